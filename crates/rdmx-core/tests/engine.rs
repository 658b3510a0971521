//! The RC engine driven through the simulated link: retransmission, duplicates, RNR,
//! retry exhaustion and ordering, with simulated time only.

mod sim;

use std::time::Duration;

use rdmx_core::{
    Access, PostError, QpState, RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge, WcOpcode,
    WcStatus,
};
use sim::{Pair, Params, Region};

fn sge(r: Region, off: u64, len: u32) -> Sge {
    Sge {
        addr: r.addr + off,
        len,
        lkey: r.lkey,
    }
}

fn remote(r: Region, off: u64) -> RemoteAddr {
    RemoteAddr {
        addr: r.addr + off,
        rkey: r.rkey,
    }
}

fn wr(wr_id: u64, op: SendOp, sges: Vec<Sge>) -> SendWr {
    SendWr {
        wr_id,
        op,
        sges: sges.as_slice().try_into().unwrap(),
        flags: SendFlags::SIGNALED,
        ud: None,
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u64 * 31 + seed * 7) as u8).collect()
}

/// Posts a mixed workload of `n` operations from A to B and checks every result.
fn mixed_workload(pair: &mut Pair, n: u64) {
    let mtu = 256usize;
    let (ra, rb) = pair.regions(64 * 1024);
    let counter = pair
        .b
        .mem
        .register(8, Access::LOCAL_WRITE | Access::REMOTE_ATOMIC);
    let mut expected_recv = Vec::new();
    let mut adds = 0u64;
    for i in 0..n {
        let len = [0, 1, mtu - 1, mtu, mtu + 1, 5 * mtu + 3][(i % 6) as usize];
        let slot = (i % 16) * 4096;
        let data = pattern(i, len);
        pair.a.mem.put(ra.addr + slot, &data);
        let op = match i % 5 {
            0 => {
                pair.b
                    .qp
                    .post_recv(
                        &pair.b.mem,
                        RecvWr {
                            wr_id: i,
                            sges: [sge(rb, slot, 4096)].try_into().unwrap(),
                        },
                    )
                    .unwrap();
                expected_recv.push((i, len));
                SendOp::Send
            }
            1 => SendOp::Write(remote(rb, slot)),
            2 => SendOp::Read(remote(rb, slot)),
            3 => {
                adds += 1;
                SendOp::FetchAdd {
                    remote: remote(counter, 0),
                    add: 1,
                }
            }
            _ => SendOp::Write(remote(rb, slot)),
        };
        let sges = if matches!(op, SendOp::FetchAdd { .. }) {
            vec![sge(ra, 60 * 1024, 8)]
        } else {
            vec![sge(ra, slot, len as u32)]
        };
        pair.a
            .qp
            .post_send(&pair.a.mem, wr(i, op, sges), None)
            .unwrap();
        pair.drive();
        let c = pair
            .a
            .send_cq
            .pop()
            .expect("a completion for every signaled request");
        assert_eq!((c.wr_id, c.status), (i, WcStatus::Success), "request {i}");
        match i % 5 {
            0 | 1 | 4 => assert_eq!(pair.b.mem.get(rb.addr + slot, len), data, "request {i}"),
            2 => assert_eq!(
                pair.a.mem.get(ra.addr + slot, len),
                pair.b.mem.get(rb.addr + slot, len)
            ),
            _ => {}
        }
    }
    assert_eq!(
        pair.b.mem.u64_at(counter.addr),
        adds,
        "each FETCH_ADD executed exactly once"
    );
    let got: Vec<(u64, usize)> = pair
        .b
        .recv_cq
        .iter()
        .map(|c| {
            assert_eq!(c.status, WcStatus::Success);
            (c.wr_id, c.byte_len as usize)
        })
        .collect();
    assert_eq!(
        got, expected_recv,
        "each SEND delivered exactly once, in order"
    );
}

#[test]
fn lossless_mixed_workload() {
    let mut pair = Pair::new(1, Params::default());
    mixed_workload(&mut pair, 60);
}

#[test]
fn loss_duplication_and_reordering_are_recovered_exactly_once() {
    for seed in 1..=6 {
        let mut pair = Pair::new(seed, Params::default());
        for l in [&mut pair.ab, &mut pair.ba] {
            l.loss = 0.15;
            l.dup = 0.10;
            l.jitter = Duration::from_micros(40);
        }
        mixed_workload(&mut pair, 60);
        assert_eq!(pair.a.qp.state(), QpState::Rts);
        assert!(
            pair.ab.dropped > 5 && pair.ba.dropped > 5,
            "the link really lost packets"
        );
    }
}

#[test]
fn every_packet_duplicated_still_executes_once() {
    let mut pair = Pair::new(9, Params::default());
    pair.ab.dup = 1.0;
    pair.ba.dup = 1.0;
    mixed_workload(&mut pair, 30);
}

#[test]
fn lost_ack_of_a_write_is_recovered_by_retransmission() {
    let mut pair = Pair::new(3, Params::default());
    let (ra, rb) = pair.regions(4096);
    pair.a.mem.put(ra.addr, b"hello");
    // Drop B's first ACK.
    pair.ba.drop_if = Some(Box::new(|i, _| i == 0));
    let t0 = pair.now;
    pair.a
        .qp
        .post_send(
            &pair.a.mem,
            wr(1, SendOp::Write(remote(rb, 0)), vec![sge(ra, 0, 5)]),
            None,
        )
        .unwrap();
    pair.drive();
    assert_eq!(pair.a.send_cq.len(), 1);
    assert_eq!(pair.a.send_cq[0].status, WcStatus::Success);
    assert_eq!(pair.b.mem.get(rb.addr, 5), b"hello");
    assert_eq!(pair.ab.log.len(), 2, "the WRITE went out twice");
    assert!(
        pair.now - t0 >= Duration::from_micros(1000),
        "retransmitted after the timeout"
    );
    assert_eq!(pair.ba.log.len(), 2, "the duplicate was acknowledged again");
}

#[test]
fn retries_exhausted_give_retry_exc_err_and_flush() {
    let params = Params {
        retry_cnt: 3,
        ..Params::default()
    };
    let mut pair = Pair::new(4, params);
    let (ra, rb) = pair.regions(4096);
    pair.ab.loss = 1.0;
    for i in 0..3 {
        pair.a
            .qp
            .post_send(
                &pair.a.mem,
                wr(i, SendOp::Write(remote(rb, 0)), vec![sge(ra, 0, 8)]),
                None,
            )
            .unwrap();
    }
    pair.drive();
    let st: Vec<(u64, WcStatus)> = pair.a.send_cq.iter().map(|c| (c.wr_id, c.status)).collect();
    assert_eq!(
        st,
        vec![
            (0, WcStatus::RetryExcErr),
            (1, WcStatus::WrFlushErr),
            (2, WcStatus::WrFlushErr)
        ]
    );
    assert_eq!(pair.a.qp.state(), QpState::Err);
    let first_sends = pair
        .ab
        .log
        .iter()
        .filter(|p| p[11] == pair.ab.log[0][11])
        .count();
    assert_eq!(first_sends, 4, "one transmission and retry_cnt retries");
    // Posts after the error are flushed at once.
    pair.a
        .qp
        .post_send(
            &pair.a.mem,
            wr(9, SendOp::Write(remote(rb, 0)), vec![sge(ra, 0, 8)]),
            None,
        )
        .unwrap();
    pair.drive();
    assert_eq!(
        pair.a.send_cq.last().map(|c| (c.wr_id, c.status)),
        Some((9, WcStatus::WrFlushErr))
    );
}

#[test]
fn rnr_waits_then_succeeds_once_a_receive_is_posted() {
    let mut pair = Pair::new(5, Params::default());
    let (ra, rb) = pair.regions(4096);
    pair.a.mem.put(ra.addr, b"late");
    pair.a
        .qp
        .post_send(&pair.a.mem, wr(1, SendOp::Send, vec![sge(ra, 0, 4)]), None)
        .unwrap();
    // No receive: RNR NAKs while B has none; A keeps retrying (rnr_retry 7).
    assert!(!pair.drive_for(Duration::from_millis(5)), "still retrying");
    assert!(pair.a.send_cq.is_empty());
    let naks = pair
        .ba
        .log
        .iter()
        .filter(|p| p.len() >= 13 && p[12] >> 5 == 0b001)
        .count();
    assert!(naks >= 2, "RNR NAKs seen: {naks}");
    pair.b
        .qp
        .post_recv(
            &pair.b.mem,
            RecvWr {
                wr_id: 7,
                sges: [sge(rb, 0, 64)].try_into().unwrap(),
            },
        )
        .unwrap();
    pair.drive();
    assert_eq!(pair.a.send_cq[0].status, WcStatus::Success);
    assert_eq!(
        (pair.b.recv_cq[0].wr_id, pair.b.recv_cq[0].byte_len),
        (7, 4)
    );
    assert_eq!(pair.b.mem.get(rb.addr, 4), b"late");
}

#[test]
fn rnr_retries_exhausted() {
    let params = Params {
        rnr_retry: 2,
        ..Params::default()
    };
    let mut pair = Pair::new(6, params);
    // A zero-latency link: only the RNR timer can move the clock.
    pair.ab.latency = Duration::ZERO;
    pair.ba.latency = Duration::ZERO;
    let (ra, _) = pair.regions(4096);
    pair.a
        .qp
        .post_send(&pair.a.mem, wr(1, SendOp::Send, vec![sge(ra, 0, 4)]), None)
        .unwrap();
    let t0 = pair.now;
    pair.drive();
    assert_eq!(pair.a.send_cq[0].status, WcStatus::RnrRetryExcErr);
    assert_eq!(pair.ab.log.len(), 3, "one SEND and rnr_retry retries");
    // Each retry waited the responder's RNR timer (code 1 = 10 µs).
    assert!(pair.now - t0 >= Duration::from_micros(20));
    assert_eq!(pair.a.qp.state(), QpState::Err);
}

#[test]
fn psn_gap_gets_one_nak_and_go_back_n() {
    let mut pair = Pair::new(7, Params::default());
    let (ra, rb) = pair.regions(8192);
    let data = pattern(1, 2000);
    pair.a.mem.put(ra.addr, &data);
    // Drop the second packet of an 8-packet WRITE: the rest arrive out of sequence.
    pair.ab.drop_if = Some(Box::new(|i, _| i == 1));
    pair.a
        .qp
        .post_send(
            &pair.a.mem,
            wr(1, SendOp::Write(remote(rb, 0)), vec![sge(ra, 0, 2000)]),
            None,
        )
        .unwrap();
    pair.drive();
    assert_eq!(pair.a.send_cq[0].status, WcStatus::Success);
    assert_eq!(pair.b.mem.get(rb.addr, 2000), data);
    let naks: Vec<&Vec<u8>> = pair
        .ba
        .log
        .iter()
        .filter(|p| p.len() >= 13 && p[12] >> 5 == 0b011)
        .collect();
    assert_eq!(naks.len(), 1, "one PSN sequence NAK for the gap");
}

#[test]
fn write_then_send_is_seen_in_order_and_fence_waits_for_read() {
    let params = Params {
        max_rd_atomic: 1,
        ..Params::default()
    };
    let mut pair = Pair::new(8, params);
    let (ra, rb) = pair.regions(8192);
    pair.b.mem.put(rb.addr + 4096, &pattern(2, 1000));
    pair.b
        .qp
        .post_recv(
            &pair.b.mem,
            RecvWr {
                wr_id: 1,
                sges: [sge(rb, 2048, 64)].try_into().unwrap(),
            },
        )
        .unwrap();
    pair.a.mem.put(ra.addr, &pattern(3, 1000));
    let read = wr(
        10,
        SendOp::Read(remote(rb, 4096)),
        vec![sge(ra, 4096, 1000)],
    );
    let write = wr(11, SendOp::Write(remote(rb, 0)), vec![sge(ra, 0, 1000)]);
    let mut send = wr(12, SendOp::Send, vec![sge(ra, 0, 16)]);
    send.flags |= SendFlags::FENCE;
    for w in [read, write, send] {
        pair.a.qp.post_send(&pair.a.mem, w, None).unwrap();
    }
    pair.drive();
    let ids: Vec<u64> = pair.a.send_cq.iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, vec![10, 11, 12], "completions in posting order");
    assert!(pair.a.send_cq.iter().all(|c| c.status == WcStatus::Success));
    assert_eq!(pair.a.mem.get(ra.addr + 4096, 1000), pattern(2, 1000));
    assert_eq!(pair.b.mem.get(rb.addr, 1000), pattern(3, 1000));
    // FENCE: the SEND (opcode 0x04) left only after the READ's last response arrived,
    // i.e. after every READ response was generated by B.
    let send_at = pair.ab.log.iter().position(|p| p[0] == 0x04).unwrap();
    let write_at = pair.ab.log.iter().position(|p| p[0] == 0x06).unwrap();
    assert!(send_at > write_at);
    assert_eq!(pair.b.recv_cq[0].opcode, WcOpcode::Recv);
}

#[test]
fn max_rd_atomic_bounds_reads_in_flight() {
    let params = Params {
        max_rd_atomic: 2,
        ..Params::default()
    };
    let mut pair = Pair::new(10, params);
    let (ra, rb) = pair.regions(8192);
    // Hold B's answers until A has had every chance to send.
    pair.ab.latency = Duration::from_millis(1);
    for i in 0..6 {
        pair.a
            .qp
            .post_send(
                &pair.a.mem,
                wr(i, SendOp::Read(remote(rb, 0)), vec![sge(ra, i * 8, 8)]),
                None,
            )
            .unwrap();
    }
    assert!(pair.a.qp.poll_transmit(pair.now, &pair.a.mem).is_some());
    assert!(pair.a.qp.poll_transmit(pair.now, &pair.a.mem).is_some());
    assert!(
        pair.a.qp.poll_transmit(pair.now, &pair.a.mem).is_none(),
        "a third READ went out"
    );
}

#[test]
fn remote_errors_leave_target_unchanged_and_flush() {
    let mut pair = Pair::new(11, Params::default());
    let (ra, rb) = pair.regions(4096);
    let readonly = pair.b.mem.register(64, Access::REMOTE_READ);
    pair.b.mem.put(rb.addr, &[0xee; 64]);
    let bad = RemoteAddr {
        addr: rb.addr,
        rkey: rb.rkey ^ 0x100,
    };
    pair.a
        .qp
        .post_send(
            &pair.a.mem,
            wr(1, SendOp::Write(bad), vec![sge(ra, 0, 64)]),
            None,
        )
        .unwrap();
    pair.a
        .qp
        .post_send(
            &pair.a.mem,
            wr(2, SendOp::Write(remote(readonly, 0)), vec![sge(ra, 0, 8)]),
            None,
        )
        .unwrap();
    pair.drive();
    let st: Vec<WcStatus> = pair.a.send_cq.iter().map(|c| c.status).collect();
    assert_eq!(st, vec![WcStatus::RemAccessErr, WcStatus::WrFlushErr]);
    assert_eq!(pair.b.mem.get(rb.addr, 64), vec![0xee; 64]);
    assert_eq!(pair.a.qp.state(), QpState::Err);
}

#[test]
fn misaligned_atomic_is_refused_at_post() {
    let mut pair = Pair::new(12, Params::default());
    let (ra, rb) = pair.regions(64);
    let res = pair.a.qp.post_send(
        &pair.a.mem,
        wr(
            1,
            SendOp::FetchAdd {
                remote: remote(rb, 4),
                add: 1,
            },
            vec![sge(ra, 0, 8)],
        ),
        None,
    );
    assert!(matches!(res, Err(PostError::Invalid(_))), "{res:?}");
    pair.drive();
    assert!(pair.a.send_cq.is_empty());
    assert_eq!(pair.b.mem.get(rb.addr, 16), vec![0; 16]);
    assert_eq!(pair.a.qp.state(), QpState::Rts);
}

#[test]
fn local_checks_at_post() {
    let params = Params {
        sq_depth: 2,
        ..Params::default()
    };
    let mut pair = Pair::new(13, params);
    let (ra, rb) = pair.regions(64);
    let mut bad = sge(ra, 0, 8);
    bad.lkey ^= 0x100;
    // Hold everything on the wire so the queue fills.
    pair.ab.latency = Duration::from_millis(5);
    let w = |i| wr(i, SendOp::Write(remote(rb, 0)), vec![sge(ra, 0, 8)]);
    pair.a.qp.post_send(&pair.a.mem, w(1), None).unwrap();
    pair.a.qp.post_send(&pair.a.mem, w(2), None).unwrap();
    assert!(matches!(
        pair.a.qp.post_send(&pair.a.mem, w(3), None),
        Err(PostError::QueueFull { depth: 2 })
    ));
    pair.drive();
    pair.a
        .qp
        .post_send(
            &pair.a.mem,
            wr(4, SendOp::Write(remote(rb, 0)), vec![bad]),
            None,
        )
        .unwrap();
    pair.drive();
    assert_eq!(
        pair.a.send_cq.last().map(|c| (c.wr_id, c.status)),
        Some((4, WcStatus::LocProtErr))
    );
    assert_eq!(pair.a.qp.state(), QpState::Err);
}

#[test]
fn unsignaled_requests_complete_silently_and_errors_always_report() {
    let mut pair = Pair::new(14, Params::default());
    let (ra, rb) = pair.regions(64);
    for i in 0..5 {
        let mut w = wr(i, SendOp::Write(remote(rb, 0)), vec![sge(ra, 0, 8)]);
        if i != 4 {
            w.flags = SendFlags::empty();
        }
        pair.a.qp.post_send(&pair.a.mem, w, None).unwrap();
    }
    pair.drive();
    assert_eq!(
        pair.a.send_cq.iter().map(|c| c.wr_id).collect::<Vec<_>>(),
        vec![4]
    );
    assert_eq!(
        pair.a.qp.outstanding().0,
        0,
        "unsignaled requests freed their slots"
    );
    let mut w = wr(
        5,
        SendOp::Write(RemoteAddr {
            addr: rb.addr,
            rkey: 0,
        }),
        vec![sge(ra, 0, 8)],
    );
    w.flags = SendFlags::empty();
    pair.a.qp.post_send(&pair.a.mem, w, None).unwrap();
    pair.drive();
    assert_eq!(
        pair.a.send_cq.last().map(|c| (c.wr_id, c.status)),
        Some((5, WcStatus::RemAccessErr))
    );
}

#[test]
fn acks_carry_receive_credits() {
    let mut pair = Pair::new(15, Params::default());
    let (ra, rb) = pair.regions(4096);
    for i in 0..5 {
        pair.b
            .qp
            .post_recv(
                &pair.b.mem,
                RecvWr {
                    wr_id: i,
                    sges: [sge(rb, 0, 64)].try_into().unwrap(),
                },
            )
            .unwrap();
    }
    pair.a
        .qp
        .post_send(&pair.a.mem, wr(1, SendOp::Send, vec![sge(ra, 0, 8)]), None)
        .unwrap();
    pair.drive();
    let ack = pair.ba.log.last().unwrap();
    let repr = rdmx_wire::RcRepr::parse_bytes(ack).unwrap();
    match repr.aeth.unwrap().syndrome {
        rdmx_wire::Syndrome::Ack { credits } => assert_eq!(credits.count(), Some(4)),
        other => panic!("expected an ACK, got {other:?}"),
    }
}

#[test]
fn sq_drain_finishes_the_started_message_and_starts_nothing_new() {
    use rdmx_core::{QpAttr, QpAttrMask};
    let mut pair = Pair::new(16, Params::default());
    let (ra, rb) = pair.regions(8192);
    let data = pattern(4, 3000);
    pair.a.mem.put(ra.addr, &data);
    pair.a
        .qp
        .post_send(
            &pair.a.mem,
            wr(1, SendOp::Write(remote(rb, 0)), vec![sge(ra, 0, 3000)]),
            None,
        )
        .unwrap();
    pair.a
        .qp
        .post_send(
            &pair.a.mem,
            wr(2, SendOp::Write(remote(rb, 4096)), vec![sge(ra, 0, 8)]),
            None,
        )
        .unwrap();
    // Two of the first WRITE's 12 packets go out, then the SQ is drained.
    let first = pair.a.qp.poll_transmit(pair.now, &pair.a.mem).unwrap();
    let second = pair.a.qp.poll_transmit(pair.now, &pair.a.mem).unwrap();
    let sqd = QpAttr {
        qp_state: QpState::Sqd,
        ..QpAttr::default()
    };
    pair.a.qp.modify(&sqd, QpAttrMask::STATE).unwrap();
    pair.b.qp.handle_packet(pair.now, &pair.b.mem, &first);
    pair.b.qp.handle_packet(pair.now, &pair.b.mem, &second);
    pair.drive();
    let ids: Vec<u64> = pair.a.send_cq.iter().map(|c| c.wr_id).collect();
    assert_eq!(
        ids,
        vec![1],
        "the started WRITE finished, the second did not start"
    );
    assert_eq!(pair.b.mem.get(rb.addr, 3000), data);
    let rts = QpAttr {
        qp_state: QpState::Rts,
        ..QpAttr::default()
    };
    pair.a.qp.modify(&rts, QpAttrMask::STATE).unwrap();
    pair.drive();
    assert_eq!(pair.a.send_cq.last().map(|c| c.wr_id), Some(2));
}

#[test]
fn reads_beyond_the_responder_resources_are_invalid_requests() {
    // A requester allowed 4 READs in flight against a responder that agreed to 1.
    let params = Params {
        max_rd_atomic: 4,
        max_dest_rd_atomic: 1,
        ..Params::default()
    };
    let mut pair = Pair::new(17, params);
    let (ra, rb) = pair.regions(8192);
    pair.b.mem.put(rb.addr, &pattern(5, 4000));
    for i in 0..2 {
        let w = wr(
            i,
            SendOp::Read(remote(rb, 0)),
            vec![sge(ra, i * 4096, 4000)],
        );
        pair.a.qp.post_send(&pair.a.mem, w, None).unwrap();
    }
    pair.drive();
    let st: Vec<WcStatus> = pair.a.send_cq.iter().map(|c| c.status).collect();
    assert_eq!(st, vec![WcStatus::Success, WcStatus::RemInvReqErr]);
    assert_eq!(pair.a.mem.get(ra.addr, 4000), pattern(5, 4000));
}
