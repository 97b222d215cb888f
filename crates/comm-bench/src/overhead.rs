//! `--profile-overhead`: the same ops with profiling off and on, in one run.
//!
//! Four ways of running each row, on the same backend:
//! - `off`: the plain group, no profiling layer;
//! - `idle`: the profiling layer, no subscriber wants the spans (the cost of compiling
//!   profiling in and leaving it unobserved);
//! - `on`: the profiling layer recording into a `CommsLogger` directly
//!   (`ProfilingLayer::with_logger`, default config: what `--profile` and `Builder::profiling`
//!   users get), no subscriber;
//! - `spans`: the profiling layer with a `CommsLogger` installed as a `tracing` subscriber
//!   layer, recording from the spans (every op timed).
//!
//! In two phases, because a registered subscriber that wants the spans changes what the others
//! cost (`tracing` then asks at every callsite instead of caching "never"): first `off`,
//! `idle` and `on` interleaved round by round for every row (the order rotates so drift hits
//! every mode alike), with no such subscriber in the process — as in a program that only
//! keeps the summary; then `off` and `spans` interleaved, once the subscriber exists.
//!
//! Each mode's time per op is the mean over the round's iterations, maximum over ranks. The
//! table shows the best round of `off` (interference from other processes only ever adds
//! time, so the minimum is the steadiest estimate on a shared machine) and, for each other
//! mode, its cost: the median over rounds of (mode − `off` of the same round). Pairing within
//! a round cancels the machine's slow drifts, and the median ignores rounds that another
//! process disturbed; the percentage is that cost over the best `off`. With one rank
//! (`--np 1`) the op itself is local and short, so the cost is the layer's own per op.

use std::sync::Arc;

use comm_api::profiling::{without_profiling, CommsConfig, CommsLogger, ProfilingLayer};
use comm_api::{CommError, HostBuffer, ProcessGroup, ReduceOp};
use tracing::Dispatch;
use tracing_subscriber::layer::SubscriberExt;

use crate::cases::{shape, Case};
use crate::{run_iters, sizes, Plan, Slot};

/// Rounds per row (each runs every mode once): many short rounds rather than a few long ones,
/// so the medians see through what other processes do to some of them. Small messages get
/// more: their rounds are short, and the cost measured is a few nanoseconds.
fn rounds(bytes: usize) -> usize {
    if bytes <= 64 << 10 {
        201
    } else {
        41
    }
}

/// One measured row, for printing.
struct Measured {
    label: String,
    iters: usize,
    /// Best round's µs per op of `off` in phase 1 and in phase 2.
    off_us: [f64; 2],
    /// Median over rounds of (mode − `off` of the round), µs per op: idle, on, spans.
    cost_us: [f64; 3],
}

/// Runs `case` through each of `modes` (group, subscriber; the first is the baseline),
/// interleaved for [`rounds`] rounds; returns the baseline's best round and, for every mode,
/// the median over rounds of its difference to the baseline's round.
async fn measure(
    pg: &ProcessGroup,
    case: &Case,
    plan: &Plan,
    modes: &[(&ProcessGroup, &Dispatch)],
) -> Result<(usize, f64, Vec<f64>), CommError> {
    let template = case.input()?;
    // Many short rounds (the median over rounds does the averaging): at most 1000 ops per
    // round unless --iters says otherwise.
    let iters = if plan.iters.is_some() {
        plan.iters_for(case.shape.bytes)
    } else {
        plan.iters_for(case.shape.bytes).min(1000)
    };
    let warmup = plan.warmup_for(iters);
    let mut samples = vec![Vec::new(); modes.len()];
    for round in 0..rounds(case.shape.bytes) {
        for k in 0..modes.len() {
            let m = (round + k) % modes.len();
            let (group, dispatch) = modes[m];
            let mut slot = Some(Slot::new(case, template.clone())?);
            let _scope = tracing::dispatcher::set_default(dispatch);
            if round == 0 {
                run_iters(group, case, warmup, &mut slot, None).await?;
            }
            let t = run_iters(group, case, iters, &mut slot, None).await?;
            let mean = t.as_secs_f64() / iters as f64;
            let max = without_profiling(|| pg.all_reduce(HostBuffer::from_slice(&[mean]), ReduceOp::Max));
            samples[m].push(max.await?.to_vec::<f64>()?[0] * 1e6);
        }
    }
    let best = samples[0].iter().copied().fold(f64::INFINITY, f64::min);
    let costs = samples.iter().map(|s| median(s.iter().zip(&samples[0]).map(|(x, base)| x - base).collect())).collect();
    Ok((iters, best, costs))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

pub(crate) async fn run(pg: &ProcessGroup, plan: &Plan) -> Result<(), CommError> {
    let (rank, n) = (pg.rank(), pg.world_size());
    let wrap = |layer: ProfilingLayer| {
        ProcessGroup::from_backend(Arc::new(layer.layer(pg.backend().clone())), pg.world_info().clone())
    };
    let profiled = wrap(ProfilingLayer::new());
    let direct = CommsLogger::new(CommsConfig::default());
    let logged = wrap(ProfilingLayer::new().with_logger(direct.clone()));
    // A registered subscriber that wants nothing, current in every round of phase 1 (and for
    // `off` in phase 2) so each mode runs under the same kind of dispatcher.
    let none = Dispatch::new(tracing::subscriber::NoSubscriber::default());
    let leader = rank == 0;
    if leader {
        println!(
            "# profiling overhead: backend {}, {n} ranks; time per op in us (mean over the iterations, max over ranks); {} interleaved rounds ({} from 64 KiB): off = the best round, the others = median over rounds of (mode - off of the same round)",
            pg.backend_name(),
            rounds(0),
            rounds((64 << 10) + 1)
        );
        println!("# off: no layer | idle: layer, no subscriber wants the spans | on: layer recording into a CommsLogger (with_logger, default sampling)");
        println!("# then, with a CommsLogger subscriber registered: off again | spans: layer + that subscriber");
    }
    let mut cases = Vec::new();
    for &coll in &plan.colls {
        for &dtype in &plan.dtypes {
            for &size in &plan.sizes {
                let Some(shape) = shape(coll, dtype, size, n) else { continue };
                cases.push(Case { coll, dtype, redop: plan.redop, root: plan.root, shape, rank, n });
            }
        }
    }
    let mut rows = Vec::new();
    for case in &cases {
        let (iters, off, cost) = measure(pg, case, plan, &[(pg, &none), (&profiled, &none), (&logged, &none)]).await?;
        rows.push(Measured {
            label: format!("{} {} {}", case.coll.name(), case.dtype.name(), sizes::format_size(case.shape.bytes)),
            iters,
            off_us: [off, 0.0],
            cost_us: [cost[1], cost[2], 0.0],
        });
    }
    let logger = CommsLogger::new(CommsConfig::default());
    let spans = Dispatch::new(tracing_subscriber::registry().with(logger.clone()));
    for (case, row) in cases.iter().zip(&mut rows) {
        let (_, off, cost) = measure(pg, case, plan, &[(pg, &none), (&profiled, &spans)]).await?;
        row.off_us[1] = off;
        row.cost_us[2] = cost[1];
    }
    if leader {
        for row in &rows {
            println!("{}", format_row(row));
        }
        println!(
            "# the loggers recorded {} (on) and {} (spans) ops on rank 0: every timed and warm-up op of their rounds",
            direct.operation_count(),
            logger.operation_count()
        );
    }
    Ok(())
}

fn format_row(m: &Measured) -> String {
    let [off, off2] = m.off_us;
    let [idle, on, spans] = m.cost_us;
    let pct = |x: f64, base: f64| if base > 0.0 { x / base * 100.0 } else { 0.0 };
    format!(
        "{:<22} iters {:>5}  off {:>9.3}  idle {:>+8.3} ({:>+6.2}%)  on {:>+8.3} ({:>+6.2}%)  | off {:>9.3}  spans {:>+8.3} ({:>+6.2}%)",
        m.label,
        m.iters,
        off,
        idle,
        pct(idle, off),
        on,
        pct(on, off),
        off2,
        spans,
        pct(spans, off2)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_show_the_cost_over_off() {
        let m = Measured {
            label: "all_reduce f32 1KiB".into(),
            iters: 1000,
            off_us: [2.0, 2.5],
            cost_us: [0.01, 0.1, -0.5],
        };
        assert_eq!(
            format_row(&m),
            "all_reduce f32 1KiB    iters  1000  off     2.000  idle   +0.010 ( +0.50%)  on   +0.100 ( +5.00%)  | off     2.500  spans   -0.500 (-20.00%)"
        );
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
