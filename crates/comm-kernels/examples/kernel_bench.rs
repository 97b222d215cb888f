//! Throughput of the reduction kernels in cache: a two-input sum per dtype and size, in GB/s
//! of output, and the time of one call (what a small all_reduce pays for its reduction).
//! `COMM_SIMD=avx2` (or `portable`) forces a lower tier.
//!
//! ```text
//! cargo run --release -p comm-kernels --example kernel_bench
//! ```

use std::time::Instant;

use comm_core::{DType, HostBuffer, ReduceOp};

fn main() {
    println!("{:>6} {:>9} {:>10} {:>9}", "dtype", "bytes", "GB/s", "ns/call");
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for bytes in [8usize, 32, 128, 512, 4 << 10, 64 << 10, 256 << 10, 1 << 20] {
            let len = bytes / dtype.size();
            let a = HostBuffer::zeroed(dtype, len);
            let b = HostBuffer::zeroed(dtype, len);
            let mut out = HostBuffer::zeroed(dtype, len);
            let iters = ((256 << 20) / bytes).min(1 << 20);
            let mut best = f64::MAX;
            for _ in 0..5 {
                let t = Instant::now();
                for _ in 0..iters {
                    comm_kernels::reduce(dtype, ReduceOp::Sum, &[a.as_bytes(), b.as_bytes()], out.as_bytes_mut());
                }
                best = best.min(t.elapsed().as_secs_f64() / iters as f64);
            }
            println!("{:>6} {:>9} {:>10.2} {:>9.1}", dtype.to_string(), bytes, bytes as f64 / best / 1e9, best * 1e9);
        }
    }
}
