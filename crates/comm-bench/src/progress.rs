//! Progress of the bench on rank 0's stderr (`--progress`), never on stdout, so the table
//! stays clean.
//!
//! * `bar`: an indicatif bar (rows done, percent, elapsed time and the row being measured),
//!   drawn only when stderr is a terminal; it steps aside for each table line and is erased at
//!   the end.
//! * `lines`: one plain line per row, `comm-bench progress: DONE/TOTAL LABEL`, and
//!   `comm-bench progress: TOTAL/TOTAL done` at the end: for a launcher that draws its own bar
//!   (`cargo xtask bench` does, from rank 0's stderr through commrun or mpirun).
//! * `off`.
//! * `auto` (the default): `bar` when stderr is a terminal, else `off` (under commrun or
//!   mpirun, or redirected to a file, where the table itself shows how far it got).

use std::fmt;
use std::io::{IsTerminal, Write};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle};

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
/// How often the bar is redrawn without news, so the elapsed time moves during a long row.
const TICK: Duration = Duration::from_millis(250);

/// `[#######---------------------]   6/24  25%  1:15  all_gather bf16 1MiB`.
fn bar_style() -> ProgressStyle {
    ProgressStyle::with_template("[{bar:28}] {pos:>3}/{len} {percent:>3}%  {minutes}  {msg}")
        .expect("the template is valid")
        .with_key("minutes", minutes)
        .progress_chars("#-")
}

/// Elapsed time as `M:SS`.
fn minutes(state: &ProgressState, w: &mut dyn fmt::Write) {
    let secs = state.elapsed().as_secs();
    let _ = write!(w, "{}:{:02}", secs / 60, secs % 60);
}

/// The progress display of one bench run.
pub(crate) struct Progress<W: Write> {
    mode: Mode,
    /// Where `lines` mode writes.
    out: W,
    /// `bar` mode's bar.
    bar: Option<ProgressBar>,
    total: usize,
    done: usize,
}

impl Progress<std::io::Stderr> {
    /// Progress of `total` rows on stderr (`Off` when `active` is false: the ranks other than 0).
    pub(crate) fn stderr(mode: Mode, total: usize, active: bool) -> Self {
        let mode = if active { mode.resolve(std::io::stderr().is_terminal()) } else { Mode::Off };
        let progress = Progress::new(mode, total, std::io::stderr(), ProgressDrawTarget::stderr());
        if let Some(bar) = &progress.bar {
            bar.enable_steady_tick(TICK);
        }
        progress
    }
}

impl<W: Write> Progress<W> {
    /// Progress of `total` rows in `mode` (`Auto` counts as `Off`): `lines` written to `out`,
    /// the bar drawn on `target`.
    pub(crate) fn new(mode: Mode, total: usize, out: W, target: ProgressDrawTarget) -> Self {
        let mode = mode.resolve(false);
        let bar = (mode == Mode::Bar)
            .then(|| ProgressBar::with_draw_target(Some(total as u64), target).with_style(bar_style()));
        Progress { mode, out, bar, total, done: 0 }
    }

    /// The row `label` is about to be measured (the rows before it are done).
    pub(crate) fn start_row(&mut self, label: &str) {
        if let Some(bar) = &self.bar {
            bar.set_message(label.to_owned());
        }
        if self.mode == Mode::Lines {
            let _ = writeln!(self.out, "{LINE_PREFIX}{}/{} {label}", self.done, self.total);
            let _ = self.out.flush();
        }
    }

    /// The row announced last is done.
    pub(crate) fn row_done(&mut self) {
        self.done += 1;
        if let Some(bar) = &self.bar {
            bar.inc(1);
        }
    }

    /// Prints `line` on stdout, with the bar out of its way.
    pub(crate) fn println(&mut self, line: &str) {
        match &self.bar {
            Some(bar) => bar.suspend(|| println!("{line}")),
            None => println!("{line}"),
        }
    }

    /// Every row is done: erases the bar, or says so in `lines` mode.
    pub(crate) fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        if self.mode == Mode::Lines {
            let _ = writeln!(self.out, "{LINE_PREFIX}{}/{} done", self.done, self.total);
            let _ = self.out.flush();
        }
        self.mode = Mode::Off;
    }
}

impl<W: Write> Drop for Progress<W> {
    /// An error ends the run early: leave no half-drawn bar before its message (a dropped
    /// indicatif bar stays on the screen).
    fn drop(&mut self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use indicatif::InMemoryTerm;

    use super::*;

    const ROWS: [&str; 2] = ["all_reduce f32 8B", "all_reduce f32 16B"];

    fn run(mode: Mode) -> String {
        let mut buf = Vec::new();
        let mut p = Progress::new(mode, 2, &mut buf, ProgressDrawTarget::hidden());
        for label in ROWS {
            p.start_row(label);
            p.row_done();
        }
        p.finish();
        drop(p);
        String::from_utf8(buf).unwrap()
    }

    fn term() -> InMemoryTerm {
        InMemoryTerm::new(4, 100)
    }

    fn on(term: &InMemoryTerm, mode: Mode, total: usize) -> Progress<Vec<u8>> {
        Progress::new(mode, total, Vec::new(), ProgressDrawTarget::term_like(Box::new(term.clone())))
    }

    #[test]
    fn off_tty_auto_prints_nothing() {
        assert_eq!(Mode::Auto.resolve(false), Mode::Off);
        assert_eq!(Mode::Auto.resolve(true), Mode::Bar);
        assert_eq!(Mode::Lines.resolve(true), Mode::Lines);
        assert_eq!(Mode::Bar.resolve(false), Mode::Bar);
        assert_eq!(run(Mode::Auto), "");
        assert_eq!(run(Mode::Off), "");
        let t = term();
        let mut p = on(&t, Mode::Auto, 2);
        p.start_row(ROWS[0]);
        assert_eq!(t.contents(), "");
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
    fn bar_mode_shows_the_row_and_erases_itself() {
        let t = term();
        let mut p = on(&t, Mode::Bar, 2);
        assert_eq!(run(Mode::Bar), "", "the bar does not write where `lines` go");
        p.start_row(ROWS[0]);
        p.row_done();
        p.start_row(ROWS[1]);
        let shown = t.contents();
        assert!(shown.contains("1/2  50%") && shown.ends_with("all_reduce f32 16B"), "{shown:?}");
        p.row_done();
        p.finish();
        assert_eq!(t.contents(), "", "the bar is erased at the end");
    }

    #[test]
    fn bar_layout() {
        let t = term();
        let mut p = on(&t, Mode::Bar, 24);
        p.bar.as_ref().unwrap().set_elapsed(Duration::from_secs(75));
        for _ in 0..6 {
            p.row_done();
        }
        p.start_row("all_gather bf16 1MiB");
        let bar = format!("[{}{}]   6/24  25%  1:15  all_gather bf16 1MiB", "#".repeat(7), "-".repeat(21));
        assert_eq!(t.contents(), bar);
    }

    #[test]
    fn dropping_erases_the_bar() {
        let t = term();
        {
            let mut p = on(&t, Mode::Bar, 3);
            p.start_row("x");
            assert!(t.contents().ends_with('x'));
        }
        assert_eq!(t.contents(), "");
    }
}
