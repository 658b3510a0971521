//! The unreliable services on the same engine: the UC responder and the UD send and
//! receive paths. (The UC requester is the RC requester with no acknowledgement awaited:
//! a request completes once its last packet is sent.)
//!
//! **UC.** No ACK, no NAK, no retransmission. The responder expects the next PSN; a gap
//! means a lost packet, and the message it belonged to is dropped whole: a receive being
//! filled goes back to the head of its queue without a completion (its bytes may have
//! been written, never reported), a WRITE being placed stops (bytes placed stay, as on an
//! adapter), and every packet is dropped until the next FIRST or ONLY starts a message,
//! which is delivered normally. A message with no receive posted, a bad R_Key, or that
//! does not fit its receive is dropped the same way, and counted.
//!
//! **UD.** One packet per message (`UD_SEND_ONLY`, with or without immediate), each with
//! its own destination (address vector, QP number, Q_Key). A datagram is accepted when
//! the QP is in RTR or later, its DETH carries the QP's Q_Key and a receive is posted that
//! holds the GRH area plus the payload; it lands after the 40-byte GRH area, which gets a
//! GRH naming the source and destination GIDs. Everything else is dropped and counted,
//! never delivered.

use rdmx_wire::{psn_add, psn_diff, DethRepr, GrhRepr, UdRepr, GRH_LEN, GRH_NEXT_HEADER_BTH};

use std::time::Instant;

use super::codec::{self, RcRepr};
use super::io::{Payload, Placement, Span, Transmit};
use super::{for_each_span, CqSide, Local, MemAccess, RcQp, RecvWqe, Srq};
use crate::access::Access;
use crate::mr::KeyUse;
use crate::qp::{QpState, QpType};
use crate::wr::{
    AddressVector, Completion, PostError, SendOp, SendWr, WcOpcode, WcStatus, MULTICAST_QPN,
};

/// The UC responder's state.
#[derive(Debug)]
pub(crate) struct UcResponder<Mr> {
    epsn: u32,
    /// The receive a SEND is filling, and the bytes it holds so far.
    filling: Option<(RecvWqe<Mr>, u64)>,
    /// The WRITE being placed: region, next address, bytes left, total length.
    placing: Option<(Option<Mr>, u64, u64, u32)>,
    /// A message was lost: drop until one starts.
    resync: bool,
}

impl<Mr> UcResponder<Mr> {
    pub(crate) fn new() -> Self {
        UcResponder {
            epsn: 0,
            filling: None,
            placing: None,
            resync: false,
        }
    }

    pub(crate) fn reset(&mut self, rq_psn: u32) {
        *self = UcResponder::new();
        self.epsn = rq_psn;
    }

    /// The receive being filled, if a SEND is half-way.
    pub(crate) fn take_receive(&mut self) -> Option<RecvWqe<Mr>> {
        self.filling.take().map(|(w, _)| w)
    }
}

/// Where a datagram came from and went to, as the transport knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct DatagramInfo {
    /// The sender's GID.
    pub sgid: [u8; 16],
    /// The GID it was sent to (a multicast group's, for a multicast datagram).
    pub dgid: [u8; 16],
    /// The datagram came as RoCEv2 over IPv4 (both GIDs IPv4-mapped): the GRH area gets
    /// what verbs puts there for it (Linux rxe's `rdma_network_hdr`), 20 bytes of zeros
    /// then the datagram's IPv4 header, instead of a GRH.
    pub roce_ipv4: bool,
    /// The datagram came as RoCEv2 over IPv6: the GRH area gets the datagram's IPv6
    /// header, as verbs puts it there (next header UDP, the payload length counting the
    /// UDP header), rather than an InfiniBand GRH (next header the BTH).
    pub roce_ipv6: bool,
}

/// The IPv6 next header (and IPv4 protocol) number of UDP.
const UDP_NEXT_HEADER: u8 = 17;

/// The IPv4 header of a RoCEv2 datagram carrying `packet_len` bytes (BTH to ICRC) from
/// `src` to `dst`, as the receiver saw it (identification 0, DF, TTL 64: what user space
/// cannot see is given its usual value), with its checksum.
fn roce_ipv4_header(src: &[u8; 16], dst: &[u8; 16], packet_len: usize) -> [u8; 20] {
    let mut h = [0u8; 20];
    h[0] = 0x45;
    let total = (20 + 8 + packet_len).min(usize::from(u16::MAX)) as u16;
    h[2..4].copy_from_slice(&total.to_be_bytes());
    h[6] = 0x40;
    h[8] = 64;
    h[9] = 17;
    h[12..16].copy_from_slice(&src[12..16]);
    h[16..20].copy_from_slice(&dst[12..16]);
    let mut sum: u32 = h
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    h[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    h
}

fn take_recv<M: MemAccess>(
    qp: &mut RcQp<M>,
    srq: &mut Option<&mut Srq<M::Mr>>,
) -> Option<RecvWqe<M::Mr>> {
    match srq {
        Some(srq) if qp.cfg.srq => srq.take(),
        _ if qp.cfg.srq => None,
        _ => qp.rq.pop_front(),
    }
}

/// Puts the receive just taken for a packet, not completed, back at the head of its
/// queue (an SRQ withdraws the limit event its take fired).
fn put_back<M: MemAccess>(
    qp: &mut RcQp<M>,
    srq: &mut Option<&mut Srq<M::Mr>>,
    wqe: RecvWqe<M::Mr>,
) {
    match srq {
        Some(srq) if qp.cfg.srq => srq.put_back(wqe),
        _ => qp.rq.push_front(wqe),
    }
}

/// Puts a receive taken for an earlier packet of a message that will not complete back
/// at the head of its queue.
fn give_back<M: MemAccess>(
    qp: &mut RcQp<M>,
    srq: &mut Option<&mut Srq<M::Mr>>,
    wqe: RecvWqe<M::Mr>,
) {
    match srq {
        Some(srq) if qp.cfg.srq => srq.queue.push_front(wqe),
        _ => qp.rq.push_front(wqe),
    }
}

fn complete<M: MemAccess>(
    qp: &mut RcQp<M>,
    srq: &mut Option<&mut Srq<M::Mr>>,
    wqe: RecvWqe<M::Mr>,
    mut c: Completion,
    solicited: bool,
) {
    c.wr_id = wqe.wr_id;
    match srq {
        Some(srq) if qp.cfg.srq => srq.spare.put_segs(wqe.segs),
        _ => qp.spare.put_segs(wqe.segs),
    }
    qp.complete(CqSide::Recv, c, solicited);
}

fn recv_completion(status: WcStatus, opcode: WcOpcode, len: u32, imm: Option<u32>) -> Completion {
    Completion {
        wr_id: 0,
        status,
        opcode,
        byte_len: if status == WcStatus::Success { len } else { 0 },
        imm_data: imm,
        qp_num: 0,
        src_qp: 0,
        grh: false,
    }
}

/// Drops the message in progress (and counts it): its receive goes back unreported.
/// Returns whether there was one.
fn abort_message<M: MemAccess>(qp: &mut RcQp<M>, srq: &mut Option<&mut Srq<M::Mr>>) -> bool {
    let mut lost = qp.uc.placing.take().is_some();
    if let Some((wqe, _)) = qp.uc.filling.take() {
        give_back(qp, srq, wqe);
        lost = true;
    }
    if lost {
        qp.dropped += 1;
    }
    lost
}

/// Handles a UC request packet (SEND or WRITE; the caller stripped the UC prefix).
pub(crate) fn uc_request<M: MemAccess>(
    qp: &mut RcQp<M>,
    mem: &M,
    mut srq: Option<&mut Srq<M::Mr>>,
    hdr: &RcRepr<'_>,
    payload: &mut Payload<'_, M::Mr>,
) {
    let op = hdr.bth.opcode;
    if !(op.is_send() || op.is_write()) || op.has_ieth() {
        qp.dropped += 1;
        return;
    }
    let psn = hdr.bth.psn;
    let in_order = psn_diff(psn, qp.uc.epsn) == 0;
    qp.uc.epsn = psn_add(psn, 1);
    if !in_order || op.starts_message() {
        // A gap, or a new message where one was half-way: what was in progress is lost.
        abort_message(qp, &mut srq);
        qp.uc.resync = !op.starts_message();
    }
    if qp.uc.resync {
        return;
    }
    let mtu = qp.sm.attrs().path_mtu.bytes() as usize;
    if !super::responder::length_fits(op, payload.len(), mtu) {
        // A packet no requester at this path MTU sends: dropped with its message, as a
        // gap drops it (rxe drops it too).
        // One drop for the message, whether or not it had begun here.
        if !abort_message(qp, &mut srq) {
            qp.dropped += 1;
        }
        qp.uc.resync = !op.ends_message();
        return;
    }
    if op.is_send() {
        uc_send(qp, mem, srq, hdr, payload);
    } else {
        uc_write(qp, mem, srq, hdr, payload);
    }
}

fn uc_send<M: MemAccess>(
    qp: &mut RcQp<M>,
    mem: &M,
    mut srq: Option<&mut Srq<M::Mr>>,
    hdr: &RcRepr<'_>,
    payload: &mut Payload<'_, M::Mr>,
) {
    let op = hdr.bth.opcode;
    if op.starts_message() {
        let Some(wqe) = take_recv(qp, &mut srq) else {
            qp.dropped += 1;
            qp.uc.resync = !op.ends_message();
            return;
        };
        qp.uc.filling = Some((wqe, 0));
    }
    let Some((wqe, off)) = qp.uc.filling.as_mut() else {
        return;
    };
    if let Some(err) = wqe.error {
        let (wqe, _) = qp.uc.filling.take().expect("just seen");
        let c = recv_completion(err, WcOpcode::Recv, 0, None);
        complete(qp, &mut srq, wqe, c, false);
        // A receive in error fails the QP, as on RC (the rest is flushed).
        qp.enter_error();
        return;
    }
    if *off + payload.len() as u64 > wqe.len {
        // Too long for the receive: the message is dropped, the receive stays posted.
        let (wqe, _) = qp.uc.filling.take().expect("just seen");
        match op.starts_message() {
            true => put_back(qp, &mut srq, wqe),
            false => give_back(qp, &mut srq, wqe),
        }
        qp.dropped += 1;
        qp.uc.resync = !op.ends_message();
        return;
    }
    let len = payload.len();
    for_each_span(&wqe.segs, *off, len, |s, addr, r| {
        payload.place(mem, &s.mr, addr, r)
    });
    *off += len as u64;
    if op.ends_message() {
        let (wqe, off) = qp.uc.filling.take().expect("just seen");
        let c = recv_completion(
            WcStatus::Success,
            WcOpcode::Recv,
            off as u32,
            hdr.immdt.map(|i| i.imm),
        );
        complete(qp, &mut srq, wqe, c, hdr.bth.solicited);
    }
}

fn uc_write<M: MemAccess>(
    qp: &mut RcQp<M>,
    mem: &M,
    mut srq: Option<&mut Srq<M::Mr>>,
    hdr: &RcRepr<'_>,
    payload: &mut Payload<'_, M::Mr>,
) {
    let op = hdr.bth.opcode;
    if op.starts_message() {
        let Some(reth) = hdr.reth else {
            qp.dropped += 1;
            qp.uc.resync = true;
            return;
        };
        let mr = if reth.dma_len == 0 {
            None
        } else {
            let granted = qp.sm.attrs().qp_access_flags.contains(Access::REMOTE_WRITE);
            match mem.resolve(
                reth.rkey,
                KeyUse::Remote,
                qp.cfg.pd,
                reth.va,
                u64::from(reth.dma_len),
                Access::REMOTE_WRITE,
            ) {
                Ok(mr) if granted => Some(mr),
                _ => {
                    // UC has no NAK: a bad R_Key drops the message.
                    qp.dropped += 1;
                    qp.uc.resync = !op.ends_message();
                    return;
                }
            }
        };
        qp.uc.placing = Some((mr, reth.va, u64::from(reth.dma_len), reth.dma_len));
    }
    let Some((mr, next, left, total)) = qp.uc.placing.as_mut() else {
        return;
    };
    let n = payload.len() as u64;
    if n > *left || (op.ends_message() && n != *left) {
        qp.uc.placing = None;
        qp.dropped += 1;
        qp.uc.resync = !op.ends_message();
        return;
    }
    if let Some(mr) = mr {
        if n > 0 {
            payload.place(mem, mr, *next, 0..n as usize);
        }
    }
    *next += n;
    *left -= n;
    let total = *total;
    if op.ends_message() {
        qp.uc.placing = None;
        if op.has_immdt() {
            let Some(wqe) = take_recv(qp, &mut srq) else {
                qp.dropped += 1;
                return;
            };
            let status = wqe.error.unwrap_or(WcStatus::Success);
            let c = recv_completion(
                status,
                WcOpcode::RecvRdmaWithImm,
                total,
                hdr.immdt.map(|i| i.imm),
            );
            complete(qp, &mut srq, wqe, c, hdr.bth.solicited);
            if status != WcStatus::Success {
                qp.enter_error();
            }
        }
    }
}

/// Builds the next UD datagram of the send queue into `out`, and completes its request.
pub(crate) fn ud_transmit<M: MemAccess>(qp: &mut RcQp<M>, out: &mut Transmit<M::Mr>) -> bool {
    let idx = qp.req.send_idx();
    let Some(w) = qp.req.sq.get(idx) else {
        return false;
    };
    if let Some(err) = w.error {
        if idx == 0 {
            qp.req.sq[0].done = Some(err);
        }
        return false;
    }
    let Some(ud) = w.ud else {
        // The post checks make this unreachable; fail the request rather than guess.
        qp.req.sq[idx].done = Some(WcStatus::LocQpOpErr);
        return false;
    };
    let imm = match w.op {
        SendOp::SendWithImm(i) => Some(i),
        _ => None,
    };
    let qkey = if ud.remote_qkey & 0x8000_0000 != 0 {
        qp.sm.attrs().qkey
    } else {
        ud.remote_qkey
    };
    let (solicited, len) = (
        w.flags.contains(crate::wr::SendFlags::SOLICITED),
        w.len as usize,
    );
    let psn = qp.req.take_psn();
    let w = &qp.req.sq[idx];
    let repr = UdRepr {
        dest_qpn: ud.remote_qpn,
        psn,
        solicited,
        pkey: 0xffff,
        deth: DethRepr {
            qkey,
            src_qpn: qp.cfg.qpn,
        },
        imm,
        payload: &[],
    };
    out.pad = repr.emit_header(len, &mut out.header);
    match &w.local {
        Local::Inline(data) => out.header.extend_from_slice(data),
        Local::Segs(segs) => for_each_span(segs, 0, len, |s, addr, r| {
            out.gather.push(Span {
                mr: s.mr.clone(),
                addr,
                len: r.len() as u32,
            })
        }),
    }
    out.ud_dest = Some(ud.av);
    qp.req.sq[idx].done = Some(WcStatus::Success);
    qp.req.advance_send();
    true
}

/// Handles a UD datagram.
pub(crate) fn ud_receive<M: MemAccess>(
    qp: &mut RcQp<M>,
    mem: &M,
    mut srq: Option<&mut Srq<M::Mr>>,
    info: &DatagramInfo,
    bytes: &[u8],
) {
    let Ok(p) = UdRepr::parse_bytes(bytes) else {
        qp.dropped += 1;
        return;
    };
    let accepting = matches!(qp.sm.state(), QpState::Rtr | QpState::Rts | QpState::Sqd);
    if !accepting
        || (p.dest_qpn != qp.cfg.qpn && p.dest_qpn != MULTICAST_QPN)
        || p.deth.qkey != qp.sm.attrs().qkey
    {
        qp.dropped += 1;
        return;
    }
    let Some(wqe) = take_recv(qp, &mut srq) else {
        qp.dropped += 1;
        return;
    };
    if let Some(err) = wqe.error {
        let c = recv_completion(err, WcOpcode::Recv, 0, None);
        complete(qp, &mut srq, wqe, c, false);
        // A receive in error fails the QP (the rest is flushed).
        qp.enter_error();
        return;
    }
    let total = GRH_LEN + p.payload.len();
    if total as u64 > wqe.len {
        put_back(qp, &mut srq, wqe);
        qp.dropped += 1;
        return;
    }
    let grh = if info.roce_ipv4 {
        let mut area = [0u8; GRH_LEN];
        // The ICRC the transport took off counts in the IP datagram's length.
        area[20..].copy_from_slice(&roce_ipv4_header(&info.sgid, &info.dgid, bytes.len() + 4));
        area
    } else {
        // From the BTH to the ICRC (which the transport took off) included; over IPv6
        // the UDP header too, which comes first.
        let (next_header, udp) = match info.roce_ipv6 {
            true => (UDP_NEXT_HEADER, 8),
            false => (GRH_NEXT_HEADER_BTH, 0),
        };
        GrhRepr {
            traffic_class: 0,
            flow_label: 0,
            payload_len: (udp + bytes.len() + 4).min(usize::from(u16::MAX)) as u16,
            next_header,
            hop_limit: 64,
            sgid: info.sgid,
            dgid: info.dgid,
        }
        .to_bytes()
    };
    let mut head: Payload<'_, M::Mr> = Payload::Bytes(&grh);
    for_each_span(&wqe.segs, 0, GRH_LEN, |s, addr, r| {
        head.place(mem, &s.mr, addr, r)
    });
    let mut body: Payload<'_, M::Mr> = Payload::Bytes(p.payload);
    for_each_span(&wqe.segs, GRH_LEN as u64, p.payload.len(), |s, addr, r| {
        body.place(mem, &s.mr, addr, r)
    });
    let mut c = recv_completion(WcStatus::Success, WcOpcode::Recv, total as u32, p.imm);
    c.src_qp = p.deth.src_qpn;
    c.grh = true;
    complete(qp, &mut srq, wqe, c, p.solicited);
}

/// What the engine does for UC and UD only.
impl<M: MemAccess> RcQp<M> {
    /// What the QP's type refuses at post: on UC, READ and atomics; on UD, anything but
    /// SEND (with or without immediate), a send without a destination, and a message
    /// longer than the largest path MTU.
    pub(crate) fn check_type(&self, wr: &SendWr, inline: Option<&[u8]>) -> Result<(), PostError> {
        let t = self.cfg.qp_type;
        if !t.allows(wr.op) {
            return Err(PostError::Invalid(match t {
                QpType::Uc => "a UC queue pair takes SEND and RDMA WRITE only",
                _ => "a UD queue pair takes SEND only",
            }));
        }
        if t != QpType::Ud {
            return match wr.ud {
                Some(_) => Err(PostError::Invalid("only UD sends name a destination")),
                None => Ok(()),
            };
        }
        if wr.ud.is_none() {
            return Err(PostError::Invalid("a UD send needs a destination"));
        }
        let len = inline.map_or_else(|| wr.sges.total_len(), |d| d.len() as u64);
        if len > u64::from(self.limits.max_mtu.bytes()) {
            return Err(PostError::Invalid("a UD message is at most the path MTU"));
        }
        Ok(())
    }

    /// The next datagram of a UD QP (or packet of another), copied into one new buffer,
    /// with the address vector it goes to (UD only; its QP number is in the BTH).
    pub fn poll_datagram(
        &mut self,
        now: Instant,
        mem: &M,
    ) -> Option<(Vec<u8>, Option<AddressVector>)> {
        let mut out = Vec::new();
        let mut scratch = std::mem::take(&mut self.scratch);
        let sent = self.poll_transmit_parts(now, &mut scratch);
        let dest = scratch.ud_dest;
        if sent {
            scratch.flatten_into(mem, &mut out);
        }
        scratch.clear();
        self.scratch = scratch;
        sent.then_some((out, dest))
    }

    /// Feeds a UD datagram with the addresses the transport saw it come from and go to
    /// (for the GRH the receive buffer starts with). Datagrams with a wrong Q_Key, for
    /// another QP, malformed, or with no receive to take them are dropped and counted
    /// ([`dropped`](Self::dropped)).
    pub fn handle_datagram(
        &mut self,
        mem: &M,
        srq: Option<&mut Srq<M::Mr>>,
        info: &DatagramInfo,
        bytes: &[u8],
    ) {
        if self.cfg.qp_type == QpType::Ud {
            ud_receive(self, mem, srq, info, bytes);
        } else {
            self.dropped += 1;
        }
    }

    /// Datagrams (UD) and whole messages (UC) dropped on receipt: wrong Q_Key, wrong QP,
    /// malformed, lost packets, no receive posted, too long for the receive.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// [`handle_header`](Self::handle_header) for a UC QP: the UC prefix is checked and
    /// taken off a copy of the headers, which then run the RC parser.
    pub(crate) fn uc_header(
        &mut self,
        mem: &M,
        srq: Option<&mut Srq<M::Mr>>,
        header: &[u8],
        rest_len: usize,
        place: &mut Vec<Placement<M::Mr>>,
    ) -> Option<usize> {
        place.clear();
        let mut copy = [0u8; 64];
        let ok = header.len() <= copy.len()
            && header
                .first()
                .is_some_and(|&op| op & rdmx_wire::SERVICE_MASK == rdmx_wire::UC_PREFIX);
        let rc_op = header.first().and_then(|&op| rdmx_wire::uc_to_rc(op));
        let (true, Some(rc_op)) = (ok, rc_op) else {
            self.dropped += 1;
            return None;
        };
        let copy = &mut copy[..header.len()];
        copy.copy_from_slice(header);
        copy[0] = rc_op;
        let Some((hdr, len)) = codec::decode_split(copy, rest_len) else {
            self.dropped += 1;
            return None;
        };
        if hdr.bth.dest_qpn != self.cfg.qpn
            || !matches!(self.sm.state(), QpState::Rtr | QpState::Rts | QpState::Sqd)
        {
            return Some(len);
        }
        uc_request(
            self,
            mem,
            srq,
            &hdr,
            &mut Payload::Deferred { len, out: place },
        );
        Some(len)
    }
}
