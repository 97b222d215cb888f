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

#[derive(Debug, Default)]
struct PoisonState {
    /// Set once `cause` is: every op checks it, so a healthy group's check is one load.
    set: AtomicBool,
    cause: Mutex<Option<String>>,
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
        *slot = Some(cause.into());
        self.0.set.store(true, SeqCst);
        true
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

/// A set of CPU numbers: the CPUs a thread may run on, or their union over the ranks of a
/// machine, which says whether those ranks can all run at once (and so whether a wait may
/// spin). A rank bound to one core sees one CPU; two ranks bound to two cores can both spin.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CpuSet(Vec<u64>);

/// CPU numbers past this are ignored (a malformed list must not allocate without bound).
const MAX_CPU: usize = 1 << 16;

impl CpuSet {
    /// The CPUs this thread may run on (`Cpus_allowed_list` in `/proc/thread-self/status`);
    /// `None` where the system does not say.
    pub fn allowed() -> Option<CpuSet> {
        let status = std::fs::read_to_string("/proc/thread-self/status").ok()?;
        let list = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
        CpuSet::parse(list).filter(|s| !s.is_empty())
    }

    /// `id` (a host identity) followed, after a newline, by the CPUs this thread may run on:
    /// what a rank publishes so that its peers learn both ([`split_id`](Self::split_id)).
    pub fn append_to(id: &str) -> String {
        format!("{id}\n{}", CpuSet::allowed().map(|c| c.to_string()).unwrap_or_default())
    }

    /// The identity and the CPUs of a value [`append_to`](Self::append_to) made (`None` where
    /// it carries none, or none readable).
    pub fn split_id(value: &str) -> (&str, Option<CpuSet>) {
        match value.split_once('\n') {
            Some((id, cpus)) => (id, CpuSet::parse(cpus).filter(|c| !c.is_empty())),
            None => (value, None),
        }
    }

    /// Parses the kernel's list format (`0-3,8,10-11`); `None` if it is not one.
    pub fn parse(list: &str) -> Option<CpuSet> {
        let mut set = CpuSet::default();
        for part in list.trim().split(',').filter(|p| !p.is_empty()) {
            let (a, b) = part.split_once('-').unwrap_or((part, part));
            let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
            if a > b || b >= MAX_CPU {
                return None;
            }
            (a..=b).for_each(|c| set.insert(c));
        }
        Some(set)
    }

    /// The set of these bit words (CPU `64 * i + j` is bit `j` of word `i`).
    pub fn from_words(words: &[u64]) -> CpuSet {
        let mut w = words.to_vec();
        while w.last() == Some(&0) {
            w.pop();
        }
        CpuSet(w)
    }

    /// The bit words of this set (see [`from_words`](Self::from_words)).
    pub fn words(&self) -> &[u64] {
        &self.0
    }

    /// Adds CPU `cpu`.
    pub fn insert(&mut self, cpu: usize) {
        if self.0.len() <= cpu / 64 {
            self.0.resize(cpu / 64 + 1, 0);
        }
        self.0[cpu / 64] |= 1 << (cpu % 64);
    }

    /// The CPUs of the set, in increasing order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.0.len() * 64).filter(|&c| self.contains(c))
    }

    /// Whether CPU `cpu` is in the set.
    pub fn contains(&self, cpu: usize) -> bool {
        self.0.get(cpu / 64).is_some_and(|w| w & (1 << (cpu % 64)) != 0)
    }

    /// Adds every CPU of `other`.
    pub fn union_with(&mut self, other: &CpuSet) {
        if self.0.len() < other.0.len() {
            self.0.resize(other.0.len(), 0);
        }
        self.0.iter_mut().zip(&other.0).for_each(|(a, b)| *a |= b);
    }

    /// The union of `sets`, or `None` when one of them is unknown.
    pub fn union_of<'a>(sets: impl IntoIterator<Item = Option<&'a CpuSet>>) -> Option<CpuSet> {
        sets.into_iter().try_fold(CpuSet::default(), |mut all, s| {
            all.union_with(s?);
            Some(all)
        })
    }

    /// How many CPUs the set holds.
    pub fn len(&self) -> usize {
        self.0.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Whether the set holds no CPU.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// [`runnable`](Self::runnable) of `union` (every rank's CPUs together), or where some
    /// rank could not tell (`None`), this process's `available_parallelism`.
    pub fn runnable_of(union: Option<&CpuSet>) -> usize {
        union.map_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()), CpuSet::runnable)
    }

    /// How many threads of the ranks whose CPUs together are `self` can run at once: the
    /// set's size, capped by a CPU quota on this process (a container's `--cpus`), which std's
    /// `available_parallelism` reports below this thread's own CPU count.
    pub fn runnable(&self) -> usize {
        let std = std::thread::available_parallelism().map_or(1, |n| n.get());
        let own = CpuSet::allowed().map_or(std, |s| s.len());
        if std < own {
            self.len().min(std)
        } else {
            self.len().max(1)
        }
    }
}

impl FromIterator<usize> for CpuSet {
    fn from_iter<I: IntoIterator<Item = usize>>(cpus: I) -> Self {
        let mut set = CpuSet::default();
        cpus.into_iter().for_each(|c| set.insert(c));
        set
    }
}

impl std::fmt::Display for CpuSet {
    /// The kernel's list format, which [`parse`](Self::parse) reads.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut cpus = self.iter().peekable();
        let mut sep = "";
        while let Some(start) = cpus.next() {
            let mut end = start;
            while cpus.next_if_eq(&(end + 1)).is_some() {
                end += 1;
            }
            match end == start {
                true => write!(f, "{sep}{start}")?,
                false => write!(f, "{sep}{start}-{end}")?,
            }
            sep = ",";
        }
        Ok(())
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
    fn cpu_sets_parse_print_and_join() {
        let a = CpuSet::parse("0-3,8").unwrap();
        assert_eq!((a.len(), a.to_string()), (5, "0-3,8".to_owned()));
        let b = CpuSet::parse(" 3-5,64,70-71\n").unwrap();
        let u = CpuSet::union_of([Some(&a), Some(&b)]).unwrap();
        assert_eq!(u.to_string(), "0-5,8,64,70-71");
        assert_eq!(CpuSet::union_of([Some(&a), None]), None);
        assert_eq!(CpuSet::from_words(u.words()), u);
        assert_eq!(CpuSet::from_words(&[0b11, 0, 0]), CpuSet::parse("0-1").unwrap());
        assert_eq!(u.iter().collect::<CpuSet>(), u);
        assert_eq!(u.iter().take(7).collect::<Vec<_>>(), [0, 1, 2, 3, 4, 5, 8]);
        for bad in ["x", "3-1", "0-99999999", "1-"] {
            assert_eq!(CpuSet::parse(bad), None, "{bad}");
        }
        assert!(CpuSet::parse("").unwrap().is_empty());
        assert_eq!(CpuSet::split_id("boot@h\n0-3,8"), ("boot@h", Some(a.clone())));
        assert_eq!(CpuSet::split_id("boot@h\n"), ("boot@h", None));
        assert_eq!(CpuSet::split_id("boot@h"), ("boot@h", None));
        assert_eq!(CpuSet::split_id(&CpuSet::append_to("boot@h")), ("boot@h", CpuSet::allowed()));
        // Where the system says, this thread may run somewhere, and alone it can run.
        if let Some(own) = CpuSet::allowed() {
            assert!(!own.is_empty());
            assert!((1..=own.len()).contains(&own.runnable()));
        }
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
