//! The header exchange that starts every checked collective: one fixed-size slot per rank
//! (header, and a small op's data), compared alike on every rank.

use std::time::Instant;

use comm_core::lane::Ticket;
use comm_core::{config, CommError, DType, HostBuffer, OpKind, Rank, ReduceOp};

use crate::raw::{self, Bufs, Request};

use super::group::Group;
use super::held;
use super::plans::{internal, take, wait, Born, Cont, Env, Pool, Start, Step, Steps};

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

/// How many bytes a rank with header `h` sent beside the exchange of a group of `n` (the start
/// of an all_reduce's input longer than its slot), if it did.
pub(super) fn bulk_len(h: &Header, n: usize) -> Option<usize> {
    let len = usize::try_from(h.extra).ok()?;
    (h.op == OpKind::AllReduce.code()).then(|| beside_len(len, n)).filter(|&b| b > 0)
}

/// How many leading bytes of an all_reduce input go beside the exchange (the slot carries the
/// rest): none when it fits, else [`WHOLE_MAX`] (so little is copied), or what the slot cannot.
pub(super) fn beside_len(len: usize, n: usize) -> usize {
    let in_slot = slot_max(n);
    if len <= in_slot {
        return 0;
    }
    len.min(WHOLE_MAX).max(len - in_slot)
}

pub(super) const NO_VALUE: u8 = u8::MAX;
pub(super) const MAGIC: u64 = 0x636f_6d6d_6d70_6902; // "commmpi" + version 2
/// In a header's second word (bits 24..32 are not the header's): the sender held no other
/// group's collective when it sent it ([`held::alone`]). Not compared: ranks differ in it.
pub(super) const ALONE: u64 = 1 << 24;

pub(super) fn op_name(code: u8) -> &'static str {
    OpKind::from_code(code).filter(|k| *k != OpKind::Other).map_or("an unknown op", OpKind::name)
}

/// What every rank publishes before a collective; all ranks must publish the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Header {
    pub(super) op: u8,
    pub(super) dtype: u8,
    pub(super) redop: u8,
    pub(super) root: u32,
    pub(super) count: u64,
    /// Op-specific (new_group: a hash of the rank list).
    pub(super) extra: u64,
}

impl Header {
    pub(super) fn new(
        op: OpKind,
        dtype: Option<DType>,
        count: usize,
        root: Option<Rank>,
        redop: Option<ReduceOp>,
    ) -> Header {
        Header {
            op: op.code(),
            dtype: dtype.map_or(NO_VALUE, DType::code),
            redop: redop.map_or(NO_VALUE, ReduceOp::code),
            root: root.unwrap_or(u32::MAX),
            count: count as u64,
            extra: 0,
        }
    }

    pub(super) fn encode(&self) -> [u64; 4] {
        let w0 =
            u64::from(self.op) | u64::from(self.dtype) << 8 | u64::from(self.redop) << 16 | u64::from(self.root) << 32;
        [MAGIC, w0, self.count, self.extra]
    }

    pub(super) fn decode(w: &[u64]) -> Option<Header> {
        (w.len() == 4 && w[0] == MAGIC).then(|| Header {
            op: w[1] as u8,
            dtype: (w[1] >> 8) as u8,
            redop: (w[1] >> 16) as u8,
            root: (w[1] >> 32) as u32,
            count: w[2],
            extra: w[3],
        })
    }

    pub(super) fn describe(&self) -> String {
        let mut s = op_name(self.op).to_owned();
        let mut parts = Vec::new();
        if let Some(d) = DType::from_code(self.dtype) {
            parts.push(if self.op == OpKind::AllToAll.code() {
                d.to_string()
            } else {
                format!("{d} × {}", self.count)
            });
        }
        if self.op == OpKind::NewGroup.code() {
            parts.push(format!("{} ranks, list hash {:016x}", self.count, self.extra));
        }
        if self.root != u32::MAX {
            parts.push(format!("root {}", self.root));
        }
        if let Some(op) = ReduceOp::ALL.get(self.redop as usize) {
            parts.push(op.to_string());
        }
        if !parts.is_empty() {
            s += &format!(" ({})", parts.join(", "));
        }
        s
    }
}

/// FNV-1a of a rank list: ranks that pass different lists to `new_group` disagree.
pub(super) fn hash_ranks(ranks: &[Rank]) -> u64 {
    ranks
        .iter()
        .flat_map(|r| r.to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// Bytes per rank received in the exchange of a group of `n`: the header, then data. One size
/// per group, so every receive holds whatever a peer sends, whatever the ranks called.
pub(super) fn exchange_slot_bytes(n: usize) -> usize {
    if n <= WHOLE_RANKS {
        return (32 + WHOLE_MAX).next_multiple_of(64);
    }
    let x = ((16 << 10) / n.max(1)).clamp(256, 1 << 10);
    1 << (usize::BITS - 1 - x.leading_zeros())
}

/// Groups of at most this many ranks receive slots that hold a whole all_reduce input of up to
/// [`WHOLE_MAX`] bytes.
const WHOLE_RANKS: usize = 8;
/// With our header and MPI's own, a message within Open MPI's 64 KiB TCP eager limit.
pub(super) const WHOLE_MAX: usize = (64 << 10) - 32 - 64;

/// The most data a rank's exchange slot carries in a group of `n`.
pub(super) fn slot_max(n: usize) -> usize {
    exchange_slot_bytes(n) - 32
}

/// What any group's exchange slot holds besides the header.
pub(super) const INLINE_ANY: usize = 256 - 32;

/// The most data a small op ships inside the exchange (then needing no other MPI call): up to
/// [`WHOLE_RANKS`], within Open MPI's 4 KiB shared-memory eager limit.
pub(super) fn inline_max(n: usize) -> usize {
    if n <= WHOLE_RANKS {
        return (4 << 10) - 96;
    }
    slot_max(n)
}

/// Every rank's exchange slot, gathered, and an all_reduce's inputs.
pub(super) struct Exchange {
    pub(super) all: HostBuffer,
    pub(super) slot: usize,
    /// The starts of the peers' inputs, sent beside the slots.
    pub(super) bulk: Option<Bulk>,
    /// This rank's whole input ([`Steps::whole`]).
    pub(super) input: Option<HostBuffer>,
}

/// The starts of all_reduce inputs exchanged beside the slots.
pub(super) struct Bulk {
    /// Peer `p`'s at `p × len` (this rank's block unused).
    peers: HostBuffer,
    len: usize,
}

impl Exchange {
    /// The first `len` bytes of rank `p`'s data in its slot.
    pub(super) fn data(&self, p: usize, len: usize) -> &[u8] {
        &self.all.as_bytes()[p * self.slot + 32..][..len]
    }

    /// Bytes `[lo, hi)` of rank `p`'s data: in the start sent beside its slot, or in the slot
    /// (which holds the bytes after that start).
    pub(super) fn range(&self, p: usize, lo: usize, hi: usize) -> &[u8] {
        match &self.bulk {
            Some(b) if hi <= b.len => &b.peers.as_bytes()[p * b.len..][lo..hi],
            Some(b) => &self.data(p, hi - b.len)[lo - b.len..],
            None => &self.data(p, hi)[lo..],
        }
    }

    /// Whether every rank of a group of `n` sent its header [`ALONE`].
    pub(super) fn all_alone(&self, n: usize) -> bool {
        (0..n).all(|p| bytemuck::cast_slice::<u8, u64>(&self.all.as_bytes()[p * self.slot..][..16])[1] & ALONE != 0)
    }

    /// Rank `p`'s header.
    pub(super) fn header(&self, p: usize) -> Option<Header> {
        let at = p * self.slot;
        Header::decode(bytemuck::cast_slice(&self.all.as_bytes()[at..at + 32]))
    }
}

/// Names a collective in messages ("all_reduce #3"), formatted only when a message needs it.
#[derive(Clone, Copy, Debug)]
pub(super) struct OpLabel {
    pub(super) name: &'static str,
    /// The group's collective number (direct ops: the lane's count).
    pub(super) seq: u64,
    /// Run on a caller's thread.
    pub(super) direct: bool,
}

impl OpLabel {
    /// The error of a failed request of this op: a truncated receive means a peer sent more
    /// than this rank expected, so the ranks called different ops or sizes.
    pub(super) fn failed(self, err: raw::MpiError) -> CommError {
        if err.is_truncation() {
            CommError::mismatch(self.name, format!("{self}: ranks passed different sizes ({err})"))
        } else {
            err.into()
        }
    }
}

impl std::fmt::Display for OpLabel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.direct {
            true => write!(f, "{} (direct #{})", self.name, self.seq),
            false => write!(f, "{} #{}", self.name, self.seq),
        }
    }
}

/// Starts a group's next collective: the header exchange first (with checking on).
pub(super) fn start_collective(
    g: &mut Group,
    steps: Steps,
    ticket: Option<Ticket>,
    half: Option<&raw::HalfOps>,
    pool: &Pool,
    graveyard: &mut Vec<Request>,
    born: &mut Born,
) {
    let Steps { name, header, payload, whole, start, reply } = steps;
    config::injected_panic(g.params.panic_at, name, g.info.rank);
    let what = OpLabel { name, seq: g.seq, direct: false };
    let checked = g.info.size > 1 && (g.params.check || header.op == OpKind::NewGroup.code());
    let env = g.env(half, pool);
    let first = if checked {
        exchange(&env, header, payload, whole, start, what).map(|(req, cont)| Step::Wait(req, cont))
    } else if whole.is_some() {
        Err(internal("an input planned beside an exchange that does not happen"))
    } else {
        start(&env, None)
    };
    g.next((ticket, what, Instant::now(), reply), first, graveyard, born);
}

/// Compares every rank's header with rank 0's (so every rank reaches the same verdict).
pub(super) fn verify(ex: &Exchange, n: usize, mine: &Header, me: usize, what: OpLabel) -> Result<(), CommError> {
    let (op, first) = (op_name(mine.op), ex.header(0));
    for p in 0..n {
        let why = match (ex.header(p), first) {
            (Some(h), Some(f)) if h == f => continue,
            (Some(h), Some(f)) => format!(
                "rank {p} called {} but rank 0 called {} (seen by rank {me} at its {what})",
                h.describe(),
                f.describe()
            ),
            _ => {
                format!("{what}: rank {p} sent a header this version does not understand (another program or version?)")
            }
        };
        return Err(CommError::mismatch(op, why));
    }
    Ok(())
}
