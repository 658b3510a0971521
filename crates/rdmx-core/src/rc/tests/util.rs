//! A deterministic two-endpoint harness for the RC engine, after quinn-proto's `Pair`.
//!
//! Two [`RcQp`]s (A and B), each with its own [`TestMem`], are connected through two
//! simulated one-way [`Link`]s. Time is simulated: [`Pair::now`] only moves when the
//! harness advances it to the next event (a packet arrival or a QP timer). Links have a
//! latency and, driven by a seeded xorshift generator, loss, duplication and reordering,
//! plus scripted faults through a filter that sees every packet decoded. Every packet put
//! on a link is logged with its fate, so tests can inspect the wire.

use std::cell::{Cell, RefCell};
use std::fmt;
use std::time::{Duration, Instant};

use rdmx_mem::Access;
use rdmx_wire as wire;

use crate::mr::{KeyError, KeyUse, MrTable, PdId};
use crate::qp::{Mtu, QpAttr, QpAttrMask, QpLimits, QpState};
use crate::rc::{CqSide, MemAccess, QpConfig, RcQp};
use crate::wr::{Completion, PostError, RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge};

/// The protection domain both QPs live in.
pub(super) const PD: PdId = PdId(1);
/// Another protection domain, for wrong-PD tests.
pub(super) const OTHER_PD: PdId = PdId(2);

/// Everything: local write and all remote access.
pub(super) const ALL: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_ATOMIC);

// ---------------------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------------------

/// A registered region of a [`TestMem`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Region {
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) lkey: u32,
    pub(super) rkey: u32,
}

impl Region {
    /// An SGE for `len` bytes at offset `off`.
    pub(super) fn sge(&self, off: u64, len: u32) -> Sge {
        Sge {
            addr: self.addr + off,
            len,
            lkey: self.lkey,
        }
    }

    /// The remote address of offset `off`.
    pub(super) fn remote(&self, off: u64) -> RemoteAddr {
        RemoteAddr {
            addr: self.addr + off,
            rkey: self.rkey,
        }
    }
}

/// What [`TestMem::resolve`] hands the engine: the region as it was checked.
#[derive(Clone, Debug)]
pub(super) struct TestMr {
    addr: u64,
    len: u64,
}

/// One endpoint's memory: a byte arena whose addresses start at `base`, with regions in
/// a real [`MrTable`] so the engine gets the real key, PD, bounds and access checks.
pub(super) struct TestMem {
    table: MrTable<()>,
    arena: RefCell<Vec<u8>>,
    base: u64,
    /// Atomic operations executed on this memory (compare-swap and fetch-add).
    pub(super) atomics: Cell<u64>,
}

impl fmt::Debug for TestMem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestMem")
            .field("base", &self.base)
            .field("bytes", &self.arena.borrow().len())
            .finish()
    }
}

impl TestMem {
    pub(super) fn new(base: u64, seed: u64) -> Self {
        TestMem {
            table: MrTable::new(seed),
            arena: RefCell::new(Vec::new()),
            base,
            atomics: Cell::new(0),
        }
    }

    /// Allocates `len` bytes (64-aligned, zeroed, with a 64-byte gap to the next
    /// allocation) without registering them.
    pub(super) fn alloc(&self, len: u64) -> u64 {
        let mut a = self.arena.borrow_mut();
        let start = (a.len() as u64).div_ceil(64) * 64 + 64;
        a.resize((start + len) as usize, 0);
        self.base + start
    }

    /// Allocates and registers `len` bytes in `pd` with `access`.
    pub(super) fn register_in(&mut self, pd: PdId, len: u64, access: Access) -> Region {
        let addr = self.alloc(len);
        self.register_at(pd, addr, len, access)
    }

    /// Allocates and registers `len` bytes in [`PD`] with `access`.
    pub(super) fn register(&mut self, len: u64, access: Access) -> Region {
        self.register_in(PD, len, access)
    }

    /// Registers already allocated bytes.
    pub(super) fn register_at(&mut self, pd: PdId, addr: u64, len: u64, access: Access) -> Region {
        let e = self
            .table
            .insert(pd, addr, len, access, ())
            .expect("register");
        Region {
            addr,
            len,
            lkey: e.lkey,
            rkey: e.rkey,
        }
    }

    /// Deregisters a region; its keys stop working at once.
    pub(super) fn deregister(&mut self, r: &Region) {
        self.table.remove(r.lkey).expect("registered");
    }

    fn range(&self, addr: u64, len: usize) -> std::ops::Range<usize> {
        assert!(addr >= self.base, "address {addr:#x} below the arena");
        let start = (addr - self.base) as usize;
        start..start + len
    }

    /// Copies bytes out of the arena.
    pub(super) fn bytes(&self, addr: u64, len: usize) -> Vec<u8> {
        self.arena.borrow()[self.range(addr, len)].to_vec()
    }

    /// Writes bytes into the arena.
    pub(super) fn fill(&self, addr: u64, data: &[u8]) {
        let r = self.range(addr, data.len());
        self.arena.borrow_mut()[r].copy_from_slice(data);
    }

    /// Native-endian u64 at `addr`.
    pub(super) fn u64_at(&self, addr: u64) -> u64 {
        u64::from_ne_bytes(self.bytes(addr, 8).try_into().unwrap())
    }

    /// Stores a native-endian u64 at `addr`.
    pub(super) fn set_u64(&self, addr: u64, v: u64) {
        self.fill(addr, &v.to_ne_bytes());
    }

    fn check_in(mr: &TestMr, addr: u64, len: u64) {
        assert!(
            addr >= mr.addr && addr + len <= mr.addr + mr.len,
            "engine access of {len} bytes at {addr:#x} outside the resolved region \
             ({} bytes at {:#x})",
            mr.len,
            mr.addr
        );
    }
}

impl MemAccess for TestMem {
    type Mr = TestMr;

    fn resolve(
        &self,
        key: u32,
        key_use: KeyUse,
        pd: PdId,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<TestMr, KeyError> {
        let e = self.table.check(key, key_use, pd, addr, len, need)?;
        Ok(TestMr {
            addr: e.addr,
            len: e.len,
        })
    }

    fn read(&self, mr: &TestMr, addr: u64, out: &mut [u8]) {
        Self::check_in(mr, addr, out.len() as u64);
        out.copy_from_slice(&self.arena.borrow()[self.range(addr, out.len())]);
    }

    fn write(&self, mr: &TestMr, addr: u64, data: &[u8]) {
        Self::check_in(mr, addr, data.len() as u64);
        self.fill(addr, data);
    }

    fn compare_swap(&self, mr: &TestMr, addr: u64, compare: u64, swap: u64) -> u64 {
        Self::check_in(mr, addr, 8);
        assert_eq!(addr % 8, 0, "misaligned atomic reached memory");
        self.atomics.set(self.atomics.get() + 1);
        let old = self.u64_at(addr);
        if old == compare {
            self.set_u64(addr, swap);
        }
        old
    }

    fn fetch_add(&self, mr: &TestMr, addr: u64, add: u64) -> u64 {
        Self::check_in(mr, addr, 8);
        assert_eq!(addr % 8, 0, "misaligned atomic reached memory");
        self.atomics.set(self.atomics.get() + 1);
        let old = self.u64_at(addr);
        self.set_u64(addr, old.wrapping_add(add));
        old
    }
}

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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
    fn new(seed: u64) -> Link {
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

    fn send(&mut self, now: Instant, bytes: Vec<u8>) {
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
            Fate::Deliver | Fate::Delay(_) => 1,
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
            self.in_flight.push((at, self.seq, pkt.bytes.clone()));
            self.seq += 1;
        }
        self.log.push((pkt, fate));
    }

    fn next_arrival(&self) -> Option<Instant> {
        self.in_flight.iter().map(|p| p.0).min()
    }

    /// The earliest packet due by `now` (ties in sending order).
    fn pop_due(&mut self, now: Instant) -> Option<Vec<u8>> {
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
            .filter(|(_, f)| *f != Fate::Drop)
            .map(|(p, _)| p)
    }

    /// Packets still travelling.
    pub(super) fn in_flight(&self) -> usize {
        self.in_flight.len()
    }
}

// ---------------------------------------------------------------------------------------
// Endpoints and the pair
// ---------------------------------------------------------------------------------------

/// How the pair is built and connected.
#[derive(Clone, Debug)]
pub(super) struct PairConfig {
    pub(super) mtu: Mtu,
    pub(super) timeout: u8,
    pub(super) retry_cnt: u8,
    pub(super) rnr_retry: u8,
    pub(super) min_rnr_timer: u8,
    pub(super) max_rd_atomic: u8,
    pub(super) max_dest_rd_atomic: u8,
    pub(super) access: Access,
    pub(super) sq_psn_a: u32,
    pub(super) sq_psn_b: u32,
    pub(super) max_send_wr: usize,
    pub(super) max_recv_wr: usize,
    pub(super) max_send_sge: usize,
    pub(super) max_recv_sge: usize,
    pub(super) seed: u64,
    /// `QpConfig::reliable_link` on both QPs.
    pub(super) reliable_link: bool,
}

impl Default for PairConfig {
    fn default() -> Self {
        PairConfig {
            mtu: Mtu::Mtu256,
            // 4.096 µs × 2^10 ≈ 4.2 ms, far above the link latency.
            timeout: 10,
            retry_cnt: 7,
            rnr_retry: 7,
            // Code 1: 10 µs.
            min_rnr_timer: 1,
            max_rd_atomic: 4,
            max_dest_rd_atomic: 4,
            access: Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
            sq_psn_a: 100,
            sq_psn_b: 5000,
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 4,
            max_recv_sge: 4,
            seed: 1,
            reliable_link: false,
        }
    }
}

/// A completion with the simulated time it was reaped.
#[derive(Clone, Copy, Debug)]
pub(super) struct Wc {
    pub(super) c: Completion,
    pub(super) at: Instant,
    pub(super) solicited: bool,
}

/// One side: its QP, memory and completion queues.
#[derive(Debug)]
pub(super) struct Endpoint {
    pub(super) qp: RcQp<TestMem>,
    pub(super) mem: TestMem,
    pub(super) send_cq: Vec<Wc>,
    pub(super) recv_cq: Vec<Wc>,
    /// While set, the harness does not call `poll_transmit` on this QP (a transport
    /// that cannot take packets, e.g. a full socket buffer).
    pub(super) hold: bool,
    /// At most this many packets are taken from the QP every `pace` (a paced or slow
    /// transport), so a long message can be half sent when answers come back.
    pub(super) burst: Option<usize>,
    pub(super) pace: Duration,
    /// When the paced transport takes packets again.
    next_burst: Option<Instant>,
}

impl Endpoint {
    /// Posts a send request.
    pub(super) fn post(&mut self, wr: SendWr) -> Result<(), PostError> {
        self.qp.post_send(&self.mem, wr, None)
    }

    /// Posts a send request with an inline payload.
    pub(super) fn post_inline(&mut self, wr: SendWr, data: Vec<u8>) -> Result<(), PostError> {
        self.qp.post_send(&self.mem, wr, Some(data))
    }

    /// Posts a receive request.
    pub(super) fn recv(&mut self, wr_id: u64, sges: Vec<Sge>) -> Result<(), PostError> {
        self.qp.post_recv(&self.mem, RecvWr { wr_id, sges })
    }

    /// Moves the engine's completions to the CQs.
    fn reap(&mut self, now: Instant) -> bool {
        let mut any = false;
        while let Some((side, c, solicited)) = self.qp.poll_completion() {
            any = true;
            let wc = Wc {
                c,
                at: now,
                solicited,
            };
            match side {
                CqSide::Send => self.send_cq.push(wc),
                CqSide::Recv => self.recv_cq.push(wc),
            }
        }
        any
    }

    /// `(wr_id, status)` of the send completions so far.
    pub(super) fn sends(&self) -> Vec<(u64, crate::wr::WcStatus)> {
        self.send_cq
            .iter()
            .map(|w| (w.c.wr_id, w.c.status))
            .collect()
    }

    /// `(wr_id, status)` of the receive completions so far.
    pub(super) fn recvs(&self) -> Vec<(u64, crate::wr::WcStatus)> {
        self.recv_cq
            .iter()
            .map(|w| (w.c.wr_id, w.c.status))
            .collect()
    }

    /// Transmits everything the QP has now onto `link`.
    fn transmit(&mut self, now: Instant, link: &mut Link) -> bool {
        let mut any = false;
        if self.hold || self.next_burst.is_some_and(|t| t > now) {
            return false;
        }
        self.next_burst = None;
        let mut sent = 0;
        loop {
            if self.burst.is_some_and(|b| sent == b) {
                self.next_burst = Some(now + self.pace);
                break;
            }
            let Some(p) = self.qp.poll_transmit(now, &self.mem) else {
                break;
            };
            sent += 1;
            any = true;
            link.send(now, p);
            assert!(
                link.log.len() < 1_000_000,
                "runaway transmission: a million packets"
            );
        }
        any
    }
}

/// Two connected QPs, two links and a simulated clock.
#[derive(Debug)]
pub(super) struct Pair {
    pub(super) a: Endpoint,
    pub(super) b: Endpoint,
    /// A to B.
    pub(super) ab: Link,
    /// B to A.
    pub(super) ba: Link,
    pub(super) epoch: Instant,
    pub(super) now: Instant,
    pub(super) cfg: PairConfig,
    /// Steps taken; [`Pair::max_steps`] bounds them so a livelock fails the test.
    pub(super) steps: usize,
    pub(super) max_steps: usize,
    /// `handle_timeout` calls per side (A, B).
    pub(super) timeouts: (usize, usize),
}

pub(super) const QPN_A: u32 = 0x11;
pub(super) const QPN_B: u32 = 0x22;

impl Pair {
    /// A connected pair with the default configuration.
    pub(super) fn new() -> Pair {
        Pair::with(PairConfig::default())
    }

    /// A connected pair.
    pub(super) fn with(cfg: PairConfig) -> Pair {
        let mut p = Pair::unconnected(cfg);
        p.connect();
        p
    }

    /// Two QPs in RESET.
    pub(super) fn unconnected(cfg: PairConfig) -> Pair {
        let limits = QpLimits::default();
        let qcfg = |qpn| {
            let mut c = QpConfig::new(qpn, PD);
            c.max_send_wr = cfg.max_send_wr;
            c.max_recv_wr = cfg.max_recv_wr;
            c.max_send_sge = cfg.max_send_sge;
            c.max_recv_sge = cfg.max_recv_sge;
            c.reliable_link = cfg.reliable_link;
            c
        };
        let epoch = Instant::now();
        let mut ab = Link::new(cfg.seed.wrapping_mul(3).wrapping_add(1));
        let mut ba = Link::new(cfg.seed.wrapping_mul(5).wrapping_add(2));
        ab.latency = Duration::from_micros(10);
        ba.latency = Duration::from_micros(10);
        Pair {
            a: Endpoint {
                qp: RcQp::new(qcfg(QPN_A), limits),
                mem: TestMem::new(0x1000_0000, cfg.seed ^ 0xa),
                send_cq: Vec::new(),
                recv_cq: Vec::new(),
                hold: false,
                burst: None,
                pace: Duration::from_micros(5),
                next_burst: None,
            },
            b: Endpoint {
                qp: RcQp::new(qcfg(QPN_B), limits),
                mem: TestMem::new(0x2000_0000, cfg.seed ^ 0xb),
                send_cq: Vec::new(),
                recv_cq: Vec::new(),
                hold: false,
                burst: None,
                pace: Duration::from_micros(5),
                next_burst: None,
            },
            ab,
            ba,
            epoch,
            now: epoch,
            cfg,
            steps: 0,
            max_steps: 200_000,
            timeouts: (0, 0),
        }
    }

    /// RESET → INIT → RTR → RTS on both sides.
    pub(super) fn connect(&mut self) {
        let c = self.cfg.clone();
        for (qp, dest, rq_psn, sq_psn) in [
            (&mut self.a.qp, QPN_B, c.sq_psn_b, c.sq_psn_a),
            (&mut self.b.qp, QPN_A, c.sq_psn_a, c.sq_psn_b),
        ] {
            to_init(qp, c.access);
            to_rtr(qp, &c, dest, rq_psn);
            to_rts(qp, &c, sq_psn);
        }
    }

    /// Simulated time since the start.
    pub(super) fn elapsed(&self) -> Duration {
        self.now - self.epoch
    }

    /// The earliest pending event: a packet arrival or a QP timer.
    fn next_event(&self) -> Option<Instant> {
        [
            self.ab.next_arrival(),
            self.ba.next_arrival(),
            self.a.qp.poll_timeout(),
            self.b.qp.poll_timeout(),
            self.a.next_burst,
            self.b.next_burst,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// One round: due timers, transmissions, completions, due deliveries; then, if
    /// nothing was due, advance the clock to the next event (not past `deadline`).
    /// Returns `false` once nothing is left to do (or the deadline is reached).
    pub(super) fn step(&mut self, deadline: Option<Instant>) -> bool {
        self.steps += 1;
        assert!(
            self.steps <= self.max_steps,
            "no quiescence after {} steps (livelock?) at {:?}: A {:?} B {:?}, {} + {} \
             packets in flight, A timer {:?}, B timer {:?}",
            self.max_steps,
            self.elapsed(),
            self.a.qp.state(),
            self.b.qp.state(),
            self.ab.in_flight(),
            self.ba.in_flight(),
            self.a.qp.poll_timeout().map(|t| t - self.epoch),
            self.b.qp.poll_timeout().map(|t| t - self.epoch),
        );
        let now = self.now;
        if self.a.qp.poll_timeout().is_some_and(|t| t <= now) {
            self.timeouts.0 += 1;
            self.a.qp.handle_timeout(now);
        }
        if self.b.qp.poll_timeout().is_some_and(|t| t <= now) {
            self.timeouts.1 += 1;
            self.b.qp.handle_timeout(now);
        }
        self.a.transmit(now, &mut self.ab);
        self.b.transmit(now, &mut self.ba);
        self.a.reap(now);
        self.b.reap(now);
        let mut delivered = false;
        while let Some(p) = self.ab.pop_due(now) {
            deliver(&mut self.b.qp, now, &self.b.mem, &p);
            delivered = true;
        }
        while let Some(p) = self.ba.pop_due(now) {
            deliver(&mut self.a.qp, now, &self.a.mem, &p);
            delivered = true;
        }
        self.check_invariants();
        if delivered {
            self.a.reap(now);
            self.b.reap(now);
            self.check_invariants();
            return true;
        }
        match self.next_event() {
            None => false,
            Some(t) => {
                if deadline.is_some_and(|d| t > d) {
                    self.now = self.now.max(deadline.unwrap());
                    return false;
                }
                self.now = self.now.max(t);
                true
            }
        }
    }

    /// Runs until nothing is in flight and no timer is armed.
    pub(super) fn drive(&mut self) {
        while self.step(None) {}
    }

    /// Runs for `d` of simulated time (or until quiescent, whichever is first), then
    /// sets the clock to the end of that span.
    pub(super) fn drive_for(&mut self, d: Duration) {
        let deadline = self.now + d;
        while self.step(Some(deadline)) {}
        self.now = self.now.max(deadline);
    }

    /// Runs until `pred` holds (checked after each step); panics if the pair goes quiet
    /// first.
    pub(super) fn drive_until(&mut self, mut pred: impl FnMut(&Pair) -> bool) {
        while !pred(self) {
            assert!(self.step(None), "went quiet before the condition held");
        }
    }

    /// The engines' own bookkeeping checks, on both sides, outside ERR (which drops it).
    fn check_invariants(&self) {
        for ep in [&self.a, &self.b] {
            if ep.qp.state() != QpState::Err {
                ep.qp.req.check_invariants();
            }
        }
    }

    /// Both links' logs merged in time order, one line per packet, for failure messages
    /// and debugging.
    pub(super) fn trace(&self) -> String {
        let mut lines: Vec<(Instant, usize, String)> = Vec::new();
        for (dir, link) in [("A>B", &self.ab), ("B>A", &self.ba)] {
            for (p, fate) in &link.log {
                let extra = match (p.syndrome, p.atomic_orig) {
                    (Some(s), _) if p.op == wire::Opcode::Acknowledge => format!(" {s}"),
                    (_, Some(o)) => format!(" orig={o}"),
                    _ => String::new(),
                };
                lines.push((
                    p.at,
                    p.n,
                    format!(
                        "{:>12?} {dir} #{:<4} {:?} psn={:#x} len={}{extra}{}",
                        p.at - self.epoch,
                        p.n,
                        p.op,
                        p.psn,
                        p.len,
                        match fate {
                            Fate::Deliver => String::new(),
                            f => format!("  [{f:?}]"),
                        }
                    ),
                ));
            }
        }
        lines.sort_by_key(|l| (l.0, l.1));
        lines.into_iter().map(|l| l.2 + "\n").collect()
    }

    /// Whether nothing is travelling and no timer is armed.
    pub(super) fn quiet(&self) -> bool {
        self.next_event().is_none()
    }
}

pub(super) fn to_init(qp: &mut RcQp<TestMem>, access: Access) {
    let attr = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        qp_access_flags: access,
        ..QpAttr::default()
    };
    qp.modify(
        &attr,
        QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
    )
    .expect("RESET -> INIT");
}

pub(super) fn to_rtr(qp: &mut RcQp<TestMem>, c: &PairConfig, dest: u32, rq_psn: u32) {
    let attr = QpAttr {
        qp_state: QpState::Rtr,
        path_mtu: c.mtu,
        dest_qp_num: dest,
        rq_psn,
        max_dest_rd_atomic: c.max_dest_rd_atomic,
        min_rnr_timer: c.min_rnr_timer,
        ..QpAttr::default()
    };
    qp.modify(
        &attr,
        QpAttrMask::STATE
            | QpAttrMask::AV
            | QpAttrMask::PATH_MTU
            | QpAttrMask::DEST_QPN
            | QpAttrMask::RQ_PSN
            | QpAttrMask::MAX_DEST_RD_ATOMIC
            | QpAttrMask::MIN_RNR_TIMER,
    )
    .expect("INIT -> RTR");
}

pub(super) fn to_rts(qp: &mut RcQp<TestMem>, c: &PairConfig, sq_psn: u32) {
    let attr = QpAttr {
        qp_state: QpState::Rts,
        sq_psn,
        timeout: c.timeout,
        retry_cnt: c.retry_cnt,
        rnr_retry: c.rnr_retry,
        max_rd_atomic: c.max_rd_atomic,
        ..QpAttr::default()
    };
    qp.modify(
        &attr,
        QpAttrMask::STATE
            | QpAttrMask::SQ_PSN
            | QpAttrMask::TIMEOUT
            | QpAttrMask::RETRY_CNT
            | QpAttrMask::RNR_RETRY
            | QpAttrMask::MAX_QP_RD_ATOMIC,
    )
    .expect("RTR -> RTS");
}

// ---------------------------------------------------------------------------------------
// Work-request builders
// ---------------------------------------------------------------------------------------

/// A signaled send request.
pub(super) fn wr(wr_id: u64, op: SendOp, sges: Vec<Sge>) -> SendWr {
    SendWr {
        wr_id,
        op,
        sges,
        flags: SendFlags::SIGNALED,
    }
}

/// A signaled send request with extra flags.
pub(super) fn wr_flags(wr_id: u64, op: SendOp, sges: Vec<Sge>, flags: SendFlags) -> SendWr {
    SendWr {
        wr_id,
        op,
        sges,
        flags: flags | SendFlags::SIGNALED,
    }
}

/// An unsignaled send request.
pub(super) fn wr_unsignaled(wr_id: u64, op: SendOp, sges: Vec<Sge>) -> SendWr {
    SendWr {
        wr_id,
        op,
        sges,
        flags: SendFlags::empty(),
    }
}

/// Deterministic test bytes: `len` bytes derived from `seed`.
pub(super) fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut r = Rng::new(seed.wrapping_add(0x5eed));
    (0..len).map(|_| r.next_u64() as u8).collect()
}

/// Splits `len` bytes into up to `n` SGEs over `region` starting at `off`, with uneven
/// sizes (some possibly zero-length when `len` is small).
pub(super) fn split_sges(region: &Region, off: u64, len: u32, n: usize) -> Vec<Sge> {
    let n = n.max(1) as u32;
    let mut sges = Vec::new();
    let mut at = 0u32;
    for i in 0..n {
        let part = if i == n - 1 {
            len - at
        } else {
            // Uneven: the i-th piece takes a third, a fifth... of what is left.
            (len - at) / (i + 2)
        };
        sges.push(region.sge(off + u64::from(at), part));
        at += part;
    }
    sges
}

/// Delivers a packet as a stream transport does: the headers through
/// [`RcQp::handle_header`], then the payload copied to the placements the engine named.
/// (The whole-packet path, `handle_packet`, is what the integration-test harness and the
/// loopback provider use.)
fn deliver(qp: &mut RcQp<TestMem>, now: Instant, mem: &TestMem, p: &[u8]) {
    let hlen = p
        .first()
        .and_then(|&b| rdmx_wire::Opcode::try_from(b).ok())
        .map_or(p.len(), |op| op.header_len())
        .min(p.len());
    let mut place = Vec::new();
    let Some(len) = qp.handle_header(now, mem, None, &p[..hlen], p.len() - hlen, &mut place) else {
        return;
    };
    let payload = &p[hlen..hlen + len];
    let mut end = 0;
    for pl in &place {
        let (off, n) = (pl.offset as usize, pl.len as usize);
        assert!(
            off >= end && off + n <= len,
            "placements in order, inside the payload"
        );
        end = off + n;
        mem.write(&pl.mr, pl.addr, &payload[off..off + n]);
    }
}
