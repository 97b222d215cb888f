//! The profiling layer's own cost per op, without any transport: an op that completes inline
//! (a backend doing nothing) submitted through `Profiling` with no subscriber, with a
//! subscriber that wants nothing, with a `CommsLogger` recording directly (`with_logger`,
//! with its default sampling and timing every call), and with a `CommsLogger` subscriber.
//! Run in release:
//! `cargo run --release -p profiling --example span_cost`.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use comm_core::ops::AllReduce;
use comm_core::{Backend, Collective, CommError, DType, Group, HostBuffer, Rank, ReduceOp, Work};
use profiling::{CommsConfig, CommsLogger, ProfilingLayer};
use tracing_subscriber::layer::SubscriberExt;

/// Completes every all_reduce at once, handing the buffer back.
struct Instant0;

#[async_trait]
impl Group for Instant0 {
    fn rank(&self) -> Rank {
        0
    }
    fn world_size(&self) -> u32 {
        2
    }
    fn backend_name(&self) -> &'static str {
        "noop"
    }
    async fn new_group(&self, _: &[Rank]) -> Result<Option<Arc<dyn Backend>>, CommError> {
        Ok(None)
    }
    async fn shutdown(&self) -> Result<(), CommError> {
        Ok(())
    }
}

impl Collective<AllReduce> for Instant0 {
    fn submit(&self, req: AllReduce) -> Work<HostBuffer> {
        Work::ready(Ok(req.buf))
    }
}

fn per_op_ns(c: &impl Collective<AllReduce>, iters: u32) -> f64 {
    let mut buf = Some(HostBuffer::zeroed(DType::F32, 256));
    let start = Instant::now();
    for _ in 0..iters {
        let b = buf.take().unwrap();
        buf = Some(c.submit(AllReduce { buf: b, op: ReduceOp::Sum }).wait().unwrap());
    }
    start.elapsed().as_nanos() as f64 / f64::from(iters)
}

fn main() {
    let iters = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(1_000_000);
    if std::env::args().nth(2).as_deref() == Some("logger") {
        // Only the CommsLogger mode, for a profiler.
        let logger = CommsLogger::new(CommsConfig::default());
        let on = tracing::Dispatch::new(tracing_subscriber::registry().with(logger));
        let profiled = ProfilingLayer::new().layer(Instant0);
        let ns = tracing::dispatcher::with_default(&on, || per_op_ns(&profiled, iters));
        println!("CommsLogger: {ns:.1} ns/op");
        return;
    }
    if std::env::args().nth(2).as_deref() == Some("direct") {
        let every = std::env::var("EVERY").ok().and_then(|s| s.parse().ok()).unwrap_or(16);
        let enabled = std::env::var("DISABLED").is_err();
        let direct = CommsLogger::new(CommsConfig { sample_every: every, enabled, ..CommsConfig::default() });
        let sampled = ProfilingLayer::new().with_logger(direct.clone()).layer(Instant0);
        let ns = per_op_ns(&sampled, iters);
        println!("direct: {ns:.1} ns/op");
        return;
    }
    let plain = Instant0;
    let profiled = ProfilingLayer::new().layer(Instant0);
    let logger = CommsLogger::new(CommsConfig::default());
    let on = tracing::Dispatch::new(tracing_subscriber::registry().with(logger.clone()));
    let idle = tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default());
    let direct = CommsLogger::new(CommsConfig::default());
    let sampled = ProfilingLayer::new().with_logger(direct.clone()).layer(Instant0);
    let every = CommsLogger::new(CommsConfig { sample_every: 1, ..CommsConfig::default() });
    let timed = ProfilingLayer::new().with_logger(every.clone()).layer(Instant0);
    // A registry needs at least one layer to free its spans (the layered stack closes them).
    let bare = tracing::Dispatch::new(tracing_subscriber::registry().with(tracing_subscriber::layer::Identity::new()));
    let clock = {
        let start = Instant::now();
        let mut last = start;
        for _ in 0..iters {
            last = std::hint::black_box(Instant::now());
        }
        (last - start).as_nanos() as f64 / f64::from(iters)
    };
    println!("Instant::now() costs {clock:.1} ns");
    for round in 0..3 {
        let off = per_op_ns(&plain, iters);
        let idle_ns = tracing::dispatcher::with_default(&idle, || per_op_ns(&profiled, iters));
        let bare_ns = tracing::dispatcher::with_default(&bare, || per_op_ns(&profiled, iters));
        let on_ns = tracing::dispatcher::with_default(&on, || per_op_ns(&profiled, iters));
        let sampled_ns = tracing::dispatcher::with_default(&idle, || per_op_ns(&sampled, iters));
        let timed_ns = tracing::dispatcher::with_default(&idle, || per_op_ns(&timed, iters));
        println!(
            "round {round}: off {off:.1} ns/op, idle {idle_ns:.1} (+{:.1}), registry only {bare_ns:.1} (+{:.1}), \
             direct logger {sampled_ns:.1} (+{:.1}), direct timing every call {timed_ns:.1} (+{:.1}), CommsLogger subscriber {on_ns:.1} (+{:.1})",
            idle_ns - off,
            bare_ns - off,
            sampled_ns - off,
            timed_ns - off,
            on_ns - off
        );
    }
    println!("recorded {} / {} / {} ops", direct.operation_count(), every.operation_count(), logger.operation_count());
}
