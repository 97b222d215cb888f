//! Profile a few collectives: a span per op, DeepSpeed's comms summary with the straggler
//! view, and (built with `--features otel`, `OTEL_TRACES_EXPORTER=console`) the spans on
//! stdout through OpenTelemetry.
//!
//! ```text
//! cargo build --examples --features profiling && commrun -n 2 -- target/debug/examples/profile
//! ```

use comm_api::profiling::{CommsConfig, CommsLogger, ProfilingLayer};
use comm_api::{Config, HostBuffer, ReduceOp};
use tracing_subscriber::layer::SubscriberExt;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // debug: rows are keyed by the span the op ran in too ("all_reduce [in step]").
    let logger = CommsLogger::new(CommsConfig { debug: true, ..CommsConfig::default() });
    // The profiling layer records into the logger directly; a subscriber is only needed for
    // the `step` spans to exist (`debug` keys rows by them) and for OpenTelemetry.
    let subscriber = tracing_subscriber::registry().with(tracing_subscriber::filter::LevelFilter::INFO);
    #[cfg(feature = "otel")]
    let (subscriber, otel) = {
        let otel = comm_api::profiling::otel::OtelConfig::from_env("profile-example")
            .with_exporter(comm_api::profiling::otel::Exporter::None);
        let otel = match std::env::var("OTEL_TRACES_EXPORTER").as_deref() {
            Ok("console" | "stdout") => otel.with_exporter(comm_api::profiling::otel::Exporter::Stdout),
            _ => otel,
        }
        .build()?;
        (subscriber.with(otel.layer()), otel)
    };
    tracing::subscriber::set_global_default(subscriber)?;

    let pg = comm_api::builder(Config::from_env()?)
        .profiling(ProfilingLayer::new().with_logger(logger.clone()))
        .init()
        .await?;
    let (rank, n) = (pg.rank(), pg.world_size());
    for step in 0..3 {
        let span = tracing::info_span!("step", step);
        let (reduced, gathered) = {
            let _in_step = span.enter();
            let grads = pg.all_reduce(HostBuffer::from_slice(&[rank as f32; 1024]), ReduceOp::Sum);
            let shards = pg.all_gather(HostBuffer::from_slice(&[rank as u8; 100])); // overlaps
            (grads, shards)
        };
        let sum = reduced.await?.to_vec::<f32>()?;
        assert!(sum.iter().all(|&x| x == (n * (n - 1) / 2) as f32));
        assert_eq!(gathered.await?.len(), 100 * n as usize);
    }
    pg.barrier().await?;

    // Collective: every rank joins; rank 0 prints both tables, every rank gets the data.
    let summary = logger.log_summary_with_stragglers(pg.backend()).await?;
    let count = |op: &str| summary.rows.iter().filter(|r| r.op == op).map(|r| r.count).sum::<u64>();
    assert_eq!((count("all_reduce"), count("all_gather"), count("barrier")), (3, 3, 1));
    let stragglers = summary.stragglers.as_ref().expect("straggler view");
    assert_eq!(stragglers.rows.len(), 3);
    #[cfg(feature = "otel")]
    otel.shutdown()?;
    pg.shutdown().await?;
    Ok(())
}
