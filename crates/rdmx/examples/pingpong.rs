//! A ping-pong that speaks the exchange of rdma-core's `ibv_rc_pingpong`,
//! `ibv_uc_pingpong` and `ibv_ud_pingpong`, so an rdmx program and the stock tools run
//! against each other, in either role.
//!
//! ```text
//! server:  cargo run --example pingpong -- [-d DEVICE] [-g GID_INDEX] [options]
//! client:  cargo run --example pingpong -- [-d DEVICE] [-g GID_INDEX] [options] SERVER_HOST
//! stock:   ibv_rc_pingpong -d rxe0 -g 1 [SERVER_HOST]   (-c uc: ibv_uc_pingpong, -c ud:
//!          ibv_ud_pingpong)
//! ```
//!
//! The exchange (TCP, port 18515 by default): the client connects and writes its
//! address, one 52-byte message `LID:QPN:PSN:GID` (`%04x:%06x:%06x:` and the 16 GID bytes
//! as 32 hex digits, NUL-terminated); the server reads it, connects its queue pair, and
//! writes its own; the client reads that, writes `done` (with its NUL) and connects. Both
//! post their receives before the peer can send; the client sends first, and each side
//! sends `-n` messages of `-s` bytes and receives as many, the next send going out once
//! the previous send and receive have completed, as the stock tool does.
//!
//! `-d` names a device (`rxe0`, `mlx5_0`) or a provider whose queue pairs have a GID;
//! `-g` picks the GID index on verbs (the IPv4-mapped one for RoCE across hosts).
//! `-c rc|uc|ud` is the transport. UD, as `ibv_ud_pingpong`: the queue pair is activated
//! with Q_Key 0x11111111, sends go through an address handle of the peer's GID, messages
//! are at most the path MTU, and each receive buffer starts with the 40-byte GRH area.
//! rdmx data are checked when both sides are rdmx (`--check`).

use std::io::{Read, Write};
use std::net::{Ipv6Addr, TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use rdmx::{
    Access, AddressHandle, AhAttr, Completion, CompletionQueue, ConnectOptions, Context, LocalSge,
    MemoryRegion, Mtu, PeerAddr, QpAttr, QpAttrMask, QpCaps, QpEndpoint, QpState, QpType,
    QueuePair, RecvRequest, SendRequest, WcOpcode, WcStatus,
};

const USAGE: &str = "usage: pingpong [OPTIONS] [HOST]

  -d, --ib-dev DEV     device (rxe0, ...) or provider (default: the first verbs device)
  -g, --gid-idx N      GID index on verbs (default: the provider's choice)
  -c, --connection T   transport: rc (default), uc or ud
  -p, --port N         TCP port of the exchange (default 18515)
  -s, --size N         message size in bytes (default 4096; ud: 1024)
  -n, --iters N        messages each way (default 1000)
  -r, --rx-depth N     receives kept posted (default 500)
  -m, --mtu N          path MTU: 256, 512, 1024, 2048 or 4096 (default 1024)
      --check          check the bytes of every message (both sides rdmx)
  HOST                 the server; without it, this process is the server";

const TIMEOUT: Duration = Duration::from_secs(60);
const POLL: Duration = Duration::from_millis(100);
const RECV_ID: u64 = 1;
const SEND_ID: u64 = 2;
/// `sizeof "0000:000000:000000:00000000000000000000000000000000"`.
const MSG_LEN: usize = 52;
/// The Q_Key `ibv_ud_pingpong` uses.
const QKEY: u32 = 0x1111_1111;
/// The GRH area at the start of every UD receive buffer.
const GRH: usize = 40;

type BoxError = Box<dyn std::error::Error>;

/// The transport service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Conn {
    Rc,
    Uc,
    Ud,
}

impl Conn {
    fn qp_type(self) -> QpType {
        match self {
            Conn::Rc => QpType::Rc,
            Conn::Uc => QpType::Uc,
            Conn::Ud => QpType::Ud,
        }
    }
}

struct Args {
    device: Option<String>,
    gid_index: Option<u32>,
    conn: Conn,
    port: u16,
    size: Option<usize>,
    iters: u64,
    rx_depth: usize,
    mtu: Mtu,
    check: bool,
    host: Option<String>,
}

fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Args, String> {
    let mut a = Args {
        device: None,
        gid_index: None,
        conn: Conn::Rc,
        port: 18515,
        size: None,
        iters: 1000,
        rx_depth: 500,
        mtu: Mtu::Mtu1024,
        check: false,
        host: None,
    };
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        let mut value = |flag: &str| it.next().ok_or_else(|| format!("{flag} needs a value"));
        fn num<T: std::str::FromStr>(flag: &str, v: String) -> Result<T, String>
        where
            T::Err: std::fmt::Display,
        {
            v.parse().map_err(|e| format!("{flag}: {e}"))
        }
        match arg.as_str() {
            "-h" | "--help" => return Err(String::new()),
            "-d" | "--ib-dev" => a.device = Some(value("-d")?),
            "-g" | "--gid-idx" => a.gid_index = Some(num("-g", value("-g")?)?),
            "-c" | "--connection" => {
                a.conn = match value("-c")?.to_ascii_lowercase().as_str() {
                    "rc" => Conn::Rc,
                    "uc" => Conn::Uc,
                    "ud" => Conn::Ud,
                    other => return Err(format!("-c: unknown transport {other} (rc, uc, ud)")),
                }
            }
            "-p" | "--port" => a.port = num("-p", value("-p")?)?,
            "-s" | "--size" => a.size = Some(num("-s", value("-s")?)?),
            "-n" | "--iters" => a.iters = num("-n", value("-n")?)?,
            "-r" | "--rx-depth" => a.rx_depth = num("-r", value("-r")?)?,
            "-m" | "--mtu" => {
                let m: u32 = num("-m", value("-m")?)?;
                a.mtu = match m {
                    256 | 512 | 1024 | 2048 | 4096 => Mtu::from_bytes(m).expect("an IB MTU"),
                    _ => return Err(format!("-m: {m} is not an InfiniBand MTU")),
                };
            }
            "--check" => a.check = true,
            s if s.starts_with('-') => return Err(format!("unknown option {s}")),
            s if a.host.is_none() => a.host = Some(s.to_string()),
            s => return Err(format!("unexpected argument {s}")),
        }
    }
    if a.size == Some(0) || a.iters == 0 || a.rx_depth == 0 {
        return Err("-s, -n and -r must be at least 1".into());
    }
    Ok(a)
}

/// A context on the device (or provider) named, or on the first verbs device.
fn open(a: &Args) -> Result<Context, BoxError> {
    let verbs = |dev: Option<&str>| {
        let mut o = rdmx::verbs::Options::default();
        if let Some(d) = dev {
            o = o.device(d);
        }
        if let Some(g) = a.gid_index {
            o = o.gid_index(g);
        }
        Context::open(o)
    };
    match a.device.as_deref() {
        None => Ok(verbs(None)?),
        Some(d) if rdmx::provider_names().any(|p| p == d) && d != "verbs" => {
            Ok(Context::open_provider(d)?)
        }
        Some("verbs") => Ok(verbs(None)?),
        Some(d) => match rdmx::devices().into_iter().find(|x| x.name == d) {
            Some(x) if x.provider == "verbs" => Ok(verbs(Some(d))?),
            Some(x) => Ok(Context::open_device(x.provider, Some(d))?),
            None => Err(format!("no device or provider named {d}").into()),
        },
    }
}

/// One side's address as the pingpong examples write it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Dest {
    lid: u16,
    qpn: u32,
    psn: u32,
    gid: [u8; 16],
}

impl Dest {
    fn to_msg(self) -> [u8; MSG_LEN] {
        let mut hex = String::with_capacity(32);
        for b in self.gid {
            hex.push_str(&format!("{b:02x}"));
        }
        let text = format!("{:04x}:{:06x}:{:06x}:{hex}", self.lid, self.qpn, self.psn);
        let mut out = [0u8; MSG_LEN];
        out[..text.len()].copy_from_slice(text.as_bytes());
        out
    }

    /// Parses a peer's message; anything malformed is an error.
    fn from_msg(msg: &[u8]) -> Result<Dest, BoxError> {
        let text = msg.split(|&b| b == 0).next().unwrap_or_default();
        let text = std::str::from_utf8(text).map_err(|_| "the peer's address is not text")?;
        let parts: Vec<&str> = text.split(':').collect();
        let bad = || format!("a malformed peer address {text:?}");
        let [lid, qpn, psn, gid] = parts[..] else {
            return Err(bad().into());
        };
        let hex = |s: &str| u32::from_str_radix(s, 16).map_err(|_| bad());
        if gid.len() != 32 {
            return Err(bad().into());
        }
        let mut g = [0u8; 16];
        for (i, b) in g.iter_mut().enumerate() {
            *b = u8::from_str_radix(&gid[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        let (lid, qpn, psn) = (hex(lid)?, hex(qpn)?, hex(psn)?);
        if lid > 0xffff || qpn > 0xff_ffff || psn > 0xff_ffff {
            return Err(bad().into());
        }
        Ok(Dest {
            lid: lid as u16,
            qpn,
            psn,
            gid: g,
        })
    }
}

/// Reads until `buf` is full or the peer closes; returns how many bytes came.
fn read_full(s: &mut TcpStream, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match s.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// The bytes of message `iter` from `sender` (0 = server, 1 = client), for `--check`.
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
    /// `[0, grh + size)`: where messages arrive (after the GRH area on UD);
    /// `[grh + size, grh + 2 * size)`: what is sent.
    mr: MemoryRegion,
    size: usize,
    /// UD: the GRH area's bytes (40), else 0.
    grh: usize,
    /// UD: the peer's address handle and QPN, once known.
    ud: std::sync::OnceLock<(AddressHandle, u32)>,
}

impl Side {
    fn post_recv(&self) -> Result<(), BoxError> {
        let sge = LocalSge::new(&self.mr, 0, self.grh + self.size)?;
        self.qp.post_recv(RecvRequest::new(RECV_ID).sge(sge))?;
        Ok(())
    }

    /// Where a sent message's bytes are.
    fn send_at(&self) -> usize {
        self.grh + self.size
    }

    fn post_send(&self) -> Result<(), BoxError> {
        let sge = LocalSge::new(&self.mr, self.send_at(), self.size)?;
        let req = SendRequest::send(SEND_ID).sge(sge);
        match self.ud.get() {
            Some((ah, qpn)) => self.qp.post_send(req.ud(ah, *qpn, QKEY))?,
            None => self.qp.post_send(req)?,
        }
        Ok(())
    }
}

/// The address this side writes: LID 0 (RoCE), its QPN, PSN and GID.
fn my_dest(qp: &QueuePair) -> Result<Dest, BoxError> {
    let ep = qp.endpoint();
    let gid = match ep.addr {
        PeerAddr::Gid(g) => g.octets(),
        // The udp provider: the address it is bound to, IPv4-mapped as RoCE's GIDs are.
        PeerAddr::Ip(std::net::SocketAddr::V4(a)) if !a.ip().is_unspecified() => {
            a.ip().to_ipv6_mapped().octets()
        }
        PeerAddr::Ip(std::net::SocketAddr::V6(a)) if !a.ip().is_unspecified() => a.ip().octets(),
        _ => {
            return Err(
                "this provider's queue pairs have no GID; the pingpong exchange \
                        needs one (use a verbs device, or -d udp)"
                    .into(),
            )
        }
    };
    Ok(Dest {
        lid: 0,
        qpn: ep.qp_num,
        psn: ep.psn,
        gid,
    })
}

/// Connects the queue pair to `peer` with the stock tool's attributes (UD: makes the
/// address handle of the peer; the queue pair is active already).
fn connect(side: &Side, a: &Args, peer: &Dest) -> Result<(), BoxError> {
    if peer.gid == [0; 16] {
        return Err("the peer sent no GID (start the stock tool with -g INDEX)".into());
    }
    if a.conn == Conn::Ud {
        let mut attr = AhAttr::gid(Ipv6Addr::from(peer.gid));
        attr.hop_limit = 1;
        let ah = side.qp.pd().create_ah(&attr)?;
        side.ud.set((ah, peer.qpn)).map_err(|_| "connected twice")?;
        return Ok(());
    }
    let ep = QpEndpoint {
        qp_num: peer.qpn,
        psn: peer.psn,
        mtu: a.mtu.bytes(),
        secret: 0,
        addr: PeerAddr::Gid(Ipv6Addr::from(peer.gid)),
    };
    let opts = options(a);
    side.qp.to_rtr(&ep, &opts)?;
    side.qp.to_rts(&ep, &opts)?;
    Ok(())
}

/// The connection attributes `ibv_rc_pingpong` uses.
fn options(a: &Args) -> ConnectOptions {
    let mut o = ConnectOptions::default();
    o.access = Access::LOCAL_WRITE;
    o.mtu = Some(a.mtu);
    o.max_rd_atomic = 1;
    o.max_dest_rd_atomic = 1;
    o.min_rnr_timer = 12;
    o.timeout = 14;
    o.retry_cnt = 7;
    o.rnr_retry = 7;
    o
}

fn run(a: Args) -> Result<(), BoxError> {
    let ctx = open(&a)?;
    let size = a
        .size
        .unwrap_or(if a.conn == Conn::Ud { 1024 } else { 4096 });
    if a.conn == Conn::Ud && size > ctx.capabilities().max_ud_message() {
        return Err(format!(
            "-s {size}: a UD message is at most the path MTU, {} bytes here",
            ctx.capabilities().max_ud_message()
        )
        .into());
    }
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(a.rx_depth + 2)?;
    let caps = QpCaps::default()
        .max_send_wr(1)
        .max_recv_wr(a.rx_depth)
        .max_sge(1)
        .max_inline_data(0);
    let qp = pd.create_qp_of_type(a.conn.qp_type(), &cq, &cq, None, caps)?;
    let grh = if a.conn == Conn::Ud { GRH } else { 0 };
    let mr = pd.register(vec![0u8; grh + 2 * size], Access::LOCAL_WRITE)?;
    let side = Side {
        qp,
        cq,
        mr,
        size,
        grh,
        ud: std::sync::OnceLock::new(),
    };
    // INIT (UD: RTS, it has no peer to wait for), and every receive posted, before the
    // peer can send.
    if a.conn == Conn::Ud {
        side.qp.activate(QKEY)?;
    } else {
        let init = QpAttr {
            qp_state: QpState::Init,
            pkey_index: 0,
            port_num: 1,
            qp_access_flags: options(&a).access,
            ..QpAttr::default()
        };
        side.qp.modify(
            &init,
            QpAttrMask::STATE
                | QpAttrMask::PKEY_INDEX
                | QpAttrMask::PORT
                | QpAttrMask::ACCESS_FLAGS,
        )?;
    }
    for _ in 0..a.rx_depth {
        side.post_recv()?;
    }
    let me = my_dest(&side.qp)?;
    let peer = match &a.host {
        None => {
            let l = TcpListener::bind(("0.0.0.0", a.port))?;
            let (mut s, from) = l.accept()?;
            drop(l);
            s.set_read_timeout(Some(TIMEOUT))?;
            let mut msg = [0u8; MSG_LEN];
            if read_full(&mut s, &mut msg)? != MSG_LEN {
                return Err(format!("{from} closed before sending its address").into());
            }
            let peer = Dest::from_msg(&msg)?;
            connect(&side, &a, &peer)?;
            s.write_all(&me.to_msg())?;
            // The client's "done" (or its close).
            let mut done = [0u8; 5];
            let n = read_full(&mut s, &mut done)?;
            if n != 5 || &done != b"done\0" {
                return Err(format!("expected \"done\" from {from}, got {:?}", &done[..n]).into());
            }
            peer
        }
        Some(host) => {
            let mut s = TcpStream::connect((host.as_str(), a.port))?;
            s.set_read_timeout(Some(TIMEOUT))?;
            s.write_all(&me.to_msg())?;
            let mut msg = [0u8; MSG_LEN];
            if read_full(&mut s, &mut msg)? != MSG_LEN {
                return Err("the server closed before sending its address".into());
            }
            s.write_all(b"done\0")?;
            let peer = Dest::from_msg(&msg)?;
            connect(&side, &a, &peer)?;
            peer
        }
    };
    println!(
        "  local address:  LID {:#06x}, QPN {:#08x}, PSN {:#08x}, GID {}",
        me.lid,
        me.qpn,
        me.psn,
        Ipv6Addr::from(me.gid)
    );
    println!(
        "  remote address: LID {:#06x}, QPN {:#08x}, PSN {:#08x}, GID {}",
        peer.lid,
        peer.qpn,
        peer.psn,
        Ipv6Addr::from(peer.gid)
    );
    let client = a.host.is_some();
    ping_pong(&side, &a, client)
}

/// The loop of the stock tool: the client sends first; a side sends its next message once
/// its previous send and the peer's message have both completed.
fn ping_pong(side: &Side, a: &Args, client: bool) -> Result<(), BoxError> {
    let (me, peer) = if client { (1u8, 0u8) } else { (0, 1) };
    let size = side.size;
    let mut scratch = vec![0u8; size];
    let mut expect = vec![0u8; size];
    let (mut sent, mut received) = (0u64, 0u64);
    // What the next send waits for.
    let (mut send_pending, mut recv_pending) = (false, true);
    let send = |iter: u64, scratch: &mut [u8]| -> Result<(), BoxError> {
        if a.check {
            pattern(scratch, iter, me);
            side.mr.write_at(side.send_at(), scratch)?;
        }
        side.post_send()
    };
    let start = Instant::now();
    if client {
        send(0, &mut scratch)?;
        send_pending = true;
    }
    let mut last = Instant::now();
    while sent < a.iters || received < a.iters {
        let mut wc = [Completion::default(); 16];
        let n = side.cq.wait(&mut wc, POLL)?;
        if n == 0 {
            if last.elapsed() > TIMEOUT {
                return Err(format!(
                    "no completion for {TIMEOUT:?} ({sent} sends and {received} receives done)"
                )
                .into());
            }
            continue;
        }
        last = Instant::now();
        for c in &wc[..n] {
            if c.status != WcStatus::Success {
                return Err(format!("completion {} failed: {:?}", c.wr_id, c.status).into());
            }
            match c.opcode {
                WcOpcode::Recv => {
                    // UD: the byte count includes the GRH area.
                    if c.byte_len as usize != side.grh + size {
                        return Err(format!("a message of {} bytes", c.byte_len).into());
                    }
                    if a.check {
                        let mut got = vec![0u8; size];
                        side.mr.read_at(side.grh, &mut got)?;
                        pattern(&mut expect, received, peer);
                        if got != expect {
                            return Err(format!("message {received}: wrong bytes").into());
                        }
                    }
                    received += 1;
                    recv_pending = false;
                    side.post_recv()?;
                }
                WcOpcode::Send => {
                    sent += 1;
                    send_pending = false;
                }
                other => return Err(format!("an unexpected completion {other:?}").into()),
            }
        }
        if !send_pending && !recv_pending && sent < a.iters {
            send(sent, &mut scratch)?;
            send_pending = true;
            recv_pending = received < a.iters;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let bytes = size as u64 * a.iters * 2;
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
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("pingpong: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pingpong: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_address_message_round_trips_and_rejects_garbage() {
        let d = Dest {
            lid: 0,
            qpn: 0x11,
            psn: 0xabcdef,
            gid: Ipv6Addr::from([0, 0, 0, 0, 0, 0xffff, 0x0a4d, 0x0001]).octets(),
        };
        let msg = d.to_msg();
        assert_eq!(
            &msg[..],
            b"0000:000011:abcdef:00000000000000000000ffff0a4d0001\0"
        );
        assert_eq!(Dest::from_msg(&msg).unwrap(), d);
        for bad in [
            &b"0000:000011:abcdef"[..],
            b"zz",
            b"0000:1000000:0:00",
            &[0xff; 52],
        ] {
            assert!(Dest::from_msg(bad).is_err(), "{bad:?}");
        }
    }
}
