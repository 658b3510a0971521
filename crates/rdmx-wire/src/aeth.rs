//! ACK Extended Transport Header (IBTA vol. 1, §9.3.5), 4 bytes.

use core::fmt;
use core::time::Duration;

use crate::error::{Error, Result};
use crate::field::{get_u24, header_view, put_u24};

/// Length of the AETH in bytes.
pub const AETH_LEN: usize = 4;

/// Mask of the 24-bit MSN field.
pub const MSN_MASK: u32 = 0x00FF_FFFF;

const TYPE_MASK: u8 = 0xE0;
const VALUE_MASK: u8 = 0x1F;
const TYPE_ACK: u8 = 0x00;
const TYPE_RNR_NAK: u8 = 0x20;
const TYPE_NAK: u8 = 0x60;

/// Credit counts for credit codes 0..=30 (IBTA vol. 1, AETH credit-count
/// encoding).
const CREDIT_COUNTS: [u16; 31] = [
    0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536,
    2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768,
];

/// RNR NAK timer values in microseconds, indexed by code (IBTA vol. 1 RNR
/// NAK timer encoding; identical to `ibv_modify_qp(3)`'s `min_rnr_timer`
/// table and the kernel's `IB_RNR_TIMER_*` constants). Code 0 is the
/// *longest* delay.
const RNR_MICROS: [u32; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560, 3_840,
    5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840,
    245_760, 327_680, 491_520,
];

/// End-to-end flow-control credits advertised in an ACK syndrome: a 5-bit
/// code standing for a (logarithmically spaced) count of receive WQEs.
///
/// Code 31 means "invalid": the responder advertises no credit limit
/// (the requester may ignore end-to-end flow control, as for SRQ-attached
/// or credit-less QPs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Credits(u8);

impl Credits {
    /// Code 31: no credit count ("invalid" in the IBTA table).
    pub const UNLIMITED: Credits = Credits(31);

    /// Wraps a 5-bit credit code; `None` if `code > 31`.
    pub const fn from_code(code: u8) -> Option<Credits> {
        if code <= VALUE_MASK {
            Some(Credits(code))
        } else {
            None
        }
    }

    /// The largest code whose credit count is `<= n` (so never advertising
    /// more than `n`); counts above 32768 saturate at code 30.
    pub fn from_count(n: u32) -> Credits {
        // The table ascends from 0, so at least its first entry is ≤ n.
        let code = CREDIT_COUNTS.partition_point(|&c| u32::from(c) <= n) - 1;
        Credits(code as u8)
    }

    /// The 5-bit code.
    pub const fn code(self) -> u8 {
        self.0
    }

    /// The credit count, or `None` for [`Credits::UNLIMITED`].
    pub const fn count(self) -> Option<u32> {
        if self.0 as usize >= CREDIT_COUNTS.len() {
            None
        } else {
            Some(CREDIT_COUNTS[self.0 as usize] as u32)
        }
    }

    /// True for code 31.
    pub const fn is_unlimited(self) -> bool {
        self.0 == Self::UNLIMITED.0
    }
}

/// Receiver-Not-Ready NAK timer: a 5-bit code for the minimum delay the
/// requester must wait before retrying.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RnrTimer(u8);

impl RnrTimer {
    /// Wraps a 5-bit timer code; `None` if `code > 31`.
    pub const fn from_code(code: u8) -> Option<RnrTimer> {
        if code <= VALUE_MASK {
            Some(RnrTimer(code))
        } else {
            None
        }
    }

    /// The timer code with the shortest delay that is at least `us`
    /// microseconds; delays above 655.36 ms saturate at code 0 (the longest).
    pub fn at_least_micros(us: u32) -> RnrTimer {
        // Codes 1..=31 are ascending; code 0 is the maximum.
        (1..=31u8)
            .find(|&c| RNR_MICROS[c as usize] >= us)
            .map_or(RnrTimer(0), RnrTimer)
    }

    /// The 5-bit code.
    pub const fn code(self) -> u8 {
        self.0
    }

    /// The delay in microseconds (code 0 = 655 360 µs, 1 = 10 µs, …,
    /// 31 = 491 520 µs).
    pub const fn to_micros(self) -> u32 {
        RNR_MICROS[(self.0 & VALUE_MASK) as usize]
    }

    /// The delay as a [`Duration`].
    pub const fn to_duration(self) -> Duration {
        Duration::from_micros(self.to_micros() as u64)
    }
}

/// NAK codes (syndrome `011xxxxx`). Codes 5..=31 are
/// reserved and rejected on parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum NakCode {
    /// PSN sequence error: the responder expected an earlier PSN.
    PsnSequenceError = 0,
    /// Invalid request (unsupported opcode, bad length, …).
    InvalidRequest = 1,
    /// Remote access error (R_Key / bounds / permission violation).
    RemoteAccessError = 2,
    /// Remote operational error (responder could not complete).
    RemoteOperationalError = 3,
    /// Invalid RD request (reliable datagram only).
    InvalidRdRequest = 4,
}

impl NakCode {
    /// Decodes a 5-bit NAK code; `None` for reserved codes.
    pub const fn from_code(code: u8) -> Option<NakCode> {
        match code {
            0 => Some(NakCode::PsnSequenceError),
            1 => Some(NakCode::InvalidRequest),
            2 => Some(NakCode::RemoteAccessError),
            3 => Some(NakCode::RemoteOperationalError),
            4 => Some(NakCode::InvalidRdRequest),
            _ => None,
        }
    }

    /// The 5-bit code.
    pub const fn code(self) -> u8 {
        self as u8
    }
}

impl fmt::Display for NakCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NakCode::PsnSequenceError => "PSN sequence error",
            NakCode::InvalidRequest => "invalid request",
            NakCode::RemoteAccessError => "remote access error",
            NakCode::RemoteOperationalError => "remote operational error",
            NakCode::InvalidRdRequest => "invalid RD request",
        })
    }
}

/// The decoded AETH syndrome byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Syndrome {
    /// Positive acknowledgement with an end-to-end credit advertisement.
    Ack {
        /// Credits advertised.
        credits: Credits,
    },
    /// Receiver not ready: retry after the timer.
    RnrNak {
        /// Minimum delay before retrying.
        timer: RnrTimer,
    },
    /// Negative acknowledgement.
    Nak(NakCode),
}

impl Syndrome {
    /// Decodes a syndrome byte; reserved encodings yield
    /// [`Error::BadSyndrome`].
    pub const fn from_byte(b: u8) -> Result<Syndrome> {
        let value = b & VALUE_MASK;
        match b & TYPE_MASK {
            TYPE_ACK => Ok(Syndrome::Ack {
                credits: Credits(value),
            }),
            TYPE_RNR_NAK => Ok(Syndrome::RnrNak {
                timer: RnrTimer(value),
            }),
            TYPE_NAK => match NakCode::from_code(value) {
                Some(code) => Ok(Syndrome::Nak(code)),
                None => Err(Error::BadSyndrome(b)),
            },
            _ => Err(Error::BadSyndrome(b)),
        }
    }

    /// Encodes the syndrome byte.
    pub const fn to_byte(self) -> u8 {
        match self {
            Syndrome::Ack { credits } => TYPE_ACK | credits.0,
            Syndrome::RnrNak { timer } => TYPE_RNR_NAK | timer.0,
            Syndrome::Nak(code) => TYPE_NAK | code as u8,
        }
    }

    /// True for a positive ACK.
    pub const fn is_ack(self) -> bool {
        matches!(self, Syndrome::Ack { .. })
    }
}

impl fmt::Display for Syndrome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Syndrome::Ack { credits } => match credits.count() {
                Some(n) => write!(f, "ACK ({n} credits)"),
                None => f.write_str("ACK (no credit limit)"),
            },
            Syndrome::RnrNak { timer } => write!(f, "RNR NAK ({} us)", timer.to_micros()),
            Syndrome::Nak(code) => write!(f, "NAK ({code})"),
        }
    }
}

header_view! {
    /// A read/write view of an ACK Extended Transport Header (4 bytes).
    ///
    /// ```text
    ///  0                   1                   2                   3
    ///  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
    /// +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
    /// |0| Typ |  Value  |                      MSN                      |
    /// +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
    /// ```
    ///
    /// The syndrome byte's top three bits select the kind:
    /// `000` ACK (value = credit-count code), `001` RNR NAK (value = RNR timer
    /// code), `011` NAK (value = NAK code). `010` and every pattern with the
    /// top (reserved) bit set are reserved and rejected with
    /// [`Error::BadSyndrome`]. MSN is the responder's 24-bit Message Sequence
    /// Number.
    Aeth, AETH_LEN
}

impl<T: AsRef<[u8]>> Aeth<T> {
    /// Raw syndrome byte.
    pub fn syndrome_raw(&self) -> u8 {
        self.buffer.as_ref()[0]
    }

    /// Decoded syndrome; [`Error::BadSyndrome`] for reserved encodings.
    pub fn syndrome(&self) -> Result<Syndrome> {
        Syndrome::from_byte(self.syndrome_raw())
    }

    /// Message sequence number (24 bits).
    pub fn msn(&self) -> u32 {
        get_u24(self.buffer.as_ref(), 1)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Aeth<T> {
    /// Sets the syndrome.
    pub fn set_syndrome(&mut self, s: Syndrome) {
        self.set_syndrome_raw(s.to_byte());
    }

    /// Sets the raw syndrome byte.
    pub fn set_syndrome_raw(&mut self, b: u8) {
        self.buffer.as_mut()[0] = b;
    }

    /// Sets the MSN; bits above 24 are discarded.
    pub fn set_msn(&mut self, v: u32) {
        put_u24(self.buffer.as_mut(), 1, v);
    }
}

/// Plain-data form of an AETH.
///
/// `msn` is a 24-bit quantity: [`AethRepr::check`] reports larger values
/// and [`AethRepr::emit`] `debug_assert!`s and masks them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AethRepr {
    /// ACK / RNR NAK / NAK and its 5-bit argument.
    pub syndrome: Syndrome,
    /// Message sequence number, `< 2^24`.
    pub msn: u32,
}

impl AethRepr {
    /// Parses an AETH view.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &Aeth<&T>) -> Result<AethRepr> {
        packet.check_len()?;
        Ok(AethRepr {
            syndrome: packet.syndrome()?,
            msn: packet.msn(),
        })
    }

    /// Checks that `msn` fits 24 bits.
    pub fn check(&self) -> Result<()> {
        if self.msn > MSN_MASK {
            return Err(Error::FieldOutOfRange {
                field: "msn",
                value: self.msn.into(),
            });
        }
        Ok(())
    }

    /// Length of the emitted header: [`AETH_LEN`].
    pub const fn buffer_len(&self) -> usize {
        AETH_LEN
    }

    /// Writes the 4 header bytes.
    ///
    /// # Panics
    /// If the view was built with `new_unchecked` over fewer than
    /// [`AETH_LEN`] bytes.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]> + ?Sized>(&self, packet: &mut Aeth<&mut T>) {
        debug_assert_eq!(self.check(), Ok(()), "AethRepr field out of range");
        packet.set_syndrome(self.syndrome);
        packet.set_msn(self.msn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aeth_known_bytes() {
        // ACK, 16 credits (code 8), MSN 0x010203.
        let bytes = [0x08, 0x01, 0x02, 0x03];
        let repr = AethRepr {
            syndrome: Syndrome::Ack {
                credits: Credits::from_count(16),
            },
            msn: 0x01_0203,
        };
        let v = Aeth::new_checked(&bytes[..]).unwrap();
        assert_eq!(AethRepr::parse(&v), Ok(repr));
        let mut out = [0xFFu8; 4];
        repr.emit(&mut Aeth::new_checked(&mut out[..]).unwrap());
        assert_eq!(out, bytes);

        // RNR NAK 0.64 ms (code 12), MSN 0xFFFFFF.
        let bytes = [0x2C, 0xFF, 0xFF, 0xFF];
        let repr = AethRepr {
            syndrome: Syndrome::RnrNak {
                timer: RnrTimer::from_code(12).unwrap(),
            },
            msn: 0xFF_FFFF,
        };
        assert_eq!(AethRepr::parse(&Aeth::new_unchecked(&bytes[..])), Ok(repr));
        let mut out = [0u8; 4];
        repr.emit(&mut Aeth::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);

        // NAK remote access error.
        let bytes = [0x62, 0x00, 0x00, 0x07];
        let repr = AethRepr {
            syndrome: Syndrome::Nak(NakCode::RemoteAccessError),
            msn: 7,
        };
        assert_eq!(AethRepr::parse(&Aeth::new_unchecked(&bytes[..])), Ok(repr));
        let mut out = [0u8; 4];
        repr.emit(&mut Aeth::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
    }

    #[test]
    fn aeth_every_syndrome_byte() {
        let mut accepted = 0;
        for b in 0..=255u8 {
            match Syndrome::from_byte(b) {
                Ok(s) => {
                    accepted += 1;
                    assert_eq!(s.to_byte(), b, "{s:?}");
                    match s {
                        Syndrome::Ack { credits } => {
                            assert_eq!(b >> 5, 0b000);
                            assert_eq!(credits.code(), b & 0x1F);
                        }
                        Syndrome::RnrNak { timer } => {
                            assert_eq!(b >> 5, 0b001);
                            assert_eq!(timer.code(), b & 0x1F);
                        }
                        Syndrome::Nak(code) => {
                            assert_eq!(b >> 5, 0b011);
                            assert_eq!(code.code(), b & 0x1F);
                            assert!(code.code() <= 4);
                        }
                    }
                }
                Err(e) => {
                    assert_eq!(e, Error::BadSyndrome(b));
                    let reserved_nak = b >> 5 == 0b011 && b & 0x1F > 4;
                    assert!(reserved_nak || b >> 5 == 0b010 || b & 0x80 != 0, "{b:#x}");
                }
            }
        }
        // 32 ACK + 32 RNR NAK + 5 NAK codes.
        assert_eq!(accepted, 69);
    }

    #[test]
    fn aeth_nak_codes() {
        let cases = [
            (NakCode::PsnSequenceError, 0x60),
            (NakCode::InvalidRequest, 0x61),
            (NakCode::RemoteAccessError, 0x62),
            (NakCode::RemoteOperationalError, 0x63),
            (NakCode::InvalidRdRequest, 0x64),
        ];
        for (code, byte) in cases {
            assert_eq!(Syndrome::Nak(code).to_byte(), byte);
            assert_eq!(Syndrome::from_byte(byte), Ok(Syndrome::Nak(code)));
            assert_eq!(NakCode::from_code(code.code()), Some(code));
        }
        for c in 5..=31 {
            assert_eq!(NakCode::from_code(c), None);
            assert_eq!(
                Syndrome::from_byte(0x60 | c),
                Err(Error::BadSyndrome(0x60 | c))
            );
        }
        assert_eq!(
            Syndrome::Nak(NakCode::PsnSequenceError).to_string(),
            "NAK (PSN sequence error)"
        );
    }

    #[test]
    fn aeth_every_credit_code() {
        let expected: [Option<u32>; 32] = [
            Some(0),
            Some(1),
            Some(2),
            Some(3),
            Some(4),
            Some(6),
            Some(8),
            Some(12),
            Some(16),
            Some(24),
            Some(32),
            Some(48),
            Some(64),
            Some(96),
            Some(128),
            Some(192),
            Some(256),
            Some(384),
            Some(512),
            Some(768),
            Some(1024),
            Some(1536),
            Some(2048),
            Some(3072),
            Some(4096),
            Some(6144),
            Some(8192),
            Some(12288),
            Some(16384),
            Some(24576),
            Some(32768),
            None,
        ];
        for (code, count) in expected.iter().enumerate() {
            let c = Credits::from_code(code as u8).unwrap();
            assert_eq!(c.code(), code as u8);
            assert_eq!(c.count(), *count, "code {code}");
            assert_eq!(c.is_unlimited(), code == 31);
            let s = Syndrome::Ack { credits: c };
            assert_eq!(s.to_byte(), code as u8);
            assert_eq!(Syndrome::from_byte(code as u8), Ok(s));
            if let Some(n) = count {
                // An exact count maps back to its code; one less maps lower.
                assert_eq!(Credits::from_count(*n), c);
                if code > 0 {
                    assert_eq!(Credits::from_count(n - 1).code(), code as u8 - 1);
                }
            }
        }
        assert_eq!(Credits::from_code(32), None);
        assert_eq!(Credits::from_count(5).count(), Some(4));
        assert_eq!(Credits::from_count(100).count(), Some(96));
        assert_eq!(Credits::from_count(32_767).count(), Some(24_576));
        assert_eq!(Credits::from_count(u32::MAX).code(), 30);
        assert_eq!(Credits::UNLIMITED.count(), None);
        assert_eq!(
            Syndrome::Ack {
                credits: Credits::UNLIMITED
            }
            .to_byte(),
            0x1F
        );
    }

    #[test]
    fn aeth_every_rnr_timer_code() {
        // Milliseconds * 100 from the IBTA RNR timer table / ibv_modify_qp(3).
        let centi_ms: [u32; 32] = [
            65536, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768,
            1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152,
        ];
        for (code, cms) in centi_ms.iter().enumerate() {
            let t = RnrTimer::from_code(code as u8).unwrap();
            assert_eq!(t.code(), code as u8);
            assert_eq!(t.to_micros(), cms * 10, "code {code}");
            assert_eq!(t.to_duration(), Duration::from_micros(u64::from(cms * 10)));
            let s = Syndrome::RnrNak { timer: t };
            assert_eq!(s.to_byte(), 0x20 | code as u8);
            assert_eq!(Syndrome::from_byte(0x20 | code as u8), Ok(s));
            assert_eq!(RnrTimer::at_least_micros(t.to_micros()), t);
        }
        assert_eq!(RnrTimer::from_code(32), None);
        assert_eq!(RnrTimer::at_least_micros(0).code(), 1);
        assert_eq!(RnrTimer::at_least_micros(11).to_micros(), 20);
        assert_eq!(RnrTimer::at_least_micros(491_521).code(), 0);
        assert_eq!(RnrTimer::at_least_micros(u32::MAX).code(), 0);
    }

    #[test]
    fn aeth_msn_range_and_truncation() {
        let r = AethRepr {
            syndrome: Syndrome::Ack {
                credits: Credits::UNLIMITED,
            },
            msn: 1 << 24,
        };
        assert_eq!(
            r.check(),
            Err(Error::FieldOutOfRange {
                field: "msn",
                value: 1 << 24
            })
        );
        let bytes = [0u8; 4];
        for n in 0..AETH_LEN {
            assert_eq!(
                Aeth::new_checked(&bytes[..n]),
                Err(Error::Truncated { need: 4, have: n })
            );
            assert!(AethRepr::parse(&Aeth::new_unchecked(&bytes[..n])).is_err());
        }
        assert_eq!(
            AethRepr::parse(&Aeth::new_unchecked(&[0x40u8, 0, 0, 0][..])),
            Err(Error::BadSyndrome(0x40))
        );
    }
}
