//! A service that survives a lost rank: ranks serve a loop of all_reduces; rank 1 is killed
//! (SIGKILL) in the middle; the others shrink their group and go on; commrun starts a
//! replacement, the survivors admit it with `grow`, it receives the service's state from rank
//! 0 (torchft's "heal"), and the loop goes on with every rank again. Every sum is checked.
//!
//! ```text
//! cargo build --examples && commrun -n 4 --max-restarts 1 -- target/debug/examples/elastic
//! ```

use std::time::Instant;

use comm_api::{CommError, Config, HostBuffer, ProcessGroup, ReduceOp};
use serde::{Deserialize, Serialize};

/// Steps of the loop, and the step before which rank 1 dies.
const STEPS: u64 = 60;
const KILL_AT: u64 = 20;
/// Steps the survivors serve on their own before they wait for the replacement.
const ALONE: u64 = 10;

/// What a replacement needs to take over: where the loop is, and what it has computed so far.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct State {
    step: u64,
    /// The sum of every step's result.
    total: f64,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), CommError> {
    let started = Instant::now();
    let cfg = Config::from_env()?;
    let replacement = std::env::var_os("COMM_JOIN").is_some();
    let (mut pg, mut state) = if replacement {
        // A replacement: join the survivors when they admit it, then take the state over.
        let pg = comm_api::builder(cfg).join().await?;
        let state = pg.broadcast_object(None::<State>, 0).await?;
        let (rank, n, took) = (pg.rank(), pg.world_size(), started.elapsed());
        println!("replacement: joined as rank {rank}/{n} at step {}, {took:?} after it started", state.step);
        (pg, state)
    } else {
        (comm_api::init(cfg).await?, State { step: 0, total: 0.0 })
    };
    let full = pg.world_size();
    // Where the survivors lost a rank, if they did.
    let mut lost_at = None;
    while state.step < STEPS {
        if pg.rank() == 1 && state.step == KILL_AT && !replacement && lost_at.is_none() {
            // A crash: no unwinding, no goodbye to the peers.
            let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
        }
        match step(&pg).await {
            Ok(sum) => {
                state.total += sum;
                state.step += 1;
            }
            Err(e) => {
                // Every survivor sees the loss (the peer that noticed it first says so).
                let t = Instant::now();
                pg = pg.shrink().await?;
                println!(
                    "rank {}: step {}: {e}; shrank to {} ranks in {:?}",
                    pg.rank(),
                    state.step,
                    pg.world_size(),
                    t.elapsed()
                );
                lost_at = Some(state.step);
            }
        }
        if lost_at.is_some_and(|at| state.step == at + ALONE) && pg.world_size() < full {
            let t = Instant::now();
            pg = pg.grow(full - pg.world_size()).await?;
            // The replacement takes the state over from rank 0.
            let healed = pg.broadcast_object((pg.rank() == 0).then(|| state.clone()), 0).await?;
            assert_eq!(healed, state, "the survivors agree on the state");
            println!("rank {}: step {}: back to {} ranks in {:?}", pg.rank(), state.step, pg.world_size(), t.elapsed());
        }
    }
    // Every rank, the replacement too, computed the same total.
    let totals = pg.all_gather_object(&state.total).await?;
    assert!(totals.iter().all(|&t| t == state.total), "totals differ: {totals:?}");
    assert_eq!(pg.world_size(), full, "the loop ends with every rank again");
    println!("rank {}/{}: {} steps, total {}", pg.rank(), pg.world_size(), state.step, state.total);
    pg.shutdown().await
}

/// One step of the service: every rank contributes 1 per element; the sum is the group's size.
async fn step(pg: &ProcessGroup) -> Result<f64, CommError> {
    let n = pg.world_size() as f32;
    let sum = pg.all_reduce(HostBuffer::from(vec![1.0f32; 256]), ReduceOp::Sum).await?.to_vec::<f32>()?;
    assert!(sum.iter().all(|&x| x == n), "rank {}: got {} instead of {n}", pg.rank(), sum[0]);
    Ok(f64::from(n))
}
