//! `init` from each launcher's variables alone, as real processes: Open MPI, MPICH, Slurm and
//! torchrun (with its agent store, faked here), plus ranks on simulated hosts (127.0.0.2/3/4).
//!
//! `comm_test::multiprocess` gives children the torchrun variables, so these tests start
//! their ranks themselves with *only* the launcher's variables (everything launcher-like from
//! the test's own environment removed) and use `multiprocess::run` in the children only.

#[path = "../../discovery/tests/support/fake_torch.rs"]
mod fake_torch;

use std::fs::File;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use comm_api::{BackendKind, CommError, Config, HostBuffer, Launcher, ReduceOp, StoreKind};
use comm_test::multiprocess::{self, CHILD_ENV};

const T: Duration = Duration::from_secs(120);

/// Names and prefixes of variables a launcher may set: removed from the children's environment.
const LAUNCHER_VARS: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CROSS_RANK",
    "CROSS_SIZE",
    "DLTS_JOB_ID",
];
const LAUNCHER_PREFIXES: &[&str] =
    &["OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI_LOCAL", "TORCHELASTIC_", "AZUREML_", "AZ_BATCH", "SM_", "COMM_"];

fn is_child() -> bool {
    std::env::var_os(CHILD_ENV).is_some()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

fn vars(pairs: &[(&str, String)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect()
}

/// A command running this test binary's `test` as a child, with only `env` as launcher
/// variables, its output to `log`.
fn rank_command(test: &str, log: &std::path::Path, env: Vec<(String, String)>) -> Command {
    let mut cmd = child_command(std::env::current_exe().expect("the test binary"), log, env);
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"]);
    cmd
}

/// `program` with only `env` as launcher variables (and the child marker), output to `log`.
fn child_command(program: impl AsRef<std::ffi::OsStr>, log: &std::path::Path, env: Vec<(String, String)>) -> Command {
    let out = File::create(log).expect("log file");
    let mut cmd = Command::new(program);
    cmd.stdin(Stdio::null()).stdout(out.try_clone().expect("log file")).stderr(out);
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        if LAUNCHER_VARS.contains(&&*k) || LAUNCHER_PREFIXES.iter().any(|p| k.starts_with(p)) {
            cmd.env_remove(&*k);
        }
    }
    cmd.env(CHILD_ENV, "1").env("RUST_BACKTRACE", "1").envs(env);
    cmd
}

fn log_path(test: &str, tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("comm-launchers-{}-{test}-{tag}.log", std::process::id()))
}

/// Waits for `procs` (killing all past `T`); each one's exit status and output.
fn wait_all(procs: Vec<(Child, std::path::PathBuf)>) -> Vec<(Option<std::process::ExitStatus>, String)> {
    let deadline = Instant::now() + T;
    let mut procs: Vec<_> = procs.into_iter().map(|(c, log)| (c, log, None)).collect();
    while procs.iter().any(|p| p.2.is_none()) && Instant::now() < deadline {
        for (c, _, status) in procs.iter_mut().filter(|p| p.2.is_none()) {
            *status = c.try_wait().ok().flatten();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    procs
        .into_iter()
        .map(|(mut c, log, status)| {
            let status = status.or_else(|| {
                let _ = c.kill();
                c.wait().ok()
            });
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let _ = std::fs::remove_file(&log);
            (status, text)
        })
        .collect()
}

/// Starts `n` ranks of this test binary running `test` with only `env(rank)` as launcher
/// variables; waits (killing all past `T`) and panics with every rank's output if one failed.
fn launch(test: &str, n: u32, env: impl Fn(u32) -> Vec<(String, String)>) {
    let ranks = (0..n)
        .map(|rank| {
            let log = log_path(test, &rank.to_string());
            (rank_command(test, &log, env(rank)).spawn().expect("start a rank"), log)
        })
        .collect();
    let mut report = String::new();
    let mut failed = false;
    for (i, (status, text)) in wait_all(ranks).into_iter().enumerate() {
        let ok = status.is_some_and(|s| s.success()) && text.contains("COMM_TEST_CHILD_DONE");
        failed |= !ok;
        report.push_str(&format!("--- rank {i}: {status:?} ok={ok}\n{text}\n"));
    }
    assert!(!failed, "`{test}` failed:\n{report}");
}

/// The job every test runs: init from the environment, check the launcher was recognised,
/// all_reduce, and show `describe()`.
async fn all_reduce_job(launcher: Launcher, store: StoreKind) -> Result<(), String> {
    let cfg = Config::from_env().map_err(|e| e.to_string())?;
    if cfg.world.source.launcher != launcher || cfg.world.store != store {
        return Err(format!("expected {launcher:?} with a {store:?} store, got {}", cfg.world));
    }
    let pg = comm_api::init(cfg).await.map_err(|e| e.to_string())?;
    let (rank, n) = (pg.rank(), pg.world_size());
    let sum = pg
        .all_reduce(HostBuffer::from_slice(&[rank as f64 + 1.0; 1000]), ReduceOp::Sum)
        .await
        .map_err(|e| e.to_string())?
        .to_vec::<f64>()
        .map_err(|e| e.to_string())?;
    let want = f64::from(n * (n + 1) / 2);
    if sum.iter().any(|&x| x != want) {
        return Err(format!("rank {rank}: all_reduce gave {}, want {want}", sum[0]));
    }
    println!("{}", pg.describe());
    pg.barrier().await.map_err(|e| e.to_string())?;
    pg.shutdown().await.map_err(|e| e.to_string())
}

#[test]
fn open_mpi_variables_only() {
    if is_child() {
        return multiprocess::run(3, "open_mpi_variables_only", T, || {
            all_reduce_job(Launcher::OpenMpi, StoreKind::Rank0)
        });
    }
    // What `mpirun -np 3` (Open MPI 4.1) sets, plus MASTER_PORT as DeepSpeed's MPI runners export it.
    let port = free_port().to_string();
    launch("open_mpi_variables_only", 3, |r| {
        vars(&[
            ("OMPI_COMM_WORLD_RANK", r.to_string()),
            ("OMPI_COMM_WORLD_SIZE", "3".into()),
            ("OMPI_COMM_WORLD_LOCAL_RANK", r.to_string()),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "3".into()),
            ("OMPI_COMM_WORLD_NODE_RANK", "0".into()),
            ("OMPI_UNIVERSE_SIZE", "3".into()),
            ("OMPI_MCA_ess_base_jobid", "2812870657".into()),
            ("OMPI_MCA_ess_base_vpid", r.to_string()),
            ("OMPI_MCA_orte_hnp_uri", "2812870656.0;tcp://127.0.0.1:45371".into()),
            ("PMIX_RANK", r.to_string()),
            ("PMIX_NAMESPACE", "2812870657".into()),
            ("MASTER_PORT", port.clone()),
        ])
    });
}

#[test]
fn mpich_variables_only() {
    if is_child() {
        return multiprocess::run(2, "mpich_variables_only", T, || all_reduce_job(Launcher::Mpich, StoreKind::Rank0));
    }
    let port = free_port().to_string();
    launch("mpich_variables_only", 2, |r| {
        vars(&[
            ("PMI_RANK", r.to_string()),
            ("PMI_SIZE", "2".into()),
            ("PMI_FD", "6".into()),
            ("MPI_LOCALRANKID", r.to_string()),
            ("MPI_LOCALNRANKS", "2".into()),
            ("MASTER_PORT", port.clone()),
        ])
    });
}

/// The job of the identity tests: job `COMM_TEST_JOB` (1 or 2) all-reduces values that name
/// it; a rank prints `SUMS-OK` with its job's sum, or `REFUSED` with a clear start-up error.
async fn identified_job() -> Result<(), String> {
    let job: f64 = std::env::var("COMM_TEST_JOB").map_err(|e| e.to_string())?.parse().map_err(|e| format!("{e}"))?;
    let pg = match comm_api::init(Config::from_env().map_err(|e| e.to_string())?).await {
        Ok(pg) => pg,
        Err(e @ (CommError::Store(_) | CommError::Io { .. } | CommError::Config(_))) => {
            println!("REFUSED job {job}: {e}");
            return Ok(());
        }
        Err(e) => return Err(format!("job {job}: not a clear refusal: {e}")),
    };
    let n = f64::from(pg.world_size());
    let mine = job * 1000.0 + f64::from(pg.rank());
    let got = pg.all_reduce(HostBuffer::from_slice(&[mine; 64]), ReduceOp::Sum).await.map_err(|e| e.to_string())?;
    let want = job * 1000.0 * n + n * (n - 1.0) / 2.0;
    let got = got.to_vec::<f64>().map_err(|e| e.to_string())?[0];
    if got != want {
        return Err(format!("WRONG job {job} rank {}: sum {got}, want {want}", pg.rank()));
    }
    println!("SUMS-OK job {job} rank {}", pg.rank());
    pg.shutdown().await.map_err(|e| e.to_string())
}

/// Two Open MPI jobs inside one Slurm allocation (`salloc` exports `SLURM_JOB_ID` and no step
/// id to both `mpirun`s) on one port: the launcher that started the ranks (mpirun, its job id)
/// decides their identity, so they never pair. Each ends with its own right sums or refused.
#[test]
fn two_mpiruns_in_one_slurm_allocation_do_not_pair() {
    const TEST: &str = "two_mpiruns_in_one_slurm_allocation_do_not_pair";
    if is_child() {
        return multiprocess::run(2, TEST, T, identified_job);
    }
    for round in 0..3 {
        let port = free_port().to_string();
        two_jobs(TEST, round, |job, r| {
            vars(&[
                ("OMPI_COMM_WORLD_RANK", r.to_string()),
                ("OMPI_COMM_WORLD_SIZE", "2".into()),
                ("OMPI_COMM_WORLD_LOCAL_RANK", r.to_string()),
                ("OMPI_COMM_WORLD_LOCAL_SIZE", "2".into()),
                ("OMPI_MCA_ess_base_jobid", format!("28128706{job}7")),
                ("SLURM_JOB_ID", "4242".into()),
                ("SLURM_NTASKS", "4".into()),
                ("MASTER_PORT", port.clone()),
            ])
        });
    }
}

/// The same with real `mpirun`s (Open MPI): two jobs at once inside what `salloc` gives them
/// (`SLURM_JOB_ID`, no step), on one `MASTER_PORT`, shm backend (this binary has no `mpi`
/// feature). Skipped without Open MPI.
#[test]
fn two_real_mpiruns_in_one_slurm_allocation_do_not_pair() {
    const TEST: &str = "two_real_mpiruns_in_one_slurm_allocation_do_not_pair";
    if is_child() {
        return multiprocess::run(2, TEST, T, identified_job);
    }
    let Some((mpirun, true)) = comm_test::mpirun::launcher() else {
        eprintln!("skipped: needs Open MPI's mpirun");
        return;
    };
    for round in 0..3 {
        let port = free_port().to_string();
        let jobs = (1..=2u32).map(|job| {
            let log = log_path(TEST, &format!("{round}-{job}"));
            let env = vars(&[
                ("SLURM_JOB_ID", "4242".into()),
                ("MASTER_PORT", port.clone()),
                ("COMM_TEST_JOB", job.to_string()),
                ("COMM_TIMEOUT", "20".into()),
            ]);
            let mut cmd = child_command(&mpirun, &log, env);
            cmd.args(["--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "2"]);
            for v in ["SLURM_JOB_ID", "MASTER_PORT", "COMM_TEST_JOB", "COMM_TIMEOUT", CHILD_ENV] {
                cmd.args(["-x", v]);
            }
            cmd.arg(std::env::current_exe().unwrap()).args([TEST, "--exact", "--nocapture", "--test-threads=1"]);
            (cmd.spawn().expect("start mpirun"), log)
        });
        let done = wait_all(jobs.collect());
        let all: String = done.iter().map(|(s, t)| format!("--- {s:?}\n{t}\n")).collect();
        assert!(
            !all.contains("WRONG") && done.iter().all(|(s, _)| s.is_some_and(|s| s.success())),
            "round {round}:\n{all}"
        );
        let summed = all.matches("SUMS-OK").count();
        assert_eq!(
            summed + all.matches("REFUSED").count(),
            4,
            "round {round}: every rank summed or was refused:\n{all}"
        );
        assert!(summed >= 2, "round {round}: no job ran:\n{all}");
        println!("round {round}: {summed} ranks summed right, {} refused", 4 - summed);
    }
}

/// Two jobs of 2 ranks each started at once (`env(job, rank)` plus the job's number), each
/// rank running [`identified_job`]: every rank ends with its own job's right sums or a clear
/// refusal. How many ranks summed.
fn two_jobs(test: &str, round: u32, env: impl Fn(u32, u32) -> Vec<(String, String)>) -> usize {
    let mut procs = Vec::new();
    for job in 1..=2u32 {
        for r in 0..2u32 {
            let mut vars = env(job, r);
            vars.push(("COMM_TEST_JOB".into(), job.to_string()));
            vars.push(("COMM_TIMEOUT".into(), "20".into()));
            let log = log_path(test, &format!("{round}-{job}-{r}"));
            procs.push((rank_command(test, &log, vars).spawn().expect("start a rank"), log));
        }
    }
    let done = wait_all(procs);
    let all: String = done.iter().map(|(s, t)| format!("--- {s:?}\n{t}\n")).collect();
    for (status, text) in &done {
        let clear = text.contains("SUMS-OK") || text.contains("REFUSED");
        assert!(
            status.is_some_and(|s| s.success()) && clear,
            "round {round}: a rank neither summed nor was refused:\n{all}"
        );
    }
    let summed = done.iter().filter(|(_, t)| t.contains("SUMS-OK")).count();
    let refused: Vec<&str> = done.iter().flat_map(|(_, t)| t.lines().filter(|l| l.contains("REFUSED"))).collect();
    println!("round {round}: {summed} ranks summed right, refused: {refused:#?}");
    if std::env::var_os("DEBUG_JOBS").is_some() {
        println!("{all}");
    }
    summed
}

/// Two jobs started by hand (`RANK`, `WORLD_SIZE`, one `MASTER_PORT`, no launcher) cannot
/// mix: without a job token each is refused (nothing tells them apart), with a token of each
/// job's own one runs and the other is refused.
#[test]
fn two_jobs_started_by_hand_on_one_port_do_not_pair() {
    const TEST: &str = "two_jobs_started_by_hand_on_one_port_do_not_pair";
    if is_child() {
        return multiprocess::run(2, TEST, T, identified_job);
    }
    for round in 0..6 {
        let port = free_port().to_string();
        let with_tokens = round % 2 == 1;
        let summed = two_jobs(TEST, round, |job, r| {
            let mut v = vars(&[
                ("RANK", r.to_string()),
                ("WORLD_SIZE", "2".into()),
                ("MASTER_ADDR", "127.0.0.1".into()),
                ("MASTER_PORT", port.clone()),
            ]);
            if with_tokens {
                v.push(("COMM_JOB_TOKEN".into(), format!("job-{job}-{port}")));
            }
            v
        });
        let want = if with_tokens { 2 } else { 0 };
        assert_eq!(summed, want, "round {round} (tokens: {with_tokens})");
    }
}

/// MPICH's Hydra starts each rank through a wrapper that does not `exec` (`mpiexec -n 2 sh -c
/// 'P; echo done'`, job scripts, `nsys`): every rank has its own `sh`, and their identity is
/// the per-host proxy above them. Real processes: a `hydra_pmi_proxy` (a shell under that
/// name) starting two ranks through `sh -c`.
#[test]
fn ranks_behind_a_wrapper_find_their_launcher() {
    const TEST: &str = "ranks_behind_a_wrapper_find_their_launcher";
    if is_child() {
        return multiprocess::run(2, TEST, T, || all_reduce_job(Launcher::Mpich, StoreKind::Rank0));
    }
    let dir = std::env::temp_dir().join(format!("comm-hydra-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let proxy = dir.join("hydra_pmi_proxy");
    let _ = std::fs::remove_file(&proxy);
    std::os::unix::fs::symlink("/bin/sh", &proxy).unwrap();
    let exe = std::env::current_exe().unwrap();
    let rank = |r: u32| {
        format!(
            "PMI_RANK={r} MPI_LOCALRANKID={r} sh -c '\"{}\" {TEST} --exact --nocapture --test-threads=1; echo wrapped {r} done' &",
            exe.display()
        )
    };
    let script = format!("{}\n{}\nwait\n", rank(0), rank(1));
    let log = log_path(TEST, "proxy");
    let env = vars(&[
        ("PMI_SIZE", "2".into()),
        ("MPI_LOCALNRANKS", "2".into()),
        ("PMI_FD", "6".into()),
        ("MASTER_PORT", free_port().to_string()),
    ]);
    let mut proxy_cmd = child_command(&proxy, &log, env);
    proxy_cmd.arg("-c").arg(&script);
    let done = wait_all(vec![(proxy_cmd.spawn().expect("start the proxy"), log)]);
    let _ = std::fs::remove_dir_all(&dir);
    let (status, text) = &done[0];
    assert!(status.is_some_and(|s| s.success()), "{text}");
    assert_eq!(text.matches("COMM_TEST_CHILD_DONE").count(), 2, "both ranks ran to the end:\n{text}");
    assert!(text.contains("wrapped 0 done") && text.contains("wrapped 1 done"), "both wrappers went on:\n{text}");
}

#[test]
fn slurm_variables_only() {
    if is_child() {
        return multiprocess::run(3, "slurm_variables_only", T, || all_reduce_job(Launcher::Slurm, StoreKind::Rank0));
    }
    // What `srun -n 3` sets on one node (the store address defaults to this host).
    let port = free_port().to_string();
    launch("slurm_variables_only", 3, |r| {
        vars(&[
            ("SLURM_JOB_ID", "424242".into()),
            ("SLURM_STEP_ID", "0".into()),
            ("SLURM_PROCID", r.to_string()),
            ("SLURM_LOCALID", r.to_string()),
            ("SLURM_NODEID", "0".into()),
            ("SLURM_NTASKS", "3".into()),
            ("SLURM_NPROCS", "3".into()),
            ("SLURM_STEP_NUM_TASKS", "3".into()),
            ("SLURM_NNODES", "1".into()),
            ("SLURM_TASKS_PER_NODE", "3".into()),
            ("SLURM_STEP_TASKS_PER_NODE", "3".into()),
            ("SLURM_JOB_NODELIST", "localhost".into()),
            ("SLURM_STEP_NODELIST", "localhost".into()),
            ("SLURMD_NODENAME", "localhost".into()),
            ("MASTER_PORT", port.clone()),
        ])
    });
}

#[test]
fn torchrun_variables_and_agent_store() {
    if is_child() {
        return multiprocess::run(3, "torchrun_variables_and_agent_store", T, || {
            all_reduce_job(Launcher::Torchrun, StoreKind::Torch)
        });
    }
    // torchrun's agent holds MASTER_PORT with torch's TCPStore; workers must not bind it.
    let agent = fake_torch::FakeTorchStore::start();
    let port = agent.port().to_string();
    launch("torchrun_variables_and_agent_store", 3, |r| {
        vars(&[
            ("LOCAL_RANK", r.to_string()),
            ("RANK", r.to_string()),
            ("GROUP_RANK", "0".into()),
            ("ROLE_RANK", r.to_string()),
            ("ROLE_NAME", "default".into()),
            ("LOCAL_WORLD_SIZE", "3".into()),
            ("WORLD_SIZE", "3".into()),
            ("GROUP_WORLD_SIZE", "1".into()),
            ("ROLE_WORLD_SIZE", "3".into()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port.clone()),
            ("TORCHELASTIC_RESTART_COUNT", "1".into()),
            ("TORCHELASTIC_MAX_RESTARTS", "3".into()),
            ("TORCHELASTIC_RUN_ID", "test-run".into()),
            ("TORCHELASTIC_USE_AGENT_STORE", "True".into()),
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1".into()),
        ])
    });
    // The ranks met in the agent's store, under the job's and this restart's prefix.
    let keys: Vec<String> = agent.keys().iter().map(|k| String::from_utf8_lossy(k).into_owned()).collect();
    let key = keys.iter().find(|k| k.starts_with("comm/") && k.ends_with("/r1/discovery/world_size"));
    assert_eq!(key.and_then(|k| agent.value(k.as_bytes())).as_deref(), Some(&b"3"[..]), "{keys:?}");
}

#[test]
fn ranks_on_simulated_hosts_meet_through_the_store() {
    if is_child() {
        return multiprocess::run(3, "ranks_on_simulated_hosts_meet_through_the_store", T, simulated_hosts);
    }
    let (p1, p2) = (free_port().to_string(), free_port().to_string());
    launch("ranks_on_simulated_hosts_meet_through_the_store", 3, |r| {
        vars(&[
            ("RANK", r.to_string()),
            ("WORLD_SIZE", "3".into()),
            ("LOCAL_RANK", "0".into()),
            ("LOCAL_WORLD_SIZE", "1".into()),
            ("MASTER_ADDR", "127.0.0.2".into()),
            ("MASTER_PORT", p1.clone()),
            ("COMM_BIND_ADDR", format!("127.0.0.{}", 2 + r)),
            ("COMM_JOB_TOKEN", format!("simulated-hosts-{p1}")),
            ("SECOND_PORT", p2.clone()),
        ])
    });
}

/// Each rank is alone on its "host" (127.0.0.2, .3, .4): the store joins them; Auto refuses
/// shm with the reason; asking for shm explicitly works (they really share this machine).
async fn simulated_hosts() -> Result<(), String> {
    let e = |e: CommError| e.to_string();
    let world = discovery::from_env().map_err(e)?;
    let rank = world.rank;
    let (store, server) = discovery::rendezvous(&world, T).await.map_err(e)?;
    let me = format!("{store:?}");
    if !me.contains(&format!("local: Some(127.0.0.{}:", 2 + rank)) || !me.contains("127.0.0.2:") {
        return Err(format!("rank {rank} reached the store from the wrong address: {me}"));
    }
    store.set(&format!("host/{rank}"), me.as_bytes()).await.map_err(e)?;
    let keys: Vec<String> = (0..world.world_size).map(|r| format!("host/{r}")).collect();
    store.wait(&keys.iter().map(String::as_str).collect::<Vec<_>>(), T).await.map_err(e)?;
    // Rank 0 serves: it leaves last.
    store.add("left", 1).await.map_err(e)?;
    if server.is_some() {
        while store.add("left", 0).await.map_err(e)? < i64::from(world.world_size) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    drop((store, server));

    let mut cfg = Config::from_env().map_err(e)?;
    cfg.world.master_port = std::env::var("SECOND_PORT").ok().and_then(|p| p.parse().ok()).ok_or("SECOND_PORT")?;
    let refused = comm_api::builder(cfg.clone()).connect().await.map(|_| ()).unwrap_err().to_string();
    if !refused.contains("several hosts") || !refused.contains("COMM_BACKEND=shm") {
        return Err(format!("Auto should refuse shm across hosts with the reason, got: {refused}"));
    }
    let pg = comm_api::builder(cfg).backend(BackendKind::Shm).connect().await.map_err(e)?;
    let out = pg.all_reduce(HostBuffer::from_slice(&[1i64 << rank]), ReduceOp::BOr).await.map_err(e)?;
    if out.to_vec::<i64>().map_err(e)? != [0b111] {
        return Err("all_reduce across simulated hosts gave a wrong result".into());
    }
    println!("{}", pg.describe());
    pg.barrier().await.map_err(e)?;
    pg.shutdown().await.map_err(e)
}
