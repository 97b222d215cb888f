//! The portable kernels: blocked, elementwise loops over every dtype and op, compiled once
//! as they are and again inside each x86-64 tier (`#[inline(always)]` all the way down).

use comm_core::{bf16, f16, DType, ReduceOp};
use half::slice::HalfFloatSliceExt;

use crate::convert::{bf16_bits_to_f32, f32_to_bf16_bits};
use crate::stream::fill_streaming;
use crate::{Dst, Src, BLOCK, SMALL, TINY};

#[inline(always)]
pub(crate) fn reduce_generic(dtype: DType, op: ReduceOp, inputs: &[Src<'_>], d: Dst<'_>) {
    match dtype {
        DType::U8 => int_op::<u8>(op, inputs, d),
        DType::I8 => int_op::<i8>(op, inputs, d),
        DType::I32 => int_op::<i32>(op, inputs, d),
        DType::I64 => int_op::<i64>(op, inputs, d),
        DType::F16 => float_op::<f16>(op, inputs, d),
        DType::BF16 => float_op::<bf16>(op, inputs, d),
        DType::F32 => float_op::<f32>(op, inputs, d),
        DType::F64 => float_op::<f64>(op, inputs, d),
        _ => unreachable!("every dtype is handled"),
    }
}

/// An element type and how it is accumulated.
trait Lane: bytemuck::Pod {
    type Acc: Copy + Default + std::ops::Div<Output = Self::Acc> + PartialOrd;
    /// Whether blocks are converted in bulk (`load_block`/`store_block`) rather than element
    /// by element inside the combining loop: only worth it where the bulk conversion is a
    /// hardware instruction the per-element one cannot vectorise into (f16 through F16C).
    const BULK: bool = false;
    fn load(self) -> Self::Acc;
    fn store(acc: Self::Acc) -> Self;
    /// Bulk `load` of a block into accumulators.
    #[inline(always)]
    fn load_block(src: &[Self], dst: &mut [Self::Acc]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = s.load();
        }
    }
    /// Bulk `store` of a block.
    #[inline(always)]
    fn store_block(src: &[Self::Acc], dst: &mut [Self]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = Self::store(s);
        }
    }
    fn count(n: usize) -> Self::Acc;
}

macro_rules! identity_lane {
    ($($t:ty),*) => {$(
        impl Lane for $t {
            type Acc = $t;
            #[inline(always)]
            fn load(self) -> $t { self }
            #[inline(always)]
            fn store(acc: $t) -> $t { acc }
            #[inline(always)]
            fn count(n: usize) -> $t { n as $t }
        }
    )*};
}
identity_lane!(u8, i8, i32, i64, f32, f64);

impl Lane for f16 {
    type Acc = f32;
    const BULK: bool = true;
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(acc: f32) -> f16 {
        f16::from_f32(acc)
    }
    #[inline(always)]
    fn load_block(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst); // the portable tier (SIMD tiers take the fused kernels)
    }
    #[inline(always)]
    fn store_block(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }
    #[inline(always)]
    fn count(n: usize) -> f32 {
        n as f32
    }
}

impl Lane for bf16 {
    type Acc = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        bf16_bits_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn store(acc: f32) -> bf16 {
        bf16::from_bits(f32_to_bf16_bits(acc))
    }
    #[inline(always)]
    fn count(n: usize) -> f32 {
        n as f32
    }
}

#[inline(always)]
fn run<'a, T: Lane>(
    inputs: &[Src<'a>],
    dst: Dst<'_>,
    combine: impl Fn(T::Acc, T::Acc) -> T::Acc,
    finish: impl Fn(T::Acc) -> T::Acc,
) {
    let out: &mut [T] = bytemuck::cast_slice_mut(dst.out);
    let mut copy: Option<&mut [T]> = dst.copy.map(bytemuck::cast_slice_mut);
    // On the stack for up to 16 inputs: at a few elements the allocation would cost more than
    // the reduction (8 B of f32: 31 ns with it). Filled in place: a collected array is
    // moved afterwards, a copy of all 16 slots.
    let typed = |s: &Src<'a>| match s {
        Src::Buf(b) => In::Buf(bytemuck::cast_slice::<u8, T>(b)),
        Src::Out => In::Out,
        Src::Copy => In::Copy,
    };
    let mut stack = [In::Out; 16];
    let heap: Vec<In<'a, T>>;
    let bufs: &[In<'a, T>] = if inputs.len() <= stack.len() {
        for (slot, s) in stack.iter_mut().zip(inputs) {
            *slot = typed(s);
        }
        &stack[..inputs.len()]
    } else {
        heap = inputs.iter().map(typed).collect();
        &heap
    };
    if out.len() <= TINY {
        // Latency-bound sizes: element by element, no block set-up.
        for i in 0..out.len() {
            let load = |b: &In<'_, T>| In::pick(b, out, copy.as_deref(), i..i + 1)[0].load();
            let acc = bufs[1..].iter().fold(load(&bufs[0]), |a, b| combine(a, load(b)));
            out[i] = T::store(finish(acc));
            if let Some(c) = copy.as_deref_mut() {
                c[i] = out[i];
            }
        }
    } else if pair(bufs, out, copy.as_deref_mut(), dst.stream, &combine, &finish) {
        // Done in one pass.
    } else if out.len() <= 4 * SMALL {
        // Small blocks for small buffers: setting up two 1024-element blocks costs more than
        // reducing a few hundred elements (64 f32: 28 ns with 64-element blocks, 116 ns
        // element by element); from ~1024 elements the big blocks win again.
        blocks::<T, SMALL>(bufs, out, copy, combine, finish);
    } else {
        blocks::<T, BLOCK>(bufs, out, copy, combine, finish);
    }
}

/// Two inputs, as two ranks reduce, in one pass over the buffers with no block copied through
/// the stack (f32, two buffers into a third: 2x at 4 KiB, 1.3x from memory); combined in the
/// same order as [`blocks`]. `false` (nothing done) for other shapes, and for types that
/// widen to accumulate (f16, bf16: 64 bf16 took 58 ns here against 47 in blocks). `stream`:
/// two buffers into a third write it with streaming stores.
#[inline(always)]
fn pair<T: Lane>(
    bufs: &[In<'_, T>],
    out: &mut [T],
    copy: Option<&mut [T]>,
    stream: bool,
    combine: impl Fn(T::Acc, T::Acc) -> T::Acc,
    finish: impl Fn(T::Acc) -> T::Acc,
) -> bool {
    if std::mem::size_of::<T::Acc>() != std::mem::size_of::<T>() {
        return false;
    }
    let f = |x: T, y: T| T::store(finish(combine(x.load(), y.load())));
    match (bufs, copy) {
        ([In::Buf(a), In::Buf(b)], None) if stream => fill_streaming(out, |i, part| {
            let (a, b) = (&a[i..i + part.len()], &b[i..i + part.len()]);
            part.iter_mut().zip(a).zip(b).for_each(|((o, &x), &y)| *o = f(x, y));
        }),
        ([In::Buf(a), In::Buf(b)], None) => out.iter_mut().zip(*a).zip(*b).for_each(|((o, &x), &y)| *o = f(x, y)),
        ([In::Out, In::Buf(b)], None) => out.iter_mut().zip(*b).for_each(|(o, &y)| *o = f(*o, y)),
        ([In::Buf(a), In::Out], None) => out.iter_mut().zip(*a).for_each(|(o, &x)| *o = f(x, *o)),
        // `copy` a second destination (a window for the peers) ...
        ([In::Out, In::Buf(b)], Some(c)) => out.iter_mut().zip(c).zip(*b).for_each(|((o, c), &y)| {
            *o = f(*o, y);
            *c = *o;
        }),
        ([In::Buf(a), In::Out], Some(c)) => out.iter_mut().zip(c).zip(*a).for_each(|((o, c), &x)| {
            *o = f(x, *o);
            *c = *o;
        }),
        // ... or an input too (the peer's slice, reduced in place).
        ([In::Out, In::Copy], Some(c)) => out.iter_mut().zip(c).for_each(|(o, c)| {
            *o = f(*o, *c);
            *c = *o;
        }),
        ([In::Copy, In::Out], Some(c)) => out.iter_mut().zip(c).for_each(|(o, c)| {
            *o = f(*c, *o);
            *c = *o;
        }),
        _ => return false,
    }
    true
}

/// An input of `run`, typed.
enum In<'a, T> {
    Buf(&'a [T]),
    Out,
    Copy,
}

// By hand: derived impls would require `T: Copy`.
impl<T> Clone for In<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for In<'_, T> {}

impl<T> In<'_, T> {
    /// The input's elements in `range`: its own, or the current contents of `out` or `copy`.
    #[inline(always)]
    fn pick<'s>(&'s self, out: &'s [T], copy: Option<&'s [T]>, range: std::ops::Range<usize>) -> &'s [T] {
        match self {
            In::Buf(b) => &b[range],
            In::Out => &out[range],
            In::Copy => &copy.expect("checked by reduce_to")[range],
        }
    }
}

#[inline(always)]
fn blocks<T: Lane, const B: usize>(
    bufs: &[In<'_, T>],
    out: &mut [T],
    mut copy: Option<&mut [T]>,
    combine: impl Fn(T::Acc, T::Acc) -> T::Acc,
    finish: impl Fn(T::Acc) -> T::Acc,
) {
    let mut acc = [T::Acc::default(); B];
    let mut tmp = [T::Acc::default(); B];
    let mut start = 0;
    while start < out.len() {
        let m = B.min(out.len() - start);
        let range = start..start + m;
        let (acc, tmp) = (&mut acc[..m], &mut tmp[..m]);
        T::load_block(bufs[0].pick(out, copy.as_deref(), range.clone()), acc);
        for b in &bufs[1..] {
            let x = b.pick(out, copy.as_deref(), range.clone());
            if T::BULK {
                T::load_block(x, tmp);
                for (a, &t) in acc.iter_mut().zip(tmp.iter()) {
                    *a = combine(*a, t);
                }
            } else {
                // Convert while combining: one pass over the block instead of two.
                for (a, &x) in acc.iter_mut().zip(x) {
                    *a = combine(*a, x.load());
                }
            }
        }
        // Every input of this block is read: now `out` may be overwritten.
        if T::BULK {
            for a in acc.iter_mut() {
                *a = finish(*a);
            }
            T::store_block(acc, &mut out[range.clone()]);
        } else {
            for (o, &a) in out[range.clone()].iter_mut().zip(acc.iter()) {
                *o = T::store(finish(a));
            }
        }
        if let Some(c) = copy.as_deref_mut() {
            c[range.clone()].copy_from_slice(&out[range]);
        }
        start += m;
    }
}

#[inline(always)]
fn float_op<T: Lane>(op: ReduceOp, inputs: &[Src<'_>], out: Dst<'_>)
where
    T::Acc: std::ops::Add<Output = T::Acc> + std::ops::Mul<Output = T::Acc>,
{
    let n = T::count(inputs.len());
    match op {
        ReduceOp::Sum => run::<T>(inputs, out, |a, b| a + b, |a| a),
        ReduceOp::Avg => run::<T>(inputs, out, |a, b| a + b, |a| a / n),
        ReduceOp::Prod => run::<T>(inputs, out, |a, b| a * b, |a| a),
        ReduceOp::Min => run::<T>(inputs, out, |a, b| if b < a { b } else { a }, |a| a),
        ReduceOp::Max => run::<T>(inputs, out, |a, b| if b > a { b } else { a }, |a| a),
        _ => unreachable!("validated: bitwise ops are rejected for floats"),
    }
}

/// Integer ops: wrapping arithmetic and bitwise ops.
trait Int: Lane<Acc = Self> + Ord {
    fn wadd(self, o: Self) -> Self;
    fn wmul(self, o: Self) -> Self;
    fn and(self, o: Self) -> Self;
    fn or(self, o: Self) -> Self;
    fn xor(self, o: Self) -> Self;
}

macro_rules! int {
    ($($t:ty),*) => {$(
        impl Int for $t {
            #[inline(always)] fn wadd(self, o: Self) -> Self { self.wrapping_add(o) }
            #[inline(always)] fn wmul(self, o: Self) -> Self { self.wrapping_mul(o) }
            #[inline(always)] fn and(self, o: Self) -> Self { self & o }
            #[inline(always)] fn or(self, o: Self) -> Self { self | o }
            #[inline(always)] fn xor(self, o: Self) -> Self { self ^ o }
        }
    )*};
}
int!(u8, i8, i32, i64);

#[inline(always)]
fn int_op<T: Int>(op: ReduceOp, inputs: &[Src<'_>], out: Dst<'_>) {
    match op {
        ReduceOp::Sum => run::<T>(inputs, out, T::wadd, |a| a),
        ReduceOp::Prod => run::<T>(inputs, out, T::wmul, |a| a),
        ReduceOp::Min => run::<T>(inputs, out, |a, b| if b < a { b } else { a }, |a| a),
        ReduceOp::Max => run::<T>(inputs, out, |a, b| if b > a { b } else { a }, |a| a),
        ReduceOp::BAnd => run::<T>(inputs, out, T::and, |a| a),
        ReduceOp::BOr => run::<T>(inputs, out, T::or, |a| a),
        ReduceOp::BXor => run::<T>(inputs, out, T::xor, |a| a),
        _ => unreachable!("validated: avg is rejected for integers"),
    }
}
