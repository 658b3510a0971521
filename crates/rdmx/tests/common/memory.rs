//! The process's resident memory, for tests that bound its growth, and the lock that lets
//! such a test run with no other test of its binary.
#![allow(
    dead_code,
    reason = "each test binary that includes this module uses what it needs of it"
)]

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

static RUNNING: RwLock<()> = RwLock::new(());

/// Held by a test that must run with no other test of its binary: one that measures the
/// process's resident memory (which a context another test makes meanwhile would grow),
/// or counts every datagram its receiver gets (which another test's flood, taking the
/// cores, could make the kernel drop from a full socket buffer).
pub(crate) fn alone() -> RwLockWriteGuard<'static, ()> {
    RUNNING.write().unwrap_or_else(|e| e.into_inner())
}

/// Held by the other tests of a binary where some run [`alone`]: they run side by side.
pub(crate) fn beside() -> RwLockReadGuard<'static, ()> {
    RUNNING.read().unwrap_or_else(|e| e.into_inner())
}

/// Resident memory of this process, in KiB (`VmRSS`).
pub(crate) fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}
