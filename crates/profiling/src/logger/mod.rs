//! [`CommsLogger`]: DeepSpeed's comms logger as a `tracing_subscriber::Layer` over the op spans.

use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock, Weak};

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

mod direct;
mod rows;
mod subscriber;

use rows::Cell;
pub(crate) use rows::{Key, Stats};

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

    /// The rank recorded ops came from, once one was.
    pub(crate) fn recorded_rank(&self) -> Option<u32> {
        self.inner.rank.get().copied()
    }

    /// Names of the ops recorded, sorted (`get_logged_comm_ops`).
    pub fn logged_ops(&self) -> Vec<String> {
        let mut ops: Vec<String> = self.rows().iter().map(|(k, _)| k.op.to_owned()).collect();
        ops.sort();
        ops.dedup();
        ops
    }

    #[inline]
    fn wants(&self, flags: u8, op: &str) -> bool {
        flags & PROF_ALL != 0 || self.inner.prof_ops.read().unwrap_or_else(|e| e.into_inner()).iter().any(|o| o == op)
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

    fn serde_json_like(s: &str) -> CommsConfig {
        serde_json::from_str(s).unwrap()
    }
}
