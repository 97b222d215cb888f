//! `cargo xtask bench`: build commrun and comm-bench in release, run them once per backend,
//! rank count and round, and put the reports side by side.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{cargo, cargo_features, mpi, progress, root, run, step, target_dir, Failure, Result};

/// Backends `--backend` knows about; each must be a feature of comm-bench to be usable.
const BACKENDS: [&str; 5] = ["shm", "mpi", "mpi-raw", "hier", "nccl"];

/// Whether `backend` runs under mpirun.
fn mpi_launched(backend: &str) -> bool {
    backend.starts_with("mpi") || backend == "hier"
}

#[derive(Debug, PartialEq)]
struct BenchArgs {
    backends: Vec<String>,
    /// `--np`: the largest of `nps` (what the backends must be able to run).
    np: u32,
    /// `--np 2,4,8`: every count of ranks to run, in order.
    nps: Vec<u32>,
    json: Option<PathBuf>,
    /// `--svg`: where the plot goes.
    svg: Option<PathBuf>,
    /// `--baseline` reports.
    baseline: Vec<PathBuf>,
    /// Show the progress (not `--no-progress`).
    progress: bool,
    /// `--rounds`: how many times each backend runs, interleaved with the others.
    rounds: u32,
    /// `--hosts 2,2`: run the MPI-launched backends on simulated hosts of these sizes
    /// (`scripts/simhosts`, MPI over TCP).
    hosts: Option<Vec<u32>>,
    /// Flags passed through to comm-bench.
    forward: Vec<String>,
}

/// `cargo xtask bench`'s options; see `cargo xtask bench --help`.
#[derive(clap::Parser, Debug)]
#[command(name = "cargo xtask bench", no_binary_name = true)]
pub(crate) struct BenchCli {
    /// Comma list of backends (compiled-in ones only); `all`: shm, mpi and mpi-raw where MPI is
    /// installed (or installable: apt, as root), nccl where `nvidia-smi -L` (or /dev/nvidiaN)
    /// shows NP GPUs; mpi-raw: the system MPI's own collectives called directly (the
    /// osu_allreduce baseline), under mpirun; with shm or mpi, the first of them runs in one
    /// mpirun process with it, the two alternating within every row (comm-bench
    /// --interleave), so both see the same machine.
    #[arg(long, value_delimiter = ',', default_value = "shm")]
    backend: Vec<String>,
    /// Ranks (default 2); several: the whole run once per count (JSON reports PATH.npN...), a
    /// side-by-side table per count, then the scaling table (each row at every count).
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..))]
    np: Option<Vec<u32>>,
    /// Run every backend N times, interleaved (shm, mpi-raw, shm, ...; JSON reports
    /// PATH...rK...); the table shows each row's median round and its spread (slowest /
    /// fastest round), and the ratio of the fastest rounds (`best`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Run the MPI-launched backends on simulated hosts of these sizes (`2,2`:
    /// `scripts/simhosts`, MPI over TCP).
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..))]
    hosts: Option<Vec<u32>>,
    /// Write the JSON report (PATH.<backend>.json per backend when several).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Plot busbw against size (log2 axis) as an SVG, one line per backend and dtype; with
    /// several --np, busbw against ranks, a panel per size (8 B, 4 KiB, 1 MiB, 64 MiB or the
    /// nearest that ran).
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Compare with saved --json reports (or, when PATH is not there, its PATH.<backend>.json
    /// siblings): every row gains the saved busbw and new/old.
    #[arg(long, value_delimiter = ',')]
    baseline: Vec<PathBuf>,
    /// No progress display (default: a bar on stderr when it is a terminal, else a line every
    /// 10 s of a longer run).
    #[arg(long)]
    no_progress: bool,
    /// all_reduce,all_gather,reduce_scatter,broadcast,all_to_all,reduce or all (default
    /// all_reduce).
    #[arg(long)]
    op: Option<String>,
    /// f32,bf16,f16,f64,i32,i64,i8,u8 or all (default f32).
    #[arg(long)]
    dtype: Option<String>,
    /// 8B..64MiB (default), 8B..64MiB:x8, 8B,1KiB,1MiB.
    #[arg(long)]
    sizes: Option<String>,
    #[arg(long)]
    iters: Option<String>,
    #[arg(long)]
    warmup: Option<String>,
    #[arg(long)]
    redop: Option<String>,
    #[arg(long)]
    root: Option<String>,
    /// Write every rank's ops as one Chrome trace-event JSON file (one backend).
    #[arg(long)]
    trace: Option<String>,
    #[arg(long)]
    check: bool,
    #[arg(long)]
    no_check: bool,
    /// Profile every op and print the CommsLogger summary after the bench.
    #[arg(long)]
    profile: bool,
    /// Instead of the table: the same ops with profiling off, with the layer but no
    /// subscriber, and with a CommsLogger, and the overhead of each (one backend).
    #[arg(long)]
    profile_overhead: bool,
    /// p50 and p99 of the per-op time (slowest rank) per row.
    #[arg(long)]
    percentiles: bool,
    /// Anything after `--` goes to comm-bench as it is (`target/release/comm-bench --help`).
    #[arg(last = true)]
    rest: Vec<String>,
}

fn bench_args(cli: BenchCli) -> Result<BenchArgs> {
    let mut forward = Vec::new();
    let valued = [
        ("--op", cli.op),
        ("--dtype", cli.dtype),
        ("--sizes", cli.sizes),
        ("--iters", cli.iters),
        ("--warmup", cli.warmup),
        ("--redop", cli.redop),
        ("--root", cli.root),
        ("--trace", cli.trace),
    ];
    for (flag, value) in valued {
        forward.extend(value.map(|v| [flag.to_owned(), v]).into_iter().flatten());
    }
    let flags = [
        ("--check", cli.check),
        ("--no-check", cli.no_check),
        ("--profile", cli.profile),
        ("--profile-overhead", cli.profile_overhead),
        ("--percentiles", cli.percentiles),
    ];
    forward.extend(flags.into_iter().filter(|&(_, on)| on).map(|(flag, _)| flag.to_owned()));
    forward.extend(cli.rest);
    let nps = cli.np.clone().unwrap_or_else(|| vec![2]);
    let mut b = BenchArgs {
        backends: cli.backend.iter().map(|s| s.trim().to_ascii_lowercase()).filter(|s| !s.is_empty()).collect(),
        np: nps.iter().copied().max().unwrap_or(2),
        nps,
        json: cli.json,
        svg: cli.svg,
        baseline: cli.baseline.into_iter().filter(|p| !p.as_os_str().is_empty()).collect(),
        progress: !cli.no_progress,
        rounds: cli.rounds,
        hosts: cli.hosts,
        forward,
    };
    if b.backends.is_empty() {
        return Err(Failure::usage("--backend needs at least one backend"));
    }
    if let Some(sizes) = &b.hosts {
        if sizes.len() < 2 {
            return Err(Failure::usage(format!(
                "--hosts {sizes:?}: expected ranks per host for 2 or more hosts (e.g. 2,2)"
            )));
        }
        let np: u32 = sizes.iter().sum();
        if cli.np.is_some() && b.nps != [np] {
            return Err(Failure::usage(format!("--hosts {sizes:?} means {np} ranks: leave out --np")));
        }
        if let Some(k) = b.backends.iter().find(|k| !mpi_launched(k)) {
            return Err(Failure::usage(format!("--hosts runs ranks under mpirun: `{k}` is not an MPI backend")));
        }
        (b.np, b.nps) = (np, vec![np]);
    }
    Ok(b)
}

/// Hosts simulated on this machine for `--hosts` (`scripts/simhosts`); removed when dropped.
struct SimHosts {
    dir: PathBuf,
    layout: String,
    np: u32,
}

impl SimHosts {
    fn script() -> PathBuf {
        root().join("scripts/simhosts")
    }

    fn up(sizes: &[u32]) -> Result<SimHosts> {
        let dir = env::temp_dir().join(format!("comm-bench-hosts-{}", std::process::id()));
        let mut c = Command::new(Self::script());
        c.arg("up").arg(&dir).arg(sizes.len().to_string());
        run(c)?;
        let layout = sizes.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        Ok(SimHosts { dir, layout, np: sizes.iter().sum() })
    }

    /// mpirun of every rank onto its host, MPI over TCP as between hosts; the program follows.
    fn mpirun(&self) -> Command {
        let mut c = mpi::mpirun(self.np);
        c.env("OMPI_MCA_btl", "tcp,self");
        c.arg(Self::script()).arg("run").arg(&self.dir).arg(&self.layout).arg("--");
        c
    }
}

impl Drop for SimHosts {
    fn drop(&mut self) {
        let _ = Command::new(Self::script()).arg("down").arg(&self.dir).status();
    }
}

/// Checks the backends against those comm-bench can be built with; returns the cargo
/// features to build with.
fn backend_features(backends: &[String], available: &[String]) -> Result<Vec<String>> {
    let mut features = Vec::new();
    for b in backends {
        if !BACKENDS.contains(&b.as_str()) {
            return Err(Failure::usage(format!("unknown backend `{b}` (known: {})", BACKENDS.join(", "))));
        }
        if !available.contains(b) {
            let usable: Vec<&str> = BACKENDS.iter().copied().filter(|k| available.iter().any(|a| a == k)).collect();
            return Err(Failure {
                code: 2,
                msg: format!(
                    "backend `{b}` is not available: comm-bench has no `{b}` feature yet (crates/comm-bench/Cargo.toml); usable now: {}",
                    usable.join(", ")
                ),
            });
        }
        features.push(format!("comm-bench/{b}"));
    }
    Ok(features)
}

/// `--profile` / `--profile-overhead` need comm-bench's `profiling` feature; the overhead run
/// measures one backend at 1 KiB and 1 MiB unless told otherwise.
fn profiling_options(b: &mut BenchArgs, features: &mut Vec<String>) -> Result {
    let has = |flag: &str| b.forward.iter().any(|a| a == flag || a.starts_with(&format!("{flag}=")));
    let overhead = has("--profile-overhead");
    if overhead || has("--profile") || has("--trace") {
        features.push("comm-bench/profiling".into());
    }
    if has("--trace") && b.backends.len() > 1 {
        return Err(Failure::usage("--trace records one backend at a time"));
    }
    if overhead {
        if b.backends.len() > 1 {
            return Err(Failure::usage("--profile-overhead measures one backend at a time"));
        }
        if !has("--sizes") {
            b.forward.extend(["--sizes".to_owned(), "1KiB,1MiB".to_owned()]);
        }
    }
    Ok(())
}

/// `all` in `--backend`, in its place: every backend comm-bench has a feature for that can
/// run here: shm; mpi when `mpi_ok` (MPI installed, or installed now); nccl when `gpus` (the
/// GPUs of this host) are at least `np`. Duplicates go.
fn expand_backends(
    requested: &[String],
    features: &[String],
    np: u32,
    mpi_ok: impl FnOnce() -> Result<bool>,
    gpus: impl FnOnce() -> usize,
) -> Result<Vec<String>> {
    let mut out: Vec<String> = Vec::new();
    let mut mpi_ok = Some(mpi_ok);
    let mut mpi_known = None;
    let mut gpus = Some(gpus);
    for r in requested {
        let picked: Vec<String> = if r == "all" {
            let mut v = Vec::new();
            for k in BACKENDS {
                if !features.iter().any(|f| f == k) {
                    println!("note: --backend all: comm-bench has no `{k}` feature, skipping {k}");
                    continue;
                }
                let usable = match k {
                    "mpi" | "mpi-raw" | "hier" => {
                        if mpi_ok.is_some() {
                            mpi_known = Some(mpi_ok.take().map_or(Ok(false), |f| f())?);
                        }
                        mpi_known.unwrap_or(false)
                    }
                    "nccl" => {
                        let n = gpus.take().map_or(0, |f| f());
                        if n < np as usize {
                            println!("note: --backend all: {n} GPU(s) here for {np} rank(s), skipping nccl");
                        }
                        n >= np as usize
                    }
                    _ => true,
                };
                if usable {
                    v.push(k.to_owned());
                } else if mpi_launched(k) {
                    println!("note: --backend all: MPI is not installed here, skipping {k}");
                }
            }
            v
        } else {
            vec![r.clone()]
        };
        for p in picked {
            if !out.contains(&p) {
                out.push(p);
            }
        }
    }
    Ok(out)
}

/// The GPUs of this host: `nvidia-smi -L` lines, else `/dev/nvidiaN` device files.
fn gpu_count() -> usize {
    if let Ok(o) = Command::new("nvidia-smi").arg("-L").stdin(std::process::Stdio::null()).output() {
        if o.status.success() {
            return String::from_utf8_lossy(&o.stdout).lines().filter(|l| l.starts_with("GPU ")).count();
        }
    }
    std::fs::read_dir("/dev").map_or(0, |d| {
        d.filter_map(|e| e.ok())
            .filter(|e| {
                let name = e.file_name();
                let name = name.to_string_lossy();
                name.strip_prefix("nvidia").is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
            })
            .count()
    })
}

/// The reports `--baseline PATH` stands for: PATH itself, or where it is not there, the
/// `PATH.<backend>.json` files of an earlier run with several backends.
fn baseline_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for p in paths {
        if p.is_file() {
            out.push(p.clone());
            continue;
        }
        let siblings: Vec<PathBuf> = BACKENDS.iter().map(|k| json_path(p, k, true)).filter(|s| s.is_file()).collect();
        if siblings.is_empty() {
            return Err(Failure::usage(format!(
                "--baseline {}: no such report (nor {})",
                p.display(),
                json_path(p, "<backend>", true).display()
            )));
        }
        out.extend(siblings);
    }
    Ok(out)
}

/// Where a backend's report goes when the user gave no `--json`.
/// The backend that runs in one process with mpi-raw per round (under mpirun), the two
/// interleaved within every row (`comm-bench --interleave mpi-raw`): the first of shm and mpi
/// in the list, when mpi-raw is in it too. On a machine whose speed changes for seconds at a
/// time, separate processes compare whichever ran in a fast stretch. None with flags that
/// apply to one backend only, or on simulated hosts.
fn interleaved(b: &BenchArgs) -> Option<&str> {
    let one_backend_only = ["--profile", "--profile-overhead", "--trace", "--zero-copy"];
    if b.hosts.is_some()
        || !b.backends.iter().any(|x| x == "mpi-raw")
        || b.forward.iter().any(|a| one_backend_only.contains(&a.split('=').next().unwrap_or_default()))
    {
        return None;
    }
    b.backends.iter().map(String::as_str).find(|x| ["shm", "mpi"].contains(x))
}

/// `comm-bench compare` or `scaling` (`sub`) over `reports` (backend, path, round), a
/// `BACKEND=PATH,PATH...` argument per backend.
fn tables(target: &Path, sub: &str, backends: &[String], reports: &[(String, PathBuf, u32)]) -> Command {
    let mut c = Command::new(target.join("comm-bench"));
    c.current_dir(root()).arg(sub);
    for k in backends {
        let paths: Vec<String> =
            reports.iter().filter(|(x, ..)| x == k).map(|(_, p, _)| p.display().to_string()).collect();
        if !paths.is_empty() {
            c.arg(format!("{k}={}", paths.join(",")));
        }
    }
    c
}

/// Where a report goes when the user asked for none but the tables or the plot need it.
fn scratch(target: &Path, backend: &str, np: u32) -> PathBuf {
    target.join("xtask-bench").join(format!("{backend}.np{np}.json"))
}

/// `PATH` with `.rN` before the extension: round N of `--rounds`.
fn round_path(path: &Path, round: u32) -> PathBuf {
    let stem = path.file_stem().map_or_else(|| "bench".into(), |s| s.to_string_lossy().into_owned());
    let name = match path.extension() {
        Some(ext) => format!("{stem}.r{round}.{}", ext.to_string_lossy()),
        None => format!("{stem}.r{round}"),
    };
    path.with_file_name(name)
}

/// `PATH` for one backend, `PATH` with `.<backend>` before the extension for several.
fn json_path(path: &Path, backend: &str, several: bool) -> PathBuf {
    if !several {
        return path.to_path_buf();
    }
    let stem = path.file_stem().map_or_else(|| "bench".into(), |s| s.to_string_lossy().into_owned());
    let name = match path.extension() {
        Some(ext) => format!("{stem}.{backend}.{}", ext.to_string_lossy()),
        None => format!("{stem}.{backend}"),
    };
    path.with_file_name(name)
}

fn git_rev() -> String {
    Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(root())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

pub(crate) fn bench(cli: BenchCli) -> Result {
    let mut b = bench_args(cli)?;
    let available = cargo_features("comm-bench")?;
    b.backends = expand_backends(&b.backends, &available, b.np, mpi::ensure_packages, gpu_count)?;
    if b.backends.is_empty() {
        return Err(Failure { code: 2, msg: "--backend all: no backend can run here".into() });
    }
    let mut features = backend_features(&b.backends, &available)?;
    profiling_options(&mut b, &mut features)?;
    if (b.svg.is_some() || !b.baseline.is_empty()) && b.forward.iter().any(|a| a == "--profile-overhead") {
        return Err(Failure::usage("--svg and --baseline need the table: they do not go with --profile-overhead"));
    }
    // comm-bench runs in the workspace root: paths the user gave are relative to here.
    let cwd = env::current_dir().unwrap_or_else(|_| root());
    for p in b.json.iter_mut().chain(b.svg.iter_mut()).chain(b.baseline.iter_mut()) {
        *p = cwd.join(&*p);
    }
    let baseline = baseline_files(&b.baseline)?;
    let progress = b.progress && !b.forward.iter().any(|a| a == "--progress" || a.starts_with("--progress="));
    if b.backends.iter().any(|x| mpi_launched(x)) && !mpi::ensure_packages()? {
        return Err(Failure { code: 2, msg: "the mpi backend needs MPI installed (see the note above)".into() });
    }
    step("build (release)", || {
        let mut c = cargo();
        c.args(["build", "--release", "-p", "commrun", "-p", "comm-bench", "--features", &features.join(",")]);
        run(c)
    })?;
    let target_root = target_dir()?;
    let target = target_root.join("release");
    let rev = git_rev();
    let several = b.backends.len() > 1;
    let hosts = match &b.hosts {
        Some(sizes) => Some(SimHosts::up(sizes)?),
        None => None,
    };
    let mut first_failure = None;
    let mut reports = Vec::new();
    // Every round of every rank count, for the scaling table.
    let mut every = Vec::new();
    for &np in &b.nps {
        let mut np_reports: Vec<(String, PathBuf, u32)> = Vec::new();
        let runs = (1..=b.rounds).flat_map(|round| b.backends.iter().map(move |k| (round, k)));
        let partner = interleaved(&b);
        for (round, backend) in runs {
            if partner.is_some() && backend == "mpi-raw" {
                // Its rows came from its partner's run in this round.
                continue;
            }
            let together = partner == Some(backend.as_str());
            // With several rank counts each gets its own report (`PATH.npN...`).
            let json_base = b.json.as_ref().map(|p| match b.nps.len() {
                1 => p.clone(),
                _ => PathBuf::from(format!("{}.np{np}", p.display())),
            });
            let json_for = |backend: &str| {
                match &json_base {
                    Some(p) => Some(json_path(p, backend, several)),
                    None if several || b.rounds > 1 || b.nps.len() > 1 || b.svg.is_some() => {
                        Some(scratch(&target_root, backend, np))
                    }
                    None => None,
                }
                .map(|p| if b.rounds > 1 { round_path(&p, round) } else { p })
            };
            // Interleaved, comm-bench writes each backend's report where `{backend}` says.
            let json = json_for(if together { "{backend}" } else { backend });
            let what = if together { format!("{backend} and mpi-raw interleaved") } else { backend.clone() };
            let label = match b.rounds {
                1 => format!("bench {what}, {np} ranks"),
                n => format!("bench {what}, {np} ranks, round {round} of {n}"),
            };
            let r = step(&label, || {
                let mut c = if let Some(h) = &hosts {
                    h.mpirun()
                } else if mpi_launched(backend) || together {
                    mpi::mpirun(np)
                } else {
                    let mut c = Command::new(target.join("commrun"));
                    c.arg("-n").arg(np.to_string()).arg("--");
                    c
                };
                c.current_dir(root()).env("COMM_BACKEND", backend).env("COMM_BENCH_GIT_REV", &rev);
                c.arg(target.join("comm-bench"));
                if progress {
                    c.args(["--progress", "lines"]);
                }
                for p in &baseline {
                    c.arg("--baseline").arg(p);
                }
                c.args(&b.forward);
                if together {
                    c.args(["--interleave", "mpi-raw"]);
                }
                if let Some(p) = &json {
                    if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
                        let _ = std::fs::create_dir_all(dir);
                    }
                    c.arg("--json").arg(p);
                }
                if progress {
                    progress::run_relayed(c, &format!("bench {backend}"))
                } else {
                    run(c)
                }
            });
            match r {
                Ok(()) if together => {
                    for k in [backend.as_str(), "mpi-raw"] {
                        np_reports.extend(json_for(k).map(|p| (k.to_owned(), p, round)));
                    }
                }
                Ok(()) => np_reports.extend(json.map(|p| (backend.clone(), p, round))),
                Err(e) => {
                    eprintln!("xtask: {}", e.msg);
                    first_failure.get_or_insert(e);
                }
            }
        }
        if np_reports.len() > 1 {
            println!("\n== {} side by side, {np} ranks ==", b.backends.join(" vs "));
            if let Err(e) = run(tables(&target, "compare", &b.backends, &np_reports)) {
                first_failure.get_or_insert(e);
            }
        }
        // The plot draws one line per backend and dtype: the first round's.
        reports.extend(np_reports.iter().filter(|r| r.2 == 1).map(|(k, p, _)| (k.clone(), p.clone())));
        every.extend(np_reports);
    }
    if b.nps.len() > 1 && !every.is_empty() {
        println!("\n== scaling, {} ranks ==", b.nps.iter().map(u32::to_string).collect::<Vec<_>>().join(", "));
        if let Err(e) = run(tables(&target, "scaling", &b.backends, &every)) {
            first_failure.get_or_insert(e);
        }
    }
    if let (Some(svg), false) = (&b.svg, reports.is_empty()) {
        step("plot", || {
            let mut c = Command::new(target.join("comm-bench"));
            c.current_dir(root()).arg("plot").arg("--svg").arg(svg);
            c.args(reports.iter().map(|(_, p)| p));
            run(c)
        })?;
    }
    match first_failure {
        None => Ok(()),
        Some(f) => Err(Failure { code: f.code, msg: "bench failed".into() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_bench(args: &[String]) -> Result<BenchArgs> {
        bench_args(<BenchCli as clap::Parser>::try_parse_from(args).map_err(|e| Failure::usage(e.to_string()))?)
    }

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn bench_defaults_and_forwarding() {
        let b = parse_bench(&[]).unwrap();
        assert_eq!((b.backends, b.np, b.json, b.forward.len()), (vec!["shm".to_owned()], 2, None, 0));
        let b = parse_bench(&args(
            "--np 4 --op all_reduce,all_gather --dtype=bf16 --sizes 8B..1MiB:x8 --no-check --json out.json -- --root 1",
        ))
        .unwrap();
        assert_eq!(b.np, 4);
        let sweep = parse_bench(&args("--np 2,8,4")).unwrap();
        assert_eq!((sweep.nps, sweep.np), (vec![2, 8, 4], 8));
        assert!(parse_bench(&args("--np 2,x")).is_err() && parse_bench(&args("--np 0")).is_err());
        assert_eq!(parse_bench(&args("--rounds 3")).unwrap().rounds, 3);
        assert!(parse_bench(&args("--rounds 0")).is_err() && parse_bench(&args("--rounds x")).is_err());
        assert_eq!(round_path(Path::new("a/b.json"), 2), PathBuf::from("a/b.r2.json"));
        assert_eq!(b.json, Some(PathBuf::from("out.json")));
        assert_eq!(b.forward, args("--op all_reduce,all_gather --dtype bf16 --sizes 8B..1MiB:x8 --no-check --root 1"));
        assert_eq!(parse_bench(&args("--backend SHM,mpi")).unwrap().backends, ["shm", "mpi"]);
    }

    #[test]
    fn trace_is_forwarded_with_the_profiling_feature() {
        assert!(parse_bench(&args("--percentiles")).unwrap().forward.contains(&"--percentiles".to_owned()));
        let mut b = parse_bench(&args("--trace /tmp/t.json --sizes 1KiB")).unwrap();
        assert!(b.forward.windows(2).any(|w| w == ["--trace", "/tmp/t.json"]), "{:?}", b.forward);
        let mut features = Vec::new();
        profiling_options(&mut b, &mut features).unwrap();
        assert_eq!(features, ["comm-bench/profiling"]);
        let mut two = parse_bench(&args("--trace t.json --backend shm,mpi")).unwrap();
        assert!(profiling_options(&mut two, &mut Vec::new()).is_err());
    }

    #[test]
    fn profiling_flags_add_the_feature_and_default_sizes() {
        let mut b = parse_bench(&args("--profile-overhead")).unwrap();
        let mut f = vec!["comm-bench/shm".to_owned()];
        profiling_options(&mut b, &mut f).unwrap();
        assert_eq!(f, ["comm-bench/shm", "comm-bench/profiling"]);
        assert_eq!(b.forward, args("--profile-overhead --sizes 1KiB,1MiB"));
        let mut b = parse_bench(&args("--profile --sizes 8B")).unwrap();
        let mut f = Vec::new();
        profiling_options(&mut b, &mut f).unwrap();
        assert_eq!((f.len(), b.forward), (1, args("--sizes 8B --profile")));
        let mut b = parse_bench(&args("--backend shm,mpi --profile-overhead")).unwrap();
        assert!(profiling_options(&mut b, &mut Vec::new()).is_err());
    }

    #[test]
    fn bench_rejects_bad_arguments() {
        assert!(parse_bench(&args("--np 0")).is_err());
        assert!(parse_bench(&args("--np")).is_err());
        assert!(parse_bench(&args("--frobnicate 3")).is_err());
        assert!(parse_bench(&args("--backend ,")).is_err());
        assert!(parse_bench(&args("--hosts 4")).is_err(), "one host is not a layout");
        assert!(parse_bench(&args("--hosts 2,2 --backend shm")).is_err(), "shm does not run under mpirun");
        assert!(parse_bench(&args("--hosts 2,2 --backend hier --np 2")).is_err(), "--np contradicts --hosts");
    }

    #[test]
    fn hosts_set_the_rank_count() {
        let b = parse_bench(&args("--hosts 3,1 --backend hier,mpi,mpi-raw")).unwrap();
        assert_eq!((b.hosts, b.np, b.nps), (Some(vec![3, 1]), 4, vec![4]));
        assert!(parse_bench(&args("--hosts 2,2 --np 4 --backend hier")).is_ok());
    }

    #[test]
    fn backends_must_be_known_and_compiled() {
        let manifest = ["default".to_owned(), "shm".to_owned()];
        let manifest = &manifest[..];
        assert_eq!(backend_features(&["shm".into()], manifest).unwrap(), ["comm-bench/shm"]);
        let e = backend_features(&["mpi".into()], manifest).unwrap_err().msg;
        assert!(e.contains("no `mpi` feature") && e.contains("usable now: shm"), "{e}");
        let e = backend_features(&["gloo".into()], manifest).unwrap_err().msg;
        assert!(e.contains("unknown backend `gloo`"), "{e}");
    }

    #[test]
    fn bench_plot_baseline_and_progress_flags() {
        let b = parse_bench(&args("--svg out.svg --baseline a.json --baseline=b.json,c.json --no-progress")).unwrap();
        assert_eq!(b.svg, Some(PathBuf::from("out.svg")));
        assert_eq!(b.baseline, [PathBuf::from("a.json"), PathBuf::from("b.json"), PathBuf::from("c.json")]);
        assert!(!b.progress && b.forward.is_empty());
        assert!(parse_bench(&[]).unwrap().progress);
        assert!(parse_bench(&args("--svg")).is_err());
    }

    #[test]
    fn backend_all_is_what_can_run_here() {
        let features: Vec<String> =
            ["default", "shm", "mpi", "mpi-raw", "hier", "nccl", "profiling"].map(String::from).into();
        let all = |req: &str, np: u32, mpi: bool, gpus: usize| {
            let req: Vec<String> = req.split(',').map(String::from).collect();
            expand_backends(&req, &features, np, || Ok(mpi), || gpus).unwrap()
        };
        assert_eq!(all("all", 2, true, 2), ["shm", "mpi", "mpi-raw", "hier", "nccl"]);
        assert_eq!(all("all", 2, false, 0), ["shm"]);
        assert_eq!(all("all", 4, true, 2), ["shm", "mpi", "mpi-raw", "hier"], "fewer GPUs than ranks");
        assert_eq!(all("mpi,all", 2, true, 0), ["mpi", "shm", "mpi-raw", "hier"], "no duplicates, given order first");
        assert_eq!(all("shm,mpi", 2, false, 0), ["shm", "mpi"], "named backends are kept (and checked later)");
        let shm_only: Vec<String> = vec!["shm".into()];
        let r = expand_backends(&["all".into()], &shm_only, 2, || panic!("mpi not asked"), || panic!("gpus")).unwrap();
        assert_eq!(r, ["shm"]);
    }

    #[test]
    fn baseline_paths_fall_back_to_per_backend_reports() {
        let dir = std::env::temp_dir().join(format!("xtask-baseline-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("one.json"), "{}").unwrap();
        std::fs::write(dir.join("two.shm.json"), "{}").unwrap();
        std::fs::write(dir.join("two.mpi.json"), "{}").unwrap();
        assert_eq!(baseline_files(&[dir.join("one.json")]).unwrap(), [dir.join("one.json")]);
        assert_eq!(
            baseline_files(&[dir.join("two.json")]).unwrap(),
            [dir.join("two.shm.json"), dir.join("two.mpi.json")]
        );
        let e = baseline_files(&[dir.join("three.json")]).unwrap_err().msg;
        assert!(e.contains("three.json: no such report") && e.contains("three.<backend>.json"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn shm_and_mpi_raw_are_interleaved_where_they_can_be() {
        let partner = |a: &str| interleaved(&parse_bench(&args(a)).unwrap()).map(str::to_owned);
        assert_eq!(partner("--backend shm,mpi,mpi-raw --rounds 3").as_deref(), Some("shm"));
        assert_eq!(partner("--backend mpi-raw,mpi").as_deref(), Some("mpi"));
        assert_eq!(partner("--backend shm,mpi"), None);
        assert_eq!(partner("--backend nccl,mpi-raw"), None);
        assert_eq!(partner("--backend shm,mpi-raw --profile"), None);
        assert_eq!(partner("--backend shm,mpi-raw --trace t.json"), None);
        assert_eq!(partner("--backend shm,mpi-raw -- --zero-copy"), None);
    }

    #[test]
    fn json_paths_per_backend() {
        assert_eq!(json_path(Path::new("r/out.json"), "shm", false), Path::new("r/out.json"));
        assert_eq!(json_path(Path::new("r/out.json"), "shm", true), Path::new("r/out.shm.json"));
        assert_eq!(json_path(Path::new("out"), "mpi", true), Path::new("out.mpi"));
    }
}
