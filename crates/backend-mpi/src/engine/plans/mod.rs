//! How each op runs: its `Steps` of nonblocking calls and continuations, built by its `Plan`
//! impl (reductions in `reduce`, data movement in `data`; barrier, `new_group` and messages here).

use comm_core::ops::{Barrier, Op, RecvFrom, SendTo};
use comm_core::{CommError, Completer, DType, HostBuffer, ReduceOp};

use crate::{raw, Reduction};

use super::header::{hash_ranks, Exchange, Header};
use super::op::{Job, NewGroup, Plan, Post};
use super::steps::{wait, Env, Out, Reply, Step, Steps};
use super::{GroupInfo, Params};

mod data;
mod reduce;

/// `(offset, length)` in elements.
type Part = (usize, usize);

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
