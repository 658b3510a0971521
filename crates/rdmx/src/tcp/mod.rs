//! The tcp provider: the RC engine over TCP streams, across processes and hosts.
//!
//! Each queue pair has its own stream to its peer QP (a stream per QP keeps each QP's
//! packets in order and lets the receive side read a payload straight into place without
//! holding other QPs back). Frames are IBTA RC packets behind a 4-byte length
//! (`stream`); payloads move between the socket and registered memory with vectored
//! I/O and no intermediate copy. Sends are plain `writev`s of up to 1 MiB of packets:
//! `MSG_ZEROCOPY` was measured at about half the bandwidth on loopback (the kernel copies
//! every looped-back zero-copy packet anyway and adds a completion notification per send),
//! and it pays off only for large sends between hosts.
//!
//! A context has one `Driver`: a listening socket that peers' QPs dial, an epoll
//! instance (mio) watching every stream, and the timers of every QP.
//!
//! ## Progress
//!
//! By default whoever polls makes progress: every poll of one of the context's CQs runs
//! the driver once without waiting (reading a few QPs' streams directly, without
//! `epoll_wait`), and a progress thread takes over only while nobody polls, so one-sided
//! operations complete while the target application does nothing. While an application
//! polled within the last millisecond the thread sleeps, away from the driver and the
//! cores: on two cores a thread woken by every packet, competing with an application that
//! spins on its CQ, costs a ping-pong a hundredfold. A poll that finds the thread asleep
//! in `epoll_wait` (holding the driver) wakes it, once, so that it hands over; a thread
//! about to sleep in [`CompletionQueue::wait`](crate::CompletionQueue::wait) says it no
//! longer polls, and the progress thread resumes at once. In busy-poll mode
//! ([`Options::busy_poll`]) no thread is started at all, and transmissions wait for the
//! next poll so that an ACK and the next request leave in one `writev`.
//!
//! ## Connection setup
//!
//! [`QueuePair::endpoint`](crate::QueuePair::endpoint) carries the address of the
//! context's listener and the QP's random secret. Of two QPs being connected, the one with
//! the smaller (QP number, PSN, port) dials the other's listener and sends a hello naming
//! both QP numbers and presenting the secret of the QP it dials; the other side's driver
//! hands the stream to the QP it names once that QP expects this peer, and closes (and
//! logs) a stream whose hello is not rdmx's, names no QP, or lacks the secret, so nobody
//! who only knows QP numbers can take a queue pair over. Neither side blocks waiting for
//! the other, so both ends can be connected from one thread.

mod qp;
mod stream;

use std::any::Any;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use mio::net::TcpListener;
use mio::{Events, Interest, Poll, Registry, Token, Waker};
use parking_lot::{Condvar, Mutex};
use slab::Slab;

use qp::TcpQp;
use rdmx_core::Mtu;

use crate::endpoint::{PeerAddr, QpEndpoint};
use crate::provider::{self, Capabilities, CqCore, ProviderConfig};
use crate::soft::{self, Engine, Keys, SoftDevice, SoftQp, SoftSrq, Transport};
use crate::{Error, Result};

/// The provider's name.
pub const NAME: &str = "tcp";
const DEVICE: &str = "tcp0";

/// How to open a tcp context.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Options {
    /// The address the context listens on for peers' queue pairs (default: every
    /// interface, a port the kernel picks).
    pub bind: Option<SocketAddr>,
    /// No progress thread: polling any of the context's CQs makes progress instead. One-
    /// sided operations aimed at this context then complete only while the application
    /// polls. The default (a progress thread that hands over to polling applications) is
    /// about as fast for a ping-pong; this mode also batches an ACK with the next request.
    pub busy_poll: bool,
}

impl Options {
    /// Sets [`bind`](Self::bind).
    pub fn bind(mut self, addr: SocketAddr) -> Self {
        self.bind = Some(addr);
        self
    }
    /// Sets [`busy_poll`](Self::busy_poll).
    pub fn busy_poll(mut self, on: bool) -> Self {
        self.busy_poll = on;
        self
    }
}

impl From<Options> for ProviderConfig {
    fn from(opts: Options) -> ProviderConfig {
        ProviderConfig::new(NAME, move || {
            Ok(Arc::new(Device::open(&opts)?) as Arc<dyn provider::Device>)
        })
    }
}

/// The provider as the registry lists it.
pub(crate) const ENTRY: provider::Entry = provider::Entry {
    name: NAME,
    devices: || {
        vec![provider::DeviceInfo {
            provider: NAME,
            name: DEVICE.to_string(),
            capabilities: caps(),
            gid: None,
        }]
    },
    open: |device| {
        if let Some(d) = device.filter(|&d| d != DEVICE) {
            return Err(Error::NoDevice(format!(
                "provider {NAME} has no device {d}; its device is {DEVICE}"
            )));
        }
        ProviderConfig::from(Options::default()).open()
    },
};

fn limits() -> rdmx_core::QpLimits {
    soft::limits(Mtu::Bytes(MAX_MTU))
}

fn caps() -> Capabilities {
    soft::capabilities(&limits(), Mtu::Bytes(ACTIVE_MTU))
}

/// A tcp device: a key table and a driver.
#[derive(Debug)]
struct Device {
    keys: Arc<Keys>,
    caps: Capabilities,
    driver: Arc<Driver>,
}

impl Device {
    fn open(opts: &Options) -> Result<Device> {
        let seed = soft::seed()?;
        let bind = opts
            .bind
            .unwrap_or_else(|| SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, 0)));
        Ok(Device {
            keys: Arc::new(Keys::new(seed)),
            caps: caps(),
            driver: Driver::start(bind, opts.busy_poll, (seed >> 32) as u32)?,
        })
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        self.driver.shutdown();
    }
}

impl SoftDevice for Device {
    const PROVIDER: &'static str = NAME;
    const DEVICE: &'static str = DEVICE;
    const AFTER_SRQ_POST: fn() = || {};
    fn keys(&self) -> &Arc<Keys> {
        &self.keys
    }
    fn caps(&self) -> &Capabilities {
        &self.caps
    }
    fn address(&self) -> PeerAddr {
        PeerAddr::Ip(self.driver.local_addr())
    }
    fn create_cq(&self, _core: &Arc<CqCore>) -> Result<Box<dyn provider::Cq>> {
        Ok(Box::new(Cq {
            driver: self.driver.clone(),
        }))
    }
    fn create_qp(&self, init: provider::QpInit<'_>) -> Result<Box<dyn provider::Qp>> {
        let srq = SoftSrq::of(init.srq)?;
        let qpn = self.driver.alloc_qpn();
        let mut cfg = soft::config(&init, qpn);
        // TCP delivers every packet once and in order, or breaks the stream.
        soft::reliable_link(&mut cfg);
        let engine = Engine::new(cfg, limits());
        let qp = self.driver.add_qp(|token| {
            TcpQp::new(
                qpn,
                init.secret,
                token,
                self.driver.clone(),
                engine,
                self.keys.clone(),
                (init.send_cq.core.clone(), init.recv_cq.core.clone()),
                srq,
            )
        });
        qp.inner.lock().my_psn = init.psn;
        Ok(Box::new(SoftQp {
            qpn,
            transport: Link { qp },
        }))
    }
}

/// A tcp CQ: every poll runs the driver (see the module's "Progress").
#[derive(Debug)]
struct Cq {
    driver: Arc<Driver>,
}

impl provider::Cq for Cq {
    fn progress(&self, _core: &CqCore) -> Result<()> {
        if self.driver.busy_poll {
            self.driver.progress(Some(Duration::ZERO));
        } else {
            self.driver.app_progress();
        }
        Ok(())
    }
    fn idle(&self) {
        self.driver.idle();
    }
    fn needs_polling(&self) -> bool {
        self.driver.busy_poll
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A tcp QP as the software host sees it.
#[derive(Debug)]
struct Link {
    qp: Arc<TcpQp>,
}

impl Transport for Link {
    fn with<T>(&self, f: impl FnOnce(&mut Engine, &Keys) -> T) -> T {
        self.qp.with(|i| f(&mut i.engine, &i.keys))
    }
    fn post_with<T>(&self, f: impl FnOnce(&mut Engine, &Keys) -> T) -> T {
        self.qp.post(|i| f(&mut i.engine, &i.keys))
    }
    fn entered_rtr(&self) -> Result<()> {
        self.qp.driver.establish(&self.qp)
    }
    fn address(&self) -> PeerAddr {
        PeerAddr::Ip(self.qp.driver.local_addr())
    }
    fn bind_peer(&self, peer: &QpEndpoint, timeout: Duration) -> Result<()> {
        let PeerAddr::Ip(addr) = peer.addr else {
            return Err(Error::InvalidArgument(
                "a tcp peer endpoint needs the address of its context",
            ));
        };
        self.qp
            .bind_peer((addr, peer.qp_num, peer.psn, peer.secret), timeout);
        Ok(())
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.qp.driver.remove_qp(&self.qp);
    }
}

const WAKER: Token = Token(0);
const LISTENER: Token = Token(1);
/// Polling reads the streams of a context with at most this many QPs directly...
const DIRECT_QPS: usize = 4;
/// ... and runs epoll every this many rounds.
const EPOLL_EVERY: u32 = 16;
/// The progress thread leaves the driver to an application that polled this recently.
const HANDOVER: Duration = Duration::from_millis(1);
/// A stream parked for a QP that has not reached RTR yet is closed after this long.
const PARKED_TIMEOUT: Duration = Duration::from_secs(60);
/// Handshakes older than this are dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// The hello a dialing QP sends: magic, the QP it wants, the QP it is, and the secret of
/// the QP it wants.
const HELLO_MAGIC: &[u8; 8] = b"RDMXTCP2";
const HELLO_LEN: usize = 24;

/// Largest path MTU on tcp.
pub(crate) const MAX_MTU: u32 = 1 << 20;
/// Largest frame a QP accepts: headers, the largest payload, pad.
pub(crate) const MAX_FRAME: usize = 128 + MAX_MTU as usize;
/// The path MTU tcp connections use unless told otherwise.
pub(crate) const ACTIVE_MTU: u32 = 1 << 20;

fn qp_token(idx: usize) -> Token {
    Token(2 + 2 * idx)
}

fn hs_token(idx: usize) -> Token {
    Token(3 + 2 * idx)
}

/// A stream whose hello named a QP that does not expect it yet.
struct Parked {
    stream: mio::net::TcpStream,
    /// The QP it comes from.
    from: u32,
    since: Instant,
}

/// A stream that dialed in and has not said which QP it wants yet.
struct Handshake {
    stream: mio::net::TcpStream,
    buf: [u8; HELLO_LEN],
    have: usize,
    since: Instant,
}

/// A context's connections, timers and (unless busy-polling) progress thread.
pub(crate) struct Driver {
    poll: Mutex<(Poll, Events)>,
    registry: Registry,
    waker: Waker,
    listener: TcpListener,
    local: SocketAddr,
    qps: Mutex<Slab<Weak<TcpQp>>>,
    by_qpn: Mutex<HashMap<u32, usize>>,
    /// Streams that dialed in before their QP expected them, by the QP they want.
    /// (At most one per QP, each closed after [`PARKED_TIMEOUT`].)
    pending: Mutex<HashMap<u32, Parked>>,
    handshakes: Mutex<Slab<Handshake>>,
    timers: Mutex<BinaryHeap<Reverse<(Instant, usize)>>>,
    /// Busy-poll mode: QPs whose transmission waits for the next round.
    owed: Mutex<Vec<usize>>,
    /// The list [`Driver::pay`] works through, kept for its capacity.
    paying: Mutex<Vec<usize>>,
    /// Rounds with direct reads ([`Driver::direct`]).
    rounds: AtomicU32,
    /// When an application last polled, in nanoseconds after `epoch` (0: not polling).
    app_polled: AtomicU64,
    epoch: Instant,
    /// The progress thread sleeps in `epoll_wait`, holding `poll`, and nobody woke it yet.
    in_epoll: AtomicBool,
    /// An application's poll runs the driver right now (see [`Driver::defers`]).
    app_round: AtomicBool,
    /// Where the progress thread sleeps while applications poll.
    nap: (Mutex<()>, Condvar),
    stop: AtomicBool,
    next_qpn: AtomicU32,
    busy_poll: bool,
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
            pending: Mutex::new(HashMap::new()),
            handshakes: Mutex::new(Slab::new()),
            timers: Mutex::new(BinaryHeap::new()),
            owed: Mutex::new(Vec::new()),
            paying: Mutex::new(Vec::new()),
            rounds: AtomicU32::new(0),
            app_polled: AtomicU64::new(0),
            epoch: Instant::now(),
            in_epoll: AtomicBool::new(false),
            app_round: AtomicBool::new(false),
            nap: (Mutex::new(()), Condvar::new()),
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
        let _g = self.nap.0.lock();
        self.nap.1.notify_all();
    }

    /// The progress thread: runs the driver while no application polls, and sleeps while
    /// one does (until [`HANDOVER`] after its last poll, or until it stops polling).
    fn run_thread(&self) {
        while !self.stop.load(Ordering::SeqCst) {
            if let Some(until) = self.app_polling_until() {
                let mut g = self.nap.0.lock();
                // Checked again under the lock: `idle` and `shutdown` notify under it.
                if self.stop.load(Ordering::SeqCst) {
                    return;
                }
                if self.app_polling_until().is_some() {
                    self.nap.1.wait_until(&mut g, until);
                }
                continue;
            }
            if !self.progress(Some(Duration::from_millis(100))) {
                // An application runs the driver right now: a round that keeps writing
                // (a peer that drains the stream as fast as it is filled) lasts longer than
                // HANDOVER, and spinning here would take a core from that writer and its
                // reader. The application polls again after its round, or says it stops
                // (`idle` wakes this nap); if it does neither, the thread resumes after
                // HANDOVER, as if it had stopped polling.
                let mut g = self.nap.0.lock();
                if self.stop.load(Ordering::SeqCst) {
                    return;
                }
                if self.app_round.load(Ordering::SeqCst) {
                    self.nap.1.wait_for(&mut g, HANDOVER);
                }
            }
        }
    }

    /// Until when the progress thread leaves the driver to polling applications, if an
    /// application polled within [`HANDOVER`].
    fn app_polling_until(&self) -> Option<Instant> {
        let at = self.app_polled.load(Ordering::SeqCst);
        if at == 0 {
            return None;
        }
        let until = self.epoch + Duration::from_nanos(at) + HANDOVER;
        (Instant::now() < until).then_some(until)
    }

    /// An application polls (progress-thread mode): records it, then runs the driver once
    /// without waiting if nobody else is; if the progress thread holds it asleep in
    /// `epoll_wait`, wakes it (once) so that it hands over.
    pub(crate) fn app_progress(&self) {
        let now = self.epoch.elapsed().as_nanos() as u64 | 1;
        if self.app_polled.load(Ordering::Relaxed) != now {
            self.app_polled.store(now, Ordering::SeqCst);
        }
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
        if self.busy_poll || self.app_polled.swap(0, Ordering::SeqCst) == 0 {
            return;
        }
        let _g = self.nap.0.lock();
        self.nap.1.notify_all();
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

    pub(crate) fn remove_qp(&self, qp: &TcpQp) {
        self.qps.lock().try_remove(qp.token);
        self.by_qpn.lock().remove(&qp.qpn);
        self.pending.lock().remove(&qp.qpn);
    }

    fn register(&self, s: &mut mio::net::TcpStream, token: usize) -> io::Result<()> {
        self.registry
            .register(s, qp_token(token), Interest::READABLE)
    }

    fn want_writable(&self, s: &mut mio::net::TcpStream, token: usize, on: bool) -> io::Result<()> {
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
    /// progress thread pays within [`HANDOVER`]).
    pub(crate) fn defers(&self) -> bool {
        self.busy_poll || self.app_round.load(Ordering::Relaxed)
    }

    /// QP `token` has packets to send on the next round.
    pub(crate) fn owe(&self, token: usize) {
        self.owed.lock().push(token);
    }

    /// Sends what [`Driver::owe`] deferred.
    fn pay(&self) {
        // No lock is held while pumping: a pump takes queue-pair locks, and another
        // thread holding one of those may be paying too.
        let mut paying = std::mem::take(&mut *self.paying.lock());
        std::mem::swap(&mut paying, &mut *self.owed.lock());
        for token in paying.drain(..) {
            let qp = self.qps.lock().get(token).and_then(Weak::upgrade);
            if let Some(qp) = qp {
                let mut g = qp.inner.lock();
                qp.pump(&mut g, Instant::now());
            }
        }
        *self.paying.lock() = paying;
    }

    /// Asks for [`TcpQp::timeout`] on QP `token` at `at`.
    fn schedule(&self, at: Instant, token: usize) {
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

    /// Lets QP `from` dial `qp`, taking its stream if it already did.
    fn expect(&self, qp: &TcpQp, from: u32) -> Result<()> {
        let mut g = qp.inner.lock();
        g.expect_peer = Some(from);
        let parked = self.pending.lock().remove(&qp.qpn);
        match parked {
            Some(p) if p.from == from => qp.attach(&mut g, p.stream),
            Some(p) => {
                tracing::warn!(
                    qpn = qp.qpn,
                    who = p.from,
                    "dropping a stream from an unexpected QP"
                );
            }
            None => {}
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
    fn round(
        &self,
        mut guard: parking_lot::MutexGuard<'_, (Poll, Events)>,
        timeout: Option<Duration>,
    ) {
        self.pay();
        let zero = timeout == Some(Duration::ZERO);
        if zero && self.direct() {
            drop(guard);
            self.fire_timers();
            return;
        }
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
        drop(guard);
        self.fire_timers();
    }

    /// Polling a context of at most [`DIRECT_QPS`] streams: reads them directly,
    /// sparing the `epoll_wait` between a packet's arrival and its read (a ping-pong's
    /// critical path). Returns whether the round is done; every [`EPOLL_EVERY`]th round
    /// runs epoll too, for everything else it watches (new connections, hellos, room to
    /// write).
    fn direct(&self) -> bool {
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

    fn fire_timers(&self) {
        let now = Instant::now();
        loop {
            let token = {
                let mut t = self.timers.lock();
                match t.peek() {
                    Some(Reverse((at, token))) if *at <= now => {
                        let token = *token;
                        t.pop();
                        token
                    }
                    _ => break,
                }
            };
            let qp = self.qps.lock().get(token).and_then(Weak::upgrade);
            if let Some(qp) = qp {
                let mut g = qp.inner.lock();
                qp.timeout(&mut g, now);
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
        let mut pending = self.pending.lock();
        if !pending.is_empty() {
            pending.retain(|to, p| {
                let keep = p.since.elapsed() <= PARKED_TIMEOUT;
                if !keep {
                    tracing::warn!(
                        to,
                        from = p.from,
                        "closing a stream whose QP did not reach RTR within {PARKED_TIMEOUT:?}"
                    );
                }
                keep
            });
        }
    }

    fn accept(&self) {
        loop {
            match self.listener.accept() {
                Ok((mut stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    let mut hs = self.handshakes.lock();
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
                    tracing::warn!("accept failed: {e}");
                    return;
                }
            }
        }
    }

    fn handshake(&self, key: usize) {
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
        if secret != qp.secret {
            tracing::warn!(
                to,
                from,
                "closing a connection that did not present the QP's secret"
            );
            return;
        }
        let mut g = qp.inner.lock();
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
            let parked = Parked {
                stream: h.stream,
                from,
                since: Instant::now(),
            };
            if let Some(old) = self.pending.lock().insert(to, parked) {
                tracing::warn!(
                    to,
                    from = old.from,
                    "closing a stream replaced by a newer one"
                );
            }
        }
    }
}
