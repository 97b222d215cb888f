//! A group (communicator) as the actor holds it: its queue, active collective and p2p.

use super::*;

pub(super) struct Group {
    pub(super) info: GroupInfo,
    pub(super) comm: Comm,
    pub(super) params: Params,
    pub(super) poisoned: Option<String>,
    pub(super) queue: VecDeque<(Plan, Option<Ticket>)>,
    pub(super) active: Option<Active>,
    pub(super) p2p: Vec<P2p>,
    pub(super) seq: u64,
    pub(super) closing: bool,
    pub(super) waiters: Vec<Completer<()>>,
}

impl Drop for Group {
    fn drop(&mut self) {
        // Callers stop using the communicator (waiting for a direct op that runs) before it
        // is freed with the group.
        if let Some(lane) = &self.info.lane {
            lane.lock().comm = None;
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

    /// Marks the group unusable and fails everything queued or in flight; requests still in
    /// flight go to the graveyard (their buffers stay with MPI).
    pub(super) fn poison(&mut self, e: &CommError, graveyard: &mut Vec<Request>) {
        if self.poisoned.is_some() {
            return;
        }
        let cause = e.to_string();
        tracing::warn!(group = self.info.gid, rank = self.info.rank, "comm mpi: group poisoned: {cause}");
        self.info.poison.set(cause.clone());
        self.poisoned = Some(cause.clone());
        let err = || CommError::Poisoned { cause: cause.clone() };
        if let Some(a) = self.active.take() {
            a.reply.fail(err());
            bury(a.req, graveyard);
        }
        for p in self.p2p.drain(..) {
            p.done.complete(Err(err()));
            if let Some(mut req) = p.req {
                if p.recv {
                    req.cancel();
                }
                bury(req, graveyard);
            }
        }
        for (plan, _) in self.queue.drain(..) {
            plan.reply.fail(err());
        }
    }
}

/// Keeps an unfinished request (and its buffers) until MPI completes it, if ever.
pub(super) fn bury(req: Request, graveyard: &mut Vec<Request>) {
    if !req.is_done() {
        graveyard.push(req);
    }
}
