//! Jobs under `mpirun`: a test re-executes its own binary on every rank, with an environment
//! variable naming the scenario that binary's `child` test then runs, and looks at the output.

use std::ffi::OsString;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How a job ended.
pub struct Job {
    /// mpirun's exit code (`None`: killed by a signal).
    pub code: Option<i32>,
    /// Everything every rank printed, stdout then stderr.
    pub output: String,
    /// How long it ran.
    pub elapsed: Duration,
}

impl Job {
    /// The output lines that contain `tag`.
    pub fn lines(&self, tag: &str) -> Vec<&str> {
        self.output.lines().filter(|l| l.contains(tag)).collect()
    }
}

impl std::fmt::Display for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "exit {:?} after {:.1?}; output:\n{}", self.code, self.elapsed, self.output)
    }
}

/// One job: `np` ranks of this test binary's `child` test, with `child.0 = child.1` set.
pub struct Launch<'a> {
    /// Ranks.
    pub np: u32,
    /// The variable that names the scenario, and the scenario.
    pub child: (&'a str, &'a str),
    /// More environment for every rank.
    pub envs: &'a [(&'a str, &'a str)],
    /// Killed after this long (`timeout -k 5`).
    pub limit: Duration,
    /// Open MPI's options beyond the usual ones (`--mca btl tcp,self`).
    pub open_mpi_args: &'a [&'a str],
    /// A command each rank runs the binary through (`simhosts run DIR 2,2 --`).
    pub wrapper: Vec<OsString>,
    /// Output lines containing one of these are printed as the job's summary.
    pub summary: &'a [&'a str],
}

static ONE_JOB: Mutex<()> = Mutex::new(());

/// The launcher (`$MPIRUN` or `mpirun`) and whether it is Open MPI's; `None` if missing.
pub fn launcher() -> Option<(String, bool)> {
    let name = std::env::var("MPIRUN").unwrap_or_else(|_| "mpirun".into());
    let out = Command::new(&name).arg("--version").stdin(Stdio::null()).output().ok().filter(|o| o.status.success())?;
    let open_mpi = String::from_utf8_lossy(&out.stdout).contains("Open MPI");
    Some((name, open_mpi))
}

/// Runs the job (one at a time per test binary); `None`, after saying so, when mpirun is not
/// installed.
pub fn run(l: Launch<'_>) -> Option<Job> {
    let Some((mpirun, open_mpi)) = launcher() else {
        eprintln!("skipped: `mpirun` not found (install openmpi-bin, or set MPIRUN)");
        return None;
    };
    let _one = ONE_JOB.lock().unwrap_or_else(|p| p.into_inner());
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = Command::new("timeout");
    cmd.args(["-k", "5", &l.limit.as_secs().to_string(), &mpirun]);
    if open_mpi {
        cmd.args(["--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]).args(l.open_mpi_args);
    }
    cmd.args(["-np", &l.np.to_string()]).args(&l.wrapper);
    cmd.arg(&exe).args(["child", "--exact", "--nocapture", "--test-threads=1"]);
    cmd.env(l.child.0, l.child.1).stdin(Stdio::null());
    for (k, v) in l.envs {
        cmd.env(k, v);
    }
    let start = Instant::now();
    let out = cmd.output().expect("running timeout/mpirun");
    let elapsed = start.elapsed();
    let output = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // The whole output goes into failure messages; a summary is enough otherwise.
    println!("mpirun -np {} {}: {elapsed:.1?}, exit {:?}", l.np, l.child.1, out.status.code());
    for line in output.lines().filter(|line| l.summary.iter().any(|t| line.contains(t))) {
        println!("    {}", line.trim_start_matches("test child ... "));
    }
    Some(Job { code: out.status.code(), output, elapsed })
}

/// Runs the conformance suite on this rank of `backend`'s group and prints `SUITE-OK` (or
/// `SUITE-FAILED` with every failure) for the parent to count; the child's exit code.
pub async fn suite_child(backend: std::sync::Arc<dyn comm_core::Backend>, cfg: &crate::SuiteConfig) -> i32 {
    let (me, n) = (backend.rank(), backend.world_size());
    match crate::suite::run(backend, cfg).await {
        Ok(r) => {
            println!("SUITE-OK rank {me}/{n}: {} checks passed in {:.2?}", r.checks, r.elapsed);
            0
        }
        Err(e) => {
            eprintln!("SUITE-FAILED rank {me}/{n}: {e}");
            1
        }
    }
}
