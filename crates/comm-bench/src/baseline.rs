//! `--baseline PATH`: this run against a saved JSON report, row by row.
//!
//! Rows match on (backend, op, dtype, bytes, np). Each table line gains the baseline's busbw
//! and the ratio new/old of busbw (above 1: this run is faster); a row the baseline lacks
//! shows `-` in both. The footer sums it up with the geometric mean of the ratios.

use std::collections::HashMap;
use std::path::PathBuf;

use crate::report::Row;
use crate::saved::{SavedReport, SavedRow};
use crate::sizes::format_size;

/// The match key of a row.
type Key = (String, String, String, u64, u32);

fn key(backend: &str, op: &str, dtype: &str, bytes: u64, np: u32) -> Key {
    (backend.to_owned(), op.to_owned(), dtype.to_owned(), bytes, np)
}

/// Widths of the two extra columns.
const BASE_W: usize = 12;
const RATIO_W: usize = 8;

/// The saved rows to compare with.
#[derive(Debug, Default)]
pub(crate) struct Baseline {
    paths: Vec<PathBuf>,
    busbw: HashMap<Key, f64>,
}

impl Baseline {
    /// Reads the saved reports; the first occurrence of a key wins.
    pub(crate) fn load(paths: &[PathBuf]) -> Result<Baseline, String> {
        let reports = paths.iter().map(|p| SavedReport::load(p)).collect::<Result<Vec<_>, _>>()?;
        Ok(Baseline::from_reports(&reports))
    }

    /// The baseline made of already-parsed reports.
    pub(crate) fn from_reports(reports: &[SavedReport]) -> Baseline {
        let mut b = Baseline { paths: reports.iter().map(|r| r.path.clone()).collect(), ..Baseline::default() };
        for r in reports.iter().flat_map(|r| &r.rows) {
            let SavedRow { backend, op, dtype, bytes, np, busbw_gbps, .. } = r;
            b.busbw.entry(key(backend, op, dtype, *bytes, *np)).or_insert(*busbw_gbps);
        }
        b
    }

    /// The paths it was read from, comma-separated.
    pub(crate) fn sources(&self) -> String {
        self.paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    }

    /// How many rows the baseline holds.
    pub(crate) fn len(&self) -> usize {
        self.busbw.len()
    }

    /// The baseline busbw of `row`, if the baseline has that row.
    pub(crate) fn lookup(&self, row: &Row) -> Option<f64> {
        self.busbw.get(&key(row.backend, row.op, row.dtype, row.bytes as u64, row.np)).copied()
    }

    /// The header cells of the two extra columns (appended to the table header).
    pub(crate) fn header() -> String {
        format!(" {:>BASE_W$} {:>RATIO_W$}", "base(GB/s)", "new/old")
    }

    /// The two extra cells of `row` (appended to its table line).
    pub(crate) fn cells(&self, row: &Row) -> String {
        let old = self.lookup(row);
        let base = old.map_or_else(|| "-".to_owned(), |b| format!("{b:.2}"));
        format!(" {base:>BASE_W$} {:>RATIO_W$}", format_ratio(row.busbw_gbps, old))
    }

    /// The footer lines for this run's `rows`: what was compared with, how many rows
    /// matched, the geometric mean and the extremes of new/old.
    pub(crate) fn footer(&self, rows: &[Row]) -> Vec<String> {
        let mut ratios = Vec::new();
        let mut missing = 0;
        for row in rows {
            match self.lookup(row) {
                Some(old) => ratios.extend(
                    ratio(row.busbw_gbps, old)
                        .map(|r| (format!("{} {} {}", row.op, row.dtype, format_size(row.bytes)), r)),
                ),
                None => missing += 1,
            }
        }
        let mut out = vec![format!(
            "# Baseline {}: {} row(s) compared, {missing} not in the baseline",
            self.sources(),
            ratios.len(),
        )];
        if let Some(g) = geomean(ratios.iter().map(|r| r.1)) {
            let cmp = |a: &&(String, f64), b: &&(String, f64)| a.1.total_cmp(&b.1);
            let (lo, hi) = (ratios.iter().min_by(cmp), ratios.iter().max_by(cmp));
            if let (Some(lo), Some(hi)) = (lo, hi) {
                out.push(format!(
                    "# busbw new/old       : geometric mean {g:.3}, min {:.2} ({}), max {:.2} ({})",
                    lo.1, lo.0, hi.1, hi.0
                ));
            }
        }
        out
    }
}

/// new / old, when both are usable numbers.
pub(crate) fn ratio(new: f64, old: f64) -> Option<f64> {
    (old > 0.0 && new.is_finite() && old.is_finite()).then(|| new / old)
}

/// The `new/old` cell: two decimals (below 0.1, two significant digits: `3.4e-3`, not a
/// misleading `0.00`), or `-` when there is no baseline row (or its busbw is 0).
pub(crate) fn format_ratio(new: f64, old: Option<f64>) -> String {
    match old.and_then(|o| ratio(new, o)) {
        Some(r) if r >= 0.095 || r == 0.0 => format!("{r:.2}"),
        Some(r) => format!("{r:.1e}"),
        None => "-".to_owned(),
    }
}

/// The geometric mean of positive values (`None` without any).
fn geomean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values.filter(|v| *v > 0.0).fold((0.0, 0usize), |(s, n), v| (s + v.ln(), n + 1));
    (n > 0).then(|| (sum / n as f64).exp())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::report::{column_header, format_row};

    fn row(backend: &'static str, dtype: &'static str, bytes: usize, np: u32, busbw: f64) -> Row {
        Row {
            op: "all_reduce",
            dtype,
            bytes,
            count: bytes / 4,
            redop: "sum",
            root: -1,
            iters: 10,
            warmup: 1,
            time_us: 1.0,
            algbw_gbps: busbw,
            busbw_gbps: busbw,
            wrong: Some(0),
            backend,
            np,
            p50_us: None,
            p99_us: None,
        }
    }

    fn saved() -> SavedReport {
        SavedReport::parse(
            r#"{"backend":"shm","np":2,"rows":[
                {"op":"all_reduce","dtype":"f32","bytes":1024,"busbw_gbps":2.0},
                {"op":"all_reduce","dtype":"f32","bytes":2048,"busbw_gbps":4.0},
                {"op":"all_reduce","dtype":"f32","bytes":4096,"busbw_gbps":0.0},
                {"op":"all_reduce","dtype":"f32","bytes":1024,"busbw_gbps":9.0,"backend":"mpi"}]}"#,
            Path::new("old.json"),
        )
        .unwrap()
    }

    #[test]
    fn rows_match_on_backend_op_dtype_bytes_np() {
        let b = Baseline::from_reports(&[saved()]);
        assert_eq!(b.len(), 4);
        assert_eq!(b.lookup(&row("shm", "f32", 1024, 2, 1.0)), Some(2.0));
        assert_eq!(b.lookup(&row("mpi", "f32", 1024, 2, 1.0)), Some(9.0));
        assert_eq!(b.lookup(&row("shm", "f32", 1024, 4, 1.0)), None, "np differs");
        assert_eq!(b.lookup(&row("shm", "bf16", 1024, 2, 1.0)), None, "dtype differs");
        assert_eq!(b.lookup(&row("shm", "f32", 512, 2, 1.0)), None, "size differs");
        assert_eq!(b.lookup(&row("nccl", "f32", 1024, 2, 1.0)), None, "backend differs");
        let mut other = row("shm", "f32", 1024, 2, 1.0);
        other.op = "all_gather";
        assert_eq!(b.lookup(&other), None, "op differs");
    }

    #[test]
    fn ratios_are_formatted_and_missing_rows_show_a_dash() {
        assert_eq!(format_ratio(3.0, Some(2.0)), "1.50");
        assert_eq!(format_ratio(1.0, Some(3.0)), "0.33");
        assert_eq!(format_ratio(1.0, None), "-");
        assert_eq!(format_ratio(1.0, Some(0.0)), "-");
        assert_eq!(format_ratio(0.0034, Some(1.0)), "3.4e-3");
        assert_eq!(format_ratio(0.0, Some(1.0)), "0.00");
        assert_eq!(format_ratio(0.096, Some(1.0)), "0.10");
        let b = Baseline::from_reports(&[saved()]);
        let cells = b.cells(&row("shm", "f32", 1024, 2, 3.0));
        assert_eq!(cells.split_whitespace().collect::<Vec<_>>(), ["2.00", "1.50"]);
        let cells = b.cells(&row("shm", "f32", 8, 2, 3.0));
        assert_eq!(cells.split_whitespace().collect::<Vec<_>>(), ["-", "-"]);
        let cells = b.cells(&row("shm", "f32", 4096, 2, 3.0));
        assert_eq!(cells.split_whitespace().collect::<Vec<_>>(), ["0.00", "-"]);
        // The extra columns line up with the header's.
        let h = format!("{}{}", column_header(false), Baseline::header());
        let line = format!("{}{}", format_row(&row("shm", "f32", 1024, 2, 3.0)), cells);
        assert_eq!(h.len(), line.len(), "\n{h}\n{line}");
        let rows = [
            row("shm", "f32", 1024, 2, 3.0),
            row("shm", "f32", 8, 2, 3.0),
            row("shm", "f32", 4096, 2, 3.0),
            row("shm", "f32", 2048, 2, 2.0),
        ];
        let f = b.footer(&rows).join("\n");
        assert!(f.contains("old.json: 2 row(s) compared, 1 not in the baseline"), "{f}");
        // sqrt(1.5 * 0.5)
        assert!(f.contains("geometric mean 0.866, min 0.50 (all_reduce f32 2KiB), max 1.50"), "{f}");
    }

    #[test]
    fn footer_without_matches_has_no_mean() {
        let b = Baseline::from_reports(&[saved()]);
        let f = b.footer(&[row("shm", "f64", 1024, 2, 3.0)]);
        assert_eq!(f.len(), 1, "{f:?}");
        assert!(f[0].contains("0 row(s) compared, 1 not in the baseline"), "{f:?}");
        assert_eq!(geomean([2.0, 8.0].into_iter()), Some(4.0));
        assert_eq!(geomean(std::iter::empty()), None);
    }
}
