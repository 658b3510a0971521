//! The RC engine under injected faults, on the loopback provider ([`rdmx::loopback::faults`]).
//!
//! Each test opens two loopback contexts whose packets are dropped, duplicated,
//! reordered, delayed, corrupted (bit flips caught by the CRC check) or mangled (headers
//! the engine must reject), runs a mixed workload — multi-packet WRITEs and READs, SENDs,
//! FETCH_ADDs and COMPARE_SWAPs — and checks every completion succeeded and every byte
//! landed as sent. FETCH_ADD counts must be exact: a duplicated or retransmitted atomic
//! executes once. The fault counters show the faults happened.
//!
//! The last tests lose every packet: every outstanding request must complete with an
//! error status (RETRY_EXC_ERR, then WR_FLUSH_ERR) within the retry budget, and dropping
//! the queue pair and region afterwards releases the memory.

mod common;

use std::time::{Duration, Instant};

use rdmx::loopback::faults::{FaultStats, Faults, PPM};
use rdmx::{
    Access, Completion, CompletionQueue, ConnectOptions, Context, LocalSge, Mapping, MemoryRegion,
    Mtu, QpCaps, QpState, QueuePair, RecvRequest, RemoteAddr, SendRequest, WcOpcode, WcStatus,
};

/// Generous bound for a whole workload on a loaded machine.
const DEADLINE: Duration = Duration::from_secs(120);
const REGION: usize = 64 * 1024;
const MSG: usize = 6 * 1024 + 100;
const ROUNDS: usize = 24;
/// Where the atomics' counter lives in B's region.
const COUNTER: usize = REGION - 8;
/// Where the compare-and-swap word lives in B's region.
const SWAP: usize = REGION - 16;

struct Side {
    ctx: Context,
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
}

/// A loopback context with `faults`. (This file is also a module of other providers'
/// test files, whose crate roots define their own `open_faulty` and `fault_stats`.)
#[allow(dead_code)]
fn open_faulty(faults: Option<Faults>) -> Context {
    let mut opts = rdmx::loopback::Options::default();
    if let Some(f) = faults {
        opts = opts.faults(f);
    }
    Context::open(opts).expect("open a loopback context")
}

#[allow(unused_imports)]
use rdmx::loopback::fault_stats;

fn side(faults: Option<Faults>) -> Side {
    let ctx = crate::open_faulty(faults);
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(1024).expect("create a CQ");
    let qp = pd
        .create_qp(
            &cq,
            &cq,
            QpCaps::default().max_send_wr(256).max_recv_wr(256),
        )
        .expect("create a QP");
    let mr = pd
        .register(Mapping::shared(REGION).expect("map"), Access::ALL)
        .expect("register");
    Side { ctx, cq, qp, mr }
}

/// The ack timeout code of [`options`] on loopback: 4.096 µs × 2^12 ≈ 17 ms, 8 tries
/// (about 135 ms) before a request fails. Loopback makes progress only on the polling
/// thread, so no thread can be kept from answering in time. (The crate roots of other
/// providers' test files define their own: where a driver thread answers, a slow
/// machine may keep it from running for longer than that.)
#[allow(dead_code)]
const FAULT_ACK_TIMEOUT: u8 = 12;

/// Connect options for lossy links: 1 KiB packets (multi-packet messages), a short ack
/// timeout ([`FAULT_ACK_TIMEOUT`] of the crate root) and the largest retry budget.
fn options() -> ConnectOptions {
    let mut o = ConnectOptions::default();
    o.mtu = Some(Mtu::Mtu1024);
    o.timeout = crate::FAULT_ACK_TIMEOUT;
    o.retry_cnt = 7;
    o.rnr_retry = 7;
    o
}

fn pair(a: Option<Faults>, b: Option<Faults>) -> (Side, Side) {
    let (a, b) = (side(a), side(b));
    a.qp.connect(b.qp.endpoint(), &options())
        .expect("connect A");
    b.qp.connect(a.qp.endpoint(), &options())
        .expect("connect B");
    (a, b)
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn image(mr: &MemoryRegion, off: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    mr.read_at(off, &mut v).expect("read");
    v
}

#[track_caller]
fn assert_bytes(actual: &[u8], expected: &[u8], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths");
    if let Some(i) = actual.iter().zip(expected).position(|(a, e)| a != e) {
        let n = actual.iter().zip(expected).filter(|(a, e)| a != e).count();
        panic!("{what}: {n} byte(s) differ, first at {i}");
    }
}

#[track_caller]
fn wait(cq: &CompletionQueue, start: Instant, what: &str) -> Completion {
    loop {
        if let Some(c) = cq.poll_one().expect("poll") {
            return c;
        }
        assert!(start.elapsed() < DEADLINE, "{what}: no completion");
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// The mixed workload, A requesting from B; checks every completion and every byte.
fn workload(a: &Side, b: &Side) {
    let start = Instant::now();
    let remote = |off: usize| RemoteAddr {
        addr: b.mr.addr() as u64 + off as u64,
        rkey: b.mr.rkey(),
    };
    let lsge = |off: usize, len: usize| LocalSge::new(&a.mr, off, len).expect("SGE");
    b.mr.write_at(COUNTER, &0u64.to_ne_bytes()).expect("zero");
    b.mr.write_at(SWAP, &0u64.to_ne_bytes()).expect("zero");
    for round in 0..ROUNDS {
        let w = pattern(round as u64 * 3 + 1, MSG);
        let s = pattern(round as u64 * 3 + 2, 1500);
        let rd = pattern(round as u64 * 3 + 3, MSG);
        a.mr.write_at(0, &w).expect("fill");
        a.mr.write_at(2 * MSG, &s).expect("fill");
        b.mr.write_at(3 * MSG, &rd).expect("fill");
        b.qp.post_recv(
            RecvRequest::new(100).sge(LocalSge::new(&b.mr, 5 * MSG, 2048).expect("SGE")),
        )
        .expect("post a receive");
        let reqs = [
            SendRequest::write(1, remote(0)).sge(lsge(0, MSG)),
            SendRequest::read(2, remote(3 * MSG)).sge(lsge(MSG, MSG)),
            SendRequest::send(3).sge(lsge(2 * MSG, 1500)),
            SendRequest::fetch_add(4, remote(COUNTER), 1).sge(lsge(4 * MSG, 8)),
            SendRequest::compare_swap(5, remote(SWAP), round as u64, round as u64 + 1)
                .sge(lsge(4 * MSG + 8, 8)),
        ];
        for r in reqs {
            a.qp.post_send(r).expect("post");
        }
        for id in 1..=5u64 {
            let c = wait(&a.cq, start, "a request");
            assert_eq!(
                (c.wr_id, c.status),
                (id, WcStatus::Success),
                "round {round}: {c:?}"
            );
        }
        let c = wait(&b.cq, start, "the receive");
        assert_eq!(
            (c.wr_id, c.status, c.opcode, c.byte_len),
            (100, WcStatus::Success, WcOpcode::Recv, 1500),
            "round {round}: {c:?}"
        );
        assert_bytes(&image(&b.mr, 0, MSG), &w, "WRITE data");
        assert_bytes(&image(&a.mr, MSG, MSG), &rd, "READ data");
        assert_bytes(&image(&b.mr, 5 * MSG, 1500), &s, "SEND data");
        let old = |off| u64::from_ne_bytes(image(&a.mr, off, 8).try_into().expect("8"));
        assert_eq!(old(4 * MSG), round as u64, "FETCH_ADD's old value");
        assert_eq!(old(4 * MSG + 8), round as u64, "COMPARE_SWAP's old value");
    }
    let val = |off| u64::from_ne_bytes(image(&b.mr, off, 8).try_into().expect("8"));
    assert_eq!(
        val(COUNTER),
        ROUNDS as u64,
        "each FETCH_ADD executed exactly once"
    );
    assert_eq!(
        val(SWAP),
        ROUNDS as u64,
        "each COMPARE_SWAP executed exactly once"
    );
    assert_eq!((a.qp.state(), b.qp.state()), (QpState::Rts, QpState::Rts));
}

/// Runs the workload with `f` on both sides and returns both sides' counters.
fn run(f: Faults) -> (FaultStats, FaultStats) {
    let mut fb = f.clone();
    fb.seed ^= 0xB;
    let (a, b) = pair(Some(f), Some(fb));
    workload(&a, &b);
    let sa = crate::fault_stats(&a.ctx).expect("A has faults");
    let sb = crate::fault_stats(&b.ctx).expect("B has faults");
    assert!(sa.packets > 0 && sb.packets > 0);
    eprintln!("fault counts: A {sa:?}, B {sb:?}");
    (sa, sb)
}

#[test]
fn workload_without_faults() {
    let (a, b) = pair(None, None);
    workload(&a, &b);
    assert_eq!(crate::fault_stats(&a.ctx), None);
}

#[test]
fn dropped_packets_are_retransmitted() {
    let (a, b) = run(Faults::seeded(1).drop(PPM / 20));
    assert!(a.dropped + b.dropped > 0, "{a:?} {b:?}");
}

#[test]
fn duplicated_packets_are_ignored() {
    let (a, b) = run(Faults::seeded(2).duplicate(PPM / 5));
    assert!(a.duplicated > 0 && b.duplicated > 0, "{a:?} {b:?}");
}

#[test]
fn reordered_packets_are_recovered() {
    let (a, b) = run(Faults::seeded(3).reorder(PPM / 10));
    assert!(a.reordered + b.reordered > 0, "{a:?} {b:?}");
}

#[test]
fn delayed_packets_are_tolerated() {
    // Some delays are longer than the ack timeout, so they also cause spurious
    // retransmissions and late duplicates.
    let (a, b) = run(Faults::seeded(4).delay(PPM / 10, Duration::from_millis(25)));
    assert!(a.delayed + b.delayed > 0, "{a:?} {b:?}");
}

#[test]
fn corrupted_packets_are_caught_by_the_crc_and_retransmitted() {
    let (a, b) = run(Faults::seeded(5).corrupt(PPM / 20));
    assert!(a.corrupted + b.corrupted > 0, "{a:?} {b:?}");
}

#[test]
fn mangled_headers_are_rejected_by_the_engine() {
    let (a, b) = run(Faults::seeded(6).mangle(PPM / 20));
    assert!(a.mangled + b.mangled > 0, "{a:?} {b:?}");
}

#[test]
fn every_fault_at_once() {
    let f = Faults::seeded(7)
        .drop(PPM / 50)
        .duplicate(PPM / 50)
        .reorder(PPM / 50)
        .delay(PPM / 50, Duration::from_millis(3))
        .corrupt(PPM / 50)
        .mangle(PPM / 50);
    let (a, b) = run(f);
    let sum = |s: FaultStats| s.dropped + s.duplicated + s.reordered + s.delayed + s.mangled;
    assert!(sum(a) + sum(b) > 0, "{a:?} {b:?}");
}

/// A link that loses every packet A sends: requests fail, none hangs, nothing leaks.
fn total_loss(a_faults: Faults, b_faults: Option<Faults>) {
    let (a, b) = pair(Some(a_faults), b_faults);
    let before = image(&b.mr, 0, REGION);
    let remote = |off: usize| RemoteAddr {
        addr: b.mr.addr() as u64 + off as u64,
        rkey: b.mr.rkey(),
    };
    let n = 40u64;
    for id in 0..n {
        let sge = LocalSge::new(&a.mr, (id as usize % 8) * MSG, MSG).expect("SGE");
        let req = match id % 4 {
            0 => SendRequest::write(id, remote(0)).sge(sge),
            1 => SendRequest::read(id, remote(MSG)).sge(sge),
            2 => SendRequest::fetch_add(id, remote(COUNTER), 1)
                .sge(LocalSge::new(&a.mr, REGION - 8, 8).expect("SGE")),
            _ => SendRequest::send(id).sge(sge),
        };
        a.qp.post_send(req).expect("post");
    }
    let start = Instant::now();
    let first = wait(&a.cq, start, "the first request");
    assert_eq!(
        (first.wr_id, first.status),
        (0, WcStatus::RetryExcErr),
        "{first:?}"
    );
    for id in 1..n {
        let c = wait(&a.cq, start, "a later request");
        assert_eq!((c.wr_id, c.status), (id, WcStatus::WrFlushErr), "{c:?}");
    }
    assert_eq!(a.qp.state(), QpState::Err);
    // Whatever B saw (nothing, or requests whose acks were lost), it stays consistent.
    if crate::fault_stats(&b.ctx).is_none() {
        assert_bytes(
            &image(&b.mr, 0, REGION),
            &before,
            "B's memory without any request",
        );
    }
    // Dropping the QP and the region unmaps A's memory: no request still holds it.
    // Regions are memfd-backed so that the file, not the address (which another test
    // thread may map again at once), shows whether A's memory is still mapped.
    let file = common::mapped_file(a.mr.addr()).expect("A's region is a mapped memfd");
    let Side { ctx, cq, qp, mr } = a;
    drop(qp);
    drop(mr);
    assert_eq!(ctx.registered_regions(), 0, "a registration leaked");
    assert!(
        !common::file_is_mapped(&file),
        "A's registered memory is still mapped"
    );
    drop(cq);
}

#[test]
fn total_loss_fails_every_request_within_the_retry_budget() {
    total_loss(Faults::seeded(8).drop(PPM), None);
}

#[test]
fn lost_acknowledgements_fail_every_request() {
    // A's requests arrive and execute, but every response B sends is lost.
    let (a, b) = (Faults::seeded(9), Faults::seeded(10).drop(PPM));
    total_loss(a, Some(b));
}
