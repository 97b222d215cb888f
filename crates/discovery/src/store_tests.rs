//! Tests of the TCP store, the server's robustness and `rendezvous`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use comm_core::{CommError, Launcher, Store, StoreKind, WorldInfo, WorldSource};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::auth;
use crate::wire::{self, Enc};
use crate::{rendezvous, StoreServer, TcpStore};

const T: Duration = Duration::from_secs(10);

fn server(token: &str) -> StoreServer {
    StoreServer::bind("127.0.0.1", 0, token).unwrap()
}

async fn client(s: &StoreServer, token: &str) -> TcpStore {
    TcpStore::connect("127.0.0.1", s.local_addr().port(), token, T).await.unwrap()
}

/// A raw connection that has done the handshake (empty token).
async fn raw_client(s: &StoreServer) -> TcpStream {
    let mut stream = TcpStream::connect(s.local_addr()).await.unwrap();
    let nonce = auth::nonce().unwrap();
    let hello = Enc::new().raw(&wire::MAGIC).u32(wire::VERSION).raw(&nonce).finish(wire::HELLO_MAX).unwrap();
    stream.write_all(&hello).await.unwrap();
    let reply = wire::read_frame(&mut stream, wire::HELLO_MAX).await.unwrap().unwrap();
    let m = wire::MAGIC.len();
    assert_eq!(reply[m], wire::HELLO_OK);
    let server_nonce = &reply[m + 5..m + 5 + auth::NONCE];
    let proof = auth::prove(b"", auth::Role::Client, &nonce, server_nonce);
    stream.write_all(&Enc::new().raw(&proof).finish(wire::HELLO_MAX).unwrap()).await.unwrap();
    let verdict = wire::read_frame(&mut stream, wire::HELLO_MAX).await.unwrap().unwrap();
    assert_eq!(verdict[m], wire::HELLO_OK);
    stream
}

/// Whether the server closed `stream` (EOF or reset) within a few seconds.
async fn closed_by_server(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 64];
    matches!(tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await, Ok(Ok(0) | Err(_)))
}

/// The server still serves a fresh, normal client.
async fn still_serves(s: &StoreServer) {
    let c = client(s, "").await;
    let n = c.add("still-serves", 1).await.unwrap();
    assert!(n >= 1);
}

#[tokio::test]
async fn get_waits_for_set_and_times_out() {
    // MemoryStore's test, on one shared client: a pending get must not block the set.
    let srv = server("");
    let s = Arc::new(client(&srv, "").await);
    let s2 = s.clone();
    let t = tokio::spawn(async move { s2.get("k", Duration::from_secs(5)).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    s.set("k", b"v").await.unwrap();
    assert_eq!(t.await.unwrap().unwrap(), b"v");
    let e = s.wait(&["k", "missing"], Duration::from_millis(50)).await.unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, CommError::Timeout { .. }), "{e:?}");
    assert!(msg.contains("`missing`") && !msg.contains("`k`"), "{msg}");
    let e = s.get("nope", Duration::from_millis(20)).await.unwrap_err();
    assert!(matches!(&e, CommError::Timeout { op, .. } if op == "store get"), "{e:?}");
    assert!(e.to_string().contains("nope"), "{e}");
    s.wait(&[], Duration::ZERO).await.unwrap();
    s.wait(&["k"], Duration::ZERO).await.unwrap();
}

#[tokio::test]
async fn add_compare_set_delete() {
    let srv = server("");
    let s = client(&srv, "").await;
    assert_eq!(s.add("c", 2).await.unwrap(), 2);
    assert_eq!(s.add("c", -5).await.unwrap(), -3);
    assert_eq!(s.get("c", T).await.unwrap(), b"-3");
    assert_eq!(s.compare_set("x", None, b"a").await.unwrap(), b"a");
    assert_eq!(s.compare_set("x", Some(b"b"), b"c").await.unwrap(), b"a");
    assert_eq!(s.compare_set("x", Some(b"a"), b"c").await.unwrap(), b"c");
    assert_eq!(s.compare_set("x", None, b"d").await.unwrap(), b"c");
    assert_eq!(s.compare_set("absent", Some(b"a"), b"z").await.unwrap(), b"");
    assert!(s.delete("x").await.unwrap());
    assert!(!s.delete("x").await.unwrap());
    s.set("y", b"zz").await.unwrap();
    let e = s.add("y", 1).await.unwrap_err();
    assert!(matches!(&e, CommError::Store(m) if m.contains("not an integer")), "{e:?}");
    // Empty keys and values, and binary values, are fine.
    s.set("", b"").await.unwrap();
    assert_eq!(s.get("", T).await.unwrap(), b"");
    let bin: Vec<u8> = (0..=255).collect();
    s.set("bin", &bin).await.unwrap();
    assert_eq!(s.get("bin", T).await.unwrap(), bin);
}

#[tokio::test]
async fn get_waits_for_another_client() {
    let srv = server("");
    let (a, b) = (client(&srv, "").await, client(&srv, "").await);
    let t = tokio::spawn(async move { a.get("later", T).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    // b is not held up by a's pending get.
    assert_eq!(b.add("other", 1).await.unwrap(), 1);
    b.set("later", b"hello").await.unwrap();
    assert_eq!(t.await.unwrap().unwrap(), b"hello");
}

#[tokio::test]
async fn big_values_round_trip_and_oversized_are_refused() {
    let srv = server("");
    let s = client(&srv, "").await;
    let big: Vec<u8> = (0..8 << 20).map(|i: u32| (i % 251) as u8).collect();
    s.set("big", &big).await.unwrap();
    assert_eq!(s.get("big", T).await.unwrap(), big);
    let huge = vec![0u8; wire::MAX_FRAME + 1];
    let e = s.set("huge", &huge).await.unwrap_err();
    assert!(matches!(e, CommError::InvalidArgument { op: "store set", .. }), "{e:?}");
    // The connection is still good.
    assert_eq!(s.add("after", 1).await.unwrap(), 1);
}

#[tokio::test(flavor = "current_thread")]
async fn thirty_two_clients_count_exactly() {
    let srv = server("job");
    let port = srv.local_addr().port();
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            tokio::spawn(async move {
                let c = TcpStore::connect("127.0.0.1", port, "job", T).await?;
                for _ in 0..10 {
                    c.add("counter", 1).await?;
                }
                c.get("counter", T).await
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let c = client(&srv, "job").await;
    assert_eq!(c.add("counter", 0).await.unwrap(), 320);
}

#[tokio::test]
async fn client_killed_mid_request() {
    let srv = server("");
    let good = client(&srv, "").await;
    let mut raw = raw_client(&srv).await;
    // A frame header announcing 100 bytes, then 10 of them.
    raw.write_all(&100u32.to_le_bytes()).await.unwrap();
    raw.write_all(&[7u8; 10]).await.unwrap();
    // While that connection is stuck mid-frame, others are served.
    good.set("a", b"1").await.unwrap();
    assert_eq!(good.get("a", T).await.unwrap(), b"1");
    drop(raw);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(good.add("n", 1).await.unwrap(), 1);
    still_serves(&srv).await;
}

#[tokio::test]
async fn garbage_closes_only_that_connection() {
    let srv = server("");
    let good = client(&srv, "").await;
    let cases: &[&[u8]] = &[
        b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n",
        &[5, 0, 0, 0, b'h', b'e', b'l', b'l', b'o'],
        &[0xff, 0xff, 0xff, 0xff],
        &[0, 0, 0, 0],
    ];
    for garbage in cases {
        let mut raw = TcpStream::connect(srv.local_addr()).await.unwrap();
        raw.write_all(garbage).await.unwrap();
        assert!(closed_by_server(&mut raw).await, "not closed after {garbage:?}");
        assert!(good.add("g", 1).await.unwrap() > 0);
        still_serves(&srv).await;
    }
}

#[tokio::test]
async fn oversized_and_malformed_frames_after_handshake() {
    let srv = server("");
    let good = client(&srv, "").await;
    let mut raw = raw_client(&srv).await;
    raw.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
    assert!(closed_by_server(&mut raw).await);
    let mut raw = raw_client(&srv).await;
    let bad = Enc::new().u64(1).u8(200).finish(wire::MAX_FRAME).unwrap();
    raw.write_all(&bad).await.unwrap();
    assert!(closed_by_server(&mut raw).await);
    good.set("still", b"here").await.unwrap();
    still_serves(&srv).await;
}

#[tokio::test]
async fn wrong_job_token_is_refused_at_once() {
    let srv = server("job-a");
    let start = Instant::now();
    let e = TcpStore::connect("127.0.0.1", srv.local_addr().port(), "job-b", T).await.unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(2));
    let msg = e.to_string();
    assert!(matches!(e, CommError::Store(_)), "{e:?}");
    assert!(msg.contains("belongs to another job (job token mismatch") && !msg.contains("MASTER_PORT"), "{msg}");
    assert!(msg.contains(&format!("127.0.0.1:{}", srv.local_addr().port())), "{msg}");
    // No token at all is a different token too.
    assert!(TcpStore::connect("127.0.0.1", srv.local_addr().port(), "", T).await.is_err());
    still_serves_with(&srv, "job-a").await;
}

/// An impostor listening on the port first (it answers like a store but does not know the
/// token) is refused, and gets no proof from the client; a client's bytes on the wire never
/// contain the token.
#[tokio::test]
async fn impostor_server_is_refused_and_the_token_never_crosses_the_wire() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let impostor = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let hello = wire::read_frame(&mut s, wire::HELLO_MAX).await.unwrap().unwrap();
        let bogus = Enc::new()
            .raw(&wire::MAGIC)
            .u8(wire::HELLO_OK)
            .u32(wire::VERSION)
            .raw(&[7; auth::NONCE])
            .raw(&[9; auth::PROOF])
            .finish(wire::HELLO_MAX)
            .unwrap();
        s.write_all(&bogus).await.unwrap();
        // Whatever the client sends next (nothing: it hangs up).
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await;
        (hello, rest)
    });
    let token = "the-secret-token-of-job-a";
    let e = TcpStore::connect("127.0.0.1", port, token, T).await.unwrap_err();
    assert!(e.to_string().contains("belongs to another job"), "{e}");
    let (hello, rest) = impostor.await.unwrap();
    assert!(rest.is_empty(), "the client sent {} more bytes to a server that failed its proof", rest.len());
    assert!(!hello.windows(token.len()).any(|w| w == token.as_bytes()), "the token crossed the wire");

    // A full, successful exchange through a recording proxy: no token either way.
    let srv = server(token);
    let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy_port = proxy.local_addr().unwrap().port();
    let target = srv.local_addr();
    let (up, down) = (Arc::new(std::sync::Mutex::new(Vec::new())), Arc::new(std::sync::Mutex::new(Vec::new())));
    let (up2, down2) = (up.clone(), down.clone());
    tokio::spawn(async move {
        let (a, _) = proxy.accept().await.unwrap();
        let b = TcpStream::connect(target).await.unwrap();
        let ((ar, aw), (br, bw)) = (a.into_split(), b.into_split());
        let pump = |mut r: tokio::net::tcp::OwnedReadHalf,
                    mut w: tokio::net::tcp::OwnedWriteHalf,
                    log: Arc<std::sync::Mutex<Vec<u8>>>| async move {
            let mut chunk = [0u8; 4096];
            while let Ok(n @ 1..) = r.read(&mut chunk).await {
                log.lock().unwrap().extend_from_slice(&chunk[..n]);
                if w.write_all(&chunk[..n]).await.is_err() {
                    break;
                }
            }
        };
        tokio::join!(pump(ar, bw, up2), pump(br, aw, down2));
    });
    let c = TcpStore::connect("127.0.0.1", proxy_port, token, T).await.unwrap();
    c.set("k", b"v").await.unwrap();
    let (up, down) = (up.lock().unwrap().clone(), down.lock().unwrap().clone());
    for bytes in [&up, &down] {
        assert!(!bytes.windows(token.len()).any(|w| w == token.as_bytes()), "the token crossed the wire");
    }
    assert!(up.len() > 2 * auth::PROOF && down.len() > auth::PROOF, "the handshake went through the proxy");
}

/// A holder of the token cannot grow rank 0's memory without bound: past the quota a write
/// fails with a clear error, replacing or deleting values frees room, and the server serves on.
#[tokio::test]
async fn the_store_has_a_quota() {
    let limits = crate::ServerLimits { quota: 1 << 20, ..Default::default() };
    let srv = StoreServer::bind_with("127.0.0.1", 0, "", limits).unwrap();
    let c = client(&srv, "").await;
    let big = vec![7u8; 400 << 10];
    c.set("a", &big).await.unwrap();
    c.set("b", &big).await.unwrap();
    let e = c.set("c", &big).await.unwrap_err();
    assert!(matches!(e, CommError::Store(_)) && e.to_string().contains("quota of 1048576 bytes"), "{e}");
    // Replacing a value counts the new size only; deleting frees it.
    c.set("a", &big).await.unwrap();
    assert!(c.delete("b").await.unwrap());
    c.set("c", &big).await.unwrap();
    assert!(c.compare_set("c", Some(&big), &vec![1u8; 900 << 10]).await.is_err());
    assert_eq!(c.add("n", 1).await.unwrap(), 1);
    still_serves(&srv).await;
}

/// A client that stops in the middle of a frame is disconnected after the frame deadline, while
/// an idle client (between frames) is not.
#[tokio::test]
async fn a_stalled_frame_is_cut_off() {
    let limits = crate::ServerLimits { frame_deadline: Duration::from_millis(300), ..Default::default() };
    let srv = StoreServer::bind_with("127.0.0.1", 0, "", limits).unwrap();
    let idle = client(&srv, "").await;
    let mut stalled = raw_client(&srv).await;
    stalled.write_all(&[200, 0, 0, 0, 1, 2]).await.unwrap(); // announces 200 bytes, sends 2
    let t = Instant::now();
    assert!(closed_by_server(&mut stalled).await, "a stalled frame kept its connection");
    assert!(t.elapsed() < Duration::from_secs(3), "cut off after {:?}", t.elapsed());
    tokio::time::sleep(Duration::from_millis(500)).await;
    idle.set("still", b"here").await.unwrap();
}

/// Reads until the server closes `stream` (within 10 s); how many bytes came first, or `None`
/// if it stayed open.
async fn bytes_until_closed(stream: &mut TcpStream) -> Option<usize> {
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stream.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => return Some(total),
            Ok(Ok(n)) => total += n,
            Err(_) => return None,
        }
    }
}

/// A client that pipelines GETs of a large value and never reads the answers is disconnected
/// once its unread responses pass the per-client bound; the server serves on.
#[tokio::test]
async fn unread_responses_are_bounded() {
    let limits = crate::ServerLimits::default().with_per_client(4 << 20);
    let srv = StoreServer::bind_with("127.0.0.1", 0, "", limits).unwrap();
    client(&srv, "").await.set("big", &vec![9u8; 1 << 20]).await.unwrap();
    let mut raw = raw_client(&srv).await;
    for id in 0..30u64 {
        let get = Enc::new().u64(id).u8(wire::op::GET).bytes(b"big").duration(T).finish(wire::MAX_FRAME).unwrap();
        raw.write_all(&get).await.unwrap();
    }
    // Give the server time to queue what it would queue, then read.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let got = bytes_until_closed(&mut raw).await.expect("a client that never reads must be disconnected");
    assert!(got < 20 << 20, "{got} bytes of the 30 MiB asked for were queued for a client that did not read");
    still_serves(&srv).await;
}

/// Many authenticated clients, each under its own bound, cannot together make the server hold
/// more than the job's quota (and one response): 32 clients pipelining GETs of a 1 MiB value
/// without reading, 4 MiB each allowed, 8 MiB for the job.
#[tokio::test]
async fn unread_responses_of_all_clients_are_bounded_together() {
    let limits = crate::ServerLimits::default().with_per_client(4 << 20).with_quota(8 << 20);
    let srv = StoreServer::bind_with("127.0.0.1", 0, "", limits).unwrap();
    client(&srv, "").await.set("big", &vec![9u8; 1 << 20]).await.unwrap();
    let mut raws = Vec::new();
    for _ in 0..32 {
        let mut raw = raw_client(&srv).await;
        for id in 0..8u64 {
            let get = Enc::new().u64(id).u8(wire::op::GET).bytes(b"big").duration(T).finish(wire::MAX_FRAME).unwrap();
            if raw.write_all(&get).await.is_err() {
                break;
            }
        }
        raws.push(raw);
    }
    let mut most = 0;
    for _ in 0..20 {
        most = most.max(srv.held());
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(most <= (9 << 20) + 4096, "the server held {most} bytes for its clients, over the job's 8 MiB");
    drop(raws);
    still_serves(&srv).await;
}

/// A client stalling in the middle of large frames (the whole frame budget) does not hold up
/// another client's small requests: a rendezvous goes on at once.
#[tokio::test]
async fn stalled_large_frames_do_not_delay_small_ones() {
    let limits =
        crate::ServerLimits { frame_deadline: Duration::from_secs(30), ..Default::default() }.with_quota(1 << 20);
    let srv = StoreServer::bind_with("127.0.0.1", 0, "", limits).unwrap();
    let mut stalled = Vec::new();
    for _ in 0..2 {
        let mut raw = raw_client(&srv).await;
        // Announces a frame of the whole budget (at least one largest frame) and sends one
        // byte of it.
        raw.write_all(&(wire::MAX_FRAME as u32).to_le_bytes()).await.unwrap();
        raw.write_all(&[0]).await.unwrap();
        stalled.push(raw);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t = Instant::now();
    let c = client(&srv, "").await;
    c.set("rank/1", b"here").await.unwrap();
    assert_eq!(c.get("rank/1", T).await.unwrap(), b"here");
    assert!(t.elapsed() < Duration::from_secs(1), "a small request waited {:?} behind stalled frames", t.elapsed());
}

/// Pending waits count their keys against the same bound: a client that piles up waits on
/// many keys is disconnected, and the waits it left are dropped.
#[tokio::test]
async fn pending_waits_are_bounded() {
    let limits = crate::ServerLimits::default().with_per_client(1 << 20);
    let srv = StoreServer::bind_with("127.0.0.1", 0, "", limits).unwrap();
    let mut raw = raw_client(&srv).await;
    for id in 0..6u64 {
        let keys: Vec<String> = (0..20_000).map(|k| format!("key-{id}-{k:08}")).collect();
        let mut wait = Enc::new().u64(id).u8(wire::op::WAIT).duration(T).u32(keys.len() as u32);
        for k in &keys {
            wait = wait.bytes(k.as_bytes());
        }
        if raw.write_all(&wait.finish(wire::MAX_FRAME).unwrap()).await.is_err() {
            break;
        }
    }
    assert!(closed_by_server(&mut raw).await, "a client holding 120k waited keys stayed connected");
    still_serves(&srv).await;
}

/// Connections past the limit are closed as they come; a slot frees when one ends.
#[tokio::test]
async fn connections_are_bounded() {
    let limits = crate::ServerLimits::default().with_connections(3);
    let srv = StoreServer::bind_with("127.0.0.1", 0, "", limits).unwrap();
    let mut open = Vec::new();
    for _ in 0..3 {
        open.push(TcpStream::connect(srv.local_addr()).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut extra = TcpStream::connect(srv.local_addr()).await.unwrap();
    assert!(closed_by_server(&mut extra).await, "a fourth connection was served");
    drop(open.pop());
    tokio::time::sleep(Duration::from_millis(200)).await;
    still_serves(&srv).await;
}

async fn still_serves_with(s: &StoreServer, token: &str) {
    client(s, token).await.set("ok", b"1").await.unwrap();
}

#[tokio::test]
async fn nothing_listening_never_came_up() {
    // A port that was free a moment ago.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let start = Instant::now();
    let e = TcpStore::connect("127.0.0.1", port, "", Duration::from_millis(300)).await.unwrap_err();
    let took = start.elapsed();
    let msg = e.to_string();
    assert!(took >= Duration::from_millis(250) && took < Duration::from_millis(1500), "{took:?}");
    assert!(msg.contains(&format!("rank 0's store never came up at 127.0.0.1:{port} after 300 ms")), "{msg}");
    assert!(msg.contains("is MASTER_ADDR/MASTER_PORT right? did rank 0 start?"), "{msg}");
}

/// Variables for `job_token_from` from a list that need not be `'static`.
fn env_owned(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let pairs: Vec<(String, String)> = pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    move |name: &str| pairs.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
}

#[test]
fn job_tokens_come_from_the_launcher_when_unset() {
    use crate::client::{job_token_from, Ancestor};
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |name: &str| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| (*v).to_owned())
    };
    let proc =
        |id: &str, name: &str, cmdline: &str| Ancestor { id: id.into(), name: name.into(), cmdline: cmdline.into() };
    let parent = || vec![proc("4242.99", "python3", "python3 train.py")];
    let on = |launcher: Launcher, local: u32| WorldInfo {
        local_world_size: local,
        source: WorldSource { launcher, variables: Vec::new() },
        ..world(0, 4, 29500)
    };
    let tok = |launcher, local, vars| job_token_from(&on(launcher, local), vars, parent);
    assert_eq!(tok(Launcher::Slurm, 4, env(&[("COMM_JOB_TOKEN", "abc"), ("SLURM_JOB_ID", "7")])).unwrap(), "abc");
    // An empty (or blank) token is no token: the launcher's identity, or the same refusal as unset.
    assert_eq!(
        tok(Launcher::Slurm, 4, env(&[("COMM_JOB_TOKEN", ""), ("SLURM_JOB_ID", "7")])).unwrap(),
        "slurm:7.batch"
    );
    let by_hand = |vars| tok(Launcher::Torchrun, 4, vars).unwrap_err().to_string();
    let unset = by_hand(env(&[("MASTER_PORT", "29500")]));
    assert!(unset.contains("started by hand"), "{unset}");
    assert_eq!(by_hand(env(&[("COMM_JOB_TOKEN", ""), ("MASTER_PORT", "29500")])), unset);
    assert_eq!(by_hand(env(&[("COMM_JOB_TOKEN", "  "), ("MASTER_PORT", "29500")])), unset);
    // Two steps of one Slurm job are two jobs.
    let step0 = tok(Launcher::Slurm, 4, env(&[("SLURM_JOB_ID", "123456"), ("SLURM_STEP_ID", "0")])).unwrap();
    let step1 = tok(Launcher::Slurm, 4, env(&[("SLURM_JOB_ID", "123456"), ("SLURM_STEP_ID", "1")])).unwrap();
    assert_eq!((step0.as_str(), step1.as_str()), ("slurm:123456.0", "slurm:123456.1"));
    assert_eq!(tok(Launcher::Slurm, 4, env(&[("SLURM_JOB_ID", "9")])).unwrap(), "slurm:9.batch");
    assert_eq!(
        tok(Launcher::Pmix, 2, env(&[("PMIX_NAMESPACE", "prterun-host-1234@1")])).unwrap(),
        "pmix:prterun-host-1234@1"
    );
    assert_eq!(
        tok(Launcher::OpenMpi, 2, env(&[("OMPI_MCA_ess_base_jobid", "2812870657")])).unwrap(),
        "ompi:2812870657"
    );
    assert_eq!(
        tok(Launcher::Torchrun, 4, env(&[("TORCHELASTIC_RUN_ID", "r1"), ("MASTER_PORT", "1")])).unwrap(),
        "torchelastic:r1"
    );
    // MPICH's Hydra and the DeepSpeed launcher export no job id: their per-host parent process
    // is the job's, when the job is on one host...
    assert_eq!(tok(Launcher::Mpich, 4, env(&[])).unwrap(), "parent:4242.99");
    assert_eq!(tok(Launcher::DeepSpeed, 4, env(&[("MASTER_PORT", "29500")])).unwrap(), "parent:4242.99");
    // ...across hosts it is not: only a port or token chosen for the job will do.
    let e = tok(Launcher::Mpich, 2, env(&[])).unwrap_err().to_string();
    assert!(e.contains("MASTER_PORT") && e.contains("COMM_JOB_TOKEN") && e.contains("Mpich"), "{e}");
    assert_eq!(tok(Launcher::Mpich, 2, env(&[("MASTER_PORT", "6000")])).unwrap(), "");
    // torchrun chose the port for its job; ranks started by hand have no identity, whatever
    // the port: two such jobs on one port would pair, so they are refused, naming the fix.
    let torchrun = env(&[("MASTER_PORT", "6000"), ("TORCHELASTIC_RUN_ID", "none"), ("GROUP_RANK", "0")]);
    assert_eq!(tok(Launcher::Torchrun, 4, torchrun).unwrap(), "");
    let e = tok(Launcher::Torchrun, 4, env(&[("MASTER_PORT", "6000")])).unwrap_err().to_string();
    assert!(e.contains("started by hand") && e.contains("COMM_JOB_TOKEN") && e.contains("commrun"), "{e}");
    assert!(tok(Launcher::Torchrun, 4, env(&[("SLURM_JOB_ID", " ")])).is_err());
    assert_eq!(tok(Launcher::Explicit, 4, env(&[])).unwrap(), "");
    // The launcher that started the ranks decides: two mpiruns inside one Slurm allocation
    // (no step of their own) are two jobs.
    let in_salloc = |jobid| {
        let vars = env_owned(&[("SLURM_JOB_ID", "77"), ("OMPI_MCA_ess_base_jobid", jobid)]);
        job_token_from(&on(Launcher::OpenMpi, 2), vars, parent)
    };
    assert_eq!((in_salloc("100").unwrap(), in_salloc("200").unwrap()), ("ompi:100".into(), "ompi:200".into()));
    let pmix_ompi = tok(Launcher::OpenMpi, 2, env(&[("SLURM_JOB_ID", "77"), ("PMIX_NAMESPACE", "ns-9")])).unwrap();
    assert_eq!(pmix_ompi, "pmix:ns-9");
    // srun inside the allocation: its step.
    assert_eq!(
        tok(Launcher::Slurm, 4, env(&[("SLURM_JOB_ID", "77"), ("SLURM_STEP_ID", "3"), ("PMIX_NAMESPACE", "x")]))
            .unwrap(),
        "slurm:77.3"
    );
    // Wrappers between Hydra's proxy (or the DeepSpeed launcher) and the rank: each rank has
    // its own `sh`, the proxy is the job's.
    let wrapped = |sh: &'static str| {
        move || {
            vec![
                proc(sh, "sh", "sh -c ./p; echo done"),
                proc("400.5", "hydra_pmi_proxy", "hydra_pmi_proxy --control-port x"),
                proc("300.5", "mpiexec.mpich", "mpiexec.mpich -n 2 sh -c ./p"),
            ]
        }
    };
    let (a, b) = (
        job_token_from(&on(Launcher::Mpich, 4), env(&[]), wrapped("501.7")).unwrap(),
        job_token_from(&on(Launcher::Mpich, 4), env(&[]), wrapped("502.7")).unwrap(),
    );
    assert_eq!((a.as_str(), b.as_str()), ("parent:400.5", "parent:400.5"));
    let deepspeed = || {
        vec![
            proc("610.1", "nsys", "nsys profile python train.py"),
            proc(
                "600.1",
                "python3",
                "/usr/bin/python3 -u -m deepspeed.launcher.launch --world_info=e30= --node_rank=0",
            ),
        ]
    };
    assert_eq!(job_token_from(&on(Launcher::DeepSpeed, 4), env(&[]), deepspeed).unwrap(), "parent:600.1");
    // The real process tree can be read: the parent first.
    let real = crate::client::ancestors();
    assert!(real[0].id.starts_with(&format!("{}.", std::os::unix::process::parent_id())), "{real:?}");
}

#[tokio::test]
async fn rendezvous_names_a_rank_0_that_never_came_up() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let start = Instant::now();
    let e = rendezvous(&world(1, 2, port), Duration::from_millis(300)).await.unwrap_err().to_string();
    assert!(start.elapsed() < Duration::from_millis(1500), "{:?}", start.elapsed());
    assert!(e.contains(&format!("rank 0's store never came up at 127.0.0.1:{port} after 300 ms")), "{e}");
}

#[tokio::test]
async fn connect_waits_for_a_late_server() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        StoreServer::bind("127.0.0.1", port, "")
    });
    let c = TcpStore::connect("127.0.0.1", port, "", T).await.unwrap();
    c.set("k", b"v").await.unwrap();
    let srv = late.join().unwrap().unwrap();
    assert_eq!(srv.local_addr().port(), port);
}

#[tokio::test]
async fn server_shutdown_fails_clients_clearly() {
    let srv = server("");
    let c = client(&srv, "").await;
    let c2 = c.clone();
    let pending = tokio::spawn(async move { c2.get("never", T).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    srv.shutdown();
    let e = tokio::time::timeout(Duration::from_secs(5), pending).await.unwrap().unwrap().unwrap_err();
    assert!(e.to_string().contains("lost the connection to the store"), "{e}");
    let e = c.set("k", b"v").await.unwrap_err();
    assert!(e.to_string().contains("lost the connection to the store"), "{e}");
}

#[tokio::test]
async fn restart_on_the_same_port() {
    let srv = server("");
    let port = srv.local_addr().port();
    let c = client(&srv, "").await;
    c.set("k", b"v").await.unwrap();
    // The server closes first, leaving its side of the connection in TIME_WAIT.
    drop(srv);
    let _ = c.set("k", b"v").await;
    let srv = StoreServer::bind("127.0.0.1", port, "").unwrap();
    still_serves(&srv).await;
}

#[tokio::test]
async fn cancelled_requests_leave_the_client_usable() {
    let srv = server("");
    let c = client(&srv, "").await;
    for _ in 0..5 {
        assert!(tokio::time::timeout(Duration::from_millis(10), c.get("nope", T)).await.is_err());
    }
    c.set("k", b"v").await.unwrap();
    assert_eq!(c.get("k", T).await.unwrap(), b"v");
    // Effectively unbounded waits are fine too.
    let c2 = c.clone();
    let t = tokio::spawn(async move { c2.get("forever", Duration::MAX).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    c.set("forever", b"x").await.unwrap();
    assert_eq!(t.await.unwrap().unwrap(), b"x");
}

#[test]
fn works_without_the_callers_runtime() {
    // The server needs no runtime from its creator, and the client none from its user: here
    // the test thread is busy (blocked in join) and the client runs under futures' executor.
    let srv = StoreServer::bind("localhost", 0, "tok").unwrap();
    let port = srv.local_addr().port();
    let user = std::thread::spawn(move || {
        futures::executor::block_on(async {
            let c = TcpStore::connect("127.0.0.1", port, "tok", T).await?;
            c.set("k", b"v").await?;
            c.get("k", T).await
        })
    });
    assert_eq!(user.join().unwrap().unwrap(), b"v");
    assert!(format!("{srv:?}").contains("StoreServer"));
}

#[test]
fn bind_errors_name_the_address() {
    let srv = server("");
    let port = srv.local_addr().port();
    let e = StoreServer::bind("127.0.0.1", port, "").unwrap_err();
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
    let e = StoreServer::bind("no-such-host.invalid", 0, "").unwrap_err();
    assert!(e.to_string().contains("no-such-host.invalid"), "{e}");
    let long = "x".repeat(wire::MAX_TOKEN + 1);
    assert!(matches!(StoreServer::bind("127.0.0.1", 0, &long), Err(CommError::Config(_))));
}

/// An MPI launch across hosts without MASTER_ADDR has no store address: a backend that needs
/// the store is refused with what to set (the mpi backends never get here).
#[tokio::test]
async fn no_store_address_across_hosts_is_refused_with_the_fix() {
    let info = WorldInfo {
        master_addr: String::new(),
        local_world_size: 1,
        source: WorldSource { launcher: Launcher::OpenMpi, variables: Vec::new() },
        ..world(0, 2, 29500)
    };
    let e = rendezvous(&info, Duration::from_secs(1)).await.unwrap_err().to_string();
    assert!(e.contains("OpenMpi across hosts (1 of the 2 ranks on this host)"), "{e}");
    assert!(e.contains("export MASTER_ADDR") && e.contains("`mpi` feature"), "{e}");
}

#[tokio::test]
async fn an_address_that_does_not_resolve_reports_the_whole_budget() {
    let info = WorldInfo { master_addr: "no.such.host.invalid".into(), ..world(1, 2, 29999) };
    let start = Instant::now();
    let e = rendezvous(&info, Duration::from_millis(1500)).await.unwrap_err().to_string();
    assert!(start.elapsed() < Duration::from_secs(6), "{:?}", start.elapsed());
    assert!(e.contains("never came up at no.such.host.invalid:29999 after 1.5 s"), "{e}");
}

fn world(rank: u32, world_size: u32, port: u16) -> WorldInfo {
    WorldInfo {
        rank,
        world_size,
        local_rank: rank,
        local_world_size: world_size,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        store: StoreKind::Rank0,
        source: WorldSource { launcher: Launcher::Explicit, variables: Vec::new() },
    }
}

#[tokio::test]
async fn rendezvous_single_process_uses_memory() {
    let (store, server) = rendezvous(&WorldInfo::single(), T).await.unwrap();
    assert!(server.is_none());
    assert!(format!("{store:?}").contains("MemoryStore"), "{store:?}");
    store.set("k", b"v").await.unwrap();
    assert!(rendezvous(&world(3, 3, 0), T).await.is_err());
    // Explicit configurations with impossible local values are refused before any socket.
    let bad = WorldInfo { local_rank: 2, local_world_size: 2, ..world(1, 2, 0) };
    let e = rendezvous(&bad, T).await.unwrap_err().to_string();
    assert!(e.contains("local rank 2 of 2"), "{e}");
    let bad = WorldInfo { local_rank: 0, local_world_size: 3, ..world(1, 2, 0) };
    assert!(matches!(rendezvous(&bad, T).await, Err(CommError::Config(_))));
}

#[tokio::test]
async fn rendezvous_three_ranks() {
    let (s0, server) = rendezvous(&world(0, 3, 0), T).await.unwrap();
    let server = server.unwrap();
    let port = server.local_addr().port();
    let ranks: Vec<_> = (1..3)
        .map(|r| {
            tokio::spawn(async move {
                let (s, server) = rendezvous(&world(r, 3, port), T).await?;
                assert!(server.is_none());
                s.set(&format!("rank{r}"), b"up").await?;
                s.wait(&["rank0", "rank1", "rank2"], T).await?;
                Ok::<_, CommError>(())
            })
        })
        .collect();
    s0.set("rank0", b"up").await.unwrap();
    for r in ranks {
        r.await.unwrap().unwrap();
    }
    s0.wait(&["rank1", "rank2"], T).await.unwrap();
    // A rank with another idea of the world size is told so.
    let e = rendezvous(&world(1, 4, port), T).await.unwrap_err();
    assert!(matches!(e, CommError::Mismatch { op: "rendezvous", .. }), "{e:?}");
    assert!(e.to_string().contains("world size 4") && e.to_string().contains("world size 3"), "{e}");
    // Other ranks need the real port.
    assert!(matches!(rendezvous(&world(1, 3, 0), T).await, Err(CommError::Config(_))));
}

#[tokio::test]
async fn rendezvous_falls_back_to_all_interfaces() {
    // 192.0.2.1 (TEST-NET-1) is not an address of this host: rank 0 listens on 0.0.0.0.
    let mut info = world(0, 2, 0);
    info.master_addr = "192.0.2.1".into();
    let (s, server) = rendezvous(&info, T).await.unwrap();
    let server = server.unwrap();
    assert!(server.local_addr().ip().is_unspecified());
    s.set("k", b"v").await.unwrap();
}
