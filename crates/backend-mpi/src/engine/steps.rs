//! The vocabulary of a collective's steps, shared by the plans, the worker and callers' threads:
//! what a continuation may use ([`Env`]), a step ([`Step`]: wait for a request, then continue;
//! or done), an op's [`Steps`] and its [`Reply`], the running [`Active`] one, and the header
//! exchange every checked collective starts with ([`exchange`]).

use std::time::Instant;

use comm_core::lane::Ticket;
use comm_core::{CommError, Completer, DType, HostBuffer, InOut};

use crate::raw::{self, Bufs, Comm, Request};

use super::header::{
    beside_len, bulk_len, exchange_slot_bytes, slot_max, verify, Bulk, Exchange, Header, OpLabel, ALONE,
};
use super::{held, Gid, GroupInfo, Params};

/// What a group's continuation may use.
#[derive(Clone, Copy)]
pub(super) struct Env<'a> {
    pub(super) comm: &'a Comm,
    pub(super) gid: Gid,
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) params: &'a Params,
    pub(super) half: Option<&'a raw::HalfOps>,
    pub(super) pool: &'a Pool,
    /// Every rank held no other group's collective when it sent this op's header (set for its
    /// start): the op may make MPI's blocking calls ([`held`](super::held)).
    pub(super) may_block: bool,
}

/// Spare large buffers, reused for scratch space and outputs (so repeated ops neither allocate
/// nor page-fault); every one taken is completely overwritten before anyone reads it.
#[derive(Default)]
pub(super) struct Pool {
    pub(super) spare: std::cell::RefCell<Vec<HostBuffer>>,
}

impl Pool {
    /// Smaller buffers are cheap to allocate (zeroing one costs about what reusing it saves).
    const MIN: usize = 16 << 10;
    /// At most this many bytes are kept.
    const MAX_BYTES: usize = 256 << 20;

    /// A buffer of `len` elements whose contents will all be overwritten (a kept one is not zeroed).
    pub(super) fn buffer(&self, dtype: DType, len: usize) -> HostBuffer {
        let bytes = len * dtype.size();
        if bytes >= Pool::MIN {
            let mut spare = self.spare.borrow_mut();
            if let Some(i) = spare.iter().position(|b| b.byte_len() == bytes) {
                let mut b = spare.swap_remove(i);
                b.reshape(dtype, len);
                return b;
            }
        }
        HostBuffer::zeroed(dtype, len)
    }

    /// Keeps a buffer nobody uses any more for [`Pool::buffer`].
    pub(super) fn recycle(&self, b: Option<HostBuffer>) {
        let Some(b) = b.filter(|b| b.byte_len() >= Pool::MIN) else { return };
        let mut spare = self.spare.borrow_mut();
        spare.push(b);
        while spare.len() > 4 || spare.iter().map(HostBuffer::byte_len).sum::<usize>() > Pool::MAX_BYTES {
            spare.remove(0);
        }
    }
}

pub(super) type Cont = Box<dyn FnOnce(&Env<'_>, Bufs) -> Result<Step, CommError> + Send>;

/// How a planned collective starts once every rank agreed on its header; given the exchange
/// when it carried every rank's [`Steps::payload`] or [`Steps::whole`].
pub(super) type Start = Box<dyn FnOnce(&Env<'_>, Option<&mut Exchange>) -> Result<Step, CommError> + Send>;

pub(super) enum Step {
    /// Wait for the request, then continue.
    Wait(Request, Cont),
    /// Finished with this output.
    Done(Out),
}

pub(super) enum Out {
    Buf(HostBuffer),
    Io(InOut),
    Unit,
    Comm(Option<Comm>),
}

pub(super) fn wait(
    req: Request,
    cont: impl FnOnce(&Env<'_>, Bufs) -> Result<Step, CommError> + Send + 'static,
) -> Step {
    Step::Wait(req, Box::new(cont))
}

pub(super) fn done(b: HostBuffer) -> Result<Step, CommError> {
    Ok(Step::Done(Out::Buf(b)))
}

/// A finished op that hands back the buffer it read and the one it filled.
pub(super) fn done_io(input: HostBuffer, output: HostBuffer) -> Result<Step, CommError> {
    Ok(Step::Done(Out::Io(InOut { input, output })))
}

pub(super) fn internal(what: &str) -> CommError {
    CommError::Backend { backend: "mpi", source: format!("internal error: {what}").into() }
}

pub(super) fn take(b: Option<HostBuffer>) -> Result<HostBuffer, CommError> {
    b.ok_or_else(|| internal("a completed request did not hand its buffer back"))
}

/// Communicators made by `new_group` (`None` on non-members), with their parent and who waits.
pub(super) type Born = Vec<(Gid, Option<Comm>, Completer<Option<GroupInfo>>)>;

/// Who gets the result.
pub(super) enum Reply {
    Buf(Completer<HostBuffer>),
    Io(Completer<InOut>),
    Unit(Completer<()>),
    Group(Completer<Option<GroupInfo>>),
}

impl Reply {
    /// Completes with `out`; a new group's communicator comes back for the worker to register.
    pub(super) fn complete(self, out: Out) -> Option<(Option<Comm>, Completer<Option<GroupInfo>>)> {
        match (self, out) {
            (Reply::Buf(d), Out::Buf(b)) => d.complete(Ok(b)),
            (Reply::Io(d), Out::Io(io)) => d.complete(Ok(io)),
            (Reply::Unit(d), Out::Unit) => d.complete(Ok(())),
            (Reply::Group(d), Out::Comm(c)) => return Some((c, d)),
            (r, _) => r.fail(internal("an op finished with the wrong kind of output")),
        }
        None
    }

    pub(super) fn fail(self, e: CommError) {
        match self {
            Reply::Buf(d) => d.complete(Err(e)),
            Reply::Io(d) => d.complete(Err(e)),
            Reply::Unit(d) => d.complete(Err(e)),
            Reply::Group(d) => d.complete(Err(e)),
        }
    }
}

/// The running collective of a group.
pub(crate) struct Active {
    /// Keeps the op counted in its group's lane until it is done.
    pub(super) ticket: Option<Ticket>,
    pub(super) what: OpLabel,
    pub(super) started: Instant,
    pub(super) req: Request,
    pub(super) cont: Cont,
    pub(super) reply: Reply,
}

/// An op's steps: its header and how to start it once every rank agreed.
pub struct Steps {
    pub(super) name: &'static str,
    pub(super) header: Header,
    /// What this rank ships in the exchange for an op small enough to finish from it (every
    /// rank of an op with a matching header has one, possibly empty).
    pub(super) payload: Option<Vec<u8>>,
    /// An all_reduce's whole input, shipped with the header (in the slot, what does not fit
    /// beside it); it comes back in the exchange ([`Exchange::input`]).
    pub(super) whole: Option<HostBuffer>,
    pub(super) start: Start,
    pub(super) reply: Reply,
}

impl Steps {
    /// An op's steps whose exchange carries at most `payload` (not an all_reduce's whole input).
    pub(super) fn new(
        name: &'static str,
        header: Header,
        payload: Option<Vec<u8>>,
        start: impl FnOnce(&Env<'_>, Option<&mut Exchange>) -> Result<Step, CommError> + Send + 'static,
        reply: Reply,
    ) -> Steps {
        Steps { name, header, payload, whole: None, start: Box::new(start), reply }
    }
}

/// Issues the exchange before a collective (a long all_reduce input's start beside it,
/// [`beside_len`]); the continuation checks the headers and starts the op, on any thread.
pub(super) fn exchange(
    env: &Env<'_>,
    header: Header,
    payload: Option<Vec<u8>>,
    whole: Option<HostBuffer>,
    start: Start,
    what: OpLabel,
) -> Result<(Request, Cont), CommError> {
    let (comm, size, pool) = (env.comm, env.size, env.pool);
    let (slot, in_slot) = (exchange_slot_bytes(size), slot_max(size));
    let beside = whole.as_ref().map_or(0, |w| beside_len(w.byte_len(), size));
    let data = match (&payload, &whole) {
        (Some(p), _) => Some(&p[..]),
        (None, Some(w)) => Some(&w.as_bytes()[beside..]),
        (None, None) => None,
    };
    if data.is_some_and(|d| d.len() > in_slot) {
        return Err(internal("an exchange payload longer than the slot"));
    }
    let inline = data.is_some();
    // Our slot: the header (with the [`ALONE`] bit), then the data.
    let p = data.unwrap_or_default();
    let mut mine = pool.buffer(DType::U8, 32 + p.len());
    let mut words = header.encode();
    if held::alone(env.gid) {
        words[1] |= ALONE;
    }
    mine.as_bytes_mut()[..32].copy_from_slice(bytemuck::cast_slice(&words));
    mine.as_bytes_mut()[32..].copy_from_slice(p);
    // An all_reduce reads its own input from its buffer: only the header is copied over.
    let own = if whole.is_some() { 32 } else { mine.byte_len() };
    // Not zeroed when kept from an earlier op: every message starts with a whole header, and
    // data is read only from peers whose header (so whose length) matches.
    let req = raw::iexchange(comm, mine, slot, own, pool.buffer(DType::U8, slot * size))?;
    // The start is sent now, so its transfer overlaps the headers' round trip; received once
    // the headers agree (its length follows from theirs: `header.extra`).
    let (sends, input) = match whole {
        Some(w) if beside > 0 => (Some(raw::imessages(comm, raw::bulk_tag(), Some((w, 0..beside)), None, &[])?), None),
        w => (None, w),
    };
    let cont: Cont = Box::new(move |env: &Env<'_>, bufs: Bufs| {
        env.pool.recycle(bufs.send);
        let mut ex = Exchange { all: take(bufs.recv)?, slot, bulk: None, input };
        if let Err(e) = verify(&ex, env.size, &header, env.rank, what) {
            return drain(env, &ex, sends, e);
        }
        let may_block = ex.all_alone(env.size);
        let Some(sends) = sends else {
            let step = start(&Env { may_block, ..*env }, inline.then_some(&mut ex));
            env.pool.recycle(Some(ex.all));
            return step;
        };
        let len = bulk_len(&header, env.size).ok_or_else(|| internal("an all_reduce sent a part it has not"))?;
        let parts: Vec<_> = (0..env.size).filter(|&p| p != env.rank).map(|p| (p, p * len, len)).collect();
        let recvs =
            raw::imessages(env.comm, raw::bulk_tag(), None, Some(env.pool.buffer(DType::U8, len * env.size)), &parts)?;
        Ok(wait(recvs, move |_, b| {
            let peers = take(b.recv)?;
            Ok(wait(sends, move |env, b| {
                ex.input = b.send;
                ex.bulk = Some(Bulk { peers, len });
                let step = start(&Env { may_block, ..*env }, Some(&mut ex));
                env.pool.recycle(Some(ex.all));
                env.pool.recycle(ex.bulk.map(|b| b.peers));
                step
            }))
        }))
    });
    Ok((req, cont))
}

/// After a failed header check: receives what the peers sent beside the exchange and completes
/// our own sends, so no message of the failed op stays queued in MPI; then fails with `e`.
fn drain(env: &Env<'_>, ex: &Exchange, sends: Option<Request>, e: CommError) -> Result<Step, CommError> {
    let mut parts = Vec::new();
    let mut at = 0;
    for p in (0..env.size).filter(|&p| p != env.rank) {
        if let Some(len) = ex.header(p).and_then(|h| bulk_len(&h, env.size)) {
            parts.push((p, at, len));
            at += len;
        }
    }
    let fail = move |_: &Env<'_>, _: Bufs| -> Result<Step, CommError> { Err(e) };
    let then = move |env: &Env<'_>, b: Bufs| match sends {
        Some(sends) => Ok(wait(sends, fail)),
        None => fail(env, b),
    };
    if parts.is_empty() {
        return then(env, Bufs::default());
    }
    // Lengths from the peers' headers: an allocation that fails is an error, not an abort.
    let recvs = raw::imessages(env.comm, raw::bulk_tag(), None, Some(HostBuffer::try_zeroed(DType::U8, at)?), &parts)?;
    Ok(wait(recvs, then))
}

/// Keeps an unfinished request (and its buffers) until MPI completes it, if ever.
pub(super) fn bury(req: Request, graveyard: &mut Vec<Request>) {
    if !req.is_done() {
        graveyard.push(req);
    }
}
