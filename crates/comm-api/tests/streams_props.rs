//! Property: whatever order each rank issues its streams' ops in (each stream's own ops in
//! order), every op's result equals the reference. In-process ranks (`LocalWorld`), a fresh
//! set of streams per case.

use comm_api::{HostBuffer, ProcessGroup, ReduceOp, StreamsOptions, WorldInfo};
use proptest::prelude::*;

#[derive(Clone, Copy, Debug)]
enum Kind {
    AllReduce,
    AllGather,
    Broadcast(u32),
}

/// Every stream's ops (kind, length), and each rank's interleaving: the stream of its next op.
#[derive(Clone, Debug)]
struct Case {
    world: u32,
    /// How many of the streams are direct (groups of their own); the rest are arbitrated.
    direct: usize,
    streams: Vec<Vec<(Kind, usize)>>,
    orders: Vec<Vec<usize>>,
}

fn case() -> impl Strategy<Value = Case> {
    (2u32..=3, 1usize..=4, 0usize..=2).prop_flat_map(|(world, n, direct)| {
        let op = (0u32..3, 0..world, 1usize..6).prop_map(|(k, root, len)| {
            let kind = match k {
                0 => Kind::AllReduce,
                1 => Kind::AllGather,
                _ => Kind::Broadcast(root),
            };
            (kind, len)
        });
        proptest::collection::vec(proptest::collection::vec(op, 1..6), n).prop_flat_map(move |streams| {
            let order: Vec<usize> = streams.iter().enumerate().flat_map(|(s, ops)| vec![s; ops.len()]).collect();
            let orders = proptest::collection::vec(Just(order).prop_shuffle(), world as usize);
            (Just(streams), orders).prop_map(move |(streams, orders)| Case { world, direct, streams, orders })
        })
    })
}

fn value(rank: u32, stream: usize, i: usize) -> f32 {
    (stream * 1000 + i * 10) as f32 + rank as f32
}

/// Runs rank `me`'s side of `case`: issues every op in its order, then checks every result.
fn rank_side(pg: ProcessGroup, case: Case) -> Result<(), String> {
    let me = pg.rank();
    futures::executor::block_on(async {
        let opts = StreamsOptions::default().direct(case.direct);
        let streams = pg.streams_with(opts).await.map_err(|e| e.to_string())?;
        let handles: Vec<ProcessGroup> = (0..case.streams.len()).map(|s| streams.stream(s as u64)).collect();
        for (s, h) in handles.iter().enumerate() {
            let want = if s < case.direct { "local" } else { "local-stream" };
            if streams.direct() != case.direct || h.backend_name() != want {
                return Err(format!("stream {s} of {} direct: {}", case.direct, h.backend_name()));
            }
        }
        let mut next = vec![0usize; case.streams.len()];
        let mut works = Vec::new();
        for &s in &case.orders[me as usize] {
            let i = next[s];
            next[s] += 1;
            let (kind, len) = case.streams[s][i];
            let buf = HostBuffer::from_slice(&vec![value(me, s, i); len]);
            let work = match kind {
                Kind::AllReduce => handles[s].all_reduce(buf, ReduceOp::Sum),
                Kind::AllGather => handles[s].all_gather(buf),
                Kind::Broadcast(root) => handles[s].broadcast(buf, root),
            };
            works.push((s, i, kind, len, work));
        }
        for (s, i, kind, len, work) in works {
            let got = work.await.map_err(|e| format!("rank {me} stream {s} op {i}: {e}"))?.to_vec::<f32>().unwrap();
            let want: Vec<f32> = match kind {
                Kind::AllReduce => vec![(0..case.world).map(|r| value(r, s, i)).sum(); len],
                Kind::AllGather => (0..case.world).flat_map(|r| vec![value(r, s, i); len]).collect(),
                Kind::Broadcast(root) => vec![value(root, s, i); len],
            };
            if got != want {
                return Err(format!("rank {me} stream {s} op {i} ({kind:?}): got {got:?}, want {want:?}"));
            }
        }
        streams.shutdown().await.map_err(|e| e.to_string())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn every_interleaving_gives_the_reference(case in case()) {
        let threads: Vec<_> = comm_test::LocalWorld::new(case.world)
            .into_iter()
            .map(|b| {
                let case = case.clone();
                std::thread::spawn(move || rank_side(ProcessGroup::from_backend(b, WorldInfo::single()), case))
            })
            .collect();
        for t in threads {
            t.join().unwrap().map_err(TestCaseError::fail)?;
        }
    }
}
