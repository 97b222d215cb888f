//! The one module with `unsafe`: every call into MPI (`mpi::ffi`), and the buffers MPI reads
//! and writes while a nonblocking operation is in flight.
//!
//! The rules this module keeps, so an audit starts and ends here:
//!
//! 1. **One thread.** Everything here except [`abort`] is called only from the actor thread,
//!    the thread that initialised MPI (Open MPI's handles are not thread-safe; the types are
//!    `!Send`, which the compiler enforces for [`Comm`] and [`Request`]). The one exception is
//!    a [`SharedComm`]: where MPI provides `MPI_THREAD_MULTIPLE`, a caller's thread runs a
//!    small collective on a group's communicator itself, holding the group's lane lock, which
//!    the actor also takes before it starts a collective on that group or frees the
//!    communicator; a request of such an op that does not complete at once moves to the actor
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

use comm_core::{bf16, f16, CommError, DType, HostBuffer, ReduceOp};
use mpi::ffi;

/// An MPI call that returned an error code.
#[derive(Debug, Clone)]
pub(crate) struct MpiError {
    /// The MPI function.
    pub(crate) call: &'static str,
    /// Its error class (`MPI_Error_class`), comparable across implementations.
    pub(crate) class: c_int,
    /// `MPI_Error_string`, trimmed.
    pub(crate) text: String,
}

impl std::fmt::Display for MpiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} failed: {} (MPI error class {})", self.call, self.text, self.class)
    }
}

impl std::error::Error for MpiError {}

impl MpiError {
    /// The message was longer than the posted receive buffer.
    pub(crate) fn is_truncation(&self) -> bool {
        self.class == ffi::MPI_ERR_TRUNCATE as c_int
    }

    pub(crate) fn into_comm(self) -> CommError {
        CommError::Backend { backend: "mpi", source: Box::new(self) }
    }
}

fn error(call: &'static str, code: c_int) -> MpiError {
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

fn check(call: &'static str, rc: c_int) -> Result<(), MpiError> {
    if rc == ffi::MPI_SUCCESS as c_int {
        Ok(())
    } else {
        Err(error(call, rc))
    }
}

/// The MPI datatype that carries `d`. f16 and bf16 travel as `uint16_t` (MPI has no such types;
/// reductions on them never use MPI's built-in ops).
pub(crate) fn datatype(d: DType) -> ffi::MPI_Datatype {
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
pub(crate) fn builtin_op(op: ReduceOp) -> Option<ffi::MPI_Op> {
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

/// `MPI_UNDEFINED` (the color of ranks that are not in a split's new communicator).
fn undefined() -> c_int {
    // SAFETY: reading a constant initialised at load time.
    unsafe { ffi::RSMPI_UNDEFINED }
}

// ---------------------------------------------------------------------------------------------
// Process-wide calls

/// Sets `MPI_ERRORS_RETURN` on `MPI_COMM_WORLD`, so communicators derived from it inherit it.
pub(crate) fn world_errors_return() -> Result<(), MpiError> {
    // SAFETY: MPI is initialised (called right after `initialize_with_threading`), on its thread.
    check("MPI_Comm_set_errhandler", unsafe {
        ffi::MPI_Comm_set_errhandler(ffi::RSMPI_COMM_WORLD, ffi::RSMPI_ERRORS_RETURN)
    })
}

/// `(rank, size)` of `MPI_COMM_WORLD`.
pub(crate) fn world_rank_size() -> Result<(i32, i32), MpiError> {
    let (mut rank, mut size) = (0, 0);
    // SAFETY: MPI is initialised; out-pointers to locals.
    unsafe {
        check("MPI_Comm_rank", ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut rank))?;
        check("MPI_Comm_size", ffi::MPI_Comm_size(ffi::RSMPI_COMM_WORLD, &mut size))?;
    }
    Ok((rank, size))
}

/// `(local rank, local size)`: this process's place among the ranks sharing its node
/// (`MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`). Collective over the world.
pub(crate) fn node_rank_size() -> Result<(i32, i32), MpiError> {
    let mut node = MaybeUninit::<ffi::MPI_Comm>::uninit();
    // SAFETY: MPI is initialised; `node` is written by a successful split and only read then;
    // the communicator is freed before returning.
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
        let (mut rank, mut size) = (0, 0);
        let r = check("MPI_Comm_rank", ffi::MPI_Comm_rank(node, &mut rank))
            .and_then(|()| check("MPI_Comm_size", ffi::MPI_Comm_size(node, &mut size)));
        ffi::MPI_Comm_free(&mut node);
        r.map(|()| (rank, size))
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

/// Ends the whole job: `MPI_Abort(MPI_COMM_WORLD, code)`. Callable from any thread (MPI is
/// initialised with `MPI_THREAD_MULTIPLE` for this); the caller checks that MPI is live.
pub(crate) fn abort(code: i32) {
    // SAFETY: the caller checked that MPI is initialised and not finalised. MPI_Abort is the one
    // call made off the actor thread; MPI_THREAD_MULTIPLE allows it.
    unsafe {
        ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code);
    }
}

extern "C" {
    fn atexit(callback: extern "C" fn()) -> c_int;
}

/// Registers `f` to run at process exit (C `atexit`: after `main` returns or `exit` is called).
pub(crate) fn at_exit(f: extern "C" fn()) -> bool {
    // SAFETY: `f` is a plain `extern "C" fn()` with no captured state; atexit only stores it.
    unsafe { atexit(f) == 0 }
}

// ---------------------------------------------------------------------------------------------
// Communicators

/// An owned communicator (never `MPI_COMM_WORLD` itself): freed on drop.
pub(crate) struct Comm {
    raw: ffi::MPI_Comm,
    rank: i32,
    size: i32,
}

impl Comm {
    fn adopt(raw: ffi::MPI_Comm) -> Result<Comm, MpiError> {
        let (mut rank, mut size) = (0, 0);
        // SAFETY: `raw` is a valid communicator that we own (fresh from dup/split).
        unsafe {
            check("MPI_Comm_set_errhandler", ffi::MPI_Comm_set_errhandler(raw, ffi::RSMPI_ERRORS_RETURN))?;
            check("MPI_Comm_rank", ffi::MPI_Comm_rank(raw, &mut rank))?;
            check("MPI_Comm_size", ffi::MPI_Comm_size(raw, &mut size))?;
        }
        Ok(Comm { raw, rank, size })
    }

    /// This process's rank in the communicator.
    pub(crate) fn rank(&self) -> i32 {
        self.rank
    }

    /// Number of ranks.
    pub(crate) fn size(&self) -> i32 {
        self.size
    }

    /// `MPI_Comm_split`: members (`Some(key)`) get the new communicator, ordered by key; the
    /// others get `None`. Blocking and collective over `self`: call it only once every rank is
    /// known to have arrived.
    pub(crate) fn split(&self, key: Option<i32>) -> Result<Option<Comm>, MpiError> {
        let color = if key.is_some() { 0 } else { undefined() };
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
/// it. The lane that holds it drops it before the actor frees the communicator.
pub(crate) struct SharedComm {
    raw: ffi::MPI_Comm,
    rank: i32,
    size: i32,
}

// SAFETY: an MPI communicator handle may be used from any thread once MPI provides
// MPI_THREAD_MULTIPLE (the actor shares one only then); the lane lock keeps collectives on it
// from two threads apart and its lifetime inside the communicator's.
unsafe impl Send for SharedComm {}
// SAFETY: as above; it is only ever used through the lane lock.
unsafe impl Sync for SharedComm {}

impl Comm {
    /// A handle for direct calls from callers' threads (see [`SharedComm`]).
    pub(crate) fn share(&self) -> SharedComm {
        SharedComm { raw: self.raw, rank: self.rank, size: self.size }
    }
}

impl SharedComm {
    /// Runs `f` with the communicator as a [`Comm`] that is not freed afterwards.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&Comm) -> R) -> R {
        let comm = std::mem::ManuallyDrop::new(Comm { raw: self.raw, rank: self.rank, size: self.size });
        f(&comm)
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: we own the communicator; the actor drops every Comm before MPI_Finalize and
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

// ---------------------------------------------------------------------------------------------
// Requests with owned buffers

/// The buffers a request uses, handed back on completion.
#[derive(Debug, Default)]
pub(crate) struct Bufs {
    /// What MPI reads (or, for in-place calls such as `MPI_Ibcast`, nothing).
    pub(crate) send: Option<HostBuffer>,
    /// What MPI writes (or reads and writes, in place).
    pub(crate) recv: Option<HostBuffer>,
}

/// How a completed request ended.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Completion {
    /// Elements received (receives only).
    pub(crate) count: Option<usize>,
}

/// What [`Request::test`] saw.
#[derive(Debug)]
pub(crate) enum Polled {
    /// Still in flight.
    Pending,
    /// Completed successfully.
    Done(Completion),
    /// MPI reported an error; `completed` says whether the request is finished (its buffers
    /// can be taken back) or in an unknown state (they stay with the request).
    Failed { err: MpiError, completed: bool },
}

/// A nonblocking MPI operation in flight, owning every buffer it uses.
pub(crate) struct Request {
    raw: ffi::MPI_Request,
    bufs: Bufs,
    /// Count and displacement arrays the call points into.
    _arrays: Vec<Vec<c_int>>,
    datatype: ffi::MPI_Datatype,
    done: bool,
}

// SAFETY: a request moves to another thread only where MPI provides MPI_THREAD_MULTIPLE (a
// caller's direct op that did not finish at once is handed to the actor, see `SharedComm`),
// and MPI request handles are then valid on any thread; its buffers are owned (rule 2).
unsafe impl Send for Request {}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request").field("done", &self.done).finish()
    }
}

/// A buffer's length as an MPI count.
pub(crate) fn count(op: &'static str, n: usize) -> Result<c_int, CommError> {
    c_int::try_from(n).map_err(|_| CommError::InvalidArgument {
        op,
        reason: format!("{n} elements do not fit MPI's int counts (at most {} per call)", c_int::MAX),
    })
}

fn counts(op: &'static str, v: &[usize]) -> Result<Vec<c_int>, CommError> {
    v.iter().map(|&n| count(op, n)).collect()
}

fn send_ptr(b: &Option<HostBuffer>) -> *const c_void {
    b.as_ref().map_or(std::ptr::null(), |b| b.as_bytes().as_ptr().cast())
}

fn recv_ptr(b: &mut Option<HostBuffer>) -> *mut c_void {
    b.as_mut().map_or(std::ptr::null_mut(), |b| b.as_bytes_mut().as_mut_ptr().cast())
}

impl Request {
    /// Moves `bufs` and `arrays` into a new request and issues it with `issue`, which gets the
    /// buffers' pointers, the arrays and the request slot.
    fn start(
        call: &'static str,
        datatype: ffi::MPI_Datatype,
        mut bufs: Bufs,
        arrays: Vec<Vec<c_int>>,
        issue: impl FnOnce(*const c_void, *mut c_void, &[Vec<c_int>], *mut ffi::MPI_Request) -> c_int,
    ) -> Result<Request, CommError> {
        let s = send_ptr(&bufs.send);
        let r = recv_ptr(&mut bufs.recv);
        // SAFETY: reading a constant initialised at load time.
        let mut req =
            Request { raw: unsafe { ffi::RSMPI_REQUEST_NULL }, bufs, _arrays: Vec::new(), datatype, done: false };
        req._arrays = arrays;
        let rc = issue(s, r, &req._arrays, &mut req.raw);
        if let Err(e) = check(call, rc) {
            // MPI's state after a failed issue is undefined: keep (leak) what it was given.
            std::mem::forget(req);
            return Err(e.into_comm());
        }
        Ok(req)
    }

    /// Polls the request once (this also drives MPI's progress engine).
    pub(crate) fn test(&mut self) -> Polled {
        if self.done {
            return Polled::Done(Completion { count: None });
        }
        let mut flag: c_int = 0;
        let mut status = MaybeUninit::<ffi::MPI_Status>::zeroed();
        // SAFETY: `self.raw` is our live request; `status` is a zeroed out-parameter.
        let rc = unsafe { ffi::MPI_Test(&mut self.raw, &mut flag, status.as_mut_ptr()) };
        if rc != ffi::MPI_SUCCESS as c_int {
            let err = error("MPI_Test", rc);
            if flag != 0 {
                // Completed with an error: MPI keeps such a request allocated; release it.
                self.done = true;
                // SAFETY: the request is complete; freeing it is allowed and it is not used again.
                unsafe {
                    if self.raw != ffi::RSMPI_REQUEST_NULL {
                        ffi::MPI_Request_free(&mut self.raw);
                    }
                }
            }
            return Polled::Failed { err, completed: flag != 0 };
        }
        if flag == 0 {
            return Polled::Pending;
        }
        self.done = true;
        let mut n: c_int = -1;
        // SAFETY: `status` was filled by the successful MPI_Test above.
        let got = unsafe { ffi::MPI_Get_count(status.as_ptr(), self.datatype, &mut n) };
        let count = (got == ffi::MPI_SUCCESS as c_int && n >= 0).then_some(n as usize);
        Polled::Done(Completion { count })
    }

    /// Asks MPI to cancel a receive that has not matched (used when it times out). Poll again
    /// to see it complete.
    pub(crate) fn cancel(&mut self) {
        if !self.done {
            // SAFETY: `self.raw` is our live request.
            unsafe {
                ffi::MPI_Cancel(&mut self.raw);
            }
        }
    }

    /// Whether MPI is finished with the request (its buffers can be taken back).
    pub(crate) fn is_done(&self) -> bool {
        self.done
    }

    /// The buffers, once the request completed; `None` (and the buffers stay leaked with the
    /// request) if it did not.
    pub(crate) fn into_bufs(mut self) -> Option<Bufs> {
        if self.done {
            Some(std::mem::take(&mut self.bufs))
        } else {
            None
        }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        if !self.done {
            // MPI may still read or write these: never free them.
            std::mem::forget(std::mem::take(&mut self.bufs));
            std::mem::forget(std::mem::take(&mut self._arrays));
        }
    }
}

/// `MPI_Isend` of the whole buffer.
pub(crate) fn isend(comm: &Comm, buf: HostBuffer, dst: i32, tag: i32) -> Result<Request, CommError> {
    let (dt, n) = (datatype(buf.dtype()), count("send", buf.len())?);
    let bufs = Bufs { send: Some(buf), recv: None };
    Request::start("MPI_Isend", dt, bufs, vec![], |s, _, _, req| {
        // SAFETY: `s` points to `n` elements of the owned send buffer (rule 2).
        unsafe { ffi::MPI_Isend(s, n, dt, dst, tag, comm.raw, req) }
    })
}

/// `MPI_Irecv` into the whole buffer.
pub(crate) fn irecv(comm: &Comm, buf: HostBuffer, src: i32, tag: i32) -> Result<Request, CommError> {
    let (dt, n) = (datatype(buf.dtype()), count("recv", buf.len())?);
    let bufs = Bufs { send: None, recv: Some(buf) };
    Request::start("MPI_Irecv", dt, bufs, vec![], |_, r, _, req| {
        // SAFETY: `r` points to `n` writable elements of the owned receive buffer (rule 2).
        unsafe { ffi::MPI_Irecv(r, n, dt, src, tag, comm.raw, req) }
    })
}

/// A message from `src` waiting to be received, whatever its tag: `(tag, bytes)`.
pub(crate) fn probe(comm: &Comm, src: i32) -> Option<(i32, usize)> {
    let mut flag: c_int = 0;
    let mut status = MaybeUninit::<ffi::MPI_Status>::zeroed();
    let mut n: c_int = -1;
    // SAFETY: out-parameters to locals; `status` is read only when a message was found.
    unsafe {
        let rc = ffi::MPI_Iprobe(src, ffi::RSMPI_ANY_TAG, comm.raw, &mut flag, status.as_mut_ptr());
        if rc != ffi::MPI_SUCCESS as c_int || flag == 0 {
            return None;
        }
        ffi::MPI_Get_count(status.as_ptr(), ffi::RSMPI_UINT8_T, &mut n);
        Some((status.assume_init().MPI_TAG, n.max(0) as usize))
    }
}

/// `MPI_Ibarrier`.
pub(crate) fn ibarrier(comm: &Comm) -> Result<Request, CommError> {
    // SAFETY: reading a constant initialised at load time.
    let dt = unsafe { ffi::RSMPI_UINT8_T };
    Request::start("MPI_Ibarrier", dt, Bufs::default(), vec![], |_, _, _, req| {
        // SAFETY: no buffers.
        unsafe { ffi::MPI_Ibarrier(comm.raw, req) }
    })
}

/// `MPI_Ibcast` of `buf` in place from `root`.
pub(crate) fn ibcast(comm: &Comm, buf: HostBuffer, root: i32) -> Result<Request, CommError> {
    let (dt, n) = (datatype(buf.dtype()), count("broadcast", buf.len())?);
    Request::start("MPI_Ibcast", dt, Bufs { send: None, recv: Some(buf) }, vec![], |_, r, _, req| {
        // SAFETY: `r` points to `n` elements of the owned buffer (rule 2).
        unsafe { ffi::MPI_Ibcast(r, n, dt, root, comm.raw, req) }
    })
}

/// `MPI_Allgather`, blocking (only where every rank is known to be in this same call, as for
/// [`allreduce`]).
pub(crate) fn allgather(comm: &Comm, send: &HostBuffer, recv: &mut HostBuffer) -> Result<(), CommError> {
    let dt = datatype(send.dtype());
    let n = count("all_gather", send.len())?;
    assert_eq!(recv.byte_len(), send.byte_len() * comm.size as usize, "allgather: wrong output size");
    let (s, r) = (send.as_bytes().as_ptr().cast::<c_void>(), recv.as_bytes_mut().as_mut_ptr().cast::<c_void>());
    // SAFETY: `s` holds `n` elements and `r` `size × n`, both outliving the (blocking) call.
    check("MPI_Allgather", unsafe { ffi::MPI_Allgather(s, n, dt, r, n, dt, comm.raw) }).map_err(MpiError::into_comm)
}

/// `MPI_Iallgather`: every rank's `send` (same length) concatenated into `recv`.
pub(crate) fn iallgather(comm: &Comm, send: HostBuffer, recv: HostBuffer) -> Result<Request, CommError> {
    let dt = datatype(send.dtype());
    let n = count("all_gather", send.len())?;
    debug_assert_eq!(recv.len(), send.len() * comm.size as usize);
    Request::start("MPI_Iallgather", dt, Bufs { send: Some(send), recv: Some(recv) }, vec![], |s, r, _, req| {
        // SAFETY: `s` holds `n` elements and `r` holds `size × n` (rule 2).
        unsafe { ffi::MPI_Iallgather(s, n, dt, r, n, dt, comm.raw, req) }
    })
}

/// `MPI_Iallgatherv`: rank `j`'s `send` (`counts[j]` elements) lands at `displs[j]` of `recv`.
pub(crate) fn iallgatherv(
    comm: &Comm,
    send: HostBuffer,
    recv: HostBuffer,
    parts: &[(usize, usize)],
) -> Result<Request, CommError> {
    let dt = datatype(send.dtype());
    let n = count("all_reduce", send.len())?;
    let c = counts("all_reduce", &parts.iter().map(|p| p.1).collect::<Vec<_>>())?;
    let d = counts("all_reduce", &parts.iter().map(|p| p.0).collect::<Vec<_>>())?;
    debug_assert!(parts.iter().all(|&(at, len)| at + len <= recv.len()));
    Request::start("MPI_Iallgatherv", dt, Bufs { send: Some(send), recv: Some(recv) }, vec![c, d], |s, r, a, req| {
        // SAFETY: `s` holds `n` elements; every (displacement, count) lies inside `r` (checked
        // above); the arrays live in the request (rule 2).
        unsafe { ffi::MPI_Iallgatherv(s, n, dt, r, a[0].as_ptr(), a[1].as_ptr(), dt, comm.raw, req) }
    })
}

/// `MPI_Igather` to `root`; `recv` (`size × send.len()`) only on the root.
pub(crate) fn igather(
    comm: &Comm,
    send: HostBuffer,
    recv: Option<HostBuffer>,
    root: i32,
) -> Result<Request, CommError> {
    let dt = datatype(send.dtype());
    let n = count("gather", send.len())?;
    debug_assert!(recv.as_ref().is_none_or(|r| r.len() == send.len() * comm.size as usize));
    debug_assert_eq!(recv.is_some(), comm.rank == root);
    Request::start("MPI_Igather", dt, Bufs { send: Some(send), recv }, vec![], |s, r, _, req| {
        // SAFETY: `s` holds `n` elements; on the root `r` holds `size × n` (rule 2); elsewhere
        // the receive arguments are ignored by MPI.
        unsafe { ffi::MPI_Igather(s, n, dt, r, n, dt, root, comm.raw, req) }
    })
}

/// `MPI_Igatherv` to `root`: rank `j`'s `send` lands at `parts[j]` of the root's `recv`.
pub(crate) fn igatherv(
    comm: &Comm,
    send: HostBuffer,
    recv: Option<HostBuffer>,
    parts: &[(usize, usize)],
    root: i32,
) -> Result<Request, CommError> {
    let dt = datatype(send.dtype());
    let n = count("reduce", send.len())?;
    let c = counts("reduce", &parts.iter().map(|p| p.1).collect::<Vec<_>>())?;
    let d = counts("reduce", &parts.iter().map(|p| p.0).collect::<Vec<_>>())?;
    debug_assert!(recv.as_ref().is_none_or(|r| parts.iter().all(|&(at, len)| at + len <= r.len())));
    Request::start("MPI_Igatherv", dt, Bufs { send: Some(send), recv }, vec![c, d], |s, r, a, req| {
        // SAFETY: `s` holds `n` elements; on the root every part lies inside `r` (checked
        // above); the arrays live in the request (rule 2).
        unsafe { ffi::MPI_Igatherv(s, n, dt, r, a[0].as_ptr(), a[1].as_ptr(), dt, root, comm.raw, req) }
    })
}

/// `MPI_Iscatter` from `root`: block `j` of the root's `send` to rank `j`'s `recv`.
pub(crate) fn iscatter(
    comm: &Comm,
    send: Option<HostBuffer>,
    recv: HostBuffer,
    root: i32,
) -> Result<Request, CommError> {
    let dt = datatype(recv.dtype());
    let n = count("scatter", recv.len())?;
    debug_assert!(send.as_ref().is_none_or(|s| s.len() == recv.len() * comm.size as usize));
    Request::start("MPI_Iscatter", dt, Bufs { send, recv: Some(recv) }, vec![], |s, r, _, req| {
        // SAFETY: on the root `s` holds `size × n` elements (ignored elsewhere); `r` holds `n`.
        unsafe { ffi::MPI_Iscatter(s, n, dt, r, n, dt, root, comm.raw, req) }
    })
}

/// `MPI_Ialltoallv`: `send_parts[j]` of `send` to rank `j`, whose block lands at
/// `recv_parts[i]` of rank `j`'s `recv` for sender `i`. Parts are `(offset, len)` in elements.
pub(crate) fn ialltoallv(
    comm: &Comm,
    send: HostBuffer,
    send_parts: &[(usize, usize)],
    recv: HostBuffer,
    recv_parts: &[(usize, usize)],
) -> Result<Request, CommError> {
    let dt = datatype(send.dtype());
    let arr = |f: fn(&(usize, usize)) -> usize, p: &[(usize, usize)]| {
        counts("all_to_all", &p.iter().map(f).collect::<Vec<_>>())
    };
    let arrays = vec![
        arr(|p| p.1, send_parts)?,
        arr(|p| p.0, send_parts)?,
        arr(|p| p.1, recv_parts)?,
        arr(|p| p.0, recv_parts)?,
    ];
    if send_parts.iter().any(|&(at, len)| at + len > send.len())
        || recv_parts.iter().any(|&(at, len)| at + len > recv.len())
    {
        return Err(CommError::invalid("all_to_all", "a block lies outside its buffer"));
    }
    Request::start("MPI_Ialltoallv", dt, Bufs { send: Some(send), recv: Some(recv) }, arrays, |s, r, a, req| {
        // SAFETY: every (displacement, count) lies inside its buffer (checked above); the arrays
        // live in the request (rule 2).
        unsafe {
            ffi::MPI_Ialltoallv(s, a[0].as_ptr(), a[1].as_ptr(), dt, r, a[2].as_ptr(), a[3].as_ptr(), dt, comm.raw, req)
        }
    })
}

/// `MPI_Iallreduce` of `send` into `recv` (same length) with `op`.
pub(crate) fn iallreduce(
    comm: &Comm,
    send: HostBuffer,
    recv: HostBuffer,
    op: ffi::MPI_Op,
) -> Result<Request, CommError> {
    let dt = datatype(send.dtype());
    let n = count("all_reduce", send.len())?;
    debug_assert_eq!(send.len(), recv.len());
    Request::start("MPI_Iallreduce", dt, Bufs { send: Some(send), recv: Some(recv) }, vec![], |s, r, _, req| {
        // SAFETY: `s` and `r` both hold `n` elements (rule 2).
        unsafe { ffi::MPI_Iallreduce(s, r, n, dt, op, comm.raw, req) }
    })
}

/// `MPI_Allreduce` of `send` into `recv` (same length) with `op`, blocking: only where every
/// rank is known to be in this same call (after the header exchange), as for [`Comm::split`].
pub(crate) fn allreduce(
    comm: &Comm,
    send: &HostBuffer,
    recv: &mut HostBuffer,
    op: ffi::MPI_Op,
) -> Result<(), CommError> {
    let dt = datatype(send.dtype());
    let n = count("all_reduce", send.len())?;
    assert_eq!(send.byte_len(), recv.byte_len(), "allreduce: buffers of different sizes");
    let (s, r) = (send.as_bytes().as_ptr().cast::<c_void>(), recv.as_bytes_mut().as_mut_ptr().cast::<c_void>());
    // SAFETY: both buffers hold `n` elements of `dt` and outlive the (blocking) call.
    check("MPI_Allreduce", unsafe { ffi::MPI_Allreduce(s, r, n, dt, op, comm.raw) }).map_err(MpiError::into_comm)
}

/// `MPI_Ireduce` of `send` into the root's `recv` with `op`.
pub(crate) fn ireduce(
    comm: &Comm,
    send: HostBuffer,
    recv: Option<HostBuffer>,
    op: ffi::MPI_Op,
    root: i32,
) -> Result<Request, CommError> {
    let dt = datatype(send.dtype());
    let n = count("reduce", send.len())?;
    debug_assert!(recv.as_ref().is_none_or(|r| r.len() == send.len()));
    Request::start("MPI_Ireduce", dt, Bufs { send: Some(send), recv }, vec![], |s, r, _, req| {
        // SAFETY: `s` holds `n` elements, and so does `r` on the root (ignored elsewhere).
        unsafe { ffi::MPI_Ireduce(s, r, n, dt, op, root, comm.raw, req) }
    })
}

/// `MPI_Ireduce_scatter_block`: `send` (`size × k`) reduced, block `rank` into `recv` (`k`).
pub(crate) fn ireduce_scatter_block(
    comm: &Comm,
    send: HostBuffer,
    recv: HostBuffer,
    op: ffi::MPI_Op,
) -> Result<Request, CommError> {
    let dt = datatype(send.dtype());
    let n = count("reduce_scatter", recv.len())?;
    debug_assert_eq!(send.len(), recv.len() * comm.size as usize);
    Request::start(
        "MPI_Ireduce_scatter_block",
        dt,
        Bufs { send: Some(send), recv: Some(recv) },
        vec![],
        |s, r, _, req| {
            // SAFETY: `s` holds `size × n` elements and `r` holds `n` (rule 2).
            unsafe { ffi::MPI_Ireduce_scatter_block(s, r, n, dt, op, comm.raw, req) }
        },
    )
}

// ---------------------------------------------------------------------------------------------
// User-defined ops for f16/bf16 (native reduction mode)

/// MPI ops combining f16/bf16 elements (carried as `uint16_t`) through f32: Sum, Prod, Min,
/// Max for each type. Each combination rounds back to 16 bits, so results depend on MPI's
/// reduction order; the default (exact) mode does not use them. (Also what comm-bench's
/// `mpi-raw` baseline reduces f16/bf16 with.)
pub struct HalfOps {
    /// f16 Sum, Prod, Min, Max, then the same for bf16 (only those created so far).
    ops: Vec<ffi::MPI_Op>,
}

macro_rules! half_op {
    ($name:ident, $t:ty, $f:expr) => {
        unsafe extern "C" fn $name(inv: *mut c_void, inout: *mut c_void, len: *mut c_int, _dt: *mut ffi::MPI_Datatype) {
            if len.is_null() {
                return;
            }
            // SAFETY: `len` is MPI's non-null pointer to the element count of this call.
            let n = unsafe { *len }.max(0) as usize;
            if n == 0 || inv.is_null() || inout.is_null() {
                return;
            }
            // SAFETY: MPI calls this with two distinct, non-null arrays of `n` elements of the
            // datatype the op is used with, which is always `uint16_t` (f16/bf16 bits).
            let (x, y) = unsafe {
                (std::slice::from_raw_parts(inv.cast::<$t>(), n), std::slice::from_raw_parts_mut(inout.cast::<$t>(), n))
            };
            let f: fn(f32, f32) -> f32 = $f;
            for (a, b) in x.iter().zip(y.iter_mut()) {
                *b = <$t>::from_f32(f(a.to_f32(), b.to_f32()));
            }
        }
    };
}

half_op!(f16_sum, f16, |a, b| a + b);
half_op!(f16_prod, f16, |a, b| a * b);
half_op!(f16_min, f16, |a, b| if a < b { a } else { b });
half_op!(f16_max, f16, |a, b| if a > b { a } else { b });
half_op!(bf16_sum, bf16, |a, b| a + b);
half_op!(bf16_prod, bf16, |a, b| a * b);
half_op!(bf16_min, bf16, |a, b| if a < b { a } else { b });
half_op!(bf16_max, bf16, |a, b| if a > b { a } else { b });

type UserFn = unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_int, *mut ffi::MPI_Datatype);

impl HalfOps {
    /// [`HalfOps::create`] for users outside this crate (MPI must be initialised).
    pub fn new() -> Result<HalfOps, CommError> {
        Self::create().map_err(MpiError::into_comm)
    }

    /// Registers the eight ops with MPI (`MPI_Op_create`, commutative).
    pub(crate) fn create() -> Result<HalfOps, MpiError> {
        let fns: [UserFn; 8] = [f16_sum, f16_prod, f16_min, f16_max, bf16_sum, bf16_prod, bf16_min, bf16_max];
        let mut made = HalfOps { ops: Vec::with_capacity(8) };
        for f in fns {
            let mut op = MaybeUninit::<ffi::MPI_Op>::uninit();
            // SAFETY: `f` has the MPI_User_function signature; `op` is read only after success.
            unsafe {
                check("MPI_Op_create", ffi::MPI_Op_create(Some(f), 1, op.as_mut_ptr()))?;
                made.ops.push(op.assume_init());
            }
        }
        Ok(made)
    }

    /// The op for `dtype` (f16 or bf16) and `op` (Sum, Prod, Min, Max; Avg uses Sum).
    pub fn get(&self, dtype: DType, op: ReduceOp) -> Option<ffi::MPI_Op> {
        let base = match dtype {
            DType::F16 => 0,
            DType::BF16 => 4,
            _ => return None,
        };
        let i = match op {
            ReduceOp::Sum | ReduceOp::Avg => 0,
            ReduceOp::Prod => 1,
            ReduceOp::Min => 2,
            ReduceOp::Max => 3,
            _ => return None,
        };
        self.ops.get(base + i).copied()
    }
}

impl Drop for HalfOps {
    fn drop(&mut self) {
        for op in &mut self.ops {
            // SAFETY: ops we created; dropped before MPI_Finalize, after the last use.
            unsafe {
                ffi::MPI_Op_free(op);
            }
        }
    }
}
