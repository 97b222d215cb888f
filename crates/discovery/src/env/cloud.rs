//! AzureML and SageMaker: Open MPI jobs that DeepSpeed recognises by a marker variable.

use comm_core::{CommError, Launcher, StoreKind, WorldInfo};

use super::mpi::{has_ompi, read_ompi};
use super::vars::{mpi_master_addr, world, Recorder, Vars};
use super::{AML_MULTI_NODE_PORT, AML_SINGLE_NODE_PORT, DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT};

/// AzureML, as DeepSpeed's `patch_aml_env_for_torch_nccl_backend` reads it.
pub(super) fn azureml(vars: &Vars) -> Option<Result<WorldInfo, CommError>> {
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
pub(super) fn sagemaker(vars: &Vars) -> Option<Result<WorldInfo, CommError>> {
    (vars.has("SM_TRAINING_ENV") && has_ompi(vars)).then(|| {
        let mut r = Recorder::new(vars);
        let place = read_ompi(&mut r)?;
        let addr = mpi_master_addr(&mut r, place.1, place.3)?;
        let port = r.port("MASTER_PORT")?.unwrap_or(DEFAULT_MASTER_PORT);
        Ok(world(r, Launcher::SageMaker, place, addr, port, StoreKind::Rank0))
    })
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::super::from_vars;
    use comm_core::Launcher;

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
        assert_eq!(from_vars(with(SAGEMAKER, &["MASTER_ADDR"])).unwrap().master_addr, "");
    }
}
