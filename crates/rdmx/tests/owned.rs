//! Owned-buffer posts: pool buffers and cached registrations move into requests from safe
//! code and come back with their completions; received bytes are read through the buffer
//! without a copy.

use std::time::{Duration, Instant};

use rdmx::{
    Access, BufferPool, CacheConfig, CachedBuf, Completion, CompletionQueue, ConnectOptions,
    Context, Error, Invalidation, PoolBuf, PoolConfig, QpCaps, QueuePair, RegCache, SendRequest,
    WcOpcode, WcStatus,
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
