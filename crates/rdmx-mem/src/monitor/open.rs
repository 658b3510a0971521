//! Creating the userfaultfd descriptor: through `/dev/userfaultfd` when it exists, through
//! the system call otherwise or when the device cannot be opened, and a probe that the
//! kernel accepts write-protect registration; plus the error descriptions that make
//! [`Unavailable`](super::Unavailable) say why.

use std::io;

use super::uffd::{feature, Uffd, USER_MODE_ONLY};
use crate::sys;

/// The events the monitor asks for (`UFFD_FEATURE_*`).
pub(super) fn features() -> u64 {
    feature::EVENT_UNMAP | feature::EVENT_REMOVE | feature::EVENT_REMAP
}

const DEVICE: &str = "/dev/userfaultfd";

/// Creates the descriptor: through `/dev/userfaultfd` when it exists, else the system call,
/// and through the system call when the device exists but cannot be opened.
pub(super) fn open_uffd() -> Result<Uffd, String> {
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(DEVICE);
    let built = match dev {
        Ok(dev) => Uffd::by_device(&dev, flags() | USER_MODE_ONLY).and_then(|uffd| {
            uffd.api(features())?;
            Ok(uffd)
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => open_by_syscall(features()),
        Err(dev) => {
            return open_by_syscall(features()).map_err(|sys| {
                format!(
                    "cannot open {DEVICE} ({dev}) and userfaultfd(2) failed ({})",
                    describe_os(&sys)
                )
            })
        }
    };
    built.map_err(|err| {
        format!(
            "cannot create a userfaultfd descriptor: {}",
            describe_os(&err)
        )
    })
}

fn flags() -> libc::c_int {
    libc::O_CLOEXEC | libc::O_NONBLOCK
}

/// `userfaultfd(2)` with user-mode-only (retried without it on kernels before 5.11), then
/// the `UFFDIO_API` handshake asking for `features`.
pub(super) fn open_by_syscall(features: u64) -> io::Result<Uffd> {
    let uffd = match Uffd::by_syscall(flags() | USER_MODE_ONLY) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Uffd::by_syscall(flags())?,
        other => other?,
    };
    uffd.api(features)?;
    Ok(uffd)
}

/// Registers a scratch page in write-protect mode, so a kernel without userfaultfd
/// write-protect support is reported by [`global`] rather than by every `watch`.
pub(super) fn probe_write_protect(uffd: &Uffd) -> Result<(), String> {
    let page = sys::page_size();
    // SAFETY: a private anonymous mapping at an address of the kernel's choosing touches no
    // existing memory.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(format!(
            "cannot map a probe page: {}",
            io::Error::last_os_error()
        ));
    }
    let registered = uffd.register_write_protect(p as usize, page);
    let result = match registered {
        Ok(_) => match uffd.unregister(p as usize, page) {
            Ok(()) => Ok(()),
            Err(err) => {
                // Unmapping a still-registered page would wait for a reader that does not
                // run yet; leave the page mapped.
                return Err(format!(
                    "cannot unregister the probe page: {}",
                    describe_os(&err)
                ));
            }
        },
        Err(err) => Err(format!(
            "the kernel refuses write-protect registration of anonymous memory: {}",
            describe_os(&err)
        )),
    };
    if let Err(err) = sys::syscall!(munmap(p, page)) {
        tracing::warn!(%err, "munmap of the userfaultfd probe page failed");
    }
    result
}

pub(super) fn describe_os(err: &io::Error) -> String {
    let hint = match err.raw_os_error() {
        Some(libc::EPERM) => " (not permitted)",
        Some(libc::ENOSYS) => " (kernel built without CONFIG_USERFAULTFD)",
        Some(libc::EINVAL) => " (the kernel lacks a requested feature)",
        _ => "",
    };
    format!("{err}{hint}")
}
