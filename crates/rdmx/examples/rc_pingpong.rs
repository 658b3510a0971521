//! Ping-pong of SENDs between two processes over any provider, like rdma-core's
//! `ibv_rc_pingpong`.
//!
//! ```text
//! server:  cargo run --example rc_pingpong -- [-d tcp] [-p 18515] [-s 4096] [-n 1000]
//! client:  cargo run --example rc_pingpong -- [options] SERVER_HOST
//! ```
//!
//! `-d` names a provider (`tcp`, `verbs`, ...) or a device of one (`rxe0`, `mlx5_0`).
//! The two sides connect through [`rdmx::cm`]; each posts its first receive while its queue
//! pair is in INIT, before the peer can send, as `ibv_rc_pingpong` does. The client sends
//! first; each side checks the bytes of every message it receives. With `-p 0` the server
//! picks a free port and prints it (`listening on ...`).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use rdmx::{
    cm, Access, Completion, CompletionQueue, ConnectOptions, Context, LocalSge, MemoryRegion,
    QpAttr, QpAttrMask, QpCaps, QpState, QueuePair, RecvRequest, SendRequest, WcOpcode, WcStatus,
};

const USAGE: &str =
    "usage: rc_pingpong [-d PROVIDER_OR_DEVICE] [-p PORT] [-s SIZE] [-n ITERS] [HOST]

  -d  provider (tcp, verbs, loopback) or device name (default tcp)
  -p  TCP port of the connection setup (default 18515; 0 on the server picks one)
  -s  message size in bytes (default 4096)
  -n  number of exchanges (default 1000)
  HOST  the server to connect to; without it, this process is the server";

const TIMEOUT: Duration = Duration::from_secs(60);
/// How long one wait for a completion blocks before the deadlines are checked.
const POLL: Duration = Duration::from_millis(100);
const RECV_ID: u64 = 1;
const SEND_ID: u64 = 2;

type BoxError = Box<dyn std::error::Error>;

struct Args {
    device: String,
    port: u16,
    size: usize,
    iters: u64,
    host: Option<String>,
}

fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Args, String> {
    let mut a = Args {
        device: "tcp".into(),
        port: 18515,
        size: 4096,
        iters: 1000,
        host: None,
    };
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        let mut value = |flag: &str| it.next().ok_or_else(|| format!("{flag} needs a value"));
        match arg.as_str() {
            "-h" | "--help" => return Err(String::new()),
            "-d" | "--ib-dev" => a.device = value("-d")?,
            "-p" | "--port" => a.port = value("-p")?.parse().map_err(|e| format!("-p: {e}"))?,
            "-s" | "--size" => a.size = value("-s")?.parse().map_err(|e| format!("-s: {e}"))?,
            "-n" | "--iters" => a.iters = value("-n")?.parse().map_err(|e| format!("-n: {e}"))?,
            s if s.starts_with('-') => return Err(format!("unknown option {s}")),
            s if a.host.is_none() => a.host = Some(s.to_string()),
            s => return Err(format!("unexpected argument {s}")),
        }
    }
    if a.size == 0 || a.iters == 0 {
        return Err("-s and -n must be at least 1".into());
    }
    Ok(a)
}

/// A provider by name, or the provider that has a device of that name.
fn open(device: &str) -> Result<Context, BoxError> {
    if rdmx::provider_names().any(|p| p == device) {
        return Ok(Context::open_provider(device)?);
    }
    match rdmx::devices().into_iter().find(|d| d.name == device) {
        Some(d) => Ok(Context::open_device(d.provider, Some(device))?),
        None => Err(format!(
            "no provider or device named {device} (providers: {})",
            rdmx::provider_names().collect::<Vec<_>>().join(", ")
        )
        .into()),
    }
}

/// The bytes of message `iter` from `sender` (0 = server, 1 = client).
fn pattern(buf: &mut [u8], iter: u64, sender: u8) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i as u64)
            .wrapping_mul(131)
            .wrapping_add(iter.wrapping_mul(7))
            .wrapping_add(u64::from(sender)) as u8;
    }
}

struct Side {
    qp: QueuePair,
    cq: CompletionQueue,
    /// `[0, size)`: what arrives; `[size, 2 * size)`: what is sent.
    mr: MemoryRegion,
    size: usize,
}

impl Side {
    fn post_recv(&self) -> Result<(), BoxError> {
        let sge = LocalSge::new(&self.mr, 0, self.size)?;
        self.qp.post_recv(RecvRequest::new(RECV_ID).sge(sge))?;
        Ok(())
    }

    fn send(&self, iter: u64, me: u8, scratch: &mut [u8]) -> Result<(), BoxError> {
        pattern(scratch, iter, me);
        self.mr.write_at(self.size, scratch)?;
        let sge = LocalSge::new(&self.mr, self.size, self.size)?;
        self.qp.post_send(SendRequest::send(SEND_ID).sge(sge))?;
        Ok(())
    }

    /// Waits for the receive of message `iter` from `peer` (and reaps send completions on
    /// the way), checks its bytes and posts the next receive.
    fn receive(
        &self,
        iter: u64,
        peer: u8,
        expect: &mut [u8],
        got: &mut [u8],
        sends: &mut u64,
    ) -> Result<(), BoxError> {
        let since = Instant::now();
        loop {
            let mut wc = [Completion::default()];
            if self.cq.wait(&mut wc, POLL)? == 0 {
                if since.elapsed() > TIMEOUT {
                    return Err(format!("no message {iter} within {TIMEOUT:?}").into());
                }
                continue;
            }
            let c = wc[0];
            if c.status != WcStatus::Success {
                return Err(format!("completion {} failed: {:?}", c.wr_id, c.status).into());
            }
            match c.opcode {
                WcOpcode::Recv => {
                    if c.byte_len as usize != self.size {
                        return Err(format!("message {iter}: {} bytes", c.byte_len).into());
                    }
                    self.mr.read_at(0, got)?;
                    pattern(expect, iter, peer);
                    if got != expect {
                        return Err(format!("message {iter}: wrong bytes").into());
                    }
                    return self.post_recv();
                }
                _ => *sends += 1,
            }
        }
    }
}

fn run(a: Args) -> Result<(), BoxError> {
    let ctx = open(&a.device)?;
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(16)?;
    let qp = pd.create_qp(&cq, &cq, QpCaps::default().max_send_wr(4).max_recv_wr(4))?;
    let mr = pd.register(vec![0u8; 2 * a.size], Access::LOCAL_WRITE)?;
    let side = Side {
        qp,
        cq,
        mr,
        size: a.size,
    };
    // INIT first, so the first receive is posted before the peer can send.
    let opts = ConnectOptions::default();
    let init = QpAttr {
        qp_state: QpState::Init,
        pkey_index: 0,
        port_num: 1,
        qp_access_flags: opts.access,
        ..QpAttr::default()
    };
    side.qp.modify(
        &init,
        QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
    )?;
    side.post_recv()?;
    let qps = std::slice::from_ref(&side.qp);
    let (me, peer) = match &a.host {
        None => {
            let l = cm::Listener::bind(("0.0.0.0", a.port))?;
            println!("listening on {}", l.local_addr()?);
            l.accept(qps, &opts, &[], TIMEOUT)?;
            (0u8, 1u8)
        }
        Some(host) => {
            cm::connect((host.as_str(), a.port), qps, &opts, &[], TIMEOUT)?;
            (1, 0)
        }
    };
    let ep = side.qp.endpoint();
    println!(
        "  local address:  QPN {:#08x}, PSN {:#08x}, provider {}, device {}",
        ep.qp_num,
        ep.psn,
        ctx.provider(),
        ctx.device_name()
    );
    let a_attr = side.qp.attrs();
    println!(
        "  remote address: QPN {:#08x}, PSN {:#08x}",
        a_attr.dest_qp_num, a_attr.rq_psn
    );

    let mut scratch = vec![0u8; a.size];
    let mut expect = vec![0u8; a.size];
    let mut got = vec![0u8; a.size];
    let mut sends = 0u64;
    let start = Instant::now();
    for iter in 0..a.iters {
        if me == 1 {
            side.send(iter, me, &mut scratch)?;
            side.receive(iter, peer, &mut expect, &mut got, &mut sends)?;
        } else {
            side.receive(iter, peer, &mut expect, &mut got, &mut sends)?;
            side.send(iter, me, &mut scratch)?;
        }
    }
    // Every SEND's completion, so the last one has reached the peer before this side
    // closes.
    let since = Instant::now();
    while sends < a.iters {
        let mut wc = [Completion::default()];
        let got = side.cq.wait(&mut wc, POLL)?;
        match (got == 1).then_some(wc[0]) {
            Some(c) if c.status != WcStatus::Success => {
                return Err(format!("completion {} failed: {:?}", c.wr_id, c.status).into())
            }
            Some(_) => sends += 1,
            None if since.elapsed() > TIMEOUT => {
                return Err("the last SENDs never completed".into())
            }
            None => {}
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let bytes = a.size as u64 * a.iters * 2;
    println!(
        "{bytes} bytes in {secs:.2} seconds = {:.2} Mbit/sec",
        bytes as f64 * 8.0 / secs / 1e6
    );
    println!(
        "{} iters in {secs:.2} seconds = {:.2} usec/iter",
        a.iters,
        secs * 1e6 / a.iters as f64
    );
    Ok(())
}

fn main() -> ExitCode {
    rc_pingpong(std::env::args().skip(1))
}

/// The program, given its arguments (the tests run it this way too).
pub fn rc_pingpong(args: impl IntoIterator<Item = String>) -> ExitCode {
    let args = match parse_args(args) {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("rc_pingpong: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rc_pingpong: {e}");
            ExitCode::FAILURE
        }
    }
}
