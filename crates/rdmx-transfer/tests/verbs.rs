//! The transfer engine over verbs: two engines in this process, each with two rails on
//! the RDMA device (the first, or `RDMX_VERBS_DEVICE`; `scripts/rxe-test.sh` runs this
//! on Soft-RoCE's rxe0 in a VM), so every request is striped over four queue pairs on
//! two rails. Checked: a batch of WRITEs lands byte for byte with its notification after
//! it, READs bring the bytes back, and with one rail broken mid-batch every request
//! completes on the other.
//!
//! Where no RDMA device exists every test passes after printing why it did not run,
//! unless `RDMX_REQUIRE_VERBS=1`, which turns that into a failure.

mod common;

use std::time::Duration;

use common::{a_path_failed, local, mid_batch, open_peer, paged_pattern, wait_completed, writes};
use rdmx::Access;
use rdmx_transfer::{Batch, Config, Engine, Rail, RequestStatus, Target, Transport};

// Soft-RoCE under emulation moves tens of MB/s: sizes are small, waits long.
const T: Duration = Duration::from_secs(120);

/// The verbs device to use, or `None` (after saying why) when there is none.
fn device() -> Option<String> {
    if let Ok(d) = std::env::var("RDMX_VERBS_DEVICE") {
        return Some(d);
    }
    if let Some(d) = rdmx::devices().into_iter().find(|d| d.provider == "verbs") {
        return Some(d.name);
    }
    let why = match rdmx::Context::open_provider("verbs") {
        Err(e) => e.to_string(),
        Ok(_) => "rdma-core lists no device".to_string(),
    };
    if std::env::var_os("RDMX_REQUIRE_VERBS").is_some_and(|v| v == "1") {
        panic!("RDMX_REQUIRE_VERBS=1 but the verbs provider cannot run: {why}");
    }
    eprintln!("skipped: the verbs provider cannot run here: {why}");
    None
}

/// Two verbs rails on `dev` (two contexts, each with its own queue pairs and CQ).
fn two_rails(dev: &str) -> Config {
    let rail = || Rail::Verbs {
        device: Some(dev.to_string()),
    };
    Config::default()
        .rails(vec![rail(), rail()])
        .listen(local())
}

#[test]
fn a_batch_over_two_verbs_rails_lands_and_reads_back() {
    let Some(dev) = device() else { return };
    let a = Engine::new("a", two_rails(&dev)).unwrap();
    let b = Engine::new("b", two_rails(&dev)).unwrap();
    // 24 requests of 100,000 bytes: slices of 64 KiB and tails, over four queue pairs.
    let (n, len) = (24, 100_000);
    let total = n * len;
    let src = a
        .register("src", paged_pattern(5, total), Access::LOCAL_WRITE)
        .unwrap();
    let back = a.register("back", total, Access::LOCAL_WRITE).unwrap();
    let dst = b
        .register("dst", total, Access::REMOTE_WRITE | Access::REMOTE_READ)
        .unwrap();
    let seg = open_peer(&a, &b);
    assert_eq!(seg.transport(), Transport::Verbs);
    let mut w = writes(&src, &seg, n, len, |o| o, |o| Target::Buffer("dst", o));
    w.notify(b"written over verbs").unwrap();
    let h = a.submit(w);
    let st = h.wait(T).unwrap();
    assert!(st.is_success(), "{st:?}");
    assert_eq!(st.bytes, total as u64);
    let note = b.recv_notification(T).expect("the batch's notification");
    assert_eq!(note.data, b"written over verbs");
    let mut got = vec![0u8; total];
    dst.read(0, &mut got).unwrap();
    assert!(got == paged_pattern(5, total), "the written bytes differ");

    let mut r = Batch::new();
    for i in 0..n {
        let off = (i * len) as u64;
        r.read((&back, off), &seg, Target::Buffer("dst", off), len as u64)
            .unwrap();
    }
    assert!(a.submit(r).wait(T).unwrap().is_success());
    back.read(0, &mut got).unwrap();
    assert!(got == paged_pattern(5, total), "the read bytes differ");

    let st = a.status();
    let paths = &st[0].2;
    assert_eq!(paths.len(), 4, "2 rails x 2 queue pairs: {paths:?}");
    assert!(
        paths
            .iter()
            .all(|p| p.up && p.transport == Transport::Verbs),
        "{paths:?}"
    );
}

/// The target takes rail 1 out of service mid-batch (its queue pairs are moved to the
/// error state and destroyed, so the initiator's requests on that rail are never
/// acknowledged: an error completion once the device's retries run out, or, as on rxe,
/// none, and the engine's timeout sets the path aside): every request completes on
/// rail 0, and the data is right.
#[test]
fn a_verbs_rail_broken_mid_batch_moves_its_slices_to_the_other() {
    let Some(dev) = device() else { return };
    mid_batch("the rail broke", || {
        let a = Engine::new(
            "a",
            two_rails(&dev)
                .set_aside(Duration::from_secs(600))
                .timeout(Duration::from_secs(10)),
        )
        .unwrap();
        let b = Engine::new("b", two_rails(&dev)).unwrap();
        let (n, len) = (48, 256 << 10);
        let src = a
            .register("src", paged_pattern(9, n * len), Access::LOCAL_WRITE)
            .unwrap();
        let dst = b.register("dst", n * len, Access::REMOTE_WRITE).unwrap();
        let seg = open_peer(&a, &b);
        let h = a.submit(writes(&src, &seg, n, len, |o| o, Target::Offset));
        wait_completed(&h, 2, || std::thread::sleep(Duration::from_millis(1)));
        if h.is_done() {
            return false;
        }
        let broken = std::time::Instant::now();
        b.close_rail(1).unwrap();
        let st = h.wait(T).unwrap();
        let failures: Vec<_> = (0..n)
            .filter_map(|i| match h.status(i) {
                Some(RequestStatus::Failed(f)) => Some(format!("request {i}: {f}")),
                _ => None,
            })
            .collect();
        assert!(
            st.is_success(),
            "{st:?} {:?} after the break: {failures:#?}",
            broken.elapsed()
        );
        for i in 0..n {
            assert_eq!(
                h.status(i),
                Some(RequestStatus::Completed { bytes: len as u64 })
            );
        }
        let mut got = vec![0u8; n * len];
        dst.read(0, &mut got).unwrap();
        assert!(
            got == paged_pattern(9, n * len),
            "data differs after the rail broke"
        );
        // No path failed: what it had was in place before the rail closed.
        a_path_failed(&a)
    });
}
