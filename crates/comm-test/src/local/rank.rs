//! One rank's handle ([`LocalRank`]): depositing collectives under the next sequence number
//! and matching point-to-point messages (the rendezvous), and its `Collective`/`Group` impls.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use comm_core::ops::{
    AllGather, AllReduce, AllToAll, Barrier, Broadcast, Gather, RecvFrom, Reduce, ReduceScatter, Scatter,
    SendTo as SendOp,
};
use comm_core::{Backend, Collective, CommError, Completer, Group, HostBuffer, Op, Rank, Work};

use super::ops::{fail, fill, finish, LocalOp, NewGroup};
use super::{Channel, Deferred, Entry, FinishFn, GroupCtx, Payload, Posted, Sig, Slot, State, World};

pub(super) fn new_handle(world: &Arc<World>, st: &mut State, gid: u64, rank: Rank, size: u32) -> Arc<dyn Backend> {
    st.handles += 1;
    if let Some(g) = st.groups.get_mut(&gid) {
        g.handles += 1;
    }
    Arc::new(LocalRank { world: world.clone(), gid, rank, size, shut: AtomicBool::new(false) })
}

/// One rank's handle on one group.
struct LocalRank {
    world: Arc<World>,
    gid: u64,
    rank: Rank,
    size: u32,
    shut: AtomicBool,
}

impl Drop for LocalRank {
    fn drop(&mut self) {
        let removed = {
            let mut st = self.world.lock();
            st.handles -= 1;
            if st.handles == 0 {
                self.world.wake.notify_all();
            }
            let last = st.groups.get_mut(&self.gid).is_some_and(|g| {
                g.handles -= 1;
                g.handles == 0
            });
            if last {
                st.groups.remove(&self.gid)
            } else {
                None
            }
        };
        // Pending completers of a group nobody holds any more complete with `Shutdown` when
        // dropped; do it outside the lock.
        drop(removed);
    }
}

/// The outcome of depositing under the lock; acted on after it is released.
enum Deposit<R: Op> {
    Fail(Completer<R::Output>, CommError),
    Waiting,
    Complete(Vec<Payload>, FinishFn),
}

impl LocalRank {
    fn precheck<R: Op>(&self, req: &R) -> Result<(), CommError> {
        if self.shut.load(Ordering::Acquire) {
            return Err(CommError::Shutdown(format!("rank {} of this local group called shutdown", self.rank)));
        }
        req.validate(self.rank, self.size)
    }

    fn collective<R: LocalOp>(&self, req: R) -> Work<R::Output> {
        if let Err(e) = self.precheck(&req) {
            return Work::ready(Err(e));
        }
        let (done, work) = Work::pending();
        let mut deferred = Deferred::new();
        let outcome = self.deposit(req, done, &mut deferred);
        deferred.into_iter().for_each(|d| d());
        match outcome {
            Deposit::Fail(done, e) => done.complete(Err(e)),
            Deposit::Waiting => {}
            Deposit::Complete(payloads, finish) => {
                finish(payloads, &GroupCtx { world: self.world.clone(), gid: self.gid })
            }
        }
        work
    }

    fn deposit<R: LocalOp>(&self, req: R, done: Completer<R::Output>, deferred: &mut Deferred) -> Deposit<R> {
        let mut st = self.world.lock();
        let idle = st.watchdog_idle;
        let Some(g) = st.groups.get_mut(&self.gid) else {
            return Deposit::Fail(done, CommError::Shutdown("the group is gone".into()));
        };
        let me = self.rank as usize;
        let n = g.size();
        let seq = g.next_seq[me];
        g.next_seq[me] += 1;

        // A late arrival at an op already known to mismatch gets the mismatch itself.
        if let Some(slot) = g.slots.get_mut(&seq) {
            if let Some(detail) = slot.failed.clone() {
                slot.arrived[me] = true;
                if slot.count() == n {
                    g.slots.remove(&seq);
                }
                return Deposit::Fail(done, CommError::mismatch(R::NAME, detail));
            }
        }
        if let Some(cause) = &g.poisoned {
            return Deposit::Fail(done, CommError::Poisoned { cause: cause.clone() });
        }

        let sig = req.sig();
        let deadline = Instant::now() + self.world.timeout;
        let slot = g.slots.entry(seq).or_insert_with(|| Slot {
            entries: (0..n).map(|_| None).collect(),
            arrived: vec![false; n],
            failed: None,
            deadline,
            finish: finish::<R>,
        });
        let diff =
            slot.entries.iter().enumerate().find_map(|(r, e)| e.as_ref().map(|e| e.sig.diff(r, &sig, self.rank)));
        if let Some(Some(diff)) = diff {
            let detail = format!("op #{seq} of the group: {diff}");
            slot.failed = Some(detail.clone());
            slot.arrived[me] = true;
            for e in slot.entries.iter_mut().filter_map(Option::take) {
                let err = CommError::mismatch(e.sig.op, detail.clone());
                deferred.push(Box::new(move || (e.fail)(e.payload, err)));
            }
            if slot.count() == n {
                g.slots.remove(&seq);
            }
            g.poison(&format!("ranks disagreed on an op: {detail}"), deferred);
            return Deposit::Fail(done, CommError::mismatch(R::NAME, detail));
        }
        slot.entries[me] = Some(Entry { sig, payload: Box::new((req, done)), fail: fail::<R> });
        slot.arrived[me] = true;
        if slot.count() < n {
            if idle {
                self.world.wake.notify_all();
            }
            return Deposit::Waiting;
        }
        let slot = g.slots.remove(&seq).expect("slot just filled");
        Deposit::Complete(
            slot.entries.into_iter().map(|e| e.expect("every rank arrived").payload).collect(),
            slot.finish,
        )
    }

    fn send(&self, req: SendOp) -> Work<HostBuffer> {
        if let Err(e) = self.precheck(&req) {
            return Work::ready(Err(e));
        }
        let (done, work) = Work::pending();
        let posted = Posted { req, done, deadline: Instant::now() + self.world.timeout };
        self.p2p((self.rank, posted.req.dst), |ch| match ch.recvs.pop_front() {
            Some(recv) => Some((posted, recv)),
            None => {
                ch.sends.push_back(posted);
                None
            }
        });
        work
    }

    fn recv(&self, req: RecvFrom) -> Work<HostBuffer> {
        if let Err(e) = self.precheck(&req) {
            return Work::ready(Err(e));
        }
        let (done, work) = Work::pending();
        let posted = Posted { req, done, deadline: Instant::now() + self.world.timeout };
        self.p2p((posted.req.src, self.rank), |ch| match ch.sends.pop_front() {
            Some(send) => Some((send, posted)),
            None => {
                ch.recvs.push_back(posted);
                None
            }
        });
        work
    }

    /// Runs `post` on the (src, dst) channel; when it returns a matched pair, delivers it.
    fn p2p(&self, key: (Rank, Rank), post: impl FnOnce(&mut Channel) -> Option<(Posted<SendOp>, Posted<RecvFrom>)>) {
        let mut deferred = Deferred::new();
        self.p2p_locked(key, post, &mut deferred);
        deferred.into_iter().for_each(|d| d());
    }

    fn p2p_locked(
        &self,
        key: (Rank, Rank),
        post: impl FnOnce(&mut Channel) -> Option<(Posted<SendOp>, Posted<RecvFrom>)>,
        deferred: &mut Deferred,
    ) {
        let mut st = self.world.lock();
        let idle = st.watchdog_idle;
        let Some(g) = st.groups.get_mut(&self.gid) else { return };
        if let Some(cause) = g.poisoned.clone() {
            // Queue the op on a scratch channel, then fail everything on it.
            let mut scratch = Channel::default();
            let _ = post(&mut scratch);
            let mut scratch_group = HashMap::from([(key, scratch)]);
            std::mem::swap(&mut g.p2p, &mut scratch_group);
            g.poison(&cause, deferred);
            g.p2p = scratch_group;
            return;
        }
        let Some((s, r)) = post(g.p2p.entry(key).or_default()) else {
            if idle {
                self.world.wake.notify_all();
            }
            return;
        };
        let (src, dst) = key;
        let (sb, rb) = (&s.req.buf, &r.req.buf);
        if s.req.tag == r.req.tag && sb.dtype() == rb.dtype() && sb.len() == rb.len() {
            deferred.push(Box::new(move || {
                let out = fill(r.req.buf, &s.req.buf);
                r.done.complete(Ok(out));
                s.done.complete(Ok(s.req.buf));
            }));
            return;
        }
        let detail = format!(
            "send from rank {src} to rank {dst} carries tag {}, {} × {} \
             but the matching recv expects tag {}, {} × {}",
            s.req.tag,
            sb.dtype(),
            sb.len(),
            r.req.tag,
            rb.dtype(),
            rb.len()
        );
        let d = detail.clone();
        deferred.push(Box::new(move || {
            s.done.complete(Err(CommError::mismatch(SendOp::NAME, d.clone())));
            r.done.complete(Err(CommError::mismatch(RecvFrom::NAME, d)));
        }));
        g.poison(&format!("point-to-point mismatch: {detail}"), deferred);
    }
}

macro_rules! collective {
    ($($t:ty),* $(,)?) => {$(
        impl Collective<$t> for LocalRank {
            fn submit(&self, req: $t) -> Work<<$t as Op>::Output> {
                self.collective(req)
            }
        }
    )*};
}
collective!(AllReduce, Broadcast, Reduce, AllGather, ReduceScatter, AllToAll, Scatter, Gather, Barrier);

impl Collective<SendOp> for LocalRank {
    fn submit(&self, req: SendOp) -> Work<HostBuffer> {
        self.send(req)
    }
}

impl Collective<RecvFrom> for LocalRank {
    fn submit(&self, req: RecvFrom) -> Work<HostBuffer> {
        self.recv(req)
    }
}

#[async_trait]
impl Group for LocalRank {
    fn rank(&self) -> Rank {
        self.rank
    }
    fn world_size(&self) -> u32 {
        self.size
    }
    fn backend_name(&self) -> &'static str {
        "local"
    }
    async fn new_group(&self, ranks: &[Rank]) -> Result<Option<Arc<dyn Backend>>, CommError> {
        self.collective(NewGroup { ranks: ranks.to_vec() }).await
    }
    async fn shutdown(&self) -> Result<(), CommError> {
        self.shut.store(true, Ordering::Release);
        Ok(())
    }
    /// Fails the group for every rank of the world: pending and later ops fail.
    fn abort(&self, cause: &str) {
        GroupCtx { world: self.world.clone(), gid: self.gid }.poison(cause);
    }
}

/// A new group's handles are made here, where handles live.
impl LocalOp for NewGroup {
    fn sig(&self) -> Sig {
        Sig { ranks: Some(self.ranks.clone()), ..Sig::new(Self::NAME) }
    }
    fn run(reqs: Vec<Self>, ctx: &GroupCtx) -> Result<Vec<Self::Output>, CommError> {
        let ranks = &reqs[0].ranks;
        let mut st = ctx.world.lock();
        let parent =
            &st.groups.get(&ctx.gid).ok_or_else(|| CommError::Shutdown("the parent group is gone".into()))?.members;
        let members = ranks.iter().map(|&r| parent[r as usize]).collect();
        let gid = st.add_group(members);
        let size = ranks.len() as u32;
        Ok((0..reqs.len() as Rank)
            .map(|r| ranks.iter().position(|&m| m == r).map(|i| new_handle(&ctx.world, &mut st, gid, i as Rank, size)))
            .collect())
    }
}
