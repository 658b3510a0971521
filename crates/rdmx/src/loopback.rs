//! The loopback provider: queue pairs of this process connected through the RC engine,
//! with packets passed in memory.
//!
//! Every loopback queue pair lives in one process-wide fabric, addressed by its QP
//! number. Progress is made from the calling thread: each verb that can change a queue
//! pair (post, modify, poll) pumps the fabric until nothing moves, delivering packets,
//! routing completions to their CQs and firing due timers, so one-sided operations
//! complete as soon as either side calls in. The fabric is serialised by one lock; it is
//! the reference for semantics, not for speed.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use parking_lot::Mutex;
use rdmx_core::rc::{QpConfig, RcQp, Srq};
use rdmx_core::QpLimits;

use crate::context::ContextInner;
use crate::cq::CompletionQueue;

pub(crate) struct Entry {
    pub(crate) engine: RcQp<ContextInner>,
    pub(crate) ctx: Arc<ContextInner>,
    pub(crate) send_cq: CompletionQueue,
    pub(crate) recv_cq: CompletionQueue,
    /// The shared receive queue the QP takes its receives from.
    pub(crate) srq: Option<u32>,
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
        self.qps.insert(
            qpn,
            Entry {
                engine: RcQp::new(cfg, limits()),
                ctx,
                send_cq,
                recv_cq,
                srq,
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
            let mut moved = false;
            let qpns: Vec<u32> = self.qps.keys().copied().collect();
            for qpn in qpns {
                let mut packets = Vec::new();
                if let Some(e) = self.qps.get_mut(&qpn) {
                    if e.engine.poll_timeout().is_some_and(|t| t <= now) {
                        e.engine.handle_timeout(now);
                    }
                    while let Some(p) = e.engine.poll_transmit(now, &e.ctx) {
                        packets.push((e.engine.dest_qpn(), p));
                    }
                    moved |= route_completions(e);
                }
                for (dest, p) in packets {
                    moved = true;
                    let Fabric { qps, srqs, .. } = self;
                    if let Some(peer) = qps.get_mut(&dest) {
                        let srq = peer
                            .srq
                            .and_then(|id| srqs.get_mut(&id))
                            .map(|e| &mut e.srq);
                        peer.engine.handle_packet_srq(now, &peer.ctx, srq, &p);
                    }
                }
            }
            if !moved {
                break;
            }
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
