//! Completion queues: fixed capacity, batch polling, and notification through a file
//! descriptor.
//!
//! A CQ holds at most its capacity of completions. A completion that finds the CQ full is
//! lost and the CQ is *overrun*, as on an adapter (`IBV_EVENT_CQ_ERR`): from then on
//! [`poll`](CompletionQueue::poll) returns [`Error::CqOverrun`] and the queue pairs that
//! use it are moved to the error state.
//!
//! Notification follows verbs: [`req_notify`](CompletionQueue::req_notify) arms the CQ
//! (for any completion, or for solicited ones and errors only); the next matching
//! completion makes [`fd`](CompletionQueue::fd) readable once, and disarms. The descriptor
//! is an eventfd that epoll, mio or tokio's `AsyncFd` can wait on;
//! [`get_event`](CompletionQueue::get_event) consumes the notification.

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use parking_lot::Mutex;
use rdmx_core::{Completion, WcStatus};

use crate::{Error, Result};

/// A completion queue (`ibv_cq`). Cloning shares the queue.
#[derive(Clone, Debug)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
}

#[derive(Debug)]
pub(crate) struct CqInner {
    state: Mutex<CqState>,
    capacity: usize,
    event: OwnedFd,
    progress: Progress,
}

/// What polling the CQ does besides taking completions.
#[derive(Debug)]
pub(crate) enum Progress {
    /// Pump the loopback fabric.
    Loopback,
    /// Run a busy-polled tcp driver once.
    Tcp(std::sync::Arc<crate::tcp::Driver>),
    /// Nothing: a progress thread makes progress.
    Background,
    /// Move the adapter CQ's completions in.
    #[cfg(feature = "verbs")]
    Verbs(crate::verbs::Cq),
}

/// Moves an engine's completions to its CQs; an overrun CQ puts the QP in error.
/// Returns whether any completion moved.
pub(crate) fn route_completions<M: rdmx_core::rc::MemAccess>(
    engine: &mut rdmx_core::rc::RcQp<M>,
    send_cq: &CompletionQueue,
    recv_cq: &CompletionQueue,
) -> bool {
    let mut moved = false;
    while let Some((side, c, solicited)) = engine.poll_completion() {
        moved = true;
        let cq = match side {
            rdmx_core::rc::CqSide::Send => send_cq,
            rdmx_core::rc::CqSide::Recv => recv_cq,
        };
        if !cq.inner.push(c, solicited) && engine.state() != rdmx_core::QpState::Err {
            let attr = rdmx_core::QpAttr {
                qp_state: rdmx_core::QpState::Err,
                ..rdmx_core::QpAttr::default()
            };
            let _ = engine.modify(&attr, rdmx_core::QpAttrMask::STATE);
        }
    }
    moved
}

#[derive(Debug)]
struct CqState {
    entries: VecDeque<Completion>,
    overrun: bool,
    armed: Option<bool>,
}

impl CompletionQueue {
    pub(crate) fn new(capacity: usize, progress: Progress) -> Result<CompletionQueue> {
        if capacity == 0 {
            return Err(Error::InvalidArgument(
                "a completion queue needs capacity ≥ 1",
            ));
        }
        // SAFETY: eventfd takes an initial value and flags and returns a new descriptor.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(Error::Io("eventfd", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        let event = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                state: Mutex::new(CqState {
                    entries: VecDeque::with_capacity(capacity.min(4096)),
                    overrun: false,
                    armed: None,
                }),
                capacity,
                event,
                progress,
            }),
        })
    }

    /// A CQ over an adapter CQ of `dev`.
    #[cfg(feature = "verbs")]
    pub(crate) fn new_verbs(
        capacity: usize,
        dev: &Arc<crate::verbs::Device>,
    ) -> Result<CompletionQueue> {
        let mut cq = Self::new(capacity, Progress::Background)?;
        let hw = crate::verbs::Cq::create(dev, capacity, cq.inner.event.as_raw_fd())?;
        Arc::get_mut(&mut cq.inner).expect("a new CQ").progress = Progress::Verbs(hw);
        Ok(cq)
    }

    /// verbs: the adapter CQ.
    #[cfg(feature = "verbs")]
    pub(crate) fn verbs(&self) -> Option<&crate::verbs::Cq> {
        match &self.inner.progress {
            Progress::Verbs(hw) => Some(hw),
            _ => None,
        }
    }

    /// Most completions the queue holds.
    pub fn capacity(&self) -> usize {
        self.inner.capacity
    }

    /// Moves up to `out.len()` completions into `out` (`ibv_poll_cq`); returns how many.
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        match &self.inner.progress {
            Progress::Loopback => crate::loopback::progress(),
            Progress::Tcp(d) => d.progress(Some(std::time::Duration::ZERO)),
            Progress::Background => {}
            #[cfg(feature = "verbs")]
            Progress::Verbs(hw) => hw.drain(|c| {
                self.inner.push(c, false);
            })?,
        }
        let mut st = self.inner.state.lock();
        if st.overrun {
            return Err(Error::CqOverrun);
        }
        let n = out.len().min(st.entries.len());
        for (slot, c) in out.iter_mut().zip(st.entries.drain(..n)) {
            *slot = c;
        }
        Ok(n)
    }

    /// Polls one completion.
    pub fn poll_one(&self) -> Result<Option<Completion>> {
        let mut one = [EMPTY];
        Ok((self.poll(&mut one)? == 1).then_some(one[0]))
    }

    /// Arms notification (`ibv_req_notify_cq`): the next completion (or, with
    /// `solicited_only`, the next solicited or error completion) makes the descriptor
    /// readable.
    pub fn req_notify(&self, solicited_only: bool) {
        #[cfg(feature = "verbs")]
        if let Progress::Verbs(hw) = &self.inner.progress {
            // The adapter notifies; the rdmx side only adds error completions in
            // solicited-only mode, which not every adapter reports (rxe does not).
            self.inner.state.lock().armed = solicited_only.then_some(true);
            if let Err(e) = hw.req_notify(solicited_only) {
                tracing::warn!(error = %e, "verbs: arming the CQ failed");
            }
            return;
        }
        self.inner.state.lock().armed = Some(solicited_only);
    }

    /// The notification descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        #[cfg(feature = "verbs")]
        if let Progress::Verbs(hw) = &self.inner.progress {
            // SAFETY: the epoll descriptor lives as long as the CQ, which `self` borrows.
            return unsafe { BorrowedFd::borrow_raw(hw.fd()) };
        }
        self.inner.event.as_fd()
    }

    /// Consumes a notification (`ibv_get_cq_event`); returns whether there was one.
    pub fn get_event(&self) -> bool {
        #[cfg(feature = "verbs")]
        if let Progress::Verbs(hw) = &self.inner.progress {
            let adapter = hw.take_events();
            if adapter {
                self.inner.state.lock().armed = None;
            }
            return self.read_event() | adapter;
        }
        self.read_event()
    }

    /// Waits up to `timeout` for the notification [`req_notify`](Self::req_notify) armed,
    /// and consumes it as [`get_event`](Self::get_event) does; returns whether there was
    /// one. The usual order is: poll until empty, arm, poll once more (a completion that
    /// came before arming does not notify), then wait. Where completions only move when
    /// someone polls (loopback, busy-polled contexts) the wait polls in short slices
    /// itself, taking no completions.
    pub fn wait_event(&self, timeout: std::time::Duration) -> Result<bool> {
        let start = std::time::Instant::now();
        let slice = match &self.inner.progress {
            Progress::Loopback | Progress::Tcp(_) => Some(std::time::Duration::from_millis(1)),
            _ => None,
        };
        loop {
            if self.get_event() {
                return Ok(true);
            }
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Ok(false);
            }
            let wait = slice.map_or(left, |s| s.min(left));
            let ms = i32::try_from(wait.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
            let mut pfd = libc::pollfd {
                fd: self.fd().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: `pfd` is one valid pollfd for the duration of the call.
            if unsafe { libc::poll(&mut pfd, 1, ms) } < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(Error::Io("poll", e));
                }
            }
            if slice.is_some() {
                self.poll(&mut [])?;
            }
        }
    }

    fn read_event(&self) -> bool {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into `v` from our own non-blocking eventfd.
        let n = unsafe {
            libc::read(
                self.inner.event.as_raw_fd(),
                (&mut v as *mut u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
        n == 8
    }
}

impl CqInner {
    /// Adds a completion; returns false when the queue was full (now overrun).
    pub(crate) fn push(&self, c: Completion, solicited: bool) -> bool {
        let mut st = self.state.lock();
        if st.overrun || st.entries.len() >= self.capacity {
            st.overrun = true;
            return false;
        }
        st.entries.push_back(c);
        if let Some(only_solicited) = st.armed {
            if !only_solicited || solicited || c.status != WcStatus::Success {
                st.armed = None;
                let one = 1u64;
                // SAFETY: writes 8 bytes from `one` to our own eventfd.
                let _ = unsafe {
                    libc::write(
                        self.event.as_raw_fd(),
                        (&one as *const u64).cast(),
                        std::mem::size_of::<u64>(),
                    )
                };
            }
        }
        true
    }
}

const EMPTY: Completion = Completion {
    wr_id: 0,
    status: WcStatus::Success,
    opcode: rdmx_core::WcOpcode::Send,
    byte_len: 0,
    imm_data: None,
    qp_num: 0,
};
