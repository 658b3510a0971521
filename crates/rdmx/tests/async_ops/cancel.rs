//! Cancellation: operations dropped before they post, in flight, with their queue pairs,
//! after completion, or in flight and then flushed. A pool of exactly one buffer, with no
//! thread caches, shows where the buffer is: while a dropped operation's buffer is in
//! flight the pool is exhausted; once it is back, it is filled with a canary that must
//! survive all later traffic.

use std::time::Duration;

use rdmx::{BufferPool, PoolBuf, PoolConfig, QpCaps};

use super::*;

/// A pool of exactly one 4 KiB buffer, with no thread caches.
fn one_buffer() -> PoolConfig {
    PoolConfig::default()
        .with_classes([4096])
        .with_slab_bytes(4096)
        .with_max_bytes(Some(4096))
        .with_thread_cache(0)
}

/// Waits until `pool` hands out a buffer again, and returns it.
async fn until_back(pool: &BufferPool, what: &str) -> PoolBuf {
    let start = std::time::Instant::now();
    loop {
        if let Ok(b) = pool.get(4096) {
            return b;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{what}: the buffer never came back"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[track_caller]
fn assert_exhausted(pool: &BufferPool, when: &str) {
    assert!(
        pool.get(4096).is_err(),
        "{when}: the pool handed out a buffer that is still in flight"
    );
}

const CANARY: u8 = 0xC5;

/// Fills `b` with the canary.
fn canary(mut b: PoolBuf) -> PoolBuf {
    b.set_len(b.capacity()).unwrap();
    b.as_mut_slice().unwrap().fill(CANARY);
    b
}

#[track_caller]
fn assert_canary(b: &PoolBuf, what: &str) {
    assert!(
        b.as_slice().unwrap().iter().all(|&x| x == CANARY),
        "{what}: a provider wrote into a buffer after it was given back"
    );
}

pub(crate) async fn dropped_before_post(p: &Provider) {
    let pr = p.pair_with(QpCaps::default().max_send_wr(1), one_buffer());
    // No receive at b yet: the first send waits (RNR) and keeps the queue's one slot.
    let first = pr.a.send(filled(&pr.spare_a, b"first"));
    // The second finds no room: it is not posted, and dropping it drops its buffer.
    let mut second = pr.a.send(pr.pool_a.get(8).unwrap());
    assert!(poll_once(&mut second).is_pending(), "no room: it waits");
    assert_exhausted(&pr.pool_a, "an operation waiting for room");
    drop(second);
    let buf = until_back(&pr.pool_a, "dropped while waiting for room").await;
    let rx = pr.b.recv(pr.spare_b.get(64).unwrap());
    let (s, r) = tokio::join!(first, rx);
    s.unwrap();
    assert_eq!(&r.unwrap().0.as_slice().unwrap()[..5], b"first");
    // Made, so posted at once, and dropped without a poll: in flight (no receive at b).
    let mut buf = buf;
    buf.set_len(8).unwrap();
    drop(pr.a.send(buf));
    assert_exhausted(&pr.pool_a, "a send posted and dropped unpolled");
    let (got, c) = pr.b.recv(pr.spare_b.get(64).unwrap()).await.unwrap();
    assert_eq!(c.byte_len, 8);
    drop(got);
    canary(until_back(&pr.pool_a, "a send posted and dropped unpolled").await);
}

/// Sends `n` messages from a to b through the spare pools, checking each.
async fn traffic(pr: &Pair, n: u64) {
    for i in 0..n {
        let msg = pattern(i, 300);
        let rx = pr.b.recv(pr.spare_b.get(4096).unwrap());
        let tx = pr.a.send(filled(&pr.spare_a, &msg));
        let (tx, rx) = tokio::join!(tx, rx);
        tx.unwrap();
        let (buf, c) = rx.unwrap();
        assert_eq!(&buf.as_slice().unwrap()[..c.byte_len as usize], &msg[..]);
    }
}

pub(crate) async fn dropped_in_flight(p: &Provider) {
    let pr = p.pair_with(QpCaps::default(), one_buffer());
    // A receive, posted and dropped: nothing was sent, so it is in flight.
    let mut rx = Box::pin(pr.b.recv(pr.pool_b.get(4096).unwrap()));
    assert!(poll_once(&mut rx).is_pending(), "nothing was sent yet");
    drop(rx);
    assert_exhausted(&pr.pool_b, "a dropped receive in flight");
    let msg = pattern(5, 3000);
    pr.a.send(filled(&pr.spare_a, &msg)).await.unwrap();
    let back = until_back(&pr.pool_b, "the dropped receive").await;
    // The provider wrote the message before the buffer came back.
    let mut head = vec![0u8; msg.len()];
    back.read_at(0, &mut head).unwrap();
    assert_eq!(head, msg, "{}: the dropped receive's data", p.name);
    let rx_canary = canary(back);

    // A send, posted and dropped: no receive at b, so it waits (RNR), in flight.
    let mut tx = Box::pin(pr.a.send(filled(&pr.pool_a, &msg)));
    assert!(poll_once(&mut tx).is_pending(), "no receive was posted yet");
    drop(tx);
    assert_exhausted(&pr.pool_a, "a dropped send in flight");
    let (buf, c) = pr.b.recv(pr.spare_b.get(4096).unwrap()).await.unwrap();
    assert_eq!(&buf.as_slice().unwrap()[..c.byte_len as usize], &msg[..]);
    let back = until_back(&pr.pool_a, "the dropped send").await;
    let mut sent = vec![0u8; msg.len()];
    back.read_at(0, &mut sent).unwrap();
    assert_eq!(sent, msg, "{}: a send's buffer is only read", p.name);
    let tx_canary = canary(back);

    // Later traffic must not touch the buffers given back.
    traffic(&pr, 20).await;
    assert_canary(&rx_canary, "the dropped receive's buffer");
    assert_canary(&tx_canary, "the dropped send's buffer");
}

/// Receives dropped in flight, each then with its queue pair destroyed (no completion
/// will come for them): the slots they held in the CQ do not pile up; each is freed at
/// the next drop of an operation in flight (before, every one stayed for good).
pub(crate) async fn dropped_in_flight_with_their_queue_pairs(p: &Provider) {
    let (sa, sb) = (p.side(1024), p.side(1024));
    let pool = BufferPool::new(sb.pd.clone(), PoolConfig::default()).unwrap();
    for _ in 0..4 {
        let (qa, qb) = p.connect(&sa, &sb, QpCaps::default());
        let mut rx = Box::pin(qb.recv(pool.get(64).unwrap()));
        assert!(poll_once(&mut rx).is_pending(), "nothing was sent");
        drop(rx);
        drop(qb);
        drop(qa);
    }
    // The Debug form says how many slots are taken.
    let shown = format!("{:?}", sb.cq);
    let taken: usize = shown
        .split("in_flight: ")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no in_flight in {shown}"));
    assert!(taken <= 1, "{}: {taken} slots taken: {shown}", p.name);
}

pub(crate) async fn dropped_after_completion(p: &Provider) {
    let pr = p.pair_with(QpCaps::default(), one_buffer());
    // Two sends in order: once the second has completed, the first's completion has been
    // routed to its slot, and its future is dropped without seeing it.
    let mut first = Box::pin(pr.a.send(filled(&pr.pool_a, b"first")));
    assert!(poll_once(&mut first).is_pending());
    let rx1 = pr.b.recv(pr.spare_b.get(64).unwrap());
    let rx2 = pr.b.recv(pr.spare_b.get(64).unwrap());
    let second = pr.a.send(filled(&pr.spare_a, b"second"));
    let (r1, r2, s2) = tokio::join!(rx1, rx2, second);
    assert_eq!(&r1.unwrap().0.as_slice().unwrap()[..5], b"first");
    r2.unwrap();
    s2.unwrap();
    assert_exhausted(&pr.pool_a, "a completed send whose future holds the buffer");
    drop(first);
    let back = canary(until_back(&pr.pool_a, "a completed, unseen send").await);
    traffic(&pr, 5).await;
    assert_canary(&back, "the completed send's buffer");
}

pub(crate) async fn dropped_in_flight_then_flushed(p: &Provider) {
    let pr = p.pair_with(QpCaps::default(), one_buffer());
    let mut rx = Box::pin(pr.b.recv(pr.pool_b.get(4096).unwrap()));
    assert!(poll_once(&mut rx).is_pending());
    drop(rx);
    assert_exhausted(&pr.pool_b, "a dropped receive in flight");
    // An error on b's queue pair flushes the receive.
    let bad = RemoteAddr {
        addr: 0,
        rkey: 0xdead_0000,
    };
    let e =
        pr.b.write(filled(&pr.spare_b, b"oops"), bad)
            .await
            .unwrap_err();
    assert!(e.status().is_some(), "{}: {e}", p.name);
    let back = canary(until_back(&pr.pool_b, "the flushed receive").await);
    tokio::task::yield_now().await;
    assert_canary(&back, "the flushed receive's buffer");
}
