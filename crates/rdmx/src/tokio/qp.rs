//! Operations as futures that own their buffers.
//!
//! An operation takes an owned buffer ([`OwnedBuf`]: a pool buffer or a cached
//! registration) and posts the request with the buffer as its one element (an owned-buffer
//! post, [`QueuePair::post_send_buf`]) at once, or, when its queue is full, as soon as
//! room frees; it resolves with the buffer and the completion. Room is counted per queue
//! ([`Room`]): a slot is taken before the post and given back when the completion has
//! been reaped, and whoever gives it back posts the oldest waiting request with it, so
//! requests go out in the order their operations were made, whenever those are polled.
//! Dropping the future before the completion leaves the buffer with the queue pair: the
//! completion queue's driver gives it back (to its pool) when the completion, or the
//! flush after an error, arrives. A buffer is never reachable by safe code while a
//! provider may still touch it.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll, Waker};

use parking_lot::Mutex;
use rdmx_core::{Completion, RemoteAddr, SendOp, WcStatus};

use super::cq::{AsyncCq, Reclaim, Shared};
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
    send_room: Room,
    recv_room: Room,
}

/// A queue's room: its free slots, and the requests waiting for one in the order their
/// operations were made. A request is posted by whoever frees the slot it gets (an
/// operation that reaped its completion, the driver giving back an abandoned request's
/// buffer), under the room's lock, so that requests go out in that order whenever their
/// operations are polled, or if they never are.
pub(super) struct Room {
    inner: Mutex<RoomInner>,
}

struct RoomInner {
    free: usize,
    waiting: VecDeque<Waiting>,
    next_id: u64,
}

/// A request waiting for room: `post` posts it and says whether it took the slot (a
/// refused post leaves it free), and gives the operation's waker to wake once the
/// room's lock is let go.
struct Waiting {
    id: u64,
    post: PostWaiting,
}

type PostWaiting = Box<dyn FnOnce(&QpShared) -> (bool, Option<Waker>) + Send>;

impl fmt::Debug for Room {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = self.inner.lock();
        f.debug_struct("Room")
            .field("free", &g.free)
            .field("waiting", &g.waiting.len())
            .finish()
    }
}

impl Room {
    fn new(depth: usize) -> Room {
        Room {
            inner: Mutex::new(RoomInner {
                free: depth,
                waiting: VecDeque::new(),
                next_id: 0,
            }),
        }
    }

    /// Gives a slot back: the oldest waiting request that the provider takes gets it.
    pub(super) fn release(&self, qp: &QpShared) {
        let mut g = self.inner.lock();
        let wake = Self::release_locked(&mut g, qp);
        drop(g);
        wake.into_iter().for_each(Waker::wake);
    }

    /// [`release`](Self::release) under the lock; returns the wakers to wake after it.
    fn release_locked(g: &mut RoomInner, qp: &QpShared) -> Vec<Waker> {
        let mut wake = Vec::new();
        while let Some(w) = g.waiting.pop_front() {
            let (posted, waker) = (w.post)(qp);
            wake.extend(waker);
            if posted {
                return wake;
            }
        }
        g.free += 1;
        wake
    }

    /// Removes waiting request `id`, unless a freed slot took it already; returns it, to
    /// drop outside the lock (its buffer goes back to its pool).
    fn withdraw(&self, id: u64) -> Option<Waiting> {
        let mut g = self.inner.lock();
        let i = g.waiting.iter().position(|w| w.id == id)?;
        g.waiting.remove(i)
    }
}

/// Where a waiting request's post left its operation, and the operation's waker.
struct Handoff<B> {
    state: Option<State<B>>,
    waker: Option<Waker>,
}

impl Drop for QpShared {
    fn drop(&mut self) {
        let caps = self.qp.caps();
        self.send.shared().release(caps.max_send_wr);
        self.recv.shared().release(caps.max_recv_wr);
    }
}

impl QpShared {
    pub(super) fn room(&self, side: Side) -> &Room {
        match side {
            Side::Send => &self.send_room,
            Side::Recv => &self.recv_room,
        }
    }

    fn cq(&self, side: Side) -> &Shared {
        match side {
            Side::Send => self.send.shared(),
            Side::Recv => self.recv.shared(),
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
                send_room: Room::new(caps.max_send_wr),
                recv_room: Room::new(caps.max_recv_wr),
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
    pub fn send<B: OwnedBuf>(&self, buf: B) -> Op<B> {
        self.post(SendRequest::new(0, SendOp::Send), buf)
    }

    /// SEND with immediate data.
    pub fn send_with_imm<B: OwnedBuf>(&self, buf: B, imm: u32) -> Op<B> {
        self.post(SendRequest::new(0, SendOp::SendWithImm(imm)), buf)
    }

    /// A receive into the buffer; the completion's `byte_len` says how much arrived (and
    /// its opcode whether it was a SEND or consumed by a WRITE_WITH_IMM).
    pub fn recv<B: OwnedBuf>(&self, buf: B) -> Op<B> {
        self.run(Side::Recv, None, buf)
    }

    /// RDMA WRITE of the buffer's bytes to `remote`.
    pub fn write<B: OwnedBuf>(&self, buf: B, remote: RemoteAddr) -> Op<B> {
        self.post(SendRequest::new(0, SendOp::Write(remote)), buf)
    }

    /// RDMA WRITE with immediate data (consumes a receive at the peer).
    pub fn write_with_imm<B: OwnedBuf>(&self, buf: B, remote: RemoteAddr, imm: u32) -> Op<B> {
        self.post(SendRequest::new(0, SendOp::WriteWithImm(remote, imm)), buf)
    }

    /// RDMA READ from `remote` into the buffer.
    pub fn read<B: OwnedBuf>(&self, buf: B, remote: RemoteAddr) -> Op<B> {
        self.post(SendRequest::new(0, SendOp::Read(remote)), buf)
    }

    /// 8-byte compare-and-swap at `remote`; the old value lands in the (8-byte) buffer.
    pub fn compare_swap<B: OwnedBuf>(
        &self,
        buf: B,
        remote: RemoteAddr,
        compare: u64,
        swap: u64,
    ) -> Op<B> {
        let op = SendOp::CompareSwap {
            remote,
            compare,
            swap,
        };
        self.post(SendRequest::new(0, op), buf)
    }

    /// 8-byte fetch-and-add at `remote`; the old value lands in the (8-byte) buffer.
    pub fn fetch_add<B: OwnedBuf>(&self, buf: B, remote: RemoteAddr, add: u64) -> Op<B> {
        self.post(SendRequest::new(0, SendOp::FetchAdd { remote, add }), buf)
    }

    /// Any send-queue request with the buffer as its one element (for flags such as
    /// FENCE or SOLICITED). The request must be signaled and have no elements of its own;
    /// its request id is replaced.
    pub fn post<B: OwnedBuf>(&self, req: SendRequest<'static>, buf: B) -> Op<B> {
        self.run(Side::Send, Some(req), buf)
    }

    fn run<B: OwnedBuf>(&self, side: Side, req: Option<SendRequest<'static>>, buf: B) -> Op<B> {
        let qp = self.shared.clone();
        let room = qp.room(side);
        let mut g = room.inner.lock();
        if g.waiting.is_empty() && g.free > 0 {
            // Posted under the lock, as `release` posts: no request made after this one
            // can go out first.
            g.free -= 1;
            let state = post(&qp, side, req, buf);
            let wake = match state {
                State::Failed(_) => Room::release_locked(&mut g, &qp),
                _ => Vec::new(),
            };
            drop(g);
            wake.into_iter().for_each(Waker::wake);
            return Op { qp, side, state };
        }
        // Behind the requests already waiting: the slot that frees next posts the oldest.
        let handoff = Arc::new(Mutex::new(Handoff {
            state: None,
            waker: None,
        }));
        let id = g.next_id;
        g.next_id += 1;
        let theirs = handoff.clone();
        g.waiting.push_back(Waiting {
            id,
            post: Box::new(move |qp: &QpShared| {
                let state = post(qp, side, req, buf);
                let took = matches!(state, State::Posted { .. });
                let mut h = theirs.lock();
                h.state = Some(state);
                (took, h.waker.take())
            }),
        });
        drop(g);
        Op {
            qp,
            side,
            state: State::Room { id, handoff },
        }
    }
}

/// Posts `buf` (with `req`, on the send queue) once room has been taken. A refused post
/// leaves the room to the caller.
fn post<B: OwnedBuf>(
    qp: &QpShared,
    side: Side,
    req: Option<SendRequest<'static>>,
    buf: B,
) -> State<B> {
    let cq = qp.cq(side);
    let (slot, wr_id) = match cq.register(qp.qp.qp_num()) {
        Ok(s) => s,
        Err(e) => return State::Failed(OpError::Post(e, buf)),
    };
    let posted = match req {
        Some(mut req) => {
            req.set_wr_id(wr_id);
            qp.qp.send_buf(req, wr_id, buf)
        }
        None => qp.qp.recv_buf(wr_id, wr_id, buf),
    };
    match posted {
        Ok(()) => State::Posted {
            slot,
            reclaim: reclaim::<B>,
        },
        Err((e, buf)) => {
            cq.free(slot);
            State::Failed(OpError::Post(e, buf))
        }
    }
}

/// An operation: a future that resolves to the buffer and the completion.
///
/// The request is posted when the operation is made, if its queue has room and no earlier
/// operation waits for it; otherwise it waits, and is posted as soon as a slot frees for
/// it, by whoever frees it (an earlier operation that reaped its completion, or the
/// driver giving back a dropped one's buffer): requests go out in the order their
/// operations were made, whether or not the waiting one is polled meanwhile. Dropping
/// it before it resolves is safe at any point: before the post the buffer simply drops;
/// after it, the queue pair keeps the buffer until the completion comes, then gives it
/// back to its pool.
#[must_use = "an operation's result says whether it succeeded (dropping it early is safe)"]
pub struct Op<B: OwnedBuf> {
    qp: Arc<QpShared>,
    side: Side,
    state: State<B>,
}

enum State<B> {
    /// Waiting for room in the queue: request `id` of the room's line, whose post leaves
    /// the operation's next state in `handoff`.
    Room {
        id: u64,
        handoff: Arc<Mutex<Handoff<B>>>,
    },
    /// Posted; the completion goes to `slot`.
    Posted {
        slot: usize,
        reclaim: Reclaim,
    },
    /// Refused before it was posted.
    Failed(OpError<B>),
    Done,
}

// No pinned reference to the buffer is ever made: an `Op` moves freely.
impl<B: OwnedBuf> Unpin for Op<B> {}

impl<B: OwnedBuf> fmt::Debug for Op<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Room { .. } => "waiting for room",
            State::Posted { .. } => "posted",
            State::Failed(_) => "refused",
            State::Done => "done",
        };
        f.debug_struct("Op")
            .field("qp_num", &self.qp.qp.qp_num())
            .field("state", &state)
            .finish()
    }
}

impl<B: OwnedBuf> Future for Op<B> {
    type Output = OpResult<B>;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<OpResult<B>> {
        let this = self.get_mut();
        loop {
            match std::mem::replace(&mut this.state, State::Done) {
                State::Room { id, handoff } => {
                    let mut h = handoff.lock();
                    match h.state.take() {
                        Some(next) => {
                            drop(h);
                            this.state = next;
                        }
                        None => {
                            match &mut h.waker {
                                Some(w) => w.clone_from(cx.waker()),
                                None => h.waker = Some(cx.waker().clone()),
                            }
                            drop(h);
                            if this.qp.cq(this.side).failed() {
                                // No slot may free any more: it leaves the line, and its
                                // post, which the failed queue refuses, gives its buffer
                                // back (a freed slot may have posted it meanwhile).
                                if let Some(w) = this.qp.room(this.side).withdraw(id) {
                                    // (The waker is this task's: no need to wake it.)
                                    let _ = (w.post)(&this.qp);
                                }
                                this.state = State::Room { id, handoff };
                                continue;
                            }
                            this.state = State::Room { id, handoff };
                            return Poll::Pending;
                        }
                    }
                }
                State::Posted { slot, reclaim } => {
                    let cq = this.qp.cq(this.side);
                    let c = match cq.poll_slot(slot, cx) {
                        Poll::Pending => {
                            this.state = State::Posted { slot, reclaim };
                            return Poll::Pending;
                        }
                        Poll::Ready(Ok(c)) => c,
                        Poll::Ready(Err(e)) => {
                            // The CQ failed: no completion will come. The buffer stays
                            // with the queue pair; the room goes to an operation waiting
                            // for it, whose post the failed CQ refuses at once.
                            this.qp.room(this.side).release(&this.qp);
                            return Poll::Ready(Err(OpError::Cq(e)));
                        }
                    };
                    let buf = this.qp.qp.take_buf_on::<B>(this.side, c.wr_id);
                    cq.free(slot);
                    this.qp.room(this.side).release(&this.qp);
                    return Poll::Ready(match buf {
                        Some(buf) if c.status == WcStatus::Success => Ok((buf, c)),
                        Some(buf) => Err(OpError::Completion(c, buf)),
                        None => Err(OpError::Cq(Error::InvalidArgument(
                            "the buffer of a completed request is not with its queue pair",
                        ))),
                    });
                }
                State::Failed(e) => return Poll::Ready(Err(e)),
                State::Done => {
                    return Poll::Ready(Err(OpError::Cq(Error::InvalidArgument(
                        "an operation polled after it resolved",
                    ))))
                }
            }
        }
    }
}

impl<B: OwnedBuf> Drop for Op<B> {
    fn drop(&mut self) {
        let state = std::mem::replace(&mut self.state, State::Done);
        let posted = match state {
            State::Room { id, handoff } => {
                // Still waiting: it leaves the line (its buffer drops). Or a freed slot
                // took it meanwhile, and it is posted (or was refused).
                if let Some(w) = self.qp.room(self.side).withdraw(id) {
                    drop(w);
                    return;
                }
                let next = handoff.lock().state.take();
                match next {
                    Some(State::Posted { slot, reclaim }) => Some((slot, reclaim)),
                    _ => None,
                }
            }
            State::Posted { slot, reclaim } => Some((slot, reclaim)),
            State::Failed(_) | State::Done => None,
        };
        if let Some((slot, reclaim)) = posted {
            let failed = self
                .qp
                .cq(self.side)
                .abandon(slot, self.side, &self.qp, reclaim);
            if failed {
                // As for an operation that saw the failure: its room goes back.
                self.qp.room(self.side).release(&self.qp);
            }
        }
    }
}

/// Gives back the buffer of a request whose future was dropped, and its queue's room.
fn reclaim<B: OwnedBuf>(qp: &QpShared, side: Side, c: &Completion) {
    drop(qp.qp.take_buf_on::<B>(side, c.wr_id));
    qp.room(side).release(qp);
}
