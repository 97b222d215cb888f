//! Command-line options of `commrun`.

use std::ffi::OsString;
use std::time::Duration;

use clap::Parser;

/// The largest number of ranks `commrun` starts (a guard against typos such as `-n 80000`).
pub const MAX_RANKS: u32 = 4096;

/// Launches N local ranks of a program with torchrun-style environment variables.
///
/// Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
/// MASTER_PORT and COMM_JOB_TOKEN. commrun serves the rendezvous store itself (COMM_STORE=external),
/// so it outlives any rank. Output lines are prefixed with `[rank] `. When a rank fails, the
/// others are stopped and commrun exits with the failing rank's code (128+signal for a rank
/// killed by a signal); with --enable-recovery a rank killed by a signal leaves the others running.
#[derive(Debug, Clone, Parser)]
#[command(name = "commrun", version, about, long_about, override_usage = "commrun -n N [OPTIONS] [--] PROG [ARGS]...")]
pub struct Options {
    /// Number of ranks (processes) to start on this machine.
    #[arg(
        short = 'n',
        long = "nproc",
        visible_alias = "nproc-per-node",
        value_name = "N",
        value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_RANKS))
    )]
    pub nproc: u32,

    /// Address of the rendezvous store [default: $MASTER_ADDR, else 127.0.0.1]. commrun serves
    /// it when the address is this machine's (else rank 0 does).
    #[arg(long, value_name = "ADDR")]
    pub master_addr: Option<String>,

    /// Port of the rendezvous store [default: $MASTER_PORT, else a free port; 0 = pick a free port].
    #[arg(long, value_name = "PORT")]
    pub master_port: Option<u16>,

    /// Suppress the standard output of every rank but rank 0 (standard error is still shown).
    #[arg(long)]
    pub quiet_ranks: bool,

    /// A rank killed by a signal (a crash, kill -9) does not stop the others: they can shrink
    /// their groups and go on (`ProcessGroup::shrink`). A job that ends with fewer ranks than
    /// it started with exits with the lost rank's code unless --allow-shrink; a rank that exits
    /// with a non-zero code still fails the job, at its end.
    #[arg(long)]
    pub enable_recovery: bool,

    /// Start a replacement for a rank killed by a signal, at most this many times in all
    /// (implies --enable-recovery). The replacement gets the rank's environment and
    /// COMM_JOIN=1: it joins the running group (`Builder::join`) when the others admit it
    /// (`ProcessGroup::grow`).
    /// Replacements start after a back-off (--restart-backoff).
    #[arg(long, value_name = "N", default_value = "0")]
    pub max_restarts: u32,

    /// Seconds before the first replacement starts; it doubles while the lost processes had
    /// run less than a second (a crash loop), up to 5 s, and starts over after one that ran
    /// longer. 0: no back-off.
    #[arg(long, value_name = "SECONDS", default_value = "0.1", value_parser = parse_seconds)]
    pub restart_backoff: Duration,

    /// With recovery, a job that ends with fewer ranks than it started with (a rank lost and not
    /// replaced) is a success. Without it commrun says so on its last line and exits with the
    /// lost rank's code.
    #[arg(long)]
    pub allow_shrink: bool,

    /// Seconds to wait after SIGTERM (or a forwarded signal) before sending SIGKILL.
    #[arg(long, value_name = "SECONDS", default_value = "5", value_parser = parse_seconds)]
    pub timeout_kill: Duration,

    /// The program to run and its arguments (put them after `--`).
    #[arg(
        value_name = "PROG",
        required = true,
        trailing_var_arg = true,
        value_parser = clap::value_parser!(OsString)
    )]
    pub command: Vec<OsString>,
}

/// Parses a non-negative number of seconds (fractions allowed) into a [`Duration`].
pub fn parse_seconds(text: &str) -> Result<Duration, String> {
    let secs: f64 = text.trim().parse().map_err(|_| format!("`{text}` is not a number of seconds"))?;
    Duration::try_from_secs_f64(secs).map_err(|_| format!("`{text}` is not a non-negative number of seconds"))
}

/// Parses the process's command line; on a usage error prints it and exits with code 2
/// (`--help` and `--version` exit with 0).
pub fn parse() -> Options {
    Options::try_parse().unwrap_or_else(|err| err.exit())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_from(args: &[&str]) -> Result<Options, clap::Error> {
        Options::try_parse_from(std::iter::once("commrun").chain(args.iter().copied()))
    }

    #[test]
    fn parses_full_command_line() {
        let o = parse_from(&[
            "-n",
            "4",
            "--master-addr",
            "10.0.0.1",
            "--master-port",
            "1234",
            "--quiet-ranks",
            "--timeout-kill",
            "0.5",
            "--",
            "prog",
            "-x",
            "--y",
        ])
        .unwrap();
        assert_eq!(o.nproc, 4);
        assert_eq!(o.master_addr.as_deref(), Some("10.0.0.1"));
        assert_eq!(o.master_port, Some(1234));
        assert!(o.quiet_ranks);
        assert_eq!(o.timeout_kill, Duration::from_millis(500));
        assert_eq!(o.command, ["prog", "-x", "--y"]);
    }

    #[test]
    fn defaults_and_command_without_separator() {
        let o = parse_from(&["-n", "2", "prog", "-n", "7"]).unwrap();
        assert_eq!(o.nproc, 2);
        assert_eq!(o.master_addr, None);
        assert_eq!(o.master_port, None);
        assert!(!o.quiet_ranks);
        assert_eq!(o.timeout_kill, Duration::from_secs(5));
        assert_eq!(o.command, ["prog", "-n", "7"]);
        let o = parse_from(&["--nproc-per-node", "3", "--", "prog"]).unwrap();
        assert_eq!(o.nproc, 3);
    }

    #[test]
    fn rejects_bad_usage() {
        for args in [
            &["-n", "0", "--", "prog"][..],
            &["-n", "2"],
            &["--", "prog"],
            &["-n", "x", "--", "prog"],
            &["-n", "2", "--timeout-kill", "-1", "--", "prog"],
            &["-n", "2", "--master-port", "70000", "--", "prog"],
            &["-n", "2", "--bogus", "--", "prog"],
        ] {
            let err = parse_from(args).unwrap_err();
            assert_eq!(err.exit_code(), 2, "{args:?}");
        }
    }

    #[test]
    fn seconds() {
        assert_eq!(parse_seconds("0").unwrap(), Duration::ZERO);
        assert_eq!(parse_seconds("2.25").unwrap(), Duration::from_millis(2250));
        assert!(parse_seconds("-1").is_err());
        assert!(parse_seconds("inf").is_err());
        assert!(parse_seconds("NaN").is_err());
        assert!(parse_seconds("soon").is_err());
    }
}
