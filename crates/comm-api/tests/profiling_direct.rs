//! Direct recording (`ProfilingLayer::with_logger`) through the facade. A binary of its own:
//! its ops run with no subscriber while `profiling.rs`'s tests install scoped ones, and
//! `tracing` may cache a callsite's interest from whichever thread registers it first.
#![cfg(feature = "profiling")]

use std::sync::Arc;

use comm_api::profiling::{CommsConfig, CommsLogger, ProfilingLayer};
use comm_api::{HostBuffer, ProcessGroup, ReduceOp, WorldInfo};

/// Direct recording with the default sampling: every rank times the same calls, so the
/// straggler view compares all of them call by call (no rank recorded more).
#[test]
fn sampled_direct_recording_lines_up_across_ranks() {
    let ranks = comm_test::LocalWorld::new(2);
    let threads: Vec<_> = ranks
        .into_iter()
        .enumerate()
        .map(|(r, b)| {
            std::thread::spawn(move || {
                let logger = CommsLogger::new(CommsConfig::default());
                let mut world = WorldInfo::single();
                (world.rank, world.world_size, world.local_world_size) = (r as u32, 2, 2);
                let layer = ProfilingLayer::new().with_logger(logger.clone());
                let pg = ProcessGroup::from_backend(Arc::new(layer.layer(b)), world);
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                rt.block_on(async {
                    for _ in 0..500 {
                        pg.all_reduce(HostBuffer::from_slice(&[r as f32; 64]), ReduceOp::Sum).await.unwrap();
                    }
                    logger.log_summary_with_stragglers(pg.backend()).await.unwrap()
                })
            })
        })
        .collect();
    let summaries: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    for s in &summaries {
        let row = &s.rows[0];
        assert_eq!((s.rows.len(), row.count), (1, 500));
        assert!(row.timed > 32 && row.timed < 100, "{} timed of 500", row.timed);
        let st = s.stragglers.as_ref().unwrap();
        assert_eq!((st.rows[0].count, st.rows[0].counts_differ), (row.timed, false));
    }
    assert_eq!(summaries[0].rows[0].timed, summaries[1].rows[0].timed);
}
