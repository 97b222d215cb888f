//! MPI backend for comm: every collective on a real MPI (Open MPI or MPICH) through rsmpi.
//!
//! Launch the program with `mpirun -np N prog` (as root add `--allow-run-as-root`, and
//! `--oversubscribe` for more ranks than cores); [`MpiBackend::init`] returns the world group.
//! One worker thread owns MPI; exact reductions by default; errors and timeouts instead of
//! hangs. The design is in ARCHITECTURE.md, "The MPI backend".

#![deny(unsafe_code)]

mod engine;
use comm_kernels as kernels;
#[allow(unsafe_code)] // the one audited module; see its docs
mod raw;

/// The f16/bf16 MPI reduction ops, for code that calls MPI itself (comm-bench's `mpi-raw`).
#[doc(hidden)]
pub use raw::HalfOps;
/// The MPI datatype that carries each dtype, and MPI's built-in op for each reduce op, for code
/// that calls MPI itself (comm-bench's `mpi-raw`).
#[doc(hidden)]
pub use raw::{builtin_op as mpi_builtin_op, datatype as mpi_datatype};

use std::sync::atomic::Ordering::SeqCst;
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use comm_core::elastic::Shrunk;
use comm_core::handle::{self, shutdown_done, Admission, Poison};
use comm_core::{config, Backend, Collective, CommError, Group, Launcher, Rank, Work, WorldInfo, WorldSource};

use engine::{Command, GroupInfo, NewGroup, Params, Pending, Plan};

/// How floating-point reductions are computed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Reduction {
    /// By this backend, in rank order: bit-identical to the reference on every rank and at
    /// every world size (f16/bf16 accumulate in f32 and round once). The default.
    #[default]
    Exact,
    /// By MPI (`MPI_Iallreduce` and friends): built-in ops for integers and f32/f64,
    /// user-defined MPI ops combining in f32 for f16/bf16 (each step rounds to 16 bits).
    /// Float results can differ in the last bits from `Exact` (and between world sizes) from
    /// three ranks on. 8-bit integers are still reduced by this backend.
    Native,
}

impl std::str::FromStr for Reduction {
    type Err = CommError;
    fn from_str(s: &str) -> Result<Self, CommError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "exact" => Ok(Reduction::Exact),
            "native" => Ok(Reduction::Native),
            other => Err(CommError::Config(format!("unknown MPI reduction mode `{other}` (expected exact or native)"))),
        }
    }
}

/// Settings of the MPI backend.
#[derive(Clone, Debug)]
pub struct MpiOptions {
    /// How long any op may take before [`CommError::Timeout`] (and group initialisation).
    pub timeout: Duration,
    /// How floating-point reductions are computed.
    pub reduction: Reduction,
    /// Exchange a header before every collective so mismatched calls fail with
    /// [`CommError::Mismatch`] (costs one small point-to-point exchange per collective).
    pub check: bool,
    /// All_reduces of at most this many bytes × (ranks − 1) gather every input to every rank
    /// and reduce them in rank order; larger ones use two phases. `None` (the default):
    /// measured from MPI's round trip when the world group is created.
    pub small_max: Option<usize>,
    /// Larger exact reductions are done this many bytes at a time (to stay in cache).
    pub chunk: usize,
    /// How long the worker busy-polls before yielding the core; `None` picks 50 µs, or 0 when
    /// this node's ranks outnumber the CPUs they may run on together.
    pub spin: Option<Duration>,
    /// Call `MPI_Abort` when any thread of the process panics (the other ranks would hang).
    pub abort_on_panic: bool,
}

impl Default for MpiOptions {
    fn default() -> Self {
        MpiOptions {
            timeout: Duration::from_secs(300),
            reduction: Reduction::Exact,
            check: true,
            small_max: None,
            chunk: 1 << 20,
            spin: None,
            abort_on_panic: true,
        }
    }
}

impl MpiOptions {
    /// Defaults, overridden by `COMM_TIMEOUT` (seconds), `COMM_MPI_REDUCTION` (`exact` or
    /// `native`), `COMM_MPI_CHECK` (`1`/`0`), `COMM_MPI_SMALL_MAX` and `COMM_MPI_CHUNK` (bytes,
    /// optional `K`/`M` suffix), `COMM_MPI_SPIN_US` and `COMM_MPI_ABORT_ON_PANIC` (`1`/`0`).
    pub fn from_env() -> Result<Self, CommError> {
        let mut o = MpiOptions::default();
        let var = config::env_var;
        o.timeout = config::env_parse("COMM_TIMEOUT", config::parse_timeout)?.unwrap_or(o.timeout);
        if let Some(v) = var("COMM_MPI_REDUCTION") {
            o.reduction = v.parse()?;
        }
        o.check = config::env_parse("COMM_MPI_CHECK", config::parse_bool)?.unwrap_or(o.check);
        o.small_max = config::env_parse("COMM_MPI_SMALL_MAX", config::parse_size)?.or(o.small_max);
        let positive =
            |v: &str| config::parse_size(v).and_then(|c| if c > 0 { Ok(c) } else { Err("must be above 0".into()) });
        o.chunk = config::env_parse("COMM_MPI_CHUNK", positive)?.unwrap_or(o.chunk);
        o.spin = config::env_parse("COMM_MPI_SPIN_US", config::parse_micros)?.or(o.spin);
        o.abort_on_panic =
            config::env_parse("COMM_MPI_ABORT_ON_PANIC", config::parse_bool)?.unwrap_or(o.abort_on_panic);
        Ok(o)
    }

    fn params(&self) -> Params {
        Params {
            panic_at: config::fault_injection().unwrap_or_default().panic_at,
            timeout: config::clamp_timeout(self.timeout),
            reduction: self.reduction,
            check: self.check,
            small_max: self.small_max.unwrap_or(engine::GATHER_MIN),
            measure: self.small_max.is_none(),
            chunk: self.chunk.max(1),
            spin: self.spin,
        }
    }
}

/// Process-wide state: whether the worker runs, and what the panic and exit hooks need.
mod global {
    use std::sync::atomic::{AtomicBool, AtomicI32, Ordering::SeqCst};
    use std::sync::mpsc::Sender;
    use std::sync::{Mutex, MutexGuard, Once};
    use std::time::{Duration, Instant};

    use crate::engine::{self, Command};
    use crate::raw;

    pub(crate) enum State {
        Idle,
        Running(Sender<Command>),
        Ended(String),
    }

    static STATE: Mutex<State> = Mutex::new(State::Idle);
    /// MPI is initialised and not being finalised: the panic hook may call MPI_Abort.
    static LIVE: AtomicBool = AtomicBool::new(false);
    pub(crate) static ABORT_ON_PANIC: AtomicBool = AtomicBool::new(true);
    static WORLD_RANK: AtomicI32 = AtomicI32::new(-1);
    static HOOKS: Once = Once::new();

    pub(crate) fn state() -> MutexGuard<'static, State> {
        STATE.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Called by the worker right after MPI_Init: the hooks go live.
    pub(crate) fn mpi_started(rank: i32) {
        WORLD_RANK.store(rank, SeqCst);
        LIVE.store(true, SeqCst);
        HOOKS.call_once(|| {
            let previous = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                previous(info);
                if LIVE.load(SeqCst) && ABORT_ON_PANIC.load(SeqCst) {
                    eprintln!(
                        "comm mpi: rank {} panicked; calling MPI_Abort so the other ranks do not hang \
                         (set COMM_MPI_ABORT_ON_PANIC=0 to keep running)",
                        WORLD_RANK.load(SeqCst)
                    );
                    raw::abort(101);
                }
            }));
            if !raw::at_exit(finalize_at_exit) {
                tracing::warn!("comm mpi: cannot register the exit hook; shut the world group down before exiting");
            }
        });
    }

    /// Called by the worker before it finalises (no more MPI_Abort from the hook).
    pub(crate) fn mpi_ending() {
        LIVE.store(false, SeqCst);
    }

    /// Called by the worker when it is done; later `init` calls fail with `why`.
    pub(crate) fn mpi_ended(why: &str) {
        *state() = State::Ended(why.to_owned());
    }

    /// At process exit: ask the worker to finish and finalise, and wait for it (bounded).
    extern "C" fn finalize_at_exit() {
        let tx = match &*state() {
            State::Running(tx) => tx.clone(),
            _ => return,
        };
        if tx.send(Command::Exit).is_err() {
            return;
        }
        // Polling the state (not a channel): thread-locals may already be gone at this point.
        let deadline = Instant::now() + engine::EXIT_GRACE + Duration::from_secs(5);
        while !matches!(*state(), State::Ended(_)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Handle to an MPI process group (a communicator). Cheap to clone; the communicator is freed
/// when the last clone is dropped (after its submitted ops) or on [`Group::shutdown`].
#[derive(Clone)]
pub struct MpiBackend {
    inner: Arc<Inner>,
}

struct Inner {
    info: GroupInfo,
    admission: Admission,
    tx: Sender<Command>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.tx.send(Command::Release(self.info.gid));
    }
}

impl std::fmt::Debug for MpiBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiBackend")
            .field("rank", &self.inner.info.rank)
            .field("size", &self.inner.info.size)
            .field("group", &self.inner.info.gid)
            .finish()
    }
}

impl MpiBackend {
    /// Initialises MPI (on the first call; on its own worker thread) and returns a new world
    /// group, a duplicate of `MPI_COMM_WORLD`. Collective: every rank calls it.
    ///
    /// Fails with [`CommError::Config`] when the launcher's environment disagrees with MPI
    /// about the number of ranks (a program linked against another MPI than the launcher's),
    /// and with [`CommError::Unavailable`] after MPI was finalised in this process.
    pub async fn init(opts: MpiOptions) -> Result<MpiBackend, CommError> {
        global::ABORT_ON_PANIC.store(opts.abort_on_panic, SeqCst);
        let (done, work) = Work::pending();
        let tx = {
            let mut state = global::state();
            let tx = match &*state {
                global::State::Running(tx) => tx.clone(),
                global::State::Ended(why) => return Err(CommError::Unavailable { backend: "mpi", why: why.clone() }),
                global::State::Idle => {
                    let (tx, rx) = channel();
                    std::thread::Builder::new()
                        .name("comm-mpi".into())
                        .spawn(move || match engine::Engine::start(rx) {
                            Ok(a) => a.run(),
                            Err((rx, why)) => {
                                global::mpi_ended(&why);
                                while let Ok(m) = rx.try_recv() {
                                    engine::reject_with(m, &why);
                                }
                            }
                        })
                        .map_err(|e| CommError::io("starting the MPI worker thread", e))?;
                    *state = global::State::Running(tx.clone());
                    tx
                }
            };
            tx.send(Command::World(opts.params(), done))
                .map_err(|_| CommError::Shutdown("the MPI worker is gone".into()))?;
            tx
        };
        let info = work.await?;
        Ok(MpiBackend::from_info(info, tx))
    }

    fn from_info(info: GroupInfo, tx: Sender<Command>) -> MpiBackend {
        let admission = Admission::new(info.rank, info.size, info.poison.clone());
        MpiBackend { inner: Arc::new(Inner { info, admission, tx }) }
    }

    /// This process's rank among the ranks on its node (`MPI_COMM_TYPE_SHARED`).
    pub fn local_rank(&self) -> Rank {
        self.inner.info.local_rank
    }

    /// Number of ranks on this process's node.
    pub fn local_world_size(&self) -> u32 {
        self.inner.info.local_size
    }

    /// How long the worker (and a caller running a small op) polls before yielding the core:
    /// [`MpiOptions::spin`], or what start-up chose from the node's CPUs.
    pub fn spin(&self) -> Duration {
        self.inner.info.spin
    }

    /// The largest point-to-point tag this MPI allows (`(MPI_TAG_UB >> 3) - 1`: the low 3 bits
    /// of MPI's tag carry the dtype, and the top block of tags is the backend's own).
    pub fn max_tag(&self) -> u32 {
        self.inner.info.tag_max
    }

    /// Reconciles the world the environment described with MPI's (call it on a world group):
    /// a launcher's rank and world size must equal MPI's, else [`CommError::Config`] names
    /// both; when nothing was found ([`Launcher::Single`]) the world is taken from MPI.
    pub fn reconcile(&self, discovered: &WorldInfo) -> Result<WorldInfo, CommError> {
        let i = &self.inner.info;
        if discovered.source.launcher == Launcher::Single {
            let mut variables = vec![format!("MPI_COMM_WORLD: rank {} of {}", i.rank, i.size)];
            let mut launcher = Launcher::Single;
            for (var, l) in [("OMPI_COMM_WORLD_SIZE", Launcher::OpenMpi), ("PMI_SIZE", Launcher::Mpich)] {
                if let Ok(v) = std::env::var(var) {
                    variables.push(format!("{var}={v}"));
                    if launcher == Launcher::Single {
                        launcher = l;
                    }
                }
            }
            return Ok(WorldInfo {
                rank: i.rank,
                world_size: i.size,
                local_rank: i.local_rank,
                local_world_size: i.local_size,
                source: WorldSource { launcher, variables },
                ..discovered.clone()
            });
        }
        if discovered.rank != i.rank || discovered.world_size != i.size {
            return Err(CommError::Config(format!(
                "MPI and the environment disagree: MPI_COMM_WORLD says rank {} of {}, but {discovered} says rank {} of {}; \
                 start the program with the mpirun of the MPI it was built with (and without other launchers' RANK/WORLD_SIZE)",
                i.rank, i.size, discovered.rank, discovered.world_size
            )));
        }
        Ok(discovered.clone())
    }

    /// Runs the op on this thread where the lane allows it, else hands it to the worker.
    fn send<R: Plan>(&self, op: Pending<R>) {
        let inner = &*self.inner;
        let (op, ticket) = match &inner.info.lane {
            Some(lane) => match engine::submit_direct(lane, &inner.info, &inner.tx, op) {
                None => return,
                Some(back) => back,
            },
            None => (op, None),
        };
        // If the worker is gone, the dropped Completer completes the Work with `Shutdown`.
        let _ = inner.tx.send(Command::Op(inner.info.gid, Box::new(op), ticket));
    }
}

impl<R: Plan> Collective<R> for MpiBackend {
    fn submit(&self, req: R) -> Work<R::Output> {
        let inner = &*self.inner;
        if let Err(e) = req.check(&inner.info).and_then(|()| inner.admission.admit(&req)) {
            return Work::ready(Err(e));
        }
        let (done, work) = Work::pending();
        // Counted before its header goes out, until it finishes (`engine::Held`).
        let held = (!R::P2P).then(|| engine::Held::new(inner.info.gid));
        self.send(Pending { req, done });
        let work = work.with_spin(inner.info.caller_spin);
        match held {
            Some(h) if !work.is_completed() => work.on_complete(move |_| drop(h)),
            _ => work,
        }
    }
}

#[async_trait]
impl Group for MpiBackend {
    fn rank(&self) -> Rank {
        self.inner.info.rank
    }

    fn world_size(&self) -> u32 {
        self.inner.info.size
    }

    fn backend_name(&self) -> &'static str {
        "mpi"
    }

    async fn new_group(&self, ranks: &[Rank]) -> Result<Option<Arc<dyn Backend>>, CommError> {
        let inner = &*self.inner;
        let sorted = handle::group_members(ranks, inner.info.size)?;
        inner.admission.check_open()?;
        let (done, work) = Work::pending();
        self.send(Pending { req: NewGroup { ranks: sorted }, done });
        Ok(work.await?.map(|info| Arc::new(MpiBackend::from_info(info, inner.tx.clone())) as Arc<dyn Backend>))
    }

    async fn shutdown(&self) -> Result<(), CommError> {
        if !self.inner.admission.begin_shutdown() {
            return Ok(());
        }
        let (done, work) = Work::pending();
        let _ = self.inner.tx.send(Command::Shutdown(self.inner.info.gid, done));
        shutdown_done(work).await
    }

    /// Later ops fail at once; the worker, woken, fails the group's ops in flight and sends
    /// the peers its notice (see `Group::hear`), which fails theirs.
    fn abort(&self, cause: &str) {
        self.inner.info.poison.set(cause);
        let _ = self.inner.tx.send(Command::Hear(self.inner.info.gid));
    }

    fn poison(&self) -> Option<&Poison> {
        Some(&self.inner.info.poison)
    }

    /// Fails at once: see [`NO_SHRINK`].
    async fn shrink(&self) -> Result<Shrunk, CommError> {
        Err(CommError::Unavailable { backend: "mpi", why: NO_SHRINK.into() })
    }
}

/// Why an MPI group cannot shrink, and what works instead.
pub const NO_SHRINK: &str = "shrinking a group after a lost rank needs an MPI with ULFM fault tolerance \
    (MPIX_Comm_shrink: Open MPI 5 built and started with `--with-ft ulfm`); the MPI libraries this backend \
    supports have none (Open MPI 4.1 has no ULFM, MPICH's default device stubs it). Restart the job \
    (torchrun --max-restarts, or a supervisor), or on one host use the shm backend, which can shrink";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse() {
        assert_eq!("NATIVE".parse::<Reduction>().unwrap(), Reduction::Native);
        assert!("fast".parse::<Reduction>().unwrap_err().to_string().contains("fast"));
    }
}
