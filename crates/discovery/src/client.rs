//! The TCP store client every rank uses.

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Buf, Bytes};
use comm_core::{CommError, Launcher, Store, WorldInfo};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

use crate::auth;
use crate::net::Hello;
use crate::wire::{self, op, Dec, Enc, FrameError};

/// How long a request that does not wait (`set`, `add`...) may go unanswered by default.
const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(300);
/// Extra time a wait's reply may take beyond its timeout (the server answers at the timeout).
const REPLY_GRACE: Duration = Duration::from_secs(10);

/// The job token this process presents to (or expects from) the store, which keeps the ranks of
/// two jobs that use the same address and port from ever pairing. The launcher that started
/// the ranks decides:
///
/// 1. `COMM_JOB_TOKEN` when set and not blank (commrun sets a random one; empty is the same as unset).
/// 2. The identity of the launcher that started this process: Open MPI's job id (or its PMIx
///    namespace) under `mpirun`, even inside a Slurm allocation (two `mpirun`s of one
///    `salloc` are two jobs); the PMIx namespace under a PMIx launcher; Slurm's job **and
///    step** id under `srun`; torch elastic's run id under torchrun; under MPICH/Hydra or the
///    DeepSpeed launcher on one host, the launcher's per-host process (`hydra_pmi_proxy`, the
///    DeepSpeed launcher's python: pid and start time), found through any wrapper between it
///    and the rank (`sh -c`, `nsys`, `perf`).
/// 3. Any other identity the environment holds, in this order: Slurm job and step (the batch
///    script counts as a step of its own), PMIx namespace, Open MPI job id, torch elastic run
///    id.
/// 4. None when the port was chosen for this job: an explicit config, `MASTER_PORT` from
///    torchrun, or given to an MPI launcher across hosts.
/// 5. Otherwise (ranks started by hand with `RANK`/`WORLD_SIZE`, whatever the port) an error
///    naming the fix: two such jobs on one port would pair, silently mixing their data.
pub fn job_token(info: &WorldInfo) -> Result<String, CommError> {
    job_token_from(info, |name| std::env::var(name).ok(), ancestors)
}

/// One process above this one: `pid.start_time` (start time in clock ticks since boot, so a
/// reused pid is another process), its name (`/proc/<pid>/comm`) and command line.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Ancestor {
    pub(crate) id: String,
    pub(crate) name: String,
    pub(crate) cmdline: String,
}

/// [`job_token`] with the variables from `var` and the process tree from `ancestors`.
pub(crate) fn job_token_from(
    info: &WorldInfo,
    var: impl Fn(&str) -> Option<String>,
    ancestors: impl Fn() -> Vec<Ancestor>,
) -> Result<String, CommError> {
    // An empty (or blank) token is no token: every job would share it.
    if let Some(t) = var("COMM_JOB_TOKEN").filter(|t| !t.trim().is_empty()) {
        return Ok(t);
    }
    let set = |name: &str| var(name).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty());
    let bounded = |t: String| t.chars().take(wire::MAX_TOKEN).collect::<String>();
    // The batch script itself (no step id) is a job of its own too.
    let slurm =
        || set("SLURM_JOB_ID").map(|job| format!("slurm:{job}.{}", set("SLURM_STEP_ID").as_deref().unwrap_or("batch")));
    let pmix = || set("PMIX_NAMESPACE").map(|ns| format!("pmix:{ns}"));
    let ompi = || set("OMPI_MCA_ess_base_jobid").map(|id| format!("ompi:{id}"));
    // torchrun's run id is "none" unless a rendezvous id was given.
    let elastic = || set("TORCHELASTIC_RUN_ID").filter(|v| v != "none").map(|id| format!("torchelastic:{id}"));
    let one_host = info.local_world_size == info.world_size;
    let own = match info.source.launcher {
        Launcher::OpenMpi => ompi().or_else(pmix),
        Launcher::Pmix => pmix(),
        Launcher::Slurm => slurm(),
        Launcher::Torchrun => elastic(),
        Launcher::Mpich | Launcher::DeepSpeed if one_host => {
            launcher_process(info.source.launcher, &ancestors()).map(|p| format!("parent:{p}"))
        }
        _ => None,
    };
    if let Some(t) = own.or_else(slurm).or_else(pmix).or_else(ompi).or_else(elastic) {
        return Ok(bounded(t));
    }
    // A port chosen for this job by the program (an explicit config), by torchrun for its
    // agents, or given to an MPI launcher across hosts is the job's identity. Ranks started by
    // hand have none: two such jobs on one port would pair, so they are refused.
    let torchrun = ["TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "GROUP_RANK"].iter().any(|v| var(v).is_some());
    let chosen_port = set("MASTER_PORT").is_some()
        && match info.source.launcher {
            Launcher::Torchrun => torchrun,
            Launcher::Single => true,
            _ => !one_host,
        };
    if info.source.launcher == Launcher::Explicit || chosen_port {
        return Ok(String::new());
    }
    let by_hand = info.source.launcher == Launcher::Torchrun && !torchrun;
    Err(CommError::Config(format!(
        "cannot tell this job from another job on the same rendezvous port ({}:{}): {}; give its ranks the same \
         COMM_JOB_TOKEN (any string of the job's own, e.g. `export COMM_JOB_TOKEN=$(uuidgen)`), or start them with \
         commrun, torchrun, mpirun or srun",
        info.master_addr,
        info.master_port,
        if by_hand {
            "its ranks were started by hand (RANK and WORLD_SIZE, no launcher)".to_owned()
        } else {
            format!(
                "the launcher ({:?}) exports no job id{}",
                info.source.launcher,
                if one_host { "" } else { " and no MASTER_PORT of the job's own was given" }
            )
        }
    )))
}

/// The per-host process of `launcher` among `ancestors` (nearest first): Hydra's proxy, or the
/// DeepSpeed launcher's python; the direct parent when none is found (a launcher that starts
/// the ranks itself).
fn launcher_process(launcher: Launcher, ancestors: &[Ancestor]) -> Option<String> {
    let is_launcher = |a: &&Ancestor| match launcher {
        Launcher::Mpich => matches!(a.name.as_str(), "hydra_pmi_proxy" | "pmi_proxy"),
        _ => a.cmdline.contains("deepspeed.launcher.launch") || a.cmdline.contains("deepspeed/launcher/launch.py"),
    };
    ancestors.iter().find(is_launcher).or(ancestors.first()).map(|a| a.id.clone())
}

/// This process's ancestors, parent first, up to (not including) init.
pub(crate) fn ancestors() -> Vec<Ancestor> {
    let mut out = Vec::new();
    let mut pid = std::os::unix::process::parent_id();
    while pid > 1 && out.len() < 64 {
        let Some((a, ppid)) = read_process(pid) else { break };
        out.push(a);
        pid = ppid;
    }
    out
}

/// `pid`'s identity and its parent's pid, from `/proc`.
fn read_process(pid: u32) -> Option<(Ancestor, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces and parentheses): state is field
    // 3, the parent field 4, start time field 22.
    let fields: Vec<&str> = stat.get(stat.rfind(')')? + 1..)?.split_whitespace().collect();
    let (ppid, start) = (fields.get(1)?.parse().ok()?, fields.get(19)?);
    let name = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default().trim().to_owned();
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
    Some((Ancestor { id: format!("{pid}.{start}"), name, cmdline }, ppid))
}

/// `addr:port`, with brackets around an IPv6 address.
pub(crate) fn display_addr(addr: &str, port: u16) -> String {
    if addr.contains(':') && !addr.starts_with('[') {
        format!("[{addr}]:{port}")
    } else {
        format!("{addr}:{port}")
    }
}

/// A client of a [`StoreServer`](crate::StoreServer): the [`Store`] every rank uses.
///
/// Cloning is cheap and clones share the connection. Requests from several tasks may be in
/// flight at once: each carries an id and its reply is matched to it, so a task blocked in
/// [`Store::get`] does not hold up another task's [`Store::set`] on the same client.
///
/// The connection is driven by a dedicated OS thread with its own small tokio runtime, so the
/// client works from any executor and cancelling a request (dropping its future) never leaves
/// half a frame on the wire. The thread ends when the last clone is dropped. If the connection
/// is lost, every pending and later request fails with [`CommError::Store`] saying why.
///
/// Every request has a deadline: waits their own timeout (plus a grace period for the reply),
/// others the request timeout (300 s unless changed with [`TcpStore::with_request_timeout`]).
#[derive(Clone)]
pub struct TcpStore {
    inner: Arc<Inner>,
    request_timeout: Duration,
}

struct Inner {
    /// `addr:port`, for messages.
    shown: String,
    /// This end of the connection.
    local_addr: Option<SocketAddr>,
    calls: mpsc::UnboundedSender<Call>,
    next_id: AtomicU64,
    /// Why the connection ended, once it has.
    closed: Closed,
}

type Closed = Arc<Mutex<Option<String>>>;
type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Reply>>>>;

/// A request handed to the connection thread.
struct Call {
    id: u64,
    frame: Bytes,
    /// How long to wait for the reply.
    limit: Duration,
    reply: oneshot::Sender<Result<Reply, CommError>>,
}

struct Reply {
    status: u8,
    body: Bytes,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Records why the connection ended; the first reason wins.
fn set_closed(closed: &Closed, why: String) {
    lock(closed).get_or_insert(why);
}

impl fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The local address tells which interface this rank reached the store from.
        f.debug_struct("TcpStore")
            .field("addr", &self.inner.shown)
            .field("local", &self.inner.local_addr)
            .finish_non_exhaustive()
    }
}

impl TcpStore {
    /// Connects to the store at `addr:port` presenting `token` (see [`job_token`]).
    ///
    /// Retries with backoff (10 ms doubling to 500 ms) until `timeout`, since rank 0 may not
    /// be listening yet; then fails with a [`CommError::Store`] saying the store never came
    /// up. A server that refuses the token fails at once: it belongs to another job.
    pub async fn connect(addr: &str, port: u16, token: &str, timeout: Duration) -> Result<TcpStore, CommError> {
        Self::connect_from(addr, port, token, timeout, None).await
    }

    /// [`TcpStore::connect`] from the local address `bind` (see [`bind_addr`](crate::bind_addr)).
    pub async fn connect_from(
        addr: &str,
        port: u16,
        token: &str,
        timeout: Duration,
        bind: Option<IpAddr>,
    ) -> Result<TcpStore, CommError> {
        if token.len() > wire::MAX_TOKEN {
            return Err(CommError::Config(format!(
                "COMM_JOB_TOKEN is {} bytes long; at most {} are allowed",
                token.len(),
                wire::MAX_TOKEN
            )));
        }
        let shown = display_addr(addr, port);
        let (calls_tx, calls_rx) = mpsc::unbounded_channel();
        let (ready_tx, ready_rx) = oneshot::channel();
        let closed = Closed::default();
        let thread_closed = closed.clone();
        let (addr, token, thread_shown) = (addr.to_owned(), token.to_owned(), shown.clone());
        std::thread::Builder::new()
            .name("comm-store-client".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread().enable_io().enable_time().build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(CommError::io("starting the store client's runtime", e)));
                        return;
                    }
                };
                rt.block_on(async move {
                    let mut ready_tx = ready_tx;
                    let connected = tokio::select! {
                        r = connect_with_retry(&addr, port, bind, &token, timeout, &thread_shown) => r,
                        // The caller stopped waiting: give up early.
                        _ = ready_tx.closed() => return,
                    };
                    match connected {
                        Ok(stream) => {
                            let local = stream.local_addr().ok();
                            if ready_tx.send(Ok(local)).is_ok() {
                                run(stream, calls_rx, thread_closed, thread_shown).await;
                            }
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                        }
                    }
                });
            })
            .map_err(|e| CommError::io("spawning the store client thread", e))?;
        let local_addr =
            ready_rx.await.unwrap_or_else(|_| Err(CommError::Store("the store client thread exited".into())))?;
        Ok(TcpStore {
            inner: Arc::new(Inner { shown, local_addr, calls: calls_tx, next_id: AtomicU64::new(1), closed }),
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        })
    }

    /// This client with another deadline for requests that do not wait (`set`, `add`,
    /// `compare_set`, `delete`); the default is 300 s.
    pub fn with_request_timeout(mut self, timeout: Duration) -> TcpStore {
        self.request_timeout = timeout;
        self
    }

    /// The local address of the connection to the store (which interface this rank uses).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.inner.local_addr
    }

    fn lost(&self) -> CommError {
        let why = lock(&self.inner.closed).clone().unwrap_or_else(|| "the connection closed".into());
        CommError::Store(format!("lost the connection to the store at {}: {why} (did rank 0 exit?)", self.inner.shown))
    }

    /// Sends a request built by `build` (after its id) and returns its reply's body.
    ///
    /// `wait` is the timeout of a request the server may hold (`get`, `wait`); others get the
    /// request timeout.
    async fn request(
        &self,
        name: &'static str,
        size_hint: usize,
        wait: Option<Duration>,
        build: impl FnOnce(Enc) -> Enc,
    ) -> Result<Vec<u8>, CommError> {
        let limit = wait.map_or(self.request_timeout, |t| t.min(wire::MAX_WAIT).saturating_add(REPLY_GRACE));
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = build(Enc::with_capacity(size_hint + 32).u64(id)).finish(wire::MAX_FRAME).map_err(|n| {
            CommError::invalid(
                name,
                format!("the request is {n} bytes, over the store's limit of {} bytes per frame", wire::MAX_FRAME),
            )
        })?;
        let (tx, rx) = oneshot::channel();
        self.inner.calls.send(Call { id, frame, limit, reply: tx }).map_err(|_| self.lost())?;
        let reply = rx.await.map_err(|_| self.lost())??;
        match reply.status {
            wire::STATUS_OK => Ok(reply.body.into()),
            wire::STATUS_TIMEOUT => Err(CommError::timeout(
                name,
                wait.unwrap_or(limit),
                format!("{} (store at {})", String::from_utf8_lossy(&reply.body), self.inner.shown),
            )),
            wire::STATUS_ERROR => Err(CommError::Store(String::from_utf8_lossy(&reply.body).into_owned())),
            s => Err(CommError::Store(format!("malformed reply from the store at {} (status {s})", self.inner.shown))),
        }
    }

    fn malformed(&self, name: &str) -> CommError {
        CommError::Store(format!("malformed reply to {name} from the store at {}", self.inner.shown))
    }
}

#[async_trait]
impl Store for TcpStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<(), CommError> {
        let size = key.len() + value.len();
        self.request("store set", size, None, |e| e.u8(op::SET).bytes(key.as_bytes()).bytes(value)).await.map(drop)
    }

    async fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, CommError> {
        self.request("store get", key.len(), Some(timeout), |e| e.u8(op::GET).bytes(key.as_bytes()).duration(timeout))
            .await
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64, CommError> {
        let body =
            self.request("store add", key.len(), None, |e| e.u8(op::ADD).bytes(key.as_bytes()).i64(delta)).await?;
        let mut d = Dec(&body);
        d.i64().ok().filter(|_| d.end().is_ok()).ok_or_else(|| self.malformed("add"))
    }

    async fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>, CommError> {
        let size = key.len() + expected.map_or(0, <[u8]>::len) + desired.len();
        self.request("store compare_set", size, None, |e| {
            let e = e.u8(op::COMPARE_SET).bytes(key.as_bytes());
            match expected {
                None => e.u8(0),
                Some(x) => e.u8(1).bytes(x),
            }
            .bytes(desired)
        })
        .await
    }

    async fn delete(&self, key: &str) -> Result<bool, CommError> {
        let body = self.request("store delete", key.len(), None, |e| e.u8(op::DELETE).bytes(key.as_bytes())).await?;
        match body.as_slice() {
            [0] => Ok(false),
            [1] => Ok(true),
            _ => Err(self.malformed("delete")),
        }
    }

    async fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), CommError> {
        let size = keys.iter().map(|k| k.len() + 4).sum();
        self.request("store wait", size, Some(timeout), |e| {
            let e = e.u8(op::WAIT).duration(timeout).u32(u32::try_from(keys.len()).unwrap_or(u32::MAX));
            keys.iter().fold(e, |e, k| e.bytes(k.as_bytes()))
        })
        .await
        .map(drop)
    }
}

async fn connect_with_retry(
    addr: &str,
    port: u16,
    bind: Option<IpAddr>,
    token: &str,
    timeout: Duration,
    shown: &str,
) -> Result<TcpStream, CommError> {
    let attempt = |left| async move {
        // A host name is resolved on every attempt: it may only appear once rank 0's host is up.
        match tokio::time::timeout(left, crate::net::dial(addr, port, bind)).await {
            Ok(Ok(stream)) => match tokio::time::timeout(left, hello(stream, token, shown)).await {
                Ok(done) => done,
                Err(_) => Err(Hello::Retry(
                    "no handshake reply: something else listens on MASTER_PORT (a torch TCPStore, such as torchrun's \
                     agent store, stays silent like this: set TORCHELASTIC_USE_AGENT_STORE=True or COMM_STORE=torch \
                     to use it)"
                        .into(),
                )),
            },
            Ok(Err(e)) => Err(Hello::Retry(e.to_string())),
            Err(_) => Err(Hello::Retry("the connection attempt timed out".into())),
        }
    };
    crate::net::retry(timeout, attempt, |last| {
        CommError::Store(format!(
            "rank 0's store never came up at {shown} after {} (is MASTER_ADDR/MASTER_PORT right? did rank 0 \
             start?); last error: {last}",
            comm_core::config::fmt_duration(timeout)
        ))
    })
    .await
}

/// Runs the client's side of the handshake (see `wire`): the server proves it knows the job
/// token before this rank proves it does.
async fn hello(mut stream: TcpStream, token: &str, shown: &str) -> Result<TcpStream, Hello> {
    let client_nonce = auth::nonce().map_err(Hello::Refused)?;
    let frame = Enc::new()
        .raw(&wire::MAGIC)
        .u32(wire::VERSION)
        .raw(&client_nonce)
        .finish(wire::HELLO_MAX)
        .map_err(|_| Hello::Refused(CommError::Store("internal: handshake frame too large".into())))?;
    wire::write_frame(&mut stream, &frame)
        .await
        .map_err(|e| Hello::Retry(format!("sending the handshake failed: {e}")))?;
    let not_a_store = || not_a_store(shown);
    let another_job = || {
        Hello::Refused(CommError::Store(format!(
            "store at {shown} belongs to another job (job token mismatch: the store was started with another \
             job identity than this rank's); if these ranks are one job, started apart or by different launchers, \
             give all of them the same COMM_JOB_TOKEN"
        )))
    };
    let reply = read_hello(&mut stream, shown).await?;
    let mut d = Dec(&reply);
    let (Ok(m), Ok(status), Ok(version)) = (d.take(wire::MAGIC.len()), d.u8(), d.u32()) else {
        return Err(not_a_store());
    };
    if m != wire::MAGIC {
        return Err(not_a_store());
    }
    match status {
        wire::HELLO_OK => {}
        wire::HELLO_BAD_VERSION => {
            return Err(Hello::Refused(CommError::Store(format!(
                "store at {shown} speaks protocol version {version}, this rank speaks version {} (ranks built from \
                 different versions of the library?)",
                wire::VERSION
            ))));
        }
        _ => return Err(not_a_store()),
    }
    let (Ok(server_nonce), Ok(proof)) = (d.take(auth::NONCE), d.take(auth::PROOF)) else {
        return Err(not_a_store());
    };
    // A server that cannot prove it knows the token is not this job's store, whatever it says:
    // it gets no proof of ours and no request.
    if !auth::verify(token.as_bytes(), auth::Role::Server, &client_nonce, server_nonce, proof) {
        return Err(another_job());
    }
    let answer = auth::prove(token.as_bytes(), auth::Role::Client, &client_nonce, server_nonce);
    let answer = Enc::new()
        .raw(&answer)
        .finish(wire::HELLO_MAX)
        .map_err(|_| Hello::Refused(CommError::Store("internal: handshake frame too large".into())))?;
    wire::write_frame(&mut stream, &answer)
        .await
        .map_err(|e| Hello::Retry(format!("sending the handshake failed: {e}")))?;
    let verdict = read_hello(&mut stream, shown).await?;
    let mut d = Dec(&verdict);
    match (d.take(wire::MAGIC.len()), d.u8()) {
        (Ok(m), Ok(wire::HELLO_OK)) if m == wire::MAGIC => Ok(stream),
        (Ok(m), Ok(wire::HELLO_BAD_TOKEN)) if m == wire::MAGIC => Err(another_job()),
        _ => Err(not_a_store()),
    }
}

fn not_a_store(shown: &str) -> Hello {
    Hello::Refused(CommError::Store(format!(
        "{shown} is not a comm rendezvous store (unexpected handshake reply); is MASTER_PORT used by another service?"
    )))
}

async fn read_hello(stream: &mut TcpStream, shown: &str) -> Result<Bytes, Hello> {
    match wire::read_frame(stream, wire::HELLO_MAX).await {
        Ok(Some(r)) => Ok(r),
        Ok(None) => Err(Hello::Retry(
            "the peer closed the connection during the handshake (is something else listening on MASTER_PORT?)".into(),
        )),
        Err(FrameError::TooLarge(_)) => Err(not_a_store(shown)),
        Err(e) => Err(Hello::Retry(format!("the handshake failed: {e}"))),
    }
}

/// Drives the connection: writes requests as they come, matches replies, enforces deadlines.
async fn run(stream: TcpStream, mut calls: mpsc::UnboundedReceiver<Call>, closed: Closed, shown: String) {
    let (rd, mut wr) = stream.into_split();
    let pending = Pending::default();
    let mut reader = tokio::spawn(read_replies(rd, pending.clone(), closed.clone()));
    loop {
        tokio::select! {
            call = calls.recv() => {
                // `None`: every handle is gone; closing the socket is all that is left.
                let Some(call) = call else { break };
                let (tx, rx) = oneshot::channel();
                lock(&pending).insert(call.id, tx);
                if let Err(e) = wire::write_frame(&mut wr, &call.frame).await {
                    // Before `call` drops, so its caller reads the reason.
                    set_closed(&closed, format!("sending a request failed: {e}"));
                    break;
                }
                tokio::spawn(forward(call, rx, pending.clone(), shown.clone()));
            }
            _ = &mut reader => {
                set_closed(&closed, "the connection's reader stopped".into());
                break;
            }
        }
    }
    reader.abort();
    // Returning drops the runtime with the `forward` tasks, and with them the callers' reply
    // senders: callers then report the reason recorded in `closed`.
}

/// Reads replies and hands each to the request with its id, until the connection ends.
async fn read_replies(mut rd: OwnedReadHalf, pending: Pending, closed: Closed) {
    // A reply is at most a stored value plus its header, and values fit in a request frame.
    let why = loop {
        let mut frame = match wire::read_frame(&mut rd, wire::MAX_FRAME).await {
            Ok(Some(f)) => f,
            Ok(None) => break "the store closed the connection".to_owned(),
            Err(e) => break format!("reading from the store failed: {e}"),
        };
        // The header is read off the frame: what is left is the body.
        let (Ok(id), Ok(status)) = (frame.try_get_u64_le(), frame.try_get_u8()) else {
            break "malformed reply from the store".to_owned();
        };
        // No entry: the request's deadline passed or its caller gave up; drop the reply.
        if let Some(tx) = lock(&pending).remove(&id) {
            let _ = tx.send(Reply { status, body: frame });
        }
    };
    set_closed(&closed, why);
}

/// Waits for one request's reply, up to its deadline, and hands it to the caller.
async fn forward(call: Call, rx: oneshot::Receiver<Reply>, pending: Pending, shown: String) {
    enum Outcome {
        Reply(Reply),
        Lost,
        TimedOut,
        Abandoned,
    }
    let Call { id, limit, mut reply, .. } = call;
    let outcome = tokio::select! {
        r = rx => r.map_or(Outcome::Lost, Outcome::Reply),
        _ = tokio::time::sleep(limit) => Outcome::TimedOut,
        _ = reply.closed() => Outcome::Abandoned,
    };
    match outcome {
        Outcome::Reply(r) => {
            let _ = reply.send(Ok(r));
        }
        // Dropping `reply` makes the caller report why the connection ended.
        Outcome::Lost => {}
        Outcome::TimedOut => {
            lock(&pending).remove(&id);
            let _ = reply.send(Err(CommError::timeout(
                "store request",
                limit,
                format!("no reply from the store at {shown} (is rank 0 alive and reachable?)"),
            )));
        }
        Outcome::Abandoned => {
            lock(&pending).remove(&id);
        }
    }
}
