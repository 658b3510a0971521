//! Frames cut short or stopped midway, in either direction: SENDs, WRITEs and READ
//! responses part-way through, against deregistration, ERR and reset; and requests
//! flushed before they were sent, which send nothing of their memory.

use super::*;

/// A length-prefixed SEND ONLY from the fake peer to `qp`.
fn send_frame(qp: u32, psn: u32, payload: &[u8]) -> Vec<u8> {
    let mut r = RcRepr::new(bth(Opcode::SendOnly, qp, psn, true));
    r.payload = payload;
    framed(&r)
}

/// Waits until byte `at` of `mr` is `value` (the victim placed a payload that far).
fn wait_byte(mr: &rdmx::MrRef, at: usize, value: u8, what: &str) {
    let start = Instant::now();
    loop {
        let mut b = [0u8; 1];
        mr.read_at(at, &mut b).expect("read");
        if b[0] == value {
            return;
        }
        assert!(start.elapsed() < DEADLINE, "{what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A SEND whose payload stops part-way before the peer closes does not complete its
/// receive with success: the message never arrived whole.
#[test]
fn a_send_cut_short_does_not_complete_its_receive() {
    let _running = memory::beside();
    let srv = Server::new();
    let v = srv.victim();
    let mut s = srv.dial(&v);
    let f = send_frame(v.qp.qp_num(), FAKE_PSN, &[0xEE; 48]);
    s.write_all(&f[..f.len() - 16])
        .expect("send part of a frame");
    s.shutdown(std::net::Shutdown::Write).expect("shutdown");
    wait_closed(&mut s);
    wait_state(&v.qp, QpState::Err);
    let c = wait_one(&v.cq, "the victim's receive");
    assert_eq!((c.wr_id, c.status), (77, WcStatus::WrFlushErr), "{c:?}");
}

/// A peer that stops part-way through a frame, keeping its stream open, fails the QP
/// within its retry budget (ack timeout × tries): the receive is flushed, and what the
/// half-read packet's headers completed does not complete with success.
#[test]
fn a_peer_stopped_mid_frame_fails_the_qp_within_its_retry_budget() {
    let _running = memory::beside();
    let srv = Server::new();
    let (qp, cq) = qp_in(&srv.pd);
    let mr = region(&srv.pd, 3);
    let mut opts = ConnectOptions::default();
    opts.timeout = 12; // 4.096 µs × 2^12 ≈ 17 ms, raised to the tcp floor of 0.5 s
    opts.retry_cnt = 2;
    let fake = fake_peer(FAKE_QPN);
    qp.connect(fake, &opts).expect("connect");
    qp.post_recv(RecvRequest::new(77).sge(LocalSge::new(&mr, 0, 64).expect("SGE")))
        .expect("post a receive");
    let mut s = srv.connect_raw();
    s.write_all(&hello(qp.qp_num(), FAKE_QPN, qp.endpoint().secret))
        .expect("hello");
    let f = send_frame(qp.qp_num(), FAKE_PSN, &[0xEE; 48]);
    // (Timed from before the write: the QP's timer may start as soon as it is made.)
    let start = Instant::now();
    s.write_all(&f[..f.len() - 16])
        .expect("send part of a frame");
    wait_state(&qp, QpState::Err);
    let took = start.elapsed();
    let c = wait_one(&cq, "the receive");
    assert_eq!((c.wr_id, c.status), (77, WcStatus::WrFlushErr), "{c:?}");
    assert!(
        took >= Duration::from_millis(1000) && took < Duration::from_secs(10),
        "the QP failed after {took:?}, not after its retry budget (1.5 s)"
    );
    wait_logged("WARN", &["sent nothing more of a frame part-way read"]);
    drop(s);
}

/// A QP part-way through reading its peer's frame still sends the rest of the frame it
/// was itself part-way through writing: two peers each in the middle of the other's
/// frame then both finish (before, each waited for the other for good).
#[test]
fn a_qp_mid_frame_finishes_writing_its_own_frame() {
    let _running = memory::beside();
    let srv = Server::new();
    let v = srv.victim();
    let mut s = srv.dial(&v);
    // Megabytes of WRITEs the fake peer does not read: the victim's stream fills, with
    // a frame part-way written.
    let big = srv
        .pd
        .register(vec![7u8; 1 << 20], Access::LOCAL_WRITE)
        .expect("register");
    for id in 0..16u64 {
        let sge = LocalSge::new(&big, 0, 1 << 20).expect("SGE");
        v.qp.post_send(
            SendRequest::write(
                id,
                RemoteAddr {
                    addr: 0x1000,
                    rkey: 0x1234,
                },
            )
            .sge(sge),
        )
        .expect("post");
    }
    std::thread::sleep(Duration::from_millis(200));
    // Now the victim goes part-way through a frame of the peer's.
    let f = write_frame(
        v.qp.qp_num(),
        FAKE_PSN,
        v.mr.addr() as u64,
        v.mr.rkey(),
        &[0xEE; 256],
    );
    s.write_all(&f[..f.len() - 128])
        .expect("send part of a frame");
    std::thread::sleep(Duration::from_millis(100));
    // The peer reads: the victim's bytes must end on a frame boundary.
    s.set_read_timeout(Some(Duration::from_secs(2)))
        .expect("SO_RCVTIMEO");
    let mut frames = 0;
    loop {
        let mut len = [0u8; 4];
        match s.read_exact(&mut len) {
            Ok(()) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                break
            }
            Err(e) => panic!("reading the victim's frames: {e}"),
        }
        let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
        s.read_exact(&mut body).unwrap_or_else(|e| {
            panic!("the victim stopped part-way through frame {frames} it was sending: {e}")
        });
        frames += 1;
    }
    assert!(frames > 0, "the victim sent nothing");
}

/// A QP moved to ERR with WRITEs still queued for its stream (the peer reads slowly)
/// sends nothing of their memory once their flushed completions are out: what the
/// application writes there afterwards never reaches the peer.
#[test]
fn flushed_requests_send_nothing_of_their_memory() {
    let _running = memory::beside();
    let srv = Server::new();
    let v = srv.victim();
    let mut s = srv.dial(&v);
    // One WRITE of more than the stream buffers while the peer does not read: a frame
    // of it is part-way written, and more wait behind it.
    const BIG: usize = 16 << 20;
    let big = srv
        .pd
        .register(vec![0xAAu8; BIG], Access::LOCAL_WRITE)
        .expect("register");
    let to = RemoteAddr {
        addr: 0x1000,
        rkey: 0x1234,
    };
    v.qp.post_send(SendRequest::write(1, to).sge(LocalSge::new(&big, 0, BIG).expect("SGE")))
        .expect("post");
    std::thread::sleep(Duration::from_millis(200));
    move_to(&v.qp, QpState::Err);
    let mut flushed = false;
    while !flushed {
        let c = wait_one(&v.cq, "the flushed WRITE");
        if c.wr_id == 1 {
            assert_eq!(c.status, WcStatus::WrFlushErr, "{c:?}");
            flushed = true;
        }
    }
    // The application has its memory back.
    big.write_at(0, &vec![0x55u8; BIG]).expect("write");
    s.set_read_timeout(Some(Duration::from_secs(2)))
        .expect("SO_RCVTIMEO");
    let mut got = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                break
            }
            Err(e) => panic!("reading the victim's stream: {e}"),
        }
    }
    assert!(got.len() > 1 << 16, "the victim sent {} bytes", got.len());
    assert!(
        !got.windows(64).any(|w| w.iter().all(|&b| b == 0x55)),
        "memory written after its request was flushed reached the peer"
    );
}

/// A WRITE of `REGION` bytes into the victim's region, sent half: the first half is in
/// place when this returns. Returns the stream, the rest of the frame, and a reference
/// that keeps the region's memory readable.
fn half_a_write(srv: &Server, v: &Victim) -> (TcpStream, Vec<u8>, rdmx::MrRef) {
    let mut s = srv.dial(v);
    let f = write_frame(
        v.qp.qp_num(),
        FAKE_PSN,
        v.mr.addr() as u64,
        v.mr.rkey(),
        &[0xEE; REGION],
    );
    let half = f.len() - REGION / 2;
    s.write_all(&f[..half]).expect("send half of a WRITE");
    // The first half is in place once the victim has read it.
    let keep = v.mr.share();
    wait_byte(
        &keep,
        REGION / 2 - 1 - 16,
        0xEE,
        "the first half never landed",
    );
    (s, f[half..].to_vec(), keep)
}

/// Whether the second half of the victim's region still holds what it held before.
fn second_half_unchanged(keep: &rdmx::MrRef, before: &[u8]) -> bool {
    let mut now = vec![0u8; REGION];
    keep.read_at(0, &mut now).expect("read");
    now[REGION / 2..] == before[REGION / 2..]
}

/// A region deregistered while a peer's WRITE into it is part-way read: once the
/// deregistration returns, nothing more of the WRITE reaches the memory (the rest
/// arrives after it), and the QP fails rather than completing the WRITE.
#[test]
fn a_write_part_way_read_stops_at_deregistration() {
    let _running = memory::beside();
    let srv = Server::new();
    let v = srv.victim();
    let (mut s, rest, keep) = half_a_write(&srv, &v);
    let Victim { qp, cq, mr, before } = v;
    drop(mr);
    s.write_all(&rest).expect("send the rest");
    wait_state(&qp, QpState::Err);
    let c = wait_one(&cq, "the victim's receive");
    assert_eq!((c.wr_id, c.status), (77, WcStatus::WrFlushErr), "{c:?}");
    assert!(
        second_half_unchanged(&keep, &before),
        "bytes of the WRITE landed after the region was deregistered"
    );
    wait_logged("WARN", &["being deregistered"]);
}

/// A QP moved to ERR part-way through reading a peer's WRITE places nothing more of it:
/// the rest, arriving after the move, does not reach the memory (a QP in ERR takes no
/// more of its peer's bytes, so a fence through another channel is one).
#[test]
fn a_write_part_way_read_stops_when_the_qp_goes_to_err() {
    let _running = memory::beside();
    let srv = Server::new();
    let v = srv.victim();
    let (mut s, rest, keep) = half_a_write(&srv, &v);
    move_to(&v.qp, QpState::Err);
    // The rest arrives after the move; the stream may be gone already.
    let _ = s.write_all(&rest);
    let c = wait_one(&v.cq, "the victim's receive");
    assert_eq!((c.wr_id, c.status), (77, WcStatus::WrFlushErr), "{c:?}");
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        second_half_unchanged(&keep, &v.before),
        "bytes of the WRITE landed after the QP went to ERR"
    );
}

/// A QP moved to RESET part-way through a peer's SEND payload does not complete its
/// receive with success.
#[test]
fn a_reset_part_way_through_a_send_completes_nothing_with_success() {
    let _running = memory::beside();
    let srv = Server::new();
    let v = srv.victim();
    let mut s = srv.dial(&v);
    let f = send_frame(v.qp.qp_num(), FAKE_PSN, &[0xEE; 48]);
    s.write_all(&f[..f.len() - 16])
        .expect("send part of a frame");
    // The headers are read once the first payload bytes are placed.
    wait_byte(&v.mr.share(), 0, 0xEE, "the payload never started");
    move_to(&v.qp, QpState::Reset);
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(300) {
        if let Some(c) = v.cq.poll_one().expect("poll") {
            assert_ne!(c.status, WcStatus::Success, "{c:?}");
        }
    }
    drop(s);
}

/// A READ response cut short fails the READ, not the SEND before it that its headers
/// acknowledged: that SEND was executed.
#[test]
fn a_read_response_cut_short_fails_the_read_only() {
    let _running = memory::beside();
    let srv = Server::new();
    let v = srv.victim();
    let mut s = srv.dial(&v);
    let src = srv
        .pd
        .register(vec![1u8; 64], Access::LOCAL_WRITE)
        .expect("register");
    v.qp.post_send(SendRequest::send(1).sge(LocalSge::new(&src, 0, 16).expect("SGE")))
        .expect("post the SEND");
    let remote = RemoteAddr {
        addr: 0x1000,
        rkey: 0x1234,
    };
    v.qp.post_send(SendRequest::read(2, remote).sge(LocalSge::new(&v.mr, 0, 64).expect("SGE")))
        .expect("post the READ");
    let send = RcRepr::parse_bytes(&read_frame(&mut s))
        .expect("the SEND")
        .bth
        .psn;
    let read = RcRepr::parse_bytes(&read_frame(&mut s))
        .expect("the READ")
        .bth
        .psn;
    assert_eq!(read, (send + 1) & 0xff_ffff);
    let mut r = RcRepr::new(bth(
        Opcode::RdmaReadResponseOnly,
        v.qp.qp_num(),
        read,
        false,
    ));
    r.aeth = Some(rdmx_wire::AethRepr {
        syndrome: Syndrome::Ack {
            credits: rdmx_wire::Credits::UNLIMITED,
        },
        msn: 2,
    });
    let payload = [0xAB; 64];
    r.payload = &payload;
    let f = framed(&r);
    s.write_all(&f[..f.len() - 32])
        .expect("send part of the response");
    s.shutdown(std::net::Shutdown::Write).expect("shutdown");
    let mut got = Vec::new();
    while got.len() < 3 {
        got.push(wait_one(&v.cq, "the victim's completions"));
    }
    got.sort_by_key(|c| c.wr_id);
    assert_eq!(
        got.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [
            (1, WcStatus::Success),
            (2, WcStatus::WrFlushErr),
            (77, WcStatus::WrFlushErr)
        ],
        "{got:?}"
    );
}
