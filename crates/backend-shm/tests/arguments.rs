//! Property test over the ops' argument space, on real shm groups of 1-3 ranks in one process:
//! every well-formed call gives the reference result on every rank, and every malformed one
//! (lengths, split sums that overflow, roots, dtypes, reduce ops) is refused with
//! `InvalidArgument` on every rank — never a panic, a hang or a partly written output.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use backend_shm::{ShmBackend, ShmOptions};
use comm_core::ops::{AllGather, AllReduce, AllToAll, Broadcast, Gather, Reduce, ReduceScatter, Scatter};
use comm_core::{Collective, CommError, DType, Group, HostBuffer, MemoryStore, ReduceOp, Store, Work};
use comm_test::reference;
use proptest::prelude::*;

/// How a caller-provided buffer (output, or scatter's root input) deviates from the right one.
#[derive(Clone, Copy, Debug)]
enum Out {
    /// Not given (the op allocates).
    Absent,
    /// Exactly right.
    Right,
    /// This many elements more (positive) or fewer.
    Off(i8),
    /// Right length, another dtype.
    OtherDtype,
}

impl Out {
    fn is_bad(self) -> bool {
        matches!(self, Out::Off(_) | Out::OtherDtype)
    }
    /// The buffer for a correct length of `len` × `dtype`, or `None` when absent.
    fn make(self, dtype: DType, len: usize) -> Option<HostBuffer> {
        match self {
            Out::Absent => None,
            Out::Right => Some(HostBuffer::zeroed(dtype, len)),
            // Never a right-sized buffer: below zero goes up instead.
            Out::Off(d) => Some(HostBuffer::zeroed(
                dtype,
                len.checked_add_signed(d.into()).unwrap_or(len + d.unsigned_abs() as usize),
            )),
            Out::OtherDtype => Some(HostBuffer::zeroed(if dtype == DType::F32 { DType::I32 } else { DType::F32 }, len)),
        }
    }
}

fn out_spec(allow_absent: bool) -> impl Strategy<Value = Out> {
    let off = prop_oneof![(-3i8..=-1).boxed(), (1i8..=3).boxed()].prop_map(Out::Off);
    prop_oneof![
        3 => Just(if allow_absent { Out::Absent } else { Out::Right }),
        3 => Just(Out::Right),
        1 => off,
        1 => Just(Out::OtherDtype),
    ]
}

/// An all_to_all's block sizes: equal, or a matrix `m[i][j]` = elements rank `i` sends to `j`.
#[derive(Clone, Debug)]
enum Splits {
    Equal { block: usize, out: Out },
    Matrix { m: Vec<Vec<usize>>, with_output: bool, fault: SplitFault },
}

#[derive(Clone, Copy, Debug)]
enum SplitFault {
    None,
    /// Every rank's input_splits start with `usize::MAX`: their sum overflows.
    Overflow,
    /// Every rank expects one element more from itself than it sends itself.
    SelfBlock,
    /// Every rank's output buffer is one element too long for its output_splits.
    OutputLen,
}

#[derive(Clone, Debug)]
enum Case {
    AllReduce { dtype: DType, len: usize, op: ReduceOp },
    Broadcast { dtype: DType, len: usize, root: u32 },
    Reduce { dtype: DType, len: usize, op: ReduceOp, root: u32 },
    AllGather { dtype: DType, len: usize, out: Out },
    ReduceScatter { dtype: DType, block: usize, extra: usize, op: ReduceOp, out: Out },
    AllToAll { dtype: DType, splits: Splits },
    Scatter { dtype: DType, block: usize, root: u32, input: Out },
    Gather { dtype: DType, len: usize, root: u32, out: Out },
}

const MAX_LEN: usize = 1500;

fn dtype() -> impl Strategy<Value = DType> {
    proptest::sample::select(DType::ALL.to_vec())
}

fn redop() -> impl Strategy<Value = ReduceOp> {
    proptest::sample::select(ReduceOp::ALL.to_vec())
}

/// Roots are mostly in range; 3 is out of range for every group here.
fn root() -> impl Strategy<Value = u32> {
    prop_oneof![4 => 0u32..3, 1 => Just(3u32)]
}

fn splits(n: usize) -> impl Strategy<Value = Splits> {
    let equal = (0usize..MAX_LEN / 3, out_spec(true)).prop_map(|(block, out)| Splits::Equal { block, out });
    let fault = prop_oneof![
        4 => Just(SplitFault::None),
        1 => Just(SplitFault::Overflow),
        1 => Just(SplitFault::SelfBlock),
        1 => Just(SplitFault::OutputLen),
    ];
    let matrix = (proptest::collection::vec(proptest::collection::vec(0usize..400, n), n), any::<bool>(), fault)
        .prop_map(|(m, with_output, fault)| Splits::Matrix { m, with_output, fault });
    prop_oneof![equal, matrix]
}

fn case(n: usize) -> impl Strategy<Value = Case> {
    let len = || 0usize..MAX_LEN;
    prop_oneof![
        (dtype(), len(), redop()).prop_map(|(dtype, len, op)| Case::AllReduce { dtype, len, op }),
        (dtype(), len(), root()).prop_map(|(dtype, len, root)| Case::Broadcast { dtype, len, root }),
        (dtype(), len(), redop(), root()).prop_map(|(dtype, len, op, root)| Case::Reduce { dtype, len, op, root }),
        (dtype(), 0usize..MAX_LEN / 3, out_spec(true)).prop_map(|(dtype, len, out)| Case::AllGather {
            dtype,
            len,
            out
        }),
        (dtype(), 0usize..MAX_LEN / 3, prop_oneof![3 => Just(0usize), 1 => 1usize..3], redop(), out_spec(true))
            .prop_map(|(dtype, block, extra, op, out)| Case::ReduceScatter { dtype, block, extra, op, out }),
        (dtype(), splits(n)).prop_map(|(dtype, splits)| Case::AllToAll { dtype, splits }),
        (dtype(), 0usize..MAX_LEN / 3, root(), out_spec(false)).prop_map(|(dtype, block, root, input)| Case::Scatter {
            dtype,
            block,
            root,
            input
        }),
        (dtype(), 0usize..MAX_LEN / 3, root(), out_spec(true)).prop_map(|(dtype, len, root, out)| Case::Gather {
            dtype,
            len,
            root,
            out
        }),
    ]
}

/// Each rank's request and, when the call is well formed, the reference outputs.
struct Planned {
    works: Vec<Work<HostBuffer>>,
    want: Option<Vec<HostBuffer>>,
}

fn refs(v: &[HostBuffer]) -> Vec<&HostBuffer> {
    v.iter().collect()
}

fn issue(ranks: &[ShmBackend], case: &Case, salt: u64) -> Planned {
    let n = ranks.len();
    let nu = n as u32;
    let bad_root = |root: u32| root >= nu;
    let data = |dtype, len, op| reference::inputs_for(op, dtype, len, nu, salt);
    match case.clone() {
        Case::AllReduce { dtype, len, op } => {
            let ins = data(dtype, len, op);
            let want = op.applies_to(dtype).then(|| reference::all_reduce(&refs(&ins), op));
            let works = ranks.iter().zip(&ins).map(|(b, x)| b.submit(AllReduce { buf: x.clone(), op })).collect();
            Planned { works, want }
        }
        Case::Broadcast { dtype, len, root } => {
            let ins = data(dtype, len, ReduceOp::Sum);
            let want = (!bad_root(root)).then(|| reference::broadcast(&refs(&ins), root));
            let works = ranks.iter().zip(&ins).map(|(b, x)| b.submit(Broadcast { buf: x.clone(), root })).collect();
            Planned { works, want }
        }
        Case::Reduce { dtype, len, op, root } => {
            let ins = data(dtype, len, op);
            let ok = op.applies_to(dtype) && !bad_root(root);
            let want = ok.then(|| reference::reduce_to_root(&refs(&ins), op, root));
            let works = ranks.iter().zip(&ins).map(|(b, x)| b.submit(Reduce { buf: x.clone(), op, root })).collect();
            Planned { works, want }
        }
        Case::AllGather { dtype, len, out } => {
            let ins = data(dtype, len, ReduceOp::Sum);
            let want = (!out.is_bad()).then(|| reference::all_gather(&refs(&ins)));
            let works = ranks
                .iter()
                .zip(&ins)
                .map(|(b, x)| {
                    b.submit(AllGather { input: x.clone(), output: out.make(dtype, len * n) }).map(|io| io.output)
                })
                .collect();
            Planned { works, want }
        }
        Case::ReduceScatter { dtype, block, extra, op, out } => {
            let len = block * n + if n > 1 { extra } else { 0 };
            let ins = data(dtype, len, op);
            let ok = op.applies_to(dtype) && len.is_multiple_of(n) && !out.is_bad();
            let want = ok.then(|| reference::reduce_scatter(&refs(&ins), op));
            let works = ranks
                .iter()
                .zip(&ins)
                .map(|(b, x)| {
                    b.submit(ReduceScatter { input: x.clone(), op, output: out.make(dtype, len / n) })
                        .map(|io| io.output)
                })
                .collect();
            Planned { works, want }
        }
        Case::AllToAll { dtype, splits: Splits::Equal { block, out } } => {
            let ins = data(dtype, block * n, ReduceOp::Sum);
            let want = (!out.is_bad()).then(|| reference::all_to_all_equal(&refs(&ins)));
            let works = ranks
                .iter()
                .zip(&ins)
                .map(|(b, x)| {
                    let output = out.make(dtype, block * n);
                    b.submit(AllToAll { input: x.clone(), output, input_splits: None, output_splits: None })
                        .map(|io| io.output)
                })
                .collect();
            Planned { works, want }
        }
        Case::AllToAll { dtype, splits: Splits::Matrix { m, with_output, fault } } => {
            let row = |i: usize| m[i].clone();
            let col = |j: usize| (0..n).map(|i| m[i][j]).collect::<Vec<_>>();
            let ins: Vec<HostBuffer> =
                (0..n).map(|i| reference::input(dtype, row(i).iter().sum(), i as u32, salt)).collect();
            let want = matches!(fault, SplitFault::None).then(|| {
                let rows: Vec<Vec<usize>> = (0..n).map(row).collect();
                reference::all_to_all(&refs(&ins), &rows)
            });
            let works = ranks
                .iter()
                .zip(&ins)
                .enumerate()
                .map(|(me, (b, x))| {
                    let (mut input_splits, mut output_splits) = (row(me), col(me));
                    let mut out_len: usize = output_splits.iter().sum();
                    let mut output = with_output;
                    match fault {
                        SplitFault::None => {}
                        SplitFault::Overflow => input_splits[0] = usize::MAX,
                        SplitFault::SelfBlock => output_splits[me] += 1,
                        SplitFault::OutputLen => {
                            out_len += 1;
                            output = true;
                        }
                    }
                    let output = output.then(|| HostBuffer::zeroed(dtype, out_len));
                    let output_splits = Some(output_splits);
                    b.submit(AllToAll { input: x.clone(), output, input_splits: Some(input_splits), output_splits })
                        .map(|io| io.output)
                })
                .collect();
            Planned { works, want }
        }
        Case::Scatter { dtype, block, root, input } => {
            // Only the root can see that its input is wrong; the others would wait for it until
            // their timeout, so a bad root input is tested where the root is the whole group.
            let input = if n > 1 && input.is_bad() { Out::Right } else { input };
            let all = reference::input(dtype, block * n, 0, salt);
            let ok = !bad_root(root) && !input.is_bad();
            let want = ok.then(|| reference::scatter(&all, nu));
            let works = ranks
                .iter()
                .enumerate()
                .map(|(r, b)| {
                    let given = if r as u32 == root { input.make(dtype, block * n) } else { None };
                    let given = given.map(|mut g| {
                        let k = g.byte_len().min(all.byte_len());
                        g.as_bytes_mut()[..k].copy_from_slice(&all.as_bytes()[..k]);
                        g
                    });
                    b.submit(Scatter { output: HostBuffer::zeroed(dtype, block), input: given, root })
                        .map(|io| io.output)
                })
                .collect();
            Planned { works, want }
        }
        Case::Gather { dtype, len, root, out } => {
            // As for scatter: only the root checks its output.
            let out = if n > 1 && out.is_bad() { Out::Right } else { out };
            let ins = data(dtype, len, ReduceOp::Sum);
            let ok = !bad_root(root) && !out.is_bad();
            let want = ok.then(|| reference::gather(&refs(&ins), root));
            let works = ranks
                .iter()
                .zip(&ins)
                .enumerate()
                .map(|(r, (b, x))| {
                    // A caller-provided output only matters (and is only checked) on the root.
                    let output = if r as u32 == root { out.make(dtype, len * n) } else { None };
                    b.submit(Gather { input: x.clone(), output, root }).map(|io| io.output)
                })
                .collect();
            Planned { works, want }
        }
    }
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap())
}

async fn world(n: u32, stream: bool) -> Vec<ShmBackend> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    // Small windows so that most sizes take the chunked paths as well as the one-step ones;
    // window copies with streaming stores in half the cases.
    let opts = ShmOptions {
        window: 4096,
        p2p_slot: Some(4096),
        small_max: Some(1024),
        timeout: Duration::from_secs(20),
        stream: stream.then_some(true),
        ..Default::default()
    };
    let futs = (0..n).map(|r| {
        let (store, opts) = (store.clone(), opts.clone());
        tokio::spawn(async move { ShmBackend::new(store, r, n, opts).await })
    });
    futures::future::join_all(futs).await.into_iter().map(|r| r.unwrap().unwrap()).collect()
}

fn check(n: u32, case: &Case, salt: u64) -> Result<(), TestCaseError> {
    runtime().block_on(async {
        let ranks = world(n, salt % 2 == 1).await;
        let Planned { works, want } = issue(&ranks, case, salt);
        let got = futures::future::join_all(works).await;
        for (r, g) in got.into_iter().enumerate() {
            match (&want, g) {
                (Some(want), Ok(out)) => {
                    reference::compare(&out, &want[r], &format!("{case:?}"), r as u32).map_err(TestCaseError::fail)?
                }
                (None, Err(CommError::InvalidArgument { .. })) => {}
                (Some(_), Err(e)) => prop_assert!(false, "rank {r}: well-formed call refused: {e}"),
                (None, other) => {
                    prop_assert!(false, "rank {r}: malformed call not refused with InvalidArgument: {other:?}")
                }
            }
        }
        // A refused call leaves the group usable, and nothing is left in flight.
        let barriers: Vec<_> = ranks.iter().map(|b| b.submit(comm_core::ops::Barrier)).collect();
        for w in barriers {
            w.await.map_err(|e| TestCaseError::fail(format!("group unusable after {case:?}: {e}")))?;
        }
        for b in &ranks {
            b.shutdown().await.map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn any_accepted_call_matches_the_reference_and_any_other_is_refused(
        (n, case) in (1u32..=3).prop_flat_map(|n| (Just(n), case(n as usize))),
        salt in any::<u64>(),
    ) {
        check(n, &case, salt)?;
    }
}
