//! A one-sided copy loop on the async API (`rdmx::tokio`): side A copies a region of side
//! B into another region of B with RDMA READs and WRITEs, many chunks in flight, without
//! B's application taking part; then checks the copy.
//!
//! ```text
//! cargo run --features tokio --example async_copy -- [-d tcp] [-m 64] [-c 65536] [-j 16]
//! ```
//!
//! `-d` names the provider (both sides run in this process, each with its own context),
//! `-m` the size of the region in MiB, `-c` the chunk size, `-j` how many chunks are in
//! flight (one task each, on a current-thread runtime; a chunk is READ into a pool buffer,
//! then the same buffer is WRITTEN to the destination).

use std::time::Instant;

use rdmx::tokio::{AsyncCq, AsyncQp};
use rdmx::{Access, BufferPool, ConnectOptions, Context, PoolConfig, QpCaps, RemoteAddr};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn arg(name: &str, default: usize) -> Result<usize, BoxError> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        Some(i) => Ok(args.get(i + 1).ok_or("a value is missing")?.parse()?),
        None => Ok(default),
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().collect();
    let provider = match args.iter().position(|a| a == "-d") {
        Some(i) => args.get(i + 1).ok_or("-d needs a provider")?.clone(),
        None => "tcp".to_string(),
    };
    let (len, chunk, jobs) = (
        arg("-m", 64)? << 20,
        arg("-c", 65536)?,
        arg("-j", 16)?.max(1),
    );
    if chunk == 0 || chunk > (4 << 20) {
        return Err("the chunk size must be 1 B to 4 MiB".into());
    }

    // B: two regions, the source filled with a pattern; B's application does nothing else.
    let cb = Context::open_provider(&provider)?;
    let pb = cb.alloc_pd();
    let src = pb.register(vec![0u8; len], Access::ALL)?;
    let dst = pb.register(vec![0u8; len], Access::ALL)?;
    let pattern: Vec<u8> = (0..len)
        .map(|i| (i % 251) as u8 ^ (i >> 20) as u8)
        .collect();
    src.write_at(0, &pattern)?;
    // A: the queue pair that does the copying.
    let ca = Context::open_provider(&provider)?;
    let pa = ca.alloc_pd();
    let caps = QpCaps::default().max_send_wr(jobs).max_recv_wr(1);
    let cq_a = AsyncCq::new(ca.create_cq(jobs + 1)?)?;
    let cq_b = AsyncCq::new(cb.create_cq(jobs + 1)?)?;
    let a = pa.create_qp(cq_a.cq(), cq_a.cq(), caps)?;
    let b = pb.create_qp(cq_b.cq(), cq_b.cq(), caps)?;
    let (ea, eb) = (a.endpoint(), b.endpoint());
    let opts = ConnectOptions::default();
    std::thread::scope(|s| -> Result<(), BoxError> {
        let t = s.spawn(|| a.connect(eb, &opts));
        b.connect(ea, &opts)?;
        t.join().map_err(|_| "connect panicked")??;
        Ok(())
    })?;
    let a = AsyncQp::new(a, &cq_a, &cq_a)?;
    let _b = AsyncQp::new(b, &cq_b, &cq_b)?;
    let pool = BufferPool::new(pa, PoolConfig::default())?;

    let (from, to) = (src.remote_at(0), dst.remote_at(0));
    let chunks = len.div_ceil(chunk);
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for j in 0..jobs {
        let (a, pool) = (a.clone(), pool.clone());
        tasks.spawn(async move {
            let mut buf = pool.get(chunk)?;
            for i in (j..chunks).step_by(jobs) {
                let off = (i * chunk) as u64;
                let n = chunk.min(len - i * chunk);
                buf.set_len(n)?;
                let at = |r: RemoteAddr| RemoteAddr {
                    addr: r.addr + off,
                    rkey: r.rkey,
                };
                let (got, _) = a.read(buf, at(from)).await?;
                let (back, _) = a.write(got, at(to)).await?;
                buf = back;
            }
            Ok::<(), BoxError>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    let took = start.elapsed();
    let mut copy = vec![0u8; len];
    dst.read_at(0, &mut copy)?;
    if copy != pattern {
        return Err("the copy differs from the source".into());
    }
    println!(
        "copied {} MiB in {chunks} chunks of {chunk} B, {jobs} in flight, on {provider}: \
         {:.3} s, {:.2} GB/s (read + write), checked",
        len >> 20,
        took.as_secs_f64(),
        2.0 * len as f64 / took.as_secs_f64().max(1e-9) / 1e9
    );
    Ok(())
}
