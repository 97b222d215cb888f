//! `init` under a real `torchrun`, whose agent already holds MASTER_PORT with torch's own
//! TCPStore (`TORCHELASTIC_USE_AGENT_STORE=True`): the ranks must meet through that store.
//!
//! Needs torch: `COMM_TEST_TORCHRUN=/path/to/torchrun cargo test -p comm-api --test
//! real_torchrun`. Without it the test prints why it did nothing and passes (CI has no torch;
//! `launchers.rs` runs the same job against a fake agent store).

use std::process::Command;
use std::time::Duration;

use comm_api::{Config, HostBuffer, ReduceOp, StoreKind};
use comm_test::multiprocess::{self, CHILD_ENV};

const T: Duration = Duration::from_secs(120);

async fn job() -> Result<(), String> {
    let cfg = Config::from_env().map_err(|e| e.to_string())?;
    if cfg.world.store != StoreKind::Torch {
        return Err(format!("torchrun should have told us to use its agent store: {}", cfg.world));
    }
    let pg = comm_api::init(cfg).await.map_err(|e| e.to_string())?;
    let out = pg
        .all_reduce(HostBuffer::from_slice(&[pg.rank() as f32 + 1.0; 8]), ReduceOp::Sum)
        .await
        .map_err(|e| e.to_string())?
        .to_vec::<f32>()
        .map_err(|e| e.to_string())?;
    let n = pg.world_size() as f32;
    if out.iter().any(|&x| x != n * (n + 1.0) / 2.0) {
        return Err(format!("wrong all_reduce result {out:?}"));
    }
    println!("{}", pg.describe());
    pg.shutdown().await.map_err(|e| e.to_string())
}

#[test]
fn under_real_torchrun() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return multiprocess::run(2, "under_real_torchrun", T, job);
    }
    let Some(torchrun) = std::env::var_os("COMM_TEST_TORCHRUN") else {
        println!("skipped: set COMM_TEST_TORCHRUN to a torchrun executable to run this test");
        return;
    };
    let exe = std::env::current_exe().expect("the test binary");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let layouts: [&[&str]; 2] = [
        &["--standalone", "--nproc-per-node", "2"],
        &["--nnodes", "1", "--nproc-per-node", "2", "--master-port", &port],
    ];
    for layout in layouts {
        let out = Command::new(&torchrun)
            .args(layout)
            .arg("--no-python")
            .arg(&exe)
            .args(["under_real_torchrun", "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, "1")
            .output()
            .expect("run torchrun");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        let done = text.matches("COMM_TEST_CHILD_DONE").count();
        assert!(
            out.status.success() && done == 2,
            "torchrun {layout:?}: {} with {done} ranks done:\n{text}",
            out.status
        );
        assert!(text.contains("store: torch TCPStore"), "{text}");
        println!("torchrun {layout:?}: ok");
    }
}
