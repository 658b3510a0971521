//! The engine: a queue pair with no I/O — reliable connected, and on the same queues
//! unreliable connected and unreliable datagram (see `unreliable.rs`: [`QpConfig::qp_type`],
//! [`RcQp::handle_datagram`], [`RcQp::poll_datagram`]).
//!
//! [`RcQp`] holds one queue pair's send and receive queues, its requester and responder
//! state, and the completions it produced. It never reads a clock, opens a socket or
//! spawns a thread: bytes and time go in, bytes, timers and completions come out. Every
//! provider drives the same engine, so every provider has the same semantics.
//!
//! ## Driving it
//!
//! ```text
//!  app ──post_send/post_recv──▶ RcQp ──poll_completion──▶ CQs
//!                               │  ▲
//!          poll_transmit(now) ◀─┘  └─ handle_packet(now, bytes) / handle_timeout(now)
//!                 │                          ▲
//!                 └──────── transport ───────┘
//! ```
//!
//! After any call that may have changed the queue pair (a post, a packet, a timeout, a
//! modify), the driver calls [`RcQp::poll_transmit`] until it returns `None`, sends what
//! it returned to the peer's QP, drains [`RcQp::poll_completion`], and arms a timer for
//! [`RcQp::poll_timeout`], calling [`RcQp::handle_timeout`] when it fires. A transport
//! may ask [`RcQp::poll_ack`] before each packet: it gives the next one as bytes when it
//! is a plain acknowledgement, the packet sent most often, and changes the queue pair as
//! `poll_transmit` would have.
//!
//! Memory is reached through [`MemAccess`]; local keys are resolved when a request is
//! posted, and the resolved regions stay in the request until it completes.
//!
//! ## Allocation
//!
//! The engine keeps the room its requests need and reuses it, as an adapter keeps a ring
//! of work-queue entries: once a queue pair has been as busy as it gets, posting with
//! [`RcQp::post_send_ref`] and [`RcQp::post_recv_ref`] ([`Srq::post_recv_ref`] for a
//! shared receive queue), moving packets with [`RcQp::poll_transmit_into`] and
//! [`RcQp::handle_packet`] or with [`RcQp::poll_transmit_parts`] and
//! [`RcQp::handle_header`], and reaping with [`RcQp::poll_completion`] allocate nothing.
//! The by-value [`RcQp::post_send`], [`RcQp::post_recv`] and [`RcQp::poll_transmit`]
//! remain for callers that hold owned requests or want a new buffer per packet.

mod codec;
mod direct;
pub mod io;
mod local;
mod mem;
mod requester;
mod responder;
mod srq;
mod unreliable;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

pub use direct::DirectRequest;
pub use io::{Placement, Span, Transmit};
pub(crate) use local::{for_each_span, resolve_sge, resolve_sges, Local, Seg, Spare};
pub use mem::MemAccess;
pub use srq::Srq;
pub use unreliable::DatagramInfo;

/// Bytes of an acknowledgement as [`RcQp::poll_ack`] gives it: BTH and AETH.
pub const ACK_LEN: usize = codec::ACK_LEN;

use crate::access::Access;
use crate::mr::PdId;
use crate::qp::{ModifyError, QpAttr, QpAttrMask, QpLimits, QpState, QpStateMachine, QpType};
use crate::wr::{Completion, PostError, RecvWr, SendFlags, SendWr, WcOpcode, WcStatus};

use io::Payload;
use requester::Requester;
use responder::Responder;

/// Most packets one message of an RC or UC queue pair spans, a quarter of the 24-bit PSN
/// space (2^22): a request longer than that at the path MTU completes with LOC_LEN_ERR.
pub const MAX_MESSAGE_PACKETS: u32 = 1 << 22;

/// Fixed properties of a queue pair, chosen at creation (`ibv_qp_init_attr`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct QpConfig {
    /// This QP's number.
    pub qpn: u32,
    /// Its protection domain.
    pub pd: PdId,
    /// Send queue depth.
    pub max_send_wr: usize,
    /// Receive queue depth.
    pub max_recv_wr: usize,
    /// SGEs per send request.
    pub max_send_sge: usize,
    /// SGEs per receive request.
    pub max_recv_sge: usize,
    /// Largest inline payload.
    pub max_inline_data: usize,
    /// Take receives from a shared receive queue ([`Srq`]) instead of an own queue.
    pub srq: bool,
    /// The link below never loses, reorders or duplicates packets (a TCP stream): an
    /// expired ack timer then only counts against the retry budget, and nothing is
    /// retransmitted, since what was sent is still on its way. A peer that stays
    /// silent for `timeout × (retry_cnt + 1)` still ends in `RetryExcErr`.
    pub reliable_link: bool,
    /// The transport service: RC (the default), UC or UD.
    pub qp_type: QpType,
    /// The shortest ack timeout this QP waits, whatever its `timeout` attribute says. On
    /// a reliable link whose peer is software (a process the host may deschedule), a
    /// silent peer is a slow process far more often than a dead one, whose end the link
    /// reports itself; a floor keeps a loaded host from failing healthy connections.
    pub min_ack_timeout: Duration,
    /// Most packets (PSNs) sent and not yet acknowledged; 0 for no limit. A datagram
    /// transport sets it so that a burst never outruns the peer's receive buffer: the
    /// requester waits for acknowledgements (and asks for them every quarter window)
    /// rather than sending packets the link would drop.
    pub send_window: u32,
}

impl QpConfig {
    /// A configuration with verbs-like defaults: 128-deep queues, 4 SGEs, 256 bytes inline.
    pub fn new(qpn: u32, pd: PdId) -> Self {
        QpConfig {
            qpn,
            pd,
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 256,
            srq: false,
            reliable_link: false,
            qp_type: QpType::Rc,
            min_ack_timeout: Duration::ZERO,
            send_window: 0,
        }
    }
}

/// Which completion queue a completion belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CqSide {
    /// The send CQ (requests posted with `post_send`).
    Send,
    /// The receive CQ (requests posted with `post_recv`).
    Recv,
}

/// A receive request as the engine holds it.
#[derive(Debug)]
pub(crate) struct RecvWqe<Mr> {
    pub(crate) wr_id: u64,
    pub(crate) segs: Vec<Seg<Mr>>,
    pub(crate) len: u64,
    /// A local error found when the request was posted.
    pub(crate) error: Option<WcStatus>,
}

/// The RC queue pair engine.
#[derive(Debug)]
pub struct RcQp<M: MemAccess> {
    pub(crate) cfg: QpConfig,
    pub(crate) sm: QpStateMachine,
    pub(crate) limits: QpLimits,
    pub(crate) req: Requester<M::Mr>,
    pub(crate) resp: Responder<M::Mr>,
    pub(crate) rq: VecDeque<RecvWqe<M::Mr>>,
    pub(crate) completions: VecDeque<(CqSide, Completion, bool)>,
    pub(crate) spare: Spare<M::Mr>,
    /// The packet [`poll_transmit_into`](Self::poll_transmit_into) builds before copying.
    scratch: Transmit<M::Mr>,
    sq_drained_event: bool,
    /// The UC responder (unused by RC and UD).
    pub(crate) uc: unreliable::UcResponder<M::Mr>,
    /// UD datagrams and UC messages dropped on receipt.
    pub(crate) dropped: u64,
    /// Where a whole UC packet's payload goes, reused packet to packet.
    uc_place: Vec<Placement<M::Mr>>,
    /// How many completions were queued when the last header came through
    /// [`handle_header`](Self::handle_header): those after it were queued for its payload
    /// (see [`abort_payload`](Self::abort_payload)).
    header_mark: usize,
}

impl<M: MemAccess> RcQp<M> {
    /// A queue pair in the RESET state.
    pub fn new(cfg: QpConfig, limits: QpLimits) -> Self {
        RcQp {
            cfg,
            sm: QpStateMachine::with_type(cfg.qp_type),
            limits,
            req: Requester::new(),
            resp: Responder::new(),
            rq: VecDeque::new(),
            completions: VecDeque::new(),
            spare: Spare::new(
                cfg.max_send_wr.saturating_add(cfg.max_recv_wr),
                cfg.max_send_sge.max(cfg.max_recv_sge),
                cfg.max_inline_data,
            ),
            scratch: Transmit::default(),
            sq_drained_event: false,
            uc: unreliable::UcResponder::new(),
            dropped: 0,
            uc_place: Vec::new(),
            header_mark: 0,
        }
    }

    /// Destroys the queue pair's work (`ibv_destroy_qp`): every request, receive and
    /// packet it holds, in flight or queued, goes without a completion, and with them
    /// every reference to registered memory; completions not yet polled go too. The
    /// engine is left as new, in RESET. A provider calls it when the QP's handle goes, so
    /// that the memory a region owned is released when both are dropped, whichever
    /// thread still looks at the engine.
    pub fn destroy(&mut self) {
        *self = RcQp::new(self.cfg, self.limits);
    }

    /// This QP's number.
    pub fn qpn(&self) -> u32 {
        self.cfg.qpn
    }

    /// The creation-time configuration.
    pub fn config(&self) -> &QpConfig {
        &self.cfg
    }

    /// Current state.
    pub fn state(&self) -> QpState {
        self.sm.state()
    }

    /// Current attributes.
    pub fn attrs(&self) -> &QpAttr {
        self.sm.attrs()
    }

    /// The peer QP number, once connected (RTR or later).
    pub fn dest_qpn(&self) -> u32 {
        self.sm.attrs().dest_qp_num
    }

    /// Changes state and attributes (`ibv_modify_qp`). Entering RESET empties the queues
    /// without completions, as verbs does; entering ERR flushes them.
    pub fn modify(&mut self, attr: &QpAttr, mask: QpAttrMask) -> Result<(), ModifyError> {
        let t = self.sm.modify(attr, mask, &self.limits)?;
        match t.to {
            QpState::Rtr if t.from == QpState::Init => {
                self.resp.reset(self.sm.attrs().rq_psn);
                self.uc.reset(self.sm.attrs().rq_psn);
            }
            QpState::Rts if t.from == QpState::Rtr => {
                let a = self.sm.attrs();
                self.req.reset(a.sq_psn, a.retry_cnt, a.rnr_retry);
            }
            // New retry counts (SQD → SQD) apply from now on.
            QpState::Sqd | QpState::Rts
                if t.mask
                    .intersects(QpAttrMask::RETRY_CNT | QpAttrMask::RNR_RETRY) =>
            {
                let a = self.sm.attrs();
                self.req.set_retry_counts(a.retry_cnt, a.rnr_retry);
            }
            QpState::Err if t.from != QpState::Err => self.flush(),
            QpState::Sqd if t.from == QpState::Rts && !self.req.in_flight() => {
                self.sq_drained_event |= self.sm.sq_drained();
            }
            QpState::Reset => {
                self.req = Requester::new();
                self.resp = Responder::new();
                self.uc = unreliable::UcResponder::new();
                self.rq.clear();
            }
            _ => {}
        }
        Ok(())
    }

    /// Posts a send request (`ibv_post_send`), taking the request and the inline payload
    /// by value; see [`post_send_ref`](Self::post_send_ref), which this calls.
    pub fn post_send(
        &mut self,
        mem: &M,
        wr: SendWr,
        inline: Option<Vec<u8>>,
    ) -> Result<(), PostError> {
        self.post_send_ref(mem, &wr, inline.as_deref())
    }

    /// Posts a send request (`ibv_post_send`).
    ///
    /// Refused at once when the QP's state does not take sends, the send queue is full,
    /// or the request is malformed (including an atomic at a remote address that is not
    /// 8-byte aligned, which rdma-core's Soft-RoCE refuses at post as well; the responder
    /// still answers such a request from a peer with a NAK). Local keys are resolved now; a key that fails its
    /// check makes the request complete with `LOC_PROT_ERR` (and the QP enter ERR) when
    /// its turn comes, as verbs does. `inline` (with [`SendFlags::INLINE`]) is copied now.
    ///
    /// Once the queue has been as deep as it gets, a post allocates nothing: the room a
    /// request needs is taken back when it completes and used for the next one.
    pub fn post_send_ref(
        &mut self,
        mem: &M,
        wr: &SendWr,
        inline: Option<&[u8]>,
    ) -> Result<(), PostError> {
        let state = self.sm.state();
        if matches!(state, QpState::Reset | QpState::Init | QpState::Rtr) {
            return Err(PostError::WrongState(state));
        }
        if self.req.sq.len() >= self.cfg.max_send_wr {
            return Err(PostError::QueueFull {
                depth: self.cfg.max_send_wr,
            });
        }
        wr.check(inline, self.cfg.max_send_sge, self.cfg.max_inline_data)?;
        self.check_type(wr, inline)?;
        let (local, error) = match inline {
            Some(data) => {
                let mut bytes = self.spare.bytes();
                bytes.extend_from_slice(data);
                (Local::Inline(bytes), None)
            }
            None => {
                let need = if wr.op.writes_local() {
                    Access::LOCAL_WRITE
                } else {
                    Access::empty()
                };
                let mut segs = self.spare.segs();
                let error = resolve_sges(mem, self.cfg.pd, &wr.sges, need, &mut segs);
                (Local::Segs(segs), error)
            }
        };
        let total = local.len();
        // PSNs compare within half their 24-bit space: a message spanning a quarter of it
        // (over 1 GiB at a 256-byte path MTU) would leave no room for the requests after.
        let mtu = self.sm.attrs().path_mtu.bytes() as u64;
        let too_many_packets = self.cfg.qp_type != QpType::Ud
            && packets_of(total, mtu) > u64::from(MAX_MESSAGE_PACKETS);
        let bad_len =
            (wr.op.is_atomic() && total != 8) || total > u64::from(u32::MAX) || too_many_packets;
        let error = error.or(bad_len.then_some(WcStatus::LocLenErr));
        self.req.push(wr, local, total, error);
        if state == QpState::Err {
            self.flush();
        }
        Ok(())
    }

    /// Posts a receive request (`ibv_post_recv`), taking the request by value; see
    /// [`post_recv_ref`](Self::post_recv_ref), which this calls.
    pub fn post_recv(&mut self, mem: &M, wr: RecvWr) -> Result<(), PostError> {
        self.post_recv_ref(mem, &wr)
    }

    /// Posts a receive request (`ibv_post_recv`). Like
    /// [`post_send_ref`](Self::post_send_ref), it allocates nothing once the queue has been
    /// as deep as it gets.
    ///
    /// `mem` resolves the request's keys: the engine's own memory, or any view of it that
    /// hands out the same regions (a transport may keep the region a queue pair's
    /// receives name, and resolve its key without a look-up in the whole table).
    pub fn post_recv_ref<R: MemAccess<Mr = M::Mr>>(
        &mut self,
        mem: &R,
        wr: &RecvWr,
    ) -> Result<(), PostError> {
        if self.cfg.srq {
            return Err(PostError::Invalid(
                "the queue pair takes its receives from a shared receive queue",
            ));
        }
        let state = self.sm.state();
        if state == QpState::Reset {
            return Err(PostError::WrongState(state));
        }
        if self.rq.len() >= self.cfg.max_recv_wr {
            return Err(PostError::QueueFull {
                depth: self.cfg.max_recv_wr,
            });
        }
        wr.check(self.cfg.max_recv_sge)?;
        let mut segs = self.spare.segs();
        let error = resolve_sges(mem, self.cfg.pd, &wr.sges, Access::LOCAL_WRITE, &mut segs);
        let len = segs.iter().map(|s| u64::from(s.len)).sum();
        self.rq.push_back(RecvWqe {
            wr_id: wr.wr_id,
            segs,
            len,
            error,
        });
        if state == QpState::Err {
            self.flush();
        }
        Ok(())
    }

    /// The next packet to send to the peer QP, if any, copied into one new buffer. See
    /// [`poll_transmit_into`](Self::poll_transmit_into) for a buffer the caller reuses.
    pub fn poll_transmit(&mut self, now: Instant, mem: &M) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        self.poll_transmit_into(now, mem, &mut out).then_some(out)
    }

    /// The next packet to send to the peer QP, copied into `out` (its contents replaced);
    /// `false` (and `out` cleared) when there is none. This is the whole-packet path of a datagram transport: with a
    /// reused `out` it allocates nothing once `out` is as large as a packet gets.
    pub fn poll_transmit_into(&mut self, now: Instant, mem: &M, out: &mut Vec<u8>) -> bool {
        let mut scratch = std::mem::take(&mut self.scratch);
        let sent = self.poll_transmit_parts(now, &mut scratch);
        if sent {
            // Overwrites what `out` holds: no zeroing of the payload's room first.
            scratch.flatten_into(mem, out);
        } else {
            out.clear();
        }
        // The spans hold regions; a spare packet must not keep them alive.
        scratch.clear();
        self.scratch = scratch;
        sent
    }

    /// Whether [`poll_transmit_parts`](Self::poll_transmit_parts) may have work: a packet
    /// to build, or a finished request to retire. When this is `false` that call would
    /// return `false` and change nothing, so a transport may skip it, and the clock
    /// reading it takes, after a request that completed as it was posted.
    pub fn may_transmit(&self) -> bool {
        self.cfg.qp_type == QpType::Ud || self.resp.has_output() || self.req.has_work()
    }

    /// The next packet to send to the peer QP when it is a plain acknowledgement (an ACK
    /// with no other answer before it), as its bytes: BTH and AETH, [`ACK_LEN`] bytes, no
    /// payload. `None` when the next packet is anything else, or there is none; then
    /// [`poll_transmit_parts`](Self::poll_transmit_parts) gives it. The packet is the one
    /// that call would give, and taking it here changes the queue pair as that call would:
    /// a transport may ask this first, and skip building a [`Transmit`] for the packet
    /// sent most often (an RC responder acknowledges every message).
    pub fn poll_ack(&mut self) -> Option<[u8; ACK_LEN]> {
        if self.cfg.qp_type != QpType::Rc {
            return None;
        }
        self.resp.poll_ack(self.sm.attrs(), self.credits())
    }

    /// The next packet to send to the peer QP into `out` (cleared first), its payload left
    /// in registered memory for the transport to gather; `false` when there is none. See
    /// [`io`] for the contract.
    pub fn poll_transmit_parts(&mut self, now: Instant, out: &mut Transmit<M::Mr>) -> bool {
        if self.cfg.qp_type == QpType::Ud {
            out.clear();
            if !matches!(self.sm.state(), QpState::Rts) {
                return false;
            }
            let sent = unreliable::ud_transmit(self, out);
            self.retire();
            return sent;
        }
        // (Asked first: most packets a requester sends go when its responder has nothing.)
        if self.resp.has_output()
            && self
                .resp
                .poll_transmit(self.sm.attrs(), self.credits(), out)
        {
            return true;
        }
        match self.sm.state() {
            QpState::Rts => {}
            // SQ drain: what was started is finished (and sent again after a loss);
            // nothing new starts.
            QpState::Sqd if self.req.continues_started() => {}
            _ => return false,
        }
        out.clear();
        let sent = requester::transmit(self, now, out).is_some();
        self.retire();
        sent
    }

    /// Feeds a packet received from the peer QP.
    pub fn handle_packet(&mut self, now: Instant, mem: &M, bytes: &[u8]) {
        self.handle_packet_srq(now, mem, None, bytes)
    }

    /// Feeds a packet to a QP that takes its receives from `srq`.
    pub fn handle_packet_srq(
        &mut self,
        now: Instant,
        mem: &M,
        srq: Option<&mut Srq<M::Mr>>,
        bytes: &[u8],
    ) {
        match self.cfg.qp_type {
            QpType::Rc => {
                if let Some(hdr) = codec::decode(bytes) {
                    self.handle(now, mem, srq, &hdr, &mut Payload::Bytes(hdr.payload));
                }
            }
            QpType::Uc => {
                // The headers run through a copy with the UC prefix taken off; the payload
                // is placed from `bytes` where the engine says.
                let hlen = bytes
                    .first()
                    .and_then(|&op| rdmx_wire::header_len_of(op))
                    .filter(|&h| h <= bytes.len());
                let Some(hlen) = hlen else {
                    self.dropped += 1;
                    return;
                };
                let mut place = std::mem::take(&mut self.uc_place);
                let rest = bytes.len() - hlen;
                if self
                    .uc_header(mem, srq, &bytes[..hlen], rest, &mut place)
                    .is_some()
                {
                    for p in place.drain(..) {
                        let at = hlen + p.offset as usize;
                        mem.write(&p.mr, p.addr, &bytes[at..at + p.len as usize]);
                    }
                }
                // Kept for the next packet, holding no region.
                place.clear();
                self.uc_place = place;
            }
            QpType::Ud => {
                let info = unreliable::DatagramInfo::default();
                unreliable::ud_receive(self, mem, srq, &info, bytes);
            }
        }
    }

    /// Feeds the headers of a packet whose payload and pad (`rest_len` bytes) are still
    /// with the transport, and fills `place` (cleared first) with where the payload goes.
    /// Returns the payload length, or `None` when the headers are malformed (the packet is
    /// dropped: the transport skips `rest_len` bytes). The transport must place the
    /// payload before it polls this QP again; see [`io`].
    pub fn handle_header(
        &mut self,
        now: Instant,
        mem: &M,
        srq: Option<&mut Srq<M::Mr>>,
        header: &[u8],
        rest_len: usize,
        place: &mut Vec<Placement<M::Mr>>,
    ) -> Option<usize> {
        place.clear();
        self.header_mark = self.completions.len();
        match self.cfg.qp_type {
            QpType::Rc => {}
            QpType::Uc => return self.uc_header(mem, srq, header, rest_len, place),
            // UD datagrams come whole (handle_datagram).
            QpType::Ud => {
                self.dropped += 1;
                return None;
            }
        }
        // Borrowed where it was parsed: the headers are large enough that a move is a
        // `memcpy`.
        let parsed = codec::decode_split(header, rest_len);
        let (hdr, len) = parsed.as_ref()?;
        self.handle(
            now,
            mem,
            srq,
            hdr,
            &mut Payload::Deferred {
                len: *len,
                out: place,
            },
        );
        Some(*len)
    }

    /// How long a requester waits for an answer before it gives up: the ack timeout (at
    /// least [`QpConfig::min_ack_timeout`]) times the tries `retry_cnt` allows; `None`
    /// with an infinite ack timeout (`timeout` 0).
    pub fn retry_budget(&self) -> Option<Duration> {
        requester::timeout_of(self).map(|t| t * (u32::from(self.sm.attrs().retry_cnt) + 1))
    }

    /// The payload of the last packet whose headers came through
    /// [`handle_header`](Self::handle_header) will not arrive whole (the stream ended or
    /// stalled part-way): the completions the headers gave that depend on it (a receive,
    /// a WRITE with immediate data, a READ) become `WR_FLUSH_ERR`; those they gave for
    /// requests before (acknowledged by a READ response's headers) stand. The queue pair
    /// goes to ERR, whose flush completes the rest. The transport calls it before it
    /// polls the queue pair again, as it would have placed the payload.
    pub fn abort_payload(&mut self) {
        let mark = self.header_mark.min(self.completions.len());
        for (_, c, _) in self.completions.iter_mut().skip(mark) {
            let carries = matches!(
                c.opcode,
                WcOpcode::Recv | WcOpcode::RecvRdmaWithImm | WcOpcode::RdmaRead
            );
            if carries && c.status == WcStatus::Success {
                c.status = WcStatus::WrFlushErr;
                c.byte_len = 0;
                c.imm_data = None;
            }
        }
        self.header_mark = self.completions.len();
        if self.sm.state() != QpState::Reset {
            self.enter_error();
        }
    }

    fn handle(
        &mut self,
        now: Instant,
        mem: &M,
        srq: Option<&mut Srq<M::Mr>>,
        hdr: &codec::RcRepr<'_>,
        payload: &mut Payload<'_, M::Mr>,
    ) {
        if hdr.bth.dest_qpn != self.cfg.qpn {
            return;
        }
        match self.sm.state() {
            QpState::Rtr | QpState::Rts | QpState::Sqd => {}
            // RESET, INIT, SQE and ERR drop incoming packets.
            _ => return,
        }
        if hdr.bth.opcode.is_response() {
            if self.sm.state() != QpState::Rtr {
                requester::handle_response(self, now, mem, hdr, payload);
                self.retire();
            }
        } else {
            responder::handle_request(self, mem, srq, hdr, payload);
        }
    }

    /// The time at which [`handle_timeout`](Self::handle_timeout) must be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.req.poll_timeout()
    }

    /// Handles timer expiry: retransmission, retries exhausted, the end of an RNR wait.
    pub fn handle_timeout(&mut self, now: Instant) {
        // SQD too: what it started must survive a loss to drain.
        if self.sm.processes_sends() {
            requester::handle_timeout(self, now);
            self.retire();
        }
    }

    /// The next completion, with the CQ it belongs to and whether it is solicited (a
    /// receive of a message sent with the solicited-event bit), for CQ notification.
    pub fn poll_completion(&mut self) -> Option<(CqSide, Completion, bool)> {
        self.completions.pop_front()
    }

    /// Whether [`poll_completion`](Self::poll_completion) has a completion to give.
    pub fn has_completions(&self) -> bool {
        !self.completions.is_empty()
    }

    /// Requests posted but not yet completed, on the send and receive queues.
    pub fn outstanding(&self) -> (usize, usize) {
        (self.req.sq.len(), self.rq.len())
    }

    /// End-to-end credits to advertise: receives posted, or none for an SRQ user (the
    /// SRQ is shared, so no per-QP count is meaningful).
    pub(crate) fn credits(&self) -> Option<u32> {
        (!self.cfg.srq).then(|| self.rq.len().min(u32::MAX as usize) as u32)
    }

    pub(crate) fn complete(&mut self, side: CqSide, mut c: Completion, solicited: bool) {
        c.qp_num = self.cfg.qpn;
        self.completions.push_back((side, c, solicited));
    }

    /// Moves the QP to ERR (after an error completion) and flushes what is left.
    pub(crate) fn enter_error(&mut self) {
        if self.sm.state() == QpState::Err {
            return;
        }
        self.sm.set_error();
        self.flush();
    }

    fn flush(&mut self) {
        let qpn = self.cfg.qpn;
        for w in self.req.sq.drain(..) {
            self.spare.put_local(w.local);
            self.completions.push_back((
                CqSide::Send,
                Completion {
                    wr_id: w.wr_id,
                    status: WcStatus::WrFlushErr,
                    opcode: w.op.wc_opcode(),
                    byte_len: 0,
                    imm_data: None,
                    qp_num: qpn,
                    src_qp: 0,
                    grh: false,
                },
                false,
            ));
        }
        self.req.after_flush();
        if let Some(cur) = self.resp.take_receive() {
            self.rq.push_front(cur);
        }
        if let Some(cur) = self.uc.take_receive() {
            self.rq.push_front(cur);
        }
        for r in self.rq.drain(..) {
            self.spare.put_segs(r.segs);
            self.completions.push_back((
                CqSide::Recv,
                Completion {
                    wr_id: r.wr_id,
                    status: WcStatus::WrFlushErr,
                    opcode: WcOpcode::Recv,
                    byte_len: 0,
                    imm_data: None,
                    qp_num: qpn,
                    src_qp: 0,
                    grh: false,
                },
                false,
            ));
        }
    }

    /// Retires completed send requests in order, producing their completions.
    fn retire(&mut self) {
        let mut failed = false;
        while let Some(w) = self.req.sq.front() {
            let Some(status) = w.done else { break };
            let w = self.req.pop_front();
            self.spare.put_local(w.local);
            if status != WcStatus::Success || w.flags.contains(SendFlags::SIGNALED) {
                let c = Completion {
                    wr_id: w.wr_id,
                    status,
                    opcode: w.op.wc_opcode(),
                    byte_len: if status == WcStatus::Success {
                        w.len as u32
                    } else {
                        0
                    },
                    imm_data: None,
                    qp_num: self.cfg.qpn,
                    src_qp: 0,
                    grh: false,
                };
                self.completions.push_back((CqSide::Send, c, false));
            }
            if status != WcStatus::Success {
                failed = true;
                break;
            }
        }
        if failed {
            self.enter_error();
        } else if self.sm.sq_draining() && !self.req.in_flight() {
            self.sq_drained_event |= self.sm.sq_drained();
        }
    }

    /// Takes the SQ-drained event (`IBV_EVENT_SQ_DRAINED`), raised once the send queue
    /// drained after a move to SQD that asked for it (`en_sqd_async_notify`).
    pub fn take_sq_drained_event(&mut self) -> bool {
        std::mem::take(&mut self.sq_drained_event)
    }
}

/// Packets a message of `len` bytes takes at a path MTU of `mtu` bytes (a power of two, as
/// the QP's state machine checks it), none for an empty one: `len.div_ceil(mtu)`, with a
/// shift for the 64-bit division, which takes tens of cycles on the hosts measured.
pub(crate) fn packets_of(len: u64, mtu: u64) -> u64 {
    debug_assert!(mtu.is_power_of_two());
    (len >> mtu.trailing_zeros()) + u64::from(len & (mtu - 1) != 0)
}

/// Where `psn` lies among the `n` PSNs from `first` on (0 for `first`), if it does.
pub(crate) fn psn_offset(psn: u32, first: u32, n: u32) -> Option<u32> {
    let d = rdmx_wire::psn_diff(psn, first);
    (d >= 0 && (d as u32) < n).then_some(d as u32)
}

/// `timeout` code to duration: 4.096 µs × 2^code; 0 means no timeout.
pub(crate) fn ack_timeout(code: u8) -> Option<Duration> {
    (code != 0).then(|| Duration::from_nanos(4096u64 << code.min(31)))
}

#[cfg(test)]
mod tests;
