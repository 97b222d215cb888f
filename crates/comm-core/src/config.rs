//! Parsing of configuration values, shared by every crate so that a value means the same
//! thing in an environment variable and on a command line: sizes (`4MiB`, `512K`, `65536`),
//! timeouts in seconds, switches.

use std::time::Duration;

use crate::CommError;

/// The longest wait any timeout stands for: longer ones are taken as this. A year is "forever"
/// for a job, and keeps `Instant::now() + timeout` far from overflowing.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 3600);

/// `timeout`, at most [`MAX_TIMEOUT`].
pub fn clamp_timeout(timeout: Duration) -> Duration {
    timeout.min(MAX_TIMEOUT)
}

/// A size: a whole number followed by an optional binary, case-insensitive unit: `B`,
/// `K`/`KB`/`KiB` (1024), `M`/`MB`/`MiB`, `G`/`GB`/`GiB`, `T`/`TB`/`TiB`. Spaces may separate
/// them.
///
/// ```
/// use comm_core::config::parse_size;
/// assert_eq!(parse_size("4MiB"), Ok(4 << 20));
/// assert_eq!(parse_size("512k"), Ok(512 << 10));
/// assert_eq!(parse_size("65536"), Ok(65536));
/// assert_eq!(parse_size("1TiB"), Ok(1 << 40));
/// assert!(parse_size("18446744073709551615G").is_err()); // overflow: an error, not a wrap
/// ```
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(format!("`{s}` is not a size (expected e.g. 8B, 4KiB, 64MiB)"));
    }
    let n: usize = num.parse().map_err(|_| format!("`{s}`: number too large"))?;
    let mult: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("`{s}`: unknown unit `{other}` (expected B, KiB, MiB, GiB, TiB or K, M, G, T)")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("`{s}`: size too large"))
}

/// A timeout in seconds (fractions allowed): positive; above [`MAX_TIMEOUT`] (`inf` too) it is
/// taken as `MAX_TIMEOUT`.
///
/// ```
/// use std::time::Duration;
/// use comm_core::config::{parse_timeout, MAX_TIMEOUT};
/// assert_eq!(parse_timeout("1.5"), Ok(Duration::from_millis(1500)));
/// assert_eq!(parse_timeout("1e20"), Ok(MAX_TIMEOUT));
/// assert_eq!(parse_timeout("inf"), Ok(MAX_TIMEOUT));
/// assert!(parse_timeout("0").is_err() && parse_timeout("nan").is_err());
/// ```
pub fn parse_timeout(s: &str) -> Result<Duration, String> {
    let secs = s.trim().parse::<f64>().ok().filter(|x| *x > 0.0);
    let secs = secs.ok_or_else(|| format!("`{s}` is not a positive number of seconds (or `inf`)"))?;
    if secs >= MAX_TIMEOUT.as_secs_f64() {
        return Ok(MAX_TIMEOUT);
    }
    // Below a nanosecond rounds to zero: still "positive" as the user meant it.
    Ok(Duration::from_secs_f64(secs).max(Duration::from_nanos(1)))
}

/// `d` for a message, rounded for people: `5.0 s` and `1.5 s` below 10 s, whole seconds from
/// there (`300 s`), whole milliseconds below a second (`300 ms`), microseconds below that
/// (`40 µs`), then nanoseconds: one formatter for every duration the crates print.
///
/// ```
/// use std::time::Duration;
/// use comm_core::config::fmt_duration;
/// assert_eq!(fmt_duration(Duration::from_nanos(2_999_998_908)), "3.0 s");
/// assert_eq!(fmt_duration(Duration::from_millis(5_007)), "5.0 s");
/// assert_eq!(fmt_duration(Duration::from_secs(300)), "300 s");
/// assert_eq!(fmt_duration(Duration::from_millis(300)), "300 ms");
/// assert_eq!(fmt_duration(Duration::from_micros(40)), "40 µs");
/// assert_eq!(fmt_duration(Duration::from_nanos(1_000)), "1 µs");
/// assert_eq!(fmt_duration(Duration::ZERO), "0 s");
/// ```
pub fn fmt_duration(d: Duration) -> String {
    let secs = d.as_secs_f64();
    match d {
        _ if d.is_zero() => "0 s".to_owned(),
        _ if secs >= 9.95 => format!("{secs:.0} s"),
        _ if secs >= 0.9995 => format!("{secs:.1} s"),
        _ if d >= Duration::from_micros(999_500) => "1.0 s".to_owned(),
        _ if d >= Duration::from_nanos(999_500) => format!("{:.0} ms", secs * 1e3),
        _ if d >= Duration::from_nanos(1_000) => format!("{:.0} µs", secs * 1e6),
        _ => format!("{} ns", d.as_nanos()),
    }
}

/// Panics when fault injection (`COMM_FAULT_INJECT=panic:OP`, [`Faults::panic_at`]) names op
/// `name`: for the tests of panic containment.
pub fn injected_panic(panic_at: Option<&str>, name: &str, rank: impl std::fmt::Display) {
    if panic_at == Some(name) {
        panic!("COMM_FAULT_INJECT: injected panic in {name} on rank {rank}");
    }
}

/// A whole number of microseconds (`COMM_*_SPIN_US`).
pub fn parse_micros(s: &str) -> Result<Duration, String> {
    s.trim()
        .parse::<u32>()
        .map(|us| Duration::from_micros(us.into()))
        .map_err(|_| format!("`{s}` is not a number of microseconds"))
}

/// A switch: `1`/`true`/`yes`/`on` or `0`/`false`/`no`/`off`.
pub fn parse_bool(s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(format!("`{s}` is not a boolean (use 1 or 0)")),
    }
}

/// Environment variable `name`, when set to something other than blanks.
pub fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// Reads `name` with `parse`; a bad value is a [`CommError::Config`] naming the variable.
pub fn env_parse<T>(name: &str, parse: impl FnOnce(&str) -> Result<T, String>) -> Result<Option<T>, CommError> {
    env_var(name).map(|v| parse(&v).map_err(|why| CommError::Config(format!("{name}={v:?}: {why}")))).transpose()
}

/// Test hooks, from `COMM_FAULT_INJECT` (unset: none, and nothing changes). Backends read it
/// once when a group starts; tests use it to check that faults are contained.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// `panic:<op>` (`panic:all_reduce`): the backend panics when it runs that op.
    pub panic_at: Option<&'static str>,
    /// `kill:rendezvous`: the process kills itself (SIGKILL) in the middle of the backend's
    /// rendezvous (shm: after publishing its segment, before unlinking it).
    pub kill_in_rendezvous: bool,
    /// `kill:shrink`: the process kills itself right after announcing itself to a shrink's
    /// agreement (see [`crate::elastic`]).
    pub kill_in_shrink: bool,
}

/// Ends this process at once with SIGKILL, as `kill -9` would (what a crash looks like to its
/// peers and its launcher); for the `kill:` fault hooks and tests.
#[doc(hidden)]
pub fn kill_self() -> ! {
    let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    // SIGKILL cannot be caught; this is only reached if sending it failed.
    std::process::abort()
}

#[doc(hidden)]
pub fn fault_injection() -> Result<Faults, CommError> {
    const OPS: [&str; 11] = [
        "all_reduce",
        "reduce",
        "broadcast",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "scatter",
        "gather",
        "barrier",
        "send",
        "recv",
    ];
    let Some(v) = env_var("COMM_FAULT_INJECT") else { return Ok(Faults::default()) };
    let v = v.trim();
    match v {
        "kill:rendezvous" => return Ok(Faults { kill_in_rendezvous: true, ..Faults::default() }),
        "kill:shrink" => return Ok(Faults { kill_in_shrink: true, ..Faults::default() }),
        _ => {}
    }
    let op = v.strip_prefix("panic:").and_then(|op| OPS.iter().find(|&&o| o == op));
    op.map(|&o| Faults { panic_at: Some(o), ..Faults::default() }).ok_or_else(|| {
        CommError::Config(format!("COMM_FAULT_INJECT={v:?}: expected panic:<op>, kill:rendezvous or kill:shrink"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        for (s, want) in [("8B", 8), ("4 KiB", 4096), ("4kb", 4096), ("64MiB", 64 << 20), ("2g", 2 << 30), ("0", 0)] {
            assert_eq!(parse_size(s), Ok(want), "{s}");
        }
        assert_eq!(parse_size("1TiB"), Ok(1 << 40));
        assert_eq!(parse_size("2 t"), Ok(2 << 40));
        for s in ["", "x", "4 PiB", "-1", "1.5M", "99999999999999999999", "18446744073709551615K"] {
            assert!(parse_size(s).is_err(), "{s}");
        }
    }

    #[test]
    fn timeouts_are_bounded() {
        assert_eq!(parse_timeout(" 15 "), Ok(Duration::from_secs(15)));
        assert_eq!(parse_timeout("1e19"), Ok(MAX_TIMEOUT));
        assert_eq!(parse_timeout("1e-12"), Ok(Duration::from_nanos(1)));
        assert_eq!(parse_timeout("inf"), Ok(MAX_TIMEOUT));
        assert_eq!(parse_timeout("Infinity"), Ok(MAX_TIMEOUT));
        for s in ["0", "-3", "-inf", "NaN", "ten", ""] {
            assert!(parse_timeout(s).is_err(), "{s}");
        }
        assert_eq!(clamp_timeout(Duration::MAX), MAX_TIMEOUT);
        assert!(std::time::Instant::now().checked_add(MAX_TIMEOUT).is_some());
    }

    #[test]
    fn switches() {
        assert_eq!(parse_bool("On"), Ok(true));
        assert_eq!(parse_bool("0"), Ok(false));
        assert!(parse_bool("maybe").is_err());
    }
}
