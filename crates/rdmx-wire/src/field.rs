//! Big-endian field accessors shared by the header views.
//!
//! These index directly and therefore panic on a short slice; the views only
//! call them after (or, for `new_unchecked` views, under the documented
//! contract of) a successful length check.

pub(crate) fn get_u16(d: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([d[at], d[at + 1]])
}

pub(crate) fn get_u24(d: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([0, d[at], d[at + 1], d[at + 2]])
}

pub(crate) fn get_u32(d: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([d[at], d[at + 1], d[at + 2], d[at + 3]])
}

pub(crate) fn get_u64(d: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[at..at + 8]);
    u64::from_be_bytes(b)
}

pub(crate) fn put_u16(d: &mut [u8], at: usize, v: u16) {
    d[at..at + 2].copy_from_slice(&v.to_be_bytes());
}

/// Writes the low 24 bits of `v`; the high byte is discarded.
pub(crate) fn put_u24(d: &mut [u8], at: usize, v: u32) {
    d[at..at + 3].copy_from_slice(&v.to_be_bytes()[1..]);
}

pub(crate) fn put_u32(d: &mut [u8], at: usize, v: u32) {
    d[at..at + 4].copy_from_slice(&v.to_be_bytes());
}

pub(crate) fn put_u64(d: &mut [u8], at: usize, v: u64) {
    d[at..at + 8].copy_from_slice(&v.to_be_bytes());
}

/// `Ok(())` when `have >= need`, else [`crate::Error::Truncated`].
pub(crate) fn check_len(need: usize, have: usize) -> crate::Result<()> {
    if have < need {
        Err(crate::Error::Truncated { need, have })
    } else {
        Ok(())
    }
}

/// Defines a fixed-length header view `$name<T>` with the usual
/// constructors; the field accessors are written next to each use.
macro_rules! header_view {
    ($(#[$meta:meta])* $name:ident, $len:expr) => {
        $(#[$meta])*
        ///
        /// Built with `new_checked`, every accessor is infallible; a view
        /// built with `new_unchecked` over a short buffer panics on access.
        /// Extra bytes after the header are allowed and ignored.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub struct $name<T: AsRef<[u8]>> {
            buffer: T,
        }

        impl<T: AsRef<[u8]>> $name<T> {
            /// Wraps a buffer without checking its length.
            pub const fn new_unchecked(buffer: T) -> Self {
                $name { buffer }
            }

            /// Wraps a buffer, failing with [`Error::Truncated`](crate::Error::Truncated)
            /// if it is shorter than the header.
            pub fn new_checked(buffer: T) -> $crate::Result<Self> {
                let v = Self::new_unchecked(buffer);
                v.check_len()?;
                Ok(v)
            }

            /// Checks that the buffer is long enough for the header.
            pub fn check_len(&self) -> $crate::Result<()> {
                $crate::field::check_len($len, self.buffer.as_ref().len())
            }

            /// Unwraps the view.
            pub fn into_inner(self) -> T {
                self.buffer
            }
        }
    };
}

pub(crate) use header_view;
