//! The worker thread of one communicator: it owns the `!Send` NCCL communicator, the CUDA
//! stream, the staging memory and the completion events, takes ops from a channel in
//! submission order, and completes each op's `Work` when the CUDA event recorded after it has
//! fired (so `Work::is_completed` is an atomic load, and nobody but this thread touches CUDA).
//!
//! Timeouts: an op whose event has not fired `timeout` after it was issued aborts the
//! communicator (`ncclCommAbort`, which also stops NCCL kernels waiting for peers) and poisons
//! the group. A call into NCCL that blocks the host (connection setup waiting for a dead peer)
//! is aborted from the watchdog thread instead (see `ffi::CommState`).
//!
//! Here: the requests the worker takes ([`Plan`], [`Prepared`], [`Body`]), bootstrap and the
//! loop. `staging`: [`Cx`], host buffers staged through pooled pinned and device memory.
//! `deadline`: [`Once`] (bootstrap steps bounded by the timeout) and the [`watchdog`].

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use comm_core::handle::Poison;
use comm_core::lane::{run_worker, Turn, Worker};
use comm_core::{CommError, Completer, Op};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use crate::error::{call_error, cuda_error};
use crate::ffi::{self, Call, CallError, Comm, CommState, ID_BYTES};

mod deadline;
mod staging;

pub(crate) use deadline::{watchdog, Once};
use staging::Pool;
pub(crate) use staging::{Cx, Staged};

/// What the handle sends to the worker.
pub(crate) enum Command {
    Op(Box<dyn Queued>),
    Shutdown(Completer<()>),
}

/// An op with its completer, as the worker sees it.
pub(crate) trait Queued: Send {
    fn name(&self) -> &'static str;
    fn p2p(&self) -> bool;
    fn prepare(self: Box<Self>, cx: &mut Cx) -> Prepared;
    fn fail(self: Box<Self>, err: CommError);
}

/// How one op is run: `plan` stages its inputs (uploads are enqueued right away) and returns the
/// calls to make and how to finish. `pub` (with `Cx` and `Prepared`) only so that the backend's
/// generic `Collective` impl may name it: this module is private, so it stays crate-internal.
pub trait Plan: Op + Sized {
    /// Point-to-point ops are batched into one NCCL group with the p2p ops submitted right
    /// after them.
    const P2P: bool = false;
    /// Checks beyond `Op::validate` that need the communicator's CUDA context.
    fn check_device(&self, _ctx: &CudaContext) -> Result<(), CommError> {
        Ok(())
    }
    fn plan(self, cx: &mut Cx, done: Completer<Self::Output>) -> Prepared;
}

pub(crate) struct Pending<R: Plan> {
    pub(crate) req: R,
    pub(crate) done: Completer<R::Output>,
}

impl<R: Plan> Queued for Pending<R> {
    fn name(&self) -> &'static str {
        R::NAME
    }
    fn p2p(&self) -> bool {
        R::P2P
    }
    fn prepare(self: Box<Self>, cx: &mut Cx) -> Prepared {
        let Pending { req, done } = *self;
        req.plan(cx, done)
    }
    fn fail(self: Box<Self>, err: CommError) {
        self.done.complete(Err(err));
    }
}

/// Completes the op: with the staging buffers once its event fired, or with the error.
pub(crate) type Finish = Box<dyn FnOnce(Result<&mut [Staged], CommError>)>;

/// A planned op.
pub struct Prepared {
    pub(crate) finish: Finish,
    pub(crate) body: Result<Body, CommError>,
}

/// The calls of a planned op and the staging memory it uses.
pub(crate) struct Body {
    pub(crate) calls: Vec<Call>,
    /// Wrap this op's calls in `ncclGroupStart/End` (all_to_all, scatter, gather).
    pub(crate) group: bool,
    pub(crate) staged: Vec<Staged>,
}
struct InFlight {
    name: &'static str,
    event: Arc<CudaEvent>,
    issued: Instant,
    finish: Finish,
    staged: Vec<Staged>,
}

/// Settings of one worker.
#[derive(Clone, Debug)]
pub(crate) struct Setup {
    pub(crate) device: usize,
    pub(crate) rank: u32,
    pub(crate) world: u32,
    pub(crate) timeout: Duration,
    pub(crate) linger: Duration,
    pub(crate) pool_limit: usize,
    /// `None`: measured ([`staging::register_min`]).
    pub(crate) register_min: Option<usize>,
    pub(crate) poison: Poison,
}

/// What the worker reports once its device is set up.
pub(crate) struct Ready {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    /// The device's UUID, hex.
    pub(crate) uuid: String,
    /// Rank 0's fresh NCCL unique id.
    pub(crate) id: Option<[u8; ID_BYTES]>,
    /// Host buffers from this size are page-locked instead of copied.
    pub(crate) register_min: usize,
}

/// The request to create the communicator.
pub(crate) type InitRequest = ([u8; ID_BYTES], Once<Arc<CommState>>);

/// Thread body: set up the device, create the communicator when asked, then serve ops.
pub(crate) fn main(setup: Setup, ready: Once<Ready>, init: Receiver<InitRequest>, rx: Receiver<Command>) {
    let ctx = match CudaContext::new(setup.device) {
        Ok(c) => c,
        Err(e) => {
            ready.complete(Err(cuda_error(&format!("cuDevicePrimaryCtxRetain (device {})", setup.device), &e)));
            return;
        }
    };
    let set_up = || -> Result<Ready, CommError> {
        ctx.bind_to_thread().map_err(|e| cuda_error("cuCtxSetCurrent", &e))?;
        let stream = ctx.new_stream().map_err(|e| cuda_error("cuStreamCreate", &e))?;
        let uuid = ctx.uuid().map_err(|e| cuda_error("cuDeviceGetUuid", &e))?;
        let uuid = uuid.bytes.iter().map(|b| format!("{:02x}", *b as u8)).collect();
        let id = if setup.rank == 0 {
            Some(ffi::unique_id().map_err(|c| crate::error::nccl_error(c.code, c.call, c.last))?)
        } else {
            None
        };
        let register_min = setup.register_min.unwrap_or_else(|| staging::register_min(&ctx));
        Ok(Ready { ctx: ctx.clone(), stream, uuid, id, register_min })
    };
    let (stream, register_min) = match set_up() {
        Ok(r) => {
            let kept = (r.stream.clone(), r.register_min);
            if !ready.complete(Ok(r)) {
                return;
            }
            kept
        }
        Err(e) => {
            ready.complete(Err(e));
            return;
        }
    };
    let Ok((id, done)) = init.recv() else { return };
    let comm = match Comm::init(&id, setup.rank, setup.world) {
        Ok(c) => c,
        Err(e) => {
            done.complete(Err(call_error(e, "ncclCommInitRank was aborted")));
            return;
        }
    };
    if !done.complete(Ok(comm.state())) {
        return; // the caller gave up waiting; `comm` is aborted on drop
    }
    let cx = Cx {
        rank: setup.rank,
        world: setup.world,
        ctx,
        stream,
        pool: Pool { dev: HashMap::new(), host: HashMap::new(), kept_dev: 0, kept_host: 0, limit: setup.pool_limit },
        scratch: None,
        register_min,
    };
    Engine {
        cx,
        comm,
        rx,
        stash: None,
        in_flight: VecDeque::new(),
        events: Vec::new(),
        graveyard: Vec::new(),
        setup,
        shutdown: None,
        disconnected: false,
        wait: Wait { idle: 0, spin_until: Instant::now() },
    }
    .run();
}

struct Engine {
    cx: Cx,
    comm: Comm,
    rx: Receiver<Command>,
    /// A command taken while collecting a p2p batch, to run next.
    stash: Option<Command>,
    in_flight: VecDeque<InFlight>,
    /// Fired completion events, reused (creating one per op costs a driver call each way).
    events: Vec<CudaEvent>,
    /// Staging memory of failed ops: the stream may still use it, so it is neither reused nor
    /// freed before the stream drained.
    graveyard: Vec<Vec<Staged>>,
    setup: Setup,
    shutdown: Option<Vec<Completer<()>>>,
    disconnected: bool,
    wait: Wait,
}

/// Most p2p ops batched into one NCCL group.
const MAX_BATCH: usize = 1024;
/// Most fired events kept for reuse.
const MAX_EVENTS: usize = 64;
/// How long after its last progress (an op submitted or completed) the worker polls without
/// giving up its core: about one small op's round trip through the device.
pub(crate) const SPIN: Duration = Duration::from_micros(50);
/// Turns that yield after the spinning, before sleeps (ops still in flight).
const YIELD_TURNS: u32 = 32;

/// The worker's waiting state between progress.
#[derive(Clone, Copy)]
struct Wait {
    /// Turns without progress since the spinning ended.
    idle: u32,
    spin_until: Instant,
}

impl Wait {
    fn progress(&mut self) {
        self.idle = 0;
        self.spin_until = Instant::now() + SPIN;
    }
}

impl Worker for Engine {
    /// One turn of the loop.
    fn turn(&mut self) -> Turn {
        let mut wait = self.wait;
        let turn = self.turn_waiting(&mut wait);
        self.wait = wait;
        turn
    }

    /// A panic is contained: the group is poisoned with its message (the op that panicked
    /// reports `Poisoned`, later ones fail fast) and shutdown still completes; a second one ends
    /// the loop as a shutdown would.
    fn contain_panic(&mut self, message: &str, nth: u32) -> Turn {
        self.poison(format!("backend `nccl`: the worker panicked: {message}"));
        Turn::after_panic(nth)
    }
}

impl Engine {
    fn run(mut self) {
        run_worker(&mut self);
        self.close();
    }

    fn turn_waiting(&mut self, wait: &mut Wait) -> Turn {
        if self.reap() {
            wait.progress();
        }
        if self.in_flight.is_empty() && (self.shutdown.is_some() || self.disconnected) {
            return Turn::Done;
        }
        match self.next(wait) {
            Some(Command::Op(r)) => {
                wait.progress();
                self.handle(r);
            }
            Some(Command::Shutdown(done)) => self.shutdown.get_or_insert_with(Vec::new).push(done),
            None => {}
        }
        Turn::Again
    }

    /// The next command. For [`SPIN`] after the last progress the channel (and, by the loop,
    /// the oldest op's event) is polled without giving up the core: a caller that waits for each
    /// op submits its next one within that, and a small op completes within it. After that,
    /// with ops in flight, a few yields and then sleeps growing from 20 µs to 1 ms; with none,
    /// a blocking receive.
    fn next(&mut self, wait: &mut Wait) -> Option<Command> {
        if let Some(c) = self.stash.take() {
            return Some(c);
        }
        let pause = if Instant::now() < wait.spin_until {
            std::hint::spin_loop();
            None
        } else if self.in_flight.is_empty() {
            if self.disconnected {
                return None;
            }
            return match self.rx.recv() {
                Ok(c) => Some(c),
                Err(_) => {
                    self.disconnected = true;
                    None
                }
            };
        } else {
            wait.idle = wait.idle.saturating_add(1);
            match wait.idle {
                i if i < YIELD_TURNS => {
                    std::thread::yield_now();
                    None
                }
                i => Some(Duration::from_micros(20u64 << (i - YIELD_TURNS).min(6)).min(Duration::from_millis(1))),
            }
        };
        let Some(step) = pause else {
            return match self.rx.try_recv() {
                Ok(c) => Some(c),
                Err(TryRecvError::Empty) => None,
                Err(TryRecvError::Disconnected) => {
                    self.disconnected = true;
                    None
                }
            };
        };
        if self.disconnected {
            std::thread::sleep(step);
            return None;
        }
        match self.rx.recv_timeout(step) {
            Ok(c) => Some(c),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => {
                self.disconnected = true;
                None
            }
        }
    }

    fn poisoned(&self) -> Option<String> {
        self.setup.poison.cause()
    }

    fn poison(&self, cause: String) {
        self.setup.poison.set(cause);
    }

    fn handle(&mut self, req: Box<dyn Queued>) {
        if let Some(cause) = self.poisoned() {
            return req.fail(CommError::Poisoned { cause });
        }
        if self.shutdown.is_some() {
            return req.fail(CommError::Shutdown(String::new()));
        }
        if !req.p2p() {
            return self.launch(vec![req], false);
        }
        // Batch the p2p ops submitted right after this one (batch_isend_irecv, a send followed
        // by its recv): they go into one NCCL group, so a ring exchange cannot deadlock.
        let mut batch = vec![req];
        while batch.len() < MAX_BATCH {
            let next = match self.rx.try_recv() {
                Ok(c) => Some(c),
                Err(TryRecvError::Empty) if !self.setup.linger.is_zero() => {
                    self.rx.recv_timeout(self.setup.linger).ok()
                }
                Err(_) => None,
            };
            match next {
                Some(Command::Op(r)) if r.p2p() => batch.push(r),
                Some(other) => {
                    self.stash = Some(other);
                    break;
                }
                None => break,
            }
        }
        self.launch(batch, true);
    }

    /// Plans, issues and records the completion event of `reqs` (one op, or a p2p batch run as
    /// one NCCL group).
    fn launch(&mut self, reqs: Vec<Box<dyn Queued>>, batch: bool) {
        let mut ops: Vec<(&'static str, Finish, Body)> = Vec::with_capacity(reqs.len());
        let mut failure = None;
        for r in reqs {
            let name = r.name();
            let p = r.prepare(&mut self.cx);
            match p.body {
                Ok(b) => ops.push((name, p.finish, b)),
                Err(e) => {
                    if e.poisons_group() && failure.is_none() {
                        failure = Some(e.to_string());
                    }
                    (p.finish)(Err(e));
                }
            }
        }
        if let Some(cause) = failure {
            // Staging failed (out of memory...): the peers would wait for this rank forever.
            self.poison(cause.clone());
            return self.fail_ops(ops, |_| CommError::Poisoned { cause: cause.clone() });
        }
        if ops.is_empty() {
            return;
        }
        let name = if batch { "p2p batch" } else { ops[0].0 };
        let issued = {
            let (comm, stream) = (&self.comm, &self.cx.stream);
            let issue_all = |ops: &[(&'static str, Finish, Body)]| -> Result<(), CallError> {
                for (_, _, b) in ops {
                    for c in &b.calls {
                        comm.issue(stream, c)?;
                    }
                }
                Ok(())
            };
            if batch || ops[0].2.group {
                comm.group(|| issue_all(&ops))
            } else {
                issue_all(&ops)
            }
        };
        let downloaded = issued.and_then(|()| {
            for (_, _, b) in &mut ops {
                for s in &mut b.staged {
                    s.download(&self.cx.stream)?;
                }
            }
            Ok(())
        });
        let event = downloaded.map_err(|e| self.call_failure(e, name)).and_then(|()| {
            let ev = match self.events.pop() {
                Some(ev) => ev,
                None => self.cx.ctx.new_event(None).map_err(|e| cuda_error("cuEventCreate", &e))?,
            };
            ev.record(&self.cx.stream).map_err(|e| cuda_error("cuEventRecord", &e))?;
            Ok(Arc::new(ev))
        });
        match event {
            Ok(event) => {
                let issued = Instant::now();
                for (name, finish, b) in ops {
                    self.in_flight.push_back(InFlight { name, event: event.clone(), issued, finish, staged: b.staged });
                }
            }
            Err(e) => {
                self.poison(e.to_string());
                let first = std::cell::Cell::new(Some(e));
                let cause = self.poisoned().unwrap_or_default();
                self.fail_ops(ops, |_| first.take().unwrap_or_else(|| CommError::Poisoned { cause: cause.clone() }));
            }
        }
    }

    /// The error of a failed call; a call refused because the watchdog aborted the
    /// communicator is a timeout.
    fn call_failure(&self, e: CallError, what: &str) -> CommError {
        if self.comm.state().is_gone() {
            return CommError::timeout(what, self.setup.timeout, format!(
                    "a call into NCCL blocked for longer than the timeout (a peer is gone?); the watchdog aborted the communicator of rank {} of {} and the group is poisoned",
                    self.setup.rank, self.setup.world
                ));
        }
        call_error(e, "the NCCL communicator was aborted")
    }

    fn fail_ops(&mut self, ops: Vec<(&'static str, Finish, Body)>, mut err: impl FnMut(usize) -> CommError) {
        for (i, (_, finish, body)) in ops.into_iter().enumerate() {
            finish(Err(err(i)));
            self.graveyard.push(body.staged);
        }
    }

    /// Completes the ops whose events fired (in order: one stream), and times out the oldest
    /// when it is overdue. Returns whether anything completed.
    fn reap(&mut self) -> bool {
        let mut progress = false;
        while let Some(front) = self.in_flight.front() {
            match front.event.try_is_complete() {
                Ok(true) => {
                    let mut f = self.in_flight.pop_front().expect("front exists");
                    (f.finish)(Ok(&mut f.staged));
                    self.cx.pool.recycle(f.staged);
                    // The last op of a batch gives the (fired) event back for reuse.
                    if let Ok(ev) = Arc::try_unwrap(f.event) {
                        if self.events.len() < MAX_EVENTS {
                            self.events.push(ev);
                        }
                    }
                    progress = true;
                }
                Ok(false) if self.comm.state().is_gone() => {
                    let e = self.call_failure(CallError::Aborted, front.name);
                    self.abort_all(e);
                    break;
                }
                Ok(false) => {
                    if front.issued.elapsed() > self.setup.timeout {
                        let e = CommError::timeout(front.name, self.setup.timeout, format!(
                                "rank {} of {} (CUDA device {}): the op did not complete (a peer never joined it, or died); the NCCL communicator was aborted (ncclCommAbort) and the group is poisoned",
                                self.setup.rank, self.setup.world, self.setup.device
                            ));
                        self.abort_all(e);
                    }
                    break;
                }
                Err(e) => {
                    let e = cuda_error("cuEventQuery", &e);
                    self.abort_all(e);
                    break;
                }
            }
        }
        progress
    }

    /// Aborts the communicator, poisons the group and fails every op in flight (the oldest
    /// with `err`, the others as poisoned).
    fn abort_all(&mut self, err: CommError) {
        let cause = err.to_string();
        self.poison(cause.clone());
        let _ = self.comm.close(false);
        tracing::error!(rank = self.setup.rank, error = %cause, "nccl: communicator aborted");
        let mut first = Some(err);
        while let Some(f) = self.in_flight.pop_front() {
            let e = first.take().unwrap_or_else(|| CommError::Poisoned { cause: cause.clone() });
            (f.finish)(Err(e));
            self.graveyard.push(f.staged);
        }
    }

    fn close(mut self) {
        let healthy = self.poisoned().is_none();
        if let Err(e) = self.comm.close(healthy) {
            tracing::warn!(rank = self.setup.rank, error = %call_error(e, ""), "nccl: closing the communicator failed");
        }
        if !self.graveyard.is_empty() {
            // Free the staging memory of failed ops only once the stream drained; if it never
            // does (a kernel that ignores the abort), leak it rather than free memory in use.
            let drained =
                self.cx.ctx.new_event(None).ok().filter(|ev| ev.record(&self.cx.stream).is_ok()).is_some_and(|ev| {
                    let deadline = Instant::now() + self.setup.timeout.min(Duration::from_secs(10));
                    loop {
                        match ev.try_is_complete() {
                            Ok(true) => break true,
                            Ok(false) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
                            _ => break false,
                        }
                    }
                });
            let graves = std::mem::take(&mut self.graveyard);
            if drained {
                drop(graves);
            } else {
                tracing::warn!(
                    rank = self.setup.rank,
                    "nccl: the stream did not drain; leaking the staging memory of failed ops"
                );
                std::mem::forget(graves);
            }
        }
        for done in self.shutdown.take().unwrap_or_default() {
            done.complete(Ok(()));
        }
    }
}
