//! An shm progress thread that sleeps is woken by every packet its peer sends, whoever
//! else runs its driver meanwhile.
//!
//! A sleeping thread raises a flag in the shared segment of each connection; the peer
//! that puts something in a ring clears the flag and sends one wake-up message on the
//! connection's socket, which the thread's `epoll_wait` watches. An application that
//! polls runs the same driver and reads the same sockets: if it takes the wake-up (and
//! handles the packet) while the thread is on its way to sleep, the thread sleeps with
//! the flag cleared, and the peer's next packets wake nobody. The thread must then be
//! woken by the application instead, or a peer whose target does not poll waits until the
//! thread's sleep times out (100 ms; fifteen seconds here, where the peer's retries run
//! out first). Likewise for a queue pair that connects while the thread is on its way to
//! sleep: the thread raised no flag for it.

use std::time::{Duration, Instant};

use rdmx::{
    Access, CompletionQueue, ConnectOptions, Context, LocalSge, QpCaps, RecvRequest, SendRequest,
    WcStatus,
};

/// How long the target's progress thread sleeps at most, in this test.
const SLEEP_CAP: Duration = Duration::from_secs(15);

fn poll_ok(cq: &CompletionQueue, what: &str, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        if let Some(c) = cq.poll_one().unwrap() {
            assert_eq!(c.status, WcStatus::Success, "{what}: {c:?}");
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no completion for {what} within {within:?}"
        );
        std::thread::yield_now();
    }
}

#[test]
fn a_wake_up_the_application_took_still_wakes_the_thread() {
    let (ca, cb) = (
        Context::open_provider("shm").unwrap(),
        Context::open_provider("shm").unwrap(),
    );
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let (qa, qb) = (ca.create_cq(16).unwrap(), cb.create_cq(16).unwrap());
    let a = pa.create_qp(&qa, &qa, QpCaps::default()).unwrap();
    let b = pb.create_qp(&qb, &qb, QpCaps::default()).unwrap();
    let opts = ConnectOptions::default();
    a.connect(b.endpoint(), &opts).unwrap();
    b.connect(a.endpoint(), &opts).unwrap();
    let ma = pa.register(vec![7u8; 64], Access::LOCAL_WRITE).unwrap();
    let mb = pb.register(vec![0u8; 128], Access::LOCAL_WRITE).unwrap();
    for i in 0..2 {
        b.post_recv(RecvRequest::new(i).sge(LocalSge::new(&mb, 64 * i as usize, 64).unwrap()))
            .unwrap();
    }

    // B's thread on its way to sleep: flags raised, rings found empty.
    let held = rdmx::shm::testing::hold_sleep(&cb, SLEEP_CAP).expect("an shm context");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !held.reached() {
        assert!(
            Instant::now() < deadline,
            "B's progress thread never went to sleep"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // A's SEND finds B asleep and wakes it; B's application, polling, takes the wake-up
    // and the SEND.
    let wakes = rdmx::shm::testing::wakes_read(&cb).unwrap();
    a.post_send(SendRequest::send(1).sge(LocalSge::new(&ma, 0, 64).unwrap()))
        .unwrap();
    poll_ok(&qb, "the first receive", Duration::from_secs(10));
    let deadline = Instant::now() + Duration::from_secs(10);
    while rdmx::shm::testing::wakes_read(&cb).unwrap() == wakes {
        assert!(
            Instant::now() < deadline,
            "B's application never read A's wake-up"
        );
        let _ = qb.poll_one().unwrap();
    }
    poll_ok(&qa, "the first SEND", Duration::from_secs(10));
    // The thread goes on to sleep; B's application polls no more. A's second SEND is
    // acknowledged by B's thread, which must be awake to read it.
    drop(held);
    a.post_send(SendRequest::send(2).sge(LocalSge::new(&ma, 0, 64).unwrap()))
        .unwrap();
    poll_ok(&qa, "the second SEND", SLEEP_CAP / 3);
    poll_ok(&qb, "the second receive", Duration::from_secs(10));
}

/// A queue pair that connects while its context's thread is on its way to sleep has no
/// flag raised by that thread: the thread is woken to sleep again with it raised. (Of a
/// pair, the side with the smaller queue pair number and PSN connects, in its
/// application's call; the other's thread answers.)
#[test]
fn a_queue_pair_connected_while_the_thread_sleeps_wakes_it() {
    let ctx = [
        Context::open_provider("shm").unwrap(),
        Context::open_provider("shm").unwrap(),
    ];
    let pd = [ctx[0].alloc_pd(), ctx[1].alloc_pd()];
    let cq = [ctx[0].create_cq(16).unwrap(), ctx[1].create_cq(16).unwrap()];
    let qp = [
        pd[0].create_qp(&cq[0], &cq[0], QpCaps::default()).unwrap(),
        pd[1].create_qp(&cq[1], &cq[1], QpCaps::default()).unwrap(),
    ];
    let mr = [
        pd[0].register(vec![7u8; 64], Access::LOCAL_WRITE).unwrap(),
        pd[1].register(vec![0u8; 64], Access::LOCAL_WRITE).unwrap(),
    ];
    let ep = [qp[0].endpoint(), qp[1].endpoint()];
    // `c` connects, `l` listens.
    let c = usize::from((ep[1].qp_num, ep[1].psn) < (ep[0].qp_num, ep[0].psn));
    let l = 1 - c;

    let held = rdmx::shm::testing::hold_sleep(&ctx[c], SLEEP_CAP).expect("an shm context");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !held.reached() {
        assert!(
            Instant::now() < deadline,
            "the progress thread never went to sleep"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // The queue pair joins its context's rounds while the thread is held.
    let opts = ConnectOptions::default();
    qp[l].connect(ep[c], &opts).unwrap();
    qp[c].connect(ep[l], &opts).unwrap();
    qp[c]
        .post_recv(RecvRequest::new(1).sge(LocalSge::new(&mr[c], 0, 64).unwrap()))
        .unwrap();
    drop(held);
    // The connecting side's application polls nothing: only its thread can read the SEND.
    qp[l]
        .post_send(SendRequest::send(2).sge(LocalSge::new(&mr[l], 0, 64).unwrap()))
        .unwrap();
    poll_ok(&cq[l], "the SEND", SLEEP_CAP / 3);
    poll_ok(&cq[c], "the receive", Duration::from_secs(10));
}
