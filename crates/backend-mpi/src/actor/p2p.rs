//! Point-to-point: tags, progress and timeouts of send/recv.

use super::*;

/// The MPI tag of a user tag: the dtype in the low 3 bits, so a receive only matches a message
/// of its own dtype.
pub(super) fn mpi_tag(tag: u32, dtype: DType) -> i32 {
    ((tag << 3) | u32::from(dtype.code())) as i32
}

pub(super) struct P2p {
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
}

impl P2p {
    pub(super) fn what(&self) -> String {
        let dir = if self.recv { "recv from" } else { "send to" };
        format!("{dir} rank {} (tag {}, {} × {})", self.peer, self.tag, self.dtype, self.len)
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

pub(super) fn progress_p2p(g: &mut Group, graveyard: &mut Vec<Request>, now: Instant) -> bool {
    let mut any = false;
    let mut failure: Option<CommError> = None;
    let mut i = 0;
    while i < g.p2p.len() {
        let p = &mut g.p2p[i];
        if p.req.is_none() {
            // Receives are matched in the order they were posted (the list keeps it), as
            // MPI matches posted receives.
            let failed = match match_recv(p, &g.comm) {
                Ok(true) => None,
                Ok(false) if now < p.deadline => {
                    i += 1;
                    continue;
                }
                Ok(false) => Some(p2p_timeout(p, &g.comm, g.params.timeout)),
                Err(e) => Some(e),
            };
            any = true;
            if let Some(e) = failed {
                // Nothing was posted for it: no request to cancel or keep.
                g.p2p.remove(i).done.complete(Err(e.duplicate()));
                failure.get_or_insert(e);
                continue;
            }
        }
        let p = &mut g.p2p[i];
        let Some(req) = p.req.as_mut() else { unreachable!("matched above") };
        let result = match req.test() {
            Polled::Pending if now < p.deadline => {
                i += 1;
                continue;
            }
            Polled::Pending => Err(p2p_timeout(p, &g.comm, g.params.timeout)),
            Polled::Done(_) if p.too_long.is_some() => Err(CommError::Mismatch {
                op: "recv",
                detail: format!(
                    "rank {} sent {} elements of {}, more than the {} elements rank {} posted a recv for (tag {})",
                    p.peer,
                    p.too_long.unwrap_or(0),
                    p.dtype,
                    p.len,
                    g.info.rank,
                    p.tag
                ),
            }),
            Polled::Done(c) => {
                if p.recv && c.count.is_some_and(|n| n != p.len) {
                    Err(CommError::Mismatch {
                        op: "recv",
                        detail: format!(
                            "rank {} sent {} elements of {} with tag {}, but rank {} posted a recv of {} elements",
                            p.peer,
                            c.count.unwrap_or(0),
                            p.dtype,
                            p.tag,
                            g.info.rank,
                            p.len
                        ),
                    })
                } else {
                    Ok(())
                }
            }
            Polled::Failed { err, .. } if p.recv && err.is_truncation() => Err(CommError::Mismatch {
                op: "recv",
                detail: format!(
                    "rank {} sent more than the {} elements of {} rank {} posted a recv for (tag {})",
                    p.peer, p.len, p.dtype, g.info.rank, p.tag
                ),
            }),
            Polled::Failed { err, .. } => Err(err.into_comm()),
        };
        any = true;
        let p = g.p2p.remove(i);
        let Some(mut req) = p.req else { unreachable!("matched above") };
        match result {
            Ok(()) => match req.into_bufs() {
                Some(b) => p.done.complete(if p.recv { take(b.recv) } else { take(b.send) }),
                None => p.done.complete(Err(internal("a completed request kept its buffers"))),
            },
            Err(e) => {
                if p.recv && !req.is_done() {
                    req.cancel();
                }
                p.done.complete(Err(e.duplicate()));
                bury(req, graveyard);
                failure.get_or_insert(e);
            }
        }
    }
    if let Some(e) = failure {
        g.poison(&e, graveyard);
    }
    any
}

/// The error of a point-to-point op that ran out of time: a mismatch when a message from the
/// peer is waiting with another tag or dtype, else a timeout.
pub(super) fn p2p_timeout(p: &P2p, comm: &Comm, after: Duration) -> CommError {
    if p.recv {
        // A header exchange's message (the peer is in a collective already) says nothing here.
        if let Some((t, bytes)) = raw::probe(comm, p.peer as i32).filter(|(t, _)| *t != raw::exchange_tag()) {
            let (tag, code) = ((t as u32) >> 3, (t as u32 & 7) as u8);
            if let Some(d) = DType::from_code(code) {
                return CommError::Mismatch {
                    op: "recv",
                    detail: format!(
                        "rank {} sent {} elements of {d} with tag {tag}, but this rank waited {after:?} in a recv of {} elements of {} with tag {}",
                        p.peer,
                        bytes / d.size(),
                        p.len,
                        p.dtype,
                        p.tag
                    ),
                };
            }
        }
    }
    CommError::Timeout {
        op: p.what(),
        after,
        detail: format!(
            "rank {} never posted the matching {} (set COMM_TIMEOUT to wait longer)",
            p.peer,
            if p.recv { "send" } else { "recv" }
        ),
    }
}
