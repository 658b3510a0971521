//! A whole RC transport packet: BTH, the extension headers its opcode
//! implies, payload and pad.

use core::fmt;

use crate::aeth::{Aeth, AethRepr, AETH_LEN};
use crate::atomic::{
    AtomicAckEth, AtomicAckEthRepr, AtomicEth, AtomicEthRepr, ATOMIC_ACK_ETH_LEN, ATOMIC_ETH_LEN,
};
use crate::bth::{Bth, BthRepr, BTH_LEN};
use crate::error::{Error, Result};
use crate::field::check_len;
use crate::imm::{Ieth, IethRepr, ImmDt, ImmDtRepr, IETH_LEN, IMMDT_LEN};
use crate::opcode::Opcode;
use crate::reth::{Reth, RethRepr, RETH_LEN};

/// The extension headers that may follow a BTH in an RC packet, in wire
/// order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HeaderKind {
    /// RDMA Extended Transport Header.
    Reth,
    /// Atomic Extended Transport Header.
    AtomicEth,
    /// ACK Extended Transport Header.
    Aeth,
    /// Atomic ACK Extended Transport Header.
    AtomicAckEth,
    /// Immediate Data.
    ImmDt,
    /// Invalidate Extended Transport Header.
    Ieth,
}

impl HeaderKind {
    /// Every extension header, in the order they appear on the wire.
    pub const ALL: [HeaderKind; 6] = [
        HeaderKind::Reth,
        HeaderKind::AtomicEth,
        HeaderKind::Aeth,
        HeaderKind::AtomicAckEth,
        HeaderKind::ImmDt,
        HeaderKind::Ieth,
    ];

    /// Length of the header in bytes.
    pub const fn wire_len(self) -> usize {
        match self {
            HeaderKind::Reth => RETH_LEN,
            HeaderKind::AtomicEth => ATOMIC_ETH_LEN,
            HeaderKind::Aeth => AETH_LEN,
            HeaderKind::AtomicAckEth => ATOMIC_ACK_ETH_LEN,
            HeaderKind::ImmDt => IMMDT_LEN,
            HeaderKind::Ieth => IETH_LEN,
        }
    }

    /// Whether packets with opcode `op` carry this header.
    pub const fn present_in(self, op: Opcode) -> bool {
        match self {
            HeaderKind::Reth => op.has_reth(),
            HeaderKind::AtomicEth => op.has_atomic_eth(),
            HeaderKind::Aeth => op.has_aeth(),
            HeaderKind::AtomicAckEth => op.has_atomic_ack_eth(),
            HeaderKind::ImmDt => op.has_immdt(),
            HeaderKind::Ieth => op.has_ieth(),
        }
    }

    /// Byte offset of this header in a packet with opcode `op`, or `None`
    /// if the opcode does not carry it.
    pub const fn offset_in(self, op: Opcode) -> Option<usize> {
        match OFFSETS[op as usize][self as usize] {
            0 => None,
            off => Some(off as usize),
        }
    }

    /// [`HeaderKind::offset_in`], worked out (once, at compile time, into [`OFFSETS`]).
    const fn compute_offset_in(self, op: Opcode) -> Option<usize> {
        if !self.present_in(op) {
            return None;
        }
        let mut off = BTH_LEN;
        let mut i = 0;
        while i < Self::ALL.len() {
            let k = Self::ALL[i];
            if k as u8 == self as u8 {
                break;
            }
            if k.present_in(op) {
                off += k.wire_len();
            }
            i += 1;
        }
        Some(off)
    }

    /// The IBTA name (`"RETH"`, `"AtomicETH"`, …).
    pub const fn name(self) -> &'static str {
        match self {
            HeaderKind::Reth => "RETH",
            HeaderKind::AtomicEth => "AtomicETH",
            HeaderKind::Aeth => "AETH",
            HeaderKind::AtomicAckEth => "AtomicAckETH",
            HeaderKind::ImmDt => "ImmDt",
            HeaderKind::Ieth => "IETH",
        }
    }
}

/// Each extension header's offset in a packet of each opcode (indexed by the opcode's
/// value, then by [`HeaderKind`]); 0 where the opcode carries no such header. Parsing
/// looks offsets up here rather than summing header lengths for every header it reads.
const OFFSETS: [[u8; 6]; 24] = {
    let mut table = [[0u8; 6]; 24];
    let mut i = 0;
    while i < Opcode::ALL.len() {
        let op = Opcode::ALL[i];
        let mut k = 0;
        while k < HeaderKind::ALL.len() {
            if let Some(off) = HeaderKind::ALL[k].compute_offset_in(op) {
                table[op as usize][k] = off as u8;
            }
            k += 1;
        }
        i += 1;
    }
    table
};

/// The extension headers of each opcode (indexed by its value) as a bit set: bit `k` for
/// `HeaderKind::ALL[k]`.
const KINDS: [u8; 24] = {
    let mut kinds = [0u8; 24];
    let mut op = 0;
    while op < 24 {
        let mut k = 0;
        while k < 6 {
            if OFFSETS[op][k] != 0 {
                kinds[op] |= 1 << k;
            }
            k += 1;
        }
        op += 1;
    }
    kinds
};

impl fmt::Display for HeaderKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Pad bytes needed after `payload_len` bytes of payload (0..=3).
pub const fn pad_for(payload_len: usize) -> u8 {
    (payload_len.wrapping_neg() & 3) as u8
}

/// A read/write view of a complete RC transport packet (no ICRC).
///
/// ```text
/// +-----+------+-----------+------+--------------+-------+------+---------+-----+
/// | BTH | RETH | AtomicETH | AETH | AtomicAckETH | ImmDt | IETH | payload | pad |
/// +-----+------+-----------+------+--------------+-------+------+---------+-----+
///   12     16       28        4          8           4      4     0..PMTU   0..3
/// ```
///
/// Only the headers the opcode calls for are present, always in the order
/// above (IBTA vol. 1, §9.2; e.g. RDMA WRITE ONLY WITH IMMEDIATE is BTH,
/// RETH, ImmDt, payload; ATOMIC ACKNOWLEDGE is BTH, AETH, AtomicAckETH).
///
/// The buffer handed to [`RcPacket::new_checked`] / [`RcRepr::parse_bytes`]
/// must end with the pad: **the 4-byte ICRC is not handled here**. On RoCEv2
/// the caller verifies and strips it (it covers the IP/UDP pseudo-header and
/// so belongs with the network layer); over a stream transport it is simply
/// not sent.
///
/// # Pad rules
///
/// The BTH `PadCnt` is the number of bytes (0..=3) appended to the payload
/// so that payload plus pad is a multiple of 4, which keeps the whole
/// transport packet 4-byte aligned (every header length is a multiple of 4).
/// Parsing requires exactly that: the bytes after the headers are a
/// multiple of 4 and at least `PadCnt`. Because FIRST and MIDDLE packets
/// always carry exactly one PMTU (a multiple of 256), their pad count must
/// be 0. Opcodes without payload must have nothing after their headers and
/// a pad count of 0. Pad byte contents are not checked on parse and are
/// emitted as 0.
///
/// # Invariants
///
/// The only constructor, [`RcPacket::new_checked`], validates the whole
/// layout as above, so every accessor is infallible
/// and panic-free afterwards. The opcode is cached; mutation is limited to
/// fields that cannot change the layout (the BTH opcode and pad count are
/// deliberately not settable through the view).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RcPacket<T: AsRef<[u8]>> {
    buffer: T,
    opcode: Opcode,
}

impl<T: AsRef<[u8]>> RcPacket<T> {
    /// Validates `buffer` as one RC packet and wraps it.
    ///
    /// Errors: [`Error::Truncated`] (shorter than the BTH or than the
    /// headers its opcode implies), [`Error::BadVersion`],
    /// [`Error::UnknownOpcode`], [`Error::UnexpectedPayload`],
    /// [`Error::BadPad`]. Header *contents* (e.g. the AETH syndrome) are
    /// checked by [`RcRepr::parse`], not here.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let opcode = Self::check(buffer.as_ref())?;
        Ok(RcPacket { buffer, opcode })
    }

    fn check(data: &[u8]) -> Result<Opcode> {
        let op = Self::check_headers(data)?;
        Self::check_rest(data, op, data.len() - op.header_len())
    }

    /// Checks the version and opcode and that `data` holds the headers the opcode implies.
    fn check_headers(data: &[u8]) -> Result<Opcode> {
        check_len(BTH_LEN, data.len())?;
        let bth = Bth::new_unchecked(data);
        if bth.tver() != 0 {
            return Err(Error::BadVersion(bth.tver()));
        }
        let op = bth.opcode()?;
        check_len(op.header_len(), data.len())?;
        Ok(op)
    }

    /// Checks that `rest` bytes of payload and pad may follow the headers in `data`.
    fn check_rest(data: &[u8], op: Opcode, rest: usize) -> Result<Opcode> {
        let pad = Bth::new_unchecked(data).pad_count();
        if !op.has_payload() {
            if rest != 0 {
                return Err(Error::UnexpectedPayload { len: rest });
            }
            if pad != 0 {
                return Err(Error::BadPad {
                    pad_count: pad,
                    len: 0,
                });
            }
        } else if rest % 4 != 0
            || rest < usize::from(pad)
            || (pad != 0 && (op.is_first() || op.is_middle()))
        {
            return Err(Error::BadPad {
                pad_count: pad,
                len: rest,
            });
        }
        Ok(op)
    }

    /// Unwraps the view.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The packet's opcode.
    pub fn opcode(&self) -> Opcode {
        self.opcode
    }

    /// Total length of the packet (headers, payload and pad).
    pub fn len(&self) -> usize {
        self.buffer.as_ref().len()
    }

    /// Always false: a valid packet holds at least a BTH.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Length of the BTH plus extension headers (offset of the payload).
    pub fn header_len(&self) -> usize {
        self.opcode.header_len()
    }

    /// The BTH pad count.
    pub fn pad_count(&self) -> u8 {
        self.bth().pad_count()
    }

    /// Payload length, excluding pad.
    pub fn payload_len(&self) -> usize {
        self.len() - self.header_len() - usize::from(self.pad_count())
    }

    /// The payload (pad excluded).
    pub fn payload(&self) -> &[u8] {
        let start = self.header_len();
        &self.buffer.as_ref()[start..start + self.payload_len()]
    }

    /// Read view of the BTH.
    pub fn bth(&self) -> Bth<&[u8]> {
        Bth::new_unchecked(&self.buffer.as_ref()[..BTH_LEN])
    }

    fn ext(&self, kind: HeaderKind) -> Option<&[u8]> {
        let off = kind.offset_in(self.opcode)?;
        Some(&self.buffer.as_ref()[off..off + kind.wire_len()])
    }

    /// Read view of the RETH, if the opcode carries one.
    pub fn reth(&self) -> Option<Reth<&[u8]>> {
        self.ext(HeaderKind::Reth).map(Reth::new_unchecked)
    }

    /// Read view of the AtomicETH, if the opcode carries one.
    pub fn atomic_eth(&self) -> Option<AtomicEth<&[u8]>> {
        self.ext(HeaderKind::AtomicEth)
            .map(AtomicEth::new_unchecked)
    }

    /// Read view of the AETH, if the opcode carries one.
    pub fn aeth(&self) -> Option<Aeth<&[u8]>> {
        self.ext(HeaderKind::Aeth).map(Aeth::new_unchecked)
    }

    /// Read view of the AtomicAckETH, if the opcode carries one.
    pub fn atomic_ack_eth(&self) -> Option<AtomicAckEth<&[u8]>> {
        self.ext(HeaderKind::AtomicAckEth)
            .map(AtomicAckEth::new_unchecked)
    }

    /// Read view of the ImmDt, if the opcode carries one.
    pub fn immdt(&self) -> Option<ImmDt<&[u8]>> {
        self.ext(HeaderKind::ImmDt).map(ImmDt::new_unchecked)
    }

    /// Read view of the IETH, if the opcode carries one.
    pub fn ieth(&self) -> Option<Ieth<&[u8]>> {
        self.ext(HeaderKind::Ieth).map(Ieth::new_unchecked)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> RcPacket<T> {
    fn bth_mut(&mut self) -> Bth<&mut [u8]> {
        Bth::new_unchecked(&mut self.buffer.as_mut()[..BTH_LEN])
    }

    fn ext_mut(&mut self, kind: HeaderKind) -> Option<&mut [u8]> {
        let off = kind.offset_in(self.opcode)?;
        Some(&mut self.buffer.as_mut()[off..off + kind.wire_len()])
    }

    /// The payload, mutably (pad excluded).
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let start = self.header_len();
        let end = start + self.payload_len();
        &mut self.buffer.as_mut()[start..end]
    }

    /// Sets the BTH PSN (e.g. when retransmitting); bits above 24 are
    /// discarded.
    pub fn set_psn(&mut self, psn: u32) {
        self.bth_mut().set_psn(psn);
    }

    /// Sets the BTH AckReq bit.
    pub fn set_ack_req(&mut self, v: bool) {
        self.bth_mut().set_ack_req(v);
    }

    /// Sets the BTH Solicited Event bit.
    pub fn set_solicited(&mut self, v: bool) {
        self.bth_mut().set_solicited(v);
    }

    /// Sets the BTH MigReq bit.
    pub fn set_migreq(&mut self, v: bool) {
        self.bth_mut().set_migreq(v);
    }

    /// Sets the BTH FECN bit.
    pub fn set_fecn(&mut self, v: bool) {
        self.bth_mut().set_fecn(v);
    }

    /// Sets the BTH BECN bit.
    pub fn set_becn(&mut self, v: bool) {
        self.bth_mut().set_becn(v);
    }

    /// Sets the BTH partition key.
    pub fn set_pkey(&mut self, v: u16) {
        self.bth_mut().set_pkey(v);
    }

    /// Sets the BTH destination QP; bits above 24 are discarded.
    pub fn set_dest_qpn(&mut self, v: u32) {
        self.bth_mut().set_dest_qpn(v);
    }

    /// Mutable view of the RETH, if the opcode carries one.
    pub fn reth_mut(&mut self) -> Option<Reth<&mut [u8]>> {
        self.ext_mut(HeaderKind::Reth).map(Reth::new_unchecked)
    }

    /// Mutable view of the AtomicETH, if the opcode carries one.
    pub fn atomic_eth_mut(&mut self) -> Option<AtomicEth<&mut [u8]>> {
        self.ext_mut(HeaderKind::AtomicEth)
            .map(AtomicEth::new_unchecked)
    }

    /// Mutable view of the AETH, if the opcode carries one.
    pub fn aeth_mut(&mut self) -> Option<Aeth<&mut [u8]>> {
        self.ext_mut(HeaderKind::Aeth).map(Aeth::new_unchecked)
    }

    /// Mutable view of the AtomicAckETH, if the opcode carries one.
    pub fn atomic_ack_eth_mut(&mut self) -> Option<AtomicAckEth<&mut [u8]>> {
        self.ext_mut(HeaderKind::AtomicAckEth)
            .map(AtomicAckEth::new_unchecked)
    }

    /// Mutable view of the ImmDt, if the opcode carries one.
    pub fn immdt_mut(&mut self) -> Option<ImmDt<&mut [u8]>> {
        self.ext_mut(HeaderKind::ImmDt).map(ImmDt::new_unchecked)
    }

    /// Mutable view of the IETH, if the opcode carries one.
    pub fn ieth_mut(&mut self) -> Option<Ieth<&mut [u8]>> {
        self.ext_mut(HeaderKind::Ieth).map(Ieth::new_unchecked)
    }
}

/// Plain-data form of a whole RC packet.
///
/// Each `Option` header must be `Some` exactly when [`BthRepr::opcode`]
/// calls for it; [`RcRepr::emit`] reports a mismatch as
/// [`Error::MissingHeader`] / [`Error::UnexpectedHeader`].
///
/// On emit, `bth.pad_count` is **ignored** and replaced by
/// [`pad_for`]`(payload_len)`; on parse it is the wire value, which the
/// pad rules force to equal `pad_for(payload.len())`. So
/// `parse(emit(r)) == r` whenever `r.bth.pad_count == pad_for(r.payload.len())`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RcRepr<'a> {
    /// Base transport header.
    pub bth: BthRepr,
    /// RETH (RDMA WRITE FIRST/ONLY, RDMA READ request).
    pub reth: Option<RethRepr>,
    /// AtomicETH (CMP_SWAP, FETCH_ADD).
    pub atomic_eth: Option<AtomicEthRepr>,
    /// AETH (read response FIRST/LAST/ONLY, ACKNOWLEDGE, ATOMIC ACKNOWLEDGE).
    pub aeth: Option<AethRepr>,
    /// AtomicAckETH (ATOMIC ACKNOWLEDGE).
    pub atomic_ack_eth: Option<AtomicAckEthRepr>,
    /// Immediate data (`*_WITH_IMMEDIATE`).
    pub immdt: Option<ImmDtRepr>,
    /// IETH (`*_WITH_INVALIDATE`).
    pub ieth: Option<IethRepr>,
    /// Payload, pad excluded. Borrowed from the parsed buffer; on emit only
    /// [`RcRepr::emit_with_payload`] reads it.
    pub payload: &'a [u8],
}

impl<'a> RcRepr<'a> {
    /// A representation with the given BTH, no extension headers and an
    /// empty payload; fill in the headers the opcode needs.
    pub const fn new(bth: BthRepr) -> RcRepr<'a> {
        RcRepr {
            bth,
            reth: None,
            atomic_eth: None,
            aeth: None,
            atomic_ack_eth: None,
            immdt: None,
            ieth: None,
            payload: &[],
        }
    }

    /// Parses a checked packet view; the payload borrows from the buffer.
    ///
    /// Beyond the layout checks done by [`RcPacket::new_checked`], this
    /// rejects a reserved AETH syndrome ([`Error::BadSyndrome`]).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &RcPacket<&'a T>) -> Result<RcRepr<'a>> {
        let data: &'a [u8] = packet.buffer.as_ref();
        let hlen = packet.opcode.header_len();
        let pad = usize::from(packet.pad_count());
        // Cannot fail for a checked packet; `get` keeps this panic-free
        // even so.
        let payload = data
            .get(hlen..data.len().saturating_sub(pad))
            .ok_or(Error::BadPad {
                pad_count: packet.pad_count(),
                len: data.len().saturating_sub(hlen),
            })?;
        Self::parse_with_payload(packet, payload)
    }

    #[inline]
    fn parse_with_payload<T: AsRef<[u8]> + ?Sized>(
        packet: &RcPacket<&'a T>,
        payload: &'a [u8],
    ) -> Result<RcRepr<'a>> {
        let data: &'a [u8] = packet.buffer.as_ref();
        // The view was checked: length, version and opcode.
        let mut repr = RcRepr::new(BthRepr::parse_checked(
            &Bth::new_unchecked(data),
            packet.opcode,
        ));
        repr.payload = payload;
        // Most packets carry one extension header or none: test the opcode's set once,
        // then parse only what is there.
        let kinds = KINDS[packet.opcode as usize];
        if kinds == 0 {
            return Ok(repr);
        }
        let has = |k: HeaderKind| kinds & (1 << k as u8) != 0;
        if has(HeaderKind::Reth) {
            repr.reth = packet.reth().map(|v| RethRepr::parse(&v)).transpose()?;
        }
        if has(HeaderKind::AtomicEth) {
            repr.atomic_eth = packet
                .atomic_eth()
                .map(|v| AtomicEthRepr::parse(&v))
                .transpose()?;
        }
        if has(HeaderKind::Aeth) {
            repr.aeth = packet.aeth().map(|v| AethRepr::parse(&v)).transpose()?;
        }
        if has(HeaderKind::AtomicAckEth) {
            repr.atomic_ack_eth = packet
                .atomic_ack_eth()
                .map(|v| AtomicAckEthRepr::parse(&v))
                .transpose()?;
        }
        if has(HeaderKind::ImmDt) {
            repr.immdt = packet.immdt().map(|v| ImmDtRepr::parse(&v)).transpose()?;
        }
        if has(HeaderKind::Ieth) {
            repr.ieth = packet.ieth().map(|v| IethRepr::parse(&v)).transpose()?;
        }
        Ok(repr)
    }

    /// [`RcPacket::new_checked`] followed by [`RcRepr::parse`].
    pub fn parse_bytes(buf: &'a [u8]) -> Result<RcRepr<'a>> {
        RcRepr::parse(&RcPacket::new_checked(buf)?)
    }

    /// Parses the headers of a packet whose payload is not at hand: `header` holds
    /// exactly the BTH and the extension headers its opcode implies, and `rest_len`
    /// bytes of payload and pad follow elsewhere (e.g. still in a socket).
    ///
    /// Checks the layout as [`RcPacket::new_checked`] does for the whole packet, and the
    /// header contents as [`RcRepr::parse`] does. Returns the representation, with an
    /// empty `payload`, and the payload length (`rest_len` less the pad).
    ///
    /// This is how a stream transport places payloads without copying them: it parses
    /// the headers first and reads the payload straight to where it belongs.
    #[inline]
    pub fn parse_split(header: &'a [u8], rest_len: usize) -> Result<(RcRepr<'a>, usize)> {
        let op = RcPacket::<&[u8]>::check_headers(header)?;
        let hlen = op.header_len();
        if header.len() != hlen {
            return Err(Error::UnexpectedPayload {
                len: header.len() - hlen,
            });
        }
        RcPacket::<&[u8]>::check_rest(header, op, rest_len)?;
        let packet = RcPacket {
            buffer: header,
            opcode: op,
        };
        let pad = usize::from(packet.pad_count());
        let repr = RcRepr::parse_with_payload(&packet, &[])?;
        Ok((repr, rest_len - pad))
    }

    /// Length of the BTH plus the extension headers of `bth.opcode`.
    pub const fn header_len(&self) -> usize {
        self.bth.opcode.header_len()
    }

    /// Length of the packet carrying `payload_len` payload bytes:
    /// headers, payload and pad (no ICRC).
    pub const fn packet_len(&self, payload_len: usize) -> usize {
        self.header_len() + payload_len + pad_for(payload_len) as usize
    }

    /// Length of the packet carrying `self.payload`
    /// (`packet_len(self.payload.len())`).
    pub const fn buffer_len(&self) -> usize {
        self.packet_len(self.payload.len())
    }

    /// Checks that this representation can be emitted with `payload_len`
    /// bytes of payload: field widths, extension headers matching the
    /// opcode, no payload on opcodes without one, and no pad on FIRST /
    /// MIDDLE packets (their payload must be a multiple of 4).
    pub fn check(&self, payload_len: usize) -> Result<()> {
        let op = self.bth.opcode;
        let pad = pad_for(payload_len);
        BthRepr {
            pad_count: pad,
            ..self.bth
        }
        .check()?;
        let present = [
            self.reth.is_some(),
            self.atomic_eth.is_some(),
            self.aeth.is_some(),
            self.atomic_ack_eth.is_some(),
            self.immdt.is_some(),
            self.ieth.is_some(),
        ];
        let mask = present
            .iter()
            .enumerate()
            .fold(0u8, |m, (k, &is)| m | (u8::from(is) << k));
        // One comparison for the usual case; the loop names the first mismatch.
        if mask != KINDS[op as usize] {
            for (kind, is) in HeaderKind::ALL.into_iter().zip(present) {
                match (kind.present_in(op), is) {
                    (true, false) => return Err(Error::MissingHeader(kind)),
                    (false, true) => return Err(Error::UnexpectedHeader(kind)),
                    _ => {}
                }
            }
        }
        if let Some(aeth) = &self.aeth {
            aeth.check()?;
        }
        if !op.has_payload() && payload_len != 0 {
            return Err(Error::UnexpectedPayload { len: payload_len });
        }
        if pad != 0 && (op.is_first() || op.is_middle()) {
            return Err(Error::BadPad {
                pad_count: pad,
                len: payload_len + usize::from(pad),
            });
        }
        Ok(())
    }

    /// Writes the BTH and extension headers into `buf[..header_len()]`
    /// for a packet that will carry `payload_len` payload bytes, and
    /// returns `header_len()`.
    ///
    /// The payload itself is *not* written (and `self.payload` is ignored):
    /// the caller places `payload_len` bytes followed by
    /// [`pad_for`]`(payload_len)` zero bytes after the headers, in this
    /// buffer or in a separate scatter-gather segment. This keeps large
    /// payloads zero-copy. `buf` only needs room for the headers.
    ///
    /// Fails as [`RcRepr::check`] does, or with [`Error::Truncated`] if
    /// `buf` is shorter than the headers; nothing is written on failure.
    pub fn emit(&self, buf: &mut [u8], payload_len: usize) -> Result<usize> {
        self.check(payload_len)?;
        let op = self.bth.opcode;
        let hlen = op.header_len();
        check_len(hlen, buf.len())?;
        let buf = &mut buf[..hlen];

        let bth = BthRepr {
            pad_count: pad_for(payload_len),
            ..self.bth
        };
        bth.emit(&mut Bth::new_unchecked(&mut buf[..BTH_LEN]));

        let mut at = BTH_LEN;
        let mut slot = |len: usize| {
            let s = at;
            at += len;
            s..at
        };
        if let Some(h) = &self.reth {
            h.emit(&mut Reth::new_unchecked(&mut buf[slot(RETH_LEN)]));
        }
        if let Some(h) = &self.atomic_eth {
            h.emit(&mut AtomicEth::new_unchecked(
                &mut buf[slot(ATOMIC_ETH_LEN)],
            ));
        }
        if let Some(h) = &self.aeth {
            h.emit(&mut Aeth::new_unchecked(&mut buf[slot(AETH_LEN)]));
        }
        if let Some(h) = &self.atomic_ack_eth {
            h.emit(&mut AtomicAckEth::new_unchecked(
                &mut buf[slot(ATOMIC_ACK_ETH_LEN)],
            ));
        }
        if let Some(h) = &self.immdt {
            h.emit(&mut ImmDt::new_unchecked(&mut buf[slot(IMMDT_LEN)]));
        }
        if let Some(h) = &self.ieth {
            h.emit(&mut Ieth::new_unchecked(&mut buf[slot(IETH_LEN)]));
        }
        debug_assert_eq!(at, hlen);
        Ok(hlen)
    }

    /// Writes the whole packet — headers, `self.payload` and zeroed pad —
    /// into `buf[..buffer_len()]` and returns [`RcRepr::buffer_len`].
    ///
    /// Fails as [`RcRepr::emit`] does; `buf` must hold the whole packet.
    pub fn emit_with_payload(&self, buf: &mut [u8]) -> Result<usize> {
        let len = self.payload.len();
        let total = self.packet_len(len);
        self.check(len)?;
        check_len(total, buf.len())?;
        let hlen = self.emit(buf, len)?;
        buf[hlen..hlen + len].copy_from_slice(self.payload);
        buf[hlen + len..total].fill(0);
        Ok(total)
    }
}

impl fmt::Display for RcRepr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = &self.bth;
        write!(f, "{} qpn={:#x} psn={}", b.opcode, b.dest_qpn, b.psn)?;
        if b.ack_req {
            f.write_str(" ackreq")?;
        }
        if b.solicited {
            f.write_str(" se")?;
        }
        if let Some(r) = &self.reth {
            write!(f, " va={:#x} rkey={:#x} len={}", r.va, r.rkey, r.dma_len)?;
        }
        if let Some(a) = &self.atomic_eth {
            write!(
                f,
                " va={:#x} rkey={:#x} swap_add={:#x} compare={:#x}",
                a.va, a.rkey, a.swap_add, a.compare
            )?;
        }
        if let Some(a) = &self.aeth {
            write!(f, " {} msn={}", a.syndrome, a.msn)?;
        }
        if let Some(a) = &self.atomic_ack_eth {
            write!(f, " orig={:#x}", a.orig_data)?;
        }
        if let Some(i) = &self.immdt {
            write!(f, " imm={:#x}", i.imm)?;
        }
        if let Some(i) = &self.ieth {
            write!(f, " inv_rkey={:#x}", i.rkey)?;
        }
        if self.bth.opcode.has_payload() {
            write!(f, " payload={}", self.payload.len())?;
        }
        Ok(())
    }
}
