//! The socket calls of the udp provider: options, and datagrams in batches with
//! `sendmmsg` and `recvmmsg`.

use std::io;
use std::net::{SocketAddr, SocketAddrV4, SocketAddrV6, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};

use rdmx_core::rc::Transmit;

use super::icrc;
use crate::provider::MrRef;

/// Datagrams moved by one `sendmmsg` or `recvmmsg`.
pub(crate) const BATCH: usize = 32;

/// Socket buffer size asked for, in each direction.
const SOCK_BUF: libc::c_int = 8 << 20;

fn setsockopt(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    val: libc::c_int,
) -> io::Result<()> {
    // SAFETY: `val` lives across the call and its size is passed.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&val as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Binds a socket on `addr` set up for RoCEv2: DF on every packet (so that IPv4 carries
/// identification 0, which the ICRC covers), and large buffers.
pub(crate) fn bind(addr: SocketAddr) -> io::Result<UdpSocket> {
    let sock = UdpSocket::bind(addr)?;
    let fd = sock.as_raw_fd();
    match addr {
        SocketAddr::V4(_) => setsockopt(
            fd,
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            libc::IP_PMTUDISC_DO,
        )?,
        SocketAddr::V6(_) => setsockopt(
            fd,
            libc::IPPROTO_IPV6,
            libc::IPV6_MTU_DISCOVER,
            libc::IP_PMTUDISC_DO,
        )?,
    }
    // Privileged processes may pass the system's limit; others get up to it.
    for (force, plain) in [
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
    ] {
        if setsockopt(fd, libc::SOL_SOCKET, force, SOCK_BUF).is_err() {
            setsockopt(fd, libc::SOL_SOCKET, plain, SOCK_BUF)?;
        }
    }
    Ok(sock)
}

/// A socket address in its C form.
pub(crate) struct CAddr {
    storage: libc::sockaddr_storage,
    len: libc::socklen_t,
}

impl CAddr {
    pub(crate) fn new(a: SocketAddr) -> CAddr {
        // SAFETY: all-zero is a valid sockaddr_storage.
        let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let len = match a {
            SocketAddr::V4(a) => {
                let sin = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: a.port().to_be(),
                    sin_addr: libc::in_addr {
                        s_addr: u32::from_ne_bytes(a.ip().octets()),
                    },
                    sin_zero: [0; 8],
                };
                // SAFETY: sockaddr_storage is larger than sockaddr_in and suitably aligned.
                unsafe {
                    std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin)
                };
                std::mem::size_of::<libc::sockaddr_in>()
            }
            SocketAddr::V6(a) => {
                let sin6 = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: a.port().to_be(),
                    sin6_flowinfo: a.flowinfo(),
                    sin6_addr: libc::in6_addr {
                        s6_addr: a.ip().octets(),
                    },
                    sin6_scope_id: a.scope_id(),
                };
                // SAFETY: sockaddr_storage is larger than sockaddr_in6 and suitably aligned.
                unsafe {
                    std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6)
                };
                std::mem::size_of::<libc::sockaddr_in6>()
            }
        };
        CAddr {
            storage,
            len: len as libc::socklen_t,
        }
    }
}

/// The Rust form of a C socket address, if it is IPv4 or IPv6.
fn from_c(s: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match libc::c_int::from(s.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let sin: &libc::sockaddr_in = unsafe { &*(s as *const libc::sockaddr_storage).cast() };
            Some(SocketAddr::V4(SocketAddrV4::new(
                u32::from_be(sin.sin_addr.s_addr).into(),
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let sin6: &libc::sockaddr_in6 =
                unsafe { &*(s as *const libc::sockaddr_storage).cast() };
            let a = SocketAddrV6::new(
                sin6.sin6_addr.s6_addr.into(),
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            );
            // A v4-mapped source on a dual-stack socket is an IPv4 peer.
            Some(match a.ip().to_ipv4_mapped() {
                Some(v4) => SocketAddr::V4(SocketAddrV4::new(v4, a.port())),
                None => SocketAddr::V6(a),
            })
        }
        _ => None,
    }
}

/// Largest UDP payload one GSO send carries.
const GSO_MAX_BYTES: usize = 65000;
/// Most segments one GSO send carries (the kernel's limit on older kernels).
const GSO_MAX_SEGS: usize = 64;

/// Room for a `UDP_SEGMENT` control message.
type SegCmsg = [u64; 4];

/// A datagram to send, as the iovecs that gather it.
pub(crate) trait Wire {
    /// Its length in bytes.
    fn wire_len(&self) -> usize;
    /// How many iovecs it takes (at most [`MAX_PARTS`]).
    fn parts(&self) -> usize;
    /// Appends its iovecs to `iov`, which has room for [`parts`](Self::parts) more.
    fn push_iov(&self, iov: &mut IoVecs);
    /// Its ICRC, the last bytes of a datagram of at least [`icrc::ICRC_LEN`] bytes.
    fn icrc_mut(&mut self) -> &mut [u8; icrc::ICRC_LEN];
}

/// The iovecs of one `sendmmsg` call, filled from the front (left uninitialized until
/// then: most calls name a few).
pub(crate) struct IoVecs {
    v: [std::mem::MaybeUninit<libc::iovec>; MAX_IOV],
    n: usize,
}

impl IoVecs {
    fn push(&mut self, p: *const u8, len: usize) {
        self.v[self.n].write(libc::iovec {
            iov_base: p.cast_mut().cast(),
            iov_len: len,
        });
        self.n += 1;
    }
}

/// A datagram in one buffer, its ICRC at the end.
impl Wire for Vec<u8> {
    fn wire_len(&self) -> usize {
        self.len()
    }
    fn parts(&self) -> usize {
        1
    }
    fn push_iov(&self, iov: &mut IoVecs) {
        iov.push(self.as_ptr(), self.len());
    }
    fn icrc_mut(&mut self) -> &mut [u8; icrc::ICRC_LEN] {
        let at = self.len() - icrc::ICRC_LEN;
        (&mut self[at..]).try_into().expect("four bytes")
    }
}

/// Most spans of registered memory a [`Packet`] gathers from before it is copied into
/// one buffer instead.
const MAX_SPANS: usize = 8;
/// Most iovecs a datagram takes: its headers, its spans, and its pad with its ICRC.
const MAX_PARTS: usize = MAX_SPANS + 2;

/// A packet of a queue pair's engine to send: its headers in a buffer, its payload still
/// in registered memory (gathered by the kernel straight from there), then its pad and
/// ICRC, computed over the payload where it lies.
#[derive(Debug, Default)]
pub(crate) struct Packet {
    t: Transmit<MrRef>,
    /// The pad's zeros (0 to 3), then the ICRC.
    tail: [u8; 3 + icrc::ICRC_LEN],
}

impl Packet {
    fn tail_len(&self) -> usize {
        usize::from(self.t.pad) + icrc::ICRC_LEN
    }

    fn icrc_mut(&mut self) -> &mut [u8; icrc::ICRC_LEN] {
        let pad = usize::from(self.t.pad);
        (&mut self.tail[pad..pad + icrc::ICRC_LEN])
            .try_into()
            .expect("four bytes")
    }

    /// Takes the packet `from` holds (leaving it this packet's emptied buffers) and seals
    /// it for `src` to `dst`. A packet gathered from more than [`MAX_SPANS`] spans is
    /// copied into its header buffer first.
    pub(crate) fn seal(&mut self, from: &mut Transmit<MrRef>, src: SocketAddr, dst: SocketAddr) {
        self.t.gather.clear();
        std::mem::swap(&mut self.t, from);
        if self.t.gather.len() > MAX_SPANS {
            for s in std::mem::take(&mut self.t.gather) {
                let at = self.t.header.len();
                self.t.header.resize(at + s.len as usize, 0);
                let r = s.mr.shared().read_at(
                    (s.addr as usize).wrapping_sub(s.mr.addr()),
                    &mut self.t.header[at..],
                );
                debug_assert!(r.is_ok(), "the engine gathers inside resolved regions");
            }
        }
        let mut h = icrc::start(src, dst, self.t.len(), &self.t.header, 0);
        for s in &self.t.gather {
            let p =
                s.mr.raw_range(s.addr, s.len as usize)
                    .expect("the engine gathers inside resolved regions");
            // SAFETY: `raw_range` checked that the `s.len` bytes at `p` lie inside the
            // region, and `s.mr` (held by this packet, as the engine held it while the
            // request was outstanding) keeps that memory mapped while the slice lives: this
            // statement only. It is the one shared reference over registered memory (other
            // accesses are raw copies, `provider::mem`), so that the CRC reads the payload
            // in place: the CRC only reads, each byte once, and every byte value is valid.
            // A write racing with it (the application changing a buffer a request it
            // posted still sends, or a peer's WRITE to the same bytes) can only change
            // the CRC: the receiver drops the packet as corrupted, and it is sent again.
            h.update(unsafe { std::slice::from_raw_parts(p, s.len as usize) });
        }
        let pad = usize::from(self.t.pad);
        self.tail = [0; 3 + icrc::ICRC_LEN];
        h.update(&self.tail[..pad]);
        *self.icrc_mut() = h.finalize().to_le_bytes();
    }

    /// Lets go of the registered memory it gathers from, keeping its buffers for reuse.
    pub(crate) fn release(&mut self) {
        self.t.gather.clear();
    }

    /// The packet as one buffer, its ICRC at the end.
    #[cfg(feature = "testing")]
    pub(crate) fn to_vec(&self) -> Vec<u8> {
        let mut v = self.t.header.clone();
        for s in &self.t.gather {
            let at = v.len();
            v.resize(at + s.len as usize, 0);
            let r =
                s.mr.shared()
                    .read_at((s.addr as usize).wrapping_sub(s.mr.addr()), &mut v[at..]);
            debug_assert!(r.is_ok(), "the engine gathers inside resolved regions");
        }
        v.extend_from_slice(&self.tail[..self.tail_len()]);
        v
    }
}

impl Wire for Packet {
    fn wire_len(&self) -> usize {
        self.t.len() + icrc::ICRC_LEN
    }
    fn parts(&self) -> usize {
        self.t.gather.len() + 2
    }
    fn push_iov(&self, iov: &mut IoVecs) {
        iov.push(self.t.header.as_ptr(), self.t.header.len());
        for s in &self.t.gather {
            let p =
                s.mr.raw_range(s.addr, s.len as usize)
                    .expect("the engine gathers inside resolved regions");
            iov.push(p, s.len as usize);
        }
        iov.push(self.tail.as_ptr(), self.tail_len());
    }
    fn icrc_mut(&mut self) -> &mut [u8; icrc::ICRC_LEN] {
        Packet::icrc_mut(self)
    }
}

/// Sends `datagrams` to `to`, `batch` (at most [`BATCH`]) messages per call. With `gso`,
/// each run of equal-sized datagrams (and a shorter one ending it) goes as one message the
/// kernel splits (`UDP_SEGMENT`). Each datagram comes sealed for IPv4 identification 0;
/// over IPv4 the ICRC of segment `k` of a run is moved to identification `k`, the one the
/// kernel gives it, for the call and restored after. Returns how many datagrams the kernel
/// refused (counted as lost: the engine retransmits).
pub(crate) fn send_all<D: Wire>(
    fd: RawFd,
    to: &CAddr,
    datagrams: &mut [D],
    batch: usize,
    gso: bool,
) -> usize {
    let batch = batch.clamp(1, BATCH);
    let v4 = libc::c_int::from(to.storage.ss_family) == libc::AF_INET;
    let mut failed = 0;
    let mut at = 0;
    let mut iov = IoVecs {
        v: [const { std::mem::MaybeUninit::uninit() }; MAX_IOV],
        n: 0,
    };
    while at < datagrams.len() {
        // Up to `batch` messages, each a run of datagrams: (first, count, segment size).
        let mut runs = [(0usize, 0usize, 0u16); BATCH];
        let mut nruns = 0;
        let mut i = at;
        let mut niov = 0;
        while nruns < batch && i < datagrams.len() && niov + MAX_PARTS <= MAX_IOV {
            let seg = datagrams[i].wire_len();
            let mut n = 1;
            let mut bytes = seg;
            niov += datagrams[i].parts();
            if gso {
                while i + n < datagrams.len()
                    && n < GSO_MAX_SEGS
                    && niov + MAX_PARTS <= MAX_IOV
                    && bytes + datagrams[i + n].wire_len() <= GSO_MAX_BYTES
                    && datagrams[i + n].wire_len() <= seg
                {
                    let len = datagrams[i + n].wire_len();
                    bytes += len;
                    niov += datagrams[i + n].parts();
                    n += 1;
                    if len < seg {
                        break;
                    }
                }
            }
            runs[nruns] = (i, n, seg as u16);
            nruns += 1;
            i += n;
        }
        let shift = |datagrams: &mut [D]| {
            for &(first, n, _) in &runs[..nruns] {
                if v4 && n > 1 {
                    // The segments of a run share a length but for the last.
                    let mut basis = None;
                    for (k, d) in datagrams[first + 1..first + n].iter_mut().enumerate() {
                        let Some(len) = d.wire_len().checked_sub(icrc::ICRC_LEN) else {
                            continue;
                        };
                        let b = match basis {
                            Some((l, b)) if l == len => b,
                            _ => {
                                let b = icrc::Basis::new(len);
                                basis = Some((len, b));
                                b
                            }
                        };
                        b.shift(d.icrc_mut(), k as u16 + 1);
                    }
                }
            }
        };
        shift(datagrams);
        let mut cmsgs: [SegCmsg; BATCH] = [[0; 4]; BATCH];
        let mut msgs = [const { std::mem::MaybeUninit::<libc::mmsghdr>::uninit() }; BATCH];
        iov.n = 0;
        for (k, &(first, n, seg)) in runs[..nruns].iter().enumerate() {
            let start = iov.n;
            for d in &datagrams[first..first + n] {
                d.push_iov(&mut iov);
            }
            // SAFETY: all-zero is a valid mmsghdr.
            let h = &mut msgs[k].write(unsafe { std::mem::zeroed() }).msg_hdr;
            h.msg_name = (&to.storage as *const libc::sockaddr_storage)
                .cast_mut()
                .cast();
            h.msg_namelen = to.len;
            h.msg_iov = iov.v[start].as_mut_ptr();
            h.msg_iovlen = iov.n - start;
            if n > 1 {
                let space = seg_cmsg(&mut cmsgs[k], seg);
                h.msg_control = cmsgs[k].as_mut_ptr().cast();
                h.msg_controllen = space;
            }
        }
        // SAFETY: the first `nruns` headers were written above; each names memory valid
        // for the call: the datagrams' buffers, registered memory their spans keep mapped
        // (bounds checked by `raw_range`), `to`, and the iovecs and control messages on
        // this stack frame. sendmmsg only reads it.
        let r = unsafe { libc::sendmmsg(fd, msgs.as_mut_ptr().cast(), nruns as libc::c_uint, 0) };
        shift(datagrams);
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            // The first message was refused (no route, no buffer): its datagrams are lost.
            if e.raw_os_error() == Some(libc::EMSGSIZE) {
                // Not a loss the retries can get past: the path's MTU is below the
                // interface's (a router on the way said so).
                tracing::warn!(
                    "sendmmsg: a datagram is larger than the path's MTU ({e}): connect with \
                     a smaller path MTU (ConnectOptions::mtu)"
                );
            } else {
                tracing::debug!("sendmmsg: {e}");
            }
            failed += runs[0].1;
            at += runs[0].1;
        } else {
            at += runs[..r as usize].iter().map(|r| r.1).sum::<usize>();
        }
    }
    failed
}

/// Most iovecs one `sendmmsg` call names (a message may name up to 1024, `UIO_MAXIOV`).
const MAX_IOV: usize = 1024;

/// Writes a `UDP_SEGMENT` control message for segments of `seg` bytes into `buf`;
/// returns its length.
fn seg_cmsg(buf: &mut SegCmsg, seg: u16) -> usize {
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<u16>() as u32) } as usize;
    debug_assert!(space <= std::mem::size_of::<SegCmsg>());
    // SAFETY: a msghdr naming `buf` (large enough, 8-aligned) as its control buffer, so
    // CMSG_FIRSTHDR and CMSG_DATA point inside it.
    unsafe {
        let mut h: libc::msghdr = std::mem::zeroed();
        h.msg_control = buf.as_mut_ptr().cast();
        h.msg_controllen = space;
        let c = libc::CMSG_FIRSTHDR(&h);
        (*c).cmsg_level = libc::SOL_UDP;
        (*c).cmsg_type = libc::UDP_SEGMENT;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<u16>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), seg);
    }
    space
}

/// Asks the kernel to hand over runs of datagrams from one sender as one buffer
/// (`UDP_GRO`), each read then saying its segment size.
pub(crate) fn enable_gro(fd: RawFd) -> io::Result<()> {
    setsockopt(fd, libc::SOL_UDP, libc::UDP_GRO, 1)
}

/// The alignment of the receive slots.
const PAGE: usize = 4096;

/// Room for one `recvmmsg` batch.
pub(crate) struct RxBatch {
    bufs: Vec<u8>,
    /// Where the first slot starts in `bufs`: on a page boundary.
    base: usize,
    slot: usize,
    /// A control buffer per slot (the `UDP_GRO` segment size).
    control: Vec<SegCmsg>,
    addrs: Vec<libc::sockaddr_storage>,
    iov: Vec<libc::iovec>,
    msgs: Vec<libc::mmsghdr>,
}

// SAFETY: the raw pointers in `iov` and `msgs` point into the batch's own buffers and are
// rebuilt before every use; nothing else shares them.
unsafe impl Send for RxBatch {}

impl RxBatch {
    pub(crate) fn new(slot: usize) -> RxBatch {
        let mut b = RxBatch {
            bufs: vec![0; slot * BATCH + PAGE],
            base: 0,
            slot,
            control: vec![[0; 4]; BATCH],
            // SAFETY: all-zero is a valid sockaddr_storage and mmsghdr.
            addrs: vec![unsafe { std::mem::zeroed() }; BATCH],
            iov: vec![
                libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                };
                BATCH
            ],
            // SAFETY: as above.
            msgs: vec![unsafe { std::mem::zeroed() }; BATCH],
        };
        b.base = b.bufs.as_ptr().align_offset(PAGE);
        b
    }

    /// Receives what is waiting, without blocking, up to `batch` (at most [`BATCH`])
    /// datagrams: the number now in the batch (0 when none waited).
    pub(crate) fn recv(&mut self, fd: RawFd, batch: usize) -> usize {
        for i in 0..BATCH {
            self.iov[i] = libc::iovec {
                iov_base: self.bufs[self.base + i * self.slot..].as_mut_ptr().cast(),
                iov_len: self.slot,
            };
            let m = &mut self.msgs[i];
            m.msg_hdr.msg_name = (&mut self.addrs[i] as *mut libc::sockaddr_storage).cast();
            m.msg_hdr.msg_namelen =
                std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            m.msg_hdr.msg_iov = &mut self.iov[i];
            m.msg_hdr.msg_iovlen = 1;
            m.msg_hdr.msg_control = self.control[i].as_mut_ptr().cast();
            m.msg_hdr.msg_controllen = std::mem::size_of::<SegCmsg>();
            m.msg_hdr.msg_flags = 0;
            m.msg_len = 0;
        }
        loop {
            // SAFETY: every header names memory of this batch, valid and not otherwise
            // borrowed for the call.
            let r = unsafe {
                libc::recvmmsg(
                    fd,
                    self.msgs.as_mut_ptr(),
                    batch.clamp(1, BATCH) as libc::c_uint,
                    libc::MSG_DONTWAIT,
                    std::ptr::null_mut(),
                )
            };
            if r >= 0 {
                return r as usize;
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => return 0,
                _ => {
                    // ICMP errors queued on the socket and the like: nothing to read.
                    tracing::debug!("recvmmsg: {e}");
                    return 0;
                }
            }
        }
    }

    /// Message `i` of the last [`recv`](Self::recv): its source, its bytes, whether it
    /// was cut (longer than a slot), and, for a run of datagrams the kernel joined
    /// (`UDP_GRO`), the size of each but the last.
    pub(crate) fn get(&self, i: usize) -> (Option<SocketAddr>, &[u8], bool, Option<usize>) {
        let m = &self.msgs[i];
        let len = (m.msg_len as usize).min(self.slot);
        let cut = m.msg_hdr.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0;
        let mut seg = None;
        // SAFETY: the kernel filled the control buffer this header names and set its
        // length; the CMSG macros stay inside it.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&m.msg_hdr);
            while !c.is_null() {
                // The kernel writes the segment size as an `int` (`udp_cmsg_recv`).
                let int = std::mem::size_of::<libc::c_int>() as u32;
                if (*c).cmsg_level == libc::SOL_UDP
                    && (*c).cmsg_type == libc::UDP_GRO
                    && (*c).cmsg_len as usize >= libc::CMSG_LEN(int) as usize
                {
                    let s = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>());
                    seg = usize::try_from(s).ok().filter(|&s| s > 0);
                }
                c = libc::CMSG_NXTHDR(&m.msg_hdr, c);
            }
        }
        (
            from_c(&self.addrs[i]),
            &self.bufs[self.base + i * self.slot..self.base + i * self.slot + len],
            cut,
            seg,
        )
    }
}

/// Waits until `fd` is readable, `wake` is readable, or `timeout_ms` passes (-1: no
/// limit).
pub(crate) fn wait(fd: RawFd, wake: RawFd, timeout_ms: libc::c_int) {
    let mut fds = [
        libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: wake,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    // SAFETY: `fds` is valid for the call.
    unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
    if fds[1].revents & libc::POLLIN != 0 {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into `v`.
        unsafe { libc::read(wake, (&mut v as *mut u64).cast(), 8) };
    }
}

/// The MTU of the network interface that has address `ip` (its name looked up with
/// `getifaddrs`, its MTU read from sysfs), if one has it.
pub(crate) fn interface_mtu(ip: std::net::IpAddr) -> Option<u32> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list it allocated into `head`, freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return None;
    }
    let mut name = None;
    let mut at = head;
    while !at.is_null() && name.is_none() {
        // SAFETY: `at` is a node of the list getifaddrs made, not yet freed.
        let ifa = unsafe { &*at };
        at = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: a non-null `ifa_addr` points to a socket address of the family it
        // names, whose size that family gives.
        let found = unsafe {
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let a = &*ifa.ifa_addr.cast::<libc::sockaddr_in>();
                    std::net::IpAddr::from(u32::from_be(a.sin_addr.s_addr).to_be_bytes())
                }
                libc::AF_INET6 => {
                    let a = &*ifa.ifa_addr.cast::<libc::sockaddr_in6>();
                    std::net::IpAddr::from(a.sin6_addr.s6_addr)
                }
                _ => continue,
            }
        };
        if found == ip {
            // SAFETY: `ifa_name` is a NUL-terminated string of the list.
            let n = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
            name = Some(n.to_string_lossy().into_owned());
        }
    }
    // SAFETY: `head` came from getifaddrs and is freed once, nothing of it kept.
    unsafe { libc::freeifaddrs(head) };
    let name = name?;
    std::fs::read_to_string(format!("/sys/class/net/{name}/mtu"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// A new eventfd (non-blocking, close-on-exec).
pub(crate) fn eventfd() -> io::Result<std::os::fd::OwnedFd> {
    // SAFETY: plain syscall.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor this process owns.
    Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) })
}

/// Wakes a thread in [`wait`].
pub(crate) fn wake(fd: RawFd) {
    let v = 1u64;
    // SAFETY: writes 8 bytes from `v`.
    unsafe { libc::write(fd, (&v as *const u64).cast(), 8) };
}
