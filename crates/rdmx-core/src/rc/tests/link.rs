//! Simulated one-way links for the engine harness: a seeded generator, decoded packets,
//! and links with latency, loss, duplication, reordering and scripted faults.

use std::fmt;
use std::time::{Duration, Instant};

use rdmx_wire as wire;

// ---------------------------------------------------------------------------------------
// Randomness
// ---------------------------------------------------------------------------------------

/// xorshift64*: small, seeded, good enough for fault injection.
#[derive(Clone, Debug)]
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn new(seed: u64) -> Self {
        // Never zero.
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub(super) fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub(super) fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// True with probability `p`.
    pub(super) fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}

// ---------------------------------------------------------------------------------------
// Packets and links
// ---------------------------------------------------------------------------------------

/// A packet as seen on a link, decoded with `rdmx_wire`.
#[derive(Clone, Debug)]
pub(super) struct Pkt {
    /// Index on its link, counting from 0.
    pub(super) n: usize,
    /// When it was put on the link.
    pub(super) at: Instant,
    pub(super) op: wire::Opcode,
    pub(super) psn: u32,
    pub(super) ack_req: bool,
    pub(super) syndrome: Option<wire::Syndrome>,
    pub(super) msn: Option<u32>,
    pub(super) reth: Option<wire::RethRepr>,
    pub(super) atomic_orig: Option<u64>,
    /// Payload bytes.
    pub(super) len: usize,
    pub(super) bytes: Vec<u8>,
}

impl Pkt {
    fn decode(n: usize, at: Instant, bytes: Vec<u8>) -> Pkt {
        let r = wire::RcRepr::parse_bytes(&bytes).expect("engine emitted a malformed packet");
        Pkt {
            n,
            at,
            op: r.bth.opcode,
            psn: r.bth.psn,
            ack_req: r.bth.ack_req,
            syndrome: r.aeth.map(|a| a.syndrome),
            msn: r.aeth.map(|a| a.msn),
            reth: r.reth,
            atomic_orig: r.atomic_ack_eth.map(|a| a.orig_data),
            len: r.payload.len(),
            bytes: bytes.clone(),
        }
    }

    /// A request (from a requester), not a response.
    pub(super) fn is_request(&self) -> bool {
        use wire::Opcode::*;
        !matches!(
            self.op,
            Acknowledge
                | AtomicAcknowledge
                | RdmaReadResponseFirst
                | RdmaReadResponseMiddle
                | RdmaReadResponseLast
                | RdmaReadResponseOnly
        )
    }

    /// A plain positive ACK (ACKNOWLEDGE with an ACK syndrome).
    pub(super) fn is_ack(&self) -> bool {
        self.op == wire::Opcode::Acknowledge
            && matches!(self.syndrome, Some(wire::Syndrome::Ack { .. }))
    }

    /// Any NAK (including RNR NAKs).
    pub(super) fn is_nak(&self) -> bool {
        self.op == wire::Opcode::Acknowledge
            && matches!(
                self.syndrome,
                Some(wire::Syndrome::Nak(_) | wire::Syndrome::RnrNak { .. })
            )
    }

    pub(super) fn is_rnr_nak(&self) -> bool {
        matches!(self.syndrome, Some(wire::Syndrome::RnrNak { .. }))
            && self.op == wire::Opcode::Acknowledge
    }

    pub(super) fn is_seq_nak(&self) -> bool {
        self.op == wire::Opcode::Acknowledge
            && self.syndrome == Some(wire::Syndrome::Nak(wire::NakCode::PsnSequenceError))
    }

    pub(super) fn is_read_response(&self) -> bool {
        use wire::Opcode::*;
        matches!(
            self.op,
            RdmaReadResponseFirst
                | RdmaReadResponseMiddle
                | RdmaReadResponseLast
                | RdmaReadResponseOnly
        )
    }

    pub(super) fn is_read_request(&self) -> bool {
        self.op == wire::Opcode::RdmaReadRequest
    }

    pub(super) fn is_atomic_request(&self) -> bool {
        matches!(self.op, wire::Opcode::CompareSwap | wire::Opcode::FetchAdd)
    }

    pub(super) fn is_send(&self) -> bool {
        use wire::Opcode::*;
        matches!(
            self.op,
            SendFirst
                | SendMiddle
                | SendLast
                | SendLastWithImmediate
                | SendOnly
                | SendOnlyWithImmediate
        )
    }

    pub(super) fn is_write(&self) -> bool {
        use wire::Opcode::*;
        matches!(
            self.op,
            RdmaWriteFirst
                | RdmaWriteMiddle
                | RdmaWriteLast
                | RdmaWriteLastWithImmediate
                | RdmaWriteOnly
                | RdmaWriteOnlyWithImmediate
        )
    }

    /// First packet of a message (FIRST or ONLY, or a one-packet request).
    pub(super) fn starts(&self) -> bool {
        use wire::Opcode::*;
        matches!(
            self.op,
            SendFirst
                | SendOnly
                | SendOnlyWithImmediate
                | RdmaWriteFirst
                | RdmaWriteOnly
                | RdmaWriteOnlyWithImmediate
                | RdmaReadRequest
                | CompareSwap
                | FetchAdd
                | RdmaReadResponseFirst
                | RdmaReadResponseOnly
        )
    }

    /// Last packet of a message (LAST or ONLY, or a one-packet request).
    pub(super) fn ends(&self) -> bool {
        use wire::Opcode::*;
        matches!(
            self.op,
            SendLast
                | SendLastWithImmediate
                | SendOnly
                | SendOnlyWithImmediate
                | RdmaWriteLast
                | RdmaWriteLastWithImmediate
                | RdmaWriteOnly
                | RdmaWriteOnlyWithImmediate
                | RdmaReadRequest
                | CompareSwap
                | FetchAdd
                | RdmaReadResponseLast
                | RdmaReadResponseOnly
        )
    }

    /// The credit count of an ACK syndrome (`None`: no ACK or no limit).
    pub(super) fn credits(&self) -> Option<u32> {
        match self.syndrome {
            Some(wire::Syndrome::Ack { credits }) => credits.count(),
            _ => None,
        }
    }
}

/// What happens to a packet put on a link.
#[derive(Clone, Copy, Debug)]
pub(super) enum Fate {
    /// Arrives after the link's latency (and any random reordering delay).
    Deliver,
    /// Never arrives.
    Drop,
    /// Arrives twice.
    Duplicate,
    /// Arrives after the latency plus this.
    Delay(Duration),
    /// Arrives on time, and a second copy this much later.
    DupDelayed(Duration),
    /// Arrives on time, changed by this (a peer that sends what it should not).
    Altered(fn(&mut [u8])),
}

/// A scripted fault: sees each packet and may decide its fate (`None`: the link's random
/// behaviour decides).
pub(super) type Filter = Box<dyn FnMut(&Pkt) -> Option<Fate>>;

/// One direction of the simulated wire.
pub(super) struct Link {
    /// One-way delay.
    pub(super) latency: Duration,
    /// Probability that a packet is lost.
    pub(super) loss: f64,
    /// Probability that a packet arrives twice.
    pub(super) dup: f64,
    /// Probability that a packet gets an extra random delay of up to `jitter`, which
    /// reorders it behind later packets.
    pub(super) reorder: f64,
    pub(super) jitter: Duration,
    /// Probability that a packet also arrives a second time, `late_by` later.
    pub(super) late_dup: f64,
    pub(super) late_by: Duration,
    /// Everything is dropped while the link is down.
    pub(super) down: bool,
    filter: Option<Filter>,
    rng: Rng,
    in_flight: Vec<(Instant, u64, Vec<u8>)>,
    seq: u64,
    /// Every packet put on the link, with its fate.
    pub(super) log: Vec<(Pkt, Fate)>,
}

impl fmt::Debug for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Link")
            .field("in_flight", &self.in_flight.len())
            .field("sent", &self.log.len())
            .finish()
    }
}

impl Link {
    pub(super) fn new(seed: u64) -> Link {
        Link {
            latency: Duration::from_micros(10),
            loss: 0.0,
            dup: 0.0,
            reorder: 0.0,
            jitter: Duration::from_micros(50),
            late_dup: 0.0,
            late_by: Duration::from_millis(10),
            down: false,
            filter: None,
            rng: Rng::new(seed),
            in_flight: Vec::new(),
            seq: 0,
            log: Vec::new(),
        }
    }

    /// Installs a scripted fault, replacing any other.
    pub(super) fn set_filter(&mut self, f: impl FnMut(&Pkt) -> Option<Fate> + 'static) {
        self.filter = Some(Box::new(f));
    }

    /// Removes the scripted fault.
    pub(super) fn clear_filter(&mut self) {
        self.filter = None;
    }

    /// Drops the first `count` packets matching `pred`, from now on.
    pub(super) fn drop_matching(
        &mut self,
        count: usize,
        mut pred: impl FnMut(&Pkt) -> bool + 'static,
    ) {
        let mut left = count;
        self.set_filter(move |p| {
            if left > 0 && pred(p) {
                left -= 1;
                Some(Fate::Drop)
            } else {
                None
            }
        });
    }

    /// Gives the first `count` packets matching `pred` the fate `fate`, from now on.
    pub(super) fn fate_matching(
        &mut self,
        count: usize,
        fate: Fate,
        mut pred: impl FnMut(&Pkt) -> bool + 'static,
    ) {
        let mut left = count;
        self.set_filter(move |p| {
            if left > 0 && pred(p) {
                left -= 1;
                Some(fate)
            } else {
                None
            }
        });
    }

    pub(super) fn send(&mut self, now: Instant, bytes: Vec<u8>) {
        let pkt = Pkt::decode(self.log.len(), now, bytes);
        let scripted = self.filter.as_mut().and_then(|f| f(&pkt));
        let fate = if self.down {
            Fate::Drop
        } else if let Some(f) = scripted {
            f
        } else if self.rng.chance(self.loss) {
            Fate::Drop
        } else if self.rng.chance(self.dup) {
            Fate::Duplicate
        } else if self.rng.chance(self.late_dup) {
            Fate::DupDelayed(self.late_by)
        } else {
            Fate::Deliver
        };
        let copies = match fate {
            Fate::Drop => 0,
            Fate::Duplicate | Fate::DupDelayed(_) => 2,
            Fate::Deliver | Fate::Delay(_) | Fate::Altered(_) => 1,
        };
        for copy in 0..copies {
            let mut at = now + self.latency;
            match fate {
                Fate::Delay(d) => at += d,
                Fate::DupDelayed(d) if copy == 1 => at += d,
                _ => {}
            }
            if self.rng.chance(self.reorder) && !self.jitter.is_zero() {
                at += Duration::from_nanos(self.rng.below(self.jitter.as_nanos() as u64 + 1));
            }
            let mut bytes = pkt.bytes.clone();
            if let Fate::Altered(f) = fate {
                f(&mut bytes);
            }
            self.in_flight.push((at, self.seq, bytes));
            self.seq += 1;
        }
        self.log.push((pkt, fate));
    }

    pub(super) fn next_arrival(&self) -> Option<Instant> {
        self.in_flight.iter().map(|p| p.0).min()
    }

    /// The earliest packet due by `now` (ties in sending order).
    pub(super) fn pop_due(&mut self, now: Instant) -> Option<Vec<u8>> {
        let i = self
            .in_flight
            .iter()
            .enumerate()
            .filter(|(_, p)| p.0 <= now)
            .min_by_key(|(_, p)| (p.0, p.1))
            .map(|(i, _)| i)?;
        Some(self.in_flight.swap_remove(i).2)
    }

    /// Packets sent on this link (whatever their fate).
    pub(super) fn sent(&self) -> impl Iterator<Item = &Pkt> + '_ {
        self.log.iter().map(|(p, _)| p)
    }

    /// Packets sent that were not dropped.
    pub(super) fn passed(&self) -> impl Iterator<Item = &Pkt> + '_ {
        self.log
            .iter()
            .filter(|(_, f)| !matches!(f, Fate::Drop))
            .map(|(p, _)| p)
    }

    /// Packets still travelling.
    pub(super) fn in_flight(&self) -> usize {
        self.in_flight.len()
    }
}
