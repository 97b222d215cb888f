//! Where this process stands in the job, and how ranks find each other.
//!
//! - [`from_env`] / [`from_vars`]: a [`WorldInfo`](comm_core::WorldInfo) read from the variables a
//!   launcher sets, trying in order torchrun / `commrun` / the DeepSpeed launcher, AzureML and
//!   SageMaker (as DeepSpeed reads them), Open MPI, MPICH / Hydra / Intel MPI, PMIx and Slurm.
//!   [`WorldSource`](comm_core::WorldSource) records which launcher won and the `NAME=value`
//!   pairs read; contradictions are errors naming them. [`slurm`] parses Slurm's host lists
//!   (`node[01-04,07]`) and task counts (`2(x3),1`).
//! - [`StoreServer`] / [`TcpStore`]: the TCP rendezvous [`Store`](comm_core::Store) rank 0 serves
//!   and every rank uses to exchange bootstrap data (shm names, NCCL ids...), across hosts too.
//!   Frames are bounded, waits are served with the caller's timeout, and a job token keeps
//!   strangers (another job on the same port) out.
//! - [`TorchStore`]: a client of torch's `TCPStore` protocol, for jobs where torch already
//!   serves the port (torchrun's agent store, `TORCHELASTIC_USE_AGENT_STORE=True`).
//! - [`rendezvous`]: the job's store, whoever serves it ([`StoreKind`](comm_core::StoreKind)).
//!
//! The servers and clients run their socket I/O on dedicated OS threads with their own small
//! tokio runtimes, so they keep working whatever the caller's executor is (a blocked
//! current-thread runtime, `futures::executor`, another tokio runtime...).
#![forbid(unsafe_code)]

mod auth;
mod client;
mod env;
mod net;
mod rendezvous;
mod server;
pub mod slurm;
pub mod torch;
mod wire;

#[cfg(test)]
mod store_tests;

pub use client::{job_token, TcpStore};
pub use env::{from_env, from_vars};
pub use net::bind_addr;
pub use rendezvous::rendezvous;
pub use server::{ServerLimits, StoreServer};
pub use torch::TorchStore;
