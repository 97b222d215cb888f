//! [`WorldInfo`] from the variables a launcher sets.

use std::collections::HashMap;

use comm_core::{CommError, Launcher, StoreKind, WorldInfo, WorldSource};

use crate::slurm::{self, TasksPerNode};

/// The address rank 0's store listens on when nothing says otherwise (torch's default).
const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";
/// The port of rank 0's store when `MASTER_PORT` is unset (torch's default).
const DEFAULT_MASTER_PORT: u16 = 29500;
/// AzureML ports, as DeepSpeed's `patch_aml_env_for_torch_nccl_backend` picks them.
const AML_MULTI_NODE_PORT: u16 = 6105;
const AML_SINGLE_NODE_PORT: u16 = 54965;

/// One launcher's reader: `None` when its variables are absent, so the next one is tried.
type Reader = fn(&Vars) -> Option<Result<WorldInfo, CommError>>;

/// The launchers, in precedence order: the first whose variables are present wins.
///
/// torchrun comes first because `commrun` and the DeepSpeed launcher set its variables, and
/// because it is often run *inside* an `mpirun` or `srun` allocation, whose variables then
/// describe the allocation rather than the ranks. AzureML and SageMaker come before Open MPI
/// because they *are* Open MPI jobs (same `OMPI_COMM_WORLD_*` variables) that DeepSpeed
/// recognises by a marker variable and reads differently.
const READERS: &[Reader] = &[torchrun, azureml, sagemaker, open_mpi, mpich, pmix, slurm];

/// Rank variables of the launchers after torchrun: with one of them present, a lone
/// `WORLD_SIZE` is not a half-set torchrun environment.
const OTHER_RANK_VARS: &[&str] = &["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"];

/// This process's [`WorldInfo`], read from the process environment.
///
/// See [`from_vars`] for the rules. Variables whose names or values are not valid UTF-8 are
/// read lossily (so a garbled `RANK` is reported, not ignored).
pub fn from_env() -> Result<WorldInfo, CommError> {
    from_vars(std::env::vars_os().map(|(k, v)| (k.to_string_lossy().into_owned(), v.to_string_lossy().into_owned())))
}

/// A [`WorldInfo`] from `(name, value)` pairs, as a launcher would set them (later pairs win).
///
/// Launchers are tried in precedence order; the first whose variables are present wins and is
/// recorded in [`WorldInfo::source`] with the `NAME=value` pairs that were read:
///
/// 1. torchrun / `commrun` ([`Launcher::Torchrun`]) and the DeepSpeed launcher
///    ([`Launcher::DeepSpeed`], recognised by `LOCAL_SIZE`): `RANK`, `WORLD_SIZE`,
///    `LOCAL_RANK`, `LOCAL_WORLD_SIZE` (or DeepSpeed's `LOCAL_SIZE`), `GROUP_RANK`,
///    `MASTER_ADDR`, `MASTER_PORT`. `TORCHELASTIC_USE_AGENT_STORE=True` (torchrun's agent
///    already serves a torch `TCPStore` on `MASTER_PORT`) gives [`StoreKind::Torch`].
/// 2. AzureML ([`Launcher::AzureMl`], `AZUREML_EXPERIMENT_ID` set, not under DLTS) and
///    SageMaker ([`Launcher::SageMaker`], `SM_TRAINING_ENV` set): the Open MPI variables,
///    with the store address DeepSpeed uses (`AZ_BATCH_MASTER_NODE` / port 6105 across
///    nodes, `AZ_BATCHAI_MPI_MASTER_NODE` / port 54965 on one node; SageMaker's `MASTER_*`).
/// 3. Open MPI ([`Launcher::OpenMpi`]): `OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK`,
///    `_LOCAL_SIZE`.
/// 4. MPICH / Hydra / Intel MPI ([`Launcher::Mpich`]): `PMI_RANK`, `PMI_SIZE`,
///    `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`.
/// 5. PMIx ([`Launcher::Pmix`]): `PMIX_RANK`, with the size from `WORLD_SIZE` or Slurm.
/// 6. Slurm's `srun` ([`Launcher::Slurm`]): `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS` /
///    `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NODEID` with `SLURM_STEP_TASKS_PER_NODE` /
///    `SLURM_TASKS_PER_NODE` / `SLURM_NTASKS_PER_NODE` (`2(x3),1`), and the node list.
///
/// The store address: `MASTER_ADDR` / `MASTER_PORT` when set (every launcher); otherwise
/// `127.0.0.1` when every rank is on this host, the first host of the step's node list under
/// Slurm, and an error naming what to set for a multi-host MPI job (its launchers do not say
/// where rank 0 runs). The port defaults to 29500. `COMM_STORE` (`rank0`, `external`,
/// `torch`) overrides who serves the store.
///
/// Missing local information is filled in: with neither local rank nor local size, every
/// rank is assumed to be on this host; with only the local size, ranks are assumed to be
/// placed in blocks per host (`local_rank = rank % local_size`); with only the local rank,
/// the local size is taken to be the world size.
///
/// With no launcher's variables present the result is [`WorldInfo::single`]. Contradictions
/// and unparsable values are [`CommError::Config`] errors that name the variables and their
/// values: a rank without a world size, `RANK >= WORLD_SIZE`, `WORLD_SIZE=0`,
/// `LOCAL_RANK >= LOCAL_WORLD_SIZE`, a port of 0 or above 65535, a bad Slurm node list, and
/// two launchers that describe the same number of processes but give this one different ranks
/// (typically `RANK` exported to every rank of an `mpirun`). Launchers describing a different
/// number of processes are not compared: that is torchrun inside an `srun` or `mpirun`
/// allocation. Nor is torchrun's elastic agent (`TORCHELASTIC_RUN_ID` set), which numbers
/// ranks in its own order.
pub fn from_vars<I, K, V>(vars: I) -> Result<WorldInfo, CommError>
where
    I: IntoIterator<Item = (K, V)>,
    K: AsRef<str>,
    V: AsRef<str>,
{
    let vars = Vars(vars.into_iter().map(|(k, v)| (k.as_ref().to_owned(), v.as_ref().to_owned())).collect());
    let mut found: Option<WorldInfo> = None;
    let mut others = Vec::new();
    for read in READERS {
        match (read(&vars), &found) {
            (None, _) => {}
            (Some(r), None) => found = Some(r?),
            // A lower-precedence launcher's values only serve the agreement check; ones that
            // do not parse are ignored (the winner's variables describe the ranks).
            (Some(r), Some(_)) => others.extend(r.ok()),
        }
    }
    let Some(mut world) = found else { return Ok(WorldInfo::single()) };
    check_agreement(&world, &others, &vars)?;
    if let Some(v) = vars.0.get("COMM_STORE") {
        world.store = match v.trim().to_ascii_lowercase().as_str() {
            "rank0" | "" => StoreKind::Rank0,
            "external" => StoreKind::External,
            "torch" => StoreKind::Torch,
            _ => {
                return Err(CommError::Config(format!(
                    "COMM_STORE={v:?} is not a store kind (expected rank0, external or torch)"
                )))
            }
        };
        world.source.variables.push(format!("COMM_STORE={v}"));
    }
    Ok(world)
}

/// Two launchers that describe jobs of the same size must give this process the same rank.
fn check_agreement(world: &WorldInfo, others: &[WorldInfo], vars: &Vars) -> Result<(), CommError> {
    if world.source.launcher == Launcher::Torchrun && vars.has("TORCHELASTIC_RUN_ID") {
        return Ok(());
    }
    for o in others.iter().filter(|o| o.world_size == world.world_size) {
        let what = if o.rank != world.rank {
            format!("rank {} and rank {}", world.rank, o.rank)
        } else if o.local_world_size == world.local_world_size && o.local_rank != world.local_rank {
            format!("local rank {} and local rank {}", world.local_rank, o.local_rank)
        } else {
            continue;
        };
        return Err(CommError::Config(format!(
            "two launchers disagree about this process in a job of {} processes: {:?} [{}] and {:?} [{}] give {what}; \
             a variable was probably inherited or exported to every process (e.g. `mpirun -x RANK`): unset the stale \
             one",
            world.world_size,
            world.source.launcher,
            world.source.variables.join(" "),
            o.source.launcher,
            o.source.variables.join(" "),
        )));
    }
    Ok(())
}

/// The variables, by name.
struct Vars(HashMap<String, String>);

impl Vars {
    fn has(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }

    fn has_any(&self, names: &[&str]) -> bool {
        names.iter().any(|n| self.has(n))
    }
}

/// Reads variables and records each one read as `NAME=value`, for [`WorldSource::variables`].
struct Recorder<'a> {
    vars: &'a Vars,
    read: Vec<String>,
}

impl<'a> Recorder<'a> {
    fn new(vars: &'a Vars) -> Self {
        Recorder { vars, read: Vec::new() }
    }

    fn get(&mut self, name: &str) -> Option<&'a str> {
        let v = self.vars.0.get(name)?;
        self.read.push(format!("{name}={v}"));
        Some(v.as_str())
    }

    /// The first of `names` that is set, with its name.
    fn first(&mut self, names: &[&'static str]) -> Option<(&'static str, &'a str)> {
        names.iter().find_map(|&n| self.get(n).map(|v| (n, v)))
    }

    /// A non-negative integer variable; `what` says what the number is, for the error.
    fn uint(&mut self, name: &str, what: &str) -> Result<Option<u32>, CommError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => parse_uint(name, v, what).map(Some),
        }
    }

    /// `MASTER_ADDR`, when set (an empty one is an error).
    fn master_addr(&mut self) -> Result<Option<String>, CommError> {
        match self.get("MASTER_ADDR").map(str::trim) {
            None => Ok(None),
            Some("") => Err(CommError::Config(
                "MASTER_ADDR is set but empty; set it to rank 0's host name or IP address".into(),
            )),
            Some(a) => Ok(Some(a.to_owned())),
        }
    }

    /// A TCP port variable, when set.
    fn port(&mut self, name: &str) -> Result<Option<u16>, CommError> {
        self.get(name).map(|p| parse_port(name, p)).transpose()
    }

    fn source(self, launcher: Launcher) -> WorldSource {
        WorldSource { launcher, variables: self.read }
    }
}

fn parse_uint(name: &str, v: &str, what: &str) -> Result<u32, CommError> {
    v.trim()
        .parse::<u32>()
        .map_err(|_| CommError::Config(format!("{name}={v:?} is not a valid {what} (expected a non-negative integer)")))
}

fn parse_port(name: &str, p: &str) -> Result<u16, CommError> {
    match p.trim().parse::<u64>() {
        Ok(n @ 1..=65535) => Ok(n as u16),
        Ok(n) => Err(CommError::Config(format!("{name}={n} is not a usable TCP port (1..=65535)"))),
        Err(_) => {
            Err(CommError::Config(format!("{name}={p:?} is not a valid TCP port (expected an integer in 1..=65535)")))
        }
    }
}

/// The checked place of this process: the values, with the names they came from for errors.
struct Place<'n> {
    rank: (u32, &'n str),
    world_size: (u32, &'n str),
    local_rank: Option<(u32, &'n str)>,
    local_world_size: Option<(u32, &'n str)>,
}

impl Place<'_> {
    /// Checks the ranges and fills in missing local values (see [`from_vars`]).
    fn resolve(self) -> Result<(u32, u32, u32, u32), CommError> {
        let ((rank, rank_name), (ws, ws_name)) = (self.rank, self.world_size);
        if ws == 0 {
            return Err(CommError::Config(format!("{ws_name}=0: a job has at least one process")));
        }
        if rank >= ws {
            return Err(CommError::Config(format!(
                "{rank_name}={rank} is out of range for {ws_name}={ws} (ranks are 0..={})",
                ws - 1
            )));
        }
        let (local_rank, local_world_size) = match (self.local_rank, self.local_world_size) {
            (None, None) => (rank, ws),
            (lr, Some((lws, lws_name))) => {
                if lws == 0 {
                    return Err(CommError::Config(format!("{lws_name}=0: a host runs at least one process")));
                }
                if lws > ws {
                    return Err(CommError::Config(format!(
                        "{lws_name}={lws} exceeds {ws_name}={ws} (more processes on this host than in the job)"
                    )));
                }
                let (lr, lr_name) = lr.unwrap_or((rank % lws, "the local rank"));
                if lr >= lws {
                    return Err(CommError::Config(format!(
                        "{lr_name}={lr} is out of range for {lws_name}={lws} (local ranks are 0..={})",
                        lws - 1
                    )));
                }
                (lr, lws)
            }
            (Some((lr, lr_name)), None) => {
                if lr >= ws {
                    return Err(CommError::Config(format!(
                        "{lr_name}={lr} is out of range: the local world size is unset, so it is taken as \
                         {ws_name}={ws}"
                    )));
                }
                (lr, ws)
            }
        };
        Ok((rank, ws, local_rank, local_world_size))
    }
}

/// A value with the name of the variable it came from.
type Named<'n> = (u32, &'n str);

/// Rank and size variables must come together.
fn both<'n>(
    rank: (Option<u32>, &'n str),
    size: (Option<u32>, &'n str),
    hint: &str,
) -> Result<(Named<'n>, Named<'n>), CommError> {
    match (rank, size) {
        ((Some(r), rn), (Some(s), sn)) => Ok(((r, rn), (s, sn))),
        ((Some(r), rn), (None, sn)) => Err(CommError::Config(format!("{rn}={r} is set but {sn} is not; {hint}"))),
        ((None, rn), (Some(s), sn)) => Err(CommError::Config(format!("{sn}={s} is set but {rn} is not; {hint}"))),
        ((None, rn), (None, sn)) => Err(CommError::Config(format!("neither {rn} nor {sn} is set; {hint}"))),
    }
}

/// The store address of a launcher that does not say where rank 0 runs: `MASTER_ADDR`, or
/// this host when every rank is here.
fn mpi_master_addr(
    r: &mut Recorder<'_>,
    launcher: &str,
    ws: (u32, &str),
    lws: u32,
    lws_name: &str,
) -> Result<String, CommError> {
    match r.master_addr()? {
        Some(a) => Ok(a),
        None if lws == ws.0 => Ok(DEFAULT_MASTER_ADDR.to_owned()),
        None => Err(CommError::Config(format!(
            "launched by {launcher} across hosts ({lws_name}={lws} < {}={}), and nothing says where rank 0 runs: \
             export MASTER_ADDR=<rank 0's host> to every rank (e.g. `mpirun -x MASTER_ADDR=host0`), or pass the \
             address explicitly (Config::explicit)",
            ws.1, ws.0
        ))),
    }
}

fn world(
    r: Recorder<'_>,
    launcher: Launcher,
    place: (u32, u32, u32, u32),
    master_addr: String,
    master_port: u16,
    store: StoreKind,
) -> WorldInfo {
    let (rank, world_size, local_rank, local_world_size) = place;
    WorldInfo {
        rank,
        world_size,
        local_rank,
        local_world_size,
        master_addr,
        master_port,
        store,
        source: r.source(launcher),
    }
}

/// torchrun, `commrun` and the DeepSpeed launcher.
fn torchrun(vars: &Vars) -> Option<Result<WorldInfo, CommError>> {
    if !vars.has("RANK") && !vars.has("WORLD_SIZE") {
        return None;
    }
    // A lone WORLD_SIZE next to another launcher's rank: that launcher's (PMIx reads it).
    if !vars.has("RANK") && vars.has_any(OTHER_RANK_VARS) {
        return None;
    }
    Some(read_torchrun(vars))
}

fn read_torchrun(vars: &Vars) -> Result<WorldInfo, CommError> {
    let mut r = Recorder::new(vars);
    let rank = r.uint("RANK", "rank")?;
    let world_size = r.uint("WORLD_SIZE", "world size")?;
    let local_rank = r.uint("LOCAL_RANK", "local rank")?;
    let lws = r.uint("LOCAL_WORLD_SIZE", "local world size")?;
    let local_size = r.uint("LOCAL_SIZE", "local world size")?;
    // torchrun's node rank: only checked, the global rank already accounts for it.
    r.uint("GROUP_RANK", "node rank")?;
    let master_addr = r.master_addr()?;
    let master_port = r.port("MASTER_PORT")?;
    let store = match r.get("TORCHELASTIC_USE_AGENT_STORE") {
        None => StoreKind::Rank0,
        Some(v) => match v.trim().to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" => StoreKind::Torch,
            "false" | "0" | "no" | "" => StoreKind::Rank0,
            _ => {
                return Err(CommError::Config(format!("TORCHELASTIC_USE_AGENT_STORE={v:?} is neither True nor False")))
            }
        },
    };

    let hint = "a launcher sets both (torchrun, DeepSpeed, commrun), or neither for a single process";
    let (rank, ws) = both((rank, "RANK"), (world_size, "WORLD_SIZE"), hint)?;
    // LOCAL_WORLD_SIZE (torchrun) and LOCAL_SIZE (DeepSpeed) mean the same; both may be set.
    let lws = match (lws, local_size) {
        (Some(a), Some(b)) if a != b => {
            return Err(CommError::Config(format!("LOCAL_WORLD_SIZE={a} and LOCAL_SIZE={b} disagree")));
        }
        (Some(a), _) => Some((a, "LOCAL_WORLD_SIZE")),
        (None, Some(b)) => Some((b, "LOCAL_SIZE")),
        (None, None) => None,
    };
    let place =
        Place { rank, world_size: ws, local_rank: local_rank.map(|l| (l, "LOCAL_RANK")), local_world_size: lws }
            .resolve()?;
    let launcher = if vars.has("LOCAL_SIZE") { Launcher::DeepSpeed } else { Launcher::Torchrun };
    let addr = master_addr.unwrap_or_else(|| DEFAULT_MASTER_ADDR.to_owned());
    Ok(world(r, launcher, place, addr, master_port.unwrap_or(DEFAULT_MASTER_PORT), store))
}

/// The Open MPI variables: `(place, world size with its name, local size)`.
fn read_ompi(r: &mut Recorder<'_>) -> Result<(u32, u32, u32, u32), CommError> {
    let rank = r.uint("OMPI_COMM_WORLD_RANK", "rank")?;
    let size = r.uint("OMPI_COMM_WORLD_SIZE", "world size")?;
    let local_rank = r.uint("OMPI_COMM_WORLD_LOCAL_RANK", "local rank")?;
    let local_size = r.uint("OMPI_COMM_WORLD_LOCAL_SIZE", "local world size")?;
    let (rank, ws) = both(
        (rank, "OMPI_COMM_WORLD_RANK"),
        (size, "OMPI_COMM_WORLD_SIZE"),
        "Open MPI's mpirun sets both; is this process really started by mpirun?",
    )?;
    Place {
        rank,
        world_size: ws,
        local_rank: local_rank.map(|l| (l, "OMPI_COMM_WORLD_LOCAL_RANK")),
        local_world_size: local_size.map(|l| (l, "OMPI_COMM_WORLD_LOCAL_SIZE")),
    }
    .resolve()
}

fn has_ompi(vars: &Vars) -> bool {
    vars.has_any(&["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"])
}

/// Open MPI's `mpirun`.
fn open_mpi(vars: &Vars) -> Option<Result<WorldInfo, CommError>> {
    has_ompi(vars).then(|| {
        let mut r = Recorder::new(vars);
        let place = read_ompi(&mut r)?;
        let addr = mpi_master_addr(
            &mut r,
            "Open MPI",
            (place.1, "OMPI_COMM_WORLD_SIZE"),
            place.3,
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        )?;
        let port = r.port("MASTER_PORT")?.unwrap_or(DEFAULT_MASTER_PORT);
        Ok(world(r, Launcher::OpenMpi, place, addr, port, StoreKind::Rank0))
    })
}

/// AzureML, as DeepSpeed's `patch_aml_env_for_torch_nccl_backend` reads it.
fn azureml(vars: &Vars) -> Option<Result<WorldInfo, CommError>> {
    (vars.has("AZUREML_EXPERIMENT_ID") && !vars.has("DLTS_JOB_ID") && has_ompi(vars)).then(|| {
        let mut r = Recorder::new(vars);
        r.get("AZUREML_EXPERIMENT_ID");
        let place = read_ompi(&mut r)?;
        let single_node = place.3 == place.1;
        let (addr, port) = if single_node {
            let addr = match r.get("AZ_BATCHAI_MPI_MASTER_NODE").map(str::trim).filter(|a| !a.is_empty()) {
                Some(a) => a.to_owned(),
                None => DEFAULT_MASTER_ADDR.to_owned(),
            };
            (addr, AML_SINGLE_NODE_PORT)
        } else {
            // "host:port"; DeepSpeed keeps only the host and takes the port from MASTER_PORT.
            let addr = match r.get("AZ_BATCH_MASTER_NODE").map(str::trim) {
                Some(hp) if !hp.is_empty() => hp.rsplit_once(':').map_or(hp, |(h, _)| h).to_owned(),
                _ => r.master_addr()?.ok_or_else(|| {
                    CommError::Config(
                        "AzureML multi-node job without AZ_BATCH_MASTER_NODE or MASTER_ADDR: cannot tell where rank 0 \
                         runs"
                            .into(),
                    )
                })?,
            };
            (addr, r.port("MASTER_PORT")?.unwrap_or(AML_MULTI_NODE_PORT))
        };
        Ok(world(r, Launcher::AzureMl, place, addr, port, StoreKind::Rank0))
    })
}

/// SageMaker, as DeepSpeed's `patch_aws_sm_env_for_torch_nccl_backend` reads it: the Open MPI
/// variables, and `MASTER_ADDR` / `MASTER_PORT` from SageMaker.
fn sagemaker(vars: &Vars) -> Option<Result<WorldInfo, CommError>> {
    (vars.has("SM_TRAINING_ENV") && has_ompi(vars)).then(|| {
        let mut r = Recorder::new(vars);
        let place = read_ompi(&mut r)?;
        let addr = mpi_master_addr(
            &mut r,
            "SageMaker",
            (place.1, "OMPI_COMM_WORLD_SIZE"),
            place.3,
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        )?;
        let port = r.port("MASTER_PORT")?.unwrap_or(DEFAULT_MASTER_PORT);
        Ok(world(r, Launcher::SageMaker, place, addr, port, StoreKind::Rank0))
    })
}

/// MPICH's Hydra (`mpiexec`) and Intel MPI.
fn mpich(vars: &Vars) -> Option<Result<WorldInfo, CommError>> {
    vars.has_any(&["PMI_RANK", "PMI_SIZE"]).then(|| {
        let mut r = Recorder::new(vars);
        let rank = r.uint("PMI_RANK", "rank")?;
        let size = r.uint("PMI_SIZE", "world size")?;
        let local_rank = r.uint("MPI_LOCALRANKID", "local rank")?;
        let local_size = r.uint("MPI_LOCALNRANKS", "local world size")?;
        let (rank, ws) = both((rank, "PMI_RANK"), (size, "PMI_SIZE"), "MPICH/Hydra and Intel MPI set both")?;
        let place = Place {
            rank,
            world_size: ws,
            local_rank: local_rank.map(|l| (l, "MPI_LOCALRANKID")),
            local_world_size: local_size.map(|l| (l, "MPI_LOCALNRANKS")),
        }
        .resolve()?;
        let addr = mpi_master_addr(&mut r, "MPICH/Intel MPI", (place.1, "PMI_SIZE"), place.3, "MPI_LOCALNRANKS")?;
        let port = r.port("MASTER_PORT")?.unwrap_or(DEFAULT_MASTER_PORT);
        Ok(world(r, Launcher::Mpich, place, addr, port, StoreKind::Rank0))
    })
}

/// A PMIx launcher (`prterun`, `srun --mpi=pmix`): PMIx exports only the rank, so the size
/// (and the rest) comes from Slurm when it launched us, or from `WORLD_SIZE`.
fn pmix(vars: &Vars) -> Option<Result<WorldInfo, CommError>> {
    vars.has("PMIX_RANK").then(|| {
        let mut r = Recorder::new(vars);
        let rank = r.uint("PMIX_RANK", "rank")?.unwrap_or_default();
        if let Some(Ok(mut w)) = slurm(vars) {
            if w.rank != rank {
                return Err(CommError::Config(format!(
                    "PMIX_RANK={rank} and SLURM_PROCID={} disagree about this process's rank",
                    w.rank
                )));
            }
            r.read.append(&mut w.source.variables);
            w.source = r.source(Launcher::Pmix);
            return Ok(w);
        }
        let size = r.uint("WORLD_SIZE", "world size")?;
        let ws = size.map(|s| (s, "WORLD_SIZE")).ok_or_else(|| {
            CommError::Config(format!(
                "PMIX_RANK={rank} is set but the world size is unknown (PMIx does not export it): set WORLD_SIZE"
            ))
        })?;
        let local_rank = r.uint("LOCAL_RANK", "local rank")?;
        let lws = r.uint("LOCAL_WORLD_SIZE", "local world size")?;
        let place = Place {
            rank: (rank, "PMIX_RANK"),
            world_size: ws,
            local_rank: local_rank.map(|l| (l, "LOCAL_RANK")),
            local_world_size: lws.map(|l| (l, "LOCAL_WORLD_SIZE")),
        }
        .resolve()?;
        let addr = mpi_master_addr(&mut r, "PMIx", ws, place.3, "LOCAL_WORLD_SIZE")?;
        let port = r.port("MASTER_PORT")?.unwrap_or(DEFAULT_MASTER_PORT);
        Ok(world(r, Launcher::Pmix, place, addr, port, StoreKind::Rank0))
    })
}

/// Slurm's `srun`. The step's variables (`SLURM_STEP_*`) describe the tasks of this `srun`
/// and win over the allocation's.
fn slurm(vars: &Vars) -> Option<Result<WorldInfo, CommError>> {
    vars.has("SLURM_PROCID").then(|| read_slurm(vars))
}

fn read_slurm(vars: &Vars) -> Result<WorldInfo, CommError> {
    let mut r = Recorder::new(vars);
    let rank = r.uint("SLURM_PROCID", "rank")?;
    let size = match r.first(&["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"]) {
        Some((name, v)) => Some((parse_uint(name, v, "task count")?, name)),
        None => None,
    };
    let (rank, ws) = match size {
        Some(ws) => ((rank.unwrap_or_default(), "SLURM_PROCID"), ws),
        None => {
            return Err(CommError::Config(format!(
                "SLURM_PROCID={} is set but SLURM_NTASKS is not; start the ranks with `srun -n N` (or `--ntasks`)",
                rank.unwrap_or_default()
            )))
        }
    };
    let local_rank = r.uint("SLURM_LOCALID", "local rank")?;
    let node = r.uint("SLURM_NODEID", "node index")?;
    let node_list = r.first(&["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"]);
    let local_size = match r.first(&["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"]) {
        Some((name, v)) => {
            let tasks = TasksPerNode::parse(v).map_err(|e| CommError::Config(format!("{name}={v:?}: {e}")))?;
            let index = u64::from(node.unwrap_or_default());
            // One entry means the same count on every node (`--ntasks-per-node`).
            let on_node = if tasks.nodes() == 1 { tasks.on_node(0) } else { tasks.on_node(index) };
            match on_node {
                Some(n) => Some((n, name)),
                None => {
                    return Err(CommError::Config(format!(
                        "SLURM_NODEID={index} is past the {} node(s) of {name}={v}",
                        tasks.nodes()
                    )))
                }
            }
        }
        None => {
            let nodes = match r.first(&["SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"]) {
                Some((name, v)) => Some(u64::from(parse_uint(name, v, "node count")?)),
                None => node_list.and_then(|(_, l)| slurm::count_hosts(l).ok()),
            };
            // One node: every task is here. Otherwise unknown; the block assumption below
            // would be a guess, so say so.
            match nodes {
                Some(1) => Some((ws.0, ws.1)),
                _ => {
                    return Err(CommError::Config(
                        "cannot tell how many Slurm tasks run on this node: SLURM_TASKS_PER_NODE and \
                         SLURM_NTASKS_PER_NODE are unset"
                            .into(),
                    ))
                }
            }
        }
    };
    let place = Place {
        rank,
        world_size: ws,
        local_rank: local_rank.map(|l| (l, "SLURM_LOCALID")),
        local_world_size: local_size,
    }
    .resolve()?;
    let addr =
        match r.master_addr()? {
            Some(a) => a,
            None if place.3 == place.1 => DEFAULT_MASTER_ADDR.to_owned(),
            // Block distribution (Slurm's default) puts rank 0 on the step's first node.
            None => match node_list {
                Some((name, list)) => {
                    slurm::first_host(list).map_err(|e| CommError::Config(format!("{name}={list:?}: {e}")))?
                }
                None => return Err(CommError::Config(
                    "Slurm job across nodes without SLURM_JOB_NODELIST or MASTER_ADDR: cannot tell where rank 0 runs"
                        .into(),
                )),
            },
        };
    let port = r.port("MASTER_PORT")?.unwrap_or(DEFAULT_MASTER_PORT);
    Ok(world(r, Launcher::Slurm, place, addr, port, StoreKind::Rank0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What torchrun 2.x gives worker 1 of node 1 with `--nnodes 2 --nproc-per-node 4`, plus some
    /// of the shell's own variables.
    const TORCHRUN: &str = "\
        PATH=/usr/local/bin:/usr/bin:/bin
        HOME=/home/alice
        OMP_NUM_THREADS=1
        LOCAL_RANK=1
        RANK=5
        GROUP_RANK=1
        ROLE_RANK=5
        ROLE_NAME=default
        LOCAL_WORLD_SIZE=4
        WORLD_SIZE=8
        GROUP_WORLD_SIZE=2
        ROLE_WORLD_SIZE=8
        MASTER_ADDR=node01.cluster
        MASTER_PORT=29400
        TORCHELASTIC_RESTART_COUNT=0
        TORCHELASTIC_MAX_RESTARTS=0
        TORCHELASTIC_RUN_ID=none
        TORCHELASTIC_USE_AGENT_STORE=True
        TORCH_NCCL_ASYNC_ERROR_HANDLING=1
        TORCHELASTIC_ERROR_FILE=/tmp/torchelastic_x1y2/none_abc/attempt_0/1/error.json";

    /// What `deepspeed --num_gpus 2` (launcher/launch.py) gives rank 3 of a 2-node job.
    const DEEPSPEED: &str = "\
        PATH=/usr/bin
        MASTER_ADDR=10.0.0.7
        MASTER_PORT=29500
        WORLD_SIZE=4
        CROSS_RANK=1
        CROSS_SIZE=2
        LOCAL_SIZE=2
        RANK=3
        LOCAL_RANK=1
        PYTHONUNBUFFERED=1";

    fn parse(dump: &str) -> Vec<(String, String)> {
        dump.lines().filter_map(|l| l.trim().split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect()
    }

    /// `dump` with `overrides` applied (`NAME=value`, or `NAME` alone to remove it).
    fn with(dump: &str, overrides: &[&str]) -> Vec<(String, String)> {
        let mut vars = parse(dump);
        for o in overrides {
            let (k, v) = o.split_once('=').map_or((*o, None), |(k, v)| (k, Some(v)));
            vars.retain(|(name, _)| name != k);
            if let Some(v) = v {
                vars.push((k.to_owned(), v.to_owned()));
            }
        }
        vars
    }

    fn config_err(vars: Vec<(String, String)>) -> String {
        match from_vars(vars) {
            Err(CommError::Config(msg)) => msg,
            other => panic!("expected a configuration error, got {other:?}"),
        }
    }

    #[test]
    fn torchrun_full_dump() {
        let w = from_vars(parse(TORCHRUN)).unwrap();
        assert_eq!((w.rank, w.world_size, w.local_rank, w.local_world_size), (5, 8, 1, 4));
        assert_eq!((w.master_addr.as_str(), w.master_port), ("node01.cluster", 29400));
        assert_eq!(w.source.launcher, Launcher::Torchrun);
        assert_eq!(
            w.source.variables,
            [
                "RANK=5",
                "WORLD_SIZE=8",
                "LOCAL_RANK=1",
                "LOCAL_WORLD_SIZE=4",
                "GROUP_RANK=1",
                "MASTER_ADDR=node01.cluster",
                "MASTER_PORT=29400",
                "TORCHELASTIC_USE_AGENT_STORE=True"
            ]
        );
        // torchrun's agent already serves a torch TCPStore on MASTER_PORT.
        assert_eq!(w.store, StoreKind::Torch);
        let w = from_vars(with(TORCHRUN, &["TORCHELASTIC_USE_AGENT_STORE=False"])).unwrap();
        assert_eq!(w.store, StoreKind::Rank0);
        let e = config_err(with(TORCHRUN, &["TORCHELASTIC_USE_AGENT_STORE=maybe"]));
        assert!(e.contains("TORCHELASTIC_USE_AGENT_STORE=\"maybe\""), "{e}");
        let e = config_err(with(TORCHRUN, &["GROUP_RANK=x"]));
        assert!(e.contains("GROUP_RANK=\"x\""), "{e}");
        assert!(!w.all_local());
        assert!(w.to_string().contains("RANK=5"), "{w}");
    }

    #[test]
    fn deepspeed_full_dump() {
        let w = from_vars(parse(DEEPSPEED)).unwrap();
        assert_eq!((w.rank, w.world_size, w.local_rank, w.local_world_size), (3, 4, 1, 2));
        assert_eq!((w.master_addr.as_str(), w.master_port), ("10.0.0.7", 29500));
        assert_eq!(w.source.launcher, Launcher::DeepSpeed);
        assert!(w.source.variables.contains(&"LOCAL_SIZE=2".to_owned()));
        // Newer DeepSpeed sets both names; they agree.
        let w = from_vars(with(DEEPSPEED, &["LOCAL_WORLD_SIZE=2"])).unwrap();
        assert_eq!((w.local_rank, w.local_world_size, w.source.launcher), (1, 2, Launcher::DeepSpeed));
        let e = config_err(with(DEEPSPEED, &["LOCAL_WORLD_SIZE=4"]));
        assert!(e.contains("LOCAL_WORLD_SIZE=4") && e.contains("LOCAL_SIZE=2"), "{e}");
    }

    #[test]
    fn nothing_set_is_a_single_process() {
        let w = from_vars(parse("PATH=/bin\nHOME=/root")).unwrap();
        assert_eq!(w, WorldInfo::single());
        // MASTER_* or LOCAL_RANK alone do not make a job.
        let w = from_vars([("MASTER_ADDR", "h"), ("MASTER_PORT", "1234"), ("LOCAL_RANK", "0")]).unwrap();
        assert_eq!(w, WorldInfo::single());
        assert_eq!(from_vars(Vec::<(String, String)>::new()).unwrap(), WorldInfo::single());
    }

    #[test]
    fn defaults_and_single_host_assumption() {
        let w = from_vars([("RANK", "2"), ("WORLD_SIZE", "3")]).unwrap();
        assert_eq!((w.rank, w.world_size, w.local_rank, w.local_world_size), (2, 3, 2, 3));
        assert_eq!((w.master_addr.as_str(), w.master_port), ("127.0.0.1", 29500));
        assert_eq!(w.source.variables, ["RANK=2", "WORLD_SIZE=3"]);
        assert!(w.all_local());
        // Only the local size: block placement.
        let w = from_vars(with(TORCHRUN, &["LOCAL_RANK"])).unwrap();
        assert_eq!((w.local_rank, w.local_world_size), (1, 4));
        // Only the local rank: the local size is the world size.
        let w = from_vars(with(TORCHRUN, &["LOCAL_WORLD_SIZE"])).unwrap();
        assert_eq!((w.local_rank, w.local_world_size), (1, 8));
        // Whitespace around numbers is tolerated, as Python's int() does; later pairs win.
        let w = from_vars([("RANK", "9"), ("RANK", " 1 "), ("WORLD_SIZE", "2\n"), ("MASTER_PORT", " 80")]).unwrap();
        assert_eq!((w.rank, w.world_size, w.master_port), (1, 2, 80));
    }

    #[test]
    fn rank_without_world_size_and_reverse() {
        let e = config_err(with(TORCHRUN, &["WORLD_SIZE"]));
        assert!(e.contains("RANK=5 is set but WORLD_SIZE is not"), "{e}");
        let e = config_err(with(TORCHRUN, &["RANK"]));
        assert!(e.contains("WORLD_SIZE=8 is set but RANK is not"), "{e}");
    }

    #[test]
    fn unparsable_numbers_name_the_variable() {
        for (var, bad) in [("RANK", "five"), ("WORLD_SIZE", "-1"), ("LOCAL_RANK", "1.0"), ("LOCAL_WORLD_SIZE", "")] {
            let e = config_err(with(TORCHRUN, &[&format!("{var}={bad}")]));
            assert!(e.starts_with(&format!("{var}=\"{bad}\" is not a valid")), "{e}");
        }
        let e = config_err(with(DEEPSPEED, &["LOCAL_SIZE=two"]));
        assert!(e.contains("LOCAL_SIZE=\"two\""), "{e}");
        let e = config_err(with(TORCHRUN, &["RANK=99999999999"]));
        assert!(e.contains("RANK=\"99999999999\""), "{e}");
    }

    #[test]
    fn out_of_range_ranks() {
        let e = config_err(with(TORCHRUN, &["RANK=8"]));
        assert!(e.contains("RANK=8") && e.contains("WORLD_SIZE=8"), "{e}");
        let e = config_err(with(TORCHRUN, &["WORLD_SIZE=0", "RANK=0"]));
        assert!(e.contains("WORLD_SIZE=0"), "{e}");
        let e = config_err(with(TORCHRUN, &["LOCAL_RANK=4"]));
        assert!(e.contains("LOCAL_RANK=4") && e.contains("LOCAL_WORLD_SIZE=4"), "{e}");
        let e = config_err(with(DEEPSPEED, &["LOCAL_RANK=2"]));
        assert!(e.contains("LOCAL_RANK=2") && e.contains("LOCAL_SIZE=2"), "{e}");
        let e = config_err(with(TORCHRUN, &["LOCAL_WORLD_SIZE=0"]));
        assert!(e.contains("LOCAL_WORLD_SIZE=0"), "{e}");
        let e = config_err(with(TORCHRUN, &["LOCAL_WORLD_SIZE=16", "LOCAL_RANK=9"]));
        assert!(e.contains("LOCAL_WORLD_SIZE=16") && e.contains("WORLD_SIZE=8"), "{e}");
        let e = config_err(with(TORCHRUN, &["LOCAL_WORLD_SIZE", "LOCAL_RANK=8"]));
        assert!(e.contains("LOCAL_RANK=8") && e.contains("WORLD_SIZE=8"), "{e}");
    }

    #[test]
    fn bad_master_port_and_addr() {
        for (bad, quoted) in [("0", "MASTER_PORT=0"), ("65536", "MASTER_PORT=65536"), ("http", "MASTER_PORT=\"http\"")]
        {
            let e = config_err(with(TORCHRUN, &[&format!("MASTER_PORT={bad}")]));
            assert!(e.contains(quoted), "{e}");
        }
        let e = config_err(with(TORCHRUN, &["MASTER_ADDR= "]));
        assert!(e.contains("MASTER_ADDR"), "{e}");
        let w = from_vars(with(TORCHRUN, &["MASTER_PORT=65535"])).unwrap();
        assert_eq!(w.master_port, 65535);
    }

    #[test]
    fn torchrun_wins_over_other_launchers_variables() {
        // torchrun inside an mpirun/srun allocation: the torchrun variables describe the ranks.
        let mut vars = parse(TORCHRUN);
        vars.extend(parse("OMPI_COMM_WORLD_RANK=0\nOMPI_COMM_WORLD_SIZE=2\nSLURM_PROCID=1\nSLURM_NTASKS=2"));
        let w = from_vars(vars).unwrap();
        assert_eq!((w.rank, w.world_size, w.source.launcher), (5, 8, Launcher::Torchrun));
    }

    #[test]
    fn from_env_agrees_with_from_vars() {
        assert_eq!(from_env().ok(), from_vars(std::env::vars()).ok());
    }

    /// `mpirun -np 4 --host n1:2,n2:2 prog` (Open MPI 4.1), rank 3, plus what the shell had.
    const OPEN_MPI: &str = "\
        PATH=/usr/bin
        HOME=/root
        OMPI_COMM_WORLD_RANK=3
        OMPI_COMM_WORLD_SIZE=4
        OMPI_COMM_WORLD_LOCAL_RANK=1
        OMPI_COMM_WORLD_LOCAL_SIZE=2
        OMPI_COMM_WORLD_NODE_RANK=1
        OMPI_UNIVERSE_SIZE=4
        OMPI_APP_CTX_NUM_PROCS=4
        OMPI_FIRST_RANKS=0
        OMPI_NUM_APP_CTX=1
        OMPI_MCA_ess=^singleton
        OMPI_MCA_ess_base_jobid=2812870657
        OMPI_MCA_ess_base_vpid=3
        OMPI_MCA_ess_base_num_procs=4
        OMPI_MCA_orte_hnp_uri=2812870656.0;tcp://10.0.0.1:45371
        OMPI_MCA_orte_local_daemon_uri=2812870656.1;tcp://10.0.0.2:39807
        OMPI_MCA_pmix=^s1,s2,cray,isolated
        PMIX_RANK=3
        PMIX_NAMESPACE=2812870657
        PMIX_SERVER_URI2=2812870656.1;tcp4://127.0.0.1:44721
        PMIX_SECURITY_MODE=native
        OMPI_COMMAND=prog";

    /// `mpiexec -n 2 prog` (MPICH 4, Hydra) on one host, rank 1.
    const MPICH: &str = "\
        PATH=/usr/bin
        PMI_RANK=1
        PMI_SIZE=2
        PMI_FD=6
        PMI_SUBVERSION=1
        PMI_VERSION=1
        MPI_LOCALRANKID=1
        MPI_LOCALNRANKS=2
        MPIR_CVAR_CH3_INTERFACE_HOSTNAME=host1
        HYDI_CONTROL_FD=7";

    /// Intel MPI's `mpirun -n 8 -ppn 4` across two hosts, rank 6, with MASTER_ADDR exported.
    const INTEL_MPI: &str = "\
        I_MPI_ROOT=/opt/intel/oneapi/mpi/2021.10.0
        I_MPI_HYDRA_TOPOLIB=hwloc
        PMI_RANK=6
        PMI_SIZE=8
        MPI_LOCALRANKID=2
        MPI_LOCALNRANKS=4
        PMI_FD=9
        MASTER_ADDR=10.1.0.5
        MASTER_PORT=29501";

    /// `srun -N 2 -n 7 prog` (Slurm 23.02), task 5: 4 tasks on gpu07, 3 on gpu08.
    const SLURM: &str = "\
        PATH=/usr/bin
        SLURM_JOB_ID=123456
        SLURM_JOBID=123456
        SLURM_STEP_ID=0
        SLURM_STEPID=0
        SLURM_PROCID=5
        SLURM_LOCALID=1
        SLURM_NODEID=1
        SLURM_NTASKS=7
        SLURM_NPROCS=7
        SLURM_NNODES=2
        SLURM_JOB_NUM_NODES=2
        SLURM_STEP_NUM_TASKS=7
        SLURM_STEP_NUM_NODES=2
        SLURM_TASKS_PER_NODE=4,3
        SLURM_STEP_TASKS_PER_NODE=4,3
        SLURM_JOB_NODELIST=gpu[07-08]
        SLURM_NODELIST=gpu[07-08]
        SLURM_STEP_NODELIST=gpu[07-08]
        SLURM_TOPOLOGY_ADDR=gpu08
        SLURMD_NODENAME=gpu08
        SLURM_GTIDS=4,5,6
        SLURM_CPUS_ON_NODE=32
        SLURM_JOB_CPUS_PER_NODE=32(x2)
        SLURM_SRUN_COMM_HOST=10.0.0.1
        SLURM_SUBMIT_DIR=/home/alice
        SLURM_CLUSTER_NAME=hpc
        SLURM_DISTRIBUTION=block
        SLURM_JOB_PARTITION=gpu";

    /// An AzureML multi-node job (2 nodes × 2), rank 2, as DeepSpeed sees it.
    const AZUREML: &str = "\
        AZUREML_EXPERIMENT_ID=3f2a9c7e-1b2d-4c5e-8f90-123456789abc
        AZUREML_RUN_ID=train_1700000000_abcd
        AZ_BATCH_MASTER_NODE=10.0.0.4:6105
        AZ_BATCHAI_MPI_MASTER_NODE=10.0.0.4
        OMPI_COMM_WORLD_RANK=2
        OMPI_COMM_WORLD_SIZE=4
        OMPI_COMM_WORLD_LOCAL_RANK=0
        OMPI_COMM_WORLD_LOCAL_SIZE=2
        NCCL_SOCKET_IFNAME=eth0";

    /// A SageMaker MPI job (2 hosts × 2), rank 1.
    const SAGEMAKER: &str = "\
        SM_TRAINING_ENV={\"hosts\":[\"algo-1\",\"algo-2\"],\"current_host\":\"algo-1\"}
        SM_HOSTS=[\"algo-1\",\"algo-2\"]
        SM_CURRENT_HOST=algo-1
        OMPI_COMM_WORLD_RANK=1
        OMPI_COMM_WORLD_SIZE=4
        OMPI_COMM_WORLD_LOCAL_RANK=1
        OMPI_COMM_WORLD_LOCAL_SIZE=2
        MASTER_ADDR=algo-1
        MASTER_PORT=7777";

    fn place(w: &WorldInfo) -> (u32, u32, u32, u32) {
        (w.rank, w.world_size, w.local_rank, w.local_world_size)
    }

    #[test]
    fn open_mpi_full_dump() {
        let e = config_err(parse(OPEN_MPI));
        assert!(e.contains("OMPI_COMM_WORLD_LOCAL_SIZE=2") && e.contains("MASTER_ADDR"), "{e}");
        let w = from_vars(with(OPEN_MPI, &["MASTER_ADDR=n1"])).unwrap();
        assert_eq!(place(&w), (3, 4, 1, 2));
        assert_eq!((w.master_addr.as_str(), w.master_port, w.source.launcher), ("n1", 29500, Launcher::OpenMpi));
        assert!(w.source.variables.contains(&"OMPI_COMM_WORLD_RANK=3".to_owned()), "{:?}", w.source.variables);
        // One host: no address needed.
        let w = from_vars(with(OPEN_MPI, &["OMPI_COMM_WORLD_LOCAL_SIZE=4", "OMPI_COMM_WORLD_LOCAL_RANK=3"])).unwrap();
        assert_eq!((place(&w), w.master_addr.as_str()), ((3, 4, 3, 4), "127.0.0.1"));
        let e = config_err(with(OPEN_MPI, &["OMPI_COMM_WORLD_SIZE"]));
        assert!(e.contains("OMPI_COMM_WORLD_RANK=3 is set but OMPI_COMM_WORLD_SIZE is not"), "{e}");
        let e = config_err(with(OPEN_MPI, &["OMPI_COMM_WORLD_LOCAL_RANK=2", "MASTER_ADDR=n1"]));
        assert!(e.contains("OMPI_COMM_WORLD_LOCAL_RANK=2") && e.contains("OMPI_COMM_WORLD_LOCAL_SIZE=2"), "{e}");
        // Open MPI 5 exports PMIX_RANK too; a different one is a contradiction.
        let mut vars = with(OPEN_MPI, &["MASTER_ADDR=n1", "PMIX_RANK=2", "WORLD_SIZE=4"]);
        vars.retain(|(k, _)| k != "OMPI_MCA_ess");
        let e = config_err(vars);
        assert!(e.contains("OpenMpi") && e.contains("Pmix") && e.contains("rank 3 and rank 2"), "{e}");
    }

    #[test]
    fn mpich_and_intel_mpi_full_dumps() {
        let w = from_vars(parse(MPICH)).unwrap();
        assert_eq!(
            (place(&w), w.master_addr.as_str(), w.source.launcher),
            ((1, 2, 1, 2), "127.0.0.1", Launcher::Mpich)
        );
        let w = from_vars(parse(INTEL_MPI)).unwrap();
        assert_eq!(place(&w), (6, 8, 2, 4));
        assert_eq!((w.master_addr.as_str(), w.master_port), ("10.1.0.5", 29501));
        let e = config_err(with(INTEL_MPI, &["MASTER_ADDR"]));
        assert!(e.contains("MPI_LOCALNRANKS=4 < PMI_SIZE=8"), "{e}");
        let e = config_err(with(MPICH, &["PMI_RANK=2"]));
        assert!(e.contains("PMI_RANK=2") && e.contains("PMI_SIZE=2"), "{e}");
        let e = config_err(with(MPICH, &["PMI_SIZE=two"]));
        assert!(e.contains("PMI_SIZE=\"two\""), "{e}");
    }

    #[test]
    fn slurm_full_dump() {
        let w = from_vars(parse(SLURM)).unwrap();
        assert_eq!(place(&w), (5, 7, 1, 3));
        assert_eq!((w.master_addr.as_str(), w.master_port, w.source.launcher), ("gpu07", 29500, Launcher::Slurm));
        assert!(w.source.variables.contains(&"SLURM_STEP_NODELIST=gpu[07-08]".to_owned()), "{:?}", w.source.variables);
        // `2(x3),1`: 7 tasks on 4 nodes; task 6 is alone on the last node.
        let w = from_vars(with(
            SLURM,
            &[
                "SLURM_STEP_TASKS_PER_NODE=2(x3),1",
                "SLURM_PROCID=6",
                "SLURM_NODEID=3",
                "SLURM_LOCALID=0",
                "SLURM_STEP_NODELIST=node[001-003,010]",
            ],
        ))
        .unwrap();
        assert_eq!((place(&w), w.master_addr.as_str()), ((6, 7, 0, 1), "node001"));
        // MASTER_ADDR/MASTER_PORT win over the node list.
        let w = from_vars(with(SLURM, &["MASTER_ADDR=10.9.9.9", "MASTER_PORT=1234"])).unwrap();
        assert_eq!((w.master_addr.as_str(), w.master_port), ("10.9.9.9", 1234));
        // `--ntasks-per-node=4` alone; one node without any per-node count.
        let w =
            from_vars(with(SLURM, &["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE=4"]))
                .unwrap();
        assert_eq!(place(&w), (5, 7, 1, 4));
        let single = "SLURM_PROCID=1\nSLURM_NTASKS=2\nSLURM_LOCALID=1\nSLURM_NNODES=1\nSLURM_NODELIST=box";
        let w = from_vars(parse(single)).unwrap();
        assert_eq!((place(&w), w.master_addr.as_str()), ((1, 2, 1, 2), "127.0.0.1"));
    }

    #[test]
    fn slurm_errors_name_the_variables() {
        let e = config_err(with(SLURM, &["SLURM_STEP_NODELIST=gpu[07-"]));
        assert!(e.contains("SLURM_STEP_NODELIST=\"gpu[07-\"") && e.contains("unclosed"), "{e}");
        let e = config_err(with(SLURM, &["SLURM_STEP_TASKS_PER_NODE=4(x"]));
        assert!(e.contains("SLURM_STEP_TASKS_PER_NODE=\"4(x\""), "{e}");
        let e = config_err(with(SLURM, &["SLURM_NODEID=2"]));
        assert!(e.contains("SLURM_NODEID=2") && e.contains("SLURM_STEP_TASKS_PER_NODE=4,3"), "{e}");
        let e = config_err(with(SLURM, &["SLURM_NTASKS", "SLURM_NPROCS", "SLURM_STEP_NUM_TASKS"]));
        assert!(e.contains("SLURM_PROCID=5 is set but SLURM_NTASKS is not"), "{e}");
        let e = config_err(with(SLURM, &["SLURM_PROCID=7"]));
        assert!(e.contains("SLURM_PROCID=7") && e.contains("SLURM_STEP_NUM_TASKS=7"), "{e}");
        let e = config_err(with(SLURM, &["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]));
        assert!(e.contains("SLURM_TASKS_PER_NODE"), "{e}");
        let e = config_err(with(SLURM, &["SLURM_LOCALID=3"]));
        assert!(e.contains("SLURM_LOCALID=3") && e.contains("SLURM_STEP_TASKS_PER_NODE=3"), "{e}");
    }

    #[test]
    fn pmix_reads_its_size_from_slurm_or_world_size() {
        let w = from_vars(with(SLURM, &["PMIX_RANK=5", "PMIX_NAMESPACE=slurm.pmix.123456.0"])).unwrap();
        assert_eq!((place(&w), w.source.launcher, w.master_addr.as_str()), ((5, 7, 1, 3), Launcher::Pmix, "gpu07"));
        assert!(w.source.variables.contains(&"PMIX_RANK=5".to_owned()), "{:?}", w.source.variables);
        let e = config_err(with(SLURM, &["PMIX_RANK=4"]));
        assert!(e.contains("PMIX_RANK=4") && e.contains("SLURM_PROCID=5"), "{e}");
        let w = from_vars([("PMIX_RANK", "1"), ("WORLD_SIZE", "2")]).unwrap();
        assert_eq!((place(&w), w.source.launcher), ((1, 2, 1, 2), Launcher::Pmix));
        let e = config_err(vec![("PMIX_RANK".to_owned(), "1".to_owned())]);
        assert!(e.contains("PMIX_RANK=1") && e.contains("WORLD_SIZE"), "{e}");
    }

    #[test]
    fn azureml_and_sagemaker_as_deepspeed_reads_them() {
        let w = from_vars(parse(AZUREML)).unwrap();
        assert_eq!(place(&w), (2, 4, 0, 2));
        assert_eq!((w.master_addr.as_str(), w.master_port, w.source.launcher), ("10.0.0.4", 6105, Launcher::AzureMl));
        let w = from_vars(with(AZUREML, &["MASTER_PORT=7000"])).unwrap();
        assert_eq!(w.master_port, 7000);
        // One node: AZ_BATCHAI_MPI_MASTER_NODE and DeepSpeed's fixed port.
        let w =
            from_vars(with(AZUREML, &["OMPI_COMM_WORLD_LOCAL_SIZE=4", "AZ_BATCHAI_MPI_MASTER_NODE=10.0.0.9"])).unwrap();
        assert_eq!((w.master_addr.as_str(), w.master_port), ("10.0.0.9", 54965));
        let e = config_err(with(AZUREML, &["AZ_BATCH_MASTER_NODE"]));
        assert!(e.contains("AZ_BATCH_MASTER_NODE"), "{e}");
        // Under DLTS, DeepSpeed does not treat it as AzureML: plain Open MPI.
        let w = from_vars(with(AZUREML, &["DLTS_JOB_ID=7", "MASTER_ADDR=h"])).unwrap();
        assert_eq!(w.source.launcher, Launcher::OpenMpi);

        let w = from_vars(parse(SAGEMAKER)).unwrap();
        assert_eq!(place(&w), (1, 4, 1, 2));
        assert_eq!((w.master_addr.as_str(), w.master_port, w.source.launcher), ("algo-1", 7777, Launcher::SageMaker));
        let e = config_err(with(SAGEMAKER, &["MASTER_ADDR"]));
        assert!(e.contains("SageMaker") && e.contains("MASTER_ADDR"), "{e}");
    }

    #[test]
    fn launchers_that_disagree_are_errors() {
        // RANK exported to every rank of an mpirun: same size, different rank.
        let mut vars = parse(OPEN_MPI);
        vars.extend(parse("RANK=0\nWORLD_SIZE=4\nMASTER_ADDR=n1"));
        let e = config_err(vars.clone());
        assert!(e.contains("rank 0 and rank 3") && e.contains("RANK=0") && e.contains("OMPI_COMM_WORLD_RANK=3"), "{e}");
        // torchrun's elastic agent numbers ranks itself: not compared.
        vars.push(("TORCHELASTIC_RUN_ID".into(), "job1".into()));
        assert_eq!(from_vars(vars).unwrap().rank, 0);
        // Agreeing launchers are fine, and the winner is recorded.
        let mut vars = parse(SLURM);
        vars.extend(parse("RANK=5\nWORLD_SIZE=7\nLOCAL_RANK=1\nLOCAL_WORLD_SIZE=3"));
        let w = from_vars(vars).unwrap();
        assert_eq!((place(&w), w.source.launcher), ((5, 7, 1, 3), Launcher::Torchrun));
        // Same rank, different local rank on a host of the same size.
        let mut vars = parse(SLURM);
        vars.extend(parse("RANK=5\nWORLD_SIZE=7\nLOCAL_RANK=2\nLOCAL_WORLD_SIZE=3"));
        let e = config_err(vars);
        assert!(e.contains("local rank 2 and local rank 1"), "{e}");
    }

    #[test]
    fn comm_store_overrides_who_serves() {
        let w = from_vars(with(DEEPSPEED, &["COMM_STORE=external"])).unwrap();
        assert_eq!(w.store, StoreKind::External);
        assert!(w.source.variables.contains(&"COMM_STORE=external".to_owned()));
        let w = from_vars(with(TORCHRUN, &["COMM_STORE=rank0"])).unwrap();
        assert_eq!(w.store, StoreKind::Rank0);
        let w = from_vars(with(DEEPSPEED, &["COMM_STORE=Torch"])).unwrap();
        assert_eq!(w.store, StoreKind::Torch);
        let e = config_err(with(DEEPSPEED, &["COMM_STORE=redis"]));
        assert!(e.contains("COMM_STORE=\"redis\""), "{e}");
    }

    mod fuzz {
        use super::super::*;
        use proptest::prelude::*;

        const NAMES: &[&str] = &[
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "LOCAL_SIZE",
            "GROUP_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "TORCHELASTIC_USE_AGENT_STORE",
            "TORCHELASTIC_RUN_ID",
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
            "PMI_RANK",
            "PMI_SIZE",
            "MPI_LOCALRANKID",
            "MPI_LOCALNRANKS",
            "PMIX_RANK",
            "SLURM_PROCID",
            "SLURM_NTASKS",
            "SLURM_STEP_NUM_TASKS",
            "SLURM_LOCALID",
            "SLURM_NODEID",
            "SLURM_TASKS_PER_NODE",
            "SLURM_NTASKS_PER_NODE",
            "SLURM_NNODES",
            "SLURM_JOB_NODELIST",
            "SLURM_STEP_NODELIST",
            "AZUREML_EXPERIMENT_ID",
            "AZ_BATCH_MASTER_NODE",
            "AZ_BATCHAI_MPI_MASTER_NODE",
            "SM_TRAINING_ENV",
            "DLTS_JOB_ID",
            "COMM_STORE",
        ];

        fn value() -> impl Strategy<Value = String> {
            prop_oneof![
                (0u64..10).prop_map(|n| n.to_string()),
                "[0-9]{1,12}",
                "[a-z0-9\\[\\],\\-():x ]{0,16}",
                any::<String>(),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig {
                // Bounded for every `cargo test`; PROPTEST_CASES=1000000 fuzzes longer.
                cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(3000),
                failure_persistence: None,
                ..ProptestConfig::default()
            })]

            /// Any mix of launcher variables gives a consistent world or an error, never a panic.
            #[test]
            fn from_vars_never_panics(vars in proptest::collection::vec((proptest::sample::select(NAMES), value()), 0..12)) {
                if let Ok(w) = from_vars(vars) {
                    prop_assert!(w.rank < w.world_size);
                    prop_assert!(w.local_rank < w.local_world_size && w.local_world_size <= w.world_size);
                    prop_assert!(w.master_port > 0 && !w.master_addr.is_empty());
                }
            }
        }
    }
}
