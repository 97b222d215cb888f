//! SIGINT / SIGTERM / SIGHUP handling: signal-hook's handler only records the signal; the
//! launcher's wait loop polls [`Incoming::received`].

use std::io;

use signal_hook::consts::signal::*;
use signal_hook::iterator::Signals;

/// The signals commrun stops the job on, as they arrive.
pub(crate) struct Incoming {
    signals: Signals,
    /// The first signal received.
    first: Option<i32>,
    /// How many signals were received (a signal repeated between two polls counts once).
    count: u32,
}

impl Incoming {
    /// Installs the handler for SIGINT, SIGTERM and SIGHUP. SIGHUP stays ignored when commrun
    /// was started with it ignored (`nohup`). Handlers are reset to the default in the children
    /// by `exec`.
    pub(crate) fn install() -> io::Result<Incoming> {
        let mut wanted = vec![SIGINT, SIGTERM];
        if !ignored_at_start(SIGHUP) {
            wanted.push(SIGHUP);
        }
        Ok(Incoming { signals: Signals::new(wanted)?, first: None, count: 0 })
    }

    /// The first signal received (if any) and how many signals were received in all.
    pub(crate) fn received(&mut self) -> Option<(i32, u32)> {
        for signo in self.signals.pending() {
            self.first.get_or_insert(signo);
            self.count += 1;
        }
        self.first.map(|signo| (signo, self.count))
    }
}

/// Whether `signo` is ignored (the disposition commrun inherited, as handlers are not installed
/// yet). Read from the `SigIgn` mask of `/proc/self/status`, which needs no unsafe `sigaction`
/// query; where that cannot be read, the signal counts as not ignored.
fn ignored_at_start(signo: i32) -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| sig_ign_has(&status, signo))
}

/// Whether the `SigIgn:` line of a `/proc/<pid>/status` text has `signo`'s bit set.
fn sig_ign_has(status: &str, signo: i32) -> bool {
    let Some(mask) = status.lines().find_map(|line| line.strip_prefix("SigIgn:")) else { return false };
    let Ok(mask) = u64::from_str_radix(mask.trim(), 16) else { return false };
    (1..=64).contains(&signo) && mask & (1 << (signo - 1)) != 0
}

/// A signal's name (`SIGKILL`), or `signal N` for one without a well-known name.
pub(crate) fn signal_name(signo: i32) -> String {
    let name = match signo {
        SIGHUP => "SIGHUP",
        SIGINT => "SIGINT",
        SIGQUIT => "SIGQUIT",
        SIGILL => "SIGILL",
        SIGTRAP => "SIGTRAP",
        SIGABRT => "SIGABRT",
        SIGBUS => "SIGBUS",
        SIGFPE => "SIGFPE",
        SIGKILL => "SIGKILL",
        SIGUSR1 => "SIGUSR1",
        SIGSEGV => "SIGSEGV",
        SIGUSR2 => "SIGUSR2",
        SIGPIPE => "SIGPIPE",
        SIGALRM => "SIGALRM",
        SIGTERM => "SIGTERM",
        SIGXCPU => "SIGXCPU",
        SIGXFSZ => "SIGXFSZ",
        _ => return format!("signal {signo}"),
    };
    name.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(signal_name(SIGKILL), "SIGKILL");
        assert_eq!(signal_name(SIGINT), "SIGINT");
        assert_eq!(signal_name(1000), "signal 1000");
    }

    #[test]
    fn ignored_mask() {
        let status = "Name:\tcommrun\nSigBlk:\t0000000000000001\nSigIgn:\t0000000000000001\n";
        assert!(sig_ign_has(status, 1));
        assert!(!sig_ign_has(status, 2));
        assert!(sig_ign_has("SigIgn:\t8000000000000000\n", 64));
        assert!(!sig_ign_has("SigIgn:\t8000000000000000\n", 65));
        assert!(!sig_ign_has("Name:\tx\n", 1));
    }
}
