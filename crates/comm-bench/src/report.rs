//! The nccl-tests–style table printed by rank 0, and the JSON report.

use std::path::Path;

use serde::Serialize;

use crate::cases::Coll;

/// One result row, identical on every rank once the time and #wrong are combined.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Row {
    pub(crate) op: &'static str,
    pub(crate) dtype: &'static str,
    /// S as nccl-tests counts it (the `size(B)` column).
    pub(crate) bytes: usize,
    /// nccl-tests' `count` column.
    pub(crate) count: usize,
    /// `sum`, ..., or `none` for data-movement ops.
    pub(crate) redop: &'static str,
    /// Root rank, or -1 for ops without one.
    pub(crate) root: i64,
    pub(crate) iters: usize,
    pub(crate) warmup: usize,
    pub(crate) time_us: f64,
    pub(crate) algbw_gbps: f64,
    pub(crate) busbw_gbps: f64,
    /// Wrong elements summed over every rank; `null` when checking was off.
    pub(crate) wrong: Option<u64>,
    pub(crate) backend: &'static str,
    pub(crate) np: u32,
    /// With `--percentiles`: the median and 99th percentile of the per-op time, each op's
    /// time being the slowest rank's (µs); absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) p50_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) p99_us: Option<f64>,
}

/// The version of the JSON layout (`schema`); raised when a field changes meaning or goes.
pub(crate) const SCHEMA: u32 = 1;

/// The JSON document `--json` writes (its fields are listed in `comm-bench --help`).
#[derive(Debug, Serialize)]
pub(crate) struct Report<'a> {
    pub(crate) schema: u32,
    pub(crate) host: String,
    pub(crate) cpu: String,
    pub(crate) nproc: usize,
    pub(crate) git_rev: Option<String>,
    /// When the first row started (after the process group was up), RFC 3339 UTC.
    pub(crate) start: String,
    /// When the last row ended, RFC 3339 UTC.
    pub(crate) end: String,
    /// The same as `end` (the field's name before `start` / `end` existed).
    pub(crate) timestamp: String,
    pub(crate) backend: &'static str,
    pub(crate) np: u32,
    pub(crate) time: &'static str,
    pub(crate) args: Vec<String>,
    pub(crate) rows: &'a [Row],
}

const HEAD: [&str; 9] =
    ["size(B)", "count", "type", "redop", "root", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"];
const WIDTH: [usize; 9] = [12, 12, 6, 6, 5, 11, 12, 12, 7];

/// Headers and width of the `--percentiles` columns.
const PCT_HEAD: [&str; 2] = ["p50(us)", "p99(us)"];
const PCT_WIDTH: usize = 10;

/// The column header (with the percentile columns when asked for).
pub(crate) fn column_header(percentiles: bool) -> String {
    let mut s = String::from("#");
    for (i, (h, w)) in HEAD.iter().zip(WIDTH).enumerate() {
        // The leading '#' takes one column of the first field.
        let w = if i == 0 { w - 1 } else { w };
        s.push_str(&format!("{h:>w$} "));
    }
    if percentiles {
        for h in PCT_HEAD {
            s.push_str(&format!("{h:>PCT_WIDTH$} "));
        }
    }
    s.trim_end().to_owned()
}

/// The `q`-quantile (0..=1) of `sorted` (nearest rank).
pub(crate) fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// `x` with 2 decimals, or fewer (then exponent notation) when that does not fit `width`,
/// like nccl-tests.
fn num(x: f64, width: usize) -> String {
    for prec in [2, 1, 0] {
        let s = format!("{x:.prec$}");
        if s.len() <= width {
            return s;
        }
    }
    format!("{x:.1e}")
}

/// One table line.
pub(crate) fn format_row(r: &Row) -> String {
    let wrong = r.wrong.map_or_else(|| "N/A".to_owned(), |w| w.to_string());
    let cells = [
        r.bytes.to_string(),
        r.count.to_string(),
        r.dtype.to_owned(),
        r.redop.to_owned(),
        r.root.to_string(),
        num(r.time_us, WIDTH[5]),
        num(r.algbw_gbps, WIDTH[6]),
        num(r.busbw_gbps, WIDTH[7]),
        wrong,
    ];
    let mut s = String::new();
    for (c, w) in cells.iter().zip(WIDTH) {
        s.push_str(&format!("{c:>w$} "));
    }
    for p in [r.p50_us, r.p99_us].into_iter().flatten() {
        s.push_str(&format!("{:>PCT_WIDTH$} ", num(p, PCT_WIDTH)));
    }
    s.trim_end().to_owned()
}

/// The footer: wrong values and the mean busbw over every row (per op too when there are
/// several ops).
pub(crate) fn footer(rows: &[Row], ops: &[Coll]) -> Vec<String> {
    let mut out = vec!["#".to_owned()];
    let wrong: u64 = rows.iter().filter_map(|r| r.wrong).sum();
    let checked = rows.iter().any(|r| r.wrong.is_some());
    out.push(match (checked, wrong) {
        (false, _) => "# Out of bounds values : N/A (not checked)".to_owned(),
        (true, 0) => "# Out of bounds values : 0 OK".to_owned(),
        (true, w) => format!("# Out of bounds values : {w} FAILED"),
    });
    out.push(format!("# Avg bus bandwidth    : {}", num(mean_busbw(rows.iter()), 12)));
    if ops.len() > 1 {
        for op in ops {
            let of_op = rows.iter().filter(|r| r.op == op.name());
            out.push(format!("#   {:<18} : {}", op.name(), num(mean_busbw(of_op), 12)));
        }
    }
    out.push("#".to_owned());
    out
}

fn mean_busbw<'a>(rows: impl Iterator<Item = &'a Row>) -> f64 {
    let (sum, n) = rows.fold((0.0, 0usize), |(s, n), r| (s + r.busbw_gbps, n + 1));
    if n == 0 {
        0.0
    } else {
        sum / n as f64
    }
}

/// Writes the report as pretty JSON.
pub(crate) fn write_json(path: &Path, report: &Report<'_>) -> std::io::Result<()> {
    let mut text = serde_json::to_string_pretty(report).map_err(std::io::Error::other)?;
    text.push('\n');
    std::fs::write(path, text)
}

/// This host's name.
pub(crate) fn hostname() -> String {
    ["/proc/sys/kernel/hostname", "/etc/hostname"]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok().map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()))
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".to_owned())
}

/// The git revision of the source tree this binary was built from, when that tree is still
/// there (`git rev-parse --short HEAD` in it); `cargo xtask bench` passes its own instead
/// (`COMM_BENCH_GIT_REV`).
pub(crate) fn git_rev() -> Option<String> {
    std::process::Command::new("git")
        .args(["-C", env!("CARGO_MANIFEST_DIR"), "rev-parse", "--short", "HEAD"])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .filter(|s| !s.is_empty())
}

/// The CPU model, from `/proc/cpuinfo` where there is one.
pub(crate) fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name") || l.starts_with("Model"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_owned())
}

/// Now, as an RFC 3339 UTC timestamp (`2026-11-01T12:34:56Z`).
pub(crate) fn timestamp() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    rfc3339(secs)
}

fn rfc3339(unix: u64) -> String {
    let (days, rem) = (unix / 86_400, unix % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(busbw: f64, wrong: Option<u64>) -> Row {
        Row {
            op: "all_reduce",
            dtype: "f32",
            bytes: 1024,
            count: 256,
            redop: "sum",
            root: -1,
            iters: 10,
            warmup: 1,
            time_us: 12.345,
            algbw_gbps: busbw,
            busbw_gbps: busbw,
            wrong,
            backend: "shm",
            np: 2,
            p50_us: None,
            p99_us: None,
        }
    }

    #[test]
    fn rows_line_up_with_the_header() {
        let h = column_header(false);
        let r = format_row(&row(1.5, Some(0)));
        assert_eq!(h.len(), r.len(), "\n{h}\n{r}");
        assert!(r.ends_with(" 0"));
        assert!(r.contains("12.35"));
        assert!(format_row(&row(1.5, None)).ends_with("N/A"));
        let h = column_header(true);
        let r = format_row(&Row { p50_us: Some(11.5), p99_us: Some(140.25), ..row(1.5, Some(0)) });
        assert_eq!(h.len(), r.len(), "\n{h}\n{r}");
        assert!(h.ends_with("p99(us)") && r.ends_with("11.50     140.25"), "{r}");
    }

    #[test]
    fn quantiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!((quantile(&v, 0.5), quantile(&v, 0.99), quantile(&v, 1.0)), (50.0, 99.0, 100.0));
        assert_eq!(quantile(&[7.0], 0.99), 7.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }

    #[test]
    fn numbers_shrink_to_fit() {
        assert_eq!(num(1.234, 6), "1.23");
        assert_eq!(num(12345.678, 6), "12346");
        assert_eq!(num(123456789.0, 6), "1.2e8");
    }

    #[test]
    fn footer_reports_wrong_values_and_mean() {
        let rows = [row(1.0, Some(0)), row(3.0, Some(2))];
        let f = footer(&rows, &[Coll::AllReduce]);
        assert!(f.iter().any(|l| l.contains("2 FAILED")), "{f:?}");
        assert!(f.iter().any(|l| l.contains("Avg bus bandwidth    : 2.00")), "{f:?}");
    }

    #[test]
    fn timestamps() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_700_000_000), "2023-11-14T22:13:20Z");
    }
}
