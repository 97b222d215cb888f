//! Staging of host buffers: device memory and the pinned host memory they are copied through,
//! pooled for reuse by size class.

use std::collections::HashMap;
use std::sync::Arc;

use comm_core::CommError;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

use crate::error::{call_error, cuda_error};
use crate::ffi::{self, DevPtr, Pinned};

/// Device memory of the pool and its address, taken once. The memory is used only on the
/// actor's stream and freed in that stream's order, so it needs none of the events a
/// `CudaSlice` records each time its address is taken (a wait and a record on the stream each:
/// about 3 µs on the device's timeline of a small staged op).
pub(super) struct Dev {
    mem: CudaSlice<u8>,
    at: DevPtr,
}

impl Dev {
    fn new(mem: CudaSlice<u8>, stream: &CudaStream) -> Dev {
        let at = DevPtr::of(&mem, stream, 0);
        Dev { mem, at }
    }

    /// The address of byte `offset`.
    pub(super) fn ptr(&self, offset: usize) -> DevPtr {
        assert!(offset <= self.mem.len(), "offset {offset} past {} bytes of staging memory", self.mem.len());
        self.at.add(offset)
    }
}

/// One host buffer's staging: device memory and the pinned host memory it is copied through.
pub(crate) struct Staged {
    pub(super) dev: Option<Dev>,
    pub(super) host: Option<Pinned>,
    pub(super) bytes: usize,
    pub(super) download: bool,
}

impl Staged {
    /// The bytes downloaded from the device (only called once the op's event fired).
    pub(crate) fn bytes(&self) -> &[u8] {
        match &self.host {
            Some(h) => h.read(self.bytes),
            None => &[],
        }
    }
}

/// The actor's resources that plans use.
pub struct Cx {
    pub(crate) rank: u32,
    pub(crate) world: u32,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(super) pool: Pool,
    pub(super) scratch: Option<Dev>,
}

impl Cx {
    /// Stages `data` on the device (upload enqueued now); `download` copies it back after the
    /// op (in-place ops).
    pub(crate) fn stage_in(&mut self, data: &[u8], download: bool) -> Result<Staged, CommError> {
        let mut s = self.stage(data.len(), download)?;
        if let (Some(host), Some(dev)) = (&mut s.host, &s.dev) {
            host.write(data);
            host.upload(&self.stream, dev.ptr(0), data.len()).map_err(|e| call_error(e, ""))?;
        }
        Ok(s)
    }

    /// Device memory for an output of `bytes`, downloaded after the op.
    pub(crate) fn stage_out(&mut self, bytes: usize) -> Result<Staged, CommError> {
        self.stage(bytes, true)
    }

    fn stage(&mut self, bytes: usize, download: bool) -> Result<Staged, CommError> {
        if bytes == 0 {
            return Ok(Staged { dev: None, host: None, bytes, download: false });
        }
        let dev = self.pool.device(&self.stream, bytes)?;
        let host = self.pool.pinned(&self.ctx, bytes)?;
        Ok(Staged { dev: Some(dev), host: Some(host), bytes, download })
    }

    /// The device address of byte `offset` of a staged buffer.
    pub(crate) fn ptr(&self, s: &Staged, offset: usize) -> DevPtr {
        match &s.dev {
            Some(d) => d.ptr(offset),
            None => DevPtr::NULL,
        }
    }

    /// The device address of element `offset` of a caller's device buffer; the stream first
    /// waits for the work already queued on the buffer's own stream.
    pub(crate) fn user_ptr<T>(&self, s: &CudaSlice<T>, offset: usize) -> Result<DevPtr, CommError> {
        if !Arc::ptr_eq(s.stream(), &self.stream) {
            self.stream.join(s.stream()).map_err(|e| cuda_error("cuStreamWaitEvent", &e))?;
        }
        Ok(if s.is_empty() { DevPtr::NULL } else { DevPtr::of(s, &self.stream, offset) })
    }

    /// A one-element (f32) device buffer for barriers.
    pub(crate) fn scratch(&mut self) -> Result<DevPtr, CommError> {
        if self.scratch.is_none() {
            let s = self.stream.alloc_zeros::<u8>(8).map_err(|e| cuda_error("cuMemAllocAsync", &e))?;
            self.scratch = Some(Dev::new(s, &self.stream));
        }
        Ok(self.scratch.as_ref().expect("just set").ptr(0))
    }
}

/// Staging memory kept for reuse, by power-of-two size class (idle buffers only).
pub(super) struct Pool {
    pub(super) dev: HashMap<usize, Vec<Dev>>,
    pub(super) host: HashMap<usize, Vec<Pinned>>,
    pub(super) kept_dev: usize,
    pub(super) kept_host: usize,
    pub(super) limit: usize,
}

fn class(bytes: usize) -> usize {
    bytes.next_power_of_two().max(4096)
}

/// Keeps `item` (of size class `c`) for reuse. When that would pass `limit`, buffers of other
/// classes go first, the largest first: the sizes in use now are the ones worth keeping (a
/// large op after many smaller ones would otherwise allocate pinned memory on every call).
fn keep<T>(map: &mut HashMap<usize, Vec<T>>, kept: &mut usize, limit: usize, c: usize, item: T) {
    if c > limit {
        return;
    }
    while *kept + c > limit {
        let Some(other) = map.iter().filter(|(&k, v)| k != c && !v.is_empty()).map(|(&k, _)| k).max() else {
            return;
        };
        map.get_mut(&other).and_then(Vec::pop);
        *kept -= other;
    }
    *kept += c;
    map.entry(c).or_default().push(item);
}

impl Pool {
    fn device(&mut self, stream: &Arc<CudaStream>, bytes: usize) -> Result<Dev, CommError> {
        let c = class(bytes);
        if let Some(d) = self.dev.get_mut(&c).and_then(Vec::pop) {
            self.kept_dev -= c;
            return Ok(d);
        }
        let mem = ffi::alloc_device(stream, c).map_err(|e| cuda_error("cuMemAllocAsync", &e))?;
        Ok(Dev::new(mem, stream))
    }

    fn pinned(&mut self, ctx: &CudaContext, bytes: usize) -> Result<Pinned, CommError> {
        let c = class(bytes);
        if let Some(h) = self.host.get_mut(&c).and_then(Vec::pop) {
            self.kept_host -= c;
            return Ok(h);
        }
        Pinned::alloc(ctx, c).map_err(|e| cuda_error("cuMemHostAlloc", &e))
    }

    pub(super) fn recycle(&mut self, staged: Vec<Staged>) {
        for s in staged {
            if let Some(d) = s.dev {
                let c = d.mem.len();
                keep(&mut self.dev, &mut self.kept_dev, self.limit, c, d);
            }
            if let Some(h) = s.host {
                let c = h.cap();
                keep(&mut self.host, &mut self.kept_host, self.limit, c, h);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes() {
        assert_eq!(class(1), 4096);
        assert_eq!(class(4097), 8192);
        assert_eq!(class(1 << 20), 1 << 20);
    }

    #[test]
    fn the_pool_keeps_the_sizes_in_use_now() {
        let (mut map, mut kept, limit) = (HashMap::<usize, Vec<u32>>::new(), 0, 256);
        for (c, id) in [(128, 1), (64, 2), (32, 3), (16, 4)] {
            keep(&mut map, &mut kept, limit, c, id);
        }
        assert_eq!(kept, 240);
        // A buffer as large as the whole pool evicts the others, the largest first.
        keep(&mut map, &mut kept, limit, 256, 5);
        assert_eq!((kept, map[&256].as_slice()), (256, &[5][..]));
        assert!(map.iter().all(|(&c, v)| c == 256 || v.is_empty()));
        // A second one of the same class does not evict the first; one over the limit is dropped.
        keep(&mut map, &mut kept, limit, 256, 6);
        keep(&mut map, &mut kept, limit, 512, 7);
        assert_eq!((kept, map[&256].as_slice()), (256, &[5][..]));
        assert!(!map.contains_key(&512));
        // Smaller ones evict it only as far as needed.
        keep(&mut map, &mut kept, limit, 64, 8);
        assert_eq!((kept, map[&64].as_slice()), (64, &[8][..]));
    }
}
