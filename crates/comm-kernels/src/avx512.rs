//! The AVX-512 tier: the generic kernels compiled with AVX-512 F/BW/VL, and the fused f16
//! and bf16 kernels.

use comm_core::{DType, ReduceOp};

use crate::half_simd;
use crate::{reduce_generic, Dst, Src, SMALL};

/// The generic kernels, compiled for AVX-512.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VL.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn reduce(dtype: DType, op: ReduceOp, inputs: &[Src<'_>], d: Dst<'_>) {
    // The fused f16/bf16 kernels store as they go: widening types never stream.
    let Dst { out, copy, stream } = d;
    if dtype == DType::F16 && out.len() / 2 > SMALL {
        // SAFETY: this tier runs only where the CPU has AVX-512 F.
        return unsafe { half_simd::x86::reduce_avx512(op, inputs, out, copy) };
    }
    if dtype == DType::BF16 && out.len() / 2 > SMALL {
        // SAFETY: as above.
        return unsafe { half_simd::x86::reduce_bf16_avx512(op, inputs, out, copy) };
    }
    reduce_generic(dtype, op, inputs, Dst { out, copy, stream })
}
