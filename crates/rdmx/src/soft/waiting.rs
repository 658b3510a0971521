//! Connections that arrive before their queue pair expects them.
//!
//! The two sides of a connection-oriented software provider (tcp, shm) each move their QP
//! to RTR on their own; the one that dials may get there first, and its connection then
//! reaches a QP that does not know yet which peer it will take. The connection waits
//! here, at most one per QP (a newer one replaces it), until the QP reaches RTR and takes
//! it, or for [`PARKED_TIMEOUT`]. The hello that names the QP, and its secret, are checked
//! before a connection is kept.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// A connection waiting for its QP to reach RTR is closed after this long.
pub(crate) const PARKED_TIMEOUT: Duration = Duration::from_secs(60);

/// Connections (`C`: the provider's) waiting for their QP, by the QP they are for.
#[derive(Debug)]
pub(crate) struct Waiting<C> {
    by_qpn: Mutex<HashMap<u32, Parked<C>>>,
}

#[derive(Debug)]
struct Parked<C> {
    conn: C,
    /// The QP it comes from.
    from: u32,
    since: Instant,
}

impl<C> Waiting<C> {
    pub(crate) fn new() -> Waiting<C> {
        Waiting {
            by_qpn: Mutex::new(HashMap::new()),
        }
    }

    /// Keeps `conn`, from QP `from`, until QP `to` expects it; closes (drops) one that
    /// waited for `to` before.
    pub(crate) fn park(&self, to: u32, from: u32, conn: C) {
        let parked = Parked {
            conn,
            from,
            since: Instant::now(),
        };
        if let Some(old) = self.by_qpn.lock().insert(to, parked) {
            tracing::warn!(
                to,
                from = old.from,
                "closing a connection replaced by a newer one"
            );
        }
    }

    /// The connection QP `from` made to QP `qpn`, if it waits; one from another QP is
    /// closed.
    pub(crate) fn take(&self, qpn: u32, from: u32) -> Option<C> {
        let parked = self.by_qpn.lock().remove(&qpn)?;
        if parked.from == from {
            return Some(parked.conn);
        }
        tracing::warn!(
            qpn,
            who = parked.from,
            "dropping a connection from an unexpected QP"
        );
        None
    }

    /// Closes what waits for QP `qpn` (it is being destroyed).
    pub(crate) fn remove(&self, qpn: u32) {
        self.by_qpn.lock().remove(&qpn);
    }

    /// Closes the connections that waited longer than [`PARKED_TIMEOUT`].
    pub(crate) fn expire(&self) {
        let mut by_qpn = self.by_qpn.lock();
        if by_qpn.is_empty() {
            return;
        }
        by_qpn.retain(|to, p| {
            let keep = p.since.elapsed() <= PARKED_TIMEOUT;
            if !keep {
                tracing::warn!(
                    to,
                    from = p.from,
                    "closing a connection whose QP did not reach RTR within {PARKED_TIMEOUT:?}"
                );
            }
            keep
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_waits_for_its_qp_and_peer() {
        let w = Waiting::new();
        w.park(7, 3, "first");
        // A newer one for the same QP replaces it.
        w.park(7, 4, "second");
        assert_eq!(w.take(7, 4), Some("second"));
        assert_eq!(w.take(7, 4), None);
        // One from another QP than the one expected is closed, not kept.
        w.park(8, 5, "stranger");
        assert_eq!(w.take(8, 6), None);
        assert_eq!(w.take(8, 5), None);
        w.park(9, 1, "gone");
        w.remove(9);
        assert_eq!(w.take(9, 1), None);
        // Fresh ones outlive an expiry pass.
        w.park(10, 2, "fresh");
        w.expire();
        assert_eq!(w.take(10, 2), Some("fresh"));
    }
}
