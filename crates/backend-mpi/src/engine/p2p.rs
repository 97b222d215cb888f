//! Point-to-point: tags, progress and timeouts of send/recv.

use std::time::{Duration, Instant};

use comm_core::lane::Ticket;
use comm_core::{CommError, Completer, DType, HostBuffer, Rank};

use crate::raw::{self, Comm, Polled, Request};

use super::op::Post;
use super::steps::{bury, internal, take};

/// The MPI tag of a user tag: the dtype in the low 3 bits, so a receive matches only its dtype.
pub(super) fn mpi_tag(tag: u32, dtype: DType) -> i32 {
    ((tag << 3) | u32::from(dtype.code())) as i32
}

/// A send MPI refused: its completer and the error.
pub(super) type Refused = (Completer<HostBuffer>, CommError);

pub(crate) struct P2p {
    pub(super) recv: bool,
    pub(super) peer: Rank,
    pub(super) tag: u32,
    pub(super) dtype: DType,
    pub(super) len: usize,
    pub(super) deadline: Instant,
    /// The send, or the receive once its message is matched.
    pub(super) req: Option<Request>,
    /// A receive's buffer until its message is matched (`raw::improbe`, so that the receive
    /// posted for it is never shorter than the message).
    pub(super) buf: Option<HostBuffer>,
    /// The length of a matched message longer than the receive: taken into a scratch buffer
    /// (so it leaves MPI's queue), then reported.
    pub(super) too_long: Option<usize>,
    pub(super) done: Completer<HostBuffer>,
    /// Counts it in its group's lane while the worker holds it (see `Lane`).
    pub(super) ticket: Option<Ticket>,
}

impl P2p {
    /// Posts a send (a receive is posted once its message is matched, see [`poll`]). A send
    /// MPI refuses comes back with its completer and the error.
    pub(super) fn start(post: Post, comm: &Comm, timeout: Duration, ticket: Option<Ticket>) -> Result<P2p, Refused> {
        let Post { recv, buf, peer, tag, done } = post;
        let (dtype, len) = (buf.dtype(), buf.len());
        let deadline = Instant::now() + timeout;
        let (req, buf) = match recv {
            true => (None, Some(buf)),
            false => match raw::isend(comm, buf, peer as i32, mpi_tag(tag, dtype)) {
                Ok(req) => (Some(req), None),
                Err(e) => return Err((done, e)),
            },
        };
        Ok(P2p { recv, peer, tag, dtype, len, deadline, req, buf, too_long: None, done, ticket })
    }
}

/// Matches a receive's message, and posts the receive for it. `Ok(false)`: none yet.
fn match_recv(p: &mut P2p, comm: &Comm) -> Result<bool, CommError> {
    let Some(m) = raw::improbe(comm, p.peer as i32, mpi_tag(p.tag, p.dtype))? else { return Ok(false) };
    let buf = p.buf.take().ok_or_else(|| internal("a receive lost its buffer"))?;
    let into = if m.bytes > buf.byte_len() {
        p.too_long = Some(m.bytes / p.dtype.size());
        HostBuffer::try_zeroed(p.dtype, m.bytes.div_ceil(p.dtype.size()))?
    } else {
        buf
    };
    p.req = Some(raw::imrecv(m, into)?);
    Ok(true)
}

/// Polls `p` once (matching a receive's message first): `None` while it is in flight within
/// its deadline, else how it ended.
pub(super) fn poll(p: &mut P2p, comm: &Comm, now: Instant, timeout: Duration) -> Option<Result<(), CommError>> {
    if p.req.is_none() {
        match match_recv(p, comm) {
            Ok(true) => {}
            Ok(false) if now < p.deadline => return None,
            Ok(false) => return Some(Err(p2p_timeout(p, comm, timeout))),
            Err(e) => return Some(Err(e)),
        }
    }
    let (peer, tag, dtype, len, me) = (p.peer, p.tag, p.dtype, p.len, comm.rank());
    let mismatch = |why: String| Err(CommError::mismatch("recv", why));
    let req = p.req.as_mut()?;
    Some(match req.test() {
        Polled::Pending if now < p.deadline => return None,
        Polled::Pending => Err(p2p_timeout(p, comm, timeout)),
        Polled::Done(_) if p.too_long.is_some() => mismatch(format!(
            "rank {peer} sent {} elements of {dtype}, more than the {len} elements rank {me} posted a recv for (tag {tag})",
            p.too_long.unwrap_or(0)
        )),
        Polled::Done(Some(n)) if p.recv && n != len => mismatch(format!(
            "rank {peer} sent {n} elements of {dtype} with tag {tag}, but rank {me} posted a recv of {len} elements"
        )),
        Polled::Done(_) => Ok(()),
        Polled::Failed { err, .. } if p.recv && err.is_truncation() => mismatch(format!(
            "rank {peer} sent more than the {len} elements of {dtype} rank {me} posted a recv for (tag {tag})"
        )),
        Polled::Failed { err, .. } => Err(err.into()),
    })
}

/// Completes a finished `p` with `result` (the buffer back, or the error); a failed request
/// MPI may still use goes to `graveyard`. The caller poisons the group first on a failure.
pub(super) fn finish(mut p: P2p, result: Result<(), CommError>, graveyard: &mut Vec<Request>) {
    // Counted down before the `Work` completes, so the caller's next op may run directly.
    drop(p.ticket.take());
    let Some(mut req) = p.req else {
        // A receive whose message never came: nothing was posted for it.
        return p.done.complete(Err(result.err().unwrap_or_else(|| internal("a receive finished unmatched"))));
    };
    match result {
        Ok(()) => p.done.complete(req.into_bufs().and_then(|b| take(if p.recv { b.recv } else { b.send }))),
        Err(e) => {
            if p.recv && !req.is_done() {
                req.cancel();
            }
            p.done.complete(Err(e));
            bury(req, graveyard);
        }
    }
}

/// The error of a point-to-point op that ran out of time: a mismatch when a message from the
/// peer is waiting with another tag or dtype, else a timeout.
pub(super) fn p2p_timeout(p: &P2p, comm: &Comm, after: Duration) -> CommError {
    let P2p { recv, peer, tag, dtype, len, .. } = *p;
    // A header exchange's message (the peer is in a collective already) says nothing here.
    let waiting = recv.then(|| raw::probe(comm, peer as i32)).flatten().filter(|(t, _)| *t < raw::exchange_tag());
    if let Some((t, bytes)) = waiting {
        if let Some(d) = DType::from_code((t as u32 & 7) as u8) {
            return CommError::mismatch("recv", format!(
                "rank {peer} sent {} elements of {d} with tag {}, but this rank waited {after:?} in a recv of {len} elements of {dtype} with tag {tag}",
                bytes / d.size(),
                (t as u32) >> 3
            ));
        }
    }
    let (dir, other) = if recv { ("recv from", "send") } else { ("send to", "recv") };
    CommError::timeout(
        format!("{dir} rank {peer} (tag {tag}, {dtype} × {len})"),
        after,
        format!("rank {peer} never posted the matching {other} (set COMM_TIMEOUT to wait longer)"),
    )
}
