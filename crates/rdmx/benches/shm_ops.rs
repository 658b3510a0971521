//! What the shm provider's operations cost a core, on one thread: both queue pairs of a
//! connection (each in its own context, on the ring data path) are driven by the same
//! thread, so no cache line crosses cores and no side waits for the other. A latency
//! between two processes is at least these costs plus the line transfers of the packets;
//! this separates the two.
//!
//! - `send`: an 8-byte SEND/RECV round trip, as `rdmx bench send_lat` runs it: A posts a
//!   SEND; B polls until its receive completes, posts the receive again and answers with
//!   a SEND; A polls until its receive and its SEND (acknowledged) have completed, and
//!   posts its receive again. Two SENDs, two ACKs, two receives and about four polls.
//! - `write`: an 8-byte RDMA WRITE on the mapped data path (executed by the initiator at
//!   post), posted and its completion polled.
//! - `poll`: a poll of a CQ that finds nothing (a spinning application pays it between
//!   arrivals, and on average half of it on the way to each).
//! - `read`: a 64 KiB RDMA READ on the mapped data path (executed by the initiator at
//!   post), every hundredth signaled and its completion polled, as `rdmx bench read_bw`
//!   posts them; against the provider's copy of 64 KiB alone between two shared
//!   mappings, in alternating batches: the difference is what a READ costs beyond its
//!   copy.
//!
//! Each figure is the median over `--rounds` (default 7) batches of `--iters` operations
//! (default 100000; a tenth of that for `read`), in nanoseconds. Run: `cargo bench -p
//! rdmx --bench shm_ops -- [send] [write] [poll] [read] [--rounds N] [--iters N]` (all four
//! without a name).

mod common;

use std::time::Instant;

use rdmx::{
    Access, Completion, CompletionQueue, ConnectOptions, Context, LocalSge, MemoryRegion, QpCaps,
    QueuePair, RecvRequest, SendRequest, WcOpcode, WcStatus,
};

/// One side: its CQ (send and receive), queue pair and region.
struct Side {
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
}

/// Two connected sides, each in a context of its own opened with `opts`.
fn pair(opts: rdmx::shm::Options, mapped: bool) -> (Side, Side) {
    let side = || {
        let ctx = Context::open(opts.clone()).expect("open an shm context");
        let pd = ctx.alloc_pd();
        let cq = ctx.create_cq(64).expect("create a CQ");
        let qp = pd
            .create_qp(&cq, &cq, QpCaps::default())
            .expect("create a QP");
        let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let mr = match mapped {
            true => pd.register(
                rdmx_mem::Mapping::shared(1 << 16).expect("shared memory"),
                access,
            ),
            false => pd.register(vec![0u8; 1 << 16], access),
        }
        .expect("register");
        Side { cq, qp, mr }
    };
    let (a, b) = (side(), side());
    let o = ConnectOptions::default();
    a.qp.connect(b.qp.endpoint(), &o).expect("connect A");
    b.qp.connect(a.qp.endpoint(), &o).expect("connect B");
    (a, b)
}

/// Polls `s` until `done`, handed each completion, says so.
fn poll_until(s: &Side, mut done: impl FnMut(&Completion) -> bool) {
    let mut wc = [Completion::default(); 8];
    loop {
        let n = s.cq.poll(&mut wc).expect("poll");
        let mut over = false;
        for c in &wc[..n] {
            assert_eq!(c.status, WcStatus::Success, "{c:?}");
            over |= done(c);
        }
        if over {
            return;
        }
    }
}

fn post_recv(s: &Side) {
    let sge = LocalSge::new(&s.mr, 0, 64).expect("a receive buffer");
    s.qp.post_recv(RecvRequest::new(0).sge(sge))
        .expect("post a receive");
}

fn post_send(s: &Side, id: u64) {
    let sge = LocalSge::new(&s.mr, 1024, 8).expect("a source");
    s.qp.post_send(SendRequest::send(id).sge(sge))
        .expect("post a SEND");
}

/// Nanoseconds per SEND/RECV round trip, one batch of `iters`.
/// (Out of line, so that a profiler can be pointed at it: `valgrind --tool=callgrind
/// --toggle-collect=shm_ops::send`.)
#[inline(never)]
fn send(a: &Side, b: &Side, iters: u64) -> f64 {
    let t = Instant::now();
    for i in 0..iters {
        post_send(a, i);
        poll_until(b, |c| c.opcode == WcOpcode::Recv);
        post_recv(b);
        post_send(b, i);
        let (mut got, mut sent) = (false, false);
        poll_until(a, |c| {
            match c.opcode {
                WcOpcode::Recv => got = true,
                _ => sent |= c.wr_id == i,
            }
            got && sent
        });
        post_recv(a);
    }
    t.elapsed().as_nanos() as f64 / iters as f64
}

/// Nanoseconds per 8-byte WRITE posted and completed, one batch of `iters`.
/// (Out of line, so that a profiler can be pointed at it: `valgrind --tool=callgrind
/// --toggle-collect=shm_ops::write`.)
#[inline(never)]
fn write(a: &Side, b: &Side, iters: u64) -> f64 {
    let to = b.mr.remote_at(0);
    let t = Instant::now();
    for i in 0..iters {
        let sge = LocalSge::new(&a.mr, 1024, 8).expect("a source");
        a.qp.post_send(SendRequest::write(i, to).sge(sge))
            .expect("post a WRITE");
        poll_until(a, |c| c.wr_id == i);
    }
    t.elapsed().as_nanos() as f64 / iters as f64
}

/// Nanoseconds per poll that finds nothing, one batch of `iters`.
/// (Out of line, so that a profiler can be pointed at it: `valgrind --tool=callgrind
/// --toggle-collect=shm_ops::poll`.)
#[inline(never)]
fn poll(a: &Side, iters: u64) -> f64 {
    let mut wc = [Completion::default(); 8];
    let t = Instant::now();
    for _ in 0..iters {
        assert_eq!(a.cq.poll(&mut wc).expect("poll"), 0);
    }
    t.elapsed().as_nanos() as f64 / iters as f64
}

/// Nanoseconds per 64 KiB READ on the mapped path (executed at post), every 100th
/// signaled and its completion polled, as `rdmx bench read_bw` posts them.
#[inline(never)]
fn read(a: &Side, b: &Side, iters: u64) -> f64 {
    let from = b.mr.remote_at(0);
    let t = Instant::now();
    for i in 0..iters {
        let sge = LocalSge::new(&a.mr, 0, 1 << 16).expect("a destination");
        let mut req = SendRequest::read(i, from).sge(sge);
        req.set_signaled(i % 100 == 99);
        a.qp.post_send(req).expect("post a READ");
        if i % 100 == 99 {
            poll_until(a, |c| c.wr_id == i);
        }
    }
    t.elapsed().as_nanos() as f64 / iters as f64
}

/// Nanoseconds per copy of 64 KiB between two shared mappings (the provider's copy).
#[inline(never)]
fn copy64(iters: u64) -> f64 {
    let (src, dst) = (
        rdmx_mem::Mapping::shared(1 << 16).expect("shared memory"),
        rdmx_mem::Mapping::shared(1 << 16).expect("shared memory"),
    );
    // SAFETY: two distinct live mappings of 64 KiB each, used only here.
    let (d, s) = unsafe {
        (
            std::slice::from_raw_parts_mut(dst.as_ptr(), 1 << 16),
            std::slice::from_raw_parts(src.as_ptr(), 1 << 16),
        )
    };
    let t = Instant::now();
    for _ in 0..iters {
        rdmx::shm::copy_slice(d, s);
        std::hint::black_box(&mut *d);
    }
    t.elapsed().as_nanos() as f64 / iters as f64
}

/// Two sides on the mapped data path, once A has mapped B's region (its file comes over
/// the socket): from then on A executes WRITEs and READs at post.
fn mapped_pair() -> (Side, Side) {
    let (a, b) = pair(rdmx::shm::Options::default().mapped(true), true);
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    while executed(&a) == 0 && Instant::now() < deadline {
        write(&a, &b, 1);
    }
    (a, b)
}

/// Requests A's queue pair has executed at post so far.
fn executed(a: &Side) -> u64 {
    rdmx::shm::executed_at_post(&a.qp).unwrap_or(0)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args = common::Args::from_env();
    let rounds = args.flag("--rounds", 7).max(1);
    let iters = args.flag("--iters", 100_000).max(1);
    let run = |name: &str| args.runs(&["send", "write", "poll", "read"], name);
    if run("send") || run("poll") {
        let (a, b) = pair(rdmx::shm::Options::default().direct(false), false);
        for _ in 0..8 {
            post_recv(&a);
            post_recv(&b);
        }
        if run("send") {
            send(&a, &b, iters / 10);
            let v = (0..rounds).map(|_| send(&a, &b, iters)).collect();
            println!("send: {:.0} ns per 8-byte SEND/RECV round trip", median(v));
        }
        if run("poll") {
            let v = (0..rounds).map(|_| poll(&a, iters * 10)).collect();
            println!("poll: {:.1} ns per poll that finds nothing", median(v));
        }
    }
    if run("read") {
        let (a, b) = mapped_pair();
        // Whole hundreds: the last READ of a batch is signaled.
        let n = (iters / 1000).max(1) * 100;
        read(&a, &b, n);
        let before = executed(&a);
        let mut r = Vec::new();
        let mut c = Vec::new();
        for _ in 0..rounds {
            r.push(read(&a, &b, n));
            c.push(copy64(n));
        }
        let (r, c) = (median(r), median(c));
        println!(
            "read: {r:.0} ns per 64 KiB READ on the mapped path, copy alone {c:.0} ns \
             ({:.0} ns more; {} of {} executed at post)",
            r - c,
            executed(&a) - before,
            rounds * n
        );
    }
    if run("write") {
        let (a, b) = mapped_pair();
        write(&a, &b, iters / 10);
        let before = executed(&a);
        let v = (0..rounds).map(|_| write(&a, &b, iters)).collect();
        println!(
            "write: {:.0} ns per 8-byte WRITE posted and completed ({} of {} executed at post)",
            median(v),
            executed(&a) - before,
            rounds * iters
        );
    }
}
