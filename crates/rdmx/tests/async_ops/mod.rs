//! The async API's suite (`rdmx::tokio`), written once and run on every provider like the
//! conformance suite: a test file per provider declares this module and expands
//! [`async_suite!`] with its [`Provider`] inside a module named after it.
//!
//! Operations post when they are made (if their queue has room), not when first polled.
//!
//! Every test runs under a deadline ([`DEADLINE`]) and checks data, not timing. The
//! cancellation tests are in [`cancel`].

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll, Wake, Waker};
use std::time::Duration;

use rdmx::tokio::{AsyncCq, AsyncQp, OpError};
use rdmx::{
    Access, BufferPool, ConnectOptions, Context, MemoryRegion, PoolBuf, PoolConfig, QpCaps,
    RemoteAddr, WcOpcode, WcStatus,
};

/// Expands to one `#[test]` per test of the suite on `$provider` (the name of a `const`
/// [`Provider`]) on a current-thread runtime, and a few again on a multi-thread runtime in
/// a module `multi_thread`.
macro_rules! async_suite {
    ($provider:ident) => {
        async_suite!(@current $provider;
            send_recv_round_trips,
            one_sided_and_atomics,
            write_with_imm_consumes_a_receive,
            error_completion_gives_the_buffer_back,
            dropped_before_post,
            dropped_in_flight,
            dropped_in_flight_with_their_queue_pairs,
            dropped_after_completion,
            dropped_in_flight_then_flushed,
            full_send_queue_waits,
            requests_go_out_in_the_order_their_operations_were_made,
            other_completions_stream,
            many_tasks_many_qps,
            many_outstanding,
            connect_through_cm,
            refusals_give_the_buffer_back,
            waiting_uses_no_cpu,
            a_failed_cq_fails_operations_waiting_for_room,
        );
        mod multi_thread {
            async_suite!(@multi $provider;
                many_tasks_many_qps,
                dropped_in_flight,
                full_send_queue_waits,
                many_outstanding,
            );
        }
    };
    (@current $p:ident; $($test:ident),* $(,)?) => {
        $(
            #[test]
            fn $test() {
                if !($p.available)() {
                    return;
                }
                crate::async_ops::run(false, crate::async_ops::$test(&$p));
            }
        )*
    };
    (@multi $p:ident; $($test:ident),* $(,)?) => {
        $(
            #[test]
            fn $test() {
                if !(super::$p.available)() {
                    return;
                }
                crate::async_ops::run(true, crate::async_ops::$test(&super::$p));
            }
        )*
    };
}

mod cancel;
pub(crate) use cancel::*;

/// What the suite needs to know about a provider.
#[derive(Clone, Copy)]
pub(crate) struct Provider {
    /// Short name, for messages.
    pub(crate) name: &'static str,
    /// Opens a context; called once per side.
    pub(crate) open: fn() -> rdmx::Result<Context>,
    /// Whether the provider can run here (a test returns at once if not).
    pub(crate) available: fn() -> bool,
    /// Whether its contexts are busy-polled (the driver then polls instead of sleeping).
    pub(crate) busy_polls: bool,
}

/// How long a whole test may take.
pub(crate) const DEADLINE: Duration = Duration::from_secs(60);

/// A current-thread or a two-worker runtime, with its IO and time drivers.
pub(crate) fn runtime(multi: bool) -> tokio::runtime::Runtime {
    if multi {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    }
    .unwrap()
}

/// Runs `test` on a current-thread or a two-worker runtime, under [`DEADLINE`].
pub(crate) fn run(multi: bool, test: impl Future<Output = ()>) {
    runtime(multi).block_on(async {
        tokio::time::timeout(DEADLINE, test)
            .await
            .expect("the test did not finish in time");
    });
}

/// Two connected async queue pairs, each side with its own context, CQ and pool.
pub(crate) struct Pair {
    pub(crate) a: AsyncQp,
    pub(crate) b: AsyncQp,
    pub(crate) cq_a: AsyncCq,
    pub(crate) pool_a: BufferPool,
    pub(crate) pool_b: BufferPool,
    /// Pools of many buffers, for traffic besides the buffers a test watches.
    pub(crate) spare_a: BufferPool,
    pub(crate) spare_b: BufferPool,
    /// A region at b that a may write, read and use atomics on.
    pub(crate) mr_b: MemoryRegion,
}

pub(crate) struct Side {
    pub(crate) pd: rdmx::ProtectionDomain,
    pub(crate) cq: AsyncCq,
}

impl Provider {
    pub(crate) fn side(&self, cq_depth: usize) -> Side {
        let ctx = (self.open)().unwrap_or_else(|e| panic!("open {}: {e}", self.name));
        let pd = ctx.alloc_pd();
        let cq = AsyncCq::new(ctx.create_cq(cq_depth).unwrap()).unwrap();
        Side { pd, cq }
    }

    pub(crate) fn connect(&self, a: &Side, b: &Side, caps: QpCaps) -> (AsyncQp, AsyncQp) {
        let qa = AsyncQp::new(
            a.pd.create_qp(a.cq.cq(), a.cq.cq(), caps).unwrap(),
            &a.cq,
            &a.cq,
        )
        .unwrap();
        let qb = AsyncQp::new(
            b.pd.create_qp(b.cq.cq(), b.cq.cq(), caps).unwrap(),
            &b.cq,
            &b.cq,
        )
        .unwrap();
        let opts = ConnectOptions::default();
        let (ea, eb) = (qa.qp().endpoint(), qb.qp().endpoint());
        // On tcp one side's move to RTR waits for the other's dial: connect both at once.
        std::thread::scope(|s| {
            let t = s.spawn(|| qa.qp().connect(eb, &opts));
            qb.qp().connect(ea, &opts).unwrap();
            t.join().unwrap().unwrap();
        });
        (qa, qb)
    }

    pub(crate) fn pair_with(&self, caps: QpCaps, pool: PoolConfig) -> Pair {
        let (sa, sb) = (self.side(1024), self.side(1024));
        let (a, b) = self.connect(&sa, &sb, caps);
        let mr_b = sb.pd.register(vec![0u8; 1 << 16], Access::ALL).unwrap();
        Pair {
            a,
            b,
            cq_a: sa.cq,
            pool_a: BufferPool::new(sa.pd.clone(), pool.clone()).unwrap(),
            pool_b: BufferPool::new(sb.pd.clone(), pool).unwrap(),
            spare_a: BufferPool::new(sa.pd, PoolConfig::default()).unwrap(),
            spare_b: BufferPool::new(sb.pd, PoolConfig::default()).unwrap(),
            mr_b,
        }
    }

    pub(crate) fn pair(&self) -> Pair {
        self.pair_with(QpCaps::default(), PoolConfig::default())
    }
}

fn filled(pool: &BufferPool, bytes: &[u8]) -> PoolBuf {
    let mut b = pool.get(bytes.len()).unwrap();
    b.write_at(0, bytes).unwrap();
    b
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (seed.wrapping_mul(31).wrapping_add(i as u64 * 7) % 251) as u8)
        .collect()
}

/// Polls `f` once, without a task to wake.
fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    struct Nobody;
    impl Wake for Nobody {
        fn wake(self: Arc<Self>) {}
    }
    let waker = Waker::from(Arc::new(Nobody));
    Pin::new(f).poll(&mut TaskContext::from_waker(&waker))
}

pub(crate) async fn send_recv_round_trips(p: &Provider) {
    let pr = p.pair();
    for round in 0..100u64 {
        let len = [1usize, 8, 100, 4096, 65536][round as usize % 5];
        let msg = pattern(round, len);
        let rx = pr.b.recv(pr.pool_b.get(65536).unwrap());
        let tx = pr.a.send(filled(&pr.pool_a, &msg));
        let (tx, rx) = tokio::join!(tx, rx);
        let (tx, c) = tx.unwrap();
        assert_eq!((c.status, c.opcode), (WcStatus::Success, WcOpcode::Send));
        assert_eq!(tx.as_slice().unwrap(), &msg[..]);
        let (rx, c) = rx.unwrap();
        assert_eq!(c.byte_len as usize, len, "{}", p.name);
        assert_eq!(&rx.as_slice().unwrap()[..len], &msg[..]);
    }
}

pub(crate) async fn one_sided_and_atomics(p: &Provider) {
    let pr = p.pair();
    let remote = |off: u64| RemoteAddr {
        addr: pr.mr_b.remote_at(0).addr + off,
        rkey: pr.mr_b.remote_at(0).rkey,
    };
    let msg = pattern(9, 8192);
    let (_, c) =
        pr.a.write(filled(&pr.pool_a, &msg), remote(100))
            .await
            .unwrap();
    assert_eq!(c.opcode, WcOpcode::RdmaWrite);
    let mut at_b = vec![0u8; msg.len()];
    pr.mr_b.read_at(100, &mut at_b).unwrap();
    assert_eq!(at_b, msg);

    let (back, c) =
        pr.a.read(pr.pool_a.get(8192).unwrap(), remote(100))
            .await
            .unwrap();
    assert_eq!((c.opcode, c.byte_len), (WcOpcode::RdmaRead, 8192));
    assert_eq!(back.as_slice().unwrap(), &msg[..]);

    pr.mr_b.write_at(64, &40u64.to_ne_bytes()).unwrap();
    let (old, _) =
        pr.a.fetch_add(pr.pool_a.get(8).unwrap(), remote(64), 2)
            .await
            .unwrap();
    assert_eq!(
        u64::from_ne_bytes(old.as_slice().unwrap().try_into().unwrap()),
        40
    );
    let (old, _) = pr.a.compare_swap(old, remote(64), 42, 7).await.unwrap();
    assert_eq!(
        u64::from_ne_bytes(old.as_slice().unwrap().try_into().unwrap()),
        42
    );
    let mut now = [0u8; 8];
    pr.mr_b.read_at(64, &mut now).unwrap();
    assert_eq!(u64::from_ne_bytes(now), 7);
}

pub(crate) async fn write_with_imm_consumes_a_receive(p: &Provider) {
    let pr = p.pair();
    let remote = pr.mr_b.remote_at(0);
    let rx = pr.b.recv(pr.pool_b.get(16).unwrap());
    let msg = pattern(3, 1000);
    let tx =
        pr.a.write_with_imm(filled(&pr.pool_a, &msg), remote, 0xfeed);
    let (tx, rx) = tokio::join!(tx, rx);
    tx.unwrap();
    let (_, c) = rx.unwrap();
    assert_eq!(c.opcode, WcOpcode::RecvRdmaWithImm);
    assert_eq!((c.imm_data, c.byte_len), (Some(0xfeed), 1000));
    let mut at_b = vec![0u8; msg.len()];
    pr.mr_b.read_at(0, &mut at_b).unwrap();
    assert_eq!(at_b, msg);

    let tx = pr.a.send_with_imm(filled(&pr.pool_a, b"imm"), 77);
    let rx = pr.b.recv(pr.pool_b.get(16).unwrap());
    let (tx, rx) = tokio::join!(tx, rx);
    tx.unwrap();
    let (buf, c) = rx.unwrap();
    assert_eq!(
        (c.imm_data, &buf.as_slice().unwrap()[..3]),
        (Some(77), &b"imm"[..])
    );
}

pub(crate) async fn error_completion_gives_the_buffer_back(p: &Provider) {
    let pr = p.pair();
    let bad = RemoteAddr {
        addr: pr.mr_b.remote_at(0).addr,
        rkey: pr.mr_b.remote_at(0).rkey ^ 0x5a5a_0000,
    };
    let msg = pattern(1, 64);
    match pr.a.write(filled(&pr.pool_a, &msg), bad).await {
        Err(OpError::Completion(c, buf)) => {
            assert_eq!(c.status, WcStatus::RemAccessErr, "{}", p.name);
            assert_eq!(buf.as_slice().unwrap(), &msg[..]);
        }
        other => panic!("{}: expected an access error, got {other:?}", p.name),
    }
    // The queue pair is in error now: a post is refused and gives the buffer back, or is
    // flushed.
    match pr.a.send(filled(&pr.pool_a, b"x")).await {
        Err(OpError::Post(_, b)) | Err(OpError::Completion(_, b)) => {
            assert_eq!(b.as_slice().unwrap(), b"x")
        }
        other => panic!("{}: a send after the error: {other:?}", p.name),
    }
}

pub(crate) async fn full_send_queue_waits(p: &Provider) {
    let caps = QpCaps::default().max_send_wr(2).max_recv_wr(64);
    let pr = p.pair_with(caps, PoolConfig::default());
    // Twenty sends on a queue of two: the rest wait for room, none is refused.
    let sends = (0..20u64).map(|i| {
        let qp = pr.a.clone();
        let buf = filled(&pr.pool_a, &i.to_le_bytes());
        async move { qp.send(buf).await.map(|_| ()) }
    });
    let recvs = (0..20u64).map(|_| {
        let qp = pr.b.clone();
        let buf = pr.pool_b.get(8).unwrap();
        async move {
            qp.recv(buf)
                .await
                .map(|(b, _)| b.as_slice().unwrap().to_vec())
        }
    });
    let (s, r) = tokio::join!(join_all(sends), join_all(recvs));
    assert!(s.iter().all(|r| r.is_ok()), "{}: {s:?}", p.name);
    let mut got: Vec<u64> = r
        .into_iter()
        .map(|r| u64::from_le_bytes(r.unwrap().try_into().unwrap()))
        .collect();
    got.sort();
    assert_eq!(got, (0..20).collect::<Vec<_>>());
}

/// An operation made while the queue is full waits for room behind those made before
/// it, whether or not it is polled: a slot that frees posts the oldest waiting request
/// (before, one made later could take the slot first, and its bytes arrived first).
pub(crate) async fn requests_go_out_in_the_order_their_operations_were_made(p: &Provider) {
    let caps = QpCaps::default().max_send_wr(1).max_recv_wr(8);
    let pr = p.pair_with(caps, PoolConfig::default());
    let recvs: Vec<_> = (0..3)
        .map(|_| pr.b.recv(pr.pool_b.get(8).unwrap()))
        .collect();
    let t = Duration::from_secs(10);
    let first = pr.a.send(filled(&pr.pool_a, b"first"));
    // The queue is full: it waits, not polled.
    let header = pr.a.send(filled(&pr.pool_a, b"header"));
    tokio::time::timeout(t, first).await.unwrap().unwrap();
    let body = pr.a.send(filled(&pr.pool_a, b"body"));
    // The later one is polled first.
    let (b, h) = tokio::time::timeout(t, async { tokio::join!(body, header) })
        .await
        .unwrap();
    assert!(b.is_ok() && h.is_ok(), "{}: {b:?} {h:?}", p.name);
    let mut got = Vec::new();
    for r in recvs {
        let (buf, c) = tokio::time::timeout(t, r).await.unwrap().unwrap();
        got.push(
            String::from_utf8_lossy(&buf.as_slice().unwrap()[..c.byte_len as usize]).into_owned(),
        );
    }
    assert_eq!(got, ["first", "header", "body"], "{}", p.name);
}

pub(crate) async fn other_completions_stream(p: &Provider) {
    let pr = p.pair();
    // A blocking post on an async queue pair: its completion goes to the stream.
    pr.a.qp()
        .post_send(rdmx::SendRequest::write(42, pr.mr_b.remote_at(0)).inline(b"hey"))
        .unwrap();
    let c = tokio::time::timeout(Duration::from_secs(10), pr.cq_a.next())
        .await
        .expect("a completion on the stream")
        .unwrap();
    assert_eq!((c.wr_id, c.status), (42, WcStatus::Success));
}

pub(crate) async fn many_tasks_many_qps(p: &Provider) {
    const QPS: usize = 4;
    const TASKS: usize = 8;
    const OPS: usize = 40;
    let caps = QpCaps::default().max_send_wr(4).max_recv_wr(TASKS * 2);
    let (sa, sb) = (p.side(1024), p.side(1024));
    let pool_a = BufferPool::new(sa.pd.clone(), PoolConfig::default()).unwrap();
    let pool_b = BufferPool::new(sb.pd.clone(), PoolConfig::default()).unwrap();
    let mut handles = Vec::new();
    // Every queue pair lives until every task is done: a receiver that returns after the
    // last message must not destroy its queue pair before the ACK went out.
    let mut keep = Vec::new();
    for q in 0..QPS {
        let (a, b) = p.connect(&sa, &sb, caps);
        keep.push((a.clone(), b.clone()));
        // Receivers: TASKS tasks, each receiving OPS messages and checking each.
        for _ in 0..TASKS {
            let (b, pool) = (b.clone(), pool_b.clone());
            handles.push(tokio::spawn(async move {
                for _ in 0..OPS {
                    let (buf, c) = b.recv(pool.get(256).unwrap()).await.unwrap();
                    let got = &buf.as_slice().unwrap()[..c.byte_len as usize];
                    let seed = u64::from_le_bytes(got[..8].try_into().unwrap());
                    assert_eq!(&got[8..], &pattern(seed, 200)[..], "message {seed}");
                }
            }));
        }
        // Senders: TASKS tasks on the same queue pair, more than its queue holds.
        for t in 0..TASKS {
            let (a, pool) = (a.clone(), pool_a.clone());
            handles.push(tokio::spawn(async move {
                for i in 0..OPS {
                    let seed = ((q * TASKS + t) * OPS + i) as u64;
                    let mut msg = seed.to_le_bytes().to_vec();
                    msg.extend(pattern(seed, 200));
                    a.send(filled(&pool, &msg)).await.unwrap();
                }
            }));
        }
    }
    for h in handles {
        h.await.unwrap();
    }
    drop(keep);
}

async fn join_all<F: Future>(fs: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let mut set = Vec::new();
    for f in fs {
        set.push(Box::pin(f));
    }
    let mut out: Vec<Option<F::Output>> = set.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in set.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => *o = Some(v),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    out.into_iter().map(Option::unwrap).collect()
}

pub(crate) async fn connect_through_cm(p: &Provider) {
    use rdmx::tokio::cm;
    let (sa, sb) = (p.side(1024), p.side(1024));
    let qp = |s: &Side| {
        AsyncQp::new(
            s.pd.create_qp(s.cq.cq(), s.cq.cq(), QpCaps::default())
                .unwrap(),
            &s.cq,
            &s.cq,
        )
        .unwrap()
    };
    let (a, b) = (qp(&sa), qp(&sb));
    let listener = cm::Listener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let opts = ConnectOptions::default();
    let t = Duration::from_secs(20);
    let accept = listener.accept(std::slice::from_ref(&b), &opts, b"from b", t);
    let connect = cm::connect(
        ("127.0.0.1", port),
        std::slice::from_ref(&a),
        &opts,
        b"from a",
        t,
    );
    let (got_b, got_a) = tokio::join!(accept, connect);
    assert_eq!(got_b.unwrap(), b"from a");
    assert_eq!(got_a.unwrap(), b"from b");
    let pool_a = BufferPool::new(sa.pd, PoolConfig::default()).unwrap();
    let pool_b = BufferPool::new(sb.pd, PoolConfig::default()).unwrap();
    let rx = b.recv(pool_b.get(64).unwrap());
    a.send(filled(&pool_a, b"connected")).await.unwrap();
    let (buf, c) = rx.await.unwrap();
    assert_eq!(
        &buf.as_slice().unwrap()[..c.byte_len as usize],
        b"connected"
    );
}

/// Ten queue pairs with 32 operations outstanding each, every byte checked: each task
/// WRITEs its own pattern to its own stretch of the peer's region and READs it back.
pub(crate) async fn many_outstanding(p: &Provider) {
    const QPS: usize = 10;
    const DEPTH: usize = 32;
    const CHUNK: usize = 1024;
    let (sa, sb) = (p.side(QPS * 2 * DEPTH), p.side(QPS * 2 * DEPTH));
    let caps = QpCaps::default().max_send_wr(DEPTH).max_recv_wr(DEPTH);
    let pool = BufferPool::new(sa.pd.clone(), PoolConfig::default()).unwrap();
    let region = sb
        .pd
        .register(vec![0u8; QPS * DEPTH * CHUNK], Access::ALL)
        .unwrap();
    let base = region.remote_at(0);
    let mut tasks = tokio::task::JoinSet::new();
    let mut keep = Vec::new();
    for q in 0..QPS {
        let (a, b) = p.connect(&sa, &sb, caps);
        keep.push(b);
        for t in 0..DEPTH {
            let (a, pool) = (a.clone(), pool.clone());
            let at = RemoteAddr {
                addr: base.addr + ((q * DEPTH + t) * CHUNK) as u64,
                rkey: base.rkey,
            };
            tasks.spawn(async move {
                for i in 0..10u64 {
                    let want = pattern(((q * DEPTH + t) as u64) << 8 | i, CHUNK);
                    let (buf, _) = a.write(filled(&pool, &want), at).await.unwrap();
                    let (got, _) = a.read(buf, at).await.unwrap();
                    assert_eq!(got.as_slice().unwrap(), &want[..], "qp {q} task {t}");
                }
            });
        }
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    drop(keep);
}

pub(crate) async fn refusals_give_the_buffer_back(p: &Provider) {
    let s = p.side(300);
    let pool = BufferPool::new(s.pd.clone(), PoolConfig::default()).unwrap();
    // A queue that cannot hold every completion the queue pair may have outstanding.
    let big = QpCaps::default().max_send_wr(200).max_recv_wr(200);
    let qp = s.pd.create_qp(s.cq.cq(), s.cq.cq(), big).unwrap();
    let e = AsyncQp::new(qp, &s.cq, &s.cq).unwrap_err();
    assert!(e.to_string().contains("cannot hold"), "{e}");
    // A queue pair in RESET refuses posts at once; the buffer comes back untouched.
    let qp =
        s.pd.create_qp(s.cq.cq(), s.cq.cq(), QpCaps::default())
            .unwrap();
    let qp = AsyncQp::new(qp, &s.cq, &s.cq).unwrap();
    match qp.send(filled(&pool, b"early")).await {
        Err(OpError::Post(_, b)) => assert_eq!(b.as_slice().unwrap(), b"early"),
        other => panic!("{}: a send in RESET: {other:?}", p.name),
    }
    match qp.recv(pool.get(64).unwrap()).await {
        Err(e) => assert!(e.into_buf().is_some()),
        Ok(_) => panic!("{}: a receive in RESET completed", p.name),
    }
    // An unsignaled request cannot return its buffer: refused.
    let req = rdmx::SendRequest::send(0).unsignaled();
    let e = qp.post(req, filled(&pool, b"x")).await.unwrap_err();
    assert!(matches!(e, OpError::Post(..)), "{e}");
}

/// CPU time this thread has used, in clock ticks (`/proc/thread-self/stat`).
fn thread_cpu_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
    // Fields after the command name (which is in parentheses): state is the 3rd field,
    // utime the 14th and stime the 15th.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// While operations wait and nothing completes, the runtime's thread sleeps: the driver
/// waits on the notification, it does not poll in a loop or in slices.
pub(crate) async fn waiting_uses_no_cpu(p: &Provider) {
    if p.busy_polls {
        return;
    }
    let pr = p.pair();
    let rx = pr.b.recv(pr.pool_b.get(64).unwrap());
    let Some(before) = thread_cpu_ticks() else {
        return;
    };
    let quiet = Duration::from_millis(600);
    let waited = tokio::time::timeout(quiet, rx).await;
    assert!(waited.is_err(), "nothing was sent");
    let used = thread_cpu_ticks().unwrap_or(before) - before;
    // A thread that polls the whole time uses about 60 ticks (of 10 ms) here.
    assert!(
        used < 20,
        "{}: the runtime thread used {used} ticks of CPU in {quiet:?} of waiting",
        p.name
    );
}

/// An operation in flight (a SEND its peer has no receive for) and one waiting for room in
/// a send queue of one; a blocking queue pair on the same CQ of 4 entries then overruns
/// it. Both operations resolve with an error (before, the one waiting for room waited for
/// good: the failed operation kept its room).
pub(crate) async fn a_failed_cq_fails_operations_waiting_for_room(p: &Provider) {
    let (sa, sb) = (p.side(4), p.side(64));
    let (a, _b) = p.connect(&sa, &sb, QpCaps::default().max_send_wr(1).max_recv_wr(1));
    // A blocking queue pair, on the same CQ, that can have more outstanding than it holds.
    let caps = QpCaps::default().max_send_wr(64);
    let c = sa.pd.create_qp(sa.cq.cq(), sa.cq.cq(), caps).unwrap();
    let d = sb.pd.create_qp(sb.cq.cq(), sb.cq.cq(), caps).unwrap();
    let (ec, ed) = (c.endpoint(), d.endpoint());
    std::thread::scope(|s| {
        let t = s.spawn(|| c.connect(ed, &ConnectOptions::default()));
        d.connect(ec, &ConnectOptions::default()).unwrap();
        t.join().unwrap().unwrap();
    });
    let mr = sb.pd.register(vec![0u8; 64], Access::ALL).unwrap();
    let pool = BufferPool::new(sa.pd.clone(), PoolConfig::default()).unwrap();
    let mut first = a.send(filled(&pool, b"first"));
    assert!(poll_once(&mut first).is_pending(), "{}", p.name);
    let mut second = a.send(filled(&pool, b"second"));
    assert!(poll_once(&mut second).is_pending(), "{}", p.name);
    let writes: Vec<_> = (0..64)
        .map(|i| rdmx::SendRequest::write(i, mr.remote_at(0)).inline(b"x"))
        .collect();
    c.post_send_list(&writes).unwrap();
    // The completions arrive (tcp: through its progress thread) while the driver task,
    // on this thread, cannot reap them.
    std::thread::sleep(Duration::from_millis(300));
    let r = tokio::time::timeout(Duration::from_secs(10), first)
        .await
        .expect("the operation in flight resolves");
    assert!(r.is_err(), "{}: {r:?}", p.name);
    let r = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .expect("the operation waiting for room resolves");
    assert!(r.is_err(), "{}: {r:?}", p.name);
}
