//! What a new world group measures once, so that its gather threshold fits the transport
//! between its ranks (see ARCHITECTURE.md, "Gather or two phases").

use std::time::{Duration, Instant};

use comm_core::{CommError, DType, HostBuffer, ReduceOp};

use crate::raw::{Comm, Polled};
use crate::{kernels, raw};

use super::header::WHOLE_MAX;
use super::steps::internal;

/// Fewest bytes a gather threshold takes: what one exchange slot carries (an input that fits
/// it costs no message of its own). Also the threshold until measured.
pub(crate) const GATHER_MIN: usize = WHOLE_MAX;
/// Most: beyond it a gather's (n − 1)-fold traffic costs more than any round trip it saves.
const GATHER_MAX: usize = 256 << 10;

/// The gather threshold (`Params::small_max`) of a new world group: the bytes a rank reduces in
/// one of MPI's round trips (what gathering saves), within [`GATHER_MIN`, `GATHER_MAX`]; the
/// largest any rank measured, so that all agree.
pub(super) fn gather_threshold(comm: &Comm, timeout: Duration) -> Result<usize, CommError> {
    let deadline = Instant::now() + timeout;
    let round_trip = (0..12)
        .map(|_| {
            let t = Instant::now();
            allreduce_max(comm, 0, deadline, timeout).map(|_| t.elapsed())
        })
        .collect::<Result<Vec<_>, _>>()?;
    // The fastest of the later ones: the first pay for connections; a busy machine only slows.
    let round_trip = round_trip[2..].iter().min().copied().unwrap_or_default();
    let per_round = per_round(round_trip, reduce_rate());
    let agreed = allreduce_max(comm, per_round, deadline, timeout)?;
    let threshold = threshold(agreed);
    tracing::debug!(?round_trip, per_round, agreed, threshold, "comm mpi: gather threshold");
    Ok(threshold)
}

/// Bytes reduced at `rate` (bytes per second) in one `round_trip`.
fn per_round(round_trip: Duration, rate: f64) -> i64 {
    // `as` saturates (and maps NaN to 0).
    (round_trip.as_secs_f64() * rate) as i64
}

/// The gather threshold for the largest `per_round` of the ranks.
fn threshold(per_round: i64) -> usize {
    usize::try_from(per_round).unwrap_or(0).clamp(GATHER_MIN, GATHER_MAX)
}

/// Bytes per second the kernels reduce (f32 sums of 64 KiB inputs, in cache); the best of 5.
fn reduce_rate() -> f64 {
    let len = 64 << 10;
    let (a, b) = (vec![1u8; len], vec![2u8; len]);
    let mut out = vec![0u8; len];
    let best = (0..5)
        .map(|_| {
            let t = Instant::now();
            kernels::reduce(DType::F32, ReduceOp::Sum, &[&a, &b], &mut out);
            std::hint::black_box(&out);
            t.elapsed()
        })
        .min()
        .unwrap_or_default();
    len as f64 / best.as_secs_f64().max(1e-9)
}

/// The largest of every rank's `mine`, by `MPI_Iallreduce` polled until done or `deadline`.
fn allreduce_max(comm: &Comm, mine: i64, deadline: Instant, timeout: Duration) -> Result<i64, CommError> {
    let op = raw::builtin_op(ReduceOp::Max).ok_or_else(|| internal("MPI_MAX is missing"))?;
    let mut req = raw::iallreduce_in_place(comm, HostBuffer::from_slice(&[mine]), op, false)?;
    loop {
        match req.test() {
            Polled::Done(_) => break,
            Polled::Pending if Instant::now() < deadline => std::hint::spin_loop(),
            Polled::Pending => {
                return Err(CommError::timeout(
                    "mpi init (measuring the round trip)",
                    timeout,
                    "a rank stopped answering while the world group was measured",
                ))
            }
            Polled::Failed { err, .. } => return Err(err.into()),
        }
    }
    let got = req.into_bufs()?.recv.ok_or_else(|| internal("a finished all_reduce lost its buffer"))?;
    got.to_vec::<i64>()?.first().copied().ok_or_else(|| internal("an empty all_reduce"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_threshold_follows_the_round_trip() {
        let us = Duration::from_micros;
        // Shared memory (measured: 1-1.4 µs, 20 GB/s): what the slot carries.
        assert_eq!(threshold(per_round(us(1), 20e9)), (64 << 10) - 96);
        // TCP over loopback (13-18 µs): the most.
        assert_eq!(threshold(per_round(us(15), 20e9)), 256 << 10);
        // Between them, as measured; nonsense stays in bounds.
        assert_eq!(threshold(per_round(us(5), 20e9)), 100_000);
        assert_eq!(threshold(per_round(Duration::MAX, f64::INFINITY)), 256 << 10);
        assert_eq!(threshold(per_round(us(1), f64::NAN)), (64 << 10) - 96);
        assert_eq!(threshold(-5), (64 << 10) - 96);
    }
}
