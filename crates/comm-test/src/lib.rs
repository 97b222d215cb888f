//! Testing support for the comm workspace (not published).
//!
//! - [`reference`](mod@crate::reference): plain sequential semantics of every op, the spec
//!   every backend must match bit for bit, plus deterministic test data and byte-exact
//!   comparison.
//! - [`LocalWorld`]: an in-process reference backend whose ranks are handles used from
//!   different threads or tasks.
//! - [`suite`]: the one conformance suite every backend runs on every rank.
//! - [`multiprocess`]: runs a test body as N real OS processes by re-executing the test binary,
//!   with torchrun-style environment variables.
//! - [`mpirun`]: the same under `mpirun`, for backends whose ranks MPI starts.

mod local;
pub mod mpirun;
pub mod multiprocess;
pub mod reference;
pub mod suite;

pub use local::LocalWorld;
pub use suite::{SuiteConfig, SuiteReport};
