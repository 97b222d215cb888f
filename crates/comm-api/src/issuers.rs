//! The check that one task issues a group's ops: ops of one group (or stream) are matched
//! across ranks by their order, and two tasks issuing at once interleave differently on each
//! rank, so same-shaped ops pair with the wrong ones and nothing can tell. The facade sees it
//! happen: an op is issued while another task's op on the same group is still in flight.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};

use comm_core::{CommError, Work};

/// Who issues an op: the tokio task, or the thread outside tokio.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Issuer {
    Task(tokio::task::Id),
    Thread(std::thread::ThreadId),
}

impl Issuer {
    fn current() -> Issuer {
        match tokio::task::try_id() {
            Some(id) => Issuer::Task(id),
            None => Issuer::Thread(std::thread::current().id()),
        }
    }
}

impl std::fmt::Display for Issuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Issuer::Task(id) => write!(f, "tokio task {id}"),
            Issuer::Thread(id) => write!(f, "thread {id:?}"),
        }
    }
}

/// Whether a second issuer is an error (`COMM_STRICT=1`; the default in debug builds) or one
/// warning per group.
pub(crate) fn strict() -> bool {
    static STRICT: OnceLock<bool> = OnceLock::new();
    *STRICT.get_or_init(|| match comm_core::config::env_var("COMM_STRICT") {
        Some(v) => comm_core::config::parse_bool(&v).unwrap_or_else(|why| {
            tracing::warn!(target: "comm", "COMM_STRICT={v:?}: {why}; using the default");
            cfg!(debug_assertions)
        }),
        None => cfg!(debug_assertions),
    })
}

/// The issuer of the ops in flight on one group (or stream), shared by its clones.
#[derive(Debug, Default)]
pub(crate) struct Issuers {
    /// The issuer and how many of its ops are in flight (from issue to completion).
    in_flight: Mutex<Option<(Issuer, usize)>>,
    warned: AtomicBool,
}

impl Issuers {
    /// Counts an op of the current issuer in flight, or refuses it (strict mode) when another
    /// issuer's op is.
    pub(crate) fn enter(self: &Arc<Self>, op: &'static str) -> Result<Entered, CommError> {
        let me = Issuer::current();
        let mut slot = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        match &mut *slot {
            Some((who, n)) if *who == me => *n += 1,
            Some((other, _)) => {
                let other = *other;
                drop(slot);
                let reason = format!(
                    "{me} issued {op} on a group (or stream) while {other} had an op in flight on it: ops of \
                     one group are matched across ranks by their order, which two tasks issuing at once make \
                     differ between ranks (ops then pair with the wrong ones). Give each task its own stream \
                     (`pg.streams().await?.stream(key)`), or order the ops yourself"
                );
                if strict() {
                    return Err(CommError::InvalidArgument { op, reason: reason + " (COMM_STRICT=1)" });
                }
                if !self.warned.swap(true, Relaxed) {
                    tracing::warn!(target: "comm", "{reason} (COMM_STRICT=1 makes this an error; warned once per group)");
                }
                return Ok(Entered(None));
            }
            None => *slot = Some((me, 1)),
        }
        Ok(Entered(Some(self.clone())))
    }

    fn leave(&self) {
        let mut slot = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, n)) = &mut *slot {
            *n -= 1;
            if *n == 0 {
                *slot = None;
            }
        }
    }
}

/// An op counted in flight until its work completes.
pub(crate) struct Entered(Option<Arc<Issuers>>);

impl Entered {
    pub(crate) fn until<T: Send + 'static>(self, work: Work<T>) -> Work<T> {
        match self.0 {
            Some(issuers) => work.on_complete(move |_| issuers.leave()),
            None => work,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_thread_may_have_many_ops_in_flight_and_another_is_refused() {
        let issuers = Arc::new(Issuers::default());
        let (a, wa) = Work::<u8>::pending();
        let (b, wb) = Work::<u8>::pending();
        let wa = issuers.enter("x").unwrap().until(wa);
        let wb = issuers.enter("x").unwrap().until(wb);
        let other = || {
            let issuers = issuers.clone();
            let done = move || issuers.enter("all_reduce").map(|e| drop(e.until(Work::ready(Ok(0u8)))));
            std::thread::spawn(done).join().unwrap()
        };
        if strict() {
            let e = other().unwrap_err().to_string();
            assert!(e.contains("all_reduce") && e.contains("stream") && e.contains("in flight"), "{e}");
        }
        a.complete(Ok(1));
        assert!(other().is_err() || !strict(), "b still in flight");
        b.complete(Ok(2));
        assert_eq!((wa.wait().unwrap(), wb.wait().unwrap()), (1, 2));
        other().expect("nothing in flight: any issuer may go on");
    }
}
