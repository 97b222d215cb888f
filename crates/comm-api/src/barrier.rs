//! torch's `monitored_barrier`: a barrier that says which ranks did not arrive.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::{Duration, Instant};

use comm_core::{CommError, DType, HostBuffer, Rank, Work};

use crate::ProcessGroup;

/// The point-to-point tag monitored barriers use (small enough for every backend's tag range).
pub const MONITORED_BARRIER_TAG: u32 = 4095;

/// `work`'s result, or `None` once `deadline` has passed; on any executor (a short-lived
/// thread wakes the task at the deadline).
async fn before<T: Send + 'static>(work: &mut Work<T>, deadline: Instant) -> Option<Result<T, CommError>> {
    let mut timer_set = false;
    std::future::poll_fn(|cx| {
        if let Poll::Ready(r) = Pin::new(&mut *work).poll(cx) {
            return Poll::Ready(Some(r));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Poll::Ready(None);
        }
        if !timer_set {
            timer_set = true;
            let waker = cx.waker().clone();
            std::thread::spawn(move || {
                std::thread::sleep(left);
                waker.wake();
            });
        }
        Poll::Pending
    })
    .await
}

fn names(ranks: &[Rank]) -> String {
    ranks.iter().map(Rank::to_string).collect::<Vec<_>>().join(", ")
}

impl ProcessGroup {
    /// A barrier that reports who is missing (torch's `monitored_barrier`): every other rank
    /// checks in with rank 0, which waits up to `timeout` for them and then lets them through.
    /// If some do not arrive, rank 0 fails with a [`CommError::Timeout`] naming them (the
    /// first one, or all of them with `wait_all_ranks`), and the others fail when rank 0 does
    /// not let them through in time. Uses point-to-point messages with tag
    /// [`MONITORED_BARRIER_TAG`]; after a failure the group should be shut down (a late rank's
    /// message may still be in flight).
    pub async fn monitored_barrier(&self, timeout: Duration, wait_all_ranks: bool) -> Result<(), CommError> {
        const OP: &str = "monitored_barrier";
        let deadline = Instant::now() + comm_core::config::clamp_timeout(timeout);
        let token = || HostBuffer::zeroed(DType::U8, 1);
        let tag = MONITORED_BARRIER_TAG;
        let n = self.world_size();
        if n == 1 {
            return Ok(());
        }
        if self.rank() != 0 {
            let mut sent = self.isend(token(), 0, tag);
            let mut through = self.irecv(token(), 0, tag);
            let waited = match before(&mut sent, deadline).await {
                Some(Ok(_)) => before(&mut through, deadline).await,
                other => other,
            };
            return match waited {
                Some(r) => r.map(drop),
                None => Err(CommError::Timeout {
                    op: OP.into(),
                    after: timeout,
                    detail: format!(
                        "rank 0 did not let rank {} through: another rank is missing (rank 0's error names it) or rank 0 is",
                        self.rank()
                    ),
                }),
            };
        }
        let mut arrivals: Vec<(Rank, Work<HostBuffer>)> = (1..n).map(|r| (r, self.irecv(token(), r, tag))).collect();
        let mut missing = Vec::new();
        for (r, w) in &mut arrivals {
            match before(w, deadline).await {
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e),
                None => {
                    missing.push(*r);
                    if !wait_all_ranks {
                        break;
                    }
                }
            }
        }
        if !missing.is_empty() {
            let which = if wait_all_ranks { "ranks" } else { "the first missing rank:" };
            return Err(CommError::Timeout {
                op: OP.into(),
                after: timeout,
                detail: format!("{which} {} did not arrive", names(&missing)),
            });
        }
        let acks: Vec<Work<HostBuffer>> = (1..n).map(|r| self.isend(token(), r, tag)).collect();
        for mut a in acks {
            match before(&mut a, deadline).await {
                Some(r) => r.map(drop)?,
                None => {
                    return Err(CommError::Timeout {
                        op: OP.into(),
                        after: timeout,
                        detail: "every rank arrived but could not be let through in time".into(),
                    });
                }
            }
        }
        Ok(())
    }
}
