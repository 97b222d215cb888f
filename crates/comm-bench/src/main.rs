//! `comm-bench`: an nccl-tests–style bandwidth benchmark of the comm collectives, run as one
//! process per rank (`commrun -n 2 -- comm-bench ...`, or `cargo xtask bench`).
//!
//! For every (op, dtype, size) it fills known inputs, runs warm-up iterations, a barrier and
//! the timed iterations (mean wall time per op, maximum over ranks), then one checked
//! iteration whose wrong elements are counted on every rank and summed. Rank 0 prints the
//! table and optionally writes JSON; every rank exits 1 when any element was wrong.

mod baseline;
mod cases;
mod compare;
#[cfg(feature = "profiling")]
mod overhead;
mod plot;
mod progress;
#[cfg(feature = "mpi-raw")]
mod rawmpi;

/// mpi-raw's buffers are plain heap memory (see `rawmpi::heap_copy`).
#[cfg(feature = "mpi-raw")]
use rawmpi::heap_copy;
#[cfg(not(feature = "mpi-raw"))]
fn heap_copy(b: &HostBuffer) -> HostBuffer {
    b.clone()
}
mod report;
mod saved;
mod sizes;
mod tasks;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use comm_api::{CommError, Config, DType, HostBuffer, InOut, P2POp, ProcessGroup, ReduceOp};

use baseline::Baseline;
use cases::{shape, Case, Coll};
use report::Row;

/// Slices of a row's timed iterations when backends are interleaved: enough that each
/// backend's share spans the row, few enough that a slice's barrier costs nothing.
const SLICES: usize = 8;
/// Default timed iterations move about this many bytes per row...
const TARGET_BYTES: usize = 4 << 30;
/// ...within these bounds.
const ITERS_MIN: usize = 5;
const ITERS_MAX: usize = 10_000;
/// Small ops settle for a few ms after start (threads placed, caches warm): a tenth of the
/// iterations, up to this many, run untimed first.
const WARMUP_MAX: usize = 1000;

const AFTER_HELP: &str = "\
SIZES (nccl-tests conventions, see shared/reference/nccl-tests-bw.md):
  --sizes takes a comma list of sizes or ranges: 8B..64MiB (doubling), 8B..64MiB:x8 (times 8
  per step), 1MiB..8MiB:+1MiB (adding), 8B,1KiB,1MiB. Units are binary and case-insensitive:
  B, K/KiB, M/MiB, G/GiB. A requested size S gives count = S / T (T = element size) and:
    op                             buffers                             size(B) column
    all_reduce, broadcast, reduce  one of `count` elements             count * T
    all_gather                     in: count, out: n * count           full output, n * count * T
    reduce_scatter                 in: n * count, out: count           full input, n * count * T
    all_to_all                     in = out: n * count (count/peer)    send buffer, n * count * T
    scatter                        root's in: n * count, out: count    root's input, n * count * T
    gather                         in: count, root's out: n * count    root's output, n * count * T
    sendrecv                       in = out: count                     the message, count * T
  where the per-rank `count` of all_gather .. gather is (S / T / n) rounded down to a multiple
  of 16 bytes, so size(B) may be slightly below the requested size; a size that leaves no
  element per rank is skipped.

TIMING:
  time(us) = mean wall time of one op over the timed iterations, the maximum over ranks.
  algbw = size(B) / time; busbw = algbw * factor with factor 2(n-1)/n for all_reduce,
  (n-1)/n for all_gather, reduce_scatter, all_to_all, scatter and gather, 1 for broadcast,
  reduce and sendrecv.
  GB/s means 10^9 bytes per second. Without --iters, iterations = clamp(4 GiB / size, 5, 10000);
  without --warmup, warm-up = clamp(iters / 10, 2, 1000). Before the first row, its op runs
  untimed for --settle milliseconds (default 500; not with --profile or --trace): a new
  process's first few hundred milliseconds can run slow on a shared machine.
  Every op reuses its buffers across iterations, as in nccl-tests: ops that read one buffer
  and fill another hand both back.

CHECKING:
  After the timed loop one more iteration runs on fresh known inputs (small integers, exact
  in every dtype; sums stay exact up to 63 ranks). #wrong is the number of wrong elements,
  summed over ranks; any wrong element makes every rank exit 1.

JSON (--json PATH, written by rank 0; schema 1):
  schema      1 (raised when a field changes meaning or goes away)
  host        host name;  cpu: CPU model (/proc/cpuinfo);  nproc: CPUs available to rank 0
  git_rev     git revision (env COMM_BENCH_GIT_REV, as cargo xtask bench sets it; else the
              source tree this binary was built from; null when unknown)
  start, end  RFC 3339 UTC times of the first row's start and the last row's end;
              timestamp: the same as end (older readers)
  backend, np the backend and the number of ranks;  time: what time_us means
  args        comm-bench's arguments
  rows        one object per table line: op, dtype, bytes (size(B)), count, redop (\"none\" for
              data movement), root (-1: none), iters, warmup, time_us, algbw_gbps, busbw_gbps
              (GB/s = 1e9 B/s), wrong (null with --no-check), backend, np, and with --percentiles
              p50_us / p99_us (per-op time of the slowest rank)
  Readers (--baseline, comm-bench plot) ignore unknown fields, and rows without backend / np
  take the document's.

BASELINE (--baseline PATH[,PATH...]):
  Compares this run with saved --json reports: each table line gains base(GB/s), the saved
  busbw, and new/old = busbw(this run) / busbw(saved), above 1 when this run is faster. Rows
  match on (backend, op, dtype, bytes, np); a row the baseline lacks shows `-`. The footer
  gives the geometric mean, min and max of new/old.

PROGRESS (--progress, on rank 0's stderr; stdout keeps the table):
  auto: a bar redrawn in place when stderr is a terminal, nothing otherwise (under commrun or
  mpirun, or redirected); bar; lines: `comm-bench progress: DONE/TOTAL ROW` per row, for a
  launcher that draws its own bar (cargo xtask bench); off.

PLOT (comm-bench plot --svg OUT.svg REPORT.json...):
  busbw (GB/s) against size (log2 axis, ticks in B/KiB/MiB/GiB), one line per backend and
  dtype (and op, where the reports hold several), with a legend and a title naming the host,
  CPU, ranks and git revision. Reports of several runs (one per backend, say) go on one plot.
  Reports of several rank counts plot busbw against ranks instead, one panel per size (those
  nearest 8 B, 4 KiB, 1 MiB and 64 MiB).

SCALING (comm-bench scaling BACKEND=REPORT[,REPORT...]...):
  Reports of several rank counts (and rounds), per backend: each row's median time and busbw
  at every count, and the largest count's busbw and time over the smallest's.

ENVIRONMENT:
  The launcher's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...), COMM_BACKEND, COMM_TIMEOUT.";

/// nccl-tests–style collective benchmark; run one process per rank (commrun -n N -- comm-bench).
#[derive(Parser, Debug)]
#[command(name = "comm-bench", version, after_help = AFTER_HELP, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Ops, comma-separated: all_reduce, all_gather, reduce_scatter, broadcast, all_to_all,
    /// reduce, sendrecv (each rank sends to the next and receives from the previous), scatter,
    /// gather, or `all`.
    #[arg(long, value_delimiter = ',', default_value = "all_reduce", value_name = "OPS")]
    op: Vec<String>,
    /// Element types, comma-separated: u8, i8, i32, i64, f16, bf16, f32, f64, or `all`.
    #[arg(long, value_delimiter = ',', default_value = "f32", value_name = "DTYPES")]
    dtype: Vec<String>,
    /// Message sizes (see SIZES below).
    #[arg(long, default_value = "8B..64MiB", value_name = "SPEC")]
    sizes: String,
    /// Reduce op of all_reduce, reduce_scatter and reduce: sum, prod, min, max, avg.
    #[arg(long, default_value = "sum")]
    redop: String,
    /// Root rank of broadcast, reduce, scatter and gather.
    #[arg(long, default_value_t = 0)]
    root: u32,
    /// Timed iterations per row (default: adaptive, see TIMING).
    #[arg(long, short = 'n', value_parser = clap::value_parser!(u64).range(1..))]
    iters: Option<u64>,
    /// Warm-up iterations per row (default: adaptive).
    #[arg(long, short = 'w')]
    warmup: Option<u64>,
    /// Milliseconds the first row runs untimed before anything is timed (a new process's
    /// first few hundred milliseconds can run slow on a shared machine; 0: none).
    #[arg(long, default_value_t = 500, value_name = "MS")]
    settle: u64,
    /// Write the results as JSON to this file (rank 0).
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
    /// Compare with saved --json reports: each row gains the saved busbw and new/old (see
    /// BASELINE below).
    #[arg(long, value_delimiter = ',', value_name = "PATH")]
    baseline: Vec<PathBuf>,
    /// Progress on rank 0's stderr (see PROGRESS below).
    #[arg(long, value_enum, default_value = "auto", value_name = "MODE")]
    progress: progress::Mode,
    /// Check every row's results (the default).
    #[arg(long, overrides_with = "no_check")]
    check: bool,
    /// Do not check results (#wrong shows N/A).
    #[arg(long, overrides_with = "check")]
    no_check: bool,
    /// In-place ops (all_reduce, broadcast, reduce) use a buffer from `alloc_buffer`: the
    /// backend's zero-copy memory where it has one.
    #[arg(long)]
    zero_copy: bool,
    /// Also time every row on streams of the group (`pg.streams()`): a direct one
    /// (`<backend>-stream-direct`, where `COMM_STREAMS_DIRECT` leaves one) and an arbitrated
    /// one (`<backend>-stream`), interleaved with the group itself in every row: the cost of a
    /// stream op.
    #[arg(long, conflicts_with = "interleave")]
    stream: bool,
    /// Instead of the table: all_reduce (first --dtype) at every size on N streams (keys
    /// `0..N`) from N threads at once, against one stream alone, in alternating slices; prints
    /// the time per op of each (the N threads' together: their aggregate rate).
    #[arg(long, value_name = "N", conflicts_with_all = ["interleave", "stream"], value_parser = clap::value_parser!(u32).range(2..=64))]
    tasks: Option<u32>,
    /// Profile every op (a span each, recorded by a CommsLogger) and print the CommsLogger
    /// summary with the per-rank straggler view after the bench (feature `profiling`).
    #[arg(long, conflicts_with = "profile_overhead")]
    profile: bool,
    /// Instead of the table: run each row with profiling off, on with no subscriber, and on
    /// with a CommsLogger, interleaved, and print the overhead (feature `profiling`).
    #[arg(long)]
    profile_overhead: bool,
    /// Also time every op on its own and report the median and the 99th percentile of the
    /// per-op time (each op's slowest rank) in p50(us) / p99(us) columns: the tail that
    /// latency-bound users (inference) care about.
    #[arg(long)]
    percentiles: bool,
    /// Also time every row on BACKEND (only `mpi-raw`: start comm-bench with `mpirun`; beside
    /// the mpi backend MPI must provide MPI_THREAD_MULTIPLE), in
    /// slices that alternate with this backend's within the row, so that both see the same
    /// machine: on a shared machine whose speed changes by 2x for seconds at a time, runs of
    /// one backend after the other compare whichever was lucky. Each backend's rows are
    /// printed (the other's marked with its name) and, with --json, written to PATH with
    /// `{backend}` replaced by the backend's name.
    #[arg(long, value_name = "BACKEND")]
    interleave: Option<String>,
    /// Write a per-rank timeline of every benchmarked op to PATH as Chrome trace-event JSON
    /// (opens in Perfetto or chrome://tracing), one track per rank, clocks aligned across
    /// ranks; rank 0 writes the merged file (feature `profiling`).
    #[arg(long, value_name = "PATH", conflicts_with = "profile_overhead")]
    trace: Option<PathBuf>,
}

/// What comm-bench does other than benchmarking.
#[derive(Subcommand, Debug)]
enum Command {
    /// Plot saved --json reports as an SVG (see PLOT in `comm-bench --help`).
    Plot(plot::PlotArgs),
    /// Saved --json reports side by side (`BACKEND=REPORT[,REPORT...]`, several reports being
    /// rounds of one backend: median and spread per row), with time ratios to the first.
    Compare(compare::CompareArgs),
    /// Saved --json reports of several rank counts (`BACKEND=REPORT[,REPORT...]`): per row,
    /// time and busbw at every count, and the largest count's over the smallest's.
    Scaling(compare::CompareArgs),
}

/// The parsed, validated request.
#[derive(Debug)]
struct Plan {
    colls: Vec<Coll>,
    dtypes: Vec<DType>,
    sizes: Vec<usize>,
    sizes_spec: String,
    redop: ReduceOp,
    root: u32,
    iters: Option<usize>,
    warmup: Option<usize>,
    settle: Duration,
    json: Option<PathBuf>,
    baseline: Option<Baseline>,
    progress: progress::Mode,
    check: bool,
    zero_copy: bool,
    stream: bool,
    tasks: Option<usize>,
    // Only acted on with the `profiling` feature; without it `from_cli` refuses them.
    #[cfg_attr(not(feature = "profiling"), allow(dead_code))]
    profile: bool,
    #[cfg_attr(not(feature = "profiling"), allow(dead_code))]
    profile_overhead: bool,
    #[cfg_attr(not(feature = "profiling"), allow(dead_code))]
    trace: Option<PathBuf>,
    percentiles: bool,
    /// `--interleave mpi-raw`.
    interleave: bool,
}

impl Plan {
    fn from_cli(cli: Cli) -> Result<Plan, String> {
        let mut colls = Vec::new();
        for o in &cli.op {
            if o.trim().eq_ignore_ascii_case("all") {
                colls.extend(Coll::ALL);
            } else {
                colls.push(Coll::parse(o)?);
            }
        }
        let mut dtypes = Vec::new();
        for d in &cli.dtype {
            if d.trim().eq_ignore_ascii_case("all") {
                dtypes.extend(DType::ALL);
            } else {
                dtypes.push(d.trim().parse::<DType>()?);
            }
        }
        dedup(&mut colls);
        dedup(&mut dtypes);
        let redop = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg]
            .into_iter()
            .find(|r| r.name().eq_ignore_ascii_case(cli.redop.trim()))
            .ok_or_else(|| format!("unknown --redop `{}` (expected sum, prod, min, max or avg)", cli.redop))?;
        if colls.iter().any(|c| c.reduces()) {
            if let Some(d) = dtypes.iter().find(|d| !redop.applies_to(**d)) {
                return Err(format!("--redop {redop} is not defined for {d}"));
            }
        }
        if (cli.profile || cli.profile_overhead || cli.trace.is_some()) && !cfg!(feature = "profiling") {
            return Err("--profile, --profile-overhead and --trace need comm-bench built with the `profiling` \
                 feature (cargo build -p comm-bench --features profiling; `cargo xtask bench --profile` does it)"
                .into());
        }
        let baseline = if cli.baseline.is_empty() { None } else { Some(Baseline::load(&cli.baseline)?) };
        let interleave = match cli.interleave.as_deref().map(str::trim) {
            None => false,
            Some("mpi-raw") => {
                if cli.profile || cli.profile_overhead || cli.trace.is_some() || cli.zero_copy {
                    return Err("--interleave: --profile, --profile-overhead, --trace and --zero-copy apply to one \
                         backend only"
                        .into());
                }
                if cli.json.as_ref().is_some_and(|p| !p.to_string_lossy().contains("{backend}")) {
                    return Err("--interleave writes a report per backend: put `{backend}` in the --json path".into());
                }
                true
            }
            Some(other) => return Err(format!("--interleave takes `mpi-raw`, not `{other}`")),
        };
        if cli.stream && cli.json.as_ref().is_some_and(|p| !p.to_string_lossy().contains("{backend}")) {
            return Err(
                "--stream writes a report for the group and one for the stream: put `{backend}` in the --json path"
                    .into(),
            );
        }
        Ok(Plan {
            colls,
            dtypes,
            sizes: sizes::parse_sizes(&cli.sizes)?,
            sizes_spec: cli.sizes,
            redop,
            root: cli.root,
            iters: cli.iters.map(|n| n as usize),
            warmup: cli.warmup.map(|n| n as usize),
            settle: Duration::from_millis(cli.settle),
            json: cli.json,
            baseline,
            progress: cli.progress,
            check: !cli.no_check,
            profile: cli.profile,
            profile_overhead: cli.profile_overhead,
            trace: cli.trace,
            percentiles: cli.percentiles,
            zero_copy: cli.zero_copy,
            stream: cli.stream,
            tasks: cli.tasks.map(|n| n as usize),
            interleave,
        })
    }

    fn iters_for(&self, bytes: usize) -> usize {
        self.iters.unwrap_or_else(|| (TARGET_BYTES / bytes.max(1)).clamp(ITERS_MIN, ITERS_MAX))
    }

    fn warmup_for(&self, iters: usize) -> usize {
        self.warmup.unwrap_or_else(|| (iters / 10).clamp(2, WARMUP_MAX))
    }
}

fn dedup<T: PartialEq + Copy>(v: &mut Vec<T>) {
    let mut seen = Vec::with_capacity(v.len());
    v.retain(|x| {
        let new = !seen.contains(x);
        seen.push(*x);
        new
    });
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let sub = match &cli.command {
        Some(Command::Plot(args)) => Some(("plot", plot::main(args))),
        Some(Command::Compare(args)) => Some(("compare", compare::main(args))),
        Some(Command::Scaling(args)) => Some(("scaling", compare::main_scaling(args))),
        None => None,
    };
    if let Some((name, result)) = sub {
        return match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("comm-bench {name}: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let plan = match Plan::from_cli(cli) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("comm-bench: {e}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("comm-bench: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(&plan)) {
        Ok(0) => ExitCode::SUCCESS,
        Ok(wrong) => {
            eprintln!("comm-bench: {wrong} wrong element(s)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("comm-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the whole plan; returns the number of wrong elements over every row and rank.
async fn run(plan: &Plan) -> Result<u64, CommError> {
    if std::env::var("COMM_BACKEND").is_ok_and(|b| b.trim() == "mpi-raw") {
        if plan.profile || plan.profile_overhead || plan.trace.is_some() || plan.zero_copy {
            return Err(CommError::Config(
                "mpi-raw is MPI called directly: --profile, --profile-overhead, --trace and --zero-copy do not apply"
                    .into(),
            ));
        }
        #[cfg(feature = "mpi-raw")]
        {
            let pg = rawmpi::init()?;
            let wrong = bench(plan, &[(pg.clone(), pg.backend_name())]).await?;
            pg.barrier().await?;
            return Ok(wrong);
        }
        #[cfg(not(feature = "mpi-raw"))]
        return Err(no_mpi_raw());
    }
    if plan.interleave {
        #[cfg(feature = "mpi-raw")]
        {
            // Ours first: the mpi backend initialises MPI, which mpi-raw then joins.
            let pg = comm_api::init(Config::from_env()?).await?;
            let raw = rawmpi::init()?;
            if (pg.rank(), pg.world_size()) != (raw.rank(), raw.world_size()) {
                return Err(CommError::Config(format!(
                    "--interleave: rank {} of {} here is MPI's rank {} of {}",
                    pg.rank(),
                    pg.world_size(),
                    raw.rank(),
                    raw.world_size()
                )));
            }
            let wrong = bench(plan, &[(pg.clone(), pg.backend_name()), (raw.clone(), raw.backend_name())]).await?;
            raw.barrier().await?;
            // Before the mpi backend finalises MPI (mpi-raw's ops are freed with it).
            drop(raw);
            quiet(|| pg.barrier()).await?;
            pg.shutdown().await?;
            return Ok(wrong);
        }
        #[cfg(not(feature = "mpi-raw"))]
        return Err(no_mpi_raw());
    }
    let builder = comm_api::builder(Config::from_env()?);
    #[cfg(feature = "profiling")]
    let (builder, logger, timeline) = {
        use comm_api::profiling::{CommsConfig, CommsLogger, ProfilingLayer, Timeline};
        let logger = plan.profile.then(|| CommsLogger::new(CommsConfig::default()));
        let timeline = plan.trace.as_ref().map(|_| Timeline::new());
        let mut layer = ProfilingLayer::new();
        if let Some(l) = &logger {
            layer = layer.with_logger(l.clone());
        }
        if let Some(t) = &timeline {
            layer = layer.with_timeline(t.clone());
        }
        let builder = if logger.is_some() || timeline.is_some() { builder.profiling(layer) } else { builder };
        (builder, logger, timeline)
    };
    let pg = builder.init().await?;
    #[cfg(feature = "profiling")]
    if let Some(t) = &timeline {
        t.align(pg.backend()).await?;
    }
    #[cfg(feature = "profiling")]
    if plan.profile_overhead {
        overhead::run(&pg, plan).await?;
        quiet(|| pg.barrier()).await?;
        pg.shutdown().await?;
        return Ok(0);
    }
    if let Some(n) = plan.tasks {
        let streams = pg.streams().await?;
        tasks::run(&pg, &streams, plan, n).await?;
        streams.shutdown().await?;
        quiet(|| pg.barrier()).await?;
        pg.shutdown().await?;
        return Ok(0);
    }
    let streams = if plan.stream { Some(pg.streams().await?) } else { None };
    // The group, then with --stream a direct stream (where there is one) and an arbitrated one.
    let mut pgs = vec![(pg.clone(), pg.backend_name())];
    if let Some(s) = &streams {
        if s.direct() > 0 {
            let name: &'static str = Box::leak(format!("{}-stream-direct", pg.backend_name()).into_boxed_str());
            pgs.push((s.stream(0), name));
        }
        let arbitrated = s.stream(s.direct() as u64);
        pgs.push((arbitrated.clone(), arbitrated.backend_name()));
    }
    let wrong = bench(plan, &pgs).await?;
    if let Some(streams) = streams {
        streams.shutdown().await?;
    }
    #[cfg(feature = "profiling")]
    if let Some(logger) = logger {
        // Collective: every rank takes part; rank 0 prints.
        logger.log_summary_with_stragglers(pg.backend()).await?;
    }
    #[cfg(feature = "profiling")]
    if let (Some(t), Some(path)) = (&timeline, &plan.trace) {
        // Collective too: rank 0 gets every rank's events and writes the file.
        if let Some(json) = t.gather(pg.backend()).await? {
            std::fs::write(path, json).map_err(|e| CommError::io(format!("writing {}", path.display()), e))?;
            println!("# trace written to {} (open it in Perfetto or chrome://tracing)", path.display());
        }
    }
    quiet(|| pg.barrier()).await?;
    pg.shutdown().await?;
    Ok(wrong)
}

#[cfg(not(feature = "mpi-raw"))]
fn no_mpi_raw() -> CommError {
    CommError::Unavailable {
        backend: "mpi-raw",
        why: "comm-bench was built without the `mpi-raw` feature (`cargo xtask bench --backend mpi-raw` builds it)"
            .into(),
    }
}

/// Benchmarks every row of the plan on each of `pgs` (one backend each, interleaved within
/// every row) and prints (rank 0) the table and its footer; returns the number of wrong
/// elements over every row, rank and backend.
async fn bench(plan: &Plan, named: &[(ProcessGroup, &'static str)]) -> Result<u64, CommError> {
    let pgs: Vec<ProcessGroup> = named.iter().map(|(pg, _)| pg.clone()).collect();
    let names: Vec<&'static str> = named.iter().map(|&(_, name)| name).collect();
    let pg = &pgs[0];
    let (rank, n) = (pg.rank(), pg.world_size());
    if plan.root >= n && plan.colls.iter().any(|c| c.rooted()) {
        return Err(CommError::Config(format!("--root {} is out of range for {n} ranks", plan.root)));
    }
    let leader = rank == 0;
    let git_rev = if leader {
        std::env::var("COMM_BENCH_GIT_REV").ok().filter(|s| !s.is_empty()).or_else(report::git_rev)
    } else {
        None
    };
    if leader {
        print_preamble(plan, &pgs, &names, git_rev.as_deref());
    }
    let start = report::timestamp();
    // Every row the plan times, in order.
    let planned = || {
        plan.colls.iter().flat_map(move |&c| {
            plan.dtypes
                .iter()
                .flat_map(move |&d| plan.sizes.iter().filter_map(move |&s| Some((c, d, shape(c, d, s, n)?))))
        })
    };
    let total = planned().count();
    if let Some((coll, dtype, shape)) = planned().next() {
        for pg in &pgs {
            settle(pg, plan, Case { coll, dtype, redop: plan.redop, root: plan.root, shape, rank, n }).await?;
        }
    }
    let mut progress = progress::Progress::stderr(plan.progress, total, leader);
    // Each backend's rows.
    let mut rows: Vec<Vec<Row>> = pgs.iter().map(|_| Vec::new()).collect();
    for &coll in &plan.colls {
        if leader {
            progress.println("#");
            progress.println(&format!("# {coll}: busbw factor {:.3} ({n} ranks)", coll.bus_factor(n)));
            let extra = if plan.baseline.is_some() { Baseline::header() } else { String::new() };
            progress.println(&format!("{}{extra}", report::column_header(plan.percentiles)));
        }
        for &dtype in &plan.dtypes {
            for &size in &plan.sizes {
                let Some(shape) = shape(coll, dtype, size, n) else { continue };
                let case = Case { coll, dtype, redop: plan.redop, root: plan.root, shape, rank, n };
                progress.start_row(&format!("{coll} {dtype} {}", sizes::format_size(shape.bytes)));
                let got = bench_row(&pgs, &names, plan, case).await?;
                progress.row_done();
                for (i, (row, mine)) in got.into_iter().zip(&mut rows).enumerate() {
                    if leader {
                        let extra = plan.baseline.as_ref().map(|b| b.cells(&row)).unwrap_or_default();
                        let who = if i > 0 { format!("  # {}", row.backend) } else { String::new() };
                        progress.println(&format!("{}{extra}{who}", report::format_row(&row)));
                    }
                    mine.push(row);
                }
            }
        }
    }
    progress.finish();
    let end = report::timestamp();
    let wrong: u64 = rows.iter().flatten().filter_map(|r| r.wrong).sum();
    if !leader {
        return Ok(wrong);
    }
    for (&name, rows) in names.iter().zip(&rows) {
        if pgs.len() > 1 {
            println!("# {name}:");
        }
        for line in report::footer(rows, &plan.colls) {
            println!("{line}");
        }
        if let Some(b) = &plan.baseline {
            for line in b.footer(rows) {
                println!("{line}");
            }
        }
        if let Some(path) = &plan.json {
            let path = PathBuf::from(path.to_string_lossy().replace("{backend}", name));
            let doc = report::Report {
                schema: report::SCHEMA,
                host: report::hostname(),
                cpu: report::cpu_model(),
                nproc: std::thread::available_parallelism().map_or(1, usize::from),
                git_rev: git_rev.clone(),
                start: start.clone(),
                timestamp: end.clone(),
                end: end.clone(),
                backend: name,
                np: n,
                time: "mean wall time per op, max over ranks",
                args: std::env::args().skip(1).collect(),
                rows,
            };
            report::write_json(&path, &doc).map_err(|e| CommError::io(format!("writing {}", path.display()), e))?;
            println!("# JSON written to {}", path.display());
        }
    }
    Ok(wrong)
}

/// Runs `f` (which submits bookkeeping ops: barriers outside the clock, the exchange of
/// results) without profiling, so `--profile` reports the benchmarked ops only.
fn quiet<T>(f: impl FnOnce() -> T) -> T {
    #[cfg(feature = "profiling")]
    return comm_api::profiling::without_profiling(f);
    #[cfg(not(feature = "profiling"))]
    f()
}

fn print_preamble(plan: &Plan, pgs: &[ProcessGroup], labels: &[&str], git_rev: Option<&str>) {
    let names = |v: Vec<&str>| v.join(",");
    let pg = &pgs[0];
    let backend = match labels {
        [first, others @ ..] if !others.is_empty() => {
            format!("{first}, interleaved in every row with {}", others.join(","))
        }
        _ => labels[0].to_owned(),
    };
    println!("# comm-bench: nccl-tests-style collective benchmark");
    println!(
        "# backend: {}  ranks: {}  host: {}  git: {}",
        backend,
        pg.world_size(),
        report::hostname(),
        git_rev.unwrap_or("unknown")
    );
    println!(
        "# ops: {}  dtypes: {}  sizes: {} ({} sizes, {}..{})  redop: {}  root: {}",
        names(plan.colls.iter().map(|c| c.name()).collect()),
        names(plan.dtypes.iter().map(|d| d.name()).collect()),
        plan.sizes_spec,
        plan.sizes.len(),
        sizes::format_size(plan.sizes.iter().copied().min().unwrap_or(0)),
        sizes::format_size(plan.sizes.iter().copied().max().unwrap_or(0)),
        plan.redop,
        plan.root
    );
    let iters = plan.iters.map_or_else(|| format!("clamp(4GiB/size, {ITERS_MIN}, {ITERS_MAX})"), |n| n.to_string());
    let warmup = plan.warmup.map_or_else(|| format!("clamp(iters/10, 2, {WARMUP_MAX})"), |n| n.to_string());
    println!(
        "# iters: {iters}  warmup: {warmup}  validation: {}{}",
        if plan.check { "on" } else { "off" },
        if plan.zero_copy { "  buffers: zero-copy (alloc_buffer)" } else { "" }
    );
    println!("# time: mean wall time per op, max over ranks; GB/s = 1e9 B/s; size(B) as nccl-tests (see --help)");
    if let Some(b) = &plan.baseline {
        println!(
            "# baseline: {} ({} rows); base(GB/s) = its busbw, new/old = busbw / base(GB/s), - = not in it",
            b.sources(),
            b.len()
        );
    }
}

/// Runs `case` untimed for `plan.settle` (rank 0's clock, so every rank runs as many ops):
/// on shared VMs a new process's first few hundred milliseconds ran 2-3× slow, whatever the
/// backend, and the rows timed then were outliers.
async fn settle(pg: &ProcessGroup, plan: &Plan, case: Case) -> Result<(), CommError> {
    // A profile or trace shows the timed ops only.
    if plan.settle.is_zero() || plan.profile || plan.trace.is_some() {
        return Ok(());
    }
    let batch = plan.iters_for(case.shape.bytes).min(100);
    let mut slot = Some(Slot::new(&case, case.input()?)?);
    let start = Instant::now();
    loop {
        run_iters(pg, &case, batch, &mut slot, None).await?;
        let more = u8::from(start.elapsed() < plan.settle);
        if quiet(|| pg.broadcast(HostBuffer::from_slice(&[more]), 0)).await?.to_vec::<u8>()?[0] == 0 {
            return Ok(());
        }
    }
}

/// Times one row on each of `pgs` and checks it; every rank returns the same rows. With
/// several backends the timed iterations run in [`SLICES`] slices, alternating between them.
async fn bench_row(
    pgs: &[ProcessGroup],
    names: &[&'static str],
    plan: &Plan,
    case: Case,
) -> Result<Vec<Row>, CommError> {
    let template = case.input()?;
    let iters = plan.iters_for(case.shape.bytes);
    let warmup = plan.warmup_for(iters);
    let mut slots = Vec::with_capacity(pgs.len());
    for pg in pgs {
        let input = if case.coll.in_place() && plan.zero_copy {
            // The backend's own memory (shm: a segment the peers map), so nothing is copied in.
            let mut b = pg.alloc_buffer(template.dtype(), template.len())?;
            b.as_bytes_mut().copy_from_slice(template.as_bytes());
            b
        } else if pg.backend_name() == "mpi-raw" {
            heap_copy(&template)
        } else {
            template.clone()
        };
        let mut slot = Some(Slot::new(&case, input)?);
        run_iters(pg, &case, warmup, &mut slot, None).await?;
        slots.push(slot);
    }
    let mut per_op: Vec<Option<Vec<f64>>> =
        pgs.iter().map(|_| plan.percentiles.then(|| Vec::with_capacity(iters))).collect();
    let mut elapsed = vec![Duration::ZERO; pgs.len()];
    let slices = if pgs.len() > 1 { SLICES.min(iters) } else { 1 };
    for s in 0..slices {
        // `iters` split as evenly as it goes (no product: `--iters` may be huge).
        let k = iters / slices + usize::from(s < iters % slices);
        for (i, pg) in pgs.iter().enumerate() {
            elapsed[i] += run_iters(pg, &case, k, &mut slots[i], per_op[i].as_mut()).await?;
        }
    }
    drop(slots);
    let mut rows = Vec::with_capacity(pgs.len());
    for (((pg, &name), elapsed), per_op) in pgs.iter().zip(names).zip(elapsed).zip(per_op) {
        rows.push(finish_row(pg, name, plan, case, &template, Timed { iters, warmup, elapsed, per_op }).await?);
    }
    Ok(rows)
}

/// What one backend's timed iterations of a row came to.
struct Timed {
    iters: usize,
    warmup: usize,
    elapsed: Duration,
    /// Each op's time, with `--percentiles`.
    per_op: Option<Vec<f64>>,
}

/// Checks one backend's results of a row and agrees on its figures across ranks.
async fn finish_row(
    pg: &ProcessGroup,
    name: &'static str,
    plan: &Plan,
    case: Case,
    template: &HostBuffer,
    Timed { iters, warmup, elapsed, per_op }: Timed,
) -> Result<Row, CommError> {
    let wrong = if plan.check {
        let Slot { input, output } = Slot::new(&case, template.clone())?;
        let got = issue(pg, &case, input, output).await?;
        Some(case.count_wrong(got.result())?)
    } else {
        None
    };

    // Same numbers on every rank: the slowest rank's time, the sum of wrong elements.
    let mean = elapsed.as_secs_f64() / iters as f64;
    let time = quiet(|| pg.all_reduce(HostBuffer::from_slice(&[mean]), ReduceOp::Max)).await?.to_vec::<f64>()?[0];
    let wrong = match wrong {
        Some(w) => {
            let all = quiet(|| pg.all_reduce(HostBuffer::from_slice(&[w as i64]), ReduceOp::Sum)).await?;
            Some(all.to_vec::<i64>()?[0] as u64)
        }
        None => None,
    };
    // Each op's time is its slowest rank's (ops are matched by index across ranks).
    let (p50_us, p99_us) = match per_op {
        Some(v) => {
            let all = quiet(|| pg.all_reduce(HostBuffer::from_slice(&v), ReduceOp::Max)).await?;
            let mut v = all.to_vec::<f64>()?;
            v.sort_by(f64::total_cmp);
            (Some(report::quantile(&v, 0.5) * 1e6), Some(report::quantile(&v, 0.99) * 1e6))
        }
        None => (None, None),
    };
    let algbw = if time > 0.0 { case.shape.bytes as f64 / time / 1e9 } else { 0.0 };
    Ok(Row {
        op: case.coll.name(),
        dtype: case.dtype.name(),
        bytes: case.shape.bytes,
        count: case.shape.count,
        redop: if case.coll.reduces() { case.redop.name() } else { "none" },
        root: if case.coll.rooted() { i64::from(case.root) } else { -1 },
        iters,
        warmup,
        time_us: time * 1e6,
        algbw_gbps: algbw,
        busbw_gbps: algbw * case.coll.bus_factor(case.n),
        wrong,
        backend: name,
        np: case.n,
        p50_us,
        p99_us,
    })
}

/// The buffers one op hands back for the next: in place, the data (`input`); otherwise the
/// input, unchanged, and the output.
pub(crate) struct Slot {
    input: HostBuffer,
    output: Option<HostBuffer>,
}

impl Slot {
    /// The first op's buffers: `input`, and the case's output when it has one.
    fn new(case: &Case, input: HostBuffer) -> Result<Slot, CommError> {
        let output = (!case.coll.in_place()).then(|| case.sentinel_output()).transpose()?;
        Ok(Slot { input, output })
    }

    /// What the op computed.
    fn result(&self) -> &HostBuffer {
        self.output.as_ref().unwrap_or(&self.input)
    }
}

/// Runs `iters` ops, each on the buffers the previous one handed back, and returns the time
/// spent in them.
async fn run_iters(
    pg: &ProcessGroup,
    case: &Case,
    iters: usize,
    slot: &mut Option<Slot>,
    mut per_op: Option<&mut Vec<f64>>,
) -> Result<Duration, CommError> {
    quiet(|| pg.barrier()).await?;
    let start = Instant::now();
    for _ in 0..iters {
        let Slot { input, output } = slot.take().ok_or_else(|| CommError::invalid("comm-bench", "lost a buffer"))?;
        let op_start = per_op.is_some().then(Instant::now);
        *slot = Some(issue(pg, case, input, output).await?);
        if let (Some(v), Some(t)) = (per_op.as_deref_mut(), op_start) {
            v.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(start.elapsed())
}

/// Issues one op and waits for it.
async fn issue(
    pg: &ProcessGroup,
    case: &Case,
    input: HostBuffer,
    output: Option<HostBuffer>,
) -> Result<Slot, CommError> {
    let (op, root) = (case.redop, case.root);
    let output = || output.ok_or_else(|| CommError::invalid("comm-bench", "missing output buffer"));
    let in_place = |input| Slot { input, output: None };
    let in_out = |io: InOut| Slot { input: io.input, output: Some(io.output) };
    Ok(match case.coll {
        Coll::AllReduce => in_place(pg.all_reduce(input, op).await?),
        Coll::Broadcast => in_place(pg.broadcast(input, root).await?),
        Coll::Reduce => in_place(pg.reduce(input, op, root).await?.into_buffer()),
        Coll::AllGather => in_out(pg.all_gather_into(input, output()?).await?),
        Coll::ReduceScatter => in_out(pg.reduce_scatter_into(input, op, output()?).await?),
        Coll::AllToAll => in_out(pg.all_to_all_single_into(input, output()?, None, None).await?),
        Coll::Scatter => {
            let input = (pg.rank() == root).then_some(input);
            in_out(pg.scatter(output()?, input, root).await?)
        }
        // Non-roots pass their output buffer too, and get it back as it was.
        Coll::Gather => in_out(pg.gather_into(input, output()?, root).await?),
        Coll::SendRecv => {
            let n = pg.world_size();
            let (next, prev) = ((pg.rank() + 1) % n, (pg.rank() + n - 1) % n);
            let works = pg.batch_isend_irecv(vec![
                P2POp::Send { buf: input, peer: next, tag: 0 },
                P2POp::Recv { buf: output()?, peer: prev, tag: 0 },
            ]);
            let [send, recv] = <[_; 2]>::try_from(works)
                .map_err(|_| CommError::invalid("comm-bench", "batch_isend_irecv did not return two works"))?;
            let output = recv.await?;
            Slot { input: send.await?, output: Some(output) }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(args: &[&str]) -> Result<Plan, String> {
        let cli = Cli::try_parse_from(std::iter::once("comm-bench").chain(args.iter().copied()))
            .map_err(|e| e.to_string())?;
        Plan::from_cli(cli)
    }

    #[test]
    fn defaults() {
        let p = plan(&[]).unwrap();
        assert_eq!(p.colls, [Coll::AllReduce]);
        assert_eq!(p.dtypes, [DType::F32]);
        assert_eq!(p.sizes.len(), 24);
        assert!(p.check);
        assert_eq!(p.iters_for(8), ITERS_MAX);
        assert_eq!(p.iters_for(64 << 20), 64);
        assert_eq!(p.iters_for(1 << 30), ITERS_MIN);
        assert_eq!(p.iters_for(4 << 20), 1024);
        assert_eq!(p.warmup_for(10_000), WARMUP_MAX);
        assert_eq!(p.warmup_for(1000), 100);
        assert_eq!(p.warmup_for(5), 2);
    }

    #[test]
    fn lists_and_flags() {
        let p =
            plan(&["--op", "all_reduce,all_gather", "--op", "reduce", "--dtype", "bf16,f64", "--no-check"]).unwrap();
        assert_eq!(p.colls, [Coll::AllReduce, Coll::AllGather, Coll::Reduce]);
        assert_eq!(p.dtypes, [DType::BF16, DType::F64]);
        assert!(!p.check);
        assert!(plan(&["--no-check", "--check"]).unwrap().check);
        let p = plan(&["--op", "all", "--dtype", "all", "--redop", "max", "--iters", "7", "--warmup", "0"]).unwrap();
        assert_eq!(p.colls, Coll::ALL);
        assert_eq!(p.dtypes.len(), 8);
        assert_eq!((p.iters_for(8), p.warmup_for(7)), (7, 0));
    }

    #[test]
    fn profile_flags_need_the_feature() {
        match plan(&["--profile"]) {
            Ok(p) => assert!(cfg!(feature = "profiling") && p.profile && !p.profile_overhead),
            Err(e) => assert!(!cfg!(feature = "profiling") && e.contains("`profiling` feature"), "{e}"),
        }
        assert!(plan(&["--profile", "--profile-overhead"]).is_err());
    }

    #[test]
    fn stream_runs_beside_the_group_with_a_report_each() {
        assert!(plan(&["--stream"]).unwrap().stream);
        assert!(plan(&["--stream", "--interleave", "mpi-raw"]).is_err());
        assert!(plan(&["--stream", "--json", "r.json"]).unwrap_err().contains("{backend}"));
        assert!(plan(&["--stream", "--json", "r-{backend}.json"]).is_ok());
        assert_eq!(plan(&["--tasks", "8"]).unwrap().tasks, Some(8));
        assert!(plan(&["--tasks", "1"]).is_err() && plan(&["--tasks", "8", "--stream"]).is_err());
    }

    #[test]
    fn interleave_takes_mpi_raw_and_a_report_per_backend() {
        assert!(plan(&["--interleave", "mpi-raw"]).unwrap().interleave);
        assert!(plan(&["--interleave", "mpi-raw", "--json", "r/{backend}.json"]).unwrap().interleave);
        assert!(plan(&["--interleave", "mpi-raw", "--json", "r.json"]).unwrap_err().contains("{backend}"));
        assert!(plan(&["--interleave", "nccl"]).unwrap_err().contains("mpi-raw"));
        assert!(plan(&["--interleave", "mpi-raw", "--zero-copy"]).unwrap_err().contains("one backend"));
        assert!(!plan(&[]).unwrap().interleave);
    }

    #[test]
    fn bad_arguments_are_rejected() {
        assert!(plan(&["--op", "gossip"]).unwrap_err().contains("unknown op"));
        assert!(plan(&["--dtype", "f8"]).unwrap_err().contains("unknown dtype"));
        assert!(plan(&["--redop", "band"]).unwrap_err().contains("--redop"));
        assert!(plan(&["--redop", "avg", "--dtype", "i32"]).unwrap_err().contains("not defined"));
        assert!(plan(&["--sizes", "1MiB..1KiB"]).is_err());
        assert!(plan(&["--iters", "0"]).is_err());
        // avg on integers is fine when no reducing op runs.
        assert!(plan(&["--redop", "avg", "--dtype", "i32", "--op", "all_gather"]).is_ok());
    }
}
