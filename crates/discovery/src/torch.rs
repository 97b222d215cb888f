//! A client of torch's `TCPStore` (the store torchrun's agent serves on `MASTER_PORT`).
//!
//! The wire format, from torch's `TCPStore.cpp` / `TCPStoreLibUvBackend.cpp` (checked against
//! torch 2.15, see `tests/fixtures/torch-2.15-exchange.txt`). Integers are native-endian
//! (little-endian on every platform torch ships for); a string or byte vector is a `u64`
//! length then the bytes. A request is one command byte then its fields:
//!
//! | command | value | fields | reply |
//! |---|---|---|---|
//! | VALIDATE | 0 | `u32` magic `0x3C85F7CE` | none |
//! | SET | 1 | key, value | none |
//! | COMPARE_SET | 2 | key, expected, desired | the value now stored (see [`TorchStore`]) |
//! | GET | 3 | key | value (empty when absent) |
//! | ADD | 4 | key, `i64` | `i64` new value |
//! | CHECK | 5 | `u64` count, keys | `u8`: 0 ready, 1 not ready |
//! | WAIT | 6 | `u64` count, keys | `u8` 0 (STOP_WAITING) once every key exists |
//! | GETNUMKEYS | 7 | | `i64` |
//! | DELETE_KEY | 8 | key | `i64` number deleted |
//! | CANCEL_WAIT | 12 | | `u8` 1 (WAIT_CANCELED), after a 0 if the wait ended first |
//! | PING | 13 | `u32` nonce | the nonce |
//!
//! The first command on a connection must be VALIDATE; the server ignores everything else
//! until then. Requests on one connection are served in order, but a pending WAIT answers
//! late, so each connection carries one request at a time. The server closes the connection
//! on a request it rejects (a key over 8 KiB, a value over 8 MiB, ADD on a non-integer).

use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use comm_core::{CommError, Store};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::client::display_addr;
use crate::net::Hello;
use crate::wire::MAX_WAIT;

/// Command bytes (torch's `QueryType`).
pub(crate) mod cmd {
    pub(crate) const VALIDATE: u8 = 0;
    pub(crate) const SET: u8 = 1;
    pub(crate) const COMPARE_SET: u8 = 2;
    pub(crate) const GET: u8 = 3;
    pub(crate) const ADD: u8 = 4;
    pub(crate) const CHECK: u8 = 5;
    pub(crate) const WAIT: u8 = 6;
    pub(crate) const GETNUMKEYS: u8 = 7;
    pub(crate) const DELETE_KEY: u8 = 8;
    pub(crate) const CANCEL_WAIT: u8 = 12;
    pub(crate) const PING: u8 = 13;
}

/// torch's `validationMagicNumber`.
pub(crate) const MAGIC: u32 = 0x3C85_F7CE;
/// WAIT's and CANCEL_WAIT's answers (torch's `WaitResponseType`).
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;
/// CHECK's answer for "every key exists" (torch's `CheckResponseType::READY`).
const READY: u8 = 0;

/// The server's limits (libuv backend): longer keys or values make it drop the connection,
/// so they are refused here with a clear error instead.
pub const MAX_KEY: usize = 8 * 1024;
/// Largest value torch's store accepts.
pub const MAX_VALUE: usize = 8 * 1024 * 1024;
/// Most keys one WAIT or CHECK may name.
const MAX_KEYS: usize = 128 * 1024;

/// How long the server gets to answer the handshake's PING.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the server gets to confirm a cancelled wait before the connection is dropped.
const CANCEL_GRACE: Duration = Duration::from_secs(5);
/// Deadline of requests that do not wait, unless changed.
const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(300);
/// Idle connections kept for reuse.
const MAX_IDLE: usize = 8;

/// A [`Store`] over torch's `TCPStore` protocol, with every key under a prefix (like torch's
/// `PrefixStore`), so this library's keys never collide with torch's own.
///
/// Each request runs on a connection of its own from a small pool, on a dedicated thread
/// with its own runtime (so any executor can drive it), and has a deadline: waits their
/// timeout, other requests the request timeout (300 s unless changed). A request whose caller
/// gives up runs to its deadline and its connection is discarded if it is left mid-exchange,
/// so the stream never desynchronises. A `set` is confirmed with a PING on the same
/// connection before it returns, so a following request on another connection sees it.
///
/// Differences from this library's own store, imposed by torch's protocol:
/// - `compare_set` cannot tell an absent key from an empty value (torch sends an empty
///   "expected" for "absent"); when a key is absent and `expected` is non-empty, torch
///   answers with `expected` itself, which is mapped back to "absent" (an empty vector)
///   unless `expected == desired`.
/// - `add` on a key whose value is not an integer makes the server drop the connection; the
///   error says so.
#[derive(Clone)]
pub struct TorchStore {
    shared: Arc<Shared>,
    runtime: Arc<RuntimeThread>,
}

struct Shared {
    addr: String,
    port: u16,
    bind: Option<IpAddr>,
    /// `addr:port`, for messages.
    shown: String,
    prefix: String,
    request_timeout: Duration,
    idle: Mutex<Vec<TcpStream>>,
    /// The local address of the first connection.
    local_addr: Option<SocketAddr>,
}

impl fmt::Debug for TorchStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TorchStore")
            .field("addr", &self.shared.shown)
            .field("prefix", &self.shared.prefix)
            .field("local", &self.shared.local_addr)
            .finish_non_exhaustive()
    }
}

/// The thread whose runtime runs every request; stopped and joined on drop.
struct RuntimeThread {
    handle: tokio::runtime::Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RuntimeThread {
    fn start() -> Result<RuntimeThread, CommError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(|e| CommError::io("starting the torch store client's runtime", e))?;
        let handle = rt.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("comm-torch-store".into())
            .spawn(move || {
                rt.block_on(async move {
                    let _ = stopped.await;
                });
                // Dropping the runtime cancels what still runs and closes its sockets.
            })
            .map_err(|e| CommError::io("spawning the torch store client thread", e))?;
        Ok(RuntimeThread { handle, stop: Some(stop), thread: Some(thread) })
    }

    async fn run<T: Send + 'static>(
        &self,
        fut: impl std::future::Future<Output = Result<T, CommError>> + Send + 'static,
    ) -> Result<T, CommError> {
        self.handle
            .spawn(fut)
            .await
            .unwrap_or_else(|e| Err(CommError::Store(format!("torch store client task failed: {e}"))))
    }
}

impl Drop for RuntimeThread {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        // Tasks never own a `RuntimeThread`, so this never runs on the thread it joins.
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Why an exchange failed; `Closed` and `Io` leave the connection unusable.
enum Fail {
    /// The caller's wait ran out (the connection may still be fine: see `wait_keys`).
    Timeout,
    Closed,
    Io(std::io::Error),
    Malformed(String),
}

impl TorchStore {
    /// Connects to the torch store at `addr:port`, keys under `prefix` (e.g. `"comm/"`).
    ///
    /// Retries with backoff (10 ms doubling to 500 ms) until `timeout` while the port refuses
    /// connections, then fails with a [`CommError::Store`] saying the store never came up. A
    /// peer that does not answer the handshake (VALIDATE, then a PING that must come back) is
    /// not a torch store, and the error says so.
    pub async fn connect(
        addr: &str,
        port: u16,
        prefix: &str,
        timeout: Duration,
        bind: Option<IpAddr>,
    ) -> Result<TorchStore, CommError> {
        let runtime = Arc::new(RuntimeThread::start()?);
        let shown = display_addr(addr, port);
        let (a, s) = (addr.to_owned(), shown.clone());
        let first = runtime.run(async move { connect_with_retry(&a, port, bind, timeout, &s).await }).await?;
        let local_addr = first.local_addr().ok();
        let shared = Arc::new(Shared {
            addr: addr.to_owned(),
            port,
            bind,
            shown,
            prefix: prefix.to_owned(),
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            idle: Mutex::new(vec![first]),
            local_addr,
        });
        Ok(TorchStore { shared, runtime })
    }

    /// This client with another deadline for requests that do not wait.
    pub fn with_request_timeout(self, timeout: Duration) -> TorchStore {
        let idle = std::mem::take(&mut *lock(&self.shared.idle));
        let s = &self.shared;
        let shared = Arc::new(Shared {
            addr: s.addr.clone(),
            port: s.port,
            bind: s.bind,
            shown: s.shown.clone(),
            prefix: s.prefix.clone(),
            request_timeout: timeout,
            idle: Mutex::new(idle),
            local_addr: s.local_addr,
        });
        TorchStore { shared, runtime: self.runtime }
    }

    /// The local address of the first connection (which interface this rank uses).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.shared.local_addr
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.shared.prefix
    }

    /// Whether every key exists, without waiting (torch's `check`).
    pub async fn check(&self, keys: &[&str]) -> Result<bool, CommError> {
        if keys.is_empty() {
            return Ok(true);
        }
        let keys = self.keys("torch store check", keys)?;
        let reply = self
            .exchange("store check", None, move |c| {
                Box::pin(async move {
                    c.write_all(&keys_request(cmd::CHECK, &keys)).await.map_err(Fail::Io)?;
                    read_u8(c).await
                })
            })
            .await?;
        Ok(reply == READY)
    }

    /// Number of keys in the whole store, torch's own included (torch's `num_keys`).
    pub async fn num_keys(&self) -> Result<i64, CommError> {
        self.exchange("store num_keys", None, |c| {
            Box::pin(async move {
                c.write_all(&[cmd::GETNUMKEYS]).await.map_err(Fail::Io)?;
                read_i64(c).await
            })
        })
        .await
    }

    fn key(&self, op: &'static str, key: &str) -> Result<Vec<u8>, CommError> {
        let full = [self.shared.prefix.as_bytes(), key.as_bytes()].concat();
        if full.len() > MAX_KEY {
            return Err(CommError::invalid(
                op,
                format!("key of {} bytes (with its prefix); torch's store accepts at most {MAX_KEY}", full.len()),
            ));
        }
        Ok(full)
    }

    fn keys(&self, op: &'static str, keys: &[&str]) -> Result<Vec<Vec<u8>>, CommError> {
        if keys.len() > MAX_KEYS {
            return Err(CommError::invalid(
                op,
                format!("{} keys; torch's store accepts at most {MAX_KEYS}", keys.len()),
            ));
        }
        keys.iter().map(|k| self.key(op, k)).collect()
    }

    /// Runs `f` on a pooled connection with a deadline; the connection goes back to the pool
    /// only when the exchange completed.
    async fn exchange<T: Send + 'static>(
        &self,
        op: &'static str,
        wait: Option<Duration>,
        f: impl for<'c> FnOnce(&'c mut TcpStream) -> BoxFut<'c, T> + Send + 'static,
    ) -> Result<T, CommError> {
        let shared = self.shared.clone();
        self.runtime
            .run(async move {
                let limit = wait.map_or(shared.request_timeout, |w| w.min(MAX_WAIT));
                let deadline = Instant::now() + limit;
                let mut conn = shared.take(deadline).await?;
                let r = match tokio::time::timeout_at(deadline, f(&mut conn)).await {
                    Ok(r) => r,
                    Err(_) => Err(Fail::Timeout),
                };
                match r {
                    Ok(v) => {
                        shared.give_back(conn);
                        Ok(v)
                    }
                    Err(Fail::Timeout) => {
                        Err(CommError::timeout(op, limit, format!("no reply from the torch store at {}", shared.shown)))
                    }
                    Err(e) => Err(shared.failed(op, e)),
                }
            })
            .await
    }
}

type BoxFut<'c, T> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, Fail>> + Send + 'c>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    /// An idle connection, or a new one (one attempt per backoff step until `deadline`).
    async fn take(&self, deadline: Instant) -> Result<TcpStream, CommError> {
        if let Some(c) = lock(&self.idle).pop() {
            return Ok(c);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        connect_with_retry(&self.addr, self.port, self.bind, left, &self.shown).await
    }

    fn give_back(&self, conn: TcpStream) {
        let mut idle = lock(&self.idle);
        if idle.len() < MAX_IDLE {
            idle.push(conn);
        }
    }

    fn failed(&self, op: &str, f: Fail) -> CommError {
        let why = match f {
            Fail::Closed => "the torch store closed the connection (it does so when it rejects a request: ADD on a \
                             value that is not an integer, a key over 8 KiB, a value over 8 MiB; or it shut down)"
                .to_owned(),
            Fail::Io(e) => format!("the connection failed: {e}"),
            Fail::Malformed(m) => format!("malformed reply: {m}"),
            Fail::Timeout => "timed out".to_owned(),
        };
        CommError::Store(format!("{op} at the torch store {}: {why}", self.shown))
    }
}

/// A request: the command byte and fields, each string or vector as `u64` length + bytes.
struct Req(Vec<u8>);

impl Req {
    fn new(command: u8) -> Req {
        Req(vec![command])
    }

    fn bytes(mut self, b: &[u8]) -> Req {
        self.0.extend_from_slice(&(b.len() as u64).to_le_bytes());
        self.0.extend_from_slice(b);
        self
    }

    fn raw(mut self, b: &[u8]) -> Req {
        self.0.extend_from_slice(b);
        self
    }
}

fn keys_request(command: u8, keys: &[Vec<u8>]) -> Vec<u8> {
    keys.iter().fold(Req::new(command).raw(&(keys.len() as u64).to_le_bytes()), |r, k| r.bytes(k)).0
}

fn io_fail(e: std::io::Error) -> Fail {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        Fail::Closed
    } else {
        Fail::Io(e)
    }
}

async fn read_u8<C: AsyncRead + Unpin>(c: &mut C) -> Result<u8, Fail> {
    c.read_u8().await.map_err(io_fail)
}

async fn read_i64<C: AsyncRead + Unpin>(c: &mut C) -> Result<i64, Fail> {
    c.read_i64_le().await.map_err(io_fail)
}

/// A `u64`-length-prefixed vector, refusing lengths over what the server could have stored.
async fn read_vec<C: AsyncRead + Unpin>(c: &mut C) -> Result<Vec<u8>, Fail> {
    let n = c.read_u64_le().await.map_err(io_fail)?;
    if n > MAX_VALUE as u64 {
        return Err(Fail::Malformed(format!("a value of {n} bytes, over torch's {MAX_VALUE}-byte limit")));
    }
    let mut v = vec![0; n as usize];
    c.read_exact(&mut v).await.map_err(io_fail)?;
    Ok(v)
}

/// SET, then a PING on the same connection: its echo proves the SET was applied.
async fn set_confirmed<C: AsyncRead + AsyncWrite + Unpin>(c: &mut C, key: &[u8], value: &[u8]) -> Result<(), Fail> {
    let nonce = nonce();
    let req = Req::new(cmd::SET).bytes(key).bytes(value).raw(&[cmd::PING]).raw(&nonce.to_le_bytes());
    c.write_all(&req.0).await.map_err(Fail::Io)?;
    match c.read_u32_le().await.map_err(io_fail)? {
        n if n == nonce => Ok(()),
        n => Err(Fail::Malformed(format!("PING answered {n:#x} instead of {nonce:#x}"))),
    }
}

/// WAIT for `keys` up to `timeout`; on timeout, cancels the wait as torch's client does.
/// `Ok(false)` is a timeout with the connection still in sync.
async fn wait_keys<C: AsyncRead + AsyncWrite + Unpin>(
    c: &mut C,
    keys: &[Vec<u8>],
    timeout: Duration,
) -> Result<bool, Fail> {
    c.write_all(&keys_request(cmd::WAIT, keys)).await.map_err(Fail::Io)?;
    match tokio::time::timeout(timeout.min(MAX_WAIT), read_u8(c)).await {
        Ok(Ok(STOP_WAITING)) => return Ok(true),
        Ok(Ok(b)) => return Err(Fail::Malformed(format!("WAIT answered {b} instead of STOP_WAITING (0)"))),
        Ok(Err(e)) => return Err(e),
        Err(_) => {}
    }
    c.write_all(&[cmd::CANCEL_WAIT]).await.map_err(Fail::Io)?;
    let cancelled = async {
        // The wait may have ended just before the cancel arrived: STOP_WAITING comes first,
        // and the keys do exist (torch's own client reports a timeout anyway; a zero timeout
        // on keys that exist would then always fail).
        match read_u8(c).await? {
            WAIT_CANCELED => Ok(false),
            STOP_WAITING => match read_u8(c).await? {
                WAIT_CANCELED => Ok(true),
                b => Err(Fail::Malformed(format!("CANCEL_WAIT answered {b} instead of WAIT_CANCELED (1)"))),
            },
            b => Err(Fail::Malformed(format!("CANCEL_WAIT answered {b}"))),
        }
    };
    tokio::time::timeout(CANCEL_GRACE, cancelled).await.unwrap_or(Err(Fail::Timeout))
}

/// A fresh 32-bit nonce (the standard library's per-process random hash keys, no dependency).
fn nonce() -> u32 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish() as u32
}

/// One connection: dial, VALIDATE, and a PING that must come back.
/// `limit` bounds the wait for the PING's answer: a peer that accepts and stays silent is not
/// a torch store (or is hung), which retrying would not change.
async fn hello(addr: &str, port: u16, bind: Option<IpAddr>, shown: &str, limit: Duration) -> Result<TcpStream, Hello> {
    let mut c = crate::net::dial(addr, port, bind).await.map_err(|e| Hello::Retry(e.to_string()))?;
    let nonce = nonce();
    let req = Req::new(cmd::VALIDATE).raw(&MAGIC.to_le_bytes()).raw(&[cmd::PING]).raw(&nonce.to_le_bytes());
    c.write_all(&req.0).await.map_err(|e| Hello::Retry(format!("sending the handshake failed: {e}")))?;
    let not_torch = |why: &str| {
        Hello::Refused(CommError::Store(format!(
            "{shown} is not a torch TCPStore ({why}); MASTER_PORT is served by something else — if it is this \
             library's own store, unset TORCHELASTIC_USE_AGENT_STORE / COMM_STORE=torch"
        )))
    };
    match tokio::time::timeout(limit, c.read_u32_le()).await {
        Ok(Ok(n)) if n == nonce => Ok(c),
        Ok(Ok(_)) => Err(not_torch("its answer to PING is not the nonce")),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(not_torch(
            "it closed the connection at the handshake; an old torch without the PING command does this too",
        )),
        Ok(Err(e)) => Err(Hello::Retry(format!("the handshake failed: {e}"))),
        Err(_) => Err(not_torch(&format!("it accepted the connection but did not answer PING within {limit:?}"))),
    }
}

/// What answers at an address, as far as a torch handshake can tell.
#[derive(Debug)]
pub(crate) enum Probe {
    /// A torch store: it echoed the PING.
    Torch,
    /// Something that closed the connection or answered otherwise (this library's own store
    /// closes at once).
    Other,
    /// Accepted, but said nothing within the limit.
    Silent,
    /// Could not connect (nothing listening yet, unreachable...).
    Unreachable(String),
}

/// Sends torch's handshake to `addr:port` and classifies the answer, within `limit`.
pub(crate) async fn probe(addr: &str, port: u16, bind: Option<IpAddr>, limit: Duration) -> Probe {
    let attempt = async {
        let mut c = match crate::net::dial(addr, port, bind).await {
            Ok(c) => c,
            Err(e) => return Probe::Unreachable(e.to_string()),
        };
        let nonce = nonce();
        let req = Req::new(cmd::VALIDATE).raw(&MAGIC.to_le_bytes()).raw(&[cmd::PING]).raw(&nonce.to_le_bytes());
        if let Err(e) = c.write_all(&req.0).await {
            return Probe::Unreachable(e.to_string());
        }
        match c.read_u32_le().await {
            Ok(n) if n == nonce => Probe::Torch,
            _ => Probe::Other,
        }
    };
    tokio::time::timeout(limit, attempt).await.unwrap_or(Probe::Silent)
}

async fn connect_with_retry(
    addr: &str,
    port: u16,
    bind: Option<IpAddr>,
    timeout: Duration,
    shown: &str,
) -> Result<TcpStream, CommError> {
    let attempt = |left: Duration| async move {
        // A little past the PING limit, so a silent peer is reported as such.
        let attempt = hello(addr, port, bind, shown, left.min(HELLO_TIMEOUT));
        tokio::time::timeout(left + Duration::from_millis(200), attempt)
            .await
            .unwrap_or_else(|_| Err(Hello::Retry("the connection attempt timed out".to_owned())))
    };
    crate::net::retry(timeout, attempt, |last| {
        CommError::Store(format!(
            "the torch store (torchrun's agent store) never came up at {shown} after {} (are \
             MASTER_ADDR/MASTER_PORT right?); last error: {last}",
            comm_core::config::fmt_duration(timeout)
        ))
    })
    .await
}

#[async_trait]
impl Store for TorchStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<(), CommError> {
        let key = self.key("store set", key)?;
        if value.len() > MAX_VALUE {
            return Err(CommError::invalid(
                "store set",
                format!("value of {} bytes; torch's store accepts at most {MAX_VALUE}", value.len()),
            ));
        }
        let value = value.to_vec();
        self.exchange("store set", None, move |c| Box::pin(async move { set_confirmed(c, &key, &value).await })).await
    }

    async fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, CommError> {
        let k = self.key("store get", key)?;
        let shown = key.to_owned();
        // The server answers GET at once (empty when absent): wait for the key first, as
        // torch's client does, on the same connection.
        let r = self
            .exchange("store get", Some(timeout.saturating_add(CANCEL_GRACE)), move |c| {
                Box::pin(async move {
                    if !wait_keys(c, std::slice::from_ref(&k), timeout).await? {
                        return Ok(None);
                    }
                    c.write_all(&Req::new(cmd::GET).bytes(&k).0).await.map_err(Fail::Io)?;
                    read_vec(c).await.map(Some)
                })
            })
            .await?;
        r.ok_or_else(|| self.timeout("store get", timeout, &[&shown]))
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64, CommError> {
        let key = self.key("store add", key)?;
        self.exchange("store add", None, move |c| {
            Box::pin(async move {
                c.write_all(&Req::new(cmd::ADD).bytes(&key).raw(&delta.to_le_bytes()).0).await.map_err(Fail::Io)?;
                read_i64(c).await
            })
        })
        .await
    }

    async fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>, CommError> {
        let key = self.key("store compare_set", key)?;
        if desired.len() > MAX_VALUE || expected.is_some_and(|e| e.len() > MAX_VALUE) {
            return Err(CommError::invalid("store compare_set", format!("values over torch's {MAX_VALUE}-byte limit")));
        }
        let (exp, des) = (expected.unwrap_or_default().to_vec(), desired.to_vec());
        let (e2, d2) = (exp.clone(), des.clone());
        let now = self
            .exchange("store compare_set", None, move |c| {
                Box::pin(async move {
                    c.write_all(&Req::new(cmd::COMPARE_SET).bytes(&key).bytes(&e2).bytes(&d2).0)
                        .await
                        .map_err(Fail::Io)?;
                    read_vec(c).await
                })
            })
            .await?;
        // torch answers a non-empty `expected` for an absent key with `expected` itself.
        if !exp.is_empty() && now == exp && exp != des {
            return Ok(Vec::new());
        }
        Ok(now)
    }

    async fn delete(&self, key: &str) -> Result<bool, CommError> {
        let key = self.key("store delete", key)?;
        let n = self
            .exchange("store delete", None, move |c| {
                Box::pin(async move {
                    c.write_all(&Req::new(cmd::DELETE_KEY).bytes(&key).0).await.map_err(Fail::Io)?;
                    read_i64(c).await
                })
            })
            .await?;
        Ok(n > 0)
    }

    async fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), CommError> {
        // Nothing to wait for (and torch's server logs `keys[0]` of a WAIT).
        if keys.is_empty() {
            return Ok(());
        }
        let full = self.keys("store wait", keys)?;
        let done = self
            .exchange("store wait", Some(timeout.saturating_add(CANCEL_GRACE)), move |c| {
                Box::pin(async move { wait_keys(c, &full, timeout).await })
            })
            .await?;
        if done {
            return Ok(());
        }
        Err(self.missing_after_timeout(keys, timeout).await)
    }
}

impl TorchStore {
    fn timeout(&self, op: &str, after: Duration, missing: &[&str]) -> CommError {
        let names: Vec<String> = missing.iter().map(|k| format!("`{k}`")).collect();
        CommError::timeout(
            op,
            after,
            format!(
                "key(s) {} never set (torch store at {}, prefix `{}`)",
                names.join(", "),
                self.shared.shown,
                self.shared.prefix
            ),
        )
    }

    /// A wait's timeout error naming only the keys still missing (one CHECK each).
    async fn missing_after_timeout(&self, keys: &[&str], after: Duration) -> CommError {
        let mut missing = Vec::new();
        for k in keys.iter().take(64) {
            if !self.check(&[k]).await.unwrap_or(false) {
                missing.push(*k);
            }
        }
        if missing.is_empty() {
            missing = keys.to_vec();
        }
        self.timeout("store wait", after, &missing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exchange recorded between torch 2.15's own client and server (Python wrapper, which
    /// prefixes keys with "/"), as `(direction, bytes)` groups between `-- op` markers.
    /// `(direction, bytes)` pieces of one op.
    type Pieces = Vec<(String, Vec<u8>)>;

    fn recorded() -> Vec<(String, Pieces)> {
        let mut ops: Vec<(String, Pieces)> = vec![("hello".into(), Vec::new())];
        for line in include_str!("../tests/fixtures/torch-2.15-exchange.txt").lines() {
            let (dir, rest) = line.split_once(' ').unwrap_or((line, ""));
            if dir == "--" {
                ops.push((rest.trim_matches(|c| c == 'b' || c == '\'').to_owned(), Vec::new()));
            } else {
                let bytes = rest.split_whitespace().map(|h| u8::from_str_radix(h, 16).unwrap()).collect();
                ops.last_mut().unwrap().1.push((dir.to_owned(), bytes));
            }
        }
        ops
    }

    fn sent(op: &[(String, Vec<u8>)], i: usize) -> &[u8] {
        &op.iter().filter(|(d, _)| d == "C>S").nth(i).unwrap().1
    }

    fn answered(op: &[(String, Vec<u8>)]) -> Vec<u8> {
        op.iter().filter(|(d, _)| d == "S>C").flat_map(|(_, b)| b.clone()).collect()
    }

    #[test]
    fn requests_match_torchs_own_client_byte_for_byte() {
        let ops = recorded();
        let op = |name: &str| ops.iter().find(|(n, _)| n == name).map(|(_, x)| x.as_slice()).unwrap();
        // Handshake: VALIDATE + magic, then PING + a random nonce that comes back.
        let hello = sent(op("hello"), 0);
        assert_eq!(hello[..6], Req::new(cmd::VALIDATE).raw(&MAGIC.to_le_bytes()).raw(&[cmd::PING]).0[..]);
        assert_eq!(answered(op("hello")), hello[6..10]);
        assert_eq!(sent(op("set"), 0), Req::new(cmd::SET).bytes(b"/k").bytes(b"v").0);
        assert_eq!(sent(op("get"), 0), keys_request(cmd::WAIT, &[b"/k".to_vec()]));
        assert_eq!(sent(op("get"), 1), Req::new(cmd::GET).bytes(b"/k").0);
        assert_eq!(sent(op("add"), 0), Req::new(cmd::ADD).bytes(b"/c").raw(&5i64.to_le_bytes()).0);
        assert_eq!(sent(op("compare_set"), 0), Req::new(cmd::COMPARE_SET).bytes(b"/k").bytes(b"v").bytes(b"w").0);
        assert_eq!(sent(op("check"), 0), keys_request(cmd::CHECK, &[b"/k".to_vec(), b"/zz".to_vec()]));
        assert_eq!(sent(op("delete"), 0), Req::new(cmd::DELETE_KEY).bytes(b"/c").0);
        assert_eq!(sent(op("wait timeout"), 0), keys_request(cmd::WAIT, &[b"/never".to_vec()]));
        assert_eq!(sent(op("wait timeout"), 1), [cmd::CANCEL_WAIT]);
        assert_eq!(sent(op("num_keys"), 0), [cmd::GETNUMKEYS]);
    }

    #[tokio::test]
    async fn replies_decode_as_torchs_own_client_read_them() {
        let ops = recorded();
        let reply = |name: &str| answered(&ops.iter().find(|(n, _)| n == name).unwrap().1);
        // get: STOP_WAITING, then the value.
        let r = reply("get");
        let mut rd = &r[..];
        assert_eq!(read_u8(&mut rd).await.ok(), Some(STOP_WAITING));
        assert_eq!(read_vec(&mut rd).await.ok(), Some(b"v".to_vec()));
        assert_eq!(read_i64(&mut &reply("add")[..]).await.ok(), Some(5));
        assert_eq!(read_vec(&mut &reply("compare_set")[..]).await.ok(), Some(b"w".to_vec()));
        assert_eq!(read_u8(&mut &reply("check")[..]).await.ok(), Some(1)); // NOT_READY: /zz is absent
        assert_eq!(read_i64(&mut &reply("delete")[..]).await.ok(), Some(1));
        assert_eq!(reply("wait timeout"), [WAIT_CANCELED]);
        assert_eq!(read_i64(&mut &reply("num_keys")[..]).await.ok(), Some(1));
        // A length past torch's limit is refused without allocating it.
        let huge = u64::MAX.to_le_bytes();
        assert!(matches!(read_vec(&mut &huge[..]).await, Err(Fail::Malformed(_))));
        assert!(matches!(read_vec(&mut &[3u8, 0, 0, 0, 0, 0, 0, 0, 1][..]).await, Err(Fail::Closed)));
    }

    #[tokio::test]
    async fn a_timed_out_wait_is_cancelled_as_torchs_client_does() {
        // The server answers CANCEL_WAIT with WAIT_CANCELED, possibly after a late STOP_WAITING.
        for (server_says, done) in [(&[WAIT_CANCELED][..], false), (&[STOP_WAITING, WAIT_CANCELED][..], true)] {
            let (mut client, mut server) = tokio::io::duplex(1024);
            let keys = [b"p/x".to_vec()];
            let peer = async {
                let mut req = vec![0u8; keys_request(cmd::WAIT, &keys).len()];
                server.read_exact(&mut req).await.unwrap();
                assert_eq!(req, keys_request(cmd::WAIT, &keys));
                let mut cancel = [0u8; 1];
                server.read_exact(&mut cancel).await.unwrap();
                assert_eq!(cancel, [cmd::CANCEL_WAIT]);
                server.write_all(server_says).await.unwrap();
            };
            let (got, ()) = tokio::join!(wait_keys(&mut client, &keys, Duration::from_millis(20)), peer);
            assert_eq!(got.ok(), Some(done), "{server_says:?}");
        }
    }
}
