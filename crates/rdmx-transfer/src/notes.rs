//! The order of notifications to one peer across a path's failure.
//!
//! Notifications to a peer all take its connection's first usable path, so they arrive
//! in the order they were sent while that path stays up. When it fails, the ones in
//! flight on it go again on another path, but only once the peer has fenced the failed
//! one (see [`Fence`](crate::fence::Fence)); notifications sent meanwhile would take the
//! new path at once and arrive first. The gate holds them back: from the moment a path
//! fails with notifications in flight until all of those have completed, and while one
//! that failed waits to go again, notifications wait here, in the order of their numbers
//! on the connection, and go out in that order once nothing sent before them is in
//! doubt. A notification that fails for good lets the later ones go.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;

use crate::engine::Shared;
use crate::path::{closed_reason, Conn, Path, Work};

/// A connection's notifications held back to keep their order.
#[derive(Default)]
pub(crate) struct NoteGate {
    /// The path notifications go on while it stays up (a path rebuilt meanwhile does
    /// not take them back: what is queued here would arrive after what goes there).
    path: Option<usize>,
    /// Failed paths that still have notifications in flight.
    failing: u32,
    /// The numbers of notifications that failed on a path and wait for its fence.
    in_doubt: Vec<u32>,
    /// Notifications to send, in the order of their numbers.
    held: VecDeque<Work>,
}

/// Whether notification number `a` was sent before `b`. Numbers wrap; the ones in doubt
/// or held at once span far less than half their range (a notification is not sent
/// again once [`WINDOW`](crate::seen::WINDOW) / 2 later ones went).
fn before(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

fn seq_of(w: &Work) -> u32 {
    match w {
        Work::Notify { seq, .. } => *seq,
        Work::Slice(_) => 0,
    }
}

impl NoteGate {
    /// Path `p` failed (the caller holds the gate and took the path down): if it has
    /// notifications in flight, the ones sent after wait until those have completed
    /// (each then goes again, or fails).
    pub(crate) fn path_failed(&mut self, p: &Path) {
        if p.notes_posted.load(Ordering::Acquire) > 0
            && !p.notes_gating.swap(true, Ordering::AcqRel)
        {
            self.failing += 1;
        }
    }

    /// Holds notification `w` until nothing sent before it is in doubt.
    pub(crate) fn insert(&mut self, w: Work) {
        let seq = seq_of(&w);
        let at = self
            .held
            .iter()
            .rposition(|h| before(seq_of(h), seq))
            .map_or(0, |i| i + 1);
        self.held.insert(at, w);
    }
}

impl Conn {
    /// Sends notification `w` (a new one, or one to go again that is not in doubt): on
    /// the first usable path, after every one sent before it that is still in doubt.
    pub(crate) fn send_note(&self, shared: &Shared, w: Work) {
        let mut g = self.gate.lock();
        g.insert(w);
        self.release(shared, &mut g);
    }

    /// Sends what nothing in doubt holds back any more.
    pub(crate) fn release_notes(&self, shared: &Shared) {
        let mut g = self.gate.lock();
        self.release(shared, &mut g);
    }

    /// Notification `seq` failed on a path and waits for the path's fence: the ones sent
    /// after it wait for it.
    pub(crate) fn note_in_doubt(&self, seq: u32) {
        self.gate.lock().in_doubt.push(seq);
    }

    /// Notification `seq`, in doubt, is settled: it goes again (`again`), or it failed.
    pub(crate) fn note_settled(&self, shared: &Shared, seq: u32, again: Option<Work>) {
        let mut g = self.gate.lock();
        if let Some(i) = g.in_doubt.iter().position(|&s| s == seq) {
            g.in_doubt.swap_remove(i);
        }
        if let Some(w) = again {
            g.insert(w);
        }
        self.release(shared, &mut g);
    }

    /// A notification posted on `p` completed, or was given up.
    pub(crate) fn note_completed(&self, shared: &Shared, p: &Path) {
        let mut g = self.gate.lock();
        if p.notes_posted.fetch_sub(1, Ordering::AcqRel) == 1
            && p.notes_gating.swap(false, Ordering::AcqRel)
        {
            g.failing -= 1;
            self.release(shared, &mut g);
        }
    }

    /// Sends what nothing in doubt holds back, in order. Under the gate's lock, so that
    /// notifications go out in that order. Once the connection is closed (it is marked
    /// closed before its paths fail and its queues empty), everything held fails.
    fn release(&self, shared: &Shared, g: &mut NoteGate) {
        if self.closed.load(Ordering::Acquire) {
            for w in g.held.drain(..) {
                fail_note(w, closed_reason(&self.peer));
            }
            return;
        }
        if g.failing > 0 {
            return;
        }
        let first_doubt = g
            .in_doubt
            .iter()
            .copied()
            .reduce(|m, s| if before(s, m) { s } else { m });
        while g
            .held
            .front()
            .is_some_and(|w| first_doubt.map_or(true, |d| before(seq_of(w), d)))
        {
            let w = g.held.pop_front().expect("just seen");
            let Some(me) = shared.me.upgrade() else {
                return fail_note(w, "the engine was dropped".into());
            };
            let sticky = g.path.filter(|&i| self.paths[i].up.load(Ordering::Acquire));
            g.path = sticky.or_else(|| self.first_up(&me));
            match g.path {
                Some(i) => {
                    if let Err(w) = self.paths[i].enqueue(w) {
                        fail_note(w, closed_reason(&self.peer));
                    }
                }
                None => fail_note(w, format!("no usable path to {}", self.peer)),
            }
        }
    }
}

/// Fails notification `w` with `why` (its batch, if it has one, says so).
fn fail_note(w: Work, why: String) {
    if let Work::Notify { batch: Some(b), .. } = w {
        b.notify_done(Err(why));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note(seq: u32) -> Work {
        Work::Notify {
            data: std::sync::Arc::from(&b""[..]),
            batch: None,
            attempt: 0,
            seq,
            invalid_once: false,
        }
    }

    #[test]
    fn held_notifications_stay_in_the_order_of_their_numbers_across_the_wrap() {
        let mut g = NoteGate::default();
        for s in [u32::MAX - 1, 2, u32::MAX, 0, 1] {
            g.insert(note(s));
        }
        let order: Vec<u32> = g.held.iter().map(seq_of).collect();
        assert_eq!(order, vec![u32::MAX - 1, u32::MAX, 0, 1, 2]);
        assert!(before(u32::MAX, 0) && !before(0, u32::MAX));
    }
}
