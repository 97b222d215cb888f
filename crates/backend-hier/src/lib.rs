//! The hierarchical backend: shared memory inside each host, MPI between hosts. A
//! [`HierBackend`] is composed from the world group (MPI) and this host's group (shm) it is
//! handed, and derives the rails and the leaders' group from the world with `new_group`.
//! Every op of the group and its sub-groups takes one lane (`lane`), so every rank issues its
//! inner groups' ops in one order. The phases of each op and the fixed reduction order (host
//! by host, in rank order): ARCHITECTURE.md, "Several hosts (hier)".

#![forbid(unsafe_code)]

use std::sync::Arc;

use async_trait::async_trait;
use comm_core::config;
use comm_core::elastic::Shrunk;
use comm_core::handle::{group_members, shutdown_done, Admission, Poison};
use comm_core::ops::AllReduce;
use comm_core::{Backend, Collective, CommError, Group, HostBuffer, Op, Rank, ReduceOp, Work};

mod lane;
mod layout;
mod plans;

use lane::{Issued, Lane};
pub use layout::{from_leader, Layout};
use plans::{Inner, Parts, Plan};

/// Tuning of a [`HierBackend`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HierOptions {
    /// Ops of at most this many bytes run on the caller's thread when the group is idle
    /// (`COMM_HIER_INLINE_MAX`); larger ones are handed to the group's thread. 0: none (a
    /// caller then never blocks, which several ranks driven by one thread need).
    pub inline_max: usize,
    /// all_reduce of at least this many bytes goes over the rails (every rank sends a slice);
    /// smaller ones through the host leaders only (fewer, larger messages between hosts)
    /// (`COMM_HIER_RAIL_MIN`). `None`: 16 KiB when every rank has a core of its own on its
    /// machine, else never (on a machine whose cores its ranks share — containers, simulated
    /// hosts — a rank driving each rail only takes cores from the others); agreed by all ranks.
    pub rail_min: Option<usize>,
}

impl Default for HierOptions {
    fn default() -> Self {
        HierOptions { inline_max: 64 << 10, rail_min: None }
    }
}

impl HierOptions {
    /// Defaults with the `COMM_HIER_*` variables applied.
    pub fn from_env() -> Result<Self, CommError> {
        let d = HierOptions::default();
        Ok(HierOptions {
            inline_max: config::env_parse("COMM_HIER_INLINE_MAX", config::parse_size)?.unwrap_or(d.inline_max),
            rail_min: config::env_parse("COMM_HIER_RAIL_MIN", config::parse_size)?.or(d.rail_min),
        })
    }
}

/// A group whose ranks span hosts: see the crate docs.
pub struct HierBackend {
    parts: Arc<Parts>,
    lane: Arc<Lane>,
    admission: Admission,
}

impl HierBackend {
    /// Composes a hierarchical group from the `world` group and this host's `local` group
    /// (whose rank `i` is this host's `i`-th rank of `layout`). Collective over `world`:
    /// creates the rails and the leaders' group.
    pub async fn new(
        world: Arc<dyn Backend>,
        local: Arc<dyn Backend>,
        layout: Layout,
        opts: HierOptions,
    ) -> Result<HierBackend, CommError> {
        let bad = |why: String| Err(CommError::invalid("hier init", why));
        let (r, n, lr, ln) = (world.rank(), world.world_size(), layout.rank(), layout.world_size());
        if (r, n) != (lr, ln) {
            return bad(format!("the world group is rank {r} of {n}, the layout rank {lr} of {ln}"));
        }
        let (r, n, i, k) =
            (local.rank() as usize, local.world_size() as usize, layout.local_index(), layout.local_size());
        if (r, n) != (i, k) {
            return bad(format!("the local group is rank {r} of {n}, the layout says local index {i} of {k}"));
        }
        let hosts = layout.hosts().to_vec();
        let mut rail = None;
        if hosts.len() > 1 && layout.is_even() && layout.local_size() > 1 {
            // Every rank takes part in creating every rail (new_group is collective).
            for i in 0..layout.local_size() {
                let mut members: Vec<Rank> = hosts.iter().map(|h| h[i]).collect();
                members.sort_unstable();
                let g = world.new_group(&members).await?;
                if i == layout.local_index() {
                    rail = g.map(|group| Inner { group, members, name: "rail" });
                }
            }
        }
        let leaders = match hosts.len() {
            1 => None,
            _ => {
                let members: Vec<Rank> = hosts.iter().map(|h| h[0]).collect();
                world.new_group(&members).await?.map(|group| Inner { group, members, name: "leaders" })
            }
        };
        let local = Inner { group: local, members: hosts[layout.host()].clone(), name: "host" };
        let poison = Poison::new();
        let lane = Lane::start(format!("comm-hier-r{}", layout.rank()), poison.clone())?;
        let admission = Admission::new(layout.rank(), layout.world_size(), poison);
        let rail_min = if let Some(min) = opts.rail_min { min } else { default_rail_min(&*world, &layout).await? };
        let parts = Parts { world, local, rail, leaders, layout, inline_max: opts.inline_max, rail_min };
        Ok(HierBackend { parts: Arc::new(parts), lane: Arc::new(lane), admission })
    }

    /// The hosts and ranks this group spans.
    pub fn layout(&self) -> &Layout {
        &self.parts.layout
    }

    /// A few words on the hosts, the rails and the leaders, for `describe()`.
    pub fn describe(&self) -> String {
        let l = &self.parts.layout;
        let (n, hosts, min) = (l.local_size(), l.hosts().len(), self.parts.rail_min);
        let rails = match &self.parts.rail {
            Some(_) if min == usize::MAX => format!("{n} rails, unused (a machine has fewer cores than ranks)"),
            Some(_) => format!("{n} rails of {hosts} ranks (one per local index) from {min} B"),
            None if hosts > 1 && l.max_local() > 1 => "no rails (hosts differ in rank count)".into(),
            None => "no rails".into(),
        };
        let leaders: Vec<Rank> = l.hosts().iter().map(|h| h[0]).collect();
        format!(
            "{}; shm within each host ({}), MPI between hosts: {rails}, leaders {leaders:?}",
            l.describe(),
            self.parts.local.group.backend_name()
        )
    }
}

/// [`HierOptions::rail_min`]'s default: 16 KiB unless some rank's machine has fewer cores than
/// ranks (one all_reduce over `world`, so every rank decides alike).
async fn default_rail_min(world: &dyn Backend, layout: &Layout) -> Result<usize, CommError> {
    let crowded = i32::from(layout.is_crowded());
    let req = AllReduce { buf: HostBuffer::from_slice(&[crowded]), op: ReduceOp::Max };
    let any = Collective::<AllReduce>::submit(world, req).await?;
    Ok(if any.as_slice::<i32>()?[0] == 0 { 16 << 10 } else { usize::MAX })
}

#[async_trait]
impl Group for HierBackend {
    fn rank(&self) -> Rank {
        self.admission.rank()
    }
    fn world_size(&self) -> u32 {
        self.admission.world()
    }
    fn backend_name(&self) -> &'static str {
        "hier"
    }
    async fn new_group(&self, ranks: &[Rank]) -> Result<Option<Arc<dyn Backend>>, CommError> {
        let ranks = group_members(ranks, self.world_size())?;
        self.admission.check_open()?;
        let l = &self.parts.layout;
        let host = l.host_of(ranks[0]).expect("members checked");
        // Ranks of one host form a sub-group of the host's group (shared memory); only that
        // host's ranks take part. Others span hosts: a sub-group of the MPI world.
        let (parent, ranks) = if ranks.iter().all(|&r| l.host_of(r) == Some(host)) {
            if l.host() != host {
                return Ok(None);
            }
            let on_host = &l.hosts()[host];
            let local: Vec<Rank> =
                ranks.iter().map(|r| on_host.iter().position(|x| x == r).expect("on this host") as Rank).collect();
            (self.parts.local.group.clone(), local)
        } else {
            (self.parts.world.clone(), ranks)
        };
        sub_group(&self.lane, parent, ranks).await
    }
    /// Fails the group here and every inner group it runs on, whose peers (on this host and
    /// the others) are told by theirs.
    fn abort(&self, cause: &str) {
        self.admission.poison().set(cause);
        self.parts.groups().for_each(|g| g.abort(cause));
    }
    fn poison(&self) -> Option<&Poison> {
        Some(self.admission.poison())
    }
    /// Fails at once: between hosts a group runs over MPI, which cannot shrink here.
    async fn shrink(&self) -> Result<Shrunk, CommError> {
        Err(CommError::Unavailable {
            backend: "hier",
            why: "it runs between hosts over MPI, and shrinking an MPI communicator needs ULFM, which the MPI \
                  libraries it supports lack (see the mpi backend's shrink); restart the job instead, or on one host \
                  use the shm backend, which can shrink"
                .into(),
        })
    }
    async fn shutdown(&self) -> Result<(), CommError> {
        if !self.admission.begin_shutdown() {
            return Ok(());
        }
        let p = self.parts.clone();
        let done = self.lane.run(false, move || {
            Issued::Done(futures::executor::block_on(async {
                let mut first = Ok(());
                for g in p.groups() {
                    first = first.and(g.shutdown().await);
                }
                first
            }))
        });
        shutdown_done(done).await
    }
}

impl<R: Plan> Collective<R> for HierBackend {
    fn submit(&self, req: R) -> Work<R::Output> {
        if let Err(e) = self.admission.admit(&req) {
            return Work::ready(Err(e));
        }
        // On the lane: fails fast if the group is poisoned, and poisons the group when a phase
        // fails (the inner groups may be left mid-op).
        let (parts, poison) = (self.parts.clone(), self.admission.poison().clone());
        self.lane.run(req.inline(&parts), move || {
            if let Err(e) = poison.check() {
                return Issued::Done(Err(e));
            }
            match req.issue(&parts) {
                Issued::Done(Err(e)) => {
                    let cause = format!("{} failed: {e}", R::NAME);
                    poison.set(cause.clone());
                    // The inner groups may be left mid-op, with ranks of other hosts waiting in
                    // them: fail them too, so those ranks learn now rather than at their timeout.
                    parts.groups().for_each(|g| g.abort(&cause));
                    Issued::Done(Err(e))
                }
                // The world group it went to poisons itself; so does this group, alike.
                Issued::Straight(w) => Issued::Straight(w.map_err(move |e| {
                    if e.poisons_group() {
                        poison.set(format!("{} failed: {e}", R::NAME));
                    }
                    e
                })),
                done => done,
            }
        })
    }
}

/// `parent.new_group(ranks)` on `lane` (in order with the group's ops; never on the caller's
/// thread: it waits for every member), the members' group wrapped to take the lane too.
async fn sub_group(
    lane: &Arc<Lane>,
    parent: Arc<dyn Backend>,
    ranks: Vec<Rank>,
) -> Result<Option<Arc<dyn Backend>>, CommError> {
    let made = lane.run(false, move || Issued::Done(futures::executor::block_on(parent.new_group(&ranks))));
    let lane = lane.clone();
    Ok(made.await?.map(|inner| Arc::new(Sub { lane, inner }) as Arc<dyn Backend>))
}

/// A sub-group made by [`HierBackend::new_group`]: a host or world sub-group whose ops take the
/// parent's lane, so they stay in program order with the parent's.
struct Sub {
    lane: Arc<Lane>,
    inner: Arc<dyn Backend>,
}

#[async_trait]
impl Group for Sub {
    fn rank(&self) -> Rank {
        self.inner.rank()
    }
    fn world_size(&self) -> u32 {
        self.inner.world_size()
    }
    fn backend_name(&self) -> &'static str {
        self.inner.backend_name()
    }
    async fn new_group(&self, ranks: &[Rank]) -> Result<Option<Arc<dyn Backend>>, CommError> {
        sub_group(&self.lane, self.inner.clone(), ranks.to_vec()).await
    }
    fn abort(&self, cause: &str) {
        self.inner.abort(cause)
    }
    fn poison(&self) -> Option<&Poison> {
        self.inner.poison()
    }
    async fn shutdown(&self) -> Result<(), CommError> {
        let inner = self.inner.clone();
        let done = self.lane.run(false, move || Issued::Done(futures::executor::block_on(inner.shutdown())));
        shutdown_done(done).await
    }
}

impl<R: Op> Collective<R> for Sub
where
    dyn Backend: Collective<R>,
{
    fn submit(&self, req: R) -> Work<R::Output> {
        let inner = self.inner.clone();
        self.lane.run(true, move || Issued::Straight(Collective::<R>::submit(&*inner, req)))
    }
}
