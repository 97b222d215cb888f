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
    launch(name, &["-n", &WORLD.to_string(), "--enable-recovery", "--allow-shrink"], |stdout, stderr| {
        let s = scenario(name);
        let lost: Vec<u32> = s.killed.iter().copied().chain(s.dies_in_shrink).collect();
        for r in (0..WORLD).filter(|r| !lost.contains(r)) {
            assert!(
                stdout.lines().any(|l| l.starts_with(&format!("[{r}] ")) && l.contains(&format!("survivor {r} ok"))),
                "rank {r} did not finish\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
            );
        }
        for r in &lost {
            assert!(stderr.contains(&format!("rank {r} was killed by signal")), "{stderr}");
        }
    });
}

/// Runs this test binary's test `name` under `commrun <args>` (in the test), or runs the rank
/// body of it (under commrun); `check(stdout, stderr)` after a successful job.
fn launch(name: &str, args: &[&str], check: impl FnOnce(&str, &str)) {
    launch_with(name, args, &[], check)
}

/// [`launch`] with extra environment variables for the ranks.
fn launch_with(name: &str, args: &[&str], envs: &[(&str, &str)], check: impl FnOnce(&str, &str)) {
    if let Ok(s) = std::env::var(SCENARIO) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let body = async {
            match s.as_str() {
                "kill_shrink_rejoin_cycles_leak_nothing" => cycles().await,
                "a_stopped_rank_is_left_out_and_told" => stopped().await,
                "a_late_newcomer_joins_the_retried_grow" => late_newcomer().await,
                s => rank(scenario(s)).await,
            }
        };
        let code = match rt.block_on(body) {
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
        .envs(envs.iter().copied())
        .args(args)
        .arg("--")
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
    assert!(status.success(), "commrun: {status}\n--- stdout\n{stdout}\n--- stderr\n{stderr}");
    check(&stdout, &stderr);
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

/// Kill, shrink and rejoin cycles on 3 ranks: each time the newest rank (the last
/// replacement) dies, the two first ones shrink, admit its replacement and check a few sums.
const CYCLES: u32 = 50;

/// What leaks would grow: threads, open files, resident memory (KiB).
fn footprint() -> (usize, usize, u64) {
    let count = |dir: &str| std::fs::read_dir(dir).map_or(0, |d| d.count());
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    (count("/proc/self/task"), count("/proc/self/fd"), rss)
}

async fn cycles() -> Result<(), String> {
    let cfg = Config::from_env().map_err(|e| e.to_string())?;
    let b = comm_api::builder(cfg).backend(BackendKind::Shm);
    let joining = std::env::var_os("COMM_JOIN").is_some();
    let mut pg = if joining { b.join().await } else { b.connect().await }.map_err(|e| e.to_string())?;
    let mut cycle: u32 = if joining { pg.broadcast_object(None, 0).await.map_err(|e| e.to_string())? } else { 0 };
    let mut baseline = None;
    let me = |pg: &ProcessGroup| pg.rank();
    while cycle < CYCLES {
        let n = pg.world_size();
        if me(&pg) == n - 1 {
            kill_self();
        }
        if step(&pg, me(&pg), 0.0, 2).await.is_ok() {
            return Err(format!("cycle {cycle}: an all_reduce without the killed rank succeeded"));
        }
        pg = pg.shrink().await.map_err(|e| format!("cycle {cycle}: shrink: {e}"))?;
        pg = pg.grow(1).await.map_err(|e| format!("cycle {cycle}: grow: {e}"))?;
        cycle += 1;
        let told: u32 = pg.broadcast_object(Some(cycle), 0).await.map_err(|e| e.to_string())?;
        assert_eq!(told, cycle);
        if cycle == 5 {
            baseline = Some(footprint());
        }
    }
    // Ranks 0 and 1 lived through every cycle (the others joined late, or are the last one).
    let all = (pg.world_size() * (pg.world_size() + 1) / 2) as f32;
    for _ in 0..10 {
        step(&pg, me(&pg), all, 2).await.map_err(|e| e.to_string())?;
    }
    if let Some((threads, fds, rss)) = baseline {
        let (t, f, r) = footprint();
        println!("rank {} footprint after cycle 5: {threads} threads, {fds} fds, {rss} KiB; after {CYCLES}: {t}, {f}, {r} KiB", me(&pg));
        if t > threads || f > fds || r > rss + 16 * 1024 {
            return Err(format!(
                "grew over {CYCLES} cycles: threads {threads} -> {t}, fds {fds} -> {f}, rss {rss} -> {r} KiB"
            ));
        }
    }
    println!("cycles ok");
    pg.shutdown().await.map_err(|e| e.to_string())
}

#[test]
fn kill_shrink_rejoin_cycles_leak_nothing() {
    let restarts = CYCLES.to_string();
    // Each newcomer is killed right after it joined: a crash loop by design, so no back-off.
    let args = ["-n", "3", "--max-restarts", &restarts, "--restart-backoff", "0"];
    launch("kill_shrink_rejoin_cycles_leak_nothing", &args, |stdout, stderr| {
        for r in [0, 1] {
            let line = stdout.lines().find(|l| l.contains(&format!("rank {r} footprint")));
            println!("{}", line.unwrap_or_else(|| panic!("rank {r} did not report\n{stdout}\n{stderr}")));
        }
        assert_eq!(stdout.matches("cycles ok").count(), 3, "{stdout}\n{stderr}");
        assert_eq!(stderr.matches("starting a replacement").count(), CYCLES as usize, "{stderr}");
        // Segments whose creator is gone (those of live processes may be mid-rendezvous).
        let left: Vec<String> = std::fs::read_dir("/dev/shm").map_or(Vec::new(), |d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| {
                    let pid = n.strip_prefix("commshm-").and_then(|r| r.split('-').next());
                    pid.is_some_and(|p| !std::path::Path::new(&format!("/proc/{p}")).exists())
                })
                .collect()
        });
        assert!(left.is_empty(), "segments left in /dev/shm: {left:?}");
    });
}

/// Rank 3 is stopped (SIGSTOP), not dead: the others' op times out, they shrink without it
/// once the agreement's timeout has passed, and wake it (SIGCONT); it is told it was left out.
async fn stopped() -> Result<(), String> {
    let e = |e: comm_api::CommError| e.to_string();
    let pg = comm_api::builder(Config::from_env().map_err(e)?).backend(BackendKind::Shm).connect().await.map_err(e)?;
    let (me, n) = (pg.rank(), pg.world_size());
    let pid_file = std::path::PathBuf::from(std::env::var("ELASTIC_DIR").unwrap()).join("stopped");
    for _ in 0..5 {
        step(&pg, me, (n * (n + 1) / 2) as f32, 2).await.map_err(e)?;
    }
    if me == 3 {
        let tmp = pid_file.with_extension("tmp");
        std::fs::write(&tmp, std::process::id().to_string()).map_err(|e| e.to_string())?;
        std::fs::rename(&tmp, &pid_file).map_err(|e| e.to_string())?;
        let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::STOP);
        // The stop takes the threads at their next kernel entry, not always before kill returns.
        std::thread::sleep(Duration::from_millis(100));
        // Woken after the others shrank without this rank. (Its pending op may still
        // complete: the others had posted their parts of it before they timed out.)
        let _ = pg.all_reduce(HostBuffer::from(vec![1.0f32; 2]), ReduceOp::Sum).await;
        return match pg.shrink().await {
            Err(e) if e.to_string().contains("without rank 3") => {
                println!("left out ok: {e}");
                Ok(())
            }
            other => Err(format!("shrink of the stopped rank gave {:?}", other.map(|g| g.world_size()))),
        };
    }
    if step(&pg, me, 0.0, 2).await.is_ok() {
        return Err("an all_reduce without the stopped rank succeeded".into());
    }
    let pg = pg.shrink().await.map_err(e)?;
    let members: Vec<u32> = (0..pg.world_size()).filter_map(|r| pg.global_rank(r)).collect();
    if members != [0, 1, 2] {
        return Err(format!("shrank to {members:?}"));
    }
    if pg.rank() == 0 {
        let pid: i32 = std::fs::read_to_string(&pid_file).map_err(|e| e.to_string())?.parse().unwrap();
        let pid = rustix::process::Pid::from_raw(pid).unwrap();
        rustix::process::kill_process(pid, rustix::process::Signal::CONT).map_err(|e| e.to_string())?;
    }
    for _ in 0..100 {
        step(&pg, me, 6.0, 2).await.map_err(e)?;
    }
    println!("survivor {me} ok");
    pg.shutdown().await.map_err(e)
}

#[test]
fn a_stopped_rank_is_left_out_and_told() {
    let dir = std::env::temp_dir().join(format!("comm-elastic-{}", std::process::id()));
    // Only the test creates it; its ranks (this function again, under SCENARIO) use theirs.
    if std::env::var_os(SCENARIO).is_none() {
        std::fs::create_dir_all(&dir).unwrap();
    }
    let envs = [("COMM_TIMEOUT", "2"), ("ELASTIC_DIR", dir.to_str().unwrap())];
    launch_with("a_stopped_rank_is_left_out_and_told", &["-n", "4"], &envs, |stdout, stderr| {
        for r in 0..3 {
            assert!(stdout.contains(&format!("survivor {r} ok")), "{stdout}\n{stderr}");
        }
        assert!(stdout.lines().any(|l| l.starts_with("[3] ") && l.contains("left out ok")), "{stdout}\n{stderr}");
    });
    let _ = std::fs::remove_dir_all(&dir);
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

/// A replacement slow to start (it calls `join` 1.5 s after it was started, with a 1 s
/// timeout): the survivor's first grow times out, claiming nothing, and its retry admits the
/// newcomer; both then sum right at world 2.
async fn late_newcomer() -> Result<(), String> {
    let e = |e: comm_api::CommError| e.to_string();
    let b = comm_api::builder(Config::from_env().map_err(e)?).backend(BackendKind::Shm);
    if std::env::var_os("COMM_JOIN").is_some() {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let pg = b.join().await.map_err(|err| format!("join: {err}"))?;
        step(&pg, pg.rank(), 3.0, 2).await.map_err(e)?;
        println!("newcomer ok at rank {} of {}", pg.rank(), pg.world_size());
        return pg.shutdown().await.map_err(e);
    }
    let pg = b.connect().await.map_err(e)?;
    if pg.rank() == 1 {
        kill_self();
    }
    if step(&pg, 0, 0.0, 2).await.is_ok() {
        return Err("an all_reduce without the killed rank succeeded".into());
    }
    let mut pg = pg.shrink().await.map_err(|err| format!("shrink: {err}"))?;
    let mut timeouts = 0;
    loop {
        match pg.grow(1).await {
            Ok(grown) => {
                pg = grown;
                break;
            }
            Err(comm_api::CommError::Timeout { .. }) if timeouts < 4 => {
                timeouts += 1;
                // The group it tried to grow still works.
                step(&pg, 0, 1.0, 2).await.map_err(|err| format!("after a timed-out grow: {err}"))?;
            }
            Err(err) => return Err(format!("grow, after {timeouts} timeouts: {err}")),
        }
    }
    step(&pg, 0, 3.0, 2).await.map_err(e)?;
    println!("member ok at world {} after {timeouts} timed-out grows", pg.world_size());
    pg.shutdown().await.map_err(e)
}

#[test]
fn a_late_newcomer_joins_the_retried_grow() {
    let envs = [("COMM_TIMEOUT", "1")];
    let args = ["-n", "2", "--max-restarts", "1"];
    launch_with("a_late_newcomer_joins_the_retried_grow", &args, &envs, |stdout, stderr| {
        assert!(stdout.contains("newcomer ok at rank 1 of 2"), "{stdout}\n{stderr}");
        let member = stdout.lines().find(|l| l.contains("member ok at world 2")).unwrap_or_default();
        assert!(!member.contains("after 0 timed-out"), "the first grow should have timed out: {stdout}\n{stderr}");
    });
}
