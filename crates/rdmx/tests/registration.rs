//! Memory registration through the facade: keys, checks, lifetimes and pinning.

mod common;

use rdmx::{Access, Context, Error, KeyError, KeyUse, Mapping, Pinning};

const RW: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_WRITE);

#[test]
fn register_gives_keys_and_copying_access() {
    let ctx = Context::open_default().unwrap();
    let pd = ctx.alloc_pd();
    let mr = pd.register(vec![7u8; 8192], RW).unwrap();
    assert_ne!(mr.lkey(), 0);
    assert_eq!(mr.rkey(), mr.lkey());
    assert_eq!(mr.len(), 8192);
    assert!(mr.is_pinned());
    let mut b = [0u8; 4];
    mr.read_at(8188, &mut b).unwrap();
    assert_eq!(b, [7; 4]);
    mr.write_at(0, b"abcd").unwrap();
    mr.read_at(0, &mut b).unwrap();
    assert_eq!(&b, b"abcd");
    assert!(matches!(
        mr.read_at(8189, &mut b),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(mr.write_at(usize::MAX, b"x").is_err());
    let local = pd.register(vec![0u8; 64], Access::LOCAL_WRITE).unwrap();
    assert_eq!(local.rkey(), 0);
    assert_eq!(ctx.registered_regions(), 2);
}

/// `byte_becomes` (a wait on a flag byte, as perftest's latency tests wait on a
/// message's last byte): it sees what another thread writes, gives up after its tries
/// when nothing does, and checks its bounds.
#[test]
fn byte_becomes_sees_a_flag_set_by_another_thread() {
    let ctx = Context::open_default().unwrap();
    let pd = ctx.alloc_pd();
    let mr = pd.register(vec![0u8; 4096], RW).unwrap();
    assert!(!mr.byte_becomes(4095, 9, 1000).unwrap());
    assert!(mr.byte_becomes(4095, 0, 1).unwrap());
    assert!(matches!(
        mr.byte_becomes(4096, 0, 1),
        Err(Error::OutOfBounds { .. })
    ));
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(20));
            mr.write_at(4095, &[9]).unwrap();
        });
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !mr.byte_becomes(4095, 9, 256).unwrap() {
            assert!(
                std::time::Instant::now() < deadline,
                "the write was never seen"
            );
        }
    });
    // (0 tries: nothing is read, nothing is seen.)
    assert!(!mr.byte_becomes(4095, 9, 0).unwrap());
}

#[test]
fn remote_write_or_atomic_without_local_write_is_rejected() {
    let ctx = Context::open_default().unwrap();
    let pd = ctx.alloc_pd();
    for access in [
        Access::REMOTE_WRITE,
        Access::REMOTE_ATOMIC | Access::REMOTE_READ,
    ] {
        let err = pd.register(vec![0u8; 64], access).unwrap_err();
        assert!(
            matches!(err, Error::Register(rdmx_mem::Error::InvalidAccess(_))),
            "{err}"
        );
    }
    assert_eq!(ctx.registered_regions(), 0);
}

#[test]
fn empty_registration_is_rejected() {
    let pd = Context::open_default().unwrap().alloc_pd();
    let err = pd.register(Vec::new(), RW).unwrap_err();
    assert!(matches!(
        err,
        Error::Register(rdmx_mem::Error::InvalidRange { .. })
    ));
}

#[test]
fn check_names_pd_bounds_and_access_failures() {
    let ctx = Context::open_default().unwrap();
    let pd = ctx.alloc_pd();
    let other = ctx.alloc_pd();
    let mr = pd
        .register(vec![0u8; 4096], Access::LOCAL_WRITE | Access::REMOTE_READ)
        .unwrap();
    let (a, k) = (mr.addr() as u64, mr.rkey());
    assert!(pd
        .check(k, KeyUse::Remote, a, 4096, Access::REMOTE_READ)
        .is_ok());
    assert!(matches!(
        other.check(k, KeyUse::Remote, a, 8, Access::REMOTE_READ),
        Err(KeyError::PdMismatch { .. })
    ));
    assert!(matches!(
        pd.check(k, KeyUse::Remote, a + 1, 4096, Access::REMOTE_READ),
        Err(KeyError::OutOfBounds { .. })
    ));
    assert!(matches!(
        pd.check(k, KeyUse::Remote, a, u64::MAX, Access::REMOTE_READ),
        Err(KeyError::OutOfBounds { .. })
    ));
    assert!(matches!(
        pd.check(k, KeyUse::Remote, a, 8, Access::REMOTE_WRITE),
        Err(KeyError::AccessDenied { .. })
    ));
}

#[test]
fn deregistration_kills_keys_at_once_but_in_use_memory_lives() {
    let ctx = Context::open_default().unwrap();
    let pd = ctx.alloc_pd();
    let mr = pd.register(vec![9u8; 4096], RW).unwrap();
    let (a, k) = (mr.addr() as u64, mr.rkey());
    // What a posted work request holds.
    let in_flight = mr.share();
    mr.deregister();
    assert_eq!(ctx.registered_regions(), 0);
    assert!(matches!(
        pd.check(k, KeyUse::Remote, a, 8, Access::REMOTE_READ),
        Err(KeyError::InvalidKey { .. })
    ));
    assert!(matches!(
        pd.check(k, KeyUse::Local, a, 8, Access::empty()),
        Err(KeyError::InvalidKey { .. })
    ));
    let mut b = [0u8; 8];
    in_flight.read_at(4088, &mut b).unwrap();
    assert_eq!(b, [9; 8]);
    // A new registration never answers to the stale key.
    let again = pd.register(vec![0u8; 4096], RW).unwrap();
    assert_ne!(again.rkey(), k);
    assert!(pd
        .check(
            k,
            KeyUse::Remote,
            again.addr() as u64,
            8,
            Access::REMOTE_READ
        )
        .is_err());
}

#[test]
fn keys_are_not_predictable_across_contexts() {
    let keys = || {
        let ctx = Context::open_default().unwrap();
        let pd = ctx.alloc_pd();
        let mrs: Vec<_> = (0..16)
            .map(|_| pd.register(vec![0u8; 64], RW).unwrap())
            .collect();
        mrs.iter().map(|m| m.rkey()).collect::<Vec<_>>()
    };
    // 16 independent 8-bit variants: equal by chance with probability 2^-128.
    assert_ne!(keys(), keys());
}

#[test]
fn overlapping_registrations_keep_shared_pages_locked() {
    let pd = Context::open_default().unwrap().alloc_pd();
    let page = rdmx_mem::sys::page_size();
    let map = Mapping::new(4 * page).unwrap();
    let base = map.as_ptr() as usize;
    assert_eq!(common::locked_in(base, base + 4 * page), 0);
    // SAFETY: the mapping outlives both regions (they are dropped first below).
    let first = unsafe { pd.register_raw(map.as_ptr(), 3 * page, RW, Pinning::Pinned) }.unwrap();
    // SAFETY: as above.
    let second = unsafe {
        pd.register_raw(
            map.as_ptr().add(page + 10),
            3 * page - 10,
            RW,
            Pinning::Pinned,
        )
    }
    .unwrap();
    assert_eq!(common::locked_in(base, base + 4 * page), 4 * page);
    drop(first);
    // Pages 1..4 are still used by `second`.
    assert_eq!(common::locked_in(base, base + page), 0);
    assert_eq!(common::locked_in(base + page, base + 4 * page), 3 * page);
    drop(second);
    assert_eq!(common::locked_in(base, base + 4 * page), 0);
}

#[test]
fn unpinned_registration_is_explicit_and_locks_nothing() {
    let pd = Context::open_default().unwrap().alloc_pd();
    let map = Mapping::new(1 << 16).unwrap();
    let base = map.as_ptr() as usize;
    let mr = pd.register_with(map, RW, Pinning::Unpinned).unwrap();
    assert!(!mr.is_pinned());
    assert_eq!(common::locked_in(base, base + (1 << 16)), 0);
    let pinned = pd.register(Mapping::new(1 << 16).unwrap(), RW).unwrap();
    assert!(pinned.is_pinned());
    let p = pinned.addr();
    assert_eq!(common::locked_in(p, p + (1 << 16)), 1 << 16);
}

#[test]
fn key_variants_spread_over_contexts_and_slots() {
    const VARIANT: u32 = 0xff;
    // Across contexts: the first region's key takes many values (64 draws from 256
    // variants give about 57 distinct ones; a fixed or clock-derived start gives a few).
    let firsts: std::collections::HashSet<u32> = (0..64)
        .map(|_| {
            let pd = Context::open_default().unwrap().alloc_pd();
            pd.register(vec![0u8; 64], RW).unwrap().rkey() & VARIANT
        })
        .collect();
    assert!(
        firsts.len() >= 32,
        "64 contexts gave only {} first key variants",
        firsts.len()
    );
    // Within a context: knowing one key does not give the next. The step between
    // consecutive regions' variants takes many values (about 162 of 256 at random; one
    // for a counter or any fixed stride).
    let pd = Context::open_default().unwrap().alloc_pd();
    let mrs: Vec<_> = (0..257)
        .map(|_| pd.register(vec![0u8; 64], RW).unwrap())
        .collect();
    let steps: std::collections::HashSet<u32> = mrs
        .windows(2)
        .map(|w| (w[1].rkey() & VARIANT).wrapping_sub(w[0].rkey() & VARIANT) & VARIANT)
        .collect();
    assert!(
        steps.len() >= 64,
        "256 consecutive registrations show only {} variant steps",
        steps.len()
    );
}

/// A region that borrows its memory (registered raw, as the registration cache's are)
/// refuses the accessors that reach memory through a handle: safe code given one by the
/// cache's `get` could otherwise write memory it borrows as `&[u8]`, or keep a handle
/// (`share`) past the buffer.
#[test]
fn a_region_that_borrows_its_memory_refuses_the_handle_accessors() {
    let ctx = Context::open_default().unwrap();
    let pd = ctx.alloc_pd();
    let config = rdmx::CacheConfig::default().invalidation(rdmx::Invalidation::Explicit);
    let cache = rdmx::RegCache::new(pd, config).unwrap();
    let buf = vec![7u8; 4096];
    let h = cache.get(&buf).unwrap();
    let r = h.region();
    let refused = |e: Error| matches!(e, Error::InvalidArgument(_));
    assert!(r.write_at(0, b"x").is_err_and(refused));
    assert!(r.read_at(0, &mut [0u8; 1]).is_err_and(refused));
    assert!(r.fetch_add_u64(0, 1).is_err_and(refused));
    assert!(r.compare_swap_u64(0, 0, 1).is_err_and(refused));
    assert!(r.byte_becomes(0, 7, 1).is_err_and(refused));
    let kept = r.share();
    drop(h);
    assert!(kept.load_u64(0).is_err_and(refused));
    assert!(kept.write_at(0, b"x").is_err_and(refused));
    assert_eq!(buf[0], 7);
}
