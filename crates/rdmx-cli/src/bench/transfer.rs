//! `rdmx bench transfer`: the transfer engine, modelled on Mooncake's
//! `transfer_engine_bench` and NIXL's `nixlbench`. A target registers one buffer; an
//! initiator's threads each submit batches of `--batch-size` requests of `--block-size`
//! bytes (READ or WRITE) and wait for them, for `--duration` seconds, over a sweep of
//! block and batch sizes. Both roles run in this process unless `--mode` says otherwise.
//! Reported per point: the transport and paths used, bandwidth, the average and p99
//! latency of a whole batch, and the time `submit` took (cutting and queueing; what a
//! caller pays before it can go on).
//!
//! `--verify` checks the bytes of every batch: with both roles in this process against
//! the target's buffer itself; an initiator against a target elsewhere reads each
//! WRITE's span back into a buffer of its own (and a READ reads a pattern it wrote
//! first); the time of each point then includes those checks, so its bandwidth reads
//! low (the header and the JSON say so). An initiator ends its run with a notification
//! to the target, which with `--runs N` exits after N of them.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rdmx::Access;
use rdmx_transfer::{Batch, Config, Engine, Rail, Target, Transport};

type BoxError = Box<dyn std::error::Error>;

/// Which side(s) this process runs.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Target and initiator in this process.
    Both,
    /// Register a buffer, print the control address, serve until killed.
    Target,
    /// Open `--segment` and measure.
    Initiator,
}

/// READ or WRITE.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpArg {
    /// Initiator reads from the target.
    Read,
    /// Initiator writes to the target.
    Write,
}

/// Options of `rdmx bench transfer`.
#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    /// Which role(s) this process plays.
    #[arg(long, value_enum, default_value_t = Mode::Both)]
    mode: Mode,
    /// initiator: the target's control address (HOST:PORT).
    #[arg(long, required_if_eq("mode", "initiator"))]
    segment: Option<String>,
    /// target (and both): the control listener's address.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// READ or WRITE.
    #[arg(long, value_enum, default_value_t = OpArg::Write)]
    op: OpArg,
    /// Block sizes in bytes (a sweep if several).
    #[arg(long, value_delimiter = ',', default_value = "65536")]
    block_size: Vec<u64>,
    /// Requests per batch (a sweep if several).
    #[arg(long, value_delimiter = ',', default_value = "128")]
    batch_size: Vec<usize>,
    /// Initiator threads, each with its own batches and region.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Seconds per point.
    #[arg(long, default_value_t = 3.0)]
    duration: f64,
    /// Rails of each engine: shm, loopback, tcp, tcp:ADDR:PORT, verbs[:DEVICE].
    #[arg(long, value_delimiter = ',', default_value = "shm,tcp:127.0.0.1:0")]
    rails: Vec<String>,
    /// Force a transport (default: chosen per peer and shown).
    #[arg(long)]
    transport: Option<String>,
    /// Queue pairs per rail.
    #[arg(long, default_value_t = 2)]
    qps_per_rail: usize,
    /// Slice size in bytes (default: the transport's, 64 KiB on tcp and verbs, 1 MiB on
    /// shm; shown in the header).
    #[arg(long)]
    slice_size: Option<usize>,
    /// target: bytes to register (default: what the sweep needs, at least 256 MiB).
    #[arg(long)]
    buffer_size: Option<u64>,
    /// Check the bytes of every batch (slower): against the target's buffer when it is
    /// in this process, else by reading them back.
    #[arg(long)]
    verify: bool,
    /// Every request uses the same block of the local and the target's buffer, as
    /// perftest's bandwidth tests (and `rdmx bench write_bw`) reuse one buffer: the bytes
    /// stay in the caches. Without it each request of a batch, and each thread, has its
    /// own block (`--block-size` x `--batch-size` x `--threads` bytes on each side).
    #[arg(long, conflicts_with = "verify")]
    reuse_block: bool,
    /// target: exit after this many initiators' runs (their closing notifications).
    #[arg(long, value_name = "N")]
    runs: Option<u64>,
    /// One JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Draw bandwidth against block size into an SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
}

#[derive(serde::Serialize)]
struct Point {
    op: &'static str,
    transport: String,
    paths: usize,
    slice_size: usize,
    block_size: u64,
    batch_size: usize,
    threads: usize,
    batches: u64,
    bytes: u64,
    bw_gb_s: f64,
    bw_mib_s: f64,
    lat_avg_us: f64,
    lat_p99_us: f64,
    submit_avg_us: f64,
    submit_p50_us: f64,
}

fn config(a: &Args) -> Result<Config, BoxError> {
    let rails = a
        .rails
        .iter()
        .map(|r| Rail::parse(r).ok_or_else(|| format!("--rails: cannot parse {r:?}")))
        .collect::<Result<Vec<_>, _>>()?;
    let transport = match &a.transport {
        None => None,
        Some(t) => Some(Transport::parse(t).ok_or_else(|| format!("--transport {t:?}"))?),
    };
    let mut c = Config::default()
        .rails(rails)
        .listen(a.listen.parse()?)
        .transport(transport)
        .qps_per_rail(a.qps_per_rail);
    c.slice_size = a.slice_size;
    Ok(c)
}

/// Bytes each initiator thread's requests span.
fn per_thread(a: &Args) -> u64 {
    let block = a.block_size.iter().max().copied().unwrap_or(0);
    if a.reuse_block {
        block
    } else {
        block * a.batch_size.iter().max().copied().unwrap_or(0) as u64
    }
}

/// Bytes of the target's buffer the run touches.
fn needed(a: &Args) -> u64 {
    per_thread(a) * if a.reuse_block { 1 } else { a.threads as u64 }
}

/// Runs the benchmark.
pub(crate) fn run(a: Args) -> Result<(), BoxError> {
    if a.threads == 0 || a.block_size.contains(&0) || a.batch_size.contains(&0) {
        return Err("--threads, --block-size and --batch-size must be above 0".into());
    }
    let size = a.buffer_size.unwrap_or_else(|| needed(&a).max(256 << 20));
    match a.mode {
        Mode::Target => {
            let t = Engine::new("bench-target", config(&a)?)?;
            t.register(
                "bench",
                size as usize,
                Access::REMOTE_READ | Access::REMOTE_WRITE,
            )?;
            println!("target listening on {}", t.control_addr());
            let mut runs = 0;
            loop {
                if let Some(n) = t.recv_notification(Duration::from_secs(3600)) {
                    println!(
                        "target: notification from {}: {}",
                        n.from,
                        String::from_utf8_lossy(&n.data)
                    );
                    runs += 1;
                    if a.runs.is_some_and(|n| runs >= n) {
                        return Ok(());
                    }
                }
            }
        }
        Mode::Initiator => {
            let seg = a.segment.clone().expect("required by clap");
            measure(&a, &seg, None)
        }
        Mode::Both => {
            let t = Engine::new("bench-target", config(&a)?)?;
            let region = t.register(
                "bench",
                size as usize,
                Access::REMOTE_READ | Access::REMOTE_WRITE,
            )?;
            measure(&a, &t.control_addr().to_string(), Some(region))
        }
    }
}

fn measure(
    a: &Args,
    peer: &str,
    target_buf: Option<rdmx_transfer::LocalBuf>,
) -> Result<(), BoxError> {
    let mut cfg = config(a)?;
    cfg.listen = "127.0.0.1:0".parse()?;
    let slice_for = cfg.clone();
    let e = Arc::new(Engine::new(
        &format!("bench-initiator-{}", std::process::id()),
        cfg,
    )?);
    let seg = e.open_segment(peer)?;
    let remote_len = seg
        .desc()
        .buffers
        .iter()
        .find(|b| b.name == "bench")
        .map(|b| b.len)
        .ok_or("the target has no buffer \"bench\"")?;
    if remote_len < needed(a) {
        return Err(format!(
            "the target's buffer ({remote_len} bytes) is smaller than the sweep needs ({})",
            needed(a)
        )
        .into());
    }
    let per_thread = per_thread(a);
    let locals = (0..a.threads)
        .map(|i| e.register(&format!("src{i}"), per_thread as usize, Access::LOCAL_WRITE))
        .collect::<Result<Vec<_>, _>>()?;
    // --verify against a target elsewhere: each thread reads back into a buffer of its own.
    let checks = if a.verify && target_buf.is_none() {
        (0..a.threads)
            .map(|i| {
                e.register(
                    &format!("check{i}"),
                    per_thread as usize,
                    Access::LOCAL_WRITE,
                )
                .map(Some)
            })
            .collect::<Result<Vec<_>, _>>()?
    } else {
        vec![None; a.threads]
    };
    let paths = seg.paths().len();
    let transport = seg.transport().to_string();
    let slice = slice_for.slice_size_for(seg.transport());
    if !a.json {
        println!(
            "rdmx bench transfer: {} over {transport} ({paths} paths: {}), slices of {} KiB, \
             {} thread(s){}, {:.1} s per point",
            match a.op {
                OpArg::Read => "READ",
                OpArg::Write => "WRITE",
            },
            seg.paths()
                .iter()
                .map(|p| p.name.split(" qp").next().unwrap_or("").to_string())
                .collect::<Vec<_>>()
                .join(", "),
            slice >> 10,
            a.threads,
            if a.reuse_block {
                ", every request on one block (--reuse-block)"
            } else {
                ""
            },
            a.duration
        );
        if a.verify {
            println!(
                "--verify: each point's time includes its checks (fills, reads back), so its \
                 bandwidth reads low; measure without --verify"
            );
        }
        println!(
            "{:>10} {:>6} {:>10} {:>10} {:>12} {:>12} {:>12} {:>12}",
            "block", "batch", "GB/s", "MiB/s", "lat avg us", "lat p99 us", "submit us", "batches"
        );
    }
    let mut points = Vec::new();
    for &block in &a.block_size {
        for &batch in &a.batch_size {
            let p = point(
                a,
                &e,
                &seg,
                &locals,
                &checks,
                target_buf.as_ref(),
                block,
                batch,
                &transport,
                (paths, slice),
            )?;
            if !a.json {
                println!(
                    "{:>10} {:>6} {:>10.3} {:>10.1} {:>12.1} {:>12.1} {:>12.1} {:>12}",
                    p.block_size,
                    p.batch_size,
                    p.bw_gb_s,
                    p.bw_mib_s,
                    p.lat_avg_us,
                    p.lat_p99_us,
                    p.submit_avg_us,
                    p.batches
                );
            }
            points.push(p);
        }
    }
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "test": "transfer",
                // With --verify, the bandwidths' time includes the checks.
                "time_includes_checks": a.verify,
                "results": points,
            })
        );
    }
    if let Some(path) = &a.plot {
        plot(path, &points)?;
    }
    if target_buf.is_none() {
        // Tell the target the run is over (with --runs it counts them).
        let bytes: u64 = points.iter().map(|p| p.bytes).sum();
        let msg = format!("rdmx bench transfer: done, {bytes} bytes");
        let st = e
            .notify(&seg, msg.as_bytes())?
            .wait(Duration::from_secs(30))?;
        if !st.is_success() {
            return Err(format!("the closing notification failed: {st:?}").into());
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn point(
    a: &Args,
    e: &Arc<Engine>,
    seg: &rdmx_transfer::Segment,
    locals: &[rdmx_transfer::LocalBuf],
    checks: &[Option<rdmx_transfer::LocalBuf>],
    target_buf: Option<&rdmx_transfer::LocalBuf>,
    block: u64,
    batch: usize,
    transport: &str,
    (paths, slice_size): (usize, usize),
) -> Result<Point, BoxError> {
    let span = block * batch as u64;
    let started = Instant::now();
    let stop_at = started + Duration::from_secs_f64(a.duration);
    let results = std::thread::scope(|s| {
        let hs: Vec<_> = locals
            .iter()
            .zip(checks)
            .enumerate()
            .map(|(t, (local, check))| {
                let base = if a.reuse_block { 0 } else { t as u64 * span };
                let check = check.as_ref();
                s.spawn(
                    move || -> Result<(Histogram<u64>, Histogram<u64>, u64), String> {
                        let mut lat = Histogram::<u64>::new(3).expect("histogram");
                        let mut sub = Histogram::<u64>::new(3).expect("histogram");
                        let mut n = 0u64;
                        let mut round = 0u8;
                        let (thread, span_len) = (t as u8, span as usize);
                        let batch_of = |op: OpArg, buf: &rdmx_transfer::LocalBuf| {
                            let mut b = Batch::with_capacity(batch);
                            for i in 0..batch as u64 {
                                let off = if a.reuse_block { 0 } else { i * block };
                                let to = Target::Buffer("bench", base + off);
                                match op {
                                    OpArg::Write => b.write((buf, off), seg, to, block),
                                    OpArg::Read => b.read((buf, off), seg, to, block),
                                }
                                .map_err(|e| e.to_string())?;
                            }
                            Ok::<_, String>(b)
                        };
                        let finish = |h: &rdmx_transfer::BatchHandle| {
                            let st = h.wait(Duration::from_secs(60)).map_err(|e| e.to_string())?;
                            if st.is_success() {
                                return Ok(());
                            }
                            let first = (0..h.len()).find_map(|i| match h.status(i) {
                                Some(rdmx_transfer::RequestStatus::Failed(f)) => {
                                    Some(f.to_string())
                                }
                                _ => None,
                            });
                            Err(format!(
                                "a batch failed: {st:?}: {}",
                                first.unwrap_or_default()
                            ))
                        };
                        let run = |b: Batch| finish(&e.submit(b));
                        if a.verify && a.op == OpArg::Read && check.is_some() {
                            // What the READs must bring: a pattern written first.
                            local
                                .write(0, &pattern(span_len, thread, 0))
                                .map_err(|e| e.to_string())?;
                            run(batch_of(OpArg::Write, local)?)?;
                        }
                        // At least one batch per point, however short the duration.
                        while n == 0 || Instant::now() < stop_at {
                            round = round.wrapping_add(1);
                            if a.verify {
                                // WRITE: this round's pattern; READ: poison, so that
                                // bytes a READ did not bring are seen.
                                let fill = match a.op {
                                    OpArg::Write => pattern(span_len, thread, round),
                                    OpArg::Read => vec![0xee; span_len],
                                };
                                local.write(0, &fill).map_err(|e| e.to_string())?;
                            }
                            let b = batch_of(a.op, local)?;
                            let t0 = Instant::now();
                            let h = e.submit(b);
                            let t1 = Instant::now();
                            finish(&h)?;
                            let t2 = Instant::now();
                            let _ = sub.record((t1 - t0).as_nanos() as u64);
                            let _ = lat.record((t2 - t0).as_nanos() as u64);
                            n += 1;
                            if !a.verify {
                                continue;
                            }
                            let want = match (a.op, target_buf) {
                                (OpArg::Write, _) => pattern(span_len, thread, round),
                                (OpArg::Read, Some(tb)) => {
                                    let mut w = vec![0u8; span_len];
                                    tb.read(base, &mut w).map_err(|e| e.to_string())?;
                                    w
                                }
                                (OpArg::Read, None) => pattern(span_len, thread, 0),
                            };
                            let mut got = vec![0u8; span_len];
                            match (a.op, target_buf, check) {
                                // In this process: the target's bytes themselves.
                                (OpArg::Write, Some(tb), _) => tb.read(base, &mut got),
                                // Elsewhere: read back what was written.
                                (OpArg::Write, None, Some(c)) => {
                                    c.write(0, &vec![0xee; span_len])
                                        .map_err(|e| e.to_string())?;
                                    run(batch_of(OpArg::Read, c)?)?;
                                    c.read(0, &mut got)
                                }
                                _ => local.read(0, &mut got),
                            }
                            .map_err(|e| e.to_string())?;
                            if let Some(at) = got.iter().zip(&want).position(|(g, w)| g != w) {
                                return Err(format!(
                                    "--verify: thread {t}, batch {n}: byte {at} of the span \
                                     differs (got {:#04x}, want {:#04x})",
                                    got[at], want[at]
                                ));
                            }
                        }
                        Ok((lat, sub, n))
                    },
                )
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("bench thread"))
            .collect::<Vec<_>>()
    });
    let mut lat = Histogram::<u64>::new(3)?;
    let mut sub = Histogram::<u64>::new(3)?;
    let mut batches = 0;
    for r in results {
        let (l, s, n) = r?;
        lat.add(l)?;
        sub.add(s)?;
        batches += n;
    }
    let bytes = batches * span;
    // From the start to the last batch's end (which may come after --duration).
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    Ok(Point {
        op: match a.op {
            OpArg::Read => "read",
            OpArg::Write => "write",
        },
        transport: transport.to_string(),
        paths,
        slice_size,
        block_size: block,
        batch_size: batch,
        threads: a.threads,
        batches,
        bytes,
        bw_gb_s: bytes as f64 / secs / 1e9,
        bw_mib_s: bytes as f64 / secs / 1048576.0,
        lat_avg_us: lat.mean() / 1e3,
        lat_p99_us: lat.value_at_quantile(0.99) as f64 / 1e3,
        submit_avg_us: sub.mean() / 1e3,
        submit_p50_us: sub.value_at_quantile(0.5) as f64 / 1e3,
    })
}

/// The bytes of a `--verify` span: each 8-byte word its index, with the thread and the
/// round in its top bytes (a misplaced or stale slice shows).
fn pattern(len: usize, thread: u8, round: u8) -> Vec<u8> {
    let tag = (u64::from(round) << 56) | (u64::from(thread) << 48);
    let mut v = vec![0u8; len];
    for (i, w) in v.chunks_mut(8).enumerate() {
        let x = (tag ^ i as u64).to_le_bytes();
        w.copy_from_slice(&x[..w.len()]);
    }
    v
}

fn plot(path: &std::path::Path, points: &[Point]) -> Result<(), BoxError> {
    use plotters::prelude::*;
    let pts: Vec<(f64, f64)> = points
        .iter()
        .map(|p| (p.block_size as f64, p.bw_gb_s))
        .collect();
    let (x0, x1) = pts
        .iter()
        .fold((f64::MAX, 0f64), |(a, b), &(x, _)| (a.min(x), b.max(x)));
    let y1 = pts.iter().fold(0f64, |a, &(_, y)| a.max(y)) * 1.1;
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("rdmx bench transfer", ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((x0..x1.max(x0 * 2.0)).log_scale(), 0f64..y1.max(1e-3))?;
    chart
        .configure_mesh()
        .x_desc("block size [bytes]")
        .y_desc("bandwidth [GB/s]")
        .draw()?;
    chart.draw_series(LineSeries::new(pts.iter().copied(), &BLUE))?;
    chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, BLUE.filled())))?;
    root.present()?;
    Ok(())
}
