//! tcp and shm between two processes: this test binary runs itself again as the peer,
//! and the two connect through `rdmx::cm`. Each test runs on both providers (`_shm`),
//! shm on its default ring data path, on the cma one (`_shm_cma`) and on the mapped one
//! (`_shm_mapped`: the regions are memfd-backed, and WRITEs and READs on an empty send
//! queue are executed by the initiator through its mapping of the peer's memory).
//!
//! - every opcode crosses the process boundary with its data checked on both sides;
//! - a peer killed with SIGKILL while requests are outstanding makes every one of them
//!   complete with an error status, and nothing hangs;
//! - a peer killed while WRITEs stream to it: each completes exactly once, those after
//!   the kill with an error, and the QP and region, once dropped, leave no registration
//!   and no mapping behind.

mod common;

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use rdmx::{
    cm, Access, Completion, CompletionQueue, ConnectOptions, Context, LocalSge, ProtectionDomain,
    QpCaps, QueuePair, RecvRequest, RemoteAddr, SendRequest, WcStatus,
};

const PEER_ENV: &str = "RDMX_TEST_PEER_ADDR";
const MODE_ENV: &str = "RDMX_TEST_PEER_MODE";
const PROVIDER_ENV: &str = "RDMX_TEST_PEER_PROVIDER";
const REGION: usize = 1 << 20;
const HALF: usize = REGION / 2;
/// The 8-byte counter for atomics, at the end of the peer's region.
const COUNTER: usize = REGION - 8;
const TIMEOUT: Duration = Duration::from_secs(30);

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect()
}

struct Side {
    _ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
}

fn side(provider: &str) -> Side {
    let ctx = match provider {
        "shm-cma" => Context::open(rdmx::shm::Options::default().cma(true)),
        "shm-mapped" => Context::open(rdmx::shm::Options::default().mapped(true)),
        p => Context::open_provider(p),
    }
    .expect("open the provider");
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(4096).expect("cq");
    let caps = QpCaps::default().max_send_wr(256).max_recv_wr(64);
    let qp = pd.create_qp(&cq, &cq, caps).expect("qp");
    Side {
        _ctx: ctx,
        pd,
        cq,
        qp,
    }
}

/// A region of `len` bytes with `access`: memfd-backed on the mapped data path.
fn region(provider: &str, pd: &ProtectionDomain, len: usize, access: Access) -> rdmx::MemoryRegion {
    if provider == "shm-mapped" {
        pd.register(rdmx::Mapping::shared(len).unwrap(), access)
    } else {
        pd.register(vec![0u8; len], access)
    }
    .expect("register")
}

fn region_bytes(r: &rdmx::RemoteRegion) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&r.addr.to_be_bytes());
    v.extend_from_slice(&r.len.to_be_bytes());
    v.extend_from_slice(&r.rkey.to_be_bytes());
    v
}

fn remote_from(b: &[u8]) -> (u64, u32) {
    assert_eq!(b.len(), 20, "peer's private data");
    (
        u64::from_be_bytes(b[..8].try_into().unwrap()),
        u32::from_be_bytes(b[16..20].try_into().unwrap()),
    )
}

fn wait(cq: &CompletionQueue, what: &str) -> Completion {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Some(c) = cq.poll_one().expect("poll") {
            return c;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::yield_now();
    }
}

fn ok(cq: &CompletionQueue, wr_id: u64, what: &str) -> Completion {
    let c = wait(cq, what);
    assert_eq!(
        (c.wr_id, c.status),
        (wr_id, WcStatus::Success),
        "{what}: {c:?}"
    );
    c
}

fn spawn_peer(addr: std::net::SocketAddr, mode: &str, provider: &str) -> Child {
    Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "peer_process", "--nocapture", "--test-threads=1"])
        .env(PEER_ENV, addr.to_string())
        .env(MODE_ENV, mode)
        .env(PROVIDER_ENV, provider)
        .spawn()
        .expect("spawn the peer process")
}

/// The peer's side; a no-op unless this process was spawned as the peer.
#[test]
fn peer_process() {
    let Ok(addr) = std::env::var(PEER_ENV) else {
        return;
    };
    let mode = std::env::var(MODE_ENV).unwrap_or_default();
    let provider = std::env::var(PROVIDER_ENV).unwrap_or_else(|_| "tcp".into());
    let s = side(&provider);
    let region = region(&provider, &s.pd, REGION, Access::ALL);
    region.write_at(HALF, &pattern(2, HALF - 8)).unwrap();
    let inbox = s.pd.register(vec![0u8; 64], Access::LOCAL_WRITE).unwrap();
    cm::connect(
        addr.as_str(),
        std::slice::from_ref(&s.qp),
        &ConnectOptions::default(),
        &region_bytes(&region.remote()),
        TIMEOUT,
    )
    .expect("peer: connect");
    if mode == "die" {
        // Posts no receive, so the other side's SENDs wait (RNR) until this process dies.
        std::thread::sleep(Duration::from_secs(600));
        return;
    }
    // (A SEND that arrives before this receive is answered RNR and retried.)
    s.qp.post_recv(RecvRequest::new(1).sge(LocalSge::new(&inbox, 0, 64).unwrap()))
        .unwrap();
    // The other side's SEND says it is done; then check what it did to this memory.
    let c = ok(&s.cq, 1, "peer: the done message");
    assert_eq!(c.byte_len, 4);
    let mut got = vec![0u8; HALF];
    region.read_at(0, &mut got).unwrap();
    let good = got == pattern(1, HALF) && region.load_u64(COUNTER).unwrap() == 100;
    let reply =
        s.pd.register(vec![u8::from(good)], Access::LOCAL_WRITE)
            .unwrap();
    s.qp.post_send(SendRequest::send(2).sge(LocalSge::new(&reply, 0, 1).unwrap()))
        .unwrap();
    ok(&s.cq, 2, "peer: reply sent");
    assert!(good, "peer: the WRITE data or the atomics' result is wrong");
}

#[test]
fn every_opcode_between_two_processes() {
    every_opcode_between_two_processes_on("tcp");
}

#[test]
fn every_opcode_between_two_processes_shm() {
    every_opcode_between_two_processes_on("shm");
}

#[test]
fn every_opcode_between_two_processes_shm_cma() {
    every_opcode_between_two_processes_on("shm-cma");
}

fn every_opcode_between_two_processes_on(provider: &str) {
    let listener = cm::Listener::bind("127.0.0.1:0").unwrap();
    let mut child = spawn_peer(listener.local_addr().unwrap(), "check", provider);
    let s = side(provider);
    let local = region(provider, &s.pd, REGION, Access::ALL);
    let reply = s.pd.register(vec![0u8; 8], Access::LOCAL_WRITE).unwrap();
    let theirs = listener
        .accept(
            std::slice::from_ref(&s.qp),
            &ConnectOptions::default(),
            &region_bytes(&local.remote()),
            TIMEOUT,
        )
        .expect("accept the peer");
    if provider.starts_with("shm") {
        let want = match provider {
            "shm" => "ring",
            "shm-mapped" => "mapped",
            _ => "cma",
        };
        let deadline = Instant::now() + TIMEOUT;
        while rdmx::shm::data_path(&s.qp).is_none() {
            assert!(Instant::now() < deadline, "the shm connection never came");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(rdmx::shm::data_path(&s.qp), Some(want));
    }
    s.qp.post_recv(RecvRequest::new(10).sge(LocalSge::new(&reply, 0, 8).unwrap()))
        .unwrap();
    let (raddr, rkey) = remote_from(&theirs);
    let at = |off: usize| RemoteAddr {
        addr: raddr + off as u64,
        rkey,
    };

    // WRITE the first half, READ the second half back.
    local.write_at(0, &pattern(1, HALF)).unwrap();
    // On the mapped path the peer's file comes over its socket after the connection: the
    // same WRITE goes again until one is executed through the mapping.
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let before = rdmx::shm::executed_at_post(&s.qp);
        s.qp.post_send(SendRequest::write(1, at(0)).sge(LocalSge::new(&local, 0, HALF).unwrap()))
            .unwrap();
        ok(&s.cq, 1, "WRITE");
        if provider != "shm-mapped" || rdmx::shm::executed_at_post(&s.qp) > before {
            break;
        }
        assert!(Instant::now() < deadline, "no WRITE ran on the mapped path");
        std::thread::sleep(Duration::from_millis(1));
    }
    let executed = rdmx::shm::executed_at_post(&s.qp);
    s.qp.post_send(
        SendRequest::read(2, at(HALF)).sge(LocalSge::new(&local, HALF, HALF - 8).unwrap()),
    )
    .unwrap();
    ok(&s.cq, 2, "READ");
    if provider == "shm-mapped" {
        assert_eq!(
            rdmx::shm::executed_at_post(&s.qp),
            executed.map(|n| n + 1),
            "the READ ran on the mapped path"
        );
    }
    let mut got = vec![0u8; HALF - 8];
    local.read_at(HALF, &mut got).unwrap();
    assert!(
        got == pattern(2, HALF - 8),
        "READ data differs from the peer's"
    );

    // Atomics on the peer's counter: 5 × FETCH_ADD 3, then CMP_SWAP 15 → 100.
    for i in 0..5u64 {
        s.qp.post_send(
            SendRequest::fetch_add(3 + i, at(COUNTER), 3).sge(LocalSge::new(&local, 0, 8).unwrap()),
        )
        .unwrap();
        ok(&s.cq, 3 + i, "FETCH_ADD");
        assert_eq!(local.load_u64(0).unwrap(), 3 * i, "FETCH_ADD's old value");
    }
    s.qp.post_send(
        SendRequest::compare_swap(8, at(COUNTER), 15, 100)
            .sge(LocalSge::new(&local, 0, 8).unwrap()),
    )
    .unwrap();
    ok(&s.cq, 8, "CMP_SWAP");
    assert_eq!(local.load_u64(0).unwrap(), 15, "CMP_SWAP's old value");

    // SEND "done"; the peer checks its memory and answers.
    s.qp.post_send(SendRequest::send(9).inline(b"done"))
        .unwrap();
    let mut seen = Vec::new();
    for _ in 0..2 {
        let c = wait(&s.cq, "the SEND and the peer's answer");
        assert_eq!(c.status, WcStatus::Success, "{c:?}");
        seen.push(c.wr_id);
    }
    seen.sort();
    assert_eq!(seen, [9, 10]);
    let mut verdict = [0u8; 1];
    reply.read_at(0, &mut verdict).unwrap();
    assert_eq!(
        verdict,
        [1],
        "the peer found its memory as this side wrote it"
    );
    let status = child.wait().unwrap();
    assert!(status.success(), "peer process: {status}");
}

#[test]
fn every_opcode_between_two_processes_shm_mapped() {
    every_opcode_between_two_processes_on("shm-mapped");
}

#[test]
fn killed_peer_fails_every_outstanding_request() {
    killed_peer_fails_every_outstanding_request_on("tcp");
}

#[test]
fn killed_peer_fails_every_outstanding_request_shm() {
    killed_peer_fails_every_outstanding_request_on("shm");
}

#[test]
fn killed_peer_fails_every_outstanding_request_shm_cma() {
    killed_peer_fails_every_outstanding_request_on("shm-cma");
}

#[test]
fn killed_peer_fails_every_outstanding_request_shm_mapped() {
    killed_peer_fails_every_outstanding_request_on("shm-mapped");
}

fn killed_peer_fails_every_outstanding_request_on(provider: &str) {
    let listener = cm::Listener::bind("127.0.0.1:0").unwrap();
    let mut child = spawn_peer(listener.local_addr().unwrap(), "die", provider);
    let s = side(provider);
    let local = region(provider, &s.pd, REGION, Access::ALL);
    local.write_at(0, &[7u8; REGION]).unwrap();
    let theirs = listener
        .accept(
            std::slice::from_ref(&s.qp),
            &ConnectOptions::default(),
            &region_bytes(&local.remote()),
            TIMEOUT,
        )
        .expect("accept the peer");
    let (raddr, rkey) = remote_from(&theirs);
    // A SEND the peer never has a receive for (RNR, retried forever), and WRITEs and
    // READs queued behind it.
    s.qp.post_send(SendRequest::send(0).sge(LocalSge::new(&local, 0, 64).unwrap()))
        .unwrap();
    let n = 100;
    for i in 1..=n {
        let remote = RemoteAddr { addr: raddr, rkey };
        let req = if i % 2 == 0 {
            SendRequest::write(i, remote)
        } else {
            SendRequest::read(i, remote)
        };
        s.qp.post_send(req.sge(LocalSge::new(&local, 0, HALF).unwrap()))
            .unwrap();
    }
    std::thread::sleep(Duration::from_millis(200));
    child.kill().unwrap();
    child.wait().unwrap();
    let killed = Instant::now();
    let mut ids = Vec::new();
    for _ in 0..=n {
        let c = wait(&s.cq, "an outstanding request to fail");
        assert_ne!(c.status, WcStatus::Success, "{c:?}");
        ids.push(c.wr_id);
    }
    ids.sort();
    assert_eq!(
        ids,
        (0..=n).collect::<Vec<_>>(),
        "each request completes once"
    );
    assert_eq!(s.qp.state(), rdmx::QpState::Err);
    assert!(killed.elapsed() < TIMEOUT);
}

#[test]
fn peer_killed_mid_stream_fails_the_rest_and_leaks_nothing() {
    peer_killed_mid_stream_fails_the_rest_and_leaks_nothing_on("tcp");
}

#[test]
fn peer_killed_mid_stream_fails_the_rest_and_leaks_nothing_shm() {
    peer_killed_mid_stream_fails_the_rest_and_leaks_nothing_on("shm");
}

#[test]
fn peer_killed_mid_stream_fails_the_rest_and_leaks_nothing_shm_cma() {
    peer_killed_mid_stream_fails_the_rest_and_leaks_nothing_on("shm-cma");
}

fn peer_killed_mid_stream_fails_the_rest_and_leaks_nothing_on(provider: &str) {
    // WRITEs stream to the peer; it is killed once some have completed. Every request
    // completes exactly once, those after the kill with an error status, within the
    // deadline; then dropping the QP and the region deregisters and unmaps the memory.
    let listener = cm::Listener::bind("127.0.0.1:0").unwrap();
    let mut child = spawn_peer(listener.local_addr().unwrap(), "die", provider);
    let Side {
        _ctx: ctx,
        pd,
        cq,
        qp,
    } = side(provider);
    let local = pd
        .register(rdmx::Mapping::shared(REGION).unwrap(), Access::ALL)
        .unwrap();
    let theirs = listener
        .accept(
            std::slice::from_ref(&qp),
            &ConnectOptions::default(),
            &region_bytes(&local.remote()),
            TIMEOUT,
        )
        .expect("accept the peer");
    let (raddr, rkey) = remote_from(&theirs);
    let remote = RemoteAddr { addr: raddr, rkey };
    let n = 2000u64;
    let (mut posted, mut done, mut ok_count) = (0u64, 0u64, 0u64);
    let mut seen = vec![false; n as usize];
    let mut killed = None;
    let start = Instant::now();
    loop {
        // Keep up to 200 WRITEs in flight; once the QP is in ERR posting fails at once,
        // and only what was posted completes.
        while posted < n && posted - done < 200 {
            let req =
                SendRequest::write(posted, remote).sge(LocalSge::new(&local, 0, HALF).unwrap());
            match qp.post_send(req) {
                Ok(()) => posted += 1,
                Err(_) if killed.is_some() => break,
                Err(e) => panic!("post: {e}"),
            }
        }
        if done == posted {
            break;
        }
        let c = wait(&cq, "a WRITE to complete");
        assert!(!seen[c.wr_id as usize], "completed twice: {c:?}");
        seen[c.wr_id as usize] = true;
        done += 1;
        if c.status == WcStatus::Success {
            ok_count += 1;
        }
        if ok_count == 50 && killed.is_none() {
            child.kill().unwrap();
            killed = Some(Instant::now());
        }
        assert!(start.elapsed() < 2 * TIMEOUT, "the stream did not end");
    }
    child.wait().unwrap();
    let killed = killed.expect("the peer was killed");
    assert!(
        ok_count >= 50 && ok_count < posted,
        "{ok_count} of {posted} succeeded"
    );
    assert!(
        seen[..posted as usize].iter().all(|&s| s),
        "every posted WRITE completed"
    );
    assert!(killed.elapsed() < TIMEOUT);
    assert_eq!(qp.state(), rdmx::QpState::Err);
    // The region is memfd-backed so that its file, not its address (which another test
    // thread may map again at once), shows whether it is still mapped.
    let file = common::mapped_file(local.addr()).expect("the region is a mapped memfd");
    drop(qp);
    drop(local);
    assert_eq!(ctx.registered_regions(), 0, "a registration leaked");
    assert!(
        !common::file_is_mapped(&file),
        "the registered memory is still mapped"
    );
    drop(cq);
}
