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
