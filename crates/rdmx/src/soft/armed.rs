//! The timers a software queue pair handed its driver.
//!
//! A driver keeps one heap of (deadline, queue pair) for all its queue pairs, and a heap
//! cannot move an entry: when a QP's deadline moves earlier (an RNR NAK's short wait
//! before the acknowledgement's long one), it pushes another. A QP needs one entry that
//! fires by its engine's deadline, not one per deadline it ever had: [`Armed`] keeps the
//! deadlines of its entries still in the heap, and a new one is pushed only when none of
//! them fires by the new deadline. An entry that fires before the engine's deadline only
//! makes the QP look (and push one if it then needs it).

use std::time::Instant;

/// The deadlines of a QP's entries in its driver's timer heap that have not fired yet,
/// earliest first.
#[derive(Debug, Default)]
pub(crate) struct Armed(Vec<Instant>);

impl Armed {
    /// Whether the engine's deadline `t` needs a new entry (none of those queued fires by
    /// then); if so, it is counted as queued, and the caller pushes it.
    pub(crate) fn arm(&mut self, t: Instant) -> bool {
        if self.0.first().is_some_and(|&first| first <= t) {
            return false;
        }
        // Earlier than every queued one: it goes first.
        self.0.insert(0, t);
        true
    }

    /// The entry for `at` fired (left the heap).
    pub(crate) fn fired(&mut self, at: Instant) {
        if let Some(i) = self.0.iter().position(|&x| x == at) {
            self.0.remove(i);
        }
    }

    /// Entries queued.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.0.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_deadline_that_moves_earlier_and_back_keeps_few_entries() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut a = Armed::default();
        assert!(a.arm(ms(67)), "the first deadline needs an entry");
        assert!(!a.arm(ms(67)) && !a.arm(ms(80)), "later ones are covered");
        // RNR NAKs: a short wait, which fires, then the acknowledgement's long one again.
        for i in 0..1000 {
            assert!(
                a.arm(ms(1) + Duration::from_micros(i)),
                "an earlier one needs one"
            );
            a.fired(ms(1) + Duration::from_micros(i));
            assert!(!a.arm(ms(68)), "the first entry still covers the long wait");
        }
        assert_eq!(a.len(), 1);
        a.fired(ms(67));
        assert!(a.arm(ms(68)), "once it fired, the long wait needs its own");
        // A stale entry (one not queued) firing changes nothing.
        a.fired(ms(5));
        assert_eq!(a.len(), 1);
    }
}
