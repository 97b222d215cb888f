//! Reduction kernels: combine the same range of several ranks' buffers, in rank order.
//!
//! The order is fixed (input 0 first), so every rank that reduces the same inputs gets
//! bit-identical results. f16/bf16 accumulate in f32 across all inputs and round once.
//! Work is blocked so the accumulator stays in L1 and the inner loops auto-vectorise.
//!
//! The same semantics as `comm_test::reference` and backend-shm's kernels (kept in step by the
//! conformance suite, which compares every backend with the reference byte for byte).

use comm_core::{bf16, f16, DType, HostBuffer, ReduceOp};

const BLOCK: usize = 1024;
const SMALL: usize = 64;

trait Lane: bytemuck::Pod {
    type Acc: Copy + Default;
    fn load(self) -> Self::Acc;
    fn store(acc: Self::Acc) -> Self;
}

macro_rules! identity_lane {
    ($($t:ty),*) => {$(
        impl Lane for $t {
            type Acc = $t;
            #[inline(always)]
            fn load(self) -> $t { self }
            #[inline(always)]
            fn store(acc: $t) -> $t { acc }
        }
    )*};
}
identity_lane!(u8, i8, i32, i64, f32, f64);

impl Lane for f16 {
    type Acc = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(acc: f32) -> f16 {
        f16::from_f32(acc)
    }
}

impl Lane for bf16 {
    type Acc = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(acc: f32) -> bf16 {
        bf16::from_f32(acc)
    }
}

#[inline(always)]
fn run<T: Lane>(
    out: &mut [u8],
    inputs: &[&[u8]],
    combine: impl Fn(T::Acc, T::Acc) -> T::Acc,
    finish: impl Fn(T::Acc) -> T::Acc,
) {
    let out: &mut [T] = bytemuck::cast_slice_mut(out);
    let ins: Vec<&[T]> = inputs.iter().map(|b| bytemuck::cast_slice::<u8, T>(b)).collect();
    if out.len() <= SMALL {
        // Latency-bound sizes: no accumulator block to initialise.
        for (i, o) in out.iter_mut().enumerate() {
            let acc = ins[1..].iter().fold(ins[0][i].load(), |a, x| combine(a, x[i].load()));
            *o = T::store(finish(acc));
        }
        return;
    }
    let mut acc = [T::Acc::default(); BLOCK];
    let mut start = 0;
    while start < out.len() {
        let m = BLOCK.min(out.len() - start);
        let acc = &mut acc[..m];
        for (a, &x) in acc.iter_mut().zip(&ins[0][start..start + m]) {
            *a = x.load();
        }
        for input in &ins[1..] {
            for (a, &x) in acc.iter_mut().zip(&input[start..start + m]) {
                *a = combine(*a, x.load());
            }
        }
        for (o, &a) in out[start..start + m].iter_mut().zip(acc.iter()) {
            *o = T::store(finish(a));
        }
        start += m;
    }
}

macro_rules! float_op {
    ($t:ty, $acc:ty, $out:expr, $ins:expr, $op:expr) => {{
        let n = $ins.len() as $acc;
        match $op {
            ReduceOp::Sum => run::<$t>($out, $ins, |a, b| a + b, |a| a),
            ReduceOp::Avg => run::<$t>($out, $ins, |a, b| a + b, |a| a / n),
            ReduceOp::Prod => run::<$t>($out, $ins, |a, b| a * b, |a| a),
            ReduceOp::Min => run::<$t>($out, $ins, |a, b| if b < a { b } else { a }, |a| a),
            ReduceOp::Max => run::<$t>($out, $ins, |a, b| if b > a { b } else { a }, |a| a),
            _ => unreachable!("validated: bitwise ops are rejected for floats"),
        }
    }};
}

macro_rules! int_op {
    ($t:ty, $out:expr, $ins:expr, $op:expr) => {{
        match $op {
            ReduceOp::Sum => run::<$t>($out, $ins, |a, b| a.wrapping_add(b), |a| a),
            ReduceOp::Prod => run::<$t>($out, $ins, |a, b| a.wrapping_mul(b), |a| a),
            ReduceOp::Min => run::<$t>($out, $ins, |a, b| a.min(b), |a| a),
            ReduceOp::Max => run::<$t>($out, $ins, |a, b| a.max(b), |a| a),
            ReduceOp::BAnd => run::<$t>($out, $ins, |a, b| a & b, |a| a),
            ReduceOp::BOr => run::<$t>($out, $ins, |a, b| a | b, |a| a),
            ReduceOp::BXor => run::<$t>($out, $ins, |a, b| a ^ b, |a| a),
            _ => unreachable!("validated: avg is rejected for integers"),
        }
    }};
}

/// `out = inputs[0] ⊕ inputs[1] ⊕ ...` elementwise, in input order. `Avg` divides by the
/// number of inputs. All slices have `out.len()` bytes, aligned for `dtype`, and the op was
/// validated for the dtype (`ReduceOp::applies_to`).
pub(crate) fn reduce(dtype: DType, op: ReduceOp, inputs: &[&[u8]], out: &mut [u8]) {
    debug_assert!(inputs.iter().all(|i| i.len() == out.len()));
    if inputs.is_empty() || out.is_empty() {
        return;
    }
    match dtype {
        DType::U8 => int_op!(u8, out, inputs, op),
        DType::I8 => int_op!(i8, out, inputs, op),
        DType::I32 => int_op!(i32, out, inputs, op),
        DType::I64 => int_op!(i64, out, inputs, op),
        DType::F16 => float_op!(f16, f32, out, inputs, op),
        DType::BF16 => float_op!(bf16, f32, out, inputs, op),
        DType::F32 => float_op!(f32, f32, out, inputs, op),
        DType::F64 => float_op!(f64, f64, out, inputs, op),
        _ => unreachable!("every dtype is handled"),
    }
}

/// Divides every element by `n` (the `Avg` of the native mode, after MPI summed): in f32 for
/// f16/bf16, then rounded once.
pub(crate) fn divide(buf: &mut HostBuffer, n: usize) {
    fn each<T: comm_core::Element>(buf: &mut HostBuffer, f: impl Fn(T) -> T) {
        if let Ok(s) = buf.as_mut_slice::<T>() {
            s.iter_mut().for_each(|x| *x = f(*x));
        }
    }
    match buf.dtype() {
        DType::F16 => each::<f16>(buf, |x| f16::from_f32(x.to_f32() / n as f32)),
        DType::BF16 => each::<bf16>(buf, |x| bf16::from_f32(x.to_f32() / n as f32)),
        DType::F32 => each::<f32>(buf, |x| x / n as f32),
        DType::F64 => each::<f64>(buf, |x| x / n as f64),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn red(op: ReduceOp, ins: &[HostBuffer]) -> HostBuffer {
        let mut out = HostBuffer::zeroed(ins[0].dtype(), ins[0].len());
        let views: Vec<&[u8]> = ins.iter().map(|b| b.as_bytes()).collect();
        reduce(ins[0].dtype(), op, &views, out.as_bytes_mut());
        out
    }

    #[test]
    fn bf16_accumulates_in_f32() {
        // 256 + 1 + 1 in bf16 steps would round 257 back to 256 twice; in f32 it is 258.
        let v = |x: f32| HostBuffer::from_slice(&[bf16::from_f32(x)]);
        let out = red(ReduceOp::Sum, &[v(256.0), v(1.0), v(1.0)]);
        assert_eq!(out.as_slice::<bf16>().unwrap()[0].to_f32(), 258.0);
    }

    #[test]
    fn ints_wrap_and_bitwise() {
        let a = HostBuffer::from_slice(&[120i8, 0b0110, -128]);
        let b = HostBuffer::from_slice(&[10i8, 0b0011, -1]);
        assert_eq!(red(ReduceOp::Sum, &[a.clone(), b.clone()]).to_vec::<i8>().unwrap(), [-126, 9, 127]);
        assert_eq!(red(ReduceOp::BXor, &[a.clone(), b.clone()]).to_vec::<i8>().unwrap(), [120 ^ 10, 0b0101, 127]);
        assert_eq!(red(ReduceOp::Min, &[a, b]).to_vec::<i8>().unwrap(), [10, 3, -128]);
    }

    #[test]
    fn small_and_blocked_paths_agree() {
        for len in [1, SMALL, SMALL + 1, BLOCK + 3] {
            let a: Vec<f32> = (0..len).map(|i| i as f32 * 0.1).collect();
            let b: Vec<f32> = (0..len).map(|i| 1.0 / (i + 1) as f32).collect();
            let out = red(ReduceOp::Sum, &[HostBuffer::from_slice(&a), HostBuffer::from_slice(&b)]);
            let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
            assert_eq!(out.to_vec::<f32>().unwrap(), want, "len {len}");
        }
    }

    #[test]
    fn avg_and_long_inputs_cross_blocks() {
        let n = 3 * BLOCK + 5;
        let a = HostBuffer::from_slice(&(0..n).map(|i| i as f64).collect::<Vec<_>>());
        let b = HostBuffer::from_slice(&(0..n).map(|i| 3.0 * i as f64).collect::<Vec<_>>());
        let out = red(ReduceOp::Avg, &[a, b]).to_vec::<f64>().unwrap();
        assert!(out.iter().enumerate().all(|(i, &x)| x == 2.0 * i as f64));
    }
}
