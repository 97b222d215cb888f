//! The torch TCPStore client against a fake torch server written from torch's sources
//! (`support/fake_torch.rs`), with hand-written byte fixtures.

mod support {
    pub mod fake_torch;
}

use std::sync::Arc;
use std::time::{Duration, Instant};

use comm_core::{CommError, Launcher, Store, StoreKind, WorldInfo, WorldSource};
use discovery::{rendezvous, StoreServer, TorchStore};
use support::fake_torch::FakeTorchStore;

const T: Duration = Duration::from_secs(10);

async fn client(s: &FakeTorchStore, prefix: &str) -> TorchStore {
    TorchStore::connect("127.0.0.1", s.port(), prefix, T, None).await.unwrap()
}

/// `u64` little-endian length, then the bytes: how torch sends strings and vectors.
fn lv(b: &[u8]) -> Vec<u8> {
    [&(b.len() as u64).to_le_bytes()[..], b].concat()
}

#[tokio::test]
async fn every_op_with_torchs_semantics() {
    let srv = FakeTorchStore::start();
    let s = client(&srv, "p/").await;
    s.set("k", b"v").await.unwrap();
    assert_eq!(srv.value(b"p/k").as_deref(), Some(&b"v"[..]), "keys live under the prefix");
    assert_eq!(s.get("k", T).await.unwrap(), b"v");
    assert_eq!(s.add("n", 5).await.unwrap(), 5);
    assert_eq!(s.add("n", -7).await.unwrap(), -2);
    assert_eq!(srv.value(b"p/n").as_deref(), Some(&b"-2"[..]), "counters are decimal strings, as in torch");
    // compare_set: absent + None sets; a match swaps; a mismatch returns the current value.
    assert_eq!(s.compare_set("c", None, b"a").await.unwrap(), b"a");
    assert_eq!(s.compare_set("c", Some(b"x"), b"b").await.unwrap(), b"a");
    assert_eq!(s.compare_set("c", Some(b"a"), b"b").await.unwrap(), b"b");
    // torch answers an absent key with `expected`; the client maps that back to "absent".
    assert_eq!(s.compare_set("absent", Some(b"x"), b"y").await.unwrap(), b"");
    assert_eq!(srv.value(b"p/absent"), None);
    assert!(s.delete("c").await.unwrap());
    assert!(!s.delete("c").await.unwrap());
    assert!(s.check(&["k", "n"]).await.unwrap());
    assert!(!s.check(&["k", "c"]).await.unwrap());
    assert_eq!(s.num_keys().await.unwrap(), 2);
    // Requests one at a time reuse one connection.
    assert_eq!(srv.connections(), 1);
}

#[tokio::test]
async fn requests_are_the_bytes_torchs_source_defines() {
    let srv = FakeTorchStore::start();
    let s = client(&srv, "p/").await;
    s.set("k", b"v").await.unwrap();
    assert_eq!(s.add("n", 3).await.unwrap(), 3);
    s.wait(&["k", "n"], T).await.unwrap();
    assert!(s.delete("n").await.unwrap());
    let log: Vec<Vec<u8>> = srv.log().into_iter().map(|(_, b)| b).collect();
    // VALIDATE (0) + magic 0x3C85F7CE little-endian; then PING (13) + a 4-byte nonce.
    assert_eq!(log[0], [0x00, 0xce, 0xf7, 0x85, 0x3c]);
    assert_eq!((log[1].len(), log[1][0]), (5, 0x0d));
    // SET (1) "p/k" "v", then the PING that confirms it.
    assert_eq!(log[2], [&[0x01][..], &lv(b"p/k"), &lv(b"v")].concat());
    assert_eq!((log[3].len(), log[3][0]), (5, 0x0d));
    // ADD (4) "p/n" +3 as i64.
    assert_eq!(log[4], [&[0x04][..], &lv(b"p/n"), &3i64.to_le_bytes()].concat());
    // WAIT (6) with a u64 key count.
    assert_eq!(log[5], [&[0x06][..], &2u64.to_le_bytes(), &lv(b"p/k"), &lv(b"p/n")].concat());
    // DELETE_KEY (8).
    assert_eq!(log[6], [&[0x08][..], &lv(b"p/n")].concat());
    assert_eq!(log.len(), 7);
}

#[tokio::test]
async fn waits_block_until_set_and_time_out_naming_missing_keys() {
    let srv = FakeTorchStore::start();
    let s = Arc::new(client(&srv, "comm/").await);
    let (s2, s3) = (s.clone(), s.clone());
    let waiter = tokio::spawn(async move { s2.wait(&["a", "b"], T).await });
    let getter = tokio::spawn(async move { s3.get("b", T).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiter.is_finished() && !getter.is_finished());
    s.set("a", b"1").await.unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(!waiter.is_finished());
    // Another client of the store (torch's own, say) sets the last key.
    srv.put(b"comm/b", b"2");
    waiter.await.unwrap().unwrap();
    assert_eq!(getter.await.unwrap().unwrap(), b"2");

    let t0 = Instant::now();
    let e = s.wait(&["a", "never", "nope"], Duration::from_millis(200)).await.unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(5));
    let msg = e.to_string();
    assert!(matches!(e, CommError::Timeout { .. }), "{e:?}");
    assert!(msg.contains("`never`") && msg.contains("`nope`") && !msg.contains("`a`"), "{msg}");
    let e = s.get("never", Duration::from_millis(100)).await.unwrap_err();
    assert!(matches!(e, CommError::Timeout { .. }) && e.to_string().contains("`never`"), "{e}");
    // The cancelled waits left their connections in sync: the store still answers.
    assert_eq!(s.get("a", T).await.unwrap(), b"1");
    // A zero timeout on keys that exist succeeds (as with this library's own store).
    assert_eq!(s.get("a", Duration::ZERO).await.unwrap(), b"1");
    s.wait(&["a", "b"], Duration::ZERO).await.unwrap();
    s.wait(&[], Duration::ZERO).await.unwrap();
    assert!(s.check(&[]).await.unwrap());
    assert!(srv.connections() <= 4, "{} connections", srv.connections());
}

#[tokio::test]
async fn many_clients_count_exactly() {
    let srv = FakeTorchStore::start();
    let mut tasks = Vec::new();
    for _ in 0..24 {
        let c = client(&srv, "x/").await;
        tasks.push(tokio::spawn(async move {
            for _ in 0..10 {
                c.add("counter", 1).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(srv.value(b"x/counter").as_deref(), Some(&b"240"[..]));
}

#[tokio::test]
async fn a_rejected_request_is_a_clear_error_and_the_client_recovers() {
    let srv = FakeTorchStore::start();
    let s = client(&srv, "p/").await;
    s.set("text", b"not a number").await.unwrap();
    let e = s.add("text", 1).await.unwrap_err().to_string();
    assert!(e.contains("closed the connection") && e.contains("not an integer"), "{e}");
    // A fresh connection serves the next request.
    assert_eq!(s.add("n", 1).await.unwrap(), 1);
    // Limits the server enforces by dropping the connection are refused before sending.
    let e = s.set(&"k".repeat(9000), b"v").await.unwrap_err();
    assert!(matches!(e, CommError::InvalidArgument { .. }) && e.to_string().contains("8192"), "{e}");
    let e = s.set("big", &vec![0u8; 9 << 20]).await.unwrap_err();
    assert!(matches!(e, CommError::InvalidArgument { .. }), "{e}");
    s.set("fits", &vec![7u8; 8 << 20]).await.unwrap();
    assert_eq!(s.get("fits", T).await.unwrap().len(), 8 << 20);
}

#[tokio::test]
async fn an_abandoned_wait_does_not_disturb_other_requests() {
    let srv = FakeTorchStore::start();
    let s = Arc::new(client(&srv, "p/").await);
    let s2 = s.clone();
    let waiter = tokio::spawn(async move { s2.wait(&["never"], Duration::from_secs(3600)).await });
    tokio::time::sleep(Duration::from_millis(30)).await;
    waiter.abort();
    s.set("k", b"v").await.unwrap();
    assert_eq!(s.get("k", T).await.unwrap(), b"v");
    // A dropped client ends its connections.
    drop(s);
}

#[tokio::test]
async fn strangers_and_silence_are_named() {
    // This library's own store on the port: not torch's.
    let ours = StoreServer::bind("127.0.0.1", 0, "").unwrap();
    let e = TorchStore::connect("127.0.0.1", ours.local_addr().port(), "p/", T, None).await.unwrap_err().to_string();
    assert!(e.contains("is not a torch TCPStore"), "{e}");
    // A peer that accepts and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let t0 = Instant::now();
    let e = TorchStore::connect("127.0.0.1", port, "p/", Duration::from_millis(500), None).await.unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    assert!(e.to_string().contains("did not answer PING"), "{e}");
    drop(silent);
    // Nothing listening at all.
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let e = TorchStore::connect("127.0.0.1", free, "p/", Duration::from_millis(300), None).await.unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains(&format!("never came up at 127.0.0.1:{free}")) && msg.contains("MASTER_PORT"), "{msg}");
}

#[tokio::test]
async fn our_client_on_a_torch_store_says_what_to_set() {
    let srv = FakeTorchStore::start();
    let e = discovery::TcpStore::connect("127.0.0.1", srv.port(), "", Duration::from_millis(500))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("TORCHELASTIC_USE_AGENT_STORE"), "{e}");
}

fn torch_world(rank: u32, world_size: u32, port: u16) -> WorldInfo {
    WorldInfo {
        rank,
        world_size,
        local_rank: rank,
        local_world_size: world_size,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        store: StoreKind::Torch,
        // An explicit config: the port is the job's (its identity), whatever this test's
        // environment holds.
        source: WorldSource { launcher: Launcher::Explicit, variables: Vec::new() },
    }
}

#[tokio::test]
async fn rendezvous_through_the_agent_store_binds_nothing() {
    let srv = FakeTorchStore::start();
    let mut ranks = Vec::new();
    for r in 0..4 {
        let w = torch_world(r, 4, srv.port());
        ranks.push(tokio::spawn(async move { rendezvous(&w, T).await }));
    }
    let mut stores = Vec::new();
    for t in ranks {
        let (store, server) = t.await.unwrap().unwrap();
        assert!(server.is_none(), "nobody serves: torchrun's agent does");
        stores.push(store);
    }
    // Under the job's own prefix: `comm/<digest of the job token>/r<restart>/`.
    let keys = srv.keys();
    let key =
        keys.iter().map(|k| String::from_utf8_lossy(k).into_owned()).find(|k| k.ends_with("discovery/world_size"));
    let key = key.unwrap_or_else(|| panic!("no world size key in {keys:?}"));
    let job = key.strip_prefix("comm/").and_then(|k| k.strip_suffix("/r0/discovery/world_size"));
    assert!(job.is_some_and(|j| j.len() == 16 && j.bytes().all(|b| b.is_ascii_hexdigit())), "{key}");
    assert_eq!(srv.value(key.as_bytes()).as_deref(), Some(&b"4"[..]));
    stores[3].set("hello", b"from 3").await.unwrap();
    assert_eq!(stores[0].get("hello", T).await.unwrap(), b"from 3");
    // A rank with another world size is told so.
    let e = rendezvous(&torch_world(1, 3, srv.port()), T).await.unwrap_err();
    assert!(matches!(e, CommError::Mismatch { .. }) && e.to_string().contains("world size 4"), "{e}");
}

#[tokio::test]
async fn a_torch_store_that_is_not_the_jobs_is_refused() {
    // Another job's torch.distributed (or torchrun agent) holds MASTER_PORT, and this job was
    // not started by torchrun: rank 0 finds the port taken, the others probe it; every rank is
    // refused at once, saying so, and nothing is written to that store.
    let srv = FakeTorchStore::start();
    let start = std::time::Instant::now();
    let mut ranks = Vec::new();
    for r in 0..3 {
        let w = WorldInfo { store: StoreKind::Rank0, ..torch_world(r, 3, srv.port()) };
        ranks.push(tokio::spawn(async move { rendezvous(&w, T).await }));
    }
    for t in ranks {
        let e = t.await.unwrap().map(|_| ()).unwrap_err();
        assert!(matches!(e, CommError::Config(_)), "{e}");
        assert!(e.to_string().contains("torch TCPStore") && e.to_string().contains("MASTER_PORT"), "{e}");
    }
    assert!(start.elapsed() < T / 2, "refused at once, not at the timeout: {:?}", start.elapsed());
    assert!(srv.keys().is_empty(), "{:?}", srv.keys());
}
