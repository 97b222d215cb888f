//! How each op runs: through the hierarchy (phases on the inner groups, see the crate docs) or
//! straight to the world group.

use std::sync::Arc;

use comm_core::ops::{
    AllGather, AllReduce, AllToAll, Barrier, Broadcast, Gather, InOut, RecvFrom, Reduce, ReduceScatter, Scatter, SendTo,
};
use comm_core::{Backend, Collective, CommError, DType, HostBuffer, Op, Rank, ReduceOp};

use crate::lane::Issued;
use crate::Layout;

/// What the ops run on (shared with the lane). Public only in name, like [`Plan`].
pub struct Parts {
    pub(crate) world: Arc<dyn Backend>,
    pub(crate) local: Inner,
    /// This rank's rail, when every host has as many ranks (and there are several hosts).
    pub(crate) rail: Option<Inner>,
    /// The leaders' group, on leaders, when there are several hosts.
    pub(crate) leaders: Option<Inner>,
    pub(crate) layout: Layout,
    pub(crate) inline_max: usize,
    pub(crate) rail_min: usize,
}

/// One op's plan. `pub` in name only: it bounds the generic `Collective` impl (a crate-private
/// bound would warn, `private_bounds`).
pub trait Plan: Op + Sized {
    /// Whether it may run on the caller's thread when the lane is idle, given its size.
    fn inline(&self, p: &Parts) -> bool {
        p.inline_max > 0 && self.bytes() <= p.inline_max
    }
    /// Runs the op through its phases, waiting for each.
    fn run(self, p: &Parts) -> Result<Self::Output, CommError>;
    /// Runs (or issues) the op; called on the lane.
    fn issue(self, p: &Parts) -> Issued<Self::Output> {
        Issued::Done(self.run(p))
    }
}

impl Parts {
    /// Every group it runs on: the inner groups, then the world.
    pub(crate) fn groups(&self) -> impl Iterator<Item = &Arc<dyn Backend>> {
        let inner = [Some(&self.local), self.rail.as_ref(), self.leaders.as_ref()];
        inner.into_iter().flatten().map(|i| &i.group).chain([&self.world])
    }
}

/// One of the groups the phases run on.
pub(crate) struct Inner {
    pub(crate) group: Arc<dyn Backend>,
    /// The world rank of each of its ranks.
    pub(crate) members: Vec<Rank>,
    /// `"host"`, `"rail"` or `"leaders"`, for errors.
    pub(crate) name: &'static str,
}

/// Waits for an inner op; its errors name world ranks and the group they came from.
fn wait<R: Op>(inner: &Inner, req: R) -> Result<R::Output, CommError>
where
    dyn Backend: Collective<R>,
{
    let (name, members) = (inner.name, &inner.members);
    Collective::<R>::submit(&*inner.group, req).wait().map_err(|e| match e {
        CommError::PeerLost { rank, detail } => CommError::peer_lost(
            members.get(rank as usize).copied().unwrap_or(rank),
            format!("{detail} (seen in the {name} group {members:?})"),
        ),
        CommError::Mismatch { op, detail } => {
            CommError::mismatch(op, format!("{detail} (in the {name} group {members:?}, by its own ranks)"))
        }
        CommError::Timeout { op, after, detail } => {
            CommError::timeout(op, after, format!("{detail} (in the {name} group {members:?})"))
        }
        other => other,
    })
}

/// Copies `n` elements of `dtype` from `src` at element `from` to `dst` at element `to`.
fn copy(dtype: DType, src: &HostBuffer, from: usize, dst: &mut HostBuffer, to: usize, n: usize) {
    let e = dtype.size();
    dst.as_bytes_mut()[to * e..(to + n) * e].copy_from_slice(&src.as_bytes()[from * e..(from + n) * e]);
}

/// The reduction all ops that reduce share: every host's partial result in local-rank order,
/// then the partials in host order; `Avg` sums and divides by the world size at the end.
fn all_reduce(p: &Parts, buf: HostBuffer, op: ReduceOp) -> Result<HostBuffer, CommError> {
    let partial = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
    let local_n = p.layout.local_size();
    let n = p.layout.world_size() as usize;
    match &p.rail {
        Some(rail) if local_n > 1 && buf.len() >= local_n && buf.byte_len() >= p.rail_min => {
            // Reduce-scatter on the host, all_reduce of each slice on its rail, all_gather on
            // the host: every link carries 1/local_n of the data.
            let (dtype, len) = (buf.dtype(), buf.len());
            let chunk = len.div_ceil(local_n);
            let padded = chunk * local_n;
            let (input, original) = if padded == len {
                (buf, None)
            } else {
                let mut b = HostBuffer::try_zeroed(dtype, padded)?;
                copy(dtype, &buf, 0, &mut b, 0, len);
                (b, Some(buf))
            };
            let InOut { input, output: slice } = wait(&p.local, ReduceScatter { input, op: partial, output: None })?;
            let mut slice = wait(rail, AllReduce { buf: slice, op: partial })?;
            if op == ReduceOp::Avg {
                comm_kernels::divide(&mut slice, n);
            }
            let full = wait(&p.local, AllGather { input: slice, output: Some(input) })?.output;
            Ok(match original {
                None => full,
                Some(mut buf) => {
                    copy(dtype, &full, 0, &mut buf, 0, len);
                    buf
                }
            })
        }
        _ => {
            // Reduce to the host's leader, all_reduce among leaders, broadcast on the host.
            let mut buf = if local_n > 1 { wait(&p.local, Reduce { buf, op: partial, root: 0 })? } else { buf };
            if p.layout.is_leader() {
                if let Some(leaders) = &p.leaders {
                    buf = wait(leaders, AllReduce { buf, op: partial })?;
                }
                if op == ReduceOp::Avg {
                    comm_kernels::divide(&mut buf, n);
                }
            }
            if local_n > 1 {
                buf = wait(&p.local, Broadcast { buf, root: 0 })?;
            }
            Ok(buf)
        }
    }
}

impl Plan for AllReduce {
    fn run(self, p: &Parts) -> Result<HostBuffer, CommError> {
        all_reduce(p, self.buf, self.op)
    }
}

impl Plan for Reduce {
    fn run(self, p: &Parts) -> Result<HostBuffer, CommError> {
        // Non-roots hand back their input unchanged.
        let mine = (self.root != p.layout.rank()).then(|| self.buf.clone());
        let r = all_reduce(p, self.buf, self.op)?;
        Ok(mine.unwrap_or(r))
    }
}

impl Plan for ReduceScatter {
    fn run(self, p: &Parts) -> Result<InOut, CommError> {
        let ReduceScatter { input, op, output } = self;
        let n = p.layout.world_size() as usize;
        let (dtype, k) = (input.dtype(), input.len() / n);
        let me = p.layout.rank() as usize;
        let full = all_reduce(p, input.clone(), op)?;
        let mut out = output.map_or_else(|| HostBuffer::try_zeroed(dtype, k), Ok)?;
        copy(dtype, &full, me * k, &mut out, 0, k);
        Ok(InOut { input, output: out })
    }
}

impl Plan for Broadcast {
    fn run(self, p: &Parts) -> Result<HostBuffer, CommError> {
        let l = &p.layout;
        let Broadcast { mut buf, root } = self;
        let root_host = l.host_of(root).expect("root validated");
        let local_n = l.local_size();
        if l.host() == root_host && local_n > 1 {
            let local_root = l.hosts()[root_host].iter().position(|&r| r == root).expect("root on its host");
            buf = wait(&p.local, Broadcast { buf, root: local_root as u32 })?;
        }
        if let Some(leaders) = &p.leaders {
            // Leaders' ranks are host indices.
            buf = wait(leaders, Broadcast { buf, root: root_host as u32 })?;
        }
        if l.host() != root_host && local_n > 1 {
            buf = wait(&p.local, Broadcast { buf, root: 0 })?;
        }
        Ok(buf)
    }
}

impl Plan for AllGather {
    fn run(self, p: &Parts) -> Result<InOut, CommError> {
        let l = &p.layout;
        let AllGather { input, output } = self;
        if l.hosts().len() == 1 {
            // One host holds every rank, in rank order.
            return wait(&p.local, AllGather { input, output });
        }
        let (dtype, len) = (input.dtype(), input.len());
        let (local_n, max_local) = (l.local_size(), l.max_local());
        let total = len * l.world_size() as usize;
        let mut out = output.map_or_else(|| HostBuffer::try_zeroed(dtype, total), Ok)?;
        let InOut { input, output: mine } = if local_n > 1 {
            wait(&p.local, AllGather { input, output: None })?
        } else {
            InOut { output: input.clone(), input }
        };
        if let Some(leaders) = &p.leaders {
            // Every host's block padded to the largest host, then each rank's piece put
            // at its rank.
            let block = if local_n == max_local {
                mine
            } else {
                let mut b = HostBuffer::try_zeroed(dtype, max_local * len)?;
                copy(dtype, &mine, 0, &mut b, 0, local_n * len);
                b
            };
            let all = wait(leaders, AllGather { input: block, output: None })?.output;
            for (h, ranks) in l.hosts().iter().enumerate() {
                for (i, &r) in ranks.iter().enumerate() {
                    copy(dtype, &all, (h * max_local + i) * len, &mut out, r as usize * len, len);
                }
            }
        }
        if local_n > 1 {
            out = wait(&p.local, Broadcast { buf: out, root: 0 })?;
        }
        Ok(InOut { input, output: out })
    }
}

impl Plan for Barrier {
    fn run(self, p: &Parts) -> Result<(), CommError> {
        // In, among leaders, out: nobody leaves before every host has entered.
        let local = p.layout.local_size() > 1;
        if local {
            wait(&p.local, Barrier)?;
        }
        if let Some(leaders) = &p.leaders {
            wait(leaders, Barrier)?;
        }
        if local && p.layout.hosts().len() > 1 {
            wait(&p.local, Barrier)?;
        }
        Ok(())
    }
}

/// Ops that go straight to the world group: issued in lane order, never waited for there.
macro_rules! straight {
    ($($op:ty),*) => {$(
        impl Plan for $op {
            fn inline(&self, _: &Parts) -> bool {
                true
            }
            fn run(self, p: &Parts) -> Result<<$op as Op>::Output, CommError> {
                Collective::<$op>::submit(&*p.world, self).wait()
            }
            fn issue(self, p: &Parts) -> Issued<<$op as Op>::Output> {
                Issued::Straight(Collective::<$op>::submit(&*p.world, self))
            }
        }
    )*};
}
straight!(AllToAll, Scatter, Gather, SendTo, RecvFrom);
