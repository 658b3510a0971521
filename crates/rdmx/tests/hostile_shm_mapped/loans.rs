//! The initiator's own regions, which requests on the mapped path borrow past its key
//! table's lock: a loan gives a request no more than its region does, and ends with the
//! region's registration.

use super::*;

/// A source of 4 KiB of `fill` bytes on the initiator, registered with `access` and
/// owned by its region; the test keeps the memory alive past the region.
fn kept_source(a: &Side, fill: u8, access: Access) -> (Arc<Mapping>, MemoryRegion) {
    let m = Arc::new(Mapping::shared(4096).unwrap());
    // SAFETY: nothing else refers to the new mapping, which is 4096 bytes long.
    unsafe { std::ptr::write_bytes(m.as_ptr(), fill, 4096) };
    let mr = a.pd.register(Owned(m.clone()), access).unwrap();
    (m, mr)
}

/// Posts `wr` as it is (its elements may name what the safe API would not let a request
/// name), and waits for its completion.
fn post_raw(a: &Side, wr: &rdmx::SendWr) -> Completion {
    // SAFETY: the elements name the test's own mapping, which outlives the request and
    // which the test does not hold references into while it is outstanding.
    unsafe { a.qp.post_send_raw(wr, None) }.unwrap();
    wait(&a.cq, "a request posted raw")
}

/// Deregistering a region a queue pair borrows ends the loan: a request naming its old
/// lkey is refused (a local protection error), nothing of the memory it covered goes
/// out, and a region registered since is lent in its turn.
#[test]
fn a_lent_region_does_not_outlive_its_registration() {
    let (a, b, _src, m, mr) = writable_pair(LEN, 0);
    let (_keep, lent) = kept_source(&a, 5, Access::LOCAL_WRITE);
    // The first WRITE lends the region, the next ones borrow it.
    write_until_mapped(&a, &lent, mr.remote().at(0));
    write_until_mapped(&a, &lent, mr.remote().at(64));
    let stale = SendRequest::write(31, mr.remote().at(128))
        .sge(LocalSge::new(&lent, 0, 64).unwrap())
        .wr()
        .clone();
    drop(lent);
    let before = rdmx::shm::executed_at_post(&a.qp).unwrap();
    let c = post_raw(&a, &stale);
    assert_eq!((c.wr_id, c.status), (31, WcStatus::LocProtErr));
    assert_eq!(rdmx::shm::executed_at_post(&a.qp), Some(before));
    drop(mr);
    let got = bytes(&m);
    assert_eq!(&got[..128], &[5u8; 128][..], "the WRITEs before landed");
    assert!(
        got[128..192].iter().all(|&x| x == 0),
        "a WRITE naming a deregistered region went out"
    );
    // A new pair on the same contexts: a region registered now is lent and borrowed.
    let qp = a.pd.create_qp(&a.cq, &a.cq, QpCaps::default()).unwrap();
    let tq = b.pd.create_qp(&b.cq, &b.cq, QpCaps::default()).unwrap();
    qp.connect(tq.endpoint(), &ConnectOptions::default())
        .unwrap();
    tq.connect(qp.endpoint(), &ConnectOptions::default())
        .unwrap();
    let a = Side { qp, ..a };
    let (m2, mr2) = register_owned(&b, LEN, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let (_keep, fresh) = kept_source(&a, 6, Access::LOCAL_WRITE);
    write_until_mapped(&a, &fresh, mr2.remote().at(0));
    write_until_mapped(&a, &fresh, mr2.remote().at(64));
    drop((fresh, mr2, tq));
    assert_eq!(&bytes(&m2)[..128], &[6u8; 128][..]);
}

/// A request that names the lent region gets only what the region grants: one past its
/// end, or a READ into a region without local writes, is refused as the table refuses
/// it (a local protection error), and nothing is copied.
#[test]
fn a_loan_grants_only_what_the_region_does() {
    for (what, read) in [
        ("past the end", false),
        ("READ into a read-only region", true),
    ] {
        // The target grants READs too: the local rights are the only thing the READ
        // lacks.
        let (a, b) = pair();
        let (m, mr) = register_owned(
            &b,
            LEN,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        );
        let access = match read {
            true => Access::empty(),
            false => Access::LOCAL_WRITE,
        };
        let (_keep, lent) = kept_source(&a, 7, access);
        write_until_mapped(&a, &lent, mr.remote().at(0));
        let mut wr = match read {
            true => SendRequest::read(41, mr.remote().at(0)),
            false => SendRequest::write(41, mr.remote().at(4096)),
        }
        .sge(LocalSge::new(&lent, 0, 64).unwrap())
        .wr()
        .clone();
        if !read {
            // Its last 32 bytes lie past the region.
            let mut sge = wr.sges[0];
            sge.addr += 4096 - 32;
            wr.sges.clear();
            wr.sges.push(sge);
        }
        let before = rdmx::shm::executed_at_post(&a.qp).unwrap();
        let c = post_raw(&a, &wr);
        assert_eq!((c.wr_id, c.status), (41, WcStatus::LocProtErr), "{what}");
        assert_eq!(rdmx::shm::executed_at_post(&a.qp), Some(before), "{what}");
        drop((lent, mr, b));
        assert!(
            bytes(&m)[4096..4096 + 64].iter().all(|&x| x == 0),
            "{what}: a refused request's bytes landed"
        );
    }
}
