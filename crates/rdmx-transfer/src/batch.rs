//! Batches: READ and WRITE requests built against open segments, submitted together and
//! followed request by request; an optional notification the peer receives once every
//! byte of the batch is in place.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use rdmx::WcStatus;

use crate::error::{Error, Result};
use crate::path::Conn;
use crate::segment::{resolve, LocalBuf, Segment, Target};
use crate::wire::SegmentDesc;

/// READ (peer → local buffer) or WRITE (local buffer → peer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Copy from the peer's segment into the local buffer.
    Read,
    /// Copy from the local buffer into the peer's segment.
    Write,
}

/// Why a request failed: the work-completion status (when a completion said so), the
/// path it failed on last, and in words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// The work-completion status, if the failure came from a completion.
    pub status: Option<WcStatus>,
    /// The path (rail, queue pair, peer) it failed on last.
    pub path: String,
    /// What happened.
    pub reason: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (path {}", self.reason, self.path)?;
        if let Some(s) = self.status {
            write!(f, ", status {s:?}")?;
        }
        f.write_str(")")
    }
}

/// Where one request is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestStatus {
    /// Submitted, no slice posted yet.
    Waiting,
    /// Some slices posted.
    InFlight,
    /// Every byte moved.
    Completed {
        /// Bytes moved.
        bytes: u64,
    },
    /// Failed on every path it was tried on, or timed out.
    Failed(Failure),
}

/// Where a whole batch is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchStatus {
    /// Requests completed.
    pub completed: usize,
    /// Requests failed.
    pub failed: usize,
    /// Requests not finished.
    pub pending: usize,
    /// Bytes moved by completed requests.
    pub bytes: u64,
    /// The notification: `None` if the batch carries none or it is not sent yet,
    /// `Some(Ok(()))` once the peer has it, `Some(Err(why))` if it was not delivered.
    pub notified: Option<std::result::Result<(), String>>,
    /// Whether everything (requests and notification) is finished.
    pub done: bool,
}

impl BatchStatus {
    /// Finished, with every request completed (and the notification delivered).
    pub fn is_success(&self) -> bool {
        self.done && self.failed == 0 && !matches!(self.notified, Some(Err(_)))
    }
}

pub(crate) const WAITING: u8 = 0;
pub(crate) const IN_FLIGHT: u8 = 1;
pub(crate) const COMPLETED: u8 = 2;
pub(crate) const FAILED: u8 = 3;

/// One request, as the workers see it.
pub(crate) struct Req {
    pub(crate) op: Op,
    pub(crate) local: LocalBuf,
    pub(crate) local_off: u64,
    pub(crate) conn: Arc<Conn>,
    pub(crate) desc: Arc<SegmentDesc>,
    pub(crate) rbuf: u32,
    pub(crate) roff: u64,
    pub(crate) len: u64,
    pub(crate) state: AtomicU8,
    pub(crate) slices_left: AtomicU32,
    pub(crate) bytes: AtomicU64,
    pub(crate) failure: OnceLock<Failure>,
}

/// A batch under way.
pub(crate) struct BatchState {
    pub(crate) reqs: Box<[Req]>,
    left: AtomicUsize,
    failed: AtomicUsize,
    pub(crate) notify: Option<Arc<[u8]>>,
    notified: OnceLock<std::result::Result<(), String>>,
    notify_left: AtomicUsize,
    done: Mutex<bool>,
    cv: Condvar,
}

impl BatchState {
    /// Request `i` moved `len` more bytes; returns whether the batch's requests are all
    /// finished now (the caller then sends the notification).
    pub(crate) fn slice_done(&self, i: usize, len: u64) -> bool {
        let r = &self.reqs[i];
        r.bytes.fetch_add(len, Ordering::Relaxed);
        if r.slices_left.fetch_sub(1, Ordering::AcqRel) == 1
            && r.state
                .compare_exchange(IN_FLIGHT, COMPLETED, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            return self.req_finished();
        }
        false
    }

    /// Fails request `i` (once); returns whether the batch's requests are all finished.
    pub(crate) fn fail(&self, i: usize, f: Failure) -> bool {
        let r = &self.reqs[i];
        let mut cur = r.state.load(Ordering::Acquire);
        loop {
            if cur == COMPLETED || cur == FAILED {
                return false;
            }
            match r
                .state
                .compare_exchange(cur, FAILED, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(c) => cur = c,
            }
        }
        tracing::debug!(request = i, failure = %f, "transfer request failed");
        let _ = r.failure.set(f);
        self.failed.fetch_add(1, Ordering::Relaxed);
        self.req_finished()
    }

    pub(crate) fn is_finished(&self, i: usize) -> bool {
        self.reqs[i].state.load(Ordering::Acquire) >= COMPLETED
    }

    fn req_finished(&self) -> bool {
        if self.left.fetch_sub(1, Ordering::AcqRel) != 1 {
            return false;
        }
        if self.notify.is_none() {
            self.finish();
            return false;
        }
        if self.failed.load(Ordering::Acquire) > 0 {
            let _ = self
                .notified
                .set(Err("not sent: a request of the batch failed".into()));
            self.finish();
            return false;
        }
        true
    }

    /// The notifications are about to go out to `n` peers.
    pub(crate) fn notifying(&self, n: usize) {
        self.notify_left.store(n, Ordering::Release);
        if n == 0 {
            let _ = self.notified.set(Ok(()));
            self.finish();
        }
    }

    /// One peer's notification finished.
    pub(crate) fn notify_done(&self, res: std::result::Result<(), String>) {
        if let Err(e) = res {
            let _ = self.notified.set(Err(e));
        }
        if self.notify_left.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _ = self.notified.set(Ok(()));
            self.finish();
        }
    }

    fn finish(&self) {
        *self.done.lock() = true;
        self.cv.notify_all();
    }

    /// The distinct connections the batch touches.
    pub(crate) fn conns(&self) -> Vec<Arc<Conn>> {
        let mut out: Vec<Arc<Conn>> = Vec::new();
        for r in self.reqs.iter() {
            if !out.iter().any(|c| Arc::ptr_eq(c, &r.conn)) {
                out.push(r.conn.clone());
            }
        }
        out
    }
}

/// A batch being built: requests, and perhaps a notification.
#[derive(Default)]
pub struct Batch {
    pub(crate) reqs: Vec<Req>,
    pub(crate) notify: Option<Arc<[u8]>>,
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("requests", &self.reqs.len())
            .field("notify", &self.notify.as_ref().map(|n| n.len()))
            .finish()
    }
}

impl Batch {
    /// An empty batch.
    pub fn new() -> Batch {
        Batch::default()
    }

    /// An empty batch with room for `n` requests.
    pub fn with_capacity(n: usize) -> Batch {
        Batch {
            reqs: Vec::with_capacity(n),
            notify: None,
        }
    }

    /// Requests so far.
    pub fn len(&self) -> usize {
        self.reqs.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    /// Adds a WRITE of `len` bytes from `local` at `local_off` to `target` in `seg`.
    pub fn write(
        &mut self,
        local: (&LocalBuf, u64),
        seg: &Segment,
        target: Target<'_>,
        len: u64,
    ) -> Result<&mut Self> {
        self.push(Op::Write, local, seg, target, len)
    }

    /// Adds a READ of `len` bytes from `target` in `seg` into `local` at `local_off`.
    pub fn read(
        &mut self,
        local: (&LocalBuf, u64),
        seg: &Segment,
        target: Target<'_>,
        len: u64,
    ) -> Result<&mut Self> {
        self.push(Op::Read, local, seg, target, len)
    }

    /// Adds a request; checked now against both sides' bounds and the peer's access.
    pub fn push(
        &mut self,
        op: Op,
        (local, local_off): (&LocalBuf, u64),
        seg: &Segment,
        target: Target<'_>,
        len: u64,
    ) -> Result<&mut Self> {
        if len == 0 || len > u32::MAX as u64 * 4096 {
            return Err(Error::Invalid(format!("a request of {len} bytes")));
        }
        if local_off.checked_add(len).map_or(true, |e| e > local.len()) {
            return Err(Error::Invalid(format!(
                "{len} bytes at {local_off} overrun local buffer {:?} ({} bytes)",
                local.name(),
                local.len()
            )));
        }
        if op == Op::Read && !local.inner.access.contains(rdmx::Access::LOCAL_WRITE) {
            return Err(Error::Invalid(format!(
                "local buffer {:?} is not writable",
                local.name()
            )));
        }
        let desc = seg.conn.desc.read().clone();
        let (rbuf, roff) = resolve(&desc, target, len, op == Op::Write)?;
        self.reqs.push(Req {
            op,
            local: local.clone(),
            local_off,
            conn: seg.conn.clone(),
            desc,
            rbuf,
            roff,
            len,
            state: AtomicU8::new(WAITING),
            slices_left: AtomicU32::new(0),
            bytes: AtomicU64::new(0),
            failure: OnceLock::new(),
        });
        Ok(self)
    }

    /// Attaches a notification (at most [`MAX_NOTIFY`](crate::MAX_NOTIFY) bytes) that every
    /// peer the batch touches receives once all of the batch's bytes are in place.
    pub fn notify(&mut self, msg: &[u8]) -> Result<&mut Self> {
        if msg.len() > crate::MAX_NOTIFY {
            return Err(Error::Invalid(format!(
                "a notification of {} bytes (at most {})",
                msg.len(),
                crate::MAX_NOTIFY
            )));
        }
        self.notify = Some(msg.into());
        Ok(self)
    }

    pub(crate) fn into_state(self) -> Arc<BatchState> {
        let n = self.reqs.len();
        let notifies = self.notify.is_some();
        Arc::new(BatchState {
            reqs: self.reqs.into_boxed_slice(),
            left: AtomicUsize::new(n),
            failed: AtomicUsize::new(0),
            notify: self.notify,
            notified: OnceLock::new(),
            notify_left: AtomicUsize::new(0),
            // An empty batch is done at once, unless it carries a notification: then when
            // that is delivered.
            done: Mutex::new(n == 0 && !notifies),
            cv: Condvar::new(),
        })
    }
}

/// A submitted batch: follow it with [`check`](Self::check), [`wait`](Self::wait) and
/// [`status`](Self::status).
#[derive(Clone)]
pub struct BatchHandle {
    pub(crate) state: Arc<BatchState>,
}

impl std::fmt::Debug for BatchHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchHandle")
            .field("status", &self.check())
            .finish()
    }
}

impl BatchHandle {
    /// The status of request `i` (in the order they were added).
    pub fn status(&self, i: usize) -> Option<RequestStatus> {
        let r = self.state.reqs.get(i)?;
        Some(match r.state.load(Ordering::Acquire) {
            WAITING => RequestStatus::Waiting,
            IN_FLIGHT => RequestStatus::InFlight,
            COMPLETED => RequestStatus::Completed {
                bytes: r.bytes.load(Ordering::Relaxed),
            },
            _ => RequestStatus::Failed(r.failure.get().cloned().unwrap_or_else(|| Failure {
                status: None,
                path: String::new(),
                reason: "failed".into(),
            })),
        })
    }

    /// Requests in the batch.
    pub fn len(&self) -> usize {
        self.state.reqs.len()
    }

    /// Whether the batch has no requests.
    pub fn is_empty(&self) -> bool {
        self.state.reqs.is_empty()
    }

    /// The batch's status now, without waiting.
    pub fn check(&self) -> BatchStatus {
        let done = *self.state.done.lock();
        let mut s = BatchStatus {
            completed: 0,
            failed: 0,
            pending: 0,
            bytes: 0,
            notified: self.state.notified.get().cloned(),
            done,
        };
        for r in self.state.reqs.iter() {
            match r.state.load(Ordering::Acquire) {
                COMPLETED => {
                    s.completed += 1;
                    s.bytes += r.bytes.load(Ordering::Relaxed);
                }
                FAILED => s.failed += 1,
                _ => s.pending += 1,
            }
        }
        s
    }

    /// Waits up to `timeout` for the batch (and its notification) to finish; returns its
    /// status, or [`Error::Timeout`] if it is still under way (it goes on).
    pub fn wait(&self, timeout: Duration) -> Result<BatchStatus> {
        let deadline = Instant::now() + timeout;
        let mut done = self.state.done.lock();
        while !*done {
            if self.state.cv.wait_until(&mut done, deadline).timed_out() && !*done {
                return Err(Error::Timeout(format!(
                    "the batch is still under way after {timeout:?}"
                )));
            }
        }
        drop(done);
        Ok(self.check())
    }

    /// Whether the batch has finished.
    pub fn is_done(&self) -> bool {
        *self.state.done.lock()
    }
}
