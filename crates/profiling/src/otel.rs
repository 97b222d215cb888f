//! OpenTelemetry export of the op spans (feature `otel`): a `tracing-opentelemetry` layer
//! over an SDK tracer provider that sends spans to an OTLP/HTTP endpoint or to stdout.
//!
//! ```no_run
//! use tracing_subscriber::layer::SubscriberExt;
//! use profiling::otel::OtelConfig;
//!
//! // OTEL_TRACES_EXPORTER (otlp | console | none), OTEL_EXPORTER_OTLP_ENDPOINT,
//! // OTEL_SERVICE_NAME, RANK and WORLD_SIZE are read from the environment.
//! let otel = OtelConfig::from_env("trainer").build().expect("exporter");
//! let subscriber = tracing_subscriber::registry().with(otel.layer());
//! tracing::subscriber::set_global_default(subscriber).unwrap();
//! // ... profiled ops ...
//! otel.shutdown().ok(); // flushes what is buffered
//! ```
//!
//! Spans keep their `comm.*` fields as attributes (integers as OTLP ints); `otel.name`,
//! `otel.kind`, `otel.status_code` and `otel.status_description` become the span's name,
//! kind and status. A span open around an op (`info_span!("train_step")`) is its parent.
//!
//! **Transport.** OTLP over HTTP with protobuf bodies, sent by a blocking `ureq` client
//! (rustls, so `https://` works) from the batch processor's own thread: no async runtime.
//! Spans are exported in batches on that thread, never on the op's path.

mod client;

use std::fmt;
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry::KeyValue;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider, SpanExporter};
use opentelemetry_sdk::Resource;
use tracing::Subscriber;
use tracing_opentelemetry::OpenTelemetryLayer;
use tracing_subscriber::registry::LookupSpan;

pub use opentelemetry_sdk::error::OTelSdkError;

/// Where spans go.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Exporter {
    /// OTLP over HTTP/protobuf. `endpoint`: a base URL such as `http://collector:4318`
    /// (`/v1/traces` is added when it has no path) or the full traces URL; `None` takes
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`, else
    /// `http://localhost:4318`.
    Otlp {
        /// Collector URL (`http://` or `https://`).
        endpoint: Option<String>,
        /// Bound on one export request.
        timeout: Duration,
    },
    /// Human-readable spans on standard output (`opentelemetry-stdout`).
    Stdout,
    /// Nothing exported (the layer still assigns trace and span ids).
    None,
}

/// Error building the pipeline.
#[derive(Debug)]
pub struct OtelError(String);

impl fmt::Display for OtelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OpenTelemetry exporter: {}", self.0)
    }
}

impl std::error::Error for OtelError {}

/// What the pipeline exports and how it names the process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OtelConfig {
    /// Resource attribute `service.name`.
    pub service_name: String,
    /// Resource attribute `rank` (the process's global rank).
    pub rank: Option<u32>,
    /// Resource attribute `world_size`.
    pub world_size: Option<u32>,
    /// Where spans go.
    pub exporter: Exporter,
}

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

impl OtelConfig {
    /// OTLP to the environment's endpoint, for service `service_name`, no rank.
    pub fn new(service_name: impl Into<String>) -> Self {
        OtelConfig {
            service_name: service_name.into(),
            rank: None,
            world_size: None,
            exporter: Exporter::Otlp { endpoint: None, timeout: DEFAULT_TIMEOUT },
        }
    }

    /// From the standard OpenTelemetry variables: `OTEL_SERVICE_NAME` (else `service_name`),
    /// `OTEL_TRACES_EXPORTER` (`otlp`, the default; `console` or `stdout`; `none`),
    /// `OTEL_EXPORTER_OTLP_TIMEOUT` (ms); and the launcher's `RANK` / `WORLD_SIZE`.
    pub fn from_env(service_name: &str) -> Self {
        let var = |k: &str| std::env::var(k).ok().map(|v| v.trim().to_owned()).filter(|v| !v.is_empty());
        let timeout = var("OTEL_EXPORTER_OTLP_TIMEOUT")
            .and_then(|v| v.parse().ok())
            .map_or(DEFAULT_TIMEOUT, Duration::from_millis);
        let exporter = match var("OTEL_TRACES_EXPORTER").map(|v| v.to_ascii_lowercase()).as_deref() {
            Some("console" | "stdout") => Exporter::Stdout,
            Some("none") => Exporter::None,
            _ => Exporter::Otlp { endpoint: None, timeout },
        };
        OtelConfig {
            service_name: var("OTEL_SERVICE_NAME").unwrap_or_else(|| service_name.to_owned()),
            rank: var("RANK").and_then(|v| v.parse().ok()),
            world_size: var("WORLD_SIZE").and_then(|v| v.parse().ok()),
            exporter,
        }
    }

    /// Sets the `rank` and `world_size` resource attributes.
    pub fn with_rank(mut self, rank: u32, world_size: u32) -> Self {
        self.rank = Some(rank);
        self.world_size = Some(world_size);
        self
    }

    /// Sets the exporter.
    pub fn with_exporter(mut self, exporter: Exporter) -> Self {
        self.exporter = exporter;
        self
    }

    fn resource(&self) -> Resource {
        let mut attrs = Vec::new();
        if let Some(r) = self.rank {
            attrs.push(KeyValue::new("rank", i64::from(r)));
        }
        if let Some(w) = self.world_size {
            attrs.push(KeyValue::new("world_size", i64::from(w)));
        }
        Resource::builder().with_service_name(self.service_name.clone()).with_attributes(attrs).build()
    }

    /// Builds the pipeline: OTLP goes through a batch processor (its own thread), stdout
    /// through a simple one (printed as each span ends).
    pub fn build(self) -> Result<OtelPipeline, OtelError> {
        let builder = SdkTracerProvider::builder().with_resource(self.resource());
        let builder = match &self.exporter {
            Exporter::Otlp { endpoint, timeout } => {
                let mut b = opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_timeout(*timeout)
                    .with_http_client(client::UreqClient::new(*timeout));
                if let Some(e) = endpoint {
                    b = b.with_endpoint(traces_url(e));
                }
                let exporter = b.build().map_err(|e| OtelError(e.to_string()))?;
                builder.with_batch_exporter(exporter)
            }
            Exporter::Stdout => builder.with_simple_exporter(opentelemetry_stdout::SpanExporter::default()),
            Exporter::None => builder,
        };
        Ok(OtelPipeline { provider: builder.build() })
    }

    /// Builds the pipeline around `exporter` with a simple (synchronous) processor: every
    /// span is exported as it ends. For tests (the SDK's in-memory exporter) and custom sinks.
    pub fn build_with_exporter(self, exporter: impl SpanExporter + 'static) -> OtelPipeline {
        let provider =
            SdkTracerProvider::builder().with_resource(self.resource()).with_simple_exporter(exporter).build();
        OtelPipeline { provider }
    }
}

/// `base` + `/v1/traces` when `base` has no path; otherwise `base` as it is.
fn traces_url(base: &str) -> String {
    let after_scheme = base.split_once("://").map_or(base, |(_, rest)| rest);
    match after_scheme.find('/') {
        Some(i) if !after_scheme[i..].trim_end_matches('/').is_empty() => base.to_owned(),
        _ => format!("{}/v1/traces", base.trim_end_matches('/')),
    }
}

/// The tracer provider and the way to get a `tracing` layer on it. Dropping it flushes and
/// shuts the exporter down (errors ignored); call [`shutdown`](Self::shutdown) to see them.
#[derive(Debug)]
pub struct OtelPipeline {
    provider: SdkTracerProvider,
}

impl OtelPipeline {
    /// A `tracing-opentelemetry` layer exporting through this pipeline (instrumentation
    /// scope `comm`).
    pub fn layer<S>(&self) -> OpenTelemetryLayer<S, SdkTracer>
    where
        S: Subscriber + for<'a> LookupSpan<'a>,
    {
        tracing_opentelemetry::layer().with_tracer(self.provider.tracer(crate::TARGET))
    }

    /// The SDK provider (for a tracer of your own).
    pub fn provider(&self) -> &SdkTracerProvider {
        &self.provider
    }

    /// Exports whatever is buffered now. An unreachable collector is an error here, never a
    /// panic or a stall of the ops.
    pub fn flush(&self) -> Result<(), OTelSdkError> {
        self.provider.force_flush()
    }

    /// Flushes and stops the exporter.
    pub fn shutdown(self) -> Result<(), OTelSdkError> {
        self.provider.shutdown()
    }
}

impl Drop for OtelPipeline {
    fn drop(&mut self) {
        // The SDK also shuts down when its last provider clone goes; doing it here makes
        // the flush happen when the caller lets go, not when the subscriber does.
        let _ = self.provider.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traces_path_is_added_to_base_urls_only() {
        assert_eq!(traces_url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/custom/path"), "http://c:4318/custom/path");
    }

    #[test]
    fn https_endpoints_are_accepted() {
        let otel = OtelConfig::new("t")
            .with_exporter(Exporter::Otlp { endpoint: Some("https://c:4318".into()), timeout: DEFAULT_TIMEOUT })
            .build();
        assert!(otel.is_ok(), "{:?}", otel.err());
    }
}
