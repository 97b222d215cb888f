//! **comm**: the collective operations of `torch.distributed` / `deepspeed.comm` for async Rust.
//!
//! ```no_run
//! use comm_api::{Config, HostBuffer, ReduceOp};
//!
//! # async fn run() -> Result<(), comm_api::CommError> {
//! let pg = comm_api::init(Config::from_env()?).await?;        // discovery + rendezvous + backend
//! let grads = HostBuffer::from_slice(&[1.0f32, 2.0, 3.0]);
//! let summed = pg.all_reduce(grads, ReduceOp::Sum).await?;     // Work<HostBuffer>, awaited
//! let w = pg.all_gather(summed);                               // issued now...
//! // ... compute while it runs ...
//! let gathered = w.await?;                                     // ...completed here
//! assert_eq!(gathered.len(), 3 * pg.world_size() as usize);
//! # Ok(()) }
//! ```
//!
//! Launch N local ranks with `commrun -n N -- prog` (or torchrun, which sets the same
//! variables). Every op returns a [`Work`] at once: a `Future` that also offers
//! `is_completed()` and a blocking `wait()`. Ops are *eager*: they are issued in program
//! order when called, so awaiting works in any order (or dropping them) never reorders
//! collectives across ranks.
//!
//! # Feature flags
//!
//! | feature | default | backend | needs to build | needs to run |
//! |---|---|---|---|---|
//! | `shm` | yes | same-host shared memory | nothing | every rank on one host; `/dev/shm` room for `2 × window + 2 × world × slot` per rank, the window being a core's L2 (64 KiB..1 MiB) and the slot the window or less (64 KiB..1 MiB, `world × slot` at most 16 MiB): 6 MiB per rank at 2 ranks with a 1 MiB L2 |
//! | `mpi` | no | MPI (Open MPI, MPICH) through rsmpi; with `shm`, which it turns on, `hier` (shm within each host, MPI between hosts) | an MPI dev package, libclang, pkg-config, a C compiler (Debian: `apt-get install --no-install-recommends libopenmpi-dev openmpi-bin libclang-dev pkg-config`; `cargo xtask test` installs them as root); elsewhere an MPI whose `mpicc` is on `PATH` (or `MPI_PKG_CONFIG` naming its `.pc`) and libclang (`LIBCLANG_PATH`) | ranks started by that MPI's `mpirun`/`mpiexec` (as root `--allow-run-as-root`; more ranks than cores `--oversubscribe`; Open MPI pins 2 ranks to one core each unless `--bind-to none`) |
//! | `nccl` | no | NCCL (GPUs) through cudarc | nothing (libcuda and libnccl are loaded at run time, so it builds and its tests pass without CUDA, GPU tests printing `skipped: no CUDA device`; cudarc pinned to CUDA 12.8 bindings, `nccl-unpinned` + `backend-nccl/cuda-*` or `CUDARC_CUDA_VERSION` for others) | an NVIDIA driver, NCCL ≥ 2.10 loadable as `libnccl.so` (a pip NCCL has only `libnccl.so.2`: symlink it), one GPU per rank (`LOCAL_RANK`, or `COMM_NCCL_DEVICE`; `backend_nccl::is_available()` says what is missing); `cargo xtask gpu-test` runs the GPU tests for real |
//! | `profiling` | no | — (a `tracing` span per op, the `CommsLogger` summary; `Builder::profiling`, `comm_api::profiling`) | nothing (pure Rust) | nothing for the summary (`ProfilingLayer::with_logger`); a `tracing` subscriber that wants the spans for anything else — none costs nothing |
//! | `otel` | no | — (`profiling` + OpenTelemetry export, `profiling::otel`) | nothing native (OTLP over HTTP/protobuf through a blocking `ureq` client with rustls: `http://` and `https://`, no async runtime) | an OTLP/HTTP collector (`OTEL_EXPORTER_OTLP_ENDPOINT`, default `http://localhost:4318`), or `OTEL_TRACES_EXPORTER=console` for stdout |
//!
//! `Auto` picks `nccl` when the feature is on and a GPU is usable, else `mpi` when an MPI
//! launcher started the process and the feature is on — `hier` when that launcher put ranks on
//! several hosts with more than one on some host (found at start-up from every rank's host
//! identity; see `backend_hier`). Asking for a backend that was not
//! compiled in fails with [`CommError::Unavailable`] naming the feature to enable; asking for
//! `nccl` where it cannot run fails with `Unavailable` naming what is missing (driver, NCCL,
//! device). Device buffers (`CudaSlice`) go zero-copy through `backend_nccl`'s request types on
//! an `NcclBackend` handle.
//!
//! # Environment
//! `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` (as
//! torchrun sets them), or else the variables of Open MPI, MPICH / Intel MPI, PMIx, Slurm,
//! AzureML or SageMaker (see `discovery::from_vars`; [`ProcessGroup::describe`] tells which
//! were used); under torchrun (`TORCHELASTIC_USE_AGENT_STORE=True`) the ranks meet in the
//! agent's torch TCPStore; `COMM_STORE` (`rank0`, `external`, `torch`) and `COMM_BIND_ADDR`
//! (the local IP to reach the store from); `COMM_TIMEOUT` (seconds, default 300) bounds every wait;
//! `COMM_BACKEND` (`auto`, `shm`, `mpi`, `nccl`, `hier`); `COMM_HOST_ID` (which ranks share a
//! host, instead of host name + boot id); `COMM_SHM_WINDOW` and friends tune shm;
//! `COMM_HIER_INLINE_MAX` and `COMM_HIER_RAIL_MIN` tune hier (see `backend_hier::HierOptions`);
//! `COMM_MPI_REDUCTION` (`exact`, `native`) and friends tune mpi (see `backend_mpi::MpiOptions`).

mod barrier;
mod config;
mod group;
#[cfg(feature = "mpi")]
mod hier;
mod issuers;
mod objects;
mod streams;

pub use barrier::MONITORED_BARRIER_TAG;
pub use comm_core::{
    bf16, f16, ops, Backend, Collective, CommError, DType, Element, Group, HostBuffer, InOut, Launcher, Rank, ReduceOp,
    Store, StoreKind, Work, WorldInfo, WorldSource,
};
pub use config::{builder, init, BackendKind, Builder, Config};
pub use group::{P2POp, ProcessGroup, Rooted};
/// Spans per op, the `CommsLogger` summary and (feature `otel`) OpenTelemetry export: the
/// `profiling` crate.
#[cfg(feature = "profiling")]
#[cfg_attr(docsrs, doc(cfg(feature = "profiling")))]
pub use profiling;
pub use streams::{Streams, StreamsOptions};

// Compile-time guarantees users rely on: handles move across tasks and threads, futures of
// ops can be spawned on a multi-threaded runtime.
#[cfg(test)]
mod auto_traits {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}

    #[test]
    fn handles_are_send_and_sync() {
        send_sync::<crate::ProcessGroup>();
        send_sync::<crate::HostBuffer>();
        send_sync::<crate::CommError>();
        send_sync::<crate::Config>();
        send::<crate::Work<crate::HostBuffer>>();
        send::<crate::Work<()>>();
    }

    #[allow(dead_code)]
    fn facade_futures_are_send(pg: &crate::ProcessGroup) {
        fn is_send<T: Send>(_: &T) {}
        is_send(&pg.all_gather_object(&1u32));
        is_send(&pg.monitored_barrier(std::time::Duration::from_secs(1), true));
        is_send(&pg.new_group(&[0]));
        is_send(&pg.shutdown());
    }
}
