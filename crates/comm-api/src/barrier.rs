//! torch's `monitored_barrier`: a barrier that says which ranks did not arrive.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::{Duration, Instant};

use comm_core::{CommError, DType, HostBuffer, Rank, Work};

use crate::ProcessGroup;

/// The point-to-point tag monitored barriers use (small enough for every backend's tag range).
pub const MONITORED_BARRIER_TAG: u32 = 4095;

/// How long the other ranks wait, past their own deadline, for rank 0's verdict: rank 0 sends
/// it at its deadline at the latest, so this only covers the message's way and a rank 0 that
/// started the barrier a little later than they did.
const VERDICT_GRACE: Duration = Duration::from_secs(2);

/// `work`'s result, or `None` once `deadline` has passed (a deadline already past checks
/// once). On any executor: the process's one timer thread (futures-timer's) wakes the task,
/// and the timer is gone with the wait.
async fn before<T: Send + 'static>(work: &mut Work<T>, deadline: Instant) -> Option<Result<T, CommError>> {
    let mut timer = futures_timer::Delay::new(deadline.saturating_duration_since(Instant::now()));
    std::future::poll_fn(|cx| {
        if let Poll::Ready(r) = Pin::new(&mut *work).poll(cx) {
            return Poll::Ready(Some(r));
        }
        if Instant::now() >= deadline || Pin::new(&mut timer).poll(cx).is_ready() {
            return Poll::Ready(None);
        }
        Poll::Pending
    })
    .await
}

fn names(ranks: &[Rank]) -> String {
    ranks.iter().map(Rank::to_string).collect::<Vec<_>>().join(", ")
}

/// Rank 0's word to each rank: through, or the first rank it found missing.
const THROUGH: i32 = -1;

impl ProcessGroup {
    /// A barrier that reports who is missing (torch's `monitored_barrier`): every other rank
    /// checks in with rank 0, which waits up to `timeout` for them and then sends each its
    /// verdict, so every rank that reaches the barrier in time ends alike. If some do not
    /// arrive, rank 0 fails with a [`CommError::Timeout`] naming them (the first one, or all
    /// of them with `wait_all_ranks`) and the others fail naming the first; a rank that gets
    /// no verdict within `timeout` plus 2 s fails saying rank 0 is missing. A zero `timeout`
    /// checks once: the barrier passes only if every rank was already there. Uses
    /// point-to-point messages with tag [`MONITORED_BARRIER_TAG`]; after a failure the group
    /// should be shut down (a late rank's message may still be in flight).
    pub async fn monitored_barrier(&self, timeout: Duration, wait_all_ranks: bool) -> Result<(), CommError> {
        const OP: &str = "monitored_barrier";
        let timeout = comm_core::config::clamp_timeout(timeout);
        let deadline = Instant::now() + timeout;
        let tag = MONITORED_BARRIER_TAG;
        let n = self.world_size();
        if n == 1 {
            return Ok(());
        }
        let timed_out = |detail: String| CommError::timeout(OP, timeout, detail);
        if self.rank() != 0 {
            let me = self.rank();
            let mut sent = self.isend(HostBuffer::zeroed(DType::U8, 1), 0, tag);
            let mut verdict = self.irecv(HostBuffer::zeroed(DType::I32, 1), 0, tag);
            let deadline = deadline + VERDICT_GRACE;
            let waited = match before(&mut sent, deadline).await {
                Some(Ok(_)) => before(&mut verdict, deadline).await,
                other => other,
            };
            return match waited {
                Some(Ok(v)) => match v.as_slice::<i32>()?[0] {
                    THROUGH => Ok(()),
                    missing => {
                        Err(timed_out(format!("rank 0 found rank {missing} missing and did not let rank {me} through")))
                    }
                },
                Some(Err(e)) => Err(e),
                None => Err(timed_out(format!("rank 0 did not let rank {me} through: rank 0 is missing"))),
            };
        }
        let mut arrivals: Vec<(Rank, Work<HostBuffer>)> =
            (1..n).map(|r| (r, self.irecv(HostBuffer::zeroed(DType::U8, 1), r, tag))).collect();
        let mut missing = Vec::new();
        for (r, w) in &mut arrivals {
            match before(w, deadline).await {
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e),
                None => missing.push(*r),
            }
        }
        // Every rank gets the verdict, the missing ones too: one that arrives late then fails
        // as the others did (its arrival meets the receive posted above).
        let word = missing.first().map_or(THROUGH, |&r| r as i32);
        let verdicts: Vec<Work<HostBuffer>> =
            (1..n).map(|r| self.isend(HostBuffer::from_slice(&[word]), r, tag)).collect();
        if !missing.is_empty() {
            if !wait_all_ranks {
                missing.truncate(1);
            }
            let which = if wait_all_ranks { "ranks" } else { "the first missing rank:" };
            return Err(timed_out(format!("{which} {} did not arrive", names(&missing))));
        }
        for mut v in verdicts {
            match before(&mut v, deadline + VERDICT_GRACE).await {
                Some(r) => r.map(drop)?,
                None => return Err(timed_out("every rank arrived but could not be let through in time".into())),
            }
        }
        Ok(())
    }
}
