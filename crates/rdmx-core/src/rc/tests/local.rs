//! Local errors: requests refused at post or failed on a local key, the queues full, and
//! attributes changed in SQD.

use std::time::Duration;

use super::util::*;
use crate::access::Access;
use crate::qp::QpState;
use crate::wr::{PostError, SendFlags, SendOp, WcStatus};

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
