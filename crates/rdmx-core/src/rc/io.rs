//! Packets in and out without copying payloads.
//!
//! A datagram transport hands the engine whole packets ([`RcQp::handle_packet`]) and takes
//! whole packets back ([`RcQp::poll_transmit_into`] into a buffer it reuses, or
//! [`RcQp::poll_transmit`] into a new one); the engine copies payloads between them and
//! registered memory. A stream transport can do better, and these types are how:
//!
//! - **Out**: [`RcQp::poll_transmit_parts`] fills a [`Transmit`]: the headers (and any
//!   inline payload) as bytes, then the payload as [`Span`]s of registered memory that the
//!   transport gathers itself, e.g. with one vectored write straight from that memory.
//! - **In**: [`RcQp::handle_header`] takes the headers and the payload's length only. The
//!   engine checks the packet exactly as it would a whole one (PSN, key, bounds, access,
//!   receive length) and answers with [`Placement`]s: which bytes of the payload go where.
//!   The transport then reads the payload from its source straight into those places and
//!   skips the bytes no placement names.
//!
//! The engine updates its state when it sees the headers: it may queue a completion or an
//! acknowledgement for a payload that is not in memory yet. A transport using
//! `handle_header` must therefore place the payload **before** it next calls
//! [`RcQp::poll_completion`] or [`RcQp::poll_transmit_parts`] on that queue pair, so no
//! completion and no acknowledgement gets ahead of its data. A stream per queue pair gives
//! that order for free.
//!
//! None of these calls allocates in the steady state: a [`Transmit`] and a placement
//! vector the transport keeps and hands in again keep their room, and so do the engine's
//! own queues. With posts through [`RcQp::post_send_ref`] and [`RcQp::post_recv_ref`], a
//! queue pair that has warmed up sends, receives and completes without touching the heap
//! ([`RcQp::poll_transmit`], which returns a new `Vec`, is the exception).
//!
//! [`RcQp::handle_packet`]: super::RcQp::handle_packet
//! [`RcQp::poll_transmit`]: super::RcQp::poll_transmit
//! [`RcQp::poll_transmit_into`]: super::RcQp::poll_transmit_into
//! [`RcQp::post_send_ref`]: super::RcQp::post_send_ref
//! [`RcQp::post_recv_ref`]: super::RcQp::post_recv_ref
//! [`RcQp::poll_transmit_parts`]: super::RcQp::poll_transmit_parts
//! [`RcQp::handle_header`]: super::RcQp::handle_header
//! [`RcQp::poll_completion`]: super::RcQp::poll_completion

use std::ops::Range;

use super::MemAccess;

/// Bytes of registered memory: `len` bytes at `addr` inside the resolved region `mr`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Span<Mr> {
    /// The region; holding it keeps the memory alive.
    pub mr: Mr,
    /// Address of the first byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
}

/// A packet to send: `header`, then the bytes of each span of `gather` in order, then
/// `pad` zero bytes.
#[derive(Debug)]
pub struct Transmit<Mr> {
    /// BTH and extension headers, followed by the payload when it is inline.
    pub header: Vec<u8>,
    /// Payload still in registered memory.
    pub gather: Vec<Span<Mr>>,
    /// Zero bytes after the payload (IBTA pad, 0..=3).
    pub pad: u8,
    /// A UD datagram: the address vector it goes to (its QP number is in the BTH).
    pub ud_dest: Option<crate::wr::AddressVector>,
}

impl<Mr> Default for Transmit<Mr> {
    fn default() -> Self {
        Transmit {
            header: Vec::new(),
            gather: Vec::new(),
            pad: 0,
            ud_dest: None,
        }
    }
}

impl<Mr> Transmit<Mr> {
    /// Length of the whole packet in bytes.
    pub fn len(&self) -> usize {
        self.header.len()
            + self.gather.iter().map(|s| s.len as usize).sum::<usize>()
            + usize::from(self.pad)
    }

    /// Whether the packet is empty (never true of a packet the engine made).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn clear(&mut self) {
        self.header.clear();
        self.gather.clear();
        self.pad = 0;
        self.ud_dest = None;
    }

    /// Replaces what `out` holds with the packet as one run of bytes, reading the gathered
    /// spans through `mem`. The bytes `out` held are overwritten rather than zeroed first
    /// (only a longer packet grows it): a reused buffer costs one copy of the payload.
    pub(crate) fn flatten_into<M: MemAccess<Mr = Mr>>(&self, mem: &M, out: &mut Vec<u8>) {
        let len = self.len();
        out.truncate(len);
        out.resize(len, 0);
        let (head, mut rest) = out.split_at_mut(self.header.len());
        head.copy_from_slice(&self.header);
        for s in &self.gather {
            let (span, tail) = rest.split_at_mut(s.len as usize);
            mem.read(&s.mr, s.addr, span);
            rest = tail;
        }
        rest.fill(0);
    }
}

/// Where received payload bytes belong: payload bytes `[offset, offset + len)` go to
/// `len` bytes at `addr` inside the resolved region `mr`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement<Mr> {
    /// The region; holding it keeps the memory alive.
    pub mr: Mr,
    /// Address of the first byte.
    pub addr: u64,
    /// Offset of the first byte in the payload.
    pub offset: u32,
    /// Length in bytes.
    pub len: u32,
}

/// A received payload as the engine sees it: bytes at hand, or bytes the transport will
/// place once the engine says where.
pub(crate) enum Payload<'a, Mr> {
    Bytes(&'a [u8]),
    Deferred {
        len: usize,
        out: &'a mut Vec<Placement<Mr>>,
    },
}

impl<Mr: Clone> Payload<'_, Mr> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Payload::Bytes(b) => b.len(),
            Payload::Deferred { len, .. } => *len,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Puts payload bytes `range` at `addr` in `mr` (the caller checked key and bounds).
    pub(crate) fn place<M: MemAccess<Mr = Mr>>(
        &mut self,
        mem: &M,
        mr: &Mr,
        addr: u64,
        range: Range<usize>,
    ) {
        match self {
            Payload::Bytes(b) => mem.write(mr, addr, &b[range]),
            Payload::Deferred { out, .. } => {
                if !range.is_empty() {
                    out.push(Placement {
                        mr: mr.clone(),
                        addr,
                        offset: range.start as u32,
                        len: range.len() as u32,
                    });
                }
            }
        }
    }
}
