//! The one place raw system calls are made: an errno-checking helper and page geometry.

use std::io;
use std::sync::OnceLock;

/// Calls a libc function and turns a `-1` return into the thread's `errno`.
macro_rules! syscall {
    ($fn:ident ( $($arg:expr),* $(,)? )) => {{
        #[allow(unused_unsafe)]
        // SAFETY: the caller of the macro upholds the contract of the wrapped libc call.
        let res = unsafe { libc::$fn($($arg),*) };
        if res == -1 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(res)
        }
    }};
}
pub(crate) use syscall;

/// The base page size of this process.
pub fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf has no memory-safety preconditions.
        let sz = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if sz > 0 {
            sz as usize
        } else {
            4096
        }
    })
}

/// Rounds `[addr, addr + len)` out to whole pages. Returns `None` when the range overflows.
pub fn page_span(addr: usize, len: usize) -> Option<(usize, usize)> {
    let page = page_size();
    let end = addr.checked_add(len)?;
    let start = addr & !(page - 1);
    let end = end.checked_add(page - 1)? & !(page - 1);
    Some((start, end))
}

/// The soft and hard `RLIMIT_MEMLOCK` of this process, in bytes (`None` = unlimited).
pub fn memlock_limit() -> io::Result<(Option<u64>, Option<u64>)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    syscall!(getrlimit(libc::RLIMIT_MEMLOCK, &mut lim))?;
    let conv = |v: libc::rlim_t| (v != libc::RLIM_INFINITY).then_some(v);
    Ok((conv(lim.rlim_cur), conv(lim.rlim_max)))
}

/// Bytes this process has locked in memory now (`VmLck` in `/proc/self/status`).
pub fn locked_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmLck:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_span_rounds_out_and_rejects_overflow() {
        let p = page_size();
        assert_eq!(page_span(p + 1, 1), Some((p, 2 * p)));
        assert_eq!(page_span(p, p), Some((p, 2 * p)));
        assert_eq!(page_span(p - 1, 2), Some((0, 2 * p)));
        assert_eq!(page_span(usize::MAX - 3, 8), None);
        assert_eq!(page_span(usize::MAX - p + 2, 1), None);
    }
}
