//! Posting in each state a queue pair can be in, and an error that flushes what is
//! outstanding.

use rdmx::{
    Error, PostError, QpAttr, QpAttrMask, QpState, RecvRequest, SendFlags, SendOp, SendRequest,
    WcOpcode, WcStatus,
};

use super::{
    assert_bytes, assert_drained, check_ok, check_status, fill, image, lacks, raddr, register,
    register_page, sge, wait_n, wait_one, Provider, ALL, DEADLINE, LOCAL,
};

/// Waits until `qp` is in `state` (a queue pair the peer's error moves there).
#[track_caller]
pub(crate) fn wait_state(qp: &rdmx::QueuePair, state: QpState, what: &str) {
    let start = std::time::Instant::now();
    while qp.state() != state {
        assert!(
            start.elapsed() < DEADLINE,
            "{what}: the queue pair stayed in {:?}, not {state:?}",
            qp.state()
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[track_caller]
fn expect_wrong_state(res: rdmx::Result<()>, state: QpState, what: &str) {
    match res {
        Err(Error::Post(PostError::WrongState(s))) if s == state => {}
        other => panic!("{what}: got {other:?}, expected WrongState({state:?})"),
    }
}

/// post_send is refused in RESET, INIT and RTR; post_recv is refused in RESET and accepted
/// in INIT and RTR, and those receives are used once the peer sends.
pub(crate) fn post_in_wrong_state(p: &Provider) {
    let cfg = p.config();
    let opts = cfg.opts;
    let (a, b) = (p.side(&cfg), p.side(&cfg));
    let (qa, qb) = (a.qp.qp_num(), b.qp.qp_num());
    let what = format!("{}: posting by state", p.name);
    let iwarp = a.caps().transport == rdmx::Transport::Iwarp;
    let src_a = register(&a.pd, 64, LOCAL);
    let inbox_a = register(&a.pd, 128, LOCAL);
    let src_b = register(&b.pd, 64, LOCAL);
    let inbox_b = register(&b.pd, 64, LOCAL);
    let data_a = fill(&src_a, 1);
    let data_b = fill(&src_b, 2);
    let send_a = |id| SendRequest::send(id).sge(sge(&src_a, 0, 32));
    let recv_a = |id: u64, k: usize| RecvRequest::new(id).sge(sge(&inbox_a, 64 * k, 64));

    expect_wrong_state(
        a.qp.post_send(send_a(1)),
        QpState::Reset,
        &format!("{what}: post_send in RESET"),
    );
    expect_wrong_state(
        a.qp.post_recv(recv_a(49, 0)),
        QpState::Reset,
        &format!("{what}: post_recv in RESET"),
    );

    let init = QpAttr {
        qp_state: QpState::Init,
        pkey_index: 0,
        port_num: 1,
        qp_access_flags: opts.access,
        ..QpAttr::default()
    };
    a.qp.modify(
        &init,
        QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
    )
    .unwrap_or_else(|e| panic!("{what}: RESET to INIT: {e}"));
    assert_eq!(a.qp.state(), QpState::Init, "{what}");
    expect_wrong_state(
        a.qp.post_send(send_a(2)),
        QpState::Init,
        &format!("{what}: post_send in INIT"),
    );
    a.qp.post_recv(recv_a(50, 0))
        .unwrap_or_else(|e| panic!("{what}: post_recv in INIT: {e}"));
    if iwarp {
        // An iWARP queue pair reaches RTR and RTS only through rdma_cm: a manual move is
        // refused, and the QP stays where it was.
        let e =
            b.qp.connect(a.qp.endpoint(), &opts)
                .expect_err("a manual connect of an iWARP queue pair");
        assert!(matches!(e, Error::Unsupported(_)), "{what}: {e:?}");
        eprintln!("skipped: {what}: RTR and RTS (iWARP moves through them in rdma_cm)");
        return;
    }

    let peer = b.qp.endpoint();
    // The address vector: where the peer is (needed by providers with real addresses).
    a.qp.bind_peer(&peer)
        .unwrap_or_else(|e| panic!("{what}: bind_peer: {e}"));
    let rtr = QpAttr {
        qp_state: QpState::Rtr,
        path_mtu: opts.mtu.expect("the suite sets the MTU"),
        dest_qp_num: peer.qp_num,
        rq_psn: peer.psn,
        max_dest_rd_atomic: opts.max_dest_rd_atomic,
        min_rnr_timer: opts.min_rnr_timer,
        ..init.clone()
    };
    a.qp.modify(
        &rtr,
        QpAttrMask::STATE
            | QpAttrMask::AV
            | QpAttrMask::PATH_MTU
            | QpAttrMask::DEST_QPN
            | QpAttrMask::RQ_PSN
            | QpAttrMask::MAX_DEST_RD_ATOMIC
            | QpAttrMask::MIN_RNR_TIMER,
    )
    .unwrap_or_else(|e| panic!("{what}: INIT to RTR: {e}"));
    assert_eq!(a.qp.state(), QpState::Rtr, "{what}");
    expect_wrong_state(
        a.qp.post_send(send_a(3)),
        QpState::Rtr,
        &format!("{what}: post_send in RTR"),
    );
    a.qp.post_recv(recv_a(51, 1))
        .unwrap_or_else(|e| panic!("{what}: post_recv in RTR: {e}"));

    // A in RTR receives: B's SEND lands in the receive posted in INIT.
    b.qp.connect(a.qp.endpoint(), &opts)
        .unwrap_or_else(|e| panic!("{what}: connect B: {e}"));
    b.qp.post_send(SendRequest::send(60).sge(sge(&src_b, 0, 32)))
        .unwrap();
    check_ok(&wait_one(&b.scq, &what), 60, WcOpcode::Send, qb, &what);
    let r = wait_one(&a.rcq, &what);
    check_ok(&r, 50, WcOpcode::Recv, qa, &what);
    assert_eq!(r.byte_len, 32, "{what}");

    let rts = QpAttr {
        qp_state: QpState::Rts,
        sq_psn: a.qp.endpoint().psn,
        timeout: opts.timeout,
        retry_cnt: opts.retry_cnt,
        rnr_retry: opts.rnr_retry,
        max_rd_atomic: opts.max_rd_atomic,
        ..rtr.clone()
    };
    a.qp.modify(
        &rts,
        QpAttrMask::STATE
            | QpAttrMask::SQ_PSN
            | QpAttrMask::TIMEOUT
            | QpAttrMask::RETRY_CNT
            | QpAttrMask::RNR_RETRY
            | QpAttrMask::MAX_QP_RD_ATOMIC,
    )
    .unwrap_or_else(|e| panic!("{what}: RTR to RTS: {e}"));
    assert_eq!(a.qp.state(), QpState::Rts, "{what}");
    b.qp.post_recv(RecvRequest::new(70).sge(sge(&inbox_b, 0, 64)))
        .unwrap();
    a.qp.post_send(send_a(4))
        .unwrap_or_else(|e| panic!("{what}: post_send in RTS: {e}"));
    check_ok(&wait_one(&a.scq, &what), 4, WcOpcode::Send, qa, &what);
    check_ok(&wait_one(&b.rcq, &what), 70, WcOpcode::Recv, qb, &what);
    // The receive posted in RTR is next.
    b.qp.post_send(SendRequest::send(61).sge(sge(&src_b, 32, 32)))
        .unwrap();
    check_ok(&wait_one(&b.scq, &what), 61, WcOpcode::Send, qb, &what);
    check_ok(&wait_one(&a.rcq, &what), 51, WcOpcode::Recv, qa, &what);

    let mut got = vec![0u8; 128];
    inbox_a.read_at(0, &mut got).unwrap();
    assert_bytes(
        &got[..32],
        &data_b[..32],
        &format!("{what}: receive posted in INIT"),
    );
    assert_bytes(
        &got[64..96],
        &data_b[32..64],
        &format!("{what}: receive posted in RTR"),
    );
    let mut got = vec![0u8; 32];
    inbox_b.read_at(0, &mut got).unwrap();
    assert_bytes(&got, &data_a[..32], &format!("{what}: SEND from RTS"));
}

/// The first request fails: every later send request (signaled or not) and every posted
/// receive completes with WrFlushErr, in order; nothing reaches the target; the QP is in
/// ERR, and requests posted afterwards complete with WrFlushErr too.
///
/// Two ways to fail first: a WRITE with an invalid rkey, and a SEND that exhausts its RNR
/// retries (`rnr_retry` 1, the peer asking for a ~123 ms RNR wait), during whose wait the
/// later requests are posted and outstanding.
pub(crate) fn error_flushes_outstanding(p: &Provider) {
    for rnr in [false, true] {
        if rnr && lacks(p, "RNR waits", |c| c.rnr_retry) {
            continue;
        }
        let (mut cfg_a, mut cfg_b) = (p.config(), p.config());
        if rnr {
            cfg_a.opts.rnr_retry = 1;
            cfg_b.opts.min_rnr_timer = 27;
        }
        let pair = p.pair_with(cfg_a, cfg_b);
        let qa = pair.a.qp.qp_num();
        let how = if rnr {
            "a SEND out of RNR retries"
        } else if pair.a.caps().remote_error_completions {
            "a WRITE with an invalid rkey"
        } else {
            "a READ with an invalid rkey"
        };
        let what = format!("{}: flush after {how}", p.name);
        let src = register(&pair.a.pd, 4096, LOCAL);
        let inbox = register(&pair.a.pd, 4 * 64, LOCAL);
        let target = register_page(&pair.b.pd, 4096, ALL);
        let before = fill(&target, 1);
        fill(&src, 2);
        let mut bad = raddr(&target, 0);
        bad.rkey ^= 0x5a;
        let (first, status) = if rnr {
            let send = SendRequest::send(1).sge(sge(&src, 0, 64));
            (send, WcStatus::RnrRetryExcErr)
        } else if pair.a.caps().remote_error_completions {
            let write = SendRequest::write(1, bad).sge(sge(&src, 0, 64));
            (write, WcStatus::RemAccessErr)
        } else {
            // A WRITE would complete once sent (iWARP); a READ waits for its response.
            let read = SendRequest::read(1, bad).sge(sge(&src, 3072, 64));
            (read, WcStatus::RemAccessErr)
        };
        pair.a
            .qp
            .post_send(first)
            .unwrap_or_else(|e| panic!("{what}: post_send: {e}"));
        for k in 0..3 {
            pair.a
                .qp
                .post_recv(RecvRequest::new(100 + k).sge(sge(&inbox, 64 * k as usize, 64)))
                .unwrap_or_else(|e| panic!("{what}: post_recv: {e}"));
        }
        let add = SendOp::FetchAdd {
            remote: raddr(&target, 512),
            add: 1,
        };
        let reqs = [
            SendRequest::send(2).sge(sge(&src, 0, 64)),
            SendRequest::write(3, raddr(&target, 128))
                .sge(sge(&src, 0, 64))
                .flags(SendFlags::empty()),
            SendRequest::read(4, raddr(&target, 256)).sge(sge(&src, 1024, 64)),
            if pair.a.caps().atomics.supported() {
                SendRequest::new(5, add).sge(sge(&src, 2048, 8))
            } else {
                SendRequest::read(5, raddr(&target, 768)).sge(sge(&src, 2048, 8))
            },
        ];
        for r in reqs {
            pair.a
                .qp
                .post_send(r)
                .unwrap_or_else(|e| panic!("{what}: post_send: {e}"));
        }
        let cs = wait_n(&pair.a.scq, 5, &what);
        check_status(&cs[0], 1, status, qa, &what);
        for (c, id) in cs[1..].iter().zip(2..) {
            check_status(c, id, WcStatus::WrFlushErr, qa, &what);
        }
        for (r, id) in wait_n(&pair.a.rcq, 3, &what).iter().zip(100..) {
            check_status(r, id, WcStatus::WrFlushErr, qa, &what);
        }
        assert_eq!(pair.a.qp.state(), QpState::Err, "{what}: requester state");
        assert_bytes(&image(&target), &before, &format!("{what}: target bytes"));

        // Posting in ERR is accepted and flushed.
        pair.a
            .qp
            .post_send(SendRequest::send(6).sge(sge(&src, 0, 64)))
            .unwrap_or_else(|e| panic!("{what}: post_send in ERR: {e}"));
        let c = wait_one(&pair.a.scq, &what);
        check_status(&c, 6, WcStatus::WrFlushErr, qa, &what);
        pair.a
            .qp
            .post_recv(RecvRequest::new(103).sge(sge(&inbox, 192, 64)))
            .unwrap_or_else(|e| panic!("{what}: post_recv in ERR: {e}"));
        let r = wait_one(&pair.a.rcq, &what);
        check_status(&r, 103, WcStatus::WrFlushErr, qa, &what);
        assert_drained(&pair.a.scq, &what);
        assert_drained(&pair.b.rcq, &what);
    }
}
