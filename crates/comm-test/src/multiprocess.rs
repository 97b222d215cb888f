//! Runs a test body as N real OS processes by re-executing the current test binary.
//!
//! ```no_run
//! use std::time::Duration;
//! #[test]
//! fn two_ranks() {
//!     comm_test::multiprocess::run(2, "two_ranks", Duration::from_secs(60), || async {
//!         let rank: u32 = std::env::var("RANK").unwrap().parse().unwrap();
//!         // ... init a backend from the environment, run collectives ...
//!         if rank > 1 { return Err("unexpected rank".into()) }
//!         Ok(())
//!     });
//! }
//! ```
//!
//! In the parent (the test as the test runner started it, `COMM_TEST_CHILD` unset), [`run`]
//! spawns `n` children: the same test binary with `[test_name, "--exact", "--nocapture",
//! "--test-threads=1"]`, so each child runs only this test, and with the torchrun variables
//! (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR=127.0.0.1`, a free
//! `MASTER_PORT`) plus a random `COMM_JOB_TOKEN` and `COMM_TEST_CHILD=1`. It waits for them
//! (killing them all past the timeout, or [`FAILURE_GRACE`] after the first failure) and panics
//! with every rank's exit status and output tail if any failed.
//!
//! In a child, `run` builds a tokio multi-thread runtime (2 workers), runs the body, and exits
//! the process itself (status 0 on `Ok`, 1 on `Err`), so the test harness runs nothing else.
//! Works the same under `cargo test` and `cargo nextest`, which both run test binaries that
//! accept these arguments. `test_name` must be the test's full path as the harness names it
//! (`my_test` for a top-level function of an integration-test file, `module::my_test` inside a
//! module); a child that finds no such test is reported as a failure, not a silent pass.

use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use comm_core::Rank;

/// Set (to `1`) in the children; its absence marks the parent.
pub const CHILD_ENV: &str = "COMM_TEST_CHILD";

/// How long the other ranks may keep running after one rank failed before they are killed
/// (they are often blocked on the failed peer until their backend's own timeout).
pub const FAILURE_GRACE: Duration = Duration::from_secs(5);

/// Printed by a child whose body returned `Ok`, so the parent can tell "ran and passed" from
/// "the harness found no test of that name and exited 0".
const DONE_MARKER: &str = "COMM_TEST_CHILD_DONE";

/// Printed by [`dying_on_purpose`]: the rank's end (any exit status, even a signal) is the test.
const DEATH_MARKER: &str = "COMM_TEST_CHILD_DIES_ON_PURPOSE";

/// Declares, from inside a rank's body, that this rank is about to exit or be killed on
/// purpose (to test how its peers react): the harness then accepts whatever status it ends
/// with, instead of reporting it as a failure.
pub fn dying_on_purpose() {
    use std::io::Write;
    let rank = std::env::var("RANK").unwrap_or_else(|_| "?".into());
    println!("\n{DEATH_MARKER} rank={rank}");
    let _ = std::io::stdout().flush();
}

fn expected_death(lines: &[String]) -> bool {
    lines.iter().any(|l| l.contains(DEATH_MARKER))
}

/// How many output lines of a failed rank the panic message shows.
const TAIL_LINES: usize = 40;
/// How many output lines of a rank that passed the panic message shows.
const OK_TAIL_LINES: usize = 8;

/// Runs `body` as `n` processes (ranks `0..n`); see the [module docs](self).
///
/// # Panics
/// In the parent, when a child fails, times out, or cannot be started; the message names every
/// rank's exit status and shows its output tail.
pub fn run<F, Fut>(n: u32, test_name: &str, timeout: Duration, body: F)
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    run_with_env(n, test_name, timeout, |_| Vec::new(), body)
}

/// Like [`run`], with extra environment variables per rank: `env(rank)` returns the
/// `(name, value)` pairs for that rank's child (e.g. to make one rank exit early or misbehave).
///
/// # Panics
/// As [`run`].
pub fn run_with_env<E, F, Fut>(n: u32, test_name: &str, timeout: Duration, env: E, body: F)
where
    E: Fn(Rank) -> Vec<(String, String)>,
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    if std::env::var_os(CHILD_ENV).is_some() {
        child(body)
    } else {
        parent(n, test_name, timeout, &env)
    }
}

fn child<F, Fut>(body: F) -> !
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    use std::io::Write;
    let rank = std::env::var("RANK").unwrap_or_else(|_| "?".into());
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("rank {rank}: cannot build the tokio runtime: {e}");
            std::process::exit(1);
        }
    };
    // Catch a panic here rather than letting libtest see it: under `#[should_panic]` libtest
    // would count it as a pass and exit 0.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rt.block_on(body())));
    // Let the body's spawned tasks go without waiting for them: the process exits next.
    rt.shutdown_background();
    let code = match result {
        Ok(Ok(())) => {
            // On a line of its own: libtest has printed "test name ... " without a newline.
            println!("\n{DONE_MARKER} rank={rank}");
            0
        }
        Ok(Err(e)) => {
            eprintln!("rank {rank}: test body failed: {e}");
            1
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "(non-string panic payload)".to_owned());
            eprintln!("rank {rank}: test body panicked: {what}");
            101
        }
    };
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // Exit here so libtest neither reports this test nor runs any other.
    std::process::exit(code)
}

/// One spawned rank.
struct Spawned {
    child: Child,
    output: Arc<Mutex<Vec<String>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
    status: Option<ExitStatus>,
    /// Why the parent killed it, if it did.
    killed: Option<String>,
}

fn parent(n: u32, test_name: &str, timeout: Duration, env: &dyn Fn(Rank) -> Vec<(String, String)>) {
    assert!(n > 0, "multiprocess::run needs at least one rank");
    // The port was free when picked, but another process (or one of this binary's own
    // outgoing connections) can take it before rank 0 binds it: then the job runs again on
    // another port, at most twice more.
    for attempt in 1..=3 {
        match job(n, test_name, timeout, env) {
            Ok(()) => return,
            Err(Failed { port_taken: true, .. }) if attempt < 3 => {
                println!("multiprocess test `{test_name}`: its store port was taken before rank 0 bound it; again on another");
            }
            Err(Failed { msg, .. }) => panic!("{msg}"),
        }
    }
}

/// Why a job failed, and whether it was because its store port was taken.
struct Failed {
    msg: String,
    port_taken: bool,
}

fn job(n: u32, test_name: &str, timeout: Duration, env: &dyn Fn(Rank) -> Vec<(String, String)>) -> Result<(), Failed> {
    let port = free_port();
    let token = random_token();
    let exe = std::env::current_exe().expect("the path of the running test binary");
    let mut ranks: Vec<Spawned> = Vec::with_capacity(n as usize);
    for rank in 0..n {
        let mut cmd = Command::new(&exe);
        cmd.args([test_name, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, "1")
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("COMM_JOB_TOKEN", &token)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env(rank) {
            cmd.env(k, v);
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                kill_all(&mut ranks, "another rank could not be started");
                panic!("multiprocess test `{test_name}`: cannot start rank {rank} ({}): {e}", exe.display());
            }
        };
        let output = Arc::new(Mutex::new(Vec::new()));
        let readers = vec![
            reader(child.stdout.take().expect("piped"), output.clone(), ""),
            reader(child.stderr.take().expect("piped"), output.clone(), "stderr| "),
        ];
        ranks.push(Spawned { child, output, readers, status: None, killed: None });
    }

    let deadline = Instant::now() + timeout;
    let mut first_failure: Option<(Instant, usize)> = None;
    loop {
        for (i, r) in ranks.iter_mut().enumerate() {
            if r.status.is_none() {
                if let Ok(Some(s)) = r.child.try_wait() {
                    r.status = Some(s);
                    let on_purpose = expected_death(&r.output.lock().unwrap_or_else(|e| e.into_inner()));
                    if !s.success() && !on_purpose && first_failure.is_none() {
                        first_failure = Some((Instant::now(), i));
                    }
                }
            }
        }
        if ranks.iter().all(|r| r.status.is_some()) {
            break;
        }
        let now = Instant::now();
        if now >= deadline {
            kill_all(&mut ranks, &format!("killed after the {timeout:?} timeout"));
            break;
        }
        if let Some((t, i)) = first_failure {
            if now >= t + FAILURE_GRACE {
                kill_all(&mut ranks, &format!("killed {FAILURE_GRACE:?} after rank {i} failed"));
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for r in &mut ranks {
        for h in r.readers.drain(..) {
            let _ = h.join();
        }
    }

    // The full output goes to the parent's (captured) stdout: shown by the harness on failure.
    let mut failed = Vec::new();
    for (i, r) in ranks.iter().enumerate() {
        let lines = r.output.lock().unwrap_or_else(|e| e.into_inner());
        for l in lines.iter() {
            println!("[rank {i}] {l}");
        }
        let done = lines.iter().any(|l| l.contains(DONE_MARKER));
        let ok = r.killed.is_none() && (expected_death(&lines) || r.status.is_some_and(|s| s.success()) && done);
        if !ok {
            failed.push(i);
        }
    }
    if failed.is_empty() {
        return Ok(());
    }
    let port_taken = {
        let lines = ranks[0].output.lock().unwrap_or_else(|e| e.into_inner());
        let bind = format!("binding the rendezvous store on 127.0.0.1:{port}");
        lines.iter().any(|l| l.contains(&bind) && l.contains("Address already in use"))
    };
    let mut msg = format!("multiprocess test `{test_name}` with {n} ranks failed on rank(s) {failed:?}\n",);
    for (i, r) in ranks.iter().enumerate() {
        let lines = r.output.lock().unwrap_or_else(|e| e.into_inner());
        let status = match (&r.killed, r.status) {
            (Some(why), _) => why.clone(),
            (None, Some(s)) => format!("{s}"),
            (None, None) => "no exit status".to_owned(),
        };
        let done = lines.iter().any(|l| l.contains(DONE_MARKER));
        let note = if r.status.is_some_and(|s| s.success()) && !done && r.killed.is_none() {
            format!(
                " — but it never finished the body: is there a test named exactly `{test_name}` \
                 (the full path, e.g. `module::{test_name}`) that calls multiprocess::run once?"
            )
        } else {
            String::new()
        };
        msg.push_str(&format!("--- rank {i}: {status}{note}\n"));
        // Ranks that passed get a short tail: what they last did can explain a peer's hang.
        let ok = done && r.killed.is_none() && r.status.is_some_and(|s| s.success());
        let skip = lines.len().saturating_sub(if ok { OK_TAIL_LINES } else { TAIL_LINES });
        if skip > 0 {
            msg.push_str(&format!("    ... {skip} earlier line(s)\n"));
        }
        for l in &lines[skip..] {
            msg.push_str(&format!("    {l}\n"));
        }
    }
    Err(Failed { msg, port_taken })
}

/// Collects `src` line by line into `out` (each line prefixed).
fn reader(
    src: impl Read + Send + 'static,
    out: Arc<Mutex<Vec<String>>>,
    prefix: &'static str,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(src);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match r.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    let line = String::from_utf8_lossy(&buf);
                    let line = line.trim_end_matches(['\n', '\r']);
                    out.lock().unwrap_or_else(|e| e.into_inner()).push(format!("{prefix}{line}"));
                }
            }
        }
    })
}

/// Kills (by pid) and reaps every child still running, recording why.
fn kill_all(ranks: &mut [Spawned], why: &str) {
    for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
        let _ = r.child.kill();
        r.status = r.child.wait().ok();
        r.killed = Some(why.to_owned());
    }
}

/// A port that was free a moment ago (bound to port 0, then released for rank 0 to take).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0 to find a free port")
}

/// 128 random bits in hex, from the standard library's per-process random hash keys.
fn random_token() -> String {
    let word = |i: u64| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(i);
        h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
        h.write_u32(std::process::id());
        h.finish()
    };
    format!("{:016x}{:016x}", word(1), word(2))
}
