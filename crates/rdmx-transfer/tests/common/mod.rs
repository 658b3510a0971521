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

/// Whether one of `a`'s paths to its first peer is down after failures.
pub(crate) fn a_path_failed(a: &Engine) -> bool {
    a.status()[0].2.iter().any(|p| !p.up && p.failures > 0)
}

/// Asserts that one of `a`'s paths to its first peer is down after failures.
pub(crate) fn assert_a_path_failed(a: &Engine) {
    assert!(
        a_path_failed(a),
        "no path saw the failure: {:?}",
        a.status()[0].2
    );
}

/// Runs `try_once`, one try of a test that breaks something while a batch is under way
/// (on engines of its own), until a try gets the fault in before the batch is over: it
/// returns `false` when the whole batch landed first, which a test thread held off for
/// some tens of milliseconds on a busy machine lets happen. `what` says what was to
/// happen mid-batch; five lost races in a row fail the test.
pub(crate) fn mid_batch(what: &str, mut try_once: impl FnMut() -> bool) {
    for _ in 0..5 {
        if try_once() {
            return;
        }
        eprintln!("the batch finished before {what}: trying again");
    }
    panic!("the batch finished before {what}, five times in a row");
}

/// A stalled path's late bytes (the stall tests): `a`'s segment of `b` over two paths,
/// `a`'s sources (patterns 1 and 2) and `b`'s destination, `n` slices of `len` bytes.
pub(crate) struct LateBytes {
    pub(crate) seg: Segment,
    pub(crate) dst: LocalBuf,
    src: [LocalBuf; 2],
    n: usize,
    len: usize,
}

/// How long a stall test waits for a batch.
const STALL_WAIT: std::time::Duration = std::time::Duration::from_secs(20);

impl LateBytes {
    /// Sets up and sends a first batch, from source 1: both paths are up after it.
    pub(crate) fn new(a: &Engine, b: &Engine, n: usize, len: usize) -> LateBytes {
        let reg = |name, seed| {
            a.register(name, pattern(seed, n * len), rdmx::Access::LOCAL_WRITE)
                .unwrap()
        };
        let src = [reg("src", 1), reg("src2", 2)];
        let dst = b
            .register("dst", n * len, rdmx::Access::REMOTE_WRITE)
            .unwrap();
        let t = LateBytes {
            seg: open_peer(a, b),
            dst,
            src,
            n,
            len,
        };
        let st = a.submit(t.batch(0)).wait(STALL_WAIT).unwrap();
        assert!(st.is_success(), "{st:?}");
        let paths = t.seg.paths();
        assert!(
            paths.len() == 2 && paths.iter().all(|p| p.up && p.failures == 0),
            "{paths:?}"
        );
        t
    }

    /// The whole of source `i` to the destination.
    fn batch(&self, i: usize) -> Batch {
        let len = self.len;
        writes(&self.src[i], &self.seg, self.n, len, |o| o, Target::Offset)
    }

    /// With a path stalled: a batch from source 2, which completes once the stalled path
    /// failed and its slices went on the other; then the application writes something
    /// else into the destination, which it returns.
    pub(crate) fn second_batch_then_overwrite(&self, a: &Engine) -> Vec<u8> {
        let st = a.submit(self.batch(1)).wait(STALL_WAIT).unwrap();
        assert!(st.is_success(), "{st:?}");
        let paths = self.seg.paths();
        assert!(
            paths.iter().any(|p| !p.up && p.failures > 0),
            "the stalled path never failed: {paths:?}"
        );
        let mut got = vec![0u8; self.n * self.len];
        self.dst.read(0, &mut got).unwrap();
        assert!(got == pattern(2, got.len()), "the batch's bytes differ");
        let after = pattern(200, got.len());
        self.dst.write(0, &after).unwrap();
        after
    }

    /// Asserts that the destination still holds `after`: no late byte landed.
    pub(crate) fn assert_holds(&self, after: &[u8]) {
        let mut got = vec![0u8; after.len()];
        self.dst.read(0, &mut got).unwrap();
        let first = got.iter().zip(after).position(|(g, w)| g != w);
        assert!(
            first.is_none(),
            "the first attempt's bytes landed after the batch completed, from byte {first:?}"
        );
    }
}
