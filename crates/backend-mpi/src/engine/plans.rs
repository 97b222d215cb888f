//! How each op runs: a plan of nonblocking steps and continuations, built by its `Plan` impl.

use std::time::Instant;

use comm_core::lane::Ticket;
use comm_core::ops::{
    slice_of, AllGather, AllReduce, AllToAll, Barrier, Broadcast, Gather, Op, RecvFrom, Reduce, ReduceScatter, Scatter,
    SendTo,
};
use comm_core::{CommError, Completer, DType, HostBuffer, InOut, OpKind, Rank, ReduceOp};

use crate::raw::{Bufs, Comm, Request};
use crate::{kernels, raw, Reduction};

use super::header::{beside_len, hash_ranks, inline_max, Exchange, Header, OpLabel, INLINE_ANY};
use super::op::{small, Job, NewGroup, Plan, Post};
use super::{Gid, GroupInfo, Params};

/// What a group's continuation may use.
#[derive(Clone, Copy)]
pub(super) struct Env<'a> {
    pub(super) comm: &'a Comm,
    pub(super) gid: Gid,
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) params: &'a Params,
    pub(super) half: Option<&'a raw::HalfOps>,
    pub(super) pool: &'a Pool,
    /// Every rank held no other group's collective when it sent this op's header (set for its
    /// start): the op may make MPI's blocking calls ([`held`](super::held)).
    pub(super) may_block: bool,
}

/// Spare large buffers, reused for scratch space and outputs: repeated ops of one size then
/// neither allocate nor page-fault. Every buffer taken from it is completely overwritten by
/// MPI or by a reduction before anyone reads it.
#[derive(Default)]
pub(super) struct Pool {
    pub(super) spare: std::cell::RefCell<Vec<HostBuffer>>,
}

impl Pool {
    /// Smaller buffers are cheap to allocate (zeroing one costs about what reusing it saves).
    const MIN: usize = 16 << 10;
    /// At most this many bytes are kept.
    const MAX_BYTES: usize = 256 << 20;

    /// A buffer of `len` elements whose contents will all be overwritten (a kept one when
    /// there is one of that size: not zeroed).
    pub(super) fn buffer(&self, dtype: DType, len: usize) -> HostBuffer {
        let bytes = len * dtype.size();
        if bytes >= Pool::MIN {
            let mut spare = self.spare.borrow_mut();
            if let Some(i) = spare.iter().position(|b| b.byte_len() == bytes) {
                let mut b = spare.swap_remove(i);
                b.reshape(dtype, len);
                return b;
            }
        }
        HostBuffer::zeroed(dtype, len)
    }
}

impl Env<'_> {
    /// A buffer of `len` elements whose contents will all be overwritten.
    pub(super) fn buffer(&self, dtype: DType, len: usize) -> HostBuffer {
        self.pool.buffer(dtype, len)
    }

    /// Keeps a buffer nobody uses any more for [`Env::buffer`].
    pub(super) fn recycle(&self, b: Option<HostBuffer>) {
        let Some(b) = b.filter(|b| b.byte_len() >= Pool::MIN) else { return };
        let mut spare = self.pool.spare.borrow_mut();
        spare.push(b);
        while spare.len() > 4 || spare.iter().map(HostBuffer::byte_len).sum::<usize>() > Pool::MAX_BYTES {
            spare.remove(0);
        }
    }
}

pub(super) type Cont = Box<dyn FnOnce(&Env<'_>, Bufs) -> Result<Step, CommError> + Send>;

/// How a planned collective starts, once every rank agreed on its header; given the gathered
/// exchange when it carried every rank's [`Steps::payload`] or [`Steps::whole`] (then the op
/// finishes from it).
pub(super) type Start = Box<dyn FnOnce(&Env<'_>, Option<&mut Exchange>) -> Result<Step, CommError> + Send>;

pub(super) enum Step {
    /// Wait for the request, then continue.
    Wait(Request, Cont),
    /// Finished with this output.
    Done(Out),
}

pub(super) enum Out {
    Buf(HostBuffer),
    Io(InOut),
    Unit,
    Comm(Option<Comm>),
}

pub(super) fn wait(
    req: Request,
    cont: impl FnOnce(&Env<'_>, Bufs) -> Result<Step, CommError> + Send + 'static,
) -> Step {
    Step::Wait(req, Box::new(cont))
}

pub(super) fn done(b: HostBuffer) -> Result<Step, CommError> {
    Ok(Step::Done(Out::Buf(b)))
}

/// A finished op that hands back the buffer it read and the one it filled.
pub(super) fn done_io(input: HostBuffer, output: HostBuffer) -> Result<Step, CommError> {
    Ok(Step::Done(Out::Io(InOut { input, output })))
}

pub(super) fn internal(what: &str) -> CommError {
    CommError::Backend { backend: "mpi", source: format!("internal error: {what}").into() }
}

pub(super) fn take(b: Option<HostBuffer>) -> Result<HostBuffer, CommError> {
    b.ok_or_else(|| internal("a completed request did not hand its buffer back"))
}

/// Communicators made by `new_group` (`None` on non-members), with their parent and who waits.
pub(super) type Born = Vec<(Gid, Option<Comm>, Completer<Option<GroupInfo>>)>;

/// Who gets the result.
pub(super) enum Reply {
    Buf(Completer<HostBuffer>),
    Io(Completer<InOut>),
    Unit(Completer<()>),
    Group(Completer<Option<GroupInfo>>),
}

impl Reply {
    /// Completes with `out`; a new group's communicator comes back for the worker to register.
    pub(super) fn complete(self, out: Out) -> Option<(Option<Comm>, Completer<Option<GroupInfo>>)> {
        match (self, out) {
            (Reply::Buf(d), Out::Buf(b)) => d.complete(Ok(b)),
            (Reply::Io(d), Out::Io(io)) => d.complete(Ok(io)),
            (Reply::Unit(d), Out::Unit) => d.complete(Ok(())),
            (Reply::Group(d), Out::Comm(c)) => return Some((c, d)),
            (r, _) => r.fail(internal("an op finished with the wrong kind of output")),
        }
        None
    }

    pub(super) fn fail(self, e: CommError) {
        match self {
            Reply::Buf(d) => d.complete(Err(e)),
            Reply::Io(d) => d.complete(Err(e)),
            Reply::Unit(d) => d.complete(Err(e)),
            Reply::Group(d) => d.complete(Err(e)),
        }
    }
}

/// The running collective of a group.
pub(crate) struct Active {
    /// Keeps the op counted in its group's lane until it is done.
    pub(super) ticket: Option<Ticket>,
    pub(super) what: OpLabel,
    pub(super) started: Instant,
    pub(super) req: Request,
    pub(super) cont: Cont,
    pub(super) reply: Reply,
}

/// An op's steps: its header and how to start it once every rank agreed.
pub struct Steps {
    pub(super) name: &'static str,
    pub(super) header: Header,
    /// What this rank ships in the exchange for an op small enough to finish from it (every
    /// rank of an op with a matching header has one, possibly empty).
    pub(super) payload: Option<Vec<u8>>,
    /// An all_reduce's whole input, shipped with the header (in the slot, what does not fit
    /// beside it); it comes back in the exchange ([`Exchange::take_input`]).
    pub(super) whole: Option<HostBuffer>,
    pub(super) start: Start,
    pub(super) reply: Reply,
}

impl Steps {
    /// An op's steps whose exchange carries at most `payload` (not an all_reduce's whole input).
    pub(super) fn new(
        name: &'static str,
        header: Header,
        payload: Option<Vec<u8>>,
        start: impl FnOnce(&Env<'_>, Option<&mut Exchange>) -> Result<Step, CommError> + Send + 'static,
        reply: Reply,
    ) -> Steps {
        Steps { name, header, payload, whole: None, start: Box::new(start), reply }
    }
}

/// The payload of an op whose data (`bytes` on every rank, by the header) fits the exchange of
/// a group of `n`.
pub(super) fn inline(bytes: usize, n: usize, data: impl FnOnce() -> Vec<u8>) -> Option<Vec<u8>> {
    small(bytes, n).then(data)
}

/// Whether a reduction is done by us (rank order, bit-identical to the reference) rather than
/// by an MPI op: always in exact mode; in native mode for 8-bit integers, which MPI libraries
/// get wrong (Open MPI 4.1's AVX kernels saturate sums instead of wrapping; MPICH 4.0
/// compares `uint8_t` as signed in min/max).
pub(super) fn local_reduction(params: &Params, dtype: DType) -> bool {
    params.reduction == Reduction::Exact || matches!(dtype, DType::U8 | DType::I8)
}

/// Whether a caller's thread may run a native all_reduce of `dtype`: MPI reduces it with a
/// built-in op (f16/bf16 take our user ops, which live on the worker, so those always run
/// there).
pub(super) fn direct_native(params: &Params, dtype: DType) -> bool {
    !local_reduction(params, dtype) && !matches!(dtype, DType::F16 | DType::BF16)
}

/// The MPI op for a reduction MPI performs: built-in for integers and (native mode) f32/f64,
/// our user-defined ops for f16/bf16 (native mode). `Avg` sums; the caller divides.
pub(super) fn mpi_op(env: &Env<'_>, dtype: DType, op: ReduceOp) -> Result<mpi::ffi::MPI_Op, CommError> {
    let unsupported = || CommError::Unsupported { op: "reduction", dtype: Some(dtype), backend: "mpi" };
    match dtype {
        DType::F16 | DType::BF16 => env.half.and_then(|h| h.get(dtype, op)).ok_or_else(unsupported),
        _ => raw::builtin_op(if op == ReduceOp::Avg { ReduceOp::Sum } else { op }).ok_or_else(unsupported),
    }
}

/// Views of `n` consecutive blocks of `len` elements.
pub(super) fn blocks(all: &HostBuffer, n: usize, len: usize) -> Vec<&[u8]> {
    let b = len * all.dtype().size();
    (0..n).map(|i| &all.as_bytes()[i * b..(i + 1) * b]).collect()
}

/// all_reduce (`root == None`) or reduce to `root` in a group of `n`. Non-roots get their
/// input back.
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
    // An all_reduce whose gather of every input stays small (`small_max`, as for exact mode's
    // all-gather) ships its whole input with the header: one round trip, reduced by us in rank
    // order (in native mode too: as fast at these sizes, and exact). In the exchange slot, or
    // for an input longer than that, most of it beside as a message of its own (so an input
    // of exactly 64 KiB is two eager messages over TCP, not a rendezvous, and no copy).
    let gather = root.is_none() && n > 1 && params.check && bytes.saturating_mul(n - 1) <= params.small_max;
    let (payload, whole, input) = if gather && !small(bytes, n) {
        // Ranks that decided otherwise (other sizes, other settings) fail the header check.
        header.extra = bytes as u64;
        (None, Some(buf), None)
    } else {
        (inline(bytes, n, || buf.as_bytes().to_vec()), None, Some(buf))
    };
    let start = move |env: &Env<'_>, ex: Option<&mut Exchange>| -> Result<Step, CommError> {
        let (me, n) = (env.rank, env.size);
        let root = root.map(|r| r as usize);
        let keep = root.is_none_or(|r| r == me);
        if let Some(ex) = ex {
            // Every input came with the headers: reduce them in rank order, no other call.
            let mut buf = input.or_else(|| ex.take_input()).ok_or_else(|| internal("an all_reduce lost its input"))?;
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
        if root.is_none() && env.may_block && !local_reduction(env.params, dtype) {
            // Every rank completed the header exchange, so every rank is in this all_reduce
            // and MPI's blocking call (its fastest algorithms) cannot wait on a missing one.
            // Wherever it runs (a caller's thread or the worker): blocking and nonblocking
            // collectives do not match each other in MPI, so all ranks must make the same call.
            let mut buf = buf;
            raw::allreduce_in_place(env.comm, &mut buf, mpi_op(env, dtype, op)?)?;
            if op == ReduceOp::Avg {
                kernels::divide(&mut buf, n);
            }
            return done(buf);
        }
        if !local_reduction(env.params, dtype) {
            let mpi = mpi_op(env, dtype, op)?;
            let req = match root {
                None => raw::iallreduce_in_place(env.comm, buf, mpi)?,
                Some(r) => {
                    raw::ireduce(env.comm, buf, keep.then(|| env.buffer(dtype, len)), mpi, r as i32, env.may_block)?
                }
            };
            return Ok(wait(req, move |env, b| {
                if !keep {
                    return done(take(b.send)?);
                }
                env.recycle(b.send);
                let mut out = take(b.recv)?;
                if op == ReduceOp::Avg {
                    kernels::divide(&mut out, n);
                }
                done(out)
            }));
        }
        let es = dtype.size();
        if len * es * (n - 1) <= env.params.small_max {
            // Small (a checked all_reduce this small came with the exchange): gather every
            // input, reduce all of them in rank order.
            let all = keep.then(|| env.buffer(dtype, n * len));
            let req = match root {
                None => raw::iallgather(env.comm, buf, take(all)?, env.may_block)?,
                Some(r) => raw::igather(env.comm, buf, all, r as i32, env.may_block)?,
            };
            return Ok(wait(req, move |env, b| {
                let mut buf = take(b.send)?;
                if keep {
                    let all = take(b.recv)?;
                    kernels::reduce(dtype, op, &blocks(&all, n, len), buf.as_bytes_mut());
                    env.recycle(Some(all));
                }
                done(buf)
            }));
        }
        // Large: chunk by chunk (so each chunk's traffic and reduction stay in cache), rank j
        // reduces slice j of the chunk of every input (in rank order), then the reduced slices
        // are gathered (to every rank, or the root).
        let per = (env.params.chunk / es).max(16 * n);
        let chunks = Chunks { dtype, op, len, root, per };
        if env.may_block {
            // After a completed exchange: MPI's blocking calls (see the native case).
            let mut buf = buf;
            reduce_blocking(env, &mut buf, chunks)?;
            return done(buf);
        }
        large_reduce(env, buf, 0, chunks)
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

/// `(offset, length)` in elements.
type Part = (usize, usize);

/// The slices of a chunk of `clen` elements at `off`: rank `j` reduces part `j`.
fn chunk_parts(off: usize, clen: usize, n: usize) -> Vec<Part> {
    (0..n)
        .map(|j| {
            let r = slice_of(clen, n, j);
            (off + r.start, r.len())
        })
        .collect()
}

/// The send and receive parts of a chunk's alltoallv without our own slice, which the
/// reduction reads where it is (a copy through the receive buffer would add a pass over it
/// to a memory-bound op: 16 MiB ran at 0.72 of MPI's own all_reduce with it).
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

/// A large exact all_reduce or reduce with MPI's blocking calls, chunk by chunk: the same
/// slices, rank order and kernel as [`large_reduce`], each rank's reduced slice gathered in
/// place (`MPI_IN_PLACE`: written into its place of `buf` first) to every rank, or to the
/// root (a non-root keeps its input, and sends its slice from a scratch buffer).
fn reduce_blocking(env: &Env<'_>, buf: &mut HostBuffer, c: Chunks) -> Result<(), CommError> {
    let (me, n, dtype, es) = (env.rank, env.size, c.dtype, c.dtype.size());
    let mut off = 0;
    while off < c.len {
        let clen = c.per.min(c.len - off);
        let parts = chunk_parts(off, clen, n);
        let (at, mine) = parts[me];
        let (send_parts, recv_parts) = peer_parts(&parts, me);
        let mut slices = env.buffer(dtype, n * mine);
        raw::alltoallv(env.comm, buf, &send_parts, &mut slices, &recv_parts)?;
        match c.root {
            Some(r) if r != me => {
                let mut reduced = env.buffer(dtype, mine);
                let own = kernels::Src::Buf(&buf.as_bytes()[at * es..(at + mine) * es]);
                reduce_slice(&c, (me, n), &slices, own, reduced.as_bytes_mut());
                raw::gatherv(env.comm, Some(&reduced), buf, &parts, r as i32)?;
                env.recycle(Some(reduced));
            }
            root => {
                // The call returned, so our slice of `buf` was sent: it may take the result.
                let out = &mut buf.as_bytes_mut()[at * es..(at + mine) * es];
                reduce_slice(&c, (me, n), &slices, kernels::Src::Out, out);
                match root {
                    None => raw::allgatherv_in_place(env.comm, buf, &parts)?,
                    Some(r) => raw::gatherv(env.comm, None, buf, &parts, r as i32)?,
                }
            }
        }
        env.recycle(Some(slices));
        off += clen;
    }
    Ok(())
}

/// Chunk `[off, off + per)` of a large exact reduction, then the next one.
pub(super) fn large_reduce(env: &Env<'_>, buf: HostBuffer, off: usize, c: Chunks) -> Result<Step, CommError> {
    let (me, n, dtype) = (env.rank, env.size, c.dtype);
    let clen = c.per.min(c.len - off);
    let parts = chunk_parts(off, clen, n);
    let (at, mine) = parts[me];
    let (send_parts, recv_parts) = peer_parts(&parts, me);
    let req = raw::ialltoallv(env.comm, buf, &send_parts, env.buffer(dtype, n * mine), &recv_parts, false)?;
    Ok(wait(req, move |env, b| {
        let (buf, slices) = (take(b.send)?, take(b.recv)?);
        let mut reduced = env.buffer(dtype, mine);
        let es = dtype.size();
        let own = kernels::Src::Buf(&buf.as_bytes()[at * es..(at + mine) * es]);
        reduce_slice(&c, (me, n), &slices, own, reduced.as_bytes_mut());
        env.recycle(Some(slices));
        let next = move |env: &Env<'_>, buf: HostBuffer| {
            if off + clen < c.len {
                large_reduce(env, buf, off + clen, c)
            } else {
                done(buf)
            }
        };
        match c.root {
            None => {
                let req = raw::iallgatherv(env.comm, reduced, buf, &parts)?;
                Ok(wait(req, move |env, b| {
                    env.recycle(b.send);
                    next(env, take(b.recv)?)
                }))
            }
            Some(r) if r == me => {
                let req = raw::igatherv(env.comm, reduced, Some(buf), &parts, r as i32)?;
                Ok(wait(req, move |env, b| {
                    env.recycle(b.send);
                    next(env, take(b.recv)?)
                }))
            }
            Some(r) => {
                // Non-roots keep their input: send the slice, keep `buf` as it is.
                let req = raw::igatherv(env.comm, reduced, None, &parts, r as i32)?;
                Ok(wait(req, move |env, b| {
                    env.recycle(b.send);
                    next(env, buf)
                }))
            }
        }
    }))
}

pub(super) fn plan_reduce_scatter(r: ReduceScatter, reply: Reply, n: usize) -> Steps {
    let (dtype, len, op) = (r.input.dtype(), r.input.len(), r.op);
    let header = Header::new(OpKind::ReduceScatter, Some(dtype), len, None, Some(op));
    let payload = inline(r.input.byte_len(), n, || r.input.as_bytes().to_vec());
    let start = move |env: &Env<'_>, ex: Option<&mut Exchange>| -> Result<Step, CommError> {
        let n = env.size;
        let block = len / n;
        let mut out = r.output.unwrap_or_else(|| env.buffer(dtype, block));
        if let Some(ex) = ex {
            // Every input came with the headers: reduce this rank's block of each, in rank order.
            let (b, all) = (block * dtype.size(), len * dtype.size());
            let ins: Vec<&[u8]> = (0..n).map(|p| &ex.data(p, all)[env.rank * b..(env.rank + 1) * b]).collect();
            kernels::reduce(dtype, op, &ins, out.as_bytes_mut());
            return done_io(r.input, out);
        }
        if !local_reduction(env.params, dtype) {
            let req = raw::ireduce_scatter_block(env.comm, r.input, out, mpi_op(env, dtype, op)?, env.may_block)?;
            return Ok(wait(req, move |_, b| {
                let mut out = take(b.recv)?;
                if op == ReduceOp::Avg {
                    kernels::divide(&mut out, n);
                }
                done_io(take(b.send)?, out)
            }));
        }
        if block == 0 {
            return done_io(r.input, out);
        }
        // Block j of every input to rank j, which reduces them in rank order; chunk by chunk.
        let per = (env.params.chunk / n / dtype.size()).max(16);
        scatter_reduce(env, r.input, out, 0, Chunks { dtype, op, len: block, root: None, per })
    };
    Steps::new("reduce_scatter", header, payload, start, reply)
}

/// Chunk `[off, off + per)` of every block of a large exact reduce_scatter into `out`, then
/// the next one.
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
    let req = raw::ialltoallv(env.comm, input, &send_parts, env.buffer(dtype, n * clen), &recv_parts, false)?;
    Ok(wait(req, move |env, b| {
        let (input, mine) = (take(b.send)?, take(b.recv)?);
        let mut out = out;
        let own = kernels::Src::Buf(&input.as_bytes()[(me * c.len + off) * es..(me * c.len + off + clen) * es]);
        reduce_slice(&c, (me, n), &mine, own, &mut out.as_bytes_mut()[off * es..(off + clen) * es]);
        env.recycle(Some(mine));
        if off + clen < c.len {
            return scatter_reduce(env, input, out, off + clen, c);
        }
        done_io(input, out)
    }))
}

pub(super) fn plan_all_to_all(r: AllToAll, reply: Reply, n: usize) -> Steps {
    let (dtype, es) = (r.input.dtype(), r.input.dtype().size());
    let header = Header::new(OpKind::AllToAll, Some(dtype), 0, None, None);
    let (ins, outs) = r.splits(n as u32);
    // What this rank sends to and expects from each peer: every rank checks every pair, so
    // all of them reach the same verdict. It rides in the exchange when it fits (2n counts),
    // after a flag saying whether the input follows it (when that fits too: then, if every
    // rank's did, the op finishes from the exchange).
    let row: Vec<i64> = ins.iter().chain(&outs).map(|&c| c as i64).collect();
    let with_data = 8 + row.len() * 8 + r.input.byte_len() <= inline_max(n);
    let payload = inline(8 + row.len() * 8, n, || {
        let mut p = Vec::with_capacity(8 + row.len() * 8 + if with_data { r.input.byte_len() } else { 0 });
        p.extend_from_slice(&i64::from(with_data).to_ne_bytes());
        p.extend_from_slice(bytemuck::cast_slice(&row));
        if with_data {
            p.extend_from_slice(r.input.as_bytes());
        }
        p
    });
    let start = move |env: &Env<'_>, ex: Option<&mut Exchange>| -> Result<Step, CommError> {
        let offsets = |v: &[usize]| -> Vec<(usize, usize)> {
            v.iter().scan(0, |at, &c| Some((std::mem::replace(at, *at + c), c))).collect()
        };
        let (send_parts, recv_parts) = (offsets(&ins), offsets(&outs));
        let mut out = r.output.unwrap_or_else(|| env.buffer(dtype, outs.iter().sum()));
        let input = r.input;
        if !env.params.check || n == 1 {
            return ialltoallv(env, input, &send_parts, out, &recv_parts);
        }
        if let Some(ex) = ex {
            let head = |p: usize| bytemuck::pod_collect_to_vec::<u8, i64>(ex.data(p, 8 + 16 * n));
            let heads: Vec<Vec<i64>> = (0..n).map(head).collect();
            let rows: Vec<i64> = heads.iter().flat_map(|h| h[1..].iter().copied()).collect();
            check_splits(&rows, n)?;
            if heads.iter().any(|h| h[0] == 0) {
                return ialltoallv(env, input, &send_parts, out, &recv_parts);
            }
            // Every input came with the headers: take our block of each.
            let me = env.rank;
            for (p, h) in heads.iter().enumerate() {
                let sent = &h[1..=n];
                let at = sent[..me].iter().sum::<i64>() as usize * es;
                let len = sent[me] as usize * es;
                let data = &ex.data(p, 8 + 16 * n + at + len)[8 + 16 * n + at..];
                let (o, l) = recv_parts[p];
                out.as_bytes_mut()[o * es..(o + l) * es].copy_from_slice(data);
            }
            return done_io(input, out);
        }
        // A group too large for the rows in its slots: gather them in a round of their own.
        let req = raw::iallgather(
            env.comm,
            HostBuffer::from_slice(&row),
            HostBuffer::zeroed(DType::I64, 2 * n * n),
            env.may_block,
        )?;
        Ok(wait(req, move |env, b| {
            check_splits(take(b.recv)?.as_slice::<i64>()?, n)?;
            ialltoallv(env, input, &send_parts, out, &recv_parts)
        }))
    };
    Steps::new("all_to_all", header, payload, start, reply)
}

/// The transfer of an all_to_all.
fn ialltoallv(
    env: &Env<'_>,
    input: HostBuffer,
    send_parts: &[Part],
    out: HostBuffer,
    recv_parts: &[Part],
) -> Result<Step, CommError> {
    let req = raw::ialltoallv(env.comm, input, send_parts, out, recv_parts, env.may_block)?;
    Ok(wait(req, |_, b| done_io(take(b.send)?, take(b.recv)?)))
}

/// Checks every rank's all_to_all row (`n` send counts, then `n` receive counts, per rank)
/// against every other's.
fn check_splits(m: &[i64], n: usize) -> Result<(), CommError> {
    for i in 0..n {
        for j in 0..n {
            let (sends, expects) = (m[i * 2 * n + j], m[j * 2 * n + n + i]);
            if sends != expects {
                return Err(CommError::Mismatch {
                    op: "all_to_all",
                    detail: format!(
                        "rank {i} sends {sends} elements to rank {j}, but rank {j}'s output splits expect {expects} from rank {i}"
                    ),
                });
            }
        }
    }
    Ok(())
}

// `d` below is each op's completer (`done` builds a finished step).

/// Largest op (bytes this rank hands in or receives, whichever is more) that a caller runs on
/// its own thread beyond what fits the exchange: once the exchange completed every rank is in
/// the op, so the rest waits for the transfer, not for peers, and a hand-off to the worker and
/// back costs more than a small transfer. Larger ones go to the worker, so that a caller that
/// overlaps its own work with them is not held up (all_reduce excepted: see its `direct`).
const DIRECT_MAX: usize = 1 << 20;

/// Whether a caller may run a transfer of `bytes` (see [`DIRECT_MAX`]).
fn direct_transfer(bytes: usize) -> bool {
    bytes <= DIRECT_MAX
}

/// Whether a caller may run a reduction of `dtype` of `bytes` beyond the exchange: ours, or
/// MPI's built-in ops (f16/bf16 MPI ops live on the worker).
fn direct_reduction(params: &Params, dtype: DType, bytes: usize) -> bool {
    direct_transfer(bytes) && (local_reduction(params, dtype) || direct_native(params, dtype))
}

impl Plan for AllReduce {
    /// Any size: once the exchange completed every rank is in it, so the rest waits for the
    /// transfer, not for peers (f16/bf16 in native mode excepted: their MPI ops live on the
    /// worker).
    fn direct(&self, params: &Params, size: usize) -> bool {
        let dtype = self.buf.dtype();
        small(self.buf.byte_len(), size) || local_reduction(params, dtype) || direct_native(params, dtype)
    }

    fn job(self, d: Completer<HostBuffer>, params: &Params, n: usize) -> Job {
        Job::Collective(plan_reduce(self.buf, self.op, None, Reply::Buf(d), params, n))
    }
}

impl Plan for Reduce {
    fn direct(&self, params: &Params, size: usize) -> bool {
        let bytes = self.buf.byte_len();
        small(bytes, size) || direct_reduction(params, self.buf.dtype(), bytes)
    }

    fn job(self, d: Completer<HostBuffer>, params: &Params, n: usize) -> Job {
        Job::Collective(plan_reduce(self.buf, self.op, Some(self.root), Reply::Buf(d), params, n))
    }
}

impl Plan for ReduceScatter {
    fn direct(&self, params: &Params, size: usize) -> bool {
        let bytes = self.input.byte_len();
        small(bytes, size) || direct_reduction(params, self.input.dtype(), bytes)
    }

    fn job(self, d: Completer<InOut>, _: &Params, n: usize) -> Job {
        Job::Collective(plan_reduce_scatter(self, Reply::Io(d), n))
    }
}

impl Plan for AllToAll {
    /// Its splits fit the exchange: once every rank is in, the rest waits for the transfer.
    fn direct(&self, _: &Params, size: usize) -> bool {
        small(16 * size, size)
    }

    fn job(self, d: Completer<InOut>, _: &Params, n: usize) -> Job {
        Job::Collective(plan_all_to_all(self, Reply::Io(d), n))
    }
}

impl Plan for Broadcast {
    fn direct(&self, _: &Params, size: usize) -> bool {
        small(self.buf.byte_len(), size) || direct_transfer(self.buf.byte_len())
    }

    fn job(self, d: Completer<HostBuffer>, _: &Params, n: usize) -> Job {
        let Broadcast { buf, root } = self;
        let header = Header::new(Self::KIND, Some(buf.dtype()), buf.len(), Some(root), None);
        let payload = inline(buf.byte_len(), n, || buf.as_bytes().to_vec());
        let start = move |env: &Env<'_>, ex: Option<&mut Exchange>| -> Result<Step, CommError> {
            let mut buf = buf;
            if let Some(ex) = ex {
                let bytes = buf.byte_len();
                buf.as_bytes_mut().copy_from_slice(ex.data(root as usize, bytes));
                return done(buf);
            }
            let req = raw::ibcast(env.comm, buf, root as i32, env.may_block)?;
            Ok(wait(req, |_, b| done(take(b.recv)?)))
        };
        Job::Collective(Steps::new(Self::NAME, header, payload, start, Reply::Buf(d)))
    }
}

impl Plan for AllGather {
    fn direct(&self, _: &Params, size: usize) -> bool {
        small(self.input.byte_len(), size) || direct_transfer(self.input.byte_len().saturating_mul(size))
    }

    fn job(self, d: Completer<InOut>, _: &Params, n: usize) -> Job {
        let AllGather { input, output } = self;
        let (dtype, len) = (input.dtype(), input.len());
        let header = Header::new(Self::KIND, Some(dtype), len, None, None);
        let payload = inline(input.byte_len(), n, || input.as_bytes().to_vec());
        let start = move |env: &Env<'_>, ex: Option<&mut Exchange>| -> Result<Step, CommError> {
            let mut out = output.unwrap_or_else(|| env.buffer(dtype, len * env.size));
            if let Some(ex) = ex {
                let b = input.byte_len();
                for p in 0..env.size {
                    out.as_bytes_mut()[p * b..(p + 1) * b].copy_from_slice(ex.data(p, b));
                }
                return done_io(input, out);
            }
            let req = raw::iallgather(env.comm, input, out, env.may_block)?;
            Ok(wait(req, |_, b| done_io(take(b.send)?, take(b.recv)?)))
        };
        Job::Collective(Steps::new(Self::NAME, header, payload, start, Reply::Io(d)))
    }
}

/// Whether a scatter of `block` bytes per rank ships its data in the exchange.
fn scatter_inline(block: usize, size: usize) -> bool {
    block.checked_mul(size).is_some_and(|all| all <= INLINE_ANY)
}

impl Plan for Scatter {
    fn direct(&self, _: &Params, size: usize) -> bool {
        let all = self.output.byte_len().saturating_mul(size);
        scatter_inline(self.output.byte_len(), size) || direct_transfer(all)
    }

    fn job(self, d: Completer<InOut>, _: &Params, _: usize) -> Job {
        let Scatter { input, output, root } = self;
        let dtype = output.dtype();
        let header = Header::new(Self::KIND, Some(dtype), output.len(), Some(root), None);
        // The root's blocks ride in the exchange when they fit in any group's slot; every
        // payload then fits (an input passed off the root too), so every rank gets the
        // exchange's data and decides from the sizes alone, alike.
        let payload = Some(match &input {
            Some(all) if all.byte_len() <= INLINE_ANY => all.as_bytes().to_vec(),
            _ => Vec::new(),
        });
        let start = move |env: &Env<'_>, ex: Option<&mut Exchange>| -> Result<Step, CommError> {
            // Off the root MPI reads no input: one passed anyway comes back as it is.
            let (input, spare) = if env.rank == root as usize { (input, None) } else { (None, input) };
            let b = output.byte_len();
            if let (Some(ex), true) = (ex, scatter_inline(b, env.size)) {
                let mut output = output;
                output.as_bytes_mut().copy_from_slice(&ex.data(root as usize, b * env.size)[env.rank * b..][..b]);
                let input = input.or(spare).unwrap_or_else(|| HostBuffer::zeroed(dtype, 0));
                return done_io(input, output);
            }
            let req = raw::iscatter(env.comm, input, output, root as i32, env.may_block)?;
            Ok(wait(req, move |_, b| {
                let input = b.send.or(spare).unwrap_or_else(|| HostBuffer::zeroed(dtype, 0));
                done_io(input, take(b.recv)?)
            }))
        };
        Job::Collective(Steps::new(Self::NAME, header, payload, start, Reply::Io(d)))
    }
}

impl Plan for Gather {
    fn direct(&self, _: &Params, size: usize) -> bool {
        small(self.input.byte_len(), size) || direct_transfer(self.input.byte_len().saturating_mul(size))
    }

    fn job(self, d: Completer<InOut>, _: &Params, n: usize) -> Job {
        let Gather { input, output, root } = self;
        let (dtype, len) = (input.dtype(), input.len());
        let header = Header::new(Self::KIND, Some(dtype), len, Some(root), None);
        let payload = inline(input.byte_len(), n, || input.as_bytes().to_vec());
        let start = move |env: &Env<'_>, ex: Option<&mut Exchange>| -> Result<Step, CommError> {
            let is_root = env.rank == root as usize;
            // Off the root MPI fills no output: one passed anyway comes back as it is.
            let (out, spare) = match is_root {
                true => (Some(output.unwrap_or_else(|| env.buffer(dtype, len * env.size))), None),
                false => (None, output),
            };
            if let Some(ex) = ex {
                // Every rank's input came with the headers.
                let b = input.byte_len();
                let output = match out {
                    Some(mut out) => {
                        for p in 0..env.size {
                            out.as_bytes_mut()[p * b..(p + 1) * b].copy_from_slice(ex.data(p, b));
                        }
                        out
                    }
                    None => spare.unwrap_or_else(|| HostBuffer::zeroed(dtype, 0)),
                };
                return done_io(input, output);
            }
            let req = raw::igather(env.comm, input, out, root as i32, env.may_block)?;
            Ok(wait(req, move |_, b| {
                let output = b.recv.or(spare).unwrap_or_else(|| HostBuffer::zeroed(dtype, 0));
                done_io(take(b.send)?, output)
            }))
        };
        Job::Collective(Steps::new(Self::NAME, header, payload, start, Reply::Io(d)))
    }
}

impl Plan for Barrier {
    /// It ships no data: the exchange is the whole op.
    fn direct(&self, _: &Params, size: usize) -> bool {
        small(0, size)
    }

    fn job(self, d: Completer<()>, _: &Params, _: usize) -> Job {
        let start = |env: &Env<'_>, _: Option<&mut Exchange>| -> Result<Step, CommError> {
            // With checking on, the header exchange already was a barrier.
            if env.params.check || env.size == 1 {
                return Ok(Step::Done(Out::Unit));
            }
            Ok(wait(raw::ibarrier(env.comm)?, |_, _| Ok(Step::Done(Out::Unit))))
        };
        Job::Collective(Steps::new(
            Self::NAME,
            Header::new(Self::KIND, None, 0, None, None),
            None,
            start,
            Reply::Unit(d),
        ))
    }
}

impl Plan for NewGroup {
    fn job(self, d: Completer<Option<GroupInfo>>, _: &Params, _: usize) -> Job {
        let ranks = self.ranks;
        let mut header = Header::new(Self::KIND, None, ranks.len(), None, None);
        header.extra = hash_ranks(&ranks);
        let start = move |env: &Env<'_>, _: Option<&mut Exchange>| -> Result<Step, CommError> {
            // Every rank of the parent passed the header exchange, so all of them are about to
            // call the (blocking) split: it cannot hang on a missing rank.
            let key = ranks.iter().position(|&r| r as usize == env.rank).map(|p| p as i32);
            let comm = env.comm.split(key).map_err(raw::MpiError::into_comm)?;
            Ok(Step::Done(Out::Comm(comm)))
        };
        Job::Collective(Steps::new(Self::NAME, header, None, start, Reply::Group(d)))
    }
}

/// A user tag must leave MPI's tag room for the dtype bits.
fn check_tag(op: &'static str, tag: u32, info: &GroupInfo) -> Result<(), CommError> {
    if tag > info.tag_max {
        return Err(CommError::invalid(
            op,
            format!(
                "tag {tag} is above this MPI's limit of {} ((MPI_TAG_UB >> 3) - 1: 3 bits carry the dtype, the top tags are the backend's)",
                info.tag_max
            ),
        ));
    }
    Ok(())
}

impl Plan for SendTo {
    const P2P: bool = true;

    fn check(&self, info: &GroupInfo) -> Result<(), CommError> {
        check_tag(Self::NAME, self.tag, info)
    }

    fn job(self, done: Completer<HostBuffer>, _: &Params, _: usize) -> Job {
        Job::P2p(Post { recv: false, buf: self.buf, peer: self.dst, tag: self.tag, done })
    }
}

impl Plan for RecvFrom {
    const P2P: bool = true;

    fn check(&self, info: &GroupInfo) -> Result<(), CommError> {
        check_tag(Self::NAME, self.tag, info)
    }

    fn job(self, done: Completer<HostBuffer>, _: &Params, _: usize) -> Job {
        Job::P2p(Post { recv: true, buf: self.buf, peer: self.src, tag: self.tag, done })
    }
}
