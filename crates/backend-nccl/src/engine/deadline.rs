//! Deadlines: [`Once`], a completer that a timer completes with a timeout unless its owner
//! is first, and the [`watchdog`] that aborts a call into NCCL blocked for too long.

use std::sync::{Arc, Mutex};
use std::thread::Thread;
use std::time::{Duration, Instant};

use comm_core::handle::Poison;
use comm_core::{CommError, Completer, Work};

use crate::ffi::CommState;

/// A completer that either its owner or a deadline completes, whichever comes first.
pub(crate) struct Once<T> {
    slot: Arc<Mutex<Option<Completer<T>>>>,
    timer: Thread,
}

impl<T: Send + 'static> Once<T> {
    /// A pending `Work` that completes with [`CommError::Timeout`] about `what` unless the
    /// returned `Once` completes it first, within `timeout`.
    pub(crate) fn with_deadline(timeout: Duration, what: String) -> Result<(Once<T>, Work<T>), CommError> {
        let (done, work) = Work::pending();
        let slot = Arc::new(Mutex::new(Some(done)));
        let timer_slot = slot.clone();
        let start = Instant::now();
        let timer = std::thread::Builder::new()
            .name("comm-nccl-deadline".into())
            .spawn(move || loop {
                let mut guard = timer_slot.lock().unwrap_or_else(|p| p.into_inner());
                if guard.is_none() {
                    return;
                }
                let left = timeout.saturating_sub(start.elapsed());
                if left.is_zero() {
                    if let Some(c) = guard.take() {
                        c.complete(Err(CommError::timeout(
                            what,
                            timeout,
                            "not every rank got there in time (is every rank running, on its own GPU?)",
                        )));
                    }
                    return;
                }
                drop(guard);
                std::thread::park_timeout(left.min(Duration::from_millis(200)));
            })
            .map_err(|e| CommError::io("starting the nccl deadline thread", e))?;
        Ok((Once { slot, timer: timer.thread().clone() }, work))
    }

    /// Completes the work unless the deadline passed; returns whether this call completed it.
    pub(crate) fn complete(self, r: Result<T, CommError>) -> bool {
        let taken = self.slot.lock().unwrap_or_else(|p| p.into_inner()).take();
        self.timer.unpark();
        match taken {
            Some(c) => {
                c.complete(r);
                true
            }
            None => false,
        }
    }
}

/// Watches the worker's calls into NCCL and aborts a call blocked for longer than `timeout`.
pub(crate) fn watchdog(state: Arc<CommState>, timeout: Duration, poison: Poison, rank: u32) {
    let tick = (timeout / 4).clamp(Duration::from_millis(10), Duration::from_millis(500));
    let (mut last, mut since) = (state.seq(), Instant::now());
    while !state.is_gone() {
        std::thread::sleep(tick);
        let seq = state.seq();
        if seq != last {
            (last, since) = (seq, Instant::now());
            continue;
        }
        if seq % 2 == 1 && since.elapsed() > timeout && state.abort_if_stuck(seq) {
            let cause = format!("rank {rank}: a call into NCCL blocked for more than {timeout:?}; the watchdog aborted the communicator");
            tracing::error!(rank, "nccl: {cause}");
            poison.set(cause);
            return;
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadline_completes_once() {
        let (once, work) = Once::<u8>::with_deadline(Duration::from_millis(20), "test wait".into()).unwrap();
        let e = work.wait().unwrap_err();
        assert!(matches!(e, CommError::Timeout { .. }), "{e}");
        assert!(!once.complete(Ok(1)), "too late");

        let (once, work) = Once::<u8>::with_deadline(Duration::from_secs(60), "test wait".into()).unwrap();
        assert!(once.complete(Ok(7)));
        assert_eq!(work.wait().unwrap(), 7);
    }
}
