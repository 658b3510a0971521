//! The three modifies that take a queue pair from RESET to RTS.

use super::{Mtu, QpAttr, QpAttrMask, QpState, QpType};
use crate::access::Access;

/// What one side needs to bring an RC queue pair from RESET to RTS, the fields
/// `ibv_rc_pingpong` sets (the peer's QPN and first PSN come from the peer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectParams {
    /// What the peer may do to this side's memory through the QP.
    pub access: Access,
    /// Path MTU.
    pub mtu: Mtu,
    /// The peer's QP number.
    pub dest_qpn: u32,
    /// The peer's first PSN (this side's expected PSN).
    pub rq_psn: u32,
    /// This side's first PSN.
    pub sq_psn: u32,
    /// READs/atomics this side may issue at once.
    pub max_rd_atomic: u8,
    /// READs/atomics this side accepts at once.
    pub max_dest_rd_atomic: u8,
    /// Ack timeout code.
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries (7 = forever).
    pub rnr_retry: u8,
    /// RNR timer code this side asks peers to wait.
    pub min_rnr_timer: u8,
}

impl ConnectParams {
    /// The attributes and masks of the RESET→INIT, INIT→RTR and RTR→RTS modifies, with
    /// exactly the attributes each transition requires (port 1, P_Key index 0).
    pub fn steps(&self) -> [(QpAttr, QpAttrMask); 3] {
        let init = QpAttr {
            qp_state: QpState::Init,
            pkey_index: 0,
            port_num: 1,
            qp_access_flags: self.access,
            ..QpAttr::default()
        };
        let rtr = QpAttr {
            qp_state: QpState::Rtr,
            path_mtu: self.mtu,
            dest_qp_num: self.dest_qpn,
            rq_psn: self.rq_psn,
            max_dest_rd_atomic: self.max_dest_rd_atomic,
            min_rnr_timer: self.min_rnr_timer,
            ..init.clone()
        };
        let rts = QpAttr {
            qp_state: QpState::Rts,
            sq_psn: self.sq_psn,
            timeout: self.timeout,
            retry_cnt: self.retry_cnt,
            rnr_retry: self.rnr_retry,
            max_rd_atomic: self.max_rd_atomic,
            ..rtr.clone()
        };
        [
            (
                init,
                QpAttrMask::STATE
                    | QpAttrMask::PKEY_INDEX
                    | QpAttrMask::PORT
                    | QpAttrMask::ACCESS_FLAGS,
            ),
            (
                rtr,
                QpAttrMask::STATE
                    | QpAttrMask::AV
                    | QpAttrMask::PATH_MTU
                    | QpAttrMask::DEST_QPN
                    | QpAttrMask::RQ_PSN
                    | QpAttrMask::MAX_DEST_RD_ATOMIC
                    | QpAttrMask::MIN_RNR_TIMER,
            ),
            (
                rts,
                QpAttrMask::STATE
                    | QpAttrMask::SQ_PSN
                    | QpAttrMask::TIMEOUT
                    | QpAttrMask::RETRY_CNT
                    | QpAttrMask::RNR_RETRY
                    | QpAttrMask::MAX_QP_RD_ATOMIC,
            ),
        ]
    }
}

impl ConnectParams {
    /// [`steps`](Self::steps) for a connected queue pair of type `qp_type` (RC or UC):
    /// a UC queue pair is given only what its transitions take (no read/atomic depths,
    /// RNR timer, ack timeout or retry counts). For UD see [`ud_steps`].
    pub fn steps_for(&self, qp_type: QpType) -> [(QpAttr, QpAttrMask); 3] {
        let mut steps = self.steps();
        if qp_type != QpType::Rc {
            steps[1].1 -= QpAttrMask::MAX_DEST_RD_ATOMIC | QpAttrMask::MIN_RNR_TIMER;
            steps[2].1 = QpAttrMask::STATE | QpAttrMask::SQ_PSN;
        }
        steps
    }
}

/// The RESET→INIT, INIT→RTR and RTR→RTS modifies of a UD queue pair with Q_Key `qkey`
/// and first PSN `sq_psn` (port 1, P_Key index 0), as `ibv_ud_pingpong` makes them.
pub fn ud_steps(qkey: u32, sq_psn: u32) -> [(QpAttr, QpAttrMask); 3] {
    let init = QpAttr {
        qp_state: QpState::Init,
        pkey_index: 0,
        port_num: 1,
        qkey,
        ..QpAttr::default()
    };
    let rtr = QpAttr {
        qp_state: QpState::Rtr,
        ..init.clone()
    };
    let rts = QpAttr {
        qp_state: QpState::Rts,
        sq_psn,
        ..init.clone()
    };
    [
        (
            init,
            QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::QKEY,
        ),
        (rtr, QpAttrMask::STATE),
        (rts, QpAttrMask::STATE | QpAttrMask::SQ_PSN),
    ]
}
