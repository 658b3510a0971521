//! The engine's UC and UD services driven by hand: packets are taken from one queue pair
//! and fed (or not) to the other, so losses are exact. Hostile datagrams (wrong Q_Key,
//! unknown QPN, truncated, random bytes, other services' packets, floods) are dropped and
//! counted, never delivered, and hold no memory.

mod sim;

use std::time::Instant;

use rdmx_core::rc::{DatagramInfo, QpConfig, RcQp};
use rdmx_core::{
    ud_steps, Access, AddressVector, ConnectParams, Mtu, QpLimits, QpType, RecvWr, RemoteAddr,
    SendFlags, SendOp, SendWr, Sge, SgeList, UdDest, WcOpcode, WcStatus, GRH_LEN,
};
use sim::{Mem, Rng, PD};

const QKEY: u32 = 0x0bad_cafe;
const A: u32 = 0x11;
const B: u32 = 0x22;

fn qp(qpn: u32, qp_type: QpType) -> RcQp<Mem> {
    qp_with_window(qpn, qp_type, 0)
}

/// A queue pair whose requester keeps at most `window` packets unacknowledged (0: no
/// limit), as the udp provider's do.
fn qp_with_window(qpn: u32, qp_type: QpType, window: u32) -> RcQp<Mem> {
    let mut cfg = QpConfig::new(qpn, PD);
    cfg.qp_type = qp_type;
    cfg.max_recv_wr = 64;
    cfg.max_send_wr = 64;
    cfg.send_window = window;
    RcQp::new(cfg, QpLimits::default())
}

fn ud(qpn: u32) -> RcQp<Mem> {
    let mut q = qp(qpn, QpType::Ud);
    for (attr, mask) in ud_steps(QKEY, 0) {
        q.modify(&attr, mask).unwrap();
    }
    q
}

fn uc_pair(mtu: Mtu) -> (RcQp<Mem>, RcQp<Mem>) {
    uc_pair_with_window(mtu, 0)
}

fn uc_pair_with_window(mtu: Mtu, window: u32) -> (RcQp<Mem>, RcQp<Mem>) {
    let mut a = qp_with_window(A, QpType::Uc, window);
    let mut b = qp_with_window(B, QpType::Uc, window);
    for (q, dest) in [(&mut a, B), (&mut b, A)] {
        let params = ConnectParams {
            access: Access::REMOTE_WRITE,
            mtu,
            dest_qpn: dest,
            rq_psn: 100,
            sq_psn: 100,
            max_rd_atomic: 1,
            max_dest_rd_atomic: 1,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
        };
        for (attr, mask) in params.steps_for(QpType::Uc) {
            q.modify(&attr, mask).unwrap();
        }
    }
    (a, b)
}

fn recv(q: &mut RcQp<Mem>, mem: &Mem, wr_id: u64, addr: u64, len: u32, lkey: u32) {
    let mut sges = SgeList::new();
    sges.push(Sge { addr, len, lkey });
    q.post_recv(mem, RecvWr { wr_id, sges }).unwrap();
}

fn send_wr(wr_id: u64, op: SendOp, addr: u64, len: u32, lkey: u32, ud: Option<UdDest>) -> SendWr {
    let mut sges = SgeList::new();
    sges.push(Sge { addr, len, lkey });
    SendWr {
        wr_id,
        op,
        sges,
        flags: SendFlags::SIGNALED,
        ud,
    }
}

/// Every packet `q` has to send.
fn packets(q: &mut RcQp<Mem>, mem: &Mem) -> Vec<Vec<u8>> {
    let now = Instant::now();
    std::iter::from_fn(|| q.poll_transmit(now, mem)).collect()
}

fn completions(q: &mut RcQp<Mem>) -> Vec<rdmx_core::Completion> {
    std::iter::from_fn(|| q.poll_completion().map(|(_, c, _)| c)).collect()
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

/// A good datagram from `A` to `B`, for the hostile tests to spoil.
fn good_datagram(mem: &Mem, len: usize) -> Vec<u8> {
    let mut a = ud(A);
    let src = mem.register(len, Access::LOCAL_WRITE);
    mem.put(src.addr, &pattern(9, len));
    let dest = UdDest {
        av: AddressVector::default(),
        remote_qpn: B,
        remote_qkey: QKEY,
    };
    a.post_send(
        mem,
        send_wr(1, SendOp::Send, src.addr, len as u32, src.lkey, Some(dest)),
        None,
    )
    .unwrap();
    let mut p = packets(&mut a, mem);
    assert_eq!(p.len(), 1);
    let c = completions(&mut a);
    assert_eq!(
        (c.len(), c[0].status),
        (1, WcStatus::Success),
        "a UD send completes when sent"
    );
    p.remove(0)
}

#[test]
fn ud_delivers_after_the_grh_area_with_the_source_qpn() {
    let mem = Mem::new(1);
    let mut b = ud(B);
    let dst = mem.register(GRH_LEN + 100, Access::LOCAL_WRITE);
    recv(&mut b, &mem, 7, dst.addr, (GRH_LEN + 100) as u32, dst.lkey);
    let info = DatagramInfo {
        sgid: [1; 16],
        dgid: [2; 16],
        roce_ipv4: false,
        roce_ipv6: false,
    };
    b.handle_datagram(&mem, None, &info, &good_datagram(&mem, 100));
    let c = completions(&mut b);
    assert_eq!(c.len(), 1);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].opcode),
        (7, WcStatus::Success, WcOpcode::Recv)
    );
    assert_eq!(
        (c[0].byte_len as usize, c[0].src_qp, c[0].grh),
        (GRH_LEN + 100, A, true)
    );
    assert_eq!(mem.get(dst.addr + GRH_LEN as u64, 100), pattern(9, 100));
    let grh = rdmx_wire::GrhRepr::parse(&mem.get(dst.addr, GRH_LEN)).unwrap();
    assert_eq!((grh.sgid, grh.dgid), ([1; 16], [2; 16]));
    assert_eq!(b.dropped(), 0);
}

#[test]
fn over_roce_ipv6_the_grh_area_holds_the_ipv6_header_as_rxe_writes_it() {
    let mem = Mem::new(4);
    let mut b = ud(B);
    let dst = mem.register(GRH_LEN + 100, Access::LOCAL_WRITE);
    recv(&mut b, &mem, 7, dst.addr, (GRH_LEN + 100) as u32, dst.lkey);
    let info = DatagramInfo {
        sgid: std::net::Ipv6Addr::LOCALHOST.octets(),
        dgid: std::net::Ipv6Addr::LOCALHOST.octets(),
        roce_ipv4: false,
        roce_ipv6: true,
    };
    let d = good_datagram(&mem, 100);
    b.handle_datagram(&mem, None, &info, &d);
    assert_eq!(completions(&mut b).len(), 1);
    let area = mem.get(dst.addr, GRH_LEN);
    let ip = rdmx_wire::GrhRepr::parse(&area).unwrap();
    assert_eq!(area[0] >> 4, 6, "IPv6");
    assert_eq!(ip.next_header, 17, "UDP");
    // The UDP header, the packet and its ICRC (taken off before the engine saw it).
    assert_eq!(usize::from(ip.payload_len), 8 + d.len() + 4);
    assert_eq!((ip.sgid, ip.dgid), (info.sgid, info.dgid));
}

#[test]
fn over_roce_ipv4_the_grh_area_holds_the_ipv4_header_as_rxe_writes_it() {
    let mem = Mem::new(3);
    let mut b = ud(B);
    let dst = mem.register(GRH_LEN + 100, Access::LOCAL_WRITE);
    recv(&mut b, &mem, 7, dst.addr, (GRH_LEN + 100) as u32, dst.lkey);
    let v4 = |a: [u8; 4]| std::net::Ipv4Addr::from(a).to_ipv6_mapped().octets();
    let info = DatagramInfo {
        sgid: v4([127, 0, 0, 1]),
        dgid: v4([127, 0, 0, 2]),
        roce_ipv4: true,
        roce_ipv6: false,
    };
    let d = good_datagram(&mem, 100);
    b.handle_datagram(&mem, None, &info, &d);
    assert_eq!(completions(&mut b).len(), 1);
    let area = mem.get(dst.addr, GRH_LEN);
    assert_eq!(&area[..20], &[0; 20], "20 reserved bytes");
    let ip = &area[20..];
    assert_eq!((ip[0], ip[9]), (0x45, 17), "IPv4, no options, UDP");
    // IP + UDP + the packet + its ICRC (taken off before the engine saw it).
    let total = u16::from_be_bytes([ip[2], ip[3]]) as usize;
    assert_eq!(total, 20 + 8 + d.len() + 4);
    assert_eq!(
        (&ip[12..16], &ip[16..20]),
        (&[127, 0, 0, 1][..], &[127, 0, 0, 2][..])
    );
    let sum: u32 = ip
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    assert_eq!(
        (sum & 0xffff) + (sum >> 16),
        0xffff,
        "a valid header checksum"
    );
}

#[test]
fn hostile_datagrams_are_dropped_and_counted() {
    let mem = Mem::new(2);
    let mut b = ud(B);
    let dst = mem.register(4 * (GRH_LEN + 64), Access::LOCAL_WRITE);
    for i in 0..4u64 {
        let at = dst.addr + i * (GRH_LEN + 64) as u64;
        recv(&mut b, &mem, i, at, (GRH_LEN + 64) as u32, dst.lkey);
    }
    let before = mem.get(dst.addr, 4 * (GRH_LEN + 64));
    let good = good_datagram(&mem, 64);
    let info = DatagramInfo::default();
    let mut fed = 0u64;
    let mut feed = |b: &mut RcQp<Mem>, bytes: &[u8]| {
        b.handle_datagram(&mem, None, &info, bytes);
        fed += 1;
    };
    // A wrong Q_Key.
    let mut wrong_qkey = good.clone();
    wrong_qkey[12..16].copy_from_slice(&(QKEY ^ 0x100).to_be_bytes());
    feed(&mut b, &wrong_qkey);
    // An unknown QP number.
    let mut other_qp = good.clone();
    other_qp[5..8].copy_from_slice(&[0, 0, 0x33]);
    feed(&mut b, &other_qp);
    // Every truncation but those that leave a shorter valid datagram (a cut on a 4-byte
    // boundary after the headers: without the ICRC of RoCE, nothing tells them apart).
    for cut in 0..good.len() {
        if cut >= 20 && (cut - 20) % 4 == 0 {
            continue;
        }
        feed(&mut b, &good[..cut]);
    }
    // Other services' opcodes with the same body.
    for op in [0x04u8, 0x24, 0x0a, 0x11, 0x66, 0xff] {
        let mut other = good.clone();
        other[0] = op;
        feed(&mut b, &other);
    }
    // Random bytes, and random bytes behind a valid UD opcode.
    let mut rng = Rng::new(3);
    for i in 0..20_000 {
        let len = (rng.next() % 128) as usize;
        let mut bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        if i % 2 == 0 && len > 0 {
            bytes[0] = 0x64;
        }
        // Keep Q_Key or QPN wrong so nothing random can be a good datagram.
        if bytes.len() >= 16 {
            bytes[12] = !(QKEY >> 24) as u8;
        }
        feed(&mut b, &bytes);
    }
    assert!(
        completions(&mut b).is_empty(),
        "nothing hostile was delivered"
    );
    assert_eq!(b.dropped(), fed, "every hostile datagram was counted");
    assert_eq!(
        mem.get(dst.addr, 4 * (GRH_LEN + 64)),
        before,
        "no receive buffer was touched"
    );
    assert_eq!(b.outstanding(), (0, 4), "every receive is still posted");
    // The good one still goes into the first receive.
    b.handle_datagram(&mem, None, &info, &good);
    let c = completions(&mut b);
    assert_eq!(
        (c.len(), c[0].wr_id, c[0].status),
        (1, 0, WcStatus::Success)
    );
}

#[test]
fn a_datagram_flood_holds_no_memory() {
    let mem = Mem::new(4);
    let mut b = ud(B);
    let good = good_datagram(&mem, 256);
    let dst = mem.register(8 * (GRH_LEN + 256), Access::LOCAL_WRITE);
    for i in 0..8u64 {
        let at = dst.addr + i * (GRH_LEN + 256) as u64;
        recv(&mut b, &mem, i, at, (GRH_LEN + 256) as u32, dst.lkey);
    }
    let info = DatagramInfo::default();
    let n = 200_000u64;
    for _ in 0..n {
        b.handle_datagram(&mem, None, &info, &good);
    }
    // Eight receives took eight datagrams; the rest found none and were dropped, with
    // nothing queued for them: the engine's queues are bounded by what was posted.
    let c = completions(&mut b);
    assert_eq!(c.len(), 8);
    assert!(c.iter().all(|c| c.status == WcStatus::Success));
    assert_eq!(b.dropped(), n - 8);
    assert_eq!(b.outstanding(), (0, 0));
    assert!(
        b.poll_transmit(Instant::now(), &mem).is_none(),
        "UD answers nothing"
    );
}

#[test]
fn uc_drops_a_message_that_lost_a_packet_and_delivers_the_next() {
    let mem = Mem::new(5);
    let (mut a, mut b) = uc_pair(Mtu::Mtu256);
    let len = 3 * 256 + 10;
    let src = mem.register(2 * len, Access::LOCAL_WRITE);
    mem.put(src.addr, &pattern(1, len));
    mem.put(src.addr + len as u64, &pattern(2, len));
    let dst = mem.register(len, Access::LOCAL_WRITE);
    recv(&mut b, &mem, 40, dst.addr, len as u32, dst.lkey);
    for (i, off) in [(1u64, 0u64), (2, len as u64)] {
        a.post_send(
            &mem,
            send_wr(i, SendOp::Send, src.addr + off, len as u32, src.lkey, None),
            None,
        )
        .unwrap();
    }
    let p = packets(&mut a, &mem);
    assert_eq!(p.len(), 8, "two four-packet messages");
    assert!(
        p.iter().all(|p| p[0] & 0xe0 == 0x20),
        "UC opcodes on the wire"
    );
    // Both sends complete at once: UC waits for nothing.
    let sc = completions(&mut a);
    assert_eq!(sc.iter().map(|c| c.wr_id).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(a.poll_timeout(), None, "no retransmission timer");
    let now = Instant::now();
    for (i, pk) in p.iter().enumerate() {
        if i == 2 {
            continue; // the first message loses its third packet
        }
        b.handle_packet(now, &mem, pk);
    }
    let c = completions(&mut b);
    assert_eq!(c.len(), 1, "one message delivered");
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].byte_len as usize),
        (40, WcStatus::Success, len)
    );
    assert_eq!(
        mem.get(dst.addr, len),
        pattern(2, len),
        "the second message, whole"
    );
    assert_eq!(b.dropped(), 1);
    assert!(
        b.poll_transmit(now, &mem).is_none(),
        "UC never acknowledges"
    );
}

#[test]
fn uc_write_with_a_lost_packet_completes_no_receive() {
    let mem = Mem::new(6);
    let (mut a, mut b) = uc_pair(Mtu::Mtu256);
    let len = 2 * 256 + 4;
    let src = mem.register(len, Access::LOCAL_WRITE);
    mem.put(src.addr, &pattern(3, len));
    let target = mem.register(len, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let rbuf = mem.register(8, Access::LOCAL_WRITE);
    recv(&mut b, &mem, 1, rbuf.addr, 8, rbuf.lkey);
    let remote = RemoteAddr {
        addr: target.addr,
        rkey: target.rkey,
    };
    a.post_send(
        &mem,
        send_wr(
            1,
            SendOp::WriteWithImm(remote, 5),
            src.addr,
            len as u32,
            src.lkey,
            None,
        ),
        None,
    )
    .unwrap();
    a.post_send(
        &mem,
        send_wr(
            2,
            SendOp::WriteWithImm(remote, 6),
            src.addr,
            len as u32,
            src.lkey,
            None,
        ),
        None,
    )
    .unwrap();
    let p = packets(&mut a, &mem);
    assert_eq!(p.len(), 6);
    let now = Instant::now();
    // The first WRITE loses its middle packet; the second arrives whole.
    for (i, pk) in p.iter().enumerate() {
        if i != 1 {
            b.handle_packet(now, &mem, pk);
        }
    }
    let c = completions(&mut b);
    assert_eq!(c.len(), 1, "only the whole WRITE consumed the receive");
    assert_eq!(
        (c[0].imm_data, c[0].opcode),
        (Some(6), WcOpcode::RecvRdmaWithImm)
    );
    assert_eq!(mem.get(target.addr, len), pattern(3, len));
    // READ and atomics are refused at post.
    let r = send_wr(3, SendOp::Read(remote), src.addr, 8, src.lkey, None);
    assert!(a.post_send(&mem, r, None).is_err());
    let f = send_wr(
        4,
        SendOp::FetchAdd { remote, add: 1 },
        src.addr,
        8,
        src.lkey,
        None,
    );
    assert!(a.post_send(&mem, f, None).is_err());
}

/// A send window (the udp provider's) holds RC packets until acknowledgements come; UC
/// gets none, so its packets go regardless: a UC WRITE of 40 packets through a window of
/// 8 leaves whole, asks for no acknowledgement, completes and lands.
#[test]
fn uc_sends_past_a_send_window_with_no_acknowledgement() {
    let mem = Mem::new(3);
    let (mut a, mut b) = uc_pair_with_window(Mtu::Mtu256, 8);
    let len = 40 * 256;
    let src = mem.register(len, Access::LOCAL_WRITE);
    mem.put(src.addr, &pattern(5, len));
    let dst = mem.register(len, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let at = RemoteAddr {
        addr: dst.addr,
        rkey: dst.rkey,
    };
    a.post_send(
        &mem,
        send_wr(1, SendOp::Write(at), src.addr, len as u32, src.lkey, None),
        None,
    )
    .unwrap();
    let sent = packets(&mut a, &mem);
    assert_eq!(sent.len(), 40, "the window held UC packets back");
    // BTH byte 8, bit 7: AckReq.
    assert!(
        sent.iter().all(|p| p[8] & 0x80 == 0),
        "a UC packet asked for an acknowledgement"
    );
    let c = completions(&mut a);
    assert_eq!((c.len(), c[0].status), (1, WcStatus::Success));
    let now = Instant::now();
    for p in &sent {
        b.handle_packet(now, &mem, p);
    }
    assert_eq!(mem.get(dst.addr, len), pattern(5, len));
}

#[test]
fn uc_drops_packets_whose_length_does_not_fit_the_path_mtu() {
    // A sender at a path MTU of 512, a receiver at 256: every packet of the sender's
    // two-packet message and its 300-byte ONLY packet is longer than the receiver's MTU
    // allows, so both messages are dropped (counted) and nothing is placed; a message the
    // receiver's MTU allows still arrives whole, into the same receive.
    let mem = Mem::new(6);
    let (mut a, _) = uc_pair(Mtu::Mtu512);
    let (_, mut b) = uc_pair(Mtu::Mtu256);
    let src = mem.register(1024, Access::LOCAL_WRITE);
    mem.put(src.addr, &pattern(3, 1024));
    let dst = mem.register(1024, Access::LOCAL_WRITE);
    recv(&mut b, &mem, 50, dst.addr, 1024, dst.lkey);
    for (i, len) in [(1u64, 700u32), (2, 300), (3, 200)] {
        a.post_send(
            &mem,
            send_wr(i, SendOp::Send, src.addr, len, src.lkey, None),
            None,
        )
        .unwrap();
    }
    let p = packets(&mut a, &mem);
    assert_eq!(p.len(), 4, "FIRST and LAST, then two ONLY packets");
    let now = Instant::now();
    for pk in &p {
        b.handle_packet(now, &mem, pk);
    }
    let c = completions(&mut b);
    assert_eq!(c.len(), 1, "the last message only");
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].byte_len),
        (50, WcStatus::Success, 200)
    );
    assert_eq!(mem.get(dst.addr, 200), pattern(3, 200));
    assert!(mem.get(dst.addr + 200, 824).iter().all(|&x| x == 0));
    // The FIRST packet (the LAST then goes with its message) and the long ONLY.
    assert_eq!(b.dropped(), 2);

    // Mid-message: a LAST packet with no payload drops its message, counted once.
    let (mut a, mut b) = uc_pair(Mtu::Mtu256);
    recv(&mut b, &mem, 51, dst.addr, 1024, dst.lkey);
    a.post_send(
        &mem,
        send_wr(4, SendOp::Send, src.addr, 300, src.lkey, None),
        None,
    )
    .unwrap();
    let mut p = packets(&mut a, &mem);
    assert_eq!(p.len(), 2, "FIRST and LAST");
    p[1].truncate(12); // the BTH alone
    for pk in &p {
        b.handle_packet(now, &mem, pk);
    }
    assert!(completions(&mut b).is_empty());
    assert_eq!(b.dropped(), 1);
}
