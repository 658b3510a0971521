//! Arbitrary bytes as the peer's side of a connection-manager exchange (`rdmx::cm`).
//!
//! A listener accepts one connection per input; the input is everything the peer sends
//! before closing its side. The server passes one QP, or two when the input's length is
//! odd, so the count in the peer's header sometimes matches (`fuzz/seeds/cm_exchange`
//! has well-formed exchanges of both kinds).
//!
//! Checked: `accept` returns, an error or the peer's private data, without panicking and
//! within its timeout; when it succeeds, the private data is exactly the bytes the header
//! announced (so never more than `MAX_PRIVATE`) and every QP is ready to send.
#![no_main]

use std::io::Write;
use std::net::TcpStream;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use rdmx::{cm, ConnectOptions, Context, ProtectionDomain, QpCaps, QpState};

/// Bytes per endpoint on the wire (`QpEndpoint::to_bytes`).
const EP_LEN: usize = rdmx::QpEndpoint::LEN;
const TIMEOUT: Duration = Duration::from_secs(5);

struct Server {
    ctx: Context,
    pd: ProtectionDomain,
    listener: cm::Listener,
}

fn server() -> &'static Server {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(|| {
        let ctx = Context::open_default().expect("open loopback");
        let pd = ctx.alloc_pd();
        let listener = cm::Listener::bind("127.0.0.1:0").expect("bind");
        Server { ctx, pd, listener }
    })
}

fuzz_target!(|data: &[u8]| {
    let s = server();
    let cq = s.ctx.create_cq(16).expect("cq");
    let n = 1 + (data.len() & 1);
    let qps: Vec<_> = (0..n)
        .map(|_| s.pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp"))
        .collect();
    let addr = s.listener.local_addr().expect("addr");
    let mut peer = TcpStream::connect(addr).expect("dial");
    // The server may refuse before reading everything; a failed write is part of the game.
    let _ = peer.write_all(data);
    let _ = peer.shutdown(std::net::Shutdown::Write);
    let start = Instant::now();
    let res = s
        .listener
        .accept(&qps, &ConnectOptions::default(), b"server", TIMEOUT);
    assert!(
        start.elapsed() < TIMEOUT * 2,
        "BUG: accept overran its timeout"
    );
    if let Ok(private) = res {
        assert!(
            private.len() <= cm::MAX_PRIVATE,
            "BUG: oversized private data"
        );
        let plen = u32::from_be_bytes(data[12..16].try_into().expect("4 bytes")) as usize;
        let at = 16 + n * EP_LEN;
        assert_eq!(
            private,
            data[at..at + plen],
            "BUG: private data is not what the header announced"
        );
        for qp in &qps {
            assert_eq!(qp.state(), QpState::Rts, "BUG: accepted but not connected");
        }
    }
    drop(peer);
});
