//! The RC queue-pair state machine: which `modify_qp` calls are legal, with which
//! attributes and values, and what each state lets the queues do.
//!
//! Every provider (loopback, TCP, real verbs) runs the same rules here before it acts:
//! [`QpStateMachine::modify`] checks a modify against the verbs transition table and the
//! device's [`QpLimits`] and either applies all of it or none of it, and the posting and
//! processing queries say what the current state allows. No I/O and no clock.
//!
//! ## States
//!
//! ```text
//!                                   +-------+
//!            any state ------------>| RESET |  attributes cleared
//!                                   +-------+
//!                                       |
//!                                       | PKEY_INDEX, PORT, ACCESS_FLAGS
//!                                       v
//!                                   +-------+---+
//!                                   | INIT  |   | opt: PKEY_INDEX, PORT, ACCESS_FLAGS
//!                                   +-------+<--+
//!                                       |
//!                                       | AV, PATH_MTU, DEST_QPN, RQ_PSN,
//!                                       | MAX_DEST_RD_ATOMIC, MIN_RNR_TIMER
//!                                       v
//!                                   +-------+
//!                                   |  RTR  |
//!                                   +-------+
//!                                       |
//!                                       | TIMEOUT, RETRY_CNT, RNR_RETRY, SQ_PSN,
//!                                       | MAX_QP_RD_ATOMIC
//!                                       v
//!       +-------+                   +-------+---+
//!       |  SQE  |------------------>|  RTS  |   | opt: ACCESS_FLAGS, MIN_RNR_TIMER,
//!       +-------+   (never for RC)  +-------+<--+      ALT_PATH, PATH_MIG_STATE
//!                                     |   ^
//!           opt: EN_SQD_ASYNC_NOTIFY  |   |  once drained; opt: ACCESS_FLAGS,
//!                                     v   |  MIN_RNR_TIMER, ALT_PATH, PATH_MIG_STATE
//!                                   +-------+---+
//!                                   |  SQD  |   | once drained; opt: PORT, AV, TIMEOUT,
//!                                   +-------+<--+ RETRY_CNT, RNR_RETRY, both rd/atomic
//!                                                 depths, ACCESS_FLAGS, PKEY_INDEX, ...
//!
//!            any state ------------> ERR       by modify, or when the engine fails the QP
//! ```
//!
//! The names on the arrows are the required [`QpAttrMask`] bits, "opt:" the optional
//! ones; [`rc_rule`] has the exact table. `STATE` may always be given, `CUR_STATE` only on
//! the transitions into RTS from RTR, RTS and SQD. A modify without `STATE` is the
//! transition from the current state to itself, so attribute-only modifies are legal in
//! INIT, RTS and SQD (and, with no attributes, in RESET and ERR) and nowhere else.
//!
//! ## Modify checks
//!
//! In this order, stopping at the first failure, with nothing changed on failure:
//!
//! 1. `CUR_STATE`, if given, must be the actual state ([`ModifyError::CurStateMismatch`]).
//! 2. The pair must be in the table ([`ModifyError::IllegalTransition`]).
//! 3. Every required attribute must be given ([`ModifyError::MissingAttrs`]), and nothing
//!    else than required, optional and `STATE` ([`ModifyError::UnexpectedAttrs`]).
//! 4. Out of SQD, only ERR and RESET are accepted until the send queue has drained
//!    ([`ModifyError::SqDraining`]).
//! 5. Each given value must be in range ([`ModifyError::InvalidValue`]): retry counts at
//!    most 7, timer codes at most 31, PSNs and the QP number below 2^24, read/atomic
//!    depths and the MTU within [`QpLimits`], the port in `1..=ports`, the partition-key
//!    index inside the table. QP access flags take any combination; see
//!    [`QpAttr::qp_access_flags`].
//!
//! ## Posting and processing
//!
//! As rdmavt (`ib_rvt_state_ops`, after IBTA C10-96) and rxe do:
//!
//! | state | post send | post recv | sends | receives |
//! |-------|-----------|-----------|-------|----------|
//! | RESET | refused   | refused   | –     | –        |
//! | INIT  | refused   | queued    | –     | incoming packets dropped |
//! | RTR   | refused   | queued    | –     | processed |
//! | RTS   | queued    | queued    | started and processed | processed |
//! | SQD   | queued    | queued    | in-flight ones finish, none started | processed |
//! | SQE   | accepted  | queued    | flushed | processed |
//! | ERR   | accepted  | accepted  | flushed | flushed |
//!
//! A refused post fails at once with `EINVAL` in rdma-core and the kernel; the
//! work-request layer reports it as `PostError::WrongState`. "Flushed" means every
//! outstanding and every newly posted request completes with `IBV_WC_WR_FLUSH_ERR`
//! instead of running.
//!
//! ## Where this differs from, or interprets, the kernel
//!
//! - `CUR_STATE` is a checked assertion here. The kernel instead uses the value given as
//!   the current state for the table lookup, trusting the caller.
//! - The kernel's table says nothing about draining; rxe refuses every modify out of a
//!   draining SQD except to ERR. This machine also lets RESET through, since any state may
//!   be reset.
//! - RC QPs never enter SQE (IBTA sends them to ERR on a send error; rdmavt refuses SQE for
//!   RC). The state and its `SQE → RTS` row are kept so the table matches the kernel's,
//!   but no modify or engine call here leads into SQE.
//! - The address vector, alternate path and path-migration state have mask bits but no
//!   fields: the provider owns addresses and takes them alongside the modify. This crate
//!   does not implement automatic path migration; `ALT_PATH` and `PATH_MIG_STATE` are
//!   accepted where the table allows them, as rxe does, and mean nothing here.

mod attr;
mod connect;
mod table;
#[cfg(test)]
mod tests;

use std::fmt;

pub use attr::{
    timeout_duration, Mtu, QpAttr, QpAttrMask, QpLimits, MAX_RETRY, MAX_TIMER_CODE, PSN_LIMIT,
    RNR_RETRY_INFINITE,
};
pub use connect::{ud_steps, ConnectParams};
pub use table::{rc_rule, rule_for, TransitionRule};

/// The transport service of a queue pair (`enum ibv_qp_type`), chosen at creation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum QpType {
    /// `IBV_QPT_RC`, reliable connected: ordered, acknowledged, retransmitted; every
    /// operation.
    #[default]
    Rc,
    /// `IBV_QPT_UC`, unreliable connected: no acknowledgement, no retransmission; a
    /// message that loses a packet is dropped whole. SEND and RDMA WRITE (with or without
    /// immediate) only.
    Uc,
    /// `IBV_QPT_UD`, unreliable datagram: connectionless, one QP reaches many through
    /// address handles, messages of at most the path MTU, SEND (with or without
    /// immediate) only, each receive buffer starting with a 40-byte GRH area.
    Ud,
}

impl QpType {
    /// Every type.
    pub const ALL: [QpType; 3] = [QpType::Rc, QpType::Uc, QpType::Ud];

    /// The name perftest's `-c` takes: `RC`, `UC` or `UD`.
    pub const fn name(self) -> &'static str {
        match self {
            QpType::Rc => "RC",
            QpType::Uc => "UC",
            QpType::Ud => "UD",
        }
    }

    /// The type named `RC`, `UC` or `UD` (any case).
    pub fn from_name(name: &str) -> Option<QpType> {
        QpType::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// Whether a send request of this opcode may be posted on this type: everything on
    /// RC; SEND and WRITE (with or without immediate) on UC; SEND (with or without
    /// immediate) on UD.
    pub fn allows(self, op: crate::wr::SendOp) -> bool {
        use crate::wr::SendOp;
        match self {
            QpType::Rc => true,
            QpType::Uc => matches!(
                op,
                SendOp::Send | SendOp::SendWithImm(_) | SendOp::Write(_) | SendOp::WriteWithImm(..)
            ),
            QpType::Ud => matches!(op, SendOp::Send | SendOp::SendWithImm(_)),
        }
    }
}

impl fmt::Display for QpType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The state of a queue pair (`enum ibv_qp_state`; the discriminants are its values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum QpState {
    /// `IBV_QPS_RESET`: just created, or reset. Nothing can be posted.
    #[default]
    Reset = 0,
    /// `IBV_QPS_INIT`: receives can be posted; incoming packets are dropped.
    Init = 1,
    /// `IBV_QPS_RTR`, ready to receive: the responder runs; sends cannot be posted yet.
    Rtr = 2,
    /// `IBV_QPS_RTS`, ready to send: fully operational.
    Rts = 3,
    /// `IBV_QPS_SQD`, send queue drained: sends already started finish, no new ones start.
    Sqd = 4,
    /// `IBV_QPS_SQE`, send queue error: UC/UD only; an RC QP never gets here.
    Sqe = 5,
    /// `IBV_QPS_ERR`: everything outstanding or posted completes with a flush error.
    Err = 6,
}

impl QpState {
    /// All states, in `ibv_qp_state` order.
    pub const ALL: [QpState; 7] = [
        QpState::Reset,
        QpState::Init,
        QpState::Rtr,
        QpState::Rts,
        QpState::Sqd,
        QpState::Sqe,
        QpState::Err,
    ];

    /// The state for an `ibv_qp_state` value.
    pub fn from_ibv(value: u32) -> Option<QpState> {
        QpState::ALL.get(usize::try_from(value).ok()?).copied()
    }

    /// The verbs name, without the `IBV_QPS_` prefix.
    pub const fn name(self) -> &'static str {
        match self {
            QpState::Reset => "RESET",
            QpState::Init => "INIT",
            QpState::Rtr => "RTR",
            QpState::Rts => "RTS",
            QpState::Sqd => "SQD",
            QpState::Sqe => "SQE",
            QpState::Err => "ERR",
        }
    }

    /// Whether `ibv_post_send` accepts requests: RTS, SQD, SQE and ERR. In SQD they wait
    /// for RTS; in SQE and ERR they complete with a flush error.
    pub const fn post_send_allowed(self) -> bool {
        matches!(
            self,
            QpState::Rts | QpState::Sqd | QpState::Sqe | QpState::Err
        )
    }

    /// Whether `ibv_post_recv` accepts requests: every state but RESET. In ERR they
    /// complete with a flush error.
    pub const fn post_recv_allowed(self) -> bool {
        !matches!(self, QpState::Reset)
    }

    /// Whether the send queue may start a request it has not started yet: RTS only.
    pub const fn starts_sends(self) -> bool {
        matches!(self, QpState::Rts)
    }

    /// Whether the send queue carries on with requests it has started (sending,
    /// retransmitting, taking acknowledgements): RTS, and SQD while it drains.
    pub const fn processes_sends(self) -> bool {
        matches!(self, QpState::Rts | QpState::Sqd)
    }

    /// Whether incoming requests are executed and answered: RTR, RTS, SQD and SQE. In
    /// RESET and INIT they are dropped; in ERR they are not answered.
    pub const fn processes_receives(self) -> bool {
        matches!(
            self,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        )
    }

    /// Whether send requests complete with a flush error instead of running: SQE and ERR.
    pub const fn flushes_sends(self) -> bool {
        matches!(self, QpState::Sqe | QpState::Err)
    }

    /// Whether receive requests complete with a flush error instead of running: ERR.
    pub const fn flushes_receives(self) -> bool {
        matches!(self, QpState::Err)
    }

    /// Whether both queues are flushed: ERR.
    pub const fn flushes(self) -> bool {
        matches!(self, QpState::Err)
    }
}

impl fmt::Display for QpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A modify that was applied: the engine reacts to it (entering ERR flushes, entering
/// RTR or RTS arms the responder or requester, entering RESET empties the queues).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transition {
    /// The state before.
    pub from: QpState,
    /// The state after (equal to `from` for an attribute-only modify).
    pub to: QpState,
    /// The attributes that were given.
    pub mask: QpAttrMask,
}

impl Transition {
    /// Whether the state changed.
    pub fn changed_state(&self) -> bool {
        self.from != self.to
    }
}

/// Why a modify was refused. Nothing was changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ModifyError {
    /// Verbs does not allow this pair of states (`EINVAL`).
    #[error("an RC queue pair cannot move from {from} to {to}")]
    IllegalTransition {
        /// The current state.
        from: QpState,
        /// The state asked for.
        to: QpState,
    },
    /// `CUR_STATE` was given and is not the actual state.
    #[error("the modify assumes state {given} but the queue pair is in {actual}")]
    CurStateMismatch {
        /// The value of `cur_qp_state`.
        given: QpState,
        /// The actual state.
        actual: QpState,
    },
    /// The transition requires these attributes and they were not given.
    #[error("missing required attributes {0:?}")]
    MissingAttrs(QpAttrMask),
    /// The transition does not accept these attributes.
    #[error("attributes {0:?} are not accepted by this transition")]
    UnexpectedAttrs(QpAttrMask),
    /// The QP is in SQD and its send queue has not drained yet; only ERR and RESET are
    /// accepted until it has.
    #[error("the send queue is still draining; only ERR and RESET are accepted")]
    SqDraining,
    /// An attribute's value is out of range.
    #[error("invalid {attr:?}: {reason}")]
    InvalidValue {
        /// The attribute (a single bit).
        attr: QpAttrMask,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// The state and attributes of one RC queue pair.
#[derive(Clone, Debug, Default)]
pub struct QpStateMachine {
    attrs: QpAttr,
    sq_draining: bool,
    qp_type: QpType,
}

impl QpStateMachine {
    /// A QP as created: in RESET, with default attributes.
    pub fn new() -> QpStateMachine {
        QpStateMachine::default()
    }

    /// A QP of type `qp_type` as created: in RESET, with default attributes.
    pub fn with_type(qp_type: QpType) -> QpStateMachine {
        QpStateMachine {
            qp_type,
            ..QpStateMachine::default()
        }
    }

    /// The QP's type, which chooses its transition table.
    pub fn qp_type(&self) -> QpType {
        self.qp_type
    }

    /// The current state.
    pub fn state(&self) -> QpState {
        self.attrs.qp_state
    }

    /// The current attributes, as `ibv_query_qp` would report them: `qp_state` and
    /// `cur_qp_state` are the current state, `en_sqd_async_notify` is as given on the
    /// last entry to SQD, and everything else is as last set (default after RESET).
    pub fn attrs(&self) -> &QpAttr {
        &self.attrs
    }

    /// Whether the QP is in SQD and its send queue has not drained yet
    /// (`ibv_qp_attr.sq_draining`).
    pub fn sq_draining(&self) -> bool {
        self.sq_draining
    }

    /// Checks a modify (`ibv_modify_qp`) without applying it, and says what it would do.
    ///
    /// The target state is `attr.qp_state` if `mask` has [`QpAttrMask::STATE`], else the
    /// current state. See the [module docs](self) for the checks and their order.
    pub fn check(
        &self,
        attr: &QpAttr,
        mask: QpAttrMask,
        limits: &QpLimits,
    ) -> Result<Transition, ModifyError> {
        let from = self.state();
        let to = if mask.contains(QpAttrMask::STATE) {
            attr.qp_state
        } else {
            from
        };
        if mask.contains(QpAttrMask::CUR_STATE) && attr.cur_qp_state != from {
            return Err(ModifyError::CurStateMismatch {
                given: attr.cur_qp_state,
                actual: from,
            });
        }
        let rule =
            rule_for(self.qp_type, from, to).ok_or(ModifyError::IllegalTransition { from, to })?;
        let missing = rule.required.difference(mask);
        if !missing.is_empty() {
            return Err(ModifyError::MissingAttrs(missing));
        }
        // Keep unknown bits: they are unexpected too.
        let unexpected = QpAttrMask::from_bits_retain(mask.bits() & !rule.allowed().bits());
        if !unexpected.is_empty() {
            return Err(ModifyError::UnexpectedAttrs(unexpected));
        }
        if self.sq_draining && !matches!(to, QpState::Err | QpState::Reset) {
            return Err(ModifyError::SqDraining);
        }
        attr::check_values(attr, mask, limits)
            .map_err(|(attr, reason)| ModifyError::InvalidValue { attr, reason })?;
        Ok(Transition { from, to, mask })
    }

    /// Checks and applies a modify (`ibv_modify_qp`): all of it, or on error none of it.
    ///
    /// Entering RESET clears every attribute back to its default. Entering SQD from RTS
    /// starts draining: the engine calls [`sq_drained`](Self::sq_drained) once no started
    /// send is outstanding (at once if none is).
    pub fn modify(
        &mut self,
        attr: &QpAttr,
        mask: QpAttrMask,
        limits: &QpLimits,
    ) -> Result<Transition, ModifyError> {
        let t = self.check(attr, mask, limits)?;
        match t.to {
            QpState::Reset => {
                *self = QpStateMachine::with_type(self.qp_type);
                return Ok(t);
            }
            QpState::Err => self.sq_draining = false,
            QpState::Sqd if t.from == QpState::Rts => {
                self.sq_draining = true;
                self.attrs.en_sqd_async_notify =
                    attr.en_sqd_async_notify && mask.contains(QpAttrMask::EN_SQD_ASYNC_NOTIFY);
            }
            _ => {}
        }
        attr::apply(
            &mut self.attrs,
            attr,
            mask.difference(QpAttrMask::EN_SQD_ASYNC_NOTIFY),
        );
        self.attrs.qp_state = t.to;
        self.attrs.cur_qp_state = t.to;
        Ok(t)
    }

    /// Moves the QP to ERR on the engine's own account (a retry count exhausted, a fatal
    /// NAK, a local protection error), as the adapter does before raising
    /// `IBV_EVENT_QP_FATAL` and the like. `None` if it was already in ERR.
    pub fn set_error(&mut self) -> Option<Transition> {
        let from = self.state();
        if from == QpState::Err {
            return None;
        }
        self.sq_draining = false;
        self.attrs.qp_state = QpState::Err;
        self.attrs.cur_qp_state = QpState::Err;
        Some(Transition {
            from,
            to: QpState::Err,
            mask: QpAttrMask::empty(),
        })
    }

    /// The engine reports that the SQ has drained: nothing it started in RTS is still
    /// outstanding. Returns whether to raise `IBV_EVENT_SQ_DRAINED` (the modify into SQD
    /// asked for it with `en_sqd_async_notify`). Does nothing, and returns `false`, unless
    /// the QP is draining.
    pub fn sq_drained(&mut self) -> bool {
        if !self.sq_draining {
            return false;
        }
        self.sq_draining = false;
        self.attrs.en_sqd_async_notify
    }

    /// Whether `ibv_post_send` accepts requests now; see [`QpState::post_send_allowed`].
    pub fn post_send_allowed(&self) -> bool {
        self.state().post_send_allowed()
    }

    /// Whether `ibv_post_recv` accepts requests now; see [`QpState::post_recv_allowed`].
    pub fn post_recv_allowed(&self) -> bool {
        self.state().post_recv_allowed()
    }

    /// Whether the send queue may start new requests now; see [`QpState::starts_sends`].
    pub fn starts_sends(&self) -> bool {
        self.state().starts_sends()
    }

    /// Whether started sends carry on now; see [`QpState::processes_sends`].
    pub fn processes_sends(&self) -> bool {
        self.state().processes_sends()
    }

    /// Whether incoming requests are executed now; see [`QpState::processes_receives`].
    pub fn processes_receives(&self) -> bool {
        self.state().processes_receives()
    }

    /// Whether both queues flush now (ERR); see [`QpState::flushes`].
    pub fn flushes(&self) -> bool {
        self.state().flushes()
    }

    /// A machine already in `state`, with default attributes, for states no modify
    /// reaches (SQE).
    #[cfg(test)]
    pub(crate) fn in_state(state: QpState) -> QpStateMachine {
        let mut m = QpStateMachine::new();
        m.attrs.qp_state = state;
        m.attrs.cur_qp_state = state;
        m
    }
}
