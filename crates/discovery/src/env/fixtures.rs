//! Launcher environments recorded from real jobs, and helpers, for the readers' tests.

use comm_core::{CommError, WorldInfo};

use super::from_vars;

/// What torchrun 2.x gives worker 1 of node 1 with `--nnodes 2 --nproc-per-node 4`, plus some
/// of the shell's own variables.
pub(super) const TORCHRUN: &str = "\
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
pub(super) const DEEPSPEED: &str = "\
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

pub(super) fn parse(dump: &str) -> Vec<(String, String)> {
    dump.lines().filter_map(|l| l.trim().split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect()
}

/// `dump` with `overrides` applied (`NAME=value`, or `NAME` alone to remove it).
pub(super) fn with(dump: &str, overrides: &[&str]) -> Vec<(String, String)> {
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

pub(super) fn config_err(vars: Vec<(String, String)>) -> String {
    match from_vars(vars) {
        Err(CommError::Config(msg)) => msg,
        other => panic!("expected a configuration error, got {other:?}"),
    }
}

/// `mpirun -np 4 --host n1:2,n2:2 prog` (Open MPI 4.1), rank 3, plus what the shell had.
pub(super) const OPEN_MPI: &str = "\
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

/// `srun -N 2 -n 7 prog` (Slurm 23.02), task 5: 4 tasks on gpu07, 3 on gpu08.
pub(super) const SLURM: &str = "\
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

pub(super) fn place(w: &WorldInfo) -> (u32, u32, u32, u32) {
    (w.rank, w.world_size, w.local_rank, w.local_world_size)
}
