//! Slurm's `srun`.

use comm_core::{CommError, Launcher, StoreKind, WorldInfo};

use crate::slurm::{self, TasksPerNode};

use super::vars::{parse_uint, world, Place, Recorder, Vars};
use super::{DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT};

/// Slurm's `srun`. The step's variables (`SLURM_STEP_*`) describe the tasks of this `srun`
/// and win over the allocation's.
pub(super) fn slurm(vars: &Vars) -> Option<Result<WorldInfo, CommError>> {
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
    use super::super::fixtures::*;
    use super::super::from_vars;
    use comm_core::Launcher;

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
}
