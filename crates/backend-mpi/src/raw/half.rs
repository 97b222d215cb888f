//! User-defined MPI ops for f16/bf16 (native reduction mode).

use std::ffi::{c_int, c_void};
use std::mem::MaybeUninit;

use comm_core::{bf16, f16, CommError, DType, ReduceOp};
use mpi::ffi;

use super::check;

/// MPI ops combining f16/bf16 elements (carried as `uint16_t`) through f32: Sum, Prod, Min,
/// Max. Each step rounds to 16 bits, so results depend on MPI's reduction order.
pub struct HalfOps {
    /// f16 Sum, Prod, Min, Max, then the same for bf16 (only those created so far).
    ops: Vec<ffi::MPI_Op>,
}

macro_rules! half_op {
    ($name:ident, $t:ty, $f:expr) => {
        unsafe extern "C" fn $name(inv: *mut c_void, inout: *mut c_void, len: *mut c_int, _dt: *mut ffi::MPI_Datatype) {
            if len.is_null() {
                return;
            }
            // SAFETY: `len` is MPI's non-null pointer to the element count of this call.
            let n = unsafe { *len }.max(0) as usize;
            if n == 0 || inv.is_null() || inout.is_null() {
                return;
            }
            // SAFETY: MPI calls this with two distinct, non-null arrays of `n` elements of the
            // datatype the op is used with, which is always `uint16_t` (f16/bf16 bits).
            let (x, y) = unsafe {
                (std::slice::from_raw_parts(inv.cast::<$t>(), n), std::slice::from_raw_parts_mut(inout.cast::<$t>(), n))
            };
            let f: fn(f32, f32) -> f32 = $f;
            for (a, b) in x.iter().zip(y.iter_mut()) {
                *b = <$t>::from_f32(f(a.to_f32(), b.to_f32()));
            }
        }
    };
}

half_op!(f16_sum, f16, |a, b| a + b);
half_op!(f16_prod, f16, |a, b| a * b);
half_op!(f16_min, f16, |a, b| if a < b { a } else { b });
half_op!(f16_max, f16, |a, b| if a > b { a } else { b });
half_op!(bf16_sum, bf16, |a, b| a + b);
half_op!(bf16_prod, bf16, |a, b| a * b);
half_op!(bf16_min, bf16, |a, b| if a < b { a } else { b });
half_op!(bf16_max, bf16, |a, b| if a > b { a } else { b });

type UserFn = unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_int, *mut ffi::MPI_Datatype);

impl HalfOps {
    /// Registers the eight ops with MPI (`MPI_Op_create`, commutative); MPI must be initialised.
    pub fn new() -> Result<HalfOps, CommError> {
        let fns: [UserFn; 8] = [f16_sum, f16_prod, f16_min, f16_max, bf16_sum, bf16_prod, bf16_min, bf16_max];
        let mut made = HalfOps { ops: Vec::with_capacity(8) };
        for f in fns {
            let mut op = MaybeUninit::<ffi::MPI_Op>::uninit();
            // SAFETY: `f` has the MPI_User_function signature; `op` is read only after success.
            unsafe {
                check("MPI_Op_create", ffi::MPI_Op_create(Some(f), 1, op.as_mut_ptr()))?;
                made.ops.push(op.assume_init());
            }
        }
        Ok(made)
    }

    /// The op for `dtype` (f16 or bf16) and `op` (Sum, Prod, Min, Max; Avg uses Sum).
    pub fn get(&self, dtype: DType, op: ReduceOp) -> Option<ffi::MPI_Op> {
        let base = match dtype {
            DType::F16 => 0,
            DType::BF16 => 4,
            _ => return None,
        };
        let i = match op {
            ReduceOp::Sum | ReduceOp::Avg => 0,
            ReduceOp::Prod => 1,
            ReduceOp::Min => 2,
            ReduceOp::Max => 3,
            _ => return None,
        };
        self.ops.get(base + i).copied()
    }
}

impl Drop for HalfOps {
    fn drop(&mut self) {
        for op in &mut self.ops {
            // SAFETY: ops we created; dropped before MPI_Finalize, after the last use.
            unsafe {
                ffi::MPI_Op_free(op);
            }
        }
    }
}
