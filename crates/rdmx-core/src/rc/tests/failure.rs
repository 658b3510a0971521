//! Failures: retries and RNR retries exhausted, remote errors, local errors, and posts
//! refused on the spot.

use std::time::Duration;

use rdmx_wire::{NakCode, Opcode, RnrTimer, Syndrome};

use super::util::*;
use crate::access::Access;
use crate::qp::QpState;
use crate::wr::{PostError, SendFlags, SendOp, WcOpcode, WcStatus};

fn ack_timeout(p: &Pair) -> Duration {
    crate::qp::timeout_duration(p.cfg.timeout).unwrap()
}

// ---------------------------------------------------------------------------------------
// Retry exhaustion
// ---------------------------------------------------------------------------------------

/// Takes A's link to B down, then posts on A a receive (id 50), a SEND (1) and a WRITE
/// (2) to B; returns A's region and B's.
fn receive_send_and_write_on_a_dead_link(p: &mut Pair) -> (Region, Region) {
    let buf = p.a.mem.register(4096, ALL);
    let remote = p.b.mem.register(4096, ALL);
    p.a.recv(50, vec![buf.sge(3000, 100)]).unwrap();
    p.ab.down = true;
    p.a.post(wr(1, SendOp::Send, vec![buf.sge(0, 600)]))
        .unwrap();
    p.a.post(wr(
        2,
        SendOp::Write(remote.remote(0)),
        vec![buf.sge(0, 100)],
    ))
    .unwrap();
    (buf, remote)
}

#[test]
fn link_down_gives_retry_exc_err_after_retry_cnt_retries_then_flush() {
    for retry_cnt in [0u8, 1, 3, 7] {
        let mut p = Pair::with(PairConfig {
            retry_cnt,
            ..PairConfig::default()
        });
        let t = ack_timeout(&p);
        let (buf, remote) = receive_send_and_write_on_a_dead_link(&mut p);
        p.a.post(wr(
            3,
            SendOp::Read(remote.remote(0)),
            vec![buf.sge(1000, 100)],
        ))
        .unwrap();
        p.drive();

        let ctx = format!("retry_cnt {retry_cnt}");
        assert_eq!(
            p.a.sends(),
            vec![
                (1, WcStatus::RetryExcErr),
                (2, WcStatus::WrFlushErr),
                (3, WcStatus::WrFlushErr)
            ],
            "{ctx}"
        );
        assert_eq!(p.a.send_cq[0].c.opcode, WcOpcode::Send, "{ctx}");
        assert_eq!(p.a.send_cq[2].c.opcode, WcOpcode::RdmaRead, "{ctx}");
        assert_eq!(p.a.recvs(), vec![(50, WcStatus::WrFlushErr)], "{ctx}");
        assert_eq!(p.a.qp.state(), QpState::Err, "{ctx}");
        assert_eq!(p.b.qp.state(), QpState::Rts, "{ctx}: B never heard of it");
        // The first packet went out once and was retransmitted retry_cnt times.
        let first = p.cfg.sq_psn_a;
        let n = p.ab.sent().filter(|x| x.psn == first).count();
        assert_eq!(n, usize::from(retry_cnt) + 1, "{ctx}");
        // Each attempt waited a full timeout.
        let at = p.a.send_cq[0].at - p.epoch;
        assert!(
            at >= t * (u32::from(retry_cnt) + 1),
            "{ctx}: failed at {at:?}"
        );
        assert!(
            at < t * (u32::from(retry_cnt) + 2),
            "{ctx}: failed at {at:?}"
        );
        assert_eq!(p.a.qp.poll_timeout(), None, "{ctx}");

        // Later posts are accepted and flushed.
        p.a.post(wr(4, SendOp::Send, vec![buf.sge(0, 10)])).unwrap();
        p.a.recv(51, vec![buf.sge(3000, 10)]).unwrap();
        let sent = p.ab.sent().count();
        p.drive();
        assert_eq!(p.a.send_cq.last().unwrap().c.wr_id, 4, "{ctx}");
        assert_eq!(
            p.a.send_cq.last().unwrap().c.status,
            WcStatus::WrFlushErr,
            "{ctx}"
        );
        assert_eq!(
            p.a.recvs().last(),
            Some(&(51, WcStatus::WrFlushErr)),
            "{ctx}"
        );
        assert_eq!(p.ab.sent().count(), sent, "{ctx}: nothing sent in ERR");
    }
}

#[test]
fn on_a_reliable_link_an_expired_timer_retransmits_nothing_but_still_ends_in_retry_exc_err() {
    let mut p = Pair::with(PairConfig {
        retry_cnt: 3,
        reliable_link: true,
        ..PairConfig::default()
    });
    let t = ack_timeout(&p);
    let buf = p.a.mem.register(4096, ALL);
    let remote = p.b.mem.register(4096, ALL);
    p.ab.down = true;
    p.a.post(wr(
        1,
        SendOp::Write(remote.remote(0)),
        vec![buf.sge(0, 1000)],
    ))
    .unwrap();
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::RetryExcErr)]);
    let first = p.cfg.sq_psn_a;
    assert_eq!(p.ab.sent().filter(|x| x.psn == first).count(), 1);
    let at = p.a.send_cq[0].at - p.epoch;
    assert!(at >= t * 4 && at < t * 5, "failed at {at:?}");
}

#[test]
fn a_floor_on_the_ack_timeout_holds_over_a_shorter_timeout_attribute() {
    let floor = Duration::from_millis(500);
    let mut p = Pair::with(PairConfig {
        retry_cnt: 3,
        reliable_link: true,
        min_ack_timeout: floor,
        ..PairConfig::default()
    });
    assert!(
        ack_timeout(&p) < floor / 10,
        "the attribute's timeout is short"
    );
    let buf = p.a.mem.register(4096, ALL);
    let remote = p.b.mem.register(4096, ALL);
    p.ab.down = true;
    p.a.post(wr(
        1,
        SendOp::Write(remote.remote(0)),
        vec![buf.sge(0, 1000)],
    ))
    .unwrap();
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::RetryExcErr)]);
    let at = p.a.send_cq[0].at - p.epoch;
    assert!(at >= floor * 4 && at < floor * 5, "failed at {at:?}");
}

#[test]
fn on_a_reliable_link_a_peer_slower_than_one_timeout_is_waited_for_without_duplicates() {
    let mut p = Pair::with(PairConfig {
        retry_cnt: 3,
        reliable_link: true,
        ..PairConfig::default()
    });
    let t = ack_timeout(&p);
    // Each way takes more than one ack timeout; the round trip stays within the budget.
    p.ab.latency = t + t / 4;
    p.ba.latency = t + t / 4;
    let src = p.a.mem.register(2000, ALL);
    p.a.mem.fill(src.addr, &pattern(7, 2000));
    let dst = p.b.mem.register(2000, ALL);
    p.a.post(wr(1, SendOp::Write(dst.remote(0)), vec![src.sge(0, 2000)]))
        .unwrap();
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)]);
    assert_eq!(p.b.mem.bytes(dst.addr, 2000), pattern(7, 2000));
    let psns: Vec<u32> = p.ab.sent().map(|x| x.psn).collect();
    let mut unique = psns.clone();
    unique.dedup();
    assert_eq!(psns, unique, "a packet was sent twice");

    // Without the flag the same peer costs retransmissions.
    let mut q = Pair::with(PairConfig {
        retry_cnt: 3,
        ..PairConfig::default()
    });
    q.ab.latency = t + t / 4;
    q.ba.latency = t + t / 4;
    let src = q.a.mem.register(2000, ALL);
    let dst = q.b.mem.register(2000, ALL);
    q.a.post(wr(1, SendOp::Write(dst.remote(0)), vec![src.sge(0, 2000)]))
        .unwrap();
    q.drive();
    assert!(q.ab.sent().count() > psns.len());
}

#[test]
fn acks_lost_forever_deliver_the_send_once_then_retry_exc_err() {
    let mut p = Pair::with(PairConfig {
        retry_cnt: 3,
        ..PairConfig::default()
    });
    let src = p.a.mem.register(300, ALL);
    p.a.mem.fill(src.addr, &pattern(1, 300));
    let dst = p.b.mem.register(600, ALL);
    p.b.recv(1, vec![dst.sge(0, 300)]).unwrap();
    p.b.recv(2, vec![dst.sge(300, 300)]).unwrap();
    p.ba.down = true;
    p.a.post(wr(1, SendOp::Send, vec![src.sge(0, 300)]))
        .unwrap();
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::RetryExcErr)]);
    assert_eq!(p.b.recvs(), vec![(1, WcStatus::Success)]);
    assert_eq!(p.b.qp.outstanding().1, 1, "duplicates consumed nothing");
    assert_eq!(p.b.mem.bytes(dst.addr, 300), pattern(1, 300));
    assert_eq!(p.b.mem.bytes(dst.addr + 300, 300), vec![0; 300]);
    // Two packets per attempt, four attempts.
    assert_eq!(p.ab.sent().count(), 8);
}

#[test]
fn retry_count_restarts_after_progress() {
    // retry_cnt 1, and every request needs one retransmission: each makes progress, so
    // none of them exhausts the count.
    let mut p = Pair::with(PairConfig {
        retry_cnt: 1,
        ..PairConfig::default()
    });
    let src = p.a.mem.register(64, ALL);
    let dst = p.b.mem.register(64 * 8, ALL);
    let mut dropped = std::collections::HashSet::new();
    p.ab.set_filter(move |x| dropped.insert(x.psn).then_some(Fate::Drop));
    for i in 0..8u64 {
        p.a.post(wr(
            i,
            SendOp::Write(dst.remote(64 * i)),
            vec![src.sge(0, 64)],
        ))
        .unwrap();
        p.drive();
    }
    let expect: Vec<_> = (0..8).map(|i| (i, WcStatus::Success)).collect();
    assert_eq!(p.a.sends(), expect);
}

// ---------------------------------------------------------------------------------------
// RNR
// ---------------------------------------------------------------------------------------

#[test]
fn rnr_nak_then_wait_then_success_once_a_receive_is_posted() {
    let mut p = Pair::with(PairConfig {
        min_rnr_timer: 14,
        rnr_retry: 6,
        ..PairConfig::default()
    });
    let rnr = RnrTimer::from_code(14).unwrap().to_duration();
    let src = p.a.mem.register(600, ALL);
    p.a.mem.fill(src.addr, &pattern(2, 600));
    let dst = p.b.mem.register(600, ALL);
    p.a.post(wr(1, SendOp::Send, vec![src.sge(0, 600)]))
        .unwrap();
    p.drive_for(rnr * 4);
    assert!(p.a.send_cq.is_empty());
    let naks: Vec<_> = p.ba.sent().filter(|x| x.is_rnr_nak()).cloned().collect();
    assert!(naks.len() >= 2, "{} RNR NAKs", naks.len());
    for n in &naks {
        assert_eq!(n.syndrome.map(|s| s.to_byte() & 0x1f), Some(14));
        assert_eq!(n.psn, p.cfg.sq_psn_a);
    }
    // Every resend of the first packet waited the RNR timer after the NAK arrived.
    let starts: Vec<_> =
        p.ab.sent()
            .filter(|x| x.psn == p.cfg.sq_psn_a)
            .map(|x| x.at)
            .collect();
    for (i, nak) in naks.iter().enumerate() {
        let arrival = nak.at + p.ba.latency;
        let next = starts.get(i + 1).copied();
        if let Some(next) = next {
            assert!(
                next >= arrival + rnr,
                "resend {} came {:?} after the NAK arrived",
                i + 1,
                next - arrival
            );
        }
    }
    // The second packet of the message is not sent before the first is accepted: the
    // requester went back to the message's start each time.
    p.b.recv(9, vec![dst.sge(0, 600)]).unwrap();
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)]);
    assert_eq!(p.b.recvs(), vec![(9, WcStatus::Success)]);
    assert_eq!(p.b.mem.bytes(dst.addr, 600), pattern(2, 600));
    assert_eq!(p.a.qp.state(), QpState::Rts);
}

#[test]
fn rnr_retry_exhausted_gives_rnr_retry_exc_err() {
    for rnr_retry in [0u8, 1, 2, 6] {
        let mut p = Pair::with(PairConfig {
            rnr_retry,
            ..PairConfig::default()
        });
        let src = p.a.mem.register(64, ALL);
        let remote = p.b.mem.register(64, ALL);
        p.a.post(wr(1, SendOp::Send, vec![src.sge(0, 64)])).unwrap();
        p.a.post(wr(2, SendOp::Write(remote.remote(0)), vec![src.sge(0, 8)]))
            .unwrap();
        p.drive();
        let ctx = format!("rnr_retry {rnr_retry}");
        assert_eq!(
            p.a.sends(),
            vec![(1, WcStatus::RnrRetryExcErr), (2, WcStatus::WrFlushErr)],
            "{ctx}"
        );
        assert_eq!(p.a.qp.state(), QpState::Err, "{ctx}");
        let attempts =
            p.ab.sent()
                .filter(|x| x.psn == p.cfg.sq_psn_a && x.is_send())
                .count();
        assert_eq!(attempts, usize::from(rnr_retry) + 1, "{ctx}");
        assert_eq!(
            p.ba.sent().filter(|x| x.is_rnr_nak()).count(),
            usize::from(rnr_retry) + 1,
            "{ctx}"
        );
        assert_eq!(p.b.mem.bytes(remote.addr, 8), vec![0; 8], "{ctx}");
    }
}

#[test]
fn rnr_retry_7_retries_forever() {
    let mut p = Pair::with(PairConfig {
        rnr_retry: 7,
        min_rnr_timer: 1,
        ..PairConfig::default()
    });
    let src = p.a.mem.register(64, ALL);
    let dst = p.b.mem.register(64, ALL);
    p.a.post(wr(1, SendOp::SendWithImm(3), vec![src.sge(0, 64)]))
        .unwrap();
    p.drive_for(Duration::from_millis(50));
    let naks = p.ba.sent().filter(|x| x.is_rnr_nak()).count();
    assert!(naks > 100, "{naks} RNR NAKs");
    assert!(p.a.send_cq.is_empty());
    assert_eq!(p.a.qp.state(), QpState::Rts);
    p.b.recv(4, vec![dst.sge(0, 64)]).unwrap();
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)]);
    assert_eq!(p.b.recv_cq[0].c.imm_data, Some(3));
}

#[test]
fn write_with_imm_without_a_receive_is_rnr_exhausted() {
    let mut p = Pair::with(PairConfig {
        rnr_retry: 1,
        ..PairConfig::default()
    });
    let src = p.a.mem.register(64, ALL);
    let dst = p.b.mem.register(64, ALL);
    p.a.post(wr(
        1,
        SendOp::WriteWithImm(dst.remote(0), 5),
        vec![src.sge(0, 64)],
    ))
    .unwrap();
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::RnrRetryExcErr)]);
    assert!(p.b.recv_cq.is_empty());
}

// ---------------------------------------------------------------------------------------
// Remote errors
// ---------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq)]
enum Bad {
    /// An rkey that names no region (a deregistered one).
    StaleKey,
    /// An rkey with a wrong variant.
    WrongVariant,
    /// Past the region's end.
    OutOfBounds,
    /// The region lacks the access.
    RegionAccess,
    /// The region is in another protection domain.
    OtherPd,
    /// The responder QP lacks the access.
    QpAccess,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Write,
    WriteImm,
    Read,
    Faa,
    Cas,
}

impl Kind {
    fn need(self) -> Access {
        match self {
            Kind::Write | Kind::WriteImm => Access::REMOTE_WRITE,
            Kind::Read => Access::REMOTE_READ,
            Kind::Faa | Kind::Cas => Access::REMOTE_ATOMIC,
        }
    }
}

#[test]
fn remote_access_errors_leave_the_target_unchanged_and_fail_the_qp() {
    use Bad::*;
    for kind in [
        Kind::Write,
        Kind::WriteImm,
        Kind::Read,
        Kind::Faa,
        Kind::Cas,
    ] {
        for bad in [
            StaleKey,
            WrongVariant,
            OutOfBounds,
            RegionAccess,
            OtherPd,
            QpAccess,
        ] {
            let all_remote = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
            let mut p = Pair::with(PairConfig {
                access: if bad == QpAccess {
                    all_remote.difference(kind.need())
                } else {
                    all_remote
                },
                ..PairConfig::default()
            });
            let len = 600u32; // 3 packets for WRITE and READ
            let region_access = if bad == RegionAccess {
                // Keep some remote access so there is an rkey at all.
                let other = if kind.need() == Access::REMOTE_READ {
                    Access::REMOTE_WRITE
                } else {
                    Access::REMOTE_READ
                };
                Access::LOCAL_WRITE | other
            } else {
                ALL
            };
            let target = if bad == OtherPd {
                p.b.mem.register_in(OTHER_PD, 1024, ALL)
            } else {
                p.b.mem.register(1024, region_access)
            };
            let before = pattern(40, 1024);
            p.b.mem.fill(target.addr, &before);
            let mut remote = target.remote(if bad == OutOfBounds {
                if matches!(kind, Kind::Faa | Kind::Cas) {
                    1024
                } else {
                    1024 - 512
                }
            } else {
                8
            });
            match bad {
                StaleKey => p.b.mem.deregister(&target),
                WrongVariant => remote.rkey ^= 0x5a,
                _ => {}
            }
            let local = p.a.mem.register(1024, ALL);
            p.a.mem.fill(local.addr, &pattern(41, 1024));
            let spare = p.b.mem.register(8, ALL);
            p.b.recv(70, vec![spare.sge(0, 8)]).unwrap();
            p.a.recv(60, vec![local.sge(0, 8)]).unwrap();
            let op = match kind {
                Kind::Write => SendOp::Write(remote),
                Kind::WriteImm => SendOp::WriteWithImm(remote, 1),
                Kind::Read => SendOp::Read(remote),
                Kind::Faa => SendOp::FetchAdd { remote, add: 1 },
                Kind::Cas => SendOp::CompareSwap {
                    remote,
                    compare: 0,
                    swap: 1,
                },
            };
            let n = if matches!(kind, Kind::Faa | Kind::Cas) {
                8
            } else {
                len
            };
            p.a.post(wr(1, op, vec![local.sge(0, n)])).unwrap();
            p.a.post(wr(2, SendOp::Send, vec![local.sge(0, 8)]))
                .unwrap();
            p.drive();

            let ctx = format!("{kind:?} with {bad:?}");
            assert_eq!(
                p.a.sends(),
                vec![(1, WcStatus::RemAccessErr), (2, WcStatus::WrFlushErr)],
                "{ctx}"
            );
            assert_eq!(p.a.recvs(), vec![(60, WcStatus::WrFlushErr)], "{ctx}");
            assert_eq!(p.a.qp.state(), QpState::Err, "{ctx}");
            assert_eq!(p.b.mem.bytes(target.addr, 1024), before, "{ctx}: target");
            assert_eq!(p.b.mem.atomics.get(), 0, "{ctx}");
            if kind == Kind::Read {
                assert_eq!(
                    p.a.mem.bytes(local.addr, 1024),
                    pattern(41, 1024),
                    "{ctx}: nothing read"
                );
            }
            let naks: Vec<_> = p.ba.sent().filter(|x| x.is_nak()).collect();
            assert_eq!(naks.len(), 1, "{ctx}");
            assert_eq!(
                naks[0].syndrome,
                Some(Syndrome::Nak(NakCode::RemoteAccessError)),
                "{ctx}"
            );
            // The responder reports the violation by failing its QP too (IBTA class C
            // responder error, as rxe and adapters do); its receive is flushed.
            assert_eq!(p.b.qp.state(), QpState::Err, "{ctx}: responder");
            assert_eq!(p.b.recvs(), vec![(70, WcStatus::WrFlushErr)], "{ctx}");
        }
    }
}

#[test]
fn misaligned_atomic_is_refused_at_post() {
    // Refused on the spot, as Soft-RoCE does; the QP stays usable and nothing is sent.
    // (A peer that sends one anyway gets a NAK: see flood.rs.)
    for off in [1u64, 4, 7, 12] {
        let mut p = Pair::new();
        let target = p.b.mem.register(64, ALL);
        p.b.mem.fill(target.addr, &pattern(50, 64));
        let local = p.a.mem.register(8, ALL);
        let misaligned = [
            SendOp::FetchAdd {
                remote: target.remote(off),
                add: 1,
            },
            SendOp::CompareSwap {
                remote: target.remote(off),
                compare: 0,
                swap: 1,
            },
        ];
        for op in misaligned {
            assert!(
                matches!(
                    p.a.post(wr(1, op, vec![local.sge(0, 8)])),
                    Err(PostError::Invalid(_))
                ),
                "offset {off}: {op:?}"
            );
        }
        p.a.post(wr(
            2,
            SendOp::FetchAdd {
                remote: target.remote(16),
                add: 1,
            },
            vec![local.sge(0, 8)],
        ))
        .unwrap();
        p.drive();
        assert_eq!(p.a.sends(), vec![(2, WcStatus::Success)], "offset {off}");
        let mut want = pattern(50, 64);
        let old = u64::from_le_bytes(want[16..24].try_into().unwrap());
        want[16..24].copy_from_slice(&(old.wrapping_add(1)).to_le_bytes());
        assert_eq!(p.b.mem.bytes(target.addr, 64), want, "offset {off}");
        assert_eq!(p.a.qp.state(), QpState::Rts, "offset {off}");
    }
}

/// A READ response or atomic acknowledgement whose AETH says NAK (which the responder
/// never sends: a refused READ or atomic gets an Acknowledge NAK) is a bad response, as
/// rxe takes it: the request completes with BAD_RESP_ERR, not with success.
#[test]
fn a_read_response_or_atomic_ack_with_a_nak_syndrome_is_a_bad_response() {
    fn nak_syndrome(b: &mut [u8]) {
        // The AETH follows the 12-byte BTH: NAK, remote access error.
        b[12] = 0x62;
    }
    for atomic in [false, true] {
        let mut p = Pair::new();
        let target = p.b.mem.register(64, ALL);
        let local = p.a.mem.register(64, ALL);
        let (op, len, answer) = match atomic {
            false => (
                SendOp::Read(target.remote(0)),
                64,
                Opcode::RdmaReadResponseOnly,
            ),
            true => (
                SendOp::FetchAdd {
                    remote: target.remote(0),
                    add: 1,
                },
                8,
                Opcode::AtomicAcknowledge,
            ),
        };
        p.ba.fate_matching(1, Fate::Altered(nak_syndrome), move |x| x.op == answer);
        p.a.post(wr(1, op, vec![local.sge(0, len)])).unwrap();
        p.drive();
        assert_eq!(
            p.a.sends(),
            vec![(1, WcStatus::BadRespErr)],
            "atomic {atomic}"
        );
        assert_eq!(p.a.qp.state(), QpState::Err, "atomic {atomic}");
    }
}

#[test]
fn send_larger_than_the_receive() {
    // One packet and several; the excess in the first packet or a later one.
    for (len, room) in [(150u32, 100u32), (600, 100), (600, 300), (600, 599)] {
        let mut p = Pair::new();
        let src = p.a.mem.register(u64::from(len), ALL);
        let dst = p.b.mem.register(u64::from(len), ALL);
        p.b.recv(1, vec![dst.sge(0, room)]).unwrap();
        p.b.recv(2, vec![dst.sge(0, room)]).unwrap();
        p.a.post(wr(1, SendOp::Send, vec![src.sge(0, len)]))
            .unwrap();
        p.a.post(wr(2, SendOp::Send, vec![src.sge(0, 1)])).unwrap();
        p.drive();
        let ctx = format!("{len} bytes into {room}");
        assert_eq!(
            p.a.sends(),
            vec![(1, WcStatus::RemInvReqErr), (2, WcStatus::WrFlushErr)],
            "{ctx}"
        );
        assert_eq!(
            p.b.recvs(),
            vec![(1, WcStatus::LocLenErr), (2, WcStatus::WrFlushErr)],
            "{ctx}"
        );
        assert_eq!(p.a.qp.state(), QpState::Err, "{ctx}");
        assert_eq!(p.b.qp.state(), QpState::Err, "{ctx}");
        // Nothing past the receive's room was written.
        assert_eq!(
            p.b.mem
                .bytes(dst.addr + u64::from(room), (len - room) as usize),
            vec![0; (len - room) as usize],
            "{ctx}"
        );
    }
}

#[test]
fn receive_with_a_bad_lkey_fails_when_a_send_arrives() {
    let mut p = Pair::new();
    let src = p.a.mem.register(64, ALL);
    let dst = p.b.mem.register(64, Access::empty());
    // Registered without LOCAL_WRITE: a receive cannot use it.
    p.b.recv(1, vec![dst.sge(0, 64)]).unwrap();
    p.a.post(wr(1, SendOp::Send, vec![src.sge(0, 64)])).unwrap();
    p.drive();
    assert_eq!(p.b.recvs(), vec![(1, WcStatus::LocProtErr)]);
    assert_eq!(p.a.sends(), vec![(1, WcStatus::RemOpErr)]);
    assert_eq!(p.a.qp.state(), QpState::Err);
    assert_eq!(p.b.qp.state(), QpState::Err);
}

/// The same receive consumed by a WRITE with immediate data: it fails, and both QPs go to
/// ERR, as for a SEND (before, the receive completed in error and the responder acknowledged
/// the WRITE and stayed in RTS, so the next one completed a later receive with success).
#[test]
fn receive_with_a_bad_lkey_fails_when_a_write_with_imm_arrives() {
    let mut p = Pair::new();
    let src = p.a.mem.register(64, ALL);
    let dst = p.b.mem.register(64, ALL);
    let closed = p.b.mem.register(64, Access::empty());
    p.b.recv(1, vec![closed.sge(0, 64)]).unwrap();
    p.b.recv(2, vec![]).unwrap();
    for id in [1, 2] {
        p.a.post(wr(
            id,
            SendOp::WriteWithImm(dst.remote(0), 7),
            vec![src.sge(0, 64)],
        ))
        .unwrap();
    }
    p.drive();
    assert_eq!(
        p.b.recvs(),
        vec![(1, WcStatus::LocProtErr), (2, WcStatus::WrFlushErr)]
    );
    assert_eq!(
        p.a.sends(),
        vec![(1, WcStatus::RemOpErr), (2, WcStatus::WrFlushErr)]
    );
    assert_eq!(p.a.qp.state(), QpState::Err);
    assert_eq!(p.b.qp.state(), QpState::Err);
    assert_eq!(p.b.mem.bytes(dst.addr, 64), vec![0; 64], "the WRITE landed");
}

// ---------------------------------------------------------------------------------------
// Local errors
// ---------------------------------------------------------------------------------------

#[test]
fn bad_lkey_at_post_gives_loc_prot_err_in_turn() {
    let mut p = Pair::new();
    let good = p.a.mem.register(256, ALL);
    let remote = p.b.mem.register(256, ALL);
    let bad = crate::wr::Sge {
        lkey: good.lkey ^ 0x33,
        ..good.sge(0, 16)
    };
    // A good WRITE in flight, then the bad SEND, then a good one behind it.
    p.a.post(wr(
        1,
        SendOp::Write(remote.remote(0)),
        vec![good.sge(0, 200)],
    ))
    .unwrap();
    p.a.post(wr(2, SendOp::Send, vec![good.sge(0, 8), bad]))
        .unwrap();
    p.a.post(wr(3, SendOp::Write(remote.remote(0)), vec![good.sge(0, 8)]))
        .unwrap();
    p.drive();
    assert_eq!(
        p.a.sends(),
        vec![
            (1, WcStatus::Success),
            (2, WcStatus::LocProtErr),
            (3, WcStatus::WrFlushErr)
        ]
    );
    assert_eq!(p.a.qp.state(), QpState::Err);
    assert_eq!(p.ab.sent().count(), 1, "only the first request went out");

    // A READ into memory without LOCAL_WRITE, out-of-bounds SGEs, a deregistered lkey.
    for case in 0..3 {
        let mut p = Pair::new();
        let remote = p.b.mem.register(256, ALL);
        let local = p.a.mem.register(256, ALL);
        let ro = p.a.mem.register(256, Access::REMOTE_READ);
        let sge = match case {
            0 => ro.sge(0, 8),
            1 => local.sge(250, 8),
            _ => {
                let gone = p.a.mem.register(256, ALL);
                p.a.mem.deregister(&gone);
                gone.sge(0, 8)
            }
        };
        p.a.post(wr(1, SendOp::Read(remote.remote(0)), vec![sge]))
            .unwrap();
        p.drive();
        assert_eq!(p.a.sends(), vec![(1, WcStatus::LocProtErr)], "case {case}");
        assert_eq!(p.ab.sent().count(), 0, "case {case}");
    }
}

#[test]
fn atomic_with_a_local_buffer_that_is_not_8_bytes() {
    for len in [4u32, 16] {
        let mut p = Pair::new();
        let remote = p.b.mem.register(64, ALL);
        let local = p.a.mem.register(64, ALL);
        p.a.post(wr(
            1,
            SendOp::FetchAdd {
                remote: remote.remote(0),
                add: 1,
            },
            vec![local.sge(0, len)],
        ))
        .unwrap();
        p.drive();
        assert_eq!(p.a.sends(), vec![(1, WcStatus::LocLenErr)]);
        assert_eq!(p.b.mem.atomics.get(), 0);
    }
}

#[test]
fn full_queues_refuse_posts() {
    let mut p = Pair::with(PairConfig {
        max_send_wr: 4,
        max_recv_wr: 3,
        ..PairConfig::default()
    });
    let buf = p.a.mem.register(64, ALL);
    p.ab.down = true;
    for i in 0..4 {
        p.a.post(wr(i, SendOp::Send, vec![buf.sge(0, 8)])).unwrap();
    }
    assert_eq!(
        p.a.post(wr(9, SendOp::Send, vec![buf.sge(0, 8)])),
        Err(PostError::QueueFull { depth: 4 })
    );
    for i in 0..3 {
        p.a.recv(i, vec![buf.sge(0, 8)]).unwrap();
    }
    assert_eq!(
        p.a.recv(9, vec![buf.sge(0, 8)]),
        Err(PostError::QueueFull { depth: 3 })
    );
    assert_eq!(p.a.qp.outstanding(), (4, 3));
    // Sending does not free a slot; completing does.
    p.drive_for(Duration::from_micros(100));
    assert!(p.a.post(wr(9, SendOp::Send, vec![buf.sge(0, 8)])).is_err());
}

#[test]
fn posts_in_the_wrong_state_are_refused() {
    let mut p = Pair::unconnected(PairConfig::default());
    let buf = p.a.mem.register(64, ALL);
    let send = || wr(1, SendOp::Send, vec![buf.sge(0, 8)]);
    assert_eq!(p.a.post(send()), Err(PostError::WrongState(QpState::Reset)));
    assert_eq!(
        p.a.recv(1, vec![buf.sge(0, 8)]),
        Err(PostError::WrongState(QpState::Reset))
    );
    to_init(&mut p.a.qp, ALL);
    assert_eq!(p.a.post(send()), Err(PostError::WrongState(QpState::Init)));
    p.a.recv(1, vec![buf.sge(0, 8)]).unwrap();
    let cfg = p.cfg.clone();
    to_rtr(&mut p.a.qp, &cfg, QPN_B, cfg.sq_psn_b);
    assert_eq!(p.a.post(send()), Err(PostError::WrongState(QpState::Rtr)));
    p.a.recv(2, vec![buf.sge(0, 8)]).unwrap();
    to_rts(&mut p.a.qp, &cfg, cfg.sq_psn_a);
    p.a.post(send()).unwrap();
    assert_eq!(p.a.qp.outstanding(), (1, 2));
}

#[test]
fn too_many_sges_and_bad_inline_are_refused() {
    let mut p = Pair::new();
    let buf = p.a.mem.register(64, ALL);
    let five: Vec<_> = (0..5).map(|i| buf.sge(i * 8, 8)).collect();
    assert_eq!(
        p.a.post(wr(1, SendOp::Send, five.clone())),
        Err(PostError::TooManySges { count: 5, max: 4 })
    );
    assert_eq!(
        p.a.recv(1, five),
        Err(PostError::TooManySges { count: 5, max: 4 })
    );
    assert_eq!(
        p.a.post_inline(
            wr_flags(1, SendOp::Send, vec![], SendFlags::INLINE),
            vec![0; 257]
        ),
        Err(PostError::InlineTooLarge { len: 257, max: 256 })
    );
    assert!(matches!(
        p.a.post_inline(wr(1, SendOp::Send, vec![]), vec![0; 8]),
        Err(PostError::Invalid(_))
    ));
    assert!(matches!(
        p.a.post_inline(
            wr_flags(1, SendOp::Read(buf.remote(0)), vec![], SendFlags::INLINE),
            vec![0; 8]
        ),
        Err(PostError::Invalid(_))
    ));
    assert_eq!(p.a.qp.outstanding(), (0, 0));
}

#[test]
fn retry_counts_changed_in_sqd_apply() {
    use crate::qp::{QpAttr, QpAttrMask};
    for rnr in [false, true] {
        let mut p = Pair::new();
        let to = |state| QpAttr {
            qp_state: state,
            ..QpAttr::default()
        };
        p.a.qp.modify(&to(QpState::Sqd), QpAttrMask::STATE).unwrap();
        let counts = QpAttr {
            retry_cnt: 1,
            rnr_retry: 1,
            ..to(QpState::Sqd)
        };
        p.a.qp
            .modify(&counts, QpAttrMask::RETRY_CNT | QpAttrMask::RNR_RETRY)
            .unwrap();
        p.a.qp.modify(&to(QpState::Rts), QpAttrMask::STATE).unwrap();
        assert_eq!(p.a.qp.attrs().retry_cnt, 1);
        let buf = p.a.mem.register(64, ALL);
        if !rnr {
            p.ab.down = true;
        }
        p.a.post(wr(1, SendOp::Send, vec![buf.sge(0, 8)])).unwrap();
        p.drive();
        let status = if rnr {
            WcStatus::RnrRetryExcErr
        } else {
            WcStatus::RetryExcErr
        };
        assert_eq!(p.a.sends(), vec![(1, status)], "rnr {rnr}");
        assert_eq!(p.ab.sent().count(), 2, "rnr {rnr}: one try and one retry");
    }
}

/// Posts WRITE 1 of `packets` packets (at a 256-byte MTU) of `pattern(seed, ..)` from A
/// into a region of B; returns where it lands and its length.
fn post_long_write(p: &mut Pair, packets: usize, seed: u64) -> (u64, usize) {
    let len = packets * 256;
    let src = p.a.mem.register(len as u64, ALL);
    p.a.mem.fill(src.addr, &pattern(seed, len));
    let dst = p.b.mem.register(len as u64, ALL);
    p.a.post(wr(
        1,
        SendOp::Write(dst.remote(0)),
        vec![src.sge(0, len as u32)],
    ))
    .unwrap();
    (dst.addr, len)
}

#[test]
fn a_send_window_holds_packets_until_acknowledgements_arrive() {
    let mut p = Pair::with(PairConfig {
        mtu: crate::Mtu::Mtu256,
        send_window: 8,
        ..PairConfig::default()
    });
    let lat = Duration::from_millis(1);
    p.ab.latency = lat;
    p.ba.latency = lat;
    let (dst, len) = post_long_write(&mut p, 64, 3);
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)]);
    assert_eq!(p.b.mem.bytes(dst, len), pattern(3, len));
    let sent: Vec<_> = p.ab.sent().collect();
    assert_eq!(sent.len(), 64, "each packet once");
    // The first window leaves at once; the next packet waits for an acknowledgement,
    // which takes a round trip.
    let first = sent[0].at;
    assert!(sent[7].at < first + lat, "the first window was held");
    assert!(
        sent[8].at >= first + 2 * lat,
        "a packet beyond the window left early"
    );
    // Acknowledgements are asked for every quarter window, inside the message too.
    assert!(sent[..63].iter().filter(|x| x.ack_req).count() >= 64 / 2 - 1);
}

/// A message longer than the send window, to a peer that stopped answering: its first
/// window goes, the rest waits for acknowledgements that never come, and the
/// retransmission timer still runs out its retries (before, it was disarmed while the
/// message was part-way sent, and the request never completed).
#[test]
fn a_message_held_by_the_send_window_times_out_on_a_dead_link() {
    let mut p = Pair::with(PairConfig {
        mtu: crate::Mtu::Mtu256,
        send_window: 8,
        retry_cnt: 2,
        ..PairConfig::default()
    });
    p.ab.down = true;
    post_long_write(&mut p, 64, 0);
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::RetryExcErr)]);
}

/// A message a slow transport takes out a packet at a time, over many ACK timeouts (a
/// stream without a send window, as tcp and shm are): it completes; the timer does not
/// run while the message is still going out (it did for a moment, and such a message
/// failed with RETRY_EXC_ERR on a healthy link).
#[test]
fn a_message_still_going_out_is_not_timed_out() {
    let mut p = Pair::with(PairConfig {
        mtu: crate::Mtu::Mtu256,
        retry_cnt: 1,
        ..PairConfig::default()
    });
    let timeout = crate::qp::timeout_duration(p.cfg.timeout).unwrap();
    p.a.burst = Some(1);
    p.a.pace = timeout / 2;
    let (dst, len) = post_long_write(&mut p, 32, 4);
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)]);
    assert_eq!(p.b.mem.bytes(dst, len), pattern(4, len));
    assert_eq!(p.ab.sent().count(), 32, "each packet once");
}

/// The same message with the acknowledgements from its 40th packet on lost, three times
/// (the window holds the rest back each time): the timer sends again what went
/// unacknowledged, and every byte lands.
#[test]
fn a_message_held_by_the_send_window_recovers_lost_acknowledgements() {
    let mut p = Pair::with(PairConfig {
        mtu: crate::Mtu::Mtu256,
        send_window: 8,
        ..PairConfig::default()
    });
    let from = rdmx_wire::psn_add(p.cfg.sq_psn_a, 40);
    p.ba.drop_matching(3, move |x| {
        x.is_ack() && rdmx_wire::psn_diff(x.psn, from) >= 0
    });
    let (dst, len) = post_long_write(&mut p, 64, 5);
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)]);
    assert_eq!(p.b.mem.bytes(dst, len), pattern(5, len));
    // Each timeout sends again from the first packet not acknowledged (the 40th), not
    // from the message's start: at most a window's worth each time.
    let sent = p.ab.sent().count();
    assert!(sent <= 64 + 3 * 8, "{sent} packets sent for 64");
}

/// A packet lost in the middle of a long WRITE: the responder NAKs the PSN it expects,
/// and the requester sends again from there, not from the message's start.
#[test]
fn a_sequence_nak_resumes_a_long_message_where_it_broke() {
    let mut p = Pair::with(PairConfig {
        mtu: crate::Mtu::Mtu256,
        ..PairConfig::default()
    });
    let lost = rdmx_wire::psn_add(p.cfg.sq_psn_a, 30);
    p.ab.drop_matching(1, move |x| x.psn == lost);
    let (dst, len) = post_long_write(&mut p, 64, 8);
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)]);
    assert_eq!(p.b.mem.bytes(dst, len), pattern(8, len));
    let sent = p.ab.sent().count();
    assert!(sent <= 64 + (64 - 30), "{sent} packets sent for 64");
}

// ---------------------------------------------------------------------------------------
// Destroying a queue pair
// ---------------------------------------------------------------------------------------

#[test]
fn destroy_drops_every_request_and_receive_without_completions() {
    let mut p = Pair::new();
    // Nothing reaches the peer: the requests stay in flight, being retried.
    receive_send_and_write_on_a_dead_link(&mut p);
    p.drive_for(Duration::from_millis(1));
    assert_eq!(p.a.qp.outstanding(), (2, 1));
    p.a.qp.destroy();
    assert_eq!(p.a.qp.state(), QpState::Reset);
    assert_eq!(p.a.qp.outstanding(), (0, 0));
    assert!(p.a.qp.poll_completion().is_none());
    assert_eq!(p.a.qp.poll_timeout(), None);
    let now = std::time::Instant::now();
    assert!(p.a.qp.poll_transmit(now, &p.a.mem).is_none());
    // Driven on, with the link back, it sends nothing and completes nothing.
    p.ab.down = false;
    p.drive();
    assert!(p.a.sends().is_empty() && p.a.recvs().is_empty());
    assert!(p.quiet());
}
