//! The facade's own sugar (coalesced all_gather, batches, sub-group rank mapping, ring groups),
//! over the in-process LocalWorld reference backend.

use std::sync::Arc;

use comm_api::{Backend, DType, HostBuffer, P2POp, ProcessGroup, ReduceOp, WorldInfo};
use comm_test::LocalWorld;

fn world(n: u32) -> Vec<ProcessGroup> {
    LocalWorld::new(n)
        .into_iter()
        .enumerate()
        .map(|(r, b): (usize, Arc<dyn Backend>)| {
            let mut info = WorldInfo::single();
            info.rank = r as u32;
            info.world_size = n;
            info.local_rank = r as u32;
            info.local_world_size = n;
            ProcessGroup::from_backend(b, info)
        })
        .collect()
}

/// Runs `f(rank's group)` on every rank concurrently and collects the results in rank order.
async fn on_all<T, F, Fut>(pgs: &[ProcessGroup], f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(ProcessGroup) -> Fut,
    Fut: std::future::Future<Output = T> + Send + 'static,
{
    let handles: Vec<_> = pgs.iter().map(|pg| tokio::spawn(f(pg.clone()))).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.expect("rank task"));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_gather_coalesced_keeps_dtypes_and_shapes() {
    let pgs = world(3);
    let outs = on_all(&pgs, |pg| async move {
        let r = pg.rank();
        let a = HostBuffer::from_slice(&[r as f32, 10.0 + r as f32]);
        let b = HostBuffer::from_slice(&[r as u8]);
        let c = HostBuffer::from_slice(&[-(r as i64); 3]);
        pg.all_gather_coalesced(vec![a, b, c]).await.unwrap()
    })
    .await;
    for out in outs {
        assert_eq!(out.len(), 3);
        assert_eq!(out[0].to_vec::<f32>().unwrap(), [0.0, 10.0, 1.0, 11.0, 2.0, 12.0]);
        assert_eq!(out[1].to_vec::<u8>().unwrap(), [0, 1, 2]);
        assert_eq!(out[2].to_vec::<i64>().unwrap(), [0, 0, 0, -1, -1, -1, -2, -2, -2]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_isend_irecv_exchanges_with_every_peer() {
    let pgs = world(4);
    let outs = on_all(&pgs, |pg| async move {
        let (me, n) = (pg.rank(), pg.world_size());
        let mut ops = Vec::new();
        for p in (0..n).filter(|&p| p != me) {
            ops.push(P2POp::Recv { buf: HostBuffer::zeroed(DType::I32, 2), peer: p, tag: 7 });
            ops.push(P2POp::Send { buf: HostBuffer::from_slice(&[me as i32, p as i32]), peer: p, tag: 7 });
        }
        let works = pg.batch_isend_irecv(ops);
        let mut got = Vec::new();
        for (i, w) in works.into_iter().enumerate() {
            let b = w.await.unwrap();
            if i % 2 == 0 {
                got.push(b.to_vec::<i32>().unwrap());
            }
        }
        (me, got)
    })
    .await;
    for (me, got) in outs {
        let peers: Vec<i32> = (0..4).filter(|&p| p != me as i32).collect();
        for (v, p) in got.iter().zip(peers) {
            assert_eq!(v, &vec![p, me as i32]);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sub_groups_map_ranks_and_reduce_only_members() {
    let pgs = world(4);
    let outs = on_all(&pgs, |pg| async move {
        let sub = pg.new_group(&[3, 1]).await.unwrap();
        match sub {
            None => None,
            Some(g) => {
                let globals: Vec<_> = (0..g.world_size()).map(|r| g.global_rank(r).unwrap()).collect();
                let v = pg.rank() as f64;
                let s = g.all_reduce(HostBuffer::from_slice(&[v]), ReduceOp::Sum).await.unwrap();
                Some((g.rank(), globals, s.to_vec::<f64>().unwrap()[0], g.global_rank(9)))
            }
        }
    })
    .await;
    assert!(outs[0].is_none() && outs[2].is_none());
    assert_eq!(outs[1], Some((0, vec![1, 3], 4.0, None)));
    assert_eq!(outs[3], Some((1, vec![1, 3], 4.0, None)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pairwise_ring_groups_link_neighbours() {
    for n in [2u32, 3, 4] {
        let pgs = world(n);
        let outs = on_all(&pgs, |pg| async move {
            let (prev, next) = pg.pairwise_ring_groups().await.unwrap();
            let members = |g: &ProcessGroup| (0..2).map(|r| g.global_rank(r).unwrap()).collect::<Vec<_>>();
            // Exchange a value with each neighbour through the pair groups. Both ops are issued
            // before either is awaited: awaiting one first would deadlock around the ring.
            let me = pg.rank() as i32;
            let wn = next.all_reduce(HostBuffer::from_slice(&[me]), ReduceOp::Sum);
            let wp = (n > 2).then(|| prev.all_reduce(HostBuffer::from_slice(&[me]), ReduceOp::Sum));
            let via_next = wn.await.unwrap();
            let via_prev = match wp {
                Some(w) => w.await.unwrap(),
                None => via_next.clone(),
            };
            (members(&prev), members(&next), via_prev.to_vec::<i32>().unwrap()[0], via_next.to_vec::<i32>().unwrap()[0])
        })
        .await;
        for (r, (prev, next, sp, sn)) in outs.into_iter().enumerate() {
            let r = r as u32;
            let (p, q) = ((r + n - 1) % n, (r + 1) % n);
            let sorted = |a: u32, b: u32| if a < b { vec![a, b] } else { vec![b, a] };
            assert_eq!(prev, sorted(p, r), "n={n} rank {r}");
            assert_eq!(next, sorted(r, q), "n={n} rank {r}");
            assert_eq!(sp, (p + r) as i32);
            assert_eq!(sn, (r + q) as i32);
        }
    }
}

#[tokio::test]
async fn single_process_world_does_everything_locally() {
    let pg = comm_api::builder(comm_api::Config::single()).connect().await.unwrap();
    assert_eq!((pg.rank(), pg.world_size(), pg.local_rank()), (0, 1, 0));
    assert!(pg.describe().contains("rank 0/1"), "{}", pg.describe());
    let rs = pg.reduce_scatter(HostBuffer::from_slice(&[1i32, 2, 3]), ReduceOp::Sum).await.unwrap();
    assert_eq!(rs.to_vec::<i32>().unwrap(), [1, 2, 3]);
    let e = pg.send(HostBuffer::from_slice(&[1u8]), 0).await.unwrap_err();
    assert!(e.to_string().contains("itself"), "{e}");
    pg.shutdown().await.unwrap();
    let e = pg.barrier().await.unwrap_err();
    assert!(matches!(e, comm_api::CommError::Shutdown(_)), "{e}");
}

/// `abort` on one rank fails another rank's op in flight and every later op, with the reason;
/// `LocalWorld` keeps no failure state, so `error()` is `None` and `on_failure` is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_fails_the_ops_in_flight_of_every_rank() {
    let pgs = world(2);
    let waiting = pgs[0].all_reduce(HostBuffer::from_slice(&[1.0f32]), ReduceOp::Sum);
    pgs[1].abort("maintenance");
    let e = waiting.await.expect_err("rank 1 never joined");
    assert!(e.to_string().contains("maintenance (ProcessGroup::abort on rank 1)"), "{e}");
    for pg in &pgs {
        let later = pg.barrier().await.expect_err("the group is aborted");
        assert!(later.to_string().contains("maintenance"), "{later}");
        assert!(pg.error().is_none());
        assert!(matches!(pg.on_failure(|_| {}), Err(comm_api::CommError::Unsupported { .. })));
    }
}
