//! Registration cache: hits, misses, invalidation (explicit and by munmap/madvise/mremap),
//! eviction limits and many threads at once.

use std::ptr;

use std::sync::Arc;

use rdmx_mem::cache::{CacheConfig, Invalidation, Monitoring, RegCache};

use rdmx_mem::{Access, Error, Pinning, Region};

mod common;

use common::Counting;

fn cache(config: CacheConfig) -> (RegCache<Counting>, Counting) {
    let r = Counting::with_pinning(Pinning::Pinned);
    (RegCache::new(r.clone(), config).unwrap(), r)
}

fn page() -> usize {
    rdmx_mem::sys::page_size()
}

/// Anonymous memory that the test unmaps itself.
fn map(len: usize, at: Option<usize>) -> Option<*mut u8> {
    let (hint, flags) = match at {
        Some(a) => (a as *mut libc::c_void, libc::MAP_FIXED_NOREPLACE),
        None => (ptr::null_mut(), 0),
    };
    // SAFETY: anonymous mapping; MAP_FIXED_NOREPLACE never replaces an existing mapping.
    let p = unsafe {
        libc::mmap(
            hint,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED || at.is_some_and(|a| p as usize != a) {
        return None;
    }
    Some(p.cast())
}

fn unmap(p: *mut u8, len: usize) {
    // SAFETY: `p` came from `map` with this length and nothing references it any more.
    assert_eq!(unsafe { libc::munmap(p.cast(), len) }, 0);
}

#[test]
fn hit_needs_cover_and_access() {
    let (c, live) = cache(CacheConfig::default().invalidation(Invalidation::Explicit));
    let buf = vec![0u8; 4 * page()];
    let p = buf.as_ptr();
    // SAFETY: `buf` outlives every handle (dropped at the end of each statement).
    let h = unsafe { c.get_raw(p, 2 * page(), Access::REMOTE_READ) }.unwrap();
    assert!(h.is_cached());
    let key = h.lkey();
    drop(h);
    // SAFETY: as above.
    unsafe {
        assert_eq!(
            c.get_raw(p, 2 * page(), Access::REMOTE_READ)
                .unwrap()
                .lkey(),
            key
        );
        assert_eq!(
            c.get_raw(p.add(10), 100, Access::empty()).unwrap().lkey(),
            key
        );
        assert_ne!(
            c.get_raw(p, 3 * page(), Access::REMOTE_READ)
                .unwrap()
                .lkey(),
            key
        );
        let rw = Access::LOCAL_WRITE | Access::REMOTE_READ;
        assert_ne!(c.get_raw(p, page(), rw).unwrap().lkey(), key);
    }
    let s = c.stats();
    assert_eq!((s.hits, s.misses), (2, 3));
    assert_eq!(s.entries, 3);
    assert_eq!(s.idle_entries, 3);
    assert_eq!(live.live().len(), 3);
    // Invalid requests fail cleanly.
    // SAFETY: nothing is registered for invalid input.
    unsafe {
        assert!(matches!(
            c.get_raw(p, 0, Access::empty()),
            Err(Error::InvalidRange { .. })
        ));
        assert!(matches!(
            c.get_raw(usize::MAX as *const u8, 2, Access::empty()),
            Err(Error::InvalidRange { .. })
        ));
        assert!(matches!(
            c.get_raw(p, 8, Access::REMOTE_WRITE),
            Err(Error::InvalidAccess(_))
        ));
    }
}

#[test]
fn safe_entry_points_borrow_the_buffer() {
    let (c, _) = cache(CacheConfig::default().invalidation(Invalidation::Explicit));
    let mut buf = vec![0u8; 1000];
    let first = c.get(&buf).unwrap().lkey();
    assert_eq!(c.get(&buf[100..200]).unwrap().lkey(), first);
    let w = c.get_mut(&mut buf).unwrap();
    assert!(w.region().access().contains(Access::LOCAL_WRITE));
    assert_eq!(w.len(), 1000);
}

/// An idle entry that grants more than the safe entry points ask for (left by
/// `get_raw`) is never what they hand out: its rkey, given to a peer, would reach memory
/// the caller borrows as `&[u8]` or `&mut [u8]`, and a receive posted with a writable
/// entry's key would write memory borrowed as `&[u8]`. They register anew instead.
#[test]
fn safe_entry_points_never_take_an_entry_with_more_access() {
    let (c, live) = cache(CacheConfig::default().invalidation(Invalidation::Explicit));
    let mut buf = vec![0u8; 4 * page()];
    let remote = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    // SAFETY: `buf` outlives the handle, dropped at once; nothing else references it.
    let key = unsafe { c.get_raw(buf.as_ptr(), buf.len(), remote) }
        .unwrap()
        .lkey();
    for access in [
        Access::REMOTE_READ,
        Access::REMOTE_ATOMIC | Access::LOCAL_WRITE,
    ] {
        // SAFETY: as above.
        drop(unsafe { c.get_raw(buf.as_ptr(), 64, access) }.unwrap());
    }
    let r = c.get(&buf[..100]).unwrap();
    assert_ne!(r.lkey(), key, "get took an entry with remote access");
    assert!(r.region().access().is_empty(), "{:?}", r.region().access());
    drop(r);
    // A writable entry, left by `get_mut`, is not what `get` takes either.
    let w = c.get_mut(&mut buf[200..300]).unwrap().lkey();
    let r = c.get(&buf[200..300]).unwrap();
    assert_ne!(r.lkey(), w, "get took a writable entry");
    drop(r);
    let w = c.get_mut(&mut buf[..100]).unwrap();
    assert_ne!(w.lkey(), key, "get_mut took an entry with remote access");
    assert_eq!(w.region().access(), Access::LOCAL_WRITE);
    drop(w);
    // `get_raw` still hits the entry with remote access.
    // SAFETY: as above.
    let again = unsafe { c.get_raw(buf.as_ptr(), 100, remote) }.unwrap();
    assert_eq!(again.lkey(), key);
    drop(again);
    assert_eq!(live.live().len(), 7);
}

#[test]
fn explicit_invalidate_removes_overlapping_entries_only() {
    let (c, live) = cache(CacheConfig::default().invalidation(Invalidation::Explicit));
    let buf = vec![0u8; 8 * page()];
    let p = buf.as_ptr();
    // SAFETY: `buf` outlives every handle.
    let (a, b) = unsafe {
        (
            c.get_raw(p, page(), Access::empty()).unwrap().lkey(),
            c.get_raw(p.add(4 * page()), page(), Access::empty())
                .unwrap()
                .lkey(),
        )
    };
    assert_eq!(c.invalidate(p as usize + page() / 2, 10), 1);
    // SAFETY: as above.
    unsafe {
        assert_ne!(c.get_raw(p, page(), Access::empty()).unwrap().lkey(), a);
        assert_eq!(
            c.get_raw(p.add(4 * page()), page(), Access::empty())
                .unwrap()
                .lkey(),
            b
        );
    }
    assert_eq!(c.stats().invalidations, 1);
    assert_eq!(live.live().len(), 2);
}

#[test]
fn entry_invalidated_in_use_retires_when_last_user_lets_go() {
    let (c, live) = cache(CacheConfig::default().invalidation(Invalidation::Explicit));
    let buf = vec![0u8; page()];
    // SAFETY: `buf` outlives the handles.
    let h1 = unsafe { c.get_raw(buf.as_ptr(), 64, Access::empty()) }.unwrap();
    // SAFETY: as above.
    let h2 = unsafe { c.get_raw(buf.as_ptr(), 64, Access::empty()) }.unwrap();
    assert_eq!(h1.lkey(), h2.lkey());
    assert_eq!(c.invalidate(buf.as_ptr() as usize, 1), 1);
    assert_eq!(c.stats().entries, 0);
    // Still registered: two users hold it.
    assert_eq!(live.live().len(), 1);
    // SAFETY: as above.
    let fresh = unsafe { c.get_raw(buf.as_ptr(), 64, Access::empty()) }.unwrap();
    assert_ne!(fresh.lkey(), h1.lkey());
    drop(h1);
    assert_eq!(live.live().len(), 2);
    drop(h2);
    assert_eq!(live.live().len(), 1);
    drop(fresh);
    assert_eq!(c.stats().idle_entries, 1);
}

#[test]
fn eviction_honours_count_limit_in_lru_order() {
    let (c, live) = cache(
        CacheConfig::default()
            .invalidation(Invalidation::Explicit)
            .max_idle_entries(4),
    );
    let buf = vec![0u8; 16 * page()];
    let at = |i: usize| buf.as_ptr().wrapping_add(i * page());
    let mut keys = Vec::new();
    for i in 0..10 {
        // SAFETY: `buf` outlives every handle.
        keys.push(
            unsafe { c.get_raw(at(i), 64, Access::empty()) }
                .unwrap()
                .lkey(),
        );
        let s = c.stats();
        assert!(s.idle_entries <= 4, "{s:?}");
    }
    let s = c.stats();
    assert_eq!((s.idle_entries, s.evictions), (4, 6));
    assert_eq!(live.live().len(), 4);
    // The four most recent survive; the oldest were evicted.
    // SAFETY: as above.
    unsafe {
        assert_eq!(
            c.get_raw(at(9), 64, Access::empty()).unwrap().lkey(),
            keys[9]
        );
        assert_ne!(
            c.get_raw(at(0), 64, Access::empty()).unwrap().lkey(),
            keys[0]
        );
    }
}

#[test]
fn eviction_honours_byte_limit() {
    let limit = 5 * page();
    let (c, _) = cache(
        CacheConfig::default()
            .invalidation(Invalidation::Explicit)
            .max_idle_bytes(limit),
    );
    let buf = vec![0u8; 64 * page()];
    let mut off = 0;
    for len in [page(), 2 * page(), 3 * page(), page(), 4 * page(), page()] {
        // SAFETY: `buf` outlives every handle.
        drop(unsafe { c.get_raw(buf.as_ptr().add(off), len, Access::empty()) }.unwrap());
        off += len;
        let s = c.stats();
        assert!(s.idle_bytes as usize <= limit, "{s:?}");
    }
    let s = c.stats();
    assert!(s.evictions >= 3, "{s:?}");
    // Entries in use are never evicted, whatever their size.
    // SAFETY: as above.
    let big = unsafe { c.get_raw(buf.as_ptr().add(off), 10 * page(), Access::empty()) }.unwrap();
    assert!(big.is_cached());
    assert_eq!(c.stats().entries - c.stats().idle_entries, 1);
}

#[test]
fn many_threads_get_and_put_at_once() {
    let (c, live) = cache(
        CacheConfig::default()
            .invalidation(Invalidation::Explicit)
            .max_idle_entries(8),
    );
    let buf = Arc::new(vec![0u8; 32 * page()]);
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let (c, buf) = (c.clone(), buf.clone());
            std::thread::spawn(move || {
                let mut held = Vec::new();
                for i in 0..2000usize {
                    let slot = (i * 7 + t * 3) % 24;
                    let len = page() * (1 + (i + t) % 4);
                    let p = buf.as_ptr().wrapping_add(slot * page());
                    // SAFETY: `buf` outlives every handle (joined below).
                    let h = unsafe { c.get_raw(p, len, Access::empty()) }.unwrap();
                    assert!(h.region().covers(p as usize, len));
                    if i % 5 == 0 {
                        held.push(h);
                    }
                    if i % 50 == 0 {
                        c.invalidate(p as usize, page());
                    }
                    if held.len() > 6 {
                        held.remove(0);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let s = c.stats();
    assert_eq!(s.entries, s.idle_entries, "{s:?}");
    assert!(s.idle_entries <= 8);
    assert_eq!(live.live().len() as u64, s.entries);
    assert_eq!(s.hits + s.misses, 16_000);
}

#[test]
fn munmap_then_mmap_at_same_address_never_returns_stale_registration() {
    let (c, live) = cache(CacheConfig::default().invalidation(Invalidation::Monitor));
    assert_eq!(c.monitoring(), Monitoring::Userfaultfd);
    let len = 16 * page();
    let mut rounds = 0;
    // Other tests map memory too; keep going until the address came back 100 times.
    for i in 0..5000 {
        if rounds == 100 {
            break;
        }
        let p = map(len, None).unwrap();
        // SAFETY: the mapping lives until the explicit unmap below; handles are dropped
        // (or kept on purpose in odd rounds, which is safe for a pin-only registrar that
        // never touches the bytes) before it.
        let h = unsafe { c.get_raw(p, len, Access::LOCAL_WRITE) }.unwrap();
        assert!(h.is_cached());
        let old = h.lkey();
        let held = if i % 2 == 0 {
            drop(h);
            None
        } else {
            Some(h)
        };
        unmap(p, len);
        // Map the same address again: nothing else may have taken it meanwhile.
        let Some(q) = map(len, Some(p as usize)) else {
            continue;
        };
        rounds += 1;
        // SAFETY: `q` stays mapped until unmapped below, after the handle is dropped.
        let h = unsafe { c.get_raw(q, len, Access::LOCAL_WRITE) }.unwrap();
        assert_ne!(h.lkey(), old, "stale registration returned in round {i}");
        drop(h);
        drop(held);
        unmap(q, len);
    }
    assert_eq!(rounds, 100, "the address came back only {rounds} times");
    // Lookups wait for delivered events by themselves; reading the counters does not.
    rdmx_mem::monitor::global().unwrap().wait_idle();
    let s = c.stats();
    assert!(s.invalidations >= 2 * rounds as u64, "{s:?}");
    assert_eq!(s.hits, 0, "{s:?}");
    assert_eq!(live.live().len() as u64, s.entries);
}

/// Memory areas (lines of `/proc/self/maps`) that overlap `[start, start + len)`.
fn areas(start: usize, len: usize) -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter_map(|l| {
            let (a, b) = l.split_once(' ')?.0.split_once('-')?;
            Some((
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            ))
        })
        .filter(|&(a, b)| a < start + len && start < b)
        .count()
}

/// Entries that go unwatch their pages: a mapping whose every other page was registered
/// and evicted in turn is one memory area again, not split at each page the kernel
/// watched (which, with enough buffers, ends at `vm.max_map_count` and refused `mmap`s).
#[test]
fn evicted_entries_unwatch_their_pages() {
    let r = Counting::with_pinning(Pinning::Unpinned);
    let config = CacheConfig::default()
        .invalidation(Invalidation::Monitor)
        .max_idle_entries(2);
    let c = RegCache::new(r, config).unwrap();
    let pages = 64;
    let p = map(pages * page(), None).unwrap();
    // Touched, so that the kernel has no reason of its own to keep pages apart.
    // SAFETY: the test's own mapping, which nothing else references.
    unsafe { ptr::write_bytes(p, 1, pages * page()) };
    assert_eq!(areas(p as usize, pages * page()), 1);
    for i in (0..pages).step_by(2) {
        // SAFETY: the mapping outlives the handle, dropped at once.
        drop(unsafe { c.get_raw(p.add(i * page()), 8, Access::empty()) }.unwrap());
    }
    let split = areas(p as usize, pages * page());
    assert!(split > 1, "watching split nothing ({split} areas)");
    c.flush();
    assert_eq!(c.stats().entries, 0);
    assert_eq!(
        areas(p as usize, pages * page()),
        1,
        "the pages stayed watched after their entries went ({split} areas while cached)"
    );
    unmap(p, pages * page());
}

#[test]
fn madvise_dontneed_invalidates_unpinned_entries() {
    let r = Counting::with_pinning(Pinning::Unpinned);
    let c = RegCache::new(
        r,
        CacheConfig::default().invalidation(Invalidation::Monitor),
    )
    .unwrap();
    let len = 8 * page();
    let p = map(len, None).unwrap();
    // SAFETY: mapped until the end of the test.
    let old = unsafe { c.get_raw(p, len, Access::empty()) }
        .unwrap()
        .lkey();
    // SAFETY: advising our own mapping.
    let rc = unsafe { libc::madvise(p.cast(), page(), libc::MADV_DONTNEED) };
    assert_eq!(rc, 0);
    // SAFETY: mapped until the end of the test.
    let new = unsafe { c.get_raw(p, len, Access::empty()) }
        .unwrap()
        .lkey();
    assert_ne!(new, old);
    assert!(c.stats().invalidations >= 1);
    unmap(p, len);
}

#[test]
fn mremap_invalidates_the_old_range() {
    let (c, live) = cache(CacheConfig::default().invalidation(Invalidation::Monitor));
    let len = 4 * page();
    let p = map(len, None).unwrap();
    let target = map(len, None).unwrap();
    // SAFETY: mapped until moved below.
    drop(unsafe { c.get_raw(p, len, Access::empty()) }.unwrap());
    assert_eq!(c.stats().entries, 1);
    // SAFETY: moving our own mapping onto another of ours.
    let q = unsafe {
        libc::mremap(
            p.cast(),
            len,
            len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            target.cast::<libc::c_void>(),
        )
    };
    assert_eq!(q, target.cast());
    rdmx_mem::monitor::global().unwrap().wait_idle();
    let s = c.stats();
    assert!(s.invalidations >= 1, "{s:?}");
    assert_eq!(s.entries, 0, "{s:?}");
    assert_eq!(live.live().len(), 0);
    unmap(q.cast(), len);
}

#[test]
fn unwatchable_memory_is_registered_but_not_cached() {
    let (c, live) = cache(CacheConfig::default().invalidation(Invalidation::Monitor));
    let file = std::env::temp_dir().join(format!("rdmx-cache-{}", std::process::id()));
    std::fs::write(&file, vec![1u8; 2 * page()]).unwrap();
    let f = std::fs::File::open(&file).unwrap();
    use std::os::fd::AsRawFd;
    // SAFETY: a private read-only mapping of our own file.
    let p = unsafe {
        libc::mmap(
            ptr::null_mut(),
            2 * page(),
            libc::PROT_READ,
            libc::MAP_PRIVATE,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    // SAFETY: mapped until unmapped below, after the handle is dropped.
    let h = unsafe { c.get_raw(p.cast(), 2 * page(), Access::empty()) }.unwrap();
    assert!(!h.is_cached());
    assert_eq!(live.live().len(), 1);
    drop(h);
    assert_eq!(live.live().len(), 0);
    assert_eq!(c.stats().uncached, 1);
    unmap(p.cast(), 2 * page());
    std::fs::remove_file(file).unwrap();
}

/// Replaces `[p, p + len)` (inside a reservation of the caller's) with a fresh anonymous
/// mapping, readable and writable or inaccessible. Replacing a watched range unmaps it
/// and the calling thread waits until the monitor has read the event, like `munmap`.
fn map_fixed(p: usize, len: usize, rw: bool) {
    let prot = if rw {
        libc::PROT_READ | libc::PROT_WRITE
    } else {
        libc::PROT_NONE
    };
    // SAFETY: the range lies inside a reservation the calling thread owns; nothing
    // references it but pin-only registrations, which never touch the bytes.
    let q = unsafe {
        libc::mmap(
            p as *mut libc::c_void,
            len,
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    assert_eq!(q as usize, p, "mmap(MAP_FIXED) failed");
}

#[test]
fn many_threads_unmap_and_remap_while_entries_are_in_use() {
    // Threads map, register, unmap (often while still holding handles to the entry) and
    // map the same addresses again, all at once, with ranges that overlap earlier ones
    // partly, so invalidations from the monitor race with lookups, inserts and
    // retirements on other threads. Each thread works inside an address window of its
    // own, reserved with PROT_NONE, and "unmaps" by mapping PROT_NONE over the range: its
    // unmap has returned before it looks the address up again, which is the ordering the
    // monitor's protocol relies on (see `rdmx_mem::monitor`). Whatever the interleaving, a
    // lookup after a remap never returns a registration made before it, and once every
    // handle is gone the only live registrations are the cache's idle entries.
    let (c, live) = cache(CacheConfig::default().invalidation(Invalidation::Monitor));
    assert_eq!(c.monitoring(), Monitoring::Userfaultfd);
    const WINDOW: usize = 64;
    let threads: Vec<_> = (0..4usize)
        .map(|t| {
            let c = c.clone();
            std::thread::spawn(move || {
                let w = map(WINDOW * page(), None).unwrap() as usize;
                map_fixed(w, WINDOW * page(), false);
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ t as u64;
                let mut rnd = |n: usize| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % n as u64) as usize
                };
                let mut held = Vec::new();
                for i in 0..400usize {
                    let pages = 1 + rnd(8);
                    let p = w + rnd(WINDOW - pages + 1) * page();
                    let len = pages * page();
                    map_fixed(p, len, true);
                    // SAFETY: the range stays mapped until replaced below; handles kept
                    // past that are safe for a pin-only registrar, which never touches
                    // the bytes.
                    let h = unsafe { c.get_raw(p as *const u8, len, Access::LOCAL_WRITE) }.unwrap();
                    assert!(h.region().covers(p, len));
                    let old = h.lkey();
                    // A second user of part of the range while the first holds it.
                    // SAFETY: as above.
                    let h2 = unsafe { c.get_raw(p as *const u8, len / 2 + 1, Access::LOCAL_WRITE) }
                        .unwrap();
                    assert!(h2.region().covers(p, len / 2 + 1));
                    if i % 3 != 0 {
                        held.push((h, h2));
                    }
                    if held.len() > 4 {
                        held.remove(rnd(held.len()));
                    }
                    map_fixed(p, len, false);
                    map_fixed(p, len, true);
                    // SAFETY: as above.
                    let h = unsafe { c.get_raw(p as *const u8, len, Access::LOCAL_WRITE) }.unwrap();
                    assert_ne!(h.lkey(), old, "thread {t} round {i}: stale registration");
                    assert!(h.region().covers(p, len));
                    drop(h);
                    map_fixed(p, len, false);
                }
                drop(held);
                unmap(w as *mut u8, WINDOW * page());
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    rdmx_mem::monitor::global().unwrap().wait_idle();
    let s = c.stats();
    assert_eq!(s.entries, s.idle_entries, "{s:?}");
    assert_eq!(live.live().len() as u64, s.entries, "{s:?}");
    assert!(s.invalidations >= 4 * 400, "{s:?}");
    assert_eq!(s.entries, 0, "every range was unmapped: {s:?}");
    drop(c);
    assert_eq!(live.live().len(), 0, "registrations outlived the cache");
}

#[test]
fn caches_created_concurrently_all_receive_invalidations() {
    // Each cache subscribes to the monitor while other threads create and drop caches
    // and unmap watched memory; every one of them must hear about its own unmap.
    let threads: Vec<_> = (0..4)
        .map(|t| {
            std::thread::spawn(move || {
                for i in 0..300 {
                    let (c, _live) =
                        cache(CacheConfig::default().invalidation(Invalidation::Monitor));
                    let len = page();
                    let p = map(len, None).unwrap();
                    // SAFETY: mapped until the unmap below; the handle is dropped first.
                    let cached = unsafe { c.get_raw(p, len, Access::empty()) }
                        .unwrap()
                        .is_cached();
                    unmap(p, len);
                    rdmx_mem::monitor::global().unwrap().wait_idle();
                    let s = c.stats();
                    // Not cached when another thread's late unmap of the same address
                    // raced with the registration; that is conservative, not a miss.
                    if cached {
                        assert_eq!(s.invalidations, 1, "thread {t} cache {i}: {s:?}");
                    }
                    assert_eq!(s.entries, 0, "thread {t} cache {i}: {s:?}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

/// A forked child's copy of the cache caches nothing, and dropping it (its entries with
/// it) leaves the parent's memory watched: the parent still learns when the memory goes.
/// (The monitor's descriptor serves the parent's memory, whoever calls it.)
#[test]
fn a_forked_child_caches_nothing_and_leaves_the_parent_s_memory_watched() {
    let r = Counting::with_pinning(Pinning::Unpinned);
    let config = CacheConfig::default().invalidation(Invalidation::Monitor);
    let c = RegCache::new(r, config).unwrap();
    let len = 4 * page();
    let p = map(len, None).unwrap();
    // SAFETY: `p` stays mapped until unmapped below, after the handle is dropped.
    drop(unsafe { c.get_raw(p, len, Access::empty()) }.unwrap());
    assert_eq!(c.stats().entries, 1);
    // SAFETY: the child only uses the cache (no lock another thread may hold), then
    // leaves with `_exit`, running nothing of the parent's.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let code = if c.monitoring() != Monitoring::Explicit {
            2
        } else {
            // SAFETY: as in the parent.
            match unsafe { c.get_raw(p, len, Access::empty()) } {
                Ok(h) if h.is_cached() => 3,
                Ok(_) => 0,
                Err(_) => 4,
            }
        };
        drop(c);
        // SAFETY: ends the child at once.
        unsafe { libc::_exit(code) };
    }
    let start = std::time::Instant::now();
    let status = loop {
        let mut status = 0;
        // SAFETY: waits for the test's own child without blocking.
        match unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } {
            0 if start.elapsed() < std::time::Duration::from_secs(20) => {
                std::thread::sleep(std::time::Duration::from_millis(10))
            }
            0 => {
                // SAFETY: the test's own child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                panic!("the forked child hung");
            }
            _ => break status,
        }
    };
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child failed: {status:#x} (2: it said the monitor works there; 3: it cached)"
    );
    unmap(p, len);
    rdmx_mem::monitor::global().unwrap().wait_idle();
    assert_eq!(
        c.stats().entries,
        0,
        "the parent's unmap went unseen: the child unwatched its memory"
    );
}
