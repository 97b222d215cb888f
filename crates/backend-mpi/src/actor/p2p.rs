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
    pub(super) req: Request,
    pub(super) done: Completer<HostBuffer>,
}

impl P2p {
    pub(super) fn what(&self) -> String {
        let dir = if self.recv { "recv from" } else { "send to" };
        format!("{dir} rank {} (tag {}, {} × {})", self.peer, self.tag, self.dtype, self.len)
    }
}

pub(super) fn progress_p2p(g: &mut Group, graveyard: &mut Vec<Request>, now: Instant) -> bool {
    let mut any = false;
    let mut failure: Option<CommError> = None;
    let mut i = 0;
    while i < g.p2p.len() {
        let p = &mut g.p2p[i];
        let result = match p.req.test() {
            Polled::Pending if now < p.deadline => {
                i += 1;
                continue;
            }
            Polled::Pending => Err(p2p_timeout(p, &g.comm, g.params.timeout)),
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
        let mut p = g.p2p.swap_remove(i);
        match result {
            Ok(()) => match p.req.into_bufs() {
                Some(b) => p.done.complete(if p.recv { take(b.recv) } else { take(b.send) }),
                None => p.done.complete(Err(internal("a completed request kept its buffers"))),
            },
            Err(e) => {
                if p.recv && !p.req.is_done() {
                    p.req.cancel();
                }
                p.done.complete(Err(e.duplicate()));
                bury(p.req, graveyard);
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
