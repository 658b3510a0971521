//! Arbitrary datagrams for the udp provider's receive path.
//!
//! One pair of connected udp queue pairs (two contexts on two loopback addresses) lives
//! across inputs. Byte 0 of an input selects how the rest is delivered to the victim:
//!
//! - bit 0: seal it with a correct ICRC (so the headers reach the parsers), else as is;
//! - bit 1: as if from the peer's address (reaching the QP), else from a stranger's;
//! - bit 2: overwrite the BTH's destination QP with the victim's;
//! - bit 3: that QP is the victim context's UD queue pair (receives posted, Q_Key
//!   `QKEY`), not its RC one.
//!
//! Checked: no panic; a poll returns; the victim's QP ends in RTS or ERR; the UD QP stays
//! in RTS; a region without remote access never changes.
#![no_main]

use std::net::SocketAddr;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use rdmx::{
    Access, CompletionQueue, ConnectOptions, Context, LocalSge, MemoryRegion, QpCaps, QpState,
    QpType, QueuePair, RecvRequest,
};

const LEN: usize = 4096;
const QKEY: u32 = 0x1111_2222;

struct Fixture {
    victim: Context,
    vcq: CompletionQueue,
    vqp: QueuePair,
    ud: QueuePair,
    _ud_buf: MemoryRegion,
    _peer: (Context, QueuePair),
    peer_addr: SocketAddr,
    victim_addr: SocketAddr,
    _open: MemoryRegion,
    closed: MemoryRegion,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let open = |a: &str| {
            Context::open(rdmx::udp::Options::default().bind(a.parse().expect("addr")))
                .expect("open udp")
        };
        let victim = open("127.3.0.1:4791");
        let peer = open("127.3.0.2:4791");
        let vcq = victim.create_cq(64).expect("cq");
        let pcq = peer.create_cq(64).expect("cq");
        let vpd = victim.alloc_pd();
        let vqp = vpd.create_qp(&vcq, &vcq, QpCaps::default()).expect("qp");
        let pqp = peer
            .alloc_pd()
            .create_qp(&pcq, &pcq, QpCaps::default())
            .expect("qp");
        let o = ConnectOptions::default();
        vqp.connect(pqp.endpoint(), &o).expect("connect");
        pqp.connect(vqp.endpoint(), &o).expect("connect");
        let open_mr = vpd.register(vec![0u8; LEN], Access::ALL).expect("register");
        let closed = vpd
            .register(vec![0x5au8; LEN], Access::LOCAL_WRITE)
            .expect("register");
        let ud = vpd
            .create_qp_of_type(QpType::Ud, &vcq, &vcq, None, QpCaps::default())
            .expect("a UD qp");
        ud.activate(QKEY).expect("activate");
        // Receives for the first datagrams that pass; later ones find none (dropped).
        let ud_buf = vpd
            .register(vec![0u8; 64 * 1024], Access::LOCAL_WRITE)
            .expect("register");
        for i in 0..64 {
            let sge = LocalSge::new(&ud_buf, i * 1024, 1024).expect("sge");
            ud.post_recv(RecvRequest::new(i as u64).sge(sge))
                .expect("post_recv");
        }
        Fixture {
            peer_addr: rdmx::udp::local_addr(&peer).expect("udp"),
            victim_addr: rdmx::udp::local_addr(&victim).expect("udp"),
            victim,
            vcq,
            vqp,
            ud,
            _ud_buf: ud_buf,
            _peer: (peer, pqp),
            _open: open_mr,
            closed,
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let mut d = rest.to_vec();
    if sel & 4 != 0 && d.len() >= 8 {
        let qp = if sel & 8 != 0 { &f.ud } else { &f.vqp };
        d[5..8].copy_from_slice(&qp.qp_num().to_be_bytes()[1..]);
    }
    let from = if sel & 2 != 0 {
        f.peer_addr
    } else {
        "127.3.0.9:4791".parse().expect("addr")
    };
    if sel & 1 != 0 {
        let c = rdmx::udp::icrc::icrc(from, f.victim_addr, &d);
        d.extend_from_slice(&c.to_le_bytes());
    }
    rdmx::udp::inject(&f.victim, from, &d);
    let _ = f.vcq.poll_one();
    let state = f.vqp.state();
    assert!(
        state == QpState::Rts || state == QpState::Err,
        "the victim's QP is in {state:?}"
    );
    assert_eq!(f.ud.state(), QpState::Rts, "datagrams do not move a UD QP");
    let mut closed = vec![0u8; LEN];
    f.closed.read_at(0, &mut closed).expect("read");
    assert!(closed.iter().all(|&b| b == 0x5a), "a closed region changed");
});
