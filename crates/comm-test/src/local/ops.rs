//! The collectives [`LocalWorld`](super::LocalWorld) runs: for each op what must agree across
//! ranks and how every rank's result is computed with [`reference`](mod@crate::reference),
//! plus `new_group` as a collective of the parent group.

use std::sync::Arc;

use comm_core::ops::{AllGather, AllReduce, AllToAll, Barrier, Broadcast, Gather, Reduce, ReduceScatter, Scatter};
use comm_core::{Backend, CommError, Completer, DType, HostBuffer, InOut, Op, Rank};

use super::{GroupCtx, Payload, Sig};
use crate::reference;

/// A collective the local backend runs: what must agree, and how to compute every rank's result.
pub(super) trait LocalOp: Op + Sized {
    fn sig(&self) -> Sig;
    /// Every rank's output, from every rank's request (index = rank).
    fn run(reqs: Vec<Self>, ctx: &GroupCtx) -> Result<Vec<Self::Output>, CommError>;
}

pub(super) fn fail<R: LocalOp>(p: Payload, e: CommError) {
    if let Ok(p) = p.downcast::<(R, Completer<R::Output>)>() {
        p.1.complete(Err(e));
    }
}

pub(super) fn finish<R: LocalOp>(payloads: Vec<Payload>, ctx: &GroupCtx) {
    let (reqs, dones): (Vec<R>, Vec<Completer<R::Output>>) = payloads
        .into_iter()
        .map(|p| *p.downcast::<(R, Completer<R::Output>)>().expect("matching signatures imply one op type per slot"))
        .unzip();
    match R::run(reqs, ctx) {
        Ok(outs) => dones.into_iter().zip(outs).for_each(|(d, o)| d.complete(Ok(o))),
        Err(e) => {
            if e.poisons_group() {
                ctx.poison(&e.to_string());
            }
            dones.into_iter().for_each(|d| d.complete(Err(e.duplicate())));
        }
    }
}

/// `dst` with `src`'s bytes (same dtype and length): results go into the caller's buffers.
pub(super) fn fill(mut dst: HostBuffer, src: &HostBuffer) -> HostBuffer {
    dst.as_bytes_mut().copy_from_slice(src.as_bytes());
    dst
}

fn data_sig(op: &'static str, buf: &HostBuffer) -> Sig {
    Sig { dtype: Some(buf.dtype()), len: Some(buf.len()), ..Sig::new(op) }
}

impl LocalOp for AllReduce {
    fn sig(&self) -> Sig {
        Sig { reduce: Some(self.op), ..data_sig(Self::NAME, &self.buf) }
    }
    fn run(reqs: Vec<Self>, _: &GroupCtx) -> Result<Vec<HostBuffer>, CommError> {
        let out = reference::reduce(&reqs.iter().map(|r| &r.buf).collect::<Vec<_>>(), reqs[0].op);
        Ok(reqs.into_iter().map(|r| fill(r.buf, &out)).collect())
    }
}

impl LocalOp for Broadcast {
    fn sig(&self) -> Sig {
        Sig { root: Some(self.root), ..data_sig(Self::NAME, &self.buf) }
    }
    fn run(reqs: Vec<Self>, _: &GroupCtx) -> Result<Vec<HostBuffer>, CommError> {
        let data = reqs[reqs[0].root as usize].buf.clone();
        Ok(reqs.into_iter().map(|r| fill(r.buf, &data)).collect())
    }
}

impl LocalOp for Reduce {
    fn sig(&self) -> Sig {
        Sig { root: Some(self.root), reduce: Some(self.op), ..data_sig(Self::NAME, &self.buf) }
    }
    fn run(reqs: Vec<Self>, _: &GroupCtx) -> Result<Vec<HostBuffer>, CommError> {
        let out = reference::reduce(&reqs.iter().map(|r| &r.buf).collect::<Vec<_>>(), reqs[0].op);
        let root = reqs[0].root as usize;
        Ok(reqs.into_iter().enumerate().map(|(i, r)| if i == root { fill(r.buf, &out) } else { r.buf }).collect())
    }
}

impl LocalOp for AllGather {
    fn sig(&self) -> Sig {
        data_sig(Self::NAME, &self.input)
    }
    fn run(reqs: Vec<Self>, _: &GroupCtx) -> Result<Vec<InOut>, CommError> {
        let all = reference::concat(&reqs.iter().map(|r| &r.input).collect::<Vec<_>>());
        Ok(reqs
            .into_iter()
            .map(|r| InOut { output: r.output.map_or_else(|| all.clone(), |o| fill(o, &all)), input: r.input })
            .collect())
    }
}

impl LocalOp for ReduceScatter {
    fn sig(&self) -> Sig {
        Sig { reduce: Some(self.op), ..data_sig(Self::NAME, &self.input) }
    }
    fn run(reqs: Vec<Self>, _: &GroupCtx) -> Result<Vec<InOut>, CommError> {
        let blocks = reference::reduce_scatter(&reqs.iter().map(|r| &r.input).collect::<Vec<_>>(), reqs[0].op);
        Ok(reqs
            .into_iter()
            .zip(blocks)
            .map(|(r, b)| InOut { output: r.output.map_or(b.clone(), |o| fill(o, &b)), input: r.input })
            .collect())
    }
}

impl LocalOp for AllToAll {
    fn sig(&self) -> Sig {
        // Lengths may differ per rank (uneven splits); `run` checks the splits pairwise.
        Sig { dtype: Some(self.input.dtype()), ..Sig::new(Self::NAME) }
    }
    fn run(reqs: Vec<Self>, _: &GroupCtx) -> Result<Vec<InOut>, CommError> {
        let n = reqs.len();
        let splits: Vec<(Vec<usize>, Vec<usize>)> = reqs.iter().map(|r| r.splits(n as u32)).collect();
        for (i, (ins, _)) in splits.iter().enumerate() {
            for (j, (_, outs)) in splits.iter().enumerate() {
                if ins[j] != outs[i] {
                    return Err(CommError::mismatch(
                        Self::NAME,
                        format!(
                            "rank {i} sends {} elements to rank {j} but rank {j} expects {} from rank {i}",
                            ins[j], outs[i]
                        ),
                    ));
                }
            }
        }
        let ins: Vec<Vec<usize>> = splits.into_iter().map(|s| s.0).collect();
        let outs = reference::all_to_all(&reqs.iter().map(|r| &r.input).collect::<Vec<_>>(), &ins);
        Ok(reqs
            .into_iter()
            .zip(outs)
            .map(|(r, b)| InOut { output: r.output.map_or(b.clone(), |o| fill(o, &b)), input: r.input })
            .collect())
    }
}

impl LocalOp for Scatter {
    fn sig(&self) -> Sig {
        Sig { root: Some(self.root), ..data_sig(Self::NAME, &self.output) }
    }
    fn run(reqs: Vec<Self>, _: &GroupCtx) -> Result<Vec<InOut>, CommError> {
        let root = reqs[0].root as usize;
        let input = reqs[root].input.as_ref().expect("validate makes the root pass its input");
        let blocks = reference::scatter(input, reqs.len() as u32);
        Ok(reqs
            .into_iter()
            .zip(blocks)
            .map(|(r, b)| {
                let input = r.input.unwrap_or_else(|| HostBuffer::zeroed(r.output.dtype(), 0));
                InOut { output: fill(r.output, &b), input }
            })
            .collect())
    }
}

impl LocalOp for Gather {
    fn sig(&self) -> Sig {
        Sig { root: Some(self.root), ..data_sig(Self::NAME, &self.input) }
    }
    fn run(reqs: Vec<Self>, _: &GroupCtx) -> Result<Vec<InOut>, CommError> {
        let root = reqs[0].root as usize;
        let all = reference::concat(&reqs.iter().map(|r| &r.input).collect::<Vec<_>>());
        Ok(reqs
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                let output = match (i == root, r.output) {
                    (true, Some(o)) => fill(o, &all),
                    (true, None) => all.clone(),
                    (false, o) => o.unwrap_or_else(|| HostBuffer::zeroed(r.input.dtype(), 0)),
                };
                InOut { input: r.input, output }
            })
            .collect())
    }
}

impl LocalOp for Barrier {
    fn sig(&self) -> Sig {
        Sig::new(Self::NAME)
    }
    fn run(reqs: Vec<Self>, _: &GroupCtx) -> Result<Vec<()>, CommError> {
        Ok(vec![(); reqs.len()])
    }
}

/// `new_group` as a collective of the parent group, so it is matched like any other op.
pub(super) struct NewGroup {
    pub(super) ranks: Vec<Rank>,
}

impl Op for NewGroup {
    type Output = Option<Arc<dyn Backend>>;
    const NAME: &'static str = "new_group";
    fn bytes(&self) -> usize {
        0
    }
    fn dtype(&self) -> Option<DType> {
        None
    }
    fn validate(&self, _: Rank, world: u32) -> Result<(), CommError> {
        if self.ranks.is_empty() {
            return Err(CommError::invalid(Self::NAME, "a group needs at least one rank"));
        }
        if let Some(&r) = self.ranks.iter().find(|&&r| r >= world) {
            return Err(CommError::invalid(
                Self::NAME,
                format!("rank {r} is out of range for a group of {world} ranks"),
            ));
        }
        if self.ranks.windows(2).any(|w| w[0] >= w[1]) {
            return Err(CommError::invalid(Self::NAME, format!("ranks {:?} are not strictly increasing", self.ranks)));
        }
        Ok(())
    }
}
