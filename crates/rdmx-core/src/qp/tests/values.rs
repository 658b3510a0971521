//! Attribute values: each checked against its range and the device's limits, and a
//! refused modify that changes nothing.

use super::*;

/// The transition on which `bit` is checked, from a state `walk_to` reaches.
fn transition_taking(bit: QpAttrMask) -> (QpState, QpState) {
    [(Reset, Init), (Init, Rtr), (Rtr, Rts)]
        .into_iter()
        .find(|&(f, t)| required(f, t).contains(bit))
        .unwrap()
}

fn modify_with(bit: QpAttrMask, edit: impl Fn(&mut QpAttr)) -> Result<Transition, ModifyError> {
    let (from, to) = transition_taking(bit);
    let mut m = walk_to(from);
    let mut attr = full_attr(to);
    edit(&mut attr);
    attempt(&mut m, &attr, required(from, to) | QpAttrMask::STATE)
}

#[test]
fn every_value_is_checked() {
    type Edit = fn(&mut QpAttr);
    let cases: [(QpAttrMask, Edit, Edit); 14] = [
        (
            QpAttrMask::RETRY_CNT,
            |a| a.retry_cnt = 7,
            |a| a.retry_cnt = 8,
        ),
        (
            QpAttrMask::RNR_RETRY,
            |a| a.rnr_retry = 7,
            |a| a.rnr_retry = 8,
        ),
        (QpAttrMask::TIMEOUT, |a| a.timeout = 31, |a| a.timeout = 32),
        (
            QpAttrMask::MIN_RNR_TIMER,
            |a| a.min_rnr_timer = 31,
            |a| a.min_rnr_timer = 32,
        ),
        (
            QpAttrMask::RQ_PSN,
            |a| a.rq_psn = PSN_LIMIT - 1,
            |a| a.rq_psn = PSN_LIMIT,
        ),
        (
            QpAttrMask::SQ_PSN,
            |a| a.sq_psn = PSN_LIMIT - 1,
            |a| a.sq_psn = PSN_LIMIT,
        ),
        (
            QpAttrMask::DEST_QPN,
            |a| a.dest_qp_num = PSN_LIMIT - 1,
            |a| a.dest_qp_num = u32::MAX,
        ),
        (
            QpAttrMask::MAX_QP_RD_ATOMIC,
            |a| a.max_rd_atomic = 16,
            |a| a.max_rd_atomic = 17,
        ),
        (
            QpAttrMask::MAX_DEST_RD_ATOMIC,
            |a| a.max_dest_rd_atomic = 16,
            |a| a.max_dest_rd_atomic = 17,
        ),
        (
            QpAttrMask::PATH_MTU,
            |a| a.path_mtu = Mtu::Mtu4096,
            |a| a.path_mtu = Mtu::Bytes(8192),
        ),
        (
            QpAttrMask::PATH_MTU,
            |a| a.path_mtu = Mtu::Bytes(256),
            |a| a.path_mtu = Mtu::Bytes(1000),
        ),
        (QpAttrMask::PORT, |a| a.port_num = 1, |a| a.port_num = 0),
        (QpAttrMask::PORT, |a| a.port_num = 1, |a| a.port_num = 2),
        (
            QpAttrMask::PKEY_INDEX,
            |a| a.pkey_index = 0,
            |a| a.pkey_index = 1,
        ),
    ];
    for (bit, good, bad) in cases {
        assert!(modify_with(bit, good).is_ok(), "{bit:?} at its limit");
        match modify_with(bit, bad) {
            Err(ModifyError::InvalidValue { attr, reason }) => {
                assert_eq!(attr, bit, "{reason}");
                assert!(!reason.is_empty());
            }
            other => panic!("{bit:?}: {other:?}"),
        }
    }
    // Values of attributes not in the mask are not looked at.
    let mut m = walk_to(Init);
    let mut attr = full_attr(Rtr);
    attr.retry_cnt = 200;
    attr.port_num = 0;
    attempt(&mut m, &attr, required(Init, Rtr) | QpAttrMask::STATE).unwrap();
}

#[test]
fn values_are_checked_against_the_given_limits() {
    let big = QpLimits {
        max_mtu: Mtu::Bytes(64 * 1024),
        max_dest_rd_atomic: 64,
        ports: 2,
        pkey_table_len: 16,
        ..QpLimits::default()
    };
    let mut m = walk_to(Init);
    let mut attr = full_attr(Rtr);
    attr.path_mtu = Mtu::Bytes(64 * 1024);
    attr.max_dest_rd_atomic = 64;
    let mask = required(Init, Rtr) | QpAttrMask::STATE;
    assert!(matches!(
        m.check(&attr, mask, &limits()),
        Err(ModifyError::InvalidValue {
            attr: QpAttrMask::PATH_MTU,
            ..
        })
    ));
    m.modify(&attr, mask, &big).unwrap();
    assert_eq!(m.attrs().path_mtu.bytes(), 65536);

    let mut m = QpStateMachine::new();
    let mut attr = full_attr(Init);
    attr.port_num = 2;
    attr.pkey_index = 15;
    m.modify(&attr, required(Reset, Init) | QpAttrMask::STATE, &big)
        .unwrap();
}

#[test]
fn qp_access_flags_need_no_local_write() {
    // A memory region may not have remote write without local write; a QP may.
    assert!(Access::REMOTE_WRITE.validate().is_err());
    for access in [
        Access::REMOTE_WRITE,
        Access::REMOTE_ATOMIC,
        Access::empty(),
        Access::ALL,
    ] {
        let mut m = QpStateMachine::new();
        let mut attr = full_attr(Init);
        attr.qp_access_flags = access;
        m.modify(&attr, required(Reset, Init) | QpAttrMask::STATE, &limits())
            .unwrap();
        assert_eq!(m.attrs().qp_access_flags, access);
    }
}

#[test]
fn failed_modifies_change_nothing() {
    let mut m = walk_to(Rtr);
    let before = m.attrs().clone();
    let mut attr = full_attr(Rts);
    attr.retry_cnt = 9; // bad value, checked after everything else was accepted
    let mask = required(Rtr, Rts) | QpAttrMask::STATE | QpAttrMask::ACCESS_FLAGS;
    attr.qp_access_flags = Access::empty();
    assert!(m.modify(&attr, mask, &limits()).is_err());
    assert_eq!(m.state(), Rtr);
    assert_eq!(m.attrs(), &before);
    // `check` never changes anything, even when it succeeds.
    attr.retry_cnt = 3;
    let t = m.check(&attr, mask, &limits()).unwrap();
    assert_eq!((t.from, t.to), (Rtr, Rts));
    assert_eq!(m.attrs(), &before);
}
