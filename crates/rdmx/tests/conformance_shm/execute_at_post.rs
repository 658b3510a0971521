use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rdmx::shm::{data_path, executed_at_post, Options};
use rdmx::{
    Access, Context, Mtu, QpCaps, QpState, QpType, QueuePair, RecvRequest, SendRequest, WcOpcode,
    WcStatus,
};

use crate::conformance::{self, Pair, Provider, ALL, LOCAL};

const FAST: Provider = Provider {
    name: "shm",
    open: || Context::open(Options::default()),
    mtu: Mtu::Bytes(65536),
};

const PACKETS: Provider = Provider {
    name: "shm",
    open: || Context::open(Options::default().execute_at_post(false)),
    mtu: Mtu::Bytes(65536),
};

fn count(qp: &QueuePair) -> u64 {
    executed_at_post(qp).expect("an shm queue pair")
}

/// Waits until both queue pairs have their connection (the accepting side gets it
/// moments after RTS), and checks it is the direct path.
fn wait_direct(a: &QueuePair, b: &QueuePair) {
    let deadline = Instant::now() + conformance::DEADLINE;
    while data_path(a).is_none() || data_path(b).is_none() {
        assert!(Instant::now() < deadline, "the shm connection never came");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        (data_path(a), data_path(b)),
        (Some("direct"), Some("direct"))
    );
}

fn pair(p: &Provider) -> Pair {
    let mut cfg = p.config();
    cfg.opts.rnr_retry = 7;
    let pair = p.pair_with(cfg, p.config());
    wait_direct(&pair.a.qp, &pair.b.qp);
    pair
}

/// WRITEs and READs of every size class, signalled, unsignalled and inline, run at
/// post; SENDs and WRITEs with immediate data take the packets, and the two ways
/// interleave with every byte and completion right. With the shortcut off, the same
/// requests all take the packets.
#[test]
fn writes_and_reads_run_at_post_and_interleave_with_packets() {
    for (p, fast) in [(FAST, true), (PACKETS, false)] {
        let pair = pair(&p);
        let (a, b) = (&pair.a, &pair.b);
        let qa = a.qp.qp_num();
        let len = 300 << 10;
        let src = conformance::register(&a.pd, len + 64, ALL);
        let back = conformance::register(&a.pd, len + 64, LOCAL);
        let dst = conformance::register(&b.pd, len + 64, ALL);
        let inbox = conformance::register(&b.pd, 4096, LOCAL);
        let data = conformance::fill(&src, 7);
        let mut expect = conformance::fill(&dst, 8);
        let mut ran = 0;
        let mut id = 0;
        for n in [1, 100, 4096, 70_000, len] {
            // Source and destination 16 bytes apart within a cache line.
            id += 1;
            a.qp.post_send(
                SendRequest::write(id, conformance::raddr(&dst, 48))
                    .sge(conformance::sge(&src, 32, n)),
            )
            .unwrap();
            let c = conformance::wait_one(&a.scq, "WRITE");
            conformance::check_ok(&c, id, WcOpcode::RdmaWrite, qa, "WRITE");
            assert_eq!(c.byte_len as usize, n);
            expect[48..48 + n].copy_from_slice(&data[32..32 + n]);
            conformance::assert_bytes(&conformance::image(&dst), &expect, "WRITE");
            id += 1;
            a.qp.post_send(
                SendRequest::read(id, conformance::raddr(&dst, 40))
                    .sge(conformance::sge(&back, 8, n)),
            )
            .unwrap();
            let c = conformance::wait_one(&a.scq, "READ");
            conformance::check_ok(&c, id, WcOpcode::RdmaRead, qa, "READ");
            assert_eq!(c.byte_len as usize, n);
            let got = conformance::image(&back);
            conformance::assert_bytes(&got[8..8 + n], &expect[40..40 + n], "READ");
            ran += 2;
        }
        // Unsignalled, then inline, then a SEND and a WRITE with immediate data
        // (packets), then a WRITE again: completions in order, bytes in place.
        a.qp.post_send(
            SendRequest::write(100, conformance::raddr(&dst, 0))
                .sge(conformance::sge(&src, 0, 5000))
                .unsignaled(),
        )
        .unwrap();
        expect[..5000].copy_from_slice(&data[..5000]);
        let small = [0xa5u8; 64];
        a.qp.post_send(SendRequest::write(101, conformance::raddr(&dst, 7000)).inline(&small))
            .unwrap();
        expect[7000..7064].copy_from_slice(&small);
        ran += 2;
        b.qp.post_recv(RecvRequest::new(200).sge(conformance::sge(&inbox, 0, 4096)))
            .unwrap();
        b.qp.post_recv(RecvRequest::new(201)).unwrap();
        a.qp.post_send(SendRequest::send(102).sge(conformance::sge(&src, 0, 3000)))
            .unwrap();
        a.qp.post_send(
            SendRequest::write_with_imm(103, conformance::raddr(&dst, 9000), 0x1234)
                .sge(conformance::sge(&src, 100, 6000)),
        )
        .unwrap();
        expect[9000..15000].copy_from_slice(&data[100..6100]);
        let cs = conformance::wait_n(&a.scq, 3, "inline WRITE, SEND, WRITE_WITH_IMM");
        let got: Vec<_> = cs.iter().map(|c| (c.wr_id, c.status)).collect();
        assert_eq!(
            got,
            [
                (101, WcStatus::Success),
                (102, WcStatus::Success),
                (103, WcStatus::Success)
            ]
        );
        let rs = conformance::wait_n(&b.rcq, 2, "the SEND and the immediate data");
        assert_eq!((rs[0].wr_id, rs[0].byte_len), (200, 3000));
        assert_eq!((rs[1].wr_id, rs[1].imm_data), (201, Some(0x1234)));
        a.qp.post_send(
            SendRequest::write(104, conformance::raddr(&dst, 20_000))
                .sge(conformance::sge(&src, 1, 9000)),
        )
        .unwrap();
        expect[20_000..29_000].copy_from_slice(&data[1..9001]);
        ran += 1;
        let c = conformance::wait_one(&a.scq, "a WRITE after the packets");
        conformance::check_ok(
            &c,
            104,
            WcOpcode::RdmaWrite,
            qa,
            "a WRITE after the packets",
        );
        conformance::assert_bytes(&conformance::image(&dst), &expect, "all the WRITEs");
        let mut got = vec![0u8; 3000];
        inbox.read_at(0, &mut got).unwrap();
        conformance::assert_bytes(&got, &data[..3000], "the SEND");
        assert_eq!(count(&a.qp), if fast { ran } else { 0 }, "executed at post");
        assert_eq!(count(&b.qp), 0);
        conformance::assert_drained(&a.scq, "the initiator's CQ");
    }
}

/// Requests posted behind an outstanding one wait their turn, on every data path:
/// a WRITE behind a WRITE to the same bytes lands after it, and a fenced WRITE
/// behind a READ of the same bytes is not seen by that READ. None of them runs at
/// post; the first request on an empty queue afterwards does.
///
/// (Without the fence, a READ may return bytes a later WRITE placed, on every path:
/// the responder reads a READ's response as it sends it, which InfiniBand allows;
/// the fence is how verbs asks for the order.)
#[test]
fn requests_behind_outstanding_ones_wait_their_turn() {
    for (p, fast) in [(PACKETS, false), (FAST, true)] {
        behind_outstanding(&p, fast);
    }
}

/// `fast`: `p` executes requests at post.
fn behind_outstanding(p: &Provider, fast: bool) {
    let pair = pair(p);
    let (a, b) = (&pair.a, &pair.b);
    let n = 50_000;
    let src = conformance::register(&a.pd, 2 * n, ALL);
    let back = conformance::register(&a.pd, n, LOCAL);
    let dst = conformance::register(&b.pd, n, ALL);
    let inbox = conformance::register(&b.pd, 64, LOCAL);
    let data = conformance::fill(&src, 1);
    let (d1, d2) = (&data[..n], &data[n..]);
    let before = conformance::fill(&dst, 2);
    let hold = || {
        // A SEND with no receive posted waits (RNR) and holds the queue.
        a.qp.post_send(SendRequest::send(1).sge(conformance::sge(&src, 0, 8)))
            .unwrap();
    };
    let release = |what: &str| {
        conformance::assert_quiet(&a.scq, what);
        assert_eq!(
            conformance::image(&dst),
            before,
            "{what}: nothing ran ahead"
        );
        b.qp.post_recv(RecvRequest::new(9).sge(conformance::sge(&inbox, 0, 64)))
            .unwrap();
        let cs = conformance::wait_n(&a.scq, 3, what);
        cs.iter()
            .map(|c| (c.wr_id, c.status, c.opcode))
            .collect::<Vec<_>>()
    };
    hold();
    for (id, at) in [(2, 0), (3, n)] {
        a.qp.post_send(
            SendRequest::write(id, conformance::raddr(&dst, 0)).sge(conformance::sge(&src, at, n)),
        )
        .unwrap();
    }
    assert_eq!(
        release("two WRITEs behind a SEND"),
        [
            (1, WcStatus::Success, WcOpcode::Send),
            (2, WcStatus::Success, WcOpcode::RdmaWrite),
            (3, WcStatus::Success, WcOpcode::RdmaWrite),
        ]
    );
    conformance::assert_bytes(&conformance::image(&dst), d2, "the later WRITE");
    dst.write_at(0, &before).unwrap();
    hold();
    a.qp.post_send(
        SendRequest::read(2, conformance::raddr(&dst, 0)).sge(conformance::sge(&back, 0, n)),
    )
    .unwrap();
    a.qp.post_send(
        SendRequest::write(3, conformance::raddr(&dst, 0))
            .sge(conformance::sge(&src, 0, n))
            .fence(),
    )
    .unwrap();
    assert_eq!(
        release("a READ and a fenced WRITE behind a SEND"),
        [
            (1, WcStatus::Success, WcOpcode::Send),
            (2, WcStatus::Success, WcOpcode::RdmaRead),
            (3, WcStatus::Success, WcOpcode::RdmaWrite),
        ]
    );
    conformance::assert_bytes(&conformance::image(&back), &before, "the READ");
    conformance::assert_bytes(&conformance::image(&dst), d1, "the fenced WRITE");
    assert_eq!(count(&a.qp), 0, "nothing ran at post behind the SEND");
    // The queue is empty again: the next WRITE runs at post (when it may).
    a.qp.post_send(
        SendRequest::write(4, conformance::raddr(&dst, 0)).sge(conformance::sge(&back, 0, n)),
    )
    .unwrap();
    let c = conformance::wait_one(&a.scq, "a WRITE on an empty queue");
    assert_eq!((c.wr_id, c.status), (4, WcStatus::Success));
    assert_eq!(count(&a.qp), u64::from(fast));
    conformance::assert_bytes(&conformance::image(&dst), &before, "the last WRITE");
}

/// What a refused request ends with: the initiator's completion status, and both
/// queue pairs' states once the initiator has it.
fn refused(p: &Provider, case: usize) -> (WcStatus, QpState, QpState, u64) {
    let pair = pair(p);
    let (a, b) = (&pair.a, &pair.b);
    let n = 10_000;
    let src = conformance::register(&a.pd, n, ALL);
    let dst = conformance::register(&b.pd, n, ALL);
    let no_write = conformance::register(&b.pd, n, LOCAL | Access::REMOTE_READ);
    let no_read = conformance::register(&b.pd, n, LOCAL | Access::REMOTE_WRITE);
    let other_pd = b.pd.context().alloc_pd();
    let elsewhere = conformance::register(&other_pd, n, ALL);
    let mut bad_key = conformance::raddr(&dst, 0);
    bad_key.rkey ^= 0x0010_0000;
    let req = match case {
        0 => SendRequest::write(1, bad_key),
        1 => SendRequest::write(1, conformance::raddr(&dst, 1)),
        2 => SendRequest::write(1, conformance::raddr(&no_write, 0)),
        3 => SendRequest::read(1, conformance::raddr(&no_read, 0)),
        4 => SendRequest::read(1, conformance::raddr(&elsewhere, 0)),
        _ => unreachable!(),
    };
    a.qp.post_send(req.sge(conformance::sge(&src, 0, n)))
        .unwrap();
    let c = conformance::wait_one(&a.scq, "a refused request");
    assert_eq!(c.wr_id, 1);
    (c.status, a.qp.state(), b.qp.state(), count(&a.qp))
}

/// A request the target refuses (a wrong rkey, out of bounds, a region without the
/// right, a region of another protection domain) ends exactly as when packets carry
/// it: the same status, both queue pairs in the same states.
#[test]
fn refused_requests_end_as_on_the_packets() {
    for case in 0..5 {
        let packets = refused(&PACKETS, case);
        let fast = refused(&FAST, case);
        assert_eq!(fast, packets, "case {case}");
        assert_eq!(
            fast,
            (WcStatus::RemAccessErr, QpState::Err, QpState::Err, 0),
            "case {case}"
        );
    }
}

/// The target deregisters the region a stream of WRITEs and READs runs to: the
/// requests before succeed, the first after fails with a remote access error (the
/// initiator's queue pair then fails), and nothing else happens.
#[test]
fn deregistration_during_traffic() {
    let pair = pair(&FAST);
    let (a, b) = (&pair.a, &pair.b);
    let n = 64 << 10;
    let src = conformance::register(&a.pd, n, ALL);
    let dst = conformance::register(&b.pd, n, ALL);
    let remote = conformance::raddr(&dst, 0);
    let done = AtomicUsize::new(0);
    let statuses = std::thread::scope(|s| {
        s.spawn(|| {
            let deadline = Instant::now() + conformance::DEADLINE;
            while done.load(Ordering::Relaxed) < 200 && Instant::now() < deadline {
                std::thread::yield_now();
            }
            drop(dst);
        });
        let mut statuses = Vec::new();
        let deadline = Instant::now() + conformance::DEADLINE;
        for i in 0u64.. {
            assert!(Instant::now() < deadline, "the deregistration never showed");
            let req = if i % 2 == 0 {
                SendRequest::write(i, remote)
            } else {
                SendRequest::read(i, remote)
            };
            a.qp.post_send(req.sge(conformance::sge(&src, 0, n)))
                .unwrap();
            let c = conformance::wait_one(&a.scq, "traffic");
            assert_eq!(c.wr_id, i);
            statuses.push(c.status);
            done.fetch_add(1, Ordering::Relaxed);
            if c.status != WcStatus::Success {
                break;
            }
        }
        statuses
    });
    let (last, before) = statuses.split_last().unwrap();
    assert!(before.len() >= 200);
    assert!(before.iter().all(|&s| s == WcStatus::Success));
    assert_eq!(*last, WcStatus::RemAccessErr);
    assert_eq!(a.qp.state(), QpState::Err);
    assert!(count(&a.qp) >= 200, "the traffic ran at post");
}

/// Two contexts, a queue pair of each posting WRITEs to a queue pair of the other at
/// once, while both contexts register and deregister memory all along: a copy at post
/// holds the initiator's key table and then the target's, and registration waits for
/// them, so the two directions must never leave each other, and the writers, waiting
/// for good. Every WRITE completes, with its bytes.
#[test]
fn crossed_posts_and_registrations_never_wait_for_each_other() {
    let (ca, cb) = (FAST.open(), FAST.open());
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let cq = |c: &Context| c.create_cq(64).unwrap();
    let (sa, ra, sb, rb) = (cq(&ca), cq(&ca), cq(&cb), cq(&cb));
    let qp = |pd: &rdmx::ProtectionDomain, s, r| {
        pd.create_qp_of_type(QpType::Rc, s, r, None, QpCaps::default())
            .unwrap()
    };
    // a1 -> b1 and b2 -> a2, each pair connected both ways.
    let (a1, b1, b2, a2) = (
        qp(&pa, &sa, &ra),
        qp(&pb, &sb, &rb),
        qp(&pb, &sb, &rb),
        qp(&pa, &sa, &ra),
    );
    let opts = FAST.options();
    for (x, y) in [(&a1, &b1), (&b2, &a2)] {
        x.connect(y.endpoint(), &opts).unwrap();
        y.connect(x.endpoint(), &opts).unwrap();
        wait_direct(x, y);
    }
    let n = 4096;
    let (src_a, dst_b) = (
        conformance::register(&pa, n, ALL),
        conformance::register(&pb, n, ALL),
    );
    let (src_b, dst_a) = (
        conformance::register(&pb, n, ALL),
        conformance::register(&pa, n, ALL),
    );
    let stop = std::sync::atomic::AtomicBool::new(false);
    let finished = std::sync::atomic::AtomicBool::new(false);
    let before = count(&a1) + count(&b2);
    std::thread::scope(|s| {
        // A deadlock would hang the scope: fail the run instead.
        s.spawn(|| {
            let deadline = Instant::now() + conformance::DEADLINE * 6;
            while !finished.load(Ordering::Relaxed) {
                if Instant::now() > deadline {
                    eprintln!("crossed posts and registrations waited for each other for good");
                    std::process::exit(101);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        for pd in [&pa, &pb] {
            let stop = &stop;
            s.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    drop(conformance::register(pd, 4096, ALL));
                }
            });
        }
        let posters: Vec<_> = [(&a1, &sa, &src_a, &dst_b), (&b2, &sb, &src_b, &dst_a)]
            .into_iter()
            .map(|(qp, cq, src, dst)| {
                s.spawn(move || {
                    for i in 0..20_000u64 {
                        src.write_at(0, &i.to_le_bytes()).unwrap();
                        qp.post_send(
                            SendRequest::write(i, conformance::raddr(dst, 0))
                                .sge(conformance::sge(src, 0, n)),
                        )
                        .unwrap();
                        let c = conformance::wait_one(cq, "a crossed WRITE");
                        assert_eq!((c.wr_id, c.status), (i, WcStatus::Success));
                        let mut got = [0u8; 8];
                        dst.read_at(0, &mut got).unwrap();
                        assert_eq!(u64::from_le_bytes(got), i);
                    }
                })
            })
            .collect();
        for p in posters {
            p.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        finished.store(true, Ordering::Relaxed);
    });
    assert!(
        count(&a1) + count(&b2) - before >= 6000,
        "the WRITEs ran at post"
    );
}

/// UC WRITEs run at post too; a UC WRITE with immediate data takes the packets.
#[test]
fn uc_writes_run_at_post() {
    let side = || crate::uc_side(FAST.open());
    let (_ca, pa, sa, _ra, qa) = side();
    let (_cb, pb, _sb, rb, qb) = side();
    let opts = FAST.options();
    qa.connect(qb.endpoint(), &opts).unwrap();
    qb.connect(qa.endpoint(), &opts).unwrap();
    wait_direct(&qa, &qb);
    let n = 100_000;
    let src = conformance::register(&pa, n, ALL);
    let dst = conformance::register(&pb, n, ALL);
    let data = conformance::fill(&src, 3);
    let mut expect = conformance::fill(&dst, 4);
    for (i, (off, len)) in [(0, 10), (5, 5000), (17, 80_000)].into_iter().enumerate() {
        qa.post_send(
            SendRequest::write(i as u64, conformance::raddr(&dst, off + 3))
                .sge(conformance::sge(&src, off, len)),
        )
        .unwrap();
        let c = conformance::wait_one(&sa, "a UC WRITE");
        assert_eq!((c.wr_id, c.status), (i as u64, WcStatus::Success));
        expect[off + 3..off + 3 + len].copy_from_slice(&data[off..off + len]);
        conformance::assert_bytes(&conformance::image(&dst), &expect, "UC WRITE");
    }
    assert_eq!(count(&qa), 3);
    qb.post_recv(RecvRequest::new(7)).unwrap();
    qa.post_send(
        SendRequest::write_with_imm(9, conformance::raddr(&dst, 0), 5)
            .sge(conformance::sge(&src, 1, 20_000)),
    )
    .unwrap();
    let c = conformance::wait_one(&rb, "a UC WRITE with immediate data");
    assert_eq!((c.wr_id, c.imm_data), (7, Some(5)));
    expect[..20_000].copy_from_slice(&data[1..20_001]);
    conformance::assert_bytes(&conformance::image(&dst), &expect, "UC WRITE_WITH_IMM");
    assert_eq!(conformance::wait_one(&sa, "its completion").wr_id, 9);
    assert_eq!(count(&qa), 3, "WRITE_WITH_IMM took the packets");
}
