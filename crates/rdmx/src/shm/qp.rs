//! A queue pair of the shm provider: the RC engine and its connection, a ring in each
//! direction of a shared segment.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rdmx_core::rc::{Placement, Srq, Transmit};
use rdmx_core::{QpAttr, QpAttrMask, QpState};

use super::copy::copy;
use super::ring::{Consumer, Producer, RingError, Segment};
use super::{sys, Driver};
use crate::provider::{CqCore, MrRef};
use crate::soft::{self, Engine, Keys};

/// Records read from a ring in one go before the QP lets others run.
const RX_BUDGET: usize = 64;

/// A connection: the segment, which side of it this QP is, the socket that tells when
/// the peer goes away, and the peer's wake-up eventfd.
#[derive(Debug)]
pub(crate) struct Conn {
    pub(crate) seg: Segment,
    /// 0: the side that created the segment; this side sends on ring `side`.
    pub(crate) side: usize,
    pub(crate) sock: UnixStream,
    pub(crate) peer_event: OwnedFd,
}

/// An shm queue pair, shared by its handle and the driver.
pub(crate) struct ShmQp {
    pub(crate) qpn: u32,
    /// The secret a peer connecting to this QP must present.
    pub(crate) secret: u64,
    pub(crate) token: usize,
    pub(crate) driver: Arc<Driver>,
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
    /// The packet being sent; `held`: it waits for room in the ring.
    scratch: Transmit<MrRef>,
    held: bool,
    place: Vec<Placement<MrRef>>,
    prefix: Vec<u8>,
    /// Waiting for the peer QP with this number to connect.
    pub(crate) expect_peer: Option<u32>,
    pub(crate) peer: Option<Peer>,
    pub(crate) my_psn: u32,
    pub(crate) connect_timeout: Duration,
    /// The earliest deadline handed to the driver and not yet fired.
    timer: Option<Instant>,
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
            secret,
            token,
            driver,
            inner: Mutex::new(Inner {
                engine,
                keys,
                send_cq: cqs.0,
                recv_cq: cqs.1,
                srq,
                conn: None,
                prod: Producer::default(),
                cons: Consumer::default(),
                scratch: Transmit::default(),
                held: false,
                place: Vec::new(),
                prefix: Vec::new(),
                expect_peer: None,
                peer: None,
                my_psn: 0,
                connect_timeout: Duration::from_secs(10),
                timer: None,
            }),
        }
    }

    /// Runs `f` on the engine, then sends what it produced and routes completions.
    pub(crate) fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        let mut g = self.inner.lock();
        let out = f(&mut g);
        self.pump(&mut g, Instant::now());
        out
    }

    /// Gives the QP its connection.
    pub(crate) fn attach(&self, g: &mut Inner, conn: Conn) {
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
        self.driver.activate(self);
        self.progress(g, Instant::now());
    }

    /// Reads what arrived and sends what is due. Returns whether anything moved.
    pub(crate) fn progress(&self, g: &mut Inner, now: Instant) -> bool {
        let moved = match g.receive(now) {
            Ok(n) => n > 0,
            Err(e) => {
                g.fail(self.qpn, &e.to_string());
                true
            }
        };
        self.pump(g, now) || moved
    }

    /// A timer may be due.
    pub(crate) fn timeout(&self, g: &mut Inner, now: Instant) {
        g.timer = None;
        if g.engine.poll_timeout().is_some_and(|t| t <= now) {
            g.engine.handle_timeout(now);
        }
        self.pump(g, now);
    }

    /// Sends what the engine has, routes its completions and arms its timer. Returns
    /// whether anything was sent or completed.
    pub(crate) fn pump(&self, g: &mut Inner, now: Instant) -> bool {
        let mut moved = match g.send(now) {
            Ok(sent) => sent,
            Err(e) => {
                g.fail(self.qpn, &e.to_string());
                true
            }
        };
        moved |= soft::route_completions(&mut g.engine, &g.send_cq, &g.recv_cq);
        if let Some(t) = g.engine.poll_timeout() {
            if g.timer.map_or(true, |held| t < held) {
                g.timer = Some(t);
                self.driver.schedule(t, self.token);
            }
        }
        moved
    }
}

impl Inner {
    /// Whether the QP has a connection.
    pub(crate) fn attached(&self) -> bool {
        self.conn.is_some()
    }

    /// Whether a packet waits in the incoming ring, or one of ours waits for room.
    pub(crate) fn ready(&mut self) -> bool {
        let Some(conn) = self.conn.as_ref() else {
            return false;
        };
        self.held || !matches!(conn.seg.peek(1 - conn.side, &mut self.cons), Ok(None))
    }

    /// Side `side` of every connection: sleeping or awake.
    pub(crate) fn set_asleep(&self, on: bool) {
        if let Some(c) = self.conn.as_ref() {
            c.seg.set_asleep(c.side, on);
        }
    }

    /// Hands incoming records to the engine, placing payloads straight from the ring into
    /// registered memory. Returns how many records were read.
    fn receive(&mut self, now: Instant) -> Result<usize, RingError> {
        let Some(conn) = self.conn.as_ref() else {
            return Ok(0);
        };
        let (seg, ring) = (&conn.seg, 1 - conn.side);
        let mut n = 0;
        while n < RX_BUDGET {
            if !matches!(
                self.engine.state(),
                QpState::Rtr | QpState::Rts | QpState::Sqd
            ) {
                // The engine would drop what arrives; leave it in the ring until it can
                // take it (RTR), or until the connection goes.
                if self.engine.state() != QpState::Err {
                    break;
                }
            }
            let Some(rec) = seg.peek(ring, &mut self.cons)? else {
                break;
            };
            if rec.prefix < rdmx_wire::BTH_LEN {
                return Err(RingError::Garbage("a packet shorter than its headers"));
            }
            self.prefix.resize(rec.prefix, 0);
            // SAFETY: `prefix` is a local buffer of `rec.prefix` bytes.
            unsafe { seg.read(ring, &rec, false, 0, self.prefix.as_mut_ptr(), rec.prefix) };
            let op = rdmx_wire::Opcode::try_from(self.prefix[0])
                .map_err(|_| RingError::Garbage("a packet with an unknown opcode"))?;
            let h = op.header_len();
            if h > rec.prefix {
                return Err(RingError::Garbage("a packet shorter than its headers"));
            }
            let inline = rec.prefix - h;
            let rest = inline + rec.len;
            let mut srq = self.srq.as_ref().map(|s| s.lock());
            let handled = self.engine.handle_header(
                now,
                &*self.keys,
                srq.as_deref_mut(),
                &self.prefix[..h],
                rest,
                &mut self.place,
            );
            drop(srq);
            if handled.is_none() {
                return Err(RingError::Garbage(
                    "malformed or unsupported packet headers",
                ));
            }
            for p in &self.place {
                let (a, b) = (p.offset as usize, p.offset as usize + p.len as usize);
                if b > rest {
                    return Err(RingError::Garbage("a payload beyond its record"));
                }
                // The part of the placement in the prefix (inline payload)...
                if a < inline {
                    let e = b.min(inline);
                    let at = (p.addr as usize).wrapping_sub(p.mr.addr());
                    p.mr.write_at(at, &self.prefix[h + a..h + e])
                        .expect("the engine places inside resolved regions");
                }
                // ... and the part in the ring.
                if b > inline {
                    let from = a.max(inline);
                    let len = b - from;
                    let dst =
                        p.mr.raw_range(p.addr + (from - a) as u64, len)
                            .expect("the engine places inside resolved regions");
                    // SAFETY: `dst` is registered memory kept alive by the placement's
                    // MrRef, `len` bytes inside its bounds (raw_range checked), and not in
                    // the segment; the range lies in the record's payload (checked above).
                    unsafe { seg.read(ring, &rec, true, from - inline, dst, len) };
                }
            }
            seg.consume(ring, &mut self.cons, &rec);
            n += 1;
        }
        if n > 0 && conn.seg.take_asleep(ring) {
            // The peer sleeps and may wait for the room just released.
            sys::signal(conn.peer_event.as_raw_fd());
        }
        Ok(n)
    }

    /// Moves the engine's packets into the outgoing ring until it has none or the ring is
    /// full. Returns whether any was sent.
    fn send(&mut self, now: Instant) -> Result<bool, RingError> {
        let Some(conn) = self.conn.as_ref() else {
            return Ok(false);
        };
        let ring = conn.side;
        let mut sent = false;
        loop {
            if !self.held {
                if !self.engine.poll_transmit_parts(now, &mut self.scratch) {
                    break;
                }
                self.held = true;
            }
            let t = &self.scratch;
            let payload: usize =
                t.gather.iter().map(|s| s.len as usize).sum::<usize>() + usize::from(t.pad);
            let align = t.gather.first().map_or(0, |s| s.addr as usize);
            let pushed = conn.seg.push(
                ring,
                &mut self.prod,
                t.header.len(),
                payload,
                align,
                |pre, pay| {
                    // SAFETY: `push` hands out `t.header.len()` writable bytes at `pre` and
                    // `payload` at `pay`, inside the segment; the sources are the packet's
                    // own header buffer and registered memory kept alive by the spans'
                    // MrRefs, inside the bounds raw_range checks.
                    unsafe {
                        copy(pre, t.header.as_ptr(), t.header.len());
                        let mut at = 0;
                        for s in &t.gather {
                            let src =
                                s.mr.raw_range(s.addr, s.len as usize)
                                    .expect("the engine gathers inside resolved regions");
                            copy(pay.add(at), src, s.len as usize);
                            at += s.len as usize;
                        }
                        std::ptr::write_bytes(pay.add(at), 0, usize::from(t.pad));
                    }
                },
            )?;
            if !pushed {
                break;
            }
            self.held = false;
            sent = true;
        }
        if sent && conn.seg.take_asleep(1 - conn.side) {
            sys::signal(conn.peer_event.as_raw_fd());
        }
        Ok(sent)
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
        self.held = false;
        self.scratch = Transmit::default();
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
