//! Helpers shared by the profiling test binaries.
#![allow(dead_code, unreachable_pub)]

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use comm_api::profiling::{CommsConfig, CommsLogger, ProfilingLayer, Summary};
use comm_api::{HostBuffer, ProcessGroup, ReduceOp, WorldInfo};
use tracing_subscriber::layer::SubscriberExt;

/// How the two ranks' logger records.
#[derive(Clone, Copy)]
pub enum Recording {
    /// From spans: the logger is this thread's subscriber layer.
    Spans,
    /// Directly: `ProfilingLayer::with_logger`, no subscriber.
    Direct,
}

/// Two in-process ranks (threads) run `ops` small all_reduces through a profiled group, then
/// the collective `log_summary_with_stragglers`; returns each rank's summary.
pub fn two_rank_summaries(recording: Recording, ops: usize) -> Vec<Summary> {
    two_ranks(recording, move |pg, logger, r| {
        Box::pin(async move {
            for _ in 0..ops {
                pg.all_reduce(HostBuffer::from_slice(&[r as f32; 64]), ReduceOp::Sum).await.unwrap();
            }
            logger.log_summary_with_stragglers(pg.backend()).await.unwrap()
        })
    })
}

/// Two in-process ranks (threads, `LocalWorld`), each running `body` on a profiled group
/// recording into its own logger; returns what each returned.
pub fn two_ranks(
    recording: Recording,
    body: impl Fn(ProcessGroup, CommsLogger, u32) -> Pin<Box<dyn Future<Output = Summary>>> + Clone + Send + 'static,
) -> Vec<Summary> {
    let threads: Vec<_> = comm_test::LocalWorld::new(2)
        .into_iter()
        .enumerate()
        .map(|(r, b)| {
            let body = body.clone();
            std::thread::spawn(move || {
                let logger = CommsLogger::new(CommsConfig::default());
                let (layer, _guard) = match recording {
                    Recording::Spans => (
                        ProfilingLayer::new(),
                        Some(tracing::subscriber::set_default(tracing_subscriber::registry().with(logger.clone()))),
                    ),
                    Recording::Direct => (ProfilingLayer::new().with_logger(logger.clone()), None),
                };
                let mut world = WorldInfo::single();
                (world.rank, world.world_size, world.local_world_size) = (r as u32, 2, 2);
                let pg = ProcessGroup::from_backend(Arc::new(layer.layer(b)), world);
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                rt.block_on(body(pg, logger, r as u32))
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}
