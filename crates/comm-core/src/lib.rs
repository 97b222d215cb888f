//! Core types and traits of the comm workspace.
//!
//! This crate is small and changes rarely: it holds the vocabulary every other crate speaks.
//! It has no native dependencies and no `unsafe` code.
//!
//! - [`DType`], [`ReduceOp`], [`Element`]: what is moved and how it is combined.
//! - [`HostBuffer`]: owned, typed host memory that is moved into an op and handed back by it.
//! - [`Work`]: the completion handle every op returns (a `Future`, plus `is_completed`/`wait`).
//! - [`ops`]: one request struct per op, each an [`Op`].
//! - [`Collective`], [`Group`], [`Backend`]: what a backend implements; a layer implements
//!   `Collective<R>` once, generically, for every op.
//! - [`Store`]: the rendezvous key-value store backends use to bootstrap.
//! - [`WorldInfo`]: who this process is in the job.
//! - [`CommError`]: the one error type.
//! - [`lane`]: the gate between a group's callers and its worker, the same in every backend.
//! - [`elastic`]: the survivors' agreement behind [`Group::shrink`].
//! - [`cpus`]: CPU sets (a thread's affinity, and the union over a host's ranks).
//! - [`handle`]: what backends' group handles share (poison, admission, sub-group names).
//! - [`config`]: parsing of sizes, timeouts and switches, the same in every crate.
#![forbid(unsafe_code)]

mod buffer;
mod collective;
pub mod config;
pub mod cpus;
mod dtype;
pub mod elastic;
mod error;
pub mod handle;
pub mod lane;
pub mod ops;
mod store;
mod work;
mod world;

pub use buffer::{set_large_buffers, ExternalStorage, HostBuffer, LargeBuffers};
pub use collective::{Backend, Collective, Group};
pub use dtype::{DType, Element, ReduceOp};
pub use error::{catch_panic, panic_message, CommError};
pub use ops::{InOut, Op, OpKind};
pub use store::{MemoryStore, Store};
pub use work::{Completer, Completion, Work};
pub use world::{Launcher, StoreKind, WorldInfo, WorldSource};

/// A rank: a process's index inside a group, `0..world_size`.
pub type Rank = u32;

/// `Result` with [`CommError`].
pub type Result<T, E = CommError> = std::result::Result<T, E>;

/// Re-exported so users name the half-precision element types without adding `half` themselves.
pub use half::{bf16, f16};
