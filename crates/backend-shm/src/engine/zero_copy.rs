//! all_reduce of buffers in the arenas, read and written where they are.

#![allow(unsafe_code)] // see the SAFETY comments

use std::sync::Arc;

use comm_core::ops::slice_of;
use comm_core::{CommError, HostBuffer, ReduceOp};
use comm_kernels::{self as kernels, Src};

use crate::arena::{self, Block, Place};
use crate::layout::{StepHeader, CARRIED};
use crate::segment::Segment;

use super::{Engine, Phase, Result, AUX_ZERO_COPY, ZC_CACHE};

/// A place in the header's carried bytes: fd, chunk length, offset (all zero: not in an arena).
fn encode(place: Option<Place>) -> [u8; CARRIED] {
    let mut d = [0u8; CARRIED];
    if let Some(p) = place {
        d[..8].copy_from_slice(&(i64::from(p.fd) + 1).to_le_bytes());
        d[8..16].copy_from_slice(&(p.chunk_len as u64).to_le_bytes());
        d[16..].copy_from_slice(&(p.off as u64).to_le_bytes());
    }
    d
}

fn decode(d: &[u8; CARRIED]) -> Option<Place> {
    let word = |i: usize| u64::from_le_bytes(d[i..i + 8].try_into().expect("8 bytes"));
    let fd = i32::try_from(word(0).checked_sub(1)?).ok()?;
    Some(Place { fd, chunk_len: usize::try_from(word(8)).ok()?, off: usize::try_from(word(16)).ok()? })
}

impl Engine {
    /// all_reduce of at least `zc_min` bytes. A first step tells every rank where the others'
    /// buffers are: when all are in arenas, rank r reduces slice r of *every* rank's buffer
    /// reading them directly and writes the result into all of them in the same pass (the
    /// lines it writes in a peer's buffer are the ones it just read, so they are in cache).
    /// Nobody else reads or writes slice r, so one more step suffices, to know every slice is
    /// written before the buffers go back to their owners: no window traffic, no copy-in or
    /// copy-out pass. Returns `false` when some rank's buffer is not in an arena: then the
    /// caller copies through the window as usual (the same decision on every rank: all read
    /// the same headers).
    ///
    /// A buffer of plain memory goes into the arena first (the one copy it costs), and comes
    /// back in it, so a loop of ops copies once.
    pub(super) fn zc_all_reduce(&mut self, buf: &mut HostBuffer, op: ReduceOp, hdr: &StepHeader) -> Result<bool> {
        let (dtype, count, es, n, me) = (buf.dtype(), buf.len(), buf.dtype().size(), self.world, self.rank);
        let block =
            |b: &HostBuffer| b.external().and_then(|e| e.as_any().downcast_ref::<Block>()).and_then(Block::place);
        if block(buf).is_none() {
            if let Some(a) = arena::get() {
                if let Some(b) = a.block(buf.byte_len(), false) {
                    let mut moved = HostBuffer::from_external(dtype, count, Box::new(b))?;
                    moved.as_bytes_mut().copy_from_slice(buf.as_bytes());
                    *buf = moved;
                }
            }
        }
        // Only where every peer's process can be opened (same host, visible pid).
        let mine = block(buf).filter(|_| (0..n).all(|p| p == me || self.procs[p].is_some()));
        let hdr = StepHeader { aux: AUX_ZERO_COPY, data: encode(mine), ..*hdr };
        let k = self.begin(&hdr)?;
        self.publish(k, &hdr)?;
        let places: Vec<Option<Place>> = (0..n)
            .map(
                |p| if p == me { mine } else { decode(&self.segs[p].read::<StepHeader>(self.lay.step_header(k)).data) },
            )
            .collect();
        self.phase = Phase::Idle;
        if places.iter().any(Option::is_none) {
            return Ok(false);
        }
        let mut peers: Vec<Option<(Arc<Segment>, usize)>> = vec![None; n];
        for (p, slot) in peers.iter_mut().enumerate().filter(|(p, _)| *p != me) {
            let place = places[p].expect("checked above");
            *slot = Some((self.map_zero_copy(p, place, count * es)?, place.off));
        }
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
                        Some((seg, base)) if Some(p) != first => Src::Buf(unsafe { seg.bytes(base + at, bytes) }),
                        _ if p == me => Src::Out,
                        _ => Src::Copy,
                    })
                    .collect();
                // SAFETY: slice `me` of the first peer's buffer is ours (above), borrowed only here.
                let copy =
                    first.and_then(|p| peers[p].as_ref()).map(|(seg, base)| unsafe { seg.bytes_mut(base + at, bytes) });
                kernels::reduce_to(dtype, op, &srcs, &mut buf.as_bytes_mut()[at..at + bytes], copy);
            }
            for (seg, base) in (0..n).filter(|&p| p != me && Some(p) != first).filter_map(|p| peers[p].as_ref()) {
                // SAFETY: slice `me` of peer `p`'s buffer is ours (above); the shared borrow
                // of it ended with the block above.
                unsafe { seg.bytes_mut(base + at, bytes) }.copy_from_slice(&buf.as_bytes()[at..at + bytes]);
            }
        }
        // Step 2: every slice of every buffer is written; the buffer can go back to its owner.
        let k = self.begin(&hdr)?;
        self.publish(k, &hdr)?;
        self.phase = Phase::Idle;
        Ok(true)
    }

    /// Peer `peer`'s arena chunk holding the `bytes` at `place`, mapped once (through its
    /// process).
    pub(super) fn map_zero_copy(&mut self, peer: usize, place: Place, bytes: usize) -> Result<Arc<Segment>> {
        if place.off.checked_add(bytes).is_none_or(|end| end > place.chunk_len) {
            return Err(CommError::Mismatch {
                op: self.op,
                detail: format!(
                    "rank {peer} named {bytes} bytes at {} of a chunk of {} bytes",
                    place.off, place.chunk_len
                ),
            });
        }
        let key = (peer, place.fd);
        if let Some(i) = self.zc_maps.iter().position(|(k, s)| *k == key && s.len() >= place.chunk_len) {
            let hit = self.zc_maps.remove(i);
            self.zc_maps.push(hit.clone());
            return Ok(hit.1);
        }
        let pid = self.procs[peer].map_or(0, |p| p.pid);
        let seg = Segment::open_anonymous(pid, place.fd, place.chunk_len).map_err(|e| CommError::Io {
            context: format!(
                "mapping rank {peer}'s shared-memory arena (process {pid}, fd {}); COMM_SHM_ARENA_MIN=off turns the arena off",
                place.fd
            ),
            source: e,
        })?;
        let seg = Arc::new(seg);
        self.zc_maps.retain(|(k, _)| *k != key);
        if self.zc_maps.len() >= ZC_CACHE {
            self.zc_maps.remove(0);
        }
        self.zc_maps.push((key, seg.clone()));
        Ok(seg)
    }
}
