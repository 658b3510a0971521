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
    fn byte_len(&self) -> usize;
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
    fn byte_len(&self) -> usize {
        self.len()
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
        check_len(buf.len())?;
        let remote = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
        let mut handle = None;
        for _ in 0..2 {
            // SAFETY: the box's memory stays where it is while `buf` lives in the returned
            // value, which drops the handle first; it is reached only through this value
            // (and by the local adapter while a request owns the value), and the handle
            // grants no remote access (checked below).
            let h = unsafe { cache.get_raw(buf.as_mut_ptr(), buf.len(), Access::LOCAL_WRITE) }?;
            if !rdmx_mem::Region::access(h.region()).intersects(remote) {
                handle = Some(h);
                break;
            }
            // A cached registration that grants remote access covers this memory (an idle
            // one, left by an earlier registration of it for remote use): a peer holding its
            // rkey could change the bytes the slices give out. It goes, and the memory is
            // registered anew, for local access only.
            drop(h);
            cache.invalidate(buf.as_ptr() as usize, buf.len());
        }
        let handle = handle.ok_or(Error::InvalidArgument(
            "the memory is registered for remote access by a registration in use",
        ))?;
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
    fn byte_len(&self) -> usize {
        self.buf.len()
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

/// Request ids rdmx keeps for its own requests: an owned-buffer request goes to the
/// provider under one of these, and its completion comes back with the id it was posted
/// with. Posts naming one ([`QueuePair::post_send`](crate::QueuePair::post_send) and the
/// rest, owned ones included) are refused, so that no other request's completion can be
/// taken for an owned request's and give its buffer back while the provider still
/// reaches it.
pub const RESERVED_WR_IDS: std::ops::RangeInclusive<u64> =
    0xfffe_0000_0000_0000..=0xfffe_ffff_ffff_ffff;
const RESERVED_MASK: u64 = 0xffff << 48;
/// The ids of the async API's operations: this and the operation's slot.
#[cfg_attr(not(feature = "tokio"), allow(dead_code))]
pub(crate) const ASYNC_IDS: u64 = *RESERVED_WR_IDS.start() | 1 << 47;
#[cfg_attr(not(feature = "tokio"), allow(dead_code))]
const ASYNC_MASK: u64 = RESERVED_MASK | 1 << 47;

/// Whether `wr_id` is one of [`RESERVED_WR_IDS`].
pub(crate) fn is_reserved(wr_id: u64) -> bool {
    wr_id & RESERVED_MASK == *RESERVED_WR_IDS.start()
}

/// Bits of an async operation's id that name its slot; the 23 above them hold the
/// slot's generation, so that an id names one use of a slot and a late completion of an
/// earlier use (a queue pair destroyed with the request in flight, its QP number reused
/// on hardware) is never taken for a later operation's.
#[cfg_attr(not(feature = "tokio"), allow(dead_code))]
pub(crate) const ASYNC_SLOT_BITS: u32 = 24;

/// The id of an async operation in slot `slot` (below 2^[`ASYNC_SLOT_BITS`]), use `gen`.
#[cfg_attr(not(feature = "tokio"), allow(dead_code))]
pub(crate) fn async_id(slot: usize, gen: u32) -> u64 {
    debug_assert!(slot < 1 << ASYNC_SLOT_BITS);
    let gen = u64::from(gen) & ((1 << (47 - ASYNC_SLOT_BITS)) - 1);
    ASYNC_IDS | gen << ASYNC_SLOT_BITS | slot as u64
}

/// The async operation's slot `wr_id` names, if it names one.
#[cfg_attr(not(feature = "tokio"), allow(dead_code))]
pub(crate) fn async_slot(wr_id: u64) -> Option<usize> {
    (wr_id & ASYNC_MASK == ASYNC_IDS).then_some((wr_id & ((1 << ASYNC_SLOT_BITS) - 1)) as usize)
}

/// Refuses a request id the application may not post ([`RESERVED_WR_IDS`]).
pub(crate) fn check_wr_id(wr_id: u64) -> Result<()> {
    if is_reserved(wr_id) {
        return Err(Error::InvalidArgument(
            "request ids 0xfffe_0000_0000_0000 to 0xfffe_ffff_ffff_ffff are rdmx's own \
             (RESERVED_WR_IDS)",
        ));
    }
    Ok(())
}

/// The buffers a queue pair holds for requests in flight, by the id they were posted with
/// and their queue, each with the reserved id it went to the provider under (`buf` `None`:
/// a slot reserved by a post that has not parked its buffer yet).
#[derive(Debug, Default)]
pub(crate) struct Parking {
    slots: Mutex<HashMap<(u64, Side), Slot>>,
    /// The next reserved id of an owned request posted through the blocking API.
    next: std::sync::atomic::AtomicU64,
}

#[derive(Debug)]
struct Slot {
    /// The id the provider has.
    id: u64,
    buf: Option<Parked>,
}

impl Parking {
    pub(crate) fn with_capacity(n: usize) -> Parking {
        Parking {
            slots: Mutex::new(HashMap::with_capacity(n)),
            next: Default::default(),
        }
    }

    /// A reserved id for an owned request posted through the blocking API (one not seen
    /// before on this queue pair until 2^47 more such posts).
    pub(crate) fn fresh_id(&self) -> u64 {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        *RESERVED_WR_IDS.start() | (n & ((1 << 47) - 1))
    }

    /// The id the provider has for the request posted as `wr_id` on `side`, if a buffer
    /// is parked (or a post reserved the slot) for it.
    pub(crate) fn holds(&self, wr_id: u64, side: Side) -> Option<u64> {
        self.slots.lock().get(&(wr_id, side)).map(|s| s.id)
    }

    /// Reserves the slot of `wr_id` on `side` for a post that gives the provider `id`;
    /// false if it is taken.
    pub(crate) fn reserve(&self, wr_id: u64, side: Side, id: u64) -> bool {
        match self.slots.lock().entry((wr_id, side)) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(Slot { id, buf: None });
                true
            }
        }
    }

    /// Gives back a slot [`reserve`](Self::reserve) took, its post failed.
    pub(crate) fn unreserve(&self, wr_id: u64, side: Side) {
        let mut slots = self.slots.lock();
        if let Some(Slot { buf: None, .. }) = slots.get(&(wr_id, side)) {
            slots.remove(&(wr_id, side));
        }
    }

    /// Parks `buf` in the slot its post reserved.
    pub(crate) fn park(&self, wr_id: u64, side: Side, buf: Parked) {
        if let Some(slot) = self.slots.lock().get_mut(&(wr_id, side)) {
            slot.buf = Some(buf);
        }
    }

    /// Takes the buffer parked for `wr_id` on `side`, if it is a `B`.
    pub(crate) fn take<B: OwnedBuf>(&self, wr_id: u64, side: Side) -> Option<B> {
        let mut slots = self.slots.lock();
        let slot = slots.get_mut(&(wr_id, side))?;
        match slot.buf.take().map(B::unpark) {
            Some(Ok(b)) => {
                slots.remove(&(wr_id, side));
                Some(b)
            }
            Some(Err(p)) => {
                slot.buf = Some(p);
                None
            }
            None => None,
        }
    }

    /// Takes every parked buffer (the queue pair is being destroyed), with the id the
    /// provider had for its request.
    pub(crate) fn drain(&self) -> Vec<(u64, Side, Parked)> {
        std::mem::take(&mut *self.slots.lock())
            .into_iter()
            .filter_map(|((_, side), slot)| Some((slot.id, side, slot.buf?)))
            .collect()
    }
}

/// Refuses an owned buffer of `len` bytes, longer than one scatter/gather element takes
/// (its `sge` would name only the length's low 32 bits).
pub(crate) fn check_len(len: usize) -> Result<()> {
    if u32::try_from(len).is_err() {
        return Err(Error::InvalidArgument(
            "an owned buffer is at most 4 GiB - 1 (one scatter/gather element)",
        ));
    }
    Ok(())
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
