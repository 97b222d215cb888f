//! What torch.distributed users reach for beyond the tensor ops, at 2 and 3 real ranks (shm):
//! object collectives, coalesced all_reduce / reduce_scatter, and monitored_barrier.

use std::time::{Duration, Instant};

use comm_api::{bf16, BackendKind, CommError, Config, DType, HostBuffer, ProcessGroup, ReduceOp};
use comm_test::{multiprocess, reference};
use serde::{Deserialize, Serialize};

const T: Duration = Duration::from_secs(120);

async fn connect() -> Result<ProcessGroup, String> {
    comm_api::builder(Config::from_env().map_err(|e| e.to_string())?)
        .backend(BackendKind::Shm)
        .connect()
        .await
        .map_err(|e| e.to_string())
}

#[derive(Serialize, Deserialize, Debug, PartialEq, Clone)]
struct Shard {
    name: String,
    rank: u32,
    values: Vec<u64>,
}

/// Ranks hold objects of different sizes.
fn shard(rank: u32) -> Shard {
    Shard { name: format!("shard-{rank}"), rank, values: (0..u64::from(rank) * 100).collect() }
}

fn e(x: impl std::fmt::Display) -> String {
    x.to_string()
}

async fn objects() -> Result<(), String> {
    let pg = connect().await?;
    let (me, n) = (pg.rank(), pg.world_size());
    let all = pg.all_gather_object(&shard(me)).await.map_err(e)?;
    if all != (0..n).map(shard).collect::<Vec<_>>() {
        return Err(format!("all_gather_object: {all:?}"));
    }
    let root = n - 1;
    let got = pg.broadcast_object((me == root).then(|| shard(root)), root).await.map_err(e)?;
    if got != shard(root) {
        return Err(format!("broadcast_object: {got:?}"));
    }
    let gathered = pg.gather_object(&shard(me), 1).await.map_err(e)?;
    match (me, gathered) {
        (1, Some(v)) if v == (0..n).map(shard).collect::<Vec<_>>() => {}
        (1, other) => return Err(format!("gather_object on the root: {other:?}")),
        (_, None) => {}
        (_, Some(_)) => return Err("gather_object returned objects off the root".into()),
    }
    let list = (me == 0).then(|| (0..n).map(|r| format!("for rank {r}: {}", "x".repeat(r as usize * 50))).collect());
    let mine: String = pg.scatter_object(list, 0).await.map_err(e)?;
    if mine != format!("for rank {me}: {}", "x".repeat(me as usize * 50)) {
        return Err(format!("scatter_object: {mine}"));
    }
    // A root that passes nothing: every rank gets a clear error, nobody hangs.
    let r = pg.broadcast_object::<Shard>(None, 0).await;
    if !matches!(&r, Err(CommError::InvalidArgument { reason, .. }) if reason.contains("rank 0")) {
        return Err(format!("broadcast_object without an object: {r:?}"));
    }
    // Rank 1 passes another type: every rank fails, naming a rank with another type.
    let r = if me == 1 {
        pg.all_gather_object(&0xFFFF_FFFF_u64).await.map(drop)
    } else {
        pg.all_gather_object(&format!("text of rank {me}")).await.map(drop)
    };
    if !matches!(&r, Err(CommError::Mismatch { detail, .. }) if detail.contains("passes another type")) {
        return Err(format!("rank {me}: a rank passing another type: {r:?}"));
    }
    pg.shutdown().await.map_err(e)
}

#[test]
fn object_collectives_2_ranks() {
    multiprocess::run(2, "object_collectives_2_ranks", T, objects);
}

#[test]
fn object_collectives_3_ranks() {
    multiprocess::run(3, "object_collectives_3_ranks", T, objects);
}

async fn coalesced() -> Result<(), String> {
    let pg = connect().await?;
    let (me, n) = (pg.rank(), pg.world_size());
    let shapes = [(DType::F32, 5), (DType::I32, 3), (DType::F32, 7), (DType::BF16, 4), (DType::I64, 0)];
    let inputs = |rank: u32, k: usize| -> Vec<HostBuffer> {
        shapes.iter().enumerate().map(|(i, &(d, len))| reference::input(d, len * k, rank, i as u64)).collect()
    };
    let got = pg.all_reduce_coalesced(inputs(me, 1), ReduceOp::Sum).await.map_err(e)?;
    for (i, g) in got.iter().enumerate() {
        let all: Vec<HostBuffer> = (0..n).map(|r| inputs(r, 1).swap_remove(i)).collect();
        let want = reference::reduce(&all.iter().collect::<Vec<_>>(), ReduceOp::Sum);
        reference::compare(g, &want, &format!("all_reduce_coalesced buffer {i}"), me)?;
    }
    let k = n as usize;
    let got = pg.reduce_scatter_coalesced(inputs(me, k), ReduceOp::Max).await.map_err(e)?;
    for (i, g) in got.iter().enumerate() {
        let all: Vec<HostBuffer> = (0..n).map(|r| inputs(r, k).swap_remove(i)).collect();
        let want = reference::reduce_scatter(&all.iter().collect::<Vec<_>>(), ReduceOp::Max);
        reference::compare(g, &want[me as usize], &format!("reduce_scatter_coalesced buffer {i}"), me)?;
    }
    let odd = pg.reduce_scatter_coalesced(vec![HostBuffer::from_slice(&[bf16::ONE; 7])], ReduceOp::Sum).await;
    if !matches!(odd, Err(CommError::InvalidArgument { .. })) {
        return Err(format!("a buffer not divisible by the group size: {odd:?}"));
    }
    pg.shutdown().await.map_err(e)
}

#[test]
fn coalesced_ops_2_ranks() {
    multiprocess::run(2, "coalesced_ops_2_ranks", T, coalesced);
}

#[test]
fn coalesced_ops_3_ranks() {
    multiprocess::run(3, "coalesced_ops_3_ranks", T, coalesced);
}

async fn monitored() -> Result<(), String> {
    let pg = connect().await?;
    let (me, n) = (pg.rank(), pg.world_size());
    pg.monitored_barrier(Duration::from_secs(20), true).await.map_err(e)?;
    // The last rank stalls past rank 0's timeout.
    let stalled = n - 1;
    if me == stalled {
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    let t = Instant::now();
    let r = pg.monitored_barrier(Duration::from_secs(1), true).await;
    let msg = r.as_ref().err().map(ToString::to_string).unwrap_or_default();
    match me {
        0 if matches!(r, Err(CommError::Timeout { .. }))
            && msg.contains(&format!("ranks {stalled} did not arrive")) => {}
        0 => return Err(format!("rank 0 should name rank {stalled}: {r:?}")),
        _ if matches!(r, Err(CommError::Timeout { .. }))
            && msg.contains(&format!("rank 0 found rank {stalled} missing and did not let rank {me} through")) => {}
        _ => return Err(format!("rank {me}: {r:?}")),
    }
    if t.elapsed() > Duration::from_secs(10) {
        return Err(format!("took {:?}", t.elapsed()));
    }
    println!("rank {me}: {msg}");
    // Everyone stays until the stalled rank is done (it checks in with rank 0 too).
    tokio::time::sleep(Duration::from_secs(6).saturating_sub(t.elapsed())).await;
    Ok(())
}

#[test]
fn monitored_barrier_2_ranks() {
    multiprocess::run(2, "monitored_barrier_2_ranks", T, monitored);
}

#[test]
fn monitored_barrier_3_ranks() {
    multiprocess::run(3, "monitored_barrier_3_ranks", T, monitored);
}

fn mismatch(r: &Result<impl std::fmt::Debug, CommError>, what: &str, me: u32) -> Result<(), String> {
    match r {
        Err(CommError::Mismatch { .. }) => Ok(()),
        other => Err(format!("rank {me}: {what}: expected Mismatch, got {other:?}")),
    }
}

/// Composite ops are checked like plain ones: ranks passing other shapes or types get an
/// error on every rank, never each other's bytes (2 ranks).
async fn composite_checks() -> Result<(), String> {
    let pg = connect().await?;
    let me = pg.rank();
    // Same byte count, other dtype: the packed u8 all_gather alone cannot see it.
    let mine = if me == 0 { HostBuffer::from_slice(&[1.5f32; 4]) } else { HostBuffer::from_slice(&[7i32; 4]) };
    mismatch(&pg.all_gather_coalesced(vec![mine]).await, "all_gather_coalesced, f32 against i32", me)?;
    // Same packed ops, other splits: the signatures differ.
    let split = |parts: &[usize]| parts.iter().map(|&k| HostBuffer::from_slice(&vec![1.0f32; k])).collect::<Vec<_>>();
    let bufs = if me == 0 { split(&[4, 4]) } else { split(&[8]) };
    mismatch(&pg.all_reduce_coalesced(bufs, ReduceOp::Sum).await, "all_reduce_coalesced, 4+4 against 8", me)?;
    let bufs = if me == 0 { split(&[2, 6]) } else { split(&[6, 2]) };
    mismatch(&pg.reduce_scatter_coalesced(bufs, ReduceOp::Sum).await, "reduce_scatter_coalesced, 2+6 against 6+2", me)?;
    // A (u32, u32) root against u32 receivers: the type fingerprint, not the bytes, decides.
    let r = if me == 0 {
        pg.broadcast_object(Some((3u32, 4u32)), 0).await.map(drop)
    } else {
        pg.broadcast_object::<u32>(None, 0).await.map(drop)
    };
    mismatch(&r, "broadcast_object, (u32, u32) against u32", me)?;
    // The group is still in step: shapes that agree go through.
    let ok = pg.all_gather_coalesced(vec![HostBuffer::from_slice(&[me as i64])]).await.map_err(e)?;
    if ok[0].to_vec::<i64>().map_err(e)? != [0, 1] {
        return Err(format!("all_gather_coalesced after the mismatches: {ok:?}"));
    }
    // A peer that declares a huge object (rank 1 forges a header: the right magic and type,
    // 1 TiB and then i64::MAX bytes): an error on the object op's rank, no allocation.
    for huge in [1i64 << 40, i64::MAX] {
        if me == 1 {
            let fp = std::any::type_name::<Vec<u8>>()
                .bytes()
                .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
            let magic = i64::from_le_bytes(*b"commobj1");
            pg.all_gather(HostBuffer::from_slice(&[magic, fp as i64, i64::MAX, huge])).await.map_err(e)?;
        } else {
            let r = pg.all_gather_object(&vec![1u8; 10]).await;
            if !matches!(&r, Err(CommError::InvalidArgument { reason, .. }) if reason.contains("over the cap")) {
                return Err(format!("a declared size of {huge}: {r:?}"));
            }
        }
    }
    // Ranks whose packed ops differ in number: the check op's lengths differ, so the backend
    // fails it on both (poisoning the group) before a packed op can pair with another.
    let bufs = if me == 0 {
        vec![HostBuffer::from_slice(&[1.0f32; 4])]
    } else {
        vec![HostBuffer::from_slice(&[1.0f32; 4]), HostBuffer::from_slice(&[1i32; 4])]
    };
    mismatch(&pg.all_reduce_coalesced(bufs, ReduceOp::Sum).await, "all_reduce_coalesced, 1 dtype against 2", me)?;
    let t = Instant::now();
    let next = pg.all_reduce(HostBuffer::from_slice(&[1.0f32]), ReduceOp::Sum).await;
    if next.is_ok() || t.elapsed() > Duration::from_secs(5) {
        return Err(format!("rank {me}: the op after a mismatch: {next:?} after {:?}", t.elapsed()));
    }
    Ok(())
}

#[test]
fn composite_ops_check_shapes_and_types() {
    multiprocess::run(2, "composite_ops_check_shapes_and_types", T, composite_checks);
}

/// A rank whose all_gather meets another rank's all_gather_object (the case: a
/// single i64 of 1 << 40) fails with `Mismatch`, never allocates what the peer's bytes say.
async fn object_against_tensor() -> Result<(), String> {
    let pg = connect().await?;
    let me = pg.rank();
    let r = if me == 0 {
        pg.all_gather_object(&vec![1u8; 10]).await.map(drop)
    } else {
        pg.all_gather(HostBuffer::from_slice(&[1i64 << 40])).await.map(drop)
    };
    mismatch(&r, "all_gather_object against all_gather", me)
}

#[test]
fn object_op_against_a_tensor_op() {
    multiprocess::run(2, "object_op_against_a_tensor_op", T, object_against_tensor);
}

/// `COMM_OBJECT_MAX` bounds what an object op moves, on every rank alike.
async fn object_cap() -> Result<(), String> {
    let pg = connect().await?;
    let me = pg.rank();
    let small: Vec<u8> = vec![1; 100];
    let got = pg.all_gather_object(&small).await.map_err(e)?;
    if got != vec![small.clone(), small] {
        return Err("all_gather_object under the cap".into());
    }
    let big = vec![1u8; if me == 1 { 5000 } else { 10 }];
    let r = pg.all_gather_object(&big).await;
    if !matches!(&r, Err(CommError::InvalidArgument { reason, .. }) if reason.contains("rank 1's object")) {
        return Err(format!("rank {me}: an object over COMM_OBJECT_MAX: {r:?}"));
    }
    Ok(())
}

#[test]
fn object_ops_respect_the_size_cap() {
    multiprocess::run_with_env(
        2,
        "object_ops_respect_the_size_cap",
        T,
        |_| vec![("COMM_OBJECT_MAX".into(), "4KiB".into())],
        object_cap,
    );
}

fn threads() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix("Threads:")).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}

/// Monitored barriers with long timeouts and a late rank: no thread (or timer) outlives its
/// wait; a zero timeout gives every rank the same outcome.
async fn monitored_is_flat() -> Result<(), String> {
    let pg = connect().await?;
    let me = pg.rank();
    pg.monitored_barrier(Duration::from_secs(600), true).await.map_err(e)?;
    let before = threads();
    for _ in 0..3000 {
        if me == 1 {
            std::thread::sleep(Duration::from_micros(300));
        }
        pg.monitored_barrier(Duration::from_secs(600), true).await.map_err(e)?;
    }
    let after = threads();
    if after > before + 2 {
        return Err(format!("rank {me}: {before} threads before 3000 monitored barriers, {after} after"));
    }
    let (mut passed, mut failed) = (0, 0);
    for round in 0..30 {
        if me == 1 && round % 2 == 0 {
            std::thread::sleep(Duration::from_millis(2));
        }
        let ok = pg.monitored_barrier(Duration::ZERO, false).await.is_ok();
        let all = pg.all_gather(HostBuffer::from_slice(&[i32::from(ok)])).await.map_err(e)?;
        let all = all.to_vec::<i32>().map_err(e)?;
        if all[0] != all[1] {
            return Err(format!("round {round}: a zero timeout ended differently on the ranks: {all:?}"));
        }
        if ok {
            passed += 1
        } else {
            failed += 1
        }
    }
    println!("rank {me}: threads {before} -> {after}; zero timeout: {passed} passed, {failed} failed on both ranks");
    Ok(())
}

#[test]
fn monitored_barrier_keeps_no_thread_per_wait() {
    multiprocess::run(2, "monitored_barrier_keeps_no_thread_per_wait", T, monitored_is_flat);
}
