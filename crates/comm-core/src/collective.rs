use std::sync::Arc;

use async_trait::async_trait;

use crate::elastic::Shrunk;
use crate::handle::Poison;
use crate::ops::{
    AllGather, AllReduce, AllToAll, Barrier, Broadcast, Gather, RecvFrom, Reduce, ReduceScatter, Scatter, SendTo,
};
use crate::{CommError, DType, HostBuffer, Op, Rank, Work};

/// Membership of a group of ranks, and the group-level operations.
#[async_trait]
pub trait Group: Send + Sync {
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
    /// A zeroed buffer that ops of this backend can use without copying it (shm: memory the
    /// peers map). Plain host memory where the backend has nothing better.
    fn alloc_buffer(&self, dtype: DType, len: usize) -> Result<HostBuffer, CommError> {
        HostBuffer::try_zeroed(dtype, len)
    }
    /// Fails the group on this rank with `cause` (later ops: `Poisoned`) and, where the
    /// backend can, tells the peers, whose ops on it then fail (`PeerLost` naming this rank)
    /// instead of waiting out their timeout. For a layer over several groups (hier) whose op
    /// failed in one of them. Default: nothing.
    fn abort(&self, _cause: &str) {}
    /// The group's failure state on this rank, where the backend keeps one: what failed it, and
    /// the hooks that run when something does. Default: none (the facade's `error()` is then
    /// always `None` and failure hooks are refused).
    fn poison(&self) -> Option<&Poison> {
        None
    }
    /// After a failure: a new group of the ranks of this one that are still alive,
    /// renumbered in their old order, agreed on by every survivor (see [`crate::elastic`]).
    /// Called by every survivor; ops still in flight on this group fail, and its resources
    /// are released once the new group is up. Default: [`CommError::Unsupported`].
    async fn shrink(&self) -> Result<Shrunk, CommError> {
        Err(CommError::Unsupported { op: "shrink", dtype: None, backend: self.backend_name() })
    }
    /// A new group of this group's ranks (keeping their ranks) and `n` newcomers that asked to
    /// join (see [`crate::elastic`]), ranked after them in the order they came. Every member
    /// calls it with the same `n`; it waits up to the group's timeout for the newcomers. This
    /// group is shut down once the new one is up. Default: [`CommError::Unsupported`].
    async fn grow(&self, _n: u32) -> Result<Arc<dyn Backend>, CommError> {
        Err(CommError::Unsupported { op: "grow", dtype: None, backend: self.backend_name() })
    }
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

// Shared handles delegate, so a layer can wrap an `Arc<dyn Backend>` (`Profiling<Arc<dyn
// Backend>>`) with the same generic impl it uses for a concrete backend.
#[async_trait]
impl<T: Group + ?Sized> Group for Arc<T> {
    fn rank(&self) -> Rank {
        (**self).rank()
    }
    fn world_size(&self) -> u32 {
        (**self).world_size()
    }
    fn backend_name(&self) -> &'static str {
        (**self).backend_name()
    }
    async fn new_group(&self, ranks: &[Rank]) -> Result<Option<Arc<dyn Backend>>, CommError> {
        (**self).new_group(ranks).await
    }
    async fn shutdown(&self) -> Result<(), CommError> {
        (**self).shutdown().await
    }
    fn alloc_buffer(&self, dtype: DType, len: usize) -> Result<HostBuffer, CommError> {
        (**self).alloc_buffer(dtype, len)
    }
    fn abort(&self, cause: &str) {
        (**self).abort(cause)
    }
    fn poison(&self) -> Option<&Poison> {
        (**self).poison()
    }
    async fn shrink(&self) -> Result<Shrunk, CommError> {
        (**self).shrink().await
    }
    async fn grow(&self, n: u32) -> Result<Arc<dyn Backend>, CommError> {
        (**self).grow(n).await
    }
}

impl<R: Op, T: Collective<R> + ?Sized> Collective<R> for Arc<T> {
    fn submit(&self, req: R) -> Work<R::Output> {
        (**self).submit(req)
    }
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
    + Collective<SendTo>
    + Collective<RecvFrom>
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
        + Collective<SendTo>
        + Collective<RecvFrom>
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

    // Compile-only: an `Arc` of a backend is itself a backend (what layers wrap), and a
    // generic layer over it is one too.
    #[allow(dead_code)]
    fn arc_is_a_backend(b: Arc<dyn Backend>) -> Arc<dyn Backend> {
        struct Layered<C>(C);
        #[async_trait]
        impl<C: Group> Group for Layered<C> {
            fn rank(&self) -> Rank {
                self.0.rank()
            }
            fn world_size(&self) -> u32 {
                self.0.world_size()
            }
            fn backend_name(&self) -> &'static str {
                self.0.backend_name()
            }
            async fn new_group(&self, ranks: &[Rank]) -> Result<Option<Arc<dyn Backend>>, CommError> {
                self.0.new_group(ranks).await
            }
            async fn shutdown(&self) -> Result<(), CommError> {
                self.0.shutdown().await
            }
        }
        impl<R: Op, C: Collective<R>> Collective<R> for Layered<C> {
            fn submit(&self, req: R) -> Work<R::Output> {
                self.0.submit(req)
            }
        }
        fn takes_backend<B: Backend>(b: B) -> B {
            b
        }
        let _w: Work<()> = takes_backend(b.clone()).submit(Barrier);
        Arc::new(Layered(Arc::new(Layered(b))))
    }
}
