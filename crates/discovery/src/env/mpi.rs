//! The MPI launchers: Open MPI's `mpirun`, MPICH's Hydra and Intel MPI, and PMIx.

use comm_core::{CommError, Launcher, StoreKind, WorldInfo};

use super::slurm::slurm;
use super::vars::{both, mpi_master_addr, world, Place, Recorder, Vars};
use super::DEFAULT_MASTER_PORT;

/// The Open MPI variables: `(place, world size with its name, local size)`.
pub(super) fn read_ompi(r: &mut Recorder<'_>) -> Result<(u32, u32, u32, u32), CommError> {
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

pub(super) fn has_ompi(vars: &Vars) -> bool {
    vars.has_any(&["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"])
}

/// Open MPI's `mpirun`.
pub(super) fn open_mpi(vars: &Vars) -> Option<Result<WorldInfo, CommError>> {
    has_ompi(vars).then(|| {
        let mut r = Recorder::new(vars);
        let place = read_ompi(&mut r)?;
        let addr = mpi_master_addr(&mut r, place.1, place.3)?;
        let port = r.port("MASTER_PORT")?.unwrap_or(DEFAULT_MASTER_PORT);
        Ok(world(r, Launcher::OpenMpi, place, addr, port, StoreKind::Rank0))
    })
}

/// MPICH's Hydra (`mpiexec`) and Intel MPI.
pub(super) fn mpich(vars: &Vars) -> Option<Result<WorldInfo, CommError>> {
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
        let addr = mpi_master_addr(&mut r, place.1, place.3)?;
        let port = r.port("MASTER_PORT")?.unwrap_or(DEFAULT_MASTER_PORT);
        Ok(world(r, Launcher::Mpich, place, addr, port, StoreKind::Rank0))
    })
}

/// A PMIx launcher (`prterun`, `srun --mpi=pmix`): PMIx exports only the rank, so the size
/// (and the rest) comes from Slurm when it launched us, or from `WORLD_SIZE`.
pub(super) fn pmix(vars: &Vars) -> Option<Result<WorldInfo, CommError>> {
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
        let addr = mpi_master_addr(&mut r, ws.0, place.3)?;
        let port = r.port("MASTER_PORT")?.unwrap_or(DEFAULT_MASTER_PORT);
        Ok(world(r, Launcher::Pmix, place, addr, port, StoreKind::Rank0))
    })
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::super::from_vars;
    use comm_core::Launcher;

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

    #[test]
    fn open_mpi_full_dump() {
        // Across hosts with no MASTER_ADDR: no store address (the mpi backends need none;
        // `rendezvous` refuses where one is needed).
        let w = from_vars(parse(OPEN_MPI)).unwrap();
        assert_eq!((place(&w), w.master_addr.as_str()), ((3, 4, 1, 2), ""));
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
        assert_eq!(from_vars(with(INTEL_MPI, &["MASTER_ADDR"])).unwrap().master_addr, "");
        let e = config_err(with(MPICH, &["PMI_RANK=2"]));
        assert!(e.contains("PMI_RANK=2") && e.contains("PMI_SIZE=2"), "{e}");
        let e = config_err(with(MPICH, &["PMI_SIZE=two"]));
        assert!(e.contains("PMI_SIZE=\"two\""), "{e}");
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
}
