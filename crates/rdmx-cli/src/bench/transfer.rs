//! perftest's transfer tests on any provider: `write_bw`, `read_bw`, `send_bw`,
//! `atomic_bw`, `write_lat`, `read_lat`, `send_lat`, `atomic_lat`.
//!
//! Both sides run in this process, each with its own context (as two processes would
//! have), connected over the chosen provider; on tcp every byte crosses a real TCP
//! connection. Bandwidth tests keep `tx_depth` requests outstanding and signal every
//! `cq_mod`-th; latency tests ping-pong (WRITE, SEND: half the round trip, as perftest
//! reports) or wait for each request (READ, atomics: the whole round trip).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use rdmx::{
    Access, Completion, CompletionQueue, ConnectOptions, Context, ContextOptions, LocalSge,
    MemoryRegion, Mtu, QpCaps, QueuePair, RecvRequest, SendRequest, WcOpcode, WcStatus,
};
use serde_json::json;

use super::stats::median;

type BoxError = Box<dyn std::error::Error>;

/// Options shared by every transfer test (perftest's names where they exist).
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct Args {
    /// Provider to run on (see `rdmx devices`).
    #[arg(long, default_value = "loopback")]
    provider: String,
    /// Message size in bytes (default: 65536 for bandwidth, 2 for latency, 8 for atomics).
    #[arg(short = 's', long)]
    size: Option<usize>,
    /// Iterations (default: 5000 for bandwidth, 1000 for latency).
    #[arg(short = 'n', long)]
    iters: Option<usize>,
    /// Requests outstanding at once (bandwidth tests).
    #[arg(short = 't', long = "tx-depth", default_value_t = 128)]
    tx_depth: usize,
    /// Signal one request in this many (bandwidth tests).
    #[arg(short = 'Q', long = "cq-mod", default_value_t = 100)]
    cq_mod: usize,
    /// Path MTU in bytes (default: the device's active MTU).
    #[arg(long)]
    mtu: Option<u32>,
    /// How progress is made: `thread` (a progress thread per context), `busy` (polling
    /// the CQs drives it; lowest latency) or `auto` (busy for latency tests, as perftest
    /// polls; thread for bandwidth tests).
    #[arg(long, value_enum, default_value_t = ProgressMode::Auto)]
    progress: ProgressMode,
    /// Check the data on the receiving side after the run.
    #[arg(long)]
    verify: bool,
    /// Report bandwidth in Gb/s instead of MiB/s.
    #[arg(long)]
    report_gbits: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// `--progress`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum ProgressMode {
    Auto,
    Thread,
    Busy,
}

/// Which test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Test {
    WriteBw,
    ReadBw,
    SendBw,
    AtomicBw,
    WriteLat,
    ReadLat,
    SendLat,
    AtomicLat,
}

impl Test {
    fn name(self) -> &'static str {
        match self {
            Test::WriteBw => "write_bw",
            Test::ReadBw => "read_bw",
            Test::SendBw => "send_bw",
            Test::AtomicBw => "atomic_bw",
            Test::WriteLat => "write_lat",
            Test::ReadLat => "read_lat",
            Test::SendLat => "send_lat",
            Test::AtomicLat => "atomic_lat",
        }
    }
    fn is_bw(self) -> bool {
        matches!(
            self,
            Test::WriteBw | Test::ReadBw | Test::SendBw | Test::AtomicBw
        )
    }
    fn is_atomic(self) -> bool {
        matches!(self, Test::AtomicBw | Test::AtomicLat)
    }
}

/// One side: a context, a region, a CQ and a QP.
struct Side {
    busy: bool,
    ctx: Context,
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
}

fn side(a: &Args, size: usize, depth: usize, busy: bool) -> Result<Side, BoxError> {
    let ctx = Context::open_with(&a.provider, &ContextOptions::default().busy_poll(busy))?;
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(4 * depth + 64)?;
    let caps = QpCaps::default()
        .max_send_wr(depth + 16)
        .max_recv_wr(depth + 16);
    let qp = pd.create_qp(&cq, &cq, caps)?;
    // Two halves: what this side sends from, and what its peer writes into.
    let mr = pd.register(vec![0u8; 2 * size.max(8)], Access::ALL)?;
    Ok(Side {
        busy,
        ctx,
        cq,
        qp,
        mr,
    })
}

/// Runs `test` and prints its result.
pub(crate) fn run(test: Test, a: Args) -> Result<(), BoxError> {
    let size = if test.is_atomic() {
        8
    } else {
        a.size.unwrap_or(if test.is_bw() { 65536 } else { 2 })
    };
    if a.size.is_some_and(|s| s != 8) && test.is_atomic() {
        return Err("atomics are 8 bytes: -s must be 8 or left out".into());
    }
    if size == 0 || a.tx_depth == 0 || a.cq_mod == 0 {
        return Err("-s, -t and -Q must be at least 1".into());
    }
    let iters = a.iters.unwrap_or(if test.is_bw() { 5000 } else { 1000 });
    if iters == 0 {
        return Err("-n must be at least 1".into());
    }
    let depth = if test.is_bw() { a.tx_depth } else { 1 };
    let busy = match a.progress {
        ProgressMode::Busy => true,
        ProgressMode::Thread => false,
        ProgressMode::Auto => !test.is_bw(),
    };
    let requester = side(&a, size, depth, busy)?;
    let responder = side(&a, size, depth, busy)?;
    let mut opts = ConnectOptions::default();
    if let Some(m) = a.mtu {
        opts.mtu = Some(Mtu::from_bytes(m).ok_or("--mtu must be a power of two ≥ 256")?);
    }
    requester.qp.connect(responder.qp.endpoint(), &opts)?;
    responder.qp.connect(requester.qp.endpoint(), &opts)?;
    let mtu = requester.qp.attrs().path_mtu.bytes();
    let info = requester.ctx.provider();
    if !a.json {
        println!("{}", "-".repeat(79));
        println!(
            "                    {} test (rdmx)",
            test.name().replace('_', " ")
        );
        println!(
            " Provider: {}   Device: {}   Transport: RC   Progress: {}",
            info.name(),
            info.device_name(),
            if busy { "busy-poll" } else { "thread" }
        );
        println!(
            " Number of qps: 1   TX depth: {depth}   CQ moderation: {}   Mtu: {mtu}[B]",
            a.cq_mod
        );
        println!("{}", "-".repeat(79));
    }
    if a.verify && !test.is_atomic() {
        requester.mr.write_at(0, &pattern(1, size))?;
        responder.mr.write_at(0, &pattern(2, size))?;
    }
    let row = if test.is_bw() {
        bandwidth(test, &a, &requester, &responder, size, iters)?
    } else {
        Row::Lat {
            bytes: size,
            iters,
            us: latency(test, &requester, &responder, size, iters)?,
        }
    };
    if a.verify {
        verify(test, &requester, &responder, size, iters)?;
    }
    if a.json {
        let out = json!({
            "test": test.name(),
            "provider": info.name(),
            "device": info.device_name(),
            "transport": "RC",
            "mtu": mtu,
            "progress": if busy { "busy-poll" } else { "thread" },
            "results": [row.json(a.report_gbits)],
        });
        println!("{out}");
    } else {
        row.print(a.report_gbits);
        println!("{}", "-".repeat(79));
    }
    Ok(())
}

enum Row {
    Bw {
        bytes: usize,
        iters: usize,
        peak: f64,
        avg: f64,
        mpps: f64,
    },
    Lat {
        bytes: usize,
        iters: usize,
        us: Vec<f64>,
    },
}

impl Row {
    fn json(&self, gbits: bool) -> serde_json::Value {
        match self {
            Row::Bw {
                bytes,
                iters,
                peak,
                avg,
                mpps,
            } => {
                let mut v = json!({
                    "bytes": bytes, "iterations": iters,
                    "bw_peak_mib_s": peak, "bw_avg_mib_s": avg, "msg_rate_mpps": mpps,
                });
                if gbits {
                    v["bw_avg_gbit_s"] = json!(avg * 1048576.0 * 8.0 / 1e9);
                }
                v
            }
            Row::Lat { bytes, iters, us } => {
                let s = LatStats::of(us);
                json!({
                    "bytes": bytes, "iterations": iters,
                    "t_min_us": s.min, "t_max_us": s.max, "t_typical_us": s.typical,
                    "t_avg_us": s.avg, "t_stdev_us": s.stdev, "p99_us": s.p99, "p999_us": s.p999,
                })
            }
        }
    }

    fn print(&self, gbits: bool) {
        match self {
            Row::Bw {
                bytes,
                iters,
                peak,
                avg,
                mpps,
            } => {
                let (unit, k) = if gbits {
                    ("Gb/sec", 1048576.0 * 8.0 / 1e9)
                } else {
                    ("MiB/sec", 1.0)
                };
                println!(
                    " #bytes     #iterations    BW peak[{unit}]    BW average[{unit}]   MsgRate[Mpps]"
                );
                println!(
                    " {bytes:<10} {iters:<14} {:<18.2} {:<21.2} {mpps:.6}",
                    peak * k,
                    avg * k
                );
            }
            Row::Lat { bytes, iters, us } => {
                let s = LatStats::of(us);
                println!(
                    " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]"
                );
                println!(
                    " {bytes:<6} {iters:<14} {:<14.2} {:<12.2} {:<18.2} {:<14.2} {:<15.2} {:<22.2} {:.2}",
                    s.min, s.max, s.typical, s.avg, s.stdev, s.p99, s.p999
                );
            }
        }
    }
}

struct LatStats {
    min: f64,
    max: f64,
    typical: f64,
    avg: f64,
    stdev: f64,
    p99: f64,
    p999: f64,
}

impl LatStats {
    fn of(us: &[f64]) -> LatStats {
        let mut v = us.to_vec();
        let typical = median(&mut v);
        let n = v.len() as f64;
        let avg = v.iter().sum::<f64>() / n;
        let var = v.iter().map(|x| (x - avg) * (x - avg)).sum::<f64>() / n;
        let pct = |p: f64| v[(((n * p).ceil() as usize).max(1) - 1).min(v.len() - 1)];
        LatStats {
            min: v[0],
            max: v[v.len() - 1],
            typical,
            avg,
            stdev: var.sqrt(),
            p99: pct(0.99),
            p999: pct(0.999),
        }
    }
}

fn poll(cq: &CompletionQueue, out: &mut [Completion]) -> Result<usize, BoxError> {
    let n = cq.poll(out)?;
    for c in &out[..n] {
        if c.status != WcStatus::Success {
            return Err(format!("work request {} failed: {:?}", c.wr_id, c.status).into());
        }
    }
    Ok(n)
}

const EMPTY: Completion = Completion {
    wr_id: 0,
    status: WcStatus::Success,
    opcode: WcOpcode::Send,
    byte_len: 0,
    imm_data: None,
    qp_num: 0,
};

/// Keeps receives posted on `s` until `stop`, polling its CQ (the SEND target's side).
fn receiver(
    s: &Side,
    size: usize,
    depth: usize,
    busy: bool,
    stop: &AtomicBool,
) -> Result<usize, BoxError> {
    let post = |i: u64| {
        s.qp.post_recv(RecvRequest::new(i).sge(LocalSge::new(&s.mr, size, size)?))
            .map_err(BoxError::from)
    };
    for i in 0..depth as u64 {
        post(i)?;
    }
    let mut got = 0;
    let mut wc = [EMPTY; 64];
    while !stop.load(Ordering::Acquire) {
        let n = poll(&s.cq, &mut wc)?;
        for c in &wc[..n] {
            got += 1;
            post(c.wr_id)?;
        }
        if n == 0 {
            idle(busy);
        }
    }
    Ok(got)
}

fn bandwidth(
    test: Test,
    a: &Args,
    req: &Side,
    resp: &Side,
    size: usize,
    iters: usize,
) -> Result<Row, BoxError> {
    let stop = Arc::new(AtomicBool::new(false));
    let depth = a.tx_depth;
    let cq_mod = a.cq_mod.min(depth);
    thread::scope(|scope| {
        // The responder's CQ is polled too: for SEND it must repost receives, and in
        // busy-poll mode polling is what moves its side.
        let stop2 = stop.clone();
        let busy = req.busy;
        let rx = scope.spawn(move || -> Result<usize, String> {
            if test == Test::SendBw {
                receiver(resp, size, depth, busy, &stop2).map_err(|e| e.to_string())
            } else {
                // One-sided: the responder's application does nothing, as with perftest's
                // server; in busy-poll mode its polling is what moves its side.
                let mut wc = [EMPTY; 16];
                while !stop2.load(Ordering::Acquire) {
                    if resp.cq.poll(&mut wc).map_err(|e| e.to_string())? == 0 {
                        idle(busy);
                    }
                }
                Ok(0)
            }
        });
        // WRITE and SEND land in the responder's second half; READ reads its first half
        // into the requester's second half.
        let remote = resp
            .mr
            .remote_at(if test == Test::ReadBw { 0 } else { size });
        let sge = LocalSge::new(&req.mr, if test == Test::ReadBw { size } else { 0 }, size)?;
        let mut wc = [EMPTY; 64];
        let (mut posted, mut done) = (0usize, 0usize);
        let mut marks = Vec::with_capacity(iters / cq_mod + 2);
        let start = Instant::now();
        while done < iters {
            while posted < iters && posted - done < depth {
                let r = match test {
                    Test::WriteBw => SendRequest::write(posted as u64, remote),
                    Test::ReadBw => SendRequest::read(posted as u64, remote),
                    Test::SendBw => SendRequest::send(posted as u64),
                    _ => SendRequest::fetch_add(posted as u64, remote, 1),
                };
                let mut r = r.sge(sge);
                if (posted + 1) % cq_mod != 0 && posted + 1 != iters {
                    r = r.unsignaled();
                }
                match req.qp.post_send(r) {
                    Ok(()) => posted += 1,
                    // The send queue holds unsignaled requests until a signaled one
                    // completes: poll and come back.
                    Err(rdmx::Error::Post(rdmx::PostError::QueueFull { .. })) => break,
                    Err(e) => return Err(e.into()),
                }
            }
            let n = poll(&req.cq, &mut wc)?;
            for c in &wc[..n] {
                done = c.wr_id as usize + 1;
                marks.push((done, Instant::now()));
            }
        }
        let total = start.elapsed();
        stop.store(true, Ordering::Release);
        rx.join().map_err(|_| "the responder thread panicked")??;
        let mib = (iters * size) as f64 / 1048576.0;
        let avg = mib / total.as_secs_f64();
        Ok(Row::Bw {
            bytes: size,
            iters,
            peak: peak(&marks, start, size).max(avg),
            avg,
            mpps: iters as f64 / total.as_secs_f64() / 1e6,
        })
    })
}

/// Best rate over any stretch of at least a tenth of the run (perftest takes the best
/// rate between completions; over short stretches that only measures timer noise).
fn peak(marks: &[(usize, Instant)], start: Instant, size: usize) -> f64 {
    let Some(&(total, end)) = marks.last() else {
        return 0.0;
    };
    let span = end.duration_since(start).max(Duration::from_nanos(1));
    let mut best: f64 = 0.0;
    let mut prev = (0usize, start);
    for &(n, t) in marks {
        let dt = t.duration_since(prev.1);
        if dt * 10 >= span && n > prev.0 {
            best = best.max((n - prev.0) as f64 * size as f64 / 1048576.0 / dt.as_secs_f64());
            prev = (n, t);
        }
    }
    let _ = total;
    best
}

fn latency(
    test: Test,
    req: &Side,
    resp: &Side,
    size: usize,
    iters: usize,
) -> Result<Vec<f64>, BoxError> {
    let warmup = (iters / 10).max(1);
    let us = match test {
        Test::WriteLat | Test::SendLat => ping_pong(test, req, resp, size, iters + warmup)?,
        _ => {
            let remote = resp.mr.remote_at(0);
            let stop = &AtomicBool::new(false);
            thread::scope(|scope| {
                let busy = req.busy;
                let h = scope.spawn(move || {
                    let mut wc = [EMPTY; 16];
                    while !stop.load(Ordering::Acquire) {
                        match resp.cq.poll(&mut wc) {
                            Ok(0) => idle(busy),
                            Ok(_) => {}
                            Err(_) => return,
                        }
                    }
                });
                let mut us = Vec::with_capacity(iters + warmup);
                let mut wc = [EMPTY; 1];
                let sge = LocalSge::new(&req.mr, size, size)?;
                for i in 0..(iters + warmup) as u64 {
                    let r = if test == Test::ReadLat {
                        SendRequest::read(i, remote)
                    } else {
                        SendRequest::fetch_add(i, remote, 1)
                    };
                    let t = Instant::now();
                    req.qp.post_send(r.sge(sge))?;
                    while poll(&req.cq, &mut wc)? == 0 {}
                    us.push(t.elapsed().as_secs_f64() * 1e6);
                }
                stop.store(true, Ordering::Release);
                h.join().map_err(|_| "the responder thread panicked")?;
                Ok::<_, BoxError>(us)
            })?
        }
    };
    Ok(us[warmup..].to_vec())
}

/// Waits a little between empty polls of a side that only needs polling to make progress
/// in busy-poll mode; otherwise leaves the cores to the progress threads.
fn idle(busy: bool) {
    if busy {
        std::hint::spin_loop();
    } else {
        thread::sleep(Duration::from_micros(100));
    }
}

/// The tag of ping-pong round `i`: never 0, so a zeroed buffer never looks done.
fn tag(i: usize) -> u8 {
    (i % 255 + 1) as u8
}

/// The last byte of the half the peer writes into.
fn last_byte(mr: &MemoryRegion, size: usize) -> Result<u8, BoxError> {
    let mut b = [0u8];
    mr.read_at(2 * size - 1, &mut b)?;
    Ok(b[0])
}

/// Ping-pong for `n` rounds; returns half of each round trip in microseconds.
fn ping_pong(test: Test, a: &Side, b: &Side, size: usize, n: usize) -> Result<Vec<f64>, BoxError> {
    if test == Test::SendLat {
        for s in [a, b] {
            s.qp.post_recv(RecvRequest::new(0).sge(LocalSge::new(&s.mr, size, size)?))?;
        }
    }
    thread::scope(|scope| {
        let echo = scope.spawn(|| -> Result<(), String> {
            let e = |e: BoxError| e.to_string();
            pong(test, b, a, size, n).map_err(e)
        });
        let mut us = Vec::with_capacity(n);
        let mut wc = [EMPTY; 4];
        let sge = LocalSge::new(&a.mr, 0, size)?;
        let inbox = LocalSge::new(&a.mr, size, size)?;
        let remote = b.mr.remote_at(size);
        for i in 0..n {
            let t = Instant::now();
            if test == Test::WriteLat {
                a.mr.write_at(size - 1, &[tag(i)])?;
                a.qp.post_send(SendRequest::write(i as u64, remote).sge(sge))?;
                let mut sent = false;
                while !sent || last_byte(&a.mr, size)? != tag(i) {
                    sent |= poll(&a.cq, &mut wc)? > 0;
                }
            } else {
                a.qp.post_send(SendRequest::send(i as u64).sge(sge))?;
                let (mut sent, mut got) = (false, false);
                while !(sent && got) {
                    let k = poll(&a.cq, &mut wc)?;
                    for c in &wc[..k] {
                        if c.opcode == WcOpcode::Recv {
                            got = true;
                            a.qp.post_recv(RecvRequest::new(0).sge(inbox))?;
                        } else {
                            sent = true;
                        }
                    }
                }
            }
            us.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
        echo.join().map_err(|_| "the echo thread panicked")??;
        Ok(us)
    })
}

/// The echoing side of [`ping_pong`]: `b` answers each round from `a`.
fn pong(test: Test, b: &Side, a: &Side, size: usize, n: usize) -> Result<(), BoxError> {
    let mut wc = [EMPTY; 4];
    let sge = LocalSge::new(&b.mr, 0, size)?;
    let inbox = LocalSge::new(&b.mr, size, size)?;
    let remote = a.mr.remote_at(size);
    let deadline = Duration::from_secs(30);
    for i in 0..n {
        let t = Instant::now();
        if test == Test::WriteLat {
            while last_byte(&b.mr, size)? != tag(i) {
                poll(&b.cq, &mut wc)?;
                if t.elapsed() > deadline {
                    return Err("the ping never arrived".into());
                }
            }
            b.mr.write_at(size - 1, &[tag(i)])?;
            b.qp.post_send(SendRequest::write(i as u64, remote).sge(sge))?;
        } else {
            loop {
                let k = poll(&b.cq, &mut wc)?;
                if wc[..k].iter().any(|c| c.opcode == WcOpcode::Recv) {
                    break;
                }
                if t.elapsed() > deadline {
                    return Err("the ping never arrived".into());
                }
            }
            b.qp.post_recv(RecvRequest::new(0).sge(inbox))?;
            b.qp.post_send(SendRequest::send(i as u64).sge(sge))?;
        }
    }
    // Reap the last answer's completion.
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(100) && poll(&b.cq, &mut wc)? == 0 {}
    Ok(())
}

/// Bytes `i * 131 + seed` (wrapping): distinct per side and per offset.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(131).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

/// Checks on the receiving side that the data (or the count of atomics) is right.
fn verify(test: Test, req: &Side, resp: &Side, size: usize, iters: usize) -> Result<(), BoxError> {
    // What landed in a side's second half.
    let read = |mr: &MemoryRegion| -> Result<Vec<u8>, BoxError> {
        let mut v = vec![0u8; size];
        mr.read_at(size, &mut v)?;
        Ok(v)
    };
    let ok = match test {
        Test::WriteBw | Test::SendBw => read(&resp.mr)? == pattern(1, size),
        Test::ReadBw | Test::ReadLat => read(&req.mr)? == pattern(2, size),
        Test::AtomicBw => resp.mr.load_u64(size)? == iters as u64,
        Test::AtomicLat => resp.mr.load_u64(0)? == (iters + (iters / 10).max(1)) as u64,
        // Every round already waited for its own tag to land.
        Test::WriteLat | Test::SendLat => true,
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "--verify: {} left wrong data on the receiving side",
            test.name()
        )
        .into())
    }
}
