//! Streams: independent ordering domains over one group, so that several tasks can each issue
//! their own ops without pairing up with another task's ops on another rank.
//!
//! The first few keys ([`StreamsOptions::direct`]) are *direct* streams: each is a sub-group
//! of all the ranks, made when the streams are, so its ops pair in its own order by
//! construction and cost what any group's do. The rest are *arbitrated*, as follows, and cost
//! no resources of their own.
//!
//! A [`Streams`] owns two sub-groups of all the parent's ranks: `data`, where every stream's ops
//! run, and `control`, which carries the arbitration. Each op is named by its stream, its
//! *channel* (the stream's collectives, or its messages from `src` to `dst`) and its number in
//! that channel, which every rank computes alike. Rank 0 of the group (the *arbiter*) learns
//! which ops each rank has issued (the others send it a frame per batch) and decides the order:
//! an op is decided once every rank it involves has issued it and it is the oldest undecided
//! op of its channel on each of them; the decisions go to the ranks involved, and every rank
//! submits its decided ops to `data` in the order decided. So every rank runs the same
//! sequence (restricted to its own ops): a stream's collectives in its order, its messages
//! between two ranks in theirs (as a communicator orders them), whatever order the tasks
//! issued them in.
//!
//! It cannot deadlock: an op that every rank it involves has issued, and whose channel's
//! earlier ops are decided, is decided at the arbiter's next turn, whatever other channels
//! hold; an op never waits for another stream, nor a message for a collective. An op whose peers do not issue it within
//! `COMM_TIMEOUT` fails (`Timeout`, naming the stream and the rank that is missing), and
//! with it the stream; ranks that issued different ops under the same name get `Mismatch`.
//! Every frame is bounded (4 KiB) and checked; when nothing happens the ranks exchange an empty
//! frame every quarter of the timeout, so the standing receives never time out and a lost
//! rank is noticed.

use std::any::Any;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use comm_core::ops::{RecvFrom, SendTo};
use comm_core::{Backend, Collective, CommError, Completer, DType, Group, HostBuffer, Op, Rank, ReduceOp, Work};

use crate::group::fnv1a;
use crate::issuers::Issuers;
use crate::ProcessGroup;

const FRAME: usize = 4096;
const MAGIC: u32 = u32::from_le_bytes(*b"cstr");
/// A rank's last frame to a peer: it sends and listens no more.
const BYE: u32 = u32::from_le_bytes(*b"cbye");
const ENTRY: usize = 48;
/// How long a rank's driver waits for something to do before it listens again to a peer it
/// owes nothing.
const LISTEN_IDLE: Duration = Duration::from_micros(100);
const PER_FRAME: usize = (FRAME - 8) / ENTRY;

const COLL: u8 = 0;
const P2P: u8 = 1;

/// What a frame entry says of an op: issued (to the arbiter), or its verdict (from it).
const POSTED: u8 = 0;
const RUN: u8 = 1;
const MISMATCH: u8 = 2;
const TIMEOUT: u8 = 3;
/// The stream failed earlier (`sig`: that failure's code, `a`/`b`: its ranks).
const DEAD: u8 = 4;

/// Every rank's name for one op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct OpKey {
    stream: u64,
    class: u8,
    src: u32,
    dst: u32,
    n: u64,
}

impl OpKey {
    fn involves(&self, world: u32) -> Vec<u32> {
        match self.class {
            COLL => (0..world).collect(),
            _ => vec![self.src, self.dst],
        }
    }

    /// The sequence this op is numbered in: a stream's collectives, or its messages from
    /// `src` to `dst`. Each is ordered on its own, as a communicator orders its collectives
    /// and the messages between two ranks, and independently of the others.
    fn channel(&self) -> OpKey {
        OpKey { n: 0, ..*self }
    }

    fn describe(&self) -> String {
        match self.class {
            COLL => format!("collective #{}", self.n),
            _ => format!("message #{} from rank {} to rank {}", self.n, self.src, self.dst),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    key: OpKey,
    code: u8,
    /// POSTED: the op's signature; DEAD: the code of the stream's failure.
    sig: u64,
    a: u32,
    b: u32,
}

fn encode(entries: &[Entry]) -> Vec<HostBuffer> {
    let chunks: Vec<&[Entry]> = if entries.is_empty() { vec![&[]] } else { entries.chunks(PER_FRAME).collect() };
    chunks
        .into_iter()
        .map(|chunk| {
            let mut buf = HostBuffer::zeroed(DType::U8, FRAME);
            let b = buf.as_bytes_mut();
            b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
            b[4..8].copy_from_slice(&(chunk.len() as u32).to_le_bytes());
            for (e, out) in chunk.iter().zip(b[8..].chunks_exact_mut(ENTRY)) {
                out[0..8].copy_from_slice(&e.key.stream.to_le_bytes());
                out[8..16].copy_from_slice(&e.key.n.to_le_bytes());
                out[16..24].copy_from_slice(&e.sig.to_le_bytes());
                out[24..28].copy_from_slice(&e.key.src.to_le_bytes());
                out[28..32].copy_from_slice(&e.key.dst.to_le_bytes());
                out[32..34].copy_from_slice(&[e.key.class, e.code]);
                out[36..40].copy_from_slice(&e.a.to_le_bytes());
                out[40..44].copy_from_slice(&e.b.to_le_bytes());
            }
            buf
        })
        .collect()
}

fn bye() -> HostBuffer {
    let mut buf = HostBuffer::zeroed(DType::U8, FRAME);
    buf.as_bytes_mut()[0..4].copy_from_slice(&BYE.to_le_bytes());
    buf
}

/// A peer's frame, checked: everything in it is bounded by `world` before it is used. `None`:
/// the peer's goodbye.
fn decode(buf: &HostBuffer, world: u32) -> Result<Option<Vec<Entry>>, String> {
    let b = buf.as_bytes();
    let word = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
    let long = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    if b.len() == FRAME && word(0) == BYE {
        return Ok(None);
    }
    if b.len() != FRAME || word(0) != MAGIC {
        return Err("not a stream frame".into());
    }
    let count = word(4) as usize;
    if count > PER_FRAME {
        return Err(format!("{count} entries (at most {PER_FRAME})"));
    }
    (0..count)
        .map(|i| {
            let at = 8 + i * ENTRY;
            let key =
                OpKey { stream: long(at), n: long(at + 8), src: word(at + 24), dst: word(at + 28), class: b[at + 32] };
            let e = Entry { key, code: b[at + 33], sig: long(at + 16), a: word(at + 36), b: word(at + 40) };
            let ranks_ok = key.class == COLL || (key.src < world && key.dst < world && key.src != key.dst);
            let ok = key.class <= P2P && e.code <= DEAD && ranks_ok && e.a < world.max(1) && e.b < world.max(1);
            ok.then_some(e).ok_or_else(|| format!("entry {i} is malformed"))
        })
        .collect::<Result<_, _>>()
        .map(Some)
}

/// Why a stream failed.
#[derive(Clone, Copy, Debug)]
struct Failure {
    code: u8,
    key: OpKey,
    a: u32,
    b: u32,
}

impl Failure {
    fn detail(&self) -> String {
        let what = self.key.describe();
        match self.code {
            MISMATCH => format!(
                "ranks {} and {} issued different ops (op, dtype, size or tag) as {what} of stream {}",
                self.a, self.b, self.key.stream
            ),
            _ => format!("rank {} did not issue {what} of stream {}", self.a, self.key.stream),
        }
    }

    /// The error of the op that failed the stream (`first`) or of a later op of it.
    fn error(&self, op: &'static str, timeout: Duration, first: bool) -> CommError {
        let detail = self.detail();
        match self.code {
            _ if !first => CommError::Poisoned { cause: format!("stream {} failed: {detail}", self.key.stream) },
            MISMATCH => CommError::mismatch(op, detail + "; the stream is failed"),
            _ => CommError::timeout(
                format!("{op} on stream {}", self.key.stream),
                timeout,
                detail + "; the stream is failed, other streams go on",
            ),
        }
    }
}

/// Why the streams broke: said to every op, and whether the control group timed out (a
/// waiting op then fails with `Timeout`).
struct Broken {
    why: String,
    timed_out: bool,
}

impl Broken {
    /// The control group failed with `e`.
    fn control(e: CommError) -> Broken {
        let timed_out = matches!(e, CommError::Timeout { .. });
        Broken { why: format!("the streams' control group failed: {e}"), timed_out }
    }
}

impl From<String> for Broken {
    fn from(why: String) -> Broken {
        Broken { why, timed_out: false }
    }
}

/// An op waiting for its turn, whatever its request type.
trait Deferred: Send {
    fn run(self: Box<Self>, data: &Arc<dyn Backend>);
    fn fail(self: Box<Self>, error: &dyn Fn(&'static str) -> CommError);
}

struct Held<R: Op> {
    req: R,
    done: Completer<R::Output>,
}

impl<R: Op> Deferred for Held<R>
where
    dyn Backend: Collective<R>,
{
    fn run(self: Box<Self>, data: &Arc<dyn Backend>) {
        let Held { req, done } = *self;
        Collective::<R>::submit(&**data, req).forward(done);
    }

    fn fail(self: Box<Self>, error: &dyn Fn(&'static str) -> CommError) {
        self.done.complete(Err(error(R::NAME)));
    }
}

enum Event {
    Post {
        key: OpKey,
        sig: u64,
        op: Box<dyn Deferred>,
    },
    /// The standing receive from this peer completed.
    Frame(u32),
    /// End this rank's streams (at most the timeout): the others say goodbye to rank 0 and
    /// wait for its answer; rank 0 answers each and ends once all did. Completes the
    /// completer, if any, when done.
    Stop(Option<Completer<()>>),
}

/// Independent ordering domains over the ranks of a group: see [`ProcessGroup::streams`].
/// Cheap to clone; the streams live until the last clone and the last stream are dropped.
#[derive(Clone)]
pub struct Streams {
    shared: Arc<Shared>,
}

struct Shared {
    data: Arc<dyn Backend>,
    /// The direct streams' groups (keys `0..direct.len()`), each with its issuers.
    direct: Vec<(Arc<dyn Backend>, Arc<Issuers>)>,
    tx: Sender<Event>,
    /// The live stream of each key, so that `stream(key)` twice shares one numbering.
    registry: Mutex<HashMap<u64, Weak<StreamBackend>>>,
    parent: ProcessGroup,
    broken: Arc<Mutex<Option<String>>>,
}

/// Without [`Streams::shutdown`], the driver says goodbye when the last handle goes and ends
/// once the peers said theirs (or after the timeout).
impl Drop for Shared {
    fn drop(&mut self) {
        let _ = self.tx.send(Event::Stop(None));
    }
}

impl std::fmt::Debug for Streams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streams").field("group", &self.shared.parent).finish()
    }
}

impl ProcessGroup {
    /// Independent ordering domains over this group's ranks, for a service whose tasks each
    /// issue their own ops. Collective (like [`new_group`](ProcessGroup::new_group): every
    /// rank calls it, in the same order relative to other collectives); then
    /// [`Streams::stream`] is local and cheap.
    ///
    /// Ops on different streams never pair with each other, whatever order the tasks issued
    /// them in on each rank; ops of one stream pair in that stream's order. The first
    /// [`StreamsOptions::direct`] keys (2 by default, `COMM_STREAMS_DIRECT`) are *direct*
    /// streams: each a sub-group of all the ranks made now, so their ops cost what the group's
    /// do. The other keys share two more sub-groups, and rank 0 decides the order in which
    /// every rank runs their ops (module docs: `comm_api::streams`), which costs each op a
    /// message to rank 0 and one back; their `backend_name()` is the group's with `-stream`
    /// (`"shm-stream"`).
    ///
    /// ```
    /// # use comm_api::{ProcessGroup, HostBuffer, ReduceOp, WorldInfo};
    /// # let pg = ProcessGroup::from_backend(comm_test::LocalWorld::new(1).remove(0), WorldInfo::single());
    /// # futures::executor::block_on(async {
    /// let streams = pg.streams().await?;
    /// let mut handlers = Vec::new();
    /// for request in 0..4u64 {
    ///     let stream = streams.stream(request); // the same key on every rank
    ///     handlers.push(std::thread::spawn(move || stream.all_reduce(HostBuffer::from_slice(&[1.0f32]), ReduceOp::Sum).wait()));
    /// }
    /// for h in handlers {
    ///     assert_eq!(h.join().unwrap()?.to_vec::<f32>()?, [pg.world_size() as f32]);
    /// }
    /// streams.shutdown().await?;
    /// # Ok::<(), comm_api::CommError>(()) }).unwrap();
    /// ```
    pub async fn streams(&self) -> Result<Streams, CommError> {
        self.make_streams(StreamsOptions::from_env()).await
    }

    /// [`streams`](ProcessGroup::streams) with `opts` instead of the environment's. Every rank
    /// must give the same options (checked: else `InvalidArgument` on every rank).
    pub async fn streams_with(&self, opts: StreamsOptions) -> Result<Streams, CommError> {
        self.make_streams(Ok(opts)).await
    }

    async fn make_streams(&self, opts: Result<StreamsOptions, CommError>) -> Result<Streams, CommError> {
        // Every rank takes part in the check, one with bad options too (as one count past the
        // bound), so that no rank waits for another that gave up; one all_reduce tells every
        // rank the largest and the smallest count.
        let max = StreamsOptions::DIRECT_MAX as i64;
        let asked = opts.as_ref().map_or(max + 1, |o| i64::try_from(o.direct).map_or(max + 1, |d| d.min(max + 1)));
        let counts = HostBuffer::from_slice(&[asked, -asked]);
        let agreed = self.all_reduce(counts, comm_core::ReduceOp::Max).await?.to_vec::<i64>()?;
        let direct = opts?.direct;
        let (most, least) = (agreed[0], -agreed[1]);
        if most > max {
            return Err(CommError::invalid(
                "streams",
                format!("a rank asks for more than {max} direct streams (or cannot read COMM_STREAMS_DIRECT)"),
            ));
        }
        if most != least {
            return Err(CommError::invalid(
                "streams",
                format!("ranks ask for between {least} and {most} direct streams: give every rank the same"),
            ));
        }
        let all: Vec<Rank> = (0..self.world_size()).collect();
        let member = |g: Option<Arc<dyn Backend>>| g.ok_or_else(|| CommError::invalid("streams", "not a member"));
        let data = member(self.backend().new_group(&all).await?)?;
        let control = member(self.backend().new_group(&all).await?)?;
        let mut direct_groups = Vec::with_capacity(direct);
        for _ in 0..direct {
            direct_groups.push((member(self.backend().new_group(&all).await?)?, Arc::default()));
        }
        let (tx, rx) = mpsc::channel();
        let broken = Arc::new(Mutex::new(None));
        let timeout = self.timeout();
        let driver = Driver::new(data.clone(), control, tx.clone(), timeout, broken.clone());
        std::thread::Builder::new()
            .name("comm-streams".into())
            .spawn(move || driver.run(rx))
            .map_err(|e| CommError::io("starting the streams thread", e))?;
        let shared =
            Shared { data, direct: direct_groups, tx, registry: Mutex::default(), parent: self.clone(), broken };
        Ok(Streams { shared: Arc::new(shared) })
    }
}

/// How [`ProcessGroup::streams_with`] sets streams up.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StreamsOptions {
    /// How many streams (keys `0..direct`) get a group of their own, created with the
    /// streams: their ops cost what the group's cost. Each is one more group's resources
    /// (with shm: its segments, `2 × window + 2 × world × slot` per rank, and a worker
    /// thread), so the default is [`DIRECT_DEFAULT`](Self::DIRECT_DEFAULT);
    /// `COMM_STREAMS_DIRECT` sets it. Streams with other keys cost no resources of their own
    /// (use them for many short-lived streams, e.g. one per request).
    pub direct: usize,
}

impl StreamsOptions {
    /// Direct streams by default.
    pub const DIRECT_DEFAULT: usize = 2;
    /// At most this many direct streams.
    pub const DIRECT_MAX: usize = 64;

    /// These options with `n` direct streams.
    pub fn direct(mut self, n: usize) -> StreamsOptions {
        self.direct = n;
        self
    }

    /// The defaults, with `COMM_STREAMS_DIRECT` read.
    pub fn from_env() -> Result<StreamsOptions, CommError> {
        let direct = comm_core::config::env_parse("COMM_STREAMS_DIRECT", |s| {
            s.trim().parse::<usize>().map_err(|e| format!("expected a number of streams: {e}"))
        })?;
        Ok(StreamsOptions { direct: direct.unwrap_or(Self::DIRECT_DEFAULT) })
    }
}

impl Default for StreamsOptions {
    fn default() -> Self {
        StreamsOptions { direct: Self::DIRECT_DEFAULT }
    }
}

impl Streams {
    /// Ends every stream on this rank once the other ranks call it too (or after the
    /// timeout): ops not yet run fail with `Shutdown`, and so do later ones. Collective, like
    /// [`ProcessGroup::shutdown`]; dropping every handle does the same without waiting.
    pub async fn shutdown(&self) -> Result<(), CommError> {
        let (done, work) = Work::pending();
        let arbitrated = match self.shared.tx.send(Event::Stop(Some(done))) {
            Err(_) => Ok(()),
            Ok(()) => match work.await {
                Err(CommError::Shutdown(_)) => Ok(()),
                other => other,
            },
        };
        for (group, _) in &self.shared.direct {
            group.shutdown().await?;
        }
        arbitrated
    }

    /// How many direct streams there are (keys `0..direct()`).
    pub fn direct(&self) -> usize {
        self.shared.direct.len()
    }

    /// The stream named `key` (the same key on every rank names the same stream): a group of
    /// the same ranks whose ops are ordered only among themselves. Local, no communication.
    /// While a handle of `key` lives, `stream(key)` returns one sharing its numbering; once
    /// all are dropped the next one starts a new stream (every rank must then do the same).
    ///
    /// Keys below [`StreamsOptions::direct`] name *direct* streams: each is a group of its own,
    /// as fast as the group itself (its `backend_name()` is the group's); the others share
    /// one group, in the order rank 0 decides.
    pub fn stream(&self, key: u64) -> ProcessGroup {
        if let Some((group, issuers)) = usize::try_from(key).ok().and_then(|k| self.shared.direct.get(k)) {
            return self.shared.parent.over(group.clone(), issuers.clone());
        }
        let mut registry = self.shared.registry.lock().unwrap_or_else(|p| p.into_inner());
        let backend = match registry.get(&key).and_then(Weak::upgrade) {
            Some(live) => live,
            None => {
                let live = Arc::new(StreamBackend {
                    key,
                    shared: self.shared.clone(),
                    counters: Mutex::default(),
                    issuers: Arc::default(),
                    closed: AtomicBool::new(false),
                });
                registry.insert(key, Arc::downgrade(&live));
                live
            }
        };
        let issuers = backend.issuers.clone();
        self.shared.parent.over(backend, issuers)
    }
}

#[derive(Default)]
struct Counters {
    collectives: u64,
    sent: HashMap<u32, u64>,
    received: HashMap<u32, u64>,
}

struct StreamBackend {
    key: u64,
    shared: Arc<Shared>,
    counters: Mutex<Counters>,
    issuers: Arc<Issuers>,
    closed: AtomicBool,
}

impl Drop for StreamBackend {
    fn drop(&mut self) {
        let mut registry = self.shared.registry.lock().unwrap_or_else(|p| p.into_inner());
        if registry.get(&self.key).is_some_and(|w| std::ptr::eq(w.as_ptr(), self)) {
            registry.remove(&self.key);
        }
    }
}

impl StreamBackend {
    fn post<R: Op>(&self, req: R) -> Work<R::Output>
    where
        dyn Backend: Collective<R>,
    {
        let data = &self.shared.data;
        let (rank, world) = (data.rank(), data.world_size());
        if let Err(e) = req.validate(rank, world) {
            return Work::ready(Err(e));
        }
        if let Some(cause) = self.shared.broken.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            return Work::ready(Err(CommError::Poisoned { cause: format!("stream {}: {cause}", self.key) }));
        }
        if self.closed.load(SeqCst) {
            return Work::ready(Err(CommError::Shutdown(format!("stream {} was shut down", self.key))));
        }
        let any: &dyn Any = &req;
        let p2p = match (any.downcast_ref::<SendTo>(), any.downcast_ref::<RecvFrom>()) {
            (Some(s), _) => Some((rank, s.dst, s.tag, true)),
            (_, Some(r)) => Some((r.src, rank, r.tag, false)),
            _ => None,
        };
        if p2p.is_some_and(|(src, dst, ..)| src == dst) {
            return Work::ready(Err(CommError::invalid(R::NAME, "a stream carries no message from a rank to itself")));
        }
        let dtype = req.dtype().map_or(u8::MAX, DType::code);
        let mut counters = self.counters.lock().unwrap_or_else(|p| p.into_inner());
        let next = |n: &mut u64| std::mem::replace(n, *n + 1);
        let (key, tag) = match p2p {
            None => (OpKey { stream: self.key, class: COLL, src: 0, dst: 0, n: next(&mut counters.collectives) }, 0),
            Some((src, dst, tag, send)) => {
                let n = if send { counters.sent.entry(dst) } else { counters.received.entry(src) };
                (OpKey { stream: self.key, class: P2P, src, dst, n: next(n.or_default()) }, tag)
            }
        };
        // What both sides of an op must agree on: a send and its receive differ only in name.
        let mut what = Vec::with_capacity(R::NAME.len() + 18);
        what.extend_from_slice(if p2p.is_some() { b"message" } else { R::NAME.as_bytes() });
        what.push(dtype);
        what.extend_from_slice(&(req.bytes() as u64).to_le_bytes());
        what.extend_from_slice(&tag.to_le_bytes());
        what.extend_from_slice(&req.root().unwrap_or(Rank::MAX).to_le_bytes());
        what.push(req.reduce_op().map_or(u8::MAX, ReduceOp::code));
        let (done, work) = Work::pending();
        // Sent while the counters are held, so that the driver gets a stream's ops in order.
        // Without a driver the op is dropped, which completes it with `Shutdown`.
        let _ = self.shared.tx.send(Event::Post { key, sig: fnv1a(&what), op: Box::new(Held { req, done }) });
        drop(counters);
        work
    }
}

impl<R: Op> Collective<R> for StreamBackend
where
    dyn Backend: Collective<R>,
{
    fn submit(&self, req: R) -> Work<R::Output> {
        self.post(req)
    }
}

#[async_trait]
impl Group for StreamBackend {
    fn rank(&self) -> Rank {
        self.shared.data.rank()
    }

    fn world_size(&self) -> u32 {
        self.shared.data.world_size()
    }

    /// The group's backend name with `-stream` (`"shm-stream"`), so reports tell them apart.
    fn backend_name(&self) -> &'static str {
        match self.shared.data.backend_name() {
            "shm" => "shm-stream",
            "mpi" => "mpi-stream",
            "hier" => "hier-stream",
            "nccl" => "nccl-stream",
            "local" => "local-stream",
            _ => "stream",
        }
    }

    async fn new_group(&self, _: &[Rank]) -> Result<Option<Arc<dyn Backend>>, CommError> {
        Err(CommError::invalid(
            "new_group",
            "a stream has no sub-groups: create them on the group, and streams on them",
        ))
    }

    /// Later ops on this stream fail with `Shutdown`; the others go on.
    async fn shutdown(&self) -> Result<(), CommError> {
        self.closed.store(true, SeqCst);
        Ok(())
    }

    fn alloc_buffer(&self, dtype: DType, len: usize) -> Result<HostBuffer, CommError> {
        self.shared.data.alloc_buffer(dtype, len)
    }

    fn abort(&self, cause: &str) {
        self.shared.data.abort(cause)
    }
}

/// What rank 0 knows of an undecided op.
struct Known {
    /// Each rank's signature of it, once that rank issued it.
    sigs: Vec<Option<u64>>,
    first: Instant,
    at: u64,
}

/// Rank 0's view: every undecided op, in the order it first heard of them.
#[derive(Default)]
struct Arbiter {
    known: HashMap<OpKey, Known>,
    order: BTreeMap<u64, OpKey>,
    next: u64,
    /// Each rank's undecided ops of each channel, in the order it issued them.
    queues: HashMap<(u32, OpKey), VecDeque<OpKey>>,
}

/// The thread that runs the arbitration on every rank (and the arbiter on rank 0).
struct Driver {
    rank: u32,
    world: u32,
    data: Arc<dyn Backend>,
    control: Arc<dyn Backend>,
    tx: Sender<Event>,
    timeout: Duration,
    broken: Arc<Mutex<Option<String>>>,
    /// This rank's ops waiting for their verdict.
    mine: HashMap<OpKey, Box<dyn Deferred>>,
    /// Ops decided this turn, in order: run once the turn's frames are out, so that no peer
    /// waits for its verdict while this rank's op waits for the peer.
    decided: Vec<Box<dyn Deferred>>,
    /// Streams that failed, and why.
    dead: HashMap<u64, Failure>,
    /// The standing receive from each peer this rank hears from.
    recvs: Vec<Option<Work<HostBuffer>>>,
    /// Entries to send to each peer, and when it was last sent one.
    outbox: Vec<Vec<Entry>>,
    last_sent: Vec<Instant>,
    /// Goodbyes sent to and received from each peer: a pair that exchanged both sends and
    /// listens no more, so nothing is left pending on `control`.
    bye_sent: Vec<bool>,
    gone: Vec<bool>,
    /// The goodbyes on their way: waited for before the thread ends (and `shutdown`
    /// returns), so that a process that exits next has sent them.
    byes: Vec<Work<HostBuffer>>,
    /// Since when this rank is ending its streams, and who waits for it.
    stopping: Option<(Instant, Vec<Completer<()>>)>,
    /// Peers whose frame this turn took: listened to again once the turn's verdicts and ops
    /// are out, since posting a receive may hold this thread for the backend's spin budget.
    relisten: Vec<u32>,
    arbiter: Option<Arbiter>,
}

impl Driver {
    fn new(
        data: Arc<dyn Backend>,
        control: Arc<dyn Backend>,
        tx: Sender<Event>,
        timeout: Duration,
        broken: Arc<Mutex<Option<String>>>,
    ) -> Driver {
        let (rank, world) = (data.rank(), data.world_size());
        let n = world as usize;
        Driver {
            rank,
            world,
            data,
            control,
            tx,
            timeout,
            broken,
            mine: HashMap::new(),
            decided: Vec::new(),
            dead: HashMap::new(),
            recvs: (0..n).map(|_| None).collect(),
            outbox: vec![Vec::new(); n],
            last_sent: vec![Instant::now(); n],
            bye_sent: vec![false; n],
            gone: vec![false; n],
            byes: Vec::new(),
            stopping: None,
            relisten: Vec::new(),
            arbiter: (rank == 0).then(Arbiter::default),
        }
    }

    /// The peers this rank exchanges frames with: the arbiter everyone, the others it.
    fn partners(&self) -> Vec<u32> {
        if self.rank == 0 {
            (1..self.world).collect()
        } else {
            vec![0]
        }
    }

    /// The partners this rank has not said goodbye to.
    fn peers(&self) -> Vec<u32> {
        self.partners().into_iter().filter(|&p| !self.bye_sent[p as usize]).collect()
    }

    fn keepalive(&self) -> Duration {
        (self.timeout / 4).max(Duration::from_millis(1))
    }

    fn run(mut self, rx: Receiver<Event>) {
        for p in self.peers() {
            self.listen(p);
        }
        // Peers to listen to again once this rank has nothing else to do (see below), and
        // since when.
        let mut deferred: Vec<(u32, Instant)> = Vec::new();
        loop {
            let mut wait = self.next_deadline().saturating_duration_since(Instant::now());
            if !deferred.is_empty() {
                wait = wait.min(LISTEN_IDLE);
            }
            let first = match rx.recv_timeout(wait) {
                Ok(ev) => Some(ev),
                Err(RecvTimeoutError::Timeout) => {
                    for (p, _) in std::mem::take(&mut deferred) {
                        self.listen(p);
                    }
                    None
                }
                Err(RecvTimeoutError::Disconnected) => return,
            };
            // Everything that arrived meanwhile in one turn: one frame per peer per batch.
            for ev in first.into_iter().chain(std::iter::from_fn(|| rx.try_recv().ok())) {
                if let Err(why) = self.handle(ev) {
                    self.fail_all(why);
                    return self.end();
                }
            }
            let turn_at = Instant::now();
            if let Err(why) = self.turn() {
                self.fail_all(why);
                return self.end();
            }
            // Posting a receive may hold this thread for the backend's spin budget. A peer
            // this turn sent a frame to owes this rank the next frame (a verdict, or its next
            // ops after one): listen now, and that wait is for it. Any other peer is listened
            // to once nothing happens for a moment (or, if this rank stays busy, after that
            // moment anyway), so that this thread does not sit in a receive while its own
            // tasks' new ops wait for it.
            deferred.extend(std::mem::take(&mut self.relisten).into_iter().map(|p| (p, turn_at)));
            let (now, later): (Vec<_>, Vec<_>) = deferred
                .drain(..)
                .partition(|&(p, since)| self.last_sent[p as usize] >= turn_at || since.elapsed() >= LISTEN_IDLE);
            deferred = later;
            for (p, _) in now {
                self.listen(p);
            }
            let partners = self.partners();
            let all_gone = partners.iter().all(|&p| self.gone[p as usize]);
            match &self.stopping {
                Some((since, _)) if all_gone || since.elapsed() >= self.timeout => return self.end(),
                // The others ended theirs: so does this rank (later ops fail with `Shutdown`).
                None if all_gone && !partners.is_empty() => return self.end(),
                _ => {}
            }
        }
    }

    /// Ends the thread: waiting ops fail with `Shutdown`, `Streams::shutdown` returns.
    fn end(mut self) {
        for op in self.mine.drain().map(|(_, op)| op).chain(self.decided.drain(..)) {
            op.fail(&|_| CommError::Shutdown("the streams were shut down".into()));
        }
        // A peer that is gone fails the send (within the backend's timeout): nothing to add.
        for bye in self.byes.drain(..) {
            let _ = bye.wait();
        }
        for done in self.stopping.take().map(|(_, w)| w).unwrap_or_default() {
            done.complete(Ok(()));
        }
    }

    /// Says goodbye to `peer` (once): nothing is sent to it after this.
    fn say_bye(&mut self, peer: u32) {
        if !std::mem::replace(&mut self.bye_sent[peer as usize], true) {
            self.byes.push(Collective::<SendTo>::submit(&*self.control, SendTo { buf: bye(), dst: peer, tag: 0 }));
        }
    }

    fn next_deadline(&self) -> Instant {
        let keepalive = self.peers().iter().map(|&p| self.last_sent[p as usize] + self.keepalive()).min();
        let oldest =
            self.arbiter.as_ref().and_then(|a| a.order.values().next().map(|k| a.known[k].first + self.timeout));
        keepalive.into_iter().chain(oldest).min().unwrap_or_else(|| Instant::now() + self.keepalive())
    }

    /// Handles one event; `Err(why)` when the streams are broken.
    fn handle(&mut self, ev: Event) -> Result<(), Broken> {
        match ev {
            Event::Stop(done) => {
                let (_, waiting) = self.stopping.get_or_insert_with(|| (Instant::now(), Vec::new()));
                waiting.extend(done);
                for (_, op) in self.mine.drain() {
                    op.fail(&|_| CommError::Shutdown("the streams were shut down".into()));
                }
                // Rank 0 goes on deciding the others' ops (messages between two of them
                // need it) and answers each goodbye; the others leave now.
                if self.rank != 0 {
                    self.say_bye(0);
                }
                Ok(())
            }
            Event::Post { op, .. } if self.stopping.is_some() => {
                op.fail(&|_| CommError::Shutdown("the streams were shut down".into()));
                Ok(())
            }
            Event::Post { key, sig, op } => {
                if let Some(f) = self.dead.get(&key.stream).copied() {
                    op.fail(&|name| f.error(name, self.timeout, false));
                    return Ok(());
                }
                self.mine.insert(key, op);
                match self.rank {
                    0 => self.posted(0, key, sig),
                    _ => self.outbox[0].push(Entry { key, code: POSTED, sig, a: 0, b: 0 }),
                }
                Ok(())
            }
            Event::Frame(peer) => {
                let work = self.recvs[peer as usize].take().expect("a frame event follows its receive");
                let buf = work.wait().map_err(Broken::control)?;
                let entries = decode(&buf, self.world).map_err(|e| format!("rank {peer} sent a bad frame: {e}"))?;
                let Some(entries) = entries else {
                    self.gone[peer as usize] = true;
                    self.say_bye(peer);
                    return Ok(());
                };
                self.relisten.push(peer);
                for e in entries {
                    match (self.rank, e.code) {
                        (0, POSTED) if e.key.involves(self.world).contains(&peer) => self.posted(peer, e.key, e.sig),
                        (r, code) if r != 0 && code != POSTED => self.verdict(e),
                        _ => return Err(format!("rank {peer} sent an entry out of protocol: {e:?}").into()),
                    }
                }
                Ok(())
            }
        }
    }

    fn listen(&mut self, peer: u32) {
        let tx = self.tx.clone();
        let recv = RecvFrom { buf: HostBuffer::zeroed(DType::U8, FRAME), src: peer, tag: 0 };
        let work = Collective::<RecvFrom>::submit(&*self.control, recv).on_complete(move |_| {
            let _ = tx.send(Event::Frame(peer));
        });
        self.recvs[peer as usize] = Some(work);
    }

    /// A verdict from the arbiter on one of this rank's ops.
    fn verdict(&mut self, e: Entry) {
        let failure = |code| Failure { code, key: e.key, a: e.a, b: e.b };
        match e.code {
            RUN => self.decided.extend(self.mine.remove(&e.key)),
            DEAD => {
                let f = *self.dead.entry(e.key.stream).or_insert(failure(e.sig as u8));
                if let Some(op) = self.mine.remove(&e.key) {
                    op.fail(&|name| f.error(name, self.timeout, false));
                }
            }
            code => {
                let f = failure(code);
                self.dead.insert(e.key.stream, f);
                if let Some(op) = self.mine.remove(&e.key) {
                    op.fail(&|name| f.error(name, self.timeout, true));
                }
            }
        }
    }

    /// Rank 0: `from` issued `key`.
    fn posted(&mut self, from: u32, key: OpKey, sig: u64) {
        if let Some(f) = self.dead.get(&key.stream).copied() {
            let e = Entry { key, code: DEAD, sig: u64::from(f.code), a: f.a, b: f.b };
            return self.deliver(from, e);
        }
        let world = self.world as usize;
        let a = self.arbiter.as_mut().expect("rank 0 arbitrates");
        let at = a.next;
        let known = a.known.entry(key).or_insert_with(|| Known { sigs: vec![None; world], first: Instant::now(), at });
        if known.at == at {
            a.order.insert(at, key);
            a.next += 1;
        }
        known.sigs[from as usize] = Some(sig);
        a.queues.entry((from, key.channel())).or_default().push_back(key);
    }

    /// Rank 0: decides every op it can, fails those that waited too long, then sends.
    fn turn(&mut self) -> Result<(), Broken> {
        if self.arbiter.is_some() {
            self.decide();
            self.expire();
        }
        self.flush()?;
        for op in std::mem::take(&mut self.decided) {
            op.run(&self.data);
        }
        Ok(())
    }

    fn decide(&mut self) {
        let world = self.world;
        loop {
            let a = self.arbiter.as_ref().expect("rank 0 arbitrates");
            let ready = a.order.values().find_map(|key| {
                let known = &a.known[key];
                let involved = key.involves(world);
                let all_issued = involved.iter().all(|&p| known.sigs[p as usize].is_some());
                let first_of_channel =
                    involved.iter().all(|&p| a.queues.get(&(p, key.channel())).and_then(VecDeque::front) == Some(key));
                (all_issued && first_of_channel).then(|| {
                    let sig = known.sigs[involved[0] as usize];
                    let odd = involved.iter().find(|&&p| known.sigs[p as usize] != sig);
                    (*key, odd.map(|&p| (involved[0], p)))
                })
            });
            match ready {
                None => return,
                Some((key, None)) => self.settle(key, |_| RUN),
                Some((key, Some((a, b)))) => self.kill(Failure { code: MISMATCH, key, a, b }),
            }
        }
    }

    /// Rank 0: fails the ops that some rank has not issued within the timeout.
    fn expire(&mut self) {
        loop {
            let a = self.arbiter.as_ref().expect("rank 0 arbitrates");
            let Some(key) = a.order.values().next().copied() else { return };
            let known = &a.known[&key];
            if known.first.elapsed() < self.timeout {
                return;
            }
            let missing = key.involves(self.world).into_iter().find(|&p| known.sigs[p as usize].is_none()).unwrap_or(0);
            self.kill(Failure { code: TIMEOUT, key, a: missing, b: 0 });
        }
    }

    /// Rank 0: fails the stream of `f.key`: that op with `f`, its other undecided ops as dead.
    fn kill(&mut self, f: Failure) {
        self.dead.insert(f.key.stream, f);
        let a = self.arbiter.as_ref().expect("rank 0 arbitrates");
        let of_stream: Vec<OpKey> = a.order.values().filter(|k| k.stream == f.key.stream).copied().collect();
        for key in of_stream {
            self.settle(key, |key| if key == f.key { f.code } else { DEAD });
        }
    }

    /// Rank 0: sends `key`'s verdict to every rank that issued it, and forgets it.
    fn settle(&mut self, key: OpKey, code: impl Fn(OpKey) -> u8) {
        let a = self.arbiter.as_mut().expect("rank 0 arbitrates");
        let Some(known) = a.known.remove(&key) else { return };
        a.order.remove(&known.at);
        let f = self.dead.get(&key.stream).copied();
        let code = code(key);
        for (p, _) in known.sigs.iter().enumerate().filter(|(_, s)| s.is_some()) {
            let p = p as u32;
            if let Some(q) = a.queues.get_mut(&(p, key.channel())) {
                q.retain(|k| *k != key);
                if q.is_empty() {
                    a.queues.remove(&(p, key.channel()));
                }
            }
        }
        for p in known.sigs.iter().enumerate().filter(|(_, s)| s.is_some()).map(|(p, _)| p as u32) {
            let e = match (code, f) {
                (DEAD, Some(f)) => Entry { key, code, sig: u64::from(f.code), a: f.a, b: f.b },
                (_, Some(f)) => Entry { key, code, sig: 0, a: f.a, b: f.b },
                _ => Entry { key, code, sig: 0, a: 0, b: 0 },
            };
            self.deliver(p, e);
        }
    }

    fn deliver(&mut self, to: u32, e: Entry) {
        if to == self.rank {
            self.verdict(e);
        } else if !self.bye_sent[to as usize] {
            self.outbox[to as usize].push(e);
        }
    }

    /// Sends what each peer is owed, or an empty frame when it has heard nothing for a while.
    fn flush(&mut self) -> Result<(), Broken> {
        let now = Instant::now();
        for p in self.peers() {
            let p = p as usize;
            if self.outbox[p].is_empty() && now < self.last_sent[p] + self.keepalive() {
                continue;
            }
            for buf in encode(&std::mem::take(&mut self.outbox[p])) {
                let work = Collective::<SendTo>::submit(&*self.control, SendTo { buf, dst: p as u32, tag: 0 });
                if let Some(c) = work.inline_completion() {
                    if let Some(e) = c.error {
                        return Err(Broken::control(e.duplicate()));
                    }
                }
            }
            self.last_sent[p] = now;
        }
        Ok(())
    }

    /// Fails every waiting op with `why`, and every later one. An op still waiting for its
    /// turn is told which stream and op it was, and a timeout stays a `Timeout`.
    fn fail_all(&mut self, Broken { why, timed_out }: Broken) {
        tracing::warn!(target: "comm", "streams: {why}");
        *self.broken.lock().unwrap_or_else(|p| p.into_inner()) = Some(why.clone());
        let timeout = self.timeout;
        for (key, op) in self.mine.drain() {
            let what = format!("{} of stream {}", key.describe(), key.stream);
            op.fail(&|name| {
                if timed_out {
                    CommError::timeout(format!("{name} on stream {}", key.stream), timeout, format!("{what}: {why}"))
                } else {
                    CommError::Poisoned { cause: format!("{what}: {why}") }
                }
            });
        }
        for op in self.decided.drain(..) {
            op.fail(&|_| CommError::Poisoned { cause: why.clone() });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_bad_ones_are_refused() {
        let key = OpKey { stream: 7, class: P2P, src: 1, dst: 0, n: 3 };
        let entries: Vec<Entry> = (0..PER_FRAME as u64 + 5)
            .map(|i| Entry { key: OpKey { n: i, ..key }, code: RUN, sig: i * 3, a: 1, b: 0 })
            .collect();
        let frames = encode(&entries);
        assert_eq!(frames.len(), 2);
        let back: Vec<Entry> = frames.iter().flat_map(|f| decode(f, 2).unwrap().unwrap()).collect();
        assert_eq!(back, entries);
        assert!(decode(&encode(&[])[0], 2).unwrap().unwrap().is_empty());
        assert_eq!(decode(&bye(), 2), Ok(None));
        // A peer naming a rank outside the group, or a count past the frame, is refused.
        assert!(decode(&frames[0], 1).unwrap_err().contains("malformed"));
        let mut bad = frames[1].clone();
        bad.as_bytes_mut()[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode(&bad, 2).unwrap_err().contains("entries"));
        bad.as_bytes_mut()[0] ^= 1;
        assert!(decode(&bad, 2).is_err());
    }
}
