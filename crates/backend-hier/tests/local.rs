//! The hierarchical composition over in-process groups (comm-test's `LocalWorld` as both the
//! world and each host's group): the conformance suite with the per-host reduction order, on
//! even and uneven hosts. The real thing (shm + MPI under mpirun, hosts in namespaces) is
//! comm-api's `tests/hier.rs`.

use std::sync::Arc;

use backend_hier::{HierBackend, HierOptions, Layout};
use comm_core::ops::AllReduce;
use comm_core::{Backend, Collective, DType, Group, HostBuffer, Rank, ReduceOp};
use comm_test::{reference, LocalWorld, SuiteConfig};
use futures::future::join_all;

/// Hosts of the given sizes, ranks in block order; every rank's hierarchical group.
async fn hier(sizes: &[usize], opts: HierOptions) -> (Vec<Arc<dyn Backend>>, Vec<Vec<Rank>>) {
    let n: usize = sizes.iter().sum();
    let world = LocalWorld::new(n as u32);
    let ids: Vec<String> = sizes.iter().enumerate().flat_map(|(h, &s)| vec![format!("boot@host{h}"); s]).collect();
    let mut locals: Vec<Arc<dyn Backend>> = Vec::new();
    for &s in sizes {
        locals.extend(LocalWorld::new(s as u32));
    }
    let made = join_all(world.into_iter().zip(locals).enumerate().map(|(r, (w, l))| {
        let layout = Layout::from_ids(&ids, r as Rank).unwrap();
        HierBackend::new(w, l, layout, opts.clone())
    }))
    .await;
    let hosts = Layout::from_ids(&ids, 0).unwrap().hosts().to_vec();
    (made.into_iter().map(|b| Arc::new(b.unwrap()) as Arc<dyn Backend>).collect(), hosts)
}

/// One thread drives every rank here: nothing may block it.
fn never_inline() -> HierOptions {
    HierOptions { inline_max: 0, ..HierOptions::default() }
}

async fn conformance(sizes: &[usize], rail_min: usize) {
    let (group, hosts) = hier(sizes, HierOptions { rail_min: Some(rail_min), ..never_inline() }).await;
    assert_eq!(group[0].backend_name(), "hier");
    let mut cfg = SuiteConfig::default();
    cfg.hosts = Some(hosts);
    let reports = comm_test::suite::run_all(group.clone(), &cfg).await.unwrap();
    assert!(reports.iter().all(|r| r.checks > 500), "{reports:?}");
    join_all(group.iter().map(|g| g.shutdown())).await.into_iter().collect::<Result<Vec<_>, _>>().unwrap();
}

#[tokio::test]
async fn conformance_two_hosts_of_two_over_rails() {
    // Every all_reduce of at least 2 elements takes the rails.
    conformance(&[2, 2], 0).await;
}

#[tokio::test]
async fn conformance_two_hosts_of_two_through_leaders() {
    conformance(&[2, 2], usize::MAX).await;
}

#[tokio::test]
async fn conformance_uneven_hosts() {
    conformance(&[3, 1], 0).await;
    conformance(&[1, 2, 3], 0).await;
}

#[tokio::test]
async fn sums_are_grouped_by_host_and_differ_from_rank_order() {
    // Values whose rank-order sum rounds differently from the per-host one: the suite's
    // comparison would not notice a backend that ignored the grouping.
    let vals: [f32; 4] = [1e-8, 1.0, -1.0, 1e-8];
    for rail_min in [0, usize::MAX] {
        let (group, hosts) = hier(&[2, 2], HierOptions { rail_min: Some(rail_min), ..never_inline() }).await;
        let ins: Vec<HostBuffer> = vals.iter().map(|&v| HostBuffer::from_slice(&[v, v])).collect();
        let works = group.iter().zip(&ins).map(|(g, b)| g.submit(AllReduce { buf: b.clone(), op: ReduceOp::Sum }));
        let got: Vec<HostBuffer> = join_all(works).await.into_iter().map(Result::unwrap).collect();
        let refs: Vec<&HostBuffer> = ins.iter().collect();
        let grouped = reference::reduce_grouped(&refs, ReduceOp::Sum, &hosts);
        assert_ne!(grouped, reference::reduce(&refs, ReduceOp::Sum));
        assert!(got.iter().all(|g| *g == grouped), "{got:?} vs {grouped:?}");
        // Host 0: 1e-8 + 1 rounds to 1; host 1: -1 + 1e-8 to -1; 0 in all (rank order: 1e-8).
        assert_eq!(grouped.as_slice::<f32>().unwrap(), &[0.0, 0.0]);
    }
}

#[tokio::test]
async fn the_caller_runs_small_ops_itself_when_idle() {
    // With inlining on, every rank's small all_reduce is done by the time submit returns; the
    // ranks need their own threads for that (each blocks until its peers arrive).
    let (group, _) = hier(&[2, 2], HierOptions::default()).await;
    let threads: Vec<_> = group
        .into_iter()
        .map(|g| {
            std::thread::spawn(move || {
                let w = g.submit(AllReduce { buf: HostBuffer::from_slice(&[1.0f32; 8]), op: ReduceOp::Avg });
                assert!(w.is_completed(), "ran inline");
                w.wait().unwrap()
            })
        })
        .collect();
    for t in threads {
        let got = t.join().unwrap();
        assert_eq!(got.dtype(), DType::F32);
        assert_eq!(got.as_slice::<f32>().unwrap(), &[1.0; 8]);
    }
}

#[tokio::test]
async fn sub_groups_of_one_host_stay_on_it() {
    let (group, _) = hier(&[2, 2], never_inline()).await;
    // Only host 1's ranks take part in a sub-group of host 1 (its host group's new_group).
    let subs = join_all(group[2..].iter().map(|g| g.new_group(&[2, 3]))).await;
    for g in &group[..2] {
        assert!(g.new_group(&[2, 3]).await.unwrap().is_none());
    }
    let subs: Vec<Arc<dyn Backend>> = subs.into_iter().map(|s| s.unwrap().unwrap()).collect();
    assert_eq!((subs[0].rank(), subs[1].rank(), subs[0].world_size()), (0, 1, 2));
    let works = subs
        .iter()
        .map(|s| s.submit(AllReduce { buf: HostBuffer::from_slice(&[s.rank() as i32 + 5]), op: ReduceOp::Sum }));
    for got in join_all(works).await {
        assert_eq!(got.unwrap().as_slice::<i32>().unwrap(), &[11]);
    }
}
