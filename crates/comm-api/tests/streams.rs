//! Several tokio tasks per rank sharing one group: on streams of their own every result is
//! right; on one shared group (or stream) the issuer check stops every task that would see a
//! wrong result, and deterministic hand-overs are never flagged.
//! Real processes, shm (the streams layer is the same over every backend).

use std::time::Duration;

use comm_api::{init, CommError, Config, HostBuffer, ProcessGroup, ReduceOp, StreamsOptions};
use comm_test::multiprocess;
use streams_body::Sharing;

const T: Duration = Duration::from_secs(120);

mod streams_body;

async fn tasks_on_streams(tasks: u64, ops: u64) -> Result<(), String> {
    let pg = init(Config::from_env().map_err(|e| e.to_string())?).await.map_err(|e| e.to_string())?;
    streams_body::tasks_on_streams(&pg, tasks, ops).await
}

#[test]
fn tasks_on_their_own_streams_world_2() {
    multiprocess::run(2, "tasks_on_their_own_streams_world_2", T, || tasks_on_streams(8, 1000));
}

#[test]
fn tasks_on_their_own_streams_world_3() {
    multiprocess::run(3, "tasks_on_their_own_streams_world_3", T, || tasks_on_streams(4, 1000));
}

#[test]
fn tasks_on_their_own_streams_world_4() {
    multiprocess::run(4, "tasks_on_their_own_streams_world_4", T, || tasks_on_streams(2, 1000));
}

/// A misuse scenario on a group (`key` None) or one stream, with a short timeout: the
/// issuer check must stop every task that would see a wrong sum.
fn misuse(world: u32, name: &str, key: Option<u64>, sharing: Sharing, tasks: u64) {
    multiprocess::run_with_env(
        world,
        name,
        T,
        |_| vec![("COMM_TIMEOUT".into(), "20".into())],
        move || async move {
            let pg = init(Config::from_env().map_err(|e| e.to_string())?).await.map_err(|e| e.to_string())?;
            let summary = match key {
                None => streams_body::misuse(&pg, sharing, tasks, 300).await?,
                Some(key) => {
                    let streams = pg.streams().await.map_err(|e| e.to_string())?;
                    let summary = streams_body::misuse(&streams.stream(key), sharing, tasks, 300).await?;
                    // The other streams go on.
                    let other = streams.stream(key + 1);
                    let got = other.all_reduce(HostBuffer::from_slice(&[1i64]), ReduceOp::Sum).await;
                    if !matches!(got.as_ref().map(|b| b.to_vec::<i64>().unwrap()), Ok(v) if v == [world as i64]) {
                        return Err(format!("stream {} after the misuse: {got:?}", key + 1));
                    }
                    summary
                }
            };
            println!("rank {}: {summary}", pg.rank());
            Ok(())
        },
    );
}

/// The README's misuse: tasks issuing on clones of one group.
#[test]
fn tasks_on_clones_of_one_group_are_stopped() {
    misuse(2, "tasks_on_clones_of_one_group_are_stopped", None, Sharing::Clones, 2);
}

/// Tasks taking turns behind a Mutex: one op in flight at a time, so only the order tells.
#[test]
fn tasks_behind_a_mutex_are_stopped() {
    misuse(3, "tasks_behind_a_mutex_are_stopped", None, Sharing::Mutex, 3);
}

/// The same on one direct stream (a group of its own)...
#[test]
fn tasks_sharing_a_direct_stream_are_stopped() {
    misuse(2, "tasks_sharing_a_direct_stream_are_stopped", Some(0), Sharing::Mutex, 4);
}

/// ... and on one arbitrated stream.
#[test]
fn tasks_sharing_an_arbitrated_stream_are_stopped() {
    misuse(3, "tasks_sharing_an_arbitrated_stream_are_stopped", Some(5), Sharing::Clones, 2);
}

/// Deterministic hand-overs (the main task, a spawned one, handlers in turn, a thread) are
/// never flagged.
#[test]
fn handing_a_group_over_is_not_flagged() {
    multiprocess::run(3, "handing_a_group_over_is_not_flagged", T, || async {
        let pg = init(Config::from_env().map_err(|e| e.to_string())?).await.map_err(|e| e.to_string())?;
        streams_body::handed_over(&pg).await?;
        let streams = pg.streams().await.map_err(|e| e.to_string())?;
        streams_body::handed_over(&streams.stream(0)).await?;
        streams_body::handed_over(&streams.stream(9)).await
    });
}

/// Rank 0 issues stream A's op then stream B's, rank 1 the other way round, with the same
/// shapes: each pairs with its own, for two direct streams (0, 1), two arbitrated ones (2, 3)
/// and one of each. The same crossing on one stream, with different shapes, is `Mismatch` on
/// both ranks, and only that stream fails; so are ops that differ in reduce op or root.
#[test]
fn crossed_streams() {
    multiprocess::run(2, "crossed_streams", T, || async {
        let pg = init(Config::from_env().map_err(|e| e.to_string())?).await.map_err(|e| e.to_string())?;
        let streams = pg.streams().await.map_err(|e| e.to_string())?;
        let me = pg.rank();
        let issue = |s: &ProcessGroup, v: f32| s.all_reduce(HostBuffer::from_slice(&[v; 16]), ReduceOp::Sum);
        for (ka, kb) in [(0, 1), (2, 3), (1, 2)] {
            let (a, b) = (streams.stream(ka), streams.stream(kb));
            let (wa, wb) = if me == 0 {
                let wa = issue(&a, 1.0);
                (wa, issue(&b, 10.0))
            } else {
                let wb = issue(&b, 10.0);
                (issue(&a, 1.0), wb)
            };
            let (ra, rb) = (wa.await.map_err(|e| e.to_string())?, wb.await.map_err(|e| e.to_string())?);
            if ra.to_vec::<f32>().unwrap() != [2.0; 16] || rb.to_vec::<f32>().unwrap() != [20.0; 16] {
                return Err(format!("crossed streams {ka} and {kb} paired wrongly: {ra:?} {rb:?}"));
            }
        }
        let (first, second) = if me == 0 { (16, 32) } else { (32, 16) };
        let crossed = |s: &ProcessGroup| {
            let w1 = s.all_reduce(HostBuffer::from_slice(&vec![1.0f32; first]), ReduceOp::Sum);
            (w1, s.all_reduce(HostBuffer::from_slice(&vec![1.0f32; second]), ReduceOp::Sum))
        };
        // An arbitrated stream, crossed, different shapes: named in both errors.
        let (w1, w2) = crossed(&streams.stream(4));
        match (w1.await, w2.await) {
            (Err(CommError::Mismatch { detail, .. }), Err(CommError::Poisoned { cause }))
                if detail.contains("stream 4") && cause.contains("stream 4") => {}
            other => return Err(format!("stream 4 crossed: {other:?}")),
        }
        // A direct stream, crossed: its group's own check (a peer may see the other's report
        // of it first).
        let (w1, w2) = crossed(&streams.stream(0));
        match (w1.await, w2.await) {
            (Err(CommError::Mismatch { .. } | CommError::PeerLost { .. }), Err(_)) => {}
            other => return Err(format!("stream 0 crossed: {other:?}")),
        }
        // Arbitrated streams whose ranks differ only in the reduce op or the root: `Mismatch`
        // on that stream alone (the data group under every arbitrated stream never sees it).
        let (op, root) = if me == 0 { (ReduceOp::Sum, 0) } else { (ReduceOp::Max, 1) };
        let r = streams.stream(5).all_reduce(HostBuffer::from_slice(&[1.0f32; 16]), op).await;
        if !matches!(&r, Err(CommError::Mismatch { detail, .. }) if detail.contains("stream 5")) {
            return Err(format!("stream 5, sum against max: {r:?}"));
        }
        let r = streams.stream(6).broadcast(HostBuffer::from_slice(&[1.0f32; 16]), root).await;
        if !matches!(&r, Err(CommError::Mismatch { detail, .. }) if detail.contains("stream 6")) {
            return Err(format!("stream 6, roots 0 and 1: {r:?}"));
        }
        // The other streams go on.
        for k in [1, 2, 3] {
            let r = issue(&streams.stream(k), 1.0).await.map_err(|e| e.to_string())?;
            if r.to_vec::<f32>().unwrap() != [2.0; 16] {
                return Err(format!("stream {k} after streams 0, 4, 5 and 6 failed"));
            }
        }
        Ok(())
    });
}

/// A stream whose peer never issues its op times out, naming the stream and the rank; the
/// other streams go on meanwhile.
#[test]
fn a_missing_op_times_out_alone() {
    multiprocess::run_with_env(
        2,
        "a_missing_op_times_out_alone",
        T,
        |_| vec![("COMM_TIMEOUT".into(), "2".into())],
        || async {
            let pg = init(Config::from_env().map_err(|e| e.to_string())?).await.map_err(|e| e.to_string())?;
            let streams = pg.streams().await.map_err(|e| e.to_string())?;
            let (lonely, busy) = (streams.stream(7), streams.stream(8));
            // A direct stream's missing op too: its own group times out, nothing else.
            let lonely_direct = streams.stream(0);
            let waiting = (pg.rank() == 0).then(|| lonely.all_reduce(HostBuffer::from_slice(&[1.0f32]), ReduceOp::Sum));
            let waiting_direct =
                (pg.rank() == 0).then(|| lonely_direct.all_reduce(HostBuffer::from_slice(&[1.0f32]), ReduceOp::Sum));
            let busy_direct = streams.stream(1);
            // Past the lonely op's 2 s timeout; the same number of ops on both ranks.
            for _ in 0..150 {
                let r = busy
                    .all_reduce(HostBuffer::from_slice(&[1.0f32; 8]), ReduceOp::Sum)
                    .await
                    .map_err(|e| e.to_string())?;
                let d = busy_direct
                    .all_reduce(HostBuffer::from_slice(&[1.0f32; 8]), ReduceOp::Sum)
                    .await
                    .map_err(|e| e.to_string())?;
                if r.to_vec::<f32>().unwrap() != [2.0; 8] || d.to_vec::<f32>().unwrap() != [2.0; 8] {
                    return Err("busy stream: wrong sum".into());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if let Some(w) = waiting {
                match w.await {
                    Err(CommError::Timeout { op, detail, .. })
                        if op.contains("stream 7") && detail.contains("rank 1") => {}
                    other => return Err(format!("lonely op: {other:?}")),
                }
                match lonely.barrier().await {
                    Err(CommError::Poisoned { cause }) if cause.contains("stream 7") => {}
                    other => return Err(format!("after the timeout: {other:?}")),
                }
            }
            if let Some(w) = waiting_direct {
                match w.await {
                    Err(CommError::Timeout { .. }) => {}
                    other => return Err(format!("lonely op on a direct stream: {other:?}")),
                }
            }
            // Neither rank ends its streams before the other is done with its checks.
            pg.barrier().await.map_err(|e| e.to_string())?;
            streams.shutdown().await.map_err(|e| e.to_string())
        },
    );
}

/// Ranks that ask for different numbers of direct streams, or one past the bound, all get
/// `InvalidArgument` (they would create different groups), and the group goes on.
#[test]
fn ranks_disagreeing_on_direct_streams_are_told() {
    multiprocess::run_with_env(
        2,
        "ranks_disagreeing_on_direct_streams_are_told",
        T,
        |rank| vec![("COMM_STREAMS_DIRECT".into(), (1 + 2 * rank).to_string())],
        || async {
            let pg = init(Config::from_env().map_err(|e| e.to_string())?).await.map_err(|e| e.to_string())?;
            match pg.streams().await {
                Err(CommError::InvalidArgument { reason, .. }) if reason.contains("between 1 and 3") => {}
                other => return Err(format!("streams with 1 and 3 direct: {other:?}")),
            }
            // One rank past the bound: every rank is told, none waits for it.
            let opts = StreamsOptions::default().direct(if pg.rank() == 0 { 1 } else { 65 });
            match pg.streams_with(opts).await {
                Err(CommError::InvalidArgument { reason, .. }) if reason.contains("more than 64") => {}
                other => return Err(format!("streams with 1 and 65 direct: {other:?}")),
            }
            // Every rank far past the bound (a count no i64 holds): told, no panic.
            match pg.streams_with(StreamsOptions::default().direct(usize::MAX)).await {
                Err(CommError::InvalidArgument { reason, .. }) if reason.contains("more than 64") => {}
                other => return Err(format!("streams with usize::MAX direct: {other:?}")),
            }
            let r = pg.all_reduce(HostBuffer::from_slice(&[1.0f32]), ReduceOp::Sum).await.map_err(|e| e.to_string())?;
            if r.to_vec::<f32>().unwrap() != [2.0] {
                return Err("the group after the refusal: wrong sum".into());
            }
            Ok(())
        },
    );
}

/// One verdict per op: rank 2 stops (SIGSTOP) before an all_reduce; ranks 0 and 1 time out
/// on it; rank 0 wakes rank 2 (SIGCONT) a second later, which then issues the op — and gets
/// the peers' failure, not a sum. On the group, on a direct stream (a group of its own) and on
/// an arbitrated stream (its error names the stream).
#[test]
fn a_rank_woken_after_its_peers_timed_out_fails_the_op_too() {
    let dir = std::env::temp_dir().join(format!("comm-verdict-{}", std::process::id()));
    if std::env::var_os(comm_test::multiprocess::CHILD_ENV).is_none() {
        std::fs::create_dir_all(&dir).unwrap();
    }
    let d = dir.clone();
    multiprocess::run_with_env(
        3,
        "a_rank_woken_after_its_peers_timed_out_fails_the_op_too",
        T,
        move |_| vec![("COMM_TIMEOUT".into(), "1".into()), ("VERDICT_DIR".into(), d.to_string_lossy().into_owned())],
        || async {
            let e = |e: CommError| e.to_string();
            let pg = init(Config::from_env().map_err(e)?).await.map_err(e)?;
            let streams = pg.streams().await.map_err(e)?;
            let dir = std::path::PathBuf::from(std::env::var("VERDICT_DIR").unwrap());
            // The arbitrated stream first: a rank stopped past the timeout fails every
            // arbitrated stream (their control group's heartbeats time out).
            for (name, g) in [("stream7", streams.stream(7)), ("group", pg.clone()), ("stream0", streams.stream(0))] {
                let sum = |g: &ProcessGroup| g.all_reduce(HostBuffer::from_slice(&[1.0f32; 4]), ReduceOp::Sum);
                for _ in 0..3 {
                    sum(&g).await.map_err(e)?;
                }
                let pid_file = dir.join(name);
                let got = match pg.rank() {
                    2 => {
                        std::fs::write(pid_file.with_extension("tmp"), std::process::id().to_string()).unwrap();
                        std::fs::rename(pid_file.with_extension("tmp"), &pid_file).unwrap();
                        rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::STOP)
                            .unwrap();
                        std::thread::sleep(Duration::from_millis(100));
                        sum(&g).await
                    }
                    r => {
                        let got = sum(&g).await;
                        if r == 0 {
                            tokio::time::sleep(Duration::from_secs(1)).await;
                            let pid: i32 = std::fs::read_to_string(&pid_file).unwrap().parse().unwrap();
                            let pid = rustix::process::Pid::from_raw(pid).unwrap();
                            rustix::process::kill_process(pid, rustix::process::Signal::CONT).unwrap();
                        }
                        // The next part starts once rank 2 has its verdict (within the timeout).
                        let done = pid_file.with_extension("done");
                        let t = std::time::Instant::now();
                        while !done.exists() && t.elapsed() < Duration::from_secs(20) {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        got
                    }
                };
                if pg.rank() == 2 {
                    std::fs::write(pid_file.with_extension("done"), b"").unwrap();
                }
                let arbitrated = name == "stream7";
                let text = got.as_ref().err().map(ToString::to_string).unwrap_or_default();
                match got {
                    Err(CommError::Timeout { detail, .. })
                        if !arbitrated && pg.rank() < 2 && detail.contains("rank 2") => {}
                    Err(CommError::Timeout { detail, .. } | CommError::PeerLost { detail, .. })
                        if !arbitrated && pg.rank() == 2 && detail.contains("given up waiting") => {}
                    // An arbitrated stream's op fails on every rank, naming the stream.
                    Err(e) if arbitrated && e.to_string().contains("stream 7") => {}
                    other => return Err(format!("{name}: rank {}: {other:?}", pg.rank())),
                }
                println!("rank {}: {name}: one verdict: {text}", pg.rank());
            }
            Ok(())
        },
    );
    if std::env::var_os(comm_test::multiprocess::CHILD_ENV).is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}
