//! Each group's lane: callers run small ops on their own thread while the worker holds none of
//! the group's ops of that class (see ARCHITECTURE.md, "The path of a small op").

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use comm_core::handle::Poison;
use comm_core::lane::{self as shared, Backlog, CallerWait, Class, LaneState, Ran, Ticket};
use comm_core::{CommError, Completer, HostBuffer};

use crate::raw::{self, Polled};

use super::header::OpLabel;
use super::op::{Job, Pending, Plan, Post};
use super::p2p::P2p;
use super::steps::{exchange, Active, Env, Out, Pool, Reply, Step, Steps};
use super::{p2p, reject_with, Command, GroupInfo, Params};

/// A group's lane, shared by its handles and the worker: a caller runs an op itself when the
/// worker holds none of the group's ops of its class, else queues it behind them.
pub(crate) struct Lane {
    pub(super) lane: shared::Lane<Caller>,
    pub(super) params: Params,
    /// Direct collectives handed to the worker (`Command::Adopt`) that it has not taken yet:
    /// they were issued before anything it has queued, so it starts nothing else meanwhile.
    pub(super) handing_over: AtomicUsize,
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
    fn is_idle(&self, class: Class, backlog: &Backlog) -> bool {
        self.comm.is_some() && backlog.of(class) == 0
    }

    fn contain_panic(&mut self, message: &str) {
        self.poison.set(format!("an MPI op panicked on the caller's thread: {message}"));
    }
}

impl Lane {
    /// `spin`: how long a caller spins for its peers; `share`: how many threads of the process
    /// may spin at once (the CPUs this rank may call its own).
    pub(super) fn new(comm: raw::SharedComm, params: Params, poison: Poison, spin: Duration, share: usize) -> Lane {
        let caller = Caller { comm: Some(comm), seq: 0, pool: Pool::default(), poison: poison.clone() };
        let wait = CallerWait { spin, then_yield: DIRECT_YIELD, share };
        Lane {
            lane: shared::Lane::new(caller, Arc::default(), poison, wait),
            params,
            handing_over: AtomicUsize::new(0),
        }
    }
}

/// Runs `op` on the caller's thread when `Plan::direct` allows it and the lane is free (`None`);
/// else hands it back for the worker, with the ticket that counts it in the lane.
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
        true => lane.lane.try_inline(class, op, |st, op, _| match op.req.job(op.done, &lane.params, size) {
            Job::P2p(post) => p2p_direct(lane, st, info, tx, post),
            Job::Collective(steps) => collective_direct(lane, st, info, tx, steps),
        }),
        false => Err(op),
    };
    match ran {
        // Completion hooks run unlocked (one may submit the next op).
        Ok(Ran { out: Ok(finished), .. }) => finished.complete(info),
        // A panic reached the op's completer, which reports it (as the group's poison).
        Ok(Ran { out: Err(_), .. }) => {}
        Err(op) => return Some((op, Some(lane.lane.backlog().ticket(class)))),
    }
    None
}

/// Runs a collective on the caller's thread, or hands it to the worker if peers are late.
fn collective_direct(
    lane: &Arc<Lane>,
    st: &mut Caller,
    info: &GroupInfo,
    tx: &std::sync::mpsc::Sender<Command>,
    steps: Steps,
) -> Finished {
    st.seq += 1;
    let Steps { name, header, payload, whole, start, reply } = steps;
    let what = OpLabel { name, seq: st.seq, direct: true };
    let Some(comm) = st.comm.as_deref() else { unreachable!("checked by the lane") };
    let (size, rank) = (info.size as usize, info.rank as usize);
    let env =
        Env { comm, gid: info.gid, rank, size, params: &lane.params, half: None, pool: &st.pool, may_block: false };
    let r = match exchange(&env, header, payload, whole, start, what) {
        Err(e) => Err(e),
        Ok((mut req, cont)) => {
            let started = Instant::now();
            let polled = lane.lane.wait().wait(|_| match req.test() {
                Polled::Pending => None,
                Polled::Done(_) => Some(Ok(())),
                Polled::Failed { err, .. } => Some(Err(what.failed(err))),
            });
            let Some(polled) = polled else {
                // Peers are late: the worker polls it (a task this thread would run may be what they
                // wait for); counted in the lane and sent under the lock, so it runs first.
                let ticket = lane.lane.backlog().ticket(Class::Collective);
                let active = Active { ticket: Some(ticket), what, started, req, cont, reply };
                lane.handing_over.fetch_add(1, SeqCst);
                return tx.send(Command::Adopt(info.gid, Box::new(active))).map_or_else(
                    |e| {
                        lane.handing_over.fetch_sub(1, SeqCst);
                        Finished::Gone(e.0)
                    },
                    |()| Finished::Nothing,
                );
            };
            // Every rank is in the op now: its further steps (a large exact reduction) run here too.
            polled.and_then(|()| req.into_bufs()).and_then(|bufs| steps_direct(&env, cont(&env, bufs)?, started, what))
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

/// Posts a send or receive on the caller's thread and polls it for a while; what is still in
/// flight goes to the worker. Returns what finished, to complete once the lane is unlocked.
fn p2p_direct(
    lane: &Arc<Lane>,
    st: &mut Caller,
    info: &GroupInfo,
    tx: &std::sync::mpsc::Sender<Command>,
    post: Post,
) -> Finished {
    let timeout = lane.params.timeout;
    let Some(comm) = st.comm.as_deref() else { unreachable!("checked by the lane") };
    let mut p = match P2p::start(post, comm, timeout, None) {
        Ok(p) => p,
        Err(refused) => return Finished::Refused(refused),
    };
    if let Some(result) = lane.lane.wait().wait(|_| p2p::poll(&mut p, comm, Instant::now(), timeout)) {
        return Finished::Done(Box::new(p), result);
    }
    p.ticket = Some(lane.lane.backlog().ticket(Class::P2p));
    tx.send(Command::AdoptP2p(info.gid, Box::new(p))).map_or_else(|e| Finished::Gone(e.0), |()| Finished::Nothing)
}

/// What a direct op leaves its caller to complete once the lane is unlocked.
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
        // A failed send or receive poisons the group before the op completes, as on the worker
        // (`progress_p2p`); the worker tells the peers (`Group::hear`).
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

/// Largest message a caller sends or receives itself: one every transport sends eagerly, with
/// no wait for the receiver's answer.
const P2P_DIRECT_MAX: usize = 2 << 10;

/// How long a direct op's caller yields after its spin before it hands the op to the worker.
const DIRECT_YIELD: Duration = Duration::from_micros(20);

/// A direct op's steps after its exchange, each request polled on this thread to its end.
fn steps_direct(env: &Env<'_>, mut step: Step, started: Instant, what: OpLabel) -> Result<Out, CommError> {
    let (size, timeout) = (env.size, env.params.timeout);
    loop {
        let (mut req, cont) = match step {
            Step::Done(out) => return Ok(out),
            Step::Wait(req, cont) => (req, cont),
        };
        // Every rank is in the op: the caller yields between polls until the timeout, as the
        // worker does (the transport may need the core).
        let wait = CallerWait { spin: Duration::ZERO, then_yield: timeout.saturating_sub(started.elapsed()), share: 0 };
        let polled = wait.wait(|_| match req.test() {
            Polled::Pending => None,
            Polled::Done(_) => Some(Ok(())),
            Polled::Failed { err, .. } => Some(Err(what.failed(err))),
        });
        let Some(polled) = polled else {
            // The request stays with MPI: dropping it leaks its buffers (raw rule 3).
            return Err(CommError::timeout(
                what.to_string(),
                timeout,
                format!("a rank of the group of {size} stopped in the middle of it (died, or hangs)"),
            ));
        };
        let bufs = polled.and_then(|()| req.into_bufs())?;
        step = cont(env, bufs)?;
    }
}
