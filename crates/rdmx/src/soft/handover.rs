//! How a software provider's driver passes between the applications that poll its CQs
//! and its progress thread.
//!
//! An application that polls runs the driver itself (its completions arrive sooner than
//! through a thread that would have to be woken), and records that it polled. While one
//! polled within the last [`HANDOVER`], the progress thread naps instead of competing for
//! the driver; it resumes a nap's length after the last poll, or at once when the
//! application says it stops polling ([`Handover::idle`], before it sleeps on a CQ's
//! notification) or the provider shuts down ([`Handover::wake`]).
//!
//! A nap lasts [`HANDOVER`] at first, and twice as long as the one before, up to the
//! driver's longest ([`NAP_MAX`] where the link holds what arrives meanwhile), while each
//! ends with an application still polling. Every end of a nap
//! wakes the thread, which on a host with no idle core takes a core from a thread that
//! polls: a process spinning on its CQ (as `rdmx bench` does) was preempted a thousand
//! times a second with 1 ms naps, which put the 99.9th percentile of `send_lat` on the
//! shm provider at 13-23 µs (12 runs), against a median of 0.4 µs.
//!
//! ```text
//!   progress thread                          application
//!   loop {                                   poll a CQ:
//!     if nap_while_app_polls() { continue }    app_polls(now); run the driver once
//!     run the driver                         sleep on a CQ's notification:
//!   }                                          idle()  (ends the nap)
//! ```
//!
//! The tcp, shm and udp drivers share it; tcp also naps with [`Handover::nap_while`] when
//! it finds an application's round running the driver.
//!
//! Both wake-ups notify under the nap's lock, and the thread checks again under it before
//! it sleeps, so none is lost.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// The progress thread leaves the driver to an application that polled this recently.
pub(crate) const HANDOVER: Duration = Duration::from_millis(1);
const HANDOVER_NS: u64 = HANDOVER.as_nanos() as u64;

/// The longest nap of a progress thread while applications keep polling, for a driver
/// whose links hold what arrives meanwhile (a ring, a TCP stream: a peer that fills them
/// waits): the thread resumes this long after the last poll at the latest, when an
/// application stops polling without saying so. A driver whose datagrams a full socket
/// drops naps [`HANDOVER`] at a time.
pub(crate) const NAP_MAX: Duration = Duration::from_millis(8);

/// Who runs a driver: the polling applications or the progress thread (see the module
/// documentation).
#[derive(Debug)]
pub(crate) struct Handover {
    /// When an application last polled, in nanoseconds after the clock's epoch
    /// ([`clock::epoch`](super::clock::epoch); 0: not polling).
    app_polled: AtomicU64,
    /// How long the progress thread's next nap lasts after the last poll, in nanoseconds
    /// (only that thread reads and writes it).
    nap_ns: AtomicU64,
    /// The longest nap, in nanoseconds.
    nap_max_ns: u64,
    /// Where the progress thread sleeps while applications poll.
    nap: (Mutex<()>, Condvar),
}

impl Handover {
    /// A handover whose progress thread naps at most `nap_max` at a time (at least
    /// [`HANDOVER`]).
    pub(crate) fn new(nap_max: Duration) -> Handover {
        Handover {
            app_polled: AtomicU64::new(0),
            nap_ns: AtomicU64::new(HANDOVER_NS),
            nap_max_ns: (nap_max.as_nanos() as u64).max(HANDOVER_NS),
            nap: (Mutex::new(()), Condvar::new()),
        }
    }

    /// An application polls at `now`.
    pub(crate) fn app_polls(&self, now: Instant) {
        self.app_polls_at(super::clock::nanos(now));
    }

    /// An application polls at `ns` nanoseconds after the clock's epoch.
    pub(crate) fn app_polls_at(&self, ns: u64) {
        let ns = ns | 1;
        // Written when it moved by a sixteenth of the handover time or more: the progress
        // thread reads the word, and a store on every poll of an application spinning on
        // its CQ is a store on every poll.
        let polled = self.app_polled.load(Ordering::Relaxed);
        if ns.wrapping_sub(polled) >= HANDOVER_NS / 16 {
            self.app_polled.store(ns, Ordering::SeqCst);
        }
    }

    /// When an application last polled, if within [`HANDOVER`].
    fn app_polled_at(&self) -> Option<Instant> {
        let at = self.app_polled.load(Ordering::SeqCst);
        if at == 0 {
            return None;
        }
        let polled = super::clock::epoch() + Duration::from_nanos(at);
        (Instant::now() < polled + HANDOVER).then_some(polled)
    }

    /// The progress thread, before it runs the driver: if an application polls, sleeps
    /// until a nap's length after its last poll (or until [`idle`](Self::idle) or
    /// [`wake`](Self::wake); not at all once `stop` is raised) and returns true; the
    /// thread then looks at `stop` and asks again. A nap that lasted its whole length
    /// makes the next one twice as long, up to the longest; finding no application
    /// polling, or being woken, makes it [`HANDOVER`] again.
    pub(crate) fn nap_while_app_polls(&self, stop: &AtomicBool) -> bool {
        let Some(polled) = self.app_polled_at() else {
            self.nap_ns.store(HANDOVER_NS, Ordering::Relaxed);
            return false;
        };
        let nap = self.nap_ns.load(Ordering::Relaxed);
        let mut g = self.nap.0.lock();
        // Checked again under the lock: `idle` and `wake` notify under it.
        let slept = !stop.load(Ordering::SeqCst)
            && self.app_polled_at().is_some()
            && self
                .nap
                .1
                .wait_until(&mut g, polled + Duration::from_nanos(nap))
                .timed_out();
        let next = match slept {
            true => (nap * 2).min(self.nap_max_ns),
            false => HANDOVER_NS,
        };
        self.nap_ns.store(next, Ordering::Relaxed);
        true
    }

    /// How long the progress thread's next nap lasts after the last poll.
    #[cfg(test)]
    fn nap_len(&self) -> Duration {
        Duration::from_nanos(self.nap_ns.load(Ordering::Relaxed))
    }

    /// The progress thread found the driver taken: if `busy` (an application's round runs
    /// it) and `stop` is not raised, sleeps up to [`HANDOVER`], or until
    /// [`idle`](Self::idle) or [`wake`](Self::wake).
    pub(crate) fn nap_while(&self, stop: &AtomicBool, busy: &AtomicBool) {
        let mut g = self.nap.0.lock();
        if !stop.load(Ordering::SeqCst) && busy.load(Ordering::SeqCst) {
            self.nap.1.wait_for(&mut g, HANDOVER);
        }
    }

    /// An application stops polling (it is about to sleep on a CQ's notification): the
    /// progress thread resumes at once.
    pub(crate) fn idle(&self) {
        if self.app_polled.swap(0, Ordering::SeqCst) == 0 {
            return;
        }
        self.wake();
    }

    /// Ends the progress thread's nap (it is to look at its stop flag).
    pub(crate) fn wake(&self) {
        let _g = self.nap.0.lock();
        self.nap.1.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// A poll dated a minute ahead, so that no test depends on how fast it runs.
    fn later() -> Instant {
        Instant::now() + Duration::from_secs(60)
    }

    /// A poll dated a little ahead, for a nap that is to run its course.
    fn soon() -> Instant {
        Instant::now() + Duration::from_millis(200)
    }

    #[test]
    fn polling_hands_over_and_idle_takes_back() {
        let h = Handover::new(NAP_MAX);
        assert_eq!(h.app_polled_at(), None);
        let at = later();
        h.app_polls(at);
        let polled = h.app_polled_at().expect("an application polls");
        assert!(polled >= at && polled <= at + Duration::from_nanos(1));
        h.idle();
        assert_eq!(h.app_polled_at(), None);
        assert!(!h.nap_while_app_polls(&AtomicBool::new(false)));
    }

    #[test]
    fn a_poll_long_past_hands_nothing_over() {
        let h = Handover::new(NAP_MAX);
        h.app_polls(Instant::now());
        std::thread::sleep(HANDOVER * 2);
        assert_eq!(h.app_polled_at(), None);
    }

    #[test]
    fn a_stopping_thread_does_not_nap() {
        let h = Handover::new(NAP_MAX);
        h.app_polls(later());
        let stop = AtomicBool::new(true);
        // Returns at once (it would otherwise sleep a minute): the caller sees `stop`.
        assert!(h.nap_while_app_polls(&stop));
        h.nap_while(&stop, &AtomicBool::new(true));
    }

    #[test]
    fn naps_lengthen_while_the_application_polls() {
        let h = Handover::new(NAP_MAX);
        let stop = AtomicBool::new(false);
        assert_eq!(h.nap_len(), HANDOVER);
        // A poll a little ahead (far enough that a descheduled test still finds it
        // polling): the nap runs its course, until a nap's length after it.
        h.app_polls(soon());
        assert!(h.nap_while_app_polls(&stop));
        assert_eq!(h.nap_len(), 2 * HANDOVER);
        h.app_polls(soon());
        assert!(h.nap_while_app_polls(&stop));
        assert_eq!(h.nap_len(), 4 * HANDOVER);
        for _ in 0..4 {
            h.app_polls(soon());
            assert!(h.nap_while_app_polls(&stop));
        }
        assert_eq!(h.nap_len(), NAP_MAX, "naps stop growing at NAP_MAX");
        // The application polls no more: the thread takes the driver back, and its next
        // nap is short again.
        assert!(!h.nap_while_app_polls(&stop));
        assert_eq!(h.nap_len(), HANDOVER);
    }

    #[test]
    fn a_driver_may_keep_its_naps_short() {
        let h = Handover::new(HANDOVER);
        let stop = AtomicBool::new(false);
        for _ in 0..2 {
            h.app_polls(soon());
            assert!(h.nap_while_app_polls(&stop));
            assert_eq!(h.nap_len(), HANDOVER);
        }
    }

    #[test]
    fn a_nap_cut_short_makes_the_next_one_short() {
        let h = Arc::new(Handover::new(NAP_MAX));
        let stop = AtomicBool::new(false);
        h.app_polls(soon());
        assert!(h.nap_while_app_polls(&stop));
        assert_eq!(h.nap_len(), 2 * HANDOVER);
        // A wake-up (as `wake` at shutdown) while the thread naps: it looks again, and
        // naps from HANDOVER again.
        h.app_polls(later());
        let (h2, napped) = (h.clone(), Arc::new(AtomicBool::new(false)));
        let napped2 = napped.clone();
        let waker = std::thread::spawn(move || {
            // Again and again: one made before the nap starts is lost.
            while !napped2.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(5));
                h2.wake();
            }
        });
        assert!(h.nap_while_app_polls(&stop));
        napped.store(true, Ordering::SeqCst);
        waker.join().expect("the waking thread");
        assert_eq!(h.nap_len(), HANDOVER);
    }

    #[test]
    fn idle_ends_the_nap() {
        let h = Arc::new(Handover::new(NAP_MAX));
        h.app_polls(later());
        let (started, start_seen) = std::sync::mpsc::channel();
        let h2 = h.clone();
        let napper = std::thread::spawn(move || {
            let stop = AtomicBool::new(false);
            let start = Instant::now();
            started.send(()).expect("the test waits");
            while h2.nap_while_app_polls(&stop) {}
            start.elapsed()
        });
        start_seen.recv().expect("the napping thread starts");
        // Most likely asleep by now; if not, it finds the application gone and does not
        // sleep at all.
        std::thread::sleep(Duration::from_millis(20));
        h.idle();
        let napped = napper.join().expect("the napping thread");
        // Without the wake-up the thread would sleep until a minute after the poll.
        assert!(napped < Duration::from_secs(30), "napped {napped:?}");
    }
}
