//! A queue pair of the tcp provider: the RC engine and the stream to its peer QP.

use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use rdmx_core::rc::{Placement, Srq, Transmit};
use rdmx_core::{QpAttr, QpAttrMask, QpState};

use super::stream::{self, Rx, RxEvent, StreamError, TxQueue};
use super::Driver;
use crate::provider::{CqCore, MrRef};
use crate::soft::{self, Engine, Keys};

/// Bytes of packets gathered for one writev before it is issued.
const TX_BATCH: usize = 1 << 20;
/// Most bytes one [`TcpQp::readable`] reads, so that a peer keeping its socket full does
/// not hold the driver from the context's other queue pairs (a turn lasts about as long
/// as 1 MiB takes to place).
pub(super) const READ_BUDGET: u64 = 1 << 20;

/// A tcp queue pair, shared by its handle and the driver.
pub(crate) struct TcpQp {
    pub(crate) qpn: u32,
    pub(crate) token: usize,
    pub(crate) driver: Arc<Driver>,
    pub(crate) inner: Mutex<Inner>,
}

impl std::fmt::Debug for TcpQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpQp").field("qpn", &self.qpn).finish()
    }
}

pub(crate) struct Inner {
    pub(crate) engine: Engine,
    pub(crate) keys: Arc<Keys>,
    send_cq: Arc<CqCore>,
    recv_cq: Arc<CqCore>,
    srq: Option<Arc<Mutex<Srq<MrRef>>>>,
    sock: Option<mio::net::TcpStream>,
    rx: Rx,
    tx: TxQueue,
    scratch: Transmit<MrRef>,
    /// The placements buffer the engine fills for the next payload.
    place: Vec<Placement<MrRef>>,
    /// Waiting for the peer QP with this number to dial in.
    pub(crate) expect_peer: Option<u32>,
    /// The peer, when known: its context's listener, QP number, first PSN and secret.
    pub(crate) peer: Option<(std::net::SocketAddr, u32, u32, u64)>,
    /// This QP's first PSN, as its endpoint gives it.
    pub(crate) my_psn: u32,
    /// The secret a peer dialing this QP must present (its endpoint's, drawn again when
    /// the QP goes back to RESET).
    pub(crate) secret: u64,
    pub(crate) connect_timeout: std::time::Duration,
    writable: bool,
    /// Transmission deferred to the driver's next busy-poll round ([`TcpQp::readable`]).
    owed: bool,
    /// A read stopped at [`READ_BUDGET`] with bytes left: the driver's next round reads on
    /// ([`Driver::read_later`]).
    pub(super) unread: bool,
    /// The deadlines of this QP's entries in the driver's timer heap (see `soft::Armed`).
    timer: soft::Armed,
    /// While a payload is part-way read: when the peer, if it sends nothing more of it,
    /// is taken to have stopped ([`Inner::stall_bound`]).
    stall_at: Option<Instant>,
}

impl TcpQp {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        qpn: u32,
        secret: u64,
        token: usize,
        driver: Arc<Driver>,
        engine: Engine,
        keys: Arc<Keys>,
        cqs: (Arc<CqCore>, Arc<CqCore>),
        srq: Option<Arc<Mutex<Srq<MrRef>>>>,
    ) -> TcpQp {
        TcpQp {
            qpn,
            token,
            driver,
            inner: Mutex::new(Inner {
                engine,
                keys,
                send_cq: cqs.0,
                recv_cq: cqs.1,
                srq,
                sock: None,
                rx: Rx::new(super::MAX_FRAME),
                tx: TxQueue::default(),
                place: Vec::new(),
                scratch: Transmit::default(),
                expect_peer: None,
                peer: None,
                my_psn: 0,
                secret,
                connect_timeout: std::time::Duration::from_secs(10),
                writable: false,
                owed: false,
                unread: false,
                timer: soft::Armed::default(),
                stall_at: None,
            }),
        }
    }

    /// Runs `f` on the engine, then sends what it produced and routes completions.
    pub(crate) fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        let mut g = self.inner.lock();
        let out = f(&mut g);
        if g.engine.state() == QpState::Reset && Self::attached(&g) {
            // Back to RESET (to connect again, perhaps to another peer): the old stream
            // and whatever is queued or half read on it go.
            g.close();
        } else if g.engine.state() == QpState::Err && g.rx.mid_payload() {
            // A QP in ERR places nothing more of its peer's bytes, the rest of a payload
            // part-way read included (it could arrive much later); the stream cannot skip
            // it and stay in step, so it closes.
            g.fail(
                self.qpn,
                &StreamError::Abandoned(
                    "the QP went to ERR part-way through reading a payload; closing its stream",
                ),
            );
        }
        self.pump(&mut g, Instant::now());
        out
    }

    /// Posts through `f`, ringing a doorbell rather than writing at once where a later
    /// event will write anyway: busy-polling, the next poll sends it (so requests posted
    /// between two polls leave in one writev); with a progress thread, while earlier
    /// requests await their ACKs (or an RNR wait), the thread sends it when the next ACK,
    /// response or timer arrives. An idle QP sends at once, for latency.
    pub(crate) fn post<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        let mut guard = self.inner.lock();
        let g = &mut *guard;
        let out = f(g);
        if !Self::attached(g) || g.rx.mid_payload() {
            self.pump(g, Instant::now());
        } else if self.driver.busy_poll() {
            self.defer(g);
        } else if g.engine.poll_timeout().is_some() {
            self.route(g);
        } else {
            self.pump(g, Instant::now());
        }
        out
    }

    /// Hands completions over now and leaves the sending to the driver's next round
    /// ([`Driver::owe`]).
    fn defer(&self, g: &mut Inner) {
        // A receive completes when its last packet's headers are read; while that packet's
        // payload is still coming, its completion must wait (as in `pump`).
        if !g.rx.mid_payload() {
            self.route(g);
        }
        if !g.owed {
            g.owed = true;
            self.driver.owe(self.token);
        }
    }

    /// Hands the engine's completions to the CQs. Once the QP is in ERR, the frames still
    /// queued with payload from registered memory go first: their requests complete
    /// flushed, and the memory must not be read for the peer after the application has
    /// it back. The frame part-way written, if it carries such payload, cannot be cut
    /// short: the stream is closed.
    fn route(&self, g: &mut Inner) {
        if g.engine.state() == QpState::Err && !g.tx.drop_payloads() {
            g.fail(
                self.qpn,
                &StreamError::Abandoned(
                    "the QP went to ERR part-way through sending a payload; closing its stream",
                ),
            );
        }
        soft::route_completions(&mut g.engine, &g.send_cq, &g.recv_cq);
    }

    /// Records the peer to dial when the QP enters RTR.
    pub(crate) fn bind_peer(
        &self,
        peer: (std::net::SocketAddr, u32, u32, u64),
        timeout: std::time::Duration,
    ) {
        let mut g = self.inner.lock();
        g.peer = Some(peer);
        g.connect_timeout = timeout;
    }

    /// Gives the QP its stream to the peer.
    pub(crate) fn attach(&self, g: &mut Inner, mut sock: mio::net::TcpStream) {
        if let Err(e) = self.driver.register(&mut sock, self.token) {
            tracing::warn!(
                qpn = self.qpn,
                "cannot watch the stream ({e}); the QP fails"
            );
            g.fail(self.qpn, &StreamError::Io(e));
            return;
        }
        g.sock = Some(sock);
        g.expect_peer = None;
        // A stream starts clean, the QP's first or one after RESET.
        g.rx = Rx::new(super::MAX_FRAME);
        g.tx.clear();
        g.writable = false;
        g.stall_at = None;
        self.pump(g, Instant::now());
        // Bytes (and the end of the stream) may have arrived before the registration.
        self.readable(g, true);
    }

    /// Whether the QP has its stream.
    pub(crate) fn attached(g: &Inner) -> bool {
        g.sock.is_some()
    }

    /// The socket has bytes (or was closed): reads frames until it has none, or until
    /// [`READ_BUDGET`] bytes, when the driver's next round reads on. With `closing` (the
    /// readiness event reported the peer's side closed, or an error), reads on until end
    /// of stream even after a short read. Returns whether it read or handled anything.
    pub(crate) fn readable(&self, g: &mut Inner, closing: bool) -> bool {
        let now = Instant::now();
        g.rx.rearm(closing);
        let before = g.rx.total();
        // Frames read ahead by the call that stopped at its budget are handled by the
        // next without a byte read, and what they cause must go out too.
        let mut handled_any = false;
        let res = loop {
            let Some(sock) = g.sock.as_ref() else {
                return false;
            };
            if g.rx.total() - before >= READ_BUDGET {
                // Readiness is edge-triggered: no event comes for the bytes left.
                if !g.unread {
                    g.unread = true;
                    self.driver.read_later(self.token);
                }
                break Ok(());
            }
            let fd = stream::fd(sock);
            match g.rx.next(fd) {
                Ok(RxEvent::Header(h, rest)) => {
                    let mut place = std::mem::take(&mut g.place);
                    let srq = g.srq.clone();
                    let mut srq_guard = srq.as_ref().map(|s| s.lock());
                    let handled = g.engine.handle_header(
                        now,
                        &*g.keys,
                        srq_guard.as_deref_mut(),
                        h,
                        rest,
                        &mut place,
                    );
                    drop(srq_guard);
                    handled_any = true;
                    match handled {
                        Some(_) => g.rx.start_payload(place, rest),
                        None => {
                            break Err(StreamError::Protocol(
                                "malformed or unsupported packet headers".into(),
                            ))
                        }
                    }
                }
                Ok(RxEvent::PayloadDone) => g.place = g.rx.take_place(),
                Ok(RxEvent::Idle) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        let read = handled_any || g.rx.total() != before;
        if res.is_ok() {
            // A payload part-way read has until the stall bound from its last byte.
            g.stall_at = match g.rx.mid_payload() {
                true if read || g.stall_at.is_none() => g.stall_bound().map(|b| now + b),
                true => g.stall_at,
                false => None,
            };
        }
        if let Err(e) = res {
            g.fail(self.qpn, &e);
            self.pump(g, now);
        } else if !read {
            // Nothing arrived and nothing was handled, so nothing changed.
        } else if self.driver.defers() && Self::attached(g) {
            // What the packets caused (mostly ACKs) goes out on the next round, or with
            // whatever the application posts first: an ACK then rides in the same writev
            // as the next request.
            self.defer(g);
        } else {
            self.pump(g, now);
        }
        read
    }

    /// The socket has room again.
    pub(crate) fn writable(&self, g: &mut Inner) {
        g.writable = false;
        self.pump(g, Instant::now());
    }

    /// The timer set for `at` fired: the engine's deadline may have come.
    pub(crate) fn timeout(&self, g: &mut Inner, at: Instant, now: Instant) {
        g.timer.fired(at);
        if g.rx.mid_payload() && g.stall_at.is_some_and(|t| t <= now) {
            let bound = g.stall_bound().unwrap_or_default();
            g.fail(
                self.qpn,
                &StreamError::Protocol(format!(
                    "the peer sent nothing more of a frame part-way read for {bound:?} \
                     (the QP's ack timeout times its retries)"
                )),
            );
        }
        if g.engine.poll_timeout().is_some_and(|t| t <= now) {
            g.engine.handle_timeout(now);
        }
        self.pump(g, now);
    }

    /// Sends what the engine has, routes its completions and arms its timer. While a
    /// payload is part-way read the engine must wait for it (see `rdmx_core::rc::io`):
    /// only the frames it produced before go out (two peers each part-way through the
    /// other's frame then still finish them), its completions wait, and the timer is
    /// armed for its deadline or the payload's stall bound, whichever comes first.
    pub(crate) fn pump(&self, g: &mut Inner, now: Instant) {
        // Whatever was owed is sent now, or, mid-payload, after the payload: the
        // readiness event that brings its bytes pumps (or owes) again.
        g.owed = false;
        let mid = g.rx.mid_payload();
        if let Some(sock) = g.sock.as_ref() {
            let fd = stream::fd(sock);
            let res = loop {
                // Once what an earlier call could not write is out, gather a batch of
                // packets, so that a burst of small ones (or an ACK and the next request)
                // leaves in one writev.
                let mut more = true;
                if g.tx.is_empty() {
                    if mid {
                        break Ok(true);
                    }
                    let mut batch = 0;
                    while batch < TX_BATCH {
                        let Inner {
                            engine, scratch, ..
                        } = &mut *g;
                        if !engine.poll_transmit_parts(now, scratch) {
                            more = false;
                            break;
                        }
                        batch += g.scratch.len();
                        g.tx.push(&mut g.scratch);
                    }
                }
                if g.tx.is_empty() {
                    break Ok(true);
                }
                match g.tx.flush(fd) {
                    Ok(true) if !more => break Ok(true),
                    Ok(true) => {}
                    Ok(false) => break Ok(false),
                    Err(e) => break Err(e),
                }
            };
            match res {
                Ok(drained) => {
                    if !drained && !g.writable {
                        g.writable = true;
                        if let Some(sock) = g.sock.as_mut() {
                            if let Err(e) = self.driver.want_writable(sock, self.token, true) {
                                g.fail(self.qpn, &StreamError::Io(e));
                            }
                        }
                    } else if drained && g.writable {
                        g.writable = false;
                        if let Some(sock) = g.sock.as_mut() {
                            let _ = self.driver.want_writable(sock, self.token, false);
                        }
                    }
                }
                Err(e) => g.fail(self.qpn, &e),
            }
        }
        let due = match g.rx.mid_payload() {
            true => [g.engine.poll_timeout(), g.stall_at]
                .into_iter()
                .flatten()
                .min(),
            false => {
                self.route(g);
                g.engine.poll_timeout()
            }
        };
        // Only a deadline that no entry the driver holds fires by is handed over: a later
        // one (the ACK timer restarted by a send) is found when an earlier fires, so the
        // driver's heap holds about one entry per QP rather than one per request.
        if let Some(t) = due {
            if g.timer.arm(t) {
                self.driver.schedule(t, self.token);
            }
        }
    }
}

impl Inner {
    /// The QP's handle went (`ibv_destroy_qp`): closes the connection and drops
    /// everything the QP holds of registered memory — its requests and receives, frames
    /// half sent or half received — so that none of it outlives the handle, even while
    /// the driver still holds the QP for an event it is handling.
    pub(crate) fn release(&mut self) {
        self.close();
        self.place.clear();
        self.scratch = Transmit::default();
        self.srq = None;
        self.engine.destroy();
    }

    /// Whether a payload part-way read is being placed into `mr`.
    pub(crate) fn places_into(&self, mr: &crate::provider::MrShared) -> bool {
        self.rx.places_into(mr)
    }

    /// Whether the last read was asked to go on to end of stream (its continuation
    /// keeps that).
    pub(super) fn rx_until_eof(&self) -> bool {
        self.rx.until_eof()
    }

    /// How long a payload part-way read may wait for its next byte: as long as a
    /// requester waits for an answer (the engine's retry budget); `None` with an infinite
    /// ack timeout.
    fn stall_bound(&self) -> Option<std::time::Duration> {
        self.engine.retry_budget()
    }

    /// Closes the stream, dropping the frames queued for it and the one half received.
    pub(super) fn close(&mut self) {
        if self.rx.mid_payload() {
            // What the payload's headers completed never arrived whole.
            self.engine.abort_payload();
        }
        self.sock = None;
        self.tx.clear();
        self.rx = Rx::new(0);
        self.stall_at = None;
    }

    /// The stream failed: close it and move the QP to ERR, so every outstanding request
    /// completes with an error status.
    pub(crate) fn fail(&mut self, qpn: u32, why: &StreamError) {
        match why {
            StreamError::Closed => tracing::debug!(qpn, "connection closed: {why}"),
            _ => tracing::warn!(qpn, "closing the connection: {why}"),
        }
        self.close();
        if self.engine.state() != QpState::Err && self.engine.state() != QpState::Reset {
            let attr = QpAttr {
                qp_state: QpState::Err,
                ..QpAttr::default()
            };
            let _ = self.engine.modify(&attr, QpAttrMask::STATE);
        }
    }
}
