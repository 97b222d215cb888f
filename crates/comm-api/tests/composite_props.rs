//! Property: a composite op (coalesced or object collective) whose ranks agree on shapes and
//! types gives every rank the reference result; one whose ranks disagree gives every rank
//! `Mismatch` — never data, never a hang. Two in-process shm ranks, a fresh group per case.

#![cfg(feature = "shm")]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use backend_shm::{ShmBackend, ShmOptions};
use comm_api::{CommError, DType, HostBuffer, ProcessGroup, ReduceOp, Store, WorldInfo};
use comm_core::MemoryStore;
use comm_test::reference;
use proptest::prelude::*;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap())
}

async fn pair() -> Vec<ProcessGroup> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let opts = ShmOptions { timeout: Duration::from_secs(10), ..Default::default() };
    let ranks = (0..2).map(|r| {
        let (store, opts) = (store.clone(), opts.clone());
        tokio::spawn(async move { ShmBackend::new(store, r, 2, opts).await })
    });
    let ranks = futures::future::join_all(ranks).await;
    ranks.into_iter().map(|b| ProcessGroup::from_backend(Arc::new(b.unwrap().unwrap()), WorldInfo::single())).collect()
}

type Shapes = Vec<(DType, usize)>;

fn shapes() -> impl Strategy<Value = Shapes> {
    let dtype = proptest::sample::select(vec![DType::U8, DType::I32, DType::I64, DType::BF16, DType::F32]);
    proptest::collection::vec((dtype, 0usize..5), 0..4)
}

/// Rank 1's shapes: rank 0's in half the cases, others (maybe equal) in the rest.
fn two_shapes() -> impl Strategy<Value = (Shapes, Shapes)> {
    (shapes(), shapes(), any::<bool>()).prop_map(|(a, b, same)| if same { (a.clone(), a) } else { (a, b) })
}

fn bufs(shapes: &Shapes, rank: u32, scale: usize) -> Vec<HostBuffer> {
    shapes.iter().enumerate().map(|(i, &(d, k))| reference::input(d, k * scale, rank, i as u64)).collect()
}

#[derive(Clone, Copy, Debug)]
enum Coalesced {
    AllGather,
    AllReduce,
    ReduceScatter,
}

fn outcome_agrees<T>(what: &str, same: bool, got: &[Result<T, CommError>]) -> Result<(), TestCaseError> {
    for (r, g) in got.iter().enumerate() {
        match (same, g) {
            (true, Ok(_)) | (false, Err(CommError::Mismatch { .. })) => {}
            (true, Err(e)) => {
                return Err(TestCaseError::fail(format!("{what}: rank {r} failed on agreeing input: {e}")))
            }
            (false, Err(e)) => return Err(TestCaseError::fail(format!("{what}: rank {r}: {e}, not Mismatch"))),
            (false, Ok(_)) => return Err(TestCaseError::fail(format!("{what}: rank {r} passed disagreeing input"))),
        }
    }
    Ok(())
}

fn coalesced(op: Coalesced, (a, b): &(Shapes, Shapes)) -> Result<(), TestCaseError> {
    let scale = if matches!(op, Coalesced::ReduceScatter) { 2 } else { 1 };
    let inputs = [bufs(a, 0, scale), bufs(b, 1, scale)];
    let got: Vec<Result<Vec<HostBuffer>, CommError>> = runtime().block_on(async {
        let pgs = pair().await;
        let works: Vec<_> = pgs
            .iter()
            .zip(inputs.clone())
            .map(|(pg, inp)| match op {
                Coalesced::AllGather => pg.all_gather_coalesced(inp),
                Coalesced::AllReduce => pg.all_reduce_coalesced(inp, ReduceOp::Max),
                Coalesced::ReduceScatter => pg.reduce_scatter_coalesced(inp, ReduceOp::Max),
            })
            .collect();
        futures::future::join_all(works).await
    });
    outcome_agrees(&format!("{op:?} {a:?} / {b:?}"), a == b, &got)?;
    if a != b {
        return Ok(());
    }
    for (r, g) in got.iter().enumerate() {
        let g = g.as_ref().expect("checked above");
        for (i, out) in g.iter().enumerate() {
            let both = [&inputs[0][i], &inputs[1][i]];
            let want = match op {
                Coalesced::AllGather => reference::all_gather(&both).swap_remove(r),
                Coalesced::AllReduce => reference::all_reduce(&both, ReduceOp::Max).swap_remove(r),
                Coalesced::ReduceScatter => reference::reduce_scatter(&both, ReduceOp::Max).swap_remove(r),
            };
            reference::compare(out, &want, &format!("{op:?} buffer {i}"), r as u32).map_err(TestCaseError::fail)?;
        }
    }
    Ok(())
}

/// An object of one of four types, by index.
#[derive(Clone, Debug, PartialEq)]
enum Obj {
    U32(u32),
    Pair(u32, u32),
    Text(String),
    Bytes(Vec<u8>),
}

fn obj() -> impl Strategy<Value = Obj> {
    prop_oneof![
        any::<u32>().prop_map(Obj::U32),
        (any::<u32>(), any::<u32>()).prop_map(|(a, b)| Obj::Pair(a, b)),
        "[a-z]{0,12}".prop_map(Obj::Text),
        proptest::collection::vec(any::<u8>(), 0..40).prop_map(Obj::Bytes),
    ]
}

#[derive(Clone, Copy, Debug)]
enum ObjOp {
    AllGather,
    Broadcast,
    Gather,
    Scatter,
}

/// `op` on one rank with `o`'s type; the result as text (every rank's objects, in order).
async fn object_op<T>(pg: &ProcessGroup, op: ObjOp, o: T) -> Result<String, CommError>
where
    T: serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug + Clone,
{
    let me = pg.rank();
    Ok(match op {
        ObjOp::AllGather => format!("{:?}", pg.all_gather_object(&o).await?),
        ObjOp::Broadcast => format!("{:?}", pg.broadcast_object((me == 0).then_some(o), 0).await?),
        ObjOp::Gather => format!("{:?}", pg.gather_object(&o, 1).await?),
        ObjOp::Scatter => format!("{:?}", pg.scatter_object((me == 0).then(|| vec![o.clone(), o]), 0).await?),
    })
}

async fn any_object_op(pg: &ProcessGroup, op: ObjOp, o: Obj) -> Result<String, CommError> {
    match o {
        Obj::U32(v) => object_op(pg, op, v).await,
        Obj::Pair(a, b) => object_op(pg, op, (a, b)).await,
        Obj::Text(s) => object_op(pg, op, s).await,
        Obj::Bytes(b) => object_op(pg, op, b).await,
    }
}

fn same_type(a: &Obj, b: &Obj) -> bool {
    std::mem::discriminant(a) == std::mem::discriminant(b)
}

fn objects(op: ObjOp, a: Obj, b: Obj) -> Result<(), TestCaseError> {
    let same = same_type(&a, &b);
    let got = runtime().block_on(async {
        let pgs = pair().await;
        let (x, y) = (&pgs[0], &pgs[1]);
        let (a2, b2) = (a.clone(), b.clone());
        let r = futures::future::join(any_object_op(x, op, a2), any_object_op(y, op, b2)).await;
        vec![r.0, r.1]
    });
    outcome_agrees(&format!("{op:?} {a:?} / {b:?}"), same, &got)?;
    if same && matches!(op, ObjOp::AllGather) {
        let want = match (&a, &b) {
            (Obj::U32(x), Obj::U32(y)) => format!("{:?}", [x, y]),
            (Obj::Pair(x0, x1), Obj::Pair(y0, y1)) => format!("{:?}", [(x0, x1), (y0, y1)]),
            (Obj::Text(x), Obj::Text(y)) => format!("{:?}", [x, y]),
            (Obj::Bytes(x), Obj::Bytes(y)) => format!("{:?}", [x, y]),
            _ => unreachable!("same type"),
        };
        for g in &got {
            prop_assert_eq!(g.as_ref().unwrap(), &want);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn coalesced_ops_agree_or_refuse_on_every_rank(
        op in proptest::sample::select(vec![Coalesced::AllGather, Coalesced::AllReduce, Coalesced::ReduceScatter]),
        shapes in two_shapes(),
    ) {
        coalesced(op, &shapes)?;
    }

    #[test]
    fn object_ops_agree_or_refuse_on_every_rank(
        op in proptest::sample::select(vec![ObjOp::AllGather, ObjOp::Broadcast, ObjOp::Gather, ObjOp::Scatter]),
        a in obj(),
        b in obj(),
    ) {
        objects(op, a, b)?;
    }
}
