//! A large READ against a udp context, in a test binary of its own: it makes the process
//! 128 MiB larger, which the memory bounds of the other udp tests would count.

use std::time::Duration;

use rdmx::{Access, LocalSge, Mtu, QpCaps, RemoteAddr, SendRequest, WcStatus};

mod common;
use common::udp_pair::{opts, side, wait_one, write_works, Side, LEN};

/// A READ of 128 MiB does not hold the responder's context from its other queue pairs:
/// its responses go out a bounded burst at a time, and WRITEs between another pair, one
/// side in that context, complete meanwhile within a short ACK timeout (code 13: 33.6 ms,
/// 8 tries, about 270 ms), which a context sending all of the READ's responses in one go
/// exhausted (in this debug build, which sends them at a few hundred MB/s: 128 MiB hold
/// it about 430 ms). The READ then completes. (Code 12, 135 ms in all, left too little
/// room for a busy machine that keeps a driver thread from running.)
#[test]
fn a_large_read_does_not_hold_the_context_from_its_other_queue_pairs() {
    const BIG: usize = 128 << 20;
    let port = 28791;
    let a = side(&format!("127.1.0.31:{port}"));
    let r = side(&format!("127.1.0.32:{port}"));
    let c = side(&format!("127.1.0.33:{port}"));
    let mut big = opts();
    big.mtu = Some(Mtu::Mtu4096);
    a.qp.connect(r.qp.endpoint(), &big).expect("connect A");
    r.qp.connect(a.qp.endpoint(), &big).expect("connect R");
    // R's second QP, the peer of C's, in R's context.
    let cq = r.ctx.create_cq(256).expect("cq");
    let r2 = Side {
        qp: r.pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp"),
        cq,
        mr: r
            .pd
            .register(vec![0u8; LEN], Access::ALL)
            .expect("register"),
        pd: r.pd.clone(),
        ctx: r.ctx.clone(),
        addr: r.addr,
    };
    let mut quick = opts();
    quick.timeout = 13;
    c.qp.connect(r2.qp.endpoint(), &quick).expect("connect C");
    r2.qp.connect(c.qp.endpoint(), &quick).expect("connect R2");
    write_works(&c, &r2, 1);

    let big_local =
        a.pd.register(vec![0u8; BIG], Access::LOCAL_WRITE)
            .expect("register");
    let big_remote =
        r.pd.register(vec![0u8; BIG], Access::ALL)
            .expect("register");
    let remote = RemoteAddr {
        addr: big_remote.addr() as u64,
        rkey: big_remote.rkey(),
    };
    a.qp.post_send(
        SendRequest::read(1, remote).sge(LocalSge::new(&big_local, 0, BIG).expect("sge")),
    )
    .expect("post the READ");
    // The READ's responses are under way.
    std::thread::sleep(Duration::from_millis(20));
    for seed in 2..=21 {
        write_works(&c, &r2, seed);
    }
    // Under a parallel test run this debug build's requester falls behind and loses
    // responses: the READ completes because each time it asks again for the rest only.
    let done = wait_one(&a.cq, "the READ");
    assert_eq!((done.wr_id, done.status), (1, WcStatus::Success));
}
