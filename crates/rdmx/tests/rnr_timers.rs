//! A SEND retried on RNR NAKs for a while (the peer posts no receive; the shortest RNR
//! timer, retried for ever) keeps at most a few timers in its context's driver: each NAK
//! sets an earlier deadline than the acknowledgement's, and a timer replaced that way must
//! do nothing when it fires. Before, each fired timer set the current deadline again, so
//! every NAK left one more timer for good (thousands a second, each firing the QP again).

mod common;

use std::time::{Duration, Instant};

use rdmx::{
    Access, CompletionQueue, ConnectOptions, Context, LocalSge, QpCaps, QueuePair, RecvRequest,
    SendRequest, WcStatus,
};

const DEADLINE: Duration = Duration::from_secs(30);

fn pair(
    open: &dyn Fn() -> Context,
) -> [(Context, rdmx::ProtectionDomain, CompletionQueue, QueuePair); 2] {
    [open(), open()].map(|ctx| {
        let pd = ctx.alloc_pd();
        let cq = ctx.create_cq(16).unwrap();
        let qp = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
        (ctx, pd, cq, qp)
    })
}

fn storm(name: &str, open: &dyn Fn() -> Context, timers: fn(&Context) -> Option<usize>) {
    let [a, b] = pair(open);
    // The shortest RNR timer (code 1: 10 µs), retried for ever (7).
    let opts = ConnectOptions::default().min_rnr_timer(1).rnr_retry(7);
    let (ea, eb) = (a.3.endpoint(), b.3.endpoint());
    a.3.connect(eb, &opts).unwrap();
    b.3.connect(ea, &opts).unwrap();
    let src = a.1.register(vec![9u8; 64], Access::LOCAL_WRITE).unwrap();
    a.3.post_send(SendRequest::send(1).sge(LocalSge::new(&src, 0, 64).unwrap()))
        .unwrap();
    // NAKed and retried for a while (polls drive progress on both sides).
    let start = Instant::now();
    let mut most = 0;
    while start.elapsed() < Duration::from_millis(500) {
        assert!(
            a.2.poll_one().unwrap().is_none(),
            "{name}: the SEND completed"
        );
        assert!(b.2.poll_one().unwrap().is_none());
        most = most.max(timers(&a.0).unwrap());
    }
    assert!(most <= 8, "{name}: {most} timers held at once");
    // A receive comes: the SEND goes.
    let inbox = b.1.register(vec![0u8; 64], Access::LOCAL_WRITE).unwrap();
    b.3.post_recv(RecvRequest::new(2).sge(LocalSge::new(&inbox, 0, 64).unwrap()))
        .unwrap();
    for (cq, id) in [(&a.2, 1), (&b.2, 2)] {
        let start = Instant::now();
        let c = loop {
            if let Some(c) = cq.poll_one().unwrap() {
                break c;
            }
            assert!(start.elapsed() < DEADLINE, "{name}: nothing completed");
        };
        assert_eq!(
            (c.wr_id, c.status),
            (id, WcStatus::Success),
            "{name}: {c:?}"
        );
    }
}

#[test]
fn rnr_retries_keep_few_timers_on_shm() {
    storm(
        "shm",
        &|| Context::open(rdmx::shm::Options::default().direct(false)).unwrap(),
        rdmx::shm::testing::pending_timers,
    );
}

#[test]
fn rnr_retries_keep_few_timers_on_tcp() {
    storm(
        "tcp",
        &|| Context::open_provider("tcp").unwrap(),
        rdmx::tcp::pending_timers,
    );
}

#[test]
fn rnr_retries_keep_few_timers_on_udp() {
    storm(
        "udp",
        &|| common::open_udp(11).unwrap(),
        rdmx::udp::pending_timers,
    );
}
