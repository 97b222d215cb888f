use std::sync::Arc;

use async_trait::async_trait;

use crate::ops::{
    AllGather, AllReduce, AllToAll, Barrier, Broadcast, Gather, Recv, Reduce, ReduceScatter, Scatter, Send,
};
use crate::{CommError, Op, Rank, Work};

/// Membership of a group of ranks, and the group-level operations.
#[async_trait]
pub trait Group: std::marker::Send + Sync {
    /// This process's rank in the group.
    fn rank(&self) -> Rank;
    /// Number of ranks in the group.
    fn world_size(&self) -> u32;
    /// Short name of the backend (`"shm"`, `"mpi"`, `"nccl"`, `"local"`).
    fn backend_name(&self) -> &'static str;
    /// Creates a sub-group of `ranks` (ranks of *this* group, strictly increasing).
    ///
    /// Collective: every rank of this group must call it, in the same order as every other
    /// `new_group` call. Members get `Some(group)`, the others `None`. In the new group, rank
    /// `i` is `ranks[i]`.
    async fn new_group(&self, ranks: &[Rank]) -> Result<Option<Arc<dyn Backend>>, CommError>;
    /// Stops the group's worker after the ops already submitted; later ops fail with
    /// [`CommError::Shutdown`]. Idempotent.
    async fn shutdown(&self) -> Result<(), CommError>;
}

/// A backend's (or layer's) implementation of op `R`.
///
/// `submit` is **eager**: the op is issued before it returns, in program order, and the
/// returned [`Work`] only reports completion. So issue order equals program order on every
/// rank and `select!`/`FuturesUnordered` over works can never reorder collectives.
///
/// A layer implements this once for every op:
///
/// ```
/// use comm_core::{Collective, Op, Work};
/// struct Counting<C> { inner: C, count: std::sync::atomic::AtomicUsize }
/// // (Group impl delegating to `inner` omitted from the bound list for brevity)
/// fn submit_counted<C: Collective<R>, R: Op>(c: &Counting<C>, req: R) -> Work<R::Output> {
///     c.count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
///     c.inner.submit(req)
/// }
/// ```
pub trait Collective<R: Op>: Group {
    /// Issues `req` and returns its completion handle.
    fn submit(&self, req: R) -> Work<R::Output>;
}

/// Everything a complete backend implements; used as `Arc<dyn Backend>`.
pub trait Backend:
    Collective<AllReduce>
    + Collective<Broadcast>
    + Collective<Reduce>
    + Collective<AllGather>
    + Collective<ReduceScatter>
    + Collective<AllToAll>
    + Collective<Scatter>
    + Collective<Gather>
    + Collective<Send>
    + Collective<Recv>
    + Collective<Barrier>
{
}

impl<T> Backend for T where
    T: Collective<AllReduce>
        + Collective<Broadcast>
        + Collective<Reduce>
        + Collective<AllGather>
        + Collective<ReduceScatter>
        + Collective<AllToAll>
        + Collective<Scatter>
        + Collective<Gather>
        + Collective<Send>
        + Collective<Recv>
        + Collective<Barrier>
        + ?Sized
{
}

#[cfg(test)]
mod tests {
    use super::*;

    // Compile-only: `dyn Backend` must stay object safe and usable through an Arc.
    #[allow(dead_code)]
    fn object_safe(b: Arc<dyn Backend>) -> Work<()> {
        Collective::<Barrier>::submit(&*b, Barrier)
    }
}
