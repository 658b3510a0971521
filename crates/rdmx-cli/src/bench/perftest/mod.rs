//! `rdmx bench TEST --perftest`: one side of a run against stock perftest (`ib_write_bw`
//! and the rest, version 6.24 as Debian's perftest 25.01), or against another `rdmx bench
//! --perftest`, speaking perftest's out-of-band exchange on its TCP port instead of
//! rdmx's own connection setup.
//!
//! The exchange ([`wire`]), as perftest's `*_bw.c` / `*_lat.c` run it without rdma_cm:
//!
//! 1. versions, system data (cycle buffer and cache line, both take the larger), MTU (both
//!    take the smaller);
//! 2. write_lat only: a handshake (key messages traded);
//! 3. a handshake per QP: each side learns the other's QPN, PSN, rkey, target address and
//!    GID; the queue pairs move to RTR and RTS;
//! 4. bandwidth tests (write, read, atomic): a handshake per QP, then one more; send
//!    tests: one handshake, then one per QP, the receives posted, then one more;
//!    write_lat: a handshake per QP, then one more;
//! 5. the test ([`loops`]): in the bandwidth tests the client (the side given a host)
//!    posts and the server's memory is the target (send_bw: the server receives); in
//!    write_lat the server writes first and each side writes once it sees the peer's
//!    write land (it polls the last byte of its target, which carries the round number);
//!    in send_lat the client sends first and each side sends once a message arrived;
//! 6. write/read/atomic bandwidth: a handshake, the client's report, a closing
//!    handshake; send tests: a closing handshake; write_lat: nothing.
//!
//! The regions are laid out as perftest's: per QP, a source half and a target half of
//! `max(size, cycle buffer)` bytes (rounded up to the cache line); messages smaller than
//! half the cycle buffer walk through it in cache-line steps.
//!
//! What is checked of the data that reaches this side: write_lat, every round: the
//! message is the peer's zeroed buffer with the round number in its last byte (perftest
//! zeroes it for write_lat); send tests: every message has the size of the test (perftest
//! fills its buffers with random bytes, so their content is not known); read_bw as the
//! client: after the run one READ of the peer's whole target area, compared with what the
//! measured READs brought; atomic_bw as the client: the same READ, each slot's value
//! being the last value fetched there plus the added 1. write_bw lands random bytes of
//! the peer in this side's memory: nothing to compare them with.

mod loops;
pub(crate) mod wire;

use std::net::{Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use rdmx::{
    Access, ConnectOptions, Mapping, MemoryRegion, Mtu, PeerAddr, QpCaps, QpEndpoint, QueuePair,
};

use super::args::{Args, Budget, Config, Op, PeerMode, Test};
use super::report::{table_header, table_row, LINE};
use super::setup::{open_context, BoxError};
use wire::{BwReport, Comm, Keys};

/// How long the exchange may wait for each message before the test.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a server waits for a peer.
const ACCEPT_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a side waits for the peer's end of the test (the server of a bandwidth
/// test idles through the client's run).
const RUN_TIMEOUT: Duration = Duration::from_secs(3600);
/// perftest's defaults: page-size cycle buffer, 64-byte cache line.
const CYCLE_BUFFER: i32 = 4096;
const CACHE_LINE: i32 = 64;
/// Receives a receiving side keeps posted per QP (perftest's rx depth for SEND).
const RX_DEPTH: u64 = 512;
/// perftest's RNR timer code (MIN_RNR_TIMER).
const MIN_RNR_TIMER: u8 = 12;

/// Runs one side of a test against perftest.
pub(crate) fn run(args: &Args) -> Result<(), BoxError> {
    let cfg = args.resolve()?;
    let provider = provider(&cfg)?;
    let busy = cfg.busy();
    let ctx = open_context(&provider, &cfg, busy)?;
    let p = &cfg.params;
    let test = p.test;
    let size = p.sizes[0];
    let iters = match p.budget {
        Budget::Iters(n) => n,
        Budget::Seconds(_) => {
            return Err("--perftest runs -n iterations; -D is not supported".into())
        }
    };
    let client = matches!(cfg.peer, PeerMode::Connect(..));
    let pd = ctx.alloc_pd();
    let recv = test.op() == Op::Send;
    let rx = if recv {
        RX_DEPTH.min(iters) as usize
    } else {
        0
    };
    let tx = if test.is_bw() { p.tx_depth } else { 2 };
    let cq = ctx.create_cq(p.qps * (tx + rx + 4) + 16)?;
    let caps = QpCaps::default().max_send_wr(tx + 2).max_recv_wr(rx.max(1));
    let qps = (0..p.qps)
        .map(|_| pd.create_qp_of_type(rdmx::QpType::Rc, &cq, &cq, None, caps))
        .collect::<Result<Vec<_>, _>>()?;
    let gid = gid_of(&qps[0])?;
    let mtu_mine = p
        .mtu
        .and_then(Mtu::from_bytes)
        .unwrap_or(ctx.capabilities().active_mtu)
        .min(ctx.capabilities().active_mtu);
    let setup = Setup {
        test,
        size,
        qps: &qps,
        pd: &pd,
        gid,
        mtu: mtu_mine,
        out_reads: ctx.capabilities().max_qp_rd_atom.max(1),
    };
    let mut s = match &cfg.peer {
        PeerMode::Connect(host, port) => {
            let stream = connect_retrying(host, *port)?;
            setup.exchange(Comm::new(stream, true, EXCHANGE_TIMEOUT)?)?
        }
        PeerMode::Listen(port) => {
            let l = TcpListener::bind(("0.0.0.0", *port))
                .map_err(|e| format!("listen on port {port}: {e}"))?;
            let at = l.local_addr()?;
            eprintln!(
                "rdmx: {} (perftest's exchange) waiting for a peer on {at}",
                test.name()
            );
            accept_valid(&l, &setup)?
        }
        PeerMode::Local => {
            return Err("--perftest runs against a peer: give --server or HOST".into())
        }
    };
    let timeout = p.qp_timeout.unwrap_or(14);
    connect_qps(&qps, &s.keys, &s.rem, s.mtu, timeout)?;
    // The handshakes after the queue pairs are connected.
    if recv {
        s.comm.hand_shake(&s.keys[0])?;
        for k in &s.keys {
            s.comm.hand_shake(k)?;
        }
    } else {
        for k in &s.keys {
            s.comm.hand_shake(k)?;
        }
        s.comm.hand_shake(&s.keys[0])?;
    }
    let run = loops::Run {
        cq: &cq,
        qps: &qps,
        mrs: &s.mrs,
        half: s.half,
        size,
        iters,
        tx_depth: p.tx_depth.max(1),
        cq_mod: p.cq_mod.max(1),
        slots: s.slots(size),
        step: s.step(size),
        rem: &s.rem,
        busy,
        gbits: cfg.report_gbits,
    };
    if recv && (!client || !test.is_bw()) {
        run.post_receives(rx as u64)?;
    }
    if recv {
        s.comm.hand_shake(&s.keys[0])?;
    }
    print_header(&provider, &cfg, &s, client);
    let mut rows = Vec::new();
    match (test, client) {
        (Test::WriteBw | Test::ReadBw | Test::AtomicBw, true) => {
            let (row, rep) = run.bw_client(test.op())?;
            s.comm.hand_shake(&s.keys[0])?;
            s.comm.reports(&rep)?;
            s.comm.hand_shake(&s.keys[0])?;
            rows.push(row);
        }
        (Test::WriteBw | Test::ReadBw | Test::AtomicBw, false) => {
            s.comm.set_timeout(RUN_TIMEOUT)?;
            s.comm.hand_shake(&s.keys[0])?;
            s.comm.set_timeout(EXCHANGE_TIMEOUT)?;
            let theirs = s.comm.reports(&BwReport::default())?;
            s.comm.hand_shake(&s.keys[0])?;
            rows.push(theirs.row(cfg.report_gbits));
        }
        (Test::SendBw, true) => {
            let (row, _) = run.bw_client(Op::Send)?;
            s.comm.hand_shake(&s.keys[0])?;
            rows.push(row);
        }
        (Test::SendBw, false) => {
            let row = run.send_bw_server(rx as u64)?;
            s.comm.set_timeout(RUN_TIMEOUT)?;
            s.comm.hand_shake(&s.keys[0])?;
            rows.push(row);
        }
        (Test::WriteLat, _) => rows.push(run.write_lat(client)?),
        (Test::SendLat, _) => {
            rows.push(run.send_lat(client, rx as u64)?);
            s.comm.set_timeout(RUN_TIMEOUT)?;
            s.comm.hand_shake(&s.keys[0])?;
        }
        (t, _) => return Err(format!("--perftest does not run {} yet", t.name()).into()),
    }
    println!("{}", table_header(test, cfg.report_gbits));
    for r in &rows {
        println!("{}", table_row(test, r, cfg.report_gbits));
    }
    println!("{LINE}");
    Ok(())
}

/// The provider: --provider, else the -d device's, else verbs if it has a device, else udp
/// (the two that speak RoCEv2, as perftest's peers do).
fn provider(cfg: &Config) -> Result<String, BoxError> {
    let devices = rdmx::devices();
    let name = match (cfg.providers.first(), &cfg.device) {
        (Some(p), _) => p.clone(),
        (None, Some(d)) => devices
            .iter()
            .find(|x| x.name == *d)
            .map(|x| x.provider.to_string())
            .ok_or_else(|| format!("-d {d}: no such device (see `rdmx devices`)"))?,
        (None, None) if devices.iter().any(|d| d.provider == "verbs") => "verbs".into(),
        (None, None) => rdmx::udp::NAME.into(),
    };
    if name != "verbs" && name != rdmx::udp::NAME {
        return Err(format!(
            "--perftest talks RoCE to perftest: --provider verbs or udp, not {name}"
        )
        .into());
    }
    Ok(name)
}

/// The GID this side's queue pairs are reached at: the device's (verbs), or the
/// IPv4-mapped address the udp provider is bound to.
fn gid_of(qp: &QueuePair) -> Result<[u8; 16], BoxError> {
    match qp.endpoint().addr {
        PeerAddr::Gid(g) => Ok(g.octets()),
        PeerAddr::Ip(SocketAddr::V4(a)) if !a.ip().is_unspecified() => {
            Ok(a.ip().to_ipv6_mapped().octets())
        }
        PeerAddr::Ip(SocketAddr::V6(a)) if !a.ip().is_unspecified() => Ok(a.ip().octets()),
        other => Err(format!(
            "this side's queue pairs have no GID perftest can reach ({other:?}); on udp bind \
             an address with {}",
            rdmx::udp::BIND_ENV
        )
        .into()),
    }
}

/// What the exchange needs of this side.
struct Setup<'a> {
    test: Test,
    size: usize,
    qps: &'a [QueuePair],
    pd: &'a rdmx::ProtectionDomain,
    gid: [u8; 16],
    mtu: Mtu,
    out_reads: u8,
}

/// The exchange up to the keys: the connection, what was agreed, this side's regions.
struct Session {
    comm: Comm,
    /// Both sides' cycle buffer and cache line.
    cycle: usize,
    line: usize,
    mtu: Mtu,
    peer_version: String,
    mrs: Vec<MemoryRegion>,
    /// Bytes of each half of a region.
    half: usize,
    keys: Vec<Keys>,
    rem: Vec<Keys>,
}

impl Session {
    /// perftest's INC: a message's step through the cycle buffer.
    fn step(&self, size: usize) -> usize {
        size.max(self.line).next_multiple_of(self.line)
    }

    /// Slots a message walks through: the cycle buffer in steps if it fits twice, else 1.
    fn slots(&self, size: usize) -> usize {
        if size <= self.cycle / 2 {
            (self.cycle / self.step(size)).max(1)
        } else {
            1
        }
    }
}

impl Setup<'_> {
    /// Versions, system data, MTU, the regions, and the keys.
    fn exchange(&self, mut comm: Comm) -> Result<Session, BoxError> {
        let peer_version = comm.versions()?;
        let cycle = comm.xchg_i32(CYCLE_BUFFER, "cycle buffer size")?;
        let line = comm.xchg_i32(CACHE_LINE, "cache line size")?;
        // Both take the larger; a peer's absurd value is refused, not allocated.
        let cycle = cycle.max(CYCLE_BUFFER);
        let line = line.max(CACHE_LINE);
        if cycle > 1 << 30 || line > 1 << 16 || !(line as u32).is_power_of_two() {
            return Err(format!(
                "the peer's system data is not plausible: cycle buffer {cycle}, cache line {line}"
            )
            .into());
        }
        let (cycle, line) = (cycle as usize, line as usize);
        let mtu = comm.mtu(self.mtu)?;
        let half = self.size.max(cycle).next_multiple_of(line);
        // Source half, target half, and a scratch half for the checks after a run.
        let mrs = self
            .qps
            .iter()
            .map(|_| -> Result<MemoryRegion, BoxError> {
                Ok(self.pd.register(Mapping::new(3 * half)?, Access::ALL)?)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let keys: Vec<Keys> = self
            .qps
            .iter()
            .zip(&mrs)
            .map(|(qp, mr)| {
                let r = mr.remote();
                Keys {
                    lid: 0,
                    out_reads: self.out_reads.into(),
                    qpn: qp.qp_num(),
                    psn: qp.endpoint().psn,
                    rkey: r.rkey,
                    vaddr: r.addr + half as u64,
                    gid: self.gid,
                    srqn: 0,
                }
            })
            .collect();
        if self.test == Test::WriteLat {
            comm.hand_shake(&keys[0])?;
        }
        let mut rem = Vec::with_capacity(keys.len());
        for k in &keys {
            rem.push(comm.hand_shake(k)?);
        }
        let mapped = |g: &[u8; 16]| Ipv6Addr::from(*g).to_ipv4_mapped().is_some();
        if mapped(&rem[0].gid) != mapped(&self.gid) {
            return Err(format!(
                "the peer's GID {} and this side's {} are not of the same IP version (give \
                 perftest -x with the index of its IPv4-mapped GID)",
                Ipv6Addr::from(rem[0].gid),
                Ipv6Addr::from(self.gid)
            )
            .into());
        }
        Ok(Session {
            comm,
            cycle,
            line,
            mtu,
            peer_version,
            mrs,
            half,
            keys,
            rem,
        })
    }
}

/// Accepts until a peer gets through the exchange up to the keys, within
/// [`ACCEPT_TIMEOUT`]; anything else that connects is logged and skipped (the queue pairs
/// are not touched before then).
fn accept_valid(l: &TcpListener, setup: &Setup) -> Result<Session, BoxError> {
    let deadline = Instant::now() + ACCEPT_TIMEOUT;
    l.set_nonblocking(true)?;
    loop {
        let stream = match l.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    return Err(
                        format!("no perftest peer connected within {ACCEPT_TIMEOUT:?}").into(),
                    );
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        stream.set_nonblocking(false)?;
        let from = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        match Comm::new(stream, false, EXCHANGE_TIMEOUT).and_then(|c| setup.exchange(c)) {
            Ok(s) => return Ok(s),
            Err(e) => eprintln!("rdmx: ignored a connection from {from}: {e}"),
        }
    }
}

/// Connects to a perftest server, retrying while it is not listening yet.
fn connect_retrying(host: &str, port: u16) -> Result<TcpStream, BoxError> {
    let since = Instant::now();
    loop {
        match TcpStream::connect((host, port)) {
            Ok(s) => return Ok(s),
            Err(e)
                if e.kind() == std::io::ErrorKind::ConnectionRefused
                    && since.elapsed() < EXCHANGE_TIMEOUT =>
            {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(format!("connect to {host}:{port}: {e}").into()),
        }
    }
}

/// Moves every queue pair to RTR and RTS with perftest's attributes.
fn connect_qps(
    qps: &[QueuePair],
    keys: &[Keys],
    rem: &[Keys],
    mtu: Mtu,
    timeout: u8,
) -> Result<(), BoxError> {
    for ((qp, mine), theirs) in qps.iter().zip(keys).zip(rem) {
        let ep = QpEndpoint {
            qp_num: theirs.qpn,
            psn: theirs.psn,
            mtu: mtu.bytes(),
            secret: 0,
            addr: PeerAddr::Gid(Ipv6Addr::from(theirs.gid)),
        };
        let mut o = ConnectOptions::default();
        o.mtu = Some(mtu);
        o.timeout = timeout;
        o.retry_cnt = 7;
        o.rnr_retry = 7;
        o.min_rnr_timer = MIN_RNR_TIMER;
        // Reads and atomics in flight: what the peer accepts, what this side accepts.
        o.max_rd_atomic = theirs.out_reads.clamp(1, 16) as u8;
        o.max_dest_rd_atomic = mine.out_reads.clamp(1, 16) as u8;
        qp.to_rtr(&ep, &o)
            .and_then(|()| qp.to_rts(&ep, &o))
            .map_err(|e| {
                format!(
                    "connect QP {:#x} to the peer's {:#x}: {e}",
                    qp.qp_num(),
                    theirs.qpn
                )
            })?;
    }
    Ok(())
}

fn print_header(provider: &str, cfg: &Config, s: &Session, client: bool) {
    let p = &cfg.params;
    println!("{LINE}");
    println!(
        "                    {} (perftest exchange, peer version {})",
        p.test.title(),
        s.peer_version
    );
    println!(
        " provider {provider}, {} QP(s), {} side, MTU {}, cycle buffer {}, cache line {}",
        p.qps,
        if client { "client" } else { "server" },
        s.mtu.bytes(),
        s.cycle,
        s.line
    );
    let line = |who: &str, k: &Keys| {
        println!(
            " {who} address: LID {:#06x} QPN {:#08x} PSN {:#08x} RKey {:#010x} VAddr {:#018x} GID {}",
            k.lid,
            k.qpn,
            k.psn,
            k.rkey,
            k.vaddr,
            Ipv6Addr::from(k.gid)
        )
    };
    for k in &s.keys {
        line("local", k);
    }
    for k in &s.rem {
        line("remote", k);
    }
    println!("{LINE}");
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use super::wire::{mtu_msg, version_msg, KEY_LEN, VERSION_LEN};
    use super::*;

    /// A perftest client's side of the exchange up to the keys, with `keys` as its key
    /// message.
    fn client(addr: SocketAddr, keys: &[u8; KEY_LEN]) -> std::io::Result<()> {
        let mut s = TcpStream::connect(addr)?;
        let mut buf = [0u8; KEY_LEN];
        s.write_all(&version_msg())?;
        s.read_exact(&mut buf[..VERSION_LEN])?;
        for v in [4096i32, 64] {
            s.write_all(&v.to_be_bytes())?;
            s.read_exact(&mut buf[..4])?;
        }
        s.write_all(&mtu_msg(Mtu::Mtu1024))?;
        s.read_exact(&mut buf[..2])?;
        s.write_all(keys)?;
        s.read_exact(&mut buf)
    }

    #[test]
    fn the_server_skips_bad_peers_and_serves_the_next() {
        let ctx = rdmx::Context::open_provider(rdmx::loopback::NAME).unwrap();
        let pd = ctx.alloc_pd();
        let cq = ctx.create_cq(8).unwrap();
        let qp = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
        let gid = std::net::Ipv4Addr::new(10, 0, 0, 1)
            .to_ipv6_mapped()
            .octets();
        let setup = Setup {
            test: Test::WriteBw,
            size: 65536,
            qps: std::slice::from_ref(&qp),
            pd: &pd,
            gid,
            mtu: Mtu::Mtu4096,
            out_reads: 16,
        };
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let good = Keys {
            lid: 0,
            out_reads: 128,
            qpn: 0x11,
            psn: 0x123456,
            rkey: 0x2222,
            vaddr: 0x5000,
            gid: std::net::Ipv4Addr::new(10, 0, 0, 2)
                .to_ipv6_mapped()
                .octets(),
            srqn: 0,
        };
        let peers = std::thread::spawn(move || {
            // Not perftest at all.
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(b"GET / HTTP/1.1\r\n").unwrap();
            let _ = s.read(&mut [0u8; 16]);
            // perftest's start, then a key message of garbage (the server answers before
            // it parses, as perftest does, then drops the connection).
            let _ = client(addr, &[b'z'; KEY_LEN]);
            // A GID of the other IP version.
            let mut v6 = good;
            v6.gid = std::net::Ipv6Addr::LOCALHOST.octets();
            let _ = client(addr, &v6.to_msg());
            // Then a good one.
            client(addr, &good.to_msg()).unwrap();
        });
        let s = accept_valid(&l, &setup).unwrap();
        peers.join().unwrap();
        assert_eq!(s.rem, [good]);
        assert_eq!(s.mtu, Mtu::Mtu1024, "the smaller MTU");
        assert_eq!((s.cycle, s.line), (4096, 64));
        assert_eq!(s.keys[0].qpn, qp.qp_num());
        assert_eq!(s.keys[0].vaddr, s.mrs[0].remote().addr + s.half as u64);
        assert_eq!(
            qp.state(),
            rdmx::QpState::Reset,
            "no peer got to the queue pair"
        );
    }
}
