//! Hostile traffic against the udp provider: a connected pair of queue pairs (A on
//! 127.1.0.1, B on 127.1.0.2, each on port 4791 plus the test's offset) while a stranger
//! sends random datagrams, valid headers with bad ICRCs, forged QP numbers and PSNs, and
//! packets for QPs in other states, then floods B. Every such datagram is dropped and
//! counted (`rdmx::udp::stats`), B's memory stays as it was, memory stays bounded, and the
//! pair keeps working.

use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

mod common;

#[path = "common/memory.rs"]
mod memory;

use rdmx::udp::{icrc::icrc, stats, UdpStats};
use rdmx::{QpAttr, QpAttrMask, QpCaps, QpState};

use common::udp_pair::{image, opts, pair, pair_with, side, write_works, Side, DEADLINE};

/// A WRITE ONLY packet with a full RETH: to `qpn` at `psn`, 64 bytes of 0xEE aimed at the
/// start of `b`'s region.
fn write_packet(qpn: u32, psn: u32, b: &Side) -> Vec<u8> {
    let mut p = vec![0x0a, 0, 0xff, 0xff, 0];
    p.extend_from_slice(&qpn.to_be_bytes()[1..]);
    p.push(0x80);
    p.extend_from_slice(&psn.to_be_bytes()[1..]);
    p.extend_from_slice(&(b.mr.addr() as u64).to_be_bytes());
    p.extend_from_slice(&b.mr.rkey().to_be_bytes());
    p.extend_from_slice(&64u32.to_be_bytes());
    p.extend_from_slice(&[0xee; 64]);
    p
}

fn sealed(from: SocketAddr, to: SocketAddr, mut p: Vec<u8>) -> Vec<u8> {
    let c = icrc(from, to, &p);
    p.extend_from_slice(&c.to_le_bytes());
    p
}

/// Waits until B has received `n` more datagrams than `before` and settled each: every
/// datagram ends in one outcome (delivered, or dropped for one reason), counted after
/// `received`, so a snapshot taken as soon as `received` moves can miss the last one's
/// outcome (or the deadline).
fn received(b: &Side, before: UdpStats, n: u64) -> UdpStats {
    let settled = |s: &UdpStats| {
        s.delivered
            + s.bad_length
            + s.bad_icrc
            + s.bad_header
            + s.unknown_qp
            + s.wrong_source
            + s.not_ready
    };
    let start = Instant::now();
    loop {
        let _ = b.cq.poll_one();
        let s = stats(&b.ctx).expect("udp");
        let done = s.received >= before.received + n && settled(&s) >= settled(&before) + n;
        if done || start.elapsed() > DEADLINE {
            return s;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn strangers_datagrams_are_dropped_and_counted() {
    let _running = memory::alone();
    let (a, b) = pair(24791);
    write_works(&a, &b, 3);
    let before_mem = image(&b.mr);
    let stranger = UdpSocket::bind("127.1.0.9:0").expect("bind");
    let me = stranger.local_addr().expect("addr");
    let qpn = b.qp.qp_num();
    let psn = b.qp.attrs().rq_psn;

    // Random datagrams of every size up to beyond the largest packet, ten at a time, each
    // ten once B has read the ten before: every one is to be counted, so none may find
    // B's socket buffer full (a burst of 200, up to 5,000 bytes each, can overflow it
    // while B's thread waits for a core).
    let s0 = stats(&b.ctx).expect("udp");
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let mut upto = s0;
    for i in 0..200usize {
        let len = (rng.next() % 5000) as usize;
        let d: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        stranger.send_to(&d, b.addr).expect("send");
        if i % 10 == 9 {
            upto = received(&b, upto, 10);
        }
    }
    let s1 = received(&b, s0, 200);
    assert_eq!(s1.received - s0.received, 200, "{s1:?}");
    assert_eq!(s1.delivered, s0.delivered, "a random datagram reached a QP");
    assert_eq!(
        (s1.bad_length - s0.bad_length) + (s1.bad_icrc - s0.bad_icrc),
        200,
        "{s1:?}"
    );

    // Valid headers for B's QP at its expected PSN, but a wrong ICRC.
    let mut bad = sealed(me, b.addr, write_packet(qpn, psn, &b));
    let n = bad.len();
    bad[n - 1] ^= 0x40;
    stranger.send_to(&bad, b.addr).expect("send");
    // Sealed for another destination address: the ICRC covers it.
    let elsewhere: SocketAddr = "127.1.0.3:24791".parse().unwrap();
    stranger
        .send_to(&sealed(me, elsewhere, write_packet(qpn, psn, &b)), b.addr)
        .expect("send");
    let s2 = received(&b, s1, 2);
    assert_eq!(s2.bad_icrc - s1.bad_icrc, 2, "{s2:?}");

    // Correct ICRCs: a QP number B does not have, and B's QP from the wrong address.
    stranger
        .send_to(
            &sealed(me, b.addr, write_packet(qpn ^ 0x5555, psn, &b)),
            b.addr,
        )
        .expect("send");
    stranger
        .send_to(&sealed(me, b.addr, write_packet(qpn, psn, &b)), b.addr)
        .expect("send");
    // Another transport's opcode (RD SEND FIRST), and another partition.
    let mut rd = write_packet(qpn, psn, &b);
    rd[0] = 0x40;
    stranger
        .send_to(&sealed(me, b.addr, rd), b.addr)
        .expect("send");
    let mut pk = write_packet(qpn, psn, &b);
    pk[2] = 0x12;
    stranger
        .send_to(&sealed(me, b.addr, pk), b.addr)
        .expect("send");
    let s3 = received(&b, s2, 4);
    assert_eq!(s3.unknown_qp - s2.unknown_qp, 1, "{s3:?}");
    assert_eq!(s3.wrong_source - s2.wrong_source, 1, "{s3:?}");
    assert_eq!(s3.bad_header - s2.bad_header, 2, "{s3:?}");
    assert_eq!(s3.delivered, s0.delivered, "{s3:?}");

    assert_eq!(image(&b.mr), before_mem, "B's memory changed");
    write_works(&a, &b, 5);
}

#[test]
fn forged_psns_from_the_peers_address_are_harmless() {
    let _running = memory::alone();
    let (a, b) = pair(25791);
    write_works(&a, &b, 7);
    let before_mem = image(&b.mr);
    let qpn = b.qp.qp_num();
    let epsn = b.qp.attrs().rq_psn;
    // Spoofed as A (the provider's own receive path, as a spoofing sender on the path
    // would reach it): PSNs far ahead, just ahead, and behind (duplicates).
    let s0 = stats(&b.ctx).expect("udp");
    for psn in [
        (epsn + 0x40_0000) & 0xff_ffff,
        (epsn + 1) & 0xff_ffff,
        (epsn + 0xff_ffff) & 0xff_ffff,
        (epsn + 0xf0_0000) & 0xff_ffff,
    ] {
        let d = sealed(a.addr, b.addr, write_packet(qpn, psn, &b));
        assert!(rdmx::udp::inject(&b.ctx, a.addr, &d), "reached the QP");
    }
    let s1 = stats(&b.ctx).expect("udp");
    assert_eq!(s1.delivered - s0.delivered, 4);
    // The engine placed none of them: out of sequence or duplicates.
    assert_eq!(image(&b.mr), before_mem, "a forged PSN placed data");
    write_works(&a, &b, 9);
}

#[test]
fn packets_for_queue_pairs_in_other_states_are_dropped() {
    let _running = memory::alone();
    let (a, b) = pair(26791);
    // A second pair on the same contexts; B's end is then moved to ERR.
    let pd_a = a.qp.pd().clone();
    let pd_b = b.qp.pd().clone();
    let qa = pd_a.create_qp(&a.cq, &a.cq, QpCaps::default()).expect("qp");
    let qb = pd_b.create_qp(&b.cq, &b.cq, QpCaps::default()).expect("qp");
    qa.connect(qb.endpoint(), &opts()).expect("connect");
    qb.connect(qa.endpoint(), &opts()).expect("connect");
    let err = QpAttr {
        qp_state: QpState::Err,
        ..QpAttr::default()
    };
    qb.modify(&err, QpAttrMask::STATE).expect("to ERR");
    // A third QP of B, never connected (RESET).
    let qc = pd_b.create_qp(&b.cq, &b.cq, QpCaps::default()).expect("qp");
    let before_mem = image(&b.mr);
    let s0 = stats(&b.ctx).expect("udp");
    let d = sealed(a.addr, b.addr, write_packet(qb.qp_num(), 0, &b));
    assert!(!rdmx::udp::inject(&b.ctx, a.addr, &d));
    let d = sealed(a.addr, b.addr, write_packet(qc.qp_num(), 0, &b));
    assert!(!rdmx::udp::inject(&b.ctx, a.addr, &d));
    let s1 = stats(&b.ctx).expect("udp");
    assert_eq!(s1.not_ready - s0.not_ready, 1, "{s1:?}");
    // The unconnected QP has no peer: nothing is from its peer.
    assert_eq!(s1.wrong_source - s0.wrong_source, 1, "{s1:?}");
    assert_eq!(image(&b.mr), before_mem);
    write_works(&a, &b, 11);
}

#[test]
fn a_flood_is_dropped_with_bounded_memory_while_the_pair_keeps_working() {
    let _running = memory::alone();
    // The flood overflows B's socket buffer, so the pair's own packets are lost there as on
    // a congested link, and the engine retransmits them. The default ACK timeout (code 14,
    // 67 ms, 8 tries: about half a second) can run out while the flood lasts on a busy
    // machine (RetryExcErr, as RC defines); a pair that must ride out floods is given a
    // budget longer than they last, as here (code 18: 1.07 s per try).
    let mut o = opts();
    o.timeout = 18;
    let (a, b) = pair_with(27791, &o);
    write_works(&a, &b, 13);
    let before_mem = image(&b.mr);
    let qpn = b.qp.qp_num();
    let rss0 = memory::rss_kib();
    let s0 = stats(&b.ctx).expect("udp");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let target = b.addr;
    let (flag, region) = (stop.clone(), (b.mr.addr() as u64, b.mr.rkey()));
    let flooder = std::thread::spawn(move || {
        let s = UdpSocket::bind("127.1.0.9:0").expect("bind");
        let me = s.local_addr().expect("addr");
        let mut rng = Rng(99);
        let mut sent = 0u64;
        while !flag.load(std::sync::atomic::Ordering::Relaxed) && sent < 200_000 {
            // Mixed: garbage, and sealed WRITEs for B's QP at random PSNs.
            let d = if sent % 2 == 0 {
                (0..(rng.next() % 1500) as usize)
                    .map(|_| rng.next() as u8)
                    .collect()
            } else {
                let mut p = vec![0x0a, 0, 0xff, 0xff, 0];
                p.extend_from_slice(&qpn.to_be_bytes()[1..]);
                p.push(0x80);
                p.extend_from_slice(&(rng.next() as u32).to_be_bytes()[1..]);
                p.extend_from_slice(&region.0.to_be_bytes());
                p.extend_from_slice(&region.1.to_be_bytes());
                p.extend_from_slice(&64u32.to_be_bytes());
                p.extend_from_slice(&[0xee; 64]);
                sealed(me, target, p)
            };
            if s.send_to(&d, target).is_ok() {
                sent += 1;
            }
        }
        sent
    });
    // The pair works during the flood.
    while stats(&b.ctx).expect("udp").received - s0.received < 1000 {
        std::thread::sleep(Duration::from_millis(1));
    }
    for round in 0..20u8 {
        write_works(&a, &b, 15 + round);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = flooder.join().expect("flooder");
    // Let B read what is left in its socket.
    std::thread::sleep(Duration::from_millis(50));
    let _ = b.cq.poll_one();
    let s1 = stats(&b.ctx).expect("udp");
    let dropped = (s1.bad_length - s0.bad_length)
        + (s1.bad_icrc - s0.bad_icrc)
        + (s1.wrong_source - s0.wrong_source);
    eprintln!("flood: {sent} sent, {dropped} dropped and counted: {s1:?}");
    assert!(dropped > 0, "{s1:?}");
    assert!(dropped <= sent);
    // Every datagram from the flooder was dropped before reaching a QP: what B's QP got
    // is exactly A's packets.
    assert!(s1.delivered - s0.delivered <= s1.received - s0.received - dropped);
    let grown = memory::rss_kib().saturating_sub(rss0);
    assert!(
        grown < 32 * 1024,
        "memory grew by {grown} KiB during the flood"
    );
    // The region the flood aimed at holds what A wrote, and nothing of the flood's.
    let now = image(&b.mr);
    assert_eq!(now[..4096], before_mem[..4096], "the flood placed data");
    assert_eq!(now[12288..], before_mem[12288..], "the flood placed data");
}

#[test]
fn an_rdmx_peer_on_the_roce_port_is_matched_by_its_port_too() {
    let _running = memory::alone();
    // Both sides on port 4791, as rdmx contexts bind by default. A process on A's
    // address but another port sends B a WRITE with a correct ICRC at B's expected PSN:
    // A is an rdmx peer (named by address and port), which sends from its socket's port
    // only, so the datagram is not A's. (Only a RoCE port named by its GID, such as rxe,
    // may send from any port of its address.)
    let a = side("127.1.0.21:4791");
    let b = side("127.1.0.22:4791");
    a.qp.connect(b.qp.endpoint(), &opts()).expect("connect A");
    b.qp.connect(a.qp.endpoint(), &opts()).expect("connect B");
    write_works(&a, &b, 7);
    let before_mem = image(&b.mr);
    let spoof = UdpSocket::bind("127.1.0.21:0").expect("bind");
    let me = spoof.local_addr().expect("addr");
    let s0 = stats(&b.ctx).expect("udp");
    let p = write_packet(b.qp.qp_num(), b.qp.attrs().rq_psn, &b);
    spoof.send_to(&sealed(me, b.addr, p), b.addr).expect("send");
    let s1 = received(&b, s0, 1);
    assert_eq!(s1.wrong_source - s0.wrong_source, 1, "{s1:?}");
    assert_eq!(s1.delivered, s0.delivered, "{s1:?}");
    assert_eq!(image(&b.mr), before_mem, "B's memory changed");
    write_works(&a, &b, 9);
}
