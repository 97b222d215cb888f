//! The shm backend as real separate processes: the conformance suite at world sizes 1–4, 8
//! and 16,
//! a 100 MiB all_reduce, and the bad-input and fault cases. Each test re-executes this test
//! binary once per rank (comm_test::multiprocess).

use std::time::{Duration, Instant};

use comm_api::{CommError, DType, HostBuffer, ReduceOp};
use comm_test::{multiprocess, SuiteConfig};

#[path = "common/shm.rs"]
mod shm;
use shm::{connect, leftovers, T};

#[path = "common/abort.rs"]
mod abort;

async fn suite(cfg: SuiteConfig) -> Result<(), String> {
    let pg = connect().await?;
    let report = comm_test::suite::run(pg.backend().clone(), &cfg).await?;
    if report.checks == 0 {
        return Err("the suite checked nothing".into());
    }
    println!("rank {}: {} checks in {:?}", report.rank, report.checks, report.elapsed);
    pg.shutdown().await.map_err(|e| e.to_string())?;
    let left = leftovers(std::process::id());
    if !left.is_empty() {
        return Err(format!("segments left in /dev/shm: {left:?}"));
    }
    Ok(())
}

#[test]
fn suite_world_1() {
    multiprocess::run(1, "suite_world_1", T, || suite(SuiteConfig::default()));
}

#[test]
fn suite_world_2() {
    multiprocess::run(2, "suite_world_2", T, || suite(SuiteConfig::default()));
}

// Many ranks oversubscribed on a small machine (16 processes on 2 cores): a reduced case
// list, so each stays within seconds (the full one takes a minute at 16 ranks here).
#[test]
fn suite_world_8() {
    multiprocess::run(8, "suite_world_8", T, || suite(SuiteConfig::many_ranks()));
}

#[test]
fn suite_world_16() {
    multiprocess::run(16, "suite_world_16", T, || suite(SuiteConfig::many_ranks()));
}

#[test]
fn suite_world_3() {
    multiprocess::run(3, "suite_world_3", T, || suite(SuiteConfig::default()));
}

#[test]
fn suite_world_4() {
    multiprocess::run(4, "suite_world_4", T, || suite(SuiteConfig::default()));
}

/// A small window forces every op through its chunked path at every world size.
#[test]
fn suite_small_window_world_3() {
    multiprocess::run_with_env(
        3,
        "suite_small_window_world_3",
        T,
        |_| {
            vec![
                ("COMM_SHM_WINDOW".into(), "4K".into()),
                ("COMM_SHM_SLOT".into(), "4K".into()),
                ("COMM_SHM_SMALL_MAX".into(), "1K".into()),
            ]
        },
        || suite(SuiteConfig::quick()),
    );
}

#[test]
fn all_reduce_100_mib() {
    multiprocess::run(2, "all_reduce_100_mib", T, || async {
        let pg = connect().await?;
        let n = 100 << 20 >> 2; // 100 MiB of f32
        let rank = pg.rank() as usize;
        let data: Vec<f32> = (0..n).map(|i| ((i + rank) % 1024) as f32).collect();
        let out = pg.all_reduce(HostBuffer::from_slice(&data), ReduceOp::Sum).await.map_err(|e| e.to_string())?;
        let out = out.as_slice::<f32>().map_err(|e| e.to_string())?;
        for (i, &x) in out.iter().enumerate() {
            let want = ((i % 1024) + ((i + 1) % 1024)) as f32;
            if x != want {
                return Err(format!("element {i}: {x} != {want}"));
            }
        }
        Ok(())
    });
}

fn expect_err(r: Result<HostBuffer, CommError>, what: &str) -> Result<CommError, String> {
    match r {
        Ok(_) => Err(format!("{what}: expected an error, got a result")),
        Err(e) => Ok(e),
    }
}

/// Ranks that disagree on dtype, length or op get Mismatch (never a hang or garbage), and
/// nothing is left in /dev/shm.
#[test]
fn mismatches_across_ranks() {
    multiprocess::run(2, "mismatches_across_ranks", T, || async {
        let rank = pg_rank();
        let world = connect().await?;
        for case in 0..6 {
            // A fresh sub-group per case: a mismatch poisons only the group it happened in.
            let pg = world.new_group(&[0, 1]).await.map_err(|e| e.to_string())?.ok_or("not a member")?;
            let r = match (case, rank) {
                (0, 0) => pg.all_reduce(HostBuffer::zeroed(DType::F32, 8), ReduceOp::Sum).await,
                (0, _) => pg.all_reduce(HostBuffer::zeroed(DType::F64, 8), ReduceOp::Sum).await,
                (1, 0) => pg.all_reduce(HostBuffer::zeroed(DType::F32, 8), ReduceOp::Sum).await,
                (1, _) => pg.all_reduce(HostBuffer::zeroed(DType::F32, 9), ReduceOp::Sum).await,
                (2, 0) => pg.all_reduce(HostBuffer::zeroed(DType::F32, 8), ReduceOp::Sum).await,
                (2, _) => pg.broadcast(HostBuffer::zeroed(DType::F32, 8), 0).await,
                // Data small enough to travel in the step header: there too a different op,
                // and one rank's op carried while the other's is not.
                (3, 0) => pg.all_reduce(HostBuffer::zeroed(DType::F32, 2), ReduceOp::Sum).await,
                (3, _) => pg.all_reduce(HostBuffer::zeroed(DType::F32, 2), ReduceOp::Max).await,
                (4, 0) => pg.all_reduce(HostBuffer::zeroed(DType::F32, 2), ReduceOp::Sum).await,
                (4, _) => pg.all_reduce(HostBuffer::zeroed(DType::F32, 16), ReduceOp::Sum).await,
                // Uneven all_to_all whose splits disagree: rank 0 sends 3 to rank 1, which
                // expects 2 from it.
                (_, 0) => pg.all_to_all_single_uneven(HostBuffer::zeroed(DType::I32, 4), vec![1, 3], vec![1, 2]).await,
                (_, _) => pg.all_to_all_single_uneven(HostBuffer::zeroed(DType::I32, 4), vec![2, 2], vec![2, 2]).await,
            };
            let e = expect_err(r, "mismatch")?;
            let msg = e.to_string();
            if !matches!(e, CommError::Mismatch { .. } | CommError::PeerLost { .. }) || !msg.contains("rank") {
                return Err(format!("case {case}: expected Mismatch naming a rank, got {msg}"));
            }
            println!("case {case}: {msg}");
            // The group is poisoned: later ops fail fast.
            match pg.barrier().await {
                Err(CommError::Poisoned { .. }) => {}
                other => return Err(format!("case {case}: expected Poisoned after a mismatch, got {other:?}")),
            }
            let _ = pg.shutdown().await;
        }
        // The parent group was not touched by its sub-groups' failures.
        world.barrier().await.map_err(|e| format!("parent group after sub-group mismatches: {e}"))?;
        if !leftovers(std::process::id()).is_empty() {
            return Err("segments left in /dev/shm".into());
        }
        Ok(())
    });
}

fn pg_rank() -> u32 {
    std::env::var("RANK").ok().and_then(|r| r.parse().ok()).unwrap_or(0)
}

/// A rank that exits before a collective: the others get PeerLost quickly (not after the
/// 300 s default timeout), naming the rank.
#[test]
fn peer_exits_before_collective() {
    multiprocess::run(3, "peer_exits_before_collective", T, || async {
        let pg = connect().await?;
        pg.barrier().await.map_err(|e| e.to_string())?;
        if pg.rank() == 2 {
            multiprocess::dying_on_purpose();
            std::process::exit(0); // leaves without a word
        }
        let t = Instant::now();
        let e = expect_err(pg.all_reduce(HostBuffer::zeroed(DType::I32, 1000), ReduceOp::Sum).await, "peer exit")?;
        let msg = e.to_string();
        if !matches!(e, CommError::PeerLost { rank: 2, .. } | CommError::PeerLost { .. }) || !msg.contains('2') {
            return Err(format!("expected PeerLost naming rank 2, got {msg}"));
        }
        if t.elapsed() > Duration::from_secs(10) {
            return Err(format!("took {:?} to notice", t.elapsed()));
        }
        println!("rank {}: {msg} after {:?}", pg.rank(), t.elapsed());
        Ok(())
    });
}

/// `pg.abort(reason)` on one rank fails the others' op in flight with `PeerLost` naming the
/// rank and the reason (shortly after, not at the timeout), `pg.error()` says it on every
/// rank, every rank's failure hook runs once, and later ops fail fast.
#[test]
fn abort_reaches_every_rank() {
    multiprocess::run(3, "abort_reaches_every_rank", T, || async {
        let pg = connect().await?;
        abort::abort_scenario(&pg).await
    });
}

/// A rank killed with SIGKILL in the middle of a long stream of ops.
#[test]
fn peer_killed_mid_job() {
    multiprocess::run(2, "peer_killed_mid_job", T, || async {
        let pg = connect().await?;
        let mut buf = HostBuffer::zeroed(DType::F32, 1 << 20);
        for i in 0.. {
            if pg.rank() == 1 && i == 20 {
                multiprocess::dying_on_purpose();
                let _ = std::process::Command::new("kill").args(["-9", &std::process::id().to_string()]).status();
                std::thread::sleep(Duration::from_secs(5));
            }
            match pg.all_reduce(buf, ReduceOp::Sum).await {
                Ok(b) => buf = b,
                Err(e) => {
                    let msg = e.to_string();
                    if !matches!(e, CommError::PeerLost { rank: 1, .. }) {
                        return Err(format!("expected PeerLost(1), got {msg}"));
                    }
                    println!("rank 0 after {i} ops: {msg}");
                    return Ok(());
                }
            }
        }
        unreachable!()
    });
}

/// The timeout applies when a peer is alive but never joins.
#[test]
fn timeout_when_peer_never_joins() {
    multiprocess::run_with_env(
        2,
        "timeout_when_peer_never_joins",
        T,
        |_| vec![("COMM_TIMEOUT".into(), "1.5".into())],
        || async {
            let pg = connect().await?;
            if pg.rank() == 1 {
                // Alive but busy elsewhere: wait for rank 0's verdict, then leave.
                std::thread::sleep(Duration::from_secs(4));
                return Ok(());
            }
            let t = Instant::now();
            let e = expect_err(pg.broadcast(HostBuffer::zeroed(DType::U8, 3), 0).await, "timeout")?;
            let msg = e.to_string();
            if !matches!(e, CommError::Timeout { .. }) || !msg.contains("rank 1") {
                return Err(format!("expected a Timeout naming rank 1, got {msg}"));
            }
            if t.elapsed() < Duration::from_millis(1400) || t.elapsed() > Duration::from_secs(4) {
                return Err(format!("timed out after {:?}, configured 1.5 s", t.elapsed()));
            }
            Ok(())
        },
    );
}

/// A panic in rank 1's backend (injected through the `COMM_FAULT_INJECT` test hook) while it
/// runs `op`: rank 1's op fails with `Poisoned` naming the panic, every later op too, and its
/// shutdown completes; rank 0 gets `PeerLost` naming rank 1 and the panic, at once (not at the
/// timeout). `len` elements decide the path: small ops run inline on the caller's thread,
/// large ones on the worker.
async fn panic_is_contained(op: &str, len: usize) -> Result<(), String> {
    let pg = connect().await?;
    pg.barrier().await.map_err(|e| e.to_string())?;
    let t = Instant::now();
    let r = match op {
        "all_reduce" => pg.all_reduce(HostBuffer::zeroed(DType::F32, len), ReduceOp::Sum).await,
        _ => pg.broadcast(HostBuffer::zeroed(DType::F32, len), 0).await,
    };
    let e = expect_err(r, "the op that panicked")?;
    let msg = e.to_string();
    if t.elapsed() > Duration::from_secs(10) {
        return Err(format!("took {:?} to fail: {msg}", t.elapsed()));
    }
    match (pg.rank(), &e) {
        (1, CommError::Poisoned { .. }) if msg.contains("injected panic") || msg.contains("panicked") => {}
        (0, CommError::PeerLost { rank: 1, .. }) if msg.contains("panicked") => {}
        _ => return Err(format!("rank {}: unexpected error {e:?}", pg.rank())),
    }
    println!("rank {}: {msg} after {:?}", pg.rank(), t.elapsed());
    // Everything later fails fast, small (inline) and large (worker) alike...
    for later in [4usize, 1 << 20] {
        let r = pg.all_reduce(HostBuffer::zeroed(DType::F32, later), ReduceOp::Sum);
        match tokio::time::timeout(Duration::from_secs(10), r).await {
            Ok(Err(CommError::Poisoned { .. })) => {}
            other => return Err(format!("rank {}: op after the panic: {other:?}", pg.rank())),
        }
    }
    // ...and shutdown completes.
    match tokio::time::timeout(Duration::from_secs(10), pg.shutdown()).await {
        Ok(Ok(())) => {}
        other => return Err(format!("rank {}: shutdown after the panic: {other:?}", pg.rank())),
    }
    if !leftovers(std::process::id()).is_empty() {
        return Err("segments left in /dev/shm".into());
    }
    Ok(())
}

fn inject_on_rank_1(op: &'static str) -> impl Fn(u32) -> Vec<(String, String)> {
    move |rank| {
        let mut env = vec![("COMM_TIMEOUT".into(), "60".into())];
        if rank == 1 {
            env.push(("COMM_FAULT_INJECT".into(), format!("panic:{op}")));
        }
        env
    }
}

#[test]
fn worker_panic_is_contained() {
    multiprocess::run_with_env(2, "worker_panic_is_contained", T, inject_on_rank_1("all_reduce"), || {
        panic_is_contained("all_reduce", 4 << 20)
    });
}

#[test]
fn inline_panic_is_contained() {
    multiprocess::run_with_env(2, "inline_panic_is_contained", T, inject_on_rank_1("broadcast"), || {
        panic_is_contained("broadcast", 16)
    });
}

/// Segments in /dev/shm whose creating process is gone.
fn orphaned_segments() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/dev/shm") else { return Vec::new() };
    dir.flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| {
            let pid = n.strip_prefix("commshm-").and_then(|r| r.split('-').next()).and_then(|p| p.parse::<u32>().ok());
            pid.is_some_and(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .map_or(true, |s| s.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z')))
            })
        })
        .collect()
}

/// A rank killed (SIGKILL) during the rendezvous, after creating and publishing its segment and
/// before unlinking it: the survivors fail at once with PeerLost naming it (not at the timeout)
/// and remove the segment it left in /dev/shm.
#[test]
fn peer_killed_during_rendezvous() {
    multiprocess::run_with_env(
        3,
        "peer_killed_during_rendezvous",
        T,
        |rank| {
            let mut env = vec![("COMM_TIMEOUT".into(), "60".into())];
            if rank == 2 {
                env.push(("COMM_FAULT_INJECT".into(), "kill:rendezvous".into()));
            }
            env
        },
        || async {
            if pg_rank() == 2 {
                multiprocess::dying_on_purpose();
            }
            let t = Instant::now();
            let e = match connect().await {
                Ok(_) => return Err("the rendezvous succeeded without rank 2".into()),
                Err(e) => e,
            };
            // Either rank 2's death itself, or another survivor that saw it first and gave up.
            let named =
                e.contains("peer rank 2 lost") || (e.contains("gave up the rendezvous") && e.contains("rank 2"));
            if !named || t.elapsed() > Duration::from_secs(10) {
                return Err(format!("expected PeerLost naming rank 2 within 10 s, got after {:?}: {e}", t.elapsed()));
            }
            println!("rank {}: {e} after {:?}", pg_rank(), t.elapsed());
            // Rank 0 serves the store: it stays a moment so the others see the same failure
            // rather than the store going away.
            tokio::time::sleep(Duration::from_secs(2)).await;
            let left = orphaned_segments();
            if !left.is_empty() {
                return Err(format!("segments of dead processes left in /dev/shm: {left:?}"));
            }
            Ok(())
        },
    );
}
