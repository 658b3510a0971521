//! The system calls the shm provider makes: memfd segments, eventfds, a small epoll
//! wrapper, and Unix sockets that pass descriptors (`SCM_RIGHTS`) and tell who is on the
//! other end (`SO_PEERCRED`), and the single kernel copy out of a peer's memory
//! (`process_vm_readv`), and the barriers the mapped path's claims rely on
//! (`membarrier`). Every `unsafe` block of the provider outside the ring and the copy
//! routine is here.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// Turns a `-1` return into the `errno` error.
fn check(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Seals a segment carries: its size can never change, so a peer cannot shrink it under
/// this process's mapping (accesses past the end would raise SIGBUS).
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// A new anonymous shared-memory file of `len` bytes, sealed at that size. It has no name
/// in any file system (nothing to unlink), and only the processes it is passed to can map
/// it.
pub(crate) fn memfd(len: usize) -> io::Result<OwnedFd> {
    memfd_sealed(len, SEALS)
}

/// [`memfd`] with the seals `seals`.
pub(crate) fn memfd_sealed(len: usize, seals: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: memfd_create takes a NUL-terminated name and flags and returns a new fd.
    let fd = check(unsafe {
        libc::memfd_create(
            c"rdmx-shm".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    })?;
    // SAFETY: `fd` is a new descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate and fcntl on our own descriptor.
    unsafe {
        check(libc::ftruncate(fd.as_raw_fd(), len as libc::off_t))?;
        check(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals))?;
    }
    Ok(fd)
}

/// Seals `fd` against new writable mappings (`F_SEAL_FUTURE_WRITE`): the mappings made
/// before keep writing, peers it is passed to can only read.
pub(crate) fn seal_future_write(fd: &OwnedFd) -> io::Result<()> {
    let seals = libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on our own descriptor.
    check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) })?;
    Ok(())
}

/// Whether the file behind `fd` is sealed against changes of size.
pub(crate) fn sealed(fd: &OwnedFd) -> bool {
    // SAFETY: fcntl F_GET_SEALS on a descriptor we own.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    seals >= 0
        && seals & (libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) != 0
        && seals & libc::F_SEAL_SHRINK != 0
}

/// Whether the file behind `fd` lives on hugetlbfs: the size seals do not keep its pages
/// (a hole punched in it gives its huge pages back, and a later fault in a mapping of it
/// raises SIGBUS when the pool is empty).
pub(crate) fn on_hugetlbfs(fd: &OwnedFd) -> bool {
    const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;
    // SAFETY: an all-zero statfs is a valid value to be overwritten.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs writes into `st`, which lives for the call.
    let ok = unsafe { libc::fstatfs(fd.as_raw_fd(), &mut st) } == 0;
    // (Refused as well when it cannot be told.)
    !ok || st.f_type as i64 == HUGETLBFS_MAGIC
}

/// The size of the file behind `fd`.
pub(crate) fn file_size(fd: &OwnedFd) -> io::Result<u64> {
    // SAFETY: an all-zero stat is a valid value to be overwritten.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes into `st`, which lives for the call.
    check(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
    Ok(st.st_size as u64)
}

/// A new non-blocking eventfd.
pub(crate) fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd takes an initial value and flags and returns a new descriptor.
    let fd = check(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })?;
    // SAFETY: `fd` is a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Adds one to an eventfd (wakes whoever waits on it).
pub(crate) fn signal(fd: RawFd) {
    let one = 1u64;
    // SAFETY: writes 8 bytes from `one`; a full or bad descriptor only makes it fail.
    let _ = unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

/// Resets an eventfd.
pub(crate) fn drain(fd: RawFd) {
    let mut v = 0u64;
    // SAFETY: reads 8 bytes into `v` from a non-blocking eventfd.
    let _ = unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
}

/// An epoll instance.
#[derive(Debug)]
pub(crate) struct Epoll {
    fd: OwnedFd,
}

impl Epoll {
    pub(crate) fn new() -> io::Result<Epoll> {
        // SAFETY: epoll_create1 returns a new descriptor.
        let fd = check(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        Ok(Epoll {
            // SAFETY: `fd` is a new descriptor that nothing else owns.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// Watches `fd` for input (and hang-up, always reported), reporting `token`.
    pub(crate) fn add(&self, fd: RawFd, token: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLRDHUP) as u32,
            u64: token,
        };
        // SAFETY: epoll_ctl reads `ev` for the call.
        check(unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) })?;
        Ok(())
    }

    /// Stops watching `fd`.
    pub(crate) fn remove(&self, fd: RawFd) {
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: as in `add`; failure (not watched) is harmless.
        let _ = unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), libc::EPOLL_CTL_DEL, fd, &mut ev) };
    }

    /// Waits up to `timeout` (`None`: forever) and appends the tokens of ready descriptors
    /// to `out`.
    pub(crate) fn wait(&self, timeout: Option<Duration>, out: &mut Vec<u64>) {
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 64];
        let ms = timeout.map_or(-1, |t| {
            // Round up, so a wait for a timer never returns just before it is due.
            t.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int
        });
        // SAFETY: epoll_wait writes at most `evs.len()` events into `evs`.
        let n = unsafe {
            libc::epoll_wait(
                self.fd.as_raw_fd(),
                evs.as_mut_ptr(),
                evs.len() as libc::c_int,
                ms,
            )
        };
        for ev in evs.iter().take(n.max(0) as usize) {
            out.push(ev.u64);
        }
    }
}

/// The uid and pid of the process at the other end of `s`.
pub(crate) fn peer_cred(s: &UnixStream) -> io::Result<(u32, i32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`.
    check(unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    })?;
    Ok((cred.uid, cred.pid))
}

/// This process's effective uid.
pub(crate) fn euid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

// `membarrier(2)` commands (linux/membarrier.h).
const MEMBARRIER_CMD_GLOBAL: libc::c_int = 1;
const MEMBARRIER_CMD_GLOBAL_EXPEDITED: libc::c_int = 2;
const MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED: libc::c_int = 4;

fn membarrier(cmd: libc::c_int) -> io::Result<()> {
    // SAFETY: membarrier takes a command and flags (0) and touches no memory of ours.
    let ret = unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0, 0) };
    match ret {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// Whether this process takes part in other processes' global expedited barriers
/// ([`global_barrier`]): registered once, at the first call.
pub(crate) fn takes_global_barriers() -> bool {
    static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *REGISTERED.get_or_init(|| membarrier(MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED).is_ok())
}

/// Whether this process can issue [`global_barrier`]s the expedited way (tried once).
pub(crate) fn issues_global_barriers() -> bool {
    static WORKS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WORKS.get_or_init(|| membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED).is_ok())
}

/// A full memory barrier on every running thread of every process that
/// [takes part](takes_global_barriers) (the expedited command, microseconds), or failing
/// that of every process (the kernel waits for a grace period, milliseconds): a store a
/// thread of those processes made before it is seen after it, and a load it makes after
/// it sees what this thread stored before.
pub(crate) fn global_barrier() -> io::Result<()> {
    membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED).or_else(|_| membarrier(MEMBARRIER_CMD_GLOBAL))
}

/// A word whose address a process hands its peer at connection setup: the peer reads it
/// with [`pull`] to learn whether the kernel lets it read this process's memory.
pub(crate) static PROBE: u64 = u64::from_be_bytes(*b"RDMXCMA1");

/// Copies bytes out of process `pid` with `process_vm_readv`: each piece is a local
/// address, an address in the peer and a length. Fails with the kernel's error, or
/// `UnexpectedEof` when it copied fewer bytes (part of a range is not mapped in the
/// peer).
///
/// # Safety
///
/// Every piece's local range is writable memory of this process that nothing references
/// for the duration of the call.
pub(crate) unsafe fn pull(pid: i32, pieces: &[(usize, u64, usize)]) -> io::Result<()> {
    const BATCH: usize = 64;
    let none = libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    };
    for chunk in pieces.chunks(BATCH) {
        let mut local = [none; BATCH];
        let mut remote = [none; BATCH];
        let mut want = 0;
        for (i, &(l, r, n)) in chunk.iter().enumerate() {
            local[i] = libc::iovec {
                iov_base: l as *mut libc::c_void,
                iov_len: n,
            };
            remote[i] = libc::iovec {
                iov_base: r as usize as *mut libc::c_void,
                iov_len: n,
            };
            want += n;
        }
        // SAFETY: the kernel writes only the local ranges (the caller vouches for them)
        // and reads the peer's memory, checking that this process may.
        let n = unsafe {
            libc::process_vm_readv(
                pid,
                local.as_ptr(),
                chunk.len() as libc::c_ulong,
                remote.as_ptr(),
                chunk.len() as libc::c_ulong,
                0,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n as usize != want {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("copied {n} of {want} bytes"),
            ));
        }
    }
    Ok(())
}

/// Whether this process may read process `pid`'s memory: reads the peer's [`PROBE`] at
/// `addr` (the address the peer gave). The error says why not.
pub(crate) fn probe(pid: i32, addr: u64) -> io::Result<()> {
    let mut v = 0u64;
    // SAFETY: the local range is `v`.
    unsafe { pull(pid, &[(&mut v as *mut u64 as usize, addr, 8)])? };
    if v != PROBE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the peer's probe word has the wrong value",
        ));
    }
    Ok(())
}

/// The address of this process's [`PROBE`].
pub(crate) fn probe_addr() -> u64 {
    &PROBE as *const u64 as usize as u64
}

/// Most descriptors one message carries.
const MAX_FDS: usize = 3;

/// Sends `bytes` and the descriptors `fds` in one message.
pub(crate) fn send_with_fds(s: &UnixStream, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
    assert!(fds.len() <= MAX_FDS);
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr().cast_mut().cast(),
        iov_len: bytes.len(),
    };
    // Room for a cmsghdr and MAX_FDS descriptors, 8-aligned.
    let mut cbuf = [0u64; 8];
    // SAFETY: an all-zero msghdr is valid; its pointers are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        // SAFETY: CMSG_SPACE/CMSG_LEN compute sizes only.
        let space = unsafe { libc::CMSG_SPACE((fds.len() * 4) as u32) } as usize;
        debug_assert!(space <= std::mem::size_of_val(&cbuf));
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: msg_control points at `cbuf`, large enough for one cmsghdr with
        // `fds.len()` descriptors (checked above); CMSG_FIRSTHDR/CMSG_DATA stay inside it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN((fds.len() * 4) as u32) as _;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(c),
                fds.len() * 4,
            );
        }
    }
    loop {
        // SAFETY: msg names `iov` and `cbuf`, both live for the call.
        let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return if n as usize == bytes.len() {
                Ok(())
            } else {
                Err(io::Error::new(io::ErrorKind::WriteZero, "short sendmsg"))
            };
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Sends `bytes` on `s` without waiting: fails (`WouldBlock`) rather than wait for room,
/// whatever the socket's mode.
pub(crate) fn send_nowait(s: &UnixStream, bytes: &[u8]) -> io::Result<()> {
    loop {
        // SAFETY: send reads `bytes.len()` bytes from `bytes` for the call.
        let n = unsafe {
            libc::send(
                s.as_raw_fd(),
                bytes.as_ptr().cast(),
                bytes.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n >= 0 {
            return match n as usize == bytes.len() {
                true => Ok(()),
                false => Err(io::Error::new(io::ErrorKind::WriteZero, "short send")),
            };
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Receives one message of exactly `buf.len()` bytes and the descriptors it carries (at
/// most [`MAX_FDS`]; more, or a short message, is an error — the descriptors are closed).
pub(crate) fn recv_with_fds(s: &UnixStream, buf: &mut [u8]) -> io::Result<Vec<OwnedFd>> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; 8];
    // SAFETY: an all-zero msghdr is valid; its pointers are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
    let n = loop {
        // SAFETY: msg names `iov` and `cbuf`, both live and writable for the call.
        let n = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `msg_controllen` bytes of `cbuf` with well-formed cmsgs;
    // CMSG_FIRSTHDR/CMSG_NXTHDR walk them without leaving the buffer, and each
    // SCM_RIGHTS payload holds whole descriptors that are now ours.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c);
                let bytes = (*c).cmsg_len as usize - (data as usize - c as usize);
                for i in 0..bytes / 4 {
                    let fd = std::ptr::read_unaligned(data.add(i * 4).cast::<RawFd>());
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 || fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "too many descriptors",
        ));
    }
    if n == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "end of stream",
        ));
    }
    if n != buf.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a short message",
        ));
    }
    Ok(fds)
}

/// Whether the other end of `s` has closed (or failed), without consuming data.
pub(crate) fn hung_up(s: &UnixStream) -> bool {
    let mut pfd = libc::pollfd {
        fd: s.as_raw_fd(),
        events: libc::POLLIN | libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: poll reads and writes the one pollfd for the call.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    n > 0 && pfd.revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR) != 0
}

/// Asks the kernel to attach the sender's credentials (`SCM_CREDENTIALS`) to every
/// datagram `fd` receives.
pub(crate) fn pass_credentials(fd: RawFd) -> io::Result<()> {
    let on: libc::c_int = 1;
    // SAFETY: setsockopt reads the one int for the call.
    check(unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PASSCRED,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    })?;
    Ok(())
}

/// `SO_PASSRIGHTS` (Linux 6.16), which the libc crate does not name yet.
const SO_PASSRIGHTS: libc::c_int = 83;

/// Asks the kernel to refuse descriptors sent to `fd` (`SCM_RIGHTS`): the sender's
/// `sendmsg` fails with `EPERM`. Returns false on a kernel without the option, where
/// [`recv_dgram`] closes any that come, and closing one (a socket set to linger, say)
/// may take a while.
pub(crate) fn refuse_descriptors(fd: RawFd) -> io::Result<bool> {
    let off: libc::c_int = 0;
    // SAFETY: setsockopt reads the one int for the call.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            SO_PASSRIGHTS,
            (&off as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    match check(r) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// A datagram [`recv_dgram`] read.
#[derive(Debug)]
pub(crate) struct Dgram {
    /// Its length; longer than the buffer if it was cut short.
    pub(crate) len: usize,
    /// The abstract name of the socket it was sent from (empty: none, or a path).
    pub(crate) from: Vec<u8>,
    /// The sender's uid and pid, as the kernel attests them.
    pub(crate) cred: Option<(u32, i32)>,
}

/// Reads one waiting datagram from `fd` into `buf` without blocking (`WouldBlock`: none).
pub(crate) fn recv_dgram(fd: RawFd, buf: &mut [u8]) -> io::Result<Dgram> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero sockaddr_un and msghdr are valid; pointers are set below.
    let mut name: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    let mut cbuf = [0u64; 8];
    // SAFETY: as above.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = (&mut name as *mut libc::sockaddr_un).cast();
    msg.msg_namelen = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
    let n = loop {
        // SAFETY: msg names `name`, `iov` and `cbuf`, all live and writable for the call.
        let n = unsafe {
            libc::recvmsg(
                fd,
                &mut msg,
                libc::MSG_DONTWAIT | libc::MSG_TRUNC | libc::MSG_CMSG_CLOEXEC,
            )
        };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut cred = None;
    // SAFETY: the kernel filled `msg_controllen` bytes of `cbuf` with well-formed cmsgs;
    // CMSG_FIRSTHDR/CMSG_NXTHDR walk them without leaving the buffer. Descriptors are
    // never passed on this socket, which refuses them where the kernel can; any that come
    // are closed.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            let data = libc::CMSG_DATA(c);
            let bytes = (*c).cmsg_len as usize - (data as usize - c as usize);
            if (*c).cmsg_level == libc::SOL_SOCKET {
                if (*c).cmsg_type == libc::SCM_CREDENTIALS
                    && bytes >= std::mem::size_of::<libc::ucred>()
                {
                    let u = std::ptr::read_unaligned(data.cast::<libc::ucred>());
                    cred = Some((u.uid, u.pid));
                } else if (*c).cmsg_type == libc::SCM_RIGHTS {
                    for i in 0..bytes / 4 {
                        let fd = std::ptr::read_unaligned(data.add(i * 4).cast::<RawFd>());
                        drop(OwnedFd::from_raw_fd(fd));
                    }
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    // An abstract name starts with a NUL byte; its length is what the kernel reports.
    let path_at = std::mem::size_of::<libc::sa_family_t>();
    let name_len = (msg.msg_namelen as usize).saturating_sub(path_at);
    let path = &name.sun_path[..name_len.min(name.sun_path.len())];
    let from = match path.split_first() {
        Some((0, rest)) => rest.iter().map(|&b| b as u8).collect(),
        _ => Vec::new(),
    };
    Ok(Dgram { len: n, from, cred })
}
