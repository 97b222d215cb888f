//! The torch TCPStore client against a real torch `TCPStore` server (libuv backend, the
//! default since torch 2.4), with a torch client on the other side reading and writing too.
//!
//! Needs a Python with torch: `COMM_TEST_TORCH_PYTHON=/path/to/python cargo test -p discovery
//! --test real_torch`. Without it the test prints why it did nothing and passes (CI has no
//! torch; `torch_store.rs` covers the protocol there against a fake server).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use comm_core::Store;
use discovery::TorchStore;

const SERVER: &str = r#"
import sys
from datetime import timedelta
import torch
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60),
             use_libuv=sys.argv[1] == "libuv")
print(s.port, torch.__version__, flush=True)
s.set("from_python", "hello")
v = s.get("from_rust")                      # blocks until the Rust client sets it
s.set("echo", v + b"!")
s.wait(["counted"], timedelta(seconds=60))
assert s.add("counter", 0) == 42, "the Rust client's adds"
assert s.compare_set("cas", "one", "two") == b"two"
s.wait(["done"], timedelta(seconds=60))
print("python ok", flush=True)
"#;

#[tokio::test]
async fn against_a_real_torch_tcpstore_libuv() {
    against_a_real_torch_tcpstore("libuv").await;
}

/// torch's older backend (`use_libuv=False`), still selectable.
#[tokio::test]
async fn against_a_real_torch_tcpstore_legacy() {
    against_a_real_torch_tcpstore("legacy").await;
}

async fn against_a_real_torch_tcpstore(backend: &str) {
    let Some(python) = std::env::var_os("COMM_TEST_TORCH_PYTHON") else {
        println!("skipped: set COMM_TEST_TORCH_PYTHON to a Python that has torch to run this test");
        return;
    };
    let mut child = Command::new(python)
        .args(["-c", SERVER, backend])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start python");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let mut words = line.split_whitespace();
    let port: u16 =
        words.next().and_then(|p| p.parse().ok()).unwrap_or_else(|| panic!("no port from python: {line:?}"));
    println!("torch {} TCPStore ({backend} backend) on port {port}", words.next().unwrap_or("?"));

    // torch's Python client prefixes its keys with "/": share its namespace to talk to it.
    let t = Duration::from_secs(30);
    let s = TorchStore::connect("127.0.0.1", port, "/", t, None).await.unwrap();
    assert_eq!(s.get("from_python", t).await.unwrap(), b"hello");
    s.set("from_rust", b"hi").await.unwrap();
    assert_eq!(s.get("echo", t).await.unwrap(), b"hi!");
    assert_eq!(s.add("counter", 40).await.unwrap(), 40);
    assert_eq!(s.add("counter", 2).await.unwrap(), 42);
    assert_eq!(s.compare_set("cas", None, b"one").await.unwrap(), b"one");
    assert_eq!(s.compare_set("cas", Some(b"zzz"), b"nope").await.unwrap(), b"one");
    assert_eq!(s.compare_set("absent", Some(b"x"), b"y").await.unwrap(), b"");
    s.set("counted", b"").await.unwrap();
    assert!(s.check(&["from_python", "echo"]).await.unwrap());
    assert!(!s.check(&["from_python", "missing"]).await.unwrap());
    let e = s.wait(&["from_python", "missing"], Duration::from_millis(300)).await.unwrap_err().to_string();
    assert!(e.contains("`missing`") && !e.contains("`from_python`"), "{e}");
    s.set("to_delete", b"x").await.unwrap();
    assert!(s.delete("to_delete").await.unwrap());
    assert!(!s.delete("to_delete").await.unwrap());
    assert!(s.num_keys().await.unwrap() >= 5);
    let e = s.add("from_python", 1).await.unwrap_err().to_string();
    assert!(e.contains("closed the connection"), "{e}");
    s.set("big", &vec![3u8; 8 << 20]).await.unwrap();
    assert_eq!(s.get("big", t).await.unwrap().len(), 8 << 20);
    // Python waits for this while the above runs: torch's compare_set swapped `cas` meanwhile.
    let deadline = std::time::Instant::now() + t;
    while s.get("cas", t).await.unwrap() != b"two" {
        assert!(std::time::Instant::now() < deadline, "python never swapped `cas`");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    s.set("done", b"").await.unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success() && rest.contains("python ok"), "python: {status} {rest}");
}

/// torch.distributed already serves its store on MASTER_PORT (nothing told us): rank 0 finds
/// the port taken by a torch store and every rank uses it.
#[tokio::test]
async fn a_real_torch_store_on_master_port_is_refused() {
    let Some(python) = std::env::var_os("COMM_TEST_TORCH_PYTHON") else {
        println!("skipped: set COMM_TEST_TORCH_PYTHON to a Python that has torch to run this test");
        return;
    };
    let script = "import sys\nfrom torch.distributed import TCPStore\n\
                  s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n\
                  print(s.port, flush=True)\nsys.stdin.read()\n";
    let mut child = Command::new(python)
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start python");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let port: u16 = line.trim().parse().unwrap_or_else(|_| panic!("no port from python: {line:?}"));
    let mut ranks = Vec::new();
    for rank in 0..3 {
        let mut w = comm_core::WorldInfo::single();
        (w.rank, w.world_size, w.local_rank, w.local_world_size, w.master_port) = (rank, 3, rank, 3, port);
        w.source.launcher = comm_core::Launcher::Explicit;
        ranks.push(tokio::spawn(async move { discovery::rendezvous(&w, Duration::from_secs(30)).await }));
    }
    // Not this job's store (it was not started by torchrun): every rank is refused.
    for t in ranks {
        let e = t.await.unwrap().map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("torch TCPStore"), "{e}");
    }
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
}
