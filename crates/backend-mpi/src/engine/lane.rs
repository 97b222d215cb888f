//! Each group's lane: callers run collectives on their own thread when the worker holds none
//! of the group's collectives, and sends and receives when it holds none of its sends and
//! receives.

use std::sync::Arc;
use std::time::{Duration, Instant};

use comm_core::handle::Poison;
use comm_core::lane::Ticket;
use comm_core::lane::{self as shared, Class, LaneState, Queued, Ran};
use comm_core::{CommError, Completer, HostBuffer};

use crate::raw;
use crate::raw::{Comm, Polled, Request};

use super::header::{exchange, Header, OpLabel};
use super::op::{Job, Pending, Plan, Post};
use super::p2p::P2p;
use super::plans::{internal, Active, Cont, Env, Out, Pool, Reply, Start, Step, Steps};
use super::{p2p, reject_with, Command, GroupInfo, Params};

/// A group's lane, shared by its handles and the worker: a caller runs a small collective on
/// its own thread (no hand-off to the worker and back) when the worker has none of this group's
/// collectives queued or running, and a small send or receive when it has none of its sends
/// and receives; otherwise it queues the op behind them. Either way the group's collectives
/// are issued one at a time, in submission order.
pub(crate) struct Lane {
    pub(super) lane: shared::Lane<Caller>,
    pub(super) params: Params,
}

/// What a caller running an op uses, under the lane's lock.
pub(super) struct Caller {
    /// The communicator, until the worker frees it.
    pub(super) comm: Option<raw::SharedComm>,
    /// Direct ops so far (for messages).
    pub(super) seq: u64,
    /// Output buffers of direct ops, reused.
    pub(super) pool: Pool,
    pub(super) poison: Poison,
}

impl LaneState for Caller {
    fn is_idle(&self, class: Class, queued: &Queued) -> bool {
        self.comm.is_some() && queued.of(class) == 0
    }

    fn contain_panic(&mut self, message: &str) {
        self.poison.set(format!("an MPI op panicked on the caller's thread: {message}"));
    }
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane").finish_non_exhaustive()
    }
}

impl Lane {
    pub(super) fn new(comm: raw::SharedComm, params: Params, poison: Poison, spin: Duration) -> Lane {
        let caller = Caller { comm: Some(comm), seq: 0, pool: Pool::default(), poison: poison.clone() };
        Lane { lane: shared::Lane::new(caller, Arc::default(), poison, spin), params }
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Caller> {
        self.lane.lock()
    }

    fn spin(&self) -> Duration {
        self.lane.spin()
    }
}

/// Runs `op` on the caller's thread when its type allows it (`Plan::direct`) and the group's
/// lane is free (`None`; see ARCHITECTURE.md, "The path of a small op"); else hands it back for
/// the worker, with the ticket that counts it in the lane (point-to-point ops never wait for
/// collectives, nor collectives for them).
pub(crate) fn submit_direct<R: Plan>(
    lane: &Arc<Lane>,
    info: &GroupInfo,
    tx: &std::sync::mpsc::Sender<Command>,
    op: Pending<R>,
) -> Option<(Pending<R>, Option<Ticket>)> {
    let class = if R::P2P { Class::P2p } else { Class::Collective };
    let size = info.size as usize;
    let direct = match R::P2P {
        true => op.req.bytes() <= P2P_DIRECT_MAX,
        false => op.req.direct(&lane.params, size) && lane.params.check && size >= 2,
    };
    let ran = match direct {
        true => lane.lane.try_inline(class, op, |st, op, _| {
            if R::P2P {
                let Job::P2p(post) = op.req.job(op.done, &lane.params, size) else {
                    unreachable!("a point-to-point op is posted")
                };
                return p2p_direct(lane, st, info, tx, post);
            }
            collective_direct(lane, st, info, tx, op)
        }),
        false => Err(op),
    };
    match ran {
        // Completion hooks run unlocked (one may submit the next op).
        Ok(Ran { out: Ok(finished), .. }) => finished.complete(info),
        // A panic reached the op's completer, which reports it (as the group's poison).
        Ok(Ran { out: Err(_), .. }) => {}
        Err(op) => return Some((op, Some(lane.lane.queued().ticket(class)))),
    }
    None
}

/// Runs a collective on the caller's thread, or hands it to the worker if peers are late.
fn collective_direct<R: Plan>(
    lane: &Arc<Lane>,
    st: &mut Caller,
    info: &GroupInfo,
    tx: &std::sync::mpsc::Sender<Command>,
    op: Pending<R>,
) -> Finished {
    st.seq += 1;
    let what = OpLabel { name: R::NAME, seq: st.seq, direct: true };
    let Some(comm) = &st.comm else { unreachable!("checked by the lane") };
    let Job::Collective(Steps { header, payload, whole, start, reply, .. }) =
        op.req.job(op.done, &lane.params, info.size as usize)
    else {
        unreachable!("point-to-point ops are posted")
    };
    let r = match comm.with(|comm| exchange_direct(comm, &st.pool, lane, info, header, payload, whole, start, what)) {
        Ok(Direct::Done(out)) => Ok(out),
        Err(e) => Err(e),
        Ok(Direct::Waiting(req, cont, started)) => {
            // Peers are late: the worker polls it from here on (this thread must not block for
            // them: a task it would run may be what they wait for). Counted in the lane like
            // any collective the worker runs, and sent under the lock, so it runs first.
            let ticket = lane.lane.queued().ticket(Class::Collective);
            let active = Active { ticket: Some(ticket), what, started, req, cont, reply };
            return match tx.send(Command::Adopt(info.gid, Box::new(active))) {
                Ok(()) => Finished::Nothing,
                Err(std::sync::mpsc::SendError(msg)) => Finished::Gone(msg),
            };
        }
    };
    if let Err(e) = &r {
        if e.poisons_group() {
            info.poison.set(e.to_string());
        }
    }
    // Not new_group (never direct): no communicator to register.
    Finished::Collective(reply, r)
}

/// Posts a send or receive (of at most [`P2P_DIRECT_MAX`] bytes, sent eagerly: a send needs
/// no answer from the receiver) on the caller's thread and polls it for the lane's spin budget
/// and a few yields (a small message is there by then). What is still in flight goes to the
/// worker, counted in the lane (sent under the lock, so later sends and receives wait behind
/// it). Returns what finished, to be completed once the lane is unlocked.
fn p2p_direct(
    lane: &Arc<Lane>,
    st: &mut Caller,
    info: &GroupInfo,
    tx: &std::sync::mpsc::Sender<Command>,
    post: Post,
) -> Finished {
    let timeout = lane.params.timeout;
    let Some(comm) = &st.comm else { unreachable!("checked by the lane") };
    let polled = comm.with(|comm| {
        let mut p = P2p::start(post, comm, timeout, None).map_err(Finished::Refused)?;
        let started = Instant::now();
        let (mut yields, mut polls) = (0, 0u32);
        loop {
            polls = polls.wrapping_add(1);
            if let Some(result) = p2p::poll(&mut p, comm, info.rank, Instant::now(), timeout) {
                return Err(Finished::Done(Box::new(p), result));
            }
            // The clock read only every 16th poll: it costs about as much as a poll.
            if !polls.is_multiple_of(16) || started.elapsed() < lane.spin() {
                std::hint::spin_loop();
            } else if yields < DIRECT_YIELDS {
                yields += 1;
                std::thread::yield_now();
            } else {
                return Ok(p);
            }
        }
    });
    let mut p = match polled {
        Ok(in_flight) => in_flight,
        Err(finished) => return finished,
    };
    p.ticket = Some(lane.lane.queued().ticket(Class::P2p));
    match tx.send(Command::AdoptP2p(info.gid, Box::new(p))) {
        Ok(()) => Finished::Nothing,
        // The worker is gone (MPI finalised): the request stays with MPI.
        Err(std::sync::mpsc::SendError(msg)) => Finished::Gone(msg),
    }
}

/// What a direct op leaves its caller to complete, once the lane is unlocked (completion
/// hooks may submit the next op).
enum Finished {
    /// Handed to the worker.
    Nothing,
    Collective(Reply, Result<Out, CommError>),
    Done(Box<P2p>, Result<(), CommError>),
    /// MPI refused to post it.
    Refused((Completer<HostBuffer>, CommError)),
    /// The worker is gone: the message it was not sent.
    Gone(Command),
}

impl Finished {
    fn complete(self, info: &GroupInfo) {
        // As on the worker (`progress_p2p`), a failed send or receive poisons the group before
        // the op completes: the caller's next op must find it so. The worker tells the peers
        // when it next looks (`Group::hear`).
        let poison = |e: &CommError| info.poison.set(e.to_string());
        match self {
            Finished::Nothing => {}
            Finished::Collective(reply, Ok(out)) => drop(reply.complete(out)),
            Finished::Collective(reply, Err(e)) => reply.fail(e),
            Finished::Done(p, result) => {
                if let Err(e) = &result {
                    poison(e);
                }
                let mut graveyard = Vec::new();
                p2p::finish(*p, result, &mut graveyard);
                // A failed request MPI may still use keeps its buffers (raw rule 3).
                std::mem::forget(graveyard);
            }
            Finished::Refused((done, e)) => {
                if e.poisons_group() {
                    poison(&e);
                }
                done.complete(Err(e));
            }
            Finished::Gone(msg) => reject_with(msg, "the MPI worker is gone"),
        }
    }
}

/// Largest message a caller sends or receives itself: one that every transport sends eagerly
/// (Open MPI's shared memory from 4 KiB on, and most others later, wait for the receiver's
/// answer first, which this thread would only wait for; the worker handles those).
const P2P_DIRECT_MAX: usize = 2 << 10;

/// How far a direct op got on the caller's thread.
pub(super) enum Direct {
    Done(Out),
    /// The exchange is still in flight after the wait budget: its request and what follows.
    Waiting(Request, Cont, Instant),
}

/// Yields a direct op's caller makes after its spin budget before handing the op to the worker.
pub(super) const DIRECT_YIELDS: u32 = 16;

/// The exchange of a direct op, polled on this thread for the lane's spin budget and a few
/// yields, then the rest of the op.
#[allow(clippy::too_many_arguments)]
pub(super) fn exchange_direct(
    comm: &Comm,
    pool: &Pool,
    lane: &Lane,
    info: &GroupInfo,
    header: Header,
    payload: Option<Vec<u8>>,
    whole: Option<HostBuffer>,
    start: Start,
    what: OpLabel,
) -> Result<Direct, CommError> {
    let (size, rank) = (info.size as usize, info.rank as usize);
    let env = Env { comm, gid: info.gid, rank, size, params: &lane.params, half: None, pool, may_block: false };
    let (mut req, finish) = exchange(&env, header, payload, whole, start, what)?;
    let started = Instant::now();
    let (mut yields, mut polls) = (0, 0u32);
    let bufs = loop {
        polls = polls.wrapping_add(1);
        match req.test() {
            Polled::Done(_) => {
                break req.into_bufs().ok_or_else(|| internal("a completed request kept its buffers"))?
            }
            Polled::Failed { err, .. } => return Err(what.failed(err)),
            // The clock read only every 16th poll: it costs about as much as a poll.
            Polled::Pending if !polls.is_multiple_of(16) || started.elapsed() < lane.spin() => std::hint::spin_loop(),
            Polled::Pending if yields < DIRECT_YIELDS => {
                yields += 1;
                std::thread::yield_now();
            }
            Polled::Pending => return Ok(Direct::Waiting(req, finish, started)),
        }
    };
    // Every rank is in the op now: its further steps (a large exact reduction) run here too.
    let mut step = finish(&env, bufs)?;
    loop {
        let (mut req, cont) = match step {
            Step::Done(out) => return Ok(Direct::Done(out)),
            Step::Wait(req, cont) => (req, cont),
        };
        let bufs = loop {
            match req.test() {
                Polled::Done(_) => {
                    break req.into_bufs().ok_or_else(|| internal("a completed request kept its buffers"))?
                }
                Polled::Failed { err, .. } => return Err(what.failed(err)),
                Polled::Pending if started.elapsed() >= lane.params.timeout => {
                    // The request stays with MPI: dropping it leaks its buffers (raw rule 3).
                    return Err(CommError::Timeout {
                        op: what.to_string(),
                        after: lane.params.timeout,
                        detail: format!("a rank of the group of {size} stopped in the middle of it (died, or hangs)"),
                    });
                }
                // Yield between polls, as the worker does while a collective is in flight: on
                // a busy machine the transport (TCP's kernel work, a peer) needs the core.
                Polled::Pending => std::thread::yield_now(),
            }
        };
        step = cont(&env, bufs)?;
    }
}
