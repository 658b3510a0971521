//! Work requests and completions: what an application posts and what it reaps.
//!
//! Names follow verbs: [`WcStatus`] is `ibv_wc_status`, [`WcOpcode`] is `ibv_wc_opcode`,
//! [`SendFlags`] are `IBV_SEND_*`. A failed work completion is a status, not a Rust error;
//! [`PostError`] is only for posts that are refused on the spot (full queue, wrong state,
//! malformed request), as `ibv_post_send` returning an errno.

use bitflags::bitflags;

/// A scatter/gather element: `len` bytes at `addr` in the region with local key `lkey`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    /// Virtual address of the first byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// Local key of the region holding the bytes.
    pub lkey: u32,
}

/// The most scatter/gather elements one work request can carry in an [`SgeList`].
///
/// Queue pairs may allow fewer (`max_send_sge`, `max_recv_sge`); none allows more.
pub const MAX_SGE: usize = 32;

/// Elements an [`SgeList`] holds without a heap allocation.
pub const INLINE_SGE: usize = 4;

/// A scatter/gather list of up to [`MAX_SGE`] elements. The first [`INLINE_SGE`] are
/// stored inline, so a work request with that many costs no allocation to build or post;
/// a longer list moves to the heap once. The list is kept small on purpose: requests are
/// built by value on the hot path, and every move copies it.
///
/// ```
/// use rdmx_core::wr::{Sge, SgeList, MAX_SGE};
///
/// let sge = Sge { addr: 0x1000, len: 64, lkey: 7 };
/// let mut list = SgeList::new();
/// list.push(sge);
/// assert_eq!(list.as_slice(), &[sge]);
/// assert_eq!(SgeList::try_from(&[sge; MAX_SGE][..]).unwrap().len(), MAX_SGE);
/// assert!(SgeList::try_from(&[sge; MAX_SGE + 1][..]).is_err());
/// ```
#[derive(Clone)]
pub struct SgeList {
    len: u8,
    inline: [Sge; INLINE_SGE],
    /// Every element once there are more than [`INLINE_SGE`]; empty until then.
    spilled: Vec<Sge>,
}

/// An [`SgeList`] already holds [`MAX_SGE`] elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("a scatter/gather list holds at most {MAX_SGE} elements")]
pub struct SgeListFull;

impl SgeList {
    const EMPTY: Sge = Sge {
        addr: 0,
        len: 0,
        lkey: 0,
    };

    /// An empty list.
    #[inline]
    pub const fn new() -> Self {
        SgeList {
            len: 0,
            inline: [Self::EMPTY; INLINE_SGE],
            spilled: Vec::new(),
        }
    }

    /// Appends `sge`, or gives [`SgeListFull`] when the list holds [`MAX_SGE`] elements.
    #[inline]
    pub fn try_push(&mut self, sge: Sge) -> Result<(), SgeListFull> {
        let len = usize::from(self.len);
        if len >= MAX_SGE {
            return Err(SgeListFull);
        }
        if len < INLINE_SGE && self.spilled.is_empty() {
            self.inline[len] = sge;
        } else {
            if self.spilled.is_empty() {
                self.spilled.reserve(2 * INLINE_SGE);
                self.spilled.extend_from_slice(&self.inline[..len]);
            }
            self.spilled.push(sge);
        }
        self.len += 1;
        Ok(())
    }

    /// Appends `sge`.
    ///
    /// # Panics
    ///
    /// When the list already holds [`MAX_SGE`] elements; see [`try_push`](Self::try_push).
    pub fn push(&mut self, sge: Sge) {
        if self.try_push(sge).is_err() {
            panic!("a scatter/gather list holds at most {MAX_SGE} elements");
        }
    }

    /// Removes every element.
    pub fn clear(&mut self) {
        self.len = 0;
        self.spilled.clear();
    }

    /// The elements, in order.
    #[inline]
    pub fn as_slice(&self) -> &[Sge] {
        if self.spilled.is_empty() {
            &self.inline[..usize::from(self.len)]
        } else {
            &self.spilled
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        usize::from(self.len)
    }

    /// Whether the list has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The elements, in order.
    pub fn iter(&self) -> std::slice::Iter<'_, Sge> {
        self.as_slice().iter()
    }

    /// Total bytes the elements cover.
    pub fn total_len(&self) -> u64 {
        self.iter().map(|s| u64::from(s.len)).sum()
    }
}

impl Default for SgeList {
    fn default() -> Self {
        SgeList::new()
    }
}

impl std::fmt::Debug for SgeList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

impl PartialEq for SgeList {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for SgeList {}

impl std::ops::Deref for SgeList {
    type Target = [Sge];

    fn deref(&self) -> &[Sge] {
        self.as_slice()
    }
}

impl AsRef<[Sge]> for SgeList {
    fn as_ref(&self) -> &[Sge] {
        self.as_slice()
    }
}

impl<'a> IntoIterator for &'a SgeList {
    type Item = &'a Sge;
    type IntoIter = std::slice::Iter<'a, Sge>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl From<Sge> for SgeList {
    fn from(sge: Sge) -> Self {
        let mut list = SgeList::new();
        list.push(sge);
        list
    }
}

impl TryFrom<&[Sge]> for SgeList {
    type Error = SgeListFull;

    /// The elements of `sges`, or [`SgeListFull`] when there are more than [`MAX_SGE`].
    fn try_from(sges: &[Sge]) -> Result<Self, SgeListFull> {
        let mut list = SgeList::new();
        for &sge in sges {
            list.try_push(sge)?;
        }
        Ok(list)
    }
}

impl<const N: usize> TryFrom<[Sge; N]> for SgeList {
    type Error = SgeListFull;

    /// The elements of `sges`, or [`SgeListFull`] when there are more than [`MAX_SGE`].
    fn try_from(sges: [Sge; N]) -> Result<Self, SgeListFull> {
        SgeList::try_from(&sges[..])
    }
}

impl Extend<Sge> for SgeList {
    /// Appends every element.
    ///
    /// # Panics
    ///
    /// When the list would exceed [`MAX_SGE`] elements.
    fn extend<I: IntoIterator<Item = Sge>>(&mut self, iter: I) {
        for sge in iter {
            self.push(sge);
        }
    }
}

/// The remote side of a one-sided operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteAddr {
    /// Remote virtual address.
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
}

/// What a send work request does (`ibv_wr_opcode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SendOp {
    /// SEND: the gathered bytes land in the peer's next receive.
    Send,
    /// SEND with 32-bit immediate data delivered in the receive completion.
    SendWithImm(u32),
    /// RDMA WRITE of the gathered bytes to remote memory.
    Write(RemoteAddr),
    /// RDMA WRITE, then immediate data that consumes a receive at the peer.
    WriteWithImm(RemoteAddr, u32),
    /// RDMA READ of remote memory, scattered into the local SGEs.
    Read(RemoteAddr),
    /// 8-byte compare-and-swap at an 8-aligned remote address; the old value is written to
    /// the (8-byte) local SGE.
    CompareSwap {
        /// Where.
        remote: RemoteAddr,
        /// Expected value.
        compare: u64,
        /// New value if equal.
        swap: u64,
    },
    /// 8-byte fetch-and-add at an 8-aligned remote address; the old value is written to
    /// the (8-byte) local SGE.
    FetchAdd {
        /// Where.
        remote: RemoteAddr,
        /// Value to add.
        add: u64,
    },
}

impl SendOp {
    /// The completion opcode this request reports.
    pub fn wc_opcode(self) -> WcOpcode {
        match self {
            SendOp::Send | SendOp::SendWithImm(_) => WcOpcode::Send,
            SendOp::Write(_) | SendOp::WriteWithImm(..) => WcOpcode::RdmaWrite,
            SendOp::Read(_) => WcOpcode::RdmaRead,
            SendOp::CompareSwap { .. } => WcOpcode::CompSwap,
            SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
        }
    }

    /// Whether the local SGEs are written (READ and atomics) rather than read.
    pub fn writes_local(self) -> bool {
        matches!(
            self,
            SendOp::Read(_) | SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. }
        )
    }

    /// Whether the request needs a response with data (READ, atomics): these count
    /// against `max_rd_atomic` and are what FENCE waits for.
    pub fn is_read_or_atomic(self) -> bool {
        self.writes_local()
    }

    /// Whether this is an 8-byte atomic.
    pub fn is_atomic(self) -> bool {
        matches!(self, SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. })
    }
}

bitflags! {
    /// Flags of a send work request (`IBV_SEND_*`).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
    pub struct SendFlags: u32 {
        /// Produce a completion (always produced on error).
        const SIGNALED = 1 << 0;
        /// Wait for earlier READs and atomics to complete before starting.
        const FENCE = 1 << 1;
        /// Copy the payload at post time; the SGEs' keys are not checked.
        const INLINE = 1 << 2;
        /// Ask the peer for a solicited event.
        const SOLICITED = 1 << 3;
    }
}

/// Where a datagram goes: the address vector of an address handle (`ibv_ah_attr`, the
/// parts a software transport uses).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct AddressVector {
    /// Destination GID (a multicast GID for a multicast group).
    pub dgid: [u8; 16],
    /// Destination LID (InfiniBand; 0 on RoCE and the software providers).
    pub dlid: u16,
    /// Service level.
    pub sl: u8,
    /// Hop limit of the GRH.
    pub hop_limit: u8,
}

impl AddressVector {
    /// Whether the destination is a multicast group (a GID in `ff00::/8`, or an
    /// IPv4-mapped one of `224.0.0.0/4`).
    pub fn is_multicast(&self) -> bool {
        const V4_MAPPED: [u8; 12] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff];
        // An IPv6 multicast GID, or an IPv4-mapped one of 224.0.0.0/4 (RoCEv2 over IPv4).
        self.dgid[0] == 0xff || (self.dgid[..12] == V4_MAPPED && self.dgid[12] & 0xf0 == 0xe0)
    }
}

/// The QP number that names a multicast group as the destination of a UD send.
pub const MULTICAST_QPN: u32 = 0xff_ffff;

/// The destination of a UD send (`ibv_send_wr.wr.ud`): the peer's address, QP number
/// and Q_Key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct UdDest {
    /// The address handle's address vector.
    pub av: AddressVector,
    /// The destination QP ([`MULTICAST_QPN`] for a multicast group).
    pub remote_qpn: u32,
    /// The Q_Key to send; with the high bit set, the sending QP's own Q_Key is sent.
    pub remote_qkey: u32,
}

/// Bytes at the start of every UD receive buffer that hold the Global Routing Header
/// (or nothing meaningful when the datagram came without one), as verbs defines it.
pub const GRH_LEN: usize = 40;

/// A send work request (`ibv_send_wr`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// Local memory: gathered for SEND/WRITE, scattered into for READ and atomics.
    pub sges: SgeList,
    /// Flags.
    pub flags: SendFlags,
    /// UD only: where the datagram goes.
    pub ud: Option<UdDest>,
}

/// A receive work request (`ibv_recv_wr`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecvWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Where an incoming SEND is scattered.
    pub sges: SgeList,
}

/// The longest message, in bytes: 2^31, InfiniBand's `max_msg_sz`. Its packets span at
/// most half the PSN space at the smallest MTU (256 bytes: 2^23 packets), which the
/// PSN arithmetic needs.
pub const MAX_MESSAGE: u64 = 1 << 31;

impl SendWr {
    /// The post-time checks every provider makes on a send request, whatever its queue
    /// holds: at most `max_sge` elements, at most [`MAX_MESSAGE`] bytes, an atomic's remote
    /// address 8-byte aligned, and `inline` bytes only with [`SendFlags::INLINE`] on a SEND
    /// or WRITE, at most `max_inline` of them. A request that fails gives the error and is
    /// not queued.
    pub fn check(
        &self,
        inline: Option<&[u8]>,
        max_sge: usize,
        max_inline: usize,
    ) -> Result<(), PostError> {
        if self.sges.len() > max_sge {
            return Err(PostError::TooManySges {
                count: self.sges.len(),
                max: max_sge,
            });
        }
        if self.sges.total_len() > MAX_MESSAGE {
            return Err(PostError::Invalid(
                "a message longer than 2^31 bytes, the longest RDMA message",
            ));
        }
        if let SendOp::CompareSwap { remote, .. } | SendOp::FetchAdd { remote, .. } = self.op {
            if remote.addr % 8 != 0 {
                return Err(PostError::Invalid(
                    "an atomic's remote address must be 8-byte aligned",
                ));
            }
        }
        if let Some(data) = inline {
            if !self.flags.contains(SendFlags::INLINE) || self.op.writes_local() {
                return Err(PostError::Invalid(
                    "inline data needs IBV_SEND_INLINE and a SEND or WRITE",
                ));
            }
            if data.len() > max_inline {
                return Err(PostError::InlineTooLarge {
                    len: data.len(),
                    max: max_inline,
                });
            }
        }
        Ok(())
    }
}

impl RecvWr {
    /// The post-time check every provider makes on a receive request: at most `max_sge`
    /// elements.
    pub fn check(&self, max_sge: usize) -> Result<(), PostError> {
        if self.sges.len() > max_sge {
            return Err(PostError::TooManySges {
                count: self.sges.len(),
                max: max_sge,
            });
        }
        Ok(())
    }
}

/// Status of a work completion (`ibv_wc_status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcStatus {
    /// The operation completed.
    Success,
    /// Local length error: a message longer than the receive buffer, or bad SGE lengths.
    LocLenErr,
    /// Local QP operation error (an internal consistency error).
    LocQpOpErr,
    /// Local protection error: an lkey that is invalid, out of bounds or lacks access.
    LocProtErr,
    /// Flushed: the QP entered the error state before this request completed.
    WrFlushErr,
    /// Bad response: an unexpected opcode from the responder.
    BadRespErr,
    /// Local access error on the responder side of a SEND (protection error at receive).
    LocAccessErr,
    /// Remote invalid request: the responder could not process the request (opcode,
    /// length, misaligned atomic...).
    RemInvReqErr,
    /// Remote access error: the rkey is invalid, out of bounds, lacks access or belongs
    /// to another protection domain.
    RemAccessErr,
    /// Remote operational error: the responder failed to complete the operation.
    RemOpErr,
    /// Transport retries exhausted (no acknowledgement within `timeout`, `retry_cnt`
    /// times).
    RetryExcErr,
    /// RNR retries exhausted (the peer had no receive posted, `rnr_retry` times).
    RnrRetryExcErr,
    /// A general error.
    GeneralErr,
}

impl WcStatus {
    /// The verbs name, e.g. `IBV_WC_REM_ACCESS_ERR`.
    pub fn verbs_name(self) -> &'static str {
        match self {
            WcStatus::Success => "IBV_WC_SUCCESS",
            WcStatus::LocLenErr => "IBV_WC_LOC_LEN_ERR",
            WcStatus::LocQpOpErr => "IBV_WC_LOC_QP_OP_ERR",
            WcStatus::LocProtErr => "IBV_WC_LOC_PROT_ERR",
            WcStatus::WrFlushErr => "IBV_WC_WR_FLUSH_ERR",
            WcStatus::BadRespErr => "IBV_WC_BAD_RESP_ERR",
            WcStatus::LocAccessErr => "IBV_WC_LOC_ACCESS_ERR",
            WcStatus::RemInvReqErr => "IBV_WC_REM_INV_REQ_ERR",
            WcStatus::RemAccessErr => "IBV_WC_REM_ACCESS_ERR",
            WcStatus::RemOpErr => "IBV_WC_REM_OP_ERR",
            WcStatus::RetryExcErr => "IBV_WC_RETRY_EXC_ERR",
            WcStatus::RnrRetryExcErr => "IBV_WC_RNR_RETRY_EXC_ERR",
            WcStatus::GeneralErr => "IBV_WC_GENERAL_ERR",
        }
    }
}

/// Opcode of a work completion (`ibv_wc_opcode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcOpcode {
    /// A SEND (with or without immediate) completed.
    Send,
    /// An RDMA WRITE (with or without immediate) completed.
    RdmaWrite,
    /// An RDMA READ completed.
    RdmaRead,
    /// A compare-and-swap completed.
    CompSwap,
    /// A fetch-and-add completed.
    FetchAdd,
    /// A receive consumed by a SEND.
    Recv,
    /// A receive consumed by an RDMA WRITE with immediate.
    RecvRdmaWithImm,
}

/// A work completion (`ibv_wc`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The request's `wr_id`.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// What completed. On error completions verbs leaves it undefined; rdmx still fills
    /// it in.
    pub opcode: WcOpcode,
    /// Bytes received (receives) or transferred (READ); 0 where verbs leaves it undefined.
    pub byte_len: u32,
    /// Immediate data, for receives of SEND/WRITE with immediate.
    pub imm_data: Option<u32>,
    /// The local QP the request was posted on.
    pub qp_num: u32,
    /// Receives on UD queue pairs: the sender's QP number (`ibv_wc.src_qp`); 0 elsewhere.
    pub src_qp: u32,
    /// Receives on UD queue pairs: the first 40 bytes of the buffer hold a GRH
    /// (`IBV_WC_GRH`); the sender's GID is its `sgid`.
    pub grh: bool,
}

impl Default for Completion {
    /// A successful SEND completion of `wr_id` 0 on QP 0: storage to poll into.
    fn default() -> Self {
        Completion {
            wr_id: 0,
            status: WcStatus::Success,
            opcode: WcOpcode::Send,
            byte_len: 0,
            imm_data: None,
            qp_num: 0,
            src_qp: 0,
            grh: false,
        }
    }
}

/// A post was refused on the spot; nothing was queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PostError {
    /// The queue holds its maximum of outstanding requests (`ENOMEM` in verbs).
    #[error("queue full: {depth} requests outstanding")]
    QueueFull {
        /// The queue's depth.
        depth: usize,
    },
    /// The QP's state does not accept this post (`EINVAL` in verbs).
    #[error("the queue pair is in state {0:?}, which does not accept this post")]
    WrongState(crate::qp::QpState),
    /// More SGEs than the queue allows.
    #[error("{count} scatter/gather elements, the queue allows {max}")]
    TooManySges {
        /// SGEs given.
        count: usize,
        /// Maximum.
        max: usize,
    },
    /// An inline payload larger than the queue allows.
    #[error("inline payload of {len} bytes, the queue allows {max}")]
    InlineTooLarge {
        /// Bytes given.
        len: usize,
        /// Maximum.
        max: usize,
    },
    /// A request that cannot be valid (e.g. an atomic whose local SGE is not 8 bytes).
    #[error("invalid work request: {0}")]
    Invalid(&'static str),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sge(i: u64) -> Sge {
        Sge {
            addr: 0x1000 * i,
            len: i as u32,
            lkey: 1,
        }
    }

    #[test]
    fn sge_list_holds_up_to_max_sge() {
        let mut list = SgeList::default();
        assert!(list.is_empty());
        for i in 0..MAX_SGE as u64 {
            list.try_push(sge(i)).unwrap();
        }
        assert_eq!(list.len(), MAX_SGE);
        assert_eq!(list.try_push(sge(99)), Err(SgeListFull));
        assert_eq!(list.len(), MAX_SGE);
        assert_eq!(list.iter().next_back().map(|s| s.addr), Some(0x1000 * 31));
        assert_eq!(list.total_len(), (0..MAX_SGE as u64).sum::<u64>());
        list.clear();
        assert!(list.is_empty());
    }

    #[test]
    fn sge_list_keeps_order_across_the_move_to_the_heap_and_back() {
        let mut list = SgeList::new();
        for round in 0..2u64 {
            for i in 0..=INLINE_SGE as u64 {
                list.push(sge(i + round));
                let want: Vec<Sge> = (0..=i).map(|j| sge(j + round)).collect();
                assert_eq!(
                    list.as_slice(),
                    &want[..],
                    "round {round}, {} elements",
                    i + 1
                );
            }
            let copy = list.clone();
            assert_eq!(copy, list);
            list.clear();
            assert!(list.is_empty());
            assert_eq!(list.as_slice(), &[]);
        }
        // Small enough that moving a request by value stays cheap.
        assert!(std::mem::size_of::<SgeList>() <= 128);
    }

    #[test]
    #[should_panic(expected = "at most 32")]
    fn sge_list_push_past_the_end_panics() {
        let mut list = SgeList::try_from([sge(1); MAX_SGE]).unwrap();
        list.push(sge(2));
    }

    #[test]
    fn a_message_longer_than_2_to_the_31_is_refused_at_post() {
        let wr = |lens: &[u32]| {
            let mut sges = SgeList::new();
            for &len in lens {
                sges.push(Sge {
                    addr: 0x1000,
                    len,
                    lkey: 1,
                });
            }
            SendWr {
                wr_id: 1,
                op: SendOp::Read(RemoteAddr { addr: 0, rkey: 1 }),
                sges,
                flags: SendFlags::SIGNALED,
                ud: None,
            }
        };
        assert!(wr(&[1 << 31]).check(None, 4, 0).is_ok());
        assert!(wr(&[1 << 30, 1 << 30]).check(None, 4, 0).is_ok());
        for lens in [&[(1 << 31) + 1][..], &[1 << 31, 1], &[u32::MAX, u32::MAX]] {
            assert!(
                matches!(wr(lens).check(None, 4, 0), Err(PostError::Invalid(_))),
                "{lens:?}"
            );
        }
    }

    #[test]
    fn sge_lists_compare_by_their_elements() {
        let a = SgeList::try_from(&[sge(1), sge(2)][..]).unwrap();
        let mut b = SgeList::try_from(&[sge(1), sge(2), sge(3)][..]).unwrap();
        assert_ne!(a, b);
        // What a shorter list leaves behind in its storage is not part of it.
        b.clear();
        b.extend([sge(1), sge(2)]);
        assert_eq!(a, b);
        assert_eq!(a.clone(), a);
        assert_eq!(SgeList::from(sge(4)).as_slice(), &[sge(4)]);
        assert_eq!(&a[..], &[sge(1), sge(2)]);
        assert_eq!(format!("{:?}", SgeList::new()), "[]");
        assert_eq!(
            SgeList::try_from(&[sge(0); MAX_SGE + 1][..]),
            Err(SgeListFull)
        );
    }
}
