//! Memory another process can map: [`Mapping::shared`] backs a mapping with a memfd,
//! and this module's registry tells a provider which registered memory lies in such a
//! mapping ([`find`]), so that it can hand the file to a peer process, and takes a
//! mapping back from every peer ([`detach`]) when one cannot be trusted to stop using it.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::sys::syscall;
use crate::{Error, Mapping};

/// The memfd behind a shared mapping: its descriptor (to pass to a peer), a number
/// unique in this process, and its size.
#[derive(Debug)]
pub struct SharedFile {
    fd: OwnedFd,
    id: u64,
    len: usize,
}

impl SharedFile {
    /// The descriptor, to pass to a peer process (it stays open while the file is).
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.as_fd()
    }

    /// A number no other shared file of this process has had.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Bytes of the file (the mapping's length, rounded up to whole pages).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: shared files are never empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A live shared mapping.
struct Entry {
    /// First byte.
    start: usize,
    /// Bytes mapped (whole pages).
    map_len: usize,
    /// Bytes its owner may use (the length asked for).
    len: usize,
    file: Arc<SharedFile>,
}

type Registry = Vec<Entry>;

fn registry() -> MutexGuard<'static, Registry> {
    static REG: Mutex<Registry> = Mutex::new(Vec::new());
    REG.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The shared file that backs `[addr, addr + len)` of this process, and the range's
/// offset in it, if the whole range lies in one live [`Mapping::shared`] that was not
/// [detached](detach).
pub fn find(addr: usize, len: usize) -> Option<(Arc<SharedFile>, u64)> {
    let end = addr.checked_add(len)?;
    let reg = registry();
    reg.iter()
        .find(|e| e.start <= addr && end <= e.start + e.map_len)
        .map(|e| (e.file.clone(), (addr - e.start) as u64))
}

/// Whether `[addr, addr + len)` spans a live shared mapping, from its first byte to the
/// last its owner may use: what [`detach`] needs to take it back.
pub fn spans(addr: usize, len: usize) -> bool {
    registry().iter().any(|e| e.start == addr && len >= e.len)
}

/// Takes the shared mapping that `[addr, addr + len)` spans back from every other
/// process: its pages are replaced, at the same address and with the same contents, by
/// private anonymous memory (`mremap` over it), so whatever a peer later writes through
/// its own mapping of the file lands in pages this process no longer uses. The mapping
/// is then no longer offered by [`find`]. Returns whether a mapping was detached: only
/// one the range spans, from its first byte to the last its owner may use, is; a range
/// that covers only part of one detaches nothing (the rest may be in use).
///
/// # Safety
///
/// Nothing in this process may read or write `[addr, addr + len)` while the call runs:
/// the bytes are copied, and a write made meanwhile may be lost (a data race). Callers
/// use it for memory whose registration is being removed and that nothing else holds.
pub unsafe fn detach(addr: usize, len: usize) -> std::io::Result<bool> {
    let mut reg = registry();
    let Some(i) = reg.iter().position(|e| e.start == addr && len >= e.len) else {
        return Ok(false);
    };
    let (start, n) = (reg[i].start, reg[i].map_len);
    // SAFETY: an anonymous private mapping at an address of the kernel's choosing.
    let tmp = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            n,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if tmp == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `start..start + n` is the live shared mapping (the registry holds only live
    // ones, under its lock) and `tmp` the new one, both `n` bytes; they do not overlap.
    // Nothing else accesses the mapping meanwhile: the caller promised so for the range,
    // which spans all the bytes its owner may use.
    unsafe { std::ptr::copy_nonoverlapping(start as *const u8, tmp.cast::<u8>(), n) };
    // SAFETY: moves the private pages over the shared mapping's range, which the
    // `Mapping` owns and unmaps on drop (munmap works for any pages there).
    let moved = unsafe {
        libc::mremap(
            tmp,
            n,
            n,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            start as *mut libc::c_void,
        )
    };
    if moved == libc::MAP_FAILED {
        let e = std::io::Error::last_os_error();
        // SAFETY: `tmp` is ours and nothing refers into it.
        unsafe { libc::munmap(tmp, n) };
        return Err(e);
    }
    reg.remove(i);
    // The new pages replace locked ones without their lock: registrations that pinned
    // the range count on it.
    crate::pin::relock(start, start + n);
    Ok(true)
}

impl Mapping {
    /// Maps `len` zeroed bytes backed by a memfd sealed at its size, that a provider can
    /// hand to a peer process for it to map (the shm provider's `mapped` data path).
    /// Until it is [detached](detach), every process the file is passed to can read and
    /// write the whole mapping.
    pub fn shared(len: usize) -> Result<Mapping, Error> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let map_len = len
            .checked_next_multiple_of(crate::sys::page_size())
            .filter(|&n| n > 0)
            .ok_or(Error::InvalidRange { addr: 0, len })?;
        let err = |source| Error::Map { len, source };
        // SAFETY: memfd_create takes a NUL-terminated name and flags; returns a new fd.
        let fd = syscall!(memfd_create(
            c"rdmx-mem".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING
        ))
        .map_err(err)?;
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        syscall!(ftruncate(fd.as_raw_fd(), map_len as libc::off_t)).map_err(err)?;
        // Sealed at its size: a peer holding the file cannot shrink it under this
        // process's mapping (whose accesses would then raise SIGBUS).
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        syscall!(fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals)).map_err(err)?;
        // SAFETY: a shared mapping of our own file at an address of the kernel's choosing.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(err(std::io::Error::last_os_error()));
        }
        let file = Arc::new(SharedFile {
            fd,
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            len: map_len,
        });
        registry().push(Entry {
            start: p as usize,
            map_len,
            len,
            file,
        });
        Ok(Mapping::from_shared_parts(p, map_len, len))
    }

    /// Whether the mapping is backed by a memfd a peer may map ([`Mapping::shared`], not
    /// [detached](detach)).
    pub fn is_shared(&self) -> bool {
        find(self.as_ptr() as usize, self.len()).is_some()
    }
}

/// A shared mapping at `base` goes: it leaves the registry.
pub(crate) fn forget(base: usize) {
    registry().retain(|e| e.start != base);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_mapping_is_found_and_detached_keeps_its_bytes() {
        let m = Mapping::shared(10_000).unwrap();
        let a = m.as_ptr() as usize;
        assert!(m.is_shared());
        let (f, off) = find(a + 100, 200).unwrap();
        assert_eq!(off, 100);
        assert_eq!(f.len(), 12_288);
        assert!(find(a + 9_000, 4_000).is_none(), "past the mapping");
        // A second view of the file, as a peer has.
        // SAFETY: maps our own file; unmapped below.
        let peer = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                f.len(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.fd().as_raw_fd(),
                0,
            )
        } as *mut u8;
        assert_ne!(peer as *mut libc::c_void, libc::MAP_FAILED);
        // SAFETY: both views are 12 KiB long and live, and the test touches neither while
        // detaching.
        unsafe {
            *peer.add(5) = 42;
            assert_eq!(*m.as_ptr().add(5), 42, "the peer's writes are seen");
            assert!(!detach(a, 9_999).unwrap(), "a range short of the end");
            assert!(!detach(a + 1, 9_999).unwrap(), "a range after the start");
            assert!(m.is_shared());
            assert!(detach(a, 10_000).unwrap());
            assert_eq!(*m.as_ptr().add(5), 42, "detaching keeps the bytes");
            *peer.add(5) = 7;
            assert_eq!(
                *m.as_ptr().add(5),
                42,
                "a detached mapping no longer sees the peer"
            );
            libc::munmap(peer.cast(), f.len());
        }
        assert!(!m.is_shared());
        // SAFETY: nothing touches the mapping meanwhile.
        assert!(!unsafe { detach(a, 10_000) }.unwrap());
    }

    /// Detaching pinned memory keeps it locked: the pages that replace the shared ones
    /// are locked again for the registrations that pinned them.
    #[test]
    fn a_detached_pinned_mapping_stays_locked() {
        let m = Mapping::shared(8192).unwrap();
        let (a, n) = (m.as_ptr() as usize, m.len());
        let guard = crate::pin::pin(a, n, crate::pin::Pinning::Pinned).unwrap();
        assert!(crate::pin::locked(a, a + n), "pinned");
        // SAFETY: nothing touches the mapping meanwhile.
        assert!(unsafe { detach(a, n) }.unwrap());
        assert!(
            crate::pin::locked(a, a + n),
            "the detached pages are not locked"
        );
        drop(guard);
    }

    #[test]
    fn a_dropped_mapping_leaves_the_registry() {
        let m = Mapping::shared(1).unwrap();
        let a = m.as_ptr() as usize;
        let id = find(a, 1).expect("a live mapping is found").0.id();
        drop(m);
        // Another test may map a file of its own at the freed address meanwhile: only
        // the dropped mapping's file must be gone.
        assert!(!matches!(find(a, 1), Some((f, _)) if f.id() == id));
    }
}
