//! InfiniBand Reliable Connected (RC) transport headers as bounds-checked
//! parse/emit pairs, byte-identical to the InfiniBand Architecture
//! Specification (IBTA vol. 1, chapter 9).
//!
//! # Where these headers sit
//!
//! ```text
//! RoCEv2:   Eth | IPv4/6 | UDP (dport 4791) | BTH | ext hdrs | payload | pad | ICRC
//! rdmx/TCP:                 stream framing  | BTH | ext hdrs | payload | pad
//!                                            \______ this crate ______________/
//! ```
//!
//! This crate covers the transport packet from the BTH to the pad. The
//! invariant CRC (ICRC) is a separate concern: on RoCEv2 it is computed over
//! masked IP/UDP fields as well, so it belongs with the network layer, and a
//! stream transport does not need it. Buffers handed to the parsers must not
//! include it.
//!
//! # Base Transport Header (12 bytes, every packet)
//!
//! ```text
//!  0                   1                   2                   3
//!  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |    OpCode     |S|M|Pad| TVer  |             P_Key             |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |F|B|   Resv6   |                    DestQP                     |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |A|    Resv7    |                      PSN                      |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//!  S = Solicited Event, M = MigReq, Pad = pad count, TVer = 0,
//!  F/B = FECN/BECN, A = AckReq; all multi-byte fields big-endian.
//! ```
//!
//! The opcode ([`Opcode`]) names the operation and its position in the
//! message (FIRST / MIDDLE / LAST / ONLY) and determines which extension
//! headers follow, always in this order:
//!
//! | header | bytes | purpose | carried by |
//! |---|---|---|---|
//! | [`Reth`] | 16 | remote VA, R_Key, total DMA length | RDMA WRITE FIRST/ONLY(+imm), RDMA READ request |
//! | [`AtomicEth`] | 28 | remote VA, R_Key, swap/add and compare operands | CMP_SWAP, FETCH_ADD |
//! | [`Aeth`] | 4 | syndrome (ACK + credits / RNR NAK + timer / NAK + code) and MSN | ACKNOWLEDGE, ATOMIC ACKNOWLEDGE, READ RESPONSE FIRST/LAST/ONLY |
//! | [`AtomicAckEth`] | 8 | original remote value | ATOMIC ACKNOWLEDGE |
//! | [`ImmDt`] | 4 | immediate data for the receive completion | `*_WITH_IMMEDIATE` |
//! | [`Ieth`] | 4 | R_Key to invalidate | `*_WITH_INVALIDATE` |
//! | DETH ([`DethRepr`]) | 8 | Q_Key and source QP | UD SENDs ([`UdRepr`]) |
//!
//! then the payload (SEND, RDMA WRITE and READ RESPONSE only) and 0–3 pad
//! bytes making payload plus pad a multiple of 4.
//!
//! # API shape
//!
//! Modelled on smoltcp's `wire` module. Each header has
//!
//! * a view `Header<T: AsRef<[u8]>>` with `new_checked` (length check),
//!   getters, and setters when `T: AsMut<[u8]>`;
//! * a plain-data `HeaderRepr` with `parse(&Header<&T>) -> Result<Repr>`,
//!   `emit(&self, &mut Header<&mut T>)` and `buffer_len()`.
//!
//! [`RcPacket`] / [`RcRepr`] do the same for a whole packet, validating the
//! opcode, header presence, lengths and pad; [`RcRepr::emit`] writes only the
//! headers so payloads can stay zero-copy, [`RcRepr::emit_with_payload`]
//! writes everything.
//!
//! Parsing never panics on any input. Views built with `new_unchecked`
//! panic on access if the buffer is too short, exactly like smoltcp's;
//! [`RcPacket`] has no unchecked constructor.
//!
//! ```
//! use rdmx_wire::{BthRepr, ImmDtRepr, Opcode, RcRepr, RethRepr};
//!
//! let mut repr = RcRepr::new(BthRepr {
//!     opcode: Opcode::RdmaWriteOnlyWithImmediate,
//!     solicited: true,
//!     migreq: false,
//!     pad_count: 1,
//!     pkey: 0xFFFF,
//!     fecn: false,
//!     becn: false,
//!     dest_qpn: 0x11,
//!     ack_req: true,
//!     psn: 42,
//! });
//! repr.reth = Some(RethRepr { va: 0x1000, rkey: 7, dma_len: 3 });
//! repr.immdt = Some(ImmDtRepr { imm: 0xC0FFEE });
//! repr.payload = b"abc";
//!
//! let mut buf = [0u8; 64];
//! let n = repr.emit_with_payload(&mut buf).unwrap();
//! assert_eq!(n, 12 + 16 + 4 + 3 + 1);
//! assert_eq!(RcRepr::parse_bytes(&buf[..n]).unwrap(), repr);
//! ```
#![forbid(unsafe_code)]

mod aeth;
mod atomic;
mod bth;
mod error;
mod field;
mod imm;
mod opcode;
mod packet;
mod reth;
mod ud;

pub use aeth::{Aeth, AethRepr, Credits, NakCode, RnrTimer, Syndrome, AETH_LEN, MSN_MASK};
pub use atomic::{
    AtomicAckEth, AtomicAckEthRepr, AtomicEth, AtomicEthRepr, ATOMIC_ACK_ETH_LEN, ATOMIC_ETH_LEN,
};
pub use bth::{
    psn_add, psn_diff, psn_le, psn_lt, psn_sub, Bth, BthRepr, BTH_LEN, PSN_MASK, QPN_MASK,
};
pub use error::{Error, Result};
pub use imm::{Ieth, IethRepr, ImmDt, ImmDtRepr, IETH_LEN, IMMDT_LEN};
pub use opcode::Opcode;
pub use packet::{pad_for, HeaderKind, RcPacket, RcRepr};
pub use reth::{Reth, RethRepr, RETH_LEN};
pub use ud::{
    header_len_of, uc_to_rc, DethRepr, GrhRepr, UdRepr, DETH_LEN, GRH_LEN, GRH_NEXT_HEADER_BTH,
    SERVICE_MASK, UC_PREFIX, UD_SEND_ONLY, UD_SEND_ONLY_WITH_IMMEDIATE,
};
