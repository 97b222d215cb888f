//! Can NCCL run here? Probes libcuda, libnccl and a visible device without panicking.
//!
//! cudarc loads libraries lazily and *panics* on the first call when a library (or a symbol)
//! is missing. The probe first asks cudarc's non-panicking presence checks, and runs every call
//! that loads something inside `comm_core::catch_panic` (with `panic = "abort"` a missing
//! *symbol* would still abort the process; a missing library never gets that far).

use std::sync::OnceLock;

use comm_core::CommError;

use crate::{ffi, BACKEND};

/// What the probe found on a machine where NCCL can run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclInfo {
    /// NCCL version as `(major, minor, patch)`.
    pub nccl_version: (u32, u32, u32),
    /// The CUDA version the driver supports, as `(major, minor)`.
    pub driver_cuda_version: (u32, u32),
    /// Number of visible CUDA devices (after `CUDA_VISIBLE_DEVICES`).
    pub devices: usize,
}

/// Oldest NCCL this backend accepts: 2.10 brought `ncclAvg` and bf16.
pub const MIN_NCCL: (u32, u32) = (2, 10);

/// Whether this backend can run here: libcuda and libnccl load, the driver initialises, a
/// device is visible and NCCL is recent enough. Never panics.
///
/// `Err` is always [`CommError::Unavailable`], naming what is missing and what to do about it.
/// The result is computed once per process.
pub fn is_available() -> Result<NcclInfo, CommError> {
    static PROBE: OnceLock<Result<NcclInfo, String>> = OnceLock::new();
    PROBE.get_or_init(|| diagnose(&System)).clone().map_err(|why| CommError::Unavailable { backend: BACKEND, why })
}

/// The machine as the probe sees it (a trait so every branch is tested without a GPU).
pub(crate) trait Machine {
    fn cuda_lib(&self) -> bool;
    fn nccl_lib(&self) -> bool;
    /// A library the loader finds under this exact name.
    fn loadable(&self, name: &str) -> bool;
    fn cu_init(&self) -> Result<(), String>;
    fn device_count(&self) -> Result<usize, String>;
    fn driver_version(&self) -> Result<i32, String>;
    fn nccl_version(&self) -> Result<i32, String>;
}

/// The real machine.
struct System;

fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    comm_core::catch_panic(f).unwrap_or_else(|msg| Err(format!("{what} panicked in cudarc's loader: {msg}")))
}

impl Machine for System {
    fn cuda_lib(&self) -> bool {
        ffi::cuda_lib_present()
    }
    fn nccl_lib(&self) -> bool {
        ffi::nccl_lib_present()
    }
    fn loadable(&self, name: &str) -> bool {
        ffi::loadable(name)
    }
    fn cu_init(&self) -> Result<(), String> {
        guarded("cuInit", || cudarc::driver::result::init().map_err(|e| e.to_string()))
    }
    fn device_count(&self) -> Result<usize, String> {
        guarded("cuDeviceGetCount", || {
            cudarc::driver::result::device::get_count().map(|n| n.max(0) as usize).map_err(|e| e.to_string())
        })
    }
    fn driver_version(&self) -> Result<i32, String> {
        guarded("cuDriverGetVersion", || ffi::driver_version().map_err(|e| e.to_string()))
    }
    fn nccl_version(&self) -> Result<i32, String> {
        guarded("ncclGetVersion", || {
            cudarc::nccl::result::get_nccl_version().map_err(|e| crate::error::describe(e.0).1.to_owned())
        })
    }
}

/// `NCCL_VERSION_CODE` to `(major, minor, patch)` (the encoding changed at 2.9).
pub(crate) fn decode_nccl_version(code: i32) -> (u32, u32, u32) {
    let v = code.max(0) as u32;
    if v >= 20900 {
        (v / 10000, (v / 100) % 100, v % 100)
    } else {
        (v / 1000, (v / 100) % 10, v % 100)
    }
}

pub(crate) fn diagnose(m: &dyn Machine) -> Result<NcclInfo, String> {
    if !m.cuda_lib() {
        return Err("the CUDA driver library (libcuda.so / libcuda.so.1) was not found: no NVIDIA driver is installed here, or its directory is not on LD_LIBRARY_PATH".into());
    }
    if !m.nccl_lib() {
        let so2 = m.loadable("libnccl.so.2");
        return Err(if so2 {
            "libnccl.so.2 is installed but cudarc loads NCCL as `libnccl.so`: create a symlink named libnccl.so to it in a directory on LD_LIBRARY_PATH (or the ldconfig cache), e.g. `ln -s $(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}') /usr/local/lib/libnccl.so && ldconfig`".into()
        } else {
            "the NCCL library (libnccl.so) was not found: install NCCL (e.g. `apt install libnccl2 libnccl-dev`, or `pip install nvidia-nccl-cu12` and symlink its lib/libnccl.so.2 as libnccl.so on LD_LIBRARY_PATH)".into()
        });
    }
    m.cu_init().map_err(|e| format!("the CUDA driver failed to initialise (cuInit): {e}"))?;
    let devices = m.device_count().map_err(|e| format!("cannot count CUDA devices: {e}"))?;
    if devices == 0 {
        let vis =
            std::env::var("CUDA_VISIBLE_DEVICES").map(|v| format!(" (CUDA_VISIBLE_DEVICES={v:?})")).unwrap_or_default();
        return Err(format!("no CUDA device is visible{vis}"));
    }
    let driver = m.driver_version().map_err(|e| format!("cannot read the driver's CUDA version: {e}"))?;
    let nccl = m.nccl_version().map_err(|e| format!("cannot read NCCL's version (ncclGetVersion): {e}"))?;
    let nccl_version = decode_nccl_version(nccl);
    if (nccl_version.0, nccl_version.1) < MIN_NCCL {
        let (a, b, c) = nccl_version;
        return Err(format!("NCCL {a}.{b}.{c} is too old: {}.{} or newer is needed", MIN_NCCL.0, MIN_NCCL.1));
    }
    let driver = driver.max(0) as u32;
    Ok(NcclInfo { nccl_version, driver_cuda_version: (driver / 1000, (driver % 1000) / 10), devices })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone)]
    struct Fake {
        cuda: bool,
        nccl: bool,
        so2: bool,
        init: Result<(), String>,
        count: Result<usize, String>,
        nccl_version: Result<i32, String>,
    }

    impl Fake {
        fn gpu() -> Fake {
            Fake { cuda: true, nccl: true, so2: true, init: Ok(()), count: Ok(1), nccl_version: Ok(22803) }
        }
    }

    impl Machine for Fake {
        fn cuda_lib(&self) -> bool {
            self.cuda
        }
        fn nccl_lib(&self) -> bool {
            self.nccl
        }
        fn loadable(&self, name: &str) -> bool {
            name == "libnccl.so.2" && self.so2
        }
        fn cu_init(&self) -> Result<(), String> {
            self.init.clone()
        }
        fn device_count(&self) -> Result<usize, String> {
            self.count.clone()
        }
        fn driver_version(&self) -> Result<i32, String> {
            Ok(13000)
        }
        fn nccl_version(&self) -> Result<i32, String> {
            self.nccl_version.clone()
        }
    }

    #[test]
    fn every_missing_piece_is_named() {
        let ok = diagnose(&Fake::gpu()).unwrap();
        assert_eq!(ok, NcclInfo { nccl_version: (2, 28, 3), driver_cuda_version: (13, 0), devices: 1 });

        let e = diagnose(&Fake { cuda: false, ..Fake::gpu() }).unwrap_err();
        assert!(e.contains("libcuda"), "{e}");
        let e = diagnose(&Fake { nccl: false, ..Fake::gpu() }).unwrap_err();
        assert!(e.contains("libnccl.so.2 is installed") && e.contains("symlink"), "{e}");
        let e = diagnose(&Fake { nccl: false, so2: false, ..Fake::gpu() }).unwrap_err();
        assert!(e.contains("libnccl.so) was not found"), "{e}");
        let e = diagnose(&Fake {
            init: Err("CUDA_ERROR_NO_DEVICE, \"no CUDA-capable device is detected\"".into()),
            ..Fake::gpu()
        })
        .unwrap_err();
        assert!(e.contains("cuInit") && e.contains("no CUDA-capable device"), "{e}");
        let e = diagnose(&Fake { count: Ok(0), ..Fake::gpu() }).unwrap_err();
        assert!(e.contains("no CUDA device is visible"), "{e}");
        let e = diagnose(&Fake { nccl_version: Ok(2708), ..Fake::gpu() }).unwrap_err();
        assert!(e.contains("NCCL 2.7.8 is too old"), "{e}");
        let e =
            diagnose(&Fake { nccl_version: Err("Missing symbol ncclGetVersion".into()), ..Fake::gpu() }).unwrap_err();
        assert!(e.contains("ncclGetVersion"), "{e}");
    }

    #[test]
    fn versions_decode_both_encodings() {
        assert_eq!(decode_nccl_version(22803), (2, 28, 3));
        assert_eq!(decode_nccl_version(21003), (2, 10, 3));
        assert_eq!(decode_nccl_version(2708), (2, 7, 8));
    }

    #[test]
    fn a_loader_panic_is_contained() {
        let r: Result<(), String> =
            guarded("cuInit", || panic!("Unable to dynamically load the \"cuda\" shared library"));
        let e = r.unwrap_err();
        assert!(e.contains("cuInit panicked") && e.contains("Unable to dynamically load"), "{e}");
    }

    #[test]
    fn the_real_probe_never_panics_and_explains_itself() {
        match is_available() {
            Ok(info) => assert!(info.devices > 0 && info.nccl_version.0 >= 2, "{info:?}"),
            Err(CommError::Unavailable { backend, why }) => {
                assert_eq!(backend, "nccl");
                assert!(!why.is_empty());
                eprintln!("nccl unavailable here (as expected without a GPU): {why}");
            }
            Err(other) => panic!("expected Unavailable, got {other:?}"),
        }
        // A second call answers from the cache, identically.
        assert_eq!(is_available().is_ok(), is_available().is_ok());
    }
}
