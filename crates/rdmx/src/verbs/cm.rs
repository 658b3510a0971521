//! Connection setup through the RDMA connection manager (`librdmacm`), the way ibverbs
//! users know it (perftest's `-R`): [`Listener`] and [`connect`] connect one verbs queue
//! pair per rdma_cm connection, with rdma_cm's small private data. For every provider,
//! [`crate::cm`] does the same job over a TCP control connection.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::qp::Qp;
use crate::{ConnectOptions, Error, QueuePair, Result};

/// Most bytes of private data an rdma_cm connect request carries (IB CM REQ, after the
/// rdma_cm header).
pub const MAX_CONNECT_PRIVATE: usize = 56;
/// Most bytes of private data an rdma_cm accept reply carries (IB CM REP).
pub const MAX_ACCEPT_PRIVATE: usize = 196;

/// The one verbs QP of an rdma_cm call.
fn rdma_cm_qp<'a>(qps: &'a [QueuePair], private: &[u8], max: usize) -> Result<&'a Qp> {
    let [qp] = qps else {
        return Err(Error::InvalidArgument(
            "rdma_cm connects one queue pair per connection: pass exactly one (for several, \
             one connection each)",
        ));
    };
    if private.len() > max {
        return Err(Error::InvalidArgument(if max == MAX_CONNECT_PRIVATE {
            "rdma_cm carries at most 56 bytes of private data in a connect request"
        } else {
            "rdma_cm carries at most 196 bytes of private data in an accept reply"
        }));
    }
    qp.provider_qp()
        .as_any()
        .downcast_ref::<Qp>()
        .ok_or(Error::Unsupported(
            "rdma_cm connects verbs queue pairs only; use rdmx::cm on other \
             providers",
        ))
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
/// passive side of [`connect`], for verbs queue pairs.
///
/// It connects one queue pair per accepted connection, moved through RTR and RTS with the
/// attributes rdma_cm negotiated (peer QP number, PSNs, path, MTU, READ depths); the
/// access flags, RNR timer and ACK timeout come from [`ConnectOptions`], whose MTU and
/// READ depths bound what rdma_cm picks. The connection (its `rdma_cm_id`) is kept by
/// the queue pair and ends when the queue pair is dropped.
///
/// Private data is what rdma_cm carries: at most [`MAX_CONNECT_PRIVATE`] bytes
/// from the connecting side, [`MAX_ACCEPT_PRIVATE`] from the accepting one. On
/// InfiniBand and RoCE the peer receives it zero-padded to those sizes (the CM messages
/// have fixed-size fields), so applications send fixed-size records.
///
/// On iWARP two rules of the protocol are the application's to keep. The connecting side
/// sends first: MPA (without the peer-to-peer mode that adds a handshake frame, as
/// soft-iWARP runs it) lets the accepting side send only once the connecting side has,
/// and a message from the accepting side that reaches the connecting side on the heels of
/// the MPA reply fails its connect (soft-iWARP: `RDMA_CM_EVENT_CONNECT_ERROR`, status
/// -22, and the accepting side's queue pair breaks, its receives completing flushed).
/// And receives go up before the peer can send, since iWARP has no RNR: post them in the
/// `ready` callback of [`accept_then`](Self::accept_then) and [`connect_then`].
///
/// ```no_run
/// # fn main() -> rdmx::Result<()> {
/// use std::time::Duration;
/// use rdmx::{verbs::cm, ConnectOptions, Context, QpCaps};
///
/// let ctx = Context::open_provider("verbs")?;
/// let pd = ctx.alloc_pd();
/// let cq = ctx.create_cq(256)?;
/// let qp = pd.create_qp(&cq, &cq, QpCaps::default())?;
/// let listener = cm::Listener::bind("0.0.0.0:18515")?;
/// let theirs = listener.accept(
///     std::slice::from_ref(&qp),
///     &ConnectOptions::default(),
///     b"my region",
///     Duration::from_secs(10),
/// )?;
/// # let _ = theirs; Ok(()) }
/// ```
#[derive(Debug)]
pub struct Listener {
    inner: super::rdmacm::Listener,
}

impl Listener {
    /// Listens on `addr` (an IP address of an RDMA device, or the unspecified address for
    /// every device; port 0 picks one).
    pub fn bind(addr: impl ToSocketAddrs) -> Result<Listener> {
        Ok(Listener {
            inner: super::rdmacm::Listener::bind(first_addr(addr)?)?,
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.inner.local_addr()
    }

    /// Waits up to `timeout` for one connect request, connects `qps` (exactly one verbs
    /// queue pair, in RESET) to the requester, sends it `private` (at most
    /// [`MAX_ACCEPT_PRIVATE`] bytes) and returns the requester's private data once
    /// the connection is established. On error the queue pair may be left part-way
    /// (INIT or RTR) and the request is rejected.
    pub fn accept(
        &self,
        qps: &[QueuePair],
        opts: &ConnectOptions,
        private: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        self.accept_then(qps, opts, private, timeout, || Ok(()))
    }

    /// [`accept`](Self::accept), calling `ready` once the queue pair is in INIT and before
    /// the accept reaches the requester, so before it can send: receives posted there are
    /// in place for its first message. iWARP needs that: it has no RNR, and a SEND that
    /// finds no receive ends the connection (the receiver's queue pair goes to ERR and its
    /// receives complete flushed). An error from `ready` rejects the request.
    pub fn accept_then(
        &self,
        qps: &[QueuePair],
        opts: &ConnectOptions,
        private: &[u8],
        timeout: Duration,
        mut ready: impl FnMut() -> Result<()>,
    ) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let qp = rdma_cm_qp(qps, private, MAX_ACCEPT_PRIVATE)?;
        self.inner.accept(qp, opts, private, deadline, &mut ready)
    }
}

/// Connects `qps` (exactly one verbs queue pair, in RESET) through the RDMA connection
/// manager to an [`Listener`] (or any rdma_cm server) at `addr`, within `timeout`:
/// address and route resolution, the connect request carrying `private` (at most
/// [`MAX_CONNECT_PRIVATE`] bytes), the moves to RTR and RTS, `rdma_establish`.
/// Returns the peer's private data (see [`Listener`] for its padding).
///
/// Errors name what happened: [`Error::RdmaCm`] for an rdma_cm event such as
/// `RDMA_CM_EVENT_REJECTED` (status 8 when nobody listens on that port),
/// `RDMA_CM_EVENT_UNREACHABLE` or `RDMA_CM_EVENT_ADDR_ERROR`; [`Error::Timeout`] when a
/// step did not finish in time; [`Error::Unsupported`] for a queue pair of another
/// provider; [`Error::NoDevice`] when the address is reached through another device than
/// the queue pair's.
pub fn connect(
    addr: impl ToSocketAddrs,
    qps: &[QueuePair],
    opts: &ConnectOptions,
    private: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>> {
    connect_then(addr, qps, opts, private, timeout, || Ok(()))
}

/// [`connect`], calling `ready` once the queue pair is in INIT and before the connect
/// request leaves, so before the peer can send: receives posted there are in place for
/// its first message (see [`Listener::accept_then`]; on iWARP a SEND that finds no
/// receive ends the connection). An error from `ready` ends the connect.
pub fn connect_then(
    addr: impl ToSocketAddrs,
    qps: &[QueuePair],
    opts: &ConnectOptions,
    private: &[u8],
    timeout: Duration,
    mut ready: impl FnMut() -> Result<()>,
) -> Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    let qp = rdma_cm_qp(qps, private, MAX_CONNECT_PRIVATE)?;
    super::rdmacm::connect(qp, first_addr(addr)?, opts, private, deadline, &mut ready)
}
