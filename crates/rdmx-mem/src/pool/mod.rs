//! Registered-buffer pools: slabs registered once through a [`Registrar`], carved into
//! size-class buffers and handed out as owned [`PoolBuf`] handles that return themselves
//! on drop.
//!
//! # Design
//!
//! - **Slabs.** A pool maps a slab (an anonymous [`Mapping`], optionally hugepage-backed),
//!   registers it once and cuts it into buffers of one size class. Every buffer of a slab
//!   carries that slab's lkey and rkey. Slabs are never deregistered while the pool lives;
//!   [`PoolConfig::max_bytes`] caps the bytes registered.
//! - **Thread caches.** Each thread keeps, per pool and per class, a *magazine* of free
//!   buffers. [`BufferPool::get`] pops from the calling thread's magazine and dropping a
//!   [`PoolBuf`] pushes onto the dropping thread's magazine: neither takes a lock nor
//!   touches memory written by other threads. Only when a magazine runs empty (a *miss*)
//!   or overflows does a thread lock the class's shared free list and move half a magazine
//!   at a time. A magazine holds at most [`PoolConfig::thread_cache`] buffers, and never
//!   more than one slab's worth, so big classes do not hoard memory per thread.
//! - **Exhaustion.** Buffers idle in other threads' magazines cannot be taken from them.
//!   When a `get` fails with [`Error::PoolExhausted`], the pool enters a *pressure* mode in
//!   which dropped buffers (and the dropping thread's magazine of that class) go straight
//!   back to the shared free list, so buffers released anywhere become available again.
//!   The mode ends when a miss finds the shared list well stocked again.
//!   [`BufferPool::flush_local`] returns the calling thread's cached buffers explicitly.
//!
//! # Lifetime
//!
//! Slabs live as long as the pool's shared state, which lives while any [`BufferPool`]
//! handle, any [`PoolBuf`] or any thread cache of the pool lives. A `PoolBuf` therefore
//! never points at freed memory, whichever thread drops it and whenever the pool handles
//! are dropped. Each region is dropped (deregistered) before its mapping is unmapped.
//!
//! When the last `BufferPool` handle is dropped the pool is *closed*: the dropping
//! thread's cache is released at once, buffers dropped later go back to the shared list,
//! and a thread exiting releases its caches. A thread that holds a cache of a closed pool
//! and stays idle keeps that pool's memory registered until it touches any pool again
//! (creating a cache purges caches of closed pools), drops one of the closed pool's
//! buffers, or exits.
//!
//! # Access and slices
//!
//! With any remote flag in [`PoolConfig::access`], a peer holding the slab's rkey may read
//! or write a buffer at any time, so Rust references to its bytes would be unsound; such
//! pools offer only the copying accessors [`PoolBuf::read_at`] and [`PoolBuf::write_at`].
//! When the access has no remote flag (it is a subset of [`Access::LOCAL_WRITE`]), only
//! work requests posted by this process can touch the memory, and
//! [`PoolBuf::as_slice`] / [`PoolBuf::as_mut_slice`] are available. Posting a work request
//! on a buffer is then the poster's promise not to hold such a slice until it completes
//! (an upper layer does this by taking the `PoolBuf` for the duration of the operation).

use std::any::Any;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::access::Access;
use crate::mapping::{Backing, HugePages, Mapping};
use crate::registrar::{Region, Registrar};
use crate::Error;

mod buf;
mod thread_cache;

pub use buf::{OutOfBounds, PoolBuf};

use thread_cache::{with_local, with_locals, Parts, ThreadPart};

/// How a [`BufferPool`] is laid out. Build it from [`PoolConfig::default`] and the
/// `with_*` setters.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolConfig {
    /// Buffer sizes in bytes, strictly increasing and non-zero. A request gets the smallest
    /// class that fits. Default: powers of two from 4 KiB to 4 MiB.
    pub classes: Vec<usize>,
    /// Bytes per slab, rounded down to a whole number of buffers of the slab's class; a slab
    /// always holds at least one buffer. Default: 4 MiB.
    pub slab_bytes: usize,
    /// Access flags every slab is registered with. Default: [`Access::LOCAL_WRITE`].
    pub access: Access,
    /// Whether slabs ask for huge pages. Default: [`HugePages::Off`].
    pub hugepages: HugePages,
    /// Whether slabs are memfd-backed ([`Mapping::shared`]), so that a provider may hand
    /// them to a peer process to map (the shm provider's `mapped` data path, when the
    /// access has remote rights); `hugepages` is then ignored. Default: false.
    pub shared: bool,
    /// Buffers each thread may cache per class; also capped to one slab's worth of buffers.
    /// 0 disables thread caching (every get and drop takes the class lock). Default: 64.
    pub thread_cache: usize,
    /// Upper bound on bytes registered by the pool; `get` fails with
    /// [`Error::PoolExhausted`] when a new slab would exceed it. Default: no bound.
    pub max_bytes: Option<usize>,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            classes: (12..=22).map(|shift| 1usize << shift).collect(),
            slab_bytes: 4 << 20,
            access: Access::LOCAL_WRITE,
            hugepages: HugePages::Off,
            shared: false,
            thread_cache: 64,
            max_bytes: None,
        }
    }
}

impl PoolConfig {
    /// Sets the size classes.
    pub fn with_classes(mut self, classes: impl Into<Vec<usize>>) -> Self {
        self.classes = classes.into();
        self
    }

    /// Sets the slab size.
    pub fn with_slab_bytes(mut self, slab_bytes: usize) -> Self {
        self.slab_bytes = slab_bytes;
        self
    }

    /// Sets the access flags.
    pub fn with_access(mut self, access: Access) -> Self {
        self.access = access;
        self
    }

    /// Sets the hugepage preference.
    pub fn with_hugepages(mut self, hugepages: HugePages) -> Self {
        self.hugepages = hugepages;
        self
    }

    /// Sets [`shared`](Self::shared).
    pub fn with_shared(mut self, shared: bool) -> Self {
        self.shared = shared;
        self
    }

    /// Sets the per-thread, per-class cache size in buffers.
    pub fn with_thread_cache(mut self, buffers: usize) -> Self {
        self.thread_cache = buffers;
        self
    }

    /// Sets the cap on registered bytes (`None`: unbounded).
    pub fn with_max_bytes(mut self, max_bytes: Option<usize>) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    fn validate(&self) -> Result<(), InvalidPoolConfig> {
        let first = *self.classes.first().ok_or(InvalidPoolConfig::NoClasses)?;
        if first == 0 {
            return Err(InvalidPoolConfig::ZeroClass);
        }
        for w in self.classes.windows(2) {
            if w[0] >= w[1] {
                return Err(InvalidPoolConfig::Unsorted {
                    prev: w[0],
                    next: w[1],
                });
            }
        }
        Ok(())
    }
}

/// A [`PoolConfig`] whose size classes cannot work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidPoolConfig {
    /// No size classes at all.
    #[error("invalid pool configuration: no size classes")]
    NoClasses,
    /// A size class of 0 bytes.
    #[error("invalid pool configuration: a size class of 0 bytes")]
    ZeroClass,
    /// Classes out of order or repeated.
    #[error(
        "invalid pool configuration: size classes must strictly increase, got {prev} then {next}"
    )]
    Unsorted {
        /// The earlier class.
        prev: usize,
        /// The class that does not exceed it.
        next: usize,
    },
}

// Until `Error` has a variant of its own for this, the configuration error travels boxed.
/// Counters of a pool, summed over all threads when [`BufferPool::stats`] is called.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Gets served from the calling thread's cache.
    pub hits: u64,
    /// Gets that found the thread cache empty and went to the shared free list or a new
    /// slab.
    pub misses: u64,
    /// Slabs registered.
    pub slabs: u64,
    /// Bytes registered (sum of slab lengths).
    pub bytes_registered: u64,
    /// The weakest backing among the slabs (`None` before the first slab).
    pub backing: Option<Backing>,
    /// Buffers on the shared free lists (not counting those cached by threads).
    pub shared_free: u64,
    /// Threads that currently hold a cache of this pool.
    pub thread_caches: u64,
    /// Gets that failed with [`Error::PoolExhausted`].
    pub exhausted: u64,
}

/// A pool of registered buffers in size classes. Cheap to clone (all clones share one
/// pool); `Send + Sync`. See the [module documentation](self) for the design.
pub struct BufferPool<R: Registrar> {
    inner: Arc<Handle<R>>,
}

impl<R: Registrar> Clone for BufferPool<R> {
    fn clone(&self) -> Self {
        BufferPool {
            inner: self.inner.clone(),
        }
    }
}

impl<R: Registrar> std::fmt::Debug for BufferPool<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferPool")
            .field("id", &self.inner.shared.id)
            .field("classes", &self.inner.sizes)
            .field("access", &self.inner.shared.access)
            .finish_non_exhaustive()
    }
}

/// What the user's handles share; dropping it closes the pool.
struct Handle<R: Registrar> {
    shared: Arc<Shared>,
    registrar: Arc<R>,
    sizes: Box<[usize]>,
    /// `log2(sizes[0])` when the classes are consecutive powers of two (the default):
    /// the class of a length is then computed instead of searched.
    pow2_shift: Option<u32>,
    hugepages: HugePages,
    shared_memory: bool,
}

impl<R: Registrar> Handle<R> {
    /// Index of the smallest class that holds `len` bytes.
    #[inline]
    fn class_of(&self, len: usize) -> Option<usize> {
        let class = match self.pow2_shift {
            Some(_) if len <= self.sizes[0] => 0,
            Some(shift) => (usize::BITS - (len - 1).leading_zeros() - shift) as usize,
            None => self.sizes.partition_point(|&size| size < len),
        };
        (class < self.sizes.len()).then_some(class)
    }
}

fn pow2_shift(sizes: &[usize]) -> Option<u32> {
    let shift = sizes[0].trailing_zeros();
    let consecutive = sizes.iter().enumerate().all(|(i, &size)| {
        size.is_power_of_two() && u64::from(size.trailing_zeros()) == u64::from(shift) + i as u64
    });
    consecutive.then_some(shift)
}

impl<R: Registrar> Drop for Handle<R> {
    fn drop(&mut self) {
        self.shared.state.fetch_or(CLOSED, Ordering::Relaxed);
        // Release this thread's cache now; other threads release theirs lazily.
        let id = self.shared.id;
        with_locals(|t| {
            if let Some(local) = t.take(id) {
                t.bury(local);
            }
        });
    }
}

impl<R: Registrar> BufferPool<R> {
    /// Creates an empty pool; slabs are registered on demand.
    ///
    /// Fails when the access flags break the verbs rule ([`Error::InvalidAccess`]) or the
    /// size classes are empty, contain 0 or do not strictly increase
    /// ([`InvalidPoolConfig`], currently carried as [`Error::Registrar`]).
    pub fn new(registrar: R, config: PoolConfig) -> Result<Self, Error> {
        let access = config.access.validate()?;
        config.validate().map_err(Error::from)?;
        let classes = config
            .classes
            .iter()
            .map(|&size| ClassState::new(size, &config))
            .collect();
        let registrar = Arc::new(registrar);
        let shared = Arc::new(Shared {
            id: ids::alloc(),
            state: AtomicU8::new(0),
            access,
            classes,
            parts: Mutex::new(Parts::default()),
            reserved: AtomicUsize::new(0),
            max_bytes: config.max_bytes,
            exhausted: AtomicU64::new(0),
            slabs: Mutex::new(Vec::new()),
            _registrar: registrar.clone(),
        });
        Ok(BufferPool {
            inner: Arc::new(Handle {
                shared,
                registrar,
                pow2_shift: pow2_shift(&config.classes),
                sizes: config.classes.into_boxed_slice(),
                hugepages: config.hugepages,
                shared_memory: config.shared,
            }),
        })
    }

    /// A buffer of the smallest class that holds `len` bytes, with [`PoolBuf::len`] set
    /// to `len`. `len == 0` is allowed and gets the smallest class.
    ///
    /// The contents are whatever the previous user left (zeroes for a fresh slab).
    /// Fails with [`Error::TooLarge`] above the largest class, [`Error::PoolExhausted`]
    /// when a new slab would exceed [`PoolConfig::max_bytes`], and with mapping or
    /// registration errors when a slab cannot be made.
    #[inline]
    pub fn get(&self, len: usize) -> Result<PoolBuf<R>, Error> {
        let h = &*self.inner;
        let Some(class) = h.class_of(len) else {
            return Err(Error::TooLarge {
                len,
                max: h.sizes[h.sizes.len() - 1],
            });
        };
        let size = h.sizes[class];
        let fast = with_local(h.shared.id, |local| {
            let slot = local.mags[class].slots.pop()?;
            local.part.hit();
            Some((local.part.clone(), slot))
        })
        .flatten();
        let (part, slot) = match fast {
            Some(got) => got,
            None => self.get_slow(class)?,
        };
        Ok(PoolBuf::new(part, slot, class, size, len))
    }

    #[cold]
    fn get_slow(&self, class: usize) -> Result<(Arc<ThreadPart>, Slot), Error> {
        let shared = &self.inner.shared;
        let c = &shared.classes[class];
        // Through this thread's cache: count the miss, refill the magazine from the shared
        // list and take one.
        let cached = with_locals(|t| {
            let local = t.get_or_create(shared);
            local.part.miss();
            let mag = &mut local.mags[class];
            shared.refill(class, &mut mag.slots, c.batch);
            (local.part.clone(), mag.slots.pop())
        });
        let part = match cached {
            Some((part, Some(slot))) => return Ok((part, slot)),
            Some((part, None)) => part,
            // No usable thread cache (thread exiting, or re-entered from a registrar):
            // serve this one get without one.
            None => {
                shared.parts.lock().retired_misses += 1;
                ThreadPart::new(shared.clone())
            }
        };
        let mut slots = self.obtain(class)?;
        let slot = slots.pop().expect("obtain returns at least one buffer");
        // Keep up to a batch in this thread's magazine, the rest goes to the shared list.
        with_local(shared.id, |local| {
            let mag = &mut local.mags[class];
            let room = (c.batch - 1).min(c.cap.saturating_sub(mag.slots.len()));
            let from = slots.len().saturating_sub(room);
            mag.slots.extend(slots.drain(from..));
        });
        if !slots.is_empty() {
            shared.put_back(class, slots.drain(..));
        }
        Ok((part, slot))
    }

    /// Buffers for an empty magazine: a batch from the shared list if another thread
    /// refilled it meanwhile, else a new slab. Growth of one class is serialised so
    /// concurrent misses do not each register a slab.
    fn obtain(&self, class: usize) -> Result<Vec<Slot>, Error> {
        let shared = &self.inner.shared;
        let c = &shared.classes[class];
        let _grow = c.grow.lock();
        let mut slots = Vec::new();
        shared.refill(class, &mut slots, c.batch);
        if !slots.is_empty() {
            return Ok(slots);
        }
        self.add_slab(class)
    }

    fn add_slab(&self, class: usize) -> Result<Vec<Slot>, Error> {
        let h = &*self.inner;
        let shared = &h.shared;
        let c = &shared.classes[class];
        let len = c.size * c.per_slab;
        shared.reserve(len)?;
        let mapping = if h.shared_memory {
            Mapping::shared(len)
        } else {
            Mapping::with_hugepages(len, h.hugepages)
        };
        // The registration owns the mapping: it stays mapped for as long as anything
        // uses the registration (a provider placing a peer's bytes), not only while the
        // slab lives. The bytes are reached only through `PoolBuf`s: the copying accessors
        // for any access, references only when no remote flag is set, and then the one
        // owner of a buffer holds them (see the module documentation on access).
        let made = mapping.and_then(|mapping| {
            let (base, backing) = (mapping.as_ptr(), mapping.backing());
            let region = h.registrar.register_mapping(mapping, shared.access)?;
            debug_assert!(region.covers(base as usize, len));
            Ok((base, backing, region))
        });
        let (base, backing, region) = match made {
            Ok(made) => made,
            Err(err) => {
                shared.reserved.fetch_sub(len, Ordering::Relaxed);
                return Err(err);
            }
        };
        let base = base as usize;
        let (lkey, rkey) = (region.lkey(), region.rkey());
        // Reversed so that pops hand out ascending addresses.
        let slots = (0..c.per_slab)
            .rev()
            .map(|i| Slot {
                addr: base + i * c.size,
                lkey,
                rkey,
            })
            .collect();
        shared.slabs.lock().push(SlabEntry {
            len,
            backing,
            _slab: Box::new(region),
        });
        Ok(slots)
    }

    /// Current counters; see [`PoolStats`].
    pub fn stats(&self) -> PoolStats {
        let shared = &self.inner.shared;
        let mut stats = PoolStats {
            exhausted: shared.exhausted.load(Ordering::Relaxed),
            ..PoolStats::default()
        };
        {
            let parts = shared.parts.lock();
            stats.hits = parts.retired_hits;
            stats.misses = parts.retired_misses;
            stats.thread_caches = parts.live.len() as u64;
            for part in &parts.live {
                let (hits, misses) = part.counts();
                stats.hits += hits;
                stats.misses += misses;
            }
        }
        {
            let slabs = shared.slabs.lock();
            stats.slabs = slabs.len() as u64;
            stats.bytes_registered = slabs.iter().map(|s| s.len as u64).sum();
            stats.backing = slabs.iter().map(|s| s.backing).min_by_key(|&b| rank(b));
        }
        stats.shared_free = shared
            .classes
            .iter()
            .map(|c| c.free.lock().len() as u64)
            .sum();
        stats
    }

    /// Returns the buffers the calling thread caches for this pool to the shared free
    /// lists, so that other threads can use them.
    pub fn flush_local(&self) {
        let shared = &self.inner.shared;
        with_local(shared.id, |local| {
            for (class, mag) in local.mags.iter_mut().enumerate() {
                shared.put_back(class, mag.slots.drain(..));
            }
        });
    }

    /// The size classes in bytes, ascending.
    pub fn classes(&self) -> &[usize] {
        &self.inner.sizes
    }

    /// The access flags every buffer of this pool is registered with.
    pub fn access(&self) -> Access {
        self.inner.shared.access
    }

    /// The registrar the pool registers slabs with.
    pub fn registrar(&self) -> &R {
        &self.inner.registrar
    }
}

/// Orders backings from weakest to strongest.
fn rank(b: Backing) -> u8 {
    match b {
        Backing::Normal => 0,
        Backing::TransparentHuge => 1,
        Backing::HugeTlb => 2,
    }
}

/// A free buffer: plain data; the memory it names is kept alive by [`Shared`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Slot {
    addr: usize,
    lkey: u32,
    rkey: u32,
}

/// The last `BufferPool` handle is gone: no get can happen any more.
const CLOSED: u8 = 1;
/// A get failed with `PoolExhausted`: dropped buffers bypass the thread caches.
const PRESSURE: u8 = 2;

/// The pool state shared by handles, thread caches and buffers. Not generic: the thread
/// caches of all pools live in one thread-local table. The slabs and the registrar are
/// owned type-erased.
struct Shared {
    id: usize,
    state: AtomicU8,
    access: Access,
    classes: Box<[ClassState]>,
    parts: Mutex<Parts>,
    reserved: AtomicUsize,
    max_bytes: Option<usize>,
    exhausted: AtomicU64,
    // Declared before the registrar: regions are dropped before what registered them.
    slabs: Mutex<Vec<SlabEntry>>,
    _registrar: Arc<dyn Any + Send + Sync>,
}

impl Shared {
    fn is_closed(&self) -> bool {
        self.state.load(Ordering::Relaxed) & CLOSED != 0
    }

    /// Moves up to `batch` buffers of `class` from the shared list into `into`.
    fn refill(&self, class: usize, into: &mut Vec<Slot>, batch: usize) {
        let mut free = self.classes[class].free.lock();
        if self.state.load(Ordering::Relaxed) & PRESSURE != 0 && free.len() >= 2 * batch {
            self.state.fetch_and(!PRESSURE, Ordering::Relaxed);
        }
        let from = free.len().saturating_sub(batch);
        into.extend(free.drain(from..));
    }

    fn put_back(&self, class: usize, slots: impl Iterator<Item = Slot>) {
        self.classes[class].free.lock().extend(slots);
    }

    /// Reserves `len` registered bytes under `max_bytes`.
    fn reserve(&self, len: usize) -> Result<(), Error> {
        let mut cur = self.reserved.load(Ordering::Relaxed);
        loop {
            let next = match (cur.checked_add(len), self.max_bytes) {
                (Some(next), Some(limit)) if next <= limit => next,
                (Some(next), None) => next,
                (_, limit) => {
                    self.exhausted.fetch_add(1, Ordering::Relaxed);
                    self.state.fetch_or(PRESSURE, Ordering::Relaxed);
                    return Err(Error::PoolExhausted {
                        limit: limit.unwrap_or(usize::MAX),
                    });
                }
            };
            match self.reserved.compare_exchange_weak(
                cur,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(()),
                Err(actual) => cur = actual,
            }
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // No thread cache refers to this id any more: each holds the Shared alive.
        ids::free(self.id);
    }
}

/// One size class: its geometry and shared free list.
#[repr(align(64))]
struct ClassState {
    size: usize,
    per_slab: usize,
    /// Magazine capacity per thread.
    cap: usize,
    /// Buffers moved per refill: half a magazine, at least one.
    batch: usize,
    free: Mutex<Vec<Slot>>,
    grow: Mutex<()>,
}

impl ClassState {
    fn new(size: usize, config: &PoolConfig) -> Self {
        let per_slab = (config.slab_bytes / size).max(1);
        let cap = config.thread_cache.min(per_slab);
        ClassState {
            size,
            per_slab,
            cap,
            batch: (cap / 2).max(1),
            free: Mutex::new(Vec::new()),
            grow: Mutex::new(()),
        }
    }
}

struct SlabEntry {
    len: usize,
    backing: Backing,
    _slab: Box<dyn Any + Send + Sync>,
}

/// Process-unique small pool ids, reused only after a pool's shared state is gone (so no
/// thread cache can still be filed under a reused id).
mod ids {
    use parking_lot::Mutex;

    struct Ids {
        next: usize,
        free: Vec<usize>,
    }

    static IDS: Mutex<Ids> = Mutex::new(Ids {
        next: 0,
        free: Vec::new(),
    });

    pub(super) fn alloc() -> usize {
        let mut ids = IDS.lock();
        match ids.free.pop() {
            Some(id) => id,
            None => {
                ids.next += 1;
                ids.next - 1
            }
        }
    }

    pub(super) fn free(id: usize) {
        IDS.lock().free.push(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{PinOnly, Pinning};

    fn pool(classes: Vec<usize>) -> BufferPool<PinOnly> {
        let config = PoolConfig::default().with_classes(classes);
        BufferPool::new(PinOnly::new(Pinning::Unpinned), config).unwrap()
    }

    #[test]
    fn computed_class_matches_search() {
        for classes in [
            PoolConfig::default().classes,
            vec![1, 2, 4, 8],
            vec![64],
            vec![1 << 20, 1 << 21, 1 << 22],
        ] {
            let pool = pool(classes.clone());
            assert!(pool.inner.pow2_shift.is_some(), "{classes:?}");
            let mut lens = vec![0, 1, 2, 3, usize::MAX, usize::MAX - 1, usize::MAX / 2 + 1];
            for &c in &classes {
                lens.extend([c - 1, c, c + 1, c * 2 - 1, c * 2, c * 2 + 1]);
            }
            for len in lens {
                let searched = classes.partition_point(|&size| size < len);
                let want = (searched < classes.len()).then_some(searched);
                assert_eq!(pool.inner.class_of(len), want, "len {len} in {classes:?}");
            }
        }
    }

    #[test]
    fn only_consecutive_powers_of_two_are_computed() {
        assert_eq!(pow2_shift(&[4096, 8192]), Some(12));
        assert_eq!(pow2_shift(&[1]), Some(0));
        assert_eq!(pow2_shift(&[64, 256]), None);
        assert_eq!(pow2_shift(&[48, 96]), None);
        assert_eq!(pow2_shift(&[100]), None);
        assert_eq!(pow2_shift(&[1 << 62, 1 << 63]), Some(62));
    }
}
