//! `cargo xtask bench --backend A,B,...`: the rows of every backend's JSON report side by side,
//! with the time ratio of each backend to the first.
//!
//! xtask has no dependencies, so this holds a small JSON reader (enough for comm-bench's
//! report: objects, arrays, strings, numbers, booleans, null).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use crate::{Failure, Result};

/// A JSON value.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Json {
    Null,
    Bool(bool),
    Num(f64),
    Str(String),
    Arr(Vec<Json>),
    Obj(BTreeMap<String, Json>),
}

impl Json {
    fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Obj(m) => m.get(key),
            _ => None,
        }
    }

    fn num(&self, key: &str) -> Option<f64> {
        match self.get(key)? {
            Json::Num(n) => Some(*n),
            _ => None,
        }
    }

    fn str(&self, key: &str) -> Option<&str> {
        match self.get(key)? {
            Json::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// Parses a whole JSON document.
pub(crate) fn parse(text: &str) -> std::result::Result<Json, String> {
    let mut p = Parser { s: text.as_bytes(), i: 0 };
    let v = p.value()?;
    p.ws();
    if p.i != p.s.len() {
        return Err(format!("trailing characters at byte {}", p.i));
    }
    Ok(v)
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> std::result::Result<(), String> {
        self.ws();
        if self.s.get(self.i) == Some(&c) {
            self.i += 1;
            Ok(())
        } else {
            Err(format!("expected `{}` at byte {}", c as char, self.i))
        }
    }

    fn value(&mut self) -> std::result::Result<Json, String> {
        self.ws();
        match self.s.get(self.i) {
            None => Err("unexpected end of JSON".into()),
            Some(b'{') => {
                self.i += 1;
                let mut m = BTreeMap::new();
                self.ws();
                if self.s.get(self.i) == Some(&b'}') {
                    self.i += 1;
                    return Ok(Json::Obj(m));
                }
                loop {
                    self.ws();
                    let k = self.string()?;
                    self.eat(b':')?;
                    m.insert(k, self.value()?);
                    self.ws();
                    match self.s.get(self.i) {
                        Some(b',') => self.i += 1,
                        Some(b'}') => {
                            self.i += 1;
                            return Ok(Json::Obj(m));
                        }
                        _ => return Err(format!("expected `,` or `}}` at byte {}", self.i)),
                    }
                }
            }
            Some(b'[') => {
                self.i += 1;
                let mut v = Vec::new();
                self.ws();
                if self.s.get(self.i) == Some(&b']') {
                    self.i += 1;
                    return Ok(Json::Arr(v));
                }
                loop {
                    v.push(self.value()?);
                    self.ws();
                    match self.s.get(self.i) {
                        Some(b',') => self.i += 1,
                        Some(b']') => {
                            self.i += 1;
                            return Ok(Json::Arr(v));
                        }
                        _ => return Err(format!("expected `,` or `]` at byte {}", self.i)),
                    }
                }
            }
            Some(b'"') => self.string().map(Json::Str),
            Some(_) => {
                for (word, v) in [("null", Json::Null), ("true", Json::Bool(true)), ("false", Json::Bool(false))] {
                    if self.s[self.i..].starts_with(word.as_bytes()) {
                        self.i += word.len();
                        return Ok(v);
                    }
                }
                let start = self.i;
                while self.i < self.s.len() && matches!(self.s[self.i], b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E')
                {
                    self.i += 1;
                }
                let t = std::str::from_utf8(&self.s[start..self.i]).unwrap_or("");
                t.parse().map(Json::Num).map_err(|_| format!("bad value at byte {start}"))
            }
        }
    }

    fn string(&mut self) -> std::result::Result<String, String> {
        if self.s.get(self.i) != Some(&b'"') {
            return Err(format!("expected a string at byte {}", self.i));
        }
        self.i += 1;
        let mut out = Vec::new();
        while let Some(&c) = self.s.get(self.i) {
            self.i += 1;
            match c {
                b'"' => return String::from_utf8(out).map_err(|e| e.to_string()),
                b'\\' => {
                    let e = *self.s.get(self.i).ok_or("unterminated escape")?;
                    self.i += 1;
                    match e {
                        b'n' => out.push(b'\n'),
                        b't' => out.push(b'\t'),
                        b'r' => out.push(b'\r'),
                        b'b' => out.push(8),
                        b'f' => out.push(12),
                        b'u' => {
                            let hex = self.s.get(self.i..self.i + 4).ok_or("short \\u escape")?;
                            self.i += 4;
                            let code = u32::from_str_radix(std::str::from_utf8(hex).unwrap_or(""), 16)
                                .map_err(|e| e.to_string())?;
                            let ch = char::from_u32(code).unwrap_or('\u{fffd}');
                            out.extend_from_slice(ch.to_string().as_bytes());
                        }
                        other => out.push(other),
                    }
                }
                c => out.push(c),
            }
        }
        Err("unterminated string".into())
    }
}

/// One measured row of a backend.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Row {
    pub(crate) op: String,
    pub(crate) dtype: String,
    pub(crate) bytes: u64,
    pub(crate) count: u64,
    pub(crate) time_us: f64,
    pub(crate) busbw: f64,
    pub(crate) wrong: Option<u64>,
}

/// The rows of a comm-bench JSON report.
pub(crate) fn rows(report: &Json) -> std::result::Result<Vec<Row>, String> {
    let Some(Json::Arr(rows)) = report.get("rows") else { return Err("no `rows` array".into()) };
    rows.iter()
        .map(|r| {
            let field = |k: &str| r.num(k).ok_or_else(|| format!("row without `{k}`"));
            Ok(Row {
                op: r.str("op").ok_or("row without `op`")?.to_owned(),
                dtype: r.str("dtype").ok_or("row without `dtype`")?.to_owned(),
                bytes: field("bytes")? as u64,
                count: field("count")? as u64,
                time_us: field("time_us")?,
                busbw: field("busbw_gbps")?,
                wrong: r.num("wrong").map(|w| w as u64),
            })
        })
        .collect()
}

/// Reads the report of each backend.
pub(crate) fn load(reports: &[(String, std::path::PathBuf)]) -> Result<Vec<(String, Vec<Row>)>> {
    reports
        .iter()
        .map(|(backend, path)| {
            let text = std::fs::read_to_string(path)
                .map_err(|e| Failure { code: 1, msg: format!("reading {}: {e}", path.display()) })?;
            let doc = parse(&text).map_err(|e| Failure { code: 1, msg: format!("{}: {e}", path.display()) })?;
            let rows = rows(&doc).map_err(|e| Failure { code: 1, msg: format!("{}: {e}", path.display()) })?;
            Ok((backend.clone(), rows))
        })
        .collect()
}

fn cell(x: f64) -> String {
    if x >= 1e6 {
        format!("{x:.3e}")
    } else {
        format!("{x:.2}")
    }
}

/// The side-by-side table: one line per (op, dtype, size) of the first backend, each backend's
/// time and busbw, and `time(B) / time(first)` for every other backend (above 1: the first
/// backend is faster).
pub(crate) fn table(all: &[(String, Vec<Row>)], np: u32) -> String {
    let mut s = String::new();
    let Some((base, base_rows)) = all.first() else { return s };
    let _ =
        writeln!(s, "# side by side, {np} ranks: time(us) = mean wall time per op (max over ranks), busbw in GB/s;");
    let _ = writeln!(
        s,
        "# {b}/{base} = time({b}) / time({base}): above 1, {base} is faster",
        b = all.get(1).map_or("x", |a| &a.0)
    );
    let mut head = format!("#{:>13} {:>6} {:>12} {:>11}", "op", "type", "size(B)", "count");
    for (b, _) in all {
        let _ = write!(head, " | {:>11} {:>9}", format!("{b} time"), format!("{b} bw"));
    }
    for (b, _) in &all[1..] {
        let _ = write!(head, " | {:>9}", format!("{b}/{base}"));
    }
    let _ = writeln!(s, "{head}");
    let mut wrong = 0;
    for r in base_rows {
        let mut line = format!("{:>14} {:>6} {:>12} {:>11}", r.op, r.dtype, r.bytes, r.count);
        let mut times = Vec::new();
        for (_, rows) in all {
            match rows.iter().find(|o| o.op == r.op && o.dtype == r.dtype && o.bytes == r.bytes) {
                Some(o) => {
                    wrong += o.wrong.unwrap_or(0);
                    let _ = write!(line, " | {:>11} {:>9}", cell(o.time_us), cell(o.busbw));
                    times.push(Some(o.time_us));
                }
                None => {
                    let _ = write!(line, " | {:>11} {:>9}", "-", "-");
                    times.push(None);
                }
            }
        }
        for t in &times[1..] {
            match (times[0], t) {
                (Some(a), Some(b)) if a > 0.0 => {
                    let _ = write!(line, " | {:>9}", format!("{:.2}", b / a));
                }
                _ => {
                    let _ = write!(line, " | {:>9}", "-");
                }
            }
        }
        let _ = writeln!(s, "{line}");
    }
    let _ = writeln!(s, "# wrong elements over all backends: {wrong}");
    s
}

/// Where a backend's report goes when the user gave no `--json`.
pub(crate) fn scratch(target: &Path, backend: &str) -> std::path::PathBuf {
    target.join("xtask-bench").join(format!("{backend}.json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_comm_bench_reports() {
        let doc = parse(
            r#"{"host":"h\"x","np":2,"args":["--op","a\u00e9"],"git_rev":null,"ok":true,
                "rows":[{"op":"all_reduce","dtype":"f32","bytes":1024,"count":256,"time_us":12.5,
                "busbw_gbps":0.08,"wrong":0},{"op":"all_reduce","dtype":"f32","bytes":2048,"count":512,
                "time_us":1.5e1,"busbw_gbps":0.14,"wrong":null}]}"#,
        )
        .unwrap();
        assert_eq!(doc.str("host"), Some("h\"x"));
        let r = rows(&doc).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].bytes, r[0].wrong, r[1].time_us, r[1].wrong), (1024, Some(0), 15.0, None));
        assert!(parse("{\"a\":}").is_err());
        assert!(parse("[1,2] x").is_err());
    }

    #[test]
    fn side_by_side_has_a_ratio_column() {
        let row = |t: f64| Row {
            op: "all_reduce".into(),
            dtype: "f32".into(),
            bytes: 8,
            count: 2,
            time_us: t,
            busbw: 0.1,
            wrong: Some(0),
        };
        let t = table(&[("shm".into(), vec![row(2.0)]), ("mpi".into(), vec![row(5.0)])], 2);
        assert!(t.contains("mpi/shm"), "{t}");
        let line = t.lines().find(|l| l.contains("all_reduce")).unwrap();
        assert!(line.trim_end().ends_with("2.50"), "{line}");
    }
}
