//! The one lane every op of a hierarchical group (and of its sub-groups) goes through, so that
//! every rank hands its inner groups their ops in one order.
//!
//! An op either runs *through the hierarchy* (its phases are inner ops issued and waited for
//! one after another) or goes *straight* to an inner group (issued, not waited for). Ops take
//! the lane in program order: on the caller's thread when the lane is idle (small ops and
//! straight ops: no hand-off), else queued for the lane's thread. Inner groups progress their
//! own ops, so a straight op in flight never holds up the lane.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};

use comm_core::handle::Poison;
use comm_core::{CommError, Work};

/// What an op did on the lane.
pub enum Issued<T> {
    /// It ran to the end (through the hierarchy).
    Done(Result<T, CommError>),
    /// It was issued to an inner group, which completes it.
    Straight(Work<T>),
}

type Job = Box<dyn FnOnce() + Send>;

struct Shared {
    /// Held while an op runs on the lane, by the lane's thread or an inline caller.
    running: Mutex<()>,
    /// Ops queued and not yet finished: an inline caller must find none.
    queued: AtomicUsize,
    poison: Poison,
}

/// See the module docs.
pub(crate) struct Lane {
    tx: Mutex<Sender<Job>>,
    shared: Arc<Shared>,
}

impl Lane {
    /// Starts the lane's thread; `name` names it.
    pub(crate) fn start(name: String, poison: Poison) -> Result<Lane, CommError> {
        let (tx, rx) = channel::<Job>();
        let shared = Arc::new(Shared { running: Mutex::new(()), queued: AtomicUsize::new(0), poison });
        let s = shared.clone();
        std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                // Ends when every handle of the group is gone (the channel disconnects).
                while let Ok(job) = rx.recv() {
                    let _running = s.running.lock().unwrap_or_else(|p| p.into_inner());
                    // Jobs contain their op's panics (`guarded`); this is for the rest of the job.
                    if let Err(p) = catch_unwind(AssertUnwindSafe(job)) {
                        s.poison.set(format!("the hier lane panicked: {}", panic_message(&*p)));
                    }
                    s.queued.fetch_sub(1, SeqCst);
                }
            })
            .map_err(|e| CommError::Io { context: "starting the hier lane thread".into(), source: e })?;
        Ok(Lane { tx: Mutex::new(tx), shared })
    }

    /// Runs `op` on the lane in program order: on this thread if `inline` allows and the lane
    /// is idle, else on the lane's thread.
    pub(crate) fn run<T: Send + 'static>(
        &self,
        inline: bool,
        op: impl FnOnce() -> Issued<T> + Send + 'static,
    ) -> Work<T> {
        if inline && self.shared.queued.load(SeqCst) == 0 {
            if let Ok(_running) = self.shared.running.try_lock() {
                // Checked again under the lock: an op queued meanwhile goes first.
                if self.shared.queued.load(SeqCst) == 0 {
                    return match guarded(&self.shared.poison, op) {
                        Issued::Done(r) => Work::ready(r),
                        Issued::Straight(w) => w,
                    };
                }
            }
        }
        let (done, work) = Work::pending();
        self.shared.queued.fetch_add(1, SeqCst);
        let poison = self.shared.poison.clone();
        let job: Job = Box::new(move || match guarded(&poison, op) {
            Issued::Done(r) => done.complete(r),
            Issued::Straight(w) => w.forward(done),
        });
        if self.tx.lock().unwrap_or_else(|p| p.into_inner()).send(job).is_err() {
            // The thread is gone: the job (and its completer) is dropped, the work says so.
            self.shared.queued.fetch_sub(1, SeqCst);
        }
        work
    }
}

/// Runs `op`; a panic poisons the group (before the op reports it) and fails the op.
fn guarded<T>(poison: &Poison, op: impl FnOnce() -> Issued<T>) -> Issued<T> {
    catch_unwind(AssertUnwindSafe(op)).unwrap_or_else(|p| {
        let cause = format!("a hier op panicked: {}", panic_message(&*p));
        poison.set(cause.clone());
        Issued::Done(Err(CommError::Poisoned { cause }))
    })
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn idle_lanes_run_inline_and_busy_ones_queue_in_order() {
        let lane = Lane::start("test-lane".into(), Poison::new()).unwrap();
        let here = std::thread::current().id();
        let w = lane.run(true, move || Issued::Done(Ok(std::thread::current().id() == here)));
        assert!(w.is_completed() && w.wait().unwrap(), "an idle lane runs inline");
        let order = Arc::new(Mutex::new(Vec::new()));
        let o = order.clone();
        let slow = lane.run(false, move || {
            std::thread::sleep(Duration::from_millis(50));
            o.lock().unwrap().push(1);
            Issued::Done(Ok(()))
        });
        let o = order.clone();
        // Inline is allowed but the lane is busy: this one queues behind the first.
        let next = lane.run(true, move || {
            o.lock().unwrap().push(2);
            Issued::Done(Ok(()))
        });
        next.wait().unwrap();
        slow.wait().unwrap();
        assert_eq!(*order.lock().unwrap(), [1, 2]);
    }

    #[test]
    fn straight_ops_are_forwarded_and_panics_poison() {
        let poison = Poison::new();
        let lane = Lane::start("test-lane".into(), poison.clone()).unwrap();
        let (done, inner) = Work::pending();
        let w = lane.run(false, move || Issued::Straight(inner));
        done.complete(Ok(5u8));
        assert_eq!(w.wait().unwrap(), 5);
        let w = lane.run(false, || -> Issued<()> { panic!("boom") });
        assert!(matches!(w.wait(), Err(CommError::Poisoned { .. })));
        assert!(poison.cause().is_some_and(|c| c.contains("boom")), "{:?}", poison.cause());
        let w = lane.run(true, || -> Issued<()> { panic!("bang") });
        assert!(matches!(w.wait(), Err(CommError::Poisoned { .. })));
    }
}
