//! Owned-buffer posts: pool buffers and cached registrations move into requests from safe
//! code and come back with their completions; received bytes are read through the buffer
//! without a copy.

use std::time::{Duration, Instant};

use rdmx::{
    Access, BufferPool, CacheConfig, CachedBuf, Completion, CompletionQueue, ConnectOptions,
    Context, Error, Invalidation, KeyUse, PoolBuf, PoolConfig, QpCaps, QueuePair, RegCache,
    SendRequest, WcOpcode, WcStatus,
};

const DEADLINE: Duration = Duration::from_secs(10);

struct Pair {
    a: QueuePair,
    b: QueuePair,
    cq_a: CompletionQueue,
    cq_b: CompletionQueue,
    pool_b: BufferPool,
    pool_a: BufferPool,
}

fn pair(provider: &str) -> Pair {
    let (ca, cb) = (
        Context::open_provider(provider).unwrap(),
        Context::open_provider(provider).unwrap(),
    );
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let (cq_a, cq_b) = (ca.create_cq(64).unwrap(), cb.create_cq(64).unwrap());
    let a = pa.create_qp(&cq_a, &cq_a, QpCaps::default()).unwrap();
    let b = pb.create_qp(&cq_b, &cq_b, QpCaps::default()).unwrap();
    let opts = ConnectOptions::default();
    let (ea, eb) = (a.endpoint(), b.endpoint());
    a.connect(eb, &opts).unwrap();
    b.connect(ea, &opts).unwrap();
    let local = PoolConfig::default().with_access(Access::LOCAL_WRITE);
    Pair {
        pool_a: BufferPool::new(pa, local.clone()).unwrap(),
        pool_b: BufferPool::new(pb, local).unwrap(),
        a,
        b,
        cq_a,
        cq_b,
    }
}

#[track_caller]
fn wait_one(cq: &CompletionQueue, what: &str) -> Completion {
    let start = Instant::now();
    let mut c = [Completion::default()];
    loop {
        if cq.wait(&mut c, Duration::from_millis(100)).unwrap() == 1 {
            return c[0];
        }
        assert!(start.elapsed() < DEADLINE, "no completion for {what}");
    }
}

fn send_and_receive_through_owned_buffers(provider: &str) {
    let p = pair(provider);
    for round in 0..50u64 {
        let rx = p.pool_b.get(4096).unwrap();
        p.b.post_recv_buf(round, rx).map_err(|(e, _)| e).unwrap();
        // Not completed yet: the buffer stays with the queue pair, even for a forged
        // completion naming it.
        let forged = Completion {
            wr_id: round,
            opcode: WcOpcode::Recv,
            qp_num: p.b.qp_num(),
            src_qp: 0,
            grh: false,
            ..Completion::default()
        };
        assert!(p.b.take_buf::<PoolBuf>(&forged).is_none());

        let msg = format!("message {round} through an owned buffer");
        let mut tx = p.pool_a.get(msg.len()).unwrap();
        tx.as_mut_slice().unwrap().copy_from_slice(msg.as_bytes());
        p.a.post_send_buf(SendRequest::send(1000 + round), tx)
            .map_err(|(e, _)| e)
            .unwrap();

        let sent = wait_one(&p.cq_a, "the SEND");
        assert_eq!((sent.wr_id, sent.status), (1000 + round, WcStatus::Success));
        let tx: PoolBuf = p.a.take_buf(&sent).expect("the send buffer comes back");
        assert_eq!(tx.as_slice().unwrap(), msg.as_bytes());
        assert!(p.a.take_buf::<PoolBuf>(&sent).is_none(), "given back once");

        let got = wait_one(&p.cq_b, "the receive");
        assert_eq!((got.wr_id, got.status), (round, WcStatus::Success));
        let rx: PoolBuf = p.b.take_buf(&got).expect("the receive buffer comes back");
        // Read in place: no copy, no unsafe.
        assert_eq!(
            &rx.as_slice().unwrap()[..got.byte_len as usize],
            msg.as_bytes()
        );
    }
}

#[test]
fn owned_buffers_on_loopback() {
    send_and_receive_through_owned_buffers("loopback");
}

#[test]
fn owned_buffers_on_tcp() {
    send_and_receive_through_owned_buffers("tcp");
}

#[test]
fn owned_posts_refuse_what_would_lose_the_buffer() {
    let p = pair("loopback");
    let rx = p.pool_b.get(64).unwrap();
    p.b.post_recv_buf(7, rx).map_err(|(e, _)| e).unwrap();
    let again = p.pool_b.get(64).unwrap();
    let (e, back) = p.b.post_recv_buf(7, again).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert_eq!(back.len(), 64, "a refused post gives the buffer back");
    let tx = p.pool_a.get(8).unwrap();
    let (e, _) =
        p.a.post_send_buf(SendRequest::send(1).unsignaled(), tx)
            .unwrap_err();
    assert!(e.to_string().contains("signaled"), "{e}");
}

/// A send and a receive of one queue pair may share an id: the send's completion gives
/// back the send's buffer only, not the receive's (still posted), whatever opcode the
/// completion passed to `take_buf` says.
#[test]
fn a_send_s_completion_does_not_give_back_a_receive_with_the_same_id() {
    let p = pair("loopback");
    let rx = p.pool_b.get(64).unwrap();
    p.b.post_recv_buf(7, rx).map_err(|(e, _)| e).unwrap();
    let landing = p.pool_a.get(64).unwrap();
    p.a.post_recv_buf(1, landing).map_err(|(e, _)| e).unwrap();
    let tx = p.pool_b.get(8).unwrap();
    p.b.post_send_buf(SendRequest::send(7), tx)
        .map_err(|(e, _)| e)
        .unwrap();
    let c = wait_one(&p.cq_b, "the SEND");
    assert_eq!(
        (c.wr_id, c.opcode, c.status),
        (7, WcOpcode::Send, WcStatus::Success)
    );
    let as_receive = Completion {
        opcode: WcOpcode::Recv,
        ..c
    };
    assert!(
        p.b.take_buf::<PoolBuf>(&as_receive).is_none(),
        "the receive's buffer came back while it is posted"
    );
    assert_eq!(p.b.take_buf::<PoolBuf>(&c).map(|b| b.len()), Some(8));
    // The receive's buffer comes back with its own completion.
    let msg = p.pool_a.get(5).unwrap();
    p.a.post_send_buf(SendRequest::send(2), msg)
        .map_err(|(e, _)| e)
        .unwrap();
    let c = wait_one(&p.cq_b, "the receive");
    assert_eq!((c.wr_id, c.opcode), (7, WcOpcode::Recv));
    assert!(p.b.take_buf::<PoolBuf>(&c).is_some());
}

/// A plain request posted with the id of an owned one, before or after it, on the same
/// queue: its completion does not give back the owned buffer, still posted; the owned
/// request's own completion does, with the bytes that landed in it.
#[test]
fn a_plain_request_with_an_owned_request_s_id_does_not_give_its_buffer_back() {
    let p = pair("loopback");
    // Receives: a plain one (no elements) first, the owned one behind it.
    p.b.post_recv(rdmx::RecvRequest::new(7)).unwrap();
    let rx = p.pool_b.get(64).unwrap();
    p.b.post_recv_buf(7, rx).map_err(|(e, _)| e).unwrap();
    p.a.post_send(SendRequest::send(1)).unwrap();
    let c = wait_one(&p.cq_b, "the empty SEND's receive");
    assert_eq!((c.wr_id, c.status, c.byte_len), (7, WcStatus::Success, 0));
    assert!(
        p.b.take_buf::<PoolBuf>(&c).is_none(),
        "the plain receive's completion gave back the owned receive's buffer"
    );
    assert_eq!(wait_one(&p.cq_a, "the empty SEND").wr_id, 1);
    let mut tx = p.pool_a.get(5).unwrap();
    tx.as_mut_slice().unwrap().copy_from_slice(b"owned");
    p.a.post_send_buf(SendRequest::send(2), tx)
        .map_err(|(e, _)| e)
        .unwrap();
    let c = wait_one(&p.cq_b, "the owned receive");
    assert_eq!((c.wr_id, c.status, c.byte_len), (7, WcStatus::Success, 5));
    let rx =
        p.b.take_buf::<PoolBuf>(&c)
            .expect("the owned receive's buffer");
    assert_eq!(&rx.as_slice().unwrap()[..5], b"owned");
    let c = wait_one(&p.cq_a, "the owned SEND");
    assert_eq!(c.wr_id, 2);
    assert!(p.a.take_buf::<PoolBuf>(&c).is_some());

    // Sends: a plain SEND completes while the owned SEND behind it, with its id, waits
    // for a receive (RNR).
    p.b.post_recv(rdmx::RecvRequest::new(50)).unwrap();
    p.a.post_send(SendRequest::send(3)).unwrap();
    let tx = p.pool_a.get(5).unwrap();
    p.a.post_send_buf(SendRequest::send(3), tx)
        .map_err(|(e, _)| e)
        .unwrap();
    let c = wait_one(&p.cq_a, "the plain SEND");
    assert_eq!((c.wr_id, c.status), (3, WcStatus::Success));
    assert!(
        p.a.take_buf::<PoolBuf>(&c).is_none(),
        "the plain SEND's completion gave back the owned SEND's buffer"
    );
    assert_eq!(wait_one(&p.cq_b, "the plain SEND's receive").wr_id, 50);
    let rx = p.pool_b.get(64).unwrap();
    p.b.post_recv_buf(51, rx).map_err(|(e, _)| e).unwrap();
    let c = wait_one(&p.cq_a, "the owned SEND");
    assert_eq!((c.wr_id, c.status), (3, WcStatus::Success));
    assert_eq!(p.a.take_buf::<PoolBuf>(&c).map(|b| b.len()), Some(5));
}

/// The ids rdmx keeps for its owned and async requests are refused on every post, so no
/// request can complete under one of them but its own.
#[test]
fn reserved_request_ids_are_refused() {
    let p = pair("loopback");
    for r in 100..103 {
        p.b.post_recv(rdmx::RecvRequest::new(r)).unwrap();
    }
    for id in [
        *rdmx::RESERVED_WR_IDS.start(),
        *rdmx::RESERVED_WR_IDS.end(),
        *rdmx::RESERVED_WR_IDS.start() | 1 << 47,
    ] {
        let refused = |r: rdmx::Result<()>, what: &str| {
            let e = r.expect_err(what);
            assert!(e.to_string().contains("RESERVED_WR_IDS"), "{what}: {e}");
        };
        refused(p.a.post_send(SendRequest::send(id)), "post_send");
        refused(
            p.a.post_send_list(&[SendRequest::send(1), SendRequest::send(id)])
                .map_err(|(i, e)| {
                    assert_eq!(i, 1);
                    e
                }),
            "post_send_list",
        );
        refused(p.b.post_recv(rdmx::RecvRequest::new(id)), "post_recv");
        let rx = p.pool_b.get(64).unwrap();
        refused(
            p.b.post_recv_buf(id, rx).map_err(|(e, _)| e),
            "post_recv_buf",
        );
        let tx = p.pool_a.get(64).unwrap();
        refused(
            p.a.post_send_buf(SendRequest::send(id), tx)
                .map_err(|(e, _)| e),
            "post_send_buf",
        );
    }
    // Each list's first request went; the ids on either side of the range are anyone's.
    for _ in 0..3 {
        assert_eq!(wait_one(&p.cq_a, "a list's first SEND").wr_id, 1);
        wait_one(&p.cq_b, "a list's first SEND's receive");
    }
    for id in [
        *rdmx::RESERVED_WR_IDS.start() - 1,
        *rdmx::RESERVED_WR_IDS.end() + 1,
    ] {
        p.b.post_recv(rdmx::RecvRequest::new(id)).unwrap();
        p.a.post_send(SendRequest::send(id)).unwrap();
        assert_eq!(wait_one(&p.cq_a, "a SEND").wr_id, id);
        assert_eq!(wait_one(&p.cq_b, "a receive").wr_id, id);
    }
}

/// Two threads post owned receives with the same id at once, 100 times: exactly one of
/// each pair is taken, the other refused with its buffer (before, both could pass the
/// check, and the second parked its buffer over the first's, which went back to the pool
/// while its receive was posted).
#[test]
fn concurrent_owned_posts_with_one_id_take_one() {
    let p = pair("loopback");
    for id in 0..100u64 {
        let barrier = std::sync::Barrier::new(2);
        let posted = std::thread::scope(|s| {
            let post = || {
                let buf = p.pool_b.get(64).unwrap();
                barrier.wait();
                p.b.post_recv_buf(id, buf).is_ok()
            };
            let one = s.spawn(post);
            let two = s.spawn(post);
            [one.join().unwrap(), two.join().unwrap()]
        });
        assert_eq!(
            posted.iter().filter(|&&ok| ok).count(),
            1,
            "posts of id {id}: {posted:?}"
        );
    }
}

/// A pool's memory stays mapped for as long as a provider holds a reference to its
/// registration (as it does while it places a peer's WRITE), even once every buffer and
/// the pool itself are gone: the registration owns the slab's mapping.
#[test]
fn a_pool_s_memory_outlives_the_pool_while_a_provider_uses_it() {
    let ctx = Context::open_provider("loopback").unwrap();
    let pd = ctx.alloc_pd();
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let pool = BufferPool::new(pd.clone(), PoolConfig::default().with_access(access)).unwrap();
    let buf = pool.get(4096).unwrap();
    let (addr, rkey) = (buf.addr() as u64, buf.rkey());
    let held = pd
        .check(rkey, KeyUse::Remote, addr, 4096, Access::REMOTE_WRITE)
        .unwrap();
    assert!(
        held.owns_memory(),
        "the pool's registration does not own its memory"
    );
    drop(buf);
    drop(pool);
    held.write_at(0, &[7u8; 64]).unwrap();
    let mut back = [0u8; 64];
    held.read_at(0, &mut back).unwrap();
    assert_eq!(back, [7u8; 64]);
}

#[test]
fn a_cached_buffer_posts_from_safe_code_and_comes_back() {
    let p = pair("loopback");
    let cache = RegCache::new(
        p.b.pd().clone(),
        CacheConfig::default().invalidation(Invalidation::Explicit),
    )
    .unwrap();
    let rx = CachedBuf::new(&cache, vec![0u8; 256]).unwrap();
    p.b.post_recv_buf(3, rx).map_err(|(e, _)| e).unwrap();
    let mut tx = p.pool_a.get(11).unwrap();
    tx.as_mut_slice().unwrap().copy_from_slice(b"cached hi!!");
    p.a.post_send_buf(SendRequest::send(4), tx)
        .map_err(|(e, _)| e)
        .unwrap();
    let got = wait_one(&p.cq_b, "the receive");
    let rx: CachedBuf = p.b.take_buf(&got).expect("the cached buffer comes back");
    assert_eq!(&rx.as_slice()[..11], b"cached hi!!");
    // The same memory again: a cache hit.
    let hits = cache.stats().hits;
    let again = CachedBuf::new(&cache, rx.into_inner()).unwrap();
    assert_eq!(cache.stats().hits, hits + 1);
    drop(again);
}

/// Memory the cache holds a registration with remote access for (an earlier `get_raw` for
/// remote use, idle now) is registered anew, for local access only, when it becomes a
/// `CachedBuf`: a peer holding the old rkey cannot change the bytes its slices give out.
#[test]
fn a_cached_buffer_never_takes_a_registration_with_remote_access() {
    let p = pair("loopback");
    let cache = RegCache::new(
        p.b.pd().clone(),
        CacheConfig::default().invalidation(Invalidation::Explicit),
    )
    .unwrap();
    let mut mem = vec![0u8; 4096].into_boxed_slice();
    let addr = mem.as_ptr() as u64;
    // SAFETY: `mem` stays allocated, in place, until after the handle is dropped.
    let old = unsafe {
        cache.get_raw(
            mem.as_mut_ptr(),
            mem.len(),
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        )
    }
    .unwrap();
    let rkey = old.region().rkey();
    drop(old);
    let buf = CachedBuf::new(&cache, mem).unwrap();
    assert_eq!(buf.as_slice().as_ptr() as u64, addr);
    let mut tx = p.pool_a.get(8).unwrap();
    tx.as_mut_slice().unwrap().copy_from_slice(b"scribble");
    p.a.post_send_buf(SendRequest::write(1, rdmx::RemoteAddr { addr, rkey }), tx)
        .map_err(|(e, _)| e)
        .unwrap();
    let c = wait_one(&p.cq_a, "the WRITE through the old rkey");
    assert_ne!(c.status, WcStatus::Success, "{c:?}");
    assert!(
        buf.as_slice().iter().all(|&b| b == 0),
        "the peer wrote the buffer"
    );
}

/// A buffer longer than one scatter/gather element takes (4 GiB - 1) is refused, not
/// posted as its length's low 32 bits (its pages are never touched).
#[test]
fn a_cached_buffer_of_4_gib_is_refused() {
    let p = pair("loopback");
    let cache = RegCache::new(
        p.b.pd().clone(),
        CacheConfig::default().invalidation(Invalidation::Explicit),
    )
    .unwrap();
    let e = CachedBuf::new(&cache, vec![0u8; 1 << 32]).unwrap_err();
    assert!(e.to_string().contains("4 GiB"), "{e}");
}

/// A cached buffer dropped (its memory freed) takes its registration out of the cache,
/// also without the cache's monitor: a later buffer at the same address must not hit it
/// (on an adapter it pins the freed pages). One handed back with `into_inner` stays
/// cached.
#[test]
fn a_freed_cached_buffer_leaves_no_registration_behind() {
    let ctx = Context::open_provider("loopback").unwrap();
    let cache = RegCache::new(
        ctx.alloc_pd(),
        CacheConfig::default().invalidation(Invalidation::Explicit),
    )
    .unwrap();
    let kept = CachedBuf::new(&cache, vec![0u8; 1 << 20])
        .unwrap()
        .into_inner();
    assert_eq!(cache.stats().entries, 1, "memory handed back stays cached");
    let freed = CachedBuf::new(&cache, vec![0u8; 1 << 20]).unwrap();
    assert_eq!(cache.stats().entries, 2);
    drop(freed);
    let st = cache.stats();
    assert_eq!(
        st.entries, 1,
        "the freed buffer's registration is still cached: {st:?}"
    );
    assert_eq!(st.invalidations, 1);
    drop(kept);
}

#[test]
fn buffers_of_a_failed_qp_come_back_with_the_flush() {
    let p = pair("loopback");
    for i in 0..4 {
        let rx = p.pool_b.get(64).unwrap();
        p.b.post_recv_buf(i, rx).map_err(|(e, _)| e).unwrap();
    }
    let err = rdmx::QpAttr {
        qp_state: rdmx::QpState::Err,
        ..Default::default()
    };
    p.b.modify(&err, rdmx::QpAttrMask::STATE).unwrap();
    for _ in 0..4 {
        let c = wait_one(&p.cq_b, "a flushed receive");
        assert_eq!(c.status, WcStatus::WrFlushErr);
        let _: PoolBuf = p.b.take_buf(&c).expect("a flushed buffer comes back");
    }
}
