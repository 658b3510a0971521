//! Attacks before or instead of the hello: bad, half-open and truncated hellos, peers
//! that connect and stall, secrets of a reset queue pair's last connection, floods of
//! connections.

use super::*;

#[test]
fn bad_hellos_are_closed() {
    let _running = memory::beside();
    let mut srv = Server::new();
    let v = srv.victim();
    // Wrong magic; a QP that does not exist; a second stream for a connected QP.
    let mut s = srv.connect_raw();
    s.write_all(b"GET / HTTP/1.1\r\n\r\n").expect("send");
    wait_closed(&mut s);
    wait_logged("WARN", &["hello is not rdmx's"]);

    let mut s = srv.connect_raw();
    s.write_all(&hello(0xAB_CDEF, 5, 0)).expect("send");
    wait_closed(&mut s);
    wait_logged("WARN", &["QP that does not exist", "to=11259375"]);

    // The first stream is the victim's once a WRITE on it is acknowledged.
    let mut first = srv.dial(&v);
    let good = pattern(4, 32);
    first
        .write_all(&write_frame(
            v.qp.qp_num(),
            FAKE_PSN,
            v.mr.addr() as u64,
            v.mr.rkey(),
            &good,
        ))
        .expect("send");
    assert_eq!(nak_of(&read_frame(&mut first)), None);
    let mut second = srv.dial(&v);
    wait_closed(&mut second);
    wait_logged("WARN", &["second connection for a connected QP"]);
    // The first stream still works.
    let more = pattern(5, 32);
    let next = (FAKE_PSN + 1) & 0xff_ffff;
    first
        .write_all(&write_frame(
            v.qp.qp_num(),
            next,
            v.mr.addr() as u64 + 32,
            v.mr.rkey(),
            &more,
        ))
        .expect("send");
    assert_eq!(nak_of(&read_frame(&mut first)), None);
    let mut want = v.before.clone();
    want[..32].copy_from_slice(&good);
    want[32..64].copy_from_slice(&more);
    assert_image(&image(&v.mr), &want, "the victim's memory");
    srv.check_healthy();
}

#[test]
fn half_open_and_truncated_hellos_are_closed() {
    let _running = memory::beside();
    let mut srv = Server::new();
    for cut in [0usize, 1, 8, 15] {
        let mut s = srv.connect_raw();
        s.write_all(&hello(1234, 5, 0)[..cut]).expect("send");
        s.shutdown(std::net::Shutdown::Write).expect("shutdown");
        wait_closed(&mut s);
    }
    wait_logged(
        "DEBUG",
        &["dropping a connection", "closed before its hello"],
    );
    srv.check_healthy();
}

#[test]
fn peers_that_connect_and_stall_are_dropped() {
    let _running = memory::beside();
    // A stream that never finishes its hello is closed after the handshake timeout
    // (10 s); meanwhile the listener serves everyone else.
    let mut srv = Server::new();
    let mut silent = srv.connect_raw();
    let mut partial = srv.connect_raw();
    partial.write_all(b"RDMXT").expect("send");
    srv.check_healthy();
    wait_closed(&mut silent);
    wait_closed(&mut partial);
    wait_logged("WARN", &["sent no hello within"]);
    srv.check_healthy();
}

#[test]
fn a_reset_queue_pair_refuses_the_secret_of_its_last_connection() {
    let _running = memory::beside();
    // A QP back in RESET draws a new secret: a peer still holding the endpoint of its
    // last connection (here it claims the QP number of the next connection's peer) is
    // refused, and the next connection's peer, given the new endpoint, joins.
    let mut srv = Server::new();
    let v = srv.victim();
    let old = v.qp.endpoint();
    move_to(&v.qp, QpState::Err);
    move_to(&v.qp, QpState::Reset);
    let new = v.qp.endpoint();
    assert_ne!(old.secret, new.secret, "the reset kept the secret");
    assert_ne!(old.psn, new.psn, "the reset kept the first PSN");
    // Parked before the QP expects its peer, then after.
    let mut early = srv.connect_raw();
    early
        .write_all(&hello(v.qp.qp_num(), FAKE_QPN, old.secret))
        .expect("hello");
    wait_closed(&mut early);
    wait_logged("WARN", &["did not present the QP's secret"]);
    let fake = fake_peer(FAKE_QPN);
    v.qp.connect(fake, &ConnectOptions::default())
        .expect("connect");
    let mut late = srv.connect_raw();
    late.write_all(&hello(v.qp.qp_num(), FAKE_QPN, old.secret))
        .expect("hello");
    wait_closed(&mut late);
    // The peer with the new endpoint is taken: a WRITE on its stream is acknowledged.
    let mut s = srv.dial(&v);
    s.write_all(&write_frame(
        v.qp.qp_num(),
        FAKE_PSN,
        v.mr.addr() as u64,
        v.mr.rkey(),
        &pattern(6, 32),
    ))
    .expect("send");
    assert_eq!(nak_of(&read_frame(&mut s)), None);
    assert_eq!(v.qp.state(), QpState::Rts);
    srv.check_healthy();
}

#[test]
fn a_reset_queue_pair_expects_no_peer_until_its_next_rtr() {
    let _running = memory::beside();
    // A QP waiting in RTR for a peer that never came is reset: it expects that peer no
    // more, so the next connection's peer, dialing before the QP is back in RTR, is kept
    // for it (before, it was closed as "a QP other than the one expected").
    let mut srv = Server::new();
    let v = srv.victim();
    move_to(&v.qp, QpState::Err);
    move_to(&v.qp, QpState::Reset);
    const NEXT_QPN: u32 = FAKE_QPN + 1;
    let mut s = srv.connect_raw();
    s.write_all(&hello(v.qp.qp_num(), NEXT_QPN, v.qp.endpoint().secret))
        .expect("hello");
    std::thread::sleep(Duration::from_millis(100));
    let next = fake_peer(NEXT_QPN);
    v.qp.connect(next, &ConnectOptions::default())
        .expect("connect");
    s.write_all(&write_frame(
        v.qp.qp_num(),
        FAKE_PSN,
        v.mr.addr() as u64,
        v.mr.rkey(),
        &pattern(7, 32),
    ))
    .expect("send");
    assert_eq!(nak_of(&read_frame(&mut s)), None);
    srv.check_healthy();
}

#[test]
fn stalled_peer_fails_outstanding_requests_with_retry_exceeded() {
    let _running = memory::beside();
    // The peer says hello and then never answers: every request the victim sends must
    // complete with an error within timeout × (retries + 1), not hang (on tcp the ack
    // timeout is at least 0.5 s: 1.5 s here).
    let srv = Server::new();
    let registered = srv.ctx.registered_regions();
    let (qp, cq) = qp_in(&srv.pd);
    let mr = region(&srv.pd, 6);
    let mut opts = ConnectOptions::default();
    opts.timeout = 12; // 4.096 µs × 2^12 ≈ 17 ms
    opts.retry_cnt = 2;
    let fake = fake_peer(FAKE_QPN);
    qp.connect(fake, &opts).expect("connect");
    let mut s = srv.connect_raw();
    s.write_all(&hello(qp.qp_num(), FAKE_QPN, qp.endpoint().secret))
        .expect("hello");
    let remote = RemoteAddr {
        addr: 0x1000,
        rkey: 0x1234,
    };
    for id in 0..8u64 {
        let sge = LocalSge::new(&mr, (id as usize) * 64, 64).expect("SGE");
        let req = if id % 2 == 0 {
            SendRequest::write(id, remote).sge(sge)
        } else {
            SendRequest::read(id, remote).sge(sge)
        };
        qp.post_send(req).expect("post");
    }
    let before = image(&mr);
    let first = wait_one(&cq, "the first request");
    assert_eq!(
        (first.wr_id, first.status),
        (0, WcStatus::RetryExcErr),
        "{first:?}"
    );
    for id in 1..8u64 {
        let c = wait_one(&cq, "a later request");
        assert_eq!((c.wr_id, c.status), (id, WcStatus::WrFlushErr), "{c:?}");
    }
    assert_eq!(qp.state(), QpState::Err);
    assert_image(&image(&mr), &before, "READ targets without a response");
    // Every request has completed, so nothing holds the region: it goes with its handle.
    drop((qp, cq, mr));
    assert_eq!(
        srv.ctx.registered_regions(),
        registered,
        "a registration outlived the failed requests"
    );
    drop(s);
}

#[test]
fn connection_flood_keeps_memory_bounded() {
    let _running = memory::alone();
    // Hundreds of hostile connections, each opened, fed garbage and closed: the server's
    // memory must not grow with their number, and the listener must still serve.
    let mut srv = Server::new();
    let round = |n: u64| {
        for i in 0..n {
            let mut s = srv.connect_raw();
            let mut bytes = hello(0x77_0000 + i as u32, 5, 0).to_vec();
            bytes.extend_from_slice(&noise(i, 512));
            let _ = s.write_all(&bytes);
            wait_closed(&mut s);
        }
    };
    round(100);
    let base = memory::rss_kib() as usize * 1024;
    round(300);
    let grown = (memory::rss_kib() as usize * 1024).saturating_sub(base);
    assert!(
        grown < 32 << 20,
        "resident memory grew by {grown} bytes over 300 hostile connections"
    );
    srv.check_healthy();
}

#[test]
fn connections_that_say_nothing_are_bounded() {
    let _running = memory::beside();
    // 300 connections that send nothing: at most 256 wait for their hello, each new one
    // closing the one that waited longest, so the first ones are closed at once rather
    // than after the hello timeout; connections made now still work.
    let mut srv = Server::new();
    let mut silent: Vec<TcpStream> = (0..300).map(|_| srv.connect_raw()).collect();
    for s in silent.iter_mut().take(30) {
        assert!(wait_closed(s).is_empty(), "the server sent something");
    }
    wait_logged("WARN", &["closing a connection that sent no hello"]);
    srv.check_healthy();
    drop(silent);
}
