//! The progress display of `cargo xtask bench`.
//!
//! comm-bench runs under commrun or mpirun, whose output is a pipe, so it cannot draw a bar
//! itself: xtask asks it for `--progress lines` (`comm-bench progress: DONE/TOTAL ROW` on rank
//! 0's stderr), relays the job's stdout and stderr line by line, keeps those lines for itself
//! and draws the progress:
//!
//! * stderr a terminal: an indicatif bar at the bottom, out of the way of every relayed line
//!   (so the table never mixes with it) and erased at the end;
//! * otherwise (a log file, CI): a plain line `# progress ...` at most every
//!   [`OFF_TTY_EVERY`], nothing at all for a shorter run; never `\r` or escape sequences.

use std::fmt;
use std::io::{self, BufRead, BufReader, IsTerminal, Read, Write};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle};

use crate::{exit_code, show, Failure, Result};

/// How often the progress line is printed when stderr is not a terminal.
pub(crate) const OFF_TTY_EVERY: Duration = Duration::from_secs(10);
/// What comm-bench's `--progress lines` puts before each of its lines.
const PREFIX: &str = "comm-bench progress: ";
/// How often the bar is redrawn without news, so the elapsed time moves during a long row.
const TICK: Duration = Duration::from_millis(250);

/// One progress report of comm-bench: rows done, rows in all, the row now measured (or `done`).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Report {
    pub(crate) done: usize,
    pub(crate) total: usize,
    pub(crate) current: String,
}

/// The report in one output line (`[0] ` commrun prefix or none, as mpirun relays it).
pub(crate) fn parse(line: &str) -> Option<Report> {
    let line = line.trim_end();
    let line = match line.strip_prefix('[') {
        Some(rest) => rest.split_once("] ").filter(|(r, _)| r.chars().all(|c| c.is_ascii_digit()))?.1,
        None => line,
    };
    let rest = line.strip_prefix(PREFIX)?;
    let (counts, current) = rest.split_once(' ').unwrap_or((rest, ""));
    let (done, total) = counts.split_once('/')?;
    Some(Report { done: done.parse().ok()?, total: total.parse().ok()?, current: current.to_owned() })
}

/// `bench shm [#######---------------------]   6/24  25%  1:15  all_gather bf16 1MiB`.
fn bar_style() -> ProgressStyle {
    ProgressStyle::with_template("{prefix} [{bar:28}] {pos:>3}/{len} {percent:>3}%  {minutes}  {msg}")
        .expect("the template is valid")
        .with_key("minutes", minutes)
        .progress_chars("#-")
}

/// Elapsed time as `M:SS`.
fn minutes(state: &ProgressState, w: &mut dyn fmt::Write) {
    let secs = state.elapsed().as_secs();
    let _ = write!(w, "{}:{:02}", secs / 60, secs % 60);
}

/// What is on the screen, and what to do with the next report.
pub(crate) struct Display {
    label: String,
    start: Instant,
    last_line: Instant,
    /// Where the bar goes once the first report arrives; `None` off a terminal.
    target: Option<ProgressDrawTarget>,
    bar: Option<ProgressBar>,
}

impl Display {
    /// A display for the job `label` (`bench shm`) that draws its bar on `target` (`None`: the
    /// plain lines for a stderr that is not a terminal).
    pub(crate) fn new(label: &str, target: Option<ProgressDrawTarget>, start: Instant) -> Display {
        Display { label: label.to_owned(), start, last_line: start, target, bar: None }
    }

    /// Takes a report that arrived at `now`.
    pub(crate) fn update(&mut self, r: Report, now: Instant, err: &mut impl Write) {
        let finished = r.total > 0 && r.done >= r.total;
        if let Some(target) = self.target.take() {
            // Made on the first report: until then there is nothing to draw.
            let bar = ProgressBar::with_draw_target(None, target)
                .with_style(bar_style())
                .with_prefix(self.label.clone())
                .with_elapsed(now.saturating_duration_since(self.start));
            self.bar = Some(bar);
        }
        if let Some(bar) = &self.bar {
            if finished {
                bar.finish_and_clear();
            } else if !bar.is_finished() {
                bar.set_length(r.total as u64);
                bar.set_position(r.done as u64);
                bar.set_message(r.current);
                if !bar.is_hidden() {
                    bar.enable_steady_tick(TICK);
                }
            }
        } else if !finished && now.duration_since(self.last_line) >= OFF_TTY_EVERY {
            let secs = now.duration_since(self.start).as_secs();
            let _ = writeln!(err, "# progress {}: {}/{} rows, {secs}s, now {}", self.label, r.done, r.total, r.current);
            let _ = err.flush();
            self.last_line = now;
        }
    }

    /// Runs `f` (which writes a relayed line) with the bar out of its way.
    pub(crate) fn relay<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.bar {
            Some(bar) => bar.suspend(f),
            None => f(),
        }
    }

    /// Erases the bar for good.
    pub(crate) fn finish(&mut self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// Reads `pipe` line by line (bytes as they are), calling `each` with every line, newline
/// included.
fn pump(pipe: impl Read, mut each: impl FnMut(&[u8])) {
    let mut reader = BufReader::with_capacity(64 * 1024, pipe);
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => each(&line),
        }
    }
}

/// Runs `cmd` (a comm-bench job started with `--progress lines`) to completion, relaying its
/// stdout and stderr and showing its progress as `label`; fails with its exit code.
pub(crate) fn run_relayed(mut cmd: Command, label: &str) -> Result {
    println!("$ {}", show(&cmd));
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| Failure { code: 1, msg: format!("cannot run `{}`: {e}", show(&cmd)) })?;
    let target = io::stderr().is_terminal().then(ProgressDrawTarget::stderr);
    let display = Arc::new(Mutex::new(Display::new(label, target, Instant::now())));
    let mut pumps = Vec::new();
    if let Some(out) = child.stdout.take() {
        let d = Arc::clone(&display);
        pumps.push(thread::spawn(move || {
            pump(out, |line| {
                let d = d.lock().unwrap_or_else(PoisonError::into_inner);
                d.relay(|| {
                    let mut stdout = io::stdout().lock();
                    let _ = stdout.write_all(line).and_then(|()| stdout.flush());
                });
            });
        }));
    }
    if let Some(pipe) = child.stderr.take() {
        let d = Arc::clone(&display);
        pumps.push(thread::spawn(move || {
            pump(pipe, |line| {
                let mut d = d.lock().unwrap_or_else(PoisonError::into_inner);
                match parse(&String::from_utf8_lossy(line)) {
                    Some(r) => d.update(r, Instant::now(), &mut io::stderr().lock()),
                    None => d.relay(|| {
                        let mut err = io::stderr().lock();
                        let _ = err.write_all(line).and_then(|()| err.flush());
                    }),
                }
            });
        }));
    }
    for p in pumps {
        let _ = p.join();
    }
    let status = child.wait();
    display.lock().unwrap_or_else(PoisonError::into_inner).finish();
    let status = status.map_err(|e| Failure { code: 1, msg: format!("waiting for `{}`: {e}", show(&cmd)) })?;
    if status.success() {
        Ok(())
    } else {
        Err(Failure { code: exit_code(status), msg: format!("`{}` failed ({status})", show(&cmd)) })
    }
}

#[cfg(test)]
mod tests {
    use indicatif::InMemoryTerm;

    use super::*;

    fn rep(done: usize, total: usize, current: &str) -> Report {
        Report { done, total, current: current.to_owned() }
    }

    #[test]
    fn reports_are_parsed_with_or_without_the_rank_prefix() {
        assert_eq!(
            parse("[0] comm-bench progress: 3/24 all_reduce f32 1KiB\n"),
            Some(rep(3, 24, "all_reduce f32 1KiB"))
        );
        assert_eq!(parse("comm-bench progress: 24/24 done"), Some(rep(24, 24, "done")));
        assert_eq!(parse("[12] comm-bench progress: 0/1"), Some(rep(0, 1, "")));
        assert_eq!(parse("[0] #    size(B)  count"), None);
        assert_eq!(parse("[x] comm-bench progress: 1/2 a"), None);
        assert_eq!(parse("comm-bench progress: one/2 a"), None);
    }

    #[test]
    fn off_tty_prints_a_plain_line_at_most_every_ten_seconds() {
        let t0 = Instant::now();
        let mut d = Display::new("bench shm", None, t0);
        let mut err = Vec::new();
        d.update(rep(0, 24, "all_reduce f32 8B"), t0, &mut err);
        d.update(rep(5, 24, "all_reduce f32 256B"), t0 + Duration::from_secs(4), &mut err);
        assert!(err.is_empty(), "nothing for the first 10 s");
        d.update(rep(12, 24, "all_reduce f32 32KiB"), t0 + Duration::from_secs(11), &mut err);
        d.update(rep(13, 24, "all_reduce f32 64KiB"), t0 + Duration::from_secs(15), &mut err);
        assert_eq!(d.relay(|| 7), 7);
        d.update(rep(20, 24, "all_reduce f32 8MiB"), t0 + Duration::from_secs(22), &mut err);
        d.update(rep(24, 24, "done"), t0 + Duration::from_secs(40), &mut err);
        d.finish();
        let text = String::from_utf8(err).unwrap();
        assert_eq!(
            text,
            "# progress bench shm: 12/24 rows, 11s, now all_reduce f32 32KiB\n\
             # progress bench shm: 20/24 rows, 22s, now all_reduce f32 8MiB\n"
        );
        assert!(!text.contains('\r') && !text.contains('\x1b'));
    }

    #[test]
    fn on_a_terminal_the_bar_is_drawn_and_erased() {
        let term = InMemoryTerm::new(4, 120);
        let t0 = Instant::now();
        let target = ProgressDrawTarget::term_like(Box::new(term.clone()));
        let mut d = Display::new("bench shm", Some(target), t0);
        let mut err = Vec::new();
        d.relay(|| ());
        assert_eq!(term.contents(), "", "nothing before the first report");
        d.update(rep(6, 24, "all_gather bf16 1MiB"), t0 + Duration::from_secs(75), &mut err);
        let bar = format!("[{}{}]   6/24  25%  1:15  all_gather bf16 1MiB", "#".repeat(7), "-".repeat(21));
        assert_eq!(term.contents(), format!("bench shm {bar}"));
        d.update(rep(24, 24, "done"), t0, &mut err);
        assert_eq!(term.contents(), "", "erased once done");
        d.relay(|| ());
        assert_eq!(term.contents(), "", "nothing left to draw once done");
        assert!(err.is_empty(), "the bar never writes to `err`: {err:?}");
    }
}
