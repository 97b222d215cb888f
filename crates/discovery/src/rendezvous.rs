//! Rank 0 serves the store, every rank connects to it.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::Duration;

use comm_core::{CommError, MemoryStore, Store, WorldInfo};
use tokio::sync::oneshot;

use crate::client::{display_addr, job_token, TcpStore};
use crate::server::{self, StoreServer};

/// The key every rank checks its world size against (the first rank to arrive sets it).
const WORLD_SIZE_KEY: &str = "discovery/world_size";

/// The job's rendezvous store, and the server when this is rank 0.
///
/// - A world of one gets a [`MemoryStore`]; no port is touched.
/// - Rank 0 starts a [`StoreServer`] on `master_addr:master_port` (a host name is resolved; if
///   that exact address cannot be bound, e.g. it names another interface, it listens on all
///   interfaces instead) and connects to it like every other rank. A `master_port` of 0 gives
///   rank 0 an ephemeral port, readable from the returned server, that it must publish itself.
/// - Every other rank connects a [`TcpStore`], retrying until `timeout` for rank 0 to come up.
///
/// Both sides present [`job_token`]. Keep the server alive as long as any rank may use the
/// store: dropping it stops the store for everyone. Each rank also checks that its
/// `world_size` agrees with the first rank's (key `discovery/world_size`), so a rank started
/// with the wrong `WORLD_SIZE` fails here with [`CommError::Mismatch`] instead of hanging later.
pub async fn rendezvous(
    info: &WorldInfo,
    timeout: Duration,
) -> Result<(Arc<dyn Store>, Option<StoreServer>), CommError> {
    if info.world_size == 0 || info.rank >= info.world_size {
        return Err(CommError::Config(format!(
            "rank {} is not in a world of size {} (ranks are 0..world_size)",
            info.rank, info.world_size
        )));
    }
    if info.world_size == 1 {
        return Ok((Arc::new(MemoryStore::new()), None));
    }
    let token = job_token();
    let (store, server) = if info.rank == 0 {
        let server = bind_rank0(&info.master_addr, info.master_port, &token).await?;
        // Connect to what was actually bound: the wildcard fallback, or an ephemeral port.
        let bound = server.local_addr();
        let ip = match bound.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        (TcpStore::connect(&ip.to_string(), bound.port(), &token, timeout).await?, Some(server))
    } else {
        if info.master_port == 0 {
            return Err(CommError::Config(format!(
                "rank {} cannot find rank 0's store: MASTER_PORT is 0 (set it to the port rank 0 listens on)",
                info.rank
            )));
        }
        (TcpStore::connect(&info.master_addr, info.master_port, &token, timeout).await?, None)
    };

    let ws = info.world_size.to_string();
    let stored = store.compare_set(WORLD_SIZE_KEY, None, ws.as_bytes()).await?;
    if stored != ws.as_bytes() {
        return Err(CommError::Mismatch {
            op: "rendezvous",
            detail: format!(
                "rank {} has world size {ws}, but the job at the store {} has world size {} (set by the first rank \
                 to arrive); check WORLD_SIZE on every rank",
                info.rank,
                display_addr(&info.master_addr, info.master_port),
                String::from_utf8_lossy(&stored)
            ),
        });
    }
    Ok((Arc::new(store), server))
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
    let starting = server::start(addr, port, token, move |r| {
        let _ = tx.send(r);
    })?;
    let bound =
        rx.await.unwrap_or_else(|_| Err(CommError::Store("the store server thread exited before binding".into())));
    starting.finish(bound)
}
