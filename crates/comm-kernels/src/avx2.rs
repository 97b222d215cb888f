//! The AVX2 tier: the generic kernels compiled with AVX2, and the fused f16 (F16C) and bf16
//! kernels.

use comm_core::{DType, ReduceOp};

use crate::half_simd;
use crate::{reduce_generic, Dst, Src, SMALL};

/// The generic kernels, compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn reduce(dtype: DType, op: ReduceOp, inputs: &[Src<'_>], d: Dst<'_>) {
    // The fused f16/bf16 kernels store as they go: widening types never stream.
    let Dst { out, copy, stream } = d;
    if dtype == DType::F16 && half_simd::has_f16c() && out.len() / 2 > SMALL {
        // SAFETY: the CPU has AVX2 (this tier) and F16C (checked).
        return unsafe { half_simd::x86::reduce_f16c(op, inputs, out, copy) };
    }
    if dtype == DType::BF16 && out.len() / 2 > SMALL {
        // SAFETY: this tier runs only where the CPU has AVX2.
        return unsafe { half_simd::x86::reduce_bf16_avx2(op, inputs, out, copy) };
    }
    reduce_generic(dtype, op, inputs, Dst { out, copy, stream })
}
