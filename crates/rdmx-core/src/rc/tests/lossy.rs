//! Random loss, duplication and reordering over mixed workloads of every operation, on
//! links that drop, repeat, reorder and delay packets, scripted and random.

use std::time::Duration;

use super::util::*;
use crate::qp::QpState;
use crate::wr::{SendOp, WcStatus};

/// What one operation should have produced.
#[derive(Debug)]
enum Expect {
    /// A SEND of these bytes into receive number `recv`.
    Send { data: Vec<u8>, recv: usize },
    /// A WRITE of these bytes at the responder's `addr`.
    Write { data: Vec<u8>, addr: u64 },
    /// A READ of these bytes into the requester's `addr`.
    Read { data: Vec<u8>, addr: u64 },
    /// The k-th FETCH_ADD (+1 on the counter): returns k, into the requester's `addr`.
    Faa { k: u64, addr: u64 },
    /// The k-th COMPARE_SWAP (k → k+1): returns k, into the requester's `addr`.
    Cas { k: u64, addr: u64 },
}

/// A workload from `req` to `resp`: every kind of operation, sizes around the MTU,
/// 1 to 3 SGEs. Returns the expectations and the responder's counter and CAS word.
struct Workload {
    expects: Vec<Expect>,
    /// Receives not posted yet (`late_recvs`), in order.
    pending_recvs: std::collections::VecDeque<(u64, Vec<crate::wr::Sge>)>,
    counter: u64,
    cas: u64,
    recv_slots: Vec<u64>,
    faa: u64,
    cases: u64,
}

const SLOT: u64 = 3 * 256 + 64;

fn sized(rng: &mut Rng) -> u32 {
    match rng.below(8) {
        0 => 0,
        1 => 1,
        2 => 255,
        3 => 256,
        4 => 257,
        _ => rng.below(3 * 256 + 1) as u32,
    }
}

fn build_workload(
    req: &mut Endpoint,
    resp: &mut Endpoint,
    n: usize,
    seed: u64,
    late_recvs: bool,
) -> Workload {
    let mut rng = Rng::new(seed);
    let src = req.mem.register(n as u64 * SLOT, ALL);
    let local = req.mem.register(n as u64 * SLOT, ALL);
    let area = resp.mem.register(n as u64 * SLOT, ALL);
    let words = resp.mem.register(16, ALL);
    let (counter, cas) = (words.addr, words.addr + 8);
    let mut w = Workload {
        expects: Vec::new(),
        pending_recvs: Default::default(),
        counter,
        cas,
        recv_slots: Vec::new(),
        faa: 0,
        cases: 0,
    };
    for i in 0..n as u64 {
        let slot = i * SLOT;
        let len = sized(&mut rng);
        let nsge = 1 + rng.below(3) as usize;
        let data = pattern(seed * 1000 + i, len as usize);
        let op = rng.below(5);
        let id = i;
        match op {
            0 => {
                req.mem.fill(src.addr + slot, &data);
                let recv = w.recv_slots.len();
                w.recv_slots.push(area.addr + slot);
                let sges = split_sges(&area, slot, SLOT as u32, 1 + rng.below(3) as usize);
                if late_recvs {
                    w.pending_recvs.push_back((1000 + recv as u64, sges));
                } else {
                    resp.recv(1000 + recv as u64, sges).unwrap();
                }
                let op = if rng.below(2) == 0 {
                    SendOp::Send
                } else {
                    SendOp::SendWithImm(i as u32)
                };
                req.post(wr(id, op, split_sges(&src, slot, len, nsge)))
                    .unwrap();
                w.expects.push(Expect::Send { data, recv });
            }
            1 => {
                req.mem.fill(src.addr + slot, &data);
                req.post(wr(
                    id,
                    SendOp::Write(area.remote(slot)),
                    split_sges(&src, slot, len, nsge),
                ))
                .unwrap();
                w.expects.push(Expect::Write {
                    data,
                    addr: area.addr + slot,
                });
            }
            2 => {
                // READs read what no later request writes: a retransmitted READ is
                // executed again and must see the same bytes.
                resp.mem.fill(area.addr + slot, &data);
                req.post(wr(
                    id,
                    SendOp::Read(area.remote(slot)),
                    split_sges(&local, slot, len, nsge),
                ))
                .unwrap();
                w.expects.push(Expect::Read {
                    data,
                    addr: local.addr + slot,
                });
            }
            3 => {
                req.post(wr(
                    id,
                    SendOp::FetchAdd {
                        remote: words.remote(0),
                        add: 1,
                    },
                    vec![local.sge(slot, 8)],
                ))
                .unwrap();
                w.expects.push(Expect::Faa {
                    k: w.faa,
                    addr: local.addr + slot,
                });
                w.faa += 1;
            }
            _ => {
                req.post(wr(
                    id,
                    SendOp::CompareSwap {
                        remote: words.remote(8),
                        compare: w.cases,
                        swap: w.cases + 1,
                    },
                    vec![local.sge(slot, 8)],
                ))
                .unwrap();
                w.expects.push(Expect::Cas {
                    k: w.cases,
                    addr: local.addr + slot,
                });
                w.cases += 1;
            }
        }
    }
    w
}

fn check_workload(w: &Workload, req: &Endpoint, resp: &Endpoint, ctx: &str) {
    let ids: Vec<(u64, WcStatus)> = req.sends();
    let expect: Vec<(u64, WcStatus)> = (0..w.expects.len() as u64)
        .map(|i| (i, WcStatus::Success))
        .collect();
    assert_eq!(ids, expect, "{ctx}: send completions, in order");
    let recvs: Vec<(u64, WcStatus)> = resp.recvs();
    let expect: Vec<(u64, WcStatus)> = (0..w.recv_slots.len() as u64)
        .map(|i| (1000 + i, WcStatus::Success))
        .collect();
    assert_eq!(recvs, expect, "{ctx}: receives, in order, each once");
    for (i, e) in w.expects.iter().enumerate() {
        match e {
            Expect::Send { data, recv } => {
                assert_eq!(
                    resp.recv_cq[*recv].c.byte_len as usize,
                    data.len(),
                    "{ctx} op {i}"
                );
                assert_eq!(
                    resp.mem.bytes(w.recv_slots[*recv], data.len()),
                    *data,
                    "{ctx} op {i}"
                );
            }
            Expect::Write { data, addr } => {
                assert_eq!(resp.mem.bytes(*addr, data.len()), *data, "{ctx} op {i}")
            }
            Expect::Read { data, addr } => {
                assert_eq!(req.mem.bytes(*addr, data.len()), *data, "{ctx} op {i}")
            }
            Expect::Faa { k, addr } | Expect::Cas { k, addr } => {
                assert_eq!(req.mem.u64_at(*addr), *k, "{ctx} op {i}")
            }
        }
    }
    assert_eq!(resp.mem.u64_at(w.counter), w.faa, "{ctx}: FETCH_ADD count");
    assert_eq!(resp.mem.u64_at(w.cas), w.cases, "{ctx}: CMP_SWAP count");
    assert_eq!(
        resp.mem.atomics.get(),
        w.faa + w.cases,
        "{ctx}: atomics executed exactly once"
    );
}

/// A random run: both directions at once, with these link and QP settings.
#[derive(Clone, Debug)]
struct Scenario {
    seed: u64,
    loss: f64,
    dup: f64,
    reorder: f64,
    late_dup: f64,
    latency: Duration,
    jitter: Duration,
    timeout: u8,
    max_rd: u8,
    mtu: crate::qp::Mtu,
    n: usize,
    /// Receives are posted a few at a time while running (RNR NAKs happen).
    late_recvs: bool,
    /// The responder side stops sending now and then (a full transport).
    stalls: bool,
    /// Both transports take at most this many packets every 5 µs.
    burst: Option<usize>,
}

impl Default for Scenario {
    fn default() -> Self {
        Scenario {
            seed: 1,
            loss: 0.0,
            dup: 0.0,
            reorder: 0.0,
            late_dup: 0.0,
            latency: Duration::from_micros(10),
            jitter: Duration::from_micros(40),
            timeout: 10,
            max_rd: 4,
            mtu: crate::qp::Mtu::Mtu256,
            n: 100,
            late_recvs: false,
            stalls: false,
            burst: None,
        }
    }
}

fn run(s: &Scenario) {
    let mut p = Pair::with(PairConfig {
        seed: s.seed,
        sq_psn_a: 0xff_ff00,
        timeout: s.timeout,
        max_rd_atomic: s.max_rd,
        max_dest_rd_atomic: s.max_rd,
        mtu: s.mtu,
        ..PairConfig::default()
    });
    for l in [&mut p.ab, &mut p.ba] {
        l.loss = s.loss;
        l.dup = s.dup;
        l.reorder = s.reorder;
        l.latency = s.latency;
        l.jitter = s.jitter;
        l.late_dup = s.late_dup;
        l.late_by = Duration::from_millis(7);
    }
    p.a.burst = s.burst;
    p.b.burst = s.burst;
    let mut wa = build_workload(&mut p.a, &mut p.b, s.n, s.seed * 2 + 1, s.late_recvs);
    let mut wb = build_workload(&mut p.b, &mut p.a, s.n / 2, s.seed * 2 + 2, s.late_recvs);
    let mut rng = Rng::new(s.seed ^ 0xfeed);
    // With receives to post or stalls to make, run in rounds of up to 6 ms.
    let rounds = if s.late_recvs || s.stalls { 20 } else { 0 };
    let mut round = 0;
    while round < rounds || !wa.pending_recvs.is_empty() || !wb.pending_recvs.is_empty() {
        round += 1;
        p.drive_for(Duration::from_micros(rng.below(6000)));
        for (w, ep) in [(&mut wa, &mut p.b), (&mut wb, &mut p.a)] {
            for _ in 0..rng.below(4) {
                if let Some((id, sges)) = w.pending_recvs.pop_front() {
                    ep.recv(id, sges).unwrap();
                }
            }
        }
        if s.stalls {
            p.b.hold = round % 3 == 1;
            p.a.hold = round % 5 == 2;
        }
    }
    p.a.hold = false;
    p.b.hold = false;
    p.drive();
    if std::env::var_os("RDMX_TRACE").is_some() {
        eprintln!("{}", p.trace());
    }
    let ctx = format!("{s:?}");
    check_workload(&wa, &p.a, &p.b, &format!("{ctx}, A→B"));
    check_workload(&wb, &p.b, &p.a, &format!("{ctx}, B→A"));
    assert_eq!(p.a.qp.state(), QpState::Rts, "{ctx}");
    assert_eq!(p.b.qp.state(), QpState::Rts, "{ctx}");
    assert_eq!(p.a.qp.outstanding(), (0, 0), "{ctx}");
    assert_eq!(p.b.qp.outstanding(), (0, 0), "{ctx}");
}

fn lossy_run(seed: u64, loss: f64, dup: f64, reorder: f64, late_dup: f64, n: usize) {
    run(&Scenario {
        seed,
        loss,
        dup,
        reorder,
        late_dup,
        n,
        ..Scenario::default()
    });
}

#[test]
fn mixed_workload_lossless() {
    for seed in 1..=3 {
        lossy_run(seed, 0.0, 0.0, 0.0, 0.0, 100);
    }
}

#[test]
fn mixed_workload_under_loss() {
    for seed in 1..=4 {
        for loss in [0.05, 0.15, 0.25] {
            lossy_run(seed, loss, 0.0, 0.0, 0.0, 100);
        }
    }
}

#[test]
fn mixed_workload_under_loss_duplication_and_reordering() {
    for seed in 1..=6 {
        for loss in [0.0, 0.1, 0.2] {
            lossy_run(seed, loss, 0.1, 0.3, 0.0, 100);
        }
    }
}

#[test]
fn mixed_workload_with_late_duplicates() {
    for seed in 1..=4 {
        lossy_run(seed, 0.1, 0.05, 0.2, 0.1, 100);
    }
}

#[test]
fn mixed_workload_every_packet_duplicated() {
    for seed in 1..=3 {
        lossy_run(seed, 0.0, 1.0, 0.0, 0.0, 60);
    }
}

#[test]
fn mixed_workload_posted_while_running() {
    let mut p = Pair::with(PairConfig {
        seed: 77,
        ..PairConfig::default()
    });
    for l in [&mut p.ab, &mut p.ba] {
        l.loss = 0.15;
        l.dup = 0.05;
        l.reorder = 0.3;
    }
    let mut batches = Vec::new();
    for round in 0..5u64 {
        // Each batch gets its own regions; completions accumulate.
        let base_a = p.a.send_cq.len();
        let w = build_workload(&mut p.a, &mut p.b, 20, 500 + round, false);
        batches.push((base_a, w));
        p.drive_for(Duration::from_micros(300));
    }
    p.drive();
    let ids: Vec<u64> = p.a.send_cq.iter().map(|w| w.c.wr_id).collect();
    let expect: Vec<u64> = (0..5).flat_map(|_| 0..20u64).collect();
    assert_eq!(ids, expect);
    assert!(p.a.send_cq.iter().all(|w| w.c.status == WcStatus::Success));
}

/// Every kind of trouble at once, over many seeds: loss with duplication, late copies and
/// reordering; a long, jittery link that makes the ACK timer fire early; receives posted
/// late (RNR NAKs); transports that stall for longer than the ACK timeout or take one
/// packet at a time; one READ/atomic in flight; a larger MTU. `RDMX_SEEDS=n` runs `n`
/// seeds per kind instead of 8 (`RDMX_SEED_FROM` moves the first), `RDMX_TRACE=1` prints
/// the wire of each run.
#[test]
fn random_scenarios() {
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    let n = env("RDMX_SEEDS").unwrap_or(8);
    let from = env("RDMX_SEED_FROM").unwrap_or(1000);
    for seed in from..from + n {
        let d = Scenario {
            seed,
            ..Scenario::default()
        };
        let lossy = Scenario {
            loss: 0.05,
            dup: 0.1,
            reorder: 0.3,
            ..d.clone()
        };
        let kinds = [
            Scenario {
                loss: 0.08,
                dup: 0.2,
                reorder: 0.5,
                late_dup: 0.2,
                ..d.clone()
            },
            Scenario {
                latency: Duration::from_micros(800),
                jitter: Duration::from_millis(3),
                reorder: 0.5,
                ..lossy.clone()
            },
            Scenario {
                late_recvs: true,
                ..lossy.clone()
            },
            Scenario {
                stalls: true,
                ..lossy.clone()
            },
            Scenario {
                max_rd: 1,
                ..lossy.clone()
            },
            Scenario {
                burst: Some(1 + seed as usize % 3),
                late_recvs: true,
                ..lossy.clone()
            },
            Scenario {
                mtu: crate::qp::Mtu::Mtu1024,
                timeout: 8,
                ..lossy.clone()
            },
            Scenario {
                loss: 0.02,
                dup: 0.3,
                reorder: 0.5,
                late_dup: 0.3,
                late_recvs: true,
                stalls: true,
                max_rd: 2,
                latency: Duration::from_micros(300),
                jitter: Duration::from_millis(1),
                ..d.clone()
            },
        ];
        for s in &kinds {
            run(s);
        }
    }
}
