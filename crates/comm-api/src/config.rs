use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use comm_core::{config, Backend, CommError, Launcher, Rank, StoreKind, WorldInfo, WorldSource};

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
    /// Shared memory within each host, MPI between hosts (feature `mpi`; `backend_hier`).
    Hier,
}

impl std::str::FromStr for BackendKind {
    type Err = CommError;
    fn from_str(s: &str) -> Result<Self, CommError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(BackendKind::Auto),
            "shm" => Ok(BackendKind::Shm),
            "mpi" => Ok(BackendKind::Mpi),
            "nccl" => Ok(BackendKind::Nccl),
            "hier" => Ok(BackendKind::Hier),
            other => {
                Err(CommError::Config(format!("unknown backend `{other}` (expected auto, shm, mpi, nccl or hier)")))
            }
        }
    }
}

impl BackendKind {
    /// The name `COMM_BACKEND` takes.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Auto => "auto",
            BackendKind::Shm => "shm",
            BackendKind::Mpi => "mpi",
            BackendKind::Nccl => "nccl",
            BackendKind::Hier => "hier",
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
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

pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// `COMM_BACKEND` and `COMM_TIMEOUT` from `var`, with their defaults.
fn env_overrides(var: impl Fn(&str) -> Option<String>) -> Result<(BackendKind, Duration), CommError> {
    let backend = var("COMM_BACKEND").unwrap_or_default().parse()?;
    let timeout = match var("COMM_TIMEOUT").filter(|v| !v.trim().is_empty()) {
        None => DEFAULT_TIMEOUT,
        Some(v) => config::parse_timeout(&v).map_err(|why| CommError::Config(format!("COMM_TIMEOUT={v:?}: {why}")))?,
    };
    Ok((backend, timeout))
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

impl Config {
    /// From the environment: the launcher's variables (see `discovery::from_env`),
    /// `COMM_BACKEND` and `COMM_TIMEOUT`.
    pub fn from_env() -> Result<Config, CommError> {
        let (backend, timeout) = env_overrides(env)?;
        Ok(Config { world: discovery::from_env()?, backend, timeout })
    }

    /// A world of one process (useful in tests and examples). Environment variables do not
    /// apply.
    pub fn single() -> Config {
        Config { world: WorldInfo::single(), backend: BackendKind::Auto, timeout: DEFAULT_TIMEOUT }
    }

    /// Explicit values, like FlexLLMGen's
    /// `initialize_distributed(head_ip, port, world_size, rank, local_rank)`. The local world
    /// size is taken to be `world_size` (all ranks on this host); change `world` for more.
    ///
    /// The place in the job comes from the arguments only; `COMM_BACKEND` and `COMM_TIMEOUT`
    /// apply as with [`Config::from_env`] (an invalid value is an error), and
    /// [`Builder::backend`] / [`Builder::timeout`] override them.
    pub fn explicit(
        master_addr: &str,
        master_port: u16,
        world_size: u32,
        rank: Rank,
        local_rank: Rank,
    ) -> Result<Config, CommError> {
        Self::explicit_from(master_addr, master_port, world_size, rank, local_rank, env)
    }

    fn explicit_from(
        master_addr: &str,
        master_port: u16,
        world_size: u32,
        rank: Rank,
        local_rank: Rank,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Config, CommError> {
        if rank >= world_size || local_rank >= world_size {
            return Err(CommError::Config(format!(
                "Config::explicit: rank {rank} / local rank {local_rank} is not in a world of {world_size}"
            )));
        }
        let (backend, timeout) = env_overrides(var)?;
        Ok(Config {
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
            backend,
            timeout,
        })
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
    layers: Layers,
}

/// A [`Builder`] starting from `cfg`.
pub fn builder(cfg: Config) -> Builder {
    Builder { cfg, layers: Layers::default() }
}

/// The layers the builder puts around every backend it starts (sub-groups inherit them).
#[derive(Clone, Debug, Default, PartialEq)]
struct Layers {
    #[cfg(feature = "profiling")]
    profiling: Option<profiling::ProfilingLayer>,
}

impl Layers {
    /// For error messages: `", profiling"` when it is on.
    fn describe(&self) -> &'static str {
        #[cfg(feature = "profiling")]
        if self.profiling.is_some() {
            return ", profiling";
        }
        ""
    }

    fn apply(&self, backend: Arc<dyn Backend>) -> Arc<dyn Backend> {
        #[cfg(feature = "profiling")]
        if let Some(layer) = &self.profiling {
            // Outermost: the span covers everything under it.
            return Arc::new(layer.layer(backend));
        }
        backend
    }
}

/// Initialises the process's default group, like `deepspeed.init_distributed`.
///
/// Idempotent per process: a second call with the same settings returns the same group; with
/// different settings it is an error. See [`Builder::connect`] for groups that are not the
/// process's default (several in one process, as in tests).
pub async fn init(cfg: Config) -> Result<ProcessGroup, CommError> {
    builder(cfg).init().await
}

type Registered = (Config, Layers, ProcessGroup);

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

    /// Bound on every wait (at most [`config::MAX_TIMEOUT`]: longer is taken as that).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.cfg.timeout = timeout;
        self
    }

    /// Opens a `tracing` span per op (`comm.<op>`, see [`profiling::Profiling`]) on this
    /// group and every group made from it; a `tracing` subscriber such as the `otel` layer
    /// decides what happens to them (nothing measurable while none wants them). With
    /// [`ProfilingLayer::with_logger`](profiling::ProfilingLayer::with_logger) every op is
    /// also recorded into a [`profiling::CommsLogger`] directly: DeepSpeed's comms summary for
    /// a few ns per op, no subscriber needed.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// use comm_api::profiling::{CommsConfig, CommsLogger, ProfilingLayer};
    /// use comm_api::{Config, HostBuffer, ReduceOp};
    ///
    /// let logger = CommsLogger::new(CommsConfig::default());
    /// let layer = ProfilingLayer::new().with_logger(logger.clone());
    /// let pg = comm_api::builder(Config::single()).profiling(layer).connect().await.unwrap();
    /// pg.all_reduce(HostBuffer::from_slice(&[1.0f32; 256]), ReduceOp::Sum).await.unwrap();
    /// let summary = logger.log_summary(); // prints the table
    /// assert_eq!((summary.rows[0].op.as_str(), summary.rows[0].bytes), ("all_reduce", 1024));
    /// # pg.shutdown().await.unwrap();
    /// # });
    /// ```
    #[cfg(feature = "profiling")]
    #[cfg_attr(docsrs, doc(cfg(feature = "profiling")))]
    pub fn profiling(mut self, layer: profiling::ProfilingLayer) -> Self {
        self.layers.profiling = Some(layer);
        self
    }

    /// Initialises (once per process) and returns the default group.
    pub async fn init(self) -> Result<ProcessGroup, CommError> {
        let mut reg = registry().lock().await;
        if let Some((cfg, layers, pg)) = &*reg {
            if *cfg == self.cfg && *layers == self.layers {
                return Ok(pg.clone());
            }
            return Err(CommError::Config(format!(
                "init was already called in this process with {} (backend {}, timeout {:?}{}); it cannot be called again with {} (backend {}, timeout {:?}{})",
                cfg.world, cfg.backend, cfg.timeout, layers.describe(), self.cfg.world, self.cfg.backend, self.cfg.timeout, self.layers.describe()
            )));
        }
        let pg = self.clone().connect().await?;
        *reg = Some((self.cfg, self.layers, pg.clone()));
        Ok(pg)
    }

    /// For a process that replaces a lost rank: joins the running group whose members admit
    /// it with [`ProcessGroup::grow`], instead of starting a new one; its rank is the one they
    /// give it. Needs a store that outlived the lost rank (`commrun` serves one; or torchrun's
    /// agent store, or `COMM_STORE=external`) and the shm backend. Like [`connect`](Self::connect),
    /// it does not register the group as the process default.
    pub async fn join(self) -> Result<ProcessGroup, CommError> {
        let world = &self.cfg.world;
        if world.store == StoreKind::Rank0 && world.world_size > 1 {
            return Err(CommError::Config(
                "join needs a store that outlives any rank, and rank 0 serves this one: launch with commrun \
                 (it serves the store), torchrun (its agent store), or set COMM_STORE=external"
                    .into(),
            ));
        }
        match resolve(self.cfg.backend, world, Available::compiled())?.0 {
            #[cfg(feature = "shm")]
            BackendKind::Shm => {
                let timeout = config::clamp_timeout(self.cfg.timeout);
                let (store, _) = discovery::rendezvous(world, timeout).await?;
                let opts = backend_shm::ShmOptions { timeout, ..backend_shm::ShmOptions::from_env()? };
                let b: Arc<dyn Backend> = Arc::new(backend_shm::ShmBackend::join(store, opts).await?);
                let why = format!("joined a running group as rank {} of {}", b.rank(), b.world_size());
                let Builder { cfg, layers } = self;
                Ok(ProcessGroup::new(layers.apply(b), cfg.world, None, why, timeout))
            }
            other => Err(CommError::Unsupported { op: "join", dtype: None, backend: other.name() }),
        }
    }

    /// Rendezvous and backend start-up, without registering the group as the process default.
    pub async fn connect(self) -> Result<ProcessGroup, CommError> {
        let Builder { cfg: Config { world, backend, timeout }, layers } = self;
        let timeout = config::clamp_timeout(timeout);
        tracing::debug!(world = %world, "comm: discovered world");
        let (kind, why) = resolve(backend, &world, Available::compiled())?;
        tracing::debug!(backend = %kind, why = %why, "comm: backend chosen");
        #[cfg(feature = "mpi")]
        if matches!(kind, BackendKind::Mpi | BackendKind::Hier) {
            // MPI brings its own rendezvous (the launcher); rank and size come from MPI itself
            // and must agree with what the environment said.
            let opts = backend_mpi::MpiOptions { timeout, ..backend_mpi::MpiOptions::from_env()? };
            let b = backend_mpi::MpiBackend::init(opts).await.map_err(|e| startup_context(e, &world))?;
            let world = b.reconcile(&world)?;
            let b: Arc<dyn Backend> = Arc::new(b);
            // Auto looks at the hosts MPI started ranks on: several, with more than one rank on
            // some host, make it hier.
            let hier = match (kind, backend) {
                (BackendKind::Hier, _) => Some(true),
                (_, BackendKind::Auto) => Some(false),
                _ => None,
            };
            let (b, server, why) = match hier {
                None => (b, None, why),
                Some(asked) => {
                    match crate::hier::start(b, asked, timeout).await.map_err(|e| startup_context(e, &world))? {
                        crate::hier::Started::Hier { backend, server, describe } => {
                            let why = match asked {
                                true => format!("asked for; {describe}"),
                                false => format!("auto: launched by {:?} on {describe}", world.source.launcher),
                            };
                            (backend, server, why)
                        }
                        crate::hier::Started::Flat(b) => (b, None, why),
                    }
                }
            };
            tracing::debug!(backend = b.backend_name(), "comm: backend ready");
            return Ok(ProcessGroup::new(layers.apply(b), world, server.map(Arc::new), why, timeout));
        }
        let (store, server) = discovery::rendezvous(&world, timeout).await?;
        let started: Result<Arc<dyn Backend>, CommError> = match kind {
            #[cfg(feature = "shm")]
            BackendKind::Shm => {
                async {
                    let opts = backend_shm::ShmOptions { timeout, ..backend_shm::ShmOptions::from_env()? };
                    let b = backend_shm::ShmBackend::new(store.clone(), world.rank, world.world_size, opts).await?;
                    Ok(Arc::new(b) as Arc<dyn Backend>)
                }
                .await
            }
            #[cfg(any(feature = "nccl", feature = "nccl-unpinned"))]
            BackendKind::Nccl => {
                async {
                    let o = backend_nccl::NcclOptions::from_env()?;
                    // One GPU per local rank unless COMM_NCCL_DEVICE says otherwise.
                    let device = o.device.or(Some(world.local_rank as usize));
                    let opts = backend_nccl::NcclOptions { timeout, device, ..o };
                    let b = backend_nccl::NcclBackend::new(store.clone(), world.rank, world.world_size, opts).await?;
                    Ok(Arc::new(b) as Arc<dyn Backend>)
                }
                .await
            }
            other => Err(not_compiled(other)),
        };
        let backend = match started {
            Ok(b) => b,
            Err(e) => {
                // Rank 0 serves the store: keep it a moment, so the peers read why this rank
                // gave up (the backend's rendezvous leaves a reason there) instead of only
                // seeing the store vanish. Nothing waits for it; process exit ends it too.
                if let Some(server) = server {
                    std::thread::spawn(move || {
                        std::thread::sleep(Duration::from_secs(3));
                        drop(server);
                    });
                }
                return Err(startup_context(e, &world));
            }
        };
        tracing::debug!(backend = backend.backend_name(), "comm: backend ready");
        Ok(ProcessGroup::new(layers.apply(backend), world, server.map(Arc::new), why, timeout))
    }
}

/// A backend that timed out while starting usually waited for ranks that were never started:
/// say which launcher described the job, so the user can check it.
fn startup_context(e: CommError, world: &WorldInfo) -> CommError {
    match e {
        CommError::Timeout { op, after, detail } => CommError::timeout(
            op,
            after,
            format!(
                "{detail}; this process is {world}: were all {} ranks started, with the same variables?",
                world.world_size
            ),
        ),
        other => other,
    }
}

fn not_compiled(kind: BackendKind) -> CommError {
    let backend = match kind {
        BackendKind::Shm => "shm",
        // hier is the mpi feature's (with shm).
        BackendKind::Mpi | BackendKind::Hier => "mpi",
        BackendKind::Nccl => "nccl",
        BackendKind::Auto => "auto",
    };
    CommError::Unavailable {
        backend,
        why: format!("comm-api was built without the `{backend}` cargo feature; rebuild with `--features {backend}`"),
    }
}

/// Which backends this build has, and what the machine offers them.
#[derive(Clone, Copy, Debug, Default)]
struct Available {
    shm: bool,
    mpi: bool,
    nccl: bool,
    /// A usable GPU (only asked when `nccl` is compiled in).
    gpu: bool,
}

impl Available {
    fn compiled() -> Available {
        let nccl = cfg!(any(feature = "nccl", feature = "nccl-unpinned"));
        // The probe never panics; it loads libcuda/libnccl only when they are there.
        let gpu = nccl && nccl_unavailable().is_none();
        Available { shm: cfg!(feature = "shm"), mpi: cfg!(feature = "mpi"), nccl, gpu }
    }
}

/// Whether this host has a GPU for each of its ranks (NCCL needs one per rank); always true
/// without the `nccl` feature (the unit tests of `resolve` describe machines by `Available`).
fn nccl_fits(world: &WorldInfo) -> bool {
    #[cfg(any(feature = "nccl", feature = "nccl-unpinned"))]
    if let Ok(info) = backend_nccl::is_available() {
        return info.devices >= world.local_world_size.max(1) as usize;
    }
    let _ = world;
    true
}

/// Why the NCCL backend cannot run here, as [`CommError::Unavailable`] (`None`: it can, or it
/// is not compiled in).
fn nccl_unavailable() -> Option<CommError> {
    #[cfg(any(feature = "nccl", feature = "nccl-unpinned"))]
    return backend_nccl::is_available().err();
    #[cfg(not(any(feature = "nccl", feature = "nccl-unpinned")))]
    None
}

/// Whether an MPI launcher started this process (Auto then prefers the MPI backend).
fn mpi_launched(world: &WorldInfo) -> bool {
    matches!(
        world.source.launcher,
        Launcher::OpenMpi | Launcher::Mpich | Launcher::Pmix | Launcher::AzureMl | Launcher::SageMaker
    )
}

/// Turns `Auto` into a concrete backend (DESIGN §4: NCCL if compiled in and a GPU is usable,
/// else MPI if an MPI launcher started us, else shm if every rank is on this host), and
/// rejects backends that were not compiled in. Returns the backend and why it was chosen.
fn resolve(kind: BackendKind, world: &WorldInfo, have: Available) -> Result<(BackendKind, String), CommError> {
    let hosts = if world.all_local() {
        "every rank is on this host".to_owned()
    } else {
        format!(
            "ranks are on several hosts (local world size {} < world size {})",
            world.local_world_size, world.world_size
        )
    };
    match kind {
        BackendKind::Auto => {
            if have.nccl && have.gpu && nccl_fits(world) {
                return Ok((BackendKind::Nccl, "auto: NCCL is compiled in and a GPU is usable".into()));
            }
            let launcher = world.source.launcher;
            if mpi_launched(world) && have.mpi {
                return Ok((BackendKind::Mpi, format!("auto: launched by {launcher:?}")));
            }
            if have.shm && world.all_local() {
                let why = if mpi_launched(world) {
                    // Said once at startup: the user may have expected MPI.
                    tracing::info!(
                        "comm: launched by {launcher:?} but built without the `mpi` feature; using shm since every \
                         rank is on this host"
                    );
                    format!("auto: {hosts} (launched by {launcher:?}, but the `mpi` feature is not compiled in)")
                } else {
                    format!("auto: {hosts}")
                };
                return Ok((BackendKind::Shm, why));
            }
            let mut no = Vec::new();
            no.push(if have.nccl {
                match nccl_unavailable() {
                    Some(CommError::Unavailable { why, .. }) => format!("nccl: no usable GPU: {why}"),
                    _ => "nccl: no usable GPU".to_owned(),
                }
            } else {
                "nccl: not compiled in (feature `nccl`)".into()
            });
            // Had MPI fit (compiled in, MPI launch), it would have been chosen above.
            no.push(if have.mpi {
                format!("mpi: not launched by an MPI launcher ({launcher:?})")
            } else {
                "mpi: not compiled in (feature `mpi`)".to_owned()
            });
            // Likewise shm, had every rank been on this host.
            no.push(if have.shm {
                format!(
                    "shm: {hosts}; if they really are all on this host, set COMM_BACKEND=shm (it checks that \
                     the ranks share a host) or start them as one node (torchrun --nnodes 1 --nproc-per-node \
                     {}: torchrun sets LOCAL_WORLD_SIZE itself); across hosts, start the ranks with mpirun or srun \
                     and build with the `mpi` feature (the mpi and hier backends)",
                    world.world_size
                )
            } else {
                "shm: not compiled in (feature `shm`)".to_owned()
            });
            Err(CommError::Unavailable {
                backend: "auto",
                why: format!("no compiled-in backend fits rank {}/{}: {}", world.rank, world.world_size, no.join("; ")),
            })
        }
        BackendKind::Shm if have.shm => {
            if !world.all_local() {
                tracing::debug!("comm: shm asked for although {hosts}; shm checks the hosts itself");
            }
            Ok((BackendKind::Shm, format!("asked for; {hosts}")))
        }
        BackendKind::Mpi if have.mpi => Ok((BackendKind::Mpi, "asked for".into())),
        BackendKind::Hier if have.mpi && have.shm => Ok((BackendKind::Hier, "asked for".into())),
        BackendKind::Nccl if have.nccl && have.gpu => Ok((BackendKind::Nccl, "asked for".into())),
        // Compiled in, but this machine lacks the driver, NCCL or a GPU: say which.
        BackendKind::Nccl if have.nccl => Err(nccl_unavailable()
            .unwrap_or_else(|| CommError::Unavailable { backend: "nccl", why: "no usable GPU".into() })),
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
    fn explicit_configs_honour_comm_timeout_and_backend() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
        };
        let c = Config::explicit_from("10.0.0.1", 29511, 4, 3, 1, vars(&[])).unwrap();
        assert_eq!(
            (c.backend, c.timeout, c.world.rank, c.world.master_port),
            (BackendKind::Auto, DEFAULT_TIMEOUT, 3, 29511)
        );
        let c =
            Config::explicit_from("h", 1, 2, 0, 0, vars(&[("COMM_TIMEOUT", "15"), ("COMM_BACKEND", "shm")])).unwrap();
        assert_eq!((c.backend, c.timeout), (BackendKind::Shm, Duration::from_secs(15)));
        // Huge values are clamped (they overflowed Duration / Instant and panicked).
        for huge in ["1e19", "1e20", "1e300"] {
            let c = Config::explicit_from("h", 1, 2, 0, 0, move |n: &str| (n == "COMM_TIMEOUT").then(|| huge.into()));
            assert_eq!(c.unwrap().timeout, config::MAX_TIMEOUT, "{huge}");
        }
        let e = Config::explicit_from("h", 1, 2, 0, 0, vars(&[("COMM_TIMEOUT", "-1")])).unwrap_err().to_string();
        assert!(e.contains("COMM_TIMEOUT") && e.contains("positive"), "{e}");
        let e = Config::explicit_from("h", 1, 2, 0, 0, vars(&[("COMM_BACKEND", "gloo")])).unwrap_err().to_string();
        assert!(e.contains("gloo"), "{e}");
        let e = Config::explicit_from("h", 1, 2, 2, 0, vars(&[])).unwrap_err().to_string();
        assert!(e.contains("rank 2"), "{e}");
    }

    const SHM_ONLY: Available = Available { shm: true, mpi: false, nccl: false, gpu: false };

    fn world(launcher: Launcher, world_size: u32, local_world_size: u32) -> WorldInfo {
        let mut w = WorldInfo::single();
        w.world_size = world_size;
        w.local_world_size = local_world_size;
        w.source.launcher = launcher;
        w
    }

    #[test]
    fn missing_features_are_named() {
        let e = resolve(BackendKind::Mpi, &WorldInfo::single(), SHM_ONLY).unwrap_err().to_string();
        assert!(e.contains("--features mpi"), "{e}");
        let e = resolve(BackendKind::Nccl, &WorldInfo::single(), SHM_ONLY).unwrap_err().to_string();
        assert!(e.contains("`nccl` cargo feature"), "{e}");
        let e = resolve(BackendKind::Shm, &WorldInfo::single(), Available::default()).unwrap_err().to_string();
        assert!(e.contains("--features shm"), "{e}");
        assert_eq!(resolve(BackendKind::Auto, &WorldInfo::single(), SHM_ONLY).unwrap().0, BackendKind::Shm);
    }

    #[test]
    fn auto_follows_the_design_order() {
        let all = Available { shm: true, mpi: true, nccl: true, gpu: true };
        let local = world(Launcher::Torchrun, 4, 4);
        let ompi = world(Launcher::OpenMpi, 4, 2);
        // NCCL first when it has a GPU.
        assert_eq!(resolve(BackendKind::Auto, &local, all).unwrap().0, BackendKind::Nccl);
        let no_gpu = Available { gpu: false, ..all };
        // Then MPI, when an MPI launcher started us (AzureML and SageMaker are Open MPI jobs).
        assert_eq!(resolve(BackendKind::Auto, &ompi, no_gpu).unwrap().0, BackendKind::Mpi);
        assert_eq!(resolve(BackendKind::Auto, &world(Launcher::AzureMl, 4, 2), no_gpu).unwrap().0, BackendKind::Mpi);
        // Not for torchrun or Slurm: shm when every rank is here.
        assert_eq!(resolve(BackendKind::Auto, &local, no_gpu).unwrap().0, BackendKind::Shm);
        assert_eq!(resolve(BackendKind::Auto, &world(Launcher::Slurm, 4, 4), no_gpu).unwrap().0, BackendKind::Shm);
        // An MPI launch without the mpi feature falls back to shm on one host, and says why.
        let (kind, why) = resolve(BackendKind::Auto, &world(Launcher::Mpich, 2, 2), SHM_ONLY).unwrap();
        assert_eq!(kind, BackendKind::Shm);
        assert!(why.contains("Mpich") && why.contains("`mpi` feature"), "{why}");
        // Across hosts with shm only: every candidate and why not.
        let e = resolve(BackendKind::Auto, &ompi, SHM_ONLY).unwrap_err().to_string();
        assert!(e.contains("nccl: not compiled in") && e.contains("mpi: not compiled in"), "{e}");
        // torchrun overwrites LOCAL_WORLD_SIZE: the advice is one it cannot undo.
        assert!(!e.contains("set LOCAL_WORLD_SIZE") && e.contains("--nnodes 1 --nproc-per-node 4"), "{e}");
        assert!(e.contains("start the ranks with mpirun or srun") && !e.contains("use the mpi backend"), "{e}");
        assert!(e.contains("local world size 2 < world size 4") && e.contains("COMM_BACKEND=shm"), "{e}");
        let e = resolve(BackendKind::Auto, &world(Launcher::Torchrun, 4, 2), no_gpu).unwrap_err().to_string();
        assert!(e.contains("nccl: no usable GPU") && e.contains("not launched by an MPI launcher"), "{e}");
        // Asking for shm across hosts is allowed: shm checks the hosts itself.
        let (kind, why) = resolve(BackendKind::Shm, &ompi, SHM_ONLY).unwrap();
        assert!(kind == BackendKind::Shm && why.contains("several hosts"), "{why}");
    }

    /// With the `nccl` feature on a machine without GPU/NCCL (CI), asking for NCCL names what is
    /// missing, and `Auto` goes on to the other backends; with a GPU, NCCL is chosen.
    #[cfg(any(feature = "nccl", feature = "nccl-unpinned"))]
    #[tokio::test]
    async fn nccl_is_chosen_only_where_it_can_run() {
        let have = Available::compiled();
        assert!(have.nccl);
        let explicit = resolve(BackendKind::Nccl, &WorldInfo::single(), have);
        let auto = resolve(BackendKind::Auto, &WorldInfo::single(), have).unwrap().0;
        match backend_nccl::is_available() {
            Ok(info) => {
                assert!(have.gpu, "{info:?}");
                assert_eq!(explicit.unwrap().0, BackendKind::Nccl);
                assert_eq!(auto, BackendKind::Nccl);
            }
            Err(probe) => {
                assert!(!have.gpu);
                let e = explicit.unwrap_err();
                let CommError::Unavailable { backend: "nccl", why } = &e else { panic!("{e:?}") };
                assert_eq!(e.to_string(), probe.to_string());
                assert!(why.contains("libcuda") || why.contains("libnccl") || why.contains("device"), "{why}");
                assert_eq!(auto, BackendKind::Shm);
                // The whole start-up path: an explicit NCCL request fails before any rendezvous.
                let e = builder(Config::single()).backend(BackendKind::Nccl).connect().await.unwrap_err();
                assert!(matches!(&e, CommError::Unavailable { backend: "nccl", .. }), "{e:?}");
                let mut multi = world(Launcher::Torchrun, 4, 2);
                multi.rank = 1;
                let e = resolve(BackendKind::Auto, &multi, have).unwrap_err().to_string();
                assert!(e.contains("nccl: no usable GPU: ") && e.contains(why.as_str()), "{e}");
            }
        }
    }

    #[tokio::test]
    async fn init_is_idempotent_and_rejects_other_settings() {
        let a = init(Config::single()).await.unwrap();
        let b = init(Config::single()).await.unwrap();
        assert_eq!(a.world_size(), b.world_size());
        let e = builder(Config::single()).timeout(Duration::from_secs(1)).init().await.unwrap_err().to_string();
        assert!(e.contains("already called"), "{e}");
        let d = a.describe();
        assert!(d.contains("rank 0/1") && d.contains("found from Single") && d.contains("in-process"), "{d}");
        assert!(d.contains("backend: shm (auto: every rank is on this host)"), "{d}");
    }
}
