//! Registration cache: get-or-register for callers that bring plain buffers.
//!
//! Registering memory costs system calls and page-table walks (microseconds to
//! milliseconds); looking a registration up costs tens of nanoseconds. The cache keeps
//! registrations made for plain buffers and hands them out again:
//!
//! - **Lookup** by address range and access, per registrar (one protection domain): a
//!   cached entry that covers the range with at least the access is a hit.
//! - **Handles** are refcounted ([`CacheHandle`]); an entry nobody holds is *idle* and
//!   sits in an LRU bounded by entry count and by bytes ([`CacheConfig`]). Beyond either
//!   bound the least recently used idle entries are deregistered.
//! - **Invalidation**: [`RegCache::invalidate`] drops every entry overlapping a range.
//!   With the [`monitor`], `munmap`, `madvise(MADV_DONTNEED)` and `mremap`
//!   invalidate automatically, and the monitor's protocol guarantees that once `munmap`
//!   returns, no lookup returns the old registration. An entry invalidated while in use
//!   leaves the cache at once and is deregistered when its last handle is dropped.
//!
//! ## When there is no monitor
//!
//! userfaultfd may be unavailable (`vm.unprivileged_userfaultfd=0` without
//! `CAP_SYS_PTRACE`, no access to `/dev/userfaultfd`, seccomp, an old kernel). Then, with
//! [`Invalidation::Auto`], the cache logs a warning once, reports
//! [`Monitoring::Explicit`] from [`RegCache::monitoring`], and relies on the caller to
//! call [`invalidate`](RegCache::invalidate) before memory is unmapped or given back to
//! the system. [`Invalidation::Monitor`] refuses to build a cache without the monitor
//! instead. Memory the monitor cannot watch (file-backed mappings) is registered but not
//! cached: such handles deregister when dropped ([`CacheHandle::is_cached`]).
//!
//! ## After `fork`
//!
//! A forked child inherits the cache but not the monitor's threads, and the monitor's
//! descriptor still serves the parent's memory. In the child the cache therefore caches
//! nothing: every handle is a registration of its own ([`CacheHandle::is_cached`] is
//! false), and [`RegCache::monitoring`] says [`Monitoring::Explicit`].
//!
//! ## Safety of what is handed out
//!
//! A handle's region may be larger than the range asked for (a hit on a larger entry).
//! The safe entry points ([`RegCache::get`], [`RegCache::get_mut`]) therefore grant no
//! remote access, and `get` no write access (they take only an entry with exactly the
//! access they ask for, never one left by `get_raw` with more) and borrow the caller's
//! buffer for the handle's lifetime; remote access
//! to plain buffers goes through the `unsafe` [`RegCache::get_raw`].

use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use slab::Slab;

use crate::access::Access;
use crate::monitor::{self, InvalidationSink, Monitor};
use crate::registrar::{Region, Registrar};
use crate::Error;

/// How the cache learns that memory went away.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Invalidation {
    /// The userfaultfd monitor when available, else explicit invalidation with a warning.
    #[default]
    Auto,
    /// The userfaultfd monitor, or [`RegCache::new`] fails.
    Monitor,
    /// Only [`RegCache::invalidate`]; the caller invalidates before unmapping.
    Explicit,
}

/// How the cache learns that memory went away, as running.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Monitoring {
    /// `munmap`, `madvise` and `mremap` invalidate automatically.
    Userfaultfd,
    /// Only explicit [`RegCache::invalidate`] calls invalidate.
    Explicit,
}

/// Limits and behaviour of a [`RegCache`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct CacheConfig {
    /// Most idle entries kept (default 1024).
    pub max_idle_entries: usize,
    /// Most idle bytes kept registered (default 256 MiB).
    pub max_idle_bytes: usize,
    /// How invalidation works (default [`Invalidation::Auto`]).
    pub invalidation: Invalidation,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            max_idle_entries: 1024,
            max_idle_bytes: 256 << 20,
            invalidation: Invalidation::Auto,
        }
    }
}

impl CacheConfig {
    /// Sets [`max_idle_entries`](Self::max_idle_entries).
    pub fn max_idle_entries(mut self, n: usize) -> Self {
        self.max_idle_entries = n;
        self
    }
    /// Sets [`max_idle_bytes`](Self::max_idle_bytes).
    pub fn max_idle_bytes(mut self, n: usize) -> Self {
        self.max_idle_bytes = n;
        self
    }
    /// Sets [`invalidation`](Self::invalidation).
    pub fn invalidation(mut self, i: Invalidation) -> Self {
        self.invalidation = i;
        self
    }
}

/// Counters of a [`RegCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CacheStats {
    /// Lookups served by a cached entry.
    pub hits: u64,
    /// Lookups that registered.
    pub misses: u64,
    /// Registrations handed out uncached (memory the monitor cannot watch, or
    /// invalidated while being registered).
    pub uncached: u64,
    /// Idle entries deregistered to stay within the limits.
    pub evictions: u64,
    /// Entries removed by invalidation.
    pub invalidations: u64,
    /// Entries cached now.
    pub entries: u64,
    /// Of which idle.
    pub idle_entries: u64,
    /// Bytes of idle entries.
    pub idle_bytes: u64,
}

/// A registration cache over one [`Registrar`]. Cloning shares the cache.
pub struct RegCache<R: Registrar> {
    shared: Arc<Shared<R>>,
}

impl<R: Registrar> Clone for RegCache<R> {
    fn clone(&self) -> Self {
        RegCache {
            shared: self.shared.clone(),
        }
    }
}

impl<R: Registrar> std::fmt::Debug for RegCache<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegCache")
            .field("monitoring", &self.monitoring())
            .field("stats", &self.stats())
            .finish()
    }
}

struct Shared<R: Registrar> {
    registrar: R,
    config: CacheConfig,
    monitor: Option<&'static Monitor>,
    subscription: OnceLock<u64>,
    inner: Mutex<Inner<R>>,
}

struct Entry<R: Registrar> {
    region: Arc<R::Region>,
    start: usize,
    end: usize,
    access: Access,
    refs: usize,
    generation: u64,
    // LRU links, meaningful while refs == 0.
    older: Option<usize>,
    newer: Option<usize>,
    /// Keeps the range watched while the entry is cached (unwatched when it goes, so
    /// that memory areas the kernel split to watch it can join again).
    _watch: Option<monitor::Watched>,
}

struct Inner<R: Registrar> {
    entries: Slab<Entry<R>>,
    by_start: BTreeMap<(usize, usize), ()>,
    longest: usize,
    oldest: Option<usize>,
    newest: Option<usize>,
    idle_entries: usize,
    idle_bytes: usize,
    next_generation: u64,
    /// Misses registering outside the lock: `(start, end, invalidated meanwhile)`.
    in_flight: Slab<(usize, usize, bool)>,
    stats: CacheStats,
}

/// A registration handed out by the cache; gives it back when dropped.
pub struct CacheHandle<R: Registrar> {
    region: Arc<R::Region>,
    slot: Option<(usize, u64)>,
    addr: usize,
    len: usize,
    cache: Arc<Shared<R>>,
}

/// A handle that also borrows the buffer it was made for.
pub struct Borrowed<'a, R: Registrar> {
    handle: CacheHandle<R>,
    _buf: PhantomData<&'a mut [u8]>,
}

impl<R: Registrar> RegCache<R> {
    /// A cache registering through `registrar`.
    pub fn new(registrar: R, config: CacheConfig) -> Result<Self, Error> {
        let monitor = match config.invalidation {
            Invalidation::Explicit => None,
            Invalidation::Monitor => {
                Some(monitor::global().map_err(|e| Error::Registrar(Box::new(e)))?)
            }
            Invalidation::Auto => match monitor::global() {
                Ok(m) => Some(m),
                Err(e) => {
                    warn_once(&e);
                    None
                }
            },
        };
        let shared = Arc::new(Shared {
            registrar,
            subscription: OnceLock::new(),
            monitor,
            config,
            inner: Mutex::new(Inner {
                entries: Slab::new(),
                by_start: BTreeMap::new(),
                longest: 0,
                oldest: None,
                newest: None,
                idle_entries: 0,
                idle_bytes: 0,
                next_generation: 0,
                in_flight: Slab::new(),
                stats: CacheStats::default(),
            }),
        });
        // Subscribed only now that the sink is alive: the monitor prunes entries whose
        // sink cannot be upgraded. Nothing is cached yet, so nothing can be missed.
        if let Some(m) = monitor {
            let _ = shared.subscription.set(m.subscribe(shared.clone()));
        }
        Ok(RegCache { shared })
    }

    /// How invalidation works in this cache.
    pub fn monitoring(&self) -> Monitoring {
        if self.shared.monitor.is_some_and(|m| !m.forked()) {
            Monitoring::Userfaultfd
        } else {
            Monitoring::Explicit
        }
    }

    /// The registrar the cache registers through.
    pub fn registrar(&self) -> &R {
        &self.shared.registrar
    }

    /// Counters and sizes now.
    pub fn stats(&self) -> CacheStats {
        let inner = self.shared.inner.lock();
        CacheStats {
            entries: inner.entries.len() as u64,
            idle_entries: inner.idle_entries as u64,
            idle_bytes: inner.idle_bytes as u64,
            ..inner.stats
        }
    }

    /// A registration of `buf` for local reads (sends and WRITE sources).
    pub fn get<'a>(&self, buf: &'a [u8]) -> Result<Borrowed<'a, R>, Error> {
        // SAFETY: the borrow keeps `buf` alive and unchanged while the handle lives, and
        // the access grants nobody write permission.
        let handle = unsafe { self.lookup(buf.as_ptr(), buf.len(), Access::empty(), true)? };
        Ok(Borrowed {
            handle,
            _buf: PhantomData,
        })
    }

    /// A registration of `buf` that the local adapter may write (receives, READ targets).
    pub fn get_mut<'a>(&self, buf: &'a mut [u8]) -> Result<Borrowed<'a, R>, Error> {
        // SAFETY: the exclusive borrow keeps `buf` alive and out of reach of other Rust
        // code while the handle lives; only the local adapter may write it.
        let handle =
            unsafe { self.lookup(buf.as_mut_ptr(), buf.len(), Access::LOCAL_WRITE, true)? };
        Ok(Borrowed {
            handle,
            _buf: PhantomData,
        })
    }

    /// A registration covering `[addr, addr + len)` with at least `access`.
    ///
    /// # Safety
    ///
    /// The memory must stay mapped while the handle lives, and must not be reached
    /// through Rust references that conflict with `access` meanwhile. The handle's region
    /// may be larger than the range asked for; with remote access flags the whole region
    /// is exposed to whoever holds its rkey while any handle to it lives, and after the
    /// last handle goes for as long as the cache keeps the registration idle (until it is
    /// evicted, or its range invalidated): [`invalidate`](Self::invalidate) the range to
    /// end a peer's access to it.
    pub unsafe fn get_raw(
        &self,
        addr: *const u8,
        len: usize,
        access: Access,
    ) -> Result<CacheHandle<R>, Error> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.lookup(addr, len, access, false) }
    }

    /// [`get_raw`](Self::get_raw); with `exact`, a hit is an entry that grants exactly
    /// `access` (what the safe entry points hand out: a key of theirs given to a peer
    /// must not let it reach memory borrowed as `&[u8]` or `&mut [u8]`, nor a receive
    /// posted with it write memory borrowed as `&[u8]`).
    ///
    /// # Safety
    ///
    /// As for [`get_raw`](Self::get_raw).
    unsafe fn lookup(
        &self,
        addr: *const u8,
        len: usize,
        access: Access,
        exact: bool,
    ) -> Result<CacheHandle<R>, Error> {
        let access = access.validate()?;
        let start = addr as usize;
        let end = match start.checked_add(len) {
            Some(end) if len > 0 => end,
            _ => return Err(Error::InvalidRange { addr: start, len }),
        };
        let shared = &self.shared;
        if shared.monitor.is_some_and(|m| m.forked()) {
            // A forked child: nothing tells this process's copy of the cache what its
            // own memory does, so nothing is cached or looked up here.
            // SAFETY: forwarded from this function's contract.
            // (The cache's lock is not taken: a thread of the parent may have held it.)
            let region = unsafe { shared.registrar.register(addr as *mut u8, len, access) }?;
            return Ok(self.handle(Arc::new(region), None, start, len));
        }
        let mut waited = false;
        let ticket = loop {
            let mut inner = shared.inner.lock();
            let found = inner.find(start, end, access, exact);
            if let Some(m) = shared.monitor.filter(|m| !waited && m.busy()) {
                // Events were read but not applied yet. One may concern a hit, or land on
                // a miss while it registers and make it uncached for nothing. Once the
                // rounds under way are delivered, the next lookup is valid.
                drop(inner);
                m.wait_idle();
                waited = true;
                continue;
            }
            if let Some(index) = found {
                inner.stats.hits += 1;
                let (region, generation) = inner.acquire(index);
                return Ok(self.handle(region, Some((index, generation)), start, len));
            }
            inner.stats.misses += 1;
            break inner.in_flight.insert((start, end, false));
        };

        let watch = shared.monitor.map(|m| m.watch_while(start, len));
        let watched = !matches!(watch, Some(Err(_)));
        let watch = watch.and_then(Result::ok);
        // SAFETY: forwarded from this function's contract.
        let region = match unsafe { shared.registrar.register(addr as *mut u8, len, access) } {
            Err(Error::MemlockLimit(_)) if self.flush() > 0 => {
                // Idle entries held the pinned memory; try once more without them.
                // SAFETY: as above.
                unsafe { shared.registrar.register(addr as *mut u8, len, access) }
            }
            other => other,
        };
        let mut inner = shared.inner.lock();
        let (_, _, invalidated) = inner.in_flight.remove(ticket);
        let region = Arc::new(region?);
        if !watched || invalidated {
            inner.stats.uncached += 1;
            return Ok(self.handle(region, None, start, len));
        }
        let slot = inner.insert(region.clone(), start, end, access, watch);
        Ok(self.handle(region, Some(slot), start, len))
    }

    fn handle(
        &self,
        region: Arc<R::Region>,
        slot: Option<(usize, u64)>,
        addr: usize,
        len: usize,
    ) -> CacheHandle<R> {
        CacheHandle {
            region,
            slot,
            addr,
            len,
            cache: self.shared.clone(),
        }
    }

    /// Removes every entry overlapping `[addr, addr + len)`. Entries in use are
    /// deregistered when their last handle is dropped. Returns how many were removed.
    pub fn invalidate(&self, addr: usize, len: usize) -> usize {
        self.shared.invalidate(addr, addr.saturating_add(len))
    }

    /// Deregisters every idle entry. Returns how many.
    pub fn flush(&self) -> usize {
        let evicted = {
            let mut inner = self.shared.inner.lock();
            inner.evict_while(|_| true)
        };
        evicted.len()
    }
}

impl<R: Registrar> Shared<R> {
    fn invalidate(&self, start: usize, end: usize) -> usize {
        let removed = {
            let mut inner = self.inner.lock();
            for (_, (s, e, hit)) in inner.in_flight.iter_mut() {
                *hit |= *e > start && *s < end;
            }
            let from = start.saturating_sub(inner.longest);
            let hits: Vec<usize> = inner
                .by_start
                .range((from, 0)..(end, 0))
                .map(|(&(_, index), _)| index)
                .filter(|&i| {
                    let e = &inner.entries[i];
                    e.end > start && e.start < end
                })
                .collect();
            let regions: Vec<Arc<R::Region>> = hits.into_iter().map(|i| inner.remove(i)).collect();
            inner.stats.invalidations += regions.len() as u64;
            regions
        };
        // Regions are dropped (deregistered) here, outside the lock.
        removed.len()
    }

    fn put(&self, slot: (usize, u64)) -> Vec<Arc<R::Region>> {
        let mut inner = self.inner.lock();
        let (index, generation) = slot;
        let Some(entry) = inner.entries.get_mut(index) else {
            return Vec::new();
        };
        if entry.generation != generation {
            // Invalidated while in use; the handle's region goes with the handle.
            return Vec::new();
        }
        entry.refs -= 1;
        if entry.refs > 0 {
            return Vec::new();
        }
        inner.push_idle(index);
        let (max_n, max_b) = (self.config.max_idle_entries, self.config.max_idle_bytes);
        inner.evict_while(|i| i.idle_entries > max_n || i.idle_bytes > max_b)
    }
}

impl<R: Registrar> InvalidationSink for Shared<R> {
    fn invalidate(&self, start: usize, end: usize) {
        Shared::invalidate(self, start, end);
    }
}

impl<R: Registrar> Drop for Shared<R> {
    fn drop(&mut self) {
        if let (Some(m), Some(&id)) = (self.monitor, self.subscription.get()) {
            m.unsubscribe(id);
        }
    }
}

impl<R: Registrar> Inner<R> {
    /// An entry covering `[start, end)` with at least `access`, and exactly `access`
    /// when `exact`.
    fn find(&self, start: usize, end: usize, access: Access, exact: bool) -> Option<usize> {
        let from = start.saturating_sub(self.longest);
        self.by_start
            .range((from, 0)..=(start, usize::MAX))
            .rev()
            .map(|(&(_, index), _)| index)
            .find(|&i| {
                let e = &self.entries[i];
                e.end >= end && e.access.contains(access) && (!exact || e.access == access)
            })
    }

    fn acquire(&mut self, index: usize) -> (Arc<R::Region>, u64) {
        if self.entries[index].refs == 0 {
            self.unlink_idle(index);
        }
        let e = &mut self.entries[index];
        e.refs += 1;
        (e.region.clone(), e.generation)
    }

    fn insert(
        &mut self,
        region: Arc<R::Region>,
        start: usize,
        end: usize,
        access: Access,
        watch: Option<monitor::Watched>,
    ) -> (usize, u64) {
        let generation = self.next_generation;
        self.next_generation += 1;
        let index = self.entries.insert(Entry {
            region,
            start,
            end,
            access,
            refs: 1,
            generation,
            older: None,
            newer: None,
            _watch: watch,
        });
        self.by_start.insert((start, index), ());
        self.longest = self.longest.max(end - start);
        (index, generation)
    }

    fn remove(&mut self, index: usize) -> Arc<R::Region> {
        if self.entries[index].refs == 0 {
            self.unlink_idle(index);
        }
        let e = self.entries.remove(index);
        self.by_start.remove(&(e.start, index));
        e.region
    }

    fn push_idle(&mut self, index: usize) {
        let newest = self.newest;
        let e = &mut self.entries[index];
        e.older = newest;
        e.newer = None;
        self.idle_entries += 1;
        self.idle_bytes += e.end - e.start;
        match newest {
            Some(n) => self.entries[n].newer = Some(index),
            None => self.oldest = Some(index),
        }
        self.newest = Some(index);
    }

    fn unlink_idle(&mut self, index: usize) {
        let (older, newer, bytes) = {
            let e = &mut self.entries[index];
            (e.older.take(), e.newer.take(), e.end - e.start)
        };
        match older {
            Some(o) => self.entries[o].newer = newer,
            None => self.oldest = newer,
        }
        match newer {
            Some(n) => self.entries[n].older = older,
            None => self.newest = older,
        }
        self.idle_entries -= 1;
        self.idle_bytes -= bytes;
    }

    /// Evicts the oldest idle entries while `over` holds; returns their regions so the
    /// caller drops them outside the lock.
    fn evict_while(&mut self, over: impl Fn(&Self) -> bool) -> Vec<Arc<R::Region>> {
        let mut out = Vec::new();
        while over(self) {
            let Some(index) = self.oldest else { break };
            out.push(self.remove(index));
            self.stats.evictions += 1;
        }
        out
    }
}

impl<R: Registrar> CacheHandle<R> {
    /// The registered region (it may cover more than [`addr`](Self::addr)..+[`len`](Self::len)).
    pub fn region(&self) -> &R::Region {
        &self.region
    }
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.region.lkey()
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.region.rkey()
    }
    /// Start of the range asked for.
    pub fn addr(&self) -> usize {
        self.addr
    }
    /// Length of the range asked for.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Always false: empty ranges are refused.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Whether the registration is cached (false: it is deregistered when dropped).
    pub fn is_cached(&self) -> bool {
        self.slot.is_some()
    }
}

impl<R: Registrar> Drop for CacheHandle<R> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot {
            let evicted = self.cache.put(slot);
            drop(evicted);
        }
    }
}

impl<R: Registrar> std::fmt::Debug for CacheHandle<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheHandle")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("lkey", &format_args!("{:#010x}", self.lkey()))
            .field("cached", &self.is_cached())
            .finish()
    }
}

impl<R: Registrar> std::ops::Deref for Borrowed<'_, R> {
    type Target = CacheHandle<R>;
    fn deref(&self) -> &CacheHandle<R> {
        &self.handle
    }
}

impl<R: Registrar> std::fmt::Debug for Borrowed<'_, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.handle.fmt(f)
    }
}

fn warn_once(e: &monitor::Unavailable) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        tracing::warn!(
            "registration cache without automatic invalidation: {e}; \
             call RegCache::invalidate before unmapping cached memory"
        )
    });
}
