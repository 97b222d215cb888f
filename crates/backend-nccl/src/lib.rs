//! NCCL backend for comm, over [`cudarc`]'s `nccl` and `driver` modules.
//!
//! cudarc is built with `dynamic-loading`: libcuda and libnccl are opened at run time, so this
//! crate builds (and its tests run) on machines with no CUDA toolkit, no NCCL and no GPU.
//! [`is_available`] says, without panicking, whether NCCL can run here and if not what is
//! missing; [`NcclBackend::new`] fails with that same [`CommError::Unavailable`].
//!
//! # How it works
//! - **Bootstrap.** Each rank's worker thread sets up its CUDA device (`rank % devices` unless
//!   [`NcclOptions::device`] says otherwise). Ranks publish `(host, device UUID)` through the
//!   [`Store`] so two ranks on one GPU are refused with a clear error; rank 0 creates the NCCL
//!   unique id and publishes it; once every rank is there, all call `ncclCommInitRank`.
//!   [`Group::new_group`] makes a fresh communicator (fresh id) per sub-group.
//! - **One worker thread per communicator** owns the `!Send` communicator, its CUDA stream,
//!   staging memory and events. Ops go to it over a channel in submission order; it issues them
//!   on its stream and completes each [`Work`] when the CUDA event recorded after the op fires,
//!   so `is_completed()` is an atomic load; `.await` holds a runtime thread only for the 50 µs
//!   its first poll spins where CPUs allow ([`Work::with_spin`]: a small op ends within it).
//! - **Host buffers** ([`HostBuffer`](comm_core::HostBuffer)) are copied through pinned memory into device staging
//!   buffers (pooled) and back; large ones are page-locked for the op and copied directly
//!   ([`NcclOptions::register_min`]). **Device buffers** (`CudaSlice<T>`) go to NCCL as they are,
//!   through the request types of [`device`] (e.g. [`DeviceAllReduce`]) on the same
//!   [`Collective`] trait, on a [`NcclBackend`] handle.
//! - **Ops.** all_reduce (sum, prod, min, max, avg), broadcast, reduce, all_gather and
//!   reduce_scatter are NCCL collectives; all_to_all, scatter and gather are grouped
//!   `ncclSend`/`ncclRecv`; send/recv submitted back to back are batched into one NCCL group
//!   (so `batch_isend_irecv` and a send-then-recv ring cannot deadlock); barrier is a
//!   one-element all_reduce. Every `comm-core` dtype is an NCCL type. Bitwise reductions do not
//!   exist in NCCL: they fail with [`CommError::Unsupported`] (the facade can fall back).
//!   Send/recv tags are not matched (NCCL has none): messages between two ranks match in order.
//! - **Timeouts.** An op not complete [`NcclOptions::timeout`] after it was issued aborts the
//!   communicator (`ncclCommAbort`, which also stops kernels waiting for a dead peer): it fails
//!   with [`CommError::Timeout`] and the group is poisoned (later ops fail fast with
//!   [`CommError::Poisoned`]). A watchdog thread does the same for a call into NCCL that blocks
//!   the host that long. `ncclCommInitRank` cannot be aborted: bootstrap is bounded by the
//!   timeout (the caller gets `Timeout`), and a worker stuck in it is left behind.
//!
//! # Building against another CUDA version
//! The default feature `cuda-12080` pins cudarc's bindings to CUDA 12.8, which run on every
//! driver since 570 (CUDA 13 drivers included). To pick others, build with
//! `default-features = false` and one of the `cuda-*` features, or with no `cuda-*` feature and
//! `CUDARC_CUDA_VERSION=13000` (cudarc's variable) in the build environment. Exactly one must be
//! chosen: cudarc fails to build with none, and with two.
//!
//! # Run-time requirements
//! An NVIDIA driver (libcuda.so.1), NCCL ≥ 2.10 reachable as `libnccl.so` (cudarc does not look
//! for `libnccl.so.2`: a pip-installed NCCL needs a symlink; [`is_available`] says so), one GPU
//! per rank. `NCCL_*` variables (`NCCL_DEBUG=INFO`, `NCCL_SOCKET_IFNAME`...) work as usual.
#![deny(unsafe_code)]

pub mod device;
mod engine;
mod error;
mod ffi;
mod plans;
mod probe;

use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use comm_core::cpus::CpuSet;
use comm_core::elastic::{Elastic, Shrunk};
use comm_core::handle::{self, shutdown_done, Admission, Poison, Subgroups};
use comm_core::ops::Op;
use comm_core::{Backend, Collective, CommError, DType, Group, Rank, Store, Work};
pub use cudarc;
use cudarc::driver::{CudaContext, CudaStream};

pub use device::{
    DeviceAllGather, DeviceAllReduce, DeviceAllToAll, DeviceBroadcast, DeviceElement, DeviceInOut, DeviceRecv,
    DeviceReduce, DeviceReduceScatter, DeviceSend,
};
use engine::{Command, Once, Pending, Plan, Setup};
pub use error::{nccl_description, NcclFailure};
pub use probe::{is_available, NcclInfo, MIN_NCCL};

/// This backend's name in errors and [`Group::backend_name`].
pub const BACKEND: &str = "nccl";

/// Settings of the NCCL backend.
#[derive(Clone, Debug)]
pub struct NcclOptions {
    /// How long bootstrap, and any op, may take before [`CommError::Timeout`] (an op that
    /// times out aborts the communicator).
    pub timeout: Duration,
    /// The CUDA device (ordinal among the visible ones) this rank uses; `None`: `rank % devices`
    /// (`comm-api` passes the local rank).
    pub device: Option<usize>,
    /// How long the worker waits for more point-to-point ops to batch with one it has (they
    /// are issued as one NCCL group). Default 200 µs.
    pub p2p_linger: Duration,
    /// Bytes of staging memory (each of device and pinned host memory) kept for reuse.
    /// Default 256 MiB.
    pub pool_limit: usize,
    /// Host buffers of at least this many bytes are page-locked for the op and copied to and
    /// from the device directly; smaller ones are copied through pooled pinned memory (two
    /// host copies, cheaper than locking pages for small buffers). `None` (the default):
    /// where the two cost the same on this machine, measured once per process
    /// ([`NcclBackend::register_min`] tells).
    pub register_min: Option<usize>,
}

impl Default for NcclOptions {
    fn default() -> Self {
        NcclOptions {
            timeout: Duration::from_secs(300),
            device: None,
            p2p_linger: Duration::from_micros(200),
            pool_limit: 256 << 20,
            register_min: None,
        }
    }
}

impl NcclOptions {
    /// Defaults, overridden by `COMM_NCCL_DEVICE`, `COMM_NCCL_P2P_LINGER_US`,
    /// `COMM_NCCL_POOL_MB` and `COMM_NCCL_REGISTER_MIN` (bytes, binary units allowed: `1MiB`).
    pub fn from_env() -> Result<Self, CommError> {
        let mut o = NcclOptions::default();
        let num = |name: &str| -> Result<Option<u64>, CommError> {
            match std::env::var(name) {
                Err(_) => Ok(None),
                Ok(v) => v
                    .trim()
                    .parse()
                    .map(Some)
                    .map_err(|_| CommError::Config(format!("{name}={v:?} is not a non-negative integer"))),
            }
        };
        if let Some(d) = num("COMM_NCCL_DEVICE")? {
            o.device = Some(d as usize);
        }
        if let Some(us) = num("COMM_NCCL_P2P_LINGER_US")? {
            o.p2p_linger = Duration::from_micros(us);
        }
        if let Some(mb) = num("COMM_NCCL_POOL_MB")? {
            o.pool_limit = (mb as usize) << 20;
        }
        if let Some(b) = comm_core::config::env_parse("COMM_NCCL_REGISTER_MIN", comm_core::config::parse_size)? {
            o.register_min = Some(b);
        }
        Ok(o)
    }
}

/// A diagnostic op: the communicator's stream waits until `release` is set, and the op
/// completes after that. It counts as an op for [`NcclOptions::timeout`], so it is how the
/// abort-on-timeout path is tested on a single GPU. Ops submitted after it queue behind it.
#[derive(Debug, Default, Clone)]
pub struct Stall {
    /// Set it to let the stream go on.
    pub release: Arc<AtomicBool>,
}

impl Op for Stall {
    type Output = ();
    const NAME: &'static str = "stall";
    fn bytes(&self) -> usize {
        0
    }
    fn dtype(&self) -> Option<DType> {
        None
    }
    fn validate(&self, _: Rank, _: u32) -> Result<(), CommError> {
        Ok(())
    }
}

/// Handle to an NCCL process group (one communicator). Cheap to clone; the communicator is
/// destroyed when the last clone is dropped (after the submitted ops) or on
/// [`Group::shutdown`].
#[derive(Clone)]
pub struct NcclBackend {
    inner: Arc<Inner>,
}

struct Inner {
    admission: Admission,
    device: usize,
    tx: Sender<Command>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    store: Arc<dyn Store>,
    opts: NcclOptions,
    subgroups: Subgroups,
    elastic: Elastic,
    info: NcclInfo,
    /// How long a caller's first wait for an op spins ([`Work::with_spin`]).
    spin: Duration,
    register_min: usize,
}

impl std::fmt::Debug for NcclBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclBackend")
            .field("rank", &self.inner.admission.rank())
            .field("world", &self.inner.admission.world())
            .field("device", &self.inner.device)
            .field("group", &self.inner.subgroups.prefix())
            .finish()
    }
}

impl NcclBackend {
    /// Joins the world group: `world` ranks that all call this with the same store.
    pub async fn new(
        store: Arc<dyn Store>,
        rank: Rank,
        world: u32,
        opts: NcclOptions,
    ) -> Result<NcclBackend, CommError> {
        Self::create(store, rank, world, opts, "nccl/world".into()).await
    }

    async fn create(
        store: Arc<dyn Store>,
        rank: Rank,
        world: u32,
        opts: NcclOptions,
        prefix: String,
    ) -> Result<NcclBackend, CommError> {
        if world == 0 || rank >= world {
            return Err(CommError::invalid("nccl init", format!("rank {rank} is not in a world of {world}")));
        }
        let info = is_available()?;
        let device = opts.device.unwrap_or(rank as usize % info.devices);
        if device >= info.devices {
            return Err(CommError::Unavailable {
                backend: BACKEND,
                why: format!(
                    "rank {rank} should use CUDA device {device}, but {} device(s) are visible (one GPU per rank: set COMM_NCCL_DEVICE / LOCAL_RANK, or CUDA_VISIBLE_DEVICES)",
                    info.devices
                ),
            });
        }
        let to = opts.timeout;
        let poison = Poison::new();
        let setup = Setup {
            device,
            rank,
            world,
            timeout: to,
            linger: opts.p2p_linger,
            pool_limit: opts.pool_limit,
            register_min: opts.register_min,
            poison: poison.clone(),
        };
        let (tx, rx) = channel();
        let (init_tx, init_rx) = channel();
        let (ready_once, ready) = Once::with_deadline(to, format!("setting up CUDA device {device}"))?;
        std::thread::Builder::new()
            .name(format!("comm-nccl-r{rank}"))
            .spawn(move || engine::main(setup, ready_once, init_rx, rx))
            .map_err(|e| CommError::io("starting the nccl worker thread", e))?;
        let ready = ready.await?;

        // One GPU per rank: NCCL refuses two ranks on one device, with a less helpful error.
        // The CPUs each rank may use come along: whether callers may spin (below).
        let host = handle::host_identity();
        let mine = CpuSet::append_to(&format!("{host} {}", ready.uuid));
        store.set(&format!("{prefix}/dev/{rank}"), mine.as_bytes()).await?;
        let (me, my_cpus) = CpuSet::split_id(&mine);
        let mut local_cpus = vec![my_cpus];
        for r in (0..world).filter(|&r| r != rank) {
            let theirs = store.get(&format!("{prefix}/dev/{r}"), to).await?;
            let (dev, cpus) = CpuSet::split_id(std::str::from_utf8(&theirs).unwrap_or_default());
            if dev.rsplit_once(' ').is_some_and(|(h, _)| h == host) {
                local_cpus.push(cpus);
            }
            if dev == me {
                return Err(CommError::Unavailable {
                    backend: BACKEND,
                    why: format!(
                        "ranks {} and {} would both use CUDA device {device} (UUID {}) of this host; NCCL needs one GPU per rank",
                        r.min(rank),
                        r.max(rank),
                        ready.uuid
                    ),
                });
            }
        }
        let key = format!("{prefix}/id");
        let id: [u8; ffi::ID_BYTES] = match ready.id {
            Some(id) => {
                store.set(&key, &id).await?;
                id
            }
            None => store.get(&key, to).await?.try_into().map_err(|v: Vec<u8>| {
                CommError::Store(format!(
                    "the NCCL unique id under `{key}` has {} bytes, not {}",
                    v.len(),
                    ffi::ID_BYTES
                ))
            })?,
        };
        // Everyone is here: ncclCommInitRank (which cannot be aborted) should not wait long.
        store.set(&format!("{prefix}/joined/{rank}"), b"1").await?;
        let keys: Vec<String> = (0..world).map(|r| format!("{prefix}/joined/{r}")).collect();
        store.wait(&keys.iter().map(String::as_str).collect::<Vec<_>>(), to).await?;
        let (init_once, init) = Once::with_deadline(to, format!("ncclCommInitRank (rank {rank} of {world})"))?;
        init_tx
            .send((id, init_once))
            .map_err(|_| CommError::Shutdown("the nccl worker exited during bootstrap".into()))?;
        let state = init.await?;
        let wd_poison = poison.clone();
        std::thread::Builder::new()
            .name(format!("comm-nccl-watchdog-r{rank}"))
            .spawn(move || engine::watchdog(state, to, wd_poison, rank))
            .map_err(|e| CommError::io("starting the nccl watchdog thread", e))?;
        // A caller that awaits an op spins for as long as the worker does after progress, where
        // this host's ranks' callers and workers can all run at once.
        let cpus = CpuSet::runnable_of(CpuSet::union_of(local_cpus.iter().map(Option::as_ref)).as_ref());
        let spin = handle::caller_spin(engine::SPIN, local_cpus.len(), cpus);
        tracing::debug!(rank, world, device, group = %prefix, ?spin, "nccl: communicator ready");
        Ok(NcclBackend {
            inner: Arc::new(Inner {
                admission: Admission::new(rank, world, poison),
                device,
                tx,
                ctx: ready.ctx,
                stream: ready.stream,
                store,
                opts,
                elastic: Elastic::new(prefix.clone()),
                subgroups: Subgroups::new(prefix),
                info,
                spin,
                register_min: ready.register_min,
            }),
        })
    }

    /// The CUDA context of this rank's device: allocate device buffers for the device ops
    /// with it (e.g. `backend.context().default_stream().clone_htod(&data)`).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    /// The stream NCCL runs on (device ops wait for their buffers' streams first; using this
    /// one avoids even that).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// The size from which host buffers are page-locked for an op rather than copied through
    /// pinned memory ([`NcclOptions::register_min`]; `usize::MAX`: never).
    pub fn register_min(&self) -> usize {
        self.inner.register_min
    }

    /// The CUDA device ordinal this rank uses.
    pub fn device(&self) -> usize {
        self.inner.device
    }

    /// What the availability probe found (NCCL and driver versions, devices).
    pub fn info(&self) -> &NcclInfo {
        &self.inner.info
    }

    /// Checks that apply to every op before it is issued: arguments, what NCCL supports, the
    /// buffers' device, poisoning and shutdown.
    fn admit<R: Plan>(&self, req: &R) -> Result<(), CommError> {
        let inner = &*self.inner;
        req.validate(inner.admission.rank(), inner.admission.world())?;
        let unsupported = || CommError::Unsupported { op: R::NAME, dtype: req.dtype(), backend: BACKEND };
        if req.dtype().is_some_and(|d| ffi::nccl_dtype(d).is_none()) {
            return Err(unsupported());
        }
        if req.reduce_op().is_some_and(|r| ffi::nccl_op(r).is_none()) {
            return Err(unsupported());
        }
        req.check_device(&inner.ctx)?;
        inner.admission.check_open()
    }

    fn submit_plan<R: Plan>(&self, req: R) -> Work<R::Output> {
        if let Err(e) = self.admit(&req) {
            return Work::ready(Err(e));
        }
        let (done, work) = Work::pending();
        // If the worker is gone the command (and its Completer) is dropped, which completes the
        // Work with `Shutdown`.
        let _ = self.inner.tx.send(Command::Op(Box::new(Pending { req, done })));
        work.with_spin(self.inner.spin)
    }
}

impl<R: Plan> Collective<R> for NcclBackend {
    fn submit(&self, req: R) -> Work<R::Output> {
        self.submit_plan(req)
    }
}

#[async_trait]
impl Group for NcclBackend {
    fn rank(&self) -> Rank {
        self.inner.admission.rank()
    }

    fn world_size(&self) -> u32 {
        self.inner.admission.world()
    }

    fn backend_name(&self) -> &'static str {
        BACKEND
    }

    async fn new_group(&self, ranks: &[Rank]) -> Result<Option<Arc<dyn Backend>>, CommError> {
        let inner = &*self.inner;
        let a = &inner.admission;
        let sub = inner.subgroups.next(ranks, a.rank(), a.world())?;
        let Some(rank) = sub.rank else { return Ok(None) };
        let opts = NcclOptions { device: Some(inner.device), ..inner.opts.clone() };
        let g = Self::create(inner.store.clone(), rank, sub.ranks.len() as u32, opts, sub.prefix).await?;
        Ok(Some(Arc::new(g)))
    }

    /// Fails the group on this rank: later ops fail at once, queued ones when the worker takes
    /// them. NCCL has no channel to tell the peers: their ops on it fail at their timeout.
    fn abort(&self, cause: &str) {
        self.inner.admission.poison().set(cause);
    }
    fn poison(&self) -> Option<&Poison> {
        Some(self.inner.admission.poison())
    }
    async fn shutdown(&self) -> Result<(), CommError> {
        if !self.inner.admission.begin_shutdown() {
            return Ok(());
        }
        let (done, work) = Work::pending();
        let _ = self.inner.tx.send(Command::Shutdown(done));
        shutdown_done(work).await
    }

    /// NCCL cannot tell a rank on another host that died from a slow one, so the survivors'
    /// agreement waits up to the timeout for ranks that do not come. The survivors then make a
    /// new communicator (`ncclCommInitRank` under a fresh name, on the same device) and abort
    /// the old one (`ncclCommAbort`: it may have operations stuck on the lost rank).
    async fn shrink(&self) -> Result<Shrunk, CommError> {
        let inner = &*self.inner;
        let (me, world) = (inner.admission.rank(), inner.admission.world());
        inner.admission.poison().set(format!("rank {me} is shrinking the group"));
        let opts = NcclOptions { device: Some(inner.device), ..inner.opts.clone() };
        let shrunk = inner
            .elastic
            .shrink(&*inner.store, me, world, opts.timeout, &|_| false, |s| {
                let (store, opts) = (inner.store.clone(), opts.clone());
                async move {
                    let n = s.ranks.len() as u32;
                    Ok(Arc::new(Self::create(store, s.rank, n, opts, s.prefix).await?) as Arc<dyn Backend>)
                }
            })
            .await?;
        let _ = self.shutdown().await;
        Ok(shrunk)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use comm_core::MemoryStore;

    #[test]
    fn options_from_the_environment() {
        let o = NcclOptions::default();
        assert_eq!(o.timeout, Duration::from_secs(300));
        assert_eq!(o.p2p_linger, Duration::from_micros(200));
        assert_eq!(o.register_min, None);
    }

    #[tokio::test]
    async fn bad_rank_is_an_argument_error() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let e = NcclBackend::new(store, 3, 2, NcclOptions::default()).await.unwrap_err();
        assert!(matches!(e, CommError::InvalidArgument { .. }), "{e}");
    }

    #[tokio::test]
    async fn without_a_gpu_joining_is_unavailable_and_says_why() {
        if is_available().is_ok() {
            eprintln!("skipped: a usable CUDA device and NCCL are present (tests/gpu.rs covers this machine)");
            return;
        }
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let e = NcclBackend::new(store, 0, 1, NcclOptions::default()).await.unwrap_err();
        let CommError::Unavailable { backend, why } = &e else { panic!("expected Unavailable, got {e:?}") };
        assert_eq!(*backend, "nccl");
        assert!(why.contains("libcuda") || why.contains("libnccl") || why.contains("device"), "{why}");
    }
}
