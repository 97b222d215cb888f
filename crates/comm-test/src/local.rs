//! [`LocalWorld`]: the in-process reference backend.
//!
//! Deliberately simple so it is obviously right: one mutex-protected table per world, keyed by
//! (group, per-group op sequence number). Every rank deposits its request under the next
//! sequence number of its own handle; the rank that arrives last computes every result with
//! [`reference`](mod@crate::reference) and completes every rank's [`Work`]. Point-to-point messages
//! are matched per (source, destination) pair in FIFO order, and a send completes when it is
//! matched (rendezvous semantics: the strictest a conformant program may assume).
//!
//! A watchdog thread per world fails ops whose peers do not arrive within the timeout.

use std::any::Any;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use comm_core::ops::{
    AllGather, AllReduce, AllToAll, Barrier, Broadcast, Gather, RecvFrom, Reduce, ReduceScatter, Scatter,
    SendTo as SendOp,
};
use comm_core::{Backend, Collective, CommError, Completer, DType, Group, HostBuffer, InOut, Op, Rank, ReduceOp, Work};

use crate::reference;

/// The in-process reference backend (`backend_name() == "local"`).
///
/// Its ranks are handles used from different threads or tasks of one process. Ops are eager:
/// `submit` deposits the request at once and the [`Work`] completes when the last rank of the
/// group has deposited the same op. Results are exactly [`reference`](mod@crate::reference)'s.
///
/// - Bad arguments fail with [`CommError::InvalidArgument`] from [`Op::validate`], on that rank
///   only and without depositing anything (so the group stays usable).
/// - Ranks that deposit a different op, dtype, length, root or reduce op under the same sequence
///   number, inconsistent all_to_all splits, or point-to-point messages whose tag, dtype or
///   length differ all get [`CommError::Mismatch`] naming the difference.
/// - A rank that waits for its peers longer than the timeout gets [`CommError::Timeout`] naming
///   the ranks that never arrived.
/// - After a mismatch or a timeout the group is poisoned: later ops fail fast with
///   [`CommError::Poisoned`] (sub-groups and parent groups are unaffected).
/// - [`Group::shutdown`] stops one rank's handle: its later ops fail with
///   [`CommError::Shutdown`]; ops already deposited still complete.
///
/// There is no worker thread: the rank that completes an op computes the results on its own
/// thread. So `.await` works on any executor, and [`Work::wait`] works when the ranks run on
/// different threads, but a rank blocking in `wait` on a single-threaded executor that also
/// runs its peers would wait for ever (until the timeout).
///
/// ```
/// use comm_core::{ops::AllReduce, Collective, HostBuffer, ReduceOp};
/// let ranks = comm_test::LocalWorld::new(2);
/// // Eager: both ranks' ops are issued before either is waited on.
/// let works: Vec<_> = ranks
///     .iter()
///     .map(|b| {
///         let req = AllReduce { buf: HostBuffer::from_slice(&[1i32, 2]), op: ReduceOp::Sum };
///         Collective::<AllReduce>::submit(&**b, req)
///     })
///     .collect();
/// for w in works {
///     assert_eq!(w.wait().unwrap().to_vec::<i32>().unwrap(), [2, 4]);
/// }
/// ```
#[derive(Debug)]
pub struct LocalWorld {
    _no_values: (),
}

impl LocalWorld {
    /// How long a rank waits for its peers by default.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

    /// A world of `n` ranks; element `r` of the result is rank `r`'s handle.
    ///
    /// # Panics
    /// When `n` is 0.
    // A world is only ever used through its ranks' handles, so `new` hands those out directly.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(n: u32) -> Vec<Arc<dyn Backend>> {
        Self::with_timeout(n, Self::DEFAULT_TIMEOUT)
    }

    /// A world of `n` ranks whose waits for peers fail after `timeout`.
    ///
    /// # Panics
    /// When `n` is 0.
    pub fn with_timeout(n: u32, timeout: Duration) -> Vec<Arc<dyn Backend>> {
        assert!(n > 0, "LocalWorld needs at least one rank");
        let world = Arc::new(World { state: Mutex::new(State::default()), wake: Condvar::new(), timeout });
        let handles = {
            let mut st = world.lock();
            let gid = st.add_group((0..n).collect());
            (0..n).map(|r| new_handle(&world, &mut st, gid, r, n)).collect()
        };
        let w = world.clone();
        std::thread::Builder::new()
            .name("comm-test-local-watchdog".into())
            .spawn(move || watchdog(&w))
            .expect("spawn the LocalWorld watchdog thread");
        handles
    }
}

type Payload = Box<dyn Any + Send>;
type FailFn = fn(Payload, CommError);
type FinishFn = fn(Vec<Payload>, &GroupCtx);
/// Completions to run after the lock is released (waking a waiter must not happen under it).
type Deferred = Vec<Box<dyn FnOnce()>>;

struct World {
    state: Mutex<State>,
    wake: Condvar,
    timeout: Duration,
}

impl World {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section only moves values around; a panic cannot leave it half-done.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[derive(Default)]
struct State {
    groups: HashMap<u64, GroupState>,
    next_gid: u64,
    /// Live handles of every group; the watchdog exits when it reaches 0.
    handles: usize,
    /// Whether the watchdog sleeps without a deadline (and must be woken for a new one).
    watchdog_idle: bool,
}

impl State {
    fn add_group(&mut self, members: Vec<Rank>) -> u64 {
        let gid = self.next_gid;
        self.next_gid += 1;
        let n = members.len();
        self.groups.insert(
            gid,
            GroupState {
                members,
                next_seq: vec![0; n],
                slots: BTreeMap::new(),
                p2p: HashMap::new(),
                poisoned: None,
                handles: 0,
            },
        );
        gid
    }
}

struct GroupState {
    /// World rank of each group rank, for messages.
    members: Vec<Rank>,
    /// Next collective sequence number of each rank.
    next_seq: Vec<u64>,
    slots: BTreeMap<u64, Slot>,
    /// Pending point-to-point messages per (src, dst).
    p2p: HashMap<(Rank, Rank), Channel>,
    poisoned: Option<String>,
    handles: usize,
}

impl GroupState {
    fn size(&self) -> usize {
        self.members.len()
    }

    /// "ranks [1, 3]", plus the world ranks when this is a sub-group.
    fn name_ranks(&self, ranks: &[usize]) -> String {
        let world: Vec<Rank> = ranks.iter().map(|&r| self.members[r]).collect();
        if self.members.iter().enumerate().all(|(i, &m)| m as usize == i) {
            format!("ranks {ranks:?}")
        } else {
            format!("group ranks {ranks:?} (world ranks {world:?})")
        }
    }

    /// Marks the group unusable and fails everything pending except mismatched slots (whose late
    /// arrivals must still learn about the mismatch itself).
    fn poison(&mut self, cause: &str, deferred: &mut Deferred) {
        if self.poisoned.is_none() {
            self.poisoned = Some(cause.to_owned());
        }
        let cause = self.poisoned.clone().unwrap_or_default();
        let slots = std::mem::take(&mut self.slots);
        for (seq, slot) in slots {
            if slot.failed.is_some() {
                self.slots.insert(seq, slot);
                continue;
            }
            for e in slot.entries.into_iter().flatten() {
                let err = CommError::Poisoned { cause: cause.clone() };
                deferred.push(Box::new(move || (e.fail)(e.payload, err)));
            }
        }
        for (_, ch) in self.p2p.drain() {
            for p in ch.sends {
                let err = CommError::Poisoned { cause: cause.clone() };
                deferred.push(Box::new(move || p.done.complete(Err(err))));
            }
            for p in ch.recvs {
                let err = CommError::Poisoned { cause: cause.clone() };
                deferred.push(Box::new(move || p.done.complete(Err(err))));
            }
        }
    }
}

/// One collective op (one sequence number) being assembled.
struct Slot {
    entries: Vec<Option<Entry>>,
    arrived: Vec<bool>,
    /// The mismatch every rank of this op gets, once one was found.
    failed: Option<String>,
    deadline: Instant,
    finish: FinishFn,
}

impl Slot {
    fn count(&self) -> usize {
        self.arrived.iter().filter(|&&a| a).count()
    }
}

struct Entry {
    sig: Sig,
    payload: Payload,
    fail: FailFn,
}

#[derive(Default)]
struct Channel {
    sends: VecDeque<Posted<SendOp>>,
    recvs: VecDeque<Posted<RecvFrom>>,
}

struct Posted<R: Op> {
    req: R,
    done: Completer<R::Output>,
    deadline: Instant,
}

/// What must agree across ranks for one collective.
#[derive(Clone, Debug, PartialEq)]
struct Sig {
    op: &'static str,
    dtype: Option<DType>,
    len: Option<usize>,
    root: Option<Rank>,
    reduce: Option<ReduceOp>,
    ranks: Option<Vec<Rank>>,
}

impl Sig {
    fn new(op: &'static str) -> Self {
        Sig { op, dtype: None, len: None, root: None, reduce: None, ranks: None }
    }

    fn diff(&self, a: usize, other: &Sig, b: Rank) -> Option<String> {
        fn show<T: std::fmt::Debug>(v: &Option<T>) -> String {
            v.as_ref().map_or_else(|| "nothing".to_owned(), |v| format!("{v:?}"))
        }
        if self.op != other.op {
            return Some(format!("rank {a} called {} but rank {b} called {}", self.op, other.op));
        }
        if self.dtype != other.dtype {
            return Some(format!(
                "rank {a} passed {} data but rank {b} passed {}",
                self.dtype.map_or("no".into(), |d| d.to_string()),
                other.dtype.map_or("no".into(), |d| d.to_string())
            ));
        }
        if self.len != other.len {
            return Some(format!(
                "rank {a} passed {} elements but rank {b} passed {}",
                show(&self.len),
                show(&other.len)
            ));
        }
        if self.root != other.root {
            return Some(format!(
                "rank {a} named root {} but rank {b} named root {}",
                show(&self.root),
                show(&other.root)
            ));
        }
        if self.reduce != other.reduce {
            return Some(format!(
                "rank {a} asked for reduce op {} but rank {b} for {}",
                self.reduce.map_or("none".into(), |r| r.to_string()),
                other.reduce.map_or("none".into(), |r| r.to_string())
            ));
        }
        if self.ranks != other.ranks {
            return Some(format!(
                "rank {a} listed ranks {} but rank {b} listed {}",
                show(&self.ranks),
                show(&other.ranks)
            ));
        }
        None
    }
}

/// What a finishing op may need from its group.
struct GroupCtx {
    world: Arc<World>,
    gid: u64,
}

impl GroupCtx {
    fn poison(&self, cause: &str) {
        let mut deferred = Deferred::new();
        if let Some(g) = self.world.lock().groups.get_mut(&self.gid) {
            g.poison(cause, &mut deferred);
        }
        deferred.into_iter().for_each(|d| d());
    }
}

/// A collective the local backend runs: what must agree, and how to compute every rank's result.
trait LocalOp: Op + Sized {
    fn sig(&self) -> Sig;
    /// Every rank's output, from every rank's request (index = rank).
    fn run(reqs: Vec<Self>, ctx: &GroupCtx) -> Result<Vec<Self::Output>, CommError>;
}

fn fail<R: LocalOp>(p: Payload, e: CommError) {
    if let Ok(p) = p.downcast::<(R, Completer<R::Output>)>() {
        p.1.complete(Err(e));
    }
}

fn finish<R: LocalOp>(payloads: Vec<Payload>, ctx: &GroupCtx) {
    let (reqs, dones): (Vec<R>, Vec<Completer<R::Output>>) = payloads
        .into_iter()
        .map(|p| *p.downcast::<(R, Completer<R::Output>)>().expect("matching signatures imply one op type per slot"))
        .unzip();
    match R::run(reqs, ctx) {
        Ok(outs) => dones.into_iter().zip(outs).for_each(|(d, o)| d.complete(Ok(o))),
        Err(e) => {
            if e.poisons_group() {
                ctx.poison(&e.to_string());
            }
            dones.into_iter().for_each(|d| d.complete(Err(e.duplicate())));
        }
    }
}

/// `dst` with `src`'s bytes (same dtype and length): results go into the caller's buffers.
fn fill(mut dst: HostBuffer, src: &HostBuffer) -> HostBuffer {
    dst.as_bytes_mut().copy_from_slice(src.as_bytes());
    dst
}

fn data_sig(op: &'static str, buf: &HostBuffer) -> Sig {
    Sig { dtype: Some(buf.dtype()), len: Some(buf.len()), ..Sig::new(op) }
}

impl LocalOp for AllReduce {
    fn sig(&self) -> Sig {
        Sig { reduce: Some(self.op), ..data_sig(Self::NAME, &self.buf) }
    }
    fn run(reqs: Vec<Self>, _: &GroupCtx) -> Result<Vec<HostBuffer>, CommError> {
        let out = reference::reduce(&reqs.iter().map(|r| &r.buf).collect::<Vec<_>>(), reqs[0].op);
        Ok(reqs.into_iter().map(|r| fill(r.buf, &out)).collect())
    }
}

impl LocalOp for Broadcast {
    fn sig(&self) -> Sig {
        Sig { root: Some(self.root), ..data_sig(Self::NAME, &self.buf) }
    }
    fn run(reqs: Vec<Self>, _: &GroupCtx) -> Result<Vec<HostBuffer>, CommError> {
        let data = reqs[reqs[0].root as usize].buf.clone();
        Ok(reqs.into_iter().map(|r| fill(r.buf, &data)).collect())
    }
}

impl LocalOp for Reduce {
    fn sig(&self) -> Sig {
        Sig { root: Some(self.root), reduce: Some(self.op), ..data_sig(Self::NAME, &self.buf) }
    }
    fn run(reqs: Vec<Self>, _: &GroupCtx) -> Result<Vec<HostBuffer>, CommError> {
        let out = reference::reduce(&reqs.iter().map(|r| &r.buf).collect::<Vec<_>>(), reqs[0].op);
        let root = reqs[0].root as usize;
        Ok(reqs.into_iter().enumerate().map(|(i, r)| if i == root { fill(r.buf, &out) } else { r.buf }).collect())
    }
}

impl LocalOp for AllGather {
    fn sig(&self) -> Sig {
        data_sig(Self::NAME, &self.input)
    }
    fn run(reqs: Vec<Self>, _: &GroupCtx) -> Result<Vec<InOut>, CommError> {
        let all = reference::concat(&reqs.iter().map(|r| &r.input).collect::<Vec<_>>());
        Ok(reqs
            .into_iter()
            .map(|r| InOut { output: r.output.map_or_else(|| all.clone(), |o| fill(o, &all)), input: r.input })
            .collect())
    }
}

impl LocalOp for ReduceScatter {
    fn sig(&self) -> Sig {
        Sig { reduce: Some(self.op), ..data_sig(Self::NAME, &self.input) }
    }
    fn run(reqs: Vec<Self>, _: &GroupCtx) -> Result<Vec<InOut>, CommError> {
        let blocks = reference::reduce_scatter(&reqs.iter().map(|r| &r.input).collect::<Vec<_>>(), reqs[0].op);
        Ok(reqs
            .into_iter()
            .zip(blocks)
            .map(|(r, b)| InOut { output: r.output.map_or(b.clone(), |o| fill(o, &b)), input: r.input })
            .collect())
    }
}

impl LocalOp for AllToAll {
    fn sig(&self) -> Sig {
        // Lengths may differ per rank (uneven splits); `run` checks the splits pairwise.
        Sig { dtype: Some(self.input.dtype()), ..Sig::new(Self::NAME) }
    }
    fn run(reqs: Vec<Self>, _: &GroupCtx) -> Result<Vec<InOut>, CommError> {
        let n = reqs.len();
        let splits: Vec<(Vec<usize>, Vec<usize>)> = reqs.iter().map(|r| r.splits(n as u32)).collect();
        for (i, (ins, _)) in splits.iter().enumerate() {
            for (j, (_, outs)) in splits.iter().enumerate() {
                if ins[j] != outs[i] {
                    return Err(CommError::Mismatch {
                        op: Self::NAME,
                        detail: format!(
                            "rank {i} sends {} elements to rank {j} but rank {j} expects {} from rank {i}",
                            ins[j], outs[i]
                        ),
                    });
                }
            }
        }
        let ins: Vec<Vec<usize>> = splits.into_iter().map(|s| s.0).collect();
        let outs = reference::all_to_all(&reqs.iter().map(|r| &r.input).collect::<Vec<_>>(), &ins);
        Ok(reqs
            .into_iter()
            .zip(outs)
            .map(|(r, b)| InOut { output: r.output.map_or(b.clone(), |o| fill(o, &b)), input: r.input })
            .collect())
    }
}

impl LocalOp for Scatter {
    fn sig(&self) -> Sig {
        Sig { root: Some(self.root), ..data_sig(Self::NAME, &self.output) }
    }
    fn run(reqs: Vec<Self>, _: &GroupCtx) -> Result<Vec<InOut>, CommError> {
        let root = reqs[0].root as usize;
        let input = reqs[root].input.as_ref().expect("validate makes the root pass its input");
        let blocks = reference::scatter(input, reqs.len() as u32);
        Ok(reqs
            .into_iter()
            .zip(blocks)
            .map(|(r, b)| {
                let input = r.input.unwrap_or_else(|| HostBuffer::zeroed(r.output.dtype(), 0));
                InOut { output: fill(r.output, &b), input }
            })
            .collect())
    }
}

impl LocalOp for Gather {
    fn sig(&self) -> Sig {
        Sig { root: Some(self.root), ..data_sig(Self::NAME, &self.input) }
    }
    fn run(reqs: Vec<Self>, _: &GroupCtx) -> Result<Vec<InOut>, CommError> {
        let root = reqs[0].root as usize;
        let all = reference::concat(&reqs.iter().map(|r| &r.input).collect::<Vec<_>>());
        Ok(reqs
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                let output = match (i == root, r.output) {
                    (true, Some(o)) => fill(o, &all),
                    (true, None) => all.clone(),
                    (false, o) => o.unwrap_or_else(|| HostBuffer::zeroed(r.input.dtype(), 0)),
                };
                InOut { input: r.input, output }
            })
            .collect())
    }
}

impl LocalOp for Barrier {
    fn sig(&self) -> Sig {
        Sig::new(Self::NAME)
    }
    fn run(reqs: Vec<Self>, _: &GroupCtx) -> Result<Vec<()>, CommError> {
        Ok(vec![(); reqs.len()])
    }
}

/// `new_group` as a collective of the parent group, so it is matched like any other op.
struct NewGroup {
    ranks: Vec<Rank>,
}

impl Op for NewGroup {
    type Output = Option<Arc<dyn Backend>>;
    const NAME: &'static str = "new_group";
    fn bytes(&self) -> usize {
        0
    }
    fn dtype(&self) -> Option<DType> {
        None
    }
    fn validate(&self, _: Rank, world: u32) -> Result<(), CommError> {
        if self.ranks.is_empty() {
            return Err(CommError::invalid(Self::NAME, "a group needs at least one rank"));
        }
        if let Some(&r) = self.ranks.iter().find(|&&r| r >= world) {
            return Err(CommError::invalid(
                Self::NAME,
                format!("rank {r} is out of range for a group of {world} ranks"),
            ));
        }
        if self.ranks.windows(2).any(|w| w[0] >= w[1]) {
            return Err(CommError::invalid(Self::NAME, format!("ranks {:?} are not strictly increasing", self.ranks)));
        }
        Ok(())
    }
}

impl LocalOp for NewGroup {
    fn sig(&self) -> Sig {
        Sig { ranks: Some(self.ranks.clone()), ..Sig::new(Self::NAME) }
    }
    fn run(reqs: Vec<Self>, ctx: &GroupCtx) -> Result<Vec<Self::Output>, CommError> {
        let ranks = &reqs[0].ranks;
        let mut st = ctx.world.lock();
        let parent =
            &st.groups.get(&ctx.gid).ok_or_else(|| CommError::Shutdown("the parent group is gone".into()))?.members;
        let members = ranks.iter().map(|&r| parent[r as usize]).collect();
        let gid = st.add_group(members);
        let size = ranks.len() as u32;
        Ok((0..reqs.len() as Rank)
            .map(|r| ranks.iter().position(|&m| m == r).map(|i| new_handle(&ctx.world, &mut st, gid, i as Rank, size)))
            .collect())
    }
}

fn new_handle(world: &Arc<World>, st: &mut State, gid: u64, rank: Rank, size: u32) -> Arc<dyn Backend> {
    st.handles += 1;
    if let Some(g) = st.groups.get_mut(&gid) {
        g.handles += 1;
    }
    Arc::new(LocalRank { world: world.clone(), gid, rank, size, shut: AtomicBool::new(false) })
}

/// One rank's handle on one group.
struct LocalRank {
    world: Arc<World>,
    gid: u64,
    rank: Rank,
    size: u32,
    shut: AtomicBool,
}

impl Drop for LocalRank {
    fn drop(&mut self) {
        let removed = {
            let mut st = self.world.lock();
            st.handles -= 1;
            if st.handles == 0 {
                self.world.wake.notify_all();
            }
            let last = st.groups.get_mut(&self.gid).is_some_and(|g| {
                g.handles -= 1;
                g.handles == 0
            });
            if last {
                st.groups.remove(&self.gid)
            } else {
                None
            }
        };
        // Pending completers of a group nobody holds any more complete with `Shutdown` when
        // dropped; do it outside the lock.
        drop(removed);
    }
}

/// The outcome of depositing under the lock; acted on after it is released.
enum Deposit<R: Op> {
    Fail(Completer<R::Output>, CommError),
    Waiting,
    Complete(Vec<Payload>, FinishFn),
}

impl LocalRank {
    fn precheck<R: Op>(&self, req: &R) -> Result<(), CommError> {
        if self.shut.load(Ordering::Acquire) {
            return Err(CommError::Shutdown(format!("rank {} of this local group called shutdown", self.rank)));
        }
        req.validate(self.rank, self.size)
    }

    fn collective<R: LocalOp>(&self, req: R) -> Work<R::Output> {
        if let Err(e) = self.precheck(&req) {
            return Work::ready(Err(e));
        }
        let (done, work) = Work::pending();
        let mut deferred = Deferred::new();
        let outcome = self.deposit(req, done, &mut deferred);
        deferred.into_iter().for_each(|d| d());
        match outcome {
            Deposit::Fail(done, e) => done.complete(Err(e)),
            Deposit::Waiting => {}
            Deposit::Complete(payloads, finish) => {
                finish(payloads, &GroupCtx { world: self.world.clone(), gid: self.gid })
            }
        }
        work
    }

    fn deposit<R: LocalOp>(&self, req: R, done: Completer<R::Output>, deferred: &mut Deferred) -> Deposit<R> {
        let mut st = self.world.lock();
        let idle = st.watchdog_idle;
        let Some(g) = st.groups.get_mut(&self.gid) else {
            return Deposit::Fail(done, CommError::Shutdown("the group is gone".into()));
        };
        let me = self.rank as usize;
        let n = g.size();
        let seq = g.next_seq[me];
        g.next_seq[me] += 1;

        // A late arrival at an op already known to mismatch gets the mismatch itself.
        if let Some(slot) = g.slots.get_mut(&seq) {
            if let Some(detail) = slot.failed.clone() {
                slot.arrived[me] = true;
                if slot.count() == n {
                    g.slots.remove(&seq);
                }
                return Deposit::Fail(done, CommError::Mismatch { op: R::NAME, detail });
            }
        }
        if let Some(cause) = &g.poisoned {
            return Deposit::Fail(done, CommError::Poisoned { cause: cause.clone() });
        }

        let sig = req.sig();
        let deadline = Instant::now() + self.world.timeout;
        let slot = g.slots.entry(seq).or_insert_with(|| Slot {
            entries: (0..n).map(|_| None).collect(),
            arrived: vec![false; n],
            failed: None,
            deadline,
            finish: finish::<R>,
        });
        let diff =
            slot.entries.iter().enumerate().find_map(|(r, e)| e.as_ref().map(|e| e.sig.diff(r, &sig, self.rank)));
        if let Some(Some(diff)) = diff {
            let detail = format!("op #{seq} of the group: {diff}");
            slot.failed = Some(detail.clone());
            slot.arrived[me] = true;
            for e in slot.entries.iter_mut().filter_map(Option::take) {
                let err = CommError::Mismatch { op: e.sig.op, detail: detail.clone() };
                deferred.push(Box::new(move || (e.fail)(e.payload, err)));
            }
            if slot.count() == n {
                g.slots.remove(&seq);
            }
            g.poison(&format!("ranks disagreed on an op: {detail}"), deferred);
            return Deposit::Fail(done, CommError::Mismatch { op: R::NAME, detail });
        }
        slot.entries[me] = Some(Entry { sig, payload: Box::new((req, done)), fail: fail::<R> });
        slot.arrived[me] = true;
        if slot.count() < n {
            if idle {
                self.world.wake.notify_all();
            }
            return Deposit::Waiting;
        }
        let slot = g.slots.remove(&seq).expect("slot just filled");
        Deposit::Complete(
            slot.entries.into_iter().map(|e| e.expect("every rank arrived").payload).collect(),
            slot.finish,
        )
    }

    fn send(&self, req: SendOp) -> Work<HostBuffer> {
        if let Err(e) = self.precheck(&req) {
            return Work::ready(Err(e));
        }
        let (done, work) = Work::pending();
        let posted = Posted { req, done, deadline: Instant::now() + self.world.timeout };
        self.p2p((self.rank, posted.req.dst), |ch| match ch.recvs.pop_front() {
            Some(recv) => Some((posted, recv)),
            None => {
                ch.sends.push_back(posted);
                None
            }
        });
        work
    }

    fn recv(&self, req: RecvFrom) -> Work<HostBuffer> {
        if let Err(e) = self.precheck(&req) {
            return Work::ready(Err(e));
        }
        let (done, work) = Work::pending();
        let posted = Posted { req, done, deadline: Instant::now() + self.world.timeout };
        self.p2p((posted.req.src, self.rank), |ch| match ch.sends.pop_front() {
            Some(send) => Some((send, posted)),
            None => {
                ch.recvs.push_back(posted);
                None
            }
        });
        work
    }

    /// Runs `post` on the (src, dst) channel; when it returns a matched pair, delivers it.
    fn p2p(&self, key: (Rank, Rank), post: impl FnOnce(&mut Channel) -> Option<(Posted<SendOp>, Posted<RecvFrom>)>) {
        let mut deferred = Deferred::new();
        self.p2p_locked(key, post, &mut deferred);
        deferred.into_iter().for_each(|d| d());
    }

    fn p2p_locked(
        &self,
        key: (Rank, Rank),
        post: impl FnOnce(&mut Channel) -> Option<(Posted<SendOp>, Posted<RecvFrom>)>,
        deferred: &mut Deferred,
    ) {
        let mut st = self.world.lock();
        let idle = st.watchdog_idle;
        let Some(g) = st.groups.get_mut(&self.gid) else { return };
        if let Some(cause) = g.poisoned.clone() {
            // Queue the op on a scratch channel, then fail everything on it.
            let mut scratch = Channel::default();
            let _ = post(&mut scratch);
            let mut scratch_group = HashMap::from([(key, scratch)]);
            std::mem::swap(&mut g.p2p, &mut scratch_group);
            g.poison(&cause, deferred);
            g.p2p = scratch_group;
            return;
        }
        let Some((s, r)) = post(g.p2p.entry(key).or_default()) else {
            if idle {
                self.world.wake.notify_all();
            }
            return;
        };
        let (src, dst) = key;
        let (sb, rb) = (&s.req.buf, &r.req.buf);
        if s.req.tag == r.req.tag && sb.dtype() == rb.dtype() && sb.len() == rb.len() {
            deferred.push(Box::new(move || {
                let out = fill(r.req.buf, &s.req.buf);
                r.done.complete(Ok(out));
                s.done.complete(Ok(s.req.buf));
            }));
            return;
        }
        let detail = format!(
            "send from rank {src} to rank {dst} carries tag {}, {} × {} \
             but the matching recv expects tag {}, {} × {}",
            s.req.tag,
            sb.dtype(),
            sb.len(),
            r.req.tag,
            rb.dtype(),
            rb.len()
        );
        let d = detail.clone();
        deferred.push(Box::new(move || {
            s.done.complete(Err(CommError::Mismatch { op: SendOp::NAME, detail: d.clone() }));
            r.done.complete(Err(CommError::Mismatch { op: RecvFrom::NAME, detail: d }));
        }));
        g.poison(&format!("point-to-point mismatch: {detail}"), deferred);
    }
}

/// Fails ops whose peers are late; returns when every handle of the world is gone.
fn watchdog(world: &World) {
    let mut st = world.lock();
    loop {
        if st.handles == 0 {
            return;
        }
        let now = Instant::now();
        let mut deferred = Deferred::new();
        let next = expire(&mut st, now, world.timeout, &mut deferred);
        if !deferred.is_empty() {
            drop(st);
            deferred.into_iter().for_each(|d| d());
            st = world.lock();
            continue;
        }
        st = match next {
            None => {
                st.watchdog_idle = true;
                let mut st = world.wake.wait(st).unwrap_or_else(|e| e.into_inner());
                st.watchdog_idle = false;
                st
            }
            Some(t) => {
                world.wake.wait_timeout(st, t.saturating_duration_since(now)).unwrap_or_else(|e| e.into_inner()).0
            }
        };
    }
}

/// Times out everything past its deadline; returns the earliest deadline still pending.
fn expire(st: &mut State, now: Instant, timeout: Duration, deferred: &mut Deferred) -> Option<Instant> {
    let mut next: Option<Instant> = None;
    for g in st.groups.values_mut() {
        let mut causes = Vec::new();
        let late: Vec<u64> = g.slots.iter().filter(|(_, s)| s.deadline <= now).map(|(&k, _)| k).collect();
        for seq in late {
            let slot = g.slots.remove(&seq).expect("listed above");
            if slot.failed.is_some() {
                continue; // its arrivals already got the mismatch
            }
            let missing: Vec<usize> = (0..g.size()).filter(|&r| !slot.arrived[r]).collect();
            let present: Vec<usize> = (0..g.size()).filter(|&r| slot.arrived[r]).collect();
            let op = slot.entries.iter().flatten().map(|e| e.sig.op).next().unwrap_or("op");
            let detail = format!(
                "{} never joined op #{seq} ({op}) that {} started",
                g.name_ranks(&missing),
                g.name_ranks(&present)
            );
            for e in slot.entries.into_iter().flatten() {
                let err = CommError::Timeout { op: e.sig.op.to_owned(), after: timeout, detail: detail.clone() };
                deferred.push(Box::new(move || (e.fail)(e.payload, err)));
            }
            causes.push(format!("{op} timed out: {detail}"));
        }
        for (&(src, dst), ch) in &mut g.p2p {
            while ch.sends.front().is_some_and(|p| p.deadline <= now) {
                let p = ch.sends.pop_front().expect("front exists");
                let detail = format!(
                    "rank {dst} never posted a recv for rank {src}'s send (tag {}, {} × {})",
                    p.req.tag,
                    p.req.buf.dtype(),
                    p.req.buf.len()
                );
                causes.push(format!("send timed out: {detail}"));
                let err = CommError::Timeout { op: SendOp::NAME.to_owned(), after: timeout, detail };
                deferred.push(Box::new(move || p.done.complete(Err(err))));
            }
            while ch.recvs.front().is_some_and(|p| p.deadline <= now) {
                let p = ch.recvs.pop_front().expect("front exists");
                let detail = format!(
                    "rank {src} never sent the message rank {dst} waits for (tag {}, {} × {})",
                    p.req.tag,
                    p.req.buf.dtype(),
                    p.req.buf.len()
                );
                causes.push(format!("recv timed out: {detail}"));
                let err = CommError::Timeout { op: RecvFrom::NAME.to_owned(), after: timeout, detail };
                deferred.push(Box::new(move || p.done.complete(Err(err))));
            }
        }
        if let Some(cause) = causes.first() {
            g.poison(cause, deferred);
        }
        let deadlines = g.slots.values().map(|s| s.deadline).chain(g.p2p.values().flat_map(|ch| {
            ch.sends.front().map(|p| p.deadline).into_iter().chain(ch.recvs.front().map(|p| p.deadline))
        }));
        for d in deadlines {
            next = Some(next.map_or(d, |n| n.min(d)));
        }
    }
    next
}

macro_rules! collective {
    ($($t:ty),* $(,)?) => {$(
        impl Collective<$t> for LocalRank {
            fn submit(&self, req: $t) -> Work<<$t as Op>::Output> {
                self.collective(req)
            }
        }
    )*};
}
collective!(AllReduce, Broadcast, Reduce, AllGather, ReduceScatter, AllToAll, Scatter, Gather, Barrier);

impl Collective<SendOp> for LocalRank {
    fn submit(&self, req: SendOp) -> Work<HostBuffer> {
        self.send(req)
    }
}

impl Collective<RecvFrom> for LocalRank {
    fn submit(&self, req: RecvFrom) -> Work<HostBuffer> {
        self.recv(req)
    }
}

#[async_trait]
impl Group for LocalRank {
    fn rank(&self) -> Rank {
        self.rank
    }
    fn world_size(&self) -> u32 {
        self.size
    }
    fn backend_name(&self) -> &'static str {
        "local"
    }
    async fn new_group(&self, ranks: &[Rank]) -> Result<Option<Arc<dyn Backend>>, CommError> {
        self.collective(NewGroup { ranks: ranks.to_vec() }).await
    }
    async fn shutdown(&self) -> Result<(), CommError> {
        self.shut.store(true, Ordering::Release);
        Ok(())
    }
}
