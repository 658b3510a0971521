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

mod conformance_shm_direct_packets {
    use rdmx::{Context, Mtu};

    use crate::conformance::Provider;

    /// shm on the direct data path with every request carried by packets (payloads of
    /// 4 KiB or more as descriptors), none executed at post time.
    const SHM_DIRECT_PACKETS: Provider = Provider {
        name: "shm",
        open: || Context::open(rdmx::shm::Options::default().execute_at_post(false)),
        mtu: Mtu::Bytes(65536),
    };

    conformance_suite!(SHM_DIRECT_PACKETS);
}

/// On the direct data path, the initiator executes WRITEs and READs at post time when
/// nothing earlier is outstanding on its send queue, and leaves everything else, errors
/// included, to the packets.
#[path = "conformance_shm/execute_at_post.rs"]
mod execute_at_post;

/// UC requests complete when sent: their buffers may be written again at once.
mod uc_buffers {
    use std::time::Duration;

    use rdmx::shm::Options;
    use rdmx::{Access, Context, RecvRequest, SendRequest, WcStatus};

    use crate::conformance;

    /// A UC SEND's buffer is written again as soon as the SEND completes, while the
    /// receiver reads nothing (its ring fills, and a packet waits for room) or, on the
    /// direct path, would copy the payload out of the sender's memory itself: every
    /// message carries the bytes its buffer held when it was posted. (Before, the packet
    /// that waited for room, or every descriptor, carried the buffer's later bytes.)
    fn sends_carry_their_own_bytes(opts: Options, data_path: &str) {
        const LEN: usize = 8 << 10;
        const N: usize = 12;
        let side = || crate::uc_side(Context::open(opts.clone()).unwrap());
        let (_ca, pa, sa, _ra, qa) = side();
        let (_cb, pb, _sb, rb, qb) = side();
        let o = rdmx::ConnectOptions::default();
        qa.connect(qb.endpoint(), &o).unwrap();
        qb.connect(qa.endpoint(), &o).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while rdmx::shm::data_path(&qa).is_none() || rdmx::shm::data_path(&qb).is_none() {
            assert!(std::time::Instant::now() < deadline, "no connection");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(rdmx::shm::data_path(&qa), Some(data_path));
        let src = conformance::register(&pa, LEN, Access::LOCAL_WRITE);
        let dst = conformance::register(&pb, N * LEN, Access::LOCAL_WRITE);
        for i in 0..N {
            qb.post_recv(RecvRequest::new(i as u64).sge(conformance::sge(&dst, i * LEN, LEN)))
                .unwrap();
        }
        // The receiver reads nothing of its ring for now.
        let held = rdmx::shm::testing::hold_reads_from(qa.qp_num());
        let mut posted = 0;
        for i in 0..N {
            src.write_at(0, &[i as u8 + 1; LEN]).unwrap();
            qa.post_send(SendRequest::send(i as u64).sge(conformance::sge(&src, 0, LEN)))
                .unwrap();
            posted += 1;
            // Done once sent; a SEND behind a packet waiting for room is not.
            let mut c = [rdmx::Completion::default()];
            match sa.wait(&mut c, Duration::from_millis(300)).unwrap() {
                0 => break,
                _ => assert_eq!((c[0].wr_id, c[0].status), (i as u64, WcStatus::Success)),
            }
        }
        assert!(posted < N, "the ring never filled");
        drop(held);
        for i in 0..posted {
            let c = conformance::wait_one(&rb, "a UC SEND");
            assert_eq!((c.wr_id, c.status), (i as u64, WcStatus::Success), "{c:?}");
            let mut got = vec![0u8; LEN];
            dst.read_at(i * LEN, &mut got).unwrap();
            assert!(
                got.iter().all(|&b| b == i as u8 + 1),
                "message {i} carries {} (of {} sent)",
                got[0] as i64 - 1,
                posted
            );
        }
    }

    #[test]
    fn on_the_ring() {
        sends_carry_their_own_bytes(
            Options::default().ring_bytes(64 << 10).direct(false),
            "ring",
        );
    }

    #[test]
    fn on_the_direct_path() {
        sends_carry_their_own_bytes(Options::default().ring_bytes(64 << 10), "direct");
    }
}

/// An acknowledgement that finds the ring full waits for room, as any packet does.
mod acks_wait_for_room {
    use std::time::{Duration, Instant};

    use rdmx::shm::Options;
    use rdmx::{Access, Context, QpCaps, RecvRequest, SendRequest, WcOpcode, WcStatus};

    use crate::conformance;

    /// A sends SENDs one at a time while it reads nothing of its incoming ring: B
    /// acknowledges each in a record of its own until the ring is full, then must keep
    /// the next acknowledgement until A reads again. Every SEND then completes. (An
    /// acknowledgement dropped for want of room left the SENDs after it without one.)
    #[test]
    fn every_send_completes_once_the_ring_drains() {
        // More than a 64 KiB ring holds of 32-byte acknowledgement records.
        const N: usize = 2600;
        let opts = Options::default().ring_bytes(64 << 10).direct(false);
        let mut caps = QpCaps::default();
        caps.max_send_wr = 4096;
        let side = || {
            let ctx = Context::open(opts.clone()).unwrap();
            let pd = ctx.alloc_pd();
            let scq = ctx.create_cq(4096).unwrap();
            let rcq = ctx.create_cq(64).unwrap();
            let qp = pd.create_qp(&scq, &rcq, caps).unwrap();
            (ctx, pd, scq, rcq, qp)
        };
        let (_ca, pa, sa, _ra, qa) = side();
        let (_cb, pb, _sb, rb, qb) = side();
        let o = rdmx::ConnectOptions::default();
        qa.connect(qb.endpoint(), &o).unwrap();
        qb.connect(qa.endpoint(), &o).unwrap();
        let src = conformance::register(&pa, 8, Access::LOCAL_WRITE);
        let dst = conformance::register(&pb, 8, Access::LOCAL_WRITE);
        for i in 0..8 {
            qb.post_recv(RecvRequest::new(i).sge(conformance::sge(&dst, 0, 8)))
                .unwrap();
        }
        let held = rdmx::shm::testing::hold_reads_from(qb.qp_num());
        for i in 0..N {
            qa.post_send(SendRequest::send(i as u64).sge(conformance::sge(&src, 0, 8)))
                .unwrap();
            // B takes each SEND (and acknowledges it) before the next is posted.
            let c = conformance::wait_one(&rb, "a SEND");
            assert_eq!((c.opcode, c.status), (WcOpcode::Recv, WcStatus::Success));
            qb.post_recv(RecvRequest::new(0).sge(conformance::sge(&dst, 0, 8)))
                .unwrap();
        }
        let mut c = [rdmx::Completion::default(); 64];
        assert_eq!(sa.poll(&mut c).unwrap(), 0, "no acknowledgement was read");
        drop(held);
        let (mut done, deadline) = (0, Instant::now() + Duration::from_secs(30));
        while done < N {
            assert!(Instant::now() < deadline, "{done} of {N} SENDs completed");
            let n = sa.wait(&mut c, Duration::from_millis(100)).unwrap();
            for wc in &c[..n] {
                assert_eq!((wc.wr_id, wc.status), (done as u64, WcStatus::Success));
                done += 1;
            }
        }
    }
}

/// A peer that stops reading its ring, alive and connected, gets no acknowledgement
/// through: the request fails after the retry budget, however the application waits
/// (the timer runs in its polls, or in the progress thread).
mod silent_peer {
    use std::time::{Duration, Instant};

    use rdmx::shm::Options;
    use rdmx::{Access, Context, QpCaps, QpState, SendRequest, WcStatus};

    use crate::conformance;

    /// How the application waits for the failure.
    #[derive(Clone, Copy, Debug)]
    enum Waits {
        /// It polls the send CQ without pause.
        Polling,
        /// It sleeps on the CQ's notification.
        Blocking,
        /// It does nothing for longer than the budget, then polls once.
        Away,
    }

    fn request_fails_after_the_budget(waits: Waits) {
        let opts = Options::default().direct(false);
        let side = || {
            let ctx = Context::open(opts.clone()).unwrap();
            let pd = ctx.alloc_pd();
            let cq = ctx.create_cq(16).unwrap();
            let qp = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
            (ctx, pd, cq, qp)
        };
        let (_ca, pa, cqa, qa) = side();
        let (_cb, _pb, _cqb, qb) = side();
        // No retries: the request fails when its first timer expires, after the ack
        // timeout (at least the reliable link's 500 ms).
        let mut o = rdmx::ConnectOptions::default();
        o.retry_cnt = 0;
        qa.connect(qb.endpoint(), &o).unwrap();
        qb.connect(qa.endpoint(), &o).unwrap();
        let src = conformance::register(&pa, 8, Access::LOCAL_WRITE);
        let _held = rdmx::shm::testing::hold_reads_from(qa.qp_num());
        let mut c = [rdmx::Completion::default(); 4];
        // The application polls before it posts, as one that sends in a loop does: the
        // progress thread leaves the rounds to it (it does not sleep, it naps).
        let polled = Instant::now();
        while polled.elapsed() < Duration::from_millis(20) {
            assert_eq!(cqa.poll(&mut c).unwrap(), 0);
        }
        let start = Instant::now();
        qa.post_send(SendRequest::send(7).sge(conformance::sge(&src, 0, 8)))
            .unwrap();
        let deadline = start + Duration::from_secs(20);
        let n = loop {
            assert!(Instant::now() < deadline, "{waits:?}: no completion");
            let n = match waits {
                Waits::Polling => cqa.poll(&mut c).unwrap(),
                Waits::Blocking => cqa.wait(&mut c, Duration::from_millis(200)).unwrap(),
                Waits::Away => {
                    std::thread::sleep(Duration::from_secs(3));
                    cqa.poll(&mut c).unwrap()
                }
            };
            if n > 0 {
                break n;
            }
        };
        let at = start.elapsed();
        assert_eq!(n, 1, "{waits:?}");
        assert_eq!(
            (c[0].wr_id, c[0].status),
            (7, WcStatus::RetryExcErr),
            "{waits:?}"
        );
        assert!(
            at >= Duration::from_millis(500),
            "{waits:?}: failed after {at:?}"
        );
        // Soon after the budget, not at some later event (the 20 s deadline); with room
        // for a test thread held off on a busy machine.
        if !matches!(waits, Waits::Away) {
            assert!(
                at < Duration::from_secs(5),
                "{waits:?}: failed after {at:?}"
            );
        }
        assert_eq!(qa.state(), QpState::Err);
    }

    #[test]
    fn while_the_application_polls() {
        request_fails_after_the_budget(Waits::Polling);
    }

    #[test]
    fn while_the_application_sleeps_on_the_cq() {
        request_fails_after_the_budget(Waits::Blocking);
    }

    #[test]
    fn while_the_application_is_away() {
        request_fails_after_the_budget(Waits::Away);
    }
}

/// A UC queue pair of `ctx`, with its protection domain and its send and receive CQs.
fn uc_side(
    ctx: rdmx::Context,
) -> (
    rdmx::Context,
    rdmx::ProtectionDomain,
    rdmx::CompletionQueue,
    rdmx::CompletionQueue,
    rdmx::QueuePair,
) {
    let pd = ctx.alloc_pd();
    let scq = ctx.create_cq(64).unwrap();
    let rcq = ctx.create_cq(64).unwrap();
    let qp = pd
        .create_qp_of_type(rdmx::QpType::Uc, &scq, &rcq, None, rdmx::QpCaps::default())
        .unwrap();
    (ctx, pd, scq, rcq, qp)
}
