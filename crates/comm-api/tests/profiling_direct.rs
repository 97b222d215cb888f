//! Direct recording (`ProfilingLayer::with_logger`) through the facade. A binary of its own:
//! its ops run with no subscriber while `profiling.rs`'s tests install scoped ones, and
//! `tracing` may cache a callsite's interest from whichever thread registers it first.
#![cfg(feature = "profiling")]

mod common;
use common::{two_rank_summaries, two_ranks, Recording};

/// Direct recording with the default sampling: every rank times the same calls, so the
/// straggler view compares all of them call by call (no rank recorded more).
#[test]
fn sampled_direct_recording_lines_up_across_ranks() {
    let summaries = two_rank_summaries(Recording::Direct, 500);
    for s in &summaries {
        let row = &s.rows[0];
        assert_eq!((s.rows.len(), row.count), (1, 500));
        assert!(row.timed > 32 && row.timed < 100, "{} timed of 500", row.timed);
        let st = s.stragglers.as_ref().unwrap();
        assert_eq!((st.rows[0].count, st.rows[0].counts_differ), (row.timed, false));
    }
    assert_eq!(summaries[0].rows[0].timed, summaries[1].rows[0].timed);
}

/// The straggler view is collective: called on one rank only, it fails after the group's
/// timeout with an error naming the rank that did not join, instead of hanging.
#[cfg(feature = "shm")]
#[test]
fn the_straggler_view_on_one_rank_only_names_the_missing_rank() {
    use std::time::{Duration, Instant};

    use backend_shm::{ShmBackend, ShmOptions};
    use comm_api::profiling::{CommsConfig, CommsLogger, ProfilingLayer};
    use comm_api::{HostBuffer, ProcessGroup, ReduceOp, Store, WorldInfo};
    use comm_core::MemoryStore;
    use std::sync::Arc;

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let opts = ShmOptions { timeout: Duration::from_secs(1), ..Default::default() };
        let ranks = (0..2).map(|r| {
            let (store, opts) = (store.clone(), opts.clone());
            tokio::spawn(async move { ShmBackend::new(store, r, 2, opts).await })
        });
        let mut pgs = Vec::new();
        let mut loggers = Vec::new();
        for b in futures::future::join_all(ranks).await {
            let logger = CommsLogger::new(CommsConfig::default());
            let layer = ProfilingLayer::new().with_logger(logger.clone());
            pgs.push(ProcessGroup::from_backend(Arc::new(layer.layer(b.unwrap().unwrap())), WorldInfo::single()));
            loggers.push(logger);
        }
        let both = pgs.iter().map(|pg| pg.all_reduce(HostBuffer::from_slice(&[1.0f32; 8]), ReduceOp::Sum));
        for r in futures::future::join_all(both).await {
            r.unwrap();
        }
        let t = Instant::now();
        let e = loggers[0].log_summary_with_stragglers(pgs[0].backend()).await.unwrap_err().to_string();
        assert!(t.elapsed() < Duration::from_secs(10), "took {:?}", t.elapsed());
        assert!(e.contains("timed out") && e.contains("rank 1"), "{e}");
        println!("{e}");
    });
}

/// Object collectives are rows of their own (one per call, this rank's encoded bytes); their
/// header exchange and data op do not show as all_gather, broadcast, gather or scatter rows.
#[test]
fn object_collectives_are_rows_of_their_own() {
    let summaries = two_ranks(Recording::Direct, |pg, logger, r| {
        Box::pin(async move {
            for _ in 0..3 {
                pg.all_gather_object(&vec![7u8; 100]).await.unwrap();
            }
            pg.broadcast_object((r == 0).then(|| "hello".to_owned()), 0).await.unwrap();
            pg.gather_object(&1u64, 1).await.unwrap();
            pg.scatter_object((r == 0).then(|| vec![5u32, 6]), 0).await.unwrap();
            logger.summary()
        })
    });
    for s in summaries {
        let rows: Vec<(String, u64, u64)> = s.rows.iter().map(|r| (r.op.clone(), r.count, r.bytes)).collect();
        // postcard: a Vec<u8> of 100 is 1 length byte + 100, a String of 5 is 6, a u64 of 1
        // is 1 (varint), a u32 of 5 or 6 is 1.
        let want = [
            ("all_gather_object", 3, 101),
            ("broadcast_object", 1, 6),
            ("gather_object", 1, 1),
            ("scatter_object", 1, 1),
        ];
        for (op, count, bytes) in want {
            assert!(rows.iter().any(|r| r == &(op.to_owned(), count, bytes)), "{op}: {rows:?}");
        }
        assert_eq!(rows.len(), 4, "only the object ops: {rows:?}");
    }
}
