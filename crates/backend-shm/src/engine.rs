//! The worker: one thread per group that owns the mapped segments and runs every op.
//!
//! Collectives run one at a time in submission order as a sequence of *steps*. In step `k`
//! every rank (1) waits until all peers have published step `k-1` — so nobody still reads the
//! buffer `k % 2` it is about to overwrite —, (2) writes its step header and its data into its
//! own buffer `k % 2`, (3) publishes `k` with a release store of its step counter, (4) waits
//! until all peers published `k` (acquire) and checks their headers against its own, (5) reads
//! any peer's buffer `k % 2`. It publishes `k + 1` only after those reads, which is what makes
//! (1) sufficient. Point-to-point messages use per-pair mailboxes with sent/acked counters
//! and progress independently of collectives, so an isend never blocks a collective.

use std::collections::VecDeque;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::{Acquire, Release, SeqCst};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use comm_core::ops::{
    AllGather, AllReduce, AllToAll, Broadcast, Gather, RecvFrom, Reduce, ReduceScatter, Scatter, SendTo,
};
use comm_core::{CommError, Completer, DType, HostBuffer, Rank, ReduceOp};

use crate::layout::*;
use crate::segment::Segment;
use crate::sys::{futex_wait, futex_wake, ProcId};
use crate::zerocopy::ShmBuf;
use comm_kernels::{self as kernels, Src};

/// What the handle sends to the worker.
pub(crate) enum Command {
    AllReduce(AllReduce, Completer<HostBuffer>),
    Broadcast(Broadcast, Completer<HostBuffer>),
    Reduce(Reduce, Completer<HostBuffer>),
    AllGather(AllGather, Completer<HostBuffer>),
    ReduceScatter(ReduceScatter, Completer<HostBuffer>),
    AllToAll(AllToAll, Completer<HostBuffer>),
    Scatter(Scatter, Completer<HostBuffer>),
    Gather(Gather, Completer<HostBuffer>),
    Send(SendTo, Completer<HostBuffer>),
    Recv(RecvFrom, Completer<HostBuffer>),
    Shutdown(Completer<()>),
    /// A small collective the caller could not finish inline.
    OneShot(OneShot, Done),
}

/// The completer of a one-step op, by output type.
pub(crate) enum Done {
    Buf(Completer<HostBuffer>),
    Unit(Completer<()>),
}

impl Done {
    fn complete(self, r: Result<OneShot>) {
        match self {
            Done::Buf(c) => c.complete(r.map(OneShot::into_buffer)),
            Done::Unit(c) => c.complete(r.map(drop)),
        }
    }
}

/// A collective that takes exactly one step (its data fits the window). These are the
/// latency-bound ops, which the caller's thread runs inline when the group is idle.
pub(crate) enum OneShot {
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
    Barrier,
}

impl OneShot {
    /// The result buffer (the barrier's is empty).
    pub(crate) fn into_buffer(self) -> HostBuffer {
        match self {
            OneShot::AllReduce { buf, .. } | OneShot::Broadcast { buf, .. } => buf,
            OneShot::AllGather { out, .. } | OneShot::ReduceScatter { out, .. } | OneShot::AllToAll { out, .. } => out,
            OneShot::Barrier => HostBuffer::zeroed(DType::U8, 0),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            OneShot::AllReduce { root: None, .. } => "all_reduce",
            OneShot::AllReduce { .. } => "reduce",
            OneShot::Broadcast { .. } => "broadcast",
            OneShot::AllGather { .. } => "all_gather",
            OneShot::ReduceScatter { .. } => "reduce_scatter",
            OneShot::AllToAll { .. } => "all_to_all",
            OneShot::Barrier => "barrier",
        }
    }

    fn header(&self, e: &Engine) -> StepHeader {
        match self {
            OneShot::AllReduce { buf, op, root } => {
                let code = if root.is_some() { OP_REDUCE } else { OP_ALL_REDUCE };
                e.header(code, buf.dtype(), buf.len(), root.unwrap_or(0), Some(*op))
            }
            OneShot::Broadcast { buf, root } => e.header(OP_BROADCAST, buf.dtype(), buf.len(), *root, None),
            OneShot::AllGather { input, .. } => e.header(OP_ALL_GATHER, input.dtype(), input.len(), 0, None),
            OneShot::ReduceScatter { input, op, .. } => {
                e.header(OP_REDUCE_SCATTER, input.dtype(), input.len(), 0, Some(*op))
            }
            // aux 0: equal splits, as in `Engine::all_to_all`.
            OneShot::AllToAll { input, .. } => e.header(OP_ALL_TO_ALL, input.dtype(), input.len(), 0, None),
            OneShot::Barrier => e.header(OP_BARRIER, DType::U8, 0, 0, None),
        }
    }

    fn io(&mut self, me: usize, io: Io<'_>) {
        match (self, io) {
            (OneShot::AllReduce { buf, .. }, Io::Write(w)) => w[..buf.byte_len()].copy_from_slice(buf.as_bytes()),
            (OneShot::AllReduce { buf, op, root }, Io::Read(views, _)) if root.is_none_or(|r| r as usize == me) => {
                reduce_views(buf.dtype(), *op, views, buf.as_bytes_mut());
            }
            (OneShot::Broadcast { buf, root }, Io::Write(w)) if *root as usize == me => {
                w[..buf.byte_len()].copy_from_slice(buf.as_bytes())
            }
            (OneShot::Broadcast { buf, root }, Io::Read(views, _)) if *root as usize != me => {
                let n = buf.byte_len();
                buf.as_bytes_mut().copy_from_slice(&views[*root as usize][..n]);
            }
            (OneShot::AllGather { input, .. }, Io::Write(w)) => w[..input.byte_len()].copy_from_slice(input.as_bytes()),
            (OneShot::AllGather { input, out }, Io::Read(views, _)) => {
                let b = input.byte_len();
                for (p, v) in views.iter().enumerate() {
                    out.as_bytes_mut()[p * b..(p + 1) * b].copy_from_slice(&v[..b]);
                }
            }
            // The whole input: block j (for rank j) at offset j * b, as in one round of
            // `Engine::reduce_scatter`.
            (OneShot::ReduceScatter { input, .. }, Io::Write(w)) => {
                w[..input.byte_len()].copy_from_slice(input.as_bytes())
            }
            (OneShot::ReduceScatter { out, op, .. }, Io::Read(views, _)) => {
                let b = out.byte_len();
                let ins: Vec<&[u8]> = views.iter().map(|v| &v[me * b..(me + 1) * b]).collect();
                kernels::reduce(out.dtype(), *op, &ins, out.as_bytes_mut());
            }
            // Only the peers' blocks go through the window, packed: rank p's block for rank j
            // at slot j, or j - 1 past p. Our own block goes straight to the output.
            (OneShot::AllToAll { input, n, .. }, Io::Write(w)) => {
                let b = input.byte_len() / *n;
                for j in (0..*n).filter(|&j| j != me) {
                    let at = (j - usize::from(j > me)) * b;
                    w[at..at + b].copy_from_slice(&input.as_bytes()[j * b..(j + 1) * b]);
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
            _ => {}
        }
    }

    /// The result in a world of one rank, where no step is needed.
    fn alone(self) -> OneShot {
        match self {
            OneShot::AllGather { input, mut out } => {
                out.as_bytes_mut().copy_from_slice(input.as_bytes());
                OneShot::AllGather { input, out }
            }
            OneShot::ReduceScatter { input, mut out, op } => {
                out.as_bytes_mut().copy_from_slice(input.as_bytes());
                OneShot::ReduceScatter { input, out, op }
            }
            OneShot::AllToAll { input, mut out, n } => {
                out.as_bytes_mut().copy_from_slice(input.as_bytes());
                OneShot::AllToAll { input, out, n }
            }
            other => other,
        }
    }
}

/// `out = views[0][..] ⊕ views[1][..] ⊕ ...` over `out.len()` bytes, in rank order.
fn reduce_views(dtype: DType, op: ReduceOp, views: &[&[u8]], out: &mut [u8]) {
    let ins: Vec<&[u8]> = views.iter().map(|v| &v[..out.len()]).collect();
    kernels::reduce(dtype, op, &ins, out);
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

struct Parked {
    op: OneShot,
    k: u64,
    hdr: StepHeader,
    done: Option<Done>,
}

/// What one turn of the worker did.
pub(crate) enum Flow {
    Busy,
    /// Waiting on peers: point-to-point ops in flight.
    Idle,
    /// Nothing in flight.
    Quiet,
    Exit,
}

const OP_ALL_REDUCE: u8 = 1;
const OP_BROADCAST: u8 = 2;
const OP_REDUCE: u8 = 3;
const OP_ALL_GATHER: u8 = 4;
const OP_REDUCE_SCATTER: u8 = 5;
const OP_ALL_TO_ALL: u8 = 6;
const OP_SCATTER: u8 = 7;
const OP_GATHER: u8 = 8;
const OP_BARRIER: u8 = 9;

/// `StepHeader::aux` of an all_reduce on zero-copy buffers.
const AUX_ZERO_COPY: u64 = 1;

fn op_name(code: u8) -> &'static str {
    match code {
        OP_ALL_REDUCE => "all_reduce",
        OP_BROADCAST => "broadcast",
        OP_REDUCE => "reduce",
        OP_ALL_GATHER => "all_gather",
        OP_REDUCE_SCATTER => "reduce_scatter",
        OP_ALL_TO_ALL => "all_to_all",
        OP_SCATTER => "scatter",
        OP_GATHER => "gather",
        OP_BARRIER => "barrier",
        _ => "unknown op",
    }
}

fn describe(h: &StepHeader) -> String {
    let dtype = DType::from_code(h.dtype).map(|d| d.name()).unwrap_or("?");
    let mut s = format!("{} #{} ({dtype} × {}", op_name(h.op), h.seq, h.count);
    if matches!(h.op, OP_BROADCAST | OP_REDUCE | OP_SCATTER | OP_GATHER) {
        s += &format!(", root {}", h.root);
    }
    if matches!(h.op, OP_ALL_REDUCE | OP_REDUCE | OP_REDUCE_SCATTER) {
        if let Some(op) = ReduceOp::ALL.get(h.redop as usize) {
            s += &format!(", {op}");
        }
    }
    if h.op == OP_ALL_REDUCE && h.aux == AUX_ZERO_COPY {
        s += ", zero-copy buffer from alloc_buffer (every rank must pass one, or none)";
    }
    s + ")"
}

/// Tunables, identical on every rank of a group (rank 0's are published through the store).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Params {
    pub(crate) timeout: Duration,
    /// Largest all_reduce/reduce (bytes) done in one step by every rank reducing all inputs;
    /// larger ones use reduce-scatter + all-gather (two steps, each rank reduces a slice).
    pub(crate) small_max: usize,
    /// How long a waiter spins before it sleeps on its futex (0 when ranks outnumber cores).
    pub(crate) spin: Duration,
    /// Test hook (`COMM_FAULT_INJECT=panic:<op>`): the worker panics when it runs this op.
    pub(crate) panic_at: Option<&'static str>,
}

/// Yields `(offset, len)` pieces of `total` elements, `per` at most; one empty piece when
/// `total` is 0 so that empty ops still meet (and are checked) like any other.
fn pieces(total: usize, per: usize) -> impl Iterator<Item = (usize, usize)> {
    let per = per.max(1);
    let n = total.div_ceil(per).max(1);
    (0..n).map(move |i| (i * per, per.min(total - (i * per).min(total))))
}

/// Splits `len` elements into `parts` contiguous slices, boundaries rounded to 16 elements so
/// slices start on cache lines. Returns the `(start, end)` of slice `i`.
fn slice_of(len: usize, parts: usize, i: usize) -> (usize, usize) {
    let per = len.div_ceil(parts).div_ceil(16) * 16;
    ((i * per).min(len), ((i + 1) * per).min(len))
}

/// The two phases of a step, as seen by an op's closure.
enum Io<'a> {
    /// Our buffer for this step, to fill.
    Write(&'a mut [u8]),
    /// Every rank's buffer for this step (index = rank), and our buffer for the next step.
    Read(&'a [&'a [u8]], &'a mut [u8]),
}

enum Phase {
    Idle,
    Writable(u64),
    Readable(u64),
}

struct SendOp {
    req: SendTo,
    done: Completer<HostBuffer>,
    offset: usize,
    started: Instant,
}

struct RecvOp {
    req: RecvFrom,
    done: Completer<HostBuffer>,
    offset: usize,
    started: Instant,
}

pub(crate) struct Engine {
    rank: usize,
    world: usize,
    lay: Layout,
    segs: Vec<Arc<Segment>>,
    procs: Vec<Option<ProcId>>,
    params: Params,
    rx: Receiver<Command>,
    /// Commands sent but not yet taken from `rx`: an inline op may only run when it is 0.
    pending: Arc<AtomicUsize>,
    parked: Option<Parked>,
    /// Set by the worker when the group is poisoned; the handle reads it to fail fast.
    poison: Arc<Mutex<Option<String>>>,
    poisoned: Option<String>,

    step: u64,
    seq: u64,
    phase: Phase,
    op: &'static str,
    colls: VecDeque<Command>,
    closing: bool,
    shutdown_waiters: Vec<Completer<()>>,

    sends: Vec<VecDeque<SendOp>>,
    recvs: Vec<VecDeque<RecvOp>>,
    sent: Vec<u64>,
    acked: Vec<u64>,
    last_liveness: Instant,
    /// Peers' zero-copy buffers mapped so far (most recent last; a few are kept).
    zc_maps: Vec<(String, Arc<Segment>)>,
    /// A finished one-step op whose caller the worker wakes after releasing the engine lock
    /// (see [`worker`]).
    finished: Option<(Done, Result<OneShot>)>,
    /// Panics contained so far (see [`Engine::contain_panic`]).
    panics: u32,
}

/// How long an inline caller keeps yielding for late peers after its spin, before it parks.
const INLINE_YIELD: Duration = Duration::from_micros(200);

/// How many peer zero-copy buffers stay mapped between ops.
const ZC_CACHE: usize = 16;

type Result<T, E = CommError> = std::result::Result<T, E>;

impl Engine {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        rank: usize,
        lay: Layout,
        segs: Vec<Arc<Segment>>,
        procs: Vec<Option<ProcId>>,
        params: Params,
        rx: Receiver<Command>,
        pending: Arc<AtomicUsize>,
        poison: Arc<Mutex<Option<String>>>,
    ) -> Engine {
        let world = lay.world;
        Engine {
            rank,
            world,
            lay,
            segs,
            procs,
            params,
            rx,
            pending,
            parked: None,
            poison,
            poisoned: None,
            step: 0,
            seq: 0,
            phase: Phase::Idle,
            op: "",
            colls: VecDeque::new(),
            closing: false,
            shutdown_waiters: Vec::new(),
            sends: (0..world).map(|_| VecDeque::new()).collect(),
            recvs: (0..world).map(|_| VecDeque::new()).collect(),
            sent: vec![0; world],
            acked: vec![0; world],
            last_liveness: Instant::now(),
            zc_maps: Vec::new(),
            finished: None,
            panics: 0,
        }
    }

    fn p2p_idle(&self) -> bool {
        self.sends.iter().all(VecDeque::is_empty) && self.recvs.iter().all(VecDeque::is_empty)
    }

    fn me(&self) -> &Segment {
        &self.segs[self.rank]
    }

    // ----------------------------------------------------------------------------------------
    // Main loop

    /// One turn of the worker: finishes a parked op, runs one queued collective, or
    /// progresses point-to-point. Never waits for a wake-up (the worker does that unlocked,
    /// so callers can run small ops inline meanwhile).
    pub(crate) fn work(&mut self) -> Flow {
        if let Some(p) = self.parked.take() {
            self.resume(p);
            return Flow::Busy;
        }
        if let Some(cmd) = self.colls.pop_front() {
            self.execute(cmd);
            return Flow::Busy;
        }
        match self.pump() {
            Ok(true) => return Flow::Busy,
            Ok(false) => {}
            Err(e) => {
                self.poison_with(&e);
                return Flow::Busy;
            }
        }
        if let Err(e) = self.check_p2p_deadlines() {
            self.poison_with(&e);
            return Flow::Busy;
        }
        if !self.p2p_idle() {
            Flow::Idle
        } else if self.closing {
            self.close();
            Flow::Exit
        } else {
            Flow::Quiet
        }
    }

    /// Whether an op submitted now could run inline: nothing queued, parked or in flight.
    pub(crate) fn is_idle(&self) -> bool {
        self.parked.is_none() && self.colls.is_empty() && self.pending.load(SeqCst) == 0 && !self.closing
    }

    fn close(&mut self) {
        if self.poisoned.is_none() {
            self.me().u32_at(OFF_STATE).store(STATE_CLOSED, SeqCst);
        }
        self.ring_all();
        for w in self.shutdown_waiters.drain(..) {
            w.complete(Ok(()));
        }
    }

    /// Runs `op` on the caller's thread: publishes it and waits up to `budget` for the
    /// peers. Call only when [`is_idle`](Self::is_idle).
    pub(crate) fn try_inline(&mut self, mut op: OneShot, budget: Duration) -> Inline {
        if let Some(e) = self.poison_error() {
            return Inline::Done(Err(e));
        }
        if self.params.panic_at == Some(op.name()) {
            panic!("COMM_FAULT_INJECT: injected panic in {} on rank {}", op.name(), self.rank);
        }
        if self.world == 1 {
            return Inline::Done(Ok(op.alone()));
        }
        let k = self.step + 1;
        if !self.reached(k - 1) {
            return Inline::NotNow(op);
        }
        self.seq += 1;
        self.op = op.name();
        let hdr = op.header(self);
        self.write_header(k, &hdr);
        self.phase = Phase::Writable(k);
        op.io(self.rank, Io::Write(self.window_mut(k)));
        self.announce(k);
        let t0 = Instant::now();
        while !self.headers_reached(k) {
            let waited = t0.elapsed();
            if waited >= budget + INLINE_YIELD {
                self.parked = Some(Parked { op, k, hdr, done: None });
                return Inline::Parked;
            }
            if waited < budget {
                // A true spin: the peer runs on another core and arrives within microseconds
                // (`budget` is zero when ranks outnumber cores).
                std::hint::spin_loop();
            } else {
                // Then give the core away while waiting a little longer: on a busy or small
                // machine the peer may need it, and parking costs two wake-ups (ours and our
                // caller's), which would make the ranks alternate between parking.
                std::thread::yield_now();
            }
        }
        Inline::Done(self.read_step(&mut op, k, &hdr).map(|()| op))
    }

    /// Gives the parked op (after [`Inline::Parked`]) its completer.
    pub(crate) fn attach(&mut self, done: Done) {
        if let Some(p) = &mut self.parked {
            p.done = Some(done);
        }
    }

    fn resume(&mut self, mut p: Parked) {
        self.op = p.op.name();
        let r = self.wait_all(p.k).and_then(|()| self.read_step(&mut p.op, p.k, &p.hdr));
        if let Err(e) = &r {
            // As for ops run by the worker (`run_op`): a lost peer or a timeout poisons.
            self.phase = Phase::Idle;
            if e.poisons_group() {
                self.poison_with(e);
            }
        }
        let r = r.map(|()| p.op);
        if let Some(done) = p.done {
            self.finished = Some((done, r));
        }
    }

    /// Checks the headers of published step `k` and runs the op's read phase.
    fn read_step(&mut self, op: &mut OneShot, k: u64, hdr: &StepHeader) -> Result<()> {
        if let Err(e) = self.check_headers(k, hdr) {
            self.phase = Phase::Idle;
            self.poison_with(&e);
            return Err(e);
        }
        let me = self.rank;
        let (views, next) = self.views(k);
        op.io(me, Io::Read(&views, next));
        self.phase = Phase::Idle;
        Ok(())
    }

    /// A one-step op on the worker (or one that could not run inline).
    fn oneshot(&mut self, mut op: OneShot) -> Result<OneShot> {
        if self.world == 1 {
            return Ok(op.alone());
        }
        let hdr = op.header(self);
        let me = self.rank;
        self.step(&hdr, |io| op.io(me, io))?;
        Ok(op)
    }

    /// Takes new commands and progresses point-to-point traffic. Returns whether anything
    /// happened.
    fn pump(&mut self) -> Result<bool> {
        let mut progressed = false;
        loop {
            match self.rx.try_recv() {
                Ok(cmd) => {
                    progressed = true;
                    self.pending.fetch_sub(1, SeqCst);
                    self.accept(cmd);
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    // Every handle is gone: finish what was submitted, then stop.
                    progressed |= !self.closing;
                    self.closing = true;
                    break;
                }
            }
        }
        if self.poisoned.is_none() {
            progressed |= self.progress_p2p()?;
        }
        Ok(progressed)
    }

    fn accept(&mut self, cmd: Command) {
        let now = Instant::now();
        match cmd {
            Command::Send(req, done) => {
                if let Some(e) = self.poison_error() {
                    return done.complete(Err(e));
                }
                let dst = req.dst as usize;
                self.sends[dst].push_back(SendOp { req, done, offset: 0, started: now });
            }
            Command::Recv(req, done) => {
                if let Some(e) = self.poison_error() {
                    return done.complete(Err(e));
                }
                let src = req.src as usize;
                self.recvs[src].push_back(RecvOp { req, done, offset: 0, started: now });
            }
            other => self.colls.push_back(other),
        }
    }

    /// One futex sleep on this rank's doorbell, unless `ready` or new work shows up first.
    fn sleep(&mut self, ready: impl Fn(&Engine) -> bool) -> Result<()> {
        let me = self.segs[self.rank].clone();
        let bell = me.u32_at(OFF_DOORBELL);
        let seen = bell.load(SeqCst);
        me.u32_at(OFF_SLEEPING).store(SLEEP_PEERS, SeqCst);
        // Re-check after announcing the sleep: a peer that published before seeing the flag
        // is visible now; one that publishes after will ring.
        let skip = ready(self) || self.pump()?;
        if !skip {
            futex_wait(bell, seen, Duration::from_millis(10));
        }
        me.u32_at(OFF_SLEEPING).store(0, SeqCst);
        Ok(())
    }

    fn ring(&self, peer: usize) {
        let seg = &self.segs[peer];
        if seg.u32_at(OFF_SLEEPING).load(SeqCst) == SLEEP_PEERS {
            seg.u32_at(OFF_DOORBELL).fetch_add(1, SeqCst);
            futex_wake(seg.u32_at(OFF_DOORBELL));
        }
    }

    fn ring_all(&self) {
        for p in (0..self.world).filter(|&p| p != self.rank) {
            let seg = &self.segs[p];
            seg.u32_at(OFF_DOORBELL).fetch_add(1, SeqCst);
            futex_wake(seg.u32_at(OFF_DOORBELL));
        }
    }

    // ----------------------------------------------------------------------------------------
    // Errors and liveness

    /// After a panic on the worker or an inline caller: the op that panicked is gone (its
    /// completer reported `Poisoned` while unwinding); poison the group with the panic's
    /// message so peers learn it at once, and fail everything else that is pending. Returns
    /// whether the engine may keep running (false after a second panic: then only
    /// [`drain_after_panic`](Self::drain_after_panic) runs).
    pub(crate) fn contain_panic(&mut self, message: &str) -> bool {
        self.panics += 1;
        let e = CommError::Backend {
            backend: "shm",
            source: format!("the worker of rank {} panicked: {message}", self.rank).into(),
        };
        self.phase = Phase::Idle;
        self.poison_with(&e);
        let poisoned = self.poison_error().unwrap_or(e);
        if let Some(Parked { done: Some(done), .. }) = self.parked.take() {
            done.complete(Err(poisoned));
        }
        if let Some((done, r)) = self.finished.take() {
            done.complete(r);
        }
        self.panics == 1
    }

    /// The worker's loop once the engine cannot be trusted: every command fails with
    /// `Poisoned`, a shutdown completes, and the loop ends with the channel or the shutdown.
    pub(crate) fn drain_after_panic(&mut self) -> Flow {
        let cause = self.poisoned.clone().unwrap_or_else(|| "the shm worker panicked".into());
        match self.rx.recv_timeout(Duration::from_millis(10)) {
            Ok(cmd) => {
                self.pending.fetch_sub(1, SeqCst);
                match cmd {
                    Command::Shutdown(d) => {
                        d.complete(Ok(()));
                        for w in self.shutdown_waiters.drain(..) {
                            w.complete(Ok(()));
                        }
                        Flow::Exit
                    }
                    other => {
                        self.fail(other, CommError::Poisoned { cause });
                        Flow::Busy
                    }
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Flow::Busy,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Flow::Exit,
        }
    }

    fn poison_error(&self) -> Option<CommError> {
        self.poisoned.as_ref().map(|cause| CommError::Poisoned { cause: cause.clone() })
    }

    /// Marks the group unusable: tells peers (state + reason in our segment), fails
    /// everything queued, and makes the handle fail new ops fast.
    fn poison_with(&mut self, e: &CommError) {
        if self.poisoned.is_some() {
            return;
        }
        let cause = e.to_string();
        let me = self.segs[self.rank].clone();
        let bytes = cause.as_bytes();
        let n = bytes.len().min(REASON_LEN - 1);
        for (i, b) in bytes[..n].iter().chain(std::iter::once(&0)).enumerate() {
            // SAFETY: the reason area is written only here, once, before the state store
            // below releases it; peers read it only after acquiring STATE_ABORTED.
            unsafe { me.write(OFF_REASON + i, *b) };
        }
        me.u32_at(OFF_STATE).store(STATE_ABORTED, SeqCst);
        self.ring_all();
        *self.poison.lock().unwrap_or_else(|p| p.into_inner()) = Some(cause.clone());
        self.poisoned = Some(cause);
        let cause = self.poisoned.clone().unwrap_or_default();
        let err = || CommError::Poisoned { cause: cause.clone() };
        for q in &mut self.sends {
            for op in q.drain(..) {
                op.done.complete(Err(err()));
            }
        }
        for q in &mut self.recvs {
            for op in q.drain(..) {
                op.done.complete(Err(err()));
            }
        }
        for cmd in std::mem::take(&mut self.colls) {
            self.fail(cmd, err());
        }
    }

    fn fail(&mut self, cmd: Command, e: CommError) {
        match cmd {
            Command::AllReduce(_, d)
            | Command::Broadcast(_, d)
            | Command::Reduce(_, d)
            | Command::AllGather(_, d)
            | Command::ReduceScatter(_, d)
            | Command::AllToAll(_, d)
            | Command::Scatter(_, d)
            | Command::Gather(_, d)
            | Command::Send(_, d)
            | Command::Recv(_, d) => d.complete(Err(e)),
            Command::OneShot(_, d) => d.complete(Err(e)),
            Command::Shutdown(d) => {
                self.closing = true;
                self.shutdown_waiters.push(d);
            }
        }
    }

    fn peer_reason(&self, peer: usize) -> String {
        let seg = &self.segs[peer];
        let bytes: Vec<u8> = (0..REASON_LEN).map(|i| seg.read::<u8>(OFF_REASON + i)).take_while(|&b| b != 0).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// `Err` when `peer` can no longer make progress: it aborted, shut down, or died.
    fn check_peer(&mut self, peer: usize, throttle: bool) -> Result<()> {
        match self.segs[peer].u32_at(OFF_STATE).load(Acquire) {
            STATE_ABORTED => {
                return Err(CommError::PeerLost {
                    rank: peer as Rank,
                    detail: format!("it aborted the group: {}", self.peer_reason(peer)),
                })
            }
            STATE_CLOSED => {
                return Err(CommError::PeerLost {
                    rank: peer as Rank,
                    detail: "it shut its process group down (or exited) without joining this op".into(),
                })
            }
            _ => {}
        }
        if throttle && self.last_liveness.elapsed() < Duration::from_millis(50) {
            return Ok(());
        }
        self.last_liveness = Instant::now();
        if let Some(p) = self.procs[peer] {
            if p.alive() == Some(false) {
                return Err(CommError::PeerLost {
                    rank: peer as Rank,
                    detail: format!("its process {} exited", p.pid),
                });
            }
        }
        Ok(())
    }

    // ----------------------------------------------------------------------------------------
    // The step protocol

    fn peer_step(&self, p: usize) -> u64 {
        self.segs[p].u64_at(OFF_STEP).load(Acquire)
    }

    fn reached(&self, target: u64) -> bool {
        (0..self.world).all(|p| p == self.rank || self.peer_step(p) >= target)
    }

    /// Waits until every peer published step `target`, progressing p2p meanwhile.
    fn wait_all(&mut self, target: u64) -> Result<()> {
        if self.reached(target) {
            return Ok(());
        }
        let start = Instant::now();
        let mut spun = false;
        loop {
            if self.reached(target) {
                return Ok(());
            }
            if self.pump()? {
                continue;
            }
            if let Some(e) = self.poison_error() {
                return Err(e);
            }
            if !spun {
                spun = true;
                while start.elapsed() < self.params.spin {
                    std::thread::yield_now();
                    if self.reached(target) {
                        return Ok(());
                    }
                }
                continue;
            }
            let late: Vec<usize> = (0..self.world).filter(|&p| p != self.rank && self.peer_step(p) < target).collect();
            for &p in &late {
                self.check_peer(p, true)?;
            }
            if start.elapsed() >= self.params.timeout {
                let who: Vec<String> = late.iter().map(|p| format!("rank {p}")).collect();
                return Err(CommError::Timeout {
                    op: self.op.to_owned(),
                    after: self.params.timeout,
                    detail: format!(
                        "{} never joined op #{} (set COMM_TIMEOUT to wait longer)",
                        who.join(", "),
                        self.seq
                    ),
                });
            }
            self.sleep(|e| e.reached(target))?;
        }
    }

    fn header(&self, op: u8, dtype: DType, count: usize, root: Rank, redop: Option<ReduceOp>) -> StepHeader {
        StepHeader {
            seq: self.seq,
            count: count as u64,
            root,
            op,
            dtype: dtype.code(),
            redop: redop.map_or(u8::MAX, ReduceOp::code),
            ..StepHeader::default()
        }
    }

    /// Starts step `k = step + 1`: waits for the buffer to be free and writes our header.
    fn begin(&mut self, hdr: &StepHeader) -> Result<u64> {
        let k = self.step + 1;
        self.wait_all(k - 1)?;
        self.write_header(k, hdr);
        self.phase = Phase::Writable(k);
        Ok(k)
    }

    /// Writes our header of step `k` but its step word, which [`announce`](Self::announce)
    /// sets. Only once every peer published `k - 1`.
    fn write_header(&self, k: u64, hdr: &StepHeader) {
        // SAFETY: every peer published `k - 1`, so all reads of this header from step `k - 2`
        // are finished; peers read it again only after `announce(k)` sets its step word, and
        // the step word (the first 8 bytes, atomic only) is not written here.
        unsafe { self.me().write(self.lay.step_header(k) + 8, hdr.body()) };
    }

    /// Whether every peer's header of step `k` is published: the inline path's wait, which
    /// finds the step and the header in one cache line (the worker waits on the step counter,
    /// which its sleeping protocol is built on).
    fn headers_reached(&self, k: u64) -> bool {
        let at = self.lay.step_header(k);
        (0..self.world).all(|p| p == self.rank || self.segs[p].u64_at(at).load(Acquire) >= k)
    }

    /// Our buffer for step `k`, while writable.
    fn window_mut(&mut self, k: u64) -> &mut [u8] {
        assert!(matches!(self.phase, Phase::Writable(s) if s == k), "window_mut outside the write phase of step {k}");
        // SAFETY: write phase of step `k` (checked above): no peer reads this buffer until we
        // publish `k`, and `&mut self` makes this the only live slice of it on our side.
        unsafe { self.segs[self.rank].bytes_mut(self.lay.step_data(k), self.lay.window) }
    }

    /// Publishes step `k`, waits for every peer to publish it, and checks their headers.
    fn publish(&mut self, k: u64, hdr: &StepHeader) -> Result<()> {
        self.announce(k);
        self.wait_all(k)?;
        self.check_headers(k, hdr)
    }

    /// Publishes step `k` (release) and wakes sleeping peers.
    fn announce(&mut self, k: u64) {
        // The header's step word first: a peer that sees it reads the header and data.
        self.me().u64_at(self.lay.step_header(k)).store(k, Release);
        self.me().u64_at(OFF_STEP).store(k, SeqCst);
        self.step = k;
        self.phase = Phase::Idle;
        for p in (0..self.world).filter(|&p| p != self.rank) {
            self.ring(p);
        }
    }

    /// Once every peer published `k`: compares their step headers with ours and opens the
    /// read phase.
    fn check_headers(&mut self, k: u64, hdr: &StepHeader) -> Result<()> {
        for p in (0..self.world).filter(|&p| p != self.rank) {
            let theirs: StepHeader = self.segs[p].read(self.lay.step_header(k));
            if theirs.step != k {
                return Err(CommError::Mismatch {
                    op: self.op,
                    detail: format!("rank {p} is out of step (at step {}, expected {k})", theirs.step),
                });
            }
            if (StepHeader { step: k, ..*hdr }) != theirs {
                return Err(CommError::Mismatch {
                    op: self.op,
                    detail: format!(
                        "rank {p} called {} but rank {} called {}",
                        describe(&theirs),
                        self.rank,
                        describe(hdr)
                    ),
                });
            }
        }
        self.phase = Phase::Readable(k);
        Ok(())
    }

    /// Every rank's buffer for step `k` (index = rank) and our buffer for step `k + 1`,
    /// while step `k` is readable.
    fn views(&mut self, k: u64) -> (Vec<&[u8]>, &mut [u8]) {
        assert!(matches!(self.phase, Phase::Readable(s) if s == k), "views outside the read phase of step {k}");
        let off = self.lay.step_data(k);
        // SAFETY: read phase of step `k` (checked): every rank published `k`, and none writes
        // its buffer `k % 2` again before all of us publish `k + 1`, which we do only after
        // these slices are gone (`step`/`begin` take `&mut self`).
        let views = self.segs.iter().map(|s| unsafe { s.bytes(off, self.lay.window) }).collect();
        // SAFETY: our buffer `(k + 1) % 2` was last read by peers in step `k - 1`, and all of
        // them published `k`; it is a different range from every slice above.
        let next = unsafe { self.me().bytes_mut(self.lay.step_data(k + 1), self.lay.window) };
        (views, next)
    }

    /// One step: `io(Io::Write(our buffer))`, publish and check, then
    /// `io(Io::Read(every rank's buffer, our next buffer))`. One closure for both phases, so
    /// it can borrow the user's buffer mutably in both.
    fn step(&mut self, hdr: &StepHeader, mut io: impl FnMut(Io<'_>)) -> Result<()> {
        let k = self.begin(hdr)?;
        io(Io::Write(self.window_mut(k)));
        self.publish(k, hdr)?;
        let (views, next) = self.views(k);
        io(Io::Read(&views, next));
        Ok(())
    }

    // ----------------------------------------------------------------------------------------
    // Collectives

    fn execute(&mut self, cmd: Command) {
        if let Some(e) = self.poison_error() {
            return self.fail(cmd, e);
        }
        self.seq += 1;
        match cmd {
            Command::AllReduce(mut r, d) => {
                let res = self.run_op("all_reduce", |e| e.all_reduce(&mut r.buf, r.op, None));
                d.complete(res.map(|()| r.buf));
            }
            Command::Reduce(mut r, d) => {
                let res = self.run_op("reduce", |e| e.all_reduce(&mut r.buf, r.op, Some(r.root)));
                d.complete(res.map(|()| r.buf));
            }
            Command::Broadcast(mut r, d) => {
                let res = self.run_op("broadcast", |e| e.broadcast(&mut r.buf, r.root));
                d.complete(res.map(|()| r.buf));
            }
            Command::AllGather(r, d) => d.complete(self.run_op("all_gather", |e| e.all_gather(r))),
            Command::ReduceScatter(r, d) => d.complete(self.run_op("reduce_scatter", |e| e.reduce_scatter(r))),
            Command::AllToAll(r, d) => d.complete(self.run_op("all_to_all", |e| e.all_to_all(r))),
            Command::Scatter(r, d) => d.complete(self.run_op("scatter", |e| e.scatter(r))),
            Command::Gather(r, d) => d.complete(self.run_op("gather", |e| e.gather(r))),
            Command::Shutdown(d) => {
                self.closing = true;
                self.shutdown_waiters.push(d);
            }
            Command::OneShot(op, d) => {
                let name = op.name();
                let r = self.run_op(name, |e| e.oneshot(op));
                self.finished = Some((d, r));
            }
            Command::Send(..) | Command::Recv(..) => unreachable!("p2p commands never enter the collective queue"),
        }
    }

    fn run_op<T>(&mut self, name: &'static str, f: impl FnOnce(&mut Engine) -> Result<T>) -> Result<T> {
        self.op = name;
        if self.params.panic_at == Some(name) {
            panic!("COMM_FAULT_INJECT: injected panic in {name} on rank {}", self.rank);
        }
        let res = f(self);
        self.phase = Phase::Idle;
        if let Err(e) = &res {
            if e.poisons_group() {
                self.poison_with(e);
            }
        }
        res
    }

    /// all_reduce, or reduce to `root` (non-roots keep their input).
    fn all_reduce(&mut self, buf: &mut HostBuffer, op: ReduceOp, root: Option<Rank>) -> Result<()> {
        let (dtype, count, es, n) = (buf.dtype(), buf.len(), buf.dtype().size(), self.world);
        let code = if root.is_some() { OP_REDUCE } else { OP_ALL_REDUCE };
        let hdr = self.header(code, dtype, count, root.unwrap_or(0), Some(op));
        if n == 1 {
            return Ok(());
        }
        if root.is_none() {
            let zc = buf.external().and_then(|e| e.as_any().downcast_ref::<ShmBuf>()).map(|z| z.name().to_owned());
            if let Some(name) = zc {
                let r = self.zc_all_reduce(buf, op, &name);
                if let Some(z) = buf.external().and_then(|e| e.as_any().downcast_ref::<ShmBuf>()) {
                    z.unlink_once(); // every peer mapped it during the first step
                }
                return r;
            }
        }
        let me = self.rank;
        let keep = root.is_none_or(|r| r as usize == me);
        let direct = count * es <= self.params.small_max;
        let user = buf.as_bytes_mut();
        for (off, len) in pieces(count, self.lay.window / es) {
            let chunk = &mut user[off * es..(off + len) * es];
            let bytes = chunk.len();
            if direct {
                // Every rank reduces all inputs: one step, n reads per rank.
                self.step(&hdr, |io| match io {
                    Io::Write(w) => w[..bytes].copy_from_slice(chunk),
                    Io::Read(views, _) if keep => reduce_views(dtype, op, views, chunk),
                    Io::Read(..) => {}
                })?;
            } else {
                // Reduce-scatter, then all-gather the reduced slices. Our own slice of our input
                // is read straight from the user's buffer (peers never read it, so it is not
                // copied in), and its result is written in place and into our next buffer for
                // the peers in the same pass.
                let (lo, hi) = slice_of(len, n, me);
                let own = lo * es..hi * es;
                self.step(&hdr, |io| match io {
                    Io::Write(w) => {
                        w[..own.start].copy_from_slice(&chunk[..own.start]);
                        w[own.end..bytes].copy_from_slice(&chunk[own.end..]);
                    }
                    Io::Read(views, next) if keep => {
                        let srcs: Vec<Src<'_>> =
                            (0..n).map(|p| if p == me { Src::Out } else { Src::Buf(&views[p][own.clone()]) }).collect();
                        kernels::reduce_to(dtype, op, &srcs, &mut chunk[own.clone()], Some(&mut next[own.clone()]));
                    }
                    Io::Read(views, next) => {
                        // A non-root of `reduce` keeps its input intact.
                        let mine = &chunk[own.clone()];
                        let srcs: Vec<Src<'_>> =
                            (0..n).map(|p| Src::Buf(if p == me { mine } else { &views[p][own.clone()] })).collect();
                        kernels::reduce_to(dtype, op, &srcs, &mut next[own.clone()], None);
                    }
                })?;
                self.step(&hdr, |io| {
                    if let (Io::Read(views, _), true) = (io, keep) {
                        // Start after our own slice and rotate, spreading readers over owners.
                        for i in 1..n {
                            let p = (me + i) % n;
                            let (lo, hi) = slice_of(len, n, p);
                            chunk[lo * es..hi * es].copy_from_slice(&views[p][lo * es..hi * es]);
                        }
                    }
                })?;
            }
        }
        Ok(())
    }

    /// all_reduce on buffers from `alloc_buffer`. Rank r owns slice r of *every* rank's
    /// buffer for the op: it reduces slice r reading all buffers directly and writes the
    /// result into all of them in the same pass (the lines it writes in a peer's buffer are
    /// the ones it just read, so they are in cache). Nobody else reads or writes slice r, so
    /// two steps suffice: one to learn where the buffers are (and that they hold their
    /// inputs), one to know every slice is written before the buffer goes back to its owner.
    /// No window traffic, no copy-in or copy-out pass.
    fn zc_all_reduce(&mut self, buf: &mut HostBuffer, op: ReduceOp, name: &str) -> Result<()> {
        let (dtype, count, es, n, me) = (buf.dtype(), buf.len(), buf.dtype().size(), self.world, self.rank);
        let hdr = StepHeader { aux: AUX_ZERO_COPY, ..self.header(OP_ALL_REDUCE, dtype, count, 0, Some(op)) };
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
        let (lo, hi) = slice_of(count, n, me);
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

    fn map_zero_copy(&mut self, peer: usize, name: &str, len: usize) -> Result<Arc<Segment>> {
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

    fn broadcast(&mut self, buf: &mut HostBuffer, root: Rank) -> Result<()> {
        let (es, root) = (buf.dtype().size(), root as usize);
        let hdr = self.header(OP_BROADCAST, buf.dtype(), buf.len(), root as Rank, None);
        if self.world == 1 {
            return Ok(());
        }
        let is_root = self.rank == root;
        let user = buf.as_bytes_mut();
        for (off, len) in pieces(user.len() / es, self.lay.window / es) {
            let chunk = &mut user[off * es..(off + len) * es];
            let bytes = chunk.len();
            self.step(&hdr, |io| match io {
                Io::Write(w) if is_root => w[..bytes].copy_from_slice(chunk),
                Io::Read(views, _) if !is_root => chunk.copy_from_slice(&views[root][..bytes]),
                _ => {}
            })?;
        }
        Ok(())
    }

    fn all_gather(&mut self, r: AllGather) -> Result<HostBuffer> {
        let (dtype, count, es, n) = (r.input.dtype(), r.input.len(), r.input.dtype().size(), self.world);
        let mut out = r.output.unwrap_or_else(|| HostBuffer::zeroed(dtype, count * n));
        let hdr = self.header(OP_ALL_GATHER, dtype, count, 0, None);
        let input = r.input.as_bytes();
        let dst = out.as_bytes_mut();
        if n == 1 {
            dst.copy_from_slice(input);
            return Ok(out);
        }
        for (off, len) in pieces(count, self.lay.window / es) {
            let src = &input[off * es..(off + len) * es];
            self.step(&hdr, |io| match io {
                Io::Write(w) => w[..src.len()].copy_from_slice(src),
                Io::Read(views, _) => {
                    for (p, v) in views.iter().enumerate() {
                        let at = (p * count + off) * es;
                        dst[at..at + src.len()].copy_from_slice(&v[..src.len()]);
                    }
                }
            })?;
        }
        Ok(out)
    }

    fn reduce_scatter(&mut self, r: ReduceScatter) -> Result<HostBuffer> {
        let (dtype, es, n, me, op) = (r.input.dtype(), r.input.dtype().size(), self.world, self.rank, r.op);
        let block = r.input.len() / n;
        let mut out = r.output.unwrap_or_else(|| HostBuffer::zeroed(dtype, block));
        let hdr = self.header(OP_REDUCE_SCATTER, dtype, r.input.len(), 0, Some(op));
        let input = r.input.as_bytes();
        let dst = out.as_bytes_mut();
        if n == 1 {
            dst.copy_from_slice(input);
            return Ok(out);
        }
        for (off, len) in pieces(block, self.lay.window / es / n) {
            let b = len * es;
            self.step(&hdr, |io| match io {
                Io::Write(w) => {
                    for j in 0..n {
                        let at = (j * block + off) * es;
                        w[j * b..(j + 1) * b].copy_from_slice(&input[at..at + b]);
                    }
                }
                Io::Read(views, _) => {
                    let ins: Vec<&[u8]> = views.iter().map(|v| &v[me * b..(me + 1) * b]).collect();
                    kernels::reduce(dtype, op, &ins, &mut dst[off * es..off * es + b]);
                }
            })?;
        }
        Ok(out)
    }

    fn all_to_all(&mut self, r: AllToAll) -> Result<HostBuffer> {
        let (dtype, es, n, me) = (r.input.dtype(), r.input.dtype().size(), self.world, self.rank);
        let (ins, outs) = r.splits(n as u32);
        let out_len: usize = outs.iter().sum();
        let mut out = r.output.unwrap_or_else(|| HostBuffer::zeroed(dtype, out_len));
        // Equal blocks need no agreement beyond the length, which the header checks. Uneven
        // ones start with a step where everyone publishes its send splits, so each rank checks
        // that what it expects from every peer is what that peer sends, and all agree on the
        // rounds. (Every rank must use the same form.)
        let equal = r.input_splits.is_none() && r.output_splits.is_none();
        let hdr = StepHeader {
            aux: u64::from(!equal),
            ..self.header(OP_ALL_TO_ALL, dtype, if equal { r.input.len() } else { 0 }, 0, None)
        };
        if n == 1 && ins[0] == outs[0] {
            out.as_bytes_mut().copy_from_slice(r.input.as_bytes());
            return Ok(out);
        }
        let mut matrix = vec![(r.input.len() / n) as u64; n * n];
        if !equal {
            let mine: Vec<u64> = ins.iter().map(|&x| x as u64).collect();
            self.step(&hdr, |io| match io {
                Io::Write(w) => w[..n * 8].copy_from_slice(bytemuck::cast_slice(&mine)),
                Io::Read(views, _) => {
                    for (p, v) in views.iter().enumerate() {
                        matrix[p * n..(p + 1) * n].copy_from_slice(bytemuck::cast_slice(&v[..n * 8]));
                    }
                }
            })?;
            for (p, &expect) in outs.iter().enumerate() {
                let sends = matrix[p * n + me] as usize;
                if sends != expect {
                    return Err(CommError::Mismatch {
                        op: "all_to_all",
                        detail: format!(
                            "rank {p} sends {sends} elements to rank {me}, but rank {me}'s output_splits expect {expect}"
                        ),
                    });
                }
            }
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
            self.step(&hdr, |io| match io {
                Io::Write(w) => {
                    for j in (0..n).filter(|&j| j != me) {
                        let (a, b) = (lo.min(ins[j]), (lo + per).min(ins[j]));
                        let src = &input[(in_off[j] + a) * es..(in_off[j] + b) * es];
                        w[slot_of(me, j)..slot_of(me, j) + src.len()].copy_from_slice(src);
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

    fn scatter(&mut self, r: Scatter) -> Result<HostBuffer> {
        let (dtype, es, n, me, root) =
            (r.output.dtype(), r.output.dtype().size(), self.world, self.rank, r.root as usize);
        let block = r.output.len();
        let mut out = r.output;
        let hdr = self.header(OP_SCATTER, dtype, block, root as Rank, None);
        let input = r.input;
        let src = input.as_ref().filter(|_| me == root).map(HostBuffer::as_bytes);
        let dst = out.as_bytes_mut();
        if n == 1 {
            if let Some(s) = src {
                dst.copy_from_slice(s);
            }
            return Ok(out);
        }
        for (off, len) in pieces(block, self.lay.window / es / n) {
            let b = len * es;
            self.step(&hdr, |io| match io {
                Io::Write(w) => {
                    if let Some(s) = src {
                        for j in 0..n {
                            let at = (j * block + off) * es;
                            w[j * b..(j + 1) * b].copy_from_slice(&s[at..at + b]);
                        }
                    }
                }
                Io::Read(views, _) => dst[off * es..off * es + b].copy_from_slice(&views[root][me * b..(me + 1) * b]),
            })?;
        }
        Ok(out)
    }

    fn gather(&mut self, r: Gather) -> Result<HostBuffer> {
        let (dtype, count, es, n, root) =
            (r.input.dtype(), r.input.len(), r.input.dtype().size(), self.world, r.root as usize);
        let hdr = self.header(OP_GATHER, dtype, count, root as Rank, None);
        let is_root = self.rank == root;
        let mut out = is_root.then(|| r.output.unwrap_or_else(|| HostBuffer::zeroed(dtype, count * n)));
        let input = r.input;
        {
            let src = input.as_bytes();
            let mut dst = out.as_mut().map(HostBuffer::as_bytes_mut);
            if n == 1 {
                if let Some(d) = dst {
                    d.copy_from_slice(src);
                }
                return Ok(out.unwrap_or(input));
            }
            for (off, len) in pieces(count, self.lay.window / es) {
                let piece = &src[off * es..(off + len) * es];
                self.step(&hdr, |io| match io {
                    Io::Write(w) => w[..piece.len()].copy_from_slice(piece),
                    Io::Read(views, _) => {
                        if let Some(dst) = dst.as_deref_mut() {
                            for (p, v) in views.iter().enumerate() {
                                let at = (p * count + off) * es;
                                dst[at..at + piece.len()].copy_from_slice(&v[..piece.len()]);
                            }
                        }
                    }
                })?;
            }
        }
        Ok(out.unwrap_or(input))
    }

    // ----------------------------------------------------------------------------------------
    // Point-to-point

    fn progress_p2p(&mut self) -> Result<bool> {
        let mut any = false;
        for peer in 0..self.world {
            while self.progress_send(peer)? {
                any = true;
            }
            while self.progress_recv(peer)? {
                any = true;
            }
        }
        Ok(any)
    }

    /// Writes the next chunk of the first queued send to `peer`, if a slot is free.
    fn progress_send(&mut self, peer: usize) -> Result<bool> {
        let Some(op) = self.sends[peer].front_mut() else { return Ok(false) };
        let chunk = self.sent[peer];
        let acked = self.segs[peer].u64_at(self.lay.acked(self.rank)).load(Acquire);
        if chunk - acked >= SLOTS {
            return Ok(false);
        }
        let total = op.req.buf.byte_len();
        let len = (total - op.offset).min(self.lay.slot);
        let me = &self.segs[self.rank];
        let hdr = MsgHeader {
            chunk,
            total: total as u64,
            offset: op.offset as u64,
            len: len as u64,
            tag: op.req.tag,
            dtype: op.req.buf.dtype().code(),
            ..MsgHeader::default()
        };
        // SAFETY: slot `chunk % SLOTS` was last used by chunk `chunk - SLOTS`, which the peer
        // acknowledged (acked > chunk - SLOTS) after it finished copying it out.
        unsafe {
            me.write(self.lay.msg_header(peer, chunk), hdr);
            me.bytes_mut(self.lay.msg_data(peer, chunk), len)
                .copy_from_slice(&op.req.buf.as_bytes()[op.offset..op.offset + len]);
        }
        me.u64_at(self.lay.sent(peer)).store(chunk + 1, SeqCst);
        self.sent[peer] = chunk + 1;
        op.offset += len;
        let finished = op.offset == total;
        self.ring(peer);
        if finished {
            let op = self.sends[peer].pop_front().expect("front exists");
            op.done.complete(Ok(op.req.buf));
        }
        Ok(true)
    }

    /// Copies the next available chunk from `peer` into the first queued receive. A receive
    /// that does not match what arrives fails with the `Mismatch` (the group is then poisoned
    /// and only later ops see `Poisoned`).
    fn progress_recv(&mut self, peer: usize) -> Result<bool> {
        self.progress_recv_front(peer).inspect_err(|e| {
            if let Some(op) = self.recvs[peer].pop_front() {
                op.done.complete(Err(e.duplicate()));
            }
        })
    }

    fn progress_recv_front(&mut self, peer: usize) -> Result<bool> {
        let Some(op) = self.recvs[peer].front_mut() else { return Ok(false) };
        let chunk = self.acked[peer];
        let src = &self.segs[peer];
        if src.u64_at(self.lay.sent(self.rank)).load(Acquire) <= chunk {
            return Ok(false);
        }
        let h: MsgHeader = src.read(self.lay.msg_header(self.rank, chunk));
        let want_total = op.req.buf.byte_len() as u64;
        let want_dtype = op.req.buf.dtype();
        if h.chunk != chunk || h.offset != op.offset as u64 {
            return Err(CommError::Mismatch {
                op: "recv",
                detail: format!("mailbox from rank {peer} is out of order (chunk {} at offset {}, expected chunk {chunk} at offset {})", h.chunk, h.offset, op.offset),
            });
        }
        if h.tag != op.req.tag || h.total != want_total || h.dtype != want_dtype.code() {
            let their_dtype = DType::from_code(h.dtype).map_or("?", DType::name);
            return Err(CommError::Mismatch {
                op: "recv",
                detail: format!(
                    "rank {peer} sent {} bytes of {their_dtype} with tag {} but rank {} posted a recv of {want_total} bytes of {want_dtype} with tag {} (messages between two ranks match in order)",
                    h.total, h.tag, self.rank, op.req.tag
                ),
            });
        }
        let len = h.len as usize;
        if op.offset + len > op.req.buf.byte_len() || len > self.lay.slot {
            return Err(CommError::Mismatch {
                op: "recv",
                detail: format!("rank {peer} sent a chunk of {len} bytes past the message end"),
            });
        }
        // SAFETY: the sender published `sent > chunk` after writing this slot and will not
        // rewrite it until we acknowledge below.
        let data = unsafe { src.bytes(self.lay.msg_data(self.rank, chunk), len) };
        op.req.buf.as_bytes_mut()[op.offset..op.offset + len].copy_from_slice(data);
        op.offset += len;
        let finished = op.offset == op.req.buf.byte_len();
        self.acked[peer] = chunk + 1;
        self.me().u64_at(self.lay.acked(peer)).store(chunk + 1, SeqCst);
        self.ring(peer);
        if finished {
            let op = self.recvs[peer].pop_front().expect("front exists");
            op.done.complete(Ok(op.req.buf));
        }
        Ok(true)
    }

    fn check_p2p_deadlines(&mut self) -> Result<()> {
        for peer in 0..self.world {
            let oldest = self.sends[peer]
                .front()
                .map(|o| o.started)
                .into_iter()
                .chain(self.recvs[peer].front().map(|o| o.started))
                .min();
            let Some(started) = oldest else { continue };
            let timeout = self.params.timeout;
            let r = self.check_peer(peer, true).and_then(|()| match started.elapsed() >= timeout {
                true => Err(CommError::Timeout {
                    op: "send/recv".into(),
                    after: timeout,
                    detail: format!("rank {peer} never posted the matching operation"),
                }),
                false => Ok(()),
            });
            if let Err(e) = r {
                // Every send and recv waiting on this peer gets the real cause; the others
                // see the group poisoned.
                for op in self.sends[peer].drain(..) {
                    op.done.complete(Err(e.duplicate()));
                }
                for op in self.recvs[peer].drain(..) {
                    op.done.complete(Err(e.duplicate()));
                }
                return Err(e);
            }
        }
        Ok(())
    }
}

/// The worker thread: runs [`Engine::work`] under the lock and sleeps on the doorbell,
/// unlocked, whenever there is nothing to do.
pub(crate) fn worker(engine: Arc<Mutex<Engine>>, me: Arc<Segment>) {
    let lock = || engine.lock().unwrap_or_else(|p| p.into_inner());
    let mut broken = false;
    // A small op's caller is woken only once the lock is released: woken under it, the caller
    // would find the engine busy and queue its next op for the worker too, and the ranks would
    // keep handing small ops to their workers (a thread hop each) instead of running them inline.
    let mut work = || {
        let turn = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut engine = lock();
            let flow = if broken { engine.drain_after_panic() } else { engine.work() };
            let finished = engine.finished.take();
            drop(engine);
            if let Some((done, r)) = finished {
                done.complete(r);
            }
            flow
        }));
        turn.unwrap_or_else(|payload| {
            // A bug, not a peer's fault: contain it so this rank fails cleanly (peers told,
            // pending ops failed, shutdown answered) instead of going half-alive.
            broken |= !lock().contain_panic(&comm_core::panic_message(&*payload));
            Flow::Busy
        })
    };
    loop {
        let bell = me.u32_at(OFF_DOORBELL);
        let seen = bell.load(SeqCst);
        let wait_for = match work() {
            Flow::Exit => return,
            Flow::Busy => continue,
            Flow::Idle => SLEEP_PEERS,
            Flow::Quiet => SLEEP_LOCAL,
        };
        // Announce the sleep, then look once more: a peer that published before seeing the
        // flag is visible now; one that publishes later rings the bell.
        me.u32_at(OFF_SLEEPING).store(wait_for, SeqCst);
        let flow = work();
        if matches!(flow, Flow::Idle | Flow::Quiet) {
            futex_wait(bell, seen, Duration::from_millis(10));
        }
        me.u32_at(OFF_SLEEPING).store(0, SeqCst);
        if matches!(flow, Flow::Exit) {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_everything_once() {
        assert_eq!(pieces(0, 4).collect::<Vec<_>>(), [(0, 0)]);
        assert_eq!(pieces(10, 4).collect::<Vec<_>>(), [(0, 4), (4, 4), (8, 2)]);
        assert_eq!(pieces(8, 4).collect::<Vec<_>>(), [(0, 4), (4, 4)]);
    }

    #[test]
    fn slices_partition() {
        for len in [0, 1, 15, 16, 17, 1000, 4099] {
            for parts in 1..=8 {
                let mut next = 0;
                for i in 0..parts {
                    let (lo, hi) = slice_of(len, parts, i);
                    assert_eq!(lo, next);
                    assert!(hi >= lo);
                    next = hi;
                }
                assert_eq!(next, len);
            }
        }
    }
}
