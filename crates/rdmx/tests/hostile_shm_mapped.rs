//! A broken, stalled or hostile peer on the shm provider's `mapped` data path: a peer that
//! claims a key and never lets go (stalled mid-copy, or scribbling its claim word), a
//! peer that dies holding a claim, a peer that tries to map the key table writable, and a
//! target whose key table lies about a region's length. Each time deregistration returns
//! within its bound and the memory is then out of the peer's reach, and requests the
//! checks refuse get the ring path's statuses, also inside a post list whose requests
//! share one claim, and after what a queue pair kept of a key from an earlier post. A
//! target queue pair destroyed amid a peer's copy goes once the copy is over.

#[path = "common/logs.rs"]
mod logs;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmx::shm::testing::{self, PeerMapping};
use rdmx::shm::DRAIN_BOUND;
use rdmx::{
    Access, Completion, CompletionQueue, ConnectOptions, Context, LocalSge, Mapping, Memory,
    MemoryRegion, Pinning, ProtectionDomain, QpAttr, QpAttrMask, QpCaps, QpState, QueuePair,
    RecvRequest, RemoteAddr, SendRequest, WcStatus,
};

use logs::wait_logged;

const DEADLINE: Duration = Duration::from_secs(30);
const LEN: usize = 64 << 10;

struct Side {
    ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
}

fn side() -> Side {
    let _ = logs::logs();
    let ctx = Context::open(rdmx::shm::Options::default().direct(false).mapped(true)).unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(64).unwrap();
    let qp = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
    Side { ctx, pd, cq, qp }
}

/// A connected pair on the mapped path: the initiator and the target.
fn pair() -> (Side, Side) {
    let (a, b) = (side(), side());
    let (ea, eb) = (a.qp.endpoint(), b.qp.endpoint());
    a.qp.connect(eb, &ConnectOptions::default()).unwrap();
    b.qp.connect(ea, &ConnectOptions::default()).unwrap();
    let start = Instant::now();
    while rdmx::shm::data_path(&a.qp).is_none() || rdmx::shm::data_path(&b.qp).is_none() {
        assert!(start.elapsed() < DEADLINE, "the shm connection never came");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(rdmx::shm::data_path(&a.qp), Some("mapped"));
    (a, b)
}

fn wait(cq: &CompletionQueue, what: &str) -> Completion {
    let start = Instant::now();
    loop {
        if let Some(c) = cq.poll_one().unwrap() {
            return c;
        }
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        std::thread::yield_now();
    }
}

/// Registers the test's own shared mapping `m` on the target (the test keeps the memory,
/// to look at it after deregistration).
fn register(t: &Side, m: &Mapping, access: Access) -> MemoryRegion {
    // SAFETY: `m` outlives the region in every test (the region is dropped first).
    unsafe {
        t.pd.register_raw(m.as_ptr(), m.len(), access, Pinning::Unpinned)
    }
    .unwrap()
}

/// WRITEs 64 bytes to `at` until one is executed through the mapping (the target's file
/// reaches the initiator over its socket after the registration).
fn write_until_mapped(a: &Side, src: &MemoryRegion, at: RemoteAddr) {
    let start = Instant::now();
    loop {
        let before = rdmx::shm::executed_at_post(&a.qp).unwrap();
        a.qp.post_send(SendRequest::write(1, at).sge(LocalSge::new(src, 0, 64).unwrap()))
            .unwrap();
        let c = wait(&a.cq, "a WRITE");
        assert_eq!(c.status, WcStatus::Success, "{c:?}");
        if rdmx::shm::executed_at_post(&a.qp).unwrap() > before {
            return;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "no WRITE ran on the mapped path"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A shared mapping a region owns, which the test still sees: it looks only once the
/// region is gone, or while no peer writes (the regions' own memory, as pools' slabs).
struct Owned(Arc<Mapping>);

// SAFETY: the mapping stays at its address while any `Arc` to it lives, and the test
// touches it only while nothing else does (never while its region is being removed).
unsafe impl Memory for Owned {
    fn as_raw(&mut self) -> (*mut u8, usize) {
        (self.0.as_ptr(), self.0.len())
    }
}

/// Registers a new shared mapping of `len` bytes on the target, owned by the region (so
/// that a stalled peer's claim ends with it detached).
fn register_owned(t: &Side, len: usize, access: Access) -> (Arc<Mapping>, MemoryRegion) {
    let m = Arc::new(Mapping::shared(len).unwrap());
    let mr = t.pd.register(Owned(m.clone()), access).unwrap();
    (m, mr)
}

/// A pair on the mapped path with a 4 KiB source of `fill` bytes on the initiator and a
/// shared mapping of `len` bytes, owned by its region, registered for remote writes on
/// the target.
fn writable_pair(len: usize, fill: u8) -> (Side, Side, MemoryRegion, Arc<Mapping>, MemoryRegion) {
    let (a, b) = pair();
    let src =
        a.pd.register(vec![fill; 4096], Access::LOCAL_WRITE)
            .unwrap();
    let (m, mr) = register_owned(&b, len, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    (a, b, src, m, mr)
}

fn bytes(m: &Mapping) -> Vec<u8> {
    // SAFETY: `m` is a live mapping of `m.len()` bytes that no region references any more.
    unsafe { std::slice::from_raw_parts(m.as_ptr(), m.len()) }.to_vec()
}

#[test]
fn the_key_table_cannot_be_mapped_writable() {
    let s = side();
    assert_eq!(testing::key_table_writable(&s.ctx), Some(false));
}

/// A peer that claims the key and never lets go (stalled mid-copy): deregistration waits
/// for it at most its bound, then takes the memory back; the peer's later writes through
/// its mapping of the file no longer reach the target's memory.
#[test]
fn a_stalled_claim_ends_with_the_memory_detached() {
    let (a, _b, src, m, mr) = writable_pair(LEN, 9);
    let peer = PeerMapping::of(m.as_ptr()).unwrap();
    let at = mr.remote().at(0);
    write_until_mapped(&a, &src, at);
    testing::stall_claim(&a.qp, at.rkey).unwrap();
    detached_after_the_bound(mr, &m, 9, "deregistration did not wait for the claim");
    wait_logged("WARN", &["still claims a key being deregistered"]);
    let before = bytes(&m);
    // SAFETY: the peer's mapping now views pages this process no longer uses (the test
    // checks just that), and nothing else of the test touches it meanwhile.
    assert!(unsafe { peer.write(0, &[0xee; 4096]) });
    assert_eq!(
        bytes(&m),
        before,
        "a write after deregistration reached the memory"
    );
    testing::scribble_claim(&a.qp, 0).unwrap();
    // Requests to the gone key fail as on the ring path.
    write_is_refused(&a, &src, at, 2);
}

/// Deregisters `mr`, a region over `m` whose first 64 bytes a mapped WRITE of `fill`
/// bytes set, as under a claim held: the deregistration waits the bound (`why` says what
/// it means if not), then the memory is detached with the WRITE in it.
fn detached_after_the_bound(mr: MemoryRegion, m: &Mapping, fill: u8, why: &str) {
    let start = Instant::now();
    drop(mr);
    let took = start.elapsed();
    assert!(took >= DRAIN_BOUND, "{why}");
    assert!(took < DRAIN_BOUND + DEADLINE, "deregistration hung");
    assert!(!m.is_shared(), "the memory was not detached");
    assert_eq!(&bytes(m)[..64], &[fill; 64], "the mapped WRITE landed");
}

/// A WRITE of 64 bytes from `src` to `at`, a deregistered key, gets the target's refusal.
fn write_is_refused(a: &Side, src: &MemoryRegion, at: RemoteAddr, wr_id: u64) {
    a.qp.post_send(SendRequest::write(wr_id, at).sge(LocalSge::new(src, 0, 64).unwrap()))
        .unwrap();
    let c = wait(&a.cq, "a WRITE to a deregistered key");
    assert_eq!(c.status, WcStatus::RemAccessErr, "{c:?}");
}

/// A target whose barrier before reading claims fails (a kernel or filter that refuses
/// `membarrier` at run time) cannot trust what its peers' claim words say: with no claim
/// held at all, the deregistration of a region that owns its mapping goes as for a
/// stalled claim, the memory detached, and a WRITE to the gone key gets the target's
/// refusal.
#[test]
fn a_failed_barrier_takes_claims_as_held() {
    let (a, b, src, m, mr) = writable_pair(LEN, 4);
    let at = mr.remote().at(0);
    write_until_mapped(&a, &src, at);
    if !testing::fail_barriers(&b.ctx, true) {
        // No global expedited barriers here: claims are sequentially consistent stores
        // and no barrier is issued (`claims_are_plain_only_when_the_target_barriers`).
        return;
    }
    detached_after_the_bound(mr, &m, 4, "deregistration trusted unordered claims");
    wait_logged("ERROR", &["membarrier failed"]);
    testing::fail_barriers(&b.ctx, false);
    write_is_refused(&a, &src, at, 3);
}

/// Handles to a region whose mapping is being detached read and write through its gate,
/// which the copy holds: a counter incremented through one all along loses nothing to
/// the copy (increments made between the copy and the remap would be).
#[test]
fn a_handle_loses_nothing_while_its_mapping_is_detached() {
    let (a, _b, src, m, mr) = writable_pair(8 << 20, 9);
    let at = mr.remote().at(0);
    write_until_mapped(&a, &src, at);
    testing::stall_claim(&a.qp, at.rkey).unwrap();
    let h = mr.share();
    h.write_at(4096, &0u64.to_ne_bytes()).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let counting = std::thread::spawn({
        let (h, stop) = (h.clone(), stop.clone());
        move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                h.fetch_add_u64(4096, 1).unwrap();
                n += 1;
            }
            n
        }
    });
    drop(mr);
    assert!(!m.is_shared(), "the memory was not detached");
    stop.store(true, Ordering::Relaxed);
    let n = counting.join().unwrap();
    assert_eq!(
        h.load_u64(4096).unwrap(),
        n,
        "increments were lost to the copy"
    );
    testing::scribble_claim(&a.qp, 0).unwrap();
}

/// Garbage in the claim word that names no key of the target's delays nothing: the
/// region is deregistered without detaching the memory.
#[test]
fn a_scribbled_claim_word_naming_nothing_is_ignored() {
    let (a, _b, src, m, mr) = writable_pair(LEN, 9);
    write_until_mapped(&a, &src, mr.remote().at(0));
    for garbage in [u64::MAX, 1, 0x5a5a_5a5a_5a5a_5a5a] {
        testing::scribble_claim(&a.qp, garbage).unwrap();
    }
    drop(mr);
    assert!(
        m.is_shared(),
        "the memory was detached for a claim on nothing"
    );
}

/// A peer that dies holding a claim holds nothing: deregistration does not wait for it.
#[test]
fn a_dead_peer_holds_no_claims() {
    let (a, _b, src, m, mr) = writable_pair(LEN, 9);
    let at = mr.remote().at(0);
    write_until_mapped(&a, &src, at);
    testing::stall_claim(&a.qp, at.rkey).unwrap();
    drop(src);
    drop(a);
    drop(mr);
    assert!(
        m.is_shared(),
        "the memory was detached for a dead peer's claim"
    );
}

/// A target whose key table says a region is far longer than it is: the initiator checks
/// the range against the file it mapped too, so a WRITE beyond it takes the rings, and
/// the target's engine refuses it as it would any out-of-bounds request.
#[test]
fn a_key_table_that_lies_about_a_length() {
    let (a, b, src, _m, mr) = writable_pair(4096, 9);
    let at = mr.remote().at(0);
    write_until_mapped(&a, &src, at);
    assert!(testing::scribble_key_length(&b.ctx, at.rkey, 1 << 40));
    let far = RemoteAddr {
        addr: at.addr + (1 << 20),
        rkey: at.rkey,
    };
    let before = rdmx::shm::executed_at_post(&a.qp).unwrap();
    a.qp.post_send(SendRequest::write(3, far).sge(LocalSge::new(&src, 0, 64).unwrap()))
        .unwrap();
    let c = wait(&a.cq, "a WRITE beyond the region");
    assert_eq!(c.status, WcStatus::RemAccessErr, "{c:?}");
    assert_eq!(rdmx::shm::executed_at_post(&a.qp), Some(before));
    drop(mr);
}

/// The completions of `n` requests, in order.
fn completions(cq: &CompletionQueue, n: usize) -> Vec<Completion> {
    (0..n).map(|_| wait(cq, "a request of the list")).collect()
}

/// An inline WRITE (its bytes name no local key) runs on the mapped path like any other,
/// and its checks still hold: one within the region executes at post and lands, one
/// beyond it gets the target's refusal.
#[test]
fn inline_writes_run_at_post_and_are_checked() {
    let (a, _b, src, m, mr) = writable_pair(LEN, 1);
    let at = |off: usize| mr.remote().at(off as u64);
    write_until_mapped(&a, &src, at(LEN - 64));
    let before = rdmx::shm::executed_at_post(&a.qp).unwrap();
    a.qp.post_send(SendRequest::write(30, at(512)).inline(&[9u8; 40]))
        .unwrap();
    assert_eq!(rdmx::shm::executed_at_post(&a.qp), Some(before + 1));
    let c = wait(&a.cq, "the inline WRITE");
    assert_eq!((c.wr_id, c.status), (30, WcStatus::Success), "{c:?}");
    a.qp.post_send(SendRequest::write(31, at(LEN - 8)).inline(&[9u8; 16]))
        .unwrap();
    assert_eq!(
        rdmx::shm::executed_at_post(&a.qp),
        Some(before + 1),
        "a WRITE beyond the region ran at post"
    );
    let c = wait(&a.cq, "the inline WRITE beyond the region");
    assert_eq!((c.wr_id, c.status), (31, WcStatus::RemAccessErr), "{c:?}");
    drop(mr);
    let seen = bytes(&m);
    assert!(
        seen[512..552].iter().all(|&x| x == 9),
        "the inline WRITE landed"
    );
    assert!(seen[552..LEN - 64].iter().all(|&x| x == 0));
    assert!(
        seen[LEN - 8..].iter().all(|&x| x == 1),
        "the refused one wrote"
    );
}

/// Inline bytes no post may carry, handed to the provider directly: more than the queue
/// pair's inline limit (256 bytes by default), or without the INLINE flag. On the mapped
/// path, to a key the connection has looked up, each is refused at post as the engine
/// refuses it, and none of its bytes lands.
#[test]
fn inline_bytes_no_post_may_carry_are_refused() {
    let (a, _b, src, m, mr) = writable_pair(LEN, 1);
    let at = mr.remote().at(512);
    write_until_mapped(&a, &src, mr.remote().at(LEN as u64 - 64));
    let before = rdmx::shm::executed_at_post(&a.qp).unwrap();
    let long = vec![9u8; 4096];
    let wr = SendRequest::write(40, at).inline(&long).wr().clone();
    // SAFETY: inline bytes only: no local memory is named.
    let r = unsafe { a.qp.post_send_raw(&wr, Some(&long)) };
    assert!(
        matches!(
            r,
            Err(rdmx::Error::Post(rdmx::PostError::InlineTooLarge { .. }))
        ),
        "{r:?}"
    );
    let mut wr = SendRequest::write(41, at).inline(&long[..64]).wr().clone();
    wr.flags.remove(rdmx::SendFlags::INLINE);
    // SAFETY: as above.
    let r = unsafe { a.qp.post_send_raw(&wr, Some(&long[..64])) };
    assert!(
        matches!(r, Err(rdmx::Error::Post(rdmx::PostError::Invalid(_)))),
        "{r:?}"
    );
    assert_eq!(rdmx::shm::executed_at_post(&a.qp), Some(before));
    drop((src, mr));
    assert!(
        bytes(&m)[..LEN - 64].iter().all(|&x| x == 0),
        "a refused request's bytes landed"
    );
}

/// A claim held from a WRITE does not let a READ of the same key through when the region
/// grants no remote reads: the READ gets the target's refusal.
#[test]
fn a_held_claim_grants_only_what_the_region_does() {
    let (a, _b, src, _m, mr) = writable_pair(LEN, 5);
    let at = mr.remote().at(0);
    write_until_mapped(&a, &src, at);
    let before = rdmx::shm::executed_at_post(&a.qp).unwrap();
    // Two elements: the WRITE takes the claim the list holds (a lone element would take
    // the lean path, whose claim ends with its copy).
    let list = [
        SendRequest::write(20, at)
            .sge(LocalSge::new(&src, 0, 32).unwrap())
            .sge(LocalSge::new(&src, 32, 32).unwrap()),
        SendRequest::read(21, at).sge(LocalSge::new(&src, 1024, 64).unwrap()),
    ];
    a.qp.post_send_list(&list).unwrap();
    let got: Vec<_> = completions(&a.cq, 2)
        .iter()
        .map(|c| (c.wr_id, c.status))
        .collect();
    assert_eq!(got, [(20, WcStatus::Success), (21, WcStatus::RemAccessErr)]);
    assert_eq!(rdmx::shm::executed_at_post(&a.qp), Some(before + 1));
    drop(mr);
}

/// The initiator keeps what it looked up of a key from one post to the next; the
/// region's deregistration voids it: a later WRITE with the old rkey gets the target's
/// refusal, and nothing lands in the memory the region covered.
#[test]
fn a_kept_lookup_does_not_outlive_its_region() {
    let (a, _b, src, m, mr) = writable_pair(LEN, 3);
    let at = |off: u64| mr.remote().at(off);
    write_until_mapped(&a, &src, at(0));
    // The next post finds the key as the last one left it.
    write_until_mapped(&a, &src, at(64));
    let stale = at(4096);
    drop(mr);
    let before = rdmx::shm::executed_at_post(&a.qp).unwrap();
    a.qp.post_send(SendRequest::write(30, stale).sge(LocalSge::new(&src, 0, 64).unwrap()))
        .unwrap();
    let c = wait(&a.cq, "a WRITE with a deregistered rkey");
    assert_eq!((c.wr_id, c.status), (30, WcStatus::RemAccessErr));
    assert_eq!(rdmx::shm::executed_at_post(&a.qp), Some(before));
    assert!(
        bytes(&m)[4096..4096 + 64].iter().all(|&x| x == 0),
        "a WRITE with a deregistered rkey landed"
    );
}

/// What was kept of a key from a WRITE grants a later post only what the region does:
/// a READ of a region without remote reads, and a WRITE past its end, get the target's
/// refusal.
#[test]
fn a_kept_lookup_grants_only_what_the_region_does() {
    for (what, late) in [("READ", true), ("WRITE past the end", false)] {
        let (a, _b, src, _m, mr) = writable_pair(LEN, 9);
        write_until_mapped(&a, &src, mr.remote().at(0));
        let before = rdmx::shm::executed_at_post(&a.qp).unwrap();
        let req = match late {
            true => SendRequest::read(40, mr.remote().at(0)),
            false => SendRequest::write(40, mr.remote().at(LEN as u64 - 32)),
        };
        a.qp.post_send(req.sge(LocalSge::new(&src, 1024, 64).unwrap()))
            .unwrap();
        let c = wait(&a.cq, what);
        assert_eq!((c.wr_id, c.status), (40, WcStatus::RemAccessErr), "{what}");
        assert_eq!(rdmx::shm::executed_at_post(&a.qp), Some(before), "{what}");
        drop(mr);
    }
}

/// Connections that come and go on a context whose published regions stay registered
/// are not watched for ever: each watched one keeps its segment mapped.
#[test]
fn connections_that_went_are_not_watched() {
    let target = side();
    let m = Mapping::shared(LEN).unwrap();
    let _mr = register(&target, &m, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    for _ in 0..6 {
        let a = side();
        let qp = target
            .pd
            .create_qp(&target.cq, &target.cq, QpCaps::default())
            .unwrap();
        let (ea, eb) = (a.qp.endpoint(), qp.endpoint());
        a.qp.connect(eb, &ConnectOptions::default()).unwrap();
        qp.connect(ea, &ConnectOptions::default()).unwrap();
        let start = Instant::now();
        while rdmx::shm::data_path(&qp).is_none() {
            assert!(start.elapsed() < DEADLINE, "the shm connection never came");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(rdmx::shm::data_path(&qp), Some("mapped"));
        drop(qp);
        drop(a);
    }
    // The connection made last may still be watched; those before it went.
    let n = testing::watched_connections(&target.ctx).unwrap();
    assert!(n <= 1, "{n} connections watched");
}

/// A target queue pair whose initiator went (its QP failed) and that connects again, to
/// a new initiator, says on its new connection that it accepts requests: the new initiator's WRITEs run on the mapped
/// path as the first one's did.
#[test]
fn a_target_that_connects_again_accepts_mapped_requests() {
    let (a, b, src, _m, mr) = writable_pair(LEN, 9);
    let at = mr.remote().at(0);
    write_until_mapped(&a, &src, at);
    // The initiator goes: the target's QP fails when it sees the connection end.
    drop(a);
    let start = Instant::now();
    while b.qp.state() != QpState::Err {
        assert!(start.elapsed() < DEADLINE, "the target's QP did not fail");
        let _ = b.cq.poll_one().unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    let reset = QpAttr {
        qp_state: QpState::Reset,
        ..QpAttr::default()
    };
    b.qp.modify(&reset, QpAttrMask::STATE).unwrap();
    let a2 = side();
    let src2 = a2
        .pd
        .register(vec![9u8; 4096], Access::LOCAL_WRITE)
        .unwrap();
    let (ea, eb) = (a2.qp.endpoint(), b.qp.endpoint());
    a2.qp.connect(eb, &ConnectOptions::default()).unwrap();
    b.qp.connect(ea, &ConnectOptions::default()).unwrap();
    let start = Instant::now();
    while rdmx::shm::data_path(&a2.qp).is_none() || rdmx::shm::data_path(&b.qp).is_none() {
        assert!(
            start.elapsed() < DEADLINE,
            "the new shm connection never came: {:?} {:?}",
            rdmx::shm::data_path(&a2.qp),
            rdmx::shm::data_path(&b.qp)
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    write_until_mapped(&a2, &src2, at);
    // And the rings carry the new connection's packets.
    let inbox = b.pd.register(vec![0u8; 64], Access::LOCAL_WRITE).unwrap();
    b.qp.post_recv(RecvRequest::new(5).sge(LocalSge::new(&inbox, 0, 64).unwrap()))
        .unwrap();
    a2.qp
        .post_send(SendRequest::send(6).sge(LocalSge::new(&src2, 0, 64).unwrap()))
        .unwrap();
    let c = wait(&a2.cq, "the SEND");
    assert_eq!(c.status, WcStatus::Success, "{c:?}");
    let c = wait(&b.cq, "the receive");
    assert_eq!((c.status, c.wr_id), (WcStatus::Success, 5), "{c:?}");
}

/// Waits until `cond` holds.
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < DEADLINE, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A region of a file registered while the file's last published region is being
/// deregistered (the deregistration waiting for a claim) keeps the file mapped at the
/// peer: the deregistration does not tell the peer to unmap a file offered again
/// meanwhile, and the new region's requests run on the mapped path.
#[test]
fn a_file_offered_again_while_its_last_region_goes_stays_mapped() {
    let (a, b) = pair();
    let src = a.pd.register(vec![7u8; 4096], Access::LOCAL_WRITE).unwrap();
    let m = Mapping::shared(2 * LEN).unwrap();
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    // SAFETY: each region covers half of `m`, which outlives both (they are dropped or
    // joined before the end of the test, `m` after them).
    let first = unsafe {
        b.pd.register_raw(m.as_ptr(), LEN, access, Pinning::Unpinned)
    }
    .unwrap();
    let at = first.remote().at(0);
    write_until_mapped(&a, &src, at);
    // The initiator claims the first region: its deregistration unpublishes it, then
    // waits for the claim to go.
    testing::stall_claim(&a.qp, at.rkey).unwrap();
    let going = std::thread::spawn(move || drop(first));
    wait_until("the first region is unpublished", || {
        !testing::peer_publishes(&a.qp, at.rkey).unwrap()
    });
    // Meanwhile the file's second half is registered: its file is offered again.
    // SAFETY: as for the first region.
    let second = unsafe {
        b.pd.register_raw(m.as_ptr().add(LEN), LEN, access, Pinning::Unpinned)
    }
    .unwrap();
    testing::scribble_claim(&a.qp, 0).unwrap();
    going.join().unwrap();
    assert!(m.is_shared(), "the memory was detached");
    // Every message about the file reached the initiator before the offer of another
    // file that it has once a WRITE into that one runs mapped.
    let m2 = Mapping::shared(LEN).unwrap();
    let other = register(&b, &m2, access);
    write_until_mapped(&a, &src, other.remote().at(0));
    assert_eq!(
        testing::peer_files_mapped(&a.qp).unwrap(),
        2,
        "the initiator unmapped the file offered again"
    );
    let before = rdmx::shm::executed_at_post(&a.qp).unwrap();
    a.qp.post_send(
        SendRequest::write(3, second.remote().at(0)).sge(LocalSge::new(&src, 0, 64).unwrap()),
    )
    .unwrap();
    let c = wait(&a.cq, "a WRITE to the second region");
    assert_eq!(c.status, WcStatus::Success, "{c:?}");
    assert_eq!(
        rdmx::shm::executed_at_post(&a.qp),
        Some(before + 1),
        "the WRITE to the second region did not run mapped"
    );
    drop(other);
    drop(second);
    assert_eq!(&bytes(&m)[LEN..LEN + 64], &[7u8; 64]);
}

#[path = "hostile_shm_mapped/deregistration.rs"]
mod deregistration;
#[path = "hostile_shm_mapped/loans.rs"]
mod loans;
#[path = "hostile_shm_mapped/post_lists.rs"]
mod post_lists;
