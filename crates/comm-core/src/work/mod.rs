use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use self::sync::{Arc, AtomicBool, Condvar, Mutex, MutexGuard, Ordering};
use crate::lane::CallerWait;
use crate::CommError;

mod combine;
use combine::{After, Join, Map};

/// The sync primitives of the completion slot: loom's under `--cfg loom`, so that
/// `tests/loom_work.rs` can explore every interleaving of completing, waiting and detaching.
mod sync {
    #[cfg(loom)]
    pub(super) use loom::sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Condvar, Mutex, MutexGuard,
    };
    #[cfg(not(loom))]
    pub(super) use std::sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Condvar, Mutex, MutexGuard,
    };
}

/// Completion handle of an op, like torch's `Work` for `async_op=True`.
///
/// The op was issued when the method that returned this handle returned (ops are *eager*);
/// the handle only reports completion. It is a [`Future`], can be polled with
/// [`is_completed`](Work::is_completed) and waited on with [`wait`](Work::wait).
/// Dropping it detaches: the op still completes, nothing is cancelled.
///
/// ```
/// use comm_core::{Work, CommError};
/// let (done, work) = Work::<u32>::pending();
/// assert!(!work.is_completed());
/// done.complete(Ok(7));
/// assert!(work.is_completed());
/// assert_eq!(work.wait().unwrap(), 7);
/// ```
#[must_use = "ops are issued eagerly; drop the Work explicitly to detach from the result"]
pub struct Work<T> {
    inner: Inner<T>,
    /// How long the first wait for a pending op polls its flag before sleeping
    /// ([`with_spin`](Work::with_spin)); zero once used.
    spin: Duration,
}

enum Inner<T> {
    Ready(Option<Result<T, CommError>>),
    Shared(Arc<Shared<T>>),
    Boxed(Box<dyn Source<T>>),
}

trait Source<T>: Send {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<T, CommError>>;
    fn is_completed(&self) -> bool;
    fn wait(&mut self) -> Result<T, CommError>;
    fn add_hook(&mut self, hook: Hook);
}

/// A completion hook: runs once, on the thread that completes the op.
type Hook = Box<dyn FnOnce(Completion<'_>) + Send>;

/// How an op ended, as seen by a hook registered with [`Work::on_complete`].
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct Completion<'a> {
    /// The op's error, `None` when it succeeded.
    pub error: Option<&'a CommError>,
    /// Whether the [`Work`] had been dropped before the op completed (a detached op).
    pub detached: bool,
}

struct Shared<T> {
    done: AtomicBool,
    slot: Mutex<Slot<T>>,
    cond: Condvar,
}

struct Slot<T> {
    result: Option<Result<T, CommError>>,
    waker: Option<Waker>,
    taken: bool,
    hook: Option<Hook>,
    /// Where the result goes instead of `result` ([`Work::forward`]).
    forward: Option<Completer<T>>,
    /// A thread sleeps in [`Work::wait`] (set under the lock before it sleeps).
    waiting: bool,
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, Slot<T>> {
        // A panic while holding this lock cannot leave the slot inconsistent (plain assignments).
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn take(&self, mut slot: MutexGuard<'_, Slot<T>>) -> Result<T, CommError> {
        slot.taken = true;
        slot.result
            .take()
            .unwrap_or_else(|| Err(CommError::invalid("Work", "result already taken (Work polled after completion)")))
    }
}

impl<T: Send + 'static> Work<T> {
    /// A handle that is already complete, for ops that finish inline.
    pub fn ready(result: Result<T, CommError>) -> Self {
        Work { inner: Inner::Ready(Some(result)), spin: Duration::ZERO }
    }

    /// A pending handle and the [`Completer`] a backend uses to finish it.
    pub fn pending() -> (Completer<T>, Work<T>) {
        let shared = Arc::new(Shared {
            done: AtomicBool::new(false),
            slot: Mutex::new(Slot {
                result: None,
                waker: None,
                taken: false,
                hook: None,
                forward: None,
                waiting: false,
            }),
            cond: Condvar::new(),
        });
        (Completer { shared: Some(shared.clone()) }, Work { inner: Inner::Shared(shared), spin: Duration::ZERO })
    }

    /// Lets the first wait for this op (a poll that finds it pending, or [`wait`](Work::wait))
    /// poll its completion for up to `budget` before the task or thread sleeps. Waking a
    /// sleeping thread takes several microseconds, more than a whole small op on a backend
    /// that completes ops on its own thread; a backend sets this for ops that usually end
    /// within `budget`, and only where the caller's spinning cannot take the core its worker
    /// needs. The spinning happens once per op and blocks the polling thread (the runtime's
    /// other tasks on it included) for at most `budget`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use comm_core::Work;
    /// let (done, work) = Work::<u8>::pending();
    /// let work = work.with_spin(Duration::from_micros(50));
    /// std::thread::spawn(move || done.complete(Ok(5)));
    /// assert_eq!(work.wait().unwrap(), 5);
    /// ```
    pub fn with_spin(mut self, budget: Duration) -> Self {
        self.spin = budget;
        self
    }

    /// Whether the op has finished (successfully or not). Never blocks.
    pub fn is_completed(&self) -> bool {
        match &self.inner {
            Inner::Ready(_) => true,
            Inner::Shared(s) => s.done.load(Ordering::Acquire),
            Inner::Boxed(b) => b.is_completed(),
        }
    }

    /// How the op ended, if it finished inline (the backend returned a [`Work::ready`]);
    /// `None` for an op still running or completed by another thread. Lets observers such as
    /// the profiling layer handle the common inline case without registering a hook.
    ///
    /// ```
    /// use comm_core::{CommError, Work};
    /// assert!(Work::ready(Ok(1u8)).inline_completion().is_some_and(|c| c.error.is_none()));
    /// let failed = Work::<u8>::ready(Err(CommError::Shutdown("gone".into())));
    /// assert!(failed.inline_completion().is_some_and(|c| c.error.is_some()));
    /// assert!(Work::<u8>::pending().1.inline_completion().is_none());
    /// ```
    pub fn inline_completion(&self) -> Option<Completion<'_>> {
        match &self.inner {
            Inner::Ready(r) => Some(Completion { error: r.as_ref().and_then(|r| r.as_ref().err()), detached: false }),
            _ => None,
        }
    }

    /// Blocks the calling thread until the op completes and returns its result.
    ///
    /// Backends progress ops on their own threads, so this never needs the async runtime to
    /// make progress and cannot deadlock it; but like tokio's `blocking_recv` it does block the
    /// calling thread, so inside async code prefer `.await`.
    pub fn wait(self) -> Result<T, CommError> {
        match self.inner {
            Inner::Ready(mut r) => r.take().expect("Ready work holds its result until taken"),
            Inner::Shared(s) => {
                spin_until(&s.done, self.spin);
                let mut slot = s.lock();
                while slot.result.is_none() && !slot.taken {
                    slot.waiting = true;
                    slot = s.cond.wait(slot).unwrap_or_else(|e| e.into_inner());
                }
                s.take(slot)
            }
            Inner::Boxed(mut b) => b.wait(),
        }
    }

    /// Calls `hook` once when the op completes: at once if it already has, otherwise on the
    /// thread that completes it (often the backend's worker), *before* the result is handed
    /// to whoever waits on this `Work`. The hook still runs when this `Work` is dropped first
    /// (the op completes anyway; [`Completion::detached`] says so), so observers such as the
    /// profiling layer see the op's true end without polling or blocking on it.
    ///
    /// The hook must be quick and must not block: it delays the completion of later ops of
    /// the same worker. Several hooks run in the order they were added.
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use comm_core::Work;
    /// let seen = Arc::new(Mutex::new(None));
    /// let (done, work) = Work::<u8>::pending();
    /// let s = seen.clone();
    /// let work = work.on_complete(move |c| *s.lock().unwrap() = Some(c.detached));
    /// drop(work); // detach: the op still completes, and the hook still runs
    /// done.complete(Ok(1));
    /// assert_eq!(*seen.lock().unwrap(), Some(true));
    /// ```
    pub fn on_complete(mut self, hook: impl FnOnce(Completion<'_>) + Send + 'static) -> Self {
        match &self.inner {
            // Ops that finished inline: no box, no lock (the profiling layer's hot path).
            Inner::Ready(r) => hook(Completion { error: r.as_ref().and_then(|r| r.as_ref().err()), detached: false }),
            _ => self.add_hook(Box::new(hook)),
        }
        self
    }

    fn add_hook(&mut self, hook: Hook) {
        match &mut self.inner {
            Inner::Ready(r) => hook(Completion { error: r.as_ref().and_then(|r| r.as_ref().err()), detached: false }),
            Inner::Shared(s) => {
                let mut slot = s.lock();
                if slot.result.is_some() || slot.taken {
                    let error = slot.result.as_ref().and_then(|r| r.as_ref().err());
                    hook(Completion { error, detached: false });
                } else {
                    slot.hook = Some(match slot.hook.take() {
                        None => hook,
                        Some(first) => Box::new(move |c| {
                            first(c);
                            hook(c);
                        }),
                    });
                }
            }
            Inner::Boxed(b) => b.add_hook(hook),
        }
    }

    /// Completes `to` with this op's result once it has one, on the thread that completes this
    /// op (or at once): for a layer that hands out its own [`Work`] before the op it forwards
    /// to was issued. Handles built with [`map`](Work::map) or [`join_all`](Work::join_all)
    /// are waited on by a helper thread.
    ///
    /// ```
    /// use comm_core::Work;
    /// let (outer_done, outer) = Work::<u8>::pending();
    /// let (inner_done, inner) = Work::<u8>::pending();
    /// inner.forward(outer_done);
    /// assert!(!outer.is_completed());
    /// inner_done.complete(Ok(3));
    /// assert_eq!(outer.wait().unwrap(), 3);
    /// ```
    pub fn forward(self, to: Completer<T>) {
        match self.inner {
            Inner::Ready(mut r) => to.complete(r.take().expect("Ready work holds its result until taken")),
            Inner::Shared(s) => {
                let mut slot = s.lock();
                match slot.result.take() {
                    Some(r) => {
                        slot.taken = true;
                        drop(slot);
                        to.complete(r);
                    }
                    None => slot.forward = Some(to),
                }
            }
            Inner::Boxed(mut b) => {
                let spawned = std::thread::Builder::new().name("comm-work-forward".into()).spawn(move || {
                    to.complete(b.wait());
                });
                // Without a thread the completer is dropped: the forwarded Work reports Shutdown.
                drop(spawned);
            }
        }
    }

    /// A handle whose result is `f` applied to this one's.
    pub fn map<U: Send + 'static>(self, f: impl FnOnce(T) -> U + Send + 'static) -> Work<U> {
        self.and_then(move |t| Ok(f(t)))
    }

    /// One handle for several ops (issued already, like every op): its result is every
    /// result in order, or the first error in order. A hook on it runs once all have ended.
    ///
    /// ```
    /// use comm_core::Work;
    /// let (a, wa) = Work::<u8>::pending();
    /// let both = Work::join_all(vec![wa, Work::ready(Ok(2))]);
    /// assert!(!both.is_completed());
    /// a.complete(Ok(1));
    /// assert_eq!(both.wait().unwrap(), vec![1, 2]);
    /// ```
    pub fn join_all(works: Vec<Work<T>>) -> Work<Vec<T>> {
        let results = works.iter().map(|_| None).collect();
        Work { inner: Inner::Boxed(Box::new(Join { works, results })), spin: Duration::ZERO }
    }

    /// A handle whose result is `f` applied to this one's successful result.
    pub fn and_then<U: Send + 'static>(self, f: impl FnOnce(T) -> Result<U, CommError> + Send + 'static) -> Work<U> {
        self.then(move |r| r.and_then(f))
    }

    /// A handle whose error is `f` applied to this one's (a success passes through).
    ///
    /// ```
    /// use comm_core::{CommError, Work};
    /// let w = Work::<u8>::ready(Err(CommError::Shutdown("gone".into())));
    /// let w = w.map_err(|e| CommError::Shutdown(format!("{e}; and more")));
    /// assert!(w.wait().unwrap_err().to_string().contains("and more"));
    /// ```
    pub fn map_err(self, f: impl FnOnce(CommError) -> CommError + Send + 'static) -> Work<T> {
        self.then(move |r| r.map_err(f))
    }

    /// This op's handle that also reports `first`, an op issued before it: its result is
    /// `first`'s error as soon as `first` failed (this op then runs on, detached), else this
    /// op's result (a hook on it reports this op). `is_completed` says true once both ended.
    ///
    /// ```
    /// use comm_core::{CommError, Work};
    /// let (check, first) = Work::<()>::pending();
    /// let both = Work::ready(Ok(5u8)).after(first);
    /// assert!(!both.is_completed());
    /// check.complete(Err(CommError::mismatch("all_gather", "ranks differ")));
    /// assert!(matches!(both.wait(), Err(CommError::Mismatch { .. })));
    /// ```
    pub fn after(self, first: Work<()>) -> Work<T> {
        match first.inline_completion() {
            Some(c) if c.error.is_none() => self,
            _ => Work { inner: Inner::Boxed(Box::new(After { first: Some(first), work: self })), spin: Duration::ZERO },
        }
    }

    fn then<U: Send + 'static>(
        self,
        f: impl FnOnce(Result<T, CommError>) -> Result<U, CommError> + Send + 'static,
    ) -> Work<U> {
        match self.inner {
            Inner::Ready(mut r) => Work::ready(f(r.take().expect("Ready work holds its result"))),
            _ => Work { inner: Inner::Boxed(Box::new(Map { work: self, f: Some(f) })), spin: Duration::ZERO },
        }
    }
}

impl<T: Send + 'static> Future for Work<T> {
    type Output = Result<T, CommError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        match &mut this.inner {
            Inner::Ready(r) => {
                Poll::Ready(r.take().unwrap_or_else(|| Err(CommError::invalid("Work", "polled after completion"))))
            }
            Inner::Shared(s) => {
                spin_until(&s.done, std::mem::take(&mut this.spin));
                let mut slot = s.lock();
                if slot.result.is_some() || slot.taken {
                    return Poll::Ready(s.take(slot));
                }
                match &slot.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => slot.waker = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
            Inner::Boxed(b) => b.poll(cx),
        }
    }
}

impl<T> Unpin for Work<T> {}

impl<T> fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let done = match &self.inner {
            Inner::Ready(_) => true,
            Inner::Shared(s) => s.done.load(Ordering::Acquire),
            Inner::Boxed(b) => b.is_completed(),
        };
        f.debug_struct("Work").field("completed", &done).finish()
    }
}

/// Polls `done` for up to `budget` (see [`Work::with_spin`]).
fn spin_until(done: &AtomicBool, budget: Duration) {
    if budget.is_zero() || cfg!(loom) {
        return;
    }
    // A caller's wait like any other, without the yielding: a parked thread is woken anyway.
    let wait = CallerWait { spin: budget, then_yield: Duration::ZERO, share: usize::MAX };
    wait.wait(|_| done.load(Ordering::Acquire).then_some(()));
}

/// The backend's side of a [`Work`]: completes it exactly once.
///
/// Dropping a `Completer` without completing it completes the `Work` with
/// [`CommError::Shutdown`], so a waiter never hangs on a worker that went away.
pub struct Completer<T> {
    shared: Option<Arc<Shared<T>>>,
}

impl<T> Completer<T> {
    /// Finish the op with `result` and wake whoever waits on the `Work`.
    pub fn complete(mut self, result: Result<T, CommError>) {
        self.finish(result);
    }

    /// Whether the `Work` is still held by someone (it was not dropped/detached).
    pub fn is_observed(&self) -> bool {
        self.shared.as_ref().is_some_and(|s| Arc::strong_count(s) > 1)
    }

    fn finish(&mut self, result: Result<T, CommError>) {
        let Some(shared) = self.shared.take() else { return };
        let (waker, forward, waiting) = {
            let mut slot = shared.lock();
            if let Some(hook) = slot.hook.take() {
                // Under the lock, so a hook added concurrently is either taken here or sees the
                // result; only our `shared` is left when the `Work` is gone.
                hook(Completion { error: result.as_ref().err(), detached: Arc::strong_count(&shared) == 1 });
            }
            let forward = match slot.forward.take() {
                Some(to) => {
                    slot.taken = true;
                    Some((to, result))
                }
                None => {
                    slot.result = Some(result);
                    None
                }
            };
            shared.done.store(true, Ordering::Release);
            (slot.waker.take(), forward, slot.waiting)
        };
        // Only when a thread sleeps in `wait`: std's notify is a futex syscall even with no
        // waiter, a good part of an op that completes on its caller's thread.
        if waiting {
            shared.cond.notify_all();
        }
        if let Some(w) = waker {
            w.wake();
        }
        // Outside our lock: the target's completion may run hooks of its own.
        if let Some((to, result)) = forward {
            to.complete(result);
        }
    }
}

impl<T> Drop for Completer<T> {
    fn drop(&mut self) {
        if self.shared.is_some() {
            let e = if std::thread::panicking() {
                // The thread running the op panicked; the backend poisons the group with the
                // panic's message.
                CommError::Poisoned { cause: "the thread running this op panicked".into() }
            } else {
                CommError::Shutdown("the worker dropped the op before finishing it".into())
            };
            self.finish(Err(e));
        }
    }
}

impl<T> fmt::Debug for Completer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completer").field("pending", &self.shared.is_some()).finish()
    }
}

// Under loom the primitives only work inside `loom::model`: `tests/loom_work.rs` covers that.
#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn wait_blocks_until_completed_from_another_thread() {
        let (c, w) = Work::<Vec<u8>>::pending();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            c.complete(Ok(vec![1, 2]));
        });
        assert_eq!(w.wait().unwrap(), vec![1, 2]);
        t.join().unwrap();
    }

    #[test]
    fn dropped_completer_reports_shutdown() {
        let (c, w) = Work::<u8>::pending();
        drop(c);
        assert!(w.is_completed());
        assert!(matches!(w.wait(), Err(CommError::Shutdown(_))));
    }

    #[test]
    fn completer_dropped_by_a_panic_reports_poisoned() {
        let (c, w) = Work::<u8>::pending();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _held = c;
            panic!("boom");
        }));
        assert!(r.is_err());
        assert!(matches!(w.wait(), Err(CommError::Poisoned { .. })));
    }

    #[tokio::test]
    async fn join_all_waits_for_every_op_and_keeps_order() {
        let (a, wa) = Work::<u8>::pending();
        let (b, wb) = Work::<u8>::pending();
        let joined = Work::join_all(vec![wa, wb]);
        let seen = Arc::new(Mutex::new(0));
        let s = seen.clone();
        let joined = joined.on_complete(move |_| *s.lock().unwrap() += 1);
        b.complete(Ok(2));
        assert!(!joined.is_completed());
        assert_eq!(*seen.lock().unwrap(), 0, "the hook waits for the last op");
        a.complete(Ok(1));
        assert!(joined.is_completed());
        assert_eq!(*seen.lock().unwrap(), 1);
        assert_eq!(joined.await.unwrap(), vec![1, 2]);
        let (c, wc) = Work::<u8>::pending();
        let failed = Work::join_all(vec![Work::ready(Err(CommError::Shutdown("x".into()))), wc]);
        c.complete(Ok(3));
        assert!(matches!(failed.wait(), Err(CommError::Shutdown(_))));
        assert_eq!(Work::<u8>::join_all(Vec::new()).wait().unwrap(), Vec::<u8>::new());
    }

    #[test]
    fn dropping_work_detaches() {
        let (c, w) = Work::<u8>::pending();
        assert!(c.is_observed());
        drop(w);
        assert!(!c.is_observed());
        c.complete(Ok(1)); // no panic, nobody listening
    }

    #[tokio::test]
    async fn await_and_map() {
        let (c, w) = Work::<u32>::pending();
        let w = w.map(|x| x * 2);
        assert!(!w.is_completed());
        tokio::spawn(async move { c.complete(Ok(21)) });
        assert_eq!(w.await.unwrap(), 42);
        let w = Work::ready(Ok(1u8)).and_then(|_| Err::<u8, _>(CommError::Shutdown(String::new())));
        assert!(w.await.is_err());
    }

    fn recorder() -> (Arc<Mutex<Vec<String>>>, impl Fn(&'static str) -> Hook) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let l = log.clone();
        let make = move |name: &'static str| -> Hook {
            let l = l.clone();
            Box::new(move |c: Completion<'_>| {
                let err = c.error.map(|e| e.to_string()).unwrap_or_default();
                l.lock().unwrap().push(format!("{name} detached={} err={err}", c.detached));
            })
        };
        (log, make)
    }

    #[test]
    fn hooks_run_at_completion_in_order() {
        let (log, hook) = recorder();
        // Already complete: at once.
        let w = Work::ready(Err::<u8, _>(CommError::Shutdown("gone".into()))).on_complete(hook("ready"));
        assert_eq!(log.lock().unwrap().as_slice(), ["ready detached=false err=process group has been shut down: gone"]);
        drop(w);
        // Pending: on the completing side, before the waiter gets the result; two hooks in order.
        let (c, w) = Work::<u8>::pending();
        let w = w.on_complete(hook("a")).on_complete(hook("b"));
        assert_eq!(log.lock().unwrap().len(), 1);
        c.complete(Ok(5));
        assert_eq!(log.lock().unwrap()[1..], ["a detached=false err=", "b detached=false err="]);
        assert_eq!(w.wait().unwrap(), 5);
        // Completed but not yet taken: at once.
        let (c, w) = Work::<u8>::pending();
        c.complete(Ok(1));
        let _w = w.on_complete(hook("late"));
        assert_eq!(log.lock().unwrap()[3], "late detached=false err=");
    }

    #[test]
    fn hooks_see_detached_ops_and_dropped_completers() {
        let (log, hook) = recorder();
        let (c, w) = Work::<u8>::pending();
        drop(w.map(|x| x + 1).on_complete(hook("mapped")));
        assert!(log.lock().unwrap().is_empty(), "dropping the work does not complete the op");
        c.complete(Ok(1));
        assert_eq!(log.lock().unwrap()[0], "mapped detached=true err=");
        let (c, w) = Work::<u8>::pending();
        let w = w.on_complete(hook("orphan"));
        drop(c);
        assert!(log.lock().unwrap()[1].starts_with("orphan detached=false err=process group has been shut down"));
        assert!(w.wait().is_err());
    }

    #[test]
    fn futures_poll_registers_waker() {
        let (c, mut w) = Work::<u8>::pending();
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut w).poll(&mut cx).is_pending());
        c.complete(Ok(3));
        assert!(matches!(Pin::new(&mut w).poll(&mut cx), Poll::Ready(Ok(3))));
    }

    #[test]
    fn with_spin_takes_an_op_that_ends_within_the_budget_without_a_wake() {
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        // Completed by another thread during the first poll's spinning: ready at once, although
        // nothing will ever wake this task.
        let (c, w) = Work::<u8>::pending();
        let mut w = w.with_spin(Duration::from_secs(10));
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            c.complete(Ok(4));
        });
        let start = Instant::now();
        assert!(matches!(Pin::new(&mut w).poll(&mut cx), Poll::Ready(Ok(4))));
        assert!(start.elapsed() < Duration::from_secs(5), "the spinning stops when the op ends");
        t.join().unwrap();
        // Not completed within the budget: the first poll spins it out, later ones do not.
        let (c, w) = Work::<u8>::pending();
        let budget = Duration::from_millis(200);
        let mut w = w.with_spin(budget);
        let start = Instant::now();
        assert!(Pin::new(&mut w).poll(&mut cx).is_pending());
        assert!(start.elapsed() >= budget);
        let again = Instant::now();
        assert!(Pin::new(&mut w).poll(&mut cx).is_pending());
        assert!(again.elapsed() < budget, "spins once per op");
        c.complete(Ok(5));
        assert!(matches!(Pin::new(&mut w).poll(&mut cx), Poll::Ready(Ok(5))));
        // `wait` spins too, then sleeps until the op ends.
        let (c, w) = Work::<u8>::pending();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(40));
            c.complete(Ok(6));
        });
        assert_eq!(w.with_spin(Duration::from_millis(5)).wait().unwrap(), 6);
        t.join().unwrap();
    }

    #[test]
    fn forward_hands_over_results_whenever_they_come() {
        // Completed before forwarding, with an error.
        let (c, inner) = Work::<u8>::pending();
        c.complete(Err(CommError::Store("x".into())));
        let (to, outer) = Work::pending();
        inner.forward(to);
        assert!(matches!(outer.wait(), Err(CommError::Store(_))));
        // Forwarded first; the inner op's hooks still run, and its completer going away
        // reaches the outer work as a shutdown.
        let (log, hook) = recorder();
        let (c, inner) = Work::<u8>::pending();
        let (to, outer) = Work::pending();
        inner.on_complete(hook("inner")).forward(to);
        drop(c);
        assert!(matches!(outer.wait(), Err(CommError::Shutdown(_))));
        assert_eq!(log.lock().unwrap().len(), 1);
        // Ready and mapped handles.
        let (to, outer) = Work::pending();
        Work::ready(Ok(4u8)).forward(to);
        assert_eq!(outer.wait().unwrap(), 4);
        let (c, inner) = Work::<u8>::pending();
        let (to, outer) = Work::pending();
        inner.map(|x| x * 2).forward(to);
        c.complete(Ok(5));
        assert_eq!(outer.wait().unwrap(), 10);
    }
}
