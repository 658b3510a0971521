//! Async rdmx on tokio (cargo feature `tokio`): completions and owned-buffer operations as
//! futures, and connection setup that does not block the runtime.
//!
//! - [`AsyncCq`] makes a [`CompletionQueue`](crate::CompletionQueue) awaitable. Its driver
//!   task sleeps on the queue's notification descriptor (tokio's `AsyncFd`), re-arming it
//!   and polling once more before every sleep, and routes each completion to the
//!   operation that waits for it. No task spins or sleeps in slices, except on a
//!   busy-polled context, where polling is what the application asked for.
//! - [`AsyncQp`] has the operations: [`send`](AsyncQp::send), [`recv`](AsyncQp::recv),
//!   [`write`](AsyncQp::write), [`read`](AsyncQp::read), the atomics,
//!   [`write_with_imm`](AsyncQp::write_with_imm), ... Each takes an owned buffer (a
//!   [`PoolBuf`](crate::PoolBuf) or a [`CachedBuf`](crate::CachedBuf)) and resolves to
//!   the buffer and the completion, or an [`OpError`] carrying both (io_uring style).
//!   An operation ([`Op`]) posts its request when it is made, so requests go out in the
//!   order the code makes them; a full queue is back-pressure: the operation waits for
//!   room, behind those that waited before it, and its request is posted as soon as a
//!   slot frees for it (by whoever frees it: no poll of the waiting operation is needed;
//!   a slot frees when the operation holding it reaps its completion, or, dropped, when
//!   the driver routes it).
//! - Cancellation is safe: a future dropped before its completion leaves the buffer with
//!   the queue pair, and the driver returns it (to its pool) when the completion, or the
//!   flush after an error, arrives. The request itself still runs: a dropped `send` is
//!   delivered, and a dropped `recv` stays posted and takes a message, which goes back
//!   to the pool with its buffer (in a `select!` loop, keep a receive's future across
//!   iterations rather than making a new one each time).
//! - If the completion queue's driver task ends without the queue failing (its runtime
//!   shut down), the queue fails: operations in flight fail, and so do those waiting for
//!   room, once it comes back (room a dropped operation held comes back at once; room a
//!   live one holds, when that one is polled).
//! - [`cm`]: [`connect`](cm::connect) and [`Listener::accept`](cm::Listener::accept) as
//!   futures.
//!
//! The blocking API and this one are the same objects: the blocking ping-pong's
//! `post_send_buf` + `cq.wait` + `take_buf` is `qp.send(buf).await` here.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use rdmx::tokio::{AsyncCq, AsyncQp};
//! use rdmx::{BufferPool, ConnectOptions, Context, PoolConfig, QpCaps};
//!
//! let ctx = Context::open_default()?;
//! let pd = ctx.alloc_pd();
//! // Room for both queue pairs' requests (128 sends and 128 receives each by default).
//! let cq = AsyncCq::new(ctx.create_cq(512)?)?;
//! let qp = |_| -> rdmx::Result<AsyncQp> {
//!     AsyncQp::new(pd.create_qp(cq.cq(), cq.cq(), QpCaps::default())?, &cq, &cq)
//! };
//! let (a, b) = (qp(0)?, qp(1)?);
//! a.qp().connect(b.qp().endpoint(), &ConnectOptions::default())?;
//! b.qp().connect(a.qp().endpoint(), &ConnectOptions::default())?;
//! let pool = BufferPool::new(pd.clone(), PoolConfig::default())?;
//!
//! let rx = b.recv(pool.get(64)?);
//! let mut msg = pool.get(5)?;
//! msg.write_at(0, b"hello")?;
//! let (sent, rx) = tokio::join!(a.send(msg), rx);
//! let (_msg, _) = sent?;
//! let (buf, c) = rx?;
//! assert_eq!(&buf.as_slice().unwrap()[..c.byte_len as usize], b"hello");
//! # Ok(()) }
//! ```

pub mod cm;
mod cq;
mod qp;

pub use cq::AsyncCq;
pub use qp::{AsyncQp, Op, OpError, OpResult};
