//! The one lane every op of a hierarchical group (and of its sub-groups) goes through, so that
//! every rank hands its inner groups their ops in one order: ARCHITECTURE.md, "Several hosts
//! (hier)", 1. and "Ordering". Inner groups progress their own ops, so a straight op in flight
//! never holds up the lane.

use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;

use comm_core::handle::Poison;
use comm_core::lane::{self, Backlog, Class, LaneState, Ran};
use comm_core::{CommError, Work};

/// What an op did on the lane.
pub enum Issued<T> {
    /// It ran to the end (through the hierarchy).
    Done(Result<T, CommError>),
    /// It was issued to an inner group, which completes it.
    Straight(Work<T>),
}

type Job = Box<dyn FnOnce() + Send>;

/// The lane's state: inner groups keep their own, so only the order is the lane's.
struct Order {
    poison: Poison,
}

impl LaneState for Order {
    fn is_idle(&self, _: Class, backlog: &Backlog) -> bool {
        backlog.any() == 0
    }

    fn contain_panic(&mut self, message: &str) {
        self.poison.set(format!("a hier op panicked: {message}"));
    }
}

/// See the module docs.
pub(crate) struct Lane {
    tx: Sender<Job>,
    lane: Arc<lane::Lane<Order>>,
}

impl Lane {
    /// Starts the lane's thread; `name` names it.
    pub(crate) fn start(name: String, poison: Poison) -> Result<Lane, CommError> {
        let (tx, rx) = channel::<Job>();
        // Hier ops wait on inner groups, which spin themselves: no budget here.
        let lane =
            Arc::new(lane::Lane::new(Order { poison: poison.clone() }, Arc::default(), poison, Default::default()));
        let queued = lane.backlog().clone();
        std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                // Ends when every handle of the group is gone (the channel disconnects).
                while let Ok(job) = rx.recv() {
                    job();
                    queued.done(Class::Collective);
                }
            })
            .map_err(|e| CommError::io("starting the hier lane thread", e))?;
        Ok(Lane { tx, lane })
    }

    /// Runs `op` on the lane in program order: on this thread if `inline` allows and the lane
    /// is idle, else on the lane's thread.
    pub(crate) fn run<T: Send + 'static>(
        &self,
        inline: bool,
        op: impl FnOnce() -> Issued<T> + Send + 'static,
    ) -> Work<T> {
        let op = match inline {
            true => match self.lane.try_inline(Class::Collective, op, |_, op, _| op()) {
                Ok(Ran { out, .. }) => return issued(out),
                Err(op) => op,
            },
            false => op,
        };
        let (done, work) = Work::pending();
        self.lane.backlog().add(Class::Collective);
        let lane = self.lane.clone();
        let job: Job = Box::new(move || {
            issued(lane.run_locked(|_| op())).forward(done);
        });
        if self.tx.send(job).is_err() {
            // The thread is gone: the job (and its completer) is dropped, the work says so.
            self.lane.backlog().done(Class::Collective);
        }
        work
    }
}

/// The work of what an op did on the lane (a panic: `Poisoned`).
fn issued<T: Send + 'static>(out: Result<Issued<T>, CommError>) -> Work<T> {
    match out {
        Ok(Issued::Done(r)) => Work::ready(r),
        Ok(Issued::Straight(w)) => w,
        Err(e) => Work::ready(Err(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
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
