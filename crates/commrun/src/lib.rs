//! `commrun`: the local launcher of the comm workspace, like `torchrun` or `mpirun`.
//!
//! ```text
//! commrun -n N [--master-addr A] [--master-port P] [--quiet-ranks] [--enable-recovery]
//!         [--max-restarts K] [--timeout-kill S] -- prog args...
//! ```
//!
//! It starts `N` processes of `prog args...`, each with the torchrun-style environment
//! (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`) plus `COMM_JOB_TOKEN`, a random 128-bit hex token shared by the ranks of one
//! job. It serves the job's rendezvous store itself (`COMM_STORE=external`), so the store
//! outlives every rank. Every output line of a rank is prefixed with `[rank] `. When a rank
//! fails, the other ranks get `SIGTERM`, then `SIGKILL` after a grace period, and `commrun` exits
//! with the failing rank's code; with `--enable-recovery` a rank killed by a signal leaves the
//! others running (they can shrink their groups), and `--max-restarts K` starts a replacement
//! with `COMM_JOIN=1` (it joins when they grow). `SIGINT`, `SIGTERM` and `SIGHUP` received by
//! `commrun` are forwarded to the ranks.
//!
//! The binary is a thin wrapper over [`cli::parse`] and [`launch::run`]; the pieces are public
//! so that they can be tested on their own.

// The one exception, `pre_exec`, is allowed where it is used.
#![deny(unsafe_code)]

pub mod cli;
pub mod job;
pub mod launch;
pub mod output;
mod signals;

#[cfg(not(unix))]
compile_error!("commrun supports Unix-like systems only");
