//! Staging of host buffers: device memory and the pinned host memory they are copied through,
//! pooled for reuse by size class.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use comm_core::{CommError, HostBuffer};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

use crate::error::{call_error, cuda_error};
use crate::ffi::{self, CallError, DevPtr, Pinned, Registered};

/// Device memory of the pool and its address, taken once. The memory is used only on the
/// worker's stream and freed in that stream's order, so it needs none of the events a
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

/// One host buffer's staging: the caller's buffer, held until the op is done, and the device
/// memory the op works on.
pub(crate) struct Staged {
    dev: Option<Dev>,
    /// Pooled pinned memory the bytes are copied through (`None` where the buffer itself is
    /// registered, or empty).
    pinned: Option<Pinned>,
    user: User,
    bytes: usize,
    download: bool,
}

/// The caller's buffer in a [`Staged`].
enum User {
    Plain(HostBuffer),
    /// Page-locked for the op: the device copies to and from it directly.
    Registered(Registered),
    Taken,
}

impl Staged {
    /// The caller's buffer, holding what the op downloaded into it (call once the op's event
    /// fired).
    pub(crate) fn take(&mut self) -> Result<HostBuffer, CommError> {
        match std::mem::replace(&mut self.user, User::Taken) {
            User::Plain(mut b) => {
                if let (true, Some(p)) = (self.download, &self.pinned) {
                    b.as_bytes_mut().copy_from_slice(p.read(self.bytes));
                }
                Ok(b)
            }
            User::Registered(r) => Ok(r.into_buffer()),
            User::Taken => Err(CommError::invalid("nccl staging", "a staged buffer was taken twice")),
        }
    }

    /// Enqueues the copy of the op's result back to the host (outputs and in-place buffers).
    pub(super) fn download(&mut self, stream: &CudaStream) -> Result<(), CallError> {
        let Some(dev) = self.dev.as_ref().filter(|_| self.download) else { return Ok(()) };
        match (&mut self.user, &mut self.pinned) {
            (User::Registered(r), _) => r.download(stream, dev.ptr(0)),
            (_, Some(p)) => p.download(stream, dev.ptr(0), self.bytes),
            _ => Ok(()),
        }
    }
}

/// The worker's resources that plans use.
pub struct Cx {
    pub(crate) rank: u32,
    pub(crate) world: u32,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(super) pool: Pool,
    pub(super) scratch: Option<Dev>,
    /// Buffers from this size are registered instead of copied through pinned memory.
    pub(super) register_min: usize,
}

impl Cx {
    /// Stages `buf` on the device (upload enqueued now); `download` copies the device's bytes
    /// back into it after the op (in-place ops).
    pub(crate) fn stage_in(&mut self, buf: HostBuffer, download: bool) -> Result<Staged, CommError> {
        self.stage(buf, true, download)
    }

    /// Device memory for the output `buf`, downloaded into it after the op.
    pub(crate) fn stage_out(&mut self, buf: HostBuffer) -> Result<Staged, CommError> {
        self.stage(buf, false, true)
    }

    fn stage(&mut self, mut buf: HostBuffer, upload: bool, download: bool) -> Result<Staged, CommError> {
        let bytes = buf.byte_len();
        if bytes == 0 {
            return Ok(Staged { dev: None, pinned: None, user: User::Plain(buf), bytes, download: false });
        }
        let dev = self.pool.device(&self.stream, bytes)?;
        let upload_err = |e| call_error(e, "");
        if bytes >= self.register_min {
            // A buffer that cannot be registered (a page of it is already) is copied instead.
            match Registered::new(&self.ctx, buf) {
                Ok(r) => {
                    if upload {
                        r.upload(&self.stream, dev.ptr(0)).map_err(upload_err)?;
                    }
                    return Ok(Staged { dev: Some(dev), pinned: None, user: User::Registered(r), bytes, download });
                }
                Err((_, b)) => buf = b,
            }
        }
        let mut pinned = self.pool.pinned(&self.ctx, bytes)?;
        if upload {
            pinned.write(buf.as_bytes());
            pinned.upload(&self.stream, dev.ptr(0), bytes).map_err(upload_err)?;
        }
        Ok(Staged { dev: Some(dev), pinned: Some(pinned), user: User::Plain(buf), bytes, download })
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

/// The host-buffer size from which page-locking the caller's buffer for an op beats copying it
/// through pinned memory, measured once per process. Locking costs a fixed part (system calls,
/// the driver's bookkeeping: about 0.2 ms on a 16-core Xeon VM) and a part per page; copying
/// costs two host copies per byte (in and out). The locking times of 256 KiB and 4 MiB (best of
/// two each) give the line that meets the copies' (4 MiB copied, best of two) at the size
/// returned, clamped to 256 KiB..=1 GiB; never (`usize::MAX`) where locking is not cheaper per
/// byte or cannot be measured. The device copies cost the same either way.
pub(super) fn register_min(ctx: &CudaContext) -> usize {
    static MIN: OnceLock<usize> = OnceLock::new();
    *MIN.get_or_init(|| {
        let min = measure_register_min(ctx).unwrap_or(usize::MAX);
        tracing::debug!(register_min = min, "nccl: host buffers page-locked from this size");
        min
    })
}

fn measure_register_min(ctx: &CudaContext) -> Option<usize> {
    const SMALL: usize = 256 << 10;
    const LARGE: usize = 4 << 20;
    fn best(mut f: impl FnMut() -> Option<()>) -> Option<f64> {
        let mut t = f64::MAX;
        for _ in 0..2 {
            let start = Instant::now();
            f()?;
            t = t.min(start.elapsed().as_secs_f64());
        }
        Some(t)
    }
    let src = vec![1u8; LARGE];
    let lock = |bytes: usize| {
        let mut buf = Some(HostBuffer::from_slice(&src[..bytes]));
        best(|| {
            let r = Registered::new(ctx, buf.take()?).ok()?;
            buf = Some(r.into_buffer());
            Some(())
        })
    };
    let (small, large) = (lock(SMALL)?, lock(LARGE)?);
    let lock_per_byte = ((large - small) / (LARGE - SMALL) as f64).max(0.0);
    let fixed = (small - lock_per_byte * SMALL as f64).max(0.0);
    let mut pinned = Pinned::alloc(ctx, LARGE).ok()?;
    let copy_per_byte =
        2.0 * best(|| {
            pinned.write(&src);
            Some(())
        })? / LARGE as f64;
    (copy_per_byte > lock_per_byte).then(|| ((fixed / (copy_per_byte - lock_per_byte)) as usize).clamp(SMALL, 1 << 30))
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
            if let Some(h) = s.pinned {
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
