use std::fmt;

use half::{bf16, f16};

/// Element type of a buffer.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// `u8`
    U8,
    /// `i8`
    I8,
    /// `i32`
    I32,
    /// `i64`
    I64,
    /// IEEE 754 half precision ([`struct@f16`]).
    F16,
    /// bfloat16 ([`bf16`]).
    BF16,
    /// `f32`
    F32,
    /// `f64`
    F64,
}

impl DType {
    /// Every dtype, in a fixed order (useful for tests and benchmarks).
    pub const ALL: [DType; 8] =
        [DType::U8, DType::I8, DType::I32, DType::I64, DType::F16, DType::BF16, DType::F32, DType::F64];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// Bytes of `len` elements, when that is a size an allocation can have (at most
    /// `isize::MAX` bytes); `None` when it overflows.
    pub const fn checked_bytes(self, len: usize) -> Option<usize> {
        match len.checked_mul(self.size()) {
            Some(b) if b <= isize::MAX as usize => Some(b),
            _ => None,
        }
    }

    /// Whether this is a floating-point type.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }

    /// Stable small integer code, used in wire headers.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// Inverse of [`DType::code`].
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(code as usize).copied()
    }

    /// Lower-case name as torch spells it (`"f32"`, `"bf16"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.to_ascii_lowercase();
        DType::ALL
            .into_iter()
            .find(|d| d.name() == lower)
            .or(match lower.as_str() {
                "float" | "float32" => Some(DType::F32),
                "double" | "float64" => Some(DType::F64),
                "half" | "float16" => Some(DType::F16),
                "bfloat16" => Some(DType::BF16),
                "uint8" => Some(DType::U8),
                "int8" => Some(DType::I8),
                "int32" | "int" => Some(DType::I32),
                "int64" | "long" => Some(DType::I64),
                _ => None,
            })
            .ok_or_else(|| format!("unknown dtype `{s}` (expected one of u8, i8, i32, i64, f16, bf16, f32, f64)"))
    }
}

/// Reduction operator, as `torch.distributed.ReduceOp`.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Product.
    Prod,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Mean over ranks (floating-point dtypes only).
    Avg,
    /// Bitwise and (integer dtypes only).
    BAnd,
    /// Bitwise or (integer dtypes only).
    BOr,
    /// Bitwise xor (integer dtypes only).
    BXor,
}

impl ReduceOp {
    /// Every reduce op, in a fixed order.
    pub const ALL: [ReduceOp; 8] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
        ReduceOp::BAnd,
        ReduceOp::BOr,
        ReduceOp::BXor,
    ];

    /// Whether this op is defined for `dtype`: bitwise ops need an integer type, `Avg` a float.
    pub const fn applies_to(self, dtype: DType) -> bool {
        match self {
            ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => !dtype.is_float(),
            ReduceOp::Avg => dtype.is_float(),
            _ => true,
        }
    }

    /// Stable small integer code, used in wire headers.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// Lower-case name (`"sum"`, `"band"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
            ReduceOp::BAnd => "band",
            ReduceOp::BOr => "bor",
            ReduceOp::BXor => "bxor",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type that is the element of a [`DType`].
///
/// Implemented for `u8, i8, i32, i64, f16, bf16, f32, f64`; typed views of a
/// [`HostBuffer`](crate::HostBuffer) are checked against `DTYPE`.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// The dtype this type represents.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => { $(impl Element for $t { const DTYPE: DType = DType::$d; })* };
}
element!(u8 => U8, i8 => I8, i32 => I32, i64 => I64, f16 => F16, bf16 => BF16, f32 => F32, f64 => F64);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_sizes() {
        for d in DType::ALL {
            assert_eq!(DType::from_code(d.code()), Some(d));
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        assert_eq!(DType::from_code(8), None);
        assert_eq!(DType::BF16.size(), 2);
        assert_eq!(DType::I64.size(), 8);
        assert!("f33".parse::<DType>().unwrap_err().contains("f33"));
    }

    #[test]
    fn op_applicability() {
        assert!(!ReduceOp::BXor.applies_to(DType::F32));
        assert!(ReduceOp::BXor.applies_to(DType::I8));
        assert!(!ReduceOp::Avg.applies_to(DType::I32));
        assert!(ReduceOp::Avg.applies_to(DType::BF16));
        assert!(ReduceOp::Max.applies_to(DType::U8));
    }
}
