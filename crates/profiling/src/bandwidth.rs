//! nccl-tests' bandwidth definitions (`shared/reference/nccl-tests-bw.md`), per op.
//!
//! `algbw = S / t` with S the op's *operation size*, `busbw = algbw × factor(n)` with `n`
//! the size of the group the op ran on (not the world: DeepSpeed's mistake). Both in GB/s,
//! 1 GB = 10^9 bytes (DeepSpeed prints Gbit/s, 8× larger).

use comm_core::OpKind;

/// nccl-tests' operation size S for an op that handed in `bytes` ([`comm_core::Op::bytes`])
/// on a group of `n` ranks.
///
/// | op | `bytes` is | S |
/// |---|---|---|
/// | all_reduce, broadcast, reduce, send, recv | the buffer | `bytes` |
/// | reduce_scatter | the full input | `bytes` (DeepSpeed multiplies by n again: n× too much) |
/// | all_to_all | the per-rank send buffer | `bytes` |
/// | all_gather, gather | the per-rank shard | `n × bytes` (the full output) |
/// | scatter | the block this rank receives | `n × bytes` (the root's full input) |
/// | anything else | — | `bytes` |
pub fn op_size(op: &str, bytes: u64, n: u32) -> u64 {
    match OpKind::from_name(op) {
        Some(OpKind::AllGather | OpKind::Gather | OpKind::Scatter) => bytes.saturating_mul(u64::from(n)),
        _ => bytes,
    }
}

/// nccl-tests' bus-bandwidth factor, or `None` when the op has no defined bus bandwidth
/// (unknown ops, barrier): such rows show latency only. Never an error — DeepSpeed exits
/// the process (status 0) on an op name it does not know.
///
/// all_reduce `2(n−1)/n`; all_gather, reduce_scatter, all_to_all, gather, scatter `(n−1)/n`;
/// broadcast, reduce, send, recv `1`.
pub fn bus_factor(op: &str, n: u32) -> Option<f64> {
    let n = f64::from(n.max(1));
    match OpKind::from_name(op)? {
        OpKind::AllReduce => Some(2.0 * (n - 1.0) / n),
        OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll | OpKind::Gather | OpKind::Scatter => {
            Some((n - 1.0) / n)
        }
        OpKind::Broadcast | OpKind::Reduce | OpKind::Send | OpKind::Recv => Some(1.0),
        _ => None,
    }
}

/// `(algbw, busbw)` in GB/s (10^9 B/s = bytes per nanosecond) for one op of `bytes` on `n`
/// ranks taking `ns` nanoseconds; `None` for ops without bandwidth (barrier, zero bytes,
/// zero time, unknown ops).
pub fn bandwidth(op: &str, bytes: u64, n: u32, ns: f64) -> Option<(f64, f64)> {
    let factor = bus_factor(op, n)?;
    if bytes == 0 || ns <= 0.0 {
        return None;
    }
    let algbw = op_size(op, bytes, n) as f64 / ns;
    Some((algbw, algbw * factor))
}

/// Base-1024 size: `512 B`, `1.00 KiB`, `64.00 MiB`.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.2} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;
    use comm_core::ops::*;
    use comm_core::{DType, HostBuffer, Op, ReduceOp};

    #[test]
    fn factors_match_nccl_tests() {
        assert_eq!(bus_factor("all_reduce", 4), Some(1.5));
        assert_eq!(bus_factor("all_reduce", 1), Some(0.0));
        assert_eq!(bus_factor("all_gather", 4), Some(0.75));
        assert_eq!(bus_factor("reduce_scatter", 2), Some(0.5));
        assert_eq!(bus_factor("all_to_all", 8), Some(0.875));
        assert_eq!(bus_factor("broadcast", 8), Some(1.0));
        assert_eq!(bus_factor("send", 2), Some(1.0));
        assert_eq!(bus_factor("barrier", 2), None);
        assert_eq!(bus_factor("all_gather_object", 2), None);
    }

    #[test]
    fn sizes_follow_what_each_op_hands_in() {
        // Pin Op::bytes() per op: if its meaning changes, S here must change with it.
        let b = |n: usize| HostBuffer::zeroed(DType::F32, n);
        assert_eq!(AllReduce { buf: b(4), op: ReduceOp::Sum }.bytes(), 16);
        assert_eq!(AllGather { input: b(4), output: None }.bytes(), 16);
        assert_eq!(ReduceScatter { input: b(8), op: ReduceOp::Sum, output: None }.bytes(), 32);
        assert_eq!(AllToAll { input: b(8), output: None, input_splits: None, output_splits: None }.bytes(), 32);
        assert_eq!(Gather { input: b(4), output: None, root: 0 }.bytes(), 16);
        assert_eq!(Scatter { output: b(4), input: None, root: 0 }.bytes(), 16);
        assert_eq!(Barrier.bytes(), 0);
        // 256 KiB reduce_scatter on 2 ranks is 256 KiB (DeepSpeed counted 512 KiB).
        assert_eq!(op_size("reduce_scatter", 256 << 10, 2), 256 << 10);
        assert_eq!(op_size("all_gather", 16, 4), 64);
        assert_eq!(op_size("scatter", 16, 4), 64);
        assert_eq!(op_size("all_to_all", 32, 4), 32);
    }

    #[test]
    fn bandwidth_in_gb_per_s() {
        // 1 GB all_reduce in 1 s on 4 ranks: algbw 1, busbw 1.5 (DeepSpeed: algbw 16 "Gbps").
        assert_eq!(bandwidth("all_reduce", 1_000_000_000, 4, 1e9), Some((1.0, 1.5)));
        assert_eq!(bandwidth("all_gather", 250_000_000, 4, 0.5e9), Some((2.0, 1.5)));
        assert_eq!(bandwidth("barrier", 0, 4, 1.0), None);
        assert_eq!(bandwidth("all_reduce", 8, 2, 0.0), None);
        assert_eq!(bandwidth("mystery", 8, 2, 1.0), None);
    }
}
