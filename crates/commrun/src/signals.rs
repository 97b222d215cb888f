//! SIGINT / SIGTERM / SIGHUP handling: the handler only records the signal; the launcher's wait
//! loop polls [`received`].

use std::io;
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};

/// The first signal received (0 = none yet).
static FIRST: AtomicI32 = AtomicI32::new(0);
/// How many signals were received.
static COUNT: AtomicU32 = AtomicU32::new(0);

extern "C" fn on_signal(signo: libc::c_int) {
    // Only lock-free atomics here: async-signal-safe.
    let _ = FIRST.compare_exchange(0, signo, Ordering::SeqCst, Ordering::SeqCst);
    COUNT.fetch_add(1, Ordering::SeqCst);
}

/// Installs the handler for SIGINT, SIGTERM and SIGHUP. SIGHUP stays ignored when commrun was
/// started with it ignored (`nohup`). Handlers are reset to the default in the children by
/// `exec`.
pub(crate) fn install() -> io::Result<()> {
    for signo in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: plain sigaction calls with zero-initialised, then filled, structs; the handler
        // only touches atomics.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if signo == libc::SIGHUP {
                if libc::sigaction(signo, std::ptr::null(), &mut old) != 0 {
                    return Err(io::Error::last_os_error());
                }
                if old.sa_sigaction == libc::SIG_IGN {
                    continue;
                }
            }
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            if libc::sigaction(signo, &action, std::ptr::null_mut()) != 0 {
                return Err(io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

/// The first signal received (if any) and how many signals were received in all.
pub(crate) fn received() -> Option<(i32, u32)> {
    match FIRST.load(Ordering::SeqCst) {
        0 => None,
        signo => Some((signo, COUNT.load(Ordering::SeqCst))),
    }
}

/// A signal's name (`SIGKILL`), or `signal N` for one without a well-known name.
pub(crate) fn signal_name(signo: i32) -> String {
    let name = match signo {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        _ => return format!("signal {signo}"),
    };
    name.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(signal_name(libc::SIGKILL), "SIGKILL");
        assert_eq!(signal_name(libc::SIGINT), "SIGINT");
        assert_eq!(signal_name(1000), "signal 1000");
    }
}
