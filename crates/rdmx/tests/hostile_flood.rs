//! A peer that floods a tcp QP with requests and never reads the answers.
//!
//! The attacker is the peer the victim QP expects (it dials with the right hello) and holds
//! a valid rkey for a 64 KiB region. It sends READ requests for the whole region, and
//! duplicate WRITEs, as fast as the socket takes them for a few seconds, without ever
//! reading a byte back. Each READ asks for 64 KiB of responses, so a server that queued
//! what it owes would grow by gigabytes. Checked: resident memory stays within a fixed
//! bound, the victim's memory is unchanged by the duplicates, and a connection to the same
//! context still completes a WRITE and a READ-back afterwards.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use rdmx::{
    Access, CompletionQueue, ConnectOptions, Context, LocalSge, MemoryRegion, PeerAddr,
    ProtectionDomain, QpCaps, QpEndpoint, QpState, QueuePair, RemoteAddr, SendRequest, WcStatus,
};
use rdmx_wire::{BthRepr, Opcode, RcRepr, RethRepr};

#[path = "common/memory.rs"]
mod memory;

const DEADLINE: Duration = Duration::from_secs(30);
const FLOOD: Duration = Duration::from_secs(3);
const FAKE_QPN: u32 = 1;
const FAKE_PSN: u32 = 0x100;
const REGION: usize = 64 * 1024;
/// Resident memory the flood may add, against the gigabytes of responses it asks for.
const BOUND: usize = 64 << 20;

fn qp_in(pd: &ProtectionDomain) -> (QueuePair, CompletionQueue) {
    let cq = pd.context().create_cq(64).expect("create a CQ");
    let qp = pd
        .create_qp(&cq, &cq, QpCaps::default())
        .expect("create a QP");
    (qp, cq)
}

fn frame(op: Opcode, qp: u32, psn: u32, reth: RethRepr, payload: &[u8]) -> Vec<u8> {
    let mut r = RcRepr::new(BthRepr {
        opcode: op,
        solicited: false,
        migreq: false,
        pad_count: 0,
        pkey: 0xffff,
        fecn: false,
        becn: false,
        dest_qpn: qp,
        ack_req: true,
        psn,
    });
    r.reth = Some(reth);
    r.payload = payload;
    let mut out = vec![0u8; 4 + r.buffer_len()];
    let n = r.emit_with_payload(&mut out[4..]).expect("emit");
    out[..4].copy_from_slice(&(n as u32).to_be_bytes());
    out.truncate(4 + n);
    out
}

fn image(mr: &MemoryRegion) -> Vec<u8> {
    let mut v = vec![0u8; mr.len()];
    mr.read_at(0, &mut v).expect("read a region");
    v
}

#[track_caller]
fn wait_success(cq: &CompletionQueue, id: u64) {
    let start = Instant::now();
    loop {
        if let Some(c) = cq.poll_one().expect("poll") {
            assert_eq!((c.wr_id, c.status), (id, WcStatus::Success), "{c:?}");
            return;
        }
        assert!(start.elapsed() < DEADLINE, "request {id} did not complete");
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// A tcp context with a region of [`REGION`] bytes open to every access, a victim QP
/// connected to a fake peer, and that peer: a stream that dialed the context and said
/// the victim's hello (with its secret).
struct Flooded {
    server: Context,
    pd: ProtectionDomain,
    target: MemoryRegion,
    victim: QueuePair,
    _victim_cq: CompletionQueue,
    peer: TcpStream,
}

fn flooded() -> Flooded {
    let server = Context::open_provider("tcp").expect("open a tcp context");
    let pd = server.alloc_pd();
    let target = pd
        .register(vec![0u8; REGION], Access::ALL)
        .expect("register");
    let (victim, victim_cq) = qp_in(&pd);
    let fake = QpEndpoint {
        qp_num: FAKE_QPN,
        psn: FAKE_PSN,
        mtu: 65536,
        secret: 0,
        addr: PeerAddr::Ip(SocketAddr::from(([127, 0, 0, 1], 9))),
    };
    victim
        .connect(fake, &ConnectOptions::default())
        .expect("connect the victim");
    let port = server.listen_addr().expect("a listener").port();
    let mut peer = TcpStream::connect(("127.0.0.1", port)).expect("dial");
    let mut hello = b"RDMXTCP2".to_vec();
    hello.extend_from_slice(&victim.qp_num().to_be_bytes());
    hello.extend_from_slice(&FAKE_QPN.to_be_bytes());
    hello.extend_from_slice(&victim.endpoint().secret.to_be_bytes());
    peer.write_all(&hello).expect("hello");
    Flooded {
        server,
        pd,
        target,
        victim,
        _victim_cq: victim_cq,
        peer,
    }
}

/// A QP of a new tcp context connected to a new QP of `pd`'s context (`a` to `b`), and
/// a region of `len` bytes of `fill` in the new context for `a`'s requests.
struct Client {
    _ctx: Context,
    a: QueuePair,
    a_cq: CompletionQueue,
    _b: QueuePair,
    _b_cq: CompletionQueue,
    local: MemoryRegion,
}

fn client_of(pd: &ProtectionDomain, len: usize, fill: u8) -> Client {
    let ctx = Context::open_provider("tcp").expect("open a tcp context");
    let cpd = ctx.alloc_pd();
    let (a, a_cq) = qp_in(&cpd);
    let (b, b_cq) = qp_in(pd);
    a.connect(b.endpoint(), &ConnectOptions::default())
        .expect("connect A");
    b.connect(a.endpoint(), &ConnectOptions::default())
        .expect("connect B");
    let local = cpd
        .register(vec![fill; len], Access::LOCAL_WRITE)
        .expect("register");
    Client {
        _ctx: ctx,
        a,
        a_cq,
        _b: b,
        _b_cq: b_cq,
        local,
    }
}

#[test]
fn requests_from_a_peer_that_never_reads_keep_memory_bounded() {
    let _running = memory::alone();
    let Flooded {
        server: _server,
        pd,
        target,
        victim,
        _victim_cq,
        peer: mut s,
    } = flooded();
    let pattern: Vec<u8> = (0..REGION).map(|i| (i * 31 + 7) as u8).collect();
    target.write_at(0, &pattern).expect("fill");
    s.set_write_timeout(Some(Duration::from_millis(200)))
        .expect("SO_SNDTIMEO");
    let reth = |len: usize| RethRepr {
        va: target.addr() as u64,
        rkey: target.rkey(),
        dma_len: len as u32,
    };
    // A READ of the whole region at the expected PSN, then its duplicates; and WRITEs
    // behind the expected PSN (duplicates of requests never made), which must not land.
    let read = frame(
        Opcode::RdmaReadRequest,
        victim.qp_num(),
        FAKE_PSN,
        reth(REGION),
        &[],
    );
    let dup_write = frame(
        Opcode::RdmaWriteOnly,
        victim.qp_num(),
        FAKE_PSN - 1,
        reth(64),
        &[],
    );
    let mut batch = Vec::new();
    for i in 0..512 {
        batch.extend_from_slice(if i % 2 == 0 { &read } else { &dup_write });
    }

    let base = memory::rss_kib() as usize * 1024;
    let start = Instant::now();
    let mut frames = 0usize;
    while start.elapsed() < FLOOD {
        // A full socket (the server stopped reading) is fine: keep trying until the end.
        if s.write_all(&batch).is_ok() {
            frames += 512;
        }
    }
    let grown = (memory::rss_kib() as usize * 1024).saturating_sub(base);
    eprintln!(
        "{frames} frames asking for {} GiB of READ responses; resident memory grew by {} KiB",
        (frames / 2 * REGION) >> 30,
        grown >> 10
    );
    assert!(frames > 0, "the server took no frame at all");
    assert!(
        grown < BOUND,
        "resident memory grew by {grown} bytes during the flood"
    );
    assert!(
        image(&target) == pattern,
        "a duplicate WRITE changed the victim's memory"
    );
    // Once the attacker goes, its QP fails promptly: the flood left no backlog of work.
    drop(s);
    let start = Instant::now();
    while victim.state() != QpState::Err {
        assert!(
            start.elapsed() < DEADLINE,
            "the victim QP is still in {:?}",
            victim.state()
        );
        std::thread::sleep(Duration::from_millis(1));
    }

    // The same context still serves a valid connection.
    // (Bound whole: the client's context and its peer QP must live on.)
    let client = client_of(&pd, 2 * 4096, 0);
    let (a, a_cq, local) = (&client.a, &client.a_cq, &client.local);
    let data: Vec<u8> = (0..4096).map(|i| (i * 7 + 1) as u8).collect();
    local.write_at(0, &data).expect("fill");
    let remote = RemoteAddr {
        addr: target.addr() as u64,
        rkey: target.rkey(),
    };
    let sge = |off| LocalSge::new(local, off, 4096).expect("SGE");
    a.post_send(SendRequest::write(1, remote).sge(sge(0)))
        .expect("post a WRITE");
    wait_success(a_cq, 1);
    a.post_send(SendRequest::read(2, remote).sge(sge(4096)))
        .expect("post a READ");
    wait_success(a_cq, 2);
    let mut back = vec![0u8; 4096];
    local.read_at(4096, &mut back).expect("read");
    assert!(back == data, "the READ did not return what the WRITE wrote");
}

/// A peer that keeps its QP's socket full (empty duplicate WRITEs: 32 bytes each, which
/// the writer copies faster than the engine handles them, and which the engine answers
/// with nothing but an ACK now and then) does not keep the context's driver from the
/// other queue pairs: a WRITE between two other QPs, one of them in the flooded
/// context, completes while the flood goes on.
#[test]
fn a_flooding_peer_does_not_starve_the_other_queue_pairs() {
    let _running = memory::alone();
    let Flooded {
        server: _server,
        pd,
        target,
        victim,
        _victim_cq,
        peer: mut s,
    } = flooded();
    let dup_write = frame(
        Opcode::RdmaWriteOnly,
        victim.qp_num(),
        FAKE_PSN - 1,
        RethRepr {
            va: target.addr() as u64,
            rkey: target.rkey(),
            dma_len: 0,
        },
        &[],
    );
    let batch: Vec<u8> = dup_write.repeat(4096);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let start = Instant::now();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if start.elapsed() > DEADLINE {
                    return false;
                }
                let _ = s.write_all(&batch);
            }
            true
        })
    };
    // The flood is under way.
    std::thread::sleep(Duration::from_millis(200));
    // (Bound whole: the client's context and its peer QP must live on.)
    let client = client_of(&pd, 4096, 5);
    let (a, a_cq, local) = (&client.a, &client.a_cq, &client.local);
    let remote = RemoteAddr {
        addr: target.addr() as u64,
        rkey: target.rkey(),
    };
    for i in 0..20 {
        a.post_send(SendRequest::write(i, remote).sge(LocalSge::new(local, 0, 4096).expect("SGE")))
            .expect("post a WRITE");
        wait_success(a_cq, i);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(
        flood.join().expect("the flood"),
        "the WRITEs completed only once the flood had stopped"
    );
}
