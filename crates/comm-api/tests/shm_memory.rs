//! The shm backend's memory as real separate processes: the shared-memory arena (large ops read
//! peers' buffers in place; its bounds; a rank without one), a small /dev/shm, and a loop of
//! large ops that holds its memory. Each test re-executes this test binary once per rank
//! (comm_test::multiprocess).

use std::time::{Duration, Instant};

use comm_api::{CommError, DType, HostBuffer, ReduceOp};
use comm_test::multiprocess;

#[path = "common/shm.rs"]
mod shm;
use shm::{connect, leftovers, T};

/// Large buffers live in the shared-memory arena once the group exists, and all_reduce,
/// all_gather, reduce_scatter, broadcast and send/recv read them in place: results equal the reference's,
/// for buffers made by every constructor, for one of plain heap memory (it comes back in the
/// arena), when a rank has no arena at all
/// (`COMM_SHM_ARENA_MIN=off` on rank `off`: everyone copies), and nothing is left in
/// /dev/shm.
async fn arena_body(off: Option<u32>) -> Result<(), String> {
    use comm_test::reference;
    let pg = connect().await?;
    let (rank, n) = (pg.rank(), pg.world_size());
    let e = |e: CommError| e.to_string();
    let in_arena = |b: &HostBuffer| b.external().is_some();
    for (dtype, len) in [(DType::F32, 1usize << 20), (DType::BF16, 300_001), (DType::I64, 70_001)] {
        let inputs: Vec<HostBuffer> = (0..n).map(|r| reference::input(dtype, len, r, 7)).collect();
        let refs: Vec<&HostBuffer> = inputs.iter().collect();
        let want = reference::all_reduce(&refs, ReduceOp::Sum).swap_remove(rank as usize);
        let mine = inputs[rank as usize].clone();
        if in_arena(&mine) != (Some(rank) != off) {
            return Err(format!("rank {rank}: a {dtype} × {len} buffer is in the arena: {}", in_arena(&mine)));
        }
        let got = pg.all_reduce(mine, ReduceOp::Sum).await.map_err(e)?;
        reference::compare(&got, &want, "all_reduce of an arena buffer", rank)?;
        // Plain memory goes into the arena for the op and stays there.
        let mut plain = HostBuffer::zeroed_on_heap(dtype, len);
        plain.as_bytes_mut().copy_from_slice(inputs[rank as usize].as_bytes());
        let got = pg.all_reduce(plain, ReduceOp::Sum).await.map_err(e)?;
        reference::compare(&got, &want, "all_reduce of a plain buffer", rank)?;
        if off.is_none() && !in_arena(&got) {
            return Err("a plain buffer did not come back in the arena".into());
        }
        // The same buffer again and again: the peers keep its chunk mapped.
        let mut again = got;
        for _ in 0..5 {
            again = pg.all_reduce(again, ReduceOp::Max).await.map_err(e)?;
        }
        reference::compare(&again, &want, "repeated all_reduce(max)", rank)?;
        // A reduce writes the root's buffer alone; the others get their inputs back.
        for root in 0..n {
            let got = pg.reduce(inputs[rank as usize].clone(), ReduceOp::Sum, root).await.map_err(e)?.into_buffer();
            let want = &reference::reduce_to_root(&refs, ReduceOp::Sum, root)[rank as usize];
            reference::compare(&got, want, &format!("reduce to {root}"), rank)?;
        }
        // The other ops read the peers' inputs in place (or all copy, with a rank without).
        let got = pg.all_gather(inputs[rank as usize].clone()).await.map_err(e)?;
        reference::compare(&got, &reference::all_gather(&refs)[rank as usize], "all_gather", rank)?;
        // One rank's input in plain memory: every rank copies through the window instead.
        let mut input = inputs[rank as usize].clone();
        if rank == 0 {
            input = HostBuffer::zeroed_on_heap(dtype, len);
            input.as_bytes_mut().copy_from_slice(inputs[0].as_bytes());
        }
        let got = pg.all_gather(input).await.map_err(e)?;
        reference::compare(&got, &reference::all_gather(&refs)[rank as usize], "all_gather, one plain input", rank)?;
        let whole = len - len % n as usize;
        let slices: Vec<HostBuffer> = inputs.iter().map(|b| reference::slice(b, 0, whole)).collect();
        let srefs: Vec<&HostBuffer> = slices.iter().collect();
        let got = pg.reduce_scatter(slices[rank as usize].clone(), ReduceOp::Sum).await.map_err(e)?;
        reference::compare(
            &got,
            &reference::reduce_scatter(&srefs, ReduceOp::Sum)[rank as usize],
            "reduce_scatter",
            rank,
        )?;
        let got = pg.all_to_all_single(slices[rank as usize].clone()).await.map_err(e)?;
        reference::compare(&got, &reference::all_to_all_equal(&srefs)[rank as usize], "all_to_all", rank)?;
        // Uneven: rank i sends rank j (i + 2j + 1) shares of its input, the last taking the rest.
        let splits: Vec<Vec<usize>> = (0..n as usize)
            .map(|i| {
                let (shares, unit) = ((0..n as usize).map(|j| i + 2 * j + 1).sum::<usize>(), len / 4);
                let mut s: Vec<usize> = (0..n as usize).map(|j| unit * (i + 2 * j + 1) / shares).collect();
                s[n as usize - 1] += len - s.iter().sum::<usize>();
                s
            })
            .collect();
        let want = reference::all_to_all(&refs, &splits)[rank as usize].clone();
        let outs: Vec<usize> = splits.iter().map(|s| s[rank as usize]).collect();
        let input = inputs[rank as usize].clone();
        let got = pg.all_to_all_single_uneven(input, splits[rank as usize].clone(), outs).await.map_err(e)?;
        reference::compare(&got, &want, "uneven all_to_all", rank)?;
        let all = reference::concat(&refs);
        for root in 0..n {
            let got = pg.broadcast(inputs[rank as usize].clone(), root).await.map_err(e)?;
            reference::compare(&got, &inputs[root as usize], "broadcast", rank)?;
            let input = (rank == root).then(|| all.clone());
            let got = pg.scatter(HostBuffer::zeroed(dtype, len), input, root).await.map_err(e)?.output;
            reference::compare(&got, &inputs[rank as usize], &format!("scatter from {root}"), rank)?;
            // Into zeros: an output the op allocates may hold the last all_gather's (equal) bytes.
            let out = HostBuffer::zeroed(dtype, if rank == root { all.len() } else { 0 });
            let got = pg.gather_into(inputs[rank as usize].clone(), out, root).await.map_err(e)?;
            if rank == root {
                reference::compare(&got.output, &all, &format!("gather to {root}"), rank)?;
            }
        }
        // A ring of large messages, sent in place from the arena, received into arena and
        // heap buffers alike.
        let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
        for (k, into) in
            [HostBuffer::zeroed(dtype, len), HostBuffer::zeroed_on_heap(dtype, len)].into_iter().enumerate()
        {
            let s = pg.isend(inputs[rank as usize].clone(), next, k as u32);
            let r = pg.irecv(into, prev, k as u32);
            let (s, r) = futures::future::join(s, r).await;
            reference::compare(&s.map_err(e)?, &inputs[rank as usize], "send (handed back)", rank)?;
            reference::compare(&r.map_err(e)?, &inputs[prev as usize], "recv", rank)?;
        }
    }
    let small = pg.alloc_buffer(DType::F32, 100).map_err(e)?;
    let got = pg.all_reduce(small, ReduceOp::Sum).await.map_err(e)?;
    if got.len() != 100 || got.as_slice::<f32>().map_err(e)?.iter().any(|&x| x != 0.0) {
        return Err("alloc_buffer's small buffer".into());
    }
    let left = leftovers(std::process::id());
    if !left.is_empty() {
        return Err(format!("segments left in /dev/shm: {left:?}"));
    }
    Ok(())
}

#[test]
fn arena_all_reduce() {
    multiprocess::run(3, "arena_all_reduce", T, || arena_body(None));
}

/// An arena at its bound (`COMM_SHM_ARENA_MAX`) gives plain memory, and ops on it copy.
#[test]
fn arena_at_its_bound() {
    let env = |_| vec![("COMM_SHM_ARENA_MAX".into(), "1MiB".into())];
    multiprocess::run_with_env(2, "arena_at_its_bound", T, env, || async {
        let pg = connect().await?;
        let e = |e: CommError| e.to_string();
        let small = HostBuffer::from(vec![1.0f32; 100_000]);
        let large = HostBuffer::from(vec![1.0f32; 1 << 20]);
        if small.external().is_none() || large.external().is_some() {
            return Err("400 KB should be in the arena, 4 MiB past its 1 MiB bound should not".into());
        }
        for buf in [small, large] {
            let got = pg.all_reduce(buf, ReduceOp::Sum).await.map_err(e)?;
            if got.as_slice::<f32>().map_err(e)?.iter().any(|&x| x != 2.0) {
                return Err("wrong sum".into());
            }
        }
        Ok(())
    });
}

#[test]
fn arena_off_on_one_rank() {
    let env = |r: u32| if r == 1 { vec![("COMM_SHM_ARENA_MIN".into(), "off".into())] } else { Vec::new() };
    multiprocess::run_with_env(3, "arena_off_on_one_rank", T, env, || arena_body(Some(1)));
}

/// Large all_gather / all_to_all blocks (several window-sized rounds, uneven splits) give the
/// reference result.
async fn large_blocks_body() -> Result<(), String> {
    use comm_test::reference;
    let pg = connect().await?;
    let (rank, n) = (pg.rank(), pg.world_size());
    let e = |e: CommError| e.to_string();
    let len = 300_007; // f32: 1.2 MB per rank
    let inputs: Vec<HostBuffer> = (0..n).map(|r| reference::input(DType::F32, len, r, 11)).collect();
    let refs: Vec<&HostBuffer> = inputs.iter().collect();
    let got = pg.all_gather(inputs[rank as usize].clone()).await.map_err(e)?;
    reference::compare(&got, &reference::all_gather(&refs)[rank as usize], "all_gather", rank)?;
    let eq = len - len % n as usize;
    let inputs: Vec<HostBuffer> = (0..n).map(|r| reference::input(DType::I32, eq, r, 12)).collect();
    let refs: Vec<&HostBuffer> = inputs.iter().collect();
    let got = pg.all_to_all_single(inputs[rank as usize].clone()).await.map_err(e)?;
    reference::compare(&got, &reference::all_to_all_equal(&refs)[rank as usize], "all_to_all", rank)?;
    // Uneven: rank i sends (i + j + 1) * 100_000 elements to rank j.
    let splits = |i: u32| (0..n).map(|j| (i + j + 1) as usize * 100_000).collect::<Vec<_>>();
    let all: Vec<Vec<usize>> = (0..n).map(splits).collect();
    let inputs: Vec<HostBuffer> =
        (0..n).map(|r| reference::input(DType::F32, all[r as usize].iter().sum(), r, 13)).collect();
    let refs: Vec<&HostBuffer> = inputs.iter().collect();
    let outs: Vec<usize> = (0..n).map(|i| all[i as usize][rank as usize]).collect();
    let got = pg
        .all_to_all_single_uneven(inputs[rank as usize].clone(), all[rank as usize].clone(), outs)
        .await
        .map_err(e)?;
    reference::compare(&got, &reference::all_to_all(&refs, &all)[rank as usize], "uneven all_to_all", rank)?;
    Ok(())
}

#[test]
fn large_blocks() {
    multiprocess::run(3, "large_blocks", T, large_blocks_body);
}

/// Runs this binary's test `name` again inside a mount namespace whose /dev/shm is a fresh
/// tmpfs of `size` bytes (`mount -o size=`), as a container's small /dev/shm is, and returns
/// false; in there returns true (the caller then runs the test). Needs root and `unshare`
/// (CI has both); elsewhere it says so and returns false.
fn in_small_dev_shm(name: &str, size: &str) -> bool {
    const INSIDE: &str = "COMM_TEST_SMALL_DEV_SHM";
    if std::env::var_os(INSIDE).is_some() {
        return true;
    }
    let unshare = || {
        let mut c = std::process::Command::new("unshare");
        c.args(["--mount", "--propagation", "private"]);
        c
    };
    if !unshare().arg("true").status().is_ok_and(|s| s.success()) {
        eprintln!("{name}: skipped: needs root and unshare(1) for a mount namespace");
        return false;
    }
    let out = unshare()
        .args(["sh", "-c", &format!("mount -t tmpfs -o size={size} tmpfs /dev/shm && exec \"$@\""), "sh"])
        .arg(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(INSIDE, "1")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("1 passed"), "in a {size} /dev/shm: {}\n{text}", out.status);
    false
}

/// The messages of the events logged in this process, for a test to read.
#[derive(Clone, Default)]
struct Logged(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Logged {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                if f.name() == "message" {
                    self.0 = format!("{v:?}");
                }
            }
        }
        let mut m = Message(String::new());
        event.record(&mut m);
        self.0.lock().unwrap().push(m.0);
    }
}

/// With a 24 MiB /dev/shm, the arena's default bound (/dev/shm's free space) takes a 4 MiB
/// buffer and refuses 32 MiB ones: those are heap memory, said once in the log, and ops on
/// them are right (no SIGBUS, no error).
#[test]
fn a_small_dev_shm_bounds_the_arena() {
    if !in_small_dev_shm("a_small_dev_shm_bounds_the_arena", "24m") {
        return;
    }
    multiprocess::run(2, "a_small_dev_shm_bounds_the_arena", T, || async {
        use tracing_subscriber::layer::SubscriberExt;
        let log = Logged::default();
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(log.clone()))
            .map_err(|e| e.to_string())?;
        let pg = connect().await?;
        let e = |e: CommError| e.to_string();
        let small = HostBuffer::from(vec![1.0f32; 1 << 20]);
        let large: Vec<HostBuffer> = (0..2).map(|_| HostBuffer::from(vec![1.0f32; 8 << 20])).collect();
        if small.external().is_none() || large.iter().any(|b| b.external().is_some()) {
            return Err("4 MiB should be in the arena, 32 MiB past its bound should not".into());
        }
        let warned = log.0.lock().unwrap().iter().filter(|m| m.contains("no room in the shared-memory arena")).count();
        if warned != 1 {
            return Err(format!("{warned} warnings of a full arena, not one"));
        }
        for buf in large.into_iter().chain([small]) {
            let got = pg.all_reduce(buf, ReduceOp::Sum).await.map_err(e)?;
            if got.as_slice::<f32>().map_err(e)?.iter().any(|&x| x != 2.0) {
                return Err("wrong sum".into());
            }
        }
        pg.shutdown().await.map_err(e)
    });
}

/// A /dev/shm too small for the group's segments (8 MiB: one rank's 1 MiB windows fit, not
/// two): every rank fails with an error that names /dev/shm, at once, never a SIGBUS or a
/// wait for the timeout.
#[test]
fn a_dev_shm_too_small_for_the_group() {
    if !in_small_dev_shm("a_dev_shm_too_small_for_the_group", "8m") {
        return;
    }
    let env = |_| vec![("COMM_SHM_WINDOW".into(), "1MiB".into()), ("COMM_TIMEOUT".into(), "100".into())];
    multiprocess::run_with_env(2, "a_dev_shm_too_small_for_the_group", T, env, || async {
        let start = Instant::now();
        match connect().await {
            Ok(_) => Err("a group in a /dev/shm too small for it".into()),
            Err(e) if e.contains("/dev/shm has less than") && start.elapsed() < Duration::from_secs(20) => {
                println!("refused in {:?}: {e}", start.elapsed());
                // Rank 0 serves the store: it stays until the others have read why.
                tokio::time::sleep(Duration::from_millis(500)).await;
                Ok(())
            }
            Err(e) => Err(format!("after {:?}, an error that does not say why: {e}", start.elapsed())),
        }
    });
}

/// This process's proportional set size (shared pages divided among the processes that map
/// them), and its shared-memory pages, in bytes.
fn pss_and_shmem() -> (usize, usize) {
    let text = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
    let kib = |key: &str| {
        text.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(0)
            << 10
    };
    (kib("Pss:"), kib("Pss_Shmem:"))
}

/// A loop of 1000 ops over 64 MiB buffers (all_reduce, broadcast, a ring of send/recv) holds
/// at most twice the live buffers' memory (proportional set size: a peer's mapping of a
/// buffer is shared memory, not a copy), the arena reusing its blocks, and names nothing in
/// /dev/shm. Then an all_gather and a reduce_scatter whose outputs stream past the L3.
#[test]
fn a_loop_of_large_ops_holds_its_memory() {
    multiprocess::run(2, "a_loop_of_large_ops_holds_its_memory", T, || async {
        let pg = connect().await?;
        let (rank, n) = (pg.rank(), pg.world_size());
        let e = |e: CommError| e.to_string();
        let before = pss_and_shmem();
        const LEN: usize = 16 << 20;
        let mut buf = HostBuffer::from(vec![1.0f32; LEN]);
        let mut inbox = HostBuffer::zeroed(DType::F32, LEN);
        for i in 0..1000 {
            buf = match i % 3 {
                0 => pg.all_reduce(buf, ReduceOp::Max).await.map_err(e)?,
                1 => pg.broadcast(buf, (i % n as usize) as u32).await.map_err(e)?,
                _ => {
                    let s = pg.isend(buf, (rank + 1) % n, 0);
                    let r = pg.irecv(inbox, (rank + n - 1) % n, 0);
                    let (s, r) = futures::future::join(s, r).await;
                    inbox = s.map_err(e)?;
                    r.map_err(e)?
                }
            };
        }
        if buf.as_slice::<f32>().map_err(e)?.iter().any(|&x| x != 1.0) {
            return Err("wrong data".into());
        }
        let after = pss_and_shmem();
        let live = 2 * LEN * 4;
        println!(
            "rank {rank}: pss {} -> {} MB, of it shmem {} -> {} MB; live buffers {} MB",
            before.0 >> 20,
            after.0 >> 20,
            before.1 >> 20,
            after.1 >> 20,
            live >> 20
        );
        if after.0.saturating_sub(before.0) > 2 * live {
            return Err(format!(
                "{} MB more after the loop, for {} MB of live buffers",
                (after.0 - before.0) >> 20,
                live >> 20
            ));
        }
        let left = leftovers(std::process::id());
        if !left.is_empty() {
            return Err(format!("segments left in /dev/shm: {left:?}"));
        }
        // An output larger than the L3 cache is written with streaming stores.
        let got = pg.all_gather(HostBuffer::from(vec![rank as f32; LEN])).await.map_err(e)?;
        let ok =
            got.as_slice::<f32>().map_err(e)?.chunks(LEN).enumerate().all(|(r, c)| c.iter().all(|&x| x == r as f32));
        if !ok {
            return Err("wrong all_gather".into());
        }
        // So is a reduce_scatter's (two inputs: in one pass).
        let input: Vec<f32> = (0..LEN).map(|i| (i % 1000) as f32 + rank as f32).collect();
        let got = pg.reduce_scatter(HostBuffer::from(input), ReduceOp::Sum).await.map_err(e)?;
        let (nf, base) = (n as f32, (n * (n - 1) / 2) as f32);
        let at = rank as usize * LEN / n as usize;
        let ok = got
            .as_slice::<f32>()
            .map_err(e)?
            .iter()
            .enumerate()
            .all(|(i, &x)| x == nf * ((at + i) % 1000) as f32 + base);
        if !ok {
            return Err("wrong reduce_scatter".into());
        }
        Ok(())
    });
}

/// A message sent in place whose send timed out (its receiver came late) is never read after
/// the sender got its buffer back: the late receive fails, even though the sender's arena
/// block now holds another buffer.
#[test]
fn a_late_receive_never_reads_a_buffer_given_back() {
    let env = |_| vec![("COMM_TIMEOUT".into(), "2".into())];
    multiprocess::run_with_env(2, "a_late_receive_never_reads_a_buffer_given_back", T, env, || async {
        let pg = connect().await?;
        const LEN: usize = 1 << 20;
        if pg.rank() == 0 {
            let sent = HostBuffer::from(vec![1.0f32; LEN]);
            match pg.isend(sent, 1, 0).await {
                Err(CommError::Timeout { .. }) => {}
                other => return Err(format!("the send should time out: {other:?}")),
            }
            // The block the message was in, now another buffer's.
            let other = HostBuffer::from(vec![9.0f32; LEN]);
            tokio::time::sleep(Duration::from_secs(4)).await;
            drop(other);
            Ok(())
        } else {
            tokio::time::sleep(Duration::from_secs(3)).await;
            match pg.irecv(HostBuffer::zeroed(DType::F32, LEN), 0, 0).await {
                Ok(b) => Err(format!(
                    "received {:?}… from a send that failed",
                    &b.as_slice::<f32>().map_err(|e| e.to_string())?[..2]
                )),
                Err(e) => {
                    println!("late receive: {e}");
                    Ok(())
                }
            }
        }
    });
}
