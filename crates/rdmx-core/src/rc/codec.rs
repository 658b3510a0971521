//! The engine's view of a packet, and the one place that speaks `rdmx-wire`.
//!
//! The engine reasons about [`Hdr`]s: the transport headers as plain values, independent
//! of wire layout. [`encode`] and [`decode`] translate to and from the IBTA byte format.

use rdmx_wire as wire;

/// The RC opcodes the engine uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    SendFirst,
    SendMiddle,
    SendLast,
    SendLastImm,
    SendOnly,
    SendOnlyImm,
    WriteFirst,
    WriteMiddle,
    WriteLast,
    WriteLastImm,
    WriteOnly,
    WriteOnlyImm,
    ReadRequest,
    ReadRespFirst,
    ReadRespMiddle,
    ReadRespLast,
    ReadRespOnly,
    Ack,
    AtomicAck,
    CompareSwap,
    FetchAdd,
}

impl Op {
    pub(crate) fn is_send(self) -> bool {
        use Op::*;
        matches!(
            self,
            SendFirst | SendMiddle | SendLast | SendLastImm | SendOnly | SendOnlyImm
        )
    }
    pub(crate) fn is_write(self) -> bool {
        use Op::*;
        matches!(
            self,
            WriteFirst | WriteMiddle | WriteLast | WriteLastImm | WriteOnly | WriteOnlyImm
        )
    }
    pub(crate) fn is_atomic(self) -> bool {
        matches!(self, Op::CompareSwap | Op::FetchAdd)
    }
    pub(crate) fn is_read_response(self) -> bool {
        use Op::*;
        matches!(
            self,
            ReadRespFirst | ReadRespMiddle | ReadRespLast | ReadRespOnly
        )
    }
    pub(crate) fn is_response(self) -> bool {
        self.is_read_response() || matches!(self, Op::Ack | Op::AtomicAck)
    }
    /// First packet of a message (FIRST or ONLY).
    pub(crate) fn starts(self) -> bool {
        use Op::*;
        matches!(
            self,
            SendFirst
                | SendOnly
                | SendOnlyImm
                | WriteFirst
                | WriteOnly
                | WriteOnlyImm
                | ReadRespFirst
                | ReadRespOnly
        )
    }
    /// Last packet of a message (LAST or ONLY).
    pub(crate) fn ends(self) -> bool {
        use Op::*;
        matches!(
            self,
            SendLast
                | SendLastImm
                | SendOnly
                | SendOnlyImm
                | WriteLast
                | WriteLastImm
                | WriteOnly
                | WriteOnlyImm
                | ReadRespLast
                | ReadRespOnly
        )
    }
    pub(crate) fn has_imm(self) -> bool {
        use Op::*;
        matches!(
            self,
            SendLastImm | SendOnlyImm | WriteLastImm | WriteOnlyImm
        )
    }

    /// The SEND opcode for a packet at this position.
    pub(crate) fn send(first: bool, last: bool, imm: bool) -> Op {
        match (first, last, imm) {
            (true, true, false) => Op::SendOnly,
            (true, true, true) => Op::SendOnlyImm,
            (true, false, _) => Op::SendFirst,
            (false, false, _) => Op::SendMiddle,
            (false, true, false) => Op::SendLast,
            (false, true, true) => Op::SendLastImm,
        }
    }

    /// The WRITE opcode for a packet at this position.
    pub(crate) fn write(first: bool, last: bool, imm: bool) -> Op {
        match (first, last, imm) {
            (true, true, false) => Op::WriteOnly,
            (true, true, true) => Op::WriteOnlyImm,
            (true, false, _) => Op::WriteFirst,
            (false, false, _) => Op::WriteMiddle,
            (false, true, false) => Op::WriteLast,
            (false, true, true) => Op::WriteLastImm,
        }
    }

    /// The READ response opcode for a packet at this position.
    pub(crate) fn read_response(first: bool, last: bool) -> Op {
        match (first, last) {
            (true, true) => Op::ReadRespOnly,
            (true, false) => Op::ReadRespFirst,
            (false, false) => Op::ReadRespMiddle,
            (false, true) => Op::ReadRespLast,
        }
    }
}

/// NAK codes the engine sends and understands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Nak {
    PsnSequence,
    InvalidRequest,
    RemoteAccess,
    RemoteOperational,
}

/// The AETH syndrome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Syndrome {
    /// ACK with the responder's receive credits (`None`: no credit limit advertised).
    Ack { credits: Option<u32> },
    /// RNR NAK with the responder's RNR timer code.
    Rnr { timer: u8 },
    /// NAK.
    Nak(Nak),
}

/// Transport headers as plain values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Hdr {
    pub(crate) op: Op,
    pub(crate) dest_qpn: u32,
    pub(crate) psn: u32,
    pub(crate) ack_req: bool,
    pub(crate) solicited: bool,
    /// RETH: (virtual address, rkey, DMA length).
    pub(crate) reth: Option<(u64, u32, u32)>,
    /// AETH: (syndrome, MSN).
    pub(crate) aeth: Option<(Syndrome, u32)>,
    /// AtomicETH: (virtual address, rkey, swap or add, compare).
    pub(crate) atomic: Option<(u64, u32, u64, u64)>,
    /// AtomicAckETH: the original remote value.
    pub(crate) atomic_ack: Option<u64>,
    /// Immediate data.
    pub(crate) imm: Option<u32>,
}

impl Hdr {
    pub(crate) fn new(op: Op, dest_qpn: u32, psn: u32) -> Hdr {
        Hdr {
            op,
            dest_qpn,
            psn,
            ack_req: false,
            solicited: false,
            reth: None,
            aeth: None,
            atomic: None,
            atomic_ack: None,
            imm: None,
        }
    }
}

fn to_wire(op: Op) -> wire::Opcode {
    use wire::Opcode as W;
    match op {
        Op::SendFirst => W::SendFirst,
        Op::SendMiddle => W::SendMiddle,
        Op::SendLast => W::SendLast,
        Op::SendLastImm => W::SendLastWithImmediate,
        Op::SendOnly => W::SendOnly,
        Op::SendOnlyImm => W::SendOnlyWithImmediate,
        Op::WriteFirst => W::RdmaWriteFirst,
        Op::WriteMiddle => W::RdmaWriteMiddle,
        Op::WriteLast => W::RdmaWriteLast,
        Op::WriteLastImm => W::RdmaWriteLastWithImmediate,
        Op::WriteOnly => W::RdmaWriteOnly,
        Op::WriteOnlyImm => W::RdmaWriteOnlyWithImmediate,
        Op::ReadRequest => W::RdmaReadRequest,
        Op::ReadRespFirst => W::RdmaReadResponseFirst,
        Op::ReadRespMiddle => W::RdmaReadResponseMiddle,
        Op::ReadRespLast => W::RdmaReadResponseLast,
        Op::ReadRespOnly => W::RdmaReadResponseOnly,
        Op::Ack => W::Acknowledge,
        Op::AtomicAck => W::AtomicAcknowledge,
        Op::CompareSwap => W::CompareSwap,
        Op::FetchAdd => W::FetchAdd,
    }
}

fn from_wire(op: wire::Opcode) -> Option<Op> {
    use wire::Opcode as W;
    Some(match op {
        W::SendFirst => Op::SendFirst,
        W::SendMiddle => Op::SendMiddle,
        W::SendLast => Op::SendLast,
        W::SendLastWithImmediate => Op::SendLastImm,
        W::SendOnly => Op::SendOnly,
        W::SendOnlyWithImmediate => Op::SendOnlyImm,
        W::RdmaWriteFirst => Op::WriteFirst,
        W::RdmaWriteMiddle => Op::WriteMiddle,
        W::RdmaWriteLast => Op::WriteLast,
        W::RdmaWriteLastWithImmediate => Op::WriteLastImm,
        W::RdmaWriteOnly => Op::WriteOnly,
        W::RdmaWriteOnlyWithImmediate => Op::WriteOnlyImm,
        W::RdmaReadRequest => Op::ReadRequest,
        W::RdmaReadResponseFirst => Op::ReadRespFirst,
        W::RdmaReadResponseMiddle => Op::ReadRespMiddle,
        W::RdmaReadResponseLast => Op::ReadRespLast,
        W::RdmaReadResponseOnly => Op::ReadRespOnly,
        W::Acknowledge => Op::Ack,
        W::AtomicAcknowledge => Op::AtomicAck,
        W::CompareSwap => Op::CompareSwap,
        W::FetchAdd => Op::FetchAdd,
        // SEND with invalidate needs memory windows, which rdmx does not offer yet.
        _ => return None,
    })
}

/// Appends the packet for `hdr` and `payload` to `out`.
pub(crate) fn encode(hdr: &Hdr, payload: &[u8], out: &mut Vec<u8>) {
    let start = out.len();
    let pad = encode_header(hdr, payload.len(), out);
    out.extend_from_slice(payload);
    out.resize(out.len() + usize::from(pad), 0);
    debug_assert!(decode(&out[start..]).is_some());
}

/// Appends the headers for `hdr` with `payload_len` bytes of payload to follow, and
/// returns the pad the payload needs after it.
pub(crate) fn encode_header(hdr: &Hdr, payload_len: usize, out: &mut Vec<u8>) -> u8 {
    let bth = wire::BthRepr {
        opcode: to_wire(hdr.op),
        solicited: hdr.solicited,
        migreq: false,
        pad_count: 0,
        pkey: 0xffff,
        fecn: false,
        becn: false,
        dest_qpn: hdr.dest_qpn & wire::QPN_MASK,
        ack_req: hdr.ack_req,
        psn: hdr.psn & wire::PSN_MASK,
    };
    let mut repr = wire::RcRepr::new(bth);
    repr.reth = hdr
        .reth
        .map(|(va, rkey, dma_len)| wire::RethRepr { va, rkey, dma_len });
    repr.aeth = hdr.aeth.map(|(syndrome, msn)| wire::AethRepr {
        syndrome: match syndrome {
            Syndrome::Ack { credits } => wire::Syndrome::Ack {
                credits: credits.map_or(wire::Credits::UNLIMITED, wire::Credits::from_count),
            },
            Syndrome::Rnr { timer } => wire::Syndrome::RnrNak {
                timer: wire::RnrTimer::from_code(timer & 0x1f).expect("masked to 5 bits"),
            },
            Syndrome::Nak(n) => wire::Syndrome::Nak(match n {
                Nak::PsnSequence => wire::NakCode::PsnSequenceError,
                Nak::InvalidRequest => wire::NakCode::InvalidRequest,
                Nak::RemoteAccess => wire::NakCode::RemoteAccessError,
                Nak::RemoteOperational => wire::NakCode::RemoteOperationalError,
            }),
        },
        msn: msn & wire::MSN_MASK,
    });
    repr.atomic_eth = hdr
        .atomic
        .map(|(va, rkey, swap_add, compare)| wire::AtomicEthRepr {
            va,
            rkey,
            swap_add,
            compare,
        });
    repr.atomic_ack_eth = hdr
        .atomic_ack
        .map(|orig_data| wire::AtomicAckEthRepr { orig_data });
    repr.immdt = hdr.imm.map(|imm| wire::ImmDtRepr { imm });
    let start = out.len();
    out.resize(start + repr.header_len(), 0);
    // The engine builds only consistent headers; a failure here is a bug in this file.
    repr.emit(&mut out[start..], payload_len)
        .expect("engine headers are consistent with their opcode");
    wire::pad_for(payload_len)
}

/// Parses a packet; `None` when it is malformed or uses an opcode the engine does not
/// implement (the caller drops it, as an adapter drops a packet with a bad header).
pub(crate) fn decode(bytes: &[u8]) -> Option<(Hdr, &[u8])> {
    let repr = wire::RcRepr::parse_bytes(bytes).ok()?;
    Some((from_repr(&repr)?, repr.payload))
}

/// Parses the headers of a packet whose payload and pad (`rest_len` bytes) are
/// elsewhere; returns them and the payload length.
pub(crate) fn decode_split(header: &[u8], rest_len: usize) -> Option<(Hdr, usize)> {
    let (repr, payload_len) = wire::RcRepr::parse_split(header, rest_len).ok()?;
    Some((from_repr(&repr)?, payload_len))
}

fn from_repr(repr: &wire::RcRepr<'_>) -> Option<Hdr> {
    let op = from_wire(repr.bth.opcode)?;
    let hdr = Hdr {
        op,
        dest_qpn: repr.bth.dest_qpn,
        psn: repr.bth.psn,
        ack_req: repr.bth.ack_req,
        solicited: repr.bth.solicited,
        reth: repr.reth.map(|r| (r.va, r.rkey, r.dma_len)),
        aeth: repr.aeth.map(|a| {
            let syndrome = match a.syndrome {
                wire::Syndrome::Ack { credits } => Syndrome::Ack {
                    credits: credits.count(),
                },
                wire::Syndrome::RnrNak { timer } => Syndrome::Rnr {
                    timer: timer.code(),
                },
                wire::Syndrome::Nak(code) => Syndrome::Nak(match code {
                    wire::NakCode::PsnSequenceError => Nak::PsnSequence,
                    wire::NakCode::InvalidRequest | wire::NakCode::InvalidRdRequest => {
                        Nak::InvalidRequest
                    }
                    wire::NakCode::RemoteAccessError => Nak::RemoteAccess,
                    wire::NakCode::RemoteOperationalError => Nak::RemoteOperational,
                }),
            };
            (syndrome, a.msn)
        }),
        atomic: repr
            .atomic_eth
            .map(|a| (a.va, a.rkey, a.swap_add, a.compare)),
        atomic_ack: repr.atomic_ack_eth.map(|a| a.orig_data),
        imm: repr.immdt.map(|i| i.imm),
    };
    Some(hdr)
}
