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

/// Starts `n` ranks of this test binary running `test` with only `env(rank)` as launcher
/// variables; waits (killing all past `T`) and panics with every rank's output if one failed.
fn launch(test: &str, n: u32, env: impl Fn(u32) -> Vec<(String, String)>) {
    let exe = std::env::current_exe().expect("the test binary");
    let dir = std::env::temp_dir();
    let mut ranks: Vec<(Child, std::path::PathBuf)> = Vec::new();
    for rank in 0..n {
        let log = dir.join(format!("comm-launchers-{}-{test}-{rank}.log", std::process::id()));
        let out = File::create(&log).expect("log file");
        let mut cmd = Command::new(&exe);
        cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log file"))
            .stderr(out);
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy();
            if LAUNCHER_VARS.contains(&&*k) || LAUNCHER_PREFIXES.iter().any(|p| k.starts_with(p)) {
                cmd.env_remove(&*k);
            }
        }
        cmd.env(CHILD_ENV, "1").env("RUST_BACKTRACE", "1").envs(env(rank));
        ranks.push((cmd.spawn().expect("start a rank"), log));
    }
    let deadline = Instant::now() + T;
    let mut status = vec![None; ranks.len()];
    while status.iter().any(Option::is_none) && Instant::now() < deadline {
        for (i, (c, _)) in ranks.iter_mut().enumerate() {
            if status[i].is_none() {
                status[i] = c.try_wait().ok().flatten();
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut report = String::new();
    let mut failed = false;
    for (i, (c, log)) in ranks.iter_mut().enumerate() {
        if status[i].is_none() {
            let _ = c.kill();
            status[i] = c.wait().ok();
            report.push_str(&format!("--- rank {i}: killed after {T:?}\n"));
        }
        let text = std::fs::read_to_string(&*log).unwrap_or_default();
        let _ = std::fs::remove_file(&*log);
        let ok = status[i].is_some_and(|s| s.success()) && text.contains("COMM_TEST_CHILD_DONE");
        failed |= !ok;
        report.push_str(&format!("--- rank {i}: {:?} ok={ok}\n{text}\n", status[i]));
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
    // The ranks met in the agent's store, under this restart's prefix.
    assert_eq!(agent.value(b"comm/r1/discovery/world_size").as_deref(), Some(&b"3"[..]));
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
