//! Arbitrary ring contents for an shm queue pair to consume.
//!
//! Each input gets a fresh pair of connected shm queue pairs (one process, two contexts,
//! the smallest rings). The victim posts a receive, then the input is written where the
//! next record of the victim's incoming ring would start, as a broken or hostile peer
//! could write it, its first four bytes (the kind word, which publishes a record) last.
//!
//! Checked: no panic; the victim's polls return within a deadline; its QP ends in RTS
//! (the records were harmless) or ERR (a broken rule, logged); the posted receive
//! completes at most once; a region without remote access never changes.
#![no_main]

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use rdmx::{
    Access, ConnectOptions, Context, LocalSge, MemoryRegion, ProtectionDomain, QpCaps, QpState,
    RecvRequest,
};

const LEN: usize = 4096;
const DEADLINE: Duration = Duration::from_secs(5);

struct Fixture {
    victim: Context,
    vpd: ProtectionDomain,
    peer: Context,
    open: MemoryRegion,
    closed: MemoryRegion,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let opts = || rdmx::shm::Options::default().ring_bytes(64 << 10);
        let victim = Context::open(opts()).expect("open shm");
        let peer = Context::open(opts()).expect("open shm");
        let vpd = victim.alloc_pd();
        let open = vpd.register(vec![0u8; LEN], Access::ALL).expect("register");
        let closed = vpd
            .register(vec![0x5au8; LEN], Access::LOCAL_WRITE)
            .expect("register");
        Fixture {
            victim,
            vpd,
            peer,
            open,
            closed,
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    let bytes = data;

    let vcq = f.victim.create_cq(16).expect("cq");
    let pcq = f.peer.create_cq(16).expect("cq");
    let vqp = f.vpd.create_qp(&vcq, &vcq, QpCaps::default()).expect("qp");
    let pqp = f
        .peer
        .alloc_pd()
        .create_qp(&pcq, &pcq, QpCaps::default())
        .expect("qp");
    let opts = ConnectOptions::default();
    let (ve, pe) = (vqp.endpoint(), pqp.endpoint());
    vqp.connect(pe, &opts).expect("connect");
    pqp.connect(ve, &opts).expect("connect");
    vqp.post_recv(RecvRequest::new(1).sge(LocalSge::new(&f.open, 0, LEN).unwrap()))
        .expect("post a receive");
    // The segment is handed over by the progress thread after `connect` returns: wait
    // for it (a busy machine may take a while) before scribbling on it.
    let start = Instant::now();
    while let Err(e) = rdmx::shm::testing::scribble_incoming(&vqp, bytes) {
        assert!(start.elapsed() < DEADLINE, "scribble: {e:?}");
        std::thread::sleep(Duration::from_millis(1));
    }

    let start = Instant::now();
    let mut completions = 0;
    for _ in 0..200 {
        while let Some(c) = vcq.poll_one().expect("poll") {
            assert_eq!(c.wr_id, 1, "a completion nobody posted: {c:?}");
            completions += 1;
        }
        let _ = pcq.poll_one();
        assert!(
            start.elapsed() < DEADLINE,
            "the victim's polls took too long"
        );
        if vqp.state() == QpState::Err && completions > 0 {
            break;
        }
    }
    assert!(
        completions <= 1,
        "the receive completed {completions} times"
    );
    assert!(
        matches!(vqp.state(), QpState::Rts | QpState::Err),
        "the victim QP is in {:?}",
        vqp.state()
    );
    let mut got = vec![0u8; LEN];
    f.closed.read_at(0, &mut got).unwrap();
    assert!(
        got.iter().all(|&b| b == 0x5a),
        "a region without remote access changed"
    );
    drop((vqp, pqp));
});
