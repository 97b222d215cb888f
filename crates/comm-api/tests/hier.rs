//! The `hier` backend for real: ranks started by `mpirun` on hosts simulated with
//! `scripts/simhosts` (each host a UTS + mount namespace: its own host name and `/dev/shm`;
//! `COMM_HOST_ID` where namespaces are unavailable), MPI forced to TCP as between real hosts.
//! `Auto` must pick `hier`; the conformance suite runs on 2 hosts × 2 ranks and on 3 + 1; a
//! rank killed on one host ends the job on every host.
//!
//! Each test re-executes this binary under mpirun with `COMM_HIER_CHILD=<scenario>`; the
//! `child` test runs it on every rank. Tests skip, with a message, without `mpirun`.
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use comm_api::{Config, HostBuffer, Rank, ReduceOp};
use comm_test::mpirun::{Job, Launch};

mod streams_body;
mod surfaces;

#[path = "common/abort.rs"]
mod abort;

const CHILD: &str = "COMM_HIER_CHILD";
const LAYOUT: &str = "COMM_HIER_TEST_LAYOUT";

fn simhosts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/simhosts")
}

/// The simulated hosts of one job; removed when dropped.
struct Hosts(PathBuf);

impl Hosts {
    fn up(count: usize) -> Hosts {
        // One directory per job: tests may set up hosts concurrently (their jobs then run one
        // at a time).
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("comm-simhosts-{}-{n}", std::process::id()));
        let ok = Command::new(simhosts()).arg("up").arg(&dir).arg(count.to_string()).status();
        assert!(ok.is_ok_and(|s| s.success()), "simhosts up failed");
        Hosts(dir)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        let _ = Command::new(simhosts()).arg("down").arg(&self.0).status();
    }
}

/// Runs `scenario` on hosts of `sizes` ranks, MPI over TCP as between hosts (shared memory
/// stays with our shm groups); `None` when mpirun is not installed.
fn job(sizes: &[usize], scenario: &str, envs: &[(&str, &str)], limit: Duration) -> Option<Job> {
    comm_test::mpirun::launcher()?;
    let hosts = Hosts::up(sizes.len());
    let layout = sizes.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",");
    let mut all: Vec<(&str, &str)> = vec![(LAYOUT, &layout)];
    all.extend_from_slice(envs);
    let wrapper = [simhosts().into(), "run".into(), hosts.0.clone().into(), layout.clone().into(), "--".into()];
    comm_test::mpirun::run(Launch {
        np: sizes.iter().sum::<usize>() as u32,
        child: (CHILD, scenario),
        envs: &all,
        limit,
        open_mpi_args: &["--mca", "btl", "tcp,self"],
        wrapper: wrapper.to_vec(),
        summary: &["-OK", "KILL-", "DESCRIBE"],
    })
}

/// Runs `scenario` as real hosts are launched: `mpirun -H simhost-0:a,simhost-1:b` starting
/// one Open MPI daemon per host (through `simhosts rsh`, entering the host), so each rank sees
/// only its host's ranks as local, and no `MASTER_ADDR` anywhere: the README's command.
/// `None` without Open MPI's mpirun.
fn job_per_host_daemons(sizes: &[usize], scenario: &str, limit: Duration) -> Option<Job> {
    match comm_test::mpirun::launcher() {
        Some((_, true)) => {}
        _ => {
            eprintln!("skipped: per-host daemons need Open MPI's mpirun");
            return None;
        }
    }
    let hosts = Hosts::up(sizes.len());
    let layout = sizes.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",");
    let list: Vec<String> = sizes.iter().enumerate().map(|(i, n)| format!("simhost-{i}:{n}")).collect();
    let agent = format!("{} rsh {}", simhosts().display(), hosts.0.display());
    let args = [
        "-H",
        &list.join(","),
        "--mca",
        "plm_rsh_agent",
        &agent,
        "--mca",
        "oob_tcp_if_include",
        "lo",
        "--mca",
        "btl",
        "tcp,self",
        "--mca",
        "btl_tcp_if_include",
        "lo",
    ];
    comm_test::mpirun::run(Launch {
        np: sizes.iter().sum::<usize>() as u32,
        child: (CHILD, scenario),
        envs: &[(LAYOUT, &layout)],
        limit,
        open_mpi_args: &args,
        wrapper: Vec::new(),
        summary: &["-OK", "DESCRIBE"],
    })
}

/// The README's multi-host command on per-host daemons: `Auto` picks hier from MPI's view of
/// the hosts, with no `MASTER_ADDR`, and the suite passes.
#[test]
fn conformance_two_hosts_of_two_on_per_host_daemons() {
    let Some(job) = job_per_host_daemons(&[2, 2], "suite", Duration::from_secs(600)) else { return };
    assert_eq!(job.code, Some(0), "{job}");
    assert_eq!(job.lines("SUITE-OK").len(), 4, "{job}");
    assert!(job.lines("DESCRIBE rank 0").iter().any(|l| l.contains("hier (auto") && l.contains("simhost-1")), "{job}");
}

#[test]
fn conformance_two_hosts_of_two() {
    // Every all_reduce over the rails (by default a machine with fewer cores than ranks, as
    // simulated hosts on a small one, takes the leaders' path, which 3 + 1 covers).
    let envs = [("COMM_HIER_RAIL_MIN", "0")];
    let Some(job) = job(&[2, 2], "suite", &envs, Duration::from_secs(600)) else { return };
    assert_eq!(job.code, Some(0), "{job}");
    assert_eq!(job.lines("SUITE-OK").len(), 4, "{job}");
    let described = job.lines("DESCRIBE rank 0");
    assert!(
        described.iter().any(|l| l.contains("hier (auto") && l.contains("simhost-1") && l.contains("rails")),
        "{job}"
    );
}

/// Two hosts of four ranks (eight on two cores): a reduced case list.
#[test]
fn conformance_two_hosts_of_four() {
    let envs = [("COMM_TEST_SUITE", "many")];
    let Some(job) = job(&[4, 4], "suite", &envs, Duration::from_secs(600)) else { return };
    assert_eq!(job.code, Some(0), "{job}");
    assert_eq!(job.lines("SUITE-OK").len(), 8, "{job}");
}

#[test]
fn conformance_three_plus_one() {
    let Some(job) = job(&[3, 1], "suite", &[], Duration::from_secs(600)) else { return };
    assert_eq!(job.code, Some(0), "{job}");
    assert_eq!(job.lines("SUITE-OK").len(), 4, "{job}");
    assert!(job.lines("DESCRIBE rank 3").iter().any(|l| l.contains("no rails")), "{job}");
}

/// The composite ops' cross-rank checks (shapes of coalesced ops, object types and sizes)
/// hold on hier as on shm: every rank of 2 × 2 errs alike, nothing is allocated from a
/// forged size, and a mismatch in one host's phase reaches the other host at once (its
/// inner groups aborted), not at the 30 s timeout.
#[test]
fn composite_ops_are_checked_across_hosts() {
    let envs = [("COMM_TIMEOUT", "30")];
    let Some(job) = job(&[2, 2], "surfaces", &envs, Duration::from_secs(120)) else { return };
    assert_eq!(job.code, Some(0), "{job}");
    assert_eq!(job.lines("SURFACES-OK").len(), 4, "{job}");
}

/// Several tasks per rank, each on its own stream, across 2 × 2 simulated hosts: every
/// result right.
#[test]
fn tasks_on_their_own_streams_across_hosts() {
    let Some(job) = job(&[2, 2], "streams", &[("COMM_TIMEOUT", "60")], Duration::from_secs(120)) else { return };
    assert_eq!(job.code, Some(0), "{job}");
    assert_eq!(job.lines("STREAMS-OK").len(), 4, "{job}");
}

/// Tasks sharing a group (clones, a Mutex) or a stream are stopped by the issuer check before
/// any sees a wrong sum, and hand-overs in one order are not flagged: hier on 2 × 2 hosts, and
/// the mpi backend on one host of 3 ranks.
#[test]
fn tasks_sharing_a_group_are_stopped_hier_and_mpi() {
    for (sizes, backend) in [(&[3][..], "mpi"), (&[2, 2][..], "hier")] {
        // The timeout bounds only the exit: MPI's finalisation waits it out for the ops the
        // poisoned groups left behind (ARCHITECTURE.md, mpi "Finalisation").
        let envs = [("COMM_TIMEOUT", "8"), ("COMM_BACKEND", backend)];
        let Some(job) = job(sizes, "misuse", &envs, Duration::from_secs(120)) else { return };
        // Every rank passed. A rank whose failed groups left MPI requests behind skips
        // MPI_Finalize at exit, as documented, and mpirun may then exit 1 after the last line.
        assert_eq!(job.lines("MISUSE-OK").len(), sizes.iter().sum::<usize>(), "{job}");
        assert!(job.code == Some(0) || job.code == Some(1), "{job}");
    }
}

/// `pg.abort(reason)` on rank 1 reaches every rank, on another host too: their op in flight
/// fails naming the reason, `error()` and the failure hook say it (the mpi backend on one host
/// of 3 ranks, hier on 2 × 2).
#[test]
fn abort_reaches_every_rank_hier_and_mpi() {
    for (sizes, backend) in [(&[3][..], "mpi"), (&[2, 2][..], "hier")] {
        let envs = [("COMM_TIMEOUT", "5"), ("COMM_BACKEND", backend)];
        let Some(job) = job(sizes, "abort", &envs, Duration::from_secs(120)) else { return };
        assert_eq!(job.lines("ABORT-OK").len(), sizes.iter().sum::<usize>(), "{job}");
        // The ranks' ops end within seconds of the abort, not at the 5 s timeout; MPI's
        // finalisation may wait for requests the failed group left behind (mpi "Finalisation").
        assert!(job.code == Some(0) || job.code == Some(1), "{job}");
    }
}

#[test]
fn a_killed_rank_ends_the_job_on_every_host() {
    let envs = [("COMM_TIMEOUT", "10")];
    let Some(job) = job(&[2, 2], "kill", &envs, Duration::from_secs(120)) else { return };
    assert_ne!(job.code, Some(0), "a killed rank fails the job: {job}");
    assert_eq!(job.lines("KILL-BEFORE").len(), 1, "rank 3 got as far as killing itself: {job}");
    assert!(job.lines("KILL-UNEXPECTED").is_empty(), "{job}");
    // A survivor that saw the loss itself names the dead rank by its world rank.
    for seen in job.lines("KILL-SEEN").iter().filter(|l| l.contains("lost")) {
        assert!(seen.contains("peer rank 3 lost"), "{job}");
    }
    // The survivors' timeout is 10 s; mpirun usually ends the job sooner.
    assert!(job.elapsed < Duration::from_secs(60), "the job ended within the timeout: {job}");
}

// ---------------------------------------------------------------------------------------------
// Child side (one process per rank)

#[test]
fn child() {
    let Ok(scenario) = std::env::var(CHILD) else { return };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let code = rt.block_on(async {
        match scenario.as_str() {
            "suite" => suite().await,
            "kill" => kill().await,
            "surfaces" => surfaces().await,
            "streams" => streams().await,
            "misuse" => misuse().await,
            "abort" => {
                let pg = comm_api::init(Config::from_env().unwrap()).await.expect("init");
                reported("ABORT", &pg, abort::abort_scenario(&pg).await)
            }
            other => {
                eprintln!("unknown scenario {other}");
                2
            }
        }
    });
    if code != 0 {
        std::process::exit(code);
    }
}

/// The hosts of this job (block placement, as `simhosts run` puts ranks).
fn hosts() -> Vec<Vec<Rank>> {
    let mut first = 0;
    let sizes = std::env::var(LAYOUT).unwrap();
    sizes
        .split(',')
        .map(|s| {
            let n: Rank = s.parse().unwrap();
            first += n;
            (first - n..first).collect()
        })
        .collect()
}

async fn suite() -> i32 {
    let pg = comm_api::init(Config::from_env().unwrap()).await.expect("init");
    let me = pg.rank();
    println!("DESCRIBE rank {me}: {}", pg.describe().replace('\n', " | "));
    if pg.backend_name() != "hier" {
        eprintln!("rank {me}: auto chose {} instead of hier", pg.backend_name());
        return 1;
    }
    // A sub-group of one host's ranks runs on shared memory, one across hosts on MPI.
    let hosts = hosts();
    for members in [hosts[0].clone(), vec![0, pg.world_size() - 1]] {
        let sub = pg.new_group(&members).await.expect("new_group");
        let want = if members == hosts[0] { "shm" } else { "mpi" };
        match sub {
            Some(sub) if sub.backend_name() != want => {
                eprintln!("rank {me}: sub-group {members:?} runs on {}, not {want}", sub.backend_name());
                return 1;
            }
            Some(sub) => {
                let got = sub.all_reduce(HostBuffer::from_slice(&[me as f32]), ReduceOp::Sum).await.unwrap();
                let sum: u32 = members.iter().sum();
                assert_eq!(got.as_slice::<f32>().unwrap(), &[sum as f32], "sub-group {members:?}");
            }
            None => assert!(!members.contains(&me), "rank {me} is a member of {members:?}"),
        }
    }
    let mut cfg = comm_test::SuiteConfig::from_env();
    cfg.hosts = Some(hosts);
    let code = comm_test::mpirun::suite_child(pg.backend().clone(), &cfg).await;
    pg.shutdown().await.expect("shutdown");
    code
}

async fn surfaces() -> i32 {
    let pg = comm_api::init(Config::from_env().unwrap()).await.expect("init");
    let mut checked = surfaces::composite_checks(&pg).await;
    // hier cannot shrink (MPI between hosts): every rank is told at once.
    if checked.is_ok() {
        let t = std::time::Instant::now();
        checked = match pg.shrink().await {
            Err(e @ comm_api::CommError::Unavailable { .. }) if t.elapsed() < Duration::from_secs(1) => {
                if e.to_string().contains("ULFM") {
                    Ok(())
                } else {
                    Err(format!("shrink: {e}"))
                }
            }
            other => Err(format!("shrink gave {:?} after {:?}", other.map(|g| g.world_size()), t.elapsed())),
        };
    }
    reported("SURFACES", &pg, checked)
}

async fn streams() -> i32 {
    let pg = comm_api::init(Config::from_env().unwrap()).await.expect("init");
    let checked = streams_body::tasks_on_streams(&pg, 4, 300).await;
    reported("STREAMS", &pg, checked)
}

async fn misuse() -> i32 {
    use streams_body::Sharing;
    let pg = comm_api::init(Config::from_env().unwrap()).await.expect("init");
    let all: Vec<Rank> = (0..pg.world_size()).collect();
    let mut checked = streams_body::handed_over(&pg).await;
    for (sharing, tasks) in [(Sharing::Clones, 2), (Sharing::Mutex, 3)] {
        if checked.is_ok() {
            let sub = pg.new_group(&all).await.expect("new_group").expect("a member");
            checked =
                streams_body::misuse(&sub, sharing, tasks, 300).await.map(|s| println!("rank {}: {s}", pg.rank()));
        }
    }
    if checked.is_ok() {
        let streams = pg.streams().await.expect("streams");
        for key in [0, 5] {
            if checked.is_ok() {
                let summary = streams_body::misuse(&streams.stream(key), Sharing::Clones, 2, 300).await;
                checked = summary.map(|s| println!("rank {} stream {key}: {s}", pg.rank()));
            }
        }
    }
    reported("MISUSE", &pg, checked)
}

/// A scenario's exit code; `<MARKER>-OK` printed when it passed, for the parent to count.
fn reported(marker: &str, pg: &comm_api::ProcessGroup, checked: Result<(), String>) -> i32 {
    match checked {
        Ok(()) => {
            println!("{marker}-OK rank {} on {}", pg.rank(), pg.backend_name());
            0
        }
        Err(e) => {
            eprintln!("{e}");
            1
        }
    }
}

async fn kill() -> i32 {
    let pg = comm_api::init(Config::from_env().unwrap()).await.expect("init");
    let me = pg.rank();
    for i in 0..100_000 {
        if me == 3 && i == 20 {
            println!("KILL-BEFORE rank 3 kills itself (SIGKILL)");
            let _ = Command::new("kill").args(["-9", &std::process::id().to_string()]).status();
        }
        let buf = HostBuffer::from_slice(&[1.0f32; 4096]);
        if let Err(e) = pg.all_reduce(buf, ReduceOp::Sum).await {
            println!("KILL-SEEN rank {me} after {i} ops: {e}");
            return 3;
        }
    }
    println!("KILL-UNEXPECTED rank {me} finished every op");
    0
}
