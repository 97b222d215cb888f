//! Per-op cost and bandwidth of `DeviceAllReduce` (f32, sum) on device buffers: the NCCL
//! backend without host staging, for comparison with `torch.distributed.all_reduce` on the same
//! GPU (`bench/torch_all_reduce.py` prints the same columns).
//!
//! ```text
//! cargo build --release -p backend-nccl --example device_bench
//! target/release/examples/device_bench            # 1 rank, in process
//! torchrun --standalone --nproc-per-node 2 --no-python target/release/examples/device_bench
//! ```
//!
//! Columns: `sync_us` is one op submitted and awaited at a time (what a caller that waits for
//! each all_reduce sees); `queued_us` is the time per op with `DEPTH` ops in flight on rotating
//! buffers (nccl-tests' loop); `algbw` is bytes / `queued_us`, `busbw` nccl-tests' 2(n-1)/n of it.
//! Sizes: `DEVICE_BENCH_SIZES` (bytes, comma-separated) or 8 B .. 256 MiB.

use std::sync::Arc;
use std::time::{Duration, Instant};

use backend_nccl::{DeviceAllReduce, NcclBackend, NcclOptions};
use comm_core::ops::Barrier;
use comm_core::{Collective, Group, MemoryStore, ReduceOp, Store};

const DEPTH: usize = 4;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let timeout = Duration::from_secs(120);
    let opts = NcclOptions { timeout, ..NcclOptions::default() };
    let (b, _server) = if std::env::var_os("RANK").is_some() {
        let world = discovery::from_env()?;
        let (store, server) = discovery::rendezvous(&world, timeout).await?;
        (NcclBackend::new(store, world.rank, world.world_size, opts).await?, Some(server))
    } else {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        (NcclBackend::new(store, 0, 1, opts).await?, None)
    };
    let (rank, n) = (b.rank(), b.world_size());
    let sizes: Vec<usize> = match std::env::var("DEVICE_BENCH_SIZES") {
        Ok(s) => s.split(',').map(|x| x.trim().parse()).collect::<Result<_, _>>()?,
        Err(_) => (3..=28).step_by(2).map(|p| 1usize << p).collect(),
    };
    let s = b.stream().clone();
    if rank == 0 {
        println!("# device_bench: DeviceAllReduce f32 sum, {n} rank(s), device {}, {:?}", b.device(), b.info());
        println!("{:>12} {:>10} {:>10} {:>10} {:>10}", "size(B)", "sync_us", "queued_us", "algbw", "busbw");
    }
    for bytes in sizes {
        let count = (bytes / 4).max(1);
        let iters = (200_000_000 / bytes.max(1)).clamp(5, 1000);
        let mut bufs = Vec::new();
        for _ in 0..DEPTH {
            bufs.push(s.clone_htod(&vec![1.0f32; count])?);
        }
        // Warm-up, and a correctness check: a sum of n ones, n times over after k ops of n^k.
        let first = bufs.pop().expect("DEPTH > 0");
        let first = b.submit(DeviceAllReduce { buf: first, op: ReduceOp::Sum }).await?;
        let got = s.clone_dtoh(&first)?;
        if got.iter().any(|&v| v != n as f32) {
            return Err(format!("rank {rank}: {bytes} B: got {:?}, want {n}", &got[..got.len().min(4)]).into());
        }
        bufs.push(first);
        Collective::<Barrier>::submit(&b, Barrier).await?;

        let mut buf = bufs.pop().expect("DEPTH > 0");
        let t = Instant::now();
        for _ in 0..iters {
            buf = b.submit(DeviceAllReduce { buf, op: ReduceOp::Sum }).await?;
        }
        let sync = t.elapsed().as_secs_f64() * 1e6 / iters as f64;
        bufs.push(buf);
        Collective::<Barrier>::submit(&b, Barrier).await?;

        let t = Instant::now();
        let mut flight = std::collections::VecDeque::new();
        for _ in 0..iters {
            let buf = match bufs.pop() {
                Some(buf) => buf,
                None => flight.pop_front().expect("DEPTH ops in flight").await?,
            };
            flight.push_back(b.submit(DeviceAllReduce { buf, op: ReduceOp::Sum }));
        }
        for w in flight {
            w.await?;
        }
        let queued = t.elapsed().as_secs_f64() * 1e6 / iters as f64;
        let algbw = bytes as f64 / queued / 1e3;
        let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
        if rank == 0 {
            println!("{bytes:>12} {sync:>10.2} {queued:>10.2} {algbw:>10.2} {busbw:>10.2}");
        }
        Collective::<Barrier>::submit(&b, Barrier).await?;
    }
    b.shutdown().await?;
    Ok(())
}
