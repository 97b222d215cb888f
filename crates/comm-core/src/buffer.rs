use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use crate::{CommError, DType, Element};

/// Memory a backend lends to a [`HostBuffer`] so ops on it can skip a copy (for example
/// shared memory its peers map). Made by the backend's `alloc_buffer`, or by
/// [`LargeBuffers`].
///
/// The byte slices must be 8-byte aligned and keep their address for the storage's life.
pub trait ExternalStorage: Send + Sync + 'static {
    /// The whole storage.
    fn bytes(&self) -> &[u8];
    /// The whole storage, mutable.
    fn bytes_mut(&mut self) -> &mut [u8];
    /// For the backend that made it to recognise it.
    fn as_any(&self) -> &dyn Any;
}

/// Where large buffers come from when a backend offers memory its peers can read in place
/// (shm: its arena of shared memory). A backend installs one with [`set_large_buffers`];
/// from then on every [`HostBuffer`] of at least [`LargeBuffers::min_bytes`] is made in it
/// (`zeroed`, `try_zeroed`, `for_overwrite`, `from_slice`, `from(Vec)`, clones), so ops on it
/// need no copy.
pub trait LargeBuffers: Send + Sync + 'static {
    /// The smallest buffer (in bytes) to take from here.
    fn min_bytes(&self) -> usize;
    /// Storage of exactly `bytes` bytes, zeroed when `zeroed`; `None` when there is no room
    /// (the buffer is then plain host memory).
    fn alloc(&self, bytes: usize, zeroed: bool) -> Option<Box<dyn ExternalStorage>>;
}

/// The installed [`LargeBuffers`], and its `min_bytes` (`usize::MAX` when none), read first so
/// that small buffers never take the lock.
static LARGE: RwLock<Option<Arc<dyn LargeBuffers>>> = RwLock::new(None);
static LARGE_MIN: AtomicUsize = AtomicUsize::new(usize::MAX);

/// Installs `large` for every later large [`HostBuffer`] of this process (`None`: plain host
/// memory again). Buffers already made keep their storage.
pub fn set_large_buffers(large: Option<Arc<dyn LargeBuffers>>) {
    let mut slot = LARGE.write().unwrap_or_else(|e| e.into_inner());
    LARGE_MIN.store(large.as_ref().map_or(usize::MAX, |l| l.min_bytes()), Ordering::SeqCst);
    *slot = large;
}

/// Large-buffer storage for `bytes`, when one is installed and has room.
fn large(bytes: usize, zeroed: bool) -> Option<Box<dyn ExternalStorage>> {
    if bytes < LARGE_MIN.load(Ordering::Relaxed) {
        return None;
    }
    let large = LARGE.read().unwrap_or_else(|e| e.into_inner()).clone()?;
    let storage = large.alloc(bytes, zeroed)?;
    let have = storage.bytes();
    // A provider's bug must not become a short or misaligned buffer.
    (have.len() == bytes && have.as_ptr().align_offset(8) == 0).then_some(storage)
}

enum Storage {
    Owned(Vec<u64>),
    External(Box<dyn ExternalStorage>),
}

/// Owned, typed, contiguous host memory.
///
/// Ops take a `HostBuffer` by value and hand it back in their output, so nothing borrowed
/// crosses an `.await`. Storage is 8-byte aligned, so a typed view of any [`DType`] is a checked
/// cast ([`bytemuck`]), never a transmute.
///
/// ```
/// use comm_core::{DType, HostBuffer};
/// let mut b = HostBuffer::from_slice(&[1.0f32, 2.0, 3.0]);
/// assert_eq!(b.dtype(), DType::F32);
/// b.as_mut_slice::<f32>().unwrap()[0] = 5.0;
/// assert_eq!(b.to_vec::<f32>().unwrap(), vec![5.0, 2.0, 3.0]);
/// assert!(b.as_slice::<i32>().is_err()); // wrong dtype: an error, not a reinterpretation
/// ```
pub struct HostBuffer {
    storage: Storage,
    bytes: usize,
    dtype: DType,
}

/// A deep copy, made where a new buffer of its size would be (see [`LargeBuffers`]).
impl Clone for HostBuffer {
    fn clone(&self) -> Self {
        match &self.storage {
            // A plain copy of the words: no zeroing pass first (a third of a clone's time).
            Storage::Owned(w) if self.bytes < LARGE_MIN.load(Ordering::Relaxed) => {
                let storage = Storage::Owned(w[..self.bytes.div_ceil(8)].to_vec());
                HostBuffer { storage, bytes: self.bytes, dtype: self.dtype }
            }
            _ => HostBuffer::copy_of(self.dtype, self.as_bytes()),
        }
    }
}

/// Equal dtype, length and contents (storage does not matter).
impl PartialEq for HostBuffer {
    fn eq(&self, other: &Self) -> bool {
        self.dtype == other.dtype && self.as_bytes() == other.as_bytes()
    }
}

fn too_large(op: &'static str, dtype: DType, len: usize) -> CommError {
    CommError::invalid(op, format!("{len} × {dtype} does not fit in memory (more than isize::MAX bytes)"))
}

impl HostBuffer {
    /// A buffer of `len` zeroed elements of `dtype`.
    ///
    /// # Panics
    /// Like `vec![0; n]`, when `len` elements of `dtype` exceed `isize::MAX` bytes; see
    /// [`HostBuffer::try_zeroed`] for an error instead.
    pub fn zeroed(dtype: DType, len: usize) -> Self {
        HostBuffer::large_or_heap("HostBuffer::zeroed", dtype, len, true)
    }

    /// A buffer of `len` elements of `dtype` for an output that is written in full: the
    /// contents are unspecified until then. One made by [`LargeBuffers`] may hold what an
    /// earlier buffer of this process left in its storage (it skips the zeroing pass, as
    /// much work as a copy); any other is zeroed. Never uninitialised memory.
    ///
    /// # Panics
    /// As [`HostBuffer::zeroed`].
    pub fn for_overwrite(dtype: DType, len: usize) -> Self {
        HostBuffer::large_or_heap("HostBuffer::for_overwrite", dtype, len, false)
    }

    /// A [`LargeBuffers`] buffer (zeroed when `zeroed`) where one is installed and has room,
    /// else zeroed heap memory; `op` names the caller in the panic.
    fn large_or_heap(op: &'static str, dtype: DType, len: usize, zeroed: bool) -> Self {
        let Some(bytes) = dtype.checked_bytes(len) else {
            panic!("{op}: {}", too_large(op, dtype, len));
        };
        match large(bytes, zeroed) {
            Some(e) => HostBuffer { storage: Storage::External(e), bytes, dtype },
            None => HostBuffer::zeroed_on_heap(dtype, len),
        }
    }

    /// A buffer of `len` zeroed elements of `dtype` in plain heap memory, whatever
    /// [`LargeBuffers`] is installed: memory no other process maps (for a C library's
    /// baseline, say).
    ///
    /// # Panics
    /// As [`HostBuffer::zeroed`].
    pub fn zeroed_on_heap(dtype: DType, len: usize) -> Self {
        let Some(bytes) = dtype.checked_bytes(len) else {
            panic!("HostBuffer::zeroed_on_heap: {}", too_large("HostBuffer::zeroed_on_heap", dtype, len));
        };
        HostBuffer { storage: Storage::Owned(vec![0u64; bytes.div_ceil(8)]), bytes, dtype }
    }

    /// A buffer of `dtype` holding a copy of `bytes` (a whole number of elements), made
    /// without zeroing it first.
    fn copy_of(dtype: DType, bytes: &[u8]) -> Self {
        let n = bytes.len();
        let storage = match large(n, false) {
            Some(mut e) => {
                e.bytes_mut().copy_from_slice(bytes);
                Storage::External(e)
            }
            None => {
                let mut words = vec![0u64; n.div_ceil(8)];
                bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..n].copy_from_slice(bytes);
                Storage::Owned(words)
            }
        };
        HostBuffer { storage, bytes: n, dtype }
    }

    /// A buffer of `len` zeroed elements of `dtype`, or [`CommError::InvalidArgument`] when
    /// that many bytes cannot be represented or allocated (instead of a panic or an abort).
    pub fn try_zeroed(dtype: DType, len: usize) -> Result<Self, CommError> {
        let bytes = dtype.checked_bytes(len).ok_or_else(|| too_large("HostBuffer::try_zeroed", dtype, len))?;
        if let Some(e) = large(bytes, true) {
            return Ok(HostBuffer { storage: Storage::External(e), bytes, dtype });
        }
        let mut words = Vec::new();
        words.try_reserve_exact(bytes.div_ceil(8)).map_err(|e| {
            CommError::invalid(
                "HostBuffer::try_zeroed",
                format!("cannot allocate {len} × {dtype} ({bytes} bytes): {e}"),
            )
        })?;
        words.resize(bytes.div_ceil(8), 0);
        Ok(HostBuffer { storage: Storage::Owned(words), bytes, dtype })
    }

    /// A buffer of `len` elements of `dtype` in memory lent by a backend. Fails when the
    /// storage is too small or not 8-byte aligned.
    pub fn from_external(dtype: DType, len: usize, storage: Box<dyn ExternalStorage>) -> Result<Self, CommError> {
        let bytes = dtype.checked_bytes(len).ok_or_else(|| too_large("HostBuffer::from_external", dtype, len))?;
        let have = storage.bytes();
        if have.len() < bytes || have.as_ptr().align_offset(8) != 0 {
            return Err(CommError::invalid(
                "HostBuffer::from_external",
                format!(
                    "storage of {} bytes (aligned: {}) cannot hold {len} × {dtype}",
                    have.len(),
                    have.as_ptr().align_offset(8) == 0
                ),
            ));
        }
        Ok(HostBuffer { storage: Storage::External(storage), bytes, dtype })
    }

    /// The backend storage behind this buffer, if it is not plain host memory.
    pub fn external(&self) -> Option<&dyn ExternalStorage> {
        match &self.storage {
            Storage::Owned(_) => None,
            Storage::External(e) => Some(&**e),
        }
    }

    /// A buffer holding a copy of `data`.
    pub fn from_slice<T: Element>(data: &[T]) -> Self {
        HostBuffer::copy_of(T::DTYPE, bytemuck::cast_slice(data))
    }

    /// A buffer of `dtype` holding a copy of raw `bytes` (length must be a multiple of the
    /// element size).
    pub fn from_bytes(dtype: DType, bytes: &[u8]) -> Result<Self, CommError> {
        if !bytes.len().is_multiple_of(dtype.size()) {
            return Err(CommError::invalid(
                "HostBuffer::from_bytes",
                format!("{} bytes is not a whole number of {dtype} elements", bytes.len()),
            ));
        }
        Ok(HostBuffer::copy_of(dtype, bytes))
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.bytes / self.dtype.size()
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Length in bytes.
    pub fn byte_len(&self) -> usize {
        self.bytes
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Owned(w) => &bytemuck::cast_slice(w)[..self.bytes],
            Storage::External(e) => &e.bytes()[..self.bytes],
        }
    }

    /// The raw bytes, mutable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.storage {
            Storage::Owned(w) => &mut bytemuck::cast_slice_mut(w)[..self.bytes],
            Storage::External(e) => &mut e.bytes_mut()[..self.bytes],
        }
    }

    /// A typed view; fails when `T` is not this buffer's dtype.
    pub fn as_slice<T: Element>(&self) -> Result<&[T], CommError> {
        self.check::<T>()?;
        Ok(bytemuck::cast_slice(self.as_bytes()))
    }

    /// A typed mutable view; fails when `T` is not this buffer's dtype.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T], CommError> {
        self.check::<T>()?;
        Ok(bytemuck::cast_slice_mut(self.as_bytes_mut()))
    }

    /// A typed copy of the contents.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>, CommError> {
        self.as_slice().map(<[T]>::to_vec)
    }

    /// Resize to `len` elements of `dtype`, reusing the allocation when it is big enough.
    /// New bytes are zero; kept bytes keep their value. Lent storage that is too small is
    /// replaced by plain host memory.
    ///
    /// # Panics
    /// As [`HostBuffer::zeroed`], when the new size exceeds `isize::MAX` bytes.
    pub fn reshape(&mut self, dtype: DType, len: usize) {
        let Some(bytes) = dtype.checked_bytes(len) else {
            panic!("HostBuffer::reshape: {}", too_large("HostBuffer::reshape", dtype, len));
        };
        let words = match &mut self.storage {
            Storage::Owned(w) => w,
            Storage::External(e) if e.bytes().len() >= bytes => {
                let old = self.bytes;
                self.bytes = bytes;
                self.dtype = dtype;
                if bytes > old {
                    self.as_bytes_mut()[old..].fill(0);
                }
                return;
            }
            Storage::External(_) => {
                let mut owned = HostBuffer::zeroed(DType::U8, bytes);
                let keep = self.bytes.min(bytes);
                owned.as_bytes_mut()[..keep].copy_from_slice(&self.as_bytes()[..keep]);
                *self = HostBuffer { dtype, ..owned };
                return;
            }
        };
        words.resize(bytes.div_ceil(8), 0);
        if bytes > self.bytes {
            // Zero the tail of the last previously used word, if any.
            let old = self.bytes;
            self.bytes = bytes;
            self.as_bytes_mut()[old..].fill(0);
        }
        self.bytes = bytes;
        self.dtype = dtype;
    }

    fn check<T: Element>(&self) -> Result<(), CommError> {
        if T::DTYPE == self.dtype {
            Ok(())
        } else {
            Err(CommError::invalid(
                "HostBuffer typed view",
                format!("buffer holds {} but {} was requested", self.dtype, T::DTYPE),
            ))
        }
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer").field("dtype", &self.dtype).field("len", &self.len()).finish()
    }
}

impl<T: Element> From<Vec<T>> for HostBuffer {
    fn from(v: Vec<T>) -> Self {
        HostBuffer::from_slice(&v)
    }
}

impl<T: Element> From<&[T]> for HostBuffer {
    fn from(v: &[T]) -> Self {
        HostBuffer::from_slice(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn typed_views_are_checked() {
        let b = HostBuffer::from_slice(&[bf16::from_f32(1.5), bf16::from_f32(-2.0)]);
        assert_eq!(b.len(), 2);
        assert_eq!(b.byte_len(), 4);
        assert_eq!(b.as_slice::<bf16>().unwrap()[0].to_f32(), 1.5);
        let err = b.as_slice::<f32>().unwrap_err().to_string();
        assert!(err.contains("holds bf16") && err.contains("f32"), "{err}");
    }

    struct Provider;
    // A size no other test of this binary uses: the provider is process-wide.
    const BIG: usize = 3_000_008;
    impl LargeBuffers for Provider {
        fn min_bytes(&self) -> usize {
            BIG
        }
        fn alloc(&self, bytes: usize, zeroed: bool) -> Option<Box<dyn ExternalStorage>> {
            (bytes < 2 * BIG).then(|| {
                let fill = if zeroed { 0 } else { u64::from_ne_bytes([0xAB; 8]) };
                // Dirty (0xAB) unless asked for zeroes; `false`: made by the provider.
                Box::new(Lent(vec![fill; bytes / 8], false)) as Box<dyn ExternalStorage>
            })
        }
    }

    #[test]
    fn large_buffers_come_from_the_installed_provider() {
        set_large_buffers(Some(Arc::new(Provider)));
        let provided =
            |b: &HostBuffer| b.external().and_then(|e| e.as_any().downcast_ref::<Lent>()).is_some_and(|l| !l.1);
        let z = HostBuffer::zeroed(DType::U8, BIG);
        assert!(provided(&z) && z.as_bytes().iter().all(|&x| x == 0));
        let t = HostBuffer::try_zeroed(DType::I64, BIG / 8).unwrap();
        assert!(provided(&t) && t.as_bytes().iter().all(|&x| x == 0));
        let data: Vec<i64> = (0..BIG as i64 / 8).collect();
        let v = HostBuffer::from(data.clone());
        assert!(provided(&v) && v.as_slice::<f64>().is_err());
        assert_eq!(v.to_vec::<i64>().unwrap(), data);
        let c = v.clone();
        assert!(provided(&c) && c == v);
        // An output for overwriting skips the zeroing pass; a small one is plain zeroes.
        let o = HostBuffer::for_overwrite(DType::U8, BIG);
        assert!(provided(&o) && o.as_bytes().iter().all(|&x| x == 0xAB));
        let o = HostBuffer::for_overwrite(DType::U8, BIG - 8);
        assert!(o.external().is_none() && o.as_bytes().iter().all(|&x| x == 0));
        // Smaller, or more than the provider has room for: plain memory.
        assert!(HostBuffer::zeroed(DType::U8, BIG - 8).external().is_none());
        assert!(HostBuffer::zeroed(DType::U8, 2 * BIG).external().is_none());
        assert!(HostBuffer::zeroed_on_heap(DType::U8, BIG).external().is_none());
        set_large_buffers(None);
        assert!(HostBuffer::zeroed(DType::U8, BIG).external().is_none());
    }

    struct Lent(Vec<u64>, bool);
    impl ExternalStorage for Lent {
        fn bytes(&self) -> &[u8] {
            bytemuck::cast_slice(&self.0)
        }
        fn bytes_mut(&mut self) -> &mut [u8] {
            bytemuck::cast_slice_mut(&mut self.0)
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    #[test]
    fn external_storage() {
        let mut b = HostBuffer::from_external(DType::F32, 3, Box::new(Lent(vec![0; 2], true))).unwrap();
        b.as_mut_slice::<f32>().unwrap().copy_from_slice(&[1.0, 2.0, 3.0]);
        assert!(b.external().unwrap().as_any().downcast_ref::<Lent>().is_some_and(|l| l.1));
        let c = b.clone();
        assert!(c.external().is_none(), "clones are plain memory");
        assert_eq!(c, b);
        b.reshape(DType::F32, 4); // still fits the 16 lent bytes
        assert!(b.external().is_some());
        assert_eq!(b.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0, 0.0]);
        b.reshape(DType::F32, 5); // does not: moves to host memory, keeping the contents
        assert!(b.external().is_none());
        assert_eq!(b.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0, 0.0, 0.0]);
        assert!(HostBuffer::from_external(DType::F64, 3, Box::new(Lent(vec![0; 2], true))).is_err());
    }

    #[test]
    fn sizes_that_do_not_fit_are_errors_not_tiny_buffers() {
        // 2^61 + 1 f64 is 2^64 + 8 bytes: it wrapped to an 8-byte buffer.
        let e = HostBuffer::try_zeroed(DType::F64, (1 << 61) + 1).unwrap_err().to_string();
        assert!(e.contains("does not fit in memory"), "{e}");
        let e = HostBuffer::try_zeroed(DType::U8, isize::MAX as usize).unwrap_err().to_string();
        assert!(e.contains("cannot allocate"), "{e}");
        assert_eq!(HostBuffer::try_zeroed(DType::BF16, 3).unwrap().byte_len(), 6);
        let r = std::panic::catch_unwind(|| HostBuffer::zeroed(DType::F64, (1 << 61) + 1));
        assert!(r.is_err(), "zeroed panics like vec![0; n] rather than returning a tiny buffer");
        let r = std::panic::catch_unwind(|| HostBuffer::zeroed(DType::U8, 1).reshape(DType::I32, usize::MAX / 2));
        assert!(r.is_err());
        assert!(HostBuffer::from_external(DType::F64, usize::MAX, Box::new(Lent(vec![0; 2], true))).is_err());
        assert_eq!(DType::I64.checked_bytes(1 << 60), None);
        assert_eq!(DType::I64.checked_bytes(3), Some(24));
    }

    #[test]
    fn odd_byte_lengths_and_f64_alignment() {
        let mut b = HostBuffer::zeroed(DType::U8, 13);
        assert_eq!(b.as_bytes().len(), 13);
        b.as_bytes_mut()[12] = 7;
        b.reshape(DType::F64, 3);
        assert_eq!(b.as_slice::<f64>().unwrap().len(), 3);
        b.as_bytes_mut().fill(9);
        b.reshape(DType::U8, 2);
        let mut c = b.clone();
        assert_eq!(c.as_bytes(), [9, 9]);
        b.reshape(DType::U8, 16);
        assert!(b.as_bytes()[2..].iter().all(|&x| x == 0), "grown bytes are zero");
        c.reshape(DType::U8, 16);
        assert_eq!(b, c, "a clone grows the same way");
        assert!(HostBuffer::from_bytes(DType::I32, &[0; 6]).is_err());
        assert_eq!(HostBuffer::from_bytes(DType::I32, &[1, 0, 0, 0]).unwrap().to_vec::<i32>().unwrap(), [1]);
    }
}
