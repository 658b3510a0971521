//! Every operation once per size, over a lossless link, data checked byte for byte.

use super::util::*;
use crate::wr::{SendOp, WcOpcode, WcStatus};
use rdmx_wire as wire;

/// 0, 1, MTU-1, MTU, MTU+1, 10×MTU+3.
fn sizes(p: &Pair) -> [u32; 6] {
    let mtu = p.cfg.mtu.bytes();
    [0, 1, mtu - 1, mtu, mtu + 1, 10 * mtu + 3]
}

/// SGE counts to try on each side.
const SGE_COUNTS: [usize; 2] = [1, 3];

#[test]
fn send_recv_every_size_and_sge_layout() {
    for (n, &len) in sizes(&Pair::new()).iter().enumerate() {
        for &ns in &SGE_COUNTS {
            for &nr in &SGE_COUNTS {
                let mut p = Pair::new();
                let data = pattern(len as u64 * 31 + ns as u64, len as usize);
                let src = p.a.mem.register(u64::from(len) + 64, ALL);
                p.a.mem.fill(src.addr + 7, &data);
                // The receive is 5 bytes larger than the message; the slack stays zero.
                let dst = p.b.mem.register(u64::from(len) + 64, ALL);
                p.b.recv(900 + n as u64, split_sges(&dst, 3, len + 5, nr))
                    .unwrap();
                p.a.post(wr(
                    n as u64,
                    SendOp::SendWithImm(0xabcd_0000 + len),
                    split_sges(&src, 7, len, ns),
                ))
                .unwrap();
                p.drive();

                let ctx = format!("len {len}, {ns} send SGEs, {nr} recv SGEs");
                assert_eq!(p.a.sends(), vec![(n as u64, WcStatus::Success)], "{ctx}");
                assert_eq!(p.a.send_cq[0].c.opcode, WcOpcode::Send, "{ctx}");
                assert_eq!(
                    p.b.recvs(),
                    vec![(900 + n as u64, WcStatus::Success)],
                    "{ctx}"
                );
                let r = p.b.recv_cq[0].c;
                assert_eq!(r.opcode, WcOpcode::Recv, "{ctx}");
                assert_eq!(r.byte_len, len, "{ctx}");
                assert_eq!(r.imm_data, Some(0xabcd_0000 + len), "{ctx}");
                assert_eq!(r.qp_num, QPN_B, "{ctx}");
                assert_eq!(p.b.mem.bytes(dst.addr + 3, len as usize), data, "{ctx}");
                assert_eq!(p.b.mem.bytes(dst.addr, 3), vec![0; 3], "{ctx}");
                assert_eq!(
                    p.b.mem.bytes(dst.addr + 3 + u64::from(len), 5),
                    vec![0; 5],
                    "{ctx}"
                );
                // Packets: ceil(len / MTU), at least one.
                let mtu = p.cfg.mtu.bytes();
                assert_eq!(
                    p.ab.sent().filter(|x| x.is_send()).count() as u32,
                    len.div_ceil(mtu).max(1),
                    "{ctx}"
                );
                assert!(p.ab.sent().all(|x| x.len <= mtu as usize), "{ctx}");
                assert_eq!(p.a.qp.outstanding(), (0, 0), "{ctx}");
                assert_eq!(p.b.qp.outstanding(), (0, 0), "{ctx}");
            }
        }
    }
}

#[test]
fn write_every_size_and_sge_layout() {
    for (n, &len) in sizes(&Pair::new()).iter().enumerate() {
        for &ns in &SGE_COUNTS {
            let mut p = Pair::new();
            let data = pattern(len as u64 * 7 + ns as u64, len as usize);
            let src = p.a.mem.register(u64::from(len) + 64, ALL);
            p.a.mem.fill(src.addr + 1, &data);
            let dst = p.b.mem.register(u64::from(len) + 64, ALL);
            p.a.post(wr(
                n as u64,
                SendOp::Write(dst.remote(5)),
                split_sges(&src, 1, len, ns),
            ))
            .unwrap();
            p.drive();

            let ctx = format!("len {len}, {ns} SGEs");
            assert_eq!(p.a.sends(), vec![(n as u64, WcStatus::Success)], "{ctx}");
            assert_eq!(p.a.send_cq[0].c.opcode, WcOpcode::RdmaWrite, "{ctx}");
            assert!(p.b.recv_cq.is_empty(), "{ctx}");
            assert_eq!(p.b.mem.bytes(dst.addr + 5, len as usize), data, "{ctx}");
            assert_eq!(p.b.mem.bytes(dst.addr, 5), vec![0; 5], "{ctx}");
            assert_eq!(
                p.b.mem.bytes(dst.addr + 5 + u64::from(len), 8),
                vec![0; 8],
                "{ctx}"
            );
        }
    }
}

#[test]
fn write_with_imm_every_size_consumes_one_receive() {
    for (n, &len) in sizes(&Pair::new()).iter().enumerate() {
        let mut p = Pair::new();
        let data = pattern(len as u64 + 99, len as usize);
        let src = p.a.mem.register(u64::from(len) + 64, ALL);
        p.a.mem.fill(src.addr, &data);
        let dst = p.b.mem.register(u64::from(len) + 64, ALL);
        let unused = p.b.mem.register(64, ALL);
        p.b.recv(70, vec![unused.sge(0, 64)]).unwrap();
        p.b.recv(71, vec![unused.sge(0, 64)]).unwrap();
        p.a.post(wr(
            n as u64,
            SendOp::WriteWithImm(dst.remote(0), 0x1234_5678),
            split_sges(&src, 0, len, 2),
        ))
        .unwrap();
        p.drive();

        let ctx = format!("len {len}");
        assert_eq!(p.a.sends(), vec![(n as u64, WcStatus::Success)], "{ctx}");
        assert_eq!(p.b.recvs(), vec![(70, WcStatus::Success)], "{ctx}");
        let r = p.b.recv_cq[0].c;
        assert_eq!(r.opcode, WcOpcode::RecvRdmaWithImm, "{ctx}");
        assert_eq!(r.imm_data, Some(0x1234_5678), "{ctx}");
        // verbs reports the length of the whole WRITE, however many packets it took.
        assert_eq!(r.byte_len, len, "{ctx}");
        assert_eq!(p.b.mem.bytes(dst.addr, len as usize), data, "{ctx}");
        // The receive's buffer is not touched by a WRITE with immediate.
        assert_eq!(p.b.mem.bytes(unused.addr, 64), vec![0; 64], "{ctx}");
        assert_eq!(p.b.qp.outstanding().1, 1, "{ctx}");
    }
}

#[test]
fn read_every_size_and_sge_layout() {
    for (n, &len) in sizes(&Pair::new()).iter().enumerate() {
        for &ns in &SGE_COUNTS {
            let mut p = Pair::new();
            let data = pattern(len as u64 * 13 + ns as u64, len as usize);
            let remote = p.b.mem.register(u64::from(len) + 64, ALL);
            p.b.mem.fill(remote.addr + 9, &data);
            let local = p.a.mem.register(u64::from(len) + 64, ALL);
            p.a.post(wr(
                n as u64,
                SendOp::Read(remote.remote(9)),
                split_sges(&local, 2, len, ns),
            ))
            .unwrap();
            p.drive();

            let ctx = format!("len {len}, {ns} SGEs");
            assert_eq!(p.a.sends(), vec![(n as u64, WcStatus::Success)], "{ctx}");
            let c = p.a.send_cq[0].c;
            assert_eq!(c.opcode, WcOpcode::RdmaRead, "{ctx}");
            assert_eq!(c.byte_len, len, "{ctx}");
            assert_eq!(p.a.mem.bytes(local.addr + 2, len as usize), data, "{ctx}");
            assert_eq!(p.a.mem.bytes(local.addr, 2), vec![0; 2], "{ctx}");
            assert_eq!(
                p.a.mem.bytes(local.addr + 2 + u64::from(len), 8),
                vec![0; 8],
                "{ctx}"
            );
            let mtu = p.cfg.mtu.bytes();
            assert_eq!(
                p.ba.sent().filter(|x| x.is_read_response()).count() as u32,
                len.div_ceil(mtu).max(1),
                "{ctx}"
            );
        }
    }
}

#[test]
fn compare_swap_and_fetch_add() {
    let mut p = Pair::new();
    let target = p.b.mem.register(64, ALL);
    p.b.mem.set_u64(target.addr + 8, 5);
    let local = p.a.mem.register(64, ALL);
    // FAA +10 (old 5), CAS 15→99 (succeeds, old 15), CAS 15→7 (fails, old 99), FAA with
    // the old value split over two SGEs.
    p.a.post(wr(
        1,
        SendOp::FetchAdd {
            remote: target.remote(8),
            add: 10,
        },
        vec![local.sge(0, 8)],
    ))
    .unwrap();
    p.a.post(wr(
        2,
        SendOp::CompareSwap {
            remote: target.remote(8),
            compare: 15,
            swap: 99,
        },
        vec![local.sge(8, 8)],
    ))
    .unwrap();
    p.a.post(wr(
        3,
        SendOp::CompareSwap {
            remote: target.remote(8),
            compare: 15,
            swap: 7,
        },
        vec![local.sge(16, 8)],
    ))
    .unwrap();
    p.a.post(wr(
        4,
        SendOp::FetchAdd {
            remote: target.remote(8),
            add: u64::MAX,
        },
        vec![local.sge(24, 3), local.sge(27, 5)],
    ))
    .unwrap();
    p.drive();

    assert_eq!(
        p.a.sends(),
        vec![
            (1, WcStatus::Success),
            (2, WcStatus::Success),
            (3, WcStatus::Success),
            (4, WcStatus::Success)
        ]
    );
    let ops: Vec<WcOpcode> = p.a.send_cq.iter().map(|w| w.c.opcode).collect();
    assert_eq!(
        ops,
        [
            WcOpcode::FetchAdd,
            WcOpcode::CompSwap,
            WcOpcode::CompSwap,
            WcOpcode::FetchAdd
        ]
    );
    assert_eq!(p.a.mem.u64_at(local.addr), 5);
    assert_eq!(p.a.mem.u64_at(local.addr + 8), 15);
    assert_eq!(p.a.mem.u64_at(local.addr + 16), 99);
    assert_eq!(p.a.mem.u64_at(local.addr + 24), 99);
    assert_eq!(p.b.mem.u64_at(target.addr + 8), 98);
    assert_eq!(p.b.mem.u64_at(target.addr), 0);
    assert_eq!(p.b.mem.atomics.get(), 4);
}

#[test]
fn inline_send_and_write() {
    let mut p = Pair::new();
    let dst = p.b.mem.register(1024, ALL);
    p.b.recv(5, vec![dst.sge(0, 512)]).unwrap();
    let data = pattern(1, 200);
    p.a.post_inline(
        wr_flags(1, SendOp::Send, vec![], crate::wr::SendFlags::INLINE),
        data.clone(),
    )
    .unwrap();
    p.a.post_inline(
        wr_flags(
            2,
            SendOp::Write(dst.remote(600)),
            vec![],
            crate::wr::SendFlags::INLINE,
        ),
        data.clone(),
    )
    .unwrap();
    p.drive();
    assert_eq!(
        p.a.sends(),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    assert_eq!(p.b.recv_cq[0].c.byte_len, 200);
    assert_eq!(p.b.mem.bytes(dst.addr, 200), data);
    assert_eq!(p.b.mem.bytes(dst.addr + 600, 200), data);
}

#[test]
fn psn_wraps_around_2_pow_24() {
    let mut p = Pair::with(PairConfig {
        sq_psn_a: 0xff_fffa,
        sq_psn_b: 0xff_fffe,
        ..PairConfig::default()
    });
    let len = 10 * 256 + 3;
    let data = pattern(2, len);
    let a_mem = p.a.mem.register(4 * len as u64, ALL);
    let b_mem = p.b.mem.register(4 * len as u64, ALL);
    p.a.mem.fill(a_mem.addr, &data);
    p.b.mem.fill(b_mem.addr + len as u64, &data);
    p.b.recv(1, vec![b_mem.sge(2 * len as u64, len as u32)])
        .unwrap();
    p.a.post(wr(
        1,
        SendOp::Write(b_mem.remote(0)),
        vec![a_mem.sge(0, len as u32)],
    ))
    .unwrap();
    p.a.post(wr(
        2,
        SendOp::Read(b_mem.remote(len as u64)),
        vec![a_mem.sge(len as u64, len as u32)],
    ))
    .unwrap();
    p.a.post(wr(3, SendOp::Send, vec![a_mem.sge(0, len as u32)]))
        .unwrap();
    // And B reads back from A across its own wrap.
    p.b.post(wr(
        9,
        SendOp::Read(a_mem.remote(0)),
        vec![b_mem.sge(3 * len as u64, len as u32)],
    ))
    .unwrap();
    p.drive();
    assert_eq!(
        p.a.sends(),
        vec![
            (1, WcStatus::Success),
            (2, WcStatus::Success),
            (3, WcStatus::Success)
        ]
    );
    assert_eq!(p.b.sends(), vec![(9, WcStatus::Success)]);
    assert_eq!(p.b.mem.bytes(b_mem.addr, len), data);
    assert_eq!(p.a.mem.bytes(a_mem.addr + len as u64, len), data);
    assert_eq!(p.b.mem.bytes(b_mem.addr + 2 * len as u64, len), data);
    assert_eq!(p.b.mem.bytes(b_mem.addr + 3 * len as u64, len), data);
    // The PSNs really wrapped.
    assert!(p.ab.sent().any(|x| x.psn == 0xff_ffff));
    assert!(p.ab.sent().any(|x| x.psn == 0));
}

#[test]
fn both_directions_at_once() {
    let mut p = Pair::new();
    let len = 3 * 256 + 17;
    let a_buf = p.a.mem.register(2 * len as u64, ALL);
    let b_buf = p.b.mem.register(2 * len as u64, ALL);
    let da = pattern(10, len);
    let db = pattern(11, len);
    p.a.mem.fill(a_buf.addr, &da);
    p.b.mem.fill(b_buf.addr, &db);
    p.a.recv(1, vec![a_buf.sge(len as u64, len as u32)])
        .unwrap();
    p.b.recv(2, vec![b_buf.sge(len as u64, len as u32)])
        .unwrap();
    p.a.post(wr(10, SendOp::Send, vec![a_buf.sge(0, len as u32)]))
        .unwrap();
    p.b.post(wr(20, SendOp::Send, vec![b_buf.sge(0, len as u32)]))
        .unwrap();
    p.drive();
    assert_eq!(p.a.sends(), vec![(10, WcStatus::Success)]);
    assert_eq!(p.b.sends(), vec![(20, WcStatus::Success)]);
    assert_eq!(p.a.mem.bytes(a_buf.addr + len as u64, len), db);
    assert_eq!(p.b.mem.bytes(b_buf.addr + len as u64, len), da);
}

/// `poll_ack` gives the packet `poll_transmit` would: the same bytes, the same state
/// after; and nothing while answers are queued (here a READ's response, with the ACK
/// queued ahead of it) or when the next packet is a request.
#[test]
fn poll_ack_gives_what_poll_transmit_would() {
    // Two identical pairs run the same script: B's first answer is taken with
    // `poll_ack` in one and `poll_transmit` in the other.
    let script = |p: &mut Pair| {
        let src = p.a.mem.register(64, ALL);
        let dst = p.b.mem.register(64, ALL);
        for i in 0..3 {
            p.b.recv(i, vec![dst.sge(0, 64)]).unwrap();
        }
        p.a.post(wr(1, SendOp::Send, vec![src.sge(0, 8)])).unwrap();
        deliver_a_to_b(p);
    };
    let (mut x, mut y) = (Pair::new(), Pair::new());
    script(&mut x);
    script(&mut y);
    let now = y.now;
    let by_ack = x.b.qp.poll_ack().expect("an ACK is due").to_vec();
    let by_transmit = y.b.qp.poll_transmit(now, &y.b.mem).expect("an ACK is due");
    assert_eq!(by_ack, by_transmit);
    let ack = wire::RcRepr::parse_bytes(&by_ack).expect("a well-formed ACK");
    assert_eq!(ack.bth.opcode, wire::Opcode::Acknowledge);
    assert_eq!(ack.aeth.map(|a| a.msn), Some(1));
    // Nothing more, either way.
    assert_eq!(x.b.qp.poll_ack(), None);
    assert!(x.b.qp.poll_transmit(now, &x.b.mem).is_none());
    assert!(y.b.qp.poll_transmit(now, &y.b.mem).is_none());

    // A READ's response queued: not a plain ACK, so `poll_ack` leaves it (and the ACK
    // coalesced behind it) to `poll_transmit`, in order.
    let mut p = Pair::new();
    let src = p.a.mem.register(64, ALL);
    let dst = p.b.mem.register(64, ALL);
    p.b.recv(0, vec![dst.sge(0, 64)]).unwrap();
    p.a.post(wr(1, SendOp::Send, vec![src.sge(0, 8)])).unwrap();
    p.a.post(wr(2, SendOp::Read(dst.remote(0)), vec![src.sge(8, 8)]))
        .unwrap();
    deliver_a_to_b(&mut p);
    let now = p.now;
    let mut ops = Vec::new();
    loop {
        assert_eq!(p.b.qp.poll_ack(), None, "answers are queued");
        let Some(pkt) = p.b.qp.poll_transmit(now, &p.b.mem) else {
            break;
        };
        ops.push(
            wire::RcRepr::parse_bytes(&pkt)
                .expect("well formed")
                .bth
                .opcode,
        );
    }
    // The SEND's ACK was queued ahead of the READ's response, to keep their order.
    assert_eq!(
        ops,
        [
            wire::Opcode::Acknowledge,
            wire::Opcode::RdmaReadResponseOnly
        ]
    );
    // A requester's packet is never a plain ACK.
    p.a.post(wr(3, SendOp::Send, vec![src.sge(0, 8)])).unwrap();
    assert_eq!(p.a.qp.poll_ack(), None);
}

/// Sends what A has and hands it to B, the clock moved on to its arrival; B sends
/// nothing.
fn deliver_a_to_b(p: &mut Pair) {
    let now = p.now;
    p.a.transmit(now, &mut p.ab);
    while let Some(t) = p.ab.next_arrival() {
        p.now = p.now.max(t);
        let now = p.now;
        while let Some(pkt) = p.ab.pop_due(now) {
            deliver(&mut p.b.qp, now, &p.b.mem, &pkt);
        }
    }
}

#[test]
fn packets_of_is_div_ceil_at_every_mtu() {
    for shift in 8..=20 {
        let mtu = 1u64 << shift;
        for len in [
            0,
            1,
            mtu - 1,
            mtu,
            mtu + 1,
            7 * mtu,
            7 * mtu + 3,
            u64::from(u32::MAX),
        ] {
            assert_eq!(
                crate::rc::packets_of(len, mtu),
                len.div_ceil(mtu),
                "{len} at {mtu}"
            );
        }
    }
}
