//! Hostile peers against the tcp provider's listener (the connection manager's are in
//! `hostile_cm.rs`).
//!
//! A tcp context accepts streams from anyone who can reach its listener. Each test here
//! plays a peer that breaks the protocol — random bytes, truncated frames, oversized or
//! zero length prefixes, unknown opcodes, wrong PSNs, forged or stale rkeys, half-open
//! connections, peers that connect and stall — and checks that:
//!
//! - the process neither panics nor aborts (a panic on the driver's thread would stop
//!   every later transfer, which the last check of each test would catch);
//! - the offending stream is closed (the attacker reads end-of-file) and the reason is
//!   logged at warn level, naming the QP;
//! - the QP it targeted moves to ERR, so its outstanding receive completes with
//!   `WR_FLUSH_ERR`;
//! - registered memory the attacker aimed at is unchanged, byte for byte;
//! - a connection established before the attack still completes transfers, and a new one
//!   connected afterwards does too.
//!
//! The attacker impersonates the peer a QP expects: it knows the QP's number (from the
//! endpoint exchange an application would do) and dials the listener with the 16-byte
//! hello, then sends what the test wants.

#[path = "common/logs.rs"]
mod logs;
#[path = "common/memory.rs"]
mod memory;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use rdmx::{
    Access, Completion, CompletionQueue, ConnectOptions, Context, LocalSge, MemoryRegion, PeerAddr,
    ProtectionDomain, QpCaps, QpEndpoint, QpState, QueuePair, RecvRequest, RemoteAddr, SendRequest,
    WcStatus,
};
use rdmx_wire::{BthRepr, NakCode, Opcode, RcRepr, RethRepr, Syndrome};

use logs::{logs, wait_logged};

/// Generous bound for anything that must happen "soon" on a loaded machine.
const DEADLINE: Duration = Duration::from_secs(30);
/// The QP number the victim QP expects its peer to have; the attacker claims it.
const FAKE_QPN: u32 = 1;
/// The first PSN the victim expects from that peer.
const FAKE_PSN: u32 = 0x100;
const REGION: usize = 4096;

// ---- the server side -----------------------------------------------------------------

/// A tcp context with one healthy connection to a second context, used to show that other
/// connections go on while one is attacked.
struct Server {
    ctx: Context,
    pd: ProtectionDomain,
    healthy: Healthy,
}

/// A connected pair of QPs: `a` in its own context, `b` in the server's.
struct Healthy {
    _ctx: Context,
    a: QueuePair,
    a_cq: CompletionQueue,
    a_mr: MemoryRegion,
    b: QueuePair,
    _b_cq: CompletionQueue,
    b_mr: MemoryRegion,
    round: u8,
}

/// A QP of the server waiting for the fake peer to dial in, with a receive posted and a
/// registered region the attacker knows.
struct Victim {
    qp: QueuePair,
    cq: CompletionQueue,
    mr: MemoryRegion,
    before: Vec<u8>,
}

fn tcp() -> Context {
    let _ = logs();
    Context::open_provider("tcp").expect("open a tcp context")
}

fn qp_in(pd: &ProtectionDomain) -> (QueuePair, CompletionQueue) {
    let cq = pd.context().create_cq(256).expect("create a CQ");
    let qp = pd
        .create_qp(&cq, &cq, QpCaps::default())
        .expect("create a QP");
    (qp, cq)
}

fn region(pd: &ProtectionDomain, seed: u8) -> MemoryRegion {
    let mr = pd
        .register(vec![0u8; REGION], Access::ALL)
        .expect("register a region");
    mr.write_at(0, &pattern(seed, REGION)).expect("fill");
    mr
}

fn image(mr: &MemoryRegion) -> Vec<u8> {
    let mut v = vec![0u8; mr.len()];
    mr.read_at(0, &mut v).expect("read a region");
    v
}

/// Compares two images and names the first difference instead of printing them.
#[track_caller]
fn assert_image(actual: &[u8], expected: &[u8], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths differ");
    if let Some(i) = actual.iter().zip(expected).position(|(a, e)| a != e) {
        let n = actual.iter().zip(expected).filter(|(a, e)| a != e).count();
        let end = (i + 16).min(actual.len());
        panic!(
            "{what}: {n} byte(s) differ, first at {i}: got {:02x?}, expected {:02x?}",
            &actual[i..end],
            &expected[i..end]
        );
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(37).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

impl Server {
    fn new() -> Server {
        let ctx = tcp();
        let pd = ctx.alloc_pd();
        let healthy = Healthy::new(&pd);
        Server { ctx, pd, healthy }
    }

    /// A QP connected to the fake peer (which, having the smaller QP number, is the side
    /// that dials), with one receive posted.
    fn victim(&self) -> Victim {
        let (qp, cq) = qp_in(&self.pd);
        let mr = region(&self.pd, 0x5A);
        let fake = fake_peer(FAKE_QPN);
        qp.connect(fake, &ConnectOptions::default())
            .expect("connect the victim to the fake peer");
        assert_eq!(qp.state(), QpState::Rts);
        qp.post_recv(RecvRequest::new(77).sge(LocalSge::new(&mr, 0, 64).expect("SGE")))
            .expect("post a receive");
        let before = image(&mr);
        Victim { qp, cq, mr, before }
    }

    /// Dials the listener and says hello as the fake peer of `victim`.
    fn dial(&self, victim: &Victim) -> TcpStream {
        let mut s = self.connect_raw();
        s.write_all(&hello(
            victim.qp.qp_num(),
            FAKE_QPN,
            victim.qp.endpoint().secret,
        ))
        .expect("send the hello");
        s
    }

    /// A plain TCP connection to the listener.
    fn connect_raw(&self) -> TcpStream {
        let port = self.ctx.listen_addr().expect("a tcp listener").port();
        let s = TcpStream::connect(("127.0.0.1", port)).expect("dial the listener");
        s.set_read_timeout(Some(DEADLINE)).expect("SO_RCVTIMEO");
        s.set_nodelay(true).expect("TCP_NODELAY");
        s
    }

    /// The checks every attack ends with: the victim is in ERR, its receive was flushed,
    /// its memory is unchanged, the healthy connection still works, and a connection made
    /// now works too.
    fn check_after(&mut self, v: &Victim) {
        wait_state(&v.qp, QpState::Err);
        let c = wait_one(&v.cq, "the victim's receive");
        assert_eq!((c.wr_id, c.status), (77, WcStatus::WrFlushErr), "{c:?}");
        assert_image(&image(&v.mr), &v.before, "the victim's memory");
        self.check_healthy();
    }

    fn check_healthy(&mut self) {
        self.healthy.transfer();
        Healthy::new(&self.pd).transfer();
    }
}

impl Healthy {
    fn new(server_pd: &ProtectionDomain) -> Healthy {
        let ctx = tcp();
        let pd = ctx.alloc_pd();
        let (a, a_cq) = qp_in(&pd);
        let (b, b_cq) = qp_in(server_pd);
        let opts = ConnectOptions::default();
        a.connect(b.endpoint(), &opts).expect("connect A");
        b.connect(a.endpoint(), &opts).expect("connect B");
        let a_mr = region(&pd, 1);
        let b_mr = region(server_pd, 2);
        Healthy {
            _ctx: ctx,
            a,
            a_cq,
            a_mr,
            b,
            _b_cq: b_cq,
            b_mr,
            round: 0,
        }
    }

    /// WRITEs fresh bytes to B and READs them back, checking both.
    fn transfer(&mut self) {
        self.round = self.round.wrapping_add(1);
        let data = pattern(self.round.wrapping_mul(13), REGION / 2);
        self.a_mr.write_at(0, &data).expect("fill");
        let remote = RemoteAddr {
            addr: self.b_mr.addr() as u64,
            rkey: self.b_mr.rkey(),
        };
        let sge = |off| LocalSge::new(&self.a_mr, off, REGION / 2).expect("SGE");
        self.a
            .post_send(SendRequest::write(1, remote).sge(sge(0)))
            .expect("post a WRITE");
        self.a
            .post_send(SendRequest::read(2, remote).sge(sge(REGION / 2)))
            .expect("post a READ");
        for id in [1, 2] {
            let c = wait_one(&self.a_cq, "the healthy connection's transfer");
            assert_eq!((c.wr_id, c.status), (id, WcStatus::Success), "{c:?}");
        }
        assert_image(&image(&self.b_mr)[..REGION / 2], &data, "WRITE data");
        assert_image(&image(&self.a_mr)[REGION / 2..], &data, "READ data");
        assert_eq!(self.b.state(), QpState::Rts);
    }
}

/// The tcp provider's hello: QP `to` is dialed by QP `from`, which presents `secret`.
fn hello(to: u32, from: u32, secret: u64) -> [u8; 24] {
    let mut h = [0u8; 24];
    h[..8].copy_from_slice(b"RDMXTCP2");
    h[8..12].copy_from_slice(&to.to_be_bytes());
    h[12..16].copy_from_slice(&from.to_be_bytes());
    h[16..].copy_from_slice(&secret.to_be_bytes());
    h
}

/// The endpoint of a fake peer QP numbered `qp_num`: it dials (its number is the smaller),
/// so the address it names is never used.
fn fake_peer(qp_num: u32) -> QpEndpoint {
    QpEndpoint {
        qp_num,
        psn: FAKE_PSN,
        mtu: 65536,
        secret: 0,
        addr: PeerAddr::Ip(SocketAddr::from(([127, 0, 0, 1], 9))),
    }
}

#[track_caller]
fn wait_one(cq: &CompletionQueue, what: &str) -> Completion {
    let start = Instant::now();
    loop {
        if let Some(c) = cq.poll_one().expect("poll a CQ") {
            return c;
        }
        assert!(start.elapsed() < DEADLINE, "{what}: no completion");
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[track_caller]
fn wait_state(qp: &QueuePair, want: QpState) {
    let start = Instant::now();
    while qp.state() != want {
        assert!(
            start.elapsed() < DEADLINE,
            "QP {:#x} stayed in {:?}, expected {want:?}",
            qp.qp_num(),
            qp.state()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Reads until the server closes the stream; returns the frames it sent first.
#[track_caller]
fn wait_closed(s: &mut TcpStream) -> Vec<u8> {
    let start = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return got,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                panic!("the server did not close the stream within {DEADLINE:?}")
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => panic!("reading from the server: {e}"),
        }
        assert!(start.elapsed() < DEADLINE * 2, "the server kept sending");
    }
}

/// Reads one frame the server sent.
#[track_caller]
fn read_frame(s: &mut TcpStream) -> Vec<u8> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).expect("a frame's length");
    let mut p = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut p).expect("a frame");
    p
}

/// The BTH of a packet from the fake peer to `qp`.
fn bth(opcode: Opcode, qp: u32, psn: u32, ack_req: bool) -> BthRepr {
    BthRepr {
        opcode,
        solicited: false,
        migreq: false,
        pad_count: 0,
        pkey: 0xffff,
        fecn: false,
        becn: false,
        dest_qpn: qp,
        ack_req,
        psn,
    }
}

/// `r`, with its payload, behind the tcp provider's length prefix.
fn framed(r: &RcRepr<'_>) -> Vec<u8> {
    let mut out = vec![0u8; 4 + r.buffer_len()];
    let n = r.emit_with_payload(&mut out[4..]).expect("emit a packet");
    out[..4].copy_from_slice(&(n as u32).to_be_bytes());
    out.truncate(4 + n);
    out
}

/// A length-prefixed RDMA WRITE ONLY from the fake peer to `qp`.
fn write_frame(qp: u32, psn: u32, va: u64, rkey: u32, payload: &[u8]) -> Vec<u8> {
    let mut r = RcRepr::new(bth(Opcode::RdmaWriteOnly, qp, psn, true));
    r.reth = Some(RethRepr {
        va,
        rkey,
        dma_len: payload.len() as u32,
    });
    r.payload = payload;
    framed(&r)
}

/// The NAK code of an acknowledge packet, or `None` for a positive ACK.
fn nak_of(p: &[u8]) -> Option<NakCode> {
    let r = RcRepr::parse_bytes(p).expect("the server sent a valid packet");
    assert_eq!(r.bth.opcode, Opcode::Acknowledge, "{r}");
    match r.aeth.expect("an AETH").syndrome {
        Syndrome::Nak(c) => Some(c),
        _ => None,
    }
}

/// Deterministic pseudo-random bytes.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Moves `qp` to `state`.
fn move_to(qp: &QueuePair, state: QpState) {
    let attr = rdmx::QpAttr {
        qp_state: state,
        ..Default::default()
    };
    qp.modify(&attr, rdmx::QpAttrMask::STATE)
        .unwrap_or_else(|e| panic!("to {state:?}: {e}"));
}

#[path = "hostile/after_hello.rs"]
mod after_hello;

#[path = "hostile/before_hello.rs"]
mod before_hello;

#[path = "hostile/mid_frame.rs"]
mod mid_frame;
