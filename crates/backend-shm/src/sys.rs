//! Small OS helpers: futex sleep/wake on shared words, process liveness.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

use rustix::thread::futex;

/// Sleeps while `*word == expected`, at most `timeout`. Spurious returns are fine: callers
/// re-check their condition. Not `PRIVATE`: the word is shared between processes.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = futex::Timespec { tv_sec: timeout.as_secs() as i64, tv_nsec: timeout.subsec_nanos() as _ };
    let _ = futex::wait(word, futex::Flags::empty(), expected, Some(&ts));
}

/// Wakes every sleeper on `word`.
pub(crate) fn futex_wake(word: &AtomicU32) {
    let _ = futex::wake(word, futex::Flags::empty(), i32::MAX as u32);
}

/// Identity of a live process: its pid and kernel start time, so a recycled pid is not
/// mistaken for the original process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ProcId {
    pub(crate) pid: u32,
    pub(crate) start: u64,
}

impl ProcId {
    /// This process.
    pub(crate) fn current() -> ProcId {
        let pid = std::process::id();
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok();
        ProcId { pid, start: stat.and_then(|s| parse_stat(&s)).map_or(0, |(_, s)| s) }
    }

    /// `Some(false)` when the process is gone (exited, zombie, or its pid was reused);
    /// `None` when it cannot be told (no /proc, another pid namespace).
    pub(crate) fn alive(&self) -> Option<bool> {
        match std::fs::read_to_string(format!("/proc/{}/stat", self.pid)) {
            Ok(stat) => {
                let (state, start) = parse_stat(&stat)?;
                Some(!matches!(state, 'Z' | 'X' | 'x') && (self.start == 0 || start == self.start))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(false),
            Err(_) => None,
        }
    }
}

/// (state, starttime) from `/proc/<pid>/stat`. The command name may contain spaces and
/// parentheses, so fields are counted after the last `)`.
fn parse_stat(stat: &str) -> Option<(char, u64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    // After the state come fields 4.. of proc(5); starttime is field 22, i.e. 19 further on.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_parsing_handles_odd_names() {
        let s = "1234 (a) b (c)) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 20 21";
        assert_eq!(parse_stat(s), Some(('S', 987654)));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn liveness() {
        assert_eq!(ProcId::current().alive(), Some(true));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let id = ProcId { pid: child.id(), start: 0 };
        child.wait().unwrap();
        assert_eq!(id.alive(), Some(false));
        let me = ProcId::current();
        assert_eq!(ProcId { start: me.start + 1, ..me }.alive(), Some(false), "recycled pid");
    }
}
