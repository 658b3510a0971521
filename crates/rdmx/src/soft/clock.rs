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

fn counter() -> &'static quanta::Clock {
    static COUNTER: OnceLock<quanta::Clock> = OnceLock::new();
    COUNTER.get_or_init(quanta::Clock::new)
}

std::thread_local! {
    /// The last clock reading of this thread, and the counter's value then.
    static ANCHOR: Cell<Option<(Instant, u64)>> = const { Cell::new(None) };
}

/// Now, to within far less than a microsecond (see the module documentation).
pub(crate) fn now() -> Instant {
    let c = counter();
    let raw = c.raw();
    ANCHOR.with(|a| {
        if let Some((at, base)) = a.get() {
            // (0 if the counter reads lower than the anchor, as it may on another core.)
            let ahead = c.delta(base, raw);
            if ahead < ANCHOR_AGE {
                return at + ahead;
            }
        }
        let at = Instant::now();
        a.set(Some((at, raw)));
        at
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
}
