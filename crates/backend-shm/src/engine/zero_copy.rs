//! all_reduce on buffers from `alloc_buffer`, read and written in the peers' segments.

#![allow(unsafe_code)] // see the SAFETY comments

use std::sync::Arc;

use comm_core::ops::slice_of;
use comm_core::{CommError, HostBuffer, OpKind, ReduceOp};
use comm_kernels::{self as kernels, Src};

use crate::layout::{StepHeader, NAME_LEN};
use crate::segment::Segment;

use super::{Engine, Phase, Result, AUX_ZERO_COPY, ZC_CACHE};

impl Engine {
    /// all_reduce on buffers from `alloc_buffer`. Rank r owns slice r of *every* rank's
    /// buffer for the op: it reduces slice r reading all buffers directly and writes the
    /// result into all of them in the same pass (the lines it writes in a peer's buffer are
    /// the ones it just read, so they are in cache). Nobody else reads or writes slice r, so
    /// two steps suffice: one to learn where the buffers are (and that they hold their
    /// inputs), one to know every slice is written before the buffer goes back to its owner.
    /// No window traffic, no copy-in or copy-out pass.
    pub(super) fn zc_all_reduce(&mut self, buf: &mut HostBuffer, op: ReduceOp, name: &str) -> Result<()> {
        let (dtype, count, es, n, me) = (buf.dtype(), buf.len(), buf.dtype().size(), self.world, self.rank);
        let hdr = StepHeader { aux: AUX_ZERO_COPY, ..self.header(OpKind::AllReduce, dtype, count, 0, Some(op)) };
        // Step 1: tell the peers where our data is.
        let k = self.begin(&hdr)?;
        let mut tag = [0u8; NAME_LEN];
        tag[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: write phase of step `k` (see `begin`).
        unsafe { self.me().write(self.lay.step_name(k), tag) };
        self.publish(k, &hdr)?;
        let mut peers: Vec<Option<Arc<Segment>>> = vec![None; n];
        for (p, slot) in peers.iter_mut().enumerate().filter(|(p, _)| *p != me) {
            let raw: [u8; NAME_LEN] = self.segs[p].read(self.lay.step_name(k));
            let end = raw.iter().position(|&b| b == 0).unwrap_or(NAME_LEN);
            let theirs = String::from_utf8_lossy(&raw[..end]).into_owned();
            *slot = Some(self.map_zero_copy(p, &theirs, count * es)?);
        }
        self.phase = Phase::Idle;
        let std::ops::Range { start: lo, end: hi } = slice_of(count, n, me);
        let (off, len) = (lo * es, (hi - lo) * es);
        // The first peer's slice is read and written through `copy` (`Src::Copy`); the
        // others' are read here and written after each piece.
        let first = (0..n).find(|&p| p != me);
        // Window-sized pieces, so the copies into the other peers' buffers read the result
        // from cache.
        let piece = (self.lay.window / es).max(1) * es;
        // Every peer published step 1, so its buffer holds its input, and until step 2 only we
        // touch slice `me` of any buffer: each piece of it is borrowed once below, shared
        // (peers after the first, while reducing) or exclusive (the first's; the others' for
        // the copy, after the shared borrows are gone).
        for start in (0..len).step_by(piece) {
            let end = (start + piece).min(len);
            let (at, bytes) = (off + start, end - start);
            {
                let srcs: Vec<Src<'_>> = (0..n)
                    .map(|p| match &peers[p] {
                        // SAFETY: slice `me` of peer `p`'s buffer is ours (above).
                        Some(seg) if Some(p) != first => Src::Buf(unsafe { seg.bytes(at, bytes) }),
                        _ if p == me => Src::Out,
                        _ => Src::Copy,
                    })
                    .collect();
                // SAFETY: slice `me` of the first peer's buffer is ours (above), borrowed only here.
                let copy = first.and_then(|p| peers[p].as_ref()).map(|seg| unsafe { seg.bytes_mut(at, bytes) });
                kernels::reduce_to(dtype, op, &srcs, &mut buf.as_bytes_mut()[at..at + bytes], copy);
            }
            for seg in (0..n).filter(|&p| p != me && Some(p) != first).filter_map(|p| peers[p].as_ref()) {
                // SAFETY: slice `me` of peer `p`'s buffer is ours (above); the shared borrow
                // of it ended with the block above.
                unsafe { seg.bytes_mut(at, bytes) }.copy_from_slice(&buf.as_bytes()[at..at + bytes]);
            }
        }
        // Step 2: every slice of every buffer is written; the buffer can go back to its owner.
        let k = self.begin(&hdr)?;
        self.publish(k, &hdr)?;
        self.phase = Phase::Idle;
        Ok(())
    }

    pub(super) fn map_zero_copy(&mut self, peer: usize, name: &str, len: usize) -> Result<Arc<Segment>> {
        if let Some(i) = self.zc_maps.iter().position(|(n, _)| n == name) {
            let hit = self.zc_maps.remove(i);
            self.zc_maps.push(hit.clone());
            return Ok(hit.1);
        }
        let seg = Segment::open(name, len).map_err(|e| CommError::Io {
            context: format!("mapping rank {peer}'s zero-copy buffer `{name}`"),
            source: e,
        })?;
        let seg = Arc::new(seg);
        if self.zc_maps.len() >= ZC_CACHE {
            self.zc_maps.remove(0);
        }
        self.zc_maps.push((name.to_owned(), seg.clone()));
        Ok(seg)
    }
}
