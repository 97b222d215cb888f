//! The process's arena of shared memory for large host buffers (`comm_core::LargeBuffers`):
//! anonymous chunks peers map once through `/proc/<pid>/fd/<fd>` (nothing named in /dev/shm,
//! nothing left behind however the process ends), carved into blocks reused by size, never
//! given back while the process lives, bounded by `COMM_SHM_ARENA_MAX`.
//!
//! A block is touched by its buffer's owner whenever the buffer is not in an op, and by peers
//! only during an op that owns the buffer; it is reused only after its buffer is dropped,
//! which cannot happen while an op owns it, so no peer reads a freed or reused block.

#![allow(unsafe_code)] // see the SAFETY comments

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use comm_core::{ExternalStorage, LargeBuffers};

use crate::segment::Segment;

/// Bytes of one chunk; blocks up to this size are carved from chunks.
pub(crate) const CHUNK: usize = 64 << 20;
/// The smallest block.
const PAGE: usize = 4096;
/// Where a buffer starts in its block: 17 cache lines in, not on a page boundary, against 4K
/// aliasing of copies between it and the window (docs/performance.md).
const SKEW: usize = 1088;
/// `COMM_SHM_ARENA_MIN`'s default: from this size, buffers live in the arena and collectives
/// read them in place (from 64 KiB that beat one step: all_reduce at 2 ranks 0.33-0.61x the
/// time at 64-256 KiB).
pub(crate) const DEFAULT_MIN: usize = 64 << 10;

/// Free bytes of /dev/shm: the default bound of the arena (a host whose /dev/shm is small,
/// like a container's 64 MiB, has little shared memory to spare).
pub(crate) fn shm_free() -> usize {
    rustix::fs::statvfs("/dev/shm").map_or(0, |s| (s.f_bavail.saturating_mul(s.f_frsize)) as usize)
}

pub(crate) struct Arena {
    /// The smallest buffer made here ([`crate::ShmOptions::arena_min`]).
    min: usize,
    /// Bytes of blocks at most ([`crate::ShmOptions::arena_max`]).
    max: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Bytes of blocks carved.
    made: usize,
    /// The chunk blocks are carved from, and where its unused part starts.
    current: Option<(Arc<Segment>, usize)>,
    /// Blocks of dropped buffers, by block size.
    free: HashMap<usize, Vec<(Arc<Segment>, usize)>>,
    /// Whether running out of room was logged.
    warned: bool,
}

static ARENA: OnceLock<Arena> = OnceLock::new();

/// Installs the process's arena as the large-buffer provider the first time a group is made
/// (not when `COMM_SHM_ARENA_MIN=off`).
pub(crate) fn install(min: Option<usize>, max: usize) {
    if min.is_some_and(|min| ARENA.set(Arena { min, max, state: Mutex::default() }).is_ok()) {
        comm_core::set_large_buffers(Some(Arc::new(Installed(ARENA.get().expect("just set")))));
    }
}

/// The arena, if a group installed it.
pub(crate) fn get() -> Option<&'static Arena> {
    ARENA.get()
}

struct Installed(&'static Arena);

impl LargeBuffers for Installed {
    fn min_bytes(&self) -> usize {
        self.0.min
    }
    fn alloc(&self, bytes: usize, zeroed: bool) -> Option<Box<dyn ExternalStorage>> {
        self.0.block(bytes, zeroed).map(|b| Box::new(b) as Box<dyn ExternalStorage>)
    }
}

impl Arena {
    /// A block for a buffer of `len` bytes (zeroed when `zeroed`), or `None` when the arena is
    /// at its bound or the system has no memory for a chunk.
    pub(crate) fn block(&'static self, len: usize, zeroed: bool) -> Option<Block> {
        let size = block_size(len.checked_add(SKEW)?)?;
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((chunk, off)) = st.free.get_mut(&size).and_then(Vec::pop) {
            drop(st);
            let mut b = Block { chunk, off, size, len, arena: self };
            if zeroed {
                b.bytes_mut().fill(0);
            }
            return Some(b);
        }
        // A fresh block is zeroed: chunks start zeroed and blocks are carved once. Its memory
        // is taken (and counted against the bound) as it is carved.
        if st.made.checked_add(size).is_none_or(|m| m > self.max) {
            return self.full(&mut st, len, None);
        }
        let fits = |c: &(Arc<Segment>, usize)| size <= CHUNK && c.1 + size <= CHUNK;
        let (chunk, off) = match st.current.as_ref().filter(|c| fits(c)) {
            Some((chunk, off)) => (chunk.clone(), *off),
            None => match Segment::anonymous("comm-arena", size.max(CHUNK)) {
                Ok(c) => (Arc::new(c), 0),
                Err(e) => return self.full(&mut st, len, Some(e)),
            },
        };
        if let Err(e) = chunk.reserve(off, size) {
            return self.full(&mut st, len, Some(e));
        }
        st.made += size;
        if size < CHUNK {
            st.current = Some((chunk.clone(), off + size));
        }
        Some(Block { chunk, off, size, len, arena: self })
    }

    fn full(&self, st: &mut State, len: usize, err: Option<std::io::Error>) -> Option<Block> {
        if !std::mem::replace(&mut st.warned, true) {
            let why = err.map_or_else(|| format!("COMM_SHM_ARENA_MAX={} bytes reached", self.max), |e| e.to_string());
            tracing::warn!(
                "comm shm: no room in the shared-memory arena for a buffer of {len} bytes ({why}); large buffers are plain \
                 memory from now on, and ops on them copy"
            );
        }
        None
    }
}

/// The block for `need` bytes: up to a chunk, `need` rounded up to a quarter of its power of
/// two (at least a page), so a block wastes under a fifth of itself — a buffer of 4 MiB (plus
/// [`SKEW`]) takes 5 MiB, not 8 — and blocks fall into few sizes that dropped buffers' blocks
/// can serve again; past a chunk, whole pages.
fn block_size(need: usize) -> Option<usize> {
    if need > CHUNK {
        return need.checked_next_multiple_of(PAGE);
    }
    let quarter = (need.max(PAGE).next_power_of_two() / 8).max(PAGE);
    Some(need.max(PAGE).next_multiple_of(quarter))
}

/// The storage of a buffer in the arena.
pub(crate) struct Block {
    chunk: Arc<Segment>,
    off: usize,
    /// The block's size (its free list).
    size: usize,
    /// The buffer's bytes, at most `size`.
    len: usize,
    arena: &'static Arena,
}

/// Where a block is, for peers: its chunk's fd and length, and its offset in the chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Place {
    pub(crate) fd: i32,
    pub(crate) chunk_len: usize,
    pub(crate) off: usize,
}

impl Block {
    /// Where this block is; `None` for a chunk that is not anonymous (never: chunks are).
    pub(crate) fn place(&self) -> Option<Place> {
        Some(Place { fd: self.chunk.fd()?, chunk_len: self.chunk.len(), off: self.off + SKEW })
    }
}

impl ExternalStorage for Block {
    fn bytes(&self) -> &[u8] {
        // SAFETY: the block's bytes are written only through `&mut` to its `HostBuffer` (by
        // the user, or by an op that owns the buffer) and read by peers only during an op
        // that owns the buffer (see the module docs), so no one writes them while this shared
        // borrow of `self` lives. No other block overlaps it.
        unsafe { self.chunk.bytes(self.off + SKEW, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `&mut self` is the only access on this side; peers touch it only during an
        // op that owns the buffer (see `bytes`); no other block overlaps it.
        unsafe { self.chunk.bytes_mut(self.off + SKEW, self.len) }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        let mut st = self.arena.state.lock().unwrap_or_else(|e| e.into_inner());
        st.free.entry(self.size).or_default().push((self.chunk.clone(), self.off));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arena(max: usize) -> &'static Arena {
        Box::leak(Box::new(Arena { min: PAGE, max, state: Mutex::default() }))
    }

    #[test]
    fn blocks_are_carved_reused_and_bounded() {
        let a = arena(3 * CHUNK);
        let mut x = a.block(100_000, true).unwrap();
        assert_eq!((x.size, x.off), (7 << 14, 0));
        assert!(x.bytes().iter().all(|&b| b == 0));
        x.bytes_mut().fill(7);
        let y = a.block(5000, false).unwrap();
        assert_eq!((y.size, y.off), (8192, 7 << 14));
        let place = x.place().unwrap();
        drop(x);
        // The dropped block comes back for the next buffer of its size, zeroed when asked.
        let z = a.block(100_000, true).unwrap();
        assert_eq!(z.place(), Some(place));
        assert!(z.bytes().iter().all(|&b| b == 0));
        // A buffer larger than a chunk gets one of its own; past the bound, none.
        let big = a.block(CHUNK + 1, false).unwrap();
        assert_eq!((big.size, big.off), (CHUNK + PAGE, 0));
        let _whole = a.block(CHUNK, false).unwrap();
        assert!(a.block(CHUNK, false).is_none(), "over COMM_SHM_ARENA_MAX");
        drop(big);
        assert!(a.block(CHUNK + 100, false).is_some(), "the big block is reused");
    }

    #[test]
    fn blocks_waste_under_a_fifth() {
        assert_eq!(block_size(1), Some(PAGE));
        assert_eq!(block_size((4 << 20) + SKEW), Some(5 << 20));
        assert_eq!(block_size((1 << 20) + 1), Some(5 << 18));
        assert_eq!(block_size(CHUNK), Some(CHUNK));
        assert_eq!(block_size(CHUNK + 1), Some(CHUNK + PAGE));
        for need in (PAGE..CHUNK).step_by(12_345) {
            let b = block_size(need).unwrap();
            assert!(b >= need && (b - need) * 5 < b.max(5 * PAGE), "{need} -> {b}");
        }
    }

    #[test]
    fn peers_map_a_block_where_it_is() {
        let a = arena(CHUNK);
        let mut b = a.block(3 * PAGE, false).unwrap();
        b.bytes_mut().fill(9);
        let p = b.place().unwrap();
        let peer = Segment::open_anonymous(std::process::id(), p.fd, p.chunk_len).unwrap();
        // SAFETY: nothing writes the block while this test reads it.
        assert!(unsafe { peer.bytes(p.off, 3 * PAGE) }.iter().all(|&x| x == 9));
    }
}
