//! The crate's only `unsafe` code: calls into libcuda and libnccl through cudarc's `result`/`sys`
//! layers, raw device addresses, pinned host memory, and the abort protocol of a communicator.
//!
//! Invariants the rest of the crate keeps (and this module relies on):
//! - A [`DevPtr`] is made from a live `CudaSlice` with an in-bounds offset. Its owner (a staging
//!   buffer or the caller's slice) is kept alive until the completion event recorded after the
//!   op has fired, or forever (the worker's graveyard) when that cannot be known.
//! - A [`Registered`] buffer is held by the worker like [`Pinned`] memory (until the op's event
//!   fired, or the stream drained) and unregistered before it is handed back.
//! - [`Pinned`] memory is written by the host only before its upload is enqueued and read only
//!   after the completion event of its download has fired; a pinned buffer of an op that failed
//!   is never reused or freed while the stream may still touch it.
//! - A [`Comm`] is created, used and destroyed on one thread (the worker's; it is `!Send`). The
//!   only call made on it from another thread is `ncclCommAbort`, by the watchdog, through the
//!   state machine of [`CommState`], which guarantees the owner never enters NCCL with that
//!   communicator once an abort has started.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_void, CStr};
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicU8, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use comm_core::{DType, HostBuffer, ReduceOp};
use cudarc::driver::{self, CudaContext, CudaSlice, CudaStream, DevicePtr, DriverError};
use cudarc::nccl::{result as nccl, sys as nsys};

/// Bytes of an NCCL unique id (`ncclUniqueId`).
pub(crate) const ID_BYTES: usize = 128;

// ---- libraries -------------------------------------------------------------------------------

/// Whether cudarc can load the CUDA driver library (no panic, unlike the first driver call).
pub(crate) fn cuda_lib_present() -> bool {
    // SAFETY: tries `dlopen` on each of cudarc's candidate names and closes what it opened; the
    // driver library's initialisers are what any CUDA program runs.
    unsafe { driver::sys::is_culib_present() }
}

/// Whether cudarc can load libnccl (it looks for `libnccl.so`, not `libnccl.so.2`).
pub(crate) fn nccl_lib_present() -> bool {
    // SAFETY: as `cuda_lib_present`, for NCCL's candidate names.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// Whether the dynamic loader finds a library by this exact name.
pub(crate) fn loadable(name: &str) -> bool {
    // SAFETY: loading runs the library's initialisers; only called with the names of the NVIDIA
    // libraries this crate would load anyway. The handle is closed at once.
    unsafe { libloading::Library::new(name) }.is_ok()
}

/// `cuDriverGetVersion` (e.g. 13000 for CUDA 13.0). Panics when libcuda is missing: call after
/// [`cuda_lib_present`] (and inside `comm_core::catch_panic`).
pub(crate) fn driver_version() -> Result<i32, DriverError> {
    let mut v = 0;
    // SAFETY: writes one int through a valid pointer.
    unsafe { driver::sys::cuDriverGetVersion(&mut v) }.result()?;
    Ok(v)
}

/// NCCL's description of a result code, when libnccl is loadable.
pub(crate) fn nccl_error_string(code: nsys::ncclResult_t) -> Option<String> {
    if !nccl_lib_present() {
        return None;
    }
    comm_core::catch_panic(|| {
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
        let p = unsafe { nsys::ncclGetErrorString(code) };
        cstr(p)
    })
    .ok()
    .flatten()
}

/// NCCL's last error message (per communicator when one is given, else the thread's last).
fn nccl_last_error(comm: nsys::ncclComm_t) -> Option<String> {
    comm_core::catch_panic(|| {
        // SAFETY: `comm` is null or a live communicator of the calling thread; NCCL returns a
        // NUL-terminated string it owns. (Missing in NCCL < 2.13: the loader panics, caught.)
        let p = unsafe { nsys::ncclGetLastError(comm) };
        cstr(p)
    })
    .ok()
    .flatten()
    .filter(|s| !s.is_empty())
}

fn cstr(p: *const c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null pointers passed here come from NCCL and point to NUL-terminated strings.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// A new NCCL unique id (rank 0 of a communicator creates it; starts NCCL's bootstrap root).
pub(crate) fn unique_id() -> Result<[u8; ID_BYTES], NcclCall> {
    let id = nccl::get_uniqueid().map_err(|e| NcclCall::new(e.0, "ncclGetUniqueId", std::ptr::null_mut()))?;
    Ok(id.internal.map(|c| c as u8))
}

// ---- errors of one call -----------------------------------------------------------------------

/// A failed call into CUDA or NCCL, with what was being done.
#[derive(Debug)]
pub(crate) enum CallError {
    /// NCCL returned an error.
    Nccl(NcclCall),
    /// The driver returned an error.
    Cuda { call: &'static str, error: DriverError },
    /// The communicator was aborted (by the watchdog or a timeout); nothing was called.
    Aborted,
}

/// An NCCL error code with NCCL's own last-error text.
#[derive(Debug)]
pub(crate) struct NcclCall {
    pub(crate) code: nsys::ncclResult_t,
    pub(crate) call: &'static str,
    pub(crate) last: Option<String>,
}

impl NcclCall {
    fn new(code: nsys::ncclResult_t, call: &'static str, comm: nsys::ncclComm_t) -> Self {
        NcclCall { code, call, last: nccl_last_error(comm) }
    }
}

fn cuda(call: &'static str) -> impl FnOnce(DriverError) -> CallError {
    move |error| CallError::Cuda { call, error }
}

// ---- the communicator ------------------------------------------------------------------------

const LIVE: u8 = 0;
const ABORTING: u8 = 1;
const GONE: u8 = 2;

/// What the worker and the watchdog share about a communicator.
///
/// `seq` is odd while the owner is inside a call into NCCL. The watchdog aborts only a call it
/// has seen running (same odd `seq`) for longer than the timeout: it moves `state` from LIVE to
/// ABORTING, re-reads `seq` (unchanged: the owner is still inside that call, which the abort is
/// meant to interrupt; changed: it backs off to LIVE), calls `ncclCommAbort` and sets GONE. The
/// owner bumps `seq` *before* looking at `state` when it enters a call, so it never starts a
/// call once an abort is under way.
#[derive(Debug, Default)]
pub(crate) struct CommState {
    raw: AtomicPtr<nsys::ncclComm>,
    seq: AtomicU64,
    state: AtomicU8,
}

impl CommState {
    /// The owner's call counter (odd: inside a call).
    pub(crate) fn seq(&self) -> u64 {
        self.seq.load(SeqCst)
    }

    /// Whether the communicator was aborted or destroyed.
    pub(crate) fn is_gone(&self) -> bool {
        self.state.load(SeqCst) == GONE
    }

    /// Watchdog side: aborts the communicator if the owner is still inside the call numbered
    /// `observed` (odd). Returns whether it aborted.
    pub(crate) fn abort_if_stuck(&self, observed: u64) -> bool {
        if observed.is_multiple_of(2) || self.raw.load(SeqCst).is_null() {
            return false;
        }
        if self.state.compare_exchange(LIVE, ABORTING, SeqCst, SeqCst).is_err() {
            return false;
        }
        if self.seq.load(SeqCst) != observed {
            self.state.store(LIVE, SeqCst);
            return false;
        }
        let raw = self.raw.load(SeqCst);
        // SAFETY: `raw` is a live communicator (state was LIVE, so nobody destroyed it) and the
        // owner cannot start another call on it (state is ABORTING). ncclCommAbort is NCCL's
        // way to interrupt a call that is blocked on that communicator from another thread.
        let _ = unsafe { nccl::comm_abort(raw) };
        self.state.store(GONE, SeqCst);
        true
    }
}

/// An NCCL communicator owned by the thread that created it (`!Send`).
pub(crate) struct Comm {
    state: Arc<CommState>,
    _owner_thread: PhantomData<*mut ()>,
}

/// Marks the owner as inside a call into NCCL until dropped.
struct Inside<'a>(&'a CommState);

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        self.0.seq.fetch_add(1, SeqCst);
    }
}

impl Comm {
    /// `ncclCommInitRank` (blocks until all `world` ranks called it with the same id). The
    /// current thread must have the device's context bound.
    pub(crate) fn init(id: &[u8; ID_BYTES], rank: u32, world: u32) -> Result<Comm, CallError> {
        let id = nsys::ncclUniqueId { internal: id.map(|b| b as c_char) };
        let mut raw: nsys::ncclComm_t = std::ptr::null_mut();
        let (nranks, rank) = (world as i32, rank as i32);
        // SAFETY: `raw` is a valid out-pointer; NCCL fills it on success.
        unsafe { nccl::comm_init_rank(&mut raw, nranks, id, rank) }
            .map_err(|e| CallError::Nccl(NcclCall::new(e.0, "ncclCommInitRank", std::ptr::null_mut())))?;
        let state = Arc::new(CommState::default());
        state.raw.store(raw, SeqCst);
        Ok(Comm { state, _owner_thread: PhantomData })
    }

    /// What the watchdog needs.
    pub(crate) fn state(&self) -> Arc<CommState> {
        self.state.clone()
    }

    fn enter(&self) -> Result<(Inside<'_>, nsys::ncclComm_t), CallError> {
        let st = &*self.state;
        st.seq.fetch_add(1, SeqCst);
        let inside = Inside(st);
        loop {
            match st.state.load(SeqCst) {
                LIVE => return Ok((inside, st.raw.load(SeqCst))),
                // The watchdog is deciding (it will see our new seq and back off) or aborting.
                ABORTING => std::thread::yield_now(),
                _ => return Err(CallError::Aborted),
            }
        }
    }

    fn check(&self, r: Result<nccl::NcclStatus, nccl::NcclError>, call: &'static str) -> Result<(), CallError> {
        r.map(drop).map_err(|e| CallError::Nccl(NcclCall::new(e.0, call, self.state.raw.load(SeqCst))))
    }

    /// Ends the communicator: `ncclCommDestroy` when `healthy`, else `ncclCommAbort`. No-op
    /// when it is already gone (aborted by the watchdog).
    pub(crate) fn close(&self, healthy: bool) -> Result<(), CallError> {
        let st = &*self.state;
        loop {
            match st.state.compare_exchange(LIVE, ABORTING, SeqCst, SeqCst) {
                Ok(_) => break,
                Err(GONE) => return Ok(()),
                Err(_) => std::thread::yield_now(),
            }
        }
        let raw = st.raw.load(SeqCst);
        // SAFETY: `raw` is live (state was LIVE) and owned by this thread, which is not inside
        // another call; after this nothing uses it (state GONE).
        let r = unsafe {
            if healthy {
                nccl::comm_destroy(raw)
            } else {
                nccl::comm_abort(raw)
            }
        };
        st.state.store(GONE, SeqCst);
        r.map(drop).map_err(|e| {
            CallError::Nccl(NcclCall {
                code: e.0,
                call: if healthy { "ncclCommDestroy" } else { "ncclCommAbort" },
                last: None,
            })
        })
    }

    /// Runs `f` (calls into NCCL) between `ncclGroupStart` and `ncclGroupEnd`; `ncclGroupEnd`
    /// runs even when `f` fails, and the first error is returned.
    pub(crate) fn group(&self, f: impl FnOnce() -> Result<(), CallError>) -> Result<(), CallError> {
        {
            let _inside = self.enter()?;
            self.check(nccl::group_start(), "ncclGroupStart")?;
        }
        let r = f();
        let end = {
            let _inside = self.enter()?;
            self.check(nccl::group_end(), "ncclGroupEnd")
        };
        r.and(end)
    }

    /// Enqueues one call on `stream`.
    pub(crate) fn issue(&self, stream: &CudaStream, call: &Call) -> Result<(), CallError> {
        let s = stream.cu_stream() as nsys::cudaStream_t;
        let cs = stream.cu_stream();
        if call.is_empty() {
            return Ok(());
        }
        if let Call::Copy { src, dst, bytes } = call {
            // SAFETY: both addresses are device memory of this context, `bytes` in bounds (DevPtr
            // invariant), kept alive until the op's completion event.
            return unsafe { driver::result::memcpy_dtod_async(dst.0, src.0, *bytes, cs) }
                .map_err(cuda("cuMemcpyDtoDAsync"));
        }
        if let Call::Stall(flag) = call {
            return launch_stall(stream, flag);
        }
        let (_inside, comm) = self.enter()?;
        let vp = |p: &DevPtr| p.0 as *mut c_void;
        // SAFETY: `comm` is live (enter checked) and owned by this thread; every address is device
        // memory of this communicator's context holding `count` elements of `dt` from that
        // address (DevPtr invariant), and stays alive until the completion event recorded after
        // this call has fired.
        let r = unsafe {
            match *call {
                Call::AllReduce { ref send, ref recv, count, dt, op } => {
                    nccl::all_reduce(vp(send), vp(recv), count, dt, op, comm, s)
                }
                Call::Broadcast { ref send, ref recv, count, dt, root } => {
                    nccl::broadcast(vp(send), vp(recv), count, dt, root, comm, s)
                }
                Call::Reduce { ref send, ref recv, count, dt, op, root } => {
                    nccl::reduce(vp(send), vp(recv), count, dt, op, root, comm, s)
                }
                Call::AllGather { ref send, ref recv, count, dt } => {
                    nccl::all_gather(vp(send), vp(recv), count, dt, comm, s)
                }
                Call::ReduceScatter { ref send, ref recv, count, dt, op } => {
                    nccl::reduce_scatter(vp(send), vp(recv), count, dt, op, comm, s)
                }
                Call::Send { ref buf, count, dt, peer } => nccl::send(vp(buf), count, dt, peer, comm, s),
                Call::Recv { ref buf, count, dt, peer } => nccl::recv(vp(buf), count, dt, peer, comm, s),
                Call::Copy { .. } | Call::Stall(_) => unreachable!("handled above"),
            }
        };
        self.check(r, call.name())
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // The worker closes explicitly; this is the fallback (unwinding): abort, never wait.
        let _ = self.close(false);
    }
}

// ---- device memory and calls -----------------------------------------------------------------

/// A device address inside a live allocation (see the module invariants).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DevPtr(u64);

impl DevPtr {
    /// The address of element `offset` of `slice`, for work on `stream`. Makes `stream` wait for
    /// the slice's last tracked write.
    pub(crate) fn of<T>(slice: &CudaSlice<T>, stream: &CudaStream, offset: usize) -> DevPtr {
        assert!(offset <= slice.len(), "offset {offset} past a device buffer of {} elements", slice.len());
        let (p, _record) = slice.device_ptr(stream);
        DevPtr(p + (offset * std::mem::size_of::<T>()) as u64)
    }

    /// No memory (for zero-length transfers, which are never issued).
    pub(crate) const NULL: DevPtr = DevPtr(0);

    /// `bytes` further.
    pub(crate) fn add(self, bytes: usize) -> DevPtr {
        DevPtr(self.0 + bytes as u64)
    }
}

/// NCCL's element type for a dtype.
pub(crate) fn nccl_dtype(d: DType) -> Option<nsys::ncclDataType_t> {
    use nsys::ncclDataType_t as T;
    Some(match d {
        DType::U8 => T::ncclUint8,
        DType::I8 => T::ncclInt8,
        DType::I32 => T::ncclInt32,
        DType::I64 => T::ncclInt64,
        DType::F16 => T::ncclFloat16,
        DType::BF16 => T::ncclBfloat16,
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
        _ => return None,
    })
}

/// NCCL's reduction for a reduce op (bitwise ops have none).
pub(crate) fn nccl_op(op: ReduceOp) -> Option<nsys::ncclRedOp_t> {
    use nsys::ncclRedOp_t as O;
    Some(match op {
        ReduceOp::Sum => O::ncclSum,
        ReduceOp::Prod => O::ncclProd,
        ReduceOp::Min => O::ncclMin,
        ReduceOp::Max => O::ncclMax,
        ReduceOp::Avg => O::ncclAvg,
        _ => return None,
    })
}

/// One call into NCCL (or the driver) on the communicator's stream. `count`s are elements.
#[derive(Debug)]
pub(crate) enum Call {
    AllReduce {
        send: DevPtr,
        recv: DevPtr,
        count: usize,
        dt: nsys::ncclDataType_t,
        op: nsys::ncclRedOp_t,
    },
    Broadcast {
        send: DevPtr,
        recv: DevPtr,
        count: usize,
        dt: nsys::ncclDataType_t,
        root: i32,
    },
    Reduce {
        send: DevPtr,
        recv: DevPtr,
        count: usize,
        dt: nsys::ncclDataType_t,
        op: nsys::ncclRedOp_t,
        root: i32,
    },
    AllGather {
        send: DevPtr,
        recv: DevPtr,
        count: usize,
        dt: nsys::ncclDataType_t,
    },
    ReduceScatter {
        send: DevPtr,
        recv: DevPtr,
        count: usize,
        dt: nsys::ncclDataType_t,
        op: nsys::ncclRedOp_t,
    },
    Send {
        buf: DevPtr,
        count: usize,
        dt: nsys::ncclDataType_t,
        peer: i32,
    },
    Recv {
        buf: DevPtr,
        count: usize,
        dt: nsys::ncclDataType_t,
        peer: i32,
    },
    /// Device-to-device copy (an all_to_all/scatter/gather block a rank keeps for itself).
    Copy {
        src: DevPtr,
        dst: DevPtr,
        bytes: usize,
    },
    /// Blocks the stream until the flag is set (diagnostics: simulates a hung op).
    Stall(Arc<AtomicBool>),
}

impl Call {
    fn is_empty(&self) -> bool {
        match self {
            Call::AllReduce { count, .. }
            | Call::Broadcast { count, .. }
            | Call::Reduce { count, .. }
            | Call::AllGather { count, .. }
            | Call::ReduceScatter { count, .. }
            | Call::Send { count, .. }
            | Call::Recv { count, .. } => *count == 0,
            Call::Copy { bytes, .. } => *bytes == 0,
            Call::Stall(_) => false,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Call::AllReduce { .. } => "ncclAllReduce",
            Call::Broadcast { .. } => "ncclBroadcast",
            Call::Reduce { .. } => "ncclReduce",
            Call::AllGather { .. } => "ncclAllGather",
            Call::ReduceScatter { .. } => "ncclReduceScatter",
            Call::Send { .. } => "ncclSend",
            Call::Recv { .. } => "ncclRecv",
            Call::Copy { .. } => "cuMemcpyDtoDAsync",
            Call::Stall(_) => "cuLaunchHostFunc",
        }
    }
}

unsafe extern "C" fn stall_until_released(arg: *mut c_void) {
    // SAFETY: `arg` is the reference `launch_stall` leaked with `Arc::into_raw`; the driver
    // runs this callback exactly once, so the reference is reclaimed exactly once.
    let flag = unsafe { Arc::from_raw(arg as *const AtomicBool) };
    while !flag.load(SeqCst) {
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn launch_stall(stream: &CudaStream, flag: &Arc<AtomicBool>) -> Result<(), CallError> {
    let arg = Arc::into_raw(flag.clone()) as *mut c_void;
    // SAFETY: the callback only reads the AtomicBool behind `arg` and makes no CUDA call.
    let r = unsafe { driver::result::stream::launch_host_function(stream.cu_stream(), stall_until_released, arg) };
    if r.is_err() {
        // SAFETY: the launch failed, so the callback will never run: reclaim its reference.
        drop(unsafe { Arc::from_raw(arg as *const AtomicBool) });
    }
    r.map_err(cuda("cuLaunchHostFunc"))
}

/// Uninitialised device memory for staging (`bytes` > 0).
pub(crate) fn alloc_device(stream: &Arc<CudaStream>, bytes: usize) -> Result<CudaSlice<u8>, DriverError> {
    // SAFETY: u8 has no invalid bit patterns; staging memory is written before it is read.
    unsafe { stream.alloc::<u8>(bytes) }
}

/// Page-locked host memory (the staging area of host buffers). `!Send`: it lives and dies on
/// the worker thread.
pub(crate) struct Pinned {
    ptr: NonNull<u8>,
    cap: usize,
}

impl Pinned {
    /// `cap` (> 0) bytes of pinned memory in `ctx`.
    pub(crate) fn alloc(ctx: &CudaContext, cap: usize) -> Result<Pinned, DriverError> {
        ctx.bind_to_thread()?;
        // SAFETY: a plain allocation (flags 0: portable to this context, cached, readable fast
        // by the host, unlike write-combined memory).
        let p = unsafe { driver::result::malloc_host(cap, 0) }?;
        let ptr = NonNull::new(p as *mut u8).ok_or(DriverError(driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY))?;
        Ok(Pinned { ptr, cap })
    }

    pub(crate) fn cap(&self) -> usize {
        self.cap
    }

    /// Copies `src` in (the buffer is idle: see the module invariants).
    pub(crate) fn write(&mut self, src: &[u8]) {
        assert!(src.len() <= self.cap);
        // SAFETY: in bounds; no transfer involving this buffer is pending (invariant), and
        // `&mut self` excludes other host access.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr(), src.len()) }
    }

    /// The first `len` bytes (call only once the download into it has completed).
    pub(crate) fn read(&self, len: usize) -> &[u8] {
        assert!(len <= self.cap);
        // SAFETY: in bounds and initialised by the completed download (invariant).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), len) }
    }

    /// Enqueues host → device of the first `len` bytes.
    pub(crate) fn upload(&self, stream: &CudaStream, dst: DevPtr, len: usize) -> Result<(), CallError> {
        assert!(len <= self.cap);
        // SAFETY: in bounds; the staging buffer is held by the in-flight op and untouched by the
        // host until it completes (invariant).
        unsafe { upload(self.ptr, len, stream, dst) }
    }

    /// Enqueues device → host into the first `len` bytes.
    pub(crate) fn download(&mut self, stream: &CudaStream, src: DevPtr, len: usize) -> Result<(), CallError> {
        assert!(len <= self.cap);
        // SAFETY: in bounds; the host reads it only after the completion event (invariant).
        unsafe { download(self.ptr, len, stream, src) }
    }
}

/// Enqueues host → device of `len` bytes at `src` into `dst`, ordered on `stream` with the op.
///
/// # Safety
/// `src..src + len` is host memory that stays allocated and unwritten until the op completes;
/// `dst` holds `len` bytes (DevPtr invariant).
unsafe fn upload(src: NonNull<u8>, len: usize, stream: &CudaStream, dst: DevPtr) -> Result<(), CallError> {
    // SAFETY: the caller's contract.
    let src = unsafe { std::slice::from_raw_parts(src.as_ptr(), len) };
    // SAFETY: as above.
    unsafe { driver::result::memcpy_htod_async(dst.0, src, stream.cu_stream()) }.map_err(cuda("cuMemcpyHtoDAsync"))
}

/// Enqueues device → host of `len` bytes from `src` into `dst`, ordered on `stream` with the op.
///
/// # Safety
/// `dst..dst + len` is host memory that stays allocated and untouched by the host until the op
/// completes; `src` holds `len` bytes (DevPtr invariant).
unsafe fn download(dst: NonNull<u8>, len: usize, stream: &CudaStream, src: DevPtr) -> Result<(), CallError> {
    // SAFETY: the caller's contract.
    let dst = unsafe { std::slice::from_raw_parts_mut(dst.as_ptr(), len) };
    // SAFETY: as above.
    unsafe { driver::result::memcpy_dtoh_async(dst, src.0, stream.cu_stream()) }.map_err(cuda("cuMemcpyDtoHAsync"))
}

/// A caller's host buffer, page-locked for one op (`cuMemHostRegister`) so that the device
/// copies to and from it directly, without the two host copies through [`Pinned`] memory. It
/// owns the buffer (whose bytes are heap or mapped memory that does not move with it) and
/// unlocks the pages before handing the buffer back or freeing it. `!Send`: it lives and dies on
/// the worker thread.
pub(crate) struct Registered {
    buf: Option<HostBuffer>,
    ptr: NonNull<u8>,
    len: usize,
}

impl Registered {
    /// Page-locks `buf`'s bytes (> 0 of them); on failure (another buffer's registration
    /// covers one of its pages, the driver's limits...) hands `buf` back.
    pub(crate) fn new(ctx: &CudaContext, mut buf: HostBuffer) -> Result<Registered, (DriverError, HostBuffer)> {
        let bytes = buf.as_bytes_mut();
        let (len, ptr) = (bytes.len(), NonNull::new(bytes.as_mut_ptr()));
        let Some(ptr) = ptr.filter(|_| len > 0) else {
            return Err((DriverError(driver::sys::CUresult::CUDA_ERROR_INVALID_VALUE), buf));
        };
        if let Err(e) = ctx.bind_to_thread() {
            return Err((e, buf));
        }
        // SAFETY: the range is `buf`'s bytes, owned by the value returned (no host access to them
        // until `into_buffer`, which unregisters first, as does `drop`).
        let r = unsafe { driver::sys::cuMemHostRegister_v2(ptr.as_ptr() as *mut c_void, len, 0) }.result();
        match r {
            Ok(()) => Ok(Registered { buf: Some(buf), ptr, len }),
            Err(e) => Err((e, buf)),
        }
    }

    /// Enqueues host → device of the whole buffer.
    pub(crate) fn upload(&self, stream: &CudaStream, dst: DevPtr) -> Result<(), CallError> {
        // SAFETY: the registered range, owned by this value, which the worker holds until the
        // op completed (or the stream drained).
        unsafe { upload(self.ptr, self.len, stream, dst) }
    }

    /// Enqueues device → host into the whole buffer.
    pub(crate) fn download(&mut self, stream: &CudaStream, src: DevPtr) -> Result<(), CallError> {
        // SAFETY: as for `upload`; the host reads it only in `into_buffer`, once the op's event
        // fired.
        unsafe { download(self.ptr, self.len, stream, src) }
    }

    /// The buffer, its pages unlocked (call only once the transfers on it completed).
    pub(crate) fn into_buffer(mut self) -> HostBuffer {
        self.unregister();
        self.buf.take().expect("held until now")
    }

    fn unregister(&mut self) {
        if self.buf.is_some() {
            // SAFETY: registered by `new` and not yet unregistered (`buf` is still held); no
            // transfer on it is pending (the op completed, or the stream drained: invariant).
            let _ = unsafe { driver::sys::cuMemHostUnregister(self.ptr.as_ptr() as *mut c_void) };
        }
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.unregister();
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc and idle (buffers of failed ops are never dropped
        // while the stream may use them: invariant).
        let _ = unsafe { driver::result::free_host(self.ptr.as_ptr() as *mut c_void) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_and_op_tables() {
        for d in DType::ALL {
            assert!(nccl_dtype(d).is_some(), "{d} is an NCCL type");
        }
        assert_eq!(nccl_dtype(DType::BF16), Some(nsys::ncclDataType_t::ncclBfloat16));
        assert_eq!(nccl_op(ReduceOp::Avg), Some(nsys::ncclRedOp_t::ncclAvg));
        for op in [ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor] {
            assert_eq!(nccl_op(op), None);
        }
    }

    #[test]
    fn the_watchdog_never_aborts_an_idle_or_moving_owner() {
        let st = CommState::default();
        // No communicator yet.
        assert!(!st.abort_if_stuck(1));
        // A fake non-null handle: the checks below must all back off before using it.
        st.raw.store(NonNull::<nsys::ncclComm>::dangling().as_ptr(), SeqCst);
        assert!(!st.abort_if_stuck(0), "even seq: the owner is not inside a call");
        st.seq.store(3, SeqCst);
        assert!(!st.abort_if_stuck(1), "the owner moved on since the watchdog looked");
        assert_eq!(st.state.load(SeqCst), LIVE, "backed off");
        st.state.store(GONE, SeqCst);
        assert!(!st.abort_if_stuck(3), "already gone");
        st.raw.store(std::ptr::null_mut(), SeqCst);
    }
}
