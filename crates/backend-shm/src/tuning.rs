//! Defaults derived from the machine: the window and the one-step threshold follow the size of
//! a core's L2 cache (sysfs), so a step's working set stays in cache on a small-cache CPU as on
//! a large one. ARCHITECTURE.md ("One step vs two") says why these formulas.

use std::sync::OnceLock;

use comm_core::config::parse_size;
use comm_core::cpus::CpuSet;

/// Per-core L2 assumed where sysfs does not say (a common size on current x86 servers).
const FALLBACK_L2: usize = 512 << 10;

/// The per-core L2 (or, lacking one, the last private data/unified cache) of CPU 0, in bytes.
pub(crate) fn l2_bytes() -> usize {
    static L2: OnceLock<usize> = OnceLock::new();
    *L2.get_or_init(|| read_cache("/sys/devices/system/cpu/cpu0/cache", 2).unwrap_or(FALLBACK_L2))
}

/// Whether an op whose ranks together touch `bytes` (every input and output) overflows the L3
/// of CPU 0 (8 MiB where sysfs does not say): then copies into its outputs stream.
pub(crate) fn past_l3(bytes: usize) -> bool {
    static L3: OnceLock<usize> = OnceLock::new();
    bytes >= *L3.get_or_init(|| read_cache("/sys/devices/system/cpu/cpu0/cache", 3).unwrap_or(8 << 20))
}

fn read_cache(dir: &str, want: u32) -> Option<usize> {
    let read = |p: std::path::PathBuf| std::fs::read_to_string(p).ok().map(|s| s.trim().to_owned());
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("index"))
        .filter_map(|e| {
            let p = e.path();
            let level: u32 = read(p.join("level"))?.parse().ok()?;
            let kind = read(p.join("type"))?;
            let size = parse_size(&read(p.join("size"))?).ok()?;
            (level == want && kind != "Instruction").then_some(size)
        })
        .max()
        .filter(|&s| s >= 64 << 10)
}

fn pow2_floor(x: usize) -> usize {
    x.checked_ilog2().map_or(0, |b| 1 << b)
}

/// The collective window: a core's L2 (64 KiB..1 MiB).
pub(crate) fn window(l2: usize) -> usize {
    pow2_floor(l2).clamp(64 << 10, 1 << 20)
}

/// Per-rank room for point-to-point mailboxes ([`slot`]): two slots of 256 KiB for each of 63
/// peers, what every group had before slots followed the window.
const MAILBOXES: usize = 32 << 20;

/// The point-to-point mailbox slot: the window's size (a chunk rewrites lines a peer read
/// only after a window's worth of others, as steps do, see `Layout::msg_data`), as long as a
/// rank's `2 × world` slots fit in [`MAILBOXES`]; 64 KiB..1 MiB.
pub(crate) fn slot(window: usize, world: u32) -> usize {
    let fit = MAILBOXES / (2 * world.max(1) as usize);
    pow2_floor(window.min(fit)).clamp(64 << 10, 1 << 20)
}

/// The largest one-step all_reduce: the largest power of two with
/// `(world + 1) × size ≤ L2 × 2 / world` (16 KiB..1 MiB).
pub(crate) fn small_max(l2: usize, world: u32) -> usize {
    let n = world.max(2) as usize;
    pow2_floor(l2 * 2 / n.saturating_mul(n + 1)).clamp(16 << 10, 1 << 20)
}

/// The CPU the worker thread of the group's rank `rank` is bound to, or `None` to leave it to
/// the scheduler. `sets`: every rank's CPUs (its affinity; `None` where it could not tell).
/// `pin`: [`ShmOptions::pin`](crate::ShmOptions::pin). `cores`: one CPU per physical core of
/// a set (see [`cores_of`]).
/// By default only when every rank may run on the same CPUs and the group's threads outnumber
/// them (ARCHITECTURE.md says why).
pub(crate) fn worker_cpu(
    rank: u32,
    sets: &[Option<CpuSet>],
    pin: Option<bool>,
    cores: impl FnOnce(&CpuSet) -> Vec<usize>,
) -> Option<usize> {
    let world = sets.len();
    let first = sets.first()?.as_ref()?;
    if pin == Some(false) || world < 2 || sets.iter().any(|s| s.as_ref() != Some(first)) {
        return None;
    }
    let runnable = first.runnable();
    let crowded = 2 * world > runnable && world <= runnable;
    if pin != Some(true) && !crowded {
        return None;
    }
    // Only now read the topology (a file per CPU).
    let cores = cores(first);
    (world <= cores.len()).then(|| cores[rank as usize])
}

/// One CPU of `set` per physical core (the lowest of its hardware threads in `set`, from
/// `DIR/cpuN/topology/thread_siblings_list`; every CPU where that is unreadable).
pub(crate) fn cores_of(set: &CpuSet, dir: &str) -> Vec<usize> {
    let cpus: Vec<usize> = set.iter().collect();
    cpus.iter()
        .copied()
        .filter(|&c| {
            let path = format!("{dir}/cpu{c}/topology/thread_siblings_list");
            let siblings = std::fs::read_to_string(path).ok().and_then(|l| CpuSet::parse(&l));
            siblings.is_none_or(|sib| cpus.iter().find(|&&o| sib.contains(o)).is_none_or(|&lowest| lowest == c))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn ranks_bound_to_their_own_cores_spin() {
        let set = |l: &str| CpuSet::parse(l).unwrap();
        // Two ranks bound to cores 0 and 1 (each sees one CPU): two CPUs together.
        let (mut u, other) = (set("0"), set("1"));
        u.union_with(&other);
        assert_eq!(u.len(), 2);
        // (Unless a CPU quota on this process caps it below two.)
        let spin = |n: usize, cpus: &CpuSet| comm_core::handle::default_spin(n, CpuSet::runnable_of(Some(cpus)));
        assert_eq!(spin(2, &u) > Duration::ZERO, u.runnable() == 2);
        // Both bound to core 0, or more ranks than CPUs: no spinning.
        assert_eq!(spin(2, &set("0")), Duration::ZERO);
        assert_eq!(spin(3, &set("0-1")), Duration::ZERO);
    }

    #[test]
    fn thresholds_follow_the_cache() {
        // Zen 1/2 (512 KiB L2): 512 KiB windows, one step up to 128 KiB with 2 ranks.
        assert_eq!((window(512 << 10), small_max(512 << 10, 2)), (512 << 10, 128 << 10));
        // Zen 4/5 (1 MiB L2): 1 MiB windows, one step up to 256 KiB with 2 ranks, 64 with 4.
        assert_eq!((window(1 << 20), small_max(1 << 20, 2), small_max(1 << 20, 4)), (1 << 20, 256 << 10, 64 << 10));
        // Sapphire Rapids (2 MiB): capped at 1 MiB windows; many ranks: at least 16 KiB.
        assert_eq!((window(2 << 20), small_max(2 << 20, 8)), (1 << 20, 32 << 10));
        assert_eq!(small_max(2 << 20, 32), 16 << 10);
        assert_eq!(small_max(256 << 10, 1000), 16 << 10);
        assert_eq!(small_max(1 << 20, u32::MAX), 16 << 10);
        assert_eq!(window(0), 64 << 10);
        // Mailbox slots: the window up to 16 ranks, then within 32 MiB per rank.
        assert_eq!((slot(1 << 20, 2), slot(1 << 20, 16), slot(1 << 20, 17)), (1 << 20, 1 << 20, 512 << 10));
        assert_eq!((slot(1 << 20, 64), slot(512 << 10, 2), slot(1 << 20, 4096)), (256 << 10, 512 << 10, 64 << 10));
    }

    #[test]
    fn workers_are_bound_where_the_group_fills_the_machine() {
        let set = |l: &str| Some(CpuSet::parse(l).unwrap());
        let each = |s: &CpuSet| s.iter().collect::<Vec<_>>();
        let runnable = |l: &str| CpuSet::parse(l).unwrap().runnable();
        // Two unbound ranks on two CPUs: rank r's worker on the r-th (unless a CPU quota on
        // this process leaves fewer than two runnable).
        let two = [set("0-1"), set("0-1")];
        let want = |cpu| (runnable("0-1") == 2).then_some(cpu);
        assert_eq!(worker_cpu(0, &two, None, each), want(0));
        assert_eq!(worker_cpu(1, &two, None, each), want(1));
        assert_eq!(worker_cpu(1, &two, Some(false), each), None);
        // Room to spare (2 ranks, 8 CPUs): left to the scheduler unless asked.
        let roomy = [set("0-7"), set("0-7")];
        assert_eq!(worker_cpu(1, &roomy, None, each), None);
        assert_eq!(worker_cpu(1, &roomy, Some(true), each), Some(1));
        // One CPU per core: CPUs 0 and 1 are two threads of core 0 here.
        assert_eq!(worker_cpu(1, &roomy, Some(true), |_| vec![0, 2, 4, 6]), Some(2));
        // More ranks than cores, ranks bound by a launcher (sets differ), a rank that could
        // not tell: never.
        assert_eq!(worker_cpu(2, &[set("0-1"), set("0-1"), set("0-1")], Some(true), each), None);
        assert_eq!(worker_cpu(0, &[set("0"), set("1")], Some(true), each), None);
        assert_eq!(worker_cpu(0, &[set("0-1"), None], Some(true), each), None);
    }

    #[test]
    fn cores_come_from_the_sibling_lists() {
        let dir = std::env::temp_dir().join(format!("comm-shm-topo-test-{}", std::process::id()));
        // Four CPUs, two cores: 0 and 2 are threads of one core, 1 and 3 of the other.
        for (cpu, sib) in [(0, "0,2"), (1, "1,3"), (2, "0,2"), (3, "1,3")] {
            let d = dir.join(format!("cpu{cpu}/topology"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("thread_siblings_list"), format!("{sib}\n")).unwrap();
        }
        let d = dir.to_str().unwrap();
        assert_eq!(cores_of(&CpuSet::parse("0-3").unwrap(), d), [0, 1]);
        // Only the second thread of a core allowed: it stands for its core.
        assert_eq!(cores_of(&CpuSet::parse("2-3").unwrap(), d), [2, 3]);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(cores_of(&CpuSet::parse("5,7").unwrap(), "/nonexistent"), [5, 7]);
    }

    #[test]
    fn sysfs_is_read_where_there_is_one() {
        let dir = std::env::temp_dir().join(format!("comm-shm-cache-test-{}", std::process::id()));
        for (i, (level, kind, size)) in
            [(1, "Data", "32K"), (1, "Instruction", "64K"), (2, "Unified", "1024K"), (3, "Unified", "32768K")]
                .iter()
                .enumerate()
        {
            let d = dir.join(format!("index{i}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("level"), format!("{level}\n")).unwrap();
            std::fs::write(d.join("type"), format!("{kind}\n")).unwrap();
            std::fs::write(d.join("size"), format!("{size}\n")).unwrap();
        }
        assert_eq!(read_cache(dir.to_str().unwrap(), 2), Some(1 << 20));
        assert_eq!(read_cache(dir.to_str().unwrap(), 3), Some(32 << 20));
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(read_cache("/nonexistent", 2), None);
        assert!(l2_bytes() >= 64 << 10);
    }
}
