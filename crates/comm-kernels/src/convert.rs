//! bf16 conversions as branch-free bit operations the compiler vectorises.

/// `half::bf16::to_f32` without branches (so it vectorises): NaNs get the quiet bit.
#[inline(always)]
pub(crate) fn bf16_bits_to_f32(i: u16) -> f32 {
    let x = (i as u32) << 16;
    let nan = (i & 0x7FFF) > 0x7F80;
    f32::from_bits(if nan { x | 0x0040_0000 } else { x })
}

/// `half::bf16::from_f32` without branches: round to nearest even, NaNs stay quiet NaNs.
#[inline(always)]
pub(crate) fn f32_to_bf16_bits(v: f32) -> u16 {
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

#[cfg(test)]
mod tests {
    use super::*;
    use comm_core::bf16;

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
}
