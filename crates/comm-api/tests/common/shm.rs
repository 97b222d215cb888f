//! Helpers of the shm multi-process test binaries.
#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use comm_api::{BackendKind, Config, ProcessGroup};

/// The bound of one multi-process test.
pub const T: Duration = Duration::from_secs(240);

pub async fn connect() -> Result<ProcessGroup, String> {
    comm_api::builder(Config::from_env().map_err(|e| e.to_string())?)
        .backend(BackendKind::Shm)
        .connect()
        .await
        .map_err(|e| e.to_string())
}

/// Names of our segments still present in /dev/shm (created by `pid`).
pub fn leftovers(pid: u32) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&format!("commshm-{pid}-")))
                .collect()
        })
        .unwrap_or_default()
}
