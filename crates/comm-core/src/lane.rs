//! The lane: the gate every op of a group passes on its way to the group's worker.
//!
//! A backend keeps what its worker and its callers share (the mapped segments, the
//! communicator) behind a [`Lane`]. An op runs in one of two ways:
//! - **inline**, on the caller's thread, when the lane is free and idle for the op's
//!   [`Class`] ([`Lane::try_inline`]): no hand-off and no wake-up, which is what makes a small
//!   op cost microseconds instead of a thread round trip;
//! - **on the worker**, counted in [`Backlog`] from the moment it is handed over until the
//!   worker is done with it (a [`Ticket`], or [`Backlog::add`]/[`Backlog::done`]), so an inline
//!   caller never overtakes it.
//!
//! The rules every backend shares live here: the try-lock and the idle check, how a caller
//! waits for its peers ([`CallerWait`]), the worker's loop ([`run_worker`]), panic containment
//! (the group is poisoned with the panic's message, the op fails with `Poisoned`), and the
//! hand-over (whether the worker must go on with something an inline caller left). What the
//! worker does in a turn, and which ops may run inline, is the backend's.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use crate::handle::Poison;
use crate::{catch_panic, CommError};

/// The two orders ops keep: collectives among themselves, sends and receives among themselves
/// (a message never waits for a collective, nor a collective for a message).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// Collectives (and anything else that takes the group's steps).
    Collective,
    /// Sends and receives.
    P2p,
}

/// What a backend keeps behind its lane.
pub trait LaneState: Send {
    /// Whether an op of `class` may run on the caller's thread now: nothing it must follow
    /// is queued for the worker (`backlog`), parked or running.
    fn is_idle(&self, class: Class, backlog: &Backlog) -> bool;

    /// Whether the worker must go on with something an inline caller left (a parked op, a
    /// message still in flight): the backend wakes it when this is true after an inline op.
    fn wants_worker(&self) -> bool {
        false
    }

    /// A panic unwound out of an op running on the lane: poison the group with `message`
    /// (peers are told) and fail what the op left pending.
    fn contain_panic(&mut self, message: &str);
}

/// Ops handed to the worker and not yet done with, per [`Class`].
#[derive(Debug, Default)]
pub struct Backlog([AtomicUsize; 2]);

impl Backlog {
    /// Of `class`.
    pub fn of(&self, class: Class) -> usize {
        self.0[class as usize].load(SeqCst)
    }

    /// Of both classes.
    pub fn any(&self) -> usize {
        self.of(Class::Collective) + self.of(Class::P2p)
    }

    /// One more of `class` handed to the worker.
    pub fn add(&self, class: Class) {
        self.0[class as usize].fetch_add(1, SeqCst);
    }

    /// The worker is done with one of `class`.
    pub fn done(&self, class: Class) {
        // Saturating: a count never goes below zero, whatever a backend's bug.
        let _ = self.0[class as usize].fetch_update(SeqCst, SeqCst, |n| Some(n.saturating_sub(1)));
    }

    /// Counts an op of `class` until the ticket is dropped.
    pub fn ticket(self: &Arc<Self>, class: Class) -> Ticket {
        self.add(class);
        Ticket { backlog: self.clone(), class }
    }
}

/// An op counted in [`Backlog`] until this is dropped (by the worker, once done with it).
#[derive(Debug)]
pub struct Ticket {
    backlog: Arc<Backlog>,
    class: Class,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.backlog.done(self.class);
    }
}

/// Threads of this process in a spinning wait now, over every group and backend.
static SPINNING: AtomicUsize = AtomicUsize::new(0);

/// A spinning wait's claim on one of the CPUs this rank may call its own. Where that many
/// threads of the process spin already (several groups or streams waiting at once), one more
/// would only take the CPU that a peer's thread, or one of them, needs to arrive: it yields
/// between polls instead.
#[derive(Debug)]
pub struct SpinSlot(());

impl SpinSlot {
    /// A slot if fewer than `share` threads of this process spin now.
    pub fn try_take(share: usize) -> Option<SpinSlot> {
        if SPINNING.fetch_add(1, SeqCst) < share {
            Some(SpinSlot(()))
        } else {
            SPINNING.fetch_sub(1, SeqCst);
            None
        }
    }
}

impl Drop for SpinSlot {
    fn drop(&mut self) {
        SPINNING.fetch_sub(1, SeqCst);
    }
}

/// How a caller waits on its own thread for its peers before it leaves the op to the worker:
/// the one waiting policy of every backend's callers.
///
/// It spins for `spin` (a true spin: the peers run on other cores and arrive within
/// microseconds), then yields the core for `then_yield` (on a busy or small machine a peer may
/// need it, and parking costs two wake-ups, which would make the ranks alternate between
/// parking), then gives up. A wait that finds [`share`](CallerWait::share) threads of the
/// process spinning already yields from the start ([`SpinSlot`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct CallerWait {
    /// How long it spins (zero where ranks outnumber their CPUs: [`crate::handle::default_spin`]).
    pub spin: Duration,
    /// How long it yields after the spin.
    pub then_yield: Duration,
    /// How many threads of the process may spin at once.
    pub share: usize,
}

impl CallerWait {
    /// Polls until `poll` gives a value, or the wait's budget is spent (`None`). `poll` is told
    /// whether the spin is over (it may then end the wait by giving a value: there is no point
    /// in yielding for a peer that waits on us).
    #[inline]
    pub fn wait<T>(&self, mut poll: impl FnMut(bool) -> Option<T>) -> Option<T> {
        // Most waits end at their first poll: that one costs no more than the poll.
        match poll(false) {
            Some(t) => Some(t),
            None => self.keep_waiting(poll),
        }
    }

    #[cold]
    fn keep_waiting<T>(&self, mut poll: impl FnMut(bool) -> Option<T>) -> Option<T> {
        // The clock is first read after 64 polls, then every 64th, and the core is yielded only
        // then: a read costs as much as a few polls, and most waits end before (the spin starts
        // a few polls late). Without a spin every poll reads it and yields.
        let mut t0 = None;
        let mut polls = 0u32;
        let mut spin = self.spin;
        let mut yielding = false;
        // Taken at the first poll that fails: a wait whose peers are there costs nothing more.
        let mut slot: Option<Option<SpinSlot>> = None;
        loop {
            if slot.is_none() && !spin.is_zero() {
                let taken = SpinSlot::try_take(self.share);
                if taken.is_none() {
                    spin = Duration::ZERO;
                }
                slot = Some(taken);
            }
            polls = polls.wrapping_add(1);
            if !polls.is_multiple_of(64) && !spin.is_zero() {
                std::hint::spin_loop();
            } else {
                let waited = t0.get_or_insert_with(Instant::now).elapsed();
                if waited < spin {
                    std::hint::spin_loop();
                } else if waited < spin + self.then_yield {
                    yielding = true;
                    std::thread::yield_now();
                } else {
                    return None;
                }
            }
            if let Some(t) = poll(yielding) {
                return Some(t);
            }
        }
    }
}

/// What a turn of a worker's loop says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Turn {
    /// Go on.
    Again,
    /// The worker is done: the loop ends.
    Done,
}

impl Turn {
    /// The usual answer to a loop's `nth` panic: go on after the first (to fail what is pending
    /// and answer shutdown), end after the second.
    pub fn after_panic(nth: u32) -> Turn {
        if nth > 1 {
            Turn::Done
        } else {
            Turn::Again
        }
    }
}

/// A backend's worker thread, run by [`run_worker`]: what it does in one turn of its loop (take
/// commands, progress ops, sleep when there is nothing to do) and how it contains a panic.
pub trait Worker {
    /// One turn of the loop.
    fn turn(&mut self) -> Turn;

    /// The loop's `nth` panic (from 1) unwound out of a turn: poison what the worker serves
    /// with `message` (its ops fail with `Poisoned`, its peers are told), and say whether the
    /// loop goes on, to fail what is pending and answer shutdown, or ends.
    fn contain_panic(&mut self, message: &str, nth: u32) -> Turn;
}

/// The loop of every backend's worker thread: turns until one says [`Turn::Done`], a panic in
/// any of them contained by [`Worker::contain_panic`].
pub fn run_worker(worker: &mut impl Worker) {
    let mut panics = 0;
    loop {
        let turn = catch_panic(|| worker.turn()).unwrap_or_else(|message| {
            panics += 1;
            worker.contain_panic(&message, panics)
        });
        if turn == Turn::Done {
            return;
        }
    }
}

/// See the module docs.
#[derive(Debug)]
pub struct Lane<S> {
    state: Mutex<S>,
    backlog: Arc<Backlog>,
    poison: Poison,
    wait: CallerWait,
}

/// What an inline op did.
#[derive(Debug)]
pub struct Ran<T> {
    /// What it returned, or `Poisoned` if it panicked.
    pub out: Result<T, CommError>,
    /// Whether the worker must go on with something it left (see [`LaneState::wants_worker`]);
    /// always after a panic, so the worker fails what is pending.
    pub hand_over: bool,
}

impl<S: LaneState> Lane<S> {
    /// `backlog` is shared with the worker, which counts down what it takes; `wait` is how an
    /// inline caller waits for its peers before it leaves its op to the worker.
    pub fn new(state: S, backlog: Arc<Backlog>, poison: Poison, wait: CallerWait) -> Self {
        Lane { state: Mutex::new(state), backlog, poison, wait }
    }

    /// The ops queued for the worker.
    pub fn backlog(&self) -> &Arc<Backlog> {
        &self.backlog
    }

    /// The group's poison, which a contained panic sets.
    pub fn poison(&self) -> &Poison {
        &self.poison
    }

    /// How an inline caller waits for its peers.
    pub fn wait(&self) -> CallerWait {
        self.wait
    }

    /// The state, waiting for the lock (a panic while it was held is already contained).
    pub fn lock(&self) -> MutexGuard<'_, S> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The state if nobody holds it.
    pub fn try_lock(&self) -> Option<MutexGuard<'_, S>> {
        match self.state.try_lock() {
            Ok(g) => Some(g),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// Runs `f` with `x` on the caller's thread when the lane is free and idle for `class`,
    /// else hands `x` back. `f` gets the lane's [`CallerWait`]. A panic in `f` is contained.
    pub fn try_inline<X, T>(
        &self,
        class: Class,
        x: X,
        f: impl FnOnce(&mut S, X, CallerWait) -> T,
    ) -> Result<Ran<T>, X> {
        let Some(mut state) = self.try_lock() else { return Err(x) };
        if !state.is_idle(class, &self.backlog) {
            return Err(x);
        }
        let out = catch_panic(|| f(&mut state, x, self.wait)).map_err(|message| self.contain(&mut state, &message));
        let hand_over = out.is_err() || state.wants_worker();
        Ok(Ran { out, hand_over })
    }

    /// Runs `f` on the locked state, as the worker does; a panic in `f` is contained.
    pub fn run_locked<T>(&self, f: impl FnOnce(&mut S) -> T) -> Result<T, CommError> {
        let mut state = self.lock();
        catch_panic(|| f(&mut state)).map_err(|message| self.contain(&mut state, &message))
    }

    fn contain(&self, state: &mut S, message: &str) -> CommError {
        state.contain_panic(message);
        CommError::Poisoned { cause: self.poison.cause().unwrap_or_else(|| message.to_string()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct State {
        parked: bool,
        poison: Poison,
    }

    impl LaneState for State {
        fn is_idle(&self, class: Class, backlog: &Backlog) -> bool {
            backlog.of(class) == 0 && (class == Class::P2p || !self.parked)
        }
        fn wants_worker(&self) -> bool {
            self.parked
        }
        fn contain_panic(&mut self, message: &str) {
            self.poison.set(format!("contained: {message}"));
        }
    }

    fn lane() -> Lane<State> {
        let poison = Poison::new();
        let state = State { parked: false, poison: poison.clone() };
        Lane::new(state, Arc::default(), poison, CallerWait { spin: Duration::from_micros(7), ..CallerWait::default() })
    }

    #[test]
    fn idle_lanes_run_inline_and_queued_ones_do_not() {
        let lane = lane();
        let here = std::thread::current().id();
        let ran = lane.try_inline(Class::Collective, 1, |_, x, wait| (x, wait.spin, std::thread::current().id()));
        let Ran { out, hand_over } = ran.unwrap();
        assert_eq!(out.unwrap(), (1, Duration::from_micros(7), here));
        assert!(!hand_over);
        // A collective queued for the worker: the next one queues too, a message does not.
        let ticket = lane.backlog().ticket(Class::Collective);
        assert_eq!(lane.try_inline(Class::Collective, 2, |_, x, _| x).unwrap_err(), 2);
        assert!(lane.try_inline(Class::P2p, 3, |_, x, _| x).is_ok());
        drop(ticket);
        assert_eq!(lane.backlog().any(), 0);
        assert!(lane.try_inline(Class::Collective, 4, |_, x, _| x).is_ok());
        // Held by the worker: hands back.
        let held = lane.lock();
        assert_eq!(lane.try_inline(Class::P2p, 5, |_, x, _| x).unwrap_err(), 5);
        drop(held);
    }

    #[test]
    fn what_an_inline_op_leaves_goes_to_the_worker() {
        let lane = lane();
        let ran = lane.try_inline(Class::Collective, (), |s, (), _| s.parked = true).unwrap();
        assert!(ran.hand_over);
        // Parked: the next collective waits for the worker.
        assert!(lane.try_inline(Class::Collective, (), |_, (), _| ()).is_err());
    }

    #[test]
    fn panics_are_contained_and_poison() {
        let lane = lane();
        let ran = lane.try_inline(Class::Collective, (), |_, (), _| -> () { panic!("boom") }).unwrap();
        assert!(ran.hand_over);
        let Err(CommError::Poisoned { cause }) = ran.out else { panic!("{:?}", ran.out) };
        assert!(cause.contains("contained: boom"), "{cause}");
        let out = lane.run_locked(|_| -> () { panic!("bang") });
        assert!(matches!(out, Err(CommError::Poisoned { .. })));
        // The lock is usable after both.
        assert!(!lane.lock().parked);
    }

    #[test]
    fn a_worker_loop_contains_panics_and_ends_when_told() {
        struct Counting {
            turns: u32,
            contained: Vec<String>,
        }
        impl Worker for Counting {
            fn turn(&mut self) -> Turn {
                self.turns += 1;
                match self.turns {
                    2 | 4 => panic!("turn {}", self.turns),
                    _ => Turn::Again,
                }
            }
            fn contain_panic(&mut self, message: &str, nth: u32) -> Turn {
                self.contained.push(format!("{nth}: {message}"));
                if nth == 2 {
                    Turn::Done
                } else {
                    Turn::Again
                }
            }
        }
        let mut w = Counting { turns: 0, contained: Vec::new() };
        run_worker(&mut w);
        assert_eq!((w.turns, w.contained), (4, vec!["1: turn 2".to_string(), "2: turn 4".to_string()]));
    }

    #[test]
    fn spin_slots_are_shared_out() {
        // Other tests of this process may hold slots meanwhile: count from here.
        let a = SpinSlot::try_take(usize::MAX).unwrap();
        let held = SPINNING.load(SeqCst);
        assert!(SpinSlot::try_take(held - 1).is_none(), "all taken");
        let b = SpinSlot::try_take(held + 1);
        assert!(b.is_some());
        drop((a, b));
    }

    #[test]
    fn a_caller_spins_then_yields_then_gives_up() {
        let wait =
            CallerWait { spin: Duration::from_millis(2), then_yield: Duration::from_millis(3), share: usize::MAX };
        // Ready at once, and on the 1000th poll.
        assert_eq!(wait.wait(|_| Some(1)), Some(1));
        let mut n = 0;
        assert_eq!(
            wait.wait(|_| (n == 1000).then_some(n).or_else(|| {
                n += 1;
                None
            })),
            Some(1000)
        );
        // Never ready: it gives up once both budgets are spent, having yielded only after the spin.
        let start = Instant::now();
        let mut first_yield = None;
        assert_eq!(
            wait.wait(|y| {
                if y {
                    first_yield.get_or_insert_with(|| start.elapsed());
                }
                None::<()>
            }),
            None
        );
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(5), "{took:?}");
        assert!(first_yield.is_some_and(|t| t >= Duration::from_millis(2)), "{first_yield:?}");
        // A poll may end the wait once yielding.
        assert_eq!(wait.wait(|y| y.then_some("gave up")), Some("gave up"));
        // With no spin slot left it yields from the first failed poll on.
        let phases = |w: CallerWait| {
            let mut seen = Vec::new();
            w.wait(|y| {
                seen.push(y);
                (seen.len() == 3).then_some(())
            });
            seen
        };
        assert_eq!(phases(wait), [false, false, false]);
        assert_eq!(phases(CallerWait { share: 0, ..wait }), [false, true, true]);
    }

    #[test]
    fn counts_never_go_below_zero() {
        let q = Backlog::default();
        q.done(Class::P2p);
        q.add(Class::P2p);
        assert_eq!((q.of(Class::P2p), q.any()), (1, 1));
        q.done(Class::P2p);
        assert_eq!(q.any(), 0);
    }
}
