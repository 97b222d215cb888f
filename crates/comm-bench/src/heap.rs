//! Keeps freed memory in the process while the bench runs.
//!
//! Ops that consume their input (all_gather, reduce_scatter, all_to_all) free a message-sized
//! buffer inside the clock, and the next batch of input copies is allocated outside it. With
//! glibc's defaults that free hands the pages back to the kernel (`munmap`, or trimming the
//! heap top) and the next copy faults them in again: at 8 MiB and more that is about half of
//! an all_to_all's time, the same for every backend, and not communication. nccl-tests and
//! DeepSpeed's benchmarks reuse their buffers; this makes ours behave the same way.

/// Serve every allocation from one heap (threads' own arenas trim themselves) and never
/// trim it (glibc); elsewhere nothing.
pub(crate) fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only changes glibc allocator parameters; it is called at start,
    // before any other thread exists. A parameter it refuses leaves the default in place.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    fn resident_bytes() -> usize {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
        let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
        pages * 4096
    }

    /// After the setting, a freed 96 MiB buffer stays resident for the next allocation
    /// (glibc would otherwise mmap it and munmap it on free). On a thread started after the
    /// setting, as comm-bench's are (the test harness's own threads may have arenas already).
    #[test]
    fn freed_memory_stays_resident() {
        super::keep_freed_memory();
        std::thread::spawn(check).join().unwrap();
    }

    fn check() {
        let big = 96 << 20;
        let before = resident_bytes();
        let v = std::hint::black_box(vec![1u8; big]);
        let touched = resident_bytes();
        assert!(touched >= before + big / 2, "the buffer was not made resident: {before} -> {touched} B");
        drop(v);
        let after = resident_bytes();
        assert!(
            after + (1 << 20) >= touched,
            "the freed buffer went back to the kernel: {touched} -> {after} B resident"
        );
    }
}
