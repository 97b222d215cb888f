//! What torch.distributed users reach for beyond the tensor ops, at 2 and 3 real ranks (shm):
//! object collectives, coalesced all_reduce / reduce_scatter, and monitored_barrier.

use std::time::{Duration, Instant};

use comm_api::{bf16, BackendKind, CommError, Config, DType, HostBuffer, ProcessGroup, ReduceOp};
use comm_test::{multiprocess, reference};
use serde::{Deserialize, Serialize};

mod surfaces;

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

/// Composite ops are checked like plain ones (2 ranks, shm).
async fn composite_checks() -> Result<(), String> {
    surfaces::composite_checks(&connect().await?).await
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
    surfaces::mismatch(&r, "all_gather_object against all_gather", me)
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

/// A `/proc/self/status` number (`Threads:`, `VmRSS:` in kB).
fn status(field: &str) -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let value = status.lines().find_map(|l| l.strip_prefix(field)).unwrap_or_default();
    value.split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// Monitored barriers with long timeouts and a late rank: no thread (or timer) outlives its
/// wait; a zero timeout gives every rank the same outcome.
async fn monitored_is_flat() -> Result<(), String> {
    let pg = connect().await?;
    let me = pg.rank();
    pg.monitored_barrier(Duration::from_secs(600), true).await.map_err(e)?;
    let (before, rss_before) = (status("Threads:"), status("VmRSS:"));
    for _ in 0..3000 {
        if me == 1 {
            std::thread::sleep(Duration::from_micros(300));
        }
        pg.monitored_barrier(Duration::from_secs(600), true).await.map_err(e)?;
    }
    let (after, rss_after) = (status("Threads:"), status("VmRSS:"));
    if after > before + 2 || rss_after > rss_before + 16 * 1024 {
        return Err(format!(
            "rank {me}: {before} threads and {rss_before} kB before 3000 monitored barriers, {after} and {rss_after} kB after"
        ));
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
    println!("rank {me}: threads {before} -> {after}, RSS {rss_before} -> {rss_after} kB; zero timeout: {passed} passed, {failed} failed on both ranks");
    Ok(())
}

#[test]
fn monitored_barrier_keeps_no_thread_per_wait() {
    multiprocess::run(2, "monitored_barrier_keeps_no_thread_per_wait", T, monitored_is_flat);
}
