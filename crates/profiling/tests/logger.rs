//! CommsLogger: exact summary numbers for scripted ops on a hand-driven clock, recorded both
//! ways: from the spans (the logger as a subscriber layer) and directly
//! (`ProfilingLayer::with_logger`).

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use comm_core::ops::{AllGather, AllReduce, Barrier, Broadcast, ReduceScatter, SendTo as SendOp};
use comm_core::{Collective, CommError, DType, HostBuffer, ReduceOp};
use common::{Fancy, Mock};
use profiling::{CommsConfig, CommsLogger, ProfilingLayer, Summary};
use tracing_subscriber::layer::SubscriberExt;

fn us(n: u64) -> Duration {
    Duration::from_micros(n)
}

fn bytes(n: usize) -> HostBuffer {
    HostBuffer::zeroed(DType::U8, n)
}

struct Rig {
    logger: CommsLogger,
    /// Drives the logger's clock.
    time: Arc<quanta::Mock>,
    /// What the test wraps its backends in.
    layer: ProfilingLayer,
    _guard: tracing::subscriber::DefaultGuard,
}

#[derive(Clone, Copy, Debug)]
enum Way {
    /// The logger is a subscriber layer and records from the spans.
    Spans,
    /// The profiling layer records into the logger; the subscriber (a bare registry, so user
    /// spans exist for `debug`) does not know the logger.
    Direct,
}

const WAYS: [Way; 2] = [Way::Spans, Way::Direct];

/// A logger on a manual clock, recording `way`. Direct recording times every call
/// (`sample_every: 1`) so the numbers are exact.
fn rig_with(config: CommsConfig, way: Way) -> Rig {
    let (clock, time) = quanta::Clock::mock();
    let logger = CommsLogger::with_clock(CommsConfig { sample_every: 1, ..config }, clock);
    let (layer, _guard) = match way {
        Way::Spans => (
            ProfilingLayer::new(),
            tracing::subscriber::set_default(tracing_subscriber::registry().with(logger.clone())),
        ),
        Way::Direct => (
            ProfilingLayer::new().with_logger(logger.clone()),
            tracing::subscriber::set_default(
                tracing_subscriber::registry().with(tracing_subscriber::layer::Identity::new()),
            ),
        ),
    };
    Rig { logger, time, layer, _guard }
}

/// Submits with `submit`, lets `lat` pass, completes: one op of exactly `lat`.
fn timed<W>(r: &Rig, mock: &Mock, lat: Duration, submit: impl FnOnce() -> W) -> W {
    let w = submit();
    r.time.increment(lat);
    mock.complete_next();
    w
}

#[test]
fn scripted_sequence_gives_exact_numbers() {
    for way in WAYS {
        scripted_sequence(way);
    }
}

fn scripted_sequence(way: Way) {
    let r = rig_with(CommsConfig::default(), way);
    let m4 = Mock::new(0, 4, false);
    let p4 = r.layer.layer(m4.clone());
    for lat in [10, 30, 20] {
        timed(&r, &m4, us(lat), || p4.submit(AllReduce { buf: bytes(1_000_000), op: ReduceOp::Sum })).wait().unwrap();
    }
    // all_gather of a 1000-byte shard on 4 ranks: S = 4000 bytes.
    timed(&r, &m4, us(1), || p4.submit(AllGather { input: bytes(1000), output: None })).wait().unwrap();
    // Failed op: counted apart, not in the latencies.
    let w = p4.submit(AllReduce { buf: bytes(1_000_000), op: ReduceOp::Sum });
    r.time.increment(us(999));
    m4.fail_next(CommError::Shutdown("test".into()));
    assert!(w.wait().is_err());

    let m2 = Mock::new(0, 2, false);
    let p2 = r.layer.layer(m2.clone());
    // 256 KiB reduce_scatter on 2 ranks (DeepSpeed accounted 512 KiB).
    timed(&r, &m2, us(100), || p2.submit(ReduceScatter { input: bytes(256 << 10), op: ReduceOp::Sum, output: None }))
        .wait()
        .unwrap();
    timed(&r, &m2, us(8), || p2.submit(Barrier)).wait().unwrap();
    timed(&r, &m2, us(4), || p2.submit(SendOp { buf: bytes(4000), dst: 1, tag: 0 })).wait().unwrap();
    // An op the formulas do not know: latency only, no exit.
    timed(&r, &m2, us(3), || p2.submit(Fancy(64))).wait().unwrap();
    // Detached: measured to completion.
    drop(p2.submit(Broadcast { buf: bytes(500), root: 0 }));
    r.time.increment(us(50));
    m2.complete_next();

    let s = r.logger.summary();
    assert_eq!(s.rank, Some(0));
    let row = |op: &str| s.rows.iter().find(|x| x.op == op).unwrap_or_else(|| panic!("no {op} row"));

    let ar = row("all_reduce");
    assert_eq!((ar.bytes, ar.group_size, ar.count, ar.errors, ar.detached), (1_000_000, 4, 3, 1, 0));
    assert_eq!((ar.total_us, ar.avg_us, ar.min_us, ar.p50_us, ar.max_us), (60.0, 20.0, 10.0, 20.0, 30.0));
    assert_eq!((ar.algbw_gbps, ar.busbw_gbps), (Some(50.0), Some(75.0))); // 1e6 B / 20 us; × 2·3/4

    let ag = row("all_gather");
    assert_eq!((ag.algbw_gbps, ag.busbw_gbps), (Some(4.0), Some(3.0))); // 4000 B / 1 us; × 3/4

    let rs = row("reduce_scatter");
    assert_eq!((rs.bytes, rs.size.as_str(), rs.avg_us), (262_144, "256.00 KiB", 100.0));
    assert_eq!((rs.algbw_gbps, rs.busbw_gbps), (Some(2.62144), Some(1.31072)));

    let b = row("barrier");
    assert_eq!((b.count, b.avg_us, b.algbw_gbps, b.busbw_gbps), (1, 8.0, None, None));
    assert_eq!((row("send").algbw_gbps, row("send").busbw_gbps), (Some(1.0), Some(1.0))); // 4000 B in 4 us
    let f = row("fancy_op");
    assert_eq!((f.count, f.avg_us, f.algbw_gbps), (1, 3.0, None));
    let bc = row("broadcast");
    assert_eq!((bc.count, bc.detached, bc.avg_us), (1, 1, 50.0));

    assert_eq!(r.logger.operation_count(), 10);
    assert_eq!(
        r.logger.logged_ops(),
        ["all_gather", "all_reduce", "barrier", "broadcast", "fancy_op", "reduce_scatter", "send"]
    );

    // The data round-trips through serde (DeepSpeed's return_dict, exportable).
    let json = serde_json::to_string(&s).unwrap();
    let back: Summary = serde_json::from_str(&json).unwrap();
    assert_eq!(back, s);
    assert!(json.contains("\"busbw_gbps\":75.0"), "{json}");

    r.logger.reset();
    assert!(!r.logger.has_data());
}

#[test]
fn table_is_aligned_and_grouped_by_op() {
    for way in WAYS {
        table(way);
    }
}

fn table(way: Way) {
    let r = rig_with(CommsConfig::default(), way);
    let m = Mock::new(0, 2, false);
    let p = r.layer.layer(m.clone());
    for (n, lat) in [(1024, 2), (1024, 4), (1 << 20, 100)] {
        timed(&r, &m, us(lat), || p.submit(AllReduce { buf: bytes(n), op: ReduceOp::Sum })).wait().unwrap();
    }
    timed(&r, &m, us(5), || p.submit(Barrier)).wait().unwrap();
    let table = r.logger.summary().to_string();
    let expected = "\
# comms summary (rank 0); latency in us, bandwidth in GB/s (10^9 B/s, nccl-tests)
op          size      ranks  count  errors   total     avg     min     p50     max  algbw  busbw
all_reduce  1.00 KiB      2      2       0    6.00    3.00    2.00    2.00    4.00   0.34   0.34
            1.00 MiB      2      1       0  100.00  100.00  100.00  100.00  100.00  10.49  10.49
barrier     0 B           2      1       0    5.00    5.00    5.00    5.00    5.00      -      -
";
    assert_eq!(table, expected, "{way:?}\n{table}");
}

#[test]
fn options_filter_and_key_what_is_recorded() {
    for way in WAYS {
        options(way);
    }
}

fn options(way: Way) {
    let r = rig_with(
        CommsConfig { prof_all: false, prof_ops: vec!["all_gather_into_tensor".into()], ..Default::default() },
        way,
    );
    let m = Mock::new(0, 2, true);
    let p = r.layer.layer(m);
    p.submit(AllReduce { buf: bytes(8), op: ReduceOp::Sum }).wait().unwrap();
    p.submit(AllGather { input: bytes(8), output: None }).wait().unwrap();
    assert_eq!(r.logger.logged_ops(), ["all_gather"]);

    r.logger.configure(CommsConfig { enabled: false, sample_every: 1, ..Default::default() });
    p.submit(AllGather { input: bytes(8), output: None }).wait().unwrap();
    assert_eq!(r.logger.operation_count(), 1);

    // debug: keyed by the span the op was called in.
    r.logger.configure(CommsConfig { debug: true, sample_every: 1, ..Default::default() });
    tracing::info_span!("forward").in_scope(|| p.submit(Barrier)).wait().unwrap();
    tracing::info_span!("backward").in_scope(|| p.submit(Barrier)).wait().unwrap();
    p.submit(Barrier).wait().unwrap();
    let s = r.logger.summary();
    let callers: Vec<Option<&str>> = s.rows.iter().filter(|x| x.op == "barrier").map(|x| x.caller.as_deref()).collect();
    assert_eq!(callers, [None, Some("backward"), Some("forward")]);
    assert!(s.to_string().contains("barrier [in forward]"));
}

#[test]
fn verbose_prints_one_line_per_op() {
    for way in WAYS {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let l = lines.clone();
        let (clock, time) = quanta::Clock::mock();
        let logger = CommsLogger::with_clock(CommsConfig { verbose: true, ..Default::default() }, clock)
            .with_output(move |s| l.lock().unwrap().push(s.to_owned()));
        let (layer, subscriber) = match way {
            Way::Spans => {
                (ProfilingLayer::new(), tracing::Dispatch::new(tracing_subscriber::registry().with(logger.clone())))
            }
            Way::Direct => (ProfilingLayer::new().with_logger(logger.clone()), tracing::Dispatch::none()),
        };
        let _g = tracing::dispatcher::set_default(&subscriber);
        let m = Mock::new(1, 2, false);
        let p = layer.layer(m.clone());
        // Verbose times every call, whatever the sampling.
        for _ in 0..2 {
            let w = p.submit(AllReduce { buf: bytes(2048), op: ReduceOp::Sum });
            time.increment(us(2));
            m.complete_next();
            w.wait().unwrap();
        }
        let line = "comm op: all_reduce | time (us): 2.00 | msg size: 2.00 KiB | ranks: 2 | algbw (GB/s): 1.02 | busbw (GB/s): 1.02";
        assert_eq!(lines.lock().unwrap().as_slice(), [line, line], "{way:?}");
    }
}

/// The direct path counts every op exactly, whether it finished inline or not, failed, was
/// detached or sampled out, from any number of threads; spans of its ops are left to it.
#[test]
fn direct_recording_counts_every_op_and_times_a_sample() {
    let (clock, _) = quanta::Clock::mock();
    let logger =
        CommsLogger::with_clock(CommsConfig { sample_every: 4, time_all_from: 1 << 20, ..Default::default() }, clock);
    // Also installed as a subscriber layer: it must not count these ops twice.
    let _g = tracing::subscriber::set_default(tracing_subscriber::registry().with(logger.clone()));
    let layer = ProfilingLayer::new().with_logger(logger.clone());

    let inline = Mock::new(0, 2, true);
    let p = layer.layer(inline.clone());
    for _ in 0..1000 {
        p.submit(AllReduce { buf: bytes(64), op: ReduceOp::Sum }).wait().unwrap();
    }
    inline.fail_inline_next(CommError::Shutdown("test".into()));
    assert!(p.submit(AllReduce { buf: bytes(64), op: ReduceOp::Sum }).wait().is_err());
    // Large messages: every call timed.
    for _ in 0..10 {
        p.submit(AllReduce { buf: bytes(1 << 20), op: ReduceOp::Sum }).wait().unwrap();
    }
    let queued = Mock::new(0, 2, false);
    let q = layer.layer(queued.clone());
    let w = q.submit(AllReduce { buf: bytes(64), op: ReduceOp::Sum });
    let mid = logger.summary();
    // Counted when submitted (a failure is taken back when it completes).
    assert_eq!(mid.rows[0].count, 1001);
    queued.complete_next();
    w.wait().unwrap();
    let w = q.submit(AllReduce { buf: bytes(64), op: ReduceOp::Sum });
    queued.fail_next(CommError::Shutdown("test".into()));
    assert!(w.wait().is_err());
    drop(q.submit(AllReduce { buf: bytes(64), op: ReduceOp::Sum }));
    queued.complete_next();

    // Four threads at once.
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..500 {
                    p.submit(AllReduce { buf: bytes(64), op: ReduceOp::Sum }).wait().unwrap();
                }
            });
        }
    });

    let s = logger.summary();
    let small = s.rows.iter().find(|r| r.bytes == 64).unwrap();
    assert_eq!((small.count, small.errors, small.detached), (1000 + 2 + 2000, 2, 1));
    // The first 4 calls per thread and row, then one in about 4 by a hash of the index.
    assert!((600..1200).contains(&small.timed), "{} of {} timed", small.timed, small.count);
    let large = s.rows.iter().find(|r| r.bytes == 1 << 20).unwrap();
    assert_eq!((large.count, large.timed), (10, 10));
    assert_eq!(logger.operation_count(), 3002 + 2 + 10);
    assert!(s.to_string().contains(&format!("{} ({} timed)", small.count, small.timed)));

    logger.reset();
    assert!(!logger.has_data());
    p.submit(AllReduce { buf: bytes(64), op: ReduceOp::Sum }).wait().unwrap();
    assert_eq!(logger.operation_count(), 1);
}

/// Direct recording with sampling: the latency columns are over the timed calls, the total
/// is the mean times the count.
#[test]
fn sampled_latencies_come_from_the_timed_calls() {
    let (clock, time) = quanta::Clock::mock();
    let logger = CommsLogger::with_clock(CommsConfig { sample_every: 8, ..Default::default() }, clock);
    let m = Mock::new(0, 2, false);
    let p = ProfilingLayer::new().with_logger(logger.clone()).layer(m.clone());
    for _ in 0..400 {
        let w = p.submit(AllReduce { buf: bytes(64), op: ReduceOp::Sum });
        time.increment(us(3));
        m.complete_next();
        w.wait().unwrap();
    }
    let r = logger.summary().rows.remove(0);
    assert_eq!(r.count, 400);
    assert!(r.timed >= 8 && r.timed < 200, "{}", r.timed);
    assert_eq!((r.min_us, r.p50_us, r.max_us, r.avg_us), (3.0, 3.0, 3.0, 3.0));
    assert_eq!(r.total_us, 1200.0);
}
