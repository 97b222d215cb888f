//! f16/bf16 kernels written with the CPU's own instructions: fused reductions (see
//! [`x86::reduce_avx512`]) where the compiler's code for the generic kernel is poor — f16
//! conversions (`vcvtph2ps` / `vcvtps2ph`) and AVX2's bf16 narrowing. Rounding is to nearest
//! even and NaNs stay NaNs, as `half`'s conversions (tested on every bit pattern).

use comm_core::{DType, ReduceOp};

use crate::{reduce_generic, Dst, Src};

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
            pub(crate) unsafe fn $name(op: ReduceOp, inputs: &[Src<'_>], out: &mut [u8], mut copy: Option<&mut [u8]>) {
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
                    _ => return reduce_generic($dtype, op, inputs, Dst { out, copy, stream: false }),
                }
                if main < n {
                    let tail: Vec<Src<'_>> = inputs
                        .iter()
                        .map(|s| match s {
                            Src::Buf(b) => Src::Buf(&b[main * 2..]),
                            other => *other,
                        })
                        .collect();
                    let (out, copy) = (&mut out[main * 2..], copy.map(|c| &mut c[main * 2..]));
                    reduce_generic($dtype, op, &tail, Dst { out, copy, stream: false });
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

    /// [`bf16_bits_to_f32`](crate::convert::bf16_bits_to_f32) on 32 lanes, as (even lanes, odd lanes): widen, quiet the NaNs.
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

    /// [`f32_to_bf16_bits`](crate::convert::f32_to_bf16_bits) on (even lanes, odd lanes), as [`x2_to_bf16x16`].
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
        _mm512_or_si512(_mm512_srli_epi32::<16>(r0), _mm512_and_si512(r1, _mm512_set1_epi32(0xFFFF_0000_u32 as i32)))
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

    /// [`bf16_bits_to_f32`](crate::convert::bf16_bits_to_f32) on 16 lanes, as (even lanes, odd lanes): widen, quiet the NaNs.
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

    /// [`f32_to_bf16_bits`](crate::convert::f32_to_bf16_bits) on (even lanes, odd lanes): round to nearest even, NaNs quiet,
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
