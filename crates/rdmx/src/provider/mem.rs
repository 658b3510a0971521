//! Registered memory as it crosses the seam: what a region is ([`MrShared`]) and the
//! references that keep it alive while requests use it ([`MrRef`]).
//!
//! Registered memory may be written by the adapter or by a peer at any time, so it is
//! reached only through raw copies and atomics here, never through Rust references.

use std::sync::Arc;

use rdmx_core::PdId;
use rdmx_mem::{Access, Memory, PinGuard};

use super::copy::copy;
use crate::{Error, Result};

/// The part of a region that outlives deregistration while in use.
pub(crate) struct MrShared {
    // Field order is drop order: unpin before the owned memory is freed.
    pub(crate) pin: Option<PinGuard>,
    pub(crate) _owner: Option<Box<dyn Memory>>,
    pub(crate) addr: *mut u8,
    pub(crate) len: usize,
    pub(crate) access: Access,
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
    pub(crate) pd: PdId,
    /// Held shared by the accessors that read or write the memory through a handle
    /// (`read_at`, `write_at`, the atomics), and exclusively while the memory is copied
    /// to take it back from a peer (shm's detach): none of them runs during the copy.
    pub(crate) gate: parking_lot::RwLock<()>,
}

// SAFETY: the raw pointer is an address of memory kept valid by `owner` or by the
// register_raw contract; MrShared never hands out references into it, only copies.
unsafe impl Send for MrShared {}
// SAFETY: as above; all access to the bytes goes through copying accessors.
unsafe impl Sync for MrShared {}

impl std::fmt::Debug for MrShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &self.addr)
            .field("len", &self.len)
            .field("access", &self.access)
            .field("lkey", &format_args!("{:#010x}", self.lkey))
            .field("rkey", &format_args!("{:#010x}", self.rkey))
            .field("pd", &self.pd)
            .field("pinned", &self.pin.is_some())
            .finish()
    }
}

impl MrShared {
    /// The address of `len` bytes at virtual address `addr`, if they lie inside the
    /// region; valid while the region's memory lives (see [`MrRef::raw_range`]).
    pub(crate) fn raw_range(&self, addr: u64, len: usize) -> Option<*mut u8> {
        let offset = (addr as usize).checked_sub(self.addr as usize)?;
        self.bounds(offset, len).ok()
    }

    fn bounds(&self, offset: usize, len: usize) -> Result<*mut u8> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.addr.wrapping_add(offset)),
            _ => Err(Error::OutOfBounds {
                offset,
                len,
                region_len: self.len,
            }),
        }
    }

    pub(crate) fn read_at(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        let src = self.bounds(offset, buf.len())?;
        // SAFETY: bounds() keeps [src, src + buf.len()) inside the registered memory, which
        // stays valid while self lives; buf is a distinct Rust allocation.
        unsafe { copy(buf.as_mut_ptr(), src, buf.len()) };
        Ok(())
    }

    /// Whether the byte at `offset` held `want` in one of up to `tries` reads.
    pub(crate) fn byte_becomes(&self, offset: usize, want: u8, tries: usize) -> Result<bool> {
        let p = self.bounds(offset, 1)?;
        // SAFETY: the byte at `p` is inside the registered memory, which stays valid while
        // self lives; registered memory is shared memory, reached only through raw copies
        // and atomics (a byte is always aligned for one).
        let byte = unsafe { std::sync::atomic::AtomicU8::from_ptr(p) };
        Ok((0..tries).any(|_| byte.load(std::sync::atomic::Ordering::Acquire) == want))
    }

    fn atomic(&self, offset: usize) -> Result<&std::sync::atomic::AtomicU64> {
        let p = self.bounds(offset, 8)?;
        if p as usize % 8 != 0 {
            return Err(Error::Misaligned { offset });
        }
        // SAFETY: the 8 bytes at `p` are inside the registered memory, which stays valid
        // while self lives, and `p` is 8-aligned. Registered memory is shared memory: every
        // access to it goes through raw copies or these atomics, never Rust references.
        Ok(unsafe { std::sync::atomic::AtomicU64::from_ptr(p.cast()) })
    }

    pub(crate) fn compare_swap(&self, offset: usize, compare: u64, swap: u64) -> Result<u64> {
        use std::sync::atomic::Ordering::SeqCst;
        let a = self.atomic(offset)?;
        Ok(match a.compare_exchange(compare, swap, SeqCst, SeqCst) {
            Ok(v) | Err(v) => v,
        })
    }

    /// (A load, not an add of 0: it writes nothing, so it does not take the line from a
    /// peer that writes it.)
    pub(crate) fn load(&self, offset: usize) -> Result<u64> {
        Ok(self
            .atomic(offset)?
            .load(std::sync::atomic::Ordering::SeqCst))
    }

    pub(crate) fn fetch_add(&self, offset: usize, add: u64) -> Result<u64> {
        Ok(self
            .atomic(offset)?
            .fetch_add(add, std::sync::atomic::Ordering::SeqCst))
    }

    pub(crate) fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        let dst = self.bounds(offset, data.len())?;
        // SAFETY: as in read_at; registered memory is writable through this pointer
        // (Memory::as_raw and register_raw both promise it).
        unsafe { copy(dst, data.as_ptr(), data.len()) };
        Ok(())
    }
}

macro_rules! region_getters {
    () => {
        /// Address of the first registered byte.
        pub fn addr(&self) -> usize {
            self.shared.addr as usize
        }
        /// Registered length in bytes.
        pub fn len(&self) -> usize {
            self.shared.len
        }
        /// Always false: empty regions cannot be registered.
        pub fn is_empty(&self) -> bool {
            self.shared.len == 0
        }
        /// Local key.
        pub fn lkey(&self) -> u32 {
            self.shared.lkey
        }
        /// Remote key (0 when the region grants no remote access).
        pub fn rkey(&self) -> u32 {
            self.shared.rkey
        }
        /// Access flags.
        pub fn access(&self) -> Access {
            self.shared.access
        }
        /// The protection domain the region belongs to.
        pub fn pd(&self) -> PdId {
            self.shared.pd
        }
        /// Whether the region owns its memory (registered with `register`, not
        /// `register_raw`).
        pub fn owns_memory(&self) -> bool {
            self.shared._owner.is_some()
        }
        /// Whether the pages are locked in memory.
        pub fn is_pinned(&self) -> bool {
            self.shared.pin.is_some()
        }
        /// Copies `buf.len()` bytes starting at `offset` out of the region.
        ///
        /// This and the other accessors reach only memory the region owns: a region
        /// registered raw refuses with [`Error::InvalidArgument`](crate::Error) (its
        /// memory is its owner's, reached directly).
        pub fn read_at(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
            let _gate = self.shared.reachable()?;
            self.shared.read_at(offset, buf)
        }
        /// Copies `data` into the region at `offset`.
        pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
            let _gate = self.shared.reachable()?;
            self.shared.write_at(offset, data)
        }
        /// Reads the byte at `offset` up to `tries` times, until it holds `want`; returns
        /// whether it did. This is how to wait for a flag a peer's RDMA WRITE sets (as
        /// perftest's latency tests wait on a message's last byte): the region is reached
        /// once for the whole wait rather than once per read, as repeated
        /// [`read_at`](Self::read_at) calls would. Reads are single atomic byte loads
        /// (`Acquire`), a fraction of a nanosecond each while the line stays in the
        /// cache (256 took 65-106 ns on a 2 GHz core).
        pub fn byte_becomes(&self, offset: usize, want: u8, tries: usize) -> Result<bool> {
            let _gate = self.shared.reachable()?;
            self.shared.byte_becomes(offset, want, tries)
        }
        /// Atomically loads the 8-aligned `u64` at `offset`.
        pub fn load_u64(&self, offset: usize) -> Result<u64> {
            let _gate = self.shared.reachable()?;
            self.shared.load(offset)
        }
        /// Atomically adds to the 8-aligned `u64` at `offset`, returning the old value;
        /// atomic against remote FETCH_ADD and COMPARE_SWAP on the same address.
        pub fn fetch_add_u64(&self, offset: usize, add: u64) -> Result<u64> {
            let _gate = self.shared.reachable()?;
            self.shared.fetch_add(offset, add)
        }
        /// Atomically replaces the 8-aligned `u64` at `offset` with `swap` if it equals
        /// `compare`, returning the old value.
        pub fn compare_swap_u64(&self, offset: usize, compare: u64, swap: u64) -> Result<u64> {
            let _gate = self.shared.reachable()?;
            self.shared.compare_swap(offset, compare, swap)
        }
    };
}

pub(crate) use region_getters;

impl MrShared {
    /// The gate, held shared, for an accessor that reaches the memory through a handle:
    /// only memory the region owns is reached this way. Memory registered raw is its
    /// owner's, who reaches it directly; a handle to it (given to safe code by the
    /// registration cache, or made by `share`) may outlive the owner's promise.
    pub(crate) fn reachable(&self) -> Result<parking_lot::RwLockReadGuard<'_, ()>> {
        if self._owner.is_none() {
            return Err(Error::InvalidArgument(
                "the region borrows its memory (register_raw): reach the memory directly",
            ));
        }
        Ok(self.gate.read())
    }
}

/// A reference to registered memory that keeps it alive, even past deregistration.
///
/// Keys may already be invalid when an `MrRef` is used; the memory is not.
#[derive(Clone, Debug)]
pub struct MrRef {
    shared: Arc<MrShared>,
}

impl MrRef {
    pub(crate) fn new(shared: Arc<MrShared>) -> Self {
        MrRef { shared }
    }

    /// The address of `len` bytes at virtual address `addr`, if they lie inside the
    /// region: for transports that move bytes between a socket and registered memory
    /// with vectored I/O. The pointer is valid while this `MrRef` (or a clone) lives.
    pub(crate) fn raw_range(&self, addr: u64, len: usize) -> Option<*mut u8> {
        self.shared.raw_range(addr, len)
    }

    /// The region itself.
    pub(crate) fn shared(&self) -> &MrShared {
        &self.shared
    }

    region_getters!();
}
