//! How each op of `comm-core` runs on shared memory: one [`Plan`] impl per request type, which
//! says whether the op fits one step (and may run inline on the caller's thread), how the
//! worker runs it otherwise, and where it waits for its turn.

use comm_core::ops::{
    AllGather, AllReduce, AllToAll, Barrier, Broadcast, Gather, RecvFrom, Reduce, ReduceScatter, Scatter, SendTo,
};
use comm_core::{CommError, Completer, DType, HostBuffer, InOut, Op, OpKind};

use crate::engine::{Engine, OneShot, OneShotOutput, Queued};

type Result<T, E = CommError> = std::result::Result<T, E>;

/// What decides whether an op fits one step; the same on every rank. In a group of one rank
/// every op fits (`window` and `small_max` are unbounded): it needs no step at all.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub(crate) world: u32,
    /// Bytes per window: the most one step moves per rank.
    pub(crate) window: usize,
    /// Largest one-step all_reduce/reduce (bytes; at most `window`).
    pub(crate) small_max: usize,
    /// The smallest op that reads its peers' buffers in place (`Params::zc_min`): all_reduce,
    /// reduce, all_gather, reduce_scatter, all_to_all, broadcast and scatter of that much take
    /// that path even when they fit one step, as it saves a copy (gather only past one step).
    pub(crate) zc_min: usize,
}

impl Limits {
    /// `r` in one step (`f`) when an op that reads peers' buffers in place from `zc_min` runs
    /// `bytes` in one, one step taking at most `most`; else `r` back.
    fn fit<R>(&self, bytes: usize, most: usize, r: R, f: impl FnOnce(R) -> OneShot) -> Result<OneShot, R> {
        if bytes <= most && bytes < self.zc_min {
            Ok(f(r))
        } else {
            Err(r)
        }
    }
}

/// How the shm backend runs one kind of op. `pub` in name only: it bounds the generic
/// `Collective` impl (a crate-private bound would warn, `private_bounds`).
pub trait Plan: Op<Output: OneShotOutput> + Sized {
    /// The one-step form, when the op fits one step (it may then run inline); else the
    /// request back.
    fn one_shot(self, _: &Limits) -> Result<OneShot, Self> {
        Err(self)
    }
    /// Runs the op on the worker in its turn (point-to-point ops never do).
    fn run(self, _: &mut Engine) -> Result<Self::Output> {
        Err(CommError::Backend { backend: "shm", source: format!("a {} ran as a collective", Self::NAME).into() })
    }
    /// Where the op waits for its turn: collectives in submission order.
    fn accept(p: Box<Pending<Self>>, e: &mut Engine) {
        e.queue_collective(p);
    }
    /// Point-to-point: the caller's thread may queue the op straight into the engine and
    /// progress it there (`ShmBackend::direct`).
    const P2P: bool = false;
}

/// An op and its completer, queued for the worker.
pub struct Pending<R: Op> {
    pub(crate) req: R,
    pub(crate) done: Completer<R::Output>,
}

impl<R: Plan> Queued for Pending<R> {
    fn accept(self: Box<Self>, e: &mut Engine) {
        R::accept(self, e);
    }
    fn run(self: Box<Self>, e: &mut Engine, arrived: bool) {
        let Pending { req, done } = *self;
        let open = arrival::<R>(&req);
        done.complete(e.run_op(R::NAME, |e| {
            if !arrived {
                e.oneshot(open)?;
            }
            req.run(e)
        }));
    }
    fn fail(self: Box<Self>, err: CommError) {
        self.done.complete(Err(err));
    }
}

/// The step that opens a queued collective `req`, on every rank alike.
pub(crate) fn arrival<R: Op>(req: &R) -> OneShot {
    let dtype = req.dtype().unwrap_or(DType::U8);
    let count = if R::KIND == OpKind::AllToAll { 0 } else { req.bytes() / dtype.size() };
    OneShot::Arrive { kind: R::KIND, dtype, count }
}

impl Plan for AllReduce {
    fn one_shot(self, l: &Limits) -> Result<OneShot, Self> {
        l.fit(self.buf.byte_len(), l.small_max, self, |r| OneShot::AllReduce { buf: r.buf, op: r.op, root: None })
    }
    fn run(mut self, e: &mut Engine) -> Result<HostBuffer> {
        e.all_reduce(&mut self.buf, self.op, None).map(|()| self.buf)
    }
}

impl Plan for Reduce {
    fn one_shot(self, l: &Limits) -> Result<OneShot, Self> {
        l.fit(self.buf.byte_len(), l.small_max, self, |r| OneShot::AllReduce {
            buf: r.buf,
            op: r.op,
            root: Some(r.root),
        })
    }
    fn run(mut self, e: &mut Engine) -> Result<HostBuffer> {
        e.all_reduce(&mut self.buf, self.op, Some(self.root)).map(|()| self.buf)
    }
}

impl Plan for Broadcast {
    fn one_shot(self, l: &Limits) -> Result<OneShot, Self> {
        l.fit(self.buf.byte_len(), l.window, self, |r| OneShot::Broadcast { buf: r.buf, root: r.root })
    }
    fn run(mut self, e: &mut Engine) -> Result<HostBuffer> {
        e.broadcast(&mut self.buf, self.root).map(|()| self.buf)
    }
}

impl Plan for AllGather {
    fn one_shot(self, l: &Limits) -> Result<OneShot, Self> {
        l.fit(self.input.byte_len(), l.window, self, |r| {
            let n = r.input.len() * l.world as usize;
            let out = r.output.unwrap_or_else(|| HostBuffer::for_overwrite(r.input.dtype(), n));
            OneShot::AllGather { input: r.input, out }
        })
    }
    fn run(mut self, e: &mut Engine) -> Result<InOut> {
        e.all_gather(&mut self).map(|output| InOut { input: self.input, output })
    }
}

impl Plan for ReduceScatter {
    fn one_shot(self, l: &Limits) -> Result<OneShot, Self> {
        l.fit(self.input.byte_len(), l.window, self, |r| {
            let block = r.input.len() / l.world as usize;
            let out = r.output.unwrap_or_else(|| HostBuffer::for_overwrite(r.input.dtype(), block));
            OneShot::ReduceScatter { input: r.input, out, op: r.op }
        })
    }
    fn run(mut self, e: &mut Engine) -> Result<InOut> {
        e.reduce_scatter(&mut self).map(|output| InOut { input: self.input, output })
    }
}

impl Plan for AllToAll {
    fn one_shot(self, l: &Limits) -> Result<OneShot, Self> {
        let n = l.world as usize;
        let peers_bytes = self.input.byte_len() / n * (n - 1);
        let uneven = self.input_splits.is_some() || self.output_splits.is_some();
        if uneven || peers_bytes > l.window || self.input.byte_len() >= l.zc_min {
            return Err(self);
        }
        let out = self.output.unwrap_or_else(|| HostBuffer::for_overwrite(self.input.dtype(), self.input.len()));
        Ok(OneShot::AllToAll { input: self.input, out, n })
    }
    fn run(mut self, e: &mut Engine) -> Result<InOut> {
        e.all_to_all(&mut self).map(|output| InOut { input: self.input, output })
    }
}

impl Plan for Barrier {
    fn one_shot(self, _: &Limits) -> Result<OneShot, Self> {
        Ok(OneShot::Barrier)
    }
    fn run(self, e: &mut Engine) -> Result<()> {
        e.oneshot(OneShot::Barrier).map(drop)
    }
}

impl Plan for Scatter {
    fn one_shot(self, l: &Limits) -> Result<OneShot, Self> {
        let n = l.world as usize;
        l.fit(self.output.byte_len(), l.window / (n - 1).max(1), self, |r| OneShot::Scatter {
            input: r.input,
            out: r.output,
            root: r.root,
            n,
        })
    }
    fn run(self, e: &mut Engine) -> Result<InOut> {
        e.scatter(self)
    }
}

impl Plan for Gather {
    fn one_shot(self, l: &Limits) -> Result<OneShot, Self> {
        if self.input.byte_len() > l.window {
            return Err(self);
        }
        Ok(OneShot::Gather { input: self.input, out: self.output, root: self.root })
    }
    fn run(self, e: &mut Engine) -> Result<InOut> {
        e.gather(self)
    }
}

/// Point-to-point ops wait in their peer's mailbox queue, not in the collective order.
impl Plan for SendTo {
    const P2P: bool = true;
    fn accept(p: Box<Pending<Self>>, e: &mut Engine) {
        e.queue_send(p.req, p.done);
    }
}

impl Plan for RecvFrom {
    const P2P: bool = true;
    fn accept(p: Box<Pending<Self>>, e: &mut Engine) {
        e.queue_recv(p.req, p.done);
    }
}
