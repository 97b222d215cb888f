//! The availability probe against real (fake) libraries, through cudarc's real loader: a stub
//! `libcuda.so` whose `cuInit` reports "no CUDA-capable device", and a stub `libnccl.so`. Each
//! case re-runs this test binary with `LD_LIBRARY_PATH` pointing at the stubs (the loader reads
//! it at process start). Needs a C compiler (`cc`); skipped without one.

use std::path::{Path, PathBuf};
use std::process::Command;

use backend_nccl::{is_available, NcclBackend, NcclOptions};
use comm_core::{CommError, MemoryStore, Store};

const CHILD: &str = "BACKEND_NCCL_FAKE_DRIVER_CHILD";

const FAKE_CUDA: &str = r#"
static const char *msg = "no CUDA-capable device is detected";
static const char *name = "CUDA_ERROR_NO_DEVICE";
int cuInit(unsigned int flags) { (void)flags; return 100; }
int cuDeviceGetCount(int *n) { *n = 0; return 100; }
int cuDeviceGet(int *d, int o) { (void)d; (void)o; return 100; }
int cuDriverGetVersion(int *v) { *v = 13000; return 0; }
int cuGetErrorString(int e, const char **s) { (void)e; *s = msg; return 0; }
int cuGetErrorName(int e, const char **s) { (void)e; *s = name; return 0; }
"#;

const FAKE_NCCL: &str = r#"
int ncclGetVersion(int *v) { *v = 22803; return 0; }
const char *ncclGetErrorString(int r) { (void)r; return "fake"; }
"#;

fn build(dir: &Path, name: &str, src: &str) -> bool {
    let c = dir.join(format!("{name}.c"));
    std::fs::write(&c, src).unwrap();
    let out = dir.join(format!("lib{name}.so"));
    Command::new("cc").args(["-shared", "-fPIC", "-o"]).arg(&out).arg(&c).status().is_ok_and(|s| s.success())
}

fn stubs(case: &str, with_nccl: bool) -> Option<PathBuf> {
    let dir = std::env::temp_dir().join(format!("backend-nccl-fake-{case}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    if !build(&dir, "cuda", FAKE_CUDA) || (with_nccl && !build(&dir, "nccl", FAKE_NCCL)) {
        println!("skipped: no C compiler (cc) to build the stub libraries");
        return None;
    }
    Some(dir)
}

/// Runs `probe_in_child` in a child with the stubs on LD_LIBRARY_PATH; returns its output.
fn child(dir: &Path) -> String {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args(["probe_in_child", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env("LD_LIBRARY_PATH", dir)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_dir_all(dir);
    assert!(out.status.success(), "child failed:\n{text}");
    text
}

#[test]
fn probe_in_child() {
    if std::env::var_os(CHILD).is_none() {
        return; // only meaningful as the child of the tests below
    }
    let e = is_available().unwrap_err();
    println!("PROBE: {e}");
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let store: std::sync::Arc<dyn Store> = std::sync::Arc::new(MemoryStore::new());
    let e2 = rt.block_on(NcclBackend::new(store, 0, 1, NcclOptions::default())).unwrap_err();
    assert!(matches!(e2, CommError::Unavailable { .. }), "{e2:?}");
    println!("JOIN: {e2}");
}

#[test]
fn libcuda_without_libnccl_names_nccl() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    // The child's loader finds libraries through LD_LIBRARY_PATH (the stubs) and then the
    // system's cache: a machine with NCCL installed cannot show a missing one.
    let cache = Command::new("ldconfig").arg("-p").output().map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    if let Some(line) = cache.iter().flat_map(|c| c.lines()).find(|l| l.trim_start().starts_with("libnccl.so ")) {
        println!("skipped: a system NCCL is installed ({}), so the loader finds it", line.trim());
        return;
    }
    let Some(dir) = stubs("nonccl", false) else { return };
    let out = child(&dir);
    assert!(out.contains("PROBE: backend `nccl` is unavailable: the NCCL library (libnccl.so) was not found"), "{out}");
    assert!(out.contains("JOIN: backend `nccl` is unavailable"), "{out}");
}

#[test]
fn libcuda_and_libnccl_without_a_device_names_the_driver_error() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let Some(dir) = stubs("nodev", true) else { return };
    let out = child(&dir);
    assert!(
        out.contains("PROBE: backend `nccl` is unavailable: the CUDA driver failed to initialise (cuInit)"),
        "{out}"
    );
    assert!(out.contains("no CUDA-capable device is detected"), "{out}");
    assert!(!out.contains("panicked"), "no panic, not even a caught one: {out}");
}
