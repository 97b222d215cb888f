//! One-step collectives: the form small ops take, run inline by the caller or by the worker.

use comm_core::lane::CallerWait;
use comm_core::{config, Completer, DType, HostBuffer, InOut, OpKind, Rank, ReduceOp};
use comm_kernels as kernels;

use crate::layout::{StepHeader, CARRIED};

use super::stores::to_window;
use super::{Done, Engine, Io, Phase, Queued, Result, AUX_ARRIVE};

/// A collective that takes exactly one step (its data fits the window). These are the
/// latency-bound ops, which the caller's thread runs inline when the group is idle.
pub enum OneShot {
    /// all_reduce (`root: None`) or reduce, by every rank reducing all inputs.
    AllReduce {
        buf: HostBuffer,
        op: ReduceOp,
        root: Option<Rank>,
    },
    Broadcast {
        buf: HostBuffer,
        root: Rank,
    },
    AllGather {
        input: HostBuffer,
        out: HostBuffer,
    },
    ReduceScatter {
        input: HostBuffer,
        out: HostBuffer,
        op: ReduceOp,
    },
    /// Equal splits only (uneven ones need a step to agree on the splits).
    AllToAll {
        input: HostBuffer,
        out: HostBuffer,
        /// Ranks (blocks).
        n: usize,
    },
    /// The root's blocks for its peers go through its window, packed as all_to_all's; its own
    /// goes straight to its output. `input` only on the root.
    Scatter {
        input: Option<HostBuffer>,
        out: HostBuffer,
        root: Rank,
        /// Ranks (blocks).
        n: usize,
    },
    /// Every rank but the root writes its block; the root reads them. `out`: the root's
    /// result (made in the read when none was passed), or what a non-root passed (handed
    /// back as it is).
    Gather {
        input: HostBuffer,
        out: Option<HostBuffer>,
        root: Rank,
    },
    Barrier,
    /// The step that opens every queued collective (one of several steps, or one without a
    /// one-step form): header only. A caller can run it inline and park it like any one-step
    /// op, and once it completed every peer has begun the op too, so the caller may run the
    /// rest without waiting long (see `ShmBackend::submit`). `kind`, `dtype` and `count` are
    /// the op's (`count` 0 for all_to_all, whose ranks may hand in different sizes); its root
    /// and splits are checked by its own steps.
    Arrive {
        kind: OpKind,
        dtype: DType,
        count: usize,
    },
}

impl OneShot {
    /// What its step header says: kind, dtype, count, root, reduce op (as the queued forms of
    /// the ops say it, so both forms check against each other; all_to_all's aux 0: equal splits).
    fn signature(&self) -> (OpKind, DType, usize, Rank, Option<ReduceOp>) {
        match self {
            OneShot::AllReduce { buf, op, root: None } => (OpKind::AllReduce, buf.dtype(), buf.len(), 0, Some(*op)),
            OneShot::AllReduce { buf, op, root: Some(r) } => (OpKind::Reduce, buf.dtype(), buf.len(), *r, Some(*op)),
            OneShot::Broadcast { buf, root } => (OpKind::Broadcast, buf.dtype(), buf.len(), *root, None),
            OneShot::AllGather { input, .. } => (OpKind::AllGather, input.dtype(), input.len(), 0, None),
            OneShot::ReduceScatter { input, op, .. } => {
                (OpKind::ReduceScatter, input.dtype(), input.len(), 0, Some(*op))
            }
            OneShot::AllToAll { input, .. } => (OpKind::AllToAll, input.dtype(), input.len(), 0, None),
            OneShot::Scatter { out, root, .. } => (OpKind::Scatter, out.dtype(), out.len(), *root, None),
            OneShot::Gather { input, root, .. } => (OpKind::Gather, input.dtype(), input.len(), *root, None),
            OneShot::Barrier => (OpKind::Barrier, DType::U8, 0, 0, None),
            OneShot::Arrive { kind, dtype, count } => (*kind, *dtype, *count, 0, None),
        }
    }

    pub(super) fn name(&self) -> &'static str {
        self.signature().0.name()
    }

    /// Whether rank `me` writes into its window (a broadcast's non-roots and a barrier do
    /// not).
    fn writes(&self, me: usize) -> bool {
        match self {
            OneShot::Broadcast { root, .. } | OneShot::Scatter { root, .. } => *root as usize == me,
            OneShot::Gather { root, .. } => *root as usize != me,
            OneShot::Barrier | OneShot::Arrive { .. } => false,
            _ => true,
        }
    }

    /// Bytes the op writes into its window.
    fn footprint(&self) -> usize {
        match self {
            OneShot::AllReduce { buf, .. } | OneShot::Broadcast { buf, .. } => buf.byte_len(),
            OneShot::AllGather { input, .. } | OneShot::ReduceScatter { input, .. } => input.byte_len(),
            OneShot::AllToAll { input, n, .. } => input.byte_len() / n * (n - 1),
            // What the root writes; every rank places and reads the step by it.
            OneShot::Scatter { out, n, .. } => out.byte_len() * (n - 1),
            OneShot::Gather { input, .. } => input.byte_len(),
            OneShot::Barrier | OneShot::Arrive { .. } => 0,
        }
    }

    /// Whether the op's data travels in the step header (see [`StepHeader::data`]).
    fn carried(&self) -> bool {
        self.footprint() <= CARRIED
    }

    /// The op's part of a phase; `stream`: whether its copies into our window stream.
    pub(super) fn io(&mut self, me: usize, io: Io<'_>, stream: bool) {
        let writes = self.writes(me);
        match (self, io) {
            (
                OneShot::AllReduce { buf, .. }
                | OneShot::Broadcast { buf, .. }
                | OneShot::AllGather { input: buf, .. }
                | OneShot::Gather { input: buf, .. },
                Io::Write(w),
            ) if writes => to_window(stream, &mut w[..buf.byte_len()], buf.as_bytes()),
            (OneShot::AllReduce { buf, op, root }, Io::Read(views, _)) if root.is_none_or(|r| r as usize == me) => {
                // Our own input is the buffer itself (see `reduce_leading`).
                kernels::reduce_leading(buf.dtype(), *op, views, Some(me), buf.as_bytes_mut());
            }
            (OneShot::Broadcast { buf, root }, Io::Read(views, _)) if *root as usize != me => {
                let n = buf.byte_len();
                buf.as_bytes_mut().copy_from_slice(&views[*root as usize][..n]);
            }
            (OneShot::AllGather { input, out }, Io::Read(views, _)) => {
                concat(views, me, input.as_bytes(), out.as_bytes_mut(), input.byte_len(), 0)
            }
            // The input but our own block: block j (for rank j) at offset j * b, as in one
            // round of `Engine::reduce_scatter`.
            (OneShot::ReduceScatter { input, out, .. }, Io::Write(w)) => {
                let own = me * out.byte_len()..(me + 1) * out.byte_len();
                to_window(stream, &mut w[..own.start], &input.as_bytes()[..own.start]);
                to_window(stream, &mut w[own.end..input.byte_len()], &input.as_bytes()[own.end..]);
            }
            (OneShot::ReduceScatter { input, out, op }, Io::Read(views, _)) => {
                let b = out.byte_len();
                let ins: Vec<&[u8]> = (views.iter().enumerate())
                    .map(|(p, v)| &(if p == me { input.as_bytes() } else { v })[me * b..(me + 1) * b])
                    .collect();
                kernels::reduce(out.dtype(), *op, &ins, out.as_bytes_mut());
            }
            // Only the peers' blocks go through the window, packed: rank p's block for rank j
            // at slot j, or j - 1 past p. Our own block goes straight to the output.
            (OneShot::AllToAll { input, n, .. }, Io::Write(w)) => {
                let b = input.byte_len() / *n;
                for j in (0..*n).filter(|&j| j != me) {
                    let at = (j - usize::from(j > me)) * b;
                    to_window(stream, &mut w[at..at + b], &input.as_bytes()[j * b..(j + 1) * b]);
                }
            }
            (OneShot::AllToAll { input, out, n }, Io::Read(views, _)) => {
                let b = input.byte_len() / *n;
                for (p, v) in views.iter().enumerate() {
                    let src = if p == me {
                        &input.as_bytes()[me * b..(me + 1) * b]
                    } else {
                        let at = (me - usize::from(me > p)) * b;
                        &v[at..at + b]
                    };
                    out.as_bytes_mut()[p * b..(p + 1) * b].copy_from_slice(src);
                }
            }
            // The root's block for rank j at slot j, or j - 1 past the root; its own block goes
            // to its output here (it reads nothing, see `reads`).
            (OneShot::Scatter { input: Some(input), out, root, n }, Io::Write(w)) if *root as usize == me => {
                let b = out.byte_len();
                for j in (0..*n).filter(|&j| j != me) {
                    let at = (j - usize::from(j > me)) * b;
                    to_window(stream, &mut w[at..at + b], &input.as_bytes()[j * b..(j + 1) * b]);
                }
                out.as_bytes_mut().copy_from_slice(&input.as_bytes()[me * b..(me + 1) * b]);
            }
            (OneShot::Scatter { out, root, .. }, Io::Read(views, _)) if *root as usize != me => {
                let (b, root) = (out.byte_len(), *root as usize);
                let at = (me - usize::from(me > root)) * b;
                out.as_bytes_mut().copy_from_slice(&views[root][at..at + b]);
            }
            (OneShot::Gather { input, out, root }, Io::Read(views, _)) if *root as usize == me => {
                let n = input.len() * views.len();
                let out = out.get_or_insert_with(|| HostBuffer::for_overwrite(input.dtype(), n));
                concat(views, me, input.as_bytes(), out.as_bytes_mut(), input.byte_len(), 0)
            }
            _ => {}
        }
    }

    /// The result in a world of one rank, where no step is needed.
    pub(super) fn alone(mut self) -> OneShot {
        match &mut self {
            OneShot::AllGather { input, out }
            | OneShot::ReduceScatter { input, out, .. }
            | OneShot::AllToAll { input, out, .. }
            | OneShot::Scatter { input: Some(input), out, .. } => out.as_bytes_mut().copy_from_slice(input.as_bytes()),
            OneShot::Gather { input, out, .. } => out
                .get_or_insert_with(|| HostBuffer::zeroed(input.dtype(), input.len()))
                .as_bytes_mut()
                .copy_from_slice(input.as_bytes()),
            _ => {}
        }
        self
    }
}

/// What an inline attempt came to.
pub(crate) enum Inline {
    /// Finished on the caller's thread.
    Done(Result<OneShot>),
    /// Published but peers are late: the worker finishes it; attach the completer with
    /// [`Engine::attach`].
    Parked,
    /// The group was not ready for it (a previous step still open): submit it normally.
    NotNow(OneShot),
}

pub(super) struct Parked {
    op: OneShot,
    k: u64,
    hdr: StepHeader,
    pub(super) then: Option<Then>,
}

/// What follows a parked op once the worker finished it.
pub(crate) enum Then {
    /// Complete the caller's `Work`.
    Done(Done),
    /// Run the queued collective the parked [`OneShot::Arrive`] opened.
    Run(Box<dyn Queued>),
}

impl Engine {
    /// Runs `op` on the caller's thread: publishes it and waits for the peers as `wait` says.
    /// Call only when [`is_idle`](Self::is_idle).
    pub(crate) fn try_inline(&mut self, mut op: OneShot, wait: CallerWait) -> Inline {
        if let Some(e) = self.poison_error() {
            return Inline::Done(Err(e));
        }
        config::injected_panic(self.params.panic_at, op.name(), self.rank);
        if self.world == 1 {
            return Inline::Done(Ok(op.alone()));
        }
        let k = self.step + 1;
        if self.all_at < k - 1 && !self.reached(k - 1) {
            return Inline::NotNow(op);
        }
        self.seq += 1;
        self.op = op.name();
        let hdr = self.oneshot_header(&mut op);
        self.write_header(k, &hdr);
        self.phase = Phase::Writable(k);
        self.write_phase(&mut op, k, &hdr);
        if let Err(e) = self.announce(k) {
            return Inline::Done(Err(e));
        }
        // Even a rank that reads nothing (a broadcast's root...) waits for its peers: if every
        // rank took itself for the root, only the header check would tell.
        if !self.poll(wait, |e| e.headers_reached(k)) {
            self.parked = Some(Parked { op, k, hdr, then: None });
            return Inline::Parked;
        }
        self.all_at = k;
        Inline::Done(self.read_step(&mut op, k, &hdr).map(|()| op))
    }

    /// Polls `ready` on the caller's thread as `wait` says; whether it became true.
    fn poll(&self, wait: CallerWait, ready: impl Fn(&Engine) -> bool) -> bool {
        wait.wait(|_| ready(self).then_some(())).is_some()
    }

    /// Gives the parked op (after [`Inline::Parked`]) what follows it.
    pub(crate) fn attach(&mut self, then: Then) {
        if let Some(p) = &mut self.parked {
            p.then = Some(then);
        }
    }

    pub(super) fn resume(&mut self, mut p: Parked) {
        self.op = p.op.name();
        // As for ops run by the worker (`run_op`): a lost peer or a timeout poisons.
        let r =
            self.wait_all(p.k).and_then(|()| self.read_step(&mut p.op, p.k, &p.hdr)).inspect_err(|e| self.failed(e));
        match (p.then, r) {
            (Some(Then::Done(done)), r) => self.finished = Some((done, r.map(|()| p.op))),
            (Some(Then::Run(op)), Ok(())) => op.run(self, true),
            (Some(Then::Run(op)), Err(e)) => op.fail(e),
            (None, _) => {}
        }
    }

    /// Checks the headers of published step `k` and runs the op's read phase.
    pub(super) fn read_step(&mut self, op: &mut OneShot, k: u64, hdr: &StepHeader) -> Result<()> {
        self.check_headers(k, hdr).inspect_err(|e| self.failed(e))?;
        self.read_phase(op, k);
        Ok(())
    }

    /// The op's write into writable step `k`, unless its header carries the data. Large copies
    /// may stream (see `stores`): an all_reduce's is timed until its read ends, the others'
    /// by the copy alone.
    fn write_phase(&mut self, op: &mut OneShot, k: u64, hdr: &StepHeader) {
        self.oneshot_timed = None;
        if op.carried() {
            return;
        }
        let (me, bytes) = (self.rank, op.footprint());
        match op {
            OneShot::AllReduce { buf, root: None, .. } => {
                let (stream, start) = self.oneshot_stores.start(bytes);
                let w = self.window_mut(k, bytes);
                to_window(stream, &mut w[..bytes], buf.as_bytes());
                self.oneshot_timed = start.map(|t| (stream, t));
            }
            // The others' readers cannot be timed (some ranks only write): their copies alone
            // are (see `stores`), for the ranks that write.
            _ => {
                let kind = usize::from(hdr.op);
                let (stream, start) = match self.write_stores.get_mut(kind) {
                    Some(s) if op.writes(me) => s.start(bytes),
                    _ => (false, None),
                };
                op.io(me, Io::Write(self.window_mut(k, bytes)), stream);
                if let Some(s) = self.write_stores.get_mut(kind) {
                    s.finish(bytes, stream, start);
                }
            }
        }
    }

    /// The op's read of readable step `k`, which ends the step.
    fn read_phase(&mut self, op: &mut OneShot, k: u64) {
        let me = self.rank;
        if op.carried() {
            op.io(me, Io::Read(&self.carried_views(k), &mut []), false);
        } else {
            let (views, next) = self.views(k, op.footprint());
            op.io(me, Io::Read(&views, next), false);
        }
        if let Some((stream, start)) = self.oneshot_timed.take() {
            self.oneshot_stores.finish(op.footprint(), stream, Some(start));
        }
        self.phase = Phase::Idle;
    }

    /// The op's step header, with its data when the header carries it.
    fn oneshot_header(&self, op: &mut OneShot) -> StepHeader {
        let (kind, dtype, count, root, redop) = op.signature();
        let aux = if matches!(op, OneShot::Arrive { .. }) { AUX_ARRIVE } else { 0 };
        let mut hdr = StepHeader { aux, ..self.header(kind, dtype, count, root, redop) };
        if op.carried() {
            op.io(self.rank, Io::Write(&mut hdr.data), false);
        }
        hdr
    }

    /// A one-step op on the worker (or one that could not run inline).
    pub(crate) fn oneshot(&mut self, mut op: OneShot) -> Result<OneShot> {
        if self.world == 1 {
            return Ok(op.alone());
        }
        let hdr = self.oneshot_header(&mut op);
        let k = self.begin(&hdr)?;
        self.write_phase(&mut op, k, &hdr);
        self.publish(k, &hdr)?;
        self.read_phase(&mut op, k);
        Ok(op)
    }
}

/// Every rank's piece of `own`'s size into `dst` in rank order, rank p's at `p × stride + at`:
/// ours from `own`, the others' from their windows.
pub(super) fn concat(views: &[&[u8]], me: usize, own: &[u8], dst: &mut [u8], stride: usize, at: usize) {
    for (p, v) in views.iter().enumerate() {
        let to = p * stride + at;
        dst[to..to + own.len()].copy_from_slice(if p == me { own } else { &v[..own.len()] });
    }
}

/// What a one-step op hands back: its buffer, or nothing (barrier).
pub trait OneShotOutput: Sized {
    fn from_one_shot(op: OneShot) -> Self;
    fn done(c: Completer<Self>) -> Done;
}

impl OneShotOutput for HostBuffer {
    /// The result buffer (the barrier's is empty).
    fn from_one_shot(op: OneShot) -> Self {
        match op {
            OneShot::AllReduce { buf, .. } | OneShot::Broadcast { buf, .. } => buf,
            other => InOut::from_one_shot(other).output,
        }
    }
    fn done(c: Completer<Self>) -> Done {
        Done::Buf(c)
    }
}

impl OneShotOutput for InOut {
    /// Input and output of an op that reads one buffer and fills another.
    fn from_one_shot(op: OneShot) -> Self {
        let empty = |d: DType| HostBuffer::zeroed(d, 0);
        match op {
            OneShot::AllGather { input, out }
            | OneShot::ReduceScatter { input, out, .. }
            | OneShot::AllToAll { input, out, .. } => InOut { input, output: out },
            OneShot::AllReduce { buf, .. } | OneShot::Broadcast { buf, .. } => {
                InOut { output: empty(buf.dtype()), input: buf }
            }
            OneShot::Scatter { input, out, .. } => {
                InOut { input: input.unwrap_or_else(|| empty(out.dtype())), output: out }
            }
            OneShot::Gather { input, out, .. } => InOut { output: out.unwrap_or_else(|| empty(input.dtype())), input },
            OneShot::Barrier | OneShot::Arrive { .. } => InOut { input: empty(DType::U8), output: empty(DType::U8) },
        }
    }
    fn done(c: Completer<Self>) -> Done {
        Done::Io(c)
    }
}

impl OneShotOutput for () {
    fn from_one_shot(_: OneShot) {}
    fn done(c: Completer<Self>) -> Done {
        Done::Unit(c)
    }
}
