//! RC transport opcodes.

use core::fmt;

use crate::error::Error;

/// A Reliable Connected BTH opcode (IBTA vol. 1, §9.2, "OpCode" field).
///
/// The 8-bit BTH opcode is split into a 3-bit transport-service prefix and a
/// 5-bit operation. Reliable Connected is prefix `000`, so every RC opcode is
/// in `0x00..=0x1F`; this crate models the 23 opcodes defined for RC up to
/// IBTA 1.4 (`0x15` is RD-only RESYNC and `0x18..=0x1F` were reserved; the
/// IBTA 1.5 FLUSH / ATOMIC WRITE additions are not supported). Any other byte
/// is rejected by [`Opcode::try_from`] with [`Error::UnknownOpcode`].
///
/// The extension headers that follow the BTH are implied by the opcode; see
/// the `has_*` methods. Position methods ([`is_first`](Self::is_first) …)
/// describe where the packet sits in its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Opcode {
    /// `SEND_FIRST` (0x00): first packet of a multi-packet SEND.
    SendFirst = 0x00,
    /// `SEND_MIDDLE` (0x01).
    SendMiddle = 0x01,
    /// `SEND_LAST` (0x02).
    SendLast = 0x02,
    /// `SEND_LAST_WITH_IMMEDIATE` (0x03): BTH, ImmDt, payload.
    SendLastWithImmediate = 0x03,
    /// `SEND_ONLY` (0x04): a single-packet SEND.
    SendOnly = 0x04,
    /// `SEND_ONLY_WITH_IMMEDIATE` (0x05): BTH, ImmDt, payload.
    SendOnlyWithImmediate = 0x05,
    /// `RDMA_WRITE_FIRST` (0x06): BTH, RETH, payload.
    RdmaWriteFirst = 0x06,
    /// `RDMA_WRITE_MIDDLE` (0x07).
    RdmaWriteMiddle = 0x07,
    /// `RDMA_WRITE_LAST` (0x08).
    RdmaWriteLast = 0x08,
    /// `RDMA_WRITE_LAST_WITH_IMMEDIATE` (0x09): BTH, ImmDt, payload.
    RdmaWriteLastWithImmediate = 0x09,
    /// `RDMA_WRITE_ONLY` (0x0A): BTH, RETH, payload.
    RdmaWriteOnly = 0x0A,
    /// `RDMA_WRITE_ONLY_WITH_IMMEDIATE` (0x0B): BTH, RETH, ImmDt, payload.
    RdmaWriteOnlyWithImmediate = 0x0B,
    /// `RDMA_READ_REQUEST` (0x0C): BTH, RETH; no payload.
    RdmaReadRequest = 0x0C,
    /// `RDMA_READ_RESPONSE_FIRST` (0x0D): BTH, AETH, payload.
    RdmaReadResponseFirst = 0x0D,
    /// `RDMA_READ_RESPONSE_MIDDLE` (0x0E): BTH, payload (no AETH).
    RdmaReadResponseMiddle = 0x0E,
    /// `RDMA_READ_RESPONSE_LAST` (0x0F): BTH, AETH, payload.
    RdmaReadResponseLast = 0x0F,
    /// `RDMA_READ_RESPONSE_ONLY` (0x10): BTH, AETH, payload.
    RdmaReadResponseOnly = 0x10,
    /// `ACKNOWLEDGE` (0x11): BTH, AETH; carries ACKs, RNR NAKs and NAKs.
    Acknowledge = 0x11,
    /// `ATOMIC_ACKNOWLEDGE` (0x12): BTH, AETH, AtomicAckETH.
    AtomicAcknowledge = 0x12,
    /// `CMP_SWAP` (0x13): BTH, AtomicETH.
    CompareSwap = 0x13,
    /// `FETCH_ADD` (0x14): BTH, AtomicETH.
    FetchAdd = 0x14,
    /// `SEND_LAST_WITH_INVALIDATE` (0x16): BTH, IETH, payload.
    SendLastWithInvalidate = 0x16,
    /// `SEND_ONLY_WITH_INVALIDATE` (0x17): BTH, IETH, payload.
    SendOnlyWithInvalidate = 0x17,
}

use Opcode::*;

impl Opcode {
    /// Every RC opcode, in numeric order.
    pub const ALL: [Opcode; 23] = [
        SendFirst,
        SendMiddle,
        SendLast,
        SendLastWithImmediate,
        SendOnly,
        SendOnlyWithImmediate,
        RdmaWriteFirst,
        RdmaWriteMiddle,
        RdmaWriteLast,
        RdmaWriteLastWithImmediate,
        RdmaWriteOnly,
        RdmaWriteOnlyWithImmediate,
        RdmaReadRequest,
        RdmaReadResponseFirst,
        RdmaReadResponseMiddle,
        RdmaReadResponseLast,
        RdmaReadResponseOnly,
        Acknowledge,
        AtomicAcknowledge,
        CompareSwap,
        FetchAdd,
        SendLastWithInvalidate,
        SendOnlyWithInvalidate,
    ];

    /// The wire value of this opcode.
    pub const fn as_u8(self) -> u8 {
        self as u8
    }

    /// The IBTA name of this opcode, e.g. `"RC_RDMA_WRITE_ONLY"`.
    pub const fn name(self) -> &'static str {
        match self {
            SendFirst => "RC_SEND_FIRST",
            SendMiddle => "RC_SEND_MIDDLE",
            SendLast => "RC_SEND_LAST",
            SendLastWithImmediate => "RC_SEND_LAST_WITH_IMMEDIATE",
            SendOnly => "RC_SEND_ONLY",
            SendOnlyWithImmediate => "RC_SEND_ONLY_WITH_IMMEDIATE",
            RdmaWriteFirst => "RC_RDMA_WRITE_FIRST",
            RdmaWriteMiddle => "RC_RDMA_WRITE_MIDDLE",
            RdmaWriteLast => "RC_RDMA_WRITE_LAST",
            RdmaWriteLastWithImmediate => "RC_RDMA_WRITE_LAST_WITH_IMMEDIATE",
            RdmaWriteOnly => "RC_RDMA_WRITE_ONLY",
            RdmaWriteOnlyWithImmediate => "RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE",
            RdmaReadRequest => "RC_RDMA_READ_REQUEST",
            RdmaReadResponseFirst => "RC_RDMA_READ_RESPONSE_FIRST",
            RdmaReadResponseMiddle => "RC_RDMA_READ_RESPONSE_MIDDLE",
            RdmaReadResponseLast => "RC_RDMA_READ_RESPONSE_LAST",
            RdmaReadResponseOnly => "RC_RDMA_READ_RESPONSE_ONLY",
            Acknowledge => "RC_ACKNOWLEDGE",
            AtomicAcknowledge => "RC_ATOMIC_ACKNOWLEDGE",
            CompareSwap => "RC_CMP_SWAP",
            FetchAdd => "RC_FETCH_ADD",
            SendLastWithInvalidate => "RC_SEND_LAST_WITH_INVALIDATE",
            SendOnlyWithInvalidate => "RC_SEND_ONLY_WITH_INVALIDATE",
        }
    }

    // ---- which extension headers follow the BTH -------------------------

    /// An RDMA Extended Transport Header follows the BTH: RDMA WRITE FIRST,
    /// RDMA WRITE ONLY (with or without immediate) and RDMA READ request.
    pub const fn has_reth(self) -> bool {
        matches!(
            self,
            RdmaWriteFirst | RdmaWriteOnly | RdmaWriteOnlyWithImmediate | RdmaReadRequest
        )
    }

    /// An ACK Extended Transport Header follows the BTH: read response
    /// FIRST / LAST / ONLY, ACKNOWLEDGE and ATOMIC ACKNOWLEDGE (read response
    /// MIDDLE has none).
    pub const fn has_aeth(self) -> bool {
        matches!(
            self,
            RdmaReadResponseFirst
                | RdmaReadResponseLast
                | RdmaReadResponseOnly
                | Acknowledge
                | AtomicAcknowledge
        )
    }

    /// An Atomic Extended Transport Header follows the BTH (CMP_SWAP and
    /// FETCH_ADD).
    pub const fn has_atomic_eth(self) -> bool {
        matches!(self, CompareSwap | FetchAdd)
    }

    /// An Atomic ACK Extended Transport Header follows the AETH (ATOMIC
    /// ACKNOWLEDGE).
    pub const fn has_atomic_ack_eth(self) -> bool {
        matches!(self, AtomicAcknowledge)
    }

    /// Immediate data follows the other headers (every `*_WITH_IMMEDIATE`).
    pub const fn has_immdt(self) -> bool {
        matches!(
            self,
            SendLastWithImmediate
                | SendOnlyWithImmediate
                | RdmaWriteLastWithImmediate
                | RdmaWriteOnlyWithImmediate
        )
    }

    /// An Invalidate Extended Transport Header follows the BTH (every
    /// `*_WITH_INVALIDATE`).
    pub const fn has_ieth(self) -> bool {
        matches!(self, SendLastWithInvalidate | SendOnlyWithInvalidate)
    }

    /// The packet may carry payload (SENDs, RDMA WRITEs, RDMA READ
    /// responses). A zero-length payload is still allowed for these.
    pub const fn has_payload(self) -> bool {
        self.is_send() || self.is_write() || self.is_read_response()
    }

    /// Total length of the BTH plus the extension headers this opcode
    /// implies, i.e. the offset of the payload.
    pub const fn header_len(self) -> usize {
        let mut len = crate::BTH_LEN;
        if self.has_reth() {
            len += crate::RETH_LEN;
        }
        if self.has_atomic_eth() {
            len += crate::ATOMIC_ETH_LEN;
        }
        if self.has_aeth() {
            len += crate::AETH_LEN;
        }
        if self.has_atomic_ack_eth() {
            len += crate::ATOMIC_ACK_ETH_LEN;
        }
        if self.has_immdt() {
            len += crate::IMMDT_LEN;
        }
        if self.has_ieth() {
            len += crate::IETH_LEN;
        }
        len
    }

    // ---- position in the message ----------------------------------------

    /// First packet of a multi-packet message (`*_FIRST`).
    pub const fn is_first(self) -> bool {
        matches!(self, SendFirst | RdmaWriteFirst | RdmaReadResponseFirst)
    }

    /// Middle packet of a multi-packet message (`*_MIDDLE`).
    pub const fn is_middle(self) -> bool {
        matches!(self, SendMiddle | RdmaWriteMiddle | RdmaReadResponseMiddle)
    }

    /// Last packet of a multi-packet message (`*_LAST*`).
    pub const fn is_last(self) -> bool {
        matches!(
            self,
            SendLast
                | SendLastWithImmediate
                | SendLastWithInvalidate
                | RdmaWriteLast
                | RdmaWriteLastWithImmediate
                | RdmaReadResponseLast
        )
    }

    /// The packet is a whole message by itself: every `*_ONLY*` opcode plus
    /// the inherently single-packet ones (RDMA READ request, ACKNOWLEDGE,
    /// ATOMIC ACKNOWLEDGE, CMP_SWAP, FETCH_ADD). Exactly one of
    /// `is_first`, `is_middle`, `is_last`, `is_only` holds for every opcode.
    pub const fn is_only(self) -> bool {
        !(self.is_first() || self.is_middle() || self.is_last())
    }

    /// The packet starts a message (`is_first() || is_only()`).
    pub const fn starts_message(self) -> bool {
        self.is_first() || self.is_only()
    }

    /// The packet ends a message (`is_last() || is_only()`).
    pub const fn ends_message(self) -> bool {
        self.is_last() || self.is_only()
    }

    // ---- kind ----------------------------------------------------------

    /// A SEND packet (any position, with or without immediate / invalidate).
    pub const fn is_send(self) -> bool {
        matches!(
            self,
            SendFirst
                | SendMiddle
                | SendLast
                | SendLastWithImmediate
                | SendOnly
                | SendOnlyWithImmediate
                | SendLastWithInvalidate
                | SendOnlyWithInvalidate
        )
    }

    /// An RDMA WRITE packet (any position, with or without immediate).
    pub const fn is_write(self) -> bool {
        matches!(
            self,
            RdmaWriteFirst
                | RdmaWriteMiddle
                | RdmaWriteLast
                | RdmaWriteLastWithImmediate
                | RdmaWriteOnly
                | RdmaWriteOnlyWithImmediate
        )
    }

    /// The RDMA READ request.
    pub const fn is_read_request(self) -> bool {
        matches!(self, RdmaReadRequest)
    }

    /// An RDMA READ response packet (any position).
    pub const fn is_read_response(self) -> bool {
        matches!(
            self,
            RdmaReadResponseFirst
                | RdmaReadResponseMiddle
                | RdmaReadResponseLast
                | RdmaReadResponseOnly
        )
    }

    /// An atomic request (CMP_SWAP or FETCH_ADD). The response is
    /// [`is_atomic_ack`](Self::is_atomic_ack).
    pub const fn is_atomic(self) -> bool {
        matches!(self, CompareSwap | FetchAdd)
    }

    /// The ACKNOWLEDGE opcode (ACK, RNR NAK or NAK, per the AETH syndrome).
    pub const fn is_ack(self) -> bool {
        matches!(self, Acknowledge)
    }

    /// The ATOMIC ACKNOWLEDGE opcode.
    pub const fn is_atomic_ack(self) -> bool {
        matches!(self, AtomicAcknowledge)
    }

    /// Sent by the requester (SENDs, WRITEs, READ request, atomics).
    pub const fn is_request(self) -> bool {
        self.is_send() || self.is_write() || self.is_read_request() || self.is_atomic()
    }

    /// Sent by the responder (READ responses, ACKNOWLEDGE, ATOMIC
    /// ACKNOWLEDGE); always `!is_request()`.
    pub const fn is_response(self) -> bool {
        !self.is_request()
    }
}

impl TryFrom<u8> for Opcode {
    type Error = Error;

    /// Decodes an RC opcode; anything else yields [`Error::UnknownOpcode`].
    fn try_from(v: u8) -> Result<Self, Error> {
        Ok(match v {
            0x00 => SendFirst,
            0x01 => SendMiddle,
            0x02 => SendLast,
            0x03 => SendLastWithImmediate,
            0x04 => SendOnly,
            0x05 => SendOnlyWithImmediate,
            0x06 => RdmaWriteFirst,
            0x07 => RdmaWriteMiddle,
            0x08 => RdmaWriteLast,
            0x09 => RdmaWriteLastWithImmediate,
            0x0A => RdmaWriteOnly,
            0x0B => RdmaWriteOnlyWithImmediate,
            0x0C => RdmaReadRequest,
            0x0D => RdmaReadResponseFirst,
            0x0E => RdmaReadResponseMiddle,
            0x0F => RdmaReadResponseLast,
            0x10 => RdmaReadResponseOnly,
            0x11 => Acknowledge,
            0x12 => AtomicAcknowledge,
            0x13 => CompareSwap,
            0x14 => FetchAdd,
            0x16 => SendLastWithInvalidate,
            0x17 => SendOnlyWithInvalidate,
            other => return Err(Error::UnknownOpcode(other)),
        })
    }
}

impl From<Opcode> for u8 {
    fn from(op: Opcode) -> u8 {
        op.as_u8()
    }
}

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opcode_values_match_ibta_table() {
        let expected: [(Opcode, u8); 23] = [
            (SendFirst, 0x00),
            (SendMiddle, 0x01),
            (SendLast, 0x02),
            (SendLastWithImmediate, 0x03),
            (SendOnly, 0x04),
            (SendOnlyWithImmediate, 0x05),
            (RdmaWriteFirst, 0x06),
            (RdmaWriteMiddle, 0x07),
            (RdmaWriteLast, 0x08),
            (RdmaWriteLastWithImmediate, 0x09),
            (RdmaWriteOnly, 0x0A),
            (RdmaWriteOnlyWithImmediate, 0x0B),
            (RdmaReadRequest, 0x0C),
            (RdmaReadResponseFirst, 0x0D),
            (RdmaReadResponseMiddle, 0x0E),
            (RdmaReadResponseLast, 0x0F),
            (RdmaReadResponseOnly, 0x10),
            (Acknowledge, 0x11),
            (AtomicAcknowledge, 0x12),
            (CompareSwap, 0x13),
            (FetchAdd, 0x14),
            (SendLastWithInvalidate, 0x16),
            (SendOnlyWithInvalidate, 0x17),
        ];
        for (i, (op, v)) in expected.iter().enumerate() {
            assert_eq!(op.as_u8(), *v, "{op}");
            assert_eq!(u8::from(*op), *v);
            assert_eq!(Opcode::try_from(*v), Ok(*op));
            assert_eq!(Opcode::ALL[i], *op);
        }
    }

    #[test]
    fn opcode_try_from_rejects_non_rc() {
        let known = Opcode::ALL.map(Opcode::as_u8);
        for v in 0..=255u8 {
            let r = Opcode::try_from(v);
            if known.contains(&v) {
                assert!(r.is_ok(), "{v:#x}");
            } else {
                assert_eq!(r, Err(Error::UnknownOpcode(v)));
            }
        }
        // Spot checks: RD RESYNC slot, UC SEND_FIRST, UD SEND_ONLY, CNP.
        for v in [0x15, 0x18, 0x1F, 0x20, 0x64, 0x81] {
            assert_eq!(Opcode::try_from(v), Err(Error::UnknownOpcode(v)));
        }
    }

    #[test]
    fn opcode_header_flags_match_rxe_table() {
        // (opcode, reth, aeth, atomic_eth, atomic_ack_eth, immdt, ieth, payload, header_len)
        type Row = (Opcode, bool, bool, bool, bool, bool, bool, bool, usize);
        #[rustfmt::skip]
        let table: [Row; 23] = [
            (SendFirst,                  false, false, false, false, false, false, true,  12),
            (SendMiddle,                 false, false, false, false, false, false, true,  12),
            (SendLast,                   false, false, false, false, false, false, true,  12),
            (SendLastWithImmediate,      false, false, false, false, true,  false, true,  16),
            (SendOnly,                   false, false, false, false, false, false, true,  12),
            (SendOnlyWithImmediate,      false, false, false, false, true,  false, true,  16),
            (RdmaWriteFirst,             true,  false, false, false, false, false, true,  28),
            (RdmaWriteMiddle,            false, false, false, false, false, false, true,  12),
            (RdmaWriteLast,              false, false, false, false, false, false, true,  12),
            (RdmaWriteLastWithImmediate, false, false, false, false, true,  false, true,  16),
            (RdmaWriteOnly,              true,  false, false, false, false, false, true,  28),
            (RdmaWriteOnlyWithImmediate, true,  false, false, false, true,  false, true,  32),
            (RdmaReadRequest,            true,  false, false, false, false, false, false, 28),
            (RdmaReadResponseFirst,      false, true,  false, false, false, false, true,  16),
            (RdmaReadResponseMiddle,     false, false, false, false, false, false, true,  12),
            (RdmaReadResponseLast,       false, true,  false, false, false, false, true,  16),
            (RdmaReadResponseOnly,       false, true,  false, false, false, false, true,  16),
            (Acknowledge,                false, true,  false, false, false, false, false, 16),
            (AtomicAcknowledge,          false, true,  false, true,  false, false, false, 24),
            (CompareSwap,                false, false, true,  false, false, false, false, 40),
            (FetchAdd,                   false, false, true,  false, false, false, false, 40),
            (SendLastWithInvalidate,     false, false, false, false, false, true,  true,  16),
            (SendOnlyWithInvalidate,     false, false, false, false, false, true,  true,  16),
        ];
        for (op, reth, aeth, atom, atomack, imm, ieth, payload, hlen) in table {
            assert_eq!(op.has_reth(), reth, "{op} reth");
            assert_eq!(op.has_aeth(), aeth, "{op} aeth");
            assert_eq!(op.has_atomic_eth(), atom, "{op} atomic eth");
            assert_eq!(op.has_atomic_ack_eth(), atomack, "{op} atomic ack eth");
            assert_eq!(op.has_immdt(), imm, "{op} immdt");
            assert_eq!(op.has_ieth(), ieth, "{op} ieth");
            assert_eq!(op.has_payload(), payload, "{op} payload");
            assert_eq!(op.header_len(), hlen, "{op} header_len");
        }
    }

    #[test]
    fn opcode_position_and_kind_partition() {
        for op in Opcode::ALL {
            let positions = [op.is_first(), op.is_middle(), op.is_last(), op.is_only()];
            assert_eq!(positions.iter().filter(|b| **b).count(), 1, "{op}");
            let kinds = [
                op.is_send(),
                op.is_write(),
                op.is_read_request(),
                op.is_read_response(),
                op.is_atomic(),
                op.is_ack(),
                op.is_atomic_ack(),
            ];
            assert_eq!(kinds.iter().filter(|b| **b).count(), 1, "{op}");
            assert_ne!(op.is_request(), op.is_response());
            assert_eq!(op.starts_message(), op.is_first() || op.is_only());
            assert_eq!(op.ends_message(), op.is_last() || op.is_only());
            let name = op.name();
            assert_eq!(name.contains("FIRST"), op.is_first(), "{name} vs is_first");
            assert_eq!(name.contains("MIDDLE"), op.is_middle(), "{name}");
            assert_eq!(name.contains("LAST"), op.is_last(), "{name}");
            assert_eq!(op.has_immdt(), name.contains("IMMEDIATE"), "{name}");
            assert_eq!(op.has_ieth(), name.contains("INVALIDATE"), "{name}");
        }
        assert!(Opcode::RdmaReadRequest.is_only());
        assert!(Opcode::Acknowledge.is_only());
        assert!(Opcode::CompareSwap.is_request());
        assert!(Opcode::AtomicAcknowledge.is_response());
        assert!(Opcode::RdmaReadResponseMiddle.is_response());
        assert!(Opcode::SendOnlyWithInvalidate.is_send());
        assert_eq!(Opcode::FetchAdd.to_string(), "RC_FETCH_ADD");
    }
}
