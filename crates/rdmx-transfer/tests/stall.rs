//! A tcp rail that stalls and comes back: its packets are dropped for a while (a route
//! that black-holes them), so the engine's timeout sets its paths aside and the slices
//! in flight on them go again on the other rail; then the route is taken away and TCP
//! delivers the first attempt's bytes, late. The peer fenced its side of the path before
//! the retry was sent, so those bytes no longer land: what the application wrote into the
//! memory after the batch completed stays.
//!
//! The tests need a network namespace of their own, to change routes in: each runs
//! itself again under `unshare --net`, which takes root (CAP_SYS_ADMIN) and iproute2's
//! `ip` and `ss`. Without them a test says it is skipped, unless `RDMX_REQUIRE_NETNS` is
//! set (as in CI), when it fails.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{open_peer, pattern, writes, LateBytes};
use rdmx::Access;
use rdmx_transfer::{Config, Engine, Rail, RequestStatus, Target};

const T: Duration = Duration::from_secs(20);
const IN_NAMESPACE: &str = "RDMX_TE_IN_NETNS";

/// Runs `cmd` with `sh -c`, which must succeed.
fn sh(cmd: &str) {
    let st = Command::new("sh").args(["-c", cmd]).status().unwrap();
    assert!(st.success(), "`{cmd}` failed: {st}");
}

/// Whether every TCP stream to or from `addr` has sent all it holds (or is gone).
fn delivered(addr: &str) -> bool {
    let filter = format!("( src {addr} or dst {addr} )");
    let out = Command::new("ss")
        .args(["-tnH", "state", "connected", &filter])
        .output()
        .unwrap();
    assert!(out.status.success(), "ss failed");
    // Each line: [state] Recv-Q Send-Q local peer.
    String::from_utf8_lossy(&out.stdout).lines().all(|l| {
        let mut queues = l.split_whitespace().filter_map(|w| w.parse::<u64>().ok());
        queues.nth(1) == Some(0)
    })
}

/// Two tcp rails, the second on 127.0.0.2 (the one that stalls), the control listener on
/// `control`, and a short timeout.
fn config(control: &str) -> Config {
    Config::default()
        .rails(vec![
            Rail::tcp("127.0.0.1:0".parse().unwrap()),
            Rail::tcp("127.0.0.2:0".parse().unwrap()),
        ])
        .listen(format!("{control}:0").parse().unwrap())
        .connect_timeout(Duration::from_secs(1))
        .qps_per_rail(1)
        .timeout(Duration::from_secs(1))
        .set_aside(Duration::from_secs(60))
}

/// Whether the caller runs in a network namespace of its own: if not, runs test `name`
/// again in a new one (`unshare --net`), checks that it passed there, and returns false.
fn in_own_namespace(name: &str) -> bool {
    if std::env::var_os(IN_NAMESPACE).is_some() {
        sh("ip link set lo up");
        return true;
    }
    let can = Command::new("unshare")
        .args(["--net", "sh", "-c", "command -v ip && command -v ss"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !can {
        let why = "a network namespace of its own (unshare --net: root) with ip and ss";
        assert!(
            std::env::var_os("RDMX_REQUIRE_NETNS").is_none(),
            "the test needs {why}"
        );
        eprintln!("skipped: the test needs {why}");
        return false;
    }
    let st = Command::new("unshare")
        .arg("--net")
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture"])
        .env(IN_NAMESPACE, "1")
        .status()
        .unwrap();
    assert!(st.success(), "the test failed in its namespace: {st}");
    false
}

/// Drops every packet to or from each of `addrs` (either side of a stream may have
/// dialed) until [`restore`].
fn black_hole(addrs: &[&str]) {
    sh("ip rule del pref 0 lookup local && ip rule add pref 100 lookup local");
    for (i, a) in addrs.iter().enumerate() {
        let pref = 50 + 2 * i;
        sh(&format!(
            "ip rule add pref {pref} to {a} blackhole && ip rule add pref {} from {a} blackhole",
            pref + 1
        ));
    }
}

/// Takes [`black_hole`]'s rules away.
fn restore(n: usize) {
    for pref in 50..50 + 2 * n {
        sh(&format!("ip rule del pref {pref}"));
    }
}

#[test]
fn a_stalled_rail_s_late_bytes_do_not_overwrite_what_came_after() {
    if !in_own_namespace("a_stalled_rail_s_late_bytes_do_not_overwrite_what_came_after") {
        return;
    }
    let a = Engine::new("a", config("127.0.0.1")).unwrap();
    let b = Engine::new("b", config("127.0.0.1")).unwrap();
    let t = LateBytes::new(&a, &b, 32, 256 << 10);
    // Rail 1 stalls: everything sent to or from its listeners is dropped.
    black_hole(&["127.0.0.2"]);
    let after = t.second_batch_then_overwrite(&a);
    // The rail comes back: TCP delivers what it held of the first attempt.
    restore(1);
    let start = Instant::now();
    while !delivered("127.0.0.2") {
        assert!(
            start.elapsed() < T,
            "the stalled rail's bytes were never delivered"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    t.assert_holds(&after);
}

/// A peer that cannot confirm the fence (its control listener is cut off too): what was
/// in flight on the stalled rail is not sent again, and fails saying why; the rest of
/// the batch completes on the other rail.
#[test]
fn in_flight_work_the_peer_cannot_fence_fails() {
    if !in_own_namespace("in_flight_work_the_peer_cannot_fence_fails") {
        return;
    }
    let a = Engine::new("a", config("127.0.0.1")).unwrap();
    let b = Engine::new("b", config("127.0.0.3")).unwrap();
    // One slice per request (64 KiB on tcp): a request fails only with its own slice.
    let (n, len) = (128, 64 << 10);
    let src = a
        .register("src", pattern(1, n * len), Access::LOCAL_WRITE)
        .unwrap();
    b.register("dst", n * len, Access::REMOTE_WRITE).unwrap();
    let seg = open_peer(&a, &b);
    let batch = || writes(&src, &seg, n, len, |o| o, Target::Offset);
    assert!(a.submit(batch()).wait(T).unwrap().is_success());
    black_hole(&["127.0.0.2", "127.0.0.3"]);
    let h = a.submit(batch());
    let st = h.wait(T).unwrap();
    restore(2);
    assert!(st.failed > 0 && st.completed > 0, "{st:?}");
    for i in 0..n {
        match h.status(i).unwrap() {
            RequestStatus::Completed { .. } => {}
            RequestStatus::Failed(f) => assert!(
                f.reason.contains("did not confirm") && f.path.contains("rail 1"),
                "{f}"
            ),
            s => panic!("request {i} is {s:?}"),
        }
    }
}
