//! Rank 0 serves the store, every rank connects to it.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::Duration;

use comm_core::{CommError, MemoryStore, Store, StoreKind, WorldInfo};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::client::{display_addr, job_token, TcpStore};
use crate::net::bind_addr;
use crate::server::{self, StoreServer};
use crate::torch::{probe, Probe, TorchStore};

/// The key every rank checks its world size against (the first rank to arrive sets it).
const WORLD_SIZE_KEY: &str = "discovery/world_size";

/// The job's rendezvous store, and the server when this is rank 0.
///
/// - A world of one gets a [`MemoryStore`]; no port is touched.
/// - [`StoreKind::Rank0`] (the default): rank 0 starts a [`StoreServer`] on
///   `master_addr:master_port` (a host name is resolved; if that exact address cannot be
///   bound, e.g. it names another interface, it listens on all interfaces instead) and
///   connects to it like every other rank. A `master_port` of 0 gives rank 0 an ephemeral
///   port, readable from the returned server, that it must publish itself. Every other rank
///   connects a [`TcpStore`], retrying until `timeout` for rank 0 to come up.
/// - [`StoreKind::External`]: the store is already served there; every rank connects.
/// - [`StoreKind::Torch`] (torchrun, `TORCHELASTIC_USE_AGENT_STORE=True`): torchrun's agent
///   already serves a torch `TCPStore` on `master_port`, so nobody binds it; every rank
///   connects a [`TorchStore`] with keys under `comm/<job>/r<TORCHELASTIC_RESTART_COUNT>/`
///   (`<job>`: a digest of the job token, so two jobs never read each other's keys; a
///   restarted job does not see the previous attempt's keys). Only then is a torch store
///   used: one found on the port otherwise is another job's, and refused.
///
/// Every request on the store is bounded by `timeout` too (waits by their own timeouts).
/// Our own store's clients present [`job_token`] (torch's store has no such check).
/// Connections are made from `COMM_BIND_ADDR` when it is set (see [`bind_addr`]). Keep the
/// server alive as long as any rank may use the store: dropping it stops the store for
/// everyone. Each rank also checks that its `world_size` agrees with the first rank's (key
/// `discovery/world_size`), so a rank started with the wrong `WORLD_SIZE` fails here with
/// [`CommError::Mismatch`] instead of hanging later.
pub async fn rendezvous(
    info: &WorldInfo,
    timeout: Duration,
) -> Result<(Arc<dyn Store>, Option<StoreServer>), CommError> {
    // Explicit configurations are checked here; discovered ones already were.
    if info.world_size == 0 || info.rank >= info.world_size {
        return Err(CommError::Config(format!(
            "rank {} is not in a world of size {} (ranks are 0..world_size)",
            info.rank, info.world_size
        )));
    }
    if info.local_world_size == 0 || info.local_world_size > info.world_size || info.local_rank >= info.local_world_size
    {
        return Err(CommError::Config(format!(
            "local rank {} of {} on this host does not fit a world of {} (local ranks are 0..local_world_size, \
             and local_world_size <= world_size)",
            info.local_rank, info.local_world_size, info.world_size
        )));
    }
    if info.world_size == 1 {
        return Ok((Arc::new(MemoryStore::new()), None));
    }
    if info.master_addr.is_empty() {
        return Err(CommError::Config(format!(
            "launched by {:?} across hosts ({} of the {} ranks on this host), and nothing says where rank 0 runs: \
             export MASTER_ADDR=<rank 0's host> to every rank (e.g. `mpirun -x MASTER_ADDR=host0`), or pass the \
             address explicitly (Config::explicit); under an MPI launcher the mpi and hier backends need no store \
             (build comm-api with the `mpi` feature)",
            info.source.launcher, info.local_world_size, info.world_size
        )));
    }
    let bind = bind_addr()?;
    let shown = display_addr(&info.master_addr, info.master_port);
    let needs_port = |what: &str| {
        CommError::Config(format!(
            "rank {} cannot find the {what}: MASTER_PORT is 0 (set it to the port the store listens on)",
            info.rank
        ))
    };
    let (store, server): (Arc<dyn Store>, Option<StoreServer>) = match info.store {
        StoreKind::Torch => {
            if info.master_port == 0 {
                return Err(needs_port("torch store"));
            }
            (Arc::new(torch_store(info, &shown, timeout, bind).await?), None)
        }
        StoreKind::Rank0 if info.rank == 0 => {
            // Without a job identity our store must not be served.
            let token = job_token(info)?;
            let server = match bind_rank0(&info.master_addr, info.master_port, &token).await {
                Ok(server) => server,
                Err(e) if is_addr_in_use(&e) => return Err(port_taken(info, &shown, bind, e).await),
                Err(e) => return Err(e),
            };
            // Connect to what was actually bound: the wildcard fallback, or an ephemeral port.
            let bound = server.local_addr();
            let ip = match bound.ip() {
                IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
                ip => ip,
            };
            // A bind address of the other family than the store's cannot reach it: drop it.
            let bind = bind.filter(|b| b.is_ipv4() == ip.is_ipv4());
            let store = TcpStore::connect_from(&ip.to_string(), bound.port(), &token, timeout, bind)
                .await?
                .with_request_timeout(timeout);
            (Arc::new(store), Some(server))
        }
        _ => {
            if info.master_port == 0 {
                return Err(needs_port("store"));
            }
            (connect_ours(info, &shown, timeout, bind).await?, None)
        }
    };
    check_world_size(info, &shown, store, server).await
}

/// How long a probe waits for a torch store's PING echo (it answers in microseconds).
const PROBE_LIMIT: Duration = Duration::from_secs(2);

/// Rank 0's store (or the one served for the job), retrying while nothing listens, until
/// `timeout`. A torch store on the port is another job's (a job uses torch's store only under
/// torchrun, `StoreKind::Torch`): refused at once, as our store of another job is by its
/// handshake.
async fn connect_ours(
    info: &WorldInfo,
    shown: &str,
    timeout: Duration,
    bind: Option<IpAddr>,
) -> Result<Arc<dyn Store>, CommError> {
    // A rank that has no job identity is refused at once, as rank 0 is, instead of waiting
    // for a store no rank of its job will serve.
    let token = job_token(info)?;
    // Out of time before anything answered (an address that does not resolve in time lands
    // here too): said with the whole budget, not what was left of it.
    let never_came_up = |why: String| {
        CommError::Store(format!(
            "rank 0's store never came up at {shown} after {} (is MASTER_ADDR/MASTER_PORT right? did rank 0 \
             start?); last error: {why}",
            comm_core::config::fmt_duration(timeout)
        ))
    };
    let deadline = Instant::now() + timeout;
    let mut backoff = Duration::from_millis(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let probed = probe(&info.master_addr, info.master_port, bind, PROBE_LIMIT.min(left)).await;
        let left = deadline.saturating_duration_since(Instant::now());
        match probed {
            Probe::Torch => return Err(torch_not_ours(info, shown)),
            Probe::Unreachable(why) if left.is_zero() => return Err(never_came_up(why)),
            Probe::Silent if left.is_zero() => {
                let limit = comm_core::config::fmt_duration(PROBE_LIMIT.min(timeout));
                return Err(never_came_up(format!("nothing answered within {limit}")));
            }
            Probe::Unreachable(why) => {
                tracing::trace!("comm: store at {shown} not reachable yet: {why}");
                tokio::time::sleep(backoff.min(left)).await;
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
            // Ours, something else, or out of time: our client retries and reports as usual.
            _ => {
                let store = TcpStore::connect_from(&info.master_addr, info.master_port, &token, left, bind)
                    .await?
                    .with_request_timeout(timeout);
                tracing::debug!(addr = %shown, local = ?store.local_addr(), "comm: connected to the store");
                return Ok(Arc::new(store));
            }
        }
    }
}

/// Rank 0 found its port taken: by a torch store (said so), or by something else.
async fn port_taken(info: &WorldInfo, shown: &str, bind: Option<IpAddr>, e: CommError) -> CommError {
    match probe(&info.master_addr, info.master_port, bind, PROBE_LIMIT).await {
        Probe::Torch => torch_not_ours(info, shown),
        _ => CommError::Config(format!(
            "rank 0 cannot serve the job's store at {shown}: the port is taken ({e}); another job may be using it: \
             set MASTER_PORT to a free port"
        )),
    }
}

fn torch_not_ours(info: &WorldInfo, shown: &str) -> CommError {
    CommError::Config(format!(
        "rank {}: a torch TCPStore serves {shown}, and it is not this job's (this job was not started by torchrun \
         with its agent store): another job's torch.distributed or torchrun holds the port, and sharing it would \
         mix the two jobs; set MASTER_PORT to a free port",
        info.rank
    ))
}

async fn torch_store(
    info: &WorldInfo,
    shown: &str,
    timeout: Duration,
    bind: Option<IpAddr>,
) -> Result<TorchStore, CommError> {
    let prefix = torch_prefix(&job_token(info)?);
    let store = TorchStore::connect(&info.master_addr, info.master_port, &prefix, timeout, bind)
        .await?
        .with_request_timeout(timeout);
    tracing::debug!(addr = %shown, prefix = %prefix, local = ?store.local_addr(), "comm: using the torch store");
    Ok(store)
}

/// Every rank checks its world size against the first rank's.
async fn check_world_size(
    info: &WorldInfo,
    shown: &str,
    store: Arc<dyn Store>,
    server: Option<StoreServer>,
) -> Result<(Arc<dyn Store>, Option<StoreServer>), CommError> {
    let ws = info.world_size.to_string();
    let stored = store.compare_set(WORLD_SIZE_KEY, None, ws.as_bytes()).await?;
    if stored != ws.as_bytes() {
        return Err(CommError::mismatch(
            "rendezvous",
            format!(
                "rank {} has world size {ws}, but the job at the store {shown} has world size {} (set by the first \
                 rank to arrive); check WORLD_SIZE on every rank",
                info.rank,
                String::from_utf8_lossy(&stored)
            ),
        ));
    }
    Ok((store, server))
}

/// The key prefix in torch's store: ours, per job (a digest of its token, so jobs sharing an
/// agent's store never read each other's keys) and per restart of the job.
pub(crate) fn torch_prefix(token: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::new().chain_update(b"comm torch prefix\0").chain_update(token.as_bytes()).finalize();
    let job: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    let restart = std::env::var("TORCHELASTIC_RESTART_COUNT").ok().filter(|r| !r.trim().is_empty());
    format!("comm/{job}/r{}/", restart.as_deref().map_or("0", str::trim))
}

/// Binds `addr:port`, or all interfaces on `port` when that exact address cannot be bound.
async fn bind_rank0(addr: &str, port: u16, token: &str) -> Result<StoreServer, CommError> {
    let exact = match bind(addr, port, token).await {
        Ok(server) => return Ok(server),
        // The port is taken: the wildcard address would not do better.
        Err(e @ CommError::Io { .. }) if is_addr_in_use(&e) => return Err(e),
        Err(e) => e,
    };
    let any = if addr.parse::<Ipv6Addr>().is_ok() { "::" } else { "0.0.0.0" };
    if addr == any {
        return Err(exact);
    }
    let server = bind(any, port, token).await?;
    tracing::info!(
        "comm store: could not listen on {} ({exact}); listening on {} instead",
        display_addr(addr, port),
        server.local_addr()
    );
    Ok(server)
}

fn is_addr_in_use(e: &CommError) -> bool {
    matches!(e, CommError::Io { source, .. } if source.kind() == std::io::ErrorKind::AddrInUse)
}

/// [`StoreServer::bind`] without blocking the caller's executor while the server starts.
async fn bind(addr: &str, port: u16, token: &str) -> Result<StoreServer, CommError> {
    let (tx, rx) = oneshot::channel();
    let starting = server::start(addr, port, token, server::ServerLimits::from_env()?, move |r| {
        let _ = tx.send(r);
    })?;
    let bound =
        rx.await.unwrap_or_else(|_| Err(CommError::Store("the store server thread exited before binding".into())));
    starting.finish(bound)
}

#[cfg(test)]
mod tests {
    #[test]
    fn jobs_get_torch_prefixes_of_their_own() {
        let (a, b) = (super::torch_prefix("job-a"), super::torch_prefix("job-b"));
        assert_ne!(a, b, "two tokens never share keys");
        assert_eq!(a, super::torch_prefix("job-a"), "every rank of a job computes the same prefix");
        assert!(a.starts_with("comm/") && a.len() == "comm/".len() + 16 + "/r0/".len(), "{a}");
    }
}
