//! `--backend mpi-raw` (`COMM_BACKEND=mpi-raw` under `mpirun`): the system MPI's own
//! collectives called directly on the bench's thread — `MPI_Allreduce`, `MPI_Allgather`,
//! `MPI_Reduce_scatter_block`, `MPI_Bcast`, `MPI_Alltoall(v)`, `MPI_Reduce`, `MPI_Scatter`,
//! `MPI_Gather`, `MPI_Barrier`, as
//! `osu_allreduce` calls them (separate send and receive buffers; f16/bf16 through
//! user-defined ops that add in f32) — with no worker, no header exchange and no checks. It is
//! the reference every performance claim is stated against.
//!
//! It is a `comm_core` backend only so the bench drives it like any other: each `submit` makes
//! the blocking MPI call and returns a completed `Work`. Point-to-point is the bench's
//! `sendrecv` (`MPI_Isend` + `MPI_Recv` + `MPI_Wait`, what `MPI_Sendrecv` does): a send is
//! posted and completes with the next receive, so a send must be followed by a receive.

use std::ffi::{c_int, c_void};
use std::ptr;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use backend_mpi::{mpi_builtin_op, mpi_datatype as datatype};
use comm_api::ops::{
    AllGather, AllReduce, AllToAll, Barrier, Broadcast, Gather, Op, RecvFrom, Reduce, ReduceScatter, Scatter, SendTo,
};
use comm_api::{
    Backend, Collective, CommError, DType, Group, HostBuffer, InOut, Launcher, ProcessGroup, Rank, ReduceOp, Work,
    WorldInfo, WorldSource,
};
use comm_core::Completer;
use mpi::ffi;

/// A copy of `b` in plain heap memory, what a C program calling MPI uses: in a process with
/// a shm group (the interleaved runs), large `HostBuffer`s would otherwise live in its
/// shared-memory arena.
pub(crate) fn heap_copy(b: &HostBuffer) -> HostBuffer {
    let mut h = HostBuffer::zeroed_on_heap(b.dtype(), b.len());
    h.as_bytes_mut().copy_from_slice(b.as_bytes());
    h
}

const NAME: &str = "mpi-raw";

/// The world communicator; MPI is finalised when the last handle goes if it was initialised
/// here.
struct Mpi {
    rank: Rank,
    size: u32,
    /// Whether `init` initialised MPI (else the mpi backend did, and finalises it).
    owned: bool,
    /// Freed before MPI is finalised (see `Drop`).
    half: Option<backend_mpi::HalfOps>,
    /// The receive buffer of the next all_reduce/reduce: results land there and the caller's
    /// buffer becomes the next one, so nothing is copied (osu's send/receive buffer pair).
    spare: Mutex<Option<HostBuffer>>,
    /// Sends posted with `MPI_Isend`, waited for by the next receive.
    sends: Mutex<Vec<Posted>>,
}

/// A posted send: its request, its buffer (which MPI reads until it completes) and its work.
struct Posted {
    req: ffi::MPI_Request,
    buf: HostBuffer,
    done: Completer<HostBuffer>,
}

// SAFETY: the MPI handles inside (the f16/bf16 op handles) are immutable identifiers, and MPI
// runs at MPI_THREAD_SERIALIZED: the bench makes one blocking call at a time, from whichever
// thread its task is on.
unsafe impl Send for Mpi {}
// SAFETY: as above; nothing is mutated through `&Mpi` but the `Mutex`-guarded spare buffer
// and posted sends.
unsafe impl Sync for Mpi {}

impl Mpi {
    /// Waits for every posted send and completes its work.
    fn finish_sends(&self) {
        let sends = std::mem::take(&mut *self.sends.lock().unwrap_or_else(|p| p.into_inner()));
        for mut s in sends {
            // SAFETY: a request `MPI_Isend` returned, waited for once; its buffer is alive.
            let rc = unsafe { ffi::MPI_Wait(&mut s.req, ffi::RSMPI_STATUS_IGNORE) };
            s.done.complete(check("MPI_Wait", rc).map(|()| s.buf));
        }
    }
}

impl Drop for Mpi {
    fn drop(&mut self) {
        self.finish_sends();
        drop(self.half.take());
        if self.owned {
            // SAFETY: MPI was initialised by `init` and every call has returned (they block).
            unsafe {
                ffi::MPI_Finalize();
            }
        }
    }
}

fn check(what: &str, rc: c_int) -> Result<(), CommError> {
    // SAFETY: reading a constant of the MPI library.
    if rc == ffi::MPI_SUCCESS as c_int {
        Ok(())
    } else {
        Err(CommError::Backend { backend: NAME, source: format!("{what} failed with MPI error {rc}").into() })
    }
}

/// A handle to the raw MPI "backend" (cheap to clone).
#[derive(Clone)]
pub(crate) struct RawMpi(Arc<Mpi>);

/// Initialises MPI, or joins the MPI the mpi backend initialised in this process (`comm-bench
/// --interleave`: then its calls come from this thread while the backend's worker makes its
/// own, which needs `MPI_THREAD_MULTIPLE`, and the backend finalises MPI, so this group must
/// be dropped before the backend's is shut down), and returns the world as a process group.
pub(crate) fn init() -> Result<ProcessGroup, CommError> {
    let (mut rank, mut size, mut provided, mut initialised) = (0, 0, 0, 0);
    // SAFETY: MPI_Initialized may be called at any time; out-pointers are valid.
    check("MPI_Initialized", unsafe { ffi::MPI_Initialized(&mut initialised) })?;
    let owned = initialised == 0;
    // SAFETY: MPI_Init_thread is called once per process, before any other MPI call (MPI is
    // not initialised); out-pointers are valid.
    unsafe {
        if owned {
            check(
                "MPI_Init_thread",
                ffi::MPI_Init_thread(
                    ptr::null_mut(),
                    ptr::null_mut(),
                    ffi::MPI_THREAD_SERIALIZED as c_int,
                    &mut provided,
                ),
            )?;
        } else {
            check("MPI_Query_thread", ffi::MPI_Query_thread(&mut provided))?;
            if provided != ffi::MPI_THREAD_MULTIPLE as c_int {
                return Err(CommError::Unavailable {
                    backend: NAME,
                    why: "beside the mpi backend, MPI must provide MPI_THREAD_MULTIPLE".into(),
                });
            }
        }
        check("MPI_Comm_rank", ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut rank))?;
        check("MPI_Comm_size", ffi::MPI_Comm_size(ffi::RSMPI_COMM_WORLD, &mut size))?;
    }
    let half = backend_mpi::HalfOps::new()?;
    let mpi = Mpi {
        rank: rank as Rank,
        size: size as u32,
        owned,
        half: Some(half),
        spare: Mutex::new(None),
        sends: Mutex::new(Vec::new()),
    };
    let mut world = WorldInfo::single();
    world.rank = mpi.rank;
    world.world_size = mpi.size;
    world.source = WorldSource { launcher: Launcher::Explicit, variables: Vec::new() };
    Ok(ProcessGroup::from_backend(Arc::new(RawMpi(Arc::new(mpi))), world))
}

fn count(n: usize) -> Result<c_int, CommError> {
    c_int::try_from(n).map_err(|_| CommError::invalid(NAME, format!("{n} elements do not fit MPI's int count")))
}

impl RawMpi {
    fn op(&self, name: &'static str, dtype: DType, op: ReduceOp) -> Result<ffi::MPI_Op, CommError> {
        let unsupported = || CommError::Unsupported { op: name, dtype: Some(dtype), backend: NAME };
        if matches!(dtype, DType::F16 | DType::BF16) {
            return match op {
                ReduceOp::Avg => Err(unsupported()),
                _ => self.0.half.as_ref().and_then(|h| h.get(dtype, op)).ok_or_else(unsupported),
            };
        }
        mpi_builtin_op(op).ok_or_else(unsupported)
    }

    /// The receive buffer for a reduction of `like`'s shape.
    fn spare(&self, like: &HostBuffer) -> HostBuffer {
        let mut spare =
            self.0.spare.lock().unwrap_or_else(|p| p.into_inner()).take().unwrap_or_else(|| heap_copy(like));
        if spare.dtype() != like.dtype() || spare.len() != like.len() {
            spare.reshape(like.dtype(), like.len());
        }
        spare
    }

    fn keep_spare(&self, b: HostBuffer) {
        *self.0.spare.lock().unwrap_or_else(|p| p.into_inner()) = Some(b);
    }

    fn all_reduce(&self, r: AllReduce) -> Result<HostBuffer, CommError> {
        let op = self.op(AllReduce::NAME, r.buf.dtype(), r.op)?;
        let mut recv = self.spare(&r.buf);
        let send = r.buf;
        let n = count(send.len())?;
        // SAFETY: both buffers hold `n` elements of the datatype; the call blocks until done.
        check("MPI_Allreduce", unsafe {
            ffi::MPI_Allreduce(
                send.as_bytes().as_ptr().cast(),
                recv.as_bytes_mut().as_mut_ptr().cast(),
                n,
                datatype(send.dtype()),
                op,
                ffi::RSMPI_COMM_WORLD,
            )
        })?;
        self.keep_spare(send);
        Ok(recv)
    }

    fn reduce(&self, r: Reduce) -> Result<HostBuffer, CommError> {
        let op = self.op(Reduce::NAME, r.buf.dtype(), r.op)?;
        let mut recv = self.spare(&r.buf);
        let send = r.buf;
        let n = count(send.len())?;
        // SAFETY: as for MPI_Allreduce; the receive buffer is only written on the root.
        check("MPI_Reduce", unsafe {
            ffi::MPI_Reduce(
                send.as_bytes().as_ptr().cast(),
                recv.as_bytes_mut().as_mut_ptr().cast(),
                n,
                datatype(send.dtype()),
                op,
                r.root as c_int,
                ffi::RSMPI_COMM_WORLD,
            )
        })?;
        if r.root == self.0.rank {
            self.keep_spare(send);
            Ok(recv)
        } else {
            self.keep_spare(recv);
            Ok(send)
        }
    }

    fn broadcast(&self, mut r: Broadcast) -> Result<HostBuffer, CommError> {
        let n = count(r.buf.len())?;
        let dt = datatype(r.buf.dtype());
        // SAFETY: the buffer holds `n` elements; in place is MPI_Bcast's own form.
        check("MPI_Bcast", unsafe {
            ffi::MPI_Bcast(r.buf.as_bytes_mut().as_mut_ptr().cast(), n, dt, r.root as c_int, ffi::RSMPI_COMM_WORLD)
        })?;
        Ok(r.buf)
    }

    fn all_gather(&self, r: AllGather) -> Result<InOut, CommError> {
        let total = r.input.len() * self.0.size as usize;
        let mut out = r.output.unwrap_or_else(|| HostBuffer::zeroed_on_heap(r.input.dtype(), total));
        let (n, dt) = (count(r.input.len())?, datatype(r.input.dtype()));
        // SAFETY: `out` holds size × n elements (checked by the request's validation).
        check("MPI_Allgather", unsafe {
            ffi::MPI_Allgather(
                r.input.as_bytes().as_ptr().cast(),
                n,
                dt,
                out.as_bytes_mut().as_mut_ptr().cast(),
                n,
                dt,
                ffi::RSMPI_COMM_WORLD,
            )
        })?;
        Ok(InOut { input: r.input, output: out })
    }

    fn scatter(&self, r: Scatter) -> Result<InOut, CommError> {
        let mut out = r.output;
        let (n, dt) = (count(out.len())?, datatype(out.dtype()));
        let send: *const c_void = r.input.as_ref().map_or(ptr::null(), |b| b.as_bytes().as_ptr().cast());
        // SAFETY: on the root the input holds size × n elements (validated); MPI reads the send
        // buffer only there. `out` holds n elements.
        check("MPI_Scatter", unsafe {
            ffi::MPI_Scatter(
                send,
                n,
                dt,
                out.as_bytes_mut().as_mut_ptr().cast(),
                n,
                dt,
                r.root as c_int,
                ffi::RSMPI_COMM_WORLD,
            )
        })?;
        let input = r.input.unwrap_or_else(|| HostBuffer::zeroed_on_heap(out.dtype(), 0));
        Ok(InOut { input, output: out })
    }

    fn gather(&self, r: Gather) -> Result<InOut, CommError> {
        let root = r.root == self.0.rank;
        let total = if root { r.input.len() * self.0.size as usize } else { 0 };
        let mut out = r.output.unwrap_or_else(|| HostBuffer::zeroed_on_heap(r.input.dtype(), total));
        let (n, dt) = (count(r.input.len())?, datatype(r.input.dtype()));
        let recv: *mut c_void = if root { out.as_bytes_mut().as_mut_ptr().cast() } else { ptr::null_mut() };
        // SAFETY: the input holds n elements; on the root `out` holds size × n (validated), and
        // MPI writes the receive buffer only there.
        check("MPI_Gather", unsafe {
            ffi::MPI_Gather(
                r.input.as_bytes().as_ptr().cast(),
                n,
                dt,
                recv,
                n,
                dt,
                r.root as c_int,
                ffi::RSMPI_COMM_WORLD,
            )
        })?;
        Ok(InOut { input: r.input, output: out })
    }

    fn reduce_scatter(&self, r: ReduceScatter) -> Result<InOut, CommError> {
        let op = self.op(ReduceScatter::NAME, r.input.dtype(), r.op)?;
        let k = r.input.len() / self.0.size as usize;
        let mut out = r.output.unwrap_or_else(|| HostBuffer::zeroed_on_heap(r.input.dtype(), k));
        // SAFETY: the input holds size × k elements and `out` k (validated).
        check("MPI_Reduce_scatter_block", unsafe {
            ffi::MPI_Reduce_scatter_block(
                r.input.as_bytes().as_ptr().cast(),
                out.as_bytes_mut().as_mut_ptr().cast(),
                count(k)?,
                datatype(r.input.dtype()),
                op,
                ffi::RSMPI_COMM_WORLD,
            )
        })?;
        Ok(InOut { input: r.input, output: out })
    }

    fn all_to_all(&self, r: AllToAll) -> Result<InOut, CommError> {
        let (ins, outs) = r.splits(self.0.size);
        let dt = datatype(r.input.dtype());
        let mut out = r.output.unwrap_or_else(|| HostBuffer::zeroed_on_heap(r.input.dtype(), outs.iter().sum()));
        let (send, recv): (*const c_void, *mut c_void) =
            (r.input.as_bytes().as_ptr().cast(), out.as_bytes_mut().as_mut_ptr().cast());
        if r.input_splits.is_none() && r.output_splits.is_none() {
            let n = count(ins[0])?;
            // SAFETY: both buffers hold size × n elements (validated: equal lengths).
            check("MPI_Alltoall", unsafe { ffi::MPI_Alltoall(send, n, dt, recv, n, dt, ffi::RSMPI_COMM_WORLD) })?;
            return Ok(InOut { input: r.input, output: out });
        }
        let displs = |v: &[usize]| v.iter().scan(0, |a, &c| Some(std::mem::replace(a, *a + c))).collect::<Vec<_>>();
        let ints = |v: Vec<usize>| v.into_iter().map(count).collect::<Result<Vec<c_int>, _>>();
        let (sd, rd) = (ints(displs(&ins))?, ints(displs(&outs))?);
        let (sc, rc) = (ints(ins)?, ints(outs)?);
        // SAFETY: counts and displacements describe the validated splits of both buffers.
        check("MPI_Alltoallv", unsafe {
            ffi::MPI_Alltoallv(
                send,
                sc.as_ptr(),
                sd.as_ptr(),
                dt,
                recv,
                rc.as_ptr(),
                rd.as_ptr(),
                dt,
                ffi::RSMPI_COMM_WORLD,
            )
        })?;
        Ok(InOut { input: r.input, output: out })
    }

    /// Posts the send; the next receive waits for it.
    fn send(&self, r: SendTo) -> Result<Work<HostBuffer>, CommError> {
        r.validate(self.0.rank, self.0.size)?;
        let n = count(r.buf.len())?;
        // SAFETY: reading a handle constant of the MPI library (overwritten by MPI_Isend).
        let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: the buffer holds `n` elements and stays alive, unmoved on the heap, in
        // `sends` until the request completes (`recv` waits for it, `Drop` of `Mpi` too).
        check("MPI_Isend", unsafe {
            ffi::MPI_Isend(
                r.buf.as_bytes().as_ptr().cast(),
                n,
                datatype(r.buf.dtype()),
                r.dst as c_int,
                r.tag as c_int,
                ffi::RSMPI_COMM_WORLD,
                &mut req,
            )
        })?;
        let (done, work) = Work::pending();
        self.0.sends.lock().unwrap_or_else(|p| p.into_inner()).push(Posted { req, buf: r.buf, done });
        Ok(work)
    }

    /// Receives, then waits for the sends posted before.
    fn recv(&self, mut r: RecvFrom) -> Result<HostBuffer, CommError> {
        let n = count(r.buf.len())?;
        // SAFETY: the buffer holds `n` elements; the call blocks until they are received.
        check("MPI_Recv", unsafe {
            ffi::MPI_Recv(
                r.buf.as_bytes_mut().as_mut_ptr().cast(),
                n,
                datatype(r.buf.dtype()),
                r.src as c_int,
                r.tag as c_int,
                ffi::RSMPI_COMM_WORLD,
                ffi::RSMPI_STATUS_IGNORE,
            )
        })?;
        self.0.finish_sends();
        Ok(r.buf)
    }

    fn barrier(&self) -> Result<(), CommError> {
        // SAFETY: the world communicator of an initialised MPI.
        check("MPI_Barrier", unsafe { ffi::MPI_Barrier(ffi::RSMPI_COMM_WORLD) })
    }
}

/// Validates like every backend, then runs `f`.
fn run<R: Op>(b: &RawMpi, req: R, f: impl FnOnce(&RawMpi, R) -> Result<R::Output, CommError>) -> Work<R::Output> {
    Work::ready(req.validate(b.0.rank, b.0.size).and_then(|()| f(b, req)))
}

macro_rules! ops {
    ($($req:ident => $f:expr),* $(,)?) => {$(
        impl Collective<$req> for RawMpi {
            fn submit(&self, req: $req) -> Work<<$req as Op>::Output> {
                run(self, req, $f)
            }
        }
    )*};
}

ops! {
    AllReduce => RawMpi::all_reduce,
    Reduce => RawMpi::reduce,
    Broadcast => RawMpi::broadcast,
    AllGather => RawMpi::all_gather,
    ReduceScatter => RawMpi::reduce_scatter,
    AllToAll => RawMpi::all_to_all,
    Barrier => |b: &RawMpi, _| b.barrier(),
    Scatter => RawMpi::scatter,
    Gather => RawMpi::gather,
    RecvFrom => RawMpi::recv,
}

impl Collective<SendTo> for RawMpi {
    fn submit(&self, req: SendTo) -> Work<HostBuffer> {
        self.send(req).unwrap_or_else(|e| Work::ready(Err(e)))
    }
}

#[async_trait]
impl Group for RawMpi {
    fn rank(&self) -> Rank {
        self.0.rank
    }
    fn world_size(&self) -> u32 {
        self.0.size
    }
    fn backend_name(&self) -> &'static str {
        NAME
    }
    async fn new_group(&self, _: &[Rank]) -> Result<Option<Arc<dyn Backend>>, CommError> {
        Err(CommError::Unsupported { op: "new_group", dtype: None, backend: NAME })
    }
    async fn shutdown(&self) -> Result<(), CommError> {
        Ok(())
    }
}
