//! Two shm rails, one of whose queue pairs stops reading its ring for a while (its
//! progress stalled), then reads it again, while the other rail carries on.
//!
//! The tests run the shm rails on the ring data path (as between two processes): each
//! sets `RDMX_SHM_DATA_PATH=ring` (the same value) before it opens any context, and no
//! other test of this binary opens one.

mod common;

use std::time::Duration;

use common::{open_peer, pattern, writes, LateBytes};
use rdmx::Access;
use rdmx_transfer::{Config, Engine, PathStatus, Rail, Segment, Target};

const T: Duration = Duration::from_secs(20);

/// Two shm rails, a path on each, and a short timeout.
fn config() -> Config {
    std::env::set_var("RDMX_SHM_DATA_PATH", "ring");
    Config::default()
        .rails(vec![Rail::Shm, Rail::Shm])
        .listen("127.0.0.1:0".parse().unwrap())
        .connect_timeout(Duration::from_secs(1))
        .qps_per_rail(1)
        .timeout(Duration::from_secs(1))
        .set_aside(Duration::from_secs(60))
}

/// The queue pair number in a path's name (`... qp0x1234 -> ...`).
fn qpn_of(name: &str) -> u32 {
    let hex = name
        .split_whitespace()
        .find_map(|w| w.strip_prefix("qp0x"))
        .unwrap_or_else(|| panic!("no queue pair in {name:?}"));
    u32::from_str_radix(hex, 16).unwrap()
}

/// The target's queue pair of one path stalls: the initiator's timeout sets the path
/// aside and the slices in flight on it go again on the other rail; once the target reads
/// on, the first attempt is still in its ring. The target fenced its side of the path
/// before the retry was sent, so those bytes no longer land: what the application wrote
/// into the memory after the batch completed stays.
#[test]
fn a_stalled_shm_peer_s_late_reads_do_not_overwrite_what_came_after() {
    let a = Engine::new("a", config()).unwrap();
    let b = Engine::new("b", config()).unwrap();
    let t = LateBytes::new(&a, &b, 16, 64 << 10);
    // The peer's queue pair of the second path reads nothing for a while.
    let held = rdmx::shm::testing::hold_reads_from(qpn_of(&t.seg.paths()[1].name));
    let after = t.second_batch_then_overwrite(&a);
    // The peer reads its ring again: the first attempt is there.
    drop(held);
    std::thread::sleep(Duration::from_millis(500));
    t.assert_holds(&after);
}

/// Two engines, `a` having opened `b`'s segment and sent it a first notification, which
/// arrived; both paths up.
fn notified_once() -> (Engine, Engine, Segment, Vec<PathStatus>) {
    let a = Engine::new("a", config()).unwrap();
    let b = Engine::new("b", config()).unwrap();
    let seg = open_peer(&a, &b);
    let st = a.notify(&seg, b"first").unwrap().wait(T).unwrap();
    assert!(st.is_success(), "{st:?}");
    assert_eq!(b.recv_notification(T).unwrap().data, b"first");
    let paths = seg.paths();
    assert!(paths.len() == 2 && paths.iter().all(|p| p.up), "{paths:?}");
    (a, b, seg, paths)
}

/// The sender's queue pair of the path a notification takes stalls after the peer has
/// received it: the acknowledgement is never read, the path is set aside and the
/// notification goes again on the other rail. The peer delivers it once.
#[test]
fn a_notification_sent_again_after_it_arrived_is_delivered_once() {
    let (a, b, seg, paths) = notified_once();

    // `a` reads nothing more on the path notifications take (the first one up).
    let index = |name: &str| {
        name.split_whitespace()
            .next()
            .unwrap()
            .rsplit('#')
            .next()
            .unwrap()
            .to_string()
    };
    let theirs = &b.status()[0].2;
    let peer_of_first = theirs
        .iter()
        .find(|p| index(&p.name) == index(&paths[0].name))
        .unwrap_or_else(|| panic!("no path of b matches {:?}: {theirs:?}", paths[0].name));
    let held = rdmx::shm::testing::hold_reads_from(qpn_of(&peer_of_first.name));
    let st = a.notify(&seg, b"again?").unwrap().wait(T).unwrap();
    assert!(st.is_success(), "{st:?}");
    assert_eq!(b.recv_notification(T).unwrap().data, b"again?");
    assert!(
        seg.paths().iter().any(|p| !p.up && p.failures > 0),
        "the held path never failed: {:?}",
        seg.paths()
    );
    drop(held);
    let st = a.notify(&seg, b"last").unwrap().wait(T).unwrap();
    assert!(st.is_success(), "{st:?}");
    let next = b.recv_notification(T).unwrap();
    assert_eq!(
        next.data,
        b"last",
        "got {:?}: a notification came twice",
        String::from_utf8_lossy(&next.data)
    );
}

/// The peer stops reading the path notifications take, with one in its ring: the path
/// is set aside, the peer fences it, and the notification goes again on the other rail.
/// One sent once the path was set aside, while that fence is under way, arrives after it
/// (before, it took the other rail at once and arrived first).
#[test]
fn a_notification_sent_while_an_earlier_one_waits_to_go_again_arrives_after_it() {
    let (a, b, seg, paths) = notified_once();
    // `b` reads nothing more on the path notifications take (the first one up).
    let held = rdmx::shm::testing::hold_reads_from(qpn_of(&paths[0].name));
    let one = a.notify(&seg, b"one").unwrap();
    let start = std::time::Instant::now();
    while seg.paths()[0].up {
        assert!(start.elapsed() < T, "the path never failed");
        std::thread::yield_now();
    }
    let two = a.notify(&seg, b"two").unwrap();
    for (h, what) in [(one, "one"), (two, "two")] {
        let st = h.wait(T).unwrap();
        assert!(st.is_success(), "{what}: {st:?}");
    }
    let got: Vec<String> = (0..2)
        .map(|_| String::from_utf8_lossy(&b.recv_notification(T).unwrap().data).into_owned())
        .collect();
    assert_eq!(got, ["one", "two"]);
    drop(held);
}

/// An engine dropped while its work waits on a stalled peer: that work fails at once,
/// saying why (before, the rail's worker, asleep waiting for its completions, stopped
/// without them and the batch waited for its waiter's timeout).
#[test]
fn dropping_an_engine_fails_its_work_waiting_on_a_stalled_peer() {
    let config = || config().timeout(Duration::from_secs(60));
    let a = Engine::new("a", config()).unwrap();
    let b = Engine::new("b", config()).unwrap();
    let (n, len) = (8, 64 << 10);
    let src = a
        .register("src", pattern(1, n * len), Access::LOCAL_WRITE)
        .unwrap();
    b.register("dst", n * len, Access::REMOTE_WRITE).unwrap();
    let seg = open_peer(&a, &b);
    let st = a
        .submit(writes(&src, &seg, n, len, |o| o, Target::Offset))
        .wait(T)
        .unwrap();
    assert!(st.is_success(), "{st:?}");
    let held: Vec<_> = seg
        .paths()
        .iter()
        .map(|p| rdmx::shm::testing::hold_reads_from(qpn_of(&p.name)))
        .collect();
    let h = a.submit(writes(&src, &seg, n, len, |o| o, Target::Offset));
    // The rails' workers go to sleep waiting for completions that do not come.
    std::thread::sleep(Duration::from_millis(300));
    assert!(!h.is_done() && seg.paths().iter().any(|p| p.in_flight > 0));
    drop(a);
    let st = h
        .wait(Duration::from_secs(10))
        .expect("work in flight waited past the engine's drop");
    drop(held);
    assert!(st.done && st.failed == n, "{st:?}");
}
