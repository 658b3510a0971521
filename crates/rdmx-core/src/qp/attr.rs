//! Queue-pair attributes: the mask, the values, the MTU and the device limits they are
//! checked against.

use std::cmp::Ordering;
use std::hash::{Hash, Hasher};
use std::time::Duration;

use bitflags::bitflags;

use super::QpState;
use crate::access::Access;

bitflags! {
    /// Which fields of a [`QpAttr`] a modify carries (`ibv_qp_attr_mask`).
    ///
    /// The bit values are those of `enum ibv_qp_attr_mask`, so a provider backed by real
    /// verbs can pass [`QpAttrMask::bits`] through unchanged.
    ///
    /// Some bits name attributes that [`QpAttr`] has no field for, because their values
    /// belong to the provider, not to this state machine: [`AV`](Self::AV) (the primary
    /// address vector; the provider takes the peer's address alongside the modify, and
    /// `INIT → RTR` still requires the bit, as verbs does), [`ALT_PATH`](Self::ALT_PATH)
    /// and [`PATH_MIG_STATE`](Self::PATH_MIG_STATE) (automatic path migration), and
    /// [`QKEY`](Self::QKEY) and [`CAP`](Self::CAP), which no RC transition accepts.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
    pub struct QpAttrMask: u32 {
        /// `IBV_QP_STATE`: move to [`QpAttr::qp_state`].
        const STATE = 1 << 0;
        /// `IBV_QP_CUR_STATE`: the caller's belief about the current state
        /// ([`QpAttr::cur_qp_state`]).
        const CUR_STATE = 1 << 1;
        /// `IBV_QP_EN_SQD_ASYNC_NOTIFY`: [`QpAttr::en_sqd_async_notify`].
        const EN_SQD_ASYNC_NOTIFY = 1 << 2;
        /// `IBV_QP_ACCESS_FLAGS`: [`QpAttr::qp_access_flags`].
        const ACCESS_FLAGS = 1 << 3;
        /// `IBV_QP_PKEY_INDEX`: [`QpAttr::pkey_index`].
        const PKEY_INDEX = 1 << 4;
        /// `IBV_QP_PORT`: [`QpAttr::port_num`].
        const PORT = 1 << 5;
        /// `IBV_QP_QKEY`: [`QpAttr::qkey`]; UD only, no RC or UC transition accepts it.
        const QKEY = 1 << 6;
        /// `IBV_QP_AV`: the primary address vector, passed to the provider alongside.
        const AV = 1 << 7;
        /// `IBV_QP_PATH_MTU`: [`QpAttr::path_mtu`].
        const PATH_MTU = 1 << 8;
        /// `IBV_QP_TIMEOUT`: [`QpAttr::timeout`].
        const TIMEOUT = 1 << 9;
        /// `IBV_QP_RETRY_CNT`: [`QpAttr::retry_cnt`].
        const RETRY_CNT = 1 << 10;
        /// `IBV_QP_RNR_RETRY`: [`QpAttr::rnr_retry`].
        const RNR_RETRY = 1 << 11;
        /// `IBV_QP_RQ_PSN`: [`QpAttr::rq_psn`].
        const RQ_PSN = 1 << 12;
        /// `IBV_QP_MAX_QP_RD_ATOMIC`: [`QpAttr::max_rd_atomic`].
        const MAX_QP_RD_ATOMIC = 1 << 13;
        /// `IBV_QP_ALT_PATH`: the alternate path, passed to the provider alongside.
        const ALT_PATH = 1 << 14;
        /// `IBV_QP_MIN_RNR_TIMER`: [`QpAttr::min_rnr_timer`].
        const MIN_RNR_TIMER = 1 << 15;
        /// `IBV_QP_SQ_PSN`: [`QpAttr::sq_psn`].
        const SQ_PSN = 1 << 16;
        /// `IBV_QP_MAX_DEST_RD_ATOMIC`: [`QpAttr::max_dest_rd_atomic`].
        const MAX_DEST_RD_ATOMIC = 1 << 17;
        /// `IBV_QP_PATH_MIG_STATE`: the migration state, passed to the provider alongside.
        const PATH_MIG_STATE = 1 << 18;
        /// `IBV_QP_CAP`: queue sizes; no RC transition accepts it.
        const CAP = 1 << 19;
        /// `IBV_QP_DEST_QPN`: [`QpAttr::dest_qp_num`].
        const DEST_QPN = 1 << 20;
    }
}

/// Largest PSN or QP number plus one: both are 24-bit fields on the wire.
pub const PSN_LIMIT: u32 = 1 << 24;

/// Largest value of the 5-bit timer codes ([`QpAttr::timeout`], [`QpAttr::min_rnr_timer`]).
pub const MAX_TIMER_CODE: u8 = 31;

/// Largest retry count ([`QpAttr::retry_cnt`], [`QpAttr::rnr_retry`]): a 3-bit field.
pub const MAX_RETRY: u8 = 7;

/// The [`QpAttr::rnr_retry`] value that means "retry RNR NAKs forever".
pub const RNR_RETRY_INFINITE: u8 = 7;

/// The attributes of a queue pair (`struct ibv_qp_attr`, the RC, UC and UD fields).
///
/// A modify reads only the fields whose bit is in its [`QpAttrMask`]; the others are
/// ignored, so `..QpAttr::default()` fills them harmlessly.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct QpAttr {
    /// State to move to ([`QpAttrMask::STATE`]).
    pub qp_state: QpState,
    /// The state the caller believes the QP is in ([`QpAttrMask::CUR_STATE`]); a modify
    /// whose belief is wrong is refused. In [`QpStateMachine::attrs`](super::QpStateMachine::attrs)
    /// it always equals `qp_state`.
    pub cur_qp_state: QpState,
    /// Ask for the "send queue drained" event when entering SQD
    /// ([`QpAttrMask::EN_SQD_ASYNC_NOTIFY`]).
    pub en_sqd_async_notify: bool,
    /// What remote peers may do through this QP ([`QpAttrMask::ACCESS_FLAGS`]):
    /// `REMOTE_WRITE`, `REMOTE_READ`, `REMOTE_ATOMIC`.
    ///
    /// Unlike a memory region's flags, any combination is valid here: the verbs rule that
    /// remote write or atomic access needs `LOCAL_WRITE` ([`Access::validate`]) is a
    /// memory-region rule, and neither the kernel nor rdma-core applies it to QPs.
    /// `LOCAL_WRITE` means nothing on a QP; it is accepted and stored as given.
    pub qp_access_flags: Access,
    /// Index into the port's partition-key table ([`QpAttrMask::PKEY_INDEX`]).
    pub pkey_index: u16,
    /// Physical port, counted from 1 ([`QpAttrMask::PORT`]).
    pub port_num: u8,
    /// Path MTU ([`QpAttrMask::PATH_MTU`]).
    pub path_mtu: Mtu,
    /// The peer's QP number, 24 bits ([`QpAttrMask::DEST_QPN`]).
    pub dest_qp_num: u32,
    /// First PSN expected from the peer, 24 bits ([`QpAttrMask::RQ_PSN`]).
    pub rq_psn: u32,
    /// First PSN this QP sends, 24 bits ([`QpAttrMask::SQ_PSN`]).
    pub sq_psn: u32,
    /// RDMA READs and atomics this QP may have outstanding as initiator
    /// ([`QpAttrMask::MAX_QP_RD_ATOMIC`]).
    pub max_rd_atomic: u8,
    /// RDMA READs and atomics this QP accepts outstanding as responder
    /// ([`QpAttrMask::MAX_DEST_RD_ATOMIC`]).
    pub max_dest_rd_atomic: u8,
    /// The RNR NAK timer this QP advertises as responder: the raw 5-bit IBTA code
    /// ([`QpAttrMask::MIN_RNR_TIMER`]). The wire crate turns codes into times.
    pub min_rnr_timer: u8,
    /// The local ACK timeout: the 5-bit code `t`, meaning 4.096 µs × 2^t, with 0 meaning
    /// infinite ([`QpAttrMask::TIMEOUT`]); see [`timeout_duration`].
    pub timeout: u8,
    /// Retransmissions after a timeout before failing, at most 7
    /// ([`QpAttrMask::RETRY_CNT`]).
    pub retry_cnt: u8,
    /// Retries after an RNR NAK before failing, at most 7; 7 means forever
    /// ([`QpAttrMask::RNR_RETRY`]).
    pub rnr_retry: u8,
    /// The Q_Key of a UD queue pair ([`QpAttrMask::QKEY`]): a datagram is accepted only
    /// if its DETH carries it, and a send whose work request names a Q_Key with the high
    /// bit set sends this one instead.
    pub qkey: u32,
}

/// The local ACK timeout that the 5-bit code `code` stands for: 4.096 µs × 2^code, or
/// `None` for code 0, which means wait forever.
///
/// Only the low 5 bits are used, as in the IBTA field; a modify refuses larger codes, so
/// stored attributes never have the others set.
pub fn timeout_duration(code: u8) -> Option<Duration> {
    match code & MAX_TIMER_CODE {
        0 => None,
        c => Some(Duration::from_nanos(4096 << c)),
    }
}

/// A path MTU.
///
/// The five InfiniBand sizes have their own variants (`IBV_MTU_256` … `IBV_MTU_4096`).
/// Software providers that are not bound by a link MTU (the TCP provider segments at,
/// say, 64 KiB) use [`Mtu::Bytes`], which must be a power of two of at least 256 bytes
/// ([`Mtu::is_valid`]); a modify also checks it against the device's
/// [`QpLimits::max_mtu`].
///
/// Comparison, ordering and hashing go by [`Mtu::bytes`], so `Mtu::Bytes(1024)` equals
/// `Mtu::Mtu1024`; [`Mtu::from_bytes`] always returns the named variant for IB sizes.
#[derive(Clone, Copy, Debug, Default)]
pub enum Mtu {
    /// 256 bytes (`IBV_MTU_256`).
    #[default]
    Mtu256,
    /// 512 bytes (`IBV_MTU_512`).
    Mtu512,
    /// 1024 bytes (`IBV_MTU_1024`).
    Mtu1024,
    /// 2048 bytes (`IBV_MTU_2048`).
    Mtu2048,
    /// 4096 bytes (`IBV_MTU_4096`).
    Mtu4096,
    /// Any other size, for software providers: a power of two, at least 256.
    Bytes(u32),
}

impl Mtu {
    /// The size in bytes.
    pub const fn bytes(self) -> u32 {
        match self {
            Mtu::Mtu256 => 256,
            Mtu::Mtu512 => 512,
            Mtu::Mtu1024 => 1024,
            Mtu::Mtu2048 => 2048,
            Mtu::Mtu4096 => 4096,
            Mtu::Bytes(n) => n,
        }
    }

    /// The MTU of `bytes` bytes, if that is a valid size; IB sizes give named variants.
    pub const fn from_bytes(bytes: u32) -> Option<Mtu> {
        match bytes {
            256 => Some(Mtu::Mtu256),
            512 => Some(Mtu::Mtu512),
            1024 => Some(Mtu::Mtu1024),
            2048 => Some(Mtu::Mtu2048),
            4096 => Some(Mtu::Mtu4096),
            n if n >= 256 && n.is_power_of_two() => Some(Mtu::Bytes(n)),
            _ => None,
        }
    }

    /// Whether the size is a power of two of at least 256 bytes.
    pub const fn is_valid(self) -> bool {
        let n = self.bytes();
        n >= 256 && n.is_power_of_two()
    }

    /// The `enum ibv_mtu` value (1 for 256 … 5 for 4096), if this is an IB size.
    pub const fn ib_code(self) -> Option<u8> {
        match self.bytes() {
            256 => Some(1),
            512 => Some(2),
            1024 => Some(3),
            2048 => Some(4),
            4096 => Some(5),
            _ => None,
        }
    }

    /// The MTU for an `enum ibv_mtu` value (1 to 5).
    pub const fn from_ib_code(code: u8) -> Option<Mtu> {
        match code {
            1 => Some(Mtu::Mtu256),
            2 => Some(Mtu::Mtu512),
            3 => Some(Mtu::Mtu1024),
            4 => Some(Mtu::Mtu2048),
            5 => Some(Mtu::Mtu4096),
            _ => None,
        }
    }
}

impl PartialEq for Mtu {
    fn eq(&self, other: &Mtu) -> bool {
        self.bytes() == other.bytes()
    }
}

impl Eq for Mtu {}

impl Hash for Mtu {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.bytes().hash(state);
    }
}

impl PartialOrd for Mtu {
    fn partial_cmp(&self, other: &Mtu) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Mtu {
    fn cmp(&self, other: &Mtu) -> Ordering {
        self.bytes().cmp(&other.bytes())
    }
}

/// What the device allows, for checking attribute values (from `ibv_device_attr` and
/// `ibv_port_attr`).
///
/// The two read/atomic depths are named after the [`QpAttr`] fields they bound.
/// IBTA gives the initiator depth as `max_qp_init_rd_atom` and the responder depth as
/// `max_qp_rd_atom`; drivers do not agree on this (mlx4 and rdmavt follow it, mlx5
/// reports them the other way round), so a provider fills these from whatever its device
/// means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct QpLimits {
    /// Largest [`QpAttr::max_rd_atomic`] (initiator depth).
    pub max_rd_atomic: u8,
    /// Largest [`QpAttr::max_dest_rd_atomic`] (responder depth).
    pub max_dest_rd_atomic: u8,
    /// Largest [`QpAttr::path_mtu`] (`ibv_port_attr.max_mtu`).
    pub max_mtu: Mtu,
    /// Physical ports (`phys_port_cnt`); valid port numbers are `1..=ports`.
    pub ports: u8,
    /// Entries in the partition-key table (`pkey_tbl_len`); valid indices are below it.
    pub pkey_table_len: u16,
}

impl Default for QpLimits {
    /// A software device: 16-deep reads and atomics each way, 4096-byte MTU, one port,
    /// one partition key (the default key at index 0).
    fn default() -> QpLimits {
        QpLimits {
            max_rd_atomic: 16,
            max_dest_rd_atomic: 16,
            max_mtu: Mtu::Mtu4096,
            ports: 1,
            pkey_table_len: 1,
        }
    }
}

/// Checks the value of every attribute in `mask`, in bit order, and names the first bad
/// one.
pub(super) fn check_values(
    attr: &QpAttr,
    mask: QpAttrMask,
    limits: &QpLimits,
) -> Result<(), (QpAttrMask, &'static str)> {
    let checks: [(QpAttrMask, bool, &'static str); 13] = [
        (
            QpAttrMask::PKEY_INDEX,
            attr.pkey_index < limits.pkey_table_len,
            "pkey_index is outside the partition-key table",
        ),
        (
            QpAttrMask::PORT,
            attr.port_num >= 1 && attr.port_num <= limits.ports,
            "port_num is not a port of the device",
        ),
        (
            QpAttrMask::PATH_MTU,
            attr.path_mtu.is_valid(),
            "path_mtu is not a power of two of at least 256 bytes",
        ),
        (
            QpAttrMask::PATH_MTU,
            attr.path_mtu <= limits.max_mtu,
            "path_mtu exceeds the device's max_mtu",
        ),
        (
            QpAttrMask::TIMEOUT,
            attr.timeout <= MAX_TIMER_CODE,
            "timeout is a 5-bit code (at most 31)",
        ),
        (
            QpAttrMask::RETRY_CNT,
            attr.retry_cnt <= MAX_RETRY,
            "retry_cnt is at most 7",
        ),
        (
            QpAttrMask::RNR_RETRY,
            attr.rnr_retry <= MAX_RETRY,
            "rnr_retry is at most 7",
        ),
        (
            QpAttrMask::RQ_PSN,
            attr.rq_psn < PSN_LIMIT,
            "rq_psn is a 24-bit value",
        ),
        (
            QpAttrMask::MAX_QP_RD_ATOMIC,
            attr.max_rd_atomic <= limits.max_rd_atomic,
            "max_rd_atomic exceeds the device limit",
        ),
        (
            QpAttrMask::MIN_RNR_TIMER,
            attr.min_rnr_timer <= MAX_TIMER_CODE,
            "min_rnr_timer is a 5-bit code (at most 31)",
        ),
        (
            QpAttrMask::SQ_PSN,
            attr.sq_psn < PSN_LIMIT,
            "sq_psn is a 24-bit value",
        ),
        (
            QpAttrMask::MAX_DEST_RD_ATOMIC,
            attr.max_dest_rd_atomic <= limits.max_dest_rd_atomic,
            "max_dest_rd_atomic exceeds the device limit",
        ),
        (
            QpAttrMask::DEST_QPN,
            attr.dest_qp_num < PSN_LIMIT,
            "dest_qp_num is a 24-bit value",
        ),
    ];
    for (bit, ok, reason) in checks {
        if mask.contains(bit) && !ok {
            return Err((bit, reason));
        }
    }
    Ok(())
}

/// Copies the fields named in `mask` from `from` into `to` (the state fields excepted).
pub(super) fn apply(to: &mut QpAttr, from: &QpAttr, mask: QpAttrMask) {
    let set = |bit: QpAttrMask| mask.contains(bit);
    if set(QpAttrMask::EN_SQD_ASYNC_NOTIFY) {
        to.en_sqd_async_notify = from.en_sqd_async_notify;
    }
    if set(QpAttrMask::ACCESS_FLAGS) {
        to.qp_access_flags = from.qp_access_flags;
    }
    if set(QpAttrMask::PKEY_INDEX) {
        to.pkey_index = from.pkey_index;
    }
    if set(QpAttrMask::PORT) {
        to.port_num = from.port_num;
    }
    if set(QpAttrMask::PATH_MTU) {
        // Valid by now; store IB sizes as their named variants.
        to.path_mtu = Mtu::from_bytes(from.path_mtu.bytes()).unwrap_or(from.path_mtu);
    }
    if set(QpAttrMask::TIMEOUT) {
        to.timeout = from.timeout;
    }
    if set(QpAttrMask::RETRY_CNT) {
        to.retry_cnt = from.retry_cnt;
    }
    if set(QpAttrMask::RNR_RETRY) {
        to.rnr_retry = from.rnr_retry;
    }
    if set(QpAttrMask::RQ_PSN) {
        to.rq_psn = from.rq_psn;
    }
    if set(QpAttrMask::MAX_QP_RD_ATOMIC) {
        to.max_rd_atomic = from.max_rd_atomic;
    }
    if set(QpAttrMask::MIN_RNR_TIMER) {
        to.min_rnr_timer = from.min_rnr_timer;
    }
    if set(QpAttrMask::SQ_PSN) {
        to.sq_psn = from.sq_psn;
    }
    if set(QpAttrMask::QKEY) {
        to.qkey = from.qkey;
    }
    if set(QpAttrMask::MAX_DEST_RD_ATOMIC) {
        to.max_dest_rd_atomic = from.max_dest_rd_atomic;
    }
    if set(QpAttrMask::DEST_QPN) {
        to.dest_qp_num = from.dest_qp_num;
    }
}
