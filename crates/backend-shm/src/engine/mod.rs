//! The worker: one thread per group that owns the mapped segments and runs every op. Steps and
//! mailboxes: ARCHITECTURE.md, "The path of one all_reduce (shm)" (3., 4.) and "Point-to-point".

use std::collections::VecDeque;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use comm_core::handle::Poison;
use comm_core::lane::{self, run_worker, Class, Lane, LaneState, Turn, Worker};
use comm_core::ops::{RecvFrom, SendTo};
use comm_core::{config, CommError, Completer, DType, HostBuffer, InOut, OpKind, ReduceOp};

use crate::layout::*;
use crate::segment::Segment;
use crate::sys::{futex_wait, ProcId};

/// What the handle sends to the worker.
pub(crate) enum Command {
    /// An op, in submission order (see `plans.rs`).
    Op(Box<dyn Queued>),
    /// A small collective the caller could not finish inline.
    OneShot(OneShot, Done),
    Shutdown(Completer<()>),
    /// Poison the group now, with this cause, telling the peers (`Group::abort`).
    Abort(String),
}

/// A queued op, whatever its request type (`plans::Pending`).
pub(crate) trait Queued: Send {
    /// Takes it in: collectives join the collective queue, p2p ops their peer's mailbox queue.
    fn accept(self: Box<Self>, e: &mut Engine);
    /// Runs a collective in its turn: its arrival step ([`OneShot::Arrive`]) unless a caller
    /// ran that already (`arrived`), then its steps.
    fn run(self: Box<Self>, e: &mut Engine, arrived: bool);
    fn fail(self: Box<Self>, err: CommError);
}

/// The completer of a one-step op, by output type.
pub enum Done {
    Buf(Completer<HostBuffer>),
    Io(Completer<InOut>),
    Unit(Completer<()>),
}

impl Done {
    fn complete(self, r: Result<OneShot>) {
        match self {
            Done::Buf(c) => c.complete(r.map(HostBuffer::from_one_shot)),
            Done::Io(c) => c.complete(r.map(InOut::from_one_shot)),
            Done::Unit(c) => c.complete(r.map(drop)),
        }
    }
}

mod collectives;
mod faults;
mod oneshot;
mod p2p;
mod steps;
mod stores;
mod zero_copy;

use oneshot::Parked;
pub(crate) use oneshot::{Inline, OneShot, OneShotOutput, Then};
pub(crate) use steps::{init_segment, publish_abort};

/// What one turn of the worker did.
pub(crate) enum Flow {
    Busy,
    /// Waiting on peers: point-to-point ops in flight.
    Idle,
    /// Nothing in flight.
    Quiet,
    Exit,
}

/// `StepHeader::aux` of a large all_reduce's first step, which says where each rank's buffer
/// is (see `zero_copy`).
const AUX_ZERO_COPY: u64 = 1;
/// `StepHeader::aux` of a queued collective's arrival step ([`OneShot::Arrive`]).
const AUX_ARRIVE: u64 = 2;

fn describe(h: &StepHeader) -> String {
    let dtype = DType::from_code(h.dtype).map(|d| d.name()).unwrap_or("?");
    let kind = OpKind::from_code(h.op);
    let mut s = format!("{} #{} ({dtype} × {}", kind.map_or("unknown op", OpKind::name), h.seq, h.count);
    use OpKind::*;
    if matches!(kind, Some(Broadcast | Reduce | Scatter | Gather)) && h.aux != AUX_ARRIVE {
        s += &format!(", root {}", h.root);
    }
    if matches!(kind, Some(AllReduce | Reduce | ReduceScatter)) {
        if let Some(op) = ReduceOp::ALL.get(h.redop as usize) {
            s += &format!(", {op}");
        }
    }
    if kind == Some(AllReduce) && h.aux == AUX_ZERO_COPY {
        s += ", the step that finds every rank's buffer";
    }
    if h.aux == AUX_ARRIVE {
        s += ", the step that opens an op of several steps";
    }
    s + ")"
}

/// Tunables, identical on every rank of a group (rank 0's are published through the store).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Params {
    pub(crate) timeout: Duration,
    /// How long a waiter spins before it sleeps on its futex (0 when ranks outnumber their CPUs).
    pub(crate) spin: Duration,
    /// The CPUs this rank may call its own (those every rank may run on, per rank, at least
    /// one): at most this many of the process's threads spin at once ([`lane::SpinSlot`]).
    pub(crate) cpus: usize,
    /// Test hook (`COMM_FAULT_INJECT=panic:<op>`): the worker panics when it runs this op.
    pub(crate) panic_at: Option<&'static str>,
    /// [`crate::ShmOptions::stream`] (this rank's own; ranks may differ).
    pub(crate) stream: Option<bool>,
    /// all_reduce, reduce, all_gather, reduce_scatter, all_to_all (its inputs' average),
    /// broadcast, scatter and gather (past one step) of at least this many bytes first learn
    /// where every rank's buffer is and read them in place when all are in arenas (rank 0's
    /// [`crate::ShmOptions::arena_min`]; `usize::MAX`: never, as when some rank has no arena).
    pub(crate) zc_min: usize,
    /// Sends of at least this many bytes from the arena go in place: `zc_min`, but above the
    /// one-step size (smaller ones were not measured faster than the mailbox).
    pub(crate) send_in_place_min: usize,
}

/// Yields `(offset, len)` pieces of `total` elements, `per` at most; one empty piece when
/// `total` is 0 so that empty ops still meet (and are checked) like any other.
fn pieces(total: usize, per: usize) -> impl Iterator<Item = (usize, usize)> {
    let per = per.max(1);
    let n = total.div_ceil(per).max(1);
    (0..n).map(move |i| (i * per, per.min(total - (i * per).min(total))))
}

/// How a step's copies into the window store (see `stores`).
#[derive(Clone, Copy)]
enum Choice {
    /// Plain stores, untimed: where the step writes nothing (or a rank of a `Writes` step that
    /// does not write).
    Plain,
    /// As the op kind's timing says, and timed (waits included).
    Timed,
    /// As the caller chose (and times).
    Given(bool),
    /// Where only some ranks write (broadcast's and scatter's root, gather's other ranks):
    /// as the op kind's writer-timed stores say (`Stores::writes`), timed by the copy alone,
    /// since the writer cannot time its readers. Pass it only on ranks that write.
    Writes,
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

/// A send or receive in its peer's queue, `offset` bytes of it done.
struct Message<R> {
    req: R,
    done: Completer<HostBuffer>,
    offset: usize,
    started: Instant,
}

pub struct Engine {
    rank: usize,
    world: usize,
    lay: Layout,
    segs: Vec<Arc<Segment>>,
    procs: Vec<Option<ProcId>>,
    params: Params,
    rx: Receiver<Command>,
    /// Commands sent but not yet taken from `rx`: an inline op may only run when it is 0.
    pending: Arc<lane::Backlog>,
    parked: Option<Parked>,
    /// Set by the worker when the group is poisoned; the handle reads it to fail fast.
    poison: Poison,
    poisoned: Option<String>,

    step: u64,
    /// Every peer was seen to have published this step (a fact that stays true: steps only
    /// grow), so the next inline op need not read their step counters again.
    all_at: u64,
    seq: u64,
    phase: Phase,
    op: &'static str,
    colls: VecDeque<Command>,
    closing: bool,
    shutdown_waiters: Vec<Completer<()>>,

    sends: Vec<VecDeque<Message<SendTo>>>,
    recvs: Vec<VecDeque<Message<RecvFrom>>>,
    /// Chunks published to each peer.
    sent: Vec<u64>,
    /// Chunks taken from each peer (and acknowledged to it).
    acked: Vec<u64>,
    /// Each peer's acknowledgement of our chunks, as last read from its segment.
    peer_acked: Vec<u64>,
    last_liveness: Instant,
    /// Peers' arena chunks mapped here, by (peer, fd), most recently used last.
    zc_maps: Vec<((usize, i32), Arc<Segment>)>,
    /// A finished one-step op whose caller the worker wakes after releasing the engine lock
    /// (see [`worker`]).
    finished: Option<(Done, Result<OneShot>)>,
    /// Panics contained so far (see [`Engine::contain_panic`]).
    panics: u32,
    /// How large steps write their window, by op kind (index: `OpKind::code`), and one-step
    /// all_reduces apart (the work per byte differs between them).
    stores: Vec<stores::Stores>,
    oneshot_stores: stores::Stores,
    /// Per op kind, as `stores`, timed by the copy alone (`Stores::writes`): for
    /// [`Choice::Writes`], other one-step ops and point-to-point chunks (`OpKind::Send`).
    write_stores: Vec<stores::Stores>,
    /// A one-step all_reduce's window stores and when it started, until its read.
    oneshot_timed: Option<(bool, Instant)>,
}

/// How long an inline caller keeps yielding for late peers after its spin, before it parks.
const INLINE_YIELD: Duration = Duration::from_micros(200);

/// How many peers' arena chunks stay mapped between ops (address space: 64 MiB each).
const ZC_CACHE: usize = 256;

type Result<T, E = CommError> = std::result::Result<T, E>;

impl Engine {
    /// The engine of rank `rank`, in the lane its worker and inline callers share, and the
    /// sender of the worker's commands.
    pub(crate) fn start(
        rank: usize,
        lay: Layout,
        segs: Vec<Arc<Segment>>,
        procs: Vec<Option<ProcId>>,
        params: Params,
    ) -> (Arc<Lane<Engine>>, Sender<Command>) {
        let (world, (tx, rx), pending, poison) = (lay.world, channel(), Arc::<lane::Backlog>::default(), Poison::new());
        let engine = Engine {
            rank,
            world,
            lay,
            segs,
            procs,
            params,
            rx,
            pending: pending.clone(),
            parked: None,
            poison: poison.clone(),
            poisoned: None,
            step: 0,
            all_at: 0,
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
            peer_acked: vec![0; world],
            last_liveness: Instant::now(),
            zc_maps: Vec::new(),
            finished: None,
            panics: 0,
            // Every collective's code is below 16 (others go untimed: `step`).
            stores: (0..16).map(|_| stores::Stores::new(params.stream)).collect(),
            oneshot_stores: stores::Stores::new(params.stream),
            write_stores: (0..16).map(|_| stores::Stores::writes(params.stream)).collect(),
            oneshot_timed: None,
        };
        let wait = lane::CallerWait { spin: params.spin, then_yield: INLINE_YIELD, share: params.cpus };
        (Arc::new(Lane::new(engine, pending, poison, wait)), tx)
    }

    fn p2p_idle(&self) -> bool {
        self.sends.iter().all(VecDeque::is_empty) && self.recvs.iter().all(VecDeque::is_empty)
    }

    fn me(&self) -> &Segment {
        &self.segs[self.rank]
    }

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
        let turn = match self.pump() {
            Ok(false) => self.check_p2p_deadlines().map(|()| false),
            pumped => pumped,
        };
        if let Err(e) = &turn {
            self.poison_with(e);
        }
        if !matches!(turn, Ok(false)) {
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

    /// Whether a collective submitted now could run inline: nothing queued, parked or in
    /// flight.
    pub(crate) fn is_idle(&self) -> bool {
        self.parked.is_none() && self.colls.is_empty() && self.pending.any() == 0 && !self.closing
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

    /// Takes new commands and progresses point-to-point traffic. Returns whether anything
    /// happened.
    fn pump(&mut self) -> Result<bool> {
        let mut progressed = false;
        loop {
            match self.rx.try_recv() {
                Ok(cmd) => {
                    progressed = true;
                    self.pending.done(Class::Collective);
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
        match cmd {
            Command::Op(op) => op.accept(self),
            Command::Abort(cause) => self.poison_with(&CommError::Poisoned { cause }),
            other => self.colls.push_back(other),
        }
    }

    pub(crate) fn queue_collective(&mut self, op: Box<dyn Queued>) {
        self.colls.push_back(Command::Op(op));
    }

    pub(crate) fn queue_send(&mut self, req: SendTo, done: Completer<HostBuffer>) {
        if let Some(e) = self.poison_error() {
            return done.complete(Err(e));
        }
        let dst = req.dst as usize;
        self.sends[dst].push_back(Message { req, done, offset: 0, started: Instant::now() });
    }

    pub(crate) fn queue_recv(&mut self, req: RecvFrom, done: Completer<HostBuffer>) {
        if let Some(e) = self.poison_error() {
            return done.complete(Err(e));
        }
        let src = req.src as usize;
        self.recvs[src].push_back(Message { req, done, offset: 0, started: Instant::now() });
    }

    fn execute(&mut self, cmd: Command) {
        if let Some(e) = self.poison_error() {
            return self.fail(cmd, e);
        }
        self.seq += 1;
        match cmd {
            Command::Op(op) => op.run(self, false),
            Command::Shutdown(d) => {
                self.closing = true;
                self.shutdown_waiters.push(d);
            }
            Command::OneShot(op, d) => self.finished = Some((d, self.run_op(op.name(), |e| e.oneshot(op)))),
            // Taken at once by `accept`, never queued.
            Command::Abort(cause) => self.poison_with(&CommError::Poisoned { cause }),
        }
    }

    pub(crate) fn run_op<T>(&mut self, name: &'static str, f: impl FnOnce(&mut Engine) -> Result<T>) -> Result<T> {
        self.op = name;
        config::injected_panic(self.params.panic_at, name, self.rank);
        let res = f(self);
        self.phase = Phase::Idle;
        res.inspect_err(|e| self.failed(e))
    }
}

impl LaneState for Engine {
    /// A collective: see [`Engine::is_idle`]. A message: nothing still on its way to the
    /// worker (it could be a message to the same peer, which must go first).
    fn is_idle(&self, class: Class, backlog: &lane::Backlog) -> bool {
        match class {
            Class::Collective => Engine::is_idle(self),
            Class::P2p => backlog.any() == 0,
        }
    }

    fn wants_worker(&self) -> bool {
        !Engine::is_idle(self) || !self.p2p_idle()
    }

    fn contain_panic(&mut self, message: &str) {
        self.on_panic(message);
    }
}

/// The worker thread: runs [`Engine::work`] under the lock and sleeps on the doorbell,
/// unlocked, whenever there is nothing to do. `spin`: how long it keeps polling while only
/// point-to-point traffic waits on peers before it sleeps ([`Params::spin`]).
pub(crate) fn worker(lane: Arc<Lane<Engine>>, me: Arc<Segment>, spin: Duration) {
    run_worker(&mut WorkerThread { lane, me, spin, broken: false, quiet_at: None, idle_since: None });
}

/// What the worker thread keeps between turns.
struct WorkerThread {
    lane: Arc<Lane<Engine>>,
    me: Arc<Segment>,
    spin: Duration,
    /// A second panic showed the engine cannot be trusted: turns only drain (see
    /// [`Engine::drain_after_panic`]).
    broken: bool,
    /// The doorbell's value when a turn last found nothing to do: until it rings again, a turn
    /// only tries the lock (16 µs stalls otherwise: ARCHITECTURE.md, "Callers own the lock...").
    quiet_at: Option<u32>,
    /// Since when turns have found point-to-point traffic in flight and nothing to do.
    idle_since: Option<Instant>,
}

/// One pass under the lock; `None` when `wait` is false and a caller holds the engine. Callers
/// are woken after the unlock (ARCHITECTURE.md, "Waking callers unlocked").
fn work(lane: &Lane<Engine>, broken: bool, wait: bool) -> Option<Flow> {
    let mut engine = match lane.try_lock() {
        Some(g) => g,
        None if wait => lane.lock(),
        None => return None,
    };
    let flow = if broken { engine.drain_after_panic() } else { engine.work() };
    let finished = engine.finished.take();
    drop(engine);
    if let Some((done, r)) = finished {
        done.complete(r);
    }
    Some(flow)
}

impl Worker for WorkerThread {
    fn turn(&mut self) -> Turn {
        let bell = self.me.u32_at(OFF_DOORBELL);
        let seen = bell.load(SeqCst);
        let wait = self.quiet_at != Some(seen);
        let wait_for = match work(&self.lane, self.broken, wait) {
            Some(Flow::Exit) => return Turn::Done,
            Some(Flow::Busy) => {
                (self.quiet_at, self.idle_since) = (None, None);
                return Turn::Again;
            }
            Some(Flow::Idle) => {
                self.quiet_at = None;
                // Poll for the next chunk or acknowledgement first (ARCHITECTURE.md, shm step 3).
                if self.idle_since.get_or_insert_with(Instant::now).elapsed() < self.spin {
                    std::thread::yield_now();
                    return Turn::Again;
                }
                SLEEP_PEERS
            }
            Some(Flow::Quiet) => {
                (self.quiet_at, self.idle_since) = (Some(seen), None);
                SLEEP_LOCAL
            }
            None => SLEEP_LOCAL,
        };
        // Announce the sleep, then look once more: a peer that published before seeing the
        // flag is visible now; one that publishes later rings the bell.
        let sleeping = self.me.u32_at(OFF_SLEEPING);
        sleeping.fetch_or(wait_for, SeqCst);
        let flow = work(&self.lane, self.broken, wait_for == SLEEP_PEERS);
        if matches!(flow, Some(Flow::Idle | Flow::Quiet) | None) {
            futex_wait(bell, seen, Duration::from_millis(10));
        }
        sleeping.fetch_and(!wait_for, SeqCst);
        match flow {
            Some(Flow::Exit) => Turn::Done,
            _ => Turn::Again,
        }
    }

    /// A bug, not a peer's fault: contained so this rank fails cleanly (peers told, pending ops
    /// failed, shutdown answered) instead of going half-alive; after a second panic turns only
    /// drain.
    fn contain_panic(&mut self, message: &str, _nth: u32) -> Turn {
        self.me.u32_at(OFF_SLEEPING).store(0, SeqCst);
        self.broken |= !self.lane.lock().on_panic(message);
        (self.quiet_at, self.idle_since) = (None, None);
        Turn::Again
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use comm_core::ops::slice_of;

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
                    let std::ops::Range { start: lo, end: hi } = slice_of(len, parts, i);
                    assert_eq!(lo, next);
                    assert!(hi >= lo);
                    next = hi;
                }
                assert_eq!(next, len);
            }
        }
    }
}
