//! A rail's worker thread: posts the slices queued on the rail's paths (up to each queue
//! pair's depth), reaps the rail's completion queue, accounts completed slices to their
//! requests, sends failed ones elsewhere, delivers notifications, fails slices that
//! exceed the timeout, and measures each path's bandwidth.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmx::{Completion, LocalSge, MemoryRegion, SendRequest, WcStatus};
use slab::Slab;

use crate::batch::{Failure, Op};
use crate::engine::{Notification, Shared};
use crate::path::{mark_in_flight, parse_recv, send_notifications, Path, RailRt, Work};

struct Inflight {
    work: Work,
    path: Arc<Path>,
    qp_num: u32,
    tag: u32,
    /// When it is late: `timeout` after it was posted, then `timeout` after its path
    /// was set aside for it (`stalled`).
    deadline: Instant,
    /// Late once: its path was set aside (its queue pair moved to the error state, which
    /// flushes it back here to be retried elsewhere).
    stalled: bool,
    /// Late twice (not even flushed): its request failed; a completion is ignored.
    expired: bool,
    // A notification's registered copy, kept until its completion.
    _mr: Option<MemoryRegion>,
}

pub(crate) fn run(shared: Arc<Shared>, rail: Arc<RailRt>) {
    let mut w = Worker {
        slab: Slab::with_capacity(1024),
        tag: 0,
        last_scan: Instant::now(),
        last_bw: Instant::now(),
        last_progress: Instant::now(),
        shared,
        rail,
    };
    w.run();
}

struct Worker {
    shared: Arc<Shared>,
    rail: Arc<RailRt>,
    slab: Slab<Inflight>,
    tag: u32,
    last_scan: Instant,
    last_bw: Instant,
    /// When a poll last reaped a completion or something was posted.
    last_progress: Instant,
}

impl Worker {
    fn run(&mut self) {
        let mut wc = vec![Completion::default(); 64];
        let mut paths: Vec<Arc<Path>> = Vec::new();
        while !self.rail.stop.load(Ordering::Acquire) {
            paths.clear();
            paths.extend(self.rail.paths.lock().iter().cloned());
            let mut posted = 0;
            for p in &paths {
                posted += self.post(p);
            }
            let n = match self.rail.cq.poll(&mut wc) {
                Ok(n) => n,
                Err(e) => {
                    tracing::error!(rail = self.rail.index, error = %e, "polling a rail failed");
                    0
                }
            };
            for c in &wc[..n] {
                self.complete(c);
            }
            let now = Instant::now();
            if now.duration_since(self.last_scan) >= Duration::from_millis(50) {
                self.scan(now);
            }
            if now.duration_since(self.last_bw) >= Duration::from_millis(20) {
                self.measure(&paths, now);
            }
            if n > 0 || posted > 0 {
                self.last_progress = now;
            } else if !self.slab.is_empty()
                && now.duration_since(self.last_progress) < self.shared.config.spin
            {
                // Work in flight that moved a moment ago: its completions are near. Polling
                // on (as a bandwidth test's requester does) beats sleeping and being woken
                // by the provider's thread for each of them; the core is offered to others.
                std::thread::yield_now();
                continue;
            }
            if n == 0 && posted == 0 {
                self.rail.sleeping.store(true, Ordering::SeqCst);
                // Work queued before the flag was seen is found here; later work kicks.
                let queued = paths.iter().any(|p| {
                    !p.pending.lock().is_empty()
                        && (!p.up.load(Ordering::Acquire)
                            || (p.outstanding.load(Ordering::Acquire) as usize)
                                < self.shared.config.queue_depth)
                });
                if !queued && !self.rail.stop.load(Ordering::Acquire) {
                    // Arm, poll once more (a completion before arming does not notify),
                    // then sleep until a completion or a kick.
                    self.rail.cq.req_notify(false);
                    let n = self.rail.cq.poll(&mut wc).unwrap_or(0);
                    if n == 0 {
                        let _ = self.rail.cq.wait_event(Duration::from_millis(50));
                    }
                    self.rail.sleeping.store(false, Ordering::SeqCst);
                    for c in &wc[..n] {
                        self.complete(c);
                    }
                } else {
                    self.rail.sleeping.store(false, Ordering::SeqCst);
                }
            }
        }
        // The engine is being dropped: what is in flight here gets no completion any
        // more (its queue pairs are gone), and fails now rather than at its waiter's
        // timeout.
        for e in self.slab.drain() {
            if !e.expired {
                let f = e.path.dropped_failure(None);
                crate::path::fail_work(&self.shared, e.work, f);
            }
        }
    }

    /// Posts what `p` has queued, up to its depth; returns how many.
    fn post(&mut self, p: &Arc<Path>) -> usize {
        let depth = self.shared.config.queue_depth as u32;
        if !p.up.load(Ordering::Acquire) {
            // Work queued just as the path went down: send it elsewhere.
            let stranded: Vec<Work> = p.pending.lock().drain(..).collect();
            if !stranded.is_empty() {
                let bytes: u64 = stranded.iter().map(Work::len).sum();
                sub_sat(&p.queued, bytes);
                match p.conn.upgrade() {
                    Some(conn) => {
                        for w in stranded {
                            conn.reschedule(&self.shared, w, p, None);
                        }
                    }
                    None => {
                        for w in stranded {
                            let f = p.closed_failure("the peer", None);
                            crate::path::fail_work(&self.shared, w, f);
                        }
                    }
                }
            }
            return 0;
        }
        if p.outstanding.load(Ordering::Acquire) >= depth {
            return 0;
        }
        let Some(qp) = p.qp.lock().clone() else {
            return 0;
        };
        let mut n = 0;
        while p.outstanding.load(Ordering::Acquire) < depth {
            let w = {
                let mut q = p.pending.lock();
                let Some(w) = q.pop_front() else {
                    break;
                };
                // A notification counts as in flight from when it leaves the queue, under
                // the queue's lock: a failure of the path meanwhile (from another thread)
                // either still finds it queued or sees it counted (`notes`).
                if let Work::Notify { .. } = w {
                    p.notes_posted.fetch_add(1, Ordering::AcqRel);
                }
                w
            };
            let len = w.len();
            sub_sat(&p.queued, len);
            let key = self.slab.vacant_key();
            self.tag = self.tag.wrapping_add(1) & crate::path::TAG_MASK;
            let wr_id = crate::path::send_wr_id(key, self.tag);
            let res = match &w {
                Work::Slice(s) => {
                    let r = &s.batch.reqs[s.req as usize];
                    if s.batch.is_finished(s.req as usize) {
                        // Its request failed meanwhile: nothing to do.
                        continue;
                    }
                    let key = r.desc.buffers[r.rbuf as usize]
                        .keys
                        .get(p.remote_rail as usize);
                    let remote = key.map(|&(addr, rkey)| rdmx::RemoteAddr {
                        addr: addr + r.roff + s.off,
                        rkey,
                    });
                    let mrs = r.local.inner.mrs.read();
                    match (remote, mrs.get(self.rail.index)) {
                        (None, _) => Err(crate::Error::Descriptor(format!(
                            "the peer's descriptor has no key on the rail of path {}",
                            p.name
                        ))),
                        (_, None) => Err(crate::segment::unregistered(r.local.name())),
                        (Some(remote), Some(mr)) => {
                            LocalSge::new(mr, (r.local_off + s.off) as usize, s.len as usize)
                                .map_err(crate::Error::from)
                                .and_then(|sge| {
                                    let req = match r.op {
                                        Op::Write => SendRequest::write(wr_id, remote),
                                        Op::Read => SendRequest::read(wr_id, remote),
                                    };
                                    qp.post_send(req.sge(sge)).map_err(crate::Error::from)
                                })
                                .map(|()| None)
                        }
                    }
                }
                &Work::Notify { ref data, seq, .. } => self
                    .rail
                    .pd
                    .register(data.to_vec(), rdmx::Access::LOCAL_WRITE)
                    .map_err(crate::Error::from)
                    .and_then(|mr| {
                        let sge = LocalSge::new(&mr, 0, data.len())?;
                        let mut req = SendRequest::send_with_imm(wr_id, seq);
                        if !data.is_empty() {
                            req = req.sge(sge);
                        }
                        qp.post_send(req)?;
                        Ok(Some(mr))
                    }),
            };
            match res {
                Ok(mr) => {
                    if let Work::Slice(s) = &w {
                        mark_in_flight(&s.batch, s.req as usize);
                    }
                    p.outstanding.fetch_add(1, Ordering::AcqRel);
                    p.in_flight.fetch_add(len, Ordering::Relaxed);
                    self.slab.insert(Inflight {
                        work: w,
                        path: p.clone(),
                        qp_num: qp.qp_num(),
                        tag: self.tag,
                        deadline: Instant::now() + self.shared.config.timeout,
                        stalled: false,
                        expired: false,
                        _mr: mr,
                    });
                    n += 1;
                }
                Err(e) => {
                    // A notification not in flight after all: it stops counting once it
                    // waits in the gate again (`reschedule`, after the path's failure), so
                    // that the ones queued behind it do not go first.
                    let note = match &w {
                        Work::Notify { .. } => p.conn.upgrade(),
                        Work::Slice(_) => None,
                    };
                    // The local side refused (unregistered buffer, a queue pair in error):
                    // a request error if the buffer went away, else the path's failure.
                    match (&w, &e) {
                        (Work::Slice(s), crate::Error::Invalid(_)) => {
                            let f = Failure {
                                status: None,
                                path: p.name.clone(),
                                reason: e.to_string(),
                            };
                            if s.batch.fail(s.req as usize, f) {
                                send_notifications(&self.shared, &s.batch);
                            }
                        }
                        _ => {
                            tracing::debug!(path = %p.name, error = %e, "post refused");
                            match p.conn.upgrade() {
                                Some(conn) => {
                                    p.fail(&self.shared);
                                    conn.reschedule(&self.shared, w, p, None);
                                }
                                None => {
                                    let f = p.closed_failure("the peer", None);
                                    crate::path::fail_work(&self.shared, w, f);
                                }
                            }
                            if let Some(conn) = note {
                                conn.note_completed(&self.shared, p);
                            }
                            return n;
                        }
                    }
                }
            }
        }
        n
    }

    fn complete(&mut self, c: &Completion) {
        if let Some((path_id, slot)) = parse_recv(c.wr_id) {
            self.received(c, path_id, slot);
            return;
        }
        let (key, tag) = crate::path::parse_send(c.wr_id);
        match self.slab.get(key) {
            Some(e) if e.tag == tag && e.qp_num == c.qp_num => {}
            _ => return,
        }
        let e = self.slab.remove(key);
        let p = e.path;
        let len = e.work.len();
        sub_sat(&p.in_flight, len);
        if c.status == WcStatus::Success || e.expired {
            p.outstanding.fetch_sub(1, Ordering::AcqRel);
        }
        if c.status == WcStatus::Success && !e.expired {
            p.done_bytes.fetch_add(len, Ordering::Relaxed);
            match e.work {
                Work::Slice(s) => {
                    if s.batch.slice_done(s.req as usize, s.len as u64) {
                        send_notifications(&self.shared, &s.batch);
                    }
                }
                Work::Notify { batch, .. } => {
                    if let Some(b) = batch {
                        b.notify_done(Ok(()));
                    }
                    if let Some(conn) = p.conn.upgrade() {
                        conn.note_completed(&self.shared, &p);
                    }
                }
            }
            return;
        }
        if e.expired {
            return;
        }
        let mut work = e.work;
        let refused = work.refusal_is_final(c.status);
        // A notification to go again: the later ones wait for it (before the path's
        // failure lets them take another).
        let note = match (&work, p.conn.upgrade()) {
            (&Work::Notify { seq, .. }, Some(conn)) => {
                if !refused {
                    conn.note_in_doubt(seq);
                }
                Some(conn)
            }
            _ => None,
        };
        p.fail(&self.shared);
        match p.conn.upgrade() {
            // Sent again elsewhere (once the peer confirms this path takes nothing more).
            Some(_) if !refused => p.retry_fenced(&self.shared, work, c.status, e.qp_num),
            conn => crate::path::fail_work(
                &self.shared,
                work,
                Failure {
                    status: Some(c.status),
                    path: p.name.clone(),
                    reason: match conn {
                        Some(_) if c.status == WcStatus::RemInvReqErr => {
                            "the request was refused as invalid again on its next attempt".into()
                        }
                        Some(_) => "the request was refused; not tried on another path".into(),
                        None => "the connection is closed".into(),
                    },
                },
            ),
        }
        if let Some(conn) = note {
            conn.note_completed(&self.shared, &p);
        }
        // Only now: the path is not rebuilt while this work is on its way elsewhere (its
        // fence asked for first).
        p.outstanding.fetch_sub(1, Ordering::AcqRel);
    }

    fn received(&mut self, c: &Completion, path_id: u32, slot: usize) {
        let path = self
            .rail
            .paths
            .lock()
            .iter()
            .find(|p| p.id == path_id)
            .cloned();
        let Some(p) = path else { return };
        let Some(qp) = p.qp.lock().clone() else {
            return;
        };
        if qp.qp_num() != c.qp_num {
            return;
        }
        if c.status != WcStatus::Success {
            if c.status != WcStatus::WrFlushErr {
                tracing::debug!(path = %p.name, status = ?c.status, "receive failed");
            }
            p.fail(&self.shared);
            return;
        }
        let len = (c.byte_len as usize).min(crate::MAX_NOTIFY);
        let mut data = vec![0u8; len];
        if p.recv_mr
            .read_at(slot * crate::MAX_NOTIFY, &mut data)
            .is_ok()
        {
            // Numbered by the sender (immediate data): one sent again after its path
            // failed, although the first attempt arrived, comes twice.
            let conn = p.conn.upgrade();
            let again = c.imm_data.zip(conn.as_ref()).is_some_and(|(seq, conn)| {
                conn.notes_seen.lock().arrived(seq) == crate::seen::Verdict::Again
            });
            if again {
                tracing::debug!(path = %p.name, "a notification that arrived before: dropped");
            } else {
                let from = conn.map(|c| c.peer.clone()).unwrap_or_default();
                self.shared.deliver(Notification { from, data });
            }
        }
        if let Err(e) = p.post_recv(&qp, slot) {
            tracing::debug!(path = %p.name, error = %e, "reposting a receive failed");
        }
    }

    /// Slices in flight longer than the timeout: the first time, their path is set
    /// aside (its queue pair moved to the error state, so they flush and are retried on
    /// other paths, as after an error completion: a peer or link that went silent,
    /// e.g. a destroyed remote queue pair the device keeps retrying at); if even that
    /// brings no completion within another timeout, their requests fail.
    fn scan(&mut self, now: Instant) {
        self.last_scan = now;
        let timeout = self.shared.config.timeout;
        let mut stalled = Vec::new();
        let mut late = Vec::new();
        for (k, e) in self.slab.iter_mut() {
            if e.expired || now < e.deadline {
                continue;
            }
            e.deadline = now + timeout;
            if e.stalled {
                e.expired = true;
                late.push(k);
            } else {
                e.stalled = true;
                stalled.push(k);
            }
        }
        for k in stalled {
            let p = self.slab[k].path.clone();
            if p.fail(&self.shared) {
                tracing::info!(path = %p.name, "no completion within {timeout:?}; path set aside");
            }
        }
        for k in late {
            let e = &self.slab[k];
            let p = e.path.clone();
            let f = Failure {
                status: None,
                path: p.name.clone(),
                reason: format!(
                    "no completion within {timeout:?}, nor a flush within {timeout:?} after \
                     its path was set aside"
                ),
            };
            match &e.work {
                Work::Slice(s) => {
                    if s.batch.fail(s.req as usize, f) {
                        send_notifications(&self.shared, &s.batch);
                    }
                }
                Work::Notify { batch, .. } => {
                    if let Some(b) = batch {
                        b.notify_done(Err(f.to_string()));
                    }
                    // Given up: the later ones need not wait for its completion.
                    if let Some(conn) = p.conn.upgrade() {
                        conn.note_completed(&self.shared, &p);
                    }
                }
            }
            p.fail(&self.shared);
        }
    }

    /// Bandwidth per path: bytes completed over the last interval, smoothed; a path with
    /// nothing in flight keeps its estimate.
    fn measure(&mut self, paths: &[Arc<Path>], now: Instant) {
        let dt = now.duration_since(self.last_bw).as_secs_f64();
        self.last_bw = now;
        for p in paths {
            let done = p.done_bytes.swap(0, Ordering::Relaxed);
            if done == 0 {
                continue;
            }
            let rate = done as f64 / dt;
            let old = p.bw.load(Ordering::Relaxed) as f64;
            p.bw.store((old * 0.7 + rate * 0.3) as u64, Ordering::Relaxed);
        }
    }
}

/// Subtracts, stopping at zero (a counter reset while work was on its way).
fn sub_sat(a: &std::sync::atomic::AtomicU64, v: u64) {
    let _ = a.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |x| {
        Some(x.saturating_sub(v))
    });
}
