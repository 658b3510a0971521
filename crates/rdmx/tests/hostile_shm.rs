//! A broken or hostile peer on the shm provider: garbage in the ring, producer indices
//! beyond the ring, records that claim more than the ring holds, a connection without the
//! secret. Each time the victim neither crashes nor hangs nor writes outside what its keys
//! grant: its queue pair goes to ERR with a logged reason, and every outstanding request
//! completes with an error status.

#[path = "common/logs.rs"]
mod logs;

use std::time::{Duration, Instant};

use rdmx::{
    Access, Completion, CompletionQueue, ConnectOptions, Context, LocalSge, ProtectionDomain,
    QpCaps, QpState, QueuePair, RecvRequest, SendRequest, WcStatus,
};

use logs::wait_logged;

const DEADLINE: Duration = Duration::from_secs(30);

struct Side {
    _ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
}

/// A side on the ring data path, or on cma; both sides are in this process, so the
/// default there (direct) is turned off except where a test asks for it.
fn side(cma: bool) -> Side {
    side_with(
        rdmx::shm::Options::default()
            .ring_bytes(64 << 10)
            .cma(cma)
            .direct(false),
    )
}

fn side_with(opts: rdmx::shm::Options) -> Side {
    // Capture logs from the start.
    let _ = logs::logs();
    let ctx = Context::open(opts).unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(64).unwrap();
    let qp = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
    Side {
        _ctx: ctx,
        pd,
        cq,
        qp,
    }
}

/// A connected pair: the victim and its peer.
fn pair() -> (Side, Side) {
    pair_with(false)
}

/// [`pair`], both sides on the cma data path or not.
fn pair_with(cma: bool) -> (Side, Side) {
    connect(side(cma), side(cma))
}

/// Connects a victim `a` and its peer `b`.
fn connect(a: Side, b: Side) -> (Side, Side) {
    let (ea, eb) = (a.qp.endpoint(), b.qp.endpoint());
    a.qp.connect(eb, &ConnectOptions::default()).unwrap();
    // The peer asks for the longest RNR wait (code 0, 655 ms): after its first RNR NAK it
    // writes nothing into the victim's ring for that long, so a scribbled index is not
    // overwritten by the peer's next record before the victim reads it.
    b.qp.connect(ea, &ConnectOptions::default().min_rnr_timer(0))
        .unwrap();
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

/// Polls `cq` for `how_long` (polls drive progress), failing with `what` if anything
/// completes.
fn quiet(cq: &CompletionQueue, how_long: Duration, what: &str) {
    let start = Instant::now();
    while start.elapsed() < how_long {
        assert!(cq.poll_one().unwrap().is_none(), "{what}");
        std::thread::yield_now();
    }
}

/// Puts `bytes` in the victim's incoming ring (their first four, the kind word that
/// publishes a record, last) while it has a receive posted and a SEND outstanding (the peer has no receive: RNR, retried
/// forever; the first RNR NAK is read before), then checks
/// both complete with an error, the QP is in ERR with `reason` logged, and a region
/// without remote access kept its bytes.
fn hostile(bytes: &[u8], reason: &str) {
    let (v, _peer) = pair();
    let inbox = v.pd.register(vec![0u8; 4096], Access::LOCAL_WRITE).unwrap();
    let closed =
        v.pd.register(vec![0x5au8; 4096], Access::LOCAL_WRITE)
            .unwrap();
    v.qp.post_recv(RecvRequest::new(1).sge(LocalSge::new(&inbox, 0, 4096).unwrap()))
        .unwrap();
    v.qp.post_send(SendRequest::send(2).sge(LocalSge::new(&closed, 0, 64).unwrap()))
        .unwrap();
    // Let the victim read the first RNR NAK (polls drive progress): then the peer writes
    // nothing for 655 ms, and the scribble is the next record the victim reads.
    let start = Instant::now();
    while rdmx::shm::testing::incoming_read(&v.qp).unwrap() == 0 {
        assert!(
            v.cq.poll_one().unwrap().is_none(),
            "a completion before the scribble"
        );
        assert!(start.elapsed() < DEADLINE, "no RNR NAK came");
        std::thread::yield_now();
    }
    rdmx::shm::testing::scribble_incoming(&v.qp, bytes).unwrap();
    let mut ids = Vec::new();
    for _ in 0..2 {
        let c = wait(&v.cq, "the outstanding requests to fail");
        assert_ne!(c.status, WcStatus::Success, "{c:?}");
        ids.push(c.wr_id);
    }
    ids.sort();
    assert_eq!(ids, [1, 2]);
    assert_eq!(v.qp.state(), QpState::Err);
    wait_logged("WARN", &["closing the shared-memory connection", reason]);
    let mut got = vec![0u8; 4096];
    closed.read_at(0, &mut got).unwrap();
    assert!(
        got.iter().all(|&b| b == 0x5a),
        "a region without remote access changed"
    );
    assert!(
        v.cq.poll_one().unwrap().is_none(),
        "a completion came twice"
    );
}

#[test]
fn garbage_in_the_ring() {
    hostile(&[0xff; 256], "an unknown record kind");
}

#[test]
fn a_record_the_peer_did_not_publish_is_not_read() {
    // A peer that wrote a record (here one no producer writes) but not its kind word:
    // the victim reads nothing, and its QP stays usable.
    let (v, _peer) = pair();
    // (The side that waits gets its connection a moment after `pair` returns.)
    data_path(&v.qp);
    let inbox = v.pd.register(vec![0u8; 4096], Access::LOCAL_WRITE).unwrap();
    v.qp.post_recv(RecvRequest::new(1).sge(LocalSge::new(&inbox, 0, 4096).unwrap()))
        .unwrap();
    let mut rec = vec![0u8; 4];
    rec.extend_from_slice(&[0xff; 252]);
    rdmx::shm::testing::scribble_incoming(&v.qp, &rec).unwrap();
    quiet(
        &v.cq,
        Duration::from_millis(200),
        "a completion from nothing",
    );
    assert_eq!(v.qp.state(), QpState::Rts);
}

#[test]
fn a_record_longer_than_the_ring() {
    // Kind 1 (packet), a 12-byte prefix, payload at 32, 1 GiB of payload.
    let mut rec = Vec::new();
    for v in [1u32, 12, 32, 1 << 30] {
        rec.extend_from_slice(&v.to_ne_bytes());
    }
    hostile(&rec, "longer than the ring holds");
}

#[test]
fn a_record_that_is_not_a_packet() {
    // A well-formed record whose prefix is no valid packet (opcode 0xff).
    let mut rec = Vec::new();
    for v in [1u32, 12, 32, 0] {
        rec.extend_from_slice(&v.to_ne_bytes());
    }
    rec.extend_from_slice(&[0xff; 16]);
    hostile(&rec, "unknown opcode");
}

#[test]
fn a_wrap_record_at_the_start() {
    hostile(&[2, 0, 0, 0], "wrap record in the wrong place");
}

/// A victim and a peer `mallory` that connects to it rather than waits: of two sides
/// the one with the smaller QP number connects, whatever the PSNs (each context draws
/// its QP numbers from a random start, so two are equal only by chance).
fn victim_and_mallory() -> (Side, Side) {
    second_connects(|| side(false), || side(false))
}

/// A side from `first` and one from `second`, drawn again until the second has the
/// smaller QP number: of two sides, that one connects (and makes the rings). Each draw
/// has even odds.
fn second_connects(first: impl Fn() -> Side, second: impl Fn() -> Side) -> (Side, Side) {
    loop {
        let (a, b) = (first(), second());
        if b.qp.qp_num() < a.qp.qp_num() {
            return (a, b);
        }
    }
}

#[test]
fn a_connection_without_the_secret_is_refused() {
    // A peer that knows the victim's address and QP number but not its secret, and
    // connects to it (the side with the smaller QP number connects).
    let (v, mallory) = victim_and_mallory();
    let ve = v.qp.endpoint();
    let opts = ConnectOptions::default();
    v.qp.connect(mallory.qp.endpoint(), &opts).unwrap();
    let mut forged = ve;
    forged.secret ^= 1;
    let err = mallory.qp.connect(forged, &opts);
    assert!(
        err.is_err(),
        "the victim took a connection without its secret"
    );
    wait_logged(
        "WARN",
        &["refusing an shm connection", "did not present its secret"],
    );
    // The victim still waits for its real peer: nothing arrived.
    assert_eq!(v.qp.state(), QpState::Rts);
    assert!(v.cq.poll_one().unwrap().is_none());
}

#[test]
fn a_reset_queue_pair_refuses_the_secret_of_its_last_connection() {
    // A QP back in RESET draws a new secret: a peer holding the endpoint of its last
    // connection cannot connect to it with that.
    let (v, mallory) = victim_and_mallory();
    let (v, old_peer) = connect(v, side(false));
    let old = v.qp.endpoint();
    for state in [QpState::Err, QpState::Reset] {
        let attr = rdmx::QpAttr {
            qp_state: state,
            ..rdmx::QpAttr::default()
        };
        v.qp.modify(&attr, rdmx::QpAttrMask::STATE).unwrap();
    }
    drop(old_peer);
    let new = v.qp.endpoint();
    assert_ne!(old.secret, new.secret, "the reset kept the secret");
    let opts = ConnectOptions::default();
    v.qp.connect(mallory.qp.endpoint(), &opts).unwrap();
    assert!(
        mallory.qp.connect(old, &opts).is_err(),
        "the reset QP took a connection with its old secret"
    );
    wait_logged(
        "WARN",
        &["refusing an shm connection", "did not present its secret"],
    );
    assert!(v.cq.poll_one().unwrap().is_none());
}

/// The data path of `qp` once it has its connection (the side that waits for its peer
/// gets it moments after the peer reached RTR).
fn data_path(qp: &QueuePair) -> &'static str {
    let start = Instant::now();
    loop {
        if let Some(p) = rdmx::shm::data_path(qp) {
            return p;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "the queue pair never got its connection"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The payload of [`write_descriptor`]'s WRITE: the path MTU of 64 KiB rings, the
/// longest an ONLY packet may carry.
const DESC_LEN: usize = 16 << 10;

/// A ring record that carries an RDMA WRITE ONLY of [`DESC_LEN`] bytes to `open` as a
/// descriptor naming `far` in the peer: a 16-byte record header, the packet's headers,
/// and at offset 48 the descriptor (pad length, then address and length).
fn write_descriptor(v: &Side, psn: u32, open: &rdmx::MemoryRegion, far: u64) -> Vec<u8> {
    use rdmx_wire::{BthRepr, Opcode, RcRepr, RethRepr};
    let mut r = RcRepr::new(BthRepr {
        opcode: Opcode::RdmaWriteOnly,
        solicited: false,
        migreq: false,
        pad_count: 0,
        pkey: 0xffff,
        fecn: false,
        becn: false,
        dest_qpn: v.qp.qp_num(),
        ack_req: true,
        psn,
    });
    r.reth = Some(RethRepr {
        va: open.addr() as u64,
        rkey: open.rkey(),
        dma_len: DESC_LEN as u32,
    });
    let mut hdr = vec![0u8; r.buffer_len()];
    let n = r.emit_with_payload(&mut hdr).expect("emit a WRITE");
    hdr.truncate(n);
    let mut rec = Vec::new();
    for x in [3u32, n as u32, 48, 24] {
        rec.extend_from_slice(&x.to_ne_bytes());
    }
    rec.extend_from_slice(&hdr);
    rec.resize(48, 0);
    for x in [0, far, DESC_LEN as u64] {
        rec.extend_from_slice(&x.to_ne_bytes());
    }
    rec
}

#[test]
fn a_descriptor_naming_memory_the_peer_does_not_have() {
    // The peer sends a valid WRITE to a region the victim opened for remote writes, but
    // its descriptor names peer memory that is not mapped: the victim's pull fails, its
    // queue pair goes to ERR, and nothing is written, in the open region or elsewhere.
    let (v, peer) = pair_with(true);
    assert_eq!(data_path(&v.qp), "cma");
    let open =
        v.pd.register(vec![0u8; 65536], Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    let inbox = v.pd.register(vec![0u8; 4096], Access::LOCAL_WRITE).unwrap();
    let closed =
        v.pd.register(vec![0x5au8; 4096], Access::LOCAL_WRITE)
            .unwrap();
    // (No SEND outstanding: the peer must not write the ring while the test does.)
    v.qp.post_recv(RecvRequest::new(1).sge(LocalSge::new(&inbox, 0, 4096).unwrap()))
        .unwrap();
    // The first page is never mapped.
    let rec = write_descriptor(&v, peer.qp.endpoint().psn, &open, 0x10);
    rdmx::shm::testing::scribble_incoming(&v.qp, &rec).unwrap();
    let c = wait(&v.cq, "the outstanding receive to fail");
    assert_ne!(c.status, WcStatus::Success, "{c:?}");
    assert_eq!(c.wr_id, 1);
    assert_eq!(v.qp.state(), QpState::Err);
    wait_logged(
        "WARN",
        &[
            "closing the shared-memory connection",
            "copying a payload out of the peer's memory failed",
        ],
    );
    let mut got = vec![1u8; 65536];
    open.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0), "the open region changed");
    let mut got = vec![0u8; 4096];
    closed.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0x5a), "a closed region changed");
}

#[test]
fn a_direct_descriptor_naming_no_registered_region() {
    // The same on the direct path (the peer in this process): the descriptor names memory
    // no region of the peer covers (lkey 0 is never valid), so the victim copies nothing.
    let direct = || side_with(rdmx::shm::Options::default().ring_bytes(64 << 10));
    let (v, peer) = connect(direct(), direct());
    assert_eq!(data_path(&v.qp), "direct");
    let open =
        v.pd.register(vec![0u8; 65536], Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    let inbox = v.pd.register(vec![0u8; 4096], Access::LOCAL_WRITE).unwrap();
    let closed =
        v.pd.register(vec![0x5au8; 4096], Access::LOCAL_WRITE)
            .unwrap();
    // (No SEND outstanding: the peer must not write the ring while the test does.)
    v.qp.post_recv(RecvRequest::new(1).sge(LocalSge::new(&inbox, 0, 4096).unwrap()))
        .unwrap();
    let rec = write_descriptor(&v, peer.qp.endpoint().psn, &open, open.addr() as u64);
    rdmx::shm::testing::scribble_incoming(&v.qp, &rec).unwrap();
    let c = wait(&v.cq, "the outstanding receive to fail");
    assert_ne!(c.status, WcStatus::Success, "{c:?}");
    assert_eq!(c.wr_id, 1);
    assert_eq!(v.qp.state(), QpState::Err);
    wait_logged(
        "WARN",
        &[
            "closing the shared-memory connection",
            "copying a payload out of the peer's memory failed",
        ],
    );
    let mut got = vec![1u8; 65536];
    open.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0), "the open region changed");
    let mut got = vec![0u8; 4096];
    closed.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0x5a), "a closed region changed");
}

#[test]
fn a_descriptor_to_a_side_that_keeps_to_the_ring() {
    // A context with cma off never raised its flag: a descriptor is garbage to it.
    let _ = logs::logs();
    let mk = |cma| {
        let ctx = Context::open(rdmx::shm::Options::default().cma(cma).direct(false)).unwrap();
        let pd = ctx.alloc_pd();
        let cq = ctx.create_cq(64).unwrap();
        let qp = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
        Side {
            _ctx: ctx,
            pd,
            cq,
            qp,
        }
    };
    let (v, peer) = (mk(false), mk(true));
    let opts = ConnectOptions::default();
    let (ev, ep) = (v.qp.endpoint(), peer.qp.endpoint());
    v.qp.connect(ep, &opts).unwrap();
    peer.qp.connect(ev, &opts).unwrap();
    assert_eq!(data_path(&v.qp), "ring");
    let open =
        v.pd.register(vec![0u8; 65536], Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    let src = peer
        .pd
        .register(vec![7u8; 65536], Access::LOCAL_WRITE)
        .unwrap();
    let rec = write_descriptor(&v, ep.psn, &open, src.addr() as u64);
    rdmx::shm::testing::scribble_incoming(&v.qp, &rec).unwrap();
    let start = Instant::now();
    while v.qp.state() != QpState::Err {
        let _ = v.cq.poll_one();
        assert!(start.elapsed() < DEADLINE, "the victim kept going");
        std::thread::yield_now();
    }
    wait_logged(
        "WARN",
        &["a descriptor on a connection that copies through the ring"],
    );
    let mut got = vec![1u8; 65536];
    open.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0), "the open region changed");
}

#[test]
fn rings_too_small_for_the_path_mtu() {
    // The side that connects makes the rings, of its own size. A peer whose rings are
    // smaller than the other side's path MTU needs (64 KiB rings, 64 KiB packets; a record
    // may take half a ring) connects: that side's QP fails with a logged reason instead of
    // sending records that do not fit, and its requests complete with an error.
    let _ = logs::logs();
    let opts = |ring| rdmx::shm::Options::default().ring_bytes(ring).direct(false);
    let (big, small) = second_connects(|| side_with(opts(4 << 20)), || side_with(opts(64 << 10)));
    let mtu = rdmx::Mtu::from_bytes(64 << 10);
    big.qp
        .connect(small.qp.endpoint(), &ConnectOptions::default().mtu(mtu))
        .unwrap();
    // (The small side sees its connection end as soon as the big side fails: it may
    // have failed before it reached RTS, which connect then reports.)
    let _ = small
        .qp
        .connect(big.qp.endpoint(), &ConnectOptions::default());
    let src = big
        .pd
        .register(vec![7u8; 64 << 10], Access::LOCAL_WRITE)
        .unwrap();
    let inbox = small
        .pd
        .register(vec![0u8; 64 << 10], Access::LOCAL_WRITE)
        .unwrap();
    small
        .qp
        .post_recv(RecvRequest::new(1).sge(LocalSge::new(&inbox, 0, 64 << 10).unwrap()))
        .unwrap();
    // The big side's QP fails when the connection arrives; the SEND may be posted before
    // or after that, and completes with an error either way.
    let _ = big
        .qp
        .post_send(SendRequest::send(2).sge(LocalSge::new(&src, 0, 64 << 10).unwrap()));
    let c = wait(&big.cq, "the SEND to fail");
    assert_ne!(c.status, WcStatus::Success, "{c:?}");
    assert_eq!(big.qp.state(), QpState::Err);
    wait_logged("WARN", &["rings are too small for this QP's path MTU"]);
    let mut got = vec![1u8; 64 << 10];
    inbox.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0), "the receive buffer changed");
}

#[test]
fn a_queue_pair_whose_peer_went_connects_again() {
    // The peer exits (its QP and context go): the victim's QP fails; moved to RESET, it
    // connects to a new peer, and the new connection's rings carry its packets from
    // their start.
    let (v, peer) = pair();
    let inbox = v.pd.register(vec![0u8; 64], Access::LOCAL_WRITE).unwrap();
    let src = v.pd.register(vec![3u8; 64], Access::LOCAL_WRITE).unwrap();
    // Some traffic first, so that the old rings' positions are not at their start.
    for i in 0..3 {
        v.qp.post_send(SendRequest::send(i).sge(LocalSge::new(&src, 0, 64).unwrap()))
            .unwrap();
        let their = peer
            .pd
            .register(vec![0u8; 64], Access::LOCAL_WRITE)
            .unwrap();
        peer.qp
            .post_recv(RecvRequest::new(i).sge(LocalSge::new(&their, 0, 64).unwrap()))
            .unwrap();
        assert_eq!(wait(&v.cq, "a SEND").status, WcStatus::Success);
        assert_eq!(wait(&peer.cq, "a receive").status, WcStatus::Success);
    }
    drop(peer);
    let start = Instant::now();
    while v.qp.state() != QpState::Err {
        assert!(start.elapsed() < DEADLINE, "the QP did not fail");
        let _ = v.cq.poll_one().unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    let reset = rdmx::QpAttr {
        qp_state: QpState::Reset,
        ..rdmx::QpAttr::default()
    };
    v.qp.modify(&reset, rdmx::QpAttrMask::STATE).unwrap();
    let (v, peer) = connect(v, side(false));
    let their = peer
        .pd
        .register(vec![0u8; 64], Access::LOCAL_WRITE)
        .unwrap();
    peer.qp
        .post_recv(RecvRequest::new(7).sge(LocalSge::new(&their, 0, 64).unwrap()))
        .unwrap();
    v.qp.post_recv(RecvRequest::new(8).sge(LocalSge::new(&inbox, 0, 64).unwrap()))
        .unwrap();
    v.qp.post_send(SendRequest::send(9).sge(LocalSge::new(&src, 0, 64).unwrap()))
        .unwrap();
    let c = wait(&v.cq, "the SEND on the new connection");
    assert_eq!((c.status, c.wr_id), (WcStatus::Success, 9), "{c:?}");
    let c = wait(&peer.cq, "the receive on the new connection");
    assert_eq!((c.status, c.wr_id), (WcStatus::Success, 7), "{c:?}");
    let mut got = [0u8; 64];
    their.read_at(0, &mut got).unwrap();
    assert_eq!(got, [3u8; 64]);
    // And the other way.
    let back = peer
        .pd
        .register(vec![4u8; 64], Access::LOCAL_WRITE)
        .unwrap();
    peer.qp
        .post_send(SendRequest::send(10).sge(LocalSge::new(&back, 0, 64).unwrap()))
        .unwrap();
    let c = wait(&v.cq, "the receive from the new peer");
    assert_eq!((c.status, c.wr_id), (WcStatus::Success, 8), "{c:?}");
    inbox.read_at(0, &mut got).unwrap();
    assert_eq!(got, [4u8; 64]);
}

/// What a peer writes on the connection's socket: a wake-up is harmless; anything else
/// (a message that is not rdmx's, a short one) fails the victim's QP with a logged reason
/// and its requests with an error.
#[test]
fn garbage_on_the_connection_socket() {
    for (bytes, reason) in [
        (&b"HELLO THERE, THIS IS NOT RDMX!!"[..24], "not rdmx's"),
        (&b"x"[..], "a short message"),
    ] {
        let (v, peer) = pair();
        // Both sides have their connection (the side that waits gets it a moment later).
        data_path(&v.qp);
        data_path(&peer.qp);
        let inbox = v.pd.register(vec![0u8; 64], Access::LOCAL_WRITE).unwrap();
        v.qp.post_recv(RecvRequest::new(1).sge(LocalSge::new(&inbox, 0, 64).unwrap()))
            .unwrap();
        // A wake-up changes nothing.
        let mut wake = [0u8; 24];
        wake[..8].copy_from_slice(b"RDMXWAKE");
        rdmx::shm::testing::send_on_socket(&peer.qp, &wake).unwrap();
        quiet(
            &v.cq,
            Duration::from_millis(50),
            "a completion after a wake-up",
        );
        assert_eq!(v.qp.state(), QpState::Rts);
        rdmx::shm::testing::send_on_socket(&peer.qp, bytes).unwrap();
        let c = wait(&v.cq, "the receive to fail");
        assert_ne!(c.status, WcStatus::Success, "{c:?}");
        assert_eq!(c.wr_id, 1);
        assert_eq!(v.qp.state(), QpState::Err);
        wait_logged("WARN", &["closing the shared-memory connection", reason]);
    }
}

/// A side whose driver sleeps (its application does not poll, nothing arrived for a
/// while) is woken by a message on the connection's socket when a packet comes for it,
/// and the packet is taken. (A sleeping driver also wakes every 100 ms on its own, and
/// a packet that comes while it is up needs no wake-up: a busy machine can stretch that
/// moment, so the test tries up to five times.)
#[test]
fn a_sleeping_side_is_woken_through_its_socket() {
    const TRIES: u64 = 5;
    let (a, b) = pair();
    let inbox = b.pd.register(vec![0u8; 64], Access::LOCAL_WRITE).unwrap();
    let src = a.pd.register(vec![5u8; 64], Access::LOCAL_WRITE).unwrap();
    let mut woken = false;
    for i in 0..TRIES {
        b.qp.post_recv(RecvRequest::new(i).sge(LocalSge::new(&inbox, 0, 64).unwrap()))
            .unwrap();
        // Nothing to do for a while: both drivers go to sleep.
        std::thread::sleep(Duration::from_millis(300));
        let before = rdmx::shm::testing::wakes_read(&b._ctx).unwrap();
        a.qp.post_send(SendRequest::send(100 + i).sge(LocalSge::new(&src, 0, 64).unwrap()))
            .unwrap();
        let c = wait(&a.cq, "the SEND");
        assert_eq!(c.status, WcStatus::Success, "{c:?}");
        woken = rdmx::shm::testing::wakes_read(&b._ctx).unwrap() > before;
        let c = wait(&b.cq, "the receive");
        assert_eq!((c.status, c.wr_id), (WcStatus::Success, i), "{c:?}");
        if woken {
            break;
        }
    }
    assert!(
        woken,
        "the receiving side was not woken through its socket in {TRIES} tries"
    );
}
