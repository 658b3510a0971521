//! Retransmission: single scripted drops at every position, and late and duplicated
//! packets.

use std::time::Duration;

use rdmx_wire::{psn_add, Opcode};

use super::util::*;
use crate::qp::QpState;
use crate::wr::{SendOp, WcStatus};

const LONG: u32 = 10 * 256 + 3; // 11 packets at MTU 256

#[derive(Clone, Copy, Debug)]
enum Pos {
    First,
    Middle,
    Last,
}

impl Pos {
    const ALL: [Pos; 3] = [Pos::First, Pos::Middle, Pos::Last];
    fn index(self) -> u32 {
        match self {
            Pos::First => 0,
            Pos::Middle => 5,
            Pos::Last => 10,
        }
    }
}

#[test]
fn send_with_one_packet_dropped_completes_once() {
    for pos in Pos::ALL {
        let mut p = Pair::new();
        let data = pattern(3, LONG as usize);
        let src = p.a.mem.register(u64::from(LONG), ALL);
        p.a.mem.fill(src.addr, &data);
        let dst = p.b.mem.register(2 * u64::from(LONG), ALL);
        p.b.recv(1, split_sges(&dst, 0, LONG, 3)).unwrap();
        p.b.recv(2, vec![dst.sge(u64::from(LONG), LONG)]).unwrap();
        let target = a_psn(&p, pos.index());
        p.ab.drop_matching(1, move |x| x.psn == target && x.is_send());
        p.a.post(wr(1, SendOp::Send, split_sges(&src, 0, LONG, 2)))
            .unwrap();
        p.drive();

        let ctx = format!("{pos:?}");
        assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)], "{ctx}");
        assert_eq!(p.b.recvs(), vec![(1, WcStatus::Success)], "{ctx}");
        assert_eq!(p.b.recv_cq[0].c.byte_len, LONG, "{ctx}");
        assert_eq!(p.b.mem.bytes(dst.addr, LONG as usize), data, "{ctx}");
        assert_eq!(p.b.qp.outstanding().1, 1, "{ctx}: one receive consumed");
        assert!(
            p.ab.sent().filter(|x| x.psn == target).count() >= 2,
            "{ctx}: the dropped packet was sent again"
        );
        match pos {
            // A later packet reveals the gap: a sequence NAK, no timeout.
            Pos::First | Pos::Middle => {
                assert_eq!(p.ba.sent().filter(|x| x.is_seq_nak()).count(), 1, "{ctx}");
                assert_eq!(p.timeouts.0, 0, "{ctx}: recovered without the timer");
            }
            // Nothing follows the last packet: only the timer finds it.
            Pos::Last => assert!(p.timeouts.0 >= 1, "{ctx}"),
        }
        assert_eq!(p.a.qp.state(), QpState::Rts);
        assert_eq!(p.b.qp.state(), QpState::Rts);
    }
}

#[test]
fn write_with_one_packet_dropped_completes_once() {
    for pos in Pos::ALL {
        let mut p = Pair::new();
        let data = pattern(4, LONG as usize);
        let src = p.a.mem.register(u64::from(LONG), ALL);
        p.a.mem.fill(src.addr, &data);
        let dst = p.b.mem.register(u64::from(LONG) + 16, ALL);
        let target = a_psn(&p, pos.index());
        p.ab.drop_matching(1, move |x| x.psn == target);
        p.a.post(wr(
            1,
            SendOp::Write(dst.remote(8)),
            split_sges(&src, 0, LONG, 3),
        ))
        .unwrap();
        p.drive();

        let ctx = format!("{pos:?}");
        assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)], "{ctx}");
        assert_eq!(p.b.mem.bytes(dst.addr + 8, LONG as usize), data, "{ctx}");
        assert_eq!(p.b.mem.bytes(dst.addr, 8), vec![0; 8], "{ctx}");
        assert_eq!(
            p.b.mem.bytes(dst.addr + 8 + u64::from(LONG), 8),
            vec![0; 8],
            "{ctx}"
        );
        assert!(p.ab.sent().filter(|x| x.psn == target).count() >= 2);
    }
}

#[test]
fn read_with_request_or_one_response_dropped_completes_once() {
    // None: the request is dropped; Some(pos): that response packet is.
    for which in [None, Some(Pos::First), Some(Pos::Middle), Some(Pos::Last)] {
        let mut p = Pair::new();
        let data = pattern(5, LONG as usize);
        let src = p.b.mem.register(u64::from(LONG), ALL);
        p.b.mem.fill(src.addr, &data);
        let dst = p.a.mem.register(u64::from(LONG), ALL);
        let first = a_psn(&p, 0);
        match which {
            None => p.ab.drop_matching(1, |x| x.is_read_request()),
            Some(pos) => {
                let psn = psn_add(first, pos.index());
                p.ba.drop_matching(1, move |x| x.is_read_response() && x.psn == psn);
            }
        }
        p.a.post(wr(
            1,
            SendOp::Read(src.remote(0)),
            split_sges(&dst, 0, LONG, 3),
        ))
        .unwrap();
        p.drive();

        let ctx = format!("{which:?}");
        assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)], "{ctx}");
        assert_eq!(p.a.send_cq[0].c.byte_len, LONG, "{ctx}");
        assert_eq!(p.a.mem.bytes(dst.addr, LONG as usize), data, "{ctx}");
        assert_eq!(
            p.ab.sent().filter(|x| x.is_read_request()).count(),
            2,
            "{ctx}: the READ was requested again once"
        );
        assert!(p.timeouts.0 >= 1, "{ctx}");
        assert_eq!(p.a.qp.state(), QpState::Rts);
    }
}

/// A READ whose responses stop part-way (one lost) asks again for the rest only: the
/// second request starts at the lost response's PSN, its RETH the address and length
/// moved on by the responses already placed, and the responder answers from there. A
/// requester that asked for the whole READ again would need every response of one
/// attempt to arrive, which a READ larger than a lossy path carries whole never does.
#[test]
fn a_read_asked_again_asks_for_the_rest_only() {
    let mut p = Pair::new();
    let data = pattern(9, LONG as usize);
    let src = p.b.mem.register(u64::from(LONG), ALL);
    p.b.mem.fill(src.addr, &data);
    let dst = p.a.mem.register(u64::from(LONG), ALL);
    let first = a_psn(&p, 0);
    let lost = psn_add(first, Pos::Middle.index());
    p.ba.drop_matching(1, move |x| x.is_read_response() && x.psn == lost);
    p.a.post(wr(1, SendOp::Read(src.remote(0)), vec![dst.sge(0, LONG)]))
        .unwrap();
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)]);
    assert_eq!(p.a.mem.bytes(dst.addr, LONG as usize), data);
    let asked: Vec<_> =
        p.ab.sent()
            .filter(|x| x.is_read_request())
            .map(|x| (x.psn, x.reth.map(|r| (r.va, r.dma_len))))
            .collect();
    let skip = Pos::Middle.index() * 256;
    assert_eq!(
        asked,
        vec![
            (first, Some((src.addr, LONG))),
            (lost, Some((src.addr + u64::from(skip), LONG - skip))),
        ]
    );
    // After the first answer's responses (the lost one among them), the second answer
    // starts at the lost one.
    let again: Vec<_> =
        p.ba.sent()
            .filter(|x| x.is_read_response())
            .skip(LONG.div_ceil(256) as usize)
            .map(|x| x.psn)
            .collect();
    assert_eq!(again.first(), Some(&lost), "{again:?}");
    assert_eq!(p.a.qp.state(), QpState::Rts);
    assert_eq!(p.b.qp.state(), QpState::Rts);
}

/// A transport that stops right after a READ's last response (a paced one, a full
/// socket) does not leave that answer counting against the responder resources: the
/// requester, whose READ is complete, sends the next, and the responder takes it.
#[test]
fn a_read_answered_in_full_frees_its_resource_before_the_next_poll() {
    let mut p = Pair::with(PairConfig {
        max_rd_atomic: 1,
        max_dest_rd_atomic: 1,
        ..PairConfig::default()
    });
    // Four packets at MTU 256; B's transport takes four at a time, then nothing for
    // longer than a round trip.
    let len = 4 * 256;
    p.b.burst = Some(4);
    p.b.pace = Duration::from_millis(5);
    let data = pattern(12, len as usize);
    let src = p.b.mem.register(u64::from(len), ALL);
    p.b.mem.fill(src.addr, &data);
    let dst = p.a.mem.register(2 * u64::from(len), ALL);
    for (id, off) in [(1, 0), (2, u64::from(len))] {
        p.a.post(wr(id, SendOp::Read(src.remote(0)), vec![dst.sge(off, len)]))
            .unwrap();
    }
    p.drive();
    assert_eq!(
        p.a.sends(),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    assert_eq!(p.a.mem.bytes(dst.addr + u64::from(len), len as usize), data);
    assert_eq!(p.b.qp.state(), QpState::Rts);
}

#[test]
fn atomic_with_request_or_ack_dropped_executes_once() {
    for (drop_ack, cas) in [(false, false), (true, false), (false, true), (true, true)] {
        let mut p = Pair::new();
        let target = p.b.mem.register(64, ALL);
        p.b.mem.set_u64(target.addr + 16, 100);
        let local = p.a.mem.register(8, ALL);
        if drop_ack {
            p.ba.drop_matching(1, |x| x.op == Opcode::AtomicAcknowledge);
        } else {
            p.ab.drop_matching(1, |x| x.is_atomic_request());
        }
        let op = if cas {
            SendOp::CompareSwap {
                remote: target.remote(16),
                compare: 100,
                swap: 500,
            }
        } else {
            SendOp::FetchAdd {
                remote: target.remote(16),
                add: 7,
            }
        };
        p.a.post(wr(1, op, vec![local.sge(0, 8)])).unwrap();
        p.drive();

        let ctx = format!("drop ack {drop_ack}, cas {cas}");
        assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)], "{ctx}");
        assert_eq!(p.a.mem.u64_at(local.addr), 100, "{ctx}");
        // A second execution would give 114, or a failed CAS returning 500.
        let expect = if cas { 500 } else { 107 };
        assert_eq!(p.b.mem.u64_at(target.addr + 16), expect, "{ctx}");
        assert_eq!(p.b.mem.atomics.get(), 1, "{ctx}: executed exactly once");
        assert_eq!(
            p.ab.sent().filter(|x| x.is_atomic_request()).count(),
            2,
            "{ctx}"
        );
        if drop_ack {
            // The retransmission was a duplicate, answered from the replay.
            let acks: Vec<u64> = p.ba.sent().filter_map(|x| x.atomic_orig).collect();
            assert_eq!(acks, vec![100, 100], "{ctx}");
        }
    }
}

#[test]
fn lost_ack_of_a_send_is_recovered_without_a_second_delivery() {
    let mut p = Pair::new();
    let src = p.a.mem.register(100, ALL);
    let dst = p.b.mem.register(200, ALL);
    p.a.mem.fill(src.addr, &pattern(9, 100));
    p.b.recv(1, vec![dst.sge(0, 100)]).unwrap();
    p.b.recv(2, vec![dst.sge(100, 100)]).unwrap();
    p.ba.drop_matching(1, |x| x.is_ack());
    p.a.post(wr(1, SendOp::Send, vec![src.sge(0, 100)]))
        .unwrap();
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)]);
    assert_eq!(p.b.recvs(), vec![(1, WcStatus::Success)]);
    assert_eq!(p.b.qp.outstanding().1, 1);
    assert_eq!(p.b.mem.bytes(dst.addr + 100, 100), vec![0; 100]);
    assert_eq!(p.ab.sent().count(), 2, "one retransmission");
    assert_eq!(p.timeouts.0, 1);
    // The completion came only after the timeout.
    assert!(p.a.send_cq[0].at - p.epoch >= ack_timeout(&p));
}

#[test]
fn go_back_to_an_earlier_read_while_a_send_is_half_received() {
    let mut p = Pair::new();
    let rsrc = p.b.mem.register(64, ALL);
    p.b.mem
        .fill(rsrc.addr, b"read me, then the long send arrives after");
    let rdst = p.a.mem.register(64, ALL);
    let data = pattern(12, LONG as usize);
    let src = p.a.mem.register(u64::from(LONG), ALL);
    p.a.mem.fill(src.addr, &data);
    let dst = p.b.mem.register(u64::from(LONG), ALL);
    p.b.recv(7, vec![dst.sge(0, LONG)]).unwrap();
    p.b.recv(8, vec![dst.sge(0, LONG)]).unwrap();
    // The READ's only response is lost, and the SEND's last packet: the responder holds
    // a half-filled receive when the requester goes back to the READ.
    p.ba.drop_matching(1, |x| x.is_read_response());
    let last = a_psn(&p, 1 + 10);
    p.ab.set_filter(move |x| (x.psn == last && x.is_send()).then_some(Fate::Drop));
    p.a.post(wr(1, SendOp::Read(rsrc.remote(0)), vec![rdst.sge(0, 41)]))
        .unwrap();
    p.a.post(wr(2, SendOp::Send, vec![src.sge(0, LONG)]))
        .unwrap();
    p.drive_for(ack_timeout(&p) / 2);
    assert!(p.a.send_cq.is_empty());
    assert!(p.b.recv_cq.is_empty(), "the SEND is incomplete");
    // Let the retransmissions through.
    p.ab.clear_filter();
    p.drive();
    assert_eq!(
        p.a.sends(),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    assert_eq!(p.b.recvs(), vec![(7, WcStatus::Success)]);
    assert_eq!(p.b.mem.bytes(dst.addr, LONG as usize), data);
    assert_eq!(
        p.a.mem.bytes(rdst.addr, 41),
        b"read me, then the long send arrives after".to_vec()
    );
    assert_eq!(p.b.qp.outstanding().1, 1);
}

#[test]
fn write_with_imm_rnr_on_its_last_packet_keeps_the_placement() {
    let mut p = Pair::new();
    let data = pattern(13, LONG as usize);
    let src = p.a.mem.register(u64::from(LONG), ALL);
    p.a.mem.fill(src.addr, &data);
    let dst = p.b.mem.register(u64::from(LONG), ALL);
    let spare = p.b.mem.register(8, ALL);
    p.a.post(wr(
        1,
        SendOp::WriteWithImm(dst.remote(0), 77),
        vec![src.sge(0, LONG)],
    ))
    .unwrap();
    p.drive_for(Duration::from_millis(1));
    assert!(p.ba.sent().any(|x| x.is_rnr_nak()));
    assert!(p.a.send_cq.is_empty());
    p.b.recv(5, vec![spare.sge(0, 8)]).unwrap();
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)]);
    assert_eq!(p.b.recvs(), vec![(5, WcStatus::Success)]);
    assert_eq!(p.b.recv_cq[0].c.byte_len, LONG);
    assert_eq!(p.b.recv_cq[0].c.imm_data, Some(77));
    assert_eq!(p.b.mem.bytes(dst.addr, LONG as usize), data);
}

#[test]
fn late_responses_of_an_abandoned_read_attempt_change_nothing() {
    let mut p = Pair::new();
    let t = ack_timeout(&p);
    let one = pattern(20, LONG as usize);
    let two = pattern(21, LONG as usize);
    let src = p.b.mem.register(2 * u64::from(LONG), ALL);
    p.b.mem.fill(src.addr, &one);
    p.b.mem.fill(src.addr + u64::from(LONG), &two);
    let dst = p.a.mem.register(u64::from(LONG), ALL);
    // The first attempt's responses from the fourth on are held up for 1.5 timeouts: the
    // requester gives up on them, asks again, completes, and starts a second READ into
    // the same buffer whose request is lost once. The stragglers arrive during it.
    let first = a_psn(&p, 0);
    let mut held = 0;
    p.ba.set_filter(move |x| {
        let i = rdmx_wire::psn_diff(x.psn, first);
        if x.is_read_response() && (3..11).contains(&i) && held < 8 {
            held += 1;
            return Some(Fate::Delay(t + t / 2));
        }
        None
    });
    p.a.post(wr(1, SendOp::Read(src.remote(0)), vec![dst.sge(0, LONG)]))
        .unwrap();
    p.drive_until(|p| !p.a.send_cq.is_empty());
    assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)]);
    assert_eq!(p.a.mem.bytes(dst.addr, LONG as usize), one);
    assert!(p.ba.in_flight() > 0, "stragglers still on the wire");

    p.ab.drop_matching(1, |x| x.is_read_request());
    p.a.post(wr(
        2,
        SendOp::Read(src.remote(u64::from(LONG))),
        vec![dst.sge(0, LONG)],
    ))
    .unwrap();
    p.drive();
    assert_eq!(
        p.a.sends(),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    assert_eq!(p.a.mem.bytes(dst.addr, LONG as usize), two);
    assert_eq!(p.a.qp.state(), QpState::Rts);
}

#[test]
fn responses_after_a_lost_atomic_ack_wait_for_it() {
    // A lost ATOMIC ACKNOWLEDGE followed by READs that complete: the requester must not
    // run ahead with more READs/atomics than max_rd_atomic, or the responder's replay
    // forgets the atomic and its retransmission is never answered.
    let mut p = Pair::with(PairConfig {
        max_rd_atomic: 2,
        max_dest_rd_atomic: 2,
        ..PairConfig::default()
    });
    let target = p.b.mem.register(8, ALL);
    p.b.mem.set_u64(target.addr, 40);
    let src = p.b.mem.register(64, ALL);
    p.b.mem.fill(src.addr, &pattern(30, 64));
    let local = p.a.mem.register(8 + 6 * 64, ALL);
    p.ba.drop_matching(1, |x| x.op == Opcode::AtomicAcknowledge);
    p.a.post(wr(
        1,
        SendOp::FetchAdd {
            remote: target.remote(0),
            add: 2,
        },
        vec![local.sge(0, 8)],
    ))
    .unwrap();
    for i in 0..6u64 {
        p.a.post(wr(
            10 + i,
            SendOp::Read(src.remote(0)),
            vec![local.sge(8 + 64 * i, 64)],
        ))
        .unwrap();
    }
    p.drive();
    let mut expect = vec![(1, WcStatus::Success)];
    expect.extend((0..6).map(|i| (10 + i, WcStatus::Success)));
    assert_eq!(p.a.sends(), expect);
    assert_eq!(p.a.mem.u64_at(local.addr), 40);
    assert_eq!(p.b.mem.u64_at(target.addr), 42);
    assert_eq!(p.b.mem.atomics.get(), 1);
    for i in 0..6 {
        assert_eq!(p.a.mem.bytes(local.addr + 8 + 64 * i, 64), pattern(30, 64));
    }
}

#[test]
fn a_read_asked_again_while_its_first_answer_is_still_queued() {
    // The responder cannot send for a while (a full transport): the requester times out
    // and asks for the READ again while the first answer is still queued. That is a
    // retransmission, not a requester exceeding the responder's resources.
    let mut p = Pair::with(PairConfig {
        max_rd_atomic: 1,
        max_dest_rd_atomic: 1,
        ..PairConfig::default()
    });
    let t = ack_timeout(&p);
    let data = pattern(31, LONG as usize);
    let src = p.b.mem.register(u64::from(LONG), ALL);
    p.b.mem.fill(src.addr, &data);
    let dst = p.a.mem.register(u64::from(LONG), ALL);
    p.b.hold = true;
    // And the first answer's last packet is lost: the READ completes from the second.
    let last = a_psn(&p, 10);
    p.ba.drop_matching(1, move |x| x.is_read_response() && x.psn == last);
    p.a.post(wr(1, SendOp::Read(src.remote(0)), vec![dst.sge(0, LONG)]))
        .unwrap();
    p.drive_for(t + t / 2);
    assert_eq!(p.ab.sent().filter(|x| x.is_read_request()).count(), 2);
    p.b.hold = false;
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)]);
    assert_eq!(p.a.mem.bytes(dst.addr, LONG as usize), data);
    assert_eq!(p.b.qp.state(), QpState::Rts);
}

#[test]
fn rnr_nak_for_a_message_still_being_sent() {
    // A paced transport takes one packet every 5 µs: the RNR NAK for the first packet of
    // a 20-packet SEND comes back while the rest is still going out. The requester must
    // wait the RNR timer and retry (rnr_retry 7: forever), not let the ACK timer burn
    // its retry_cnt.
    let mut p = Pair::with(PairConfig {
        retry_cnt: 2,
        rnr_retry: 7,
        ..PairConfig::default()
    });
    p.a.burst = Some(1);
    let len = 20 * 256;
    let data = pattern(40, len);
    let src = p.a.mem.register(len as u64, ALL);
    p.a.mem.fill(src.addr, &data);
    let dst = p.b.mem.register(len as u64, ALL);
    p.a.post(wr(1, SendOp::Send, vec![src.sge(0, len as u32)]))
        .unwrap();
    p.drive_for(ack_timeout(&p) * 5);
    assert!(p.a.send_cq.is_empty(), "{:?}", p.a.sends());
    assert_eq!(p.a.qp.state(), QpState::Rts);
    assert!(p.ba.sent().filter(|x| x.is_rnr_nak()).count() >= 2);
    p.b.recv(7, vec![dst.sge(0, len as u32)]).unwrap();
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)]);
    assert_eq!(p.b.recvs(), vec![(7, WcStatus::Success)]);
    assert_eq!(p.b.mem.bytes(dst.addr, len), data);
}

#[test]
fn sequence_nak_for_a_message_still_being_sent() {
    // The same paced transport; the third packet is lost and the NAK comes back while
    // the message is still going out: go back at once, no timeout.
    let mut p = Pair::new();
    p.a.burst = Some(1);
    let len = 20 * 256;
    let data = pattern(41, len);
    let src = p.a.mem.register(len as u64, ALL);
    p.a.mem.fill(src.addr, &data);
    let dst = p.b.mem.register(len as u64, ALL);
    p.b.recv(7, vec![dst.sge(0, len as u32)]).unwrap();
    let lost = a_psn(&p, 2);
    p.ab.drop_matching(1, move |x| x.psn == lost);
    p.a.post(wr(1, SendOp::Send, vec![src.sge(0, len as u32)]))
        .unwrap();
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)]);
    assert_eq!(p.b.mem.bytes(dst.addr, len), data);
    assert_eq!(p.ba.sent().filter(|x| x.is_seq_nak()).count(), 1);
    assert_eq!(p.timeouts.0, 0, "recovered by the NAK, not the timer");
    assert!(p.a.send_cq[0].at - p.epoch < ack_timeout(&p));
}
