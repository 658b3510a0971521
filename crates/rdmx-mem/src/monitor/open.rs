//! Creating the userfaultfd descriptor: through the `userfaultfd` crate's builder, through
//! the system call when `/dev/userfaultfd` exists but cannot be opened, and a probe that
//! the kernel accepts write-protect registration; plus the error descriptions that make
//! [`Unavailable`](super::Unavailable) say why.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};

use userfaultfd::{FeatureFlags, RegisterMode, Uffd, UffdBuilder};

use crate::sys;

pub(super) fn features() -> FeatureFlags {
    FeatureFlags::EVENT_UNMAP | FeatureFlags::EVENT_REMOVE | FeatureFlags::EVENT_REMAP
}

/// Creates the descriptor: through the builder (`/dev/userfaultfd` when it exists, else the
/// system call), and through the system call when the device exists but cannot be opened.
pub(super) fn open_uffd() -> Result<Uffd, String> {
    let built = UffdBuilder::new()
        .close_on_exec(true)
        .non_blocking(true)
        .user_mode_only(true)
        .require_features(features())
        .create();
    match built {
        Ok(uffd) => Ok(uffd),
        Err(userfaultfd::Error::OpenDevUserfaultfd(dev)) => {
            open_by_syscall(features()).map_err(|sys| {
                format!(
                    "cannot open /dev/userfaultfd ({dev}) and userfaultfd(2) failed ({})",
                    describe_os(&sys)
                )
            })
        }
        Err(err) => Err(format!(
            "cannot create a userfaultfd descriptor: {}",
            describe_uffd(&err)
        )),
    }
}

const UFFD_USER_MODE_ONLY: libc::c_int = 1;
const UFFD_API: u64 = 0xaa;
/// `_IOWR(0xaa, 0x3f, struct uffdio_api)`.
const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;

/// `struct uffdio_api`.
#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

/// `userfaultfd(2)` with user-mode-only (retried without it on kernels before 5.11), then
/// the `UFFDIO_API` handshake asking for `features`.
pub(super) fn open_by_syscall(features: FeatureFlags) -> io::Result<Uffd> {
    let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
    let create = |flags: libc::c_int| {
        // SAFETY: userfaultfd(2) takes only flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
        if fd < 0 {
            Err(io::Error::last_os_error())
        } else {
            RawFd::try_from(fd).map_err(|_| io::Error::other("descriptor out of range"))
        }
    };
    let fd = match create(flags | UFFD_USER_MODE_ONLY) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => create(flags)?,
        other => other?,
    };
    // SAFETY: `fd` is a new descriptor that nothing else owns.
    let uffd = unsafe { Uffd::from_raw_fd(fd) };
    let mut api = UffdioApi {
        api: UFFD_API,
        features: features.bits(),
        ioctls: 0,
    };
    // SAFETY: UFFDIO_API reads and writes one `struct uffdio_api`, which `api` is.
    sys::syscall!(ioctl(
        uffd.as_raw_fd(),
        UFFDIO_API as _,
        &mut api as *mut UffdioApi
    ))?;
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
    let registered = uffd.register_with_mode(p, page, RegisterMode::WRITE_PROTECT);
    let result = match registered {
        Ok(_) => match uffd.unregister(p, page) {
            Ok(()) => Ok(()),
            Err(err) => {
                // Unmapping a still-registered page would wait for a reader that does not
                // run yet; leave the page mapped.
                return Err(format!(
                    "cannot unregister the probe page: {}",
                    describe_uffd(&err)
                ));
            }
        },
        Err(err) => Err(format!(
            "the kernel refuses write-protect registration of anonymous memory: {}",
            describe_uffd(&err)
        )),
    };
    if let Err(err) = sys::syscall!(munmap(p, page)) {
        tracing::warn!(%err, "munmap of the userfaultfd probe page failed");
    }
    result
}

pub(super) fn uffd_to_io(err: userfaultfd::Error) -> io::Error {
    match err {
        userfaultfd::Error::SystemError(errno) => io::Error::from_raw_os_error(errno as i32),
        other => io::Error::other(other),
    }
}

pub(super) fn describe_uffd(err: &userfaultfd::Error) -> String {
    match err {
        userfaultfd::Error::SystemError(errno) => {
            describe_os(&io::Error::from_raw_os_error(*errno as i32))
        }
        other => other.to_string(),
    }
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
