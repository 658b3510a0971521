//! Arbitrary bytes on a tcp provider's stream, after a valid hello, through real sockets.
//!
//! One tcp context per process listens; each input gets a fresh QP connected to a fake
//! peer, dials the listener as that peer, sends the hello and then the input's stream, and
//! closes its sending side. The driver parses the frames (length prefix, headers), hands
//! headers to the engine, and reads payloads straight into registered memory.
//!
//! The input's first byte says how the bytes are paced, since a stream driver's bugs often
//! hide in how bytes and the end of stream arrive: bit 0 set, the hello goes first and the
//! rest a millisecond later (after the server took the stream), so the stream's bytes and
//! its end arrive together on a watched socket; bit 1 set, the end of stream comes a
//! millisecond after the bytes. The remaining bytes are the stream.
//!
//! Values a peer learns from the endpoint exchange change from one input to the next, so
//! the input names them with placeholders that are replaced before sending:
//!
//! | placeholder | replaced with |
//! |---|---|
//! | `QPN#` | the victim QP's number (BTH destination QP: reserved byte, 24 bits) |
//! | `RKY#` | the rkey of `open` (remote write, read and atomic) |
//! | `CKY#` | the lkey of `closed` (local write only: no rkey at all) |
//! | `XKY#` | the rkey of `other` (every access, but another protection domain) |
//! | `OPENADDR`, `SHUTADDR`, `XPD_ADDR` | the address of `open`, `closed`, `other` |
//!
//! `fuzz/seeds/tcp_stream` holds valid frames written this way, `fuzz/dicts/tcp_stream`
//! the placeholders.
//!
//! Checked: no panic in this process (the driver runs on its own thread; a panic there
//! would stop every later input, which the next one notices as a stream never closed);
//! the server closes the stream within a deadline; the QP ends in ERR; the one posted
//! receive completes exactly once (with data or flushed); `closed` and `other` never
//! change; nothing is left registered beyond the fixed regions.
#![no_main]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use rdmx::{
    Access, ConnectOptions, Context, LocalSge, MemoryRegion, PeerAddr, ProtectionDomain, QpCaps,
    QpEndpoint, QpState, RecvRequest,
};

const DEADLINE: Duration = Duration::from_secs(8);
/// The fake peer's QP number: below every QP number the context hands out, so the
/// victim waits to be dialed rather than dialing.
const FAKE_QPN: u32 = 1;
const FAKE_PSN: u32 = 0;
const LEN: usize = 8192;
/// How long a paced input waits between its parts.
const PAUSE: Duration = Duration::from_millis(1);
const RECV_WR: u64 = 7;

struct Server {
    ctx: Context,
    pd: ProtectionDomain,
    /// Remote write, read and atomic: the input may name its key and use it.
    open: MemoryRegion,
    /// Local write only: no packet may ever change it.
    closed: MemoryRegion,
    /// Every access, in another PD: no packet on a QP of `pd` may ever change it.
    other: MemoryRegion,
    closed_bytes: Vec<u8>,
    other_bytes: Vec<u8>,
}

fn server() -> &'static Server {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(|| {
        let ctx = Context::open_provider("tcp").expect("open tcp");
        let pd = ctx.alloc_pd();
        let open = pd.register(vec![0u8; LEN], Access::ALL).expect("register");
        let closed = pd
            .register(vec![0u8; LEN], Access::LOCAL_WRITE)
            .expect("register");
        let other = ctx
            .alloc_pd()
            .register(vec![0u8; LEN], Access::ALL)
            .expect("register");
        let closed_bytes: Vec<u8> = (0..LEN).map(|i| (i * 7 + 3) as u8).collect();
        let other_bytes: Vec<u8> = (0..LEN).map(|i| (i * 13 + 5) as u8).collect();
        closed.write_at(0, &closed_bytes).expect("fill");
        other.write_at(0, &other_bytes).expect("fill");
        Server {
            ctx,
            pd,
            open,
            closed,
            other,
            closed_bytes,
            other_bytes,
        }
    })
}

/// `data` with every placeholder replaced (see the module docs).
fn substitute(data: &[u8], s: &Server, qpn: u32) -> Vec<u8> {
    let short: [(&[u8; 4], [u8; 4]); 4] = [
        (b"QPN#", (qpn & 0xff_ffff).to_be_bytes()),
        (b"RKY#", s.open.rkey().to_be_bytes()),
        (b"CKY#", s.closed.lkey().to_be_bytes()),
        (b"XKY#", s.other.rkey().to_be_bytes()),
    ];
    let long: [(&[u8; 8], [u8; 8]); 3] = [
        (b"OPENADDR", (s.open.addr() as u64).to_be_bytes()),
        (b"SHUTADDR", (s.closed.addr() as u64).to_be_bytes()),
        (b"XPD_ADDR", (s.other.addr() as u64).to_be_bytes()),
    ];
    let mut out = Vec::with_capacity(data.len());
    let mut i = 0;
    'scan: while i < data.len() {
        for (mark, with) in &long {
            if data[i..].starts_with(*mark) {
                out.extend_from_slice(with);
                i += 8;
                continue 'scan;
            }
        }
        for (mark, with) in &short {
            if data[i..].starts_with(*mark) {
                out.extend_from_slice(with);
                i += 4;
                continue 'scan;
            }
        }
        out.push(data[i]);
        i += 1;
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let s = server();
    let cq = s.ctx.create_cq(64).expect("cq");
    let qp =
        s.pd.create_qp(&cq, &cq, QpCaps::default())
            .expect("create a QP");
    let fake = QpEndpoint {
        qp_num: FAKE_QPN,
        psn: FAKE_PSN,
        mtu: 65536,
        secret: 0,
        addr: PeerAddr::Ip(SocketAddr::from(([127, 0, 0, 1], 9))),
    };
    qp.connect(fake, &ConnectOptions::default())
        .expect("connect");
    qp.post_recv(RecvRequest::new(RECV_WR).sge(LocalSge::new(&s.open, 0, 4096).expect("sge")))
        .expect("post a receive");
    let port = s.ctx.listen_addr().expect("listener").port();
    let mut sock = TcpStream::connect(("127.0.0.1", port)).expect("dial");
    sock.set_read_timeout(Some(DEADLINE)).expect("timeout");
    sock.set_nodelay(true).expect("TCP_NODELAY");
    let (pace, data) = data.split_first().map_or((0, data), |(p, d)| (*p, d));
    let mut bytes = Vec::with_capacity(24 + data.len());
    bytes.extend_from_slice(b"RDMXTCP2");
    bytes.extend_from_slice(&qp.qp_num().to_be_bytes());
    bytes.extend_from_slice(&FAKE_QPN.to_be_bytes());
    bytes.extend_from_slice(&qp.endpoint().secret.to_be_bytes());
    if pace & 1 != 0 {
        sock.write_all(&bytes).expect("send the hello");
        bytes.clear();
        std::thread::sleep(PAUSE);
    }
    bytes.extend_from_slice(&substitute(data, s, qp.qp_num()));
    // The server may close first (a protocol violation); then writing fails, which is fine.
    let _ = sock.write_all(&bytes);
    if pace & 2 != 0 {
        std::thread::sleep(PAUSE);
    }
    let _ = sock.shutdown(std::net::Shutdown::Write);
    // The server answers what it accepted, then closes once it reads our end of stream
    // (or earlier, on a protocol violation).
    let mut buf = [0u8; 4096];
    loop {
        match sock.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => panic!(
                "BUG: the server did not close the stream ({e}); QP {} is in {:?}",
                qp.qp_num(),
                qp.state()
            ),
        }
    }
    let start = Instant::now();
    while qp.state() != QpState::Err {
        assert!(
            start.elapsed() < DEADLINE,
            "BUG: the QP is not in ERR after its stream closed"
        );
        std::thread::sleep(Duration::from_micros(50));
    }
    // The receive completes once: with a SEND's data, or flushed when the QP failed.
    let mut recv_done = 0;
    loop {
        while let Some(c) = cq.poll_one().expect("poll") {
            assert_eq!(
                c.wr_id, RECV_WR,
                "BUG: a completion for nothing posted: {c:?}"
            );
            recv_done += 1;
        }
        if recv_done > 0 {
            break;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "BUG: the posted receive never completed"
        );
        std::thread::sleep(Duration::from_micros(50));
    }
    assert_eq!(recv_done, 1, "BUG: the receive completed more than once");
    let mut now = vec![0u8; LEN];
    s.closed.read_at(0, &mut now).expect("read");
    assert!(
        now == s.closed_bytes,
        "BUG: a region without remote access changed"
    );
    s.other.read_at(0, &mut now).expect("read");
    assert!(now == s.other_bytes, "BUG: another PD's region changed");
    drop(qp);
    assert_eq!(s.ctx.registered_regions(), 3, "BUG: registrations leaked");
});
