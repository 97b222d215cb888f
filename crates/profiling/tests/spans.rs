//! The span of each op: name, fields, parent, and when it ends (completion, error, detach).

mod common;

use std::sync::Arc;

use comm_core::ops::{AllGather, AllReduce, Barrier, Broadcast};
use comm_core::{Backend, Collective, CommError, Group, Work};
use common::{f32s, Capture, Fancy, Mock};
use profiling::{without_profiling, ProfilingLayer};
use tracing_subscriber::layer::SubscriberExt;

fn capture() -> (Capture, tracing::subscriber::DefaultGuard) {
    let cap = Capture::default();
    let guard = tracing::subscriber::set_default(tracing_subscriber::registry().with(cap.clone()));
    (cap, guard)
}

#[test]
fn span_has_every_field_and_the_callers_span_as_parent() {
    let (cap, _g) = capture();
    let mock = Mock::new(1, 4, false);
    let p = ProfilingLayer::new().layer(mock.clone());
    let step = tracing::info_span!("train_step");
    let w = step.in_scope(|| p.submit(AllReduce { buf: f32s(256), op: comm_core::ReduceOp::Sum }));

    let s = &cap.named("comm.all_reduce")[0];
    assert_eq!(s.target, "comm");
    assert_eq!(s.parent, Some("train_step"));
    let f = |k: &str| s.fields.get(k).cloned().unwrap_or_default();
    assert_eq!(f("comm.op"), "all_reduce");
    assert_eq!(f("comm.bytes"), "1024");
    assert_eq!(f("comm.dtype"), "f32");
    assert_eq!((f("comm.rank"), f("comm.world_size")), ("1".into(), "4".into()));
    assert_eq!((f("comm.group_rank"), f("comm.group_size")), ("1".into(), "4".into()));
    assert_eq!(f("comm.backend"), "mock");
    assert_eq!((f("otel.name"), f("otel.kind")), ("comm.all_reduce".into(), "client".into()));
    assert!(!s.fields.contains_key("otel.status_code") && !s.fields.contains_key("comm.detached"));

    // Open until the op completes; awaiting is not what ends it.
    assert!(!cap.named("comm.all_reduce")[0].closed);
    mock.complete_next();
    assert!(cap.named("comm.all_reduce")[0].closed, "closed at completion, before anyone looked at the work");
    assert_eq!(w.wait().unwrap().len(), 256);
}

#[test]
fn inline_ops_end_before_submit_returns_and_barrier_has_no_dtype() {
    let (cap, _g) = capture();
    let p = ProfilingLayer::new().layer(Mock::new(0, 2, true));
    let w = p.submit(Barrier);
    let s = &cap.named("comm.barrier")[0];
    assert!(s.closed);
    assert_eq!(s.fields["comm.bytes"], "0");
    assert!(!s.fields.contains_key("comm.dtype"));
    assert!(w.is_completed());
    w.wait().unwrap();
}

#[test]
fn failed_ops_mark_the_span_as_an_error() {
    let (cap, _g) = capture();
    let mock = Mock::new(0, 2, false);
    let p = ProfilingLayer::new().layer(mock.clone());
    let w = p.submit(Broadcast { buf: f32s(4), root: 0 });
    mock.fail_next(CommError::peer_lost(1, "exited"));
    let s = &cap.named("comm.broadcast")[0];
    assert!(s.closed);
    assert_eq!(s.fields["otel.status_code"], "ERROR");
    assert_eq!(s.fields["otel.status_description"], "peer rank 1 lost: exited");
    assert!(matches!(w.wait(), Err(CommError::PeerLost { rank: 1, .. })));
}

#[test]
fn detached_ops_end_at_completion_and_say_so() {
    let (cap, _g) = capture();
    let mock = Mock::new(0, 2, false);
    let p = ProfilingLayer::new().layer(mock.clone());
    drop(p.submit(AllGather { input: f32s(2), output: None }));
    assert!(!cap.named("comm.all_gather")[0].closed, "the op still runs: the span stays open");
    mock.complete_next();
    let s = &cap.named("comm.all_gather")[0];
    assert!(s.closed);
    assert_eq!(s.fields["comm.detached"], "true");
}

#[test]
fn ops_outside_the_known_list_get_a_generic_callsite_and_their_name() {
    let (cap, _g) = capture();
    let p = ProfilingLayer::new().with_world(3, 8).layer(Mock::new(0, 2, true));
    p.submit(Fancy(12)).wait().unwrap();
    let s = &cap.named("comm.op")[0];
    assert_eq!(s.fields["otel.name"], "comm.fancy_op");
    assert_eq!(s.fields["comm.op"], "fancy_op");
    assert_eq!((s.fields["comm.rank"].as_str(), s.fields["comm.world_size"].as_str()), ("3", "8"));
    assert_eq!(s.fields["comm.group_size"], "2");
}

#[test]
fn no_span_without_an_interested_subscriber_or_when_suppressed() {
    // No subscriber at all: the op passes through.
    let p = ProfilingLayer::new().layer(Mock::new(0, 1, true));
    p.submit(Barrier).wait().unwrap();
    let (cap, _g) = capture();
    without_profiling(|| p.submit(Barrier)).wait().unwrap();
    assert!(cap.all().is_empty());
    p.submit(Barrier).wait().unwrap();
    assert_eq!(cap.all().len(), 1);
}

#[test]
fn works_that_complete_later_still_resolve_through_map() {
    let (cap, _g) = capture();
    let mock = Mock::new(0, 2, false);
    let p = ProfilingLayer::new().layer(mock.clone());
    let w: Work<usize> = p.submit(AllReduce { buf: f32s(3), op: comm_core::ReduceOp::Max }).map(|b| b.len());
    let t = std::thread::spawn(move || w.wait().unwrap());
    std::thread::sleep(std::time::Duration::from_millis(20));
    mock.complete_next();
    assert_eq!(t.join().unwrap(), 3);
    assert!(cap.named("comm.all_reduce")[0].closed);
}

/// Runs `f` on `n` threads, one LocalWorld rank each, each with the capture subscriber.
fn on_ranks<T: Send + 'static>(
    n: u32,
    cap: &Capture,
    f: impl Fn(Arc<dyn Backend>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let ranks = comm_test::LocalWorld::new(n);
    let threads: Vec<_> = ranks
        .into_iter()
        .map(|b| {
            let (f, cap) = (f.clone(), cap.clone());
            std::thread::spawn(move || {
                let _g = tracing::subscriber::set_default(tracing_subscriber::registry().with(cap));
                f(b)
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

#[test]
fn sub_groups_are_profiled_with_the_process_rank() {
    let cap = Capture::default();
    on_ranks(3, &cap, |b| {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let p = ProfilingLayer::new().layer(b);
            let me = p.rank();
            let sub = p.new_group(&[0, 2]).await.unwrap();
            if let Some(sub) = sub {
                let out = sub.submit(AllReduce { buf: f32s(2), op: comm_core::ReduceOp::Sum }).await.unwrap();
                assert_eq!(out.len(), 2);
                assert_eq!(sub.world_size(), 2);
            } else {
                assert_eq!(me, 1);
            }
        })
    });
    let spans = cap.named("comm.all_reduce");
    assert_eq!(spans.len(), 2);
    let mut ranks: Vec<(String, String, String, String)> = spans
        .iter()
        .map(|s| {
            let f = |k: &str| s.fields[k].clone();
            (f("comm.rank"), f("comm.world_size"), f("comm.group_rank"), f("comm.group_size"))
        })
        .collect();
    ranks.sort();
    assert_eq!(
        ranks,
        [("0".into(), "3".into(), "0".into(), "2".into()), ("2".into(), "3".into(), "1".into(), "2".into())]
    );
    assert_eq!(cap.named("comm.new_group").len(), 3);
    assert!(spans.iter().all(|s| s.closed));
}

#[test]
fn conformance_suite_passes_through_the_layer() {
    let cap = Capture::default();
    let reports = on_ranks(2, &cap, |b| {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let profiled: Arc<dyn Backend> = Arc::new(ProfilingLayer::new().layer(b));
        rt.block_on(comm_test::suite::run(profiled, &comm_test::SuiteConfig::quick()))
    });
    for r in reports {
        r.unwrap();
    }
    let spans = cap.all();
    assert!(spans.iter().filter(|s| s.target == "comm").count() > 100, "{} spans", spans.len());
    assert!(spans.iter().filter(|s| s.name.starts_with("comm.") && s.name != "comm.new_group").all(|s| s.closed));
    for op in [
        "all_reduce",
        "broadcast",
        "reduce",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "scatter",
        "gather",
        "send",
        "recv",
        "barrier",
    ] {
        assert!(!cap.named(&format!("comm.{op}")).is_empty(), "no span for {op}");
    }
}
