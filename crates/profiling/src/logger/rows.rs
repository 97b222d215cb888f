//! The rows: their live counters, each thread's cache of the rows it records into (so the
//! hot path takes no lock), and how a completed op is counted and printed (`verbose`).

use std::cell::RefCell;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::bandwidth::bandwidth;
use crate::bandwidth::human_size;

use super::{CommsLogger, VERBOSE};

/// Aggregation key: one row of the summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Key {
    pub(crate) op: &'static str,
    pub(crate) caller: Option<&'static str>,
    pub(crate) group_size: u32,
    pub(crate) bytes: u64,
}

/// One row's data, as read for a summary: successful ops, the latencies of the timed ones in
/// call order (kept whole for exact percentiles and the per-call straggler view; 8 bytes per
/// timed op — `reset` between epochs), failed and detached ops.
#[derive(Clone, Debug, Default)]
pub(crate) struct Stats {
    pub(crate) count: u64,
    pub(crate) samples_ns: Vec<u64>,
    pub(crate) errors: u64,
    pub(crate) detached: u64,
}

/// One row's live counters. Recording adds to them without the logger's map lock: threads
/// find their cells through a per-thread cache ([`CACHE`]).
///
/// Successes are counted on per-thread counters ([`ThreadCounts`]), each written by one thread
/// only (a plain store, no locked instruction). Ops recorded directly are counted when
/// *submitted*; the few that fail are taken back by the thread that sees them complete, on its
/// own counter. So the common case — a small op finishing inline — costs one plain store, and
/// an op completed by the backend's worker needs nothing from the logger unless it failed, was
/// detached or is timed. Ops recorded from spans are counted when they complete.
#[derive(Debug)]
pub(crate) struct Cell {
    pub(super) key: Key,
    /// The row's number in [`Inner::rows`](super::Inner::rows) (from 1), carried by tickets.
    row: NonZeroU32,
    threads: Mutex<Vec<Arc<ThreadCounts>>>,
    pub(super) errors: AtomicU64,
    pub(super) detached: AtomicU64,
    samples_ns: Mutex<Vec<u64>>,
}

/// One thread's counts in one row; successes = submitted (direct) − taken back (direct
/// failures) + completed (from spans).
#[derive(Debug, Default)]
pub(super) struct ThreadCounts {
    pub(super) submitted: LocalCount,
    pub(super) taken_back: LocalCount,
    completed: LocalCount,
}

impl ThreadCounts {
    fn count(&self) -> u64 {
        (self.submitted.get() + self.completed.get()).saturating_sub(self.taken_back.get())
    }
}

/// A counter with one writer: a plain load and store, no locked instruction. `reset` moves
/// `base` instead of zeroing `n`, so it cannot race with the writer.
#[derive(Debug, Default)]
pub(super) struct LocalCount {
    n: AtomicU64,
    base: AtomicU64,
}

impl LocalCount {
    /// Only from the thread that owns the counter; returns the count before.
    pub(super) fn bump(&self) -> u64 {
        let n = self.n.load(Ordering::Relaxed);
        self.n.store(n + 1, Ordering::Relaxed);
        n
    }

    fn get(&self) -> u64 {
        self.n.load(Ordering::Relaxed).saturating_sub(self.base.load(Ordering::Relaxed))
    }

    fn reset(&self) {
        self.base.store(self.n.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

impl Cell {
    pub(super) fn samples(&self) -> MutexGuard<'_, Vec<u64>> {
        self.samples_ns.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn threads(&self) -> MutexGuard<'_, Vec<Arc<ThreadCounts>>> {
        self.threads.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn stats(&self) -> Stats {
        Stats {
            count: self.threads().iter().map(|t| t.count()).sum(),
            samples_ns: self.samples().clone(),
            errors: self.errors.load(Ordering::Relaxed),
            detached: self.detached.load(Ordering::Relaxed),
        }
    }

    pub(super) fn clear(&self) {
        let mut samples = self.samples();
        samples.clear();
        samples.shrink_to_fit();
        for c in [&self.errors, &self.detached] {
            c.store(0, Ordering::Relaxed);
        }
        for t in self.threads().iter() {
            [&t.submitted, &t.taken_back, &t.completed].iter().for_each(|c| c.reset());
        }
    }
}

/// A thread's view of the rows it recorded into, so the hot path takes no lock: `(logger id,
/// key)` → the row's cell and this thread's counters in it (the submitted count is also the
/// index that decides which calls are timed). A handful of entries: a linear scan beats
/// hashing.
pub(super) struct Cached {
    pub(super) logger: u64,
    pub(super) key: Key,
    pub(super) row: NonZeroU32,
    pub(super) cell: Arc<Cell>,
    pub(super) counts: Arc<ThreadCounts>,
}

thread_local! {
    pub(super) static CACHE: RefCell<Vec<Cached>> = const { RefCell::new(Vec::new()) };
}

/// Entries kept per thread before the cache starts over (a program with more rows than this
/// only pays the map lock more often).
const CACHE_CAP: usize = 256;

impl CommsLogger {
    /// Runs `f` on this thread's cache entry for `key` (made on first use).
    #[inline]
    pub(super) fn with_cached<T>(&self, key: &Key, rank: u32, f: impl FnOnce(&Cached) -> T) -> T {
        CACHE.with(|cache| {
            let mut cache = cache.borrow_mut();
            let id = self.inner.id;
            let hit = |c: &Cached| {
                c.logger == id
                    && c.key.bytes == key.bytes
                    && c.key.group_size == key.group_size
                    && (std::ptr::eq(c.key.op, key.op) || c.key.op == key.op)
                    && c.key.caller == key.caller
            };
            let i = match cache.iter().position(hit) {
                Some(i) => i,
                None => self.add_cached(&mut cache, key, rank),
            };
            f(&cache[i])
        })
    }

    #[cold]
    fn add_cached(&self, cache: &mut Vec<Cached>, key: &Key, rank: u32) -> usize {
        if cache.len() >= CACHE_CAP {
            cache.clear();
        }
        self.inner.rank.get_or_init(|| rank);
        let cell = self
            .cells()
            .entry(*key)
            .or_insert_with(|| {
                let mut rows = self.inner.rows.write().unwrap_or_else(|e| e.into_inner());
                let row = NonZeroU32::MIN.saturating_add(rows.len() as u32);
                let cell = Arc::new(Cell {
                    key: *key,
                    row,
                    threads: Mutex::default(),
                    errors: AtomicU64::new(0),
                    detached: AtomicU64::new(0),
                    samples_ns: Mutex::default(),
                });
                rows.push(cell.clone());
                cell
            })
            .clone();
        let counts = Arc::new(ThreadCounts::default());
        cell.threads().push(counts.clone());
        cache.push(Cached { logger: self.inner.id, key: *key, row: cell.row, cell, counts });
        cache.len() - 1
    }

    /// Counts one completed op on this thread's counters.
    pub(super) fn record(&self, key: &Key, rank: u32, failed: bool, detached: bool, latency_ns: Option<u64>) {
        self.with_cached(key, rank, |c| {
            if failed {
                c.cell.errors.fetch_add(1, Ordering::Relaxed);
            } else {
                c.counts.completed.bump();
                if let Some(ns) = latency_ns {
                    c.cell.samples().push(ns);
                }
            }
            if detached {
                c.cell.detached.fetch_add(1, Ordering::Relaxed);
            }
        });
        if let Some(ns) = latency_ns {
            self.verbose(key, ns, failed, detached);
        }
    }

    pub(super) fn verbose(&self, key: &Key, latency_ns: u64, failed: bool, detached: bool) {
        if self.inner.flags.load(Ordering::Relaxed) & VERBOSE == 0 {
            return;
        }
        let line = verbose_line(key, latency_ns, failed, detached);
        match &self.inner.output {
            Some(out) => out(&line),
            None if self.inner.rank.get() == Some(&0) => println!("{line}"),
            None => {}
        }
    }
}

/// DeepSpeed's verbose line, in the units of the summary.
fn verbose_line(k: &Key, latency_ns: u64, failed: bool, detached: bool) -> String {
    let mut line = format!(
        "comm op: {} | time (us): {:.2} | msg size: {} | ranks: {}",
        k.op,
        latency_ns as f64 / 1e3,
        human_size(k.bytes),
        k.group_size
    );
    if let Some((alg, bus)) = bandwidth(k.op, k.bytes, k.group_size, latency_ns as f64) {
        line.push_str(&format!(" | algbw (GB/s): {alg:.2} | busbw (GB/s): {bus:.2}"));
    }
    if let Some(c) = k.caller {
        line.push_str(&format!(" | caller: {c}"));
    }
    if failed {
        line.push_str(" | FAILED");
    }
    if detached {
        line.push_str(" | detached");
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verbose_line_format() {
        let key = Key { op: "all_reduce", caller: Some("step"), group_size: 4, bytes: 1 << 20 };
        assert_eq!(
            verbose_line(&key, 1_048_576, false, true),
            "comm op: all_reduce | time (us): 1048.58 | msg size: 1.00 MiB | ranks: 4 | algbw (GB/s): 1.00 | busbw (GB/s): 1.50 | caller: step | detached"
        );
    }
}
