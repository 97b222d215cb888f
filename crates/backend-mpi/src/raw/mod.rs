//! The one module with `unsafe`: every call into MPI (`mpi::ffi`), and the buffers MPI reads
//! and writes while a nonblocking operation is in flight.
//!
//! The rules this module keeps, so an audit starts and ends here:
//!
//! 1. **One thread.** Everything here except [`abort`] is called only from the worker thread,
//!    the thread that initialised MPI (Open MPI's handles are not thread-safe; the types are
//!    `!Send`, which the compiler enforces for [`Comm`] and [`Request`]). The one exception is
//!    a [`SharedComm`]: where MPI provides `MPI_THREAD_MULTIPLE`, a caller's thread runs a
//!    small collective on a group's communicator itself, holding the group's lane lock, which
//!    the worker also takes before it starts a collective on that group or frees the
//!    communicator; a request of such an op that does not complete at once moves to the worker
//!    (then [`Request`] crosses threads, as `MPI_THREAD_MULTIPLE` allows).
//! 2. **Owned buffers.** A nonblocking call takes its buffers *by value* and moves them into the
//!    returned [`Request`]; they come back only from [`Request::into_bufs`] after MPI reported the
//!    request complete. Heap storage of a [`HostBuffer`] does not move when the struct moves, so
//!    the pointers handed to MPI stay valid. Count and displacement arrays live in the request
//!    too (MPI may read them until completion).
//! 3. **Never free what MPI may still touch.** Dropping a request that did not complete leaks
//!    its buffers (and the MPI request) instead of freeing them; an issue call that fails leaks
//!    its buffers as well (MPI's state is undefined after an error).
//! 4. **Every return code is checked.** Communicators use `MPI_ERRORS_RETURN` (set on
//!    `MPI_COMM_WORLD` before any communicator is derived from it, and again on each new one),
//!    so a failing call returns an error code here instead of aborting the job.

use std::ffi::{c_char, c_int, c_void};
use std::mem::MaybeUninit;

use comm_core::{CommError, DType, ReduceOp};
use mpi::ffi;

mod calls;
mod half;
mod request;

pub(crate) use calls::*;
pub use half::HalfOps;
pub(crate) use request::*;

/// An MPI call that returned an error code.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{call} failed: {text} (MPI error class {class})")]
pub(crate) struct MpiError {
    /// The MPI function.
    pub(crate) call: &'static str,
    /// Its error class (`MPI_Error_class`), comparable across implementations.
    pub(crate) class: c_int,
    /// `MPI_Error_string`, trimmed.
    pub(crate) text: String,
}

impl MpiError {
    /// The message was longer than the posted receive buffer (for several requests tested
    /// at once, `MPI_ERR_IN_STATUS`: their statuses are not kept, and of the errors one
    /// receive of a collective can meet, truncation is the one a live peer causes).
    pub(crate) fn is_truncation(&self) -> bool {
        self.class == ffi::MPI_ERR_TRUNCATE as c_int || self.class == ffi::MPI_ERR_IN_STATUS as c_int
    }
}

impl From<MpiError> for CommError {
    fn from(e: MpiError) -> CommError {
        CommError::Backend { backend: "mpi", source: Box::new(e) }
    }
}

pub(super) fn error(call: &'static str, code: c_int) -> MpiError {
    let mut class = code;
    let mut buf = vec![0u8; 1024];
    let mut len: c_int = 0;
    // SAFETY: out-pointers to live locals; `buf` holds 1024 bytes, more than
    // MPI_MAX_ERROR_STRING (256 in Open MPI, 1024 in MPICH), which bounds what MPI writes.
    let text = unsafe {
        ffi::MPI_Error_class(code, &mut class);
        if ffi::MPI_Error_string(code, buf.as_mut_ptr().cast::<c_char>(), &mut len) == 0 {
            buf.truncate(len.clamp(0, 1024) as usize);
            String::from_utf8_lossy(&buf).trim_matches(|c: char| c == '\0' || c.is_whitespace()).to_owned()
        } else {
            format!("error code {code}")
        }
    };
    MpiError { call, class, text }
}

pub(super) fn check(call: &'static str, rc: c_int) -> Result<(), MpiError> {
    if rc == ffi::MPI_SUCCESS as c_int {
        Ok(())
    } else {
        Err(error(call, rc))
    }
}

/// The MPI datatype that carries `d`. f16 and bf16 travel as `uint16_t` (MPI has no such types;
/// reductions on them never use MPI's built-in ops).
pub fn datatype(d: DType) -> ffi::MPI_Datatype {
    // SAFETY: reading constants that mpi-sys's C shim initialises at load time.
    unsafe {
        match d {
            DType::U8 => ffi::RSMPI_UINT8_T,
            DType::I8 => ffi::RSMPI_INT8_T,
            DType::I32 => ffi::RSMPI_INT32_T,
            DType::I64 => ffi::RSMPI_INT64_T,
            DType::F16 | DType::BF16 => ffi::RSMPI_UINT16_T,
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F64 => ffi::RSMPI_DOUBLE,
            _ => ffi::RSMPI_DATATYPE_NULL,
        }
    }
}

/// MPI's built-in op for `op` (for integers, and for f32/f64 in native mode). `Avg` has none:
/// callers sum and divide.
pub fn builtin_op(op: ReduceOp) -> Option<ffi::MPI_Op> {
    // SAFETY: reading constants that mpi-sys's C shim initialises at load time.
    unsafe {
        Some(match op {
            ReduceOp::Sum => ffi::RSMPI_SUM,
            ReduceOp::Prod => ffi::RSMPI_PROD,
            ReduceOp::Min => ffi::RSMPI_MIN,
            ReduceOp::Max => ffi::RSMPI_MAX,
            ReduceOp::BAnd => ffi::RSMPI_BAND,
            ReduceOp::BOr => ffi::RSMPI_BOR,
            ReduceOp::BXor => ffi::RSMPI_BXOR,
            _ => return None,
        })
    }
}

/// Sets `MPI_ERRORS_RETURN` on `MPI_COMM_WORLD`, so communicators derived from it inherit it.
pub(crate) fn world_errors_return() -> Result<(), MpiError> {
    // SAFETY: MPI is initialised (called right after `initialize_with_threading`), on its thread.
    check("MPI_Comm_set_errhandler", unsafe {
        ffi::MPI_Comm_set_errhandler(ffi::RSMPI_COMM_WORLD, ffi::RSMPI_ERRORS_RETURN)
    })
}

/// `(rank, size)` of `MPI_COMM_WORLD`.
pub(crate) fn world_rank_size() -> Result<(i32, i32), MpiError> {
    // SAFETY: reading a constant initialised at load time; MPI is initialised (the worker
    // calls this after MPI_Init).
    unsafe { rank_size(ffi::RSMPI_COMM_WORLD) }
}

/// `(rank, size)` of `comm`.
///
/// # Safety
/// MPI is initialised and `comm` is a valid communicator.
unsafe fn rank_size(comm: ffi::MPI_Comm) -> Result<(i32, i32), MpiError> {
    let (mut rank, mut size) = (0, 0);
    // SAFETY: as the caller promises; out-pointers to locals.
    unsafe {
        check("MPI_Comm_rank", ffi::MPI_Comm_rank(comm, &mut rank))?;
        check("MPI_Comm_size", ffi::MPI_Comm_size(comm, &mut size))?;
    }
    Ok((rank, size))
}

/// `(local rank, local size)` among the ranks sharing this node (`MPI_COMM_TYPE_SHARED`); `cpus`
/// (bit words) is this rank's CPUs on entry and the node's union on return. Collective.
pub(crate) fn node_rank_size(cpus: &mut [u64]) -> Result<(i32, i32), MpiError> {
    let mut node = MaybeUninit::<ffi::MPI_Comm>::uninit();
    let n = c_int::try_from(cpus.len()).expect("a CPU mask of a few words");
    // SAFETY: MPI is initialised; `node` is written by a successful split and only read then;
    // the communicator is freed before returning. `cpus` holds `n` u64 and outlives the
    // blocking allreduce (MPI_IN_PLACE: it is the input too), which every rank of the node
    // makes here, right after the split.
    unsafe {
        check(
            "MPI_Comm_split_type",
            ffi::MPI_Comm_split_type(
                ffi::RSMPI_COMM_WORLD,
                ffi::RSMPI_COMM_TYPE_SHARED,
                0,
                ffi::RSMPI_INFO_NULL,
                node.as_mut_ptr(),
            ),
        )?;
        let mut node = node.assume_init();
        let r = rank_size(node).and_then(|rs| {
            let buf = cpus.as_mut_ptr().cast::<c_void>();
            let rc = ffi::MPI_Allreduce(in_place(), buf, n, ffi::RSMPI_UINT64_T, ffi::RSMPI_BOR, node);
            check("MPI_Allreduce", rc).map(|()| rs)
        });
        ffi::MPI_Comm_free(&mut node);
        r
    }
}

/// `MPI_TAG_UB` (the largest tag), at least 32767 by the standard.
pub(crate) fn tag_ub() -> i32 {
    let mut value: *mut c_int = std::ptr::null_mut();
    let mut flag: c_int = 0;
    // SAFETY: for MPI_TAG_UB, MPI stores a pointer to an int it owns into `value`; we read the
    // int only when `flag` says the attribute is set and the pointer is not null.
    unsafe {
        let rc = ffi::MPI_Comm_get_attr(
            ffi::RSMPI_COMM_WORLD,
            ffi::MPI_TAG_UB as c_int,
            (&mut value as *mut *mut c_int).cast::<c_void>(),
            &mut flag,
        );
        if rc == ffi::MPI_SUCCESS as c_int && flag != 0 && !value.is_null() {
            *value
        } else {
            32767
        }
    }
}

/// The tag of [`iexchange`](calls::iexchange)'s messages: the top block of tags, which user tags (`tag << 3 |
/// dtype`, tag ≤ `(MPI_TAG_UB >> 3) - 1`) never reach.
pub(crate) fn exchange_tag() -> i32 {
    (tag_ub() >> 3) << 3
}

/// The tag of an all_reduce input sent beside the exchange ([`imessages`](calls::imessages)): the next in the
/// reserved block (of 8, as `MPI_TAG_UB` is `2^k - 1`: the worker checks it).
pub(crate) fn bulk_tag() -> i32 {
    exchange_tag() + 1
}

/// The tag of a poisoned group's notice to its peers ([`take_notice`](request::take_notice)).
pub(crate) fn notice_tag() -> i32 {
    exchange_tag() + 2
}

/// Ends the whole job: `MPI_Abort(MPI_COMM_WORLD, code)`. Callable from any thread (MPI is
/// initialised with `MPI_THREAD_MULTIPLE` for this); the caller checks that MPI is live.
pub(crate) fn abort(code: i32) {
    // SAFETY: the caller checked that MPI is initialised and not finalised. MPI_Abort is the one
    // call made off the worker thread; MPI_THREAD_MULTIPLE allows it.
    unsafe {
        ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code);
    }
}

extern "C" {
    fn atexit(callback: extern "C" fn()) -> c_int;
    /// `MPI_IN_PLACE` of the MPI the crate is built against (`csrc/in_place.c`).
    fn comm_mpi_in_place() -> *mut c_void;
}

/// `MPI_IN_PLACE`, for a send buffer that is the receive buffer.
fn in_place() -> *const c_void {
    // SAFETY: a C function with no arguments that returns a constant.
    unsafe { comm_mpi_in_place() }
}

/// Registers `f` to run at process exit (C `atexit`: after `main` returns or `exit` is called).
pub(crate) fn at_exit(f: extern "C" fn()) -> bool {
    // SAFETY: `f` is a plain `extern "C" fn()` with no captured state; atexit only stores it.
    unsafe { atexit(f) == 0 }
}

/// An owned communicator (never `MPI_COMM_WORLD` itself): freed on drop.
pub(crate) struct Comm {
    raw: ffi::MPI_Comm,
    rank: i32,
    size: i32,
}

impl Comm {
    fn adopt(raw: ffi::MPI_Comm) -> Result<Comm, MpiError> {
        // SAFETY: `raw` is a valid communicator that we own (fresh from dup/split).
        let (rank, size) = unsafe {
            check("MPI_Comm_set_errhandler", ffi::MPI_Comm_set_errhandler(raw, ffi::RSMPI_ERRORS_RETURN))?;
            rank_size(raw)?
        };
        Ok(Comm { raw, rank, size })
    }

    /// A handle for direct calls from callers' threads (see [`SharedComm`]).
    pub(crate) fn share(&self) -> SharedComm {
        SharedComm(std::mem::ManuallyDrop::new(Comm { raw: self.raw, rank: self.rank, size: self.size }))
    }

    /// This process's rank in the communicator.
    pub(crate) fn rank(&self) -> i32 {
        self.rank
    }

    /// Number of ranks.
    pub(crate) fn size(&self) -> i32 {
        self.size
    }

    /// `MPI_Comm_split`: members (`Some(key)`) get the new communicator, ordered by key. Blocking:
    /// call it only once every rank is known to have arrived.
    pub(crate) fn split(&self, key: Option<i32>) -> Result<Option<Comm>, MpiError> {
        // SAFETY: reading a constant initialised at load time (`MPI_UNDEFINED`: not a member).
        let color = if key.is_some() { 0 } else { unsafe { ffi::RSMPI_UNDEFINED } };
        let mut out = MaybeUninit::<ffi::MPI_Comm>::uninit();
        // SAFETY: `self.raw` is valid; `out` is read only after a successful call.
        let raw = unsafe {
            check("MPI_Comm_split", ffi::MPI_Comm_split(self.raw, color, key.unwrap_or(0), out.as_mut_ptr()))?;
            out.assume_init()
        };
        // SAFETY: reading a constant initialised at load time.
        if raw == unsafe { ffi::RSMPI_COMM_NULL } {
            return Ok(None);
        }
        Comm::adopt(raw).map(Some)
    }
}

/// A communicator's handle for the callers' threads (rule 1): not owned, never freed through
/// it. The lane that holds it drops it before the worker frees the communicator.
pub(crate) struct SharedComm(std::mem::ManuallyDrop<Comm>);

// SAFETY: an MPI communicator handle may be used from any thread once MPI provides
// MPI_THREAD_MULTIPLE (the worker shares one only then); the lane lock keeps collectives on it
// from two threads apart and its lifetime inside the communicator's.
unsafe impl Send for SharedComm {}
// SAFETY: as above; it is only ever used through the lane lock.
unsafe impl Sync for SharedComm {}

impl std::ops::Deref for SharedComm {
    /// The communicator as a [`Comm`] that is never freed through it.
    type Target = Comm;
    fn deref(&self) -> &Comm {
        &self.0
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: we own the communicator; the worker drops every Comm before MPI_Finalize and
        // only once its own requests on it completed (or it skips finalising altogether).
        unsafe {
            ffi::MPI_Comm_free(&mut self.raw);
        }
    }
}

/// A duplicate of `MPI_COMM_WORLD` being made (`MPI_Comm_idup`): nonblocking, so a rank that
/// never joins makes the others time out instead of hanging.
pub(crate) struct PendingDup {
    req: ffi::MPI_Request,
    /// Where MPI writes the new handle; boxed so its address is stable until completion.
    out: Box<MaybeUninit<ffi::MPI_Comm>>,
    done: bool,
}

impl PendingDup {
    /// Starts duplicating `MPI_COMM_WORLD`.
    pub(crate) fn world() -> Result<PendingDup, MpiError> {
        // SAFETY: reading a constant initialised at load time.
        let mut p =
            PendingDup { req: unsafe { ffi::RSMPI_REQUEST_NULL }, out: Box::new(MaybeUninit::uninit()), done: false };
        // SAFETY: `p.out` is boxed (stable address) and kept alive by `p` until completion (or
        // leaked by Drop if it never completes).
        check("MPI_Comm_idup", unsafe { ffi::MPI_Comm_idup(ffi::RSMPI_COMM_WORLD, p.out.as_mut_ptr(), &mut p.req) })?;
        Ok(p)
    }

    /// `Some(communicator)` once the duplicate is ready.
    pub(crate) fn test(&mut self) -> Result<Option<Comm>, MpiError> {
        if self.done {
            return Ok(None);
        }
        let mut flag: c_int = 0;
        // SAFETY: `self.req` is our live request; status ignored.
        check("MPI_Test", unsafe { ffi::MPI_Test(&mut self.req, &mut flag, ffi::RSMPI_STATUS_IGNORE) })?;
        if flag == 0 {
            return Ok(None);
        }
        self.done = true;
        // SAFETY: the request completed, so MPI wrote the new communicator.
        Comm::adopt(unsafe { self.out.assume_init_read() }).map(Some)
    }
}

impl Drop for PendingDup {
    fn drop(&mut self) {
        if !self.done {
            // MPI may still write the handle: never free its slot.
            std::mem::forget(std::mem::replace(&mut self.out, Box::new(MaybeUninit::uninit())));
        }
    }
}
