//! `comm-bench`: an nccl-tests–style bandwidth benchmark of the comm collectives, run as one
//! process per rank (`commrun -n 2 -- comm-bench ...`, or `cargo xtask bench`).
//!
//! For every (op, dtype, size) it fills known inputs, runs warm-up iterations, a barrier and
//! the timed iterations (mean wall time per op, maximum over ranks), then one checked
//! iteration whose wrong elements are counted on every rank and summed. Rank 0 prints the
//! table and optionally writes JSON; every rank exits 1 when any element was wrong.

mod baseline;
mod cases;
mod cli;
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

use clap::Parser;
use comm_api::{CommError, Config, HostBuffer, InOut, P2POp, ProcessGroup, ReduceOp};

use baseline::Baseline;
use cases::{shape, Case, Coll};
use cli::{Cli, Command, Plan, ITERS_MAX, ITERS_MIN, SLICES, WARMUP_MAX};
use report::Row;

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
