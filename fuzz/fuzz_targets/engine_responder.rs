//! The RC engine's responder fed arbitrary packet sequences.
//!
//! An `RcQp` in RTS, connected to a fake peer, with checked memory (`rdmx_fuzz::FakeMem`):
//!
//! | region | PD | access | role |
//! |---|---|---|---|
//! | 0 `A` | 1 | local write, remote write/read/atomic | the target of WRITE, READ, atomics |
//! | 1 `B` | 1 | remote read | read-only: must never change |
//! | 2 `C` | 2 | everything | another PD: must never change |
//! | 3 `R` | 1 | local write | receive buffers |
//!
//! The input is a configuration, some receives, and a sequence of steps: request packets
//! built from `Arbitrary` specs (opcode, PSN near the expected one, rkey valid, stale or
//! wrong, address and length near the region bounds, payload around the MTU) and emitted
//! with `rdmx-wire`, raw bytes, either fed whole (`handle_packet`) or as header now and
//! payload placed later (`handle_header`); posted receives; `poll_transmit`;
//! `poll_completion`; time passing with `handle_timeout`; state changes and reconnects.
//!
//! Checked: no panic; every memory access stays inside the range resolved for the
//! handle used, with the right access (`FakeMem`); guard bytes, the read-only region and
//! the other PD's region never change; every placement lies inside the payload; every
//! packet sent parses, is a response and goes to the peer; every receive completes at
//! most once, and only if it was posted (so never more completions than receives); a
//! successful receive's bytes were all written; no send completion appears.
#![no_main]

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use rdmx_core::rc::{CqSide, MemAccess, QpConfig, RcQp, Srq, Transmit};
use rdmx_core::{
    Access, ConnectParams, KeyUse, PdId, QpLimits, QpState, RecvWr, Sge, SgeList, WcOpcode,
    WcStatus,
};
use rdmx_fuzz::*;
use rdmx_wire::{
    psn_add, AethRepr, AtomicAckEthRepr, AtomicEthRepr, BthRepr, HeaderKind, IethRepr, ImmDtRepr,
    NakCode, Opcode, RcRepr, RethRepr, Syndrome,
};

const PD1: PdId = PdId(1);
const PD2: PdId = PdId(2);
const B: usize = 1;
const C: usize = 2;
const R: usize = 3;
const MAX_STEPS: usize = 400;

#[derive(Arbitrary, Debug)]
struct Input {
    cfg: Cfg,
    recvs: Vec<RecvSpec>,
    steps: Vec<Step>,
}

#[derive(Arbitrary, Debug)]
struct Cfg {
    mtu: MtuSel,
    rq_psn: PsnStart,
    max_dest_rd_atomic: u8,
    /// QP access flags (low 4 bits); bit 4 clear: all remote access.
    access: u8,
    srq: bool,
    min_rnr_timer: u8,
}

#[derive(Arbitrary, Debug)]
struct RecvSpec {
    sges: Vec<SgeSpec>,
}

#[derive(Arbitrary, Debug)]
struct SgeSpec {
    key: Option<KeySel>,
    len: LenSel,
}

#[derive(Arbitrary, Debug)]
enum PsnSel {
    Expected,
    Delta(i8),
    Raw(u32),
}

#[derive(Arbitrary, Debug)]
struct Pkt {
    op: u8,
    psn: PsnSel,
    wrong_qp: Option<u32>,
    flags: u8,
    key: KeySel,
    addr: AddrSel,
    dma_len: LenSel,
    payload: LenSel,
    imm: u32,
    swap_add: u64,
    compare: u64,
    syndrome: u8,
    msn: u32,
    fill: u8,
    deferred: bool,
}

#[derive(Arbitrary, Debug)]
enum Step {
    Packet(Pkt),
    Raw {
        bytes: Vec<u8>,
        deferred: bool,
        split: u8,
    },
    PostRecv(RecvSpec),
    Transmit {
        max: u8,
        parts: bool,
    },
    Completions,
    Advance {
        us: u16,
        shift: u8,
        force: bool,
    },
    Modify(Modify),
    Reconnect(PsnStart),
}

struct Harness {
    qp: RcQp<FakeMem>,
    mem: FakeMem,
    srq: Option<Srq<Handle>>,
    params: ConnectParams,
    now: Instant,
    mtu: u32,
    /// The responder's expected PSN as far as the harness can tell.
    epsn: u32,
    next_wr: u64,
    /// Receives posted, not completed: the memory stamp when posted and their segments
    /// (`None` if one failed its check).
    posted: HashMap<u64, (u64, Option<Vec<(u64, u32)>>)>,
    /// Receives that will never complete (the QP was reset).
    dropped: HashSet<u64>,
    completed: HashSet<u64>,
    recv_cursor: u64,
}

fuzz_target!(|input: Input| {
    let mem = FakeMem::new(&[
        (
            PD1,
            2048,
            Access::LOCAL_WRITE
                | Access::REMOTE_WRITE
                | Access::REMOTE_READ
                | Access::REMOTE_ATOMIC,
        ),
        (PD1, 512, Access::REMOTE_READ),
        (PD2, 512, Access::all()),
        (PD1, 2048, Access::LOCAL_WRITE),
    ]);
    let c = &input.cfg;
    let access = if c.access & 0x10 == 0 {
        Access::all()
    } else {
        Access::from_bits_truncate(u32::from(c.access))
    };
    let params = ConnectParams {
        access,
        mtu: c.mtu.get(),
        dest_qpn: PEER_QPN,
        rq_psn: c.rq_psn.get(),
        sq_psn: 0x1000,
        max_rd_atomic: 4,
        max_dest_rd_atomic: c.max_dest_rd_atomic % 17,
        timeout: 8,
        retry_cnt: 7,
        rnr_retry: 7,
        min_rnr_timer: c.min_rnr_timer % 32,
    };
    let mut cfg = QpConfig::new(QPN, PD1);
    cfg.srq = c.srq;
    cfg.max_recv_wr = 16;
    let mut qp = RcQp::new(cfg, QpLimits::default());
    connect(&mut qp, &params);
    let mut h = Harness {
        qp,
        mem,
        srq: c.srq.then(|| Srq::new(PD1, 16, 4)),
        params,
        now: Instant::now(),
        mtu: params.mtu.bytes(),
        epsn: params.rq_psn,
        next_wr: 1,
        posted: HashMap::new(),
        dropped: HashSet::new(),
        completed: HashSet::new(),
        recv_cursor: 0,
    };
    for r in &input.recvs {
        h.post_recv(r);
    }
    for step in input.steps.iter().take(MAX_STEPS) {
        h.step(step);
        h.mem.check_intact(&[B, C]);
    }
    h.transmit(usize::MAX, false);
    h.completions();
    h.mem.check_intact(&[B, C]);
});

impl Harness {
    fn step(&mut self, step: &Step) {
        match step {
            Step::Packet(p) => self.packet(p),
            Step::Raw {
                bytes,
                deferred,
                split,
            } => {
                let split = (usize::from(*split) % 64).min(bytes.len());
                self.deliver(bytes, deferred.then_some(split));
            }
            Step::PostRecv(r) => self.post_recv(r),
            Step::Transmit { max, parts } => self.transmit(usize::from(*max) + 1, *parts),
            Step::Completions => self.completions(),
            Step::Advance { us, shift, force } => {
                self.now += Duration::from_micros(u64::from(*us)) * (1 << (shift % 12));
                if *force || self.qp.poll_timeout().is_some_and(|t| t <= self.now) {
                    self.qp.handle_timeout(self.now);
                }
            }
            Step::Modify(m) => m.apply(&mut self.qp),
            Step::Reconnect(psn) => {
                // Completions already made stay (they are in the CQ); RESET empties the
                // receive queue without completions (an SRQ keeps its receives, less one
                // a SEND was filling).
                self.completions();
                if self.srq.is_none() {
                    self.dropped.extend(self.posted.drain().map(|(wr, _)| wr));
                }
                self.params.rq_psn = psn.get();
                self.epsn = self.params.rq_psn;
                connect(&mut self.qp, &self.params);
            }
        }
    }

    fn post_recv(&mut self, spec: &RecvSpec) {
        let mut segs = Some(Vec::new());
        let sges: Vec<Sge> = spec
            .sges
            .iter()
            .take(5)
            .map(|s| {
                let len = s.len.get(self.mtu);
                let (lkey, region) = match s.key {
                    // Fresh bytes of the receive region.
                    None => (self.mem.regions[R].lkey, R),
                    Some(k) => k.get(&self.mem, KeyUse::Local),
                };
                let r = &self.mem.regions[region];
                let len64 = u64::from(len);
                if self.recv_cursor + len64 > r.len {
                    self.recv_cursor = 0;
                }
                let addr = r.addr + self.recv_cursor;
                self.recv_cursor = (self.recv_cursor + len64).next_multiple_of(8);
                let ok = self
                    .mem
                    .resolve(lkey, KeyUse::Local, PD1, addr, len64, Access::LOCAL_WRITE)
                    .is_ok();
                match (&mut segs, ok) {
                    (Some(v), true) => v.push((addr, len)),
                    _ => segs = None,
                }
                Sge { addr, len, lkey }
            })
            .collect();
        let wr_id = self.next_wr;
        self.next_wr += 1;
        let sges = SgeList::try_from(&sges[..]).expect("at most five elements");
        let wr = RecvWr { wr_id, sges };
        let posted = match self.srq.as_mut() {
            Some(srq) => srq.post_recv(&self.mem, wr),
            None => self.qp.post_recv(&self.mem, wr),
        };
        if posted.is_ok() {
            self.posted.insert(wr_id, (self.mem.stamp(), segs));
        }
    }

    fn packet(&mut self, p: &Pkt) {
        let op = Opcode::ALL[usize::from(p.op) % Opcode::ALL.len()];
        let psn = match p.psn {
            PsnSel::Expected => self.epsn,
            PsnSel::Delta(d) => psn_add(self.epsn, i32::from(d) as u32),
            PsnSel::Raw(x) => x & 0xFF_FFFF,
        };
        let (rkey, region) = p.key.get(&self.mem, KeyUse::Remote);
        let va = p.addr.get(&self.mem.regions[region]);
        let dma_len = p.dma_len.get(self.mtu);
        let mut plen = if op.has_payload() {
            (p.payload.get(self.mtu) as usize).min(2 * self.mtu as usize + 64)
        } else {
            0
        };
        if op.is_first() || op.is_middle() {
            plen &= !3;
        }
        let payload = vec![p.fill; plen];
        let mut repr = RcRepr::new(BthRepr {
            opcode: op,
            solicited: p.flags & 1 != 0,
            migreq: p.flags & 2 != 0,
            pad_count: 0,
            pkey: if p.flags & 4 != 0 { 0x7fff } else { 0xffff },
            fecn: p.flags & 8 != 0,
            becn: p.flags & 16 != 0,
            dest_qpn: p.wrong_qp.map_or(QPN, |q| q & 0xFF_FFFF),
            ack_req: p.flags & 32 != 0,
            psn,
        });
        let has = |k: HeaderKind| k.present_in(op);
        repr.reth = has(HeaderKind::Reth).then_some(RethRepr { va, rkey, dma_len });
        repr.atomic_eth = has(HeaderKind::AtomicEth).then_some(AtomicEthRepr {
            va,
            rkey,
            swap_add: p.swap_add,
            compare: p.compare,
        });
        repr.aeth = has(HeaderKind::Aeth).then_some(AethRepr {
            syndrome: Syndrome::Nak(NakCode::PsnSequenceError),
            msn: p.msn & 0xFF_FFFF,
        });
        repr.atomic_ack_eth = has(HeaderKind::AtomicAckEth).then_some(AtomicAckEthRepr {
            orig_data: p.compare,
        });
        repr.immdt = has(HeaderKind::ImmDt).then_some(ImmDtRepr { imm: p.imm });
        repr.ieth = has(HeaderKind::Ieth).then_some(IethRepr { rkey });
        repr.payload = &payload;
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit_with_payload(&mut buf)
            .expect("the harness builds consistent packets");
        if let Some(off) = HeaderKind::Aeth.offset_in(op) {
            buf[off] = p.syndrome; // any syndrome, reserved ones too
        }
        // Track the PSN a well-behaved requester would use next.
        if psn == self.epsn && op.is_request() {
            let n = if op == Opcode::RdmaReadRequest {
                dma_len.div_ceil(self.mtu).max(1)
            } else {
                1
            };
            self.epsn = psn_add(self.epsn, n);
        }
        let split = repr.header_len();
        self.deliver(&buf, p.deferred.then_some(split));
    }

    /// Feeds a packet whole, or as its first `split` bytes with the rest placed after.
    fn deliver(&mut self, bytes: &[u8], split: Option<usize>) {
        match split {
            None => self
                .qp
                .handle_packet_srq(self.now, &self.mem, self.srq.as_mut(), bytes),
            Some(k) => {
                let (header, rest) = bytes.split_at(k);
                let mut place = Vec::new();
                let got = self.qp.handle_header(
                    self.now,
                    &self.mem,
                    self.srq.as_mut(),
                    header,
                    rest.len(),
                    &mut place,
                );
                match got {
                    Some(len) => {
                        let repr = RcRepr::parse_bytes(bytes)
                            .expect("BUG: handle_header took a packet the parser refuses");
                        assert_eq!(len, repr.payload.len(), "BUG: payload length");
                        self.mem.place(&place, repr.payload);
                    }
                    None => assert!(place.is_empty(), "BUG: placements for a dropped packet"),
                }
            }
        }
    }

    fn transmit(&mut self, max: usize, parts: bool) {
        let mut t = Transmit::default();
        for n in 0.. {
            if n >= max {
                return;
            }
            assert!(n < 100_000, "BUG: poll_transmit never runs dry");
            let p = if parts {
                if !self.qp.poll_transmit_parts(self.now, &mut t) {
                    return;
                }
                self.mem.flatten(&t)
            } else {
                match self.qp.poll_transmit(self.now, &self.mem) {
                    Some(p) => p,
                    None => return,
                }
            };
            let r = check_sent(&p);
            rdmx_fuzz::trace!(
                "sent {} {:?}",
                r.bth.opcode,
                r.aeth.map(|a| a.syndrome.to_string())
            );
            assert!(
                r.bth.opcode.is_response(),
                "BUG: the responder sent a request: {r}"
            );
            // Follow the responder's expected PSN from its answers.
            if let (Opcode::Acknowledge, Some(a)) = (r.bth.opcode, r.aeth) {
                match a.syndrome {
                    Syndrome::Ack { .. } => self.epsn = psn_add(r.bth.psn, 1),
                    Syndrome::Nak(NakCode::PsnSequenceError) | Syndrome::RnrNak { .. } => {
                        self.epsn = r.bth.psn
                    }
                    _ => {}
                }
            }
        }
    }

    fn completions(&mut self) {
        while let Some((side, c, _)) = self.qp.poll_completion() {
            assert_eq!(
                side,
                CqSide::Recv,
                "BUG: send completion, nothing was posted: {c:?}"
            );
            assert_eq!(c.qp_num, QPN);
            assert!(
                !self.dropped.contains(&c.wr_id),
                "BUG: completion for a receive dropped by RESET: {c:?}"
            );
            assert!(
                self.completed.insert(c.wr_id),
                "BUG: receive completed twice: {c:?}"
            );
            rdmx_fuzz::trace!("completion {:?} {:?}", c.opcode, c.status);
            let (stamp, segs) = self
                .posted
                .remove(&c.wr_id)
                .unwrap_or_else(|| panic!("BUG: completion for a receive never posted: {c:?}"));
            if c.status == WcStatus::Success && c.opcode == WcOpcode::Recv {
                let segs = segs.expect("BUG: a receive with a bad SGE succeeded");
                let total: u64 = segs.iter().map(|&(_, l)| u64::from(l)).sum();
                assert!(
                    u64::from(c.byte_len) <= total,
                    "BUG: byte_len past the receive"
                );
                let mut left = u64::from(c.byte_len);
                for (a, l) in segs {
                    let n = left.min(u64::from(l));
                    assert!(
                        self.mem.written_since(a, n, stamp),
                        "BUG: receive {c:?} succeeded but bytes at {a:#x} were never written"
                    );
                    left -= n;
                }
            }
        }
        if self.qp.state() == QpState::Err && self.srq.is_none() {
            assert_eq!(self.qp.outstanding().1, 0, "BUG: receives left in ERR");
        }
    }
}
