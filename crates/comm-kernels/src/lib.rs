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
use half::slice::HalfFloatSliceExt;

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
    let srcs: Vec<Src<'_>> = inputs.iter().map(|b| Src::Buf(b)).collect();
    reduce_to(dtype, op, &srcs, out, None);
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
    if inputs.is_empty() || out.is_empty() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    match simd_level() {
        // SAFETY: the CPU supports AVX-512 F/BW/VL (checked at run time by `simd_level`).
        Simd::Avx512 => return unsafe { avx512::reduce(dtype, op, inputs, out, copy) },
        // SAFETY: the CPU supports AVX2 (checked at run time by `simd_level`).
        Simd::Avx2 => return unsafe { avx2::reduce(dtype, op, inputs, out, copy) },
        Simd::None => {}
    }
    reduce_generic(dtype, op, inputs, out, copy)
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

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;

    /// The generic kernels, compiled for AVX2.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn reduce(
        dtype: DType,
        op: ReduceOp,
        inputs: &[Src<'_>],
        out: &mut [u8],
        copy: Option<&mut [u8]>,
    ) {
        if dtype == DType::F16 && half_simd::has_f16c() && out.len() / 2 > SMALL {
            // SAFETY: the CPU has AVX2 (this tier) and F16C (checked).
            return unsafe { half_simd::x86::reduce_f16c(op, inputs, out, copy) };
        }
        if dtype == DType::BF16 && out.len() / 2 > SMALL {
            // SAFETY: this tier runs only where the CPU has AVX2.
            return unsafe { half_simd::x86::reduce_bf16_avx2(op, inputs, out, copy) };
        }
        reduce_generic(dtype, op, inputs, out, copy)
    }
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

/// The destination of a reduction: `out`, and optionally a second copy.
struct Dst<'a> {
    out: &'a mut [u8],
    copy: Option<&'a mut [u8]>,
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;

    /// The generic kernels, compiled for AVX-512.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F, BW and VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn reduce(
        dtype: DType,
        op: ReduceOp,
        inputs: &[Src<'_>],
        out: &mut [u8],
        copy: Option<&mut [u8]>,
    ) {
        if dtype == DType::F16 && out.len() / 2 > SMALL {
            // SAFETY: this tier runs only where the CPU has AVX-512 F.
            return unsafe { half_simd::x86::reduce_avx512(op, inputs, out, copy) };
        }
        if dtype == DType::BF16 && out.len() / 2 > SMALL {
            // SAFETY: as above.
            return unsafe { half_simd::x86::reduce_bf16_avx512(op, inputs, out, copy) };
        }
        reduce_generic(dtype, op, inputs, out, copy)
    }
}

#[inline(always)]
fn reduce_generic(dtype: DType, op: ReduceOp, inputs: &[Src<'_>], out: &mut [u8], copy: Option<&mut [u8]>) {
    let d = Dst { out, copy };
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

/// f16/bf16 kernels written with the CPU's own instructions: fused reductions (see
/// [`x86::reduce_avx512`]) where the compiler's code for the generic kernel is poor — f16
/// conversions (`vcvtph2ps` / `vcvtps2ph`) and AVX2's bf16 narrowing. Rounding is to nearest
/// even and NaNs stay NaNs, as `half`'s conversions (tested on every bit pattern).
mod half_simd {
    use super::*;

    /// Whether the CPU converts f16 in hardware (F16C), for the AVX2 tier.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn has_f16c() -> bool {
        use std::sync::OnceLock;
        static F16C: OnceLock<bool> = OnceLock::new();
        *F16C.get_or_init(|| std::is_x86_feature_detected!("f16c"))
    }

    #[cfg(target_arch = "x86_64")]
    pub(super) mod x86 {
        use super::*;
        use std::arch::x86_64::*;

        /// Round to nearest even (F16C's immediate has 3 bits: no exception flag).
        const ROUND: i32 = _MM_FROUND_TO_NEAREST_INT;

        /// One fused f16 reduction per vector width: every input converted, combined in rank
        /// order and rounded once, `W` lanes at a time, with no f32 block in between (the
        /// blocked path's extra passes made f16 the slowest dtype). The combining ops are the
        /// generic kernel's (`min(b, a)` is `b < a ? b : a`, NaN-compatible with it); the tail
        /// goes through the generic kernel.
        macro_rules! fused {
            ($name:ident, $dtype:expr, $feat:literal, $w:literal, $vh:ty, $load_h:ident, $store_h:ident, $to:ident,
             $to_arith:ident, $from:ident,
             $round:expr, $add:ident, $mul:ident, $div:ident, $min:ident, $max:ident, $set1:ident) => {
                /// # Safety
                /// The CPU must support the features enabled here.
                #[target_feature(enable = $feat)]
                pub(crate) unsafe fn $name(
                    op: ReduceOp,
                    inputs: &[Src<'_>],
                    out: &mut [u8],
                    mut copy: Option<&mut [u8]>,
                ) {
                    let n = out.len() / 2;
                    let main = n / $w * $w;
                    let out_ptr = out.as_mut_ptr().cast::<u16>();
                    let copy_ptr = copy.as_deref_mut().map(|c| c.as_mut_ptr().cast::<u16>());
                    // `out` and `copy` are read and written through the same pointers.
                    let ptrs: Vec<*const u16> = inputs
                        .iter()
                        .map(|s| match s {
                            Src::Buf(b) => b.as_ptr().cast::<u16>(),
                            Src::Out => out_ptr.cast_const(),
                            // Checked by `reduce_to`: there is a copy buffer.
                            Src::Copy => copy_ptr.map_or(std::ptr::null(), <*mut u16>::cast_const),
                        })
                        .collect();
                    let count = inputs.len() as f32;
                    macro_rules! run {
                        ($to_f:ident, $combine:expr, $finish:expr) => {{
                            let mut i = 0;
                            while i < main {
                                // SAFETY: every input, `out` and `copy` have `n` >= i + W
                                // elements (u16 lanes; unaligned loads and stores). All inputs
                                // of lanes i..i+W are read before `out`'s and `copy`'s lanes
                                // are written, so either may be one of them.
                                unsafe {
                                    let mut acc = $to_f($load_h(ptrs[0].add(i).cast::<$vh>()));
                                    for p in &ptrs[1..] {
                                        acc = $combine(acc, $to_f($load_h(p.add(i).cast::<$vh>())));
                                    }
                                    let h = $from::<{ $round }>($finish(acc));
                                    $store_h(out_ptr.add(i).cast::<$vh>(), h);
                                    if let Some(c) = copy_ptr {
                                        $store_h(c.add(i).cast::<$vh>(), h);
                                    }
                                }
                                i += $w;
                            }
                        }};
                    }
                    let id = |a| a;
                    // With two inputs or more, sums and products go through arithmetic, which
                    // quiets a NaN itself (keeping its payload): `$to_arith` may skip that.
                    let arith = inputs.len() > 1;
                    match op {
                        ReduceOp::Sum if arith => run!($to_arith, |a, b| $add(a, b), id),
                        ReduceOp::Sum => run!($to, |a, b| $add(a, b), id),
                        ReduceOp::Avg if arith => run!($to_arith, |a, b| $add(a, b), |a| $div(a, $set1(count))),
                        ReduceOp::Avg => run!($to, |a, b| $add(a, b), |a| $div(a, $set1(count))),
                        ReduceOp::Prod if arith => run!($to_arith, |a, b| $mul(a, b), id),
                        ReduceOp::Prod => run!($to, |a, b| $mul(a, b), id),
                        ReduceOp::Min => run!($to, |a, b| $min(b, a), id),
                        ReduceOp::Max => run!($to, |a, b| $max(b, a), id),
                        // Not float ops (validated away): the generic kernel decides.
                        _ => return reduce_generic($dtype, op, inputs, out, copy),
                    }
                    if main < n {
                        let tail: Vec<Src<'_>> = inputs
                            .iter()
                            .map(|s| match s {
                                Src::Buf(b) => Src::Buf(&b[main * 2..]),
                                other => *other,
                            })
                            .collect();
                        reduce_generic($dtype, op, &tail, &mut out[main * 2..], copy.map(|c| &mut c[main * 2..]));
                    }
                }
            };
        }

        fused!(
            reduce_avx512,
            DType::F16,
            "avx512f",
            16,
            __m256i,
            _mm256_loadu_si256,
            _mm256_storeu_si256,
            _mm512_cvtph_ps,
            _mm512_cvtph_ps,
            _mm512_cvtps_ph,
            ROUND | _MM_FROUND_NO_EXC,
            _mm512_add_ps,
            _mm512_mul_ps,
            _mm512_div_ps,
            _mm512_min_ps,
            _mm512_max_ps,
            _mm512_set1_ps
        );
        // 16 lanes per iteration as two 8-lane halves: two independent chains, one load and
        // one store of 256 bits (kernel: 8 lanes ran at 13.8 GB/s, 16 at 23.5, f32 21-23).
        fused!(
            reduce_f16c,
            DType::F16,
            "avx,avx2,f16c",
            16,
            __m256i,
            _mm256_loadu_si256,
            _mm256_storeu_si256,
            f16x16_to_x2,
            f16x16_to_x2,
            x2_to_f16x16,
            ROUND,
            add2,
            mul2,
            div2,
            min2,
            max2,
            set1x2
        );
        fused!(
            reduce_bf16_avx2,
            DType::BF16,
            "avx,avx2",
            16,
            __m256i,
            _mm256_loadu_si256,
            _mm256_storeu_si256,
            bf16x16_to_x2,
            bf16x16_to_x2_raw,
            x2_to_bf16x16,
            0,
            add2,
            mul2,
            div2,
            min2,
            max2,
            set1x2
        );

        // bf16 on AVX-512: the AVX2 kernel's even/odd scheme on 32 lanes. The compiler's
        // widening (`vpmovzxwd`) and narrowing (`vpmovdw`) are cross-lane moves, slow on CPUs
        // that run 512-bit operations as two 256-bit halves (Zen 4).
        fused!(
            reduce_bf16_avx512,
            DType::BF16,
            "avx512f",
            32,
            __m512i,
            _mm512_loadu_si512,
            _mm512_storeu_si512,
            bf16x32_to_w2,
            bf16x32_to_w2_raw,
            w2_to_bf16x32,
            0,
            addw,
            mulw,
            divw,
            minw,
            maxw,
            set1w
        );

        /// 32 f32 lanes as two AVX-512 registers (even lanes, odd lanes).
        #[derive(Clone, Copy)]
        struct W2(__m512, __m512);

        macro_rules! pairwise512 {
            ($($name:ident => $f:ident),*) => {$(
                #[target_feature(enable = "avx512f")]
                fn $name(a: W2, b: W2) -> W2 {
                    W2($f(a.0, b.0), $f(a.1, b.1))
                }
            )*};
        }
        pairwise512!(addw => _mm512_add_ps, mulw => _mm512_mul_ps, divw => _mm512_div_ps, minw => _mm512_min_ps,
            maxw => _mm512_max_ps);

        #[target_feature(enable = "avx512f")]
        fn set1w(x: f32) -> W2 {
            W2(_mm512_set1_ps(x), _mm512_set1_ps(x))
        }

        /// [`bf16_bits_to_f32`] on 32 lanes, as (even lanes, odd lanes): widen, quiet the NaNs.
        #[target_feature(enable = "avx512f")]
        fn bf16x32_to_w2(h: __m512i) -> W2 {
            let quiet = |x: __m512i| {
                let abs = _mm512_and_si512(x, _mm512_set1_epi32(0x7FFF_FFFF));
                let nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7F80_0000));
                _mm512_castsi512_ps(_mm512_mask_or_epi32(x, nan, x, _mm512_set1_epi32(0x0040_0000)))
            };
            let W2(even, odd) = bf16x32_to_w2_raw(h);
            W2(quiet(_mm512_castps_si512(even)), quiet(_mm512_castps_si512(odd)))
        }

        /// Widen only (see [`bf16x16_to_x2_raw`]).
        #[target_feature(enable = "avx512f")]
        fn bf16x32_to_w2_raw(h: __m512i) -> W2 {
            let even = _mm512_slli_epi32::<16>(h);
            let odd = _mm512_and_si512(h, _mm512_set1_epi32(0xFFFF_0000_u32 as i32));
            W2(_mm512_castsi512_ps(even), _mm512_castsi512_ps(odd))
        }

        /// [`f32_to_bf16_bits`] on (even lanes, odd lanes), as [`x2_to_bf16x16`].
        #[target_feature(enable = "avx512f")]
        fn w2_to_bf16x32<const R: i32>(v: W2) -> __m512i {
            let rounded = |x: __m512i| {
                let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(1));
                _mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)))
            };
            let (x0, x1) = (_mm512_castps_si512(v.0), _mm512_castps_si512(v.1));
            let nan0 = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v.0, v.0);
            let nan1 = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v.1, v.1);
            let (r0, r1) = if nan0 | nan1 == 0 {
                (rounded(x0), rounded(x1))
            } else {
                // A NaN keeps its high half, quieted (the rounding add could carry out of it).
                let quiet = |x: __m512i| _mm512_or_si512(x, _mm512_set1_epi32(0x0040_0000));
                (
                    _mm512_mask_blend_epi32(nan0, rounded(x0), quiet(x0)),
                    _mm512_mask_blend_epi32(nan1, rounded(x1), quiet(x1)),
                )
            };
            _mm512_or_si512(
                _mm512_srli_epi32::<16>(r0),
                _mm512_and_si512(r1, _mm512_set1_epi32(0xFFFF_0000_u32 as i32)),
            )
        }

        /// 16 f32 lanes as two AVX2 registers: the bf16 AVX2 kernel works 16 elements at a
        /// time (two independent chains per iteration, one 256-bit store).
        #[derive(Clone, Copy)]
        struct X2(__m256, __m256);

        macro_rules! pairwise {
            ($($name:ident => $f:ident),*) => {$(
                #[target_feature(enable = "avx,avx2")]
                fn $name(a: X2, b: X2) -> X2 {
                    X2($f(a.0, b.0), $f(a.1, b.1))
                }
            )*};
        }
        pairwise!(add2 => _mm256_add_ps, mul2 => _mm256_mul_ps, div2 => _mm256_div_ps, min2 => _mm256_min_ps,
            max2 => _mm256_max_ps);

        #[target_feature(enable = "avx,avx2")]
        fn set1x2(x: f32) -> X2 {
            X2(_mm256_set1_ps(x), _mm256_set1_ps(x))
        }

        /// F16C's conversion on 16 lanes (two halves).
        #[target_feature(enable = "avx,avx2,f16c")]
        fn f16x16_to_x2(h: __m256i) -> X2 {
            X2(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(h)))
        }

        /// F16C's rounding conversion on 16 lanes (two halves).
        #[target_feature(enable = "avx,avx2,f16c")]
        fn x2_to_f16x16<const R: i32>(v: X2) -> __m256i {
            _mm256_set_m128i(_mm256_cvtps_ph::<R>(v.1), _mm256_cvtps_ph::<R>(v.0))
        }

        // bf16 on AVX2 keeps the 16 lanes of a 256-bit load where they are: the even lanes
        // (low halves of the 32-bit words) become one f32 vector by a shift, the odd lanes
        // (high halves) another by a mask, and narrowing puts each back with a shift or a mask
        // and one OR. No widening moves, packs or cross-lane permutes, which cost 2-3 uops each
        // on CPUs that split 256-bit operations into 128-bit halves (Zen 1/2).

        /// [`bf16_bits_to_f32`] on 16 lanes, as (even lanes, odd lanes): widen, quiet the NaNs.
        #[target_feature(enable = "avx,avx2")]
        fn bf16x16_to_x2(h: __m256i) -> X2 {
            let quiet = |x: __m256i| {
                let abs = _mm256_and_si256(x, _mm256_set1_epi32(0x7FFF_FFFF));
                let nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7F80_0000));
                _mm256_castsi256_ps(_mm256_or_si256(x, _mm256_and_si256(nan, _mm256_set1_epi32(0x0040_0000))))
            };
            let X2(even, odd) = bf16x16_to_x2_raw(h);
            X2(quiet(_mm256_castps_si256(even)), quiet(_mm256_castps_si256(odd)))
        }

        /// Widen only: a signalling NaN stays signalling, for inputs that go through arithmetic
        /// (which quiets it, as [`bf16x16_to_x2`] would have).
        #[target_feature(enable = "avx,avx2")]
        fn bf16x16_to_x2_raw(h: __m256i) -> X2 {
            let even = _mm256_slli_epi32::<16>(h);
            let odd = _mm256_and_si256(h, _mm256_set1_epi32(0xFFFF_0000_u32 as i32));
            X2(_mm256_castsi256_ps(even), _mm256_castsi256_ps(odd))
        }

        /// [`f32_to_bf16_bits`] on (even lanes, odd lanes): round to nearest even, NaNs quiet,
        /// each half back into its 16 bits of the 32-bit words.
        #[target_feature(enable = "avx,avx2")]
        fn x2_to_bf16x16<const R: i32>(v: X2) -> __m256i {
            // x + 0x7FFF + (bit 16 of x): the bf16 in the high half, rounded.
            let rounded = |x: __m256i| {
                let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(1));
                _mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)))
            };
            let high = _mm256_set1_epi32(0xFFFF_0000_u32 as i32);
            let (x0, x1) = (_mm256_castps_si256(v.0), _mm256_castps_si256(v.1));
            // NaNs are rare: one test for all 16 lanes, and their fix-up only when there is one.
            let nan = _mm256_or_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(v.0, v.0), _mm256_cmp_ps::<_CMP_UNORD_Q>(v.1, v.1));
            let (r0, r1) = if _mm256_testz_ps(nan, nan) == 1 {
                (rounded(x0), rounded(x1))
            } else {
                // A NaN keeps its high half, quieted (the rounding add could carry out of it).
                let with_nans = |x: __m256i| {
                    let abs = _mm256_and_si256(x, _mm256_set1_epi32(0x7FFF_FFFF));
                    let nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7F80_0000));
                    let quiet = _mm256_or_si256(x, _mm256_set1_epi32(0x0040_0000));
                    _mm256_blendv_epi8(rounded(x), quiet, nan)
                };
                (with_nans(x0), with_nans(x1))
            };
            _mm256_or_si256(_mm256_srli_epi32::<16>(r0), _mm256_and_si256(r1, high))
        }
    }
}

/// `half::bf16::to_f32` without branches (so it vectorises): NaNs get the quiet bit.
#[inline(always)]
fn bf16_bits_to_f32(i: u16) -> f32 {
    let x = (i as u32) << 16;
    let nan = (i & 0x7FFF) > 0x7F80;
    f32::from_bits(if nan { x | 0x0040_0000 } else { x })
}

/// `half::bf16::from_f32` without branches: round to nearest even, NaNs stay quiet NaNs.
#[inline(always)]
fn f32_to_bf16_bits(v: f32) -> u16 {
    let x = v.to_bits();
    let nan = x & 0x7FFF_FFFF > 0x7F80_0000;
    // Round half to even: add 0x7FFF plus the lowest kept bit, then truncate. (NaNs, the only
    // values for which the add could carry out, take the other branch.)
    let rounded = (x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16) as u16;
    if nan {
        ((x >> 16) | 0x0040) as u16
    } else {
        rounded
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
fn run<T: Lane>(
    inputs: &[Src<'_>],
    dst: Dst<'_>,
    combine: impl Fn(T::Acc, T::Acc) -> T::Acc,
    finish: impl Fn(T::Acc) -> T::Acc,
) {
    let out: &mut [T] = bytemuck::cast_slice_mut(dst.out);
    let mut copy: Option<&mut [T]> = dst.copy.map(bytemuck::cast_slice_mut);
    let bufs: Vec<In<'_, T>> = inputs
        .iter()
        .map(|s| match s {
            Src::Buf(b) => In::Buf(bytemuck::cast_slice::<u8, T>(b)),
            Src::Out => In::Out,
            Src::Copy => In::Copy,
        })
        .collect();
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
    } else if out.len() <= 4 * SMALL {
        // Small blocks for small buffers: setting up two 1024-element blocks costs more than
        // reducing a few hundred elements (64 f32: 28 ns with 64-element blocks, 116 ns
        // element by element); from ~1024 elements the big blocks win again.
        blocks::<T, SMALL>(&bufs, out, copy, combine, finish);
    } else {
        blocks::<T, BLOCK>(&bufs, out, copy, combine, finish);
    }
}

/// An input of `run`, typed.
enum In<'a, T> {
    Buf(&'a [T]),
    Out,
    Copy,
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use comm_core::HostBuffer;

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
        reduce_generic(ins[0].dtype(), op, &views, out.as_bytes_mut(), None);
        out
    }

    /// Input `own` taken in place from the output buffer, result also copied out.
    fn red_in_place(op: ReduceOp, ins: &[HostBuffer], own: usize) -> (HostBuffer, Vec<u8>) {
        let mut out = ins[own].clone();
        let mut copy = vec![0u8; out.byte_len()];
        let views: Vec<Src<'_>> =
            ins.iter().enumerate().map(|(i, b)| if i == own { Src::Out } else { Src::Buf(b.as_bytes()) }).collect();
        reduce_to(ins[0].dtype(), op, &views, out.as_bytes_mut(), Some(&mut copy));
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
                            unsafe { avx2::reduce(dtype, op, &views, out.as_bytes_mut(), None) };
                            assert_eq!(out.as_bytes(), want.as_bytes(), "avx2 {dtype} {op} len {len}");
                        }
                        let (inplace, copy) = red_in_place(op, &ins, ranks / 2);
                        assert_eq!(inplace.as_bytes(), want.as_bytes(), "in place {dtype} {op} len {len}");
                        assert_eq!(copy, want.as_bytes(), "copy {dtype} {op} len {len}");
                        if ranks > 1 {
                            let (inplace, copy) = red_both_in_place(op, &ins, ranks - 1, 0);
                            assert_eq!(inplace.as_bytes(), want.as_bytes(), "out+copy in place {dtype} {op} len {len}");
                            assert_eq!(copy, want.as_bytes(), "copy in place {dtype} {op} len {len}");
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
                    unsafe { avx2::reduce(dtype, op, &views, out.as_bytes_mut(), None) };
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
                    unsafe { avx512::reduce(dtype, op, &views, out.as_bytes_mut(), None) };
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
    fn bf16_conversions_equal_half_everywhere() {
        for bits in 0..=u16::MAX {
            let h = bf16::from_bits(bits);
            assert_eq!(bf16_bits_to_f32(bits).to_bits(), h.to_f32().to_bits(), "bf16 {bits:#06x}");
        }
        let mut s = 0x1234_5678u32;
        let specials = [
            0u32,
            0x8000_0000,
            0x7F80_0000,
            0xFF80_0000,
            0x7FC0_0000,
            0x7F80_0001,
            0x7F7F_FFFF,
            0x0000_8000,
            0x0001_8000,
            0x3F80_8000,
            0x3F81_8000,
        ];
        for i in 0..2_000_000u32 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            let x = if (i as usize) < specials.len() { specials[i as usize] } else { s };
            let v = f32::from_bits(x);
            assert_eq!(f32_to_bf16_bits(v), bf16::from_f32(v).to_bits(), "f32 {x:#010x}");
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
