//! UD queue pairs on shm: datagrams between contexts through one Unix datagram socket per
//! context.
//!
//! The rings are per connection, and a UD queue pair has none: it may send to any queue
//! pair of any context it has an address handle for. So each context has, besides its
//! listener, a datagram socket in the abstract namespace ([`socket_name`], named like the
//! listener), and every UD datagram is one IBTA packet (BTH, DETH, immediate data,
//! payload) sent to the socket of the destination context. An address handle names a
//! context by its shm GID ([`shm_gid`](crate::shm_gid): the process id and the context's
//! random number); the QP within it is the BTH's destination QPN.
//!
//! The kernel copies each datagram twice (in and out of the socket); the path is for
//! datagrams of up to the path MTU (64 KiB by default), not for bulk data, which RC moves
//! through the rings.
//!
//! ## What a datagram must pass
//!
//! The receiving socket asks for every sender's credentials (`SO_PASSCRED`): a datagram
//! is taken only from a process of this user (or of one in `Options::allowed_uids`), sent
//! from a socket whose name is that of a context of the sending process (the name's
//! process id is the one the kernel attests), so the source GID in the GRH is the
//! sender's own. It must be no longer than the largest UD packet, name a UD queue pair
//! of this context, and then pass the engine: a well-formed UD packet, the QP's Q_Key, a
//! posted receive that holds the GRH area and the payload. Anything else is dropped and
//! counted ([`UdStats`], per QP in [`QueuePair::dropped`](crate::QueuePair::dropped)).
//! The socket refuses descriptors (`SO_PASSRIGHTS`, Linux 6.16): a sender's `sendmsg`
//! with `SCM_RIGHTS` fails with `EPERM`; on older kernels any that come are closed.
//!
//! ## Memory and back-pressure
//!
//! The kernel bounds each socket's queue (`net.unix.max_dgram_qlen` datagrams, and the
//! socket buffer): a send to a full socket is retried from a queue of at most
//! [`MAX_QUEUED`] bytes, each datagram for at most [`MAX_WAIT`], after which it is dropped and
//! counted, as a congested network drops datagrams. A datagram to a context that does not
//! exist (any more) is dropped at once. There is no multicast on shm.

use std::collections::{HashMap, VecDeque};
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixDatagram};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use rdmx_core::rc::{DatagramInfo, Srq};

use super::sys;
use crate::provider::{CqCore, MrRef};
use crate::soft::{self, Engine, Keys};
use crate::{Error, Result};

/// Bytes of datagrams waiting for room in full destination sockets, at most.
pub const MAX_QUEUED: usize = 4 << 20;
/// How long a datagram waits for room before it is dropped.
pub const MAX_WAIT: Duration = Duration::from_secs(1);
/// Datagrams read in one go before the reader lets others run.
const RX_BUDGET: usize = 64;
/// Bytes of a UD packet beyond its payload, at most (BTH, DETH, immediate data, pad).
const HEADROOM: usize = 32;

/// The abstract socket name of the datagram socket of shm context `id` of process `pid`.
pub fn socket_name(pid: u32, id: u32) -> String {
    format!("rdmx-shm-ud.{pid}.{id:08x}")
}

/// The process and context a datagram socket name names.
fn parse_name(name: &[u8]) -> Option<(u32, u32)> {
    let rest = std::str::from_utf8(name)
        .ok()?
        .strip_prefix("rdmx-shm-ud.")?;
    let (pid, id) = rest.split_once('.')?;
    if id.len() != 8 {
        return None;
    }
    Some((pid.parse().ok()?, u32::from_str_radix(id, 16).ok()?))
}

/// What a context's UD datagram socket received, sent and dropped so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct UdStats {
    /// Datagrams read from the socket.
    pub received: u64,
    /// Datagrams handed to a UD queue pair (which may still drop them: a wrong Q_Key, no
    /// receive; counted in its [`dropped`](crate::QueuePair::dropped)).
    pub delivered: u64,
    /// Dropped: too short for a BTH, or longer than the largest UD packet.
    pub bad_length: u64,
    /// Dropped: not from a context socket of a process of an allowed user.
    pub wrong_source: u64,
    /// Dropped: for a QP number that is no UD queue pair of this context.
    pub unknown_qp: u64,
    /// Datagrams sent.
    pub sent: u64,
    /// Datagrams dropped on the way out: no such context, no room within
    /// [`MAX_WAIT`], more than [`MAX_QUEUED`] bytes waiting, or a destination GID that names no
    /// shm context.
    pub send_dropped: u64,
}

#[derive(Debug, Default)]
struct Counters([AtomicU64; 7]);

const RECEIVED: usize = 0;
const DELIVERED: usize = 1;
const BAD_LENGTH: usize = 2;
const WRONG_SOURCE: usize = 3;
const UNKNOWN_QP: usize = 4;
const SENT: usize = 5;
const SEND_DROPPED: usize = 6;

impl Counters {
    fn add(&self, i: usize) {
        self.0[i].fetch_add(1, Ordering::Relaxed);
    }
    fn get(&self) -> UdStats {
        let g = |i: usize| self.0[i].load(Ordering::Relaxed);
        UdStats {
            received: g(RECEIVED),
            delivered: g(DELIVERED),
            bad_length: g(BAD_LENGTH),
            wrong_source: g(WRONG_SOURCE),
            unknown_qp: g(UNKNOWN_QP),
            sent: g(SENT),
            send_dropped: g(SEND_DROPPED),
        }
    }
}

/// A datagram waiting for room at its destination.
struct Queued {
    to: UnixAddr,
    bytes: Vec<u8>,
    since: Instant,
}

/// A context's datagram socket and its UD queue pairs.
pub(crate) struct Port {
    sock: UnixDatagram,
    /// This context's GID (the destination in the GRH of what it receives).
    gid: [u8; 16],
    qps: RwLock<HashMap<u32, Arc<UdQp>>>,
    /// How many: read by every round of the driver, which looks at the socket only when
    /// there are any.
    count: AtomicUsize,
    /// Datagrams waiting for room, and their bytes.
    out: Mutex<(VecDeque<Queued>, usize)>,
    rx: Mutex<Vec<u8>>,
    /// Users whose processes may send (besides this one's).
    allowed_uids: Vec<u32>,
    counters: Counters,
}

impl std::fmt::Debug for Port {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("shm::ud::Port").finish_non_exhaustive()
    }
}

impl Port {
    /// Runs `f` with every UD queue pair of the context locked, in address order.
    pub(crate) fn with_all_locked<R>(&self, f: impl FnOnce() -> R) -> R {
        let mut qps: Vec<Arc<UdQp>> = self.qps.read().values().cloned().collect();
        qps.sort_by_key(|q| Arc::as_ptr(q) as usize);
        let _held: Vec<_> = qps.iter().map(|q| q.inner.lock()).collect();
        f()
    }

    /// Binds the datagram socket of context `id` of process `pid`, whose UD messages are
    /// at most `max_message` bytes.
    pub(crate) fn bind(
        pid: u32,
        id: u32,
        max_message: usize,
        allowed_uids: Vec<u32>,
    ) -> Result<Port> {
        let addr = UnixAddr::from_abstract_name(socket_name(pid, id))
            .map_err(|e| Error::Io("socket name", e))?;
        let sock =
            UnixDatagram::bind_addr(&addr).map_err(|e| Error::Io("bind the shm UD socket", e))?;
        sock.set_nonblocking(true)
            .map_err(|e| Error::Io("O_NONBLOCK", e))?;
        sys::pass_credentials(sock.as_raw_fd()).map_err(|e| Error::Io("SO_PASSCRED", e))?;
        // Nothing passes descriptors here: a stranger's would have to be closed, which a
        // descriptor set up for it (a socket that lingers) can make slow.
        if !sys::refuse_descriptors(sock.as_raw_fd()).map_err(|e| Error::Io("SO_PASSRIGHTS", e))? {
            tracing::debug!(
                "this kernel cannot refuse descriptors on the shm UD socket (SO_PASSRIGHTS, \
                 Linux 6.16): any sent are closed on receipt"
            );
        }
        Ok(Port {
            sock,
            gid: crate::shm_gid(pid, id).octets(),
            qps: RwLock::new(HashMap::new()),
            count: AtomicUsize::new(0),
            out: Mutex::new((VecDeque::new(), 0)),
            // One byte more than the largest packet, to tell a longer one.
            rx: Mutex::new(vec![0; max_message + HEADROOM + 1]),
            allowed_uids,
            counters: Counters::default(),
        })
    }

    pub(crate) fn fd(&self) -> std::os::fd::RawFd {
        self.sock.as_raw_fd()
    }

    pub(crate) fn stats(&self) -> UdStats {
        self.counters.get()
    }

    /// Whether any UD queue pair lives here (rounds read the socket only then).
    pub(crate) fn in_use(&self) -> bool {
        self.count.load(Ordering::Relaxed) > 0
    }

    /// Whether datagrams wait for room (the progress thread must not sleep long).
    pub(crate) fn backlogged(&self) -> bool {
        !self.out.lock().0.is_empty()
    }

    pub(crate) fn add(&self, qp: Arc<UdQp>) {
        let mut qps = self.qps.write();
        qps.insert(qp.qpn, qp);
        self.count.store(qps.len(), Ordering::Relaxed);
    }

    pub(crate) fn remove(&self, qpn: u32) {
        let mut qps = self.qps.write();
        let qp = qps.remove(&qpn);
        self.count.store(qps.len(), Ordering::Relaxed);
        drop(qps);
        // The QP lets go of the application's memory now (a datagram being handled may
        // hold it a moment longer).
        if let Some(qp) = qp {
            let mut g = qp.inner.lock();
            g.srq = None;
            g.engine.destroy();
        }
    }

    /// Sends datagram `bytes` to the context `dgid` names, or queues it while that
    /// context's socket is full.
    fn send(&self, dgid: [u8; 16], bytes: Vec<u8>) {
        let Some((pid, id)) = crate::shm_of_gid(dgid.into()) else {
            self.counters.add(SEND_DROPPED);
            return;
        };
        let Ok(to) = UnixAddr::from_abstract_name(socket_name(pid, id)) else {
            self.counters.add(SEND_DROPPED);
            return;
        };
        let mut g = self.out.lock();
        let (out, queued) = &mut *g;
        if out.is_empty() && self.try_send(&to, &bytes) {
            return;
        }
        if *queued + bytes.len() > MAX_QUEUED {
            self.counters.add(SEND_DROPPED);
            return;
        }
        *queued += bytes.len();
        out.push_back(Queued {
            to,
            bytes,
            since: Instant::now(),
        });
    }

    /// Sends one datagram; false if the destination has no room (try again later).
    fn try_send(&self, to: &UnixAddr, bytes: &[u8]) -> bool {
        match self.sock.send_to_addr(bytes, to) {
            Ok(_) => {
                self.counters.add(SENT);
                true
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
            Err(e) => {
                // No such context (any more), or a datagram the socket cannot take.
                tracing::trace!("shm UD send dropped: {e}");
                self.counters.add(SEND_DROPPED);
                true
            }
        }
    }

    /// Sends queued datagrams while there is room; drops those that waited too long.
    fn flush(&self, now: Instant) -> bool {
        let Some(mut g) = self.out.try_lock() else {
            return false;
        };
        let (out, queued) = &mut *g;
        let mut moved = false;
        while let Some(q) = out.front() {
            let sent = self.try_send(&q.to, &q.bytes);
            if !sent && now.saturating_duration_since(q.since) <= MAX_WAIT {
                break;
            }
            if !sent {
                self.counters.add(SEND_DROPPED);
            }
            *queued -= q.bytes.len();
            out.pop_front();
            moved = true;
        }
        moved
    }

    /// Sends what waits and reads what arrived. Returns whether anything moved.
    pub(crate) fn progress(&self, now: Instant) -> bool {
        let moved = self.flush(now);
        self.receive(now) | moved
    }

    fn allows(&self, uid: u32) -> bool {
        uid == sys::euid() || self.allowed_uids.contains(&uid)
    }

    /// Reads up to [`RX_BUDGET`] datagrams and hands each to its queue pair.
    fn receive(&self, now: Instant) -> bool {
        let Some(mut buf) = self.rx.try_lock() else {
            return false;
        };
        let mut moved = false;
        for _ in 0..RX_BUDGET {
            let d = match sys::recv_dgram(self.sock.as_raw_fd(), &mut buf) {
                Ok(d) => d,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    tracing::debug!("shm UD receive: {e}");
                    break;
                }
            };
            moved = true;
            self.counters.add(RECEIVED);
            let sender = parse_name(&d.from);
            let source_ok = match (d.cred, sender) {
                (Some((uid, pid)), Some((name_pid, _))) => {
                    self.allows(uid) && u32::try_from(pid).ok() == Some(name_pid)
                }
                _ => false,
            };
            let Some((pid, id)) = sender.filter(|_| source_ok) else {
                self.counters.add(WRONG_SOURCE);
                continue;
            };
            if d.len < rdmx_wire::BTH_LEN || d.len >= buf.len() {
                self.counters.add(BAD_LENGTH);
                continue;
            }
            let bytes = &buf[..d.len];
            let qpn = u32::from_be_bytes([0, bytes[5], bytes[6], bytes[7]]);
            let qp = self.qps.read().get(&qpn).cloned();
            let Some(qp) = qp else {
                self.counters.add(UNKNOWN_QP);
                continue;
            };
            self.counters.add(DELIVERED);
            let info = DatagramInfo {
                sgid: crate::shm_gid(pid, id).octets(),
                dgid: self.gid,
                roce_ipv4: false,
                roce_ipv6: false,
            };
            qp.deliver(&info, bytes, now);
        }
        moved
    }
}

/// A UD queue pair of the shm provider: the engine, and the context's port its
/// datagrams go through.
pub(crate) struct UdQp {
    pub(crate) qpn: u32,
    pub(crate) port: Arc<Port>,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for UdQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("shm::UdQp").field("qpn", &self.qpn).finish()
    }
}

pub(crate) struct Inner {
    pub(crate) engine: Engine,
    pub(crate) keys: Arc<Keys>,
    send_cq: Arc<CqCore>,
    recv_cq: Arc<CqCore>,
    srq: Option<Arc<Mutex<Srq<MrRef>>>>,
}

impl UdQp {
    pub(crate) fn new(
        qpn: u32,
        port: Arc<Port>,
        engine: Engine,
        keys: Arc<Keys>,
        cqs: (Arc<CqCore>, Arc<CqCore>),
        srq: Option<Arc<Mutex<Srq<MrRef>>>>,
    ) -> UdQp {
        UdQp {
            qpn,
            port,
            inner: Mutex::new(Inner {
                engine,
                keys,
                send_cq: cqs.0,
                recv_cq: cqs.1,
                srq,
            }),
        }
    }

    /// Runs `f` on the engine, then sends what it produced and routes completions.
    pub(crate) fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        let mut g = self.inner.lock();
        let out = f(&mut g);
        self.pump(&mut g);
        out
    }

    fn deliver(&self, info: &DatagramInfo, bytes: &[u8], _now: Instant) {
        let mut g = self.inner.lock();
        {
            let Inner {
                engine, keys, srq, ..
            } = &mut *g;
            let mut srq = srq.as_ref().map(|s| s.lock());
            engine.handle_datagram(&**keys, srq.as_deref_mut(), info, bytes);
        }
        self.pump(&mut g);
    }

    /// Sends every datagram the engine built and routes its completions.
    fn pump(&self, g: &mut Inner) {
        let now = Instant::now();
        while let Some((bytes, av)) = g.engine.poll_datagram(now, &*g.keys) {
            match av {
                Some(av) => self.port.send(av.dgid, bytes),
                None => self.port.counters.add(SEND_DROPPED),
            }
        }
        soft::route_completions(&mut g.engine, &g.send_cq, &g.recv_cq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_names_parse_back_and_others_do_not() {
        assert_eq!(
            parse_name(socket_name(42, 0xdead_beef).as_bytes()),
            Some((42, 0xdead_beef))
        );
        for bad in [
            &b"rdmx-shm.42.deadbeef"[..],
            b"rdmx-shm-ud.42.dead",
            b"rdmx-shm-ud.x.deadbeef",
            b"rdmx-shm-ud.42",
            b"",
            &[0xff, 0xfe][..],
        ] {
            assert_eq!(parse_name(bad), None, "{bad:?}");
        }
    }
}
