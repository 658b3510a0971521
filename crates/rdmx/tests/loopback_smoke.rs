//! End-to-end over the loopback provider: every opcode once, data checked.

use rdmx::{
    Access, ConnectOptions, Context, LocalSge, QpCaps, RecvRequest, RemoteAddr, SendOp,
    SendRequest, WcOpcode, WcStatus,
};

#[test]
fn every_opcode_once_over_loopback() {
    let ctx = Context::open_default().unwrap();
    let pd = ctx.alloc_pd();
    let cq_a = ctx.create_cq(64).unwrap();
    let cq_b = ctx.create_cq(64).unwrap();
    let a = pd.create_qp(&cq_a, &cq_a, QpCaps::default()).unwrap();
    let b = pd.create_qp(&cq_b, &cq_b, QpCaps::default()).unwrap();
    a.connect(b.endpoint(), &ConnectOptions::default()).unwrap();
    b.connect(a.endpoint(), &ConnectOptions::default()).unwrap();

    let rw =
        Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    let src: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
    let mr_a = pd.register(src.clone(), rw).unwrap();
    let mr_b = pd.register(vec![0u8; 10_000], rw).unwrap();

    // SEND / RECV.
    b.post_recv(RecvRequest::new(7).sge(LocalSge::new(&mr_b, 0, 10_000).unwrap()))
        .unwrap();
    a.post_send(SendRequest::send(1).sge(LocalSge::new(&mr_a, 0, 9000).unwrap()))
        .unwrap();
    let c = cq_a.poll_one().unwrap().expect("send completion");
    assert_eq!(
        (c.wr_id, c.status, c.opcode),
        (1, WcStatus::Success, WcOpcode::Send)
    );
    let r = cq_b.poll_one().unwrap().expect("recv completion");
    assert_eq!(
        (r.wr_id, r.status, r.opcode, r.byte_len),
        (7, WcStatus::Success, WcOpcode::Recv, 9000)
    );
    let mut got = vec![0u8; 9000];
    mr_b.read_at(0, &mut got).unwrap();
    assert_eq!(got, src[..9000]);

    // WRITE, then READ it back.
    let remote = RemoteAddr {
        addr: mr_b.addr() as u64 + 100,
        rkey: mr_b.rkey(),
    };
    mr_a.write_at(0, b"written by rdma").unwrap();
    a.post_send(SendRequest::write(2, remote).sge(LocalSge::new(&mr_a, 0, 15).unwrap()))
        .unwrap();
    assert_eq!(cq_a.poll_one().unwrap().unwrap().status, WcStatus::Success);
    let mut w = [0u8; 15];
    mr_b.read_at(100, &mut w).unwrap();
    assert_eq!(&w, b"written by rdma");
    a.post_send(SendRequest::read(3, remote).sge(LocalSge::new(&mr_a, 5000, 15).unwrap()))
        .unwrap();
    let c = cq_a.poll_one().unwrap().unwrap();
    assert_eq!(
        (c.status, c.opcode),
        (WcStatus::Success, WcOpcode::RdmaRead)
    );
    mr_a.read_at(5000, &mut w).unwrap();
    assert_eq!(&w, b"written by rdma");

    // Atomics.
    mr_b.write_at(0, &5u64.to_ne_bytes()).unwrap();
    let target = RemoteAddr {
        addr: mr_b.addr() as u64,
        rkey: mr_b.rkey(),
    };
    a.post_send(
        SendRequest::new(
            4,
            SendOp::FetchAdd {
                remote: target,
                add: 10,
            },
        )
        .sge(LocalSge::new(&mr_a, 8, 8).unwrap()),
    )
    .unwrap();
    assert_eq!(cq_a.poll_one().unwrap().unwrap().status, WcStatus::Success);
    let mut old = [0u8; 8];
    mr_a.read_at(8, &mut old).unwrap();
    assert_eq!(u64::from_ne_bytes(old), 5);
    assert_eq!(mr_b.load_u64(0).unwrap(), 15);
    a.post_send(
        SendRequest::new(
            5,
            SendOp::CompareSwap {
                remote: target,
                compare: 15,
                swap: 99,
            },
        )
        .sge(LocalSge::new(&mr_a, 8, 8).unwrap()),
    )
    .unwrap();
    assert_eq!(cq_a.poll_one().unwrap().unwrap().status, WcStatus::Success);
    assert_eq!(mr_b.load_u64(0).unwrap(), 99);
}

/// A CQ armed for solicited completions only is woken by its overrun (which moves the
/// QP to ERR): a waiter does not sleep through it, and its poll reports the overrun.
#[test]
fn an_overrun_wakes_a_cq_armed_for_solicited_completions() {
    let ctx = Context::open_default().unwrap();
    let pd = ctx.alloc_pd();
    let cq_a = ctx.create_cq(16).unwrap();
    let cq_b = ctx.create_cq(2).unwrap();
    let a = pd.create_qp(&cq_a, &cq_a, QpCaps::default()).unwrap();
    let b = pd.create_qp(&cq_b, &cq_b, QpCaps::default()).unwrap();
    a.connect(b.endpoint(), &ConnectOptions::default()).unwrap();
    b.connect(a.endpoint(), &ConnectOptions::default()).unwrap();
    let mr_a = pd.register(vec![1u8; 64], Access::LOCAL_WRITE).unwrap();
    let mr_b = pd.register(vec![0u8; 4 * 64], Access::LOCAL_WRITE).unwrap();
    for i in 0..4 {
        b.post_recv(RecvRequest::new(i).sge(LocalSge::new(&mr_b, i as usize * 64, 64).unwrap()))
            .unwrap();
    }
    cq_b.req_notify(true);
    for i in 0..3 {
        a.post_send(SendRequest::send(i).sge(LocalSge::new(&mr_a, 0, 64).unwrap()))
            .unwrap();
    }
    assert!(
        cq_b.wait_event(std::time::Duration::from_secs(5)).unwrap(),
        "the overrun did not wake the armed CQ"
    );
    assert!(matches!(cq_b.poll_one(), Err(rdmx::Error::CqOverrun)));
}

/// An address handle of another context's protection domain is refused at post, even
/// where both domains have the same number in their contexts.
#[test]
fn an_address_handle_of_another_context_is_refused() {
    let (c1, c2) = (
        Context::open_default().unwrap(),
        Context::open_default().unwrap(),
    );
    let (pd1, pd2) = (c1.alloc_pd(), c2.alloc_pd());
    let cq = c1.create_cq(8).unwrap();
    let qp = pd1
        .create_qp_of_type(rdmx::QpType::Ud, &cq, &cq, None, QpCaps::default())
        .unwrap();
    qp.activate(0x11).unwrap();
    let ah = pd2
        .create_ah(&rdmx::AhAttr::to_endpoint(&qp.endpoint()))
        .unwrap();
    let mr = pd1.register(vec![0u8; 64], Access::LOCAL_WRITE).unwrap();
    let req = SendRequest::send(1)
        .sge(LocalSge::new(&mr, 0, 8).unwrap())
        .ud(&ah, qp.qp_num(), 0x11);
    assert!(
        qp.post_send(req).is_err(),
        "an AH of another context was taken"
    );
}
