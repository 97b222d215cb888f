//! End-to-end tests of the `commrun` binary with `sh -c` programs.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// A `commrun` command with a clean job environment (no inherited MASTER_* or token).
fn commrun() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_commrun"));
    cmd.env_remove("MASTER_ADDR").env_remove("MASTER_PORT").env_remove("COMM_JOB_TOKEN");
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd
}

/// Runs `commrun args...`, failing the test if it takes longer than `limit`.
fn run(args: &[&str], limit: Duration) -> (Output, Duration) {
    let start = Instant::now();
    let child = commrun().args(args).spawn().expect("start commrun");
    let out = wait_with_output(child, limit);
    (out, start.elapsed())
}

fn wait_with_output(mut child: Child, limit: Duration) -> Output {
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out_reader = thread::spawn(move || {
        let mut buf = Vec::new();
        stdout.read_to_end(&mut buf).unwrap();
        buf
    });
    let err_reader = thread::spawn(move || {
        let mut buf = Vec::new();
        stderr.read_to_end(&mut buf).unwrap();
        buf
    });
    let status = wait_timeout(&mut child, limit);
    Output { status, stdout: out_reader.join().unwrap(), stderr: err_reader.join().unwrap() }
}

fn wait_timeout(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("commrun did not finish within {limit:?}");
        }
        thread::sleep(Duration::from_millis(10));
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn lines(bytes: &[u8]) -> Vec<String> {
    text(bytes).lines().map(str::to_owned).collect()
}

/// Whether `pid` is still running (`kill -0`; a zombie waiting for its reaper counts as gone).
fn alive(pid: u32) -> bool {
    let ok = Command::new("kill")
        .args(["-0", &pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => !stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z')),
        Err(_) => true,
    }
}

/// Waits up to 3 s for every pid to be gone; returns those still running.
fn survivors(pids: &[u32]) -> Vec<u32> {
    let start = Instant::now();
    loop {
        let left: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
        if left.is_empty() || start.elapsed() > Duration::from_secs(3) {
            for &p in &left {
                let _ = Command::new("kill").args(["-9", &p.to_string()]).status();
            }
            return left;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// The pids from lines `[r] pids P1 P2 ...`.
fn printed_pids(stdout: &[u8]) -> Vec<u32> {
    lines(stdout)
        .iter()
        .filter_map(|l| l.split_once("] pids ").map(|(_, rest)| rest.to_owned()))
        .flat_map(|rest| rest.split_whitespace().map(|p| p.parse::<u32>().unwrap()).collect::<Vec<_>>())
        .collect()
}

const LONG: Duration = Duration::from_secs(30);

#[test]
fn ranks_get_the_job_environment() {
    let (out, _) = run(
        &[
            "-n",
            "3",
            "--",
            "sh",
            "-c",
            "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $COMM_JOB_TOKEN $GROUP_RANK\"",
        ],
        LONG,
    );
    assert!(out.status.success(), "{out:?}");
    let mut lines = lines(&out.stdout);
    lines.sort();
    assert_eq!(lines.len(), 3, "{lines:?}");
    let mut ports = HashSet::new();
    let mut tokens = HashSet::new();
    for (rank, line) in lines.iter().enumerate() {
        let rest = line.strip_prefix(&format!("[{rank}] ")).unwrap_or_else(|| panic!("bad prefix: {line}"));
        let f: Vec<&str> = rest.split(' ').collect();
        assert_eq!(f.len(), 8, "{line}");
        assert_eq!(f[0], rank.to_string());
        assert_eq!(f[1], "3");
        assert_eq!(f[2], rank.to_string());
        assert_eq!(f[3], "3");
        assert_eq!(f[4], "127.0.0.1");
        let port: u16 = f[5].parse().unwrap();
        assert_ne!(port, 0);
        ports.insert(port);
        assert_eq!(f[6].len(), 32, "token {}", f[6]);
        assert!(f[6].bytes().all(|b| b.is_ascii_hexdigit()));
        tokens.insert(f[6].to_owned());
        assert_eq!(f[7], "0");
    }
    assert_eq!(ports.len(), 1, "one port per job");
    assert_eq!(tokens.len(), 1, "one token per job");
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
}

#[test]
fn flags_and_environment_are_honoured() {
    let start = Instant::now();
    let child = commrun()
        .env("COMM_JOB_TOKEN", "given-token")
        .env("MASTER_PORT", "23456")
        .args([
            "-n",
            "2",
            "--master-addr",
            "10.9.8.7",
            "--",
            "sh",
            "-c",
            "echo $MASTER_ADDR $MASTER_PORT $COMM_JOB_TOKEN",
        ])
        .spawn()
        .unwrap();
    let out = wait_with_output(child, LONG);
    assert!(out.status.success());
    let mut got = lines(&out.stdout);
    got.sort();
    assert_eq!(got, ["[0] 10.9.8.7 23456 given-token", "[1] 10.9.8.7 23456 given-token"]);

    let child = commrun()
        .env("MASTER_PORT", "23456")
        .args(["-n", "1", "--master-port", "34567", "--", "sh", "-c", "echo $MASTER_PORT"])
        .spawn()
        .unwrap();
    let out = wait_with_output(child, LONG);
    assert_eq!(lines(&out.stdout), ["[0] 34567"]);
    assert!(start.elapsed() < LONG);
}

#[test]
fn failing_rank_stops_the_others() {
    // Every rank prints its shell's pid and its background sleep's pid; rank 1 then fails.
    let script = "sleep 30 & echo \"pids $$ $!\"; \
                  if [ \"$RANK\" = 1 ]; then sleep 1; exit 3; fi; wait";
    let (out, took) = run(&["-n", "3", "--", "sh", "-c", script], LONG);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert!(stderr.contains("commrun: rank 1 exited with code 3; stopping the other ranks"), "{stderr}");
    let pids = printed_pids(&out.stdout);
    assert_eq!(pids.len(), 6, "{}", text(&out.stdout));
    assert_eq!(survivors(&pids), Vec::<u32>::new(), "processes left running");
}

#[test]
fn rank_killed_by_signal_gives_128_plus_signal() {
    let script = "if [ \"$RANK\" = 1 ]; then kill -KILL $$; fi; exec sleep 30";
    let (out, took) = run(&["-n", "2", "--", "sh", "-c", script], LONG);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(137), "{stderr}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert!(stderr.contains("commrun: rank 1 was killed by signal 9 (SIGKILL)"), "{stderr}");
}

#[test]
fn all_ranks_succeed_gives_zero_and_a_late_failure_counts() {
    let (out, _) = run(&["-n", "4", "--", "true"], LONG);
    assert_eq!(out.status.code(), Some(0));
    assert!(out.stdout.is_empty() && out.stderr.is_empty());
    // Rank 0 exits 0 at once; rank 2 fails later: that still fails the job.
    let (out, _) = run(&["-n", "3", "--", "sh", "-c", "[ \"$RANK\" = 2 ] && { sleep 0.3; exit 5; }; exit 0"], LONG);
    assert_eq!(out.status.code(), Some(5), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("commrun: rank 2 exited with code 5"), "{stderr}");
}

/// Starts commrun with ranks that print their pids and sleep; waits until all have printed,
/// sends `signo` to commrun; returns (exit code, stderr, pids).
fn signal_commrun(signo: &str, extra: &[&str]) -> (Option<i32>, String, Vec<u32>) {
    // The background sleep ignores SIGINT (as in any non-interactive shell), so it only goes
    // away because commrun kills the rank's process group.
    let script = "sleep 30 & echo \"pids $$ $!\"; wait";
    let mut args = vec!["-n", "3", "--timeout-kill", "1"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", "-c", script]);
    let start = Instant::now();
    let mut child = commrun().args(&args).spawn().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut stderr = child.stderr.take().unwrap();
    let err_reader = thread::spawn(move || {
        let mut buf = Vec::new();
        stderr.read_to_end(&mut buf).unwrap();
        buf
    });
    let mut printed = Vec::new();
    let mut line = String::new();
    while printed.len() < 3 {
        line.clear();
        if stdout.read_line(&mut line).unwrap() == 0 {
            let _ = child.kill();
            let _ = child.wait();
            panic!("commrun ended early: {printed:?}");
        }
        printed.push(line.clone());
    }
    let status = Command::new("kill").args([&format!("-{signo}"), &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let status = wait_timeout(&mut child, LONG);
    assert!(start.elapsed() < Duration::from_secs(15), "took {:?}", start.elapsed());
    let pids = printed_pids(printed.concat().as_bytes());
    assert_eq!(pids.len(), 6, "{printed:?}");
    (status.code(), text(&err_reader.join().unwrap()), pids)
}

#[test]
fn sigint_stops_every_rank_and_exits_130() {
    let (code, stderr, pids) = signal_commrun("INT", &[]);
    assert_eq!(code, Some(130), "{stderr}");
    assert!(stderr.contains("commrun: received SIGINT; stopping all ranks"), "{stderr}");
    assert_eq!(survivors(&pids), Vec::<u32>::new(), "processes left running");
}

#[test]
fn sigterm_stops_every_rank_and_exits_143() {
    let (code, stderr, pids) = signal_commrun("TERM", &["--master-port", "0"]);
    assert_eq!(code, Some(143), "{stderr}");
    assert_eq!(survivors(&pids), Vec::<u32>::new(), "processes left running");
}

#[test]
fn ranks_ignoring_sigterm_are_killed_after_the_grace_period() {
    let script = "trap '' TERM; echo \"pids $$\"; [ \"$RANK\" = 0 ] && { sleep 1; exit 4; }; \
                  while :; do sleep 0.1; done";
    let (out, took) = run(&["-n", "2", "--timeout-kill", "0.5", "--", "sh", "-c", script], LONG);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert!(stderr.contains("commrun: rank 1 did not stop within"), "{stderr}");
    assert_eq!(survivors(&printed_pids(&out.stdout)), Vec::<u32>::new());
}

#[test]
fn quiet_ranks_hides_stdout_of_other_ranks_only() {
    let script = "echo \"out $RANK\"; echo \"err $RANK\" >&2";
    let (out, _) = run(&["-n", "2", "--quiet-ranks", "--", "sh", "-c", script], LONG);
    assert!(out.status.success());
    assert_eq!(lines(&out.stdout), ["[0] out 0"]);
    let mut err = lines(&out.stderr);
    err.sort();
    assert_eq!(err, ["[0] err 0", "[1] err 1"]);

    let (out, _) = run(&["-n", "2", "--", "sh", "-c", script], LONG);
    let mut got = lines(&out.stdout);
    got.sort();
    assert_eq!(got, ["[0] out 0", "[1] out 1"]);
}

#[test]
fn partial_lines_and_raw_bytes_keep_their_prefix() {
    let (out, _) = run(&["-n", "1", "--", "sh", "-c", "printf 'one\\n\\ntwo\\377\\376\\nno newline'"], LONG);
    assert!(out.status.success());
    assert_eq!(out.stdout, b"[0] one\n[0] \n[0] two\xff\xfe\n[0] no newline\n");
    let (out, _) = run(&["-n", "2", "--", "sh", "-c", "printf \"err $RANK\" >&2"], LONG);
    let mut err = lines(&out.stderr);
    err.sort();
    assert_eq!(err, ["[0] err 0", "[1] err 1"]);
}

#[test]
fn lines_of_different_ranks_never_mix() {
    let script = "i=0; while [ $i -lt 300 ]; do echo \"line $RANK $i abcdefghijklmnopqrstuvwxyz\"; i=$((i+1)); done";
    let (out, _) = run(&["-n", "4", "--", "sh", "-c", script], LONG);
    assert!(out.status.success());
    let lines = lines(&out.stdout);
    assert_eq!(lines.len(), 1200);
    let mut next = [0usize; 4];
    for line in &lines {
        let (prefix, rest) = line.split_once(' ').unwrap();
        let rank: usize = prefix.trim_start_matches('[').trim_end_matches(']').parse().unwrap();
        assert_eq!(rest, format!("line {rank} {} abcdefghijklmnopqrstuvwxyz", next[rank]), "{line}");
        next[rank] += 1;
    }
}

#[test]
fn missing_program_exits_127() {
    let (out, _) = run(&["-n", "2", "--", "/nonexistent/commrun-test-prog"], LONG);
    assert_eq!(out.status.code(), Some(127));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("commrun: cannot start `/nonexistent/commrun-test-prog`: No such file or directory"),
        "{stderr}"
    );
    let (out, _) = run(&["-n", "1", "commrun-no-such-program-on-path"], LONG);
    assert_eq!(out.status.code(), Some(127));
    assert!(text(&out.stderr).contains("cannot start `commrun-no-such-program-on-path`"));
}

#[test]
fn usage_errors_exit_2() {
    for args in [&["-n", "0", "--", "true"][..], &["-n", "2"], &["--", "true"], &["-n", "2", "--bogus", "--", "true"]] {
        let (out, _) = run(args, LONG);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(!out.stderr.is_empty());
    }
    let child = commrun().env("MASTER_PORT", "nope").args(["-n", "1", "--", "true"]).spawn().unwrap();
    let out = wait_with_output(child, LONG);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("MASTER_PORT=nope"));
}

#[test]
fn concurrent_jobs_get_different_ports_and_tokens() {
    let jobs: Vec<Child> = (0..2)
        .map(|_| {
            commrun()
                .args(["-n", "2", "--", "sh", "-c", "echo $MASTER_PORT $COMM_JOB_TOKEN; sleep 0.5"])
                .spawn()
                .unwrap()
        })
        .collect();
    let results: Vec<(String, String)> = jobs
        .into_iter()
        .map(|child| {
            let out = wait_with_output(child, LONG);
            assert!(out.status.success());
            let values: HashSet<String> =
                lines(&out.stdout).iter().map(|l| l.split_once(' ').unwrap().1.to_owned()).collect();
            assert_eq!(values.len(), 1, "ranks of one job agree: {values:?}");
            let value = values.into_iter().next().unwrap();
            let (port, token) = value.split_once(' ').unwrap();
            (port.to_owned(), token.to_owned())
        })
        .collect();
    assert_ne!(results[0].0, results[1].0, "ports");
    assert_ne!(results[0].1, results[1].1, "tokens");
}

/// Replacements that crash at once: restarts back off (100 ms, doubling), and a job that ends
/// with fewer ranks than it started with says so on its last line and fails with the lost
/// rank's code, unless --allow-shrink.
#[test]
fn restarts_back_off_and_a_shrunk_job_is_not_a_success() {
    let prog = r#"if [ "$RANK" = 1 ]; then kill -9 $$; fi; sleep 1.5"#;
    for allow in [false, true] {
        let mut args = vec!["-n", "2", "--max-restarts", "3"];
        if allow {
            args.push("--allow-shrink");
        }
        args.extend(["--", "sh", "-c", prog]);
        let (out, took) = run(&args, Duration::from_secs(30));
        let err = text(&out.stderr);
        let delays: Vec<&str> =
            err.lines().filter_map(|l| l.split("starting a replacement (COMM_JOIN=1) in ").nth(1)).collect();
        assert_eq!(delays, ["100 ms", "200 ms", "400 ms"], "{err}");
        assert!(took >= Duration::from_millis(700), "the three back-offs take 0.7 s: {took:?}");
        let last = err.lines().last().unwrap_or_default();
        assert!(last.contains("the job finished with 1 of 2 ranks (rank 1 was killed by signal 9"), "{err}");
        if allow {
            assert_eq!(out.status.code(), Some(0), "{err}");
        } else {
            assert_eq!(out.status.code(), Some(137), "{err}");
            assert!(last.contains("--allow-shrink makes this a success"), "{err}");
        }
    }
}

/// The store commrun serves says why it closes a connection on commrun's stderr, without a
/// `tracing` subscriber anywhere: here a client that is not a store client. (The store may close
/// before bash's write ends, so the script ignores SIGPIPE and its write's result.)
#[test]
fn the_stores_warnings_reach_the_terminal() {
    let prog = r#"if [ "$RANK" = 0 ]; then trap '' PIPE; exec 3<>/dev/tcp/127.0.0.1/$MASTER_PORT; printf 'GET / HTTP/1.0\r\n\r\n' >&3 2>/dev/null; sleep 0.5; fi; exit 0"#;
    let (out, _) = run(&["-n", "2", "--", "bash", "-c", prog], Duration::from_secs(30));
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("comm store:") && err.contains("is not a store client"), "{err}");
}
