//! Reading back the JSON reports that `--json` writes, for `--baseline`, `comm-bench plot` and
//! `comm-bench compare`.
//!
//! The reader is lenient: unknown fields are ignored, and a row without its own `backend` or
//! `np` takes the document's (reports written before those fields were per row).

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// One row of a saved report: what `--baseline` matches on and what the plot draws.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub(crate) struct SavedRow {
    pub(crate) op: String,
    pub(crate) dtype: String,
    pub(crate) bytes: u64,
    pub(crate) busbw_gbps: f64,
    #[serde(default)]
    pub(crate) time_us: f64,
    #[serde(default)]
    pub(crate) backend: String,
    #[serde(default)]
    pub(crate) np: u32,
    /// Wrong elements (`None`: not checked).
    #[serde(default)]
    pub(crate) wrong: Option<u64>,
}

/// A saved report: its machine description and rows.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct SavedReport {
    /// Where it was read from (not in the JSON).
    #[serde(skip)]
    pub(crate) path: PathBuf,
    #[serde(default)]
    pub(crate) host: Option<String>,
    #[serde(default)]
    pub(crate) cpu: Option<String>,
    #[serde(default)]
    pub(crate) git_rev: Option<String>,
    #[serde(default)]
    pub(crate) backend: Option<String>,
    #[serde(default)]
    pub(crate) np: Option<u32>,
    pub(crate) rows: Vec<SavedRow>,
}

impl SavedReport {
    /// Parses a report, filling each row's missing `backend` / `np` from the document.
    pub(crate) fn parse(text: &str, path: &Path) -> Result<SavedReport, String> {
        let mut r: SavedReport =
            serde_json::from_str(text).map_err(|e| format!("{}: not a comm-bench JSON report: {e}", path.display()))?;
        r.path = path.to_path_buf();
        for row in &mut r.rows {
            if row.backend.is_empty() {
                row.backend = r.backend.clone().unwrap_or_else(|| "?".to_owned());
            }
            if row.np == 0 {
                row.np = r.np.unwrap_or(0);
            }
        }
        Ok(r)
    }

    /// Reads and parses the report at `path`.
    pub(crate) fn load(path: &Path) -> Result<SavedReport, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
        SavedReport::parse(&text, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_inherit_backend_and_np() {
        let r = SavedReport::parse(
            r#"{"host":"h","backend":"mpi","np":4,"extra":[1,2],"rows":[
                {"op":"all_reduce","dtype":"f32","bytes":8,"busbw_gbps":0.5,"time_us":1.0},
                {"op":"all_reduce","dtype":"f32","bytes":16,"busbw_gbps":0.7,"backend":"shm","np":2}]}"#,
            Path::new("x.json"),
        )
        .unwrap();
        assert_eq!(r.host.as_deref(), Some("h"));
        assert_eq!((r.rows[0].backend.as_str(), r.rows[0].np), ("mpi", 4));
        assert_eq!((r.rows[1].backend.as_str(), r.rows[1].np), ("shm", 2));
        let e = SavedReport::parse("{\"rows\": 3}", Path::new("bad.json")).unwrap_err();
        assert!(e.contains("bad.json") && e.contains("not a comm-bench JSON report"), "{e}");
    }
}
