//! The conformance suite on `LocalWorld` at several world sizes, and LocalWorld's own error
//! behaviour (mismatch, timeout, poisoning, invalid arguments, sub-groups, shutdown).

use std::sync::Arc;
use std::time::{Duration, Instant};

use comm_core::ops::{AllGather, AllReduce, AllToAll, Barrier, Broadcast, RecvFrom, Reduce, SendTo as SendOp};
use comm_core::{Backend, Collective, CommError, DType, Group, HostBuffer, Op, ReduceOp, Work};
use comm_test::{suite, LocalWorld, SuiteConfig};

fn submit<R: Op>(b: &Arc<dyn Backend>, req: R) -> Work<R::Output>
where
    dyn Backend: Collective<R>,
{
    Collective::<R>::submit(&**b, req)
}

/// Runs the suite on every rank of a fresh LocalWorld, one tokio task per rank.
async fn suite_on_local(n: u32) {
    let start = Instant::now();
    let cfg = SuiteConfig::default();
    let tasks: Vec<_> = LocalWorld::new(n)
        .into_iter()
        .map(|b| {
            let cfg = cfg.clone();
            tokio::spawn(async move { suite::run(b, &cfg).await })
        })
        .collect();
    for t in tasks {
        let report = t.await.expect("suite task").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(report.world_size, n);
        assert_eq!(report.backend, "local");
        assert!(report.checks > 500, "only {} checks", report.checks);
        assert!(report.skipped.is_empty());
        println!("rank {}: {} checks in {:?}", report.rank, report.checks, report.elapsed);
    }
    println!("world of {n}: {:?}", start.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_world_1() {
    suite_on_local(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_world_2() {
    suite_on_local(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_world_3() {
    suite_on_local(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_world_4() {
    suite_on_local(4).await;
}

#[test]
fn run_all_needs_no_runtime() {
    let cfg = SuiteConfig::quick();
    let reports = futures::executor::block_on(suite::run_all(LocalWorld::new(3), &cfg)).unwrap();
    assert_eq!(reports.len(), 3);
    assert!(reports.iter().enumerate().all(|(r, rep)| rep.rank as usize == r && rep.checks > 100));
}

fn f32s(v: &[f32]) -> HostBuffer {
    HostBuffer::from_slice(v)
}

fn expect_mismatch<T: std::fmt::Debug>(r: Result<T, CommError>, needle: &str) {
    match r {
        Err(CommError::Mismatch { detail, .. }) => assert!(detail.contains(needle), "{detail:?} lacks {needle:?}"),
        other => panic!("expected Mismatch containing {needle:?}, got {other:?}"),
    }
}

#[tokio::test]
async fn different_ops_lengths_dtypes_roots_and_reduce_ops_mismatch() {
    // Different op kinds.
    let w = LocalWorld::new(2);
    let a = submit(&w[0], AllReduce { buf: f32s(&[1.0]), op: ReduceOp::Sum });
    let b = submit(&w[1], Broadcast { buf: f32s(&[1.0]), root: 0 });
    expect_mismatch(a.await, "rank 0 called all_reduce but rank 1 called broadcast");
    expect_mismatch(b.await, "rank 0 called all_reduce but rank 1 called broadcast");
    // The group is poisoned afterwards: later ops fail fast.
    let later = submit(&w[0], Barrier).await;
    assert!(matches!(later, Err(CommError::Poisoned { .. })), "{later:?}");

    let w = LocalWorld::new(3);
    let works: Vec<_> = [3usize, 3, 4]
        .iter()
        .zip(&w)
        .map(|(&len, b)| submit(b, AllReduce { buf: HostBuffer::zeroed(DType::F32, len), op: ReduceOp::Sum }))
        .collect();
    for wk in works {
        expect_mismatch(wk.await, "rank 0 passed 3 elements but rank 2 passed 4");
    }

    let w = LocalWorld::new(2);
    let a = submit(&w[0], AllGather { input: HostBuffer::zeroed(DType::F32, 2), output: None });
    let b = submit(&w[1], AllGather { input: HostBuffer::zeroed(DType::BF16, 2), output: None });
    expect_mismatch(a.await, "rank 0 passed f32 data but rank 1 passed bf16");
    expect_mismatch(b.await, "f32");

    let w = LocalWorld::new(2);
    let a = submit(&w[0], Reduce { buf: f32s(&[1.0]), op: ReduceOp::Sum, root: 0 });
    let b = submit(&w[1], Reduce { buf: f32s(&[1.0]), op: ReduceOp::Sum, root: 1 });
    expect_mismatch(a.await, "named root");
    expect_mismatch(b.await, "named root");

    let w = LocalWorld::new(2);
    let a = submit(&w[0], AllReduce { buf: f32s(&[1.0]), op: ReduceOp::Sum });
    let b = submit(&w[1], AllReduce { buf: f32s(&[1.0]), op: ReduceOp::Max });
    expect_mismatch(a.await, "reduce op sum but rank 1 for max");
    expect_mismatch(b.await, "reduce op sum");
}

#[tokio::test]
async fn inconsistent_all_to_all_splits_and_p2p_tags_mismatch() {
    let w = LocalWorld::new(2);
    let a2a = |input: usize, ins: Vec<usize>, outs: Vec<usize>| AllToAll {
        input: HostBuffer::zeroed(DType::I32, input),
        output: None,
        input_splits: Some(ins),
        output_splits: Some(outs),
    };
    let a = submit(&w[0], a2a(3, vec![1, 2], vec![1, 1]));
    let b = submit(&w[1], a2a(2, vec![1, 1], vec![1, 1]));
    expect_mismatch(a.await, "rank 0 sends 2 elements to rank 1 but rank 1 expects 1 from rank 0");
    expect_mismatch(b.await, "rank 0 sends 2");

    let w = LocalWorld::new(2);
    let s = submit(&w[0], SendOp { buf: f32s(&[1.0]), dst: 1, tag: 7 });
    let r = submit(&w[1], RecvFrom { buf: HostBuffer::zeroed(DType::F32, 1), src: 0, tag: 8 });
    expect_mismatch(s.await, "tag 7");
    expect_mismatch(r.await, "expects tag 8");

    let w = LocalWorld::new(2);
    let r = submit(&w[1], RecvFrom { buf: HostBuffer::zeroed(DType::F32, 2), src: 0, tag: 0 });
    let s = submit(&w[0], SendOp { buf: f32s(&[1.0]), dst: 1, tag: 0 });
    expect_mismatch(s.await, "f32 × 1 but the matching recv expects tag 0, f32 × 2");
    expect_mismatch(r.await, "f32 × 2");
}

#[tokio::test]
async fn a_late_rank_gets_the_mismatch_too() {
    let w = LocalWorld::new(3);
    let a = submit(&w[0], Barrier);
    let b = submit(&w[1], AllReduce { buf: f32s(&[1.0]), op: ReduceOp::Sum });
    expect_mismatch(a.await, "rank 0 called barrier but rank 1 called all_reduce");
    expect_mismatch(b.await, "rank 0 called barrier");
    // Rank 2 arrives after the mismatch was found: it learns the mismatch, not just "poisoned".
    expect_mismatch(submit(&w[2], Barrier).await, "rank 0 called barrier");
}

#[tokio::test]
async fn missing_ranks_time_out_by_name_and_poison_the_group() {
    let w = LocalWorld::with_timeout(4, Duration::from_millis(200));
    let start = Instant::now();
    let a = submit(&w[0], Barrier);
    let b = submit(&w[2], Barrier);
    let pending_send = submit(&w[3], SendOp { buf: f32s(&[1.0]), dst: 1, tag: 0 });
    for r in [a.await, b.await] {
        match r {
            Err(CommError::Timeout { op, after, detail }) => {
                assert_eq!(op, "barrier");
                assert_eq!(after, Duration::from_millis(200));
                assert!(detail.contains("ranks [1, 3] never joined"), "{detail}");
            }
            other => panic!("expected Timeout, got {other:?}"),
        }
    }
    assert!(start.elapsed() >= Duration::from_millis(200));
    let s = pending_send.await;
    assert!(matches!(s, Err(CommError::Timeout { .. } | CommError::Poisoned { .. })), "{s:?}");
    let later = submit(&w[1], Barrier).await;
    assert!(matches!(later, Err(CommError::Poisoned { ref cause }) if cause.contains("never joined")), "{later:?}");
}

#[tokio::test]
async fn invalid_arguments_deposit_nothing() {
    let w = LocalWorld::new(2);
    // Only rank 0 makes a mistake; it gets InvalidArgument at once and the group stays in step.
    let bad = submit(&w[0], Broadcast { buf: f32s(&[1.0]), root: 2 }).await;
    assert!(matches!(bad, Err(CommError::InvalidArgument { op: "broadcast", .. })), "{bad:?}");
    let bad = submit(&w[0], AllReduce { buf: f32s(&[1.0]), op: ReduceOp::BXor }).await;
    assert!(matches!(bad, Err(CommError::InvalidArgument { .. })), "{bad:?}");
    let a = submit(&w[0], AllReduce { buf: f32s(&[1.0, 2.0]), op: ReduceOp::Sum });
    let b = submit(&w[1], AllReduce { buf: f32s(&[3.0, 4.0]), op: ReduceOp::Sum });
    assert_eq!(a.await.unwrap().to_vec::<f32>().unwrap(), [4.0, 6.0]);
    assert_eq!(b.await.unwrap().to_vec::<f32>().unwrap(), [4.0, 6.0]);
}

#[tokio::test]
async fn sub_groups_renumber_and_exclude_non_members() {
    let w = LocalWorld::new(4);
    let groups = futures::future::join_all(w.iter().map(|b| b.new_group(&[1, 3]))).await;
    let groups: Vec<_> = groups.into_iter().map(Result::unwrap).collect();
    assert!(groups[0].is_none() && groups[2].is_none());
    let (g1, g3) = (groups[1].clone().unwrap(), groups[3].clone().unwrap());
    assert_eq!((g1.rank(), g1.world_size(), g3.rank(), g3.world_size()), (0, 2, 1, 2));
    assert_eq!(g1.backend_name(), "local");
    let a = submit(&g1, AllReduce { buf: HostBuffer::from_slice(&[1i64]), op: ReduceOp::Sum });
    let b = submit(&g3, AllReduce { buf: HostBuffer::from_slice(&[10i64]), op: ReduceOp::Sum });
    assert_eq!(a.await.unwrap().to_vec::<i64>().unwrap(), [11]);
    assert_eq!(b.await.unwrap().to_vec::<i64>().unwrap(), [11]);
    // Bad rank lists are invalid arguments on every rank.
    for b in &w {
        let e = b.new_group(&[2, 1]).await.map(|_| ());
        assert!(matches!(e, Err(CommError::InvalidArgument { .. })), "{e:?}");
        let e = b.new_group(&[4]).await.map(|_| ());
        assert!(matches!(e, Err(CommError::InvalidArgument { .. })), "{e:?}");
    }
    // Different rank lists on different ranks are a mismatch.
    let a = w[0].new_group(&[0]);
    let b = w[1].new_group(&[1]);
    let c = w[2].new_group(&[0]);
    let d = w[3].new_group(&[0]);
    let (a, b, _, _) = futures::future::join4(a, b, c, d).await;
    expect_mismatch(a.map(|_| ()), "listed ranks");
    expect_mismatch(b.map(|_| ()), "listed ranks");
}

#[tokio::test]
async fn shutdown_stops_one_handle() {
    let w = LocalWorld::new(2);
    w[0].shutdown().await.unwrap();
    w[0].shutdown().await.unwrap();
    let e = submit(&w[0], Barrier).await;
    assert!(matches!(e, Err(CommError::Shutdown(_))), "{e:?}");
    // Rank 1 is unaffected: its barrier just waits for a peer that will not come.
    assert!(!submit(&w[1], Barrier).is_completed());
}

#[test]
fn blocking_wait_works_across_threads() {
    let w = LocalWorld::new(3);
    let threads: Vec<_> = w
        .into_iter()
        .enumerate()
        .map(|(r, b)| {
            std::thread::spawn(move || {
                let buf = HostBuffer::from_slice(&[r as u8 + 1]);
                submit(&b, AllReduce { buf, op: ReduceOp::Prod }).wait().unwrap().to_vec::<u8>().unwrap()
            })
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), [6]);
    }
}

/// A backend that corrupts one element of rank 1's f32 all_reduce results: the suite must
/// notice and name the op.
struct Faulty(Arc<dyn Backend>);

macro_rules! delegate {
    ($($t:ty),*) => {$(
        impl Collective<$t> for Faulty {
            fn submit(&self, req: $t) -> Work<<$t as Op>::Output> {
                Collective::<$t>::submit(&*self.0, req)
            }
        }
    )*};
}
delegate!(
    Broadcast,
    Reduce,
    AllGather,
    comm_core::ops::ReduceScatter,
    AllToAll,
    comm_core::ops::Scatter,
    comm_core::ops::Gather,
    SendOp,
    RecvFrom,
    Barrier
);

impl Collective<AllReduce> for Faulty {
    fn submit(&self, req: AllReduce) -> Work<HostBuffer> {
        let corrupt = self.0.rank() == 1 && req.buf.dtype() == DType::F32 && req.buf.len() == 7;
        Collective::<AllReduce>::submit(&*self.0, req).map(move |mut b| {
            if corrupt {
                b.as_mut_slice::<f32>().unwrap()[3] += 1.0;
            }
            b
        })
    }
}

#[async_trait::async_trait]
impl Group for Faulty {
    fn rank(&self) -> u32 {
        self.0.rank()
    }
    fn world_size(&self) -> u32 {
        self.0.world_size()
    }
    fn backend_name(&self) -> &'static str {
        "faulty"
    }
    async fn new_group(&self, ranks: &[u32]) -> Result<Option<Arc<dyn Backend>>, CommError> {
        self.0.new_group(ranks).await
    }
    async fn shutdown(&self) -> Result<(), CommError> {
        self.0.shutdown().await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_suite_catches_a_wrong_result() {
    let mut cfg = SuiteConfig::quick();
    cfg.dtypes = vec![DType::F32, DType::I32];
    let backends: Vec<Arc<dyn Backend>> =
        LocalWorld::new(2).into_iter().map(|b| Arc::new(Faulty(b)) as Arc<dyn Backend>).collect();
    let err = suite::run_all(backends, &cfg).await.unwrap_err();
    assert!(err.contains("backend `faulty`, rank 1 of 2"), "{err}");
    assert!(err.contains("all_reduce(sum) f32 × 7, rank 1: f32 × 7: element 3 is"), "{err}");
    assert!(!err.contains("rank 0 of 2"), "rank 0 saw correct results: {err}");
}
