//! Verbs queue pairs: the rdmx state machine in front of the adapter's, exact queue
//! depths, and the references posted requests hold (shared receive queues: `srq`).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use parking_lot::Mutex;
use rdmx_core::{
    PostError, QpAttr, QpAttrMask, QpState, QpStateMachine, QpType, RecvWr, SendFlags, SendOp,
    SendWr, WcOpcode,
};

use super::srq::{Srq, SrqShared};
use super::{sys, verb, Device};
use crate::endpoint::{PeerAddr, QpEndpoint};
use crate::provider::{MrRef, QpCaps};
use crate::{Error, Result};

/// The bit that marks the `wr_id` the adapter sees as a receive's.
pub(super) const RECV_BIT: u64 = 1 << 63;

/// Whether an adapter `wr_id` is a receive's.
pub(super) fn is_recv(hw_wr_id: u64) -> bool {
    hw_wr_id & RECV_BIT != 0
}

/// The largest inline payload the device takes on an RC QP (0 if it takes none).
pub(super) fn probe_max_inline(ctx: &Arc<sys::Context>) -> u32 {
    let Ok(cq) = sys::Cq::create(ctx, 2).map(Arc::new) else {
        return 0;
    };
    let Ok(pd) = sys::Pd::alloc(ctx).map(Arc::new) else {
        return 0;
    };
    for inline in [1024, 512, 256, 128, 64, 32] {
        let mut cap = sys::QpCap {
            max_send_wr: 1,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: inline,
        };
        let rc = sys::consts::qp_type::IBV_QPT_RC;
        if sys::Qp::create(&pd, rc, &cq, &cq, None, &mut cap).is_ok() {
            return cap.max_inline_data.max(inline);
        }
    }
    0
}

/// A request in flight: the caller's `wr_id` and the regions it uses (and, for a UD send,
/// its address handle).
pub(super) struct Slot {
    pub(super) seq: u64,
    pub(super) wr_id: u64,
    pub(super) opcode: WcOpcode,
    pub(super) _refs: Refs,
    pub(super) _ah: Option<Arc<sys::Ah>>,
}

/// An address handle on a verbs device (`ibv_create_ah`).
pub(crate) struct Ah {
    hw: Arc<sys::Ah>,
    av: rdmx_core::AddressVector,
}

impl std::fmt::Debug for Ah {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("verbs::Ah").field("av", &self.av).finish()
    }
}

impl Ah {
    /// `ibv_create_ah` in rdmx domain `pd` for `av`, from the context's GID.
    pub(crate) fn create(
        dev: &Arc<Device>,
        pd: rdmx_core::PdId,
        av: &rdmx_core::AddressVector,
    ) -> Result<Ah> {
        let hw_pd = dev.pd(pd)?;
        let hw = sys::Ah::create(
            &hw_pd,
            dev.port,
            dev.gid_index as u8,
            av.dgid,
            av.dlid,
            av.sl,
            av.hop_limit,
        )
        .map_err(verb("ibv_create_ah"))?;
        Ok(Ah {
            hw: Arc::new(hw),
            av: *av,
        })
    }
}

impl crate::provider::Ah for Ah {
    fn av(&self) -> rdmx_core::AddressVector {
        self.av
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[derive(Default)]
struct Queue {
    next_seq: u64,
    slots: VecDeque<Slot>,
}

/// Sequence numbers each queue pair's requests start from: a window of 2^40 per queue
/// pair (the adapter's wr_ids). Completions of a destroyed queue pair may still sit in
/// the CQ when a new one gets its number (siw hands the lowest free one out again); their
/// numbers lie below the new one's window, so they match none of its requests.
static NEXT_SEQ_BASE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
const SEQ_WINDOW: u64 = 1 << 40;

/// The start of a new window of sequence numbers, for a queue pair or an SRQ. Below
/// RECV_BIT: 2^23 windows before the numbers come round.
pub(super) fn next_seq_window() -> u64 {
    NEXT_SEQ_BASE.fetch_add(SEQ_WINDOW, Ordering::Relaxed) % (RECV_BIT / 2)
}

impl Queue {
    fn starting_at(base: u64) -> Queue {
        Queue {
            next_seq: base,
            slots: VecDeque::new(),
        }
    }
}

/// What completions need of a QP, shared with the device's QP registry.
pub(crate) struct Shared {
    sq: Mutex<Queue>,
    rq: Mutex<Queue>,
    srq: Option<Arc<SrqShared>>,
}

impl Shared {
    /// A send completion for adapter `wr_id` `seq`: earlier unsignaled requests are done
    /// too. Returns the caller's `wr_id` and the request's opcode.
    pub(super) fn complete_send(&self, seq: u64) -> Option<(u64, WcOpcode)> {
        let mut q = self.sq.lock();
        while q.slots.front().is_some_and(|s| s.seq < seq) {
            q.slots.pop_front();
        }
        match q.slots.front() {
            Some(s) if s.seq == seq => q.slots.pop_front().map(|s| (s.wr_id, s.opcode)),
            _ => None,
        }
    }

    /// A receive completion: the caller's `wr_id`.
    pub(super) fn complete_recv(&self, hw_wr_id: u64) -> Option<u64> {
        let seq = hw_wr_id & !RECV_BIT;
        if let Some(srq) = &self.srq {
            return srq.slots.lock().slots.remove(&seq).map(|s| s.wr_id);
        }
        let mut q = self.rq.lock();
        while q.slots.front().is_some_and(|s| s.seq < seq) {
            q.slots.pop_front();
        }
        match q.slots.front() {
            Some(s) if s.seq == seq => q.slots.pop_front().map(|s| s.wr_id),
            _ => None,
        }
    }
}

/// An RC queue pair on a verbs device.
pub(crate) struct Qp {
    hw: sys::Qp,
    qp_type: QpType,
    dev: Arc<Device>,
    shared: Arc<Shared>,
    machine: Mutex<QpStateMachine>,
    caps: QpCaps,
    peer: Mutex<Option<QpEndpoint>>,
    /// The address vector rdma_cm resolved; the move to RTR takes it instead of the GID
    /// named by `bind_peer`.
    cm_path: Mutex<Option<Box<sys::AhAttr>>>,
    /// The rdma_cm connection, kept while the QP lives (destroying it disconnects).
    cm: Mutex<Option<super::rdmacm::Conn>>,
    /// The multicast groups the QP is attached to (gid, lid): detached at destruction.
    groups: Mutex<Vec<([u8; 16], u16)>>,
}

impl std::fmt::Debug for Qp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("verbs::Qp")
            .field("qp_num", &self.hw.qp_num())
            .field("state", &self.machine.lock().state())
            .finish_non_exhaustive()
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        self.dev.qps.write().remove(&self.hw.qp_num());
        // The kernel refuses to destroy a QP still attached to a multicast group (EBUSY):
        // it would live on, receiving into buffers given back with its handle.
        for (gid, lid) in self.groups.get_mut().drain(..) {
            if let Err(e) = self.hw.mcast(false, gid, lid) {
                tracing::warn!(error = %e, "verbs: ibv_detach_mcast at destruction failed");
            }
        }
    }
}

/// The regions a posted request names, held until its completion is reaped; one region
/// (the common case) costs no allocation.
pub(super) enum Refs {
    None,
    One(#[allow(dead_code)] MrRef),
    Many(#[allow(dead_code)] Vec<MrRef>),
}

pub(super) fn lkey_refs(dev: &Device, sges: &[rdmx_core::Sge]) -> (Refs, sys::SgeArray) {
    let refs = match sges {
        [] => Refs::None,
        [one] => dev.mr_by_lkey(one.lkey).map_or(Refs::None, Refs::One),
        many => Refs::Many(many.iter().filter_map(|s| dev.mr_by_lkey(s.lkey)).collect()),
    };
    (refs, sys::SgeArray::new(sges))
}

/// Whether every element lies inside the live region its lkey names (`refs`, from
/// [`lkey_refs`]: a region that is gone has no entry; an lkey reused since names another
/// region, which need not cover the element).
fn inside_live_regions(refs: &Refs, sges: &[rdmx_core::Sge]) -> bool {
    let inside = |mr: &MrRef, s: &rdmx_core::Sge| mr.raw_range(s.addr, s.len as usize).is_some();
    match (refs, sges) {
        (Refs::None, []) => true,
        (Refs::One(mr), [s]) => inside(mr, s),
        (Refs::Many(mrs), _) if mrs.len() == sges.len() => mrs
            .iter()
            .zip(sges)
            .all(|(mr, s)| mr.lkey() == s.lkey && inside(mr, s)),
        _ => false,
    }
}

pub(super) fn post_error(e: std::io::Error, depth: usize, what: &'static str) -> Error {
    match e.raw_os_error() {
        Some(libc::ENOMEM) => Error::Post(PostError::QueueFull { depth }),
        Some(libc::EINVAL) => Error::Post(PostError::Invalid("the adapter refused the request")),
        _ => Error::Io(what, e),
    }
}

impl Qp {
    /// Creates an RC QP in RESET (`ibv_create_qp`).
    pub(crate) fn create(
        dev: &Arc<Device>,
        pd: rdmx_core::PdId,
        qp_type: QpType,
        cqs: (&super::Cq, &super::Cq),
        srq: Option<&Srq>,
        caps: QpCaps,
    ) -> Result<Qp> {
        let hw_pd = dev.pd(pd)?;
        let mut cap = sys::QpCap {
            max_send_wr: caps.max_send_wr as u32,
            max_recv_wr: if srq.is_some() {
                0
            } else {
                caps.max_recv_wr as u32
            },
            max_send_sge: caps.max_send_sge as u32,
            max_recv_sge: if srq.is_some() {
                0
            } else {
                caps.max_recv_sge as u32
            },
            max_inline_data: caps.max_inline_data as u32,
        };
        let hw_type = match qp_type {
            QpType::Rc => sys::consts::qp_type::IBV_QPT_RC,
            QpType::Uc => sys::consts::qp_type::IBV_QPT_UC,
            QpType::Ud => sys::consts::qp_type::IBV_QPT_UD,
        };
        let hw = sys::Qp::create(
            &hw_pd,
            hw_type,
            &cqs.0.hw,
            &cqs.1.hw,
            srq.map(|s| &s.hw),
            &mut cap,
        )
        .map_err(verb("ibv_create_qp"))?;
        let base = next_seq_window();
        let shared = Arc::new(Shared {
            sq: Mutex::new(Queue::starting_at(base)),
            rq: Mutex::new(Queue::starting_at(base)),
            srq: srq.map(|s| s.shared.clone()),
        });
        dev.qps.write().insert(hw.qp_num(), Arc::downgrade(&shared));
        Ok(Qp {
            hw,
            qp_type,
            dev: dev.clone(),
            shared,
            machine: Mutex::new(QpStateMachine::with_type(qp_type)),
            caps,
            peer: Mutex::new(None),
            cm_path: Mutex::new(None),
            cm: Mutex::new(None),
            groups: Mutex::new(Vec::new()),
        })
    }

    /// The QP number.
    pub(crate) fn qp_num(&self) -> u32 {
        self.hw.qp_num()
    }

    /// Names the peer for the address vector of the move to RTR.
    pub(crate) fn bind_peer(&self, peer: &QpEndpoint) {
        *self.peer.lock() = Some(*peer);
    }

    /// The device the QP is on.
    pub(crate) fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// Whether the QP takes its receives from an SRQ.
    pub(crate) fn has_srq(&self) -> bool {
        self.shared.srq.is_some()
    }

    /// Sets the address vector rdma_cm resolved, for the move to RTR.
    pub(super) fn set_cm_path(&self, av: sys::AhAttr) {
        *self.cm_path.lock() = Some(Box::new(av));
    }

    /// Keeps the rdma_cm connection until the QP is dropped.
    pub(super) fn keep_cm(&self, conn: super::rdmacm::Conn) {
        *self.cm.lock() = Some(conn);
    }

    /// The current state. While the QP runs, the adapter may have moved it to ERR; the
    /// adapter is asked.
    pub(crate) fn state(&self) -> QpState {
        let mut m = self.machine.lock();
        if matches!(m.state(), QpState::Rtr | QpState::Rts | QpState::Sqd) {
            if let Ok(s) = self.hw.query_state() {
                if s == sys::consts::qp_state::IBV_QPS_ERR {
                    m.set_error();
                }
            }
        }
        m.state()
    }

    /// The current attributes.
    pub(crate) fn attrs(&self) -> QpAttr {
        self.state();
        self.machine.lock().attrs().clone()
    }

    /// iWARP: the connection manager moved the adapter's QP to RTS itself (when the
    /// MPA exchange finished); walks rdmx's state machine through RTR and RTS with
    /// `steps` (the RTR and RTS attributes of the connection), touching nothing on the
    /// adapter.
    pub(super) fn connected_by_cm(&self, steps: [(QpAttr, QpAttrMask); 2]) -> Result<()> {
        let hw = self.hw.query_state().map_err(verb("ibv_query_qp"))?;
        if hw != sys::consts::qp_state::IBV_QPS_RTS {
            return Err(Error::Protocol(
                "rdma_cm reported the connection established, but the queue pair is not in RTS",
            ));
        }
        let mut m = self.machine.lock();
        for (attr, mask) in steps {
            m.modify(&attr, mask, &self.dev.limits)?;
        }
        Ok(())
    }

    /// `ibv_modify_qp`, checked against the verbs rules first.
    pub(crate) fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        if self.dev.caps.transport == crate::Transport::Iwarp
            && mask.contains(QpAttrMask::STATE)
            && matches!(attr.qp_state, QpState::Rtr | QpState::Rts)
        {
            return Err(Error::Unsupported(
                "an iWARP queue pair connects only through rdma_cm (rdmx::verbs::cm), which \
                 moves it to RTS",
            ));
        }
        self.state();
        let mut m = self.machine.lock();
        m.check(attr, mask, &self.dev.limits)?;
        let (mut hw_attr, hw_mask) = self.hw_attr(attr, mask)?;
        self.hw
            .modify(&mut hw_attr, hw_mask)
            .map_err(verb("ibv_modify_qp"))?;
        m.modify(attr, mask, &self.dev.limits)?;
        Ok(())
    }

    fn hw_attr(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<(sys::QpAttr, u32)> {
        use sys::consts::mask as m;
        let mut a = sys::qp_attr();
        let mut bits = 0;
        let state = |s: QpState| s as u32;
        let mut set = |flag: QpAttrMask, bit: u32| {
            if mask.contains(flag) {
                bits |= bit;
            }
        };
        set(QpAttrMask::STATE, m::STATE);
        set(QpAttrMask::CUR_STATE, m::CUR_STATE);
        set(QpAttrMask::EN_SQD_ASYNC_NOTIFY, m::EN_SQD_ASYNC_NOTIFY);
        set(QpAttrMask::ACCESS_FLAGS, m::ACCESS_FLAGS);
        set(QpAttrMask::PKEY_INDEX, m::PKEY_INDEX);
        set(QpAttrMask::PORT, m::PORT);
        set(QpAttrMask::AV, m::AV);
        set(QpAttrMask::PATH_MTU, m::PATH_MTU);
        set(QpAttrMask::TIMEOUT, m::TIMEOUT);
        set(QpAttrMask::RETRY_CNT, m::RETRY_CNT);
        set(QpAttrMask::RNR_RETRY, m::RNR_RETRY);
        set(QpAttrMask::RQ_PSN, m::RQ_PSN);
        set(QpAttrMask::MAX_QP_RD_ATOMIC, m::MAX_QP_RD_ATOMIC);
        set(QpAttrMask::MIN_RNR_TIMER, m::MIN_RNR_TIMER);
        set(QpAttrMask::SQ_PSN, m::SQ_PSN);
        set(QpAttrMask::MAX_DEST_RD_ATOMIC, m::MAX_DEST_RD_ATOMIC);
        set(QpAttrMask::DEST_QPN, m::DEST_QPN);
        set(QpAttrMask::QKEY, m::QKEY);
        a.qkey = attr.qkey;
        a.qp_state = state(attr.qp_state);
        a.cur_qp_state = state(attr.cur_qp_state);
        a.en_sqd_async_notify = u8::from(attr.en_sqd_async_notify);
        a.qp_access_flags = attr.qp_access_flags.bits();
        a.pkey_index = attr.pkey_index;
        a.port_num = self.dev.port;
        a.path_mtu = u32::from(attr.path_mtu.ib_code().unwrap_or(3));
        a.dest_qp_num = attr.dest_qp_num;
        a.rq_psn = attr.rq_psn;
        a.sq_psn = attr.sq_psn;
        a.max_rd_atomic = attr.max_rd_atomic;
        a.max_dest_rd_atomic = attr.max_dest_rd_atomic;
        a.min_rnr_timer = attr.min_rnr_timer;
        a.timeout = attr.timeout;
        a.retry_cnt = attr.retry_cnt;
        a.rnr_retry = attr.rnr_retry;
        if let (true, Some(av)) = (mask.contains(QpAttrMask::AV), &*self.cm_path.lock()) {
            a.ah_attr = **av;
        } else if mask.contains(QpAttrMask::AV) {
            let peer = (*self.peer.lock()).ok_or(Error::InvalidArgument(
                "the move to RTR needs the peer's address: call bind_peer or connect",
            ))?;
            let gid = match peer.addr {
                PeerAddr::Gid(g) => g.octets(),
                // A RoCEv2 peer named by its IP address (rdmx's udp provider): its GID
                // is the address, IPv4 ones mapped.
                PeerAddr::Ip(a) => match a.ip() {
                    std::net::IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
                    std::net::IpAddr::V6(v6) => v6.octets(),
                },
                _ => {
                    return Err(Error::InvalidArgument(
                        "a verbs peer endpoint needs the GID of its port",
                    ))
                }
            };
            sys::set_av(
                &mut a,
                self.dev.port,
                self.dev.gid_index as u8,
                Some(gid),
                0,
            );
        }
        Ok((a, bits))
    }

    /// `ibv_post_send` of one request.
    ///
    /// # Safety
    ///
    /// As [`provider::Qp::post_send`](crate::provider::Qp::post_send).
    pub(crate) unsafe fn post_send(
        &self,
        wr: &SendWr,
        inline: Option<&[u8]>,
        ah: Option<&Ah>,
    ) -> Result<()> {
        let state = self.machine.lock().state();
        if !state.post_send_allowed() {
            return Err(PostError::WrongState(state).into());
        }
        // The checks every provider makes (a device would say EINVAL, or fail an unaligned
        // atomic later with a remote error).
        wr.check(inline, self.caps.max_send_sge, self.caps.max_inline_data)?;
        let caps = &self.dev.caps;
        match wr.op {
            SendOp::SendWithImm(_) | SendOp::WriteWithImm(..) if !caps.imm_data => {
                return Err(PostError::Invalid("the device has no immediate data (iWARP)").into())
            }
            SendOp::Read(_) if wr.sges.len() > caps.max_read_sge as usize => {
                return Err(PostError::Invalid(
                    "more local elements on a READ than the device takes (max_read_sge)",
                )
                .into())
            }
            SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } if !caps.atomics.supported() => {
                return Err(PostError::Invalid("the device has no atomics").into())
            }
            _ => {}
        }
        let mut flags = 0;
        for (f, bit) in [
            (SendFlags::SIGNALED, sys::consts::SEND_SIGNALED),
            (SendFlags::FENCE, sys::consts::SEND_FENCE),
            (SendFlags::SOLICITED, sys::consts::SEND_SOLICITED),
            (SendFlags::INLINE, sys::consts::SEND_INLINE),
        ] {
            if wr.flags.contains(f) {
                flags |= bit;
            }
        }
        let (refs, mut sges) = lkey_refs(&self.dev, &wr.sges);
        if let Some(data) = inline {
            flags |= sys::consts::SEND_INLINE;
            sges = sys::SgeArray::inline(data);
        } else if flags & sys::consts::SEND_INLINE != 0 && !inside_live_regions(&refs, &wr.sges) {
            // With the flag, rdma-core copies the elements' bytes with the CPU during the
            // post and never looks at their lkeys: elements of a region deregistered
            // since (whose memory may be freed) go to the adapter instead, which checks
            // the keys and fails the request.
            flags &= !sys::consts::SEND_INLINE;
        }
        use sys::SendKind as K;
        let kind = match wr.op {
            SendOp::Send => K::Send,
            SendOp::SendWithImm(v) => K::SendImm(v),
            SendOp::Write(r) => K::Write(r.addr, r.rkey),
            SendOp::WriteWithImm(r, v) => K::WriteImm(r.addr, r.rkey, v),
            SendOp::Read(r) => K::Read(r.addr, r.rkey),
            SendOp::CompareSwap {
                remote,
                compare,
                swap,
            } => K::CompareSwap(remote.addr, remote.rkey, compare, swap),
            SendOp::FetchAdd { remote, add } => K::FetchAdd(remote.addr, remote.rkey, add),
            _ => return Err(PostError::Invalid("an opcode the verbs provider lacks").into()),
        };
        let depth = self.caps.max_send_wr;
        let mut q = self.shared.sq.lock();
        if q.slots.len() >= depth {
            return Err(PostError::QueueFull { depth }.into());
        }
        let seq = q.next_seq;
        let mut hw_wr = sys::SendWr::new(seq, kind, flags, sges);
        let ah = match (ah, &wr.ud) {
            (Some(ah), Some(ud)) => {
                hw_wr.set_ud(&ah.hw, ud.remote_qpn, ud.remote_qkey);
                Some(ah.hw.clone())
            }
            (None, None) => None,
            _ => {
                return Err(PostError::Invalid(
                    "a UD send names an address handle and a destination",
                )
                .into())
            }
        };
        // SAFETY: the regions the elements name are held by `refs` until the completion is
        // reaped; inline data is copied during the call; the caller upholds the rest.
        unsafe { self.hw.post_send(&mut hw_wr) }
            .map_err(|e| post_error(e, depth, "ibv_post_send"))?;
        q.next_seq += 1;
        q.slots.push_back(Slot {
            seq,
            wr_id: wr.wr_id,
            opcode: wr.op.wc_opcode(),
            _refs: refs,
            _ah: ah,
        });
        drop(q);
        if state == QpState::Err {
            self.kick_flush();
        }
        Ok(())
    }

    /// After a post to a QP in ERR: moves it to ERR again, which makes the device run its
    /// flush over the queues. The verbs contract flushes such a request; Soft-RoCE queues
    /// it and flushes it only when something schedules its completer, which a modify to
    /// ERR does. A failure here leaves the request queued as the device chose.
    fn kick_flush(&self) {
        let attr = QpAttr {
            qp_state: QpState::Err,
            ..QpAttr::default()
        };
        if let Ok((mut hw_attr, hw_mask)) = self.hw_attr(&attr, QpAttrMask::STATE) {
            if let Err(e) = self.hw.modify(&mut hw_attr, hw_mask) {
                tracing::debug!(error = %e, "ibv_modify_qp(ERR) after a post in ERR");
            }
        }
    }

    /// `ibv_attach_mcast` or `ibv_detach_mcast` (UD queue pairs only).
    pub(crate) fn mcast(&self, attach: bool, gid: [u8; 16], lid: u16) -> Result<()> {
        if self.qp_type != QpType::Ud {
            return Err(Error::InvalidArgument(
                "only UD queue pairs join multicast groups",
            ));
        }
        let what = if attach {
            "ibv_attach_mcast"
        } else {
            "ibv_detach_mcast"
        };
        self.hw.mcast(attach, gid, lid).map_err(verb(what))?;
        let mut groups = self.groups.lock();
        groups.retain(|&g| g != (gid, lid));
        if attach {
            groups.push((gid, lid));
        }
        Ok(())
    }

    /// `ibv_post_recv` of one request.
    ///
    /// # Safety
    ///
    /// As [`provider::Qp::post_recv`](crate::provider::Qp::post_recv).
    pub(crate) unsafe fn post_recv(&self, wr: &RecvWr) -> Result<()> {
        if self.shared.srq.is_some() {
            return Err(PostError::Invalid(
                "the queue pair takes its receives from a shared receive queue",
            )
            .into());
        }
        let state = self.machine.lock().state();
        if !state.post_recv_allowed() {
            return Err(PostError::WrongState(state).into());
        }
        wr.check(self.caps.max_recv_sge)?;
        let (refs, mut sges) = lkey_refs(&self.dev, &wr.sges);
        let depth = self.caps.max_recv_wr;
        let mut q = self.shared.rq.lock();
        if q.slots.len() >= depth {
            return Err(PostError::QueueFull { depth }.into());
        }
        let seq = q.next_seq;
        // SAFETY: as in post_send.
        unsafe { self.hw.post_recv(seq | RECV_BIT, sges.as_mut_slice()) }
            .map_err(|e| post_error(e, depth, "ibv_post_recv"))?;
        q.next_seq += 1;
        q.slots.push_back(Slot {
            seq,
            wr_id: wr.wr_id,
            opcode: WcOpcode::Recv,
            _refs: refs,
            _ah: None,
        });
        drop(q);
        if state == QpState::Err {
            self.kick_flush();
        }
        Ok(())
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("verbs::Shared")
    }
}
