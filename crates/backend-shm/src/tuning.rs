//! Defaults derived from the machine: the window and the one-step threshold follow the size of
//! a core's L2 cache (sysfs), so a step's working set stays in cache on a small-cache CPU as on
//! a large one. ARCHITECTURE.md ("One step vs two") says why these formulas.

use std::sync::OnceLock;
use std::time::Duration;

use comm_core::config::parse_size;
use comm_core::handle::CpuSet;

/// Per-core L2 assumed where sysfs does not say (a common size on current x86 servers).
const FALLBACK_L2: usize = 512 << 10;

/// The per-core L2 (or, lacking one, the last private data/unified cache) of CPU 0, in bytes.
pub(crate) fn l2_bytes() -> usize {
    static L2: OnceLock<usize> = OnceLock::new();
    *L2.get_or_init(|| read_l2("/sys/devices/system/cpu/cpu0/cache").unwrap_or(FALLBACK_L2))
}

fn read_l2(dir: &str) -> Option<usize> {
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
            (level == 2 && kind != "Instruction").then_some(size)
        })
        .max()
        .filter(|&s| s >= 64 << 10)
}

fn pow2_floor(x: usize) -> usize {
    if x == 0 {
        0
    } else {
        1 << (usize::BITS - 1 - x.leading_zeros())
    }
}

/// The collective window: a core's L2 (64 KiB..1 MiB). Every step of a large op pays a fixed
/// cost (the synchronisation, and the slower rank's delay on a shared or virtualised machine),
/// so steps should be long; what a rank reads in a step was just written by its peers and
/// crosses cores through L3 at any window size. Beyond L2 a step's copies start to evict the
/// user data the step reads next.
pub(crate) fn window(l2: usize) -> usize {
    pow2_floor(l2).clamp(64 << 10, 1 << 20)
}

/// The largest one-step all_reduce: every rank reads all `world` inputs and writes its output,
/// `(world + 1) × size` bytes, which must fit in a core's L2 (16 KiB..1 MiB).
pub(crate) fn small_max(l2: usize, world: u32) -> usize {
    pow2_floor(l2 / (world as usize + 1)).clamp(16 << 10, 1 << 20)
}

/// How long a wait spins before it sleeps: 50 µs, or nothing when the group's ranks outnumber
/// the CPUs they can run on together (`cpus`: the union of every rank's affinity; `None` where
/// a rank could not tell, then this process's CPUs). Ranks bound to one core each see one CPU
/// apiece but can all spin at once; a spinning rank that shares its core with a peer only
/// delays it.
pub(crate) fn spin(world: u32, cpus: Option<&CpuSet>) -> Duration {
    let cores = cpus.map_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()), CpuSet::runnable);
    if world as usize > cores {
        Duration::ZERO
    } else {
        Duration::from_micros(50)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_bound_to_their_own_cores_spin() {
        let set = |l: &str| CpuSet::parse(l).unwrap();
        // Two ranks bound to cores 0 and 1 (each sees one CPU): two CPUs together.
        let (mut u, other) = (set("0"), set("1"));
        u.union_with(&other);
        assert_eq!(u.len(), 2);
        // (Unless a CPU quota on this process caps it below two.)
        assert_eq!(spin(2, Some(&u)) > Duration::ZERO, u.runnable() == 2);
        // Both bound to core 0, or more ranks than CPUs: no spinning.
        assert_eq!(spin(2, Some(&set("0"))), Duration::ZERO);
        assert_eq!(spin(3, Some(&set("0-1"))), Duration::ZERO);
    }

    #[test]
    fn thresholds_follow_the_cache() {
        // Zen 1/2 (512 KiB L2): 512 KiB windows, one step up to 128 KiB with 2 ranks.
        assert_eq!((window(512 << 10), small_max(512 << 10, 2)), (512 << 10, 128 << 10));
        // Zen 4/5 (1 MiB L2): 1 MiB windows, one step up to 256 KiB with 2 ranks, 128 with 4.
        assert_eq!((window(1 << 20), small_max(1 << 20, 2), small_max(1 << 20, 4)), (1 << 20, 256 << 10, 128 << 10));
        // Sapphire Rapids (2 MiB): capped at 1 MiB windows; many ranks: at least 16 KiB.
        assert_eq!((window(2 << 20), small_max(2 << 20, 32)), (1 << 20, 32 << 10));
        assert_eq!(small_max(256 << 10, 1000), 16 << 10);
        assert_eq!(window(0), 64 << 10);
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
        assert_eq!(read_l2(dir.to_str().unwrap()), Some(1 << 20));
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(read_l2("/nonexistent"), None);
        assert!(l2_bytes() >= 64 << 10);
    }
}
