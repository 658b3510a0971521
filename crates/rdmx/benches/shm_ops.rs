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
//!
//! Each figure is the median over `--rounds` (default 7) batches of `--iters` operations
//! (default 100000), in nanoseconds. Run: `cargo bench -p rdmx --bench shm_ops -- [send]
//! [write] [poll] [--rounds N] [--iters N]` (all three without a name).

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
        let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args = common::Args::from_env();
    let rounds = args.flag("--rounds", 7).max(1);
    let iters = args.flag("--iters", 100_000).max(1);
    let run = |name: &str| args.runs(&["send", "write", "poll"], name);
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
    if run("write") {
        let (a, b) = pair(rdmx::shm::Options::default().mapped(true), true);
        // The peer's region is mapped once its file has come over the socket.
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        while rdmx::shm::executed_at_post(&a.qp) == Some(0) && Instant::now() < deadline {
            write(&a, &b, 1);
        }
        write(&a, &b, iters / 10);
        let before = rdmx::shm::executed_at_post(&a.qp);
        let v = (0..rounds).map(|_| write(&a, &b, iters)).collect();
        let at_post = rdmx::shm::executed_at_post(&a.qp)
            .zip(before)
            .map(|(x, y)| x - y);
        println!(
            "write: {:.0} ns per 8-byte WRITE posted and completed ({} of {} executed at post)",
            median(v),
            at_post.unwrap_or(0),
            rounds * iters
        );
    }
}
