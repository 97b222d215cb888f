//! A group (communicator) as the worker holds it: its queue, active collective and p2p.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use comm_core::lane::Ticket;
use comm_core::{config, CommError, Completer, DType, HostBuffer, OpKind, Rank};

use crate::raw::{self, Comm, Request};

use super::header::OpLabel;
use super::p2p::{finish, mpi_tag, poll, P2p};
use super::steps::{bury, exchange, internal, Active, Born, Env, Pool, Reply, Step, Steps};
use super::{GroupInfo, Params};

pub(super) struct Group {
    pub(super) info: GroupInfo,
    pub(super) comm: Comm,
    pub(super) params: Params,
    pub(super) poisoned: Option<String>,
    pub(super) queue: VecDeque<(Steps, Option<Ticket>)>,
    pub(super) active: Option<Active>,
    pub(super) p2p: Vec<P2p>,
    pub(super) seq: u64,
    pub(super) closing: bool,
    pub(super) waiters: Vec<Completer<()>>,
    /// When [`Group::hear`] last looked for a peer's poison notice.
    pub(super) heard_at: Instant,
}

/// How often a group with ops in flight looks for a peer's poison notice: a peer that failed
/// is known within this, not at the timeout, and the probe costs nothing on the fast path.
const HEAR_EVERY: Duration = Duration::from_millis(1);

impl Drop for Group {
    fn drop(&mut self) {
        // Callers stop using the communicator before it is freed with the group.
        if let Some(lane) = &self.info.lane {
            lane.lane.lock().comm = None;
        }
    }
}

impl Group {
    pub(super) fn idle(&self) -> bool {
        self.active.is_none() && self.queue.is_empty() && self.p2p.is_empty()
    }

    pub(super) fn env<'a>(&'a self, half: Option<&'a raw::HalfOps>, pool: &'a Pool) -> Env<'a> {
        Env {
            comm: &self.comm,
            gid: self.info.gid,
            rank: self.info.rank as usize,
            size: self.info.size as usize,
            params: &self.params,
            half,
            pool,
            may_block: false,
        }
    }

    pub(super) fn poison_error(&self) -> Option<CommError> {
        self.poisoned.as_ref().map(|cause| CommError::Poisoned { cause: cause.clone() })
    }

    /// Marks the group unusable and fails everything queued or in flight; every peer is sent a
    /// notice, so its ops on the group fail within [`HEAR_EVERY`] instead of at their timeout.
    pub(super) fn poison(&mut self, e: &CommError, graveyard: &mut Vec<Request>) {
        if self.poison_only(e, graveyard) {
            let cause = e.to_string();
            let text = &cause.as_bytes()[..cause.len().min(raw::NOTICE_MAX)];
            for p in (0..self.info.size).filter(|&p| p != self.info.rank) {
                if let Ok(buf) = HostBuffer::from_bytes(DType::U8, text) {
                    // A peer that is gone may never take it: the request stays in the graveyard.
                    if let Ok(req) = raw::isend(&self.comm, buf, p as i32, raw::notice_tag()) {
                        bury(req, graveyard);
                    }
                }
            }
        }
    }

    /// [`Group::poison`] without the notices; whether the group was healthy until now.
    fn poison_only(&mut self, e: &CommError, graveyard: &mut Vec<Request>) -> bool {
        if self.poisoned.is_some() {
            return false;
        }
        let cause = e.to_string();
        tracing::warn!(group = self.info.gid, rank = self.info.rank, "comm mpi: group poisoned: {cause}");
        self.info.poison.set(cause.clone());
        self.poisoned = Some(cause.clone());
        self.fail_all(&|| CommError::Poisoned { cause: cause.clone() }, true, graveyard);
        true
    }

    /// Fails every op queued or in flight with `err()`; unfinished requests go to the graveyard
    /// (matched receives cancelled first where `cancel`).
    pub(super) fn fail_all(&mut self, err: &dyn Fn() -> CommError, cancel: bool, graveyard: &mut Vec<Request>) {
        if let Some(a) = self.active.take() {
            a.reply.fail(err());
            bury(a.req, graveyard);
        }
        for p in self.p2p.drain(..) {
            p.done.complete(Err(err()));
            if let Some(mut req) = p.req {
                if cancel && p.recv {
                    req.cancel();
                }
                bury(req, graveyard);
            }
        }
        for (steps, _) in self.queue.drain(..) {
            steps.reply.fail(err());
        }
    }

    /// Goes on with a collective's step `r`: its request becomes the active one, or the op ends,
    /// its lane ticket dropped first (else the caller's next op, submitted at once, would find
    /// the worker busy and queue behind nothing).
    pub(super) fn next(
        &mut self,
        (ticket, what, started, reply): (Option<Ticket>, OpLabel, Instant, Reply),
        r: Result<Step, CommError>,
        graveyard: &mut Vec<Request>,
        born: &mut Born,
    ) {
        match r {
            Ok(Step::Wait(req, cont)) => self.active = Some(Active { ticket, what, started, req, cont, reply }),
            Ok(Step::Done(out)) => {
                drop(ticket);
                born.extend(reply.complete(out).map(|(c, d)| (self.info.gid, c, d)));
            }
            Err(e) => {
                drop(ticket);
                if e.poisons_group() {
                    self.poison(&e, graveyard);
                }
                reply.fail(e);
            }
        }
    }

    /// Poisons the group when a caller's op poisoned it on the caller's thread, or (while ops
    /// are in flight, at most every [`HEAR_EVERY`]) a peer's notice says its side failed.
    pub(super) fn hear(&mut self, now: Instant, graveyard: &mut Vec<Request>) -> bool {
        if self.poisoned.is_some() {
            return false;
        }
        if let Some(cause) = self.info.poison.cause() {
            self.poison(&CommError::Poisoned { cause }, graveyard);
            return true;
        }
        if self.idle() || now.duration_since(self.heard_at) < HEAR_EVERY {
            return false;
        }
        self.heard_at = now;
        let e = match raw::take_notice(&self.comm) {
            Ok(None) => return false,
            Ok(Some((from, cause))) => {
                CommError::peer_lost(from as Rank, format!("rank {from}'s side of the group failed: {cause}"))
            }
            Err(e) => e,
        };
        // The op in flight fails with the real cause (its receives from the failed peer will
        // never match: cancelled, so MPI can still be finalised); what is queued, as poisoned.
        // The group is marked failed first: whoever the op's failure wakes sees it (`error()`).
        self.info.poison.set(e.to_string());
        if let Some(mut a) = self.active.take() {
            a.reply.fail(e.duplicate());
            a.req.cancel();
            bury(a.req, graveyard);
        }
        self.poison_only(&e, graveyard)
    }
}

/// Starts a group's next collective: the header exchange first (with checking on).
pub(super) fn start_collective(
    g: &mut Group,
    steps: Steps,
    ticket: Option<Ticket>,
    half: Option<&raw::HalfOps>,
    pool: &Pool,
    graveyard: &mut Vec<Request>,
    born: &mut Born,
) {
    let Steps { name, header, payload, whole, start, reply } = steps;
    config::injected_panic(g.params.panic_at, name, g.info.rank);
    let what = OpLabel { name, seq: g.seq, direct: false };
    let checked = g.info.size > 1 && (g.params.check || header.op == OpKind::NewGroup.code());
    let env = g.env(half, pool);
    let first = if checked {
        exchange(&env, header, payload, whole, start, what).map(|(req, cont)| Step::Wait(req, cont))
    } else if whole.is_some() {
        Err(internal("an input planned beside an exchange that does not happen"))
    } else {
        start(&env, None)
    };
    g.next((ticket, what, Instant::now(), reply), first, graveyard, born);
}

impl Group {
    /// Progresses every send and receive in flight; whether any finished.
    pub(super) fn progress_p2p(&mut self, graveyard: &mut Vec<Request>, now: Instant) -> bool {
        let g = self;
        let mut any = false;
        let mut i = 0;
        // Receives still unmatched in this pass: a later receive from the same rank with the same
        // tag must not match first (its probe would take a message that arrived since theirs).
        let mut waiting: Vec<(Rank, i32)> = Vec::new();
        while i < g.p2p.len() {
            // Receives are matched in posting order (the list keeps it), as MPI matches them.
            let p = &mut g.p2p[i];
            let key = (p.peer, mpi_tag(p.tag, p.dtype));
            let unmatched = p.recv && p.req.is_none();
            if unmatched && waiting.contains(&key) {
                i += 1;
                continue;
            }
            let Some(result) = poll(p, &g.comm, now, g.params.timeout) else {
                if unmatched && g.p2p[i].req.is_none() {
                    waiting.push(key);
                }
                i += 1;
                continue;
            };
            any = true;
            let p = g.p2p.remove(i);
            // Poisoned before the op completes: the caller's next op must find it so.
            if let Err(e) = &result {
                g.poison(e, graveyard);
            }
            finish(p, result, graveyard);
        }
        any
    }
}
