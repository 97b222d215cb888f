//! [`CommsLogger`]: DeepSpeed's comms logger as a `tracing_subscriber::Layer` over the op spans.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};
use std::time::{Duration, Instant};

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
}

impl Default for CommsConfig {
    fn default() -> Self {
        CommsConfig { enabled: true, verbose: false, prof_all: true, prof_ops: Vec::new(), debug: false }
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

/// A clock the test drives by hand, for exact latencies (see [`CommsLogger::with_clock`]).
#[derive(Clone, Debug, Default)]
pub struct ManualClock {
    ns: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock at time zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.ns.fetch_add(d.as_nanos() as u64, Ordering::SeqCst);
    }

    /// The time since the clock was created.
    pub fn now(&self) -> Duration {
        Duration::from_nanos(self.ns.load(Ordering::SeqCst))
    }
}

#[derive(Debug)]
enum Clock {
    Monotonic(Instant),
    Manual(ManualClock),
}

impl Clock {
    fn now_ns(&self) -> u64 {
        match self {
            Clock::Monotonic(origin) => origin.elapsed().as_nanos() as u64,
            Clock::Manual(c) => c.ns.load(Ordering::SeqCst),
        }
    }
}

type Output = Arc<dyn Fn(&str) + Send + Sync>;

/// Aggregation key: one row of the summary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Key {
    pub(crate) op: &'static str,
    pub(crate) caller: Option<&'static str>,
    pub(crate) group_size: u32,
    pub(crate) bytes: u64,
}

/// Per-key data: every successful op's latency in call order (kept whole for exact
/// percentiles and the per-call straggler view; 8 bytes per op — `reset` between epochs).
#[derive(Clone, Debug, Default)]
pub(crate) struct Stats {
    pub(crate) samples_ns: Vec<u64>,
    pub(crate) errors: u64,
    pub(crate) detached: u64,
}

/// FxHash (rustc's): the keys are a few short strings and integers, hashed once per op on
/// the recording path, where SipHash's DoS resistance buys nothing.
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher(u64);

impl std::hash::Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
    fn write_u8(&mut self, n: u8) {
        self.write_u64(u64::from(n));
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

type FxBuild = std::hash::BuildHasherDefault<FxHasher>;

#[derive(Default)]
pub(crate) struct Records {
    pub(crate) rows: HashMap<Key, Stats, FxBuild>,
    /// The process's global rank, as the spans report it.
    pub(crate) rank: Option<u32>,
}

/// Kept in the span's extensions from open to close.
struct Pending {
    key: Key,
    rank: u32,
    start_ns: u64,
    failed: bool,
    detached: bool,
}

struct Inner {
    flags: AtomicU8,
    prof_ops: RwLock<Vec<String>>,
    clock: Clock,
    records: Mutex<Records>,
    output: Option<Output>,
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
        Self::build(config, Clock::Monotonic(Instant::now()), None)
    }

    /// A logger whose latencies come from `clock` (tests: exact numbers).
    pub fn with_clock(config: CommsConfig, clock: ManualClock) -> Self {
        Self::build(config, Clock::Manual(clock), None)
    }

    /// Sends the `verbose` lines to `out` (every rank) instead of standard output (rank 0).
    /// Meant for construction: on a logger that was already cloned it starts a fresh one
    /// (same config and clock, no data).
    pub fn with_output(mut self, out: impl Fn(&str) + Send + Sync + 'static) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.output = Some(Arc::new(out));
            return self;
        }
        let clock = match &self.inner.clock {
            Clock::Monotonic(origin) => Clock::Monotonic(*origin),
            Clock::Manual(c) => Clock::Manual(c.clone()),
        };
        Self::build(self.config(), clock, Some(Arc::new(out)))
    }

    fn build(config: CommsConfig, clock: Clock, output: Option<Output>) -> Self {
        let logger = CommsLogger {
            inner: Arc::new(Inner {
                flags: AtomicU8::new(0),
                prof_ops: RwLock::new(Vec::new()),
                clock,
                records: Mutex::new(Records::default()),
                output,
            }),
        };
        logger.configure(config);
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
        }
    }

    pub(crate) fn records(&self) -> MutexGuard<'_, Records> {
        self.inner.records.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Forgets everything recorded (DeepSpeed's `reset_log`), e.g. between epochs.
    pub fn reset(&self) {
        self.records().rows.clear();
    }

    /// Whether anything was recorded (`has_comm_data`).
    pub fn has_data(&self) -> bool {
        !self.records().rows.is_empty()
    }

    /// Ops recorded, failed ones included (`get_comm_operation_count`).
    pub fn operation_count(&self) -> u64 {
        self.records().rows.values().map(|s| s.samples_ns.len() as u64 + s.errors).sum()
    }

    /// Names of the ops recorded, sorted (`get_logged_comm_ops`).
    pub fn logged_ops(&self) -> Vec<String> {
        let mut ops: Vec<String> = self.records().rows.keys().map(|k| k.op.to_owned()).collect();
        ops.sort();
        ops.dedup();
        ops
    }

    /// The summary of what was recorded on this process, without printing.
    pub fn summary(&self) -> Summary {
        let records = self.records();
        let mut keys: Vec<&Key> = records.rows.keys().collect();
        keys.sort();
        let rows = keys.into_iter().map(|k| Row::new(k, &records.rows[k])).collect();
        Summary { rank: records.rank, rows, stragglers: None }
    }

    /// Prints this process's summary table to standard output and returns it (DeepSpeed's
    /// `log_summary(return_dict=True)`; the data is `serde`-serializable). For the
    /// per-rank straggler view see [`log_summary_with_stragglers`](Self::log_summary_with_stragglers).
    pub fn log_summary(&self) -> Summary {
        let s = self.summary();
        println!("{s}");
        s
    }

    fn wants(&self, flags: u8, op: &str) -> bool {
        flags & PROF_ALL != 0 || self.inner.prof_ops.read().unwrap_or_else(|e| e.into_inner()).iter().any(|o| o == op)
    }

    fn record(&self, p: Pending, latency_ns: u64, verbose: bool) {
        {
            let mut records = self.records();
            records.rank.get_or_insert(p.rank);
            let stats = records.rows.entry(p.key).or_default();
            if p.failed {
                stats.errors += 1;
            } else {
                stats.samples_ns.push(latency_ns);
            }
            stats.detached += u64::from(p.detached);
        }
        if verbose {
            let line = verbose_line(&p, latency_ns);
            match &self.inner.output {
                Some(out) => out(&line),
                None if p.rank == 0 => println!("{line}"),
                None => {}
            }
        }
    }
}

/// DeepSpeed's verbose line, in the units of the summary.
fn verbose_line(p: &Pending, latency_ns: u64) -> String {
    let k = &p.key;
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
    if p.failed {
        line.push_str(" | FAILED");
    }
    if p.detached {
        line.push_str(" | detached");
    }
    line
}

/// Interns op names of spans outside the known list (`comm.op` spans carry theirs in a field).
fn intern(name: &str) -> &'static str {
    static NAMES: OnceLock<Mutex<Vec<&'static str>>> = OnceLock::new();
    let mut names = NAMES.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    if let Some(n) = names.iter().find(|n| **n == name) {
        return n;
    }
    let leaked: &'static str = Box::leak(name.to_owned().into_boxed_str());
    names.push(leaked);
    leaked
}

#[derive(Default)]
struct OpFields {
    op: Option<&'static str>,
    bytes: i64,
    group_size: i64,
    rank: i64,
    /// `comm.op` is only read for the shared `comm.op` callsite.
    read_op: bool,
}

impl Visit for OpFields {
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
            Pending { key, rank: f.rank as u32, start_ns: self.inner.clock.now_ns(), failed: false, detached: false };
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
        let latency = self.inner.clock.now_ns().saturating_sub(p.start_ns);
        let verbose = self.inner.flags.load(Ordering::Relaxed) & VERBOSE != 0;
        self.record(p, latency, verbose);
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

    #[test]
    fn verbose_line_format() {
        let p = Pending {
            key: Key { op: "all_reduce", caller: Some("step"), group_size: 4, bytes: 1 << 20 },
            rank: 0,
            start_ns: 0,
            failed: false,
            detached: true,
        };
        assert_eq!(
            verbose_line(&p, 1_048_576),
            "comm op: all_reduce | time (us): 1048.58 | msg size: 1.00 MiB | ranks: 4 | algbw (GB/s): 1.00 | busbw (GB/s): 1.50 | caller: step | detached"
        );
    }
}
