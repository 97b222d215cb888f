//! Errors and liveness: poisoning, panics, peers that abort or die.

use std::sync::atomic::Ordering::{Acquire, SeqCst};
use std::time::{Duration, Instant};

use comm_core::lane::Class;
use comm_core::{CommError, Rank};

use crate::layout::{OFF_REASON, OFF_STATE, REASON_LEN, STATE_ABORTED, STATE_CLOSED};

use super::steps::publish_abort;
use super::{Command, Engine, Flow, Parked, Phase, Result, Then};

impl Engine {
    /// After a panic on the worker or an inline caller (ARCHITECTURE.md, end of "The path of one
    /// all_reduce (shm)"): whether the engine may keep running (false after a second panic: then
    /// only [`drain_after_panic`](Self::drain_after_panic) runs).
    pub(crate) fn on_panic(&mut self, message: &str) -> bool {
        self.panics += 1;
        let e = CommError::Backend {
            backend: "shm",
            source: format!("the worker of rank {} panicked: {message}", self.rank).into(),
        };
        self.phase = Phase::Idle;
        self.poison_with(&e);
        let poisoned = self.poison_error().unwrap_or(e);
        match self.parked.take() {
            Some(Parked { then: Some(Then::Done(done)), .. }) => done.complete(Err(poisoned)),
            Some(Parked { then: Some(Then::Run(op)), .. }) => op.fail(poisoned),
            _ => {}
        }
        if let Some((done, r)) = self.finished.take() {
            done.complete(r);
        }
        self.panics == 1
    }

    /// The worker's loop once the engine cannot be trusted: every command fails with
    /// `Poisoned`, a shutdown completes, and the loop ends with the channel or the shutdown.
    pub(crate) fn drain_after_panic(&mut self) -> Flow {
        let cause = self.poisoned.clone().unwrap_or_else(|| "the shm worker panicked".into());
        match self.rx.recv_timeout(Duration::from_millis(10)) {
            Ok(cmd) => {
                self.pending.done(Class::Collective);
                match cmd {
                    Command::Shutdown(d) => {
                        d.complete(Ok(()));
                        for w in self.shutdown_waiters.drain(..) {
                            w.complete(Ok(()));
                        }
                        Flow::Exit
                    }
                    other => {
                        self.fail(other, CommError::Poisoned { cause });
                        Flow::Busy
                    }
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Flow::Busy,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Flow::Exit,
        }
    }

    pub(super) fn poison_error(&self) -> Option<CommError> {
        self.poisoned.as_ref().map(|cause| CommError::Poisoned { cause: cause.clone() })
    }

    /// Marks the group unusable: tells peers (state + reason in our segment), fails
    /// everything queued, and makes the handle fail new ops fast.
    pub(super) fn poison_with(&mut self, e: &CommError) {
        if self.poisoned.is_some() {
            return;
        }
        let cause = e.to_string();
        self.give_up(&cause);
        self.poison.set(cause.clone());
        self.poisoned = Some(cause);
        let err = CommError::Poisoned { cause: self.poisoned.clone().unwrap_or_default() };
        for peer in 0..self.world {
            self.fail_p2p(peer, &err);
        }
        for cmd in std::mem::take(&mut self.colls) {
            self.fail(cmd, err.duplicate());
        }
    }

    /// Tells the peers this rank gave up the group (state and reason in its segment). Before
    /// any op fails: a peer reading a message sent in place checks this after its copy, so it
    /// never takes a buffer its owner got back meanwhile.
    pub(super) fn give_up(&mut self, cause: &str) {
        publish_abort(&self.segs[self.rank], cause);
        self.ring_all();
    }

    /// Whether `peer` still holds the message it sent in place, having read it: it neither
    /// aborted nor closed since (it releases a message only after saying so, `give_up`).
    pub(super) fn still_held(&self, peer: usize) -> Result<()> {
        std::sync::atomic::fence(SeqCst);
        match self.segs[peer].u32_at(OFF_STATE).load(SeqCst) {
            STATE_ABORTED | STATE_CLOSED => Err(CommError::peer_lost(
                peer as Rank,
                format!("it gave up its send while this rank read it: {}", self.peer_reason(peer)),
            )),
            _ => Ok(()),
        }
    }

    /// An op ended in `e`: its step is over; a lost peer, a mismatch or a timeout poisons.
    pub(super) fn failed(&mut self, e: &CommError) {
        self.phase = Phase::Idle;
        if e.poisons_group() {
            self.poison_with(e);
        }
    }

    /// Fails every send to and receive from `peer` with `e`.
    pub(super) fn fail_p2p(&mut self, peer: usize, e: &CommError) {
        let recvs = self.recvs[peer].drain(..).map(|op| op.done);
        for done in self.sends[peer].drain(..).map(|op| op.done).chain(recvs) {
            done.complete(Err(e.duplicate()));
        }
    }

    pub(super) fn fail(&mut self, cmd: Command, e: CommError) {
        match cmd {
            Command::Op(op) => op.fail(e),
            Command::OneShot(_, d) => d.complete(Err(e)),
            Command::Shutdown(d) => {
                self.closing = true;
                self.shutdown_waiters.push(d);
            }
            Command::Abort(_) => {}
        }
    }

    pub(super) fn peer_reason(&self, peer: usize) -> String {
        let seg = &self.segs[peer];
        let bytes: Vec<u8> = (0..REASON_LEN).map(|i| seg.read::<u8>(OFF_REASON + i)).take_while(|&b| b != 0).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// `Err` when `peer` can no longer make progress: it aborted, shut down, or died (its
    /// process is looked at every 50 ms at most).
    pub(super) fn check_peer(&mut self, peer: usize) -> Result<()> {
        let why = match self.segs[peer].u32_at(OFF_STATE).load(Acquire) {
            STATE_ABORTED => format!("it aborted the group: {}", self.peer_reason(peer)),
            STATE_CLOSED => "it shut its process group down (or exited) without joining this op".to_owned(),
            _ if self.last_liveness.elapsed() < Duration::from_millis(50) => return Ok(()),
            _ => {
                self.last_liveness = Instant::now();
                match self.procs[peer].filter(|p| p.alive() == Some(false)) {
                    Some(p) => format!("its process {} exited", p.pid),
                    None => return Ok(()),
                }
            }
        };
        Err(CommError::peer_lost(peer as Rank, why))
    }
}
