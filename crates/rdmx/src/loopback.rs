//! The loopback provider: queue pairs of this process connected through the RC engine,
//! with packets passed in memory.
//!
//! Every loopback queue pair lives in one process-wide fabric, addressed by its QP
//! number. Progress is made from the calling thread: each verb that can change a queue
//! pair (post, modify, poll) pumps the fabric until nothing moves, delivering packets,
//! routing completions to their CQs and firing due timers, so one-sided operations
//! complete as soon as either side calls in. The fabric is serialised by one lock; it is
//! the reference for semantics, not for speed.
//!
//! A context opened with [`Faults`](crate::faults::Faults) has the packets its queue pairs
//! send dropped, delayed, duplicated, reordered or corrupted on their way here
//! ([`crate::faults`]); delayed packets wait in the fabric until they are due.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use parking_lot::Mutex;
use rdmx_core::rc::{QpConfig, RcQp, Srq};
use rdmx_core::QpLimits;

use crate::context::ContextInner;
use crate::cq::CompletionQueue;
use crate::faults::{self, Rng, Wire};

pub(crate) struct Entry {
    pub(crate) engine: RcQp<ContextInner>,
    pub(crate) ctx: Arc<ContextInner>,
    pub(crate) send_cq: CompletionQueue,
    pub(crate) recv_cq: CompletionQueue,
    /// The shared receive queue the QP takes its receives from.
    pub(crate) srq: Option<u32>,
    /// With fault injection: the QP's generator, and a packet held back for reordering.
    faults: Option<(Rng, Option<Wire>)>,
}

pub(crate) struct SrqEntry {
    pub(crate) srq: Srq<crate::mr::MrRef>,
    pub(crate) ctx: Arc<ContextInner>,
}

#[derive(Default)]
pub(crate) struct Fabric {
    pub(crate) qps: HashMap<u32, Entry>,
    pub(crate) srqs: HashMap<u32, SrqEntry>,
    next_qpn: u32,
    next_srq: u32,
    /// Delayed packets: when each is due, and who sent it.
    delayed: Vec<(Instant, u32, Wire)>,
}

pub(crate) fn fabric() -> &'static Mutex<Fabric> {
    static FABRIC: OnceLock<Mutex<Fabric>> = OnceLock::new();
    FABRIC.get_or_init(|| {
        Mutex::new(Fabric {
            qps: HashMap::new(),
            srqs: HashMap::new(),
            // QP numbers 0 and 1 are special in InfiniBand.
            next_qpn: 0x11,
            next_srq: 1,
            delayed: Vec::new(),
        })
    })
}

impl Fabric {
    pub(crate) fn create(
        &mut self,
        ctx: Arc<ContextInner>,
        mut cfg: QpConfig,
        send_cq: CompletionQueue,
        recv_cq: CompletionQueue,
        srq: Option<u32>,
    ) -> u32 {
        let qpn = self.next_qpn;
        self.next_qpn = (self.next_qpn + 1) & 0xff_ffff;
        cfg.qpn = qpn;
        cfg.srq = srq.is_some();
        let faults = ctx.faults.as_ref().map(|i| (i.rng(qpn), None));
        self.qps.insert(
            qpn,
            Entry {
                engine: RcQp::new(cfg, limits()),
                ctx,
                send_cq,
                recv_cq,
                srq,
                faults,
            },
        );
        qpn
    }

    pub(crate) fn create_srq(&mut self, srq: SrqEntry) -> u32 {
        let id = self.next_srq;
        self.next_srq += 1;
        self.srqs.insert(id, srq);
        id
    }

    /// Runs every queue pair until no packet, completion or due timer is left.
    pub(crate) fn pump(&mut self) {
        let now = Instant::now();
        loop {
            let mut moved = self.deliver_due(now);
            let qpns: Vec<u32> = self.qps.keys().copied().collect();
            for qpn in qpns {
                let mut packets = Vec::new();
                if let Some(e) = self.qps.get_mut(&qpn) {
                    if e.engine.poll_timeout().is_some_and(|t| t <= now) {
                        e.engine.handle_timeout(now);
                    }
                    while let Some(p) = e.engine.poll_transmit(now, &e.ctx) {
                        packets.push(Wire::plain(e.engine.dest_qpn(), p));
                    }
                    moved |= route_completions(e);
                }
                for w in packets {
                    moved = true;
                    self.send(qpn, w, now);
                }
            }
            if !moved {
                // Packets held back for reordering go once nothing overtakes them.
                moved = self.release_held(now);
            }
            if !moved {
                break;
            }
        }
    }

    /// The earliest instant a delayed packet is due.
    pub(crate) fn next_delayed(&self) -> Option<Instant> {
        self.delayed.iter().map(|(t, _, _)| *t).min()
    }

    /// Sends `w` from QP `from`, through its context's faults if it has any.
    fn send(&mut self, from: u32, w: Wire, now: Instant) {
        let Some(e) = self.qps.get_mut(&from) else {
            return;
        };
        let (Some(inj), Some((rng, held))) = (e.ctx.faults.clone(), e.faults.as_mut()) else {
            self.deliver(None, w, now);
            return;
        };
        let fate = faults::apply(&inj, rng, now, w.dest, w.bytes);
        let overtaken = match fate.hold {
            Some(h) => held.replace(h),
            None => held.take(),
        };
        if let Some((at, w)) = fate.later {
            self.delayed.push((at, from, w));
        }
        for w in fate.now {
            self.deliver(Some(&inj), w, now);
        }
        // A packet held back goes after the one that overtook it.
        if let Some(w) = overtaken {
            self.deliver(Some(&inj), w, now);
        }
    }

    fn deliver_due(&mut self, now: Instant) -> bool {
        let mut due = Vec::new();
        let mut i = 0;
        while i < self.delayed.len() {
            if self.delayed[i].0 <= now {
                due.push(self.delayed.swap_remove(i));
            } else {
                i += 1;
            }
        }
        due.sort_by_key(|(t, _, _)| *t);
        let moved = !due.is_empty();
        for (_, from, w) in due {
            let inj = self.qps.get(&from).and_then(|e| e.ctx.faults.clone());
            self.deliver(inj.as_deref(), w, now);
        }
        moved
    }

    fn release_held(&mut self, now: Instant) -> bool {
        let mut held = Vec::new();
        for e in self.qps.values_mut() {
            if let Some((_, h)) = e.faults.as_mut() {
                if let Some(w) = h.take() {
                    held.push((e.ctx.faults.clone(), w));
                }
            }
        }
        let moved = !held.is_empty();
        for (inj, w) in held {
            self.deliver(inj.as_deref(), w, now);
        }
        moved
    }

    /// Hands `w` to its destination QP, unless it fails its CRC check.
    fn deliver(&mut self, inj: Option<&faults::Injector>, w: Wire, now: Instant) {
        if !w.intact(inj) {
            return;
        }
        let Fabric { qps, srqs, .. } = self;
        if let Some(peer) = qps.get_mut(&w.dest) {
            let srq = peer
                .srq
                .and_then(|id| srqs.get_mut(&id))
                .map(|e| &mut e.srq);
            peer.engine.handle_packet_srq(now, &peer.ctx, srq, &w.bytes);
        }
    }
}

fn route_completions(e: &mut Entry) -> bool {
    crate::cq::route_completions(&mut e.engine, &e.send_cq, &e.recv_cq)
}

/// Pumps the fabric from a verb that does not otherwise touch it (polling a CQ).
pub(crate) fn progress() {
    fabric().lock().pump();
}

/// Starts, once per process, the thread that fires timers (retransmission, the end of an
/// RNR wait) when no application thread calls in, so a request completes even while the
/// application only waits on a CQ's descriptor.
pub(crate) fn start_progress_thread() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        let spawned = std::thread::Builder::new()
            .name("rdmx-loopback".into())
            .spawn(|| loop {
                let next = {
                    let mut fab = fabric().lock();
                    fab.pump();
                    fab.qps
                        .values()
                        .filter_map(|e| e.engine.poll_timeout())
                        .chain(fab.next_delayed())
                        .min()
                };
                let now = Instant::now();
                let idle = std::time::Duration::from_millis(50);
                let wait = next.map_or(idle, |t| t.saturating_duration_since(now).min(idle));
                std::thread::sleep(wait.max(std::time::Duration::from_micros(20)));
            });
        if let Err(e) = spawned {
            tracing::warn!(
                "cannot start the loopback progress thread ({e}); progress is made only \
                 when the application calls in"
            );
        }
    });
}

/// Limits of loopback queue pairs.
pub(crate) fn limits() -> QpLimits {
    QpLimits::default()
}
