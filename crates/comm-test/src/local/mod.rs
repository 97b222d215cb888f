//! [`LocalWorld`]: the in-process reference backend.
//!
//! Deliberately simple so it is obviously right: one mutex-protected table per world, keyed by
//! (group, per-group op sequence number). Every rank deposits its request under the next sequence
//! number of its own handle; the rank that arrives last computes every result with
//! [`reference`](mod@crate::reference) and completes every rank's [`Work`](comm_core::Work).
//! Point-to-point messages are matched per (source, destination) pair in FIFO order, and a send
//! completes when it is matched (rendezvous semantics: the strictest a conformant program may
//! assume).
//!
//! A watchdog thread per world fails ops whose peers do not arrive within the timeout.

use std::any::Any;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use comm_core::ops::{RecvFrom, SendTo as SendOp};
use comm_core::{Backend, CommError, Completer, DType, Op, Rank, ReduceOp};

mod ops;
mod rank;
mod watchdog;

use rank::new_handle;
use watchdog::watchdog;

/// The in-process reference backend (`backend_name() == "local"`).
///
/// Its ranks are handles used from different threads or tasks of one process. Ops are eager:
/// `submit` deposits the request at once and the [`Work`](comm_core::Work) completes when the last
/// rank of the group has deposited the same op. Results are exactly
/// [`reference`](mod@crate::reference)'s.
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
/// - [`Group::shutdown`](comm_core::Group::shutdown) stops one rank's handle: its later ops fail
///   with [`CommError::Shutdown`]; ops already deposited still complete.
///
/// There is no worker thread: the rank that completes an op computes the results on its own thread.
/// So `.await` works on any executor, and [`Work::wait`](comm_core::Work::wait) works when the
/// ranks run on different threads, but a rank blocking in `wait` on a single-threaded executor that
/// also runs its peers would wait for ever (until the timeout).
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
