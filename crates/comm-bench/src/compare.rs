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

/// Runs `comm-bench compare`.
pub(crate) fn main(args: &CompareArgs) -> Result<(), String> {
    let mut series = Vec::new();
    for spec in &args.series {
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
    print!("{}", table(&series));
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
