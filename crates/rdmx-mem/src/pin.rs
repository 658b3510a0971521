//! Pinning: registration locks pages in memory with `mlock`, deregistration unlocks them.
//!
//! `mlock` is per page and not counted by the kernel: one `munlock` undoes any number of
//! `mlock`s of the same page. Registrations overlap (two buffers in one page, a cache entry
//! inside a larger region), so this module keeps one process-wide count per page range and
//! only locks pages whose count goes from 0 to 1 and unlocks pages whose count returns to 0.
//! A deregistration therefore never unlocks pages another registration still needs.
//!
//! Registration locks its whole span every time, not only the pages whose count was 0:
//! a count can outlive the pages it was for (an application that unmaps registered
//! memory, whose registration the cache drops only once the monitor reports it), and a
//! new mapping at the same addresses then needs its own lock. Locking a locked page
//! again costs nothing in the limit: the kernel counts locked pages, not calls.
//!
//! When locking would exceed `RLIMIT_MEMLOCK`, the error ([`MemlockLimit`]) states the
//! limit, the bytes asked for and how to raise it. Not pinning is an explicit choice
//! ([`Pinning::Unpinned`]); it never happens silently.

use std::io;

use parking_lot::Mutex;

use crate::error::{Error, MemlockLimit};
use crate::ranges::{merge, RangeCounts};
use crate::sys::{self, syscall};

/// Whether a registration locks its pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Pinning {
    /// Lock the pages with `mlock` for the life of the registration (the default).
    #[default]
    Pinned,
    /// Do not lock. The kernel may page the memory out or move it; software providers
    /// still work, but a real adapter would not see moved pages.
    Unpinned,
}

/// Keeps pages `[start, end)` locked until dropped.
#[derive(Debug)]
pub struct PinGuard {
    start: usize,
    end: usize,
}

impl PinGuard {
    /// The locked page-aligned span.
    pub fn span(&self) -> (usize, usize) {
        (self.start, self.end)
    }
}

impl Drop for PinGuard {
    fn drop(&mut self) {
        unlock_span(&mut PINS.lock(), self.start, self.end);
    }
}

/// Pins `[addr, addr + len)` (rounded out to whole pages) when `pinning` asks for it.
///
/// Returns `Ok(None)` for [`Pinning::Unpinned`]. Errors on an empty or overflowing range,
/// on `RLIMIT_MEMLOCK`, and when the range is not mapped.
pub fn pin(addr: usize, len: usize, pinning: Pinning) -> Result<Option<PinGuard>, Error> {
    let (start, end) = match sys::page_span(addr, len) {
        Some(span) if len > 0 => span,
        _ => return Err(Error::InvalidRange { addr, len }),
    };
    match pinning {
        Pinning::Unpinned => Ok(None),
        Pinning::Pinned => {
            lock_span(&mut PINS.lock(), start, end)?;
            Ok(Some(PinGuard { start, end }))
        }
    }
}

/// Locks again the pinned pages of `[start, end)`: pages that replaced pinned ones at
/// the same addresses (a detached shared mapping) came without the lock.
pub(crate) fn relock(start: usize, end: usize) {
    let pins = PINS.lock();
    for (s, e, c) in pins.pieces(start, end) {
        if c > 0 {
            if let Err(err) = syscall!(mlock(s as *const libc::c_void, e - s)) {
                tracing::warn!(addr = s, len = e - s, %err, "locking detached pages again failed");
            }
        }
    }
}

/// Bytes rdmx holds pinned in this process right now.
pub fn pinned_bytes() -> usize {
    PINS.lock().covered_bytes()
}

static PINS: Mutex<RangeCounts> = Mutex::new(RangeCounts::new());

/// Locks `[start, end)` and counts it.
fn lock_span(counts: &mut RangeCounts, start: usize, end: usize) -> Result<(), Error> {
    let gaps = merge(
        counts
            .pieces(start, end)
            .into_iter()
            .filter(|&(_, _, c)| c == 0),
    );
    if let Err(err) = syscall!(mlock(start as *const libc::c_void, end - start)) {
        // Part of the span may be locked now: unlock what no other registration
        // counts on (the rest was locked before, or is meant to be).
        for &(s, e) in &gaps {
            let _ = syscall!(munlock(s as *const libc::c_void, e - s));
        }
        let requested = gaps.iter().map(|(s, e)| e - s).sum();
        return Err(classify(err, start, end - start, requested));
    }
    counts.add(start, end, 1);
    Ok(())
}

/// Counts `[start, end)` down, unlocking the pages no registration counts on any more.
fn unlock_span(counts: &mut RangeCounts, start: usize, end: usize) {
    let freed = merge(
        counts
            .pieces(start, end)
            .into_iter()
            .filter(|&(_, _, c)| c == 1),
    );
    counts.add(start, end, -1);
    for (s, e) in freed {
        // The pages may already be unmapped (the owner freed them); the kernel then
        // dropped the lock with the mapping and munlock reports ENOMEM, which is fine.
        if let Err(err) = syscall!(munlock(s as *const libc::c_void, e - s)) {
            tracing::debug!(addr = s, len = e - s, %err, "munlock failed");
        }
    }
}

fn classify(err: io::Error, addr: usize, len: usize, requested: usize) -> Error {
    let errno = err.raw_os_error();
    let limit_like = matches!(errno, Some(libc::ENOMEM | libc::EPERM | libc::EAGAIN));
    if limit_like {
        if let Ok((Some(limit), _)) = sys::memlock_limit() {
            let locked = sys::locked_bytes();
            let over = locked.unwrap_or(0) + requested as u64 > limit;
            if errno == Some(libc::EPERM) || over {
                return Error::MemlockLimit(MemlockLimit {
                    requested,
                    limit: Some(limit),
                    locked,
                });
            }
        }
    }
    Error::Pin {
        addr,
        len,
        source: err,
    }
}

/// Whether every page of `[start, end)` lies in a mapping the kernel holds locked.
#[cfg(test)]
pub(crate) fn locked(start: usize, end: usize) -> bool {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut covered = 0;
    let mut overlap = 0;
    for line in smaps.lines() {
        let range = line.split_once(' ').and_then(|(r, _)| {
            let (a, b) = r.split_once('-')?;
            Some((
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            ))
        });
        if let Some((a, b)) = range {
            overlap = b.min(end).saturating_sub(a.max(start));
        } else if let Some(flags) = line.strip_prefix("VmFlags:") {
            if flags.split_ascii_whitespace().any(|f| f == "lo") {
                covered += overlap;
            }
        }
    }
    covered >= end - start
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Memory unmapped while still counted as pinned (its registration not dropped yet)
    /// and mapped again at the same address is locked by the next registration there,
    /// and stays locked when the stale count goes.
    #[test]
    fn a_new_mapping_where_a_pinned_one_was_is_locked_again() {
        let len = 4 * sys::page_size();
        let map = |at: *mut libc::c_void, flags| {
            // SAFETY: an anonymous private mapping, at `at` only with MAP_FIXED over the
            // test's own earlier mapping, which nothing references.
            let p = unsafe {
                libc::mmap(
                    at,
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags,
                    -1,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            p
        };
        let p = map(std::ptr::null_mut(), 0);
        let a = p as usize;
        let stale = pin(a, len, Pinning::Pinned).unwrap();
        assert!(locked(a, a + len));
        // The owner maps new memory there (in one step, over the old: no other thread's
        // mapping can take the hole), before the stale pin goes.
        map(p, libc::MAP_FIXED);
        assert!(!locked(a, a + len), "a new mapping came locked");
        let fresh = pin(a, len, Pinning::Pinned).unwrap();
        assert!(locked(a, a + len), "the new mapping was not locked");
        drop(stale);
        assert!(locked(a, a + len), "the stale pin unlocked the new mapping");
        drop(fresh);
        assert!(!locked(a, a + len), "the last pin left it locked");
        // SAFETY: as above.
        assert_eq!(unsafe { libc::munmap(p, len) }, 0);
    }
}
