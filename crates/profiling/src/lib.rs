//! Profiling for the comm collectives: every op is a `tracing` span, DeepSpeed's comms
//! summary is a subscriber layer over those spans, and (feature `otel`) the spans go to
//! OpenTelemetry.
//!
//! - [`ProfilingLayer`] → [`Profiling<C>`]: wraps a backend; opens a span `comm.<op>`
//!   (target [`TARGET`]) when an op is submitted and closes it when the op completes —
//!   nothing is synchronised to measure. Costs nothing measurable when no subscriber wants
//!   the spans.
//! - [`CommsLogger`]: a `tracing_subscriber::Layer` aggregating the spans per op and message
//!   size (count, total / avg / min / p50 / max latency, algbw / busbw with nccl-tests'
//!   factors, see [`bandwidth`]); [`CommsLogger::log_summary`] prints the table and returns
//!   a `serde` [`Summary`]; [`CommsLogger::log_summary_with_stragglers`] adds the per-rank
//!   view, gathered through a group.
//! - [`Timeline`]: every op as a slice of its rank's track in Chrome's trace-event format
//!   (Perfetto, `chrome://tracing`), clocks aligned across ranks, merged on rank 0
//!   ([`ProfilingLayer::with_timeline`]).
//! - `otel` (feature): `otel::OtelConfig` builds a `tracing-opentelemetry` layer exporting
//!   to an OTLP/HTTP endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT`) or stdout, with the resource
//!   attributes `service.name` and `rank`.
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use comm_core::{ops::AllReduce, Collective, DType, HostBuffer, ReduceOp};
//! use profiling::{CommsConfig, CommsLogger, ProfilingLayer};
//! use tracing_subscriber::layer::SubscriberExt;
//!
//! let logger = CommsLogger::new(CommsConfig::default());
//! let _guard = tracing::subscriber::set_default(tracing_subscriber::registry().with(logger.clone()));
//! let rank = ProfilingLayer::new().layer(comm_test::LocalWorld::new(1).remove(0));
//! rank.submit(AllReduce { buf: HostBuffer::zeroed(DType::F32, 256), op: ReduceOp::Sum }).await.unwrap();
//! let summary = logger.summary();
//! assert_eq!((summary.rows[0].op.as_str(), summary.rows[0].bytes, summary.rows[0].count), ("all_reduce", 1024, 1));
//! # });
//! ```
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod bandwidth;
mod layer;
mod logger;
#[cfg(feature = "otel")]
#[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
pub mod otel;
mod summary;
mod timeline;

pub use bandwidth::human_size;
pub use layer::{recorded_as, without_profiling, Profiling, ProfilingLayer};
pub use logger::{CommsConfig, CommsLogger};
pub use summary::{Row, StragglerRow, Stragglers, Summary};
pub use timeline::{chrome_trace, Timeline, TraceEvent, MAX_EVENTS};

/// The `tracing` target of every span this crate opens (`comm.<op>`, `comm.new_group`):
/// filter on it (`RUST_LOG=comm=info`, `Targets::new().with_target(TARGET, Level::INFO)`).
pub const TARGET: &str = "comm";
