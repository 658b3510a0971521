//! The udp provider's ICRCs against the IP and UDP headers the kernel really sent.
//!
//! The ICRC covers most of the IP header (on IPv4 the identification and the flags
//! too), which a UDP socket neither shows nor lets the sender write: the provider computes
//! it from the headers it expects the kernel to emit. This test captures the provider's
//! datagrams on the loopback interface with a packet socket (CAP_NET_RAW), recomputes each
//! ICRC from the captured headers as a receiving adapter or Linux rxe does, and compares.
//! Over loopback a UDP GSO send stays one packet: the capture says its segment size (a
//! virtio-net header), and the test splits it as the kernel does where it leaves a host
//! (segment `k` gets IPv4 identification `id + k` and its own lengths), checking each
//! segment's ICRC. Without CAP_NET_RAW it says so and checks nothing.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use rdmx::{Access, ConnectOptions, Context, LocalSge, Mtu, QpCaps, RemoteAddr, SendRequest};

/// CRC-32 as zlib computes it (reflected, complemented).
fn crc32(parts: &[&[u8]]) -> u32 {
    let mut c = !0u32;
    for p in parts {
        for &b in *p {
            c ^= u32::from(b);
            for _ in 0..8 {
                c = (c >> 1) ^ (0xEDB8_8320 & (c & 1).wrapping_neg());
            }
        }
    }
    !c
}

/// The ICRC of a captured IPv4 packet, its variant fields masked as IBTA says.
fn icrc_of(ip_packet: &[u8]) -> Option<(u32, u32)> {
    let ihl = usize::from(ip_packet[0] & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([ip_packet[2], ip_packet[3]]));
    let pkt = &ip_packet[..total.min(ip_packet.len())];
    if pkt.len() < ihl + 8 + 12 + 4 {
        return None;
    }
    let mut ip = pkt[..ihl].to_vec();
    ip[1] = 0xff; // TOS
    ip[8] = 0xff; // TTL
    ip[10] = 0xff; // checksum
    ip[11] = 0xff;
    let mut udp = pkt[ihl..ihl + 8].to_vec();
    udp[6] = 0xff;
    udp[7] = 0xff;
    let mut bth = pkt[ihl + 8..ihl + 20].to_vec();
    bth[4] = 0xff;
    let rest = &pkt[ihl + 20..pkt.len() - 4];
    let t = &pkt[pkt.len() - 4..];
    let got = u32::from_le_bytes([t[0], t[1], t[2], t[3]]);
    Some((crc32(&[&[0xff; 8], &ip, &udp, &bth, rest]), got))
}

/// A packet socket on every interface, each frame read with a virtio-net header before it.
fn packet_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_NONBLOCK,
            (libc::ETH_P_IP as u16).to_be() as libc::c_int,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor this test owns.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let on: libc::c_int = 1;
    // SAFETY: `on` lives across the call and its size is passed.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_PACKET,
            libc::PACKET_VNET_HDR,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(sock)
}

/// Bytes of a virtio-net header; of an Ethernet header (loopback's frames have one).
const VNET_HDR: usize = 10;
const ETH_HDR: usize = 14;
/// The virtio-net GSO type of a UDP GSO packet.
const GSO_UDP_L4: u8 = 5;

/// The IPv4 packets a captured one leaves a host as: itself, or for a UDP GSO packet of
/// segment size `gso_size`, its segments as the kernel makes them.
fn segments(p: &[u8], gso_size: Option<usize>) -> Vec<Vec<u8>> {
    let ihl = usize::from(p[0] & 0x0f) * 4;
    let Some(seg) = gso_size.filter(|&s| p.len() > ihl + 8 + s) else {
        return vec![p.to_vec()];
    };
    let id = u16::from_be_bytes([p[4], p[5]]);
    p[ihl + 8..]
        .chunks(seg)
        .enumerate()
        .map(|(k, payload)| {
            let mut q = p[..ihl + 8].to_vec();
            q.extend_from_slice(payload);
            let total = (ihl + 8 + payload.len()) as u16;
            q[2..4].copy_from_slice(&total.to_be_bytes());
            q[4..6].copy_from_slice(&id.wrapping_add(k as u16).to_be_bytes());
            q[ihl + 4..ihl + 6].copy_from_slice(&(8 + payload.len() as u16).to_be_bytes());
            q
        })
        .collect()
}

#[test]
fn icrcs_match_the_headers_the_kernel_sent() {
    let sock = match packet_socket() {
        Ok(s) => s,
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
            eprintln!("SKIPPED: capturing packets needs CAP_NET_RAW ({e})");
            return;
        }
        Err(e) => panic!("packet socket: {e}"),
    };
    let open = |a: &str| {
        Context::open(rdmx::udp::Options::default().bind(a.parse().expect("addr")))
            .expect("open udp")
    };
    let (ca, cb) = (open("127.4.0.1:4791"), open("127.4.0.2:4791"));
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let (qa_cq, qb_cq) = (ca.create_cq(64).expect("cq"), cb.create_cq(64).expect("cq"));
    let qa = pa.create_qp(&qa_cq, &qa_cq, QpCaps::default()).expect("qp");
    let qb = pb.create_qp(&qb_cq, &qb_cq, QpCaps::default()).expect("qp");
    let mut o = ConnectOptions::default();
    o.mtu = Some(Mtu::Mtu1024);
    qa.connect(qb.endpoint(), &o).expect("connect");
    qb.connect(qa.endpoint(), &o).expect("connect");
    let ma = pa.register(vec![7u8; 5000], Access::ALL).expect("register");
    let mb = pb.register(vec![0u8; 5000], Access::ALL).expect("register");
    qa.post_send(
        SendRequest::write(
            1,
            RemoteAddr {
                addr: mb.addr() as u64,
                rkey: mb.rkey(),
            },
        )
        .sge(LocalSge::new(&ma, 0, 5000).expect("sge")),
    )
    .expect("post");
    let start = Instant::now();
    let mut checked = 0;
    // Packets sent as UDP GSO runs (the provider's default for multi-packet messages).
    let mut joined = 0;
    let mut buf = vec![0u8; 65536];
    while start.elapsed() < Duration::from_secs(10) && checked < 6 {
        let _ = qa_cq.poll_one();
        let _ = qb_cq.poll_one();
        // SAFETY: reads into `buf`, which is valid for its length.
        let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n <= 0 {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        let frame = &buf[..n as usize];
        if frame.len() < VNET_HDR + ETH_HDR + 20 {
            continue;
        }
        let gso = (frame[1] & 0x7f == GSO_UDP_L4)
            .then(|| usize::from(u16::from_le_bytes([frame[4], frame[5]])));
        let p = &frame[VNET_HDR + ETH_HDR..];
        let ihl = usize::from(p[0] & 0x0f) * 4;
        let from_us = p[9] == 17
            && p.len() > ihl + 8
            && (p[12..16] == [127, 4, 0, 1] || p[12..16] == [127, 4, 0, 2])
            && u16::from_be_bytes([p[ihl + 2], p[ihl + 3]]) == 4791;
        if !from_us {
            continue;
        }
        joined += usize::from(gso.is_some());
        for p in segments(p, gso) {
            let (want, got) = icrc_of(&p).expect("a whole RoCEv2 packet");
            assert_eq!(
                got,
                want,
                "the ICRC of a packet as sent (IP id {:#x}, flags {:#x})",
                u16::from_be_bytes([p[4], p[5]]),
                p[6] >> 5
            );
            checked += 1;
        }
    }
    // Five WRITE packets and at least one ACK.
    assert!(checked >= 6, "captured only {checked} packets");
    assert!(joined >= 1, "no UDP GSO run was captured");
}
