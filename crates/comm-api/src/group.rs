use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::issuers::Issuers;

use comm_core::ops::{
    AllGather, AllReduce, AllToAll, Barrier, Broadcast, Gather, RecvFrom, Reduce, ReduceScatter, Scatter, SendTo,
};
use comm_core::{
    Backend, Collective, CommError, DType, HostBuffer, InOut, Op, Rank, ReduceOp, StoreKind, Work, WorldInfo,
};

/// A group of ranks and every collective op on it. Cheap to clone.
///
/// Methods return a [`Work`] immediately (the op is already issued); `.await` it, poll
/// `is_completed()`, or `wait()` from synchronous code. Buffers are moved in and handed back.
/// Every rank of the group must call the same ops in the same order.
#[derive(Clone)]
pub struct ProcessGroup {
    backend: Arc<dyn Backend>,
    world: Arc<WorldInfo>,
    /// Global rank of each group rank.
    members: Arc<Vec<Rank>>,
    /// Rank 0 serves the rendezvous store; it must outlive every group created from it.
    _server: Option<Arc<discovery::StoreServer>>,
    /// Why this backend was chosen (for [`ProcessGroup::describe`]).
    chosen: Arc<str>,
    /// The turns of the tasks issuing this group's (or stream's) collectives: the issuer check.
    issuers: Arc<Issuers>,
    /// `COMM_TIMEOUT`: bounds a stream's wait for its peers' ops.
    timeout: Duration,
}

/// What a rooted op ([`ProcessGroup::reduce`], [`ProcessGroup::gather`]) gives a rank: the
/// result on the root, the rank's own input (handed back for reuse) elsewhere.
#[derive(Debug)]
pub enum Rooted {
    /// On the root: the op's result.
    Root(HostBuffer),
    /// On every other rank: its input, unchanged.
    Input(HostBuffer),
}

impl Rooted {
    fn new(root: bool, buf: HostBuffer) -> Rooted {
        if root {
            Rooted::Root(buf)
        } else {
            Rooted::Input(buf)
        }
    }

    /// Whether this rank is the op's root.
    pub fn is_root(&self) -> bool {
        matches!(self, Rooted::Root(_))
    }

    /// The result on the root, `None` elsewhere.
    pub fn into_result(self) -> Option<HostBuffer> {
        match self {
            Rooted::Root(b) => Some(b),
            Rooted::Input(_) => None,
        }
    }

    /// The buffer, whichever it is (to reuse it).
    pub fn into_buffer(self) -> HostBuffer {
        match self {
            Rooted::Root(b) | Rooted::Input(b) => b,
        }
    }
}

/// One point-to-point op of a [`ProcessGroup::batch_isend_irecv`] batch.
#[derive(Debug)]
pub enum P2POp {
    /// Send `buf` to `peer`.
    Send {
        /// Data.
        buf: HostBuffer,
        /// Destination (group rank).
        peer: Rank,
        /// Tag.
        tag: u32,
    },
    /// Receive into `buf` from `peer`.
    Recv {
        /// Receives the data.
        buf: HostBuffer,
        /// Source (group rank).
        peer: Rank,
        /// Tag.
        tag: u32,
    },
}

impl fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("backend", &self.backend.backend_name())
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("members", &self.members)
            .finish()
    }
}

impl ProcessGroup {
    pub(crate) fn new(
        backend: Arc<dyn Backend>,
        world: WorldInfo,
        server: Option<Arc<discovery::StoreServer>>,
        chosen: String,
        timeout: Duration,
    ) -> ProcessGroup {
        let members = (0..backend.world_size()).collect();
        ProcessGroup {
            backend,
            world: Arc::new(world),
            members: Arc::new(members),
            _server: server,
            chosen: chosen.into(),
            issuers: Arc::default(),
            timeout,
        }
    }

    /// This group's description over another backend (a sub-group, a stream) and issuers.
    pub(crate) fn over(&self, backend: Arc<dyn Backend>, issuers: Arc<Issuers>) -> ProcessGroup {
        ProcessGroup { backend, issuers, ..self.clone() }
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Wraps a backend you built yourself (for example `comm_test::LocalWorld` ranks);
    /// `world` describes the process.
    pub fn from_backend(backend: Arc<dyn Backend>, world: WorldInfo) -> ProcessGroup {
        ProcessGroup::new(backend, world, None, "given to from_backend".into(), crate::config::DEFAULT_TIMEOUT)
    }

    /// The backend under this group.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    fn submit<R: Op>(&self, req: R) -> Work<R::Output>
    where
        dyn Backend: Collective<R>,
    {
        // Messages pair per peer and tag, not in the group's order: the issuer check
        // (`issuers`) is for collectives.
        if !R::KIND.is_collective() || !crate::issuers::enabled() {
            return Collective::<R>::submit(&*self.backend, req);
        }
        self.issuers.submit(&self.backend, req)
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> Rank {
        self.backend.rank()
    }

    /// Number of ranks in the group.
    pub fn world_size(&self) -> u32 {
        self.backend.world_size()
    }

    /// This process's rank on its host (from the launcher).
    pub fn local_rank(&self) -> Rank {
        self.world.local_rank
    }

    /// The global rank of group rank `group_rank`, or `None` if out of range.
    pub fn global_rank(&self, group_rank: Rank) -> Option<Rank> {
        self.members.get(group_rank as usize).copied()
    }

    /// Short backend name: `"shm"`, `"mpi"`, `"nccl"`.
    pub fn backend_name(&self) -> &'static str {
        self.backend.backend_name()
    }

    /// How this process found its place in the job, where the store is and why this backend,
    /// in a few lines for logs and bug reports:
    ///
    /// ```text
    /// rank 1/4 (local 1/4), found from Torchrun: RANK=1 WORLD_SIZE=4 LOCAL_RANK=1 ...
    /// store: torch TCPStore at 127.0.0.1:29500 (torchrun's agent store)
    /// backend: shm (auto: every rank is on this host)
    /// ```
    pub fn describe(&self) -> String {
        let w = &*self.world;
        let vars =
            if w.source.variables.is_empty() { "(no variables)".to_owned() } else { w.source.variables.join(" ") };
        let store = match (self.backend_name(), w.store) {
            // MPI's launcher connects the ranks; no store of ours is involved.
            ("mpi", _) => "none (the MPI launcher connects the ranks)".to_owned(),
            ("hier", _) => {
                "none between hosts (the MPI launcher connects them); each host's first rank serves its shm group's on 127.0.0.1"
                    .to_owned()
            }
            (_, StoreKind::Rank0) if w.world_size == 1 => "in-process (single rank)".to_owned(),
            (_, StoreKind::Rank0) => format!("served by rank 0 at {}:{}", w.master_addr, w.master_port),
            (_, StoreKind::External) => format!("external, at {}:{}", w.master_addr, w.master_port),
            (_, StoreKind::Torch) => {
                format!("torch TCPStore at {}:{} (torchrun's agent store)", w.master_addr, w.master_port)
            }
            _ => format!("at {}:{}", w.master_addr, w.master_port),
        };
        let group = if self.members.len() as u32 == w.world_size {
            String::new()
        } else {
            format!("\ngroup: ranks {:?} of the world, this is group rank {}", self.members, self.rank())
        };
        format!(
            "rank {}/{} (local {}/{}), found from {:?}: {vars}\nstore: {store}\nbackend: {} ({}){group}",
            w.rank,
            w.world_size,
            w.local_rank,
            w.local_world_size,
            w.source.launcher,
            self.backend_name(),
            self.chosen
        )
    }

    /// The world as discovered at `init`.
    pub fn world_info(&self) -> &WorldInfo {
        &self.world
    }

    /// A zeroed buffer the backend can use without copying (shm: memory of its shared arena,
    /// which peers map; large buffers are made there anyway once a shm group exists, see
    /// README's "Zero copy"). Plain memory on other backends.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// use comm_api::{DType, ReduceOp};
    /// let pg = comm_api::init(comm_api::Config::single()).await.unwrap();
    /// let mut buf = pg.alloc_buffer(DType::F32, 1 << 20).unwrap();
    /// buf.as_mut_slice::<f32>().unwrap().fill(1.0);
    /// let buf = pg.all_reduce(buf, ReduceOp::Sum).await.unwrap();
    /// assert_eq!(buf.as_slice::<f32>().unwrap()[0], 1.0);
    /// # });
    /// ```
    pub fn alloc_buffer(&self, dtype: DType, len: usize) -> Result<HostBuffer, CommError> {
        self.backend.alloc_buffer(dtype, len)
    }

    /// Every rank ends with `root`'s `buf`.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let pg = comm_api::init(comm_api::Config::single()).await.unwrap();
    /// let b = pg.broadcast(comm_api::HostBuffer::from_slice(&[7u8, 8]), 0).await.unwrap();
    /// assert_eq!(b.to_vec::<u8>().unwrap(), [7, 8]);
    /// # });
    /// ```
    #[doc(alias = "bcast")]
    #[doc(alias = "MPI_Bcast")]
    pub fn broadcast(&self, buf: HostBuffer, root: Rank) -> Work<HostBuffer> {
        self.submit(Broadcast { buf, root })
    }

    /// Every rank ends with the reduction of every rank's `buf` (in place, handed back).
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// use comm_api::{HostBuffer, ReduceOp};
    /// let pg = comm_api::init(comm_api::Config::single()).await.unwrap();
    /// let out = pg.all_reduce(HostBuffer::from_slice(&[1.5f32, 2.0]), ReduceOp::Sum).await.unwrap();
    /// assert_eq!(out.to_vec::<f32>().unwrap(), [1.5, 2.0]); // one rank: the sum of one input
    /// # });
    /// ```
    #[doc(alias = "allreduce")]
    #[doc(alias = "MPI_Allreduce")]
    pub fn all_reduce(&self, buf: HostBuffer, op: ReduceOp) -> Work<HostBuffer> {
        self.submit(AllReduce { buf, op })
    }

    /// DeepSpeed's `inference_all_reduce`: the same as [`all_reduce`](Self::all_reduce), which
    /// already takes the fastest path the backend has — and, unlike DeepSpeed's, honours `op`,
    /// the group and every dtype.
    pub fn inference_all_reduce(&self, buf: HostBuffer, op: ReduceOp) -> Work<HostBuffer> {
        self.all_reduce(buf, op)
    }

    /// `root` ends with the reduction ([`Rooted::Root`]); other ranks get their input back
    /// unchanged ([`Rooted::Input`]).
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// use comm_api::{HostBuffer, ReduceOp};
    /// let pg = comm_api::init(comm_api::Config::single()).await.unwrap();
    /// let r = pg.reduce(HostBuffer::from_slice(&[2i32]), ReduceOp::Sum, 0).await.unwrap();
    /// assert_eq!(r.into_result().unwrap().to_vec::<i32>().unwrap(), [2]); // rank 0 is the root
    /// # });
    /// ```
    pub fn reduce(&self, buf: HostBuffer, op: ReduceOp, root: Rank) -> Work<Rooted> {
        let root_here = self.rank() == root;
        self.submit(Reduce { buf, op, root }).map(move |b| Rooted::new(root_here, b))
    }

    /// Concatenation of every rank's `input`, in rank order (`world_size × len`).
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let pg = comm_api::init(comm_api::Config::single()).await.unwrap();
    /// let all = pg.all_gather(comm_api::HostBuffer::from_slice(&[3i64])).await.unwrap();
    /// assert_eq!(all.to_vec::<i64>().unwrap(), [3]);
    /// # });
    /// ```
    #[doc(alias = "all_gather_into_tensor")]
    #[doc(alias = "allgather")]
    #[doc(alias = "MPI_Allgather")]
    pub fn all_gather(&self, input: HostBuffer) -> Work<HostBuffer> {
        self.submit(AllGather { input, output: None }).map(|io| io.output)
    }

    /// [`all_gather`](Self::all_gather) into a caller's buffer (reused, no allocation); it must
    /// hold `world_size × input.len()` elements of the input's dtype. Both buffers come back.
    #[doc(alias = "all_gather_into_tensor")]
    #[doc(alias = "all_gather_base")]
    pub fn all_gather_into(&self, input: HostBuffer, output: HostBuffer) -> Work<InOut> {
        self.submit(AllGather { input, output: Some(output) })
    }

    /// All-gathers several buffers in one op (DeepSpeed's `all_gather_coalesced`): buffer `i`
    /// of the result holds every rank's buffer `i`, concatenated in rank order. Buffers may
    /// differ in dtype and length, but every rank must pass the same shapes: each rank's
    /// packed data opens with a signature of its shapes, and ranks that disagree get
    /// [`CommError::Mismatch`] on every rank.
    pub fn all_gather_coalesced(&self, inputs: Vec<HostBuffer>) -> Work<Vec<HostBuffer>> {
        const SIG: usize = 8;
        let sig = shape_signature(&inputs);
        let shapes: Vec<(DType, usize)> = inputs.iter().map(|b| (b.dtype(), b.byte_len())).collect();
        let total = SIG + shapes.iter().map(|s| s.1).sum::<usize>();
        let mut packed = match HostBuffer::try_zeroed(DType::U8, total) {
            Ok(p) => p,
            Err(e) => return Work::ready(Err(e)),
        };
        packed.as_bytes_mut()[..SIG].copy_from_slice(&sig.to_le_bytes());
        let mut at = SIG;
        for b in &inputs {
            packed.as_bytes_mut()[at..at + b.byte_len()].copy_from_slice(b.as_bytes());
            at += b.byte_len();
        }
        let n = self.world_size() as usize;
        let me = self.rank();
        self.all_gather(packed).and_then(move |all| {
            let bytes = all.as_bytes();
            let sigs =
                (0..n).map(|r| u64::from_le_bytes(bytes[r * total..r * total + SIG].try_into().expect("8 bytes")));
            check_signatures("all_gather_coalesced", me, sig, sigs)?;
            let mut out = Vec::with_capacity(shapes.len());
            let mut at = SIG;
            for (dtype, len) in shapes {
                let mut b = HostBuffer::try_zeroed(dtype, n * len / dtype.size())?;
                for r in 0..n {
                    let src = &bytes[r * total + at..r * total + at + len];
                    b.as_bytes_mut()[r * len..(r + 1) * len].copy_from_slice(src);
                }
                out.push(b);
                at += len;
            }
            Ok(out)
        })
    }

    /// The first op of a coalesced reduction: an all_gather of this rank's shape signature
    /// and the element count of each packed op, so ranks whose packed ops differ in number
    /// already disagree here (the backend's `Mismatch`, which poisons the group before any
    /// of those ops can pair with another), and ranks whose shapes differ find it in the
    /// signatures once the ops end. Returns the check and the signature.
    fn shapes_agree(&self, bufs: &[HostBuffer], packed: &[usize]) -> (Work<HostBuffer>, u64) {
        let sig = shape_signature(bufs);
        // No u64 dtype: the words travel as i64 bit patterns.
        let mut words = vec![sig as i64];
        words.extend(packed.iter().map(|&c| c as i64));
        (self.all_gather(HostBuffer::from_slice(&words)), sig)
    }

    /// A coalesced reduction's packed ops (`issue` of each), after the shape check
    /// ([`shapes_agree`](Self::shapes_agree)): their results in order, once every rank's shapes
    /// agreed. Nothing is issued when packing failed.
    fn checked_coalesced(
        &self,
        op: &'static str,
        bufs: &[HostBuffer],
        counts: &[usize],
        packed: Result<Vec<HostBuffer>, CommError>,
        issue: impl Fn(HostBuffer) -> Work<HostBuffer>,
    ) -> Work<Vec<HostBuffer>> {
        let packed = match packed {
            Ok(p) => p,
            Err(e) => return Work::ready(Err(e)),
        };
        let (check, sig) = self.shapes_agree(bufs, counts);
        let mut works = vec![check];
        works.extend(packed.into_iter().map(issue));
        let (me, width) = (self.rank(), 1 + counts.len());
        Work::join_all(works).and_then(move |mut results| {
            let sigs = results.remove(0);
            check_signatures(op, me, sig, sigs.as_slice::<i64>()?.chunks(width).map(|w| w[0] as u64))?;
            Ok(results)
        })
    }

    /// All-reduces several buffers with one collective per dtype (DeepSpeed's and torch's
    /// `all_reduce_coalesced`): each dtype's buffers are packed into one, reduced, and handed
    /// back in the order given, as `all_reduce` of each would. Every rank must pass the same
    /// shapes: a small all_gather of their signature goes first, and ranks that disagree get
    /// [`CommError::Mismatch`] on every rank.
    pub fn all_reduce_coalesced(&self, bufs: Vec<HostBuffer>, op: ReduceOp) -> Work<Vec<HostBuffer>> {
        const OP: &str = "all_reduce_coalesced";
        let groups = by_dtype(&bufs);
        let counts: Vec<usize> = groups.iter().map(|(_, m)| m.iter().map(|&i| bufs[i].len()).sum()).collect();
        // Everything is packed before the first op is issued: a failed allocation issues none.
        let packed = groups.iter().map(|(dtype, members)| {
            let total = members.iter().map(|&i| bufs[i].byte_len()).sum();
            let mut packed = HostBuffer::try_zeroed(DType::U8, total)?;
            let mut at = 0;
            for &i in members {
                packed.as_bytes_mut()[at..at + bufs[i].byte_len()].copy_from_slice(bufs[i].as_bytes());
                at += bufs[i].byte_len();
            }
            packed.reshape(*dtype, total / dtype.size());
            Ok(packed)
        });
        let packed = packed.collect::<Result<Vec<_>, CommError>>();
        let reduced = self.checked_coalesced(OP, &bufs, &counts, packed, |p| self.all_reduce(p, op));
        reduced.and_then(move |reduced| {
            let mut bufs = bufs;
            for ((_, members), packed) in groups.iter().zip(reduced) {
                let mut at = 0;
                for &i in members {
                    let n = bufs[i].byte_len();
                    bufs[i].as_bytes_mut().copy_from_slice(&packed.as_bytes()[at..at + n]);
                    at += n;
                }
            }
            Ok(bufs)
        })
    }

    /// Reduce-scatters several buffers with one collective per dtype (`reduce_scatter_coalesced`):
    /// buffer `i` (`world_size × kᵢ` elements) is reduced across ranks and this rank gets its
    /// block `rank` (`kᵢ` elements), as `reduce_scatter` of each would. Shapes are checked
    /// across ranks as in [`all_reduce_coalesced`](Self::all_reduce_coalesced).
    pub fn reduce_scatter_coalesced(&self, inputs: Vec<HostBuffer>, op: ReduceOp) -> Work<Vec<HostBuffer>> {
        let n = self.world_size() as usize;
        if let Some(b) = inputs.iter().find(|b| !b.len().is_multiple_of(n)) {
            return Work::ready(Err(CommError::invalid(
                "reduce_scatter_coalesced",
                format!("a buffer of {} elements is not divisible by the group size {n}", b.len()),
            )));
        }
        let groups = by_dtype(&inputs);
        let counts: Vec<usize> = groups.iter().map(|(_, m)| m.iter().map(|&i| inputs[i].len()).sum()).collect();
        // Rank-major packing: block r of the packed buffer is block r of every member, so the
        // packed reduce_scatter hands each rank exactly its blocks. Everything is packed before
        // the first op is issued: a failed allocation issues none.
        let packed = groups.iter().map(|(dtype, members)| {
            let block: usize = members.iter().map(|&i| inputs[i].byte_len() / n).sum();
            let mut packed = HostBuffer::try_zeroed(DType::U8, block * n)?;
            let mut at = 0;
            for r in 0..n {
                for &i in members {
                    let k = inputs[i].byte_len() / n;
                    packed.as_bytes_mut()[at..at + k].copy_from_slice(&inputs[i].as_bytes()[r * k..(r + 1) * k]);
                    at += k;
                }
            }
            packed.reshape(*dtype, block * n / dtype.size());
            Ok(packed)
        });
        let packed = packed.collect::<Result<Vec<_>, CommError>>();
        let blocks = self
            .checked_coalesced("reduce_scatter_coalesced", &inputs, &counts, packed, |p| self.reduce_scatter(p, op));
        let shapes: Vec<(DType, usize)> = inputs.iter().map(|b| (b.dtype(), b.len() / n)).collect();
        blocks.and_then(move |blocks| {
            let mut out: Vec<Option<HostBuffer>> = shapes.iter().map(|_| None).collect();
            for ((_, members), block) in groups.iter().zip(blocks) {
                let mut at = 0;
                for &i in members {
                    let (dtype, k) = shapes[i];
                    let bytes = k * dtype.size();
                    out[i] = Some(HostBuffer::from_bytes(dtype, &block.as_bytes()[at..at + bytes])?);
                    at += bytes;
                }
            }
            Ok(out.into_iter().flatten().collect())
        })
    }

    /// `input` (`world_size × k` elements) reduced across ranks; rank `r` gets block `r`.
    #[doc(alias = "reduce_scatter_tensor")]
    #[doc(alias = "reduce_scatter_block")]
    #[doc(alias = "MPI_Reduce_scatter_block")]
    pub fn reduce_scatter(&self, input: HostBuffer, op: ReduceOp) -> Work<HostBuffer> {
        self.submit(ReduceScatter { input, op, output: None }).map(|io| io.output)
    }

    /// [`reduce_scatter`](Self::reduce_scatter) into a caller's buffer of `input.len() / world_size`;
    /// both buffers come back.
    #[doc(alias = "reduce_scatter_tensor")]
    #[doc(alias = "reduce_scatter_base")]
    pub fn reduce_scatter_into(&self, input: HostBuffer, op: ReduceOp, output: HostBuffer) -> Work<InOut> {
        self.submit(ReduceScatter { input, op, output: Some(output) })
    }

    /// torch's `all_to_all_single` with equal blocks: block `j` of this rank's input goes to
    /// rank `j`, which stores it as its block `rank`.
    #[doc(alias = "all_to_all")]
    #[doc(alias = "alltoall")]
    #[doc(alias = "MPI_Alltoall")]
    pub fn all_to_all_single(&self, input: HostBuffer) -> Work<HostBuffer> {
        self.submit(AllToAll { input, output: None, input_splits: None, output_splits: None }).map(|io| io.output)
    }

    /// `all_to_all_single` with uneven blocks: `input_splits[j]` elements go to rank `j`,
    /// `output_splits[i]` elements come from rank `i`. Splits that do not match across ranks
    /// give [`CommError::Mismatch`].
    #[doc(alias = "all_to_all_single")]
    #[doc(alias = "alltoallv")]
    #[doc(alias = "MPI_Alltoallv")]
    pub fn all_to_all_single_uneven(
        &self,
        input: HostBuffer,
        input_splits: Vec<usize>,
        output_splits: Vec<usize>,
    ) -> Work<HostBuffer> {
        self.submit(AllToAll {
            input,
            output: None,
            input_splits: Some(input_splits),
            output_splits: Some(output_splits),
        })
        .map(|io| io.output)
    }

    /// `all_to_all_single` into a caller's buffer; `None` splits mean equal blocks. Both
    /// buffers come back.
    pub fn all_to_all_single_into(
        &self,
        input: HostBuffer,
        output: HostBuffer,
        input_splits: Option<Vec<usize>>,
        output_splits: Option<Vec<usize>>,
    ) -> Work<InOut> {
        self.submit(AllToAll { input, output: Some(output), input_splits, output_splits })
    }

    /// Rank `r` receives block `r` of the root's `input` (`world_size × output.len()`) into
    /// `output`. Non-roots pass `None` as input. Both buffers come back (a non-root's input is
    /// empty).
    pub fn scatter(&self, output: HostBuffer, input: Option<HostBuffer>, root: Rank) -> Work<InOut> {
        self.submit(Scatter { output, input, root })
    }

    /// The root receives every rank's `input` concatenated in rank order ([`Rooted::Root`]);
    /// other ranks get their input back ([`Rooted::Input`]).
    pub fn gather(&self, input: HostBuffer, root: Rank) -> Work<Rooted> {
        let root_here = self.rank() == root;
        self.submit(Gather { input, output: None, root })
            .map(move |io| Rooted::new(root_here, if root_here { io.output } else { io.input }))
    }

    /// [`gather`](Self::gather) into a caller's buffer on the root (others pass an empty one, or
    /// any buffer they want back as it is). Both buffers come back.
    #[doc(alias = "gather")]
    pub fn gather_into(&self, input: HostBuffer, output: HostBuffer, root: Rank) -> Work<InOut> {
        self.submit(Gather { input, output: Some(output), root })
    }

    /// Sends `buf` to `dst` (tag 0); the `Work` hands `buf` back once it is sent. Awaiting it
    /// is torch's blocking `send`; not awaiting it right away is `isend`.
    pub fn send(&self, buf: HostBuffer, dst: Rank) -> Work<HostBuffer> {
        self.isend(buf, dst, 0)
    }

    /// Receives from `src` (tag 0) into `buf`, whose dtype and length must match the send.
    pub fn recv(&self, buf: HostBuffer, src: Rank) -> Work<HostBuffer> {
        self.irecv(buf, src, 0)
    }

    /// Tagged send. Messages between two ranks arrive in order; a receive whose tag, dtype
    /// or size differs from the next message is a [`CommError::Mismatch`].
    #[doc(alias = "MPI_Isend")]
    pub fn isend(&self, buf: HostBuffer, dst: Rank, tag: u32) -> Work<HostBuffer> {
        self.submit(SendTo { buf, dst, tag })
    }

    /// Tagged receive.
    #[doc(alias = "MPI_Irecv")]
    pub fn irecv(&self, buf: HostBuffer, src: Rank, tag: u32) -> Work<HostBuffer> {
        self.submit(RecvFrom { buf, src, tag })
    }

    /// Issues every op of `ops` at once (sends and receives progress concurrently, so any
    /// order is deadlock-free) and returns their works in the same order. The sends are issued
    /// first: a backend may wait a moment for a receive's message when it is issued, and the
    /// peers' messages come from their sends. Messages between two ranks still match in the
    /// order of `ops`.
    pub fn batch_isend_irecv(&self, ops: Vec<P2POp>) -> Vec<Work<HostBuffer>> {
        let mut works: Vec<Option<Work<HostBuffer>>> = ops.iter().map(|_| None).collect();
        let (sends, recvs): (Vec<_>, Vec<_>) =
            ops.into_iter().enumerate().partition(|(_, op)| matches!(op, P2POp::Send { .. }));
        for (i, op) in sends.into_iter().chain(recvs) {
            works[i] = Some(match op {
                P2POp::Send { buf, peer, tag } => self.isend(buf, peer, tag),
                P2POp::Recv { buf, peer, tag } => self.irecv(buf, peer, tag),
            });
        }
        works.into_iter().flatten().collect()
    }

    /// Resolves once every rank of the group has entered the barrier.
    #[doc(alias = "MPI_Barrier")]
    pub fn barrier(&self) -> Work<()> {
        self.submit(Barrier)
    }

    /// A sub-group of `ranks` (ranks of this group; sorted like torch does). Collective: every
    /// rank of this group calls it, in the same order relative to other `new_group` calls.
    /// Members get `Some`, the others `None`. Ops on the sub-group involve only its members.
    pub async fn new_group(&self, ranks: &[Rank]) -> Result<Option<ProcessGroup>, CommError> {
        // Backends take strictly increasing ranks; torch accepts any order and sorts.
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        let Some(backend) = self.backend.new_group(&sorted).await? else { return Ok(None) };
        let members = sorted.iter().map(|&r| self.members[r as usize]).collect();
        Ok(Some(ProcessGroup { members: Arc::new(members), ..self.over(backend, Arc::default()) }))
    }

    /// After a rank was lost: a new group of this group's ranks that are still alive,
    /// renumbered in their old order (ULFM's `MPIX_Comm_shrink`, NCCL's `ncclCommShrink`).
    /// Every survivor calls it; they agree through the store on who is left, so each gets the
    /// same group, or an error (a rank that comes after the others decided is left out and
    /// told so). A rank that is alive but does not come within `COMM_TIMEOUT` is left out.
    /// Ops still in flight on this group fail; it is shut down once the new group is up.
    /// Sub-groups and streams are per group: make them again over the new one.
    ///
    /// shm and nccl shrink; mpi and hier fail at once saying why (their MPI libraries cannot
    /// shrink a communicator); see README's "Surviving a lost rank".
    #[doc(alias = "MPIX_Comm_shrink")]
    pub async fn shrink(&self) -> Result<ProcessGroup, CommError> {
        let s = self.backend.shrink().await?;
        let members = s.ranks.iter().map(|&r| self.members[r as usize]).collect();
        Ok(ProcessGroup { members: Arc::new(members), ..self.over(s.group, Arc::default()) })
    }

    /// Admits `n` newcomers, processes that called [`Builder::join`](crate::Builder::join)
    /// (a replacement for a lost rank, e.g. restarted by `commrun --max-restarts`): returns a
    /// new group of this group's ranks, which keep their ranks, and the newcomers after them in
    /// the order they came (NCCL's `ncclCommGrow`). Every member calls it with the same `n`
    /// where its loop allows; it waits up to `COMM_TIMEOUT` for the newcomers. This group is
    /// shut down once the new one is up. The new group is a world of its own: its ranks are
    /// its [`global_rank`](Self::global_rank)s. shm only, like [`shrink`](Self::shrink).
    pub async fn grow(&self, n: u32) -> Result<ProcessGroup, CommError> {
        let backend = self.backend.grow(n).await?;
        let members = (0..backend.world_size()).collect();
        Ok(ProcessGroup { members: Arc::new(members), ..self.over(backend, Arc::default()) })
    }

    /// FlexLLMGen's pipeline helper: the two-rank groups `{r, r+1 mod n}` of a ring, created
    /// in the same order on every rank; returns this rank's `(with previous, with next)`.
    /// Needs at least 2 ranks (with exactly 2, both are the same pair).
    pub async fn pairwise_ring_groups(&self) -> Result<(ProcessGroup, ProcessGroup), CommError> {
        let n = self.world_size();
        if n < 2 {
            return Err(CommError::invalid("pairwise_ring_groups", "needs at least 2 ranks"));
        }
        let me = self.rank();
        let (mut prev, mut next) = (None, None);
        for r in 0..n {
            let pair = [r, (r + 1) % n];
            if n == 2 && r == 1 {
                break; // {0,1} and {1,0} are the same group
            }
            if let Some(g) = self.new_group(&pair).await? {
                if pair[1] == me {
                    prev = Some(g.clone());
                }
                if pair[0] == me {
                    next = Some(g);
                }
            }
        }
        match (prev, next) {
            (Some(p), Some(n)) => Ok((p, n)),
            (Some(p), None) | (None, Some(p)) => Ok((p.clone(), p)),
            (None, None) => Err(CommError::invalid("pairwise_ring_groups", "this rank is in no ring group")),
        }
    }

    /// Stops this group's backend after the ops already issued (torch's
    /// `destroy_process_group`). Later ops fail with [`CommError::Shutdown`].
    pub async fn shutdown(&self) -> Result<(), CommError> {
        self.backend.shutdown().await
    }

    /// Fails this group on every rank (torchcomms' `abort`, NCCL's `ncclCommRevoke`): its ops in
    /// flight and later ones fail here with `Poisoned`, and on the other ranks with `PeerLost`
    /// naming this rank and `reason`, as soon as their backend hears of it (shm, mpi, hier:
    /// within milliseconds; nccl tells no peer, whose ops fail at their timeout). Local, no
    /// wait; the group cannot be used again (make a new one, or `shrink`). On a stream it fails
    /// every arbitrated stream (they share one group).
    pub fn abort(&self, reason: &str) {
        self.backend.abort(&format!("{reason} (ProcessGroup::abort on rank {})", self.rank()));
    }

    /// What failed this group on this rank, once something did (c10d's `get_error`): the
    /// first failure, as every later op reports it (`Poisoned`). `None` while it is healthy,
    /// and on backends without a failure state (`local`, streams).
    pub fn error(&self) -> Option<CommError> {
        self.backend.poison().and_then(|p| p.cause()).map(|cause| CommError::Poisoned { cause })
    }

    /// Runs `hook` once, with the cause, when this group fails on this rank (an op's error
    /// that poisons it, a peer's failure or abort, [`abort`](Self::abort)); at once if it has
    /// already. It runs on the thread that fails the group, often the backend's worker: keep it
    /// short (flip a health flag, send to a channel). `Unsupported` where the backend keeps no
    /// failure state (`local`, streams).
    pub fn on_failure(&self, hook: impl FnOnce(&str) + Send + 'static) -> Result<(), CommError> {
        let poison = self.backend.poison().ok_or(CommError::Unsupported {
            op: "on_failure",
            dtype: None,
            backend: self.backend.backend_name(),
        })?;
        poison.on_set(Box::new(hook));
        Ok(())
    }
}

/// The indices of `bufs` grouped by dtype, groups in order of first appearance (the same on
/// every rank that passes the same shapes, so the collectives line up).
/// FNV-1a over `bytes`: a fingerprint that is the same on every rank.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The shapes of `bufs` (dtype and element count of each, in order) as one word.
fn shape_signature(bufs: &[HostBuffer]) -> u64 {
    let mut bytes = Vec::with_capacity(bufs.len() * 9);
    for b in bufs {
        bytes.push(b.dtype().code());
        bytes.extend_from_slice(&(b.len() as u64).to_le_bytes());
    }
    fnv1a(&bytes)
}

/// `Mismatch` naming the first rank whose shape signature differs from `mine`.
fn check_signatures(op: &'static str, me: Rank, mine: u64, sigs: impl Iterator<Item = u64>) -> Result<(), CommError> {
    match sigs.enumerate().find(|&(_, s)| s != mine) {
        Some((r, _)) => Err(CommError::mismatch(op, format!(
                "rank {r} passed buffers of other dtypes or lengths than rank {me} (every rank must pass the same shapes, in the same order)"
            ))),
        None => Ok(()),
    }
}

fn by_dtype(bufs: &[HostBuffer]) -> Vec<(DType, Vec<usize>)> {
    let mut groups: Vec<(DType, Vec<usize>)> = Vec::new();
    for (i, b) in bufs.iter().enumerate() {
        match groups.iter_mut().find(|(d, _)| *d == b.dtype()) {
            Some((_, members)) => members.push(i),
            None => groups.push((b.dtype(), vec![i])),
        }
    }
    groups
}
