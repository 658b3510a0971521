//! A failed path's fence: work that was in flight on it goes again on another path only
//! once the peer has moved its side of the path to the error state.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use rdmx::WcStatus;

use crate::batch::Failure;
use crate::engine::Shared;
use crate::path::{fail_work, Path, Work};

/// A failed path's fence. Work that was in flight on such a path is sent again on
/// another only once the peer has moved its queue pair of the path to the error state,
/// which drops whatever still arrives on it: before, the first attempt may still land,
/// after the second, perhaps after the batch was reported done and its memory reused.
/// Every transport can hold a first attempt back: a TCP stream's buffers on either end
/// (after a stall, or a link that dropped for a while), an shm ring or a descriptor of
/// the initiator's memory that a stalled peer reads late, packets held in a verbs fabric
/// or a loopback fault. If the peer cannot confirm the fence (it does not answer within
/// the connect timeout), that work fails.
pub(crate) struct Fence {
    /// The queue pair of this path the fence is for.
    qpn: u32,
    state: FenceState,
    /// Work that failed on the path, with its status, waiting for the fence.
    parked: Vec<(Work, WcStatus)>,
}

#[derive(Clone)]
enum FenceState {
    /// Asked for; no answer yet.
    Running,
    /// The peer's queue pair takes nothing more.
    Done,
    /// The peer did not confirm it, and why.
    Failed(String),
}

impl Fence {
    /// Whether a fence is being asked for (the path is not rebuilt meanwhile).
    pub(crate) fn running(&self) -> bool {
        matches!(self.state, FenceState::Running)
    }
}

impl Path {
    /// Sends `w`, which failed with `status` while in flight on this path's queue pair
    /// `qpn`, again on another path once the peer has fenced this one (see [`Fence`]),
    /// failing it if the peer does not confirm the fence.
    pub(crate) fn retry_fenced(
        self: &Arc<Path>,
        shared: &Shared,
        w: Work,
        status: WcStatus,
        qpn: u32,
    ) {
        let mut fences = self.fences.lock();
        if let Some(f) = fences.iter_mut().find(|f| f.qpn == qpn) {
            match f.state.clone() {
                FenceState::Running => f.parked.push((w, status)),
                state => {
                    drop(fences);
                    self.after_fence(shared, &state, w, status);
                }
            }
            return;
        }
        let Some(shared) = self.open(shared) else {
            // The engine or the connection is closing: nothing goes again.
            drop(fences);
            self.after_fence(shared, &FenceState::Done, w, status);
            return;
        };
        let (mine, peer) = *self.qp_pair.lock();
        if mine != qpn {
            // Rebuilt since: the peer replaced its queue pair of the path, whose bytes
            // no longer land.
            drop(fences);
            self.after_fence(&shared, &FenceState::Done, w, status);
            return;
        }
        // The current queue pair's first failure: the finished fences of older ones go
        // (their late work is rebuilt-since work, above).
        fences.retain(Fence::running);
        fences.push(Fence {
            qpn,
            state: FenceState::Running,
            parked: vec![(w, status)],
        });
        drop(fences);
        let p = self.clone();
        let spawned = std::thread::Builder::new()
            .name("rdmx-te-fence".into())
            .spawn({
                let shared = shared.clone();
                move || {
                    let res = crate::handshake::fence(&shared, &p, peer);
                    p.fenced(&shared, qpn, res.map_err(|e| e.to_string()));
                }
            });
        if let Err(e) = spawned {
            self.fenced(&shared, qpn, Err(format!("no thread to ask for it: {e}")));
        }
    }

    /// The engine, unless it or this path's connection is closing.
    fn open(&self, shared: &Shared) -> Option<Arc<Shared>> {
        let conn_open = self
            .conn
            .upgrade()
            .is_some_and(|c| !c.closed.load(Ordering::Acquire));
        let me = shared.me.upgrade()?;
        (conn_open && !shared.stop.load(Ordering::Acquire)).then_some(me)
    }

    /// Whether a fence of this path is under way (the path is not rebuilt meanwhile).
    pub(crate) fn fencing(&self) -> bool {
        self.fences.lock().iter().any(Fence::running)
    }

    /// The fence for queue pair `qpn` was confirmed, or not: the work waiting for it goes
    /// on, or fails.
    fn fenced(&self, shared: &Shared, qpn: u32, res: Result<(), String>) {
        let state = match res {
            Ok(()) => FenceState::Done,
            Err(why) => {
                tracing::warn!(
                    path = %self.name,
                    "the peer did not confirm that the failed path takes nothing more ({why}); \
                     what was in flight on it is not sent again"
                );
                FenceState::Failed(why)
            }
        };
        let parked = {
            let mut fences = self.fences.lock();
            match fences.iter_mut().find(|f| f.qpn == qpn) {
                Some(f) => {
                    f.state = state.clone();
                    std::mem::take(&mut f.parked)
                }
                None => Vec::new(),
            }
        };
        for (w, status) in parked {
            self.after_fence(shared, &state, w, status);
        }
    }

    /// `w`, which failed with `status`, goes again once its fence ended in `state`, or
    /// fails: the fence failed, the engine or the connection is closing, or (a
    /// notification) the peer may have given it up.
    fn after_fence(&self, shared: &Shared, state: &FenceState, w: Work, status: WcStatus) {
        // A notification in doubt: the later ones wait until it is settled here.
        let note = match &w {
            Work::Notify { seq, .. } => Some(*seq),
            Work::Slice(_) => None,
        };
        let conn = match self.conn.upgrade() {
            Some(conn) if self.open(shared).is_some() => conn,
            conn => {
                let failure = if shared.stop.load(Ordering::Acquire) {
                    self.dropped_failure(Some(status))
                } else {
                    let peer = conn.as_ref().map(|c| c.peer.clone()).unwrap_or_default();
                    self.closed_failure(&peer, Some(status))
                };
                fail_work(shared, w, failure);
                if let (Some(c), Some(seq)) = (conn, note) {
                    c.note_settled(shared, seq, None);
                }
                return;
            }
        };
        let reason = match (state, &w) {
            (FenceState::Failed(why), _) => format!(
                "not sent again: the peer did not confirm that the path takes nothing more \
                 of it ({why})"
            ),
            (_, &Work::Notify { seq, .. })
                if conn.notes_sent.load(Ordering::Relaxed).wrapping_sub(seq)
                    > crate::seen::WINDOW / 2 =>
            {
                format!(
                    "not sent again: over {} later notifications went to the peer meanwhile, \
                     and it may have given this one up",
                    crate::seen::WINDOW / 2
                )
            }
            _ => return conn.reschedule(shared, w, self, Some(status)),
        };
        let failure = Failure {
            status: Some(status),
            path: self.name.clone(),
            reason,
        };
        fail_work(shared, w, failure);
        if let Some(seq) = note {
            conn.note_settled(shared, seq, None);
        }
    }
}
