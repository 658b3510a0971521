//! The provider conformance suite (`tests/conformance/`) on the udp provider, both sides
//! in this process, each with its own context bound to its own loopback address on port
//! 4791 (127.0.0.1 and 127.0.0.2 for the first pair, 127.0.1.1 and 127.0.1.2 for the
//! next, ...), so every request crosses real UDP sockets as RoCEv2 datagrams with checked
//! ICRCs. `loss_udp` runs the loss-recovery tests (`faults.rs`) with the faults injected
//! at the sending socket: datagrams dropped, duplicated, reordered, delayed, corrupted
//! (then dropped by the receiver's ICRC check) or with mangled headers (resealed, so the
//! parsers must reject them). `conformance_udp_gso` runs the suite with UDP GSO and GRO (the default),
//! `conformance_udp` with them off.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU32, Ordering};

use rdmx::loopback::faults::{FaultStats, Faults};
use rdmx::Context;

#[macro_use]
mod conformance;

#[path = "faults.rs"]
mod loss_udp;

/// Opens a udp context on the next free loopback address, port 4791.
fn open_udp(opts: rdmx::udp::Options) -> rdmx::Result<Context> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let mut last = None;
    for _ in 0..512 {
        let k = NEXT.fetch_add(1, Ordering::Relaxed) % 500;
        let ip = Ipv4Addr::new(127, 0, (k / 2) as u8, 1 + (k % 2) as u8);
        let addr = SocketAddr::from((ip, rdmx::udp::ROCE_PORT));
        match Context::open(opts.clone().bind(addr)) {
            Ok(c) => return Ok(c),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("tried"))
}

/// For `loss_udp`: the ack timeout code, 4.096 µs × 2^14 ≈ 67 ms (8 tries, about 0.5 s
/// before a request fails). The contexts' driver threads answer, and a busy machine may
/// keep one from running for longer than loopback's 17 ms tries allow.
const FAULT_ACK_TIMEOUT: u8 = 14;

/// For `loss_udp`: a udp context with `faults`.
fn open_faulty(faults: Option<Faults>) -> Context {
    let mut o = rdmx::udp::Options::default();
    if let Some(f) = faults {
        o = o.faults(f);
    }
    open_udp(o).expect("open a udp context")
}

/// For `loss_udp`: what fault injection did.
fn fault_stats(ctx: &Context) -> Option<FaultStats> {
    rdmx::udp::fault_stats(ctx)
}

/// A WRITE of `sges` elements of `sge_len` bytes each from a context with GSO on to one
/// with GRO `rx_gro`: what the receiver counted.
fn gso_write(rx_gro: bool, sges: usize, sge_len: usize) -> rdmx::udp::UdpStats {
    use rdmx::{Access, ConnectOptions, LocalSge, Mtu, QpCaps, RemoteAddr, SendRequest};
    let o = |gso| rdmx::udp::Options::default().gso(gso);
    let (ca, cb) = (
        open_udp(o(true)).expect("open"),
        open_udp(o(rx_gro)).expect("open"),
    );
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let (qa_cq, qb_cq) = (ca.create_cq(16).expect("cq"), cb.create_cq(16).expect("cq"));
    let qa = pa
        .create_qp(&qa_cq, &qa_cq, QpCaps::default().max_sge(sges.max(4)))
        .expect("qp");
    let qb = pb.create_qp(&qb_cq, &qb_cq, QpCaps::default()).expect("qp");
    let mut opts = ConnectOptions::default();
    opts.mtu = Some(Mtu::Mtu4096);
    qa.connect(qb.endpoint(), &opts).expect("connect");
    qb.connect(qa.endpoint(), &opts).expect("connect");
    let len = sges * sge_len;
    let data: Vec<u8> = (0..len as u32).map(|i| (i * 7 + i / 251) as u8).collect();
    let ma = pa.register(data.clone(), Access::ALL).expect("register");
    let mb = pb
        .register(vec![0u8; 65536], Access::ALL)
        .expect("register");
    let remote = RemoteAddr {
        addr: mb.addr() as u64,
        rkey: mb.rkey(),
    };
    let wr = (0..sges).fold(SendRequest::write(1, remote), |wr, k| {
        wr.sge(LocalSge::new(&ma, k * sge_len, sge_len).expect("sge"))
    });
    qa.post_send(wr).expect("post");
    let start = std::time::Instant::now();
    let c = loop {
        if let Some(c) = qa_cq.poll_one().expect("poll") {
            break c;
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(10),
            "no completion"
        );
    };
    assert_eq!(c.status, rdmx::WcStatus::Success);
    let mut got = vec![0u8; len];
    mb.read_at(0, &mut got).expect("read");
    assert_eq!(got, data);
    rdmx::udp::stats(&cb).expect("udp")
}

/// With GSO on both sides, a multi-packet WRITE leaves in runs the receiver reads joined,
/// and every byte lands.
/// A send window beyond a quarter of the PSN space is refused when the context opens
/// (PSNs compare within half of it); the largest one opens.
#[test]
fn a_send_window_past_a_quarter_of_the_psn_space_is_refused() {
    let loopback = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    for window in [(1 << 22) + 1, u32::MAX] {
        let opts = rdmx::udp::Options::default()
            .send_window(window)
            .bind(loopback);
        match Context::open(opts) {
            Err(rdmx::Error::InvalidArgument(why)) => assert!(why.contains("window"), "{why}"),
            other => panic!("a send window of {window} packets: {other:?}"),
        }
    }
    open_udp(rdmx::udp::Options::default().send_window(1 << 22)).unwrap();
}

/// An IPv4-mapped IPv6 address is refused when the context opens: its packets would go
/// as IPv4 with an ICRC computed over an IPv6 header (every one dropped by the peer).
/// The same address as IPv4 opens.
#[test]
fn an_ipv4_mapped_ipv6_address_is_refused() {
    let mapped = SocketAddr::from((Ipv4Addr::LOCALHOST.to_ipv6_mapped(), 0));
    match Context::open(rdmx::udp::Options::default().bind(mapped)) {
        Err(rdmx::Error::InvalidArgument(why)) => assert!(why.contains("IPv4"), "{why}"),
        other => panic!("bound to {mapped}: {other:?}"),
    }
    let plain = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    open_udp(rdmx::udp::Options::default().bind(plain)).unwrap();
}

#[test]
fn gso_runs_arrive_joined() {
    let s = gso_write(true, 1, 65536);
    assert!(s.joined >= 2, "nothing arrived joined: {s:?}");
    assert_eq!(s.bad_icrc, 0, "{s:?}");
}

/// A receiver without GRO gets the segments of a GSO send one by one, each with the ICRC
/// of its own IPv4 identification, and accepts every one.
#[test]
fn gso_segments_pass_a_receiver_without_gro() {
    let s = gso_write(false, 1, 65536);
    assert_eq!((s.joined, s.bad_icrc), (0, 0), "{s:?}");
    assert!(s.delivered >= 16, "{s:?}");
}

/// A payload gathered from many small elements (a packet of 4096 bytes from 11 of them)
/// lands whole, each datagram with a correct ICRC.
#[test]
fn packets_gathered_from_many_elements_arrive_intact() {
    let s = gso_write(true, 32, 400);
    assert_eq!(s.bad_icrc, 0, "{s:?}");
    assert!(s.delivered >= 4, "{s:?}");
}

mod conformance_udp {
    use rdmx::Mtu;

    use crate::conformance::Provider;

    /// udp at its largest path MTU (4 KiB), one datagram per message (GSO and GRO off).
    const UDP: Provider = Provider {
        name: "udp",
        open: || crate::open_udp(rdmx::udp::Options::default().gso(false)),
        mtu: Mtu::Mtu4096,
    };

    conformance_suite!(UDP);
}

mod conformance_udp_small_mtu {
    use rdmx::Mtu;

    use crate::conformance::Provider;

    /// udp at the smallest path MTU (256 bytes), with a small send window: messages span
    /// many datagrams and the window fills.
    const UDP_256: Provider = Provider {
        name: "udp",
        open: || {
            crate::open_udp(
                rdmx::udp::Options::default()
                    .max_mtu(Mtu::Mtu256)
                    .send_window(16),
            )
        },
        mtu: Mtu::Mtu256,
    };

    conformance_suite!(UDP_256);
}

mod conformance_udp_gso {
    use rdmx::Mtu;

    use crate::conformance::Provider;

    /// udp as it opens by default, with UDP GSO and GRO: runs of equal-sized datagrams
    /// leave as one message and may arrive joined.
    const UDP_GSO: Provider = Provider {
        name: "udp",
        open: || crate::open_udp(rdmx::udp::Options::default()),
        mtu: Mtu::Mtu4096,
    };

    conformance_suite!(UDP_GSO);
}
