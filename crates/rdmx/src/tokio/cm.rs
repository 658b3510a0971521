//! Connection setup for async queue pairs: the exchange of [`crate::cm`], with the
//! control connection made and accepted on tokio. The exchange itself and the queue pairs'
//! moves to RTS (which on tcp dial the peer's listener) run on tokio's blocking pool, so
//! no runtime thread blocks. The timeouts need a runtime with its time driver enabled.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ::tokio::net::{TcpListener, TcpStream, ToSocketAddrs};

use super::AsyncQp;
use crate::cm::Side;
use crate::{ConnectOptions, Error, Result};

/// A control-connection listener whose [`accept`](Self::accept) is a future.
#[derive(Debug)]
pub struct Listener {
    inner: TcpListener,
    exchange_timeout: Option<Duration>,
}

impl Listener {
    /// Listens on `addr` (port 0 picks one).
    pub async fn bind(addr: impl ToSocketAddrs) -> Result<Listener> {
        let inner = TcpListener::bind(addr)
            .await
            .map_err(|e| Error::Io("bind", e))?;
        Ok(Listener {
            inner,
            exchange_timeout: None,
        })
    }

    /// Bounds the exchange with each accepted peer by `timeout` (see
    /// [`crate::cm::Listener::with_exchange_timeout`]).
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
    /// connects every queue pair, and returns the peer's private data; as
    /// [`crate::cm::Listener::accept`].
    pub async fn accept(
        &self,
        qps: &[AsyncQp],
        opts: &ConnectOptions,
        private: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let (s, _) = ::tokio::time::timeout(timeout, self.inner.accept())
            .await
            .map_err(|_| Error::Timeout("no peer connected"))?
            .map_err(|e| Error::Io("accept", e))?;
        let deadline = match self.exchange_timeout {
            Some(t) => Instant::now() + t,
            None => deadline,
        };
        exchange(s, Side::Accepts, qps, opts, private, deadline).await
    }
}

/// Connects to a [`Listener`] (or a blocking [`crate::cm::Listener`]) at `addr`, exchanges
/// endpoints and private data, connects every queue pair, and returns the peer's private
/// data; as [`crate::cm::connect`].
pub async fn connect(
    addr: impl ToSocketAddrs,
    qps: &[AsyncQp],
    opts: &ConnectOptions,
    private: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    let s = ::tokio::time::timeout(timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| Error::Timeout("connecting to the peer"))?
        .map_err(|e| Error::Io("connect to the peer", e))?;
    exchange(s, Side::Connects, qps, opts, private, deadline).await
}

async fn exchange(
    s: TcpStream,
    side: Side,
    qps: &[AsyncQp],
    opts: &ConnectOptions,
    private: &[u8],
    deadline: Instant,
) -> Result<Vec<u8>> {
    let s = s
        .into_std()
        .map_err(|e| Error::Io("the connection-setup stream", e))?;
    s.set_nonblocking(false)
        .map_err(|e| Error::Io("O_NONBLOCK", e))?;
    let (qps, opts, private) = (qps.to_vec(), *opts, private.to_vec());
    ::tokio::task::spawn_blocking(move || {
        let qps: Vec<_> = qps.iter().map(AsyncQp::qp).collect();
        crate::cm::exchange(
            s,
            side,
            &qps,
            &opts,
            &private,
            deadline,
            &mut |_| true,
            &mut || Ok(()),
        )
    })
    .await
    .map_err(|e| Error::Io("the connection-setup task", std::io::Error::other(e)))?
}
