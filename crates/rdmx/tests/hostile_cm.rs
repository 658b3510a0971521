//! Hostile peers against the connection manager's listener (`rdmx::cm`).
//!
//! Each test plays a peer that breaks the endpoint exchange — random bytes, oversized
//! private data, a wrong queue-pair count, a bad address family, a truncated message, a
//! peer that stalls — and checks that `accept` fails with an error naming what was wrong
//! (never a panic or a hang), within its timeout, without connecting the QP, without
//! sending the peer a byte (its endpoints carry the QP's secret), and that the same
//! listener then serves a valid peer.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use rdmx::{
    cm, CompletionQueue, ConnectOptions, Context, ProtectionDomain, QpCaps, QpState, QueuePair,
};

/// Generous bound for anything that must happen "soon" on a loaded machine.
const DEADLINE: Duration = Duration::from_secs(30);

fn tcp() -> Context {
    Context::open_provider("tcp").expect("open a tcp context")
}

fn qp_in(pd: &ProtectionDomain) -> (QueuePair, CompletionQueue) {
    let cq = pd.context().create_cq(256).expect("create a CQ");
    let qp = pd
        .create_qp(&cq, &cq, QpCaps::default())
        .expect("create a QP");
    (qp, cq)
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

/// Runs `attack` against a `cm::Listener` accepting for one QP, expects `accept` to fail
/// with an error (never a panic or a hang) having sent the attacker nothing, then lets a
/// valid peer connect.
fn cm_attack(attack: impl FnOnce(&mut TcpStream) + Send + 'static, expect: &str) {
    let srv = tcp();
    let pd = srv.alloc_pd();
    let (qp, _cq) = qp_in(&pd);
    let listener = cm::Listener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let attacker = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).expect("dial the cm listener");
        s.set_read_timeout(Some(DEADLINE)).expect("SO_RCVTIMEO");
        attack(&mut s);
        // Keep the stream until the listener drops it, so its error is the one the
        // attack provokes rather than a reset.
        let mut learned = Vec::new();
        let _ = s.read_to_end(&mut learned);
        learned
    });
    let start = Instant::now();
    let res = listener.accept(
        std::slice::from_ref(&qp),
        &ConnectOptions::default(),
        b"server",
        Duration::from_secs(3),
    );
    let err = res.expect_err("a hostile peer must not connect");
    assert!(
        err.to_string().contains(expect),
        "accept failed with {err}, expected {expect:?}"
    );
    assert!(
        start.elapsed() < DEADLINE,
        "accept took {:?}",
        start.elapsed()
    );
    let learned = attacker.join().expect("the attacker thread");
    assert!(
        learned.is_empty(),
        "the listener sent a peer that broke the exchange {} bytes: {:?}",
        learned.len(),
        &learned[..learned.len().min(16)]
    );
    assert_eq!(
        qp.state(),
        QpState::Reset,
        "a failed exchange connected the QP"
    );

    // The listener still serves a valid peer.
    let (qp2, _cq2) = qp_in(&pd);
    serves_a_valid_peer(&listener, &qp2);
}

/// `listener` connects `qp` to a valid peer that dials it: both QPs end in RTS, each side
/// with the other's private data.
fn serves_a_valid_peer(listener: &cm::Listener, qp: &QueuePair) {
    let addr = listener.local_addr().expect("addr");
    let cli = tcp();
    let cli_pd = cli.alloc_pd();
    let (cqp, _ccq) = qp_in(&cli_pd);
    let peer = std::thread::spawn(move || {
        let got = cm::connect(
            addr,
            std::slice::from_ref(&cqp),
            &ConnectOptions::default(),
            b"client",
            DEADLINE,
        )
        .expect("a valid peer connects");
        (got, cqp, cli)
    });
    let got = listener
        .accept(
            std::slice::from_ref(qp),
            &ConnectOptions::default(),
            b"server",
            DEADLINE,
        )
        .expect("accept a valid peer");
    assert_eq!(got, b"client");
    let (theirs, cqp, _cli) = peer.join().expect("the valid peer");
    assert_eq!(theirs, b"server");
    assert_eq!((qp.state(), cqp.state()), (QpState::Rts, QpState::Rts));
}

fn cm_head(n: u32, plen: u32) -> Vec<u8> {
    let mut h = b"RDMXCM02".to_vec();
    h.extend_from_slice(&n.to_be_bytes());
    h.extend_from_slice(&plen.to_be_bytes());
    h
}

#[test]
fn cm_random_bytes() {
    cm_attack(
        |s| {
            let _ = s.write_all(&noise(99, 4096));
        },
        "not an rdmx connection manager",
    );
}

#[test]
fn cm_oversized_private_data() {
    cm_attack(
        |s| {
            let _ = s.write_all(&cm_head(1, u32::MAX));
        },
        "too much private data",
    );
}

#[test]
fn cm_wrong_qp_count() {
    cm_attack(
        |s| {
            let _ = s.write_all(&cm_head(0xFFFF_FFFF, 0));
        },
        "different number of queue pairs",
    );
}

#[test]
fn cm_bad_address_family() {
    cm_attack(
        |s| {
            let mut m = cm_head(1, 0);
            let mut ep = [0u8; rdmx::QpEndpoint::LEN];
            ep[0] = 1;
            ep[21] = 9;
            m.extend_from_slice(&ep);
            let _ = s.write_all(&m);
        },
        "unknown kind",
    );
}

#[test]
fn cm_truncated_then_closed() {
    cm_attack(
        |s| {
            let mut m = cm_head(1, 100);
            m.extend_from_slice(&[0u8; 20]);
            let _ = s.write_all(&m);
            let _ = s.shutdown(std::net::Shutdown::Write);
        },
        "connection-setup exchange",
    );
}

#[test]
fn cm_peer_that_stalls() {
    cm_attack(
        |s| {
            let _ = s.write_all(b"RDMX");
            // Hold the connection open past the accept timeout.
            std::thread::sleep(Duration::from_secs(5));
        },
        "connection-setup exchange",
    );
}

#[test]
fn cm_peer_that_trickles() {
    // One byte every 400 ms: each read waits less than the accept's 3 s, but the whole
    // exchange is bounded by it (sent whole, the attack would take 40 s, past the
    // test's deadline).
    cm_attack(
        |s| {
            let mut h = cm_head(1, 1024);
            h.extend_from_slice(&[0u8; 84]);
            for b in h {
                if s.write_all(&[b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(400));
            }
        },
        "connection-setup exchange",
    );
}

/// A well-formed rdmx peer whose private data the listener does not admit
/// (`accept_checked`): the accept fails naming the refusal, neither QP is connected, the
/// peer's connect fails having learned nothing, and the listener then serves the peer it
/// admits.
#[test]
fn cm_peer_not_admitted() {
    let srv = tcp();
    let pd = srv.alloc_pd();
    let listener = cm::Listener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let dial = |private: &'static [u8]| {
        std::thread::spawn(move || {
            let cli = tcp();
            let cli_pd = cli.alloc_pd();
            let (cqp, _ccq) = qp_in(&cli_pd);
            let got = cm::connect(
                addr,
                std::slice::from_ref(&cqp),
                &ConnectOptions::default(),
                private,
                DEADLINE,
            );
            let state = cqp.state();
            // The QP and its context stay up until the test has looked at both sides.
            (got, state, cqp, cli)
        })
    };
    let (qp, _cq) = qp_in(&pd);
    let accept = || {
        listener.accept_checked(
            std::slice::from_ref(&qp),
            &ConnectOptions::default(),
            b"server",
            DEADLINE,
            |p| p == b"invited",
            || Ok(()),
        )
    };
    let stranger = dial(b"stranger");
    let err = accept().expect_err("a peer not admitted must not connect");
    assert!(err.to_string().contains("refused"), "{err}");
    assert_eq!(
        qp.state(),
        QpState::Reset,
        "the refused exchange connected the QP"
    );
    let (got, state, _, _) = stranger.join().expect("the stranger");
    assert!(got.is_err(), "the stranger learned {got:?}");
    assert_eq!(state, QpState::Reset, "the stranger's QP was connected");

    let invited = dial(b"invited");
    let got = accept().expect("accept the peer admitted");
    assert_eq!(got, b"invited");
    let (theirs, state, _cqp, _cli) = invited.join().expect("the invited peer");
    assert_eq!(theirs.expect("the invited peer connects"), b"server");
    assert_eq!((qp.state(), state), (QpState::Rts, QpState::Rts));
}

/// A well-formed peer whose endpoint cannot be reached (the listener's QP has to dial
/// it, and the port is closed): the accept fails, its queue pairs are back in RESET,
/// and the listener then connects a valid peer with the same queue pair.
#[test]
fn cm_peer_that_cannot_be_reached_leaves_the_qps_in_reset() {
    let srv = tcp();
    let pd = srv.alloc_pd();
    let (qp, _cq) = qp_in(&pd);
    let listener = cm::Listener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a port");
    let attacker = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).expect("dial the cm listener");
        s.set_read_timeout(Some(DEADLINE)).expect("SO_RCVTIMEO");
        let ep = rdmx::QpEndpoint {
            qp_num: 0xff_ffff,
            psn: 0xff_ffff,
            mtu: 4096,
            secret: 1,
            addr: rdmx::PeerAddr::Ip(closed),
        };
        let mut m = cm_head(1, 0);
        m.extend_from_slice(&ep.to_bytes());
        let _ = s.write_all(&m);
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
    });
    let err = listener
        .accept(
            std::slice::from_ref(&qp),
            &ConnectOptions::default(),
            b"server",
            Duration::from_secs(3),
        )
        .expect_err("an unreachable peer must not connect");
    attacker.join().expect("the attacker thread");
    assert_eq!(qp.state(), QpState::Reset, "after {err}");

    serves_a_valid_peer(&listener, &qp);
}
