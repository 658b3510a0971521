//! The tcp context's driver: its listener and streams, handshakes, timers, and the
//! progress that applications' polls and the progress thread take turns running.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use mio::net::TcpListener;
use mio::{Events, Interest, Poll, Registry, Token, Waker};
use parking_lot::Mutex;
use slab::Slab;

use super::qp::TcpQp;
use super::stream::StreamError;
use super::*;
use crate::soft::{Handover, Waiting};

pub(super) const WAKER: Token = Token(0);
pub(super) const LISTENER: Token = Token(1);
/// Polling reads the streams of a context with at most this many QPs directly...
pub(super) const DIRECT_QPS: usize = 4;
/// ... and runs epoll every this many rounds.
pub(super) const EPOLL_EVERY: u32 = 16;
/// Handshakes older than this are dropped.
pub(super) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most connections that wait for their hello at once: beyond them, the hellos that came
/// are taken, and then a new connection closes the one that waited longest, so that
/// connections that say nothing cannot take all of the process's descriptors, and a peer
/// that sends its hello at once still gets through.
const MAX_HANDSHAKES: usize = 256;
/// The hello a dialing QP sends: magic, the QP it wants, the QP it is, and the secret of
/// the QP it wants.
pub(super) const HELLO_MAGIC: &[u8; 8] = b"RDMXTCP2";
pub(super) const HELLO_LEN: usize = 24;

pub(super) fn qp_token(idx: usize) -> Token {
    Token(2 + 2 * idx)
}

pub(super) fn hs_token(idx: usize) -> Token {
    Token(3 + 2 * idx)
}

/// A list of QP tokens for the next round, whose capacity is kept: the round takes the
/// list while others push onto the spare one.
#[derive(Default)]
pub(super) struct Tokens {
    live: Mutex<Vec<usize>>,
    spare: Mutex<Vec<usize>>,
}

impl Tokens {
    fn push(&self, token: usize) {
        self.live.lock().push(token);
    }

    /// The tokens pushed so far; hand the list back with [`Tokens::give_back`].
    fn take(&self) -> Vec<usize> {
        let mut taken = std::mem::take(&mut *self.spare.lock());
        std::mem::swap(&mut taken, &mut *self.live.lock());
        taken
    }

    fn give_back(&self, mut list: Vec<usize>) {
        list.clear();
        *self.spare.lock() = list;
    }
}

/// A stream that dialed in and has not said which QP it wants yet.
pub(super) struct Handshake {
    pub(super) stream: mio::net::TcpStream,
    pub(super) buf: [u8; HELLO_LEN],
    pub(super) have: usize,
    pub(super) since: Instant,
}

/// A context's connections, timers and (unless busy-polling) progress thread.
pub(crate) struct Driver {
    pub(super) poll: Mutex<(Poll, Events)>,
    pub(super) registry: Registry,
    pub(super) waker: Waker,
    pub(super) listener: TcpListener,
    pub(super) local: SocketAddr,
    pub(super) qps: Mutex<Slab<Weak<TcpQp>>>,
    pub(super) by_qpn: Mutex<HashMap<u32, usize>>,
    /// Streams that dialed in before their QP expected them.
    pub(super) pending: Waiting<mio::net::TcpStream>,
    pub(super) handshakes: Mutex<Slab<Handshake>>,
    pub(super) timers: Mutex<BinaryHeap<Reverse<(Instant, usize)>>>,
    /// Busy-poll mode: QPs whose transmission waits for the next round.
    pub(super) owed: Tokens,
    /// QPs whose last read stopped at its budget: the next round reads on.
    unread: Tokens,
    /// Rounds with direct reads ([`Driver::direct`]).
    pub(super) rounds: AtomicU32,
    /// An accept failed: the listener is tried again at the next round.
    accept_again: AtomicBool,
    /// Who runs the driver: polling applications or the progress thread.
    pub(super) handover: Handover,
    /// The progress thread sleeps in `epoll_wait`, holding `poll`, and nobody woke it yet.
    pub(super) in_epoll: AtomicBool,
    /// An application's poll runs the driver right now (see [`Driver::defers`]).
    pub(super) app_round: AtomicBool,
    pub(super) stop: AtomicBool,
    pub(super) next_qpn: AtomicU32,
    pub(super) busy_poll: bool,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("tcp::Driver")
            .field("local", &self.local)
            .field("busy_poll", &self.busy_poll)
            .finish()
    }
}

impl Driver {
    /// Binds the listener on `bind` and, unless `busy_poll`, starts the progress thread.
    pub(crate) fn start(bind: SocketAddr, busy_poll: bool, qpn_seed: u32) -> Result<Arc<Driver>> {
        let poll = Poll::new().map_err(|e| Error::Io("epoll_create", e))?;
        let registry = poll
            .registry()
            .try_clone()
            .map_err(|e| Error::Io("epoll", e))?;
        let waker = Waker::new(&registry, WAKER).map_err(|e| Error::Io("eventfd", e))?;
        let mut listener = TcpListener::bind(bind).map_err(|e| Error::Io("bind", e))?;
        stream::deepen_backlog(&listener).map_err(|e| Error::Io("listen", e))?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::Io("getsockname", e))?;
        registry
            .register(&mut listener, LISTENER, Interest::READABLE)
            .map_err(|e| Error::Io("epoll_ctl", e))?;
        let driver = Arc::new(Driver {
            poll: Mutex::new((poll, Events::with_capacity(256))),
            registry,
            waker,
            listener,
            local,
            qps: Mutex::new(Slab::new()),
            by_qpn: Mutex::new(HashMap::new()),
            pending: Waiting::new(),
            handshakes: Mutex::new(Slab::new()),
            timers: Mutex::new(BinaryHeap::new()),
            owed: Tokens::default(),
            unread: Tokens::default(),
            rounds: AtomicU32::new(0),
            accept_again: AtomicBool::new(false),
            handover: Handover::new(crate::soft::handover::NAP_MAX),
            in_epoll: AtomicBool::new(false),
            app_round: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            // QP numbers 0 and 1 are special in InfiniBand.
            next_qpn: AtomicU32::new((qpn_seed & 0x7f_ffff) | 0x10),
            busy_poll,
        });
        if !busy_poll {
            let d = driver.clone();
            std::thread::Builder::new()
                .name("rdmx-tcp".into())
                .spawn(move || d.run_thread())
                .map_err(|e| Error::Io("spawn the progress thread", e))?;
        }
        Ok(driver)
    }

    /// The address peers dial.
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Whether polling a CQ drives progress (no progress thread).
    pub(crate) fn busy_poll(&self) -> bool {
        self.busy_poll
    }

    /// Stops the progress thread.
    pub(crate) fn shutdown(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.waker.wake();
        self.handover.wake();
    }

    /// The progress thread: runs the driver while no application polls, and sleeps while
    /// one does (until a nap's length after its last poll, at most
    /// [`NAP_MAX`](crate::soft::handover::NAP_MAX), or until it stops polling).
    pub(super) fn run_thread(&self) {
        while !self.stop.load(Ordering::SeqCst) {
            if self.handover.nap_while_app_polls(&self.stop) {
                continue;
            }
            if !self.progress(Some(Duration::from_millis(100))) {
                // An application runs the driver right now: a round that keeps writing
                // (a peer that drains the stream as fast as it is filled) lasts longer than
                // HANDOVER, and spinning here would take a core from that writer and its
                // reader. The application polls again after its round, or says it stops
                // (`idle` wakes this nap); if it does neither, the thread resumes after
                // HANDOVER, as if it had stopped polling.
                self.handover.nap_while(&self.stop, &self.app_round);
            }
        }
    }

    /// An application polls (progress-thread mode): records it, then runs the driver once
    /// without waiting if nobody else is; if the progress thread holds it asleep in
    /// `epoll_wait`, wakes it (once) so that it hands over.
    pub(crate) fn app_progress(&self) {
        self.handover.app_polls(Instant::now());
        match self.poll.try_lock() {
            Some(guard) => {
                self.app_round.store(true, Ordering::Relaxed);
                self.round(guard, Some(Duration::ZERO));
                self.app_round.store(false, Ordering::Relaxed);
            }
            None => {
                if self.in_epoll.swap(false, Ordering::SeqCst) {
                    let _ = self.waker.wake();
                }
            }
        }
    }

    /// An application stops polling (it is about to sleep on a CQ's notification): the
    /// progress thread resumes at once.
    pub(crate) fn idle(&self) {
        if !self.busy_poll {
            self.handover.idle();
        }
    }

    pub(crate) fn alloc_qpn(&self) -> u32 {
        self.next_qpn.fetch_add(1, Ordering::Relaxed) & 0xff_ffff
    }

    /// Adds a QP made by `make(token)`.
    pub(crate) fn add_qp(&self, make: impl FnOnce(usize) -> TcpQp) -> Arc<TcpQp> {
        let mut qps = self.qps.lock();
        let entry = qps.vacant_entry();
        let qp = Arc::new(make(entry.key()));
        entry.insert(Arc::downgrade(&qp));
        self.by_qpn.lock().insert(qp.qpn, qp.token);
        qp
    }

    /// `mr`'s keys stopped working: a QP part-way through placing a payload into it (the
    /// engine accepted the packet's headers while the key worked) cannot finish without
    /// writing the region after its deregistration, nor leave the rest out and still
    /// report the request done: its connection fails, the packet's completions with it.
    pub(crate) fn deregistered(&self, mr: &crate::provider::MrShared) {
        let qps: Vec<Arc<TcpQp>> = self
            .qps
            .lock()
            .iter()
            .filter_map(|(_, q)| q.upgrade())
            .collect();
        for qp in qps {
            let mut g = qp.inner.lock();
            if g.places_into(mr) {
                g.fail(
                    qp.qpn,
                    &StreamError::Abandoned(
                        "the region a payload was being placed into is being deregistered",
                    ),
                );
                qp.pump(&mut g, Instant::now());
            }
        }
    }

    /// The QP's handle went: the driver forgets it, and it lets go of the application's
    /// memory now (an event being handled may hold the QP a moment longer).
    pub(crate) fn remove_qp(&self, qp: &TcpQp) {
        self.qps.lock().try_remove(qp.token);
        self.by_qpn.lock().remove(&qp.qpn);
        self.pending.remove(qp.qpn);
        qp.inner.lock().release();
    }

    pub(super) fn register(&self, s: &mut mio::net::TcpStream, token: usize) -> io::Result<()> {
        self.registry
            .register(s, qp_token(token), Interest::READABLE)
    }

    pub(super) fn want_writable(
        &self,
        s: &mut mio::net::TcpStream,
        token: usize,
        on: bool,
    ) -> io::Result<()> {
        let interest = if on {
            Interest::READABLE | Interest::WRITABLE
        } else {
            Interest::READABLE
        };
        self.registry.reregister(s, qp_token(token), interest)
    }

    /// Whether what arriving packets cause (mostly ACKs) may wait for the next round or
    /// the application's next post, to leave in one `writev` with it: when busy-polling,
    /// and in rounds an application's poll runs (it polls again soon, or, if it stops, the
    /// progress thread pays within [`NAP_MAX`](crate::soft::handover::NAP_MAX)).
    pub(crate) fn defers(&self) -> bool {
        self.busy_poll || self.app_round.load(Ordering::Relaxed)
    }

    /// QP `token` has packets to send on the next round.
    pub(crate) fn owe(&self, token: usize) {
        self.owed.push(token);
    }

    /// Sends what [`Driver::owe`] deferred.
    pub(super) fn pay(&self) {
        // No lock is held while pumping: a pump takes queue-pair locks, and another
        // thread holding one of those may be paying too.
        let paying = self.owed.take();
        for &token in &paying {
            let qp = self.qps.lock().get(token).and_then(Weak::upgrade);
            if let Some(qp) = qp {
                let mut g = qp.inner.lock();
                qp.pump(&mut g, Instant::now());
            }
        }
        self.owed.give_back(paying);
    }

    /// QP `token`'s read stopped at its budget with bytes left ([`TcpQp::readable`]).
    pub(super) fn read_later(&self, token: usize) {
        self.unread.push(token);
    }

    /// Reads on the QPs in `tokens` (from [`Driver::read_later`]), each for one more
    /// budget.
    fn read_on(&self, tokens: Vec<usize>) {
        for &token in &tokens {
            let qp = self.qps.lock().get(token).and_then(Weak::upgrade);
            if let Some(qp) = qp {
                let mut g = qp.inner.lock();
                // (A token freed and taken by a new QP meanwhile is not marked.)
                if std::mem::take(&mut g.unread) {
                    let closing = g.rx_until_eof();
                    qp.readable(&mut g, closing);
                }
            }
        }
        self.unread.give_back(tokens);
    }

    /// Asks for [`TcpQp::timeout`] on QP `token` at `at`.
    pub(super) fn schedule(&self, at: Instant, token: usize) {
        let mut t = self.timers.lock();
        let earlier = t.peek().map_or(true, |Reverse((first, _))| at < *first);
        t.push(Reverse((at, token)));
        drop(t);
        // A thread in `epoll_wait` must wait less; a napping one computes its wait afresh
        // when it wakes (and polling applications fire timers meanwhile).
        if earlier && self.in_epoll.swap(false, Ordering::SeqCst) {
            let _ = self.waker.wake();
        }
    }

    /// Establishes the stream of `qp`, which just entered RTR. With a peer bound
    /// ([`TcpQp::bind_peer`]) and this side the smaller of the pair, dials the peer's
    /// listener; otherwise waits for the peer QP (the RTR attributes' destination) to
    /// dial in.
    pub(crate) fn establish(&self, qp: &TcpQp) -> Result<()> {
        let (peer, my_psn, timeout, dest) = {
            let g = qp.inner.lock();
            (g.peer, g.my_psn, g.connect_timeout, g.engine.dest_qpn())
        };
        let Some((peer_addr, peer_qpn, peer_psn, peer_secret)) = peer.filter(|p| p.1 == dest)
        else {
            return self.expect(qp, dest);
        };
        // An unspecified address (a listener on every interface) means this host.
        let peer_addr = match peer_addr {
            SocketAddr::V4(a) if a.ip().is_unspecified() => {
                SocketAddr::from(([127, 0, 0, 1], a.port()))
            }
            SocketAddr::V6(a) if a.ip().is_unspecified() => {
                SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, a.port()))
            }
            a => a,
        };
        // Both sides order the pair the same way; the smaller dials.
        let me = (qp.qpn, my_psn, self.local.port());
        let them = (peer_qpn, peer_psn, peer_addr.port());
        if me < them {
            let mut s = TcpStream::connect_timeout(&peer_addr, timeout)
                .map_err(|e| Error::Io("connect", e))?;
            s.set_nodelay(true)
                .map_err(|e| Error::Io("TCP_NODELAY", e))?;
            let mut hello = [0u8; HELLO_LEN];
            hello[..8].copy_from_slice(HELLO_MAGIC);
            hello[8..12].copy_from_slice(&peer_qpn.to_be_bytes());
            hello[12..16].copy_from_slice(&qp.qpn.to_be_bytes());
            hello[16..].copy_from_slice(&peer_secret.to_be_bytes());
            s.set_write_timeout(Some(timeout))
                .map_err(|e| Error::Io("SO_SNDTIMEO", e))?;
            s.write_all(&hello)
                .map_err(|e| Error::Io("send the hello", e))?;
            s.set_nonblocking(true)
                .map_err(|e| Error::Io("O_NONBLOCK", e))?;
            let mut g = qp.inner.lock();
            qp.attach(&mut g, mio::net::TcpStream::from_std(s));
        } else {
            return self.expect(qp, peer_qpn);
        }
        Ok(())
    }

    /// `qp` went back to RESET with first PSN `psn` and secret `secret`: a stream parked
    /// for it, or attached to it since the reset (the peer it last expected, with the old
    /// secret), goes, and it expects no peer until its next move to RTR.
    pub(super) fn rekey(&self, qp: &TcpQp, psn: u32, secret: u64) {
        let mut g = qp.inner.lock();
        g.my_psn = psn;
        g.secret = secret;
        g.expect_peer = None;
        if TcpQp::attached(&g) {
            tracing::warn!(
                qpn = qp.qpn,
                "closing a connection made with the secret the QP had before its reset"
            );
            g.close();
        }
        self.pending.remove(qp.qpn);
    }

    /// Lets QP `from` dial `qp`, taking its stream if it already did.
    pub(super) fn expect(&self, qp: &TcpQp, from: u32) -> Result<()> {
        let mut g = qp.inner.lock();
        g.expect_peer = Some(from);
        if let Some(stream) = self.pending.take(qp.qpn, from) {
            qp.attach(&mut g, stream);
        }
        Ok(())
    }

    /// Runs the driver once: waits up to `timeout` (or until the next timer) for socket
    /// events, handles them, then fires due timers. Returns at once (and false) if
    /// another thread is running it.
    pub(crate) fn progress(&self, timeout: Option<Duration>) -> bool {
        let Some(guard) = self.poll.try_lock() else {
            return false;
        };
        self.round(guard, timeout);
        true
    }

    /// [`progress`](Self::progress) once `poll` is held.
    pub(super) fn round(
        &self,
        mut guard: parking_lot::MutexGuard<'_, (Poll, Events)>,
        timeout: Option<Duration>,
    ) {
        self.pay();
        // Taken before the events are read: a QP whose read stops at its budget in this
        // round is read on in the next, after the others had their turn.
        let unread = self.unread.take();
        if timeout == Some(Duration::ZERO) && self.direct() {
            self.read_on(unread);
            drop(guard);
            self.fire_timers();
            return;
        }
        let timeout = if unread.is_empty() {
            timeout
        } else {
            Some(Duration::ZERO)
        };
        let zero = timeout == Some(Duration::ZERO);
        if !zero {
            // Before the timers are read: `schedule` either sees this or pushed a timer
            // this round sees.
            self.in_epoll.store(true, Ordering::SeqCst);
        }
        let now = Instant::now();
        let next_timer = self.timers.lock().peek().map(|Reverse((t, _))| *t);
        let wait = match (timeout, next_timer) {
            (Some(t), Some(n)) => Some(t.min(n.saturating_duration_since(now))),
            (t, None) => t,
            (None, Some(n)) => Some(n.saturating_duration_since(now)),
        };
        let (poll, events) = &mut *guard;
        let res = poll.poll(events, wait);
        if !zero {
            self.in_epoll.store(false, Ordering::SeqCst);
        }
        if let Err(e) = res {
            if e.kind() != io::ErrorKind::Interrupted {
                tracing::warn!("epoll_wait failed: {e}");
            }
        }
        for ev in events.iter() {
            match ev.token() {
                WAKER => {}
                LISTENER => self.accept(),
                Token(t) if t % 2 == 0 => {
                    let qp = self.qps.lock().get((t - 2) / 2).and_then(Weak::upgrade);
                    if let Some(qp) = qp {
                        let mut g = qp.inner.lock();
                        if ev.is_writable() {
                            qp.writable(&mut g);
                        }
                        let closing = ev.is_read_closed() || ev.is_error();
                        if ev.is_readable() || closing {
                            qp.readable(&mut g, closing);
                        }
                    }
                }
                Token(t) => self.handshake((t - 3) / 2),
            }
        }
        self.read_on(unread);
        drop(guard);
        self.fire_timers();
    }

    /// Polling a context of at most [`DIRECT_QPS`] streams: reads them directly,
    /// sparing the `epoll_wait` between a packet's arrival and its read (a ping-pong's
    /// critical path). Returns whether the round is done; every [`EPOLL_EVERY`]th round
    /// runs epoll too, for everything else it watches (new connections, hellos, room to
    /// write).
    pub(super) fn direct(&self) -> bool {
        let mut qps = [const { None }; DIRECT_QPS];
        {
            let slab = self.qps.lock();
            if slab.len() > DIRECT_QPS {
                return false;
            }
            for (slot, (_, qp)) in qps.iter_mut().zip(slab.iter()) {
                *slot = qp.upgrade();
            }
        }
        for qp in qps.iter().flatten() {
            let mut g = qp.inner.lock();
            if TcpQp::attached(&g) {
                // Rounds repeat, so a short read needs no care for the end of stream.
                qp.readable(&mut g, false);
            }
        }
        self.rounds.fetch_add(1, Ordering::Relaxed) % EPOLL_EVERY != 0
    }

    pub(super) fn fire_timers(&self) {
        if self.accept_again.swap(false, Ordering::Relaxed) {
            self.accept();
        }
        let now = Instant::now();
        loop {
            let (at, token) = {
                let mut t = self.timers.lock();
                match t.peek() {
                    Some(&Reverse((at, token))) if at <= now => {
                        t.pop();
                        (at, token)
                    }
                    _ => break,
                }
            };
            let qp = self.qps.lock().get(token).and_then(Weak::upgrade);
            if let Some(qp) = qp {
                let mut g = qp.inner.lock();
                qp.timeout(&mut g, at, now);
            }
        }
        // Handshakes that never finished.
        let mut hs = self.handshakes.lock();
        let stale: Vec<usize> = hs
            .iter()
            .filter(|(_, h)| h.since.elapsed() > HANDSHAKE_TIMEOUT)
            .map(|(k, _)| k)
            .collect();
        for k in stale {
            let mut h = hs.remove(k);
            tracing::warn!("closing a connection that sent no hello within {HANDSHAKE_TIMEOUT:?}");
            let _ = self.registry.deregister(&mut h.stream);
        }
        drop(hs);
        self.pending.expire();
    }

    pub(super) fn accept(&self) {
        loop {
            match self.listener.accept() {
                Ok((mut stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    if self.handshakes.lock().len() >= MAX_HANDSHAKES {
                        // Hellos that came meanwhile (a burst of connections is accepted
                        // before any is read) are taken first.
                        let waiting: Vec<usize> =
                            self.handshakes.lock().iter().map(|(k, _)| k).collect();
                        for k in waiting {
                            self.handshake(k);
                        }
                    }
                    let mut hs = self.handshakes.lock();
                    if hs.len() >= MAX_HANDSHAKES {
                        if let Some(k) = hs.iter().min_by_key(|(_, h)| h.since).map(|(k, _)| k) {
                            let mut old = hs.remove(k);
                            let _ = self.registry.deregister(&mut old.stream);
                            tracing::warn!(
                                "closing a connection that sent no hello: {MAX_HANDSHAKES} \
                                 connections wait for theirs"
                            );
                        }
                    }
                    let entry = hs.vacant_entry();
                    if self
                        .registry
                        .register(&mut stream, hs_token(entry.key()), Interest::READABLE)
                        .is_ok()
                    {
                        entry.insert(Handshake {
                            stream,
                            buf: [0; HELLO_LEN],
                            have: 0,
                            since: Instant::now(),
                        });
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // (Out of descriptors, say.) The listener's readiness is reported
                    // once per new connection: the ones queued now are taken at the next
                    // round rather than when another one comes.
                    tracing::warn!("accept failed: {e}");
                    self.accept_again.store(true, Ordering::Relaxed);
                    return;
                }
            }
        }
    }

    pub(super) fn handshake(&self, key: usize) {
        let mut hs = self.handshakes.lock();
        let Some(h) = hs.get_mut(key) else { return };
        let done = loop {
            match h.stream.read(&mut h.buf[h.have..]) {
                Ok(0) => break Err("closed before its hello".to_string()),
                Ok(n) => {
                    h.have += n;
                    // A stranger (an HTTP request, a scan) is told apart by the magic
                    // alone: no need to wait for a whole hello.
                    if h.have >= HELLO_MAGIC.len() && &h.buf[..HELLO_MAGIC.len()] != HELLO_MAGIC {
                        break Ok(());
                    }
                    if h.have == HELLO_LEN {
                        break Ok(());
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => break Err(e.to_string()),
            }
        };
        let mut h = hs.remove(key);
        drop(hs);
        let _ = self.registry.deregister(&mut h.stream);
        if let Err(why) = done {
            tracing::debug!("dropping a connection: {why}");
            return;
        }
        if &h.buf[..8] != HELLO_MAGIC {
            tracing::warn!("closing a connection whose hello is not rdmx's");
            return;
        }
        let to = u32::from_be_bytes(h.buf[8..12].try_into().expect("4 bytes"));
        let from = u32::from_be_bytes(h.buf[12..16].try_into().expect("4 bytes"));
        let secret = u64::from_be_bytes(h.buf[16..24].try_into().expect("8 bytes"));
        let token = self.by_qpn.lock().get(&to).copied();
        let qp = token.and_then(|t| self.qps.lock().get(t).and_then(Weak::upgrade));
        let Some(qp) = qp else {
            tracing::warn!(
                to,
                from,
                "closing a connection for a QP that does not exist"
            );
            return;
        };
        // The secret is checked under the QP's lock, which a reset's new secret takes
        // too, and the stream is attached or parked under it: none presenting the old
        // secret outlives the reset ([`Driver::rekey`]).
        let mut g = qp.inner.lock();
        if secret != g.secret {
            tracing::warn!(
                to,
                from,
                "closing a connection that did not present the QP's secret"
            );
            return;
        }
        if TcpQp::attached(&g) {
            tracing::warn!(to, from, "closing a second connection for a connected QP");
        } else if g.expect_peer == Some(from) {
            qp.attach(&mut g, h.stream);
        } else if let Some(expected) = g.expect_peer {
            tracing::warn!(
                to,
                from,
                expected,
                "closing a connection from a QP other than the one expected"
            );
        } else {
            // The peer reached RTR first: keep the stream until this QP does.
            self.pending.park(to, from, h.stream);
        }
    }
}
