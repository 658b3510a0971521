//! Flow control and queues: selective signaling, full queues, CQ overrun, RNR, and
//! completion notification.

use std::time::Instant;

use rdmx::{
    Error, MemoryRegion, PostError, QpState, RecvRequest, SendFlags, SendOp, SendRequest, WcOpcode,
    WcStatus,
};

use super::{
    assert_bytes, assert_drained, assert_quiet, check_ok, check_status, fill, image, lacks, raddr,
    register, sge, wait_n, wait_one, wait_readable, Pair, Provider, ALL, DEADLINE, LOCAL,
};

/// Only signaled WRs complete; waiting for the last signaled WR of each batch frees the SQ,
/// so twelve times the SQ depth goes through an 8-deep SQ. Every WRITE's data lands.
pub(crate) fn selective_signaling(p: &Provider) {
    const DEPTH: usize = 8;
    const BATCHES: usize = 12;
    let mut cfg = p.config();
    cfg.caps = cfg.caps.max_send_wr(DEPTH);
    let pair = p.pair_with(cfg, p.config());
    let qa = pair.a.qp.qp_num();
    let src = register(&pair.a.pd, DEPTH * BATCHES * 16, LOCAL);
    let dst = register(&pair.b.pd, DEPTH * BATCHES * 16, ALL);
    let data = fill(&src, 1);
    fill(&dst, 2);
    for batch in 0..BATCHES {
        let what = format!("{}: selective signaling, batch {batch}", p.name);
        // Which WRs of the batch are signaled; the last always is.
        let signaled = |j: usize| match batch % 3 {
            0 => j == DEPTH - 1,
            1 => j == 3 || j == DEPTH - 1,
            _ => j == 0 || j == DEPTH - 1,
        };
        for j in 0..DEPTH {
            let k = batch * DEPTH + j;
            let flags = if signaled(j) {
                SendFlags::SIGNALED
            } else {
                SendFlags::empty()
            };
            pair.a
                .qp
                .post_send(
                    SendRequest::write(k as u64, raddr(&dst, 16 * k))
                        .sge(sge(&src, 16 * k, 16))
                        .flags(flags),
                )
                .unwrap_or_else(|e| panic!("{what}: post WR {j} of the batch: {e}"));
        }
        let expected: Vec<u64> = (0..DEPTH)
            .filter(|&j| signaled(j))
            .map(|j| (batch * DEPTH + j) as u64)
            .collect();
        let got = wait_n(&pair.a.scq, expected.len(), &what);
        for (c, &id) in got.iter().zip(&expected) {
            check_ok(c, id, WcOpcode::RdmaWrite, qa, &what);
        }
        // Completions come in order: with the batch's last WR reaped, nothing of it is left.
        assert_drained(&pair.a.scq, &what);
    }
    assert_bytes(
        &image(&dst),
        &data,
        &format!("{}: data of signaled and unsignaled WRITEs", p.name),
    );
}

/// With `max_send_wr` SENDs outstanding (stalled by RNR: no receive posted), one more post
/// fails at once with QueueFull; once receives are posted, all of them complete, in
/// order, with their data, and the SQ takes as many again.
pub(crate) fn send_queue_full(p: &Provider) {
    if lacks(p, "RNR waits", |c| c.rnr_retry) {
        return;
    }
    const DEPTH: usize = 8;
    let mut cfg = p.config();
    cfg.caps = cfg.caps.max_send_wr(DEPTH);
    cfg.opts.rnr_retry = 7;
    let pair = p.pair_with(cfg, p.config());
    let (qa, qb) = (pair.a.qp.qp_num(), pair.b.qp.qp_num());
    let src = register(&pair.a.pd, 2 * DEPTH * 32, LOCAL);
    let inbox = register(&pair.b.pd, 2 * DEPTH * 32, LOCAL);
    let data = fill(&src, 1);
    fill(&inbox, 2);
    let what = format!("{}: full send queue", p.name);
    let send = |k: usize| SendRequest::send(k as u64).sge(sge(&src, 32 * k, 32));
    for k in 0..DEPTH {
        pair.a
            .qp
            .post_send(send(k))
            .unwrap_or_else(|e| panic!("{what}: post {k} of {DEPTH}: {e}"));
    }
    match pair.a.qp.post_send(send(DEPTH)) {
        Err(Error::Post(PostError::QueueFull { .. })) => {}
        other => panic!("{what}: post beyond max_send_wr gave {other:?}, expected QueueFull"),
    }
    assert_quiet(&pair.a.scq, &format!("{what}: SENDs waiting for receives"));

    for round in 0..2 {
        let what = format!("{what}, round {round}");
        let ids: Vec<usize> = (round * DEPTH..(round + 1) * DEPTH).collect();
        for &k in &ids {
            pair.b
                .qp
                .post_recv(RecvRequest::new(k as u64).sge(sge(&inbox, 32 * k, 32)))
                .unwrap_or_else(|e| panic!("{what}: post_recv: {e}"));
        }
        if round == 1 {
            for &k in &ids {
                pair.a
                    .qp
                    .post_send(send(k))
                    .unwrap_or_else(|e| panic!("{what}: post {k} again: {e}"));
            }
        }
        let sent = wait_n(&pair.a.scq, DEPTH, &what);
        let recvd = wait_n(&pair.b.rcq, DEPTH, &what);
        for ((c, r), &k) in sent.iter().zip(&recvd).zip(&ids) {
            check_ok(c, k as u64, WcOpcode::Send, qa, &what);
            check_ok(r, k as u64, WcOpcode::Recv, qb, &what);
            assert_eq!(r.byte_len, 32, "{what}: {r:?}");
        }
    }
    assert_bytes(&image(&inbox), &data, &format!("{what}: received data"));
}

/// A post list (`post_send_list`) posts in order and stops at the first request refused,
/// naming its index: one the facade refuses (too many elements) leaves the ones before it
/// posted and run, one the queue refuses (full, SENDs stalled by RNR) likewise; the
/// posted part completes in order with its data.
pub(crate) fn post_list_stops_at_the_first_refused(p: &Provider) {
    let what = format!("{}: post list", p.name);
    const DEPTH: usize = 8;
    let mut cfg = p.config();
    cfg.caps = cfg.caps.max_send_wr(DEPTH);
    cfg.opts.rnr_retry = 7;
    let pair = p.pair_with(cfg, p.config());
    let (qa, qb) = (pair.a.qp.qp_num(), pair.b.qp.qp_num());
    let src = register(&pair.a.pd, 4 * DEPTH * 32, LOCAL);
    let dst = register(&pair.b.pd, 4 * DEPTH * 32, ALL);
    let data = fill(&src, 3);
    fill(&dst, 4);

    // WRITEs, the third with more elements than a request holds.
    let write =
        |k: usize| SendRequest::write(k as u64, raddr(&dst, 32 * k)).sge(sge(&src, 32 * k, 32));
    let mut too_long = write(2);
    // More than any request holds (32 elements).
    for _ in 0..40 {
        too_long = too_long.sge(sge(&src, 64, 1));
    }
    let list = [write(0), write(1), too_long, write(3)];
    match pair.a.qp.post_send_list(&list) {
        Err((2, Error::Post(PostError::TooManySges { .. }))) => {}
        other => panic!("{what}: list with a long third request gave {other:?}"),
    }
    let done = wait_n(&pair.a.scq, 2, &what);
    for (c, k) in done.iter().zip(0u64..) {
        check_ok(c, k, WcOpcode::RdmaWrite, qa, &what);
    }
    assert_quiet(
        &pair.a.scq,
        &format!("{what}: nothing after the refused request"),
    );
    assert_bytes(
        &image(&dst)[..64],
        &data[..64],
        &format!("{what}: the two WRITEs posted"),
    );
    assert_ne!(
        &image(&dst)[64..128],
        &data[64..128],
        "{what}: the refused WRITEs ran"
    );
    if lacks(p, "RNR waits", |c| c.rnr_retry) {
        return;
    }

    // SENDs stalled by RNR: the list fills the queue and stops there.
    let base = 2 * DEPTH;
    let send = |k: usize| SendRequest::send(k as u64).sge(sge(&src, 32 * k, 32));
    let list: Vec<SendRequest<'_>> = (base..base + DEPTH + 3).map(send).collect();
    match pair.a.qp.post_send_list(&list) {
        Err((DEPTH, Error::Post(PostError::QueueFull { .. }))) => {}
        other => panic!("{what}: list longer than the send queue gave {other:?}"),
    }
    assert_quiet(&pair.a.scq, &format!("{what}: SENDs waiting for receives"));
    for k in base..base + DEPTH {
        pair.b
            .qp
            .post_recv(RecvRequest::new(k as u64).sge(sge(&dst, 32 * k, 32)))
            .unwrap_or_else(|e| panic!("{what}: post_recv: {e}"));
    }
    let sent = wait_n(&pair.a.scq, DEPTH, &what);
    let recvd = wait_n(&pair.b.rcq, DEPTH, &what);
    for ((c, r), k) in sent.iter().zip(&recvd).zip(base as u64..) {
        check_ok(c, k, WcOpcode::Send, qa, &what);
        check_ok(r, k, WcOpcode::Recv, qb, &what);
    }
    let (from, to) = (32 * base, 32 * (base + DEPTH));
    assert_bytes(
        &image(&dst)[from..to],
        &data[from..to],
        &format!("{what}: received data"),
    );
}

/// With `max_recv_wr` receives posted, one more fails at once with QueueFull; receives
/// consumed by SENDs free their slots.
pub(crate) fn recv_queue_full(p: &Provider) {
    const DEPTH: usize = 8;
    let mut cfg = p.config();
    cfg.caps = cfg.caps.max_recv_wr(DEPTH);
    let pair = p.pair_with(p.config(), cfg);
    let (qa, qb) = (pair.a.qp.qp_num(), pair.b.qp.qp_num());
    let what = format!("{}: full receive queue", p.name);
    let src = register(&pair.a.pd, 64, LOCAL);
    let inbox = register(&pair.b.pd, (DEPTH + 2) * 64, LOCAL);
    let data = fill(&src, 1);
    let recv = |k: usize| RecvRequest::new(k as u64).sge(sge(&inbox, 64 * k, 64));
    for k in 0..DEPTH {
        pair.b
            .qp
            .post_recv(recv(k))
            .unwrap_or_else(|e| panic!("{what}: post {k} of {DEPTH}: {e}"));
    }
    match pair.b.qp.post_recv(recv(DEPTH)) {
        Err(Error::Post(PostError::QueueFull { .. })) => {}
        other => panic!("{what}: post beyond max_recv_wr gave {other:?}, expected QueueFull"),
    }
    // One SEND frees one slot.
    pair.a
        .qp
        .post_send(SendRequest::send(100).sge(sge(&src, 0, 64)))
        .unwrap();
    check_ok(
        &wait_one(&pair.a.scq, &what),
        100,
        WcOpcode::Send,
        qa,
        &what,
    );
    check_ok(&wait_one(&pair.b.rcq, &what), 0, WcOpcode::Recv, qb, &what);
    pair.b
        .qp
        .post_recv(recv(DEPTH))
        .unwrap_or_else(|e| panic!("{what}: post into the freed slot: {e}"));
    match pair.b.qp.post_recv(recv(DEPTH + 1)) {
        Err(Error::Post(PostError::QueueFull { .. })) => {}
        other => panic!("{what}: post beyond max_recv_wr again gave {other:?}"),
    }
    // The rest are consumed in order.
    for k in 1..=DEPTH {
        pair.a
            .qp
            .post_send(SendRequest::send(100 + k as u64).sge(sge(&src, 0, 64)))
            .unwrap();
        check_ok(
            &wait_one(&pair.a.scq, &what),
            100 + k as u64,
            WcOpcode::Send,
            qa,
            &what,
        );
        let r = wait_one(&pair.b.rcq, &what);
        check_ok(&r, k as u64, WcOpcode::Recv, qb, &what);
        let mut got = vec![0u8; 64];
        inbox.read_at(64 * k, &mut got).unwrap();
        assert_bytes(&got, &data, &format!("{what}: receive {k}"));
    }
}

/// More completions than a CQ holds: polling reports the overrun, and keeps reporting it.
pub(crate) fn cq_overrun(p: &Provider) {
    let mut cfg = p.config();
    cfg.send_cq = 2;
    cfg.caps = cfg.caps.max_send_wr(8);
    let pair = p.pair_with(cfg, p.config());
    let what = format!("{}: CQ overrun", p.name);
    let src = register(&pair.a.pd, 64, LOCAL);
    let dst = register(&pair.b.pd, 64, ALL);
    for k in 0..4u64 {
        pair.a
            .qp
            .post_send(SendRequest::write(k, raddr(&dst, 8 * k as usize)).sge(sge(&src, 0, 8)))
            .unwrap_or_else(|e| panic!("{what}: post {k}: {e}"));
    }
    // Poll without taking anything, so the completions can only pile up.
    let start = Instant::now();
    loop {
        match pair.a.scq.poll(&mut []) {
            Err(Error::CqOverrun) => break,
            Ok(0) => assert!(
                start.elapsed() < DEADLINE,
                "{what}: 4 completions into a 2-entry CQ, no overrun reported within {DEADLINE:?}"
            ),
            other => panic!("{what}: poll gave {other:?}"),
        }
        std::thread::yield_now();
    }
    let mut buf = [wait_slot(); 4];
    assert!(
        matches!(pair.a.scq.poll(&mut buf), Err(Error::CqOverrun)),
        "{what}: a poll after the overrun must report it"
    );
    assert!(
        matches!(pair.a.scq.poll_one(), Err(Error::CqOverrun)),
        "{what}: the overrun is sticky"
    );
}

fn wait_slot() -> rdmx::Completion {
    rdmx::Completion {
        wr_id: u64::MAX,
        status: WcStatus::GeneralErr,
        opcode: WcOpcode::Send,
        byte_len: 0,
        imm_data: None,
        qp_num: 0,
        src_qp: 0,
        grh: false,
    }
}

/// A SEND and a WRITE_WITH_IMM to a peer with no receive posted wait (rnr_retry 7) and
/// complete successfully once the receive is posted.
pub(crate) fn rnr_then_success(p: &Provider) {
    if lacks(p, "RNR waits", |c| c.rnr_retry) {
        return;
    }
    let mut cfg = p.config();
    cfg.opts.rnr_retry = 7;
    let pair = p.pair_with(cfg, p.config());
    let (qa, qb) = (pair.a.qp.qp_num(), pair.b.qp.qp_num());
    let src = register(&pair.a.pd, 4096, LOCAL);
    let inbox = register(&pair.b.pd, 4096, LOCAL);
    let dst = register(&pair.b.pd, 4096, ALL);
    let data = fill(&src, 1);
    fill(&inbox, 2);
    let mut exp_dst = fill(&dst, 3);

    let what = format!("{}: SEND after RNR", p.name);
    pair.a
        .qp
        .post_send(SendRequest::send(1).sge(sge(&src, 0, 1000)))
        .unwrap();
    assert_quiet(
        &pair.a.scq,
        &format!("{what}: before the receive is posted"),
    );
    pair.b
        .qp
        .post_recv(RecvRequest::new(11).sge(sge(&inbox, 0, 1000)))
        .unwrap();
    check_ok(&wait_one(&pair.a.scq, &what), 1, WcOpcode::Send, qa, &what);
    let r = wait_one(&pair.b.rcq, &what);
    check_ok(&r, 11, WcOpcode::Recv, qb, &what);
    assert_eq!(r.byte_len, 1000, "{what}");
    let mut got = vec![0u8; 1000];
    inbox.read_at(0, &mut got).unwrap();
    assert_bytes(&got, &data[..1000], &what);

    let what = format!("{}: WRITE_WITH_IMM after RNR", p.name);
    let op = SendOp::WriteWithImm(raddr(&dst, 100), 0x5eed);
    pair.a
        .qp
        .post_send(SendRequest::new(2, op).sge(sge(&src, 1000, 2000)))
        .unwrap();
    assert_quiet(
        &pair.a.scq,
        &format!("{what}: before the receive is posted"),
    );
    pair.b.qp.post_recv(RecvRequest::new(12)).unwrap();
    check_ok(
        &wait_one(&pair.a.scq, &what),
        2,
        WcOpcode::RdmaWrite,
        qa,
        &what,
    );
    let r = wait_one(&pair.b.rcq, &what);
    check_ok(&r, 12, WcOpcode::RecvRdmaWithImm, qb, &what);
    assert_eq!((r.byte_len, r.imm_data), (2000, Some(0x5eed)), "{what}");
    exp_dst[100..2100].copy_from_slice(&data[1000..3000]);
    assert_bytes(&image(&dst), &exp_dst, &what);

    // The connection still works.
    let what = format!("{}: SEND after the RNR waits", p.name);
    pair.b
        .qp
        .post_recv(RecvRequest::new(13).sge(sge(&inbox, 0, 16)))
        .unwrap();
    pair.a
        .qp
        .post_send(SendRequest::send(3).sge(sge(&src, 0, 16)))
        .unwrap();
    check_ok(&wait_one(&pair.a.scq, &what), 3, WcOpcode::Send, qa, &what);
    check_ok(&wait_one(&pair.b.rcq, &what), 13, WcOpcode::Recv, qb, &what);
}

/// With a small rnr_retry (0, 1, 2), a SEND that never finds a receive fails with
/// RnrRetryExcErr and the requester enters ERR.
pub(crate) fn rnr_retries_exhausted(p: &Provider) {
    if lacks(p, "RNR waits", |c| c.rnr_retry) {
        return;
    }
    for retries in [0u8, 1, 2] {
        let what = format!("{}: rnr_retry {retries}", p.name);
        let mut cfg = p.config();
        cfg.opts.rnr_retry = retries;
        let pair = p.pair_with(cfg, p.config());
        let src = register(&pair.a.pd, 64, LOCAL);
        pair.a
            .qp
            .post_send(SendRequest::send(1).sge(sge(&src, 0, 64)))
            .unwrap();
        let c = wait_one(&pair.a.scq, &what);
        check_status(&c, 1, WcStatus::RnrRetryExcErr, pair.a.qp.qp_num(), &what);
        assert_eq!(pair.a.qp.state(), QpState::Err, "{what}: requester state");
        assert_drained(&pair.b.rcq, &what);
    }
}

/// Posts receive `id` (64 bytes of `inbox`) on side b and SEND `id` (8 bytes of `src`)
/// on side a.
fn send_8_bytes(pair: &Pair, id: u64, src: &MemoryRegion, inbox: &MemoryRegion) {
    pair.b
        .qp
        .post_recv(RecvRequest::new(id).sge(sge(inbox, 0, 64)))
        .unwrap();
    pair.a
        .qp
        .post_send(SendRequest::send(id).sge(sge(src, 0, 8)))
        .unwrap();
}

/// `req_notify(false)`: the next completion makes the descriptor readable once; the
/// notification is consumed by `get_event` and not repeated until re-armed.
pub(crate) fn notify_any_completion(p: &Provider) {
    let pair = p.pair();
    let (qa, qb) = (pair.a.qp.qp_num(), pair.b.qp.qp_num());
    let src = register(&pair.a.pd, 64, LOCAL);
    let inbox = register(&pair.b.pd, 64, ALL);
    let what = format!("{}: notification", p.name);

    assert!(!pair.b.rcq.get_event(), "{what}: an event before arming");
    pair.b.rcq.req_notify(false);
    assert!(
        !pair.b.rcq.get_event(),
        "{what}: an event before any completion"
    );
    send_8_bytes(&pair, 1, &src, &inbox);
    wait_readable(&pair.b.rcq, &format!("{what}: armed receive CQ"));
    assert!(
        pair.b.rcq.get_event(),
        "{what}: get_event after a completion"
    );
    assert!(!pair.b.rcq.get_event(), "{what}: the event is consumed");
    check_ok(&wait_one(&pair.b.rcq, &what), 1, WcOpcode::Recv, qb, &what);
    check_ok(&wait_one(&pair.a.scq, &what), 1, WcOpcode::Send, qa, &what);

    // Not re-armed: the next completion is not notified.
    send_8_bytes(&pair, 2, &src, &inbox);
    check_ok(&wait_one(&pair.b.rcq, &what), 2, WcOpcode::Recv, qb, &what);
    check_ok(&wait_one(&pair.a.scq, &what), 2, WcOpcode::Send, qa, &what);
    assert!(
        !pair.b.rcq.get_event(),
        "{what}: an event without re-arming"
    );

    // Send CQs notify too.
    pair.a.scq.req_notify(false);
    pair.a
        .qp
        .post_send(SendRequest::write(3, raddr(&inbox, 0)).sge(sge(&src, 0, 8)))
        .unwrap();
    wait_readable(&pair.a.scq, &format!("{what}: armed send CQ"));
    assert!(pair.a.scq.get_event(), "{what}: get_event on the send CQ");
    check_ok(
        &wait_one(&pair.a.scq, &what),
        3,
        WcOpcode::RdmaWrite,
        qa,
        &what,
    );
}

/// `wait_event`: returns false at its timeout while nothing completes, true (consuming
/// the event) once an armed CQ gets a completion, and false again until re-armed.
pub(crate) fn wait_event_blocks_until_a_completion(p: &Provider) {
    let pair = p.pair();
    let qb = pair.b.qp.qp_num();
    let src = register(&pair.a.pd, 64, LOCAL);
    let inbox = register(&pair.b.pd, 64, ALL);
    let what = format!("{}: wait_event", p.name);
    let short = std::time::Duration::from_millis(20);

    pair.b.rcq.req_notify(false);
    assert!(
        !pair.b.rcq.wait_event(short).unwrap(),
        "{what}: an event with nothing completed"
    );
    send_8_bytes(&pair, 1, &src, &inbox);
    assert!(
        pair.b.rcq.wait_event(DEADLINE).unwrap(),
        "{what}: no event within {DEADLINE:?} of a completion on an armed CQ"
    );
    check_ok(&wait_one(&pair.b.rcq, &what), 1, WcOpcode::Recv, qb, &what);
    wait_one(&pair.a.scq, &what);
    assert!(
        !pair.b.rcq.wait_event(short).unwrap(),
        "{what}: the event was consumed and the CQ not re-armed"
    );
}

/// `req_notify(true)`: an unsolicited successful completion does not notify (and leaves the
/// CQ armed); a SEND with the solicited flag does, and so does an error completion.
pub(crate) fn notify_solicited_only(p: &Provider) {
    let pair = p.pair();
    let (qa, qb) = (pair.a.qp.qp_num(), pair.b.qp.qp_num());
    let src = register(&pair.a.pd, 64, LOCAL);
    let inbox = register(&pair.b.pd, 64, ALL);
    let data = fill(&src, 1);
    let what = format!("{}: solicited-only notification", p.name);

    pair.b.rcq.req_notify(true);
    send_8_bytes(&pair, 1, &src, &inbox);
    check_ok(&wait_one(&pair.b.rcq, &what), 1, WcOpcode::Recv, qb, &what);
    check_ok(&wait_one(&pair.a.scq, &what), 1, WcOpcode::Send, qa, &what);
    assert!(
        !pair.b.rcq.get_event(),
        "{what}: an unsolicited SEND notified"
    );

    pair.b
        .qp
        .post_recv(RecvRequest::new(2).sge(sge(&inbox, 0, 64)))
        .unwrap();
    pair.a
        .qp
        .post_send(
            SendRequest::send(2)
                .sge(sge(&src, 8, 16))
                .flags(SendFlags::SIGNALED | SendFlags::SOLICITED),
        )
        .unwrap();
    wait_readable(&pair.b.rcq, &format!("{what}: solicited SEND"));
    assert!(
        pair.b.rcq.get_event(),
        "{what}: get_event after a solicited SEND"
    );
    let r = wait_one(&pair.b.rcq, &what);
    check_ok(&r, 2, WcOpcode::Recv, qb, &what);
    assert_eq!(r.byte_len, 16, "{what}");
    let mut got = vec![0u8; 16];
    inbox.read_at(0, &mut got).unwrap();
    assert_bytes(&got, &data[8..24], &what);
    check_ok(&wait_one(&pair.a.scq, &what), 2, WcOpcode::Send, qa, &what);

    // On the send CQ: a successful WRITE does not notify, a failed one does.
    pair.a.scq.req_notify(true);
    pair.a
        .qp
        .post_send(SendRequest::write(3, raddr(&inbox, 0)).sge(sge(&src, 0, 8)))
        .unwrap();
    check_ok(
        &wait_one(&pair.a.scq, &what),
        3,
        WcOpcode::RdmaWrite,
        qa,
        &what,
    );
    assert!(
        !pair.a.scq.get_event(),
        "{what}: a successful WRITE notified"
    );
    let mut bad = raddr(&inbox, 0);
    bad.rkey ^= 0x5a;
    pair.a
        .qp
        .post_send(SendRequest::write(4, bad).sge(sge(&src, 0, 8)))
        .unwrap();
    wait_readable(&pair.a.scq, &format!("{what}: error completion"));
    assert!(
        pair.a.scq.get_event(),
        "{what}: get_event after an error completion"
    );
    check_status(
        &wait_one(&pair.a.scq, &what),
        4,
        WcStatus::RemAccessErr,
        qa,
        &what,
    );
}

/// Two threads polling one CQ while a third posts: every request's completion comes
/// out exactly once, to one of them, and each thread sees its completions in posting
/// order.
pub(crate) fn two_threads_polling_one_cq(p: &Provider) {
    const N: u64 = 2000;
    let pair = p.pair();
    let src = register(&pair.a.pd, 8, LOCAL);
    let dst = register(&pair.b.pd, 8, ALL);
    let what = format!("{}: two threads polling one CQ", p.name);
    let got = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        let pollers: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    let start = Instant::now();
                    while got.lock().unwrap().len() < N as usize {
                        assert!(
                            start.elapsed() < DEADLINE * 3,
                            "{what}: completions missing"
                        );
                        if let Some(c) = pair.a.scq.poll_one().unwrap() {
                            assert_eq!(c.status, WcStatus::Success, "{what}: {c:?}");
                            mine.push(c.wr_id);
                            got.lock().unwrap().push(c.wr_id);
                        }
                    }
                    mine
                })
            })
            .collect();
        // No more outstanding than the CQ holds: it never overruns.
        let cap = pair.a.scq.capacity() as u64;
        let mut id = 0;
        let start = Instant::now();
        while id < N {
            if id - got.lock().unwrap().len() as u64 >= cap {
                std::thread::yield_now();
                assert!(
                    start.elapsed() < DEADLINE * 3,
                    "{what}: completions stalled"
                );
                continue;
            }
            let req = SendRequest::write(id, raddr(&dst, 0)).sge(sge(&src, 0, 8));
            match pair.a.qp.post_send(req) {
                Ok(()) => id += 1,
                Err(Error::Post(PostError::QueueFull { .. })) => std::thread::yield_now(),
                Err(e) => panic!("{what}: post {id}: {e}"),
            }
            assert!(start.elapsed() < DEADLINE * 3, "{what}: posting stalled");
        }
        for t in pollers {
            let mine = t.join().unwrap();
            assert!(
                mine.windows(2).all(|w| w[0] < w[1]),
                "{what}: one thread saw completions out of order"
            );
        }
    });
    let mut all = got.into_inner().unwrap();
    all.sort_unstable();
    assert_eq!(
        all,
        (0..N).collect::<Vec<_>>(),
        "{what}: every completion once"
    );
}

/// A queue pair destroyed with completions still in its CQ (its receive flushed, not
/// polled), then a new one on the same CQs (an adapter may give it the same number):
/// none of the old completions is taken for the new queue pair's requests.
pub(crate) fn a_new_queue_pair_gets_no_completion_of_a_destroyed_one(p: &Provider) {
    let what = format!("{}: a QP made after one destroyed on its CQs", p.name);
    let pair = p.pair();
    let inbox = register(&pair.b.pd, 64, LOCAL);
    pair.b
        .qp
        .post_recv(RecvRequest::new(1).sge(sge(&inbox, 0, 64)))
        .unwrap();
    pair.b
        .qp
        .modify(
            &rdmx::QpAttr {
                qp_state: QpState::Err,
                ..Default::default()
            },
            rdmx::QpAttrMask::STATE,
        )
        .unwrap();
    let super::Pair { a: _a, b } = pair;
    let super::Side { pd, scq, rcq, qp } = b;
    let caps = qp.caps();
    drop(qp);
    let c = pd.create_qp(&scq, &rcq, caps).unwrap();
    let init = rdmx::QpAttr {
        qp_state: QpState::Init,
        pkey_index: 0,
        port_num: 1,
        qp_access_flags: p.options().access,
        ..Default::default()
    };
    let mask = rdmx::QpAttrMask::STATE
        | rdmx::QpAttrMask::PKEY_INDEX
        | rdmx::QpAttrMask::PORT
        | rdmx::QpAttrMask::ACCESS_FLAGS;
    c.modify(&init, mask)
        .unwrap_or_else(|e| panic!("{what}: RESET to INIT: {e}"));
    c.post_recv(RecvRequest::new(7).sge(sge(&inbox, 0, 64)))
        .unwrap();
    let start = Instant::now();
    while start.elapsed() < std::time::Duration::from_millis(300) {
        if let Some(got) = rcq.poll_one().unwrap() {
            assert_ne!(
                got.qp_num,
                c.qp_num(),
                "{what}: the new QP got a completion: {got:?}"
            );
        }
    }
}

/// Two threads wait on one CQ (`CompletionQueue::wait`) for one completion each, the
/// second completion coming after the first was taken: both return with one within a
/// bounded time (before, the thread whose wake-up the other took slept on, unarmed, to its
/// timeout).
pub(crate) fn two_threads_waiting_on_one_cq(p: &Provider) {
    const TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);
    let pair = p.pair();
    let src = register(&pair.a.pd, 8, LOCAL);
    let dst = register(&pair.b.pd, 8, ALL);
    let what = format!("{}: two threads waiting on one CQ", p.name);
    std::thread::scope(|s| {
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    let start = Instant::now();
                    let mut c = [rdmx::Completion::default()];
                    let n = pair.a.scq.wait(&mut c, TIMEOUT).unwrap();
                    (n, c[0], start.elapsed())
                })
            })
            .collect();
        for id in 0..2 {
            // Both asleep first; the second completion after the first was taken.
            std::thread::sleep(std::time::Duration::from_millis(200));
            let req = SendRequest::write(id, raddr(&dst, 0)).sge(sge(&src, 0, 8));
            pair.a.qp.post_send(req).unwrap();
        }
        let mut ids = Vec::new();
        for t in waiters {
            let (n, c, took) = t.join().unwrap();
            assert_eq!((n, c.status), (1, WcStatus::Success), "{what}: {c:?}");
            assert!(
                took < TIMEOUT / 2,
                "{what}: a waiter returned after {took:?} (its timeout is {TIMEOUT:?})"
            );
            ids.push(c.wr_id);
        }
        ids.sort_unstable();
        assert_eq!(ids, [0, 1], "{what}");
    });
}
