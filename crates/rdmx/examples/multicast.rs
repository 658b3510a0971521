//! UD multicast across two hosts: the receiving side attaches several UD queue pairs to a
//! multicast group, the sending side sends one datagram to the group and every member
//! gets it; then one member detaches, and the next datagram to the group reaches the
//! others only.
//!
//! ```text
//! receiver:  cargo run --example multicast -- --role recv [-d DEV] [-p PORT] [-q N] [-m GROUP]
//! sender:    cargo run --example multicast -- --role send [-d DEV] [-p PORT] [-m GROUP] HOST
//! ```
//!
//! The two sides coordinate over TCP (port 18530 by default), one text line at a time:
//! the sender connects (retrying for a minute while nobody listens) and writes `hello QPN`; the receiver, whose `-q` members (3 by
//! default) are attached with two receives posted each, answers `ready ENDPOINT` (the
//! compact endpoint of its last member, in hex); the sender sends datagram A to the group
//! and writes `sent`; the receiver checks that every member got A (from the sender's QP,
//! with its payload), detaches the last member and writes `detached`; the sender sends
//! datagram B to the group, then datagram C to the detached member's own address, and
//! writes `sent`; the receiver checks that the other members got B and that the detached
//! member's next receive took C, so B never reached it. It writes `ok` or what went
//! wrong, and both sides exit with that outcome.
//!
//! RoCE groups are IPv4 groups (`-m`, default 239.1.2.3), named by their IPv4-mapped GID.
//! Soft-RoCE (`rdma_rxe`) gets a RoCEv2 datagram from the kernel's IP layer, which drops
//! datagrams to a group the host has not joined, and `ibv_attach_mcast` on rxe registers
//! the group with the device only (with an Ethernet filter for the MAC of an IPv6 group,
//! not the IPv4 group's). So the receiver also joins the group at the IP level on the
//! interface of its device's IPv4 address (a UDP socket with `IP_ADD_MEMBERSHIP`), as
//! rdma_cm's `rdma_join_multicast` does on RoCE; `--no-ip-join` leaves that out, to see
//! what the device does alone.

use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream, UdpSocket};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use rdmx::{
    Access, AhAttr, Completion, CompletionQueue, Context, LocalSge, MemoryRegion, PeerAddr, QpCaps,
    QpEndpoint, QpType, QueuePair, RecvRequest, SendRequest, WcOpcode, WcStatus, GRH_LEN,
    MULTICAST_QPN,
};

const USAGE: &str = "usage: multicast --role recv|send [OPTIONS] [HOST]

  --role recv|send     receive (the members, TCP server) or send (TCP client of HOST)
  -d, --ib-dev DEV     verbs device (default: the first one)
  -p, --port N         TCP port of the coordination (default 18530)
  -q, --members N      receiver: UD queue pairs attached to the group (default 3)
  -m, --group ADDR     IPv4 multicast group (default 239.1.2.3)
      --no-ip-join     receiver: do not join the group at the IP level
  HOST                 sender: the receiver's host";

const QKEY: u32 = 0x1111_2222;
const LEN: usize = 100;
const SLOT: usize = GRH_LEN + LEN;
const TIMEOUT: Duration = Duration::from_secs(10);
/// How long the sender retries a receiver that is not listening yet.
const CONNECT_RETRY: Duration = Duration::from_secs(60);

type BoxError = Box<dyn std::error::Error>;

struct Args {
    send: bool,
    device: Option<String>,
    port: u16,
    members: usize,
    group: Ipv4Addr,
    ip_join: bool,
    host: Option<String>,
}

fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Args, String> {
    let mut a = Args {
        send: false,
        device: None,
        port: 18530,
        members: 3,
        group: Ipv4Addr::new(239, 1, 2, 3),
        ip_join: true,
        host: None,
    };
    let mut role = None;
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        let mut value = |flag: &str| it.next().ok_or_else(|| format!("{flag} needs a value"));
        match arg.as_str() {
            "-h" | "--help" => return Err(String::new()),
            "--role" => role = Some(value("--role")?),
            "-d" | "--ib-dev" => a.device = Some(value("-d")?),
            "-p" | "--port" => a.port = value("-p")?.parse().map_err(|e| format!("-p: {e}"))?,
            "-q" | "--members" => {
                a.members = value("-q")?.parse().map_err(|e| format!("-q: {e}"))?
            }
            "-m" | "--group" => a.group = value("-m")?.parse().map_err(|e| format!("-m: {e}"))?,
            "--no-ip-join" => a.ip_join = false,
            s if s.starts_with('-') => return Err(format!("unknown option {s}")),
            s if a.host.is_none() => a.host = Some(s.to_string()),
            s => return Err(format!("unexpected argument {s}")),
        }
    }
    a.send = match role.as_deref() {
        Some("send") => true,
        Some("recv") => false,
        _ => return Err("--role recv or --role send".into()),
    };
    if a.send != a.host.is_some() {
        return Err("the sender needs the receiver's HOST, the receiver takes none".into());
    }
    if a.members < 2 {
        return Err("-q: at least 2 members (one of them detaches)".into());
    }
    if !a.group.is_multicast() {
        return Err(format!("-m: {} is not an IPv4 multicast group", a.group));
    }
    Ok(a)
}

fn open(a: &Args) -> Result<Context, BoxError> {
    let mut o = rdmx::verbs::Options::default();
    if let Some(d) = &a.device {
        o = o.device(d);
    }
    Ok(Context::open(o)?)
}

/// An activated UD queue pair with a receive CQ of its own and a region of two slots.
struct Member {
    qp: QueuePair,
    rcq: CompletionQueue,
    mr: MemoryRegion,
}

fn member(ctx: &Context, pd: &rdmx::ProtectionDomain) -> Result<Member, BoxError> {
    let scq = ctx.create_cq(16)?;
    let rcq = ctx.create_cq(16)?;
    let qp = pd.create_qp_of_type(QpType::Ud, &scq, &rcq, None, QpCaps::default())?;
    qp.activate(QKEY)?;
    let mr = pd.register(vec![0u8; 2 * SLOT], Access::LOCAL_WRITE)?;
    Ok(Member { qp, rcq, mr })
}

/// The next completion on `cq` within [`TIMEOUT`], or `None`.
fn next(cq: &CompletionQueue) -> Result<Option<Completion>, BoxError> {
    let since = Instant::now();
    let mut wc = [Completion::default(); 1];
    while since.elapsed() < TIMEOUT {
        if cq.poll(&mut wc)? == 1 {
            return Ok(Some(wc[0]));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(None)
}

fn pattern(tag: u8) -> Vec<u8> {
    (0..LEN).map(|i| tag ^ i as u8).collect()
}

/// Checks that `m`'s next receive is a datagram of `tag` from QP `src` in slot `wr_id`.
fn expect(m: &Member, what: &str, wr_id: u64, tag: u8, src: u32) -> Result<(), String> {
    let c = next(&m.rcq)
        .map_err(|e| format!("{what}: {e}"))?
        .ok_or_else(|| format!("{what}: nothing arrived within {TIMEOUT:?}"))?;
    if (c.status, c.opcode, c.wr_id) != (WcStatus::Success, WcOpcode::Recv, wr_id) {
        return Err(format!(
            "{what}: receive {} completed {:?} ({:?}), want receive {wr_id}",
            c.wr_id, c.status, c.opcode
        ));
    }
    if (c.src_qp, c.byte_len as usize) != (src, SLOT) {
        return Err(format!(
            "{what}: {} bytes from QP {:#x}, want {SLOT} from {src:#x}",
            c.byte_len, c.src_qp
        ));
    }
    let mut got = vec![0u8; LEN];
    m.mr.read_at(wr_id as usize * SLOT + GRH_LEN, &mut got)
        .map_err(|e| format!("{what}: {e}"))?;
    if got != pattern(tag) {
        let name = char::from(tag);
        return Err(format!("{what}: the payload is not datagram {name}'s"));
    }
    Ok(())
}

fn line(r: &mut impl BufRead) -> Result<String, BoxError> {
    let mut s = String::new();
    if r.read_line(&mut s)? == 0 {
        return Err("the peer closed the coordination connection".into());
    }
    Ok(s.trim_end().to_string())
}

fn receiver(a: &Args) -> Result<(), BoxError> {
    let ctx = open(a)?;
    let pd = ctx.alloc_pd();
    let members = (0..a.members)
        .map(|_| member(&ctx, &pd))
        .collect::<Result<Vec<_>, _>>()?;
    let gid = a.group.to_ipv6_mapped();
    for m in &members {
        m.qp.attach_mcast(gid, 0)?;
        for r in 0..2u64 {
            m.qp.post_recv(RecvRequest::new(r).sge(LocalSge::new(
                &m.mr,
                r as usize * SLOT,
                SLOT,
            )?))?;
        }
    }
    // The IP-level membership (see the module docs), held until the end.
    let _join = match (a.ip_join, members[0].qp.endpoint().addr) {
        (false, _) => None,
        (true, PeerAddr::Gid(g)) if g.to_ipv4_mapped().is_some() => {
            let ip = g.to_ipv4_mapped().expect("checked");
            let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
            s.join_multicast_v4(&a.group, &ip)?;
            println!(
                "joined {} at the IP level on the interface of {ip}",
                a.group
            );
            Some(s)
        }
        (true, addr) => {
            return Err(format!("the device's address {addr:?} is not an IPv4 one").into())
        }
    };
    println!(
        "{} UD queue pairs attached to {} ({gid}); waiting on TCP port {}",
        members.len(),
        a.group,
        a.port
    );
    let (stream, peer) = TcpListener::bind((Ipv4Addr::UNSPECIFIED, a.port))?.accept()?;
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut r = BufReader::new(stream.try_clone()?);
    let mut w = stream;
    let hello = line(&mut r)?;
    let src: u32 = hello
        .strip_prefix("hello ")
        .and_then(|q| q.parse().ok())
        .ok_or_else(|| format!("{peer}: expected `hello QPN`, got {hello:?}"))?;
    let last = members.last().expect("at least 2 members");
    let ep: String = last
        .qp
        .endpoint()
        .to_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    writeln!(w, "ready {ep}")?;
    let outcome = (|| -> Result<(), BoxError> {
        if line(&mut r)? != "sent" {
            return Err("expected `sent`".into());
        }
        for (i, m) in members.iter().enumerate() {
            expect(m, &format!("member {i}, datagram A"), 0, b'A', src)?;
        }
        println!("datagram A reached all {} members", members.len());
        last.qp.detach_mcast(gid, 0)?;
        writeln!(w, "detached")?;
        if line(&mut r)? != "sent" {
            return Err("expected `sent`".into());
        }
        for (i, m) in members[..members.len() - 1].iter().enumerate() {
            expect(m, &format!("member {i}, datagram B"), 1, b'B', src)?;
        }
        // Its second receive takes the unicast C: the group's B never reached it.
        expect(last, "the detached member", 1, b'C', src)?;
        println!(
            "datagram B reached the {} attached members, not the detached one",
            members.len() - 1
        );
        Ok(())
    })();
    match &outcome {
        Ok(()) => writeln!(w, "ok")?,
        Err(e) => writeln!(w, "failed: {e}")?,
    }
    outcome
}

fn sender(a: &Args, host: &str) -> Result<(), BoxError> {
    let ctx = open(a)?;
    let pd = ctx.alloc_pd();
    let scq = ctx.create_cq(16)?;
    let qp = pd.create_qp_of_type(QpType::Ud, &scq, &scq, None, QpCaps::default())?;
    qp.activate(QKEY)?;
    let mr = pd.register(vec![0u8; 3 * LEN], Access::LOCAL_WRITE)?;
    for (k, tag) in [b'A', b'B', b'C'].into_iter().enumerate() {
        mr.write_at(k * LEN, &pattern(tag))?;
    }
    let group = pd.create_ah(&AhAttr::multicast(a.group.to_ipv6_mapped()))?;
    // The receiver may still be starting: retry while nobody listens.
    let since = Instant::now();
    let stream = loop {
        match TcpStream::connect((host, a.port)) {
            Ok(s) => break s,
            Err(e) if since.elapsed() < CONNECT_RETRY => {
                if e.kind() != std::io::ErrorKind::ConnectionRefused {
                    return Err(format!("connect to {host}:{}: {e}", a.port).into());
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(format!("connect to {host}:{}: {e}", a.port).into()),
        }
    };
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut r = BufReader::new(stream.try_clone()?);
    let mut w = stream;
    writeln!(w, "hello {}", qp.qp_num())?;
    let ready = line(&mut r)?;
    let hex = ready
        .strip_prefix("ready ")
        .ok_or_else(|| format!("expected `ready ENDPOINT`, got {ready:?}"))?;
    let raw = (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(hex.get(2 * i..2 * i + 2).unwrap_or("?"), 16))
        .collect::<Result<Vec<u8>, _>>()?;
    let detached = QpEndpoint::from_bytes(&raw)?;
    let send = |k: usize, ah: &rdmx::AddressHandle, qpn: u32| -> Result<(), BoxError> {
        qp.post_send(
            SendRequest::send(k as u64)
                .sge(LocalSge::new(&mr, k * LEN, LEN)?)
                .ud(ah, qpn, QKEY),
        )?;
        let c = next(&scq)?.ok_or("a send did not complete")?;
        if c.status != WcStatus::Success {
            return Err(format!("send {k} completed {:?}", c.status).into());
        }
        Ok(())
    };
    send(0, &group, MULTICAST_QPN)?;
    writeln!(w, "sent")?;
    let said = line(&mut r)?;
    if said != "detached" {
        return Err(format!("the receiver: {said}").into());
    }
    send(1, &group, MULTICAST_QPN)?;
    let unicast = pd.create_ah(&AhAttr::to_endpoint(&detached))?;
    send(2, &unicast, detached.qp_num)?;
    writeln!(w, "sent")?;
    match line(&mut r)?.as_str() {
        "ok" => {
            println!("the receiver got A on every member and B on the attached ones only");
            Ok(())
        }
        other => Err(format!("the receiver: {other}").into()),
    }
}

fn main() -> ExitCode {
    let a = match parse_args(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("multicast: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let result = match &a.host {
        Some(host) => sender(&a, host),
        None => receiver(&a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("multicast: {e}");
            ExitCode::FAILURE
        }
    }
}
