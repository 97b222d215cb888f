//! Reduction kernels of comm: combine the same range of several ranks' buffers, in rank order.
//!
//! Shared by the backends that reduce on the host (shm, and mpi, which reduces itself to stay
//! bit-identical with the reference); a crate of its own because backends never depend on
//! each other and comm-core stays free of `unsafe`.
//!
//! The order is fixed (input 0 first), so every rank that reduces the same inputs gets
//! bit-identical results. f16/bf16 accumulate in f32 across all inputs and round once
//! (round-to-nearest-even, exactly as `half`'s conversions, which the reference uses).
//!
//! Work is blocked (1024 elements) so accumulators stay in L1 and the inner loops are plain
//! elementwise loops the compiler vectorises. On x86-64 the same code is compiled a second
//! time with AVX2 and with AVX-512 enabled, chosen at run time. f16 (AVX-512 and F16C) and
//! bf16 (AVX2) take fused kernels written with the conversion instructions instead
//! (`half_simd`); bf16 conversions elsewhere are branch-free bit operations the compiler
//! vectorises.

use comm_core::{bf16, f16, DType, ReduceOp};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod convert;
mod half_simd;
mod portable;
mod stream;

use portable::reduce_generic;
pub use stream::copy_streaming;

/// The destination of a reduction: `out`, optionally a second copy, and whether `out` is
/// written with streaming stores.
pub(crate) struct Dst<'a> {
    pub(crate) out: &'a mut [u8],
    pub(crate) copy: Option<&'a mut [u8]>,
    pub(crate) stream: bool,
}

impl<'a> Dst<'a> {
    /// `out` alone, written with plain stores.
    fn plain(out: &'a mut [u8]) -> Self {
        Dst { out, copy: None, stream: false }
    }
}

const BLOCK: usize = 1024;
/// Block size for buffers of at most `BLOCK` elements; also the size up to which f16/bf16
/// skip the fused kernels.
const SMALL: usize = 64;
/// Up to this many elements, reduce element by element (no block set-up at all).
const TINY: usize = 8;

/// One input of a reduction.
#[derive(Clone, Copy, Debug)]
pub enum Src<'a> {
    /// A separate buffer.
    Buf(&'a [u8]),
    /// The current contents of the output buffer (an in-place input).
    Out,
    /// The current contents of the `copy` buffer of [`reduce_to`] (which must be given).
    Copy,
}

/// `out = inputs[0] ⊕ inputs[1] ⊕ ...` elementwise, in input order. `Avg` divides by the
/// number of inputs. All slices have `out.len()` bytes, aligned for `dtype`, and the op was
/// validated for the dtype (`ReduceOp::applies_to`).
pub fn reduce(dtype: DType, op: ReduceOp, inputs: &[&[u8]], out: &mut [u8]) {
    debug_assert!(inputs.iter().all(|b| b.len() == out.len()));
    reduce_leading(dtype, op, inputs, None, out);
}

/// [`reduce`] of the first `out.len()` bytes of each input (a window holding more). Input
/// `own`, when given, is `out`'s current contents instead (an in-place input; `inputs[own]`
/// is not read): a rank's own data is quicker to read from its buffer than from the copy it
/// wrote for its peers, which the peers' reads may have taken out of its cache.
///
/// # Panics
/// When an input is shorter than `out`.
pub fn reduce_leading(dtype: DType, op: ReduceOp, inputs: &[&[u8]], own: Option<usize>, out: &mut [u8]) {
    leading(dtype, op, inputs, own, Dst::plain(out))
}

/// [`reduce`] into an output larger than the caches, which nothing reads soon: two inputs of
/// a type that does not widen (not f16/bf16) write it with streaming stores, skipping the read
/// of each output line before it is written (two 64 MiB f32 inputs from memory, four runs:
/// 7.3-9.8 against 7.1-7.6 GB/s); other shapes as [`reduce`].
pub fn reduce_streaming(dtype: DType, op: ReduceOp, inputs: &[&[u8]], out: &mut [u8]) {
    debug_assert!(inputs.iter().all(|b| b.len() == out.len()));
    leading(dtype, op, inputs, None, Dst { out, copy: None, stream: true })
}

fn leading<'a>(dtype: DType, op: ReduceOp, inputs: &[&'a [u8]], own: Option<usize>, d: Dst<'_>) {
    // A small all_reduce's reduction takes tens of nanoseconds: the inputs' list lives on the
    // stack rather than costing an allocation as long again.
    const STACK: usize = 16;
    let len = d.out.len();
    let src = |(i, b): (usize, &&'a [u8])| if Some(i) == own { Src::Out } else { Src::Buf(&b[..len]) };
    if inputs.len() <= STACK {
        let mut srcs = [Src::Out; STACK];
        for (s, b) in srcs.iter_mut().zip(inputs.iter().enumerate()) {
            *s = src(b);
        }
        return dispatch(dtype, op, &srcs[..inputs.len()], d);
    }
    let srcs: Vec<Src<'_>> = inputs.iter().enumerate().map(src).collect();
    dispatch(dtype, op, &srcs, d);
}

/// Like [`reduce`], but an input may be `out` itself ([`Src::Out`]) or `copy`
/// ([`Src::Copy`]), read before it is overwritten, and the result is also written to `copy`
/// when given — one pass over the data where a separate copy-in or copy-out would be another.
///
/// # Panics
/// When an input is [`Src::Copy`] and `copy` is `None`.
pub fn reduce_to(dtype: DType, op: ReduceOp, inputs: &[Src<'_>], out: &mut [u8], copy: Option<&mut [u8]>) {
    debug_assert!(inputs.iter().all(|i| !matches!(i, Src::Buf(b) if b.len() != out.len())));
    debug_assert!(copy.as_ref().is_none_or(|c| c.len() == out.len()));
    assert!(
        copy.is_some() || !inputs.iter().any(|i| matches!(i, Src::Copy)),
        "reduce_to: an input is Src::Copy but there is no copy buffer"
    );
    dispatch(dtype, op, inputs, Dst { out, copy, stream: false })
}

/// The reduction on the CPU's best tier.
fn dispatch(dtype: DType, op: ReduceOp, inputs: &[Src<'_>], d: Dst<'_>) {
    if inputs.is_empty() || d.out.is_empty() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    match simd_level() {
        // SAFETY: the CPU supports AVX-512 F/BW/VL (checked at run time by `simd_level`).
        Simd::Avx512 => return unsafe { avx512::reduce(dtype, op, inputs, d) },
        // SAFETY: the CPU supports AVX2 (checked at run time by `simd_level`).
        Simd::Avx2 => return unsafe { avx2::reduce(dtype, op, inputs, d) },
        Simd::None => {}
    }
    reduce_generic(dtype, op, inputs, d)
}

#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Simd {
    None,
    Avx2,
    /// 512-bit registers matter most for f16/bf16: widening u16 lanes to f32 and narrowing them
    /// back has single instructions there (vpmovzxwd / vpmovdw), not on AVX2 (~2.5x for bf16).
    Avx512,
}

#[cfg(target_arch = "x86_64")]
fn simd_level() -> Simd {
    use std::sync::OnceLock;
    static LEVEL: OnceLock<Simd> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let forced = std::env::var("COMM_SIMD").unwrap_or_default();
        let avx512 = std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vl");
        let avx2 = std::is_x86_feature_detected!("avx2");
        match forced.as_str() {
            "none" | "portable" => Simd::None,
            "avx2" if avx2 => Simd::Avx2,
            _ if avx512 => Simd::Avx512,
            _ if avx2 => Simd::Avx2,
            _ => Simd::None,
        }
    })
}

/// Divides every element by `n` (an `Avg` whose sum was computed elsewhere, e.g. by MPI): in
/// f32 for f16/bf16, then rounded once. Integer buffers are left as they are.
pub fn divide(buf: &mut comm_core::HostBuffer, n: usize) {
    fn each<T: comm_core::Element>(buf: &mut comm_core::HostBuffer, f: impl Fn(T) -> T) {
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
    use comm_core::HostBuffer;

    #[test]
    fn leading_bytes_of_few_and_many_inputs() {
        for n in [1usize, 2, 16, 17, 40] {
            // Inputs 5 elements long; the reduction covers their first 3.
            let ins: Vec<HostBuffer> =
                (0..n).map(|r| HostBuffer::from_slice(&[r as i32, 1, -(r as i32), 1000, 1000])).collect();
            let views: Vec<&[u8]> = ins.iter().map(|b| b.as_bytes()).collect();
            let s = (0..n as i32).sum::<i32>();
            let mut out = HostBuffer::zeroed(DType::I32, 3);
            reduce_leading(DType::I32, ReduceOp::Sum, &views, None, out.as_bytes_mut());
            assert_eq!(out.to_vec::<i32>().unwrap(), [s, n as i32, -s], "{n} inputs");
            // The own input comes from `out`, not from its (here wrong) copy among the inputs.
            for own in [0, n / 2, n - 1] {
                let mut views = views.clone();
                let wrong = HostBuffer::from_slice(&[7i32, 7, 7]);
                views[own] = wrong.as_bytes();
                let mut out = HostBuffer::from_slice(&[own as i32, 1, -(own as i32)]);
                reduce_leading(DType::I32, ReduceOp::Sum, &views, Some(own), out.as_bytes_mut());
                assert_eq!(out.to_vec::<i32>().unwrap(), [s, n as i32, -s], "{n} inputs, own {own}");
            }
        }
    }

    fn red(op: ReduceOp, ins: &[HostBuffer]) -> HostBuffer {
        let mut out = HostBuffer::zeroed(ins[0].dtype(), ins[0].len());
        let views: Vec<&[u8]> = ins.iter().map(|b| b.as_bytes()).collect();
        reduce(ins[0].dtype(), op, &views, out.as_bytes_mut());
        out
    }

    /// The portable kernels, whatever the CPU has.
    fn red_generic(op: ReduceOp, ins: &[HostBuffer]) -> HostBuffer {
        let mut out = HostBuffer::zeroed(ins[0].dtype(), ins[0].len());
        let views: Vec<Src<'_>> = ins.iter().map(|b| Src::Buf(b.as_bytes())).collect();
        reduce_generic(ins[0].dtype(), op, &views, Dst::plain(out.as_bytes_mut()));
        out
    }

    /// Input `own` taken in place from the output buffer, result also copied out when `copied`.
    fn red_in_place(op: ReduceOp, ins: &[HostBuffer], own: usize, copied: bool) -> (HostBuffer, Vec<u8>) {
        let mut out = ins[own].clone();
        let mut copy = vec![0u8; out.byte_len()];
        let views: Vec<Src<'_>> =
            ins.iter().enumerate().map(|(i, b)| if i == own { Src::Out } else { Src::Buf(b.as_bytes()) }).collect();
        reduce_to(ins[0].dtype(), op, &views, out.as_bytes_mut(), copied.then_some(&mut copy[..]));
        let copy = if copied { copy } else { out.as_bytes().to_vec() };
        (out, copy)
    }

    /// Inputs `own` and `other` taken in place from the output and the copy buffer.
    fn red_both_in_place(op: ReduceOp, ins: &[HostBuffer], own: usize, other: usize) -> (HostBuffer, Vec<u8>) {
        let mut out = ins[own].clone();
        let mut copy = ins[other].as_bytes().to_vec();
        let views: Vec<Src<'_>> = (0..ins.len())
            .map(|i| match i {
                _ if i == own => Src::Out,
                _ if i == other => Src::Copy,
                _ => Src::Buf(ins[i].as_bytes()),
            })
            .collect();
        reduce_to(ins[0].dtype(), op, &views, out.as_bytes_mut(), Some(&mut copy));
        (out, copy)
    }

    /// Scalar reference: element by element with `half`'s own conversions.
    fn scalar(op: ReduceOp, ins: &[HostBuffer]) -> HostBuffer {
        fn go<T: Copy + bytemuck::Pod + comm_core::Element, A: Copy>(
            ins: &[HostBuffer],
            load: impl Fn(T) -> A,
            store: impl Fn(A) -> T,
            comb: impl Fn(A, A) -> A,
            fin: impl Fn(A) -> A,
        ) -> HostBuffer {
            let vs: Vec<&[T]> = ins.iter().map(|b| b.as_slice::<T>().unwrap()).collect();
            let out: Vec<T> = (0..vs[0].len())
                .map(|i| store(fin(vs[1..].iter().fold(load(vs[0][i]), |a, v| comb(a, load(v[i]))))))
                .collect();
            HostBuffer::from_slice(&out)
        }
        let n = ins.len() as f32;
        let minf = |a: f32, b: f32| if b < a { b } else { a };
        let maxf = |a: f32, b: f32| if b > a { b } else { a };
        macro_rules! f {
            ($t:ty, $load:expr, $store:expr) => {
                match op {
                    ReduceOp::Sum => go::<$t, f32>(ins, $load, $store, |a, b| a + b, |a| a),
                    ReduceOp::Avg => go::<$t, f32>(ins, $load, $store, |a, b| a + b, |a| a / n),
                    ReduceOp::Prod => go::<$t, f32>(ins, $load, $store, |a, b| a * b, |a| a),
                    ReduceOp::Min => go::<$t, f32>(ins, $load, $store, minf, |a| a),
                    ReduceOp::Max => go::<$t, f32>(ins, $load, $store, maxf, |a| a),
                    _ => unreachable!(),
                }
            };
        }
        match ins[0].dtype() {
            DType::F16 => f!(f16, |x: f16| x.to_f32(), f16::from_f32),
            DType::BF16 => f!(bf16, |x: bf16| x.to_f32(), bf16::from_f32),
            DType::F32 => f!(f32, |x: f32| x, |x| x),
            DType::I32 => match op {
                ReduceOp::Sum => go::<i32, i32>(ins, |x| x, |x| x, i32::wrapping_add, |a| a),
                ReduceOp::BXor => go::<i32, i32>(ins, |x| x, |x| x, |a, b| a ^ b, |a| a),
                ReduceOp::Max => go::<i32, i32>(ins, |x| x, |x| x, i32::max, |a| a),
                _ => unreachable!(),
            },
            _ => unreachable!(),
        }
    }

    fn data(dtype: DType, len: usize, seed: u64) -> HostBuffer {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let f = |x: u64| ((x >> 11) as f64 / (1u64 << 53) as f64 * 8.0 - 4.0) as f32;
        match dtype {
            DType::F16 => HostBuffer::from_slice(&(0..len).map(|_| f16::from_f32(f(next()))).collect::<Vec<_>>()),
            DType::BF16 => HostBuffer::from_slice(&(0..len).map(|_| bf16::from_f32(f(next()))).collect::<Vec<_>>()),
            DType::F32 => HostBuffer::from_slice(&(0..len).map(|_| f(next())).collect::<Vec<_>>()),
            DType::I32 => HostBuffer::from_slice(&(0..len).map(|_| next() as i32).collect::<Vec<_>>()),
            _ => unreachable!(),
        }
    }

    #[test]
    fn simd_and_portable_kernels_match_the_scalar_reference() {
        let cases: &[(DType, &[ReduceOp])] = &[
            (DType::F16, &[ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max]),
            (DType::BF16, &[ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max]),
            (DType::F32, &[ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max]),
            (DType::I32, &[ReduceOp::Sum, ReduceOp::BXor, ReduceOp::Max]),
        ];
        for &(dtype, ops) in cases {
            for &op in ops {
                // Odd lengths and tails that are not a multiple of any vector width or block.
                for len in [
                    1,
                    3,
                    TINY,
                    TINY + 1,
                    SMALL,
                    SMALL + 1,
                    127,
                    4 * SMALL,
                    4 * SMALL + 1,
                    BLOCK - 1,
                    BLOCK + 13,
                    3 * BLOCK + 7,
                ] {
                    for ranks in [1, 2, 3, 5] {
                        let ins: Vec<HostBuffer> =
                            (0..ranks).map(|r| data(dtype, len, (r * 1000 + len) as u64)).collect();
                        let want = scalar(op, &ins);
                        assert_eq!(red(op, &ins).as_bytes(), want.as_bytes(), "{dtype} {op} len {len} ranks {ranks}");
                        assert_eq!(red_generic(op, &ins).as_bytes(), want.as_bytes(), "generic {dtype} {op} len {len}");
                        #[cfg(target_arch = "x86_64")]
                        if std::is_x86_feature_detected!("avx2") {
                            let mut out = HostBuffer::zeroed(dtype, len);
                            let views: Vec<Src<'_>> = ins.iter().map(|b| Src::Buf(b.as_bytes())).collect();
                            // SAFETY: AVX2 was detected just above.
                            unsafe { avx2::reduce(dtype, op, &views, Dst::plain(out.as_bytes_mut())) };
                            assert_eq!(out.as_bytes(), want.as_bytes(), "avx2 {dtype} {op} len {len}");
                        }
                        // Every position of the own input (first, middle, last), with and
                        // without a copy: two inputs have a one-pass kernel per shape.
                        for (own, copied) in [(0, true), (ranks / 2, true), (ranks - 1, false), (0, false)] {
                            let (inplace, copy) = red_in_place(op, &ins, own, copied);
                            assert_eq!(inplace.as_bytes(), want.as_bytes(), "in place {own} {dtype} {op} len {len}");
                            assert_eq!(copy, want.as_bytes(), "copy {own} {dtype} {op} len {len}");
                        }
                        if ranks > 1 {
                            for (own, other) in [(ranks - 1, 0), (0, ranks - 1)] {
                                let (inplace, copy) = red_both_in_place(op, &ins, own, other);
                                let what = format!("out {own} + copy {other} in place {dtype} {op} len {len}");
                                assert_eq!(inplace.as_bytes(), want.as_bytes(), "{what}");
                                assert_eq!(copy, want.as_bytes(), "{what}");
                            }
                        }
                    }
                }
            }
        }
    }

    /// Every f16 / bf16 bit pattern (NaNs, infinities, subnormals, signed zeros) through every
    /// tier: bit-exact against the scalar reference except that a NaN only has to be a NaN
    /// (which NaN's payload an add returns depends on operand order the compiler may swap).
    #[test]
    fn half_kernels_on_every_bit_pattern() {
        let is_nan = |dtype: DType, bits: u16| match dtype {
            DType::F16 => f16::from_bits(bits).is_nan(),
            _ => bf16::from_bits(bits).is_nan(),
        };
        for dtype in [DType::F16, DType::BF16] {
            let all: Vec<u16> = (0..=u16::MAX).collect();
            let shifted = |k: usize| -> HostBuffer {
                let v: Vec<u16> = all.iter().cycle().skip(k * 7919).take(all.len() + 5).copied().collect();
                let mut b = HostBuffer::zeroed(dtype, v.len());
                b.as_bytes_mut().copy_from_slice(bytemuck::cast_slice(&v));
                b
            };
            let ins: Vec<HostBuffer> = (0..3).map(shifted).collect();
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
                let want = scalar(op, &ins);
                let mut got = vec![("dispatched", red(op, &ins)), ("generic", red_generic(op, &ins))];
                #[cfg(target_arch = "x86_64")]
                if std::is_x86_feature_detected!("avx2") {
                    let mut out = HostBuffer::zeroed(dtype, ins[0].len());
                    let views: Vec<Src<'_>> = ins.iter().map(|b| Src::Buf(b.as_bytes())).collect();
                    // SAFETY: AVX2 was detected just above.
                    unsafe { avx2::reduce(dtype, op, &views, Dst::plain(out.as_bytes_mut())) };
                    got.push(("avx2", out));
                }
                #[cfg(target_arch = "x86_64")]
                if std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512bw")
                    && std::is_x86_feature_detected!("avx512vl")
                {
                    let mut out = HostBuffer::zeroed(dtype, ins[0].len());
                    let views: Vec<Src<'_>> = ins.iter().map(|b| Src::Buf(b.as_bytes())).collect();
                    // SAFETY: AVX-512 F/BW/VL were detected just above.
                    unsafe { avx512::reduce(dtype, op, &views, Dst::plain(out.as_bytes_mut())) };
                    got.push(("avx512", out));
                }
                let want: &[u16] = bytemuck::cast_slice(want.as_bytes());
                for (tier, out) in &got {
                    let out: &[u16] = bytemuck::cast_slice(out.as_bytes());
                    for (i, (g, w)) in out.iter().zip(want).enumerate() {
                        let same = g == w || (is_nan(dtype, *g) && is_nan(dtype, *w));
                        assert!(same, "{tier} {dtype} {op} element {i}: {g:#06x} vs {w:#06x}");
                    }
                }
            }
        }
    }

    #[test]
    fn unaligned_sub_slices() {
        // Slices that start in the middle of a buffer (as the reduce-scatter slices do).
        let a = data(DType::F32, 4099, 1);
        let b = data(DType::F32, 4099, 2);
        for off in [1usize, 3, 17] {
            let len = 4099 - off;
            let ins = [&a.as_bytes()[off * 4..], &b.as_bytes()[off * 4..]];
            let mut out = vec![0u8; len * 4];
            reduce(DType::F32, ReduceOp::Sum, &ins, &mut out);
            let want: Vec<f32> = a.as_slice::<f32>().unwrap()[off..]
                .iter()
                .zip(&b.as_slice::<f32>().unwrap()[off..])
                .map(|(x, y)| x + y)
                .collect();
            assert_eq!(out, bytemuck::cast_slice::<f32, u8>(&want));
        }
    }

    #[test]
    fn streaming_matches_plain_at_any_alignment() {
        for dtype in [DType::F32, DType::I32, DType::BF16] {
            let n = 3000;
            let (a, b) = (data(dtype, n, 11), data(dtype, n, 12));
            let es = dtype.size();
            for off in [0usize, 1, 5, 16, 17] {
                for len in [0usize, 1, 15, 16, 17, 64, 100, 1000, n - off] {
                    let r = off * es..(off + len) * es;
                    let ins = [&a.as_bytes()[r.clone()], &b.as_bytes()[r.clone()]];
                    let mut want = vec![0xa5u8; n * es];
                    reduce(dtype, ReduceOp::Sum, &ins, &mut want[r.clone()]);
                    let mut got = HostBuffer::zeroed(dtype, n);
                    got.as_bytes_mut().fill(0xa5);
                    reduce_streaming(dtype, ReduceOp::Sum, &ins, &mut got.as_bytes_mut()[r]);
                    assert_eq!(got.as_bytes(), &want[..], "{dtype} offset {off}, {len} elements");
                }
            }
        }
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
    fn avg_and_long_inputs_cross_blocks() {
        let n = 3 * BLOCK + 5;
        let a = HostBuffer::from_slice(&(0..n).map(|i| i as f64).collect::<Vec<_>>());
        let b = HostBuffer::from_slice(&(0..n).map(|i| 3.0 * i as f64).collect::<Vec<_>>());
        let out = red(ReduceOp::Avg, &[a, b]).to_vec::<f64>().unwrap();
        assert!(out.iter().enumerate().all(|(i, &x)| x == 2.0 * i as f64));
    }
}
