//! Rails, paths and connections: a path is one queue pair on one rail to one peer; a
//! connection holds every path to a peer and schedules slices over them by each path's
//! bytes queued and in flight over its measured bandwidth. A path that fails is set
//! aside, its slices go to the others, and it is rebuilt on demand once its time is up.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use parking_lot::{Mutex, RwLock};
use rdmx::{CompletionQueue, LocalSge, MemoryRegion, ProtectionDomain, QueuePair};
use rdmx::{RecvRequest, WcStatus};

use crate::batch::{BatchState, Failure, IN_FLIGHT, WAITING};
use crate::config::Transport;
use crate::engine::Shared;
use crate::wire::{RailDesc, SegmentDesc};

/// Receives posted per path for notifications.
pub(crate) const RECVS: usize = 8;

/// One rail of this engine: a device, its protection domain and completion queue, and
/// the worker thread that posts and reaps for every path on it.
pub(crate) struct RailRt {
    pub(crate) index: usize,
    pub(crate) kind: Transport,
    pub(crate) pd: ProtectionDomain,
    pub(crate) cq: CompletionQueue,
    pub(crate) desc: RailDesc,
    pub(crate) paths: Mutex<Vec<Arc<Path>>>,
    pub(crate) sleeping: AtomicBool,
    pub(crate) stop: AtomicBool,
    pub(crate) closed: AtomicBool,
}

impl RailRt {
    /// Wakes the worker if it sleeps.
    pub(crate) fn kick(&self) {
        if self.sleeping.load(Ordering::SeqCst) {
            self.cq.wake();
        }
    }
}

/// A piece of a request on its way.
pub(crate) struct Slice {
    pub(crate) batch: Arc<BatchState>,
    pub(crate) req: u32,
    pub(crate) off: u64,
    pub(crate) len: u32,
    pub(crate) attempt: u32,
    /// Refused once already as an invalid request (see [`Work::refusal_is_final`]).
    pub(crate) invalid_once: bool,
}

/// What a path's queue holds.
pub(crate) enum Work {
    Slice(Slice),
    Notify {
        data: Arc<[u8]>,
        batch: Option<Arc<BatchState>>,
        attempt: u32,
        /// Its number on its connection (the SEND's immediate data), the same on every
        /// attempt: the peer drops a second arrival.
        seq: u32,
        /// Refused once already as an invalid request (see [`Work::refusal_is_final`]).
        invalid_once: bool,
    },
}

impl Work {
    /// Whether failing with `status` ends this work here, without trying another path.
    ///
    /// A request the peer refused for its key, range or rights, or one wrong in itself
    /// (a local protection or length error), gets the same answer on any path and would
    /// take each down in turn: final at once. An invalid-request NAK (`RemInvReqErr`) is
    /// different: this engine checked the request against the segment before posting it,
    /// and a responder also sends that NAK when the path's request stream broke (an
    /// opcode out of sequence, a length that does not fit the path MTU; Soft-RoCE does so
    /// after recovering from packet loss). The first one sends the work on another path;
    /// a second is final.
    pub(crate) fn refusal_is_final(&mut self, status: WcStatus) -> bool {
        match status {
            WcStatus::RemAccessErr | WcStatus::LocProtErr | WcStatus::LocLenErr => true,
            WcStatus::RemInvReqErr => {
                let once = match self {
                    Work::Slice(s) => &mut s.invalid_once,
                    Work::Notify { invalid_once, .. } => invalid_once,
                };
                std::mem::replace(once, true)
            }
            _ => false,
        }
    }

    pub(crate) fn len(&self) -> u64 {
        match self {
            Work::Slice(s) => s.len as u64,
            Work::Notify { data, .. } => data.len() as u64,
        }
    }
}

/// A path's state, as status and bench output show it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathStatus {
    /// The path's name: rail, device, queue pair, peer.
    pub name: String,
    /// The transport.
    pub transport: Transport,
    /// Usable now.
    pub up: bool,
    /// Bytes posted and not completed.
    pub in_flight: u64,
    /// Bytes queued, not posted yet.
    pub queued: u64,
    /// Measured bandwidth, bytes per second.
    pub bandwidth: u64,
    /// Times it failed.
    pub failures: u32,
}

/// One queue pair on one rail to one peer.
pub(crate) struct Path {
    pub(crate) conn: Weak<Conn>,
    pub(crate) rail: Arc<RailRt>,
    pub(crate) remote_rail: u8,
    pub(crate) index: u16,
    pub(crate) id: u32,
    pub(crate) name: String,
    pub(crate) qp: Mutex<Option<Arc<QueuePair>>>,
    pub(crate) up: AtomicBool,
    pub(crate) down_until: Mutex<Option<Instant>>,
    pub(crate) repairing: AtomicBool,
    pub(crate) failures: AtomicU32,
    pub(crate) pending: Mutex<VecDeque<Work>>,
    pub(crate) queued: AtomicU64,
    pub(crate) in_flight: AtomicU64,
    pub(crate) outstanding: AtomicU32,
    pub(crate) bw: AtomicU64,
    pub(crate) done_bytes: AtomicU64,
    pub(crate) recv_mr: MemoryRegion,
    /// The numbers of this path's queue pair and of the peer's it is connected to
    /// (set together when the path is built or rebuilt).
    pub(crate) qp_pair: Mutex<(u32, u32)>,
    /// Whether the peer confirmed that its queue pair takes nothing more, once this
    /// path failed with work in flight: one fence per queue pair of the path that did
    /// (the current one's, and older ones' still under way).
    pub(crate) fences: Mutex<Vec<crate::fence::Fence>>,
    /// Notifications posted on this path and not completed.
    pub(crate) notes_posted: AtomicU32,
    /// Whether this path failed with notifications in flight, which hold the later ones
    /// of its connection back until they complete (`notes`).
    pub(crate) notes_gating: AtomicBool,
}

impl Path {
    pub(crate) fn new(
        conn: Weak<Conn>,
        rail: Arc<RailRt>,
        remote_rail: u8,
        index: u16,
        id: u32,
        peer: &str,
        qp: QueuePair,
    ) -> crate::Result<Arc<Path>> {
        let recv_mr = rail.pd.register(
            vec![0u8; RECVS * crate::MAX_NOTIFY],
            rdmx::Access::LOCAL_WRITE,
        )?;
        let qp_num = qp.qp_num();
        let name = format!(
            "{}/{}#{} qp{qp_num:#x} -> {peer} rail {remote_rail}",
            rail.kind, rail.desc.device, index,
        );
        Ok(Arc::new(Path {
            conn,
            remote_rail,
            index,
            id,
            name,
            qp: Mutex::new(Some(Arc::new(qp))),
            up: AtomicBool::new(true),
            down_until: Mutex::new(None),
            repairing: AtomicBool::new(false),
            failures: AtomicU32::new(0),
            pending: Mutex::new(VecDeque::new()),
            queued: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            outstanding: AtomicU32::new(0),
            bw: AtomicU64::new(1 << 30),
            done_bytes: AtomicU64::new(0),
            recv_mr,
            qp_pair: Mutex::new((qp_num, 0)),
            fences: Mutex::new(Vec::new()),
            notes_posted: AtomicU32::new(0),
            notes_gating: AtomicBool::new(false),
            rail,
        }))
    }

    /// Queues `w` on this path, unless its connection is closed (or gone): `w` is then
    /// given back, for the caller to fail.
    pub(crate) fn enqueue(&self, w: Work) -> Result<(), Work> {
        let Some(mut q) = self.queue_if_open() else {
            return Err(w);
        };
        self.queued.fetch_add(w.len(), Ordering::Relaxed);
        q.push_back(w);
        drop(q);
        self.rail.kick();
        Ok(())
    }

    /// The path's queue, locked, if its connection is open. Closing a connection marks it
    /// closed, then empties its paths' queues under this lock (`Shared::drop_conn`), so
    /// nothing queued through here is left where no worker looks.
    pub(crate) fn queue_if_open(&self) -> Option<parking_lot::MutexGuard<'_, VecDeque<Work>>> {
        let q = self.pending.lock();
        let open = self
            .conn
            .upgrade()
            .is_some_and(|c| !c.closed.load(Ordering::Acquire));
        open.then_some(q)
    }

    /// Fails every work item queued on this path (its connection closed).
    pub(crate) fn fail_queued(&self, shared: &Shared, peer: &str) {
        let left: Vec<Work> = self.pending.lock().drain(..).collect();
        self.queued.store(0, Ordering::Relaxed);
        for w in left {
            fail_work(shared, w, self.closed_failure(peer, None));
        }
    }

    /// The failure of work on this path when its engine is dropped.
    pub(crate) fn dropped_failure(&self, status: Option<WcStatus>) -> Failure {
        Failure {
            status,
            path: self.name.clone(),
            reason: "the engine was dropped".into(),
        }
    }

    /// The failure of work that found this path's connection closed.
    pub(crate) fn closed_failure(&self, peer: &str, status: Option<WcStatus>) -> Failure {
        Failure {
            status,
            path: self.name.clone(),
            reason: closed_reason(peer),
        }
    }

    /// Posts every notification receive on the current queue pair.
    pub(crate) fn post_recvs(&self) -> crate::Result<()> {
        let Some(qp) = self.qp.lock().clone() else {
            return Ok(());
        };
        for slot in 0..RECVS {
            self.post_recv(&qp, slot)?;
        }
        Ok(())
    }

    pub(crate) fn post_recv(&self, qp: &QueuePair, slot: usize) -> crate::Result<()> {
        let sge = LocalSge::new(&self.recv_mr, slot * crate::MAX_NOTIFY, crate::MAX_NOTIFY)?;
        qp.post_recv(RecvRequest::new(recv_wr_id(self.id, slot)).sge(sge))?;
        Ok(())
    }

    pub(crate) fn status(&self) -> PathStatus {
        PathStatus {
            name: self.name.clone(),
            transport: self.rail.kind,
            up: self.up.load(Ordering::Acquire),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            queued: self.queued.load(Ordering::Relaxed),
            bandwidth: self.bw.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
        }
    }

    /// Sets the path aside: not used until `set_aside` has passed and it is rebuilt; its
    /// queue pair is moved to the error state so that its requests flush at once; its
    /// queued work goes elsewhere. Returns whether this call took it down.
    pub(crate) fn fail(&self, shared: &Shared) -> bool {
        let conn = self.conn.upgrade();
        // Under its connection's notification gate: no later notification takes another
        // path before the ones queued or in flight here are accounted for (`notes`).
        let mut gate = conn.as_ref().map(|c| c.gate.lock());
        if !self.up.swap(false, Ordering::AcqRel) {
            return false;
        }
        self.failures.fetch_add(1, Ordering::Relaxed);
        *self.down_until.lock() = Some(Instant::now() + shared.config.set_aside);
        tracing::info!(path = %self.name, "transfer path failed; set aside");
        if let Some(qp) = self.qp.lock().clone() {
            let attr = rdmx::QpAttr {
                qp_state: rdmx::QpState::Err,
                ..Default::default()
            };
            let _ = qp.modify(&attr, rdmx::QpAttrMask::STATE);
        }
        let queued: Vec<Work> = self.pending.lock().drain(..).collect();
        self.queued.store(0, Ordering::Relaxed);
        // After the drain: a notification the worker took from the queue before it is
        // counted as in flight by now (it counts under the queue's lock).
        if let Some(g) = gate.as_mut() {
            g.path_failed(self);
        }
        // Queued notifications wait in the gate, in order, with those sent meanwhile.
        let (notes, slices): (Vec<Work>, Vec<Work>) = queued
            .into_iter()
            .partition(|w| matches!(w, Work::Notify { .. }));
        if let Some(g) = gate.as_mut() {
            notes.into_iter().for_each(|w| g.insert(w));
        }
        drop(gate);
        if let Some(conn) = conn {
            for w in slices {
                conn.reschedule(shared, w, self, None);
            }
            conn.release_notes(shared);
        }
        true
    }
}

const RECV_FLAG: u64 = 1 << 63;
/// The bits of a send-queue request's tag (above its slab key in its id): bit 63 of the
/// id stays clear, which receives' ids set.
pub(crate) const TAG_MASK: u32 = 0x7fff_ffff;

/// Why work to `peer` fails once its connection closed.
pub(crate) fn closed_reason(peer: &str) -> String {
    format!("the connection to {peer} closed")
}

/// The id of a send-queue request: its slab `key` in the low 32 bits, `tag` (31 bits)
/// above.
pub(crate) fn send_wr_id(key: usize, tag: u32) -> u64 {
    (key as u64 & 0xffff_ffff) | u64::from(tag & TAG_MASK) << 32
}

/// A send-queue request's (slab key, tag): the inverse of [`send_wr_id`].
pub(crate) fn parse_send(wr_id: u64) -> (usize, u32) {
    (
        (wr_id & 0xffff_ffff) as usize,
        (wr_id >> 32) as u32 & TAG_MASK,
    )
}

pub(crate) fn recv_wr_id(path: u32, slot: usize) -> u64 {
    RECV_FLAG | (path as u64) << 16 | slot as u64
}

/// A receive's (path id, slot), if `wr_id` names one.
pub(crate) fn parse_recv(wr_id: u64) -> Option<(u32, usize)> {
    (wr_id & RECV_FLAG != 0).then_some((
        ((wr_id & !RECV_FLAG) >> 16) as u32,
        (wr_id & 0xffff) as usize,
    ))
}

/// Every path to one peer, and what the peer told us.
pub(crate) struct Conn {
    pub(crate) peer: String,
    /// Where this engine reaches the peer's control listener to ask whether it still
    /// holds this connection ([`Msg::Probe`](crate::wire::Msg::Probe)): the address the
    /// initiator dialed; on the target, the peer's control port at the address its
    /// control connection came from when its descriptor names a loopback address (it
    /// listens on every interface).
    pub(crate) probe_at: std::net::SocketAddr,
    pub(crate) secret: u64,
    pub(crate) transport: Transport,
    pub(crate) mtu: u32,
    pub(crate) initiator: bool,
    pub(crate) desc: RwLock<Arc<SegmentDesc>>,
    pub(crate) paths: Vec<Arc<Path>>,
    pub(crate) closed: AtomicBool,
    /// When it was added to the engine's connections (its count of them then; 0: not
    /// yet).
    pub(crate) added: std::sync::atomic::AtomicU64,
    /// The number of the next notification sent on this connection.
    pub(crate) notes_sent: AtomicU32,
    /// The notifications from the peer that arrived on this connection.
    pub(crate) notes_seen: Mutex<crate::seen::Seen>,
    /// Notifications to the peer held back to keep their order (`notes`).
    pub(crate) gate: Mutex<crate::notes::NoteGate>,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("peer", &self.peer)
            .field("transport", &self.transport)
            .field("paths", &self.paths.len())
            .finish()
    }
}

impl Conn {
    /// Notification `data` of `batch` (if any), numbered on this connection.
    pub(crate) fn notification(&self, data: Arc<[u8]>, batch: Option<Arc<BatchState>>) -> Work {
        Work::Notify {
            data,
            batch,
            attempt: 0,
            seq: self.notes_sent.fetch_add(1, Ordering::Relaxed),
            invalid_once: false,
        }
    }

    /// The best usable path for `len` more bytes: the one that would finish them first
    /// given what it has queued and in flight and its bandwidth; `extra[i]` is what the
    /// caller is about to add to path `i`. Starts the rebuild of set-aside paths whose
    /// time is up.
    pub(crate) fn pick(&self, shared: &Arc<Shared>, extra: &[u64], len: u64) -> Option<usize> {
        // The path that would finish first: least (load / bandwidth), compared as
        // load_a * bw_b < load_b * bw_a (no division on this per-slice path).
        let mut best: Option<(usize, u128, u128)> = None;
        for (i, p) in self.paths.iter().enumerate() {
            if !p.up.load(Ordering::Acquire) {
                self.maybe_repair(shared, p);
                continue;
            }
            let load = p.queued.load(Ordering::Relaxed) as u128
                + p.in_flight.load(Ordering::Relaxed) as u128
                + extra.get(i).copied().unwrap_or(0) as u128
                + len as u128;
            let bw = p.bw.load(Ordering::Relaxed).max(1) as u128;
            if best.map_or(true, |(_, l, b)| load * b < l * bw) {
                best = Some((i, load, bw));
            }
        }
        best.map(|(i, _, _)| i)
    }

    /// The first usable path: notifications to one peer all take it, so they arrive in
    /// the order they were sent while it stays up.
    pub(crate) fn first_up(&self, shared: &Arc<Shared>) -> Option<usize> {
        self.pick(shared, &[], 0)?;
        self.paths.iter().position(|p| p.up.load(Ordering::Acquire))
    }

    /// Queues `w` on the best usable path other than the one it failed on; if there is
    /// none, or it has been retried too often, fails it.
    pub(crate) fn reschedule(
        &self,
        shared: &Shared,
        mut w: Work,
        failed_on: &Path,
        status: Option<WcStatus>,
    ) {
        let Some(shared_arc) = shared.me.upgrade() else {
            return;
        };
        let attempt = match &mut w {
            Work::Slice(s) => {
                s.attempt += 1;
                s.attempt
            }
            Work::Notify { attempt, .. } => {
                *attempt += 1;
                *attempt
            }
        };
        // A notification in doubt (one that failed with this status) is settled here.
        let doubt = match (&w, status) {
            (Work::Notify { seq, .. }, Some(_)) => Some(*seq),
            _ => None,
        };
        if attempt <= shared.config.max_retries {
            if let Work::Notify { .. } = w {
                // After every earlier one still in doubt, on the first usable path.
                return match doubt {
                    Some(seq) => self.note_settled(shared, seq, Some(w)),
                    None => self.send_note(shared, w),
                };
            }
        }
        let target = if attempt > shared.config.max_retries {
            None
        } else {
            self.pick(&shared_arc, &[], w.len())
        };
        let reason = if attempt > shared.config.max_retries {
            format!("retried {} times", shared.config.max_retries)
        } else {
            format!("every path to {} failed", self.peer)
        };
        match target {
            Some(i) => {
                if let Err(w) = self.paths[i].enqueue(w) {
                    fail_work(shared, w, failed_on.closed_failure(&self.peer, status));
                }
            }
            None => {
                fail_work(
                    shared,
                    w,
                    Failure {
                        status,
                        path: failed_on.name.clone(),
                        reason,
                    },
                );
                if let Some(seq) = doubt {
                    self.note_settled(shared, seq, None);
                }
            }
        }
    }

    fn maybe_repair(&self, shared: &Arc<Shared>, p: &Arc<Path>) {
        if !self.initiator || self.closed.load(Ordering::Acquire) {
            return;
        }
        // The repair is claimed before the path is found due: a caller that found it due
        // just before another's repair brought it up (and cleared its due time) would
        // otherwise claim it right after and rebuild it again, replacing the queue pair
        // that work was just posted on, whose completions then never come.
        if p.repairing.swap(true, Ordering::AcqRel) {
            return;
        }
        let due = p.down_until.lock().is_some_and(|t| Instant::now() >= t);
        if !due
            || p.outstanding.load(Ordering::Acquire) != 0
            || p.rail.closed.load(Ordering::Acquire)
            || p.fencing()
        {
            p.repairing.store(false, Ordering::Release);
            return;
        }
        let shared = shared.clone();
        let p = p.clone();
        let _ = std::thread::Builder::new()
            .name("rdmx-te-repair".into())
            .spawn(move || {
                if let Err(e) = crate::handshake::repair(&shared, &p) {
                    tracing::warn!(path = %p.name, error = %e, "rebuilding a transfer path failed");
                    *p.down_until.lock() = Some(Instant::now() + shared.config.set_aside);
                    // With every path down and the peer refusing or gone, the connection
                    // is over: the next open_segment makes a new one.
                    if let Some(c) = p.conn.upgrade() {
                        if c.paths.iter().all(|q| !q.up.load(Ordering::Acquire)) {
                            c.closed.store(true, Ordering::Release);
                        }
                    }
                }
                p.repairing.store(false, Ordering::Release);
            });
    }
}

/// Fails the request (or notification) `w` belongs to.
pub(crate) fn fail_work(shared: &Shared, w: Work, f: Failure) {
    match w {
        Work::Slice(s) => {
            if s.batch.fail(s.req as usize, f) {
                send_notifications(shared, &s.batch);
            }
        }
        Work::Notify { batch, .. } => {
            if let Some(b) = batch {
                b.notify_done(Err(f.to_string()));
            }
        }
    }
}

/// Sends a finished batch's notification to every peer it touched.
pub(crate) fn send_notifications(shared: &Shared, batch: &Arc<BatchState>) {
    let Some(data) = batch.notify.clone() else {
        return;
    };
    let Some(me) = shared.me.upgrade() else {
        return;
    };
    let conns = batch.conns();
    batch.notifying(conns.len());
    for c in conns {
        let w = c.notification(data.clone(), Some(batch.clone()));
        c.send_note(&me, w);
    }
}

/// One connection's share of a batch: work per path, and its bytes per path.
type Plan = (Arc<Conn>, Vec<VecDeque<Work>>, Vec<u64>);

/// Cuts the batch's requests into slices and queues them on the connections' paths.
pub(crate) fn schedule(shared: &Arc<Shared>, batch: &Arc<BatchState>) {
    // Work per path, gathered first and queued with one lock per path.
    let mut plan: Vec<Plan> = Vec::new();
    for (ri, r) in batch.reqs.iter().enumerate() {
        let ci = match plan.iter().position(|(c, _, _)| Arc::ptr_eq(c, &r.conn)) {
            Some(i) => i,
            None => {
                let n = r.conn.paths.len();
                plan.push((
                    r.conn.clone(),
                    (0..n).map(|_| VecDeque::new()).collect(),
                    vec![0; n],
                ));
                plan.len() - 1
            }
        };
        let (conn, works, extra) = &mut plan[ci];
        let slice = shared.config.slice_size_for(conn.transport) as u64;
        let tail = slice / 4;
        let mut cuts = r.len / slice;
        if r.len % slice >= tail || cuts == 0 {
            cuts += 1;
        }
        r.slices_left.store(cuts as u32, Ordering::Release);
        let mut off = 0;
        for k in 0..cuts {
            let len = if k + 1 == cuts { r.len - off } else { slice };
            let w = Work::Slice(Slice {
                batch: batch.clone(),
                req: ri as u32,
                off,
                len: len as u32,
                attempt: 0,
                invalid_once: false,
            });
            match conn.pick(shared, extra, len) {
                Some(i) => {
                    extra[i] += len;
                    works[i].push_back(w);
                }
                None => {
                    fail_work(
                        shared,
                        w,
                        Failure {
                            status: None,
                            path: "-".into(),
                            reason: format!("no usable path to {}", conn.peer),
                        },
                    );
                    break;
                }
            }
            off += len;
        }
    }
    for (conn, works, extra) in plan {
        for ((p, w), e) in conn.paths.iter().zip(works).zip(extra) {
            if w.is_empty() {
                continue;
            }
            match p.queue_if_open() {
                Some(mut q) => {
                    p.queued.fetch_add(e, Ordering::Relaxed);
                    q.extend(w);
                    drop(q);
                    p.rail.kick();
                }
                // The connection closed since the plan was made (replaced by a new one,
                // or its peer gone).
                None => {
                    for w in w {
                        fail_work(shared, w, p.closed_failure(&conn.peer, None));
                    }
                }
            }
        }
    }
}

/// Marks request `i` in flight (first slice posted).
pub(crate) fn mark_in_flight(batch: &BatchState, i: usize) {
    let _ = batch.reqs[i].state.compare_exchange(
        WAITING,
        IN_FLIGHT,
        Ordering::AcqRel,
        Ordering::Acquire,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A send-queue request's id never reads as a receive's, whatever its tag (the
    /// worker's tag counter runs on for as long as the engine does), and reads back as
    /// its key and tag.
    #[test]
    fn send_ids_never_read_as_receives() {
        for tag in [0, 1, TAG_MASK - 1, TAG_MASK, TAG_MASK + 1, u32::MAX] {
            for key in [0, 1, 0xffff, u32::MAX as usize] {
                let id = send_wr_id(key, tag);
                assert_eq!(parse_recv(id), None, "key {key} tag {tag:#x}");
                let (k, t) = parse_send(id);
                assert_eq!(k as u64, key as u64 & 0xffff_ffff, "key {key} tag {tag:#x}");
                assert_eq!(t, tag & TAG_MASK, "key {key} tag {tag:#x}");
            }
        }
    }

    /// Access and local errors end the work on the path they hit; an invalid-request NAK
    /// sends it on another path once and ends it the second time; other failures (the
    /// path's, such as a retry count exceeded or a flush) never end it here.
    #[test]
    fn an_invalid_request_is_final_the_second_time_only() {
        let note = || Work::Notify {
            data: Arc::from(&b"x"[..]),
            batch: None,
            attempt: 0,
            seq: 0,
            invalid_once: false,
        };
        for status in [
            WcStatus::RemAccessErr,
            WcStatus::LocProtErr,
            WcStatus::LocLenErr,
        ] {
            assert!(note().refusal_is_final(status), "{status:?}");
        }
        for status in [
            WcStatus::RetryExcErr,
            WcStatus::WrFlushErr,
            WcStatus::RnrRetryExcErr,
        ] {
            let mut w = note();
            assert!(!w.refusal_is_final(status), "{status:?}");
            assert!(!w.refusal_is_final(status), "{status:?} again");
        }
        let mut w = note();
        assert!(!w.refusal_is_final(WcStatus::RetryExcErr));
        assert!(!w.refusal_is_final(WcStatus::RemInvReqErr), "first");
        assert!(!w.refusal_is_final(WcStatus::RetryExcErr));
        assert!(w.refusal_is_final(WcStatus::RemInvReqErr), "second");
    }
}
