//! The straggler view: per-call latencies gathered across ranks through a real group.

mod common;

use std::time::Duration;

use comm_core::ops::{AllReduce, Barrier};
use comm_core::{Collective, DType, HostBuffer, ReduceOp};
use common::Mock;
use profiling::{CommsConfig, CommsLogger, ProfilingLayer, Summary};
use tracing_subscriber::layer::SubscriberExt;

/// Rank `rank` records all_reduces of 1 KiB taking `lats` µs (and a barrier if `barrier`),
/// then gathers the straggler view over a LocalWorld group.
fn rank_main(group: std::sync::Arc<dyn comm_core::Backend>, lats: Vec<u64>, barrier: bool) -> Summary {
    let (clock, time) = quanta::Clock::mock();
    let logger = CommsLogger::with_clock(CommsConfig::default(), clock);
    let _g = tracing::subscriber::set_default(tracing_subscriber::registry().with(logger.clone()));
    let rank = comm_core::Group::rank(&*group);
    let mock = Mock::new(rank, 2, false);
    let p = ProfilingLayer::new().layer(mock.clone());
    for lat in lats {
        let w = p.submit(AllReduce { buf: HostBuffer::zeroed(DType::F32, 256), op: ReduceOp::Sum });
        time.increment(Duration::from_micros(lat));
        mock.complete_next();
        w.wait().unwrap();
    }
    if barrier {
        let w = p.submit(Barrier);
        mock.complete_next();
        w.wait().unwrap();
    }
    // The group used for the exchange is profiled too: its ops must not show up.
    let profiled_group = ProfilingLayer::new().layer(group);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let s = rt.block_on(logger.summary_with_stragglers(&profiled_group)).unwrap();
    assert_eq!(logger.operation_count(), s.rows.iter().map(|r| r.count).sum::<u64>());
    s
}

#[test]
fn per_call_min_max_and_straggler_time_across_ranks() {
    let ranks = comm_test::LocalWorld::new(2);
    let mut it = ranks.into_iter();
    let (g0, g1) = (it.next().unwrap(), it.next().unwrap());
    // Rank 1 ran one more all_reduce; only rank 0 ran a barrier.
    let t0 = std::thread::spawn(move || rank_main(g0, vec![10, 20, 30], true));
    let t1 = std::thread::spawn(move || rank_main(g1, vec![15, 10, 40, 99], false));
    let (s0, s1) = (t0.join().unwrap(), t1.join().unwrap());

    for (me, s) in [(0u32, &s0), (1, &s1)] {
        let st = s.stragglers.as_ref().unwrap();
        assert_eq!((st.ranks, st.group_rank), (2, me));
        assert_eq!(st.rows.len(), 1);
        let r = &st.rows[0];
        assert_eq!((r.op.as_str(), r.bytes, r.group_size, r.count, r.counts_differ), ("all_reduce", 1024, 2, 3, true));
        // Calls: (10, 15), (20, 10), (30, 40): min 10 + 10 + 30, max 15 + 20 + 40.
        assert_eq!((r.total_min_us, r.total_max_us), (50.0, 75.0));
        assert_eq!((r.fastest_rank, r.slowest_rank), (0, 1)); // 60 vs 65
        let (own, straggler) = if me == 0 { (60.0, 10.0) } else { (65.0, 15.0) };
        assert_eq!((r.total_own_us, r.total_straggler_us), (own, straggler));
        assert_eq!(r.avg_straggler_us, straggler / 3.0);
        assert_eq!(st.skipped, ["barrier 0 B on 2 ranks (recorded on 1 of 2 ranks)"]);
    }
    let text = s0.to_string();
    assert!(text.contains("straggler view over 2 ranks"), "{text}");
    assert!(text.contains("3*"), "{text}");
    // Local rows are unaffected: rank 1 still reports its own four calls.
    assert_eq!(s1.rows[0].count, 4);
    assert_eq!(s1.rows[0].total_us, 164.0);
}

#[test]
fn nothing_recorded_anywhere_is_fine() {
    let ranks = comm_test::LocalWorld::new(3);
    let threads: Vec<_> = ranks.into_iter().map(|g| std::thread::spawn(move || rank_main(g, vec![], false))).collect();
    for t in threads {
        let s = t.join().unwrap();
        let st = s.stragglers.unwrap();
        assert!(st.rows.is_empty() && st.skipped.is_empty());
    }
}

#[test]
fn rows_come_in_key_order_with_numeric_sizes() {
    let ranks = comm_test::LocalWorld::new(2);
    let threads: Vec<_> = ranks
        .into_iter()
        .map(|g| {
            std::thread::spawn(move || {
                let logger = CommsLogger::new(CommsConfig::default());
                let _g = tracing::subscriber::set_default(tracing_subscriber::registry().with(logger.clone()));
                let p = ProfilingLayer::new().layer(Mock::new(comm_core::Group::rank(&*g), 2, true));
                for len in [512, 16, 4096] {
                    p.submit(AllReduce { buf: HostBuffer::zeroed(DType::F32, len), op: ReduceOp::Sum }).wait().unwrap();
                }
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                rt.block_on(logger.summary_with_stragglers(&*g)).unwrap()
            })
        })
        .collect();
    for t in threads {
        let st = t.join().unwrap().stragglers.unwrap();
        let sizes: Vec<u64> = st.rows.iter().map(|r| r.bytes).collect();
        assert_eq!(sizes, [64, 2048, 16384]);
    }
}
