//! Anonymous memory mappings, optionally hugepage-backed, and the [`Memory`] trait for
//! memory a registration may own.

use std::ptr::NonNull;

use crate::sys::syscall;
use crate::Error;

const HUGE_PAGE: usize = 2 << 20;

/// Whether a mapping asks for huge pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HugePages {
    /// Base pages only.
    #[default]
    Off,
    /// `MAP_HUGETLB` when the system has huge pages reserved, else a 2 MiB-aligned mapping
    /// advised with `MADV_HUGEPAGE` (transparent huge pages).
    Prefer,
}

/// What actually backs a [`Mapping`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backing {
    /// Base pages.
    Normal,
    /// Transparent huge pages were requested with `MADV_HUGEPAGE` (the kernel decides).
    TransparentHuge,
    /// Reserved huge pages (`MAP_HUGETLB`).
    HugeTlb,
}

/// An owned, page-aligned, zero-filled anonymous mapping; unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    base: *mut libc::c_void,
    map_len: usize,
    backing: Backing,
    /// A memfd-backed mapping ([`Mapping::shared`]): it leaves the registry on drop.
    shared: bool,
}

// SAFETY: a Mapping owns its pages exclusively; the raw pointers are not shared aliases.
unsafe impl Send for Mapping {}
// SAFETY: &Mapping only exposes the address and length, never the bytes.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of base pages.
    pub fn new(len: usize) -> Result<Mapping, Error> {
        Self::with_hugepages(len, HugePages::Off)
    }

    /// Maps `len` bytes, asking for huge pages as `huge` says.
    pub fn with_hugepages(len: usize, huge: HugePages) -> Result<Mapping, Error> {
        if len == 0 {
            return Err(Error::InvalidRange { addr: 0, len });
        }
        if huge == HugePages::Prefer {
            if let Some(rounded) = len.checked_next_multiple_of(HUGE_PAGE) {
                if let Ok(base) = map(rounded, libc::MAP_HUGETLB) {
                    return Ok(Self::from_parts(base, rounded, base, len, Backing::HugeTlb));
                }
                // Over-map by one huge page so a 2 MiB-aligned start exists inside.
                if let Some(map_len) = rounded.checked_add(HUGE_PAGE) {
                    let base = map(map_len, 0).map_err(|source| Error::Map { len, source })?;
                    let aligned = (base as usize).next_multiple_of(HUGE_PAGE);
                    let p = aligned as *mut libc::c_void;
                    // SAFETY: [aligned, aligned + rounded) lies inside the mapping just made.
                    let advised = unsafe { libc::madvise(p, rounded, libc::MADV_HUGEPAGE) };
                    let backing = if advised == 0 {
                        Backing::TransparentHuge
                    } else {
                        Backing::Normal
                    };
                    return Ok(Self::from_parts(base, map_len, p, len, backing));
                }
            }
        }
        let base = map(len, 0).map_err(|source| Error::Map { len, source })?;
        Ok(Self::from_parts(base, len, base, len, Backing::Normal))
    }

    fn from_parts(
        base: *mut libc::c_void,
        map_len: usize,
        start: *mut libc::c_void,
        len: usize,
        backing: Backing,
    ) -> Mapping {
        Mapping {
            ptr: NonNull::new(start.cast()).expect("mmap returned null"),
            len,
            base,
            map_len,
            backing,
            shared: false,
        }
    }

    pub(crate) fn from_shared_parts(
        base: *mut libc::c_void,
        map_len: usize,
        len: usize,
    ) -> Mapping {
        // Built field by field: a temporary Mapping would unmap the pages when dropped.
        Mapping {
            ptr: NonNull::new(base.cast()).expect("mmap returned null"),
            len,
            base,
            map_len,
            backing: Backing::Normal,
            shared: true,
        }
    }

    /// Start of the usable memory.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Usable length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: mappings are never empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What backs the memory.
    pub fn backing(&self) -> Backing {
        self.backing
    }
}

fn map(len: usize, extra: libc::c_int) -> std::io::Result<*mut libc::c_void> {
    // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches
    // no existing memory.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | extra,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(p)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.shared {
            crate::shared::forget(self.base as usize);
        }
        if let Err(err) = syscall!(munmap(self.base, self.map_len)) {
            tracing::error!(%err, "munmap failed");
        }
    }
}

/// Memory that a registration can take ownership of and keep alive.
///
/// # Safety
///
/// `as_raw` must return the same pointer and length every time, and the memory must stay
/// valid and writable through that pointer for as long as the value lives, even after the
/// value itself is moved. Implementors must not touch the memory themselves; and unless
/// [`shared_with_others`](Memory::shared_with_others) says so, nothing else may access it
/// while a registration that owns it is being removed (a provider may copy it then).
pub unsafe trait Memory: Send + Sync + 'static {
    /// Start and length of the memory, with write permission.
    fn as_raw(&mut self) -> (*mut u8, usize);

    /// Whether others may reach the memory while a registration that owns this value is
    /// removed (the same memory registered again elsewhere, say): a provider then never
    /// copies it to take it back from a peer, and waits for the peer instead.
    fn shared_with_others(&self) -> bool {
        false
    }
}

// SAFETY: moving a Vec moves only its header; the heap buffer stays put, and the pointer
// comes from `as_mut_ptr` so it may be written through.
unsafe impl Memory for Vec<u8> {
    fn as_raw(&mut self) -> (*mut u8, usize) {
        (self.as_mut_ptr(), self.len())
    }
}

// SAFETY: the mapping's pages stay at the same address until it is dropped.
unsafe impl Memory for Mapping {
    fn as_raw(&mut self) -> (*mut u8, usize) {
        (self.as_ptr(), self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapping_is_zeroed_aligned_and_writable() {
        let m = Mapping::new(10_000).unwrap();
        assert_eq!(m.as_ptr() as usize % crate::sys::page_size(), 0);
        assert_eq!(m.backing(), Backing::Normal);
        // SAFETY: the mapping is 10_000 bytes long and owned by this test.
        unsafe {
            assert_eq!(*m.as_ptr().add(9_999), 0);
            *m.as_ptr().add(9_999) = 7;
            assert_eq!(*m.as_ptr().add(9_999), 7);
        }
    }

    #[test]
    fn hugepage_mapping_is_huge_aligned_or_says_why_not() {
        let m = Mapping::with_hugepages(3 << 20, HugePages::Prefer).unwrap();
        match m.backing() {
            Backing::HugeTlb | Backing::TransparentHuge => {
                assert_eq!(m.as_ptr() as usize % HUGE_PAGE, 0)
            }
            Backing::Normal => {}
        }
        assert_eq!(m.len(), 3 << 20);
    }

    #[test]
    fn zero_length_is_an_error() {
        assert!(matches!(Mapping::new(0), Err(Error::InvalidRange { .. })));
    }
}
