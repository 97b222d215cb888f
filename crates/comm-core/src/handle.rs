//! What every backend's group handle shares: the poison flag its worker sets, the admission
//! checks before an op is issued, sub-group membership and naming, the shutdown round trip, the
//! host identity and the CPUs a machine's ranks can run on. Backends keep their own workers;
//! these are the parts that mean the same thing everywhere, so the same situation gives the
//! same error whichever backend runs.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::{CommError, Op, Rank, Work};

/// Why a group stopped working, shared by its handles and its worker. The first cause wins:
/// later failures are consequences of it.
#[derive(Clone, Debug, Default)]
pub struct Poison(Arc<PoisonState>);

/// What runs once when a group fails, with the cause ([`Poison::on_set`]).
pub type FailureHook = Box<dyn FnOnce(&str) + Send>;

#[derive(Default)]
struct PoisonState {
    /// Set once `cause` is: every op checks it, so a healthy group's check is one load.
    set: AtomicBool,
    cause: Mutex<Option<String>>,
    hooks: Mutex<Vec<FailureHook>>,
}

impl std::fmt::Debug for PoisonState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoisonState").field("set", &self.set).field("cause", &self.cause).finish_non_exhaustive()
    }
}

impl Poison {
    /// A healthy group's flag.
    pub fn new() -> Self {
        Self::default()
    }

    /// Marks the group unusable; returns whether this call did it (false: it already was).
    pub fn set(&self, cause: impl Into<String>) -> bool {
        let mut slot = self.0.cause.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_some() {
            return false;
        }
        let cause = cause.into();
        *slot = Some(cause.clone());
        self.0.set.store(true, SeqCst);
        drop(slot);
        // Taken after the flag is up: a hook added meanwhile either is taken here or sees it.
        let hooks = std::mem::take(&mut *self.0.hooks.lock().unwrap_or_else(|p| p.into_inner()));
        for hook in hooks {
            hook(&cause);
        }
        true
    }

    /// Runs `hook` once with the cause when the group is poisoned, on the thread that poisons
    /// it (at once, on this thread, if it is already).
    pub fn on_set(&self, hook: FailureHook) {
        let mut hooks = self.0.hooks.lock().unwrap_or_else(|p| p.into_inner());
        if !self.0.set.load(SeqCst) {
            return hooks.push(hook);
        }
        drop(hooks);
        if let Some(cause) = self.cause() {
            hook(&cause);
        }
    }

    /// The cause, once poisoned.
    pub fn cause(&self) -> Option<String> {
        if !self.0.set.load(SeqCst) {
            return None;
        }
        self.0.cause.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// `Err(Poisoned)` once poisoned.
    pub fn check(&self) -> Result<(), CommError> {
        match self.cause() {
            Some(cause) => Err(CommError::Poisoned { cause }),
            None => Ok(()),
        }
    }
}

/// The checks every op passes before a backend issues it: its arguments on this rank, the
/// group's poison flag, and whether the group was shut down.
#[derive(Debug)]
pub struct Admission {
    rank: Rank,
    world: u32,
    poison: Poison,
    shut: AtomicBool,
}

impl Admission {
    /// For rank `rank` of a group of `world`, whose worker sets `poison`.
    pub fn new(rank: Rank, world: u32, poison: Poison) -> Self {
        Admission { rank, world, poison, shut: AtomicBool::new(false) }
    }

    /// This rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// The group's size.
    pub fn world(&self) -> u32 {
        self.world
    }

    /// The group's poison flag.
    pub fn poison(&self) -> &Poison {
        &self.poison
    }

    /// Argument errors first (the group stays usable after them), then poison, then shutdown.
    pub fn admit<R: Op>(&self, req: &R) -> Result<(), CommError> {
        req.validate(self.rank, self.world)?;
        self.check_open()
    }

    /// Whether the group still takes work: not poisoned, not shut down.
    pub fn check_open(&self) -> Result<(), CommError> {
        self.poison.check()?;
        if self.shut.load(SeqCst) {
            return Err(CommError::Shutdown(String::new()));
        }
        Ok(())
    }

    /// Stops admitting ops; true for the call that did it (which then runs the shutdown).
    pub fn begin_shutdown(&self) -> bool {
        !self.shut.swap(true, SeqCst)
    }
}

/// The end of a shutdown round trip: a worker that is already gone has shut down too.
pub async fn shutdown_done(work: Work<()>) -> Result<(), CommError> {
    match work.await {
        Ok(()) | Err(CommError::Shutdown(_)) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Names a group's sub-groups. Every rank of the parent counts every `new_group` call (members
/// or not, as torch requires), so all members derive the same name for the same call.
#[derive(Debug)]
pub struct Subgroups {
    prefix: String,
    next: AtomicU64,
}

/// One `new_group` call as this rank sees it.
#[derive(Debug)]
pub struct Subgroup {
    /// The members, in parent rank order.
    pub ranks: Vec<Rank>,
    /// This rank's rank in the new group; `None` when it is not a member.
    pub rank: Option<Rank>,
    /// The new group's name, unique under the parent's.
    pub prefix: String,
}

impl Subgroups {
    /// Sub-groups of the group named `prefix`.
    pub fn new(prefix: impl Into<String>) -> Self {
        Subgroups { prefix: prefix.into(), next: AtomicU64::new(0) }
    }

    /// The parent group's name.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Checks `ranks` (distinct ranks of a group of `world`, at least one; any order) and
    /// names the new group. A rejected call is not counted, so ranks stay in step when every
    /// rank makes the same mistake.
    pub fn next(&self, ranks: &[Rank], rank: Rank, world: u32) -> Result<Subgroup, CommError> {
        let sorted = group_members(ranks, world)?;
        let id = self.next.fetch_add(1, SeqCst);
        let me = sorted.iter().position(|&r| r == rank).map(|p| p as Rank);
        Ok(Subgroup { ranks: sorted, rank: me, prefix: format!("{}/g{id}", self.prefix) })
    }
}

/// The members of a `new_group(ranks)` call, sorted: distinct ranks of a group of `world`,
/// at least one.
pub fn group_members(ranks: &[Rank], world: u32) -> Result<Vec<Rank>, CommError> {
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    if sorted.is_empty() || sorted.len() != ranks.len() || sorted.last().is_some_and(|&r| r >= world) {
        return Err(CommError::invalid(
            "new_group",
            format!("ranks {ranks:?} must be distinct ranks of this group of {world} (and at least one)"),
        ));
    }
    Ok(sorted)
}

/// Who this host is: boot id and host name. Ranks with equal values share a machine (memory,
/// GPUs); a container or namespace with its own host name counts as another host.
///
/// `COMM_HOST_ID`, when set, replaces both: ranks with equal values count as one host. It is
/// for layouts the two cannot describe (containers of one pod that share `/dev/shm` but not a
/// host name), and stands in for separate hosts in tests where namespaces are unavailable.
pub fn host_identity() -> String {
    if let Some(id) = crate::config::env_var("COMM_HOST_ID").filter(|v| !v.trim().is_empty()) {
        return format!("id:{}", id.trim());
    }
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_owned()).unwrap_or_default();
    format!("{}@{}", read("/proc/sys/kernel/random/boot_id"), read("/proc/sys/kernel/hostname"))
}

/// How long a worker's wait spins before it sleeps, by default: 50 µs, or nothing where the
/// `ranks` ranks of this host outnumber the `cpus` CPUs they may run on together (ranks bound
/// to a core each see one CPU apiece but can all spin at once; a rank spinning on a core it
/// shares with a peer only delays it).
pub fn default_spin(ranks: usize, cpus: usize) -> Duration {
    if ranks > cpus {
        Duration::ZERO
    } else {
        Duration::from_micros(50)
    }
}

/// How long a caller's first wait for an op that a worker thread runs may spin
/// ([`Work::with_spin`]): the worker's own polling time `spin`, where the `ranks` ranks of this
/// host, each a caller and a worker, can all run at once on `cpus` CPUs; else not at all
/// (spinning callers would take their workers' CPUs).
pub fn caller_spin(spin: Duration, ranks: usize, cpus: usize) -> Duration {
    if ranks.saturating_mul(2) <= cpus {
        spin
    } else {
        Duration::ZERO
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{AllReduce, Broadcast};
    use crate::{DType, HostBuffer, ReduceOp};

    #[test]
    fn callers_spin_only_where_callers_and_workers_all_fit() {
        let us = Duration::from_micros(50);
        assert_eq!(caller_spin(us, 1, 2), us);
        assert_eq!(caller_spin(us, 8, 16), us);
        assert_eq!(caller_spin(us, 2, 2), Duration::ZERO);
        assert_eq!(caller_spin(us, 9, 16), Duration::ZERO);
        assert_eq!(caller_spin(us, usize::MAX, 16), Duration::ZERO);
    }

    #[test]
    fn the_first_cause_wins() {
        let p = Poison::new();
        assert!(p.check().is_ok());
        assert!(p.clone().set("peer 1 died"));
        assert!(!p.set("timeout"));
        let e = p.check().unwrap_err();
        assert!(matches!(&e, CommError::Poisoned { cause } if cause == "peer 1 died"), "{e}");
    }

    #[test]
    fn failure_hooks_run_once_with_the_first_cause() {
        let p = Poison::new();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let hook = |tag: &'static str| -> FailureHook {
            let seen = seen.clone();
            Box::new(move |cause: &str| seen.lock().unwrap().push(format!("{tag}: {cause}")))
        };
        p.on_set(hook("before"));
        p.on_set(hook("before too"));
        assert!(seen.lock().unwrap().is_empty());
        // Set from another thread (as a worker does); a later cause runs nothing.
        let q = p.clone();
        std::thread::spawn(move || q.set("rank 1 aborted: drain")).join().unwrap();
        assert!(!p.set("timeout"));
        p.on_set(hook("after"));
        assert_eq!(
            *seen.lock().unwrap(),
            ["before: rank 1 aborted: drain", "before too: rank 1 aborted: drain", "after: rank 1 aborted: drain"]
        );
    }

    #[test]
    fn admission_reports_arguments_then_poison_then_shutdown() {
        let a = Admission::new(0, 2, Poison::new());
        let bad = Broadcast { buf: HostBuffer::zeroed(DType::F32, 1), root: 2 };
        let good = AllReduce { buf: HostBuffer::zeroed(DType::F32, 1), op: ReduceOp::Sum };
        assert!(matches!(a.admit(&bad), Err(CommError::InvalidArgument { .. })));
        a.admit(&good).unwrap();
        assert!(a.begin_shutdown());
        assert!(!a.begin_shutdown());
        assert!(matches!(a.admit(&good), Err(CommError::Shutdown(_))));
        a.poison().set("x");
        assert!(matches!(a.admit(&good), Err(CommError::Poisoned { .. })));
        assert!(matches!(a.admit(&bad), Err(CommError::InvalidArgument { .. })));
    }

    #[test]
    fn subgroups_are_checked_and_named_alike_on_every_rank() {
        let s = Subgroups::new("shm/world");
        for bad in [&[][..], &[0, 0][..], &[4][..]] {
            let e = s.next(bad, 0, 4).unwrap_err().to_string();
            assert!(e.contains("distinct ranks of this group of 4"), "{e}");
        }
        let g = s.next(&[3, 1], 3, 4).unwrap();
        assert_eq!((g.ranks.as_slice(), g.rank, g.prefix.as_str()), (&[1, 3][..], Some(1), "shm/world/g0"));
        let g = s.next(&[1, 3], 0, 4).unwrap();
        assert_eq!((g.rank, g.prefix.as_str()), (None, "shm/world/g1"));
    }

    #[test]
    fn host_identity_names_boot_and_host() {
        let id = host_identity();
        assert!(id.contains('@') && id.len() > 1, "{id}");
        assert_eq!(id, host_identity());
    }

    #[tokio::test]
    async fn a_gone_worker_counts_as_shut_down() {
        let (done, work) = Work::<()>::pending();
        drop(done);
        shutdown_done(work).await.unwrap();
        let (done, work) = Work::<()>::pending();
        done.complete(Err(CommError::Store("x".into())));
        assert!(shutdown_done(work).await.is_err());
    }
}
