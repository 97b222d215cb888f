//! Checks shared by the shm tests (`torch_extras`) and the mpirun ones (`hier`): the
//! composite ops on any backend.

use std::time::{Duration, Instant};

use comm_api::{CommError, HostBuffer, ProcessGroup, ReduceOp};

fn e(x: impl std::fmt::Display) -> String {
    x.to_string()
}

pub(crate) fn mismatch(r: &Result<impl std::fmt::Debug, CommError>, what: &str, me: u32) -> Result<(), String> {
    match r {
        Err(CommError::Mismatch { .. }) => Ok(()),
        other => Err(format!("rank {me}: {what}: expected Mismatch, got {other:?}")),
    }
}

/// Composite ops are checked like plain ones: ranks passing other shapes or types get an
/// error on every rank, never each other's bytes (rank 0 against the rest; 2 ranks or more).
pub(crate) async fn composite_checks(pg: &ProcessGroup) -> Result<(), String> {
    let me = pg.rank();
    // Same byte count, other dtype: the packed u8 all_gather alone cannot see it.
    let mine = if me == 0 { HostBuffer::from_slice(&[1.5f32; 4]) } else { HostBuffer::from_slice(&[7i32; 4]) };
    mismatch(&pg.all_gather_coalesced(vec![mine]).await, "all_gather_coalesced, f32 against i32", me)?;
    // Same packed ops, other splits: the signatures differ.
    let split = |parts: &[usize]| parts.iter().map(|&k| HostBuffer::from_slice(&vec![1.0f32; k])).collect::<Vec<_>>();
    let bufs = if me == 0 { split(&[4, 4]) } else { split(&[8]) };
    mismatch(&pg.all_reduce_coalesced(bufs, ReduceOp::Sum).await, "all_reduce_coalesced, 4+4 against 8", me)?;
    let n = pg.world_size() as usize;
    let bufs = if me == 0 { split(&[2 * n, 6 * n]) } else { split(&[6 * n, 2 * n]) };
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
    if ok[0].to_vec::<i64>().map_err(e)? != (0..pg.world_size() as i64).collect::<Vec<_>>() {
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
    // On hier the ranks of the other host learn it from their peers: `PeerLost` carrying the
    // mismatch, at once rather than at their timeout.
    match pg.all_reduce_coalesced(bufs, ReduceOp::Sum).await {
        Err(CommError::Mismatch { .. }) => {}
        Err(CommError::PeerLost { detail, .. }) if detail.contains("ranks disagree") => {}
        other => return Err(format!("rank {me}: all_reduce_coalesced, 1 dtype against 2: {other:?}")),
    }
    let t = Instant::now();
    let next = pg.all_reduce(HostBuffer::from_slice(&[1.0f32]), ReduceOp::Sum).await;
    if next.is_ok() || t.elapsed() > Duration::from_secs(5) {
        return Err(format!("rank {me}: the op after a mismatch: {next:?} after {:?}", t.elapsed()));
    }
    Ok(())
}
