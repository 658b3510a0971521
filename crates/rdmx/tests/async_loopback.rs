//! The async API's suite (`tests/async_ops/`) on the loopback provider.

#[macro_use]
mod async_ops;

mod async_loopback {
    use crate::async_ops::Provider;

    pub(crate) const LOOPBACK: Provider = Provider {
        name: "loopback",
        open: || rdmx::Context::open_provider("loopback"),
        available: || true,
        busy_polls: false,
    };

    async_suite!(LOOPBACK);
}

/// An operation whose queue's driver task is gone (made on a runtime that has since shut
/// down) fails at once rather than waiting for a completion nobody routes.
#[test]
fn operations_fail_once_the_driver_s_runtime_is_gone() {
    let rt = || async_ops::runtime(false);
    let first = rt();
    let pr = first.block_on(async { async_loopback::LOOPBACK.pair() });
    drop(first);
    let r = rt().block_on(async {
        let buf = pr.pool_b.get(8).unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(10), pr.b.recv(buf)).await
    });
    let r = r.expect("the operation waited with no driver");
    let e = r.expect_err("an operation with no driver succeeded");
    let why = match &e {
        rdmx::tokio::OpError::Post(rdmx::Error::Io(_, io), _) => io.to_string(),
        other => panic!("{other:?}"),
    };
    assert!(why.contains("driver task ended"), "{why}");
}

/// The same for an operation waiting for room that a dropped operation held: once the
/// driver is gone, that room comes back (no completion will) and the waiting operation
/// fails.
#[test]
fn an_operation_waiting_for_room_fails_once_the_driver_s_runtime_is_gone() {
    let rt = || async_ops::runtime(false);
    let first = rt();
    let (pr, waiting) = first.block_on(async {
        let caps = rdmx::QpCaps::default().max_send_wr(1);
        let pr = async_loopback::LOOPBACK.pair_with(caps, rdmx::PoolConfig::default());
        // Posted, then dropped in flight (the driver never ran to route its completion).
        drop(pr.a.send(pr.pool_a.get(8).unwrap()));
        // The queue is full: this one waits for the dropped one's room.
        let waiting = pr.a.send(pr.pool_a.get(8).unwrap());
        (pr, waiting)
    });
    drop(first);
    let r = rt().block_on(async {
        tokio::time::timeout(std::time::Duration::from_secs(10), waiting).await
    });
    let r = r.expect("the operation waited for room with no driver");
    assert!(r.is_err(), "an operation with no driver succeeded");
    drop(pr);
}
