//! `comm-bench plot --svg OUT REPORT.json...`: busbw (GB/s) against message size (log2 x
//! axis, ticks in B/KiB/MiB/GiB) as an SVG, one line per backend × dtype (× op); when the
//! reports hold several rank counts, busbw against ranks instead, a panel per message size.
//! Drawn with `plotters`' SVG backend.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use plotters::coord::ranged1d::{KeyPointHint, NoDefaultFormatting, Ranged, ValueFormatter};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use crate::saved::SavedReport;
use crate::sizes::format_size;

/// Size of the picture in pixels.
const SIZE: (u32, u32) = (1000, 620);
/// Line colours (Tableau 10), used in turn.
const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];
/// Stroke width of the data lines (the axes and ticks are 1 wide).
pub(crate) const LINE_WIDTH: u32 = 2;

/// `comm-bench plot` arguments.
#[derive(clap::Args, Debug)]
pub(crate) struct PlotArgs {
    /// Where to write the SVG.
    #[arg(long, value_name = "PATH")]
    pub(crate) svg: PathBuf,
    /// Title (default: busbw vs size with the reports' host, CPU, ranks and git revision).
    #[arg(long)]
    pub(crate) title: Option<String>,
    /// JSON reports written by `comm-bench --json` (several: one per backend, say).
    #[arg(required = true, value_name = "REPORT")]
    pub(crate) reports: Vec<PathBuf>,
}

/// Runs `comm-bench plot`.
pub(crate) fn main(args: &PlotArgs) -> Result<(), String> {
    let reports = args.reports.iter().map(|p| SavedReport::load(p)).collect::<Result<Vec<_>, _>>()?;
    let svg = render(&reports, args.title.as_deref())?;
    write(&args.svg, &svg)?;
    match rank_counts(&reports).len() {
        0 | 1 => println!("# SVG plot ({} line(s)) written to {}", series(&reports).len(), args.svg.display()),
        n => println!("# SVG plot of busbw against {n} rank counts written to {}", args.svg.display()),
    }
    Ok(())
}

/// Writes `svg` to `path` (through a temporary file, so a reader never sees half a plot).
pub(crate) fn write(path: &Path, svg: &str) -> Result<(), String> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, svg).map_err(|e| format!("writing {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("writing {}: {e}", path.display()))
}

/// One line of the plot.
#[derive(Debug, PartialEq)]
pub(crate) struct Series {
    pub(crate) label: String,
    /// (bytes, busbw GB/s), by size.
    pub(crate) points: Vec<(f64, f64)>,
}

/// The lines: rows grouped by (backend, op, dtype, np); the label names the backend and the
/// dtype, and the op and the rank count only where the reports hold more than one.
pub(crate) fn series(reports: &[SavedReport]) -> Vec<Series> {
    let rows: Vec<_> = reports.iter().flat_map(|r| &r.rows).filter(|r| r.bytes > 0).collect();
    let several = |f: &dyn Fn(&&crate::saved::SavedRow) -> String| {
        let mut v: Vec<String> = rows.iter().map(f).collect();
        v.sort();
        v.dedup();
        v.len() > 1
    };
    let (ops, nps) = (several(&|r| r.op.clone()), several(&|r| r.np.to_string()));
    // Keyed in first-seen order, so the legend follows the reports.
    let mut order: Vec<(String, String, String, u32)> = Vec::new();
    let mut points: BTreeMap<usize, Vec<(f64, f64)>> = BTreeMap::new();
    for r in &rows {
        let k = (r.backend.clone(), r.op.clone(), r.dtype.clone(), r.np);
        let i = order.iter().position(|o| *o == k).unwrap_or_else(|| {
            order.push(k);
            order.len() - 1
        });
        points.entry(i).or_default().push((r.bytes as f64, r.busbw_gbps.max(0.0)));
    }
    order
        .into_iter()
        .enumerate()
        .map(|(i, (backend, op, dtype, np))| {
            let mut label = backend;
            if ops {
                label = format!("{label} {op}");
            }
            label = format!("{label} {dtype}");
            if nps {
                label = format!("{label} np={np}");
            }
            let mut points = points.remove(&i).unwrap_or_default();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            Series { label, points }
        })
        .collect()
}

/// The default title: what was measured, where, on which revision.
pub(crate) fn title(reports: &[SavedReport]) -> String {
    let distinct = |f: &dyn Fn(&SavedReport) -> Option<String>| {
        let mut v: Vec<String> = reports.iter().filter_map(f).filter(|s| !s.is_empty()).collect();
        v.sort();
        v.dedup();
        if v.is_empty() {
            "?".to_owned()
        } else {
            v.join(", ")
        }
    };
    let mut nps: Vec<u32> = reports.iter().flat_map(|r| r.rows.iter().map(|x| x.np).chain(r.np)).collect();
    nps.retain(|n| *n > 0);
    nps.sort_unstable();
    nps.dedup();
    let nps =
        if nps.is_empty() { "?".to_owned() } else { nps.iter().map(u32::to_string).collect::<Vec<_>>().join(", ") };
    format!(
        "comm-bench busbw — host {}, CPU {}, np {}, git {}",
        distinct(&|r| r.host.clone()),
        distinct(&|r| r.cpu.clone()),
        nps,
        distinct(&|r| r.git_rev.clone()),
    )
}

/// A log2 axis (byte counts, or rank counts) from 2^lo to 2^hi, with ticks at powers of two.
#[derive(Clone, Debug)]
struct Log2 {
    lo: f64,
    hi: f64,
}

impl Ranged for Log2 {
    type FormatOption = NoDefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let x = value.max(1.0).log2();
        let f = (x - self.lo) / (self.hi - self.lo);
        limit.0 + (f * f64::from(limit.1 - limit.0)).round() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        // Every `step`-th power of two, at exponents that are multiples of `step`, so that
        // with a step of 2, 5 or 10 the ticks still hit 1KiB, 1MiB and 1GiB.
        let (lo, hi) = (self.lo.ceil() as i32, self.hi.floor() as i32);
        let n = hint.max_num_points().max(1);
        let count = |step: i32| (lo..=hi).filter(|e| e % step == 0).count();
        let step = [1, 2, 5, 10, 20, 30].into_iter().find(|&s| count(s) <= n).unwrap_or(30);
        (lo..=hi).filter(|e| e % step == 0).map(|e| 2f64.powi(e)).collect()
    }

    fn range(&self) -> Range<f64> {
        2f64.powf(self.lo)..2f64.powf(self.hi)
    }
}

impl ValueFormatter<f64> for Log2 {
    fn format(value: &f64) -> String {
        format_size(value.round() as usize)
    }
}

/// Sizes for the panels of the scaling plot: those nearest (in doublings) to 8 B, 4 KiB,
/// 1 MiB and 64 MiB — the small-message latency, the copy path, and two bandwidth sizes.
fn panel_sizes(reports: &[SavedReport]) -> Vec<u64> {
    let mut have: Vec<u64> = reports.iter().flat_map(|r| &r.rows).map(|r| r.bytes).filter(|&b| b > 0).collect();
    have.sort_unstable();
    have.dedup();
    let mut out: Vec<u64> = [8u64, 4 << 10, 1 << 20, 64 << 20]
        .into_iter()
        .filter_map(|want| {
            let far = |b: &u64| ((*b as f64).log2() - (want as f64).log2()).abs();
            have.iter().copied().min_by(|a, b| far(a).total_cmp(&far(b)))
        })
        .collect();
    out.dedup();
    out
}

/// The lines of one panel of the scaling plot: rows of `bytes` grouped by (backend, op,
/// dtype), one point (ranks, busbw) per rank count, in the order of `keys` (every panel's
/// lines, so a line keeps its colour across panels).
fn scaling_series(reports: &[SavedReport], bytes: u64, keys: &[(String, String, String)]) -> Vec<Vec<(f64, f64)>> {
    keys.iter()
        .map(|k| {
            let mut p: Vec<(f64, f64)> = reports
                .iter()
                .flat_map(|r| &r.rows)
                .filter(|r| r.bytes == bytes && (&r.backend, &r.op, &r.dtype) == (&k.0, &k.1, &k.2))
                .map(|r| (f64::from(r.np), r.busbw_gbps.max(0.0)))
                .collect();
            p.sort_by(|a, b| a.0.total_cmp(&b.0));
            p.dedup_by(|a, b| a.0 == b.0);
            p
        })
        .collect()
}

/// The distinct rank counts of the reports' rows.
fn rank_counts(reports: &[SavedReport]) -> Vec<u32> {
    let mut nps: Vec<u32> = reports.iter().flat_map(|r| &r.rows).map(|r| r.np).filter(|&n| n > 0).collect();
    nps.sort_unstable();
    nps.dedup();
    nps
}

/// The SVG text of the plot: busbw against size, or against ranks when the reports hold
/// several rank counts.
pub(crate) fn render(reports: &[SavedReport], title_text: Option<&str>) -> Result<String, String> {
    if rank_counts(reports).len() > 1 {
        return render_scaling(reports, title_text);
    }
    let lines = series(reports);
    if lines.iter().all(|s| s.points.is_empty()) {
        return Err("nothing to plot: the reports have no rows".into());
    }
    let all = || lines.iter().flat_map(|s| &s.points);
    let (min_b, max_b) = all().fold((f64::MAX, 0f64), |(lo, hi), p| (lo.min(p.0), hi.max(p.0)));
    let (mut lo, mut hi) = (min_b.log2().floor(), max_b.log2().ceil());
    if hi - lo < 1.0 {
        (lo, hi) = (lo - 1.0, hi + 1.0);
    }
    let top = all().map(|p| p.1).fold(0f64, f64::max).max(0.01) * 1.08;
    let title_text = title_text.map_or_else(|| title(reports), str::to_owned);
    let err = |e: &dyn std::fmt::Display| format!("drawing the plot: {e}");
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(&title_text, ("sans-serif", 17))
            .margin(16)
            .margin_right(32)
            .x_label_area_size(48)
            .y_label_area_size(64)
            .build_cartesian_2d(Log2 { lo, hi }, 0f64..top)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_labels(13)
            .y_labels(10)
            .max_light_lines(1)
            .x_desc("message size (log2)")
            .y_desc("busbw (GB/s)")
            .x_label_formatter(&|x| format_size(x.round() as usize))
            .y_label_formatter(&|y| format!("{y:.2}"))
            .draw()
            .map_err(|e| err(&e))?;
        for (i, s) in lines.iter().enumerate() {
            line(&mut chart, &s.points, COLORS[i % COLORS.len()], Some(&s.label))?;
        }
        legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
        root.present().map_err(|e| err(&e))?;
    }
    Ok(svg)
}

type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<Log2, RangedCoordf64>>;

/// One data line with a marker per point, named in the legend when `label` is given.
fn line(chart: &mut Chart<'_, '_>, points: &[(f64, f64)], color: RGBColor, label: Option<&str>) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("drawing the plot: {e}");
    let drawn = chart
        .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(LINE_WIDTH)))
        .map_err(|e| err(&e))?;
    if let Some(label) = label {
        drawn.label(label).legend(move |(x, y)| Rectangle::new([(x, y - 3), (x + 18, y + 3)], color.filled()));
    }
    chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled()))).map_err(|e| err(&e))?;
    Ok(())
}

fn legend<'a, 'b>(chart: &mut Chart<'a, 'b>, at: SeriesLabelPosition) -> Result<(), String>
where
    'b: 'a,
{
    chart
        .configure_series_labels()
        .position(at)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.85))
        .draw()
        .map_err(|e| format!("drawing the plot: {e}"))
}

/// busbw against ranks (log2 axis), a panel per size of [`panel_sizes`], one line per
/// backend × dtype (× op).
fn render_scaling(reports: &[SavedReport], title_text: Option<&str>) -> Result<String, String> {
    let nps = rank_counts(reports);
    let sizes = panel_sizes(reports);
    let mut keys: Vec<(String, String, String)> = Vec::new();
    for r in reports.iter().flat_map(|r| &r.rows) {
        let k = (r.backend.clone(), r.op.clone(), r.dtype.clone());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    let several_ops = keys.iter().any(|k| k.1 != keys[0].1);
    let label = |k: &(String, String, String)| match several_ops {
        true => format!("{} {} {}", k.0, k.1, k.2),
        false => format!("{} {}", k.0, k.2),
    };
    let (lo, hi) = (f64::from(nps[0]).log2().floor(), f64::from(nps[nps.len() - 1]).log2().ceil());
    let title_text = title_text.map_or_else(|| title(reports).replacen("busbw", "busbw vs ranks", 1), str::to_owned);
    let err = |e: &dyn std::fmt::Display| format!("drawing the plot: {e}");
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let root = root.titled(&title_text, ("sans-serif", 17)).map_err(|e| err(&e))?;
        let grid = match sizes.len() {
            1 => (1, 1),
            2 => (1, 2),
            _ => (2, 2),
        };
        for (panel, (area, &bytes)) in root.split_evenly(grid).iter().zip(&sizes).enumerate() {
            let lines = scaling_series(reports, bytes, &keys);
            let top = lines.iter().flatten().map(|p| p.1).fold(0f64, f64::max).max(0.01) * 1.08;
            let mut chart = ChartBuilder::on(area)
                .caption(format!("{} per op", format_size(bytes as usize)), ("sans-serif", 14))
                .margin(10)
                .x_label_area_size(36)
                .y_label_area_size(56)
                .build_cartesian_2d(Log2 { lo, hi: hi.max(lo + 1.0) }, 0f64..top)
                .map_err(|e| err(&e))?;
            chart
                .configure_mesh()
                .x_labels(8)
                .y_labels(6)
                .max_light_lines(1)
                .x_desc("ranks (log2)")
                .y_desc("busbw (GB/s)")
                .x_label_formatter(&|x| format!("{}", x.round()))
                .y_label_formatter(&|y| format!("{y:.2}"))
                .draw()
                .map_err(|e| err(&e))?;
            // The legend once, in the first panel.
            for (i, points) in lines.iter().enumerate().filter(|(_, p)| !p.is_empty()) {
                let name = (panel == 0).then(|| label(&keys[i]));
                line(&mut chart, points, COLORS[i % COLORS.len()], name.as_deref())?;
            }
            if panel == 0 {
                legend(&mut chart, SeriesLabelPosition::UpperRight)?;
            }
        }
        root.present().map_err(|e| err(&e))?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(backend: &str, np: u32, rows: &[(&str, &str, u64, f64)]) -> SavedReport {
        let rows: Vec<String> = rows
            .iter()
            .map(|(op, dtype, bytes, bw)| {
                format!(r#"{{"op":"{op}","dtype":"{dtype}","bytes":{bytes},"busbw_gbps":{bw}}}"#)
            })
            .collect();
        let text = format!(
            r#"{{"host":"box&1","cpu":"Test CPU <2 cores>","git_rev":"abc1234","backend":"{backend}","np":{np},"rows":[{}]}}"#,
            rows.join(",")
        );
        SavedReport::parse(&text, Path::new("t.json")).unwrap()
    }

    /// The tags of an XML-ish text, checked for balance: every `<x ...>` that is not
    /// self-closed has its `</x>`, in order. Returns the elements (name, attribute text).
    fn elements(svg: &str) -> Vec<(String, String)> {
        let mut stack: Vec<String> = Vec::new();
        let mut out = Vec::new();
        let mut rest = svg;
        while let Some(start) = rest.find('<') {
            let end = rest[start..].find('>').expect("unterminated tag") + start;
            let tag = &rest[start + 1..end];
            assert!(!tag.contains('<'), "`<` inside a tag: {tag}");
            if let Some(name) = tag.strip_prefix('/') {
                assert_eq!(stack.pop().as_deref(), Some(name.trim()), "mismatched </{name}>");
            } else if !tag.starts_with('?') && !tag.starts_with('!') {
                let name = tag.split_whitespace().next().unwrap_or("").trim_end_matches('/').to_owned();
                if !tag.ends_with('/') {
                    stack.push(name.clone());
                }
                out.push((name, tag.to_owned()));
            }
            // Text between tags must not hold a raw `<` or a bare `&`.
            let next = rest[end + 1..].find('<').map_or(rest.len(), |n| n + end + 1);
            let text = &rest[end + 1..next];
            for (i, _) in text.match_indices('&') {
                let ent = &text[i..];
                assert!(
                    ["&amp;", "&lt;", "&gt;", "&quot;", "&apos;", "&#"].iter().any(|e| ent.starts_with(e)),
                    "bare & in {text:?}"
                );
            }
            rest = &rest[end + 1..];
        }
        assert!(stack.is_empty(), "unclosed tags {stack:?}");
        out
    }

    /// The vertex count of each data line (the polylines drawn [`LINE_WIDTH`] wide).
    fn data_lines(els: &[(String, String)]) -> Vec<usize> {
        els.iter()
            .filter(|(n, t)| n == "polyline" && attr(t, "stroke-width") == Some(&LINE_WIDTH.to_string()))
            .map(|(_, t)| attr(t, "points").unwrap().split_whitespace().count())
            .collect()
    }

    fn attr<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
        let pat = format!(" {name}=\"");
        let at = tag.find(&pat)? + pat.len();
        Some(&tag[at..at + tag[at..].find('"')?])
    }

    #[test]
    fn one_polyline_per_series_with_every_point() {
        let shm = report(
            "shm",
            2,
            &[
                ("all_reduce", "f32", 8, 0.01),
                ("all_reduce", "f32", 1024, 1.0),
                ("all_reduce", "f32", 1 << 20, 9.5),
                ("all_reduce", "f32", 64 << 20, 4.0),
                ("all_reduce", "bf16", 1024, 0.8),
                ("all_reduce", "bf16", 1 << 20, 7.0),
            ],
        );
        let mpi = report("mpi", 2, &[("all_reduce", "f32", 8, 0.02), ("all_reduce", "f32", 1 << 20, 5.0)]);
        let reports = [shm, mpi];
        let svg = render(&reports, None).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{}", &svg[..80]);
        let els = elements(&svg);
        let lines = data_lines(&els);
        assert_eq!(lines, [4, 2, 2], "one polyline per backend x dtype, one vertex per row");
        assert_eq!(els.iter().filter(|(n, _)| n == "circle").count(), 8, "a marker per row");
        for needle in ["shm f32", "shm bf16", "mpi f32", "busbw (GB/s)", "16B", "1KiB", "1MiB", "64MiB", "git abc1234"]
        {
            assert!(svg.contains(needle), "no `{needle}` in the SVG");
        }
        // The title's special characters are escaped.
        assert!(svg.contains("host box&amp;1") && svg.contains("Test CPU &lt;2 cores&gt;"));
        assert!(svg.contains("np 2"));
        // The vertices go left to right (log2 x axis, sizes in order).
        let poly = els.iter().find(|(n, t)| n == "polyline" && attr(t, "stroke-width") == Some("2")).unwrap();
        let xs: Vec<i32> = attr(&poly.1, "points")
            .unwrap()
            .split_whitespace()
            .map(|p| p.split(',').next().unwrap().parse().unwrap())
            .collect();
        assert!(xs.windows(2).all(|w| w[0] < w[1]), "{xs:?}");
        // 8 B -> 1 KiB is 7 doublings, 1 KiB -> 1 MiB 10: equal steps per doubling.
        let per = |a: usize, b: usize, doublings: f64| f64::from(xs[b] - xs[a]) / doublings;
        assert!((per(0, 1, 7.0) - per(1, 2, 10.0)).abs() < 1.0, "{xs:?}");
    }

    #[test]
    fn labels_name_op_and_np_only_when_they_vary() {
        let a = report("shm", 2, &[("all_reduce", "f32", 8, 1.0), ("all_gather", "f32", 8, 2.0)]);
        let b = report("shm", 4, &[("all_reduce", "f32", 8, 1.0)]);
        let labels: Vec<String> = series(&[a, b]).into_iter().map(|s| s.label).collect();
        assert_eq!(labels, ["shm all_reduce f32 np=2", "shm all_gather f32 np=2", "shm all_reduce f32 np=4"]);
        let one = report("shm", 2, &[("all_reduce", "f32", 8, 1.0)]);
        assert_eq!(series(std::slice::from_ref(&one))[0].label, "shm f32");
        assert!(title(&[one]).contains("np 2"));
    }

    #[test]
    fn several_rank_counts_plot_busbw_against_ranks() {
        let rows = |bw: f64| -> Vec<(&str, &str, u64, f64)> {
            [8u64, 4096, 1 << 20, 16 << 20, 64 << 20].iter().map(|&b| ("all_reduce", "f32", b, bw)).collect()
        };
        let reports: Vec<SavedReport> = [(2, 8.0), (4, 6.0), (8, 5.0), (16, 4.0)]
            .into_iter()
            .flat_map(|(np, bw)| [report("shm", np, &rows(bw)), report("mpi", np, &rows(bw / 2.0))])
            .collect();
        assert_eq!(panel_sizes(&reports), [8, 4096, 1 << 20, 64 << 20]);
        let svg = render(&reports, None).unwrap();
        let els = elements(&svg);
        let lines = data_lines(&els);
        assert_eq!(lines, [4; 8], "two lines (shm, mpi) in each of four panels, a vertex per rank count");
        for needle in ["busbw vs ranks", "8B per op", "4KiB per op", "1MiB per op", "64MiB per op", "ranks (log2)"] {
            assert!(svg.contains(needle), "no `{needle}` in the SVG");
        }
        // The legend once, in the first panel.
        assert_eq!(svg.matches("\nshm f32\n").count(), 1, "{svg}");
        // Sizes between the wanted ones: the nearest each, no repeats.
        let odd =
            [report("shm", 2, &[("all_reduce", "f32", 64, 1.0)]), report("shm", 4, &[("all_reduce", "f32", 64, 1.0)])];
        assert_eq!(panel_sizes(&odd), [64]);
        elements(&render(&odd, None).unwrap());
    }

    #[test]
    fn a_single_size_and_empty_reports() {
        let one = report("shm", 2, &[("all_reduce", "f32", 4096, 1.0)]);
        let svg = render(&[one], Some("custom title")).unwrap();
        assert!(svg.contains("custom title"));
        elements(&svg);
        let empty = report("shm", 2, &[]);
        assert!(render(&[empty], None).unwrap_err().contains("nothing to plot"));
    }

    #[test]
    fn log2_ticks_are_powers_of_two() {
        let axis = Log2 { lo: 3.0, hi: 26.0 };
        let ticks: Vec<String> = axis.key_points(13usize).iter().map(Log2::format).collect();
        assert_eq!(ticks.first().map(String::as_str), Some("16B"));
        assert!(ticks.len() == 12 && ticks.contains(&"1KiB".to_owned()) && ticks.contains(&"1MiB".to_owned()));
        let ticks: Vec<String> = axis.key_points(6usize).iter().map(Log2::format).collect();
        assert_eq!(ticks, ["32B", "1KiB", "32KiB", "1MiB", "32MiB"]);
        assert_eq!(axis.key_points(100usize).len(), 24);
        assert_eq!(Log2::format(&8.0), "8B");
        assert_eq!(Log2::format(&65536.0), "64KiB");
        assert_eq!(axis.map(&8.0, (0, 230)), 0);
        assert_eq!(axis.map(&(64.0 * 1024.0 * 1024.0), (0, 230)), 230);
        assert_eq!(axis.map(&8192.0, (0, 230)), 100);
    }
}
