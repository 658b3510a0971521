//! The shm context's driver: its listener and connections, timers, and the progress
//! that applications' polls and the progress thread take turns running.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use slab::Slab;

use super::qp::{Conn, ShmQp};
use super::*;
use crate::soft::{self, Handover, Waiting};

const EVENT: u64 = 0;
const LISTENER: u64 = 1;
/// The datagram socket's token (QP and handshake tokens count up from 2).
const UD: u64 = u64::MAX;
/// The progress thread spins this long after the last work before it sleeps. Waking it
/// costs a peer a system call and the packet tens of microseconds, so it stays up through
/// the gaps of a busy stream (measured: 8-byte WRITEs ran 7× faster with 2 ms than with
/// 50 µs on two cores).
const SPIN: Duration = Duration::from_millis(1);
/// The spinning progress thread reads the clock once every this many idle rounds.
const CLOCK_EVERY: u32 = 64;
/// An application's poll looks at the sockets (peers gone, new connections) every this
/// many rounds.
const EPOLL_EVERY: u32 = 64;

/// The longest the progress thread sleeps at a time: a wake-up lost (none is known to
/// be) costs at most this.
const SLEEP_CAP: Duration = Duration::from_millis(100);

/// What tests do to the progress thread's sleep: hold it on its way there (flags raised,
/// the rings found empty, `epoll_wait` not yet entered) and lengthen it, so that a
/// wake-up lost there shows as a long stall.
#[cfg(feature = "testing")]
#[derive(Debug, Default)]
pub(super) struct SleepHook {
    /// The thread is to stop before `epoll_wait`.
    pub(super) hold: AtomicBool,
    /// The thread waits there.
    pub(super) held: AtomicBool,
    /// The longest sleep, in milliseconds (0: [`SLEEP_CAP`]).
    pub(super) cap_ms: AtomicU64,
}

#[cfg(feature = "testing")]
impl SleepHook {
    fn cap(&self) -> Duration {
        match self.cap_ms.load(Ordering::Relaxed) {
            0 => SLEEP_CAP,
            ms => Duration::from_millis(ms),
        }
    }

    /// Waits while the hold lasts (or until `stop`).
    fn pass(&self, stop: &AtomicBool) {
        while self.hold.load(Ordering::SeqCst) && !stop.load(Ordering::SeqCst) {
            self.held.store(true, Ordering::SeqCst);
            std::thread::sleep(Duration::from_micros(200));
        }
        self.held.store(false, Ordering::SeqCst);
    }
}

/// Connections that sent no hello after this long are closed.
pub(super) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

pub(super) fn qp_token(idx: usize) -> u64 {
    2 + 2 * idx as u64
}

pub(super) fn hs_token(idx: usize) -> u64 {
    3 + 2 * idx as u64
}

/// The abstract socket name of device `id` of process `pid`.
pub(super) fn socket_name(pid: u32, id: u32) -> String {
    format!("rdmx-shm.{pid}.{id:08x}")
}

/// A context's listener, connections, timers and progress thread.
pub(crate) struct Driver {
    pub(super) epoll: sys::Epoll,
    pub(super) listener: UnixListener,
    pub(super) pid: u32,
    pub(super) id: u32,
    /// Peers write this to wake the progress thread.
    pub(super) event: OwnedFd,
    pub(super) qps: Mutex<Slab<Weak<ShmQp>>>,
    pub(super) by_qpn: Mutex<HashMap<u32, usize>>,
    /// QPs with a connection: what a round reads (through its copy in [`Rounds`]).
    pub(super) active: RwLock<Vec<Arc<ShmQp>>>,
    /// Counts the changes of `active`, raised after each.
    pub(super) active_changes: AtomicU64,
    /// Connections made before their QP expected them.
    pub(super) pending: Waiting<Conn>,
    pub(super) handshakes: Mutex<Slab<(UnixStream, Instant)>>,
    pub(super) timers: Mutex<BinaryHeap<Reverse<(Instant, usize)>>>,
    /// The first deadline in `timers`, in nanoseconds since the clock's epoch
    /// ([`soft::clock::epoch`]; `u64::MAX`: none),
    /// written under its lock: a round that finds it ahead takes no lock.
    pub(super) first_timer: AtomicU64,
    /// Held by whoever runs a round, with what rounds keep between them.
    pub(super) running: Mutex<Rounds>,
    /// The progress thread sleeps in `epoll_wait`.
    pub(super) sleeping: AtomicBool,
    /// Wake-ups read from connections' sockets (a peer woke this side's driver).
    pub(super) wakes: AtomicU32,
    /// Who runs rounds: polling applications or the progress thread.
    pub(super) handover: Handover,
    /// Tests hold the progress thread on its way to sleep, and lengthen its sleeps.
    #[cfg(feature = "testing")]
    pub(super) sleep_hook: SleepHook,
    pub(super) stop: AtomicBool,
    pub(super) next_qpn: AtomicU32,
    /// Copy large payloads out of peers' memory where the kernel allows it.
    pub(super) cma: bool,
    /// Copy payloads straight out of the memory of peers in this process.
    pub(super) direct: bool,
    /// Execute WRITEs and READs to peers in this process at post time.
    pub(super) execute_at_post: bool,
    /// Other users whose processes may be peers.
    pub(super) allowed_uids: Vec<u32>,
    /// The key table of the `mapped` data path, when this context runs it.
    pub(super) published: Option<mapped::Published>,
    /// Connections whose peers may claim this context's keys (`mapped`).
    pub(super) watch: Mutex<Vec<mapped::Watch>>,
    /// The datagram socket of UD queue pairs.
    pub(super) ud: Arc<ud::Port>,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("shm::Driver")
            .field("pid", &self.pid)
            .field("id", &self.id)
            .finish()
    }
}

impl Driver {
    /// Runs `f` with every queue pair of this context locked: those of connections, then
    /// the UD ones, each in address order (the order in which the `direct` path takes
    /// two). Nothing of this context places a peer's bytes into memory meanwhile.
    pub(super) fn with_queue_pairs_locked<R>(&self, f: impl FnOnce() -> R) -> R {
        let mut qps = self.active.read().clone();
        qps.sort_by_key(|q| Arc::as_ptr(q) as usize);
        let _held: Vec<_> = qps.iter().map(|q| q.inner.lock()).collect();
        self.ud.with_all_locked(f)
    }

    /// Waits until no queue pair of this context uses a region it was lent past the key
    /// table's lock before the last deregistration ([`soft::Lent`]): each one's lock,
    /// which it holds from the check that its loan stands to the end of its copy, is
    /// taken and let go in turn. A queue pair that takes its lock later sees the
    /// deregistration's count, and the loan gone.
    pub(super) fn wait_for_borrowers(&self) {
        let qps: Vec<Arc<ShmQp>> = self
            .qps
            .lock()
            .iter()
            .filter_map(|(_, q)| q.upgrade())
            .collect();
        for q in qps {
            drop(q.inner.lock());
        }
    }

    pub(super) fn start(seed: u64, opts: &Options) -> Result<Arc<Driver>> {
        let pid = std::process::id();
        let epoll = sys::Epoll::new().map_err(|e| Error::Io("epoll_create", e))?;
        let event = sys::eventfd().map_err(|e| Error::Io("eventfd", e))?;
        // A random name: nobody can guess it to squat it before the context binds, and
        // a second context of the process gets its own.
        let (listener, id) = loop {
            let id = soft::seed()? as u32 ^ (seed >> 32) as u32;
            let addr = UnixAddr::from_abstract_name(socket_name(pid, id))
                .map_err(|e| Error::Io("socket name", e))?;
            match UnixListener::bind_addr(&addr) {
                Ok(l) => break (l, id),
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => continue,
                Err(e) => return Err(Error::Io("bind the shm socket", e)),
            }
        };
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::Io("O_NONBLOCK", e))?;
        epoll
            .add(event.as_raw_fd(), EVENT)
            .map_err(|e| Error::Io("epoll_ctl", e))?;
        epoll
            .add(listener.as_raw_fd(), LISTENER)
            .map_err(|e| Error::Io("epoll_ctl", e))?;
        let ud = ud::Port::bind(
            pid,
            id,
            active_mtu(opts.ring_bytes) as usize,
            opts.allowed_uids.clone(),
        )?;
        epoll
            .add(ud.fd(), UD)
            .map_err(|e| Error::Io("epoll_ctl", e))?;
        let driver = Arc::new(Driver {
            epoll,
            listener,
            pid,
            id,
            event,
            qps: Mutex::new(Slab::new()),
            by_qpn: Mutex::new(HashMap::new()),
            active: RwLock::new(Vec::new()),
            active_changes: AtomicU64::new(0),
            pending: Waiting::new(),
            handshakes: Mutex::new(Slab::new()),
            timers: Mutex::new(BinaryHeap::new()),
            first_timer: AtomicU64::new(u64::MAX),
            running: Mutex::new(Rounds::default()),
            sleeping: AtomicBool::new(false),
            wakes: AtomicU32::new(0),
            handover: Handover::new(crate::soft::handover::NAP_MAX),
            #[cfg(feature = "testing")]
            sleep_hook: SleepHook::default(),
            stop: AtomicBool::new(false),
            // QP numbers 0 and 1 are special in InfiniBand.
            next_qpn: AtomicU32::new(((seed as u32) & 0x7f_ffff) | 0x10),
            cma: opts.cma,
            // The mapped path takes the place of `direct` (it runs in one process too).
            direct: opts.direct && !opts.mapped,
            execute_at_post: opts.execute_at_post,
            allowed_uids: opts.allowed_uids.clone(),
            published: if opts.mapped {
                Some(
                    mapped::Published::new()
                        .map_err(|e| Error::Io("create the shm key table", e))?,
                )
            } else {
                None
            },
            watch: Mutex::new(Vec::new()),
            ud: Arc::new(ud),
        });
        let d = Arc::downgrade(&driver);
        std::thread::Builder::new()
            .name("rdmx-shm".into())
            .spawn(move || Driver::run_thread(d))
            .map_err(|e| Error::Io("spawn the progress thread", e))?;
        Ok(driver)
    }

    pub(super) fn addr(&self) -> PeerAddr {
        PeerAddr::Unix {
            pid: self.pid,
            id: self.id,
        }
    }

    pub(super) fn shutdown(&self) {
        self.stop.store(true, Ordering::SeqCst);
        sys::signal(self.event.as_raw_fd());
        self.handover.wake();
    }

    pub(super) fn alloc_qpn(&self) -> u32 {
        self.next_qpn.fetch_add(1, Ordering::Relaxed) & 0xff_ffff
    }

    pub(super) fn add_qp(&self, make: impl FnOnce(usize) -> ShmQp) -> Arc<ShmQp> {
        let mut qps = self.qps.lock();
        let entry = qps.vacant_entry();
        let qp = Arc::new(make(entry.key()));
        entry.insert(Arc::downgrade(&qp));
        self.by_qpn.lock().insert(qp.qpn, qp.token);
        qp
    }

    /// The handle of `qp` went (or is going): forgets it, releases what it holds of
    /// registered memory, and closes its connection. Returns once the peer no longer
    /// copies out of this QP's memory (its copies of payloads named by descriptor records:
    /// `cma`, `direct`) nor into or out of it through its mapping (`mapped`), or after
    /// [`DRAIN_BOUND`] with a warning and false if it still does (a peer stopped
    /// mid-copy). A second call has nothing left to release or wait
    /// for.
    pub(super) fn remove_qp(&self, qp: &ShmQp) -> bool {
        self.active.write().retain(|q| q.token != qp.token);
        self.active_changes.fetch_add(1, Ordering::Release);
        self.qps.lock().try_remove(qp.token);
        self.by_qpn.lock().remove(&qp.qpn);
        self.pending.remove(qp.qpn);
        // Lets go of the application's memory now (a round, or a post of a peer QP in
        // this process, may hold the QP a moment longer), and closes the connection (the
        // peer sees its socket end).
        let conn = {
            let mut g = qp.inner.lock();
            g.release();
            g.conn.take()
        };
        let Some(c) = conn else {
            return true;
        };
        self.epoll.remove(c.sock.as_raw_fd());
        let quiet = let_go(&c, self.published.as_ref());
        if !quiet {
            tracing::warn!(
                qpn = qp.qpn,
                "shm: the peer still copies out of (or, through its mapping, into) a \
                 destroyed queue pair's memory after {DRAIN_BOUND:?}"
            );
        }
        quiet
    }

    /// `qp` went back to RESET (to connect again, perhaps to another peer) and gave up
    /// its connection `c`: it is closed as at destruction, once the peer copies nothing
    /// of this QP's memory. Called without the QP's lock.
    pub(super) fn reset_conn(&self, qp: &ShmQp, c: super::qp::Conn) {
        self.epoll.remove(c.sock.as_raw_fd());
        if !let_go(&c, self.published.as_ref()) {
            tracing::warn!(
                qpn = qp.qpn,
                "shm: the peer still copies out of (or, through its mapping, into) the \
                 memory of a queue pair gone back to RESET after {DRAIN_BOUND:?}"
            );
        }
    }

    /// `qp` has its connection: rounds read it from now on.
    pub(super) fn activate(&self, qp: &ShmQp) {
        let arc = self.qps.lock().get(qp.token).and_then(Weak::upgrade);
        if let Some(arc) = arc {
            let mut active = self.active.write();
            if !active.iter().any(|q| q.token == qp.token) {
                active.push(arc);
                drop(active);
                self.active_changes.fetch_add(1, Ordering::SeqCst);
                // A progress thread asleep since before the change raised no wake-up flag
                // on this QP, so its peer would not wake it: it wakes now, and sleeps
                // again (if nothing moves) with the flag raised. (Pairs with the
                // thread's look at the count after it raises `sleeping`.)
                if self.sleeping.load(Ordering::SeqCst) {
                    sys::signal(self.event.as_raw_fd());
                }
            }
        }
    }

    /// Asks for [`ShmQp::timeout`] on QP `token` at `at`.
    pub(super) fn schedule(&self, at: Instant, token: usize) {
        let mut t = self.timers.lock();
        let earlier = t.peek().map_or(true, |Reverse((first, _))| at < *first);
        t.push(Reverse((at, token)));
        if earlier {
            self.first_timer
                .store(soft::clock::nanos(at), Ordering::Release);
        }
        drop(t);
        if earlier && self.sleeping.load(Ordering::SeqCst) {
            // The sleeping thread must wait less.
            sys::signal(self.event.as_raw_fd());
        }
    }

    /// The progress thread: runs rounds while no application polls, spins a little after
    /// the last work, then sleeps until a peer, a socket or a timer wakes it.
    pub(super) fn run_thread(me: Weak<Driver>) {
        let mut last_work = Instant::now();
        // The time rounds run with: read again after work, and every CLOCK_EVERY idle
        // rounds (a spin that reads the clock every round spends its time there).
        let mut now = last_work;
        let mut idle = 0u32;
        let mut events = Vec::new();
        loop {
            let Some(d) = me.upgrade() else { return };
            if d.stop.load(Ordering::SeqCst) {
                return;
            }
            if d.handover.nap_while_app_polls(&d.stop) {
                now = Instant::now();
                continue;
            }
            let Some(mut guard) = d.running.try_lock() else {
                std::thread::yield_now();
                now = Instant::now();
                continue;
            };
            let mut moved = d.round(&mut guard, now);
            if guard.count() % EPOLL_EVERY == 0 {
                events.clear();
                d.epoll.wait(Some(Duration::ZERO), &mut events);
                moved |= !events.is_empty();
                d.handle_events(&events);
            }
            if moved {
                now = Instant::now();
                last_work = now;
                idle = 0;
                continue;
            }
            idle = idle.wrapping_add(1);
            if idle % CLOCK_EVERY != 0 {
                drop(guard);
                std::hint::spin_loop();
                continue;
            }
            now = Instant::now();
            if now.duration_since(last_work) < SPIN {
                drop(guard);
                std::hint::spin_loop();
                continue;
            }
            // Sleep: raise the flags, look once more, then wait.
            let changes = d.active_changes.load(Ordering::SeqCst);
            let active = d.active.read().clone();
            for q in &active {
                q.inner.lock().set_asleep(true);
            }
            d.sleeping.store(true, Ordering::SeqCst);
            // A QP connected since `active` was read has no flag raised (its peer would
            // not wake this thread): no sleep then, nor a wake-up lost if it connects
            // after this look ([`activate`](Self::activate) signals).
            let ready = d.active_changes.load(Ordering::SeqCst) != changes
                || active.iter().any(|q| q.inner.lock().ready())
                || d.ud.backlogged();
            if !ready {
                // Read after `sleeping` is raised: a timer scheduled later signals.
                let next = d.timers.lock().peek().map(|Reverse((t, _))| *t);
                #[cfg(not(feature = "testing"))]
                let cap = SLEEP_CAP;
                #[cfg(feature = "testing")]
                let cap = d.sleep_hook.cap();
                let wait = next.map_or(cap, |t| {
                    t.saturating_duration_since(Instant::now()).min(cap)
                });
                drop(guard);
                #[cfg(feature = "testing")]
                d.sleep_hook.pass(&d.stop);
                events.clear();
                d.epoll.wait(Some(wait), &mut events);
            }
            d.sleeping.store(false, Ordering::SeqCst);
            for q in &active {
                q.inner.lock().set_asleep(false);
            }
            if !ready {
                let _guard = d.running.lock();
                d.handle_events(&events);
            }
            now = Instant::now();
            // Work waiting, or a wake-up by an event (a peer, a socket, a timer scheduled
            // meanwhile): spin again after it. A wait that merely timed out goes back to
            // sleep after the next batch of rounds, unless they find work (a timer that
            // was due among it), so an idle context costs no CPU.
            if ready || !events.is_empty() {
                last_work = now;
            }
        }
    }

    /// One pass over every connected QP and the due timers. Returns whether anything
    /// moved. The caller holds `running`.
    pub(super) fn round(&self, r: &mut Rounds, now: Instant) -> bool {
        self.round_at(r, now, soft::clock::nanos(now))
    }

    /// [`round`](Self::round) at `now`, which is `ns` nanoseconds after the clock's epoch.
    fn round_at(&self, r: &mut Rounds, now: Instant, ns: u64) -> bool {
        let mut moved = false;
        // The copy of `active` is taken again when it changed (rarely: as QPs connect and
        // go), so that a round takes no lock to find its QPs.
        let changes = self.active_changes.load(Ordering::Acquire);
        if changes != r.changes {
            r.qps.clone_from(&self.active.read());
            r.changes = changes;
        }
        for q in &r.qps {
            if let Some(mut g) = q.inner.try_lock() {
                moved |= q.poll(&mut g, now);
            }
        }
        if self.ud.in_use() {
            moved |= self.ud.progress(now);
        }
        moved | self.fire_timers_at(now, ns)
    }

    /// Runs the QP timers due at `now`, which is `ns` nanoseconds after the clock's epoch.
    /// Returns whether any found work.
    fn fire_timers_at(&self, now: Instant, ns: u64) -> bool {
        if ns < self.first_timer.load(Ordering::Acquire) {
            return false;
        }
        let mut fired = false;
        loop {
            let (at, token) = {
                let mut t = self.timers.lock();
                let due = match t.peek() {
                    Some(&Reverse((at, token))) if at <= now => {
                        t.pop();
                        Some((at, token))
                    }
                    _ => None,
                };
                let first = t
                    .peek()
                    .map_or(u64::MAX, |Reverse((at, _))| soft::clock::nanos(*at));
                self.first_timer.store(first, Ordering::Release);
                match due {
                    Some(d) => d,
                    None => break,
                }
            };
            let qp = self.qps.lock().get(token).and_then(Weak::upgrade);
            if let Some(qp) = qp {
                let mut g = qp.inner.lock();
                fired |= qp.timeout(&mut g, at, now);
            }
        }
        fired
    }

    pub(super) fn handle_events(&self, events: &[u64]) {
        for &ev in events {
            match ev {
                EVENT => sys::drain(self.event.as_raw_fd()),
                LISTENER => self.accept(),
                UD => {
                    self.ud.progress(Instant::now());
                }
                t if t % 2 == 0 => {
                    let qp = self
                        .qps
                        .lock()
                        .get(((t - 2) / 2) as usize)
                        .and_then(Weak::upgrade);
                    if let Some(qp) = qp {
                        let mut g = qp.inner.lock();
                        let mut hung_up = g.conn.as_ref().is_some_and(|c| sys::hung_up(&c.sock));
                        let mut gone = hung_up;
                        // Wake-ups, and files the peer hands over or takes back (`mapped`).
                        match g.conn.as_mut().map(Conn::read_messages) {
                            Some(Ok(wakes)) => {
                                self.wakes.fetch_add(wakes, Ordering::Relaxed);
                            }
                            Some(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                                // The peer closed its end after the look above (its last
                                // messages came first): it hung up all the same.
                                hung_up = true;
                                gone = true;
                            }
                            Some(Err(e)) => {
                                if !gone {
                                    tracing::warn!(
                                        qpn = qp.qpn,
                                        "closing the shared-memory connection: {e}"
                                    );
                                }
                                gone = true;
                            }
                            None => {}
                        }
                        if gone {
                            if let Some(c) = g.conn.as_ref().filter(|_| hung_up) {
                                // (Not a peer that broke the rules: it may still copy.)
                                c.peer_gone.store(true, Ordering::SeqCst);
                            }
                            // Whatever the peer managed to put in the ring first counts.
                            qp.progress(&mut g, Instant::now());
                            if let Some(c) = g.conn.as_ref() {
                                self.epoll.remove(c.sock.as_raw_fd());
                            }
                            g.fail_as(
                                qp.qpn,
                                "the peer closed its connection (it exited or was killed)",
                                tracing::Level::DEBUG,
                            );
                        }
                    }
                }
                t => self.handshake(((t - 3) / 2) as usize),
            }
        }
        self.expire();
    }

    /// An application polls: records it and runs a round if nobody else is.
    pub(super) fn app_progress(&self) {
        let (now, ns) = soft::clock::now_and_nanos();
        self.handover.app_polls_at(ns);
        if let Some(mut g) = self.running.try_lock() {
            self.round_at(&mut g, now, ns);
            if g.count() % EPOLL_EVERY == 0 {
                let mut events = Vec::new();
                self.epoll.wait(Some(Duration::ZERO), &mut events);
                self.handle_events(&events);
                // What this took may have been meant for the progress thread, asleep in
                // `epoll_wait`: a peer's wake-up (which cleared the flag that asks the
                // peer for it, so none follows), a timer's signal. It wakes, and sleeps
                // again with every flag raised.
                if !events.is_empty() && self.sleeping.load(Ordering::SeqCst) {
                    sys::signal(self.event.as_raw_fd());
                }
            }
        }
    }

    /// An application stops polling: the progress thread resumes at once.
    pub(super) fn idle(&self) {
        self.handover.idle();
    }
}

/// What rounds keep from one to the next, under [`Driver::running`].
#[derive(Default)]
pub(crate) struct Rounds {
    /// The connected QPs, as `active` was when its change count was `changes`.
    qps: Vec<Arc<ShmQp>>,
    changes: u64,
    /// Rounds run (wrapping).
    count: u32,
}

impl Rounds {
    /// Counts a round; returns the count before it.
    fn count(&mut self) -> u32 {
        let n = self.count;
        self.count = n.wrapping_add(1);
        n
    }

    /// Rounds run so far (wrapping).
    #[cfg(feature = "testing")]
    pub(crate) fn rounds_run(&self) -> u32 {
        self.count
    }
}

/// Tells the peer of connection `c` that this side's queue pair is gone, then waits, for
/// at most [`DRAIN_BOUND`], until the peer copies nothing out of this side's memory (it
/// may be amid a copy it began before) and, on the `mapped` path, nothing into or out of
/// it under a claim made before the target word went to 0 (a claim made after sees the
/// 0 and backs off). A peer that closed its socket copies nothing. Returns whether it
/// let go.
fn let_go(c: &Conn, published: Option<&mapped::Published>) -> bool {
    // Sequentially consistent (and a global barrier, for peers that claim with a plain
    // store), then the claim is loaded: as deregistration's unpublishing (see `mapped`),
    // either the peer sees the 0 after its claim, or the claim is seen here and waited
    // for.
    c.seg.target_word(c.side).store(0, Ordering::SeqCst);
    if let Some(p) = published {
        // Without the barrier the peer's claim word proves nothing: it counts as held
        // (the barrier is tried again until the bound), unless the peer goes.
        let mut ordered = false;
        let done = wait_bounded(DRAIN_BOUND, || {
            ordered = ordered || p.barrier().is_ok();
            ordered || c.peer_gone.load(Ordering::SeqCst) || sys::hung_up(&c.sock)
        });
        if !ordered {
            tracing::error!("shm mapped: membarrier failed; the peer's claim is taken as held");
            return done;
        }
    }
    let copying = c.seg.leave(c.side);
    let peer_claims = || c.seg.claim_word(1 - c.side).load(Ordering::SeqCst) != 0;
    if !copying && !peer_claims() {
        return true;
    }
    wait_bounded(DRAIN_BOUND, || {
        (!c.seg.copying(1 - c.side) && !peer_claims())
            || c.peer_gone.load(Ordering::SeqCst)
            || sys::hung_up(&c.sock)
    })
}
