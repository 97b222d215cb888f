//! Overlap communication with computation on a tokio runtime.
//!
//! The all_gather is issued before the computation and completes on the backend's own
//! thread while a tokio task computes; nothing blocks the runtime.
//!
//! ```text
//! cargo build --examples && commrun -n 2 -- target/debug/examples/overlap
//! ```

use std::time::Instant;

use comm_api::{Config, HostBuffer, ReduceOp};

#[tokio::main]
async fn main() -> Result<(), comm_api::CommError> {
    let pg = comm_api::init(Config::from_env()?).await?;
    let (rank, n) = (pg.rank(), pg.world_size() as usize);

    let shard: Vec<f32> = (0..1 << 20).map(|i| (i % 7) as f32 + rank as f32).collect();
    let t = Instant::now();
    let gather = pg.all_gather(HostBuffer::from_slice(&shard)); // issued now

    // Compute something unrelated meanwhile.
    let local =
        tokio::task::spawn_blocking(move || shard.iter().map(|&x| x as f64).sum::<f64>()).await.expect("compute task");

    let all = gather.await?.to_vec::<f32>()?;
    assert_eq!(all.len(), n << 20);
    // Check the result: block r was produced by rank r.
    for r in 0..n {
        assert_eq!(all[r << 20], r as f32, "block {r}");
    }

    // Agree on the global sum of the local sums.
    let total = pg.all_reduce(HostBuffer::from_slice(&[local]), ReduceOp::Sum).await?.to_vec::<f64>()?[0];
    println!(
        "rank {rank}: gathered {} floats and computed while waiting ({:?}); global sum {total}",
        all.len(),
        t.elapsed()
    );
    pg.shutdown().await
}
