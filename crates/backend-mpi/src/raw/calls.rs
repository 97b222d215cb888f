//! The collective calls, each moving its buffers into a [`Request`] (nonblocking, or blocking
//! where the caller says `blocking`).

use std::ffi::c_int;
use std::ops::Range;

use comm_core::{CommError, DType, HostBuffer};
use mpi::ffi;

use super::request::{count, counts, recv_ptr, send_ptr, Bufs, Issued, Request};
use super::{check, datatype, exchange_tag, in_place, Comm};

/// A collective's nonblocking call given a request slot, else its blocking form (see
/// [`Request::start`]).
macro_rules! call {
    ($req:expr, $nonblocking:ident / $blocking:ident($($arg:expr),*)) => {
        match $req {
            Some(req) => ffi::$nonblocking($($arg),*, req),
            None => ffi::$blocking($($arg),*),
        }
    };
}

/// `MPI_Ibarrier`.
pub(crate) fn ibarrier(comm: &Comm) -> Issued {
    Request::start(false, "MPI_Ibarrier", datatype(DType::U8), Bufs::default(), vec![], |_, _, _, req| {
        // SAFETY: no buffers; `req` is the request's slot or none (`MPI_Barrier`).
        unsafe { call!(req, MPI_Ibarrier / MPI_Barrier(comm.raw)) }
    })
}

/// `MPI_Ibcast` of `buf` in place from `root` (`MPI_Bcast` where `blocking`, as below).
pub(crate) fn ibcast(comm: &Comm, buf: HostBuffer, root: i32, blocking: bool) -> Issued {
    let (dt, n) = (datatype(buf.dtype()), count("broadcast", buf.len())?);
    Request::start(blocking, "MPI_Ibcast", dt, Bufs { send: None, recv: Some(buf) }, vec![], |_, r, _, req| {
        // SAFETY: `r` points to `n` elements of the owned buffer (rule 2).
        unsafe { call!(req, MPI_Ibcast / MPI_Bcast(r, n, dt, root, comm.raw)) }
    })
}

/// `MPI_Iallgather` (`MPI_Allgather`): every rank's `send` concatenated into `recv`.
pub(crate) fn iallgather(comm: &Comm, send: HostBuffer, recv: HostBuffer, blocking: bool) -> Issued {
    let (dt, n) = (datatype(send.dtype()), count("all_gather", send.len())?);
    debug_assert_eq!(recv.len(), send.len() * comm.size as usize);
    let bufs = Bufs { send: Some(send), recv: Some(recv) };
    Request::start(blocking, "MPI_Iallgather", dt, bufs, vec![], |s, r, _, req| {
        // SAFETY: `s` holds `n` elements and `r` holds `size × n` (rule 2).
        unsafe { call!(req, MPI_Iallgather / MPI_Allgather(s, n, dt, r, n, dt, comm.raw)) }
    })
}

/// An all-gather of small slots by point-to-point messages (cheaper than `MPI_Iallgather`):
/// `send` (at most `slot` bytes) goes to every other rank, and rank `p`'s lands at `p × slot`
/// of `recv` (`size × slot` bytes; the first `own` bytes of ours are copied there).
pub(crate) fn iexchange(comm: &Comm, send: HostBuffer, slot: usize, own: usize, mut recv: HostBuffer) -> Issued {
    let (me, size) = (comm.rank as usize, comm.size as usize);
    let bytes = send.byte_len();
    if bytes > slot || own > bytes || recv.byte_len() != slot * size {
        return Err(CommError::invalid("mpi exchange", format!("{bytes} bytes for {size} slots of {slot}")));
    }
    recv.as_bytes_mut()[me * slot..me * slot + own].copy_from_slice(&send.as_bytes()[..own]);
    let from: Vec<(usize, usize, usize)> = peers(comm).map(|p| (p, p * slot, slot)).collect();
    let bytes = 0..send.byte_len();
    imessages(comm, exchange_tag(), Some((send, bytes)), Some(recv), &from)
}

/// Every rank of `comm` but this one.
fn peers(comm: &Comm) -> impl Iterator<Item = usize> + Clone {
    let me = comm.rank as usize;
    (0..comm.size as usize).filter(move |&p| p != me)
}

/// Point-to-point messages on one tag that complete together: the given bytes of `send` to every
/// other rank, and for each `(peer, at, len)` of `from`, `len` bytes into `recv` at byte `at`.
pub(crate) fn imessages(
    comm: &Comm,
    tag: i32,
    send: Option<(HostBuffer, Range<usize>)>,
    recv: Option<HostBuffer>,
    from: &[(usize, usize, usize)],
) -> Issued {
    let room = recv.as_ref().map_or(0, HostBuffer::byte_len);
    if from.iter().any(|&(p, at, len)| p >= comm.size as usize || at.checked_add(len).is_none_or(|end| end > room)) {
        return Err(CommError::invalid("mpi messages", "a receive lies outside its buffer"));
    }
    let (send, skip, n_send) = match send {
        Some((b, r)) if r.start <= r.end && r.end <= b.byte_len() => (Some(b), r.start, r.len()),
        Some(_) => return Err(CommError::invalid("mpi messages", "a send lies outside its buffer")),
        None => (None, 0, 0),
    };
    let n_send = count("mpi messages", n_send)?;
    let n_recv = counts("mpi messages", &from.iter().map(|f| f.2).collect::<Vec<_>>())?;
    let to: Vec<usize> = if send.is_some() { peers(comm).collect() } else { Vec::new() };
    let dt = datatype(DType::U8);
    let mut bufs = Bufs { send, recv };
    let (s, r) = (send_ptr(&bufs.send), recv_ptr(&mut bufs.recv));
    let mut req = Request::unissued(bufs, Vec::new(), dt);
    req.many = vec![req.raw; from.len() + to.len()];
    // Receives first, then the sends.
    let recvs = from.iter().zip(n_recv).map(|(&(p, at, _), n)| (true, p, at, n));
    for (i, (recv, p, at, n)) in recvs.chain(to.iter().map(|&p| (false, p, skip, n_send))).enumerate() {
        let slot = &mut req.many[i];
        // SAFETY: a receive's `n` bytes at `at` lie in the owned receive buffer, a send's `n`
        // bytes from `skip` in the owned send buffer (both checked above).
        let rc = unsafe {
            match recv {
                true => ffi::MPI_Irecv(r.cast::<u8>().add(at).cast(), n, dt, p as c_int, tag, comm.raw, slot),
                false => ffi::MPI_Isend(s.cast::<u8>().add(at).cast(), n, dt, p as c_int, tag, comm.raw, slot),
            }
        };
        if let Err(e) = check(if recv { "MPI_Irecv" } else { "MPI_Isend" }, rc) {
            // Calls already issued may still use the buffers: keep (leak) them.
            std::mem::forget(req);
            return Err(e.into());
        }
    }
    Ok(req)
}

/// Counts and displacements of `parts` (`(offset, len)` in elements) of a buffer of `len`
/// elements, as MPI's v-calls take them; an error when a part lies outside the buffer.
fn parts_arrays(op: &'static str, parts: &[(usize, usize)], len: usize) -> Result<[Vec<c_int>; 2], CommError> {
    if parts.iter().any(|&(at, n)| at.checked_add(n).is_none_or(|end| end > len)) {
        return Err(CommError::invalid(op, "a block lies outside its buffer"));
    }
    let counts_of = |f: fn(&(usize, usize)) -> usize| counts(op, &parts.iter().map(f).collect::<Vec<_>>());
    Ok([counts_of(|p| p.1)?, counts_of(|p| p.0)?])
}

/// `MPI_Iallgatherv` (`MPI_Allgatherv`): rank `j`'s `send` lands at `parts[j]` of `recv`; with
/// no `send`, this rank's part is already in place there (`MPI_IN_PLACE`).
pub(crate) fn iallgatherv(
    comm: &Comm,
    send: Option<HostBuffer>,
    recv: HostBuffer,
    parts: &[(usize, usize)],
    blocking: bool,
) -> Issued {
    let dt = datatype(recv.dtype());
    let (n, own) = (count("all_reduce", send.as_ref().map_or(0, HostBuffer::len))?, send.is_none());
    let [c, d] = parts_arrays("all_reduce", parts, recv.len())?;
    let bufs = Bufs { send, recv: Some(recv) };
    Request::start(blocking, "MPI_Iallgatherv", dt, bufs, vec![c, d], |s, r, a, req| {
        let s = if own { in_place() } else { s };
        // SAFETY: `s` holds `n` elements (or is MPI_IN_PLACE); every (displacement, count) lies
        // inside `r` (checked above); the arrays live in the request (rule 2).
        unsafe { call!(req, MPI_Iallgatherv / MPI_Allgatherv(s, n, dt, r, a[0].as_ptr(), a[1].as_ptr(), dt, comm.raw)) }
    })
}

/// `MPI_Igather` (`MPI_Gather`) to `root`; `recv` (`size × send.len()`) only on the root.
pub(crate) fn igather(comm: &Comm, send: HostBuffer, recv: Option<HostBuffer>, root: i32, blocking: bool) -> Issued {
    let (dt, n) = (datatype(send.dtype()), count("gather", send.len())?);
    debug_assert!(recv.as_ref().is_none_or(|r| r.len() == send.len() * comm.size as usize));
    debug_assert_eq!(recv.is_some(), comm.rank == root);
    Request::start(blocking, "MPI_Igather", dt, Bufs { send: Some(send), recv }, vec![], |s, r, _, req| {
        // SAFETY: `s` holds `n` elements; on the root `r` holds `size × n` (rule 2); elsewhere
        // the receive arguments are ignored by MPI.
        unsafe { call!(req, MPI_Igather / MPI_Gather(s, n, dt, r, n, dt, root, comm.raw)) }
    })
}

/// `MPI_Igatherv` (`MPI_Gatherv`) to `root`: rank `j`'s `send` lands at `parts[j]` of the root's
/// `recv`; a root with no `send` has its part already in place there (`MPI_IN_PLACE`).
pub(crate) fn igatherv(
    comm: &Comm,
    send: Option<HostBuffer>,
    recv: Option<HostBuffer>,
    parts: &[(usize, usize)],
    root: i32,
    blocking: bool,
) -> Issued {
    let Some(dt) = send.as_ref().or(recv.as_ref()).map(|b| datatype(b.dtype())) else {
        return Err(CommError::invalid("reduce", "a gather with no buffers"));
    };
    let (n, own) = (count("reduce", send.as_ref().map_or(0, HostBuffer::len))?, send.is_none());
    if own && (recv.is_none() || comm.rank != root) {
        return Err(CommError::invalid("reduce", "only the root gathers in place"));
    }
    // Off the root MPI reads no receive parts: only their counts must fit an int.
    let [c, d] = parts_arrays("reduce", parts, recv.as_ref().map_or(usize::MAX, HostBuffer::len))?;
    Request::start(blocking, "MPI_Igatherv", dt, Bufs { send, recv }, vec![c, d], |s, r, a, req| {
        let s = if own { in_place() } else { s };
        // SAFETY: `s` holds `n` elements (or is MPI_IN_PLACE on the root); on the root every part
        // lies inside `r` (checked above); the arrays live in the request (rule 2).
        unsafe { call!(req, MPI_Igatherv / MPI_Gatherv(s, n, dt, r, a[0].as_ptr(), a[1].as_ptr(), dt, root, comm.raw)) }
    })
}

/// `MPI_Iscatter` (`MPI_Scatter`): block `j` of the root's `send` to rank `j`'s `recv`.
pub(crate) fn iscatter(comm: &Comm, send: Option<HostBuffer>, recv: HostBuffer, root: i32, blocking: bool) -> Issued {
    let (dt, n) = (datatype(recv.dtype()), count("scatter", recv.len())?);
    debug_assert!(send.as_ref().is_none_or(|s| s.len() == recv.len() * comm.size as usize));
    Request::start(blocking, "MPI_Iscatter", dt, Bufs { send, recv: Some(recv) }, vec![], |s, r, _, req| {
        // SAFETY: on the root `s` holds `size × n` elements (ignored elsewhere); `r` holds `n`.
        unsafe { call!(req, MPI_Iscatter / MPI_Scatter(s, n, dt, r, n, dt, root, comm.raw)) }
    })
}

/// `MPI_Ialltoallv` (`MPI_Alltoallv`): `send_parts[j]` of `send` to rank `j`, landing at its
/// `recv_parts[i]` for sender `i`. Parts are `(offset, len)` in elements.
pub(crate) fn ialltoallv(
    comm: &Comm,
    send: HostBuffer,
    send_parts: &[(usize, usize)],
    recv: HostBuffer,
    recv_parts: &[(usize, usize)],
    blocking: bool,
) -> Issued {
    let dt = datatype(send.dtype());
    let [sc, sd] = parts_arrays("all_to_all", send_parts, send.len())?;
    let [rc, rd] = parts_arrays("all_to_all", recv_parts, recv.len())?;
    let arrays = vec![sc, sd, rc, rd];
    let bufs = Bufs { send: Some(send), recv: Some(recv) };
    Request::start(blocking, "MPI_Ialltoallv", dt, bufs, arrays, |s, r, a, req| {
        let (sc, sd, rc, rd) = (a[0].as_ptr(), a[1].as_ptr(), a[2].as_ptr(), a[3].as_ptr());
        // SAFETY: every (displacement, count) lies inside its buffer (checked above); the arrays
        // live in the request (rule 2).
        unsafe { call!(req, MPI_Ialltoallv / MPI_Alltoallv(s, sc, sd, dt, r, rc, rd, dt, comm.raw)) }
    })
}

/// `MPI_Iallreduce` (`MPI_Allreduce`) of `buf` in place (`MPI_IN_PLACE`: no copy of the input).
pub(crate) fn iallreduce_in_place(comm: &Comm, buf: HostBuffer, op: ffi::MPI_Op, blocking: bool) -> Issued {
    let (dt, n) = (datatype(buf.dtype()), count("all_reduce", buf.len())?);
    let bufs = Bufs { send: None, recv: Some(buf) };
    Request::start(blocking, "MPI_Iallreduce", dt, bufs, vec![], |_, r, _, req| {
        // SAFETY: `r` holds `n` elements (rule 2); MPI_IN_PLACE makes it the input too.
        unsafe { call!(req, MPI_Iallreduce / MPI_Allreduce(in_place(), r, n, dt, op, comm.raw)) }
    })
}

/// `MPI_Ireduce` (`MPI_Reduce`) of `send` into the root's `recv` with `op`.
pub(crate) fn ireduce(
    comm: &Comm,
    send: HostBuffer,
    recv: Option<HostBuffer>,
    op: ffi::MPI_Op,
    root: i32,
    blocking: bool,
) -> Issued {
    let (dt, n) = (datatype(send.dtype()), count("reduce", send.len())?);
    debug_assert!(recv.as_ref().is_none_or(|r| r.len() == send.len()));
    Request::start(blocking, "MPI_Ireduce", dt, Bufs { send: Some(send), recv }, vec![], |s, r, _, req| {
        // SAFETY: `s` holds `n` elements, and so does `r` on the root (ignored elsewhere).
        unsafe { call!(req, MPI_Ireduce / MPI_Reduce(s, r, n, dt, op, root, comm.raw)) }
    })
}

/// `MPI_Ireduce_scatter_block` (`MPI_Reduce_scatter_block`): `send` (`size × k`) reduced,
/// block `rank` into `recv` (`k`).
pub(crate) fn ireduce_scatter_block(
    comm: &Comm,
    send: HostBuffer,
    recv: HostBuffer,
    op: ffi::MPI_Op,
    blocking: bool,
) -> Issued {
    let (dt, n) = (datatype(send.dtype()), count("reduce_scatter", recv.len())?);
    debug_assert_eq!(send.len(), recv.len() * comm.size as usize);
    let bufs = Bufs { send: Some(send), recv: Some(recv) };
    Request::start(blocking, "MPI_Ireduce_scatter_block", dt, bufs, vec![], |s, r, _, req| {
        // SAFETY: `s` holds `size × n` elements and `r` holds `n` (rule 2).
        unsafe { call!(req, MPI_Ireduce_scatter_block / MPI_Reduce_scatter_block(s, r, n, dt, op, comm.raw)) }
    })
}
