//! all_reduce, reduce and reduce_scatter.

use comm_core::ops::{slice_of, AllReduce, Reduce, ReduceScatter};
use comm_core::{CommError, Completer, DType, HostBuffer, InOut, OpKind, Rank, ReduceOp};

use crate::engine::header::{beside_len, inline_max, Exchange, Header};
use crate::engine::op::{Job, Plan};
use crate::engine::steps::{done, done_io, internal, take, wait, Env, Reply, Step, Steps};
use crate::engine::Params;
use crate::{kernels, raw};

use super::{blocks, direct_native, direct_reduction, local_reduction, mpi_op, Part};

/// all_reduce (`root == None`) or reduce to `root` in a group of `n`; non-roots get their input.
pub(super) fn plan_reduce(
    buf: HostBuffer,
    op: ReduceOp,
    root: Option<Rank>,
    reply: Reply,
    params: &Params,
    n: usize,
) -> Steps {
    let (dtype, len, bytes) = (buf.dtype(), buf.len(), buf.byte_len());
    let (name, code) = if root.is_some() { ("reduce", OpKind::Reduce) } else { ("all_reduce", OpKind::AllReduce) };
    let mut header = Header::new(code, Some(dtype), len, root, Some(op));
    // An all_reduce whose gather of every input stays within `small_max` ships its whole input
    // with the header (one round trip, reduced by us in rank order, in native mode too).
    let gather = root.is_none() && n > 1 && params.check && bytes.saturating_mul(n - 1) <= params.small_max;
    let (payload, whole, input) = if gather && bytes > inline_max(n) {
        // Ranks that decided otherwise (other sizes, other settings) fail the header check.
        header.extra = bytes as u64;
        (None, Some(buf), None)
    } else {
        ((bytes <= inline_max(n)).then(|| buf.as_bytes().to_vec()), None, Some(buf))
    };
    let start = move |env: &Env<'_>, ex: Option<&mut Exchange>| -> Result<Step, CommError> {
        let (me, n, comm, block) = (env.rank, env.size, env.comm, env.may_block);
        let root = root.map(|r| r as usize);
        let keep = root.is_none_or(|r| r == me);
        if let Some(ex) = ex {
            // Every input came with the headers: reduce them in rank order, no other call.
            let mut buf = input.or_else(|| ex.input.take()).ok_or_else(|| internal("an all_reduce lost its input"))?;
            // In two ranges when the start of the inputs came beside the slots.
            let split = beside_len(bytes, n);
            for (lo, hi) in [(0, split), (split, bytes)].into_iter().filter(|(lo, hi)| lo < hi && keep) {
                let ins: Vec<kernels::Src<'_>> = (0..n)
                    .map(|p| if p == me { kernels::Src::Out } else { kernels::Src::Buf(ex.range(p, lo, hi)) })
                    .collect();
                kernels::reduce_to(dtype, op, &ins, &mut buf.as_bytes_mut()[lo..hi], None);
            }
            return done(buf);
        }
        let buf = input.ok_or_else(|| internal("an all_reduce's input went beside an exchange that did not happen"))?;
        if !local_reduction(env.params, dtype) {
            // Where `may_block`, every rank is in this op (the exchange completed), so MPI's
            // blocking call cannot wait on a missing one; on every rank alike, as MPI does not
            // match a blocking collective with a nonblocking one.
            let mpi = mpi_op(env, dtype, op)?;
            let req = match root {
                None => raw::iallreduce_in_place(comm, buf, mpi, block)?,
                Some(r) => raw::ireduce(comm, buf, keep.then(|| env.pool.buffer(dtype, len)), mpi, r as i32, block)?,
            };
            return Ok(wait(req, move |env, b| {
                if !keep {
                    return done(take(b.send)?);
                }
                env.pool.recycle(b.send);
                let mut out = take(b.recv)?;
                if op == ReduceOp::Avg {
                    kernels::divide(&mut out, n);
                }
                done(out)
            }));
        }
        let es = dtype.size();
        if len * es * (n - 1) <= env.params.small_max {
            // Small: gather every input, reduce them in rank order.
            let all = keep.then(|| env.pool.buffer(dtype, n * len));
            let req = match root {
                None => raw::iallgather(env.comm, buf, take(all)?, env.may_block)?,
                Some(r) => raw::igather(env.comm, buf, all, r as i32, env.may_block)?,
            };
            return Ok(wait(req, move |env, b| {
                let mut buf = take(b.send)?;
                if keep {
                    let all = take(b.recv)?;
                    kernels::reduce(dtype, op, &blocks(&all, n, len), buf.as_bytes_mut());
                    env.pool.recycle(Some(all));
                }
                done(buf)
            }));
        }
        // Large: per chunk, rank j reduces slice j of every input, then the slices are gathered.
        let per = (env.params.chunk / es).max(16 * n);
        // After a completed exchange, where `may_block`: MPI's blocking calls (see the native case).
        large_reduce(env, buf, 0, Chunks { dtype, op, len, root, per }, env.may_block)
    };
    Steps { name, header, payload, whole, start: Box::new(start), reply }
}

/// A large exact all_reduce / reduce, processed `per` elements at a time.
#[derive(Clone, Copy)]
pub(super) struct Chunks {
    pub(super) dtype: DType,
    pub(super) op: ReduceOp,
    pub(super) len: usize,
    pub(super) root: Option<usize>,
    pub(super) per: usize,
}

/// The send and receive parts of a chunk's alltoallv without our own slice, which the
/// reduction reads where it is (a copy would add a pass over memory).
fn peer_parts(parts: &[Part], me: usize) -> (Vec<Part>, Vec<Part>) {
    let mine = parts[me].1;
    let mut send = parts.to_vec();
    send[me].1 = 0;
    let recv = (0..parts.len()).map(|i| (i * mine, if i == me { 0 } else { mine })).collect();
    (send, recv)
}

/// Our slice of a chunk reduced in rank order into `out`: each peer's from its block of
/// `slices` (see [`peer_parts`]), ours from `own`.
fn reduce_slice(c: &Chunks, (me, n): (usize, usize), slices: &HostBuffer, own: kernels::Src<'_>, out: &mut [u8]) {
    let peers = blocks(slices, n, out.len() / c.dtype.size());
    let ins: Vec<kernels::Src<'_>> = (0..n).map(|p| if p == me { own } else { kernels::Src::Buf(peers[p]) }).collect();
    kernels::reduce_to(c.dtype, c.op, &ins, out, None);
}

/// Chunk `[off, off + per)` of a large exact reduction, then the next one; with MPI's blocking
/// calls where `block` (each completes at once, so the chunks run back to back).
pub(super) fn large_reduce(
    env: &Env<'_>,
    buf: HostBuffer,
    off: usize,
    c: Chunks,
    block: bool,
) -> Result<Step, CommError> {
    let (me, n, dtype, es) = (env.rank, env.size, c.dtype, c.dtype.size());
    let clen = c.per.min(c.len - off);
    // Rank `j` reduces part `j` of the chunk.
    let parts: Vec<Part> = (0..n).map(|j| slice_of(clen, n, j)).map(|r| (off + r.start, r.len())).collect();
    let (at, mine) = parts[me];
    let (send_parts, recv_parts) = peer_parts(&parts, me);
    let req = raw::ialltoallv(env.comm, buf, &send_parts, env.pool.buffer(dtype, n * mine), &recv_parts, block)?;
    Ok(wait(req, move |env, b| {
        let (mut buf, slices) = (take(b.send)?, take(b.recv)?);
        let slice = at * es..(at + mine) * es;
        // A rank that keeps the result reduces into its slice of `buf`, which the alltoallv has
        // sent, and gathers it from there (`MPI_IN_PLACE`); the others keep their input.
        let (req, kept) = match c.root {
            Some(r) if r != me => {
                let mut reduced = env.pool.buffer(dtype, mine);
                reduce_slice(&c, (me, n), &slices, kernels::Src::Buf(&buf.as_bytes()[slice]), reduced.as_bytes_mut());
                (raw::igatherv(env.comm, Some(reduced), None, &parts, r as i32, block)?, Some(buf))
            }
            root => {
                reduce_slice(&c, (me, n), &slices, kernels::Src::Out, &mut buf.as_bytes_mut()[slice]);
                match root {
                    None => (raw::iallgatherv(env.comm, None, buf, &parts, block)?, None),
                    Some(r) => (raw::igatherv(env.comm, None, Some(buf), &parts, r as i32, block)?, None),
                }
            }
        };
        env.pool.recycle(Some(slices));
        Ok(wait(req, move |env, b| {
            env.pool.recycle(b.send);
            let buf = kept.map_or_else(|| take(b.recv), Ok)?;
            match off + clen < c.len {
                true => large_reduce(env, buf, off + clen, c, block),
                false => done(buf),
            }
        }))
    }))
}

/// Chunk `[off, off + per)` of every block of a large exact reduce_scatter, then the next one.
pub(super) fn scatter_reduce(
    env: &Env<'_>,
    input: HostBuffer,
    out: HostBuffer,
    off: usize,
    c: Chunks,
) -> Result<Step, CommError> {
    let (me, n, dtype, es) = (env.rank, env.size, c.dtype, c.dtype.size());
    let clen = c.per.min(c.len - off);
    let parts: Vec<Part> = (0..n).map(|j| (j * c.len + off, clen)).collect();
    let (send_parts, recv_parts) = peer_parts(&parts, me);
    let req = raw::ialltoallv(env.comm, input, &send_parts, env.pool.buffer(dtype, n * clen), &recv_parts, false)?;
    Ok(wait(req, move |env, b| {
        let (input, mine) = (take(b.send)?, take(b.recv)?);
        let mut out = out;
        let own = kernels::Src::Buf(&input.as_bytes()[(me * c.len + off) * es..(me * c.len + off + clen) * es]);
        reduce_slice(&c, (me, n), &mine, own, &mut out.as_bytes_mut()[off * es..(off + clen) * es]);
        env.pool.recycle(Some(mine));
        if off + clen < c.len {
            return scatter_reduce(env, input, out, off + clen, c);
        }
        done_io(input, out)
    }))
}

impl Plan for AllReduce {
    /// Any size: past the exchange it waits for the transfer, not for peers (native f16/bf16
    /// excepted: their MPI ops live on the worker).
    fn direct(&self, params: &Params, size: usize) -> bool {
        let dtype = self.buf.dtype();
        self.buf.byte_len() <= inline_max(size) || local_reduction(params, dtype) || direct_native(params, dtype)
    }

    fn job(self, d: Completer<HostBuffer>, params: &Params, n: usize) -> Job {
        Job::Collective(plan_reduce(self.buf, self.op, None, Reply::Buf(d), params, n))
    }
}

impl Plan for Reduce {
    fn direct(&self, params: &Params, size: usize) -> bool {
        let bytes = self.buf.byte_len();
        bytes <= inline_max(size) || direct_reduction(params, self.buf.dtype(), bytes)
    }

    fn job(self, d: Completer<HostBuffer>, params: &Params, n: usize) -> Job {
        Job::Collective(plan_reduce(self.buf, self.op, Some(self.root), Reply::Buf(d), params, n))
    }
}

impl Plan for ReduceScatter {
    fn direct(&self, params: &Params, size: usize) -> bool {
        let bytes = self.input.byte_len();
        bytes <= inline_max(size) || direct_reduction(params, self.input.dtype(), bytes)
    }

    fn job(self, d: Completer<InOut>, _: &Params, n: usize) -> Job {
        let ReduceScatter { input, op, output } = self;
        let (dtype, len) = (input.dtype(), input.len());
        let header = Header::new(OpKind::ReduceScatter, Some(dtype), len, None, Some(op));
        let payload = (input.byte_len() <= inline_max(n)).then(|| input.as_bytes().to_vec());
        let start = move |env: &Env<'_>, ex: Option<&mut Exchange>| -> Result<Step, CommError> {
            let n = env.size;
            let block = len / n;
            let mut out = output.unwrap_or_else(|| env.pool.buffer(dtype, block));
            if let Some(ex) = ex {
                // Every input came with the headers: reduce this rank's block of each, in rank order.
                let (b, all) = (block * dtype.size(), len * dtype.size());
                let ins: Vec<&[u8]> = (0..n).map(|p| &ex.data(p, all)[env.rank * b..(env.rank + 1) * b]).collect();
                kernels::reduce(dtype, op, &ins, out.as_bytes_mut());
                return done_io(input, out);
            }
            if !local_reduction(env.params, dtype) {
                let req = raw::ireduce_scatter_block(env.comm, input, out, mpi_op(env, dtype, op)?, env.may_block)?;
                return Ok(wait(req, move |_, b| {
                    let mut out = take(b.recv)?;
                    if op == ReduceOp::Avg {
                        kernels::divide(&mut out, n);
                    }
                    done_io(take(b.send)?, out)
                }));
            }
            if block == 0 {
                return done_io(input, out);
            }
            // Block j of every input to rank j, which reduces them in rank order; chunk by chunk.
            let per = (env.params.chunk / n / dtype.size()).max(16);
            scatter_reduce(env, input, out, 0, Chunks { dtype, op, len: block, root: None, per })
        };
        Job::Collective(Steps::new("reduce_scatter", header, payload, start, Reply::Io(d)))
    }
}
