//! tcp over IPv6: contexts listening on `[::1]`, queue pairs connected through an
//! `rdmx::cm` listener on `[::1]`, and a WRITE and a READ that cross it with their data
//! checked. Fails where the loopback interface has no IPv6 address.

use std::net::{Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use rdmx::{
    cm, Access, CompletionQueue, ConnectOptions, Context, LocalSge, QpCaps, SendRequest, WcStatus,
};

const TIMEOUT: Duration = Duration::from_secs(10);

fn ok(cq: &CompletionQueue, wr_id: u64) {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Some(c) = cq.poll_one().unwrap() {
            assert_eq!((c.wr_id, c.status), (wr_id, WcStatus::Success), "{c:?}");
            return;
        }
        assert!(Instant::now() < deadline, "no completion for {wr_id}");
        std::thread::yield_now();
    }
}

#[test]
fn write_and_read_over_ipv6_loopback() {
    let v6 = SocketAddr::from((Ipv6Addr::LOCALHOST, 0));
    let open = || Context::open(rdmx::tcp::Options::default().bind(v6)).unwrap();
    let (ca, cb) = (open(), open());
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let (qa_cq, qb_cq) = (ca.create_cq(16).unwrap(), cb.create_cq(16).unwrap());
    let qa = pa.create_qp(&qa_cq, &qa_cq, QpCaps::default()).unwrap();
    let qb = pb.create_qp(&qb_cq, &qb_cq, QpCaps::default()).unwrap();
    assert!(
        matches!(qa.endpoint().addr, rdmx::PeerAddr::Ip(a) if a.is_ipv6()),
        "{:?}",
        qa.endpoint()
    );

    let listener = cm::Listener::bind(v6).unwrap();
    let addr = listener.local_addr().unwrap();
    assert!(addr.is_ipv6());
    let opts = ConnectOptions::default();
    std::thread::scope(|s| {
        let t = s.spawn(|| listener.accept(std::slice::from_ref(&qb), &opts, b"b", TIMEOUT));
        let theirs = cm::connect(addr, std::slice::from_ref(&qa), &opts, b"a", TIMEOUT).unwrap();
        assert_eq!(theirs, b"b");
        assert_eq!(t.join().unwrap().unwrap(), b"a");
    });

    let mine = pa
        .register(b"over IPv6".to_vec(), Access::LOCAL_WRITE)
        .unwrap();
    let theirs = pb.register(vec![0u8; 9], Access::ALL).unwrap();
    qa.post_send(
        SendRequest::write(1, theirs.remote_at(0)).sge(LocalSge::new(&mine, 0, 9).unwrap()),
    )
    .unwrap();
    ok(&qa_cq, 1);
    let mut got = [0u8; 9];
    theirs.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"over IPv6");

    theirs.write_at(0, b"read back").unwrap();
    qa.post_send(
        SendRequest::read(2, theirs.remote_at(0)).sge(LocalSge::new(&mine, 0, 9).unwrap()),
    )
    .unwrap();
    ok(&qa_cq, 2);
    mine.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"read back");
}
