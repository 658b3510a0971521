use std::time::Duration;

use super::*;
use crate::access::Access;
use QpState::{Init, Reset, Rtr, Rts, Sqd, Sqe};

mod values;

/// The legal RC pairs, written out independently of `rc_rule`.
const LEGAL: [(QpState, QpState); 23] = [
    (Reset, Reset),
    (Reset, Init),
    (Reset, QpState::Err),
    (Init, Reset),
    (Init, Init),
    (Init, Rtr),
    (Init, QpState::Err),
    (Rtr, Reset),
    (Rtr, Rts),
    (Rtr, QpState::Err),
    (Rts, Reset),
    (Rts, Rts),
    (Rts, Sqd),
    (Rts, QpState::Err),
    (Sqd, Reset),
    (Sqd, Rts),
    (Sqd, Sqd),
    (Sqd, QpState::Err),
    (Sqe, Reset),
    (Sqe, Rts),
    (Sqe, QpState::Err),
    (QpState::Err, Reset),
    (QpState::Err, QpState::Err),
];

const ALL_BITS: QpAttrMask = QpAttrMask::all();

fn limits() -> QpLimits {
    QpLimits::default()
}

/// Valid values for every field, aimed at `to`.
fn full_attr(to: QpState) -> QpAttr {
    QpAttr {
        qp_state: to,
        cur_qp_state: Reset,
        en_sqd_async_notify: true,
        qp_access_flags: Access::REMOTE_WRITE | Access::REMOTE_READ,
        pkey_index: 0,
        port_num: 1,
        path_mtu: Mtu::Mtu1024,
        dest_qp_num: 0x12,
        rq_psn: 100,
        sq_psn: 200,
        max_rd_atomic: 4,
        max_dest_rd_atomic: 8,
        min_rnr_timer: 12,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        qkey: 0x1111_1111,
    }
}

fn required(from: QpState, to: QpState) -> QpAttrMask {
    rc_rule(from, to).unwrap().required
}

/// Takes `m` to `to` with the required attributes only.
fn step(m: &mut QpStateMachine, to: QpState) {
    let from = m.state();
    let mask = required(from, to) | QpAttrMask::STATE;
    m.modify(&full_attr(to), mask, &limits())
        .unwrap_or_else(|e| panic!("{from} -> {to}: {e}"));
}

/// A machine in `state`, reached by modifies where a modify can reach it; SQD has
/// drained.
fn walk_to(state: QpState) -> QpStateMachine {
    let path: &[QpState] = match state {
        Reset => &[],
        Init => &[Init],
        Rtr => &[Init, Rtr],
        Rts => &[Init, Rtr, Rts],
        Sqd => &[Init, Rtr, Rts, Sqd],
        QpState::Err => &[Init, QpState::Err],
        Sqe => return QpStateMachine::in_state(Sqe),
    };
    let mut m = QpStateMachine::new();
    for &s in path {
        step(&mut m, s);
    }
    m.sq_drained();
    assert_eq!(m.state(), state);
    m
}

fn attempt(
    m: &mut QpStateMachine,
    attr: &QpAttr,
    mask: QpAttrMask,
) -> Result<Transition, ModifyError> {
    let before = (m.state(), m.attrs().clone(), m.sq_draining());
    let r = m.modify(attr, mask, &limits());
    if r.is_err() {
        assert_eq!(
            (m.state(), m.attrs().clone(), m.sq_draining()),
            before,
            "a failed modify changed the QP"
        );
    }
    r
}

#[test]
fn the_table_allows_exactly_the_verbs_pairs() {
    for from in QpState::ALL {
        for to in QpState::ALL {
            let legal = LEGAL.contains(&(from, to));
            assert_eq!(rc_rule(from, to).is_some(), legal, "{from} -> {to}");
            let mut m = walk_to(from);
            let r = attempt(&mut m, &full_attr(to), QpAttrMask::STATE);
            if !legal {
                assert_eq!(
                    r,
                    Err(ModifyError::IllegalTransition { from, to }),
                    "{from} -> {to}"
                );
            }
        }
    }
}

/// The kernel's RC column again, transcribed separately from `rc_rule`, so a slip in
/// either shows up here. Pairs not listed take no attributes.
#[test]
fn rules_match_the_kernel_rc_column() {
    use QpAttrMask as M;
    let rts_opt =
        M::CUR_STATE | M::ACCESS_FLAGS | M::ALT_PATH | M::PATH_MIG_STATE | M::MIN_RNR_TIMER;
    let expected = [
        (
            Reset,
            Init,
            M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS,
            M::empty(),
        ),
        (
            Init,
            Init,
            M::empty(),
            M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS,
        ),
        (
            Init,
            Rtr,
            M::AV
                | M::PATH_MTU
                | M::DEST_QPN
                | M::RQ_PSN
                | M::MAX_DEST_RD_ATOMIC
                | M::MIN_RNR_TIMER,
            M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX,
        ),
        (
            Rtr,
            Rts,
            M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC,
            rts_opt,
        ),
        (Rts, Rts, M::empty(), rts_opt),
        (Rts, Sqd, M::empty(), M::EN_SQD_ASYNC_NOTIFY),
        (Sqd, Rts, M::empty(), rts_opt),
        (
            Sqd,
            Sqd,
            M::empty(),
            M::PORT
                | M::AV
                | M::TIMEOUT
                | M::RETRY_CNT
                | M::RNR_RETRY
                | M::MAX_QP_RD_ATOMIC
                | M::MAX_DEST_RD_ATOMIC
                | M::ALT_PATH
                | M::ACCESS_FLAGS
                | M::PKEY_INDEX
                | M::MIN_RNR_TIMER
                | M::PATH_MIG_STATE,
        ),
    ];
    for (from, to) in LEGAL {
        let (req, opt) = expected
            .iter()
            .find(|e| (e.0, e.1) == (from, to))
            .map_or((M::empty(), M::empty()), |e| (e.2, e.3));
        let rule = rc_rule(from, to).unwrap();
        assert_eq!((rule.required, rule.optional), (req, opt), "{from} -> {to}");
        assert!(!rule.allowed().is_empty() && rule.allowed().contains(M::STATE));
    }
}

#[test]
fn every_legal_transition_succeeds_with_exactly_its_required_attrs() {
    for (from, to) in LEGAL {
        let rule = rc_rule(from, to).unwrap();
        for mask in [rule.required | QpAttrMask::STATE, rule.allowed()] {
            let mut m = walk_to(from);
            let mut attr = full_attr(to);
            attr.cur_qp_state = from;
            let t = m
                .modify(&attr, mask, &limits())
                .unwrap_or_else(|e| panic!("{from} -> {to} with {mask:?}: {e}"));
            assert_eq!(t, Transition { from, to, mask });
            assert_eq!(t.changed_state(), from != to);
            assert_eq!(m.state(), to);
            assert_eq!(m.attrs().qp_state, to);
            assert_eq!(m.attrs().cur_qp_state, to);
        }
    }
}

#[test]
fn each_missing_required_attr_is_named() {
    for (from, to) in LEGAL {
        for bit in required(from, to).iter() {
            let mut m = walk_to(from);
            let mask = (required(from, to) | QpAttrMask::STATE).difference(bit);
            assert_eq!(
                attempt(&mut m, &full_attr(to), mask),
                Err(ModifyError::MissingAttrs(bit)),
                "{from} -> {to} without {bit:?}"
            );
        }
    }
}

#[test]
fn each_disallowed_attr_is_unexpected() {
    for (from, to) in LEGAL {
        let rule = rc_rule(from, to).unwrap();
        for bit in ALL_BITS.difference(rule.allowed()).iter() {
            let mut m = walk_to(from);
            let mut attr = full_attr(to);
            attr.cur_qp_state = from;
            assert_eq!(
                attempt(&mut m, &attr, rule.required | QpAttrMask::STATE | bit),
                Err(ModifyError::UnexpectedAttrs(bit)),
                "{from} -> {to} with {bit:?}"
            );
        }
    }
}

#[test]
fn unknown_mask_bits_are_unexpected() {
    let rate_limit = QpAttrMask::from_bits_retain(1 << 25);
    let mut m = walk_to(Rts);
    assert_eq!(
        attempt(&mut m, &full_attr(Rts), QpAttrMask::STATE | rate_limit),
        Err(ModifyError::UnexpectedAttrs(rate_limit))
    );
}

#[test]
fn any_state_goes_to_err_and_reset_with_no_attrs() {
    for from in QpState::ALL {
        for to in [QpState::Err, Reset] {
            assert_eq!(
                rc_rule(from, to).map(TransitionRule::allowed),
                Some(QpAttrMask::STATE)
            );
            let mut m = walk_to(from);
            assert_eq!(
                attempt(&mut m, &full_attr(to), QpAttrMask::STATE | QpAttrMask::PORT),
                Err(ModifyError::UnexpectedAttrs(QpAttrMask::PORT))
            );
            let t = m
                .modify(&full_attr(to), QpAttrMask::STATE, &limits())
                .unwrap();
            assert_eq!((t.from, t.to), (from, to));
            assert_eq!(m.state(), to);
        }
    }
}

#[test]
fn entering_reset_clears_the_attributes() {
    let mut m = walk_to(Rts);
    assert_ne!(m.attrs(), &QpAttr::default());
    step(&mut m, Reset);
    assert_eq!(m.attrs(), &QpAttr::default());
}

#[test]
fn cur_state_must_match_and_is_only_taken_into_rts() {
    let mask = required(Rtr, Rts) | QpAttrMask::STATE | QpAttrMask::CUR_STATE;
    let mut attr = full_attr(Rts);

    let mut m = walk_to(Rtr);
    attr.cur_qp_state = Rts;
    assert_eq!(
        attempt(&mut m, &attr, mask),
        Err(ModifyError::CurStateMismatch {
            given: Rts,
            actual: Rtr
        })
    );
    attr.cur_qp_state = Rtr;
    assert!(attempt(&mut m, &attr, mask).is_ok());

    // Matching, but INIT -> RTR does not take CUR_STATE.
    let mut m = walk_to(Init);
    let mut attr = full_attr(Rtr);
    attr.cur_qp_state = Init;
    let mask = required(Init, Rtr) | QpAttrMask::STATE | QpAttrMask::CUR_STATE;
    assert_eq!(
        attempt(&mut m, &attr, mask),
        Err(ModifyError::UnexpectedAttrs(QpAttrMask::CUR_STATE))
    );
}

#[test]
fn attribute_only_modifies_follow_the_same_state_rows() {
    // INIT -> INIT takes the port.
    let mut m = walk_to(Init);
    let t = attempt(&mut m, &full_attr(Reset), QpAttrMask::PORT).unwrap();
    assert_eq!((t.from, t.to), (Init, Init));
    // RTR -> RTR is not a transition at all.
    let mut m = walk_to(Rtr);
    assert_eq!(
        attempt(&mut m, &full_attr(Reset), QpAttrMask::MIN_RNR_TIMER),
        Err(ModifyError::IllegalTransition { from: Rtr, to: Rtr })
    );
    // RTS -> RTS changes the access flags.
    let mut m = walk_to(Rts);
    let mut attr = full_attr(Reset);
    attr.qp_access_flags = Access::REMOTE_ATOMIC;
    attempt(&mut m, &attr, QpAttrMask::ACCESS_FLAGS).unwrap();
    assert_eq!(m.state(), Rts);
    assert_eq!(m.attrs().qp_access_flags, Access::REMOTE_ATOMIC);
}

#[test]
fn full_walk_through_every_operational_state() {
    let l = limits();
    let mut m = QpStateMachine::new();
    assert_eq!(m.state(), Reset);

    let mut a = QpAttr {
        qp_state: Init,
        qp_access_flags: Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
        port_num: 1,
        ..QpAttr::default()
    };
    use QpAttrMask as M;
    let t = m
        .modify(&a, M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS, &l)
        .unwrap();
    assert_eq!((t.from, t.to), (Reset, Init));

    a.qp_state = Rtr;
    a.path_mtu = Mtu::Mtu4096;
    a.dest_qp_num = 0xab_cdef;
    a.rq_psn = 0x12_3456;
    a.max_dest_rd_atomic = 16;
    a.min_rnr_timer = 12;
    let rtr = M::STATE
        | M::AV
        | M::PATH_MTU
        | M::DEST_QPN
        | M::RQ_PSN
        | M::MAX_DEST_RD_ATOMIC
        | M::MIN_RNR_TIMER;
    m.modify(&a, rtr, &l).unwrap();
    assert_eq!(m.state(), Rtr);

    a.qp_state = Rts;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = RNR_RETRY_INFINITE;
    a.sq_psn = 0x65_4321;
    a.max_rd_atomic = 16;
    let rts = M::STATE | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC;
    m.modify(&a, rts, &l).unwrap();
    let expect = QpAttr {
        cur_qp_state: Rts,
        ..a.clone()
    };
    assert_eq!(m.attrs(), &expect);

    // RTS -> SQD, asking for the drained event; nothing moves until the SQ drains.
    a.qp_state = Sqd;
    a.en_sqd_async_notify = true;
    m.modify(&a, M::STATE | M::EN_SQD_ASYNC_NOTIFY, &l).unwrap();
    assert!(m.sq_draining());
    a.qp_state = Rts;
    assert_eq!(m.check(&a, M::STATE, &l), Err(ModifyError::SqDraining));
    assert_eq!(m.check(&a, M::TIMEOUT, &l), Err(ModifyError::SqDraining));
    assert!(m.sq_drained(), "notify was asked for");
    assert!(!m.sq_drained(), "drains once");

    // SQD -> SQD changes the timeout, then back to RTS.
    a.timeout = 18;
    m.modify(&a, M::TIMEOUT, &l).unwrap();
    assert_eq!((m.state(), m.attrs().timeout), (Sqd, 18));
    m.modify(&a, M::STATE, &l).unwrap();
    assert_eq!(m.state(), Rts);

    a.qp_state = QpState::Err;
    let t = m.modify(&a, M::STATE, &l).unwrap();
    assert_eq!((t.from, t.to), (Rts, QpState::Err));
    assert!(m.flushes());
    assert_eq!(m.attrs().timeout, 18, "ERR keeps the attributes");

    a.qp_state = Reset;
    m.modify(&a, M::STATE, &l).unwrap();
    assert_eq!(m.state(), Reset);
    assert_eq!(m.attrs(), &QpAttr::default());
}

#[test]
fn draining_sqd_accepts_only_err_and_reset() {
    for to in [QpState::Err, Reset] {
        let mut m = walk_to(Rts);
        step(&mut m, Sqd);
        assert!(m.sq_draining());
        step(&mut m, to);
        assert!(!m.sq_draining());
        assert!(!m.sq_drained());
    }
    // Without EN_SQD_ASYNC_NOTIFY (or with it false) no event is due.
    let mut m = walk_to(Rts);
    m.modify(&full_attr(Sqd), QpAttrMask::STATE, &limits())
        .unwrap();
    assert!(!m.sq_drained());
    let mut m = walk_to(Rts);
    let mut attr = full_attr(Sqd);
    attr.en_sqd_async_notify = false;
    m.modify(
        &attr,
        QpAttrMask::STATE | QpAttrMask::EN_SQD_ASYNC_NOTIFY,
        &limits(),
    )
    .unwrap();
    assert!(m.sq_draining());
    assert!(!m.sq_drained());
    assert!(!m.sq_draining());
}

#[test]
fn the_engine_can_fail_the_qp() {
    let mut m = walk_to(Rts);
    assert_eq!(
        m.set_error(),
        Some(Transition {
            from: Rts,
            to: QpState::Err,
            mask: QpAttrMask::empty()
        })
    );
    assert_eq!(m.state(), QpState::Err);
    assert_eq!(m.set_error(), None);
    let mut m = walk_to(Rts);
    step(&mut m, Sqd);
    m.set_error().unwrap();
    assert!(!m.sq_draining());
}

#[test]
fn posting_and_processing_per_state() {
    // state, post send, post recv, starts sends, processes sends, processes receives,
    // flushes sends, flushes receives
    let table = [
        (Reset, false, false, false, false, false, false, false),
        (Init, false, true, false, false, false, false, false),
        (Rtr, false, true, false, false, true, false, false),
        (Rts, true, true, true, true, true, false, false),
        (Sqd, true, true, false, true, true, false, false),
        (Sqe, true, true, false, false, true, true, false),
        (QpState::Err, true, true, false, false, false, true, true),
    ];
    for (s, ps, pr, ss, prs, prr, fs, fr) in table {
        let got = (
            s.post_send_allowed(),
            s.post_recv_allowed(),
            s.starts_sends(),
            s.processes_sends(),
            s.processes_receives(),
            s.flushes_sends(),
            s.flushes_receives(),
        );
        assert_eq!(got, (ps, pr, ss, prs, prr, fs, fr), "{s}");
        assert_eq!(s.flushes(), fr);
        let m = walk_to(s);
        assert_eq!(
            (
                m.post_send_allowed(),
                m.post_recv_allowed(),
                m.starts_sends(),
                m.processes_sends(),
                m.processes_receives(),
                m.flushes()
            ),
            (ps, pr, ss, prs, prr, fr),
            "{s}"
        );
    }
}

#[test]
fn states_match_ibv_values_and_names() {
    for (i, s) in QpState::ALL.into_iter().enumerate() {
        assert_eq!(s as usize, i);
        assert_eq!(QpState::from_ibv(i as u32), Some(s));
    }
    assert_eq!(QpState::from_ibv(7), None);
    assert_eq!(QpState::Rts.to_string(), "RTS");
    assert_eq!(QpState::default(), Reset);
}

#[test]
fn mask_bits_match_ibv_qp_attr_mask() {
    assert_eq!(QpAttrMask::STATE.bits(), 1);
    assert_eq!(QpAttrMask::AV.bits(), 1 << 7);
    assert_eq!(QpAttrMask::MAX_QP_RD_ATOMIC.bits(), 1 << 13);
    assert_eq!(QpAttrMask::DEST_QPN.bits(), 1 << 20);
    assert_eq!(ALL_BITS.bits(), (1 << 21) - 1);
}

#[test]
fn timeout_codes() {
    assert_eq!(timeout_duration(0), None);
    assert_eq!(timeout_duration(1), Some(Duration::from_nanos(8192)));
    assert_eq!(timeout_duration(14), Some(Duration::from_nanos(4096 << 14)));
    assert_eq!(timeout_duration(31), Some(Duration::from_nanos(4096 << 31)));
    assert!(timeout_duration(31).unwrap() > Duration::from_secs(8796));
    assert_eq!(timeout_duration(32), None, "only the low 5 bits count");
}

#[test]
fn mtu_sizes_codes_and_comparison() {
    let ib = [
        Mtu::Mtu256,
        Mtu::Mtu512,
        Mtu::Mtu1024,
        Mtu::Mtu2048,
        Mtu::Mtu4096,
    ];
    for (i, m) in ib.into_iter().enumerate() {
        assert_eq!(m.bytes(), 256 << i);
        assert_eq!(m.ib_code(), Some(i as u8 + 1));
        assert_eq!(Mtu::from_ib_code(i as u8 + 1), Some(m));
        assert_eq!(Mtu::from_bytes(256 << i), Some(m));
        assert!(matches!(Mtu::from_bytes(256 << i), Some(x) if !matches!(x, Mtu::Bytes(_))));
        assert!(m.is_valid());
    }
    assert_eq!(Mtu::Bytes(1024), Mtu::Mtu1024);
    assert_eq!(Mtu::Bytes(2048).ib_code(), Some(4));
    assert_eq!(Mtu::from_bytes(65536), Some(Mtu::Bytes(65536)));
    assert_eq!(Mtu::from_bytes(65536).unwrap().ib_code(), None);
    assert_eq!(Mtu::from_bytes(128), None);
    assert_eq!(Mtu::from_bytes(3000), None);
    assert_eq!(Mtu::from_ib_code(0), None);
    assert_eq!(Mtu::from_ib_code(6), None);
    assert!(!Mtu::Bytes(0).is_valid());
    assert!(Mtu::Mtu4096 < Mtu::Bytes(8192));
    assert!(Mtu::Bytes(512) < Mtu::Mtu1024);
    assert_eq!(Mtu::default(), Mtu::Mtu256);
}

#[test]
fn ib_sized_byte_mtus_are_stored_as_named_variants() {
    let mut m = walk_to(Init);
    let mut attr = full_attr(Rtr);
    attr.path_mtu = Mtu::Bytes(2048);
    m.modify(&attr, required(Init, Rtr) | QpAttrMask::STATE, &limits())
        .unwrap();
    assert!(matches!(m.attrs().path_mtu, Mtu::Mtu2048));
}

#[test]
fn ud_and_uc_take_their_own_columns() {
    let limits = QpLimits::default();
    // UD: INIT needs the Q_Key, and no transition takes a peer or a path.
    let mut ud = QpStateMachine::with_type(QpType::Ud);
    let init = QpAttr {
        qp_state: Init,
        port_num: 1,
        qkey: 7,
        ..QpAttr::default()
    };
    let rc_init = QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT;
    assert_eq!(
        ud.modify(&init, rc_init | QpAttrMask::ACCESS_FLAGS, &limits),
        Err(ModifyError::MissingAttrs(QpAttrMask::QKEY))
    );
    for (attr, mask) in ud_steps(0x1234, 5) {
        ud.modify(&attr, mask, &limits).unwrap();
    }
    assert_eq!((ud.state(), ud.attrs().qkey), (Rts, 0x1234));
    let to_rtr_again = rule_for(QpType::Ud, Init, Rtr).unwrap();
    assert!(to_rtr_again.required.is_empty());
    assert!(!to_rtr_again.allowed().contains(QpAttrMask::DEST_QPN));
    // UC: no read/atomic depths, RNR timer, ack timeout or retries; RC takes no Q_Key.
    let params = ConnectParams {
        access: Access::REMOTE_WRITE,
        mtu: Mtu::Mtu1024,
        dest_qpn: 0x12,
        rq_psn: 1,
        sq_psn: 2,
        max_rd_atomic: 1,
        max_dest_rd_atomic: 1,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        min_rnr_timer: 12,
    };
    let mut uc = QpStateMachine::with_type(QpType::Uc);
    let rc_steps = params.steps();
    uc.modify(&rc_steps[0].0, rc_steps[0].1, &limits).unwrap();
    assert!(matches!(
        uc.modify(&rc_steps[1].0, rc_steps[1].1, &limits),
        Err(ModifyError::UnexpectedAttrs(_))
    ));
    for (attr, mask) in params.steps_for(QpType::Uc).into_iter().skip(1) {
        uc.modify(&attr, mask, &limits).unwrap();
    }
    assert_eq!(uc.state(), Rts);
    assert!(!rc_rule(Reset, Init)
        .unwrap()
        .allowed()
        .contains(QpAttrMask::QKEY));
    // A reset keeps the type.
    uc.modify(&QpAttr::default(), QpAttrMask::STATE, &limits)
        .unwrap();
    assert_eq!(uc.qp_type(), QpType::Uc);
}
