//! A deterministic two-endpoint harness for the RC engine: simulated clock, simulated
//! link per direction with latency, loss, duplication, reordering and scripted drops,
//! all driven by a seeded PRNG, so every run of a test is the same run.
#![allow(dead_code, unreachable_pub)]

use std::cell::RefCell;
use std::time::{Duration, Instant};

use rdmx_core::rc::{CqSide, MemAccess, QpConfig, RcQp};
use rdmx_core::{
    Access, Completion, ConnectParams, KeyError, KeyUse, MrTable, Mtu, PdId, QpLimits,
};

pub const PD: PdId = PdId(1);
const BASE: u64 = 0x10_0000;

/// One endpoint's registered memory: a byte arena and a real key table.
pub struct Mem {
    table: RefCell<MrTable<()>>,
    bytes: RefCell<Vec<u8>>,
}

/// A registered region in a [`Mem`].
#[derive(Clone, Copy, Debug)]
pub struct Region {
    pub addr: u64,
    pub len: u64,
    pub lkey: u32,
    pub rkey: u32,
}

impl Mem {
    pub fn new(seed: u64) -> Self {
        Mem {
            table: RefCell::new(MrTable::new(seed)),
            bytes: RefCell::new(Vec::new()),
        }
    }

    /// Registers `len` fresh bytes (8-aligned) in `pd`.
    pub fn register_in(&self, pd: PdId, len: usize, access: Access) -> Region {
        let mut bytes = self.bytes.borrow_mut();
        let start = bytes.len().next_multiple_of(8);
        bytes.resize(start + len.max(1), 0);
        let addr = BASE + start as u64;
        let mut t = self.table.borrow_mut();
        let e = t.insert(pd, addr, len.max(1) as u64, access, ()).unwrap();
        Region {
            addr,
            len: len as u64,
            lkey: e.lkey,
            rkey: e.rkey,
        }
    }

    pub fn register(&self, len: usize, access: Access) -> Region {
        self.register_in(PD, len, access)
    }

    pub fn deregister(&self, r: Region) {
        self.table.borrow_mut().remove(r.lkey).unwrap();
    }

    pub fn get(&self, addr: u64, len: usize) -> Vec<u8> {
        let off = (addr - BASE) as usize;
        self.bytes.borrow()[off..off + len].to_vec()
    }

    pub fn put(&self, addr: u64, data: &[u8]) {
        let off = (addr - BASE) as usize;
        self.bytes.borrow_mut()[off..off + data.len()].copy_from_slice(data);
    }

    pub fn u64_at(&self, addr: u64) -> u64 {
        u64::from_ne_bytes(self.get(addr, 8).try_into().unwrap())
    }
}

impl MemAccess for Mem {
    type Mr = ();
    fn resolve(
        &self,
        key: u32,
        key_use: KeyUse,
        pd: PdId,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<(), KeyError> {
        self.table
            .borrow()
            .check(key, key_use, pd, addr, len, need)
            .map(|_| ())
    }
    fn read(&self, _: &(), addr: u64, out: &mut [u8]) {
        out.copy_from_slice(&self.get(addr, out.len()));
    }
    fn write(&self, _: &(), addr: u64, data: &[u8]) {
        self.put(addr, data);
    }
    fn compare_swap(&self, _: &(), addr: u64, compare: u64, swap: u64) -> u64 {
        let old = self.u64_at(addr);
        if old == compare {
            self.put(addr, &swap.to_ne_bytes());
        }
        old
    }
    fn fetch_add(&self, _: &(), addr: u64, add: u64) -> u64 {
        let old = self.u64_at(addr);
        self.put(addr, &old.wrapping_add(add).to_ne_bytes());
        old
    }
}

/// xorshift64*: small, seeded, good enough for fault injection.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 > 1.0 - p
    }
}

/// A scripted fault: given a packet's index on the link and its bytes, drop it?
pub type DropFilter = Box<dyn FnMut(usize, &[u8]) -> bool>;

/// One direction of the simulated link.
pub struct Link {
    pub latency: Duration,
    pub jitter: Duration,
    pub loss: f64,
    pub dup: f64,
    /// Scripted faults: return true to drop this packet (its index, its bytes).
    pub drop_if: Option<DropFilter>,
    in_flight: Vec<(Instant, u64, Vec<u8>)>,
    seq: u64,
    /// Every packet offered to the link, in order (dropped ones included).
    pub log: Vec<Vec<u8>>,
    /// Packets the link dropped.
    pub dropped: usize,
}

impl Link {
    fn new() -> Self {
        Link {
            latency: Duration::from_micros(5),
            jitter: Duration::ZERO,
            loss: 0.0,
            dup: 0.0,
            drop_if: None,
            in_flight: Vec::new(),
            seq: 0,
            log: Vec::new(),
            dropped: 0,
        }
    }

    fn send(&mut self, now: Instant, rng: &mut Rng, p: Vec<u8>) {
        let idx = self.log.len();
        self.log.push(p.clone());
        if let Some(f) = self.drop_if.as_mut() {
            if f(idx, &p) {
                self.dropped += 1;
                return;
            }
        }
        if rng.chance(self.loss) {
            self.dropped += 1;
            return;
        }
        let copies = if rng.chance(self.dup) { 2 } else { 1 };
        for _ in 0..copies {
            let jitter = if self.jitter.is_zero() {
                Duration::ZERO
            } else {
                Duration::from_nanos(rng.next() % self.jitter.as_nanos() as u64)
            };
            self.seq += 1;
            self.in_flight
                .push((now + self.latency + jitter, self.seq, p.clone()));
        }
    }

    fn next_due(&self) -> Option<Instant> {
        self.in_flight.iter().map(|(t, _, _)| *t).min()
    }

    fn take_due(&mut self, now: Instant) -> Vec<Vec<u8>> {
        self.in_flight.sort_by_key(|(t, s, _)| (*t, *s));
        let n = self
            .in_flight
            .iter()
            .take_while(|(t, _, _)| *t <= now)
            .count();
        self.in_flight.drain(..n).map(|(_, _, p)| p).collect()
    }
}

/// One endpoint.
pub struct Side {
    pub qp: RcQp<Mem>,
    pub mem: Mem,
    pub send_cq: Vec<Completion>,
    pub recv_cq: Vec<Completion>,
}

/// Connection parameters.
#[derive(Clone, Copy)]
pub struct Params {
    pub mtu: Mtu,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub sq_depth: usize,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            mtu: Mtu::Mtu256,
            timeout: 8, // ~1 ms
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1, // 10 µs
            max_rd_atomic: 4,
            max_dest_rd_atomic: 16,
            sq_depth: 256,
        }
    }
}

/// Two connected endpoints, a clock and the link between them.
pub struct Pair {
    pub a: Side,
    pub b: Side,
    pub ab: Link,
    pub ba: Link,
    pub now: Instant,
    pub rng: Rng,
}

const ALL_ACCESS: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_ATOMIC);

impl Pair {
    pub fn new(seed: u64, p: Params) -> Pair {
        let side = |qpn: u32, seed: u64| {
            let mut cfg = QpConfig::new(qpn, PD);
            cfg.max_send_wr = p.sq_depth;
            cfg.max_recv_wr = p.sq_depth;
            Side {
                qp: RcQp::new(cfg, QpLimits::default()),
                mem: Mem::new(seed),
                send_cq: Vec::new(),
                recv_cq: Vec::new(),
            }
        };
        let mut pair = Pair {
            a: side(0x11, seed),
            b: side(0x12, seed ^ 0x55),
            ab: Link::new(),
            ba: Link::new(),
            now: Instant::now(),
            rng: Rng::new(seed),
        };
        connect(&mut pair.a.qp, 0x12, 1000, 5000, &p);
        connect(&mut pair.b.qp, 0x11, 5000, 1000, &p);
        pair
    }

    /// Runs until nothing is in flight and no timer is armed, or `limit` of simulated
    /// time passes. Returns false on the time limit.
    pub fn drive_for(&mut self, limit: Duration) -> bool {
        let end = self.now + limit;
        for _ in 0..2_000_000 {
            let mut moved = false;
            for (side, link) in [(&mut self.a, &mut self.ab), (&mut self.b, &mut self.ba)] {
                while let Some(p) = side.qp.poll_transmit(self.now, &side.mem) {
                    link.send(self.now, &mut self.rng, p);
                    moved = true;
                }
                while let Some((cq, c, _)) = side.qp.poll_completion() {
                    match cq {
                        CqSide::Send => side.send_cq.push(c),
                        CqSide::Recv => side.recv_cq.push(c),
                    }
                    moved = true;
                }
            }
            for p in self.ab.take_due(self.now) {
                self.b.qp.handle_packet(self.now, &self.b.mem, &p);
                moved = true;
            }
            for p in self.ba.take_due(self.now) {
                self.a.qp.handle_packet(self.now, &self.a.mem, &p);
                moved = true;
            }
            if moved {
                continue;
            }
            let next = [
                self.ab.next_due(),
                self.ba.next_due(),
                self.a.qp.poll_timeout(),
                self.b.qp.poll_timeout(),
            ]
            .into_iter()
            .flatten()
            .min();
            let Some(next) = next else { return true };
            if next > end {
                return false;
            }
            self.now = self.now.max(next);
            if self.a.qp.poll_timeout().is_some_and(|t| t <= self.now) {
                self.a.qp.handle_timeout(self.now);
            }
            if self.b.qp.poll_timeout().is_some_and(|t| t <= self.now) {
                self.b.qp.handle_timeout(self.now);
            }
        }
        panic!("the pair did not settle: livelock");
    }

    pub fn drive(&mut self) {
        assert!(
            self.drive_for(Duration::from_secs(60)),
            "still busy after 60 s of simulated time"
        );
    }

    /// Registers a region with every access on each side.
    pub fn regions(&self, len: usize) -> (Region, Region) {
        (
            self.a.mem.register(len, ALL_ACCESS),
            self.b.mem.register(len, ALL_ACCESS),
        )
    }
}

fn connect(qp: &mut RcQp<Mem>, dest: u32, sq_psn: u32, rq_psn: u32, p: &Params) {
    let params = ConnectParams {
        access: ALL_ACCESS,
        mtu: p.mtu,
        dest_qpn: dest,
        rq_psn,
        sq_psn,
        max_rd_atomic: p.max_rd_atomic,
        max_dest_rd_atomic: p.max_dest_rd_atomic,
        timeout: p.timeout,
        retry_cnt: p.retry_cnt,
        rnr_retry: p.rnr_retry,
        min_rnr_timer: p.min_rnr_timer,
    };
    for (attr, mask) in params.steps() {
        qp.modify(&attr, mask).unwrap();
    }
}

/// The opcode byte of a packet on the link.
pub fn opcode(p: &[u8]) -> u8 {
    p[0]
}
