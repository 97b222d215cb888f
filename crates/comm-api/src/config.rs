use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use comm_core::{Backend, CommError, Launcher, Rank, StoreKind, WorldInfo, WorldSource};

use crate::ProcessGroup;

/// Which backend to use.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// NCCL if compiled in and a GPU is usable, else MPI if launched by an MPI launcher, else
    /// shm if every rank is on this host.
    #[default]
    Auto,
    /// Same-host shared memory (feature `shm`).
    Shm,
    /// MPI through rsmpi (feature `mpi`).
    Mpi,
    /// NCCL through cudarc (feature `nccl`).
    Nccl,
}

impl std::str::FromStr for BackendKind {
    type Err = CommError;
    fn from_str(s: &str) -> Result<Self, CommError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(BackendKind::Auto),
            "shm" => Ok(BackendKind::Shm),
            "mpi" => Ok(BackendKind::Mpi),
            "nccl" => Ok(BackendKind::Nccl),
            other => Err(CommError::Config(format!("unknown backend `{other}` (expected auto, shm, mpi or nccl)"))),
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Auto => "auto",
            BackendKind::Shm => "shm",
            BackendKind::Mpi => "mpi",
            BackendKind::Nccl => "nccl",
        })
    }
}

/// Everything `init` needs: where this process is in the job, which backend, how long to wait.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// This process's place in the job.
    pub world: WorldInfo,
    /// Backend choice.
    pub backend: BackendKind,
    /// Bound on every wait (rendezvous, collectives); default 300 s or `COMM_TIMEOUT`.
    pub timeout: Duration,
}

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

fn env_timeout() -> Result<Duration, CommError> {
    match std::env::var("COMM_TIMEOUT") {
        Err(_) => Ok(DEFAULT_TIMEOUT),
        Ok(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| CommError::Config(format!("COMM_TIMEOUT={v:?} is not a positive number of seconds"))),
    }
}

impl Config {
    /// From the environment: the launcher's variables (see `discovery::from_env`),
    /// `COMM_BACKEND` and `COMM_TIMEOUT`.
    pub fn from_env() -> Result<Config, CommError> {
        let backend = std::env::var("COMM_BACKEND").unwrap_or_default().parse()?;
        Ok(Config { world: discovery::from_env()?, backend, timeout: env_timeout()? })
    }

    /// A world of one process (useful in tests and examples).
    pub fn single() -> Config {
        Config { world: WorldInfo::single(), backend: BackendKind::Auto, timeout: DEFAULT_TIMEOUT }
    }

    /// Explicit values, like FlexLLMGen's
    /// `initialize_distributed(head_ip, port, world_size, rank, local_rank)`. The local world
    /// size is taken to be `world_size` (all ranks on this host); change `world` for more.
    pub fn explicit(master_addr: &str, master_port: u16, world_size: u32, rank: Rank, local_rank: Rank) -> Config {
        Config {
            world: WorldInfo {
                rank,
                world_size,
                local_rank,
                local_world_size: world_size,
                master_addr: master_addr.to_owned(),
                master_port,
                store: StoreKind::Rank0,
                source: WorldSource { launcher: Launcher::Explicit, variables: Vec::new() },
            },
            backend: BackendKind::Auto,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

/// Builds a [`ProcessGroup`] with non-default settings.
///
/// ```
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// use std::time::Duration;
/// use comm_api::{BackendKind, Config};
/// let pg = comm_api::builder(Config::single())
///     .backend(BackendKind::Shm)
///     .timeout(Duration::from_secs(30))
///     .init()
///     .await
///     .unwrap();
/// assert_eq!(pg.backend_name(), "shm");
/// # });
/// ```
#[derive(Clone, Debug)]
pub struct Builder {
    cfg: Config,
}

/// A [`Builder`] starting from `cfg`.
pub fn builder(cfg: Config) -> Builder {
    Builder { cfg }
}

/// Initialises the process's default group, like `deepspeed.init_distributed`.
///
/// Idempotent per process: a second call with the same settings returns the same group; with
/// different settings it is an error. See [`Builder::connect`] for groups that are not the
/// process's default (several in one process, as in tests).
pub async fn init(cfg: Config) -> Result<ProcessGroup, CommError> {
    builder(cfg).init().await
}

type Registered = (Config, ProcessGroup);

fn registry() -> &'static tokio::sync::Mutex<Option<Registered>> {
    static REG: OnceLock<tokio::sync::Mutex<Option<Registered>>> = OnceLock::new();
    REG.get_or_init(|| tokio::sync::Mutex::new(None))
}

impl Builder {
    /// Backend choice.
    pub fn backend(mut self, kind: BackendKind) -> Self {
        self.cfg.backend = kind;
        self
    }

    /// Bound on every wait.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.cfg.timeout = timeout;
        self
    }

    /// Initialises (once per process) and returns the default group.
    pub async fn init(self) -> Result<ProcessGroup, CommError> {
        let mut reg = registry().lock().await;
        if let Some((cfg, pg)) = &*reg {
            if *cfg == self.cfg {
                return Ok(pg.clone());
            }
            return Err(CommError::Config(format!(
                "init was already called in this process with {} (backend {}, timeout {:?}); it cannot be called again with {} (backend {}, timeout {:?})",
                cfg.world, cfg.backend, cfg.timeout, self.cfg.world, self.cfg.backend, self.cfg.timeout
            )));
        }
        let pg = self.clone().connect().await?;
        *reg = Some((self.cfg, pg.clone()));
        Ok(pg)
    }

    /// Rendezvous and backend start-up, without registering the group as the process default.
    pub async fn connect(self) -> Result<ProcessGroup, CommError> {
        let Config { world, backend, timeout } = self.cfg;
        tracing::debug!(world = %world, "comm: discovered world");
        let kind = resolve(backend, &world)?;
        let (store, server) = discovery::rendezvous(&world, timeout).await?;
        let backend: Arc<dyn Backend> = match kind {
            #[cfg(feature = "shm")]
            BackendKind::Shm => {
                let opts = backend_shm::ShmOptions { timeout, ..backend_shm::ShmOptions::from_env()? };
                Arc::new(backend_shm::ShmBackend::new(store.clone(), world.rank, world.world_size, opts).await?)
            }
            other => return Err(not_compiled(other)),
        };
        tracing::debug!(backend = backend.backend_name(), "comm: backend ready");
        Ok(ProcessGroup::new(backend, world, server.map(Arc::new)))
    }
}

fn not_compiled(kind: BackendKind) -> CommError {
    let backend = match kind {
        BackendKind::Shm => "shm",
        BackendKind::Mpi => "mpi",
        BackendKind::Nccl => "nccl",
        BackendKind::Auto => "auto",
    };
    CommError::Unavailable {
        backend,
        why: format!("comm-api was built without the `{backend}` cargo feature; rebuild with `--features {backend}`"),
    }
}

/// Turns `Auto` into a concrete backend, and rejects backends that were not compiled in.
fn resolve(kind: BackendKind, world: &WorldInfo) -> Result<BackendKind, CommError> {
    match kind {
        BackendKind::Auto => {
            if cfg!(feature = "shm") && world.all_local() {
                Ok(BackendKind::Shm)
            } else {
                Err(CommError::Unavailable {
                    backend: "auto",
                    why: format!(
                        "no compiled-in backend fits {world}: shm needs every rank on this host (LOCAL_WORLD_SIZE = WORLD_SIZE){}",
                        if cfg!(feature = "shm") { "" } else { " and the `shm` feature" }
                    ),
                })
            }
        }
        BackendKind::Shm if cfg!(feature = "shm") => Ok(BackendKind::Shm),
        other => Err(not_compiled(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_names_parse() {
        assert_eq!("SHM".parse::<BackendKind>().unwrap(), BackendKind::Shm);
        assert_eq!("".parse::<BackendKind>().unwrap(), BackendKind::Auto);
        let e = "gloo".parse::<BackendKind>().unwrap_err().to_string();
        assert!(e.contains("gloo"), "{e}");
    }

    #[test]
    fn missing_features_are_named() {
        let e = resolve(BackendKind::Mpi, &WorldInfo::single()).unwrap_err().to_string();
        assert!(e.contains("--features mpi"), "{e}");
        let e = resolve(BackendKind::Nccl, &WorldInfo::single()).unwrap_err().to_string();
        assert!(e.contains("`nccl` cargo feature"), "{e}");
        let mut multi = WorldInfo::single();
        multi.world_size = 4;
        multi.local_world_size = 2;
        let e = resolve(BackendKind::Auto, &multi).unwrap_err().to_string();
        assert!(e.contains("every rank on this host"), "{e}");
        assert_eq!(resolve(BackendKind::Auto, &WorldInfo::single()).unwrap(), BackendKind::Shm);
    }

    #[tokio::test]
    async fn init_is_idempotent_and_rejects_other_settings() {
        let a = init(Config::single()).await.unwrap();
        let b = init(Config::single()).await.unwrap();
        assert_eq!(a.world_size(), b.world_size());
        let e = builder(Config::single()).timeout(Duration::from_secs(1)).init().await.unwrap_err().to_string();
        assert!(e.contains("already called"), "{e}");
    }
}
