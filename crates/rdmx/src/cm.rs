//! Connection setup shared by every provider: a listener and a connect call that exchange
//! queue-pair endpoints (QP number, first PSN, address) and application data over a TCP
//! control connection, then connect each queue pair to its peer.
//!
//! This is the exchange `ibv_rc_pingpong` and perftest do by hand, done once for all
//! providers. Both sides pass the same number of queue pairs; `qps[i]` is connected to the
//! peer's `qps[i]`. The `private` bytes (up to [`MAX_PRIVATE`]) carry whatever the
//! application needs, typically the remote regions (address, length, rkey) the peer may
//! use. A peer's endpoint that names an unspecified IP (its context listens on every
//! interface) is given the IP the control connection reached it at.
//!
//! For verbs queue pairs the RDMA connection manager does the same job the way ibverbs
//! users know it (perftest's `-R`): [`RdmaCmListener`] and [`rdma_connect`] connect one
//! queue pair per rdma_cm connection, with rdma_cm's small private data.
//!
//! ```no_run
//! # fn main() -> rdmx::Result<()> {
//! use std::time::Duration;
//! use rdmx::{cm, ConnectOptions, Context, QpCaps};
//!
//! let ctx = Context::open_provider("tcp")?;
//! let pd = ctx.alloc_pd();
//! let cq = ctx.create_cq(256)?;
//! let qp = pd.create_qp(&cq, &cq, QpCaps::default())?;
//! // On the server: `cm::Listener::bind("0.0.0.0:18515")?.accept(...)`.
//! let theirs = cm::connect(
//!     "server.example:18515",
//!     std::slice::from_ref(&qp),
//!     &ConnectOptions::default(),
//!     b"my region: ...",
//!     Duration::from_secs(10),
//! )?;
//! # let _ = theirs; Ok(()) }
//! ```

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::qp::{ConnectOptions, QpEndpoint, QueuePair};
use crate::{Error, Result};

/// Most bytes of private data each side may send.
pub const MAX_PRIVATE: usize = 1 << 20;
/// Most queue pairs one exchange connects.
pub const MAX_QPS: usize = 1 << 16;

const MAGIC: &[u8; 8] = b"RDMXCM01";
/// Bytes per endpoint: QP number, PSN, address family, IP, port.
const EP_LEN: usize = 4 + 4 + 1 + 16 + 2;

/// A control-connection listener (the passive side of `rdma_cm`).
#[derive(Debug)]
pub struct Listener {
    inner: TcpListener,
}

impl Listener {
    /// Listens on `addr` (IPv4 or IPv6; port 0 picks one).
    pub fn bind(addr: impl ToSocketAddrs) -> Result<Listener> {
        let inner = TcpListener::bind(addr).map_err(|e| Error::Io("bind", e))?;
        Ok(Listener { inner })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.inner
            .local_addr()
            .map_err(|e| Error::Io("getsockname", e))
    }

    /// Waits up to `timeout` for one peer, exchanges endpoints and private data with it,
    /// connects every queue pair, and returns the peer's private data.
    pub fn accept(
        &self,
        qps: &[QueuePair],
        opts: &ConnectOptions,
        private: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        self.inner
            .set_nonblocking(true)
            .map_err(|e| Error::Io("O_NONBLOCK", e))?;
        let stream = loop {
            match self.inner.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(Error::Timeout("no peer connected"));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::Io("accept", e)),
            }
        };
        stream
            .set_nonblocking(false)
            .map_err(|e| Error::Io("O_NONBLOCK", e))?;
        exchange(stream, qps, opts, private, deadline)
    }
}

/// Connects to a [`Listener`] at `addr` within `timeout`, exchanges endpoints and private
/// data, connects every queue pair, and returns the peer's private data.
pub fn connect(
    addr: impl ToSocketAddrs,
    qps: &[QueuePair],
    opts: &ConnectOptions,
    private: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    let mut last = None;
    let addrs = addr
        .to_socket_addrs()
        .map_err(|e| Error::Io("resolve the peer's address", e))?;
    for a in addrs {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&a, left.max(Duration::from_millis(1))) {
            Ok(s) => return exchange(s, qps, opts, private, deadline),
            Err(e) => last = Some(e),
        }
    }
    Err(Error::Io(
        "connect to the peer",
        last.unwrap_or_else(|| std::io::Error::other("the address resolved to nothing")),
    ))
}

fn exchange(
    mut s: TcpStream,
    qps: &[QueuePair],
    opts: &ConnectOptions,
    private: &[u8],
    deadline: Instant,
) -> Result<Vec<u8>> {
    if private.len() > MAX_PRIVATE || qps.len() > MAX_QPS {
        return Err(Error::InvalidArgument(
            "too much private data or too many queue pairs for one exchange",
        ));
    }
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(Error::Timeout("connection setup"));
    }
    let io = |e| Error::Io("the connection-setup exchange", e);
    s.set_read_timeout(Some(left)).map_err(io)?;
    s.set_write_timeout(Some(left)).map_err(io)?;
    s.set_nodelay(true).map_err(io)?;
    let peer_ip = s.peer_addr().map_err(io)?.ip();

    let mut msg = Vec::with_capacity(16 + qps.len() * EP_LEN + private.len());
    msg.extend_from_slice(MAGIC);
    msg.extend_from_slice(&(qps.len() as u32).to_be_bytes());
    msg.extend_from_slice(&(private.len() as u32).to_be_bytes());
    for qp in qps {
        encode(&qp.endpoint(), &mut msg);
    }
    msg.extend_from_slice(private);
    s.write_all(&msg).map_err(io)?;

    let mut head = [0u8; 16];
    s.read_exact(&mut head).map_err(io)?;
    if &head[..8] != MAGIC {
        return Err(Error::Protocol(
            "the peer is not an rdmx connection manager",
        ));
    }
    let n = u32::from_be_bytes(head[8..12].try_into().expect("4 bytes")) as usize;
    let plen = u32::from_be_bytes(head[12..16].try_into().expect("4 bytes")) as usize;
    if n != qps.len() {
        return Err(Error::Protocol(
            "the peer connects a different number of queue pairs",
        ));
    }
    if plen > MAX_PRIVATE {
        return Err(Error::Protocol("the peer sent too much private data"));
    }
    let mut body = vec![0u8; n * EP_LEN + plen];
    s.read_exact(&mut body).map_err(io)?;
    for (qp, raw) in qps.iter().zip(body.chunks_exact(EP_LEN)) {
        let mut ep = decode(raw)?;
        if let Some(a) = ep.addr.as_mut() {
            if a.ip().is_unspecified() {
                a.set_ip(peer_ip.to_canonical());
            }
        }
        qp.connect(ep, opts)?;
    }
    // Both sides have connected their QPs before either returns, so the first request
    // finds its peer in RTR.
    s.write_all(b"R").map_err(io)?;
    let mut ready = [0u8; 1];
    s.read_exact(&mut ready).map_err(io)?;
    if ready != *b"R" {
        return Err(Error::Protocol("the peer did not confirm the connection"));
    }
    Ok(body.split_off(n * EP_LEN))
}

fn encode(ep: &QpEndpoint, out: &mut Vec<u8>) {
    out.extend_from_slice(&ep.qp_num.to_be_bytes());
    out.extend_from_slice(&ep.psn.to_be_bytes());
    let (family, ip, port) = match ep.addr {
        None => (0u8, [0u8; 16], 0u16),
        Some(SocketAddr::V4(a)) => (4, a.ip().to_ipv6_mapped().octets(), a.port()),
        Some(SocketAddr::V6(a)) => (6, a.ip().octets(), a.port()),
    };
    out.push(family);
    out.extend_from_slice(&ip);
    out.extend_from_slice(&port.to_be_bytes());
}

fn decode(raw: &[u8]) -> Result<QpEndpoint> {
    let u32_at = |i: usize| u32::from_be_bytes(raw[i..i + 4].try_into().expect("4 bytes"));
    let ip: [u8; 16] = raw[9..25].try_into().expect("16 bytes");
    let port = u16::from_be_bytes([raw[25], raw[26]]);
    let v6 = std::net::Ipv6Addr::from(ip);
    let addr = match raw[8] {
        0 => None,
        4 => Some(SocketAddr::new(IpAddr::V6(v6).to_canonical(), port)),
        6 => Some(SocketAddr::new(IpAddr::V6(v6), port)),
        _ => return Err(Error::Protocol("bad address family in a peer's endpoint")),
    };
    Ok(QpEndpoint {
        qp_num: u32_at(0) & 0xff_ffff,
        psn: u32_at(4) & 0xff_ffff,
        addr,
    })
}

/// Most bytes of private data an rdma_cm connect request carries (IB CM REQ, after the
/// rdma_cm header).
pub const MAX_RDMA_CM_CONNECT_PRIVATE: usize = 56;
/// Most bytes of private data an rdma_cm accept reply carries (IB CM REP).
pub const MAX_RDMA_CM_ACCEPT_PRIVATE: usize = 196;

/// The one verbs QP of an rdma_cm call, after the checks every provider shares.
#[cfg(feature = "verbs")]
fn rdma_cm_qp<'a>(
    qps: &'a [QueuePair],
    private: &[u8],
    max: usize,
) -> Result<&'a crate::verbs::Qp> {
    let qp = rdma_cm_check(qps, private, max)?;
    qp.verbs().ok_or(Error::Unsupported(
        "rdma_cm connects verbs queue pairs only; use cm::Listener/cm::connect on other providers",
    ))
}

fn rdma_cm_check<'a>(qps: &'a [QueuePair], private: &[u8], max: usize) -> Result<&'a QueuePair> {
    let [qp] = qps else {
        return Err(Error::InvalidArgument(
            "rdma_cm connects one queue pair per connection: pass exactly one (for several, \
             one connection each)",
        ));
    };
    if private.len() > max {
        return Err(Error::InvalidArgument(
            if max == MAX_RDMA_CM_CONNECT_PRIVATE {
                "rdma_cm carries at most 56 bytes of private data in a connect request"
            } else {
                "rdma_cm carries at most 196 bytes of private data in an accept reply"
            },
        ));
    }
    Ok(qp)
}

fn first_addr(addr: impl ToSocketAddrs) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| Error::Io("resolve the address", e))?
        .next()
        .ok_or_else(|| {
            Error::Io(
                "resolve the address",
                std::io::Error::other("the address resolved to nothing"),
            )
        })
}

/// A listener of the RDMA connection manager (`rdma_bind_addr` + `rdma_listen`): the
/// passive side of [`rdma_connect`], for verbs queue pairs.
///
/// It connects one queue pair per accepted connection, moved through RTR and RTS with the
/// attributes rdma_cm negotiated (peer QP number, PSNs, path, MTU, READ depths); the
/// access flags, RNR timer and ACK timeout come from [`ConnectOptions`], whose MTU and
/// READ depths bound what rdma_cm picks. The connection (its `rdma_cm_id`) is kept by
/// the queue pair and ends when the queue pair is dropped.
///
/// Private data is what rdma_cm carries: at most [`MAX_RDMA_CM_CONNECT_PRIVATE`] bytes
/// from the connecting side, [`MAX_RDMA_CM_ACCEPT_PRIVATE`] from the accepting one. On
/// InfiniBand and RoCE the peer receives it zero-padded to those sizes (the CM messages
/// have fixed-size fields), so applications send fixed-size records.
///
/// ```no_run
/// # fn main() -> rdmx::Result<()> {
/// use std::time::Duration;
/// use rdmx::{cm, ConnectOptions, Context, QpCaps};
///
/// let ctx = Context::open_provider("verbs")?;
/// let pd = ctx.alloc_pd();
/// let cq = ctx.create_cq(256)?;
/// let qp = pd.create_qp(&cq, &cq, QpCaps::default())?;
/// let listener = cm::RdmaCmListener::bind("0.0.0.0:18515")?;
/// let theirs = listener.accept(
///     std::slice::from_ref(&qp),
///     &ConnectOptions::default(),
///     b"my region",
///     Duration::from_secs(10),
/// )?;
/// # let _ = theirs; Ok(()) }
/// ```
#[derive(Debug)]
pub struct RdmaCmListener {
    #[cfg(feature = "verbs")]
    inner: crate::verbs::rdmacm::Listener,
}

impl RdmaCmListener {
    /// Listens on `addr` (an IP address of an RDMA device, or the unspecified address for
    /// every device; port 0 picks one).
    pub fn bind(addr: impl ToSocketAddrs) -> Result<RdmaCmListener> {
        let addr = first_addr(addr)?;
        #[cfg(feature = "verbs")]
        return Ok(RdmaCmListener {
            inner: crate::verbs::rdmacm::Listener::bind(addr)?,
        });
        #[cfg(not(feature = "verbs"))]
        {
            let _ = addr;
            Err(Error::Unsupported("rdma_cm needs rdmx's verbs feature"))
        }
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        #[cfg(feature = "verbs")]
        return self.inner.local_addr();
        #[cfg(not(feature = "verbs"))]
        Err(Error::Unsupported("rdma_cm needs rdmx's verbs feature"))
    }

    /// Waits up to `timeout` for one connect request, connects `qps` (exactly one verbs
    /// queue pair, in RESET) to the requester, sends it `private` (at most
    /// [`MAX_RDMA_CM_ACCEPT_PRIVATE`] bytes) and returns the requester's private data once
    /// the connection is established. On error the queue pair may be left part-way
    /// (INIT or RTR) and the request is rejected.
    pub fn accept(
        &self,
        qps: &[QueuePair],
        opts: &ConnectOptions,
        private: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        #[cfg(feature = "verbs")]
        {
            let qp = rdma_cm_qp(qps, private, MAX_RDMA_CM_ACCEPT_PRIVATE)?;
            self.inner.accept(qp, opts, private, deadline)
        }
        #[cfg(not(feature = "verbs"))]
        {
            let _ = (opts, deadline);
            rdma_cm_check(qps, private, MAX_RDMA_CM_ACCEPT_PRIVATE)?;
            Err(Error::Unsupported("rdma_cm needs rdmx's verbs feature"))
        }
    }
}

/// Connects `qps` (exactly one verbs queue pair, in RESET) through the RDMA connection
/// manager to an [`RdmaCmListener`] (or any rdma_cm server) at `addr`, within `timeout`:
/// address and route resolution, the connect request carrying `private` (at most
/// [`MAX_RDMA_CM_CONNECT_PRIVATE`] bytes), the moves to RTR and RTS, `rdma_establish`.
/// Returns the peer's private data (see [`RdmaCmListener`] for its padding).
///
/// Errors name what happened: [`Error::RdmaCm`] for an rdma_cm event such as
/// `RDMA_CM_EVENT_REJECTED` (status 8 when nobody listens on that port),
/// `RDMA_CM_EVENT_UNREACHABLE` or `RDMA_CM_EVENT_ADDR_ERROR`; [`Error::Timeout`] when a
/// step did not finish in time; [`Error::Unsupported`] for a queue pair of another
/// provider; [`Error::NoDevice`] when the address is reached through another device than
/// the queue pair's.
pub fn rdma_connect(
    addr: impl ToSocketAddrs,
    qps: &[QueuePair],
    opts: &ConnectOptions,
    private: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    #[cfg(feature = "verbs")]
    {
        let qp = rdma_cm_qp(qps, private, MAX_RDMA_CM_CONNECT_PRIVATE)?;
        crate::verbs::rdmacm::connect(qp, first_addr(addr)?, opts, private, deadline)
    }
    #[cfg(not(feature = "verbs"))]
    {
        let _ = (addr, opts, deadline);
        rdma_cm_check(qps, private, MAX_RDMA_CM_CONNECT_PRIVATE)?;
        Err(Error::Unsupported("rdma_cm needs rdmx's verbs feature"))
    }
}
