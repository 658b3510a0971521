//! The RC engine's requester fed arbitrary responses.
//!
//! An `RcQp` in RTS, connected to a fake peer, with checked memory (`rdmx_fuzz::FakeMem`):
//!
//! | region | PD | access | role |
//! |---|---|---|---|
//! | 0 `L` | 1 | local write | where READ and atomic results land; also a source |
//! | 1 `S` | 1 | none | the bytes SENDs and WRITEs gather: must never change |
//! | 2 `P` | 2 | local write | another PD: must never change |
//! | 3 `W` | 1 | remote read | no local write: must never change |
//!
//! Send requests of every opcode (SEND, SEND with immediate, WRITE, WRITE with immediate,
//! READ, compare-and-swap, fetch-and-add; signaled or not, fenced, inline, with good and
//! bad SGEs) are posted, the packets they make are taken with `poll_transmit`, and the
//! requester is fed responses: ACKs, NAKs and RNR NAKs with any AETH syndrome and MSN,
//! READ responses with any payload length, ATOMIC ACKNOWLEDGEs, at PSNs near the ones
//! it sent; or honest answers to what it sent (some dropped); or raw bytes; whole or as
//! header now and payload placed later. Time passes and timeouts fire.
//!
//! Checked: no panic; every memory access stays inside the range resolved for the handle
//! used, with the right access (`FakeMem`), so READ data lands only inside the local
//! SGEs; guard bytes and the regions above never change; every packet sent parses and
//! goes to the peer; every work request completes at most once, in posting
//! order, and only if it was posted; a success completion is for a signaled request,
//! has the request's opcode and length, and for READ and atomics every byte of the local
//! SGEs was written after the post. At the end, unless the QP is draining or has no
//! retransmission timer, honest answers and timeouts must empty the send queue.
#![no_main]

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use rdmx_core::rc::{CqSide, MemAccess, QpConfig, RcQp, Transmit};
use rdmx_core::{
    Access, ConnectParams, KeyUse, PdId, QpLimits, QpState, RemoteAddr, SendFlags, SendOp, SendWr,
    Sge, SgeList, WcStatus,
};
use rdmx_fuzz::*;
use rdmx_wire::{
    psn_add, AethRepr, AtomicAckEthRepr, AtomicEthRepr, BthRepr, Credits, HeaderKind, IethRepr,
    ImmDtRepr, Opcode, RcRepr, RethRepr, Syndrome,
};

const PD1: PdId = PdId(1);
const PD2: PdId = PdId(2);
const L: usize = 0;
const S: usize = 1;
const P: usize = 2;
const W: usize = 3;
const MAX_STEPS: usize = 300;

#[derive(Arbitrary, Debug)]
struct Input {
    cfg: Cfg,
    sends: Vec<SendSpec>,
    steps: Vec<Step>,
}

#[derive(Arbitrary, Debug)]
struct Cfg {
    mtu: MtuSel,
    sq_psn: PsnStart,
    max_rd_atomic: u8,
    timeout: u8,
    retry_cnt: u8,
    rnr_retry: u8,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum OpSel {
    Send,
    SendImm(u32),
    Write,
    WriteImm(u32),
    Read,
    CompareSwap { compare: u64, swap: u64 },
    FetchAdd(u64),
}

#[derive(Arbitrary, Debug)]
struct SendSpec {
    op: OpSel,
    sges: Vec<SgeSpec>,
    /// Bits: signaled, fence, solicited, inline.
    flags: u8,
    remote: u64,
    rkey: u32,
    inline_len: LenSel,
}

#[derive(Arbitrary, Debug)]
struct SgeSpec {
    key: Option<KeySel>,
    addr: Option<AddrSel>,
    len: LenSel,
}

/// A PSN near one the requester sent: the `idx`-th latest request packet's, `within` its
/// PSN range (READs span several), plus `delta`.
#[derive(Arbitrary, Debug)]
enum PsnSel {
    Sent { idx: u8, within: u16, delta: i8 },
    Raw(u32),
}

#[derive(Arbitrary, Debug)]
enum RespOp {
    Ack,
    AtomicAck,
    ReadFirst,
    ReadMiddle,
    ReadLast,
    ReadOnly,
    Any(u8),
}

#[derive(Arbitrary, Debug)]
enum SynSel {
    Ack(u8),
    Rnr(u8),
    Nak(u8),
    Raw(u8),
}

#[derive(Arbitrary, Debug)]
struct Resp {
    op: RespOp,
    psn: PsnSel,
    syndrome: SynSel,
    msn: u32,
    payload: LenSel,
    orig: u64,
    fill: u8,
    wrong_qp: Option<u32>,
    deferred: bool,
}

#[derive(Arbitrary, Debug)]
enum Step {
    Post(SendSpec),
    Transmit {
        max: u8,
        parts: bool,
    },
    /// Honest answers to the next `n` request packets sent, skipping those whose bit is
    /// set in `drop`.
    Answer {
        n: u8,
        drop: u8,
        deferred: bool,
    },
    Response(Resp),
    Raw {
        bytes: Vec<u8>,
        deferred: bool,
        split: u8,
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

#[derive(Debug)]
struct WrInfo {
    op: SendOp,
    signaled: bool,
    len: u64,
    /// Memory stamp at post, and the local segments written to (READ, atomics), when all
    /// are valid.
    stamp: u64,
    scatter: Option<Vec<(u64, u32)>>,
}

/// A request packet the requester sent: PSN, opcode, PSNs it spans, and its headers.
#[derive(Clone, Copy, Debug)]
struct Sent {
    psn: u32,
    op: Opcode,
    npsn: u32,
    dma_len: u32,
    ack_req: bool,
}

struct Harness {
    qp: RcQp<FakeMem>,
    mem: FakeMem,
    params: ConnectParams,
    now: Instant,
    mtu: u32,
    next_wr: u64,
    /// Posted and not completed.
    wrs: BTreeMap<u64, WrInfo>,
    /// Dropped by a RESET: must never complete.
    dropped: Vec<u64>,
    last_completed: u64,
    sent: Vec<Sent>,
    unanswered: VecDeque<Sent>,
    cursor: [u64; 4],
    msn: u32,
}

fuzz_target!(|input: Input| {
    let mem = FakeMem::new(&[
        (PD1, 4096, Access::LOCAL_WRITE),
        (PD1, 2048, Access::empty()),
        (PD2, 1024, Access::LOCAL_WRITE),
        (PD1, 1024, Access::REMOTE_READ),
    ]);
    let c = &input.cfg;
    let params = ConnectParams {
        access: Access::all(),
        mtu: c.mtu.get(),
        dest_qpn: PEER_QPN,
        rq_psn: 0x77_0000,
        sq_psn: c.sq_psn.get(),
        max_rd_atomic: c.max_rd_atomic % 17,
        max_dest_rd_atomic: 4,
        timeout: c.timeout % 32,
        retry_cnt: c.retry_cnt % 8,
        rnr_retry: c.rnr_retry % 8,
        min_rnr_timer: 1,
    };
    let mut cfg = QpConfig::new(QPN, PD1);
    cfg.max_send_wr = 32;
    let mut qp = RcQp::new(cfg, QpLimits::default());
    connect(&mut qp, &params);
    let mut h = Harness {
        qp,
        mem,
        params,
        now: Instant::now(),
        mtu: params.mtu.bytes(),
        next_wr: 1,
        wrs: BTreeMap::new(),
        dropped: Vec::new(),
        last_completed: 0,
        sent: Vec::new(),
        unanswered: VecDeque::new(),
        cursor: [0; 4],
        msn: 0,
    };
    for s in input.sends.iter().take(32) {
        h.post(s);
    }
    for step in input.steps.iter().take(MAX_STEPS) {
        h.step(step);
        h.check();
    }
    h.settle();
});

impl Harness {
    fn check(&self) {
        self.mem.check_intact(&[S, P, W]);
    }

    fn step(&mut self, step: &Step) {
        match step {
            Step::Post(s) => self.post(s),
            Step::Transmit { max, parts } => self.transmit(usize::from(*max) + 1, *parts),
            Step::Answer { n, drop, deferred } => {
                for i in 0..usize::from(*n % 16) + 1 {
                    let Some(s) = self.unanswered.pop_front() else {
                        break;
                    };
                    if drop >> (i % 8) & 1 == 0 {
                        self.answer(s, *deferred);
                    }
                }
            }
            Step::Response(r) => self.response(r),
            Step::Raw {
                bytes,
                deferred,
                split,
            } => {
                let split = (usize::from(*split) % 64).min(bytes.len());
                self.deliver(bytes, deferred.then_some(split));
            }
            Step::Completions => self.completions(),
            Step::Advance { us, shift, force } => {
                self.now += Duration::from_micros(u64::from(*us)) * (1 << (shift % 12));
                if *force || self.qp.poll_timeout().is_some_and(|t| t <= self.now) {
                    self.qp.handle_timeout(self.now);
                }
            }
            Step::Modify(m) => m.apply(&mut self.qp),
            Step::Reconnect(psn) => {
                // Completions already made stay; RESET drops the rest without any.
                self.completions();
                self.dropped
                    .extend(std::mem::take(&mut self.wrs).into_keys());
                self.params.sq_psn = psn.get();
                self.sent.clear();
                self.unanswered.clear();
                connect(&mut self.qp, &self.params);
            }
        }
    }

    /// Fresh bytes of region `r` for a segment of `len` bytes.
    fn alloc(&mut self, r: usize, len: u64) -> u64 {
        let reg = &self.mem.regions[r];
        if self.cursor[r] + len > reg.len {
            self.cursor[r] = 0;
        }
        let addr = reg.addr + self.cursor[r];
        self.cursor[r] = (self.cursor[r] + len).next_multiple_of(8);
        addr
    }

    fn post(&mut self, spec: &SendSpec) {
        let op = match spec.op {
            OpSel::Send => SendOp::Send,
            OpSel::SendImm(i) => SendOp::SendWithImm(i),
            OpSel::Write => SendOp::Write(RemoteAddr {
                addr: spec.remote,
                rkey: spec.rkey,
            }),
            OpSel::WriteImm(i) => SendOp::WriteWithImm(
                RemoteAddr {
                    addr: spec.remote,
                    rkey: spec.rkey,
                },
                i,
            ),
            OpSel::Read => SendOp::Read(RemoteAddr {
                addr: spec.remote,
                rkey: spec.rkey,
            }),
            OpSel::CompareSwap { compare, swap } => SendOp::CompareSwap {
                remote: RemoteAddr {
                    addr: spec.remote & !7,
                    rkey: spec.rkey,
                },
                compare,
                swap,
            },
            OpSel::FetchAdd(add) => SendOp::FetchAdd {
                remote: RemoteAddr {
                    addr: spec.remote & !7,
                    rkey: spec.rkey,
                },
                add,
            },
        };
        let mut flags = SendFlags::empty();
        flags.set(SendFlags::SIGNALED, spec.flags & 1 != 0);
        flags.set(SendFlags::FENCE, spec.flags & 2 != 0);
        flags.set(SendFlags::SOLICITED, spec.flags & 4 != 0);
        let inline = spec.flags & 8 != 0 && !op.writes_local();
        let need = if op.writes_local() {
            Access::LOCAL_WRITE
        } else {
            Access::empty()
        };
        // Results land in L, sources are in S, unless the spec names a key.
        let home = if op.writes_local() { L } else { S };
        let mut scatter = Some(Vec::new());
        let mut sges = SgeList::new();
        let default_atomic = [SgeSpec {
            key: None,
            addr: None,
            len: LenSel::Tiny(7),
        }];
        let specs = if op.is_atomic() && spec.sges.is_empty() {
            &default_atomic[..]
        } else {
            &spec.sges[..spec.sges.len().min(5)]
        };
        for s in specs {
            let len = s.len.get(self.mtu);
            let (lkey, region) = match s.key {
                None => (self.mem.regions[home].lkey, home),
                Some(k) => k.get(&self.mem, KeyUse::Local),
            };
            let addr = match s.addr {
                None => self.alloc(region, u64::from(len)),
                Some(a) => a.get(&self.mem.regions[region]),
            };
            let ok = self
                .mem
                .resolve(lkey, KeyUse::Local, PD1, addr, u64::from(len), need)
                .is_ok();
            match (&mut scatter, ok) {
                (Some(v), true) => v.push((addr, len)),
                _ => scatter = None,
            }
            sges.push(Sge { addr, len, lkey });
        }
        let inline_data = inline.then(|| {
            flags |= SendFlags::INLINE;
            vec![0x3C; (spec.inline_len.get(self.mtu) as usize).min(300)]
        });
        let len = match &inline_data {
            Some(d) => d.len() as u64,
            None => sges.iter().map(|s| u64::from(s.len)).sum(),
        };
        let wr_id = self.next_wr;
        self.next_wr += 1;
        let wr = SendWr {
            wr_id,
            op,
            sges,
            flags,
            ud: None,
        };
        if self.qp.post_send(&self.mem, wr, inline_data).is_ok() {
            self.wrs.insert(
                wr_id,
                WrInfo {
                    op,
                    signaled: flags.contains(SendFlags::SIGNALED),
                    len,
                    stamp: self.mem.stamp(),
                    scatter: if op.writes_local() { scatter } else { None },
                },
            );
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
            let op = r.bth.opcode;
            if !op.is_request() {
                // This QP's responder answering a request among the fuzzed packets.
                continue;
            }
            let dma_len = r.reth.map_or(0, |x| x.dma_len);
            let s = Sent {
                psn: r.bth.psn,
                op,
                npsn: if op == Opcode::RdmaReadRequest {
                    dma_len.div_ceil(self.mtu).max(1)
                } else {
                    1
                },
                dma_len,
                ack_req: r.bth.ack_req,
            };
            if self.sent.len() >= 256 {
                self.sent.drain(..128);
            }
            self.sent.push(s);
            if self.unanswered.len() < 256 {
                self.unanswered.push_back(s);
            }
        }
    }

    /// What a correct responder answers to `s`.
    fn answer(&mut self, s: Sent, deferred: bool) {
        let ack = Syndrome::Ack {
            credits: Credits::UNLIMITED,
        };
        match s.op {
            Opcode::RdmaReadRequest => {
                self.msn = (self.msn + 1) & 0xFF_FFFF;
                for i in 0..s.npsn {
                    let (first, last) = (i == 0, i + 1 == s.npsn);
                    let op = match (first, last) {
                        (true, true) => Opcode::RdmaReadResponseOnly,
                        (true, false) => Opcode::RdmaReadResponseFirst,
                        (false, false) => Opcode::RdmaReadResponseMiddle,
                        (false, true) => Opcode::RdmaReadResponseLast,
                    };
                    let off = i * self.mtu;
                    let len = (s.dma_len - off).min(self.mtu);
                    let payload = vec![0xD7; len as usize];
                    let aeth = (first || last).then_some(AethRepr {
                        syndrome: ack,
                        msn: self.msn,
                    });
                    self.respond(op, psn_add(s.psn, i), aeth, None, &payload, deferred);
                }
            }
            Opcode::CompareSwap | Opcode::FetchAdd => {
                self.msn = (self.msn + 1) & 0xFF_FFFF;
                let aeth = Some(AethRepr {
                    syndrome: ack,
                    msn: self.msn,
                });
                self.respond(
                    Opcode::AtomicAcknowledge,
                    s.psn,
                    aeth,
                    Some(0x0123_4567_89AB_CDEF),
                    &[],
                    deferred,
                );
            }
            op => {
                if op.ends_message() {
                    self.msn = (self.msn + 1) & 0xFF_FFFF;
                }
                if s.ack_req {
                    let aeth = Some(AethRepr {
                        syndrome: ack,
                        msn: self.msn,
                    });
                    self.respond(Opcode::Acknowledge, s.psn, aeth, None, &[], deferred);
                }
            }
        }
    }

    fn respond(
        &mut self,
        op: Opcode,
        psn: u32,
        aeth: Option<AethRepr>,
        orig: Option<u64>,
        payload: &[u8],
        deferred: bool,
    ) {
        let mut repr = RcRepr::new(BthRepr {
            opcode: op,
            solicited: false,
            migreq: false,
            pad_count: 0,
            pkey: 0xffff,
            fecn: false,
            becn: false,
            dest_qpn: QPN,
            ack_req: false,
            psn,
        });
        repr.aeth = aeth;
        repr.atomic_ack_eth = orig.map(|orig_data| AtomicAckEthRepr { orig_data });
        repr.payload = payload;
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit_with_payload(&mut buf)
            .expect("the harness builds consistent packets");
        self.deliver(&buf, deferred.then_some(repr.header_len()));
    }

    fn response(&mut self, r: &Resp) {
        let op = match r.op {
            RespOp::Ack => Opcode::Acknowledge,
            RespOp::AtomicAck => Opcode::AtomicAcknowledge,
            RespOp::ReadFirst => Opcode::RdmaReadResponseFirst,
            RespOp::ReadMiddle => Opcode::RdmaReadResponseMiddle,
            RespOp::ReadLast => Opcode::RdmaReadResponseLast,
            RespOp::ReadOnly => Opcode::RdmaReadResponseOnly,
            RespOp::Any(b) => Opcode::ALL[usize::from(b) % Opcode::ALL.len()],
        };
        let psn = match r.psn {
            PsnSel::Sent { idx, within, delta } => match self.sent.len() {
                0 => psn_add(self.params.sq_psn, i32::from(delta) as u32),
                n => {
                    let s = self.sent[n - 1 - usize::from(idx) % n];
                    let p = psn_add(s.psn, u32::from(within) % s.npsn);
                    psn_add(p, i32::from(delta) as u32)
                }
            },
            PsnSel::Raw(p) => p & 0xFF_FFFF,
        };
        let syndrome = match r.syndrome {
            SynSel::Ack(c) => c % 32,
            SynSel::Rnr(t) => 0x20 | (t % 32),
            SynSel::Nak(n) => 0x60 | (n % 5),
            SynSel::Raw(b) => b,
        };
        let mut plen = if op.has_payload() {
            (r.payload.get(self.mtu) as usize).min(2 * self.mtu as usize + 64)
        } else {
            0
        };
        if op.is_first() || op.is_middle() {
            plen &= !3;
        }
        let payload = vec![r.fill; plen];
        let mut repr = RcRepr::new(BthRepr {
            opcode: op,
            solicited: false,
            migreq: false,
            pad_count: 0,
            pkey: 0xffff,
            fecn: false,
            becn: false,
            dest_qpn: r.wrong_qp.map_or(QPN, |q| q & 0xFF_FFFF),
            ack_req: false,
            psn,
        });
        let has = |k: HeaderKind| k.present_in(op);
        repr.reth = has(HeaderKind::Reth).then_some(RethRepr {
            va: r.orig,
            rkey: r.msn,
            dma_len: plen as u32,
        });
        repr.atomic_eth = has(HeaderKind::AtomicEth).then_some(AtomicEthRepr {
            va: r.orig & !7,
            rkey: r.msn,
            swap_add: r.orig,
            compare: r.orig,
        });
        repr.aeth = has(HeaderKind::Aeth).then_some(AethRepr {
            syndrome: Syndrome::Ack {
                credits: Credits::UNLIMITED,
            },
            msn: r.msn & 0xFF_FFFF,
        });
        repr.atomic_ack_eth =
            has(HeaderKind::AtomicAckEth).then_some(AtomicAckEthRepr { orig_data: r.orig });
        repr.immdt = has(HeaderKind::ImmDt).then_some(ImmDtRepr { imm: r.msn });
        repr.ieth = has(HeaderKind::Ieth).then_some(IethRepr { rkey: r.msn });
        repr.payload = &payload;
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit_with_payload(&mut buf)
            .expect("the harness builds consistent packets");
        if let Some(off) = HeaderKind::Aeth.offset_in(op) {
            buf[off] = syndrome;
        }
        let split = repr.header_len();
        self.deliver(&buf, r.deferred.then_some(split));
    }

    /// Feeds a packet whole, or as its first `split` bytes with the rest placed after.
    fn deliver(&mut self, bytes: &[u8], split: Option<usize>) {
        match split {
            None => self.qp.handle_packet(self.now, &self.mem, bytes),
            Some(k) => {
                let (header, rest) = bytes.split_at(k);
                let mut place = Vec::new();
                let got = self.qp.handle_header(
                    self.now,
                    &self.mem,
                    None,
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

    fn completions(&mut self) {
        while let Some((side, c, _)) = self.qp.poll_completion() {
            assert_eq!(
                side,
                CqSide::Send,
                "BUG: receive completion, none posted: {c:?}"
            );
            assert_eq!(c.qp_num, QPN);
            assert!(
                !self.dropped.contains(&c.wr_id),
                "BUG: completion for a request dropped by RESET: {c:?}"
            );
            assert!(
                c.wr_id > self.last_completed,
                "BUG: completion out of order or twice: {c:?} after wr {}",
                self.last_completed
            );
            self.last_completed = c.wr_id;
            let w = self
                .wrs
                .remove(&c.wr_id)
                .unwrap_or_else(|| panic!("BUG: completion for a request never posted: {c:?}"));
            // Everything posted before it is done: completions are in order.
            if let Some((&older, _)) = self.wrs.range(..c.wr_id).next_back() {
                assert!(
                    !self.wrs[&older].signaled,
                    "BUG: signaled wr {older} skipped by the completion of {c:?}"
                );
            }
            self.wrs.retain(|&id, _| id > c.wr_id);
            assert_eq!(c.opcode, w.op.wc_opcode(), "BUG: completion opcode: {c:?}");
            rdmx_fuzz::trace!(
                "completion {:?} {:?} signaled={}",
                c.opcode,
                c.status,
                w.signaled
            );
            if c.status != WcStatus::Success {
                continue;
            }
            assert!(w.signaled, "BUG: an unsignaled request completed: {c:?}");
            assert_eq!(u64::from(c.byte_len), w.len, "BUG: byte_len of {c:?}");
            if w.op.writes_local() {
                let segs = w
                    .scatter
                    .unwrap_or_else(|| panic!("BUG: success with a bad local SGE: {c:?}"));
                let mut left = if w.op.is_atomic() { 8 } else { w.len };
                for (a, l) in segs {
                    let n = left.min(u64::from(l));
                    assert!(
                        self.mem.written_since(a, n, w.stamp),
                        "BUG: {c:?} succeeded but its bytes at {a:#x} were never written"
                    );
                    left -= n;
                }
            }
        }
    }

    /// Honest answers and time until nothing is left to do; then the send queue must be
    /// empty, unless the QP drains (SQD starts nothing new) or has no timer (a lost
    /// answer is then waited for forever, as verbs' timeout 0 means).
    fn settle(&mut self) {
        self.unanswered.clear();
        for _ in 0..10_000 {
            self.transmit(usize::MAX, false);
            let pending: Vec<Sent> = self.unanswered.drain(..).collect();
            for s in &pending {
                self.answer(*s, false);
            }
            self.completions();
            self.check();
            if !pending.is_empty() {
                continue;
            }
            match self.qp.poll_timeout() {
                Some(t) => {
                    self.now = self.now.max(t);
                    self.qp.handle_timeout(self.now);
                }
                None => break,
            }
        }
        self.transmit(usize::MAX, false);
        self.completions();
        let state = self.qp.state();
        rdmx_fuzz::trace!("settled {state:?} outstanding={}", self.qp.outstanding().0);
        if self.params.timeout != 0 && matches!(state, QpState::Rts | QpState::Err) {
            assert_eq!(
                self.qp.outstanding().0,
                0,
                "BUG: requests stuck in {state:?} with an honest peer: {:?}",
                self.wrs
            );
        }
    }
}
