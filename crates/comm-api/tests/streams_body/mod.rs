//! The streams scenario shared by the shm tests (`streams`) and the mpirun ones (`hier`):
//! several tasks per rank, each on its own stream, mixed ops, every result checked.

use std::time::Duration;

use comm_api::{CommError, HostBuffer, ProcessGroup, ReduceOp};

/// A small deterministic generator, so every rank draws the same shapes per op.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51afd7ed558ccd);
    x ^ (x >> 33)
}

/// Task `task`'s `ops` mixed ops on `pg` (its own stream, or a shared group), each result
/// checked; the number of wrong results, or the first error.
async fn mixed_ops(pg: ProcessGroup, task: u64, ops: u64) -> Result<u64, CommError> {
    let (me, n) = (pg.rank() as u64, pg.world_size() as u64);
    let mut wrong = 0;
    for i in 0..ops {
        let draw = mix(task * 1_000_003 + i);
        let len = 1 + (draw % 300) as usize;
        let value = |r: u64| (task * 1000 + r * 10 + i % 7) as f32;
        if draw.is_multiple_of(3) {
            // Now and then a pause, so the tasks interleave differently on each rank.
            tokio::time::sleep(Duration::from_micros(draw % 200)).await;
        }
        let ok = match (draw >> 8) % 4 {
            0 => {
                let out = pg.all_reduce(HostBuffer::from_slice(&vec![value(me); len]), ReduceOp::Sum).await?;
                let sum: f32 = (0..n).map(value).sum();
                out.to_vec::<f32>()?.iter().all(|&x| x == sum)
            }
            1 => {
                let got = pg.all_gather(HostBuffer::from_slice(&vec![value(me); len])).await?.to_vec::<f32>()?;
                (0..n).all(|r| got[r as usize * len..][..len].iter().all(|&x| x == value(r)))
            }
            2 => {
                let root = (draw >> 16) % n;
                let out = pg.broadcast(HostBuffer::from_slice(&vec![value(me); len]), root as u32).await?;
                out.to_vec::<f32>()?.iter().all(|&x| x == value(root))
            }
            _ => {
                // A ring: send to the next rank, receive from the previous.
                let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
                let sent = pg.isend(HostBuffer::from_slice(&vec![value(me); len]), next as u32, task as u32);
                let got = pg.irecv(HostBuffer::zeroed(comm_api::DType::F32, len), prev as u32, task as u32).await?;
                sent.await?;
                got.to_vec::<f32>()?.iter().all(|&x| x == value(prev))
            }
        };
        wrong += u64::from(!ok);
    }
    Ok(wrong)
}

/// `tasks` tasks per rank, each on its own stream of `pg`, `ops` mixed ops each: no wrong result.
pub(crate) async fn tasks_on_streams(pg: &ProcessGroup, tasks: u64, ops: u64) -> Result<(), String> {
    let streams = pg.streams().await.map_err(|e| e.to_string())?;
    let handles: Vec<_> = (0..tasks).map(|t| tokio::spawn(mixed_ops(streams.stream(t), t, ops))).collect();
    for (t, h) in handles.into_iter().enumerate() {
        let wrong = h.await.map_err(|e| e.to_string())?.map_err(|e| format!("task {t}: {e}"))?;
        if wrong != 0 {
            return Err(format!("task {t}: {wrong} of {ops} results wrong"));
        }
    }
    streams.shutdown().await.map_err(|e| e.to_string())?;
    // Ended: later ops fail, at once.
    match streams.stream(0).barrier().await {
        Err(CommError::Shutdown(_)) => Ok(()),
        other => Err(format!("an op after shutdown: {other:?}")),
    }
}
