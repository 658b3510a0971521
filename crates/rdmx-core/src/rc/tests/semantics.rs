//! Responder duplicates, sequence NAKs, ordering, FENCE, the read/atomic depth,
//! selective signaling, credits, solicited events and zero-length operations.

use std::time::{Duration, Instant};

use rdmx_wire::{Credits, Opcode};

use super::util::*;
use crate::qp::QpState;
use crate::wr::{SendFlags, SendOp, WcStatus};

// ---------------------------------------------------------------------------------------
// Duplicates at the responder
// ---------------------------------------------------------------------------------------

#[test]
fn duplicated_sends_are_delivered_once() {
    for late in [false, true] {
        let mut p = Pair::new();
        let src = p.a.mem.register(2048, ALL);
        p.a.mem.fill(src.addr, &pattern(1, 2048));
        let dst = p.b.mem.register(3 * 1024, ALL);
        for i in 0..3 {
            p.b.recv(i, vec![dst.sge(1024 * i, 1024)]).unwrap();
        }
        // Every packet of the first (3-packet) SEND arrives twice; late copies come after
        // the second SEND was received.
        let fate = if late {
            Fate::DupDelayed(Duration::from_millis(1))
        } else {
            Fate::Duplicate
        };
        p.ab.fate_matching(3, fate, |x| x.is_send());
        p.a.post(wr(1, SendOp::Send, vec![src.sge(0, 600)]))
            .unwrap();
        p.drive_until(|p| !p.a.send_cq.is_empty());
        p.a.post(wr(2, SendOp::Send, vec![src.sge(1024, 100)]))
            .unwrap();
        p.drive();

        let ctx = format!("late {late}");
        assert_eq!(
            p.a.sends(),
            vec![(1, WcStatus::Success), (2, WcStatus::Success)],
            "{ctx}"
        );
        assert_eq!(
            p.b.recvs(),
            vec![(0, WcStatus::Success), (1, WcStatus::Success)],
            "{ctx}"
        );
        assert_eq!(p.b.qp.outstanding().1, 1, "{ctx}");
        assert_eq!(
            p.b.mem.bytes(dst.addr, 600),
            pattern(1, 2048)[..600].to_vec()
        );
        assert_eq!(
            p.b.mem.bytes(dst.addr + 1024, 100),
            pattern(1, 2048)[1024..1124].to_vec(),
            "{ctx}: the second receive holds the second message"
        );
        assert_eq!(p.b.mem.bytes(dst.addr + 2048, 1024), vec![0; 1024], "{ctx}");
        // The duplicates were acknowledged, not NAKed.
        assert_eq!(p.ba.sent().filter(|x| x.is_nak()).count(), 0, "{ctx}");
    }
}

#[test]
fn duplicate_ack_covers_what_was_received() {
    // Duplicate SENDs get an ACK for the last PSN received: it must not complete a
    // later request that the responder has not seen.
    let mut p = Pair::new();
    let src = p.a.mem.register(1024, ALL);
    let dst = p.b.mem.register(1024, ALL);
    p.b.recv(1, vec![dst.sge(0, 1024)]).unwrap();
    p.b.recv(2, vec![dst.sge(0, 1024)]).unwrap();
    // The first SEND arrives twice; the second SEND's only packet is lost once.
    p.ab.set_filter({
        move |x| match x.n {
            0 => Some(Fate::Duplicate),
            1 => Some(Fate::Drop),
            _ => None,
        }
    });
    p.a.post(wr(1, SendOp::Send, vec![src.sge(0, 10)])).unwrap();
    p.a.post(wr(2, SendOp::Send, vec![src.sge(0, 10)])).unwrap();
    p.drive_for(ack_timeout(&p) / 2);
    assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)]);
    assert_eq!(p.b.recvs(), vec![(1, WcStatus::Success)]);
    for ack in p.ba.sent().filter(|x| x.is_ack()) {
        assert_eq!(ack.psn, a_psn(&p, 0));
    }
    p.drive();
    assert_eq!(
        p.a.sends(),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    assert_eq!(
        p.b.recvs(),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
}

#[test]
fn duplicate_read_is_executed_again() {
    let mut p = Pair::new();
    let len = 600u32;
    let src = p.b.mem.register(u64::from(len), ALL);
    p.b.mem.fill(src.addr, &pattern(2, len as usize));
    let dst = p.a.mem.register(u64::from(len), ALL);
    p.ab.fate_matching(1, Fate::DupDelayed(Duration::from_millis(1)), |x| {
        x.is_read_request()
    });
    p.a.post(wr(1, SendOp::Read(src.remote(0)), vec![dst.sge(0, len)]))
        .unwrap();
    p.drive_until(|p| !p.a.send_cq.is_empty());
    // The memory changes before the duplicate arrives: a re-execution reads the new bytes.
    p.b.mem.fill(src.addr, &pattern(3, len as usize));
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)]);
    assert_eq!(
        p.a.mem.bytes(dst.addr, len as usize),
        pattern(2, len as usize)
    );
    let responses: Vec<_> = p.ba.sent().filter(|x| x.is_read_response()).collect();
    assert_eq!(responses.len(), 6, "three packets, twice");
    let second: Vec<u8> = responses[3..]
        .iter()
        .flat_map(|x| {
            let r = rdmx_wire::RcRepr::parse_bytes(&x.bytes).unwrap();
            r.payload.to_vec()
        })
        .collect();
    assert_eq!(
        second,
        pattern(3, len as usize),
        "executed again, not replayed"
    );
    assert_eq!(p.a.qp.state(), QpState::Rts);
}

/// A FETCH_ADD of 5 on 1000 whose request reaches the responder twice (the second a
/// millisecond late, after the answer), on `p` once `before` has run on it. Checks that
/// it completed and ran once; returns the ATOMIC ACKNOWLEDGEs sent (PSN, original value).
fn fetch_add_asked_twice(mut p: Pair, before: impl FnOnce(&mut Pair)) -> Vec<(u32, u64)> {
    let target = p.b.mem.register(8, ALL);
    p.b.mem.set_u64(target.addr, 1000);
    let local = p.a.mem.register(16, ALL);
    before(&mut p);
    p.ab.fate_matching(1, Fate::DupDelayed(Duration::from_millis(1)), |x| {
        x.is_atomic_request()
    });
    p.a.post(wr(
        1,
        SendOp::FetchAdd {
            remote: target.remote(0),
            add: 5,
        },
        vec![local.sge(0, 8)],
    ))
    .unwrap();
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)]);
    assert_eq!(p.b.mem.u64_at(target.addr), 1005);
    assert_eq!(p.b.mem.atomics.get(), 1);
    p.ba.sent()
        .filter(|x| x.op == Opcode::AtomicAcknowledge)
        .map(|x| (x.psn, x.atomic_orig.unwrap()))
        .collect()
}

#[test]
fn duplicate_atomic_is_answered_from_the_replay() {
    let p = Pair::new();
    let psn = a_psn(&p, 0);
    let acks = fetch_add_asked_twice(p, |_| {});
    assert_eq!(acks, vec![(psn, 1000), (psn, 1000)]);
}

/// The responder looks its replay up newest first: an answer it remembers from before
/// the 24-bit PSNs wrapped, at the PSN a new atomic takes again, is not what the new
/// atomic's duplicate gets.
#[test]
fn a_duplicate_atomic_gets_its_own_answer_not_an_older_one_at_its_psn() {
    let p = Pair::new();
    let psn = a_psn(&p, 0);
    let acks = fetch_add_asked_twice(p, |p| p.b.qp.resp.remember_old_atomic(psn, 7777));
    assert_eq!(acks, vec![(psn, 1000), (psn, 1000)]);
}

#[test]
fn very_late_duplicate_atomic_is_never_executed_again() {
    // The replay remembers max_dest_rd_atomic answers; a duplicate older than that is
    // dropped, never executed.
    let mut p = Pair::with(PairConfig {
        max_rd_atomic: 1,
        max_dest_rd_atomic: 1,
        ..PairConfig::default()
    });
    let target = p.b.mem.register(8, ALL);
    let local = p.a.mem.register(16, ALL);
    p.ab.fate_matching(1, Fate::DupDelayed(Duration::from_millis(1)), |x| {
        x.is_atomic_request()
    });
    for i in 0..3 {
        p.a.post(wr(
            i,
            SendOp::FetchAdd {
                remote: target.remote(0),
                add: 1,
            },
            vec![local.sge(0, 8)],
        ))
        .unwrap();
    }
    p.drive();
    assert_eq!(
        p.a.sends(),
        (0..3).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>()
    );
    assert_eq!(p.b.mem.u64_at(target.addr), 3);
    assert_eq!(p.b.mem.atomics.get(), 3);
    assert_eq!(p.b.qp.state(), QpState::Rts);
    assert_eq!(p.a.qp.state(), QpState::Rts);
}

// ---------------------------------------------------------------------------------------
// PSN sequence errors
// ---------------------------------------------------------------------------------------

#[test]
fn psn_gap_gets_one_nak_and_go_back_n() {
    let mut p = Pair::new();
    let src = p.a.mem.register(64, ALL);
    let dst = p.b.mem.register(64 * 6, ALL);
    for i in 0..6 {
        p.b.recv(i, vec![dst.sge(64 * i, 64)]).unwrap();
    }
    let gap = a_psn(&p, 1);
    p.ab.drop_matching(1, move |x| x.psn == gap);
    for i in 0..6 {
        p.a.mem.fill(src.addr + i, &[i as u8]);
        p.a.post(wr(i, SendOp::Send, vec![src.sge(i, 1)])).unwrap();
    }
    p.drive();
    assert_eq!(
        p.a.sends(),
        (0..6).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>()
    );
    assert_eq!(
        p.b.recvs(),
        (0..6).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>()
    );
    for i in 0..6 {
        assert_eq!(p.b.mem.bytes(dst.addr + 64 * i, 1), vec![i as u8]);
    }
    let naks: Vec<_> = p.ba.sent().filter(|x| x.is_nak()).collect();
    assert_eq!(naks.len(), 1, "four packets past the gap, one NAK");
    assert!(naks[0].is_seq_nak());
    assert_eq!(naks[0].psn, gap);
    // Go-back-N: after the NAK, everything from the gap was sent again, in order.
    let nak_arrival = naks[0].at + p.ba.latency;
    let resent: Vec<u32> =
        p.ab.sent()
            .filter(|x| x.at >= nak_arrival)
            .map(|x| x.psn)
            .collect();
    assert_eq!(resent, (1..6).map(|k| a_psn(&p, k)).collect::<Vec<_>>());
    assert_eq!(p.timeouts.0, 0, "no timeout needed");
}

#[test]
fn lost_sequence_nak_is_recovered_by_the_timer() {
    let mut p = Pair::new();
    let src = p.a.mem.register(64, ALL);
    let dst = p.b.mem.register(64 * 4, ALL);
    for i in 0..4 {
        p.b.recv(i, vec![dst.sge(64 * i, 64)]).unwrap();
    }
    let gap = a_psn(&p, 1);
    p.ab.drop_matching(1, move |x| x.psn == gap);
    p.ba.drop_matching(1, |x| x.is_seq_nak());
    for i in 0..4 {
        p.a.post(wr(i, SendOp::Send, vec![src.sge(i, 1)])).unwrap();
    }
    p.drive();
    assert_eq!(
        p.a.sends(),
        (0..4).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>()
    );
    assert_eq!(p.b.recvs().len(), 4);
    assert_eq!(p.ba.sent().filter(|x| x.is_seq_nak()).count(), 1);
    assert!(p.timeouts.0 >= 1);
}

#[test]
fn gap_inside_a_multi_packet_write_and_a_read_behind_it() {
    let mut p = Pair::new();
    let len = 10 * 256 + 3;
    let data = pattern(4, len);
    let src = p.a.mem.register(len as u64, ALL);
    p.a.mem.fill(src.addr, &data);
    let dst = p.b.mem.register(len as u64, ALL);
    let rdst = p.a.mem.register(len as u64, ALL);
    let gap = a_psn(&p, 4);
    p.ab.drop_matching(1, move |x| x.psn == gap);
    p.a.post(wr(
        1,
        SendOp::Write(dst.remote(0)),
        vec![src.sge(0, len as u32)],
    ))
    .unwrap();
    p.a.post(wr(
        2,
        SendOp::Read(dst.remote(0)),
        vec![rdst.sge(0, len as u32)],
    ))
    .unwrap();
    p.drive();
    assert_eq!(
        p.a.sends(),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    assert_eq!(p.b.mem.bytes(dst.addr, len), data);
    assert_eq!(
        p.a.mem.bytes(rdst.addr, len),
        data,
        "the READ saw the WRITE"
    );
    assert_eq!(p.ba.sent().filter(|x| x.is_seq_nak()).count(), 1);
}

// ---------------------------------------------------------------------------------------
// Ordering
// ---------------------------------------------------------------------------------------

#[test]
fn write_then_send_the_receiver_sees_the_write_when_the_send_completes() {
    let mut p = Pair::new();
    let len = 5 * 256;
    let data = pattern(5, len);
    let src = p.a.mem.register(len as u64 + 8, ALL);
    p.a.mem.fill(src.addr, &data);
    let dst = p.b.mem.register(len as u64, ALL);
    let flag = p.b.mem.register(8, ALL);
    p.b.recv(1, vec![flag.sge(0, 8)]).unwrap();
    // Lose a WRITE packet: the SEND behind it must wait for its retransmission.
    let lost = a_psn(&p, 2);
    p.ab.drop_matching(1, move |x| x.psn == lost);
    p.a.post(wr(
        1,
        SendOp::Write(dst.remote(0)),
        vec![src.sge(0, len as u32)],
    ))
    .unwrap();
    p.a.post(wr(2, SendOp::Send, vec![src.sge(len as u64, 8)]))
        .unwrap();
    p.drive_until(|p| !p.b.recv_cq.is_empty());
    assert_eq!(p.b.mem.bytes(dst.addr, len), data);
    p.drive();
    assert_eq!(
        p.a.sends(),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
}

#[test]
fn send_completions_come_in_posting_order() {
    let mut p = Pair::new();
    let rsrc = p.b.mem.register(64, ALL);
    let local = p.a.mem.register(256, ALL);
    let wdst = p.b.mem.register(64, ALL);
    let rdst = p.b.mem.register(64, ALL);
    p.b.recv(1, vec![rdst.sge(0, 64)]).unwrap();
    // The READ's response is lost: WRITE and SEND behind it are acknowledged first but
    // complete after it.
    p.ba.drop_matching(1, |x| x.is_read_response());
    p.a.post(wr(1, SendOp::Read(rsrc.remote(0)), vec![local.sge(0, 64)]))
        .unwrap();
    p.a.post(wr(
        2,
        SendOp::Write(wdst.remote(0)),
        vec![local.sge(64, 64)],
    ))
    .unwrap();
    p.a.post(wr_unsignaled(
        3,
        SendOp::Write(wdst.remote(0)),
        vec![local.sge(64, 64)],
    ))
    .unwrap();
    p.a.post(wr(4, SendOp::Send, vec![local.sge(128, 64)]))
        .unwrap();
    p.drive();
    assert_eq!(
        p.a.sends(),
        vec![
            (1, WcStatus::Success),
            (2, WcStatus::Success),
            (4, WcStatus::Success)
        ]
    );
    let t = p.a.send_cq[0].at;
    assert!(t - p.epoch >= ack_timeout(&p));
    assert!(p.a.send_cq.iter().all(|w| w.at >= t));
    assert_eq!(p.b.recvs(), vec![(1, WcStatus::Success)]);
}

/// When each READ response (last or only packet) reached A.
fn read_done_times(p: &Pair) -> Vec<Instant> {
    p.ba.passed()
        .filter(|x| {
            matches!(
                x.op,
                Opcode::RdmaReadResponseLast | Opcode::RdmaReadResponseOnly
            )
        })
        .map(|x| x.at + p.ba.latency)
        .collect()
}

#[test]
fn fence_waits_for_earlier_reads_and_atomics() {
    for (fence, atomic) in [(true, false), (false, false), (true, true), (false, true)] {
        let mut p = Pair::new();
        let src = p.b.mem.register(1024, ALL);
        let local = p.a.mem.register(1024, ALL);
        let dst = p.b.mem.register(64, ALL);
        p.b.recv(1, vec![dst.sge(0, 64)]).unwrap();
        let first = if atomic {
            SendOp::FetchAdd {
                remote: src.remote(0),
                add: 1,
            }
        } else {
            SendOp::Read(src.remote(0))
        };
        let n = if atomic { 8 } else { 4 * 256 };
        p.a.post(wr(1, first, vec![local.sge(0, n)])).unwrap();
        let flags = if fence {
            SendFlags::FENCE
        } else {
            SendFlags::empty()
        };
        p.a.post(wr_flags(2, SendOp::Send, vec![local.sge(0, 8)], flags))
            .unwrap();
        p.drive();
        let ctx = format!("fence {fence}, atomic {atomic}");
        assert_eq!(
            p.a.sends(),
            vec![(1, WcStatus::Success), (2, WcStatus::Success)],
            "{ctx}"
        );
        let send_at = p.ab.sent().find(|x| x.is_send()).unwrap().at;
        let answered = if atomic {
            p.ba.sent()
                .find(|x| x.op == Opcode::AtomicAcknowledge)
                .map(|x| x.at + p.ba.latency)
                .unwrap()
        } else {
            read_done_times(&p)[0]
        };
        if fence {
            assert!(
                send_at >= answered,
                "{ctx}: the SEND went out before the answer"
            );
        } else {
            assert!(
                send_at < answered,
                "{ctx}: without FENCE the SEND does not wait"
            );
        }
    }
}

#[test]
fn fence_does_not_wait_for_writes_and_sends() {
    let mut p = Pair::new();
    let local = p.a.mem.register(64, ALL);
    let dst = p.b.mem.register(64, ALL);
    p.b.recv(1, vec![dst.sge(0, 64)]).unwrap();
    p.a.post(wr(1, SendOp::Write(dst.remote(0)), vec![local.sge(0, 8)]))
        .unwrap();
    p.a.post(wr_flags(
        2,
        SendOp::Send,
        vec![local.sge(0, 8)],
        SendFlags::FENCE,
    ))
    .unwrap();
    p.drive();
    let times: Vec<Instant> = p.ab.sent().map(|x| x.at).collect();
    assert_eq!(times.len(), 2);
    assert_eq!(times[0], times[1]);
}

#[test]
fn max_rd_atomic_bounds_reads_and_atomics_in_flight() {
    for depth in [1u8, 2, 3] {
        let mut p = Pair::with(PairConfig {
            max_rd_atomic: depth,
            max_dest_rd_atomic: depth,
            ..PairConfig::default()
        });
        let src = p.b.mem.register(2048, ALL);
        let local = p.a.mem.register(8 * 2048, ALL);
        let wdst = p.b.mem.register(64, ALL);
        for i in 0..8u64 {
            let op = match i % 3 {
                0 => SendOp::Read(src.remote(0)),
                1 => SendOp::FetchAdd {
                    remote: src.remote(0),
                    add: 1,
                },
                _ => SendOp::Read(src.remote(1024)),
            };
            let n = if i % 3 == 1 { 8 } else { 700 };
            p.a.post(wr(i, op, vec![local.sge(2048 * i, n)])).unwrap();
            // WRITEs in between do not count.
            p.a.post(wr(
                100 + i,
                SendOp::Write(wdst.remote(0)),
                vec![local.sge(0, 8)],
            ))
            .unwrap();
        }
        p.drive();
        assert_eq!(p.a.send_cq.len(), 16);
        assert!(p.a.send_cq.iter().all(|w| w.c.status == WcStatus::Success));
        // Outstanding at each request's sending: requests sent so far minus answers that
        // had arrived.
        let mut answers: Vec<Instant> =
            p.ba.sent()
                .filter(|x| {
                    matches!(
                        x.op,
                        Opcode::RdmaReadResponseLast
                            | Opcode::RdmaReadResponseOnly
                            | Opcode::AtomicAcknowledge
                    )
                })
                .map(|x| x.at + p.ba.latency)
                .collect();
        answers.sort();
        let mut most = 0;
        for (k, req) in
            p.ab.sent()
                .filter(|x| x.is_read_request() || x.is_atomic_request())
                .enumerate()
        {
            let answered = answers.iter().filter(|&&t| t <= req.at).count();
            most = most.max(k + 1 - answered);
        }
        assert_eq!(most, usize::from(depth), "depth {depth}");
        // Requests go out in order: at the start, one WRITE behind each READ or atomic
        // the bound let through, and none behind the one it held back.
        let t0 = p.ab.sent().next().unwrap().at;
        assert_eq!(
            p.ab.sent().filter(|x| x.is_write() && x.at == t0).count(),
            usize::from(depth),
            "depth {depth}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Selective signaling
// ---------------------------------------------------------------------------------------

#[test]
fn unsignaled_requests_complete_silently_and_free_their_slots() {
    let mut p = Pair::with(PairConfig {
        max_send_wr: 4,
        ..PairConfig::default()
    });
    let local = p.a.mem.register(64, ALL);
    let dst = p.b.mem.register(64, ALL);
    for round in 0..3u64 {
        for i in 0..4 {
            p.a.post(wr_unsignaled(
                round * 10 + i,
                SendOp::Write(dst.remote(8 * i)),
                vec![local.sge(0, 8)],
            ))
            .unwrap();
        }
        p.drive();
        assert_eq!(p.a.qp.outstanding().0, 0, "round {round}");
    }
    assert!(p.a.send_cq.is_empty());
    p.a.post(wr(99, SendOp::Write(dst.remote(0)), vec![local.sge(0, 8)]))
        .unwrap();
    p.drive();
    assert_eq!(p.a.sends(), vec![(99, WcStatus::Success)]);
}

#[test]
fn an_error_on_an_unsignaled_request_still_completes() {
    let mut p = Pair::new();
    let local = p.a.mem.register(64, ALL);
    let dst = p.b.mem.register(64, ALL);
    let mut bad = dst.remote(0);
    bad.rkey ^= 0x77;
    p.a.post(wr_unsignaled(
        1,
        SendOp::Write(dst.remote(0)),
        vec![local.sge(0, 8)],
    ))
    .unwrap();
    p.a.post(wr_unsignaled(2, SendOp::Write(bad), vec![local.sge(0, 8)]))
        .unwrap();
    p.a.post(wr_unsignaled(
        3,
        SendOp::Write(dst.remote(0)),
        vec![local.sge(0, 8)],
    ))
    .unwrap();
    p.drive();
    assert_eq!(
        p.a.sends(),
        vec![(2, WcStatus::RemAccessErr), (3, WcStatus::WrFlushErr)]
    );
    // A local error too.
    let mut p = Pair::new();
    let local = p.a.mem.register(64, ALL);
    let sge = crate::wr::Sge {
        lkey: 0,
        ..local.sge(0, 8)
    };
    p.a.post(wr_unsignaled(5, SendOp::Send, vec![sge])).unwrap();
    p.drive();
    assert_eq!(p.a.sends(), vec![(5, WcStatus::LocProtErr)]);
}

// ---------------------------------------------------------------------------------------
// Credits, solicited events, zero-length operations
// ---------------------------------------------------------------------------------------

#[test]
fn acks_carry_the_receive_credits() {
    let mut p = Pair::new();
    let local = p.a.mem.register(64, ALL);
    let dst = p.b.mem.register(64, ALL);
    for i in 0..5 {
        p.b.recv(i, vec![dst.sge(0, 64)]).unwrap();
    }
    p.a.post(wr(1, SendOp::Send, vec![local.sge(0, 8)]))
        .unwrap();
    p.drive();
    let ack = p.ba.sent().find(|x| x.is_ack()).unwrap().clone();
    // Five posted, one consumed: four left.
    assert_eq!(ack.credits(), Some(4));
    assert_eq!(p.a.qp.req.peer_credits, Some(4));

    for i in 0..16 {
        p.b.recv(10 + i, vec![dst.sge(0, 64)]).unwrap();
    }
    p.a.post(wr(2, SendOp::Write(dst.remote(0)), vec![local.sge(0, 8)]))
        .unwrap();
    p.drive();
    let ack = p.ba.sent().filter(|x| x.is_ack()).last().unwrap().clone();
    // 20 receives: the largest credit count not above it is 16.
    let r = rdmx_wire::RcRepr::parse_bytes(&ack.bytes).unwrap();
    let aeth = r.aeth.unwrap();
    assert_eq!(
        aeth.syndrome,
        rdmx_wire::Syndrome::Ack {
            credits: Credits::from_count(20)
        }
    );
    assert_eq!(ack.credits(), Some(16));
    assert_eq!(p.a.qp.req.peer_credits, Some(16));

    // Read responses and atomic acknowledgements carry them too.
    p.a.post(wr(3, SendOp::Read(dst.remote(0)), vec![local.sge(0, 8)]))
        .unwrap();
    p.drive();
    let resp = p.ba.sent().find(|x| x.is_read_response()).unwrap();
    assert_eq!(resp.credits(), Some(16));
}

#[test]
fn solicited_flag_reaches_the_receive_completion() {
    let mut p = Pair::new();
    let local = p.a.mem.register(600, ALL);
    let dst = p.b.mem.register(1200, ALL);
    p.b.recv(1, vec![dst.sge(0, 600)]).unwrap();
    p.b.recv(2, vec![dst.sge(600, 600)]).unwrap();
    p.a.post(wr_flags(
        1,
        SendOp::Send,
        vec![local.sge(0, 600)],
        SendFlags::SOLICITED,
    ))
    .unwrap();
    p.a.post(wr(2, SendOp::Send, vec![local.sge(0, 600)]))
        .unwrap();
    p.drive();
    let s: Vec<bool> = p.b.recv_cq.iter().map(|w| w.solicited).collect();
    assert_eq!(s, vec![true, false]);
    // Only the last packet carries the bit.
    let bits: Vec<bool> =
        p.ab.sent()
            .map(|x| {
                rdmx_wire::RcRepr::parse_bytes(&x.bytes)
                    .unwrap()
                    .bth
                    .solicited
            })
            .collect();
    assert_eq!(bits, vec![false, false, true, false, false, false]);
}

#[test]
fn zero_length_write_and_read_check_no_key() {
    let mut p = Pair::new();
    let local = p.a.mem.register(8, ALL);
    let bogus = crate::wr::RemoteAddr {
        addr: 0xdead_0000,
        rkey: 0x1234_5678,
    };
    p.a.post(wr(1, SendOp::Write(bogus), vec![])).unwrap();
    p.a.post(wr(2, SendOp::Read(bogus), vec![local.sge(0, 0)]))
        .unwrap();
    p.drive();
    assert_eq!(
        p.a.sends(),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
}
