//! The MPI backend without a launcher: a singleton world of one rank (MPI can be initialised
//! once per process, so this binary holds a single test).

use std::sync::Arc;

use backend_mpi::{MpiBackend, MpiOptions};
use comm_core::{Backend, CommError, Group};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn singleton_world_passes_the_suite_and_finalises_once() {
    let opts = MpiOptions { abort_on_panic: false, ..MpiOptions::default() };
    let world = MpiBackend::init(opts.clone()).await.expect("MPI init as a singleton");
    assert_eq!((world.rank(), world.world_size(), world.local_world_size()), (0, 1, 1));
    let found = comm_core::WorldInfo::single();
    assert_eq!(world.reconcile(&found).unwrap().world_size, 1);

    let b: Arc<dyn Backend> = Arc::new(world.clone());
    let report = comm_test::suite::run(b, &comm_test::SuiteConfig::default()).await.unwrap_or_else(|e| panic!("{e}"));
    println!("singleton: {} checks passed in {:.2?}", report.checks, report.elapsed);
    assert!(report.checks > 500, "{report:?}");

    // A second world group in the same process works, and is independent.
    let second = MpiBackend::init(opts.clone()).await.unwrap();
    let sum = comm_core::Collective::<comm_core::ops::AllReduce>::submit(
        &second,
        comm_core::ops::AllReduce { buf: comm_core::HostBuffer::from_slice(&[1.5f32]), op: comm_core::ReduceOp::Sum },
    )
    .await
    .unwrap();
    assert_eq!(sum.to_vec::<f32>().unwrap(), [1.5]);

    // Shutting a world group down finalises MPI: later ops and inits fail cleanly.
    world.shutdown().await.unwrap();
    world.shutdown().await.unwrap();
    let after = comm_core::Collective::<comm_core::ops::Barrier>::submit(&second, comm_core::ops::Barrier).await;
    assert!(matches!(after, Err(CommError::Shutdown(_) | CommError::Unavailable { .. })), "{after:?}");
    let again = MpiBackend::init(opts).await.unwrap_err();
    assert!(matches!(again, CommError::Unavailable { .. }) && again.to_string().contains("finalised"), "{again}");
}
