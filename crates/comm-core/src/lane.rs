//! The lane: the gate every op of a group passes on its way to the group's worker.
//!
//! A backend keeps what its worker and its callers share (the mapped segments, the
//! communicator) behind a [`Lane`]. An op runs in one of two ways:
//! - **inline**, on the caller's thread, when the lane is free and idle for the op's
//!   [`Class`] ([`Lane::try_inline`]): no hand-off and no wake-up, which is what makes a small
//!   op cost microseconds instead of a thread round trip;
//! - **on the worker**, counted in [`Queued`] from the moment it is handed over until the
//!   worker is done with it (a [`Ticket`], or [`Queued::add`]/[`Queued::done`]), so an inline
//!   caller never overtakes it.
//!
//! The rules every backend shares live here: the try-lock and the idle check, panic
//! containment (the group is poisoned with the panic's message, the op fails with
//! `Poisoned`), and the hand-over (whether the worker must go on with something an inline
//! caller left). What the worker does, and which ops may run inline, is the backend's.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::Duration;

use crate::handle::Poison;
use crate::{panic_message, CommError};

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
    /// is queued for the worker (`queued`), parked or running.
    fn is_idle(&self, class: Class, queued: &Queued) -> bool;

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
pub struct Queued([AtomicUsize; 2]);

impl Queued {
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
        Ticket { queued: self.clone(), class }
    }
}

/// An op counted in [`Queued`] until this is dropped (by the worker, once done with it).
#[derive(Debug)]
pub struct Ticket {
    queued: Arc<Queued>,
    class: Class,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.queued.done(self.class);
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

/// See the module docs.
#[derive(Debug)]
pub struct Lane<S> {
    state: Mutex<S>,
    queued: Arc<Queued>,
    poison: Poison,
    spin: Duration,
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
    /// `queued` is shared with the worker, which counts down what it takes; `spin` is how long
    /// an inline caller may wait for peers before it parks its op for the worker
    /// ([`crate::handle::caller_spin`]).
    pub fn new(state: S, queued: Arc<Queued>, poison: Poison, spin: Duration) -> Self {
        Lane { state: Mutex::new(state), queued, poison, spin }
    }

    /// The ops queued for the worker.
    pub fn queued(&self) -> &Arc<Queued> {
        &self.queued
    }

    /// The group's poison, which a contained panic sets.
    pub fn poison(&self) -> &Poison {
        &self.poison
    }

    /// How long an inline caller may wait for peers.
    pub fn spin(&self) -> Duration {
        self.spin
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
    /// else hands `x` back. `f` gets the spin budget. A panic in `f` is contained.
    pub fn try_inline<X, T>(&self, class: Class, x: X, f: impl FnOnce(&mut S, X, Duration) -> T) -> Result<Ran<T>, X> {
        let Some(mut state) = self.try_lock() else { return Err(x) };
        if !state.is_idle(class, &self.queued) {
            return Err(x);
        }
        let out = catch_unwind(AssertUnwindSafe(|| f(&mut state, x, self.spin)));
        let out = out.map_err(|payload| self.contain(&mut state, &panic_message(&*payload)));
        let hand_over = out.is_err() || state.wants_worker();
        Ok(Ran { out, hand_over })
    }

    /// Runs `f` on the locked state, as the worker does; a panic in `f` is contained.
    pub fn run_locked<T>(&self, f: impl FnOnce(&mut S) -> T) -> Result<T, CommError> {
        let mut state = self.lock();
        let out = catch_unwind(AssertUnwindSafe(|| f(&mut state)));
        out.map_err(|payload| self.contain(&mut state, &panic_message(&*payload)))
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
        fn is_idle(&self, class: Class, queued: &Queued) -> bool {
            queued.of(class) == 0 && (class == Class::P2p || !self.parked)
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
        Lane::new(state, Arc::default(), poison, Duration::from_micros(7))
    }

    #[test]
    fn idle_lanes_run_inline_and_queued_ones_do_not() {
        let lane = lane();
        let here = std::thread::current().id();
        let ran = lane.try_inline(Class::Collective, 1, |_, x, spin| (x, spin, std::thread::current().id()));
        let Ran { out, hand_over } = ran.unwrap();
        assert_eq!(out.unwrap(), (1, Duration::from_micros(7), here));
        assert!(!hand_over);
        // A collective queued for the worker: the next one queues too, a message does not.
        let ticket = lane.queued().ticket(Class::Collective);
        assert_eq!(lane.try_inline(Class::Collective, 2, |_, x, _| x).unwrap_err(), 2);
        assert!(lane.try_inline(Class::P2p, 3, |_, x, _| x).is_ok());
        drop(ticket);
        assert_eq!(lane.queued().any(), 0);
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
    fn counts_never_go_below_zero() {
        let q = Queued::default();
        q.done(Class::P2p);
        q.add(Class::P2p);
        assert_eq!((q.of(Class::P2p), q.any()), (1, 1));
        q.done(Class::P2p);
        assert_eq!(q.any(), 0);
    }
}
