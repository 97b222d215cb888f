//! The command line (`Cli`) and what it asks for (`Plan`): ops, dtypes, sizes, backends and
//! how to time them.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use comm_api::{DType, ReduceOp};

use crate::baseline::Baseline;
use crate::cases::Coll;
use crate::{compare, plot, progress, sizes};

/// Slices of a row's timed iterations when backends are interleaved: enough that each
/// backend's share spans the row, few enough that a slice's barrier costs nothing.
pub(crate) const SLICES: usize = 8;
/// Default timed iterations move about this many bytes per row...
pub(crate) const TARGET_BYTES: usize = 4 << 30;
/// ...within these bounds.
pub(crate) const ITERS_MIN: usize = 5;
pub(crate) const ITERS_MAX: usize = 10_000;
/// Small ops settle for a few ms after start (threads placed, caches warm): a tenth of the
/// iterations, up to this many, run untimed first.
pub(crate) const WARMUP_MAX: usize = 1000;

pub(crate) const AFTER_HELP: &str = "\
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
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Option<Command>,
    /// Ops, comma-separated: all_reduce, all_gather, reduce_scatter, broadcast, all_to_all,
    /// reduce, sendrecv (each rank sends to the next and receives from the previous), scatter,
    /// gather, or `all`.
    #[arg(long, value_delimiter = ',', default_value = "all_reduce", value_name = "OPS")]
    pub(crate) op: Vec<String>,
    /// Element types, comma-separated: u8, i8, i32, i64, f16, bf16, f32, f64, or `all`.
    #[arg(long, value_delimiter = ',', default_value = "f32", value_name = "DTYPES")]
    pub(crate) dtype: Vec<String>,
    /// Message sizes (see SIZES below).
    #[arg(long, default_value = "8B..64MiB", value_name = "SPEC")]
    pub(crate) sizes: String,
    /// Reduce op of all_reduce, reduce_scatter and reduce: sum, prod, min, max, avg.
    #[arg(long, default_value = "sum")]
    pub(crate) redop: String,
    /// Root rank of broadcast, reduce, scatter and gather.
    #[arg(long, default_value_t = 0)]
    pub(crate) root: u32,
    /// Timed iterations per row (default: adaptive, see TIMING).
    #[arg(long, short = 'n', value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) iters: Option<u64>,
    /// Warm-up iterations per row (default: adaptive).
    #[arg(long, short = 'w')]
    pub(crate) warmup: Option<u64>,
    /// Milliseconds the first row runs untimed before anything is timed (a new process's
    /// first few hundred milliseconds can run slow on a shared machine; 0: none).
    #[arg(long, default_value_t = 500, value_name = "MS")]
    pub(crate) settle: u64,
    /// Write the results as JSON to this file (rank 0).
    #[arg(long, value_name = "PATH")]
    pub(crate) json: Option<PathBuf>,
    /// Compare with saved --json reports: each row gains the saved busbw and new/old (see
    /// BASELINE below).
    #[arg(long, value_delimiter = ',', value_name = "PATH")]
    pub(crate) baseline: Vec<PathBuf>,
    /// Progress on rank 0's stderr (see PROGRESS below).
    #[arg(long, value_enum, default_value = "auto", value_name = "MODE")]
    pub(crate) progress: progress::Mode,
    /// Check every row's results (the default).
    #[arg(long, overrides_with = "no_check")]
    pub(crate) check: bool,
    /// Do not check results (#wrong shows N/A).
    #[arg(long, overrides_with = "check")]
    pub(crate) no_check: bool,
    /// In-place ops (all_reduce, broadcast, reduce) use a buffer from `alloc_buffer`: the
    /// backend's zero-copy memory where it has one.
    #[arg(long)]
    pub(crate) zero_copy: bool,
    /// Also time every row on streams of the group (`pg.streams()`): a direct one
    /// (`<backend>-stream-direct`, where `COMM_STREAMS_DIRECT` leaves one) and an arbitrated
    /// one (`<backend>-stream`), interleaved with the group itself in every row: the cost of a
    /// stream op.
    #[arg(long, conflicts_with = "interleave")]
    pub(crate) stream: bool,
    /// Instead of the table: all_reduce (first --dtype) at every size on N streams (keys
    /// `0..N`) from N threads at once, against one stream alone, in alternating slices; prints
    /// the time per op of each (the N threads' together: their aggregate rate).
    #[arg(long, value_name = "N", conflicts_with_all = ["interleave", "stream"], value_parser = clap::value_parser!(u32).range(2..=64))]
    pub(crate) tasks: Option<u32>,
    /// Profile every op (a span each, recorded by a CommsLogger) and print the CommsLogger
    /// summary with the per-rank straggler view after the bench (feature `profiling`).
    #[arg(long, conflicts_with = "profile_overhead")]
    pub(crate) profile: bool,
    /// Instead of the table: run each row with profiling off, on with no subscriber, and on
    /// with a CommsLogger, interleaved, and print the overhead (feature `profiling`).
    #[arg(long)]
    pub(crate) profile_overhead: bool,
    /// Also time every op on its own and report the median and the 99th percentile of the
    /// per-op time (each op's slowest rank) in p50(us) / p99(us) columns: the tail that
    /// latency-bound users (inference) care about.
    #[arg(long)]
    pub(crate) percentiles: bool,
    /// Also time every row on BACKEND (only `mpi-raw`: start comm-bench with `mpirun`; beside
    /// the mpi backend MPI must provide MPI_THREAD_MULTIPLE), in
    /// slices that alternate with this backend's within the row, so that both see the same
    /// machine: on a shared machine whose speed changes by 2x for seconds at a time, runs of
    /// one backend after the other compare whichever was lucky. Each backend's rows are
    /// printed (the other's marked with its name) and, with --json, written to PATH with
    /// `{backend}` replaced by the backend's name.
    #[arg(long, value_name = "BACKEND")]
    pub(crate) interleave: Option<String>,
    /// Write a per-rank timeline of every benchmarked op to PATH as Chrome trace-event JSON
    /// (opens in Perfetto or chrome://tracing), one track per rank, clocks aligned across
    /// ranks; rank 0 writes the merged file (feature `profiling`).
    #[arg(long, value_name = "PATH", conflicts_with = "profile_overhead")]
    pub(crate) trace: Option<PathBuf>,
}

/// What comm-bench does other than benchmarking.
#[derive(Subcommand, Debug)]
pub(crate) enum Command {
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
pub(crate) struct Plan {
    pub(crate) colls: Vec<Coll>,
    pub(crate) dtypes: Vec<DType>,
    pub(crate) sizes: Vec<usize>,
    pub(crate) sizes_spec: String,
    pub(crate) redop: ReduceOp,
    pub(crate) root: u32,
    pub(crate) iters: Option<usize>,
    pub(crate) warmup: Option<usize>,
    pub(crate) settle: Duration,
    pub(crate) json: Option<PathBuf>,
    pub(crate) baseline: Option<Baseline>,
    pub(crate) progress: progress::Mode,
    pub(crate) check: bool,
    pub(crate) zero_copy: bool,
    pub(crate) stream: bool,
    pub(crate) tasks: Option<usize>,
    // Only acted on with the `profiling` feature; without it `from_cli` refuses them.
    #[cfg_attr(not(feature = "profiling"), allow(dead_code))]
    pub(crate) profile: bool,
    #[cfg_attr(not(feature = "profiling"), allow(dead_code))]
    pub(crate) profile_overhead: bool,
    #[cfg_attr(not(feature = "profiling"), allow(dead_code))]
    pub(crate) trace: Option<PathBuf>,
    pub(crate) percentiles: bool,
    /// `--interleave mpi-raw`.
    pub(crate) interleave: bool,
}

impl Plan {
    pub(crate) fn from_cli(cli: Cli) -> Result<Plan, String> {
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

    pub(crate) fn iters_for(&self, bytes: usize) -> usize {
        self.iters.unwrap_or_else(|| (TARGET_BYTES / bytes.max(1)).clamp(ITERS_MIN, ITERS_MAX))
    }

    pub(crate) fn warmup_for(&self, iters: usize) -> usize {
        self.warmup.unwrap_or_else(|| (iters / 10).clamp(2, WARMUP_MAX))
    }
}

pub(crate) fn dedup<T: PartialEq + Copy>(v: &mut Vec<T>) {
    let mut seen = Vec::with_capacity(v.len());
    v.retain(|x| {
        let new = !seen.contains(x);
        seen.push(*x);
        new
    });
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
