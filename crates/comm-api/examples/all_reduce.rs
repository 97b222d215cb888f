//! Sum a vector across every rank.
//!
//! ```text
//! cargo build --examples && commrun -n 4 -- target/debug/examples/all_reduce
//! ```

use comm_api::{Config, HostBuffer, ReduceOp};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), comm_api::CommError> {
    let pg = comm_api::init(Config::from_env()?).await?;
    let (rank, n) = (pg.rank(), pg.world_size());
    if rank == 0 {
        // Which backend was chosen and why, and how the ranks found each other.
        println!("{}", pg.describe());
    }

    // Rank r contributes [r, r, r, r]; everyone ends with 0 + 1 + ... + (n-1).
    let buf = HostBuffer::from_slice(&[rank as f32; 4]);
    let sum = pg.all_reduce(buf, ReduceOp::Sum).await?.to_vec::<f32>()?;
    let want = (n * (n - 1) / 2) as f32;
    assert!(sum.iter().all(|&x| x == want), "rank {rank}: got {sum:?}, want {want}");
    println!("rank {rank}/{n}: all_reduce sum = {sum:?}");

    pg.barrier().await?;
    pg.shutdown().await
}
