//! Connection setup shared by every provider: a listener and a connect call that exchange
//! queue-pair endpoints (QP number, first PSN, address) and application data over a TCP
//! control connection, then connect each queue pair to its peer.
//!
//! This is the exchange `ibv_rc_pingpong` and perftest do by hand, done once for all
//! providers. Both sides pass the same number of queue pairs; `qps[i]` is connected to the
//! peer's `qps[i]`. The `private` bytes (up to [`MAX_PRIVATE`]) carry whatever the
//! application needs, typically the remote regions (address, length, rkey) the peer may
//! use. A peer's endpoint that names an unspecified IP (its context listens on every
//! interface) is given the IP the control connection reached it at. The connecting side
//! speaks first: the listening side sends its endpoints, which carry each queue pair's
//! secret, only to a peer whose own message came whole and well-formed.
//!
//! For verbs queue pairs the RDMA connection manager does the same job the way ibverbs
//! users know it (perftest's `-R`): see the verbs provider's `cm` module.
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

use std::borrow::Borrow;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use crate::endpoint::{ConnectOptions, PeerAddr, QpEndpoint};
use crate::qp::QueuePair;
use crate::{Error, QpAttr, QpAttrMask, QpState, Result};

/// Most bytes of private data each side may send.
pub const MAX_PRIVATE: usize = 1 << 20;
/// Most queue pairs one exchange connects.
pub const MAX_QPS: usize = 1 << 16;

const MAGIC: &[u8; 8] = b"RDMXCM02";
/// Bytes per endpoint ([`QpEndpoint::to_bytes`]).
const EP_LEN: usize = QpEndpoint::LEN;

/// A control-connection listener (the passive side of `rdma_cm`).
#[derive(Debug)]
pub struct Listener {
    inner: TcpListener,
    /// How long the exchange with one accepted peer may take (`None`: until the accept's
    /// deadline).
    exchange_timeout: Option<Duration>,
}

impl Listener {
    /// Listens on `addr` (IPv4 or IPv6; port 0 picks one).
    pub fn bind(addr: impl ToSocketAddrs) -> Result<Listener> {
        let inner = TcpListener::bind(addr).map_err(|e| Error::Io("bind", e))?;
        Ok(Listener {
            inner,
            exchange_timeout: None,
        })
    }

    /// Bounds the exchange with each accepted peer by `timeout`, however long the accept
    /// waits in all: a peer that connects and stalls then costs a server that loops over
    /// [`accept`](Self::accept) (skipping bad peers) at most this long.
    pub fn with_exchange_timeout(mut self, timeout: Duration) -> Listener {
        self.exchange_timeout = Some(timeout);
        self
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.inner
            .local_addr()
            .map_err(|e| Error::Io("getsockname", e))
    }

    /// Waits up to `timeout` for one peer, exchanges endpoints and private data with it,
    /// connects every queue pair, and returns the peer's private data.
    ///
    /// A peer that is not an rdmx connection manager, or breaks off the exchange, is an
    /// error ([`Error::Protocol`], [`Error::Io`]) returned before any queue pair is
    /// connected; one whose queue pairs cannot be reached, or that breaks off after the
    /// exchange, leaves them back in RESET. Either way the listener and the queue pairs
    /// stay usable, so a server can log it and accept again.
    /// Waiting with no peer ends in [`Error::Timeout`].
    pub fn accept(
        &self,
        qps: &[QueuePair],
        opts: &ConnectOptions,
        private: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        self.accept_then(qps, opts, private, timeout, || Ok(()))
    }

    /// [`accept`](Self::accept), calling `connected` once every queue pair is connected
    /// and before the peer learns so: receives posted there are in place before the peer
    /// can send (which matters on UC, where a message without a receive is lost). An
    /// error from it ends the exchange.
    pub fn accept_then(
        &self,
        qps: &[QueuePair],
        opts: &ConnectOptions,
        private: &[u8],
        timeout: Duration,
        connected: impl FnMut() -> Result<()>,
    ) -> Result<Vec<u8>> {
        self.accept_checked(qps, opts, private, timeout, |_| true, connected)
    }

    /// [`accept_then`](Self::accept_then), going on only with a peer whose private data
    /// `admit` accepts: it looks at the peer's message before this side sends anything
    /// or connects a queue pair. A refused peer is an error ([`Error::Protocol`]) that
    /// leaves the queue pairs as they were, having learned nothing of this side (its
    /// stream is closed); a server can accept again, as after any bad peer. An
    /// application ties a second exchange to the peer of a first one this way, with a
    /// value it gave that peer.
    pub fn accept_checked(
        &self,
        qps: &[QueuePair],
        opts: &ConnectOptions,
        private: &[u8],
        timeout: Duration,
        mut admit: impl FnMut(&[u8]) -> bool,
        mut connected: impl FnMut() -> Result<()>,
    ) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        self.inner
            .set_nonblocking(true)
            .map_err(|e| Error::Io("O_NONBLOCK", e))?;
        let stream = loop {
            match self.inner.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(Error::Timeout("no peer connected"));
                    }
                    // Asleep until a peer connects (the listener is readable) or the
                    // deadline. The listener stays non-blocking: another thread's accept
                    // may take the connection first, and this one then waits again.
                    crate::cq::wait_readable(self.inner.as_fd(), left)
                        .map_err(|e| Error::Io("poll", e))?;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::Io("accept", e)),
            }
        };
        stream
            .set_nonblocking(false)
            .map_err(|e| Error::Io("O_NONBLOCK", e))?;
        let deadline = match self.exchange_timeout {
            Some(t) => deadline.min(Instant::now() + t),
            None => deadline,
        };
        exchange(
            stream,
            Side::Accepts,
            qps,
            opts,
            private,
            deadline,
            &mut admit,
            &mut connected,
        )
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
    connect_then(addr, qps, opts, private, timeout, || Ok(()))
}

/// [`connect`], calling `connected` once every queue pair is connected and before the
/// peer learns so (see [`Listener::accept_then`]).
pub fn connect_then(
    addr: impl ToSocketAddrs,
    qps: &[QueuePair],
    opts: &ConnectOptions,
    private: &[u8],
    timeout: Duration,
    mut connected: impl FnMut() -> Result<()>,
) -> Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    let mut last = None;
    let addrs = addr
        .to_socket_addrs()
        .map_err(|e| Error::Io("resolve the peer's address", e))?;
    for a in addrs {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&a, left.max(Duration::from_millis(1))) {
            Ok(s) => {
                return exchange(
                    s,
                    Side::Connects,
                    qps,
                    opts,
                    private,
                    deadline,
                    &mut |_| true,
                    &mut connected,
                )
            }
            Err(e) => last = Some(e),
        }
    }
    Err(Error::Io(
        "connect to the peer",
        last.unwrap_or_else(|| std::io::Error::other("the address resolved to nothing")),
    ))
}

/// Which end of the control connection this side is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// It dialed: it sends its endpoints first.
    Connects,
    /// It accepted: it sends its endpoints (and their secrets) only once the peer's
    /// message has come whole and well-formed, so that a peer that is not an rdmx
    /// connection manager (a scanner, a stray client) learns nothing.
    Accepts,
}

/// The exchange over a connected control stream (blocking, bounded by `deadline`). The
/// accepting side goes on only if `admit` accepts the peer's private data.
#[allow(clippy::too_many_arguments)]
pub(crate) fn exchange(
    mut s: TcpStream,
    side: Side,
    qps: &[impl Borrow<QueuePair>],
    opts: &ConnectOptions,
    private: &[u8],
    deadline: Instant,
    admit: &mut dyn FnMut(&[u8]) -> bool,
    connected: &mut dyn FnMut() -> Result<()>,
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
    s.set_nodelay(true).map_err(io)?;
    let peer_ip = s.peer_addr().map_err(io)?.ip();

    let mut msg = Vec::with_capacity(16 + qps.len() * EP_LEN + private.len());
    msg.extend_from_slice(MAGIC);
    msg.extend_from_slice(&(qps.len() as u32).to_be_bytes());
    msg.extend_from_slice(&(private.len() as u32).to_be_bytes());
    for qp in qps {
        msg.extend_from_slice(&qp.borrow().endpoint().to_bytes());
    }
    msg.extend_from_slice(private);
    if side == Side::Connects {
        write_by(&mut s, &msg, deadline).map_err(io)?;
    }
    let (eps, theirs) = read_theirs(&mut s, qps.len(), peer_ip, deadline)?;
    if side == Side::Accepts {
        if !admit(&theirs) {
            return Err(Error::Protocol("the peer's private data was refused"));
        }
        write_by(&mut s, &msg, deadline).map_err(io)?;
    }
    // Connecting a QP may dial the address the peer gave: within the deadline too.
    let left = deadline.saturating_duration_since(Instant::now());
    let opts = &ConnectOptions {
        connect_timeout: opts.connect_timeout.min(left),
        ..*opts
    };
    let mut finish = || -> Result<()> {
        for (qp, ep) in qps.iter().zip(&eps) {
            qp.borrow().connect(*ep, opts)?;
        }
        connected()?;
        // Both sides have connected their QPs before either returns, so the first request
        // finds its peer in RTR.
        write_by(&mut s, b"R", deadline).map_err(io)?;
        let mut ready = [0u8; 1];
        read_by(&mut s, &mut ready, deadline).map_err(io)?;
        if ready != *b"R" {
            return Err(Error::Protocol("the peer did not confirm the connection"));
        }
        Ok(())
    };
    if let Err(e) = finish() {
        // Connecting failed part-way (a peer that cannot be reached, or that broke off):
        // the queue pairs go back to RESET, ready for the next exchange.
        let reset = QpAttr {
            qp_state: QpState::Reset,
            ..QpAttr::default()
        };
        for qp in qps {
            let _ = qp.borrow().modify(&reset, QpAttrMask::STATE);
        }
        return Err(e);
    }
    Ok(theirs)
}

/// Reads the peer's message: its `n` endpoints (an unspecified IP in one replaced by
/// `peer_ip`) and its private data. Every endpoint is parsed before any queue pair is
/// connected, so a malformed one leaves them all as they were.
fn read_theirs(
    s: &mut TcpStream,
    n: usize,
    peer_ip: std::net::IpAddr,
    deadline: Instant,
) -> Result<(Vec<QpEndpoint>, Vec<u8>)> {
    let io = |e| Error::Io("the connection-setup exchange", e);
    let mut head = [0u8; 16];
    read_by(s, &mut head, deadline).map_err(io)?;
    if &head[..8] != MAGIC {
        return Err(Error::Protocol(
            "the peer is not an rdmx connection manager",
        ));
    }
    let count = u32::from_be_bytes(head[8..12].try_into().expect("4 bytes")) as usize;
    let plen = u32::from_be_bytes(head[12..16].try_into().expect("4 bytes")) as usize;
    if count != n {
        return Err(Error::Protocol(
            "the peer connects a different number of queue pairs",
        ));
    }
    if plen > MAX_PRIVATE {
        return Err(Error::Protocol("the peer sent too much private data"));
    }
    let mut body = vec![0u8; n * EP_LEN + plen];
    read_by(s, &mut body, deadline).map_err(io)?;
    let mut eps = Vec::with_capacity(n);
    for raw in body.chunks_exact(EP_LEN).take(n) {
        let mut ep = QpEndpoint::from_bytes(raw)?;
        if let PeerAddr::Ip(a) = &mut ep.addr {
            if a.ip().is_unspecified() {
                a.set_ip(peer_ip.to_canonical());
            }
        }
        eps.push(ep);
    }
    Ok((eps, body.split_off(n * EP_LEN)))
}

/// Reads exactly `buf.len()` bytes by `deadline`. The socket's timeout bounds one read
/// only: it is set to what is left before each, so that a peer that sends a byte at a
/// time cannot stretch the exchange past its deadline.
fn read_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        s.set_read_timeout(Some(left_until(deadline)?))?;
        match s.read(&mut buf[at..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => at += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes all of `buf` by `deadline` (as [`read_by`] reads).
fn write_by(s: &mut TcpStream, buf: &[u8], deadline: Instant) -> std::io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        s.set_write_timeout(Some(left_until(deadline)?))?;
        match s.write(&buf[at..]) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => at += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The time left until `deadline`; an error once it has passed.
fn left_until(deadline: Instant) -> std::io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "the connection-setup deadline passed",
        ));
    }
    Ok(left)
}
