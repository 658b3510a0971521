//! A queue pair of the udp provider: the RC engine, and the peer its packets go to.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rdmx_core::rc::Srq;

use rdmx_core::rc::Transmit;

use super::driver::Driver;
use super::sys::{Packet, BATCH};
use crate::provider::{CqCore, MrRef};
use crate::soft::{self, Engine, Keys};

/// Most datagrams one [`UdpQp::pump`] sends: the rest of a long burst (a large READ's
/// responses) goes at the driver's next step, so that one request does not hold the
/// driver from the context's other queue pairs until it is all sent.
const PUMP_DATAGRAMS: usize = 256;

/// A udp queue pair, shared by its handle and the driver.
pub(crate) struct UdpQp {
    pub(crate) qpn: u32,
    pub(crate) driver: Arc<Driver>,
    pub(crate) inner: Mutex<Inner>,
}

impl std::fmt::Debug for UdpQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UdpQp").field("qpn", &self.qpn).finish()
    }
}

pub(crate) struct Inner {
    pub(crate) engine: Engine,
    pub(crate) keys: Arc<Keys>,
    pub(crate) send_cq: Arc<CqCore>,
    pub(crate) recv_cq: Arc<CqCore>,
    pub(crate) srq: Option<Arc<Mutex<Srq<MrRef>>>>,
    /// Where the peer QP is: the only source its packets are taken from, and where this
    /// QP's packets go.
    pub(crate) peer: Option<SocketAddr>,
    /// The peer is a RoCE port named by its GID (verbs: Linux rxe, an adapter), which
    /// sends from a source port of its choosing: only its address is compared.
    pub(crate) any_port: bool,
    /// Packets built and not yet sent.
    tx: Vec<Packet>,
    /// Sent packets, their buffers kept for reuse (holding no registered memory).
    spare: Vec<Packet>,
    /// What the engine fills with the next packet.
    scratch: Transmit<MrRef>,
    /// The deadlines of this QP's entries in the driver's timer heap (see `soft::Armed`).
    pub(crate) timer: soft::Armed,
    /// A pump stopped at [`PUMP_DATAGRAMS`] and asked the driver to time the QP out at
    /// once, to send the rest.
    resume: bool,
    /// With fault injection: the QP's generator and a datagram held back.
    #[cfg(feature = "testing")]
    pub(crate) faults: Option<(crate::loopback::faults::Rng, Option<Vec<u8>>)>,
}

impl UdpQp {
    pub(crate) fn new(
        qpn: u32,
        driver: Arc<Driver>,
        engine: Engine,
        keys: Arc<Keys>,
        cqs: (Arc<CqCore>, Arc<CqCore>),
        srq: Option<Arc<Mutex<Srq<MrRef>>>>,
    ) -> UdpQp {
        #[cfg(feature = "testing")]
        let faults = driver.faults.as_ref().map(|inj| (inj.rng(qpn), None));
        UdpQp {
            qpn,
            inner: Mutex::new(Inner {
                engine,
                keys,
                send_cq: cqs.0,
                recv_cq: cqs.1,
                srq,
                peer: None,
                any_port: false,
                tx: Vec::with_capacity(BATCH),
                spare: Vec::new(),
                scratch: Transmit::default(),
                timer: soft::Armed::default(),
                resume: false,
                #[cfg(feature = "testing")]
                faults,
            }),
            driver,
        }
    }

    /// The QP's handle went (`ibv_destroy_qp`): drops everything the QP holds of
    /// registered memory — its requests and receives, packets built and not sent — so
    /// that none of it outlives the handle, even while the driver still holds the QP for
    /// a datagram or timer it is handling.
    pub(crate) fn release(&self) {
        let mut g = self.inner.lock();
        g.tx.clear();
        g.scratch = Transmit::default();
        g.srq = None;
        g.engine.destroy();
    }

    /// Runs `f` on the engine, then sends what it produced and routes completions.
    pub(crate) fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        let mut g = self.inner.lock();
        let out = f(&mut g);
        self.pump(&mut g, Instant::now());
        out
    }

    /// Feeds one packet (its ICRC checked and removed) from the peer.
    pub(crate) fn handle(&self, g: &mut Inner, now: Instant, packet: &[u8]) {
        let Inner {
            engine, keys, srq, ..
        } = g;
        let mut srq = srq.as_ref().map(|s| s.lock());
        engine.handle_packet_srq(now, &**keys, srq.as_deref_mut(), packet);
    }

    /// The timer set for `at` fired: the engine's deadline may have come.
    pub(crate) fn timeout(&self, g: &mut Inner, at: Instant, now: Instant) {
        g.timer.fired(at);
        g.resume = false;
        if g.engine.poll_timeout().is_some_and(|t| t <= now) {
            g.engine.handle_timeout(now);
        }
        self.pump(g, now);
    }

    /// Sends what the engine has, in batches, routes its completions and arms its timer.
    pub(crate) fn pump(&self, g: &mut Inner, now: Instant) {
        if g.engine.config().qp_type == rdmx_core::QpType::Ud {
            // Each datagram has its own destination.
            super::ud::pump(self, g, now);
            return;
        }
        let local = self.driver.local;
        let mut sent = 0;
        loop {
            let mut more = true;
            while g.tx.len() < BATCH {
                let Inner {
                    engine, scratch, ..
                } = &mut *g;
                if !engine.poll_transmit_parts(now, scratch) {
                    more = false;
                    break;
                }
                match g.peer {
                    Some(peer) => {
                        let mut p = g.spare.pop().unwrap_or_default();
                        p.seal(&mut g.scratch, local, peer);
                        g.tx.push(p);
                    }
                    // Connected without a peer (modified by hand): nowhere to send.
                    None => {
                        self.driver.stats.count_unrouted();
                        g.scratch.gather.clear();
                    }
                }
            }
            if let (Some(peer), false) = (g.peer, g.tx.is_empty()) {
                self.send(g, peer, now);
            }
            let Inner { tx, spare, .. } = &mut *g;
            for mut p in tx.drain(..) {
                p.release();
                spare.push(p);
            }
            if !more {
                break;
            }
            sent += BATCH;
            if sent >= PUMP_DATAGRAMS {
                // Later than the `now` of the timer round this may run in: the rest goes
                // at the next step, after the other QPs had theirs.
                if !g.resume {
                    g.resume = true;
                    self.driver
                        .schedule(Instant::now() + Duration::from_nanos(1), self.qpn);
                }
                break;
            }
        }
        #[cfg(feature = "testing")]
        if let (Some(peer), Some((_, held))) = (g.peer, g.faults.as_mut()) {
            // A datagram held back for reordering goes once nothing else overtakes it.
            if let Some(d) = held.take() {
                self.driver.send_now(peer, &mut [d]);
            }
        }
        soft::route_completions(&mut g.engine, &g.send_cq, &g.recv_cq);
        // Only a deadline that no entry the driver holds fires by is handed over; a later
        // one is found when an earlier fires.
        if let Some(t) = g.engine.poll_timeout() {
            if g.timer.arm(t) {
                self.driver.schedule(t, self.qpn);
            }
        }
    }

    #[cfg(not(feature = "testing"))]
    fn send(&self, g: &mut Inner, peer: SocketAddr, _now: Instant) {
        self.driver.send_now(peer, &mut g.tx);
    }

    /// Sends the batch, through the context's faults if it has any.
    #[cfg(feature = "testing")]
    fn send(&self, g: &mut Inner, peer: SocketAddr, now: Instant) {
        use super::icrc;
        use crate::loopback::faults;
        let (Some(inj), Some((rng, held))) = (self.driver.faults.as_ref(), g.faults.as_mut())
        else {
            self.driver.send_now(peer, &mut g.tx);
            return;
        };
        let local = self.driver.local;
        // What the faults made of a datagram, as it goes on the wire: a corrupted one is
        // counted and sent as it is (the receiver's ICRC check drops it); one with mangled
        // headers gets a fresh ICRC, so that the receiver's parser must reject it.
        let wire = |orig: &[u8], w: faults::Wire| -> Vec<u8> {
            let intact = w.intact(Some(inj));
            let mut b = w.bytes;
            if intact && b[..] != orig[..] {
                if b.len() == orig.len() {
                    b.truncate(b.len() - icrc::ICRC_LEN);
                }
                icrc::seal(local, peer, &mut b);
            }
            b
        };
        let mut out = Vec::with_capacity(g.tx.len());
        for p in &g.tx {
            let d = &p.to_vec()[..];
            let fate = faults::apply(inj, rng, now, self.qpn, d.to_vec());
            let overtaken = match fate.hold {
                Some(h) => held.replace(wire(d, h)),
                None => held.take(),
            };
            if let Some((at, w)) = fate.later {
                self.driver.delay(at, peer, wire(d, w));
            }
            out.extend(fate.now.into_iter().map(|w| wire(d, w)));
            out.extend(overtaken);
        }
        self.driver.send_now(peer, &mut out);
    }
}
