//! One-sided streaming with RDMA WRITE_WITH_IMM: a writer puts chunks into a ring in the
//! reader's registered memory, and the reader learns of each chunk only from the receive
//! completion the immediate data consumes.
//!
//! ```text
//! cargo run --release --example write_stream -- [-d tcp] [-s CHUNK] [-n CHUNKS] [-r SLOTS]
//! ```
//!
//! Both ends live in this process, each with its own context (any provider; default tcp),
//! connected to each other. The writer's chunk `i` goes to ring slot `i % SLOTS` with `i`
//! as its immediate; the reader checks the slot's bytes, reposts the receive, and every
//! quarter ring hands credits back with a SEND_WITH_IMM carrying how many chunks it has
//! consumed, so the writer never overwrites a slot the reader has not read.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use rdmx::{
    Access, Completion, CompletionQueue, ConnectOptions, Context, LocalSge, MemoryRegion, QpCaps,
    QueuePair, RecvRequest, SendRequest, WcOpcode, WcStatus,
};

const USAGE: &str = "usage: write_stream [-d PROVIDER] [-s CHUNK_BYTES] [-n CHUNKS] [-r SLOTS]

  -d  provider (default tcp)
  -s  bytes per chunk (default 65536)
  -n  chunks to stream (default 4096)
  -r  slots in the reader's ring (default 16)";

const TIMEOUT: Duration = Duration::from_secs(60);
/// Receives the writer keeps posted for credit messages.
const CREDIT_RX: usize = 8;

type BoxError = Box<dyn std::error::Error>;

struct Args {
    provider: String,
    chunk: usize,
    chunks: u64,
    slots: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        provider: "tcp".into(),
        chunk: 65536,
        chunks: 4096,
        slots: 16,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |flag: &str| it.next().ok_or_else(|| format!("{flag} needs a value"));
        match arg.as_str() {
            "-h" | "--help" => return Err(String::new()),
            "-d" => a.provider = value("-d")?,
            "-s" => a.chunk = value("-s")?.parse().map_err(|e| format!("-s: {e}"))?,
            "-n" => a.chunks = value("-n")?.parse().map_err(|e| format!("-n: {e}"))?,
            "-r" => a.slots = value("-r")?.parse().map_err(|e| format!("-r: {e}"))?,
            s => return Err(format!("unexpected argument {s}")),
        }
    }
    if a.chunk < 8 || a.chunks == 0 || a.slots < 4 {
        return Err("-s must be at least 8, -n at least 1, -r at least 4".into());
    }
    Ok(a)
}

/// Chunk `index`'s bytes: its index, then a pattern of it.
fn fill(buf: &mut [u8], index: u64) {
    buf[..8].copy_from_slice(&index.to_le_bytes());
    for (i, b) in buf[8..].iter_mut().enumerate() {
        *b = (i as u64).wrapping_mul(31).wrapping_add(index) as u8;
    }
}

struct End {
    _ctx: Context,
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
}

fn end(provider: &str, bytes: usize, access: Access, depth: usize) -> Result<End, BoxError> {
    let ctx = Context::open_provider(provider)?;
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(4 * depth)?;
    let caps = QpCaps::default().max_send_wr(depth).max_recv_wr(depth);
    let qp = pd.create_qp(&cq, &cq, caps)?;
    let mr = pd.register(vec![0u8; bytes], access)?;
    Ok(End {
        _ctx: ctx,
        cq,
        qp,
        mr,
    })
}

fn check(c: &Completion) -> Result<(), BoxError> {
    if c.status != WcStatus::Success {
        return Err(format!("{:?} {} completed with {:?}", c.opcode, c.wr_id, c.status).into());
    }
    Ok(())
}

fn run(a: Args) -> Result<(), BoxError> {
    let ring = a.chunk * a.slots;
    let depth = a.slots + CREDIT_RX + 4;
    // The writer's memory: a source slot per ring slot. The reader's: the ring.
    let writer = end(&a.provider, ring, Access::LOCAL_WRITE, depth)?;
    let reader = end(
        &a.provider,
        ring,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        depth,
    )?;
    let opts = ConnectOptions::default();
    let (ew, er) = (writer.qp.endpoint(), reader.qp.endpoint());
    // Each side moves to RTR and posts its receives before either can send.
    writer.qp.to_rtr(&er, &opts)?;
    reader.qp.to_rtr(&ew, &opts)?;
    for i in 0..a.slots as u64 {
        // A WRITE_WITH_IMM's receive needs no memory: the data went to the ring.
        reader.qp.post_recv(RecvRequest::new(i))?;
    }
    for i in 0..CREDIT_RX as u64 {
        writer.qp.post_recv(RecvRequest::new(i))?;
    }
    writer.qp.to_rts(&er, &opts)?;
    reader.qp.to_rts(&ew, &opts)?;
    let ring_at = reader.mr.remote();
    let credit_every = (a.slots / 4).max(1) as u64;

    let (mut posted, mut written, mut consumed, mut acked) = (0u64, 0u64, 0u64, 0u64);
    let mut chunk = vec![0u8; a.chunk];
    let mut want = vec![0u8; a.chunk];
    let mut wc = [Completion::default(); 32];
    let start = Instant::now();
    let mut last_progress = Instant::now();
    while consumed < a.chunks || written < a.chunks {
        // Writer: a chunk into every slot the reader has handed back.
        while posted < a.chunks && posted - acked < a.slots as u64 {
            let slot = (posted % a.slots as u64) as usize;
            let off = slot * a.chunk;
            fill(&mut chunk, posted);
            writer.mr.write_at(off, &chunk)?;
            let req = SendRequest::write_with_imm(posted, ring_at.at(off as u64), posted as u32)
                .sge(LocalSge::new(&writer.mr, off, a.chunk)?);
            writer.qp.post_send(req)?;
            posted += 1;
        }
        // Reader: each receive completion names a chunk.
        let n = reader.cq.poll(&mut wc)?;
        for c in &wc[..n] {
            check(c)?;
            if c.opcode != WcOpcode::RecvRdmaWithImm {
                continue; // a credit SEND's completion
            }
            let index = u64::from(c.imm_data.ok_or("a WRITE_WITH_IMM without immediate")?);
            if index != consumed & 0xffff_ffff {
                return Err(format!("chunk {index} arrived, {consumed} was next").into());
            }
            let slot = (consumed % a.slots as u64) as usize;
            reader.mr.read_at(slot * a.chunk, &mut chunk)?;
            fill(&mut want, consumed);
            if chunk != want {
                return Err(format!("chunk {consumed} has wrong bytes").into());
            }
            reader.qp.post_recv(RecvRequest::new(c.wr_id))?;
            consumed += 1;
            if consumed % credit_every == 0 || consumed == a.chunks {
                let credit = SendRequest::send_with_imm(consumed, consumed as u32);
                reader.qp.post_send(credit)?;
            }
        }
        // Writer: WRITE completions and credits.
        let m = writer.cq.poll(&mut wc)?;
        for c in &wc[..m] {
            check(c)?;
            match c.opcode {
                WcOpcode::RdmaWrite => written += 1,
                WcOpcode::Recv => {
                    let total = u64::from(c.imm_data.ok_or("a credit without immediate")?);
                    // The count travels modulo 2^32; it only grows.
                    acked += total.wrapping_sub(acked) & 0xffff_ffff;
                    writer.qp.post_recv(RecvRequest::new(c.wr_id))?;
                }
                _ => {}
            }
        }
        if n + m > 0 {
            last_progress = Instant::now();
        } else if last_progress.elapsed() > TIMEOUT {
            return Err(format!("stalled after {consumed} chunks").into());
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let bytes = a.chunk as u64 * a.chunks;
    println!(
        "{} chunks of {} bytes through a {}-slot ring on {}: {bytes} bytes in {secs:.3} s = {:.2} Gbit/s, all checked",
        a.chunks,
        a.chunk,
        a.slots,
        a.provider,
        bytes as f64 * 8.0 / secs / 1e9
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("write_stream: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("write_stream: {e}");
            ExitCode::FAILURE
        }
    }
}
