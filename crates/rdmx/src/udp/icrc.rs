//! The RoCEv2 invariant CRC, as Linux rxe computes it, and the checks a datagram passes
//! before its packet reaches a queue pair.
//!
//! The ICRC is the reflected CRC-32 of zlib over: eight bytes of ones (the masked LRH),
//! the IP header and the UDP header with their variant fields set to ones (IPv4: TOS, TTL,
//! header checksum; IPv6: traffic class, flow label, hop limit; UDP: checksum), the BTH with
//! its byte 4 set to ones, then the rest of the packet (headers, payload, pad). It goes on
//! the wire least-significant byte first.
//!
//! User space does not see the IP header of a datagram it receives, so the header is
//! rebuilt from what the socket knows: the addresses, the ports and the lengths. On IPv4
//! the identification field is covered too: the kernel writes 0 there for a packet with DF
//! set sent from an unconnected socket (how this provider sends), which is what is assumed
//! when checking; a peer that picks other identifications (Linux rxe hashes them) sends
//! ICRCs an IPv4 receiver cannot check (see `Options::verify_icrc`). IPv6 has no such
//! field: both directions can be checked.

use std::net::SocketAddr;

use crc32fast::Hasher;

/// The UDP destination port of RoCEv2.
pub const ROCE_PORT: u16 = 4791;

/// Bytes of the BTH.
pub(crate) const BTH_LEN: usize = 12;
/// Bytes of the ICRC.
pub const ICRC_LEN: usize = 4;
/// Bytes of the UDP header.
const UDP_LEN: usize = 8;

/// The ICRC of `packet` (BTH to pad, without the ICRC), sent from `src` to `dst` in a
/// datagram of its own.
pub fn icrc(src: SocketAddr, dst: SocketAddr, packet: &[u8]) -> u32 {
    let mut h = Hasher::new();
    h.update(&[0xff; 8]);
    let udp_len = (UDP_LEN + packet.len() + ICRC_LEN) as u16;
    match (src, dst) {
        (SocketAddr::V4(s), SocketAddr::V4(d)) => {
            let total = 20 + udp_len;
            let mut ip = [0u8; 20];
            ip[0] = 0x45;
            ip[1] = 0xff; // TOS
            ip[2..4].copy_from_slice(&total.to_be_bytes());
            // Identification 0, DF set.
            ip[6] = 0x40;
            ip[8] = 0xff; // TTL
            ip[9] = 17; // UDP
            ip[10] = 0xff; // checksum
            ip[11] = 0xff;
            ip[12..16].copy_from_slice(&s.ip().octets());
            ip[16..20].copy_from_slice(&d.ip().octets());
            h.update(&ip);
        }
        _ => {
            let (s, d) = (v6(src), v6(dst));
            let mut ip = [0u8; 40];
            // Version 6; traffic class and flow label masked.
            ip[..4].copy_from_slice(&[0x6f, 0xff, 0xff, 0xff]);
            ip[4..6].copy_from_slice(&udp_len.to_be_bytes());
            ip[6] = 17;
            ip[7] = 0xff; // hop limit
            ip[8..24].copy_from_slice(&s);
            ip[24..40].copy_from_slice(&d);
            h.update(&ip);
        }
    }
    let mut udp = [0xffu8; UDP_LEN];
    udp[..2].copy_from_slice(&src.port().to_be_bytes());
    udp[2..4].copy_from_slice(&dst.port().to_be_bytes());
    udp[4..6].copy_from_slice(&udp_len.to_be_bytes());
    h.update(&udp);
    if packet.len() >= BTH_LEN {
        let mut bth = [0u8; BTH_LEN];
        bth.copy_from_slice(&packet[..BTH_LEN]);
        bth[4] = 0xff;
        h.update(&bth);
        h.update(&packet[BTH_LEN..]);
    } else {
        h.update(packet);
    }
    h.finalize()
}

fn v6(a: SocketAddr) -> [u8; 16] {
    match a {
        SocketAddr::V4(a) => a.ip().to_ipv6_mapped().octets(),
        SocketAddr::V6(a) => a.ip().octets(),
    }
}

/// Appends the ICRC of `packet` to it.
pub(crate) fn seal(src: SocketAddr, dst: SocketAddr, packet: &mut Vec<u8>) {
    let c = icrc(src, dst, packet);
    packet.extend_from_slice(&c.to_le_bytes());
}

/// Why a datagram was dropped before it reached a queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reject {
    /// Shorter than a BTH and an ICRC, or longer than the largest packet.
    Length,
    /// The ICRC does not match.
    Icrc,
    /// Not an RC, UC or UD packet of transport version 0 in the default partition.
    Header,
}

/// Checks a datagram from `src` to `dst`: its length, its ICRC (with `verify`), and the
/// BTH fields every packet for this provider has. Returns the packet without its ICRC
/// and the destination QP number.
pub(crate) fn check(
    src: SocketAddr,
    dst: SocketAddr,
    datagram: &[u8],
    max_len: usize,
    verify: bool,
) -> Result<(&[u8], u32), Reject> {
    if datagram.len() < BTH_LEN + ICRC_LEN || datagram.len() > max_len {
        return Err(Reject::Length);
    }
    let (packet, tail) = datagram.split_at(datagram.len() - ICRC_LEN);
    if verify {
        let got = u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]);
        if got != icrc(src, dst, packet) {
            return Err(Reject::Icrc);
        }
    }
    let opcode = packet[0];
    let tver = packet[1] & 0x0f;
    let pkey = u16::from_be_bytes([packet[2], packet[3]]);
    // RC (0x00..=0x1f), UC (0x20..=0x3f) and UD SEND (0x64, 0x65) opcodes the engine
    // knows; the partition is the default one (full or limited).
    let ud = opcode == rdmx_wire::UD_SEND_ONLY || opcode == rdmx_wire::UD_SEND_ONLY_WITH_IMMEDIATE;
    let known = (opcode <= 0x3f || ud) && rdmx_wire::header_len_of(opcode).is_some();
    if !known || tver != 0 || pkey & 0x7fff != 0x7fff {
        return Err(Reject::Header);
    }
    let qpn = u32::from_be_bytes([0, packet[5], packet[6], packet[7]]);
    Ok((packet, qpn))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> SocketAddr {
        s.parse().expect("an address")
    }

    #[test]
    fn a_sealed_packet_passes_and_every_bit_flip_fails() {
        let (src, dst) = (a("127.0.0.1:4791"), a("127.0.0.2:4791"));
        let mut p = vec![0x04, 0, 0xff, 0xff, 0, 0, 0, 0x12, 0x80, 0, 0, 5];
        p.extend_from_slice(&[7u8; 20]);
        seal(src, dst, &mut p);
        let (packet, qpn) = check(src, dst, &p, 9000, true).expect("intact");
        assert_eq!((packet.len(), qpn), (32, 0x12));
        for bit in 0..p.len() * 8 {
            let mut q = p.clone();
            q[bit / 8] ^= 1 << (bit % 8);
            // Byte 4 of the BTH is masked out of the ICRC, as in IBTA.
            if bit / 8 == 4 {
                assert!(check(src, dst, &q, 9000, true).is_ok());
                continue;
            }
            assert!(check(src, dst, &q, 9000, true).is_err(), "bit {bit}");
        }
        // The addresses and ports are covered.
        assert_eq!(
            check(a("127.0.0.3:4791"), dst, &p, 9000, true),
            Err(Reject::Icrc)
        );
        assert_eq!(
            check(src, a("127.0.0.2:4792"), &p, 9000, true),
            Err(Reject::Icrc)
        );
    }

    #[test]
    fn variant_fields_are_masked_ipv6() {
        let (src, dst) = (a("[fe80::1]:4791"), a("[fe80::2]:4791"));
        let mut p = vec![
            0x04, 0, 0xff, 0xff, 0, 0, 0, 0x12, 0x80, 0, 0, 5, 1, 2, 3, 4,
        ];
        seal(src, dst, &mut p);
        assert!(check(src, dst, &p, 9000, true).is_ok());
        assert_eq!(
            check(src, a("[fe80::3]:4791"), &p, 9000, true),
            Err(Reject::Icrc)
        );
    }

    #[test]
    fn short_long_and_foreign_datagrams_are_refused() {
        let (src, dst) = (a("127.0.0.1:4791"), a("127.0.0.2:4791"));
        assert_eq!(check(src, dst, &[0; 15], 9000, false), Err(Reject::Length));
        assert_eq!(check(src, dst, &[0; 101], 100, false), Err(Reject::Length));
        // RD opcode 0x40, transport version 1, partition 0x1234.
        for bth in [
            [0x40, 0, 0xff, 0xff],
            [0x04, 1, 0xff, 0xff],
            [0x04, 0, 0x12, 0x34],
        ] {
            let mut p = bth.to_vec();
            p.extend_from_slice(&[0; 12]);
            assert_eq!(check(src, dst, &p, 9000, false), Err(Reject::Header));
        }
    }
}
