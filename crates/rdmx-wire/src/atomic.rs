//! Atomic Extended Transport Header (28 bytes, IBTA vol. 1, §9.3.4) and
//! Atomic ACK Extended Transport Header (8 bytes, §9.3.6).

use crate::error::Result;
use crate::field::{get_u32, get_u64, header_view, put_u32, put_u64};

/// Length of the AtomicETH in bytes.
pub const ATOMIC_ETH_LEN: usize = 28;

/// Length of the AtomicAckETH in bytes.
pub const ATOMIC_ACK_ETH_LEN: usize = 8;

mod field {
    pub(super) const VA: usize = 0;
    pub(super) const RKEY: usize = 8;
    pub(super) const SWAP_ADD: usize = 12;
    pub(super) const COMPARE: usize = 20;
}

header_view! {
    /// A read/write view of an Atomic Extended Transport Header (28 bytes).
    ///
    /// ```text
    /// AtomicETH                                 AtomicAckETH
    /// +-----------------------------------+     +-----------------------------+
    /// | Virtual Address            (8 B)  |     | Original Remote Data  (8 B) |
    /// | R_Key                      (4 B)  |     +-----------------------------+
    /// | Swap (or Add) Data         (8 B)  |
    /// | Compare Data               (8 B)  |
    /// +-----------------------------------+
    /// ```
    ///
    /// CMP_SWAP uses both data fields; FETCH_ADD uses the first as the addend
    /// and ignores Compare Data. The requirement that the virtual address be
    /// 8-byte aligned is a responder check, not a wire-format one, so it is not
    /// enforced here.
    AtomicEth, ATOMIC_ETH_LEN
}

impl<T: AsRef<[u8]>> AtomicEth<T> {
    /// Remote virtual address of the 8-byte target.
    pub fn va(&self) -> u64 {
        get_u64(self.buffer.as_ref(), field::VA)
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::RKEY)
    }

    /// Swap data (CMP_SWAP) or addend (FETCH_ADD).
    pub fn swap_add(&self) -> u64 {
        get_u64(self.buffer.as_ref(), field::SWAP_ADD)
    }

    /// Compare data (CMP_SWAP only).
    pub fn compare(&self) -> u64 {
        get_u64(self.buffer.as_ref(), field::COMPARE)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AtomicEth<T> {
    /// Sets the remote virtual address.
    pub fn set_va(&mut self, v: u64) {
        put_u64(self.buffer.as_mut(), field::VA, v);
    }

    /// Sets the remote key.
    pub fn set_rkey(&mut self, v: u32) {
        put_u32(self.buffer.as_mut(), field::RKEY, v);
    }

    /// Sets the swap data / addend.
    pub fn set_swap_add(&mut self, v: u64) {
        put_u64(self.buffer.as_mut(), field::SWAP_ADD, v);
    }

    /// Sets the compare data.
    pub fn set_compare(&mut self, v: u64) {
        put_u64(self.buffer.as_mut(), field::COMPARE, v);
    }
}

/// Plain-data form of an AtomicETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AtomicEthRepr {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Swap data (CMP_SWAP) or addend (FETCH_ADD).
    pub swap_add: u64,
    /// Compare data (CMP_SWAP; conventionally 0 for FETCH_ADD).
    pub compare: u64,
}

impl AtomicEthRepr {
    /// Parses an AtomicETH view (fails only on a short buffer).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &AtomicEth<&T>) -> Result<AtomicEthRepr> {
        packet.check_len()?;
        Ok(AtomicEthRepr {
            va: packet.va(),
            rkey: packet.rkey(),
            swap_add: packet.swap_add(),
            compare: packet.compare(),
        })
    }

    /// Length of the emitted header: [`ATOMIC_ETH_LEN`].
    pub const fn buffer_len(&self) -> usize {
        ATOMIC_ETH_LEN
    }

    /// Writes the 28 header bytes.
    ///
    /// # Panics
    /// If the view was built with `new_unchecked` over fewer than
    /// [`ATOMIC_ETH_LEN`] bytes.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]> + ?Sized>(&self, packet: &mut AtomicEth<&mut T>) {
        packet.set_va(self.va);
        packet.set_rkey(self.rkey);
        packet.set_swap_add(self.swap_add);
        packet.set_compare(self.compare);
    }
}

header_view! {
    /// A read/write view of an Atomic ACK Extended Transport Header
    /// (8 bytes): the original remote data, big-endian.
    AtomicAckEth, ATOMIC_ACK_ETH_LEN
}

impl<T: AsRef<[u8]>> AtomicAckEth<T> {
    /// The value at the target address before the atomic operation.
    pub fn orig_data(&self) -> u64 {
        get_u64(self.buffer.as_ref(), 0)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AtomicAckEth<T> {
    /// Sets the original remote data.
    pub fn set_orig_data(&mut self, v: u64) {
        put_u64(self.buffer.as_mut(), 0, v);
    }
}

/// Plain-data form of an AtomicAckETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AtomicAckEthRepr {
    /// The value at the target address before the atomic operation.
    pub orig_data: u64,
}

impl AtomicAckEthRepr {
    /// Parses an AtomicAckETH view (fails only on a short buffer).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &AtomicAckEth<&T>) -> Result<AtomicAckEthRepr> {
        packet.check_len()?;
        Ok(AtomicAckEthRepr {
            orig_data: packet.orig_data(),
        })
    }

    /// Length of the emitted header: [`ATOMIC_ACK_ETH_LEN`].
    pub const fn buffer_len(&self) -> usize {
        ATOMIC_ACK_ETH_LEN
    }

    /// Writes the 8 header bytes.
    ///
    /// # Panics
    /// If the view was built with `new_unchecked` over fewer than
    /// [`ATOMIC_ACK_ETH_LEN`] bytes.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]> + ?Sized>(&self, packet: &mut AtomicAckEth<&mut T>) {
        packet.set_orig_data(self.orig_data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    #[test]
    fn atomic_eth_known_bytes() {
        let bytes: [u8; 28] = [
            0x00, 0x00, 0x7F, 0x00, 0x12, 0x34, 0x56, 0x78, // VA
            0x00, 0x00, 0x10, 0x01, // R_Key
            0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, // swap
            0x99, 0xAA, 0xBB, 0xCC, 0xDD, 0xEE, 0xFF, 0x00, // compare
        ];
        let repr = AtomicEthRepr {
            va: 0x0000_7F00_1234_5678,
            rkey: 0x1001,
            swap_add: 0x1122_3344_5566_7788,
            compare: 0x99AA_BBCC_DDEE_FF00,
        };
        let v = AtomicEth::new_checked(&bytes[..]).unwrap();
        assert_eq!(v.va(), repr.va);
        assert_eq!(v.rkey(), repr.rkey);
        assert_eq!(v.swap_add(), repr.swap_add);
        assert_eq!(v.compare(), repr.compare);
        assert_eq!(AtomicEthRepr::parse(&v), Ok(repr));
        let mut out = [0x5Au8; 28];
        repr.emit(&mut AtomicEth::new_checked(&mut out[..]).unwrap());
        assert_eq!(out, bytes);
        assert_eq!(repr.buffer_len(), 28);
        for n in 0..ATOMIC_ETH_LEN {
            assert_eq!(
                AtomicEth::new_checked(&bytes[..n]),
                Err(Error::Truncated { need: 28, have: n })
            );
        }
    }

    #[test]
    fn atomic_ack_eth_known_bytes() {
        let bytes = [0xFE, 0xDC, 0xBA, 0x98, 0x76, 0x54, 0x32, 0x10];
        let repr = AtomicAckEthRepr {
            orig_data: 0xFEDC_BA98_7654_3210,
        };
        let v = AtomicAckEth::new_checked(&bytes[..]).unwrap();
        assert_eq!(AtomicAckEthRepr::parse(&v), Ok(repr));
        let mut out = [0u8; 8];
        repr.emit(&mut AtomicAckEth::new_checked(&mut out[..]).unwrap());
        assert_eq!(out, bytes);
        assert_eq!(repr.buffer_len(), 8);
        for n in 0..ATOMIC_ACK_ETH_LEN {
            assert_eq!(
                AtomicAckEthRepr::parse(&AtomicAckEth::new_unchecked(&bytes[..n])),
                Err(Error::Truncated { need: 8, have: n })
            );
        }
    }
}
