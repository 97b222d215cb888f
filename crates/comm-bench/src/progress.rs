//! Progress of the bench on rank 0's stderr (`--progress`), never on stdout, so the table
//! stays clean.
//!
//! * `bar`: one line redrawn in place (`\r`, erase line): rows done, percent, elapsed time and
//!   the row being measured; it is erased before each table line and at the end.
//! * `lines`: one plain line per row, `comm-bench progress: DONE/TOTAL LABEL`, and
//!   `comm-bench progress: TOTAL/TOTAL done` at the end: for a launcher that draws its own bar
//!   (`cargo xtask bench` does, from rank 0's stderr through commrun or mpirun).
//! * `off`.
//! * `auto` (the default): `bar` when stderr is a terminal, else `off` (under commrun or
//!   mpirun, or redirected to a file, where the table itself shows how far it got).

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// What `--progress` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Mode {
    /// `bar` on a terminal, else `off`.
    Auto,
    /// A bar redrawn in place on stderr.
    Bar,
    /// One `comm-bench progress: DONE/TOTAL LABEL` line per row on stderr.
    Lines,
    /// Nothing.
    Off,
}

impl Mode {
    /// `Auto` made concrete, for a stderr that is (`tty`) or is not a terminal.
    pub(crate) fn resolve(self, tty: bool) -> Mode {
        match self {
            Mode::Auto if tty => Mode::Bar,
            Mode::Auto => Mode::Off,
            m => m,
        }
    }
}

/// The prefix of `lines` mode's lines.
pub(crate) const LINE_PREFIX: &str = "comm-bench progress: ";
/// Width of the bar itself, in characters.
const BAR_WIDTH: usize = 28;

/// The progress display of one bench run.
pub(crate) struct Progress<W: Write> {
    mode: Mode,
    out: W,
    total: usize,
    done: usize,
    current: String,
    start: Instant,
    drawn: bool,
}

impl Progress<std::io::Stderr> {
    /// Progress of `total` rows on stderr (`Off` when `active` is false: the ranks other than 0).
    pub(crate) fn stderr(mode: Mode, total: usize, active: bool) -> Self {
        let mode = if active { mode.resolve(std::io::stderr().is_terminal()) } else { Mode::Off };
        Progress::new(mode, total, std::io::stderr())
    }
}

impl<W: Write> Progress<W> {
    /// Progress of `total` rows written to `out` in `mode` (`Auto` counts as `Off`).
    pub(crate) fn new(mode: Mode, total: usize, out: W) -> Self {
        let mode = mode.resolve(false);
        Progress { mode, out, total, done: 0, current: String::new(), start: Instant::now(), drawn: false }
    }

    /// The row `label` is about to be measured (the rows before it are done).
    pub(crate) fn start_row(&mut self, label: &str) {
        self.current = label.to_owned();
        match self.mode {
            Mode::Bar => self.draw(),
            Mode::Lines => {
                let _ = writeln!(self.out, "{LINE_PREFIX}{}/{} {label}", self.done, self.total);
                let _ = self.out.flush();
            }
            Mode::Auto | Mode::Off => {}
        }
    }

    /// The row announced last is done.
    pub(crate) fn row_done(&mut self) {
        self.done += 1;
    }

    /// Prints `line` on stdout, with the bar out of its way.
    pub(crate) fn println(&mut self, line: &str) {
        self.clear();
        println!("{line}");
        if self.mode == Mode::Bar && !self.current.is_empty() {
            self.draw();
        }
    }

    /// Every row is done: erases the bar, or says so in `lines` mode.
    pub(crate) fn finish(&mut self) {
        self.clear();
        if self.mode == Mode::Lines {
            let _ = writeln!(self.out, "{LINE_PREFIX}{}/{} done", self.done, self.total);
            let _ = self.out.flush();
        }
        self.mode = Mode::Off;
    }

    fn draw(&mut self) {
        let line = bar_line(self.done, self.total, self.start.elapsed(), &self.current);
        let _ = write!(self.out, "\r\x1b[2K{line}");
        let _ = self.out.flush();
        self.drawn = true;
    }

    fn clear(&mut self) {
        if self.drawn {
            let _ = write!(self.out, "\r\x1b[2K");
            let _ = self.out.flush();
            self.drawn = false;
        }
    }
}

impl<W: Write> Drop for Progress<W> {
    /// An error ends the run early: leave no half-drawn bar before its message.
    fn drop(&mut self) {
        self.clear();
    }
}

/// `[#########-------------------]  12/24  50%  0:31  all_reduce f32 1MiB`.
pub(crate) fn bar_line(done: usize, total: usize, elapsed: Duration, current: &str) -> String {
    let frac = if total == 0 { 1.0 } else { done as f64 / total as f64 };
    let filled = ((frac * BAR_WIDTH as f64).round() as usize).min(BAR_WIDTH);
    let secs = elapsed.as_secs();
    format!(
        "[{}{}] {done:>3}/{total} {:>3}%  {}:{:02}  {current}",
        "#".repeat(filled),
        "-".repeat(BAR_WIDTH - filled),
        (frac * 100.0).round() as u32,
        secs / 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(mode: Mode) -> String {
        let mut buf = Vec::new();
        let mut p = Progress::new(mode, 2, &mut buf);
        for label in ["all_reduce f32 8B", "all_reduce f32 16B"] {
            p.start_row(label);
            p.row_done();
        }
        p.finish();
        drop(p);
        String::from_utf8(buf).unwrap()
    }

    #[test]
    fn off_tty_auto_prints_nothing() {
        assert_eq!(Mode::Auto.resolve(false), Mode::Off);
        assert_eq!(Mode::Auto.resolve(true), Mode::Bar);
        assert_eq!(Mode::Lines.resolve(true), Mode::Lines);
        assert_eq!(Mode::Bar.resolve(false), Mode::Bar);
        assert_eq!(run(Mode::Auto), "");
        assert_eq!(run(Mode::Off), "");
    }

    #[test]
    fn lines_mode_is_plain_lines() {
        let out = run(Mode::Lines);
        assert_eq!(
            out,
            "comm-bench progress: 0/2 all_reduce f32 8B\n\
             comm-bench progress: 1/2 all_reduce f32 16B\n\
             comm-bench progress: 2/2 done\n"
        );
        assert!(!out.contains('\r') && !out.contains('\x1b'));
    }

    #[test]
    fn bar_mode_redraws_in_place_and_erases_itself() {
        let out = run(Mode::Bar);
        assert_eq!(out.matches("\r\x1b[2K[").count(), 2, "{out:?}");
        assert!(out.ends_with("\r\x1b[2K"), "the bar is erased at the end: {out:?}");
        assert!(!out.contains('\n'), "{out:?}");
        assert!(out.contains("1/2  50%") && out.contains("all_reduce f32 16B"), "{out:?}");
    }

    #[test]
    fn bar_lines() {
        let l = bar_line(6, 24, Duration::from_secs(75), "all_gather bf16 1MiB");
        assert_eq!(l, format!("[{}{}]   6/24  25%  1:15  all_gather bf16 1MiB", "#".repeat(7), "-".repeat(21)));
        assert!(bar_line(0, 0, Duration::ZERO, "").contains("100%"));
    }

    #[test]
    fn dropping_erases_the_bar() {
        let mut buf = Vec::new();
        {
            let mut p = Progress::new(Mode::Bar, 3, &mut buf);
            p.start_row("x");
        }
        assert!(String::from_utf8(buf).unwrap().ends_with("\r\x1b[2K"));
    }
}
