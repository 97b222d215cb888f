//! The worker: the one thread that initialises MPI, owns every communicator and request, and
//! runs every op as nonblocking steps polled in one loop (see ARCHITECTURE.md, "The MPI backend").

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::Ordering::SeqCst;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use comm_core::cpus::CpuSet;
use comm_core::handle::{self, Poison};
use comm_core::lane::{run_worker, Turn, Worker};
use comm_core::{CommError, Completer, Rank};

use crate::raw::{self, Comm, PendingDup, Polled, Request};
use crate::{global, Reduction};

mod group;
mod header;
mod held;
mod lane;
mod measure;
mod op;
mod p2p;
mod plans;
mod steps;

pub(crate) use comm_core::lane::Ticket;
use group::{start_collective, Group};
pub(crate) use held::Held;
pub(crate) use lane::{submit_direct, Lane};
pub(crate) use measure::GATHER_MIN;
use op::{Job, Queued};
pub(crate) use op::{NewGroup, Pending, Plan};
use p2p::P2p;
pub(crate) use steps::Active;
use steps::{bury, internal, Born, Pool};

/// Identifies a group (communicator) inside the worker.
pub(crate) type Gid = u64;

/// Settings of one group (a world group's are inherited by its sub-groups).
#[derive(Clone, Debug)]
pub struct Params {
    pub(crate) timeout: Duration,
    pub(crate) reduction: Reduction,
    pub(crate) check: bool,
    pub(crate) small_max: usize,
    /// A world group measures `small_max` (`measure::gather_threshold`) when it is created.
    pub(crate) measure: bool,
    pub(crate) chunk: usize,
    pub(crate) spin: Option<Duration>,
    /// Test hook (`COMM_FAULT_INJECT=panic:<op>`): the worker panics when it starts this op.
    pub(crate) panic_at: Option<&'static str>,
}

/// What a handle needs to know about its group.
#[derive(Clone)]
pub struct GroupInfo {
    pub(crate) gid: Gid,
    pub(crate) rank: Rank,
    pub(crate) size: u32,
    /// Largest user tag (`(MPI_TAG_UB >> 3) - 1`, see `MpiBackend::max_tag`).
    pub(crate) tag_max: u32,
    pub(crate) poison: Poison,
    /// Created by `MpiBackend::init` (its shutdown ends MPI for the process).
    pub(crate) world: bool,
    pub(crate) local_rank: Rank,
    pub(crate) local_size: u32,
    /// How long the worker and the lane poll before yielding.
    pub(crate) spin: Duration,
    /// How long a caller waiting for the worker polls before sleeping (`handle::caller_spin`).
    pub(crate) caller_spin: Duration,
    /// Where callers may run small ops themselves (MPI provides `MPI_THREAD_MULTIPLE`).
    pub(crate) lane: Option<Arc<Lane>>,
}

/// A message to the worker.
pub(crate) enum Command {
    /// An op on a group (with its lane ticket when it is a collective).
    Op(Gid, Box<dyn Queued>, Option<Ticket>),
    /// A caller's direct op whose exchange did not complete at once: the worker finishes it.
    Adopt(Gid, Box<Active>),
    /// A caller's direct send or receive that did not complete at once: the worker polls it.
    AdoptP2p(Gid, Box<P2p>),
    /// A new world group (a duplicate of MPI_COMM_WORLD).
    World(Params, Completer<GroupInfo>),
    /// Shut a group down (a world group: end MPI) after its submitted ops.
    Shutdown(Gid, Completer<()>),
    /// The last handle of a group was dropped.
    Release(Gid),
    /// The process is exiting: finish, finalise MPI.
    Exit,
    /// A caller poisoned the group (`abort`): fail what is in flight and tell the peers now.
    Hear(Gid),
}

/// Facts about the world fixed at initialisation.
struct World {
    rank: i32,
    local_rank: i32,
    local_size: i32,
    /// How many threads the node's ranks can run at once (`CpuSet::runnable` of their union).
    node_cpus: usize,
    tag_max: u32,
    /// Why world groups cannot be created (the launcher and MPI disagree).
    refuse: Option<String>,
}

struct Ending {
    deadline: Instant,
    waiters: Vec<Completer<()>>,
}

pub(crate) struct Engine {
    rx: Receiver<Command>,
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

/// Whether no caller runs a direct op on `g` now and none handed one over that the worker has
/// not taken, so its next queued collective may start: such an op was issued before the queued
/// one and must run first. Once the lane was seen free, no caller goes direct before the queue
/// is empty (the queued ops' tickets are counted in the lane).
fn lane_free(g: &Group) -> bool {
    g.info.lane.as_ref().is_none_or(|l| l.lane.try_lock().is_some() && l.handing_over.load(SeqCst) == 0)
}

impl Worker for Engine {
    /// One turn of the loop.
    fn turn(&mut self) -> Turn {
        let mut progressed = false;
        while let Ok(m) = self.rx.try_recv() {
            progressed = true;
            self.accept(m);
        }
        progressed |= self.progress();
        self.reap();
        if self.ending.as_ref().is_some_and(|e| {
            self.groups.values().all(Group::idle) && self.dups.is_empty() || Instant::now() >= e.deadline
        }) {
            return Turn::Done;
        }
        if progressed {
            self.last_progress = Instant::now();
        } else {
            self.idle();
        }
        Turn::Again
    }

    /// A panic (with `abort_on_panic` off) poisons every group, so pending and later ops fail
    /// and shutdown completes; a second one ends the worker.
    fn contain_panic(&mut self, message: &str, nth: u32) -> Turn {
        let e = CommError::Backend {
            backend: "mpi",
            source: format!("the MPI worker of rank {} panicked: {message}", self.world.rank).into(),
        };
        for g in self.groups.values_mut() {
            g.poison(&e, &mut self.graveyard);
        }
        Turn::after_panic(nth)
    }
}

/// The words of the CPU mask the node's ranks exchange at start: 4096 CPUs.
const CPU_WORDS: usize = 64;

/// How long the worker waits for ops still running when the process exits.
pub(crate) const EXIT_GRACE: Duration = Duration::from_secs(30);

impl Engine {
    /// Initialises MPI on this (the worker's) thread. `Err` when it cannot.
    pub(crate) fn start(rx: Receiver<Command>) -> Result<Engine, (Receiver<Command>, String)> {
        let Some((universe, provided)) = mpi::initialize_with_threading(mpi::Threading::Multiple) else {
            return Err((rx, "MPI was already initialised (or finalised) in this process by other code; the mpi backend must be the one to initialise it".into()));
        };
        let fail = |e: raw::MpiError| e.to_string();
        let setup = || -> Result<World, String> {
            raw::world_errors_return().map_err(fail)?;
            let (rank, size) = raw::world_rank_size().map_err(fail)?;
            let mut cpus = [0u64; CPU_WORDS];
            let own = CpuSet::allowed()
                .unwrap_or_else(|| (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect());
            // CPUs past the mask's end count as its last one: a bound rank still counts once.
            for (i, w) in own.words().iter().enumerate() {
                cpus[i.min(CPU_WORDS - 1)] |= w;
            }
            let (local_rank, local_size) = raw::node_rank_size(&mut cpus).map_err(fail)?;
            let node_cpus = CpuSet::from_words(&cpus).runnable();
            // The top block of tags is the header exchange's (`raw::exchange_tag`, `bulk_tag`).
            if raw::tag_ub() % 8 == 0 {
                return Err(format!("MPI_TAG_UB is {}: the backend needs it to be 2^k - 1", raw::tag_ub()));
            }
            let tag_max = ((raw::tag_ub().max(0) as u32) >> 3).saturating_sub(1);
            Ok(World { rank, local_rank, local_size, node_cpus, tag_max, refuse: launcher_disagrees(size) })
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
            tracing::debug!("comm mpi: MPI provides {provided:?} threading; only the worker thread calls MPI");
        }
        global::mpi_started(world.rank);
        let spin = comm_core::handle::default_spin(world.local_size as usize, world.node_cpus);
        Ok(Engine {
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
        run_worker(&mut self);
        self.finish();
    }

    /// The CPUs this rank may call its own: at most this many of its threads spin at once.
    fn cpu_share(&self) -> usize {
        (self.world.node_cpus / (self.world.local_size.max(1) as usize)).max(1)
    }

    /// Nothing progressed: spin, then yield between polls while a collective (or, for a
    /// second, point-to-point) is in flight, as MPI only progresses inside our polls; then
    /// poll point-to-point every 200 µs; with nothing in flight sleep until a message arrives.
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
        if let Ok(m) = self.rx.recv_timeout(wait) {
            self.last_progress = Instant::now();
            self.accept(m);
        }
    }

    fn accept(&mut self, m: Command) {
        match m {
            Command::Op(gid, cmd, ticket) => {
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
                match cmd.job(&g.params, g.info.size as usize) {
                    Job::P2p(post) => match P2p::start(post, &g.comm, g.params.timeout, ticket) {
                        Ok(p) => g.p2p.push(p),
                        Err((done, e)) => {
                            if e.poisons_group() {
                                g.poison(&e, &mut self.graveyard);
                            }
                            done.complete(Err(e));
                        }
                    },
                    Job::Collective(steps) => g.queue.push_back((steps, ticket)),
                }
            }
            Command::Adopt(gid, a) => match self.groups.get_mut(&gid) {
                Some(g) => {
                    if let Some(lane) = &g.info.lane {
                        lane.handing_over.fetch_sub(1, SeqCst);
                    }
                    if g.active.is_none() && g.poisoned.is_none() {
                        g.active = Some(*a);
                        return;
                    }
                    let running = g.active.as_ref().map(|r| r.what.to_string()).unwrap_or_default();
                    let e = g.poison_error().unwrap_or_else(|| {
                        internal(&format!("{} was handed over while {running} ran (group {gid})", a.what))
                    });
                    let Active { req, reply, .. } = *a;
                    reply.fail(e);
                    bury(req, &mut self.graveyard);
                }
                None => refuse(Command::Adopt(gid, a), &|| CommError::Shutdown("the group was shut down".into())),
            },
            Command::Hear(gid) => {
                if let Some(g) = self.groups.get_mut(&gid) {
                    g.hear(Instant::now(), &mut self.graveyard);
                }
            }
            Command::AdoptP2p(gid, p) => match self.groups.get_mut(&gid) {
                Some(g) => match g.poison_error() {
                    None => g.p2p.push(*p),
                    Some(e) => p2p::finish(*p, Err(e), &mut self.graveyard),
                },
                None => refuse(Command::AdoptP2p(gid, p), &|| CommError::Shutdown("the group was shut down".into())),
            },
            Command::World(params, done) => {
                if self.ending.is_some() {
                    return done.complete(Err(CommError::Shutdown("MPI is being finalised".into())));
                }
                if let Some(why) = &self.world.refuse {
                    return done.complete(Err(CommError::Config(why.clone())));
                }
                if params.reduction == Reduction::Native && self.half.is_none() {
                    match raw::HalfOps::new() {
                        Ok(h) => self.half = Some(h),
                        Err(e) => return done.complete(Err(e)),
                    }
                }
                match PendingDup::world() {
                    Ok(p) => {
                        let deadline = Instant::now() + params.timeout;
                        self.dups.push((p, params, done, deadline));
                    }
                    Err(e) => done.complete(Err(e.into())),
                }
            }
            Command::Shutdown(gid, done) => match self.groups.get_mut(&gid) {
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
            Command::Release(gid) => {
                if let Some(g) = self.groups.get_mut(&gid) {
                    g.closing = true;
                }
            }
            Command::Exit => self.end(Instant::now() + EXIT_GRACE, None),
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

    /// Polls everything in flight once and starts queued collectives; whether anything did.
    fn progress(&mut self) -> bool {
        let mut any = false;
        any |= self.progress_dups();
        let mut born: Born = Vec::new();
        let half = self.half.as_ref();
        let pool = &self.pool;
        let now = Instant::now();
        for g in self.groups.values_mut() {
            any |= g.hear(now, &mut self.graveyard);
            any |= g.progress_p2p(&mut self.graveyard, now);
            loop {
                if g.active.is_none() {
                    if g.queue.is_empty() || !lane_free(g) {
                        break;
                    }
                    let Some((steps, ticket)) = g.queue.pop_front() else { break };
                    any = true;
                    g.seq += 1;
                    start_collective(g, steps, ticket, half, pool, &mut self.graveyard, &mut born);
                }
                let Some(a) = g.active.as_mut() else { continue };
                let e = match a.req.test() {
                    Polled::Pending if now.duration_since(a.started) < g.params.timeout => break,
                    Polled::Pending => CommError::timeout(a.what.to_string(), g.params.timeout, format!(
                            "not every rank of the group of {} joined it: a peer died, hangs, or called another op (MPI cannot tell which; set COMM_TIMEOUT to wait longer)",
                            g.info.size
                        )),
                    Polled::Failed { err, .. } => {
                        any = true;
                        a.what.failed(err)
                    }
                    Polled::Done(_) => {
                        any = true;
                        let Active { ticket, what, started, req, cont, reply } =
                            g.active.take().expect("active checked above");
                        let next = req.into_bufs().and_then(|bufs| cont(&g.env(half, pool), bufs));
                        g.next((ticket, what, started, reply), next, &mut self.graveyard, &mut born);
                        continue;
                    }
                };
                let a = g.active.take().expect("active checked above");
                // Marked failed before the op fails (see `Group::hear`).
                g.info.poison.set(e.to_string());
                a.reply.fail(e.duplicate());
                bury(a.req, &mut self.graveyard);
                g.poison(&e, &mut self.graveyard);
                break;
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
            let polled = self.dups[i].0.test();
            if matches!(polled, Ok(None)) && Instant::now() < self.dups[i].3 {
                i += 1;
                continue;
            }
            any = true;
            let (p, mut params, done, _) = self.dups.swap_remove(i);
            let comm = match polled {
                Ok(Some(comm)) => comm,
                failed => {
                    std::mem::forget(p);
                    let e = match failed {
                        Err(e) => e.into(),
                        _ => CommError::timeout(
                            "mpi init (MPI_Comm_idup of MPI_COMM_WORLD)",
                            params.timeout,
                            "not every rank of MPI_COMM_WORLD called init",
                        ),
                    };
                    done.complete(Err(e));
                    continue;
                }
            };
            let measured = (params.measure && comm.size() > 1)
                .then(|| measure::gather_threshold(&comm, params.timeout))
                .transpose();
            match measured {
                Ok(t) => {
                    params.small_max = t.unwrap_or(params.small_max);
                    let info = self.register(comm, params, true);
                    done.complete(Ok(info));
                }
                Err(e) => {
                    // A rank may still be in the measurement: keep the communicator.
                    std::mem::forget(comm);
                    done.complete(Err(e));
                }
            }
        }
        any
    }

    fn register(&mut self, comm: Comm, params: Params, world: bool) -> GroupInfo {
        let gid = self.next_gid;
        self.next_gid += 1;
        if let Some(s) = params.spin {
            self.spin = s;
        }
        let poison = Poison::new();
        // Fault injection targets the worker: its groups keep every op there.
        let lane = (self.multiple && params.panic_at.is_none())
            .then(|| Arc::new(Lane::new(comm.share(), params.clone(), poison.clone(), self.spin, self.cpu_share())));
        let info = GroupInfo {
            gid,
            rank: comm.rank() as Rank,
            size: comm.size() as u32,
            tag_max: self.world.tag_max,
            poison,
            world,
            local_rank: self.world.local_rank as Rank,
            local_size: self.world.local_size as u32,
            spin: self.spin,
            caller_spin: handle::caller_spin(self.spin, self.world.local_size as usize, self.world.node_cpus),
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
                heard_at: Instant::now(),
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
    /// MPI_Finalize could hang or crash: the launcher ends the job).
    fn finish(mut self) {
        let clean = self.groups.values().all(Group::idle) && self.dups.is_empty() && self.graveyard.is_empty();
        for g in self.groups.values_mut() {
            let cause = || CommError::Shutdown("MPI was finalised before this op finished".into());
            g.fail_all(&cause, false, &mut self.graveyard);
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
            reject_with(m, "MPI was finalised");
        }
    }
}

/// Answers a message that cannot be served, with `why`.
pub(crate) fn reject_with(m: Command, why: &str) {
    refuse(m, &|| CommError::Unavailable { backend: "mpi", why: why.to_owned() });
}

/// Answers a message with `e()`; a request handed over stays with MPI.
fn refuse(m: Command, e: &dyn Fn() -> CommError) {
    match m {
        Command::Op(_, cmd, _) => cmd.fail(e()),
        Command::Adopt(_, a) => {
            let Active { req, reply, .. } = *a;
            reply.fail(e());
            std::mem::forget(req);
        }
        Command::AdoptP2p(_, p) => {
            let P2p { req, done, .. } = *p;
            done.complete(Err(e()));
            std::mem::forget(req);
        }
        Command::World(_, d) => d.complete(Err(e())),
        Command::Shutdown(_, d) => d.complete(Ok(())),
        Command::Release(_) | Command::Exit | Command::Hear(_) => {}
    }
}

/// Why world groups cannot be created when the launcher's environment says the job has another
/// number of ranks than MPI_COMM_WORLD (the binary is linked against another MPI).
fn launcher_disagrees(size: i32) -> Option<String> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"].into_iter().find_map(|var| {
        let v = std::env::var(var).ok()?.trim().parse::<i32>().ok().filter(|&v| v != size)?;
        Some(format!(
            "the launcher says the job has {v} ranks ({var}={v}) but MPI_COMM_WORLD has {size}: \
             the program is linked against a different MPI than the launcher that started it \
             (e.g. an Open MPI build under MPICH's mpiexec runs every rank as a singleton); \
             launch it with the mpirun of the MPI it was built with"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::header::*;
    use super::p2p::*;
    use comm_core::{DType, OpKind, ReduceOp};

    #[test]
    fn the_exchange_slot_follows_the_group_size() {
        let slots: Vec<usize> = [1, 2, 4, 5, 8, 16, 64, 1000].iter().map(|&n| exchange_slot_bytes(n)).collect();
        // Up to 8 ranks a slot holds most of a 64 KiB all_reduce input; small ops inline up to
        // 4000 B there (one eager message on shared memory), 992 B in a group of 9..16.
        assert_eq!(slots, [65472, 65472, 65472, 65472, 65472, 1024, 256, 256]);
        assert_eq!(exchange_slot_bytes(32), 512);
        assert_eq!((inline_max(2), inline_max(8), inline_max(16)), (4000, 4000, 992));
        assert_eq!((slot_max(8), slot_max(9)), ((64 << 10) - 96, 992));
        assert!((1..5000).all(|n| inline_max(n) <= slot_max(n)));
        // What a scatter's root may always ship: every group's slot has room for it.
        assert!((1..5000).all(|n| inline_max(n) >= INLINE_ANY));
        assert_eq!(inline_max(1 << 20), INLINE_ANY);
    }

    #[test]
    fn an_all_reduce_input_past_the_slot_sends_its_start_beside() {
        let whole = (64 << 10) - 96;
        // Fits the slot: nothing beside. 64 KiB: one eager-sized message beside, 96 B in the slot.
        assert_eq!((beside_len(whole, 2), beside_len(64 << 10, 2)), (0, whole));
        // Longer than one message and the slot together: the slot stays full.
        assert_eq!(beside_len(1 << 20, 8), (1 << 20) - whole);
        // Large groups' small slots: the whole input beside, only the header in the slot.
        assert_eq!((beside_len(992, 9), beside_len(8 << 10, 9), beside_len(993, 9)), (0, 8 << 10, 993));
        assert_eq!(beside_len(100 << 10, 9), (100 << 10) - 992);
        assert!((1..20).flat_map(|n| (0..300_000).step_by(97).map(move |l| (n, l))).all(|(n, l)| {
            let b = beside_len(l, n);
            b <= l && l - b <= slot_max(n)
        }));
    }

    #[test]
    fn headers_round_trip_and_describe() {
        let mut h = Header::new(OpKind::Reduce, Some(DType::BF16), 7, Some(3), Some(ReduceOp::Max));
        h.extra = 9;
        assert_eq!(Header::decode(&h.encode()), Some(h));
        assert_eq!(h.describe(), "reduce (bf16 × 7, root 3, max)");
        assert_eq!(Header::new(OpKind::Barrier, None, 0, None, None).describe(), "barrier");
        assert_eq!(Header::decode(&[1, 2, 3, 4]), None);
        assert_ne!(hash_ranks(&[0, 1]), hash_ranks(&[0, 2]));
    }

    #[test]
    fn tags_carry_dtype() {
        assert_ne!(mpi_tag(5, DType::F32), mpi_tag(5, DType::I32));
        assert_eq!(mpi_tag(5, DType::F64) as u32 >> 3, 5);
        assert_eq!(OpLabel { name: "all_to_all", seq: 3, direct: false }.to_string(), "all_to_all #3");
        assert_eq!(OpLabel { name: "barrier", seq: 7, direct: true }.to_string(), "barrier (direct #7)");
    }
}
