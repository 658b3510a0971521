//! The provider conformance suite (`tests/conformance/`) on the verbs provider: real
//! rdma-core on the first RDMA device (or `RDMX_VERBS_DEVICE`), e.g. an adapter or
//! Soft-RoCE (`scripts/rxe-test.sh` runs it on rxe in a VM). Each side of a connection
//! opens its own context, as two processes would.
//!
//! Where no RDMA device exists every test passes after printing why it did not run,
//! unless `RDMX_REQUIRE_VERBS=1`, which turns that into a failure.

#[macro_use]
mod conformance;

/// The verbs provider, or `None` (after saying why) when no RDMA device exists here.
fn verbs_provider() -> Option<conformance::Provider> {
    let devices = rdmx::devices();
    if devices.iter().any(|d| d.provider == "verbs") {
        return Some(conformance_verbs::VERBS);
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

/// Expands to the verbs [`Provider`](conformance::Provider), or returns from the test
/// when there is no RDMA device.
macro_rules! verbs_or_skip {
    () => {
        match crate::verbs_provider() {
            Some(p) => p,
            None => return,
        }
    };
}

mod conformance_verbs {
    use rdmx::{Context, Mtu};

    use crate::conformance::Provider;

    /// verbs at a 1024-byte path MTU, which every RoCE and InfiniBand port carries (rxe's
    /// active MTU on a 1500-byte netdev), so messages of the suite's sizes span packets.
    pub(crate) const VERBS: Provider = Provider {
        name: "verbs",
        open: || match std::env::var("RDMX_VERBS_DEVICE") {
            Ok(dev) => Context::open(rdmx::verbs::Options::default().device(&dev)),
            Err(_) => Context::open_provider("verbs"),
        },
        mtu: Mtu::Mtu1024,
    };

    conformance_suite!(verbs_or_skip!());
}
