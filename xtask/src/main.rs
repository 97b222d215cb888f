//! Project automation: `cargo xtask test [--quick]`, `cargo xtask ci`, `cargo xtask bench [...]`,
//! `cargo xtask tidy`, `cargo xtask gpu-test [--no-run]`.
//!
//! `std` with clap (arguments) and indicatif (the bench progress bar), so it builds in seconds
//! before anything else.

use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, ExitStatus};
use std::thread::sleep;
use std::time::{Duration, Instant};

mod bench;
mod mpi;
mod progress;
mod test;
mod tidy;

use bench::bench;
use test::{gpu_test, test};

/// Project automation.
#[derive(clap::Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask")]
enum Cli {
    /// Every check CI runs (`--quick`: without fmt and clippy).
    ///
    /// Installs the mpi backend's system packages when missing (apt, as root), tidy, fmt check,
    /// clippy -D warnings (with the mpi feature), cargo test --workspace, the mpi backend's
    /// tests (conformance suite under mpirun at 1-4 ranks, faults), every comm-api example under
    /// commrun -n 2 and -n 3 and under mpirun -np 2, and comm-bench smoke runs on shm and mpi
    /// (debug build). The nccl feature is built, linted and unit-tested too (no GPU needed: its
    /// GPU tests print `skipped: no CUDA device`); so are the profiling and otel features.
    Test(TestArgs),
    /// The same as `test` (what .ci/run calls).
    Ci(TestArgs),
    /// The structure rules (`test` runs them first).
    ///
    /// No import circle among one crate's files, no source file over 800 lines, README's
    /// Environment table and the `COMM_*` variables the code reads agree, every type
    /// ARCHITECTURE's vocabulary table names exists, README's first screen names
    /// `cargo xtask test` and `cargo xtask bench`.
    Tidy,
    /// Installs the system packages the mpi backend needs.
    ///
    /// apt, when missing, as root; `test` does this first.
    Deps,
    /// The GPU tests, which fail where NCCL cannot run.
    ///
    /// The NCCL backend's GPU tests (conformance suite on 1 rank, and on 2 where two GPUs are
    /// visible; zero-copy device ops; abort on timeout) and comm-api's nccl tests, with
    /// COMM_NCCL_REQUIRE_GPU=1: where NCCL cannot run they fail instead of skipping.
    GpuTest {
        /// Only build them and print the test binaries (to carry to a GPU machine without a
        /// Rust toolchain; run them there with COMM_NCCL_REQUIRE_GPU=1 --test-threads=1).
        #[arg(long)]
        no_run: bool,
    },
    /// Benchmarks backends side by side (comm-bench in release).
    ///
    /// Builds commrun and comm-bench in release and runs `commrun -n NP -- comm-bench ...` once
    /// per backend (`mpirun -np NP comm-bench ...` for mpi); with several backends, a
    /// side-by-side table with the time ratio of each to the first follows.
    Bench(Box<bench::BenchCli>),
}

#[derive(clap::Args)]
struct TestArgs {
    /// Skip fmt and clippy.
    #[arg(long)]
    quick: bool,
}

/// Backends `--backend` knows about; each must be a feature of comm-bench to be usable.
/// Why xtask stops: a message and the exit code to stop with.
#[derive(Debug)]
struct Failure {
    code: u8,
    msg: String,
}

impl Failure {
    fn usage(msg: impl Into<String>) -> Failure {
        Failure { code: 2, msg: format!("{} (see `cargo xtask help`)", msg.into()) }
    }
}

type Result<T = (), E = Failure> = std::result::Result<T, E>;

fn main() -> ExitCode {
    let cli = match <Cli as clap::Parser>::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    let result = match cli {
        Cli::Test(t) | Cli::Ci(t) => test(t.quick),
        Cli::Bench(b) => bench(*b),
        Cli::Tidy => step("tidy", tidy::tidy),
        Cli::Deps => step("system packages of the mpi backend", || {
            if mpi::ensure_packages()? {
                Ok(())
            } else {
                Err(Failure { code: 1, msg: "the mpi backend's packages are missing (see above)".into() })
            }
        }),
        Cli::GpuTest { no_run } => gpu_test(no_run),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("xtask: {}", f.msg);
            ExitCode::from(f.code.max(1))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Shared helpers

/// The workspace root (the parent of this crate's directory).
fn root() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    dir.parent().unwrap_or(dir).to_path_buf()
}

/// The cargo that runs us (`cargo xtask` sets `CARGO`), or `cargo` from `PATH`.
fn cargo() -> Command {
    let mut c = Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    c.current_dir(root());
    c
}

/// The shell form of a command, for logs.
fn show(cmd: &Command) -> String {
    let mut s = String::new();
    for (k, v) in cmd.get_envs() {
        if let Some(v) = v {
            let _ = write!(s, "{}={} ", k.to_string_lossy(), v.to_string_lossy());
        }
    }
    s.push_str(&cmd.get_program().to_string_lossy());
    for a in cmd.get_args() {
        let a = a.to_string_lossy();
        if a.is_empty() || a.contains(|c: char| c.is_whitespace() || "'\"$*?;&|<>()".contains(c)) {
            let _ = write!(s, " '{}'", a.replace('\'', r"'\''"));
        } else {
            let _ = write!(s, " {a}");
        }
    }
    s
}

/// The exit code to stop with for a finished child.
fn exit_code(status: ExitStatus) -> u8 {
    match status.code() {
        Some(c) => u8::try_from(c).unwrap_or(1).max(1),
        None => {
            #[cfg(unix)]
            {
                use std::os::unix::process::ExitStatusExt;
                status.signal().map_or(1, |s| 128u8.saturating_add(u8::try_from(s).unwrap_or(0)))
            }
            #[cfg(not(unix))]
            {
                1
            }
        }
    }
}

/// Runs `cmd` to completion, failing with its exit code.
fn run(mut cmd: Command) -> Result {
    println!("$ {}", show(&cmd));
    let status = cmd.status().map_err(|e| Failure { code: 1, msg: format!("cannot run `{}`: {e}", show(&cmd)) })?;
    if status.success() {
        Ok(())
    } else {
        Err(Failure { code: exit_code(status), msg: format!("`{}` failed ({status})", show(&cmd)) })
    }
}

/// Like [`run`], but stops the command (SIGTERM, then SIGKILL) after `limit`.
fn run_bounded(mut cmd: Command, limit: Duration) -> Result {
    println!("$ {}", show(&cmd));
    let mut child = cmd.spawn().map_err(|e| Failure { code: 1, msg: format!("cannot run `{}`: {e}", show(&cmd)) })?;
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if start.elapsed() < limit => sleep(Duration::from_millis(50)),
            Ok(None) => {
                stop(&mut child);
                return Err(Failure {
                    code: 124,
                    msg: format!("`{}` did not finish within {}s and was stopped", show(&cmd), limit.as_secs()),
                });
            }
            Err(e) => return Err(Failure { code: 1, msg: format!("waiting for `{}`: {e}", show(&cmd)) }),
        }
    };
    if status.success() {
        Ok(())
    } else {
        Err(Failure { code: exit_code(status), msg: format!("`{}` failed ({status})", show(&cmd)) })
    }
}

/// SIGTERM (commrun forwards it to its ranks), then SIGKILL if it is still there after 5 s.
fn stop(child: &mut Child) {
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Prints a banner, runs `f`, and reports how long it took.
fn step(name: &str, f: impl FnOnce() -> Result) -> Result {
    println!("\n== {name} ==");
    let start = Instant::now();
    let r = f();
    let secs = start.elapsed().as_secs_f64();
    match &r {
        Ok(()) => println!("== {name}: ok ({secs:.1}s) =="),
        Err(e) => println!("== {name}: FAILED ({secs:.1}s, exit code {}) ==", e.code),
    }
    r
}

/// The workspace's metadata (`cargo metadata`, no dependencies, offline).
fn metadata() -> Result<cargo_metadata::Metadata> {
    cargo_metadata::MetadataCommand::new()
        .current_dir(root())
        .no_deps()
        .other_options(vec!["--offline".to_owned()])
        .exec()
        .map_err(|e| Failure { code: 1, msg: format!("cargo metadata: {e}") })
}

/// The workspace's target directory.
fn target_dir() -> Result<PathBuf> {
    Ok(metadata()?.target_directory.into_std_path_buf())
}

/// The features of the workspace package `name`.
fn cargo_features(name: &str) -> Result<Vec<String>> {
    let metadata = metadata()?;
    let package = metadata.packages.iter().find(|p| p.name.as_str() == name);
    let package = package.ok_or_else(|| Failure { code: 1, msg: format!("no package `{name}` in the workspace") })?;
    Ok(package.features.keys().cloned().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_shown_quoted() {
        let mut c = Command::new("prog");
        c.args(["a", "b c", ""]).env("K", "v");
        assert_eq!(show(&c), "K=v prog a 'b c' ''");
    }
}
