//! Deregistration against a stalled peer's claim, on memory registered every way (part of
//! a mapping, raw, shared with others), and a detached mapping that keeps what peers
//! wrote into its other regions.

use super::*;

/// A region over a shared mapping of twice [`LEN`], registered by `register`, whose key
/// a stalled peer claims: its deregistration waits past the bound, does not detach the
/// mapping, and returns once the claim goes, the mapped WRITE in place.
fn waits_for_a_stalled_claim(register: impl FnOnce(&Side, &Arc<Mapping>) -> MemoryRegion) {
    let (a, b) = pair();
    let src = a.pd.register(vec![5u8; 4096], Access::LOCAL_WRITE).unwrap();
    let m = Arc::new(Mapping::shared(2 * LEN).unwrap());
    let mr = register(&b, &m);
    let at = mr.remote().at(0);
    write_until_mapped(&a, &src, at);
    testing::stall_claim(&a.qp, at.rkey).unwrap();
    let going = std::thread::spawn(move || drop(mr));
    std::thread::sleep(2 * DRAIN_BOUND);
    assert!(
        !going.is_finished(),
        "deregistration returned under a claim"
    );
    assert!(m.is_shared(), "the memory was detached under a claim");
    testing::scribble_claim(&a.qp, 0).unwrap();
    going.join().unwrap();
    assert!(m.is_shared(), "the memory was detached");
    assert_eq!(&bytes(&m)[..64], &[5u8; 64], "the mapped WRITE landed");
}

/// [`waits_for_a_stalled_claim`] for a region registered raw over `len` bytes.
fn raw_region_waits_for_a_stalled_claim(len: usize) {
    waits_for_a_stalled_claim(|b, m| {
        let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
        // SAFETY: the region covers the start of `m`, which outlives it (the
        // deregistration is joined before the end of the test).
        unsafe {
            b.pd.register_raw(m.as_ptr(), len, access, Pinning::Unpinned)
        }
        .unwrap()
    });
}

/// A raw region over part of its mapping cannot take the mapping back (the rest may be
/// in use); it says so.
#[test]
fn a_stalled_claim_on_part_of_a_mapping_holds_its_deregistration_until_it_goes() {
    raw_region_waits_for_a_stalled_claim(LEN);
    wait_logged("ERROR", &["does not own all of its shared mapping"]);
}

/// Nor can a raw region over all of it: memory registered raw stays its owner's, who may
/// write it at any time (copying it then would lose those writes).
#[test]
fn a_stalled_claim_on_memory_registered_raw_holds_its_deregistration_until_it_goes() {
    raw_region_waits_for_a_stalled_claim(2 * LEN);
}

/// Memory a region owns but others may reach while it is removed (as the transfer
/// engine's buffers, registered on every rail).
struct OwnedWithOthers(Arc<Mapping>);

// SAFETY: as `Owned`; it says that others may reach the memory.
unsafe impl Memory for OwnedWithOthers {
    fn as_raw(&mut self) -> (*mut u8, usize) {
        (self.0.as_ptr(), self.0.len())
    }
    fn shared_with_others(&self) -> bool {
        true
    }
}

/// Nor can a region whose memory others may reach while it is removed, though it owns
/// it: its deregistration waits for a stalled claim too.
#[test]
fn a_stalled_claim_on_memory_shared_with_others_holds_its_deregistration_until_it_goes() {
    waits_for_a_stalled_claim(|b, m| {
        let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
        b.pd.register(OwnedWithOthers(m.clone()), access).unwrap()
    });
}

/// A second initiator on its own connection to the target context of `b`.
fn second_initiator(b: &Side) -> (Side, QueuePair) {
    let a2 = side();
    let b2 = b.pd.create_qp(&b.cq, &b.cq, QpCaps::default()).unwrap();
    a2.qp
        .connect(b2.endpoint(), &ConnectOptions::default())
        .unwrap();
    b2.connect(a2.qp.endpoint(), &ConnectOptions::default())
        .unwrap();
    wait_until("the second connection", || {
        rdmx::shm::data_path(&a2.qp).is_some() && rdmx::shm::data_path(&b2).is_some()
    });
    (a2, b2)
}

/// Bytes `range` of `m`.
fn bytes_at(m: &Mapping, range: std::ops::Range<usize>) -> Vec<u8> {
    // SAFETY: `m` is a live mapping that covers `range`, and nothing writes it meanwhile
    // (the test's peers are idle when it looks).
    unsafe { std::slice::from_raw_parts(m.as_ptr().add(range.start), range.len()) }.to_vec()
}

/// Deregistering a region that spans its mapping, which a stalled initiator claims,
/// detaches the mapping. A second initiator was copying into another region in that
/// mapping then: its copy ends before the mapping is copied and is in it, and the other
/// region still takes WRITEs (through the rings) afterwards.
#[test]
fn a_detached_mapping_keeps_what_peers_wrote_into_its_other_regions() {
    let (a, b) = pair();
    let (a2, _b2) = second_initiator(&b);
    let src = a.pd.register(vec![1u8; 4096], Access::LOCAL_WRITE).unwrap();
    let src2 = a2
        .pd
        .register(vec![2u8; 4096], Access::LOCAL_WRITE)
        .unwrap();
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    // The first region owns the mapping; the second covers its second half.
    let (m, first) = register_owned(&b, 2 * LEN, access);
    // SAFETY: `m` outlives the region, and the test touches its memory only after the
    // regions are gone or while the peers are idle.
    let second = unsafe {
        b.pd.register_raw(m.as_ptr().add(LEN), LEN, access, Pinning::Unpinned)
    }
    .unwrap();
    let (at1, at2) = (first.remote().at(0), second.remote().at(0));
    write_until_mapped(&a, &src, at1);
    write_until_mapped(&a2, &src2, at2);
    let peer = PeerMapping::of(m.as_ptr()).unwrap();
    // The first initiator stalls holding its claim; the second is copying into the
    // second region when the first region's deregistration begins.
    testing::stall_claim(&a.qp, at1.rkey).unwrap();
    testing::stall_claim(&a2.qp, at2.rkey).unwrap();
    let going = std::thread::spawn(move || drop(first));
    wait_until("the second region is unpublished", || {
        !testing::peer_publishes(&a2.qp, at2.rkey).unwrap()
    });
    // The second initiator's copy lands, then its claim goes.
    // SAFETY: the test plays the second initiator's copy; nothing of this process
    // touches those bytes until the deregistration has returned.
    assert!(unsafe { peer.write(LEN, &[0xab; 64]) });
    testing::scribble_claim(&a2.qp, 0).unwrap();
    going.join().unwrap();
    assert!(!m.is_shared(), "the mapping was not detached");
    assert_eq!(
        bytes_at(&m, LEN..LEN + 64),
        [0xab; 64],
        "the copy into the other region was lost"
    );
    let at = RemoteAddr {
        addr: at2.addr + 64,
        ..at2
    };
    a2.qp
        .post_send(SendRequest::write(5, at).sge(LocalSge::new(&src2, 0, 64).unwrap()))
        .unwrap();
    let c = wait(&a2.cq, "a WRITE to the other region");
    assert_eq!(c.status, WcStatus::Success, "{c:?}");
    assert_eq!(bytes_at(&m, LEN + 64..LEN + 128), [2u8; 64]);
    testing::scribble_claim(&a.qp, 0).unwrap();
    drop(second);
}

/// An initiator that goes with a claim in its word, after the target's queue pair went
/// too, holds nothing: the target stops watching its connection (which kept the
/// connection's segment mapped) at its next deregistration, of any region.
#[test]
fn a_dead_initiator_s_leftover_claim_is_not_watched() {
    let (a, b, src, _m, mr) = writable_pair(LEN, 9);
    let m2 = Mapping::shared(LEN).unwrap();
    let other = register(&b, &m2, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let at = mr.remote().at(0);
    write_until_mapped(&a, &src, at);
    testing::stall_claim(&a.qp, at.rkey).unwrap();
    drop(src);
    let Side { ctx, qp, .. } = a;
    drop(qp);
    drop(ctx);
    wait_until("the target's QP fails with the connection", || {
        let _ = b.cq.poll_one().unwrap();
        b.qp.state() == QpState::Err
    });
    let Side { ctx, pd, cq, qp } = b;
    drop(qp);
    assert_eq!(testing::watched_connections(&ctx), Some(1));
    drop(other);
    assert_eq!(
        testing::watched_connections(&ctx),
        Some(0),
        "a dead initiator's claim is still watched"
    );
    drop(mr);
    drop((pd, cq));
}

/// A target queue pair destroyed while its peer copies into its memory through the
/// mapping (under a claim made before) goes only once the copy is over: the memory is
/// the application's again when the destruction returns. The peer's next WRITE does not
/// run through the mapping.
#[test]
fn a_destroyed_target_goes_once_its_peer_s_mapped_copy_is_over() {
    let (a, b, src, _m, mr) = writable_pair(LEN, 9);
    let at = mr.remote().at(0);
    write_until_mapped(&a, &src, at);
    testing::stall_claim(&a.qp, at.rkey).unwrap();
    let Side { ctx, pd, cq, qp } = b;
    let ended = AtomicBool::new(false);
    let waited = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            ended.store(true, Ordering::SeqCst);
            // (Once the queue pair went, the initiator's connection may be gone too.)
            let _ = testing::scribble_claim(&a.qp, 0);
        });
        drop(qp);
        ended.load(Ordering::SeqCst)
    });
    assert!(
        waited,
        "the queue pair went while its peer still copied into its memory"
    );
    let before = rdmx::shm::executed_at_post(&a.qp).unwrap();
    a.qp.post_send(SendRequest::write(2, at).sge(LocalSge::new(&src, 0, 64).unwrap()))
        .unwrap();
    let c = wait(&a.cq, "a WRITE to a destroyed queue pair");
    assert_ne!(c.status, WcStatus::Success, "{c:?}");
    assert_eq!(rdmx::shm::executed_at_post(&a.qp).unwrap(), before);
    drop((mr, pd, cq, ctx));
}

/// A peer stopped mid-copy into a destroyed target queue pair's memory holds the
/// destruction for `DRAIN_BOUND` at most, with a warning.
#[test]
fn a_peer_stalled_in_a_mapped_copy_holds_a_destruction_for_a_bounded_time() {
    let (a, b, src, _m, mr) = writable_pair(LEN, 9);
    let at = mr.remote().at(0);
    write_until_mapped(&a, &src, at);
    testing::stall_claim(&a.qp, at.rkey).unwrap();
    let Side { ctx, pd, cq, qp } = b;
    let start = Instant::now();
    drop(qp);
    let took = start.elapsed();
    assert!(
        took >= DRAIN_BOUND,
        "the destruction did not wait: {took:?}"
    );
    assert!(took < DRAIN_BOUND + DEADLINE, "the destruction hung");
    wait_logged("WARN", &["into) a destroyed queue pair's memory"]);
    let _ = testing::scribble_claim(&a.qp, 0);
    drop((mr, pd, cq, ctx));
}
