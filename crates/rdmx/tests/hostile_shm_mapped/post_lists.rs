//! Post lists on the mapped path: the requests of a list to one region share one claim
//! and are still checked one by one, requests that name one element of the region on
//! loan take the lean path with a claim each, a long list claims again, and a list that
//! mixes both paths never waits on the key table.

use super::*;

/// A post list's requests to one region claim it once, and each is still checked: those
/// within the region execute at post, one beyond it gets the target's own refusal, and
/// the one behind that is flushed with the queue pair. (The first request has two
/// elements, as do the others after it: a lone element of the region on loan would take
/// the lean path, which claims for itself; see `the_lean_path_runs_a_post_list`.)
#[test]
fn a_post_list_under_one_claim_checks_every_request() {
    let (a, _b, src, m, mr) = writable_pair(LEN, 7);
    let at = |off: usize| mr.remote().at(off as u64);
    write_until_mapped(&a, &src, at(LEN - 64));
    let before = rdmx::shm::executed_at_post(&a.qp).unwrap();
    let sge = |off, len| LocalSge::new(&src, off, len).unwrap();
    let list = [
        SendRequest::write(10, at(0))
            .sge(sge(0, 50))
            .sge(sge(50, 50)),
        SendRequest::write(11, at(1000))
            .sge(sge(100, 100))
            .sge(sge(200, 100)),
        SendRequest::write(12, at(LEN - 32))
            .sge(sge(0, 32))
            .sge(sge(32, 32)),
        SendRequest::write(13, at(2000))
            .sge(sge(0, 32))
            .sge(sge(32, 32)),
    ];
    a.qp.post_send_list(&list).unwrap();
    assert_eq!(
        rdmx::shm::executed_at_post(&a.qp),
        Some(before + 2),
        "the requests within the region execute at post, the others take the rings"
    );
    let got: Vec<_> = completions(&a.cq, 4)
        .iter()
        .map(|c| (c.wr_id, c.status))
        .collect();
    assert_eq!(
        got,
        [
            (10, WcStatus::Success),
            (11, WcStatus::Success),
            (12, WcStatus::RemAccessErr),
            (13, WcStatus::WrFlushErr),
        ]
    );
    drop(mr);
    let seen = bytes(&m);
    assert!(seen[..100].iter().all(|&x| x == 7));
    assert!(seen[1000..1200].iter().all(|&x| x == 7));
    assert!(
        seen[2000..2064].iter().all(|&x| x == 0),
        "a flushed WRITE landed"
    );
    assert!(
        seen[LEN - 32..].iter().all(|&x| x == 7),
        "the first WRITE there ran"
    );
}

/// A post list's requests that each name one element of the region on loan, or carry
/// inline bytes, take the lean path one by one: each makes and ends its own claim, and
/// all land. Behind a request that holds the list's claim (two elements) they run under
/// that claim instead: the lean path never takes the claim word while the list holds it.
#[test]
fn the_lean_path_runs_a_post_list() {
    let (a, _b, src, m, mr) = writable_pair(LEN, 6);
    let at = |off: u64| mr.remote().at(off);
    write_until_mapped(&a, &src, at(LEN as u64 - 64));
    let sge = |off, len| LocalSge::new(&src, off, len).unwrap();
    let counts = || {
        (
            rdmx::shm::executed_at_post(&a.qp).unwrap(),
            testing::claims_made(&a.qp).unwrap(),
        )
    };
    let (ran, claims) = counts();
    let lone = [
        SendRequest::write(50, at(0)).sge(sge(0, 64)),
        SendRequest::write(51, at(64)).inline(&[8u8; 16]),
        SendRequest::write(52, at(128)).sge(sge(64, 64)),
    ];
    a.qp.post_send_list(&lone).unwrap();
    assert_eq!(
        counts(),
        (ran + 3, claims + 3),
        "three lean requests, three claims"
    );
    let held = [
        SendRequest::write(53, at(256))
            .sge(sge(0, 32))
            .sge(sge(32, 32)),
        SendRequest::write(54, at(320)).sge(sge(0, 64)),
        SendRequest::write(55, at(384)).inline(&[8u8; 16]),
    ];
    a.qp.post_send_list(&held).unwrap();
    assert_eq!(counts(), (ran + 6, claims + 4), "one claim for the list");
    let got = completions(&a.cq, 6);
    assert!(got.iter().all(|c| c.status == WcStatus::Success), "{got:?}");
    drop(mr);
    let seen = bytes(&m);
    for (range, fill) in [
        (0..64, 6),
        (64..80, 8),
        (128..192, 6),
        (256..384, 6),
        (384..400, 8),
    ] {
        assert!(seen[range.clone()].iter().all(|&x| x == fill), "{range:?}");
    }
    assert!(seen[80..128].iter().all(|&x| x == 0));
}

/// A post list to one key claims it once, and again after every 64 MiB it copied under
/// one claim: a long list never holds a claim long enough to look stalled to a
/// deregistration that waits for it.
#[test]
fn a_long_post_list_claims_again() {
    const BIG: usize = 32 << 20;
    let (a, b) = pair();
    let src = a.pd.register(vec![3u8; BIG], Access::LOCAL_WRITE).unwrap();
    let m = Mapping::shared(BIG).unwrap();
    let mr = register(&b, &m, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let at = mr.remote().at(0);
    write_until_mapped(&a, &src, at);
    // Two elements each, so that the requests run under the list's claim (a lone element
    // of the region on loan would take the lean path, which claims for itself).
    let half = |k| LocalSge::new(&src, k * BIG / 2, BIG / 2).unwrap();
    let list: Vec<_> = (0..3)
        .map(|i| SendRequest::write(20 + i, at).sge(half(0)).sge(half(1)))
        .collect();
    let (claims, ran) = (
        testing::claims_made(&a.qp).unwrap(),
        rdmx::shm::executed_at_post(&a.qp).unwrap(),
    );
    a.qp.post_send_list(&list).unwrap();
    assert_eq!(rdmx::shm::executed_at_post(&a.qp), Some(ran + 3));
    // 32 MiB, then 64 under the first claim; the third request makes a second.
    assert_eq!(testing::claims_made(&a.qp).unwrap(), claims + 2);
    let got = completions(&a.cq, 3);
    assert!(got.iter().all(|c| c.status == WcStatus::Success), "{got:?}");
    drop(mr);
    assert!(bytes(&m).iter().all(|&x| x == 3));
}

/// A post list whose first request runs on the mapped path (the list keeps the key
/// table read-locked for its requests on that path) and whose second goes to the engine
/// (which locks the table again) never stalls, while another thread registers and
/// deregisters regions of the same table over and over (writers waiting for the lock).
#[test]
fn a_post_list_of_both_paths_never_stalls_on_the_key_table() {
    const ROUNDS: u64 = 2000;
    let (a, b, src, _m, mr) = writable_pair(LEN, 4);
    let at = mr.remote().at(0);
    write_until_mapped(&a, &src, at);
    let inbox = b.pd.register(vec![0u8; 64], Access::LOCAL_WRITE).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let churn = {
        let (pd, stop) = (a.pd.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                drop(pd.register(vec![0u8; 4096], Access::LOCAL_WRITE).unwrap());
                n += 1;
            }
            n
        })
    };
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let poster = std::thread::spawn(move || {
        let sge = LocalSge::new(&src, 0, 64).unwrap();
        // Two elements: the WRITE takes the list's path, which read-locks the key table
        // whenever the churn voided the queue pair's loan (a lone element of the region
        // on loan would take the lean path, which never locks it).
        let halves = [
            LocalSge::new(&src, 0, 32).unwrap(),
            LocalSge::new(&src, 32, 32).unwrap(),
        ];
        let mut mapped = 0;
        for i in 0..ROUNDS {
            b.qp.post_recv(RecvRequest::new(i).sge(LocalSge::new(&inbox, 0, 64).unwrap()))
                .unwrap();
            let before = rdmx::shm::executed_at_post(&a.qp).unwrap();
            let list = [
                SendRequest::write(2 * i, at).sge(halves[0]).sge(halves[1]),
                SendRequest::send(2 * i + 1).sge(sge),
            ];
            a.qp.post_send_list(&list).unwrap();
            mapped += rdmx::shm::executed_at_post(&a.qp).unwrap() - before;
            for c in completions(&a.cq, 2) {
                assert_eq!(c.status, WcStatus::Success, "{c:?}");
            }
            let c = wait(&b.cq, "the receive");
            assert_eq!((c.status, c.wr_id), (WcStatus::Success, i), "{c:?}");
        }
        done_tx.send(mapped).unwrap();
    });
    let mapped = done_rx.recv_timeout(DEADLINE);
    stop.store(true, Ordering::Relaxed);
    // (Before the joins: stalled, both threads would wait for good.)
    let mapped = mapped.expect("a post list stalled on the key table");
    let regions = churn.join().unwrap();
    poster.join().unwrap();
    assert!(regions > 0, "no region was registered meanwhile");
    assert_eq!(mapped, ROUNDS, "every list's WRITE ran on the mapped path");
}
