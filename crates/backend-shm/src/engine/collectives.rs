//! Collectives as sequences of steps.

use comm_core::ops::{slice_of, AllGather, AllToAll, Gather, ReduceScatter, Scatter};
use comm_core::{CommError, HostBuffer, InOut, OpKind, Rank, ReduceOp};
use comm_kernels::{self as kernels, Src};

use crate::layout::StepHeader;

use super::oneshot::concat;
use super::stores::to_window;
use super::{pieces, Choice, Engine, Io, Result};

// Groups of one rank run every op but an uneven all_to_all in its one-step form (`Limits`).
impl Engine {
    /// all_reduce, or reduce to `root` (non-roots keep their input).
    pub(crate) fn all_reduce(&mut self, buf: &mut HostBuffer, op: ReduceOp, root: Option<Rank>) -> Result<()> {
        let (dtype, count, es, n) = (buf.dtype(), buf.len(), buf.dtype().size(), self.world);
        let code = if root.is_some() { OpKind::Reduce } else { OpKind::AllReduce };
        let hdr = self.header(code, dtype, count, root.unwrap_or(0), Some(op));
        if buf.byte_len() >= self.params.zc_min && self.zc_all_reduce(buf, op, root, &hdr)? {
            return Ok(());
        }
        let me = self.rank;
        let keep = root.is_none_or(|r| r as usize == me);
        let user = buf.as_bytes_mut();
        for (off, len) in pieces(count, self.lay.window / es) {
            let chunk = &mut user[off * es..(off + len) * es];
            let bytes = chunk.len();
            // Reduce-scatter, then all-gather the reduced slices; our own slice straight from
            // and to the user's buffer (ARCHITECTURE.md, "One step vs two").
            let std::ops::Range { start: lo, end: hi } = slice_of(len, n, me);
            let own = lo * es..hi * es;
            // all_reduce's and reduce's pieces choose their stores and are timed whole (see
            // `stores`): the reads of what we stream happen in the second step (every rank
            // writes and reads in the first).
            let (stream, start) = self.choose(hdr.op, bytes);
            self.step(&hdr, bytes, Choice::Given(stream), |io, stream| match io {
                Io::Write(w) => {
                    to_window(stream, &mut w[..own.start], &chunk[..own.start]);
                    to_window(stream, &mut w[own.end..bytes], &chunk[own.end..]);
                }
                Io::Read(views, next) if keep => {
                    let srcs: Vec<Src<'_>> =
                        (0..n).map(|p| if p == me { Src::Out } else { Src::Buf(&views[p][own.clone()]) }).collect();
                    if stream {
                        kernels::reduce_to(dtype, op, &srcs, &mut chunk[own.clone()], None);
                        kernels::copy_streaming(&mut next[own.clone()], &chunk[own.clone()]);
                    } else {
                        kernels::reduce_to(dtype, op, &srcs, &mut chunk[own.clone()], Some(&mut next[own.clone()]));
                    }
                }
                Io::Read(views, next) => {
                    // A non-root of `reduce` keeps its input intact.
                    let mine = &chunk[own.clone()];
                    let srcs: Vec<Src<'_>> =
                        (0..n).map(|p| Src::Buf(if p == me { mine } else { &views[p][own.clone()] })).collect();
                    kernels::reduce_to(dtype, op, &srcs, &mut next[own.clone()], None);
                }
            })?;
            self.step(&hdr, bytes, Choice::Plain, |io, _| {
                if let (Io::Read(views, _), true) = (io, keep) {
                    // Start after our own slice and rotate, spreading readers over owners.
                    for i in 1..n {
                        let p = (me + i) % n;
                        let std::ops::Range { start: lo, end: hi } = slice_of(len, n, p);
                        chunk[lo * es..hi * es].copy_from_slice(&views[p][lo * es..hi * es]);
                    }
                }
            })?;
            self.chosen(hdr.op, bytes, stream, start);
        }
        Ok(())
    }

    pub(crate) fn broadcast(&mut self, buf: &mut HostBuffer, root: Rank) -> Result<()> {
        let (es, root) = (buf.dtype().size(), root as usize);
        let hdr = self.header(OpKind::Broadcast, buf.dtype(), buf.len(), root as Rank, None);
        if buf.byte_len() >= self.params.zc_min && self.zc_from_root(&hdr, root, None, buf, false)? {
            return Ok(());
        }
        let is_root = self.rank == root;
        let user = buf.as_bytes_mut();
        for (off, len) in pieces(user.len() / es, self.lay.window / es) {
            let chunk = &mut user[off * es..(off + len) * es];
            let bytes = chunk.len();
            let choice = if is_root { Choice::Writes } else { Choice::Plain };
            self.step(&hdr, bytes, choice, |io, stream| match io {
                Io::Write(w) if is_root => to_window(stream, &mut w[..bytes], chunk),
                Io::Read(views, _) if !is_root => chunk.copy_from_slice(&views[root][..bytes]),
                _ => {}
            })?;
        }
        Ok(())
    }

    /// Fills `r`'s output (taken from it, or allocated); `r.input` stays.
    pub(crate) fn all_gather(&mut self, r: &mut AllGather) -> Result<HostBuffer> {
        let (dtype, count, n) = (r.input.dtype(), r.input.len(), self.world);
        let mut out = r.output.take().unwrap_or_else(|| HostBuffer::for_overwrite(dtype, count * n));
        let hdr = self.header(OpKind::AllGather, dtype, count, 0, None);
        let moved = (out.byte_len() + r.input.byte_len()).saturating_mul(n);
        if r.input.byte_len() >= self.params.zc_min && self.zc_gather(&r.input, moved, Some(&mut out), &hdr)? {
            return Ok(out);
        }
        self.concat(&hdr, &r.input, Some(out.as_bytes_mut()), Choice::Timed)?;
        Ok(out)
    }

    /// Every rank's input (ours: `src`) into `dst` in rank order, a window's piece per step;
    /// ours is written to the window unless `choice` is `Plain`. A rank without `dst` only writes.
    fn concat(&mut self, hdr: &StepHeader, src: &HostBuffer, mut dst: Option<&mut [u8]>, choice: Choice) -> Result<()> {
        let (es, count, me) = (src.dtype().size(), src.len(), self.rank);
        for (off, len) in pieces(count, self.lay.window / es) {
            let piece = &src.as_bytes()[off * es..(off + len) * es];
            self.step(hdr, piece.len(), choice, |io, stream| match io {
                Io::Write(w) if !matches!(choice, Choice::Plain) => to_window(stream, &mut w[..piece.len()], piece),
                Io::Write(_) => {}
                Io::Read(views, _) => {
                    if let Some(dst) = dst.as_deref_mut() {
                        concat(views, me, piece, dst, count * es, off * es);
                    }
                }
            })?;
        }
        Ok(())
    }

    /// Fills `r`'s output (taken from it, or allocated); `r.input` stays.
    pub(crate) fn reduce_scatter(&mut self, r: &mut ReduceScatter) -> Result<HostBuffer> {
        let (dtype, es, n, me, op) = (r.input.dtype(), r.input.dtype().size(), self.world, self.rank, r.op);
        let block = r.input.len() / n;
        let mut out = r.output.take().unwrap_or_else(|| HostBuffer::for_overwrite(dtype, block));
        let hdr = self.header(OpKind::ReduceScatter, dtype, r.input.len(), 0, Some(op));
        if r.input.byte_len() >= self.params.zc_min && self.zc_reduce_scatter(r, &mut out, &hdr)? {
            return Ok(out);
        }
        let input = r.input.as_bytes();
        let dst = out.as_bytes_mut();
        for (off, len) in pieces(block, self.lay.window / es / n) {
            let b = len * es;
            self.step(&hdr, n * b, Choice::Timed, |io, stream| match io {
                // Our own block is read straight from the input (below): it is not copied in.
                Io::Write(w) => {
                    for j in (0..n).filter(|&j| j != me) {
                        let at = (j * block + off) * es;
                        to_window(stream, &mut w[j * b..(j + 1) * b], &input[at..at + b]);
                    }
                }
                Io::Read(views, _) => {
                    let at = (me * block + off) * es;
                    let ins: Vec<&[u8]> = (views.iter().enumerate())
                        .map(|(p, v)| if p == me { &input[at..at + b] } else { &v[me * b..(me + 1) * b] })
                        .collect();
                    kernels::reduce(dtype, op, &ins, &mut dst[off * es..off * es + b]);
                }
            })?;
        }
        Ok(out)
    }

    /// Fills `r`'s output (taken from it, or allocated); `r.input` stays.
    pub(crate) fn all_to_all(&mut self, r: &mut AllToAll) -> Result<HostBuffer> {
        let (dtype, es, n, me) = (r.input.dtype(), r.input.dtype().size(), self.world, self.rank);
        let (ins, outs) = r.splits(n as u32);
        let out_len: usize = outs.iter().sum();
        let mut out = r.output.take().unwrap_or_else(|| HostBuffer::for_overwrite(dtype, out_len));
        // Equal blocks need no agreement beyond the length, which the header checks. Uneven
        // ones start with a step where everyone publishes its send splits, so each rank checks
        // that what it expects from every peer is what that peer sends, and all agree on the
        // rounds. (Every rank must use the same form.)
        let equal = r.input_splits.is_none() && r.output_splits.is_none();
        let hdr = StepHeader {
            aux: u64::from(!equal),
            ..self.header(OpKind::AllToAll, dtype, if equal { r.input.len() } else { 0 }, 0, None)
        };
        if n == 1 && ins[0] == outs[0] {
            out.as_bytes_mut().copy_from_slice(r.input.as_bytes());
            return Ok(out);
        }
        let mut matrix = vec![(r.input.len() / n) as u64; n * n];
        if !equal {
            let mine: Vec<u64> = ins.iter().map(|&x| x as u64).collect();
            self.step(&hdr, n * 8, Choice::Plain, |io, _| match io {
                Io::Write(w) => w[..n * 8].copy_from_slice(bytemuck::cast_slice(&mine)),
                Io::Read(views, _) => {
                    for (p, v) in views.iter().enumerate() {
                        let row: &[u64] = if p == me { &mine } else { bytemuck::cast_slice(&v[..n * 8]) };
                        matrix[p * n..(p + 1) * n].copy_from_slice(row);
                    }
                }
            })?;
            for (p, &expect) in outs.iter().enumerate() {
                let sends = matrix[p * n + me] as usize;
                if sends != expect {
                    return Err(CommError::mismatch("all_to_all", format!(
                            "rank {p} sends {sends} elements to rank {me}, but rank {me}'s output_splits expect {expect}"
                        )));
                }
            }
        }
        // The inputs' average: every rank decides alike (they all have the matrix).
        let average = matrix.iter().fold(0u64, |a, &x| a.saturating_add(x)) / n as u64;
        if average.saturating_mul(es as u64) >= self.params.zc_min as u64
            && self.zc_all_to_all(&r.input, &matrix, &mut out, &hdr)?
        {
            return Ok(out);
        }
        let input = r.input.as_bytes();
        let dst = out.as_bytes_mut();
        let in_off: Vec<usize> = ins.iter().scan(0, |a, &x| Some(std::mem::replace(a, *a + x))).collect();
        let out_off: Vec<usize> = outs.iter().scan(0, |a, &x| Some(std::mem::replace(a, *a + x))).collect();
        // The block a rank keeps goes straight from its input to its output (one copy instead
        // of two through its own window), so the window holds n - 1 slots: rank p's block
        // for rank j sits in slot `j` of p's window, or `j - 1` past p.
        let per = (self.lay.window / (n - 1).max(1) / es).max(1);
        let rounds = (matrix.iter().copied().max().unwrap_or(0) as usize).div_ceil(per);
        let slot = per * es;
        let slot_of = |p: usize, j: usize| (j - usize::from(j > p)) * slot;
        for t in 0..rounds {
            let lo = t * per;
            self.step(&hdr, (n - 1) * slot, Choice::Timed, |io, stream| match io {
                Io::Write(w) => {
                    for j in (0..n).filter(|&j| j != me) {
                        let (a, b) = (lo.min(ins[j]), (lo + per).min(ins[j]));
                        let src = &input[(in_off[j] + a) * es..(in_off[j] + b) * es];
                        to_window(stream, &mut w[slot_of(me, j)..slot_of(me, j) + src.len()], src);
                    }
                }
                Io::Read(views, _) => {
                    for (p, v) in views.iter().enumerate() {
                        let (a, b) = (lo.min(outs[p]), (lo + per).min(outs[p]));
                        let bytes = (b - a) * es;
                        let at = (out_off[p] + a) * es;
                        let src = if p == me {
                            // ins[me] == outs[me]: equal splits, or checked against the matrix.
                            &input[(in_off[me] + a) * es..(in_off[me] + a) * es + bytes]
                        } else {
                            &v[slot_of(p, me)..slot_of(p, me) + bytes]
                        };
                        dst[at..at + bytes].copy_from_slice(src);
                    }
                }
            })?;
        }
        Ok(out)
    }

    pub(crate) fn scatter(&mut self, r: Scatter) -> Result<InOut> {
        let Scatter { output: mut out, input, root } = r;
        let (dtype, block, n, me, root) = (out.dtype(), out.len(), self.world, self.rank, root as usize);
        let es = dtype.size();
        let hdr = self.header(OpKind::Scatter, dtype, block, root as Rank, None);
        let mine = input.as_ref().filter(|_| me == root);
        if out.byte_len() >= self.params.zc_min && self.zc_from_root(&hdr, root, mine, &mut out, true)? {
            return Ok(InOut { input: input.unwrap_or_else(|| HostBuffer::zeroed(dtype, 0)), output: out });
        }
        let src = mine.map(HostBuffer::as_bytes);
        let dst = out.as_bytes_mut();
        for (off, len) in pieces(block, self.lay.window / es / n) {
            let b = len * es;
            let choice = if src.is_some() { Choice::Writes } else { Choice::Plain };
            self.step(&hdr, n * b, choice, |io, stream| match io {
                Io::Write(w) => {
                    if let Some(s) = src {
                        for j in (0..n).filter(|&j| j != root) {
                            let at = (j * block + off) * es;
                            to_window(stream, &mut w[j * b..(j + 1) * b], &s[at..at + b]);
                        }
                    }
                }
                Io::Read(views, _) => {
                    let theirs = match src {
                        Some(s) => &s[(me * block + off) * es..][..b],
                        None => &views[root][me * b..(me + 1) * b],
                    };
                    dst[off * es..off * es + b].copy_from_slice(theirs);
                }
            })?;
        }
        Ok(InOut { input: input.unwrap_or_else(|| HostBuffer::zeroed(dtype, 0)), output: out })
    }

    /// The root's output is the concatenation; elsewhere the output passed (or an empty one)
    /// comes back as it is.
    pub(crate) fn gather(&mut self, r: Gather) -> Result<InOut> {
        let Gather { input, output, root } = r;
        let (dtype, count, n, root) = (input.dtype(), input.len(), self.world, root as usize);
        let hdr = self.header(OpKind::Gather, dtype, count, root as Rank, None);
        let is_root = self.rank == root;
        let (mut out, spare) = match is_root {
            true => (Some(output.unwrap_or_else(|| HostBuffer::for_overwrite(dtype, count * n))), None),
            false => (None, output),
        };
        let done = |out: Option<HostBuffer>, input| {
            let output = out.or(spare).unwrap_or_else(|| HostBuffer::zeroed(dtype, 0));
            InOut { input, output }
        };
        // Only past one step: in one the other ranks' copies into their windows overlap the
        // root's reads, where in place the root alone copies while the others wait for it
        // (512 KiB-2 MiB at 2 ranks: 1.2-1.8x the time of one step).
        let zc_min = self.params.zc_min.max(self.lay.window.saturating_add(1));
        let moved = input.byte_len().saturating_mul(2 * n);
        if input.byte_len() >= zc_min && self.zc_gather(&input, moved, out.as_mut(), &hdr)? {
            return Ok(done(out, input));
        }
        // The root takes its own piece from its input.
        let choice = if is_root { Choice::Plain } else { Choice::Writes };
        self.concat(&hdr, &input, out.as_mut().map(HostBuffer::as_bytes_mut), choice)?;
        Ok(done(out, input))
    }
}
