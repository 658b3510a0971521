//! The provider-independent part of every completion queue: a bounded queue of
//! completions, overrun detection, and notification through an eventfd.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use rdmx_core::{Completion, WcStatus};

use crate::owned::{self, side_of, Side};

use crate::{Error, Result};

/// Completions waiting to be polled, shared by a CQ and the queue pairs that complete to it.
#[derive(Debug)]
pub(crate) struct CqCore {
    state: Mutex<CqState>,
    /// Whether `take` has anything to find (completions, or an overrun to report): a poll
    /// of an empty queue reads this and skips the lock. Changed only under the lock.
    ready: AtomicBool,
    capacity: usize,
    event: OwnedFd,
}

#[derive(Debug)]
struct CqState {
    entries: VecDeque<Completion>,
    overrun: bool,
    /// Armed: `Some(solicited_only)`.
    armed: Option<bool>,
    /// Owned-buffer requests whose completions are watched for, by (QP number, the
    /// reserved id the provider has, queue): how many are still awaited, how many were
    /// seen and not yet taken, and the id the application posted it with, which the
    /// completion is given back. A send and a receive may share an id: a completion counts
    /// for its own queue only (receives complete with a receive opcode, errors included).
    watched: HashMap<(u32, u64, Side), Watch>,
}

impl CqCore {
    pub(crate) fn new(capacity: usize) -> Result<CqCore> {
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
        Ok(CqCore {
            state: Mutex::new(CqState {
                entries: VecDeque::with_capacity(capacity.min(4096)),
                overrun: false,
                armed: None,
                watched: HashMap::new(),
            }),
            ready: AtomicBool::new(false),
            capacity,
            event,
        })
    }

    /// Most completions the queue holds.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Adds a completion; returns false when the queue was full (now overrun).
    pub(crate) fn push(&self, mut c: Completion, solicited: bool) -> bool {
        let mut st = self.state.lock();
        if st.overrun || st.entries.len() >= self.capacity {
            st.overrun = true;
            self.ready.store(true, Ordering::Release);
            // The overrun is an event an armed queue reports, whatever it was armed for
            // (`IBV_EVENT_CQ_ERR`): a waiter wakes and its poll says so.
            if st.armed.take().is_some() {
                self.notify();
            }
            return false;
        }
        if !st.watched.is_empty() && owned::is_reserved(c.wr_id) {
            if let Some(w) = st.watched.get_mut(&(c.qp_num, c.wr_id, side_of(&c))) {
                if w.awaited > 0 {
                    w.awaited -= 1;
                    w.seen += 1;
                }
                c.wr_id = w.wr_id;
            }
        }
        st.entries.push_back(c);
        self.ready.store(true, Ordering::Release);
        if let Some(only_solicited) = st.armed {
            if !only_solicited || solicited || c.status != WcStatus::Success {
                st.armed = None;
                self.notify();
            }
        }
        true
    }

    /// Makes the eventfd readable as a notification would (see
    /// [`CompletionQueue::wake`](crate::CompletionQueue::wake)).
    pub(crate) fn wake(&self) {
        self.notify();
    }

    fn notify(&self) {
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

    /// Moves up to `out.len()` completions into `out`.
    pub(crate) fn take(&self, out: &mut [Completion]) -> Result<usize> {
        if !self.ready.load(Ordering::Acquire) {
            return Ok(0);
        }
        let mut st = self.state.lock();
        if st.overrun {
            return Err(Error::CqOverrun);
        }
        let n = out.len().min(st.entries.len());
        for (slot, c) in out.iter_mut().zip(st.entries.drain(..n)) {
            *slot = c;
        }
        if st.entries.is_empty() {
            self.ready.store(false, Ordering::Relaxed);
        }
        Ok(n)
    }

    /// Arms notification for the next completion (or solicited/error one).
    pub(crate) fn arm(&self, solicited_only: bool) {
        self.state.lock().armed = Some(solicited_only);
    }

    /// Arms for error completions only: the adapter notifies the rest itself.
    pub(crate) fn arm_errors_only(&self, on: bool) {
        self.state.lock().armed = on.then_some(true);
    }

    /// Disarms.
    pub(crate) fn disarm(&self) {
        self.state.lock().armed = None;
    }

    /// The eventfd.
    pub(crate) fn event_fd(&self) -> RawFd {
        self.event.as_raw_fd()
    }

    /// Consumes an eventfd notification; returns whether there was one.
    pub(crate) fn read_event(&self) -> bool {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into `v` from our own non-blocking eventfd.
        let n = unsafe {
            libc::read(
                self.event.as_raw_fd(),
                (&mut v as *mut u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
        n == 8
    }

    /// Watches for the completion of request `id` (reserved) on QP `qpn`'s queue `side`
    /// (an owned-buffer post the application named `wr_id`).
    pub(crate) fn watch(&self, qpn: u32, id: u64, side: Side, wr_id: u64) {
        let mut st = self.state.lock();
        let w = st.watched.entry((qpn, id, side)).or_default();
        w.awaited += 1;
        w.wr_id = wr_id;
    }

    /// Stops watching `wr_id` on `qpn` (its post failed).
    pub(crate) fn unwatch(&self, qpn: u32, wr_id: u64, side: Side) {
        let mut st = self.state.lock();
        if let Entry::Occupied(mut e) = st.watched.entry((qpn, wr_id, side)) {
            let w = e.get_mut();
            if w.awaited > 0 {
                w.awaited -= 1;
            } else {
                w.seen = w.seen.saturating_sub(1);
            }
            if w.awaited == 0 && w.seen == 0 {
                e.remove();
            }
        }
    }

    /// Watches again for a completion that was already seen.
    pub(crate) fn rewatch_seen(&self, qpn: u32, wr_id: u64, side: Side) {
        self.state
            .lock()
            .watched
            .entry((qpn, wr_id, side))
            .or_default()
            .seen += 1;
    }

    /// If the completion of watched request `wr_id` on `qpn` has arrived, stops watching it
    /// and returns true.
    pub(crate) fn take_watched(&self, qpn: u32, wr_id: u64, side: Side) -> bool {
        let mut st = self.state.lock();
        match st.watched.entry((qpn, wr_id, side)) {
            Entry::Occupied(mut e) if e.get().seen > 0 => {
                let w = e.get_mut();
                w.seen -= 1;
                if w.awaited == 0 && w.seen == 0 {
                    e.remove();
                }
                true
            }
            _ => false,
        }
    }
}

/// The watched requests of one (QP number, request id, queue).
#[derive(Debug, Default)]
struct Watch {
    awaited: u32,
    seen: u32,
    /// The id the application posted the request with.
    wr_id: u64,
}
