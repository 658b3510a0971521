//! Destroying a queue pair lets go of the application's memory at once, as
//! `ibv_destroy_qp` does: once a queue pair with requests in flight and the region they
//! use are dropped, the region's memory is unmapped before the second drop returns,
//! whatever the provider's progress thread is doing with the queue pair at that moment.
//!
//! Each software provider gets connected pairs (each side its own context, as two
//! processes would have). A streams WRITEs to B and, with some in flight and B's
//! acknowledgements arriving, drops its queue pair and then its region. The region is
//! memfd-backed, so its file, not its address (which another thread may map again at
//! once), shows whether it is still mapped. Many rounds: the race this guards against is
//! narrow. A progress thread that holds the queue pair while it handles an
//! acknowledgement would otherwise drop the queue pair, and with it the requests' hold on
//! the memory, on its own thread a moment later.

mod common;

use std::time::{Duration, Instant};

use rdmx::{Access, ConnectOptions, Context, LocalSge, Mapping, QpCaps, RemoteAddr, SendRequest};

const ROUNDS: usize = 100;
const REGION: usize = 256 << 10;
const MSG: usize = 8 << 10;
/// WRITEs posted per round: more than go out at once, so that some are in flight, and
/// some queued, when the queue pair goes.
const WRITES: u64 = 48;

fn open_udp() -> rdmx::Result<Context> {
    common::open_udp(10)
}

fn destroy_with_requests_in_flight(open: fn() -> rdmx::Result<Context>) {
    let (ca, cb) = (open().unwrap(), open().unwrap());
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let target = pb
        .register(
            Mapping::new(REGION).unwrap(),
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        )
        .unwrap();
    let remote = RemoteAddr {
        addr: target.addr() as u64,
        rkey: target.rkey(),
    };
    for round in 0..ROUNDS {
        let (qa, qb) = (ca.create_cq(256).unwrap(), cb.create_cq(256).unwrap());
        let caps = QpCaps::default().max_send_wr(WRITES as usize);
        let a = pa.create_qp(&qa, &qa, caps).unwrap();
        let b = pb.create_qp(&qb, &qb, QpCaps::default()).unwrap();
        let opts = ConnectOptions::default();
        a.connect(b.endpoint(), &opts).unwrap();
        b.connect(a.endpoint(), &opts).unwrap();
        let mr = pa
            .register(Mapping::shared(REGION).unwrap(), Access::LOCAL_WRITE)
            .unwrap();
        let file = common::mapped_file(mr.addr()).expect("the region is a mapped memfd");
        for id in 0..WRITES {
            let off = (id as usize * MSG) % REGION;
            let sge = LocalSge::new(&mr, off, MSG).unwrap();
            a.post_send(SendRequest::write(id, remote).sge(sge))
                .unwrap();
        }
        // The first completion: acknowledgements are arriving, the progress threads
        // handle the queue pair.
        let deadline = Instant::now() + Duration::from_secs(10);
        while qa.poll_one().unwrap().is_none() {
            assert!(
                Instant::now() < deadline,
                "round {round}: no WRITE completed"
            );
        }
        drop(a);
        drop(mr);
        assert_eq!(
            ca.registered_regions(),
            0,
            "round {round}: a registration leaked"
        );
        assert!(
            !common::file_is_mapped(&file),
            "round {round}: the region's memory is still mapped after its queue pair and \
             it were dropped"
        );
        drop(b);
    }
}

#[test]
fn destroying_a_queue_pair_releases_its_memory_at_once_loopback() {
    destroy_with_requests_in_flight(Context::open_default);
}

#[test]
fn destroying_a_queue_pair_releases_its_memory_at_once_tcp() {
    destroy_with_requests_in_flight(|| Context::open_provider("tcp"));
}

#[test]
fn destroying_a_queue_pair_releases_its_memory_at_once_shm() {
    destroy_with_requests_in_flight(|| Context::open_provider("shm"));
}

#[test]
fn destroying_a_queue_pair_releases_its_memory_at_once_udp() {
    destroy_with_requests_in_flight(open_udp);
}
