//! The owned buffer handle.

use std::fmt;
use std::iter;
use std::marker::PhantomData;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::thread_cache::{with_local, with_locals, ThreadPart};
use super::{Shared, Slot, CLOSED, PRESSURE};
use crate::access::Access;
use crate::registrar::Registrar;

/// A buffer of a [`BufferPool`](super::BufferPool): `capacity()` registered bytes at
/// `addr()`, of which the first `len()` are the valid ones.
///
/// Owned and `Send + Sync`; dropping it, on any thread, returns it to the pool. It keeps
/// the pool's memory alive, even after every pool handle is gone.
///
/// The bytes are reached by copying ([`read_at`](Self::read_at),
/// [`write_at`](Self::write_at)) or, only in pools without remote access, through slices
/// ([`as_slice`](Self::as_slice), [`as_mut_slice`](Self::as_mut_slice)): with remote
/// access a peer may change the memory at any time through the slab's rkey.
pub struct PoolBuf<R: Registrar> {
    part: Arc<ThreadPart>,
    slot: Slot,
    class: usize,
    len: usize,
    cap: usize,
    _registrar: PhantomData<fn() -> R>,
}

/// A copy or length change outside a buffer's valid bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{len} bytes at offset {offset} exceed the {bound} bytes available")]
pub struct OutOfBounds {
    /// Offset asked for.
    pub offset: usize,
    /// Bytes asked for.
    pub len: usize,
    /// Bytes available: the valid length for copies, the capacity for `set_len`.
    pub bound: usize,
}

impl<R: Registrar> PoolBuf<R> {
    pub(super) fn new(
        part: Arc<ThreadPart>,
        slot: Slot,
        class: usize,
        cap: usize,
        len: usize,
    ) -> Self {
        PoolBuf {
            part,
            slot,
            class,
            len,
            cap,
            _registrar: PhantomData,
        }
    }

    /// Address of the first byte.
    #[inline]
    pub fn addr(&self) -> usize {
        self.slot.addr
    }

    /// Valid length in bytes: what was asked of `get`, or set by [`set_len`](Self::set_len).
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the valid length is 0.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size of the buffer (its size class) in bytes.
    #[inline]
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Sets the valid length, up to the capacity. Bytes that become valid hold whatever
    /// was last written there.
    pub fn set_len(&mut self, len: usize) -> Result<(), OutOfBounds> {
        if len > self.cap {
            return Err(OutOfBounds {
                offset: 0,
                len,
                bound: self.cap,
            });
        }
        self.len = len;
        Ok(())
    }

    /// Local key of the slab's registration.
    #[inline]
    pub fn lkey(&self) -> u32 {
        self.slot.lkey
    }

    /// Remote key of the slab's registration.
    #[inline]
    pub fn rkey(&self) -> u32 {
        self.slot.rkey
    }

    /// Access flags of the slab's registration.
    #[inline]
    pub fn access(&self) -> Access {
        self.part.shared.access
    }

    /// Whether no peer can touch the memory: the access has no remote flag.
    fn local_only(&self) -> bool {
        Access::LOCAL_WRITE.contains(self.access())
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), OutOfBounds> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(OutOfBounds {
                offset,
                len,
                bound: self.len,
            }),
        }
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the buffer. The range must lie
    /// within the valid length.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<(), OutOfBounds> {
        self.check(offset, dst.len())?;
        // SAFETY: [addr + offset, + dst.len()) lies within this buffer (checked above),
        // which the slabs kept alive by `part` hold mapped. `dst` cannot overlap it: it is
        // a unique borrow, and references into this buffer exist only as borrows of
        // `self`-derived slices, which `&mut [u8]` to them would conflict with.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (self.slot.addr + offset) as *const u8,
                dst.as_mut_ptr(),
                dst.len(),
            );
        }
        Ok(())
    }

    /// Copies `src` into the buffer at `offset`. The range must lie within the valid
    /// length.
    pub fn write_at(&mut self, offset: usize, src: &[u8]) -> Result<(), OutOfBounds> {
        self.check(offset, src.len())?;
        // SAFETY: the range lies within this buffer (checked above) and is mapped
        // writable while `part` lives. This `PoolBuf` is the buffer's only owner and is
        // borrowed mutably, so no slice of it is alive, and `src` cannot point into it.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                (self.slot.addr + offset) as *mut u8,
                src.len(),
            );
        }
        Ok(())
    }

    /// The valid bytes, when the pool's access has no remote flag; `None` otherwise (a
    /// peer could change them under the reference).
    pub fn as_slice(&self) -> Option<&[u8]> {
        if !self.local_only() {
            return None;
        }
        // SAFETY: `len <= cap` bytes of this buffer, mapped while `part` lives. Only this
        // owner reaches the buffer and no peer can (no remote access); the adapter writes
        // only on work requests whose poster promised not to hold this borrow meanwhile.
        Some(unsafe { std::slice::from_raw_parts(self.slot.addr as *const u8, self.len) })
    }

    /// The valid bytes, mutable, when the pool's access has no remote flag; `None`
    /// otherwise.
    pub fn as_mut_slice(&mut self) -> Option<&mut [u8]> {
        if !self.local_only() {
            return None;
        }
        // SAFETY: as in `as_slice`; the borrow of `self` is unique, so is the slice.
        Some(unsafe { std::slice::from_raw_parts_mut(self.slot.addr as *mut u8, self.len) })
    }
}

impl<R: Registrar> fmt::Debug for PoolBuf<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolBuf")
            .field("addr", &format_args!("{:#x}", self.slot.addr))
            .field("len", &self.len)
            .field("capacity", &self.cap)
            .field("lkey", &self.slot.lkey)
            .field("rkey", &self.slot.rkey)
            .finish()
    }
}

impl<R: Registrar> Drop for PoolBuf<R> {
    #[inline]
    fn drop(&mut self) {
        let shared = &*self.part.shared;
        let (class, slot) = (self.class, self.slot);
        if shared.state.load(Ordering::Relaxed) == 0 {
            let cached = with_local(shared.id, |local| {
                local.mags[class].push(slot, shared, class);
            });
            if cached.is_some() {
                return;
            }
        }
        give_back_slow(&self.part.shared, class, slot);
    }
}

/// Returns a buffer when the fast path cannot: no cache yet on this thread, pool under
/// pressure or closed, or thread-local gone.
#[cold]
fn give_back_slow(shared: &Arc<Shared>, class: usize, slot: Slot) {
    let state = shared.state.load(Ordering::Relaxed);
    let cached = with_locals(|t| {
        if state & CLOSED != 0 {
            // Nobody can get from this pool again: release this thread's cache of it.
            if let Some(local) = t.take(shared.id) {
                t.bury(local);
            }
            false
        } else if state & PRESSURE != 0 {
            // Make this buffer, and the ones this thread cached of its class, available
            // to every thread.
            if let Some(local) = t.get(shared.id) {
                let mag = &mut local.mags[class];
                shared.put_back(class, mag.slots.drain(..).chain(iter::once(slot)));
                true
            } else {
                false
            }
        } else {
            t.get_or_create(shared).mags[class].push(slot, shared, class);
            true
        }
    });
    if cached != Some(true) {
        shared.put_back(class, iter::once(slot));
    }
}
