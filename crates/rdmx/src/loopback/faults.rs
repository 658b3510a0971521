//! Fault injection for the loopback provider: packets dropped, delayed, duplicated,
//! reordered or corrupted between the RC engines, so tests drive the engine through
//! retransmission, duplicate detection, sequence-error recovery and error completion.
//!
//! A context opened with [`Options::faults`](super::Options::faults) applies [`Faults`]
//! to every packet its queue pairs send. Each queue pair draws from its own
//! deterministic generator (seeded from [`Faults::seed`] and its QP number), so a failing
//! run can be repeated. What happened is counted in [`FaultStats`]
//! ([`fault_stats`](super::fault_stats)).
//!
//! The loopback path carries whole IBTA RC packets, which have no integrity check of their
//! own (on RoCE the ICRC provides it, on tcp the stream does). Two kinds of corruption are
//! offered, and neither pretends the engine can spot a flipped payload bit by itself:
//!
//! - [`Faults::corrupt`] flips one random bit anywhere in the packet after a CRC-32 over
//!   the packet was taken, as a link flips bits after the sender computed its ICRC. The
//!   receiving side checks the CRC like an adapter checks the ICRC, and drops the packet:
//!   corruption becomes loss, which the engine must recover from.
//! - [`Faults::mangle`] breaks the packet's headers so that they cannot parse (a reserved
//!   opcode, a cut inside the headers, a reserved AETH syndrome) and hands it to the engine
//!   unchecked: the engine itself must reject it, never place it.
//!
//! Rates are in parts per million of packets sent.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Parts per million: the unit of every rate in [`Faults`].
pub const PPM: u32 = 1_000_000;

/// What a loopback context does to the packets its queue pairs send.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Faults {
    /// Seed of the per-QP generators.
    pub seed: u64,
    /// Packets lost.
    pub drop: u32,
    /// Packets delivered twice.
    pub duplicate: u32,
    /// Packets held back and delivered after the QP's next packet.
    pub reorder: u32,
    /// Packets delivered [`delay_by`](Self::delay_by) late.
    pub delay: u32,
    /// How late a delayed packet arrives.
    pub delay_by: Duration,
    /// Packets with one bit flipped after their CRC was taken; dropped by the check.
    pub corrupt: u32,
    /// Packets whose headers are made unparseable and delivered to the engine.
    pub mangle: u32,
}

impl Faults {
    /// No faults, generators seeded with `seed`.
    pub fn seeded(seed: u64) -> Faults {
        Faults {
            seed,
            ..Faults::default()
        }
    }
    /// Sets [`drop`](Self::drop).
    pub fn drop(mut self, ppm: u32) -> Self {
        self.drop = ppm;
        self
    }
    /// Sets [`duplicate`](Self::duplicate).
    pub fn duplicate(mut self, ppm: u32) -> Self {
        self.duplicate = ppm;
        self
    }
    /// Sets [`reorder`](Self::reorder).
    pub fn reorder(mut self, ppm: u32) -> Self {
        self.reorder = ppm;
        self
    }
    /// Sets [`delay`](Self::delay) and [`delay_by`](Self::delay_by).
    pub fn delay(mut self, ppm: u32, by: Duration) -> Self {
        self.delay = ppm;
        self.delay_by = by;
        self
    }
    /// Sets [`corrupt`](Self::corrupt).
    pub fn corrupt(mut self, ppm: u32) -> Self {
        self.corrupt = ppm;
        self
    }
    /// Sets [`mangle`](Self::mangle).
    pub fn mangle(mut self, ppm: u32) -> Self {
        self.mangle = ppm;
        self
    }

    /// Parses [`FAULTS_ENV`](super::FAULTS_ENV)'s value: comma-separated `KIND=PPM` for
    /// `drop`, `duplicate`, `reorder`, `corrupt` and `mangle`, `delay=PPM@MICROS`, and
    /// `seed=N`.
    pub(crate) fn parse(spec: &str) -> Result<Faults, String> {
        let mut f = Faults::default();
        for item in spec.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (kind, value) = item
                .split_once('=')
                .ok_or_else(|| format!("`{item}` is not KIND=VALUE"))?;
            let ppm = |v: &str| -> Result<u32, String> {
                v.parse::<u32>()
                    .ok()
                    .filter(|&n| n <= PPM)
                    .ok_or_else(|| format!("{kind}: `{v}` is not a rate of 0 to {PPM} ppm"))
            };
            match kind.trim() {
                "seed" => {
                    f.seed = value
                        .parse()
                        .map_err(|_| format!("seed: `{value}` is not a number"))?
                }
                "drop" => f.drop = ppm(value)?,
                "duplicate" => f.duplicate = ppm(value)?,
                "reorder" => f.reorder = ppm(value)?,
                "corrupt" => f.corrupt = ppm(value)?,
                "mangle" => f.mangle = ppm(value)?,
                "delay" => {
                    let (rate, us) = value
                        .split_once('@')
                        .ok_or_else(|| format!("delay: `{value}` is not PPM@MICROS"))?;
                    f.delay = ppm(rate)?;
                    f.delay_by = Duration::from_micros(
                        us.parse()
                            .map_err(|_| format!("delay: `{us}` is not microseconds"))?,
                    );
                }
                other => {
                    return Err(format!(
                        "unknown fault `{other}` (drop, duplicate, reorder, corrupt, mangle, \
                         delay, seed)"
                    ))
                }
            }
        }
        Ok(f)
    }
}

/// What a context's fault injection did so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct FaultStats {
    /// Packets its queue pairs sent.
    pub packets: u64,
    /// Packets dropped.
    pub dropped: u64,
    /// Packets delivered twice.
    pub duplicated: u64,
    /// Packets delivered after a later one.
    pub reordered: u64,
    /// Packets delivered late.
    pub delayed: u64,
    /// Packets corrupted and dropped by the CRC check.
    pub corrupted: u64,
    /// Packets delivered with unparseable headers.
    pub mangled: u64,
}

/// A context's fault configuration and counters.
#[derive(Debug)]
pub(crate) struct Injector {
    cfg: Faults,
    counts: [AtomicU64; 7],
}

const PACKETS: usize = 0;
const DROPPED: usize = 1;
const DUPLICATED: usize = 2;
const REORDERED: usize = 3;
const DELAYED: usize = 4;
const CORRUPTED: usize = 5;
const MANGLED: usize = 6;

impl Injector {
    pub(crate) fn new(cfg: Faults) -> Injector {
        Injector {
            cfg,
            counts: Default::default(),
        }
    }

    fn count(&self, what: usize) {
        self.counts[what].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn stats(&self) -> FaultStats {
        let c = |i: usize| self.counts[i].load(Ordering::Relaxed);
        FaultStats {
            packets: c(PACKETS),
            dropped: c(DROPPED),
            duplicated: c(DUPLICATED),
            reordered: c(REORDERED),
            delayed: c(DELAYED),
            corrupted: c(CORRUPTED),
            mangled: c(MANGLED),
        }
    }

    /// A generator for queue pair `qpn`.
    pub(crate) fn rng(&self, qpn: u32) -> Rng {
        Rng(splitmix(self.cfg.seed ^ (u64::from(qpn) << 32)) | 1)
    }
}

/// A packet on its way: its destination, bytes and, when corruption is on, the CRC the
/// sender took.
#[derive(Debug)]
pub(crate) struct Wire {
    pub(crate) dest: u32,
    pub(crate) bytes: Vec<u8>,
    crc: Option<u32>,
}

impl Wire {
    /// A packet as the fabric carries it without faults.
    pub(crate) fn plain(dest: u32, bytes: Vec<u8>) -> Wire {
        Wire {
            dest,
            bytes,
            crc: None,
        }
    }

    /// Whether the packet passes its CRC check (always, without one). A failed check is
    /// counted against `inj`.
    pub(crate) fn intact(&self, inj: Option<&Injector>) -> bool {
        match self.crc {
            Some(c) if c != crc32(&self.bytes) => {
                if let Some(i) = inj {
                    i.count(CORRUPTED);
                }
                false
            }
            _ => true,
        }
    }
}

/// Where the fabric should put a packet after the faults.
#[derive(Debug, Default)]
pub(crate) struct Fate {
    /// Deliver now (zero, one or two copies).
    pub(crate) now: Vec<Wire>,
    /// Deliver at the instant given.
    pub(crate) later: Option<(Instant, Wire)>,
    /// Hold back until the QP sends its next packet.
    pub(crate) hold: Option<Wire>,
}

/// A queue pair's fault state: its generator.
#[derive(Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// True with probability `ppm` parts per million.
    fn chance(&mut self, ppm: u32) -> bool {
        ppm > 0 && (self.next() % u64::from(PPM)) < u64::from(ppm)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Decides what happens to `bytes`, sent to `dest` at `now`.
pub(crate) fn apply(
    inj: &Injector,
    rng: &mut Rng,
    now: Instant,
    dest: u32,
    bytes: Vec<u8>,
) -> Fate {
    let cfg = &inj.cfg;
    inj.count(PACKETS);
    let mut fate = Fate::default();
    if rng.chance(cfg.drop) {
        inj.count(DROPPED);
        return fate;
    }
    let mut w = Wire {
        dest,
        crc: (cfg.corrupt > 0).then(|| crc32(&bytes)),
        bytes,
    };
    if rng.chance(cfg.corrupt) && !w.bytes.is_empty() {
        // Counted when the receiving side's check drops it.
        let bit = rng.below(w.bytes.len() * 8);
        w.bytes[bit / 8] ^= 1 << (bit % 8);
    } else if rng.chance(cfg.mangle) {
        mangle(rng, &mut w.bytes);
        // A sender that builds bad headers computes its CRC over them: the packet reaches
        // the engine, which must refuse it itself.
        if w.crc.is_some() {
            w.crc = Some(crc32(&w.bytes));
        }
        inj.count(MANGLED);
    }
    if rng.chance(cfg.duplicate) {
        inj.count(DUPLICATED);
        fate.now.push(Wire {
            dest,
            bytes: w.bytes.clone(),
            crc: w.crc,
        });
    }
    if rng.chance(cfg.delay) {
        inj.count(DELAYED);
        fate.later = Some((now + cfg.delay_by, w));
    } else if rng.chance(cfg.reorder) {
        inj.count(REORDERED);
        fate.hold = Some(w);
    } else {
        fate.now.push(w);
    }
    fate
}

/// Makes a packet's headers unparseable.
fn mangle(rng: &mut Rng, p: &mut Vec<u8>) {
    use rdmx_wire::Opcode;
    let op = p.first().and_then(|&b| Opcode::try_from(b).ok());
    match (rng.below(3), op) {
        // A syndrome of the reserved type (binary 10) in an acknowledgement's AETH.
        (0, Some(op)) if op.has_aeth() && p.len() > rdmx_wire::BTH_LEN => {
            let at = rdmx_wire::BTH_LEN;
            p[at] = (p[at] & 0x9F) | 0x40;
        }
        // Cut inside the headers.
        (1, Some(op)) => p.truncate(rng.below(op.header_len())),
        // An opcode no transport defines: reserved in RC's range (0x00..=0x1F), UC's
        // (0x20..=0x3F) and UD's (0x60..=0x7F), or a manufacturer's (0xC0..). (UC and UD
        // packets are mangled this way only.)
        _ => {
            let reserved = [0x19u8, 0x1A, 0x1F, 0x3F, 0x7F, 0xFF];
            if let Some(b) = p.first_mut() {
                *b = reserved[rng.below(reserved.len())];
            }
        }
    }
    debug_assert!(!parses(p), "a mangled packet still parses");
}

/// Whether `p` parses as an RC, UC or UD packet (a UC one by its opcode: the rest of its
/// headers are RC's).
fn parses(p: &[u8]) -> bool {
    rdmx_wire::RcRepr::parse_bytes(p).is_ok()
        || rdmx_wire::UdRepr::parse_bytes(p).is_ok()
        || p.first().is_some_and(|&b| {
            b & rdmx_wire::SERVICE_MASK == rdmx_wire::UC_PREFIX && rdmx_wire::uc_to_rc(b).is_some()
        })
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// CRC-32 (IEEE, reflected), the polynomial of the IBTA ICRC.
fn crc32(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = (c >> 1) ^ (0xEDB8_8320 & (c & 1).wrapping_neg());
        }
    }
    !c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_spec_parses_and_a_bad_one_says_why() {
        let f = Faults::parse("drop=2000, seed=7,delay=10@150,reorder=5").expect("valid");
        assert_eq!(
            (f.drop, f.seed, f.delay, f.delay_by, f.reorder, f.duplicate),
            (2000, 7, 10, Duration::from_micros(150), 5, 0)
        );
        assert_eq!(Faults::parse("").expect("empty"), Faults::default());
        for (bad, says) in [
            ("drop", "KIND=VALUE"),
            ("drop=1000001", "0 to 1000000"),
            ("drop=-1", "0 to 1000000"),
            ("delay=10", "PPM@MICROS"),
            ("seed=x", "not a number"),
            ("lose=5", "unknown fault `lose`"),
        ] {
            let e = Faults::parse(bad).expect_err(bad);
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn crc32_matches_the_standard_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn every_single_bit_flip_fails_the_check() {
        let bytes: Vec<u8> = (0..64u8).collect();
        let crc = Some(crc32(&bytes));
        for bit in 0..bytes.len() * 8 {
            let mut w = Wire {
                dest: 0,
                bytes: bytes.clone(),
                crc,
            };
            w.bytes[bit / 8] ^= 1 << (bit % 8);
            assert!(!w.intact(None), "bit {bit}");
        }
    }

    #[test]
    fn mangled_packets_never_parse() {
        use rdmx_wire::{BthRepr, Opcode, RcRepr};
        let inj = Injector::new(Faults::seeded(1).mangle(PPM));
        let mut rng = inj.rng(0x11);
        for op in Opcode::ALL {
            let mut r = RcRepr::new(BthRepr {
                opcode: op,
                solicited: false,
                migreq: false,
                pad_count: 0,
                pkey: 0xffff,
                fecn: false,
                becn: false,
                dest_qpn: 0x12,
                ack_req: false,
                psn: 5,
            });
            r.reth = op.has_reth().then_some(rdmx_wire::RethRepr {
                va: 0,
                rkey: 0,
                dma_len: 0,
            });
            r.atomic_eth = op.has_atomic_eth().then_some(rdmx_wire::AtomicEthRepr {
                va: 0,
                rkey: 0,
                swap_add: 0,
                compare: 0,
            });
            r.aeth = op.has_aeth().then_some(rdmx_wire::AethRepr {
                syndrome: rdmx_wire::Syndrome::Ack {
                    credits: rdmx_wire::Credits::UNLIMITED,
                },
                msn: 0,
            });
            r.atomic_ack_eth = op
                .has_atomic_ack_eth()
                .then_some(rdmx_wire::AtomicAckEthRepr { orig_data: 0 });
            r.immdt = op.has_immdt().then_some(rdmx_wire::ImmDtRepr { imm: 0 });
            r.ieth = op.has_ieth().then_some(rdmx_wire::IethRepr { rkey: 0 });
            let payload = [7u8; 16];
            if op.has_payload() {
                r.payload = &payload;
            }
            let mut buf = vec![0u8; r.buffer_len()];
            r.emit_with_payload(&mut buf).expect("emit");
            for _ in 0..50 {
                let mut p = buf.clone();
                mangle(&mut rng, &mut p);
                assert!(!parses(&p), "{op}: {p:02x?}");
            }
        }
        // UD and UC packets too: a UD SEND with immediate data, a UC SEND MIDDLE.
        let mut ud = vec![0x65u8, 0, 0xff, 0xff, 0, 0, 0, 0x12, 0, 0, 0, 5];
        ud.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 2]); // DETH
        ud.extend_from_slice(&[0, 0, 0, 9]); // ImmDt
        ud.extend_from_slice(&[7u8; 16]);
        assert!(rdmx_wire::UdRepr::parse_bytes(&ud).is_ok());
        let mut uc = vec![0x21u8, 0, 0xff, 0xff, 0, 0, 0, 0x12, 0, 0, 0, 5];
        uc.extend_from_slice(&[7u8; 16]);
        assert!(parses(&uc));
        for buf in [ud, uc] {
            for _ in 0..50 {
                let mut p = buf.clone();
                mangle(&mut rng, &mut p);
                assert!(!parses(&p), "{p:02x?}");
            }
        }
    }
}
