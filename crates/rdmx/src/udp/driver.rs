//! A udp context's socket, its receive path, its timers and its progress thread.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use rdmx_core::QpState;

use super::icrc::{self, Reject};
use super::qp::UdpQp;
use super::sys::{self, CAddr, RxBatch, BATCH};
use super::UdpStats;
use crate::soft::Handover;
use crate::{Error, Result};

/// Timer key of delayed datagrams (fault injection); QP numbers have 24 bits.
/// Most batches of datagrams one progress step reads: a flood that keeps the socket full
/// must not keep the step from answering what it took (ACKs, READ responses) and from
/// firing timers.
const BATCHES_PER_RECEIVE: usize = 16;
const DELAYED: u32 = u32::MAX;

/// Counters of what arrived and what was dropped.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    c: [AtomicU64; 11],
}

const RECEIVED: usize = 0;
const DELIVERED: usize = 1;
const BAD_LENGTH: usize = 2;
const BAD_ICRC: usize = 3;
const BAD_HEADER: usize = 4;
const UNKNOWN_QP: usize = 5;
const WRONG_SOURCE: usize = 6;
const NOT_READY: usize = 7;
const SENT: usize = 8;
const SEND_FAILED: usize = 9;
const JOINED: usize = 10;

impl Stats {
    fn add(&self, i: usize, n: u64) {
        self.c[i].fetch_add(n, Ordering::Relaxed);
    }
    pub(crate) fn count_unrouted(&self) {
        self.add(SEND_FAILED, 1);
    }
    pub(crate) fn get(&self) -> UdpStats {
        let g = |i: usize| self.c[i].load(Ordering::Relaxed);
        UdpStats {
            received: g(RECEIVED),
            delivered: g(DELIVERED),
            bad_length: g(BAD_LENGTH),
            bad_icrc: g(BAD_ICRC),
            bad_header: g(BAD_HEADER),
            unknown_qp: g(UNKNOWN_QP),
            wrong_source: g(WRONG_SOURCE),
            not_ready: g(NOT_READY),
            sent: g(SENT),
            send_failed: g(SEND_FAILED),
            joined: g(JOINED),
        }
    }
}

/// A context's socket, queue pairs, timers and progress thread.
pub(crate) struct Driver {
    sock: UdpSocket,
    /// The address the socket is bound to: the source of every packet sent.
    pub(crate) local: SocketAddr,
    /// Largest datagram accepted.
    max_datagram: usize,
    pub(crate) verify_icrc: bool,
    /// Datagrams per `sendmmsg`/`recvmmsg`.
    batch: usize,
    /// Runs of equal-sized datagrams go as one GSO send, and joined runs are taken (GRO).
    pub(crate) gso: bool,
    qps: RwLock<HashMap<u32, Arc<UdpQp>>>,
    rx: Mutex<RxBatch>,
    pub(super) timers: Mutex<BinaryHeap<Reverse<(Instant, u32)>>>,
    /// Datagrams held back by fault injection: when each is due, and where it goes.
    delayed: Mutex<Vec<(Instant, SocketAddr, Vec<u8>)>>,
    pub(crate) stats: Stats,
    wake: OwnedFd,
    /// The progress thread sleeps in `poll` until this instant (ns after `epoch`;
    /// `u64::MAX`: not sleeping there).
    sleeping_until: AtomicU64,
    /// Who takes datagrams and fires timers: polling applications or the progress thread.
    handover: Handover,
    epoch: Instant,
    stop: AtomicBool,
    next_qpn: AtomicU32,
    #[cfg(feature = "testing")]
    pub(crate) faults: Option<Arc<crate::loopback::faults::Injector>>,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("udp::Driver")
            .field("local", &self.local)
            .finish()
    }
}

/// How a driver starts.
pub(crate) struct Start {
    pub(crate) sock: UdpSocket,
    pub(crate) max_datagram: usize,
    pub(crate) verify_icrc: bool,
    pub(crate) batch: usize,
    pub(crate) gso: bool,
    pub(crate) qpn_seed: u32,
    #[cfg(feature = "testing")]
    pub(crate) faults: Option<crate::loopback::faults::Faults>,
}

impl Driver {
    /// Takes the socket and starts the progress thread.
    pub(crate) fn start(s: Start) -> Result<Arc<Driver>> {
        // A kernel without UDP GRO (before 5.0) has no UDP GSO either (4.18): the context
        // then moves one datagram per message.
        let gso = s.gso
            && sys::enable_gro(s.sock.as_raw_fd())
                .inspect_err(|e| tracing::info!("udp: no UDP GRO ({e}); GSO and GRO off"))
                .is_ok();
        // A run the kernel joined can be as long as a UDP payload gets.
        let slot = if gso { 65536 } else { s.max_datagram + 1 };
        let local = s
            .sock
            .local_addr()
            .map_err(|e| Error::Io("getsockname", e))?;
        let driver = Arc::new(Driver {
            sock: s.sock,
            local,
            max_datagram: s.max_datagram,
            verify_icrc: s.verify_icrc,
            batch: s.batch.clamp(1, BATCH),
            gso,
            qps: RwLock::new(HashMap::new()),
            rx: Mutex::new(RxBatch::new(slot)),
            timers: Mutex::new(BinaryHeap::new()),
            delayed: Mutex::new(Vec::new()),
            stats: Stats::default(),
            wake: sys::eventfd().map_err(|e| Error::Io("eventfd", e))?,
            sleeping_until: AtomicU64::new(u64::MAX),
            // Naps stay short: datagrams that arrive while nobody runs the driver wait in
            // the socket, which drops what it has no room for.
            handover: Handover::new(crate::soft::handover::HANDOVER),
            epoch: Instant::now(),
            stop: AtomicBool::new(false),
            // QP numbers 0 and 1 are special in InfiniBand.
            next_qpn: AtomicU32::new((s.qpn_seed & 0x7f_ffff) | 0x10),
            #[cfg(feature = "testing")]
            faults: s
                .faults
                .map(|f| Arc::new(crate::loopback::faults::Injector::new(f))),
        });
        let d = driver.clone();
        std::thread::Builder::new()
            .name("rdmx-udp".into())
            .spawn(move || d.run_thread())
            .map_err(|e| Error::Io("spawn the progress thread", e))?;
        Ok(driver)
    }

    /// Stops the progress thread.
    pub(crate) fn shutdown(&self) {
        self.stop.store(true, Ordering::SeqCst);
        sys::wake(self.wake.as_raw_fd());
        self.handover.wake();
    }

    /// A new QP number, not in use in this context.
    pub(crate) fn alloc_qpn(&self) -> u32 {
        loop {
            let n = self.next_qpn.fetch_add(1, Ordering::Relaxed) & 0xff_ffff;
            if assignable_qpn(n) && !self.qps.read().contains_key(&n) {
                return n;
            }
        }
    }

    pub(crate) fn add_qp(&self, qp: Arc<UdpQp>) {
        self.qps.write().insert(qp.qpn, qp);
    }

    /// The QP's handle went: the driver forgets it, and it lets go of the application's
    /// memory now (a datagram or timer being handled may hold the QP a moment longer).
    pub(crate) fn remove_qp(&self, qpn: u32) {
        let qp = self.qps.write().remove(&qpn);
        if let Some(qp) = qp {
            qp.release();
        }
    }

    fn ns(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.epoch).as_nanos() as u64
    }

    /// Asks for a timeout on QP `qpn` at `at`.
    pub(crate) fn schedule(&self, at: Instant, qpn: u32) {
        self.timers.lock().push(Reverse((at, qpn)));
        if self.ns(at) < self.sleeping_until.load(Ordering::SeqCst) {
            sys::wake(self.wake.as_raw_fd());
        }
    }

    /// Sends datagrams to `to` now.
    pub(crate) fn send_now<D: sys::Wire>(&self, to: SocketAddr, datagrams: &mut [D]) {
        if datagrams.is_empty() {
            return;
        }
        let failed = sys::send_all(
            self.sock.as_raw_fd(),
            &CAddr::new(to),
            datagrams,
            self.batch,
            self.gso,
        );
        self.stats.add(SENT, (datagrams.len() - failed) as u64);
        self.stats.add(SEND_FAILED, failed as u64);
    }

    /// Sends a datagram at `at` (fault injection).
    #[cfg(feature = "testing")]
    pub(crate) fn delay(&self, at: Instant, to: SocketAddr, d: Vec<u8>) {
        self.delayed.lock().push((at, to, d));
        self.schedule(at, DELAYED);
    }

    /// An application polled: receive and fire timers without waiting.
    pub(crate) fn app_progress(&self) {
        self.handover.app_polls(Instant::now());
        self.progress();
    }

    /// An application stops polling: the progress thread takes over at once.
    pub(crate) fn idle(&self) {
        self.handover.idle();
    }

    /// Receives what waits and fires due timers.
    fn progress(&self) {
        self.receive();
        self.fire_timers();
    }

    fn run_thread(self: Arc<Self>) {
        while !self.stop.load(Ordering::SeqCst) {
            if self.handover.nap_while_app_polls(&self.stop) {
                continue;
            }
            let now = Instant::now();
            let next = self.timers.lock().peek().map(|Reverse((t, _))| *t);
            // Sleeps are capped, so a timer pushed just before the flag was set is late by
            // at most this much.
            let cap = now + Duration::from_millis(50);
            let until = next.map_or(cap, |t| t.min(cap));
            self.sleeping_until.store(self.ns(until), Ordering::SeqCst);
            // A timer pushed between the peek and the store is seen here.
            let next = self.timers.lock().peek().map(|Reverse((t, _))| *t);
            let until = next.map_or(until, |t| t.min(until));
            let ms = until
                .saturating_duration_since(Instant::now())
                .as_micros()
                .div_ceil(1000) as libc::c_int;
            sys::wait(self.sock.as_raw_fd(), self.wake.as_raw_fd(), ms);
            self.sleeping_until.store(u64::MAX, Ordering::SeqCst);
            self.progress();
        }
    }

    /// Reads the waiting datagrams, at most [`BATCHES_PER_RECEIVE`] batches of them, and
    /// hands each to its QP, then lets the QPs that took one answer. The socket is
    /// watched level-triggered: what is left is read at the next step, after the timers.
    fn receive(&self) {
        let Some(mut rx) = self.rx.try_lock() else {
            return;
        };
        let fd = self.sock.as_raw_fd();
        let mut touched: Vec<Arc<UdpQp>> = Vec::new();
        for _ in 0..BATCHES_PER_RECEIVE {
            let n = rx.recv(fd, self.batch);
            let now = Instant::now();
            for i in 0..n {
                let (from, bytes, cut, seg) = rx.get(i);
                let seg = seg.unwrap_or(bytes.len()).max(1);
                if bytes.len() > seg {
                    self.stats.add(JOINED, bytes.len().div_ceil(seg) as u64);
                }
                if bytes.is_empty() {
                    self.deliver(from, bytes, 0, now);
                    continue;
                }
                self.deliver_run(from, bytes, seg, cut, now, &mut touched);
            }
            if n < self.batch {
                break;
            }
        }
        drop(rx);
        let now = Instant::now();
        for qp in touched {
            let mut g = qp.inner.lock();
            qp.pump(&mut g, now);
        }
    }

    /// Checks the datagrams of a run the kernel joined (or a datagram alone: `seg` its
    /// length), each `seg` bytes but the last, and feeds their packets to their QPs, the
    /// QP of consecutive packets locked once; adds the QPs to pump to `touched`.
    fn deliver_run(
        &self,
        from: Option<SocketAddr>,
        bytes: &[u8],
        seg: usize,
        cut: bool,
        now: Instant,
        touched: &mut Vec<Arc<UdpQp>>,
    ) {
        let Some(from) = from else {
            let n = bytes.len().div_ceil(seg) as u64;
            self.stats.add(RECEIVED, n);
            self.stats.add(WRONG_SOURCE, n);
            return;
        };
        // Segment `k` of a joined run most likely carries IPv4 identification `k`.
        let id = |d: &[u8]| ((d.as_ptr() as usize - bytes.as_ptr() as usize) / seg) as u16;
        let mut chunks = bytes.chunks(seg);
        let mut next = chunks.next();
        while let Some(d) = next.take() {
            let len = if cut { usize::MAX } else { d.len() };
            self.stats.add(RECEIVED, 1);
            let Some((packet, qpn)) = self.admit(Some(from), d, len, id(d)) else {
                next = chunks.next();
                continue;
            };
            let Some(qp) = self.qps.read().get(&qpn).cloned() else {
                self.stats.add(UNKNOWN_QP, 1);
                next = chunks.next();
                continue;
            };
            let mut g = qp.inner.lock();
            let mut fed = self.feed(&qp, &mut g, from, packet, now);
            // The packets after it for the same QP, under the same lock.
            for d in chunks.by_ref() {
                let len = if cut { usize::MAX } else { d.len() };
                match self.admit(Some(from), d, len, id(d)) {
                    Some((packet, n)) if n == qpn => {
                        self.stats.add(RECEIVED, 1);
                        fed |= self.feed(&qp, &mut g, from, packet, now);
                    }
                    // Counted when it is taken up again.
                    Some(_) => {
                        next = Some(d);
                        break;
                    }
                    None => self.stats.add(RECEIVED, 1),
                }
            }
            drop(g);
            if fed && !touched.iter().any(|t| t.qpn == qp.qpn) {
                touched.push(qp);
            }
            if next.is_none() {
                next = chunks.next();
            }
        }
    }

    /// Checks a datagram of `len` bytes (`usize::MAX`: cut short by the socket) and feeds
    /// its packet to its QP; returns the QP to pump afterwards.
    pub(crate) fn deliver(
        &self,
        from: Option<SocketAddr>,
        bytes: &[u8],
        len: usize,
        now: Instant,
    ) -> Option<Arc<UdpQp>> {
        self.stats.add(RECEIVED, 1);
        let (packet, qpn) = self.admit(from, bytes, len, 0)?;
        let from = from?;
        let Some(qp) = self.qps.read().get(&qpn).cloned() else {
            self.stats.add(UNKNOWN_QP, 1);
            return None;
        };
        let mut g = qp.inner.lock();
        let fed = self.feed(&qp, &mut g, from, packet, now);
        drop(g);
        fed.then_some(qp)
    }

    /// Checks a datagram's source, length, ICRC and headers (counting what it drops):
    /// its packet and the QP number it names.
    fn admit<'a>(
        &self,
        from: Option<SocketAddr>,
        bytes: &'a [u8],
        len: usize,
        likely_id: u16,
    ) -> Option<(&'a [u8], u32)> {
        let Some(from) = from else {
            self.stats.add(WRONG_SOURCE, 1);
            return None;
        };
        let checked = if len > self.max_datagram {
            Err(Reject::Length)
        } else {
            icrc::check(
                from,
                self.local,
                bytes,
                self.max_datagram,
                self.verify_icrc,
                likely_id,
            )
        };
        match checked {
            Ok(p) => Some(p),
            Err(r) => {
                self.stats.add(
                    match r {
                        Reject::Length => BAD_LENGTH,
                        Reject::Icrc => BAD_ICRC,
                        Reject::Header => BAD_HEADER,
                    },
                    1,
                );
                None
            }
        }
    }

    /// Feeds a checked packet from `from` to `qp` (locked: `g`) if the QP takes it from
    /// there in its state; whether it did.
    fn feed(
        &self,
        qp: &UdpQp,
        g: &mut super::qp::Inner,
        from: SocketAddr,
        packet: &[u8],
        now: Instant,
    ) -> bool {
        if g.engine.config().qp_type == rdmx_core::QpType::Ud {
            // A UD queue pair takes datagrams from anyone; the engine checks the Q_Key.
            self.stats.add(DELIVERED, 1);
            super::ud::receive(g, from, self.local, packet);
            return true;
        }
        let from_peer = g
            .peer
            .is_some_and(|p| p.ip() == from.ip() && (p.port() == from.port() || g.any_port));
        if !from_peer {
            self.stats.add(WRONG_SOURCE, 1);
            return false;
        }
        if !matches!(g.engine.state(), QpState::Rtr | QpState::Rts | QpState::Sqd) {
            self.stats.add(NOT_READY, 1);
            return false;
        }
        self.stats.add(DELIVERED, 1);
        qp.handle(g, now, packet);
        true
    }

    fn fire_timers(&self) {
        let now = Instant::now();
        loop {
            let (at, qpn) = {
                let mut t = self.timers.lock();
                match t.peek() {
                    Some(&Reverse((at, qpn))) if at <= now => {
                        t.pop();
                        (at, qpn)
                    }
                    _ => break,
                }
            };
            if qpn == DELAYED {
                self.send_delayed(now);
                continue;
            }
            let qp = self.qps.read().get(&qpn).cloned();
            if let Some(qp) = qp {
                let mut g = qp.inner.lock();
                qp.timeout(&mut g, at, now);
            }
        }
    }

    fn send_delayed(&self, now: Instant) {
        let due: Vec<(Instant, SocketAddr, Vec<u8>)> = {
            let mut d = self.delayed.lock();
            let (due, later) = std::mem::take(&mut *d)
                .into_iter()
                .partition(|(t, _, _)| *t <= now);
            *d = later;
            due
        };
        for (_, to, d) in due {
            self.send_now(to, &mut [d]);
        }
    }
}

/// Whether QP number `n` may be given to a new QP: not 0 or 1 (special in every
/// transport) nor the multicast QP number, to which datagrams for a group are sent.
fn assignable_qpn(n: u32) -> bool {
    n > 1 && n != rdmx_core::MULTICAST_QPN
}

#[cfg(test)]
mod tests {
    use super::assignable_qpn;

    #[test]
    fn the_special_queue_pair_numbers_are_never_assigned() {
        assert!(!assignable_qpn(0));
        assert!(!assignable_qpn(1));
        assert!(!assignable_qpn(0xff_ffff));
        assert!(assignable_qpn(2));
        assert!(assignable_qpn(0xff_fffe));
    }
}
