//! The time for the software providers' hot paths.
//!
//! `Instant::now()` reads the clock through the vDSO, about 50 ns in a virtual machine:
//! as much as the rest of a post, or of a poll that finds nothing. Where the time-stamp
//! counter is invariant it reads in a few nanoseconds, so each thread keeps the last
//! `Instant` it read and the counter's value then, and answers within [`ANCHOR_AGE`] of
//! it by adding the counter's progress (quanta's calibration turns ticks into
//! nanoseconds); past that it reads the clock again. Without a usable counter quanta reads
//! the monotonic clock itself, and the answer is the clock's.
//!
//! The error is the calibration's over at most [`ANCHOR_AGE`], far below a microsecond,
//! and it starts again from the clock each time: the engine's timers are milliseconds.

use std::cell::Cell;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long a thread answers from the counter before it reads the clock again.
const ANCHOR_AGE: Duration = Duration::from_micros(100);
/// [`ANCHOR_AGE`] in nanoseconds.
const ANCHOR_AGE_NS: u64 = ANCHOR_AGE.as_nanos() as u64;

/// The instant [`nanos`] counts from: the first time the process asked.
pub(crate) fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// `at` in nanoseconds since [`epoch`] (0 before it).
pub(crate) fn nanos(at: Instant) -> u64 {
    at.saturating_duration_since(epoch()).as_nanos() as u64
}

fn counter() -> &'static quanta::Clock {
    static COUNTER: OnceLock<quanta::Clock> = OnceLock::new();
    COUNTER.get_or_init(quanta::Clock::new)
}

std::thread_local! {
    /// The last clock reading of this thread, the counter's value then, and the reading
    /// in nanoseconds since [`epoch`].
    static ANCHOR: Cell<Option<(Instant, u64, u64)>> = const { Cell::new(None) };
}

/// Now, to within far less than a microsecond (see the module documentation).
pub(crate) fn now() -> Instant {
    now_and_nanos().0
}

/// [`now`], and the same time in nanoseconds since [`epoch`]: what a poll compares with
/// its deadlines, without the arithmetic of `Instant`s (a subtraction of two of them
/// cost a fifth of an empty poll of the shm provider).
pub(crate) fn now_and_nanos() -> (Instant, u64) {
    let c = counter();
    let raw = c.raw();
    ANCHOR.with(|a| {
        if let Some((at, base, ns)) = a.get() {
            // (0 if the counter reads lower than the anchor, as it may on another core.)
            let ahead = c.delta_as_nanos(base, raw);
            if ahead < ANCHOR_AGE_NS {
                return (at + Duration::from_nanos(ahead), ns + ahead);
            }
        }
        // (The epoch first: a reading made before it would count as 0.)
        epoch();
        let at = Instant::now();
        let ns = nanos(at);
        a.set(Some((at, raw, ns)));
        (at, ns)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stays_within_a_few_microseconds_of_the_clock() {
        for _ in 0..10_000 {
            let before = Instant::now();
            let t = now();
            let after = Instant::now();
            // The counter's answer may trail the clock by the calibration's error over
            // ANCHOR_AGE at most; it never runs ahead of a later reading by more.
            let slack = Duration::from_micros(5);
            assert!(t + slack >= before, "{:?} behind", before - t);
            assert!(t <= after + slack, "{:?} ahead", t - after);
        }
    }

    #[test]
    fn nanos_say_the_same_time() {
        for _ in 0..10_000 {
            let (t, ns) = now_and_nanos();
            assert_eq!(ns, nanos(t));
        }
    }
}
