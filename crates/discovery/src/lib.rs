//! Where this process stands in the job, and how ranks find each other.
//!
//! - [`from_env`] / [`from_vars`]: a [`WorldInfo`](comm_core::WorldInfo) read from the variables a
//!   launcher sets (torchrun and the DeepSpeed launcher today; the readers form a precedence list
//!   so Open MPI, MPICH, Slurm... slot in later).
//! - [`StoreServer`] / [`TcpStore`]: the TCP rendezvous [`Store`](comm_core::Store) rank 0 serves
//!   and every rank uses to exchange bootstrap data (shm names, NCCL ids...), across hosts too.
//!   Frames are bounded, waits are served with the caller's timeout, and a job token keeps
//!   strangers (another job on the same port) out.
//! - [`rendezvous`]: the two put together: rank 0 serves, every rank connects.
//!
//! Both the server and each client run their socket I/O on a dedicated OS thread with its own
//! small tokio runtime, so they keep working whatever the caller's executor is (a blocked
//! current-thread runtime, `futures::executor`, another tokio runtime...).
#![forbid(unsafe_code)]

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
pub use server::StoreServer;
pub use torch::TorchStore;
