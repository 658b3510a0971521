//! Automatic invalidation: a process-wide userfaultfd monitor that reports memory going
//! away.
//!
//! A registration cache is keyed by virtual address. When the application unmaps a buffer
//! and later maps new memory at the same address, a cached registration for that address
//! describes pages that no longer exist there; handing it out would let an adapter read or
//! write the old pages. This module tells the cache when memory goes away, so that never
//! happens.
//!
//! # How
//!
//! One userfaultfd descriptor serves the whole process ([`global`]). The cache asks the
//! monitor to watch every range it registers ([`watch_while`](Monitor::watch_while)),
//! for as long as it caches the registration: the kernel splits memory areas where a
//! watched range begins and ends, and pages no holder watches any more are unwatched so
//! that they can join again (watches are counted per page). Ranges are registered with
//! `UFFDIO_REGISTER_MODE_WP` only, never `MODE_MISSING`, and no page is ever
//! write-protected, so no page fault is ever delivered to the monitor and touching watched
//! memory costs nothing extra. What the monitor does receive are the non-cooperative events
//! it asked for, and nothing else (`EVENT_FORK` is not enabled, so a forked child simply
//! loses the registration):
//!
//! - `UNMAP`: `munmap`, an `mmap(MAP_FIXED)` over the range, `mremap` shrinking it, `brk`
//!   shrinking the heap (which is how `free` trims the main heap);
//! - `REMOVE`: `madvise` with `MADV_DONTNEED`, `MADV_FREE` or `MADV_REMOVE` (which is how
//!   `free` trims thread arenas);
//! - `REMAP`: `mremap` moving the range (the old range is reported, on Linux 6.18 once as
//!   `REMAP` and once as `UNMAP`; the new location stays watched).
//!
//! Every such range is handed to every subscribed [`InvalidationSink`].
//!
//! # The race and the protocol that closes it
//!
//! The kernel makes the thread calling `munmap`/`madvise`/`mremap` wait until the monitor
//! has *read* the event from the descriptor, not until anyone acted on it. Without more
//! care this is possible: `munmap` returns, the application maps new memory at the same
//! address and asks the cache for a registration, and the cache still holds the old entry
//! because the monitor has read the event but not yet delivered it. The protocol:
//!
//! 1. The reader thread `poll`s the descriptor for `POLLIN` (with a timeout, so it never
//!    sleeps unboundedly).
//! 2. It counts a new round as started (`started += 1`, `SeqCst`) **before** reading.
//! 3. It reads every available event (the descriptor is non-blocking) and queues the
//!    ranges for delivery, followed by the round itself.
//! 4. Each range is delivered to every live sink (the subscriber list is copied out of
//!    its lock first; dead `Weak`s are dropped).
//! 5. Only then is the round counted as finished (`finished += 1`, `SeqCst`). Rounds finish
//!    in the order they started.
//!
//! `pending = started - finished`; [`Monitor::busy`] is `pending != 0`. Once `munmap` has
//! returned, its event has been read, so either its round is still pending or the range
//! has been delivered. The cache therefore checks [`busy`](Monitor::busy) after every lookup
//! hit; if it is set, the cache releases its lock, calls [`wait_idle`](Monitor::wait_idle)
//! and looks up again. A hit seen while the monitor is idle cannot be stale.
//!
//! [`wait_idle`](Monitor::wait_idle) waits for the rounds started before it was called, not
//! for a moment when nothing is pending, so a stream of unrelated `munmap`s cannot starve
//! it. After it returns, every `munmap` that returned before the lookup began has been
//! delivered; the second lookup's result can be used even if [`busy`](Monitor::busy) is set
//! again (anything newer raced with the lookup itself, which the application cannot rely
//! on anyway).
//!
//! # Two threads, and why
//!
//! Reading and delivering happen on two daemon threads that live for the whole process:
//! `rdmx-uffd` reads, `rdmx-uffd-sink` calls the sinks. Sinks take their own locks, and a
//! thread holding such a lock may itself unmap watched memory, directly or without knowing
//! it (`free` trimming the heap with `brk` or `madvise`). That thread then waits in the
//! kernel until the event is read; if the same thread that reads were waiting for the lock
//! inside a sink, neither would ever proceed. The reader therefore never waits for anything
//! a blocked thread could hold: it takes no lock but a short queue lock that the delivery
//! thread never holds across a call, and after start-up it frees no memory (a `free` can
//! trim the heap, which would wait for the reader itself). Its queue is bounded: when it is
//! full, further ranges are merged into the last queued one, which invalidates more than
//! needed but never less. Sinks may take locks and may even unmap watched memory.
//!
//! # Fallback
//!
//! When the process may not create a userfaultfd descriptor (unprivileged with
//! `vm.unprivileged_userfaultfd=0` on a kernel without user-mode-only descriptors, no
//! access to `/dev/userfaultfd`, seccomp) or the kernel lacks the events or the
//! write-protect register mode, [`global`] returns [`Unavailable`], whose message says why
//! and how to enable the monitor. The cache then relies on explicit `invalidate()` calls.
//! Likewise, [`Monitor::watch`] fails for memory the kernel will not watch (file-backed
//! mappings on disk filesystems, for example); the cache must not rely on automatic
//! invalidation for those ranges.
//!
//! # Limits
//!
//! `REMOVE` is reported *before* the kernel drops the pages (the `madvise` caller waits for
//! the read, then zaps). Memory whose pages change without any of the three events
//! (`fallocate(PUNCH_HOLE)` on a shared-memory file, for instance) is not reported. Every
//! `munmap` of watched memory costs a round trip to the reader thread (tens of
//! microseconds) before it returns.

use std::cell::Cell;
use std::fmt;
use std::io;
use std::os::fd::AsRawFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::ranges::RangeCounts;
use crate::sys;

mod open;
mod uffd;
mod watch;

use open::{open_uffd, probe_write_protect};
use uffd::{Event, EventBuffer, Uffd};
pub use watch::Watched;

/// Something that must forget about memory that went away, such as a registration cache.
pub trait InvalidationSink: Send + Sync + 'static {
    /// Called on the monitor's delivery thread for every range `[start, end)` that went
    /// away.
    ///
    /// The range may be wider than what actually went away (a `munmap` is reported as the
    /// whole `munmap` call, and ranges are merged when the monitor falls far behind), never
    /// narrower. Implementations may take their own locks and may unmap memory; they should
    /// be quick, because [`Monitor::busy`] stays set until every sink has returned.
    fn invalidate(&self, start: usize, end: usize);
}

/// The process-wide userfaultfd monitor. Obtain it with [`global`].
pub struct Monitor {
    shared: Arc<Shared>,
}

/// The monitor could not be started; the registration cache then relies on explicit
/// invalidation.
#[derive(Clone, Debug, thiserror::Error)]
#[error(
    "the userfaultfd memory monitor is unavailable: {reason}. To enable it, allow this \
     process to create userfaultfd descriptors: run Linux 5.11+ (user-mode-only \
     descriptors need no privilege), or set `sysctl vm.unprivileged_userfaultfd=1`, or grant \
     CAP_SYS_PTRACE, or give the process read/write access to /dev/userfaultfd; the kernel \
     must be built with CONFIG_USERFAULTFD and support the UNMAP, REMOVE and REMAP events \
     and write-protect registration (Linux 5.7+). Until then the registration cache cannot \
     see munmap/madvise/mremap and relies on explicit invalidate() calls"
)]
pub struct Unavailable {
    /// What failed, with the system error.
    pub reason: String,
}

/// Returns the process-wide monitor, starting it on first use.
///
/// Start-up happens once; if it fails, the same [`Unavailable`] is returned on every call.
pub fn global() -> Result<&'static Monitor, Unavailable> {
    static GLOBAL: OnceLock<Result<Monitor, Unavailable>> = OnceLock::new();
    GLOBAL
        .get_or_init(Monitor::start)
        .as_ref()
        .map_err(Clone::clone)
}

impl Monitor {
    /// Watches `[addr, addr + len)`, rounded out to whole pages: from now on, unmapping,
    /// `madvise`-removing or moving any part of it is reported to the sinks.
    ///
    /// Watching an already watched range again is harmless (the kernel skips it), and a
    /// range that is partly watched becomes fully watched. Unmapped holes inside the range
    /// are skipped: only what is mapped now is watched. The protection of the memory does
    /// not matter. Errors (the kernel's `errno`, kept in [`io::Error::raw_os_error`]):
    /// `EINVAL` for memory the kernel will not watch (file-backed mappings other than
    /// shared memory and hugetlbfs, `VM_PFNMAP` device memory, ...) and for a range with
    /// nothing mapped in it, `EBUSY` when another userfaultfd descriptor already watches
    /// part of it; `InvalidInput` for an empty or overflowing range.
    pub fn watch(&self, addr: usize, len: usize) -> io::Result<()> {
        self.shared.watch(addr, len).map(drop)
    }

    /// Whether this is a forked child of the process the monitor serves: it reports
    /// nothing here, and watching from here would act on the parent's memory.
    pub fn forked(&self) -> bool {
        std::process::id() != self.shared.pid
    }

    /// [`watch`](Self::watch), until the returned guard is dropped: pages no guard (nor a
    /// [`watch`](Self::watch) for good) holds any more are unwatched then, so that ranges
    /// watched once do not split the process's memory areas for good (towards
    /// `vm.max_map_count`) as registrations come and go.
    pub fn watch_while(&self, addr: usize, len: usize) -> io::Result<Watched> {
        let (start, end) = self.shared.watch(addr, len)?;
        Ok(Watched {
            shared: self.shared.clone(),
            start,
            end,
        })
    }

    /// Subscribes `sink` to every range that goes away from now on. Returns an id for
    /// [`unsubscribe`](Self::unsubscribe).
    ///
    /// Only a `Weak` is kept: once the sink is dropped it is no longer called, and its
    /// entry is removed. The sink is taken as a live `Arc` (only its `Weak` is kept) because an entry whose sink
    /// cannot be upgraded counts as dropped: a `Weak` handed out by [`Arc::new_cyclic`]
    /// before construction ends would be pruned by the next delivery or subscription and
    /// the sink would silently never be called.
    pub fn subscribe(&self, sink: Arc<dyn InvalidationSink>) -> u64 {
        let sink = Arc::downgrade(&sink);
        let id = self.shared.next_id.fetch_add(1, SeqCst);
        let mut subs = self.shared.subscribers.lock();
        subs.retain(|(_, w)| w.strong_count() > 0);
        subs.push((id, sink));
        id
    }

    /// Unsubscribes the sink with `id`; unknown ids are ignored.
    ///
    /// When this returns, the sink is not being called and will not be called again. To
    /// guarantee that, it waits for a delivery in progress to finish, so do not call it
    /// while holding a lock the sink takes. Called from within a sink, it does not wait (the
    /// current delivery may still call the unsubscribed sink).
    pub fn unsubscribe(&self, id: u64) {
        if self.forked() {
            // Nothing is delivered in a forked child, and a delivery the parent was
            // making when it forked never ends here.
            return;
        }
        let epoch = {
            let mut subs = self.shared.subscribers.lock();
            subs.retain(|(i, w)| *i != id && w.strong_count() > 0);
            self.shared.sink_epoch.load(SeqCst)
        };
        // An odd epoch read under the lock means sinks are being called from a copy of the
        // list taken before the removal: wait for that delivery to end.
        if epoch % 2 == 1 && !on_delivery_thread() {
            let mut backoff = Backoff::default();
            while self.shared.sink_epoch.load(SeqCst) == epoch {
                backoff.snooze();
            }
        }
    }

    /// True while events have been read from the kernel but not yet delivered to every sink.
    ///
    /// A cache that finds an entry must check this after the lookup; when it is set, it must
    /// release its lock, call [`wait_idle`](Self::wait_idle) and look up again.
    pub fn busy(&self) -> bool {
        if self.forked() {
            return false;
        }
        // `finished` first: a round that is unfinished when this starts is then seen as
        // unfinished or, if it finishes meanwhile, `started` has moved past `finished`.
        let finished = self.shared.finished.load(SeqCst);
        self.shared.started.load(SeqCst) != finished
    }

    /// Waits until everything read from the kernel before this call has been delivered to
    /// every sink: spins briefly, then yields, then sleeps in short steps.
    ///
    /// When no new events arrive meanwhile, [`busy`](Self::busy) is false afterwards. Events
    /// read after the call began are not waited for, so a steady stream of them cannot
    /// starve the caller.
    ///
    /// Do not call it while holding a lock a sink takes: the delivery waits for that lock.
    /// Returns at once when called from within a sink, since the delivery in progress cannot
    /// finish before the sink returns.
    pub fn wait_idle(&self) {
        if on_delivery_thread() || self.forked() {
            return;
        }
        let target = self.shared.started.load(SeqCst);
        let mut backoff = Backoff::default();
        while self.shared.finished.load(SeqCst) < target {
            backoff.snooze();
        }
    }

    fn start() -> Result<Monitor, Unavailable> {
        let unavailable = |reason: String| Unavailable { reason };
        let uffd = open_uffd().map_err(unavailable)?;
        probe_write_protect(&uffd).map_err(unavailable)?;
        let shared = Arc::new(Shared {
            uffd,
            started: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            queue: Mutex::new(Queue {
                ranges: Vec::with_capacity(QUEUE_CAP),
                rounds: 0,
                merged: 0,
                faults: 0,
                read_errors: 0,
                last_errno: 0,
            }),
            ready: Condvar::new(),
            subscribers: Mutex::new(Vec::new()),
            watched: Mutex::new(RangeCounts::new()),
            pid: std::process::id(),
            next_id: AtomicU64::new(1),
            sink_epoch: AtomicU64::new(0),
        });
        let spawn = |name: &str, body: fn(Arc<Shared>)| {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(name.to_owned())
                .spawn(move || body(shared))
                .map_err(|e| unavailable(format!("cannot start the {name} thread: {e}")))
        };
        spawn("rdmx-uffd-sink", deliver_loop)?;
        spawn("rdmx-uffd", read_loop)?;
        Ok(Monitor { shared })
    }
}

impl fmt::Debug for Monitor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Monitor")
            .field("fd", &self.shared.uffd.as_raw_fd())
            .field("busy", &self.busy())
            .field("subscribers", &self.shared.subscribers.lock().len())
            .finish()
    }
}

/// Ranges the reader may queue before it starts merging them.
const QUEUE_CAP: usize = 4096;
/// Events read per `read` call.
const READ_BATCH: usize = 64;
/// Reads per round before the reader hands the round over.
const READS_PER_ROUND: usize = 16;
/// The reader's `poll` timeout.
const POLL_TIMEOUT_MS: libc::c_int = 100;

struct Shared {
    uffd: Uffd,
    /// Rounds of reading begun: incremented before each read.
    started: AtomicU64,
    /// Rounds whose ranges have been delivered to every sink; never passes `started`.
    finished: AtomicU64,
    queue: Mutex<Queue>,
    /// Signals the delivery thread that the queue has something.
    ready: Condvar,
    subscribers: Mutex<Vec<(u64, Weak<dyn InvalidationSink>)>>,
    /// How many holders watch each page ([`Monitor::watch`] holds for good).
    watched: Mutex<RangeCounts>,
    /// The process the monitor serves: a forked child inherits the descriptor, whose
    /// ioctls act on this process's memory, and none of the threads.
    pid: u32,
    next_id: AtomicU64,
    /// Incremented under the subscriber lock when the delivery thread copies the list, and
    /// again when it has finished calling the sinks: odd while sinks are being called.
    sink_epoch: AtomicU64,
}

/// What the reader hands to the delivery thread.
struct Queue {
    /// Never grows beyond its initial capacity, [`QUEUE_CAP`].
    ranges: Vec<(usize, usize)>,
    /// Rounds handed over, each after all of its ranges.
    rounds: u64,
    /// Ranges merged into the last one because the queue was full.
    merged: u64,
    /// Page faults seen (none are expected).
    faults: u64,
    /// Failed reads, and the `errno` of the last one (0 when it was not a system error).
    read_errors: u64,
    last_errno: i32,
}

impl Queue {
    fn is_empty(&self) -> bool {
        self.ranges.is_empty() && self.rounds == 0 && self.faults == 0 && self.read_errors == 0
    }

    /// Queues a range without ever reallocating: when full, widens the last range instead.
    fn push(&mut self, (start, end): (usize, usize)) {
        if self.ranges.len() < self.ranges.capacity() || self.ranges.is_empty() {
            self.ranges.push((start, end));
        } else if let Some(last) = self.ranges.last_mut() {
            *last = (last.0.min(start), last.1.max(end));
            self.merged += 1;
        }
    }
}

thread_local! {
    static DELIVERY_THREAD: Cell<bool> = const { Cell::new(false) };
}

fn on_delivery_thread() -> bool {
    DELIVERY_THREAD.with(Cell::get)
}

/// The `rdmx-uffd` thread: reads events and queues their ranges. After start-up it frees no
/// memory and waits for nothing but the short queue lock.
fn read_loop(shared: Arc<Shared>) {
    let fd = shared.uffd.as_raw_fd();
    let page = sys::page_size();
    let mut buf = EventBuffer::new(READ_BATCH);
    loop {
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is one valid pollfd that lives across the call.
        let ready = unsafe { libc::poll(&mut pfd, 1, POLL_TIMEOUT_MS) };
        if ready <= 0 {
            continue; // timeout or EINTR
        }
        shared.started.fetch_add(1, SeqCst);
        for _ in 0..READS_PER_ROUND {
            let mut batch = Batch::default();
            let read: Result<usize, i32> = match shared.uffd.read_events(&mut buf) {
                Ok(events) => {
                    let mut read = 0;
                    for event in events {
                        read += 1;
                        match event {
                            Event::Unmap { start, end } | Event::Remove { start, end } => {
                                batch.push(start, end);
                            }
                            Event::Remap { from, len, .. } => {
                                batch.push(from, from.saturating_add(len));
                            }
                            Event::Pagefault {
                                addr,
                                write_protect,
                            } => {
                                batch.faults += 1;
                                release_fault(&shared.uffd, write_protect, addr & !(page - 1));
                            }
                            // EVENT_FORK is never requested; dropping closes the descriptor.
                            Event::Fork(fd) => {
                                batch.faults += 1;
                                drop(fd);
                            }
                            Event::Unknown => batch.faults += 1,
                        }
                    }
                    Ok(read)
                }
                Err(err) => Err(err.raw_os_error().unwrap_or(0)),
            };
            if batch.len > 0 || batch.faults > 0 || read.is_err() {
                let mut q = shared.queue.lock();
                for &range in &batch.ranges[..batch.len] {
                    q.push(range);
                }
                q.faults += batch.faults;
                if let Err(errno) = read {
                    q.read_errors += 1;
                    q.last_errno = errno;
                }
                drop(q);
                shared.ready.notify_one();
            }
            match read {
                Ok(0) => break,
                Ok(_) => {}
                Err(_) => {
                    // Not expected on a live descriptor; back off rather than spin.
                    std::thread::sleep(Duration::from_millis(10));
                    break;
                }
            }
        }
        // Even an empty round goes through the queue, so rounds finish in order.
        shared.queue.lock().rounds += 1;
        shared.ready.notify_one();
    }
}

/// The ranges of one `read`, on the reader's stack.
struct Batch {
    ranges: [(usize, usize); READ_BATCH],
    len: usize,
    faults: u64,
}

impl Default for Batch {
    fn default() -> Self {
        Batch {
            ranges: [(0, 0); READ_BATCH],
            len: 0,
            faults: 0,
        }
    }
}

impl Batch {
    fn push(&mut self, start: usize, end: usize) {
        match self.ranges.get_mut(self.len) {
            Some(slot) => {
                *slot = (start, end);
                self.len += 1;
            }
            // Cannot happen (one read returns at most READ_BATCH events); stay conservative.
            None => {
                if let Some(last) = self.ranges.last_mut() {
                    *last = (last.0.min(start), last.1.max(end));
                }
            }
        }
    }
}

/// A page fault can only come from a write-protected page, and this module never protects
/// one. Should one arrive anyway, unprotect the page and wake the faulting thread so it
/// does not hang.
fn release_fault(uffd: &Uffd, write_protect: bool, page: usize) {
    let size = sys::page_size();
    let _ = if write_protect {
        uffd.remove_write_protection(page, size)
    } else {
        uffd.wake(page, size)
    };
}

/// The `rdmx-uffd-sink` thread: hands queued ranges to the sinks, then counts the rounds
/// that came with them as finished.
fn deliver_loop(shared: Arc<Shared>) {
    DELIVERY_THREAD.with(|d| d.set(true));
    let mut ranges: Vec<(usize, usize)> = Vec::with_capacity(QUEUE_CAP);
    let mut sinks: Vec<(u64, Weak<dyn InvalidationSink>)> = Vec::new();
    loop {
        let (rounds, merged, faults, read_errors, last_errno) = {
            let mut q = shared.queue.lock();
            while q.is_empty() {
                shared.ready.wait(&mut q);
            }
            std::mem::swap(&mut q.ranges, &mut ranges);
            (
                std::mem::take(&mut q.rounds),
                std::mem::take(&mut q.merged),
                std::mem::take(&mut q.faults),
                std::mem::take(&mut q.read_errors),
                q.last_errno,
            )
        };
        if merged > 0 {
            tracing::debug!(merged, "userfaultfd monitor fell behind; merged ranges");
        }
        if faults > 0 {
            tracing::warn!(
                faults,
                "userfaultfd monitor saw unexpected page faults or events"
            );
        }
        if read_errors > 0 {
            let err = io::Error::from_raw_os_error(last_errno);
            tracing::warn!(read_errors, %err, "userfaultfd monitor failed to read events");
        }
        if !ranges.is_empty() {
            deliver(&shared, &ranges, &mut sinks);
            ranges.clear();
        }
        shared.finished.fetch_add(rounds, SeqCst);
    }
}

fn deliver(
    shared: &Shared,
    ranges: &[(usize, usize)],
    sinks: &mut Vec<(u64, Weak<dyn InvalidationSink>)>,
) {
    {
        let subs = shared.subscribers.lock();
        sinks.clear();
        sinks.extend(subs.iter().cloned());
        shared.sink_epoch.fetch_add(1, SeqCst);
    }
    let mut dead = false;
    for (id, weak) in sinks.iter() {
        let Some(sink) = weak.upgrade() else {
            dead = true;
            continue;
        };
        for &(start, end) in ranges {
            let called = catch_unwind(AssertUnwindSafe(|| sink.invalidate(start, end)));
            if called.is_err() {
                tracing::error!(id, start, end, "invalidation sink panicked");
            }
        }
    }
    shared.sink_epoch.fetch_add(1, SeqCst);
    sinks.clear();
    if dead {
        shared
            .subscribers
            .lock()
            .retain(|(_, w)| w.strong_count() > 0);
    }
}

/// Spin, then yield, then sleep in short steps.
#[derive(Default)]
struct Backoff {
    step: u32,
}

impl Backoff {
    fn snooze(&mut self) {
        if self.step < 64 {
            std::hint::spin_loop();
        } else if self.step < 1024 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
        self.step = self.step.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::open::{features, open_by_syscall};
    use super::*;
    use libc::c_void;
    use std::os::fd::RawFd;

    #[test]
    fn unavailable_says_why_and_how_to_enable() {
        let e = Unavailable {
            reason: "userfaultfd(2) failed: Operation not permitted".into(),
        };
        let s = e.to_string();
        for needle in [
            "Operation not permitted",
            "vm.unprivileged_userfaultfd=1",
            "CAP_SYS_PTRACE",
            "/dev/userfaultfd",
            "UNMAP, REMOVE and REMAP",
            "explicit invalidate()",
        ] {
            assert!(s.contains(needle), "missing {needle:?} in: {s}");
        }
        assert_eq!(e.clone().reason, e.reason);
    }

    #[test]
    fn queue_never_grows_and_merges_when_full() {
        let mut q = Queue {
            ranges: Vec::with_capacity(2),
            rounds: 0,
            merged: 0,
            faults: 0,
            read_errors: 0,
            last_errno: 0,
        };
        let cap = q.ranges.capacity();
        for i in 0..cap {
            q.push((0x10_000 * (i + 1), 0x10_000 * (i + 1) + 0x1000));
        }
        q.push((0x1000, 0x2000));
        q.push((0x900_000, 0x901_000));
        assert_eq!(q.ranges.capacity(), cap);
        assert_eq!(q.ranges.len(), cap);
        assert_eq!(q.merged, 2);
        let last = *q.ranges.last().unwrap();
        assert_eq!(last, (0x1000, 0x901_000));
    }

    /// Reads one event from `uffd` on this thread, waiting up to five seconds.
    fn read_one(uffd: &Uffd) -> Event {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(ev) = uffd.read_event().expect("read_event") {
                return ev;
            }
            assert!(std::time::Instant::now() < deadline, "no event within 5 s");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    // The fallback path used when /dev/userfaultfd exists but cannot be opened.
    #[test]
    fn syscall_fallback_descriptor_reports_unmap() {
        let uffd = open_by_syscall(features()).expect("userfaultfd(2) works here");
        let len = 2 * sys::page_size();
        let p = map_pages(2);
        uffd.register_write_protect(p as usize, len)
            .expect("register");
        let addr = p as usize;
        // munmap blocks until the event is read, so unmap on another thread.
        let unmapper = std::thread::spawn(move || {
            sys::syscall!(munmap(addr as *mut c_void, len)).expect("munmap");
        });
        match read_one(&uffd) {
            Event::Unmap { start, end } => {
                assert!(start <= addr && end >= addr + len);
            }
            other => panic!("expected an unmap event, got {other:?}"),
        }
        unmapper.join().unwrap();
    }

    fn map_pages(pages: usize) -> *mut c_void {
        // SAFETY: new private anonymous mapping.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                pages * sys::page_size(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        p
    }

    #[test]
    fn watch_refuses_memory_another_userfaultfd_watches() {
        let Ok(monitor) = global() else {
            panic!(
                "the monitor must start on this machine: {:?}",
                global().err()
            );
        };
        let other = open_by_syscall(features()).expect("userfaultfd(2) works here");
        let len = 2 * sys::page_size();
        let p = map_pages(2);
        other
            .register_write_protect(p as usize, len)
            .expect("register");
        let err = monitor.watch(p as usize, len).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EBUSY), "{err}");
        other.unregister(p as usize, len).expect("unregister");
        monitor.watch(p as usize, len).expect("free to watch now");
        sys::syscall!(munmap(p, len)).expect("munmap");
    }

    // Without CAP_SYS_PTRACE and with vm.unprivileged_userfaultfd=0, only a user-mode-only
    // descriptor may be created; the fallback asks for one.
    #[test]
    fn user_mode_only_needs_no_privilege() {
        let sysctl = std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd")
            .map(|s| s.trim() == "1")
            .unwrap_or(false);
        std::thread::spawn(move || {
            use caps::{CapSet, Capability};
            // Capabilities are per thread: this drops them for this test thread only.
            caps::drop(None, CapSet::Effective, Capability::CAP_SYS_PTRACE).unwrap();
            // SAFETY: userfaultfd(2) takes only flags.
            let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) };
            if sysctl {
                assert!(fd >= 0);
            } else {
                assert_eq!(fd, -1);
                assert_eq!(io::Error::last_os_error().raw_os_error(), Some(libc::EPERM));
            }
            if fd >= 0 {
                // SAFETY: fd is ours.
                unsafe { libc::close(fd as RawFd) };
            }
            open_by_syscall(features()).expect("user-mode-only descriptor without privilege");
        })
        .join()
        .unwrap();
    }
}
