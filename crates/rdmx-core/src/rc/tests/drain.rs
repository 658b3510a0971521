//! SQ drain: what a queue pair started it finishes, and sends again after a loss; nothing
//! new starts.

use std::time::Duration;

use super::util::*;
use crate::qp::QpState;
use crate::wr::{SendOp, WcStatus};

#[test]
fn sq_drain_retransmits_what_it_started_and_starts_nothing_new() {
    use crate::qp::{QpAttr, QpAttrMask};
    for lose in ["packet", "ack", "read response"] {
        let mut p = Pair::new();
        let len = 3 * 256;
        let data = pattern(60, len);
        let src = p.a.mem.register(2 * len as u64, ALL);
        p.a.mem.fill(src.addr, &data);
        let dst = p.b.mem.register(2 * len as u64, ALL);
        p.b.mem.fill(dst.addr + len as u64, &data);
        match lose {
            "packet" => {
                // The WRITE's second packet (the READ takes 3 PSNs).
                let psn = a_psn(&p, 4);
                p.ab.drop_matching(1, move |x| x.psn == psn);
            }
            "ack" => p.ba.drop_matching(1, |x| x.is_ack()),
            _ => p.ba.drop_matching(1, |x| x.is_read_response()),
        }
        p.a.post(wr(
            1,
            SendOp::Read(dst.remote(len as u64)),
            vec![src.sge(len as u64, len as u32)],
        ))
        .unwrap();
        p.a.post(wr(
            2,
            SendOp::Write(dst.remote(0)),
            vec![src.sge(0, len as u32)],
        ))
        .unwrap();
        // Both go out; then the SQ is drained and a third request is posted.
        p.drive_for(Duration::from_nanos(1));
        assert_eq!(p.ab.sent().count(), 4, "{lose}");
        let sqd = QpAttr {
            qp_state: QpState::Sqd,
            en_sqd_async_notify: true,
            ..QpAttr::default()
        };
        p.a.qp
            .modify(&sqd, QpAttrMask::STATE | QpAttrMask::EN_SQD_ASYNC_NOTIFY)
            .unwrap();
        p.a.post(wr(3, SendOp::Write(dst.remote(0)), vec![src.sge(0, 8)]))
            .unwrap();
        if lose != "packet" {
            // The timeout rewinds: still draining, not drained.
            p.drive_until(|p| p.timeouts.0 >= 1);
            assert!(p.a.send_cq.len() < 2, "{lose}");
            assert!(!p.a.qp.take_sq_drained_event(), "{lose}: drained too early");
            assert!(p.a.qp.sm.sq_draining(), "{lose}");
        }
        p.drive();
        assert_eq!(
            p.a.sends(),
            vec![(1, WcStatus::Success), (2, WcStatus::Success)],
            "{lose}: what was started finished, through a retransmission"
        );
        if lose == "packet" {
            // Recovered by the sequence NAK's go-back-N.
            assert_eq!(p.ba.sent().filter(|x| x.is_seq_nak()).count(), 1, "{lose}");
        } else {
            assert!(p.timeouts.0 >= 1, "{lose}");
        }
        assert_eq!(p.b.mem.bytes(dst.addr, len), data, "{lose}");
        assert_eq!(p.a.mem.bytes(src.addr + len as u64, len), data, "{lose}");
        assert!(p.a.qp.take_sq_drained_event(), "{lose}");
        assert_eq!(
            p.ab.sent().filter(|x| x.len == 8).count(),
            0,
            "{lose}: 3 waits"
        );
        let rts = QpAttr {
            qp_state: QpState::Rts,
            ..QpAttr::default()
        };
        p.a.qp.modify(&rts, QpAttrMask::STATE).unwrap();
        p.drive();
        assert_eq!(p.a.send_cq.last().map(|w| w.c.wr_id), Some(3), "{lose}");
    }
}
