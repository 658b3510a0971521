//! The tcp driver reads streams edge-triggered: one readiness event per arrival. These
//! tests send a stream's last bytes and its end in one segment (corked, then shut down),
//! so that both land in one event, and check that the end is still noticed: the server
//! closes the stream and the QP fails, flushing its receive. A stream from a QP other than
//! the one a QP expects is closed at once.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use rdmx::{
    Access, CompletionQueue, ConnectOptions, Context, LocalSge, PeerAddr, ProtectionDomain, QpCaps,
    QpEndpoint, QpState, QueuePair, RecvRequest, WcStatus,
};

const DEADLINE: Duration = Duration::from_secs(10);
/// The fake peer's QP number: smaller than any real one, so the fake peer is the side
/// that dials.
const FAKE_QPN: u32 = 1;

/// The tcp provider's hello from QP `from` to `qp`, presenting `qp`'s secret.
fn hello(qp: &QueuePair, from: u32) -> Vec<u8> {
    hello_with(qp, from, qp.endpoint().secret)
}

fn hello_with(qp: &QueuePair, from: u32, secret: u64) -> Vec<u8> {
    [
        &b"RDMXTCP2"[..],
        &qp.qp_num().to_be_bytes(),
        &from.to_be_bytes(),
        &secret.to_be_bytes(),
    ]
    .concat()
}

/// A QP expecting the fake peer, with a receive posted.
fn victim(pd: &ProtectionDomain) -> (QueuePair, CompletionQueue) {
    let cq = pd.context().create_cq(8).unwrap();
    let qp = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
    let fake = QpEndpoint {
        qp_num: FAKE_QPN,
        psn: 0,
        mtu: 65536,
        secret: 0,
        addr: PeerAddr::Ip(SocketAddr::from(([127, 0, 0, 1], 9))),
    };
    qp.connect(fake, &ConnectOptions::default()).unwrap();
    let mr = pd.register(vec![0u8; 64], Access::LOCAL_WRITE).unwrap();
    qp.post_recv(RecvRequest::new(7).sge(LocalSge::new(&mr, 0, 64).unwrap()))
        .unwrap();
    (qp, cq)
}

fn dial(ctx: &Context) -> TcpStream {
    let port = ctx.listen_addr().unwrap().port();
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    s.set_nodelay(true).unwrap();
    s
}

/// Holds back what is written to `s` until it is shut down, so the last bytes and the
/// end of the stream leave in one segment.
fn cork(s: &TcpStream) {
    let on: libc::c_int = 1;
    // SAFETY: setsockopt on a socket `s` owns, reading one c_int from a live local.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_CORK,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "TCP_CORK: {}", std::io::Error::last_os_error());
}

/// Waits for the server to close `s`.
#[track_caller]
fn closed_by_server(s: &mut TcpStream, what: &str) {
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return,
            Err(e) => panic!("{what}: the server did not close the stream ({e})"),
        }
    }
}

#[track_caller]
fn fails_with_its_receive_flushed(qp: &QueuePair, cq: &CompletionQueue, what: &str) {
    let start = Instant::now();
    loop {
        if let Some(c) = cq.poll_one().unwrap() {
            assert_eq!(
                (c.wr_id, c.status),
                (7, WcStatus::WrFlushErr),
                "{what}: {c:?}"
            );
            assert_eq!(qp.state(), QpState::Err, "{what}");
            return;
        }
        assert!(start.elapsed() < DEADLINE, "{what}: the QP never failed");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn last_bytes_and_end_of_stream_together_are_noticed() {
    let ctx = Context::open_provider("tcp").unwrap();
    let pd = ctx.alloc_pd();
    // The hello alone, then: part of a length prefix, a whole prefix, a prefix and part
    // of the headers; each followed at once by the end of the stream.
    let tails: [&[u8]; 3] = [&[0, 0], &[0, 0, 0, 40], &[0, 0, 0, 40, 0x0a, 0]];
    for round in 0..30 {
        let tail = tails[round % tails.len()];
        let (qp, cq) = victim(&pd);
        let mut s = dial(&ctx);
        s.write_all(&hello(&qp, FAKE_QPN)).unwrap();
        // Once the QP has its stream (its readiness then comes from events), the tail
        // and the end of the stream, together.
        std::thread::sleep(Duration::from_millis(20));
        cork(&s);
        s.write_all(tail).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let what = format!("round {round}, {} trailing bytes", tail.len());
        closed_by_server(&mut s, &what);
        fails_with_its_receive_flushed(&qp, &cq, &what);
    }
}

#[test]
fn a_stream_from_another_qp_is_closed_at_once() {
    let ctx = Context::open_provider("tcp").unwrap();
    let pd = ctx.alloc_pd();
    let (qp, _cq) = victim(&pd);
    let mut s = dial(&ctx);
    s.write_all(&hello(&qp, FAKE_QPN + 1)).unwrap();
    closed_by_server(&mut s, "a hello from an unexpected QP");
    // The QP still waits for the peer it expects, which can then connect.
    let mut s = dial(&ctx);
    s.write_all(&hello(&qp, FAKE_QPN)).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut buf = [0u8; 1];
    let err = s
        .read(&mut buf)
        .expect_err("the expected peer's stream stays open");
    assert!(
        matches!(
            err.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
        "{err}"
    );
    assert_eq!(qp.state(), QpState::Rts);
}

#[test]
fn a_hello_without_the_secret_is_closed_and_the_qp_waits_on() {
    // A hijacker who knows both QP numbers (they are small and easy to guess) but not
    // the victim's secret is refused; the real peer, which has it, then connects.
    let ctx = Context::open_provider("tcp").unwrap();
    let pd = ctx.alloc_pd();
    let (qp, _cq) = victim(&pd);
    let secret = qp.endpoint().secret;
    for guess in [0, 1, secret ^ 1, !secret, secret.rotate_left(32)] {
        let mut s = dial(&ctx);
        s.write_all(&hello_with(&qp, FAKE_QPN, guess)).unwrap();
        closed_by_server(&mut s, "a hello with the wrong secret");
    }
    assert_eq!(
        qp.state(),
        QpState::Rts,
        "the hijack attempts left the QP alone"
    );
    let mut s = dial(&ctx);
    s.write_all(&hello(&qp, FAKE_QPN)).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut buf = [0u8; 1];
    match s.read(&mut buf) {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) => {}
        other => panic!("the real peer's stream was not kept: {other:?}"),
    }
}
