//! Receiver not ready: RNR NAKs, waits and retries, and their exhaustion.

use std::time::Duration;

use rdmx_wire::RnrTimer;

use super::util::*;
use crate::qp::QpState;
use crate::wr::{SendOp, WcStatus};

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
