//! Starting the hierarchical backend (`backend_hier`) on top of a started MPI world: the
//! hosts from one all_gather of host identities, then per host an shm group whose rendezvous
//! store the host's leader serves on loopback (its port and token shared over MPI).

use std::sync::Arc;
use std::time::Duration;

use backend_hier::{HierBackend, HierOptions, Layout};
use backend_shm::{ShmBackend, ShmOptions};
use comm_core::{handle, Backend, CommError, Store};
use discovery::{StoreServer, TcpStore};

/// What [`start`] made.
pub(crate) enum Started {
    /// A hierarchical group over the hosts described.
    Hier { backend: Arc<dyn Backend>, server: Option<StoreServer>, describe: String },
    /// The world group as it was (auto found one host, or one rank per host).
    Flat(Arc<dyn Backend>),
}

/// Builds the hierarchical group over `world` (collective over it) when `asked`, or when the
/// ranks are on several hosts with more than one on some host.
pub(crate) async fn start(world: Arc<dyn Backend>, asked: bool, timeout: Duration) -> Result<Started, CommError> {
    let layout = Layout::discover(&*world, &handle::host_identity()).await?;
    if !asked && !layout.is_hierarchical() {
        return Ok(Started::Flat(world));
    }
    // The leader serves its host's store on loopback: reachable from exactly its host.
    // A leader that cannot serve says so in its payload: its host's ranks fail with its reason
    // instead of waiting for a store that never comes.
    let (server, mine) = if layout.is_leader() {
        match serve_host_store() {
            Ok((server, payload)) => (Some(server), payload),
            Err(e) => {
                // At most what one slot of the exchange holds.
                let mut why = format!("! {e}");
                while why.len() > 250 {
                    why.pop();
                }
                (None, why)
            }
        }
    } else {
        (None, String::new())
    };
    let theirs = backend_hier::from_leader(&*world, &layout, mine.as_bytes()).await?;
    let theirs = String::from_utf8_lossy(&theirs).into_owned();
    if let Some(why) = theirs.strip_prefix("! ") {
        return Err(CommError::Store(format!("the first rank of this host could not serve its shm store: {why}")));
    }
    let (port, token) = theirs
        .split_once(' ')
        .and_then(|(p, t)| Some((p.parse::<u16>().ok()?, t.to_owned())))
        .ok_or_else(|| CommError::Store(format!("malformed host store address `{theirs}` from the host leader")))?;
    let store: Arc<dyn Store> = Arc::new(TcpStore::connect("127.0.0.1", port, &token, timeout).await?);
    let mut opts = ShmOptions { timeout, ..ShmOptions::from_env()? };
    // shm spins (and binds its workers) only when its ranks have a core each; hosts sharing
    // one machine (containers, simulated hosts) count too, or their spinning ranks take the
    // cores the others need.
    if layout.is_crowded() {
        opts.spin = opts.spin.or(Some(Duration::ZERO));
        opts.pin = opts.pin.or(Some(false));
    }
    let local = ShmBackend::new(store, layout.local_index() as u32, layout.local_size() as u32, opts).await?;
    let hier = HierBackend::new(world, Arc::new(local), layout, HierOptions::from_env()?).await?;
    let describe = hier.describe();
    Ok(Started::Hier { backend: Arc::new(hier), server, describe })
}

/// The host's rendezvous store, on loopback with a random token; and `port token` for the
/// host's ranks.
fn serve_host_store() -> Result<(StoreServer, String), CommError> {
    let mut raw = [0u8; 16];
    getrandom::fill(&mut raw).map_err(|e| CommError::Store(format!("random store token: {e}")))?;
    let token: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    let server = StoreServer::bind("127.0.0.1", 0, &token)?;
    let payload = format!("{} {token}", server.local_addr().port());
    Ok((server, payload))
}
