//! A connected pair of udp queue pairs, each in its own context on an address of its
//! own, for the tests that attack or load one.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rdmx::{
    Access, Completion, CompletionQueue, ConnectOptions, Context, LocalSge, MemoryRegion, Mtu,
    ProtectionDomain, QpCaps, QpState, QueuePair, RemoteAddr, SendRequest, WcStatus,
};

pub const LEN: usize = 64 * 1024;
pub const DEADLINE: Duration = Duration::from_secs(30);

/// A context bound to `addr`, with a QP, its CQ and a region of [`LEN`] bytes open to
/// every access.
pub struct Side {
    pub ctx: Context,
    pub pd: ProtectionDomain,
    pub cq: CompletionQueue,
    pub qp: QueuePair,
    pub mr: MemoryRegion,
    pub addr: SocketAddr,
}

pub fn side(addr: &str) -> Side {
    let addr: SocketAddr = addr.parse().expect("an address");
    let ctx = Context::open(rdmx::udp::Options::default().bind(addr)).expect("open udp");
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(256).expect("cq");
    let qp = pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp");
    let mr = pd.register(vec![0u8; LEN], Access::ALL).expect("register");
    Side {
        ctx,
        pd,
        cq,
        qp,
        mr,
        addr,
    }
}

pub fn opts() -> ConnectOptions {
    let mut o = ConnectOptions::default();
    o.mtu = Some(Mtu::Mtu1024);
    o
}

pub fn pair(port: u16) -> (Side, Side) {
    pair_with(port, &opts())
}

pub fn pair_with(port: u16, o: &ConnectOptions) -> (Side, Side) {
    let a = side(&format!("127.1.0.1:{port}"));
    let b = side(&format!("127.1.0.2:{port}"));
    a.qp.connect(b.qp.endpoint(), o).expect("connect A");
    b.qp.connect(a.qp.endpoint(), o).expect("connect B");
    (a, b)
}

pub fn image(mr: &MemoryRegion) -> Vec<u8> {
    let mut v = vec![0u8; mr.len()];
    mr.read_at(0, &mut v).expect("read");
    v
}

/// The next completion on `cq`; fails if none comes within [`DEADLINE`].
#[track_caller]
pub fn wait_one(cq: &CompletionQueue, what: &str) -> Completion {
    let start = Instant::now();
    loop {
        if let Some(c) = cq.poll_one().expect("poll") {
            return c;
        }
        assert!(start.elapsed() < DEADLINE, "{what} did not complete");
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// A WRITE's data from A lands in B, and A's completion says so.
pub fn write_works(a: &Side, b: &Side, seed: u8) {
    let data: Vec<u8> = (0..8192u32).map(|i| (i as u8).wrapping_mul(seed)).collect();
    a.mr.write_at(0, &data).expect("fill");
    let remote = RemoteAddr {
        addr: b.mr.addr() as u64 + 4096,
        rkey: b.mr.rkey(),
    };
    a.qp.post_send(
        SendRequest::write(u64::from(seed), remote)
            .sge(LocalSge::new(&a.mr, 0, data.len()).expect("sge")),
    )
    .expect("post");
    let c = wait_one(&a.cq, "the WRITE");
    assert_eq!((c.wr_id, c.status), (u64::from(seed), WcStatus::Success));
    let mut got = vec![0u8; data.len()];
    b.mr.read_at(4096, &mut got).expect("read");
    assert_eq!(got, data, "WRITE data");
    assert_eq!((a.qp.state(), b.qp.state()), (QpState::Rts, QpState::Rts));
}
