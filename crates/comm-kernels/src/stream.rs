//! Copies with streaming (non-temporal) stores.

#![allow(unsafe_code)] // see the SAFETY comments

/// `dst.copy_from_slice(src)` with stores that bypass the caches, then a store fence: the
/// data is in memory, no cache holds the old lines, and every store is ordered before any
/// later one (a release that publishes it). For a buffer another core reads next: a plain
/// store must first take its line back from the cache of every core that read it last, one
/// round trip per line, which costs far more than the copy where those cores sit apart (on
/// another chiplet). Costs a memory round trip for the reader instead, so only worth it there.
///
/// # Panics
/// When the lengths differ.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming: lengths differ");
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        // Plain stores up to the first 64-byte boundary of `dst` and after the last one.
        let head = dst.as_ptr().align_offset(64).min(dst.len());
        let body = (dst.len() - head) / 64 * 64;
        dst[..head].copy_from_slice(&src[..head]);
        let (d, s) = (dst[head..head + body].as_mut_ptr(), src[head..head + body].as_ptr());
        for i in (0..body).step_by(64) {
            // SAFETY: SSE2 is part of x86-64. `i + 64 <= body`, so the 64 bytes at `s + i` and
            // `d + i` lie in `src` and `dst` (borrowed above, not overlapping: one is `&mut`);
            // `d + i` is 64-byte aligned (`head` aligned it, `i` is a multiple of 64), as
            // `_mm_stream_si128` needs 16; loads are unaligned.
            unsafe {
                for j in 0..4 {
                    let x = _mm_loadu_si128(s.add(i + 16 * j).cast::<__m128i>());
                    _mm_stream_si128(d.add(i + 16 * j).cast::<__m128i>(), x);
                }
            }
        }
        dst[head + body..].copy_from_slice(&src[head + body..]);
        // SAFETY: SSE is part of x86-64.
        unsafe { _mm_sfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// Writes `out` through `fill(i, part)`, which fills `part` with the elements from `i` on:
/// the 64-byte lines in the middle of `out` are filled in a line on the stack (so in
/// registers or L1) and written with streaming stores, the ragged ends in place; then a
/// store fence. For an output larger than the caches, which nothing reads soon: plain stores
/// would first read every line from memory.
#[inline(always)]
pub(crate) fn fill_streaming<T: bytemuck::Pod>(out: &mut [T], mut fill: impl FnMut(usize, &mut [T])) {
    #[repr(C, align(64))]
    #[derive(Clone, Copy)]
    struct Line([u8; 64]);
    let size = std::mem::size_of::<T>();
    if cfg!(not(target_arch = "x86_64")) || size == 0 || 64 % size != 0 {
        return fill(0, out);
    }
    let per = 64 / size;
    // `usize::MAX` (never aligned) when `out` is not aligned to `T`'s size: all in place.
    let head = out.as_ptr().align_offset(64).min(out.len());
    let body = (out.len() - head) / per * per;
    fill(0, &mut out[..head]);
    let mut line = Line([0; 64]);
    for i in (head..head + body).step_by(per) {
        fill(i, bytemuck::cast_slice_mut(&mut line.0));
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{__m128i, _mm_load_si128, _mm_stream_si128};
            let (d, s) = (out[i..i + per].as_mut_ptr().cast::<__m128i>(), line.0.as_ptr().cast::<__m128i>());
            // SAFETY: SSE2 is part of x86-64. `out[i..i + per]` is 64 bytes, 64-byte aligned
            // (`head` aligned it and `i - head` is a multiple of `per`), as `line` is.
            unsafe {
                for j in 0..4 {
                    _mm_stream_si128(d.add(j), _mm_load_si128(s.add(j)));
                }
            }
        }
    }
    fill(head + body, &mut out[head + body..]);
    // SAFETY: SSE is part of x86-64.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_any_length_at_any_alignment() {
        let src: Vec<u8> = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut dst = vec![0u8; 5200];
        for off in [0usize, 1, 15, 16, 63, 64, 65] {
            for len in [0usize, 1, 63, 64, 65, 127, 128, 1000, 4096, 4999 - off] {
                dst.fill(0xee);
                copy_streaming(&mut dst[off..off + len], &src[off..off + len]);
                assert_eq!(&dst[off..off + len], &src[off..off + len], "offset {off}, {len} bytes");
                assert!(dst[..off].iter().chain(&dst[off + len..]).all(|&b| b == 0xee), "offset {off}, {len} bytes");
            }
        }
    }
}
