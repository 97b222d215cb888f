//! Several ranks in one process (threads), sharing a MemoryStore: quick protocol checks.

use std::sync::Arc;
use std::time::Duration;

use backend_shm::{ShmBackend, ShmOptions};
use comm_core::ops::{
    AllGather, AllReduce, AllToAll, Barrier, Broadcast, Gather, RecvFrom, Reduce, ReduceScatter, Scatter, SendTo,
};
use comm_core::{Collective, CommError, Group, HostBuffer, MemoryStore, ReduceOp, Store};

async fn world(n: u32, opts: ShmOptions) -> Vec<ShmBackend> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let futs = (0..n).map(|r| {
        let store = store.clone();
        let opts = opts.clone();
        tokio::spawn(async move { ShmBackend::new(store, r, n, opts).await.unwrap() })
    });
    futures::future::join_all(futs).await.into_iter().map(Result::unwrap).collect()
}

fn small_opts() -> ShmOptions {
    ShmOptions {
        window: 4096,
        p2p_slot: Some(4096),
        small_max: Some(1024),
        timeout: Duration::from_secs(20),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_reduce_small_and_chunked() {
    // Window stores as the timing picks them, and either kind throughout (`ShmOptions::stream`).
    for (n, stream) in [1u32, 2, 3].into_iter().flat_map(|n| [None, Some(true), Some(false)].map(|s| (n, s))) {
        let ranks = world(n, ShmOptions { stream, ..small_opts() }).await;
        // Windows of 1024 f32: one step, whole windows, and a shorter last piece.
        for len in [0usize, 1, 7, 300, 2048, 2049, 3072, 5000] {
            let works: Vec<_> = ranks
                .iter()
                .enumerate()
                .map(|(r, b)| {
                    let data: Vec<f32> = (0..len).map(|i| (i * (r + 1)) as f32).collect();
                    b.submit(AllReduce { buf: HostBuffer::from_slice(&data), op: ReduceOp::Sum })
                })
                .collect();
            let tri = (n * (n + 1) / 2) as f32;
            for w in works {
                let out = w.await.unwrap().to_vec::<f32>().unwrap();
                let want: Vec<f32> = (0..len).map(|i| i as f32 * tri).collect();
                assert_eq!(out, want, "n={n} len={len} stream {stream:?}");
            }
            // reduce: the root gets the sum, the others keep their inputs.
            let root = n - 1;
            let works: Vec<_> = ranks
                .iter()
                .enumerate()
                .map(|(r, b)| {
                    let data: Vec<f32> = (0..len).map(|i| (i * (r + 1)) as f32).collect();
                    b.submit(Reduce { buf: HostBuffer::from_slice(&data), op: ReduceOp::Sum, root })
                })
                .collect();
            for (r, w) in works.into_iter().enumerate() {
                let out = w.await.unwrap().to_vec::<f32>().unwrap();
                let k = if r as u32 == root { tri } else { (r + 1) as f32 };
                let want: Vec<f32> = (0..len).map(|i| i as f32 * k).collect();
                assert_eq!(out, want, "reduce n={n} len={len} rank {r} stream {stream:?}");
            }
        }
        for b in &ranks {
            b.shutdown().await.unwrap();
        }
    }
}

/// Steps of a page or more move through the window (`Layout::rotation`): a long run of
/// mixed ops and sizes on one group, a 64 KiB window, puts them at every place in it and
/// wraps; each result is checked, so a reader looking where its peer did not write (or at an
/// older op's data there) fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_ops_at_every_place_in_the_window() {
    for (n, stream) in [(2u32, None), (3, None), (2, Some(true)), (3, Some(true))] {
        let opts = ShmOptions { window: 64 << 10, small_max: Some(16 << 10), stream, ..small_opts() };
        let ranks = world(n, opts).await;
        let tri = (n * (n + 1) / 2) as i32;
        let lens = [1024usize, 100, 1500, 4096, 5000, 12_000, 16_384, 30_000, 3000];
        for j in 0..90usize {
            let (len, jj) = (lens[j % lens.len()], j as i32);
            let iota = |f: &dyn Fn(usize) -> i32| HostBuffer::from_slice(&(0..len).map(f).collect::<Vec<i32>>());
            let ctx = format!("n={n} op {j} len {len} stream {stream:?}");
            match j % 5 {
                0 => {
                    let works: Vec<_> = (0..n as usize)
                        .map(|r| {
                            ranks[r].submit(AllReduce { buf: iota(&|i| (i * (r + 1)) as i32 + jj), op: ReduceOp::Sum })
                        })
                        .collect();
                    let want: Vec<i32> = (0..len).map(|i| i as i32 * tri + n as i32 * jj).collect();
                    for w in works {
                        assert_eq!(w.await.unwrap().to_vec::<i32>().unwrap(), want, "all_reduce {ctx}");
                    }
                }
                1 => {
                    let works: Vec<_> = (0..n as usize)
                        .map(|r| {
                            ranks[r]
                                .submit(AllGather { input: iota(&|i| (r * 1_000_003 + i) as i32 + jj), output: None })
                        })
                        .collect();
                    let want: Vec<i32> =
                        (0..n as usize).flat_map(|r| (0..len).map(move |i| (r * 1_000_003 + i) as i32 + jj)).collect();
                    for w in works {
                        assert_eq!(w.await.unwrap().output.to_vec::<i32>().unwrap(), want, "all_gather {ctx}");
                    }
                }
                2 => {
                    let total = len * n as usize;
                    let works: Vec<_> = (0..n as usize)
                        .map(|r| {
                            let input = HostBuffer::from_slice(
                                &(0..total).map(|i| (i * (r + 1)) as i32 - jj).collect::<Vec<i32>>(),
                            );
                            ranks[r].submit(ReduceScatter { input, op: ReduceOp::Sum, output: None })
                        })
                        .collect();
                    for (r, w) in works.into_iter().enumerate() {
                        let want: Vec<i32> = (r * len..(r + 1) * len).map(|i| i as i32 * tri - n as i32 * jj).collect();
                        assert_eq!(
                            w.await.unwrap().output.to_vec::<i32>().unwrap(),
                            want,
                            "reduce_scatter {ctx} rank {r}"
                        );
                    }
                }
                3 => {
                    let root = (j % n as usize) as u32;
                    let works: Vec<_> = (0..n as usize)
                        .map(|r| {
                            let buf = if r as u32 == root { iota(&|i| i as i32 * 3 + jj) } else { iota(&|_| -1) };
                            ranks[r].submit(Broadcast { buf, root })
                        })
                        .collect();
                    let want: Vec<i32> = (0..len).map(|i| i as i32 * 3 + jj).collect();
                    for w in works {
                        assert_eq!(w.await.unwrap().to_vec::<i32>().unwrap(), want, "broadcast {ctx}");
                    }
                }
                _ => {
                    // Rank r's block for rank q: r * 10^6 + q * 10^4 + position + op.
                    let val = |r: usize, q: usize, i: usize| (r * 1_000_000 + q * 10_000 + i % 10_000) as i32 + jj;
                    let per = len.div_ceil(n as usize);
                    let works: Vec<_> = (0..n as usize)
                        .map(|r| {
                            let input: Vec<i32> =
                                (0..n as usize).flat_map(|q| (0..per).map(move |i| val(r, q, i))).collect();
                            let input = HostBuffer::from_slice(&input);
                            ranks[r].submit(AllToAll { input, output: None, input_splits: None, output_splits: None })
                        })
                        .collect();
                    for (q, w) in works.into_iter().enumerate() {
                        let want: Vec<i32> =
                            (0..n as usize).flat_map(|r| (0..per).map(move |i| val(r, q, i))).collect();
                        assert_eq!(w.await.unwrap().output.to_vec::<i32>().unwrap(), want, "all_to_all {ctx} rank {q}");
                    }
                }
            }
        }
        for b in &ranks {
            b.shutdown().await.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatch_is_reported() {
    let ranks = world(2, small_opts()).await;
    let a = ranks[0].submit(AllReduce { buf: HostBuffer::from_slice(&[1.0f32; 4]), op: ReduceOp::Sum });
    let b = ranks[1].submit(AllGather { input: HostBuffer::from_slice(&[1.0f32; 4]), output: None });
    let (a, b) = (a.await, b.await);
    let msg = format!("{a:?} {b:?}");
    assert!(msg.contains("Mismatch"), "{msg}");
    // The group is poisoned now.
    let c = ranks[0].submit(Barrier).await;
    assert!(matches!(c, Err(CommError::Poisoned { .. })), "{c:?}");
}

/// Ops of several steps open with a step of their own on every rank, so different ops, and
/// sizes that make one rank's op one step and another's several, are told apart there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatch_of_ops_of_several_steps_is_reported() {
    let long = || HostBuffer::from_slice(&[1.0f32; 5000]);
    let short = HostBuffer::from_slice(&[1.0f32; 4]);
    for case in 0..2 {
        let ranks = world(2, small_opts()).await;
        let a = match case {
            0 => ranks[0].submit(AllReduce { buf: long(), op: ReduceOp::Sum }),
            _ => ranks[0].submit(AllReduce { buf: short.clone(), op: ReduceOp::Sum }),
        };
        let (b, names) = match case {
            0 => (
                ranks[1].submit(AllGather { input: long(), output: None }).await.map(drop),
                ["all_reduce #1 (f32 × 5000", "all_gather #1 (f32 × 5000"],
            ),
            _ => (
                ranks[1].submit(AllReduce { buf: long(), op: ReduceOp::Sum }).await.map(drop),
                ["all_reduce #1 (f32 × 4, sum)", "all_reduce #1 (f32 × 5000, the step that opens"],
            ),
        };
        for r in [a.await.map(drop), b] {
            let Err(CommError::Mismatch { detail, .. }) = &r else { panic!("case {case}: {r:?}") };
            assert!(names.iter().all(|n| detail.contains(n)), "case {case}: {detail}");
        }
    }
}

/// Ranks that disagree on the root, so that none of them reads a peer's data (each takes
/// itself for a broadcast's root, or another rank for a gather's), still find out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn root_mismatch_is_reported_where_no_rank_reads() {
    for case in 0..2 {
        let ranks = world(2, small_opts()).await;
        let works: Vec<_> = (0..2u32)
            .map(|r| {
                let buf = HostBuffer::from_slice(&[r as f32; 2]);
                match case {
                    0 => ranks[r as usize].submit(Broadcast { buf, root: r }).map(drop),
                    _ => ranks[r as usize].submit(Gather { input: buf, output: None, root: 1 - r }).map(drop),
                }
            })
            .collect();
        for w in works {
            let r = w.await;
            let Err(CommError::Mismatch { detail, .. }) = &r else { panic!("case {case}: {r:?}") };
            assert!(detail.contains("root 0") && detail.contains("root 1"), "{detail}");
        }
    }
}

/// Ops of several steps up to `inline_max` run on the caller's thread when the peers are
/// there: done when `submit` returns, no hand-off to the worker. With `inline_max` 0 the
/// worker runs them. A peer that comes late does not hold the caller: after a short wait
/// the op is handed to the worker, which finishes it.
#[test]
fn ops_of_several_steps_run_inline_unless_a_peer_is_late() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    const LEN: usize = 5000; // 20 KB of f32: 3 pieces of a 4 KiB window (small_max 1 KiB)
    let input = |r: usize| HostBuffer::from_slice(&(0..LEN).map(|i| (i * (r + 1)) as f32).collect::<Vec<_>>());
    let want: Vec<f32> = (0..LEN).map(|i| (i * 3) as f32).collect();
    for (inline_max, expect_inline) in [(64 << 10, true), (0, false)] {
        let opts = ShmOptions { inline_max: Some(inline_max), ..small_opts() };
        let ranks = rt.block_on(world(2, opts));
        let start = Arc::new(std::sync::Barrier::new(2));
        let threads: Vec<_> = (0..2)
            .map(|r| {
                let (b, start, input, want) = (ranks[r].clone(), start.clone(), input, want.clone());
                std::thread::spawn(move || {
                    let mut inline = 0;
                    for _ in 0..50 {
                        start.wait();
                        let w = b.submit(AllReduce { buf: input(r), op: ReduceOp::Sum });
                        inline += usize::from(w.is_completed());
                        assert_eq!(w.wait().unwrap().to_vec::<f32>().unwrap(), want);
                    }
                    inline
                })
            })
            .collect();
        let inline: Vec<usize> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        println!("inline_max {inline_max}: {inline:?} of 50 done when submit returned");
        if expect_inline {
            assert!(inline.iter().all(|&k| k >= 35), "only {inline:?} of 50 all_reduces per rank ran inline");
        } else {
            assert!(
                inline.iter().all(|&k| k <= 10),
                "{inline:?} of 50 all_reduces per rank done at once with inline_max 0"
            );
        }

        // Rank 1 comes 300 ms late: rank 0's submit returns long before, and both finish.
        let late = std::thread::spawn({
            let b = ranks[1].clone();
            move || {
                std::thread::sleep(Duration::from_millis(300));
                b.submit(AllReduce { buf: input(1), op: ReduceOp::Sum }).wait()
            }
        });
        let t = std::time::Instant::now();
        let w = ranks[0].submit(AllReduce { buf: input(0), op: ReduceOp::Sum });
        let held = t.elapsed();
        assert!(held < Duration::from_millis(100), "the caller was held {held:?} by a late peer");
        assert!(!w.is_completed());
        assert_eq!(w.wait().unwrap().to_vec::<f32>().unwrap(), want);
        assert_eq!(late.join().unwrap().unwrap().to_vec::<f32>().unwrap(), want);
        for b in &ranks {
            rt.block_on(b.shutdown()).unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2p_large_both_directions() {
    let ranks = world(2, small_opts()).await;
    let n = 20_000usize;
    let a = HostBuffer::from_slice(&(0..n as i32).collect::<Vec<_>>());
    let s0 = ranks[0].submit(SendTo { buf: a.clone(), dst: 1, tag: 3 });
    let s1 = ranks[1].submit(SendTo { buf: a.clone(), dst: 0, tag: 3 });
    let r0 = ranks[0].submit(RecvFrom { buf: HostBuffer::zeroed(comm_core::DType::I32, n), src: 1, tag: 3 });
    let r1 = ranks[1].submit(RecvFrom { buf: HostBuffer::zeroed(comm_core::DType::I32, n), src: 0, tag: 3 });
    s0.await.unwrap();
    s1.await.unwrap();
    assert_eq!(r0.await.unwrap(), a);
    assert_eq!(r1.await.unwrap(), a);
}

/// Sends and receives run on the caller's thread when nothing else is on its way to the
/// worker: a message that fits the free mailbox slots is written before `submit` returns. The
/// messages to one peer keep their order whichever thread writes them: a large one left to the
/// worker half-written is not overtaken by the small ones after it, whether the receives are
/// posted before or after the sends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2p_runs_inline_and_keeps_its_order() {
    let ranks = world(2, small_opts()).await;
    let i32s = |n: usize, k: i32| HostBuffer::from_slice(&(0..n as i32).map(|x| x * k).collect::<Vec<_>>());
    // Sends into free slots, receives of messages already there: done before `submit` returns.
    let mut inline = 0;
    for round in 0..50 {
        let sent = ranks[0].submit(SendTo { buf: i32s(16, round), dst: 1, tag: 1 });
        let got = ranks[1].submit(RecvFrom { buf: HostBuffer::zeroed(comm_core::DType::I32, 16), src: 0, tag: 1 });
        inline += usize::from(sent.is_completed() && got.is_completed());
        assert_eq!(got.await.unwrap(), i32s(16, round));
        sent.await.unwrap();
    }
    assert!(inline >= 45, "only {inline} of 50 small sends and receives finished in their callers");
    for recv_first in [false, true] {
        let big = 20_000; // 80 KB: 20 mailbox chunks of 4 KiB
        let recv = |n: usize, tag| {
            ranks[1].submit(RecvFrom { buf: HostBuffer::zeroed(comm_core::DType::I32, n), src: 0, tag })
        };
        let early: Vec<_> = if recv_first { vec![recv(big, 7), recv(3, 8), recv(5, 9)] } else { Vec::new() };
        let sends = [(big, 7, 3), (3, 8, -1), (5, 9, 2)]
            .map(|(n, tag, k)| ranks[0].submit(SendTo { buf: i32s(n, k), dst: 1, tag }));
        let got = if recv_first { early } else { vec![recv(big, 7), recv(3, 8), recv(5, 9)] };
        for (g, (n, k)) in got.into_iter().zip([(big, 3), (3, -1), (5, 2)]) {
            assert_eq!(g.await.unwrap(), i32s(n, k), "recv_first {recv_first}");
        }
        for s in sends {
            s.await.unwrap();
        }
    }
}

/// Scatter and gather, where only some ranks write (the root, or every rank but it), choose
/// their stores by timing their copies (`Choice::Writes`); here over several pieces, with the
/// kind as timing picks it and with every copy streaming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scatter_and_gather_with_either_stores() {
    for stream in [None, Some(true)] {
        let n = 3usize;
        let ranks = world(n as u32, ShmOptions { stream, ..small_opts() }).await;
        let block = 3000; // 12 KB per rank: pieces of a 4 KiB window
        let all: Vec<i32> = (0..(n * block) as i32).map(|x| x * 5 - 7).collect();
        let scattered: Vec<_> = (0..n)
            .map(|r| {
                let input = (r == 1).then(|| HostBuffer::from_slice(&all));
                ranks[r].submit(Scatter { output: HostBuffer::zeroed(comm_core::DType::I32, block), input, root: 1 })
            })
            .collect();
        for (r, w) in scattered.into_iter().enumerate() {
            let got = w.await.unwrap().output.to_vec::<i32>().unwrap();
            assert_eq!(got, all[r * block..(r + 1) * block], "scatter to rank {r}, stream {stream:?}");
        }
        let gathered: Vec<_> = (0..n)
            .map(|r| {
                let input = HostBuffer::from_slice(&all[r * block..(r + 1) * block]);
                ranks[r].submit(Gather { input, output: None, root: 2 })
            })
            .collect();
        for (r, w) in gathered.into_iter().enumerate() {
            let out = w.await.unwrap().output;
            if r == 2 {
                assert_eq!(out.to_vec::<i32>().unwrap(), all, "gather, stream {stream:?}");
            }
        }
    }
}

/// Mailbox chunks of 16 KiB or more take successive places in their slot
/// (`Layout::msg_data`): a run of messages of mixed sizes, whole and partial chunks, both
/// ways, puts them everywhere in it; a reader that looks one place off gets the wrong data.
/// Also with every chunk written by streaming stores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mailbox_chunks_at_every_place_in_the_slot() {
    for stream in [None, Some(true)] {
        mailbox_run(ShmOptions { p2p_slot: Some(64 << 10), stream, ..small_opts() }).await;
    }
}

async fn mailbox_run(opts: ShmOptions) {
    let ranks = world(2, opts).await;
    let msg = |bytes: usize, k: i32| HostBuffer::from_slice(&(0..bytes as i32 / 4).map(|x| x ^ k).collect::<Vec<_>>());
    let sizes = [16 << 10, 20_000, 40_000, (64 << 10) + 12_000, 3000, 17_000, 33_000];
    for i in 0..60 {
        let bytes = sizes[i % sizes.len()];
        let (a, b) = (msg(bytes, i as i32), msg(bytes, !(i as i32)));
        let sends = [
            ranks[0].submit(SendTo { buf: a.clone(), dst: 1, tag: 2 }),
            ranks[1].submit(SendTo { buf: b.clone(), dst: 0, tag: 2 }),
        ];
        let zero = || HostBuffer::zeroed(comm_core::DType::I32, bytes / 4);
        let got1 = ranks[1].submit(RecvFrom { buf: zero(), src: 0, tag: 2 });
        let got0 = ranks[0].submit(RecvFrom { buf: zero(), src: 1, tag: 2 });
        assert_eq!(got1.await.unwrap(), a, "message {i} of {bytes} bytes to rank 1");
        assert_eq!(got0.await.unwrap(), b, "message {i} of {bytes} bytes to rank 0");
        for s in sends {
            s.await.unwrap();
        }
    }
}

/// A large send whose receiver posts the recv only after a pause, during which both ranks
/// run inline collectives: the receiver's worker sleeps through the sender's ring (nothing was
/// in flight there) and must still pick the message up once the recv is posted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recv_posted_late_after_quiet_collectives() {
    let ranks = world(2, small_opts()).await;
    let n = 20_000usize; // 80 KB: 20 mailbox slots of 4 KiB
    let a = HostBuffer::from_slice(&(0..n as i32).map(|x| x * 7).collect::<Vec<_>>());
    let sent = ranks[0].submit(SendTo { buf: a.clone(), dst: 1, tag: 9 });
    for _ in 0..50 {
        let x = ranks[0].submit(AllReduce { buf: HostBuffer::from_slice(&[1.0f32]), op: ReduceOp::Sum });
        let y = ranks[1].submit(AllReduce { buf: HostBuffer::from_slice(&[2.0f32]), op: ReduceOp::Sum });
        assert_eq!(x.await.unwrap().to_vec::<f32>().unwrap(), [3.0]);
        assert_eq!(y.await.unwrap().to_vec::<f32>().unwrap(), [3.0]);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let got = tokio::time::timeout(
        Duration::from_secs(5),
        ranks[1].submit(RecvFrom { buf: HostBuffer::zeroed(comm_core::DType::I32, n), src: 0, tag: 9 }),
    )
    .await
    .expect("the late recv completes");
    assert_eq!(got.unwrap(), a);
    sent.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_names_the_missing_rank() {
    let mut o = small_opts();
    o.timeout = Duration::from_millis(300);
    let ranks = world(3, o).await;
    let t = std::time::Instant::now();
    let a = ranks[0].submit(Barrier);
    let b = ranks[1].submit(Barrier);
    let e = a.await.unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(e.to_string().contains("rank 2"), "{e}");
    let _ = b.await;
}

/// A recv that does not match the send fails with `Mismatch` (the truth), one that nobody
/// sends to with `Timeout`; only ops after them see `Poisoned`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2p_failures_carry_their_real_cause() {
    let ranks = world(2, small_opts()).await;
    let send = ranks[0].submit(SendTo { buf: HostBuffer::from_slice(&[1i32, 2, 3]), dst: 1, tag: 5 });
    let recv = ranks[1].submit(RecvFrom { buf: HostBuffer::zeroed(comm_core::DType::I32, 4), src: 0, tag: 5 });
    let r = recv.await;
    assert!(matches!(r, Err(CommError::Mismatch { .. })), "{r:?}");
    let msg = r.unwrap_err().to_string();
    assert!(msg.contains("12 bytes") && msg.contains("16 bytes"), "{msg}");
    drop(send);
    let later = ranks[1].submit(RecvFrom { buf: HostBuffer::zeroed(comm_core::DType::I32, 3), src: 0, tag: 5 }).await;
    assert!(matches!(later, Err(CommError::Poisoned { .. })), "{later:?}");

    let opts = ShmOptions { timeout: Duration::from_millis(300), ..small_opts() };
    let ranks = world(2, opts).await;
    let r = ranks[1].submit(RecvFrom { buf: HostBuffer::zeroed(comm_core::DType::U8, 1), src: 0, tag: 0 }).await;
    assert!(matches!(r, Err(CommError::Timeout { .. })), "{r:?}");
    let later = ranks[1].submit(Barrier).await;
    assert!(matches!(later, Err(CommError::Poisoned { .. })), "{later:?}");
}

/// This thread's CPU affinity set to `cpus` (util-linux `taskset` on our thread id).
fn bind_this_thread(cpus: &str) -> bool {
    let me = std::fs::read_link("/proc/thread-self").ok();
    let tid = me.as_ref().and_then(|p| p.file_name()).map(|t| t.to_string_lossy().into_owned());
    tid.is_some_and(|tid| {
        std::process::Command::new("taskset")
            .args(["-p", "-c", cpus, &tid])
            .stdout(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

/// Ranks that a launcher binds to one core each (each sees one CPU) still spin: together they
/// have a core apiece. Two ranks bound to the same core do not.
#[test]
fn bound_ranks_spin_unless_they_share_a_core() {
    let Some(own) = comm_core::cpus::CpuSet::allowed().filter(|c| c.len() >= 2) else {
        println!("skipped: fewer than two CPUs to bind ranks to");
        return;
    };
    let first_two: Vec<String> = own.iter().take(2).map(|c| c.to_string()).collect();
    for (cpus, spins) in [([first_two[0].as_str(), first_two[1].as_str()], true), ([first_two[0].as_str(); 2], false)] {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let ranks: Vec<_> = (0..2u32)
            .map(|r| {
                let (store, cpu) = (store.clone(), cpus[r as usize].to_owned());
                std::thread::spawn(move || {
                    if !bind_this_thread(&cpu) {
                        return None;
                    }
                    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                    Some(rt.block_on(ShmBackend::new(store, r, 2, ShmOptions::default())).unwrap())
                })
            })
            .collect();
        let ranks: Vec<_> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
        if ranks.iter().any(Option::is_none) {
            println!("skipped: `taskset` could not bind a thread");
            return;
        }
        for b in ranks.iter().flatten() {
            // (Unless a CPU quota on this process allows only one thread at a time.)
            let quota_one = std::thread::available_parallelism().map_or(1, |n| n.get()) < 2;
            assert_eq!(b.spin() > Duration::ZERO, spins && !quota_one, "ranks on CPUs {cpus:?}");
        }
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(futures::future::join_all(ranks.iter().flatten().map(|b| b.shutdown())));
    }
}

/// The CPUs each thread of this process named `name` may run on.
fn thread_cpus(name: &str) -> Vec<String> {
    let tasks = std::fs::read_dir("/proc/self/task").unwrap();
    tasks
        .flatten()
        .filter(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == name))
        .filter_map(|t| {
            let status = std::fs::read_to_string(t.path().join("status")).ok()?;
            status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).map(|l| l.trim().to_owned())
        })
        .collect()
}

/// Asked to, each rank binds its worker thread to a core of its own; unasked on a machine with
/// room to spare, or told not to, it leaves them to the scheduler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_bound_to_cores_of_their_own() {
    if comm_core::cpus::CpuSet::allowed().is_none_or(|c| c.len() < 2) {
        println!("skipped: fewer than two CPUs");
        return;
    }
    let ranks = world(2, ShmOptions { pin: Some(true), ..small_opts() }).await;
    let cpus: Vec<usize> = ranks.iter().map(|b| b.worker_cpu().expect("a bound worker")).collect();
    assert_ne!(cpus[0], cpus[1]);
    for (r, cpu) in cpus.iter().enumerate() {
        // The worker binds itself when it starts, which on a busy machine can be a moment
        // after the group is up (and other tests' workers share the name).
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut seen = thread_cpus(&format!("comm-shm-r{r}"));
        while !seen.contains(&cpu.to_string()) && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
            seen = thread_cpus(&format!("comm-shm-r{r}"));
        }
        assert!(seen.contains(&cpu.to_string()), "rank {r}'s worker on CPU {cpu}: threads {seen:?}");
    }
    // Still a working group, and so are its sub-groups.
    let works: Vec<_> = ranks
        .iter()
        .map(|b| b.submit(AllReduce { buf: HostBuffer::from_slice(&[1.0f32; 5000]), op: ReduceOp::Sum }))
        .collect();
    for w in works {
        assert_eq!(w.await.unwrap().to_vec::<f32>().unwrap(), vec![2.0f32; 5000]);
    }
    let subs = futures::future::join_all(ranks.iter().map(|b| b.new_group(&[0, 1]))).await;
    let subs: Vec<_> = subs.into_iter().map(|s| s.unwrap().expect("a member")).collect();
    let works: Vec<_> = subs.iter().map(|b| b.submit(Barrier)).collect();
    for w in works {
        w.await.unwrap();
    }
    let ranks = world(2, ShmOptions { pin: Some(false), ..small_opts() }).await;
    assert!(ranks.iter().all(|b| b.worker_cpu().is_none()));
}

/// Two groups of the same ranks whose collectives the ranks submit in opposite orders (each
/// group has its own engine): both complete, at sizes of one step and of many.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_of_two_groups_in_opposite_orders_complete() {
    let ranks = world(2, small_opts()).await;
    let subs = futures::future::join_all(ranks.iter().map(|b| b.new_group(&[0, 1]))).await;
    let subs: Vec<_> = subs.into_iter().map(|s| s.unwrap().unwrap()).collect();
    for len in [4usize, 5000, 1 << 16] {
        for round in 0..20 {
            let ar = |g: &dyn comm_core::Backend, r: usize| {
                Collective::<AllReduce>::submit(
                    g,
                    AllReduce { buf: HostBuffer::from_slice(&vec![r as f32; len]), op: ReduceOp::Sum },
                )
            };
            let (a0, b0) = (ar(&ranks[0], 0), ar(&*subs[0], 0));
            let (b1, a1) = (ar(&*subs[1], 1), ar(&ranks[1], 1));
            let all = futures::future::join_all([a0, b0, b1, a1]);
            let done = tokio::time::timeout(Duration::from_secs(20), all).await.expect("no hang");
            for got in done {
                assert!(got.unwrap().to_vec::<f32>().unwrap().iter().all(|&x| x == 1.0), "len {len} round {round}");
            }
        }
    }
    for s in &subs {
        s.shutdown().await.unwrap();
    }
    for b in &ranks {
        b.shutdown().await.unwrap();
    }
}
