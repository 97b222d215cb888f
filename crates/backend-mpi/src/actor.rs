//! The actor: the one thread that initialises MPI, owns every communicator and request, and is
//! the only thread that calls MPI (except `MPI_Abort` from the panic hook).
//!
//! Handles send [`Msg`]s over a channel. Each group (a communicator) runs its collectives one
//! at a time in submission order — every rank then issues the same MPI collectives in the same
//! order, which MPI requires —, while its point-to-point operations are all in flight at once.
//! Every operation is a nonblocking MPI call; the loop polls every request (`MPI_Test`, which
//! also drives MPI's progress), so an `isend` never waits behind a collective and collectives
//! of different groups overlap.
//!
//! A collective is a chain of steps: each step is one nonblocking call plus a continuation that
//! runs when it completes (and may issue the next call). With checking on (the default), step
//! one gathers a fixed-size slot from every rank: a 32-byte header (op, dtype, count, root,
//! reduce op) and, for a small op, its data; all ranks see the same headers, so they all detect
//! a mismatch alike and fail with [`CommError::Mismatch`] instead of feeding MPI mismatched
//! calls (which MPI does not detect: it hangs, corrupts or aborts), and a small op finishes from
//! the slots without a second call.

use std::collections::{BTreeMap, VecDeque};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use comm_core::ops::{
    AllGather, AllReduce, AllToAll, Broadcast, Gather, RecvFrom, Reduce, ReduceScatter, Scatter, SendTo,
};
use comm_core::{CommError, Completer, DType, HostBuffer, Rank, ReduceOp};

use crate::raw::{self, Bufs, Comm, PendingDup, Polled, Request};
use crate::{global, kernels, Reduction};

/// Identifies a group (communicator) inside the actor.
pub(crate) type Gid = u64;

/// Settings of one group (a world group's are inherited by its sub-groups).
#[derive(Clone, Debug)]
pub(crate) struct Params {
    pub(crate) timeout: Duration,
    pub(crate) reduction: Reduction,
    pub(crate) check: bool,
    pub(crate) small_max: usize,
    pub(crate) chunk: usize,
    pub(crate) spin: Option<Duration>,
    /// Test hook (`COMM_FAULT_INJECT=panic:<op>`): the actor panics when it starts this op.
    pub(crate) panic_at: Option<&'static str>,
}

/// What a handle needs to know about its group.
#[derive(Clone, Debug)]
pub(crate) struct GroupInfo {
    pub(crate) gid: Gid,
    pub(crate) rank: Rank,
    pub(crate) size: u32,
    /// Largest user tag (MPI_TAG_UB >> 3: the low 3 bits carry the dtype).
    pub(crate) tag_max: u32,
    pub(crate) poison: Arc<Mutex<Option<String>>>,
    /// Created by `MpiBackend::init` (its shutdown ends MPI for the process).
    pub(crate) world: bool,
    pub(crate) local_rank: Rank,
    pub(crate) local_size: u32,
    /// Where callers may run small collectives themselves (MPI provides
    /// `MPI_THREAD_MULTIPLE`).
    pub(crate) lane: Option<Arc<Lane>>,
}

/// A group's collectives, shared by its handles and the actor: a caller runs a small one on
/// its own thread (no hand-off to the actor and back) when the actor has none of this group's
/// collectives queued or running; otherwise it queues it behind them. Either way the group's
/// collectives are issued one at a time, in submission order.
pub(crate) struct Lane {
    state: Mutex<LaneState>,
    params: Params,
    /// How long a direct op polls before yielding between polls (zero when ranks outnumber
    /// cores).
    spin: Duration,
}

struct LaneState {
    /// Collectives handed to the actor and not finished.
    queued: usize,
    /// The communicator, until the actor frees it.
    comm: Option<raw::SharedComm>,
    /// Direct ops so far (for messages).
    seq: u64,
    /// Output buffers of direct ops, reused.
    pool: Pool,
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane").finish_non_exhaustive()
    }
}

impl Lane {
    fn lock(&self) -> std::sync::MutexGuard<'_, LaneState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A collective handed to the actor: counted in its lane until the actor is done with it.
pub(crate) struct Ticket(Arc<Lane>);

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.queued = st.queued.saturating_sub(1);
    }
}

/// Runs `cmd` on the caller's thread when it is a small collective or an all_reduce and the
/// group's lane is free (`None`; see ARCHITECTURE.md, "The path of a small op"); else hands it
/// back for the actor, with the ticket that counts it in the lane when it is a collective
/// (point-to-point ops never wait for collectives).
pub(crate) fn submit_direct(
    lane: &Arc<Lane>,
    info: &GroupInfo,
    tx: &std::sync::mpsc::Sender<Msg>,
    cmd: Cmd,
) -> Option<(Cmd, Option<Ticket>)> {
    if matches!(cmd, Cmd::Send(..) | Cmd::Recv(..)) {
        return Some((cmd, None));
    }
    let mut st = lane.lock();
    let small = cmd.inline_bytes().is_some_and(|b| b <= inline_max(info.size as usize));
    // An all_reduce of any size continues on this thread once the exchange completed: every
    // rank is in it then, so it waits for the transfer, not for peers.
    let all_reduce = matches!(&cmd, Cmd::AllReduce(r, _)
        if local_reduction(&lane.params, r.buf.dtype()) || blocking_native(&lane.params, r.buf.dtype()));
    if st.comm.is_none() || st.queued > 0 || !(small || all_reduce) || !lane.params.check || info.size < 2 {
        st.queued += 1;
        return Some((cmd, Some(Ticket(lane.clone()))));
    }
    st.seq += 1;
    let what = format!("{} (direct #{})", cmd.name(), st.seq);
    let Some(comm) = &st.comm else { unreachable!("checked above") };
    let Plan { header, payload, start, reply, .. } = plan(cmd);
    let r = match comm.with(|comm| exchange_direct(comm, &st.pool, lane, info, header, payload, start, &what)) {
        Ok(Direct::Done(out)) => Ok(out),
        Err(e) => Err(e),
        Ok(Direct::Waiting(req, cont, started)) => {
            // Peers are late: the actor polls it from here on (this thread must not block for
            // them: a task it would run may be what they wait for). Counted in the lane like
            // any collective the actor runs, and sent under the lock, so it runs first.
            st.queued += 1;
            let active = Active { ticket: Some(Ticket(lane.clone())), what, started, req, cont, reply };
            if let Err(std::sync::mpsc::SendError(msg)) = tx.send(Msg::Adopt(info.gid, Box::new(active))) {
                // The actor is gone (MPI finalised): the request stays with MPI.
                drop(st);
                if let Msg::Adopt(_, a) = msg {
                    let Active { req, reply, .. } = *a;
                    reply.fail(CommError::Shutdown("the MPI actor is gone".into()));
                    std::mem::forget(req);
                }
            }
            return None;
        }
    };
    if let Err(e) = &r {
        if e.poisons_group() {
            let mut p = info.poison.lock().unwrap_or_else(|p| p.into_inner());
            p.get_or_insert_with(|| e.to_string());
        }
    }
    // Completion hooks run unlocked (one may submit the next op).
    drop(st);
    match r {
        // Not new_group (never direct): no communicator to register.
        Ok(out) => drop(reply.complete(out)),
        Err(e) => reply.fail(e),
    }
    None
}

/// How far a direct op got on the caller's thread.
enum Direct {
    Done(Out),
    /// The exchange is still in flight after the wait budget: its request and what follows.
    Waiting(Request, Cont, Instant),
}

/// Yields a direct op's caller makes after its spin budget before handing the op to the actor.
const DIRECT_YIELDS: u32 = 16;

/// The exchange of a direct op, polled on this thread for the lane's spin budget and a few
/// yields, then the rest of the op.
#[allow(clippy::too_many_arguments)]
fn exchange_direct(
    comm: &Comm,
    pool: &Pool,
    lane: &Lane,
    info: &GroupInfo,
    header: Header,
    payload: Option<Vec<u8>>,
    start: Start,
    what: &str,
) -> Result<Direct, CommError> {
    let (size, rank) = (info.size as usize, info.rank as usize);
    let (mut req, finish) = exchange(comm, size, header, payload, start, what.to_owned())?;
    let started = Instant::now();
    let mut yields = 0;
    let bufs = loop {
        match req.test() {
            Polled::Done(_) => {
                break req.into_bufs().ok_or_else(|| internal("a completed request kept its buffers"))?
            }
            Polled::Failed { err, .. } => return Err(err.into_comm()),
            Polled::Pending if started.elapsed() < lane.spin => std::hint::spin_loop(),
            Polled::Pending if yields < DIRECT_YIELDS => {
                yields += 1;
                std::thread::yield_now();
            }
            Polled::Pending => return Ok(Direct::Waiting(req, finish, started)),
        }
    };
    let env = Env { comm, rank, size, params: &lane.params, half: None, pool };
    // Every rank is in the op now: its further steps (a large exact reduction) run here too.
    let mut step = finish(&env, bufs)?;
    loop {
        let (mut req, cont) = match step {
            Step::Done(out) => return Ok(Direct::Done(out)),
            Step::Wait(req, cont) => (req, cont),
        };
        let bufs = loop {
            match req.test() {
                Polled::Done(_) => {
                    break req.into_bufs().ok_or_else(|| internal("a completed request kept its buffers"))?
                }
                Polled::Failed { err, .. } => return Err(err.into_comm()),
                Polled::Pending if started.elapsed() >= lane.params.timeout => {
                    // The request stays with MPI: dropping it leaks its buffers (raw rule 3).
                    return Err(CommError::Timeout {
                        op: what.to_owned(),
                        after: lane.params.timeout,
                        detail: format!("a rank of the group of {size} stopped in the middle of it (died, or hangs)"),
                    });
                }
                // Yield between polls, as the actor does while a collective is in flight: on
                // a busy machine the transport (TCP's kernel work, a peer) needs the core.
                Polled::Pending => std::thread::yield_now(),
            }
        };
        step = cont(&env, bufs)?;
    }
}

/// Issues the exchange before a collective (the header, and a small op's data, of every rank in
/// one fixed-size slot each); the continuation checks the headers and starts the op, from the
/// slots when they carry its data. The same on the actor and on a caller's thread.
fn exchange(
    comm: &Comm,
    size: usize,
    header: Header,
    payload: Option<Vec<u8>>,
    start: Start,
    what: String,
) -> Result<(Request, Cont), CommError> {
    let slot = exchange_slot_bytes(size);
    let payload = payload.filter(|p| p.len() <= inline_max(size));
    let mine = exchange_slot(slot, &header, payload.as_deref());
    let req = raw::iallgather(comm, mine, HostBuffer::zeroed(DType::U8, slot * size))?;
    let inline = payload.is_some();
    let cont: Cont = Box::new(move |env: &Env<'_>, bufs: Bufs| {
        let ex = Exchange { all: take(bufs.recv)?, slot };
        verify(&ex, env.size, &header, env.rank, &what)?;
        start(env, inline.then_some(&ex))
    });
    Ok((req, cont))
}

/// This rank's slot of the exchange before a collective: the header, then a small op's data.
fn exchange_slot(slot: usize, header: &Header, payload: Option<&[u8]>) -> HostBuffer {
    let mut mine = HostBuffer::zeroed(DType::U8, slot);
    mine.as_bytes_mut()[..32].copy_from_slice(bytemuck::cast_slice(&header.encode()));
    if let Some(p) = payload {
        mine.as_bytes_mut()[32..32 + p.len()].copy_from_slice(p);
    }
    mine
}

/// A message to the actor.
pub(crate) enum Msg {
    /// An op on a group (with its lane ticket when it is a collective).
    Op(Gid, Cmd, Option<Ticket>),
    /// A caller's direct op whose exchange did not complete at once: the actor finishes it.
    Adopt(Gid, Box<Active>),
    /// A new world group (a duplicate of MPI_COMM_WORLD).
    World(Params, Completer<GroupInfo>),
    /// Shut a group down (a world group: end MPI) after its submitted ops.
    Shutdown(Gid, Completer<()>),
    /// The last handle of a group was dropped.
    Release(Gid),
    /// The process is exiting: finish, finalise MPI.
    Exit,
}

/// An op, with the completer of its `Work`.
pub(crate) enum Cmd {
    AllReduce(AllReduce, Completer<HostBuffer>),
    Broadcast(Broadcast, Completer<HostBuffer>),
    Reduce(Reduce, Completer<HostBuffer>),
    AllGather(AllGather, Completer<HostBuffer>),
    ReduceScatter(ReduceScatter, Completer<HostBuffer>),
    AllToAll(AllToAll, Completer<HostBuffer>),
    Scatter(Scatter, Completer<HostBuffer>),
    Gather(Gather, Completer<HostBuffer>),
    Barrier(Completer<()>),
    Send(SendTo, Completer<HostBuffer>),
    Recv(RecvFrom, Completer<HostBuffer>),
    NewGroup(Vec<Rank>, Completer<Option<GroupInfo>>),
}

impl Cmd {
    /// The bytes a small op ships in the header exchange (and then needs no other call), for
    /// the ops that can; which ones do is the plans' rule (`Plan::payload`).
    fn inline_bytes(&self) -> Option<usize> {
        match self {
            Cmd::AllReduce(r, _) => Some(r.buf.byte_len()),
            Cmd::Reduce(r, _) => Some(r.buf.byte_len()),
            Cmd::Broadcast(r, _) => Some(r.buf.byte_len()),
            Cmd::AllGather(r, _) => Some(r.input.byte_len()),
            Cmd::Barrier(_) => Some(0),
            _ => None,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Cmd::AllReduce(..) => "all_reduce",
            Cmd::Broadcast(..) => "broadcast",
            Cmd::Reduce(..) => "reduce",
            Cmd::AllGather(..) => "all_gather",
            Cmd::ReduceScatter(..) => "reduce_scatter",
            Cmd::AllToAll(..) => "all_to_all",
            Cmd::Scatter(..) => "scatter",
            Cmd::Gather(..) => "gather",
            Cmd::Barrier(..) => "barrier",
            Cmd::Send(..) => "send",
            Cmd::Recv(..) => "recv",
            Cmd::NewGroup(..) => "new_group",
        }
    }

    fn fail(self, e: CommError) {
        match self {
            Cmd::AllReduce(_, d)
            | Cmd::Broadcast(_, d)
            | Cmd::Reduce(_, d)
            | Cmd::AllGather(_, d)
            | Cmd::ReduceScatter(_, d)
            | Cmd::AllToAll(_, d)
            | Cmd::Scatter(_, d)
            | Cmd::Gather(_, d)
            | Cmd::Send(_, d)
            | Cmd::Recv(_, d) => d.complete(Err(e)),
            Cmd::Barrier(d) => d.complete(Err(e)),
            Cmd::NewGroup(_, d) => d.complete(Err(e)),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Headers

const OP_ALL_REDUCE: u8 = 1;
const OP_BROADCAST: u8 = 2;
const OP_REDUCE: u8 = 3;
const OP_ALL_GATHER: u8 = 4;
const OP_REDUCE_SCATTER: u8 = 5;
const OP_ALL_TO_ALL: u8 = 6;
const OP_SCATTER: u8 = 7;
const OP_GATHER: u8 = 8;
const OP_BARRIER: u8 = 9;
const OP_NEW_GROUP: u8 = 10;
const NO_VALUE: u8 = u8::MAX;
const MAGIC: u64 = 0x636f_6d6d_6d70_6901; // "commmpi" + version 1

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
        OP_NEW_GROUP => "new_group",
        _ => "an unknown op",
    }
}

/// What every rank publishes before a collective; all ranks must publish the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    op: u8,
    dtype: u8,
    redop: u8,
    root: u32,
    count: u64,
    /// Op-specific (new_group: a hash of the rank list).
    extra: u64,
}

impl Header {
    fn new(op: u8, dtype: Option<DType>, count: usize, root: Option<Rank>, redop: Option<ReduceOp>) -> Header {
        Header {
            op,
            dtype: dtype.map_or(NO_VALUE, DType::code),
            redop: redop.map_or(NO_VALUE, ReduceOp::code),
            root: root.unwrap_or(u32::MAX),
            count: count as u64,
            extra: 0,
        }
    }

    fn encode(&self) -> [u64; 4] {
        let w0 =
            u64::from(self.op) | u64::from(self.dtype) << 8 | u64::from(self.redop) << 16 | u64::from(self.root) << 32;
        [MAGIC, w0, self.count, self.extra]
    }

    fn decode(w: &[u64]) -> Option<Header> {
        (w.len() == 4 && w[0] == MAGIC).then(|| Header {
            op: w[1] as u8,
            dtype: (w[1] >> 8) as u8,
            redop: (w[1] >> 16) as u8,
            root: (w[1] >> 32) as u32,
            count: w[2],
            extra: w[3],
        })
    }

    fn describe(&self) -> String {
        let mut s = op_name(self.op).to_owned();
        let mut parts = Vec::new();
        if let Some(d) = DType::from_code(self.dtype) {
            parts.push(if self.op == OP_ALL_TO_ALL { d.to_string() } else { format!("{d} × {}", self.count) });
        }
        if self.op == OP_NEW_GROUP {
            parts.push(format!("{} ranks, list hash {:016x}", self.count, self.extra));
        }
        if self.root != u32::MAX {
            parts.push(format!("root {}", self.root));
        }
        if let Some(op) = ReduceOp::ALL.get(self.redop as usize) {
            parts.push(op.to_string());
        }
        if !parts.is_empty() {
            s += &format!(" ({})", parts.join(", "));
        }
        s
    }
}

/// FNV-1a of a rank list: ranks that pass different lists to `new_group` disagree.
fn hash_ranks(ranks: &[Rank]) -> u64 {
    ranks
        .iter()
        .flat_map(|r| r.to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

// ---------------------------------------------------------------------------------------------
// Steps

/// What a group's continuation may use.
struct Env<'a> {
    comm: &'a Comm,
    rank: usize,
    size: usize,
    params: &'a Params,
    half: Option<&'a raw::HalfOps>,
    pool: &'a Pool,
}

/// Spare large buffers, reused for scratch space and outputs: repeated ops of one size then
/// neither allocate nor page-fault. Every buffer taken from it is completely overwritten by
/// MPI or by a reduction before anyone reads it.
#[derive(Default)]
struct Pool {
    spare: std::cell::RefCell<Vec<HostBuffer>>,
}

impl Pool {
    /// Smaller buffers are cheap to allocate.
    const MIN: usize = 64 << 10;
    /// At most this many bytes are kept.
    const MAX_BYTES: usize = 256 << 20;
}

impl Env<'_> {
    /// A buffer of `len` elements whose contents will all be overwritten.
    fn buffer(&self, dtype: DType, len: usize) -> HostBuffer {
        let bytes = len * dtype.size();
        if bytes >= Pool::MIN {
            let mut spare = self.pool.spare.borrow_mut();
            if let Some(i) = spare.iter().position(|b| b.byte_len() == bytes) {
                let mut b = spare.swap_remove(i);
                b.reshape(dtype, len);
                return b;
            }
        }
        HostBuffer::zeroed(dtype, len)
    }

    /// Keeps a buffer nobody uses any more for [`Env::buffer`].
    fn recycle(&self, b: Option<HostBuffer>) {
        let Some(b) = b.filter(|b| b.byte_len() >= Pool::MIN) else { return };
        let mut spare = self.pool.spare.borrow_mut();
        spare.push(b);
        while spare.len() > 4 || spare.iter().map(HostBuffer::byte_len).sum::<usize>() > Pool::MAX_BYTES {
            spare.remove(0);
        }
    }
}

type Cont = Box<dyn FnOnce(&Env<'_>, Bufs) -> Result<Step, CommError> + Send>;

/// How a planned collective starts, once every rank agreed on its header; given the gathered
/// exchange when it carried every rank's [`Plan::payload`] (then a small op finishes from it).
type Start = Box<dyn FnOnce(&Env<'_>, Option<&Exchange>) -> Result<Step, CommError> + Send>;

/// Bytes per rank of the exchange before every collective in a group of `n`: the 32-byte
/// header, then up to [`inline_max`] bytes of data. One size per group, so the first MPI call
/// of every op has the same count on every rank whatever the ranks called (MPI cannot detect
/// mismatched counts): 1 KiB up to 16 ranks, halving with more (16 KiB gathered in all), at
////// least 256 bytes (a larger slot makes every op's exchange slower).
fn exchange_slot_bytes(n: usize) -> usize {
    let x = ((16 << 10) / n.max(1)).clamp(256, 1 << 10);
    1 << (usize::BITS - 1 - x.leading_zeros())
}

/// The most data a small op ships inside the exchange (and then needs no other MPI call).
fn inline_max(n: usize) -> usize {
    exchange_slot_bytes(n) - 32
}

/// Every rank's exchange slot, gathered.
struct Exchange {
    all: HostBuffer,
    slot: usize,
}

impl Exchange {
    /// The first `len` bytes of rank `p`'s data.
    fn data(&self, p: usize, len: usize) -> &[u8] {
        let at = p * self.slot + 32;
        &self.all.as_bytes()[at..at + len]
    }

    /// Rank `p`'s header.
    fn header(&self, p: usize) -> Option<Header> {
        let at = p * self.slot;
        Header::decode(bytemuck::cast_slice(&self.all.as_bytes()[at..at + 32]))
    }
}

enum Step {
    /// Wait for the request, then continue.
    Wait(Request, Cont),
    /// Finished with this output.
    Done(Out),
}

enum Out {
    Buf(HostBuffer),
    Unit,
    Comm(Option<Comm>),
}

fn wait(req: Request, cont: impl FnOnce(&Env<'_>, Bufs) -> Result<Step, CommError> + Send + 'static) -> Step {
    Step::Wait(req, Box::new(cont))
}

fn done(b: HostBuffer) -> Result<Step, CommError> {
    Ok(Step::Done(Out::Buf(b)))
}

fn internal(what: &str) -> CommError {
    CommError::Backend { backend: "mpi", source: format!("internal error: {what}").into() }
}

fn take(b: Option<HostBuffer>) -> Result<HostBuffer, CommError> {
    b.ok_or_else(|| internal("a completed request did not hand its buffer back"))
}

/// Communicators made by `new_group` (`None` on non-members), with their parent and who waits.
type Born = Vec<(Gid, Option<Comm>, Completer<Option<GroupInfo>>)>;

/// Who gets the result.
enum Reply {
    Buf(Completer<HostBuffer>),
    Unit(Completer<()>),
    Group(Completer<Option<GroupInfo>>),
}

impl Reply {
    /// Completes with `out`; a new group's communicator comes back for the actor to register.
    fn complete(self, out: Out) -> Option<(Option<Comm>, Completer<Option<GroupInfo>>)> {
        match (self, out) {
            (Reply::Buf(d), Out::Buf(b)) => d.complete(Ok(b)),
            (Reply::Unit(d), Out::Unit) => d.complete(Ok(())),
            (Reply::Group(d), Out::Comm(c)) => return Some((c, d)),
            (r, _) => r.fail(internal("an op finished with the wrong kind of output")),
        }
        None
    }

    fn fail(self, e: CommError) {
        match self {
            Reply::Buf(d) => d.complete(Err(e)),
            Reply::Unit(d) => d.complete(Err(e)),
            Reply::Group(d) => d.complete(Err(e)),
        }
    }
}

/// The running collective of a group.
pub(crate) struct Active {
    /// Keeps the op counted in its group's lane until it is done.
    ticket: Option<Ticket>,
    what: String,
    started: Instant,
    req: Request,
    cont: Cont,
    reply: Reply,
}

/// An op's plan: its header and how to start it once every rank agreed.
struct Plan {
    name: &'static str,
    header: Header,
    /// What this rank ships in the exchange for an op small enough to finish from it (every
    /// rank of an op with a matching header has one, possibly empty).
    payload: Option<Vec<u8>>,
    start: Start,
    reply: Reply,
}

/// The payload of an op whose data (`bytes` on every rank, by the header) may fit the exchange
/// (whether it does depends on the group's size: [`inline_max`]).
fn inline(bytes: usize, data: impl FnOnce() -> Vec<u8>) -> Option<Vec<u8>> {
    (bytes <= inline_max(1)).then(data)
}

/// Slice `i` of `len` elements cut in `parts`, boundaries on 16 elements: `(offset, len)`.
fn slice_of(len: usize, parts: usize, i: usize) -> (usize, usize) {
    let per = len.div_ceil(parts).div_ceil(16) * 16;
    let (lo, hi) = ((i * per).min(len), ((i + 1) * per).min(len));
    (lo, hi - lo)
}

/// Whether a reduction is done by us (rank order, bit-identical to the reference) rather than
/// by an MPI op: always in exact mode; in native mode for 8-bit integers, which MPI libraries
/// get wrong (Open MPI 4.1's AVX kernels saturate sums instead of wrapping; MPICH 4.0
/// compares `uint8_t` as signed in min/max).
fn local_reduction(params: &Params, dtype: DType) -> bool {
    params.reduction == Reduction::Exact || matches!(dtype, DType::U8 | DType::I8)
}

/// Whether a native all_reduce of `dtype` runs as a blocking `MPI_Allreduce` after the
/// exchange: MPI reduces it with a built-in op (f16/bf16 take our user ops, which live on the
/// actor: a caller's thread cannot reach them, so these stay nonblocking everywhere).
fn blocking_native(params: &Params, dtype: DType) -> bool {
    !local_reduction(params, dtype) && !matches!(dtype, DType::F16 | DType::BF16)
}

/// The MPI op for a reduction MPI performs: built-in for integers and (native mode) f32/f64,
/// our user-defined ops for f16/bf16 (native mode). `Avg` sums; the caller divides.
fn mpi_op(env: &Env<'_>, dtype: DType, op: ReduceOp) -> Result<mpi::ffi::MPI_Op, CommError> {
    let unsupported = || CommError::Unsupported { op: "reduction", dtype: Some(dtype), backend: "mpi" };
    match dtype {
        DType::F16 | DType::BF16 => env.half.and_then(|h| h.get(dtype, op)).ok_or_else(unsupported),
        _ => raw::builtin_op(if op == ReduceOp::Avg { ReduceOp::Sum } else { op }).ok_or_else(unsupported),
    }
}

/// Views of `n` consecutive blocks of `len` elements.
fn blocks(all: &HostBuffer, n: usize, len: usize) -> Vec<&[u8]> {
    let b = len * all.dtype().size();
    (0..n).map(|i| &all.as_bytes()[i * b..(i + 1) * b]).collect()
}

/// all_reduce (`root == None`) or reduce to `root`. Non-roots get their input back.
fn plan_reduce(buf: HostBuffer, op: ReduceOp, root: Option<Rank>, reply: Reply) -> Plan {
    let (dtype, len) = (buf.dtype(), buf.len());
    let (name, code) = if root.is_some() { ("reduce", OP_REDUCE) } else { ("all_reduce", OP_ALL_REDUCE) };
    let header = Header::new(code, Some(dtype), len, root, Some(op));
    let payload = inline(buf.byte_len(), || buf.as_bytes().to_vec());
    let start = move |env: &Env<'_>, ex: Option<&Exchange>| -> Result<Step, CommError> {
        let (me, n) = (env.rank, env.size);
        let root = root.map(|r| r as usize);
        let keep = root.is_none_or(|r| r == me);
        if let Some(ex) = ex {
            // Every input came with the headers: reduce them in rank order, no other call (in
            // native mode too: as fast, and exact).
            let mut buf = buf;
            if keep {
                let bytes = buf.byte_len();
                let ins: Vec<&[u8]> = (0..n).map(|p| ex.data(p, bytes)).collect();
                kernels::reduce(dtype, op, &ins, buf.as_bytes_mut());
            }
            return done(buf);
        }
        if root.is_none() && env.params.check && blocking_native(env.params, dtype) {
            // Every rank completed the header exchange, so every rank is in this all_reduce
            // and MPI's blocking call (its fastest algorithms) cannot wait on a missing one.
            // Wherever it runs (a caller's thread or the actor): blocking and nonblocking
            // collectives do not match each other in MPI, so all ranks must make the same call.
            let mut out = env.buffer(dtype, len);
            raw::allreduce(env.comm, &buf, &mut out, mpi_op(env, dtype, op)?)?;
            env.recycle(Some(buf));
            if op == ReduceOp::Avg {
                kernels::divide(&mut out, n);
            }
            return done(out);
        }
        if !local_reduction(env.params, dtype) {
            let mpi = mpi_op(env, dtype, op)?;
            let recv = keep.then(|| env.buffer(dtype, len));
            let req = match root {
                None => raw::iallreduce(env.comm, buf, take(recv)?, mpi)?,
                Some(r) => raw::ireduce(env.comm, buf, recv, mpi, r as i32)?,
            };
            return Ok(wait(req, move |env, b| {
                if !keep {
                    return done(take(b.send)?);
                }
                env.recycle(b.send);
                let mut out = take(b.recv)?;
                if op == ReduceOp::Avg {
                    kernels::divide(&mut out, n);
                }
                done(out)
            }));
        }
        let es = dtype.size();
        if len * es * (n - 1) <= env.params.small_max {
            // Small: gather every input, reduce all of them in rank order.
            if root.is_none() && env.params.check {
                // After a completed exchange: MPI's blocking call (see the native case).
                let mut all = env.buffer(dtype, n * len);
                raw::allgather(env.comm, &buf, &mut all)?;
                let mut buf = buf;
                kernels::reduce(dtype, op, &blocks(&all, n, len), buf.as_bytes_mut());
                env.recycle(Some(all));
                return done(buf);
            }
            let all = keep.then(|| env.buffer(dtype, n * len));
            let req = match root {
                None => raw::iallgather(env.comm, buf, take(all)?)?,
                Some(r) => raw::igather(env.comm, buf, all, r as i32)?,
            };
            return Ok(wait(req, move |env, b| {
                let mut buf = take(b.send)?;
                if keep {
                    let all = take(b.recv)?;
                    kernels::reduce(dtype, op, &blocks(&all, n, len), buf.as_bytes_mut());
                    env.recycle(Some(all));
                }
                done(buf)
            }));
        }
        // Large: chunk by chunk (so each chunk's traffic and reduction stay in cache), rank j
        // reduces slice j of the chunk of every input (in rank order), then the reduced slices
        // are gathered (to every rank, or the root).
        let per = (env.params.chunk / es).max(16 * n);
        large_reduce(env, buf, 0, Chunks { dtype, op, len, root, per })
    };
    Plan { name, header, payload, start: Box::new(start), reply }
}

/// A large exact all_reduce / reduce, processed `per` elements at a time.
#[derive(Clone, Copy)]
struct Chunks {
    dtype: DType,
    op: ReduceOp,
    len: usize,
    root: Option<usize>,
    per: usize,
}

/// Chunk `[off, off + per)` of a large exact reduction, then the next one.
fn large_reduce(env: &Env<'_>, buf: HostBuffer, off: usize, c: Chunks) -> Result<Step, CommError> {
    let (me, n, dtype) = (env.rank, env.size, c.dtype);
    let clen = c.per.min(c.len - off);
    let parts: Vec<(usize, usize)> = (0..n)
        .map(|j| {
            let (lo, l) = slice_of(clen, n, j);
            (off + lo, l)
        })
        .collect();
    let mine = parts[me].1;
    let recv_parts: Vec<(usize, usize)> = (0..n).map(|i| (i * mine, mine)).collect();
    let req = raw::ialltoallv(env.comm, buf, &parts, env.buffer(dtype, n * mine), &recv_parts)?;
    Ok(wait(req, move |env, b| {
        let (buf, slices) = (take(b.send)?, take(b.recv)?);
        let mut reduced = env.buffer(dtype, mine);
        kernels::reduce(dtype, c.op, &blocks(&slices, n, mine), reduced.as_bytes_mut());
        env.recycle(Some(slices));
        let next = move |env: &Env<'_>, buf: HostBuffer| {
            if off + clen < c.len {
                large_reduce(env, buf, off + clen, c)
            } else {
                done(buf)
            }
        };
        match c.root {
            None => {
                let req = raw::iallgatherv(env.comm, reduced, buf, &parts)?;
                Ok(wait(req, move |env, b| {
                    env.recycle(b.send);
                    next(env, take(b.recv)?)
                }))
            }
            Some(r) if r == me => {
                let req = raw::igatherv(env.comm, reduced, Some(buf), &parts, r as i32)?;
                Ok(wait(req, move |env, b| {
                    env.recycle(b.send);
                    next(env, take(b.recv)?)
                }))
            }
            Some(r) => {
                // Non-roots keep their input: send the slice, keep `buf` as it is.
                let req = raw::igatherv(env.comm, reduced, None, &parts, r as i32)?;
                Ok(wait(req, move |env, b| {
                    env.recycle(b.send);
                    next(env, buf)
                }))
            }
        }
    }))
}

fn plan_reduce_scatter(r: ReduceScatter, reply: Reply) -> Plan {
    let (dtype, len, op) = (r.input.dtype(), r.input.len(), r.op);
    let header = Header::new(OP_REDUCE_SCATTER, Some(dtype), len, None, Some(op));
    let start = move |env: &Env<'_>, _: Option<&Exchange>| -> Result<Step, CommError> {
        let n = env.size;
        let block = len / n;
        let out = r.output.unwrap_or_else(|| env.buffer(dtype, block));
        if !local_reduction(env.params, dtype) {
            let req = raw::ireduce_scatter_block(env.comm, r.input, out, mpi_op(env, dtype, op)?)?;
            return Ok(wait(req, move |env, b| {
                env.recycle(b.send);
                let mut out = take(b.recv)?;
                if op == ReduceOp::Avg {
                    kernels::divide(&mut out, n);
                }
                done(out)
            }));
        }
        if block == 0 {
            return done(out);
        }
        // Block j of every input to rank j, which reduces them in rank order; chunk by chunk.
        let per = (env.params.chunk / n / dtype.size()).max(16);
        scatter_reduce(env, r.input, out, 0, Chunks { dtype, op, len: block, root: None, per })
    };
    Plan { name: "reduce_scatter", header, payload: None, start: Box::new(start), reply }
}

/// Chunk `[off, off + per)` of every block of a large exact reduce_scatter into `out`, then
/// the next one.
fn scatter_reduce(env: &Env<'_>, input: HostBuffer, out: HostBuffer, off: usize, c: Chunks) -> Result<Step, CommError> {
    let (n, dtype, es) = (env.size, c.dtype, c.dtype.size());
    let clen = c.per.min(c.len - off);
    let send_parts: Vec<(usize, usize)> = (0..n).map(|j| (j * c.len + off, clen)).collect();
    let recv_parts: Vec<(usize, usize)> = (0..n).map(|i| (i * clen, clen)).collect();
    let req = raw::ialltoallv(env.comm, input, &send_parts, env.buffer(dtype, n * clen), &recv_parts)?;
    Ok(wait(req, move |env, b| {
        let (input, mine) = (take(b.send)?, take(b.recv)?);
        let mut out = out;
        kernels::reduce(dtype, c.op, &blocks(&mine, n, clen), &mut out.as_bytes_mut()[off * es..(off + clen) * es]);
        env.recycle(Some(mine));
        if off + clen < c.len {
            return scatter_reduce(env, input, out, off + clen, c);
        }
        env.recycle(Some(input));
        done(out)
    }))
}

fn plan_all_to_all(r: AllToAll, reply: Reply) -> Plan {
    let dtype = r.input.dtype();
    let header = Header::new(OP_ALL_TO_ALL, Some(dtype), 0, None, None);
    let start = move |env: &Env<'_>, _: Option<&Exchange>| -> Result<Step, CommError> {
        let n = env.size;
        let (ins, outs) = r.splits(n as u32);
        let offsets = |v: &[usize]| -> Vec<(usize, usize)> {
            v.iter().scan(0, |at, &c| Some((std::mem::replace(at, *at + c), c))).collect()
        };
        let (send_parts, recv_parts) = (offsets(&ins), offsets(&outs));
        let out = r.output.unwrap_or_else(|| env.buffer(dtype, outs.iter().sum()));
        let input = r.input;
        let exchange = move |env: &Env<'_>| -> Result<Step, CommError> {
            let req = raw::ialltoallv(env.comm, input, &send_parts, out, &recv_parts)?;
            Ok(wait(req, |env, b| {
                env.recycle(b.send);
                done(take(b.recv)?)
            }))
        };
        if !env.params.check || n == 1 {
            return exchange(env);
        }
        // Every rank publishes what it sends to and expects from each peer; all ranks check
        // every pair, so they agree on the verdict.
        let row: Vec<i64> = ins.iter().chain(&outs).map(|&c| c as i64).collect();
        let req = raw::iallgather(env.comm, HostBuffer::from_slice(&row), HostBuffer::zeroed(DType::I64, 2 * n * n))?;
        Ok(wait(req, move |env, b| {
            let all = take(b.recv)?;
            let m = all.as_slice::<i64>()?;
            for i in 0..n {
                for j in 0..n {
                    let (sends, expects) = (m[i * 2 * n + j], m[j * 2 * n + n + i]);
                    if sends != expects {
                        return Err(CommError::Mismatch {
                            op: "all_to_all",
                            detail: format!(
                                "rank {i} sends {sends} elements to rank {j}, but rank {j}'s output splits expect {expects} from rank {i}"
                            ),
                        });
                    }
                }
            }
            exchange(env)
        }))
    };
    Plan { name: "all_to_all", header, payload: None, start: Box::new(start), reply }
}

/// The plan of a collective command.
fn plan(cmd: Cmd) -> Plan {
    match cmd {
        Cmd::AllReduce(r, d) => plan_reduce(r.buf, r.op, None, Reply::Buf(d)),
        Cmd::Reduce(r, d) => plan_reduce(r.buf, r.op, Some(r.root), Reply::Buf(d)),
        Cmd::ReduceScatter(r, d) => plan_reduce_scatter(r, Reply::Buf(d)),
        Cmd::AllToAll(r, d) => plan_all_to_all(r, Reply::Buf(d)),
        Cmd::Broadcast(r, d) => {
            let header = Header::new(OP_BROADCAST, Some(r.buf.dtype()), r.buf.len(), Some(r.root), None);
            let payload = inline(r.buf.byte_len(), || r.buf.as_bytes().to_vec());
            let start = move |env: &Env<'_>, ex: Option<&Exchange>| -> Result<Step, CommError> {
                let mut buf = r.buf;
                if let Some(ex) = ex {
                    let bytes = buf.byte_len();
                    buf.as_bytes_mut().copy_from_slice(ex.data(r.root as usize, bytes));
                    return done(buf);
                }
                let req = raw::ibcast(env.comm, buf, r.root as i32)?;
                Ok(wait(req, |_, b| done(take(b.recv)?)))
            };
            Plan { name: "broadcast", header, payload, start: Box::new(start), reply: Reply::Buf(d) }
        }
        Cmd::AllGather(r, d) => {
            let (dtype, len) = (r.input.dtype(), r.input.len());
            let header = Header::new(OP_ALL_GATHER, Some(dtype), len, None, None);
            let payload = inline(r.input.byte_len(), || r.input.as_bytes().to_vec());
            let start = move |env: &Env<'_>, ex: Option<&Exchange>| -> Result<Step, CommError> {
                let mut out = r.output.unwrap_or_else(|| env.buffer(dtype, len * env.size));
                if let Some(ex) = ex {
                    let b = r.input.byte_len();
                    for p in 0..env.size {
                        out.as_bytes_mut()[p * b..(p + 1) * b].copy_from_slice(ex.data(p, b));
                    }
                    return done(out);
                }
                let req = raw::iallgather(env.comm, r.input, out)?;
                Ok(wait(req, |env, b| {
                    env.recycle(b.send);
                    done(take(b.recv)?)
                }))
            };
            Plan { name: "all_gather", header, payload, start: Box::new(start), reply: Reply::Buf(d) }
        }
        Cmd::Scatter(r, d) => {
            let header = Header::new(OP_SCATTER, Some(r.output.dtype()), r.output.len(), Some(r.root), None);
            let start = move |env: &Env<'_>, _: Option<&Exchange>| -> Result<Step, CommError> {
                let input = r.input.filter(|_| env.rank == r.root as usize);
                let req = raw::iscatter(env.comm, input, r.output, r.root as i32)?;
                Ok(wait(req, |env, b| {
                    env.recycle(b.send);
                    done(take(b.recv)?)
                }))
            };
            Plan { name: "scatter", header, payload: None, start: Box::new(start), reply: Reply::Buf(d) }
        }
        Cmd::Gather(r, d) => {
            let (dtype, len) = (r.input.dtype(), r.input.len());
            let header = Header::new(OP_GATHER, Some(dtype), len, Some(r.root), None);
            let start = move |env: &Env<'_>, _: Option<&Exchange>| -> Result<Step, CommError> {
                let is_root = env.rank == r.root as usize;
                let out = is_root.then(|| r.output.unwrap_or_else(|| env.buffer(dtype, len * env.size)));
                let req = raw::igather(env.comm, r.input, out, r.root as i32)?;
                Ok(wait(req, move |env, b| {
                    if !is_root {
                        return done(take(b.send)?);
                    }
                    env.recycle(b.send);
                    done(take(b.recv)?)
                }))
            };
            Plan { name: "gather", header, payload: None, start: Box::new(start), reply: Reply::Buf(d) }
        }
        Cmd::Barrier(d) => {
            let start = |env: &Env<'_>, _: Option<&Exchange>| -> Result<Step, CommError> {
                // With checking on, the header exchange already was a barrier.
                if env.params.check || env.size == 1 {
                    return Ok(Step::Done(Out::Unit));
                }
                Ok(wait(raw::ibarrier(env.comm)?, |_, _| Ok(Step::Done(Out::Unit))))
            };
            Plan {
                name: "barrier",
                header: Header::new(OP_BARRIER, None, 0, None, None),
                payload: None,
                start: Box::new(start),
                reply: Reply::Unit(d),
            }
        }
        Cmd::NewGroup(ranks, d) => {
            let mut header = Header::new(OP_NEW_GROUP, None, ranks.len(), None, None);
            header.extra = hash_ranks(&ranks);
            let start = move |env: &Env<'_>, _: Option<&Exchange>| -> Result<Step, CommError> {
                // Every rank of the parent passed the header exchange, so all of them are
                // about to call the (blocking) split: it cannot hang on a missing rank.
                let key = ranks.iter().position(|&r| r as usize == env.rank).map(|p| p as i32);
                let comm = env.comm.split(key).map_err(raw::MpiError::into_comm)?;
                Ok(Step::Done(Out::Comm(comm)))
            };
            Plan { name: "new_group", header, payload: None, start: Box::new(start), reply: Reply::Group(d) }
        }
        Cmd::Send(..) | Cmd::Recv(..) => unreachable!("point-to-point commands are never planned as collectives"),
    }
}

// ---------------------------------------------------------------------------------------------
// Point-to-point

/// The MPI tag of a user tag: the dtype in the low 3 bits, so a receive only matches a message
/// of its own dtype.
fn mpi_tag(tag: u32, dtype: DType) -> i32 {
    ((tag << 3) | u32::from(dtype.code())) as i32
}

struct P2p {
    recv: bool,
    peer: Rank,
    tag: u32,
    dtype: DType,
    len: usize,
    deadline: Instant,
    req: Request,
    done: Completer<HostBuffer>,
}

impl P2p {
    fn what(&self) -> String {
        let dir = if self.recv { "recv from" } else { "send to" };
        format!("{dir} rank {} (tag {}, {} × {})", self.peer, self.tag, self.dtype, self.len)
    }
}

// ---------------------------------------------------------------------------------------------
// Groups

struct Group {
    info: GroupInfo,
    comm: Comm,
    params: Params,
    poisoned: Option<String>,
    queue: VecDeque<(Cmd, Option<Ticket>)>,
    active: Option<Active>,
    p2p: Vec<P2p>,
    seq: u64,
    closing: bool,
    waiters: Vec<Completer<()>>,
}

impl Drop for Group {
    fn drop(&mut self) {
        // Callers stop using the communicator (waiting for a direct op that runs) before it
        // is freed with the group.
        if let Some(lane) = &self.info.lane {
            lane.lock().comm = None;
        }
    }
}

impl Group {
    fn idle(&self) -> bool {
        self.active.is_none() && self.queue.is_empty() && self.p2p.is_empty()
    }

    fn env<'a>(&'a self, half: Option<&'a raw::HalfOps>, pool: &'a Pool) -> Env<'a> {
        Env {
            comm: &self.comm,
            rank: self.info.rank as usize,
            size: self.info.size as usize,
            params: &self.params,
            half,
            pool,
        }
    }

    fn poison_error(&self) -> Option<CommError> {
        self.poisoned.as_ref().map(|cause| CommError::Poisoned { cause: cause.clone() })
    }

    /// Marks the group unusable and fails everything queued or in flight; requests still in
    /// flight go to the graveyard (their buffers stay with MPI).
    fn poison(&mut self, e: &CommError, graveyard: &mut Vec<Request>) {
        if self.poisoned.is_some() {
            return;
        }
        let cause = e.to_string();
        tracing::warn!(group = self.info.gid, rank = self.info.rank, "comm mpi: group poisoned: {cause}");
        *self.info.poison.lock().unwrap_or_else(|p| p.into_inner()) = Some(cause.clone());
        self.poisoned = Some(cause.clone());
        let err = || CommError::Poisoned { cause: cause.clone() };
        if let Some(a) = self.active.take() {
            a.reply.fail(err());
            bury(a.req, graveyard);
        }
        for mut p in self.p2p.drain(..) {
            if p.recv {
                p.req.cancel();
            }
            p.done.complete(Err(err()));
            bury(p.req, graveyard);
        }
        for (cmd, _) in self.queue.drain(..) {
            cmd.fail(err());
        }
    }
}

/// Keeps an unfinished request (and its buffers) until MPI completes it, if ever.
fn bury(req: Request, graveyard: &mut Vec<Request>) {
    if !req.is_done() {
        graveyard.push(req);
    }
}

// ---------------------------------------------------------------------------------------------
// The actor

/// Facts about the world fixed at initialisation.
struct World {
    rank: i32,
    local_rank: i32,
    local_size: i32,
    tag_max: u32,
    /// Why world groups cannot be created (the launcher and MPI disagree).
    refuse: Option<String>,
}

struct Ending {
    deadline: Instant,
    waiters: Vec<Completer<()>>,
}

pub(crate) struct Actor {
    rx: Receiver<Msg>,
    universe: Option<mpi::environment::Universe>,
    world: World,
    groups: BTreeMap<Gid, Group>,
    next_gid: Gid,
    dups: Vec<(PendingDup, Params, Completer<GroupInfo>, Instant)>,
    graveyard: Vec<Request>,
    half: Option<raw::HalfOps>,
    pool: Pool,
    ending: Option<Ending>,
    last_progress: Instant,
    spin: Duration,
    /// MPI provides `MPI_THREAD_MULTIPLE`: groups get a lane for direct ops.
    multiple: bool,
}

/// How long the actor waits for ops still running when the process exits.
pub(crate) const EXIT_GRACE: Duration = Duration::from_secs(30);

impl Actor {
    /// Initialises MPI on this (the actor's) thread. `Err` when it cannot.
    pub(crate) fn start(rx: Receiver<Msg>) -> Result<Actor, (Receiver<Msg>, String)> {
        let Some((universe, provided)) = mpi::initialize_with_threading(mpi::Threading::Multiple) else {
            return Err((rx, "MPI was already initialised (or finalised) in this process by other code; the mpi backend must be the one to initialise it".into()));
        };
        let fail = |e: raw::MpiError| e.to_string();
        let setup = || -> Result<World, String> {
            raw::world_errors_return().map_err(fail)?;
            let (rank, size) = raw::world_rank_size().map_err(fail)?;
            let (local_rank, local_size) = raw::node_rank_size().map_err(fail)?;
            let tag_max = (raw::tag_ub().max(0) as u32) >> 3;
            Ok(World { rank, local_rank, local_size, tag_max, refuse: launcher_disagrees(size) })
        };
        let world = match setup() {
            Ok(w) => w,
            Err(e) => {
                // Leave MPI initialised (finalising now could hang on peers); the job fails.
                std::mem::forget(universe);
                return Err((rx, format!("setting up MPI failed: {e}")));
            }
        };
        if provided < mpi::Threading::Multiple {
            tracing::debug!("comm mpi: MPI provides {provided:?} threading; only the actor thread calls MPI");
        }
        global::mpi_started(world.rank);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let spin = if world.local_size as usize > cores { Duration::ZERO } else { Duration::from_micros(50) };
        Ok(Actor {
            rx,
            universe: Some(universe),
            world,
            groups: BTreeMap::new(),
            next_gid: 0,
            dups: Vec::new(),
            graveyard: Vec::new(),
            half: None,
            pool: Pool::default(),
            ending: None,
            last_progress: Instant::now(),
            spin,
            multiple: provided >= mpi::Threading::Multiple,
        })
    }

    pub(crate) fn run(mut self) {
        let mut panics = 0;
        loop {
            // A panic here (with `abort_on_panic` off; on, the hook ends the job first) is
            // contained: every group is poisoned with its message, so pending and later ops
            // fail and shutdown completes. A second one ends the actor as at finalisation.
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.turn())) {
                Ok(true) => break,
                Ok(false) => {}
                Err(payload) => {
                    panics += 1;
                    self.contain_panic(&comm_core::panic_message(&*payload));
                    if panics > 1 {
                        break;
                    }
                }
            }
        }
        self.finish();
    }

    /// One turn of the loop; whether the actor is done.
    fn turn(&mut self) -> bool {
        let mut progressed = self.drain();
        progressed |= self.progress();
        self.reap();
        if self.ending.as_ref().is_some_and(|e| {
            self.groups.values().all(Group::idle) && self.dups.is_empty() || Instant::now() >= e.deadline
        }) {
            return true;
        }
        if progressed {
            self.last_progress = Instant::now();
        } else {
            self.idle();
        }
        false
    }

    fn contain_panic(&mut self, message: &str) {
        let e = CommError::Backend {
            backend: "mpi",
            source: format!("the MPI actor of rank {} panicked: {message}", self.world.rank).into(),
        };
        for g in self.groups.values_mut() {
            g.poison(&e, &mut self.graveyard);
        }
    }

    fn drain(&mut self) -> bool {
        let mut any = false;
        loop {
            match self.rx.try_recv() {
                Ok(m) => {
                    any = true;
                    self.accept(m);
                }
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => return any,
            }
        }
    }

    /// Nothing progressed. Right after progress: poll again at once (spin). While a collective
    /// is in flight every rank is (or should be) in it and MPI only progresses inside our
    /// polls: keep polling, yielding the core between polls. With only point-to-point ops in
    /// flight (a peer may be busy computing for long) the same for a second, then poll every
    /// 200 µs. With nothing in flight: sleep until a message arrives.
    fn idle(&mut self) {
        let quiet = self.last_progress.elapsed();
        if quiet < self.spin {
            std::hint::spin_loop();
            return;
        }
        let collective = !self.dups.is_empty() || self.groups.values().any(|g| g.active.is_some());
        let p2p = self.groups.values().any(|g| !g.p2p.is_empty());
        let wait = if collective || (p2p && quiet < Duration::from_secs(1)) {
            std::thread::yield_now();
            return;
        } else if p2p {
            Duration::from_micros(200)
        } else {
            Duration::from_millis(100)
        };
        match self.rx.recv_timeout(wait) {
            Ok(m) => {
                self.last_progress = Instant::now();
                self.accept(m);
            }
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {}
        }
    }

    fn accept(&mut self, m: Msg) {
        match m {
            Msg::Op(gid, cmd, ticket) => {
                if self.ending.is_some() {
                    return cmd.fail(CommError::Shutdown("MPI is being finalised".into()));
                }
                let Some(g) = self.groups.get_mut(&gid) else {
                    return cmd.fail(CommError::Shutdown("the group was shut down".into()));
                };
                if g.closing {
                    return cmd.fail(CommError::Shutdown(String::new()));
                }
                if let Some(e) = g.poison_error() {
                    return cmd.fail(e);
                }
                match cmd {
                    Cmd::Send(req, done) => self.start_p2p(gid, false, req.buf, req.dst, req.tag, done),
                    Cmd::Recv(req, done) => self.start_p2p(gid, true, req.buf, req.src, req.tag, done),
                    other => g.queue.push_back((other, ticket)),
                }
            }
            Msg::Adopt(gid, a) => match self.groups.get_mut(&gid) {
                Some(g) if g.active.is_none() && g.poisoned.is_none() => g.active = Some(*a),
                Some(g) => {
                    let e =
                        g.poison_error().unwrap_or_else(|| internal("a direct op was handed over while another ran"));
                    let Active { req, reply, .. } = *a;
                    reply.fail(e);
                    bury(req, &mut self.graveyard);
                }
                None => {
                    let Active { req, reply, .. } = *a;
                    reply.fail(CommError::Shutdown("the group was shut down".into()));
                    std::mem::forget(req);
                }
            },
            Msg::World(params, done) => {
                if self.ending.is_some() {
                    return done.complete(Err(CommError::Shutdown("MPI is being finalised".into())));
                }
                if let Some(why) = &self.world.refuse {
                    return done.complete(Err(CommError::Config(why.clone())));
                }
                if params.reduction == Reduction::Native && self.half.is_none() {
                    match raw::HalfOps::create() {
                        Ok(h) => self.half = Some(h),
                        Err(e) => return done.complete(Err(e.into_comm())),
                    }
                }
                match PendingDup::world() {
                    Ok(p) => {
                        let deadline = Instant::now() + params.timeout;
                        self.dups.push((p, params, done, deadline));
                    }
                    Err(e) => done.complete(Err(e.into_comm())),
                }
            }
            Msg::Shutdown(gid, done) => match self.groups.get_mut(&gid) {
                Some(g) if g.info.world => {
                    let deadline = Instant::now() + g.params.timeout;
                    self.end(deadline, Some(done));
                }
                Some(g) => {
                    g.closing = true;
                    g.waiters.push(done);
                }
                None => done.complete(Ok(())),
            },
            Msg::Release(gid) => {
                if let Some(g) = self.groups.get_mut(&gid) {
                    g.closing = true;
                }
            }
            Msg::Exit => self.end(Instant::now() + EXIT_GRACE, None),
        }
    }

    /// Finish every group's submitted ops (until `deadline`), then finalise MPI.
    fn end(&mut self, deadline: Instant, waiter: Option<Completer<()>>) {
        let e = self.ending.get_or_insert(Ending { deadline, waiters: Vec::new() });
        e.deadline = e.deadline.min(deadline);
        e.waiters.extend(waiter);
        for g in self.groups.values_mut() {
            g.closing = true;
        }
    }

    fn start_p2p(&mut self, gid: Gid, recv: bool, buf: HostBuffer, peer: Rank, tag: u32, done: Completer<HostBuffer>) {
        let Some(g) = self.groups.get_mut(&gid) else { return };
        let (dtype, len) = (buf.dtype(), buf.len());
        let t = mpi_tag(tag, dtype);
        let issued =
            if recv { raw::irecv(&g.comm, buf, peer as i32, t) } else { raw::isend(&g.comm, buf, peer as i32, t) };
        match issued {
            Ok(req) => {
                let deadline = Instant::now() + g.params.timeout;
                g.p2p.push(P2p { recv, peer, tag, dtype, len, deadline, req, done });
            }
            Err(e) => {
                if e.poisons_group() {
                    g.poison(&e, &mut self.graveyard);
                }
                done.complete(Err(e));
            }
        }
    }

    /// Polls everything in flight once; starts queued collectives. Returns whether anything
    /// completed or started.
    fn progress(&mut self) -> bool {
        let mut any = false;
        any |= self.progress_dups();
        let mut born: Born = Vec::new();
        let half = self.half.as_ref();
        let pool = &self.pool;
        let now = Instant::now();
        for (&gid, g) in self.groups.iter_mut() {
            any |= progress_p2p(g, &mut self.graveyard, now);
            loop {
                if g.active.is_none() {
                    let Some((cmd, ticket)) = g.queue.pop_front() else { break };
                    any = true;
                    g.seq += 1;
                    start_collective(g, cmd, ticket, half, pool, &mut self.graveyard, &mut born);
                }
                let Some(a) = g.active.as_mut() else { continue };
                match a.req.test() {
                    Polled::Pending => {
                        if now.duration_since(a.started) >= g.params.timeout {
                            let e = CommError::Timeout {
                                op: a.what.clone(),
                                after: g.params.timeout,
                                detail: format!(
                                    "not every rank of the group of {} joined it: a peer died, hangs, or called another op (MPI cannot tell which; set COMM_TIMEOUT to wait longer)",
                                    g.info.size
                                ),
                            };
                            let a = g.active.take().expect("active checked above");
                            a.reply.fail(e.duplicate());
                            bury(a.req, &mut self.graveyard);
                            g.poison(&e, &mut self.graveyard);
                        }
                        break;
                    }
                    Polled::Failed { err, completed } => {
                        any = true;
                        let a = g.active.take().expect("active checked above");
                        let e = if err.is_truncation() {
                            CommError::Mismatch {
                                op: op_of(&a.what),
                                detail: format!("{}: ranks passed different sizes ({err})", a.what),
                            }
                        } else {
                            err.into_comm()
                        };
                        if !completed {
                            bury(a.req, &mut self.graveyard);
                        }
                        a.reply.fail(e.duplicate());
                        g.poison(&e, &mut self.graveyard);
                        break;
                    }
                    Polled::Done(_) => {
                        any = true;
                        let Active { ticket, what, started, req, cont, reply } =
                            g.active.take().expect("active checked above");
                        let Some(bufs) = req.into_bufs() else {
                            reply.fail(internal("a completed request kept its buffers"));
                            break;
                        };
                        let next = {
                            let env = g.env(half, pool);
                            cont(&env, bufs)
                        };
                        match next {
                            Ok(Step::Wait(req, cont)) => {
                                g.active = Some(Active { ticket, what, started, req, cont, reply })
                            }
                            Ok(Step::Done(out)) => {
                                born.extend(reply.complete(out).map(|(c, d)| (gid, c, d)));
                            }
                            Err(e) => {
                                if e.poisons_group() {
                                    g.poison(&e, &mut self.graveyard);
                                }
                                reply.fail(e);
                            }
                        }
                    }
                }
            }
        }
        for (parent, comm, done) in born {
            let params = self.groups.get(&parent).map(|g| g.params.clone());
            match (comm, params) {
                (Some(comm), Some(params)) => {
                    let info = self.register(comm, params, false);
                    done.complete(Ok(Some(info)));
                }
                _ => done.complete(Ok(None)),
            }
        }
        any
    }

    fn progress_dups(&mut self) -> bool {
        let mut any = false;
        let mut i = 0;
        while i < self.dups.len() {
            let (p, _, _, deadline) = &mut self.dups[i];
            let deadline = *deadline;
            match p.test() {
                Ok(None) if Instant::now() < deadline => {
                    i += 1;
                    continue;
                }
                Ok(None) => {
                    let (p, params, done, _) = self.dups.swap_remove(i);
                    std::mem::forget(p);
                    done.complete(Err(CommError::Timeout {
                        op: "mpi init (MPI_Comm_idup of MPI_COMM_WORLD)".into(),
                        after: params.timeout,
                        detail: "not every rank of MPI_COMM_WORLD called init".into(),
                    }));
                }
                Ok(Some(comm)) => {
                    let (_, params, done, _) = self.dups.swap_remove(i);
                    let info = self.register(comm, params, true);
                    done.complete(Ok(info));
                }
                Err(e) => {
                    let (p, _, done, _) = self.dups.swap_remove(i);
                    std::mem::forget(p);
                    done.complete(Err(e.into_comm()));
                }
            }
            any = true;
        }
        any
    }

    fn register(&mut self, comm: Comm, params: Params, world: bool) -> GroupInfo {
        let gid = self.next_gid;
        self.next_gid += 1;
        if let Some(s) = params.spin {
            self.spin = s;
        }
        // Fault injection targets the actor: its groups keep every op there.
        let lane = (self.multiple && params.panic_at.is_none()).then(|| {
            let state = LaneState { queued: 0, comm: Some(comm.share()), seq: 0, pool: Pool::default() };
            Arc::new(Lane { state: Mutex::new(state), params: params.clone(), spin: self.spin })
        });
        let info = GroupInfo {
            gid,
            rank: comm.rank() as Rank,
            size: comm.size() as u32,
            tag_max: self.world.tag_max,
            poison: Arc::new(Mutex::new(None)),
            world,
            local_rank: self.world.local_rank as Rank,
            local_size: self.world.local_size as u32,
            lane,
        };
        self.groups.insert(
            gid,
            Group {
                info: info.clone(),
                comm,
                params,
                poisoned: None,
                queue: VecDeque::new(),
                active: None,
                p2p: Vec::new(),
                seq: 0,
                closing: false,
                waiters: Vec::new(),
            },
        );
        info
    }

    /// Frees closing groups that have nothing left to do; polls the graveyard.
    fn reap(&mut self) {
        self.graveyard.retain_mut(|r| !matches!(r.test(), Polled::Done(_) | Polled::Failed { completed: true, .. }));
        if self.ending.is_some() {
            return; // groups are freed together in `finish`
        }
        let gone: Vec<Gid> = self.groups.iter().filter(|(_, g)| g.closing && g.idle()).map(|(&k, _)| k).collect();
        for gid in gone {
            if let Some(mut g) = self.groups.remove(&gid) {
                for w in g.waiters.drain(..) {
                    w.complete(Ok(()));
                }
            }
        }
    }

    /// Frees every communicator and finalises MPI, unless requests are still in flight (then
    /// MPI_Finalize could hang or crash: the process leaves MPI as it is, and the launcher ends
    /// the job).
    fn finish(mut self) {
        let clean = self.groups.values().all(Group::idle) && self.dups.is_empty() && self.graveyard.is_empty();
        for g in self.groups.values_mut() {
            let cause = CommError::Shutdown("MPI was finalised before this op finished".into());
            if let Some(a) = g.active.take() {
                a.reply.fail(cause.duplicate());
                bury(a.req, &mut self.graveyard);
            }
            for p in g.p2p.drain(..) {
                p.done.complete(Err(cause.duplicate()));
                bury(p.req, &mut self.graveyard);
            }
            for (cmd, _) in g.queue.drain(..) {
                cmd.fail(cause.duplicate());
            }
        }
        let waiters: Vec<Completer<()>> = self.ending.take().map(|e| e.waiters).unwrap_or_default();
        global::mpi_ending();
        if clean {
            self.groups.clear();
            self.half = None;
            drop(self.universe.take()); // MPI_Finalize
        } else {
            tracing::warn!(
                "comm mpi: {} request(s) never completed; not calling MPI_Finalize (the launcher will end the job)",
                self.graveyard.len() + self.dups.len()
            );
            std::mem::forget(std::mem::take(&mut self.groups));
            std::mem::forget(std::mem::take(&mut self.graveyard));
            std::mem::forget(std::mem::take(&mut self.dups));
            std::mem::forget(self.half.take());
            std::mem::forget(self.universe.take());
        }
        global::mpi_ended(if clean {
            "MPI was finalised in this process (a world group was shut down, or the process is exiting); it cannot be initialised again"
        } else {
            "MPI was left unfinalised after requests that never completed"
        });
        for w in waiters {
            w.complete(Ok(()));
        }
        // Anything that arrives from now on is answered by the global state.
        while let Ok(m) = self.rx.try_recv() {
            reject(m);
        }
    }
}

/// The op name in "all_reduce #3".
fn op_of(what: &str) -> &'static str {
    [
        OP_ALL_REDUCE,
        OP_BROADCAST,
        OP_REDUCE,
        OP_ALL_GATHER,
        OP_REDUCE_SCATTER,
        OP_ALL_TO_ALL,
        OP_SCATTER,
        OP_GATHER,
        OP_BARRIER,
        OP_NEW_GROUP,
    ]
    .into_iter()
    .map(op_name)
    .find(|n| what.split(' ').next() == Some(n))
    .unwrap_or("collective")
}

/// Answers a message that arrived after MPI ended.
pub(crate) fn reject(m: Msg) {
    reject_with(m, "MPI was finalised");
}

/// Answers a message that cannot be served, with `why`.
pub(crate) fn reject_with(m: Msg, why: &str) {
    let e = || CommError::Unavailable { backend: "mpi", why: why.to_owned() };
    match m {
        Msg::Op(_, cmd, _) => cmd.fail(e()),
        Msg::Adopt(_, a) => {
            let Active { req, reply, .. } = *a;
            reply.fail(e());
            std::mem::forget(req);
        }
        Msg::World(_, d) => d.complete(Err(e())),
        Msg::Shutdown(_, d) => d.complete(Ok(())),
        Msg::Release(_) | Msg::Exit => {}
    }
}

/// Starts a group's next collective: the header exchange first (with checking on), else the
/// op itself.
fn start_collective(
    g: &mut Group,
    cmd: Cmd,
    ticket: Option<Ticket>,
    half: Option<&raw::HalfOps>,
    pool: &Pool,
    graveyard: &mut Vec<Request>,
    born: &mut Born,
) {
    let Plan { name, header, payload, start, reply } = plan(cmd);
    if g.params.panic_at == Some(name) {
        panic!("COMM_FAULT_INJECT: injected panic in {name} on rank {}", g.info.rank);
    }
    let what = format!("{name} #{}", g.seq);
    let checked = g.info.size > 1 && (g.params.check || header.op == OP_NEW_GROUP);
    let env = g.env(half, pool);
    let first = if checked {
        exchange(env.comm, env.size, header, payload, start, what.clone()).map(|(req, cont)| Step::Wait(req, cont))
    } else {
        start(&env, None)
    };
    match first {
        Ok(Step::Wait(req, cont)) => {
            g.active = Some(Active { ticket, what, started: Instant::now(), req, cont, reply })
        }
        Ok(Step::Done(out)) => born.extend(reply.complete(out).map(|(c, d)| (g.info.gid, c, d))),
        Err(e) => {
            if e.poisons_group() {
                g.poison(&e, graveyard);
            }
            reply.fail(e);
        }
    }
}

/// Compares every rank's header with rank 0's (so every rank reaches the same verdict).
fn verify(ex: &Exchange, n: usize, mine: &Header, me: usize, what: &str) -> Result<(), CommError> {
    let headers: Vec<Option<Header>> = (0..n).map(|p| ex.header(p)).collect();
    let op = op_name(mine.op);
    let Some(first) = headers[0] else {
        return Err(CommError::Mismatch {
            op,
            detail: format!(
                "{what}: rank 0 sent a header this version does not understand (another program or version?)"
            ),
        });
    };
    for (p, h) in headers.iter().enumerate().skip(1) {
        match h {
            None => {
                return Err(CommError::Mismatch {
                    op,
                    detail: format!(
                        "{what}: rank {p} sent a header this version does not understand (another program or version?)"
                    ),
                })
            }
            Some(h) if *h != first => {
                return Err(CommError::Mismatch {
                    op,
                    detail: format!(
                        "rank {p} called {} but rank 0 called {} (seen by rank {me} at its {what})",
                        h.describe(),
                        first.describe()
                    ),
                })
            }
            Some(_) => {}
        }
    }
    Ok(())
}

fn progress_p2p(g: &mut Group, graveyard: &mut Vec<Request>, now: Instant) -> bool {
    let mut any = false;
    let mut failure: Option<CommError> = None;
    let mut i = 0;
    while i < g.p2p.len() {
        let p = &mut g.p2p[i];
        let result = match p.req.test() {
            Polled::Pending if now < p.deadline => {
                i += 1;
                continue;
            }
            Polled::Pending => Err(p2p_timeout(p, &g.comm, g.params.timeout)),
            Polled::Done(c) => {
                if p.recv && c.count.is_some_and(|n| n != p.len) {
                    Err(CommError::Mismatch {
                        op: "recv",
                        detail: format!(
                            "rank {} sent {} elements of {} with tag {}, but rank {} posted a recv of {} elements",
                            p.peer,
                            c.count.unwrap_or(0),
                            p.dtype,
                            p.tag,
                            g.info.rank,
                            p.len
                        ),
                    })
                } else {
                    Ok(())
                }
            }
            Polled::Failed { err, .. } if p.recv && err.is_truncation() => Err(CommError::Mismatch {
                op: "recv",
                detail: format!(
                    "rank {} sent more than the {} elements of {} rank {} posted a recv for (tag {})",
                    p.peer, p.len, p.dtype, g.info.rank, p.tag
                ),
            }),
            Polled::Failed { err, .. } => Err(err.into_comm()),
        };
        any = true;
        let mut p = g.p2p.swap_remove(i);
        match result {
            Ok(()) => match p.req.into_bufs() {
                Some(b) => p.done.complete(if p.recv { take(b.recv) } else { take(b.send) }),
                None => p.done.complete(Err(internal("a completed request kept its buffers"))),
            },
            Err(e) => {
                if p.recv && !p.req.is_done() {
                    p.req.cancel();
                }
                p.done.complete(Err(e.duplicate()));
                bury(p.req, graveyard);
                failure.get_or_insert(e);
            }
        }
    }
    if let Some(e) = failure {
        g.poison(&e, graveyard);
    }
    any
}

/// The error of a point-to-point op that ran out of time: a mismatch when a message from the
/// peer is waiting with another tag or dtype, else a timeout.
fn p2p_timeout(p: &P2p, comm: &Comm, after: Duration) -> CommError {
    if p.recv {
        if let Some((t, bytes)) = raw::probe(comm, p.peer as i32) {
            let (tag, code) = ((t as u32) >> 3, (t as u32 & 7) as u8);
            if let Some(d) = DType::from_code(code) {
                return CommError::Mismatch {
                    op: "recv",
                    detail: format!(
                        "rank {} sent {} elements of {d} with tag {tag}, but this rank waited {after:?} in a recv of {} elements of {} with tag {}",
                        p.peer,
                        bytes / d.size(),
                        p.len,
                        p.dtype,
                        p.tag
                    ),
                };
            }
        }
    }
    CommError::Timeout {
        op: p.what(),
        after,
        detail: format!(
            "rank {} never posted the matching {} (set COMM_TIMEOUT to wait longer)",
            p.peer,
            if p.recv { "send" } else { "recv" }
        ),
    }
}

/// When the launcher's environment says the job has another number of ranks than
/// MPI_COMM_WORLD: the binary is linked against another MPI than the launcher's (each rank
/// then runs as a singleton).
fn launcher_disagrees(size: i32) -> Option<String> {
    for var in ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"] {
        if let Some(v) = std::env::var(var).ok().and_then(|v| v.trim().parse::<i32>().ok()) {
            if v != size {
                return Some(format!(
                    "the launcher says the job has {v} ranks ({var}={v}) but MPI_COMM_WORLD has {size}: \
                     the program is linked against a different MPI than the launcher that started it \
                     (e.g. an Open MPI build under MPICH's mpiexec runs every rank as a singleton); \
                     launch it with the mpirun of the MPI it was built with"
                ));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exchange_slot_follows_the_group_size() {
        let slots: Vec<usize> = [1, 2, 4, 5, 8, 16, 64, 1000].iter().map(|&n| exchange_slot_bytes(n)).collect();
        assert_eq!(slots, [1024, 1024, 1024, 1024, 1024, 1024, 256, 256]);
        assert_eq!(exchange_slot_bytes(32), 512);
        assert_eq!(inline_max(2), 992);
    }

    #[test]
    fn headers_round_trip_and_describe() {
        let mut h = Header::new(OP_REDUCE, Some(DType::BF16), 7, Some(3), Some(ReduceOp::Max));
        h.extra = 9;
        assert_eq!(Header::decode(&h.encode()), Some(h));
        assert_eq!(h.describe(), "reduce (bf16 × 7, root 3, max)");
        assert_eq!(Header::new(OP_BARRIER, None, 0, None, None).describe(), "barrier");
        assert_eq!(Header::decode(&[1, 2, 3, 4]), None);
        assert_ne!(hash_ranks(&[0, 1]), hash_ranks(&[0, 2]));
    }

    #[test]
    fn slices_partition_and_tags_carry_dtype() {
        for len in [0, 1, 15, 16, 17, 1000, 4099] {
            for parts in 1..=5 {
                let mut next = 0;
                for i in 0..parts {
                    let (lo, n) = slice_of(len, parts, i);
                    assert_eq!(lo, next);
                    next = lo + n;
                }
                assert_eq!(next, len);
            }
        }
        assert_ne!(mpi_tag(5, DType::F32), mpi_tag(5, DType::I32));
        assert_eq!(mpi_tag(5, DType::F64) as u32 >> 3, 5);
        assert_eq!(op_of("all_to_all #3"), "all_to_all");
    }
}
