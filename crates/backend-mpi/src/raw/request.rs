//! Requests with owned buffers: what a nonblocking call returns, polled until MPI is done
//! with its buffers; point-to-point calls.

use std::ffi::{c_int, c_void};
use std::mem::MaybeUninit;

use comm_core::{CommError, HostBuffer};
use mpi::ffi;

use super::{check, datatype, error, notice_tag, Comm, MpiError};

/// The buffers a request uses, handed back on completion.
#[derive(Debug, Default)]
pub(crate) struct Bufs {
    /// What MPI reads (or, for in-place calls such as `MPI_Ibcast`, nothing).
    pub(crate) send: Option<HostBuffer>,
    /// What MPI writes (or reads and writes, in place).
    pub(crate) recv: Option<HostBuffer>,
}

/// What [`Request::test`] saw.
#[derive(Debug)]
pub(crate) enum Polled {
    /// Still in flight.
    Pending,
    /// Completed successfully, with the elements received (receives only).
    Done(Option<usize>),
    /// MPI reported an error; `completed` says whether the request is finished (its buffers
    /// can be taken back) or in an unknown state (they stay with the request).
    Failed { err: MpiError, completed: bool },
}

/// A nonblocking MPI operation in flight, owning every buffer it uses.
pub(crate) struct Request {
    pub(super) raw: ffi::MPI_Request,
    /// Instead of `raw` (then null): the requests of an op made of several calls, complete
    /// together (`iexchange`).
    pub(super) many: Vec<ffi::MPI_Request>,
    pub(super) bufs: Bufs,
    /// Count and displacement arrays the call points into.
    pub(super) _arrays: Vec<Vec<c_int>>,
    pub(super) datatype: ffi::MPI_Datatype,
    pub(super) done: bool,
}

// SAFETY: a request moves to another thread only where MPI provides MPI_THREAD_MULTIPLE (a
// caller's direct op that did not finish at once is handed to the worker, see `SharedComm`),
// and MPI request handles are then valid on any thread; its buffers are owned (rule 2).
unsafe impl Send for Request {}

/// What issuing a call gives: its request, or why MPI refused it.
pub(crate) type Issued = Result<Request, CommError>;

/// A buffer's length as an MPI count.
pub(crate) fn count(op: &'static str, n: usize) -> Result<c_int, CommError> {
    c_int::try_from(n).map_err(|_| CommError::InvalidArgument {
        op,
        reason: format!("{n} elements do not fit MPI's int counts (at most {} per call)", c_int::MAX),
    })
}

pub(super) fn counts(op: &'static str, v: &[usize]) -> Result<Vec<c_int>, CommError> {
    v.iter().map(|&n| count(op, n)).collect()
}

pub(super) fn send_ptr(b: &Option<HostBuffer>) -> *const c_void {
    b.as_ref().map_or(std::ptr::null(), |b| b.as_bytes().as_ptr().cast())
}

pub(super) fn recv_ptr(b: &mut Option<HostBuffer>) -> *mut c_void {
    b.as_mut().map_or(std::ptr::null_mut(), |b| b.as_bytes_mut().as_mut_ptr().cast())
}

impl Request {
    /// A request holding `bufs` and `arrays`, not yet issued (its handle null).
    pub(super) fn unissued(bufs: Bufs, arrays: Vec<Vec<c_int>>, datatype: ffi::MPI_Datatype) -> Request {
        // SAFETY: reading a constant initialised at load time.
        let raw = unsafe { ffi::RSMPI_REQUEST_NULL };
        Request { raw, many: Vec::new(), bufs, _arrays: arrays, datatype, done: false }
    }

    /// Moves `bufs` and `arrays` into a new request and issues it with `issue`, which gets the
    /// request's slot; or where `blocking`, MPI's blocking form (`issue` gets `None`), returned
    /// completed: only where every rank makes the same call and no blocked threads can form a
    /// cycle (the worker's `held`). Calls with no blocking form pass `false`.
    pub(super) fn start(
        blocking: bool,
        call: &'static str,
        datatype: ffi::MPI_Datatype,
        bufs: Bufs,
        arrays: Vec<Vec<c_int>>,
        issue: impl FnOnce(*const c_void, *mut c_void, &[Vec<c_int>], Option<*mut ffi::MPI_Request>) -> c_int,
    ) -> Issued {
        let mut req = Request::unissued(bufs, arrays, datatype);
        let s = send_ptr(&req.bufs.send);
        let r = recv_ptr(&mut req.bufs.recv);
        let rc = issue(s, r, &req._arrays, (!blocking).then_some(&mut req.raw as *mut _));
        // A blocking call returned: MPI no longer uses the buffers, whatever it reports.
        req.done = blocking;
        if let Err(e) = check(call, rc) {
            // MPI's state after a failed issue is undefined: keep (leak) what it was given.
            if !blocking {
                std::mem::forget(req);
            }
            return Err(e.into());
        }
        Ok(req)
    }

    /// Polls the request once (this also drives MPI's progress engine).
    pub(crate) fn test(&mut self) -> Polled {
        if self.done {
            return Polled::Done(None);
        }
        if !self.many.is_empty() {
            return self.test_many();
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
        Polled::Done(count)
    }

    fn test_many(&mut self) -> Polled {
        let mut flag: c_int = 0;
        let n = self.many.len() as c_int;
        // SAFETY: `self.many` holds our live requests (completed ones are set to null by MPI).
        let rc = unsafe { ffi::MPI_Testall(n, self.many.as_mut_ptr(), &mut flag, ffi::RSMPI_STATUSES_IGNORE) };
        if rc != ffi::MPI_SUCCESS as c_int {
            // Which calls completed is not known: keep the buffers (as for a request in flight).
            return Polled::Failed { err: error("MPI_Testall", rc), completed: false };
        }
        if flag == 0 {
            return Polled::Pending;
        }
        self.done = true;
        Polled::Done(None)
    }

    /// Asks MPI to cancel a receive that has not matched (of an op made of several calls, each
    /// one still live). Poll again to see it complete.
    pub(crate) fn cancel(&mut self) {
        if self.done {
            return;
        }
        let reqs = if self.many.is_empty() { std::slice::from_mut(&mut self.raw) } else { &mut self.many[..] };
        for r in reqs {
            // SAFETY: reading a constant initialised at load time; a request MPI completed is
            // null and is skipped, the others are our live requests.
            unsafe {
                if *r != ffi::RSMPI_REQUEST_NULL {
                    ffi::MPI_Cancel(r);
                }
            }
        }
    }

    /// Whether MPI is finished with the request (its buffers can be taken back).
    pub(crate) fn is_done(&self) -> bool {
        self.done
    }

    /// The buffers, once the request completed; an (internal) error, the buffers leaked with
    /// the request, if it did not.
    pub(crate) fn into_bufs(mut self) -> Result<Bufs, CommError> {
        if !self.done {
            let source = "internal error: a completed request kept its buffers".into();
            return Err(CommError::Backend { backend: "mpi", source });
        }
        Ok(std::mem::take(&mut self.bufs))
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
pub(crate) fn isend(comm: &Comm, buf: HostBuffer, dst: i32, tag: i32) -> Issued {
    let (dt, n) = (datatype(buf.dtype()), count("send", buf.len())?);
    let bufs = Bufs { send: Some(buf), recv: None };
    Request::start(false, "MPI_Isend", dt, bufs, vec![], |s, _, _, req| {
        let req = req.expect("a nonblocking call has a request");
        // SAFETY: `s` points to `n` elements of the owned send buffer (rule 2); `req` is the
        // request's slot.
        unsafe { ffi::MPI_Isend(s, n, dt, dst, tag, comm.raw, req) }
    })
}

/// A message matched by [`improbe`] and not yet received: only [`imrecv`] may take it.
pub(crate) struct Matched {
    message: ffi::MPI_Message,
    /// Its length in bytes.
    pub(crate) bytes: usize,
    source: i32,
}

// SAFETY: a matched message is a handle owned by the worker thread, like a request; it moves
// only with the `P2p` that holds it and is used by the thread that matched it.
unsafe impl Send for Matched {}

/// `MPI_Improbe`: the next message from `src` with `tag`, taken out of matching, so a receive
/// of its length can be posted (Open MPI's single-copy path overruns a shorter one).
pub(crate) fn improbe(comm: &Comm, src: i32, tag: i32) -> Result<Option<Matched>, CommError> {
    let mut flag: c_int = 0;
    let mut status = MaybeUninit::<ffi::MPI_Status>::zeroed();
    // SAFETY: reading a constant initialised at load time.
    let mut message = unsafe { ffi::RSMPI_MESSAGE_NULL };
    // SAFETY: out-parameters to locals; `status` is read only when a message was matched.
    let rc = unsafe { ffi::MPI_Improbe(src, tag, comm.raw, &mut flag, &mut message, status.as_mut_ptr()) };
    check("MPI_Improbe", rc)?;
    if flag == 0 {
        return Ok(None);
    }
    let mut n: c_int = -1;
    // SAFETY: `status` was filled by the successful MPI_Improbe above.
    let rc = unsafe { ffi::MPI_Get_count(status.as_ptr(), ffi::RSMPI_UINT8_T, &mut n) };
    check("MPI_Get_count", rc)?;
    // SAFETY: `status` was filled by the successful MPI_Improbe.
    let source = unsafe { status.assume_init() }.MPI_SOURCE;
    Ok(Some(Matched { message, bytes: n.max(0) as usize, source }))
}

/// `MPI_Imrecv` of a matched message into `buf`, which must hold all of it.
pub(crate) fn imrecv(m: Matched, buf: HostBuffer) -> Issued {
    if m.bytes > buf.byte_len() {
        return Err(CommError::invalid("recv", format!("{} bytes do not fit {} bytes", m.bytes, buf.byte_len())));
    }
    let (dt, n) = (datatype(buf.dtype()), count("recv", buf.len())?);
    let mut message = m.message;
    let bufs = Bufs { send: None, recv: Some(buf) };
    Request::start(false, "MPI_Imrecv", dt, bufs, vec![], |_, r, _, req| {
        let req = req.expect("a nonblocking call has a request");
        // SAFETY: `r` points to `n` writable elements of the owned receive buffer (rule 2),
        // at least the message's length (checked above); `message` was matched by
        // `improbe` and is received once (MPI sets it to null); `req` is the request's slot.
        unsafe { ffi::MPI_Imrecv(r, n, dt, &mut message, req) }
    })
}

/// The longest notice [`take_notice`] receives (longer ones are cut there).
pub(crate) const NOTICE_MAX: usize = 512;

/// A poisoned group's notice from any peer, if one has arrived: `(source, text)`. Notices are
/// at most [`NOTICE_MAX`] bytes, sent eagerly, so the matched message is received at once.
pub(crate) fn take_notice(comm: &Comm) -> Result<Option<(i32, String)>, CommError> {
    // SAFETY: reading a constant initialised at load time.
    let Some(mut m) = improbe(comm, unsafe { ffi::RSMPI_ANY_SOURCE }, notice_tag())? else { return Ok(None) };
    let mut text = vec![0u8; NOTICE_MAX];
    // SAFETY: `text` holds NOTICE_MAX bytes, the receive's count; `m.message` was matched by
    // `improbe` and is received once. A longer message is truncated (an error we report, not UB).
    let rc = unsafe {
        let buf = text.as_mut_ptr().cast();
        ffi::MPI_Mrecv(buf, NOTICE_MAX as c_int, ffi::RSMPI_UINT8_T, &mut m.message, ffi::RSMPI_STATUS_IGNORE)
    };
    check("MPI_Mrecv", rc)?;
    text.truncate(m.bytes.min(NOTICE_MAX));
    Ok(Some((m.source, String::from_utf8_lossy(&text).into_owned())))
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
