//! The requester: turns send requests into packets, and acknowledgements, NAKs and
//! responses into completions.
//!
//! Requests are transmitted in order, segmented by the path MTU, each packet with the next
//! PSN. A READ request takes as many PSNs as its response has packets. Requests complete in
//! the order they were posted: an ACK completes SENDs and WRITEs up to its PSN, a READ
//! completes with its last response packet, an atomic with its ATOMIC ACKNOWLEDGE.
//!
//! Recovery is go-back-N from the start of the oldest affected request: on a timeout
//! (`retry_cnt` times, then `RETRY_EXC_ERR`), on an RNR NAK (after waiting the NAK's RNR
//! timer, `rnr_retry` times with 7 meaning forever, then `RNR_RETRY_EXC_ERR`), and on a
//! PSN-sequence NAK. Responders handle the resulting duplicates.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rdmx_wire::{psn_add, psn_diff, AtomicEthRepr, RethRepr};

use super::codec::{self, NakCode, Opcode, RcRepr, Syndrome};
use super::io::{Payload, Span, Transmit};
use super::{ack_timeout, for_each_span, packets_of, psn_offset, Local, MemAccess, RcQp};
use crate::wr::{SendFlags, SendOp, SendWr, WcStatus};

/// A send request as the requester holds it.
#[derive(Debug)]
pub(crate) struct SendWqe<Mr> {
    pub(crate) wr_id: u64,
    pub(crate) op: SendOp,
    pub(crate) flags: SendFlags,
    pub(crate) local: Local<Mr>,
    pub(crate) len: u64,
    /// A local error found at post time; reported when the request's turn comes.
    pub(crate) error: Option<WcStatus>,
    /// PSN of the first packet, once started.
    pub(crate) first_psn: u32,
    /// PSNs the request occupies (packets, or READ response packets).
    pub(crate) npsn: u32,
    /// READ: PSN of the next response packet expected.
    pub(crate) next_resp: u32,
    /// READ: response packets the last request skipped, those taken before the rewind
    /// that preceded it (set again at each rewind): asked for again, the READ asks for
    /// the rest only.
    resume: u32,
    /// Final status, once known.
    pub(crate) done: Option<WcStatus>,
    /// UD: where the datagram goes.
    pub(crate) ud: Option<crate::wr::UdDest>,
}

impl<Mr> SendWqe<Mr> {
    fn last_psn(&self) -> u32 {
        psn_add(self.first_psn, self.npsn - 1)
    }
    /// READ: PSN of the first response its last request asked for.
    fn resp_start(&self) -> u32 {
        psn_add(self.first_psn, self.resume)
    }
    fn contains(&self, psn: u32) -> bool {
        psn_offset(psn, self.first_psn, self.npsn).is_some()
    }
}

#[derive(Debug)]
pub(crate) struct Requester<Mr> {
    pub(crate) sq: VecDeque<SendWqe<Mr>>,
    /// Index in `sq` of the request being (or next to be) transmitted.
    send_idx: usize,
    /// Bytes of `sq[send_idx]` already sent.
    send_off: u64,
    /// Requests at the front of `sq` that were ever started: at least `send_idx`, more
    /// after a rewind. Those are in flight, and SQD still (re)sends them.
    started_hw: usize,
    next_psn: u32,
    /// Every PSN before this one is known to have reached the peer (the send window's
    /// start).
    acked: u32,
    /// READs and atomics sent and not completed.
    rd_atomic: u32,
    retry_left: u8,
    rnr_left: u8,
    retry_cnt: u8,
    rnr_retry: u8,
    timer: Option<Instant>,
    rnr_until: Option<Instant>,
    /// The peer's advertised receive credits, from its last ACK.
    pub(crate) peer_credits: Option<u32>,
}

impl<Mr> Requester<Mr> {
    pub(crate) fn new() -> Self {
        Requester {
            sq: VecDeque::new(),
            send_idx: 0,
            send_off: 0,
            started_hw: 0,
            next_psn: 0,
            acked: 0,
            rd_atomic: 0,
            retry_left: 0,
            rnr_left: 0,
            retry_cnt: 0,
            rnr_retry: 0,
            timer: None,
            rnr_until: None,
            peer_credits: None,
        }
    }

    pub(crate) fn reset(&mut self, sq_psn: u32, retry_cnt: u8, rnr_retry: u8) {
        self.next_psn = sq_psn;
        self.acked = sq_psn;
        self.set_retry_counts(retry_cnt, rnr_retry);
    }

    /// New `retry_cnt` and `rnr_retry`; the counts left restart from them.
    pub(crate) fn set_retry_counts(&mut self, retry_cnt: u8, rnr_retry: u8) {
        self.retry_cnt = retry_cnt;
        self.rnr_retry = rnr_retry;
        self.retry_left = retry_cnt;
        self.rnr_left = rnr_retry;
    }

    pub(crate) fn push(
        &mut self,
        wr: &SendWr,
        local: Local<Mr>,
        len: u64,
        error: Option<WcStatus>,
    ) {
        self.sq.push_back(SendWqe {
            wr_id: wr.wr_id,
            op: wr.op,
            flags: wr.flags,
            local,
            len,
            error,
            first_psn: 0,
            npsn: 0,
            next_resp: 0,
            resume: 0,
            done: None,
            ud: wr.ud,
        });
    }

    /// Index in the queue of the next request to send.
    pub(crate) fn send_idx(&self) -> usize {
        self.send_idx
    }

    /// The next PSN, taken by a one-packet request (UD).
    pub(crate) fn take_psn(&mut self) -> u32 {
        let psn = self.next_psn;
        self.next_psn = psn_add(psn, 1);
        psn
    }

    /// The request at `send_idx` was sent whole (UD).
    pub(crate) fn advance_send(&mut self) {
        self.send_idx += 1;
        self.started_hw = self.started_hw.max(self.send_idx);
    }

    pub(crate) fn pop_front(&mut self) -> SendWqe<Mr> {
        let w = self.sq.pop_front().expect("caller checked");
        self.send_idx = self.send_idx.saturating_sub(1);
        self.started_hw = self.started_hw.saturating_sub(1);
        w
    }

    pub(crate) fn after_flush(&mut self) {
        self.send_idx = 0;
        self.send_off = 0;
        self.started_hw = 0;
        self.rd_atomic = 0;
        self.timer = None;
        self.rnr_until = None;
    }

    /// The peer answered up to (not including) `next`: the send window moves on.
    /// Returns whether it moved.
    fn answered(&mut self, next: u32) -> bool {
        let moved = psn_diff(next, self.acked) > 0;
        if moved {
            self.acked = next;
        }
        moved
    }

    /// Whether any started request has not completed.
    pub(crate) fn in_flight(&self) -> bool {
        self.sq
            .iter()
            .take(self.started_hw)
            .any(|w| w.done.is_none())
    }

    /// Whether the next packet belongs to a request already started: a multi-packet
    /// message partly sent, or a request being sent again after a rewind. SQD sends
    /// these and starts nothing new.
    pub(crate) fn continues_started(&self) -> bool {
        self.send_off > 0 || self.send_idx < self.started_hw
    }

    /// Whether a request waits to be sent (new, or again after a rewind), or has
    /// finished and waits to retire.
    pub(crate) fn has_work(&self) -> bool {
        self.send_idx < self.sq.len() || self.sq.front().is_some_and(|w| w.done.is_some())
    }

    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        match (self.timer, self.rnr_until) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Checks the bookkeeping between calls (tests only): the READ/atomic count, the
    /// indices, and that completed requests never wait behind incomplete ones.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        assert!(self.send_idx <= self.started_hw, "send_idx past started_hw");
        assert!(
            self.started_hw <= self.sq.len(),
            "started_hw past the queue"
        );
        assert!(self.send_off == 0 || self.send_idx < self.sq.len());
        let sent_rd = self
            .sq
            .iter()
            .take(self.send_idx)
            .filter(|w| w.op.is_read_or_atomic() && w.done.is_none() && w.npsn > 0)
            .count();
        assert_eq!(self.rd_atomic as usize, sent_rd, "rd_atomic out of step");
        assert!(
            self.sq.iter().all(|w| w.done.is_none()),
            "a completed request was left in the queue"
        );
        let mut psn = None;
        for w in self.sq.iter().take(self.started()) {
            if w.npsn == 0 {
                continue;
            }
            if let Some(p) = psn {
                assert_eq!(
                    w.first_psn, p,
                    "PSNs of started requests are not contiguous"
                );
            }
            psn = Some(psn_add(w.first_psn, w.npsn));
        }
    }

    /// Requests started: those before `send_idx`, and the message being sent if it is
    /// half-way (a transport that takes packets slowly can get answers to its first
    /// packets before its last ones are out).
    fn started(&self) -> usize {
        (self.send_idx + usize::from(self.send_off > 0)).min(self.sq.len())
    }

    /// Index of the started request whose PSNs include `psn`.
    fn find(&self, psn: u32) -> Option<usize> {
        (0..self.started()).find(|&i| self.sq[i].npsn > 0 && self.sq[i].contains(psn))
    }

    /// Whether every request before `idx` has completed, so `idx` may complete now.
    fn is_oldest(&self, idx: usize) -> bool {
        self.sq.iter().take(idx).all(|w| w.done.is_some())
    }

    /// Restarts transmission at request `idx` (its first packet, same PSNs).
    fn rewind(&mut self, idx: usize) {
        if idx >= self.started() {
            return;
        }
        self.next_psn = self.sq[idx].first_psn;
        for w in self.sq.iter_mut().skip(idx) {
            if w.op.is_read_or_atomic() && w.done.is_none() && w.npsn > 0 {
                self.rd_atomic -= 1;
                if matches!(w.op, SendOp::Read(_)) {
                    // Its responses come in order: those before `next_resp` are placed.
                    w.resume = psn_diff(w.next_resp, w.first_psn).max(0) as u32;
                }
            }
            w.npsn = 0;
        }
        self.send_idx = idx;
        self.send_off = 0;
    }

    /// Restarts transmission at PSN `psn` of request `idx` when that is part-way through a
    /// SEND or WRITE whose packets before it the peer has (a sequence NAK names the PSN
    /// the peer expects; an ACK said it has those before): only the rest is sent again,
    /// as rxe does, so a long message on a lossy path is not sent from its start after
    /// every loss. Otherwise restarts at the request's first packet ([`rewind`](Self::rewind)).
    fn resume_at(&mut self, idx: usize, psn: u32, mtu: u64) {
        if idx >= self.started() {
            return;
        }
        let w = &self.sq[idx];
        let k = psn_diff(psn, w.first_psn);
        let midway = matches!(
            w.op,
            SendOp::Send | SendOp::SendWithImm(_) | SendOp::Write(_) | SendOp::WriteWithImm(..)
        ) && w.npsn > 1
            && k > 0
            && (k as u32) < w.npsn;
        let npsn = w.npsn;
        self.rewind(idx);
        if midway {
            // The request keeps its PSNs; transmission goes on from packet `k`.
            self.sq[idx].npsn = npsn;
            self.next_psn = psn;
            self.send_off = k as u64 * mtu;
        }
    }

    /// Marks everything strictly before `psn` as acknowledged (SENDs and WRITEs).
    fn ack_before(&mut self, psn: u32) -> bool {
        let mut progress = false;
        for w in self.sq.iter_mut().take(self.send_idx) {
            if w.done.is_some() || w.npsn == 0 {
                continue;
            }
            if psn_diff(psn, w.last_psn()) <= 0 {
                break;
            }
            if w.op.is_read_or_atomic() {
                // An ACK past a READ or atomic whose response never came: its response was
                // lost. Leave it for the retransmission timer.
                break;
            }
            w.done = Some(WcStatus::Success);
            progress = true;
        }
        progress
    }
}

pub(crate) fn timeout_of<M: MemAccess>(qp: &RcQp<M>) -> Option<Duration> {
    ack_timeout(qp.sm.attrs().timeout).map(|t| t.max(qp.cfg.min_ack_timeout))
}

/// The requests the retransmission timer watches: those sent whole, and the one part-way
/// sent when the send window holds the rest of it back (it waits there for
/// acknowledgements that may never come). A message part-way sent for any other reason
/// is still going out (a stream taking it as fast as it can): its packets are not
/// acknowledged before its last one asks, and the timer starts once it is out, however
/// long that takes.
fn watched<M: MemAccess>(qp: &RcQp<M>) -> usize {
    let w = qp.cfg.send_window;
    let held = w > 0 && psn_diff(qp.req.next_psn, qp.req.acked) >= w as i32;
    match held {
        true => qp.req.started(),
        false => qp.req.send_idx,
    }
}

fn arm<M: MemAccess>(qp: &mut RcQp<M>, now: Instant) {
    let outstanding = qp.req.sq.iter().take(watched(qp)).any(|w| w.done.is_none());
    qp.req.timer = match (outstanding, timeout_of(qp)) {
        (true, Some(t)) => Some(now + t),
        _ => None,
    };
}

fn progress<M: MemAccess>(qp: &mut RcQp<M>, now: Instant) {
    qp.req.retry_left = qp.req.retry_cnt;
    qp.req.rnr_left = qp.req.rnr_retry;
    arm(qp, now);
}

/// Builds the next packet of the send queue into `out` (cleared by the caller), if one
/// may go now.
pub(crate) fn transmit<M: MemAccess>(
    qp: &mut RcQp<M>,
    now: Instant,
    out: &mut Transmit<M::Mr>,
) -> Option<()> {
    if let Some(t) = qp.req.rnr_until {
        if now < t {
            return None;
        }
        qp.req.rnr_until = None;
    }
    let uc = qp.cfg.qp_type == crate::qp::QpType::Uc;
    let attrs = qp.sm.attrs();
    let mtu = attrs.path_mtu.bytes() as u64;
    let max_rd = u32::from(attrs.max_rd_atomic.max(1));
    let dest = attrs.dest_qp_num;
    let req = &mut qp.req;
    let idx = req.send_idx;
    let w = req.sq.get(idx)?;
    if let Some(err) = w.error {
        // A request that failed its local checks completes with its error once everything
        // before it has completed.
        if idx == 0 {
            req.sq[0].done = Some(err);
        }
        return None;
    }
    let fence = w.flags.contains(SendFlags::FENCE);
    if req.send_off == 0 {
        if fence && req.rd_atomic > 0 {
            return None;
        }
        if w.op.is_read_or_atomic() && req.rd_atomic >= max_rd {
            return None;
        }
    }
    let psn = req.next_psn;
    // UC awaits no acknowledgement, so nothing would ever move a window on: its packets
    // leave as the transport takes them.
    let window = if uc { 0 } else { qp.cfg.send_window };
    if window > 0 && psn_diff(psn, req.acked) >= window as i32 {
        return None;
    }
    // Asks for an acknowledgement every quarter window, so the window moves during long
    // messages too.
    let ask_ack = window > 0 && psn % (window / 4).max(1) == 0;
    // Payload bytes `(offset into the request, length)`.
    let mut payload = (0, 0);
    let mut hdr;
    req.started_hw = req.started_hw.max(idx + 1);
    let w = &mut req.sq[idx];
    match w.op {
        SendOp::Send | SendOp::SendWithImm(_) | SendOp::Write(_) | SendOp::WriteWithImm(..) => {
            let first = req.send_off == 0;
            let chunk = (w.len - req.send_off).min(mtu);
            let last = req.send_off + chunk == w.len;
            if first {
                w.first_psn = psn;
                w.npsn = packets_of(w.len, mtu).max(1) as u32;
            }
            payload = (req.send_off, chunk as usize);
            let imm = match w.op {
                SendOp::SendWithImm(i) | SendOp::WriteWithImm(_, i) => Some(i),
                _ => None,
            };
            let op = match w.op {
                SendOp::Send | SendOp::SendWithImm(_) => {
                    codec::send_opcode(first, last, imm.is_some())
                }
                _ => codec::write_opcode(first, last, imm.is_some()),
            };
            hdr = codec::header(op, dest, psn);
            if let (true, SendOp::Write(r) | SendOp::WriteWithImm(r, _)) = (first, w.op) {
                hdr.reth = Some(RethRepr {
                    va: r.addr,
                    rkey: r.rkey,
                    dma_len: w.len as u32,
                });
            }
            if last {
                hdr.immdt = imm.map(|imm| rdmx_wire::ImmDtRepr { imm });
                hdr.bth.ack_req = !uc;
                if uc {
                    // UC awaits no acknowledgement: sent is done.
                    w.done = Some(WcStatus::Success);
                }
                hdr.bth.solicited = w.flags.contains(SendFlags::SOLICITED);
                req.send_idx += 1;
                req.send_off = 0;
            } else {
                hdr.bth.ack_req = ask_ack;
                req.send_off += chunk;
            }
            req.next_psn = psn_add(psn, 1);
        }
        SendOp::Read(r) => {
            // Sent again (its PSNs are the same, see `rewind`), it asks for the responses
            // from the first one not taken: a large READ on a lossy path then completes
            // by parts rather than only when all of it arrives in one go.
            let k = match psn == w.first_psn {
                true => w.resume,
                false => 0,
            };
            w.first_psn = psn;
            w.npsn = packets_of(w.len, mtu).max(1) as u32;
            w.resume = k.min(w.npsn - 1);
            let skip = u64::from(w.resume) * mtu;
            w.next_resp = w.resp_start();
            hdr = codec::header(Opcode::RdmaReadRequest, dest, w.next_resp);
            hdr.reth = Some(RethRepr {
                va: r.addr.wrapping_add(skip),
                rkey: r.rkey,
                dma_len: (w.len - skip) as u32,
            });
            hdr.bth.ack_req = true;
            req.next_psn = psn_add(psn, w.npsn);
            req.rd_atomic += 1;
            req.send_idx += 1;
        }
        SendOp::CompareSwap {
            remote,
            compare,
            swap,
        } => {
            w.first_psn = psn;
            w.npsn = 1;
            hdr = codec::header(Opcode::CompareSwap, dest, psn);
            hdr.atomic_eth = Some(AtomicEthRepr {
                va: remote.addr,
                rkey: remote.rkey,
                swap_add: swap,
                compare,
            });
            hdr.bth.ack_req = true;
            req.next_psn = psn_add(psn, 1);
            req.rd_atomic += 1;
            req.send_idx += 1;
        }
        SendOp::FetchAdd { remote, add } => {
            w.first_psn = psn;
            w.npsn = 1;
            hdr = codec::header(Opcode::FetchAdd, dest, psn);
            hdr.atomic_eth = Some(AtomicEthRepr {
                va: remote.addr,
                rkey: remote.rkey,
                swap_add: add,
                compare: 0,
            });
            hdr.bth.ack_req = true;
            req.next_psn = psn_add(psn, 1);
            req.rd_atomic += 1;
            req.send_idx += 1;
        }
    }
    if qp.req.timer.is_none() && !uc {
        qp.req.timer = timeout_of(qp).map(|t| now + t);
    }
    out.pad = codec::encode_header(&hdr, payload.1, &mut out.header);
    if uc {
        out.header[0] |= rdmx_wire::UC_PREFIX;
    }
    gather(&qp.req.sq[idx].local, payload.0, payload.1, out);
    Some(())
}

/// Adds `len` bytes starting `off` bytes into the request's local data to the packet:
/// spans of registered memory, or inline bytes after the headers.
fn gather<Mr: Clone>(local: &Local<Mr>, off: u64, len: usize, out: &mut Transmit<Mr>) {
    match local {
        Local::Inline(data) => out
            .header
            .extend_from_slice(&data[off as usize..off as usize + len]),
        Local::Segs(segs) => for_each_span(segs, off, len, |s, addr, r| {
            out.gather.push(Span {
                mr: s.mr.clone(),
                addr,
                len: r.len() as u32,
            })
        }),
    }
}

/// Puts the payload starting `off` bytes into the request's local segments.
fn scatter<M: MemAccess>(
    mem: &M,
    local: &Local<M::Mr>,
    off: u64,
    payload: &mut Payload<'_, M::Mr>,
) {
    if let Local::Segs(segs) = local {
        let len = payload.len();
        for_each_span(segs, off, len, |s, addr, r| {
            payload.place(mem, &s.mr, addr, r)
        });
    }
}

/// Handles an ACK, NAK, READ response or ATOMIC ACKNOWLEDGE.
pub(crate) fn handle_response<M: MemAccess>(
    qp: &mut RcQp<M>,
    now: Instant,
    mem: &M,
    hdr: &RcRepr<'_>,
    payload: &mut Payload<'_, M::Mr>,
) {
    let psn = hdr.bth.psn;
    // Responses for PSNs never sent are ghosts.
    if psn_diff(psn, qp.req.next_psn) >= 0 {
        return;
    }
    let syndrome = hdr.aeth.map(|a| a.syndrome);
    // Every answer says the peer has the packets before it; an ACK (of any kind) and a
    // response its own PSN too.
    let moved = match syndrome {
        Some(Syndrome::Ack { .. }) | None => qp.req.answered(psn_add(psn, 1)),
        Some(_) => qp.req.answered(psn),
    };
    let plain_ack =
        hdr.bth.opcode == Opcode::Acknowledge && matches!(syndrome, Some(Syndrome::Ack { .. }));
    if moved && !plain_ack {
        // PSNs the peer had not acknowledged before arrived: the path works, and the
        // retries start over (part of a long message the window holds back, or requests
        // behind a READ or atomic whose answer was lost and is being asked for again).
        // (A plain ACK does so once, below, after the requests it completes.)
        progress(qp, now);
    }
    if let Some(Syndrome::Ack { credits }) = syndrome {
        qp.req.peer_credits = credits.count();
    }
    match (hdr.bth.opcode, syndrome) {
        (Opcode::Acknowledge, Some(Syndrome::Ack { .. })) => {
            let next = psn_add(psn, 1);
            // Not short-circuited: the requests before `next` complete either way.
            if qp.req.ack_before(next) | moved {
                progress(qp, now);
            }
        }
        (Opcode::Acknowledge, Some(Syndrome::RnrNak { timer })) => {
            let progressed = qp.req.ack_before(psn);
            let Some(idx) = qp.req.find(psn) else { return };
            if qp.req.rnr_retry != 7 {
                if qp.req.rnr_left == 0 {
                    // Completions are in order: with an earlier READ or atomic unanswered
                    // (its answer was lost) the timer resends from there first.
                    if qp.req.is_oldest(idx) {
                        qp.req.sq[idx].done = Some(WcStatus::RnrRetryExcErr);
                    }
                    return;
                }
                qp.req.rnr_left -= 1;
            }
            if progressed {
                qp.req.retry_left = qp.req.retry_cnt;
            }
            qp.req.rewind(idx);
            qp.req.rnr_until = Some(now + timer.to_duration());
            qp.req.timer = None;
        }
        (Opcode::Acknowledge, Some(Syndrome::Nak(nak))) => {
            if qp.req.ack_before(psn) {
                progress(qp, now);
            }
            let Some(idx) = qp.req.find(psn) else { return };
            if nak != NakCode::PsnSequenceError && !qp.req.is_oldest(idx) {
                // An earlier READ or atomic is unanswered, so its answer was lost; the
                // timer resends from it, and this request is NAKed again in its turn.
                return;
            }
            match nak {
                NakCode::PsnSequenceError => {
                    let mtu = u64::from(qp.sm.attrs().path_mtu.bytes());
                    qp.req.resume_at(idx, psn, mtu)
                }
                NakCode::InvalidRequest | NakCode::InvalidRdRequest => {
                    qp.req.sq[idx].done = Some(WcStatus::RemInvReqErr)
                }
                NakCode::RemoteAccessError => qp.req.sq[idx].done = Some(WcStatus::RemAccessErr),
                NakCode::RemoteOperationalError => qp.req.sq[idx].done = Some(WcStatus::RemOpErr),
            }
        }
        (op, _) if op.is_read_response() => {
            let Some(idx) = qp.req.find(psn) else { return };
            // A response acknowledges every request before its READ.
            let first = qp.req.sq[idx].first_psn;
            if qp.req.ack_before(first) {
                progress(qp, now);
            }
            if !qp.req.is_oldest(idx) {
                // An earlier READ or atomic is unanswered: its answer was lost (answers
                // come in order). Taking this one would complete requests out of order and
                // let more READs and atomics out than max_rd_atomic, until the responder
                // forgets the lost one; the timer resends from the lost one instead.
                return;
            }
            let mtu = qp.sm.attrs().path_mtu.bytes() as u64;
            let w = &mut qp.req.sq[idx];
            if !matches!(w.op, SendOp::Read(_)) || w.done.is_some() || psn != w.next_resp {
                // Out of order (a response was lost) or not a READ: wait for the timer.
                return;
            }
            let off = u64::from(psn_diff(psn, w.first_psn) as u32) * mtu;
            let last = psn == w.last_psn();
            let expect = if last { w.len - off } else { mtu };
            // Where the last request asked to start, a response may start a message (its
            // answer) or not (a late one of the answer before, whose bytes are the same).
            let starts_ok = match psn == w.first_psn {
                true => op.starts_message(),
                false => psn == w.resp_start() || !op.starts_message(),
            };
            // FIRST, LAST and ONLY carry an AETH, which must say ACK: a NAK comes as an
            // Acknowledge, so a response that says one is malformed.
            let nak = !matches!(syndrome, Some(Syndrome::Ack { .. }) | None);
            if payload.len() as u64 != expect || !starts_ok || op.ends_message() != last || nak {
                w.done = Some(WcStatus::BadRespErr);
                return;
            }
            scatter(mem, &w.local, off, payload);
            w.next_resp = psn_add(psn, 1);
            if last {
                w.done = Some(WcStatus::Success);
                qp.req.rd_atomic -= 1;
            }
            progress(qp, now);
        }
        (Opcode::AtomicAcknowledge, _) => {
            let Some(idx) = qp.req.find(psn) else { return };
            if qp.req.ack_before(psn) {
                progress(qp, now);
            }
            if !qp.req.is_oldest(idx) {
                // As for READ responses: an earlier answer was lost.
                return;
            }
            let w = &mut qp.req.sq[idx];
            if !w.op.is_atomic() || w.done.is_some() {
                return;
            }
            let Some(orig) = hdr.atomic_ack_eth.map(|a| a.orig_data) else {
                return;
            };
            if !matches!(syndrome, Some(Syndrome::Ack { .. })) {
                // As for READ responses: a NAK comes as an Acknowledge.
                w.done = Some(WcStatus::BadRespErr);
                return;
            }
            // From the header, so at hand whatever the packet's payload is.
            scatter(mem, &w.local, 0, &mut Payload::Bytes(&orig.to_ne_bytes()));
            w.done = Some(WcStatus::Success);
            qp.req.rd_atomic -= 1;
            progress(qp, now);
        }
        _ => {}
    }
}

/// Retransmission timer or RNR wait expired.
pub(crate) fn handle_timeout<M: MemAccess>(qp: &mut RcQp<M>, now: Instant) {
    if qp.req.rnr_until.is_some_and(|t| now >= t) {
        qp.req.rnr_until = None;
        arm(qp, now);
    }
    let Some(t) = qp.req.timer else { return };
    if now < t {
        return;
    }
    let Some(oldest) = qp.req.sq.iter().position(|w| w.done.is_none()) else {
        qp.req.timer = None;
        return;
    };
    if oldest >= watched(qp) {
        qp.req.timer = None;
        return;
    }
    if qp.req.retry_left == 0 {
        qp.req.sq[oldest].done = Some(WcStatus::RetryExcErr);
        qp.req.timer = None;
        return;
    }
    qp.req.retry_left -= 1;
    if !qp.cfg.reliable_link {
        // From the first packet not acknowledged (the peer has those before it).
        let mtu = u64::from(qp.sm.attrs().path_mtu.bytes());
        let acked = qp.req.acked;
        qp.req.resume_at(oldest, acked, mtu);
    }
    qp.req.timer = timeout_of(qp).map(|d| now + d);
}
