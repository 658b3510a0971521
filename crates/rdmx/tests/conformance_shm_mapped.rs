//! The provider conformance suite on the shm provider's `mapped` data path: every region
//! the suite registers is memfd-backed (`Mapping::shared`), each side has its own context
//! (its own socket, progress thread, key table), and each context maps the files of the
//! other's regions through their own mappings, as a second process would. RDMA WRITEs and
//! READs posted on an empty send queue are executed by the initiator with one memcpy into
//! or out of its mapping of the target's file; everything else takes the rings.
//! `mapped_path_runs` checks that the path is the one running and that it executes
//! requests.

#[macro_use]
mod conformance;

use std::sync::atomic::Ordering;

fn open_mapped() -> rdmx::Result<rdmx::Context> {
    conformance::SHARED_MEMORY.store(true, Ordering::Relaxed);
    rdmx::Context::open(rdmx::shm::Options::default().direct(false).mapped(true))
}

mod conformance_shm_mapped {
    use rdmx::Mtu;

    use crate::conformance::Provider;

    /// shm on the mapped data path.
    const SHM_MAPPED: Provider = Provider {
        name: "shm",
        open: super::open_mapped,
        mtu: Mtu::Bytes(65536),
    };

    conformance_suite!(SHM_MAPPED);
}

/// The pair runs the mapped path, and WRITEs and READs of every size class at misaligned
/// offsets are executed at post time and move their bytes intact; a region of plain memory
/// takes the rings.
mod mapped_path_runs {
    use std::time::{Duration, Instant};

    use rdmx::{Access, Mtu, SendRequest, WcStatus};

    use crate::conformance::{self, Provider};

    #[test]
    fn writes_and_reads_execute_at_post() {
        let p = Provider {
            name: "shm",
            open: super::open_mapped,
            mtu: Mtu::Bytes(65536),
        };
        let pair = p.pair();
        let (a, b) = (&pair.a, &pair.b);
        let deadline = Instant::now() + Duration::from_secs(30);
        while rdmx::shm::data_path(&a.qp).is_none() || rdmx::shm::data_path(&b.qp).is_none() {
            assert!(Instant::now() < deadline, "the shm connection never came");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(rdmx::shm::data_path(&a.qp), Some("mapped"));
        assert_eq!(rdmx::shm::data_path(&b.qp), Some("mapped"));
        let len = 300 << 10;
        let src = conformance::register(&a.pd, len + 64, Access::LOCAL_WRITE);
        let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let dst = conformance::register(&b.pd, len + 64, access);
        let data = conformance::fill(&src, 7);
        // The file reaches the peer through its socket: wait until a WRITE runs mapped.
        let before = rdmx::shm::executed_at_post(&a.qp).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut i = 0u64;
        loop {
            a.qp.post_send(
                SendRequest::write(i, conformance::raddr(&dst, 0))
                    .sge(conformance::sge(&src, 0, 64)),
            )
            .unwrap();
            let c = conformance::wait_one(&a.scq, "WRITE");
            assert_eq!(c.status, WcStatus::Success, "{c:?}");
            i += 1;
            if rdmx::shm::executed_at_post(&a.qp).unwrap() > before {
                break;
            }
            assert!(Instant::now() < deadline, "no WRITE ran on the mapped path");
            std::thread::sleep(Duration::from_millis(1));
        }
        for n in [1, 100, 4096, 70_000, len] {
            let at_post = rdmx::shm::executed_at_post(&a.qp).unwrap();
            a.qp.post_send(
                SendRequest::write(n as u64, conformance::raddr(&dst, 48))
                    .sge(conformance::sge(&src, 32, n)),
            )
            .unwrap();
            let c = conformance::wait_one(&a.scq, "WRITE");
            assert_eq!(c.status, WcStatus::Success, "{c:?}");
            assert_eq!(rdmx::shm::executed_at_post(&a.qp), Some(at_post + 1), "{n}");
            let got = conformance::image(&dst);
            conformance::assert_bytes(&got[48..48 + n], &data[32..32 + n], "WRITE");
            // And back with a READ.
            let back = conformance::register(&a.pd, n + 16, Access::LOCAL_WRITE);
            a.qp.post_send(
                SendRequest::read(n as u64, conformance::raddr(&dst, 48))
                    .sge(conformance::sge(&back, 16, n)),
            )
            .unwrap();
            let c = conformance::wait_one(&a.scq, "READ");
            assert_eq!(c.status, WcStatus::Success, "{c:?}");
            assert_eq!(rdmx::shm::executed_at_post(&a.qp), Some(at_post + 2), "{n}");
            conformance::assert_bytes(&conformance::image(&back)[16..], &data[32..32 + n], "READ");
        }
        // Plain memory is not mapped: the request takes the rings, and still arrives.
        let plain =
            b.pd.register(vec![0u8; 4096], Access::LOCAL_WRITE | Access::REMOTE_WRITE)
                .unwrap();
        let at_post = rdmx::shm::executed_at_post(&a.qp).unwrap();
        a.qp.post_send(
            SendRequest::write(99, conformance::raddr(&plain, 0))
                .sge(conformance::sge(&src, 0, 4096)),
        )
        .unwrap();
        let c = conformance::wait_one(&a.scq, "WRITE");
        assert_eq!(c.status, WcStatus::Success, "{c:?}");
        assert_eq!(rdmx::shm::executed_at_post(&a.qp), Some(at_post));
        conformance::assert_bytes(&conformance::image(&plain), &data[..4096], "WRITE to plain");
    }
}
