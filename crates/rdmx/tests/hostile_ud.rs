//! Hostile datagrams against UD queue pairs on the udp and shm providers: a stranger
//! sends datagrams with a wrong Q_Key, for unknown QP numbers, truncated, too long, of
//! random bytes (and on shm, from a socket that is no context's or that lies about its
//! process), then floods. Each is dropped and counted (per QP in `QueuePair::dropped`, per
//! context in `udp::stats` / `shm::ud_stats`), takes no receive, writes no memory, memory
//! stays bounded, and the queue pair keeps receiving datagrams from its real senders.
//!
//! The checks are shared ([`dropped_and_counted`], [`flood`]); each provider's module
//! brings what is its own: how a stranger reaches the victim ([`Stranger`]), the bad
//! datagrams of its wire, and which of its counters they land in.

use std::net::{SocketAddr, UdpSocket};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixDatagram};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmx::{
    Access, AhAttr, CompletionQueue, Context, LocalSge, MemoryRegion, PeerAddr, ProtectionDomain,
    QpCaps, QpType, QueuePair, RecvRequest, SendRequest, WcStatus, GRH_LEN,
};

#[path = "common/memory.rs"]
mod memory;

const QKEY: u32 = 0x0bad_cafe;
/// The BTH opcode of a UD SEND without immediate data.
const UD_SEND_ONLY: u8 = 0x64;
const LEN: usize = 256;
const RECVS: usize = 8;
const DEADLINE: Duration = Duration::from_secs(30);

struct Ud {
    ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
}

fn ud(ctx: Context) -> Ud {
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(256).expect("cq");
    let qp = pd
        .create_qp_of_type(QpType::Ud, &cq, &cq, None, QpCaps::default())
        .expect("a UD QP");
    qp.activate(QKEY).expect("activate");
    Ud { ctx, pd, cq, qp }
}

/// The victim's receives: `RECVS` slots of the GRH area plus `LEN` bytes.
fn post_recvs(v: &Ud) -> MemoryRegion {
    let mr =
        v.pd.register(vec![0u8; RECVS * (GRH_LEN + LEN)], Access::LOCAL_WRITE)
            .expect("register");
    for i in 0..RECVS {
        let at = i * (GRH_LEN + LEN);
        v.qp.post_recv(
            RecvRequest::new(i as u64).sge(LocalSge::new(&mr, at, GRH_LEN + LEN).expect("sge")),
        )
        .expect("post_recv");
    }
    mr
}

fn image(mr: &MemoryRegion) -> Vec<u8> {
    let mut v = vec![0u8; mr.len()];
    mr.read_at(0, &mut v).expect("read");
    v
}

/// A UD SEND packet (BTH and DETH, no ICRC) for QP `dest` with Q_Key `qkey`.
fn ud_packet(dest: u32, qkey: u32, src: u32, payload: &[u8]) -> Vec<u8> {
    let mut p = vec![UD_SEND_ONLY, 0, 0xff, 0xff, 0];
    p.extend_from_slice(&dest.to_be_bytes()[1..]);
    p.extend_from_slice(&[0, 0, 0, 1]);
    p.extend_from_slice(&qkey.to_be_bytes());
    p.push(0);
    p.extend_from_slice(&src.to_be_bytes()[1..]);
    p.extend_from_slice(payload);
    p
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// Sends one real datagram from `tx` to `v` until `v` completes a receive with it (UD
/// may lose a datagram under a flood); returns the receive's slot.
fn real_datagram_arrives(tx: &Ud, v: &Ud, tag: u8) -> u64 {
    let src = tx
        .pd
        .register(vec![tag; LEN], Access::LOCAL_WRITE)
        .expect("register");
    let ah = tx
        .pd
        .create_ah(&AhAttr::to_endpoint(&v.qp.endpoint()))
        .expect("ah");
    let start = Instant::now();
    loop {
        tx.qp
            .post_send(
                SendRequest::send(u64::from(tag))
                    .sge(LocalSge::new(&src, 0, LEN).expect("sge"))
                    .ud(&ah, v.qp.qp_num(), QKEY),
            )
            .expect("post_send");
        let sent = Instant::now();
        while sent.elapsed() < Duration::from_millis(200) {
            let _ = tx.cq.poll_one();
            if let Some(c) = v.cq.poll_one().expect("poll") {
                assert_eq!(c.status, WcStatus::Success);
                assert_eq!(c.src_qp, tx.qp.qp_num());
                assert_eq!(c.byte_len as usize, GRH_LEN + LEN);
                return c.wr_id;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        assert!(start.elapsed() < DEADLINE, "no real datagram arrived");
    }
}

/// Polls `v` for a while: no completion may come.
fn quiet(v: &Ud, what: &str) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(100) {
        if let Some(c) = v.cq.poll_one().expect("poll") {
            panic!("{what}: a completion {c:?}");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Waits until `done` holds (polling `v` meanwhile) or the deadline.
fn until(v: &Ud, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() && start.elapsed() < DEADLINE {
        let _ = v.cq.poll_one();
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Runs `send`, which sends hostile datagrams to `v` and returns how many, and waits
/// until `v`'s context has received them all (`stats`: how many datagrams it received,
/// and its counters): none may take a receive. `check` then gets the counters before and
/// after, and how many of them the QP dropped. No hostile datagram may have written
/// memory, and the first receive then takes a real datagram from `tx`.
fn dropped_and_counted<S: std::fmt::Debug>(
    v: &Ud,
    tx: &Ud,
    stats: impl Fn(&Ud) -> (u64, S),
    send: impl FnOnce() -> u64,
    check: impl FnOnce(S, S, u64),
) {
    let mr = post_recvs(v);
    let before = image(&mr);
    let (r0, s0) = stats(v);
    let d0 =
        v.qp.dropped()
            .expect("a software provider counts its drops");
    let n = send();
    until(v, || stats(v).0 >= r0 + n);
    quiet(v, "hostile datagrams");
    let (r1, s1) = stats(v);
    assert_eq!(r1 - r0, n, "{s1:?}");
    let dropped =
        v.qp.dropped()
            .expect("a software provider counts its drops")
            - d0;
    check(s0, s1, dropped);
    assert_eq!(image(&mr), before, "no hostile datagram wrote memory");
    // The first receive is still there for a real datagram.
    assert_eq!(real_datagram_arrives(tx, v, 3), 0);
}

/// A socket that is no context's, sending to one victim on a provider's wire.
trait Stranger: Send + 'static {
    /// The datagram that carries `packet` (on udp: with its ICRC).
    fn datagram(&self, packet: Vec<u8>) -> Vec<u8>;
    /// Sends `d`; whether it went.
    fn send(&self, d: &[u8]) -> bool;
}

/// A stranger floods the victim `v` from `s` with random bytes and datagrams with wrong
/// Q_Keys or for unknown QPs until `v`'s context has received 20,000 of them (`stats`:
/// how many datagrams it received, and its counters for the report); meanwhile every
/// receive of `v` still takes a real datagram from `tx`, the wrong Q_Keys are counted
/// by the QP, and memory stays bounded.
fn flood<S: std::fmt::Debug>(v: &Ud, tx: &Ud, s: impl Stranger, stats: impl Fn(&Ud) -> (u64, S)) {
    let _mr = post_recvs(v);
    let qpn = v.qp.qp_num();
    let rss0 = memory::rss_kib();
    let (r0, _) = stats(v);
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let flooder = std::thread::spawn(move || {
        let mut rng = Rng(99);
        let mut sent = 0u64;
        while !flag.load(Ordering::Relaxed) && sent < 200_000 {
            let d = match sent % 3 {
                0 => {
                    let len = (rng.next() % 1500) as usize;
                    rng.bytes(len)
                }
                1 => s.datagram(ud_packet(qpn, rng.next() as u32, 7, &[0xee; 512])),
                _ => s.datagram(ud_packet(rng.next() as u32, QKEY, 7, &[0xee; 64])),
            };
            if s.send(&d) {
                sent += 1;
            }
        }
        sent
    });
    until(v, || stats(v).0 - r0 >= 20_000);
    for tag in 0..RECVS as u8 {
        real_datagram_arrives(tx, v, tag + 1);
    }
    stop.store(true, Ordering::Relaxed);
    let sent = flooder.join().expect("flooder");
    let (r1, s1) = stats(v);
    eprintln!(
        "flood: {sent} sent, {} received, {} dropped by the QP: {s1:?}",
        r1 - r0,
        v.qp.dropped()
            .expect("a software provider counts its drops")
    );
    assert!(
        v.qp.dropped()
            .expect("a software provider counts its drops")
            > 0,
        "the wrong Q_Keys were counted"
    );
    let grown = memory::rss_kib().saturating_sub(rss0);
    assert!(grown < 32 * 1024, "memory grew by {grown} KiB");
}

mod udp {
    use super::*;
    use rdmx::udp::{icrc::icrc, stats};

    fn open(addr: &str) -> (Ud, SocketAddr) {
        let addr: SocketAddr = addr.parse().expect("an address");
        let ctx = Context::open(rdmx::udp::Options::default().bind(addr)).expect("open udp");
        (ud(ctx), addr)
    }

    fn sealed(from: SocketAddr, to: SocketAddr, mut p: Vec<u8>) -> Vec<u8> {
        let c = icrc(from, to, &p);
        p.extend_from_slice(&c.to_le_bytes());
        p
    }

    #[test]
    fn bad_datagrams_are_dropped_and_counted() {
        let _running = memory::alone();
        let (v, at) = open("127.4.0.2:4791");
        let (tx, _) = open("127.4.0.1:4791");
        let s = UdpSocket::bind("127.4.0.9:0").expect("bind");
        let me = s.local_addr().expect("addr");
        let qpn = v.qp.qp_num();
        let send = || {
            let mut rng = Rng(7);
            // Reach the QP, then dropped by the engine: a wrong Q_Key, a truncated DETH.
            let wrong_qkey = sealed(me, at, ud_packet(qpn, QKEY ^ 1, 0x42, &[1; 64]));
            let truncated = sealed(me, at, ud_packet(qpn, QKEY, 0x42, &[])[..16].to_vec());
            // Dropped before: an unknown QP, a bad ICRC, random bytes, too long.
            let unknown = sealed(me, at, ud_packet(qpn ^ 0x1000, QKEY, 0x42, &[1; 64]));
            let mut bad_icrc = wrong_qkey.clone();
            bad_icrc[20] ^= 1;
            let long = sealed(me, at, ud_packet(qpn, QKEY, 0x42, &[1; 5000]));
            let mut n = 0u64;
            for d in [&wrong_qkey, &truncated, &unknown, &bad_icrc, &long] {
                s.send_to(d, at).expect("send");
                n += 1;
            }
            for _ in 0..50 {
                let len = (rng.next() % 200) as usize;
                s.send_to(&rng.bytes(len), at).expect("send");
                n += 1;
            }
            n
        };
        let stats = |v: &Ud| {
            let s = stats(&v.ctx).expect("udp");
            (s.received, s)
        };
        dropped_and_counted(&v, &tx, stats, send, |s0, s1, dropped| {
            assert_eq!(s1.delivered - s0.delivered, 2, "{s1:?}");
            assert_eq!(s1.unknown_qp - s0.unknown_qp, 1, "{s1:?}");
            assert!(s1.bad_icrc - s0.bad_icrc >= 1, "{s1:?}");
            assert!(s1.bad_length - s0.bad_length >= 1, "{s1:?}");
            assert_eq!(dropped, 2, "the wrong Q_Key and the truncated DETH");
        });
    }

    /// A UDP socket of no context's.
    struct Stranger {
        s: UdpSocket,
        me: SocketAddr,
        at: SocketAddr,
    }

    impl super::Stranger for Stranger {
        fn datagram(&self, packet: Vec<u8>) -> Vec<u8> {
            sealed(self.me, self.at, packet)
        }
        fn send(&self, d: &[u8]) -> bool {
            self.s.send_to(d, self.at).is_ok()
        }
    }

    #[test]
    fn a_flood_is_dropped_with_bounded_memory_while_datagrams_still_arrive() {
        let _running = memory::alone();
        let (v, at) = open("127.4.0.4:4791");
        let (tx, _) = open("127.4.0.3:4791");
        let s = UdpSocket::bind("127.4.0.9:0").expect("bind");
        let me = s.local_addr().expect("addr");
        flood(&v, &tx, Stranger { s, me, at }, |v| {
            let s = stats(&v.ctx).expect("udp");
            (s.received, s)
        });
    }
}

mod shm {
    use super::*;
    use rdmx::shm::{ud_socket_name, ud_stats};

    fn open() -> Ud {
        ud(Context::open(rdmx::shm::Options::default()).expect("open shm"))
    }

    /// The victim's datagram socket.
    fn target(v: &Ud) -> UnixAddr {
        let PeerAddr::Unix { pid, id } = v.qp.endpoint().addr else {
            panic!("an shm endpoint names its context");
        };
        UnixAddr::from_abstract_name(ud_socket_name(pid, id)).expect("name")
    }

    /// A socket named as context `id` of process `pid` would name its own.
    fn stranger(pid: u32, id: u32) -> UnixDatagram {
        let a = UnixAddr::from_abstract_name(ud_socket_name(pid, id)).expect("name");
        UnixDatagram::bind_addr(&a).expect("bind")
    }

    #[test]
    fn bad_datagrams_are_dropped_and_counted() {
        let _running = memory::alone();
        let v = open();
        let tx = open();
        let to = target(&v);
        let qpn = v.qp.qp_num();
        let me = std::process::id();
        let s = stranger(me, 0x7e57_0001);
        let send = || {
            let mut rng = Rng(5);
            let mut n = 0u64;
            let mut send = |sock: &UnixDatagram, d: &[u8]| {
                sock.send_to_addr(d, &to).expect("send");
                n += 1;
            };
            // Reach the QP, then dropped by the engine: a wrong Q_Key, a truncated DETH.
            send(&s, &ud_packet(qpn, QKEY ^ 1, 0x42, &[1; 64]));
            send(&s, &ud_packet(qpn, QKEY, 0x42, &[])[..16]);
            // Dropped before: an unknown QP, too short, too long.
            send(&s, &ud_packet(qpn ^ 0x1000, QKEY, 0x42, &[1; 64]));
            send(&s, &[0x64, 0, 0xff]);
            send(&s, &ud_packet(qpn, QKEY, 0x42, &vec![1; 70_000]));
            // From no context's socket (unnamed), and from one naming another process.
            send(
                &UnixDatagram::unbound().expect("socket"),
                &ud_packet(qpn, QKEY, 0x42, &[1; 8]),
            );
            send(
                &stranger(me ^ 1, 0x7e57_0002),
                &ud_packet(qpn, QKEY, 0x42, &[1; 8]),
            );
            for _ in 0..50 {
                let len = (rng.next() % 200) as usize;
                send(&s, &rng.bytes(len));
            }
            n
        };
        let stats = |v: &Ud| {
            let s = ud_stats(&v.ctx).expect("shm");
            (s.received, s)
        };
        dropped_and_counted(&v, &tx, stats, send, |s0, s1, dropped| {
            assert_eq!(s1.wrong_source - s0.wrong_source, 2, "{s1:?}");
            assert!(s1.bad_length - s0.bad_length >= 2, "{s1:?}");
            assert!(s1.unknown_qp - s0.unknown_qp >= 1, "{s1:?}");
            assert!(dropped >= 2, "the wrong Q_Key and the truncated DETH");
        });
    }

    /// A socket named as a context of this process that does not exist.
    struct Stranger {
        s: UnixDatagram,
        to: UnixAddr,
    }

    impl super::Stranger for Stranger {
        fn datagram(&self, packet: Vec<u8>) -> Vec<u8> {
            packet
        }
        fn send(&self, d: &[u8]) -> bool {
            let sent = self.s.send_to_addr(d, &self.to).is_ok();
            if !sent {
                std::thread::yield_now();
            }
            sent
        }
    }

    #[test]
    fn a_flood_is_dropped_with_bounded_memory_while_datagrams_still_arrive() {
        let _running = memory::alone();
        let v = open();
        let tx = open();
        let s = stranger(std::process::id(), 0x7e57_0003);
        s.set_nonblocking(true).expect("nonblocking");
        let to = target(&v);
        flood(&v, &tx, Stranger { s, to }, |v| {
            let s = ud_stats(&v.ctx).expect("shm");
            (s.received, s)
        });
    }

    /// Sends `packet` with `fd` attached (`SCM_RIGHTS`) on the connected socket `s`.
    fn send_with_fd(s: &UnixDatagram, fd: i32, packet: &[u8]) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let mut iov = libc::iovec {
            iov_base: packet.as_ptr() as *mut libc::c_void,
            iov_len: packet.len(),
        };
        let mut cbuf = [0u64; 4];
        // SAFETY: an all-zero msghdr is valid; the pointers set below outlive the call.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        // SAFETY: CMSG_SPACE only computes a length.
        msg.msg_controllen = unsafe { libc::CMSG_SPACE(4) } as _;
        // SAFETY: cbuf holds CMSG_SPACE(4) bytes, so the first header and its one
        // descriptor fit; sendmsg reads msg, iov and cbuf for the call.
        let n = unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(4) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<i32>(), fd);
            libc::sendmsg(s.as_raw_fd(), &msg, 0)
        };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Whether this kernel lets a socket refuse descriptors (`SO_PASSRIGHTS`, 83, Linux
    /// 6.16).
    fn kernel_refuses_descriptors() -> bool {
        use std::os::fd::AsRawFd;
        let probe = UnixDatagram::unbound().expect("socket");
        let off: libc::c_int = 0;
        // SAFETY: setsockopt reads the one int for the call.
        let r = unsafe {
            libc::setsockopt(
                probe.as_raw_fd(),
                libc::SOL_SOCKET,
                83,
                (&off as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        r == 0
    }

    /// A descriptor sent to a context's datagram socket is refused where the kernel can
    /// (the sender's `sendmsg` fails with `EPERM`) and is never kept: the pipe whose write
    /// end was sent reads end-of-file once the sender closes its own copy.
    #[test]
    fn descriptors_sent_to_the_datagram_socket_are_refused() {
        let _running = memory::alone();
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        let v = open();
        let s = stranger(std::process::id(), 0x7e57_00fd);
        s.connect_addr(&target(&v)).expect("connect");
        let mut ends = [0i32; 2];
        // SAFETY: pipe2 fills the two ints.
        let made = unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) };
        assert_eq!(made, 0, "pipe2");
        // SAFETY: both ends are new descriptors this test owns.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1])) };
        let packet = ud_packet(v.qp.qp_num(), QKEY, 0x42, &[1; 8]);
        let sent = send_with_fd(&s, w.as_raw_fd(), &packet);
        if kernel_refuses_descriptors() {
            let e = sent.expect_err("the socket refuses descriptors");
            assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
        } else {
            sent.expect("sent");
        }
        drop(w);
        let mut pfd = libc::pollfd {
            fd: r.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll reads and writes the one pollfd for the call.
        let n = unsafe { libc::poll(&mut pfd, 1, DEADLINE.as_millis() as libc::c_int) };
        assert_eq!(n, 1, "the pipe's write end is still open somewhere");
        let mut b = [0u8; 1];
        // SAFETY: read writes at most one byte into b.
        let got = unsafe { libc::read(r.as_raw_fd(), b.as_mut_ptr().cast(), 1) };
        assert_eq!(got, 0, "end-of-file: nobody holds the write end");
    }
}
