//! RLIMIT_MEMLOCK errors. Alone in its file (its own process): it lowers a process-wide
//! limit and drops CAP_IPC_LOCK from this thread, so that the limit applies even to root.

use rdmx::{Access, Context, Error, Mapping, Pinning};

#[test]
fn exceeding_memlock_names_limit_request_and_fix() {
    let limit = 1u64 << 20;
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into a valid rlimit struct.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) };
    assert_eq!(rc, 0);
    // Lower only the soft limit: raising the hard one needs CAP_SYS_RESOURCE.
    assert!(lim.rlim_max >= limit, "hard RLIMIT_MEMLOCK below 1 MiB");
    lim.rlim_cur = limit;
    // SAFETY: setrlimit reads a valid rlimit struct.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) };
    assert_eq!(rc, 0, "setrlimit: {}", std::io::Error::last_os_error());
    // Capabilities are per thread: drop CAP_IPC_LOCK here so mlock honours the limit.
    caps::drop(
        None,
        caps::CapSet::Effective,
        caps::Capability::CAP_IPC_LOCK,
    )
    .unwrap();

    let pd = Context::open_default().unwrap().alloc_pd();
    let err = pd
        .register(Mapping::new(4 << 20).unwrap(), Access::LOCAL_WRITE)
        .unwrap_err();
    let Error::Register(rdmx_mem::Error::MemlockLimit(m)) = &err else {
        panic!("expected a memlock error, got {err:?}");
    };
    assert_eq!(m.limit, Some(limit));
    assert_eq!(m.requested, 4 << 20);
    let msg = err.to_string();
    assert!(msg.contains("1048576 bytes"), "{msg}");
    assert!(msg.contains("4194304 bytes"), "{msg}");
    assert!(msg.contains("ulimit -l"), "{msg}");
    assert_eq!(
        rdmx_mem::pin::pinned_bytes(),
        0,
        "a failed pin left pages counted"
    );

    // Nothing silently falls back; asking for no pinning works.
    let unpinned = pd
        .register_with(
            Mapping::new(4 << 20).unwrap(),
            Access::LOCAL_WRITE,
            Pinning::Unpinned,
        )
        .unwrap();
    assert!(!unpinned.is_pinned());
    // A registration inside the limit still pins.
    let small = pd
        .register(Mapping::new(256 << 10).unwrap(), Access::LOCAL_WRITE)
        .unwrap();
    assert!(small.is_pinned());
}
