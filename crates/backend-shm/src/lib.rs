//! Same-host shared-memory backend for comm: one segment per rank (mode 0600, unlinked once
//! every rank mapped it), one worker thread per group, ops in submission order. Results are
//! reduced in rank order (bit-identical on every rank); disagreeing ranks get
//! [`CommError::Mismatch`], lost ones [`CommError::PeerLost`], absent ones
//! [`CommError::Timeout`]. The path of one op: ARCHITECTURE.md, "The path of one all_reduce
//! (shm)".

#![deny(unsafe_code)]

// Mapped memory is touched only in `segment`, `engine::steps`, `engine::zero_copy` and `arena`.
mod arena;
mod engine;
mod layout;
mod plans;
#[allow(unsafe_code)]
mod segment;
mod sys;
mod tuning;

use std::sync::atomic::Ordering::SeqCst;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use comm_core::cpus::CpuSet;
use comm_core::elastic::{self, Elastic, Shrunk};
use comm_core::handle::{self, shutdown_done, Admission, Poison, Subgroups};
use comm_core::lane::{CallerWait, Class, Lane, Ran};
use comm_core::{config, Backend, Collective, CommError, DType, Group, HostBuffer, OpKind, Rank, Store, Work};

use engine::{Command, Engine, Inline, OneShot, OneShotOutput, Params, Queued, Then};
use layout::{
    Layout, MAGIC, OFF_DOORBELL, OFF_MAGIC, OFF_RANK, OFF_SLEEPING, OFF_STATE, OFF_VERSION, OFF_WINDOW, OFF_WORLD,
    STATE_READY, VERSION,
};
use plans::{Limits, Pending, Plan};
use segment::Segment;
use sys::ProcId;

/// Settings of the shm backend. Rank 0's window, slot and threshold are used by every rank.
#[derive(Clone, Debug)]
pub struct ShmOptions {
    /// How long any wait for peers may take before [`CommError::Timeout`].
    pub timeout: Duration,
    /// Bytes per collective buffer (two per rank); larger ops are chunked. Default: a core's
    /// L2 cache (64 KiB..1 MiB).
    pub window: usize,
    /// Bytes per point-to-point mailbox slot (two per peer per rank). `None` (the default): the
    /// window's size while each rank's mailboxes stay within 32 MiB (`tuning::slot`).
    pub p2p_slot: Option<usize>,
    /// all_reduce/reduce up to this many bytes (at most `window`) take one step (and may run
    /// inline); larger ones reduce-scatter and all-gather. `None` (the default): from the L2
    /// size and the rank count (`tuning::small_max`).
    pub small_max: Option<usize>,
    /// Ops of several steps up to this many bytes per rank run on the caller's thread when
    /// the group is idle (0: never). `None` (the default): two windows; larger ones go to the
    /// worker, so a caller overlapping its own work with them is not held up.
    pub inline_max: Option<usize>,
    /// Spin before sleeping; `None`: 50 µs, or 0 when the ranks outnumber their CPUs.
    pub spin: Option<Duration>,
    /// Bind each rank's worker thread to a core of its own. `None` (the default): only where
    /// the group's threads outnumber the CPUs every rank may run on (`tuning::worker_cpu`).
    pub pin: Option<bool>,
    /// Write large steps' windows with streaming (`Some(true)`) or plain stores. `None` (the
    /// default): plain, unless timing shows them several times slower (`engine::stores`).
    pub stream: Option<bool>,
    /// From this many bytes, `HostBuffer`s live in the process's shared-memory arena once a
    /// group exists, and large ops read the peers' buffers there in place (rank 0's value
    /// decides for a group). `None`: no arena. Default 64 KiB.
    pub arena_min: Option<usize>,
    /// Bytes the arena may grow to; past them large buffers are heap memory. Default: the
    /// free space of /dev/shm.
    pub arena_max: usize,
}

impl Default for ShmOptions {
    fn default() -> Self {
        ShmOptions {
            timeout: Duration::from_secs(300),
            window: tuning::window(tuning::l2_bytes()),
            p2p_slot: None,
            small_max: None,
            inline_max: None,
            spin: None,
            pin: None,
            stream: None,
            arena_min: Some(arena::DEFAULT_MIN),
            arena_max: arena::shm_free(),
        }
    }
}

/// Largest `window` and `p2p_slot` (each rank's segment holds two windows and two slots per
/// peer, so larger values only cost `/dev/shm` room).
pub const MAX_WINDOW: usize = 1 << 30;
/// Smallest `window` and `p2p_slot`.
pub const MIN_WINDOW: usize = 4 << 10;

impl ShmOptions {
    /// Defaults, overridden by `COMM_SHM_WINDOW`, `COMM_SHM_SLOT`, `COMM_SHM_SMALL_MAX`,
    /// `COMM_SHM_INLINE_MAX`, `COMM_SHM_ARENA_MIN` (or `off`), `COMM_SHM_ARENA_MAX` (sizes
    /// as [`config::parse_size`] reads them: `512KiB`, `4M`, `65536`), `COMM_SHM_SPIN_US`,
    /// `COMM_SHM_PIN` and `COMM_SHM_STREAM` (`1` or `0`).
    pub fn from_env() -> Result<Self, CommError> {
        let mut o = ShmOptions::default();
        o.window = config::env_parse("COMM_SHM_WINDOW", config::parse_size)?.unwrap_or(o.window);
        o.p2p_slot = config::env_parse("COMM_SHM_SLOT", config::parse_size)?.or(o.p2p_slot);
        o.small_max = config::env_parse("COMM_SHM_SMALL_MAX", config::parse_size)?.or(o.small_max);
        o.inline_max = config::env_parse("COMM_SHM_INLINE_MAX", config::parse_size)?.or(o.inline_max);
        o.spin = config::env_parse("COMM_SHM_SPIN_US", config::parse_micros)?.or(o.spin);
        o.pin = config::env_parse("COMM_SHM_PIN", config::parse_bool)?.or(o.pin);
        o.stream = config::env_parse("COMM_SHM_STREAM", config::parse_bool)?.or(o.stream);
        o.arena_min = match config::env_var("COMM_SHM_ARENA_MIN") {
            Some(v) if v.trim().eq_ignore_ascii_case("off") => None,
            _ => config::env_parse("COMM_SHM_ARENA_MIN", config::parse_size)?.or(o.arena_min).map(|m| m.max(1)),
        };
        o.arena_max = config::env_parse("COMM_SHM_ARENA_MAX", config::parse_size)?.unwrap_or(o.arena_max);
        o.check()?;
        Ok(o)
    }

    /// Whether the sizes are in range ([`MIN_WINDOW`]..=[`MAX_WINDOW`] for the window and
    /// the slot).
    pub fn check(&self) -> Result<(), CommError> {
        let sizes = [("window (COMM_SHM_WINDOW)", Some(self.window)), ("p2p_slot (COMM_SHM_SLOT)", self.p2p_slot)];
        for (what, v) in sizes.into_iter().filter_map(|(what, v)| Some((what, v?))) {
            if !(MIN_WINDOW..=MAX_WINDOW).contains(&v) {
                return Err(CommError::Config(format!(
                    "shm {what} of {v} bytes is out of range: {MIN_WINDOW}..={MAX_WINDOW} bytes (4 KiB to 1 GiB)"
                )));
            }
        }
        Ok(())
    }
}

/// Handle to a shared-memory process group. Cheap to clone; the worker stops when the last
/// clone is dropped (after finishing submitted ops) or on [`Group::shutdown`].
#[derive(Clone)]
pub struct ShmBackend {
    inner: Arc<Inner>,
}

struct Inner {
    admission: Admission,
    tx: Sender<Command>,
    /// The engine, shared by the worker and inline callers; its queue count is the commands
    /// sent to the worker and not yet taken (see `Engine::is_idle`).
    lane: Arc<Lane<Engine>>,
    /// Which ops fit one step.
    limits: Limits,
    /// Largest op of several steps a caller runs inline ([`ShmOptions::inline_max`]).
    inline_max: usize,
    /// The core the worker thread is bound to (see [`ShmOptions::pin`]).
    worker_cpu: Option<usize>,
    me: Arc<Segment>,
    store: Arc<dyn Store>,
    opts: ShmOptions,
    subgroups: Subgroups,
    /// The peers' processes (`None`: this rank, or one whose liveness cannot be told).
    procs: Vec<Option<ProcId>>,
    elastic: Elastic,
}

impl std::fmt::Debug for ShmBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmBackend")
            .field("rank", &self.inner.admission.rank())
            .field("world", &self.inner.admission.world())
            .field("group", &self.inner.subgroups.prefix())
            .finish()
    }
}

/// The value rank `r` publishes under `key` (as text), waited for until `deadline` in slices: if its
/// process (`known[r]`) exits first, or a rank gives up the rendezvous of group `abort`, the
/// wait fails at once instead of at the deadline.
async fn get_from(
    store: &dyn Store,
    key: &str,
    r: Rank,
    known: &[Option<ProcId>],
    deadline: std::time::Instant,
    abort: Option<&str>,
) -> Result<String, CommError> {
    let known = known.get(r as usize).copied().flatten();
    let since = std::time::Instant::now();
    let budget = deadline.saturating_duration_since(since);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let slice = if known.is_some() || abort.is_some() { left.min(Duration::from_millis(20)) } else { left };
        match store.get(key, slice).await {
            Err(CommError::Timeout { .. }) if !left.is_zero() && slice < left => {}
            Err(e) => return Err(e.waited(since, budget)),
            Ok(v) => return Ok(String::from_utf8_lossy(&v).into_owned()),
        }
        if let Some(e) = match abort {
            Some(prefix) => ShmBackend::gave_up(store, prefix).await,
            None => None,
        } {
            return Err(e);
        }
        if let Some(p) = known.filter(|p| p.alive() == Some(false)) {
            return Err(CommError::peer_lost(r, format!("its process {} exited during the rendezvous", p.pid)));
        }
    }
}

impl ShmBackend {
    /// How long this group's waits spin before they sleep: [`ShmOptions::spin`], or what
    /// start-up chose from the CPUs the ranks may run on together.
    pub fn spin(&self) -> Duration {
        self.inner.lane.wait().spin
    }

    /// The CPU this group's worker thread is bound to, if any (see [`ShmOptions::pin`]).
    pub fn worker_cpu(&self) -> Option<usize> {
        self.inner.worker_cpu
    }

    /// Joins the world group: `world` ranks that all call this with the same store.
    pub async fn new(store: Arc<dyn Store>, rank: Rank, world: u32, opts: ShmOptions) -> Result<ShmBackend, CommError> {
        Self::create(store, rank, world, opts, "shm/world".into(), None, &[]).await
    }

    /// A process that replaces a lost rank: waits (up to the timeout) until the members of a
    /// running group admit it ([`Group::grow`]), then joins the group they make.
    pub async fn join(store: Arc<dyn Store>, opts: ShmOptions) -> Result<ShmBackend, CommError> {
        let a = elastic::admission(&*store, config::clamp_timeout(opts.timeout)).await?;
        Self::create(store, a.rank, a.world, opts, a.prefix, None, &[]).await
    }

    async fn create(
        store: Arc<dyn Store>,
        rank: Rank,
        world: u32,
        opts: ShmOptions,
        prefix: String,
        // A sub-group's: its process's world worker core.
        inherited_cpu: Option<Option<usize>>,
        // A shrunk group's: the members' processes, known from the old group.
        known: &[Option<ProcId>],
    ) -> Result<ShmBackend, CommError> {
        if world == 0 || rank >= world {
            return Err(CommError::invalid("shm init", format!("rank {rank} is not in a world of {world}")));
        }
        opts.check()?;
        let to = config::clamp_timeout(opts.timeout);
        let host = handle::host_identity();
        // With the CPUs this rank may run on: whether the group's ranks can all run at once.
        store.set(&format!("{prefix}/host/{rank}"), CpuSet::append_to(&host).as_bytes()).await?;
        if rank == 0 {
            // One step moves at most a window per rank.
            let small_max =
                opts.small_max.unwrap_or_else(|| tuning::small_max(tuning::l2_bytes(), world)).min(opts.window);
            let slot = opts.p2p_slot.unwrap_or_else(|| tuning::slot(opts.window, world));
            // Collectives read peers' arena buffers in place from this size (sends go in place
            // only above one step: `Params::send_in_place_min`).
            let zc_min = opts.arena_min.unwrap_or(usize::MAX);
            let p = format!("{} {} {} {}", opts.window, slot, small_max, zc_min);
            store.set(&format!("{prefix}/params"), p.as_bytes()).await?;
        }
        let deadline = std::time::Instant::now() + to;
        let params = get_from(&*store, &format!("{prefix}/params"), 0, known, deadline, None).await?;
        let nums: Vec<usize> = params.split(' ').filter_map(|x| x.parse().ok()).collect();
        let [window, slot, small_max, zc_min] = nums[..] else {
            return Err(CommError::Store(format!("malformed shm parameters `{params}` in the store")));
        };
        let mut sets = Vec::with_capacity(world as usize);
        for r in 0..world {
            let value = get_from(&*store, &format!("{prefix}/host/{r}"), r, known, deadline, None).await?;
            let (theirs, their_cpus) = CpuSet::split_id(&value);
            if theirs != host {
                return Err(CommError::Unavailable {
                    backend: "shm",
                    why: format!(
                        "rank {r} runs on another host ({theirs}) than rank {rank} ({host}); shared memory needs every rank of the group on one host (use the mpi or nccl backend)"
                    ),
                });
            }
            sets.push(their_cpus);
        }
        let runnable = CpuSet::runnable_of(CpuSet::union_of(sets.iter().map(Option::as_ref)).as_ref());
        let worker_cpu = inherited_cpu.unwrap_or_else(|| {
            tuning::worker_cpu(rank, &sets, opts.pin, |s| tuning::cores_of(s, "/sys/devices/system/cpu"))
        });

        reap_stale_segments();
        let lay = Layout::new(world as usize, window, slot).ok_or_else(|| {
            CommError::Config(format!(
                "a shm segment for {world} ranks with {window}-byte windows and {slot}-byte slots does not fit in memory"
            ))
        })?;
        let mut rnd = [0u8; 8];
        getrandom::fill(&mut rnd)
            .map_err(|e| CommError::io("random segment name", std::io::Error::other(e.to_string())))?;
        let me_id = ProcId::current();
        let name = format!("/commshm-{}-{:016x}", me_id.pid, u64::from_le_bytes(rnd));
        let me = match Segment::create(&name, lay.total) {
            Ok(seg) => Arc::new(seg),
            Err(e) => {
                let e = CommError::io(format!("creating shared memory `{name}` ({} bytes)", lay.total), e);
                // Tell the others at once, instead of letting them wait for this rank's segment.
                let _ = store.set(&format!("{prefix}/abort"), format!("rank {rank}: {e}").as_bytes()).await;
                return Err(e);
            }
        };
        engine::init_segment(&me, world, rank, lay.window);
        me.u32_at(OFF_STATE).store(STATE_READY, SeqCst);
        me.u64_at(OFF_MAGIC).store(MAGIC, SeqCst);

        let faults = config::fault_injection()?;
        arena::install(opts.arena_min, opts.arena_max);
        let joined = Self::join_peers(&*store, &prefix, rank, world, &lay, &me, me_id, to, faults, known).await;
        if let Err(e) = &joined {
            // Tell the others why this rank gives up before its segment goes away.
            let _ = store.set(&format!("{prefix}/abort"), format!("rank {rank}: {e}").as_bytes()).await;
        }
        // Unlink as soon as every rank mapped it (or at once on failure): nothing is left in
        // /dev/shm whatever happens to the processes later.
        let _ = me.unlink();
        if joined.is_err() {
            // What a peer that died before unlinking its segment left behind.
            reap_stale_segments();
        }
        let (segs, procs, all_arenas) = joined?;

        let params = Params {
            panic_at: faults.panic_at,
            timeout: to,
            spin: opts.spin.unwrap_or_else(|| handle::default_spin(world as usize, runnable)),
            cpus: (runnable / world as usize).max(1),
            stream: opts.stream,
            // With a rank that has no arena every large op would learn so in an extra step and
            // copy anyway: they copy at once.
            zc_min: if all_arenas { zc_min } else { usize::MAX },
            send_in_place_min: if all_arenas { zc_min.max(small_max + 1) } else { usize::MAX },
        };
        let (lane, tx) = Engine::start(rank as usize, lay, segs, procs.clone(), params);
        let (worker_lane, worker_me, spin) = (lane.clone(), me.clone(), params.spin);
        std::thread::Builder::new()
            .name(format!("comm-shm-r{rank}"))
            .spawn(move || {
                if let Some(cpu) = worker_cpu {
                    let mut set = rustix::thread::CpuSet::new();
                    set.set(cpu);
                    // Only a placement hint: the worker runs anywhere if this fails.
                    let _ = rustix::thread::sched_setaffinity(None, &set);
                }
                engine::worker(worker_lane, worker_me, spin)
            })
            .map_err(|e| CommError::io("starting the shm worker thread", e))?;
        Ok(ShmBackend {
            inner: Arc::new(Inner {
                admission: Admission::new(rank, world, lane.poison().clone()),
                tx,
                lane,
                limits: match world {
                    1 => Limits { world, window: usize::MAX, small_max: usize::MAX, zc_min: usize::MAX },
                    _ => Limits { world, window: lay.window, small_max, zc_min: params.zc_min },
                },
                inline_max: opts.inline_max.unwrap_or(2 * lay.window),
                worker_cpu,
                me,
                store,
                opts,
                procs,
                elastic: Elastic::new(prefix.clone()),
                subgroups: Subgroups::new(prefix),
            }),
        })
    }

    #[allow(clippy::too_many_arguments)]
    async fn join_peers(
        store: &dyn Store,
        prefix: &str,
        rank: Rank,
        world: u32,
        lay: &Layout,
        me: &Arc<Segment>,
        me_id: ProcId,
        to: Duration,
        faults: config::Faults,
        known: &[Option<ProcId>],
    ) -> Result<(Vec<Arc<Segment>>, Vec<Option<ProcId>>, bool), CommError> {
        let start = std::time::Instant::now();
        let mut all_arenas = arena::get().is_some();
        let info = format!("{} {} {} {}", me.name(), me_id.pid, me_id.start, u8::from(all_arenas));
        store.set(&format!("{prefix}/seg/{rank}"), info.as_bytes()).await?;
        if faults.kill_in_rendezvous {
            config::kill_self();
        }
        let mut segs = Vec::with_capacity(world as usize);
        let mut procs = Vec::with_capacity(world as usize);
        for r in 0..world {
            if r == rank {
                segs.push(me.clone());
                procs.push(None);
                continue;
            }
            let raw = get_from(store, &format!("{prefix}/seg/{r}"), r, known, start + to, Some(prefix)).await?;
            let mut it = raw.split(' ');
            let (Some(name), Some(pid), Some(start), Some(arena)) = (it.next(), it.next(), it.next(), it.next()) else {
                return Err(CommError::Store(format!("malformed segment record `{raw}` for rank {r}")));
            };
            let id = ProcId { pid: pid.parse().unwrap_or(0), start: start.parse().unwrap_or(0) };
            all_arenas &= arena == "1";
            // A pid we cannot see (another pid namespace) is not checked; timeouts still apply.
            let alive = || if id.pid == 0 { None } else { id.alive() };
            let lost = || CommError::peer_lost(r, format!("its process {} exited during the rendezvous", id.pid));
            if alive() == Some(false) {
                return Err(lost());
            }
            let seg = match Segment::open(name, lay.total) {
                Ok(seg) => seg,
                // Gone because its creator died (and a survivor removed it), or gave up: say so.
                Err(_) if alive() == Some(false) => return Err(lost()),
                Err(e) => {
                    return Err(Self::gave_up(store, prefix)
                        .await
                        .unwrap_or_else(|| CommError::io(format!("mapping rank {r}'s shared memory `{name}`"), e)))
                }
            };
            let ok = seg.u64_at(OFF_MAGIC).load(SeqCst) == MAGIC
                && seg.read::<u32>(OFF_VERSION) == VERSION
                && seg.read::<u32>(OFF_WORLD) == world
                && seg.read::<u32>(OFF_RANK) == r
                && seg.read::<u64>(OFF_WINDOW) == lay.window as u64;
            if !ok {
                return Err(CommError::mismatch(
                    "shm init",
                    format!("rank {r}'s segment `{name}` has a different layout (another job or version?)"),
                ));
            }
            segs.push(Arc::new(seg));
            procs.push(alive().map(|_| id));
        }
        store.set(&format!("{prefix}/mapped/{rank}"), b"1").await?;
        // Every peer mapped ours: a peer killed meanwhile fails this at once.
        for r in (0..world).filter(|&r| r != rank) {
            get_from(store, &format!("{prefix}/mapped/{r}"), r, &procs, start + to, Some(prefix)).await?;
        }
        Ok((segs, procs, all_arenas))
    }

    /// The reason a rank gave up this group's rendezvous, if one did.
    async fn gave_up(store: &dyn Store, prefix: &str) -> Option<CommError> {
        let reason = store.get(&format!("{prefix}/abort"), Duration::ZERO).await.ok()?;
        let reason = String::from_utf8_lossy(&reason).into_owned();
        let rank = reason.strip_prefix("rank ").and_then(|r| r.split(':').next()).and_then(|r| r.parse().ok());
        Some(CommError::peer_lost(rank.unwrap_or(0), format!("it gave up the rendezvous: {reason}")))
    }

    fn enqueue(&self, cmd: Command) {
        let inner = &*self.inner;
        // Every command counts as a collective: a message must not overtake any of them.
        inner.lane.backlog().add(Class::Collective);
        // If the worker is gone the command (and its Completer) is dropped, which completes
        // the Work with `Shutdown`.
        if inner.tx.send(cmd).is_err() {
            inner.lane.backlog().done(Class::Collective);
        }
        self.ring_worker();
    }

    fn ring_worker(&self) {
        let me = &self.inner.me;
        me.u32_at(OFF_DOORBELL).fetch_add(1, SeqCst);
        if me.u32_at(OFF_SLEEPING).load(SeqCst) != 0 {
            sys::futex_wake(me.u32_at(OFF_DOORBELL));
        }
    }

    /// Issues `req`: on the caller's thread when the group is idle, else on the worker
    /// (ARCHITECTURE.md, "The path of one all_reduce (shm)", 2.).
    fn submit<R: Plan>(&self, req: R) -> Work<R::Output> {
        if let Err(e) = self.inner.admission.admit(&req) {
            return Work::ready(Err(e));
        }
        match req.one_shot(&self.inner.limits) {
            Ok(op) => self.one_step(op),
            Err(req) if R::P2P => self.direct(req),
            Err(req) => self.queued(req),
        }
    }

    fn one_step<T: OneShotOutput + Send + 'static>(&self, op: OneShot) -> Work<T> {
        let ran = self.inline(Class::Collective, op, |e, op, wait| match e.try_inline(op, wait) {
            Inline::Done(r) => Ok(Work::ready(r.map(T::from_one_shot))),
            Inline::Parked => {
                let (done, work) = Work::pending();
                e.attach(Then::Done(T::done(done)));
                Ok(work)
            }
            Inline::NotNow(op) => Err(op),
        });
        let op = match ran {
            Ok(Ok(Ok(work))) => return work,
            Ok(Ok(Err(op))) | Err(op) => op,
            Ok(Err(poisoned)) => return Work::ready(Err(poisoned)),
        };
        let (done, work) = Work::pending();
        self.enqueue(Command::OneShot(op, T::done(done)));
        work
    }

    /// An op of several steps (or without a one-step form): ARCHITECTURE.md, "Inline ops of
    /// several steps".
    fn queued<R: Plan>(&self, req: R) -> Work<R::Output> {
        let inner = &*self.inner;
        let world = inner.limits.world as usize;
        // What the op moves per rank, about: gather, scatter and all_gather move `world`
        // blocks of the size they report.
        let size = match R::KIND {
            OpKind::AllGather | OpKind::Gather | OpKind::Scatter => req.bytes().saturating_mul(world),
            _ => req.bytes(),
        };
        let open = plans::arrival(&req);
        let (done, work) = Work::pending();
        let mut op: Box<dyn Queued> = Box::new(Pending { req, done });
        if !R::P2P && size <= inner.inline_max {
            let ran = self.inline(Class::Collective, op, |e, op, wait| match e.try_inline(open, wait) {
                Inline::Done(Ok(_)) => {
                    op.run(e, true);
                    None
                }
                Inline::Done(Err(err)) => {
                    op.fail(err);
                    None
                }
                Inline::Parked => {
                    e.attach(Then::Run(op));
                    None
                }
                Inline::NotNow(_) => Some(op),
            });
            // A panic reached the op's completer, which reports it (as the group's poison).
            op = match ran {
                Ok(Ok(None) | Err(_)) => return work,
                Ok(Ok(Some(op))) | Err(op) => op,
            };
        }
        self.enqueue(Command::Op(op));
        work
    }

    /// Runs `f` with `x` on the caller's thread when the engine is free and idle for `class` (see
    /// [`Lane::try_inline`]), else hands `x` back; a panic in `f` comes back as `Poisoned`.
    fn inline<X, T>(
        &self,
        class: Class,
        x: X,
        f: impl FnOnce(&mut Engine, X, CallerWait) -> T,
    ) -> Result<Result<T, CommError>, X> {
        let Ran { out, hand_over } = self.inner.lane.try_inline(class, x, f)?;
        // A parked op, a message in flight, or commands taken while waiting: the worker goes
        // on with them.
        if hand_over {
            self.ring_worker();
        }
        Ok(out)
    }

    /// A send or receive queued straight into the engine and progressed on the caller's thread
    /// (ARCHITECTURE.md, "Direct point-to-point"); else queued.
    fn direct<R: Plan>(&self, req: R) -> Work<R::Output> {
        let ran = self.inline(Class::P2p, req, |engine, req, wait| {
            let (done, work) = Work::pending();
            R::accept(Box::new(Pending { req, done }), engine);
            // A send writes what the free slots take and leaves the rest (to the worker, or this
            // thread's next receive); a receive waits a moment for its message.
            engine.progress_inline((R::KIND != OpKind::Send).then_some(wait), || work.is_completed());
            work
        });
        // A panic reached the op's completer, which reports it.
        ran.unwrap_or_else(|req| Ok(self.queued(req))).unwrap_or_else(|e| Work::ready(Err(e)))
    }
}

/// Removes `commshm-<pid>-*` segments whose creator is dead: left behind only when a process
/// was killed between creating its segment and the end of the handshake.
fn reap_stale_segments() {
    let Ok(dir) = std::fs::read_dir("/dev/shm") else { return };
    for entry in dir.flatten() {
        let name = entry.file_name();
        let pid = name.to_str().and_then(|n| n.strip_prefix("commshm-")).and_then(|r| r.split('-').next());
        let Some(pid) = pid.and_then(|p| p.parse::<u32>().ok()) else { continue };
        if (ProcId { pid, start: 0 }).alive() == Some(false) {
            let _ = rustix::shm::unlink(format!("/{}", name.to_string_lossy()).as_str());
        }
    }
}

impl<R: Plan> Collective<R> for ShmBackend {
    fn submit(&self, req: R) -> Work<R::Output> {
        ShmBackend::submit(self, req)
    }
}

#[async_trait]
impl Group for ShmBackend {
    fn rank(&self) -> Rank {
        self.inner.admission.rank()
    }

    fn world_size(&self) -> u32 {
        self.inner.admission.world()
    }

    fn backend_name(&self) -> &'static str {
        "shm"
    }

    async fn new_group(&self, ranks: &[Rank]) -> Result<Option<Arc<dyn Backend>>, CommError> {
        let inner = &*self.inner;
        let a = &inner.admission;
        let sub = inner.subgroups.next(ranks, a.rank(), a.world())?;
        let Some(rank) = sub.rank else { return Ok(None) };
        let world = sub.ranks.len() as u32;
        let g =
            Self::create(inner.store.clone(), rank, world, inner.opts.clone(), sub.prefix, Some(inner.worker_cpu), &[])
                .await?;
        Ok(Some(Arc::new(g)))
    }

    /// A buffer in the arena whatever its size (large buffers are there anyway, see
    /// [`ShmOptions::arena_min`]); heap memory when the arena is off or full.
    fn alloc_buffer(&self, dtype: DType, len: usize) -> Result<HostBuffer, CommError> {
        let bytes = dtype
            .checked_bytes(len)
            .ok_or_else(|| CommError::invalid("alloc_buffer", format!("{len} × {dtype} does not fit in memory")))?;
        match arena::get().and_then(|a| a.block(bytes, true)) {
            Some(block) => HostBuffer::from_external(dtype, len, Box::new(block)),
            None => HostBuffer::try_zeroed(dtype, len),
        }
    }

    async fn shutdown(&self) -> Result<(), CommError> {
        if !self.inner.admission.begin_shutdown() {
            return Ok(());
        }
        let (done, work) = Work::pending();
        self.enqueue(Command::Shutdown(done));
        shutdown_done(work).await
    }

    /// Later ops fail at once; the worker fails the group's ops as it takes the command (ahead
    /// of queued collectives), writing the cause into this rank's segment, where the peers'
    /// waits see it.
    fn abort(&self, cause: &str) {
        self.inner.admission.poison().set(cause);
        // Said at once, so that a process that exits next still tells its peers why.
        engine::publish_abort(&self.inner.me, cause);
        self.enqueue(Command::Abort(cause.to_owned()));
    }

    fn poison(&self) -> Option<&Poison> {
        Some(self.inner.admission.poison())
    }

    /// On one host a rank's death is exact (its process is gone), so the survivors' agreement
    /// waits only for ranks that are alive. The new group has segments and a worker of its
    /// own; this one is shut down once it is up.
    async fn shrink(&self) -> Result<Shrunk, CommError> {
        let inner = &*self.inner;
        let (me, world) = (inner.admission.rank(), inner.admission.world());
        // Ops still in flight here fail now (a no-op when a failure already poisoned it).
        self.abort(&format!("rank {me} is shrinking the group"));
        let gone = |r: Rank| inner.procs[r as usize].is_some_and(|p| p.alive() == Some(false));
        let timeout = config::clamp_timeout(inner.opts.timeout);
        let shrunk = inner
            .elastic
            .shrink(&*inner.store, me, world, timeout, &gone, |s| {
                let (store, opts, cpu) = (inner.store.clone(), inner.opts.clone(), inner.worker_cpu);
                let known: Vec<Option<ProcId>> = s.ranks.iter().map(|&r| inner.procs[r as usize]).collect();
                async move {
                    let n = s.ranks.len() as u32;
                    let g = Self::create(store, s.rank, n, opts, s.prefix, Some(cpu), &known).await?;
                    Ok(Arc::new(g) as Arc<dyn Backend>)
                }
            })
            .await?;
        let _ = self.shutdown().await;
        Ok(shrunk)
    }

    /// The members keep their ranks and are known (a member that dies meanwhile fails the
    /// rendezvous at once); the newcomers are waited for up to the timeout.
    async fn grow(&self, n: u32) -> Result<Arc<dyn Backend>, CommError> {
        let inner = &*self.inner;
        let (me, world) = (inner.admission.rank(), inner.admission.world());
        inner.admission.check_open()?;
        let timeout = config::clamp_timeout(inner.opts.timeout);
        let a = inner.elastic.grow(&*inner.store, me, world, n, timeout).await?;
        let (store, opts) = (inner.store.clone(), inner.opts.clone());
        let g = Self::create(store, a.rank, a.world, opts, a.prefix, Some(inner.worker_cpu), &inner.procs).await?;
        let _ = self.shutdown().await;
        Ok(Arc::new(g))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_sizes_are_bounded() {
        ShmOptions::default().check().unwrap();
        // Used to wrap to a 0-byte window when aligned, and the workers panicked.
        for window in [usize::MAX - 15, MAX_WINDOW + 1, 0, MIN_WINDOW - 1] {
            let e = ShmOptions { window, ..ShmOptions::default() }.check().unwrap_err().to_string();
            assert!(e.contains("COMM_SHM_WINDOW") && e.contains("out of range"), "{e}");
        }
        let e = ShmOptions { p2p_slot: Some(usize::MAX), ..ShmOptions::default() }.check().unwrap_err().to_string();
        assert!(e.contains("COMM_SHM_SLOT"), "{e}");
        assert!(Layout::new(usize::MAX / 8, MIN_WINDOW, MIN_WINDOW).is_none());
    }
}
