//! Starting the ranks, pumping their output and supervising them until the job ends.
//!
//! Each rank is started in a process group of its own (so stopping a rank also stops what it
//! started, e.g. a shell's children) with standard input from `/dev/null`; on Linux it also gets
//! `PR_SET_PDEATHSIG = SIGKILL`, so it does not outlive a `commrun` that is killed outright.
//! The wait loop observes exits with `waitid(WNOWAIT)` and reaps nobody before the job ends:
//! a rank's pid (its process group id) cannot be reused while it is an unreaped zombie, so
//! signalling the groups is always safe.

use std::io::{self, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, WaitId, WaitIdOptions, WaitOptions};

use crate::cli::Options;
use crate::job::Job;
use crate::output::{prefix_lines, rank_prefix, MAX_LINE};
use crate::signals::{signal_name, Incoming};

/// How often the wait loop checks the ranks and the signals.
const POLL: Duration = Duration::from_millis(10);
/// After the ranks have ended, how long the output threads may go without passing on a line
/// before commrun stops waiting for them (a pipe can be held open by a process the rank left
/// behind).
const OUTPUT_IDLE: Duration = Duration::from_secs(2);

/// The "core dumped" bit of a wait status (`WCOREDUMP`), which rustix does not decode.
const WCOREFLAG: i32 = 0x80;

/// How a rank ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// It exited with this code.
    Code(i32),
    /// It was killed by this signal; `true` when it dumped core.
    Signal(i32, bool),
}

impl Exit {
    /// Whether this is a success (exit code 0).
    pub fn success(self) -> bool {
        self == Exit::Code(0)
    }

    /// The exit code a shell would report: the code, or 128 + the signal number.
    pub fn shell_code(self) -> i32 {
        match self {
            Exit::Code(code) => code,
            Exit::Signal(signo, _) => 128 + signo,
        }
    }
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Exit::Code(code) => write!(f, "exited with code {code}"),
            Exit::Signal(signo, core) => {
                write!(f, "was killed by signal {signo} ({})", signal_name(signo))?;
                if core {
                    write!(f, " (core dumped)")?;
                }
                Ok(())
            }
        }
    }
}

/// Why the job is being stopped (the first reason wins and gives the exit code).
#[derive(Debug, Clone, Copy)]
enum Stop {
    /// A rank failed.
    RankFailed(Exit),
    /// commrun received a signal.
    Signal(i32),
    /// A rank could not be started; the exit code.
    SpawnFailed(i32),
}

impl Stop {
    fn exit_code(self) -> i32 {
        match self {
            Stop::RankFailed(exit) => exit.shell_code(),
            Stop::Signal(signo) => 128 + signo,
            Stop::SpawnFailed(code) => code,
        }
    }
}

/// One started rank.
struct Rank {
    rank: u32,
    pid: Pid,
    /// Set once its exit was observed (it is a zombie until [`Rank::reap`]).
    exit: Option<Exit>,
    /// When it was started (a replacement that dies young backs the next one off further).
    started: Instant,
}

impl Rank {
    /// Checks, without reaping, whether the rank has exited.
    fn peek(&mut self) -> io::Result<Option<Exit>> {
        if self.exit.is_some() {
            return Ok(self.exit);
        }
        // WNOWAIT leaves the rank waitable, so its pid stays ours until `reap`.
        let options = WaitIdOptions::EXITED | WaitIdOptions::NOHANG | WaitIdOptions::NOWAIT;
        let status = loop {
            match rustix::process::waitid(WaitId::Pid(self.pid), options) {
                Err(rustix::io::Errno::INTR) => continue,
                result => break result?,
            }
        };
        let Some(status) = status else { return Ok(None) };
        self.exit = if let Some(code) = status.exit_status() {
            Some(Exit::Code(code))
        } else {
            status.terminating_signal().map(|signo| Exit::Signal(signo, status.dumped()))
        };
        Ok(self.exit)
    }

    /// Sends `signal` to the rank's process group (the rank and whatever it started). Only
    /// called before [`Rank::reap`], while the pid cannot have been reused.
    fn signal(&self, signal: Signal) {
        if rustix::process::kill_process_group(self.pid, signal).is_err() {
            let _ = rustix::process::kill_process(self.pid, signal);
        }
    }

    /// Waits for the rank (blocking) and releases its process-table entry.
    fn reap(&mut self) -> Exit {
        loop {
            match rustix::process::waitpid(Some(self.pid), WaitOptions::empty()) {
                Ok(Some((pid, status))) if pid == self.pid => {
                    let exit = match status.terminating_signal() {
                        Some(signo) => Exit::Signal(signo, status.as_raw() & WCOREFLAG != 0),
                        None => Exit::Code(status.exit_status().unwrap_or(0)),
                    };
                    return *self.exit.get_or_insert(exit);
                }
                Err(rustix::io::Errno::INTR) => continue,
                // ECHILD: somebody else reaped it; keep what we saw.
                _ => return *self.exit.get_or_insert(Exit::Code(0)),
            }
        }
    }
}

/// Copies a rank's pipe to commrun's stdout or stderr with the rank prefix, one locked write
/// (and flush) per line so lines of different ranks never mix. Write errors (a closed stdout)
/// are ignored, but the pipe is still drained so the rank never blocks on it.
fn spawn_pump<R: Read + Send + 'static>(
    pipe: R,
    rank: u32,
    to_stderr: bool,
    lines: Arc<AtomicU64>,
    done: mpsc::Sender<()>,
) -> io::Result<()> {
    let name = format!("rank{rank}-{}", if to_stderr { "stderr" } else { "stdout" });
    thread::Builder::new().name(name).spawn(move || {
        let prefix = rank_prefix(rank);
        let _ = prefix_lines(BufReader::with_capacity(64 * 1024, pipe), &prefix, MAX_LINE, |line| {
            if to_stderr {
                let mut err = io::stderr().lock();
                let _ = err.write_all(line).and_then(|()| err.flush());
            } else {
                let mut out = io::stdout().lock();
                let _ = out.write_all(line).and_then(|()| out.flush());
            }
            lines.fetch_add(1, Ordering::Relaxed);
        });
        let _ = done.send(());
    })?;
    Ok(())
}

/// The `io::Error` text without Rust's ` (os error N)` suffix.
fn os_message(err: &io::Error) -> String {
    let text = err.to_string();
    match text.rfind(" (os error ") {
        Some(at) if text.ends_with(')') => text[..at].to_owned(),
        _ => text,
    }
}

fn build_command(opts: &Options, job: &Job, rank: u32) -> Command {
    let mut cmd = Command::new(&opts.command[0]);
    cmd.args(&opts.command[1..]).envs(job.rank_env(rank)).stdin(Stdio::null()).stderr(Stdio::piped());
    cmd.stdout(if opts.quiet_ranks && rank != 0 { Stdio::null() } else { Stdio::piped() });
    cmd.process_group(0);
    #[cfg(target_os = "linux")]
    {
        let parent = rustix::process::getpid();
        // `pre_exec` has no safe counterpart; it is the crate's only unsafe code.
        #[allow(unsafe_code)]
        // SAFETY: the closure runs between fork and exec and only makes async-signal-safe
        // calls (rustix's raw prctl and getppid syscalls) and builds errors without allocating.
        unsafe {
            cmd.pre_exec(move || {
                rustix::process::set_parent_process_death_signal(Some(Signal::KILL))?;
                if rustix::process::getppid() != Some(parent) {
                    // commrun died before prctl took effect.
                    return Err(rustix::io::Errno::SRCH.into());
                }
                Ok(())
            });
        }
    }
    cmd
}

/// The longest delay before a replacement starts.
const RESTART_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// A lost process that ran this long resets the back-off.
const RESTART_BACKOFF_RESET: Duration = Duration::from_secs(1);

/// Runs the job described by `opts` to its end and returns commrun's exit code: 0 when every
/// rank exited with 0; the first failing rank's code (128 + signal for a rank killed by a
/// signal); 128 + signal when commrun itself got SIGINT/SIGTERM/SIGHUP; 127 (126) when the
/// program cannot be found (started); 2 for a bad environment; 1 for other launcher errors.
pub fn run(opts: &Options) -> i32 {
    let mut job = match Job::resolve(opts, |key| std::env::var(key).ok()) {
        Ok(job) => job,
        Err(msg) => {
            eprintln!("commrun: {msg}");
            return 2;
        }
    };
    // Held until every rank has ended: the store outlives any of them.
    let _store = match job.serve_store(|key| std::env::var(key).ok()) {
        Ok(store) => store,
        Err(msg) => {
            eprintln!("commrun: {msg}");
            return 2;
        }
    };
    let mut incoming = match Incoming::install() {
        Ok(incoming) => incoming,
        Err(err) => {
            eprintln!("commrun: cannot install signal handlers: {}", os_message(&err));
            return 1;
        }
    };

    let (done_tx, done_rx) = mpsc::channel();
    let mut spawner = Spawner { opts, job: &job, lines: Arc::new(AtomicU64::new(0)), done: done_tx, pumps: 0 };
    let mut ranks: Vec<Rank> = Vec::with_capacity(job.world_size as usize);
    let mut stop: Option<Stop> = None;

    for rank in 0..job.world_size {
        if incoming.received().is_some() {
            break; // handled by the wait loop
        }
        match spawner.start(rank, false) {
            Ok(started) => ranks.push(started),
            Err(code) => {
                stop = Some(Stop::SpawnFailed(code));
                break;
            }
        }
    }

    let code = supervise(&mut ranks, &mut incoming, stop, &mut spawner);
    let Spawner { lines, done, pumps, .. } = spawner;
    drop(done);
    wait_for_output(&done_rx, pumps, &lines);
    code
}

/// Starts ranks (and replacements) and the threads that pass their output on.
struct Spawner<'a> {
    opts: &'a Options,
    job: &'a Job,
    lines: Arc<AtomicU64>,
    done: mpsc::Sender<()>,
    /// Output threads started.
    pumps: usize,
}

impl Spawner<'_> {
    /// Starts `rank` (with `joining`, a replacement for a lost one: `COMM_JOIN=1`); on failure
    /// says why and returns the exit code.
    fn start(&mut self, rank: u32, joining: bool) -> Result<Rank, i32> {
        let mut cmd = build_command(self.opts, self.job, rank);
        if joining {
            cmd.env("COMM_JOIN", "1");
        }
        let mut child = cmd.spawn().map_err(|err| {
            let prog = self.opts.command[0].to_string_lossy();
            eprintln!("commrun: cannot start `{prog}`: {}", os_message(&err));
            if err.kind() == io::ErrorKind::NotFound {
                127
            } else {
                126
            }
        })?;
        let started = Rank { rank, pid: Pid::from_child(&child), exit: None, started: Instant::now() };
        let pipes: [(Option<Box<dyn Read + Send>>, bool); 2] = [
            (child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>), false),
            (child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>), true),
        ];
        for (pipe, to_stderr) in pipes {
            let Some(pipe) = pipe else { continue };
            match spawn_pump(pipe, rank, to_stderr, self.lines.clone(), self.done.clone()) {
                Ok(()) => self.pumps += 1,
                // The pipe was dropped with the closure; the rank gets EPIPE/SIGPIPE on output.
                Err(err) => eprintln!("commrun: cannot start an output thread for rank {rank}: {}", os_message(&err)),
            }
        }
        // `child` is dropped here without waiting: the wait loop owns the pid from now on.
        Ok(started)
    }
}

/// Signals every rank whose process group is still ours.
fn signal_all(ranks: &[Rank], signal: Signal) {
    for r in ranks {
        r.signal(signal);
    }
}

/// The wait loop: watches exits and signals, stops the job on the first failure (with
/// recovery, the first that is not a rank killed by a signal; such a rank is started again
/// while restarts are left), then kills stragglers and reaps every rank. Returns the exit code.
fn supervise(ranks: &mut Vec<Rank>, incoming: &mut Incoming, mut stop: Option<Stop>, spawner: &mut Spawner<'_>) -> i32 {
    let grace = spawner.opts.timeout_kill;
    let recovery = spawner.opts.enable_recovery || spawner.opts.max_restarts > 0;
    let mut restarts_left = spawner.opts.max_restarts;
    // Replacements due (when, rank): started after a back-off, so a replacement that crashes at
    // once does not spin through the restarts.
    let mut due: Vec<(Instant, u32)> = Vec::new();
    let first_backoff = spawner.opts.restart_backoff.min(RESTART_BACKOFF_MAX);
    let mut backoff = first_backoff;
    let mut deadline = stop.map(|_| {
        signal_all(ranks, Signal::TERM);
        Instant::now() + grace
    });
    let mut killed = false;
    let mut signals_seen = 0;
    // With recovery: the processes killed by a signal so far (reported once each).
    let mut lost: Vec<Pid> = Vec::new();

    loop {
        if let Some((signo, count)) = incoming.received() {
            if count > signals_seen {
                if stop.is_none() {
                    // Forward the signal itself, then the usual grace period and SIGKILL.
                    eprintln!("commrun: received {}; stopping all ranks", signal_name(signo));
                    stop = Some(Stop::Signal(signo));
                    // Only SIGINT/SIGTERM/SIGHUP are received, all of them named.
                    if let Some(signal) = Signal::from_named_raw(signo) {
                        signal_all(ranks, signal);
                    }
                    deadline = Some(Instant::now() + grace);
                } else if !killed {
                    // A signal while already stopping (a second Ctrl-C): no more grace.
                    eprintln!("commrun: received a signal while stopping; killing all ranks");
                    signal_all(ranks, Signal::KILL);
                    killed = true;
                }
                signals_seen = count;
            }
        }

        let mut running = 0;
        for i in 0..ranks.len() {
            let exit = match ranks[i].peek() {
                Ok(Some(exit)) => exit,
                Ok(None) => {
                    running += 1;
                    continue;
                }
                Err(err) => {
                    eprintln!("commrun: cannot wait for rank {}: {}", ranks[i].rank, os_message(&err));
                    ranks[i].exit = Some(Exit::Code(1));
                    Exit::Code(1)
                }
            };
            let crashed = matches!(exit, Exit::Signal(..));
            if stop.is_none() && recovery && crashed && !lost.contains(&ranks[i].pid) {
                lost.push(ranks[i].pid);
                let rank = ranks[i].rank;
                if restarts_left > 0 {
                    restarts_left -= 1;
                    // The back-off grows while processes die young (a crash loop), and starts
                    // over after one that ran a while.
                    if ranks[i].started.elapsed() >= RESTART_BACKOFF_RESET {
                        backoff = first_backoff;
                    }
                    eprintln!(
                        "commrun: rank {rank} {exit}; starting a replacement (COMM_JOIN=1) in {}",
                        comm_core::config::fmt_duration(backoff)
                    );
                    due.push((Instant::now() + backoff, rank));
                    backoff = (backoff * 2).min(RESTART_BACKOFF_MAX);
                } else if ranks.iter().any(|r| r.exit.is_none()) {
                    eprintln!("commrun: rank {rank} {exit}; the others go on (--enable-recovery)");
                }
            } else if stop.is_none() && !exit.success() && !(recovery && crashed) {
                let others = ranks.iter().any(|r| r.exit.is_none());
                let tail = if others { "; stopping the other ranks" } else { "" };
                eprintln!("commrun: rank {} {exit}{tail}", ranks[i].rank);
                stop = Some(Stop::RankFailed(exit));
                signal_all(ranks, Signal::TERM);
                deadline = Some(Instant::now() + grace);
            }
        }
        if stop.is_some() {
            due.clear();
        }
        while let Some(i) = due.iter().position(|(at, _)| Instant::now() >= *at) {
            let (_, rank) = due.remove(i);
            match spawner.start(rank, true) {
                Ok(started) => {
                    ranks.push(started);
                    running += 1;
                }
                Err(code) => {
                    stop = Some(Stop::SpawnFailed(code));
                    signal_all(ranks, Signal::TERM);
                    deadline = Some(Instant::now() + grace);
                    due.clear();
                }
            }
        }
        if running == 0 && due.is_empty() {
            break;
        }
        if let Some(deadline) = deadline {
            if !killed && Instant::now() >= deadline {
                for r in ranks.iter().filter(|r| r.exit.is_none()) {
                    eprintln!("commrun: rank {} did not stop within {:?}; sending SIGKILL", r.rank, grace);
                }
                signal_all(ranks, Signal::KILL);
                killed = true;
            }
        }
        thread::sleep(POLL);
    }

    if stop.is_some() {
        // Every rank has exited; kill what they left behind in their process groups.
        signal_all(ranks, Signal::KILL);
    }
    for r in ranks.iter_mut() {
        r.reap();
    }
    match stop {
        Some(stop) => stop.exit_code(),
        None => shrunk_exit(ranks, spawner.opts.nproc, spawner.opts.allow_shrink),
    }
}

/// The exit code of a job that nobody stopped: 0 when every rank's last process succeeded;
/// else (ranks lost to signals, not replaced) the first lost rank's code, unless
/// `allow_shrink`, said on the last line either way.
fn shrunk_exit(ranks: &[Rank], world: u32, allow_shrink: bool) -> i32 {
    // A rank's last process is its latest replacement (pushed after the one it replaces).
    let last = |rank: u32| ranks.iter().rev().find(|r| r.rank == rank).and_then(|r| r.exit);
    let lost: Vec<(u32, Exit)> = (0..world).filter_map(|r| last(r).filter(|e| !e.success()).map(|e| (r, e))).collect();
    let Some(&(_, first)) = lost.first() else { return 0 };
    let names: Vec<String> = lost.iter().map(|(r, e)| format!("rank {r} {e}")).collect();
    let finished = world as usize - lost.len();
    if finished == 0 {
        eprintln!("commrun: every rank was lost ({})", names.join(", "));
        return first.shell_code();
    }
    if allow_shrink {
        eprintln!("commrun: the job finished with {finished} of {world} ranks ({}); --allow-shrink", names.join(", "));
        return 0;
    }
    eprintln!(
        "commrun: the job finished with {finished} of {world} ranks ({}); exiting with code {} (--allow-shrink makes \
         this a success)",
        names.join(", "),
        first.shell_code()
    );
    first.shell_code()
}

/// Waits for the output threads to drain the pipes; gives up once no line was passed on for
/// [`OUTPUT_IDLE`] (a pipe held open by a process a rank left behind).
fn wait_for_output(done: &mpsc::Receiver<()>, mut pending: usize, lines: &AtomicU64) {
    let mut seen = lines.load(Ordering::Relaxed);
    let mut idle_since = Instant::now();
    while pending > 0 {
        match done.recv_timeout(Duration::from_millis(50)) {
            Ok(()) => pending -= 1,
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let now = lines.load(Ordering::Relaxed);
                if now != seen {
                    seen = now;
                    idle_since = Instant::now();
                } else if idle_since.elapsed() >= OUTPUT_IDLE {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_and_messages() {
        assert!(Exit::Code(0).success());
        assert!(!Exit::Code(3).success());
        assert_eq!(Exit::Code(3).shell_code(), 3);
        assert_eq!(Exit::Signal(Signal::KILL.as_raw(), false).shell_code(), 137);
        assert_eq!(Exit::Code(3).to_string(), "exited with code 3");
        assert_eq!(Exit::Signal(9, false).to_string(), "was killed by signal 9 (SIGKILL)");
        assert_eq!(Exit::Signal(11, true).to_string(), "was killed by signal 11 (SIGSEGV) (core dumped)");
        assert_eq!(Stop::Signal(Signal::INT.as_raw()).exit_code(), 130);
        assert_eq!(Stop::SpawnFailed(127).exit_code(), 127);
    }

    #[test]
    fn os_messages() {
        assert_eq!(os_message(&io::Error::from(rustix::io::Errno::NOENT)), "No such file or directory");
        assert_eq!(os_message(&io::Error::other("plain")), "plain");
    }
}
