//! How each op runs: its `Steps` of nonblocking calls and continuations, built by its `Plan`
//! impl (reductions in `reduce`, data movement in `data`; barrier, `new_group` and messages here).

use std::time::Instant;

use comm_core::lane::Ticket;
use comm_core::ops::{Barrier, Op, RecvFrom, SendTo};
use comm_core::{CommError, Completer, DType, HostBuffer, InOut, ReduceOp};

use crate::raw::{Bufs, Comm, Request};
use crate::{raw, Reduction};

use super::header::{hash_ranks, Exchange, Header, OpLabel};
use super::op::{Job, NewGroup, Plan, Post};
use super::{Gid, GroupInfo, Params};

mod data;
mod reduce;

/// `(offset, length)` in elements.
type Part = (usize, usize);

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

/// Spare large buffers, reused for scratch space and outputs (so repeated ops neither allocate
/// nor page-fault); every one taken is completely overwritten before anyone reads it.
#[derive(Default)]
pub(super) struct Pool {
    pub(super) spare: std::cell::RefCell<Vec<HostBuffer>>,
}

impl Pool {
    /// Smaller buffers are cheap to allocate (zeroing one costs about what reusing it saves).
    const MIN: usize = 16 << 10;
    /// At most this many bytes are kept.
    const MAX_BYTES: usize = 256 << 20;

    /// A buffer of `len` elements whose contents will all be overwritten (a kept one is not zeroed).
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

    /// Keeps a buffer nobody uses any more for [`Pool::buffer`].
    pub(super) fn recycle(&self, b: Option<HostBuffer>) {
        let Some(b) = b.filter(|b| b.byte_len() >= Pool::MIN) else { return };
        let mut spare = self.spare.borrow_mut();
        spare.push(b);
        while spare.len() > 4 || spare.iter().map(HostBuffer::byte_len).sum::<usize>() > Pool::MAX_BYTES {
            spare.remove(0);
        }
    }
}

pub(super) type Cont = Box<dyn FnOnce(&Env<'_>, Bufs) -> Result<Step, CommError> + Send>;

/// How a planned collective starts once every rank agreed on its header; given the exchange
/// when it carried every rank's [`Steps::payload`] or [`Steps::whole`].
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
    /// beside it); it comes back in the exchange ([`Exchange::input`]).
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

/// Whether a reduction is done by us (rank order) rather than by an MPI op: always in exact
/// mode; in native mode for 8-bit integers, which MPI libraries get wrong (Open MPI 4.1 saturates
/// sums; MPICH 4.0 compares `uint8_t` as signed in min/max).
pub(super) fn local_reduction(params: &Params, dtype: DType) -> bool {
    params.reduction == Reduction::Exact || matches!(dtype, DType::U8 | DType::I8)
}

/// Whether a caller's thread may run a native all_reduce of `dtype`: a built-in MPI op (our
/// f16/bf16 ops live on the worker).
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

/// Largest op (bytes in or out) a caller runs on its own thread beyond what fits the exchange;
/// larger ones go to the worker, so a caller overlapping its own work is not held up.
const DIRECT_MAX: usize = 1 << 20;

/// Whether a caller may run a reduction of `bytes` beyond the exchange (see [`direct_native`]).
fn direct_reduction(params: &Params, dtype: DType, bytes: usize) -> bool {
    bytes <= DIRECT_MAX && (local_reduction(params, dtype) || direct_native(params, dtype))
}

impl Plan for Barrier {
    /// It ships no data: the exchange is the whole op.
    fn direct(&self, _: &Params, _: usize) -> bool {
        true
    }

    fn job(self, d: Completer<()>, _: &Params, _: usize) -> Job {
        let start = |env: &Env<'_>, _: Option<&mut Exchange>| -> Result<Step, CommError> {
            // With checking on, the header exchange already was a barrier.
            if env.params.check || env.size == 1 {
                return Ok(Step::Done(Out::Unit));
            }
            Ok(wait(raw::ibarrier(env.comm)?, |_, _| Ok(Step::Done(Out::Unit))))
        };
        let header = Header::new(Self::KIND, None, 0, None, None);
        Job::Collective(Steps::new(Self::NAME, header, None, start, Reply::Unit(d)))
    }
}

impl Plan for NewGroup {
    fn job(self, d: Completer<Option<GroupInfo>>, _: &Params, _: usize) -> Job {
        let ranks = self.ranks;
        let mut header = Header::new(Self::KIND, None, ranks.len(), None, None);
        header.extra = hash_ranks(&ranks);
        let start = move |env: &Env<'_>, _: Option<&mut Exchange>| -> Result<Step, CommError> {
            // Every rank passed the header exchange: the blocking split cannot hang on a missing one.
            let key = ranks.iter().position(|&r| r as usize == env.rank).map(|p| p as i32);
            let comm = env.comm.split(key)?;
            Ok(Step::Done(Out::Comm(comm)))
        };
        Job::Collective(Steps::new(Self::NAME, header, None, start, Reply::Group(d)))
    }
}

/// Sends and receives; a user tag must leave MPI's tag room for the dtype bits.
macro_rules! p2p_plan {
    ($op:ty, $recv:literal, $peer:ident) => {
        impl Plan for $op {
            const P2P: bool = true;

            fn check(&self, info: &GroupInfo) -> Result<(), CommError> {
                if self.tag <= info.tag_max {
                    return Ok(());
                }
                Err(CommError::invalid(Self::NAME, format!(
                    "tag {} is above this MPI's limit of {} ((MPI_TAG_UB >> 3) - 1: 3 bits carry the dtype, the top tags are the backend's)",
                    self.tag, info.tag_max
                )))
            }

            fn job(self, done: Completer<HostBuffer>, _: &Params, _: usize) -> Job {
                Job::P2p(Post { recv: $recv, buf: self.buf, peer: self.$peer, tag: self.tag, done })
            }
        }
    };
}

p2p_plan!(SendTo, false, dst);
p2p_plan!(RecvFrom, true, src);
