//! One request struct per op. A backend implements [`Collective<R>`](crate::Collective) for
//! each; layers implement it once for every `R: Op`.
//!
//! Every request validates itself against the caller's rank and the group size with
//! [`Op::validate`], so all backends reject the same bad input with the same error.

use crate::{CommError, DType, HostBuffer, Rank, ReduceOp};

/// Slice `i` of `len` elements cut into `parts` contiguous slices, boundaries rounded up to
/// 16 elements (slices start on cache lines for every dtype up to 4 bytes); the last slices
/// may be short or empty. The one cut every backend's two-step algorithms use, so ranks agree
/// on who owns what.
///
/// ```
/// use comm_core::ops::slice_of;
/// assert_eq!(slice_of(100, 3, 0), 0..48);
/// assert_eq!(slice_of(100, 3, 2), 96..100);
/// assert_eq!(slice_of(10, 4, 3), 10..10);
/// ```
pub fn slice_of(len: usize, parts: usize, i: usize) -> std::ops::Range<usize> {
    let per = len.div_ceil(parts.max(1)).div_ceil(16) * 16;
    (i * per).min(len)..((i + 1) * per).min(len)
}

/// The ops of [`ops`](self), as plain values; [`code`](OpKind::code) is a stable number for
/// headers that ranks compare.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(u8)]
pub enum OpKind {
    /// An op defined elsewhere (a backend's diagnostic op, a test op).
    Other = 0,
    /// [`AllReduce`].
    AllReduce = 1,
    /// [`Broadcast`].
    Broadcast = 2,
    /// [`Reduce`].
    Reduce = 3,
    /// [`AllGather`].
    AllGather = 4,
    /// [`ReduceScatter`].
    ReduceScatter = 5,
    /// [`AllToAll`].
    AllToAll = 6,
    /// [`Scatter`].
    Scatter = 7,
    /// [`Gather`].
    Gather = 8,
    /// [`Barrier`].
    Barrier = 9,
    /// `new_group`, which backends agree on like a collective.
    NewGroup = 10,
    /// [`SendTo`].
    Send = 11,
    /// [`RecvFrom`].
    Recv = 12,
}

impl OpKind {
    const ALL: [OpKind; 13] = [
        OpKind::Other,
        OpKind::AllReduce,
        OpKind::Broadcast,
        OpKind::Reduce,
        OpKind::AllGather,
        OpKind::ReduceScatter,
        OpKind::AllToAll,
        OpKind::Scatter,
        OpKind::Gather,
        OpKind::Barrier,
        OpKind::NewGroup,
        OpKind::Send,
        OpKind::Recv,
    ];

    /// The name torch gives the op (`"all_reduce"`); `"op"` for [`OpKind::Other`].
    pub const fn name(self) -> &'static str {
        match self {
            OpKind::Other => "op",
            OpKind::AllReduce => "all_reduce",
            OpKind::Broadcast => "broadcast",
            OpKind::Reduce => "reduce",
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllToAll => "all_to_all",
            OpKind::Scatter => "scatter",
            OpKind::Gather => "gather",
            OpKind::Barrier => "barrier",
            OpKind::NewGroup => "new_group",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
        }
    }

    /// The kind named `name` (as [`name`](Self::name) spells it).
    pub fn from_name(name: &str) -> Option<OpKind> {
        Self::ALL.into_iter().find(|k| *k != OpKind::Other && k.name() == name)
    }

    /// A stable wire number (never 0 for a kind of this crate's set).
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// The kind with wire number `code`.
    pub fn from_code(code: u8) -> Option<OpKind> {
        Self::ALL.get(usize::from(code)).copied()
    }

    /// Whether every rank of the group takes part (not send/recv).
    pub const fn is_collective(self) -> bool {
        !matches!(self, OpKind::Send | OpKind::Recv)
    }
}

impl std::fmt::Display for OpKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A request for one op.
pub trait Op: Send + 'static {
    /// What the op's [`Work`](crate::Work) resolves to.
    type Output: Send + 'static;
    /// Which op this is, for code that treats ops alike whatever their buffers (headers on
    /// the wire, bandwidth factors). Ops outside this crate's set are [`OpKind::Other`].
    const KIND: OpKind = OpKind::Other;
    /// The op's name as torch spells it (`"all_reduce"`); also its span name suffix. Ops of
    /// this crate's set take their kind's name.
    const NAME: &'static str = Self::KIND.name();
    /// Message size in bytes: what this rank hands in (the input buffer; for reduce_scatter
    /// and all_to_all that is the full input, for all_gather and gather the per-rank shard,
    /// for scatter the block this rank receives, 0 for barrier). nccl-tests' operation size,
    /// from which bandwidth is computed, derives from it and the group size (the `profiling`
    /// crate does that per op).
    fn bytes(&self) -> usize;
    /// Element type, when the op carries data.
    fn dtype(&self) -> Option<DType>;
    /// Checks the arguments on this rank; group-wide agreement is the backend's job.
    fn validate(&self, rank: Rank, world_size: u32) -> Result<(), CommError>;
    /// The root rank, for ops that have one (every rank must name the same).
    fn root(&self) -> Option<Rank> {
        None
    }
    /// How the op combines, for reductions (every rank must use the same).
    fn reduce_op(&self) -> Option<ReduceOp> {
        None
    }
}

// Argument checks shared by every request type, here and in backends' own request types
// (e.g. NCCL's device-buffer ops), so the same bad input gets the same error everywhere.

/// `root` must be a rank of a group of `world`.
pub fn check_root(op: &'static str, root: Rank, world: u32) -> Result<(), CommError> {
    if root >= world {
        return Err(CommError::invalid(op, format!("root {root} is out of range for a group of {world} ranks")));
    }
    Ok(())
}

/// `r` must be defined for `dtype` (bitwise ops: integers; avg: floats).
pub fn check_reduce(op: &'static str, r: ReduceOp, dtype: DType) -> Result<(), CommError> {
    if !r.applies_to(dtype) {
        let why =
            if r == ReduceOp::Avg { "avg needs a floating-point dtype" } else { "bitwise ops need an integer dtype" };
        return Err(CommError::invalid(op, format!("reduce op {r} is not defined for {dtype}: {why}")));
    }
    Ok(())
}

/// A buffer (`what`) must hold exactly `want` elements.
pub fn check_len(op: &'static str, what: &str, got: usize, want: usize) -> Result<(), CommError> {
    if got != want {
        return Err(CommError::invalid(op, format!("{what} holds {got} elements, {want} are needed")));
    }
    Ok(())
}

fn check_output(op: &'static str, out: &HostBuffer, dtype: DType, len: usize) -> Result<(), CommError> {
    if out.dtype() != dtype {
        return Err(CommError::invalid(op, format!("output buffer is {} but the input is {dtype}", out.dtype())));
    }
    check_len(op, "output buffer", out.len(), len)
}

/// `world` blocks of `len` elements of `dtype` (an all_gather's or gather's output, a scatter's
/// input): their element count, when the bytes fit in memory.
pub fn check_total(op: &'static str, len: usize, world: u32, dtype: DType) -> Result<usize, CommError> {
    len.checked_mul(world as usize)
        .filter(|&total| dtype.checked_bytes(total).is_some())
        .ok_or_else(|| CommError::invalid(op, format!("{world} blocks of {len} × {dtype} do not fit in memory")))
}

/// The sum of `splits` (`what` names them), when it does not overflow.
pub fn check_splits_sum(op: &'static str, what: &str, splits: &[usize]) -> Result<usize, CommError> {
    splits
        .iter()
        .try_fold(0usize, |acc, &s| acc.checked_add(s))
        .ok_or_else(|| CommError::invalid(op, format!("{what} {splits:?} sum to more than usize::MAX elements")))
}

/// `peer` must be another rank of a group of `world` than `rank`.
pub fn check_peer(op: &'static str, peer: Rank, rank: Rank, world: u32) -> Result<(), CommError> {
    if peer >= world {
        return Err(CommError::invalid(op, format!("peer rank {peer} is out of range for a group of {world} ranks")));
    }
    if peer == rank {
        return Err(CommError::invalid(op, format!("rank {rank} cannot {op} to/from itself")));
    }
    Ok(())
}

/// `all_reduce`: every rank ends with the reduction of all ranks' `buf`. In place.
#[derive(Debug)]
pub struct AllReduce {
    /// Input, and output once reduced.
    pub buf: HostBuffer,
    /// How to combine.
    pub op: ReduceOp,
}

impl Op for AllReduce {
    type Output = HostBuffer;
    const KIND: OpKind = OpKind::AllReduce;
    fn bytes(&self) -> usize {
        self.buf.byte_len()
    }
    fn dtype(&self) -> Option<DType> {
        Some(self.buf.dtype())
    }
    fn validate(&self, _: Rank, _: u32) -> Result<(), CommError> {
        check_reduce(Self::NAME, self.op, self.buf.dtype())
    }
    fn reduce_op(&self) -> Option<ReduceOp> {
        Some(self.op)
    }
}

/// `broadcast`: every rank ends with `root`'s `buf`. In place.
#[derive(Debug)]
pub struct Broadcast {
    /// Data on the root; overwritten elsewhere.
    pub buf: HostBuffer,
    /// The rank whose data is sent.
    pub root: Rank,
}

impl Op for Broadcast {
    type Output = HostBuffer;
    const KIND: OpKind = OpKind::Broadcast;
    fn bytes(&self) -> usize {
        self.buf.byte_len()
    }
    fn dtype(&self) -> Option<DType> {
        Some(self.buf.dtype())
    }
    fn validate(&self, _: Rank, world: u32) -> Result<(), CommError> {
        check_root(Self::NAME, self.root, world)
    }
    fn root(&self) -> Option<Rank> {
        Some(self.root)
    }
}

/// `reduce`: `root` ends with the reduction of all ranks' `buf`; other ranks get their input back.
#[derive(Debug)]
pub struct Reduce {
    /// Input; on the root, the output.
    pub buf: HostBuffer,
    /// How to combine.
    pub op: ReduceOp,
    /// The rank that receives the result.
    pub root: Rank,
}

impl Op for Reduce {
    type Output = HostBuffer;
    const KIND: OpKind = OpKind::Reduce;
    fn bytes(&self) -> usize {
        self.buf.byte_len()
    }
    fn dtype(&self) -> Option<DType> {
        Some(self.buf.dtype())
    }
    fn validate(&self, _: Rank, world: u32) -> Result<(), CommError> {
        check_root(Self::NAME, self.root, world)?;
        check_reduce(Self::NAME, self.op, self.buf.dtype())
    }
    fn root(&self) -> Option<Rank> {
        Some(self.root)
    }
    fn reduce_op(&self) -> Option<ReduceOp> {
        Some(self.op)
    }
}

/// What an op that reads one buffer and fills another hands back: both, so that callers can
/// reuse them. `input` comes back unchanged. A side the op had no buffer for (a scatter's input
/// off the root, a gather's output off the root, when none was passed) is an empty buffer.
#[derive(Debug)]
pub struct InOut {
    /// The buffer the op read.
    pub input: HostBuffer,
    /// The buffer the op filled.
    pub output: HostBuffer,
}

/// `all_gather_into_tensor`: every rank ends with the concatenation of all ranks' `input`,
/// in rank order, in `output` (allocated when `None`), `world_size × input.len()` long.
#[derive(Debug)]
pub struct AllGather {
    /// This rank's shard.
    pub input: HostBuffer,
    /// Caller-provided output to fill (the `_into` variants).
    pub output: Option<HostBuffer>,
}

impl Op for AllGather {
    type Output = InOut;
    const KIND: OpKind = OpKind::AllGather;
    fn bytes(&self) -> usize {
        self.input.byte_len()
    }
    fn dtype(&self) -> Option<DType> {
        Some(self.input.dtype())
    }
    fn validate(&self, _: Rank, world: u32) -> Result<(), CommError> {
        let total = check_total(Self::NAME, self.input.len(), world, self.input.dtype())?;
        match &self.output {
            Some(out) => check_output(Self::NAME, out, self.input.dtype(), total),
            None => Ok(()),
        }
    }
}

/// `reduce_scatter_tensor`: `input` (`world_size × k` elements) is reduced across ranks and rank
/// `r` gets block `r` (`k` elements), in `output` (allocated when `None`).
#[derive(Debug)]
pub struct ReduceScatter {
    /// Full-length input.
    pub input: HostBuffer,
    /// How to combine.
    pub op: ReduceOp,
    /// Caller-provided output to fill (the `_into` variants).
    pub output: Option<HostBuffer>,
}

impl Op for ReduceScatter {
    type Output = InOut;
    const KIND: OpKind = OpKind::ReduceScatter;
    fn bytes(&self) -> usize {
        self.input.byte_len()
    }
    fn dtype(&self) -> Option<DType> {
        Some(self.input.dtype())
    }
    fn validate(&self, _: Rank, world: u32) -> Result<(), CommError> {
        check_reduce(Self::NAME, self.op, self.input.dtype())?;
        let n = self.input.len();
        if !n.is_multiple_of(world as usize) {
            return Err(CommError::invalid(
                Self::NAME,
                format!("input length {n} is not divisible by the group size {world}"),
            ));
        }
        match &self.output {
            Some(out) => check_output(Self::NAME, out, self.input.dtype(), n / world as usize),
            None => Ok(()),
        }
    }
    fn reduce_op(&self) -> Option<ReduceOp> {
        Some(self.op)
    }
}

/// `all_to_all_single`: rank `i` sends block `j` of its input to rank `j`, which stores it as
/// its block `i`. Blocks are equal (`input.len() / world_size`) unless splits are given
/// (element counts per peer, as torch's `input_split_sizes` / `output_split_sizes`).
#[derive(Debug)]
pub struct AllToAll {
    /// Data to send, blocks in destination-rank order.
    pub input: HostBuffer,
    /// Caller-provided output to fill.
    pub output: Option<HostBuffer>,
    /// Elements sent to each rank; `None` = equal split.
    pub input_splits: Option<Vec<usize>>,
    /// Elements received from each rank; `None` = equal split.
    pub output_splits: Option<Vec<usize>>,
}

impl AllToAll {
    /// The resolved (input, output) splits for a group of `world` ranks; call after `validate`.
    pub fn splits(&self, world: u32) -> (Vec<usize>, Vec<usize>) {
        let n = world as usize;
        let eq = |len: usize| vec![len / n; n];
        let ins = self.input_splits.clone().unwrap_or_else(|| eq(self.input.len()));
        let outs = self.output_splits.clone().unwrap_or_else(|| match &self.output {
            Some(o) => eq(o.len()),
            None => eq(self.input.len()),
        });
        (ins, outs)
    }
}

impl Op for AllToAll {
    type Output = InOut;
    const KIND: OpKind = OpKind::AllToAll;
    fn bytes(&self) -> usize {
        self.input.byte_len()
    }
    fn dtype(&self) -> Option<DType> {
        Some(self.input.dtype())
    }
    fn validate(&self, rank: Rank, world: u32) -> Result<(), CommError> {
        let n = world as usize;
        let bad = |reason: String| Err(CommError::invalid(Self::NAME, reason));
        if let Some(out) = &self.output {
            if out.dtype() != self.input.dtype() {
                return bad(format!("output buffer is {} but the input is {}", out.dtype(), self.input.dtype()));
            }
        }
        let output_len = self.output.as_ref().map(HostBuffer::len);
        for (what, splits, len) in
            [("input", &self.input_splits, Some(self.input.len())), ("output", &self.output_splits, output_len)]
        {
            match splits {
                Some(s) => {
                    if s.len() != n {
                        return bad(format!("{what}_splits has {} entries, the group has {n} ranks", s.len()));
                    }
                    let sum = check_splits_sum(Self::NAME, &format!("{what}_splits"), s)?;
                    if let Some(len) = len.filter(|&l| l != sum) {
                        return bad(format!("{what}_splits sum to {sum} but the {what} buffer holds {len} elements"));
                    }
                    if self.input.dtype().checked_bytes(sum).is_none() {
                        return bad(format!(
                            "{what}_splits sum to {sum} × {}: more than fits in memory",
                            self.input.dtype()
                        ));
                    }
                }
                None => {
                    let len = len.unwrap_or(self.input.len());
                    if len % n != 0 {
                        return bad(format!(
                            "{what} length {len} is not divisible by the group size {n} (give splits for uneven blocks)"
                        ));
                    }
                }
            }
        }
        match (&self.input_splits, &self.output_splits, output_len) {
            // Equal blocks both ways: every rank sends len/n to every rank, so what it receives
            // fills exactly an output of the input's length.
            (None, None, Some(out)) if out != self.input.len() => bad(format!(
                "output buffer holds {out} elements but the input holds {} (equal splits need equal lengths; give splits for uneven blocks)",
                self.input.len()
            )),
            (Some(_), None, None) => {
                bad("input_splits without output_splits or an output buffer: the receive size is unknown".into())
            }
            _ => {
                // The block a rank keeps must be as long as the block it receives from itself.
                let me = rank as usize;
                let block = |splits: &Option<Vec<usize>>, len: usize| splits.as_ref().map_or(len / n, |s| s[me]);
                let (sends, expects) = (
                    block(&self.input_splits, self.input.len()),
                    block(&self.output_splits, output_len.unwrap_or(self.input.len())),
                );
                if sends != expects {
                    return bad(format!(
                        "rank {me} sends {sends} elements to itself but its output expects {expects} from rank {me}"
                    ));
                }
                Ok(())
            }
        }
    }
}

/// `scatter`: the root's `input` (`world_size × output.len()` elements) is split in rank order
/// and rank `r` receives block `r` into `output`.
#[derive(Debug)]
pub struct Scatter {
    /// Receives this rank's block.
    pub output: HostBuffer,
    /// On the root: the blocks for every rank. Ignored elsewhere.
    pub input: Option<HostBuffer>,
    /// The rank that sends.
    pub root: Rank,
}

impl Op for Scatter {
    type Output = InOut;
    const KIND: OpKind = OpKind::Scatter;
    fn bytes(&self) -> usize {
        self.output.byte_len()
    }
    fn dtype(&self) -> Option<DType> {
        Some(self.output.dtype())
    }
    fn validate(&self, rank: Rank, world: u32) -> Result<(), CommError> {
        check_root(Self::NAME, self.root, world)?;
        if rank == self.root {
            let Some(input) = &self.input else {
                return Err(CommError::invalid(Self::NAME, "the root must pass the data to scatter"));
            };
            let total = check_total(Self::NAME, self.output.len(), world, self.output.dtype())?;
            check_output(Self::NAME, input, self.output.dtype(), total).map_err(|_| {
                CommError::invalid(
                    Self::NAME,
                    format!(
                        "root input is {} × {} elements, expected {} × {total} (world size × output length)",
                        input.dtype(),
                        input.len(),
                        self.output.dtype(),
                    ),
                )
            })?;
        }
        Ok(())
    }
    fn root(&self) -> Option<Rank> {
        Some(self.root)
    }
}

/// `gather`: the root receives every rank's `input`, concatenated in rank order, in `output`
/// (allocated when `None`).
#[derive(Debug)]
pub struct Gather {
    /// This rank's contribution.
    pub input: HostBuffer,
    /// On the root, a caller-provided output (`world_size × input.len()`).
    pub output: Option<HostBuffer>,
    /// The rank that receives.
    pub root: Rank,
}

impl Op for Gather {
    type Output = InOut;
    const KIND: OpKind = OpKind::Gather;
    fn bytes(&self) -> usize {
        self.input.byte_len()
    }
    fn dtype(&self) -> Option<DType> {
        Some(self.input.dtype())
    }
    fn validate(&self, rank: Rank, world: u32) -> Result<(), CommError> {
        check_root(Self::NAME, self.root, world)?;
        let total = check_total(Self::NAME, self.input.len(), world, self.input.dtype())?;
        match &self.output {
            Some(out) if rank == self.root => check_output(Self::NAME, out, self.input.dtype(), total),
            _ => Ok(()),
        }
    }
    fn root(&self) -> Option<Rank> {
        Some(self.root)
    }
}

/// `send`: point-to-point to `dst`. Resolves (handing `buf` back) once the data is out of
/// `buf`. Messages between two ranks are delivered in order; the receiver's `tag` must match.
#[derive(Debug)]
pub struct SendTo {
    /// The data.
    pub buf: HostBuffer,
    /// Destination rank.
    pub dst: Rank,
    /// Message tag.
    pub tag: u32,
}

impl Op for SendTo {
    type Output = HostBuffer;
    const KIND: OpKind = OpKind::Send;
    fn bytes(&self) -> usize {
        self.buf.byte_len()
    }
    fn dtype(&self) -> Option<DType> {
        Some(self.buf.dtype())
    }
    fn validate(&self, rank: Rank, world: u32) -> Result<(), CommError> {
        check_peer(Self::NAME, self.dst, rank, world)
    }
}

/// `recv`: point-to-point from `src` into `buf` (its dtype and length must match the send).
#[derive(Debug)]
pub struct RecvFrom {
    /// Receives the data.
    pub buf: HostBuffer,
    /// Source rank.
    pub src: Rank,
    /// Message tag.
    pub tag: u32,
}

impl Op for RecvFrom {
    type Output = HostBuffer;
    const KIND: OpKind = OpKind::Recv;
    fn bytes(&self) -> usize {
        self.buf.byte_len()
    }
    fn dtype(&self) -> Option<DType> {
        Some(self.buf.dtype())
    }
    fn validate(&self, rank: Rank, world: u32) -> Result<(), CommError> {
        check_peer(Self::NAME, self.src, rank, world)
    }
}

/// `barrier`: resolves once every rank of the group has entered it.
#[derive(Debug, Default, Clone, Copy)]
pub struct Barrier;

impl Op for Barrier {
    type Output = ();
    const KIND: OpKind = OpKind::Barrier;
    fn bytes(&self) -> usize {
        0
    }
    fn dtype(&self) -> Option<DType> {
        None
    }
    fn validate(&self, _: Rank, _: u32) -> Result<(), CommError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn slices_partition_in_order() {
        for len in [0, 1, 15, 16, 17, 1000, 4099] {
            for parts in 1..=5 {
                let mut next = 0;
                for i in 0..parts {
                    let r = super::slice_of(len, parts, i);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }
    use super::*;

    fn f32s(n: usize) -> HostBuffer {
        HostBuffer::zeroed(DType::F32, n)
    }

    #[test]
    fn kinds_round_trip_through_names_and_codes() {
        for k in OpKind::ALL {
            assert_eq!(OpKind::from_code(k.code()), Some(k));
            let named = OpKind::from_name(k.name());
            assert_eq!(named, (k != OpKind::Other).then_some(k));
        }
        assert_eq!(OpKind::from_code(13), None);
        assert_eq!(OpKind::from_name("inference_all_reduce"), None);
        assert_eq!(AllReduce::NAME, "all_reduce");
        assert_eq!(RecvFrom::KIND, OpKind::Recv);
        assert!(Barrier::KIND.is_collective() && !SendTo::KIND.is_collective());
    }

    #[test]
    fn bad_input_is_named() {
        let e = Broadcast { buf: f32s(1), root: 4 }.validate(0, 4).unwrap_err().to_string();
        assert!(e.contains("root 4") && e.contains("4 ranks"), "{e}");
        let e = AllReduce { buf: f32s(1), op: ReduceOp::BXor }.validate(0, 2).unwrap_err().to_string();
        assert!(e.contains("bxor") && e.contains("f32"), "{e}");
        let e = ReduceScatter { input: f32s(7), op: ReduceOp::Sum, output: None }.validate(0, 2).unwrap_err();
        assert!(e.to_string().contains("not divisible"), "{e}");
        let e =
            AllToAll { input: f32s(4), output: None, input_splits: Some(vec![1, 2]), output_splits: Some(vec![2, 2]) }
                .validate(0, 2)
                .unwrap_err();
        assert!(e.to_string().contains("input_splits sum to 3"), "{e}");
        let e = SendTo { buf: f32s(1), dst: 1, tag: 0 }.validate(1, 2).unwrap_err();
        assert!(e.to_string().contains("itself"), "{e}");
        let e = RecvFrom { buf: f32s(1), src: 9, tag: 0 }.validate(1, 2).unwrap_err();
        assert!(e.to_string().contains("out of range"), "{e}");
        let e =
            AllGather { input: f32s(2), output: Some(HostBuffer::zeroed(DType::F64, 4)) }.validate(0, 2).unwrap_err();
        assert!(e.to_string().contains("output buffer is f64"), "{e}");
        let e = Scatter { output: f32s(2), input: None, root: 0 }.validate(0, 2).unwrap_err();
        assert!(e.to_string().contains("root must pass"), "{e}");
    }

    fn a2a(input: usize, output: Option<usize>, ins: Option<Vec<usize>>, outs: Option<Vec<usize>>) -> AllToAll {
        AllToAll { input: f32s(input), output: output.map(f32s), input_splits: ins, output_splits: outs }
    }

    #[test]
    fn lengths_are_checked_exactly_and_without_overflow() {
        // Equal splits: the output must be exactly as long as the input (a longer one was
        // accepted and partly never written; a shorter one panicked in the engine).
        for out in [6, 2, 0] {
            let e = a2a(4, Some(out), None, None).validate(0, 2).unwrap_err().to_string();
            assert!(e.contains("equal splits need equal lengths"), "{out}: {e}");
        }
        a2a(4, Some(4), None, None).validate(1, 2).unwrap();
        // Split sums that wrap around usize.
        let e = a2a(0, Some(1), Some(vec![usize::MAX, 1]), Some(vec![0, 1])).validate(1, 2).unwrap_err().to_string();
        assert!(e.contains("input_splits") && e.contains("usize::MAX"), "{e}");
        let e = a2a(1, None, Some(vec![0, 1]), Some(vec![usize::MAX, 2])).validate(1, 2).unwrap_err().to_string();
        assert!(e.contains("output_splits") && e.contains("usize::MAX"), "{e}");
        // A sum that does not overflow usize but cannot be a buffer.
        let e = a2a(1, None, Some(vec![0, 1]), Some(vec![usize::MAX / 2, 1])).validate(1, 2).unwrap_err().to_string();
        assert!(e.contains("fits in memory"), "{e}");
        // The block a rank keeps.
        let e = a2a(4, None, Some(vec![1, 3]), Some(vec![2, 2])).validate(1, 2).unwrap_err().to_string();
        assert!(e.contains("sends 3 elements to itself") && e.contains("expects 2"), "{e}");
        let e = a2a(4, Some(6), Some(vec![2, 2]), None).validate(0, 2).unwrap_err().to_string();
        assert!(e.contains("sends 2 elements to itself") && e.contains("expects 3"), "{e}");
        a2a(4, Some(6), Some(vec![1, 3]), Some(vec![1, 5])).validate(0, 2).unwrap();
        // world × len products.
        let big = usize::MAX / 4 + 1;
        let huge_gather = AllGather { input: HostBuffer::zeroed(DType::U8, 0), output: None };
        huge_gather.validate(0, u32::MAX).unwrap();
        assert!(check_total("all_gather", big, 4, DType::U8).unwrap_err().to_string().contains("do not fit"));
        assert!(check_total("gather", usize::MAX / 8, 2, DType::F64).is_err());
        assert_eq!(check_total("gather", 3, 4, DType::F64).unwrap(), 12);
        assert!(check_splits_sum("x", "s", &[usize::MAX, 0, 1]).is_err());
        assert_eq!(check_splits_sum("x", "s", &[usize::MAX, 0]).unwrap(), usize::MAX);
    }

    #[test]
    fn good_input_passes_and_splits_resolve() {
        AllReduce { buf: HostBuffer::zeroed(DType::I8, 3), op: ReduceOp::BAnd }.validate(0, 3).unwrap();
        Scatter { output: f32s(2), input: None, root: 0 }.validate(1, 2).unwrap();
        let a = AllToAll { input: f32s(6), output: None, input_splits: None, output_splits: None };
        a.validate(0, 3).unwrap();
        assert_eq!(a.splits(3), (vec![2, 2, 2], vec![2, 2, 2]));
        let a =
            AllToAll { input: f32s(3), output: None, input_splits: Some(vec![0, 3]), output_splits: Some(vec![1, 3]) };
        a.validate(1, 2).unwrap();
        assert_eq!(a.splits(2), (vec![0, 3], vec![1, 3]));
    }
}
