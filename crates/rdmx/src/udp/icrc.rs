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
//!
//! A UDP GSO send is one such packet that the kernel splits into segments where it leaves
//! the host (or that stays joined over loopback); the segments get identifications 0, 1,
//! 2, ... in order, each with its own UDP length. The sender seals each datagram for
//! identification 0 and `Basis::shift` moves the ICRC of segment `k` to identification `k`
//! (the CRC is linear: a changed field changes the CRC by the CRC of the change, shifted
//! by the bytes after it). A receiver accepts identifications 0 to `MAX_SEGMENT_ID`
//! on IPv4, so that it checks segments of a GSO send whether they arrive apart or joined
//! (UDP GRO).

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
    icrc_with_id(src, dst, packet, 0)
}

/// [`icrc`] for a packet whose IPv4 header carries identification `id` (ignored on IPv6).
fn icrc_with_id(src: SocketAddr, dst: SocketAddr, packet: &[u8], id: u16) -> u32 {
    start(src, dst, packet.len(), packet, id).finalize()
}

/// The ICRC's state after the masked headers of a packet of `packet_len` bytes (BTH to
/// pad) from `src` to `dst` and the packet's first bytes, `first` (its BTH masked): the
/// rest of the packet is fed to it by the caller, wherever those bytes are.
pub(crate) fn start(
    src: SocketAddr,
    dst: SocketAddr,
    packet_len: usize,
    first: &[u8],
    id: u16,
) -> Hasher {
    // The masked LRH, IP and UDP headers and the BTH go in one update (short ones cost
    // nearly as much as long ones): 8 + 40 + 8 + 12 bytes at most.
    let mut head = [0xffu8; 8 + 40 + UDP_LEN + BTH_LEN];
    let mut at = 8;
    let udp_len = (UDP_LEN + packet_len + ICRC_LEN) as u16;
    match (src, dst) {
        (SocketAddr::V4(s), SocketAddr::V4(d)) => {
            let total = 20 + udp_len;
            let ip = &mut head[at..at + 20];
            ip.fill(0);
            ip[0] = 0x45;
            ip[1] = 0xff; // TOS
            ip[2..4].copy_from_slice(&total.to_be_bytes());
            ip[4..6].copy_from_slice(&id.to_be_bytes());
            // DF set.
            ip[6] = 0x40;
            ip[8] = 0xff; // TTL
            ip[9] = 17; // UDP
            ip[10] = 0xff; // checksum
            ip[11] = 0xff;
            ip[12..16].copy_from_slice(&s.ip().octets());
            ip[16..20].copy_from_slice(&d.ip().octets());
            at += 20;
        }
        _ => {
            let (s, d) = (v6(src), v6(dst));
            let ip = &mut head[at..at + 40];
            // Version 6; traffic class and flow label masked.
            ip[..4].copy_from_slice(&[0x6f, 0xff, 0xff, 0xff]);
            ip[4..6].copy_from_slice(&udp_len.to_be_bytes());
            ip[6] = 17;
            ip[7] = 0xff; // hop limit
            ip[8..24].copy_from_slice(&s);
            ip[24..40].copy_from_slice(&d);
            at += 40;
        }
    }
    // UDP: the checksum stays masked.
    head[at..at + 2].copy_from_slice(&src.port().to_be_bytes());
    head[at + 2..at + 4].copy_from_slice(&dst.port().to_be_bytes());
    head[at + 4..at + 6].copy_from_slice(&udp_len.to_be_bytes());
    at += UDP_LEN;
    let mut h = Hasher::new();
    if first.len() >= BTH_LEN {
        head[at..at + BTH_LEN].copy_from_slice(&first[..BTH_LEN]);
        head[at + 4] = 0xff;
        h.update(&head[..at + BTH_LEN]);
        h.update(&first[BTH_LEN..]);
    } else {
        h.update(&head[..at]);
        h.update(first);
    }
    h
}

fn v6(a: SocketAddr) -> [u8; 16] {
    match a {
        SocketAddr::V4(a) => a.ip().to_ipv6_mapped().octets(),
        SocketAddr::V6(a) => a.ip().octets(),
    }
}

/// The largest IPv4 identification a received ICRC is checked against (segments of one
/// GSO send are numbered from 0; a send carries at most 64).
pub(crate) const MAX_SEGMENT_ID: u16 = 63;

/// The reflected CRC-32 polynomial.
const POLY: u32 = 0xedb8_8320;

/// `a·b` modulo the CRC polynomial, both in the reflected form (bit 31 is `x^0`).
fn mulmod(a: u32, mut b: u32) -> u32 {
    let mut p = 0;
    let mut m = 1u32 << 31;
    while m != 0 {
        if a & m != 0 {
            p ^= b;
        }
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
        m >>= 1;
    }
    p
}

/// `x^(8n)` modulo the polynomial: what appending `n` zero bytes multiplies a CRC
/// register by.
fn zeros(mut n: usize) -> u32 {
    let mut p = 1u32 << 31;
    let mut sq = 1u32 << 23; // x^8
    while n != 0 {
        if n & 1 != 0 {
            p = mulmod(p, sq);
        }
        sq = mulmod(sq, sq);
        n >>= 1;
    }
    p
}

/// The register of a CRC with no initial value and no final inversion over `bytes`.
fn raw(bytes: &[u8]) -> u32 {
    let mut c = 0u32;
    for &b in bytes {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
        }
    }
    c
}

/// The change of the ICRC of an IPv4 packet of `packet_len` bytes (BTH to pad) when its IP
/// identification goes from 0 to 2^j, for j = 0..6.
fn id_basis(packet_len: usize) -> [u32; 6] {
    // The identification is bytes 12 and 13 of what the ICRC covers (after 8 bytes of
    // LRH and 4 of IP header); behind it come the rest of the IP header (14), the UDP
    // header (8) and the packet.
    let z = zeros(14 + UDP_LEN + packet_len);
    std::array::from_fn(|j| mulmod(raw(&(1u16 << j).to_be_bytes()), z))
}

/// The change of the ICRC of an IPv4 packet of `packet_len` bytes when its identification
/// goes from 0 to `id` (at most [`MAX_SEGMENT_ID`]).
fn id_delta(basis: &[u32; 6], id: u16) -> u32 {
    (0..6)
        .filter(|j| id & (1 << j) != 0)
        .fold(0, |d, j| d ^ basis[j])
}

/// [`id_basis`] of `packet_len`, from a per-thread cache of the last few lengths (a
/// message's first packet is longer than the ones after it, so lengths alternate).
fn cached_basis(packet_len: usize) -> [u32; 6] {
    const WAYS: usize = 4;
    /// Lengths with their factors, and the way the next miss replaces.
    type Ways = ([(usize, [u32; 6]); WAYS], usize);
    thread_local! {
        static CACHE: std::cell::Cell<Ways> =
            const { std::cell::Cell::new(([(usize::MAX, [0; 6]); WAYS], 0)) };
    }
    CACHE.with(|c| {
        let (mut ways, next) = c.get();
        if let Some((_, b)) = ways.iter().find(|(len, _)| *len == packet_len) {
            return *b;
        }
        let b = id_basis(packet_len);
        ways[next] = (packet_len, b);
        c.set((ways, (next + 1) % WAYS));
        b
    })
}

/// Moves the ICRC at the end of `datagram` (sealed for IPv4 identification 0) to
/// identification `id` (1 to [`MAX_SEGMENT_ID`]); applied twice, it restores it.
#[cfg(test)]
fn shift_id(datagram: &mut [u8], id: u16) {
    let Some(at) = datagram.len().checked_sub(ICRC_LEN) else {
        return;
    };
    let (_, t) = datagram.split_at_mut(at);
    Basis::new(at).shift(t.try_into().expect("four bytes"), id);
}

/// What moves the ICRC of an IPv4 packet of a given length from identification 0 to
/// another.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Basis([u32; 6]);

impl Basis {
    /// For packets of `packet_len` bytes (BTH to pad).
    pub(crate) fn new(packet_len: usize) -> Basis {
        Basis(cached_basis(packet_len))
    }

    /// Moves `icrc`, sealed for IPv4 identification 0, to identification `id` (1 to
    /// [`MAX_SEGMENT_ID`]); applied twice, it restores it.
    pub(crate) fn shift(&self, icrc: &mut [u8; ICRC_LEN], id: u16) {
        *icrc = (u32::from_le_bytes(*icrc) ^ id_delta(&self.0, id)).to_le_bytes();
    }
}

/// Whether `got` is the ICRC of an IPv4 packet of `packet_len` bytes whose ICRC for
/// identification 0 is `want`, with an identification from 1 to [`MAX_SEGMENT_ID`];
/// `likely` is tried first.
fn matches_other_id(got: u32, want: u32, packet_len: usize, likely: u16) -> bool {
    let d = got ^ want;
    let basis = cached_basis(packet_len);
    let ok = |id: u16| id_delta(&basis, id) == d;
    (1..=MAX_SEGMENT_ID).contains(&likely) && ok(likely) || (1..=MAX_SEGMENT_ID).any(ok)
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
/// and the destination QP number. Over IPv4, `likely_id` is the identification tried
/// first after 0 (segment `k` of a joined run most likely carries `k`).
pub(crate) fn check(
    src: SocketAddr,
    dst: SocketAddr,
    datagram: &[u8],
    max_len: usize,
    verify: bool,
    likely_id: u16,
) -> Result<(&[u8], u32), Reject> {
    if datagram.len() < BTH_LEN + ICRC_LEN || datagram.len() > max_len {
        return Err(Reject::Length);
    }
    let (packet, tail) = datagram.split_at(datagram.len() - ICRC_LEN);
    if verify {
        let got = u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]);
        let want = icrc(src, dst, packet);
        let v4 = matches!((src, dst), (SocketAddr::V4(_), SocketAddr::V4(_)));
        if got != want && !(v4 && matches_other_id(got, want, packet.len(), likely_id)) {
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
        let (packet, qpn) = check(src, dst, &p, 9000, true, 0).expect("intact");
        assert_eq!((packet.len(), qpn), (32, 0x12));
        for bit in 0..p.len() * 8 {
            let mut q = p.clone();
            q[bit / 8] ^= 1 << (bit % 8);
            // Byte 4 of the BTH is masked out of the ICRC, as in IBTA.
            if bit / 8 == 4 {
                assert!(check(src, dst, &q, 9000, true, 0).is_ok());
                continue;
            }
            assert!(check(src, dst, &q, 9000, true, 0).is_err(), "bit {bit}");
        }
        // The addresses and ports are covered.
        assert_eq!(
            check(a("127.0.0.3:4791"), dst, &p, 9000, true, 0),
            Err(Reject::Icrc)
        );
        assert_eq!(
            check(src, a("127.0.0.2:4792"), &p, 9000, true, 0),
            Err(Reject::Icrc)
        );
    }

    #[test]
    fn a_segment_icrc_moves_to_its_ip_identification() {
        let (src, dst) = (a("127.0.0.1:4791"), a("127.0.0.2:4791"));
        for len in [16usize, 1040, 4112] {
            let mut p: Vec<u8> = vec![0x07, 0, 0xff, 0xff, 0, 0, 0, 0x12, 0x80, 0, 0, 5];
            p.extend((0..len - 16).map(|i| (i * 13) as u8));
            seal(src, dst, &mut p);
            let sealed = p.clone();
            for id in 1..=MAX_SEGMENT_ID {
                shift_id(&mut p, id);
                let t = &p[p.len() - 4..];
                let got = u32::from_le_bytes([t[0], t[1], t[2], t[3]]);
                assert_eq!(
                    got,
                    icrc_with_id(src, dst, &p[..p.len() - 4], id),
                    "id {id}"
                );
                // What a receiver accepts: a segment of a GSO send.
                assert!(check(src, dst, &p, 9000, true, 0).is_ok(), "id {id}");
                // Named as the likely one, or another named instead.
                assert!(check(src, dst, &p, 9000, true, id).is_ok(), "id {id}");
                assert!(check(src, dst, &p, 9000, true, 64 - id).is_ok(), "id {id}");
                shift_id(&mut p, id);
                assert_eq!(p, sealed);
            }
            // An identification no GSO send gives is refused.
            let c = icrc_with_id(src, dst, &p[..p.len() - 4], 64);
            let at = p.len() - 4;
            p[at..].copy_from_slice(&c.to_le_bytes());
            assert_eq!(check(src, dst, &p, 9000, true, 0), Err(Reject::Icrc));
            assert_eq!(check(src, dst, &p, 9000, true, 64), Err(Reject::Icrc));
        }
    }

    #[test]
    fn variant_fields_are_masked_ipv6() {
        let (src, dst) = (a("[fe80::1]:4791"), a("[fe80::2]:4791"));
        let mut p = vec![
            0x04, 0, 0xff, 0xff, 0, 0, 0, 0x12, 0x80, 0, 0, 5, 1, 2, 3, 4,
        ];
        seal(src, dst, &mut p);
        assert!(check(src, dst, &p, 9000, true, 0).is_ok());
        assert_eq!(
            check(src, a("[fe80::3]:4791"), &p, 9000, true, 0),
            Err(Reject::Icrc)
        );
    }

    #[test]
    fn short_long_and_foreign_datagrams_are_refused() {
        let (src, dst) = (a("127.0.0.1:4791"), a("127.0.0.2:4791"));
        assert_eq!(
            check(src, dst, &[0; 15], 9000, false, 0),
            Err(Reject::Length)
        );
        assert_eq!(
            check(src, dst, &[0; 101], 100, false, 0),
            Err(Reject::Length)
        );
        // RD opcode 0x40, transport version 1, partition 0x1234.
        for bth in [
            [0x40, 0, 0xff, 0xff],
            [0x04, 1, 0xff, 0xff],
            [0x04, 0, 0x12, 0x34],
        ] {
            let mut p = bth.to_vec();
            p.extend_from_slice(&[0; 12]);
            assert_eq!(check(src, dst, &p, 9000, false, 0), Err(Reject::Header));
        }
    }
}
