//! RDMA Extended Transport Header (IBTA vol. 1, §9.3.3), 16 bytes.

use crate::error::Result;
use crate::field::{get_u32, get_u64, header_view, put_u32, put_u64};

/// Length of the RETH in bytes.
pub const RETH_LEN: usize = 16;

mod field {
    pub(super) const VA: usize = 0;
    pub(super) const RKEY: usize = 8;
    pub(super) const DMA_LEN: usize = 12;
}

header_view! {
    /// A read/write view of an RDMA Extended Transport Header (16 bytes).
    ///
    /// ```text
    ///  0                   1                   2                   3
    ///  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
    /// +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
    /// |                     Virtual Address (63..32)                  |
    /// +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
    /// |                     Virtual Address (31..0)                   |
    /// +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
    /// |                             R_Key                             |
    /// +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
    /// |                           DMA Length                          |
    /// +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
    /// ```
    ///
    /// Carried by RDMA WRITE FIRST / ONLY (target of the whole message) and the
    /// RDMA READ request (source region and total length to read).
    Reth, RETH_LEN
}

impl<T: AsRef<[u8]>> Reth<T> {
    /// Remote virtual address.
    pub fn va(&self) -> u64 {
        get_u64(self.buffer.as_ref(), field::VA)
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::RKEY)
    }

    /// Length of the whole RDMA operation in bytes (not of this packet).
    pub fn dma_len(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::DMA_LEN)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Reth<T> {
    /// Sets the remote virtual address.
    pub fn set_va(&mut self, v: u64) {
        put_u64(self.buffer.as_mut(), field::VA, v);
    }

    /// Sets the remote key.
    pub fn set_rkey(&mut self, v: u32) {
        put_u32(self.buffer.as_mut(), field::RKEY, v);
    }

    /// Sets the DMA length.
    pub fn set_dma_len(&mut self, v: u32) {
        put_u32(self.buffer.as_mut(), field::DMA_LEN, v);
    }
}

/// Plain-data form of a RETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RethRepr {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Length of the whole RDMA operation in bytes.
    pub dma_len: u32,
}

impl RethRepr {
    /// Parses a RETH view (fails only on a short buffer).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &Reth<&T>) -> Result<RethRepr> {
        packet.check_len()?;
        Ok(RethRepr {
            va: packet.va(),
            rkey: packet.rkey(),
            dma_len: packet.dma_len(),
        })
    }

    /// Length of the emitted header: [`RETH_LEN`].
    pub const fn buffer_len(&self) -> usize {
        RETH_LEN
    }

    /// Writes the 16 header bytes.
    ///
    /// # Panics
    /// If the view was built with `new_unchecked` over fewer than
    /// [`RETH_LEN`] bytes.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]> + ?Sized>(&self, packet: &mut Reth<&mut T>) {
        packet.set_va(self.va);
        packet.set_rkey(self.rkey);
        packet.set_dma_len(self.dma_len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    const BYTES: [u8; 16] = [
        0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF, // VA
        0xDE, 0xAD, 0xBE, 0xEF, // R_Key
        0x00, 0x01, 0x00, 0x02, // DMA length
    ];

    const REPR: RethRepr = RethRepr {
        va: 0x0123_4567_89AB_CDEF,
        rkey: 0xDEAD_BEEF,
        dma_len: 0x0001_0002,
    };

    #[test]
    fn reth_known_bytes_round_trip() {
        let v = Reth::new_checked(&BYTES[..]).unwrap();
        assert_eq!(v.va(), REPR.va);
        assert_eq!(v.rkey(), REPR.rkey);
        assert_eq!(v.dma_len(), REPR.dma_len);
        assert_eq!(RethRepr::parse(&v), Ok(REPR));

        let mut out = [0xAAu8; 16];
        REPR.emit(&mut Reth::new_checked(&mut out[..]).unwrap());
        assert_eq!(out, BYTES);
        assert_eq!(REPR.buffer_len(), 16);
    }

    #[test]
    fn reth_truncated() {
        for n in 0..RETH_LEN {
            assert_eq!(
                Reth::new_checked(&BYTES[..n]),
                Err(Error::Truncated { need: 16, have: n })
            );
            assert!(RethRepr::parse(&Reth::new_unchecked(&BYTES[..n])).is_err());
        }
    }
}
