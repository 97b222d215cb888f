//! Where everything lives inside one rank's segment.
//!
//! ```text
//! 0     control: magic, version, world, rank, state, window          (line 0)
//! 64    step counter: last step this rank published                 (line 1)
//! 128   doorbell + sleeping flag: futex word peers ring               (line 2)
//! 192   abort reason (256 bytes of UTF-8)
//! 512   p2p counters, one cache line each: sent[peer]..., acked[peer]...
//! coll  2 × (64-byte step header + window)      double-buffered window
//! p2p   world × SLOTS × (64-byte msg header + slot)   one mailbox per destination
//! ```
//! Every rank writes only its own segment; peers read it.

use bytemuck::{Pod, Zeroable};

pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"commshm1");
/// Raised whenever the segment layout or the step protocol changes (git has the history), so
/// ranks of different builds refuse each other.
pub(crate) const VERSION: u32 = 11;

pub(crate) const OFF_MAGIC: usize = 0;
pub(crate) const OFF_VERSION: usize = 8;
pub(crate) const OFF_WORLD: usize = 12;
pub(crate) const OFF_RANK: usize = 16;
pub(crate) const OFF_STATE: usize = 20;
pub(crate) const OFF_WINDOW: usize = 24;
pub(crate) const OFF_STEP: usize = 64;
pub(crate) const OFF_DOORBELL: usize = 128;
/// Who sleeps on the doorbell: flags, each set and cleared by its owner (ARCHITECTURE.md,
/// "Sleeping flags"); 0 when nobody does.
pub(crate) const OFF_SLEEPING: usize = 132;
/// Waiting for peers (a collective's step, a point-to-point slot): every peer that publishes
/// progress rings.
pub(crate) const SLEEP_PEERS: u32 = 1;
/// Nothing in flight: only this rank's own submissions (and a peer closing or failing) ring
/// (ARCHITECTURE.md, "Idle workers sleep through peers' steps").
pub(crate) const SLEEP_LOCAL: u32 = 2;
/// The engine's holder waits for a peer's step or slot: every peer that publishes progress
/// rings, as for [`SLEEP_PEERS`].
pub(crate) const SLEEP_ENGINE: u32 = 4;
pub(crate) const OFF_REASON: usize = 192;
pub(crate) const REASON_LEN: usize = 256;
/// Non-zero while a caller of this rank waits in a receive on its own thread (its own line:
/// written at every such receive). A peer waiting for this rank's message gives up early
/// when it is set: this rank may be waiting for the peer in turn.
pub(crate) const OFF_RECEIVING: usize = 448;
const OFF_P2P_COUNTERS: usize = 512;
const LINE: usize = 64;
/// A step or message header; a collective buffer's precedes its data (so a small op's data
/// is the line next to the one a waiting peer polls).
const HDR: usize = 64;

/// Smallest step that moves through the window ([`Layout::rotation`]).
const ROTATE_MIN: usize = 4096;

/// Smallest mailbox chunk that moves through its slot: a receiver copies a chunk out right
/// away, so a few lines are quickest taken back from its L1 (4 KiB chunks ran 20 % slower
/// when they moved, 8 KiB the same, 16–64 KiB 5–8 % faster).
const MSG_ROTATE_MIN: usize = 16 << 10;

/// Mailbox slots per destination: two, so a sender fills one while the receiver drains the other.
pub(crate) const SLOTS: u64 = 2;

/// `state` values.
pub(crate) const STATE_READY: u32 = 1;
pub(crate) const STATE_ABORTED: u32 = 2;
pub(crate) const STATE_CLOSED: u32 = 3;
/// Between `READY` and `ABORTED` while the reason is written (`engine::publish_abort`).
pub(crate) const STATE_WRITING: u32 = 4;

/// Offsets of one segment, identical on every rank of a group.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Layout {
    pub(crate) world: usize,
    pub(crate) window: usize,
    pub(crate) slot: usize,
    coll: usize,
    p2p: usize,
    pub(crate) total: usize,
}

impl Layout {
    /// The layout for `world` ranks, or `None` when the segment's size would overflow
    /// (`window` and `slot` are bounded by [`crate::ShmOptions`]; this guards `world` too).
    pub(crate) fn new(world: usize, window: usize, slot: usize) -> Option<Layout> {
        let align = |x: usize, a: usize| x.checked_next_multiple_of(a);
        let window = align(window.max(4096), LINE)?;
        let slot = align(slot.max(4096), LINE)?;
        let coll = align(world.checked_mul(LINE)?.checked_add(OFF_P2P_COUNTERS)?, 4096)?;
        let p2p = (HDR + window).checked_mul(2)?.checked_add(coll)?;
        let mailboxes = world.checked_mul(SLOTS as usize)?.checked_mul(HDR.checked_add(slot)?)?;
        let total = align(p2p.checked_add(mailboxes)?, 4096)?;
        (total <= isize::MAX as usize).then_some(Layout { world, window, slot, coll, p2p, total })
    }

    /// Counter of chunks this rank has consumed from `peer`.
    pub(crate) fn acked(&self, peer: usize) -> usize {
        OFF_P2P_COUNTERS + peer * LINE
    }

    /// Header of the collective buffer used by step `k`. Its first word is the header's
    /// step, written last (atomically, release) when the step is published: a peer waiting
    /// for the step polls this line and finds the header with it.
    pub(crate) fn step_header(&self, k: u64) -> usize {
        self.coll + (k % 2) as usize * (HDR + self.window)
    }

    /// Data of the collective buffer used by step `k` (`window` bytes).
    pub(crate) fn step_data(&self, k: u64) -> usize {
        self.step_header(k) + HDR
    }

    /// Where in the buffer of step `k` a step that moves `bytes` per rank puts them (the same on
    /// every rank): from a page, the `k / 2`-th step on it takes the next line-aligned slot of
    /// its size, wrapping (ARCHITECTURE.md, "Where a step's data goes in the window").
    pub(crate) fn rotation(&self, k: u64, bytes: usize) -> usize {
        place(k / 2, bytes, self.window, ROTATE_MIN)
    }

    /// Header of the mailbox slot for chunk number `chunk` to `peer`.
    pub(crate) fn msg_header(&self, peer: usize, chunk: u64) -> usize {
        self.p2p + (peer * SLOTS as usize + (chunk % SLOTS) as usize) * (HDR + self.slot)
    }

    /// Data of that slot: where chunk number `chunk` of `len` bytes (at most `slot`) starts
    /// in it. Chunks of [`MSG_ROTATE_MIN`] or more move through their slot as steps move
    /// through the window ([`Layout::rotation`]).
    pub(crate) fn msg_data(&self, peer: usize, chunk: u64, len: usize) -> usize {
        self.msg_header(peer, chunk) + HDR + place(chunk / SLOTS, len, self.slot, MSG_ROTATE_MIN)
    }
}

/// Where the `j`-th use of a buffer of `space` bytes puts `bytes` (at most `space`): from
/// `min` up, the `j`-th line-aligned slot of that size, wrapping; below it, the start.
fn place(j: u64, bytes: usize, space: usize, min: usize) -> usize {
    if bytes < min {
        return 0;
    }
    let stride = bytes.next_multiple_of(LINE);
    let slots = (space / stride).max(1) as u64;
    (j % slots) as usize * stride
}

/// Written by every rank at every collective step; peers compare it with their own, so ranks
/// that call different ops (or sizes, dtypes, roots) get `Mismatch` instead of garbage.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub(crate) struct StepHeader {
    /// Only ever accessed atomically in the segment (see [`Layout::step_header`]).
    pub(crate) step: u64,
    pub(crate) seq: u64,
    pub(crate) count: u64,
    pub(crate) aux: u64,
    pub(crate) root: u32,
    pub(crate) op: u8,
    pub(crate) dtype: u8,
    pub(crate) redop: u8,
    pub(crate) _pad: u8,
    /// The data of a one-step op that writes at most [`CARRIED`] bytes (then not in the
    /// window): it reaches a peer in the line the peer polls, one cache-line transfer per
    /// rank and step instead of two. Zero otherwise; never compared between ranks.
    pub(crate) data: [u8; CARRIED],
}

/// Bytes of data a step header carries (the header's 64 bytes less its 40 of fields).
pub(crate) const CARRIED: usize = 24;

/// Offset of [`StepHeader::data`] in the header.
pub(crate) const CARRIED_AT: usize = HDR - CARRIED;

/// Header of one mailbox chunk.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub(crate) struct MsgHeader {
    /// The chunk's number + 1 once published: written last (atomically), it is the word a
    /// receiver polls, so the header comes with it (and with it the data of a small chunk);
    /// a slot's previous chunk left its own number there, and a new segment 0.
    pub(crate) published: u64,
    pub(crate) total: u64,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) tag: u32,
    pub(crate) dtype: u8,
    /// [`IN_PLACE`] or 0.
    pub(crate) flags: u8,
    pub(crate) _pad: [u8; 2],
    /// The data of a chunk of at most [`CARRIED`] bytes (then not in the slot).
    pub(crate) data: [u8; CARRIED],
}

/// [`MsgHeader::flags`]: the message is not in the mailbox; its data carries where the whole
/// message is in the sender's arena, for the receiver to copy it from there and acknowledge
/// the chunk when done.
pub(crate) const IN_PLACE: u8 = 1;

const _: () = assert!(size_of::<StepHeader>() == HDR && size_of::<MsgHeader>() == HDR);
const _: () = assert!(std::mem::offset_of!(StepHeader, data) == CARRIED_AT);
const _: () = assert!(std::mem::offset_of!(MsgHeader, data) == CARRIED_AT);

/// A header's bytes after its first word (which is written separately, atomically, last).
pub(crate) fn body<H: Pod>(h: &H) -> [u64; HDR / 8 - 1] {
    bytemuck::cast::<H, [u64; HDR / 8]>(*h)[1..].try_into().expect("a header is HDR bytes")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_do_not_overlap() {
        for world in 1..=16 {
            let l = Layout::new(world, 1 << 16, 1 << 13).unwrap();
            assert!(l.acked(world - 1) + 8 <= l.step_header(0));
            assert_eq!(l.step_data(0), l.step_header(0) + 64);
            assert_eq!(l.step_data(0) + l.window, l.step_header(1));
            assert!(l.step_data(1) + l.window <= l.msg_header(0, 0));
            assert!(l.msg_data(world - 1, 1, l.slot) + l.slot <= l.total);
            assert_eq!(l.step_header(0) % 64, 0);
            assert_eq!(l.msg_data(1 % world, 1, 64) % 64, 0);
        }
    }

    #[test]
    fn steps_move_through_the_window() {
        let l = Layout::new(2, 1 << 16, 1 << 13).unwrap();
        for bytes in [0, 64, ROTATE_MIN - 1] {
            assert!((0..8).all(|k| l.rotation(k, bytes) == 0), "{bytes}");
        }
        // 16 KiB steps: four slots per buffer, visited in turn, line-aligned, inside it.
        let at: Vec<usize> = (0..10).map(|k| l.rotation(k, 16 << 10)).collect();
        assert_eq!(at, [0, 0, 16384, 16384, 32768, 32768, 49152, 49152, 0, 0]);
        for (k, bytes) in (0..64).flat_map(|k| [(k, 4096), (k, 5000), (k, 40000), (k, 1 << 16)]) {
            let at = l.rotation(k, bytes);
            assert!(at.is_multiple_of(64) && at + bytes <= l.window, "step {k} of {bytes} at {at}");
        }
        // The step after `k` on the same buffer of equal size never starts where `k` did,
        // unless only one fits.
        assert_ne!(l.rotation(3, 30000), l.rotation(5, 30000));
        assert_eq!(l.rotation(3, 40000), l.rotation(5, 40000));
    }

    #[test]
    fn mailbox_chunks_move_through_their_slot() {
        let l = Layout::new(2, 1 << 16, 1 << 16).unwrap();
        let data = |chunk, len| l.msg_data(1, chunk, len) - l.msg_header(1, chunk) - 64;
        // 16 KiB chunks: slot `chunk % 2`, four places in it, each visited in turn.
        let at: Vec<usize> = (0..10).map(|c| data(c, 16 << 10)).collect();
        assert_eq!(at, [0, 0, 16384, 16384, 32768, 32768, 49152, 49152, 0, 0]);
        // Small and whole-slot chunks stay at the start; every chunk stays inside its slot.
        assert!((0..8).all(|c| data(c, 100) == 0 && data(c, 4096) == 0 && data(c, 1 << 16) == 0));
        for (c, len) in (0..64).flat_map(|c| [(c, 16384), (c, 20000), (c, 40000), (c, 1 << 16)]) {
            assert!(data(c, len) + len <= l.slot, "chunk {c} of {len}");
        }
    }
}
