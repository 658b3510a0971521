//! The error type shared by every parser and emitter in this crate.

use core::fmt;

use crate::packet::HeaderKind;

/// Why a buffer could not be parsed, or a representation could not be
/// emitted.
///
/// The enum is `#[non_exhaustive]`: future header types (e.g. the IBTA 1.5
/// FLUSH / ATOMIC WRITE extensions) may add variants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Error {
    /// The buffer is shorter than the structure being read or written.
    Truncated {
        /// Bytes required.
        need: usize,
        /// Bytes available.
        have: usize,
    },
    /// The BTH opcode is not one of the RC opcodes this crate knows (this
    /// includes every UC, RD, UD, CNP and manufacturer-specific opcode).
    UnknownOpcode(u8),
    /// The BTH transport header version (`TVer`) is not 0.
    BadVersion(u8),
    /// The BTH pad count is inconsistent with the bytes following the
    /// headers: payload plus pad must be a multiple of 4 and at least
    /// `pad_count` bytes long, and FIRST / MIDDLE packets (whose payload is
    /// always a full PMTU) must carry no pad.
    BadPad {
        /// The pad count from (or derived for) the BTH.
        pad_count: u8,
        /// Bytes of payload plus pad following the headers.
        len: usize,
    },
    /// Bytes follow the headers of an opcode that carries no payload
    /// (ACKNOWLEDGE, ATOMIC ACKNOWLEDGE, RDMA READ request, atomics).
    UnexpectedPayload {
        /// Bytes found (or requested) after the headers.
        len: usize,
    },
    /// The AETH syndrome uses a reserved encoding.
    BadSyndrome(u8),
    /// A representation lacks an extension header its opcode requires.
    MissingHeader(HeaderKind),
    /// A representation carries an extension header its opcode forbids.
    UnexpectedHeader(HeaderKind),
    /// A representation field does not fit its wire width (e.g. a PSN or
    /// QPN of 2^24 or more, or a pad count above 3).
    FieldOutOfRange {
        /// Name of the offending field.
        field: &'static str,
        /// The value that did not fit.
        value: u64,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Error::Truncated { need, have } => {
                write!(f, "truncated: need {need} bytes, have {have}")
            }
            Error::UnknownOpcode(op) => write!(f, "unknown or non-RC opcode {op:#04x}"),
            Error::BadVersion(v) => write!(f, "unsupported transport header version {v}"),
            Error::BadPad { pad_count, len } => write!(
                f,
                "pad count {pad_count} inconsistent with {len} bytes of payload and pad"
            ),
            Error::UnexpectedPayload { len } => {
                write!(f, "{len} payload bytes on an opcode that carries none")
            }
            Error::BadSyndrome(s) => write!(f, "reserved AETH syndrome {s:#04x}"),
            Error::MissingHeader(h) => write!(f, "opcode requires a {h} header"),
            Error::UnexpectedHeader(h) => write!(f, "opcode does not carry a {h} header"),
            Error::FieldOutOfRange { field, value } => {
                write!(f, "{field} value {value:#x} does not fit its wire field")
            }
        }
    }
}

impl std::error::Error for Error {}

/// `Result` specialised to this crate's [`Error`].
pub type Result<T> = core::result::Result<T, Error>;
