//! An idle context costs no CPU: once its queue pairs have nothing to do and nobody polls,
//! the provider's progress threads sleep until a peer, a socket or a timer wakes them
//! (loopback's and udp's also every 50 ms, tcp's and shm's every 100 ms, to look at
//! their timers).
//!
//! Each software provider gets a connected pair of queue pairs (each side its own
//! context, as two processes would have), moves a SEND and a WRITE, and is then left
//! alone for a second. Two things are read meanwhile:
//!
//! - on shm, how many progress rounds its drivers run (`rdmx::shm::testing`): a thread
//!   that wakes up and finds nothing to do goes back to sleep within one batch of rounds
//!   (64), where one that spins for a while after each wake-up runs thousands;
//! - on every provider, the CPU time of each `rdmx-*` thread of this process, from the
//!   kernel's per-thread CPU clock: a thread that sleeps between wake-ups costs a few
//!   milliseconds in the second at most (more on a host whose hypervisor takes the CPU
//!   away from it), one that polls without sleeping, hundreds.
//!
//! And a connection manager's listener waiting for a peer sleeps in the kernel until one
//! connects or its deadline passes: the waiting thread's voluntary context switches are
//! counted (one per sleep).

mod common;

use std::time::{Duration, Instant};

use rdmx::{
    Access, CompletionQueue, ConnectOptions, Context, LocalSge, QpCaps, RecvRequest, RemoteAddr,
    SendRequest, WcStatus,
};

/// What each provider thread of this process may spend over the quiet second: 5% of a
/// core. (Measured in a debug build: 0.5 to 9 ms, the most on a host busy with other
/// work.)
const ALLOWED: Duration = Duration::from_millis(50);
/// Rounds an shm driver runs after a wake-up that finds nothing, before it sleeps again.
const ROUNDS_PER_WAKE: u32 = 64;
/// How long the threads may take to settle after the last work (spin windows, the
/// handover after the last poll), before the measured second starts.
const SETTLE: Duration = Duration::from_millis(300);

/// The CPU time each of this process's threads named `rdmx-*` has used so far, and how
/// often it has slept (its voluntary context switches).
fn provider_threads_cpu() -> Vec<(String, i32, Duration, u64)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc/self/task").expect("/proc/self/task") {
        let entry = entry.expect("task entry");
        let Ok(tid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(name) = std::fs::read_to_string(entry.path().join("comm")) else {
            continue; // gone meanwhile
        };
        let name = name.trim().to_string();
        if !name.starts_with("rdmx-") {
            continue;
        }
        // The kernel's per-thread CPU clock (as `pthread_getcpuclockid` makes it):
        // `~tid << 3 | CPUCLOCK_PERTHREAD_MASK | CPUCLOCK_SCHED`.
        let clock = (!(tid as libc::clockid_t) << 3) | 6;
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec into `ts`; an invalid clock (the
        // thread exited) is an error return, not undefined behaviour.
        if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
            continue;
        }
        let cpu = Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32);
        let sleeps = std::fs::read_to_string(entry.path().join("status"))
            .ok()
            .and_then(|st| sleeps_in(&st))
            .unwrap_or(0);
        out.push((name, tid, cpu, sleeps));
    }
    out
}

/// The voluntary context switches (sleeps) a thread's `/proc/.../status` names.
fn sleeps_in(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .and_then(|n| n.trim().parse().ok())
}

fn open_udp() -> rdmx::Result<Context> {
    common::open_udp(9)
}

fn poll_ok(cq: &CompletionQueue, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(c) = cq.poll_one().unwrap() {
            assert_eq!(c.status, WcStatus::Success, "{what}: {c:?}");
            return;
        }
        assert!(Instant::now() < deadline, "no completion for {what}");
    }
}

/// How a test opens a context.
type Open = fn() -> rdmx::Result<Context>;

/// What the provider threads did over the quiet second.
struct Quiet {
    /// Each `rdmx-*` thread: its name, how often it slept, the CPU time it used.
    threads: Vec<(String, u64, Duration)>,
    /// Progress rounds both contexts' drivers ran (shm only).
    rounds: Option<u32>,
}

/// Two contexts from `open`, a connected pair of queue pairs between them that has
/// moved a SEND and a WRITE; then what the provider threads do over a quiet second.
fn idle_cost(open: Open) -> Quiet {
    let (ca, cb) = (open().unwrap(), open().unwrap());
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let (qa, qb) = (ca.create_cq(16).unwrap(), cb.create_cq(16).unwrap());
    let a = pa.create_qp(&qa, &qa, QpCaps::default()).unwrap();
    let b = pb.create_qp(&qb, &qb, QpCaps::default()).unwrap();
    let opts = ConnectOptions::default();
    a.connect(b.endpoint(), &opts).unwrap();
    b.connect(a.endpoint(), &opts).unwrap();
    let rw = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let ma = pa.register(vec![7u8; 4096], rw).unwrap();
    let mb = pb.register(vec![0u8; 8192], rw).unwrap();
    b.post_recv(RecvRequest::new(1).sge(LocalSge::new(&mb, 0, 4096).unwrap()))
        .unwrap();
    a.post_send(SendRequest::send(2).sge(LocalSge::new(&ma, 0, 4096).unwrap()))
        .unwrap();
    poll_ok(&qa, "the SEND");
    poll_ok(&qb, "the receive");
    let remote = RemoteAddr {
        addr: mb.addr() as u64 + 4096,
        rkey: mb.rkey(),
    };
    a.post_send(SendRequest::write(3, remote).sge(LocalSge::new(&ma, 0, 4096).unwrap()))
        .unwrap();
    poll_ok(&qa, "the WRITE");

    let rounds = || {
        let (ra, rb) = (
            rdmx::shm::testing::progress_rounds(&ca),
            rdmx::shm::testing::progress_rounds(&cb),
        );
        Some(ra?.wrapping_add(rb?))
    };
    std::thread::sleep(SETTLE);
    let (before, r0) = (provider_threads_cpu(), rounds());
    std::thread::sleep(Duration::from_secs(1));
    let (after, r1) = (provider_threads_cpu(), rounds());
    let threads = after
        .iter()
        .map(|(name, tid, cpu, sleeps)| {
            let (c0, s0) = before
                .iter()
                .find(|b| b.1 == *tid)
                .map_or((Duration::ZERO, 0), |b| (b.2, b.3));
            (
                format!("{name} ({tid})"),
                sleeps.saturating_sub(s0),
                cpu.saturating_sub(c0),
            )
        })
        .collect();
    // The pair stays connected (and idle) through the measurement.
    assert_eq!(a.state(), rdmx::QpState::Rts);
    assert_eq!(b.state(), rdmx::QpState::Rts);
    Quiet {
        threads,
        rounds: r0.zip(r1).map(|(r0, r1)| r1.wrapping_sub(r0)),
    }
}

/// One test for every provider, one after the other: the process's provider threads are
/// all measured at once, so no other test in this binary may open a context.
#[test]
fn idle_contexts_cost_no_cpu() {
    let providers: [(&str, Open); 4] = [
        ("loopback", Context::open_default),
        ("tcp", || Context::open_provider("tcp")),
        ("shm", || Context::open_provider("shm")),
        ("udp", open_udp),
    ];
    let mut failed = Vec::new();
    for (name, open) in providers {
        let quiet = idle_cost(open);
        eprintln!(
            "{name}: over a quiet second, (thread, sleeps, CPU time): {:?}; shm rounds: {:?}",
            quiet.threads, quiet.rounds
        );
        failed.extend(
            quiet
                .threads
                .iter()
                .filter(|t| t.2 > ALLOWED)
                .map(|(thread, _, cpu)| format!("{thread} after {name}: {cpu:?} of CPU")),
        );
        if let Some(rounds) = quiet.rounds {
            // Each shm thread's wake-ups (and the one it was in when the second began).
            let wakes: u64 = quiet
                .threads
                .iter()
                .filter(|t| t.0.starts_with("rdmx-shm"))
                .map(|t| t.1 + 1)
                .sum();
            let most = ROUNDS_PER_WAKE as u64 * (wakes + 2);
            if u64::from(rounds) > most {
                failed.push(format!(
                    "{name}: {rounds} progress rounds for {wakes} wake-ups (at most {most})"
                ));
            }
        }
    }
    assert!(
        failed.is_empty(),
        "provider threads ran while idle: {failed:?}"
    );
}

/// How often the calling thread has slept so far (its voluntary context switches).
fn own_sleeps() -> u64 {
    let status =
        std::fs::read_to_string("/proc/thread-self/status").expect("/proc/thread-self/status");
    sleeps_in(&status).expect("voluntary_ctxt_switches")
}

#[test]
fn a_listener_waiting_for_a_peer_sleeps_until_its_deadline() {
    let listener = rdmx::cm::Listener::bind("127.0.0.1:0").unwrap();
    let wait = Duration::from_millis(500);
    let (before, start) = (own_sleeps(), Instant::now());
    let got = listener.accept(&[], &ConnectOptions::default(), &[], wait);
    let (slept, took) = (own_sleeps() - before, start.elapsed());
    assert!(
        matches!(got, Err(rdmx::Error::Timeout(_))),
        "no peer, so a timeout: {got:?}"
    );
    assert!(took >= wait, "returned after {took:?}, before its deadline");
    // One sleep in poll(2), a few more for a signal or the scheduler; a thread that looks
    // every millisecond sleeps some 500 times.
    assert!(slept < 50, "slept {slept} times in {took:?} of waiting");
}
