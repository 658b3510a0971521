//! Completion queues: fixed capacity, batch polling, blocking waits, and notification
//! through a file descriptor.
//!
//! A CQ holds at most its capacity of completions. A completion that finds the CQ full is
//! lost and the CQ is *overrun*, as on an adapter (`IBV_EVENT_CQ_ERR`): from then on
//! [`poll`](CompletionQueue::poll) returns [`Error::CqOverrun`] and the queue pairs that
//! use it are moved to the error state.
//!
//! Notification follows verbs: [`req_notify`](CompletionQueue::req_notify) arms the CQ
//! (for any completion, or for solicited ones and errors only); the next matching
//! completion makes [`fd`](CompletionQueue::fd) readable once, and disarms. The descriptor
//! can be waited on with epoll, mio or tokio's `AsyncFd`;
//! [`get_event`](CompletionQueue::get_event) consumes the notification.
//! [`wait`](CompletionQueue::wait) does all of it: poll, arm, poll again, sleep.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmx_core::Completion;

use crate::provider::{CqCore, CqParts, Device};
use crate::{Error, Result};

/// A completion queue (`ibv_cq`). Cloning shares the queue.
#[derive(Clone, Debug)]
pub struct CompletionQueue {
    pub(crate) parts: Arc<CqParts>,
}

impl CompletionQueue {
    pub(crate) fn new(device: &dyn Device, capacity: usize) -> Result<CompletionQueue> {
        let core = Arc::new(CqCore::new(capacity)?);
        let imp = device.create_cq(&core)?;
        Ok(CompletionQueue {
            parts: Arc::new(CqParts { core, imp }),
        })
    }

    pub(crate) fn core(&self) -> &Arc<CqCore> {
        &self.parts.core
    }

    /// Most completions the queue holds.
    pub fn capacity(&self) -> usize {
        self.parts.core.capacity()
    }

    /// Moves up to `out.len()` completions into `out` (`ibv_poll_cq`); returns how many.
    ///
    /// Completions already queued are taken first, and the provider makes progress (on
    /// the software providers, a round of their driver) only when they do not fill
    /// `out`: an application that takes its completions one at a time from a busy queue
    /// then pays one round per batch of completions, not one per completion.
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        let core = &self.parts.core;
        let n = core.take(out)?;
        // A poll into an empty slice still makes progress (it may report an overrun).
        if n > 0 && n == out.len() {
            return Ok(n);
        }
        let more = self
            .parts
            .imp
            .progress(core)
            .and_then(|()| core.take(&mut out[n..]));
        match more {
            Ok(m) => Ok(n + m),
            // Completions already taken are returned; the error comes with the next poll.
            Err(_) if n > 0 => Ok(n),
            Err(e) => Err(e),
        }
    }

    /// Polls one completion.
    pub fn poll_one(&self) -> Result<Option<Completion>> {
        let mut one = [Completion::default()];
        Ok((self.poll(&mut one)? == 1).then_some(one[0]))
    }

    /// Waits up to `timeout` for completions and moves up to `out.len()` of them into
    /// `out`; returns how many (0 when the time ran out). Polls first, then arms the CQ,
    /// polls again (a completion that came before arming does not notify) and sleeps on
    /// the notification, so a waiting thread uses no CPU where the provider makes progress
    /// by itself. Each wake-up goes round again (poll, arm, poll), so several threads may
    /// wait on one CQ: one whose wake-up another took arms the CQ again before it sleeps.
    pub fn wait(&self, out: &mut [Completion], timeout: Duration) -> Result<usize> {
        let deadline = Instant::now() + timeout;
        loop {
            let n = self.poll(out)?;
            if n > 0 || out.is_empty() {
                return Ok(n);
            }
            self.req_notify(false);
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return self.poll(out);
            }
            self.sleep_once(left)?;
        }
    }

    /// Consumes a notification if there is one; else sleeps until the descriptor is
    /// readable or `left` has passed (a slice of it where completions move only when
    /// someone polls, after which it polls the provider).
    fn sleep_once(&self, left: Duration) -> Result<()> {
        if self.get_event() {
            return Ok(());
        }
        let slice = self.polling_slice();
        if slice.is_none() {
            self.parts.imp.idle();
        }
        wait_readable(self.fd(), slice.map_or(left, |s| s.min(left)))
            .map_err(|e| Error::Io("poll", e))?;
        if slice.is_some() {
            self.parts.imp.progress(&self.parts.core)?;
        }
        Ok(())
    }

    /// How long a waiter sleeps before it polls, where completions move only when someone
    /// polls (loopback, busy-polled contexts).
    fn polling_slice(&self) -> Option<Duration> {
        self.parts
            .imp
            .needs_polling()
            .then_some(Duration::from_millis(1))
    }

    /// Arms notification (`ibv_req_notify_cq`): the next completion (or, with
    /// `solicited_only`, the next solicited or error completion) makes the descriptor
    /// readable.
    pub fn req_notify(&self, solicited_only: bool) {
        self.parts.imp.req_notify(&self.parts.core, solicited_only);
    }

    /// The notification descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        let fd = self
            .parts
            .imp
            .fd()
            .unwrap_or_else(|| self.parts.core.event_fd());
        // SAFETY: both candidate descriptors live as long as the CQ, which `self` borrows.
        unsafe { BorrowedFd::borrow_raw(fd) }
    }

    /// Makes the notification descriptor readable as a completion would, without adding
    /// one: a thread sleeping in [`wait_event`](Self::wait_event) (or in `poll(2)` on
    /// [`fd`](Self::fd)) wakes and finds no completion. For a thread that waits for
    /// completions and for work from other threads alike (it arms, polls, then sleeps in
    /// `wait_event`), such as a transfer engine's worker. [`wait`](Self::wait) itself
    /// sleeps on until a completion or its timeout.
    pub fn wake(&self) {
        self.parts.core.wake();
    }

    /// Consumes a notification (`ibv_get_cq_event`); returns whether there was one.
    pub fn get_event(&self) -> bool {
        self.parts.imp.get_event(&self.parts.core)
    }

    /// Waits up to `timeout` for the notification [`req_notify`](Self::req_notify) armed,
    /// and consumes it as [`get_event`](Self::get_event) does; returns whether there was
    /// one. The usual order is: poll until empty, arm, poll once more (a completion that
    /// came before arming does not notify), then wait. Where completions only move when
    /// someone polls (loopback, busy-polled contexts) the wait polls in short slices
    /// itself, taking no completions.
    pub fn wait_event(&self, timeout: Duration) -> Result<bool> {
        let start = Instant::now();
        let slice = self.polling_slice();
        loop {
            if self.get_event() {
                return Ok(true);
            }
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Ok(false);
            }
            if slice.is_none() {
                self.parts.imp.idle();
            }
            let wait = slice.map_or(left, |s| s.min(left));
            wait_readable(self.fd(), wait).map_err(|e| Error::Io("poll", e))?;
            if slice.is_some() {
                self.parts.imp.progress(&self.parts.core)?;
            }
        }
    }
}

/// Waits until `fd` is readable (or hung up) or `timeout` has passed, rounded up to a
/// millisecond; returns whether it is. A wait a signal interrupted returns `Ok(false)`,
/// as one that timed out: callers loop on their own deadline.
pub(crate) fn wait_readable(fd: BorrowedFd<'_>, timeout: Duration) -> std::io::Result<bool> {
    let ms = i32::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `pfd` is one valid pollfd for the duration of the call.
    match unsafe { libc::poll(&mut pfd, 1, ms) } {
        n if n > 0 => Ok(true),
        0 => Ok(false),
        _ => {
            let e = std::io::Error::last_os_error();
            match e.kind() {
                std::io::ErrorKind::Interrupted => Ok(false),
                _ => Err(e),
            }
        }
    }
}
