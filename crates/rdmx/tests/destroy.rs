//! Destroying a queue pair lets go of the application's memory at once, as
//! `ibv_destroy_qp` does: once a queue pair with requests in flight and the region they
//! use are dropped, the region's memory is unmapped before the second drop returns,
//! whatever the provider's progress thread is doing with the queue pair at that moment.
//!
//! Each software provider gets connected pairs (each side its own context, as two
//! processes would have). A streams WRITEs to B and, with some in flight and B's
//! acknowledgements arriving, drops its queue pair and then its region. The region is
//! memfd-backed, so its file, not its address (which another thread may map again at
//! once), shows whether it is still mapped. Many rounds: the race this guards against is
//! narrow. A progress thread that holds the queue pair while it handles an
//! acknowledgement would otherwise drop the queue pair, and with it the requests' hold on
//! the memory, on its own thread a moment later.
//!
//! The owned buffers of requests in flight come back to their pool when their queue pair
//! goes (round after round, a pool with room for one round's never runs out). On shm, a
//! peer that copies a payload out of the queue pair's memory (a descriptor's, on the
//! `cma` and `direct` data paths) holds the destruction until the copy is over, and one
//! stopped mid-copy holds it for `DRAIN_BOUND` at most; the buffers it may still read are
//! then never used again.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdmx::{Access, ConnectOptions, Context, LocalSge, Mapping, QpCaps, RemoteAddr, SendRequest};

const ROUNDS: usize = 100;
const REGION: usize = 256 << 10;
const MSG: usize = 8 << 10;
/// WRITEs posted per round: more than go out at once, so that some are in flight, and
/// some queued, when the queue pair goes.
const WRITES: u64 = 48;

fn open_udp() -> rdmx::Result<Context> {
    common::open_udp(10)
}

fn destroy_with_requests_in_flight(open: fn() -> rdmx::Result<Context>) {
    let (ca, cb) = (open().unwrap(), open().unwrap());
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let target = pb
        .register(
            Mapping::new(REGION).unwrap(),
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        )
        .unwrap();
    let remote = RemoteAddr {
        addr: target.addr() as u64,
        rkey: target.rkey(),
    };
    for round in 0..ROUNDS {
        let (qa, qb) = (ca.create_cq(256).unwrap(), cb.create_cq(256).unwrap());
        let caps = QpCaps::default().max_send_wr(WRITES as usize);
        let a = pa.create_qp(&qa, &qa, caps).unwrap();
        let b = pb.create_qp(&qb, &qb, QpCaps::default()).unwrap();
        let opts = ConnectOptions::default();
        a.connect(b.endpoint(), &opts).unwrap();
        b.connect(a.endpoint(), &opts).unwrap();
        let mr = pa
            .register(Mapping::shared(REGION).unwrap(), Access::LOCAL_WRITE)
            .unwrap();
        let file = common::mapped_file(mr.addr()).expect("the region is a mapped memfd");
        for id in 0..WRITES {
            let off = (id as usize * MSG) % REGION;
            let sge = LocalSge::new(&mr, off, MSG).unwrap();
            a.post_send(SendRequest::write(id, remote).sge(sge))
                .unwrap();
        }
        // The first completion: acknowledgements are arriving, the progress threads
        // handle the queue pair.
        let deadline = Instant::now() + Duration::from_secs(10);
        while qa.poll_one().unwrap().is_none() {
            assert!(
                Instant::now() < deadline,
                "round {round}: no WRITE completed"
            );
        }
        drop(a);
        drop(mr);
        assert_eq!(
            ca.registered_regions(),
            0,
            "round {round}: a registration leaked"
        );
        assert!(
            !common::file_is_mapped(&file),
            "round {round}: the region's memory is still mapped after its queue pair and \
             it were dropped"
        );
        drop(b);
    }
}

/// One test per software provider (loopback, tcp, shm, udp), each calling `$run` with
/// the provider's opener, in a module named `$name`.
macro_rules! on_every_provider {
    ($name:ident, $run:ident) => {
        mod $name {
            use super::*;

            #[test]
            fn loopback() {
                $run(Context::open_default);
            }

            #[test]
            fn tcp() {
                $run(|| Context::open_provider("tcp"));
            }

            #[test]
            fn shm() {
                $run(|| Context::open_provider("shm"));
            }

            #[test]
            fn udp() {
                $run(open_udp);
            }
        }
    };
}

on_every_provider!(
    destroying_a_queue_pair_releases_its_memory_at_once,
    destroy_with_requests_in_flight
);

/// Buffers per slab of the pools below, and slabs a pool may register: one round's
/// buffers fit, a second round's would not if the first's were never given back.
const POOL_BUFS: usize = 16;
const BUF: usize = 4096;
const RECVS: u64 = 8;
const SENDS: u64 = 4;

fn pool(pd: &rdmx::ProtectionDomain) -> rdmx::BufferPool {
    rdmx::BufferPool::new(
        pd.clone(),
        rdmx::PoolConfig::default()
            .with_classes([BUF])
            .with_slab_bytes(POOL_BUFS * BUF)
            .with_max_bytes(Some(POOL_BUFS * BUF))
            .with_access(Access::LOCAL_WRITE),
    )
    .unwrap()
}

/// Connected queue pairs on contexts of their own (A's in `pd`, the pool's), and A's
/// owned buffers in flight: receives nothing will match, and SENDs B has no receive for
/// (retried after each RNR NAK without end).
fn pair_with_owned_buffers_in_flight(
    pd: &rdmx::ProtectionDomain,
    cb: &Context,
    pool: &rdmx::BufferPool,
) -> (rdmx::QueuePair, rdmx::QueuePair, rdmx::CompletionQueue) {
    let ca = pd.context();
    let (qa, qb) = (ca.create_cq(64).unwrap(), cb.create_cq(64).unwrap());
    let a = pd.create_qp(&qa, &qa, QpCaps::default()).unwrap();
    let b = cb
        .alloc_pd()
        .create_qp(&qb, &qb, QpCaps::default())
        .unwrap();
    let opts = ConnectOptions::default();
    a.connect(b.endpoint(), &opts).unwrap();
    b.connect(a.endpoint(), &opts).unwrap();
    for id in 0..RECVS {
        a.post_recv_buf(id, pool.get(BUF).unwrap())
            .map_err(|(e, _)| e)
            .unwrap();
    }
    for id in 0..SENDS {
        a.post_send_buf(SendRequest::send(RECVS + id), pool.get(BUF).unwrap())
            .map_err(|(e, _)| e)
            .unwrap();
    }
    (a, b, qa)
}

/// Destroying a queue pair gives back the owned buffers of its requests in flight (the
/// provider can no longer reach them): round after round, the pool never runs out.
fn owned_buffers_in_flight_come_back(open: fn() -> rdmx::Result<Context>) {
    let (ca, cb) = (open().unwrap(), open().unwrap());
    let pa = ca.alloc_pd();
    let pool = pool(&pa);
    for round in 0..4 {
        let (a, b, _cq) = pair_with_owned_buffers_in_flight(&pa, &cb, &pool);
        drop(a);
        drop(b);
        assert_eq!(
            pool.stats().exhausted,
            0,
            "round {round}: the buffers in flight on the last queue pair did not come back"
        );
    }
}

on_every_provider!(
    owned_buffers_in_flight_come_back_when_their_queue_pair_goes,
    owned_buffers_in_flight_come_back
);

/// Makes `qp` (shm) look stopped mid-copy out of the memory of `peer`, once both have
/// their connection (it comes moments after the move to RTR).
fn stall_copy_when_connected(qp: &rdmx::QueuePair, peer: &rdmx::QueuePair) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while rdmx::shm::data_path(qp).is_none() || rdmx::shm::data_path(peer).is_none() {
        assert!(
            Instant::now() < deadline,
            "the shm queue pair never connected"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    rdmx::shm::testing::stall_copy(qp).unwrap();
}

/// shm queue pairs: A (its owned buffers in flight, from `pool`) and B, stopped mid-copy
/// out of A's memory.
struct Stalled {
    b: rdmx::QueuePair,
    a: rdmx::QueuePair,
    _cq: rdmx::CompletionQueue,
    pool: rdmx::BufferPool,
    pa: rdmx::ProtectionDomain,
    cb: Context,
}

fn stalled() -> Stalled {
    let open = || Context::open_provider("shm").unwrap();
    let (ca, cb) = (open(), open());
    let pa = ca.alloc_pd();
    let pool = pool(&pa);
    let (a, b, _cq) = pair_with_owned_buffers_in_flight(&pa, &cb, &pool);
    stall_copy_when_connected(&b, &a);
    Stalled {
        b,
        a,
        _cq,
        pool,
        pa,
        cb,
    }
}

/// shm: a peer that copies a payload out of a queue pair's memory (a descriptor's) when
/// the queue pair is destroyed holds the destruction until the copy is over, so that the
/// memory is not used again under it; then the owned buffers come back.
#[test]
fn an_shm_queue_pair_goes_only_once_its_peer_stopped_copying_from_it() {
    let Stalled {
        b,
        a,
        _cq,
        pool,
        pa,
        cb,
    } = stalled();
    let ended = AtomicBool::new(false);
    let ender = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            ended.store(true, Ordering::SeqCst);
            rdmx::shm::testing::end_copy(&b).unwrap();
        });
        drop(a);
        ended.load(Ordering::SeqCst)
    });
    assert!(
        ender,
        "the queue pair went while its peer still copied from it"
    );
    // The next round's buffers fit: this round's came back.
    let (a, b2, _cq2) = pair_with_owned_buffers_in_flight(&pa, &cb, &pool);
    assert_eq!(
        pool.stats().exhausted,
        0,
        "the buffers in flight did not come back"
    );
    drop((a, b, b2));
}

/// shm: a peer stopped mid-copy does not hold a destruction for longer than
/// `DRAIN_BOUND`; the owned buffers it may still read are never used again (leaked).
#[test]
fn an_shm_peer_stopped_mid_copy_holds_a_destruction_for_a_bounded_time() {
    let Stalled {
        b,
        a,
        _cq,
        pool,
        pa: _pa,
        cb: _cb,
    } = stalled();
    let t = Instant::now();
    drop(a);
    assert!(
        t.elapsed() >= rdmx::shm::DRAIN_BOUND,
        "the queue pair went before the bound while its peer still copied from it"
    );
    // This round's buffers were kept from reuse: the pool has too few for another.
    let got: Vec<_> = (0..RECVS + SENDS)
        .map_while(|_| pool.get(BUF).ok())
        .collect();
    assert!(
        got.len() < (RECVS + SENDS) as usize,
        "buffers a stalled peer may still read were given back ({} of {}; {:?})",
        got.len(),
        RECVS + SENDS,
        pool.stats()
    );
    drop(b);
}
