//! A tensor-parallel MLP block, split across the ranks the way Megatron-LM and DeepSpeed
//! AutoTP split it, decoding one token at a time (batch 1):
//!
//! - `W1` (`4H × H`, bf16) is **column-parallel**: rank r holds a slice of its output rows and
//!   computes its slice of `gelu(W1 · x)` with no communication;
//! - `W2` (`H × 4H`, bf16) is **row-parallel**: rank r holds the matching input columns and
//!   computes a partial `W2 · h` of full length;
//! - one `all_reduce` (bf16, `H` elements) sums the partials: the block's only communication.
//!
//! Prints the per-token latency and the share spent in the all_reduce, and checks the output
//! against the same block computed in one process. Hidden size `TP_MLP_HIDDEN` (default 4096),
//! tokens `TP_MLP_TOKENS` (default 50).
//!
//! ```text
//! cargo build --release --examples && commrun -n 2 -- target/release/examples/tp_mlp
//! ```

use std::time::{Duration, Instant};

use comm_api::{bf16, Config, HostBuffer, ReduceOp};

/// Deterministic weights in [-1, 1) / sqrt(fan_in): any rank can build any slice.
fn weight(matrix: u64, row: usize, col: usize, fan_in: usize) -> bf16 {
    let mut z = matrix.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((row as u64) << 32 | col as u64);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    let unit = (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
    bf16::from_f32(unit / (fan_in as f32).sqrt())
}

fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044_715 * x * x * x)).tanh())
}

/// Rows `lo..hi` of the intermediate layer on rank `r` of `n` (uneven when `n` does not divide it).
fn shard(inter: usize, r: usize, n: usize) -> (usize, usize) {
    (inter * r / n, inter * (r + 1) / n)
}

struct Block {
    hidden: usize,
    lo: usize,
    hi: usize,
    /// Rows `lo..hi` of W1, row-major (`(hi - lo) × hidden`).
    w1: Vec<bf16>,
    /// Columns `lo..hi` of W2, stored transposed (`(hi - lo) × hidden`), so both products
    /// stream through memory.
    w2t: Vec<bf16>,
}

impl Block {
    fn new(hidden: usize, lo: usize, hi: usize) -> Block {
        let inter = 4 * hidden;
        let w1 = (lo..hi).flat_map(|i| (0..hidden).map(move |j| weight(1, i, j, hidden))).collect();
        let w2t = (lo..hi).flat_map(|i| (0..hidden).map(move |j| weight(2, j, i, inter))).collect();
        Block { hidden, lo, hi, w1, w2t }
    }

    /// This rank's partial output: `W2[:, lo..hi] · gelu(W1[lo..hi, :] · x)`, in f32.
    fn partial(&self, x: &[f32]) -> Vec<f32> {
        let h = self.hidden;
        let mut y = vec![0f32; h];
        for k in 0..self.hi - self.lo {
            let row = &self.w1[k * h..(k + 1) * h];
            let a = gelu(row.iter().zip(x).map(|(w, x)| w.to_f32() * x).sum());
            for (y, w) in y.iter_mut().zip(&self.w2t[k * h..(k + 1) * h]) {
                *y += w.to_f32() * a;
            }
        }
        y
    }
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), comm_api::CommError> {
    let pg = comm_api::init(Config::from_env()?).await?;
    let (rank, n) = (pg.rank() as usize, pg.world_size() as usize);
    let hidden = env_usize("TP_MLP_HIDDEN", 4096);
    let tokens = env_usize("TP_MLP_TOKENS", 50).max(1);
    let (lo, hi) = shard(4 * hidden, rank, n);
    let block = Block::new(hidden, lo, hi);

    let mut x: Vec<f32> = (0..hidden).map(|j| ((j * 7 + 3) % 17) as f32 / 17.0 - 0.5).collect();
    let first_input = x.clone();
    let (mut total, mut comm) = (Duration::ZERO, Duration::ZERO);
    let mut first_output = Vec::new();
    pg.barrier().await?;
    for t in 0..tokens {
        let start = Instant::now();
        let partial: Vec<bf16> = block.partial(&x).into_iter().map(bf16::from_f32).collect();
        let c = Instant::now();
        let y = pg.all_reduce(HostBuffer::from_slice(&partial), ReduceOp::Sum).await?;
        comm += c.elapsed();
        total += start.elapsed();
        let y: Vec<f32> = y.as_slice::<bf16>()?.iter().map(|v| v.to_f32()).collect();
        if t == 0 {
            first_output = y.clone();
        }
        // The next token's input: this output, kept in range as a residual stream would be.
        x = y.iter().map(|v| v.clamp(-4.0, 4.0)).collect();
    }

    if rank == 0 {
        // The same block in one process, in f32 with the same bf16 weights.
        let whole = Block::new(hidden, 0, 4 * hidden);
        let want = whole.partial(&first_input);
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        let err = first_output.iter().zip(&want).fold(0f32, |m, (g, w)| m.max((g - w).abs())) / scale;
        // bf16 partials (8 mantissa bits) summed over n ranks, against an f32 computation.
        assert!(err < 0.02, "tensor-parallel output differs from the single-process one: {err:.4} of the max");
        let per_token = total.as_secs_f64() * 1e6 / tokens as f64;
        println!(
            "tp_mlp: {n} ranks, hidden {hidden} (bf16 weights, batch 1), {tokens} tokens: {per_token:.1} µs per token, {:.1}% in all_reduce ({} B); output matches the single-process block (max error {err:.2e} of the largest value)",
            100.0 * comm.as_secs_f64() / total.as_secs_f64(),
            hidden * 2
        );
    }
    pg.barrier().await?;
    pg.shutdown().await
}
