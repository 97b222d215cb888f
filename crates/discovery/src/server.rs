//! The TCP store server rank 0 runs.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use comm_core::{CommError, MemoryStore, Store};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{mpsc, oneshot, Notify, Semaphore};

use crate::auth;
use crate::wire::{self, FrameError, Request};

/// A warning of the store's: to stderr, where a rank serving the store (and commrun) show it,
/// whether or not the program installed a `tracing` subscriber; and to `tracing`.
macro_rules! warn {
    ($($t:tt)*) => {{
        let msg = format!($($t)*);
        eprintln!("{msg}");
        tracing::warn!("{msg}");
    }};
}

/// torch's VALIDATE command byte and the first bytes of its magic, read as our length prefix.
const TORCH_PROBE: u32 = u32::from_le_bytes([crate::torch::cmd::VALIDATE, 0xce, 0xf7, 0x85]);

/// How long a new connection may take to send its handshake before it is dropped.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// The rendezvous store server, served from its own thread until dropped.
///
/// The server owns a dedicated OS thread running a current-thread tokio runtime, so it keeps
/// answering even while the thread that created it is blocked, or its runtime is a busy
/// current-thread one. Each connection is served by its own task; a wait (`get`, `wait`) is
/// served by a task of its own with the client's timeout, so a blocked client blocks no one.
/// Only clients that present the same job token are served.
///
/// Dropping the server (or calling [`StoreServer::shutdown`]) stops it, closes every
/// connection and joins its thread.
pub struct StoreServer {
    local_addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    /// What the server holds for all its clients together (see `Holdings`).
    held: Arc<AtomicUsize>,
}

impl fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreServer").field("local_addr", &self.local_addr).finish_non_exhaustive()
    }
}

/// A server thread that has been started but has not reported its bind result yet.
pub(crate) struct Starting {
    stop: oneshot::Sender<()>,
    thread: JoinHandle<()>,
    held: Arc<AtomicUsize>,
}

impl Starting {
    /// The server, once its thread reported `bound`.
    pub(crate) fn finish(self, bound: Result<SocketAddr, CommError>) -> Result<StoreServer, CommError> {
        match bound {
            Ok(local_addr) => {
                Ok(StoreServer { local_addr, stop: Some(self.stop), thread: Some(self.thread), held: self.held })
            }
            Err(e) => {
                // The thread reported its failure and is exiting: reap it.
                let _ = self.thread.join();
                Err(e)
            }
        }
    }
}

/// Bounds a [`StoreServer`] puts on its clients: what an authenticated client can make the
/// server hold is bounded by these, and a client over a per-connection bound is disconnected
/// with a logged reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerLimits {
    /// Once a request's first byte has arrived, the whole frame must follow within this; a
    /// client that stalls in the middle of a frame is disconnected (idle connections are fine).
    pub frame_deadline: Duration,
    /// Most bytes of keys and values the store holds (one store per job); a request past it
    /// fails with a [`CommError::Store`] naming the quota, and the server goes on serving.
    /// Frames over 4 KiB being received, on every connection together, are held to the same
    /// number (at least one largest frame): a connection past it waits for room within its
    /// frame deadline (smaller frames, every rendezvous request among them, never wait). So are
    /// the unread responses and pending waits of every connection together: a connection that
    /// would pass it is closed.
    pub quota: usize,
    /// Most bytes one connection may have the server hold for it: responses it has not read
    /// yet and the keys of its pending waits (one response is always allowed, so the largest
    /// value can be read).
    pub per_client: usize,
    /// Most connections at once; more are closed as they come.
    pub connections: usize,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            frame_deadline: Duration::from_secs(30),
            quota: 256 << 20,
            per_client: wire::MAX_FRAME,
            connections: 8192,
        }
    }
}

impl ServerLimits {
    /// Defaults, with `COMM_STORE_QUOTA` (a size: `512MiB`) for the quota.
    pub fn from_env() -> Result<Self, CommError> {
        let quota = comm_core::config::env_parse("COMM_STORE_QUOTA", comm_core::config::parse_size)?;
        Ok(ServerLimits { quota: quota.unwrap_or(ServerLimits::default().quota), ..ServerLimits::default() })
    }

    /// With another frame deadline.
    pub fn with_frame_deadline(self, frame_deadline: Duration) -> Self {
        ServerLimits { frame_deadline, ..self }
    }

    /// With another quota.
    pub fn with_quota(self, quota: usize) -> Self {
        ServerLimits { quota, ..self }
    }

    /// With another per-connection bound.
    pub fn with_per_client(self, per_client: usize) -> Self {
        ServerLimits { per_client, ..self }
    }

    /// With another connection count.
    pub fn with_connections(self, connections: usize) -> Self {
        ServerLimits { connections, ..self }
    }
}

impl StoreServer {
    /// Starts a server listening on `addr:port` (a host name is resolved; port 0 picks a free
    /// port, see [`StoreServer::local_addr`]) that serves clients presenting `token`.
    ///
    /// `SO_REUSEADDR` is set, so a server restarted right away on the same port can bind while
    /// the previous one's connections linger in `TIME_WAIT`.
    pub fn bind(addr: &str, port: u16, token: &str) -> Result<StoreServer, CommError> {
        Self::bind_with(addr, port, token, ServerLimits::from_env()?)
    }

    /// [`StoreServer::bind`] with explicit limits.
    pub fn bind_with(addr: &str, port: u16, token: &str, limits: ServerLimits) -> Result<StoreServer, CommError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let starting = start(addr, port, token, limits, move |r| {
            let _ = tx.send(r);
        })?;
        let bound =
            rx.recv().unwrap_or_else(|_| Err(CommError::Store("the store server thread exited before binding".into())));
        starting.finish(bound)
    }

    /// Bytes the server holds for its clients now: responses they have not read and the keys
    /// of their pending waits (at most [`ServerLimits::quota`] and one response).
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    /// The address the server listens on (with the actual port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops the server and joins its thread (what dropping it does).
    pub fn shutdown(self) {
        drop(self);
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("comm store server thread panicked");
            }
        }
    }
}

/// Starts the server thread; it resolves and binds `addr:port` and calls `report` with the
/// result before serving.
pub(crate) fn start(
    addr: &str,
    port: u16,
    token: &str,
    limits: ServerLimits,
    report: impl FnOnce(Result<SocketAddr, CommError>) + Send + 'static,
) -> Result<Starting, CommError> {
    if token.len() > wire::MAX_TOKEN {
        return Err(CommError::Config(format!(
            "COMM_JOB_TOKEN is {} bytes long; at most {} are allowed",
            token.len(),
            wire::MAX_TOKEN
        )));
    }
    let (stop_tx, stop_rx) = oneshot::channel();
    let (addr, token) = (addr.to_owned(), Arc::<[u8]>::from(token.as_bytes()));
    let held = Arc::new(AtomicUsize::new(0));
    let held_by_all = held.clone();
    let thread = std::thread::Builder::new()
        .name("comm-store-server".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread().enable_io().enable_time().build() {
                Ok(rt) => rt,
                Err(e) => return report(Err(CommError::io("starting the store server's runtime", e))),
            };
            rt.block_on(async move {
                let listener = match listen(&addr, port).await {
                    Ok(l) => l,
                    Err(e) => return report(Err(e)),
                };
                match listener.local_addr() {
                    Ok(a) => report(Ok(a)),
                    Err(e) => return report(Err(CommError::io("reading the store's bound address", e))),
                }
                serve(listener, token, limits, held_by_all, stop_rx).await;
            });
            // Dropping the runtime here cancels every connection task, closing their sockets.
        })
        .map_err(|e| CommError::io("spawning the store server thread", e))?;
    Ok(Starting { stop: stop_tx, thread, held })
}

/// Resolves `addr` and listens on the first of its addresses that binds.
async fn listen(addr: &str, port: u16) -> Result<TcpListener, CommError> {
    let shown = crate::client::display_addr(addr, port);
    // Blocking resolution is fine: this is the server's own thread, before it serves anyone.
    let addrs: Vec<SocketAddr> = (addr, port)
        .to_socket_addrs()
        .map_err(|e| CommError::Config(format!("cannot resolve the store address {shown}: {e}")))?
        .collect();
    let mut last = None;
    for a in &addrs {
        let bound = (|| {
            let socket = if a.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
            socket.set_reuseaddr(true)?;
            socket.bind(*a)?;
            socket.listen(1024)
        })();
        match bound {
            Ok(l) => return Ok(l),
            Err(e) => last = Some((*a, e)),
        }
    }
    Err(match last {
        None => CommError::Config(format!("the store address {shown} resolves to no address")),
        Some((a, e)) => {
            let hint = if e.kind() == std::io::ErrorKind::AddrInUse {
                " (is another job, or a torchrun agent's store, using MASTER_PORT? pick another port)"
            } else {
                ""
            };
            CommError::io(format!("binding the rendezvous store on {a}{hint}"), e)
        }
    })
}

/// Accepts connections until told to stop.
async fn serve(
    listener: TcpListener,
    token: Arc<[u8]>,
    limits: ServerLimits,
    held: Arc<AtomicUsize>,
    mut stop: oneshot::Receiver<()>,
) {
    let store = Arc::new(Quota::new(MemoryStore::new(), limits.quota));
    let frames = Arc::new(Semaphore::new(limits.quota.clamp(wire::MAX_FRAME, Semaphore::MAX_PERMITS)));
    let open = Arc::new(Semaphore::new(limits.connections.min(Semaphore::MAX_PERMITS)));
    loop {
        tokio::select! {
            _ = &mut stop => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let Ok(slot) = open.clone().try_acquire_owned() else {
                        warn!("comm store: refusing {peer}: {} connections are open already", limits.connections);
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    let served = Served {
                        token: token.clone(),
                        store: store.clone(),
                        frames: frames.clone(),
                        held: held.clone(),
                        limits,
                    };
                    tokio::spawn(async move {
                        connection(stream, peer, served).await;
                        drop(slot);
                    });
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    warn!("comm store: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
}

/// What every connection of a job shares.
struct Served {
    token: Arc<[u8]>,
    store: Arc<Quota>,
    /// The budget of frames being received ([`ServerLimits::quota`]).
    frames: Arc<Semaphore>,
    /// What all connections hold for their clients together ([`Holdings`]).
    held: Arc<AtomicUsize>,
    limits: ServerLimits,
}

/// What one connection makes the server hold: its unread responses and pending waits' keys,
/// within [`ServerLimits::per_client`].
struct Holdings {
    bytes: AtomicUsize,
    limit: usize,
    /// What every connection of the job holds together, within [`ServerLimits::quota`].
    job: Arc<AtomicUsize>,
    job_limit: usize,
    /// Rung when a response or a wait would pass a limit: the connection is closed.
    over: Notify,
}

impl Holdings {
    /// Counts `n` more bytes, or rings `over` when that passes this connection's limit or the
    /// job's, and this connection holds something already. Whether they were counted.
    fn take(&self, n: usize) -> bool {
        let before = self.bytes.fetch_add(n, Ordering::AcqRel);
        let job_before = self.job.fetch_add(n, Ordering::AcqRel);
        let over = before.saturating_add(n) > self.limit || job_before.saturating_add(n) > self.job_limit;
        if before > 0 && over {
            self.give(n);
            self.over.notify_one();
            return false;
        }
        true
    }

    fn give(&self, n: usize) {
        self.bytes.fetch_sub(n, Ordering::AcqRel);
        self.job.fetch_sub(n, Ordering::AcqRel);
    }

    /// Queues a response for the writer, counted until written.
    fn respond(&self, tx: &mpsc::UnboundedSender<Bytes>, frame: Bytes) {
        let n = frame.len();
        if self.take(n) && tx.send(frame).is_err() {
            self.give(n);
        }
    }
}

/// What a pending wait on `keys` is counted as: the keys and their strings' overhead.
fn wait_cost(keys: &[String]) -> usize {
    keys.iter().map(|k| k.len() + std::mem::size_of::<String>() + 16).sum()
}

/// Serves one connection: the handshake, then requests until it closes or misbehaves.
async fn connection(stream: TcpStream, peer: SocketAddr, served: Served) {
    let Served { token, store, frames, held: held_by_all, limits } = served;
    let (mut rd, mut wr) = stream.into_split();
    if !handshake(&mut rd, &mut wr, peer, &token).await {
        return;
    }
    // Responses go through a writer task so reading never waits on writing: a client that
    // pipelines requests without reading cannot deadlock against the server (and what it
    // leaves unread is bounded by `Holdings`).
    let held = Arc::new(Holdings {
        bytes: AtomicUsize::new(0),
        limit: limits.per_client,
        job: held_by_all.clone(),
        job_limit: limits.quota,
        over: Notify::new(),
    });
    let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
    let writer = tokio::spawn(write_responses(wr, rx, held.clone()));
    loop {
        let read = tokio::select! {
            _ = held.over.notified() => {
                warn!(
                    "comm store: closing the connection from {peer}: it would make the server hold more than {} bytes \
                     of unread responses and pending waits for it, or {} for all clients together",
                    limits.per_client,
                    limits.quota
                );
                break;
            }
            read = wire::read_frame_within(&mut rd, wire::MAX_FRAME, limits.frame_deadline, &frames) => read,
        };
        let (frame, permit) = match read {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(FrameError::Io(e)) => {
                tracing::debug!("comm store: connection from {peer} failed: {e}");
                break;
            }
            Err(e) => {
                warn!("comm store: closing the connection from {peer}: {e}");
                break;
            }
        };
        let decoded = wire::decode_request(&frame);
        // The frame's bytes are free again once decoded; what the request keeps is counted below.
        drop((frame, permit));
        let (id, req) = match decoded {
            Ok(r) => r,
            Err(e) => {
                warn!("comm store: closing the connection from {peer}: malformed request ({})", e.0);
                break;
            }
        };
        match req {
            // Waits get a task each, so a blocked wait holds up nothing else.
            Request::Get { key, timeout } => {
                let store = store.clone();
                let cost = wait_cost(std::slice::from_ref(&key));
                if held.take(cost) {
                    spawn_wait(id, tx.clone(), held.clone(), cost, async move { store.store.get(&key, timeout).await });
                }
            }
            Request::Wait { keys, timeout } => {
                let store = store.clone();
                let cost = wait_cost(&keys);
                if held.take(cost) {
                    spawn_wait(id, tx.clone(), held.clone(), cost, async move {
                        wait(&store.store, &keys, timeout).await.map(|()| Vec::new())
                    });
                }
            }
            // The rest complete at once, in the order they arrived.
            other => held.respond(&tx, store.immediate(id, other).await),
        }
    }
    // The client is gone or misbehaved: drop what it still waits for.
    writer.abort();
}

/// Serves a wait on a task of its own, which ends early if the connection goes away; `cost`
/// is given back to `held` when it ends.
fn spawn_wait(
    id: u64,
    tx: mpsc::UnboundedSender<Bytes>,
    held: Arc<Holdings>,
    cost: usize,
    wait: impl Future<Output = Result<Vec<u8>, CommError>> + Send + 'static,
) {
    tokio::spawn(async move {
        tokio::select! {
            r = wait => {
                held.give(cost);
                held.respond(&tx, r.map_or_else(|e| error_response(id, e), |v| wire::response(id, wire::STATUS_OK, &v)));
            }
            _ = tx.closed() => held.give(cost),
        }
    });
}

/// Runs the server's side of the handshake (see `wire`): whether to go on serving.
async fn handshake(rd: &mut OwnedReadHalf, wr: &mut OwnedWriteHalf, peer: SocketAddr, token: &[u8]) -> bool {
    match tokio::time::timeout(HELLO_TIMEOUT, authenticate(rd, wr, peer, token)).await {
        Ok(ok) => ok,
        Err(_) => {
            warn!("comm store: {peer} did not complete the handshake within {HELLO_TIMEOUT:?}; closing");
            false
        }
    }
}

async fn authenticate(rd: &mut OwnedReadHalf, wr: &mut OwnedWriteHalf, peer: SocketAddr, token: &[u8]) -> bool {
    let hello = match wire::read_frame(rd, wire::HELLO_MAX).await {
        Ok(Some(f)) => f,
        Ok(None) => return false,
        // The first bytes of torch's VALIDATE read as a length: a rank probing whether this
        // port is a torch store (see `rendezvous`). Closing answers "no" at once.
        Err(FrameError::TooLarge(n)) if n == TORCH_PROBE => {
            tracing::debug!("comm store: {peer} probed for a torch store; closing");
            return false;
        }
        Err(e) => {
            warn!("comm store: {peer} is not a store client ({e}); closing");
            return false;
        }
    };
    let mut d = wire::Dec(&hello);
    let version = match (d.take(wire::MAGIC.len()), d.u32()) {
        (Ok(m), Ok(v)) if m == wire::MAGIC => v,
        _ => {
            warn!("comm store: {peer} is not a store client (bad handshake); closing");
            return false;
        }
    };
    let status = |s: u8| wire::Enc::new().raw(&wire::MAGIC).u8(s).u32(wire::VERSION);
    let client_nonce = d.rest().to_vec();
    if version != wire::VERSION || client_nonce.len() != auth::NONCE {
        warn!("comm store: refusing {peer}: protocol version {version}, this server speaks {}", wire::VERSION);
        if let Ok(frame) = status(wire::HELLO_BAD_VERSION).finish(wire::HELLO_MAX) {
            let _ = wire::write_frame(wr, &frame).await;
        }
        return false;
    }
    let Ok(server_nonce) = auth::nonce() else { return false };
    let proof = auth::prove(token, auth::Role::Server, &client_nonce, &server_nonce);
    let Ok(challenge) = status(wire::HELLO_OK).raw(&server_nonce).raw(&proof).finish(wire::HELLO_MAX) else {
        return false;
    };
    if wire::write_frame(wr, &challenge).await.is_err() {
        return false;
    }
    let answer = match wire::read_frame(rd, wire::HELLO_MAX).await {
        Ok(Some(f)) => f,
        // A client that found our proof wrong (another job's) hangs up here.
        _ => return false,
    };
    let ok = auth::verify(token, auth::Role::Client, &client_nonce, &server_nonce, &answer);
    if !ok {
        warn!("comm store: refusing {peer}: job token mismatch (a client of another job?)");
    }
    let verdict = status(if ok { wire::HELLO_OK } else { wire::HELLO_BAD_TOKEN }).finish(wire::HELLO_MAX);
    let sent = match verdict {
        Ok(frame) => wire::write_frame(wr, &frame).await.is_ok(),
        Err(_) => false,
    };
    sent && ok
}

async fn write_responses(mut wr: OwnedWriteHalf, mut rx: mpsc::UnboundedReceiver<Bytes>, held: Arc<Holdings>) {
    while let Some(frame) = rx.recv().await {
        let written = wire::write_frame(&mut wr, &frame).await;
        held.give(frame.len());
        if written.is_err() {
            break;
        }
    }
}

/// The job's store and what its keys and values take, bounded by a quota.
struct Quota {
    store: MemoryStore,
    limit: usize,
    /// Bytes per key (key + value) and their sum. Writes take this lock for their whole
    /// duration, so the accounting matches the store.
    sizes: tokio::sync::Mutex<(HashMap<String, usize>, usize)>,
}

impl Quota {
    fn new(store: MemoryStore, limit: usize) -> Quota {
        Quota { store, limit, sizes: tokio::sync::Mutex::new((HashMap::new(), 0)) }
    }

    /// Serves a request that does not wait.
    async fn immediate(&self, id: u64, req: Request) -> Bytes {
        let mut sizes = self.sizes.lock().await;
        let (map, used) = &mut *sizes;
        let store = &self.store;
        let size = |key: &str, value: usize| key.len().saturating_add(value);
        let check = |key: &str, value: usize| -> Result<(), CommError> {
            let after = (*used - map.get(key).copied().unwrap_or(0)).saturating_add(size(key, value));
            if after > self.limit {
                return Err(CommError::Store(format!(
                    "the store's quota of {} bytes is exceeded: setting `{key}` ({value} bytes) would make it hold {after} \
                     (raise COMM_STORE_QUOTA if the job really needs that much)",
                    self.limit
                )));
            }
            Ok(())
        };
        let r = match req {
            Request::Set { key, value } => match check(&key, value.len()) {
                Ok(()) => store.set(&key, &value).await.map(|()| Some((key, value.len()))),
                Err(e) => Err(e),
            }
            .map(|k| (k, Vec::new())),
            Request::Add { key, delta } => match check(&key, 8) {
                Ok(()) => store.add(&key, delta).await.map(|n| (Some((key, 8)), n.to_le_bytes().to_vec())),
                Err(e) => Err(e),
            },
            Request::CompareSet { key, expected, desired } => match check(&key, desired.len()) {
                Ok(()) => store.compare_set(&key, expected.as_deref(), &desired).await.map(|now| {
                    let len = now.len();
                    (Some((key, len)), now)
                }),
                Err(e) => Err(e),
            },
            Request::Delete { key } => store.delete(&key).await.map(|gone| {
                if let Some(old) = map.remove(&key) {
                    *used -= old;
                }
                (None, vec![u8::from(gone)])
            }),
            Request::Get { .. } | Request::Wait { .. } => {
                Err(CommError::Store("internal: a wait served as immediate".into()))
            }
        };
        match r {
            Ok((written, body)) => {
                if let Some((key, value)) = written {
                    let new = size(&key, value);
                    let old = map.insert(key, new).unwrap_or(0);
                    *used = *used - old + new;
                }
                wire::response(id, wire::STATUS_OK, &body)
            }
            Err(e) => error_response(id, e),
        }
    }
}

/// Waits for `keys`; on timeout, names only the keys still missing.
async fn wait(store: &MemoryStore, keys: &[String], timeout: Duration) -> Result<(), CommError> {
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    match store.wait(&refs, timeout).await {
        Err(CommError::Timeout { op, after, .. }) => {
            let mut missing = Vec::new();
            for k in &refs {
                if store.get(k, Duration::ZERO).await.is_err() {
                    missing.push(format!("`{k}`"));
                }
            }
            if missing.is_empty() {
                // All set just as the wait timed out: still a timeout, name them all.
                missing = refs.iter().map(|k| format!("`{k}`")).collect();
            }
            Err(CommError::timeout(op, after, format!("key(s) {} never set", missing.join(", "))))
        }
        other => other,
    }
}

fn error_response(id: u64, e: CommError) -> Bytes {
    match e {
        CommError::Timeout { detail, .. } => wire::response(id, wire::STATUS_TIMEOUT, detail.as_bytes()),
        CommError::Store(msg) => wire::response(id, wire::STATUS_ERROR, msg.as_bytes()),
        other => wire::response(id, wire::STATUS_ERROR, other.to_string().as_bytes()),
    }
}
