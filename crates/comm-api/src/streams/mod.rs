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
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex, Weak};

use async_trait::async_trait;
use comm_core::ops::{RecvFrom, SendTo};
use comm_core::{Backend, Collective, CommError, DType, Group, HostBuffer, Op, Rank, ReduceOp, Work};

use crate::group::fnv1a;
use crate::issuers::Issuers;
use crate::ProcessGroup;

mod driver;
mod wire;

use driver::{Driver, Event, Undecided};
use wire::{OpKey, COLL, P2P};

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
        let _ = self.shared.tx.send(Event::Post { key, sig: fnv1a(&what), op: Box::new(Undecided { req, done }) });
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
