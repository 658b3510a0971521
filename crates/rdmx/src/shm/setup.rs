//! Connection setup: the hello on a new connection's socket, with the segment's memfd
//! and (on the `mapped` data path) the key tables, and its checks. After it, the socket
//! carries wake-ups and files (see `Conn::read_messages`); no descriptor either side
//! writes to is shared (a peer could make it block).

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};
use std::sync::{Arc, Weak};
use std::time::Instant;

use super::qp::{Conn, Inner, ShmQp};
use super::ring::Segment;
use super::{hs_token, local_peer, mapped, socket_name, sys, Driver, HANDSHAKE_TIMEOUT, MIN_RING};
use crate::{Error, Result};

const HELLO_MAGIC: &[u8; 8] = b"RDMXSHM4";
const HELLO_LEN: usize = 44;
const REPLY_MAGIC: &[u8; 8] = b"RDMXSHK4";
const REPLY_LEN: usize = 16;
/// Most connections that wait for their hello at once (beyond them, the hellos that came
/// are taken, then the one that waited longest is closed).
const MAX_HANDSHAKES: usize = 256;

impl Driver {
    /// Establishes the connection of `qp`, which just entered RTR: with a peer bound and
    /// this side the smaller of the pair, connects to the peer's socket and hands it the
    /// segment; otherwise waits for the peer (the RTR attributes' destination) to connect.
    pub(super) fn establish(&self, qp: &ShmQp, ring_bytes: usize) -> Result<()> {
        let (peer, my_psn, timeout, dest) = {
            let g = qp.inner.lock();
            (g.peer, g.my_psn, g.connect_timeout, g.engine.dest_qpn())
        };
        let Some(peer) = peer.filter(|p| p.qpn == dest) else {
            return self.expect(qp, dest);
        };
        if (qp.qpn, my_psn) >= (peer.qpn, peer.psn) {
            return self.expect(qp, peer.qpn);
        }
        let addr = UnixAddr::from_abstract_name(socket_name(peer.pid, peer.dev))
            .map_err(|e| Error::Io("socket name", e))?;
        let s = UnixStream::connect_addr(&addr).map_err(|e| Error::Io("connect (shm)", e))?;
        let (uid, peer_pid) = sys::peer_cred(&s).map_err(|e| Error::Io("SO_PEERCRED", e))?;
        if !self.allows(uid) {
            tracing::warn!(
                uid,
                "refusing an shm peer that runs as another user (not in allowed_uids)"
            );
            return Err(Error::Protocol(
                "the shm peer runs as another user, not in allowed_uids",
            ));
        }
        s.set_read_timeout(Some(timeout))
            .map_err(|e| Error::Io("SO_RCVTIMEO", e))?;
        s.set_write_timeout(Some(timeout))
            .map_err(|e| Error::Io("SO_SNDTIMEO", e))?;
        let (seg, memfd) =
            Segment::create(ring_bytes).map_err(|e| Error::Io("create the shm segment", e))?;
        let mut hello = [0u8; HELLO_LEN];
        hello[..8].copy_from_slice(HELLO_MAGIC);
        hello[8..12].copy_from_slice(&peer.qpn.to_be_bytes());
        hello[12..16].copy_from_slice(&qp.qpn.to_be_bytes());
        hello[16..24].copy_from_slice(&peer.secret.to_be_bytes());
        hello[24..32].copy_from_slice(&(ring_bytes as u64).to_be_bytes());
        hello[32..40].copy_from_slice(&self.probe_addr().to_be_bytes());
        hello[40..44].copy_from_slice(&self.id.to_be_bytes());
        let mut fds = vec![memfd.as_raw_fd()];
        fds.extend(self.published.as_ref().map(|p| p.fd().as_raw_fd()));
        sys::send_with_fds(&s, &hello, &fds).map_err(|e| Error::Io("send the shm hello", e))?;
        let mut reply = [0u8; REPLY_LEN];
        let fds = sys::recv_with_fds(&s, &mut reply).map_err(|e| {
            Error::Io(
                "receiving the shm peer's answer (it closes the connection on a wrong secret)",
                e,
            )
        })?;
        // The peer has its copy: ours goes (a memfd has no name to unlink).
        drop(memfd);
        if &reply[..8] != REPLY_MAGIC {
            return Err(Error::Protocol("the shm peer's answer is not rdmx's"));
        }
        let mut fds = fds.into_iter();
        let mapped = self.peer_view(qp.qpn, fds.next());
        let peer_probe = u64::from_be_bytes(reply[8..16].try_into().expect("8 bytes"));
        let (direct, peer_qp) = local_peer(self.direct, peer_pid, peer.dev, peer.qpn);
        let pulls = direct.is_some() || self.try_pull(qp.qpn, peer_pid, peer_probe);
        if pulls {
            seg.set_pulls(0);
        }
        s.set_nonblocking(true)
            .map_err(|e| Error::Io("O_NONBLOCK", e))?;
        let mut g = qp.inner.lock();
        qp.attach(
            &mut g,
            Conn {
                seg: Arc::new(seg),
                side: 0,
                sock: Arc::new(s),
                peer_pid,
                pulls,
                direct,
                peer_qp: peer_qp.filter(|_| self.execute_at_post),
                mapped,
                peer_gone: Arc::default(),
            },
        );
        Ok(())
    }

    /// The peer's key table, mapped, if both sides run the `mapped` data path (the peer
    /// sent `fd`). Says why not in the log.
    fn peer_view(&self, qpn: u32, fd: Option<OwnedFd>) -> Option<mapped::PeerView> {
        self.published.as_ref()?;
        let Some(fd) = fd else {
            tracing::debug!(qpn, "shm: the peer does not run the mapped data path");
            return None;
        };
        match mapped::PeerView::open(&fd) {
            Ok(v) => Some(v),
            Err(e) => {
                tracing::warn!(
                    qpn,
                    "shm: the peer's key table is unusable ({e}); no mapped path"
                );
                None
            }
        }
    }

    /// Whether a process of user `uid` may be a peer.
    fn allows(&self, uid: u32) -> bool {
        uid == sys::euid() || self.allowed_uids.contains(&uid)
    }

    /// The address of the word a peer reads to learn whether it can pull from this
    /// process; 0 (do not try) when this context keeps to the ring.
    fn probe_addr(&self) -> u64 {
        if self.cma {
            sys::probe_addr()
        } else {
            0
        }
    }

    /// Whether QP `qpn` can pull from process `pid`, which named its probe word at `addr`
    /// (0: the peer keeps to the ring). Says why not in the log.
    fn try_pull(&self, qpn: u32, pid: i32, addr: u64) -> bool {
        if !self.cma || addr == 0 {
            tracing::debug!(qpn, "shm data path: ring (cma not asked for on both sides)");
            return false;
        }
        match sys::probe(pid, addr) {
            Ok(()) => {
                tracing::debug!(qpn, pid, "shm: payloads from the peer arrive by cma");
                true
            }
            Err(e) => {
                tracing::warn!(
                    qpn,
                    pid,
                    "shm: cannot read the peer's memory with process_vm_readv ({e}; \
                     see kernel.yama.ptrace_scope): its payloads come through the ring"
                );
                false
            }
        }
    }

    /// Lets QP `from` connect to `qp`, taking its connection if it already did.
    fn expect(&self, qp: &ShmQp, from: u32) -> Result<()> {
        let mut g = qp.inner.lock();
        g.expect_peer = Some(from);
        if let Some(conn) = self.pending.take(qp.qpn, from) {
            qp.attach(&mut g, conn);
        }
        Ok(())
    }

    /// Takes the connections waiting on the listener. Any process may connect to a socket
    /// in the abstract namespace: one of a user this context does not admit is closed at
    /// once, and at most [`MAX_HANDSHAKES`] connections wait for their hello (beyond them,
    /// the hellos that came are taken, then a new one closes the one that waited longest),
    /// so that no peer can take all of this process's descriptors.
    pub(super) fn accept(&self) {
        loop {
            match self.listener.accept() {
                Ok((s, _)) => {
                    match sys::peer_cred(&s) {
                        Ok((uid, _)) if self.allows(uid) => {}
                        Ok((uid, pid)) => {
                            tracing::warn!(
                                uid,
                                pid,
                                "refusing an shm connection from a process of another user \
                                 (not in allowed_uids)"
                            );
                            continue;
                        }
                        Err(e) => {
                            tracing::warn!("refusing an shm connection: SO_PEERCRED: {e}");
                            continue;
                        }
                    }
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
                        // The one that waited longest goes: a peer that connects and sends
                        // its hello at once gets through, whoever else keeps connecting.
                        if let Some(k) = hs.iter().min_by_key(|(_, h)| h.1).map(|(k, _)| k) {
                            let (old, _) = hs.remove(k);
                            self.epoll.remove(old.as_raw_fd());
                            tracing::warn!(
                                "closing an shm connection that sent no hello: \
                                 {MAX_HANDSHAKES} connections wait for theirs"
                            );
                        }
                    }
                    let entry = hs.vacant_entry();
                    if s.set_nonblocking(true).is_ok()
                        && self.epoll.add(s.as_raw_fd(), hs_token(entry.key())).is_ok()
                    {
                        entry.insert((s, Instant::now()));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::warn!("accept (shm) failed: {e}");
                    return;
                }
            }
        }
    }

    pub(super) fn handshake(&self, key: usize) {
        let mut hs = self.handshakes.lock();
        let Some((s, _)) = hs.get(key) else { return };
        let mut hello = [0u8; HELLO_LEN];
        let got = sys::recv_with_fds(s, &mut hello);
        if matches!(&got, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock) {
            return;
        }
        let (s, _) = hs.remove(key);
        drop(hs);
        self.epoll.remove(s.as_raw_fd());
        if let Err(why) = self.admit(s, got, &hello) {
            tracing::warn!("refusing an shm connection: {why}");
        }
    }

    /// Checks a hello and its descriptors, answers, and hands the connection to its QP
    /// (or parks it until the QP reaches RTR).
    fn admit(
        &self,
        s: UnixStream,
        got: std::io::Result<Vec<OwnedFd>>,
        hello: &[u8; HELLO_LEN],
    ) -> std::result::Result<(), String> {
        let fds = got.map_err(|e| format!("no hello ({e})"))?;
        let (uid, pid) = sys::peer_cred(&s).map_err(|e| format!("SO_PEERCRED: {e}"))?;
        if !self.allows(uid) {
            return Err(format!(
                "process {pid} runs as user {uid}, not this one's nor in allowed_uids"
            ));
        }
        if &hello[..8] != HELLO_MAGIC {
            return Err("the hello is not rdmx's".into());
        }
        let be32 = |i: usize| u32::from_be_bytes(hello[i..i + 4].try_into().expect("4 bytes"));
        let (to, from) = (be32(8), be32(12));
        let secret = u64::from_be_bytes(hello[16..24].try_into().expect("8 bytes"));
        let cap = u64::from_be_bytes(hello[24..32].try_into().expect("8 bytes"));
        let token = self.by_qpn.lock().get(&to).copied();
        let qp = token.and_then(|t| self.qps.lock().get(t).and_then(Weak::upgrade));
        let Some(qp) = qp else {
            return Err(format!("QP {to} (from QP {from}) does not exist"));
        };
        let presented = |g: &Inner| {
            if secret == g.secret {
                Ok(())
            } else {
                Err(format!(
                    "the connection to QP {to} from QP {from} did not present its secret"
                ))
            }
        };
        presented(&qp.inner.lock())?;
        let mut fds = fds.into_iter();
        let Some(memfd) = fds.next() else {
            return Err("the hello lacks the segment".into());
        };
        let cap = usize::try_from(cap)
            .ok()
            .filter(|&c| c >= MIN_RING)
            .ok_or_else(|| format!("a ring size out of range ({cap} bytes)"))?;
        let seg = Segment::open(&memfd, cap).map_err(|e| format!("the segment: {e}"))?;
        drop(memfd);
        let peer_probe = u64::from_be_bytes(hello[32..40].try_into().expect("8 bytes"));
        let (direct, peer_qp) = local_peer(self.direct, pid, be32(40), from);
        let pulls = direct.is_some() || self.try_pull(to, pid, peer_probe);
        if pulls {
            seg.set_pulls(1);
        }
        let mapped = self.peer_view(to, fds.next());
        let mut reply = [0u8; REPLY_LEN];
        reply[..8].copy_from_slice(REPLY_MAGIC);
        reply[8..16].copy_from_slice(&self.probe_addr().to_be_bytes());
        let out: Vec<_> = self.published.iter().map(|p| p.fd().as_raw_fd()).collect();
        sys::send_with_fds(&s, &reply, &out).map_err(|e| format!("answer: {e}"))?;
        let conn = Conn {
            seg: Arc::new(seg),
            side: 1,
            sock: Arc::new(s),
            peer_pid: pid,
            pulls,
            direct,
            peer_qp: peer_qp.filter(|_| self.execute_at_post),
            mapped,
            peer_gone: Arc::default(),
        };
        // Checked again under the lock that a reset's new secret takes, under which the
        // connection is attached or parked: none presenting the old secret outlives the
        // reset ([`Driver::rekey`]).
        let mut g = qp.inner.lock();
        presented(&g)?;
        if g.attached() {
            return Err(format!("a second connection for connected QP {to}"));
        }
        if g.expect_peer == Some(from) {
            qp.attach(&mut g, conn);
        } else if let Some(expected) = g.expect_peer {
            return Err(format!(
                "a connection to QP {to} from QP {from}, not the expected {expected}"
            ));
        } else {
            self.pending.park(to, from, conn);
        }
        Ok(())
    }

    /// `qp` went back to RESET with first PSN `psn` and secret `secret`: a connection
    /// parked for it, or attached to it since the reset (the peer it last expected, with
    /// the old secret), goes, and it expects no peer until its next move to RTR.
    pub(super) fn rekey(&self, qp: &ShmQp, psn: u32, secret: u64) {
        let mut g = qp.inner.lock();
        g.my_psn = psn;
        g.secret = secret;
        g.expect_peer = None;
        let late = g.conn.take();
        self.pending.remove(qp.qpn);
        drop(g);
        if let Some(c) = late {
            tracing::warn!(
                qpn = qp.qpn,
                "closing a connection made with the secret the QP had before its reset"
            );
            self.reset_conn(qp, c);
        }
    }

    /// Closes handshakes and parked connections that waited too long.
    pub(super) fn expire(&self) {
        let mut hs = self.handshakes.lock();
        let stale: Vec<usize> = hs
            .iter()
            .filter(|(_, h)| h.1.elapsed() > HANDSHAKE_TIMEOUT)
            .map(|(k, _)| k)
            .collect();
        for k in stale {
            let (s, _) = hs.remove(k);
            self.epoll.remove(s.as_raw_fd());
            tracing::warn!(
                "closing an shm connection that sent no hello within {HANDSHAKE_TIMEOUT:?}"
            );
        }
        drop(hs);
        self.pending.expire();
    }
}
