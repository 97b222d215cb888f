//! GPU tests of the NCCL backend. Each prints `skipped: no CUDA device (<why>)` and passes where
//! NCCL cannot run (no driver, no libnccl, no GPU), so they are part of every `cargo test`;
//! `cargo xtask gpu-test` runs them with `COMM_NCCL_REQUIRE_GPU=1`, which turns a skip into a
//! failure (on a machine that is supposed to have a GPU, a silent skip would hide a broken
//! setup).
//!
//! - the conformance suite on 1 rank (in process), and on 2 ranks as 2 processes where two
//!   GPUs are visible;
//! - zero-copy ops on device buffers (`CudaSlice`), including a buffer written on another
//!   stream and submitted at once, and the argument/unsupported errors;
//! - abort on timeout: a stalled stream times out, the communicator is aborted, the group is
//!   poisoned, and shutdown still works.

use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::{Duration, Instant};

use backend_nccl::{
    is_available, DeviceAllGather, DeviceAllReduce, DeviceAllToAll, DeviceBroadcast, DeviceReduce, DeviceReduceScatter,
    NcclBackend, NcclInfo, NcclOptions, Stall,
};
use comm_core::ops::{AllGather, AllReduce, Barrier};
use comm_core::{bf16, Backend, Collective, CommError, Group, HostBuffer, MemoryStore, ReduceOp, Store};
use comm_test::SuiteConfig;

const T: Duration = Duration::from_secs(600);

/// The probe's result, or `None` after printing why the test is skipped.
fn gpu(need: usize) -> Option<NcclInfo> {
    let require = std::env::var_os("COMM_NCCL_REQUIRE_GPU").is_some_and(|v| v == "1");
    let why = match is_available() {
        Ok(info) if info.devices >= need => return Some(info),
        Ok(info) => format!("needs {need} CUDA devices, {} visible", info.devices),
        Err(e) => e.to_string(),
    };
    if require && need == 1 {
        panic!("COMM_NCCL_REQUIRE_GPU=1 but NCCL cannot run here: {why}");
    }
    println!("skipped: no CUDA device ({why})");
    None
}

fn opts(timeout: Duration) -> NcclOptions {
    NcclOptions { timeout, ..NcclOptions::default() }
}

async fn one_rank(timeout: Duration) -> NcclBackend {
    one_rank_with(opts(timeout)).await
}

async fn one_rank_with(o: NcclOptions) -> NcclBackend {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    NcclBackend::new(store, 0, 1, o).await.expect("a 1-rank NCCL communicator")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_1_rank() {
    let Some(info) = gpu(1) else { return };
    println!("NCCL {:?}, driver CUDA {:?}, {} device(s)", info.nccl_version, info.driver_cuda_version, info.devices);
    // Host buffers copied through pinned memory, then every non-empty one page-locked and
    // copied directly.
    for (how, register_min) in [("copied", usize::MAX), ("registered", 1)] {
        let b = one_rank_with(NcclOptions { register_min: Some(register_min), ..opts(Duration::from_secs(120)) }).await;
        let mut cfg = SuiteConfig::default();
        cfg.allow_unsupported = true;
        let start = Instant::now();
        let report = comm_test::suite::run(Arc::new(b.clone()) as Arc<dyn Backend>, &cfg)
            .await
            .unwrap_or_else(|e| panic!("{how}: {e}"));
        println!(
            "conformance, 1 rank on device {}, host buffers {how}: {} checks passed, {} skipped (unsupported), {:.2}s",
            b.device(),
            report.checks,
            report.skipped.len(),
            start.elapsed().as_secs_f64()
        );
        // Only the bitwise reductions (which NCCL lacks) may be skipped.
        for s in &report.skipped {
            assert!(s.contains("band") || s.contains("bor") || s.contains("bxor"), "unexpected skip: {s}");
        }
        assert!(report.checks > 500, "{} checks", report.checks);
        b.shutdown().await.unwrap();
    }
}

/// Large host buffers, page-locked or copied, and many small ones in flight at once with every
/// buffer registered: buffers that share a page cannot all be registered, and fall back to the
/// copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_buffers_registered_or_copied() {
    if gpu(1).is_none() {
        return;
    }
    // Every buffer, those from the measured size, none.
    for register_min in [Some(1), None, Some(usize::MAX)] {
        let b = one_rank_with(NcclOptions { register_min, ..opts(Duration::from_secs(120)) }).await;
        let register_min = b.register_min();
        println!("host buffers page-locked from {register_min} bytes");
        for n in [1usize << 18, (3 << 20) + 5, 16 << 20] {
            let data: Vec<f32> = (0..n).map(|i| (i % 4099) as f32).collect();
            let out = b.submit(AllReduce { buf: HostBuffer::from_slice(&data), op: ReduceOp::Max }).await.unwrap();
            assert!(out.to_vec::<f32>().unwrap() == data, "all_reduce of {n} floats, register_min {register_min}");
            let io = b.submit(AllGather { input: HostBuffer::from_slice(&data), output: None }).await.unwrap();
            assert!(io.output.to_vec::<f32>().unwrap() == data, "all_gather of {n} floats");
            assert!(io.input.to_vec::<f32>().unwrap() == data, "all_gather's input comes back as it was");
        }
        let works: Vec<_> = (0..64)
            .map(|i| b.submit(AllReduce { buf: HostBuffer::from_slice(&[i as f64; 3]), op: ReduceOp::Sum }))
            .collect();
        for (i, w) in works.into_iter().enumerate() {
            assert_eq!(w.await.unwrap().to_vec::<f64>().unwrap(), [i as f64; 3], "small op {i} in flight");
        }
        b.shutdown().await.unwrap();
    }
}

#[test]
fn conformance_2_ranks() {
    if std::env::var_os(comm_test::multiprocess::CHILD_ENV).is_none() && gpu(2).is_none() {
        return;
    }
    let env = |_| vec![("NCCL_SOCKET_IFNAME".to_owned(), "lo".to_owned())];
    comm_test::multiprocess::run_with_env(2, "conformance_2_ranks", T, env, || async {
        let world = discovery::from_env().map_err(|e| e.to_string())?;
        let (store, _server) = discovery::rendezvous(&world, T).await.map_err(|e| e.to_string())?;
        let b = NcclBackend::new(store, world.rank, world.world_size, opts(Duration::from_secs(120)))
            .await
            .map_err(|e| e.to_string())?;
        let mut cfg = SuiteConfig::default();
        cfg.allow_unsupported = true;
        let r = comm_test::suite::run(Arc::new(b.clone()) as Arc<dyn Backend>, &cfg).await?;
        println!("conformance, rank {} of 2: {} checks passed, {} skipped", r.rank, r.checks, r.skipped.len());
        device_ops_two_ranks(&b).await?;
        b.shutdown().await.map_err(|e| e.to_string())
    });
}

/// Two ranks: device all_reduce sums across GPUs, a device send/recv exchange in both
/// directions (batched), all_to_all.
async fn device_ops_two_ranks(b: &NcclBackend) -> Result<(), String> {
    let me = b.rank();
    let s = b.context().default_stream();
    let x = s.clone_htod(&[me as f32 + 1.0; 1000]).map_err(|e| e.to_string())?;
    let y = b.submit(DeviceAllReduce { buf: x, op: ReduceOp::Sum }).await.map_err(|e| e.to_string())?;
    let y = s.clone_dtoh(&y).map_err(|e| e.to_string())?;
    if y.iter().any(|&v| v != 3.0) {
        return Err(format!("device all_reduce: {:?}", &y[..4]));
    }
    let peer = 1 - me;
    let out = s.clone_htod(&[me as i64 * 10; 4096]).map_err(|e| e.to_string())?;
    let inb = s.alloc_zeros::<i64>(4096).map_err(|e| e.to_string())?;
    let send = b.submit(backend_nccl::DeviceSend { buf: out, dst: peer });
    let recv = b.submit(backend_nccl::DeviceRecv { buf: inb, src: peer });
    let (send, recv) = futures::future::join(send, recv).await;
    send.map_err(|e| e.to_string())?;
    let got = s.clone_dtoh(&recv.map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    if got.iter().any(|&v| v != peer as i64 * 10) {
        return Err(format!("device send/recv: {:?}", &got[..4]));
    }
    let input = s.clone_htod(&[me as i32 * 2, me as i32 * 2 + 1]).map_err(|e| e.to_string())?;
    let output = s.alloc_zeros::<i32>(2).map_err(|e| e.to_string())?;
    let io = b.submit(DeviceAllToAll { input, output }).await.map_err(|e| e.to_string())?;
    let got = s.clone_dtoh(&io.output).map_err(|e| e.to_string())?;
    if got != [me as i32, me as i32 + 2] {
        return Err(format!("device all_to_all on rank {me}: {got:?}"));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_buffers_zero_copy() {
    if gpu(1).is_none() {
        return;
    }
    let b = one_rank(Duration::from_secs(60)).await;
    let ctx = b.context().clone();
    // Written on a stream of the caller's own, submitted at once: the op must wait for it.
    let theirs = ctx.new_stream().unwrap();
    let data: Vec<f32> = (0..1 << 20).map(|i| i as f32 * 0.5).collect();
    let x = theirs.clone_htod(&data).unwrap();
    let x = b.submit(DeviceAllReduce { buf: x, op: ReduceOp::Sum }).await.unwrap();
    assert_eq!(theirs.clone_dtoh(&x).unwrap(), data, "sum over one rank is the input");
    let x = b.submit(DeviceAllReduce { buf: x, op: ReduceOp::Avg }).await.unwrap();
    assert_eq!(theirs.clone_dtoh(&x).unwrap(), data, "avg over one rank is the input");

    let s = ctx.default_stream();
    let h: Vec<bf16> = (0..777).map(|i| bf16::from_f32(i as f32)).collect();
    let y = b.submit(DeviceBroadcast { buf: s.clone_htod(&h).unwrap(), root: 0 }).await.unwrap();
    assert_eq!(s.clone_dtoh(&y).unwrap(), h);
    let y = b.submit(DeviceReduce { buf: y, op: ReduceOp::Max, root: 0 }).await.unwrap();
    assert_eq!(s.clone_dtoh(&y).unwrap(), h);

    // Outputs start at zero: the data really moved.
    let ints: Vec<i64> = (0..4099).map(|i| i * 3 - 7).collect();
    let io = b
        .submit(DeviceAllGather { input: s.clone_htod(&ints).unwrap(), output: s.alloc_zeros(4099).unwrap() })
        .await
        .unwrap();
    assert_eq!(s.clone_dtoh(&io.output).unwrap(), ints);
    let io = b
        .submit(DeviceReduceScatter { input: io.output, output: s.alloc_zeros(4099).unwrap(), op: ReduceOp::Sum })
        .await
        .unwrap();
    assert_eq!(s.clone_dtoh(&io.output).unwrap(), ints);
    let io = b.submit(DeviceAllToAll { input: io.output, output: s.alloc_zeros(4099).unwrap() }).await.unwrap();
    assert_eq!(s.clone_dtoh(&io.output).unwrap(), ints);
    let u: Vec<u8> = (0..=255).collect();
    let z = b.submit(DeviceAllReduce { buf: s.clone_htod(&u).unwrap(), op: ReduceOp::Min }).await.unwrap();
    assert_eq!(s.clone_dtoh(&z).unwrap(), u);

    // Errors: wrong output length, a reduction NCCL lacks; the group stays usable.
    let e = b
        .submit(DeviceAllGather { input: s.alloc_zeros::<f32>(4).unwrap(), output: s.alloc_zeros(5).unwrap() })
        .await
        .unwrap_err();
    assert!(matches!(e, CommError::InvalidArgument { .. }), "{e}");
    let e = b.submit(DeviceAllReduce { buf: s.alloc_zeros::<i32>(4).unwrap(), op: ReduceOp::BXor }).await.unwrap_err();
    assert!(matches!(e, CommError::Unsupported { .. }), "{e}");
    let e = b.submit(DeviceAllReduce { buf: s.alloc_zeros::<f32>(4).unwrap(), op: ReduceOp::BAnd }).await.unwrap_err();
    assert!(matches!(e, CommError::InvalidArgument { .. }), "{e}");
    let empty = b.submit(DeviceAllReduce { buf: s.alloc_zeros::<f32>(0).unwrap(), op: ReduceOp::Sum }).await.unwrap();
    assert!(empty.is_empty());
    Collective::<Barrier>::submit(&b, Barrier).await.unwrap();

    // Many small ops back to back: each completes from its event, in order.
    let mut works = Vec::new();
    for i in 0..200 {
        works.push(b.submit(DeviceAllReduce { buf: s.clone_htod(&[i as f32; 16]).unwrap(), op: ReduceOp::Sum }));
    }
    let start = Instant::now();
    for (i, w) in works.into_iter().enumerate() {
        assert_eq!(s.clone_dtoh(&w.await.unwrap()).unwrap(), [i as f32; 16]);
    }
    println!("200 queued 64-byte device all_reduces drained in {:?}", start.elapsed());
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_on_timeout_poisons_the_group() {
    if gpu(1).is_none() {
        return;
    }
    let timeout = Duration::from_secs(2);
    let b = one_rank(timeout).await;
    let ok = b.submit(AllReduce { buf: HostBuffer::from_slice(&[1.0f32, 2.0]), op: ReduceOp::Sum }).await.unwrap();
    assert_eq!(ok.to_vec::<f32>().unwrap(), [1.0, 2.0]);

    let stall = Stall::default();
    let release = stall.release.clone();
    // Let the stream go on eventually, so the abort (which may wait for the device) returns.
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(4));
        release.store(true, SeqCst);
    });
    let start = Instant::now();
    let work = b.submit(stall);
    assert!(!work.is_completed());
    let e = work.await.unwrap_err();
    let took = start.elapsed();
    println!("stalled op failed after {took:?}: {e}");
    assert!(matches!(&e, CommError::Timeout { op, .. } if op == "stall"), "{e:?}");
    assert!(e.to_string().contains("aborted"), "{e}");
    assert!(took >= timeout && took < Duration::from_secs(60), "{took:?}");

    let e = b.submit(AllReduce { buf: HostBuffer::from_slice(&[1.0f32]), op: ReduceOp::Sum }).await.unwrap_err();
    assert!(matches!(e, CommError::Poisoned { .. }), "later ops fail fast: {e:?}");
    let e = Collective::<Barrier>::submit(&b, Barrier).await.unwrap_err();
    assert!(matches!(e, CommError::Poisoned { .. }), "{e:?}");
    releaser.join().unwrap();
    b.shutdown().await.unwrap();

    // A fresh communicator on the same device works after that.
    let b = one_rank(Duration::from_secs(30)).await;
    let ok = b.submit(AllReduce { buf: HostBuffer::from_slice(&[3i64]), op: ReduceOp::Max }).await.unwrap();
    assert_eq!(ok.to_vec::<i64>().unwrap(), [3]);
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_that_does_not_exist_is_refused() {
    let Some(info) = gpu(1) else { return };
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let o = NcclOptions { device: Some(info.devices), ..opts(Duration::from_secs(30)) };
    let e = NcclBackend::new(store, 0, 1, o).await.map(|_| ()).unwrap_err();
    assert!(matches!(e, CommError::Unavailable { .. }), "{e:?}");
    assert!(e.to_string().contains(&format!("device {}", info.devices)), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_on_another_device_is_refused() {
    if gpu(2).is_none() {
        return;
    }
    let b = one_rank(Duration::from_secs(30)).await;
    let other = backend_nccl::cudarc::driver::CudaContext::new(1 - b.device()).unwrap();
    let x = other.default_stream().clone_htod(&[1.0f32; 8]).unwrap();
    let e = b.submit(DeviceAllReduce { buf: x, op: ReduceOp::Sum }).await.unwrap_err();
    assert!(matches!(e, CommError::InvalidArgument { .. }), "{e:?}");
    assert!(e.to_string().contains("lives on CUDA device"), "{e}");
    // The group is still usable.
    let ok = b.submit(AllReduce { buf: HostBuffer::from_slice(&[2.0f32]), op: ReduceOp::Sum }).await.unwrap();
    assert_eq!(ok.to_vec::<f32>().unwrap(), [2.0]);
    b.shutdown().await.unwrap();
}

/// A group shrunk to its survivors (here the one rank: one GPU) gets a new communicator that
/// works; the old one is aborted and refuses ops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shrink_makes_a_new_communicator() {
    if gpu(1).is_none() {
        return;
    }
    let old = one_rank(Duration::from_secs(60)).await;
    let shrunk = old.shrink().await.expect("shrink");
    assert_eq!(shrunk.ranks, [0]);
    let sum = Collective::<AllReduce>::submit(
        &*shrunk.group,
        AllReduce { buf: HostBuffer::from(vec![2.0f32; 8]), op: ReduceOp::Sum },
    )
    .await
    .unwrap();
    assert_eq!(sum.to_vec::<f32>().unwrap(), [2.0; 8]);
    let refused = old.submit(AllReduce { buf: HostBuffer::from(vec![1.0f32]), op: ReduceOp::Sum }).await;
    assert!(refused.is_err(), "the old group still ran an op");
    shrunk.group.shutdown().await.unwrap();
}
