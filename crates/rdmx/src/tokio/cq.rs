//! An awaitable completion queue: one driver task per queue reaps completions and routes
//! each to the operation that waits for it.
//!
//! The driver polls the queue until it is empty, arms its notification, polls once more
//! (a completion that came before the arm does not notify), tells the provider it stops
//! polling (on tcp the progress thread takes over at once), and sleeps on the notification
//! descriptor, registered with tokio's reactor. Where completions only move when someone
//! polls (a busy-polled tcp context, chosen for the lowest latency) it polls instead,
//! yielding to other tasks between polls, for as long as the queue is awaitable.
//!
//! Operations name their slot, and the slot's use, in the request id: one of the reserved
//! ids ([`RESERVED_WR_IDS`](crate::RESERVED_WR_IDS)), which no other post can name. A
//! completion whose id names a slot of its queue pair, in the use it was posted in, wakes
//! that operation (or, when the operation was dropped, gives the buffer back to its
//! pool). One with an operation's id that no operation waits for any more (its queue
//! pair was destroyed with the request in flight, and the slot freed, perhaps taken
//! again by a queue pair that got the same number) is dropped, logged at debug level;
//! every other completion goes to [`AsyncCq::next`].

use std::collections::VecDeque;
use std::fmt;
use std::future::poll_fn;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Weak};
use std::task::{Context as TaskContext, Poll, Waker};

use ::tokio::io::unix::AsyncFd;
use ::tokio::io::Interest;
use ::tokio::task::AbortHandle;
use parking_lot::Mutex;
use rdmx_core::Completion;
use slab::Slab;

use super::qp::QpShared;
use crate::owned::Side;
use crate::provider::CqCore;
use crate::{CompletionQueue, Error, Result};

/// Completions the driver moves per poll.
const BATCH: usize = 64;

/// A completion queue that can be awaited: operations of [`AsyncQp`](super::AsyncQp)s on
/// it resolve when their completions arrive, and [`next`](Self::next) yields the other
/// completions (of requests posted through the blocking API). Cloning shares the queue.
///
/// Its driver task polls the underlying [`CompletionQueue`]: do not poll that yourself
/// while the `AsyncCq` lives, or operations miss their completions. The operations'
/// request ids are among [`RESERVED_WR_IDS`](crate::RESERVED_WR_IDS), which no blocking
/// post can name.
#[derive(Clone)]
pub struct AsyncCq {
    handle: Arc<Handle>,
}

impl fmt::Debug for AsyncCq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.handle.shared.state.lock();
        f.debug_struct("AsyncCq")
            .field("cq", &self.handle.shared.cq)
            .field("in_flight", &st.slots.len())
            .field("other", &st.other.len())
            .finish()
    }
}

/// The driver lives while some handle does.
struct Handle {
    shared: Arc<Shared>,
    driver: AbortHandle,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

pub(super) struct Shared {
    // Field order is drop order: the descriptor leaves the reactor before the queue that
    // owns it goes.
    fd: AsyncFd<Fd>,
    cq: CompletionQueue,
    state: Mutex<State>,
    /// Whether the driver polls instead of sleeping on the notification.
    polling: bool,
    /// Requests the queue pairs on this queue may have outstanding together.
    reserved: Mutex<usize>,
}

struct Fd(RawFd);

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

#[derive(Default)]
struct State {
    slots: Slab<Slot>,
    /// The generation of the next slot taken (see [`crate::owned::async_id`]).
    next_gen: u32,
    /// Completions no operation waits for.
    other: VecDeque<Completion>,
    other_waker: Option<Waker>,
    /// Why the driver stopped, if it did.
    failed: Option<Failure>,
}

enum Slot {
    /// Posted (or about to be) with request id `id`; its future waits.
    Waiting {
        qpn: u32,
        id: u64,
        waker: Option<Waker>,
    },
    /// Completed; its future has not seen it yet.
    Done(Completion),
    /// Its future was dropped while the request was in flight: the queue pair keeps the
    /// buffer until the completion comes, then `reclaim` gives it back.
    Abandoned {
        qpn: u32,
        id: u64,
        side: Side,
        qp: Weak<QpShared>,
        reclaim: Reclaim,
    },
    /// Abandoned and completed: the driver is giving the buffer back.
    Reclaiming,
}

/// Gives back the buffer of a completed request whose future was dropped.
pub(super) type Reclaim = fn(&QpShared, Side, &Completion);

#[derive(Clone, Debug)]
enum Failure {
    Overrun,
    Io(std::io::ErrorKind, String),
}

impl Failure {
    fn error(&self) -> Error {
        match self {
            Failure::Overrun => Error::CqOverrun,
            Failure::Io(kind, msg) => Error::Io(
                "waiting for completions",
                std::io::Error::new(*kind, msg.clone()),
            ),
        }
    }
}

impl AsyncCq {
    /// Makes `cq` awaitable and starts its driver task on the current tokio runtime.
    ///
    /// Fails outside a runtime; the runtime needs its IO driver (`enable_io` or
    /// `enable_all`, as `#[tokio::main]` has), without which tokio panics. A queue pair's
    /// requests must complete only to awaitable queues, and the queue must hold every
    /// completion its queue pairs may have outstanding together
    /// ([`AsyncQp::new`](super::AsyncQp::new) checks).
    pub fn new(cq: CompletionQueue) -> Result<AsyncCq> {
        let rt = ::tokio::runtime::Handle::try_current().map_err(|_| {
            Error::InvalidArgument("an async completion queue needs a tokio runtime")
        })?;
        let _enter = rt.enter();
        // SAFETY: the descriptor belongs to `cq`, which the returned value keeps, and
        // which `Shared` drops after the `AsyncFd` (field order); nothing else closes it.
        let fd =
            unsafe { AsyncFd::register_with_interest(Fd(cq.fd().as_raw_fd()), Interest::READABLE) }
                .map_err(|e| {
                    Error::Io(
                        "registering the completion queue with tokio",
                        std::io::Error::from(e),
                    )
                })?;
        let polling = !cq.parts.imp.notifies_unpolled();
        let shared = Arc::new(Shared {
            fd,
            cq,
            state: Mutex::new(State::default()),
            polling,
            reserved: Mutex::new(0),
        });
        // Owned by the task from the start: a task dropped before its first poll fails
        // the queue too.
        let (gone, sh) = (DriverGone(shared.clone()), shared.clone());
        let driver = rt
            .spawn(async move {
                let _gone = gone;
                drive(sh).await;
            })
            .abort_handle();
        Ok(AsyncCq {
            handle: Arc::new(Handle { shared, driver }),
        })
    }

    /// The completion queue.
    pub fn cq(&self) -> &CompletionQueue {
        &self.handle.shared.cq
    }

    /// The next completion that no operation of the async API waits for (requests posted
    /// through the blocking API, on queue pairs that complete here). Await it from one
    /// task at a time: the queue wakes only the task that polled last.
    pub async fn next(&self) -> Result<Completion> {
        poll_fn(|cx| self.poll_next(cx)).await
    }

    /// Polls for [`next`](Self::next): the stream of completions, as `Stream::poll_next`
    /// (never ends; an error means the queue failed).
    pub fn poll_next(&self, cx: &mut TaskContext<'_>) -> Poll<Result<Completion>> {
        let sh = &self.handle.shared;
        let mut st = sh.state.lock();
        if let Some(c) = st.other.pop_front() {
            return Poll::Ready(Ok(c));
        }
        if let Some(f) = &st.failed {
            return Poll::Ready(Err(f.error()));
        }
        match &mut st.other_waker {
            Some(w) => w.clone_from(cx.waker()),
            None => st.other_waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    pub(super) fn shared(&self) -> &Shared {
        &self.handle.shared
    }
}

impl Shared {
    pub(super) fn core(&self) -> &Arc<CqCore> {
        self.cq.core()
    }

    /// Sets aside room for `n` more outstanding requests.
    pub(super) fn reserve(&self, n: usize) -> Result<()> {
        let mut r = self.reserved.lock();
        if r.saturating_add(n) > self.cq.capacity() {
            return Err(Error::InvalidArgument(
                "the completion queue cannot hold a completion for every request its queue \
                 pairs may have outstanding",
            ));
        }
        *r += n;
        Ok(())
    }

    pub(super) fn release(&self, n: usize) {
        let mut r = self.reserved.lock();
        *r = r.saturating_sub(n);
    }

    /// A slot for a request of QP `qpn` about to be posted; returns its request id.
    pub(super) fn register(&self, qpn: u32) -> Result<(usize, u64)> {
        let mut st = self.state.lock();
        if let Some(f) = &st.failed {
            return Err(f.error());
        }
        let st = &mut *st;
        let entry = st.slots.vacant_entry();
        let i = entry.key();
        if i >= 1 << crate::owned::ASYNC_SLOT_BITS {
            return Err(Error::InvalidArgument(
                "too many async operations in flight on one completion queue",
            ));
        }
        let id = crate::owned::async_id(i, st.next_gen);
        entry.insert(Slot::Waiting {
            qpn,
            id,
            waker: None,
        });
        st.next_gen = st.next_gen.wrapping_add(1);
        Ok((i, id))
    }

    /// Frees slot `i`: its request was never posted, or its buffer has been taken.
    pub(super) fn free(&self, i: usize) {
        self.state.lock().slots.try_remove(i);
    }

    /// Polls slot `i` for its completion.
    pub(super) fn poll_slot(&self, i: usize, cx: &mut TaskContext<'_>) -> Poll<Result<Completion>> {
        let mut st = self.state.lock();
        let st = &mut *st;
        match st.slots.get_mut(i) {
            // The slot stays taken until `free`: its request id must not be reused
            // before the buffer has left the queue pair.
            Some(Slot::Done(c)) => Poll::Ready(Ok(*c)),
            Some(Slot::Waiting { waker, .. }) => {
                if let Some(f) = &st.failed {
                    st.slots.remove(i);
                    return Poll::Ready(Err(f.error()));
                }
                match waker {
                    Some(w) => w.clone_from(cx.waker()),
                    None => *waker = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
            Some(Slot::Abandoned { .. } | Slot::Reclaiming) | None => Poll::Ready(Err(
                Error::InvalidArgument("an async operation's slot is gone"),
            )),
        }
    }

    /// The future of slot `i` was dropped with its request in flight: the buffer goes
    /// back (through `reclaim`) when the completion comes, or now if it came already.
    /// Returns true if the queue has failed, so that no completion will come (the buffer
    /// then stays with the queue pair, and the caller gives back the request's room).
    pub(super) fn abandon(
        &self,
        i: usize,
        side: Side,
        qp: &Arc<QpShared>,
        reclaim: Reclaim,
    ) -> bool {
        let mut st = self.state.lock();
        // The slots abandoned before whose queue pair is gone wait for a completion that
        // will not come (destroying a queue pair completes nothing): freed here, so that
        // a server dropping futures as connections come and go does not keep them all.
        st.slots
            .retain(|_, s| !matches!(s, Slot::Abandoned { qp, .. } if qp.strong_count() == 0));
        let mut failed = false;
        let done = match st.slots.get(i) {
            Some(Slot::Done(c)) => Some(*c),
            Some(Slot::Waiting { qpn, id, .. }) => {
                let (qpn, id) = (*qpn, *id);
                if st.failed.is_some() {
                    // No completion will come: the buffer stays with the queue pair.
                    st.slots.remove(i);
                    failed = true;
                } else {
                    st.slots[i] = Slot::Abandoned {
                        qpn,
                        id,
                        side,
                        qp: Arc::downgrade(qp),
                        reclaim,
                    };
                }
                None
            }
            _ => None,
        };
        if let Some(c) = done {
            drop(st);
            reclaim(qp, side, &c);
            self.free(i);
        }
        failed
    }

    /// Routes `batch` to the operations that wait for it.
    fn dispatch(&self, batch: &[Completion], wake: &mut Vec<Waker>, late: &mut Vec<Late>) {
        let mut st = self.state.lock();
        let st = &mut *st;
        for c in batch {
            let Some(i) = owner(st, c) else {
                if crate::owned::async_slot(c.wr_id).is_some() {
                    // An operation's id, but no operation waits for it: its slot was
                    // freed (its queue pair went with the request in flight) and maybe
                    // taken again. Nobody is to see it.
                    tracing::debug!(
                        wr_id = c.wr_id,
                        qpn = c.qp_num,
                        "async completion queue: a completion for an operation that is gone"
                    );
                    continue;
                }
                st.other.push_back(*c);
                if let Some(w) = st.other_waker.take() {
                    wake.push(w);
                }
                continue;
            };
            match std::mem::replace(&mut st.slots[i], Slot::Done(*c)) {
                Slot::Waiting { waker, .. } => wake.extend(waker),
                Slot::Abandoned {
                    qp, side, reclaim, ..
                } => {
                    st.slots[i] = Slot::Reclaiming;
                    late.push((i, qp, side, reclaim, *c));
                }
                Slot::Done(_) | Slot::Reclaiming => {}
            }
        }
    }

    /// Stops the driver: every waiting operation and the stream see `why`.
    fn fail(&self, why: Failure) {
        tracing::warn!(?why, "async completion queue: the driver stops");
        self.stop(why);
    }

    /// As [`fail`](Self::fail), without a warning.
    fn stop(&self, why: Failure) {
        let mut wake = Vec::new();
        let mut st = self.state.lock();
        st.failed = Some(why);
        for (_, s) in st.slots.iter_mut() {
            if let Slot::Waiting { waker, .. } = s {
                wake.extend(waker.take());
            }
        }
        // Abandoned requests get no completion now: their room goes back (their buffers
        // stay with their queue pairs), to operations waiting for it, whose posts the
        // failed queue refuses.
        let mut abandoned = Vec::new();
        st.slots.retain(|_, s| match s {
            Slot::Abandoned { qp, side, .. } => {
                abandoned.push((qp.clone(), *side));
                false
            }
            _ => true,
        });
        wake.extend(st.other_waker.take());
        drop(st);
        wake.into_iter().for_each(Waker::wake);
        for (qp, side) in abandoned {
            if let Some(qp) = qp.upgrade() {
                qp.room(side).release(&qp);
                let_go(qp);
            }
        }
    }

    /// Whether the queue has failed (no completion reaches an operation any more).
    pub(super) fn failed(&self) -> bool {
        self.state.lock().failed.is_some()
    }
}

/// Drops the driver's handle of a queue pair, taken for a moment to give back a buffer or
/// a request's room. If the application dropped its own handles meanwhile, this one is
/// the last, and the queue pair is destroyed on a blocking thread rather than on the
/// runtime's: destruction may wait for the peer (shm waits up to its drain bound for a
/// peer stopped in the middle of a copy).
fn let_go<T: Send + 'static>(handle: Arc<T>) {
    let Some(last) = Arc::into_inner(handle) else {
        return;
    };
    match ::tokio::runtime::Handle::try_current() {
        Ok(rt) => drop(rt.spawn_blocking(move || drop(last))),
        Err(_) => drop(last),
    }
}

/// The buffer of an abandoned request, to give back outside the lock.
type Late = (usize, Weak<QpShared>, Side, Reclaim, Completion);

/// Polls `cq` until it is empty; returns how many completions it routed.
fn reap(
    sh: &Shared,
    batch: &mut [Completion],
    wake: &mut Vec<Waker>,
    late: &mut Vec<Late>,
) -> Result<usize> {
    let mut total = 0;
    loop {
        let n = sh.cq.poll(batch)?;
        if n == 0 {
            break;
        }
        sh.dispatch(&batch[..n], wake, late);
        total += n;
        wake.drain(..).for_each(Waker::wake);
        for (i, qp, side, reclaim, c) in late.drain(..) {
            if let Some(qp) = qp.upgrade() {
                reclaim(&qp, side, &c);
                let_go(qp);
            }
            sh.free(i);
        }
        if n < batch.len() {
            break;
        }
    }
    Ok(total)
}

/// Fails the queue if its driver task ends without having failed it: the task was
/// dropped (its runtime shut down), and no completion would reach an operation any more.
struct DriverGone(Arc<Shared>);

impl Drop for DriverGone {
    fn drop(&mut self) {
        // (Also when the queue is dropped, which is no cause for a warning.)
        if self.0.state.lock().failed.is_none() {
            tracing::debug!("async completion queue: the driver task ended");
            self.0.stop(Failure::Io(
                std::io::ErrorKind::Other,
                "the driver task ended (its runtime shut down, or the queue was dropped)".into(),
            ));
        }
    }
}

/// The driver task.
async fn drive(sh: Arc<Shared>) {
    let mut batch = vec![Completion::default(); BATCH];
    let (mut wake, mut late) = (Vec::new(), Vec::new());
    let mut reaped = |sh: &Shared, wake: &mut Vec<Waker>, late: &mut Vec<Late>| match reap(
        sh, &mut batch, wake, late,
    ) {
        Ok(n) => Some(n),
        Err(Error::CqOverrun) => {
            sh.fail(Failure::Overrun);
            None
        }
        Err(e) => {
            sh.fail(Failure::Io(std::io::ErrorKind::Other, e.to_string()));
            None
        }
    };
    loop {
        let Some(n) = reaped(&sh, &mut wake, &mut late) else {
            return;
        };
        if n > 0 {
            // Let the woken operations run (and post their next requests) before polling
            // again and arming.
            ::tokio::task::yield_now().await;
            continue;
        }
        if sh.polling {
            // A busy-polled context moves only when polled, also as the target of the
            // peer's one-sided requests: poll for as long as the queue is awaitable.
            ::tokio::task::yield_now().await;
            continue;
        }
        sh.cq.req_notify(false);
        // A completion that came before the arm did not notify.
        match reaped(&sh, &mut wake, &mut late) {
            None => return,
            Some(0) => {}
            Some(_) => continue,
        }
        sh.cq.parts.imp.idle();
        match sh.fd.readable().await {
            Ok(mut ready) => ready.clear_ready(),
            Err(e) => {
                sh.fail(Failure::Io(e.kind(), e.to_string()));
                return;
            }
        }
        sh.cq.get_event();
    }
}

/// The slot of the operation `c` completes: the one its id names, if that slot holds the
/// request posted with that very id (slot and generation) on `c`'s queue pair.
fn owner(st: &State, c: &Completion) -> Option<usize> {
    let i = crate::owned::async_slot(c.wr_id)?;
    match st.slots.get(i)? {
        Slot::Waiting { qpn, id, .. } | Slot::Abandoned { qpn, id, .. } => {
            (*qpn == c.qp_num && *id == c.wr_id).then_some(i)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completion(wr_id: u64, qp_num: u32) -> Completion {
        Completion {
            wr_id,
            qp_num,
            ..Completion::default()
        }
    }

    /// Sends the id of the thread that drops it.
    struct DroppedOn(std::sync::mpsc::Sender<std::thread::ThreadId>);

    impl Drop for DroppedOn {
        fn drop(&mut self) {
            let _ = self.0.send(std::thread::current().id());
        }
    }

    #[test]
    fn the_driver_s_last_handle_of_a_queue_pair_is_dropped_off_the_runtime_thread() {
        let rt = ::tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime");
        let (tx, rx) = std::sync::mpsc::channel();
        let app = Arc::new(DroppedOn(tx));
        rt.block_on(async {
            // The application still holds its handle: nothing is dropped.
            let_go(app.clone());
            assert!(rx.try_recv().is_err());
            assert_eq!(Arc::strong_count(&app), 1);
        });
        let runtime_thread = std::thread::current().id();
        rt.block_on(async move {
            // The driver's handle is the last.
            let_go(app);
        });
        let dropped_on = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the queue pair is dropped");
        assert_ne!(dropped_on, runtime_thread);
    }

    #[test]
    fn a_late_completion_of_a_slot_s_earlier_use_is_not_the_later_operation_s() {
        let mut st = State::default();
        let take = |st: &mut State, qpn| {
            let entry = st.slots.vacant_entry();
            let (i, id) = (
                entry.key(),
                crate::owned::async_id(entry.key(), st.next_gen),
            );
            entry.insert(Slot::Waiting {
                qpn,
                id,
                waker: None,
            });
            st.next_gen += 1;
            (i, id)
        };
        // An operation on QP 7; its slot is freed with the request in flight (its queue
        // pair went), then taken by an operation of a new QP 7 (the number reused).
        let (i, old) = take(&mut st, 7);
        st.slots.remove(i);
        let (j, new) = take(&mut st, 7);
        assert_eq!(i, j, "the slot is used again");
        assert_ne!(old, new);
        assert_eq!(owner(&st, &completion(old, 7)), None, "the old request's");
        assert_eq!(owner(&st, &completion(new, 8)), None, "another QP's");
        assert_eq!(owner(&st, &completion(new, 7)), Some(j));
        assert_eq!(crate::owned::async_slot(new), Some(j));
    }
}
