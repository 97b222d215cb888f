//! The abort scenario, run by every rank of a job of 2 or more on any backend: rank 1 aborts
//! the group while the others wait in an all_reduce it never joins.
#![allow(dead_code, unreachable_pub)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use comm_api::{CommError, DType, HostBuffer, ProcessGroup, ReduceOp};

/// How long rank 1 lets the others wait before it aborts.
const BEFORE_ABORT: Duration = Duration::from_millis(300);
/// How long after the abort the others' op may take to fail on a loaded 2-core machine (the
/// measured time is printed; shm and mpi take milliseconds).
const SLACK: Duration = Duration::from_secs(3);

/// Passes on every rank, or says why not; prints what it saw when it passed.
pub async fn abort_scenario(pg: &ProcessGroup) -> Result<(), String> {
    let me = pg.rank();
    let fired = Arc::new(Mutex::new(Vec::<String>::new()));
    let seen = fired.clone();
    pg.on_failure(move |cause| seen.lock().unwrap().push(cause.to_string())).map_err(|e| e.to_string())?;
    if let Some(e) = pg.error() {
        return Err(format!("rank {me}: error() before any failure: {e}"));
    }
    pg.barrier().await.map_err(|e| format!("rank {me}: barrier: {e}"))?;
    let start = Instant::now();
    let what = if me == 1 {
        tokio::time::sleep(BEFORE_ABORT).await;
        pg.abort("maintenance");
        "aborted".to_string()
    } else {
        let r = pg.all_reduce(HostBuffer::zeroed(DType::F32, 4), ReduceOp::Sum).await;
        let took = start.elapsed();
        let e = match r {
            Ok(_) => return Err(format!("rank {me}: the all_reduce rank 1 never joined completed")),
            Err(e) => e,
        };
        let msg = e.to_string();
        if !msg.contains("maintenance") || !matches!(e, CommError::PeerLost { .. } | CommError::Poisoned { .. }) {
            return Err(format!("rank {me}: expected PeerLost or Poisoned with the reason, got {e:?}"));
        }
        if took > BEFORE_ABORT + SLACK {
            return Err(format!(
                "rank {me}: the op failed {took:?} after it was issued, the abort came at {BEFORE_ABORT:?}"
            ));
        }
        format!("op failed {:?} after the abort: {msg}", took.saturating_sub(BEFORE_ABORT))
    };
    let error = pg.error().ok_or_else(|| format!("rank {me}: error() is None after the abort ({what})"))?;
    if !error.to_string().contains("maintenance") {
        return Err(format!("rank {me}: error() does not give the reason: {error}"));
    }
    // The hook runs on the thread that failed the group, right after error() can see it.
    let waited = Instant::now();
    while fired.lock().unwrap().is_empty() && waited.elapsed() < SLACK {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let causes = fired.lock().unwrap().clone();
    if causes.len() != 1 || !causes[0].contains("maintenance") {
        return Err(format!("rank {me}: the failure hook ran {} times: {causes:?}", causes.len()));
    }
    // Later ops fail at once, and a hook added now runs at once.
    let later = Instant::now();
    if pg.barrier().await.is_ok() || later.elapsed() > SLACK {
        return Err(format!("rank {me}: a barrier after the abort did not fail at once"));
    }
    let again = Arc::new(Mutex::new(0));
    let count = again.clone();
    pg.on_failure(move |_| *count.lock().unwrap() += 1).map_err(|e| e.to_string())?;
    if *again.lock().unwrap() != 1 {
        return Err(format!("rank {me}: a hook added after the failure did not run at once"));
    }
    println!("abort, rank {me}: {what}");
    Ok(())
}
