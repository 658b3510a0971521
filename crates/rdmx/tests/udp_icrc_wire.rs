//! The udp provider's ICRCs against the IP and UDP headers the kernel really sent.
//!
//! The ICRC covers most of the IP header (on IPv4 the identification and the flags
//! too), which a UDP socket neither shows nor lets the sender write: the provider computes
//! it from the headers it expects the kernel to emit. This test captures the provider's
//! datagrams on the loopback interface with a packet socket (CAP_NET_RAW), recomputes each
//! ICRC from the captured headers as a receiving adapter or Linux rxe does, and compares.
//! Without CAP_NET_RAW it says so and checks nothing.

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

fn packet_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_DGRAM | libc::SOCK_NONBLOCK,
            (libc::ETH_P_IP as u16).to_be() as libc::c_int,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor this test owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
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
        let p = &buf[..n as usize];
        let ihl = usize::from(p[0] & 0x0f) * 4;
        let from_us = p[9] == 17
            && p.len() > ihl + 8
            && (p[12..16] == [127, 4, 0, 1] || p[12..16] == [127, 4, 0, 2])
            && u16::from_be_bytes([p[ihl + 2], p[ihl + 3]]) == 4791;
        if !from_us {
            continue;
        }
        let (want, got) = icrc_of(p).expect("a whole RoCEv2 packet");
        assert_eq!(
            got,
            want,
            "the ICRC of a packet as sent (IP id {:#x}, flags {:#x})",
            u16::from_be_bytes([p[4], p[5]]),
            p[6] >> 5
        );
        checked += 1;
    }
    // Five WRITE packets and at least one ACK.
    assert!(checked >= 6, "captured only {checked} packets");
}
