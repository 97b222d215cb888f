//! Surviving lost ranks, as users run it: `commrun --enable-recovery` starts 4 ranks of this
//! test binary on the shm backend; some are killed (SIGKILL, or abort in the middle of the
//! shrink) in the middle of a stream of all_reduces; the others shrink their group and check
//! 100 further all_reduces. commrun serves the store, so losing rank 0 loses nothing.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use comm_api::{BackendKind, Config, HostBuffer, ProcessGroup, ReduceOp};

/// Set in the ranks: the scenario they run.
const SCENARIO: &str = "ELASTIC_SCENARIO";
const WORLD: u32 = 4;
/// A bound on one job; each takes about a second.
const LIMIT: Duration = Duration::from_secs(120);

struct Scenario {
    /// Ranks killed (SIGKILL) before their op number `at`.
    killed: &'static [u32],
    /// A rank that aborts while it takes part in the shrink.
    dies_in_shrink: Option<u32>,
    at: usize,
    /// Elements of the large all_reduces (one in four ops), above the window: the worker runs them.
    large: usize,
}

fn scenario(name: &str) -> Scenario {
    match name {
        "rank1_small" => Scenario { killed: &[1], dies_in_shrink: None, at: 7, large: 0 },
        "rank0_large" => Scenario { killed: &[0], dies_in_shrink: None, at: 9, large: 64 << 10 },
        "two_at_once" => Scenario { killed: &[1, 2], dies_in_shrink: None, at: 5, large: 64 << 10 },
        "lost_during_shrink" => Scenario { killed: &[2], dies_in_shrink: Some(3), at: 4, large: 0 },
        other => panic!("no scenario {other}"),
    }
}

/// Runs `name` under commrun (in the test) or as one of its ranks (under commrun).
fn job(name: &str) {
    if let Ok(s) = std::env::var(SCENARIO) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let code = match rt.block_on(rank(scenario(&s))) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("rank body failed: {e}");
                1
            }
        };
        rt.shutdown_background();
        std::process::exit(code);
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_commrun"))
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .env_remove("COMM_JOB_TOKEN")
        .env_remove("COMM_STORE")
        .env(SCENARIO, name)
        .env("COMM_TIMEOUT", "30")
        // A small window, so that the large ops take the worker's path.
        .env("COMM_SHM_WINDOW", "64KiB")
        .args(["-n", &WORLD.to_string(), "--enable-recovery", "--"])
        .arg(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > LIMIT {
            let _ = child.kill();
            panic!("commrun ran past {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stdout = String::new();
    out.read_to_string(&mut stdout).unwrap();
    let stderr = err_reader.join().unwrap();
    let s = scenario(name);
    let lost: Vec<u32> = s.killed.iter().copied().chain(s.dies_in_shrink).collect();
    let survivors: Vec<u32> = (0..WORLD).filter(|r| !lost.contains(r)).collect();
    for r in &survivors {
        assert!(
            stdout.lines().any(|l| l.starts_with(&format!("[{r}] ")) && l.contains(&format!("survivor {r} ok"))),
            "rank {r} did not finish\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
        );
    }
    assert!(status.success(), "commrun: {status}\n--- stdout\n{stdout}\n--- stderr\n{stderr}");
    for r in &lost {
        assert!(stderr.contains(&format!("rank {r} was killed by signal")), "{stderr}");
    }
}

fn kill_self() -> ! {
    let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    unreachable!("SIGKILL")
}

/// Threads of this process whose name starts with `prefix`.
fn threads(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.flatten()
                .filter(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.starts_with(prefix)))
                .count()
        })
        .unwrap_or(0)
}

/// One all_reduce of `old_rank + 1` on every member; checks the sum.
async fn step(pg: &ProcessGroup, old_rank: u32, expect: f32, len: usize) -> Result<(), comm_api::CommError> {
    let out = pg.all_reduce(HostBuffer::from(vec![(old_rank + 1) as f32; len]), ReduceOp::Sum).await?;
    let got = out.as_slice::<f32>().unwrap();
    assert!(got.iter().all(|&x| x == expect), "all_reduce gave {} instead of {expect}", got[0]);
    Ok(())
}

async fn rank(s: Scenario) -> Result<(), String> {
    let pg = comm_api::builder(Config::from_env().map_err(|e| e.to_string())?)
        .backend(BackendKind::Shm)
        .connect()
        .await
        .map_err(|e| e.to_string())?;
    let (me, n) = (pg.rank(), pg.world_size());
    let len = |i: usize| if s.large > 0 && i % 4 == 3 { s.large } else { 2 };
    let all = (n * (n + 1) / 2) as f32;
    let mut i = 0;
    let failure = loop {
        if i == s.at && s.killed.contains(&me) {
            kill_self();
        }
        if let Err(e) = step(&pg, me, all, len(i)).await {
            break e;
        }
        i += 1;
        if i > s.at + 1000 {
            return Err("no failure was seen".into());
        }
    };
    // The first error names a lost rank, directly or through the peer that saw it.
    let text = failure.to_string();
    if !s.killed.iter().any(|k| text.contains(&format!("rank {k}"))) {
        return Err(format!("the first error does not name a lost rank: {text}"));
    }
    if s.dies_in_shrink == Some(me) {
        std::env::set_var("COMM_FAULT_INJECT", "kill:shrink");
    }
    let t = Instant::now();
    let pg = pg.shrink().await.map_err(|e| format!("shrink: {e}"))?;
    let took = t.elapsed();
    let lost: Vec<u32> = s.killed.iter().copied().chain(s.dies_in_shrink).collect();
    let expect: Vec<u32> = (0..n).filter(|r| !lost.contains(r)).collect();
    let members: Vec<u32> = (0..pg.world_size()).filter_map(|r| pg.global_rank(r)).collect();
    if members != expect || expect.get(pg.rank() as usize) != Some(&me) {
        return Err(format!("rank {me} got members {members:?} (rank {}), expected {expect:?}", pg.rank()));
    }
    let sum = expect.iter().map(|r| (r + 1) as f32).sum::<f32>();
    for i in 0..100 {
        step(&pg, me, sum, len(i)).await.map_err(|e| format!("all_reduce {i} after the shrink: {e}"))?;
    }
    // The old group's worker is gone: one shm worker thread is left, the new group's.
    let deadline = Instant::now() + Duration::from_secs(5);
    while threads("comm-shm-r") != 1 {
        if Instant::now() > deadline {
            return Err(format!("{} shm worker threads after the shrink", threads("comm-shm-r")));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!("survivor {me} ok: shrank to {members:?} in {took:?}");
    pg.shutdown().await.map_err(|e| e.to_string())
}

#[test]
fn rank1_small() {
    job("rank1_small");
}

#[test]
fn rank0_large() {
    job("rank0_large");
}

#[test]
fn two_at_once() {
    job("two_at_once");
}

#[test]
fn lost_during_shrink() {
    job("lost_during_shrink");
}
