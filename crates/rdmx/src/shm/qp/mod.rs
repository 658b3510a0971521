//! A queue pair of the shm provider: the RC engine and its connection, a ring in each
//! direction of a shared segment.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rdmx_core::rc::{Placement, Srq, Transmit};
use rdmx_core::{QpAttr, QpAttrMask, QpState};

use std::sync::atomic::Ordering;

use super::mapped::{self, PeerView};
use super::ring::{Consumer, Producer, Segment};
use super::{sys, Driver};
use crate::provider::{CqCore, MrRef};
use crate::soft::{self, Engine, Keys};

mod records;

/// Records read from a ring in one go before the QP lets others run.
const RX_BUDGET: usize = 64;

/// Most packets taken from the engine at a time, to be written to the ring together.
const OUT_BATCH: usize = 16;

/// Packets whose payload in registered memory is at least this long go as descriptors
/// when the peer pulls: it copies the payload itself, with one `process_vm_readv`.
pub(crate) const PULL_MIN: usize = 16 << 10;

/// The same, when the peer is in this process: it copies with a plain memcpy, which
/// costs less than a second copy through the ring from a few KiB up.
pub(crate) const DIRECT_MIN: usize = 4 << 10;

/// A packet taken from the engine for the ring.
#[derive(Default)]
struct Outgoing {
    t: Transmit<MrRef>,
    /// Its payload (and pad) copied out of registered memory, with the address it came
    /// from (for its alignment in the ring); `None`: it is still there. See
    /// [`Inner::own_held`].
    owned: Option<(Vec<u8>, usize)>,
}

/// A connection: the segment, which side of it this QP is, and the socket that tells
/// when the peer goes away and carries wake-ups.
#[derive(Debug)]
pub(crate) struct Conn {
    pub(crate) seg: Arc<Segment>,
    /// 0: the side that created the segment; this side sends on ring `side`.
    pub(crate) side: usize,
    /// The connection's socket: the peer's end tells of its exit (end of stream), and
    /// carries wake-ups and (on the `mapped` path) files; see [`Conn::read_messages`].
    pub(crate) sock: Arc<UnixStream>,
    /// The peer process (as the kernel names it, `SO_PEERCRED`).
    pub(crate) peer_pid: i32,
    /// This side reads descriptor records: it can copy out of the peer's memory.
    pub(crate) pulls: bool,
    /// The peer's key table, when the peer is in this process: payloads are then copied
    /// straight out of its registered memory with memcpy (the `direct` data path).
    pub(crate) direct: Option<Arc<Keys>>,
    /// The peer queue pair, when it is in this process and its context copies directly:
    /// WRITEs and READs may then be executed at post time (see `direct`).
    pub(crate) peer_qp: Option<Weak<ShmQp>>,
    /// The peer's key table and the files it handed over, when both sides run the
    /// `mapped` data path.
    pub(crate) mapped: Option<PeerView>,
    /// Raised when the peer closed its socket (it exited or was killed): its claims on
    /// this side's keys are void (`mapped`).
    pub(crate) peer_gone: Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        // This QP accepts nothing more from a peer that executes requests itself; one
        // that claims a key after this sees it and backs off (see `mapped`; a claim made
        // before is seen by whoever reads the claim word after the socket went, with a
        // barrier for a peer that claims with a plain store: `Watch::claim`).
        self.seg.target_word(self.side).store(0, Ordering::SeqCst);
    }
}

/// A wake-up on a connection's socket: the side that sleeps waits on its sockets (and
/// nothing of the peer's: a descriptor the peer shares could be made to block).
const WAKE_MAGIC: &[u8; 8] = b"RDMXWAKE";

/// Most messages read from a connection's socket in one go: a peer that keeps sending
/// does not keep the driver reading.
const MSGS_PER_READ: usize = 64;

impl Conn {
    /// Wakes the peer, which sleeps: one message on the socket, never waiting (a peer
    /// that leaves its socket full has messages to wake it already).
    fn wake_peer(&self) {
        let mut msg = [0u8; mapped::MSG_LEN];
        msg[..8].copy_from_slice(WAKE_MAGIC);
        let _ = sys::send_nowait(&self.sock, &msg);
    }

    /// Reads the messages waiting on the connection's socket: wake-ups (returns how many),
    /// and on the `mapped` path files handed over or taken back. Anything else, a short
    /// message included, is an error that ends the connection
    /// ([`std::io::ErrorKind::UnexpectedEof`]: the peer closed its end).
    pub(crate) fn read_messages(&mut self) -> std::io::Result<u32> {
        let mut wakes = 0;
        for _ in 0..MSGS_PER_READ {
            let mut msg = [0u8; mapped::MSG_LEN];
            let fds = match sys::recv_with_fds(&self.sock, &mut msg) {
                Ok(fds) => fds,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(wakes),
                Err(e) => return Err(e),
            };
            if &msg[..8] == WAKE_MAGIC && msg[8..].iter().all(|&b| b == 0) && fds.is_empty() {
                wakes += 1;
                continue;
            }
            match self.mapped.as_mut() {
                Some(view) => view.handle(&msg, fds)?,
                None => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        "a message on the connection's socket that is not rdmx's",
                    ))
                }
            }
        }
        Ok(wakes)
    }

    /// How payloads move on this connection: `cma` when both sides copy large payloads
    /// straight out of the other's memory, `ring` when neither does, `cma+ring` when only
    /// one side can.
    pub(crate) fn data_path(&self) -> &'static str {
        if self.mapped.is_some() {
            return "mapped";
        }
        match (self.pulls, self.seg.pulls(1 - self.side)) {
            (true, true) if self.direct.is_some() => "direct",
            (true, true) => "cma",
            (false, false) => "ring",
            _ => "cma+ring",
        }
    }
}

/// An shm queue pair, shared by its handle and the driver.
pub(crate) struct ShmQp {
    pub(crate) qpn: u32,
    pub(crate) token: usize,
    pub(crate) driver: Arc<Driver>,
    /// The key table of the QP's device (the one `Inner::keys` holds): a post borrows it
    /// from here, outside the QP's lock.
    pub(crate) keys: Arc<Keys>,
    pub(crate) inner: Mutex<Inner>,
}

impl std::fmt::Debug for ShmQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmQp").field("qpn", &self.qpn).finish()
    }
}

/// The peer as its endpoint names it: process, device, QP number, first PSN, secret.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Peer {
    pub(crate) pid: u32,
    pub(crate) dev: u32,
    pub(crate) qpn: u32,
    pub(crate) psn: u32,
    pub(crate) secret: u64,
}

pub(crate) struct Inner {
    pub(crate) engine: Engine,
    pub(crate) keys: Arc<Keys>,
    send_cq: Arc<CqCore>,
    recv_cq: Arc<CqCore>,
    srq: Option<Arc<Mutex<Srq<MrRef>>>>,
    pub(crate) conn: Option<Conn>,
    prod: Producer,
    pub(crate) cons: Consumer,
    /// Packets taken from the engine for the ring, in order: those from `out_next` up to
    /// `out_end` wait for room (they are held). See [`Inner::send`].
    out: Vec<Outgoing>,
    out_next: usize,
    out_end: usize,
    place: Vec<Placement<MrRef>>,
    prefix: Vec<u8>,
    /// The peer reads descriptor records (seen in the segment).
    peer_pulls: bool,
    /// A descriptor record's payload, its spans, and the pieces of one pull: local
    /// address, peer address, length.
    desc_bytes: Vec<u8>,
    spans: Vec<(u64, u64)>,
    span_keys: Vec<u32>,
    /// The peer's regions a direct copy reads, held while it runs.
    sources: Vec<MrRef>,
    pieces: Vec<(usize, u64, usize)>,
    /// Waiting for the peer QP with this number to connect.
    pub(crate) expect_peer: Option<u32>,
    pub(crate) peer: Option<Peer>,
    pub(crate) my_psn: u32,
    /// The secret a peer connecting to this QP must present (its endpoint's, drawn again
    /// when the QP goes back to RESET).
    pub(crate) secret: u64,
    pub(crate) connect_timeout: Duration,
    /// The deadlines of this QP's entries in the driver's timer heap (see `soft::Armed`).
    timer: soft::Armed,
    /// Requests executed at post time (the `direct` and `mapped` data paths' shortcut).
    pub(crate) executed_at_post: u64,
    /// The target word last written to the segment (`mapped`).
    target_word: u64,
    /// The local region the last request on the `mapped` path named, lent past the key
    /// table's lock while no region of the table is deregistered: deregistration waits
    /// for this lock ([`Driver::wait_for_borrowers`]), held from the check that the loan
    /// still stands to the end of the copy.
    pub(crate) lent: Option<soft::Lent>,
    /// The local region the last receive named, lent past the key table's lock in the
    /// same way: a receive whose first element names it again resolves that key on the
    /// loan, while no region of the table is deregistered ([`Inner::post_recv`]).
    recv_lent: Option<soft::Lent>,
    /// A polling round runs: the peer is woken ([`Inner::wake`]) at the round's next
    /// visit rather than at once (see [`ShmQp::poll`]).
    lazy_wake: bool,
    /// The peer may sleep waiting for what this QP did since it last looked.
    wake_due: bool,
}

impl ShmQp {
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
    ) -> ShmQp {
        ShmQp {
            qpn,
            token,
            driver,
            keys: Arc::clone(&keys),
            inner: Mutex::new(Inner {
                engine,
                keys,
                send_cq: cqs.0,
                recv_cq: cqs.1,
                srq,
                conn: None,
                prod: Producer::default(),
                cons: Consumer::default(),
                out: Vec::new(),
                out_next: 0,
                out_end: 0,
                place: Vec::new(),
                prefix: Vec::new(),
                peer_pulls: false,
                desc_bytes: Vec::new(),
                spans: Vec::new(),
                span_keys: Vec::new(),
                sources: Vec::new(),
                pieces: Vec::new(),
                expect_peer: None,
                peer: None,
                my_psn: 0,
                secret,
                connect_timeout: Duration::from_secs(10),
                timer: soft::Armed::default(),
                executed_at_post: 0,
                target_word: 0,
                lent: None,
                recv_lent: None,
                lazy_wake: false,
                wake_due: false,
            }),
        }
    }

    /// Runs `f` on the engine, then sends what it produced and routes completions.
    pub(crate) fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        let mut g = self.inner.lock();
        let out = f(&mut g);
        // Back to RESET (to connect again): the old connection goes, and with it the
        // packet held for its ring.
        let gone = match g.engine.state() == QpState::Reset {
            true => {
                let conn = g.conn.take();
                if conn.is_some() {
                    g.drop_out();
                }
                conn
            }
            false => None,
        };
        self.pump(&mut g, Instant::now());
        drop(g);
        // Waited for without the QP's lock: rounds go on meanwhile.
        if let Some(c) = gone {
            self.driver.reset_conn(self, c);
        }
        out
    }

    /// Runs `f` on the engine, then routes completions: for verbs that give the engine
    /// nothing to send (posting a receive).
    pub(crate) fn with_quiet<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        let mut g = self.inner.lock();
        let out = f(&mut g);
        let g = &mut *g;
        soft::route_completions(&mut g.engine, &g.send_cq, &g.recv_cq);
        out
    }

    /// Gives the QP its connection.
    pub(crate) fn attach(&self, g: &mut Inner, conn: Conn) {
        // The side that connects makes the rings, of its own size: this side's packets,
        // up to its path MTU, must fit them.
        let mtu = g.engine.attrs().path_mtu.bytes();
        if mtu > super::max_mtu(conn.seg.cap()) {
            tracing::warn!(
                qpn = self.qpn,
                ring_bytes = conn.seg.cap(),
                mtu,
                "the peer's rings are too small for this QP's path MTU; the QP fails"
            );
            g.fail(self.qpn, "the peer's rings are too small for the path MTU");
            return;
        }
        if let Err(e) = self
            .driver
            .epoll
            .add(conn.sock.as_raw_fd(), super::qp_token(self.token))
        {
            tracing::warn!(
                qpn = self.qpn,
                "cannot watch the connection ({e}); the QP fails"
            );
            g.fail(self.qpn, "cannot watch the connection socket");
            return;
        }
        g.conn = Some(conn);
        g.expect_peer = None;
        // A new segment (a QP may connect again after RESET): its rings start empty, the
        // peer has not said it pulls, and its target word is 0 until the next progress
        // step writes it.
        g.prod = Producer::default();
        g.cons = Consumer::default();
        g.peer_pulls = false;
        g.target_word = 0;
        self.driver.activate(self);
        if let (Some(c), Some(p)) = (g.conn.as_ref(), self.driver.published.as_ref()) {
            if c.mapped.is_some() {
                let mut watch = self.driver.watch.lock();
                mapped::prune(p, &mut watch);
                watch.push(mapped::Watch {
                    seg: c.seg.clone(),
                    sock: Arc::downgrade(&c.sock),
                    peer: 1 - c.side,
                    peer_gone: c.peer_gone.clone(),
                });
                // Under the watch's lock, as every offer and forget (`published`).
                p.offer_all(&c.sock);
                drop(watch);
            }
        }
        self.progress(g, Instant::now());
    }

    /// Reads what arrived and sends what is due. Returns whether anything moved.
    pub(crate) fn progress(&self, g: &mut Inner, now: Instant) -> bool {
        let moved = self.read(g, now);
        self.pump(g, now) || moved
    }

    /// A polling round's step: reads what arrived and, when something did or a packet of
    /// ours waits for room in the ring, sends what is due. An idle round stops there:
    /// everything else that gives the engine work makes progress itself (posts and the
    /// other verbs through [`with`](Self::with), timers through
    /// [`timeout`](Self::timeout), a new connection through [`attach`](Self::attach)).
    ///
    /// Waking a sleeping peer takes a full fence after the ring writes, which waits until
    /// the peer's core has given up the lines written: in a round, that is on the way from
    /// a packet's arrival to its completion (a SEND's ACK, the room released). So a round
    /// only notes that the peer may need waking, and looks at the next visit, a poll
    /// later, or before the progress thread sleeps. (A peer only sleeps after it found
    /// nothing to do for a while; every path that does not spin wakes it at once.)
    ///
    /// The ACK of what arrived goes in the same round, before the completions reach the
    /// application, although the application waits for those. Measured on `send_lat`
    /// (two processes, interleaved rounds): holding the ACK back until after the
    /// application's next post (the answer first) made it 9-32% slower, since the side
    /// that pings waits for its SEND's completion (as perftest does) and so for the ACK;
    /// an ACK published as a word in the segment instead of a record saved under 4% there
    /// and cost `send_bw` a quarter. Holding a plain ACK back for one round, to go first
    /// in the batch of the application's next post (or with the next round's packets),
    /// made `send_lat` 1.9× slower (2 vCPU AMD EPYC VM, 6 interleaved pairs, 8 B). Made
    /// again, with the held ACK sent by the next round at the latest and only while a
    /// receive's completion goes to the application, it was 1.30× slower (2 vCPU Intel
    /// Xeon, a cache line 145 ns between the cores, 8 interleaved pairs). What it
    /// changes: the peer reads the ACK's line and then the answer's, one after the
    /// other, each a miss, with its handling of the ACK in between; sent at once, the ACK
    /// is read and handled while this side's application works on its answer.
    pub(crate) fn poll(&self, g: &mut Inner, now: Instant) -> bool {
        if g.wake_due {
            g.wake();
        }
        g.lazy_wake = true;
        let moved = self.read(g, now);
        let moved = if moved || g.held() {
            self.pump(g, now) || moved
        } else {
            false
        };
        g.lazy_wake = false;
        moved
    }

    /// Hands what arrived to the engine; a peer that broke the ring's rules fails the QP.
    /// Returns whether anything moved.
    fn read(&self, g: &mut Inner, now: Instant) -> bool {
        #[cfg(feature = "testing")]
        if super::testing::reads_held(g.engine.attrs().dest_qp_num) {
            return false;
        }
        match g.receive(now) {
            Ok(n) => n > 0,
            Err(e) => {
                g.fail(self.qpn, &e.to_string());
                true
            }
        }
    }

    /// The timer set for `at` fired. Returns whether it was due (the engine's deadline
    /// had come) or anything moved: a timer the engine no longer needs (its request was
    /// acknowledged meanwhile, or its deadline moved) is no work.
    pub(crate) fn timeout(&self, g: &mut Inner, at: Instant, now: Instant) -> bool {
        g.timer.fired(at);
        let due = g.engine.poll_timeout().is_some_and(|t| t <= now);
        if due {
            g.engine.handle_timeout(now);
        }
        self.pump(g, now) || due
    }

    /// Sends what the engine has, routes its completions and arms its timer. Returns
    /// whether anything was sent or completed.
    pub(crate) fn pump(&self, g: &mut Inner, now: Instant) -> bool {
        self.pump_at(g, Some(now))
    }

    /// [`pump`](Self::pump) after a post, reading the clock only if the engine may send:
    /// a request executed at post sends nothing, and on that path a clock reading is a
    /// tenth of a post.
    pub(crate) fn pump_posted(&self, g: &mut Inner) -> bool {
        self.pump_at(g, None)
    }

    /// What follows a post whose every request was executed at post: their completions
    /// (the signaled ones) go to the CQ. Nothing else changed: such a request gives the
    /// engine nothing to send, and changes neither its state (the target word) nor its
    /// timers. Unless the CQ had no room for a completion, which moves the QP to ERR: a
    /// whole progress step then follows.
    pub(crate) fn settle_executed(&self, g: &mut Inner) {
        if g.engine.has_completions() {
            soft::route_completions(&mut g.engine, &g.send_cq, &g.recv_cq);
            if g.engine.state() != QpState::Rts {
                self.pump_posted(g);
            }
        }
    }

    /// [`pump`](Self::pump) at `now`, or with `None` at the clock's time if a packet may go.
    fn pump_at(&self, g: &mut Inner, now: Option<Instant>) -> bool {
        let send = match now {
            Some(now) => g.send(now),
            // (`send` with nothing held and nothing from the engine sends nothing.)
            None if g.held() || g.engine.may_transmit() => g.send(soft::clock::now()),
            None => Ok(false),
        };
        let mut moved = match send {
            Ok(sent) => sent,
            Err(e) => {
                g.fail(self.qpn, &e.to_string());
                true
            }
        };
        moved |= soft::route_completions(&mut g.engine, &g.send_cq, &g.recv_cq);
        if let Some(c) = g.conn.as_ref().filter(|c| c.mapped.is_some()) {
            let w = mapped::target_word(g.engine.direct_target_view());
            if w != g.target_word {
                c.seg.target_word(c.side).store(w, Ordering::SeqCst);
                g.target_word = w;
            }
        }
        if let Some(t) = g.engine.poll_timeout() {
            if g.timer.arm(t) {
                self.driver.schedule(t, self.token);
            }
        }
        moved
    }
}

impl Inner {
    /// The QP's handle went (`ibv_destroy_qp`): drops everything the QP holds of
    /// registered memory — its requests and receives, the packet being sent, the regions
    /// a copy reads — so that none of it outlives the handle, even while a round (or a
    /// post of a peer QP in this process) still holds the QP. The caller closes the
    /// connection.
    pub(crate) fn release(&mut self) {
        self.drop_out();
        self.place.clear();
        self.sources.clear();
        self.srq = None;
        self.engine.destroy();
    }

    /// Posts a receive request. The region of its first element is lent past the key
    /// table's lock ([`soft::Lent`]) and kept: the next receive that names it again
    /// resolves its key on the loan, with no look-up and no lock on the table (the two
    /// atomic read-modify-writes of the table's read lock, of a post that takes about ten
    /// such), as long as no region of the table was deregistered since. Each
    /// deregistration waits, after raising the table's count, for this QP's lock
    /// ([`Driver::wait_for_borrowers`]), which the caller holds.
    pub(crate) fn post_recv(&mut self, wr: &rdmx_core::RecvWr) -> crate::Result<()> {
        let lkey = wr.sges.first().map(|s| s.lkey);
        let kept = self
            .recv_lent
            .filter(|l| Some(l.lkey()) == lkey && self.keys.still_lends(l));
        let loan = match (kept, lkey) {
            (Some(l), _) => Some(l),
            (None, Some(k)) => self.keys.read().lend(k),
            (None, None) => None,
        };
        self.recv_lent = loan;
        // SAFETY: the loan was made, or found standing, under this QP's lock, held until
        // the engine has taken its own reference on the region (`WithLoan::new`).
        let mem = unsafe { soft::WithLoan::new(&self.keys, loan.as_ref()) };
        Ok(self.engine.post_recv_ref(&mem, wr)?)
    }

    /// Whether packets taken from the engine wait for room in the ring.
    pub(crate) fn held(&self) -> bool {
        self.out_next < self.out_end
    }

    /// Drops the packets taken from the engine, sent or held, and the regions they name
    /// (the connection went).
    fn drop_out(&mut self) {
        self.out = Vec::new();
        self.out_next = 0;
        self.out_end = 0;
    }

    /// Whether the QP has a connection.
    pub(crate) fn attached(&self) -> bool {
        self.conn.is_some()
    }

    /// Whether the peer has read every packet this QP sent (its engine handled them).
    pub(crate) fn peer_took_all(&self) -> bool {
        self.conn
            .as_ref()
            .is_some_and(|c| !self.held() && c.seg.drained(c.side, &self.prod))
    }

    /// Whether a packet waits in the incoming ring, or one of ours waits for room.
    pub(crate) fn ready(&mut self) -> bool {
        let Some(conn) = self.conn.as_ref() else {
            return false;
        };
        self.held() || !matches!(conn.seg.peek(1 - conn.side, &mut self.cons), Ok(None))
    }

    /// This QP's side of its connection: sleeping or awake. A peer still to be woken is
    /// woken first.
    pub(crate) fn set_asleep(&mut self, on: bool) {
        if self.wake_due {
            self.wake();
        }
        if let Some(c) = self.conn.as_ref() {
            c.seg.set_asleep(c.side, on);
        }
    }

    /// Something went into the ring or room came free: the peer is woken if it sleeps,
    /// now or (in a polling round) at the round's next visit.
    fn peer_may_wait(&mut self) {
        if self.lazy_wake {
            self.wake_due = true;
        } else {
            self.wake();
        }
    }

    /// Wakes the peer if it sleeps.
    fn wake(&mut self) {
        self.wake_due = false;
        if let Some(c) = self.conn.as_ref() {
            if c.seg.take_asleep(1 - c.side) {
                c.wake_peer();
            }
        }
    }
    /// The connection failed: drop it and move the QP to ERR, so every outstanding request
    /// completes with an error status.
    pub(crate) fn fail(&mut self, qpn: u32, why: &str) {
        self.fail_as(qpn, why, tracing::Level::WARN);
    }

    /// [`fail`](Self::fail), logging at `level` (a peer that closed its side is no
    /// anomaly: its application may just have destroyed the QP).
    pub(crate) fn fail_as(&mut self, qpn: u32, why: &str, level: tracing::Level) {
        if self.conn.is_some() {
            if level == tracing::Level::WARN {
                tracing::warn!(qpn, "closing the shared-memory connection: {why}");
            } else {
                tracing::debug!(qpn, "closing the shared-memory connection: {why}");
            }
        }
        self.conn = None;
        self.drop_out();
        if self.engine.state() != QpState::Err && self.engine.state() != QpState::Reset {
            let attr = QpAttr {
                qp_state: QpState::Err,
                ..QpAttr::default()
            };
            let _ = self.engine.modify(&attr, QpAttrMask::STATE);
        }
        soft::route_completions(&mut self.engine, &self.send_cq, &self.recv_cq);
    }
}
