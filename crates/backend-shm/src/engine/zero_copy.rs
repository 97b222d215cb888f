//! Large ops on buffers in the arenas, read (and for all_reduce written) where they are.

#![allow(unsafe_code)] // see the SAFETY comments

use std::sync::Arc;

use comm_core::ops::{slice_of, ReduceScatter};
use comm_core::{CommError, HostBuffer, Rank, ReduceOp};
use comm_kernels::{self as kernels, Src};

use crate::arena::{self, Block, Place};
use crate::layout::{StepHeader, CARRIED};
use crate::segment::Segment;
use crate::tuning;

use super::stores::to_window;
use super::{Engine, Phase, Result, AUX_ZERO_COPY, ZC_CACHE};

/// Peers' buffers mapped here for one op (index: rank; ours `None`): chunk and offset.
type Mapped = Vec<Option<(Arc<Segment>, usize)>>;

/// `len` bytes at `off` of a peer's input mapped for the op, or of this rank's `own` input.
fn peer_or_own<'a>(mapped: &'a Option<(Arc<Segment>, usize)>, own: &'a [u8], off: usize, len: usize) -> &'a [u8] {
    match mapped {
        // SAFETY: a peer's input is in its op until the last step; nobody writes it.
        Some((seg, base)) => unsafe { seg.bytes(base + off, len) },
        None => &own[off..off + len],
    }
}

/// What a rank says in the header of the first step: where its buffer is (fd + 1, 0: not in
/// an arena), whether it can open every peer's memory, the chunk's length, the offset.
pub(super) fn encode(place: Option<Place>, can_open: bool) -> [u8; CARRIED] {
    let mut d = [0u8; CARRIED];
    d[4..8].copy_from_slice(&u32::from(can_open).to_le_bytes());
    if let Some(p) = place {
        d[..4].copy_from_slice(&(p.fd as u32).wrapping_add(1).to_le_bytes());
        d[8..16].copy_from_slice(&(p.chunk_len as u64).to_le_bytes());
        d[16..].copy_from_slice(&(p.off as u64).to_le_bytes());
    }
    d
}

pub(super) fn decode(d: &[u8; CARRIED]) -> (Option<Place>, bool) {
    let word = |i: usize| u64::from_le_bytes(d[i..i + 8].try_into().expect("8 bytes"));
    let fd = u32::from_le_bytes(d[..4].try_into().expect("4 bytes")).checked_sub(1).and_then(|f| i32::try_from(f).ok());
    let place = fd.and_then(|fd| {
        Some(Place { fd, chunk_len: usize::try_from(word(8)).ok()?, off: usize::try_from(word(16)).ok()? })
    });
    (place, d[4..8] != [0; 4])
}

/// Where `b` is, when it is in an arena.
pub(super) fn place_of(b: &HostBuffer) -> Option<Place> {
    b.external().and_then(|e| e.as_any().downcast_ref::<Block>()).and_then(Block::place)
}

impl Engine {
    /// The first step of a large op: every rank says where its buffer is (`mine`) and whether
    /// it can open every peer's memory (same host, visible pid). When every rank can, and the
    /// buffers of the ranks `read` picks are all in arenas, returns those mapped (`bytes` from
    /// each place); else `None`, and the op copies through the window as usual. Every rank
    /// decides the same: all read the same headers.
    fn zc_where(
        &mut self,
        hdr: &StepHeader,
        mine: Option<Place>,
        read: impl Fn(usize) -> bool,
        bytes: impl Fn(usize) -> usize,
    ) -> Result<Option<Mapped>> {
        let (n, me) = (self.world, self.rank);
        let can_open = (0..n).all(|p| p == me || self.procs[p].is_some());
        let hdr = StepHeader { aux: AUX_ZERO_COPY, data: encode(mine, can_open), ..*hdr };
        let k = self.begin(&hdr)?;
        self.publish(k, &hdr)?;
        let said: Vec<(Option<Place>, bool)> = (0..n)
            .map(|p| {
                if p == me {
                    (mine, can_open)
                } else {
                    decode(&self.segs[p].read::<StepHeader>(self.lay.step_header(k)).data)
                }
            })
            .collect();
        self.phase = Phase::Idle;
        if !said.iter().enumerate().all(|(p, (place, open))| *open && (!read(p) || place.is_some())) {
            return Ok(None);
        }
        let mut mapped: Mapped = vec![None; n];
        for p in (0..n).filter(|&p| p != me && read(p)) {
            let place = said[p].0.expect("checked above");
            mapped[p] = Some((self.map_zero_copy(p, place, bytes(p))?, place.off));
        }
        Ok(Some(mapped))
    }

    /// The last step of an op that read peers' buffers: every rank is done with them, so they
    /// can go back to their owners.
    fn zc_done(&mut self, hdr: &StepHeader) -> Result<bool> {
        let hdr = StepHeader { aux: AUX_ZERO_COPY, ..*hdr };
        let k = self.begin(&hdr)?;
        self.publish(k, &hdr)?;
        self.phase = Phase::Idle;
        Ok(true)
    }

    /// all_reduce (a reduce: `root`) of at least `zc_min` bytes in the ranks' arenas: rank r
    /// reduces slice r of every buffer in place (ARCHITECTURE.md, "Zero copy, by default").
    /// Returns `false` when the op must copy through the window instead ([`Self::zc_where`]).
    pub(super) fn zc_all_reduce(
        &mut self,
        buf: &mut HostBuffer,
        op: ReduceOp,
        root: Option<Rank>,
        hdr: &StepHeader,
    ) -> Result<bool> {
        let (dtype, count, es) = (buf.dtype(), buf.len(), buf.dtype().size());
        if place_of(buf).is_none() {
            if let Some(b) = arena::get().and_then(|a| a.block(buf.byte_len(), false)) {
                let mut moved = HostBuffer::from_external(dtype, count, Box::new(b))?;
                moved.as_bytes_mut().copy_from_slice(buf.as_bytes());
                *buf = moved;
            }
        }
        let r = self.zc_where(hdr, place_of(buf), |_| true, |_| count * es).and_then(|peers| match peers {
            Some(peers) => self.zc_reduce(buf, op, root, hdr, &peers),
            None => Ok(false),
        });
        if r.is_err() && place_of(buf).is_some() {
            // Peers that saw where the buffer is may still write their slices into it: it
            // must never hold another buffer (the op fails; its block stays out of use).
            std::mem::forget(std::mem::replace(buf, HostBuffer::zeroed(dtype, 0)));
        }
        r
    }

    /// The reduction of [`zc_all_reduce`](Self::zc_all_reduce) once every buffer is mapped. A
    /// reduce writes slice r of the result into the root's buffer alone.
    fn zc_reduce(
        &mut self,
        buf: &mut HostBuffer,
        op: ReduceOp,
        root: Option<Rank>,
        hdr: &StepHeader,
        peers: &Mapped,
    ) -> Result<bool> {
        let (dtype, count, es, n, me) = (buf.dtype(), buf.len(), buf.dtype().size(), self.world, self.rank);
        let std::ops::Range { start: lo, end: hi } = slice_of(count, n, me);
        let (off, len) = (lo * es, (hi - lo) * es);
        // Every peer published step 1, so its buffer holds its input, and until step 2 only we
        // touch slice `me` of any buffer.
        if let Some(root) = root.map(|r| r as usize) {
            let mine = &mut buf.as_bytes_mut()[off..off + len];
            // The root's slice is borrowed once, exclusively, here.
            let (out, own) = match &peers[root] {
                // SAFETY: slice `me` of the root's buffer is ours (above).
                Some((seg, base)) => (unsafe { seg.bytes_mut(base + off, len) }, Src::Buf(&*mine)),
                None => (mine, Src::Out),
            };
            let srcs: Vec<Src<'_>> = (0..n)
                .map(|p| match &peers[p] {
                    _ if p == root => Src::Out,
                    // SAFETY: slice `me` of peer `p`'s buffer is ours (above); only read.
                    Some((seg, base)) => Src::Buf(unsafe { seg.bytes(base + off, len) }),
                    None => own,
                })
                .collect();
            kernels::reduce_to(dtype, op, &srcs, out, None);
            return self.zc_done(hdr);
        }
        // The first peer's slice is read and written through `copy` (`Src::Copy`); the
        // others' are read here and written after each piece.
        let first = (0..n).find(|&p| p != me);
        // Window-sized pieces, so the copies into the other peers' buffers read the result
        // from cache.
        let piece = (self.lay.window / es).max(1) * es;
        // Each piece of slice `me` is borrowed once below, shared (peers after the first, while
        // reducing) or exclusive (the first's; the others' for the copy, after the shared
        // borrows are gone).
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
        // Every slice of every buffer is written; the buffers can go back to their owners.
        self.zc_done(hdr)
    }

    /// reduce_scatter of inputs of at least `zc_min` bytes, when every rank's input is in an
    /// arena: rank r reduces block r of every rank's input straight into its output.
    pub(super) fn zc_reduce_scatter(
        &mut self,
        r: &ReduceScatter,
        out: &mut HostBuffer,
        hdr: &StepHeader,
    ) -> Result<bool> {
        let (n, me) = (self.world, self.rank);
        let block = out.byte_len();
        let Some(peers) = self.zc_where(hdr, place_of(&r.input), |_| true, |_| block * n)? else { return Ok(false) };
        let at = me * block;
        let ins: Vec<&[u8]> = peers.iter().map(|m| peer_or_own(m, r.input.as_bytes(), at, block)).collect();
        if tuning::past_l3((block * n + block).saturating_mul(n)) {
            kernels::reduce_streaming(out.dtype(), r.op, &ins, out.as_bytes_mut());
        } else {
            kernels::reduce(out.dtype(), r.op, &ins, out.as_bytes_mut());
        }
        self.zc_done(hdr)
    }

    /// all_to_all whose inputs average at least `zc_min` bytes, when every rank's input is in
    /// an arena: each rank copies its block of every peer's input straight into its output.
    /// `matrix[p * n + j]`: the elements rank p sends rank j (every rank has the same).
    pub(super) fn zc_all_to_all(
        &mut self,
        input: &HostBuffer,
        matrix: &[u64],
        out: &mut HostBuffer,
        hdr: &StepHeader,
    ) -> Result<bool> {
        let (n, me, es) = (self.world, self.rank, input.dtype().size());
        // Bytes of `row` (a peer's: checked) from its start to its column `j`.
        let upto = |p: usize, j: usize| -> Option<usize> {
            let elems = matrix[p * n..p * n + j].iter().try_fold(0u64, |a, &x| a.checked_add(x))?;
            usize::try_from(elems).ok()?.checked_mul(es)
        };
        let mut sizes = Vec::with_capacity(n);
        for p in 0..n {
            let (Some(from), Some(to), Some(len)) = (upto(p, me), upto(p, me + 1), upto(p, n)) else {
                return Err(CommError::mismatch("all_to_all", format!("rank {p}'s splits overflow")));
            };
            sizes.push((from, to - from, len));
        }
        let Some(peers) = self.zc_where(hdr, place_of(input), |_| true, |p| sizes[p].2)? else { return Ok(false) };
        let moved = sizes.iter().map(|s| s.2).fold(0usize, usize::saturating_add);
        let stream = tuning::past_l3(moved.saturating_mul(2));
        let dst = out.as_bytes_mut();
        let mut at = 0;
        for (p, mapped) in peers.iter().enumerate() {
            let (from, len, _) = sizes[p];
            to_window(stream, &mut dst[at..at + len], peer_or_own(mapped, input.as_bytes(), from, len));
            at += len;
        }
        self.zc_done(hdr)
    }

    /// all_gather (`out` on every rank), or gather past one step (`out` the root's alone), of
    /// inputs of at least `zc_min` bytes, when every rank's input is in an arena: a rank with
    /// `out` copies every input straight into it (one copy instead of two). `moved`: the bytes
    /// the ranks touch together (`tuning::past_l3`).
    pub(super) fn zc_gather(
        &mut self,
        input: &HostBuffer,
        moved: usize,
        out: Option<&mut HostBuffer>,
        hdr: &StepHeader,
    ) -> Result<bool> {
        let bytes = input.byte_len();
        let Some(peers) = self.zc_where(hdr, place_of(input), |_| true, |_| bytes)? else { return Ok(false) };
        if let Some(out) = out {
            let (stream, dst) = (tuning::past_l3(moved), out.as_bytes_mut());
            for (p, mapped) in peers.iter().enumerate() {
                to_window(
                    stream,
                    &mut dst[p * bytes..(p + 1) * bytes],
                    peer_or_own(mapped, input.as_bytes(), 0, bytes),
                );
            }
        }
        self.zc_done(hdr)
    }

    /// broadcast, or scatter (`scatter`: each rank's block), of at least `zc_min` bytes from an
    /// input in the root's arena: every rank but the root copies its part straight into `out`
    /// (one copy instead of two); a scatter's root copies its own block from `own`, its input.
    pub(super) fn zc_from_root(
        &mut self,
        hdr: &StepHeader,
        root: usize,
        own: Option<&HostBuffer>,
        out: &mut HostBuffer,
        scatter: bool,
    ) -> Result<bool> {
        let (len, n, me) = (out.byte_len(), self.world, self.rank);
        let place = own.or((!scatter && me == root).then_some(&*out)).and_then(place_of);
        let (at, total, moved) = if scatter { (me * len, len * n, 2 * n) } else { (0, len, n) };
        let Some(peers) = self.zc_where(hdr, place, |p| p == root, |_| total)? else { return Ok(false) };
        let src = match (&peers[root], own) {
            // SAFETY: the root's input is in its op until the last step; nobody writes it.
            (Some((seg, base)), _) => unsafe { seg.bytes(base + at, len) },
            (None, Some(own)) => &own.as_bytes()[at..at + len],
            (None, None) => return self.zc_done(hdr), // a broadcast's root
        };
        to_window(tuning::past_l3(len.saturating_mul(moved)), out.as_bytes_mut(), src);
        self.zc_done(hdr)
    }

    /// Peer `peer`'s arena chunk holding the `bytes` at `place`, mapped once (through its
    /// process).
    pub(super) fn map_zero_copy(&mut self, peer: usize, place: Place, bytes: usize) -> Result<Arc<Segment>> {
        if place.off.checked_add(bytes).is_none_or(|end| end > place.chunk_len) {
            return Err(CommError::mismatch(
                self.op,
                format!("rank {peer} named {bytes} bytes at {} of a chunk of {} bytes", place.off, place.chunk_len),
            ));
        }
        let key = (peer, place.fd);
        if let Some(i) = self.zc_maps.iter().position(|(k, s)| *k == key && s.len() >= place.chunk_len) {
            let hit = self.zc_maps.remove(i);
            self.zc_maps.push(hit.clone());
            return Ok(hit.1);
        }
        let pid = self.procs[peer].map_or(0, |p| p.pid);
        let seg = Segment::open_anonymous(pid, place.fd, place.chunk_len).map_err(|e| {
            let fd = place.fd;
            let what = format!("mapping rank {peer}'s shared-memory arena (process {pid}, fd {fd}); COMM_SHM_ARENA_MIN=off turns the arena off");
            CommError::io(what, e)
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

/// Copies `dst.len()` bytes from `off` in a peer's chunk: a message it sent in place, which it
/// keeps unwritten in its send until we acknowledge the chunk that said where it is.
pub(super) fn copy_in_place(seg: &Segment, off: usize, dst: &mut [u8]) {
    // SAFETY: the sender does not write the message until we acknowledge it, which the caller
    // does after this borrow ends; `map_zero_copy` checked that it lies in the chunk.
    dst.copy_from_slice(unsafe { seg.bytes(off, dst.len()) });
}
