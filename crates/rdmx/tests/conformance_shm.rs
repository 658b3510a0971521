//! The provider conformance suite (`tests/conformance/`) on the shm provider, both sides
//! in this process, each with its own context (its own socket, progress thread and key
//! table), so every request crosses a pair of shared-memory rings. `conformance_shm_cma`
//! copies payloads of 16 KiB or more with `process_vm_readv` instead (the `cma` data
//! path).

#[macro_use]
mod conformance;

mod conformance_shm {
    use rdmx::{Context, Mtu};

    use crate::conformance::Provider;

    /// shm at its default path MTU (64 KiB).
    const SHM: Provider = Provider {
        name: "shm",
        open: || Context::open_provider("shm"),
        mtu: Mtu::Bytes(65536),
    };

    conformance_suite!(SHM);
}

mod conformance_shm_small_ring {
    use rdmx::{Context, Mtu};

    use crate::conformance::Provider;

    /// shm with the smallest rings and a 4 KiB path MTU: messages of the suite's sizes
    /// span many packets, and the rings fill and wrap.
    const SHM_SMALL: Provider = Provider {
        name: "shm",
        open: || Context::open(rdmx::shm::Options::default().ring_bytes(64 << 10)),
        mtu: Mtu::Mtu4096,
    };

    conformance_suite!(SHM_SMALL);
}

mod conformance_shm_cma {
    use rdmx::{Context, Mtu};

    use crate::conformance::Provider;

    /// shm on the cma data path: payloads of 16 KiB or more are pulled by the receiver.
    const SHM_CMA: Provider = Provider {
        name: "shm",
        open: || Context::open(rdmx::shm::Options::default().cma(true)),
        mtu: Mtu::Bytes(65536),
    };

    conformance_suite!(SHM_CMA);
}
