//! What each benchmarked collective moves (nccl-tests' size conventions), its bus-bandwidth
//! factor, and the known inputs / expected outputs of the checked iteration.

use std::fmt;

use comm_api::{bf16, f16, CommError, DType, Element, HostBuffer, ReduceOp};

/// A benchmarked collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Coll {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    AllToAll,
    Reduce,
    /// Every rank sends its buffer to the next rank and receives the previous one's (nccl-tests'
    /// `sendrecv_perf`): point-to-point, posted together as one batch.
    SendRecv,
    /// The root's buffer, block `r` to rank `r` (torch's `scatter`; no nccl-tests counterpart:
    /// sized and counted like all_gather).
    Scatter,
    /// Every rank's block to the root, in rank order (torch's `gather`; like all_gather).
    Gather,
}

impl Coll {
    pub(crate) const ALL: [Coll; 9] = [
        Coll::AllReduce,
        Coll::AllGather,
        Coll::ReduceScatter,
        Coll::Broadcast,
        Coll::AllToAll,
        Coll::Reduce,
        Coll::SendRecv,
        Coll::Scatter,
        Coll::Gather,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Coll::AllReduce => "all_reduce",
            Coll::AllGather => "all_gather",
            Coll::ReduceScatter => "reduce_scatter",
            Coll::Broadcast => "broadcast",
            Coll::AllToAll => "all_to_all",
            Coll::Reduce => "reduce",
            Coll::SendRecv => "sendrecv",
            Coll::Scatter => "scatter",
            Coll::Gather => "gather",
        }
    }

    pub(crate) fn parse(s: &str) -> Result<Coll, String> {
        let norm: String = s.trim().to_ascii_lowercase().chars().filter(|c| *c != '_' && *c != '-').collect();
        Ok(match norm.as_str() {
            "allreduce" => Coll::AllReduce,
            "allgather" | "allgatherintotensor" => Coll::AllGather,
            "reducescatter" | "reducescattertensor" => Coll::ReduceScatter,
            "broadcast" | "bcast" => Coll::Broadcast,
            "alltoall" | "alltoallsingle" => Coll::AllToAll,
            "reduce" => Coll::Reduce,
            "sendrecv" => Coll::SendRecv,
            "scatter" => Coll::Scatter,
            "gather" => Coll::Gather,
            _ => {
                let names: Vec<_> = Coll::ALL.iter().map(|c| c.name()).collect();
                return Err(format!("unknown op `{s}` (expected {} or all)", names.join(", ")));
            }
        })
    }

    /// Whether the op combines values with a reduce op.
    pub(crate) fn reduces(self) -> bool {
        matches!(self, Coll::AllReduce | Coll::ReduceScatter | Coll::Reduce)
    }

    /// Whether the op has a root rank.
    pub(crate) fn rooted(self) -> bool {
        matches!(self, Coll::Broadcast | Coll::Reduce | Coll::Scatter | Coll::Gather)
    }

    /// Whether the op works in place on one buffer (else: consumed input, reused output).
    pub(crate) fn in_place(self) -> bool {
        matches!(self, Coll::AllReduce | Coll::Broadcast | Coll::Reduce)
    }

    /// busbw = algbw × this (nccl-tests' `*GetBw`), for `n` ranks.
    pub(crate) fn bus_factor(self, n: u32) -> f64 {
        let n = f64::from(n);
        match self {
            Coll::AllReduce => 2.0 * (n - 1.0) / n,
            Coll::AllGather | Coll::ReduceScatter | Coll::AllToAll | Coll::Scatter | Coll::Gather => (n - 1.0) / n,
            Coll::Broadcast | Coll::Reduce | Coll::SendRecv => 1.0,
        }
    }
}

impl fmt::Display for Coll {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The buffers of one benchmark row, sized from a requested byte count as nccl-tests does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shape {
    /// The `count` column: elements per call as nccl-tests reports them (the per-rank count
    /// for all_gather / reduce_scatter, the per-peer count for all_to_all).
    pub(crate) count: usize,
    /// Elements of the input buffer.
    pub(crate) in_len: usize,
    /// Elements of the output buffer (out-of-place ops), or 0.
    pub(crate) out_len: usize,
    /// S, the `size` column and the numerator of algbw.
    pub(crate) bytes: usize,
}

/// Sizes the buffers for `size` requested bytes on `n` ranks, or `None` when that is less than
/// one element per rank. `count = size / T`; ops that partition the buffer use
/// `(count / n)` rounded down to a multiple of 16 bytes per rank (nccl-tests' `setupArgs`),
/// so the bytes actually moved can be slightly below the requested size.
pub(crate) fn shape(coll: Coll, dtype: DType, size: usize, n: u32) -> Option<Shape> {
    let t = dtype.size();
    let n = n as usize;
    let count = size / t;
    let part = || {
        let align = (16 / t).max(1);
        (count / n) / align * align
    };
    let s = match coll {
        Coll::AllReduce | Coll::Broadcast | Coll::Reduce => {
            Shape { count, in_len: count, out_len: 0, bytes: count * t }
        }
        // S = the message each rank sends (and receives); it needs a peer.
        Coll::SendRecv if n < 2 => return None,
        Coll::SendRecv => Shape { count, in_len: count, out_len: count, bytes: count * t },
        // count per rank; input = count, output = n·count; S = full output.
        Coll::AllGather => {
            let c = part();
            Shape { count: c, in_len: c, out_len: c * n, bytes: c * n * t }
        }
        // count per rank; the root's input = n·count, each output = count; S = the root's input.
        Coll::Scatter => {
            let c = part();
            Shape { count: c, in_len: c * n, out_len: c, bytes: c * n * t }
        }
        // count per rank; each input = count, the root's output = n·count; S = the root's output.
        Coll::Gather => {
            let c = part();
            Shape { count: c, in_len: c, out_len: c * n, bytes: c * n * t }
        }
        // count = per-rank output; input = n·count; S = full input.
        Coll::ReduceScatter => {
            let c = part();
            Shape { count: c, in_len: c * n, out_len: c, bytes: c * n * t }
        }
        // count per peer; input = output = n·count; S = per-rank send buffer.
        Coll::AllToAll => {
            let c = part();
            Shape { count: c, in_len: c * n, out_len: c * n, bytes: c * n * t }
        }
    };
    (s.count > 0).then_some(s)
}

/// A number type the benchmark fills and checks; every value used is a small integer, exact
/// in every dtype.
trait Num: Element + Copy {
    fn from_i64(v: i64) -> Self;
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
}

macro_rules! num_int {
    ($($t:ty),*) => {$(
        impl Num for $t {
            fn from_i64(v: i64) -> Self { v as $t } // wrapping, like the backends' integer ops
            fn from_f64(v: f64) -> Self { v as $t }
            fn to_f64(self) -> f64 { self as f64 }
        }
    )*};
}
num_int!(u8, i8, i32, i64);

impl Num for f32 {
    fn from_i64(v: i64) -> Self {
        v as f32
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}

impl Num for f64 {
    fn from_i64(v: i64) -> Self {
        v as f64
    }
    fn from_f64(v: f64) -> Self {
        v
    }
    fn to_f64(self) -> f64 {
        self
    }
}

macro_rules! num_half {
    ($($t:ty),*) => {$(
        impl Num for $t {
            fn from_i64(v: i64) -> Self { <$t>::from_f64(v as f64) }
            fn from_f64(v: f64) -> Self { <$t>::from_f64(v) }
            fn to_f64(self) -> f64 { <$t>::to_f64(self) }
        }
    )*};
}
num_half!(f16, bf16);

/// Runs `$body` with `$T` bound to the Rust type of `$dtype`.
macro_rules! with_num {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::U8 => {
                type $T = u8;
                $body
            }
            DType::I8 => {
                type $T = i8;
                $body
            }
            DType::I32 => {
                type $T = i32;
                $body
            }
            DType::I64 => {
                type $T = i64;
                $body
            }
            DType::F16 => {
                type $T = f16;
                $body
            }
            DType::BF16 => {
                type $T = bf16;
                $body
            }
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            other => return Err(CommError::invalid("comm-bench", format!("dtype {other} is not supported"))),
        }
    };
}

/// A small pseudo-random integer in `0..m`, a pure function of `(stream, i)`.
fn pat(stream: u64, i: usize, m: u64) -> i64 {
    let mut z = stream.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64).wrapping_add(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z % m) as i64
}

/// Values moved by the data-movement ops: 0..=100, exact in every dtype (i8, bf16 included).
const DATA_RANGE: u64 = 101;
/// Marks output elements the op should have written.
const SENTINEL: i64 = 111;

/// Element `i` of rank `r`'s contribution to a reduction: 0..=2 (1..=2 for products), so that
/// sums stay exact in bf16 and i8 for up to 63 ranks.
fn red_input(op: ReduceOp, r: u32, i: usize) -> i64 {
    match op {
        ReduceOp::Prod => 1 + pat(u64::from(r), i, 2),
        _ => pat(u64::from(r), i, 3),
    }
}

/// The expected reduction of element `i` over `n` ranks; `Avg` is returned as a sum (divide later).
fn red_expected(op: ReduceOp, n: u32, i: usize) -> i64 {
    let vals = (0..n).map(|r| red_input(op, r, i));
    match op {
        ReduceOp::Prod => vals.fold(1i64, i64::wrapping_mul),
        ReduceOp::Min => vals.min().unwrap_or(0),
        ReduceOp::Max => vals.max().unwrap_or(0),
        _ => vals.sum(),
    }
}

fn data_input(stream: u64, i: usize) -> i64 {
    pat(stream ^ 0x5EED, i, DATA_RANGE)
}

/// One row's parameters that the fill/check functions need.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Case {
    pub(crate) coll: Coll,
    pub(crate) dtype: DType,
    pub(crate) redop: ReduceOp,
    pub(crate) root: u32,
    pub(crate) shape: Shape,
    pub(crate) rank: u32,
    pub(crate) n: u32,
}

fn filled<T: Num>(len: usize, f: impl Fn(usize) -> i64) -> HostBuffer {
    let v: Vec<T> = (0..len).map(|i| T::from_i64(f(i))).collect();
    HostBuffer::from_slice(&v)
}

impl Case {
    /// This rank's input for the checked iteration (also used, before it is overwritten, by
    /// the timed iterations).
    pub(crate) fn input(&self) -> Result<HostBuffer, CommError> {
        let (r, n, len) = (self.rank, self.n, self.shape.in_len);
        let f: Box<dyn Fn(usize) -> i64> = match self.coll {
            Coll::AllReduce | Coll::Reduce | Coll::ReduceScatter => {
                let op = self.redop;
                Box::new(move |i| red_input(op, r, i))
            }
            Coll::AllGather | Coll::SendRecv | Coll::Gather => Box::new(move |i| data_input(u64::from(r), i)),
            // The root's block j is rank j's (other ranks' inputs are not passed).
            Coll::Scatter => {
                let k = self.shape.count;
                Box::new(move |x| data_input((x / k) as u64, x % k))
            }
            // Non-roots start with other data, which the broadcast must overwrite.
            Coll::Broadcast => {
                let stream = if r == self.root { u64::from(r) } else { u64::from(r) + 1000 };
                Box::new(move |i| data_input(stream, i))
            }
            Coll::AllToAll => {
                let k = self.shape.count;
                // Block j goes to rank j: element (r → j, i).
                Box::new(move |x| data_input(u64::from(r * n + (x / k) as u32), x % k))
            }
        };
        Ok(with_num!(self.dtype, T => filled::<T>(len, f)))
    }

    /// An output buffer full of a value the op never produces.
    pub(crate) fn sentinel_output(&self) -> Result<HostBuffer, CommError> {
        Ok(with_num!(self.dtype, T => filled::<T>(self.shape.out_len, |_| SENTINEL)))
    }

    /// How many elements of `got` (what the op handed back) differ from the expected result.
    pub(crate) fn count_wrong(&self, got: &HostBuffer) -> Result<u64, CommError> {
        with_num!(self.dtype, T => self.count_wrong_t::<T>(got.as_slice::<T>()?))
    }

    fn count_wrong_t<T: Num>(&self, got: &[T]) -> Result<u64, CommError> {
        let (r, n, k) = (self.rank, self.n, self.shape.count);
        let want_len = if self.coll.in_place() { self.shape.in_len } else { self.shape.out_len };
        if got.len() != want_len {
            return Ok(want_len.max(got.len()) as u64);
        }
        let op = self.redop;
        let want: Box<dyn Fn(usize) -> T> = match self.coll {
            Coll::AllReduce => Box::new(|i| reduced::<T>(op, n, i)),
            Coll::Reduce if r == self.root => Box::new(|i| reduced::<T>(op, n, i)),
            Coll::Reduce => Box::new(|i| T::from_i64(red_input(op, r, i))),
            Coll::ReduceScatter => Box::new(|i| reduced::<T>(op, n, r as usize * k + i)),
            Coll::AllGather => Box::new(|x| T::from_i64(data_input((x / k) as u64, x % k))),
            Coll::Gather if r == self.root => Box::new(|x| T::from_i64(data_input((x / k) as u64, x % k))),
            // A non-root's output buffer comes back untouched.
            Coll::Gather => Box::new(|_| T::from_i64(SENTINEL)),
            Coll::Scatter => Box::new(|i| T::from_i64(data_input(u64::from(r), i))),
            Coll::Broadcast => Box::new(|i| T::from_i64(data_input(u64::from(self.root), i))),
            // Block q came from rank q: its element (q → r, i).
            Coll::AllToAll => Box::new(|x| T::from_i64(data_input(u64::from((x / k) as u32 * n + r), x % k))),
            Coll::SendRecv => Box::new(|i| T::from_i64(data_input(u64::from((r + n - 1) % n), i))),
        };
        let tol = tolerance(self.dtype, op);
        Ok(got
            .iter()
            .enumerate()
            .filter(|&(i, g)| {
                let (g, w) = (g.to_f64(), want(i).to_f64());
                if tol == 0.0 {
                    g != w
                } else {
                    (g - w).abs() > tol * w.abs().max(1.0)
                }
            })
            .count() as u64)
    }
}

fn reduced<T: Num>(op: ReduceOp, n: u32, i: usize) -> T {
    let e = red_expected(op, n, i);
    if op == ReduceOp::Avg {
        T::from_f64(e as f64 / f64::from(n))
    } else {
        T::from_i64(e)
    }
}

/// Relative tolerance of the check: 0 (exact) except for `avg`, whose division rounds.
fn tolerance(dtype: DType, op: ReduceOp) -> f64 {
    if op != ReduceOp::Avg {
        return 0.0;
    }
    match dtype {
        DType::BF16 => 1.0 / 128.0,
        DType::F16 => 1.0 / 1024.0,
        DType::F32 => 1e-6,
        _ => 1e-12,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_tests_shapes() {
        // all_reduce / broadcast / reduce: the whole buffer.
        let s = shape(Coll::AllReduce, DType::F32, 1024, 4).unwrap();
        assert_eq!(s, Shape { count: 256, in_len: 256, out_len: 0, bytes: 1024 });
        // all_gather: per-rank count, S = full output.
        let s = shape(Coll::AllGather, DType::F32, 1024, 4).unwrap();
        assert_eq!(s, Shape { count: 64, in_len: 64, out_len: 256, bytes: 1024 });
        // reduce_scatter: per-rank output count, S = full input.
        let s = shape(Coll::ReduceScatter, DType::F32, 1024, 4).unwrap();
        assert_eq!(s, Shape { count: 64, in_len: 256, out_len: 64, bytes: 1024 });
        // all_to_all: per-peer count, S = per-rank send buffer.
        let s = shape(Coll::AllToAll, DType::BF16, 1024, 4).unwrap();
        assert_eq!(s, Shape { count: 128, in_len: 512, out_len: 512, bytes: 1024 });
        // 16-byte rounding of the per-rank count: 1000 B of f32 on 3 ranks → 250/3 = 83 → 80.
        let s = shape(Coll::AllGather, DType::F32, 1000, 3).unwrap();
        assert_eq!((s.count, s.bytes), (80, 960));
        // Too small: no row.
        assert_eq!(shape(Coll::AllGather, DType::F32, 8, 2), None);
        assert_eq!(shape(Coll::AllReduce, DType::F64, 4, 2), None);
        // sendrecv: the message each rank sends; nobody to send to alone.
        let s = shape(Coll::SendRecv, DType::F32, 1024, 4).unwrap();
        assert_eq!(s, Shape { count: 256, in_len: 256, out_len: 256, bytes: 1024 });
        assert_eq!(shape(Coll::SendRecv, DType::F32, 1024, 1), None);
        assert!(shape(Coll::AllReduce, DType::F32, 8, 2).is_some());
    }

    #[test]
    fn bus_factors() {
        assert_eq!(Coll::AllReduce.bus_factor(2), 1.0);
        assert_eq!(Coll::AllReduce.bus_factor(4), 1.5);
        assert_eq!(Coll::AllGather.bus_factor(4), 0.75);
        assert_eq!(Coll::Broadcast.bus_factor(8), 1.0);
    }

    #[test]
    fn op_names_parse() {
        for c in Coll::ALL {
            assert_eq!(Coll::parse(c.name()).unwrap(), c);
        }
        assert_eq!(Coll::parse("AllReduce").unwrap(), Coll::AllReduce);
        assert_eq!(Coll::parse("all_to_all_single").unwrap(), Coll::AllToAll);
        assert!(Coll::parse("gossip").is_err());
    }

    /// Simulates every rank and the op itself, then checks that the expectation agrees.
    #[test]
    fn checks_accept_correct_results_and_count_wrong_ones() {
        let n = 3u32;
        for dtype in [DType::F32, DType::BF16, DType::I8, DType::F64] {
            for coll in Coll::ALL {
                let shape = shape(coll, dtype, 480, n).unwrap();
                let case = |rank| Case { coll, dtype, redop: ReduceOp::Sum, root: 1, shape, rank, n };
                let inputs: Vec<Vec<f64>> = (0..n).map(|r| as_f64(&case(r).input().unwrap())).collect();
                for r in 0..n {
                    let c = case(r);
                    let k = shape.count;
                    let out: Vec<f64> = match coll {
                        Coll::AllReduce => (0..k).map(|i| inputs.iter().map(|v| v[i]).sum()).collect(),
                        Coll::Reduce if r == c.root => (0..k).map(|i| inputs.iter().map(|v| v[i]).sum()).collect(),
                        Coll::Reduce => inputs[r as usize].clone(),
                        Coll::Broadcast => inputs[c.root as usize].clone(),
                        Coll::AllGather => inputs.concat(),
                        Coll::ReduceScatter => {
                            (0..k).map(|i| inputs.iter().map(|v| v[r as usize * k + i]).sum()).collect()
                        }
                        Coll::AllToAll => inputs.iter().flat_map(|v| v[r as usize * k..][..k].to_vec()).collect(),
                        Coll::SendRecv => inputs[((r + n - 1) % n) as usize].clone(),
                        Coll::Scatter => inputs[c.root as usize][r as usize * k..][..k].to_vec(),
                        Coll::Gather if r == c.root => inputs.concat(),
                        Coll::Gather => vec![SENTINEL as f64; shape.out_len],
                    };
                    let mut buf = from_f64(dtype, &out);
                    assert_eq!(c.count_wrong(&buf).unwrap(), 0, "{coll} {dtype} rank {r}");
                    let mut bad = as_f64(&buf);
                    bad[0] += 1.0;
                    bad[k - 1] += 1.0;
                    buf = from_f64(dtype, &bad);
                    assert_eq!(c.count_wrong(&buf).unwrap(), if k > 1 { 2 } else { 1 }, "{coll} {dtype} rank {r}");
                }
            }
        }
    }

    #[test]
    fn every_redop_has_exact_expectations() {
        for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg] {
            let n = 2;
            let shape = shape(Coll::AllReduce, DType::F32, 64, n).unwrap();
            let inputs: Vec<Vec<f64>> = (0..n)
                .map(|r| {
                    let c = Case { coll: Coll::AllReduce, dtype: DType::F32, redop: op, root: 0, shape, rank: r, n };
                    as_f64(&c.input().unwrap())
                })
                .collect();
            let out: Vec<f64> = (0..shape.count)
                .map(|i| {
                    let (a, b) = (inputs[0][i], inputs[1][i]);
                    match op {
                        ReduceOp::Sum => a + b,
                        ReduceOp::Prod => a * b,
                        ReduceOp::Min => a.min(b),
                        ReduceOp::Max => a.max(b),
                        _ => (a + b) / 2.0,
                    }
                })
                .collect();
            let c = Case { coll: Coll::AllReduce, dtype: DType::F32, redop: op, root: 0, shape, rank: 0, n };
            assert_eq!(c.count_wrong(&from_f64(DType::F32, &out)).unwrap(), 0, "{op}");
        }
    }

    #[test]
    fn sentinel_is_never_a_valid_result() {
        let shape = shape(Coll::AllGather, DType::I8, 64, 2).unwrap();
        let c = Case { coll: Coll::AllGather, dtype: DType::I8, redop: ReduceOp::Sum, root: 0, shape, rank: 0, n: 2 };
        assert_eq!(c.count_wrong(&c.sentinel_output().unwrap()).unwrap(), shape.out_len as u64);
    }

    fn as_f64(b: &HostBuffer) -> Vec<f64> {
        fn go<T: Num>(b: &HostBuffer) -> Vec<f64> {
            b.as_slice::<T>().unwrap().iter().map(|x| x.to_f64()).collect()
        }
        match b.dtype() {
            DType::F32 => go::<f32>(b),
            DType::F64 => go::<f64>(b),
            DType::BF16 => go::<bf16>(b),
            DType::I8 => go::<i8>(b),
            d => panic!("{d}"),
        }
    }

    fn from_f64(dtype: DType, v: &[f64]) -> HostBuffer {
        fn go<T: Num>(v: &[f64]) -> HostBuffer {
            HostBuffer::from_slice(&v.iter().map(|&x| T::from_f64(x)).collect::<Vec<T>>())
        }
        match dtype {
            DType::F32 => go::<f32>(v),
            DType::F64 => go::<f64>(v),
            DType::BF16 => go::<bf16>(v),
            DType::I8 => go::<i8>(v),
            d => panic!("{d}"),
        }
    }
}
