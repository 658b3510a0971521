//! Setup shared by the transfer engine's integration tests.
#![allow(dead_code)]

use std::net::SocketAddr;

use rdmx_transfer::{Batch, BatchHandle, Config, Engine, LocalBuf, Rail, Segment, Target};

/// 127.0.0.1, on a port the kernel picks.
pub(crate) fn local() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// `n` tcp rails and the control listener, all on local ports the kernel picks.
pub(crate) fn tcp_rails(n: usize) -> Config {
    Config::default()
        .rails((0..n).map(|_| Rail::tcp(local())).collect())
        .listen(local())
}

/// `len` bytes that differ with `seed`; they repeat every 256 bytes.
pub(crate) fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// As [`pattern`], with the index of each 4 KiB page mixed in: they repeat every MiB,
/// so a page that lands at the wrong place within one shows.
pub(crate) fn paged_pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect()
}

/// `a`'s segment of `b`, opened through `b`'s control address.
pub(crate) fn open_peer(a: &Engine, b: &Engine) -> Segment {
    a.open_segment(&b.control_addr().to_string()).unwrap()
}

/// A batch of `n` WRITEs of `len` bytes from `src` to `seg`: request `i` copies the
/// bytes at `from(i * len)` in `src` to `to(i * len)`.
pub(crate) fn writes(
    src: &LocalBuf,
    seg: &Segment,
    n: usize,
    len: usize,
    from: impl Fn(u64) -> u64,
    to: impl Fn(u64) -> Target<'static>,
) -> Batch {
    let mut b = Batch::new();
    for i in 0..n {
        let off = (i * len) as u64;
        b.write((src, from(off)), seg, to(off), len as u64).unwrap();
    }
    b
}

/// Waits until `k` of `h`'s requests have completed or the batch is done, calling
/// `pause` between looks.
pub(crate) fn wait_completed(h: &BatchHandle, k: usize, pause: impl Fn()) {
    while h.check().completed < k && !h.is_done() {
        pause();
    }
}

/// Asserts that one of `a`'s paths to its first peer is down after failures.
pub(crate) fn assert_a_path_failed(a: &Engine) {
    let paths = &a.status()[0].2;
    assert!(
        paths.iter().any(|p| !p.up && p.failures > 0),
        "no path saw the failure: {paths:?}"
    );
}
