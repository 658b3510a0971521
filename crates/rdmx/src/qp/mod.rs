//! Queue pairs (RC, UC and UD): creation, state and connection, and posting requests
//! (borrowed regions or owned buffers). The requests themselves are built in
//! [`request`].

use std::borrow::Borrow;
use std::sync::Arc;

use rdmx_core::{Completion, PostError, QpAttr, QpAttrMask, QpState, QpType, RecvWr, SendWr};

use crate::ah::AddressHandle;
use crate::cq::CompletionQueue;
use crate::endpoint::{ConnectOptions, QpEndpoint};
use crate::owned::{self, OwnedBuf, Parking, Side};
use crate::pd::ProtectionDomain;
use crate::provider::CqCore;
use crate::provider::{self, QpCaps, QpInit};
use crate::srq::SharedReceiveQueue;
use crate::{Error, Result};

mod request;

pub use request::{LocalSge, RecvRequest, SendRequest};

/// A queue pair (`ibv_qp`): RC (the default), UC or UD ([`QpType`]). Dropping it
/// destroys it (on tcp, closing its stream, so the peer's outstanding requests complete
/// with errors).
#[derive(Debug)]
pub struct QueuePair {
    // Field order is drop order: the provider's QP goes first, and the owned buffers of
    // requests still in flight last, once nothing can reach them.
    imp: Box<dyn provider::Qp>,
    pd: ProtectionDomain,
    qp_type: QpType,
    /// The first PSN and the secret of the QP's next (or current) connection.
    keys: parking_lot::Mutex<ConnKeys>,
    caps: QpCaps,
    /// The CQs, and the owned buffers of requests in flight.
    parked: InFlight,
}

/// What a QP's endpoint gives a peer for one connection, drawn at random when the QP is
/// created and again each time it goes back to RESET.
#[derive(Debug, Clone, Copy)]
struct ConnKeys {
    psn: u32,
    secret: u64,
}

impl ConnKeys {
    fn draw() -> Result<ConnKeys> {
        let mut random = [0u8; 12];
        getrandom::fill(&mut random).map_err(|e| Error::Seed(e.to_string()))?;
        Ok(ConnKeys {
            psn: u32::from_ne_bytes([random[0], random[1], random[2], 0]) & 0xff_ffff,
            secret: u64::from_ne_bytes(random[4..].try_into().expect("8 bytes")),
        })
    }
}

/// The owned buffers of a queue pair's requests in flight, and the CQs their completions
/// go to (the queue pair's own, which it reaches through here). When the queue pair is
/// destroyed they are settled after the provider's queue pair has gone: a buffer whose
/// completion waits in its CQ is dropped with the completion; one whose request was still
/// in flight is dropped too (the provider no longer reaches it), unless the provider said
/// it still might (`keep`): that one is leaked, never reused.
#[derive(Debug)]
struct InFlight {
    bufs: Parking,
    qpn: u32,
    send_cq: Arc<CqCore>,
    recv_cq: Arc<CqCore>,
    keep: bool,
}

impl InFlight {
    /// The CQ of the send (`Side::Send`) or receive queue.
    fn cq(&self, side: Side) -> &Arc<CqCore> {
        match side {
            Side::Send => &self.send_cq,
            Side::Recv => &self.recv_cq,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let qpn = self.qpn;
        for (id, side, buf) in self.bufs.drain() {
            let cq = self.cq(side);
            if cq.take_watched(qpn, id, side) {
                continue;
            }
            cq.unwatch(qpn, id, side);
            if self.keep {
                tracing::warn!(qpn, id, "leaking a buffer a peer may still read");
                std::mem::forget(buf);
            }
        }
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
        self.create_qp_inner(QpType::Rc, send_cq, recv_cq, None, caps)
    }

    /// Creates a queue pair of type `qp_type` in the RESET state (`ibv_create_qp` with
    /// `qp_type`), taking its receives from `srq` if given. A type the provider lacks
    /// ([`Capabilities::supports`](crate::Capabilities::supports)) is refused with
    /// [`Error::Unsupported`].
    pub fn create_qp_of_type(
        &self,
        qp_type: QpType,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        srq: Option<&SharedReceiveQueue>,
        caps: QpCaps,
    ) -> Result<QueuePair> {
        self.create_qp_inner(qp_type, send_cq, recv_cq, srq, caps)
    }

    /// Creates an RC queue pair that takes its receives from `srq`.
    pub fn create_qp_with_srq(
        &self,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        srq: &SharedReceiveQueue,
        caps: QpCaps,
    ) -> Result<QueuePair> {
        self.create_qp_inner(QpType::Rc, send_cq, recv_cq, Some(srq), caps)
    }

    fn create_qp_inner(
        &self,
        qp_type: QpType,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        srq: Option<&SharedReceiveQueue>,
        caps: QpCaps,
    ) -> Result<QueuePair> {
        let dev = self.context().capabilities();
        if !dev.supports(qp_type) {
            return Err(Error::Unsupported(match qp_type {
                QpType::Uc => "this provider has no UC queue pairs",
                _ => "this provider has no UD queue pairs",
            }));
        }
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
        let keys = ConnKeys::draw()?;
        let imp = self.context().device().create_qp(QpInit {
            pd: self.id(),
            qp_type,
            send_cq: &send_cq.parts,
            recv_cq: &recv_cq.parts,
            srq: srq.map(|s| s.imp()),
            caps,
            psn: keys.psn,
            secret: keys.secret,
        })?;
        Ok(QueuePair {
            pd: self.clone(),
            qp_type,
            keys: parking_lot::Mutex::new(keys),
            caps,
            parked: InFlight {
                bufs: Parking::with_capacity(caps.max_send_wr + caps.max_recv_wr),
                qpn: imp.qp_num(),
                send_cq: send_cq.core().clone(),
                recv_cq: recv_cq.core().clone(),
                keep: false,
            },
            imp,
        })
    }
}

impl QueuePair {
    /// This QP's number.
    pub fn qp_num(&self) -> u32 {
        self.imp.qp_num()
    }

    /// The sizes it was created with.
    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    /// RC, UC or UD.
    pub fn qp_type(&self) -> QpType {
        self.qp_type
    }

    /// Takes a UD queue pair in RESET through INIT and RTR to RTS with Q_Key `qkey`, as
    /// `ibv_ud_pingpong` does: from then on it receives datagrams carrying `qkey` and
    /// sends to any address handle.
    pub fn activate(&self, qkey: u32) -> Result<()> {
        if self.qp_type != QpType::Ud {
            return Err(Error::InvalidArgument(
                "activate is for UD queue pairs; connect RC and UC queue pairs",
            ));
        }
        let psn = self.keys.lock().psn;
        for (attr, mask) in rdmx_core::ud_steps(qkey, psn) {
            self.modify(&attr, mask)?;
        }
        Ok(())
    }

    /// Attaches this UD queue pair to the multicast group `gid` (`ibv_attach_mcast`; `lid`
    /// is the group's LID on InfiniBand, 0 elsewhere): a send to the group reaches every
    /// attached queue pair.
    ///
    /// On Soft-RoCE the host must also be a member of the group at the IP level, on the
    /// interface of the device (e.g. a UDP socket's `IP_ADD_MEMBERSHIP`, as rdma_cm's
    /// `rdma_join_multicast` does on RoCE): rxe's `ibv_attach_mcast` registers the group
    /// with the device only, and the IP layer, which every RoCEv2 datagram passes
    /// through (those sent to the group from this host come back as IP's multicast
    /// loopback), drops datagrams of groups the host has not joined.
    pub fn attach_mcast(&self, gid: std::net::Ipv6Addr, lid: u16) -> Result<()> {
        self.check_mcast(gid)?;
        self.imp.attach_mcast(gid.octets(), lid)
    }

    /// Detaches this UD queue pair from the multicast group `gid` (`ibv_detach_mcast`).
    pub fn detach_mcast(&self, gid: std::net::Ipv6Addr, lid: u16) -> Result<()> {
        self.check_mcast(gid)?;
        self.imp.detach_mcast(gid.octets(), lid)
    }

    fn check_mcast(&self, gid: std::net::Ipv6Addr) -> Result<()> {
        if self.qp_type != QpType::Ud {
            return Err(Error::InvalidArgument(
                "only UD queue pairs join multicast groups",
            ));
        }
        // RoCEv2 over IPv4 names an IPv4 group (224.0.0.0/4), IPv4-mapped.
        let v4_group = gid.to_ipv4_mapped().is_some_and(|v4| v4.is_multicast());
        if !gid.is_multicast() && !v4_group {
            return Err(Error::InvalidArgument(
                "not a multicast GID (ff00::/8, or an IPv4-mapped 224.0.0.0/4)",
            ));
        }
        if !self.pd.context().capabilities().multicast {
            return Err(Error::Unsupported("this provider has no multicast"));
        }
        Ok(())
    }

    /// Datagrams (UD) or whole messages (UC) this queue pair dropped on receipt: a wrong
    /// Q_Key, no receive posted, too long for the receive, a lost packet, a malformed
    /// packet; `Some(0)` for RC (which retransmits instead). `None` where the provider
    /// cannot know: on verbs the adapter drops such datagrams and messages without telling
    /// the queue pair (rdma-core has no per-QP count of them; some devices keep port-wide
    /// counters, e.g. Soft-RoCE's under `/sys/class/infiniband/*/ports/*/hw_counters`).
    pub fn dropped(&self) -> Option<u64> {
        self.imp.dropped()
    }

    /// Whether its send (`Side::Send`) or receive queue completes to `cq`.
    #[cfg(feature = "tokio")]
    pub(crate) fn completes_to(&self, side: Side, cq: &Arc<CqCore>) -> bool {
        Arc::ptr_eq(self.parked.cq(side), cq)
    }

    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    pub(crate) fn provider_qp(&self) -> &dyn provider::Qp {
        self.imp.as_ref()
    }

    /// Current state.
    pub fn state(&self) -> QpState {
        self.imp.state()
    }

    /// Current attributes (`ibv_query_qp`).
    pub fn attrs(&self) -> QpAttr {
        self.imp.attrs()
    }

    /// Changes state and attributes (`ibv_modify_qp`).
    ///
    /// On tcp, entering RTR establishes the stream to the peer: the QP dials the peer
    /// given to [`bind_peer`](Self::bind_peer) or waits for the RTR destination QP to
    /// dial it.
    ///
    /// Moving a QP in another state back to RESET draws a new first PSN and secret for
    /// its next connection (see [`endpoint`](Self::endpoint)).
    pub fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        if !(mask.contains(QpAttrMask::STATE) && attr.qp_state == QpState::Reset) {
            return self.imp.modify(attr, mask);
        }
        // The state before, read under the keys' lock: of two threads resetting at once,
        // at least the second draws new keys.
        let mut keys = self.keys.lock();
        let was_reset = self.imp.state() == QpState::Reset;
        self.imp.modify(attr, mask)?;
        if !was_reset {
            *keys = ConnKeys::draw()?;
            self.imp.rekey(keys.psn, keys.secret);
        }
        Ok(())
    }

    /// Names the peer QP before a manual move to RTR (the address vector of verbs).
    /// [`connect`](Self::connect) does this itself.
    pub fn bind_peer(&self, peer: &QpEndpoint) -> Result<()> {
        self.imp
            .bind_peer(peer, ConnectOptions::default().connect_timeout)
    }

    /// This side's endpoint, to hand to the peer.
    ///
    /// A QP moved back to RESET draws a new first PSN and secret for its next
    /// connection: take its endpoint again after the reset. A peer holding the endpoint
    /// of an earlier connection cannot join the next one.
    pub fn endpoint(&self) -> QpEndpoint {
        let keys = *self.keys.lock();
        QpEndpoint {
            qp_num: self.qp_num(),
            psn: keys.psn,
            mtu: self.pd.context().capabilities().active_mtu.bytes(),
            secret: keys.secret,
            addr: self.imp.address(),
        }
    }

    /// Takes a QP in RESET through INIT, RTR and RTS, connected to `peer` (RC and UC;
    /// a UD queue pair is [`activate`](Self::activate)d instead).
    pub fn connect(&self, peer: QpEndpoint, opts: &ConnectOptions) -> Result<()> {
        self.to_rtr(&peer, opts)?;
        self.to_rts(&peer, opts)
    }

    /// Takes a QP in RESET through INIT to RTR, connected to `peer`: from here it receives
    /// (post receives now, before the peer can send, as `ibv_rc_pingpong` does), and
    /// [`to_rts`](Self::to_rts) lets it send.
    pub fn to_rtr(&self, peer: &QpEndpoint, opts: &ConnectOptions) -> Result<()> {
        let params = self.connect_params(peer, opts)?;
        self.imp.bind_peer(peer, opts.connect_timeout)?;
        for (attr, mask) in params.steps_for(self.qp_type).into_iter().take(2) {
            self.modify(&attr, mask)?;
        }
        Ok(())
    }

    /// Takes a QP in RTR to RTS (see [`to_rtr`](Self::to_rtr)).
    pub fn to_rts(&self, peer: &QpEndpoint, opts: &ConnectOptions) -> Result<()> {
        let params = self.connect_params(peer, opts)?;
        for (attr, mask) in params.steps_for(self.qp_type).into_iter().skip(2) {
            self.modify(&attr, mask)?;
        }
        Ok(())
    }

    fn connect_params(
        &self,
        peer: &QpEndpoint,
        opts: &ConnectOptions,
    ) -> Result<rdmx_core::ConnectParams> {
        if self.qp_type == QpType::Ud {
            return Err(Error::InvalidArgument(
                "a UD queue pair has no peer to connect to; activate it",
            ));
        }
        let caps = self.pd.context().capabilities();
        // The device's limits bound the defaults; the peer's MTU bounds the path's.
        let mtu = opts.mtu.unwrap_or_else(|| {
            rdmx_core::Mtu::from_bytes(peer.mtu).map_or(caps.active_mtu, |p| p.min(caps.active_mtu))
        });
        Ok(rdmx_core::ConnectParams {
            access: opts.access,
            mtu,
            dest_qpn: peer.qp_num,
            rq_psn: peer.psn,
            sq_psn: self.keys.lock().psn,
            max_rd_atomic: opts.max_rd_atomic.min(caps.max_qp_init_rd_atom),
            max_dest_rd_atomic: opts.max_dest_rd_atomic.min(caps.max_qp_rd_atom),
            timeout: opts.timeout,
            retry_cnt: opts.retry_cnt,
            rnr_retry: opts.rnr_retry,
            min_rnr_timer: opts.min_rnr_timer,
        })
    }

    /// Posts a send request (`ibv_post_send`).
    ///
    /// What the queue pair's type does not allow is refused here, on every provider: on
    /// UC anything but SEND and WRITE (with or without immediate); on UD anything but
    /// SEND (with or without immediate), a send without an address handle
    /// ([`SendRequest::ud`]) or with one of another protection domain, and a message
    /// longer than the path MTU.
    pub fn post_send<'a>(&self, req: impl Borrow<SendRequest<'a>>) -> Result<()> {
        let req = req.borrow();
        req.check_overflow()?;
        owned::check_wr_id(req.wr.wr_id)?;
        self.check_type(&req.wr, req.inline, req.ah)?;
        // SAFETY: every element of a SendRequest was made by LocalSge::new from a
        // registered region that owns its memory, which safe code only reaches through
        // copies.
        unsafe { self.post_imp(self.imp.as_ref(), &req.wr, req.inline, req.ah) }
    }

    /// Posts through the provider, with the address handle for UD.
    ///
    /// # Safety
    ///
    /// As [`provider::Qp::post_send`].
    unsafe fn post_imp(
        &self,
        imp: &dyn provider::Qp,
        wr: &SendWr,
        inline: Option<&[u8]>,
        ah: Option<&AddressHandle>,
    ) -> Result<()> {
        match ah {
            // SAFETY: forwarded; the caller upholds the contract.
            Some(ah) => unsafe { imp.post_send_ud(wr, inline, ah.imp()) },
            // SAFETY: as above.
            None => unsafe { imp.post_send(wr, inline) },
        }
    }

    /// The checks of [`post_send`](Self::post_send) that depend on the QP's type.
    fn check_type(
        &self,
        wr: &SendWr,
        inline: Option<&[u8]>,
        ah: Option<&AddressHandle>,
    ) -> Result<()> {
        if !self.qp_type.allows(wr.op) {
            return Err(PostError::Invalid(match self.qp_type {
                QpType::Uc => {
                    "a UC queue pair takes SEND and RDMA WRITE (with or without immediate) only"
                }
                _ => "a UD queue pair takes SEND (with or without immediate) only",
            })
            .into());
        }
        if self.qp_type != QpType::Ud {
            if ah.is_some() || wr.ud.is_some() {
                return Err(PostError::Invalid("only UD sends name an address handle").into());
            }
            return Ok(());
        }
        let Some(ah) = ah else {
            return Err(
                PostError::Invalid("a UD send needs an address handle (SendRequest::ud)").into(),
            );
        };
        if ah.pd().id() != self.pd.id() || !ah.pd().context().same(self.pd.context()) {
            return Err(PostError::Invalid(
                "the address handle belongs to another protection domain",
            )
            .into());
        }
        let len = inline.map_or_else(|| wr.sges.total_len(), |d| d.len() as u64);
        let mtu = self.pd.context().capabilities().max_ud_message() as u64;
        if len > mtu {
            return Err(PostError::Invalid("a UD message is at most the path MTU").into());
        }
        Ok(())
    }

    /// Posts several send requests in order, as `ibv_post_send` takes a list; stops at the
    /// first that is refused and returns how many were posted with the error.
    pub fn post_send_list(
        &self,
        reqs: &[SendRequest<'_>],
    ) -> std::result::Result<(), (usize, Error)> {
        if let [req] = reqs {
            // A list of one (perftest's default): the provider's single post, which
            // walks no list.
            return self.post_send(req).map_err(|e| (0, e));
        }
        if self.qp_type == QpType::Ud {
            for (i, r) in reqs.iter().enumerate() {
                self.post_send(r).map_err(|e| (i, e))?;
            }
            return Ok(());
        }
        // Checked up front; the requests before the first refused one go to the provider
        // as one list (one lock and one progress step on the software providers).
        let mut refused = None;
        for (i, r) in reqs.iter().enumerate() {
            let checked = r
                .check_overflow()
                .and_then(|()| owned::check_wr_id(r.wr.wr_id))
                .and_then(|()| self.check_type(&r.wr, r.inline, r.ah));
            if let Err(e) = checked {
                refused = Some((i, e));
                break;
            }
        }
        let valid = refused.as_ref().map_or(reqs.len(), |(i, _)| *i);
        if valid > 0 {
            let mut wrs = reqs[..valid].iter().map(|r| (&r.wr, r.inline));
            // SAFETY: as in post_send: every element was made by LocalSge::new from a
            // registered region that owns its memory.
            unsafe { self.imp.post_send_list(&mut wrs) }?;
        }
        refused.map_or(Ok(()), Err)
    }

    /// Posts a send request with raw elements.
    ///
    /// # Safety
    ///
    /// The provider writes (READ, atomics) or reads the memory the elements name, through
    /// their keys. The caller must not hold Rust references to that memory while the
    /// request is outstanding (e.g. a pool buffer's slice in the same slab).
    pub unsafe fn post_send_raw(&self, wr: &SendWr, inline: Option<&[u8]>) -> Result<()> {
        owned::check_wr_id(wr.wr_id)?;
        // SAFETY: forwarded; the caller upholds this function's contract.
        unsafe { self.imp.post_send(wr, inline) }
    }

    /// Posts a receive request (`ibv_post_recv`).
    pub fn post_recv(&self, req: impl Borrow<RecvRequest>) -> Result<()> {
        let req = req.borrow();
        if req.overflow != 0 {
            return Err(PostError::TooManySges {
                count: req.wr.sges.len() + req.overflow,
                max: rdmx_core::wr::MAX_SGE,
            }
            .into());
        }
        owned::check_wr_id(req.wr.wr_id)?;
        // SAFETY: as in post_send.
        unsafe { self.imp.post_recv(&req.wr) }
    }

    /// Posts several receive requests in order; stops at the first that is refused and
    /// returns how many were posted with the error.
    pub fn post_recv_list(&self, reqs: &[RecvRequest]) -> std::result::Result<(), (usize, Error)> {
        for (i, r) in reqs.iter().enumerate() {
            self.post_recv(r).map_err(|e| (i, e))?;
        }
        Ok(())
    }

    /// Posts a receive request with raw elements.
    ///
    /// # Safety
    ///
    /// As [`post_send_raw`](Self::post_send_raw): the provider writes the named memory.
    pub unsafe fn post_recv_raw(&self, wr: &RecvWr) -> Result<()> {
        owned::check_wr_id(wr.wr_id)?;
        // SAFETY: forwarded; the caller upholds this function's contract.
        unsafe { self.imp.post_recv(wr) }
    }
}

impl QueuePair {
    /// Posts a receive into `buf`, which the queue pair keeps until the receive's
    /// completion has been polled; [`take_buf`](Self::take_buf) then gives it back. On a
    /// refused post the buffer comes back with the error.
    pub fn post_recv_buf<B: OwnedBuf>(
        &self,
        wr_id: u64,
        buf: B,
    ) -> std::result::Result<(), (Error, B)> {
        if let Err(e) = owned::check_wr_id(wr_id) {
            return Err((e, buf));
        }
        self.recv_buf(wr_id, self.parked.bufs.fresh_id(), buf)
    }

    /// [`post_recv_buf`](Self::post_recv_buf), going to the provider as `id` (one of
    /// [`RESERVED_WR_IDS`](crate::RESERVED_WR_IDS), unique among the queue pair's owned
    /// requests in flight).
    pub(crate) fn recv_buf<B: OwnedBuf>(
        &self,
        wr_id: u64,
        id: u64,
        buf: B,
    ) -> std::result::Result<(), (Error, B)> {
        let wr = owned::recv_wr(id, buf.sge());
        self.post_owned(wr_id, id, Side::Recv, buf, |imp| {
            // SAFETY: the buffer's memory is registered and owned by `buf`, which the
            // queue pair holds (parked) until the request's completion has been polled;
            // nothing else can reach it meanwhile.
            unsafe { imp.post_recv(&wr) }
        })
    }

    /// Posts `req` with `buf` as its one element: gathered from for SEND and WRITE,
    /// scattered into for READ and atomics. The request must be signaled and have no other
    /// elements; the queue pair keeps the buffer until the completion has been polled.
    pub fn post_send_buf<B: OwnedBuf>(
        &self,
        req: SendRequest<'_>,
        buf: B,
    ) -> std::result::Result<(), (Error, B)> {
        if let Err(e) = owned::check_wr_id(req.wr.wr_id) {
            return Err((e, buf));
        }
        self.send_buf(req, self.parked.bufs.fresh_id(), buf)
    }

    /// [`post_send_buf`](Self::post_send_buf), going to the provider as `id` (as in
    /// [`recv_buf`](Self::recv_buf)).
    pub(crate) fn send_buf<B: OwnedBuf>(
        &self,
        req: SendRequest<'_>,
        id: u64,
        buf: B,
    ) -> std::result::Result<(), (Error, B)> {
        if let Err(e) = owned::check_send(req.wr.flags, req.wr.sges.len() + req.overflow) {
            return Err((e, buf));
        }
        let mut wr = req.wr;
        wr.sges.push(buf.sge());
        if let Err(e) = self.check_type(&wr, None, req.ah) {
            return Err((e, buf));
        }
        let wr_id = wr.wr_id;
        wr.wr_id = id;
        let ah = req.ah;
        self.post_owned(wr_id, id, Side::Send, buf, |imp| {
            // SAFETY: as in recv_buf.
            unsafe { self.post_imp(imp, &wr, None, ah) }
        })
    }

    /// Posts an owned request the application names `wr_id`, which goes to the provider
    /// as `id`: its completion comes back named `wr_id`, and it is the only completion
    /// that returns the buffer (no other request can be posted as `id`).
    fn post_owned<B: OwnedBuf>(
        &self,
        wr_id: u64,
        id: u64,
        side: Side,
        buf: B,
        post: impl FnOnce(&dyn provider::Qp) -> Result<()>,
    ) -> std::result::Result<(), (Error, B)> {
        debug_assert!(owned::is_reserved(id));
        if let Err(e) = owned::check_len(buf.byte_len()) {
            return Err((e, buf));
        }
        // The slot is taken before the post, so that two posts with one id at once
        // cannot both go (the second would park its buffer over the first's).
        if !self.parked.bufs.reserve(wr_id, side, id) {
            return Err((
                Error::InvalidArgument("an owned-buffer request with this wr_id is in flight"),
                buf,
            ));
        }
        let cq = self.cq_of(side);
        // Watched before the post: the completion may come inside it.
        cq.watch(self.qp_num(), id, side, wr_id);
        match post(self.imp.as_ref()) {
            Ok(()) => {
                self.parked.bufs.park(wr_id, side, buf.park());
                Ok(())
            }
            Err(e) => {
                cq.unwatch(self.qp_num(), id, side);
                self.parked.bufs.unreserve(wr_id, side);
                Err((e, buf))
            }
        }
    }

    fn cq_of(&self, side: Side) -> &CqCore {
        self.parked.cq(side)
    }

    /// The buffer of the owned-buffer request `c` completed, once `c` has been polled from
    /// its CQ; `None` if there is no such buffer of type `B`, or its completion has not
    /// been polled yet (the buffer then stays with the queue pair).
    pub fn take_buf<B: OwnedBuf>(&self, c: &Completion) -> Option<B> {
        self.take_buf_on(owned::side_of(c), c.wr_id)
    }

    /// [`take_buf`](Self::take_buf) for a request whose queue the caller knows (the
    /// opcode of an error completion need not say it).
    pub(crate) fn take_buf_on<B: OwnedBuf>(&self, side: Side, wr_id: u64) -> Option<B> {
        // Only the completion of the provider's request `id` counts: another request
        // named `wr_id` (a plain one) completes under `wr_id` itself.
        let id = self.parked.bufs.holds(wr_id, side)?;
        if !self.cq_of(side).take_watched(self.qp_num(), id, side) {
            return None;
        }
        let buf = self.parked.bufs.take::<B>(wr_id, side);
        if buf.is_none() {
            // Another buffer type (or its post still parking it): watch again so that a
            // take with the right type works.
            self.cq_of(side).rewatch_seen(self.qp_num(), id, side);
        }
        buf
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // The fields go next, the provider's QP first; then the owned buffers in flight
        // (`InFlight`).
        self.parked.keep = !self.imp.quiesce();
    }
}
