//! The provider conformance suite (`tests/conformance/`) on the tcp provider, both sides
//! in this process, each with its own context (its own listener and progress thread), so
//! every request crosses a real TCP connection on the loopback interface.

#[macro_use]
mod conformance;

mod conformance_tcp {
    use rdmx::{Context, Mtu};

    use crate::conformance::Provider;

    /// tcp at its default path MTU (1 MiB): one frame per MiB of payload.
    const TCP: Provider = Provider {
        name: "tcp",
        open: || Context::open_provider("tcp"),
        mtu: Mtu::Bytes(1 << 20),
    };

    conformance_suite!(TCP);
}

mod conformance_tcp_small_mtu {
    use rdmx::{Context, Mtu};

    use crate::conformance::Provider;

    /// tcp at a 4 KiB path MTU, so messages of the suite's sizes span many frames.
    const TCP_4K: Provider = Provider {
        name: "tcp",
        open: || Context::open_provider("tcp"),
        mtu: Mtu::Mtu4096,
    };

    conformance_suite!(TCP_4K);
}
