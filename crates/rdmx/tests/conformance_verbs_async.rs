//! The async API's suite (`tests/async_ops/`) on the verbs provider: real rdma-core on the
//! first RDMA device (or `RDMX_VERBS_DEVICE`); `scripts/rxe-test.sh` runs it on Soft-RoCE
//! in a VM. Where no RDMA device exists every test passes after printing why it did not
//! run, unless `RDMX_REQUIRE_VERBS=1`.

#[macro_use]
mod async_ops;

mod conformance_verbs_async {
    use rdmx::Context;

    use crate::async_ops::Provider;

    /// Opens the verbs device.
    fn open() -> rdmx::Result<Context> {
        match std::env::var("RDMX_VERBS_DEVICE") {
            Ok(dev) => Context::open(rdmx::verbs::Options::default().device(&dev)),
            Err(_) => Context::open_provider("verbs"),
        }
    }

    pub(crate) const VERBS: Provider = Provider {
        name: "verbs",
        open,
        available,
        busy_polls: false,
    };

    /// Whether verbs can run here; panics under `RDMX_REQUIRE_VERBS=1` when it cannot.
    pub(crate) fn available() -> bool {
        if rdmx::devices().iter().any(|d| d.provider == "verbs") {
            return true;
        }
        if std::env::var_os("RDMX_REQUIRE_VERBS").is_some_and(|v| v == "1") {
            panic!("RDMX_REQUIRE_VERBS=1 but the verbs provider cannot run here");
        }
        eprintln!("skipped: no RDMA device for the verbs provider");
        false
    }

    async_suite!(VERBS);
}
