//! The provider conformance suite (`tests/conformance/`) on the shm provider, both sides
//! in this process, each with its own context (its own socket, progress thread and key
//! table), so every request crosses a pair of shared-memory rings. By default payloads
//! of 4 KiB or more are copied once, straight between the two contexts' registered
//! memory (the `direct` data path); `conformance_shm_ring` and `conformance_shm_small_ring`
//! copy every payload through the rings, and `conformance_shm_cma` copies payloads of
//! 16 KiB or more with `process_vm_readv` (the `cma` data path). `data_paths` checks
//! that each runs the path it asked for.

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

mod conformance_shm_ring {
    use rdmx::{Context, Mtu};

    use crate::conformance::Provider;

    /// shm with every payload through the rings (as between processes by default).
    const SHM_RING: Provider = Provider {
        name: "shm",
        open: || Context::open(rdmx::shm::Options::default().direct(false)),
        mtu: Mtu::Bytes(65536),
    };

    conformance_suite!(SHM_RING);
}

mod conformance_shm_small_ring {
    use rdmx::{Context, Mtu};

    use crate::conformance::Provider;

    /// shm with the smallest rings and a 4 KiB path MTU: messages of the suite's sizes
    /// span many packets, and the rings fill and wrap.
    const SHM_SMALL: Provider = Provider {
        name: "shm",
        open: || {
            Context::open(
                rdmx::shm::Options::default()
                    .ring_bytes(64 << 10)
                    .direct(false),
            )
        },
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
        open: || Context::open(rdmx::shm::Options::default().cma(true).direct(false)),
        mtu: Mtu::Bytes(65536),
    };

    conformance_suite!(SHM_CMA);
}

/// Each option set runs the data path it asks for, and moves a WRITE of every size class
/// (ring-sized, descriptor-sized, several packets) intact at a misaligned offset.
mod data_paths {
    use std::time::{Duration, Instant};

    use rdmx::shm::Options;
    use rdmx::{Access, Context, Mtu, SendRequest, WcStatus};

    use crate::conformance::{self, Provider};

    fn run(open: fn() -> rdmx::Result<Context>, want: &str) {
        let p = Provider {
            name: "shm",
            open,
            mtu: Mtu::Bytes(65536),
        };
        let pair = p.pair();
        let (a, b) = (&pair.a, &pair.b);
        let deadline = Instant::now() + Duration::from_secs(30);
        while rdmx::shm::data_path(&a.qp).is_none() || rdmx::shm::data_path(&b.qp).is_none() {
            assert!(Instant::now() < deadline, "the shm connection never came");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(rdmx::shm::data_path(&a.qp), Some(want));
        assert_eq!(rdmx::shm::data_path(&b.qp), Some(want));
        let len = 300 << 10;
        let src = conformance::register(&a.pd, len + 64, Access::LOCAL_WRITE);
        let dst =
            conformance::register(&b.pd, len + 64, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        let data = conformance::fill(&src, 7);
        for (i, n) in [100, 4096, 70_000, len].into_iter().enumerate() {
            // Source and destination 16 bytes apart within a cache line.
            a.qp.post_send(
                SendRequest::write(i as u64, conformance::raddr(&dst, 48))
                    .sge(conformance::sge(&src, 32, n)),
            )
            .unwrap();
            let c = conformance::wait_one(&a.scq, "WRITE");
            assert_eq!(c.status, WcStatus::Success, "{c:?}");
            let got = conformance::image(&dst);
            conformance::assert_bytes(&got[48..48 + n], &data[32..32 + n], "WRITE");
        }
    }

    #[test]
    fn direct_by_default_in_one_process() {
        run(|| Context::open(Options::default().direct(true)), "direct");
    }

    #[test]
    fn ring_when_direct_is_off() {
        run(|| Context::open(Options::default().direct(false)), "ring");
    }

    #[test]
    fn cma_when_asked_and_direct_is_off() {
        run(
            || Context::open(Options::default().direct(false).cma(true)),
            "cma",
        );
    }
}
