//! Owned-buffer posts from a [`BufferPool`]: buffers move into work requests and come
//! back with their completions, so neither side can touch one while the provider owns it,
//! and received bytes are read in place, without a copy and without `unsafe`.
//!
//! ```text
//! cargo run --example pool_owned -- [-d tcp] [-s SIZE] [-n MESSAGES]
//! ```
//!
//! A sender and a receiver in this process, each with its own context (any provider;
//! default tcp) and a pool of locally accessible buffers. The receiver keeps receives
//! posted with [`QueuePair::post_recv_buf`]; the sender fills a pool buffer and posts it
//! with [`QueuePair::post_send_buf`]. On each completion [`QueuePair::take_buf`] gives the
//! buffer back: the receiver reads the message through `as_slice()` and drops the buffer,
//! which returns it to the pool for the next get. At the end both pools' statistics show
//! that the buffers were reused rather than registered again.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use rdmx::{
    Access, BufferPool, Completion, CompletionQueue, ConnectOptions, Context, PoolBuf, PoolConfig,
    QpCaps, QueuePair, SendRequest, WcStatus,
};

const USAGE: &str = "usage: pool_owned [-d PROVIDER] [-s SIZE] [-n MESSAGES]

  -d  provider (default tcp)
  -s  message size in bytes (default 4096)
  -n  messages (default 10000)";

const TIMEOUT: Duration = Duration::from_secs(60);
/// Receives kept posted, and sends in flight.
const DEPTH: u64 = 32;

type BoxError = Box<dyn std::error::Error>;

struct Args {
    provider: String,
    size: usize,
    messages: u64,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        provider: "tcp".into(),
        size: 4096,
        messages: 10_000,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |flag: &str| it.next().ok_or_else(|| format!("{flag} needs a value"));
        match arg.as_str() {
            "-h" | "--help" => return Err(String::new()),
            "-d" => a.provider = value("-d")?,
            "-s" => a.size = value("-s")?.parse().map_err(|e| format!("-s: {e}"))?,
            "-n" => a.messages = value("-n")?.parse().map_err(|e| format!("-n: {e}"))?,
            s => return Err(format!("unexpected argument {s}")),
        }
    }
    if a.size < 8 {
        return Err("-s must be at least 8".into());
    }
    Ok(a)
}

fn fill(buf: &mut [u8], n: u64) {
    buf[..8].copy_from_slice(&n.to_le_bytes());
    for (i, b) in buf[8..].iter_mut().enumerate() {
        *b = (i as u64).wrapping_mul(7).wrapping_add(n) as u8;
    }
}

struct End {
    _ctx: Context,
    cq: CompletionQueue,
    qp: QueuePair,
    pool: BufferPool,
}

fn end(provider: &str) -> Result<End, BoxError> {
    let ctx = Context::open_provider(provider)?;
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(4 * DEPTH as usize)?;
    let caps = QpCaps::default()
        .max_send_wr(DEPTH as usize)
        .max_recv_wr(DEPTH as usize);
    let qp = pd.create_qp(&cq, &cq, caps)?;
    // Local access only: no peer can name these buffers in a WRITE or READ.
    let pool = BufferPool::new(pd, PoolConfig::default().with_access(Access::LOCAL_WRITE))?;
    Ok(End {
        _ctx: ctx,
        cq,
        qp,
        pool,
    })
}

fn check(c: &Completion) -> Result<(), BoxError> {
    if c.status != WcStatus::Success {
        return Err(format!("{:?} {} completed with {:?}", c.opcode, c.wr_id, c.status).into());
    }
    Ok(())
}

fn run(a: Args) -> Result<(), BoxError> {
    let tx = end(&a.provider)?;
    let rx = end(&a.provider)?;
    let opts = ConnectOptions::default();
    let (et, er) = (tx.qp.endpoint(), rx.qp.endpoint());
    tx.qp.to_rtr(&er, &opts)?;
    rx.qp.to_rtr(&et, &opts)?;
    // Receives first: wr_id r names the buffer posted r-th.
    let post_recv = |r: u64| -> Result<(), BoxError> {
        let buf = rx.pool.get(a.size)?;
        rx.qp.post_recv_buf(r, buf).map_err(|(e, _buf)| e)?;
        Ok(())
    };
    let mut next_recv = 0;
    while next_recv < DEPTH.min(a.messages) {
        post_recv(next_recv)?;
        next_recv += 1;
    }
    tx.qp.to_rts(&er, &opts)?;
    rx.qp.to_rts(&et, &opts)?;

    let (mut sent, mut send_done, mut received) = (0u64, 0u64, 0u64);
    let mut wc = [Completion::default(); 32];
    let start = Instant::now();
    let mut last_progress = Instant::now();
    while received < a.messages || send_done < a.messages {
        // Sends, up to DEPTH in flight and never more than the receives posted.
        while sent < a.messages && sent - send_done < DEPTH && sent < next_recv {
            let mut buf = tx.pool.get(a.size)?;
            fill(
                buf.as_mut_slice().ok_or("a pool buffer without a slice")?,
                sent,
            );
            tx.qp
                .post_send_buf(SendRequest::send(sent), buf)
                .map_err(|(e, _buf)| e)?;
            sent += 1;
        }
        let n = tx.cq.poll(&mut wc)?;
        for c in &wc[..n] {
            check(c)?;
            // The send buffer comes back; dropping it returns it to the pool.
            let _done: PoolBuf = tx.qp.take_buf(c).ok_or("a send buffer did not come back")?;
            send_done += 1;
        }
        let m = rx.cq.poll(&mut wc)?;
        for c in &wc[..m] {
            check(c)?;
            let buf: PoolBuf = rx
                .qp
                .take_buf(c)
                .ok_or("a receive buffer did not come back")?;
            // Read in place: the bytes the provider put in the buffer, no copy.
            let got =
                &buf.as_slice().ok_or("a pool buffer without a slice")?[..c.byte_len as usize];
            let n = u64::from_le_bytes(got[..8].try_into()?);
            let mut want = vec![0u8; a.size];
            fill(&mut want, n);
            if n != c.wr_id || got != want.as_slice() {
                return Err(format!("receive {} holds wrong bytes", c.wr_id).into());
            }
            drop(buf);
            received += 1;
            if next_recv < a.messages {
                post_recv(next_recv)?;
                next_recv += 1;
            }
        }
        if n + m > 0 {
            last_progress = Instant::now();
        } else if last_progress.elapsed() > TIMEOUT {
            return Err(format!("stalled after {received} messages").into());
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{} messages of {} bytes on {} in {secs:.3} s ({:.0} msg/s), each read in place and checked",
        a.messages,
        a.size,
        a.provider,
        a.messages as f64 / secs
    );
    for (name, pool) in [("sender", &tx.pool), ("receiver", &rx.pool)] {
        let s = pool.stats();
        println!(
            "{name} pool: {} gets from the thread cache, {} misses, {} slab(s), {} bytes registered",
            s.hits, s.misses, s.slabs, s.bytes_registered
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("pool_owned: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pool_owned: {e}");
            ExitCode::FAILURE
        }
    }
}
