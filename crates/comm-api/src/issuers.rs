//! The check that one task issues a group's ops: ops of one group (or stream) are matched
//! across ranks by their order, and two tasks issuing at once interleave differently on each
//! rank, so same-shaped ops pair with the wrong ones and nothing can tell. The facade sees it
//! happen: an op is issued while another task's op on the same group is still in flight.

use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};

use comm_core::{CommError, Work};

/// Bits of [`Issuers::state`] that count the ops in flight; the rest name their issuer.
const COUNT_BITS: u32 = 20;
const COUNT: u64 = (1 << COUNT_BITS) - 1;

/// Who issues an op: the tokio task, or the thread outside tokio, as a number (a task's id
/// or a thread's, times two, plus one for a thread), cut to the bits above the count.
fn current() -> u64 {
    /// Keeps the `u64` that `Id` and `ThreadId` hash as (their only field).
    struct Capture(u64);
    impl Hasher for Capture {
        fn finish(&self) -> u64 {
            self.0
        }
        fn write(&mut self, bytes: &[u8]) {
            self.0 = bytes.iter().fold(self.0, |h, &b| h.rotate_left(8) ^ u64::from(b));
        }
        fn write_u64(&mut self, x: u64) {
            self.0 = x;
        }
    }
    let mut h = Capture(0);
    let thread = match tokio::task::try_id() {
        Some(id) => {
            id.hash(&mut h);
            0
        }
        None => {
            std::thread::current().id().hash(&mut h);
            1
        }
    };
    ((h.0 << 1) | thread) & (u64::MAX >> COUNT_BITS)
}

fn describe(issuer: u64) -> String {
    match issuer & 1 {
        0 => format!("tokio task {}", issuer >> 1),
        _ => format!("thread {}", issuer >> 1),
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
    /// The issuer (high bits) and how many of its ops are in flight, from issue to
    /// completion (low [`COUNT_BITS`]): one word, so the check costs one compare-and-swap.
    state: AtomicU64,
    warned: AtomicBool,
}

impl Issuers {
    /// Counts an op of the current issuer in flight, or refuses it (strict mode) when another
    /// issuer's op is.
    pub(crate) fn enter(self: &Arc<Self>, op: &'static str) -> Result<Entered, CommError> {
        let me = current();
        let mut now = self.state.load(Relaxed);
        loop {
            let (who, n) = (now >> COUNT_BITS, now & COUNT);
            let next = match n {
                0 => (me << COUNT_BITS) | 1,
                // Past a million ops in flight, the rest go uncounted.
                COUNT if who == me => return Ok(Entered(None)),
                _ if who == me => now + 1,
                _ => return self.refuse(op, me, who),
            };
            match self.state.compare_exchange_weak(now, next, Relaxed, Relaxed) {
                Ok(_) => return Ok(Entered(Some(self.clone()))),
                Err(seen) => now = seen,
            }
        }
    }

    fn refuse(&self, op: &'static str, me: u64, other: u64) -> Result<Entered, CommError> {
        let reason = format!(
            "{} issued {op} on a group (or stream) while {} had an op in flight on it: ops of one group \
             are matched across ranks by their order, which two tasks issuing at once make differ between \
             ranks (ops then pair with the wrong ones). Give each task its own stream \
             (`pg.streams().await?.stream(key)`), or order the ops yourself",
            describe(me),
            describe(other)
        );
        if strict() {
            return Err(CommError::InvalidArgument { op, reason: reason + " (COMM_STRICT=1)" });
        }
        if !self.warned.swap(true, Relaxed) {
            tracing::warn!(target: "comm", "{reason} (COMM_STRICT=1 makes this an error; warned once per group)");
        }
        Ok(Entered(None))
    }

    fn leave(&self) {
        self.state.fetch_sub(1, Relaxed);
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
