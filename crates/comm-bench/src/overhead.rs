//! `--profile-overhead`: the same ops with profiling off and on, in one run.
//!
//! Three ways of running each row, on the same backend, interleaved round by round (the order
//! rotates so drift hits every mode alike):
//! - `off`: the plain group, no profiling layer;
//! - `idle`: the profiling layer, but this thread's subscriber wants no spans (the cost of
//!   compiling profiling in and leaving it unobserved; measured while another subscriber
//!   exists in the process, so the callsites are in their "ask each time" state — an upper
//!   bound for a program that never installs one);
//! - `on`: the profiling layer with a `CommsLogger` subscriber recording every op.
//!
//! Each mode's time per op is the mean over the round's iterations, maximum over ranks; the
//! table shows the best round of each mode (interference from other processes only ever adds
//! time, so the minimum is the steadiest estimate on a shared machine), the difference to
//! `off`, and the medians. With one rank (`--np 1`) the op itself is local and short, so the
//! difference is the layer's own cost per op in absolute terms.

use std::sync::Arc;

use comm_api::profiling::{without_profiling, CommsConfig, CommsLogger, ProfilingLayer};
use comm_api::{CommError, HostBuffer, ProcessGroup, ReduceOp};
use tracing::Dispatch;
use tracing_subscriber::layer::SubscriberExt;

use crate::cases::{shape, Case};
use crate::{run_iters, sizes, Plan};

/// Rounds per row (each runs every mode once).
const ROUNDS: usize = 15;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Off,
    Idle,
    On,
}

const MODES: [Mode; 3] = [Mode::Off, Mode::Idle, Mode::On];

/// One measured row, for printing.
struct Measured {
    label: String,
    iters: usize,
    /// Best round's µs per op of off, idle, on.
    best_us: [f64; 3],
    /// Median round's µs per op of off, idle, on.
    median_us: [f64; 3],
}

pub(crate) async fn run(pg: &ProcessGroup, plan: &Plan) -> Result<(), CommError> {
    let (rank, n) = (pg.rank(), pg.world_size());
    let profiled = ProcessGroup::from_backend(
        Arc::new(ProfilingLayer::new().layer(pg.backend().clone())),
        pg.world_info().clone(),
    );
    let logger = CommsLogger::new(CommsConfig::default());
    let on = Dispatch::new(tracing_subscriber::registry().with(logger.clone()));
    // A registered subscriber that wants nothing. (`Dispatch::none()` is not registered: with
    // `on` as the only registered dispatcher, tracing would cache each callsite's interest
    // from whichever default was current at its first use, and `idle` would switch `on` off.)
    let idle = Dispatch::new(tracing::subscriber::NoSubscriber::default());
    let leader = rank == 0;
    if leader {
        println!(
            "# profiling overhead: backend {}, {n} ranks; time per op in us (mean over the iterations, max over ranks), best of {ROUNDS} interleaved rounds (medians in brackets)",
            pg.backend_name()
        );
        println!("# off: no layer | idle: layer, no subscriber wants the spans | on: layer + CommsLogger");
    }
    let mut rows = Vec::new();
    for &coll in &plan.colls {
        for &dtype in &plan.dtypes {
            for &size in &plan.sizes {
                let Some(shape) = shape(coll, dtype, size, n) else { continue };
                let case = Case { coll, dtype, redop: plan.redop, root: plan.root, shape, rank, n };
                let template = case.input()?;
                let iters = plan.iters_for(case.shape.bytes);
                let warmup = plan.warmup_for(iters);
                let mut samples: [Vec<f64>; 3] = Default::default();
                for round in 0..ROUNDS {
                    for k in 0..MODES.len() {
                        let mode = MODES[(round + k) % MODES.len()];
                        let (group, dispatch) = match mode {
                            Mode::Off => (pg, &idle),
                            Mode::Idle => (&profiled, &idle),
                            Mode::On => (&profiled, &on),
                        };
                        let mut slot =
                            Some(if case.coll.in_place() { template.clone() } else { case.sentinel_output()? });
                        let _scope = tracing::dispatcher::set_default(dispatch);
                        if round == 0 {
                            run_iters(group, &case, warmup, &template, &mut slot).await?;
                        }
                        let t = run_iters(group, &case, iters, &template, &mut slot).await?;
                        let mean = t.as_secs_f64() / iters as f64;
                        let max = without_profiling(|| pg.all_reduce(HostBuffer::from_slice(&[mean]), ReduceOp::Max));
                        samples[mode as usize].push(max.await?.to_vec::<f64>()?[0] * 1e6);
                    }
                }
                let sorted = samples.map(|mut v| {
                    v.sort_by(f64::total_cmp);
                    v
                });
                let m = Measured {
                    label: format!("{} {} {}", coll.name(), dtype.name(), sizes::format_size(case.shape.bytes)),
                    iters,
                    best_us: [0, 1, 2].map(|i| sorted[i][0]),
                    median_us: [0, 1, 2].map(|i| sorted[i][sorted[i].len() / 2]),
                };
                if leader {
                    println!("{}", format_row(&m));
                }
                rows.push(m);
            }
        }
    }
    if leader {
        println!(
            "# on: the CommsLogger recorded {} ops on rank 0 (every timed and warm-up op of the `on` rounds)",
            logger.operation_count()
        );
    }
    Ok(())
}

fn format_row(m: &Measured) -> String {
    let [off, idle, on] = m.best_us;
    let pct = |x: f64| if off > 0.0 { (x - off) / off * 100.0 } else { 0.0 };
    let [moff, midle, mon] = m.median_us;
    format!(
        "{:<22} iters {:>5}  off {:>9.3}  idle {:>9.3} ({:>+6.2}%)  on {:>9.3} ({:>+6.2}%)  [{moff:.3} / {midle:.3} / {mon:.3}]",
        m.label,
        m.iters,
        off,
        idle,
        pct(idle),
        on,
        pct(on)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_show_the_difference_to_off() {
        let m = Measured {
            label: "all_reduce f32 1KiB".into(),
            iters: 1000,
            best_us: [2.0, 2.01, 2.1],
            median_us: [2.5, 2.5, 2.75],
        };
        assert_eq!(
            format_row(&m),
            "all_reduce f32 1KiB    iters  1000  off     2.000  idle     2.010 ( +0.50%)  on     2.100 ( +5.00%)  [2.500 / 2.500 / 2.750]"
        );
    }
}
