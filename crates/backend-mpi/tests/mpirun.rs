//! The MPI backend under `mpirun`: the conformance suite at 1–4 ranks, the native reduction
//! mode, and faults (mismatched calls, a rank that never joins, a killed rank, a panic).
//!
//! Each test re-executes this test binary under `mpirun` with `COMM_MPI_CHILD=<scenario>`;
//! the `child` test runs the scenario on every rank (and does nothing otherwise). Tests skip,
//! with a message, when `mpirun` is not installed. Jobs run one at a time.
//!
//! Against MPICH (Debian: `mpich libmpich-dev`), in a target directory of its own because
//! mpi-sys does not rebuild when `MPICC` changes:
//! `MPICC=mpicc.mpich MPIRUN=mpiexec.mpich CARGO_TARGET_DIR=target-mpich cargo test -p backend-mpi`.

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use backend_mpi::{MpiBackend, MpiOptions};
use comm_core::ops::{AllGather, AllReduce, AllToAll, Barrier, Broadcast, RecvFrom, SendTo};
use comm_core::{Backend, Collective, CommError, Group, HostBuffer, ReduceOp};
use comm_test::mpirun::{Job, Launch};

const CHILD: &str = "COMM_MPI_CHILD";

// ---------------------------------------------------------------------------------------------
// Parent side

/// Runs `scenario` on `np` ranks; `None` when mpirun is not installed.
fn job(np: u32, scenario: &str, envs: &[(&str, &str)], limit: Duration) -> Option<Job> {
    comm_test::mpirun::run(Launch {
        np,
        child: (CHILD, scenario),
        envs,
        limit,
        open_mpi_args: &[],
        wrapper: Vec::new(),
        summary: &["-OK", "KILL-", "calling MPI_Abort"],
    })
}

fn lines<'a>(job: &'a Job, tag: &str) -> Vec<&'a str> {
    job.lines(tag)
}

/// Runs `scenario` on `np` ranks (within `limit`): the job must succeed and every rank print
/// `ok`.
fn every_rank_ok(np: u32, scenario: &str, envs: &[(&str, &str)], limit: Duration, ok: &str) {
    let Some(job) = job(np, scenario, envs, limit) else { return };
    assert_eq!(job.code, Some(0), "the job failed: {job}");
    assert_eq!(lines(&job, ok).len(), np as usize, "every rank reports {ok}: {job}");
}

fn conformance(np: u32, envs: &[(&str, &str)]) {
    every_rank_ok(np, "suite", envs, Duration::from_secs(600), "SUITE-OK");
}

#[test]
fn conformance_1_rank() {
    conformance(1, &[]);
}

#[test]
fn conformance_2_ranks() {
    conformance(2, &[]);
}

/// Three ranks (uneven slices) with tiny thresholds, so every reduction of the suite takes
/// the large, chunked path, many chunks per op.
#[test]
fn conformance_3_ranks_chunked() {
    conformance(3, &[("COMM_MPI_SMALL_MAX", "1K"), ("COMM_MPI_CHUNK", "4K")]);
}

#[test]
fn conformance_4_ranks() {
    conformance(4, &[]);
}

/// Eight ranks on two cores, a reduced case list (`SuiteConfig::many_ranks`).
#[test]
fn conformance_8_ranks() {
    conformance(8, &[("COMM_TEST_SUITE", "many")]);
}

/// Four ranks with a large gather threshold, so the suite's large all_reduces (100 003
/// elements) send their whole inputs beside the header exchange.
#[test]
fn conformance_4_ranks_inputs_beside_the_exchange() {
    conformance(4, &[("COMM_MPI_SMALL_MAX", "4M")]);
}

/// Without the header exchange (`COMM_MPI_CHECK=0`) every op is MPI's nonblocking call.
#[test]
fn conformance_2_ranks_unchecked() {
    conformance(2, &[("COMM_MPI_CHECK", "0")]);
}

/// MPI's own reductions (built-in ops for f32/f64, our user-defined ops for f16/bf16) are
/// exact at two ranks (one combination per element), so the suite passes there too.
#[test]
fn conformance_native_reductions_2_ranks() {
    conformance(2, &[("COMM_MPI_REDUCTION", "native")]);
}

/// DeepSpeed's isend blocked until matched (PR 8303): here rank 0's 8 MiB isend is in flight
/// while both ranks run collectives, and rank 1 posts the matching recv only after them. Then
/// messages on the largest user tag cross a collective.
#[test]
fn an_isend_does_not_block_collectives() {
    every_rank_ok(2, "overlap", &[], Duration::from_secs(120), "OVERLAP-OK");
}

#[test]
fn mismatched_calls_are_errors_not_aborts() {
    let Some(job) = job(2, "mismatch", &[], Duration::from_secs(120)) else { return };
    assert_eq!(job.code, Some(0), "mismatches must not abort the job: {job}");
    for want in ["size", "inline", "whole", "op", "splits", "truncated", "long", "short", "dtype", "poisoned"] {
        let seen = lines(&job, &format!("MISMATCH-OK {want}"));
        let expect = if matches!(want, "truncated" | "long" | "short" | "dtype") { 1 } else { 2 };
        assert_eq!(seen.len(), expect, "`{want}` reported by {expect} rank(s): {job}");
    }
}

/// A receive that fails poisons its group before it completes (so the receiver's next op
/// cannot pair with the sender's), and the sender learns of it in milliseconds, not at its
/// timeout: its next collective fails with `PeerLost` naming the receiver.
#[test]
fn a_failed_receive_poisons_first_and_tells_the_sender() {
    every_rank_ok(2, "told", &[], Duration::from_secs(120), "TOLD-OK");
}

#[test]
fn small_ops_on_the_callers_thread_keep_their_order() {
    every_rank_ok(3, "lanes", &[], Duration::from_secs(120), "LANES-OK");
}

/// Native mode: large all_reduces are MPI's blocking call after the exchange, on whichever
/// thread runs them; every rank must make the same call whatever thread that is.
#[test]
fn small_ops_on_the_callers_thread_keep_their_order_in_native_mode() {
    every_rank_ok(3, "lanes", &[("COMM_MPI_REDUCTION", "native")], Duration::from_secs(120), "LANES-OK");
}

#[test]
fn small_sends_and_receives_run_on_the_callers_thread_in_order() {
    every_rank_ok(2, "p2p", &[], Duration::from_secs(120), "P2P-OK");
}

#[test]
fn collectives_of_two_groups_in_opposite_orders_complete() {
    every_rank_ok(2, "crossed", &[], Duration::from_secs(120), "CROSSED-OK");
}

#[test]
fn a_small_op_waiting_for_a_late_peer_does_not_block_its_caller() {
    every_rank_ok(2, "late", &[], Duration::from_secs(120), "LATE-OK");
}

#[test]
fn shrink_says_why_it_cannot_at_once() {
    every_rank_ok(2, "shrink", &[], Duration::from_secs(120), "SHRINK-OK");
}

#[test]
fn a_rank_that_never_joins_times_out() {
    let Some(job) = job(2, "timeout", &[], Duration::from_secs(120)) else { return };
    let ok = lines(&job, "TIMEOUT-OK");
    assert_eq!(ok.len(), 1, "rank 0 reports the timeout: {job}");
    assert!(job.elapsed < Duration::from_secs(60), "the job ended: {job}");
}

#[test]
fn a_killed_rank_ends_the_job() {
    let Some(job) = job(3, "kill", &[], Duration::from_secs(120)) else { return };
    assert_ne!(job.code, Some(0), "a killed rank fails the job: {job}");
    assert!(!lines(&job, "KILL-BEFORE").is_empty(), "rank 2 got as far as killing itself: {job}");
    // The timeout of the survivors is 10 s; mpirun usually ends the job sooner.
    assert!(job.elapsed < Duration::from_secs(45), "the job ended within the timeout: {job}");
}

#[test]
fn a_panic_aborts_the_job_at_once() {
    let Some(job) = job(2, "panic", &[], Duration::from_secs(120)) else { return };
    assert_ne!(job.code, Some(0), "a panic fails the job: {job}");
    assert!(!lines(&job, "calling MPI_Abort").is_empty(), "the panic hook aborted: {job}");
    // Rank 0 waits in a collective with a 60 s timeout: the abort must end it long before.
    assert!(job.elapsed < Duration::from_secs(30), "ended quickly: {job}");
}

#[test]
fn a_panic_is_contained_without_abort_on_panic() {
    let envs = [("COMM_MPI_ABORT_ON_PANIC", "0"), ("COMM_FAULT_INJECT", "panic:all_reduce")];
    every_rank_ok(2, "contained", &envs, Duration::from_secs(120), "CONTAINED-OK");
}

/// Ranks bound to a core each (each sees one CPU) still poll: the node's ranks have a core
/// apiece together. Ranks bound to one shared core do not.
#[test]
fn ranks_bound_to_their_own_cores_poll() {
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        println!("skipped: fewer than two CPUs to bind ranks to");
        return;
    }
    for (cpu, spins) in [("$R", "1"), ("0", "0")] {
        // Each rank binds itself to CPU `cpu` ($R: its rank) before it starts.
        let bind = format!("R=${{OMPI_COMM_WORLD_RANK:-${{PMI_RANK:-0}}}}; exec taskset -c {cpu} \"$0\" \"$@\"");
        let Some(job) = comm_test::mpirun::run(Launch {
            np: 2,
            child: (CHILD, "bound"),
            envs: &[("COMM_TEST_SPINS", spins)],
            limit: Duration::from_secs(120),
            open_mpi_args: &[],
            wrapper: ["sh", "-c", &bind].iter().map(Into::into).collect(),
            summary: &["-OK"],
        }) else {
            return;
        };
        assert_eq!(job.code, Some(0), "{job}");
        assert_eq!(lines(&job, "BOUND-OK").len(), 2, "{job}");
    }
}

// ---------------------------------------------------------------------------------------------
// Child side (one process per rank)

#[test]
fn child() {
    let Ok(scenario) = std::env::var(CHILD) else { return };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let code = rt.block_on(async {
        match scenario.as_str() {
            "suite" => suite().await,
            "mismatch" => mismatch().await,
            "told" => told().await,
            "lanes" => lanes().await,
            "late" => late().await,
            "p2p" => p2p().await,
            "crossed" => crossed().await,
            "overlap" => overlap().await,
            "timeout" => timeout().await,
            "kill" => kill().await,
            "panic" => panic().await,
            "contained" => contained().await,
            "bound" => bound().await,
            "shrink" => shrink().await,
            other => {
                eprintln!("unknown scenario {other}");
                2
            }
        }
    });
    if code != 0 {
        std::process::exit(code);
    }
}

/// MPI cannot shrink a communicator here: every rank gets the reason at once, and the group
/// still works.
async fn shrink() -> i32 {
    let w = MpiBackend::init(opts(Duration::from_secs(20))).await.unwrap();
    let t = Instant::now();
    let e = w.shrink().await.unwrap_err();
    let took = t.elapsed();
    assert!(took < Duration::from_secs(1), "shrink took {took:?}");
    assert!(matches!(e, CommError::Unavailable { backend: "mpi", .. }) && e.to_string().contains("ULFM"), "{e}");
    let sum = w.submit(AllReduce { buf: f32s(&[1.0]), op: ReduceOp::Sum }).await.unwrap();
    assert_eq!(sum.to_vec::<f32>().unwrap(), [w.world_size() as f32]);
    println!("SHRINK-OK rank {} in {took:?}", w.rank());
    w.shutdown().await.unwrap();
    0
}

async fn bound() -> i32 {
    let world = MpiBackend::init(MpiOptions::from_env().unwrap()).await.expect("init");
    let own = comm_core::cpus::CpuSet::allowed().map(|c| c.len());
    let want = std::env::var("COMM_TEST_SPINS").unwrap() == "1";
    let code = if own != Some(1) {
        eprintln!("rank {}: not bound to one CPU ({own:?})", world.rank());
        1
    } else if (world.spin() > Duration::ZERO) != want {
        eprintln!("rank {}: spin {:?}, expected {}", world.rank(), world.spin(), if want { "some" } else { "none" });
        1
    } else {
        println!("BOUND-OK rank {} spin {:?}", world.rank(), world.spin());
        0
    };
    world.shutdown().await.expect("shutdown");
    code
}

fn opts(timeout: Duration) -> MpiOptions {
    MpiOptions { timeout, ..MpiOptions::from_env().unwrap() }
}

async fn suite() -> i32 {
    let world = MpiBackend::init(MpiOptions::from_env().unwrap()).await.expect("init");
    let b: Arc<dyn Backend> = Arc::new(world.clone());
    let code = comm_test::mpirun::suite_child(b, &comm_test::SuiteConfig::from_env()).await;
    world.shutdown().await.expect("shutdown");
    code
}

/// Every rank's worker panics when it starts an all_reduce (`COMM_FAULT_INJECT`), with
/// `abort_on_panic` off: the op fails with `Poisoned`, later ops too, and shutdown completes.
async fn contained() -> i32 {
    let world = MpiBackend::init(opts(Duration::from_secs(20))).await.expect("init");
    let me = world.rank();
    let r = world.submit(AllReduce { buf: f32s(&[1.0; 8]), op: ReduceOp::Sum }).await;
    let ok1 = matches!(&r, Err(CommError::Poisoned { cause }) if cause.contains("panicked"));
    let later = world.submit(Barrier).await;
    let ok2 = matches!(&later, Err(CommError::Poisoned { cause }) if cause.contains("panicked"));
    let shut = tokio::time::timeout(Duration::from_secs(20), world.shutdown()).await;
    if ok1 && ok2 && matches!(shut, Ok(Ok(()))) {
        println!("CONTAINED-OK rank {me}");
        0
    } else {
        eprintln!("CONTAINED-FAILED rank {me}: {r:?} / {later:?} / {shut:?}");
        1
    }
}

/// Small collectives (which a caller runs on its own thread when the group has none queued in
/// the worker) interleaved with large ones (which go to the worker) and with point-to-point
/// messages in flight, submitted without waiting: every result must be the one of the op in
/// its submission order.
async fn lanes() -> i32 {
    let w = MpiBackend::init(opts(Duration::from_secs(60))).await.unwrap();
    let (me, n) = (w.rank(), w.world_size());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    for i in 0..40u32 {
        let big = w.submit(AllReduce { buf: f32s(&vec![me as f32; 1 << 16]), op: ReduceOp::Sum });
        let recv = w.submit(RecvFrom { buf: f32s(&[0.0; 3]), src: prev, tag: i });
        let small = w.submit(AllReduce { buf: f32s(&[(me * 100 + i) as f32; 4]), op: ReduceOp::Sum });
        let send = w.submit(SendTo { buf: f32s(&[i as f32; 3]), dst: next, tag: i });
        let bcast = w.submit(Broadcast { buf: f32s(&[me as f32 + i as f32; 8]), root: i % n });
        let gathered = w.submit(AllGather { input: f32s(&[me as f32, i as f32]), output: None });
        let sum: f32 = (0..n).map(|r| r as f32).sum();
        assert!(big.await.unwrap().to_vec::<f32>().unwrap().iter().all(|&x| x == sum), "big #{i}");
        let want = (0..n).map(|r| (r * 100 + i) as f32).sum::<f32>();
        assert_eq!(small.await.unwrap().to_vec::<f32>().unwrap(), [want; 4], "small #{i}");
        assert_eq!(bcast.await.unwrap().to_vec::<f32>().unwrap(), [(i % n + i) as f32; 8], "broadcast #{i}");
        let g: Vec<f32> = (0..n).flat_map(|r| [r as f32, i as f32]).collect();
        assert_eq!(gathered.await.unwrap().output.to_vec::<f32>().unwrap(), g, "all_gather #{i}");
        send.await.unwrap();
        assert_eq!(recv.await.unwrap().to_vec::<f32>().unwrap(), [i as f32; 3], "recv #{i}");
    }
    // Then small ops alone, each awaited (the direct path every time), and a barrier.
    for i in 0..200u32 {
        let got = w.submit(AllReduce { buf: f32s(&[i as f32]), op: ReduceOp::Max }).await.unwrap();
        assert_eq!(got.to_vec::<f32>().unwrap(), [i as f32]);
    }
    Collective::<Barrier>::submit(&w, Barrier).await.unwrap();
    println!("LANES-OK rank {me}");
    w.shutdown().await.unwrap();
    0
}

/// Small sends and receives run on the caller's thread while none of the group's
/// point-to-point ops is with the worker: an eager send is done when `submit` returns (0 of 100
/// were, through the worker). A large message, which the worker handles, and the small ones
/// posted after it arrive in order.
async fn p2p() -> i32 {
    let w = MpiBackend::init(opts(Duration::from_secs(60))).await.unwrap();
    let (me, n) = (w.rank(), w.world_size());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let mut inline = 0;
    for i in 0..100u32 {
        let send = w.submit(SendTo { buf: f32s(&[i as f32; 2]), dst: next, tag: 7 });
        inline += usize::from(send.is_completed());
        let got = w.submit(RecvFrom { buf: f32s(&[0.0; 2]), src: prev, tag: 7 }).await.unwrap();
        assert_eq!(got.to_vec::<f32>().unwrap(), [i as f32; 2], "message #{i}");
        send.await.unwrap();
    }
    assert!(inline >= 80, "only {inline} of 100 small sends were done when submit returned");
    // A receive the worker could not match yet must not let a later one with the same source
    // and tag take the message that arrives next.
    let big: Vec<f32> = (0..100_000).map(|x| x as f32).collect();
    let msgs = [vec![1.0f32], big, vec![2.0]];
    for _ in 0..20 {
        let sends: Vec<_> = msgs.iter().map(|m| w.submit(SendTo { buf: f32s(m), dst: next, tag: 9 })).collect();
        let recvs: Vec<_> =
            msgs.iter().map(|m| w.submit(RecvFrom { buf: f32s(&vec![0.0; m.len()]), src: prev, tag: 9 })).collect();
        for (r, m) in recvs.into_iter().zip(&msgs) {
            assert_eq!(&r.await.unwrap().to_vec::<f32>().unwrap(), m);
        }
        for s in sends {
            s.await.unwrap();
        }
    }
    println!("P2P-OK rank {me} ({inline} of 100 sends done in submit)");
    w.shutdown().await.unwrap();
    0
}

/// Two groups of the same ranks whose collectives the ranks submit in opposite orders, each
/// behind a large broadcast that the worker runs (so both reach the worker): a nonblocking API
/// must complete both, as MPI's nonblocking collectives on two communicators do, whichever
/// order each rank chose. (Were both workers to make MPI's blocking calls, each could block in
/// its first group's call, waiting for the peer's part queued behind the peer's.)
async fn crossed() -> i32 {
    let w = MpiBackend::init(opts(Duration::from_secs(30))).await.unwrap();
    let (me, n) = (w.rank(), w.world_size());
    let all: Vec<u32> = (0..n).collect();
    let sub = w.new_group(&all).await.unwrap().unwrap();
    let sum: f32 = (0..n).map(|r| r as f32).sum();
    for (i, len) in [4usize, 1 << 10, 1 << 18].repeat(30).into_iter().enumerate() {
        let big = 1 << 19;
        let b1 = w.submit(Broadcast { buf: f32s(&vec![me as f32; big]), root: 0 });
        let b2 = Collective::<Broadcast>::submit(&*sub, Broadcast { buf: f32s(&vec![me as f32; big]), root: 0 });
        let ar = |g: &dyn Backend| {
            Collective::<AllReduce>::submit(g, AllReduce { buf: f32s(&vec![me as f32; len]), op: ReduceOp::Sum })
        };
        let ag = |g: &dyn Backend| {
            Collective::<AllGather>::submit(g, AllGather { input: f32s(&vec![me as f32; len]), output: None })
        };
        // all_reduce, then all_gather, on the world and the sub-group: in that order on even
        // ranks, the groups swapped on odd ones.
        let (x, y, u, v) = if me % 2 == 0 {
            let (x, y) = (ar(&w), ar(&*sub));
            (x, y, ag(&w), ag(&*sub))
        } else {
            let y = ar(&*sub);
            let x = ar(&w);
            let v = ag(&*sub);
            (x, y, ag(&w), v)
        };
        let all = async {
            b1.await.unwrap();
            b2.await.unwrap();
            let (x, y) = (x.await, y.await);
            let (u, v) = (u.await, v.await);
            (x.and_then(|x| Ok((x, y?))), u.and_then(|u| Ok((u, v?))))
        };
        let gathered: Vec<f32> = (0..n).flat_map(|r| vec![r as f32; len]).collect();
        match tokio::time::timeout(Duration::from_secs(20), all).await {
            Ok((Ok((x, y)), Ok((u, v)))) => {
                assert!(
                    x.to_vec::<f32>().unwrap().iter().chain(&y.to_vec::<f32>().unwrap()).all(|&v| v == sum),
                    "{len}"
                );
                assert_eq!(u.output.to_vec::<f32>().unwrap(), gathered, "{len}");
                assert_eq!(v.output.to_vec::<f32>().unwrap(), gathered, "{len}");
            }
            other => {
                eprintln!(
                    "CROSSED-FAILED rank {me} round {i} len {len}: {:?}",
                    other.map(|(a, b)| (a.is_ok(), b.is_ok()))
                );
                std::process::exit(1);
            }
        }
    }
    println!("CROSSED-OK rank {me}");
    sub.shutdown().await.unwrap();
    w.shutdown().await.unwrap();
    0
}

/// Rank 1 joins a small all_reduce only after a message that rank 0 sends after submitting
/// it: the submit must return while the peer is missing (the op is handed to the worker), or
/// rank 0 would never send and both would wait for the timeout.
async fn late() -> i32 {
    let w = MpiBackend::init(opts(Duration::from_secs(20))).await.unwrap();
    let me = w.rank();
    let sum = if me == 0 {
        let t = Instant::now();
        let sum = w.submit(AllReduce { buf: f32s(&[1.0; 4]), op: ReduceOp::Sum });
        let took = t.elapsed();
        assert!(took < Duration::from_millis(500), "the submit waited {took:?} for the peer");
        std::thread::sleep(Duration::from_millis(50));
        w.submit(SendTo { buf: f32s(&[5.0]), dst: 1, tag: 1 }).await.unwrap();
        sum.await.unwrap()
    } else {
        let got = w.submit(RecvFrom { buf: f32s(&[0.0]), src: 0, tag: 1 }).await.unwrap();
        assert_eq!(got.to_vec::<f32>().unwrap(), [5.0]);
        w.submit(AllReduce { buf: f32s(&[1.0; 4]), op: ReduceOp::Sum }).await.unwrap()
    };
    assert_eq!(sum.to_vec::<f32>().unwrap(), [2.0; 4]);
    // The group goes on: a direct op again, then one queued behind a handed-over one.
    let again = w.submit(AllReduce { buf: f32s(&[me as f32]), op: ReduceOp::Max }).await.unwrap();
    assert_eq!(again.to_vec::<f32>().unwrap(), [1.0]);
    println!("LATE-OK rank {me}");
    w.shutdown().await.unwrap();
    0
}

fn f32s(v: &[f32]) -> HostBuffer {
    HostBuffer::from_slice(v)
}

fn expect_mismatch<T: std::fmt::Debug>(what: &str, me: u32, got: Result<T, CommError>, needles: &[&str]) {
    match got {
        Err(CommError::Mismatch { detail, .. }) if needles.iter().all(|n| detail.contains(n)) => {
            println!("MISMATCH-OK {what} rank {me}: {detail}");
        }
        other => panic!("{what} on rank {me}: expected a Mismatch naming {needles:?}, got {other:?}"),
    }
}

async fn overlap() -> i32 {
    let w = MpiBackend::init(opts(Duration::from_secs(30))).await.unwrap();
    let me = w.rank();
    let big = 2 << 20; // 8 MiB of f32: far above every eager limit
    let data: Vec<f32> = (0..big).map(|i| i as f32).collect();
    let t = Instant::now();
    let send = (me == 0).then(|| w.submit(SendTo { buf: f32s(&data), dst: 1, tag: 9 }));
    for _ in 0..3 {
        let sum = w.submit(AllReduce { buf: f32s(&[1.0; 1000]), op: ReduceOp::Sum }).await.unwrap();
        assert_eq!(sum.to_vec::<f32>().unwrap(), vec![2.0; 1000]);
        Collective::<Barrier>::submit(&w, Barrier).await.unwrap();
    }
    if let Some(s) = send {
        s.await.unwrap();
    } else {
        let got =
            w.submit(RecvFrom { buf: HostBuffer::zeroed(comm_core::DType::F32, big), src: 0, tag: 9 }).await.unwrap();
        assert_eq!(got.to_vec::<f32>().unwrap(), data);
    }
    // The largest user tag works while collectives run (their header exchange has the tag
    // block above it to itself; u8 is dtype code 0, the exchange's low bits), and the next
    // one is refused.
    let (top, peer) = (w.max_tag(), 1 - me);
    let e = w.submit(SendTo { buf: f32s(&[1.0]), dst: peer, tag: top + 1 }).await.unwrap_err();
    assert!(matches!(e, CommError::InvalidArgument { .. }), "{e}");
    let recv = w.submit(RecvFrom { buf: HostBuffer::from_slice(&[0u8; 3]), src: peer, tag: top });
    let sum = w.submit(AllReduce { buf: f32s(&[1.0]), op: ReduceOp::Sum });
    let send = w.submit(SendTo { buf: HostBuffer::from_slice(&[me as u8; 3]), dst: peer, tag: top });
    assert_eq!(sum.await.unwrap().to_vec::<f32>().unwrap(), [2.0]);
    send.await.unwrap();
    assert_eq!(recv.await.unwrap().to_vec::<u8>().unwrap(), [peer as u8; 3]);
    // Around the exchange slot's end (64 KiB - 96 = 16 360 f32), gathered (a threshold of 64
    // KiB, as measured over a network): all in the slot, then the start beside it and the tail
    // in the slot; every element lands where it belongs.
    let gather = MpiBackend::init(MpiOptions { small_max: Some(64 << 10), ..opts(Duration::from_secs(30)) }).await;
    let gather = gather.unwrap();
    for len in [16_359, 16_360, 16_361, 16_384] {
        let mine: Vec<f32> = (0..len).map(|i| (i * (me + 1)) as f32 + 0.5).collect();
        let sum = gather.submit(AllReduce { buf: f32s(&mine), op: ReduceOp::Sum }).await.unwrap();
        let want: Vec<f32> = (0..len).map(|i| (i * 3) as f32 + 1.0).collect();
        assert_eq!(sum.to_vec::<f32>().unwrap(), want, "all_reduce of {len} f32");
    }
    println!("OVERLAP-OK rank {me} in {:.1?}", t.elapsed());
    w.shutdown().await.unwrap();
    0
}

/// Every sub-case on a fresh world group (a mismatch poisons its group).
async fn mismatch() -> i32 {
    let short = opts(Duration::from_secs(3));
    let w = MpiBackend::init(short.clone()).await.unwrap();
    let me = w.rank();

    // Sizes differ.
    let len = if me == 0 { 8 } else { 9 };
    let got = w.submit(AllReduce { buf: f32s(&vec![1.0; len]), op: ReduceOp::Sum }).await;
    expect_mismatch("size", me, got, &["f32 × 9", "f32 × 8"]);
    match Collective::<Barrier>::submit(&w, Barrier).await {
        Err(CommError::Poisoned { .. }) => println!("MISMATCH-OK poisoned rank {me}"),
        other => panic!("expected Poisoned after a mismatch, got {other:?}"),
    }

    // One rank's data rides in the header exchange, the other's does not: the exchange is the
    // same call on both, so both see the mismatch (neither hangs in a second call).
    let w = MpiBackend::init(short.clone()).await.unwrap();
    let len = if me == 0 { 2 } else { 1 << 16 };
    let got = w.submit(AllReduce { buf: f32s(&vec![1.0; len]), op: ReduceOp::Sum }).await;
    expect_mismatch("inline", me, got, &["f32 × 65536", "f32 × 2"]);
    // One small, one whole in the exchange (16 KiB).
    let w = MpiBackend::init(short.clone()).await.unwrap();
    let len = if me == 0 { 2 } else { 1 << 12 };
    let got = w.submit(AllReduce { buf: f32s(&vec![1.0; len]), op: ReduceOp::Sum }).await;
    expect_mismatch("whole", me, got, &["f32 × 4096", "f32 × 2"]);

    // Both inputs partly sent beside the exchange (what passes its 64 KiB - 96 slot; gathered
    // up to 64 KiB, as over a network), of different lengths: each rank drains the other's
    // (else it would stay queued in MPI, and MPI_Finalize below could hang on it).
    let gather = MpiOptions { small_max: Some(64 << 10), ..short.clone() };
    let w = MpiBackend::init(gather.clone()).await.unwrap();
    let len = if me == 0 { 16_370 } else { 16_380 };
    let got = w.submit(AllReduce { buf: f32s(&vec![1.0; len]), op: ReduceOp::Sum }).await;
    expect_mismatch("bulk", me, got, &["f32 × 16380", "f32 × 16370"]);
    // One beside the exchange, the other rank in another op.
    let w = MpiBackend::init(gather).await.unwrap();
    let got = if me == 0 {
        w.submit(AllReduce { buf: f32s(&vec![1.0; 16_384]), op: ReduceOp::Sum }).await
    } else {
        w.submit(Broadcast { buf: f32s(&[1.0; 4]), root: 0 }).await
    };
    expect_mismatch("bulk-op", me, got, &["all_reduce (f32 × 16384", "broadcast"]);

    // Different ops.
    let w = MpiBackend::init(short.clone()).await.unwrap();
    let got = if me == 0 {
        w.submit(Broadcast { buf: f32s(&[1.0; 4]), root: 0 }).await
    } else {
        w.submit(AllGather { input: f32s(&[1.0; 4]), output: None }).await.map(|io| io.output)
    };
    expect_mismatch("op", me, got, &["broadcast", "all_gather"]);

    // all_to_all splits that do not pair up.
    let w = MpiBackend::init(short.clone()).await.unwrap();
    let (input, ins) = if me == 0 { (vec![1.0; 2], vec![1, 1]) } else { (vec![1.0; 3], vec![2, 1]) };
    let req = AllToAll { input: f32s(&input), output: None, input_splits: Some(ins), output_splits: Some(vec![1, 1]) };
    expect_mismatch("splits", me, w.submit(req).await, &["rank 1 sends 2 elements to rank 0"]);

    // A receive shorter than the message (MPI's truncation error).
    let w = MpiBackend::init(short.clone()).await.unwrap();
    if me == 0 {
        w.submit(SendTo { buf: f32s(&[2.0; 10]), dst: 1, tag: 3 }).await.unwrap();
    } else {
        let got = w.submit(RecvFrom { buf: f32s(&[0.0; 5]), src: 0, tag: 3 }).await;
        expect_mismatch("truncated", me, got, &["more than the 5 elements"]);
    }

    // The same above every eager limit: in Open MPI's shared-memory single-copy path a receive
    // posted shorter than the message is overrun, so receives are posted only once their
    // message is matched, at its length.
    let w = MpiBackend::init(short.clone()).await.unwrap();
    if me == 0 {
        w.submit(SendTo { buf: f32s(&vec![2.0; 1 << 16]), dst: 1, tag: 3 }).await.unwrap();
    } else {
        let got = w.submit(RecvFrom { buf: f32s(&[0.0; 1000]), src: 0, tag: 3 }).await;
        expect_mismatch("long", me, got, &["sent 65536 elements", "more than the 1000 elements"]);
    }

    // A receive longer than the message.
    let w = MpiBackend::init(short.clone()).await.unwrap();
    if me == 0 {
        w.submit(SendTo { buf: f32s(&[2.0; 3]), dst: 1, tag: 4 }).await.unwrap();
    } else {
        let got = w.submit(RecvFrom { buf: f32s(&[0.0; 5]), src: 0, tag: 4 }).await;
        expect_mismatch("short", me, got, &["sent 3 elements", "recv of 5"]);
    }

    // Another dtype: the tags do not match; after the timeout the waiting message is named.
    let w = MpiBackend::init(short.clone()).await.unwrap();
    if me == 0 {
        w.submit(SendTo { buf: f32s(&[2.0; 4]), dst: 1, tag: 5 }).await.unwrap();
    } else {
        let got = w.submit(RecvFrom { buf: HostBuffer::from_slice(&[0i32; 4]), src: 0, tag: 5 }).await;
        expect_mismatch("dtype", me, got, &["4 elements of f32 with tag 5", "of i32 with tag 5"]);
    }

    // The job is still healthy: a fresh group works, then MPI is finalised cleanly. (Rank 0
    // is a timeout ahead of rank 1 here.)
    let w = MpiBackend::init(opts(Duration::from_secs(30))).await.unwrap();
    let sum = w.submit(AllReduce { buf: f32s(&[1.0]), op: ReduceOp::Sum }).await.unwrap();
    assert_eq!(sum.to_vec::<f32>().unwrap(), [2.0]);
    w.shutdown().await.unwrap();
    0
}

async fn told() -> i32 {
    // A timeout far beyond what the test allows: only the notice can end rank 0's wait.
    let w = MpiBackend::init(opts(Duration::from_secs(60))).await.unwrap();
    let me = w.rank();
    for round in 0..3 {
        let w = if round == 0 { w.clone() } else { MpiBackend::init(opts(Duration::from_secs(60))).await.unwrap() };
        if me == 0 {
            w.submit(SendTo { buf: f32s(&vec![1.0; 1 << 20]), dst: 1, tag: 7 }).await.unwrap();
            let t = Instant::now();
            let got = w.submit(AllReduce { buf: f32s(&[5.0; 4]), op: ReduceOp::Sum }).await;
            match got {
                Err(CommError::PeerLost { rank: 1, ref detail }) if t.elapsed() < Duration::from_secs(5) => {
                    println!("rank 0 round {round}: told after {:?}: {detail}", t.elapsed());
                }
                other => {
                    panic!("rank 0: expected PeerLost naming rank 1 within 5 s, got {other:?} after {:?}", t.elapsed())
                }
            }
        } else {
            let got = w.submit(RecvFrom { buf: f32s(&[0.0; 1024]), src: 0, tag: 7 }).await;
            expect_mismatch("told", me, got, &["sent 1048576 elements"]);
            // Submitted the moment the receive failed: it must not meet rank 0's all_reduce.
            let next = w.submit(AllReduce { buf: f32s(&[7.0; 4]), op: ReduceOp::Sum }).await;
            assert!(matches!(next, Err(CommError::Poisoned { .. })), "rank 1: the op after a failed receive: {next:?}");
        }
    }
    // The job is still healthy: a fresh group works, then MPI is finalised cleanly.
    let fresh = MpiBackend::init(opts(Duration::from_secs(30))).await.unwrap();
    let sum = fresh.submit(AllReduce { buf: f32s(&[1.0]), op: ReduceOp::Sum }).await.unwrap();
    assert_eq!(sum.to_vec::<f32>().unwrap(), [2.0]);
    println!("TOLD-OK rank {me}");
    drop(w);
    fresh.shutdown().await.unwrap();
    0
}

async fn timeout() -> i32 {
    let w = MpiBackend::init(opts(Duration::from_secs(2))).await.unwrap();
    let me = w.rank();
    if me == 0 {
        let t = Instant::now();
        let got = w.submit(AllReduce { buf: f32s(&[1.0; 16]), op: ReduceOp::Sum }).await;
        let took = t.elapsed();
        match got {
            Err(CommError::Timeout { .. }) if took < Duration::from_secs(5) => {
                println!("TIMEOUT-OK after {took:.1?}: {}", got.unwrap_err())
            }
            other => panic!("expected a Timeout within 5 s, got {other:?} after {took:?}"),
        }
        assert!(matches!(Collective::<Barrier>::submit(&w, Barrier).await, Err(CommError::Poisoned { .. })));
    } else {
        // Never joins; exits after rank 0 gave up.
        tokio::time::sleep(Duration::from_secs(6)).await;
    }
    let _ = w.shutdown().await;
    0
}

async fn kill() -> i32 {
    let w = MpiBackend::init(opts(Duration::from_secs(10))).await.unwrap();
    let me = w.rank();
    for i in 0..100_000 {
        if me == 2 && i == 20 {
            println!("KILL-BEFORE rank 2 kills itself (SIGKILL)");
            let _ = Command::new("kill").args(["-9", &std::process::id().to_string()]).status();
        }
        if let Err(e) = w.submit(AllReduce { buf: f32s(&[1.0; 1000]), op: ReduceOp::Sum }).await {
            println!("KILL-SEEN rank {me} after {i} ops: {e}");
            return 3;
        }
    }
    0
}

async fn panic() -> i32 {
    let w = MpiBackend::init(opts(Duration::from_secs(60))).await.unwrap();
    for _ in 0..5 {
        w.submit(AllReduce { buf: f32s(&[1.0; 10]), op: ReduceOp::Sum }).await.unwrap();
    }
    if w.rank() == 1 {
        panic!("rank 1 panics on purpose");
    }
    let got = w.submit(AllReduce { buf: f32s(&[1.0; 10]), op: ReduceOp::Sum }).await;
    println!("PANIC-UNEXPECTED rank 0 finished its op: {got:?}");
    0
}
