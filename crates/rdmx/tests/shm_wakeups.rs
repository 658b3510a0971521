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

use rdmx::shm::testing::{hold_sleep, wakes_read, SleepHeld};
use rdmx::{
    Access, CompletionQueue, ConnectOptions, Context, LocalSge, MemoryRegion, QpCaps, QueuePair,
    RecvRequest, SendRequest, WcStatus,
};

/// How long a progress thread sleeps at most, in these tests.
const SLEEP_CAP: Duration = Duration::from_secs(15);

/// One side of a pair: its own context (as another process would have), a queue pair
/// and 128 bytes of registered memory.
struct Side {
    ctx: Context,
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
}

fn side() -> Side {
    let ctx = Context::open_provider("shm").unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(16).unwrap();
    let qp = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
    let mr = pd.register(vec![7u8; 128], Access::LOCAL_WRITE).unwrap();
    Side { ctx, cq, qp, mr }
}

/// Connects the pair.
fn connect(x: &Side, y: &Side) {
    let opts = ConnectOptions::default();
    x.qp.connect(y.qp.endpoint(), &opts).unwrap();
    y.qp.connect(x.qp.endpoint(), &opts).unwrap();
}

fn send(from: &Side, wr_id: u64) {
    let sge = LocalSge::new(&from.mr, 0, 64).unwrap();
    from.qp
        .post_send(SendRequest::send(wr_id).sge(sge))
        .unwrap();
}

fn recv(into: &Side, wr_id: u64) {
    let sge = LocalSge::new(&into.mr, 64 * (wr_id as usize % 2), 64).unwrap();
    into.qp.post_recv(RecvRequest::new(wr_id).sge(sge)).unwrap();
}

/// Holds the progress thread of `s`'s context on its way to sleep, once it got there.
fn hold(s: &Side) -> SleepHeld {
    let held = hold_sleep(&s.ctx, SLEEP_CAP).expect("an shm context");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !held.reached() {
        assert!(
            Instant::now() < deadline,
            "the progress thread never went to sleep"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    held
}

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
    let (a, b) = (side(), side());
    connect(&a, &b);
    recv(&b, 0);
    recv(&b, 1);

    // B's thread on its way to sleep: flags raised, rings found empty.
    let held = hold(&b);
    // A's SEND finds B asleep and wakes it; B's application, polling, takes the wake-up
    // and the SEND.
    let wakes = wakes_read(&b.ctx).unwrap();
    send(&a, 1);
    poll_ok(&b.cq, "the first receive", Duration::from_secs(10));
    let deadline = Instant::now() + Duration::from_secs(10);
    while wakes_read(&b.ctx).unwrap() == wakes {
        assert!(
            Instant::now() < deadline,
            "B's application never read A's wake-up"
        );
        let _ = b.cq.poll_one().unwrap();
    }
    poll_ok(&a.cq, "the first SEND", Duration::from_secs(10));
    // The thread goes on to sleep; B's application polls no more. A's second SEND is
    // acknowledged by B's thread, which must be awake to read it.
    drop(held);
    send(&a, 2);
    poll_ok(&a.cq, "the second SEND", SLEEP_CAP / 3);
    poll_ok(&b.cq, "the second receive", Duration::from_secs(10));
}

/// A queue pair that connects while its context's thread is on its way to sleep has no
/// flag raised by that thread: the thread is woken to sleep again with it raised. (Of a
/// pair, the side with the smaller queue pair number and PSN connects, in its
/// application's call; the other's thread answers.)
#[test]
fn a_queue_pair_connected_while_the_thread_sleeps_wakes_it() {
    let (x, y) = (side(), side());
    let (ex, ey) = (x.qp.endpoint(), y.qp.endpoint());
    // `c` connects, `l` listens.
    let (c, l) = match (ex.qp_num, ex.psn) < (ey.qp_num, ey.psn) {
        true => (&x, &y),
        false => (&y, &x),
    };
    // The queue pair joins its context's rounds while the thread is held.
    let held = hold(c);
    connect(l, c);
    recv(c, 1);
    drop(held);
    // The connecting side's application polls nothing: only its thread can read the SEND.
    send(l, 2);
    poll_ok(&l.cq, "the SEND", SLEEP_CAP / 3);
    poll_ok(&c.cq, "the receive", Duration::from_secs(10));
}
