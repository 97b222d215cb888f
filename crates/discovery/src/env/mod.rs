//! [`WorldInfo`] from the variables a launcher sets.

use comm_core::{CommError, Launcher, StoreKind, WorldInfo};

mod cloud;
#[cfg(test)]
mod fixtures;
mod mpi;
mod slurm;
mod torchrun;
mod vars;

use cloud::{azureml, sagemaker};
use mpi::{mpich, open_mpi, pmix};
use slurm::slurm;
use torchrun::torchrun;
use vars::Vars;

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
/// 1. torchrun ([`Launcher::Torchrun`]), `commrun` ([`Launcher::Commrun`]) and the DeepSpeed launcher
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
/// Slurm, and none (empty) for a multi-host MPI job, whose launchers do not say where rank 0
/// runs: the mpi and hier backends need no store, and `rendezvous` refuses naming what to set. The port defaults to 29500. `COMM_STORE` (`rank0`, `external`,
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

#[cfg(test)]
mod tests {
    use super::fixtures::*;
    use super::*;

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
                    // An empty address only where ranks span hosts (an MPI launch without MASTER_ADDR).
                    prop_assert!(w.master_port > 0 && (!w.master_addr.is_empty() || w.local_world_size < w.world_size));
                }
            }
        }
    }
}
