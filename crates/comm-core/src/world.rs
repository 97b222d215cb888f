use std::fmt;

use crate::Rank;

/// Which launcher (or configuration) described this process's place in the job.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// Values given explicitly in code.
    Explicit,
    /// torchrun / torch elastic, or ranks started by hand with its variables.
    Torchrun,
    /// `commrun` (torchrun's variables, plus `COMM_LAUNCHER=commrun`).
    Commrun,
    /// The DeepSpeed launcher (torchrun variables plus `LOCAL_SIZE`).
    DeepSpeed,
    /// Open MPI's `mpirun`.
    OpenMpi,
    /// MPICH / Hydra / Intel MPI.
    Mpich,
    /// A PMIx launcher.
    Pmix,
    /// Slurm's `srun`.
    Slurm,
    /// Azure ML.
    AzureMl,
    /// Amazon SageMaker.
    SageMaker,
    /// Nothing found: a single process, rank 0 of 1.
    Single,
}

/// Who serves the rendezvous store at [`WorldInfo::master_addr`]:[`WorldInfo::master_port`].
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StoreKind {
    /// Rank 0 serves the library's own store there (the default).
    #[default]
    Rank0,
    /// The library's own store is already served there by another process (nobody binds).
    External,
    /// A torch `TCPStore` is served there (torchrun's agent store): every rank connects to it
    /// as a torch client and nobody binds the port.
    Torch,
}

/// Where a [`WorldInfo`] came from: the launcher and the variables that were read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorldSource {
    /// The launcher that won.
    pub launcher: Launcher,
    /// The `NAME=value` pairs (or settings) the values were read from.
    pub variables: Vec<String>,
}

/// This process's place in the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorldInfo {
    /// Global rank, `0..world_size`.
    pub rank: Rank,
    /// Number of processes in the job.
    pub world_size: u32,
    /// Rank among the processes on this host.
    pub local_rank: Rank,
    /// Number of processes on this host.
    pub local_world_size: u32,
    /// Address of rank 0's rendezvous store.
    pub master_addr: String,
    /// Port of the rendezvous store.
    pub master_port: u16,
    /// Who serves the store at `master_addr:master_port`.
    pub store: StoreKind,
    /// How this was found.
    pub source: WorldSource,
}

impl WorldInfo {
    /// A world of one process (rank 0 of 1), on localhost.
    pub fn single() -> Self {
        WorldInfo {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            store: StoreKind::Rank0,
            source: WorldSource { launcher: Launcher::Single, variables: Vec::new() },
        }
    }

    /// Whether every rank of the job runs on this host.
    pub fn all_local(&self) -> bool {
        self.local_world_size == self.world_size
    }
}

impl fmt::Display for WorldInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {}/{} (local {}/{}), store {}:{}, from {:?}",
            self.rank,
            self.world_size,
            self.local_rank,
            self.local_world_size,
            self.master_addr,
            self.master_port,
            self.source.launcher
        )?;
        match self.store {
            StoreKind::Rank0 => {}
            StoreKind::External => f.write_str(" (external store)")?,
            StoreKind::Torch => f.write_str(" (torch TCPStore)")?,
        }
        if !self.source.variables.is_empty() {
            write!(f, " [{}]", self.source.variables.join(" "))?;
        }
        Ok(())
    }
}
