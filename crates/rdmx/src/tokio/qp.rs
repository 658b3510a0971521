//! Operations as futures that own their buffers.
//!
//! An operation takes an owned buffer ([`OwnedBuf`]: a pool buffer or a cached
//! registration), waits for room in its queue, posts the request with the buffer as its one
//! element (an owned-buffer post, [`QueuePair::post_send_buf`]), and resolves with the
//! buffer and the completion. Dropping the future before the completion leaves the buffer
//! with the queue pair: the completion queue's driver gives it back (to its pool) when the
//! completion, or the flush after an error, arrives. A buffer is never reachable by safe
//! code while a provider may still touch it.

use std::fmt;
use std::future::poll_fn;
use std::sync::Arc;

use ::tokio::sync::Semaphore;
use rdmx_core::{Completion, RemoteAddr, SendOp, WcStatus};

use super::cq::{AsyncCq, Shared};
use crate::owned::{OwnedBuf, Side};
use crate::{Error, QueuePair, Result, SendRequest};

/// What an operation resolves to: the buffer and the successful completion, or
/// [`OpError`] (which carries the buffer when it can come back).
pub type OpResult<B> = std::result::Result<(B, Completion), OpError<B>>;

/// An operation that did not succeed.
#[non_exhaustive]
pub enum OpError<B> {
    /// The post was refused (a wrong state, a bad argument): the provider never saw the
    /// buffer.
    Post(Error, B),
    /// The request completed with an error status; the completion says which
    /// (`WR_FLUSH_ERR` for requests flushed after an earlier error).
    Completion(Completion, B),
    /// The completion queue failed (overrun, or its descriptor broke) before the request
    /// completed: the queue pair keeps the buffer until it is destroyed.
    Cq(Error),
}

impl<B> OpError<B> {
    /// The buffer, if it came back.
    pub fn into_buf(self) -> Option<B> {
        match self {
            OpError::Post(_, b) | OpError::Completion(_, b) => Some(b),
            OpError::Cq(_) => None,
        }
    }

    /// The completion's status, for an error completion.
    pub fn status(&self) -> Option<WcStatus> {
        match self {
            OpError::Completion(c, _) => Some(c.status),
            _ => None,
        }
    }
}

impl<B> fmt::Debug for OpError<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OpError::Post(e, _) => f.debug_tuple("Post").field(e).finish(),
            OpError::Completion(c, _) => f.debug_tuple("Completion").field(c).finish(),
            OpError::Cq(e) => f.debug_tuple("Cq").field(e).finish(),
        }
    }
}

impl<B> fmt::Display for OpError<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OpError::Post(e, _) => write!(f, "post refused: {e}"),
            OpError::Completion(c, _) => {
                write!(f, "request {:#x} completed with {:?}", c.wr_id, c.status)
            }
            OpError::Cq(e) => write!(f, "the completion queue failed: {e}"),
        }
    }
}

impl<B> std::error::Error for OpError<B> {}

/// A queue pair whose operations are futures. Cloning shares it; it can be used from many
/// tasks at once, on any runtime flavour.
///
/// A full send or receive queue is back-pressure: an operation waits for room (a slot frees
/// when an earlier request of the queue completes). Operations are always signaled; their
/// request ids are the async API's own (see [`AsyncCq`]).
#[derive(Clone, Debug)]
pub struct AsyncQp {
    shared: Arc<QpShared>,
}

#[derive(Debug)]
pub(super) struct QpShared {
    // Field order is drop order: the queue pair goes first (it keeps, and never reuses,
    // buffers still in flight), then the driver handles.
    qp: QueuePair,
    send: AsyncCq,
    recv: AsyncCq,
    send_room: Semaphore,
    recv_room: Semaphore,
}

impl Drop for QpShared {
    fn drop(&mut self) {
        let caps = self.qp.caps();
        self.send.shared().release(caps.max_send_wr);
        self.recv.shared().release(caps.max_recv_wr);
    }
}

impl QpShared {
    fn room(&self, side: Side) -> &Semaphore {
        match side {
            Side::Send => &self.send_room,
            Side::Recv => &self.recv_room,
        }
    }
}

impl AsyncQp {
    /// Makes `qp` asynchronous; `send_cq` and `recv_cq` must wrap the queues it was created
    /// with, and have room for its depths (each [`AsyncCq`] refuses queue pairs whose
    /// depths add up to more completions than it holds: it could overrun).
    pub fn new(qp: QueuePair, send_cq: &AsyncCq, recv_cq: &AsyncCq) -> Result<AsyncQp> {
        if !qp.completes_to(Side::Send, send_cq.shared().core())
            || !qp.completes_to(Side::Recv, recv_cq.shared().core())
        {
            return Err(Error::InvalidArgument(
                "the async completion queues are not the queue pair's",
            ));
        }
        let caps = qp.caps();
        send_cq.shared().reserve(caps.max_send_wr)?;
        if let Err(e) = recv_cq.shared().reserve(caps.max_recv_wr) {
            send_cq.shared().release(caps.max_send_wr);
            return Err(e);
        }
        Ok(AsyncQp {
            shared: Arc::new(QpShared {
                qp,
                send: send_cq.clone(),
                recv: recv_cq.clone(),
                send_room: Semaphore::new(caps.max_send_wr),
                recv_room: Semaphore::new(caps.max_recv_wr),
            }),
        })
    }

    /// The queue pair (for its endpoint, state, and blocking posts; a blocking post takes
    /// room the async operations count on, and then one of them may be refused with
    /// "queue full").
    pub fn qp(&self) -> &QueuePair {
        &self.shared.qp
    }

    /// SEND of the buffer's bytes.
    pub async fn send<B: OwnedBuf>(&self, buf: B) -> OpResult<B> {
        self.post(SendRequest::new(0, SendOp::Send), buf).await
    }

    /// SEND with immediate data.
    pub async fn send_with_imm<B: OwnedBuf>(&self, buf: B, imm: u32) -> OpResult<B> {
        self.post(SendRequest::new(0, SendOp::SendWithImm(imm)), buf)
            .await
    }

    /// A receive into the buffer; the completion's `byte_len` says how much arrived (and
    /// its opcode whether it was a SEND or consumed by a WRITE_WITH_IMM).
    pub async fn recv<B: OwnedBuf>(&self, buf: B) -> OpResult<B> {
        self.run(Side::Recv, None, buf).await
    }

    /// RDMA WRITE of the buffer's bytes to `remote`.
    pub async fn write<B: OwnedBuf>(&self, buf: B, remote: RemoteAddr) -> OpResult<B> {
        self.post(SendRequest::new(0, SendOp::Write(remote)), buf)
            .await
    }

    /// RDMA WRITE with immediate data (consumes a receive at the peer).
    pub async fn write_with_imm<B: OwnedBuf>(
        &self,
        buf: B,
        remote: RemoteAddr,
        imm: u32,
    ) -> OpResult<B> {
        self.post(SendRequest::new(0, SendOp::WriteWithImm(remote, imm)), buf)
            .await
    }

    /// RDMA READ from `remote` into the buffer.
    pub async fn read<B: OwnedBuf>(&self, buf: B, remote: RemoteAddr) -> OpResult<B> {
        self.post(SendRequest::new(0, SendOp::Read(remote)), buf)
            .await
    }

    /// 8-byte compare-and-swap at `remote`; the old value lands in the (8-byte) buffer.
    pub async fn compare_swap<B: OwnedBuf>(
        &self,
        buf: B,
        remote: RemoteAddr,
        compare: u64,
        swap: u64,
    ) -> OpResult<B> {
        let op = SendOp::CompareSwap {
            remote,
            compare,
            swap,
        };
        self.post(SendRequest::new(0, op), buf).await
    }

    /// 8-byte fetch-and-add at `remote`; the old value lands in the (8-byte) buffer.
    pub async fn fetch_add<B: OwnedBuf>(
        &self,
        buf: B,
        remote: RemoteAddr,
        add: u64,
    ) -> OpResult<B> {
        self.post(SendRequest::new(0, SendOp::FetchAdd { remote, add }), buf)
            .await
    }

    /// Any send-queue request with the buffer as its one element (for flags such as
    /// FENCE or SOLICITED). The request must be signaled and have no elements of its own;
    /// its request id is replaced.
    pub async fn post<B: OwnedBuf>(&self, req: SendRequest, buf: B) -> OpResult<B> {
        self.run(Side::Send, Some(req), buf).await
    }

    async fn run<B: OwnedBuf>(&self, side: Side, req: Option<SendRequest>, buf: B) -> OpResult<B> {
        let sh = &self.shared;
        let cq = match side {
            Side::Send => sh.send.shared(),
            Side::Recv => sh.recv.shared(),
        };
        let room = sh.room(side);
        // Cancel-safe: dropped here, the buffer was never posted and simply drops.
        let Ok(permit) = room.acquire().await else {
            return Err(OpError::Post(
                Error::InvalidArgument("the queue pair is closed"),
                buf,
            ));
        };
        let qpn = sh.qp.qp_num();
        let (slot, wr_id) = match cq.register(qpn) {
            Ok(s) => s,
            Err(e) => return Err(OpError::Post(e, buf)),
        };
        let posted = match req {
            Some(mut req) => {
                req.set_wr_id(wr_id);
                sh.qp.post_send_buf(req, buf)
            }
            None => sh.qp.post_recv_buf(wr_id, buf),
        };
        if let Err((e, buf)) = posted {
            cq.free(slot);
            return Err(OpError::Post(e, buf));
        }
        // The room comes back with the completion (below, or when reclaimed).
        permit.forget();
        let mut flight = InFlight {
            qp: sh,
            cq,
            side,
            slot,
            reclaim: reclaim::<B>,
            done: false,
        };
        let res = poll_fn(|cx| cq.poll_slot(slot, cx)).await;
        flight.done = true;
        let c = match res {
            Ok(c) => c,
            Err(e) => return Err(OpError::Cq(e)),
        };
        let buf = sh.qp.take_buf_on::<B>(side, c.wr_id);
        cq.free(slot);
        room.add_permits(1);
        match buf {
            Some(buf) if c.status == WcStatus::Success => Ok((buf, c)),
            Some(buf) => Err(OpError::Completion(c, buf)),
            None => Err(OpError::Cq(Error::InvalidArgument(
                "the buffer of a completed request is not with its queue pair",
            ))),
        }
    }
}

/// A posted request whose future may be dropped: then its buffer is left to the driver.
struct InFlight<'a> {
    qp: &'a Arc<QpShared>,
    cq: &'a Shared,
    side: Side,
    slot: usize,
    reclaim: super::cq::Reclaim,
    done: bool,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.cq.abandon(self.slot, self.side, self.qp, self.reclaim);
        }
    }
}

/// Gives back the buffer of a request whose future was dropped, and its queue's room.
fn reclaim<B: OwnedBuf>(qp: &QpShared, side: Side, c: &Completion) {
    drop(qp.qp.take_buf_on::<B>(side, c.wr_id));
    qp.room(side).add_permits(1);
}
