//! Base Transport Header (IBTA vol. 1, §9.2), 12 bytes, and PSN arithmetic.

use crate::error::{Error, Result};
use crate::field::{check_len, get_u16, get_u24, put_u16, put_u24};
use crate::opcode::Opcode;

/// Length of the BTH in bytes.
pub const BTH_LEN: usize = 12;

/// Mask of the 24-bit PSN and QPN fields.
pub const PSN_MASK: u32 = 0x00FF_FFFF;

/// Mask of the 24-bit destination QP number.
pub const QPN_MASK: u32 = 0x00FF_FFFF;

/// `psn + n` modulo 2^24. Bits of `psn` above 24 are discarded.
pub const fn psn_add(psn: u32, n: u32) -> u32 {
    psn.wrapping_add(n) & PSN_MASK
}

/// `psn - n` modulo 2^24. Bits of `psn` above 24 are discarded.
pub const fn psn_sub(psn: u32, n: u32) -> u32 {
    psn.wrapping_sub(n) & PSN_MASK
}

/// Signed distance `a - b` in the 24-bit PSN space, in
/// `-2^23 ..= 2^23 - 1`.
///
/// This is the serial-number comparison the RC window checks need: a PSN
/// is "ahead" of another when it lies in the half of the circle after it.
/// Two PSNs exactly 2^23 apart are ambiguous; the result is then `-2^23`
/// in both directions. Bits above 24 in either argument are ignored.
pub const fn psn_diff(a: u32, b: u32) -> i32 {
    // Move the 24-bit difference into the top of an i32 and shift back
    // arithmetically to sign-extend it.
    ((a.wrapping_sub(b) << 8) as i32) >> 8
}

/// `a` precedes `b` in PSN order (`psn_diff(a, b) < 0`).
pub const fn psn_lt(a: u32, b: u32) -> bool {
    psn_diff(a, b) < 0
}

/// `a` precedes or equals `b` in PSN order (`psn_diff(a, b) <= 0`).
pub const fn psn_le(a: u32, b: u32) -> bool {
    psn_diff(a, b) <= 0
}

mod field {
    pub(super) const OPCODE: usize = 0;
    pub(super) const FLAGS: usize = 1; // SE | M | PadCnt | TVer
    pub(super) const PKEY: usize = 2;
    pub(super) const FECN_BECN: usize = 4;
    pub(super) const DEST_QP: usize = 5;
    pub(super) const ACK_REQ: usize = 8;
    pub(super) const PSN: usize = 9;

    pub(super) const SE: u8 = 0x80;
    pub(super) const MIG: u8 = 0x40;
    pub(super) const PAD_SHIFT: u32 = 4;
    pub(super) const PAD: u8 = 0x30;
    pub(super) const TVER: u8 = 0x0F;
    pub(super) const FECN: u8 = 0x80;
    pub(super) const BECN: u8 = 0x40;
    pub(super) const ACK: u8 = 0x80;
}

/// A read/write view of a Base Transport Header at the start of a buffer.
///
/// ```text
///  0                   1                   2                   3
///  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
/// +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
/// |    OpCode     |S|M|Pad| TVer  |             P_Key             |
/// +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
/// |F|B|   Resv6   |                    DestQP                     |
/// +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
/// |A|    Resv7    |                      PSN                      |
/// +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
/// ```
///
/// Built with [`Bth::new_checked`], every accessor is infallible. A view
/// built with [`Bth::new_unchecked`] over fewer than [`BTH_LEN`] bytes panics
/// on access. Setters of single-bit or sub-byte fields preserve the other
/// bits of their byte (including reserved bits); setters of 24-bit fields
/// write only the low 24 bits of their argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bth<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Bth<T> {
    /// Wraps a buffer without checking its length.
    pub const fn new_unchecked(buffer: T) -> Self {
        Bth { buffer }
    }

    /// Wraps a buffer, failing with [`Error::Truncated`] if it is shorter
    /// than [`BTH_LEN`]. Extra bytes are allowed (they are the rest of the
    /// packet).
    pub fn new_checked(buffer: T) -> Result<Self> {
        let b = Self::new_unchecked(buffer);
        b.check_len()?;
        Ok(b)
    }

    /// Checks that the buffer holds at least [`BTH_LEN`] bytes.
    pub fn check_len(&self) -> Result<()> {
        check_len(BTH_LEN, self.buffer.as_ref().len())
    }

    /// Unwraps the view.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// Raw opcode byte.
    pub fn opcode_raw(&self) -> u8 {
        self.buffer.as_ref()[field::OPCODE]
    }

    /// Decoded opcode; [`Error::UnknownOpcode`] if it is not RC.
    pub fn opcode(&self) -> Result<Opcode> {
        Opcode::try_from(self.opcode_raw())
    }

    /// Solicited Event bit.
    pub fn solicited(&self) -> bool {
        self.buffer.as_ref()[field::FLAGS] & field::SE != 0
    }

    /// MigReq bit (path migration state).
    pub fn migreq(&self) -> bool {
        self.buffer.as_ref()[field::FLAGS] & field::MIG != 0
    }

    /// Pad count (0..=3): bytes of padding after the payload.
    pub fn pad_count(&self) -> u8 {
        (self.buffer.as_ref()[field::FLAGS] & field::PAD) >> field::PAD_SHIFT
    }

    /// Transport header version (must be 0).
    pub fn tver(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS] & field::TVER
    }

    /// Partition key.
    pub fn pkey(&self) -> u16 {
        get_u16(self.buffer.as_ref(), field::PKEY)
    }

    /// Forward Explicit Congestion Notification bit.
    pub fn fecn(&self) -> bool {
        self.buffer.as_ref()[field::FECN_BECN] & field::FECN != 0
    }

    /// Backward Explicit Congestion Notification bit.
    pub fn becn(&self) -> bool {
        self.buffer.as_ref()[field::FECN_BECN] & field::BECN != 0
    }

    /// The six reserved bits after FECN/BECN (transmitted as 0).
    pub fn resv6(&self) -> u8 {
        self.buffer.as_ref()[field::FECN_BECN] & 0x3F
    }

    /// Destination QP number (24 bits).
    pub fn dest_qpn(&self) -> u32 {
        get_u24(self.buffer.as_ref(), field::DEST_QP)
    }

    /// AckReq bit: the requester asks for an acknowledgement.
    pub fn ack_req(&self) -> bool {
        self.buffer.as_ref()[field::ACK_REQ] & field::ACK != 0
    }

    /// The seven reserved bits after AckReq (transmitted as 0).
    pub fn resv7(&self) -> u8 {
        self.buffer.as_ref()[field::ACK_REQ] & 0x7F
    }

    /// Packet sequence number (24 bits).
    pub fn psn(&self) -> u32 {
        get_u24(self.buffer.as_ref(), field::PSN)
    }
}

fn set_bit(byte: &mut u8, mask: u8, on: bool) {
    if on {
        *byte |= mask;
    } else {
        *byte &= !mask;
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Bth<T> {
    /// Sets the opcode.
    pub fn set_opcode(&mut self, op: Opcode) {
        self.set_opcode_raw(op.as_u8());
    }

    /// Sets the raw opcode byte (for tests and non-RC experiments).
    pub fn set_opcode_raw(&mut self, op: u8) {
        self.buffer.as_mut()[field::OPCODE] = op;
    }

    /// Sets the Solicited Event bit.
    pub fn set_solicited(&mut self, v: bool) {
        set_bit(&mut self.buffer.as_mut()[field::FLAGS], field::SE, v);
    }

    /// Sets the MigReq bit.
    pub fn set_migreq(&mut self, v: bool) {
        set_bit(&mut self.buffer.as_mut()[field::FLAGS], field::MIG, v);
    }

    /// Sets the pad count; only the low two bits of `v` are used.
    pub fn set_pad_count(&mut self, v: u8) {
        let b = &mut self.buffer.as_mut()[field::FLAGS];
        *b = (*b & !field::PAD) | ((v << field::PAD_SHIFT) & field::PAD);
    }

    /// Sets the transport header version; only the low four bits are used.
    pub fn set_tver(&mut self, v: u8) {
        let b = &mut self.buffer.as_mut()[field::FLAGS];
        *b = (*b & !field::TVER) | (v & field::TVER);
    }

    /// Sets the partition key.
    pub fn set_pkey(&mut self, v: u16) {
        put_u16(self.buffer.as_mut(), field::PKEY, v);
    }

    /// Sets the FECN bit.
    pub fn set_fecn(&mut self, v: bool) {
        set_bit(&mut self.buffer.as_mut()[field::FECN_BECN], field::FECN, v);
    }

    /// Sets the BECN bit.
    pub fn set_becn(&mut self, v: bool) {
        set_bit(&mut self.buffer.as_mut()[field::FECN_BECN], field::BECN, v);
    }

    /// Sets the destination QP number; bits above 24 are discarded.
    pub fn set_dest_qpn(&mut self, v: u32) {
        put_u24(self.buffer.as_mut(), field::DEST_QP, v);
    }

    /// Sets the AckReq bit.
    pub fn set_ack_req(&mut self, v: bool) {
        set_bit(&mut self.buffer.as_mut()[field::ACK_REQ], field::ACK, v);
    }

    /// Sets the PSN; bits above 24 are discarded.
    pub fn set_psn(&mut self, v: u32) {
        put_u24(self.buffer.as_mut(), field::PSN, v);
    }

    /// Zeroes both reserved fields (Resv6 and Resv7).
    pub fn clear_reserved(&mut self) {
        let d = self.buffer.as_mut();
        d[field::FECN_BECN] &= field::FECN | field::BECN;
        d[field::ACK_REQ] &= field::ACK;
    }
}

/// Plain-data form of a BTH.
///
/// `TVer` is not represented: it is always emitted as 0 and any other value
/// is rejected by [`BthRepr::parse`]. Reserved bits are emitted as 0 and
/// ignored on parse.
///
/// `dest_qpn` and `psn` are 24-bit and `pad_count` 2-bit quantities stored
/// in wider integers. [`BthRepr::check`] reports out-of-range values as
/// [`Error::FieldOutOfRange`]; [`BthRepr::emit`] treats them as a caller bug
/// (`debug_assert!`) and, in release builds, masks them to their width.
/// [`crate::RcRepr::emit`] runs [`BthRepr::check`] and returns the error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BthRepr {
    /// Opcode (determines the extension headers that follow).
    pub opcode: Opcode,
    /// Solicited Event.
    pub solicited: bool,
    /// MigReq.
    pub migreq: bool,
    /// Pad count, 0..=3.
    pub pad_count: u8,
    /// Partition key.
    pub pkey: u16,
    /// FECN.
    pub fecn: bool,
    /// BECN.
    pub becn: bool,
    /// Destination QP number, `< 2^24`.
    pub dest_qpn: u32,
    /// AckReq.
    pub ack_req: bool,
    /// Packet sequence number, `< 2^24`.
    pub psn: u32,
}

impl BthRepr {
    /// Parses a BTH view. Fails on a short buffer, a non-zero `TVer`
    /// ([`Error::BadVersion`]) or a non-RC opcode.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &Bth<&T>) -> Result<BthRepr> {
        packet.check_len()?;
        let tver = packet.tver();
        if tver != 0 {
            return Err(Error::BadVersion(tver));
        }
        Ok(Self::parse_checked(packet, packet.opcode()?))
    }

    /// [`BthRepr::parse`] of a BTH whose length, version and opcode (`op`) the caller has
    /// already checked.
    #[inline]
    pub(crate) fn parse_checked<T: AsRef<[u8]> + ?Sized>(packet: &Bth<&T>, op: Opcode) -> BthRepr {
        let d: &[u8; BTH_LEN] = packet.buffer.as_ref()[..BTH_LEN]
            .try_into()
            .expect("a slice of BTH_LEN bytes");
        let w0 = u32::from_be_bytes([d[0], d[1], d[2], d[3]]);
        let w1 = u32::from_be_bytes([d[4], d[5], d[6], d[7]]);
        let w2 = u32::from_be_bytes([d[8], d[9], d[10], d[11]]);
        let flags = (w0 >> 16) as u8;
        BthRepr {
            opcode: op,
            solicited: flags & field::SE != 0,
            migreq: flags & field::MIG != 0,
            pad_count: (flags & field::PAD) >> field::PAD_SHIFT,
            pkey: w0 as u16,
            fecn: w1 & (u32::from(field::FECN) << 24) != 0,
            becn: w1 & (u32::from(field::BECN) << 24) != 0,
            dest_qpn: w1 & QPN_MASK,
            ack_req: w2 & (u32::from(field::ACK) << 24) != 0,
            psn: w2 & PSN_MASK,
        }
    }

    /// Checks that every field fits its wire width.
    pub fn check(&self) -> Result<()> {
        if self.dest_qpn > QPN_MASK {
            return Err(Error::FieldOutOfRange {
                field: "dest_qpn",
                value: self.dest_qpn.into(),
            });
        }
        if self.psn > PSN_MASK {
            return Err(Error::FieldOutOfRange {
                field: "psn",
                value: self.psn.into(),
            });
        }
        if self.pad_count > 3 {
            return Err(Error::FieldOutOfRange {
                field: "pad_count",
                value: self.pad_count.into(),
            });
        }
        Ok(())
    }

    /// Length of the emitted header: [`BTH_LEN`].
    pub const fn buffer_len(&self) -> usize {
        BTH_LEN
    }

    /// Writes all 12 bytes of the BTH, with `TVer` and reserved bits 0.
    ///
    /// Out-of-range `dest_qpn`, `psn` or `pad_count` trip a `debug_assert!`
    /// and are masked to their width otherwise (see [`BthRepr::check`]).
    ///
    /// # Panics
    /// If the view was built with `new_unchecked` over fewer than
    /// [`BTH_LEN`] bytes.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]> + ?Sized>(&self, packet: &mut Bth<&mut T>) {
        debug_assert_eq!(self.check(), Ok(()), "BthRepr field out of range");
        let d: &mut [u8; BTH_LEN] = (&mut packet.buffer.as_mut()[..BTH_LEN])
            .try_into()
            .expect("a slice of BTH_LEN bytes");
        // Three big-endian words (one bounds check): opcode, flags and P_Key; FECN/BECN
        // and the destination QP; AckReq and the PSN.
        let flags = (u32::from(self.solicited) << 7)
            | (u32::from(self.migreq) << 6)
            | (u32::from(self.pad_count & 0x3) << field::PAD_SHIFT);
        let w0 = (u32::from(self.opcode.as_u8()) << 24) | (flags << 16) | u32::from(self.pkey);
        let w1 = (u32::from(self.fecn) << 31)
            | (u32::from(self.becn) << 30)
            | (self.dest_qpn & QPN_MASK);
        let w2 = (u32::from(self.ack_req) << 31) | (self.psn & PSN_MASK);
        d[0..4].copy_from_slice(&w0.to_be_bytes());
        d[4..8].copy_from_slice(&w1.to_be_bytes());
        d[8..12].copy_from_slice(&w2.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // RDMA_WRITE_ONLY, SE, pad 2, P_Key 0xFFFF, BECN, QP 0x123456,
    // AckReq, PSN 0xABCDEF.
    const BYTES: [u8; 12] = [
        0x0A, 0xA0, 0xFF, 0xFF, //
        0x40, 0x12, 0x34, 0x56, //
        0x80, 0xAB, 0xCD, 0xEF,
    ];

    fn repr() -> BthRepr {
        BthRepr {
            opcode: Opcode::RdmaWriteOnly,
            solicited: true,
            migreq: false,
            pad_count: 2,
            pkey: 0xFFFF,
            fecn: false,
            becn: true,
            dest_qpn: 0x12_3456,
            ack_req: true,
            psn: 0xAB_CDEF,
        }
    }

    #[test]
    fn bth_deconstruct_known_bytes() {
        let b = Bth::new_checked(&BYTES[..]).unwrap();
        assert_eq!(b.opcode(), Ok(Opcode::RdmaWriteOnly));
        assert!(b.solicited());
        assert!(!b.migreq());
        assert_eq!(b.pad_count(), 2);
        assert_eq!(b.tver(), 0);
        assert_eq!(b.pkey(), 0xFFFF);
        assert!(!b.fecn());
        assert!(b.becn());
        assert_eq!(b.dest_qpn(), 0x12_3456);
        assert!(b.ack_req());
        assert_eq!(b.psn(), 0xAB_CDEF);
        assert_eq!(BthRepr::parse(&b), Ok(repr()));
    }

    #[test]
    fn bth_emit_known_bytes() {
        let mut buf = [0xEEu8; 12];
        repr().emit(&mut Bth::new_checked(&mut buf[..]).unwrap());
        assert_eq!(buf, BYTES);
    }

    #[test]
    fn bth_setters_build_known_bytes() {
        let mut buf = [0u8; 12];
        let mut b = Bth::new_checked(&mut buf[..]).unwrap();
        b.set_opcode(Opcode::RdmaWriteOnly);
        b.set_solicited(true);
        b.set_pad_count(2);
        b.set_pkey(0xFFFF);
        b.set_becn(true);
        b.set_dest_qpn(0xFF12_3456); // high byte discarded
        b.set_ack_req(true);
        b.set_psn(0xAB_CDEF);
        assert_eq!(buf, BYTES);
    }

    #[test]
    fn bth_all_flags_and_bit_positions() {
        let r = BthRepr {
            opcode: Opcode::SendFirst,
            solicited: true,
            migreq: true,
            pad_count: 3,
            pkey: 0x8001,
            fecn: true,
            becn: true,
            dest_qpn: 0xFF_FFFF,
            ack_req: true,
            psn: 0,
        };
        let mut buf = [0u8; 12];
        r.emit(&mut Bth::new_unchecked(&mut buf[..]));
        assert_eq!(
            buf,
            [0x00, 0xF0, 0x80, 0x01, 0xC0, 0xFF, 0xFF, 0xFF, 0x80, 0x00, 0x00, 0x00]
        );
        assert_eq!(BthRepr::parse(&Bth::new_unchecked(&buf[..])), Ok(r));

        // Each single flag in isolation lands on the documented bit.
        let base = BthRepr {
            solicited: false,
            migreq: false,
            pad_count: 0,
            fecn: false,
            becn: false,
            ack_req: false,
            ..r
        };
        let cases: [(BthRepr, usize, u8); 7] = [
            (
                BthRepr {
                    solicited: true,
                    ..base
                },
                1,
                0x80,
            ),
            (
                BthRepr {
                    migreq: true,
                    ..base
                },
                1,
                0x40,
            ),
            (
                BthRepr {
                    pad_count: 1,
                    ..base
                },
                1,
                0x10,
            ),
            (
                BthRepr {
                    pad_count: 2,
                    ..base
                },
                1,
                0x20,
            ),
            (BthRepr { fecn: true, ..base }, 4, 0x80),
            (BthRepr { becn: true, ..base }, 4, 0x40),
            (
                BthRepr {
                    ack_req: true,
                    ..base
                },
                8,
                0x80,
            ),
        ];
        for (r, at, byte) in cases {
            let mut buf = [0u8; 12];
            r.emit(&mut Bth::new_unchecked(&mut buf[..]));
            assert_eq!(buf[at], byte, "{r:?}");
        }
    }

    #[test]
    fn bth_reserved_bits_ignored_on_parse_and_zeroed_on_emit() {
        let mut buf = BYTES;
        buf[4] |= 0x3F;
        buf[8] |= 0x7F;
        let b = Bth::new_checked(&buf[..]).unwrap();
        assert_eq!(b.resv6(), 0x3F);
        assert_eq!(b.resv7(), 0x7F);
        assert_eq!(BthRepr::parse(&b), Ok(repr()));
        let mut out = [0xFFu8; 12];
        repr().emit(&mut Bth::new_unchecked(&mut out[..]));
        assert_eq!(out, BYTES);
        let mut v = Bth::new_unchecked(&mut buf[..]);
        v.clear_reserved();
        assert_eq!(buf, BYTES);
    }

    #[test]
    fn bth_setters_preserve_neighbours() {
        let mut buf = [0xFFu8; 12];
        let mut b = Bth::new_unchecked(&mut buf[..]);
        b.set_pad_count(0);
        b.set_tver(0);
        assert_eq!(b.pad_count(), 0);
        assert!(b.solicited() && b.migreq());
        b.set_fecn(false);
        assert!(b.becn());
        assert_eq!(b.resv6(), 0x3F);
        b.set_dest_qpn(0);
        assert_eq!(b.resv6(), 0x3F);
        b.set_psn(0);
        assert!(b.ack_req());
        b.set_ack_req(false);
        assert_eq!(b.resv7(), 0x7F);
        assert_eq!(buf, [0xFF, 0xC0, 0xFF, 0xFF, 0x7F, 0, 0, 0, 0x7F, 0, 0, 0]);
    }

    #[test]
    fn bth_rejects_bad_version_opcode_and_short_buffers() {
        let mut buf = BYTES;
        buf[1] |= 0x01;
        let b = Bth::new_checked(&buf[..]).unwrap();
        assert_eq!(BthRepr::parse(&b), Err(Error::BadVersion(1)));

        let mut buf = BYTES;
        buf[0] = 0x24; // UC SEND_ONLY
        assert_eq!(
            BthRepr::parse(&Bth::new_checked(&buf[..]).unwrap()),
            Err(Error::UnknownOpcode(0x24))
        );

        for n in 0..BTH_LEN {
            assert_eq!(
                Bth::new_checked(&BYTES[..n]),
                Err(Error::Truncated { need: 12, have: n })
            );
            assert_eq!(
                BthRepr::parse(&Bth::new_unchecked(&BYTES[..n])),
                Err(Error::Truncated { need: 12, have: n })
            );
        }
    }

    #[test]
    fn bth_check_field_ranges() {
        assert_eq!(repr().check(), Ok(()));
        let r = BthRepr {
            psn: 1 << 24,
            ..repr()
        };
        assert_eq!(
            r.check(),
            Err(Error::FieldOutOfRange {
                field: "psn",
                value: 1 << 24
            })
        );
        let r = BthRepr {
            dest_qpn: u32::MAX,
            ..repr()
        };
        assert!(matches!(
            r.check(),
            Err(Error::FieldOutOfRange {
                field: "dest_qpn",
                ..
            })
        ));
        let r = BthRepr {
            pad_count: 4,
            ..repr()
        };
        assert!(matches!(
            r.check(),
            Err(Error::FieldOutOfRange {
                field: "pad_count",
                ..
            })
        ));
    }

    #[test]
    fn psn_wraparound_arithmetic() {
        assert_eq!(psn_add(0xFF_FFFF, 1), 0);
        assert_eq!(psn_add(0xFF_FFFE, 5), 3);
        assert_eq!(psn_add(7, 0), 7);
        assert_eq!(psn_add(0, PSN_MASK), PSN_MASK);
        assert_eq!(psn_add(1, PSN_MASK), 0);
        assert_eq!(psn_sub(0, 1), 0xFF_FFFF);
        assert_eq!(psn_sub(3, 5), 0xFF_FFFE);

        assert_eq!(psn_diff(0, 0xFF_FFFF), 1);
        assert_eq!(psn_diff(0xFF_FFFF, 0), -1);
        assert_eq!(psn_diff(5, 3), 2);
        assert_eq!(psn_diff(3, 5), -2);
        assert_eq!(psn_diff(2, 0xFF_FFFE), 4);
        assert_eq!(psn_diff(0x7F_FFFF, 0), 0x7F_FFFF);
        assert_eq!(psn_diff(0x80_0000, 0), -0x80_0000);
        assert_eq!(psn_diff(0, 0x80_0000), -0x80_0000);
        assert_eq!(psn_diff(0, 0x80_0001), 0x7F_FFFF);
        // Bits above 24 are ignored.
        assert_eq!(psn_diff(0x0100_0005, 3), 2);

        assert!(psn_lt(0xFF_FFFF, 0));
        assert!(!psn_lt(0, 0xFF_FFFF));
        assert!(!psn_lt(4, 4));
        assert!(psn_le(4, 4));
        assert!(psn_lt(0xFF_FF00, 0x10));

        // psn_diff inverts psn_add for every distance in range.
        let mut x = 0x12_3457u32;
        for n in [0u32, 1, 2, 100, 0x7F_FFFF] {
            for _ in 0..64 {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345) & PSN_MASK;
                assert_eq!(psn_diff(psn_add(x, n), x), n as i32);
                assert_eq!(psn_diff(x, psn_add(x, n)), -(n as i32));
                assert_eq!(psn_sub(psn_add(x, n), n), x);
            }
        }
    }
}
