//! The summary's data (serde) and table, and the cross-rank straggler view.

use std::collections::HashMap;
use std::fmt;

use comm_core::ops::{AllGather, AllReduce};
use comm_core::{Collective, CommError, HostBuffer, ReduceOp};
use serde::{Deserialize, Serialize};

use crate::bandwidth::{bandwidth, human_size};
use crate::logger::{Key, Stats};
use crate::{without_profiling, CommsLogger};

/// Everything [`CommsLogger::log_summary`] prints, as data (DeepSpeed's `return_dict`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// The process's global rank, as its op spans report it (`None` before any op).
    pub rank: Option<u32>,
    /// One row per op, caller, group size and message size, sorted in that order.
    pub rows: Vec<Row>,
    /// The per-rank view, from [`CommsLogger::log_summary_with_stragglers`].
    pub stragglers: Option<Stragglers>,
}

/// One (op, caller, group size, message size) of the summary. Latencies in microseconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// Op name (`"all_reduce"`).
    pub op: String,
    /// The span the op was submitted in (with `debug`).
    pub caller: Option<String>,
    /// Message size: [`Op::bytes`](comm_core::Op::bytes), what this rank handed in.
    pub bytes: u64,
    /// `bytes`, human-readable (base 1024).
    pub size: String,
    /// Ranks in the group the op ran on (the `n` of the bandwidth formulas).
    pub group_size: u32,
    /// Ops that succeeded.
    pub count: u64,
    /// Of those, the ones timed: the latency columns are over these. All of them unless
    /// the logger samples small messages ([`CommsConfig::sample_every`](crate::CommsConfig::sample_every)).
    pub timed: u64,
    /// Ops that failed (not in the latency columns).
    pub errors: u64,
    /// Ops whose `Work` was dropped before they completed (measured to their completion).
    pub detached: u64,
    /// Sum of latencies (when only some calls were timed: `avg_us × count`).
    pub total_us: f64,
    /// Mean latency.
    pub avg_us: f64,
    /// Fastest call.
    pub min_us: f64,
    /// Median call (nearest rank: the ⌈count/2⌉-th fastest).
    pub p50_us: f64,
    /// Slowest call.
    pub max_us: f64,
    /// nccl-tests algbw at the mean latency, GB/s (10^9 B/s); `None` without bandwidth.
    pub algbw_gbps: Option<f64>,
    /// nccl-tests busbw at the mean latency, GB/s.
    pub busbw_gbps: Option<f64>,
}

/// The straggler view: per-call latencies of every rank, compared call by call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stragglers {
    /// Ranks in the group the data was gathered over.
    pub ranks: u32,
    /// This process's rank in that group.
    pub group_rank: u32,
    /// One row per key recorded on every rank.
    pub rows: Vec<StragglerRow>,
    /// Keys not recorded on every rank (e.g. ops of a sub-group), left out.
    pub skipped: Vec<String>,
}

/// Per-call comparison across ranks for one key. For call `i`, `min_i` is the fastest rank's
/// latency — the op's own cost, everyone was there — and `own_i − min_i` is the time this
/// rank spent waiting for the others (DeepSpeed's "straggler effect"). Microseconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StragglerRow {
    /// Op name.
    pub op: String,
    /// Caller span (with `debug`).
    pub caller: Option<String>,
    /// Message size in bytes.
    pub bytes: u64,
    /// `bytes`, human-readable.
    pub size: String,
    /// Ranks in the group the op ran on.
    pub group_size: u32,
    /// Calls compared: the fewest any rank recorded (the first ones on every rank).
    pub count: u64,
    /// Whether ranks recorded different counts for this key.
    pub counts_differ: bool,
    /// Σ min_i: the communication itself.
    pub total_min_us: f64,
    /// Σ own_i: this rank's total.
    pub total_own_us: f64,
    /// Σ max_i: the slowest rank of each call.
    pub total_max_us: f64,
    /// Σ (own_i − min_i): this rank's wait for stragglers.
    pub total_straggler_us: f64,
    /// Σ min_i / count.
    pub avg_min_us: f64,
    /// Σ (own_i − min_i) / count.
    pub avg_straggler_us: f64,
    /// The rank with the smallest total over these calls.
    pub fastest_rank: u32,
    /// The rank with the largest total over these calls.
    pub slowest_rank: u32,
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1e3
}

impl Row {
    pub(crate) fn new(k: &Key, s: &Stats) -> Row {
        let timed = s.samples_ns.len() as u64;
        let sum: u64 = s.samples_ns.iter().sum();
        let mut sorted = s.samples_ns.clone();
        sorted.sort_unstable();
        let at = |i: usize| sorted.get(i).copied().map_or(0.0, us);
        let avg_ns = if timed == 0 { 0.0 } else { sum as f64 / timed as f64 };
        let total_ns = if timed == s.count { sum as f64 } else { avg_ns * s.count as f64 };
        let bw = bandwidth(k.op, k.bytes, k.group_size, avg_ns);
        Row {
            op: k.op.to_owned(),
            caller: k.caller.map(str::to_owned),
            bytes: k.bytes,
            size: human_size(k.bytes),
            group_size: k.group_size,
            count: s.count,
            timed,
            errors: s.errors,
            detached: s.detached,
            total_us: total_ns / 1e3,
            avg_us: avg_ns / 1e3,
            min_us: at(0),
            p50_us: at(sorted.len().div_ceil(2).saturating_sub(1)),
            max_us: at(sorted.len().saturating_sub(1)),
            algbw_gbps: bw.map(|b| b.0),
            busbw_gbps: bw.map(|b| b.1),
        }
    }
}

/// A text table: the first `left` columns (text) left-aligned, numbers right-aligned, columns as wide as their widest
/// cell, the op name only on the first row of its group (DeepSpeed's layout).
struct Table {
    headers: Vec<&'static str>,
    left: usize,
    rows: Vec<Vec<String>>,
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let line = |f: &mut fmt::Formatter<'_>, cells: &mut dyn Iterator<Item = &str>| -> fmt::Result {
            let mut out = String::new();
            for (i, (cell, w)) in cells.zip(&widths).enumerate() {
                if i > 0 {
                    out.push_str("  ");
                }
                if i < self.left {
                    out.push_str(&format!("{cell:<w$}"));
                } else {
                    out.push_str(&format!("{cell:>w$}"));
                }
            }
            writeln!(f, "{}", out.trim_end())
        };
        line(f, &mut self.headers.iter().copied())?;
        for row in &self.rows {
            line(f, &mut row.iter().map(String::as_str))?;
        }
        Ok(())
    }
}

fn op_label(op: &str, caller: Option<&str>) -> String {
    match caller {
        Some(c) => format!("{op} [in {c}]"),
        None => op.to_owned(),
    }
}

fn opt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.2}"))
}

impl fmt::Display for Summary {
    /// The aligned table (and the straggler table when present).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rank = self.rank.map_or_else(|| "?".to_owned(), |r| r.to_string());
        writeln!(f, "# comms summary (rank {rank}); latency in us, bandwidth in GB/s (10^9 B/s, nccl-tests)")?;
        // Latency columns over the timed calls: say how many when the logger sampled.
        let sampled = self.rows.iter().any(|r| r.timed != r.count);
        let mut last = None;
        let rows = self
            .rows
            .iter()
            .map(|r| {
                let label = op_label(&r.op, r.caller.as_deref());
                let first = last.as_ref() != Some(&label);
                last = Some(label.clone());
                vec![
                    if first { label } else { String::new() },
                    r.size.clone(),
                    r.group_size.to_string(),
                    if sampled { format!("{} ({} timed)", r.count, r.timed) } else { r.count.to_string() },
                    r.errors.to_string(),
                    format!("{:.2}", r.total_us),
                    format!("{:.2}", r.avg_us),
                    format!("{:.2}", r.min_us),
                    format!("{:.2}", r.p50_us),
                    format!("{:.2}", r.max_us),
                    opt(r.algbw_gbps),
                    opt(r.busbw_gbps),
                ]
            })
            .collect();
        let table = Table {
            headers: vec![
                "op", "size", "ranks", "count", "errors", "total", "avg", "min", "p50", "max", "algbw", "busbw",
            ],
            left: 2,
            rows,
        };
        write!(f, "{table}")?;
        if let Some(s) = &self.stragglers {
            writeln!(
                f,
                "# straggler view over {} ranks (this is group rank {}): min = fastest rank per call (the op itself), straggler = own - min (waiting for others)",
                s.ranks, s.group_rank
            )?;
            let mut last = None;
            let rows = s
                .rows
                .iter()
                .map(|r| {
                    let label = op_label(&r.op, r.caller.as_deref());
                    let first = last.as_ref() != Some(&label);
                    last = Some(label.clone());
                    vec![
                        if first { label } else { String::new() },
                        r.size.clone(),
                        format!("{}{}", r.count, if r.counts_differ { "*" } else { "" }),
                        format!("{:.2}", r.total_min_us),
                        format!("{:.2}", r.total_straggler_us),
                        format!("{:.2}", r.avg_min_us),
                        format!("{:.2}", r.avg_straggler_us),
                        format!("{:.2}", r.total_max_us),
                        r.fastest_rank.to_string(),
                        r.slowest_rank.to_string(),
                    ]
                })
                .collect();
            let table = Table {
                headers: vec![
                    "op",
                    "size",
                    "count",
                    "total min",
                    "total straggler",
                    "avg min",
                    "avg straggler",
                    "total max",
                    "fastest",
                    "slowest",
                ],
                left: 2,
                rows,
            };
            write!(f, "{table}")?;
            if s.rows.iter().any(|r| r.counts_differ) {
                writeln!(f, "# * ranks recorded different counts; the first `count` calls are compared")?;
            }
            for k in &s.skipped {
                writeln!(f, "# skipped (not recorded on every rank): {k}")?;
            }
        }
        Ok(())
    }
}

/// A key as one line of text, identical on every rank (tabs and newlines in names replaced).
fn ident(k: &Key) -> String {
    let clean = |s: &str| s.replace(['\t', '\n', '\0'], " ");
    format!("{}\t{}\t{}\t{}", clean(k.op), k.caller.map(clean).unwrap_or_default(), k.group_size, k.bytes)
}

/// `(op, caller, group_size, bytes)` back from [`ident`].
fn parse_ident(id: &str) -> Option<(String, Option<String>, u32, u64)> {
    let mut it = id.split('\t');
    let op = it.next()?.to_owned();
    let caller = Some(it.next()?).filter(|c| !c.is_empty()).map(str::to_owned);
    let group_size = it.next()?.parse().ok()?;
    let bytes = it.next()?.parse().ok()?;
    Some((op, caller, group_size, bytes))
}

/// One rank's list: `ident \t count` lines.
fn parse_list(text: &str) -> Vec<(&str, usize)> {
    text.lines().filter_map(|l| l.rsplit_once('\t').and_then(|(id, n)| Some((id, n.parse().ok()?)))).collect()
}

impl CommsLogger {
    /// The summary of what was recorded on this process, without printing.
    pub fn summary(&self) -> Summary {
        let rows = self.rows().iter().map(|(k, s)| Row::new(k, s)).collect();
        Summary { rank: self.recorded_rank(), rows, stragglers: None }
    }

    /// Prints this process's summary table to standard output and returns it (DeepSpeed's
    /// `log_summary(return_dict=True)`; the data is `serde`-serializable). For the
    /// per-rank straggler view see [`log_summary_with_stragglers`](Self::log_summary_with_stragglers).
    pub fn log_summary(&self) -> Summary {
        let s = self.summary();
        println!("{s}");
        s
    }

    /// [`summary`](Self::summary) plus the straggler view over `group`, without printing.
    ///
    /// **Collective**: every rank of `group` must call it (like DeepSpeed's
    /// `log_summary(show_straggler=True)`). Unlike DeepSpeed it works when ranks recorded
    /// different keys or counts (it exchanges the key lists first and compares the common
    /// part, listing the rest), and its own exchanges are not profiled. Three ops: an
    /// all_reduce of the list length, an all_gather of the lists, an all_gather of the
    /// latencies.
    pub async fn summary_with_stragglers<G>(&self, group: &G) -> Result<Summary, CommError>
    where
        G: Collective<AllGather> + Collective<AllReduce> + ?Sized,
    {
        let mut summary = self.summary();
        // In key order (op, caller, group size, bytes), which rank 0's list then gives everyone.
        let ordered: Vec<(String, Vec<u64>)> =
            { self.rows().into_iter().map(|(k, s)| (ident(&k), s.samples_ns)).collect() };
        let text: String = ordered.iter().map(|(id, s)| format!("{id}\t{}\n", s.len())).collect();
        let local: HashMap<String, Vec<u64>> = ordered.into_iter().collect();
        let n = group.world_size() as usize;
        let me = group.rank() as usize;

        let len = HostBuffer::from_slice(&[text.len() as i64]);
        let max = without_profiling(|| group.submit(AllReduce { buf: len, op: ReduceOp::Max })).await?;
        let max = max.to_vec::<i64>()?[0].max(0) as usize;
        let mut padded = text.into_bytes();
        padded.resize(max, 0);
        let lists =
            without_profiling(|| group.submit(AllGather { input: HostBuffer::from_slice(&padded), output: None }))
                .await?
                .output;
        let lists: Vec<Vec<(&str, usize)>> = (0..n)
            .map(|r| {
                let raw = &lists.as_bytes()[r * max..(r + 1) * max];
                let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
                std::str::from_utf8(&raw[..end]).map(parse_list).map_err(|_| {
                    CommError::invalid("log_summary", format!("rank {r} sent a key list that is not UTF-8"))
                })
            })
            .collect::<Result<_, _>>()?;
        let counts: Vec<HashMap<&str, usize>> = lists.iter().map(|l| l.iter().copied().collect()).collect();

        // Keys every rank recorded, in rank 0's order (the same on every rank).
        let mut common = Vec::new();
        for &(id, _) in &lists[0] {
            let per_rank: Option<Vec<usize>> = counts.iter().map(|c| c.get(id).copied()).collect();
            if let Some(per_rank) = per_rank {
                let m = per_rank.iter().copied().min().unwrap_or(0);
                common.push((id, m, per_rank.iter().any(|&c| c != m)));
            }
        }
        let mut skipped: Vec<String> = lists
            .iter()
            .flatten()
            .map(|(id, _)| *id)
            .filter(|id| !common.iter().any(|c| c.0 == *id))
            .map(|id| {
                let have = counts.iter().filter(|c| c.contains_key(id)).count();
                match parse_ident(id) {
                    Some((op, caller, g, b)) => format!(
                        "{} {} on {g} ranks (recorded on {have} of {n} ranks)",
                        op_label(&op, caller.as_deref()),
                        human_size(b)
                    ),
                    None => id.to_owned(),
                }
            })
            .collect();
        skipped.sort();
        skipped.dedup();

        let mine: Vec<f64> = common.iter().flat_map(|&(id, m, _)| local[id][..m].iter().map(|&ns| ns as f64)).collect();
        let total = mine.len();
        // `total` is the same on every rank (same keys, same m), so all skip or none does.
        let all = if total == 0 {
            Vec::new()
        } else {
            without_profiling(|| group.submit(AllGather { input: HostBuffer::from_slice(&mine), output: None }))
                .await?
                .output
                .to_vec::<f64>()?
        };

        let mut rows = Vec::new();
        let mut at = 0;
        for &(id, m, counts_differ) in &common {
            let (op, caller, group_size, bytes) =
                parse_ident(id).ok_or_else(|| CommError::invalid("log_summary", format!("bad key `{id}`")))?;
            let (mut tmin, mut town, mut tmax) = (0.0, 0.0, 0.0);
            let mut per_rank = vec![0.0; n];
            for i in 0..m {
                let call = |r: usize| all[r * total + at + i];
                let (lo, hi) = (0..n).map(call).fold((f64::INFINITY, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
                tmin += lo;
                tmax += hi;
                town += call(me);
                for (r, t) in per_rank.iter_mut().enumerate() {
                    *t += call(r);
                }
            }
            at += m;
            let argby = |better: fn(f64, f64) -> bool| {
                (0..n).fold(0, |best, r| if better(per_rank[r], per_rank[best]) { r } else { best }) as u32
            };
            let per = |v: f64| if m == 0 { 0.0 } else { v / m as f64 / 1e3 };
            rows.push(StragglerRow {
                op,
                caller,
                bytes,
                size: human_size(bytes),
                group_size,
                count: m as u64,
                counts_differ,
                total_min_us: tmin / 1e3,
                total_own_us: town / 1e3,
                total_max_us: tmax / 1e3,
                total_straggler_us: (town - tmin) / 1e3,
                avg_min_us: per(tmin),
                avg_straggler_us: per(town - tmin),
                fastest_rank: argby(|a, b| a < b),
                slowest_rank: argby(|a, b| a > b),
            });
        }
        summary.stragglers = Some(Stragglers { ranks: n as u32, group_rank: me as u32, rows, skipped });
        Ok(summary)
    }

    /// [`summary_with_stragglers`](Self::summary_with_stragglers), printed on group rank 0
    /// (DeepSpeed's `log_summary(show_straggler=True)`); every rank gets the data.
    ///
    /// **Collective**: every rank of `group` calls it. Called on some ranks only, it fails after
    /// the group's timeout with the backend's error naming a rank that did not join.
    pub async fn log_summary_with_stragglers<G>(&self, group: &G) -> Result<Summary, CommError>
    where
        G: Collective<AllGather> + Collective<AllReduce> + ?Sized,
    {
        let s = self.summary_with_stragglers(group).await?;
        if group.rank() == 0 {
            println!("{s}");
        }
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_human() {
        assert_eq!(human_size(0), "0 B");
        assert_eq!(human_size(1023), "1023 B");
        assert_eq!(human_size(1024), "1.00 KiB");
        assert_eq!(human_size(1536), "1.50 KiB");
        assert_eq!(human_size(64 << 20), "64.00 MiB");
        assert_eq!(human_size(3 << 30), "3.00 GiB");
    }

    #[test]
    fn rows_compute_exact_statistics() {
        let k = Key { op: "all_reduce", caller: None, group_size: 4, bytes: 1_000_000 };
        let s = Stats { count: 4, samples_ns: vec![4_000, 1_000, 3_000, 2_000], errors: 1, detached: 2 };
        let r = Row::new(&k, &s);
        assert_eq!((r.count, r.timed, r.errors, r.detached), (4, 4, 1, 2));
        assert_eq!((r.total_us, r.avg_us, r.min_us, r.p50_us, r.max_us), (10.0, 2.5, 1.0, 2.0, 4.0));
        // 1 MB in 2.5 us = 400 GB/s; busbw × 2(4-1)/4 = 600.
        assert_eq!(r.algbw_gbps, Some(400.0));
        assert_eq!(r.busbw_gbps, Some(600.0));
        let odd = Row::new(&k, &Stats { count: 3, samples_ns: vec![5_000, 1_000, 3_000], ..Stats::default() });
        assert_eq!(odd.p50_us, 3.0);
        // Sampled: the latency columns over the timed calls, the total estimated over all.
        let sampled = Row::new(&k, &Stats { count: 10, samples_ns: vec![5_000, 1_000, 3_000], ..Stats::default() });
        assert_eq!((sampled.count, sampled.timed, sampled.avg_us, sampled.total_us), (10, 3, 3.0, 30.0));
        let none = Row::new(&k, &Stats { errors: 3, ..Stats::default() });
        assert_eq!((none.count, none.avg_us, none.algbw_gbps), (0, 0.0, None));
    }

    #[test]
    fn idents_round_trip() {
        let k = Key { op: "send", caller: Some("step\tone"), group_size: 2, bytes: 8 };
        let id = ident(&k);
        assert_eq!(parse_ident(&id), Some(("send".into(), Some("step one".into()), 2, 8)));
        assert_eq!(parse_list(&format!("{id}\t3\n")), [(id.as_str(), 3)]);
    }
}
