//! Two jobs started at the same time on one host, on the same rendezvous port, with each
//! launcher's variables: they never pair. Each rank either finishes its job with its own
//! job's result or fails with a clear error (job token mismatch, port in use); never a result
//! mixing both jobs. MPICH's Hydra is played by a shell that starts both ranks of a job (as
//! its proxy does), Slurm by two steps of one job.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use comm_api::{Config, HostBuffer, ReduceOp};
use comm_test::multiprocess::CHILD_ENV;

const T: Duration = Duration::from_secs(60);

/// In a child: one rank of job `JOB` (1 or 2). Its input is the job's number, so a sum
/// mixing jobs is visible.
async fn rank_body() -> Result<String, String> {
    let job: f64 = std::env::var("JOB").ok().and_then(|j| j.parse().ok()).ok_or("JOB unset")?;
    let cfg = Config::from_env().map_err(|e| e.to_string())?;
    let pg = comm_api::init(cfg).await.map_err(|e| format!("REFUSED {e}"))?;
    let n = f64::from(pg.world_size());
    let sum = pg
        .all_reduce(HostBuffer::from_slice(&[job; 16]), ReduceOp::Sum)
        .await
        .map_err(|e| format!("REFUSED {e}"))?
        .to_vec::<f64>()
        .map_err(|e| e.to_string())?;
    if sum.iter().any(|&x| x != job * n) {
        return Err(format!("WRONG job {job}: all_reduce gave {} (another job's data)", sum[0]));
    }
    pg.shutdown().await.map_err(|e| e.to_string())?;
    Ok(format!("OK job {job}"))
}

fn child() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    match rt.block_on(rank_body()) {
        Ok(line) => println!("\nRESULT {line}"),
        Err(e) => println!("\nRESULT {e}"),
    }
    rt.shutdown_background();
    std::process::exit(0);
}

/// Starts two jobs of two ranks, each under a shell of its own (their common parent, like a
/// launcher's per-host process), with `vars(job, rank)` as launcher variables; returns every
/// rank's RESULT line.
fn two_jobs(test: &str, vars: impl Fn(u32, u32) -> Vec<(&'static str, String)>) -> Vec<String> {
    let exe = std::env::current_exe().unwrap();
    let mut shells = Vec::new();
    for job in 1..=2u32 {
        // `sh` starts both ranks and waits for them: each rank's parent is this job's shell.
        let mut script = String::new();
        for rank in 0..2 {
            let env: String = vars(job, rank).iter().map(|(k, v)| format!("{k}={v} ")).collect();
            script.push_str(&format!("env {env}JOB={job} \"$0\" {test} --exact --nocapture --test-threads=1 & "));
        }
        script.push_str("wait");
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(script).arg(&exe).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::null());
        for (k, _) in std::env::vars() {
            if ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"].contains(&k.as_str())
                || ["COMM_", "PMI", "SLURM_", "OMPI_", "MPI_LOCAL", "TORCHELASTIC_", "LOCAL_"]
                    .iter()
                    .any(|p| k.starts_with(p))
            {
                cmd.env_remove(k);
            }
        }
        cmd.env(CHILD_ENV, "1").env("COMM_TIMEOUT", "20").env("COMM_BACKEND", "shm");
        shells.push(cmd.spawn().unwrap());
    }
    let start = Instant::now();
    let mut lines = Vec::new();
    for mut sh in shells {
        while sh.try_wait().unwrap().is_none() {
            assert!(start.elapsed() < T, "a job hung (no rank may wait forever)");
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut out = String::new();
        std::io::Read::read_to_string(sh.stdout.as_mut().unwrap(), &mut out).unwrap();
        lines.extend(out.lines().filter_map(|l| l.strip_prefix("RESULT ").map(str::to_owned)));
    }
    lines
}

/// Every rank reported, none saw another job's data, a refusal is one of the clear ones, and
/// one job at least ran (the first to bind the port).
fn check(lines: &[String]) {
    assert_eq!(lines.len(), 4, "every rank reports: {lines:?}");
    for l in lines {
        assert!(
            l.starts_with("OK")
                || (l.starts_with("REFUSED")
                    && (l.contains("belongs to another job") || l.contains("MASTER_PORT") || l.contains("address"))),
            "unexpected outcome: {l} (all: {lines:?})"
        );
    }
    assert!(lines.iter().filter(|l| l.starts_with("OK")).count() >= 2, "no job ran: {lines:?}");
}

fn port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string()
}

/// Two jobs of `launcher` (see [`launched`]) on one port never pair.
fn two_jobs_of(test: &str, launcher: &str) {
    let p = port();
    check(&two_jobs(test, |job, rank| launched(launcher, job, rank, &p)));
}

#[test]
fn two_mpich_jobs_never_pair() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return child();
    }
    // Hydra exports ranks and sizes but no job id; both jobs use one (default-like) port.
    two_jobs_of("two_mpich_jobs_never_pair", "mpiexec.mpich");
}

#[test]
fn two_slurm_steps_never_pair() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return child();
    }
    // Two `srun` steps of one allocation: same job id, different step ids.
    two_jobs_of("two_slurm_steps_never_pair", "srun");
}

#[test]
fn two_open_mpi_jobs_never_pair() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return child();
    }
    // Each mpirun has its own job id.
    two_jobs_of("two_open_mpi_jobs_never_pair", "mpirun");
}

#[test]
fn two_deepspeed_jobs_never_pair() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return child();
    }
    // The DeepSpeed launcher exports torchrun's variables plus LOCAL_SIZE, with MASTER_PORT
    // 29500 for every job unless told otherwise, and no job id.
    two_jobs_of("two_deepspeed_jobs_never_pair", "deepspeed");
}

#[path = "../../discovery/tests/support/fake_torch.rs"]
mod fake_torch;

/// Rank `rank` of job `job` as `launcher` starts it, on `port`: what `two_jobs` exports.
fn launched(launcher: &str, job: u32, rank: u32, port: &str) -> Vec<(&'static str, String)> {
    let mut vars = match launcher {
        "mpirun" => vec![
            ("OMPI_COMM_WORLD_RANK", rank.to_string()),
            ("OMPI_COMM_WORLD_SIZE", "2".into()),
            ("OMPI_COMM_WORLD_LOCAL_RANK", rank.to_string()),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2".into()),
            ("OMPI_MCA_ess_base_jobid", format!("{}", 1000 + job)),
        ],
        "srun" => vec![
            ("SLURM_JOB_ID", "4242".into()),
            ("SLURM_STEP_ID", (job - 1).to_string()),
            ("SLURM_PROCID", rank.to_string()),
            ("SLURM_NTASKS", "2".into()),
            ("SLURM_LOCALID", rank.to_string()),
            ("SLURM_TASKS_PER_NODE", "2".into()),
            ("SLURM_NODELIST", "localhost".into()),
        ],
        "mpiexec.mpich" => vec![
            ("PMI_RANK", rank.to_string()),
            ("PMI_SIZE", "2".into()),
            ("MPI_LOCALRANKID", rank.to_string()),
            ("MPI_LOCALNRANKS", "2".into()),
        ],
        "deepspeed" => vec![
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", "2".into()),
            ("LOCAL_RANK", rank.to_string()),
            ("LOCAL_SIZE", "2".into()),
        ],
        // Started by hand, with a token of each job's own or none.
        "tokens" | "by hand" => vec![
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", "2".into()),
            ("LOCAL_RANK", rank.to_string()),
            ("LOCAL_WORLD_SIZE", "2".into()),
        ],
        "torchrun" => vec![
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", "2".into()),
            ("LOCAL_RANK", rank.to_string()),
            ("LOCAL_WORLD_SIZE", "2".into()),
            ("GROUP_RANK", "0".into()),
            ("TORCHELASTIC_RESTART_COUNT", "0".into()),
            ("TORCHELASTIC_RUN_ID", format!("run-{job}")),
            ("TORCHELASTIC_USE_AGENT_STORE", "True".into()),
        ],
        other => panic!("no launcher {other}"),
    };
    if launcher == "tokens" {
        vars.push(("COMM_JOB_TOKEN", format!("token-of-job-{job}")));
    }
    vars.push(("MASTER_ADDR", "127.0.0.1".into()));
    vars.push(("MASTER_PORT", port.to_owned()));
    vars
}

/// Another job's torch store (torch.distributed, a torchrun agent) holds the port: two jobs
/// of every launcher next to it are refused at once, saying so; none writes to that store.
#[test]
fn jobs_next_to_another_jobs_torch_store_are_refused() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return child();
    }
    let torch = fake_torch::FakeTorchStore::start();
    let p = torch.port().to_string();
    for launcher in ["mpirun", "srun", "mpiexec.mpich", "tokens", "by hand"] {
        let lines = two_jobs("jobs_next_to_another_jobs_torch_store_are_refused", |job, rank| {
            launched(launcher, job, rank, &p)
        });
        assert_eq!(lines.len(), 4, "{launcher}: every rank reports: {lines:?}");
        for l in &lines {
            let clear = l.contains("torch TCPStore") || (launcher == "by hand" && l.contains("cannot tell this job"));
            assert!(l.starts_with("REFUSED") && clear, "{launcher}: {l} (all: {lines:?})");
        }
    }
    assert!(torch.keys().is_empty(), "{:?}", torch.keys());
}

/// Two torchrun jobs whose agents share one store (and a job of another launcher next to a
/// torchrun job): each torchrun job keeps to keys of its own and gets its own sums; the other
/// launcher's job is refused, and the torchrun job is unharmed.
#[test]
fn torchrun_jobs_keep_to_their_own_keys() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return child();
    }
    let agent = fake_torch::FakeTorchStore::start();
    let p = agent.port().to_string();
    let lines = two_jobs("torchrun_jobs_keep_to_their_own_keys", |job, rank| launched("torchrun", job, rank, &p));
    assert_eq!((ok_lines(&lines, 1), ok_lines(&lines, 2)), (2, 2), "{lines:?}");
    let jobs: std::collections::BTreeSet<_> =
        agent.keys().iter().filter_map(|k| String::from_utf8_lossy(k).split('/').nth(1).map(str::to_owned)).collect();
    assert_eq!(jobs.len(), 2, "two prefixes, one per job: {:?}", agent.keys());
    for other in ["mpirun", "tokens"] {
        let agent = fake_torch::FakeTorchStore::start();
        let p = agent.port().to_string();
        let lines = two_jobs("torchrun_jobs_keep_to_their_own_keys", |job, rank| {
            launched(if job == 1 { "torchrun" } else { other }, job, rank, &p)
        });
        let refused = lines.iter().filter(|l| l.starts_with("REFUSED") && l.contains("torch TCPStore")).count();
        assert_eq!((ok_lines(&lines, 1), refused), (2, 2), "torchrun next to {other}: {lines:?}");
    }
}

fn ok_lines(lines: &[String], job: u32) -> usize {
    lines.iter().filter(|l| **l == format!("OK job {job}")).count()
}
