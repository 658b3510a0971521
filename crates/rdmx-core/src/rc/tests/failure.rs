//! Failures: retries exhausted, remote errors, and a queue pair destroyed with requests
//! in flight.

use std::time::Duration;

use rdmx_wire::{NakCode, Opcode, Syndrome};

use super::util::*;
use crate::access::Access;
use crate::qp::QpState;
use crate::wr::{PostError, SendOp, WcOpcode, WcStatus};

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
