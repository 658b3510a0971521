//! Atomics: COMPARE_SWAP and FETCH_ADD values, and FETCH_ADD from several QPs at once
//! interleaved with CPU atomics on the target.

use std::time::Instant;

use rdmx::{AtomicCap, RemoteAddr, SendOp, SendRequest, WcOpcode};

use super::{
    assert_bytes, check_ok, fill, image, lacks, raddr, register_page, sge, u64_at, wait_one, Pair,
    Provider, ALL, DEADLINE, LOCAL,
};

// ---- atomics ---------------------------------------------------------------------------

/// Runs one atomic per case against a fresh target value and checks the value returned
/// into the local element, the target after, and that no neighbouring byte moved.
fn atomic_cases(p: &Provider, kind: &str, cases: &[(u64, SendOpFn, u64, u64)]) {
    if lacks(p, "atomics", |c| c.atomics.supported()) {
        return;
    }
    let pair = p.pair();
    let target = register_page(&pair.b.pd, 4096, ALL);
    let local = register_page(&pair.a.pd, 4096, LOCAL);
    for (i, &(initial, make, after, arg)) in cases.iter().enumerate() {
        let what = format!("{}: {kind} case {i} (initial {initial:#x})", p.name);
        let (t, l) = (64 + 24 * i, 1024 + 16 * i);
        let mut exp_t = fill(&target, 10 + i as u64);
        let mut exp_l = fill(&local, 100 + i as u64);
        target.write_at(t, &initial.to_ne_bytes()).unwrap();
        exp_t[t..t + 8].copy_from_slice(&after.to_ne_bytes());
        exp_l[l..l + 8].copy_from_slice(&initial.to_ne_bytes());
        let (op, opcode) = make(raddr(&target, t), initial, arg);
        let wr_id = 500 + i as u64;
        pair.a
            .qp
            .post_send(SendRequest::new(wr_id, op).sge(sge(&local, l, 8)))
            .unwrap_or_else(|e| panic!("{what}: post_send: {e}"));
        let c = wait_one(&pair.a.scq, &what);
        check_ok(&c, wr_id, opcode, pair.a.qp.qp_num(), &what);
        assert_eq!(
            (u64_at(&image(&local), l), target.load_u64(t).unwrap()),
            (initial, after),
            "{what}: (value returned, target after)"
        );
        assert_bytes(&image(&target), &exp_t, &format!("{what}: target region"));
        assert_bytes(&image(&local), &exp_l, &format!("{what}: local region"));
    }
}

/// Builds an atomic from (remote, initial value, case argument).
type SendOpFn = fn(RemoteAddr, u64, u64) -> (SendOp, WcOpcode);

/// COMPARE_SWAP that matches (swaps) and that does not (leaves the target), with the old
/// value returned either way.
pub(crate) fn compare_swap_values(p: &Provider) {
    fn cs_eq(remote: RemoteAddr, initial: u64, swap: u64) -> (SendOp, WcOpcode) {
        let op = SendOp::CompareSwap {
            remote,
            compare: initial,
            swap,
        };
        (op, WcOpcode::CompSwap)
    }
    fn cs_ne(remote: RemoteAddr, initial: u64, swap: u64) -> (SendOp, WcOpcode) {
        let op = SendOp::CompareSwap {
            remote,
            compare: initial ^ 1,
            swap,
        };
        (op, WcOpcode::CompSwap)
    }
    let cases: [(u64, SendOpFn, u64, u64); 6] = [
        (5, cs_eq, 99, 99),
        (99, cs_ne, 99, 7),
        (
            u64::MAX,
            cs_eq,
            0x0123_4567_89ab_cdef,
            0x0123_4567_89ab_cdef,
        ),
        (0, cs_ne, 0, 2),
        (1 << 63, cs_eq, 1, 1),
        (0xffff_ffff, cs_ne, 0xffff_ffff, 0xffff_ffff_0000_0000),
    ];
    atomic_cases(p, "COMPARE_SWAP", &cases);
}

/// FETCH_ADD including carries across 32 bits and wrap-around at 2^64.
pub(crate) fn fetch_add_values(p: &Provider) {
    fn fa(remote: RemoteAddr, _initial: u64, add: u64) -> (SendOp, WcOpcode) {
        (SendOp::FetchAdd { remote, add }, WcOpcode::FetchAdd)
    }
    let cases: [(u64, SendOpFn, u64, u64); 5] = [
        (40, fa, 42, 2),
        (42, fa, 41, u64::MAX),
        (u64::MAX, fa, 1, 2),
        (0x1_ffff_ffff, fa, 0x2_0000_0000, 1),
        (7, fa, 7, 0),
    ];
    atomic_cases(p, "FETCH_ADD", &cases);
}

// ---- concurrent atomics ----------------------------------------------------------------

/// Four QP pairs on four threads each do 500 FETCH_ADDs of 1 on one target, while the
/// target's CPU adds 2^32 at a time: the sum is exact and every add saw a distinct value.
/// The CPU takes part only on a device whose atomics are atomic against the CPU's
/// ([`AtomicCap::Global`]); on one whose atomics are atomic among themselves only
/// (`IBV_ATOMIC_HCA`, as Soft-RoCE's), a CPU add racing a remote one may be lost, as the
/// verbs contract allows, so there the remote adds race each other alone.
pub(crate) fn concurrent_fetch_add_from_qps_and_cpu(p: &Provider) {
    if lacks(p, "atomics", |c| c.atomics.supported()) {
        return;
    }
    const QPS: usize = 4;
    const ADDS: usize = 500;
    const CPU_STEP: u64 = 1 << 32;
    let what = format!("{}: concurrent FETCH_ADD", p.name);
    let pd_a = p.open().alloc_pd();
    let ctx_b = p.open();
    let cpu_too = ctx_b.capabilities().atomics == AtomicCap::Global;
    let pd_b = ctx_b.alloc_pd();
    let target = register_page(&pd_b, 4096, ALL);
    let cfg = p.config();
    let pairs: Vec<Pair> = (0..QPS)
        .map(|_| {
            let pair = Pair {
                a: p.side_in(&pd_a, &cfg),
                b: p.side_in(&pd_b, &cfg),
            };
            p.connect(&pair.a, &cfg.opts, &pair.b, &cfg.opts);
            pair
        })
        .collect();
    let remote = raddr(&target, 0);
    let (remote_olds, cpu_olds) = std::thread::scope(|s| {
        let threads: Vec<_> = pairs
            .iter()
            .map(|pair| {
                let what = &what;
                s.spawn(move || {
                    let local = register_page(&pair.a.pd, 4096, LOCAL);
                    let qa = pair.a.qp.qp_num();
                    let mut olds = Vec::with_capacity(ADDS);
                    for k in 0..ADDS as u64 {
                        let op = SendOp::FetchAdd { remote, add: 1 };
                        pair.a
                            .qp
                            .post_send(SendRequest::new(k, op).sge(sge(&local, 0, 8)))
                            .unwrap_or_else(|e| panic!("{what}: post_send: {e}"));
                        let c = wait_one(&pair.a.scq, what);
                        check_ok(&c, k, WcOpcode::FetchAdd, qa, what);
                        olds.push(local.load_u64(0).unwrap());
                    }
                    olds
                })
            })
            .collect();
        // The target's CPU adds for as long as the remote adds run (a requester that
        // panics has finished too: its join below reports the panic), and at least 500
        // times.
        let mut cpu_olds = Vec::new();
        let start = Instant::now();
        while !threads.iter().all(|t| t.is_finished()) || (cpu_too && cpu_olds.len() < ADDS) {
            assert!(
                start.elapsed() < DEADLINE * 2,
                "{what}: the requesters did not finish within {:?}",
                DEADLINE * 2
            );
            if cpu_too {
                cpu_olds.push(target.fetch_add_u64(0, CPU_STEP).unwrap());
            }
            std::thread::yield_now();
        }
        let remote_olds: Vec<Vec<u64>> = threads
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect();
        (remote_olds, cpu_olds)
    });

    let remote_total = (QPS * ADDS) as u64;
    let expected = remote_total + cpu_olds.len() as u64 * CPU_STEP;
    assert_eq!(
        target.load_u64(0).unwrap(),
        expected,
        "{what}: final value ({} CPU adds)",
        cpu_olds.len()
    );
    for (i, olds) in remote_olds.iter().enumerate() {
        assert!(
            olds.windows(2).all(|w| w[0] < w[1]),
            "{what}: QP {i}'s returned values are not increasing"
        );
    }
    // Remote adds change the low 32 bits, CPU adds the high ones: the low halves of the
    // remote adds' old values are exactly 0..remote_total.
    let mut low: Vec<u64> = remote_olds
        .iter()
        .flatten()
        .map(|v| v & 0xffff_ffff)
        .collect();
    low.sort_unstable();
    assert!(
        low.iter().copied().eq(0..remote_total),
        "{what}: the remote adds did not each see a distinct count"
    );
    let mut all: Vec<u64> = remote_olds.into_iter().flatten().chain(cpu_olds).collect();
    let n = all.len();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), n, "{what}: two adds returned the same old value");
}
