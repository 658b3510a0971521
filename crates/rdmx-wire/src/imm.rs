//! Immediate Data header (ImmDt, IBTA vol. 1, §9.3.7) and Invalidate
//! Extended Transport Header (IETH, §9.3.8), 4 bytes each.

use crate::error::Result;
use crate::field::{get_u32, header_view, put_u32};

/// Length of the ImmDt header in bytes.
pub const IMMDT_LEN: usize = 4;

/// Length of the IETH in bytes.
pub const IETH_LEN: usize = 4;

header_view! {
    /// A read/write view of an Immediate Data header (4 bytes).
    ///
    /// # Immediate data byte order
    ///
    /// ImmDt is 4 opaque bytes that the responder hands to the consumer in the
    /// receive completion. This crate exposes them as a `u32` whose value is
    /// the bytes read **big-endian** (`u32::from_be_bytes(wire)`), so
    /// `imm = 0x0102_0304` is sent as `01 02 03 04`.
    ///
    /// libibverbs' `imm_data` fields are `__be32`: the same wire bytes stored
    /// in memory unchanged. Convert with `u32::from_be(verbs_imm_data)` on the
    /// way in and `imm.to_be()` on the way out; the numeric value a C program
    /// gets from `ntohl(wc.imm_data)` equals this crate's `imm`.
    ImmDt, IMMDT_LEN
}

impl<T: AsRef<[u8]>> ImmDt<T> {
    /// The immediate data, read big-endian (see [`ImmDt`]).
    pub fn imm(&self) -> u32 {
        get_u32(self.buffer.as_ref(), 0)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> ImmDt<T> {
    /// Sets the immediate data, written big-endian.
    pub fn set_imm(&mut self, v: u32) {
        put_u32(self.buffer.as_mut(), 0, v);
    }
}

/// Plain-data form of an ImmDt header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ImmDtRepr {
    /// The immediate data as a big-endian-decoded `u32` (verbs
    /// `imm_data == imm.to_be()`).
    pub imm: u32,
}

impl ImmDtRepr {
    /// Parses an ImmDt view (fails only on a short buffer).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &ImmDt<&T>) -> Result<ImmDtRepr> {
        packet.check_len()?;
        Ok(ImmDtRepr { imm: packet.imm() })
    }

    /// Length of the emitted header: [`IMMDT_LEN`].
    pub const fn buffer_len(&self) -> usize {
        IMMDT_LEN
    }

    /// Writes the 4 header bytes.
    ///
    /// # Panics
    /// If the view was built with `new_unchecked` over fewer than
    /// [`IMMDT_LEN`] bytes.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]> + ?Sized>(&self, packet: &mut ImmDt<&mut T>) {
        packet.set_imm(self.imm);
    }
}

header_view! {
    /// A read/write view of an Invalidate Extended Transport Header
    /// (4 bytes).
    ///
    /// The IETH carries the R_Key the responder must invalidate after the
    /// SEND completes (SEND_LAST/ONLY_WITH_INVALIDATE); it is an ordinary
    /// big-endian `u32`.
    Ieth, IETH_LEN
}

impl<T: AsRef<[u8]>> Ieth<T> {
    /// The R_Key to invalidate.
    pub fn rkey(&self) -> u32 {
        get_u32(self.buffer.as_ref(), 0)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Ieth<T> {
    /// Sets the R_Key to invalidate.
    pub fn set_rkey(&mut self, v: u32) {
        put_u32(self.buffer.as_mut(), 0, v);
    }
}

/// Plain-data form of an IETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IethRepr {
    /// The R_Key to invalidate.
    pub rkey: u32,
}

impl IethRepr {
    /// Parses an IETH view (fails only on a short buffer).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &Ieth<&T>) -> Result<IethRepr> {
        packet.check_len()?;
        Ok(IethRepr {
            rkey: packet.rkey(),
        })
    }

    /// Length of the emitted header: [`IETH_LEN`].
    pub const fn buffer_len(&self) -> usize {
        IETH_LEN
    }

    /// Writes the 4 header bytes.
    ///
    /// # Panics
    /// If the view was built with `new_unchecked` over fewer than
    /// [`IETH_LEN`] bytes.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]> + ?Sized>(&self, packet: &mut Ieth<&mut T>) {
        packet.set_rkey(self.rkey);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    #[test]
    fn immdt_known_bytes_are_big_endian() {
        let bytes = [0x01, 0x02, 0x03, 0x04];
        let v = ImmDt::new_checked(&bytes[..]).unwrap();
        assert_eq!(v.imm(), 0x0102_0304);
        let repr = ImmDtRepr::parse(&v).unwrap();
        assert_eq!(repr, ImmDtRepr { imm: 0x0102_0304 });
        let mut out = [0u8; 4];
        repr.emit(&mut ImmDt::new_checked(&mut out[..]).unwrap());
        assert_eq!(out, bytes);
        // The verbs __be32 representation is the wire bytes in memory.
        assert_eq!(repr.imm.to_be().to_ne_bytes(), bytes);
        assert_eq!(repr.buffer_len(), 4);
    }

    #[test]
    fn ieth_known_bytes() {
        let bytes = [0xCA, 0xFE, 0xF0, 0x0D];
        let v = Ieth::new_checked(&bytes[..]).unwrap();
        assert_eq!(v.rkey(), 0xCAFE_F00D);
        let repr = IethRepr::parse(&v).unwrap();
        let mut out = [0u8; 4];
        repr.emit(&mut Ieth::new_checked(&mut out[..]).unwrap());
        assert_eq!(out, bytes);
        assert_eq!(repr.buffer_len(), 4);
    }

    #[test]
    fn immdt_ieth_truncated() {
        let bytes = [0u8; 4];
        for n in 0..4 {
            let e = Error::Truncated { need: 4, have: n };
            assert_eq!(ImmDtRepr::parse(&ImmDt::new_unchecked(&bytes[..n])), Err(e));
            assert_eq!(IethRepr::parse(&Ieth::new_unchecked(&bytes[..n])), Err(e));
        }
    }
}
