//! The async API's suite (`tests/async_ops/`) on the tcp provider, each side with its own
//! context, every request crossing a real TCP connection; and again on busy-polled
//! contexts, where the completion queue's driver polls instead of sleeping.

#[macro_use]
mod async_ops;

mod async_tcp {
    use crate::async_ops::Provider;

    pub(crate) const TCP: Provider = Provider {
        name: "tcp",
        open: || rdmx::Context::open_provider("tcp"),
        available: || true,
        busy_polls: false,
    };

    async_suite!(TCP);
}

mod async_tcp_busy_poll {
    use crate::async_ops::Provider;

    pub(crate) const TCP_BUSY: Provider = Provider {
        name: "tcp (busy poll)",
        open: || rdmx::Context::open(rdmx::tcp::Options::default().busy_poll(true)),
        available: || true,
        busy_polls: true,
    };

    async_suite!(TCP_BUSY);
}
