//! A deterministic two-endpoint harness for the RC engine, after quinn-proto's `Pair`.
//!
//! Two [`RcQp`]s (A and B), each with its own [`TestMem`], are connected through two
//! simulated one-way [`Link`]s. Time is simulated: [`Pair::now`] only moves when the
//! harness advances it to the next event (a packet arrival or a QP timer). Links have a
//! latency and, driven by a seeded xorshift generator, loss, duplication and reordering,
//! plus scripted faults through a filter that sees every packet decoded. Every packet put
//! on a link is logged with its fate, so tests can inspect the wire.

use std::time::{Duration, Instant};

use rdmx_wire as wire;

use crate::access::Access;
use crate::qp::{Mtu, QpAttr, QpAttrMask, QpLimits, QpState};
use crate::rc::{CqSide, MemAccess, QpConfig, RcQp};
use crate::wr::{Completion, PostError, RecvWr, SendFlags, SendOp, SendWr, Sge};

pub(super) use super::link::*;
pub(super) use super::mem::*;

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
    /// `QpConfig::min_ack_timeout` on both QPs.
    pub(super) min_ack_timeout: Duration,
    /// `QpConfig::send_window` on both QPs.
    pub(super) send_window: u32,
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
            min_ack_timeout: Duration::ZERO,
            send_window: 0,
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
        self.qp.post_recv(
            &self.mem,
            RecvWr {
                wr_id,
                sges: sges.as_slice().try_into().unwrap(),
            },
        )
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
    pub(super) fn transmit(&mut self, now: Instant, link: &mut Link) -> bool {
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
            // Every step of every scenario checks that `may_transmit` never says no
            // when there is work.
            let (may, done) = (self.qp.may_transmit(), self.qp.completions.len());
            // B's transport asks for a plain acknowledgement first (`poll_ack`), as the
            // shm provider's does; A's takes every packet through `poll_transmit`: every
            // scenario runs both.
            let ack = match self.qp.qpn() == QPN_B {
                true => self.qp.poll_ack().map(|b| b.to_vec()),
                false => None,
            };
            let Some(p) = ack.or_else(|| self.qp.poll_transmit(now, &self.mem)) else {
                assert!(
                    may || self.qp.completions.len() == done,
                    "may_transmit said no, yet a request retired"
                );
                break;
            };
            assert!(may, "may_transmit said no, yet a packet went out");
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
            c.min_ack_timeout = cfg.min_ack_timeout;
            c.send_window = cfg.send_window;
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

/// The ACK timeout the pair's configuration gives.
pub(super) fn ack_timeout(p: &Pair) -> Duration {
    crate::qp::timeout_duration(p.cfg.timeout).unwrap()
}

/// The k-th PSN A sends.
pub(super) fn a_psn(p: &Pair, k: u32) -> u32 {
    wire::psn_add(p.cfg.sq_psn_a, k)
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
        sges: sges.as_slice().try_into().unwrap(),
        flags: SendFlags::SIGNALED,
        ud: None,
    }
}

/// A signaled send request with extra flags.
pub(super) fn wr_flags(wr_id: u64, op: SendOp, sges: Vec<Sge>, flags: SendFlags) -> SendWr {
    SendWr {
        wr_id,
        op,
        sges: sges.as_slice().try_into().unwrap(),
        flags: flags | SendFlags::SIGNALED,
        ud: None,
    }
}

/// An unsignaled send request.
pub(super) fn wr_unsignaled(wr_id: u64, op: SendOp, sges: Vec<Sge>) -> SendWr {
    SendWr {
        wr_id,
        op,
        sges: sges.as_slice().try_into().unwrap(),
        flags: SendFlags::empty(),
        ud: None,
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
pub(super) fn deliver(qp: &mut RcQp<TestMem>, now: Instant, mem: &TestMem, p: &[u8]) {
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
