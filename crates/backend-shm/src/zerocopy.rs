//! Zero-copy buffers: host buffers that live in their own shared-memory segment, which peers
//! map by name the first time an op uses them, so a large all_reduce reads and writes them in
//! place instead of copying through the window.

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;

use comm_core::ExternalStorage;

use crate::segment::Segment;

/// The storage of a buffer from `alloc_buffer`.
pub(crate) struct ShmBuf {
    seg: Arc<Segment>,
    len: usize,
    unlinked: AtomicBool,
}

impl ShmBuf {
    pub(crate) fn new(seg: Segment, len: usize) -> ShmBuf {
        ShmBuf { seg: Arc::new(seg), len, unlinked: AtomicBool::new(false) }
    }

    pub(crate) fn name(&self) -> &str {
        self.seg.name()
    }

    /// Removes the name from /dev/shm once every peer has mapped it (after the first op that
    /// used it), or when the buffer is dropped.
    pub(crate) fn unlink_once(&self) {
        if !self.unlinked.swap(true, SeqCst) {
            let _ = self.seg.unlink();
        }
    }
}

impl ExternalStorage for ShmBuf {
    fn bytes(&self) -> &[u8] {
        // SAFETY: the buffer's bytes are written only through `&mut` to its `HostBuffer`
        // (by the user, or by the worker while the buffer is moved into an op) and read by
        // peers only during an op, while the owner's buffer is moved into that op. So no one
        // writes while this shared borrow of `self` lives.
        unsafe { self.seg.bytes(0, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `&mut self` is the only access on this side; peers touch it only during an
        // op that owns the buffer (see `bytes`).
        unsafe { self.seg.bytes_mut(0, self.len) }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for ShmBuf {
    fn drop(&mut self) {
        self.unlink_once();
    }
}
