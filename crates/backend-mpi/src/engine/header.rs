//! The header exchange that starts every checked collective: one fixed-size slot per rank
//! (header, and a small op's data), compared alike on every rank.

use comm_core::{CommError, DType, HostBuffer, OpKind, Rank, ReduceOp};

use crate::raw;

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
    pub(super) peers: HostBuffer,
    pub(super) len: usize,
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
