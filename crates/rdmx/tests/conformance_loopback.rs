//! The provider conformance suite (`tests/conformance/`) on the loopback provider.
//!
//! Every test is named `conformance_loopback::<test>`. Another provider gets the same
//! suite with a file like this one: its own module name and its own [`Provider`] value.
//!
//! [`Provider`]: conformance::Provider

#[macro_use]
mod conformance;

mod conformance_loopback {
    use rdmx::{Context, Mtu};

    use crate::conformance::Provider;

    /// Loopback: queue pairs of this process connected in memory, at the default path MTU.
    const LOOPBACK: Provider = Provider {
        name: "loopback",
        open: || Context::open_provider("loopback"),
        mtu: Mtu::Mtu4096,
    };

    conformance_suite!(LOOPBACK);
}
