//! Address handles: where a UD send goes (`ibv_ah`).

use std::net::{IpAddr, Ipv6Addr};
use std::sync::Arc;

use rdmx_core::AddressVector;

use crate::endpoint::{PeerAddr, QpEndpoint};
use crate::pd::ProtectionDomain;
use crate::provider;
use crate::Result;

/// The GID of the software providers' own host: `::ffff:127.0.0.1`, the RoCEv2 GID of the
/// IPv4 loopback address. Loopback datagrams carry it as their source in the GRH.
pub const LOCAL_GID: Ipv6Addr = Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, 0x7f00, 0x0001);

/// The first 64 bits of the GID that names an shm context ([`PeerAddr::Unix`]) in an
/// address handle and in the GRH of the datagrams it sends and receives: `fd72:646d:7873:686d`
/// (a unique-local prefix, `fd` then "rdmxshm" in ASCII), followed by the context's
/// random number and its process id, 32 bits each. (The process id comes last: in a GRH
/// area the source GID's last four bytes are where RoCEv2 over IPv4 has the IP header's
/// first, and a process id's top byte, 0, never reads as IP version 4 there.)
pub const SHM_GID_PREFIX: [u16; 4] = [0xfd72, 0x646d, 0x7873, 0x686d];

/// The GID naming shm context `id` of process `pid` (see [`SHM_GID_PREFIX`]).
pub fn shm_gid(pid: u32, id: u32) -> Ipv6Addr {
    let p = SHM_GID_PREFIX;
    Ipv6Addr::new(
        p[0],
        p[1],
        p[2],
        p[3],
        (id >> 16) as u16,
        id as u16,
        (pid >> 16) as u16,
        pid as u16,
    )
}

/// The process and context an shm GID names ([`shm_gid`]); `None` for another GID.
pub fn shm_of_gid(gid: Ipv6Addr) -> Option<(u32, u32)> {
    let s = gid.segments();
    (s[..4] == SHM_GID_PREFIX).then(|| {
        (
            (u32::from(s[6]) << 16) | u32::from(s[7]),
            (u32::from(s[4]) << 16) | u32::from(s[5]),
        )
    })
}

/// What an address handle names (`ibv_ah_attr`): the peer's GID (or a multicast group's)
/// and, on InfiniBand, its LID.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct AhAttr {
    /// Destination GID (`grh.dgid`); a multicast GID (`ff00::/8`) names a group.
    pub dgid: Ipv6Addr,
    /// Destination LID (InfiniBand only; 0 elsewhere).
    pub dlid: u16,
    /// Service level.
    pub sl: u8,
    /// GRH hop limit.
    pub hop_limit: u8,
}

impl AhAttr {
    /// An address handle attribute for the GID `dgid`.
    pub fn gid(dgid: Ipv6Addr) -> AhAttr {
        AhAttr {
            dgid,
            dlid: 0,
            sl: 0,
            hop_limit: 64,
        }
    }

    /// The multicast group `gid`; send to it with remote QPN
    /// [`MULTICAST_QPN`](crate::MULTICAST_QPN).
    pub fn multicast(gid: Ipv6Addr) -> AhAttr {
        AhAttr::gid(gid)
    }

    /// The address of the queue pair whose endpoint is `peer` (its QPN is
    /// `peer.qp_num`): the GID of its port (verbs), its IP as a RoCEv2 GID (an IPv4 one
    /// mapped), its context's [`shm_gid`] for an shm queue pair, or [`LOCAL_GID`] for a
    /// queue pair of this process (loopback).
    pub fn to_endpoint(peer: &QpEndpoint) -> AhAttr {
        let gid = match peer.addr {
            PeerAddr::Gid(g) => g,
            PeerAddr::Unix { pid, id } => shm_gid(pid, id),
            PeerAddr::Ip(sa) => match sa.ip() {
                IpAddr::V4(v4) => v4.to_ipv6_mapped(),
                IpAddr::V6(v6) => v6,
            },
            _ => LOCAL_GID,
        };
        AhAttr::gid(gid)
    }

    /// The address vector the engine uses.
    pub fn av(&self) -> AddressVector {
        AddressVector {
            dgid: self.dgid.octets(),
            dlid: self.dlid,
            sl: self.sl,
            hop_limit: self.hop_limit,
        }
    }
}

/// An address handle (`ibv_ah`): the destination of UD sends, created in a protection
/// domain with [`ProtectionDomain::create_ah`] and named by each UD send request
/// ([`SendRequest::ud`](crate::SendRequest::ud)). Cloning is cheap and yields the same
/// handle; it is destroyed when the last clone goes.
#[derive(Clone, Debug)]
pub struct AddressHandle {
    imp: Arc<dyn provider::Ah>,
    attr: AhAttr,
    pd: ProtectionDomain,
}

impl AddressHandle {
    /// What it was created with.
    pub fn attr(&self) -> &AhAttr {
        &self.attr
    }

    /// The protection domain it belongs to.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    pub(crate) fn imp(&self) -> &dyn provider::Ah {
        self.imp.as_ref()
    }
}

impl PartialEq for AddressHandle {
    /// The same handle (clones of one creation).
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.imp, &other.imp)
    }
}

impl Eq for AddressHandle {}

impl ProtectionDomain {
    /// Creates an address handle (`ibv_create_ah`). Refused with
    /// [`Error::Unsupported`](crate::Error::Unsupported) by a provider without UD queue
    /// pairs ([`Capabilities::ud`](crate::Capabilities::ud)).
    pub fn create_ah(&self, attr: &AhAttr) -> Result<AddressHandle> {
        let imp = self.context().device().create_ah(self.id(), &attr.av())?;
        Ok(AddressHandle {
            imp,
            attr: *attr,
            pd: self.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shm_gids_round_trip_and_others_are_not_shm() {
        let g = shm_gid(0x0012_3456, 0xdead_beef);
        assert_eq!(g.to_string(), "fd72:646d:7873:686d:dead:beef:12:3456");
        assert_eq!(shm_of_gid(g), Some((0x0012_3456, 0xdead_beef)));
        assert_eq!(shm_of_gid(LOCAL_GID), None);
        // In a GRH area the GID's byte 12 sits where an IPv4 header's version would: a
        // process id (at most 2^22) keeps it 0.
        assert_eq!(shm_gid(1 << 22, u32::MAX).octets()[12], 0);
        assert_eq!(shm_of_gid("fd72:646d:7873:686e::1".parse().unwrap()), None);
    }
}
