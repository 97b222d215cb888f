//! `comm-bench compare`: saved reports side by side, one column group per backend, with the
//! time ratio of each backend to the first. A backend may come with several reports (rounds of
//! the same run, interleaved with the other backends' by `cargo xtask bench --rounds N`): each
//! row then shows the median round and the spread (slowest / fastest round), so a machine that
//! changed speed during the run shows up as spread instead of as a false ratio, and a second
//! ratio of the fastest rounds (a slow period that caught most of one backend's rounds of a row
//! moves the median, but rarely every round).

use std::fmt::Write as _;
use std::path::PathBuf;

use clap::Args;

use crate::saved::{SavedReport, SavedRow};

#[derive(Args, Debug)]
pub(crate) struct CompareArgs {
    /// `BACKEND=REPORT[,REPORT...]`: a label and its JSON report(s), one per round; the first
    /// is the reference of the ratio columns.
    #[arg(required = true, value_name = "BACKEND=REPORTS")]
    pub(crate) series: Vec<String>,
}

/// One backend's rounds of one row.
struct Cell {
    /// The median round's row (the upper median for an even count).
    median: SavedRow,
    /// Slowest round's time over the fastest's.
    spread: f64,
    /// The fastest round's time.
    best: f64,
    wrong: u64,
}

type Key = (String, String, u64);

/// The rows of one backend, merged over its rounds, in the first round's order.
fn merge(rounds: &[SavedReport]) -> Vec<(Key, Cell)> {
    let Some(first) = rounds.first() else { return Vec::new() };
    first
        .rows
        .iter()
        .map(|r| {
            let key = (r.op.clone(), r.dtype.clone(), r.bytes);
            let mut all: Vec<&SavedRow> = rounds
                .iter()
                .filter_map(|rep| rep.rows.iter().find(|o| o.op == r.op && o.dtype == r.dtype && o.bytes == r.bytes))
                .collect();
            all.sort_by(|a, b| a.time_us.total_cmp(&b.time_us));
            let (fast, slow) = (all[0].time_us, all[all.len() - 1].time_us);
            let cell = Cell {
                median: all[all.len() / 2].clone(),
                spread: if fast > 0.0 { slow / fast } else { 1.0 },
                best: fast,
                wrong: all.iter().filter_map(|o| o.wrong).sum(),
            };
            (key, cell)
        })
        .collect()
}

fn num(x: f64) -> String {
    if x >= 1e6 {
        format!("{x:.3e}")
    } else {
        format!("{x:.2}")
    }
}

/// The side-by-side table of `series` (label, rounds).
pub(crate) fn table(series: &[(String, Vec<SavedReport>)]) -> String {
    let mut s = String::new();
    let Some((base, base_rounds)) = series.first() else { return s };
    let rounds = series.iter().map(|(_, r)| r.len()).max().unwrap_or(1);
    let np = base_rounds.iter().flat_map(|r| r.rows.first()).map(|r| r.np).next().unwrap_or(0);
    let merged: Vec<(&str, Vec<(Key, Cell)>)> = series.iter().map(|(b, r)| (b.as_str(), merge(r))).collect();
    let _ =
        writeln!(s, "# side by side, {np} ranks: time(us) = mean wall time per op (max over ranks), busbw in GB/s;");
    if rounds > 1 {
        let _ = writeln!(
            s,
            "# {rounds} interleaved rounds: each cell is the median round, `spread` its slowest / fastest round"
        );
    }
    let other = series.get(1).map_or("x", |x| x.0.as_str());
    let _ = writeln!(s, "# {other}/{base} = time({other}) / time({base}): above 1, {base} is faster");
    if rounds > 1 {
        let _ = writeln!(s, "# `best`: the same ratio of each backend's fastest round");
    }
    let mut head = format!("#{:>13} {:>6} {:>12}", "op", "type", "size(B)");
    for (b, _) in series {
        let _ = write!(head, " | {:>11} {:>9}", format!("{b} time"), format!("{b} bw"));
        if rounds > 1 {
            let _ = write!(head, " {:>6}", "spread");
        }
    }
    for (b, _) in &series[1..] {
        let _ = write!(head, " | {:>9}", format!("{b}/{base}"));
        if rounds > 1 {
            let _ = write!(head, " {:>5}", "best");
        }
    }
    let _ = writeln!(s, "{head}");
    let mut wrong = 0;
    for (key, _) in &merged[0].1 {
        let mut line = format!("{:>14} {:>6} {:>12}", key.0, key.1, key.2);
        let mut times = Vec::new();
        for (_, rows) in &merged {
            match rows.iter().find(|(k, _)| k == key) {
                Some((_, c)) => {
                    wrong += c.wrong;
                    let _ = write!(line, " | {:>11} {:>9}", num(c.median.time_us), num(c.median.busbw_gbps));
                    if rounds > 1 {
                        let _ = write!(line, " {:>6.2}", c.spread);
                    }
                    times.push(Some((c.median.time_us, c.best)));
                }
                None => {
                    let _ = write!(line, " | {:>11} {:>9}", "-", "-");
                    if rounds > 1 {
                        let _ = write!(line, " {:>6}", "-");
                    }
                    times.push(None);
                }
            }
        }
        for t in &times[1..] {
            let ratio = |f: fn((f64, f64)) -> f64| match (times[0], t) {
                (Some(a), Some(b)) if f(a) > 0.0 => format!("{:.2}", f(*b) / f(a)),
                _ => "-".to_owned(),
            };
            let _ = write!(line, " | {:>9}", ratio(|t| t.0));
            if rounds > 1 {
                let _ = write!(line, " {:>5}", ratio(|t| t.1));
            }
        }
        let _ = writeln!(s, "{line}");
    }
    let _ = writeln!(s, "# wrong elements over all backends and rounds: {wrong}");
    s
}

/// The rank count of a report (its rows', else the document's; 0 when unknown).
fn np_of(r: &SavedReport) -> u32 {
    r.rows.first().map(|x| x.np).filter(|&n| n > 0).or(r.np).unwrap_or(0)
}

/// The scaling table of `series` (label, reports of several rank counts, each count perhaps
/// in several rounds): per backend, each row's median time and busbw at every rank count, and
/// two ratios of the largest count to the smallest — busbw (below 1: it falls as ranks are
/// added) and time.
pub(crate) fn scaling(series: &[(String, Vec<SavedReport>)]) -> String {
    let mut s = String::new();
    let mut nps: Vec<u32> = series.iter().flat_map(|(_, r)| r.iter().map(np_of)).collect();
    nps.sort_unstable();
    nps.dedup();
    let (Some(&lo), Some(&hi)) = (nps.first(), nps.last()) else { return s };
    let _ = writeln!(
        s,
        "# scaling over {} ranks: time(us) and busbw (GB/s) per rank count, each the median round;",
        nps.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
    );
    let _ = writeln!(s, "# bw {hi}/{lo} = busbw at {hi} ranks / at {lo}; t {hi}/{lo} = time at {hi} ranks / at {lo}");
    for (label, reports) in series {
        let per_np: Vec<Vec<(Key, Cell)>> = nps
            .iter()
            .map(|&n| merge(&reports.iter().filter(|r| np_of(r) == n).cloned().collect::<Vec<_>>()))
            .collect();
        let mut keys: Vec<&Key> = Vec::new();
        for k in per_np.iter().flatten().map(|(k, _)| k) {
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
        let mut head = format!("# {label}\n#{:>13} {:>6} {:>12}", "op", "type", "size(B)");
        for n in &nps {
            let _ = write!(head, " | {:>11} {:>9}", format!("np{n} time"), "bw");
        }
        let _ = write!(head, " | {:>9} {:>9}", format!("bw {hi}/{lo}"), format!("t {hi}/{lo}"));
        let _ = writeln!(s, "{head}");
        for key in keys {
            let mut line = format!("{:>14} {:>6} {:>12}", key.0, key.1, key.2);
            let cells: Vec<Option<&SavedRow>> =
                per_np.iter().map(|rows| rows.iter().find(|(k, _)| k == key).map(|(_, c)| &c.median)).collect();
            for c in &cells {
                match c {
                    Some(r) => write!(line, " | {:>11} {:>9}", num(r.time_us), num(r.busbw_gbps)),
                    None => write!(line, " | {:>11} {:>9}", "-", "-"),
                }
                .ok();
            }
            let ratio = |f: fn(&SavedRow) -> f64| match (cells[0], cells[cells.len() - 1]) {
                (Some(a), Some(b)) if f(a) > 0.0 => format!("{:.2}", f(b) / f(a)),
                _ => "-".to_owned(),
            };
            let _ = writeln!(line, " | {:>9} {:>9}", ratio(|r| r.busbw_gbps), ratio(|r| r.time_us));
            s.push_str(&line);
        }
    }
    s
}

/// `BACKEND=REPORT[,REPORT...]` arguments, loaded.
fn load_series(specs: &[String]) -> Result<Vec<(String, Vec<SavedReport>)>, String> {
    let mut series = Vec::new();
    for spec in specs {
        let (label, paths) =
            spec.split_once('=').ok_or_else(|| format!("`{spec}`: expected BACKEND=REPORT[,REPORT...]"))?;
        let rounds = paths
            .split(',')
            .filter(|p| !p.is_empty())
            .map(|p| SavedReport::load(&PathBuf::from(p)))
            .collect::<Result<Vec<_>, _>>()?;
        if rounds.is_empty() {
            return Err(format!("`{spec}`: no report"));
        }
        series.push((label.to_owned(), rounds));
    }
    Ok(series)
}

/// Runs `comm-bench compare`.
pub(crate) fn main(args: &CompareArgs) -> Result<(), String> {
    print!("{}", table(&load_series(&args.series)?));
    Ok(())
}

/// Runs `comm-bench scaling`.
pub(crate) fn main_scaling(args: &CompareArgs) -> Result<(), String> {
    print!("{}", scaling(&load_series(&args.series)?));
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn report(backend: &str, rows: &[(u64, f64)]) -> SavedReport {
        let rows: Vec<String> = rows
            .iter()
            .map(|(b, t)| {
                format!(
                    r#"{{"op":"all_reduce","dtype":"f32","bytes":{b},"busbw_gbps":{},"time_us":{t},"wrong":0}}"#,
                    *b as f64 / t / 1e3
                )
            })
            .collect();
        let text = format!(r#"{{"backend":"{backend}","np":2,"rows":[{}]}}"#, rows.join(","));
        SavedReport::parse(&text, Path::new("x.json")).unwrap()
    }

    #[test]
    fn one_round_each_gives_the_ratio() {
        let t = table(&[
            ("shm".into(), vec![report("shm", &[(8, 1.0), (1024, 2.0)])]),
            ("mpi-raw".into(), vec![report("mpi-raw", &[(8, 0.5), (1024, 4.0)])]),
        ]);
        assert!(t.contains("mpi-raw/shm"), "{t}");
        assert!(!t.contains("spread"), "{t}");
        let line = t.lines().find(|l| l.contains(" 1024 ")).unwrap();
        assert!(line.trim_end().ends_with("2.00"), "{line}");
        let line = t.lines().find(|l| l.contains(" 8 ")).unwrap();
        assert!(line.trim_end().ends_with("0.50"), "{line}");
        assert!(t.contains("wrong elements over all backends and rounds: 0"));
    }

    #[test]
    fn scaling_gives_every_rank_count_and_the_ratios() {
        let at = |np: u32, t: f64| {
            let mut r = report("shm", &[(1 << 20, t)]);
            r.rows[0].np = np;
            r
        };
        // Two rounds at 2 ranks (median: the upper, 12), one at 8; 16 ranks lack nothing.
        let t = scaling(&[("shm".into(), vec![at(2, 10.0), at(8, 30.0), at(2, 12.0), at(16, 48.0)])]);
        assert!(t.contains("scaling over 2, 8, 16 ranks"), "{t}");
        assert!(t.contains("np2 time") && t.contains("np16 time") && t.contains("bw 16/2"), "{t}");
        let line = t.lines().find(|l| l.contains(" 1048576 ")).unwrap();
        let cells: Vec<&str> = line.split([' ', '|']).filter(|c| !c.is_empty()).collect();
        // op type size, (time bw) x 3, bw ratio, time ratio
        assert_eq!((cells[3], cells[5], cells[7]), ("12.00", "30.00", "48.00"), "{line}");
        assert_eq!((cells[9], cells[10]), ("0.25", "4.00"), "{line}");
    }

    #[test]
    fn rounds_give_the_median_and_the_spread() {
        // shm: 1, 3, 2 µs over three rounds -> median 2, spread 3; mpi-raw: 4 every round.
        let shm = vec![report("shm", &[(8, 1.0)]), report("shm", &[(8, 3.0)]), report("shm", &[(8, 2.0)])];
        let mpi = vec![report("mpi-raw", &[(8, 4.0)]); 3];
        let t = table(&[("shm".into(), shm), ("mpi-raw".into(), mpi)]);
        assert!(t.contains("3 interleaved rounds"), "{t}");
        let line = t.lines().find(|l| l.contains(" 8 ")).unwrap();
        let cells: Vec<&str> = line.split_whitespace().collect();
        // op type size | time bw spread | time bw spread | ratio
        assert_eq!(cells[4], "2.00", "{line}");
        assert_eq!(cells[6], "3.00", "{line}");
        assert_eq!(cells[8], "4.00", "{line}");
        assert_eq!(cells[10], "1.00", "{line}");
        // median ratio 4 / 2, fastest rounds' 4 / 1.
        assert_eq!(cells[12], "2.00", "{line}");
        assert_eq!(cells[13], "4.00", "{line}");
    }
}
