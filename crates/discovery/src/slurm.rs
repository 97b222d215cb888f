//! Slurm's compressed host lists (`node[01-04,07],login1`) and task counts (`2(x3),1`).
//!
//! Both parsers are total: any input gives a value or an error, never a panic, and the
//! expansion is bounded so `n[0-99999999999]` is refused instead of filling memory.

use std::fmt;

/// Most host names [`expand_hostlist`] produces; longer lists are errors.
pub const MAX_HOSTS: usize = 1 << 20;

/// Longest number inside brackets: keeps every bound and the padding width in `u64` range.
const MAX_DIGITS: usize = 18;

/// Why a Slurm value could not be parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseError(pub String);

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ParseError {}

fn err<T>(msg: impl Into<String>) -> Result<T, ParseError> {
    Err(ParseError(msg.into()))
}

/// One `lo-hi` (or single `n`) inside brackets; `width` is the zero-padded width of `lo`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Range {
    lo: u64,
    hi: u64,
    width: usize,
}

impl Range {
    fn len(&self) -> u64 {
        self.hi - self.lo + 1
    }

    fn format(&self, n: u64, out: &mut String) {
        use std::fmt::Write;
        let _ = write!(out, "{n:0width$}", width = self.width);
    }
}

/// A piece of one host expression: literal text, or a bracketed set of ranges.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Part {
    Text(String),
    Ranges(Vec<Range>),
}

impl Part {
    fn count(&self) -> u64 {
        match self {
            Part::Text(_) => 1,
            // Bounded by MAX_DIGITS-digit numbers and a bounded number of ranges; saturate anyway.
            Part::Ranges(rs) => rs.iter().fold(0u64, |n, r| n.saturating_add(r.len())),
        }
    }

    /// The `i`-th name this part stands for (`i < count`).
    fn nth(&self, mut i: u64, out: &mut String) {
        match self {
            Part::Text(t) => out.push_str(t),
            Part::Ranges(rs) => {
                for r in rs {
                    if i < r.len() {
                        r.format(r.lo + i, out);
                        return;
                    }
                    i -= r.len();
                }
            }
        }
    }
}

/// Splits `s` on commas that are not inside brackets.
fn split_top_level(s: &str) -> Result<Vec<&str>, ParseError> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in s.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return err(format!("nested `[` at byte {i}")),
            ']' if depth == 1 => depth = 0,
            ']' => return err(format!("`]` without `[` at byte {i}")),
            ',' if depth == 0 => {
                items.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return err("unclosed `[`");
    }
    items.push(&s[start..]);
    Ok(items)
}

fn parse_number(s: &str) -> Result<(u64, usize), ParseError> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return err(format!("`{s}` is not a number"));
    }
    if s.len() > MAX_DIGITS {
        return err(format!("`{s}` has more than {MAX_DIGITS} digits"));
    }
    // All ASCII digits, at most 18 of them: always fits.
    s.parse::<u64>().map(|n| (n, s.len())).or_else(|_| err(format!("`{s}` is not a number")))
}

fn parse_ranges(inner: &str) -> Result<Vec<Range>, ParseError> {
    let mut ranges = Vec::new();
    for piece in inner.split(',') {
        let piece = piece.trim();
        let (lo, hi) = match piece.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (piece, piece),
        };
        let (lo_n, lo_w) = parse_number(lo)?;
        let (hi_n, _) = parse_number(hi)?;
        if hi_n < lo_n {
            return err(format!("range `{piece}` goes backwards"));
        }
        // Slurm pads to the width of the lower bound when it has a leading zero (`[08-10]`).
        let width = if lo.len() > 1 && lo.starts_with('0') { lo_w } else { 0 };
        ranges.push(Range { lo: lo_n, hi: hi_n, width });
    }
    Ok(ranges)
}

fn parse_item(item: &str) -> Result<Vec<Part>, ParseError> {
    let item = item.trim();
    if item.is_empty() {
        return err("empty host name");
    }
    let mut parts = Vec::new();
    let mut rest = item;
    while !rest.is_empty() {
        match rest.find('[') {
            Some(open) => {
                if open > 0 {
                    parts.push(Part::Text(rest[..open].to_owned()));
                }
                // split_top_level checked the brackets are balanced and not nested.
                let Some(close) = rest[open..].find(']').map(|c| open + c) else {
                    return err(format!("unclosed `[` in `{item}`"));
                };
                let inner = &rest[open + 1..close];
                if inner.trim().is_empty() {
                    return err(format!("empty brackets in `{item}`"));
                }
                parts.push(Part::Ranges(parse_ranges(inner).map_err(|e| ParseError(format!("{e} in `{item}`")))?));
                rest = &rest[close + 1..];
            }
            None => {
                parts.push(Part::Text(rest.to_owned()));
                rest = "";
            }
        }
    }
    Ok(parts)
}

/// Parsed host list: each item is a sequence of parts.
fn parse(list: &str) -> Result<Vec<Vec<Part>>, ParseError> {
    let list = list.trim();
    if list.is_empty() {
        return err("the host list is empty");
    }
    split_top_level(list)?.into_iter().map(parse_item).collect()
}

fn item_count(parts: &[Part]) -> u64 {
    parts.iter().fold(1u64, |n, p| n.saturating_mul(p.count()))
}

/// Every host name of a Slurm host list, in Slurm's order.
///
/// Handles several comma-separated items (`node[1-2],login`), several ranges per bracket
/// (`node[01-04,07]`), several brackets per item (`rack[1-2]-n[1-2]` gives `rack1-n1`,
/// `rack1-n2`, `rack2-n1`, `rack2-n2`) and zero padding (`[08-10]` gives `08 09 10`). Lists
/// longer than [`MAX_HOSTS`] are errors.
pub fn expand_hostlist(list: &str) -> Result<Vec<String>, ParseError> {
    let items = parse(list)?;
    let total = items.iter().fold(0u64, |n, it| n.saturating_add(item_count(it)));
    if total > MAX_HOSTS as u64 {
        return err(format!("the host list names {total} hosts, more than the {MAX_HOSTS} accepted"));
    }
    let mut hosts = Vec::with_capacity(total as usize);
    for parts in &items {
        let n = item_count(parts);
        for mut i in 0..n {
            // Mixed radix, last bracket fastest: the order Slurm lists them in.
            let mut digits = vec![0u64; parts.len()];
            for (d, p) in digits.iter_mut().zip(parts).rev() {
                let c = p.count();
                *d = i % c;
                i /= c;
            }
            let mut name = String::new();
            for (p, d) in parts.iter().zip(digits) {
                p.nth(d, &mut name);
            }
            hosts.push(name);
        }
    }
    Ok(hosts)
}

/// The first host of a Slurm host list, without expanding the rest (rank 0 runs there under
/// Slurm's default block distribution).
pub fn first_host(list: &str) -> Result<String, ParseError> {
    let items = parse(list)?;
    let mut name = String::new();
    // `parse` never returns an empty list.
    for p in items.first().map(Vec::as_slice).unwrap_or_default() {
        p.nth(0, &mut name);
    }
    Ok(name)
}

/// The number of hosts in a Slurm host list (saturating), without expanding it.
pub fn count_hosts(list: &str) -> Result<u64, ParseError> {
    Ok(parse(list)?.iter().fold(0u64, |n, it| n.saturating_add(item_count(it))))
}

/// A parsed `SLURM_TASKS_PER_NODE`-style value: `2(x3),1` is 2 tasks on each of 3 nodes, then 1.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TasksPerNode(Vec<(u32, u32)>);

impl TasksPerNode {
    /// Parses `count[(xrepeat)],...` (`4`, `2(x3),1`).
    pub fn parse(s: &str) -> Result<TasksPerNode, ParseError> {
        let s = s.trim();
        if s.is_empty() {
            return err("the task list is empty");
        }
        let mut groups = Vec::new();
        for piece in s.split(',') {
            let piece = piece.trim();
            let (count, repeat) = match piece.split_once('(') {
                None => (piece, 1),
                Some((count, rest)) => {
                    let Some(r) = rest.strip_suffix(')').and_then(|r| r.trim().strip_prefix(['x', 'X'])) else {
                        return err(format!("`{piece}` is not `count(xrepeat)`"));
                    };
                    let repeat = parse_u32(r.trim(), piece)?;
                    if repeat == 0 {
                        return err(format!("`{piece}` repeats zero times"));
                    }
                    (count.trim(), repeat)
                }
            };
            groups.push((parse_u32(count, piece)?, repeat));
        }
        Ok(TasksPerNode(groups))
    }

    /// Number of nodes described (saturating).
    pub fn nodes(&self) -> u64 {
        self.0.iter().fold(0u64, |n, &(_, r)| n.saturating_add(u64::from(r)))
    }

    /// Total number of tasks (saturating).
    pub fn total(&self) -> u64 {
        self.0.iter().fold(0u64, |n, &(c, r)| n.saturating_add(u64::from(c).saturating_mul(u64::from(r))))
    }

    /// Tasks on node `index` (0-based), or `None` past the end.
    pub fn on_node(&self, mut index: u64) -> Option<u32> {
        for &(c, r) in &self.0 {
            if index < u64::from(r) {
                return Some(c);
            }
            index -= u64::from(r);
        }
        None
    }
}

fn parse_u32(s: &str, piece: &str) -> Result<u32, ParseError> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return err(format!("`{piece}` is not a task count"));
    }
    s.parse::<u32>().or_else(|_| err(format!("`{piece}`: count too large")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(s: &str) -> Vec<String> {
        expand_hostlist(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn real_looking_host_lists() {
        assert_eq!(hosts("node01"), ["node01"]);
        assert_eq!(hosts("node[01-04,07]"), ["node01", "node02", "node03", "node04", "node07"]);
        assert_eq!(hosts("gpu-a100-[8-11]"), ["gpu-a100-8", "gpu-a100-9", "gpu-a100-10", "gpu-a100-11"]);
        assert_eq!(hosts("n[08-10]"), ["n08", "n09", "n10"]);
        assert_eq!(hosts("n[098-101]"), ["n098", "n099", "n100", "n101"]);
        assert_eq!(hosts("a[1-2]-b[3-4]"), ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]);
        assert_eq!(hosts("node[1-2],login1,gpu[001-002]"), ["node1", "node2", "login1", "gpu001", "gpu002"]);
        assert_eq!(hosts("nid[00012,00015-00016]"), ["nid00012", "nid00015", "nid00016"]);
        assert_eq!(hosts("compute-[0]"), ["compute-0"]);
        assert_eq!(hosts("[1-2]x"), ["1x", "2x"]);
        assert_eq!(hosts("r1n[0-1].cluster.local"), ["r1n0.cluster.local", "r1n1.cluster.local"]);
        assert_eq!(hosts(" node[1 - 2] "), ["node1", "node2"]);
        assert_eq!(hosts("10.0.0.[5-6]"), ["10.0.0.5", "10.0.0.6"]);
        assert_eq!(hosts("n[0-999]").len(), 1000);
        assert_eq!(first_host("node[07-09],x").unwrap(), "node07");
        assert_eq!(first_host("rack[3-4]-n[10-12]").unwrap(), "rack3-n10");
        assert_eq!(count_hosts("a[1-3]-b[1-2],c").unwrap(), 7);
    }

    #[test]
    fn bad_host_lists_are_errors() {
        for bad in [
            "",
            " ",
            "node[",
            "node]",
            "node[]",
            "node[1-",
            "node[a-b]",
            "node[3-1]",
            "node[[1]]",
            "a,,b",
            "a,",
            "n[1-2",
            "n[-1]",
            "n[1,]",
            "n[99999999999999999999]",
        ] {
            assert!(expand_hostlist(bad).is_err(), "{bad:?} should be an error");
            assert!(first_host(bad).is_err(), "{bad:?} should be an error");
        }
        let e = expand_hostlist("n[0-99999999999]").unwrap_err();
        assert!(e.0.contains("more than"), "{e}");
        let e = expand_hostlist("a[0-999]b[0-999]c[0-9]").unwrap_err();
        assert!(e.0.contains("10000000 hosts"), "{e}");
        // Counting and the first host still work on lists too long to expand.
        assert_eq!(first_host("n[0-99999999999]").unwrap(), "n0");
        assert_eq!(count_hosts("n[0-99999999999]").unwrap(), 100_000_000_000);
    }

    #[test]
    fn tasks_per_node() {
        let t = TasksPerNode::parse("2(x3),1").unwrap();
        assert_eq!((t.nodes(), t.total()), (4, 7));
        assert_eq!((0..5).map(|i| t.on_node(i)).collect::<Vec<_>>(), [Some(2), Some(2), Some(2), Some(1), None]);
        let t = TasksPerNode::parse("8").unwrap();
        assert_eq!((t.nodes(), t.total(), t.on_node(0)), (1, 8, Some(8)));
        let t = TasksPerNode::parse("4(x2), 3 ,1(X1)").unwrap();
        assert_eq!((t.nodes(), t.total(), t.on_node(2)), (4, 12, Some(3)));
        for bad in ["", "x", "2(x0)", "2(3)", "2(x3", "-1", "2,,1", "1(x4294967296)", "99999999999"] {
            assert!(TasksPerNode::parse(bad).is_err(), "{bad:?} should be an error");
        }
        let t = TasksPerNode::parse("4294967295(x4294967295),4294967295(x4294967295)").unwrap();
        assert_eq!(t.total(), u64::MAX);
    }

    mod fuzz {
        use super::super::*;
        use proptest::prelude::*;

        fn config() -> ProptestConfig {
            // Bounded so it runs in every `cargo test` (and so in `cargo xtask test`);
            // PROPTEST_CASES=1000000 fuzzes longer.
            let cases = std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(2000);
            ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
        }

        proptest! {
            #![proptest_config(config())]

            #[test]
            fn hostlist_never_panics(s in "[a-z0-9\\[\\],\\- ]{0,40}") {
                if let Ok(h) = expand_hostlist(&s) {
                    prop_assert!(!h.is_empty() && h.len() <= MAX_HOSTS);
                    prop_assert_eq!(first_host(&s).ok(), Some(h[0].clone()));
                    prop_assert_eq!(count_hosts(&s).ok(), Some(h.len() as u64));
                }
            }

            #[test]
            fn hostlist_never_panics_on_any_text(s in any::<String>()) {
                let _ = expand_hostlist(&s);
                let _ = first_host(&s);
                let _ = count_hosts(&s);
            }

            #[test]
            fn ranges_expand_as_written(prefix in "[a-z][a-z-]{0,5}", lo in 0u64..500, len in 1u64..50, pad in 0usize..5) {
                let hi = lo + len - 1;
                let lo_text = format!("{lo:0width$}", width = format!("{hi}").len() + pad);
                let list = format!("{prefix}[{lo_text}-{hi}],tail");
                let h = expand_hostlist(&list).unwrap();
                prop_assert_eq!(h.len() as u64, len + 1);
                // Padded to the lower bound's written width exactly when it has a leading zero.
                let width = if lo_text.len() > 1 && lo_text.starts_with('0') { lo_text.len() } else { 0 };
                for (i, name) in h[..len as usize].iter().enumerate() {
                    let n = lo + i as u64;
                    let want = format!("{prefix}{n:0width$}");
                    prop_assert_eq!(name, &want);
                }
                prop_assert_eq!(&h[len as usize], "tail");
            }

            #[test]
            fn tasks_per_node_never_panics(s in "[0-9x(),X ]{0,30}") {
                if let Ok(t) = TasksPerNode::parse(&s) {
                    prop_assert!(t.nodes() >= 1);
                    prop_assert!(t.on_node(t.nodes() - 1).is_some());
                    prop_assert!(t.on_node(t.nodes()).is_none());
                }
            }

            #[test]
            fn tasks_per_node_round_trip(groups in proptest::collection::vec((0u32..64, 1u32..5), 1..6)) {
                let s = groups.iter().map(|&(c, r)| if r == 1 { c.to_string() } else { format!("{c}(x{r})") })
                    .collect::<Vec<_>>().join(",");
                let t = TasksPerNode::parse(&s).unwrap();
                let flat: Vec<u32> = groups.iter().flat_map(|&(c, r)| std::iter::repeat_n(c, r as usize)).collect();
                prop_assert_eq!(t.nodes(), flat.len() as u64);
                prop_assert_eq!(t.total(), flat.iter().map(|&c| u64::from(c)).sum::<u64>());
                for (i, c) in flat.iter().enumerate() {
                    prop_assert_eq!(t.on_node(i as u64), Some(*c));
                }
            }
        }
    }
}
