//! The engine's packets, as `rdmx-wire` represents them.
//!
//! The engine reasons about [`RcRepr`]s: the transport headers as plain values, in the
//! wire crate's own types ([`Opcode`], [`Syndrome`], the extension header reprs). This
//! module adds what the engine needs on top: the opcode for a packet at a given place in
//! its message, headers with the engine's fixed fields filled in, and encoding and
//! decoding restricted to the opcodes the engine implements.

use rdmx_wire as wire;

pub(crate) use wire::{NakCode, Opcode, RcRepr, Syndrome};

/// Headers for a packet of `op` to `dest_qpn` at `psn`, with no extension headers: the
/// caller adds those the opcode needs.
pub(crate) fn header(op: Opcode, dest_qpn: u32, psn: u32) -> RcRepr<'static> {
    RcRepr::new(wire::BthRepr {
        opcode: op,
        solicited: false,
        migreq: false,
        pad_count: 0,
        pkey: 0xffff,
        fecn: false,
        becn: false,
        dest_qpn: dest_qpn & wire::QPN_MASK,
        ack_req: false,
        psn: psn & wire::PSN_MASK,
    })
}

/// The SEND opcode for a packet at this position.
pub(crate) fn send_opcode(first: bool, last: bool, imm: bool) -> Opcode {
    match (first, last, imm) {
        (true, true, false) => Opcode::SendOnly,
        (true, true, true) => Opcode::SendOnlyWithImmediate,
        (true, false, _) => Opcode::SendFirst,
        (false, false, _) => Opcode::SendMiddle,
        (false, true, false) => Opcode::SendLast,
        (false, true, true) => Opcode::SendLastWithImmediate,
    }
}

/// The RDMA WRITE opcode for a packet at this position.
pub(crate) fn write_opcode(first: bool, last: bool, imm: bool) -> Opcode {
    match (first, last, imm) {
        (true, true, false) => Opcode::RdmaWriteOnly,
        (true, true, true) => Opcode::RdmaWriteOnlyWithImmediate,
        (true, false, _) => Opcode::RdmaWriteFirst,
        (false, false, _) => Opcode::RdmaWriteMiddle,
        (false, true, false) => Opcode::RdmaWriteLast,
        (false, true, true) => Opcode::RdmaWriteLastWithImmediate,
    }
}

/// The RDMA READ response opcode for a packet at this position.
pub(crate) fn read_response_opcode(first: bool, last: bool) -> Opcode {
    match (first, last) {
        (true, true) => Opcode::RdmaReadResponseOnly,
        (true, false) => Opcode::RdmaReadResponseFirst,
        (false, false) => Opcode::RdmaReadResponseMiddle,
        (false, true) => Opcode::RdmaReadResponseLast,
    }
}

/// An ACK syndrome advertising `credits` receives (`None`: no credit limit).
pub(crate) fn ack(credits: Option<u32>) -> Syndrome {
    Syndrome::Ack {
        credits: credits.map_or(wire::Credits::UNLIMITED, wire::Credits::from_count),
    }
}

/// An RNR NAK syndrome with the RNR timer `code` (`min_rnr_timer`, 5 bits).
pub(crate) fn rnr_nak(code: u8) -> Syndrome {
    Syndrome::RnrNak {
        timer: wire::RnrTimer::from_code(code & 0x1f).expect("masked to 5 bits"),
    }
}

/// An AETH with `syndrome` and the MSN `msn`.
pub(crate) fn aeth(syndrome: Syndrome, msn: u32) -> Option<wire::AethRepr> {
    Some(wire::AethRepr {
        syndrome,
        msn: msn & wire::MSN_MASK,
    })
}

/// Whether `hdr` is a BTH and nothing else, consistent with `payload_len` bytes of
/// payload and `pad`: every check [`RcRepr::emit`] makes passes for it (a header that
/// fails one goes the general way, which names the failure).
fn bth_only(hdr: &RcRepr<'_>, payload_len: usize, pad: u8) -> bool {
    let op = hdr.bth.opcode;
    op.header_len() == wire::BTH_LEN
        && hdr.reth.is_none()
        && hdr.atomic_eth.is_none()
        && hdr.aeth.is_none()
        && hdr.atomic_ack_eth.is_none()
        && hdr.immdt.is_none()
        && hdr.ieth.is_none()
        && (op.has_payload() || payload_len == 0)
        && (pad == 0 || !(op.is_first() || op.is_middle()))
        && hdr.bth.dest_qpn <= wire::QPN_MASK
        && hdr.bth.psn <= wire::PSN_MASK
}

/// Bytes of an acknowledgement: its BTH and AETH.
pub(crate) const ACK_LEN: usize = wire::BTH_LEN + wire::AETH_LEN;

/// The bytes of `ack`, an ACKNOWLEDGE (BTH and AETH, no payload), as [`encode_header`]
/// writes them, without its general checks and its growable buffer.
pub(crate) fn ack_bytes(ack: &RcRepr<'_>) -> [u8; ACK_LEN] {
    debug_assert_eq!(ack.check(0), Ok(()));
    debug_assert_eq!(ack.bth.opcode, Opcode::Acknowledge);
    let mut b = [0u8; ACK_LEN];
    let (bth, aeth) = b.split_at_mut(wire::BTH_LEN);
    ack.bth.emit(&mut wire::Bth::new_unchecked(bth));
    if let Some(a) = &ack.aeth {
        a.emit(&mut wire::Aeth::new_unchecked(aeth));
    }
    b
}

/// Whether the engine implements `op`. SEND with invalidate needs memory windows, which
/// rdmx does not offer yet.
fn supported(op: Opcode) -> bool {
    !op.has_ieth()
}

/// Appends the packet for `hdr` and `payload` to `out` (tests forge packets with it).
#[cfg(test)]
pub(crate) fn encode(hdr: &RcRepr<'_>, payload: &[u8], out: &mut Vec<u8>) {
    let start = out.len();
    let pad = encode_header(hdr, payload.len(), out);
    out.extend_from_slice(payload);
    out.resize(out.len() + usize::from(pad), 0);
    debug_assert!(decode(&out[start..]).is_some());
}

/// Appends the headers `hdr` with `payload_len` bytes of payload to follow, and returns
/// the pad the payload needs after it. `hdr.payload` is not read.
pub(crate) fn encode_header(hdr: &RcRepr<'_>, payload_len: usize, out: &mut Vec<u8>) -> u8 {
    let pad = wire::pad_for(payload_len);
    if bth_only(hdr, payload_len, pad) {
        // Most data packets (SEND ONLY, the middle and last packets of a message): the BTH
        // alone, written directly; the general path below checks and writes the same
        // bytes at some five times the cost, on every request's way out.
        let mut b = [0u8; wire::BTH_LEN];
        wire::BthRepr {
            pad_count: pad,
            ..hdr.bth
        }
        .emit(&mut wire::Bth::new_unchecked(&mut b[..]));
        out.extend_from_slice(&b);
        return pad;
    }
    let start = out.len();
    out.resize(start + hdr.header_len(), 0);
    // The engine builds only consistent headers; a failure here is a bug in the engine.
    hdr.emit(&mut out[start..], payload_len)
        .expect("engine headers are consistent with their opcode");
    wire::pad_for(payload_len)
}

/// Parses a packet, its payload borrowed from `bytes`; `None` when it is malformed or
/// uses an opcode the engine does not implement (the caller drops it, as an adapter drops
/// a packet with a bad header).
pub(crate) fn decode(bytes: &[u8]) -> Option<RcRepr<'_>> {
    let repr = RcRepr::parse_bytes(bytes).ok()?;
    supported(repr.bth.opcode).then_some(repr)
}

/// Parses the headers of a packet whose payload and pad (`rest_len` bytes) are
/// elsewhere; returns them and the payload length.
#[inline]
pub(crate) fn decode_split(header: &[u8], rest_len: usize) -> Option<(RcRepr<'_>, usize)> {
    // The opcode is looked at before parsing, so that the parsed headers move to the
    // caller once (they are large enough for every move to be a `memcpy`).
    if let Some(op) = header.first().and_then(|&b| Opcode::try_from(b).ok()) {
        if !supported(op) {
            return None;
        }
    }
    RcRepr::parse_split(header, rest_len).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The direct BTH and the general path write the same bytes, for every opcode, flag
    /// and payload length that takes it, and the general path alone takes the rest.
    #[test]
    fn a_lone_bth_is_written_as_the_general_path_writes_it() {
        let mut direct = 0;
        for code in 0..=255u8 {
            let Ok(op) = Opcode::try_from(code) else {
                continue;
            };
            for (len, flags) in [(0, 0u8), (1, 1), (4, 2), (7, 3), (256, 0), (255, 1)] {
                let mut h = header(op, 0xab_cdef, 0x12_3456 + u32::from(flags));
                h.bth.solicited = flags & 1 != 0;
                h.bth.ack_req = flags & 2 != 0;
                let pad = wire::pad_for(len);
                if !bth_only(&h, len, pad) {
                    continue;
                }
                direct += 1;
                let mut fast = vec![0xee];
                assert_eq!(encode_header(&h, len, &mut fast), pad);
                let mut general = vec![0xee; 1 + h.header_len()];
                h.emit(&mut general[1..], len).expect("a consistent header");
                assert_eq!(fast, general, "{op:?} with {len} bytes");
            }
        }
        // SEND FIRST/MIDDLE/LAST/ONLY, WRITE MIDDLE/LAST, READ RESPONSE MIDDLE.
        assert!(direct >= 7 * 3, "only {direct} headers went the direct way");
        // A header with an extension goes the general way.
        let mut ack = header(Opcode::Acknowledge, 1, 2);
        ack.aeth = aeth(self::ack(None), 3);
        assert!(!bth_only(&ack, 0, 0));
        // So does one the general path refuses (a pad on a FIRST packet).
        assert!(!bth_only(&header(Opcode::SendFirst, 1, 2), 255, 1));
    }
}
