//! Shared receive queues: several queue pairs consume one queue of receives, the limit
//! event fires once when it runs low, and an empty SRQ means RNR.

use rdmx::{Error, PostError, QpCaps, RecvRequest, SendRequest, WcOpcode};

use super::{
    assert_bytes, assert_quiet, check_ok, fill, register, sge, wait_n, wait_one, Provider, LOCAL,
};

/// Two QPs on one side share an SRQ; SENDs on both land in its receives, taken in the
/// order they were posted.
pub(crate) fn shared_receive_queue(p: &Provider) {
    let (ctx_a, ctx_b) = (p.open(), p.open());
    let (pd_a, pd_b) = (ctx_a.alloc_pd(), ctx_b.alloc_pd());
    let cq_a = ctx_a.create_cq(64).unwrap();
    let cq_b = ctx_b.create_cq(64).unwrap();
    let srq = pd_b.create_srq(16, 2).unwrap();
    let mut opts = p.options();
    opts.rnr_retry = 7;
    let mut qps = Vec::new();
    let inline = 256.min(ctx_a.capabilities().max_inline_data as usize);
    let caps = QpCaps::default().max_inline_data(inline);
    for _ in 0..2 {
        let a = pd_a.create_qp(&cq_a, &cq_a, caps).unwrap();
        let b = pd_b.create_qp_with_srq(&cq_b, &cq_b, &srq, caps).unwrap();
        p.connect_qps(&a, &opts, &b, &opts);
        qps.push((a, b));
    }
    let src = register(&pd_a, 8192, LOCAL);
    let data = fill(&src, 9);
    let inbox = register(&pd_b, 8 * 1024, LOCAL);
    let what = format!("{}: SRQ", p.name);

    // A QP that uses an SRQ has no receive queue of its own.
    assert!(
        matches!(
            qps[0]
                .1
                .post_recv(RecvRequest::new(1).sge(sge(&inbox, 0, 64))),
            Err(Error::Post(PostError::Invalid(_)))
        ),
        "{what}: post_recv on a QP with an SRQ"
    );
    for i in 0..4 {
        srq.post_recv(RecvRequest::new(100 + i as u64).sge(sge(&inbox, i * 1024, 1024)))
            .unwrap();
    }
    assert_eq!(srq.len(), 4);
    // A limit above the queue's capacity arms nothing: refused.
    assert!(
        matches!(srq.arm_limit(17), Err(Error::InvalidArgument(_))),
        "{what}: a limit above max_wr"
    );
    srq.arm_limit(2).unwrap();
    assert!(
        !srq.limit_reached(),
        "{what}: limit event before any receive was taken"
    );

    // One SEND on each QP. Nothing orders two QPs' messages: the first to land takes
    // receive 100, the other 101; each completion names its QP and the length it sent.
    for (i, (a, _)) in qps.iter().enumerate() {
        a.post_send(SendRequest::send(i as u64).sge(sge(&src, i * 1000, 700 + i)))
            .unwrap();
    }
    wait_n(&cq_a, 2, &what);
    let mut recvs = wait_n(&cq_b, 2, &what);
    recvs.sort_by_key(|r| r.wr_id);
    let mut senders = Vec::new();
    for (k, r) in recvs.iter().enumerate() {
        let i = (r.byte_len as usize).wrapping_sub(700);
        assert!(i < 2, "{what}: a receive of {} bytes", r.byte_len);
        check_ok(r, 100 + k as u64, WcOpcode::Recv, qps[i].1.qp_num(), &what);
        let mut got = vec![0u8; 700 + i];
        inbox.read_at(k * 1024, &mut got).unwrap();
        assert_bytes(&got, &data[i * 1000..i * 1000 + 700 + i], &what);
        senders.push(i);
    }
    senders.sort_unstable();
    assert_eq!(senders, [0, 1], "{what}: one message from each QP");
    assert_eq!(srq.len(), 2);
    assert!(
        !srq.limit_reached(),
        "{what}: 2 left is not below the limit of 2"
    );

    // The next SEND leaves 1: below the limit, the event fires once.
    qps[1]
        .0
        .post_send(SendRequest::send(2).sge(sge(&src, 0, 10)))
        .unwrap();
    wait_one(&cq_a, &what);
    wait_one(&cq_b, &what);
    assert!(srq.limit_reached(), "{what}: limit event");
    assert!(!srq.limit_reached(), "{what}: the limit event fires once");

    if !ctx_a.capabilities().rnr_retry {
        eprintln!("skipped: {what}: an empty SRQ answering RNR (the device has no RNR waits)");
        return;
    }
    // Drain the last receive, then an empty SRQ answers RNR until one is posted.
    qps[0]
        .0
        .post_send(SendRequest::send(3).sge(sge(&src, 0, 10)))
        .unwrap();
    wait_one(&cq_a, &what);
    check_ok(
        &wait_one(&cq_b, &what),
        103,
        WcOpcode::Recv,
        qps[0].1.qp_num(),
        &what,
    );
    qps[1]
        .0
        .post_send(SendRequest::send(4).sge(sge(&src, 0, 20)))
        .unwrap();
    assert_quiet(&cq_a, &format!("{what}: SEND while the SRQ is empty"));
    srq.post_recv(RecvRequest::new(200).sge(sge(&inbox, 0, 1024)))
        .unwrap();
    check_ok(
        &wait_one(&cq_a, &what),
        4,
        WcOpcode::Send,
        qps[1].0.qp_num(),
        &what,
    );
    check_ok(
        &wait_one(&cq_b, &what),
        200,
        WcOpcode::Recv,
        qps[1].1.qp_num(),
        &what,
    );
}

/// Receives an SRQ gave a QP that is destroyed before their completions are polled leave
/// the SRQ's room: it takes as many new receives as it holds (on verbs, the SRQ kept them
/// counted as posted for good, and refused posts it had room for).
pub(crate) fn a_destroyed_qp_leaves_its_srq_receives_room(p: &Provider) {
    let (ctx_a, ctx_b) = (p.open(), p.open());
    let (pd_a, pd_b) = (ctx_a.alloc_pd(), ctx_b.alloc_pd());
    let cq_a = ctx_a.create_cq(64).unwrap();
    let cq_b = ctx_b.create_cq(64).unwrap();
    const DEPTH: usize = 4;
    let srq = pd_b.create_srq(DEPTH, 1).unwrap();
    let opts = p.options();
    // Within every device's limits (siw takes less inline data than the default).
    let inline = 64.min(ctx_a.capabilities().max_inline_data as usize);
    let caps = QpCaps::default().max_inline_data(inline);
    let src = register(&pd_a, 64, LOCAL);
    let inbox = register(&pd_b, 64 * DEPTH, LOCAL);
    let what = format!("{}: SRQ receives of a destroyed QP", p.name);
    for round in 0..3u64 {
        let a = pd_a.create_qp(&cq_a, &cq_a, caps).unwrap();
        let b = pd_b.create_qp_with_srq(&cq_b, &cq_b, &srq, caps).unwrap();
        p.connect_qps(&a, &opts, &b, &opts);
        for i in 0..DEPTH {
            srq.post_recv(RecvRequest::new(round * 100 + i as u64).sge(sge(&inbox, i * 64, 64)))
                .unwrap_or_else(|e| panic!("{what}: round {round}, receive {i}: {e}"));
        }
        for i in 0..DEPTH {
            a.post_send(SendRequest::send(i as u64).sge(sge(&src, 0, 8)))
                .unwrap();
        }
        // Every SEND is acknowledged: each took one of the SRQ's receives.
        wait_n(&cq_a, DEPTH, &what);
        // The receiving QP goes before its completions are polled.
        drop(b);
        drop(a);
        // The CQ is polled on (the software providers still give what it holds of the
        // QP; verbs gives nothing of a destroyed QP).
        let start = std::time::Instant::now();
        while start.elapsed() < std::time::Duration::from_millis(100) {
            while cq_b.poll_one().unwrap().is_some() {}
            std::thread::yield_now();
        }
    }
}
