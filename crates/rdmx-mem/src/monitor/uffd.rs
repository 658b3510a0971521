//! The part of userfaultfd(2) the monitor uses, on a descriptor it owns: creating it, the
//! `UFFDIO_API` handshake, write-protect registration, waking, and reading events.
//!
//! The kernel's definitions (the `uffd_msg` layout, the `uffdio_*` argument structures,
//! event, feature and register-mode constants, ioctl numbers) come from `linux-raw-sys`,
//! which ships them generated from the kernel's UAPI headers for every architecture; the
//! tests below check them against the running kernel.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use linux_raw_sys::general::{self as uapi, uffd_msg, uffdio_api, uffdio_range};
use linux_raw_sys::ioctl;

use crate::sys;

/// `UFFD_FEATURE_*` bits.
pub(super) mod feature {
    use linux_raw_sys::general as uapi;

    pub(in super::super) const EVENT_REMAP: u64 = uapi::UFFD_FEATURE_EVENT_REMAP as u64;
    pub(in super::super) const EVENT_REMOVE: u64 = uapi::UFFD_FEATURE_EVENT_REMOVE as u64;
    pub(in super::super) const EVENT_UNMAP: u64 = uapi::UFFD_FEATURE_EVENT_UNMAP as u64;
}

/// `UFFD_USER_MODE_ONLY`: the descriptor handles faults from user space only, which needs
/// no privilege (Linux 5.11+).
pub(super) const USER_MODE_ONLY: libc::c_int = uapi::UFFD_USER_MODE_ONLY as libc::c_int;

/// `USERFAULTFD_IOC_NEW` on `/dev/userfaultfd`: `_IO(USERFAULTFD_IOC, 0x00)`, taking the
/// flags of userfaultfd(2) as its argument.
const USERFAULTFD_IOC_NEW: libc::Ioctl = libc::_IO(uapi::USERFAULTFD_IOC, 0x00);

/// An owned userfaultfd descriptor.
#[derive(Debug)]
pub(super) struct Uffd {
    fd: OwnedFd,
}

impl AsRawFd for Uffd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// One event, as far as the monitor cares.
#[derive(Debug)]
pub(super) enum Event {
    /// A page fault at `addr`; `write_protect` when it hit a write-protected page.
    Pagefault { addr: usize, write_protect: bool },
    /// `[start, end)` was unmapped.
    Unmap { start: usize, end: usize },
    /// `[start, end)` was dropped by `madvise`.
    Remove { start: usize, end: usize },
    /// `len` bytes at `from` moved elsewhere.
    Remap { from: usize, len: usize },
    /// A forked child's descriptor (only with `EVENT_FORK`); dropping it closes it.
    Fork(OwnedFd),
    /// An event this module does not know.
    Unknown,
}

/// Room for the messages of one `read`.
pub(super) struct EventBuffer {
    msgs: Vec<uffd_msg>,
}

impl EventBuffer {
    /// Room for `n` messages.
    pub(super) fn new(n: usize) -> EventBuffer {
        // SAFETY: uffd_msg holds only integers (in unions of integer structs); all-zero is
        // a valid value.
        let zero: uffd_msg = unsafe { std::mem::zeroed() };
        EventBuffer {
            msgs: vec![zero; n.max(1)],
        }
    }
}

fn range(start: usize, len: usize) -> uffdio_range {
    uffdio_range {
        start: start as u64,
        len: len as u64,
    }
}

impl Uffd {
    /// userfaultfd(2) with `flags` (`O_CLOEXEC`, `O_NONBLOCK`, [`USER_MODE_ONLY`]).
    pub(super) fn by_syscall(flags: libc::c_int) -> io::Result<Uffd> {
        // SAFETY: userfaultfd(2) takes only flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let fd = RawFd::try_from(fd).map_err(|_| io::Error::other("descriptor out of range"))?;
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Uffd { fd })
    }

    /// `USERFAULTFD_IOC_NEW` on an open `/dev/userfaultfd`, with the flags of
    /// userfaultfd(2).
    pub(super) fn by_device(dev: &File, flags: libc::c_int) -> io::Result<Uffd> {
        // SAFETY: USERFAULTFD_IOC_NEW takes the flags as an integer and touches no memory.
        let fd = sys::syscall!(ioctl(dev.as_raw_fd(), USERFAULTFD_IOC_NEW, flags))?;
        // SAFETY: the ioctl returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Uffd { fd })
    }

    /// The `UFFDIO_API` handshake asking for `features` (`UFFD_FEATURE_*`); returns the
    /// ioctls the descriptor supports (bit `n` for ioctl number `n`). Fails with `EINVAL`
    /// when the kernel lacks a requested feature.
    pub(super) fn api(&self, features: u64) -> io::Result<u64> {
        let mut api = uffdio_api {
            api: u64::from(uapi::UFFD_API),
            features,
            ioctls: 0,
        };
        let arg: *mut uffdio_api = &mut api;
        // SAFETY: UFFDIO_API reads and writes one `struct uffdio_api`, which `arg` points to.
        sys::syscall!(ioctl(self.as_raw_fd(), ioctl::UFFDIO_API as _, arg))?;
        Ok(api.ioctls)
    }

    /// `UFFDIO_REGISTER` of `[start, start + len)` in write-protect mode; returns the ioctls
    /// the range supports.
    pub(super) fn register_write_protect(&self, start: usize, len: usize) -> io::Result<u64> {
        let mut reg = uapi::uffdio_register {
            range: range(start, len),
            mode: u64::from(uapi::UFFDIO_REGISTER_MODE_WP),
            ioctls: 0,
        };
        let arg: *mut uapi::uffdio_register = &mut reg;
        // SAFETY: UFFDIO_REGISTER reads and writes one `struct uffdio_register`; it changes
        // no memory, only what the kernel reports for the range.
        sys::syscall!(ioctl(self.as_raw_fd(), ioctl::UFFDIO_REGISTER as _, arg))?;
        Ok(reg.ioctls)
    }

    /// `UFFDIO_UNREGISTER` of `[start, start + len)`.
    pub(super) fn unregister(&self, start: usize, len: usize) -> io::Result<()> {
        let mut r = range(start, len);
        let arg: *mut uffdio_range = &mut r;
        // SAFETY: UFFDIO_UNREGISTER reads one `struct uffdio_range`.
        sys::syscall!(ioctl(self.as_raw_fd(), ioctl::UFFDIO_UNREGISTER as _, arg))?;
        Ok(())
    }

    /// `UFFDIO_WRITEPROTECT` clearing the protection of `[start, start + len)` and waking
    /// the threads that faulted on it.
    pub(super) fn remove_write_protection(&self, start: usize, len: usize) -> io::Result<()> {
        let mut wp = uapi::uffdio_writeprotect {
            range: range(start, len),
            mode: 0,
        };
        let arg: *mut uapi::uffdio_writeprotect = &mut wp;
        // SAFETY: UFFDIO_WRITEPROTECT reads one `struct uffdio_writeprotect`; clearing a
        // protection changes no memory.
        sys::syscall!(ioctl(
            self.as_raw_fd(),
            ioctl::UFFDIO_WRITEPROTECT as _,
            arg
        ))?;
        Ok(())
    }

    /// `UFFDIO_WAKE`: wakes the threads that faulted on `[start, start + len)`.
    pub(super) fn wake(&self, start: usize, len: usize) -> io::Result<()> {
        let mut r = range(start, len);
        let arg: *mut uffdio_range = &mut r;
        // SAFETY: UFFDIO_WAKE reads one `struct uffdio_range`.
        sys::syscall!(ioctl(self.as_raw_fd(), ioctl::UFFDIO_WAKE as _, arg))?;
        Ok(())
    }

    /// Reads the waiting events into `buf`; none when a non-blocking descriptor has none.
    pub(super) fn read_events<'a>(
        &self,
        buf: &'a mut EventBuffer,
    ) -> io::Result<impl Iterator<Item = Event> + 'a> {
        const MSG: usize = std::mem::size_of::<uffd_msg>();
        let bytes = buf.msgs.len() * MSG;
        let ptr = buf.msgs.as_mut_ptr().cast::<libc::c_void>();
        // SAFETY: `ptr` points to `bytes` writable bytes of plain-integer messages.
        let n = match sys::syscall!(read(self.as_raw_fd(), ptr, bytes)) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
            Ok(n) => n as usize,
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => 0,
            Err(e) => return Err(e),
        };
        if n % MSG != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("userfaultfd read returned {n} bytes, not whole {MSG}-byte messages"),
            ));
        }
        Ok(buf.msgs[..n / MSG].iter().map(Event::from_msg))
    }

    /// Reads one event, if one is waiting (on a non-blocking descriptor).
    #[cfg(test)]
    pub(super) fn read_event(&self) -> io::Result<Option<Event>> {
        let mut buf = EventBuffer::new(1);
        let event = self.read_events(&mut buf)?.next();
        Ok(event)
    }
}

impl Event {
    fn from_msg(msg: &uffd_msg) -> Event {
        match u32::from(msg.event) {
            uapi::UFFD_EVENT_PAGEFAULT => {
                // SAFETY: the kernel fills `pagefault` for a PAGEFAULT event.
                let pf = unsafe { msg.arg.pagefault };
                Event::Pagefault {
                    addr: pf.address as usize,
                    write_protect: pf.flags & u64::from(uapi::UFFD_PAGEFAULT_FLAG_WP) != 0,
                }
            }
            uapi::UFFD_EVENT_UNMAP => {
                // SAFETY: the kernel fills `remove` for an UNMAP event.
                let r = unsafe { msg.arg.remove };
                Event::Unmap {
                    start: r.start as usize,
                    end: r.end as usize,
                }
            }
            uapi::UFFD_EVENT_REMOVE => {
                // SAFETY: the kernel fills `remove` for a REMOVE event.
                let r = unsafe { msg.arg.remove };
                Event::Remove {
                    start: r.start as usize,
                    end: r.end as usize,
                }
            }
            uapi::UFFD_EVENT_REMAP => {
                // SAFETY: the kernel fills `remap` for a REMAP event.
                let r = unsafe { msg.arg.remap };
                Event::Remap {
                    from: r.from as usize,
                    len: r.len as usize,
                }
            }
            uapi::UFFD_EVENT_FORK => {
                // SAFETY: the kernel fills `fork` for a FORK event.
                let fd = unsafe { msg.arg.fork }.ufd as RawFd;
                // SAFETY: the kernel installed this descriptor in this process for the event;
                // nothing else owns it.
                Event::Fork(unsafe { OwnedFd::from_raw_fd(fd) })
            }
            _ => Event::Unknown,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn syscall_flags() -> libc::c_int {
        libc::O_CLOEXEC | libc::O_NONBLOCK | USER_MODE_ONLY
    }

    fn map_page() -> usize {
        // SAFETY: a new private anonymous mapping touches no existing memory.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                sys::page_size(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        p as usize
    }

    /// The ioctl numbers encode the size of their argument, so the kernel accepting each
    /// ioctl confirms the structure; the reported ioctl bits confirm the ioctl numbers'
    /// low byte; an event read confirms the message size.
    #[test]
    fn definitions_match_the_kernel() {
        assert_eq!(std::mem::size_of::<uffd_msg>(), 32);
        let uffd = Uffd::by_syscall(syscall_flags()).expect("userfaultfd(2) works here");
        let bit = |nr: u32| 1u64 << nr;
        let ioctls = uffd
            .api(feature::EVENT_UNMAP | feature::EVENT_REMOVE | feature::EVENT_REMAP)
            .expect("UFFDIO_API with the monitor's features");
        for nr in [
            uapi::_UFFDIO_API,
            uapi::_UFFDIO_REGISTER,
            uapi::_UFFDIO_UNREGISTER,
        ] {
            assert_ne!(ioctls & bit(nr), 0, "ioctl {nr} missing from {ioctls:#x}");
        }
        assert_eq!((ioctl::UFFDIO_API & 0xff), uapi::_UFFDIO_API);
        assert_eq!((ioctl::UFFDIO_REGISTER & 0xff), uapi::_UFFDIO_REGISTER);
        assert_eq!((ioctl::UFFDIO_UNREGISTER & 0xff), uapi::_UFFDIO_UNREGISTER);
        assert_eq!((ioctl::UFFDIO_WAKE & 0xff), uapi::_UFFDIO_WAKE);
        assert_eq!(
            (ioctl::UFFDIO_WRITEPROTECT & 0xff),
            uapi::_UFFDIO_WRITEPROTECT
        );

        let page = sys::page_size();
        let p = map_page();
        let ranged = uffd
            .register_write_protect(p, page)
            .expect("write-protect registration");
        for nr in [uapi::_UFFDIO_WAKE, uapi::_UFFDIO_WRITEPROTECT] {
            assert_ne!(ranged & bit(nr), 0, "ioctl {nr} missing from {ranged:#x}");
        }
        uffd.remove_write_protection(p, page)
            .expect("UFFDIO_WRITEPROTECT");
        uffd.wake(p, page).expect("UFFDIO_WAKE");
        uffd.unregister(p, page).expect("UFFDIO_UNREGISTER");
        sys::syscall!(munmap(p as *mut libc::c_void, page)).expect("munmap");
        assert!(uffd.read_event().expect("read").is_none());
    }

    #[test]
    fn madvise_is_a_remove_event_of_the_range() {
        let uffd = Uffd::by_syscall(syscall_flags()).expect("userfaultfd(2) works here");
        uffd.api(feature::EVENT_REMOVE).expect("UFFDIO_API");
        let page = sys::page_size();
        let p = map_page();
        uffd.register_write_protect(p, page).expect("register");
        // madvise waits until the event is read, so call it on another thread.
        let advisor = std::thread::spawn(move || {
            sys::syscall!(madvise(p as *mut libc::c_void, page, libc::MADV_DONTNEED))
                .expect("madvise");
        });
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let event = loop {
            if let Some(ev) = uffd.read_event().expect("read") {
                break ev;
            }
            assert!(std::time::Instant::now() < deadline, "no event within 5 s");
            std::thread::sleep(std::time::Duration::from_millis(1));
        };
        advisor.join().unwrap();
        match event {
            Event::Remove { start, end } => assert_eq!((start, end), (p, p + page)),
            other => panic!("expected a remove event, got {other:?}"),
        }
        uffd.unregister(p, page).expect("unregister");
        sys::syscall!(munmap(p as *mut libc::c_void, page)).expect("munmap");
    }
}
