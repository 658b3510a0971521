//! The responder: executes requests from the peer and answers them.
//!
//! Each request packet is checked against the expected PSN. In sequence, it is executed:
//! a SEND is scattered into the next receive (or answered with an RNR NAK when none is
//! posted), a WRITE is placed after its rkey, bounds and access are checked, a READ is
//! answered with response packets, an atomic is executed once on an 8-aligned address.
//! A duplicate (an older PSN) is re-acknowledged; a duplicate READ is executed again; a
//! duplicate atomic gets its saved answer, never a second execution. A PSN from the future
//! gets one PSN-sequence NAK until the expected packet arrives, and none after an RNR NAK
//! (the requester comes back to the RNR-NAKed PSN by itself). ACKs are coalesced: one
//! ACK answers every packet received since the last one. Each AETH carries the number of
//! receives posted, as end-to-end credits.

use std::collections::VecDeque;

use rdmx_wire::psn_add;

use super::codec::{self, Opcode, RcRepr, Syndrome};
use super::io::{Span, Transmit};
use super::{psn_offset, RecvWqe};
use crate::qp::QpAttr;

mod request;

pub(crate) use request::{handle_request, length_fits};

/// A receive being filled by a multi-packet SEND.
#[derive(Debug)]
struct Filling<Mr> {
    wqe: RecvWqe<Mr>,
    off: u64,
}

/// A WRITE being placed, across packets.
#[derive(Debug)]
struct Placing<Mr> {
    mr: Option<Mr>,
    next: u64,
    left: u64,
    /// The DMA length from the first packet's RETH.
    total: u32,
}

/// Answers a responder holds before it drops new requests, beyond twice its responder
/// resources (a READ or atomic answer and the ACK before it). A requester keeps at most
/// `max_rd_atomic` READs and atomics outstanding and ACKs coalesce, so only a peer that
/// sends without reading what it is sent gets this far; its requests are then dropped as
/// if lost, and the queue stays bounded, in memory and in the time a duplicate READ takes
/// to find its earlier answer.
const EXTRA_ANSWERS: usize = 64;

/// An answer waiting to go. Packets wait as header values and are encoded into the
/// transport's buffer as they go, so answering allocates nothing.
#[derive(Debug)]
enum Answer<Mr> {
    /// A packet of headers only (ACK, NAK).
    Packet(RcRepr<'static>),
    /// The ATOMIC ACKNOWLEDGE of the atomic at `psn`; `again` when it answers a
    /// duplicate.
    Atomic {
        psn: u32,
        again: bool,
        packet: RcRepr<'static>,
    },
    /// A READ whose response packets are made one at a time as they are sent, so a large
    /// READ never holds its whole response in memory.
    Read(ReadJob<Mr>),
}

#[derive(Debug)]
struct ReadJob<Mr> {
    mr: Option<Mr>,
    va: u64,
    len: u64,
    psn: u32,
    /// Index of the next response packet.
    next: u64,
    packets: u64,
    mtu: u64,
    dest: u32,
    credits: Option<u32>,
    msn: u32,
    /// The answer to a duplicate request.
    again: bool,
}

impl<Mr> ReadJob<Mr> {
    /// The next response packet into `out`; `false` once all were made. The payload is
    /// left in memory, as a span for the transport to gather.
    fn next_packet(&mut self, out: &mut Transmit<Mr>) -> bool
    where
        Mr: Clone,
    {
        let i = self.next;
        if i == self.packets {
            return false;
        }
        self.next += 1;
        let off = i * self.mtu;
        let chunk = (self.len - off.min(self.len)).min(self.mtu) as usize;
        if let Some(mr) = &self.mr {
            if chunk > 0 {
                out.gather.push(Span {
                    mr: mr.clone(),
                    addr: self.va + off,
                    len: chunk as u32,
                });
            }
        }
        let (first, last) = (i == 0, i + 1 == self.packets);
        let mut h = codec::header(
            codec::read_response_opcode(first, last),
            self.dest,
            psn_add(self.psn, i as u32),
        );
        if first || last {
            h.aeth = codec::aeth(codec::ack(self.credits), self.msn);
        }
        out.pad = codec::encode_header(&h, chunk, &mut out.header);
        true
    }
}

/// What a duplicate READ or atomic is answered with.
#[derive(Debug)]
enum Replay {
    /// A READ's first PSN and how many its response takes.
    Read {
        psn: u32,
        packets: u32,
    },
    Atomic {
        psn: u32,
        orig: u64,
    },
}

#[derive(Debug)]
pub(crate) struct Responder<Mr> {
    epsn: u32,
    msn: u32,
    filling: Option<Filling<Mr>>,
    placing: Option<Placing<Mr>>,
    /// A sequence NAK or an RNR NAK was sent for the current `epsn`: later PSNs are
    /// dropped without another NAK until `epsn` arrives.
    nak_sent: bool,
    /// PSN to acknowledge, coalesced, with the MSN as of that PSN (later requests may
    /// have moved `msn` on before the ACK is built).
    ack: Option<(u32, u32)>,
    /// Answers waiting to go, in order.
    out: VecDeque<Answer<Mr>>,
    replay: VecDeque<Replay>,
}

impl<Mr> Responder<Mr> {
    pub(crate) fn new() -> Self {
        Responder {
            epsn: 0,
            msn: 0,
            filling: None,
            placing: None,
            nak_sent: false,
            ack: None,
            out: VecDeque::new(),
            replay: VecDeque::new(),
        }
    }

    pub(crate) fn reset(&mut self, rq_psn: u32) {
        *self = Responder::new();
        self.epsn = rq_psn;
    }

    /// The receive being filled, if a SEND is half-way.
    pub(crate) fn take_receive(&mut self) -> Option<RecvWqe<Mr>> {
        self.filling.take().map(|f| f.wqe)
    }

    /// Whether [`poll_transmit`](Self::poll_transmit) has a packet to give.
    pub(crate) fn has_output(&self) -> bool {
        !self.out.is_empty() || self.ack.is_some()
    }

    /// The next answer into `out` (cleared first); `false` when there is none.
    pub(crate) fn poll_transmit(
        &mut self,
        attrs: &QpAttr,
        credits: Option<u32>,
        out: &mut Transmit<Mr>,
    ) -> bool
    where
        Mr: Clone,
    {
        out.clear();
        while let Some(front) = self.out.front_mut() {
            match front {
                Answer::Packet(_) | Answer::Atomic { .. } => {
                    let p = match self.out.pop_front() {
                        Some(Answer::Packet(p) | Answer::Atomic { packet: p, .. }) => p,
                        _ => unreachable!("front is a packet"),
                    };
                    out.pad = codec::encode_header(&p, 0, &mut out.header);
                    return true;
                }
                Answer::Read(job) => {
                    if job.next_packet(out) {
                        if job.next == job.packets {
                            // Its last packet: the answer leaves the queue with it. Left
                            // for the next poll, it would still count against the
                            // responder resources when a transport that stops between
                            // two polls (a paced one, a full socket) has sent it, and the
                            // requester, its READ complete, sends the next.
                            self.out.pop_front();
                        }
                        return true;
                    }
                    self.out.pop_front();
                }
            }
        }
        match self.ack_packet(attrs, credits) {
            Some(p) => {
                out.pad = codec::encode_header(&p, 0, &mut out.header);
                true
            }
            None => false,
        }
    }

    /// The coalesced ACK as bytes, if it is the next answer: the one
    /// [`poll_transmit`](Self::poll_transmit) would give now (no other answer waits
    /// before it).
    pub(crate) fn poll_ack(
        &mut self,
        attrs: &QpAttr,
        credits: Option<u32>,
    ) -> Option<[u8; codec::ACK_LEN]> {
        if !self.out.is_empty() {
            return None;
        }
        self.ack_packet(attrs, credits)
            .map(|p| codec::ack_bytes(&p))
    }

    /// The coalesced ACK, if one is due.
    #[inline]
    fn ack_packet(&mut self, attrs: &QpAttr, credits: Option<u32>) -> Option<RcRepr<'static>> {
        let (psn, msn) = self.ack.take()?;
        let mut h = codec::header(Opcode::Acknowledge, attrs.dest_qp_num, psn);
        h.aeth = codec::aeth(codec::ack(credits), msn);
        Some(h)
    }

    /// New READs and atomics answered but not fully sent (repeated answers to duplicates
    /// excepted): the responder resources in use.
    fn resources_in_use(&self) -> usize {
        self.out
            .iter()
            .filter(|a| match a {
                Answer::Read(j) => !j.again,
                Answer::Atomic { again, .. } => !again,
                Answer::Packet(_) => false,
            })
            .count()
    }

    /// Answers waiting to go.
    #[cfg(test)]
    pub(crate) fn queued(&self) -> usize {
        self.out.len()
    }

    /// Whether the answers waiting to go reached their bound (see [`EXTRA_ANSWERS`]).
    fn full(&self, attrs: &QpAttr) -> bool {
        self.out.len() >= 2 * usize::from(attrs.max_dest_rd_atomic.max(1)) + EXTRA_ANSWERS
    }

    /// Drops the answers still queued to the READ whose response PSNs start at `first`
    /// and number `packets` (an earlier repeated answer starts inside them): the
    /// requester asked again, so the answer about to be queued replaces them.
    fn forget_read(&mut self, first: u32, packets: u32) {
        self.out.retain(|a| match a {
            Answer::Read(j) => psn_offset(j.psn, first, packets).is_none(),
            _ => true,
        });
    }

    fn push(&mut self, attrs: &QpAttr, credits: Option<u32>, answer: Answer<Mr>) {
        if let Some(ack) = self.ack_packet(attrs, credits) {
            self.out.push_back(Answer::Packet(ack));
        }
        self.out.push_back(answer);
    }

    fn nak(&mut self, attrs: &QpAttr, credits: Option<u32>, psn: u32, syndrome: Syndrome) {
        let mut h = codec::header(Opcode::Acknowledge, attrs.dest_qp_num, psn);
        h.aeth = codec::aeth(syndrome, self.msn);
        self.push(attrs, credits, Answer::Packet(h));
    }

    /// Remembers an atomic's answer at `psn` as one from long before (its PSN taken
    /// again after the 24-bit PSNs wrapped).
    #[cfg(test)]
    pub(crate) fn remember_old_atomic(&mut self, psn: u32, orig: u64) {
        self.replay.push_front(Replay::Atomic { psn, orig });
    }

    /// Remembers `r`, the newest answer, for requests asked again (looked up newest
    /// first: the 24-bit PSNs wrap, so an entry left from long before may carry the same
    /// PSN as a recent one). At most `depth` are kept.
    fn remember(&mut self, r: Replay, depth: u8) {
        self.replay.push_back(r);
        while self.replay.len() > usize::from(depth.max(1)) {
            self.replay.pop_front();
        }
    }
}
