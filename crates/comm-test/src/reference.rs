//! Plain sequential reference semantics: the spec every backend must match bit for bit.
//!
//! Reductions combine ranks in the fixed order `0, 1, .., n-1` (`acc = x0; acc = combine(acc, x1);
//! ...`), so a result never depends on timing or on the algorithm a backend picks:
//!
//! - `f16`/`bf16` accumulate in `f32` across all ranks and are rounded once at the end
//!   (round to nearest even); `f32` accumulates in `f32`, `f64` in `f64`.
//! - `Sum`/`Prod` on integers wrap.
//! - `Min` is `if x < acc { x } else { acc }`, `Max` is `if x > acc { x } else { acc }` (floats
//!   too, so `min(-0.0, 0.0)` keeps whichever came first).
//! - `Avg` (floats only) sums in the accumulator type, divides by `n` in that type, then rounds.
//! - `BAnd`/`BOr`/`BXor` on integers.
//!
//! Every function here takes *all* ranks' inputs (index = rank) and returns every rank's output,
//! so a test can regenerate the whole group's data on any rank with [`input`] and pick its own
//! row. They panic on arguments a backend must reject (mismatched dtypes or lengths, a reduce op
//! that does not apply to the dtype): validate requests before calling them.

use comm_core::{bf16, f16, DType, Element, HostBuffer, Rank, ReduceOp};

/// Elementwise reduction of every rank's buffer, in rank order (see the module docs).
///
/// # Panics
/// When `inputs` is empty, when the buffers differ in dtype or length, or when `op` does not
/// apply to the dtype.
pub fn reduce(inputs: &[&HostBuffer], op: ReduceOp) -> HostBuffer {
    let first = inputs.first().expect("reference::reduce needs at least one input");
    let (dtype, len) = (first.dtype(), first.len());
    for (r, b) in inputs.iter().enumerate() {
        assert!(
            b.dtype() == dtype && b.len() == len,
            "reference::reduce: rank {r} holds {} × {} but rank 0 holds {dtype} × {len}",
            b.dtype(),
            b.len()
        );
    }
    assert!(op.applies_to(dtype), "reference::reduce: {op} does not apply to {dtype}");
    match dtype {
        DType::U8 => fold::<u8, u8>(inputs, op, |x| x, |a| a),
        DType::I8 => fold::<i8, i8>(inputs, op, |x| x, |a| a),
        DType::I32 => fold::<i32, i32>(inputs, op, |x| x, |a| a),
        DType::I64 => fold::<i64, i64>(inputs, op, |x| x, |a| a),
        DType::F16 => fold::<f16, f32>(inputs, op, f16::to_f32, f16::from_f32),
        DType::BF16 => fold::<bf16, f32>(inputs, op, bf16::to_f32, bf16::from_f32),
        DType::F32 => fold::<f32, f32>(inputs, op, |x| x, |a| a),
        DType::F64 => fold::<f64, f64>(inputs, op, |x| x, |a| a),
        other => panic!("reference::reduce: dtype {other} is not known to comm-test"),
    }
}

/// The reduction of a group whose ranks sit on several hosts and reduce per host first (the
/// `hier` backend): each host's inputs in rank order (rounded to the dtype once), then the
/// host results in the order of `hosts` (rounded once more). `Avg` sums both ways and then
/// divides by the number of ranks (in `f32` for f16/bf16, rounding once more).
///
/// # Panics
/// As [`reduce`], and when a rank of `hosts` has no input.
pub fn reduce_grouped(inputs: &[&HostBuffer], op: ReduceOp, hosts: &[Vec<Rank>]) -> HostBuffer {
    let partial = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
    let per_host: Vec<HostBuffer> =
        hosts.iter().map(|h| reduce(&h.iter().map(|&r| inputs[r as usize]).collect::<Vec<_>>(), partial)).collect();
    let mut total = reduce(&per_host.iter().collect::<Vec<_>>(), partial);
    if op == ReduceOp::Avg {
        let n = inputs.len();
        fn each<T: Element>(b: &mut HostBuffer, f: impl Fn(T) -> T) {
            b.as_mut_slice::<T>().expect("dtype checked").iter_mut().for_each(|x| *x = f(*x));
        }
        match total.dtype() {
            DType::F16 => each::<f16>(&mut total, |x| f16::from_f32(x.to_f32() / n as f32)),
            DType::BF16 => each::<bf16>(&mut total, |x| bf16::from_f32(x.to_f32() / n as f32)),
            DType::F32 => each::<f32>(&mut total, |x| x / n as f32),
            DType::F64 => each::<f64>(&mut total, |x| x / n as f64),
            other => panic!("reference::reduce_grouped: avg does not apply to {other}"),
        }
    }
    total
}

/// Arithmetic of an accumulator type. Integer ops wrap; the ops that do not apply to a type
/// (`Avg` on integers, bitwise on floats) are never called because [`reduce`] checks first.
trait Arith: Copy + PartialOrd {
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn band(self, o: Self) -> Self;
    fn bor(self, o: Self) -> Self;
    fn bxor(self, o: Self) -> Self;
    fn div_n(self, n: usize) -> Self;
}

macro_rules! int_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            fn add(self, o: Self) -> Self { self.wrapping_add(o) }
            fn mul(self, o: Self) -> Self { self.wrapping_mul(o) }
            fn band(self, o: Self) -> Self { self & o }
            fn bor(self, o: Self) -> Self { self | o }
            fn bxor(self, o: Self) -> Self { self ^ o }
            fn div_n(self, _: usize) -> Self { unreachable!("avg is checked to apply to floats only") }
        }
    )*};
}
int_arith!(u8, i8, i32, i64);

macro_rules! float_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            fn add(self, o: Self) -> Self { self + o }
            fn mul(self, o: Self) -> Self { self * o }
            fn band(self, _: Self) -> Self { unreachable!("bitwise ops are checked to apply to integers only") }
            fn bor(self, _: Self) -> Self { unreachable!("bitwise ops are checked to apply to integers only") }
            fn bxor(self, _: Self) -> Self { unreachable!("bitwise ops are checked to apply to integers only") }
            fn div_n(self, n: usize) -> Self { self / n as $t }
        }
    )*};
}
float_arith!(f32, f64);

fn fold<T: Element, A: Arith>(inputs: &[&HostBuffer], op: ReduceOp, load: fn(T) -> A, store: fn(A) -> T) -> HostBuffer {
    let slice =
        |b: &HostBuffer| -> Vec<A> { b.as_slice::<T>().expect("dtype checked").iter().map(|&x| load(x)).collect() };
    let mut acc = slice(inputs[0]);
    for b in &inputs[1..] {
        let xs = b.as_slice::<T>().expect("dtype checked");
        let combine: fn(A, A) -> A = match op {
            ReduceOp::Sum | ReduceOp::Avg => A::add,
            ReduceOp::Prod => A::mul,
            ReduceOp::Min => |a, x| if x < a { x } else { a },
            ReduceOp::Max => |a, x| if x > a { x } else { a },
            ReduceOp::BAnd => A::band,
            ReduceOp::BOr => A::bor,
            ReduceOp::BXor => A::bxor,
            other => panic!("reference::reduce: reduce op {other} is not known to comm-test"),
        };
        for (a, &x) in acc.iter_mut().zip(xs) {
            *a = combine(*a, load(x));
        }
    }
    if op == ReduceOp::Avg {
        for a in &mut acc {
            *a = a.div_n(inputs.len());
        }
    }
    let out: Vec<T> = acc.into_iter().map(store).collect();
    HostBuffer::from_slice(&out)
}

/// `all_reduce`: every rank gets [`reduce`] of all inputs.
pub fn all_reduce(inputs: &[&HostBuffer], op: ReduceOp) -> Vec<HostBuffer> {
    vec![reduce(inputs, op); inputs.len()]
}

/// `broadcast`: every rank gets `root`'s input.
pub fn broadcast(inputs: &[&HostBuffer], root: Rank) -> Vec<HostBuffer> {
    vec![inputs[root as usize].clone(); inputs.len()]
}

/// `reduce`: the root gets the reduction; every other rank gets its input back unchanged.
pub fn reduce_to_root(inputs: &[&HostBuffer], op: ReduceOp, root: Rank) -> Vec<HostBuffer> {
    let reduced = reduce(inputs, op);
    (0..inputs.len()).map(|r| if r == root as usize { reduced.clone() } else { inputs[r].clone() }).collect()
}

/// `all_gather`: every rank gets the concatenation of all inputs in rank order.
pub fn all_gather(inputs: &[&HostBuffer]) -> Vec<HostBuffer> {
    vec![concat(inputs); inputs.len()]
}

/// `reduce_scatter`: every input (`n × k` elements) is reduced and rank `r` gets block `r`.
///
/// # Panics
/// When the length is not divisible by the number of ranks (and as [`reduce`]).
pub fn reduce_scatter(inputs: &[&HostBuffer], op: ReduceOp) -> Vec<HostBuffer> {
    let n = inputs.len();
    let reduced = reduce(inputs, op);
    assert!(
        reduced.len().is_multiple_of(n),
        "reference::reduce_scatter: length {} is not divisible by {n}",
        reduced.len()
    );
    let k = reduced.len() / n;
    (0..n).map(|r| slice(&reduced, r * k, k)).collect()
}

/// `all_to_all_single` with equal blocks: each input holds `n` equal blocks, block `j` goes to
/// rank `j`.
pub fn all_to_all_equal(inputs: &[&HostBuffer]) -> Vec<HostBuffer> {
    let n = inputs.len();
    let splits: Vec<Vec<usize>> = inputs.iter().map(|b| equal_splits(b.len(), n)).collect();
    all_to_all(inputs, &splits)
}

/// `all_to_all_single` with uneven blocks: rank `i`'s input is cut by `input_splits[i]` (one
/// count per destination); rank `j`'s output is the concatenation over `i` of block `i → j`.
///
/// # Panics
/// When a split list has the wrong number of entries or does not sum to its input's length.
pub fn all_to_all(inputs: &[&HostBuffer], input_splits: &[Vec<usize>]) -> Vec<HostBuffer> {
    let n = inputs.len();
    assert_eq!(input_splits.len(), n, "reference::all_to_all: one split list per rank");
    let blocks: Vec<Vec<HostBuffer>> = inputs
        .iter()
        .zip(input_splits)
        .enumerate()
        .map(|(i, (b, s))| {
            assert_eq!(s.len(), n, "reference::all_to_all: rank {i}'s splits need {n} entries");
            assert_eq!(
                s.iter().sum::<usize>(),
                b.len(),
                "reference::all_to_all: rank {i}'s splits must sum to its length"
            );
            let mut off = 0;
            s.iter()
                .map(|&c| {
                    off += c;
                    slice(b, off - c, c)
                })
                .collect()
        })
        .collect();
    (0..n).map(|j| concat(&blocks.iter().map(|row| &row[j]).collect::<Vec<_>>())).collect()
}

/// `scatter`: the root's input (`n × k` elements) is cut in rank order, rank `r` gets block `r`.
///
/// # Panics
/// When the length is not divisible by `world`.
pub fn scatter(root_input: &HostBuffer, world: u32) -> Vec<HostBuffer> {
    let n = world as usize;
    assert!(
        root_input.len().is_multiple_of(n),
        "reference::scatter: length {} is not divisible by {n}",
        root_input.len()
    );
    let k = root_input.len() / n;
    (0..n).map(|r| slice(root_input, r * k, k)).collect()
}

/// `gather`'s outputs: the root's is the concatenation in rank order; the others' are empty
/// (they passed no output).
pub fn gather(inputs: &[&HostBuffer], root: Rank) -> Vec<HostBuffer> {
    let all = concat(inputs);
    (0..inputs.len())
        .map(|r| if r == root as usize { all.clone() } else { HostBuffer::zeroed(inputs[r].dtype(), 0) })
        .collect()
}

/// `send`/`recv`: the sender gets its buffer back unchanged, the receiver a copy of it.
/// Returns `(sender's output, receiver's output)`.
pub fn send_recv(sent: &HostBuffer) -> (HostBuffer, HostBuffer) {
    (sent.clone(), sent.clone())
}

/// The concatenation of `parts` (all of one dtype) in order.
///
/// # Panics
/// When `parts` is empty or the dtypes differ.
pub fn concat(parts: &[&HostBuffer]) -> HostBuffer {
    let dtype = parts.first().expect("reference::concat needs at least one part").dtype();
    let mut bytes = Vec::with_capacity(parts.iter().map(|p| p.byte_len()).sum());
    for p in parts {
        assert_eq!(p.dtype(), dtype, "reference::concat: parts of different dtypes");
        bytes.extend_from_slice(p.as_bytes());
    }
    HostBuffer::from_bytes(dtype, &bytes).expect("whole elements")
}

/// Elements `start..start + len` of `buf`, copied.
///
/// # Panics
/// When the range is out of bounds.
pub fn slice(buf: &HostBuffer, start: usize, len: usize) -> HostBuffer {
    let s = buf.dtype().size();
    HostBuffer::from_bytes(buf.dtype(), &buf.as_bytes()[start * s..(start + len) * s]).expect("whole elements")
}

/// `n` equal counts that sum to `len` (`len / n` each; callers ensure divisibility).
pub fn equal_splits(len: usize, n: usize) -> Vec<usize> {
    vec![len / n; n]
}

/// A 64-bit mixer (splitmix64's finaliser): cheap, stateless, good enough for test data.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Which value range [`input_with`] draws floats from. Integers always span their full range
/// (wrapping is defined).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Values {
    /// Floats uniform in `[-4, 4)` with random low mantissa bits: sums of many ranks stay far
    /// from overflow while the rounding of every addition matters.
    #[default]
    Wide,
    /// Floats with magnitude in `[0.5, 1.5)` and a random sign, so a product over 8+ ranks stays
    /// in range even for `f16`.
    NearOne,
}

/// Deterministic pseudo-random data for `rank`'s buffer: any rank can regenerate any other
/// rank's input from `(dtype, len, rank, salt)`. Floats are [`Values::Wide`], never NaN or inf.
pub fn input(dtype: DType, len: usize, rank: Rank, salt: u64) -> HostBuffer {
    input_with(dtype, len, rank, salt, Values::Wide)
}

/// Like [`input`], with the value range chosen for reduce op `op` (near 1 for `Prod`).
pub fn input_for(op: ReduceOp, dtype: DType, len: usize, rank: Rank, salt: u64) -> HostBuffer {
    input_with(dtype, len, rank, salt, if op == ReduceOp::Prod { Values::NearOne } else { Values::Wide })
}

/// Every rank's [`input_for`] in a group of `world` ranks (index = rank).
pub fn inputs_for(op: ReduceOp, dtype: DType, len: usize, world: u32, salt: u64) -> Vec<HostBuffer> {
    (0..world).map(|r| input_for(op, dtype, len, r, salt)).collect()
}

/// Like [`input`], with an explicit value range.
pub fn input_with(dtype: DType, len: usize, rank: Rank, salt: u64, values: Values) -> HostBuffer {
    let seed = mix(mix(salt) ^ (u64::from(rank) << 32) ^ u64::from(dtype.code()));
    let bits = (0..len as u64).map(move |i| mix(seed ^ i.wrapping_mul(0xD1B5_4A32_D192_ED03)));
    // Wide: a random sign, a full random mantissa and an exponent in [-8, 1], so |x| < 4 and
    // every addition of values of different magnitudes rounds (the order of ranks matters).
    // NearOne: magnitude in [0.5, 1.5). Both exact in f32 before any conversion.
    let f32_of = move |b: u64| {
        let sign = if (b >> 8) & 1 == 0 { 1.0 } else { -1.0 };
        match values {
            Values::Wide => sign * (1.0 + (b >> 41) as f32 / (1u64 << 23) as f32) * 2f32.powi((b % 10) as i32 - 8),
            Values::NearOne => sign * (0.5 + (b >> 41) as f32 / (1u64 << 23) as f32),
        }
    };
    let f64_of = move |b: u64| {
        let sign = if (b >> 8) & 1 == 0 { 1.0 } else { -1.0 };
        let frac = (b >> 12) as f64 / (1u64 << 52) as f64;
        match values {
            Values::Wide => sign * (1.0 + frac) * 2f64.powi((b % 10) as i32 - 8),
            Values::NearOne => sign * (0.5 + frac),
        }
    };
    match dtype {
        DType::U8 => HostBuffer::from(bits.map(|b| b as u8).collect::<Vec<_>>()),
        DType::I8 => HostBuffer::from(bits.map(|b| b as i8).collect::<Vec<_>>()),
        DType::I32 => HostBuffer::from(bits.map(|b| b as i32).collect::<Vec<_>>()),
        DType::I64 => HostBuffer::from(bits.map(|b| b as i64).collect::<Vec<_>>()),
        DType::F16 => HostBuffer::from(bits.map(|b| f16::from_f32(f32_of(b))).collect::<Vec<_>>()),
        DType::BF16 => HostBuffer::from(bits.map(|b| bf16::from_f32(f32_of(b))).collect::<Vec<_>>()),
        DType::F32 => HostBuffer::from(bits.map(f32_of).collect::<Vec<_>>()),
        DType::F64 => HostBuffer::from(bits.map(f64_of).collect::<Vec<_>>()),
        other => panic!("reference::input: dtype {other} is not known to comm-test"),
    }
}

/// Element `i` of `buf` for messages: the value, and for floats also its bit pattern.
pub fn element_to_string(buf: &HostBuffer, i: usize) -> String {
    fn at<T: Element>(b: &HostBuffer, i: usize) -> T {
        b.as_slice::<T>().expect("dtype checked")[i]
    }
    match buf.dtype() {
        DType::U8 => at::<u8>(buf, i).to_string(),
        DType::I8 => at::<i8>(buf, i).to_string(),
        DType::I32 => at::<i32>(buf, i).to_string(),
        DType::I64 => at::<i64>(buf, i).to_string(),
        DType::F16 => {
            let v = at::<f16>(buf, i);
            format!("{:?} (0x{:04x})", v.to_f32(), v.to_bits())
        }
        DType::BF16 => {
            let v = at::<bf16>(buf, i);
            format!("{:?} (0x{:04x})", v.to_f32(), v.to_bits())
        }
        DType::F32 => {
            let v = at::<f32>(buf, i);
            format!("{v:?} (0x{:08x})", v.to_bits())
        }
        DType::F64 => {
            let v = at::<f64>(buf, i);
            format!("{v:?} (0x{:016x})", v.to_bits())
        }
        other => format!("<{other} element>"),
    }
}

/// Compares `got` with `want` byte for byte.
///
/// On a difference the message names `what` (the op and its parameters), `rank`, the dtype, the
/// lengths, the first differing index with both values, and how many elements differ.
pub fn compare(got: &HostBuffer, want: &HostBuffer, what: &str, rank: Rank) -> Result<(), String> {
    if got.dtype() != want.dtype() || got.len() != want.len() {
        return Err(format!(
            "{what}, rank {rank}: output is {} × {} but the reference is {} × {}",
            got.dtype(),
            got.len(),
            want.dtype(),
            want.len()
        ));
    }
    if got.as_bytes() == want.as_bytes() {
        return Ok(());
    }
    let size = got.dtype().size();
    let differs = |i: &usize| got.as_bytes()[i * size..(i + 1) * size] != want.as_bytes()[i * size..(i + 1) * size];
    let first = (0..got.len()).find(differs).expect("the bytes differ somewhere");
    let count = (0..got.len()).filter(differs).count();
    Err(format!(
        "{what}, rank {rank}: {} × {}: element {first} is {} but the reference is {} ({count} of {} elements differ)",
        got.dtype(),
        got.len(),
        element_to_string(got, first),
        element_to_string(want, first),
        got.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refs(v: &[HostBuffer]) -> Vec<&HostBuffer> {
        v.iter().collect()
    }

    #[test]
    fn bf16_sum_accumulates_in_f32_and_rounds_once() {
        // 1 + 2^-8 rounds back to 1 in bf16 (8 significant bits, tie to even), so summing pairwise
        // in bf16 gives 1; accumulating in f32 gives 1 + 2^-7, which bf16 holds exactly.
        let tiny = bf16::from_f32(1.0 / 256.0);
        let one = bf16::from_f32(1.0);
        let pairwise = bf16::from_f32(bf16::from_f32(one.to_f32() + tiny.to_f32()).to_f32() + tiny.to_f32());
        assert_eq!(pairwise.to_f32(), 1.0);
        let ins = [HostBuffer::from_slice(&[one]), HostBuffer::from_slice(&[tiny]), HostBuffer::from_slice(&[tiny])];
        let got = reduce(&refs(&ins), ReduceOp::Sum).to_vec::<bf16>().unwrap();
        assert_eq!(got[0].to_f32(), 1.0 + 1.0 / 128.0);
    }

    #[test]
    fn integers_wrap_and_bitwise() {
        let ins = [HostBuffer::from_slice(&[100i8, 16, -128]), HostBuffer::from_slice(&[100i8, 16, -1])];
        let third = HostBuffer::from_slice(&[100i8, 1, 1]);
        let all = [&ins[0], &ins[1], &third];
        assert_eq!(reduce(&all, ReduceOp::Sum).to_vec::<i8>().unwrap(), [44, 33, -128]);
        assert_eq!(reduce(&all[..2], ReduceOp::Prod).to_vec::<i8>().unwrap(), [16, 0, -128]);
        let u = [HostBuffer::from_slice(&[0b1100u8]), HostBuffer::from_slice(&[0b1010u8])];
        assert_eq!(reduce(&refs(&u), ReduceOp::BAnd).to_vec::<u8>().unwrap(), [0b1000]);
        assert_eq!(reduce(&refs(&u), ReduceOp::BOr).to_vec::<u8>().unwrap(), [0b1110]);
        assert_eq!(reduce(&refs(&u), ReduceOp::BXor).to_vec::<u8>().unwrap(), [0b0110]);
        assert_eq!(reduce(&refs(&u), ReduceOp::Min).to_vec::<u8>().unwrap(), [0b1010]);
        let big = [HostBuffer::from_slice(&[i64::MAX]), HostBuffer::from_slice(&[1i64])];
        assert_eq!(reduce(&refs(&big), ReduceOp::Sum).to_vec::<i64>().unwrap(), [i64::MIN]);
    }

    #[test]
    fn avg_min_max_on_floats() {
        let ins = [HostBuffer::from_slice(&[1.0f32, -0.0]), HostBuffer::from_slice(&[2.0f32, 0.0])];
        let third = HostBuffer::from_slice(&[4.0f32, -0.0]);
        let all = [&ins[0], &ins[1], &third];
        assert_eq!(reduce(&all, ReduceOp::Avg).to_vec::<f32>().unwrap()[0], 7.0f32 / 3.0);
        // Ties keep the earlier rank's value: the sign of zero shows the order.
        assert!(reduce(&all, ReduceOp::Min).to_vec::<f32>().unwrap()[1].is_sign_negative());
        assert!(reduce(&all, ReduceOp::Max).to_vec::<f32>().unwrap()[1].is_sign_negative());
        assert_eq!(reduce(&all, ReduceOp::Max).to_vec::<f32>().unwrap()[0], 4.0);
        // f16 avg: 1 + 2 + 2^-10 in f32, / 3, rounded once.
        let h =
            [f16::from_f32(1.0), f16::from_f32(2.0), f16::from_f32(1.0 / 1024.0)].map(|x| HostBuffer::from_slice(&[x]));
        let want = f16::from_f32((1.0 + 2.0 + 1.0 / 1024.0) / 3.0);
        assert_eq!(reduce(&refs(&h), ReduceOp::Avg).to_vec::<f16>().unwrap(), [want]);
    }

    #[test]
    fn layout_ops_on_small_examples() {
        let ins = [HostBuffer::from_slice(&[1i32, 2, 3, 4]), HostBuffer::from_slice(&[10i32, 20, 30, 40])];
        let rs = reduce_scatter(&refs(&ins), ReduceOp::Sum);
        assert_eq!(rs[0].to_vec::<i32>().unwrap(), [11, 22]);
        assert_eq!(rs[1].to_vec::<i32>().unwrap(), [33, 44]);
        let a2a = all_to_all_equal(&refs(&ins));
        assert_eq!(a2a[0].to_vec::<i32>().unwrap(), [1, 2, 10, 20]);
        assert_eq!(a2a[1].to_vec::<i32>().unwrap(), [3, 4, 30, 40]);
        // Uneven: rank 0 sends 0 to itself and 4 to rank 1; rank 1 sends 3 to rank 0, 1 to itself.
        let a2a = all_to_all(&refs(&ins), &[vec![0, 4], vec![3, 1]]);
        assert_eq!(a2a[0].to_vec::<i32>().unwrap(), [10, 20, 30]);
        assert_eq!(a2a[1].to_vec::<i32>().unwrap(), [1, 2, 3, 4, 40]);
        let g = gather(&refs(&ins), 1);
        assert_eq!(g[0].len(), 0);
        assert_eq!(g[1].to_vec::<i32>().unwrap(), [1, 2, 3, 4, 10, 20, 30, 40]);
        let s = scatter(&g[1], 4);
        assert_eq!(s[3].to_vec::<i32>().unwrap(), [30, 40]);
        let r = reduce_to_root(&refs(&ins), ReduceOp::Max, 0);
        assert_eq!(r[0].to_vec::<i32>().unwrap(), [10, 20, 30, 40]);
        assert_eq!(r[1], ins[1]);
        assert_eq!(broadcast(&refs(&ins), 1)[0], ins[1]);
        assert_eq!(all_gather(&refs(&ins))[1].len(), 8);
    }

    #[test]
    fn inputs_are_deterministic_and_in_range() {
        for d in DType::ALL {
            assert_eq!(input(d, 100, 3, 9), input(d, 100, 3, 9));
            assert_ne!(input(d, 100, 3, 9), input(d, 100, 2, 9));
            assert_ne!(input(d, 100, 3, 9), input(d, 100, 3, 8));
        }
        for d in [DType::F16, DType::BF16, DType::F32, DType::F64] {
            let w = input(d, 1000, 0, 1);
            let w: Vec<f64> = match d {
                DType::F16 => w.to_vec::<f16>().unwrap().iter().map(|x| x.to_f64()).collect(),
                DType::BF16 => w.to_vec::<bf16>().unwrap().iter().map(|x| x.to_f64()).collect(),
                DType::F32 => w.to_vec::<f32>().unwrap().iter().map(|&x| f64::from(x)).collect(),
                _ => w.to_vec::<f64>().unwrap(),
            };
            assert!(w.iter().all(|x| x.is_finite() && x.abs() <= 4.0 && *x != 0.0), "{d}");
            assert!(w.iter().filter(|x| x.fract() != 0.0).count() > 900, "{d}");
            assert!(w.iter().any(|&x| x < -1.0) && w.iter().any(|&x| x.abs() < 0.01), "{d}");
        }
        let p = input_for(ReduceOp::Prod, DType::F16, 1000, 0, 1).to_vec::<f16>().unwrap();
        assert!(p.iter().all(|x| (0.5..=1.5).contains(&x.to_f32().abs())));
        let i = input(DType::I64, 1000, 0, 1).to_vec::<i64>().unwrap();
        assert!(i.iter().any(|&x| x > i64::MAX / 2) && i.iter().any(|&x| x < i64::MIN / 2));
    }

    #[test]
    fn compare_names_the_first_difference() {
        let a = HostBuffer::from_slice(&[1.0f32, 2.0, 3.0]);
        let mut b = a.clone();
        b.as_mut_slice::<f32>().unwrap()[1] = 2.5;
        assert!(compare(&a, &a, "x", 0).is_ok());
        let e = compare(&b, &a, "all_reduce(sum)", 3).unwrap_err();
        assert!(
            e.contains("all_reduce(sum), rank 3") && e.contains("f32 × 3") && e.contains("element 1 is 2.5"),
            "{e}"
        );
        assert!(e.contains("reference is 2.0") && e.contains("1 of 3"), "{e}");
        let e = compare(&HostBuffer::zeroed(DType::F64, 3), &a, "x", 0).unwrap_err();
        assert!(e.contains("f64 × 3") && e.contains("f32 × 3"), "{e}");
    }
}
