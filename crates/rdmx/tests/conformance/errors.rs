//! Errors: protection (keys, bounds, access, domains), misaligned atomics, deregistered
//! keys and length errors (posting in the wrong state and flushing: `states`).
//!
//! Every remote error is checked the same way: the requester's completion has the verbs
//! status, the requester is in ERR, and the target region is unchanged byte for byte.

use rdmx::{
    Access, Error, MemoryRegion, PostError, QpState, RecvRequest, RemoteAddr, SendFlags, SendOp,
    SendRequest, WcOpcode, WcStatus,
};

use super::states::wait_state;
use super::{
    assert_bytes, check_ok, check_status, fill, image, lacks, raddr, register, register_page, sge,
    u64_at, wait_one, Pair, Provider, ALL, LOCAL,
};

/// A one-sided operation aimed at a responder's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RemoteOp {
    Write,
    WriteWithImm,
    Read,
    CompareSwap,
    FetchAdd,
}

use RemoteOp::{CompareSwap, FetchAdd, Read, Write, WriteWithImm};

const ALL_OPS: [RemoteOp; 5] = [Write, WriteWithImm, Read, CompareSwap, FetchAdd];

/// The request for `op`. A COMPARE_SWAP compares with `current` (the value there now, if
/// known) so that, were it executed, it would change the target.
fn request(
    op: RemoteOp,
    wr_id: u64,
    local: &MemoryRegion,
    remote: RemoteAddr,
    len: usize,
    current: u64,
) -> SendRequest<'static> {
    match op {
        Write => SendRequest::write(wr_id, remote).sge(sge(local, 0, len)),
        WriteWithImm => {
            SendRequest::new(wr_id, SendOp::WriteWithImm(remote, 0x1234)).sge(sge(local, 0, len))
        }
        Read => SendRequest::read(wr_id, remote).sge(sge(local, 0, len)),
        CompareSwap => SendRequest::new(
            wr_id,
            SendOp::CompareSwap {
                remote,
                compare: current,
                swap: !current,
            },
        )
        .sge(sge(local, 0, 8)),
        FetchAdd => {
            SendRequest::new(wr_id, SendOp::FetchAdd { remote, add: 1 }).sge(sge(local, 0, 8))
        }
    }
}

/// Posts `op` (of `len` bytes for WRITE and READ) from `pair.a` to `remote` and checks that
/// it completes with `status`, that A is in ERR, and that `watched` did not change.
fn expect_refused(
    pair: &Pair,
    op: RemoteOp,
    watched: &MemoryRegion,
    remote: RemoteAddr,
    len: usize,
    status: WcStatus,
    what: &str,
) {
    let what = format!("{what}: {op:?}");
    let caps = pair.a.caps();
    if (matches!(op, CompareSwap | FetchAdd) && !caps.atomics.supported())
        || (op == WriteWithImm && !caps.imm_data)
    {
        eprintln!("skipped: {what}: the device lacks the operation, by its capabilities");
        return;
    }
    let local = register_page(&pair.a.pd, len.max(8), LOCAL);
    fill(&local, 0xfeed);
    if op == WriteWithImm {
        // A receive for the immediate, so that an RNR cannot stand in for the error.
        pair.b
            .qp
            .post_recv(RecvRequest::new(900))
            .unwrap_or_else(|e| panic!("{what}: post_recv: {e}"));
    }
    let before = image(watched);
    let base = watched.addr() as u64;
    let current = match remote.addr.checked_sub(base) {
        Some(off) if off + 8 <= watched.len() as u64 => u64_at(&before, off as usize),
        _ => 0,
    };
    pair.a
        .qp
        .post_send(request(op, 1, &local, remote, len, current))
        .unwrap_or_else(|e| panic!("{what}: post_send: {e}"));
    let c = wait_one(&pair.a.scq, &what);
    let unacked = match op {
        Write | WriteWithImm => [
            WcStatus::Success,
            WcStatus::WrFlushErr,
            WcStatus::LocQpOpErr,
        ]
        .contains(&c.status),
        _ => [WcStatus::WrFlushErr, WcStatus::LocQpOpErr].contains(&c.status),
    };
    if unacked && !caps.remote_error_completions {
        // iWARP: the responder's refusal ends the connection instead. A WRITE completes
        // once sent; a request still being sent when the connection ends completes
        // LOC_QP_OP_ERR (siw), one not yet started is flushed.
        assert_eq!(
            (c.wr_id, c.qp_num),
            (1, pair.a.qp.qp_num()),
            "{what}: {c:?}"
        );
        wait_state(&pair.a.qp, QpState::Err, &what);
    } else {
        check_status(&c, 1, status, pair.a.qp.qp_num(), &what);
        // The device may report the completion a moment before it shows the QP in ERR.
        wait_state(&pair.a.qp, QpState::Err, &what);
    }
    assert_eq!(
        pair.a.qp.state(),
        QpState::Err,
        "{what}: the requester after an error completion"
    );
    assert_bytes(&image(watched), &before, &format!("{what}: target bytes"));
}

/// An rkey that names no region (a wrong key variant, an unused index) → RemAccessErr.
pub(crate) fn invalid_rkey(p: &Provider) {
    for op in ALL_OPS {
        for (how, mangle) in [
            ("wrong key variant", 0x0000_005au32),
            ("unused index", 0xff00_0000),
        ] {
            let pair = p.pair();
            let target = register_page(&pair.b.pd, 4096, ALL);
            fill(&target, 1);
            let mut remote = raddr(&target, 64);
            remote.rkey ^= mangle;
            let what = format!("{}: rkey with {how}", p.name);
            expect_refused(
                &pair,
                op,
                &target,
                remote,
                64,
                WcStatus::RemAccessErr,
                &what,
            );
        }
    }
}

/// Ranges that leave the region (across the end, before the start, a multi-packet WRITE
/// whose first packet fits, atomics just outside) → RemAccessErr, nothing written.
pub(crate) fn out_of_bounds(p: &Provider) {
    let m = p.mtu_bytes() as i64;
    let tlen = 2 * m;
    let mut cases: Vec<(RemoteOp, i64, usize, &str)> = Vec::new();
    for op in [Write, WriteWithImm, Read] {
        cases.push((op, tlen - 32, 64, "64 bytes across the end"));
        cases.push((op, -8, 64, "64 bytes from 8 before the start"));
        cases.push((
            op,
            m,
            m as usize + 1,
            "MTU+1 bytes, the last one past the end",
        ));
        cases.push((op, tlen, 1, "1 byte just past the end"));
    }
    for op in [CompareSwap, FetchAdd] {
        cases.push((op, tlen, 8, "8 bytes just past the end"));
        cases.push((op, -8, 8, "8 bytes just before the start"));
    }
    for (op, off, len, how) in cases {
        let pair = p.pair();
        let target = register_page(&pair.b.pd, tlen as usize, ALL);
        fill(&target, 2);
        let remote = RemoteAddr {
            addr: (target.addr() as i64 + off) as u64,
            rkey: target.rkey(),
        };
        let what = format!("{}: out of bounds, {how}", p.name);
        expect_refused(
            &pair,
            op,
            &target,
            remote,
            len,
            WcStatus::RemAccessErr,
            &what,
        );
    }
}

/// Regions that do not grant what the operation needs → RemAccessErr, nothing changed.
pub(crate) fn region_without_remote_access(p: &Provider) {
    let lw = Access::LOCAL_WRITE;
    let cases: [(Access, &[RemoteOp]); 5] = [
        (
            lw | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
            &[Write, WriteWithImm],
        ),
        (lw | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC, &[Read]),
        (
            lw | Access::REMOTE_READ | Access::REMOTE_WRITE,
            &[CompareSwap, FetchAdd],
        ),
        (lw, &ALL_OPS),
        (
            Access::REMOTE_READ,
            &[Write, WriteWithImm, CompareSwap, FetchAdd],
        ),
    ];
    for (access, ops) in cases {
        for &op in ops {
            let pair = p.pair();
            let target = register_page(&pair.b.pd, 4096, access);
            fill(&target, 3);
            let what = format!("{}: region with {access:?}", p.name);
            let remote = raddr(&target, 64);
            expect_refused(
                &pair,
                op,
                &target,
                remote,
                64,
                WcStatus::RemAccessErr,
                &what,
            );
        }
    }
}

/// A responder QP whose access flags lack what the operation needs, on a region that grants
/// everything → RemAccessErr, nothing changed.
pub(crate) fn qp_without_remote_access(p: &Provider) {
    let lw = Access::LOCAL_WRITE;
    let cases: [(Access, &[RemoteOp]); 4] = [
        (
            lw | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
            &[Write, WriteWithImm],
        ),
        (lw | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC, &[Read]),
        (
            lw | Access::REMOTE_READ | Access::REMOTE_WRITE,
            &[CompareSwap, FetchAdd],
        ),
        (Access::empty(), &ALL_OPS),
    ];
    for (access, ops) in cases {
        for &op in ops {
            let mut cfg = p.config();
            cfg.opts.access = access;
            let pair = p.pair_with(p.config(), cfg);
            let target = register_page(&pair.b.pd, 4096, ALL);
            fill(&target, 4);
            let what = format!("{}: responder QP with access {access:?}", p.name);
            let remote = raddr(&target, 64);
            expect_refused(
                &pair,
                op,
                &target,
                remote,
                64,
                WcStatus::RemAccessErr,
                &what,
            );
        }
    }
}

/// A region of another protection domain than the responder QP's → RemAccessErr, while
/// the same region in the QP's domain works.
pub(crate) fn wrong_pd(p: &Provider) {
    for op in ALL_OPS {
        let pair = p.pair();
        let other_pd = pair.b.pd.context().alloc_pd();
        assert_ne!(other_pd.id(), pair.b.pd.id(), "{}: a new PD", p.name);
        let target = register_page(&other_pd, 4096, ALL);
        fill(&target, 5);
        let what = format!("{}: region in another PD", p.name);
        let remote = raddr(&target, 64);
        expect_refused(
            &pair,
            op,
            &target,
            remote,
            64,
            WcStatus::RemAccessErr,
            &what,
        );
    }
    // Control: the same registration in the QP's own domain is reachable.
    let what = format!("{}: region in the QP's PD", p.name);
    let pair = p.pair();
    let target = register_page(&pair.b.pd, 4096, ALL);
    let src = register(&pair.a.pd, 64, LOCAL);
    let data = fill(&src, 6);
    pair.a
        .qp
        .post_send(SendRequest::write(1, raddr(&target, 64)).sge(sge(&src, 0, 64)))
        .unwrap();
    check_ok(
        &wait_one(&pair.a.scq, &what),
        1,
        WcOpcode::RdmaWrite,
        pair.a.qp.qp_num(),
        &what,
    );
    let mut got = vec![0u8; 64];
    target.read_at(64, &mut got).unwrap();
    assert_bytes(&got, &data, &what);
}

/// Atomics at remote addresses that are not 8-aligned are refused at post (as Soft-RoCE
/// does); the QP stays usable, nothing at the target changes, and an aligned atomic on
/// the same QP then succeeds.
pub(crate) fn misaligned_atomic(p: &Provider) {
    if lacks(p, "atomics", |c| c.atomics.supported()) {
        return;
    }
    let pair = p.pair();
    let target = register_page(&pair.b.pd, 4096, ALL);
    let local = register_page(&pair.a.pd, 8, LOCAL);
    fill(&target, 7);
    let before = image(&target);
    for op in [CompareSwap, FetchAdd] {
        for off in [1usize, 4, 12] {
            let what = format!("{}: {op:?} at offset {off} of a page", p.name);
            let remote = raddr(&target, off);
            match pair.a.qp.post_send(request(op, 1, &local, remote, 8, 0)) {
                Err(Error::Post(PostError::Invalid(_))) => {}
                other => panic!("{what}: got {other:?}, expected PostError::Invalid"),
            }
            assert_eq!(pair.a.qp.state(), QpState::Rts, "{what}: requester state");
        }
    }
    let what = format!("{}: aligned FetchAdd after the refused ones", p.name);
    let current = u64_at(&before, 16);
    pair.a
        .qp
        .post_send(request(FetchAdd, 2, &local, raddr(&target, 16), 8, current))
        .unwrap_or_else(|e| panic!("{what}: post_send: {e}"));
    let c = wait_one(&pair.a.scq, &what);
    check_status(&c, 2, WcStatus::Success, pair.a.qp.qp_num(), &what);
    assert_bytes(
        &image(&local),
        &before[16..24],
        &format!("{what}: fetched value"),
    );
    let after = image(&target);
    assert_bytes(
        &after[..16],
        &before[..16],
        &format!("{what}: bytes before"),
    );
    assert_bytes(&after[24..], &before[24..], &format!("{what}: bytes after"));
    assert_ne!(after[16..24], before[16..24], "{what}: the add landed");
}

/// Keys of deregistered regions: a stale rkey → RemAccessErr (and no live region of the
/// responder changes), also right after the same QP used it successfully (a transport
/// that remembers what it looked up must look again); a stale lkey in a send request →
/// LocProtErr; a stale lkey in a receive → LocProtErr at the receiver and RemOpErr at
/// the requester, also right after a receive into the region completed.
pub(crate) fn deregistered_keys(p: &Provider) {
    for op in [Write, Read] {
        let pair = p.pair();
        let used = register_page(&pair.b.pd, 4096, ALL);
        fill(&used, 11);
        let local = register_page(&pair.a.pd, 4096, LOCAL);
        fill(&local, 12);
        let remote = raddr(&used, 64);
        let what = format!("{}: {op:?} with an rkey used, then deregistered", p.name);
        for id in 1..=3 {
            pair.a
                .qp
                .post_send(request(op, id, &local, remote, 64, 0))
                .unwrap_or_else(|e| panic!("{what}: post_send: {e}"));
            let c = wait_one(&pair.a.scq, &what);
            check_status(&c, id, WcStatus::Success, pair.a.qp.qp_num(), &what);
        }
        let live = register_page(&pair.b.pd, 4096, ALL);
        fill(&live, 13);
        used.deregister();
        expect_refused(&pair, op, &live, remote, 64, WcStatus::RemAccessErr, &what);
    }

    for op in ALL_OPS {
        let pair = p.pair();
        let dead = register_page(&pair.b.pd, 4096, ALL);
        let remote = raddr(&dead, 64);
        dead.deregister();
        let live = register_page(&pair.b.pd, 4096, ALL);
        fill(&live, 8);
        let what = format!("{}: rkey of a deregistered region", p.name);
        expect_refused(&pair, op, &live, remote, 64, WcStatus::RemAccessErr, &what);
    }

    for op in ["SEND", "WRITE", "READ", "FETCH_ADD"] {
        let what = format!("{}: {op} with the lkey of a deregistered region", p.name);
        let pair = p.pair();
        let target = register_page(&pair.b.pd, 4096, ALL);
        let before = fill(&target, 9);
        let inbox = register(&pair.b.pd, 64, LOCAL);
        pair.b
            .qp
            .post_recv(RecvRequest::new(7).sge(sge(&inbox, 0, 64)))
            .unwrap();
        let local = register_page(&pair.a.pd, 4096, LOCAL);
        fill(&local, 10);
        let (s64, s8) = (sge(&local, 0, 64), sge(&local, 0, 8));
        local.deregister();
        let req = match op {
            "SEND" => SendRequest::send(1).sge(s64),
            "WRITE" => SendRequest::write(1, raddr(&target, 64)).sge(s64),
            "READ" => SendRequest::read(1, raddr(&target, 64)).sge(s64),
            _ => {
                let add = SendOp::FetchAdd {
                    remote: raddr(&target, 64),
                    add: 1,
                };
                SendRequest::new(1, add).sge(s8)
            }
        };
        pair.a
            .qp
            .post_send(req)
            .unwrap_or_else(|e| panic!("{what}: post_send: {e}"));
        let c = wait_one(&pair.a.scq, &what);
        check_status(&c, 1, WcStatus::LocProtErr, pair.a.qp.qp_num(), &what);
        assert_eq!(pair.a.qp.state(), QpState::Err, "{what}: requester state");
        assert_bytes(&image(&target), &before, &format!("{what}: target bytes"));
    }

    let what = format!("{}: receive with the lkey of a deregistered region", p.name);
    let pair = p.pair();
    let inbox = register(&pair.b.pd, 64, LOCAL);
    let src = register(&pair.a.pd, 64, LOCAL);
    // A receive into the region first, completed: a transport that keeps the region its
    // receives named must look the key up again once it is deregistered.
    pair.b
        .qp
        .post_recv(RecvRequest::new(6).sge(sge(&inbox, 0, 64)))
        .unwrap();
    pair.a
        .qp
        .post_send(SendRequest::send(0).sge(sge(&src, 0, 64)))
        .unwrap();
    let r = wait_one(&pair.b.rcq, &what);
    check_status(&r, 6, WcStatus::Success, pair.b.qp.qp_num(), &what);
    let c = wait_one(&pair.a.scq, &what);
    check_status(&c, 0, WcStatus::Success, pair.a.qp.qp_num(), &what);
    let stale = sge(&inbox, 0, 64);
    inbox.deregister();
    pair.b
        .qp
        .post_recv(RecvRequest::new(7).sge(stale))
        .unwrap_or_else(|e| panic!("{what}: post_recv: {e}"));
    pair.a
        .qp
        .post_send(SendRequest::send(1).sge(sge(&src, 0, 64)))
        .unwrap();
    let r = wait_one(&pair.b.rcq, &what);
    check_status(&r, 7, WcStatus::LocProtErr, pair.b.qp.qp_num(), &what);
    let c = wait_one(&pair.a.scq, &what);
    check_status(&c, 1, WcStatus::RemOpErr, pair.a.qp.qp_num(), &what);
    assert_eq!(pair.b.qp.state(), QpState::Err, "{what}: receiver state");
    assert_eq!(pair.a.qp.state(), QpState::Err, "{what}: requester state");
}

/// A SEND longer than the receive: LocLenErr at the receiver, RemInvReqErr at the
/// requester, both in ERR, nothing written outside the receive buffer.
pub(crate) fn send_longer_than_receive(p: &Provider) {
    let m = p.mtu_bytes();
    for (recv_len, send_len) in [(50, 100), (0, 1), (2 * m, 3 * m)] {
        let what = format!(
            "{}: {send_len}-byte SEND into a {recv_len}-byte receive",
            p.name
        );
        let pair = p.pair();
        let src = register(&pair.a.pd, send_len, LOCAL);
        fill(&src, 11);
        let inbox = register(&pair.b.pd, recv_len + 64, LOCAL);
        let before = fill(&inbox, 12);
        let mut recv = RecvRequest::new(7);
        if recv_len > 0 {
            recv = recv.sge(sge(&inbox, 0, recv_len));
        }
        pair.b.qp.post_recv(recv).unwrap();
        pair.a
            .qp
            .post_send(SendRequest::send(1).sge(sge(&src, 0, send_len)))
            .unwrap();
        let r = wait_one(&pair.b.rcq, &what);
        check_status(&r, 7, WcStatus::LocLenErr, pair.b.qp.qp_num(), &what);
        let c = wait_one(&pair.a.scq, &what);
        if !pair.a.caps().remote_error_completions && c.status == WcStatus::Success {
            // iWARP: the SEND completed once sent; the receiver's error ends the connection.
            wait_state(&pair.a.qp, QpState::Err, &what);
        } else {
            check_status(&c, 1, WcStatus::RemInvReqErr, pair.a.qp.qp_num(), &what);
        }
        assert_eq!(pair.b.qp.state(), QpState::Err, "{what}: receiver state");
        assert_eq!(pair.a.qp.state(), QpState::Err, "{what}: requester state");
        let got = image(&inbox);
        assert_bytes(
            &got[recv_len..],
            &before[recv_len..],
            &format!("{what}: bytes past the receive buffer"),
        );
    }
}

/// A SEND flagged INLINE whose element names a region deregistered since (its memory
/// may be freed): the flag does not let the bytes be read past the dead key. The post is
/// refused, or the request completes in error; the peer receives nothing.
pub(crate) fn inline_flag_with_a_stale_element(p: &Provider) {
    let what = format!(
        "{}: a SEND flagged INLINE naming a deregistered region",
        p.name
    );
    let pair = p.pair();
    if pair.a.qp.caps().max_inline_data < 64 {
        eprintln!("{what}: no inline data on this device; skipped");
        return;
    }
    let inbox = register(&pair.b.pd, 64, LOCAL);
    pair.b
        .qp
        .post_recv(RecvRequest::new(7).sge(sge(&inbox, 0, 64)))
        .unwrap();
    let src = register(&pair.a.pd, 4096, LOCAL);
    fill(&src, 3);
    let stale = sge(&src, 0, 64);
    src.deregister();
    let req = SendRequest::send(1)
        .sge(stale)
        .flags(SendFlags::SIGNALED | SendFlags::INLINE);
    if pair.a.qp.post_send(req).is_ok() {
        let c = wait_one(&pair.a.scq, &what);
        assert_eq!(c.wr_id, 1, "{what}: {c:?}");
        assert_ne!(c.status, WcStatus::Success, "{what}: {c:?}");
    }
    let start = std::time::Instant::now();
    while start.elapsed() < std::time::Duration::from_millis(200) {
        if let Some(c) = pair.b.rcq.poll_one().unwrap() {
            assert_ne!(
                c.status,
                WcStatus::Success,
                "{what}: the peer received {c:?}"
            );
        }
    }
}
