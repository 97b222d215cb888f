//! POSIX shared-memory segments: creation, mapping, unlinking, and raw access.
//!
//! The mapping `unsafe` of the shm backend lives here. The segment is a plain byte range
//! shared with other processes; every word that is accessed concurrently is an atomic, and
//! every other byte range is handed out only through `unsafe fn`s whose contract is the step
//! protocol in `engine/steps.rs` (one writer, readers only after the writer's
//! release-store of its step counter, no rewrite until every reader has moved past that step).

use std::ffi::c_void;
use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

use rustix::fs::{FallocateFlags, Mode};
use rustix::mm::{MapFlags, ProtFlags};
use rustix::shm;

/// One mapped segment.
pub(crate) struct Segment {
    base: NonNull<u8>,
    len: usize,
    name: String,
    /// An anonymous segment's file, kept open: peers open it as `/proc/<pid>/fd/<fd>`.
    fd: Option<rustix::fd::OwnedFd>,
}

// SAFETY: a `Segment` is a shared mapping that stays valid until `Drop` unmaps it. It has no
// thread affinity; concurrent access from several threads (the handle rings doorbells, the
// worker runs the protocol) only goes through atomics or through the `unsafe fn`s below, whose
// callers uphold the protocol's exclusivity.
unsafe impl Send for Segment {}
// SAFETY: see `Send`: shared references only give out atomics, or raw ranges under `unsafe`.
unsafe impl Sync for Segment {}

impl Segment {
    /// Creates `name` exclusively (mode 0600), reserves `len` bytes of tmpfs, maps it.
    pub(crate) fn create(name: &str, len: usize) -> io::Result<Segment> {
        let fd = shm::open(name, shm::OFlags::CREATE | shm::OFlags::EXCL | shm::OFlags::RDWR, Mode::RUSR | Mode::WUSR)?;
        // fallocate, not ftruncate: a tmpfs that is too small must fail here with ENOSPC, not
        // later with SIGBUS on first touch.
        if let Err(e) = rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, len as u64) {
            let _ = shm::unlink(name);
            let e = io::Error::from(e);
            if e.raw_os_error() == Some(rustix::io::Errno::NOSPC.raw_os_error()) {
                return Err(io::Error::new(
                    io::ErrorKind::StorageFull,
                    format!("/dev/shm has less than {len} bytes free for `{name}` (enlarge it, e.g. docker --shm-size, or lower COMM_SHM_WINDOW)"),
                ));
            }
            return Err(e);
        }
        let base = Self::map(&fd, len).inspect_err(|_| {
            let _ = shm::unlink(name);
        })?;
        Ok(Segment { base, len, name: name.to_owned(), fd: None })
    }

    /// Opens and maps an existing segment that must be at least `len` bytes long.
    pub(crate) fn open(name: &str, len: usize) -> io::Result<Segment> {
        Self::map_existing(shm::open(name, shm::OFlags::RDWR, Mode::empty())?, len, name.to_owned())
    }

    /// Maps the first `len` bytes of `fd`, which must have that many.
    fn map_existing(fd: rustix::fd::OwnedFd, len: usize, name: String) -> io::Result<Segment> {
        let size = rustix::fs::fstat(&fd)?.st_size as u64;
        if size < len as u64 {
            let e = format!("segment `{name}` is {size} bytes, expected at least {len}");
            return Err(io::Error::new(io::ErrorKind::InvalidData, e));
        }
        Ok(Segment { base: Self::map(&fd, len)?, len, name, fd: None })
    }

    /// An anonymous segment (`memfd_create`) of `len` bytes, mapped; its memory is taken as
    /// ranges are [`reserve`](Self::reserve)d. It has no name to leak: the kernel frees it when
    /// this process and every mapping of it are gone.
    pub(crate) fn anonymous(what: &str, len: usize) -> io::Result<Segment> {
        let fd = rustix::fs::memfd_create(what, rustix::fs::MemfdFlags::CLOEXEC)?;
        rustix::fs::ftruncate(&fd, len as u64)?;
        let base = Self::map(&fd, len)?;
        Ok(Segment { base, len, name: what.to_owned(), fd: Some(fd) })
    }

    /// Takes the memory of `off..off + len` of an anonymous segment now, so that a full memory
    /// budget fails here instead of with SIGBUS when the range is first touched.
    pub(crate) fn reserve(&self, off: usize, len: usize) -> io::Result<()> {
        self.check(off, len, 1);
        let fd = self.fd.as_ref().ok_or_else(|| io::Error::other("not an anonymous segment"))?;
        rustix::fs::fallocate(fd, FallocateFlags::empty(), off as u64, len as u64).map_err(Into::into)
    }

    /// The file descriptor of an [`anonymous`](Self::anonymous) segment, by which peers on this
    /// host open it.
    pub(crate) fn fd(&self) -> Option<i32> {
        use rustix::fd::AsRawFd;
        self.fd.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// Maps `len` bytes of process `pid`'s anonymous segment `fd` (through
    /// `/proc/<pid>/fd/<fd>`: same user, same host).
    pub(crate) fn open_anonymous(pid: u32, fd: i32, len: usize) -> io::Result<Segment> {
        let path = format!("/proc/{pid}/fd/{fd}");
        let flags = rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC;
        Self::map_existing(rustix::fs::open(path.as_str(), flags, Mode::empty())?, len, path)
    }

    /// The mapping's length.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn map(fd: &rustix::fd::OwnedFd, len: usize) -> io::Result<NonNull<u8>> {
        // SAFETY: a fresh shared mapping of a file we hold open; no existing Rust memory is
        // affected. The fd may be closed afterwards; the mapping keeps the object alive.
        let ptr = unsafe {
            rustix::mm::mmap(std::ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, fd, 0)?
        };
        NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))
    }

    /// Removes the name from /dev/shm; mappings stay valid.
    pub(crate) fn unlink(&self) -> io::Result<()> {
        shm::unlink(self.name.as_str()).map_err(Into::into)
    }

    /// The segment's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    fn check(&self, off: usize, len: usize, align: usize) {
        assert!(
            off.checked_add(len).is_some_and(|end| end <= self.len) && off.is_multiple_of(align),
            "shm access out of bounds or misaligned: offset {off} + {len} in a segment of {} bytes",
            self.len
        );
    }

    /// The atomic `u64` at `off` (8-aligned, in bounds: checked).
    pub(crate) fn u64_at(&self, off: usize) -> &AtomicU64 {
        self.check(off, 8, 8);
        // SAFETY: in bounds and aligned (checked); the mapping lives as long as `self`; the
        // word is only ever accessed atomically by every process.
        unsafe { AtomicU64::from_ptr(self.base.as_ptr().add(off).cast()) }
    }

    /// The atomic `u32` at `off` (4-aligned, in bounds: checked).
    pub(crate) fn u32_at(&self, off: usize) -> &AtomicU32 {
        self.check(off, 4, 4);
        // SAFETY: as for `u64_at`.
        unsafe { AtomicU32::from_ptr(self.base.as_ptr().add(off).cast()) }
    }

    /// Reads a plain value at `off`. A value torn by a concurrent writer is possible when the
    /// caller breaks the protocol, but it is still a valid `T` (Pod), so this is safe.
    pub(crate) fn read<T: bytemuck::Pod>(&self, off: usize) -> T {
        self.check(off, size_of::<T>(), align_of::<T>());
        // SAFETY: in bounds and aligned (checked); any bit pattern is a valid `T`; volatile
        // because another process may write it.
        unsafe { std::ptr::read_volatile(self.base.as_ptr().add(off).cast::<T>()) }
    }

    /// Writes a plain value at `off`.
    ///
    /// # Safety
    /// The caller must own the range under the step protocol (no peer reads it now).
    pub(crate) unsafe fn write<T: bytemuck::Pod>(&self, off: usize, value: T) {
        self.check(off, size_of::<T>(), align_of::<T>());
        // SAFETY: in bounds and aligned (checked); exclusivity is the caller's contract.
        unsafe { std::ptr::write_volatile(self.base.as_ptr().add(off).cast::<T>(), value) }
    }

    /// The bytes `off..off + len`, shared.
    ///
    /// # Safety
    /// No process may write the range while the returned slice is alive (the step protocol:
    /// the owner published the step and will not rewrite until this rank moves past it).
    pub(crate) unsafe fn bytes(&self, off: usize, len: usize) -> &[u8] {
        self.check(off, len, 1);
        // SAFETY: in bounds (checked); immutability for the slice's life is the caller's contract.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(off), len) }
    }

    /// The bytes `off..off + len`, exclusive.
    ///
    /// # Safety
    /// Only this rank's own segment, in a range no peer reads now and no other live slice
    /// covers (the step protocol: every peer has moved past the step that last used it).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn bytes_mut(&self, off: usize, len: usize) -> &mut [u8] {
        self.check(off, len, 1);
        // SAFETY: in bounds (checked); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add(off), len) }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: `base..base+len` is exactly our mapping; every reference handed out borrows
        // `self`, so none outlives this call.
        let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast::<c_void>(), self.len) };
    }
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment").field("name", &self.name).field("len", &self.len).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_open_unlink_and_exclusive() {
        let name = format!("/commshm-test-{}-{}", std::process::id(), 1);
        let a = Segment::create(&name, 8192).unwrap();
        assert!(Segment::create(&name, 8192).is_err(), "O_EXCL");
        let b = Segment::open(&name, 8192).unwrap();
        a.u64_at(64).store(42, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(b.u64_at(64).load(std::sync::atomic::Ordering::SeqCst), 42);
        assert!(Segment::open(&name, 1 << 20).is_err(), "too short");
        a.unlink().unwrap();
        assert!(Segment::open(&name, 8192).is_err(), "unlinked");
        // Still mapped after unlink.
        assert_eq!(b.u64_at(64).load(std::sync::atomic::Ordering::SeqCst), 42);
        let meta = std::fs::metadata(format!("/dev/shm{name}"));
        assert!(meta.is_err());
    }

    #[test]
    fn anonymous_segments_are_opened_through_proc() {
        let a = Segment::anonymous("commshm-test", 8192).unwrap();
        let b = Segment::open_anonymous(std::process::id(), a.fd().unwrap(), 8192).unwrap();
        a.u64_at(64).store(7, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(b.u64_at(64).load(std::sync::atomic::Ordering::SeqCst), 7);
        assert!(Segment::open_anonymous(std::process::id(), a.fd().unwrap(), 1 << 20).is_err(), "too short");
        assert!(Segment::open_anonymous(std::process::id(), 100_000, 8).is_err(), "no such fd");
    }

    #[test]
    fn mode_is_0600() {
        use std::os::unix::fs::PermissionsExt;
        let name = format!("/commshm-test-{}-{}", std::process::id(), 2);
        let a = Segment::create(&name, 4096).unwrap();
        let mode = std::fs::metadata(format!("/dev/shm{name}")).unwrap().permissions().mode();
        a.unlink().unwrap();
        assert_eq!(mode & 0o777, 0o600);
    }
}
