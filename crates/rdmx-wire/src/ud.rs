//! Unreliable Datagram packets: the Datagram Extended Transport Header (DETH), the UD
//! SEND opcodes, and the Global Routing Header (GRH) that verbs puts at the start of
//! every UD receive buffer.
//!
//! A UD packet is `BTH | DETH | [ImmDt] | payload | pad` (IBTA vol. 1, §9.2 and §9.3.3).
//! UD has two opcodes, both single-packet sends: `UD_SEND_ONLY` (0x64) and
//! `UD_SEND_ONLY_WITH_IMMEDIATE` (0x65).
//!
//! ```text
//! DETH (8 bytes)
//!  0                   1                   2                   3
//!  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |                             Q_Key                             |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |    Reserved   |                    SrcQP                      |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ```
//!
//! Parsing never panics: every length is checked first.

use crate::error::{Error, Result};
use crate::{pad_for, Bth, BTH_LEN, IMMDT_LEN, PSN_MASK, QPN_MASK};

/// Bytes of a DETH.
pub const DETH_LEN: usize = 8;
/// Bytes of a GRH.
pub const GRH_LEN: usize = 40;
/// `UD_SEND_ONLY`.
pub const UD_SEND_ONLY: u8 = 0x64;
/// `UD_SEND_ONLY_WITH_IMMEDIATE`.
pub const UD_SEND_ONLY_WITH_IMMEDIATE: u8 = 0x65;
/// The transport-service prefix of UC opcodes (the top three bits `001`): a UC opcode is
/// this ORed with the RC opcode of the same operation.
pub const UC_PREFIX: u8 = 0x20;
/// The mask of the transport-service prefix in a BTH opcode.
pub const SERVICE_MASK: u8 = 0xe0;
/// The IPv6 next-header value of a GRH that an InfiniBand BTH follows.
pub const GRH_NEXT_HEADER_BTH: u8 = 0x1b;

/// The bytes of the headers (BTH and extension headers) a packet with BTH opcode byte
/// `op` carries, for RC and UC opcodes this crate knows and the UD SENDs; `None` for any
/// other byte. A stream transport reads this many bytes before it hands the headers on.
pub fn header_len_of(op: u8) -> Option<usize> {
    match op {
        UD_SEND_ONLY => Some(BTH_LEN + DETH_LEN),
        UD_SEND_ONLY_WITH_IMMEDIATE => Some(BTH_LEN + DETH_LEN + IMMDT_LEN),
        _ => crate::Opcode::try_from(uc_to_rc(op)?)
            .ok()
            .map(|o| o.header_len()),
    }
}

/// The RC opcode byte of the same operation as the RC or UC opcode byte `op`; `None` for
/// other transport services and for what UC does not have (READ, atomics, ACKs).
pub fn uc_to_rc(op: u8) -> Option<u8> {
    match op & SERVICE_MASK {
        0 => Some(op),
        UC_PREFIX if op & !SERVICE_MASK <= 0x0b => Some(op & !SERVICE_MASK),
        _ => None,
    }
}

/// A DETH as plain values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DethRepr {
    /// The Q_Key the receiver checks.
    pub qkey: u32,
    /// The sending QP (24 bits).
    pub src_qpn: u32,
}

impl DethRepr {
    /// Parses a DETH from the first [`DETH_LEN`] bytes of `b`.
    pub fn parse(b: &[u8]) -> Result<DethRepr> {
        let b = b.get(..DETH_LEN).ok_or(Error::Truncated {
            need: DETH_LEN,
            have: b.len(),
        })?;
        Ok(DethRepr {
            qkey: u32::from_be_bytes([b[0], b[1], b[2], b[3]]),
            src_qpn: u32::from_be_bytes([0, b[5], b[6], b[7]]),
        })
    }

    /// Writes the DETH into the first [`DETH_LEN`] bytes of `out`.
    pub fn emit(&self, out: &mut [u8]) -> Result<()> {
        let have = out.len();
        let out = out.get_mut(..DETH_LEN).ok_or(Error::Truncated {
            need: DETH_LEN,
            have,
        })?;
        out[..4].copy_from_slice(&self.qkey.to_be_bytes());
        out[4..].copy_from_slice(&(self.src_qpn & QPN_MASK).to_be_bytes());
        out[4] = 0;
        Ok(())
    }
}

/// A whole UD packet as plain values, its payload borrowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdRepr<'a> {
    /// Destination QP (`0xFFFFFF` for a multicast group).
    pub dest_qpn: u32,
    /// PSN (carried, not checked: UD has no sequence).
    pub psn: u32,
    /// Solicited event.
    pub solicited: bool,
    /// Partition key.
    pub pkey: u16,
    /// The DETH.
    pub deth: DethRepr,
    /// Immediate data (`UD_SEND_ONLY_WITH_IMMEDIATE`).
    pub imm: Option<u32>,
    /// The payload.
    pub payload: &'a [u8],
}

impl<'a> UdRepr<'a> {
    /// Bytes of the headers: BTH, DETH and ImmDt if any.
    pub fn header_len(&self) -> usize {
        BTH_LEN + DETH_LEN + if self.imm.is_some() { IMMDT_LEN } else { 0 }
    }

    /// Parses a whole UD packet (without ICRC). Anything but a UD SEND, a nonzero
    /// transport version, a short buffer or a pad that does not fit is an error.
    pub fn parse_bytes(buf: &'a [u8]) -> Result<UdRepr<'a>> {
        let bth = Bth::new_checked(buf)?;
        let imm = match bth.opcode_raw() {
            UD_SEND_ONLY => false,
            UD_SEND_ONLY_WITH_IMMEDIATE => true,
            other => return Err(Error::UnknownOpcode(other)),
        };
        if bth.tver() != 0 {
            return Err(Error::BadVersion(bth.tver()));
        }
        let deth = DethRepr::parse(&buf[BTH_LEN..]).map_err(|_| Error::Truncated {
            need: BTH_LEN + DETH_LEN,
            have: buf.len(),
        })?;
        let mut at = BTH_LEN + DETH_LEN;
        let imm = if imm {
            let b = buf.get(at..at + IMMDT_LEN).ok_or(Error::Truncated {
                need: at + IMMDT_LEN,
                have: buf.len(),
            })?;
            at += IMMDT_LEN;
            Some(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
        } else {
            None
        };
        let pad = usize::from(bth.pad_count());
        let rest = buf.len() - at;
        if rest < pad || rest % 4 != 0 {
            return Err(Error::BadPad {
                pad_count: bth.pad_count(),
                len: rest,
            });
        }
        Ok(UdRepr {
            dest_qpn: bth.dest_qpn(),
            psn: bth.psn(),
            solicited: bth.solicited(),
            pkey: bth.pkey(),
            deth,
            imm,
            payload: &buf[at..buf.len() - pad],
        })
    }

    /// Appends the headers for a payload of `payload_len` bytes to `out`, and returns the
    /// pad the payload needs after it. `self.payload` is not read.
    pub fn emit_header(&self, payload_len: usize, out: &mut Vec<u8>) -> u8 {
        let start = out.len();
        out.resize(start + self.header_len(), 0);
        let pad = pad_for(payload_len);
        let buf = &mut out[start..];
        let mut bth = Bth::new_unchecked(&mut buf[..BTH_LEN]);
        bth.set_opcode_raw(if self.imm.is_some() {
            UD_SEND_ONLY_WITH_IMMEDIATE
        } else {
            UD_SEND_ONLY
        });
        bth.set_solicited(self.solicited);
        bth.set_pad_count(pad);
        bth.set_tver(0);
        bth.set_pkey(self.pkey);
        bth.set_dest_qpn(self.dest_qpn & QPN_MASK);
        bth.set_psn(self.psn & PSN_MASK);
        self.deth
            .emit(&mut buf[BTH_LEN..])
            .expect("room was made for the DETH");
        if let Some(imm) = self.imm {
            buf[BTH_LEN + DETH_LEN..BTH_LEN + DETH_LEN + IMMDT_LEN]
                .copy_from_slice(&imm.to_be_bytes());
        }
        pad
    }
}

/// A GRH as plain values (IPv6 format, as RoCE and InfiniBand both lay it out in a
/// receive buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GrhRepr {
    /// Traffic class.
    pub traffic_class: u8,
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Bytes after the GRH (the transport packet and its CRCs).
    pub payload_len: u16,
    /// Next header (0x1B: an InfiniBand BTH).
    pub next_header: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Source GID.
    pub sgid: [u8; 16],
    /// Destination GID.
    pub dgid: [u8; 16],
}

impl GrhRepr {
    /// Parses a GRH from the first [`GRH_LEN`] bytes of `b` (IP version 6 only).
    pub fn parse(b: &[u8]) -> Result<GrhRepr> {
        let b = b.get(..GRH_LEN).ok_or(Error::Truncated {
            need: GRH_LEN,
            have: b.len(),
        })?;
        if b[0] >> 4 != 6 {
            return Err(Error::BadVersion(b[0] >> 4));
        }
        let mut sgid = [0u8; 16];
        let mut dgid = [0u8; 16];
        sgid.copy_from_slice(&b[8..24]);
        dgid.copy_from_slice(&b[24..40]);
        Ok(GrhRepr {
            traffic_class: (b[0] << 4) | (b[1] >> 4),
            flow_label: u32::from_be_bytes([0, b[1] & 0x0f, b[2], b[3]]),
            payload_len: u16::from_be_bytes([b[4], b[5]]),
            next_header: b[6],
            hop_limit: b[7],
            sgid,
            dgid,
        })
    }

    /// The GRH as its [`GRH_LEN`] bytes.
    pub fn to_bytes(&self) -> [u8; GRH_LEN] {
        let mut b = [0u8; GRH_LEN];
        let flow = self.flow_label & 0x000f_ffff;
        b[0] = 0x60 | (self.traffic_class >> 4);
        b[1] = (self.traffic_class << 4) | (flow >> 16) as u8;
        b[2] = (flow >> 8) as u8;
        b[3] = flow as u8;
        b[4..6].copy_from_slice(&self.payload_len.to_be_bytes());
        b[6] = self.next_header;
        b[7] = self.hop_limit;
        b[8..24].copy_from_slice(&self.sgid);
        b[24..40].copy_from_slice(&self.dgid);
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ud_packets_round_trip() {
        for imm in [None, Some(0xdead_beef)] {
            let repr = UdRepr {
                dest_qpn: 0x12_3456,
                psn: 77,
                solicited: true,
                pkey: 0xffff,
                deth: DethRepr {
                    qkey: 0x1111_1111,
                    src_qpn: 0xab_cdef,
                },
                imm,
                payload: b"hello",
            };
            let mut out = Vec::new();
            let pad = repr.emit_header(5, &mut out);
            out.extend_from_slice(b"hello");
            out.resize(out.len() + usize::from(pad), 0);
            assert_eq!(out.len() % 4, 0);
            assert_eq!(UdRepr::parse_bytes(&out).unwrap(), repr);
        }
    }

    #[test]
    fn ud_parse_refuses_what_is_not_a_ud_send() {
        assert!(UdRepr::parse_bytes(&[]).is_err());
        let mut out = Vec::new();
        let repr = UdRepr {
            dest_qpn: 1,
            psn: 0,
            solicited: false,
            pkey: 0xffff,
            deth: DethRepr {
                qkey: 1,
                src_qpn: 2,
            },
            imm: Some(3),
            payload: &[],
        };
        repr.emit_header(0, &mut out);
        for cut in 0..out.len() {
            assert!(UdRepr::parse_bytes(&out[..cut]).is_err(), "cut at {cut}");
        }
        let mut rc = out.clone();
        rc[0] = 0x04;
        assert!(UdRepr::parse_bytes(&rc).is_err());
    }

    #[test]
    fn grh_round_trips() {
        let g = GrhRepr {
            traffic_class: 0xab,
            flow_label: 0x1_2345,
            payload_len: 1000,
            next_header: GRH_NEXT_HEADER_BTH,
            hop_limit: 64,
            sgid: [1; 16],
            dgid: [0xff; 16],
        };
        assert_eq!(GrhRepr::parse(&g.to_bytes()).unwrap(), g);
        assert!(GrhRepr::parse(&[0u8; 39]).is_err());
    }
}
