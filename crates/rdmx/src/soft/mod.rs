//! The software host of the sans-IO RC engine, shared by the software providers
//! (loopback, tcp): the key table ([`Keys`]), software capabilities, shared receive
//! queues, and [`SoftQp`], a queue pair that runs the engine over a pluggable packet
//! [`Transport`]. A software provider brings only its transport: how packets move, how
//! progress is made, and where the peer is. The providers with a progress thread (tcp,
//! shm, udp) share it with polling applications through a [`Handover`].

mod armed;
pub(crate) mod clock;
pub(crate) mod handover;
mod mem;
mod waiting;

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rdmx_core::rc::{RcQp, Srq};
use rdmx_core::{
    KeyError, KeyUse, Mtu, PdId, QpAttr, QpAttrMask, QpLimits, QpState, RecvWr, SendWr,
};
use rdmx_mem::Access;

pub(crate) use armed::Armed;
pub(crate) use handover::Handover;
pub(crate) use mem::{no_regions, Keys, KeysRead, Lent, WithLoan};
pub(crate) use waiting::Waiting;

use crate::endpoint::{PeerAddr, QpEndpoint};
use crate::provider::{self, AtomicCap, Capabilities, CqCore, MrRef};
use crate::Result;

/// The engine as software providers run it.
pub(crate) type Engine = RcQp<Keys>;

/// Limits of software queue pairs whose path MTU goes up to `max_mtu`.
pub(crate) fn limits(max_mtu: Mtu) -> QpLimits {
    let mut l = QpLimits::default();
    l.max_mtu = max_mtu;
    l
}

/// Capabilities of a software device.
pub(crate) fn capabilities(limits: &QpLimits, active_mtu: Mtu) -> Capabilities {
    Capabilities {
        max_qp: 1 << 16,
        max_qp_wr: 1 << 14,
        max_sge: 32,
        max_cqe: 1 << 20,
        max_mr: (1 << rdmx_core::mr::INDEX_BITS) - 1,
        max_mr_size: u64::from(u32::MAX),
        max_qp_rd_atom: limits.max_dest_rd_atomic,
        max_qp_init_rd_atom: limits.max_rd_atomic,
        max_mtu: limits.max_mtu,
        active_mtu,
        max_inline_data: 4096,
        atomics: AtomicCap::Global,
        transport: provider::Transport::InfiniBand,
        imm_data: true,
        max_read_sge: 32,
        rnr_retry: true,
        remote_error_completions: true,
        // The engine runs UC over any transport; UD and multicast need a transport that
        // routes each packet by its own destination, which each provider says it has.
        uc: true,
        ud: false,
        multicast: false,
        // The engine counts every datagram and UC message it drops.
        counts_dropped: true,
    }
}

/// A new random seed (key variants, QP numbers).
pub(crate) fn seed() -> Result<u64> {
    let mut seed = [0u8; 8];
    getrandom::fill(&mut seed).map_err(|e| crate::Error::Seed(e.to_string()))?;
    Ok(u64::from_ne_bytes(seed))
}

/// The engine configuration of a new queue pair.
pub(crate) fn config(init: &provider::QpInit<'_>, qpn: u32) -> rdmx_core::rc::QpConfig {
    let mut cfg = rdmx_core::rc::QpConfig::new(qpn, init.pd);
    cfg.max_send_wr = init.caps.max_send_wr;
    cfg.max_recv_wr = init.caps.max_recv_wr;
    cfg.max_send_sge = init.caps.max_send_sge;
    cfg.max_recv_sge = init.caps.max_recv_sge;
    cfg.max_inline_data = init.caps.max_inline_data;
    cfg.srq = init.srq.is_some();
    cfg.qp_type = init.qp_type;
    cfg
}

/// The shortest ack timeout on a link that never loses a packet (tcp, shm): there the
/// timer only watches for a peer that stopped answering, and a peer process descheduled
/// on a crowded host answers late, not never (a peer that dies closes the link, which
/// fails the QP at once). With `retry_cnt` 7 a silent peer fails requests after 4 s.
pub(crate) const RELIABLE_LINK_MIN_ACK_TIMEOUT: std::time::Duration =
    std::time::Duration::from_millis(500);

/// Marks `cfg` as a QP on a link that delivers every packet once and in order, or breaks:
/// nothing is retransmitted, and the ack timeout is at least
/// [`RELIABLE_LINK_MIN_ACK_TIMEOUT`].
pub(crate) fn reliable_link(cfg: &mut rdmx_core::rc::QpConfig) {
    cfg.reliable_link = true;
    cfg.min_ack_timeout = RELIABLE_LINK_MIN_ACK_TIMEOUT;
}

/// A software device: what a software provider brings to the seam. Everything that
/// depends only on the key table (registration, key checks, shared receive queues) is
/// implemented once, for every software device, by the [`provider::Device`] impl below.
pub(crate) trait SoftDevice: Send + Sync + std::fmt::Debug + 'static {
    /// The provider's name.
    const PROVIDER: &'static str;
    /// The device's name.
    const DEVICE: &'static str;
    /// Called after a receive is posted to one of the device's SRQs.
    const AFTER_SRQ_POST: fn();
    /// The key table.
    fn keys(&self) -> &Arc<Keys>;
    /// What the device can do.
    fn caps(&self) -> &Capabilities;
    /// Where peers reach the device's queue pairs.
    fn address(&self) -> PeerAddr;
    /// The provider half of a new CQ.
    fn create_cq(&self, core: &Arc<CqCore>) -> Result<Box<dyn provider::Cq>>;
    /// A new queue pair.
    fn create_qp(&self, init: provider::QpInit<'_>) -> Result<Box<dyn provider::Qp>>;
    /// A region was just registered (its keys work).
    fn registered(&self, _mr: &Arc<provider::MrShared>) {}
    /// A region is being deregistered; its keys stop working right after this returns.
    fn deregistering(&self, _mr: &provider::MrShared) {}
    /// A region's keys stopped working: what a packet accepted before is still placing
    /// into it must end before this returns, and no peer may reach its memory any more
    /// then (the region is deregistered after).
    fn deregistered(&self, _mr: &Arc<provider::MrShared>) {}
}

impl<D: SoftDevice> provider::Device for D {
    fn provider(&self) -> &'static str {
        D::PROVIDER
    }
    fn name(&self) -> &str {
        D::DEVICE
    }
    fn caps(&self) -> &Capabilities {
        SoftDevice::caps(self)
    }
    fn address(&self) -> PeerAddr {
        SoftDevice::address(self)
    }
    unsafe fn register(&self, reg: provider::Registration) -> Result<Arc<provider::MrShared>> {
        // SAFETY: forwarded; the caller upholds the contract.
        let mr = unsafe { self.keys().register(reg) }?;
        self.registered(&mr);
        Ok(mr)
    }
    fn deregister(&self, mr: &Arc<provider::MrShared>) {
        self.deregistering(mr);
        self.keys().deregister(mr);
        self.deregistered(mr);
    }
    fn check(
        &self,
        pd: PdId,
        key: u32,
        key_use: KeyUse,
        addr: u64,
        len: u64,
        need: Access,
    ) -> std::result::Result<MrRef, KeyError> {
        use rdmx_core::rc::MemAccess;
        self.keys().resolve(key, key_use, pd, addr, len, need)
    }
    fn registered_regions(&self) -> usize {
        self.keys().len()
    }
    fn create_cq(&self, core: &Arc<CqCore>) -> Result<Box<dyn provider::Cq>> {
        SoftDevice::create_cq(self, core)
    }
    fn create_qp(&self, init: provider::QpInit<'_>) -> Result<Box<dyn provider::Qp>> {
        SoftDevice::create_qp(self, init)
    }
    fn create_ah(&self, _pd: PdId, av: &rdmx_core::AddressVector) -> Result<Arc<dyn provider::Ah>> {
        if !SoftDevice::caps(self).ud {
            return Err(crate::Error::Unsupported(
                "this provider has no UD queue pairs, so no address handles",
            ));
        }
        Ok(Arc::new(SoftAh(*av)))
    }
    fn create_srq(
        &self,
        pd: PdId,
        max_wr: usize,
        max_sge: usize,
    ) -> Result<Box<dyn provider::Srq>> {
        Ok(Box::new(SoftSrq::new(
            self.keys().clone(),
            pd,
            max_wr,
            max_sge,
            D::AFTER_SRQ_POST,
        )))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A software address handle: the address vector, which the engine routes by.
#[derive(Debug)]
pub(crate) struct SoftAh(rdmx_core::AddressVector);

impl provider::Ah for SoftAh {
    fn av(&self) -> rdmx_core::AddressVector {
        self.0
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Moves an engine's completions to its CQs; an overrun CQ puts the QP in error.
/// Returns whether any completion moved.
pub(crate) fn route_completions(engine: &mut Engine, send_cq: &CqCore, recv_cq: &CqCore) -> bool {
    let mut moved = false;
    while let Some((side, c, solicited)) = engine.poll_completion() {
        moved = true;
        let cq = match side {
            rdmx_core::rc::CqSide::Send => send_cq,
            rdmx_core::rc::CqSide::Recv => recv_cq,
        };
        if !cq.push(c, solicited) && engine.state() != QpState::Err {
            let attr = QpAttr {
                qp_state: QpState::Err,
                ..QpAttr::default()
            };
            let _ = engine.modify(&attr, QpAttrMask::STATE);
        }
    }
    moved
}

/// A software shared receive queue: the engine's [`Srq`] behind a lock, which the QPs that
/// use it take while they handle packets.
#[derive(Debug)]
pub(crate) struct SoftSrq {
    pub(crate) srq: Arc<Mutex<Srq<MrRef>>>,
    keys: Arc<Keys>,
    /// Called after a receive is posted (loopback delivers what waited for it).
    after_post: fn(),
}

impl SoftSrq {
    pub(crate) fn new(
        keys: Arc<Keys>,
        pd: PdId,
        max_wr: usize,
        max_sge: usize,
        after_post: fn(),
    ) -> SoftSrq {
        SoftSrq {
            srq: Arc::new(Mutex::new(Srq::new(pd, max_wr, max_sge))),
            keys,
            after_post,
        }
    }

    /// The SRQ behind a seam SRQ of a software provider, if it is one.
    pub(crate) fn of(srq: Option<&dyn provider::Srq>) -> Result<Option<Arc<Mutex<Srq<MrRef>>>>> {
        match srq {
            None => Ok(None),
            Some(s) => match s.as_any().downcast_ref::<SoftSrq>() {
                Some(s) => Ok(Some(s.srq.clone())),
                None => Err(crate::Error::InvalidArgument(
                    "the shared receive queue belongs to another provider",
                )),
            },
        }
    }
}

impl provider::Srq for SoftSrq {
    unsafe fn post_recv(&self, wr: &RecvWr) -> Result<()> {
        self.srq.lock().post_recv_ref(&*self.keys, wr)?;
        (self.after_post)();
        Ok(())
    }
    fn len(&self) -> usize {
        self.srq.lock().len()
    }
    fn arm_limit(&self, limit: usize) -> Result<()> {
        self.srq.lock().arm_limit(limit);
        Ok(())
    }
    fn limit_reached(&self) -> bool {
        self.srq.lock().take_limit_event()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// How a software provider moves one queue pair's packets: the engine lives with the
/// transport (which runs it from its own progress), and every verb reaches it through
/// [`with`](Transport::with).
pub(crate) trait Transport: Send + Sync + std::fmt::Debug + 'static {
    /// Runs `f` on the engine and the key table, then makes progress (sends what the
    /// engine produced, routes completions).
    fn with<T>(&self, f: impl FnOnce(&mut Engine, &Keys) -> T) -> T;
    /// As [`with`](Self::with), for posting: the transport may send later, when it next
    /// makes progress anyway.
    fn post_with<T>(&self, f: impl FnOnce(&mut Engine, &Keys) -> T) -> T {
        self.with(f)
    }
    /// Posts a receive request: by default to the engine through [`with`](Self::with). A
    /// receive gives the engine nothing to send (a requester that met an RNR NAK sends
    /// again on its own timer), so a transport may only route completions (a QP in the
    /// error state flushes the receive at once); one that keeps the region its receives
    /// name (shm) may also resolve the key itself.
    fn post_recv(&self, wr: &RecvWr) -> Result<()> {
        self.with(|e, keys| Ok(e.post_recv_ref(keys, wr)?))
    }
    /// Posts a send request: by default, to the engine through
    /// [`post_with`](Self::post_with). A transport that can execute some requests itself
    /// (shm between two contexts of one process) takes them here.
    fn post_send(&self, wr: &SendWr, inline: Option<&[u8]>) -> Result<()> {
        self.post_with(|e, keys| e.post_send_ref(keys, wr, inline))?;
        Ok(())
    }
    /// Posts a list of send requests: by default, all under one
    /// [`post_send`](Self::post_send)-like call to [`post_with`](Self::post_with), so the
    /// engine's lock is taken and progress made once for the list. Stops at the first
    /// request refused, with its index.
    fn post_send_list(
        &self,
        wrs: &mut dyn Iterator<Item = (&SendWr, Option<&[u8]>)>,
    ) -> std::result::Result<(), (usize, crate::Error)> {
        self.post_with(|e, keys| {
            for (i, (wr, inline)) in wrs.enumerate() {
                e.post_send_ref(keys, wr, inline)
                    .map_err(|err| (i, err.into()))?;
            }
            Ok(())
        })
    }
    /// The QP is about to be moved to RTR: what the transport needs for it (its peer) is
    /// there, or the move is refused.
    fn ready_for_rtr(&self) -> Result<()> {
        Ok(())
    }
    /// The QP just entered RTR.
    fn entered_rtr(&self) -> Result<()> {
        Ok(())
    }
    /// Where the peer reaches this QP.
    fn address(&self) -> PeerAddr;
    /// Names the peer before the move to RTR.
    fn bind_peer(&self, _peer: &QpEndpoint, _timeout: Duration) -> Result<()> {
        Ok(())
    }
    /// Attaches to (or, with `attach` false, detaches from) the multicast group `gid`.
    fn multicast(&self, _gid: [u8; 16], _attach: bool) -> Result<()> {
        Err(crate::Error::Unsupported("this provider has no multicast"))
    }
    /// The queue pair is being destroyed ([`provider::Qp::quiesce`]).
    fn quiesce(&self) -> bool {
        true
    }
    /// The queue pair went back to RESET with a new first PSN and secret
    /// ([`provider::Qp::rekey`]).
    fn rekey(&self, _psn: u32, _secret: u64) {}
}

/// A software queue pair: the RC engine over transport `T`.
#[derive(Debug)]
pub(crate) struct SoftQp<T: Transport> {
    pub(crate) qpn: u32,
    pub(crate) transport: T,
}

impl<T: Transport> provider::Qp for SoftQp<T> {
    fn qp_num(&self) -> u32 {
        self.qpn
    }
    fn state(&self) -> QpState {
        self.transport.with(|e, _| e.state())
    }
    fn attrs(&self) -> QpAttr {
        self.transport.with(|e, _| e.attrs().clone())
    }
    fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        if mask.contains(QpAttrMask::STATE) && attr.qp_state == QpState::Rtr {
            self.transport.ready_for_rtr()?;
        }
        let entered_rtr = self.transport.with(|e, _| {
            let before = e.state();
            e.modify(attr, mask)
                .map(|()| before != QpState::Rtr && e.state() == QpState::Rtr)
        })?;
        if entered_rtr {
            self.transport.entered_rtr()?;
        }
        Ok(())
    }
    fn address(&self) -> PeerAddr {
        self.transport.address()
    }
    fn bind_peer(&self, peer: &QpEndpoint, timeout: Duration) -> Result<()> {
        self.transport.bind_peer(peer, timeout)
    }
    fn quiesce(&self) -> bool {
        self.transport.quiesce()
    }
    fn rekey(&self, psn: u32, secret: u64) {
        self.transport.rekey(psn, secret)
    }
    unsafe fn post_send(&self, wr: &SendWr, inline: Option<&[u8]>) -> Result<()> {
        self.transport.post_send(wr, inline)
    }
    unsafe fn post_send_list(
        &self,
        wrs: &mut dyn Iterator<Item = (&SendWr, Option<&[u8]>)>,
    ) -> std::result::Result<(), (usize, crate::Error)> {
        self.transport.post_send_list(wrs)
    }
    unsafe fn post_send_ud(
        &self,
        wr: &SendWr,
        inline: Option<&[u8]>,
        ah: &dyn provider::Ah,
    ) -> Result<()> {
        // The handle, not a copy a request made of it, says where the datagram goes.
        let mut wr = wr.clone();
        if let Some(ud) = wr.ud.as_mut() {
            ud.av = ah.av();
        }
        // SAFETY: forwarded; the caller upholds the contract.
        unsafe { provider::Qp::post_send(self, &wr, inline) }
    }
    unsafe fn post_recv(&self, wr: &RecvWr) -> Result<()> {
        self.transport.post_recv(wr)
    }
    fn attach_mcast(&self, gid: [u8; 16], _lid: u16) -> Result<()> {
        self.transport.multicast(gid, true)
    }
    fn detach_mcast(&self, gid: [u8; 16], _lid: u16) -> Result<()> {
        self.transport.multicast(gid, false)
    }
    fn dropped(&self) -> Option<u64> {
        Some(self.transport.with(|e, _| e.dropped()))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
