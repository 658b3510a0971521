//! The transition tables of RC, UC and UD queue pairs: which `(current, next)` pairs a modify may ask for, and the
//! attributes each one requires and allows.
//!
//! These are the RC, UC and UD columns of the Linux kernel's `qp_state_table`
//! (`drivers/infiniband/core/verbs.c`, used by `ib_modify_qp_is_ok`), which encodes the
//! IBTA Modify QP rules. [`QpAttrMask::STATE`] is always allowed and is left out of both
//! masks.

use super::{QpAttrMask, QpState, QpType};

/// What one legal transition requires and allows, besides [`QpAttrMask::STATE`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TransitionRule {
    /// Attributes that must be given.
    pub required: QpAttrMask,
    /// Attributes that may be given.
    pub optional: QpAttrMask,
}

impl TransitionRule {
    /// Everything the transition accepts: required, optional and `STATE`.
    pub fn allowed(self) -> QpAttrMask {
        self.required | self.optional | QpAttrMask::STATE
    }
}

const fn rule(required: QpAttrMask, optional: QpAttrMask) -> Option<TransitionRule> {
    Some(TransitionRule { required, optional })
}

const NONE: QpAttrMask = QpAttrMask::empty();

/// The rule for moving an RC QP from `from` to `to` with a modify, or `None` if verbs
/// forbids that pair. A modify without [`QpAttrMask::STATE`] is the pair `(s, s)`.
pub fn rc_rule(from: QpState, to: QpState) -> Option<TransitionRule> {
    use QpAttrMask as M;
    use QpState::*;

    match (from, to) {
        // Any state may be reset or failed, with no attributes. (Current kernels allow
        // RESET → ERR too; older tables lacked it.)
        (_, Reset) | (_, Err) => rule(NONE, NONE),

        (Reset, Init) => rule(M::PKEY_INDEX.union(M::PORT).union(M::ACCESS_FLAGS), NONE),

        (Init, Init) => rule(NONE, M::PKEY_INDEX.union(M::PORT).union(M::ACCESS_FLAGS)),
        (Init, Rtr) => rule(
            M::AV
                .union(M::PATH_MTU)
                .union(M::DEST_QPN)
                .union(M::RQ_PSN)
                .union(M::MAX_DEST_RD_ATOMIC)
                .union(M::MIN_RNR_TIMER),
            M::ALT_PATH.union(M::ACCESS_FLAGS).union(M::PKEY_INDEX),
        ),

        (Rtr, Rts) => rule(
            M::TIMEOUT
                .union(M::RETRY_CNT)
                .union(M::RNR_RETRY)
                .union(M::SQ_PSN)
                .union(M::MAX_QP_RD_ATOMIC),
            M::CUR_STATE
                .union(M::ALT_PATH)
                .union(M::ACCESS_FLAGS)
                .union(M::MIN_RNR_TIMER)
                .union(M::PATH_MIG_STATE),
        ),

        (Rts, Rts) | (Sqd, Rts) => rule(
            NONE,
            M::CUR_STATE
                .union(M::ACCESS_FLAGS)
                .union(M::ALT_PATH)
                .union(M::PATH_MIG_STATE)
                .union(M::MIN_RNR_TIMER),
        ),
        (Rts, Sqd) => rule(NONE, M::EN_SQD_ASYNC_NOTIFY),

        (Sqd, Sqd) => rule(
            NONE,
            M::PORT
                .union(M::AV)
                .union(M::TIMEOUT)
                .union(M::RETRY_CNT)
                .union(M::RNR_RETRY)
                .union(M::MAX_QP_RD_ATOMIC)
                .union(M::MAX_DEST_RD_ATOMIC)
                .union(M::ALT_PATH)
                .union(M::ACCESS_FLAGS)
                .union(M::PKEY_INDEX)
                .union(M::MIN_RNR_TIMER)
                .union(M::PATH_MIG_STATE),
        ),

        // The kernel marks SQE → RTS valid for every QP type but lists no RC attributes,
        // not even CUR_STATE: RC QPs never enter SQE (a send error takes them to ERR).
        (Sqe, Rts) => rule(NONE, NONE),

        _ => None,
    }
}

/// The rule for moving a queue pair of type `qp_type` from `from` to `to`; see
/// [`rc_rule`] for RC. UC takes no read/atomic depths, RNR or retry attributes (it never
/// acknowledges nor retransmits); UD takes a Q_Key and no path, peer or PSN of the peer.
pub fn rule_for(qp_type: QpType, from: QpState, to: QpState) -> Option<TransitionRule> {
    use QpAttrMask as M;
    use QpState::*;

    match qp_type {
        QpType::Rc => rc_rule(from, to),
        QpType::Uc => match (from, to) {
            (_, Reset) | (_, Err) => rule(NONE, NONE),
            (Reset, Init) => rule(M::PKEY_INDEX.union(M::PORT).union(M::ACCESS_FLAGS), NONE),
            (Init, Init) => rule(NONE, M::PKEY_INDEX.union(M::PORT).union(M::ACCESS_FLAGS)),
            (Init, Rtr) => rule(
                M::AV.union(M::PATH_MTU).union(M::DEST_QPN).union(M::RQ_PSN),
                M::ALT_PATH.union(M::ACCESS_FLAGS).union(M::PKEY_INDEX),
            ),
            (Rtr, Rts) => rule(
                M::SQ_PSN,
                M::CUR_STATE
                    .union(M::ALT_PATH)
                    .union(M::ACCESS_FLAGS)
                    .union(M::PATH_MIG_STATE),
            ),
            (Rts, Rts) | (Sqd, Rts) => rule(
                NONE,
                M::CUR_STATE
                    .union(M::ACCESS_FLAGS)
                    .union(M::ALT_PATH)
                    .union(M::PATH_MIG_STATE),
            ),
            (Rts, Sqd) => rule(NONE, M::EN_SQD_ASYNC_NOTIFY),
            (Sqd, Sqd) => rule(
                NONE,
                M::AV
                    .union(M::ALT_PATH)
                    .union(M::ACCESS_FLAGS)
                    .union(M::PKEY_INDEX)
                    .union(M::PATH_MIG_STATE),
            ),
            (Sqe, Rts) => rule(NONE, M::CUR_STATE.union(M::ACCESS_FLAGS)),
            _ => None,
        },
        QpType::Ud => match (from, to) {
            (_, Reset) | (_, Err) => rule(NONE, NONE),
            (Reset, Init) => rule(M::PKEY_INDEX.union(M::PORT).union(M::QKEY), NONE),
            (Init, Init) => rule(NONE, M::PKEY_INDEX.union(M::PORT).union(M::QKEY)),
            (Init, Rtr) => rule(NONE, M::PKEY_INDEX.union(M::QKEY)),
            (Rtr, Rts) => rule(M::SQ_PSN, M::CUR_STATE.union(M::QKEY)),
            (Rts, Rts) | (Sqd, Rts) => rule(NONE, M::CUR_STATE.union(M::QKEY)),
            (Rts, Sqd) => rule(NONE, M::EN_SQD_ASYNC_NOTIFY),
            (Sqd, Sqd) => rule(NONE, M::PKEY_INDEX.union(M::QKEY)),
            (Sqe, Rts) => rule(NONE, M::CUR_STATE.union(M::QKEY)),
            _ => None,
        },
    }
}
