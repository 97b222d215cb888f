use std::fmt;

use crate::{CommError, DType, Element};

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
#[derive(Clone, PartialEq)]
pub struct HostBuffer {
    words: Vec<u64>,
    bytes: usize,
    dtype: DType,
}

impl HostBuffer {
    /// A buffer of `len` zeroed elements of `dtype`.
    pub fn zeroed(dtype: DType, len: usize) -> Self {
        let bytes = len * dtype.size();
        HostBuffer { words: vec![0u64; bytes.div_ceil(8)], bytes, dtype }
    }

    /// A buffer holding a copy of `data`.
    pub fn from_slice<T: Element>(data: &[T]) -> Self {
        let mut b = HostBuffer::zeroed(T::DTYPE, data.len());
        b.as_bytes_mut().copy_from_slice(bytemuck::cast_slice(data));
        b
    }

    /// A buffer of `dtype` holding a copy of raw `bytes` (length must be a multiple of the
    /// element size).
    pub fn from_bytes(dtype: DType, bytes: &[u8]) -> Result<Self, CommError> {
        if bytes.len() % dtype.size() != 0 {
            return Err(CommError::invalid(
                "HostBuffer::from_bytes",
                format!("{} bytes is not a whole number of {dtype} elements", bytes.len()),
            ));
        }
        let mut b = HostBuffer::zeroed(dtype, bytes.len() / dtype.size());
        b.as_bytes_mut().copy_from_slice(bytes);
        Ok(b)
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
        &bytemuck::cast_slice(&self.words)[..self.bytes]
    }

    /// The raw bytes, mutable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.bytes]
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
    /// New bytes are zero; kept bytes keep their value.
    pub fn reshape(&mut self, dtype: DType, len: usize) {
        let bytes = len * dtype.size();
        self.words.resize(bytes.div_ceil(8), 0);
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

    #[test]
    fn odd_byte_lengths_and_f64_alignment() {
        let mut b = HostBuffer::zeroed(DType::U8, 13);
        assert_eq!(b.as_bytes().len(), 13);
        b.as_bytes_mut()[12] = 7;
        b.reshape(DType::F64, 3);
        assert_eq!(b.as_slice::<f64>().unwrap().len(), 3);
        b.reshape(DType::U8, 2);
        b.reshape(DType::U8, 16);
        assert!(b.as_bytes()[2..].iter().all(|&x| x == 0), "grown bytes are zero");
        assert!(HostBuffer::from_bytes(DType::I32, &[0; 6]).is_err());
        assert_eq!(HostBuffer::from_bytes(DType::I32, &[1, 0, 0, 0]).unwrap().to_vec::<i32>().unwrap(), [1]);
    }
}
