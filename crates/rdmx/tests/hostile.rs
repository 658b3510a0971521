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

/// Resident memory of this process, in bytes.
fn rss() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    let kb: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kb * 1024
}

// ---- attacks after the hello -----------------------------------------------------------

/// Sends `bytes` after the hello and expects the stream closed for a protocol violation.
fn protocol_violation(bytes: &[u8], reason: &str) {
    protocol_violation_to(|_| bytes.to_vec(), reason)
}

/// Like [`protocol_violation`], with bytes made for the victim's QP number.
fn protocol_violation_to(make: impl FnOnce(u32) -> Vec<u8>, reason: &str) {
    let mut srv = Server::new();
    let v = srv.victim();
    let mut s = srv.dial(&v);
    s.write_all(&make(v.qp.qp_num()))
        .expect("send the hostile bytes");
    wait_closed(&mut s);
    let qpn = format!("qpn={}", v.qp.qp_num());
    wait_logged(
        "WARN",
        &["closing the connection", "protocol violation", reason, &qpn],
    );
    srv.check_after(&v);
}

#[test]
fn zero_length_prefix() {
    protocol_violation(
        &[0, 0, 0, 0, 0x0A, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        "frame of 0 bytes",
    );
}

#[test]
fn oversized_length_prefix() {
    let mut f = write_frame(1, FAKE_PSN, 0, 0, &[0; 16]);
    f[..4].copy_from_slice(&u32::MAX.to_be_bytes());
    protocol_violation(&f, "frame of 4294967295 bytes");
}

#[test]
fn length_prefix_one_past_the_largest_frame() {
    // 128 bytes of headers plus the largest path MTU (1 MiB) is the most a frame may be.
    let mut f = write_frame(1, FAKE_PSN, 0, 0, &[0; 16]);
    f[..4].copy_from_slice(&(128u32 + (1 << 20) + 1).to_be_bytes());
    protocol_violation(&f, "at most");
}

#[test]
fn length_prefix_shorter_than_the_headers() {
    let mut f = write_frame(1, FAKE_PSN, 0, 0, &[0; 16]);
    f[..4].copy_from_slice(&20u32.to_be_bytes()); // WRITE ONLY has 28 bytes of headers
    protocol_violation(&f, "frame of 20 bytes");
}

#[test]
fn invalid_opcode() {
    let mut f = write_frame(1, FAKE_PSN, 0, 0, &[0; 16]);
    f[4] = 0x1F; // reserved in the RC opcode space
    protocol_violation(&f, "unknown opcode 0x1f");
}

#[test]
fn reserved_aeth_syndrome() {
    // An ACK whose AETH syndrome uses the reserved type (binary 10): headers the engine
    // cannot parse.
    protocol_violation_to(
        |qpn| {
            let mut f = vec![0u8; 4 + 12 + 4];
            f[..4].copy_from_slice(&16u32.to_be_bytes());
            f[4] = Opcode::Acknowledge.as_u8();
            f[6..8].copy_from_slice(&0xffffu16.to_be_bytes());
            f[8..12].copy_from_slice(&qpn.to_be_bytes());
            f[16] = 0b0100_0000;
            f
        },
        "malformed or unsupported packet headers",
    );
}

#[test]
fn random_bytes_after_the_hello() {
    // Random streams mostly fail the opcode or length check at once; some parse as
    // frames and go to the engine. Either way the server must close the stream or keep
    // it consistent, never panic, and never touch memory the stream had no key for.
    let mut srv = Server::new();
    for seed in 1..=24u64 {
        let v = srv.victim();
        let mut s = srv.dial(&v);
        let len = 1 + (seed as usize * 977) % 6000;
        let _ = s.write_all(&noise(seed, len));
        // Close our side: whatever was left unparsed becomes a truncated frame.
        let _ = s.shutdown(std::net::Shutdown::Write);
        wait_closed(&mut s);
        wait_state(&v.qp, QpState::Err);
        assert_image(
            &image(&v.mr),
            &v.before,
            &format!("seed {seed}: the victim's memory"),
        );
    }
    srv.check_healthy();
}

#[test]
fn truncated_frame_then_close() {
    let mut srv = Server::new();
    // With a valid rkey the engine names where the payload goes and the stream reads it
    // straight there, so the bytes that arrived may be placed: the peer had the right to
    // write them (as with a WRITE that fails part-way on an adapter). Nothing else changes.
    let v = srv.victim();
    let mut s = srv.dial(&v);
    let f = write_frame(
        v.qp.qp_num(),
        FAKE_PSN,
        v.mr.addr() as u64,
        v.mr.rkey(),
        &[0xEE; 256],
    );
    s.write_all(&f[..f.len() - 128])
        .expect("send part of a frame");
    s.shutdown(std::net::Shutdown::Write).expect("shutdown");
    wait_closed(&mut s);
    wait_state(&v.qp, QpState::Err);
    let c = wait_one(&v.cq, "the victim's receive");
    assert_eq!((c.wr_id, c.status), (77, WcStatus::WrFlushErr), "{c:?}");
    let now = image(&v.mr);
    let k = now.iter().take_while(|&&b| b == 0xEE).count().min(128);
    let mut want = v.before.clone();
    want[..k].fill(0xEE);
    assert_image(
        &now,
        &want,
        "only a prefix of the truncated payload may be placed",
    );
    wait_logged(
        "DEBUG",
        &["connection closed", &format!("qpn={}", v.qp.qp_num())],
    );

    // With a forged rkey nothing is placed, whole or truncated.
    let v = srv.victim();
    let mut s = srv.dial(&v);
    let f = write_frame(
        v.qp.qp_num(),
        FAKE_PSN,
        v.mr.addr() as u64,
        v.mr.rkey() ^ 0x80,
        &[0xEE; 256],
    );
    s.write_all(&f[..f.len() - 128])
        .expect("send part of a frame");
    s.shutdown(std::net::Shutdown::Write).expect("shutdown");
    wait_closed(&mut s);
    srv.check_after(&v);
}

#[test]
fn wrong_psn_is_nakked_and_never_placed() {
    let mut srv = Server::new();
    let v = srv.victim();
    let mut s = srv.dial(&v);
    // PSNs ahead of the expected one: a sequence error, NAKed once, nothing placed.
    for d in [1u32, 2, 1000, 0x7f_ffff] {
        let psn = (FAKE_PSN + d) & 0xff_ffff;
        s.write_all(&write_frame(
            v.qp.qp_num(),
            psn,
            v.mr.addr() as u64,
            v.mr.rkey(),
            &[0xEE; 64],
        ))
        .expect("send");
    }
    let p = read_frame(&mut s);
    assert_eq!(nak_of(&p), Some(NakCode::PsnSequenceError));
    // A PSN behind the expected one is a duplicate: acknowledged, not executed again
    // (there was no first execution, so nothing changes).
    let behind = (FAKE_PSN + 0xff_ffff) & 0xff_ffff;
    s.write_all(&write_frame(
        v.qp.qp_num(),
        behind,
        v.mr.addr() as u64,
        v.mr.rkey(),
        &[0xEE; 64],
    ))
    .expect("send");
    // The expected PSN then works: the stream is still usable.
    let good = pattern(9, 64);
    s.write_all(&write_frame(
        v.qp.qp_num(),
        FAKE_PSN,
        v.mr.addr() as u64 + 64,
        v.mr.rkey(),
        &good,
    ))
    .expect("send");
    let start = Instant::now();
    loop {
        let p = read_frame(&mut s);
        if nak_of(&p).is_none() && RcRepr::parse_bytes(&p).expect("parsed").bth.psn == FAKE_PSN {
            break;
        }
        assert!(start.elapsed() < DEADLINE, "no ACK for the expected PSN");
    }
    let mut want = v.before.clone();
    want[64..128].copy_from_slice(&good);
    assert_image(
        &image(&v.mr),
        &want,
        "only the in-sequence WRITE may change memory",
    );
    assert_eq!(v.qp.state(), QpState::Rts);
    srv.check_healthy();
}

#[test]
fn forged_rkeys_are_refused_with_memory_unchanged() {
    let mut srv = Server::new();
    // A region that was registered and deregistered: its rkey is stale.
    let stale = region(&srv.pd, 3);
    let stale_rkey = stale.rkey();
    let stale_addr = stale.addr() as u64;
    drop(stale);
    for (what, forge) in [
        ("a flipped variant bit", 0u32),
        ("a stale rkey", 1),
        ("the lkey of a local-only region", 2),
        ("random keys", 3),
    ] {
        let v = srv.victim();
        let local_only = srv
            .pd
            .register(vec![0u8; 64], Access::LOCAL_WRITE)
            .expect("register");
        let (va, rkey) = match forge {
            0 => (v.mr.addr() as u64, v.mr.rkey() ^ 0x1),
            1 => (stale_addr, stale_rkey),
            2 => (local_only.addr() as u64, local_only.lkey()),
            _ => (
                v.mr.addr() as u64,
                u32::from_le_bytes(noise(7, 4).try_into().unwrap()),
            ),
        };
        let mut s = srv.dial(&v);
        s.write_all(&write_frame(v.qp.qp_num(), FAKE_PSN, va, rkey, &[0xEE; 64]))
            .expect("send");
        let p = read_frame(&mut s);
        assert_eq!(nak_of(&p), Some(NakCode::RemoteAccessError), "{what}");
        // A remote access error is fatal for the responder's QP.
        wait_state(&v.qp, QpState::Err);
        let c = wait_one(&v.cq, "the victim's receive");
        assert_eq!(
            (c.wr_id, c.status),
            (77, WcStatus::WrFlushErr),
            "{what}: {c:?}"
        );
        assert_image(&image(&v.mr), &v.before, what);
        assert_image(&image(&local_only), &[0u8; 64], what);
    }
    srv.check_healthy();
}

// ---- attacks before or instead of the hello -------------------------------------------

#[test]
fn bad_hellos_are_closed() {
    let mut srv = Server::new();
    let v = srv.victim();
    // Wrong magic; a QP that does not exist; a second stream for a connected QP.
    let mut s = srv.connect_raw();
    s.write_all(b"GET / HTTP/1.1\r\n\r\n").expect("send");
    wait_closed(&mut s);
    wait_logged("WARN", &["hello is not rdmx's"]);

    let mut s = srv.connect_raw();
    s.write_all(&hello(0xAB_CDEF, 5, 0)).expect("send");
    wait_closed(&mut s);
    wait_logged("WARN", &["QP that does not exist", "to=11259375"]);

    // The first stream is the victim's once a WRITE on it is acknowledged.
    let mut first = srv.dial(&v);
    let good = pattern(4, 32);
    first
        .write_all(&write_frame(
            v.qp.qp_num(),
            FAKE_PSN,
            v.mr.addr() as u64,
            v.mr.rkey(),
            &good,
        ))
        .expect("send");
    assert_eq!(nak_of(&read_frame(&mut first)), None);
    let mut second = srv.dial(&v);
    wait_closed(&mut second);
    wait_logged("WARN", &["second connection for a connected QP"]);
    // The first stream still works.
    let more = pattern(5, 32);
    let next = (FAKE_PSN + 1) & 0xff_ffff;
    first
        .write_all(&write_frame(
            v.qp.qp_num(),
            next,
            v.mr.addr() as u64 + 32,
            v.mr.rkey(),
            &more,
        ))
        .expect("send");
    assert_eq!(nak_of(&read_frame(&mut first)), None);
    let mut want = v.before.clone();
    want[..32].copy_from_slice(&good);
    want[32..64].copy_from_slice(&more);
    assert_image(&image(&v.mr), &want, "the victim's memory");
    srv.check_healthy();
}

#[test]
fn half_open_and_truncated_hellos_are_closed() {
    let mut srv = Server::new();
    for cut in [0usize, 1, 8, 15] {
        let mut s = srv.connect_raw();
        s.write_all(&hello(1234, 5, 0)[..cut]).expect("send");
        s.shutdown(std::net::Shutdown::Write).expect("shutdown");
        wait_closed(&mut s);
    }
    wait_logged(
        "DEBUG",
        &["dropping a connection", "closed before its hello"],
    );
    srv.check_healthy();
}

#[test]
fn peers_that_connect_and_stall_are_dropped() {
    // A stream that never finishes its hello is closed after the handshake timeout
    // (10 s); meanwhile the listener serves everyone else.
    let mut srv = Server::new();
    let mut silent = srv.connect_raw();
    let mut partial = srv.connect_raw();
    partial.write_all(b"RDMXT").expect("send");
    srv.check_healthy();
    wait_closed(&mut silent);
    wait_closed(&mut partial);
    wait_logged("WARN", &["sent no hello within"]);
    srv.check_healthy();
}

#[test]
fn a_reset_queue_pair_refuses_the_secret_of_its_last_connection() {
    // A QP back in RESET draws a new secret: a peer still holding the endpoint of its
    // last connection (here it claims the QP number of the next connection's peer) is
    // refused, and the next connection's peer, given the new endpoint, joins.
    let mut srv = Server::new();
    let v = srv.victim();
    let old = v.qp.endpoint();
    move_to(&v.qp, QpState::Err);
    move_to(&v.qp, QpState::Reset);
    let new = v.qp.endpoint();
    assert_ne!(old.secret, new.secret, "the reset kept the secret");
    assert_ne!(old.psn, new.psn, "the reset kept the first PSN");
    // Parked before the QP expects its peer, then after.
    let mut early = srv.connect_raw();
    early
        .write_all(&hello(v.qp.qp_num(), FAKE_QPN, old.secret))
        .expect("hello");
    wait_closed(&mut early);
    wait_logged("WARN", &["did not present the QP's secret"]);
    let fake = fake_peer(FAKE_QPN);
    v.qp.connect(fake, &ConnectOptions::default())
        .expect("connect");
    let mut late = srv.connect_raw();
    late.write_all(&hello(v.qp.qp_num(), FAKE_QPN, old.secret))
        .expect("hello");
    wait_closed(&mut late);
    // The peer with the new endpoint is taken: a WRITE on its stream is acknowledged.
    let mut s = srv.dial(&v);
    s.write_all(&write_frame(
        v.qp.qp_num(),
        FAKE_PSN,
        v.mr.addr() as u64,
        v.mr.rkey(),
        &pattern(6, 32),
    ))
    .expect("send");
    assert_eq!(nak_of(&read_frame(&mut s)), None);
    assert_eq!(v.qp.state(), QpState::Rts);
    srv.check_healthy();
}

#[test]
fn a_reset_queue_pair_expects_no_peer_until_its_next_rtr() {
    // A QP waiting in RTR for a peer that never came is reset: it expects that peer no
    // more, so the next connection's peer, dialing before the QP is back in RTR, is kept
    // for it (before, it was closed as "a QP other than the one expected").
    let mut srv = Server::new();
    let v = srv.victim();
    move_to(&v.qp, QpState::Err);
    move_to(&v.qp, QpState::Reset);
    const NEXT_QPN: u32 = FAKE_QPN + 1;
    let mut s = srv.connect_raw();
    s.write_all(&hello(v.qp.qp_num(), NEXT_QPN, v.qp.endpoint().secret))
        .expect("hello");
    std::thread::sleep(Duration::from_millis(100));
    let next = fake_peer(NEXT_QPN);
    v.qp.connect(next, &ConnectOptions::default())
        .expect("connect");
    s.write_all(&write_frame(
        v.qp.qp_num(),
        FAKE_PSN,
        v.mr.addr() as u64,
        v.mr.rkey(),
        &pattern(7, 32),
    ))
    .expect("send");
    assert_eq!(nak_of(&read_frame(&mut s)), None);
    srv.check_healthy();
}

#[test]
fn stalled_peer_fails_outstanding_requests_with_retry_exceeded() {
    // The peer says hello and then never answers: every request the victim sends must
    // complete with an error within timeout × (retries + 1), not hang (on tcp the ack
    // timeout is at least 0.5 s: 1.5 s here).
    let srv = Server::new();
    let registered = srv.ctx.registered_regions();
    let (qp, cq) = qp_in(&srv.pd);
    let mr = region(&srv.pd, 6);
    let mut opts = ConnectOptions::default();
    opts.timeout = 12; // 4.096 µs × 2^12 ≈ 17 ms
    opts.retry_cnt = 2;
    let fake = fake_peer(FAKE_QPN);
    qp.connect(fake, &opts).expect("connect");
    let mut s = srv.connect_raw();
    s.write_all(&hello(qp.qp_num(), FAKE_QPN, qp.endpoint().secret))
        .expect("hello");
    let remote = RemoteAddr {
        addr: 0x1000,
        rkey: 0x1234,
    };
    for id in 0..8u64 {
        let sge = LocalSge::new(&mr, (id as usize) * 64, 64).expect("SGE");
        let req = if id % 2 == 0 {
            SendRequest::write(id, remote).sge(sge)
        } else {
            SendRequest::read(id, remote).sge(sge)
        };
        qp.post_send(req).expect("post");
    }
    let before = image(&mr);
    let first = wait_one(&cq, "the first request");
    assert_eq!(
        (first.wr_id, first.status),
        (0, WcStatus::RetryExcErr),
        "{first:?}"
    );
    for id in 1..8u64 {
        let c = wait_one(&cq, "a later request");
        assert_eq!((c.wr_id, c.status), (id, WcStatus::WrFlushErr), "{c:?}");
    }
    assert_eq!(qp.state(), QpState::Err);
    assert_image(&image(&mr), &before, "READ targets without a response");
    // Every request has completed, so nothing holds the region: it goes with its handle.
    drop((qp, cq, mr));
    assert_eq!(
        srv.ctx.registered_regions(),
        registered,
        "a registration outlived the failed requests"
    );
    drop(s);
}

#[test]
fn connection_flood_keeps_memory_bounded() {
    // Hundreds of hostile connections, each opened, fed garbage and closed: the server's
    // memory must not grow with their number, and the listener must still serve.
    let mut srv = Server::new();
    let round = |n: u64| {
        for i in 0..n {
            let mut s = srv.connect_raw();
            let mut bytes = hello(0x77_0000 + i as u32, 5, 0).to_vec();
            bytes.extend_from_slice(&noise(i, 512));
            let _ = s.write_all(&bytes);
            wait_closed(&mut s);
        }
    };
    round(100);
    let base = rss();
    round(300);
    let grown = rss().saturating_sub(base);
    assert!(
        grown < 32 << 20,
        "resident memory grew by {grown} bytes over 300 hostile connections"
    );
    srv.check_healthy();
}

#[test]
fn connections_that_say_nothing_are_bounded() {
    // 300 connections that send nothing: at most 256 wait for their hello, each new one
    // closing the one that waited longest, so the first ones are closed at once rather
    // than after the hello timeout; connections made now still work.
    let mut srv = Server::new();
    let mut silent: Vec<TcpStream> = (0..300).map(|_| srv.connect_raw()).collect();
    for s in silent.iter_mut().take(30) {
        assert!(wait_closed(s).is_empty(), "the server sent something");
    }
    wait_logged("WARN", &["closing a connection that sent no hello"]);
    srv.check_healthy();
    drop(silent);
}

/// A length-prefixed SEND ONLY from the fake peer to `qp`.
fn send_frame(qp: u32, psn: u32, payload: &[u8]) -> Vec<u8> {
    let mut r = RcRepr::new(bth(Opcode::SendOnly, qp, psn, true));
    r.payload = payload;
    framed(&r)
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

/// Waits until byte `at` of `mr` is `value` (the victim placed a payload that far).
fn wait_byte(mr: &rdmx::MrRef, at: usize, value: u8, what: &str) {
    let start = Instant::now();
    loop {
        let mut b = [0u8; 1];
        mr.read_at(at, &mut b).expect("read");
        if b[0] == value {
            return;
        }
        assert!(start.elapsed() < DEADLINE, "{what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A SEND whose payload stops part-way before the peer closes does not complete its
/// receive with success: the message never arrived whole.
#[test]
fn a_send_cut_short_does_not_complete_its_receive() {
    let srv = Server::new();
    let v = srv.victim();
    let mut s = srv.dial(&v);
    let f = send_frame(v.qp.qp_num(), FAKE_PSN, &[0xEE; 48]);
    s.write_all(&f[..f.len() - 16])
        .expect("send part of a frame");
    s.shutdown(std::net::Shutdown::Write).expect("shutdown");
    wait_closed(&mut s);
    wait_state(&v.qp, QpState::Err);
    let c = wait_one(&v.cq, "the victim's receive");
    assert_eq!((c.wr_id, c.status), (77, WcStatus::WrFlushErr), "{c:?}");
}

/// A peer that stops part-way through a frame, keeping its stream open, fails the QP
/// within its retry budget (ack timeout × tries): the receive is flushed, and what the
/// half-read packet's headers completed does not complete with success.
#[test]
fn a_peer_stopped_mid_frame_fails_the_qp_within_its_retry_budget() {
    let srv = Server::new();
    let (qp, cq) = qp_in(&srv.pd);
    let mr = region(&srv.pd, 3);
    let mut opts = ConnectOptions::default();
    opts.timeout = 12; // 4.096 µs × 2^12 ≈ 17 ms, raised to the tcp floor of 0.5 s
    opts.retry_cnt = 2;
    let fake = fake_peer(FAKE_QPN);
    qp.connect(fake, &opts).expect("connect");
    qp.post_recv(RecvRequest::new(77).sge(LocalSge::new(&mr, 0, 64).expect("SGE")))
        .expect("post a receive");
    let mut s = srv.connect_raw();
    s.write_all(&hello(qp.qp_num(), FAKE_QPN, qp.endpoint().secret))
        .expect("hello");
    let f = send_frame(qp.qp_num(), FAKE_PSN, &[0xEE; 48]);
    s.write_all(&f[..f.len() - 16])
        .expect("send part of a frame");
    let start = Instant::now();
    wait_state(&qp, QpState::Err);
    let took = start.elapsed();
    let c = wait_one(&cq, "the receive");
    assert_eq!((c.wr_id, c.status), (77, WcStatus::WrFlushErr), "{c:?}");
    assert!(
        took >= Duration::from_millis(1000) && took < Duration::from_secs(10),
        "the QP failed after {took:?}, not after its retry budget (1.5 s)"
    );
    wait_logged("WARN", &["sent nothing more of a frame part-way read"]);
    drop(s);
}

/// A QP part-way through reading its peer's frame still sends the rest of the frame it
/// was itself part-way through writing: two peers each in the middle of the other's
/// frame then both finish (before, each waited for the other for good).
#[test]
fn a_qp_mid_frame_finishes_writing_its_own_frame() {
    let srv = Server::new();
    let v = srv.victim();
    let mut s = srv.dial(&v);
    // Megabytes of WRITEs the fake peer does not read: the victim's stream fills, with
    // a frame part-way written.
    let big = srv
        .pd
        .register(vec![7u8; 1 << 20], Access::LOCAL_WRITE)
        .expect("register");
    for id in 0..16u64 {
        let sge = LocalSge::new(&big, 0, 1 << 20).expect("SGE");
        v.qp.post_send(
            SendRequest::write(
                id,
                RemoteAddr {
                    addr: 0x1000,
                    rkey: 0x1234,
                },
            )
            .sge(sge),
        )
        .expect("post");
    }
    std::thread::sleep(Duration::from_millis(200));
    // Now the victim goes part-way through a frame of the peer's.
    let f = write_frame(
        v.qp.qp_num(),
        FAKE_PSN,
        v.mr.addr() as u64,
        v.mr.rkey(),
        &[0xEE; 256],
    );
    s.write_all(&f[..f.len() - 128])
        .expect("send part of a frame");
    std::thread::sleep(Duration::from_millis(100));
    // The peer reads: the victim's bytes must end on a frame boundary.
    s.set_read_timeout(Some(Duration::from_secs(2)))
        .expect("SO_RCVTIMEO");
    let mut frames = 0;
    loop {
        let mut len = [0u8; 4];
        match s.read_exact(&mut len) {
            Ok(()) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                break
            }
            Err(e) => panic!("reading the victim's frames: {e}"),
        }
        let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
        s.read_exact(&mut body).unwrap_or_else(|e| {
            panic!("the victim stopped part-way through frame {frames} it was sending: {e}")
        });
        frames += 1;
    }
    assert!(frames > 0, "the victim sent nothing");
}

/// A QP moved to ERR with WRITEs still queued for its stream (the peer reads slowly)
/// sends nothing of their memory once their flushed completions are out: what the
/// application writes there afterwards never reaches the peer.
#[test]
fn flushed_requests_send_nothing_of_their_memory() {
    let srv = Server::new();
    let v = srv.victim();
    let mut s = srv.dial(&v);
    // One WRITE of more than the stream buffers while the peer does not read: a frame
    // of it is part-way written, and more wait behind it.
    const BIG: usize = 16 << 20;
    let big = srv
        .pd
        .register(vec![0xAAu8; BIG], Access::LOCAL_WRITE)
        .expect("register");
    let to = RemoteAddr {
        addr: 0x1000,
        rkey: 0x1234,
    };
    v.qp.post_send(SendRequest::write(1, to).sge(LocalSge::new(&big, 0, BIG).expect("SGE")))
        .expect("post");
    std::thread::sleep(Duration::from_millis(200));
    move_to(&v.qp, QpState::Err);
    let mut flushed = false;
    while !flushed {
        let c = wait_one(&v.cq, "the flushed WRITE");
        if c.wr_id == 1 {
            assert_eq!(c.status, WcStatus::WrFlushErr, "{c:?}");
            flushed = true;
        }
    }
    // The application has its memory back.
    big.write_at(0, &vec![0x55u8; BIG]).expect("write");
    s.set_read_timeout(Some(Duration::from_secs(2)))
        .expect("SO_RCVTIMEO");
    let mut got = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                break
            }
            Err(e) => panic!("reading the victim's stream: {e}"),
        }
    }
    assert!(got.len() > 1 << 16, "the victim sent {} bytes", got.len());
    assert!(
        !got.windows(64).any(|w| w.iter().all(|&b| b == 0x55)),
        "memory written after its request was flushed reached the peer"
    );
}

/// A WRITE of `REGION` bytes into the victim's region, sent half: the first half is in
/// place when this returns. Returns the stream, the rest of the frame, and a reference
/// that keeps the region's memory readable.
fn half_a_write(srv: &Server, v: &Victim) -> (TcpStream, Vec<u8>, rdmx::MrRef) {
    let mut s = srv.dial(v);
    let f = write_frame(
        v.qp.qp_num(),
        FAKE_PSN,
        v.mr.addr() as u64,
        v.mr.rkey(),
        &[0xEE; REGION],
    );
    let half = f.len() - REGION / 2;
    s.write_all(&f[..half]).expect("send half of a WRITE");
    // The first half is in place once the victim has read it.
    let keep = v.mr.share();
    wait_byte(
        &keep,
        REGION / 2 - 1 - 16,
        0xEE,
        "the first half never landed",
    );
    (s, f[half..].to_vec(), keep)
}

/// Whether the second half of the victim's region still holds what it held before.
fn second_half_unchanged(keep: &rdmx::MrRef, before: &[u8]) -> bool {
    let mut now = vec![0u8; REGION];
    keep.read_at(0, &mut now).expect("read");
    now[REGION / 2..] == before[REGION / 2..]
}

/// A region deregistered while a peer's WRITE into it is part-way read: once the
/// deregistration returns, nothing more of the WRITE reaches the memory (the rest
/// arrives after it), and the QP fails rather than completing the WRITE.
#[test]
fn a_write_part_way_read_stops_at_deregistration() {
    let srv = Server::new();
    let v = srv.victim();
    let (mut s, rest, keep) = half_a_write(&srv, &v);
    let Victim { qp, cq, mr, before } = v;
    drop(mr);
    s.write_all(&rest).expect("send the rest");
    wait_state(&qp, QpState::Err);
    let c = wait_one(&cq, "the victim's receive");
    assert_eq!((c.wr_id, c.status), (77, WcStatus::WrFlushErr), "{c:?}");
    assert!(
        second_half_unchanged(&keep, &before),
        "bytes of the WRITE landed after the region was deregistered"
    );
    wait_logged("WARN", &["being deregistered"]);
}

/// A QP moved to ERR part-way through reading a peer's WRITE places nothing more of it:
/// the rest, arriving after the move, does not reach the memory (a QP in ERR takes no
/// more of its peer's bytes, so a fence through another channel is one).
#[test]
fn a_write_part_way_read_stops_when_the_qp_goes_to_err() {
    let srv = Server::new();
    let v = srv.victim();
    let (mut s, rest, keep) = half_a_write(&srv, &v);
    move_to(&v.qp, QpState::Err);
    // The rest arrives after the move; the stream may be gone already.
    let _ = s.write_all(&rest);
    let c = wait_one(&v.cq, "the victim's receive");
    assert_eq!((c.wr_id, c.status), (77, WcStatus::WrFlushErr), "{c:?}");
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        second_half_unchanged(&keep, &v.before),
        "bytes of the WRITE landed after the QP went to ERR"
    );
}

/// A QP moved to RESET part-way through a peer's SEND payload does not complete its
/// receive with success.
#[test]
fn a_reset_part_way_through_a_send_completes_nothing_with_success() {
    let srv = Server::new();
    let v = srv.victim();
    let mut s = srv.dial(&v);
    let f = send_frame(v.qp.qp_num(), FAKE_PSN, &[0xEE; 48]);
    s.write_all(&f[..f.len() - 16])
        .expect("send part of a frame");
    // The headers are read once the first payload bytes are placed.
    wait_byte(&v.mr.share(), 0, 0xEE, "the payload never started");
    move_to(&v.qp, QpState::Reset);
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(300) {
        if let Some(c) = v.cq.poll_one().expect("poll") {
            assert_ne!(c.status, WcStatus::Success, "{c:?}");
        }
    }
    drop(s);
}

/// A READ response cut short fails the READ, not the SEND before it that its headers
/// acknowledged: that SEND was executed.
#[test]
fn a_read_response_cut_short_fails_the_read_only() {
    let srv = Server::new();
    let v = srv.victim();
    let mut s = srv.dial(&v);
    let src = srv
        .pd
        .register(vec![1u8; 64], Access::LOCAL_WRITE)
        .expect("register");
    v.qp.post_send(SendRequest::send(1).sge(LocalSge::new(&src, 0, 16).expect("SGE")))
        .expect("post the SEND");
    let remote = RemoteAddr {
        addr: 0x1000,
        rkey: 0x1234,
    };
    v.qp.post_send(SendRequest::read(2, remote).sge(LocalSge::new(&v.mr, 0, 64).expect("SGE")))
        .expect("post the READ");
    let send = RcRepr::parse_bytes(&read_frame(&mut s))
        .expect("the SEND")
        .bth
        .psn;
    let read = RcRepr::parse_bytes(&read_frame(&mut s))
        .expect("the READ")
        .bth
        .psn;
    assert_eq!(read, (send + 1) & 0xff_ffff);
    let mut r = RcRepr::new(bth(
        Opcode::RdmaReadResponseOnly,
        v.qp.qp_num(),
        read,
        false,
    ));
    r.aeth = Some(rdmx_wire::AethRepr {
        syndrome: Syndrome::Ack {
            credits: rdmx_wire::Credits::UNLIMITED,
        },
        msn: 2,
    });
    let payload = [0xAB; 64];
    r.payload = &payload;
    let f = framed(&r);
    s.write_all(&f[..f.len() - 32])
        .expect("send part of the response");
    s.shutdown(std::net::Shutdown::Write).expect("shutdown");
    let mut got = Vec::new();
    while got.len() < 3 {
        got.push(wait_one(&v.cq, "the victim's completions"));
    }
    got.sort_by_key(|c| c.wr_id);
    assert_eq!(
        got.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [
            (1, WcStatus::Success),
            (2, WcStatus::WrFlushErr),
            (77, WcStatus::WrFlushErr)
        ],
        "{got:?}"
    );
}
