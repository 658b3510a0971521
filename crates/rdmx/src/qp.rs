//! Queue pairs: connected RC endpoints, and the requests posted to them.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rdmx_core::rc::{QpConfig, RcQp, Srq};
use rdmx_core::{
    QpAttr, QpAttrMask, QpLimits, QpState, RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge,
};

use crate::context::{Backend, ContextInner};
use crate::cq::CompletionQueue;
use crate::loopback;
use crate::mr::{MemoryRegion, MrRef};
use crate::pd::ProtectionDomain;
use crate::provider::ProviderKind;
use crate::tcp::{self, TcpQp};
use crate::{Error, Result};

/// Limits of a provider's queue pairs.
pub(crate) fn limits(kind: ProviderKind) -> QpLimits {
    let mut l = loopback::limits();
    if kind == ProviderKind::Tcp {
        l.max_mtu = rdmx_core::Mtu::Bytes(tcp::MAX_MTU);
    }
    l
}

/// Sizes of a queue pair's queues (`ibv_qp_cap`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: usize,
    /// Receive queue depth.
    pub max_recv_wr: usize,
    /// SGEs per send request.
    pub max_send_sge: usize,
    /// SGEs per receive request.
    pub max_recv_sge: usize,
    /// Largest inline payload in bytes.
    pub max_inline_data: usize,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 256,
        }
    }
}

impl QpCaps {
    /// Sets the send queue depth.
    pub fn max_send_wr(mut self, n: usize) -> Self {
        self.max_send_wr = n;
        self
    }
    /// Sets the receive queue depth.
    pub fn max_recv_wr(mut self, n: usize) -> Self {
        self.max_recv_wr = n;
        self
    }
    /// Sets SGEs per request, on both queues.
    pub fn max_sge(mut self, n: usize) -> Self {
        self.max_send_sge = n;
        self.max_recv_sge = n;
        self
    }
}

/// An RC queue pair (`ibv_qp`). Dropping it destroys it (on tcp, closing its stream, so
/// the peer's outstanding requests complete with errors).
#[derive(Debug)]
pub struct QueuePair {
    qpn: u32,
    pd: ProtectionDomain,
    imp: Imp,
}

#[derive(Debug)]
enum Imp {
    Loopback,
    Tcp(Arc<TcpQp>),
    #[cfg(feature = "verbs")]
    Verbs(Box<crate::verbs::Qp>),
}

/// A scatter/gather element in a registered region, checked against the region's bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalSge(Sge);

impl LocalSge {
    /// `len` bytes at `offset` in `mr`.
    ///
    /// Only regions that own their memory qualify: a posted request may outlive any borrow
    /// of memory registered with [`ProtectionDomain::register_raw`] (as the registration
    /// cache does), so such memory is posted with the `unsafe` `*_raw` calls.
    pub fn new(mr: &MemoryRegion, offset: usize, len: usize) -> Result<LocalSge> {
        if !mr.owns_memory() {
            return Err(Error::InvalidArgument(
                "the region borrows its memory; post it with post_send_raw/post_recv_raw",
            ));
        }
        match offset.checked_add(len) {
            Some(end) if end <= mr.len() && len <= u32::MAX as usize => Ok(LocalSge(Sge {
                addr: (mr.addr() + offset) as u64,
                len: len as u32,
                lkey: mr.lkey(),
            })),
            _ => Err(Error::OutOfBounds {
                offset,
                len,
                region_len: mr.len(),
            }),
        }
    }

    /// The element as verbs sees it.
    pub fn sge(&self) -> Sge {
        self.0
    }
}

/// A send work request built from registered regions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendRequest {
    wr: SendWr,
    inline: Option<Vec<u8>>,
}

impl SendRequest {
    /// A request doing `op`, signaled by default.
    pub fn new(wr_id: u64, op: SendOp) -> Self {
        SendRequest {
            wr: SendWr {
                wr_id,
                op,
                sges: Vec::new(),
                flags: SendFlags::SIGNALED,
            },
            inline: None,
        }
    }
    /// SEND.
    pub fn send(wr_id: u64) -> Self {
        Self::new(wr_id, SendOp::Send)
    }
    /// RDMA WRITE to `remote`.
    pub fn write(wr_id: u64, remote: RemoteAddr) -> Self {
        Self::new(wr_id, SendOp::Write(remote))
    }
    /// RDMA READ from `remote`.
    pub fn read(wr_id: u64, remote: RemoteAddr) -> Self {
        Self::new(wr_id, SendOp::Read(remote))
    }
    /// SEND with immediate data.
    pub fn send_with_imm(wr_id: u64, imm: u32) -> Self {
        Self::new(wr_id, SendOp::SendWithImm(imm))
    }
    /// RDMA WRITE with immediate data (consumes a receive at the peer).
    pub fn write_with_imm(wr_id: u64, remote: RemoteAddr, imm: u32) -> Self {
        Self::new(wr_id, SendOp::WriteWithImm(remote, imm))
    }
    /// 8-byte compare-and-swap; the old value lands in the (8-byte) local element.
    pub fn compare_swap(wr_id: u64, remote: RemoteAddr, compare: u64, swap: u64) -> Self {
        Self::new(
            wr_id,
            SendOp::CompareSwap {
                remote,
                compare,
                swap,
            },
        )
    }
    /// 8-byte fetch-and-add; the old value lands in the (8-byte) local element.
    pub fn fetch_add(wr_id: u64, remote: RemoteAddr, add: u64) -> Self {
        Self::new(wr_id, SendOp::FetchAdd { remote, add })
    }
    /// Adds a local element.
    pub fn sge(mut self, sge: LocalSge) -> Self {
        self.wr.sges.push(sge.0);
        self
    }
    /// No completion on success (selective signaling).
    pub fn unsignaled(mut self) -> Self {
        self.wr.flags.remove(SendFlags::SIGNALED);
        self
    }
    /// Wait for earlier READs and atomics before starting.
    pub fn fence(mut self) -> Self {
        self.wr.flags |= SendFlags::FENCE;
        self
    }
    /// Ask for a solicited event at the receiver.
    pub fn solicited(mut self) -> Self {
        self.wr.flags |= SendFlags::SOLICITED;
        self
    }
    /// Replaces the flags (SIGNALED is on by default; pass it to keep it).
    pub fn flags(mut self, flags: SendFlags) -> Self {
        self.wr.flags = flags;
        self
    }
    /// Sends `data` inline: copied at post time, no local key needed.
    pub fn inline(mut self, data: &[u8]) -> Self {
        self.wr.flags |= SendFlags::INLINE;
        self.wr.sges.clear();
        self.inline = Some(data.to_vec());
        self
    }
    /// The work request.
    pub fn wr(&self) -> &SendWr {
        &self.wr
    }
}

/// A receive work request built from registered regions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecvRequest {
    wr: RecvWr,
}

impl RecvRequest {
    /// A receive with no elements yet.
    pub fn new(wr_id: u64) -> Self {
        RecvRequest {
            wr: RecvWr {
                wr_id,
                sges: Vec::new(),
            },
        }
    }
    /// Adds a local element.
    pub fn sge(mut self, sge: LocalSge) -> Self {
        self.wr.sges.push(sge.0);
        self
    }
}

impl ProtectionDomain {
    /// Creates an RC queue pair in the RESET state (`ibv_create_qp`).
    pub fn create_qp(
        &self,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        caps: QpCaps,
    ) -> Result<QueuePair> {
        self.create_qp_inner(send_cq, recv_cq, None, caps)
    }

    /// Creates an RC queue pair that takes its receives from `srq`.
    pub fn create_qp_with_srq(
        &self,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        srq: &SharedReceiveQueue,
        caps: QpCaps,
    ) -> Result<QueuePair> {
        self.create_qp_inner(send_cq, recv_cq, Some(srq), caps)
    }

    fn create_qp_inner(
        &self,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        srq: Option<&SharedReceiveQueue>,
        caps: QpCaps,
    ) -> Result<QueuePair> {
        let dev = self.context().capabilities();
        if caps.max_send_wr.max(caps.max_recv_wr) > dev.max_qp_wr as usize
            || caps.max_send_sge.max(caps.max_recv_sge) > dev.max_sge as usize
            || caps.max_inline_data > dev.max_inline_data as usize
        {
            return Err(Error::InvalidArgument(
                "queue pair capabilities above the device's limits",
            ));
        }
        if caps.max_send_wr == 0 || caps.max_recv_wr == 0 {
            return Err(Error::InvalidArgument("queue depths must be at least 1"));
        }
        let mut cfg = QpConfig::new(0, self.id());
        cfg.max_send_wr = caps.max_send_wr;
        cfg.max_recv_wr = caps.max_recv_wr;
        cfg.max_send_sge = caps.max_send_sge;
        cfg.max_recv_sge = caps.max_recv_sge;
        cfg.max_inline_data = caps.max_inline_data;
        let ctx: Arc<ContextInner> = self.context().inner.clone();
        #[cfg(feature = "verbs")]
        if let Backend::Verbs(dev) = &ctx.backend {
            let srq = match srq.map(|s| &s.imp) {
                None => None,
                Some(SrqImp::Verbs(s)) => Some(s),
                Some(_) => {
                    return Err(Error::InvalidArgument(
                        "the shared receive queue belongs to another provider",
                    ))
                }
            };
            let (Some(scq), Some(rcq)) = (send_cq.verbs(), recv_cq.verbs()) else {
                return Err(Error::InvalidArgument(
                    "the completion queues belong to another provider",
                ));
            };
            let qp = crate::verbs::Qp::create(dev, self, (scq, rcq), srq, caps)?;
            return Ok(QueuePair {
                qpn: qp.qp_num(),
                pd: self.clone(),
                imp: Imp::Verbs(Box::new(qp)),
            });
        }
        match (&ctx.backend, srq.map(|s| &s.imp)) {
            (Backend::Loopback, None | Some(SrqImp::Loopback(_))) => {
                let qpn = loopback::fabric().lock().create(
                    ctx.clone(),
                    cfg,
                    send_cq.clone(),
                    recv_cq.clone(),
                    srq.and_then(|s| match s.imp {
                        SrqImp::Loopback(id) => Some(id),
                        _ => None,
                    }),
                );
                Ok(QueuePair {
                    qpn,
                    pd: self.clone(),
                    imp: Imp::Loopback,
                })
            }
            (Backend::Tcp(driver), None | Some(SrqImp::Shared(_))) => {
                let qpn = driver.alloc_qpn();
                cfg.qpn = qpn;
                cfg.srq = srq.is_some();
                // TCP delivers every packet once and in order, or breaks the stream.
                cfg.reliable_link = true;
                let engine = RcQp::new(cfg, limits(ProviderKind::Tcp));
                let shared = srq.and_then(|s| match &s.imp {
                    SrqImp::Shared(q) => Some(q.clone()),
                    _ => None,
                });
                let qp = driver.add_qp(|token| {
                    TcpQp::new(
                        qpn,
                        token,
                        driver.clone(),
                        engine,
                        ctx.clone(),
                        (send_cq.clone(), recv_cq.clone()),
                        shared,
                    )
                });
                Ok(QueuePair {
                    qpn,
                    pd: self.clone(),
                    imp: Imp::Tcp(qp),
                })
            }
            _ => Err(Error::InvalidArgument(
                "the shared receive queue belongs to another provider",
            )),
        }
    }

    /// Creates a shared receive queue (`ibv_create_srq`).
    pub fn create_srq(&self, max_wr: usize, max_sge: usize) -> Result<SharedReceiveQueue> {
        let dev = self.context().capabilities();
        if max_wr == 0 || max_wr > dev.max_qp_wr as usize || max_sge > dev.max_sge as usize {
            return Err(Error::InvalidArgument(
                "shared receive queue sizes outside the device's limits",
            ));
        }
        let ctx = self.context().inner.clone();
        #[cfg(feature = "verbs")]
        if let Backend::Verbs(dev) = &ctx.backend {
            let imp = SrqImp::Verbs(crate::verbs::Srq::create(dev, self, max_wr, max_sge)?);
            return Ok(SharedReceiveQueue { imp, ctx });
        }
        let srq = Srq::new(self.id(), max_wr, max_sge);
        let imp = match &ctx.backend {
            Backend::Loopback => {
                SrqImp::Loopback(loopback::fabric().lock().create_srq(loopback::SrqEntry {
                    srq,
                    ctx: ctx.clone(),
                }))
            }
            _ => SrqImp::Shared(Arc::new(Mutex::new(srq))),
        };
        Ok(SharedReceiveQueue { imp, ctx })
    }
}

/// A shared receive queue (`ibv_srq`): receives that several queue pairs consume.
#[derive(Debug)]
pub struct SharedReceiveQueue {
    imp: SrqImp,
    ctx: Arc<ContextInner>,
}

#[derive(Debug)]
enum SrqImp {
    Loopback(u32),
    Shared(Arc<Mutex<Srq<MrRef>>>),
    #[cfg(feature = "verbs")]
    Verbs(crate::verbs::Srq),
}

impl SharedReceiveQueue {
    /// Runs `f` on a software SRQ; verbs SRQs are handled by each caller first.
    fn with<T>(&self, f: impl FnOnce(&mut Srq<MrRef>, &ContextInner) -> T) -> T {
        match &self.imp {
            #[cfg(feature = "verbs")]
            SrqImp::Verbs(_) => unreachable!("verbs SRQs are handled before `with`"),
            SrqImp::Loopback(id) => {
                let mut fab = loopback::fabric().lock();
                let e = fab.srqs.get_mut(id).expect("a live SRQ is in the fabric");
                let out = f(&mut e.srq, &e.ctx);
                fab.pump();
                out
            }
            SrqImp::Shared(q) => f(&mut q.lock(), &self.ctx),
        }
    }

    /// Posts a receive (`ibv_post_srq_recv`).
    pub fn post_recv(&self, req: RecvRequest) -> Result<()> {
        #[cfg(feature = "verbs")]
        if let SrqImp::Verbs(s) = &self.imp {
            // SAFETY: every element of a RecvRequest was made by LocalSge::new from a
            // registered region, which safe code only reaches through copies.
            return unsafe { s.post_recv(req.wr) };
        }
        self.with(|q, ctx| q.post_recv(ctx, req.wr))?;
        Ok(())
    }

    /// Receives posted and not yet consumed (verbs: not yet reaped from a CQ).
    pub fn len(&self) -> usize {
        #[cfg(feature = "verbs")]
        if let SrqImp::Verbs(s) = &self.imp {
            return s.len();
        }
        self.with(|q, _| q.len())
    }

    /// Whether no receive is posted.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Arms the limit: the limit event fires once when fewer than `limit` receives remain
    /// (`IBV_SRQ_LIMIT`). 0 disarms.
    pub fn arm_limit(&self, limit: usize) {
        #[cfg(feature = "verbs")]
        if let SrqImp::Verbs(s) = &self.imp {
            return s.arm_limit(limit);
        }
        self.with(|q, _| q.arm_limit(limit));
    }

    /// Takes the limit event (`IBV_EVENT_SRQ_LIMIT_REACHED`) if it fired.
    pub fn limit_reached(&self) -> bool {
        #[cfg(feature = "verbs")]
        if let SrqImp::Verbs(s) = &self.imp {
            return s.limit_reached();
        }
        self.with(|q, _| q.take_limit_event())
    }
}

impl Drop for SharedReceiveQueue {
    fn drop(&mut self) {
        if let SrqImp::Loopback(id) = self.imp {
            loopback::fabric().lock().srqs.remove(&id);
        }
    }
}

impl QueuePair {
    /// This QP's number.
    pub fn qp_num(&self) -> u32 {
        self.qpn
    }

    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// The verbs QP behind it, if it is one.
    #[cfg(feature = "verbs")]
    pub(crate) fn verbs(&self) -> Option<&crate::verbs::Qp> {
        match &self.imp {
            Imp::Verbs(qp) => Some(qp.as_ref()),
            _ => None,
        }
    }

    /// Runs `f` on the engine and its memory, then makes progress.
    fn with<T>(&self, f: impl FnOnce(&mut RcQp<ContextInner>, &ContextInner) -> T) -> T {
        match &self.imp {
            Imp::Loopback => {
                let mut fab = loopback::fabric().lock();
                let e = fab
                    .qps
                    .get_mut(&self.qpn)
                    .expect("a live QueuePair is in the fabric");
                let out = f(&mut e.engine, &e.ctx);
                fab.pump();
                out
            }
            Imp::Tcp(qp) => {
                let ctx = self.pd.context().inner.clone();
                qp.with(|i| f(&mut i.engine, &ctx))
            }
            #[cfg(feature = "verbs")]
            Imp::Verbs(_) => unreachable!("verbs QPs are handled before `with`"),
        }
    }

    /// As [`with`](Self::with), for posting: a provider may send the request later, when
    /// it next makes progress anyway.
    fn post_with<T>(&self, f: impl FnOnce(&mut RcQp<ContextInner>, &ContextInner) -> T) -> T {
        match &self.imp {
            Imp::Tcp(qp) => {
                let ctx = self.pd.context().inner.clone();
                qp.post(|i| f(&mut i.engine, &ctx))
            }
            _ => self.with(f),
        }
    }

    /// Current state.
    pub fn state(&self) -> QpState {
        #[cfg(feature = "verbs")]
        if let Imp::Verbs(qp) = &self.imp {
            return qp.state();
        }
        self.with(|e, _| e.state())
    }

    /// Current attributes (`ibv_query_qp`).
    pub fn attrs(&self) -> QpAttr {
        #[cfg(feature = "verbs")]
        if let Imp::Verbs(qp) = &self.imp {
            return qp.attrs();
        }
        self.with(|e, _| e.attrs().clone())
    }

    /// Changes state and attributes (`ibv_modify_qp`).
    ///
    /// On tcp, entering RTR establishes the stream to the peer: the QP dials the peer
    /// given to [`bind_peer`](Self::bind_peer) or waits for the RTR destination QP to
    /// dial it.
    pub fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        #[cfg(feature = "verbs")]
        if let Imp::Verbs(qp) = &self.imp {
            return qp.modify(attr, mask);
        }
        let entered_rtr = self.with(|e, _| {
            let before = e.state();
            e.modify(attr, mask)
                .map(|()| before != QpState::Rtr && e.state() == QpState::Rtr)
        })?;
        if let (Imp::Tcp(qp), true) = (&self.imp, entered_rtr) {
            qp.driver.establish(qp)?;
        }
        Ok(())
    }

    /// Names the peer QP before a manual move to RTR (the address vector of verbs): on
    /// tcp, where its context listens; on verbs, its GID. [`connect`](Self::connect) does
    /// this itself.
    pub fn bind_peer(&self, peer: &QpEndpoint) {
        #[cfg(feature = "verbs")]
        if let Imp::Verbs(qp) = &self.imp {
            return qp.bind_peer(peer);
        }
        if let (Imp::Tcp(qp), Some(addr)) = (&self.imp, peer.addr) {
            qp.bind_peer(
                (addr, peer.qp_num, peer.psn),
                self.endpoint().psn,
                ConnectOptions::default().connect_timeout,
            );
        }
    }

    /// Posts a send request (`ibv_post_send`).
    pub fn post_send(&self, req: SendRequest) -> Result<()> {
        // SAFETY: every element of a SendRequest was made by LocalSge::new from a
        // registered region, which safe code only reaches through copies.
        unsafe { self.post_send_raw(req.wr, req.inline) }
    }

    /// Posts a send request with raw elements.
    ///
    /// # Safety
    ///
    /// The engine writes (READ, atomics) or reads the memory the elements name, through
    /// their keys. The caller must not hold Rust references to that memory while the
    /// request is outstanding (e.g. a pool buffer's slice in the same slab).
    pub unsafe fn post_send_raw(&self, wr: SendWr, inline: Option<Vec<u8>>) -> Result<()> {
        #[cfg(feature = "verbs")]
        if let Imp::Verbs(qp) = &self.imp {
            // SAFETY: forwarded; the caller upholds this function's contract.
            return unsafe { qp.post_send(wr, inline) };
        }
        self.post_with(|e, ctx| e.post_send(ctx, wr, inline))?;
        Ok(())
    }

    /// Posts a receive request (`ibv_post_recv`).
    pub fn post_recv(&self, req: RecvRequest) -> Result<()> {
        // SAFETY: as in post_send.
        unsafe { self.post_recv_raw(req.wr) }
    }

    /// Posts a receive request with raw elements.
    ///
    /// # Safety
    ///
    /// As [`post_send_raw`](Self::post_send_raw): the engine writes the named memory.
    pub unsafe fn post_recv_raw(&self, wr: RecvWr) -> Result<()> {
        #[cfg(feature = "verbs")]
        if let Imp::Verbs(qp) = &self.imp {
            // SAFETY: forwarded; the caller upholds this function's contract.
            return unsafe { qp.post_recv(wr) };
        }
        self.with(|e, ctx| e.post_recv(ctx, wr))?;
        Ok(())
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        match &self.imp {
            Imp::Loopback => {
                loopback::fabric().lock().qps.remove(&self.qpn);
            }
            Imp::Tcp(qp) => qp.driver.remove_qp(qp),
            #[cfg(feature = "verbs")]
            Imp::Verbs(_) => {}
        }
    }
}

/// What a peer needs to connect to a queue pair: its number, first PSN and, on tcp, the
/// address its context listens on (the fields `ibv_rc_pingpong` exchanges out of band).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QpEndpoint {
    /// QP number.
    pub qp_num: u32,
    /// First packet sequence number the QP sends with.
    pub psn: u32,
    /// tcp: where the QP's context accepts streams. An unspecified IP (the context listens
    /// on every interface) means the peer's own host; a connection manager replaces it
    /// with the address it reached the peer at.
    ///
    /// verbs: the GID of the QP's port as an IPv6 address (a RoCEv2 GID of an IPv4
    /// address is IPv4-mapped), and the port's active MTU in bytes in place of the port
    /// number: connecting takes the smaller of the two sides' MTUs.
    pub addr: Option<SocketAddr>,
}

/// Connection parameters for [`QueuePair::connect`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectOptions {
    /// What the peer may do to this side's memory through this QP.
    pub access: rdmx_mem::Access,
    /// Path MTU; `None` takes the device's active MTU ([`Capabilities::active_mtu`]).
    ///
    /// [`Capabilities::active_mtu`]: crate::Capabilities::active_mtu
    pub mtu: Option<rdmx_core::Mtu>,
    /// Outstanding READs/atomics this side may issue.
    pub max_rd_atomic: u8,
    /// Outstanding READs/atomics this side accepts.
    pub max_dest_rd_atomic: u8,
    /// Ack timeout code (4.096 µs × 2^timeout; 0 = none).
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries (7 = forever).
    pub rnr_retry: u8,
    /// RNR timer code this side asks peers to wait.
    pub min_rnr_timer: u8,
    /// tcp: how long establishing the stream to the peer may take.
    pub connect_timeout: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            access: rdmx_mem::Access::LOCAL_WRITE
                | rdmx_mem::Access::REMOTE_READ
                | rdmx_mem::Access::REMOTE_WRITE
                | rdmx_mem::Access::REMOTE_ATOMIC,
            mtu: None,
            max_rd_atomic: 16,
            max_dest_rd_atomic: 16,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
            connect_timeout: Duration::from_secs(10),
        }
    }
}

impl QueuePair {
    /// This side's endpoint, to hand to the peer.
    pub fn endpoint(&self) -> QpEndpoint {
        #[cfg(feature = "verbs")]
        if let Imp::Verbs(qp) = &self.imp {
            return qp.endpoint(initial_psn(self.qpn));
        }
        QpEndpoint {
            qp_num: self.qpn,
            psn: initial_psn(self.qpn),
            addr: match &self.imp {
                Imp::Tcp(qp) => Some(qp.driver.local_addr()),
                _ => None,
            },
        }
    }

    /// Takes a QP in RESET through INIT, RTR and RTS, connected to `peer`.
    pub fn connect(&self, peer: QpEndpoint, opts: &ConnectOptions) -> Result<()> {
        let caps = self.pd.context().capabilities();
        let mtu = opts.mtu.unwrap_or(caps.active_mtu);
        let (max_rd_atomic, max_dest_rd_atomic) = (opts.max_rd_atomic, opts.max_dest_rd_atomic);
        // The adapter's limits bound the defaults; the peer's MTU bounds the path's.
        #[cfg(feature = "verbs")]
        let (mtu, max_rd_atomic, max_dest_rd_atomic) = match &self.imp {
            Imp::Verbs(qp) => {
                qp.bind_peer(&peer);
                let peer_mtu = peer
                    .addr
                    .and_then(|a| rdmx_core::Mtu::from_bytes(a.port().into()));
                (
                    match (opts.mtu, peer_mtu) {
                        (None, Some(p)) => mtu.min(p),
                        _ => mtu,
                    },
                    max_rd_atomic.min(caps.max_qp_init_rd_atom),
                    max_dest_rd_atomic.min(caps.max_qp_rd_atom),
                )
            }
            _ => (mtu, max_rd_atomic, max_dest_rd_atomic),
        };
        let params = rdmx_core::ConnectParams {
            access: opts.access,
            mtu,
            dest_qpn: peer.qp_num,
            rq_psn: peer.psn,
            sq_psn: self.endpoint().psn,
            max_rd_atomic,
            max_dest_rd_atomic,
            timeout: opts.timeout,
            retry_cnt: opts.retry_cnt,
            rnr_retry: opts.rnr_retry,
            min_rnr_timer: opts.min_rnr_timer,
        };
        if let Imp::Tcp(qp) = &self.imp {
            let addr = peer.addr.ok_or(Error::InvalidArgument(
                "a tcp peer endpoint needs the address of its context",
            ))?;
            qp.bind_peer(
                (addr, peer.qp_num, peer.psn),
                self.endpoint().psn,
                opts.connect_timeout,
            );
        }
        for (attr, mask) in params.steps() {
            self.modify(&attr, mask)?;
        }
        Ok(())
    }
}

/// A first PSN that differs between QPs (a real adapter would draw it at random).
fn initial_psn(qpn: u32) -> u32 {
    qpn.wrapping_mul(0x9e37_79b9) & 0xff_ffff
}
