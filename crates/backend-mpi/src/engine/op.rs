//! What this backend needs from each request type ([`Plan`], implemented per op in `plans`),
//! and how a request queued for the worker travels ([`Pending`] behind `Box<dyn Queued>`).

use comm_core::ops::Op;
use comm_core::{CommError, Completer, DType, HostBuffer, OpKind, Rank};

use super::steps::Steps;
use super::{GroupInfo, Params};

/// How one request type runs on this backend. Public only in name (this module is private),
/// as are the types in its signatures: `MpiBackend` implements `Collective<R>` for every
/// `R: Plan`, and a crate-private bound there would be a `private_bounds` warning.
pub trait Plan: Op + Sized {
    /// Point-to-point: posted at once, never queued behind the group's collectives.
    const P2P: bool = false;

    /// Checks against this group's limits at submission, beyond `Op::validate`.
    fn check(&self, _info: &GroupInfo) -> Result<(), CommError> {
        Ok(())
    }

    /// Whether a caller may run it on its own thread while the group's lane is free: ops that
    /// finish from the header exchange, collectives up to `plans::DIRECT_MAX`, and all_reduce.
    fn direct(&self, _params: &Params, _size: usize) -> bool {
        false
    }

    /// What it becomes in a group of `size` ranks (on the worker or a caller's thread).
    fn job(self, done: Completer<Self::Output>, params: &Params, size: usize) -> Job;
}

/// An op ready to run.
pub enum Job {
    /// A collective: the group runs it after the ones submitted before it.
    Collective(Steps),
    /// A send or receive, posted at once.
    P2p(Post),
}

/// A send or receive to post.
pub struct Post {
    pub(super) recv: bool,
    pub(super) buf: HostBuffer,
    pub(super) peer: Rank,
    pub(super) tag: u32,
    pub(super) done: Completer<HostBuffer>,
}

/// An op handed to the worker, whatever its type.
pub(crate) trait Queued: Send {
    fn job(self: Box<Self>, params: &Params, size: usize) -> Job;
    fn fail(self: Box<Self>, e: CommError);
}

/// A request with the completer of its `Work`.
pub(crate) struct Pending<R: Plan> {
    pub(crate) req: R,
    pub(crate) done: Completer<R::Output>,
}

impl<R: Plan> Queued for Pending<R> {
    fn job(self: Box<Self>, params: &Params, size: usize) -> Job {
        let Pending { req, done } = *self;
        req.job(done, params, size)
    }

    fn fail(self: Box<Self>, e: CommError) {
        self.done.complete(Err(e));
    }
}

/// `new_group`'s header agreement and `MPI_Comm_split`, run as a collective of the parent group.
pub(crate) struct NewGroup {
    /// The members, sorted.
    pub(crate) ranks: Vec<Rank>,
}

impl Op for NewGroup {
    type Output = Option<GroupInfo>;
    const KIND: OpKind = OpKind::NewGroup;

    fn bytes(&self) -> usize {
        0
    }

    fn dtype(&self) -> Option<DType> {
        None
    }

    /// Checked by `handle::group_members` before it is built.
    fn validate(&self, _rank: Rank, _world_size: u32) -> Result<(), CommError> {
        Ok(())
    }
}
