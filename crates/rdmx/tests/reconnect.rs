//! A queue pair taken back to RESET connects again, to another peer, and works there
//! (as `ibv_modify_qp` to RESET allows): after its connection failed (the old peer went),
//! and after the application moved it to ERR with its connection still up. Nothing of
//! the old connection reaches the new one. Every software provider.

mod common;

use std::time::{Duration, Instant};

use rdmx::{
    Access, CompletionQueue, ConnectOptions, Context, LocalSge, MemoryRegion, ProtectionDomain,
    QpAttr, QpAttrMask, QpCaps, QpState, QueuePair, RecvRequest, SendRequest, WcStatus,
};

const DEADLINE: Duration = Duration::from_secs(20);

struct Side {
    _ctx: Context,
    _pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
}

fn side(open: fn() -> rdmx::Result<Context>) -> Side {
    let ctx = open().unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(64).unwrap();
    let qp = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
    let mr = pd.register(vec![0u8; 4096], Access::LOCAL_WRITE).unwrap();
    Side {
        _ctx: ctx,
        _pd: pd,
        cq,
        qp,
        mr,
    }
}

fn connect(a: &QueuePair, b: &QueuePair) {
    let opts = ConnectOptions::default();
    let (ea, eb) = (a.endpoint(), b.endpoint());
    a.connect(eb, &opts).unwrap();
    b.connect(ea, &opts).unwrap();
}

fn wait(cq: &CompletionQueue, what: &str) -> rdmx::Completion {
    let start = Instant::now();
    loop {
        if let Some(c) = cq.poll_one().unwrap() {
            return c;
        }
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Drains `cq` of the flushed completions of the old connection.
fn drain(cq: &CompletionQueue) {
    std::thread::sleep(Duration::from_millis(50));
    while cq.poll_one().unwrap().is_some() {}
}

fn to(qp: &QueuePair, state: QpState) {
    qp.modify(
        &QpAttr {
            qp_state: state,
            ..QpAttr::default()
        },
        QpAttrMask::STATE,
    )
    .unwrap();
}

/// `from` SENDs 64 bytes of `fill` to `to`, which has a receive posted: both complete
/// with success and the bytes land.
fn send_lands(from: &Side, to: &Side, fill: u8, what: &str) {
    to.qp
        .post_recv(RecvRequest::new(5).sge(LocalSge::new(&to.mr, 0, 64).unwrap()))
        .unwrap();
    from.mr.write_at(0, &[fill; 64]).unwrap();
    from.qp
        .post_send(SendRequest::send(6).sge(LocalSge::new(&from.mr, 0, 64).unwrap()))
        .unwrap();
    let c = wait(&from.cq, what);
    assert_eq!((c.wr_id, c.status), (6, WcStatus::Success), "{what}: {c:?}");
    let c = wait(&to.cq, what);
    assert_eq!(
        (c.wr_id, c.status, c.byte_len),
        (5, WcStatus::Success, 64),
        "{what}: {c:?}"
    );
    let mut got = [0u8; 64];
    to.mr.read_at(0, &mut got).unwrap();
    assert_eq!(got, [fill; 64], "{what}");
}

fn reconnects(open: fn() -> rdmx::Result<Context>) {
    // The old peer goes: the QP fails, is reset, and connects to a new peer.
    let a = side(open);
    let b = side(open);
    connect(&a.qp, &b.qp);
    send_lands(&b, &a, 1, "the first connection");
    drop(b);
    let start = Instant::now();
    while a.qp.state() != QpState::Err {
        // (loopback and udp do not notice a peer that went: the application moves on.)
        if start.elapsed() > Duration::from_millis(500) {
            to(&a.qp, QpState::Err);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    drain(&a.cq);
    to(&a.qp, QpState::Reset);
    let c = side(open);
    connect(&a.qp, &c.qp);
    send_lands(&c, &a, 2, "a connection after the peer went");
    send_lands(&a, &c, 3, "a connection after the peer went, the other way");

    // The application moves the QP to ERR with its connection up, then to RESET, and
    // connects it to another peer.
    to(&a.qp, QpState::Err);
    drain(&a.cq);
    to(&a.qp, QpState::Reset);
    let d = side(open);
    connect(&a.qp, &d.qp);
    send_lands(&d, &a, 4, "a connection after ERR with the old one up");
    send_lands(
        &a,
        &d,
        5,
        "a connection after ERR with the old one up, the other way",
    );
    drop(c);
}

#[test]
fn tcp() {
    reconnects(|| Context::open(rdmx::tcp::Options::default()));
}

#[test]
fn loopback() {
    reconnects(Context::open_default);
}

#[test]
fn shm() {
    reconnects(|| Context::open(rdmx::shm::Options::default()));
}

#[test]
fn udp() {
    reconnects(|| common::open_udp(12));
}
