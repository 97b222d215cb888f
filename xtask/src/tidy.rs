//! `cargo xtask tidy`: the structure rules every change keeps (rust-analyzer's tidy tests are the
//! model), run first by `cargo xtask test`:
//! - no import circle among the files of one crate (through `crate::`, `super::` and `self::`
//!   paths in non-test code; the crate root hands names on and is left out);
//! - no source file over [`MAX_LINES`] lines;
//! - every `COMM_*` variable the code reads is in README's Environment table, and every one the
//!   table lists is read;
//! - every type ARCHITECTURE's vocabulary table names exists;
//! - README's first screen names `cargo xtask test` and `cargo xtask bench`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use crate::{root, Failure, Result};

/// The longest a source file may be.
const MAX_LINES: usize = 800;
/// How many of README's lines are its first screen.
const FIRST_SCREEN: usize = 40;
/// The crate whose `COMM_*` variables are the test harness's own (xtask's are ones it sets).
const HARNESS: &str = "comm-test";

pub(crate) fn tidy() -> Result {
    let root = root();
    let problems = problems(&root).map_err(|e| Failure { code: 1, msg: format!("tidy: reading the tree: {e}") })?;
    if problems.is_empty() {
        println!("tidy: no import circle, no file over {MAX_LINES} lines, environment and vocabulary tables true");
        return Ok(());
    }
    for p in &problems {
        println!("tidy: {p}");
    }
    Err(Failure { code: 1, msg: format!("tidy: {} problem(s), listed above", problems.len()) })
}

/// Every broken rule, one line each.
fn problems(root: &Path) -> std::io::Result<Vec<String>> {
    let mut out = Vec::new();
    let mut crates: Vec<PathBuf> = fs::read_dir(root.join("crates"))?.flatten().map(|e| e.path()).collect();
    crates.push(root.join("xtask"));
    crates.sort();
    let mut sources = Vec::new();
    for dir in &crates {
        let files = rust_files(dir)?;
        let src: Vec<&PathBuf> = files.iter().filter(|f| f.starts_with(dir.join("src"))).collect();
        let texts: Vec<(PathBuf, String)> =
            src.iter().map(|f| Ok(((*f).clone(), fs::read_to_string(f)?))).collect::<std::io::Result<_>>()?;
        for circle in circles(&dir.join("src"), &texts) {
            let names: Vec<String> = circle.iter().map(|p| shown(root, p)).collect();
            out.push(format!("import circle: {}", names.join(" ⇄ ")));
        }
        for f in &files {
            let n = fs::read_to_string(f)?.lines().count();
            if n > MAX_LINES {
                out.push(format!("{} has {n} lines (at most {MAX_LINES})", shown(root, f)));
            }
        }
        if !dir.ends_with(HARNESS) && !dir.ends_with("xtask") {
            sources.extend(texts);
        }
    }
    let readme = fs::read_to_string(root.join("README.md"))?;
    out.extend(environment(&readme, &sources));
    let architecture = fs::read_to_string(root.join("ARCHITECTURE.md"))?;
    out.extend(vocabulary(&architecture, &sources));
    let first: String = readme.lines().take(FIRST_SCREEN).collect::<Vec<_>>().join("\n");
    for cmd in ["cargo xtask test", "cargo xtask bench"] {
        if !first.contains(cmd) {
            out.push(format!("README's first {FIRST_SCREEN} lines do not name `{cmd}`"));
        }
    }
    Ok(out)
}

/// `.rs` files under `dir`, outside `target`.
fn rust_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in fs::read_dir(&d)?.flatten() {
            let p = e.path();
            if p.is_dir() && !p.ends_with("target") {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    Ok(out)
}

fn shown(root: &Path, p: &Path) -> String {
    p.strip_prefix(root).unwrap_or(p).display().to_string()
}

/// A file's code up to its first `#[cfg(test)]`, without `//` comments.
fn non_test(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        if line.trim_start().starts_with("#[cfg(test)]") {
            break;
        }
        out.push_str(line.split("//").next().unwrap_or(""));
        out.push('\n');
    }
    out
}

/// The module path of a file under `src` (`engine/mod.rs` → `["engine"]`; the root is `[]`).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap_or(file).with_extension("");
    let mut parts: Vec<String> = rel.iter().map(|s| s.to_string_lossy().into_owned()).collect();
    match parts.last().map(String::as_str) {
        Some("lib" | "main") if parts.len() == 1 => parts.clear(),
        Some("mod") => {
            parts.pop();
        }
        _ => {}
    }
    parts
}

/// The paths a file's code names through `crate::`, `super::` or `self::`, as module paths from
/// the crate root (`use super::{a::B, c}` in `x::y` gives `x::a::B` and `x::c`).
fn references(module: &[String], code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut i = 0;
    while i < bytes.len() {
        let head = ["crate", "super", "self"].into_iter().find(|h| bytes[i..].starts_with(h.as_bytes()));
        let Some(head) = head.filter(|h| (i == 0 || !ident(bytes[i - 1])) && bytes[i + h.len()..].starts_with(b"::"))
        else {
            i += 1;
            continue;
        };
        // The path: `head(::ident)*`, then maybe `::{group}`.
        let mut j = i + head.len();
        let mut tail = Vec::new();
        let mut group = None;
        while bytes[j..].starts_with(b"::") {
            let k = j + 2;
            if bytes[k..].starts_with(b"{") {
                let end = bytes[k..].iter().position(|&c| c == b'}').map_or(code.len(), |e| k + e);
                group = Some(&code[k + 1..end]);
                j = end;
                break;
            }
            let len = bytes[k..].iter().take_while(|&&c| ident(c)).count();
            if len == 0 {
                break;
            }
            tail.push(code[k..k + len].to_string());
            j = k + len;
        }
        let mut base: Vec<String> = match head {
            "crate" => Vec::new(),
            "self" => module.to_vec(),
            _ => module[..module.len().saturating_sub(1)].to_vec(),
        };
        if head == "super" {
            while tail.first().is_some_and(|t| t == "super") {
                base.pop();
                tail.remove(0);
            }
        }
        base.extend(tail);
        match group {
            Some(g) => {
                for item in g.split(',') {
                    let item = item.split(" as ").next().unwrap_or("");
                    let mut path = base.clone();
                    path.extend(
                        item.split("::").map(str::trim).filter(|s| !s.is_empty() && *s != "self").map(String::from),
                    );
                    out.push(path);
                }
            }
            None => out.push(base),
        }
        i = j.max(i + 1);
    }
    out
}

/// Files of one crate (`texts`: its `src` files) that import each other in a loop, each loop
/// sorted; the crate root is left out (it hands names on).
fn circles(src: &Path, texts: &[(PathBuf, String)]) -> Vec<Vec<PathBuf>> {
    let modules: BTreeMap<Vec<String>, usize> =
        texts.iter().enumerate().map(|(i, (p, _))| (module_of(src, p), i)).collect();
    let resolve = |path: &[String]| (0..=path.len()).rev().find_map(|k| modules.get(&path[..k]).copied());
    let root = modules.get(&Vec::new()).copied();
    let mut edges: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); texts.len()];
    for (i, (p, text)) in texts.iter().enumerate() {
        let module = module_of(src, p);
        if module.is_empty() {
            continue;
        }
        for r in references(&module, &non_test(text)) {
            if let Some(q) = resolve(&r).filter(|&q| q != i && Some(q) != root) {
                edges[i].insert(q);
            }
        }
    }
    strongly_connected(&edges)
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|c| {
            let mut files: Vec<PathBuf> = c.into_iter().map(|i| texts[i].0.clone()).collect();
            files.sort();
            files
        })
        .collect()
}

/// Tarjan's strongly connected components, iteratively.
fn strongly_connected(edges: &[BTreeSet<usize>]) -> Vec<Vec<usize>> {
    const NONE: usize = usize::MAX;
    let n = edges.len();
    let (mut index, mut low, mut on) = (vec![NONE; n], vec![0; n], vec![false; n]);
    let (mut stack, mut out, mut next) = (Vec::new(), Vec::new(), 0);
    for start in 0..n {
        if index[start] != NONE {
            continue;
        }
        // The depth-first path: each node with the edges it has not followed yet.
        let mut walk: Vec<(usize, Vec<usize>)> = Vec::new();
        let mut enter = Some(start);
        loop {
            if let Some(v) = enter.take() {
                (index[v], low[v], on[v]) = (next, next, true);
                next += 1;
                stack.push(v);
                walk.push((v, edges[v].iter().rev().copied().collect()));
            }
            let Some((v, todo)) = walk.last_mut() else { break };
            let v = *v;
            if let Some(w) = todo.pop() {
                if index[w] == NONE {
                    enter = Some(w);
                } else if on[w] {
                    low[v] = low[v].min(index[w]);
                }
                continue;
            }
            walk.pop();
            if let Some(&(parent, _)) = walk.last() {
                low[parent] = low[parent].min(low[v]);
            }
            if low[v] == index[v] {
                let mut component = Vec::new();
                while let Some(w) = stack.pop() {
                    on[w] = false;
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                out.push(component);
            }
        }
    }
    out
}

/// `COMM_*` names quoted in code (`"COMM_TIMEOUT"`).
fn variables_read(sources: &[(PathBuf, String)]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (_, text) in sources {
        let code = non_test(text);
        for (i, _) in code.match_indices("\"COMM_") {
            let name: String = code[i + 1..]
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            if name.len() > 5 && code[i + 1 + name.len()..].starts_with('"') {
                out.insert(name);
            }
        }
    }
    out
}

/// The `COMM_*` names in the first column of README's Environment table.
fn variables_listed(readme: &str) -> BTreeSet<String> {
    let section = readme.split("\n## Environment").nth(1).unwrap_or("");
    let section = section.split("\n## ").next().unwrap_or("");
    let mut out = BTreeSet::new();
    for row in section.lines().filter(|l| l.starts_with('|')) {
        let first = row.split('|').nth(1).unwrap_or("");
        for quoted in first.split('`').skip(1).step_by(2) {
            if quoted.starts_with("COMM_") {
                out.insert(quoted.to_string());
            }
        }
    }
    out
}

fn environment(readme: &str, sources: &[(PathBuf, String)]) -> Vec<String> {
    let (read, listed) = (variables_read(sources), variables_listed(readme));
    let missing =
        read.difference(&listed).map(|v| format!("`{v}` is read by the code but not in README's Environment table"));
    let stale =
        listed.difference(&read).map(|v| format!("`{v}` is in README's Environment table but no code reads it"));
    missing.chain(stale).collect()
}

/// The names in the first column of ARCHITECTURE's vocabulary table (the one whose header is
/// `| name | what it is |`) that are code (backquoted), without generics.
fn vocabulary_names(architecture: &str) -> Vec<String> {
    let Some(start) = architecture.find("| name | what it is |") else { return Vec::new() };
    let mut out = Vec::new();
    for row in architecture[start..].lines().skip(2).take_while(|l| l.starts_with('|')) {
        let first = row.split('|').nth(1).unwrap_or("").trim();
        if let Some(name) = first.strip_prefix('`').and_then(|s| s.split('`').next()) {
            out.push(name.split('<').next().unwrap_or(name).to_string());
        }
    }
    out
}

fn vocabulary(architecture: &str, sources: &[(PathBuf, String)]) -> Vec<String> {
    let names = vocabulary_names(architecture);
    if names.is_empty() {
        return vec!["ARCHITECTURE.md has no vocabulary table (`| name | what it is |`)".into()];
    }
    names
        .into_iter()
        .filter(|name| {
            !sources.iter().any(|(_, text)| {
                ["struct", "enum", "trait", "type"].iter().any(|kw| {
                    text.match_indices(&format!("{kw} {name}")).any(|(i, m)| {
                        let after = text[i + m.len()..].chars().next();
                        !after.is_some_and(|c| c.is_alphanumeric() || c == '_')
                    })
                })
            })
        })
        .map(|name| format!("ARCHITECTURE's vocabulary names `{name}`, which no crate defines"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_resolve_like_the_compiler() {
        let m = |s: &str| s.split("::").map(String::from).collect::<Vec<_>>();
        let code = "use super::{header::OpLabel, p2p::P2p as Q};\nuse crate::raw::{self, Comm};\nlet x = self::a::b;\nmy_crate::x; super::super::top::T";
        let refs = references(&m("engine::group"), code);
        assert_eq!(
            refs,
            [
                m("engine::header::OpLabel"),
                m("engine::p2p::P2p"),
                m("raw"),
                m("raw::Comm"),
                m("engine::group::a::b"),
                m("top::T"),
            ]
        );
        assert_eq!(non_test("a // b\n#[cfg(test)]\nc"), "a \n");
    }

    #[test]
    fn circles_are_found_and_the_root_is_left_out() {
        let src = Path::new("/c/src");
        let file = |p: &str, t: &str| (src.join(p), t.to_string());
        let texts = [
            file("lib.rs", "use crate::a::A; use crate::b::B;"),
            file("a.rs", "use crate::b::B;"),
            file("b/mod.rs", "use crate::c::C;"),
            file("c.rs", "use super::a::A; use crate::X;"),
            file("d.rs", "use crate::a::A;\n#[cfg(test)]\nuse crate::d2::D;"),
            file("d2.rs", "use crate::d::D;"),
        ];
        assert_eq!(circles(src, &texts), [vec![src.join("a.rs"), src.join("b/mod.rs"), src.join("c.rs")]]);
        assert!(circles(src, &texts[..3]).is_empty());
    }

    #[test]
    fn environment_and_vocabulary_are_checked_both_ways() {
        let readme = "# x\n## Environment\n\n| variable | meaning |\n|---|---|\n| `COMM_A`, `COMM_B` | uses `COMM_C` |\n| `RANK` | r |\n\n## Next\n| `COMM_D` | |\n";
        let code = vec![(
            PathBuf::from("x.rs"),
            "env(\"COMM_A\"); env(\"COMM_E\");\n#[cfg(test)]\nenv(\"COMM_B\")".to_string(),
        )];
        assert_eq!(
            environment(readme, &code),
            [
                "`COMM_E` is read by the code but not in README's Environment table",
                "`COMM_B` is in README's Environment table but no code reads it",
            ]
        );
        let arch = "| name | what it is | shm |\n|---|---|---|\n| `Plan` | a | b |\n| `Pending<R>` | c |\n| worker | d |\n\n| `Gone` |";
        assert_eq!(vocabulary_names(arch), ["Plan", "Pending"]);
        let code = vec![(PathBuf::from("x.rs"), "pub trait Plan {}\nstruct PendingMore;".to_string())];
        assert_eq!(vocabulary(arch, &code), ["ARCHITECTURE's vocabulary names `Pending`, which no crate defines"]);
    }
}
