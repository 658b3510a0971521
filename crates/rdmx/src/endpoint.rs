//! What two sides exchange to connect: a queue pair's [`QpEndpoint`] and the
//! [`RemoteRegion`]s a peer may use, each with a stable compact byte form (and, with the
//! `serde` feature, serde support) so applications need not define their own.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use rdmx_core::Mtu;

use crate::{Error, Result};

/// Where a peer reaches a queue pair: the part of an endpoint that depends on the fabric.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub enum PeerAddr {
    /// A queue pair of this process, found by its number (loopback).
    Local,
    /// An IP address and port (tcp: the listener of the QP's context). An unspecified
    /// IP (a context listening on every interface) means the peer's own host; a
    /// connection manager replaces it with the address it reached the peer at.
    Ip(SocketAddr),
    /// An InfiniBand/RoCE port's GID (verbs); a RoCEv2 GID of an IPv4 address is
    /// IPv4-mapped.
    Gid(Ipv6Addr),
    /// A context on this host, reached through a local socket named after its process
    /// and a random number (shm).
    Unix {
        /// The process.
        pid: u32,
        /// The context's random number.
        id: u32,
    },
}

/// What a peer needs to connect to a queue pair (the fields `ibv_rc_pingpong` exchanges out
/// of band), plus a connection secret.
///
/// The secret is drawn at random for each connection: when the queue pair is created, and
/// again (with the first PSN) whenever it goes back to RESET. A transport that strangers
/// can reach (tcp, shm) accepts a peer only if it presents it, so nobody joins a connection
/// they were not given, including the peer of the queue pair's previous one. Keep
/// endpoints as private as the data the connection carries.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct QpEndpoint {
    /// QP number.
    pub qp_num: u32,
    /// First packet sequence number the QP sends with (random).
    pub psn: u32,
    /// The largest path MTU the QP's side offers, in bytes; connecting takes the smaller
    /// of both sides' unless told otherwise.
    pub mtu: u32,
    /// The connection secret.
    pub secret: u64,
    /// Where the QP is.
    pub addr: PeerAddr,
}

impl std::fmt::Debug for QpEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QpEndpoint")
            .field("qp_num", &self.qp_num)
            .field("psn", &self.psn)
            .field("mtu", &self.mtu)
            .field("secret", &"..")
            .field("addr", &self.addr)
            .finish()
    }
}

impl QpEndpoint {
    /// Bytes of the compact form.
    pub const LEN: usize = 40;
    const VERSION: u8 = 1;

    /// The compact form: version, QP number, PSN, MTU, secret, address kind, IP, port
    /// (network byte order).
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[0] = Self::VERSION;
        out[1..5].copy_from_slice(&self.qp_num.to_be_bytes());
        out[5..9].copy_from_slice(&self.psn.to_be_bytes());
        out[9..13].copy_from_slice(&self.mtu.to_be_bytes());
        out[13..21].copy_from_slice(&self.secret.to_be_bytes());
        let (kind, ip, port) = match self.addr {
            PeerAddr::Local => (0u8, Ipv6Addr::UNSPECIFIED, 0u16),
            PeerAddr::Ip(SocketAddr::V4(a)) => (4, a.ip().to_ipv6_mapped(), a.port()),
            PeerAddr::Ip(SocketAddr::V6(a)) => (6, *a.ip(), a.port()),
            PeerAddr::Gid(g) => (1, g, 0),
            PeerAddr::Unix { pid, id } => {
                let mut o = [0u8; 16];
                o[..4].copy_from_slice(&pid.to_be_bytes());
                o[4..8].copy_from_slice(&id.to_be_bytes());
                (2, Ipv6Addr::from(o), 0)
            }
        };
        out[21] = kind;
        out[22..38].copy_from_slice(&ip.octets());
        out[38..40].copy_from_slice(&port.to_be_bytes());
        out
    }

    /// Parses the compact form; anything malformed is an error, never a panic.
    pub fn from_bytes(raw: &[u8]) -> Result<QpEndpoint> {
        if raw.len() != Self::LEN || raw[0] != Self::VERSION {
            return Err(Error::Protocol("a malformed queue-pair endpoint"));
        }
        let u32_at = |i: usize| u32::from_be_bytes([raw[i], raw[i + 1], raw[i + 2], raw[i + 3]]);
        let mut secret = [0u8; 8];
        secret.copy_from_slice(&raw[13..21]);
        let mut ip = [0u8; 16];
        ip.copy_from_slice(&raw[22..38]);
        let ip = Ipv6Addr::from(ip);
        let port = u16::from_be_bytes([raw[38], raw[39]]);
        let addr = match raw[21] {
            0 => PeerAddr::Local,
            1 => PeerAddr::Gid(ip),
            2 => {
                let o = ip.octets();
                PeerAddr::Unix {
                    pid: u32::from_be_bytes([o[0], o[1], o[2], o[3]]),
                    id: u32::from_be_bytes([o[4], o[5], o[6], o[7]]),
                }
            }
            4 => PeerAddr::Ip(SocketAddr::new(IpAddr::V6(ip).to_canonical(), port)),
            6 => PeerAddr::Ip(SocketAddr::new(IpAddr::V6(ip), port)),
            _ => return Err(Error::Protocol("a queue-pair endpoint of an unknown kind")),
        };
        let (qp_num, psn, mtu) = (u32_at(1), u32_at(5), u32_at(9));
        if qp_num > 0xff_ffff || psn > 0xff_ffff || Mtu::from_bytes(mtu).is_none() {
            return Err(Error::Protocol(
                "a queue-pair endpoint with fields out of range",
            ));
        }
        Ok(QpEndpoint {
            qp_num,
            psn,
            mtu,
            secret: u64::from_be_bytes(secret),
            addr,
        })
    }
}

/// What a peer needs to reach a region remotely: address, length and rkey.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct RemoteRegion {
    /// Virtual address of the first byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

impl RemoteRegion {
    /// Bytes of the compact form.
    pub const LEN: usize = 20;

    /// The compact form: address, length, rkey (network byte order).
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[..8].copy_from_slice(&self.addr.to_be_bytes());
        out[8..16].copy_from_slice(&self.len.to_be_bytes());
        out[16..].copy_from_slice(&self.rkey.to_be_bytes());
        out
    }

    /// Parses the compact form.
    pub fn from_bytes(raw: &[u8]) -> Result<RemoteRegion> {
        if raw.len() != Self::LEN {
            return Err(Error::Protocol("a malformed remote region"));
        }
        let mut a = [0u8; 8];
        let mut l = [0u8; 8];
        a.copy_from_slice(&raw[..8]);
        l.copy_from_slice(&raw[8..16]);
        Ok(RemoteRegion {
            addr: u64::from_be_bytes(a),
            len: u64::from_be_bytes(l),
            rkey: u32::from_be_bytes([raw[16], raw[17], raw[18], raw[19]]),
        })
    }

    /// The remote address of the byte at `offset`, with this region's rkey.
    pub fn at(&self, offset: u64) -> rdmx_core::RemoteAddr {
        rdmx_core::RemoteAddr {
            addr: self.addr.wrapping_add(offset),
            rkey: self.rkey,
        }
    }
}

/// Connection parameters for [`QueuePair::connect`](crate::QueuePair::connect).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectOptions {
    /// What the peer may do to this side's memory through this QP.
    pub access: rdmx_mem::Access,
    /// Path MTU; `None` takes the smaller of this device's active MTU
    /// ([`Capabilities::active_mtu`]) and the MTU the peer's endpoint offers.
    ///
    /// Both sides must end up with the same path MTU, as on InfiniBand: a responder
    /// refuses a SEND or WRITE packet longer than its path MTU (or a FIRST or MIDDLE one
    /// not exactly of it) with a NAK, and both queue pairs go to the error state. An
    /// endpoint offers its device's active MTU, not a value set here, so set the same
    /// one on both sides, or on neither.
    ///
    /// [`Capabilities::active_mtu`]: crate::Capabilities::active_mtu
    pub mtu: Option<rdmx_core::Mtu>,
    /// Outstanding READs/atomics this side may issue.
    pub max_rd_atomic: u8,
    /// Outstanding READs/atomics this side accepts.
    pub max_dest_rd_atomic: u8,
    /// Ack timeout code (4.096 µs × 2^timeout; 0 = none).
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries (7 = forever).
    pub rnr_retry: u8,
    /// RNR timer code this side asks peers to wait.
    pub min_rnr_timer: u8,
    /// tcp: how long establishing the stream to the peer may take.
    pub connect_timeout: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            access: rdmx_mem::Access::LOCAL_WRITE
                | rdmx_mem::Access::REMOTE_READ
                | rdmx_mem::Access::REMOTE_WRITE
                | rdmx_mem::Access::REMOTE_ATOMIC,
            mtu: None,
            max_rd_atomic: 16,
            max_dest_rd_atomic: 16,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
            connect_timeout: Duration::from_secs(10),
        }
    }
}

impl ConnectOptions {
    /// Sets what the peer may do to this side's memory.
    pub fn access(mut self, access: rdmx_mem::Access) -> Self {
        self.access = access;
        self
    }
    /// Sets the path MTU (`None`: the smaller of both sides'); both sides must agree
    /// (see [`ConnectOptions::mtu`](Self#structfield.mtu)).
    pub fn mtu(mut self, mtu: Option<rdmx_core::Mtu>) -> Self {
        self.mtu = mtu;
        self
    }
    /// Sets the outstanding READs/atomics this side issues and accepts.
    pub fn rd_atomic(mut self, issue: u8, accept: u8) -> Self {
        self.max_rd_atomic = issue;
        self.max_dest_rd_atomic = accept;
        self
    }
    /// Sets the ack timeout code (4.096 µs × 2^timeout; 0 = none).
    pub fn timeout(mut self, timeout: u8) -> Self {
        self.timeout = timeout;
        self
    }
    /// Sets the transport retries.
    pub fn retry_cnt(mut self, n: u8) -> Self {
        self.retry_cnt = n;
        self
    }
    /// Sets the RNR retries (7 = forever).
    pub fn rnr_retry(mut self, n: u8) -> Self {
        self.rnr_retry = n;
        self
    }
    /// Sets the RNR timer code this side asks peers to wait.
    pub fn min_rnr_timer(mut self, code: u8) -> Self {
        self.min_rnr_timer = code;
        self
    }
    /// Sets how long establishing the stream to the peer may take (tcp).
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_round_trip_and_garbage_is_refused() {
        for addr in [
            PeerAddr::Local,
            PeerAddr::Ip("10.1.2.3:4791".parse().unwrap()),
            PeerAddr::Ip("[fe80::1]:18515".parse().unwrap()),
            PeerAddr::Gid("::ffff:10.0.0.1".parse().unwrap()),
        ] {
            let ep = QpEndpoint {
                qp_num: 0x12_3456,
                psn: 0xab_cdef,
                mtu: 4096,
                secret: 0x0123_4567_89ab_cdef,
                addr,
            };
            assert_eq!(QpEndpoint::from_bytes(&ep.to_bytes()).unwrap(), ep);
        }
        assert!(QpEndpoint::from_bytes(&[0u8; 40]).is_err());
        assert!(QpEndpoint::from_bytes(&[1u8; 12]).is_err());
        let mut bad = [0u8; 40];
        bad[0] = 1;
        bad[21] = 9;
        assert!(QpEndpoint::from_bytes(&bad).is_err());
        let r = RemoteRegion {
            addr: 0x7fff_0000_1000,
            len: 1 << 20,
            rkey: 0xdead_beef,
        };
        assert_eq!(RemoteRegion::from_bytes(&r.to_bytes()).unwrap(), r);
    }
}
