//! UD queue pairs on udp: RoCEv2 datagrams, and multicast by IP multicast.
//!
//! A UD datagram is one RoCEv2 packet (BTH, DETH with the Q_Key and the source QPN,
//! immediate data, payload, ICRC) in one UDP datagram to port 4791 of the address its
//! address handle names: an IPv4-mapped GID is an IPv4 address, as `rdma_gid2ip` reads
//! it, any other an IPv6 one. It leaves from the context's socket like every packet and
//! arrives there; the receive path checks it as every datagram (length, ICRC, BTH) and
//! hands it to the UD queue pair its BTH names, from any source: a UD queue pair has no
//! peer. The engine then checks the Q_Key and the receive (see
//! [`rdmx_core::rc`]'s UD). The GRH area of a receive gets what rxe puts there: over IPv4,
//! 20 bytes of zeros and the datagram's IPv4 header (rebuilt from what the socket saw:
//! identification 0 and TTL 64 stand for the fields user space does not see); over IPv6,
//! a GRH naming both addresses.
//!
//! ## Multicast
//!
//! An IPv4 context joins IPv4 groups, named by IPv4-mapped multicast GIDs
//! (`::ffff:224.0.0.0/100`, the GIDs rdma_cm makes for RoCEv2 over IPv4): the first of
//! its queue pairs to attach to a group opens a socket bound to the group's address on
//! port 4791 (`SO_REUSEADDR`, so every context of the host can) and joins it on the
//! context's own interface (`IP_ADD_MEMBERSHIP`); a thread reads it and hands each
//! datagram for QPN `0xFFFFFF` to every queue pair of the context attached to the group.
//! The last to detach closes the socket, which leaves the group. Datagrams to a group go
//! out of the context's interface (`IP_MULTICAST_IF`) and are looped back to the host's
//! members. An IPv6 context has no multicast (its capabilities say so).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rdmx_core::rc::DatagramInfo;
use rdmx_core::MULTICAST_QPN;

use super::icrc::{self, ROCE_PORT};
use super::qp::{Inner, UdpQp};
use crate::soft;
use crate::{Error, Result};

/// How often a group's reader looks whether it should stop.
const READ_TIMEOUT: Duration = Duration::from_millis(50);

/// The UDP address a destination GID names (`rdma_gid2ip`): an IPv4-mapped GID is an
/// IPv4 address.
pub(crate) fn addr_of(gid: [u8; 16]) -> SocketAddr {
    let v6 = Ipv6Addr::from(gid);
    match v6.to_ipv4_mapped() {
        Some(v4) => SocketAddr::new(IpAddr::V4(v4), ROCE_PORT),
        None => SocketAddr::new(IpAddr::V6(v6), ROCE_PORT),
    }
}

/// The GID of an IP address: an IPv4 one mapped.
fn gid_of(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// Prepares a context's socket for UD: datagrams to IPv4 groups leave through the
/// context's own interface (and loop back to the host's members).
pub(crate) fn prepare(sock: &UdpSocket) -> Result<()> {
    let local = sock.local_addr().map_err(|e| Error::Io("getsockname", e))?;
    if let IpAddr::V4(v4) = local.ip() {
        let s = socket2::SockRef::from(sock);
        s.set_multicast_if_v4(&v4)
            .map_err(|e| Error::Io("IP_MULTICAST_IF", e))?;
        s.set_multicast_loop_v4(true)
            .map_err(|e| Error::Io("IP_MULTICAST_LOOP", e))?;
    }
    Ok(())
}

/// Sends every datagram a UD queue pair's engine built, each sealed for its own
/// destination, and routes its completions.
pub(crate) fn pump(qp: &UdpQp, g: &mut Inner, now: Instant) {
    let local = qp.driver.local;
    // Consecutive datagrams to one destination leave in one batch.
    let mut run: Vec<Vec<u8>> = Vec::new();
    let mut run_to: Option<SocketAddr> = None;
    while let Some((mut bytes, av)) = g.engine.poll_datagram(now, &*g.keys) {
        let Some(to) = av.map(|av| addr_of(av.dgid)) else {
            qp.driver.stats.count_unrouted();
            continue;
        };
        if to.is_ipv4() != local.is_ipv4() || to.ip().is_unspecified() {
            // No route from this context's address family.
            qp.driver.stats.count_unrouted();
            continue;
        }
        if run_to.is_some_and(|r| r != to) {
            qp.driver.send_now(run_to.take().expect("a run"), &mut run);
            run.clear();
        }
        icrc::seal(local, to, &mut bytes);
        run.push(bytes);
        run_to = Some(to);
    }
    if let Some(to) = run_to {
        qp.driver.send_now(to, &mut run);
    }
    soft::route_completions(&mut g.engine, &g.send_cq, &g.recv_cq);
}

/// Feeds a datagram (its ICRC checked and removed) from `from` to UD queue pair `qp`.
pub(crate) fn receive(g: &mut Inner, from: SocketAddr, to: SocketAddr, packet: &[u8]) {
    let info = DatagramInfo {
        sgid: gid_of(from.ip()),
        dgid: gid_of(to.ip()),
        roce_ipv4: from.is_ipv4() && to.is_ipv4(),
        roce_ipv6: from.is_ipv6() && to.is_ipv6(),
    };
    let Inner {
        engine, keys, srq, ..
    } = g;
    let mut srq = srq.as_ref().map(|s| s.lock());
    engine.handle_datagram(&**keys, srq.as_deref_mut(), &info, packet);
}

/// A group this context joined: its socket, and its members here.
struct Group {
    members: Mutex<Vec<Arc<UdpQp>>>,
    stop: AtomicBool,
}

/// The multicast groups a context's queue pairs joined.
#[derive(Default)]
pub(crate) struct Groups {
    map: Mutex<HashMap<Ipv4Addr, Arc<Group>>>,
}

impl std::fmt::Debug for Groups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("udp::Groups").finish_non_exhaustive()
    }
}

/// The IPv4 group a multicast GID names on an IPv4 context.
fn group_of(gid: [u8; 16]) -> Result<Ipv4Addr> {
    match Ipv6Addr::from(gid).to_ipv4_mapped() {
        Some(v4) if v4.is_multicast() => Ok(v4),
        _ => Err(Error::InvalidArgument(
            "a udp context joins IPv4 groups, named by IPv4-mapped GIDs (::ffff:224.0.0.0/100)",
        )),
    }
}

impl Groups {
    /// Attaches `qp` to group `gid` (joining it if it is the context's first member), or
    /// detaches it.
    pub(crate) fn attach(
        &self,
        qp: &Arc<UdpQp>,
        gid: [u8; 16],
        attach: bool,
        max_datagram: usize,
    ) -> Result<()> {
        let IpAddr::V4(local) = qp.driver.local.ip() else {
            return Err(Error::Unsupported("an IPv6 udp context has no multicast"));
        };
        let group = group_of(gid)?;
        let mut map = self.map.lock();
        if !attach {
            let Some(g) = map.get(&group) else {
                return Err(Error::InvalidArgument(
                    "the queue pair is not attached to that group",
                ));
            };
            let mut m = g.members.lock();
            let Some(at) = m.iter().position(|q| q.qpn == qp.qpn) else {
                return Err(Error::InvalidArgument(
                    "the queue pair is not attached to that group",
                ));
            };
            m.swap_remove(at);
            if m.is_empty() {
                g.stop.store(true, Ordering::SeqCst);
                drop(m);
                map.remove(&group);
            }
            return Ok(());
        }
        if let Some(g) = map.get(&group) {
            let mut m = g.members.lock();
            // Attaching twice is harmless, as in verbs.
            if !m.iter().any(|q| q.qpn == qp.qpn) {
                m.push(qp.clone());
            }
            return Ok(());
        }
        let sock = join(group, local)?;
        let g = Arc::new(Group {
            members: Mutex::new(vec![qp.clone()]),
            stop: AtomicBool::new(false),
        });
        let reader = g.clone();
        let verify = qp.driver.verify_icrc;
        std::thread::Builder::new()
            .name("rdmx-udp-mcast".into())
            .spawn(move || read_group(&reader, &sock, group, max_datagram, verify))
            .map_err(|e| Error::Io("spawn the multicast reader", e))?;
        map.insert(group, g);
        Ok(())
    }

    /// Detaches QP `qpn` from every group (it is being destroyed).
    pub(crate) fn leave_all(&self, qpn: u32) {
        let mut map = self.map.lock();
        map.retain(|_, g| {
            let mut m = g.members.lock();
            m.retain(|q| q.qpn != qpn);
            let keep = !m.is_empty();
            if !keep {
                g.stop.store(true, Ordering::SeqCst);
            }
            keep
        });
    }
}

impl Drop for Groups {
    fn drop(&mut self) {
        for g in self.map.get_mut().values() {
            g.stop.store(true, Ordering::SeqCst);
        }
    }
}

/// A socket bound to `group`:4791 and joined to it on the interface of `local`.
fn join(group: Ipv4Addr, local: Ipv4Addr) -> Result<UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))
        .map_err(|e| Error::Io("socket", e))?;
    s.set_reuse_address(true)
        .map_err(|e| Error::Io("SO_REUSEADDR", e))?;
    s.bind(&SocketAddr::new(IpAddr::V4(group), ROCE_PORT).into())
        .map_err(|e| Error::Io("bind the multicast group's address", e))?;
    s.join_multicast_v4(&group, &local)
        .map_err(|e| Error::Io("IP_ADD_MEMBERSHIP", e))?;
    s.set_read_timeout(Some(READ_TIMEOUT))
        .map_err(|e| Error::Io("SO_RCVTIMEO", e))?;
    Ok(s.into())
}

/// Reads a group's socket until told to stop: each datagram that passes the checks goes
/// to every member.
fn read_group(g: &Group, sock: &UdpSocket, group: Ipv4Addr, max_datagram: usize, verify: bool) {
    let to = SocketAddr::new(IpAddr::V4(group), ROCE_PORT);
    let mut buf = vec![0u8; max_datagram + 1];
    while !g.stop.load(Ordering::SeqCst) {
        let (n, from) = match sock.recv_from(&mut buf) {
            Ok(r) => r,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) =>
            {
                continue
            }
            Err(e) => {
                tracing::warn!(%group, "the multicast reader stops: {e}");
                return;
            }
        };
        let Ok((packet, qpn)) = icrc::check(from, to, &buf[..n], max_datagram, verify, 0) else {
            tracing::trace!(%group, %from, "dropping a malformed group datagram");
            continue;
        };
        if qpn != MULTICAST_QPN {
            continue;
        }
        let members = g.members.lock().clone();
        let now = Instant::now();
        for qp in members {
            let mut inner = qp.inner.lock();
            receive(&mut inner, from, to, packet);
            qp.pump(&mut inner, now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gids_name_addresses_as_rdma_gid2ip_does() {
        let v4: Ipv6Addr = "::ffff:127.0.0.3".parse().unwrap();
        assert_eq!(addr_of(v4.octets()), "127.0.0.3:4791".parse().unwrap());
        let v6: Ipv6Addr = "fe80::1".parse().unwrap();
        assert_eq!(addr_of(v6.octets()), "[fe80::1]:4791".parse().unwrap());
        let g: Ipv6Addr = "::ffff:239.1.2.3".parse().unwrap();
        assert_eq!(group_of(g.octets()).unwrap(), Ipv4Addr::new(239, 1, 2, 3));
        assert!(group_of(v4.octets()).is_err(), "not a multicast address");
        let ff: Ipv6Addr = "ff0e::1:2:3".parse().unwrap();
        assert!(group_of(ff.octets()).is_err(), "an IPv6 group");
    }
}
