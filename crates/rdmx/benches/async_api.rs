//! The async API (`rdmx::tokio`) against the blocking one, on tcp, in one run:
//!
//! - `lat`: 8-byte SEND/RECV round trips (a ping-pong between two threads, each side its
//!   own context): blocking (`post_*_buf`, `CompletionQueue::wait`, `take_buf`) against
//!   async (`recv(buf).await`, `send(buf).await`, each side on a current-thread runtime);
//!   median round trip of each, and their ratio.
//! - `bw`: RDMA WRITE of 64 KiB, 16 outstanding: blocking (`post_send_buf` + `wait`)
//!   against async (16 tasks on a current-thread runtime, each `write(buf).await` in a
//!   loop); median bandwidth of each, and their ratio.
//! - `scale`: 100 queue pairs × 128 outstanding async SENDs each, every message checked
//!   at the receiver, on one current-thread runtime for `--secs` seconds (default 30);
//!   operations per second and the process's resident memory at start and end.
//!
//! Rounds of the two APIs are interleaved (`--rounds`, default 7), so drift on a shared
//! machine hits both alike. Run: `cargo bench -p rdmx --bench async_api -- [lat] [bw]
//! [scale] [--rounds N] [--secs S] [--shared-cq]` (all three without a name; with
//! `--shared-cq` the scale run puts every queue pair of a side on one CQ).

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmx::tokio::{AsyncCq, AsyncQp};
use rdmx::{
    Access, BufferPool, Completion, CompletionQueue, ConnectOptions, Context, PoolBuf, PoolConfig,
    QpCaps, QueuePair, RemoteAddr, SendRequest,
};

const T: Duration = Duration::from_secs(10);

fn main() {
    let args = common::Args::from_env();
    let rounds = args.flag("--rounds", 7) as usize;
    let secs = args.flag("--secs", 30);
    let runs = ["lat", "bw", "scale"];
    if args.runs(&runs, "lat") {
        lat(rounds);
    }
    if args.runs(&runs, "bw") {
        bw(rounds);
    }
    if args.runs(&runs, "scale") {
        scale(secs, args.has("--shared-cq"));
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn tcp() -> Context {
    Context::open_provider("tcp").expect("a tcp context")
}

/// Two connected queue pairs in two tcp contexts, each with its own CQ.
struct Ends {
    qp: [QueuePair; 2],
    cq: [CompletionQueue; 2],
    pool: [BufferPool; 2],
    mr_b: rdmx::MemoryRegion,
}

fn ends(caps: QpCaps, cq_depth: usize) -> Ends {
    let (ca, cb) = (tcp(), tcp());
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let cq = [
        ca.create_cq(cq_depth).unwrap(),
        cb.create_cq(cq_depth).unwrap(),
    ];
    let a = pa.create_qp(&cq[0], &cq[0], caps).unwrap();
    let b = pb.create_qp(&cq[1], &cq[1], caps).unwrap();
    let opts = ConnectOptions::default();
    let (ea, eb) = (a.endpoint(), b.endpoint());
    std::thread::scope(|s| {
        let t = s.spawn(|| a.connect(eb, &opts));
        b.connect(ea, &opts).unwrap();
        t.join().unwrap().unwrap();
    });
    let mr_b = pb.register(vec![0u8; 1 << 20], Access::ALL).unwrap();
    Ends {
        qp: [a, b],
        cq,
        pool: [
            BufferPool::new(pa, PoolConfig::default()).unwrap(),
            BufferPool::new(pb, PoolConfig::default()).unwrap(),
        ],
        mr_b,
    }
}

fn wait_one(cq: &CompletionQueue) -> Completion {
    let mut c = [Completion::default()];
    let start = Instant::now();
    while cq.wait(&mut c, T).unwrap() == 0 {
        assert!(start.elapsed() < T, "no completion");
    }
    assert_eq!(c[0].status, rdmx::WcStatus::Success, "{:?}", c[0]);
    c[0]
}

const LAT_ITERS: usize = 2000;

/// Blocking ping-pong: side `me` of `e`; returns round trips (ns) on side 0.
fn lat_sync(e: &Ends, me: usize) -> Vec<f64> {
    let (qp, cq, pool) = (&e.qp[me], &e.cq[me], &e.pool[me]);
    let mut rtts = Vec::with_capacity(LAT_ITERS);
    let mut rx = Some(pool.get(64).unwrap());
    let mut tx = Some(pool.get(8).unwrap());
    qp.post_recv_buf(1, rx.take().unwrap())
        .map_err(|(e, _)| e)
        .unwrap();
    for _ in 0..LAT_ITERS {
        let start = Instant::now();
        if me == 0 {
            qp.post_send_buf(SendRequest::send(2), tx.take().unwrap())
                .map_err(|(e, _)| e)
                .unwrap();
        }
        // A send completion and a receive, in either order.
        let mut got_recv = false;
        let mut got_send = me == 1;
        while !(got_recv && got_send) {
            let c = wait_one(cq);
            if c.wr_id == 1 {
                rx = qp.take_buf(&c);
                qp.post_recv_buf(1, rx.take().unwrap())
                    .map_err(|(e, _)| e)
                    .unwrap();
                got_recv = true;
                if me == 1 {
                    qp.post_send_buf(SendRequest::send(2), tx.take().unwrap())
                        .map_err(|(e, _)| e)
                        .unwrap();
                    got_send = false;
                }
            } else {
                tx = qp.take_buf(&c);
                got_send = true;
            }
        }
        rtts.push(start.elapsed().as_nanos() as f64);
    }
    rtts
}

/// Async ping-pong on a current-thread runtime.
/// (The queue pair comes back so that it outlives the peer's last request.)
fn lat_async(
    qp: QueuePair,
    cq: CompletionQueue,
    pool: BufferPool,
    me: usize,
) -> (Vec<f64>, AsyncQp) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let acq = AsyncCq::new(cq).unwrap();
        let qp = AsyncQp::new(qp, &acq, &acq).unwrap();
        let mut rtts = Vec::with_capacity(LAT_ITERS);
        let mut rx = pool.get(64).unwrap();
        let mut tx = pool.get(8).unwrap();
        let mut next = qp.recv(pool.get(64).unwrap());
        for _ in 0..LAT_ITERS {
            let start = Instant::now();
            if me == 0 {
                let sent = qp.send(tx);
                let (got, _) = next.await.unwrap();
                next = qp.recv(rx);
                rx = got;
                tx = sent.await.unwrap().0;
            } else {
                // The next receive is posted (when made) before the reply goes out.
                let (got, _) = next.await.unwrap();
                next = qp.recv(rx);
                rx = got;
                tx = qp.send(tx).await.unwrap().0;
            }
            rtts.push(start.elapsed().as_nanos() as f64);
        }
        (rtts, qp)
    })
}

fn lat(rounds: usize) {
    let mut sync_med = Vec::new();
    let mut async_med = Vec::new();
    for round in 0..rounds {
        // A fresh pair per round and API, so neither inherits the other's state.
        let e = ends(QpCaps::default(), 1024);
        let mut s = std::thread::scope(|sc| {
            let t = sc.spawn(|| lat_sync(&e, 1));
            let r = lat_sync(&e, 0);
            t.join().unwrap();
            r
        });
        sync_med.push(median(&mut s) / 1000.0);
        let Ends { qp, cq, pool, .. } = ends(QpCaps::default(), 1024);
        let [qa, qb] = qp;
        let [ca, cb] = cq;
        let [pa, pb] = pool;
        let t = std::thread::spawn(move || lat_async(qb, cb, pb, 1));
        let (mut a, _qa) = lat_async(qa, ca, pa, 0);
        let _qb = t.join().unwrap().1;
        async_med.push(median(&mut a) / 1000.0);
        println!(
            "lat round {round}: blocking {:.2} us, async {:.2} us",
            sync_med[round], async_med[round]
        );
    }
    let (s, a) = (median(&mut sync_med), median(&mut async_med));
    println!(
        "send_lat 8 B round trip on tcp, median of {rounds} rounds x {LAT_ITERS}: \
         blocking {s:.2} us, async {a:.2} us, async/blocking {:.3}",
        a / s
    );
}

const BW_SIZE: usize = 64 << 10;
const BW_DEPTH: usize = 16;
const BW_ITERS: usize = 4000;

fn bw_sync(e: &Ends) -> f64 {
    let (qp, cq, pool) = (&e.qp[0], &e.cq[0], &e.pool[0]);
    let remote = |i: usize| e.mr_b.remote_at((i % 16) * BW_SIZE);
    let start = Instant::now();
    let mut posted = 0;
    let mut done = 0;
    let mut free: Vec<PoolBuf> = (0..BW_DEPTH).map(|_| pool.get(BW_SIZE).unwrap()).collect();
    let mut cs = [Completion::default(); BW_DEPTH];
    while done < BW_ITERS {
        while posted < BW_ITERS && !free.is_empty() {
            let b = free.pop().unwrap();
            qp.post_send_buf(SendRequest::write(posted as u64, remote(posted)), b)
                .map_err(|(e, _)| e)
                .unwrap();
            posted += 1;
        }
        let n = cq.wait(&mut cs, T).unwrap();
        for c in &cs[..n] {
            assert_eq!(c.status, rdmx::WcStatus::Success);
            free.push(qp.take_buf(c).unwrap());
            done += 1;
        }
    }
    (BW_ITERS * BW_SIZE) as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn bw_async(qp: QueuePair, cq: CompletionQueue, pool: BufferPool, remote: RemoteAddr) -> f64 {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let acq = AsyncCq::new(cq).unwrap();
        let qp = AsyncQp::new(qp, &acq, &acq).unwrap();
        let start = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for t in 0..BW_DEPTH {
            let (qp, mut buf) = (qp.clone(), pool.get(BW_SIZE).unwrap());
            tasks.spawn(async move {
                for i in 0..BW_ITERS / BW_DEPTH {
                    let at = RemoteAddr {
                        addr: remote.addr + (((t + i) % 16) * BW_SIZE) as u64,
                        rkey: remote.rkey,
                    };
                    buf = qp.write(buf, at).await.unwrap().0;
                }
            });
        }
        while let Some(r) = tasks.join_next().await {
            r.unwrap();
        }
        (BW_ITERS * BW_SIZE) as f64 / start.elapsed().as_secs_f64() / 1e9
    })
}

fn bw(rounds: usize) {
    let caps = QpCaps::default();
    let mut s_all = Vec::new();
    let mut a_all = Vec::new();
    for round in 0..rounds {
        let e = ends(caps, 1024);
        let s = bw_sync(&e);
        let Ends {
            qp, cq, pool, mr_b, ..
        } = ends(caps, 1024);
        let [qa, qb] = qp;
        let [ca, _cb] = cq;
        let [pa, _pb] = pool;
        let a = bw_async(qa, ca, pa, mr_b.remote_at(0));
        drop((qb, mr_b));
        println!("bw round {round}: blocking {s:.3} GB/s, async {a:.3} GB/s");
        s_all.push(s);
        a_all.push(a);
    }
    let (s, a) = (median(&mut s_all), median(&mut a_all));
    println!(
        "write_bw 64 KiB x {BW_DEPTH} outstanding on tcp, median of {rounds} rounds x \
         {BW_ITERS}: blocking {s:.3} GB/s, async {a:.3} GB/s, async/blocking {:.3}",
        a / s
    );
}

const SCALE_QPS: usize = 100;
const SCALE_DEPTH: usize = 128;
const SCALE_MSG: usize = 256;

fn rss_kib() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4
}

/// With `shared`, one CQ per side serves every queue pair; otherwise each has its own.
fn scale(secs: u64, shared: bool) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (ca, cb) = (tcp(), tcp());
        let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
        let pool_a = BufferPool::new(pa.clone(), PoolConfig::default()).unwrap();
        let pool_b = BufferPool::new(pb.clone(), PoolConfig::default()).unwrap();
        let caps = QpCaps::default()
            .max_send_wr(SCALE_DEPTH)
            .max_recv_wr(SCALE_DEPTH);
        let stop = Arc::new(AtomicBool::new(false));
        let ops = Arc::new(AtomicU64::new(0));
        let mut tasks = tokio::task::JoinSet::new();
        let all = 2 * SCALE_DEPTH * SCALE_QPS;
        let one = (
            AsyncCq::new(ca.create_cq(all).unwrap()).unwrap(),
            AsyncCq::new(cb.create_cq(all).unwrap()).unwrap(),
        );
        for q in 0..SCALE_QPS {
            // A CQ per queue pair and side (each driver routes its own queue's
            // completions), or one per side.
            let (qa_cq, qb_cq) = if shared {
                one.clone()
            } else {
                (
                    AsyncCq::new(ca.create_cq(2 * SCALE_DEPTH).unwrap()).unwrap(),
                    AsyncCq::new(cb.create_cq(2 * SCALE_DEPTH).unwrap()).unwrap(),
                )
            };
            let a = pa.create_qp(qa_cq.cq(), qa_cq.cq(), caps).unwrap();
            let b = pb.create_qp(qb_cq.cq(), qb_cq.cq(), caps).unwrap();
            let (ea, eb) = (a.endpoint(), b.endpoint());
            let opts = ConnectOptions::default();
            std::thread::scope(|s| {
                let t = s.spawn(|| a.connect(eb, &opts));
                b.connect(ea, &opts).unwrap();
                t.join().unwrap().unwrap();
            });
            let a = AsyncQp::new(a, &qa_cq, &qa_cq).unwrap();
            let b = AsyncQp::new(b, &qb_cq, &qb_cq).unwrap();
            for lane in 0..SCALE_DEPTH {
                let (b, pool, stop, ops) = (b.clone(), pool_b.clone(), stop.clone(), ops.clone());
                tasks.spawn(async move {
                    let mut buf = pool.get(SCALE_MSG).unwrap();
                    loop {
                        let (got, c) = b.recv(buf).await.unwrap();
                        let bytes = &got.as_slice().unwrap()[..c.byte_len as usize];
                        let seq = u64::from_le_bytes(bytes[..8].try_into().unwrap());
                        assert!(
                            bytes[8..].iter().all(|&x| x == (seq % 251) as u8),
                            "corrupt message"
                        );
                        ops.fetch_add(1, Ordering::Relaxed);
                        if seq == u64::MAX {
                            return;
                        }
                        buf = got;
                    }
                });
                let (a, pool, stop) = (a.clone(), pool_a.clone(), stop.clone());
                tasks.spawn(async move {
                    let mut buf = pool.get(SCALE_MSG).unwrap();
                    let mut seq = ((q * SCALE_DEPTH + lane) as u64) << 32;
                    loop {
                        let last = stop.load(Ordering::Relaxed);
                        let s = if last { u64::MAX } else { seq };
                        buf.write_at(0, &s.to_le_bytes()).unwrap();
                        buf.as_mut_slice().unwrap()[8..].fill((s % 251) as u8);
                        buf = a.send(buf).await.unwrap().0;
                        if last {
                            return;
                        }
                        seq += 1;
                    }
                });
            }
        }
        // Warm up, then measure.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (rss0, ops0, t0) = (rss_kib(), ops.load(Ordering::Relaxed), Instant::now());
        let mut samples = Vec::new();
        for _ in 0..secs {
            tokio::time::sleep(Duration::from_secs(1)).await;
            samples.push(rss_kib());
        }
        let (rss1, ops1, el) = (rss_kib(), ops.load(Ordering::Relaxed), t0.elapsed());
        stop.store(true, Ordering::Relaxed);
        while let Some(r) = tasks.join_next().await {
            r.unwrap();
        }
        println!(
            "scale: {SCALE_QPS} QPs x {SCALE_DEPTH} outstanding SENDs of {SCALE_MSG} B on tcp, \
             {}, current-thread runtime, {secs} s: {:.0} messages/s verified; RSS start \
             {rss0} KiB, end {rss1} KiB (min {} KiB, max {} KiB over the run)",
            if shared {
                "one CQ per side"
            } else {
                "a CQ per QP and side"
            },
            (ops1 - ops0) as f64 / el.as_secs_f64(),
            samples.iter().min().unwrap_or(&0),
            samples.iter().max().unwrap_or(&0),
        );
    });
}
