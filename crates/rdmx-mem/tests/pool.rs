//! Registered-buffer pools: class selection, keys, thread caches, exhaustion, lifetime.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use rdmx_mem::pool::{BufferPool, OutOfBounds, PoolBuf, PoolConfig};

use rdmx_mem::{Access, Backing, Error, HugePages, Mapping, PinOnly, Pinning, Registrar};

mod common;

use common::{Counting, UNMAPPED_BEFORE_DEREGISTER};

fn unpinned() -> PinOnly {
    PinOnly::new(Pinning::Unpinned)
}

fn small() -> PoolConfig {
    PoolConfig::default()
        .with_classes([64, 256, 1024, 4096])
        .with_slab_bytes(16 << 10)
        .with_thread_cache(8)
}

fn fill<R: Registrar>(buf: &mut PoolBuf<R>, byte: u8) {
    let data = vec![byte; buf.len()];
    buf.write_at(0, &data).unwrap();
}

fn holds<R: Registrar>(buf: &PoolBuf<R>, byte: u8) -> bool {
    let mut data = vec![!byte; buf.len()];
    buf.read_at(0, &mut data).unwrap();
    data.iter().all(|&b| b == byte)
}

#[test]
fn get_picks_the_smallest_class_that_fits() {
    let pool = BufferPool::new(unpinned(), small()).unwrap();
    for (len, cap) in [
        (0, 64),
        (1, 64),
        (64, 64),
        (65, 256),
        (256, 256),
        (257, 1024),
        (4095, 4096),
        (4096, 4096),
    ] {
        let buf = pool.get(len).unwrap();
        assert_eq!((buf.len(), buf.capacity()), (len, cap), "get({len})");
        assert_eq!(buf.is_empty(), len == 0);
    }
    match pool.get(4097) {
        Err(Error::TooLarge {
            len: 4097,
            max: 4096,
        }) => {}
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert!(matches!(
        pool.get(usize::MAX),
        Err(Error::TooLarge { max: 4096, .. })
    ));
}

#[test]
fn default_classes_are_powers_of_two_from_4k_to_4m() {
    let config = PoolConfig::default();
    let want: Vec<usize> = (12..=22).map(|s| 1 << s).collect();
    assert_eq!(config.classes, want);
    assert_eq!(config.access, Access::LOCAL_WRITE);
    let pool = BufferPool::new(unpinned(), config).unwrap();
    assert_eq!(pool.get(4 << 20).unwrap().capacity(), 4 << 20);
    assert_eq!(pool.get(3000).unwrap().capacity(), 4096);
    assert!(matches!(
        pool.get((4 << 20) + 1),
        Err(Error::TooLarge { .. })
    ));
}

#[test]
fn invalid_configurations_are_rejected() {
    let msg = |config: PoolConfig| match BufferPool::new(unpinned(), config) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("accepted"),
    };
    assert!(msg(small().with_classes(Vec::new())).contains("no size classes"));
    assert!(msg(small().with_classes([0, 64])).contains("0 bytes"));
    assert!(msg(small().with_classes([256, 64])).contains("256 then 64"));
    assert!(msg(small().with_classes([64, 64])).contains("64 then 64"));
    assert!(matches!(
        BufferPool::new(unpinned(), small().with_access(Access::REMOTE_WRITE)),
        Err(Error::InvalidAccess(_))
    ));
    assert!(BufferPool::new(unpinned(), small().with_classes([1])).is_ok());
}

#[test]
fn buffer_keys_are_those_of_its_slab_region() {
    let reg = Counting::new();
    let pool = BufferPool::new(reg.clone(), small().with_access(Access::ALL)).unwrap();
    // Several slabs per class: 16 KiB slabs of 64..4096-byte buffers.
    let mut bufs = Vec::new();
    for i in 0..200 {
        bufs.push(pool.get([10, 200, 1000, 4000][i % 4]).unwrap());
    }
    let live = reg.live();
    assert!(live.len() > 4, "{} regions", live.len());
    assert_eq!(pool.stats().slabs, live.len() as u64);
    let mut addrs = HashSet::new();
    for buf in &bufs {
        let r = reg.region_of(buf);
        assert_eq!((buf.lkey(), buf.rkey()), (r.lkey, r.rkey), "{buf:?}");
        assert_ne!(buf.lkey(), buf.rkey());
        assert_eq!(buf.access(), Access::ALL);
        assert!(addrs.insert(buf.addr()), "{buf:?} handed out twice");
    }
}

#[test]
fn drop_then_get_on_one_thread_reuses_the_buffer_and_counts() {
    let pool = BufferPool::new(unpinned(), small()).unwrap();
    let empty = pool.stats();
    assert_eq!((empty.hits, empty.misses, empty.slabs), (0, 0, 0));
    assert_eq!((empty.bytes_registered, empty.backing), (0, None));

    let a = pool.get(100).unwrap();
    let addr = a.addr();
    let s = pool.stats();
    assert_eq!(
        (s.hits, s.misses, s.slabs, s.bytes_registered),
        (0, 1, 1, 16 << 10)
    );
    assert_eq!(s.thread_caches, 1);
    drop(a);
    let b = pool.get(200).unwrap();
    assert_eq!(
        b.addr(),
        addr,
        "most recently freed buffer comes back first"
    );
    let s = pool.stats();
    assert_eq!((s.hits, s.misses, s.slabs), (1, 1, 1));

    // Other classes have their own slabs.
    let c = pool.get(4096).unwrap();
    let s = pool.stats();
    assert_eq!(
        (s.hits, s.misses, s.slabs, s.bytes_registered),
        (1, 2, 2, 32 << 10)
    );
    drop((b, c));
}

#[test]
fn magazines_spill_and_refill_through_the_shared_list() {
    // 64-byte class: 256 buffers per 16 KiB slab; magazine of 8, batches of 4.
    let pool = BufferPool::new(unpinned(), small()).unwrap();
    let bufs: Vec<_> = (0..100).map(|_| pool.get(64).unwrap()).collect();
    assert_eq!(pool.stats().slabs, 1);
    let free_before = pool.stats().shared_free;
    assert!(free_before <= 256 - 100, "{free_before}");
    drop(bufs);
    // All but at most a magazine's worth went back to the shared list.
    let s = pool.stats();
    assert!((248..256).contains(&s.shared_free), "{s:?}");
    pool.flush_local();
    assert_eq!(pool.stats().shared_free, 256);
}

#[test]
fn thread_cache_zero_disables_caching() {
    let pool = BufferPool::new(unpinned(), small().with_thread_cache(0)).unwrap();
    for _ in 0..10 {
        drop(pool.get(64).unwrap());
    }
    let s = pool.stats();
    assert_eq!((s.hits, s.misses), (0, 10));
    assert_eq!(s.shared_free, 256);
}

#[test]
fn eight_threads_never_share_a_buffer() {
    const THREADS: usize = 8;
    const ROUNDS: usize = 1500;
    let pool = BufferPool::new(unpinned(), small()).unwrap();
    let out: Arc<Mutex<HashSet<usize>>> = Arc::default();
    let gets = Arc::new(AtomicUsize::new(0));
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..THREADS)
        .map(|_| mpsc::channel::<(PoolBuf<PinOnly>, u8)>())
        .unzip();
    let mut handles = Vec::new();
    for (t, rx) in receivers.into_iter().enumerate() {
        let pool = pool.clone();
        let out = out.clone();
        let gets = gets.clone();
        let next = senders[(t + 1) % THREADS].clone();
        handles.push(thread::spawn(move || {
            let check_and_drop = |buf: PoolBuf<PinOnly>, byte: u8| {
                assert!(holds(&buf, byte), "buffer {buf:?} lost pattern {byte}");
                assert!(out.lock().unwrap().remove(&buf.addr()));
                drop(buf);
            };
            let mut held = std::collections::VecDeque::new();
            for i in 0..ROUNDS {
                let len = [1, 64, 100, 300, 1024, 2000, 4096][(i * 7 + t) % 7];
                let mut buf = pool.get(len).unwrap();
                gets.fetch_add(1, Ordering::Relaxed);
                assert!(
                    out.lock().unwrap().insert(buf.addr()),
                    "{buf:?} handed out twice"
                );
                let byte = (t * 31 + i) as u8;
                if i % 2 == 0 {
                    buf.as_mut_slice().unwrap().fill(byte);
                } else {
                    fill(&mut buf, byte);
                }
                held.push_back((buf, byte));
                if held.len() > 6 {
                    let (buf, byte) = held.pop_front().unwrap();
                    if i % 3 == 0 {
                        // Verified and dropped by the next thread.
                        assert!(holds(&buf, byte));
                        next.send((buf, byte)).unwrap();
                    } else {
                        check_and_drop(buf, byte);
                    }
                }
                while let Ok((buf, byte)) = rx.try_recv() {
                    check_and_drop(buf, byte);
                }
            }
            for (buf, byte) in held {
                check_and_drop(buf, byte);
            }
            drop(next);
            drop(pool);
            for (buf, byte) in rx {
                check_and_drop(buf, byte);
            }
        }));
    }
    drop(senders);
    for h in handles {
        h.join().unwrap();
    }
    assert!(out.lock().unwrap().is_empty());
    let s = pool.stats();
    assert_eq!(
        s.hits + s.misses,
        gets.load(Ordering::Relaxed) as u64,
        "{s:?}"
    );
    assert_eq!(s.thread_caches, 0, "exited threads released their caches");
    assert!(s.hits > s.misses, "{s:?}");
}

#[test]
fn buffer_dropped_on_another_thread_is_reused() {
    // One buffer in all: a 4 KiB class in 4 KiB slabs, at most 4 KiB registered.
    let config = PoolConfig::default()
        .with_classes([4096])
        .with_slab_bytes(4096)
        .with_max_bytes(Some(4096));
    let pool = BufferPool::new(unpinned(), config).unwrap();
    let mut buf = pool.get(4096).unwrap();
    let addr = buf.addr();
    fill(&mut buf, 0x5a);
    assert!(matches!(
        pool.get(1),
        Err(Error::PoolExhausted { limit: 4096 })
    ));
    thread::spawn(move || drop(buf)).join().unwrap();
    let again = pool.get(10).unwrap();
    assert_eq!(again.addr(), addr);
    assert!(holds(&again, 0x5a), "contents are the previous user's");
    assert_eq!(pool.stats().slabs, 1);
}

#[test]
fn exhaustion_recovers_when_buffers_return() {
    let config = small().with_max_bytes(Some(32 << 10));
    let pool = BufferPool::new(unpinned(), config).unwrap();
    // Two 16 KiB slabs of the 4 KiB class: 8 buffers.
    let mut bufs: Vec<_> = (0..8).map(|_| pool.get(4096).unwrap()).collect();
    assert!(matches!(
        pool.get(4096),
        Err(Error::PoolExhausted { limit }) if limit == 32 << 10
    ));
    // Other classes cannot grow either.
    assert!(matches!(pool.get(10), Err(Error::PoolExhausted { .. })));
    let s = pool.stats();
    assert_eq!((s.slabs, s.bytes_registered, s.exhausted), (2, 32 << 10, 2));

    // Returned on this thread.
    bufs.pop();
    let b = pool.get(4000).unwrap();
    bufs.push(b);

    // Returned on another thread that stays alive: the pool is under pressure, so the
    // buffers bypass that thread's cache.
    let (tx, rx) = mpsc::channel::<()>();
    let give: Vec<_> = bufs.drain(..4).collect();
    let keeper = thread::spawn(move || {
        drop(give);
        rx.recv().unwrap();
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got = Vec::new();
    while got.len() < 4 {
        match pool.get(4096) {
            Ok(b) => got.push(b),
            Err(Error::PoolExhausted { .. }) => thread::yield_now(),
            Err(e) => panic!("{e}"),
        }
        assert!(
            Instant::now() < deadline,
            "buffers dropped on a live thread never came back: {:?}",
            pool.stats()
        );
    }
    assert!(matches!(pool.get(4096), Err(Error::PoolExhausted { .. })));
    tx.send(()).unwrap();
    keeper.join().unwrap();
    assert_eq!(pool.stats().slabs, 2);
}

#[test]
fn buffers_outlive_the_pool_and_regions_go_with_the_last_holder() {
    let reg = Counting::new();
    let pool = BufferPool::new(reg.clone(), small()).unwrap();
    let (ready_tx, ready_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let p2 = pool.clone();
    // A thread that caches buffers of the pool and stays alive until told to exit.
    let cacher = thread::spawn(move || {
        let bufs: Vec<_> = (0..4).map(|_| p2.get(100).unwrap()).collect();
        drop(bufs);
        drop(p2);
        ready_tx.send(()).unwrap();
        go_rx.recv().unwrap();
    });
    ready_rx.recv().unwrap();

    let mut buf = pool.get(1000).unwrap();
    fill(&mut buf, 0xa5);
    let regions = reg.live().len();
    assert_eq!(regions, 2);
    drop(pool);
    // The handle is gone but the buffer is still registered and usable.
    assert_eq!(reg.live().len(), regions);
    assert_eq!(reg.region_of(&buf).lkey, buf.lkey());
    assert!(holds(&buf, 0xa5));
    fill(&mut buf, 0x3c);
    assert!(holds(&buf, 0x3c));
    drop(buf);
    // The idle thread's cache still holds the pool.
    assert_eq!(reg.live().len(), regions);
    go_tx.send(()).unwrap();
    cacher.join().unwrap();
    assert!(reg.live().is_empty(), "{:?}", reg.live());
    assert_eq!(UNMAPPED_BEFORE_DEREGISTER.load(Ordering::SeqCst), 0);
}

#[test]
fn last_buffer_after_close_deregisters_at_once() {
    let reg = Counting::new();
    let pool = BufferPool::new(reg.clone(), small()).unwrap();
    let buf = pool.get(64).unwrap();
    let cached = pool.get(64).unwrap();
    drop(cached);
    drop(pool);
    assert_eq!(reg.live().len(), 1);
    // Dropped on another thread, which has no cache of the pool.
    thread::spawn(move || drop(buf)).join().unwrap();
    assert!(reg.live().is_empty());

    // A pool dropped with nothing outstanding deregisters right away.
    let pool = BufferPool::new(reg.clone(), small()).unwrap();
    drop(pool.get(64).unwrap());
    assert_eq!(reg.live().len(), 1);
    drop(pool);
    assert!(reg.live().is_empty());
    assert_eq!(UNMAPPED_BEFORE_DEREGISTER.load(Ordering::SeqCst), 0);
}

#[test]
fn closed_pool_cache_is_purged_when_the_thread_touches_another_pool() {
    let reg = Counting::new();
    let pool = BufferPool::new(reg.clone(), small()).unwrap();
    let (step_tx, step_rx) = mpsc::channel::<()>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let p2 = pool.clone();
    let reg2 = Counting::new();
    let other_reg = reg2.clone();
    let worker = thread::spawn(move || {
        drop(p2.get(64).unwrap());
        drop(p2);
        done_tx.send(()).unwrap();
        step_rx.recv().unwrap();
        let other = BufferPool::new(other_reg, small()).unwrap();
        let b = other.get(64).unwrap();
        done_tx.send(()).unwrap();
        step_rx.recv().unwrap();
        drop(b);
    });
    done_rx.recv().unwrap();
    drop(pool);
    assert_eq!(reg.live().len(), 1, "the worker's cache keeps the pool");
    step_tx.send(()).unwrap();
    done_rx.recv().unwrap();
    assert!(
        reg.live().is_empty(),
        "purged when the worker made a new cache"
    );
    assert_eq!(reg2.live().len(), 1);
    step_tx.send(()).unwrap();
    worker.join().unwrap();
    assert!(reg2.live().is_empty());
}

#[test]
fn thread_exit_returns_cached_buffers() {
    let pool = BufferPool::new(unpinned(), small()).unwrap();
    let p2 = pool.clone();
    thread::spawn(move || {
        let bufs: Vec<_> = (0..5).map(|_| p2.get(64).unwrap()).collect();
        drop(bufs);
        let s = p2.stats();
        assert_eq!(s.thread_caches, 1);
        assert!(s.shared_free < 256, "{s:?}");
    })
    .join()
    .unwrap();
    let s = pool.stats();
    // First get: a new slab, one buffer plus three for the magazine (batch of 4); gets
    // 2-4 hit; get 5 refills from the shared list.
    assert_eq!((s.thread_caches, s.shared_free), (0, 256));
    assert_eq!((s.hits, s.misses), (3, 2));
}

#[test]
fn slices_only_without_remote_access() {
    for (access, local) in [
        (Access::empty(), true),
        (Access::LOCAL_WRITE, true),
        (Access::REMOTE_READ, false),
        (Access::LOCAL_WRITE | Access::REMOTE_WRITE, false),
        (Access::LOCAL_WRITE | Access::REMOTE_ATOMIC, false),
        (Access::ALL, false),
    ] {
        let pool = BufferPool::new(unpinned(), small().with_access(access)).unwrap();
        assert_eq!(pool.access(), access);
        let mut buf = pool.get(100).unwrap();
        assert_eq!(buf.access(), access);
        assert_eq!(buf.as_slice().is_some(), local, "{access:?}");
        assert_eq!(buf.as_mut_slice().is_some(), local, "{access:?}");
        if local {
            buf.as_mut_slice().unwrap()[..3].copy_from_slice(b"abc");
            let mut out = [0; 3];
            buf.read_at(0, &mut out).unwrap();
            assert_eq!(&out, b"abc");
            buf.write_at(97, b"xyz").unwrap();
            assert_eq!(buf.as_slice().unwrap().len(), 100);
            assert_eq!(&buf.as_slice().unwrap()[97..], b"xyz");
        }
    }
}

#[test]
fn backing_is_reported_in_stats() {
    let pool = BufferPool::new(unpinned(), PoolConfig::default()).unwrap();
    assert_eq!(pool.stats().backing, None);
    let _b = pool.get(4096).unwrap();
    assert_eq!(pool.stats().backing, Some(Backing::Normal));

    let expect = Mapping::with_hugepages(4 << 20, HugePages::Prefer)
        .unwrap()
        .backing();
    let pool = BufferPool::new(
        unpinned(),
        PoolConfig::default().with_hugepages(HugePages::Prefer),
    )
    .unwrap();
    let b = pool.get(4096).unwrap();
    assert_eq!(pool.stats().backing, Some(expect));
    if expect != Backing::Normal {
        assert_eq!(b.addr() % (2 << 20), 0, "first buffer starts a huge page");
    }
}

#[test]
fn copies_check_bounds_without_overflow() {
    let pool = BufferPool::new(unpinned(), small()).unwrap();
    let mut buf = pool.get(100).unwrap();
    let mut one = [0u8; 1];
    assert!(buf.write_at(99, &[7]).is_ok());
    assert!(buf.read_at(99, &mut one).is_ok());
    assert_eq!(one, [7]);
    assert!(buf.write_at(100, &[]).is_ok());
    assert!(buf.read_at(100, &mut []).is_ok());
    assert_eq!(
        buf.write_at(100, &[1]),
        Err(OutOfBounds {
            offset: 100,
            len: 1,
            bound: 100
        })
    );
    assert!(buf.write_at(101, &[]).is_err());
    assert!(buf.write_at(99, &[1, 2]).is_err());
    assert!(buf.read_at(usize::MAX, &mut one).is_err());
    assert!(buf.write_at(usize::MAX, &[1]).is_err());
    assert!(buf.read_at(usize::MAX, &mut []).is_err());
    assert!(buf.write_at(1, &[0; 100]).is_err());
    // Copies are bounded by the valid length, not the capacity.
    assert_eq!(buf.capacity(), 256);
    assert!(buf.write_at(200, &[1]).is_err());
    buf.set_len(256).unwrap();
    assert!(buf.write_at(200, &[1]).is_ok());
    assert_eq!(
        buf.set_len(257),
        Err(OutOfBounds {
            offset: 0,
            len: 257,
            bound: 256
        })
    );
    assert_eq!(buf.len(), 256);
    buf.set_len(0).unwrap();
    assert!(buf.is_empty());
    assert_eq!(buf.as_slice(), Some(&[][..]));
}

#[test]
fn pinned_slabs_are_unpinned_when_the_pool_is_gone() {
    // The only test in this binary that pins; 16 KiB slabs stay far below RLIMIT_MEMLOCK.
    let before = rdmx_mem::pin::pinned_bytes();
    let pool = BufferPool::new(Counting::with_pinning(Pinning::Pinned), small()).unwrap();
    let buf = pool.get(64).unwrap();
    assert_eq!(rdmx_mem::pin::pinned_bytes(), before + (16 << 10));
    drop(pool);
    assert_eq!(rdmx_mem::pin::pinned_bytes(), before + (16 << 10));
    drop(buf);
    assert_eq!(rdmx_mem::pin::pinned_bytes(), before);
}

#[test]
fn pools_and_buffers_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<BufferPool<PinOnly>>();
    check::<PoolBuf<PinOnly>>();
    check::<PoolBuf<Counting>>();
}

#[test]
fn shared_pools_take_memfd_backed_slabs() {
    let pool = BufferPool::new(unpinned(), small().with_shared(true)).unwrap();
    let mut buf = pool.get(1000).unwrap();
    fill(&mut buf, 7);
    let (file, _) = rdmx_mem::shared::find(buf.addr(), buf.len()).expect("a shared slab");
    assert!(file.len() >= buf.len());
    assert!(holds(&buf, 7));
    let plain = BufferPool::new(unpinned(), small()).unwrap();
    let buf = plain.get(1000).unwrap();
    assert!(rdmx_mem::shared::find(buf.addr(), buf.len()).is_none());
}
