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

/// How the tasks of a misuse scenario share one group (or stream).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Sharing {
    /// Each task holds a clone and issues when it likes.
    Clones,
    /// The tasks take turns behind a `tokio::sync::Mutex` (one op in flight per rank), which
    /// orders them on a rank but not across ranks.
    Mutex,
}

/// What one task of a misuse scenario saw.
#[derive(Debug)]
struct Outcome {
    /// Ops whose result came back wrong.
    wrong: u64,
    /// The op that first failed (its number in the task) and the error.
    failed: Option<(u64, CommError)>,
}

/// `tasks` tasks per rank share `pg` as `sharing` says, each issuing `ops` same-shaped
/// all_reduces (i64, so every sum is exact) with random pauses, until one fails. Every task
/// must end with only right results, or with an error: never wrong results and no error. The
/// summary says how many tasks failed and at which op.
pub(crate) async fn misuse(pg: &ProcessGroup, sharing: Sharing, tasks: u64, ops: u64) -> Result<String, String> {
    let (me, n) = (pg.rank() as i64, pg.world_size() as i64);
    let shared = std::sync::Arc::new(tokio::sync::Mutex::new(pg.clone()));
    let handles: Vec<_> = (0..tasks)
        .map(|task| {
            let (pg, shared) = (pg.clone(), shared.clone());
            tokio::spawn(async move {
                let mut out = Outcome { wrong: 0, failed: None };
                // Different pauses on every rank: the tasks interleave differently.
                let mut draw = mix(task * 7919 + me as u64 * 104_729 + 1);
                let value = |r: i64, i: u64| ((task as i64) << 32) + ((i as i64) << 8) + r;
                for i in 0..ops {
                    draw = mix(draw);
                    match draw % 4 {
                        0 => tokio::time::sleep(Duration::from_micros(draw % 150)).await,
                        1 => tokio::task::yield_now().await,
                        _ => {}
                    }
                    let buf = HostBuffer::from_slice(&[value(me, i); 8]);
                    let got = match sharing {
                        Sharing::Clones => pg.all_reduce(buf, ReduceOp::Sum).await,
                        Sharing::Mutex => {
                            let group = shared.lock().await;
                            group.all_reduce(buf, ReduceOp::Sum).await
                        }
                    };
                    match got.and_then(|b| b.to_vec::<i64>()) {
                        Ok(v) => out.wrong += u64::from(v != [(0..n).map(|r| value(r, i)).sum::<i64>(); 8]),
                        Err(e) => {
                            out.failed = Some((i, e));
                            break;
                        }
                    }
                }
                out
            })
        })
        .collect();
    let (mut failed_at, mut named, mut first) = (Vec::new(), false, String::new());
    for (t, h) in handles.into_iter().enumerate() {
        let out = h.await.map_err(|e| e.to_string())?;
        match out.failed {
            None if out.wrong > 0 => {
                return Err(format!("rank {me} task {t}: {} of {ops} results wrong and no error", out.wrong))
            }
            None => {}
            Some((i, e)) => {
                // A Timeout too: on mpi and hier an arbitrated stream's peers may learn of the
                // failure only when their control group times out.
                let expected = matches!(
                    e,
                    CommError::Mismatch { .. }
                        | CommError::Poisoned { .. }
                        | CommError::PeerLost { .. }
                        | CommError::Timeout { .. }
                );
                if !expected {
                    return Err(format!("rank {me} task {t}: op {i} failed with an unexpected error: {e}"));
                }
                // The advice reaches some task of every rank that saw the misuse.
                named |= e.to_string().contains("its own stream");
                if failed_at.iter().all(|&j| i < j) {
                    first = e.to_string();
                }
                failed_at.push(i);
            }
        }
    }
    if !failed_at.is_empty() && !named {
        return Err(format!("rank {me}: no task's error said what went wrong (failed at ops {failed_at:?})"));
    }
    failed_at.sort_unstable();
    let n = failed_at.len();
    Ok(format!("{sharing:?} × {tasks}: {n} of {tasks} tasks stopped by an error, at ops {failed_at:?}; first: {first}"))
}

/// The deterministic patterns the issuer check must never flag, on `pg`: ops from the main
/// task, then from a spawned task (README's example), then request handlers spawned one after
/// another, each issuing a few ops; every result right.
pub(crate) async fn handed_over(pg: &ProcessGroup) -> Result<(), String> {
    let n = pg.world_size() as f32;
    let sum = move |pg: ProcessGroup| async move {
        let got = pg.all_reduce(HostBuffer::from_slice(&[1.0f32; 16]), ReduceOp::Sum).await?;
        Ok::<bool, CommError>(got.to_vec::<f32>()?.iter().all(|&x| x == n))
    };
    let mut right = sum(pg.clone()).await.map_err(|e| e.to_string())?;
    right &= tokio::spawn(sum(pg.clone())).await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
    right &= sum(pg.clone()).await.map_err(|e| e.to_string())?;
    for request in 0..20 {
        let pg = pg.clone();
        let handler = tokio::spawn(async move {
            let mut right = true;
            for _ in 0..=request % 3 {
                right &= sum(pg.clone()).await?;
            }
            pg.barrier().await?;
            Ok::<bool, CommError>(right)
        });
        right &= handler.await.map_err(|e| e.to_string())?.map_err(|e| format!("handler {request}: {e}"))?;
    }
    // From a plain thread too (a thread outside tokio is an issuer of its own).
    let from_thread = pg.clone();
    right &= std::thread::spawn(move || {
        from_thread.all_reduce(HostBuffer::from_slice(&[1.0f32; 16]), ReduceOp::Sum).wait().map(|b| b.to_vec::<f32>())
    })
    .join()
    .map_err(|_| "the thread panicked".to_owned())?
    .and_then(|v| v)
    .map_err(|e| e.to_string())?
    .iter()
    .all(|&x| x == n);
    if right {
        Ok(())
    } else {
        Err("a deterministic hand-over gave wrong sums".into())
    }
}
