//! tcp in busy-poll mode: no progress threads, polling a CQ drives its context. Posts
//! made between two polls leave together, and the ACKs a poll's packets cause wait for
//! the next poll or ride with the next request. Each side here has a thread polling its
//! own CQ, as an application must; the tests check that nothing is lost or delayed for
//! good on those deferred paths: bursts larger than the path MTU (payloads read in
//! several pieces), READs, a SEND ping-pong whose every ACK is deferred, and large
//! receives, whose completion must wait until the last byte of their payload is read.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdmx::{
    cm, Access, Completion, CompletionQueue, ConnectOptions, Context, LocalSge, MemoryRegion,
    QpCaps, QueuePair, RecvRequest, SendRequest, WcOpcode, WcStatus,
};

const REGION: usize = 16 << 20;
const TIMEOUT: Duration = Duration::from_secs(30);
const DEPTH: usize = 64;

struct Side {
    _ctx: Context,
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
}

fn side() -> Side {
    let ctx = Context::open(rdmx::tcp::Options::default().busy_poll(true)).unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(1024).unwrap();
    let caps = QpCaps::default()
        .max_send_wr(DEPTH + 8)
        .max_recv_wr(DEPTH + 8);
    let qp = pd.create_qp(&cq, &cq, caps).unwrap();
    let mr = pd.register(vec![0u8; REGION], Access::ALL).unwrap();
    Side {
        _ctx: ctx,
        cq,
        qp,
        mr,
    }
}

/// Two busy-polled sides, connected through `rdmx::cm`.
fn pair() -> (Side, Side) {
    let (a, b) = (side(), side());
    let listener = cm::Listener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::scope(|s| {
        let t = s.spawn(|| {
            listener
                .accept(
                    std::slice::from_ref(&b.qp),
                    &ConnectOptions::default(),
                    &[],
                    TIMEOUT,
                )
                .unwrap()
        });
        cm::connect(
            addr,
            std::slice::from_ref(&a.qp),
            &ConnectOptions::default(),
            &[],
            TIMEOUT,
        )
        .unwrap();
        t.join().unwrap();
    });
    (a, b)
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn wait(cq: &CompletionQueue, what: &str) -> Completion {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Some(c) = cq.poll_one().unwrap() {
            assert_eq!(c.status, WcStatus::Success, "{what}: {c:?}");
            return c;
        }
        assert!(Instant::now() < deadline, "{what}: no completion");
    }
}

/// Sets its flag when dropped, also while unwinding from a failed assertion.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Polls `s`'s CQ until `stop`, as the passive side of one-sided traffic must; with
/// `echo`, answers each SEND with a SEND_WITH_IMM carrying its immediate plus one.
fn serve(s: &Side, stop: &AtomicBool, echo: bool) {
    // Stop on the test thread's deadline too, so that a failure there ends the test.
    let deadline = Instant::now() + 4 * TIMEOUT;
    if echo {
        for i in 0..DEPTH as u64 {
            let sge = LocalSge::new(&s.mr, 0, 64).unwrap();
            s.qp.post_recv(RecvRequest::new(i).sge(sge)).unwrap();
        }
    }
    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
        if let Some(c) = s.cq.poll_one().unwrap() {
            assert_eq!(c.status, WcStatus::Success, "server: {c:?}");
            if c.opcode == WcOpcode::Recv {
                let imm = c.imm_data.expect("a SEND with an immediate");
                let sge = LocalSge::new(&s.mr, 0, 64).unwrap();
                s.qp.post_recv(RecvRequest::new(c.wr_id).sge(sge)).unwrap();
                s.qp.post_send(SendRequest::send_with_imm(u64::from(imm), imm + 1).unsignaled())
                    .unwrap();
            }
        }
    }
}

#[test]
fn bursts_of_writes_and_reads_across_the_mtu_land_intact() {
    let (a, b) = pair();
    let stop = AtomicBool::new(false);
    // Sizes from one byte to four path MTUs, packed back to back in B's region.
    let sizes: Vec<usize> = (0..160u64)
        .map(|i| [1, 8, 100, 4096, 65_535, 65_536, 65_537, 200_000][i as usize % 8])
        .collect();
    std::thread::scope(|s| {
        s.spawn(|| serve(&b, &stop, false));
        let _stop = StopOnDrop(&stop);
        for round in 0..2u64 {
            let mut off = 0usize;
            let mut places = Vec::new();
            for (i, &len) in sizes.iter().enumerate() {
                assert!(off + len <= REGION / 2, "pieces fit without overlap");
                places.push((off, len, (round << 32) | i as u64));
                off += len;
            }
            // WRITE each piece from A's lower half to the same offset in B's lower half,
            // DEPTH outstanding, then READ it back into A's upper half.
            for op in ["write", "read"] {
                let mut posted = 0;
                let mut done = 0;
                while done < places.len() {
                    while posted < places.len() && posted - done < DEPTH {
                        let (off, len, seed) = places[posted];
                        let to = b.mr.remote_at(off);
                        let req = if op == "write" {
                            a.mr.write_at(off, &pattern(seed, len)).unwrap();
                            SendRequest::write(posted as u64, to)
                                .sge(LocalSge::new(&a.mr, off, len).unwrap())
                        } else {
                            SendRequest::read(posted as u64, to)
                                .sge(LocalSge::new(&a.mr, REGION / 2 + off, len).unwrap())
                        };
                        a.qp.post_send(req).unwrap();
                        posted += 1;
                    }
                    let c = wait(&a.cq, op);
                    assert_eq!(c.wr_id, done as u64, "{op}s complete in order");
                    // A completed WRITE has landed in B; a completed READ in A.
                    let (off, len, seed) = places[done];
                    let mut got = vec![0u8; len];
                    if op == "write" {
                        b.mr.read_at(off, &mut got).unwrap();
                    } else {
                        a.mr.read_at(REGION / 2 + off, &mut got).unwrap();
                    }
                    assert!(got == pattern(seed, len), "{op} {done} of {len} bytes");
                    done += 1;
                }
            }
        }
    });
}

#[test]
fn send_ping_pong_with_every_ack_deferred_never_stalls() {
    let (a, b) = pair();
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| serve(&b, &stop, true));
        let _stop = StopOnDrop(&stop);
        let sge = LocalSge::new(&a.mr, 0, 64).unwrap();
        a.qp.post_recv(RecvRequest::new(0).sge(sge)).unwrap();
        for k in 0..2000u32 {
            let imm = k * 2;
            a.qp.post_send(SendRequest::send_with_imm(u64::from(k), imm))
                .unwrap();
            // The send completion and the echo, in either order.
            let mut echoed = false;
            let mut sent = false;
            while !(echoed && sent) {
                let c = wait(&a.cq, "ping-pong");
                match c.opcode {
                    WcOpcode::Send => {
                        assert_eq!(c.wr_id, u64::from(k));
                        sent = true;
                    }
                    WcOpcode::Recv => {
                        assert_eq!(c.imm_data, Some(imm + 1), "round {k}");
                        let sge = LocalSge::new(&a.mr, 0, 64).unwrap();
                        a.qp.post_recv(RecvRequest::new(0).sge(sge)).unwrap();
                        echoed = true;
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
        }
    });
}

#[test]
fn a_large_receive_completes_only_once_its_bytes_have_landed() {
    let (a, b) = pair();
    let stop = AtomicBool::new(false);
    let sizes = [32 << 10, 64 << 10, 100_000, 1 << 20];
    let rounds = 400u64;
    std::thread::scope(|s| {
        // B checks each message the moment its receive completes, then clears the buffer.
        s.spawn(|| {
            let post = |i: u64| {
                let sge = LocalSge::new(&b.mr, 0, 1 << 20).unwrap();
                b.qp.post_recv(RecvRequest::new(i).sge(sge)).unwrap();
            };
            post(0);
            for round in 0..rounds {
                let c = wait(&b.cq, "B's receive");
                assert_eq!(c.opcode, WcOpcode::Recv);
                let len = c.byte_len as usize;
                assert_eq!(len, sizes[round as usize % sizes.len()]);
                let mut got = vec![0u8; len];
                b.mr.read_at(0, &mut got).unwrap();
                assert!(
                    got == pattern(round, len),
                    "round {round}: the receive of {len} bytes completed before its data landed"
                );
                b.mr.write_at(0, &vec![0u8; len]).unwrap();
                post(round + 1);
            }
            // Serve A's last ACKs.
            while !stop.load(Ordering::Relaxed) {
                let _ = b.cq.poll_one().unwrap();
            }
        });
        let _stop = StopOnDrop(&stop);
        for round in 0..rounds {
            let len = sizes[round as usize % sizes.len()];
            a.mr.write_at(0, &pattern(round, len)).unwrap();
            let sge = LocalSge::new(&a.mr, 0, len).unwrap();
            a.qp.post_send(SendRequest::send(round).sge(sge)).unwrap();
            let c = wait(&a.cq, "A's SEND");
            assert_eq!(c.wr_id, round);
        }
    });
}
