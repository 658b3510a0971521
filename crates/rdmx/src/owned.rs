//! Owned-buffer posts, in the io_uring style: a registered buffer moves into a work
//! request and comes back once its completion has been polled, so the application never
//! touches memory a provider owns, and reads what it received as a plain `&[u8]`, without
//! a copy and without `unsafe`.
//!
//! ```
//! # fn main() -> rdmx::Result<()> {
//! use std::time::Duration;
//! use rdmx::{BufferPool, Completion, ConnectOptions, Context, PoolBuf, PoolConfig, QpCaps};
//! use rdmx::{Access, SendRequest};
//!
//! let ctx = Context::open_default()?;
//! let pd = ctx.alloc_pd();
//! let cq = ctx.create_cq(16)?;
//! let (a, b) = (
//!     pd.create_qp(&cq, &cq, QpCaps::default())?,
//!     pd.create_qp(&cq, &cq, QpCaps::default())?,
//! );
//! a.connect(b.endpoint(), &ConnectOptions::default())?;
//! b.connect(a.endpoint(), &ConnectOptions::default())?;
//! let pool = BufferPool::new(pd.clone(), PoolConfig::default().with_access(Access::LOCAL_WRITE))
//!     .map_err(rdmx::Error::from)?;
//!
//! b.post_recv_buf(1, pool.get(64).map_err(rdmx::Error::from)?).map_err(|(e, _)| e)?;
//! let mut out = pool.get(5).map_err(rdmx::Error::from)?;
//! out.as_mut_slice().unwrap().copy_from_slice(b"hello");
//! a.post_send_buf(SendRequest::send(2), out).map_err(|(e, _)| e)?;
//!
//! let mut got = [Completion::default(); 2];
//! let mut n = 0;
//! while n < 2 {
//!     n += cq.wait(&mut got[n..], Duration::from_secs(5))?;
//! }
//! let recv = got.iter().find(|c| c.wr_id == 1).unwrap();
//! let buf: PoolBuf = b.take_buf(recv).expect("the receive completed");
//! assert_eq!(&buf.as_slice().unwrap()[..recv.byte_len as usize], b"hello");
//! # Ok(()) }
//! ```

use std::collections::HashMap;

use parking_lot::Mutex;
use rdmx_core::{Completion, RecvWr, SendFlags, Sge, SgeList};
use rdmx_mem::Access;

use crate::{CacheHandle, Error, PoolBuf, RegCache, Result};

/// Registered memory that can move into a work request: a [`PoolBuf`] or a [`CachedBuf`].
pub trait OwnedBuf: Send + Sized + 'static + sealed::Sealed {
    /// The buffer as one scatter/gather element: its valid bytes and their local key.
    fn sge(&self) -> Sge;
    #[doc(hidden)]
    fn park(self) -> Parked;
    #[doc(hidden)]
    fn unpark(p: Parked) -> std::result::Result<Self, Parked>;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for crate::PoolBuf {}
    impl Sealed for super::CachedBuf {}
}

/// A buffer held by a queue pair while a request uses it.
#[doc(hidden)]
#[derive(Debug)]
pub enum Parked {
    /// A pool buffer.
    Pool(PoolBuf),
    /// A cached registration of an owned buffer.
    Cached(CachedBuf),
}

impl OwnedBuf for PoolBuf {
    fn sge(&self) -> Sge {
        Sge {
            addr: self.addr() as u64,
            len: self.len() as u32,
            lkey: self.lkey(),
        }
    }
    fn park(self) -> Parked {
        Parked::Pool(self)
    }
    fn unpark(p: Parked) -> std::result::Result<Self, Parked> {
        match p {
            Parked::Pool(b) => Ok(b),
            other => Err(other),
        }
    }
}

/// An owned buffer registered through a [`RegCache`]: the cache's registration of memory
/// this value owns, so it can be posted from safe code (and moved into a request) like a
/// pool buffer. The registration grants local access only, so no peer can change the
/// bytes: [`as_slice`](Self::as_slice) and [`as_mut_slice`](Self::as_mut_slice) are safe.
pub struct CachedBuf {
    // Field order is drop order: the handle goes back to the cache, then the memory's
    // registration is invalidated and the memory freed (`Owned`).
    handle: CacheHandle,
    buf: Owned,
}

/// A cached buffer's memory, and the cache: when the memory is freed, its range is
/// invalidated first. Without the cache's monitor nothing else would: a later buffer at
/// the same address would hit the old registration, which on an adapter keeps the old
/// pages pinned, so what it receives would land where nobody reads.
struct Owned {
    buf: Box<[u8]>,
    /// `None` once the memory is handed back ([`CachedBuf::into_inner`]): it stays
    /// registered for the caller to use again.
    cache: Option<RegCache>,
}

impl Drop for Owned {
    fn drop(&mut self) {
        if let Some(cache) = self.cache.take() {
            cache.invalidate(self.buf.as_ptr() as usize, self.buf.len());
        }
    }
}

impl std::ops::Deref for Owned {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf
    }
}

impl std::ops::DerefMut for Owned {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }
}

impl std::fmt::Debug for CachedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachedBuf")
            .field("len", &self.buf.len())
            .field("handle", &self.handle)
            .finish()
    }
}

impl CachedBuf {
    /// Registers `buf` through `cache` (a hit when the same memory was registered before
    /// and is still cached).
    pub fn new(cache: &RegCache, buf: impl Into<Box<[u8]>>) -> Result<CachedBuf> {
        let mut buf: Box<[u8]> = buf.into();
        // SAFETY: the box's memory stays where it is while `buf` lives in the returned
        // value, which drops the handle first; it is reached only through this value
        // (and by the local adapter while a request owns the value), and the handle grants
        // no remote access.
        let handle = unsafe { cache.get_raw(buf.as_mut_ptr(), buf.len(), Access::LOCAL_WRITE) }?;
        Ok(CachedBuf {
            handle,
            buf: Owned {
                buf,
                cache: Some(cache.clone()),
            },
        })
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.buf
    }

    /// The bytes, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.buf
    }

    /// Gives the registration back to the cache and returns the memory.
    pub fn into_inner(self) -> Box<[u8]> {
        let CachedBuf { handle, mut buf } = self;
        drop(handle);
        buf.cache = None;
        std::mem::take(&mut buf.buf)
    }
}

impl OwnedBuf for CachedBuf {
    fn sge(&self) -> Sge {
        Sge {
            addr: self.buf.as_ptr() as u64,
            len: self.buf.len() as u32,
            lkey: self.handle.lkey(),
        }
    }
    fn park(self) -> Parked {
        Parked::Cached(self)
    }
    fn unpark(p: Parked) -> std::result::Result<Self, Parked> {
        match p {
            Parked::Cached(b) => Ok(b),
            other => Err(other),
        }
    }
}

/// Which queue a parked buffer's request was posted to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Side {
    Send,
    Recv,
}

/// The buffers a queue pair holds for requests in flight (`None`: a slot reserved by a
/// post that has not parked its buffer yet).
#[derive(Debug, Default)]
pub(crate) struct Parking {
    slots: Mutex<HashMap<(u64, Side), Option<Parked>>>,
}

impl Parking {
    pub(crate) fn with_capacity(n: usize) -> Parking {
        Parking {
            slots: Mutex::new(HashMap::with_capacity(n)),
        }
    }

    /// Whether a buffer is parked (or a post reserved the slot) for `wr_id` on `side`.
    pub(crate) fn holds(&self, wr_id: u64, side: Side) -> bool {
        self.slots.lock().contains_key(&(wr_id, side))
    }

    /// Reserves the slot of `wr_id` on `side` for a post; false if it is taken.
    pub(crate) fn reserve(&self, wr_id: u64, side: Side) -> bool {
        match self.slots.lock().entry((wr_id, side)) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(None);
                true
            }
        }
    }

    /// Gives back a slot [`reserve`](Self::reserve) took, its post failed.
    pub(crate) fn unreserve(&self, wr_id: u64, side: Side) {
        let mut slots = self.slots.lock();
        if let Some(None) = slots.get(&(wr_id, side)) {
            slots.remove(&(wr_id, side));
        }
    }

    /// Parks `buf` in the slot its post reserved.
    pub(crate) fn park(&self, wr_id: u64, side: Side, buf: Parked) {
        self.slots.lock().insert((wr_id, side), Some(buf));
    }

    /// Takes the buffer parked for `wr_id` on `side`, if it is a `B`.
    pub(crate) fn take<B: OwnedBuf>(&self, wr_id: u64, side: Side) -> Option<B> {
        let mut slots = self.slots.lock();
        let p = slots.remove(&(wr_id, side))?;
        match p.map(B::unpark) {
            Some(Ok(b)) => Some(b),
            Some(Err(p)) => {
                slots.insert((wr_id, side), Some(p));
                None
            }
            None => {
                slots.insert((wr_id, side), None);
                None
            }
        }
    }

    /// Takes every parked buffer (the queue pair is being destroyed).
    pub(crate) fn drain(&self) -> Vec<(u64, Side, Parked)> {
        std::mem::take(&mut *self.slots.lock())
            .into_iter()
            .filter_map(|((w, s), p)| Some((w, s, p?)))
            .collect()
    }
}

/// The receive request of an owned post.
pub(crate) fn recv_wr(wr_id: u64, sge: Sge) -> RecvWr {
    RecvWr {
        wr_id,
        sges: SgeList::from(sge),
    }
}

/// Checks an owned send: signaled (the completion returns the buffer), no other
/// elements, no inline data.
pub(crate) fn check_send(flags: SendFlags, sges: usize) -> Result<()> {
    if !flags.contains(SendFlags::SIGNALED) {
        return Err(Error::InvalidArgument(
            "an owned-buffer request must be signaled: its completion returns the buffer",
        ));
    }
    if sges != 0 || flags.contains(SendFlags::INLINE) {
        return Err(Error::InvalidArgument(
            "an owned-buffer request takes its one element from the buffer",
        ));
    }
    Ok(())
}

/// The queue whose request `c` completes.
pub(crate) fn side_of(c: &Completion) -> Side {
    use rdmx_core::WcOpcode;
    match c.opcode {
        WcOpcode::Recv | WcOpcode::RecvRdmaWithImm => Side::Recv,
        _ => Side::Send,
    }
}
