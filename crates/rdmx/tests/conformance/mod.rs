//! The provider conformance suite: one set of tests, written once against the rdmx facade,
//! run unchanged on every provider.
//!
//! # Instantiating it for a provider
//!
//! A provider is described by one [`Provider`] value (how to open a context on it, and the
//! path MTU to connect with). A test file per provider declares this module and expands
//! [`conformance_suite!`] inside a module whose name contains `conformance` and the
//! provider's name, so every generated test is named e.g.
//! `conformance_loopback::send_sizes_and_sges`:
//!
//! ```ignore
//! #[macro_use]
//! mod conformance;
//!
//! mod conformance_tcp {
//!     const TCP: crate::conformance::Provider = crate::conformance::Provider {
//!         name: "tcp",
//!         open: || rdmx::Context::open_provider("tcp"),
//!         mtu: rdmx::Mtu::Bytes(65536),
//!     };
//!     conformance_suite!(TCP);
//! }
//! ```
//!
//! # Rules the tests follow
//!
//! - Every behaviour is checked with data: bytes that must change are compared with what
//!   was sent, bytes that must not change are compared byte for byte with what was there.
//! - Nothing is timed. Waits for completions poll with a generous deadline
//!   ([`DEADLINE`]) and fail with a message naming what was awaited. Where a test needs
//!   "nothing happens", it checks it in a way that does not depend on timing (completions
//!   are delivered in order, so once a later one has been reaped an earlier one cannot
//!   still come), except for the short quiet spells of [`assert_quiet`], which can only
//!   fail on a wrong implementation.
//! - Each side of a connection gets its own context, as two processes or two hosts would.
//! - Progress may happen inside verb calls or in the background; the suite only polls, and
//!   where requests must be outstanding together it queues them behind a SEND that waits
//!   for a receive (RNR), so they are outstanding whatever the provider's progress model.

use std::os::fd::AsRawFd;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdmx::{
    Access, Capabilities, Completion, CompletionQueue, ConnectOptions, Context, LocalSge, Mapping,
    MemoryRegion, Mtu, ProtectionDomain, QpCaps, QpState, QueuePair, RemoteAddr, Transport,
    WcOpcode, WcStatus,
};

pub(crate) mod atomics;
pub(crate) mod data;
pub(crate) mod errors;
pub(crate) mod flow;
pub(crate) mod srq;
pub(crate) mod states;
pub(crate) mod unreliable;

/// Expands to one `#[test]` per conformance test, each running it on `$provider` (an
/// expression of type [`Provider`], e.g. a `const`).
macro_rules! conformance_suite {
    ($provider:expr) => {
        conformance_suite!(@tests $provider;
            data::send_sizes_and_sges,
            data::send_with_imm_sizes_and_sges,
            data::write_sizes_and_sges,
            data::write_with_imm_sizes_and_sges,
            data::read_sizes_and_sges,
            atomics::compare_swap_values,
            atomics::fetch_add_values,
            data::inline_send_and_write,
            data::write_then_send_ordering,
            data::fence_after_read_and_atomic,
            data::immediate_data,
            data::writes_both_ways_at_once,
            atomics::concurrent_fetch_add_from_qps_and_cpu,
            flow::selective_signaling,
            flow::send_queue_full,
            flow::post_list_stops_at_the_first_refused,
            flow::recv_queue_full,
            flow::cq_overrun,
            flow::rnr_then_success,
            flow::rnr_retries_exhausted,
            flow::notify_any_completion,
            flow::notify_solicited_only,
            flow::wait_event_blocks_until_a_completion,
            flow::two_threads_polling_one_cq,
            flow::two_threads_waiting_on_one_cq,
            flow::a_new_queue_pair_gets_no_completion_of_a_destroyed_one,
            errors::invalid_rkey,
            errors::out_of_bounds,
            errors::region_without_remote_access,
            errors::qp_without_remote_access,
            errors::wrong_pd,
            errors::misaligned_atomic,
            states::post_in_wrong_state,
            states::error_flushes_outstanding,
            errors::deregistered_keys,
            errors::send_longer_than_receive,
            errors::inline_flag_with_a_stale_element,
            srq::shared_receive_queue,
            srq::a_destroyed_qp_leaves_its_srq_receives_room,
            unreliable::ud_datagrams_to_several_qps,
            unreliable::ud_qkey_mismatch,
            unreliable::ud_oversize_refused,
            unreliable::refused_opcodes,
            unreliable::ud_multicast,
            unreliable::ud_unordered_delivery,
            unreliable::uc_send_and_write,
            unreliable::uc_messages_span_more_than_a_send_window,
            unreliable::ud_with_a_shared_receive_queue,
            unreliable::receives_in_error_fail_ud_and_uc_qps,
            unreliable::srq_limit_counts_consumed_receives_only,
        );
    };
    (@tests $p:expr; $($topic:ident :: $test:ident),* $(,)?) => {
        $(
            #[test]
            fn $test() {
                crate::conformance::$topic::$test(&$p)
            }
        )*
    };
}

/// What the suite needs to know about a provider: the one provider-specific part.
pub(crate) struct Provider {
    /// Short name, used in failure messages.
    pub(crate) name: &'static str,
    /// Opens a context on the provider. Called once for each side of every connection.
    pub(crate) open: fn() -> rdmx::Result<Context>,
    /// The path MTU connections use; message sizes are chosen around it.
    pub(crate) mtu: Mtu,
}

/// How long any wait for a completion or an event may take before the test fails.
pub(crate) const DEADLINE: Duration = Duration::from_secs(10);

/// How long [`assert_quiet`] watches a queue.
const QUIET: Duration = Duration::from_millis(20);

/// Every access a region can grant.
pub(crate) const ALL: Access = Access::ALL;

/// Local write only: for buffers that receive or are READ/atomic targets locally.
pub(crate) const LOCAL: Access = Access::LOCAL_WRITE;

impl Provider {
    /// Opens a context, failing the test with the provider's error, and checks it is the
    /// provider asked for and supports the MTU the suite connects with.
    pub(crate) fn open(&self) -> Context {
        let ctx = (self.open)().unwrap_or_else(|e| panic!("{}: open a context: {e}", self.name));
        assert_eq!(ctx.provider(), self.name, "the context's provider");
        assert!(
            ctx.capabilities().max_mtu >= self.mtu,
            "{}: the device's max MTU {:?} is below the suite's {:?}",
            self.name,
            ctx.capabilities().max_mtu,
            self.mtu
        );
        ctx
    }

    /// The path MTU in bytes.
    pub(crate) fn mtu_bytes(&self) -> usize {
        self.mtu.bytes() as usize
    }

    /// The default connection options, at this provider's MTU.
    pub(crate) fn options(&self) -> ConnectOptions {
        let mut o = ConnectOptions::default();
        o.mtu = Some(self.mtu);
        o
    }

    /// The default configuration of one side of a connection.
    pub(crate) fn config(&self) -> SideConfig {
        SideConfig {
            caps: QpCaps::default(),
            send_cq: 256,
            recv_cq: 256,
            opts: self.options(),
        }
    }

    /// A queue pair in RESET with its own CQs, in `pd`.
    pub(crate) fn side_in(&self, pd: &ProtectionDomain, cfg: &SideConfig) -> Side {
        let ctx = pd.context();
        let scq = ctx
            .create_cq(cfg.send_cq)
            .unwrap_or_else(|e| panic!("{}: create a send CQ: {e}", self.name));
        let rcq = ctx
            .create_cq(cfg.recv_cq)
            .unwrap_or_else(|e| panic!("{}: create a receive CQ: {e}", self.name));
        // Inline data up to what the device takes (soft-iWARP: well below the default).
        let caps = cfg.caps.max_inline_data(
            cfg.caps
                .max_inline_data
                .min(ctx.capabilities().max_inline_data as usize),
        );
        let qp = pd
            .create_qp(&scq, &rcq, caps)
            .unwrap_or_else(|e| panic!("{}: create a QP: {e}", self.name));
        assert_eq!(
            qp.state(),
            QpState::Reset,
            "{}: a new QP is in RESET",
            self.name
        );
        Side {
            pd: pd.clone(),
            scq,
            rcq,
            qp,
        }
    }

    /// A queue pair in RESET in a new context of its own.
    pub(crate) fn side(&self, cfg: &SideConfig) -> Side {
        self.side_in(&self.open().alloc_pd(), cfg)
    }

    /// Connects `a` and `b` to each other, each with its own options, and checks both are
    /// in RTS at the provider's MTU.
    pub(crate) fn connect(
        &self,
        a: &Side,
        a_opts: &ConnectOptions,
        b: &Side,
        b_opts: &ConnectOptions,
    ) {
        self.connect_qps(&a.qp, a_opts, &b.qp, b_opts);
        for (name, s, o) in [("A", a, a_opts), ("B", b, b_opts)] {
            assert_eq!(
                s.qp.state(),
                QpState::Rts,
                "{}: {name} connected",
                self.name
            );
            assert_eq!(
                Some(s.qp.attrs().path_mtu),
                o.mtu,
                "{}: {name}'s path MTU",
                self.name
            );
        }
    }

    /// Connects two queue pairs in RESET: by exchanging endpoints, or, on a device that
    /// connects only through rdma_cm (iWARP), `b` accepting on the device's IPv4 address
    /// and `a` connecting to it.
    pub(crate) fn connect_qps(
        &self,
        a: &QueuePair,
        a_opts: &ConnectOptions,
        b: &QueuePair,
        b_opts: &ConnectOptions,
    ) {
        let ctx = a.pd().context();
        if ctx.capabilities().transport != Transport::Iwarp {
            a.connect(b.endpoint(), a_opts)
                .unwrap_or_else(|e| panic!("{}: connect A to B: {e}", self.name));
            b.connect(a.endpoint(), b_opts)
                .unwrap_or_else(|e| panic!("{}: connect B to A: {e}", self.name));
            return;
        }
        use rdmx::verbs::cm;
        let ip = rdma_cm_ip(ctx);
        let listener = cm::Listener::bind((ip, 0))
            .unwrap_or_else(|e| panic!("{}: rdma_cm listen on {ip}: {e}", self.name));
        let addr = listener.local_addr().expect("the listener's address");
        std::thread::scope(|s| {
            let accepted =
                s.spawn(|| listener.accept(std::slice::from_ref(b), b_opts, b"", DEADLINE));
            cm::connect(addr, std::slice::from_ref(a), a_opts, b"", DEADLINE)
                .unwrap_or_else(|e| panic!("{}: rdma_cm connect A to B: {e}", self.name));
            accepted
                .join()
                .expect("the accepting thread")
                .unwrap_or_else(|e| panic!("{}: rdma_cm accept B: {e}", self.name));
        });
    }

    /// Two connected queue pairs with the default configuration, in two contexts.
    pub(crate) fn pair(&self) -> Pair {
        self.pair_with(self.config(), self.config())
    }

    /// Two connected queue pairs, `a` and `b` configured as given, in two contexts.
    pub(crate) fn pair_with(&self, a: SideConfig, b: SideConfig) -> Pair {
        let pair = Pair {
            a: self.side(&a),
            b: self.side(&b),
        };
        self.connect(&pair.a, &a.opts, &pair.b, &b.opts);
        pair
    }
}

/// How one side of a connection is set up.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SideConfig {
    /// Queue sizes.
    pub(crate) caps: QpCaps,
    /// Send CQ capacity.
    pub(crate) send_cq: usize,
    /// Receive CQ capacity.
    pub(crate) recv_cq: usize,
    /// Options this side connects with.
    pub(crate) opts: ConnectOptions,
}

/// One side of a connection: a QP with a send CQ and a receive CQ of its own.
pub(crate) struct Side {
    pub(crate) pd: ProtectionDomain,
    pub(crate) scq: CompletionQueue,
    pub(crate) rcq: CompletionQueue,
    pub(crate) qp: QueuePair,
}

impl Side {
    /// The capabilities of the side's device.
    pub(crate) fn caps(&self) -> Capabilities {
        self.pd.context().capabilities().clone()
    }
}

/// The IPv4 address rdma_cm reaches `ctx`'s device at: `RDMX_VERBS_IP` or `RXE_IP` (the
/// Soft-RoCE/soft-iWARP VM of `scripts/rxe-test.sh` sets it), else the address the
/// device's GID maps.
fn rdma_cm_ip(ctx: &Context) -> std::net::Ipv4Addr {
    std::env::var("RDMX_VERBS_IP")
        .or_else(|_| std::env::var("RXE_IP"))
        .ok()
        .and_then(|s| s.parse().ok())
        .or_else(|| {
            rdmx::devices()
                .into_iter()
                .find(|d| d.name == ctx.device_name())
                .and_then(|d| d.gid)
                .and_then(|(_, g)| g.to_ipv4_mapped())
        })
        .unwrap_or_else(|| {
            panic!(
                "{} connects through rdma_cm, but has no IPv4 address (set RDMX_VERBS_IP)",
                ctx.device_name()
            )
        })
}

/// Returns true (after saying why) when the provider lacks what a test needs, as its
/// [`Capabilities`] report; the test then returns without checking anything.
pub(crate) fn lacks(p: &Provider, what: &str, has: impl FnOnce(&Capabilities) -> bool) -> bool {
    let ctx = p.open();
    if has(ctx.capabilities()) {
        return false;
    }
    eprintln!(
        "skipped: {} ({}) has no {what}, by its capabilities",
        p.name,
        ctx.device_name()
    );
    true
}

/// Two connected sides: `a` is the requester in most tests, `b` the responder.
pub(crate) struct Pair {
    pub(crate) a: Side,
    pub(crate) b: Side,
}

// ---- memory ----------------------------------------------------------------------------

/// Serialises the tests that register megabytes, so the suite stays within a small
/// `RLIMIT_MEMLOCK` (8 MiB is common) however many tests run at once.
pub(crate) fn big_memory() -> MutexGuard<'static, ()> {
    static BIG: Mutex<()> = Mutex::new(());
    BIG.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Registers `len` zeroed heap bytes (no particular alignment).
pub(crate) fn register(pd: &ProtectionDomain, len: usize, access: Access) -> MemoryRegion {
    if len > 0 && SHARED_MEMORY.load(std::sync::atomic::Ordering::Relaxed) {
        return register_page(pd, len, access);
    }
    pd.register(vec![0u8; len], access)
        .unwrap_or_else(|e| panic!("register {len} bytes with {access:?}: {e}"))
}

/// Set by a suite whose provider maps peers' memory: [`register`] and [`register_page`]
/// then register memfd-backed mappings ([`Mapping::shared`]) instead of plain memory.
pub(crate) static SHARED_MEMORY: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Registers a page-aligned mapping of `len` bytes (for atomics and exact bounds).
pub(crate) fn register_page(pd: &ProtectionDomain, len: usize, access: Access) -> MemoryRegion {
    let m = if SHARED_MEMORY.load(std::sync::atomic::Ordering::Relaxed) {
        Mapping::shared(len)
    } else {
        Mapping::new(len)
    };
    let m = m.unwrap_or_else(|e| panic!("map {len} bytes: {e}"));
    pd.register(m, access)
        .unwrap_or_else(|e| panic!("register a {len}-byte mapping with {access:?}: {e}"))
}

/// `len` bytes at `off` in `mr`, as a local element.
pub(crate) fn sge(mr: &MemoryRegion, off: usize, len: usize) -> LocalSge {
    LocalSge::new(mr, off, len).unwrap_or_else(|e| {
        panic!(
            "SGE of {len} bytes at {off} in a {}-byte region: {e}",
            mr.len()
        )
    })
}

/// The remote address of byte `off` of `mr`.
pub(crate) fn raddr(mr: &MemoryRegion, off: usize) -> RemoteAddr {
    RemoteAddr {
        addr: mr.addr() as u64 + off as u64,
        rkey: mr.rkey(),
    }
}

/// Deterministic pseudo-random bytes; different seeds give different bytes.
pub(crate) fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xd1b5_4a32_d192_ed03;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Fills all of `mr` with `pattern(seed)` and returns what it now holds.
pub(crate) fn fill(mr: &MemoryRegion, seed: u64) -> Vec<u8> {
    let bytes = pattern(seed, mr.len());
    mr.write_at(0, &bytes).expect("write a whole region");
    bytes
}

/// All bytes of `mr`.
pub(crate) fn image(mr: &MemoryRegion) -> Vec<u8> {
    let mut out = vec![0u8; mr.len()];
    mr.read_at(0, &mut out).expect("read a whole region");
    out
}

/// The native-endian `u64` at `off` of a byte image.
pub(crate) fn u64_at(bytes: &[u8], off: usize) -> u64 {
    u64::from_ne_bytes(bytes[off..off + 8].try_into().expect("8 bytes"))
}

/// Compares two byte strings and names the first difference instead of printing them.
#[track_caller]
pub(crate) fn assert_bytes(actual: &[u8], expected: &[u8], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths differ");
    if let Some(i) = actual.iter().zip(expected).position(|(a, e)| a != e) {
        let diffs = actual.iter().zip(expected).filter(|(a, e)| a != e).count();
        let end = (i + 16).min(actual.len());
        panic!(
            "{what}: {diffs} byte(s) differ, first at offset {i}: got {:02x?}, expected {:02x?}",
            &actual[i..end],
            &expected[i..end]
        );
    }
}

// ---- completions ---------------------------------------------------------------------

/// Waits for the next completion on `cq`.
#[track_caller]
pub(crate) fn wait_one(cq: &CompletionQueue, what: &str) -> Completion {
    wait_n(cq, 1, what).pop().expect("one completion")
}

/// Waits for the next `n` completions on `cq`, in order.
#[track_caller]
pub(crate) fn wait_n(cq: &CompletionQueue, n: usize, what: &str) -> Vec<Completion> {
    let start = Instant::now();
    let mut got = Vec::with_capacity(n);
    while got.len() < n {
        match cq.poll_one() {
            Ok(Some(c)) => got.push(c),
            Ok(None) => {
                assert!(
                    start.elapsed() < DEADLINE,
                    "{what}: waited {DEADLINE:?} for {n} completion(s), got {}: {got:?}",
                    got.len()
                );
                std::thread::yield_now();
            }
            Err(e) => panic!("{what}: polling the CQ failed after {got:?}: {e}"),
        }
    }
    got
}

/// Fails if `cq` holds a completion now.
#[track_caller]
pub(crate) fn assert_drained(cq: &CompletionQueue, what: &str) {
    match cq.poll_one() {
        Ok(None) => {}
        Ok(Some(c)) => panic!("{what}: unexpected completion {c:?}"),
        Err(e) => panic!("{what}: polling the CQ failed: {e}"),
    }
}

/// Polls `cq` for a short spell and fails if any completion arrives. Used only where a
/// correct provider can never produce one (a request that is waiting for the peer).
#[track_caller]
pub(crate) fn assert_quiet(cq: &CompletionQueue, what: &str) {
    let start = Instant::now();
    while start.elapsed() < QUIET {
        assert_drained(cq, what);
        std::thread::yield_now();
    }
}

/// Checks a successful completion of `wr_id` with `opcode` on QP `qp_num`.
#[track_caller]
pub(crate) fn check_ok(c: &Completion, wr_id: u64, opcode: WcOpcode, qp_num: u32, what: &str) {
    assert_eq!(
        (c.wr_id, c.status, c.opcode, c.qp_num),
        (wr_id, WcStatus::Success, opcode, qp_num),
        "{what}: completion {c:?}"
    );
}

/// Checks the status of a completion of `wr_id` on QP `qp_num` (the opcode of an error
/// completion is undefined in verbs, so it is not checked).
#[track_caller]
pub(crate) fn check_status(c: &Completion, wr_id: u64, status: WcStatus, qp_num: u32, what: &str) {
    assert_eq!(
        (c.wr_id, c.status, c.qp_num),
        (wr_id, status, qp_num),
        "{what}: completion {c:?}"
    );
}

/// Waits until the CQ's notification descriptor is readable.
#[track_caller]
pub(crate) fn wait_readable(cq: &CompletionQueue, what: &str) {
    let start = Instant::now();
    loop {
        let mut pfd = libc::pollfd {
            fd: cq.fd().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, 10) };
        assert!(
            n >= 0,
            "{what}: poll(2) failed: {}",
            std::io::Error::last_os_error()
        );
        if n == 1 && pfd.revents & libc::POLLIN != 0 {
            return;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "{what}: the CQ's descriptor did not become readable within {DEADLINE:?}"
        );
        // Lets providers that progress inside verbs move; consumes nothing.
        let _ = cq.poll(&mut []);
    }
}
