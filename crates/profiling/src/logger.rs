//! [`CommsLogger`]: DeepSpeed's comms logger as a `tracing_subscriber::Layer` over the op spans.

use std::cell::RefCell;
use std::fmt;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock, Weak};

use comm_core::Completion;
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::Subscriber;
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

use crate::bandwidth::bandwidth;
use crate::summary::{human_size, Row, Summary};
use crate::TARGET;

/// What the logger records, as DeepSpeed's `comms_logger` config section.
///
/// Unlike DeepSpeed, where the section's mere presence switched logging on (and its ops
/// synchronised: DeepSpeed#2861), `enabled` is a value and recording never synchronises.
/// Deserializes from DeepSpeed's JSON (`{"enabled": true, "prof_ops": ["all_reduce"]}`);
/// missing keys take the defaults below.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct CommsConfig {
    /// Record at all (default `true`: adding the layer is the opt-in).
    pub enabled: bool,
    /// Print one line per op as it completes (rank 0, or every rank with
    /// [`CommsLogger::with_output`]).
    pub verbose: bool,
    /// Record every op (default `true`); when `false`, only those in `prof_ops`.
    pub prof_all: bool,
    /// Ops to record when `prof_all` is off, by name (`"all_reduce"`); torch's spellings
    /// (`all_gather_into_tensor`, `reduce_scatter_tensor`, `all_to_all_single`, `isend`,
    /// `irecv`, `inference_all_reduce`) are accepted — DeepSpeed compared against log names
    /// and never matched.
    pub prof_ops: Vec<String>,
    /// Key records by op *and* caller: the name of the span the op was submitted in (with
    /// `#[tracing::instrument]`, the calling function), like DeepSpeed's `[Caller Func: f]`.
    pub debug: bool,
    /// For ops recorded directly ([`ProfilingLayer::with_logger`](crate::ProfilingLayer::with_logger)):
    /// time one call in `sample_every` of messages under `time_all_from` bytes (default 32;
    /// `1` times every call). Every call is *counted*; the latency columns are over the timed
    /// ones ([`Row::timed`](crate::Row::timed)). The first `sample_every` calls of each row
    /// are all timed, the rest are picked by a hash of the call's index, so every rank times
    /// the same calls (the straggler view compares them) and periodic patterns do not alias.
    /// Reading the clock twice costs about as much as a small shared-memory op itself; this
    /// is what keeps the logger under 5 % there.
    pub sample_every: u32,
    /// Messages of at least this many bytes are timed on every call (default 64 KiB: such
    /// ops take microseconds, next to which the clock is noise).
    pub time_all_from: u64,
}

impl Default for CommsConfig {
    fn default() -> Self {
        CommsConfig {
            enabled: true,
            verbose: false,
            prof_all: true,
            prof_ops: Vec::new(),
            debug: false,
            sample_every: 32,
            time_all_from: 64 << 10,
        }
    }
}

const ENABLED: u8 = 1;
const VERBOSE: u8 = 2;
const PROF_ALL: u8 = 4;
const DEBUG: u8 = 8;

/// The op name the library uses for a torch/DeepSpeed spelling.
fn canonical_op(name: &str) -> &str {
    match name.trim() {
        "all_gather_into_tensor" | "all_gather_base" => "all_gather",
        "reduce_scatter_tensor" | "reduce_scatter_base" => "reduce_scatter",
        "all_to_all_single" => "all_to_all",
        "isend" => "send",
        "irecv" => "recv",
        "inference_all_reduce" => "all_reduce",
        other => other,
    }
}

type Output = Arc<dyn Fn(&str) + Send + Sync>;

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
    key: Key,
    /// The row's number in [`Inner::rows`] (from 1), carried by tickets.
    row: NonZeroU32,
    threads: Mutex<Vec<Arc<ThreadCounts>>>,
    errors: AtomicU64,
    detached: AtomicU64,
    samples_ns: Mutex<Vec<u64>>,
}

/// One thread's counts in one row; successes = submitted (direct) − taken back (direct
/// failures) + completed (from spans).
#[derive(Debug, Default)]
struct ThreadCounts {
    submitted: LocalCount,
    taken_back: LocalCount,
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
struct LocalCount {
    n: AtomicU64,
    base: AtomicU64,
}

impl LocalCount {
    /// Only from the thread that owns the counter; returns the count before.
    fn bump(&self) -> u64 {
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
    fn samples(&self) -> MutexGuard<'_, Vec<u64>> {
        self.samples_ns.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn threads(&self) -> MutexGuard<'_, Vec<Arc<ThreadCounts>>> {
        self.threads.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn stats(&self) -> Stats {
        Stats {
            count: self.threads().iter().map(|t| t.count()).sum(),
            samples_ns: self.samples().clone(),
            errors: self.errors.load(Ordering::Relaxed),
            detached: self.detached.load(Ordering::Relaxed),
        }
    }

    fn clear(&self) {
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
struct Cached {
    logger: u64,
    key: Key,
    row: NonZeroU32,
    cell: Arc<Cell>,
    counts: Arc<ThreadCounts>,
}

thread_local! {
    static CACHE: RefCell<Vec<Cached>> = const { RefCell::new(Vec::new()) };
}

/// Entries kept per thread before the cache starts over (a program with more rows than this
/// only pays the map lock more often).
const CACHE_CAP: usize = 256;

/// splitmix64's finaliser: a call index to a well-mixed word, to pick the timed calls.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// [`Ticket::start`] of a call that is not timed.
const UNTIMED: u64 = u64::MAX;

/// What [`CommsLogger::begin`] decided for one op recorded directly; handed back when the op
/// completes. Two words, so it travels in registers on the hot path.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ticket {
    /// The op's row ([`Cell::row`]).
    row: NonZeroU32,
    /// The clock at submission (its ticks); [`UNTIMED`] when the call is not timed.
    start: u64,
}

const _: () = assert!(std::mem::size_of::<Option<Ticket>>() == 16);

impl Ticket {
    /// Whether the call is timed (its completion hook then carries the logger itself).
    pub(crate) fn is_timed(&self) -> bool {
        self.start != UNTIMED
    }
}

/// Kept in the span's extensions from open to close.
struct Pending {
    key: Key,
    rank: u32,
    start: u64,
    failed: bool,
    detached: bool,
}

struct Inner {
    /// Unique per logger (never reused), naming it in per-thread caches and in span fields.
    id: u64,
    flags: AtomicU8,
    sample_every: AtomicU32,
    /// `u64::MAX / sample_every`: a call is timed when the hash of its index is below (a
    /// compare instead of a division on the hot path).
    sample_below: AtomicU64,
    time_all_from: AtomicU64,
    prof_ops: RwLock<Vec<String>>,
    /// Raw TSC ticks (calibrated against the OS clock), or a mock in tests.
    clock: quanta::Clock,
    /// Every row ever recorded; `reset` clears the cells but keeps them, so cached handles
    /// stay valid. FxHash: short keys hashed on the recording path, where SipHash's DoS
    /// resistance buys nothing.
    cells: Mutex<FxHashMap<Key, Arc<Cell>>>,
    /// The same cells by row number (minus one), for tickets whose row is not in the
    /// completing thread's cache.
    rows: RwLock<Vec<Arc<Cell>>>,
    /// The process's global rank, as the ops report it.
    rank: OnceLock<u32>,
    output: Option<Output>,
}

/// Every live logger by id, so a completion hook can find its logger without holding a
/// reference (which would cost two atomic operations on one cache line from two threads for
/// every op that completes off the submitting thread).
fn registry() -> &'static Mutex<Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    REGISTRY.get_or_init(Mutex::default)
}

type Registry = Vec<(u64, Weak<Inner>)>;

impl Inner {
    /// Nanoseconds since the raw timestamp `start`.
    fn elapsed_ns(&self, start: u64) -> u64 {
        self.clock.delta_as_nanos(start, self.clock.raw())
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        registry().lock().unwrap_or_else(|e| e.into_inner()).retain(|(id, _)| *id != self.id);
    }
}

/// DeepSpeed's `CommsLogger`, rebuilt on the op spans of [`Profiling`](crate::Profiling):
/// a `tracing_subscriber::Layer` that aggregates, per op, caller (with `debug`), group size
/// and message size: count, total / avg / min / p50 / max latency, algbw and busbw (GB/s,
/// nccl-tests definitions, see [`bandwidth`](crate::bandwidth)).
///
/// ```
/// use tracing_subscriber::layer::SubscriberExt;
/// use profiling::{CommsConfig, CommsLogger};
/// let logger = CommsLogger::new(CommsConfig::default());
/// let subscriber = tracing_subscriber::registry().with(logger.clone());
/// // tracing::subscriber::set_global_default(subscriber), run ops through a
/// // `Profiling` layer, then:
/// # drop(subscriber);
/// let summary = logger.summary();   // or `log_summary()` to print the table too
/// assert!(summary.rows.is_empty());
/// ```
///
/// Differences from DeepSpeed (`shared/reference/deepspeed-comm.md` §4), on purpose:
/// latencies are per call (DeepSpeed's timer regression made them cumulative); nothing is
/// synchronised to measure (the span ends when the op completes); reduce_scatter's size is
/// not multiplied by n again; `n` is the op's group, not the world; bandwidth is GB/s like
/// nccl-tests, not Gbit/s; averages are plain means (DeepSpeed: 10 %-trimmed) and min / p50
/// / max are shown; an op the formulas do not know shows latency only instead of exiting the
/// process; failed ops are counted apart and left out of the latency statistics.
///
/// Clones share the same data.
#[derive(Clone)]
pub struct CommsLogger {
    inner: Arc<Inner>,
}

impl fmt::Debug for CommsLogger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CommsLogger").field("config", &self.config()).field("clock", &self.inner.clock).finish()
    }
}

impl Default for CommsLogger {
    fn default() -> Self {
        CommsLogger::new(CommsConfig::default())
    }
}

impl CommsLogger {
    /// A logger with `config`, timing spans with the monotonic clock.
    pub fn new(config: CommsConfig) -> Self {
        Self::build(config, quanta::Clock::new(), None)
    }

    /// A logger whose latencies come from `clock`; with [`quanta::Clock::mock`], a clock the
    /// test drives by hand, for exact numbers.
    pub fn with_clock(config: CommsConfig, clock: quanta::Clock) -> Self {
        Self::build(config, clock, None)
    }

    /// Sends the `verbose` lines to `out` (every rank) instead of standard output (rank 0).
    /// Meant for construction: on a logger that was already cloned it starts a fresh one
    /// (same config and clock, no data).
    pub fn with_output(mut self, out: impl Fn(&str) + Send + Sync + 'static) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.output = Some(Arc::new(out));
            return self;
        }
        Self::build(self.config(), self.inner.clock.clone(), Some(Arc::new(out)))
    }

    fn build(config: CommsConfig, clock: quanta::Clock, output: Option<Output>) -> Self {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let logger = CommsLogger {
            inner: Arc::new(Inner {
                id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                flags: AtomicU8::new(0),
                sample_every: AtomicU32::new(1),
                sample_below: AtomicU64::new(u64::MAX),
                time_all_from: AtomicU64::new(0),
                prof_ops: RwLock::new(Vec::new()),
                clock,
                cells: Mutex::new(FxHashMap::default()),
                rows: RwLock::new(Vec::new()),
                rank: OnceLock::new(),
                output,
            }),
        };
        logger.configure(config);
        let mut registry = registry().lock().unwrap_or_else(|e| e.into_inner());
        registry.push((logger.inner.id, Arc::downgrade(&logger.inner)));
        drop(registry);
        logger
    }

    /// Changes what is recorded from now on (DeepSpeed's `configure`).
    pub fn configure(&self, config: CommsConfig) {
        let ops = config.prof_ops.iter().map(|o| canonical_op(o).to_owned()).collect();
        *self.inner.prof_ops.write().unwrap_or_else(|e| e.into_inner()) = ops;
        let flags =
            [(config.enabled, ENABLED), (config.verbose, VERBOSE), (config.prof_all, PROF_ALL), (config.debug, DEBUG)]
                .iter()
                .filter(|(on, _)| *on)
                .fold(0, |acc, (_, bit)| acc | bit);
        let every = config.sample_every.max(1);
        self.inner.sample_every.store(every, Ordering::Relaxed);
        self.inner.sample_below.store(u64::MAX / u64::from(every), Ordering::Relaxed);
        self.inner.time_all_from.store(config.time_all_from, Ordering::Relaxed);
        self.inner.flags.store(flags, Ordering::Release);
    }

    /// The current configuration.
    pub fn config(&self) -> CommsConfig {
        let flags = self.inner.flags.load(Ordering::Acquire);
        CommsConfig {
            enabled: flags & ENABLED != 0,
            verbose: flags & VERBOSE != 0,
            prof_all: flags & PROF_ALL != 0,
            prof_ops: self.inner.prof_ops.read().unwrap_or_else(|e| e.into_inner()).clone(),
            debug: flags & DEBUG != 0,
            sample_every: self.inner.sample_every.load(Ordering::Relaxed),
            time_all_from: self.inner.time_all_from.load(Ordering::Relaxed),
        }
    }

    /// Identifies this logger (and its clones) in the `comm.logger` field of op spans.
    pub(crate) fn id(&self) -> u64 {
        self.inner.id
    }

    fn cells(&self) -> MutexGuard<'_, FxHashMap<Key, Arc<Cell>>> {
        self.inner.cells.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every row with data, in key order.
    pub(crate) fn rows(&self) -> Vec<(Key, Stats)> {
        let mut rows: Vec<(Key, Stats)> =
            self.cells().iter().map(|(k, c)| (*k, c.stats())).filter(|(_, s)| s.count + s.errors > 0).collect();
        rows.sort_by_key(|r| r.0);
        rows
    }

    /// Forgets everything recorded (DeepSpeed's `reset_log`), e.g. between epochs.
    pub fn reset(&self) {
        self.cells().values().for_each(|c| c.clear());
    }

    /// Whether anything was recorded (`has_comm_data`).
    pub fn has_data(&self) -> bool {
        !self.rows().is_empty()
    }

    /// Ops recorded, failed ones included (`get_comm_operation_count`).
    pub fn operation_count(&self) -> u64 {
        self.rows().iter().map(|(_, s)| s.count + s.errors).sum()
    }

    /// Names of the ops recorded, sorted (`get_logged_comm_ops`).
    pub fn logged_ops(&self) -> Vec<String> {
        let mut ops: Vec<String> = self.rows().iter().map(|(k, _)| k.op.to_owned()).collect();
        ops.sort();
        ops.dedup();
        ops
    }

    /// The summary of what was recorded on this process, without printing.
    pub fn summary(&self) -> Summary {
        let rows = self.rows().iter().map(|(k, s)| Row::new(k, s)).collect();
        Summary { rank: self.inner.rank.get().copied(), rows, stragglers: None }
    }

    /// Prints this process's summary table to standard output and returns it (DeepSpeed's
    /// `log_summary(return_dict=True)`; the data is `serde`-serializable). For the
    /// per-rank straggler view see [`log_summary_with_stragglers`](Self::log_summary_with_stragglers).
    pub fn log_summary(&self) -> Summary {
        let s = self.summary();
        println!("{s}");
        s
    }

    #[inline]
    fn wants(&self, flags: u8, op: &str) -> bool {
        flags & PROF_ALL != 0 || self.inner.prof_ops.read().unwrap_or_else(|e| e.into_inner()).iter().any(|o| o == op)
    }

    /// The direct path's start ([`Profiling`](crate::Profiling) with a logger): counts the
    /// op as a success and decides whether to time it. Then [`end_inline`](Self::end_inline)
    /// on the submitting thread, or [`end`](Self::end) from the completion hook when
    /// [`needs_end`](Self::needs_end).
    #[inline]
    pub(crate) fn begin(&self, op: &'static str, bytes: u64, group_size: u32, rank: u32) -> Option<Ticket> {
        let flags = self.inner.flags.load(Ordering::Relaxed);
        if flags & ENABLED == 0 || !self.wants(flags, op) {
            return None;
        }
        let caller = if flags & DEBUG != 0 { tracing::Span::current().metadata().map(|m| m.name()) } else { None };
        let key = Key { op, caller, group_size, bytes };
        let (row, index) = self.with_cached(&key, rank, |c| (c.row, c.counts.submitted.bump()));
        let timed = index < u64::from(self.inner.sample_every.load(Ordering::Relaxed))
            || flags & VERBOSE != 0
            || bytes >= self.inner.time_all_from.load(Ordering::Relaxed)
            || mix(index) < self.inner.sample_below.load(Ordering::Relaxed);
        let start = if timed { self.inner.clock.raw() } else { UNTIMED };
        Some(Ticket { row, start })
    }

    /// An op [`begin`](Self::begin) counted finished inline: only a failure or a timed call
    /// has anything left to record.
    #[inline]
    pub(crate) fn end_inline(&self, t: Ticket, c: Completion<'_>) {
        if c.error.is_some() || t.is_timed() {
            self.end_inline_rest(t, c);
        }
    }

    #[inline(never)]
    fn end_inline_rest(&self, t: Ticket, c: Completion<'_>) {
        if let Some(key) = self.key_of(t) {
            self.end(&key, t, c);
        }
    }

    /// The key of `t`'s row (from this thread's cache, else the logger's list of rows).
    pub(crate) fn key_of(&self, t: Ticket) -> Option<Key> {
        let id = self.inner.id;
        let cached =
            CACHE.with(|cache| cache.borrow().iter().find(|c| c.logger == id && c.row == t.row).map(|c| c.key));
        cached.or_else(|| {
            let rows = self.inner.rows.read().unwrap_or_else(|e| e.into_inner());
            rows.get(t.row.get() as usize - 1).map(|c| c.key)
        })
    }

    /// Completes the record of an op [`begin`](Self::begin) counted as a success, on the
    /// thread that sees it complete: takes a failure back out (on this thread's own counter)
    /// and counts it as an error, and adds the latency of a timed call. An untimed success
    /// has nothing left to do: see [`needs_end`](Self::needs_end).
    pub(crate) fn end(&self, key: &Key, t: Ticket, c: Completion<'_>) {
        let failed = c.error.is_some();
        let latency = t.is_timed().then(|| self.inner.elapsed_ns(t.start));
        let rank = self.inner.rank.get().copied().unwrap_or(0);
        self.with_cached(key, rank, |e| {
            if failed {
                e.counts.taken_back.bump();
                e.cell.errors.fetch_add(1, Ordering::Relaxed);
            } else if let Some(ns) = latency {
                e.cell.samples().push(ns);
            }
            if c.detached {
                e.cell.detached.fetch_add(1, Ordering::Relaxed);
            }
        });
        if let Some(ns) = latency {
            self.verbose(key, ns, failed, c.detached);
        }
    }

    /// Whether [`end`](Self::end) has anything to record for this completion.
    pub(crate) fn needs_end(t: Ticket, c: Completion<'_>) -> bool {
        c.error.is_some() || c.detached || t.is_timed()
    }

    /// The live logger with this id, for a completion hook that did not carry one (a rare
    /// failed or detached untimed op).
    pub(crate) fn find(id: u64) -> Option<CommsLogger> {
        let registry = registry().lock().unwrap_or_else(|e| e.into_inner());
        registry.iter().find(|(i, _)| *i == id).and_then(|(_, w)| w.upgrade()).map(|inner| CommsLogger { inner })
    }

    /// Runs `f` on this thread's cache entry for `key` (made on first use).
    #[inline]
    fn with_cached<T>(&self, key: &Key, rank: u32, f: impl FnOnce(&Cached) -> T) -> T {
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
    fn record(&self, key: &Key, rank: u32, failed: bool, detached: bool, latency_ns: Option<u64>) {
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

    fn verbose(&self, key: &Key, latency_ns: u64, failed: bool, detached: bool) {
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

/// Distinct op names [`intern`] keeps; later ones share the row name [`OTHER_OP`].
const MAX_OTHER_OPS: usize = 64;
const OTHER_OP: &str = "other";

/// The op name of a `comm.op` span (an op outside the layer's known list, whose name comes
/// in a field) as the `'static` name of its row. Field values are arbitrary strings, so the
/// names kept are bounded: op types are few, but a stray span must not grow memory forever.
fn intern(name: &str) -> &'static str {
    static NAMES: [OnceLock<Box<str>>; MAX_OTHER_OPS] = [const { OnceLock::new() }; MAX_OTHER_OPS];
    static USED: Mutex<usize> = Mutex::new(0);
    let mut used = USED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(n) = NAMES[..*used].iter().filter_map(OnceLock::get).find(|n| ***n == *name) {
        return n;
    }
    let Some(slot) = NAMES.get(*used) else { return OTHER_OP };
    *used += 1;
    slot.get_or_init(|| name.into())
}

#[derive(Default)]
struct OpFields {
    op: Option<&'static str>,
    bytes: i64,
    group_size: i64,
    rank: i64,
    /// `comm.logger`: the logger that records the op directly, if any.
    logger: Option<u64>,
    /// `comm.op` is only read for the shared `comm.op` callsite.
    read_op: bool,
}

impl Visit for OpFields {
    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "comm.logger" {
            self.logger = Some(value);
        }
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        match field.name() {
            "comm.bytes" => self.bytes = value,
            "comm.group_size" => self.group_size = value,
            "comm.rank" => self.rank = value,
            _ => {}
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        if self.read_op && field.name() == "comm.op" {
            self.op = Some(intern(value));
        }
    }
    fn record_debug(&mut self, _: &Field, _: &dyn fmt::Debug) {}
}

struct EndFields<'a>(&'a mut Pending);

impl Visit for EndFields<'_> {
    fn record_bool(&mut self, field: &Field, value: bool) {
        if field.name() == "comm.detached" {
            self.0.detached = value;
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "otel.status_code" {
            self.0.failed = value.eq_ignore_ascii_case("error");
        }
    }
    fn record_debug(&mut self, _: &Field, _: &dyn fmt::Debug) {}
}

impl<S> Layer<S> for CommsLogger
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let flags = self.inner.flags.load(Ordering::Relaxed);
        let meta = attrs.metadata();
        if flags & ENABLED == 0 || meta.target() != TARGET {
            return;
        }
        let Some(short) = meta.name().strip_prefix("comm.") else { return };
        let mut f = OpFields { read_op: short == "op", ..OpFields::default() };
        attrs.record(&mut f);
        if f.logger == Some(self.inner.id) {
            return; // recorded directly, without the span
        }
        let op = if f.read_op { f.op } else { Some(short) };
        // Spans of the target without op fields (e.g. comm.new_group) have no group size.
        let Some(op) = op.filter(|_| f.group_size > 0) else { return };
        if !self.wants(flags, op) {
            return;
        }
        let Some(span) = ctx.span(id) else { return };
        let caller = if flags & DEBUG != 0 { span.parent().map(|p| p.name()) } else { None };
        let key = Key { op, caller, group_size: f.group_size as u32, bytes: f.bytes.max(0) as u64 };
        let pending =
            Pending { key, rank: f.rank as u32, start: self.inner.clock.raw(), failed: false, detached: false };
        span.extensions_mut().insert(pending);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut ext = span.extensions_mut();
        if let Some(p) = ext.get_mut::<Pending>() {
            values.record(&mut EndFields(p));
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else { return };
        let Some(p) = span.extensions_mut().remove::<Pending>() else { return };
        let latency = self.inner.elapsed_ns(p.start);
        self.record(&p.key, p.rank, p.failed, p.detached, Some(latency));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_round_trips_and_reads_deepspeed_json() {
        let cfg: CommsConfig =
            serde_json_like(r#"{"enabled": true, "verbose": true, "prof_all": false, "prof_ops": ["all_reduce"]}"#);
        assert!(cfg.enabled && cfg.verbose && !cfg.prof_all && !cfg.debug);
        let logger = CommsLogger::new(CommsConfig {
            prof_ops: vec!["reduce_scatter_tensor".into(), "isend".into()],
            ..cfg.clone()
        });
        assert_eq!(logger.config().prof_ops, ["reduce_scatter", "send"]);
        assert!(logger.wants(logger.inner.flags.load(Ordering::Relaxed), "send"));
        assert!(!logger.wants(logger.inner.flags.load(Ordering::Relaxed), "all_reduce"));
        assert!(CommsConfig::default().prof_all && CommsConfig::default().enabled);
    }

    #[test]
    fn sampling_times_the_first_calls_then_one_in_n_by_a_hash_of_the_index() {
        let cfg = CommsConfig { sample_every: 4, time_all_from: 1000, ..CommsConfig::default() };
        let logger = CommsLogger::new(cfg);
        let timed: Vec<bool> = (0..4000).map(|_| logger.begin("all_reduce", 8, 2, 0).unwrap().is_timed()).collect();
        assert!(timed[..4].iter().all(|t| *t));
        let n = timed.iter().filter(|t| **t).count();
        assert!((900..1100).contains(&n), "{n} of 4000 timed, expected about 1000");
        // The same calls on every rank: a fresh logger (a fresh per-thread index) picks the same.
        let again = CommsLogger::new(logger.config());
        assert!((0..4000).all(|i| again.begin("all_reduce", 8, 2, 0).unwrap().is_timed() == timed[i]));
        // Large messages: every call.
        assert!((0..100).all(|_| logger.begin("all_reduce", 1000, 2, 0).unwrap().is_timed()));
        // Not a periodic pick: some window of 4 consecutive calls has no timed call.
        assert!(timed[4..].chunks(4).any(|w| w.iter().all(|t| !*t)));
    }

    fn serde_json_like(s: &str) -> CommsConfig {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn interned_names_are_shared_and_bounded() {
        let a = intern("intern_test_op");
        assert!(std::ptr::eq(a, intern(&String::from("intern_test_op"))));
        // Other tests may hold slots too: fill whatever is left, then names share a row.
        for i in 0..MAX_OTHER_OPS {
            intern(&format!("intern_test_{i}"));
        }
        assert_eq!(intern("intern_test_one_too_many"), OTHER_OP);
        assert_eq!(intern("intern_test_op"), "intern_test_op");
    }

    #[test]
    fn verbose_line_format() {
        let key = Key { op: "all_reduce", caller: Some("step"), group_size: 4, bytes: 1 << 20 };
        assert_eq!(
            verbose_line(&key, 1_048_576, false, true),
            "comm op: all_reduce | time (us): 1048.58 | msg size: 1.00 MiB | ranks: 4 | algbw (GB/s): 1.00 | busbw (GB/s): 1.50 | caller: step | detached"
        );
    }
}
