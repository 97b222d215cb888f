//! `--tasks N`: what N threads, each issuing on a stream of its own, get done together,
//! against one stream alone (the way a service's request handlers share a group).

use std::time::{Duration, Instant};

use comm_api::{CommError, HostBuffer, ProcessGroup, ReduceOp, Streams};

use crate::cli::Plan;

/// Alternating slices of each measurement per size, so both see the same machine.
const SLICES: usize = 5;

pub(crate) async fn run(pg: &ProcessGroup, streams: &Streams, plan: &Plan, n: usize) -> Result<(), CommError> {
    let dtype = plan.dtypes[0];
    let leader = pg.rank() == 0;
    if leader {
        println!(
            "# comm-bench --tasks {n}: all_reduce {dtype} sum on {} ranks, {} direct streams; time per op, max over \
             ranks: one stream alone, then {n} threads on streams 0..{n} at once (their ops together)",
            pg.world_size(),
            streams.direct()
        );
        println!("#    size(B)    one(us)  {n:>3}x(us)  rate {n}x/one");
    }
    let lanes: Vec<ProcessGroup> = (0..n as u64).map(|k| streams.stream(k)).collect();
    for &size in &plan.sizes {
        let input = HostBuffer::zeroed(dtype, (size / dtype.size()).max(1));
        let per = (plan.iters_for(size) / SLICES).max(n);
        time(&lanes, &input, plan.warmup_for(per).max(n))?;
        let (mut one, mut many) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..SLICES {
            pg.barrier().await?;
            one += time(&lanes[..1], &input, per)?;
            pg.barrier().await?;
            many += time(&lanes, &input, per)?;
        }
        let t = HostBuffer::from_slice(&[one.as_secs_f64(), many.as_secs_f64()]);
        let t = pg.all_reduce(t, ReduceOp::Max).await?.to_vec::<f64>()?;
        let ops = (per * SLICES) as f64;
        let (one_us, many_us) = (t[0] / ops * 1e6, t[1] / ops * 1e6);
        if leader {
            println!("{:>12} {one_us:>10.2} {many_us:>10.2} {:>14.2}", input.byte_len(), one_us / many_us);
        }
    }
    Ok(())
}

/// Runs `ops` all_reduces spread over `lanes`, each lane on a thread of its own, all at once
/// (every rank gives each lane the same share); returns the wall time.
fn time(lanes: &[ProcessGroup], input: &HostBuffer, ops: usize) -> Result<Duration, CommError> {
    let start = Instant::now();
    std::thread::scope(|s| {
        let threads: Vec<_> = lanes
            .iter()
            .enumerate()
            .map(|(i, lane)| {
                let share = ops / lanes.len() + usize::from(i < ops % lanes.len());
                s.spawn(move || {
                    let mut buf = input.clone();
                    for _ in 0..share {
                        buf = lane.all_reduce(buf, ReduceOp::Sum).wait()?;
                    }
                    Ok::<(), CommError>(())
                })
            })
            .collect();
        threads
            .into_iter()
            .try_for_each(|t| t.join().unwrap_or_else(|_| Err(CommError::Shutdown("a bench thread panicked".into()))))
    })?;
    Ok(start.elapsed())
}
