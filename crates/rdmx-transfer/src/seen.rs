//! Which notifications a connection's peer sent have arrived: each carries a sequence
//! number of its connection (a SEND's immediate data), and one sent again after its path
//! failed, when the first attempt had arrived after all, is dropped the second time.

use std::collections::VecDeque;

/// How far past the oldest missing notification the window reaches. A notification
/// still missing once one this far beyond it has arrived is given up (its sender failed
/// it): should it come after all, it is taken for a duplicate and dropped. A sender
/// therefore does not send one again once half as many later ones went.
pub(crate) const WINDOW: u32 = 1 << 16;

/// The sequence numbers seen on one connection, in serial-number order (they wrap).
#[derive(Debug, Default)]
pub(crate) struct Seen {
    /// The oldest number that has neither arrived nor been given up: every one before
    /// it has.
    next: u32,
    /// Whether `next + i` arrived, for the numbers from `next` to the newest that did
    /// (the first is always false; at most [`WINDOW`] of them).
    ahead: VecDeque<bool>,
}

/// What to do with a notification.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The first time it arrived: deliver it.
    New,
    /// It arrived before, or was given up: drop it.
    Again,
}

impl Seen {
    /// Notes that notification `seq` arrived, and says whether it is new.
    pub(crate) fn arrived(&mut self, seq: u32) -> Verdict {
        let mut d = seq.wrapping_sub(self.next);
        if d >= 1 << 31 {
            // Before `next`: arrived already, or given up.
            return Verdict::Again;
        }
        if d >= WINDOW {
            // Far ahead: give up what is missing up to where the window then starts.
            let k = d - WINDOW + 1;
            let drop = (k as usize).min(self.ahead.len());
            let missing = self.ahead.drain(..drop).filter(|&a| !a).count() + (k as usize - drop);
            // Most often notifications the sender failed (no usable path, retries used
            // up), which it reported: no cause for a warning here.
            tracing::debug!(
                "{missing} notification(s) numbered before {} never arrived while {WINDOW} \
                 later ones did: given up (should one come after all, it is dropped)",
                self.next.wrapping_add(k)
            );
            self.next = self.next.wrapping_add(k);
            self.collapse();
            d = seq.wrapping_sub(self.next);
        }
        let d = d as usize;
        if self.ahead.get(d) == Some(&true) {
            return Verdict::Again;
        }
        if self.ahead.len() <= d {
            self.ahead.resize(d + 1, false);
        }
        self.ahead[d] = true;
        self.collapse();
        Verdict::New
    }

    /// Moves `next` past the numbers at the front that arrived.
    fn collapse(&mut self) {
        while self.ahead.front() == Some(&true) {
            self.ahead.pop_front();
            self.next = self.next.wrapping_add(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_number_is_new_once_in_any_order() {
        let mut s = Seen::default();
        assert_eq!(s.arrived(0), Verdict::New);
        assert_eq!(s.arrived(2), Verdict::New);
        assert_eq!(s.arrived(2), Verdict::Again);
        assert_eq!(s.arrived(0), Verdict::Again);
        assert_eq!(s.arrived(1), Verdict::New);
        assert_eq!(s.arrived(1), Verdict::Again);
        assert_eq!((s.next, s.ahead.len()), (3, 0));
        assert_eq!(s.arrived(3), Verdict::New);
    }

    #[test]
    fn numbers_wrap() {
        let mut s = Seen {
            next: u32::MAX - 1,
            ..Seen::default()
        };
        assert_eq!(s.arrived(1), Verdict::New);
        assert_eq!(s.arrived(u32::MAX), Verdict::New);
        assert_eq!(s.arrived(u32::MAX - 1), Verdict::New);
        assert_eq!(s.arrived(0), Verdict::New);
        assert_eq!((s.next, s.ahead.len()), (2, 0));
        assert_eq!(s.arrived(u32::MAX), Verdict::Again);
        assert_eq!(s.arrived(1), Verdict::Again);
    }

    #[test]
    fn a_gap_is_given_up_once_the_window_passes_it() {
        let mut s = Seen::default();
        // 0 never comes; 1 .. WINDOW do.
        for q in 1..WINDOW {
            assert_eq!(s.arrived(q), Verdict::New);
        }
        assert_eq!(s.next, 0);
        assert_eq!(s.arrived(WINDOW), Verdict::New);
        assert_eq!((s.next, s.ahead.len()), (WINDOW + 1, 0));
        assert_eq!(s.arrived(0), Verdict::Again);
        assert_eq!(s.arrived(WINDOW + 1), Verdict::New);
        // A jump of more than the window at once: what lies between is given up.
        assert_eq!(s.arrived(5 * WINDOW), Verdict::New);
        assert_eq!(s.ahead.len(), WINDOW as usize);
        assert_eq!(s.arrived(4 * WINDOW), Verdict::Again);
        assert_eq!(s.arrived(4 * WINDOW + 1), Verdict::New);
        assert_eq!(s.arrived(4 * WINDOW + 1), Verdict::Again);
    }
}
