//! The transfer engine end to end over tcp and shm (engines in one process, talking
//! through the real transports), and its reliability: broken rails, dead peers, bad
//! control connections and descriptors, mismatched MTUs.

mod common;

use std::io::Write;
use std::time::{Duration, Instant};

use common::{
    a_path_failed, local, mid_batch, open_peer, pattern, tcp_rails, wait_completed, writes,
};
use rdmx::Access;
use rdmx_transfer::{
    Batch, Config, Engine, Error, Rail, RequestStatus, Segment, Target, Transport,
};

const T: Duration = Duration::from_secs(20);

/// Writes `n` requests of `len` bytes from `a` into `b`'s buffer "dst", reads them back
/// into "back", and checks every byte; returns the transport used.
fn round_trip(a: &Engine, b: &Engine, n: usize, len: usize) -> Transport {
    let total = n * len;
    let src = a
        .register("src", pattern(3, total), Access::LOCAL_WRITE)
        .unwrap();
    let back = a.register("back", total, Access::LOCAL_WRITE).unwrap();
    let dst = b
        .register("dst", total, Access::REMOTE_WRITE | Access::REMOTE_READ)
        .unwrap();
    let seg = open_peer(a, b);
    let mut w = writes(&src, &seg, n, len, |o| o, |o| Target::Buffer("dst", o));
    w.notify(b"written").unwrap();
    let h = a.submit(w);
    let st = h.wait(T).unwrap();
    assert!(st.is_success(), "{st:?}");
    assert_eq!(st.bytes, total as u64);
    for i in 0..n {
        assert_eq!(
            h.status(i),
            Some(RequestStatus::Completed { bytes: len as u64 })
        );
    }
    // The notification comes after every byte is in place.
    let note = b.recv_notification(T).expect("the batch's notification");
    assert_eq!(note.data, b"written");
    assert_eq!(note.from, a.name());
    let mut got = vec![0u8; total];
    dst.read(0, &mut got).unwrap();
    assert!(got == pattern(3, total), "the written bytes differ");

    let mut r = Batch::new();
    r.read(
        (&back, 0),
        &seg,
        Target::Offset(dst.segment_offset()),
        total as u64,
    )
    .unwrap();
    assert!(a.submit(r).wait(T).unwrap().is_success());
    back.read(0, &mut got).unwrap();
    assert!(got == pattern(3, total), "the read bytes differ");
    seg.transport()
}

#[test]
fn write_read_and_notify_over_tcp_with_two_rails() {
    let a = Engine::new("a", tcp_rails(2)).unwrap();
    let b = Engine::new("b", tcp_rails(2)).unwrap();
    // 70 KiB: a 64 KiB slice and a 6 KiB tail merged into it; 300 KiB: five slices.
    assert_eq!(round_trip(&a, &b, 5, 300 << 10), Transport::Tcp);
    let st = a.status();
    assert_eq!(st.len(), 1);
    let (peer, t, paths) = &st[0];
    assert_eq!((peer.as_str(), *t), ("b", Transport::Tcp));
    assert_eq!(paths.len(), 4, "2 rails x 2 queue pairs: {paths:?}");
    assert!(paths.iter().all(|p| p.up));
}

/// An engine with an shm rail and a tcp one, listening on this host.
fn shm_and_tcp() -> Config {
    Config::default()
        .rails(vec![Rail::Shm, Rail::tcp(local())])
        .listen(local())
}

#[test]
fn same_host_peers_use_shm_by_default() {
    let a = Engine::new("a", shm_and_tcp()).unwrap();
    let b = Engine::new("b", shm_and_tcp()).unwrap();
    assert_eq!(round_trip(&a, &b, 3, 1 << 20), Transport::Shm);
}

/// A same-host peer that closed its shm rail is reached over tcp, its other transport
/// (before, the choice still counted the closed rail, found no rail of it in service, and
/// the open panicked dividing by zero).
#[test]
fn a_peer_with_its_shm_rail_closed_is_reached_over_tcp() {
    let a = Engine::new("a", shm_and_tcp()).unwrap();
    let b = Engine::new("b", shm_and_tcp()).unwrap();
    b.close_rail(0).unwrap();
    assert_eq!(round_trip(&a, &b, 3, 64 << 10), Transport::Tcp);
}

#[test]
fn a_forced_transport_is_used_or_refused_naming_both_sides() {
    let a = Engine::new("a", shm_and_tcp()).unwrap();
    let b = Engine::new("b", shm_and_tcp()).unwrap();
    let seg = a
        .open_segment_with(&b.control_addr().to_string(), Some(Transport::Tcp))
        .unwrap();
    assert_eq!(seg.transport(), Transport::Tcp);
    let c = Engine::new("c", tcp_rails(1)).unwrap();
    let e = a
        .open_segment_with(&c.control_addr().to_string(), Some(Transport::Shm))
        .unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::Mismatch { .. }), "{msg}");
    assert!(
        msg.contains("shm, tcp") && msg.contains("the peer's: tcp"),
        "{msg}"
    );
}

#[test]
fn an_mtu_above_either_side_is_refused_naming_both_values() {
    let a = Engine::new("a", tcp_rails(1).mtu(Some(1 << 30))).unwrap();
    let b = Engine::new("b", tcp_rails(1)).unwrap();
    let theirs = b.desc().rails[0].mtu;
    let e = a.open_segment(&b.control_addr().to_string()).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::Mismatch { .. }), "{msg}");
    assert!(
        msg.contains("MTU 1073741824") && msg.contains(&format!("is {theirs}")),
        "{msg}"
    );
}

#[test]
fn bad_requests_are_refused_before_submission() {
    let a = Engine::new("a", tcp_rails(1)).unwrap();
    let b = Engine::new("b", tcp_rails(1)).unwrap();
    let src = a.register("src", 8192, Access::LOCAL_WRITE).unwrap();
    b.register("ro", 4096, Access::REMOTE_READ).unwrap();
    let seg = open_peer(&a, &b);
    let mut batch = Batch::new();
    let e = batch
        .write((&src, 0), &seg, Target::Buffer("ro", 0), 4096)
        .unwrap_err();
    assert!(e.to_string().contains("remote writes"), "{e}");
    let e = batch
        .read((&src, 0), &seg, Target::Buffer("ro", 1), 4096)
        .unwrap_err();
    assert!(e.to_string().contains("overrun"), "{e}");
    let e = batch
        .read((&src, 0), &seg, Target::Buffer("nope", 0), 1)
        .unwrap_err();
    assert!(e.to_string().contains("no buffer"), "{e}");
    let e = batch
        .read((&src, 8000), &seg, Target::Offset(0), 4096)
        .unwrap_err();
    assert!(e.to_string().contains("local buffer"), "{e}");
    let e = batch
        .read((&src, 0), &seg, Target::Offset(1 << 30), 1)
        .unwrap_err();
    assert!(e.to_string().contains("no registered buffer"), "{e}");
    assert!(batch.is_empty());
}

/// One of two rails broken mid-batch (the target takes it out of service, closing its
/// queue pairs): every request completes on the other rail, and the data is right.
#[test]
fn a_rail_broken_mid_batch_moves_its_slices_to_the_other() {
    mid_batch("the rail broke", || {
        let a = Engine::new("a", tcp_rails(2).set_aside(Duration::from_secs(60))).unwrap();
        let b = Engine::new("b", tcp_rails(2)).unwrap();
        let n = 64;
        let len = 1 << 20;
        let src = a
            .register("src", pattern(9, n * len), Access::LOCAL_WRITE)
            .unwrap();
        let dst = b.register("dst", n * len, Access::REMOTE_WRITE).unwrap();
        let seg = open_peer(&a, &b);
        let h = a.submit(writes(&src, &seg, n, len, |o| o, Target::Offset));
        // Break rail 1 while the batch is under way.
        wait_completed(&h, 2, std::thread::yield_now);
        if h.is_done() {
            return false;
        }
        b.close_rail(1).unwrap();
        let st = h.wait(T).unwrap();
        assert!(st.is_success(), "{st:?}");
        let mut got = vec![0u8; n * len];
        dst.read(0, &mut got).unwrap();
        assert!(
            got == pattern(9, n * len),
            "data differs after the rail broke"
        );
        // No path failed: what it had was in place before the rail closed.
        a_path_failed(&a)
    });
}

/// An engine with its first rail out of service is still opened by new peers, which
/// connect on its other rail only (before, rails were numbered without the closed one on
/// the target's side, and every open was refused).
#[test]
fn an_engine_with_its_first_rail_closed_is_opened_on_the_other() {
    let b = Engine::new("b", tcp_rails(2)).unwrap();
    b.close_rail(0).unwrap();
    let a = Engine::new("a", tcp_rails(2)).unwrap();
    assert_eq!(round_trip(&a, &b, 3, 100 << 10), Transport::Tcp);
    let paths = &a.status()[0].2;
    assert!(!paths.is_empty() && paths.iter().all(|p| p.up), "{paths:?}");
    assert!(
        paths.iter().all(|p| p.name.ends_with("rail 1")),
        "a path on the closed rail: {paths:?}"
    );
}

/// A set-aside path is rebuilt on demand once its time is up: the target takes a rail
/// out of service mid-batch and back; the next batch after the set-aside time brings
/// the initiator's paths on it up again.
#[test]
fn a_failed_path_is_rebuilt_lazily_after_its_set_aside_time() {
    mid_batch("rail 1 closed", || {
        let a = Engine::new("a", tcp_rails(2).set_aside(Duration::from_millis(300))).unwrap();
        let b = Engine::new("b", tcp_rails(2)).unwrap();
        let len = 1 << 20;
        let src = a
            .register("src", pattern(4, len), Access::LOCAL_WRITE)
            .unwrap();
        // Enough requests that the batch is still under way when rail 1 closes after the
        // first completes (tcp moves 1 MiB in a fraction of a millisecond).
        let n = 128;
        let dst = b.register("dst", n * len, Access::REMOTE_WRITE).unwrap();
        let seg = open_peer(&a, &b);
        let batch = || writes(&src, &seg, n, len, |_| 0, Target::Offset);
        let h = a.submit(batch());
        wait_completed(&h, 1, std::thread::yield_now);
        b.close_rail(1).unwrap();
        assert!(h.wait(T).unwrap().is_success());
        let down = |a: &Engine| a.status()[0].2.iter().filter(|p| !p.up).count();
        if down(&a) == 0 {
            return false;
        }
        b.reopen_rail(1).unwrap();
        let deadline = Instant::now() + T;
        while down(&a) > 0 {
            assert!(
                Instant::now() < deadline,
                "paths not rebuilt: {:?}",
                a.status()
            );
            let h = a.submit(batch());
            match h.wait(T) {
                Ok(st) => assert!(st.is_success(), "{st:?}"),
                Err(e) => panic!("{e}: {:?} {:?}", h.check(), a.status()),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let paths = &a.status()[0].2;
        assert!(paths.iter().all(|p| p.up) && paths.iter().any(|p| p.failures > 0));
        let mut got = vec![0u8; len];
        dst.read((31 * len) as u64, &mut got).unwrap();
        assert!(got == pattern(4, len));
        true
    });
}

/// A peer that dies mid-batch: every request on it ends failed (with the path and the
/// status) within the timeout, none hangs; another peer's batch completes.
#[test]
fn a_dead_peer_fails_its_requests_and_spares_the_others() {
    mid_batch("the peer went away", || {
        let a = Engine::new("a", tcp_rails(1).timeout(Duration::from_secs(5))).unwrap();
        let dying = Engine::new("dying", tcp_rails(1)).unwrap();
        let alive = Engine::new("alive", tcp_rails(1)).unwrap();
        let len = 1 << 20;
        let n = 64;
        let src = a
            .register("src", pattern(1, len), Access::LOCAL_WRITE)
            .unwrap();
        dying
            .register("dst", n * len, Access::REMOTE_WRITE)
            .unwrap();
        let dst2 = alive
            .register("dst", n * len, Access::REMOTE_WRITE)
            .unwrap();
        let s1 = open_peer(&a, &dying);
        let s2 = open_peer(&a, &alive);
        let batch_to = |seg: &Segment| writes(&src, seg, n, len, |_| 0, Target::Offset);
        let h1 = a.submit(batch_to(&s1));
        let h2 = a.submit(batch_to(&s2));
        drop(dying);
        let start = Instant::now();
        let st1 = h1
            .wait(Duration::from_secs(15))
            .expect("no request may hang");
        assert!(start.elapsed() < Duration::from_secs(15));
        assert!(st1.done && st1.pending == 0, "{st1:?}");
        if st1.failed == 0 {
            return false;
        }
        for i in 0..n {
            match h1.status(i).unwrap() {
                RequestStatus::Completed { .. } => {}
                RequestStatus::Failed(f) => {
                    assert!(f.path.contains("dying"), "{f}");
                }
                s => panic!("request {i} is {s:?}"),
            }
        }
        let st2 = h2.wait(T).unwrap();
        assert!(st2.is_success(), "{st2:?}");
        let mut got = vec![0u8; len];
        dst2.read(((n - 1) * len) as u64, &mut got).unwrap();
        assert!(got == pattern(1, len));
        // A new batch to the dead peer fails at once rather than hanging.
        let st = a
            .submit(batch_to(&s1))
            .wait(Duration::from_secs(15))
            .unwrap();
        assert_eq!(st.failed, n, "{st:?}");
        true
    });
}

/// Strangers and garbage on the control listener are refused with a reason, and the
/// listener goes on serving real peers.
#[test]
fn the_control_listener_survives_garbage_and_strangers() {
    let b = Engine::new("b", tcp_rails(1).connect_timeout(Duration::from_secs(2))).unwrap();
    b.register("dst", 4096, Access::REMOTE_WRITE).unwrap();
    let addr = b.control_addr();
    // Plain garbage.
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    // A frame claiming 4 GiB.
    let mut s2 = std::net::TcpStream::connect(addr).unwrap();
    let mut f = b"RDMXTE02".to_vec();
    f.extend_from_slice(&u32::MAX.to_be_bytes());
    s2.write_all(&f).unwrap();
    // A connection that says nothing.
    let _idle = std::net::TcpStream::connect(addr).unwrap();
    // A real peer still opens the engine and writes.
    a_peer_writes_4_kib_to(addr, 5);
}

/// A new engine opens the engine whose control listener is at `addr` and WRITEs 4 KiB of
/// `pattern(seed, ..)` to the start of its segment, which succeeds.
fn a_peer_writes_4_kib_to(addr: std::net::SocketAddr, seed: u8) {
    let a = Engine::new("a", tcp_rails(1)).unwrap();
    let src = a
        .register("src", pattern(seed, 4096), Access::LOCAL_WRITE)
        .unwrap();
    let seg = a.open_segment(&addr.to_string()).unwrap();
    let mut batch = Batch::new();
    batch
        .write((&src, 0), &seg, Target::Offset(0), 4096)
        .unwrap();
    assert!(a.submit(batch).wait(T).unwrap().is_success());
}

/// Strangers that send a control message a byte at a time (its header claiming 16 MiB)
/// are closed within the connect timeout, however steadily they send (before, each
/// read's own timeout was all, and they were held for good, each with a thread); a real
/// peer opens the engine meanwhile.
#[test]
fn strangers_that_send_a_byte_at_a_time_are_closed_within_the_connect_timeout() {
    use std::io::Read;
    let b = Engine::new("b", tcp_rails(1).connect_timeout(Duration::from_secs(1))).unwrap();
    b.register("dst", 4096, Access::REMOTE_WRITE).unwrap();
    let addr = b.control_addr();
    let start = Instant::now();
    std::thread::scope(|sc| {
        let drips: Vec<_> = (0..8)
            .map(|_| {
                sc.spawn(move || {
                    let mut s = std::net::TcpStream::connect(addr).unwrap();
                    s.set_read_timeout(Some(Duration::from_millis(100)))
                        .unwrap();
                    let mut f = b"RDMXTE02".to_vec();
                    f.extend_from_slice(&(16u32 << 20).to_be_bytes());
                    s.write_all(&f).unwrap();
                    let mut buf = [0u8; 256];
                    loop {
                        if start.elapsed() > Duration::from_secs(10) {
                            return None;
                        }
                        match s.read(&mut buf) {
                            Ok(_) => return Some(start.elapsed()),
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
                            Err(_) => return Some(start.elapsed()),
                        }
                        if s.write_all(&[0]).is_err() {
                            return Some(start.elapsed());
                        }
                    }
                })
            })
            .collect();
        a_peer_writes_4_kib_to(addr, 6);
        for d in drips {
            let closed = d.join().unwrap();
            assert!(
                closed.is_some_and(|t| t < Duration::from_secs(5)),
                "a stranger sending a byte at a time was held for {closed:?}"
            );
        }
    });
}

#[test]
fn standalone_notifications_and_slot_pools() {
    let a = Engine::new("a", tcp_rails(1)).unwrap();
    let b = Engine::new("b", tcp_rails(1)).unwrap();
    let pool = b
        .register_pool(
            "pages",
            16 << 10,
            8,
            Access::REMOTE_WRITE | Access::REMOTE_READ,
        )
        .unwrap();
    let slot = pool.get().unwrap();
    slot.write(0, b"page").unwrap();
    assert_eq!(pool.available(), 7);
    let seg = open_peer(&a, &b);
    let out = a.register("out", 16 << 10, Access::LOCAL_WRITE).unwrap();
    let mut batch = Batch::new();
    batch
        .read((&out, 0), &seg, Target::Buffer("pages", slot.offset()), 4)
        .unwrap();
    assert!(a.submit(batch).wait(T).unwrap().is_success());
    let mut got = [0u8; 4];
    out.read(0, &mut got).unwrap();
    assert_eq!(&got, b"page");
    for i in 0..20u8 {
        let h = a.notify(&seg, &[i; 100]).unwrap();
        // Done only once the peer acknowledged it (a caller may exit right after).
        let st = h.wait(T).unwrap();
        assert!(st.is_success(), "{st:?}");
        assert_eq!(st.notified, Some(Ok(())), "{st:?}");
    }
    // A batch with a notification and no request has no peer to tell: done at once.
    let mut empty = Batch::new();
    empty.notify(b"nobody").unwrap();
    let st = a.submit(empty).wait(T).unwrap();
    assert_eq!(
        (st.done, st.notified.clone()),
        (true, Some(Ok(()))),
        "{st:?}"
    );
    for i in 0..20u8 {
        let n = b.recv_notification(T).unwrap();
        assert_eq!(n.data, vec![i; 100]);
    }
    assert!(b.try_recv_notification().is_none());
    // b can talk back over the same connection.
    let a_seg = open_peer(&b, &a);
    assert!(b
        .notify(&a_seg, b"hi")
        .unwrap()
        .wait(T)
        .unwrap()
        .is_success());
    assert_eq!(a.recv_notification(T).unwrap().data, b"hi");
    drop(slot);
    assert_eq!(pool.available(), 8);
}

/// Not a test by itself: the target process the next test kills (run only when the
/// parent sets `RDMX_TE_CHILD_TARGET`).
#[test]
fn child_target_process() {
    if std::env::var_os("RDMX_TE_CHILD_TARGET").is_none() {
        return;
    }
    let e = Engine::new("victim", tcp_rails(2)).unwrap();
    e.register("dst", 64 << 20, Access::REMOTE_WRITE).unwrap();
    println!("control {}", e.control_addr());
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(600));
}

/// A peer process killed outright mid-batch (SIGKILL): every request to it ends,
/// completed or failed naming the path, within the timeout; a batch to another peer
/// completes meanwhile.
#[test]
fn a_peer_process_killed_mid_batch() {
    mid_batch("the peer was killed", || {
        use std::io::BufRead;
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_target_process", "--nocapture"])
            .env("RDMX_TE_CHILD_TARGET", "1")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let addr = loop {
            let mut line = String::new();
            assert!(out.read_line(&mut line).unwrap() > 0, "the child exited");
            if let Some(a) = line.trim().strip_prefix("control ") {
                break a.to_string();
            }
        };
        let a = Engine::new("a", tcp_rails(2).timeout(Duration::from_secs(5))).unwrap();
        let other = Engine::new("other", tcp_rails(1)).unwrap();
        let dst2 = other
            .register("dst", 64 << 20, Access::REMOTE_WRITE)
            .unwrap();
        let len = 1 << 20;
        let src = a
            .register("src", pattern(7, len), Access::LOCAL_WRITE)
            .unwrap();
        let victim = a.open_segment(&addr).unwrap();
        let alive = open_peer(&a, &other);
        let batch_to = |seg: &Segment, n: usize| writes(&src, seg, n, len, |_| 0, Target::Offset);
        let h = a.submit(batch_to(&victim, 64));
        wait_completed(&h, 1, std::thread::yield_now);
        child.kill().unwrap();
        child.wait().unwrap();
        let killed = Instant::now();
        let h2 = a.submit(batch_to(&alive, 64));
        let st = h
            .wait(Duration::from_secs(20))
            .expect("no request may hang");
        assert!(killed.elapsed() < Duration::from_secs(20));
        assert_eq!(st.pending, 0, "{st:?}");
        if st.failed == 0 {
            return false;
        }
        for i in 0..64 {
            match h.status(i).unwrap() {
                RequestStatus::Completed { .. } => {}
                RequestStatus::Failed(f) => assert!(f.path.contains("victim"), "{f}"),
                s => panic!("request {i} is {s:?}"),
            }
        }
        let st2 = h2.wait(T).unwrap();
        assert!(st2.is_success(), "{st2:?}");
        let mut got = vec![0u8; len];
        dst2.read((63 * len) as u64, &mut got).unwrap();
        assert!(got == pattern(7, len));
        // New work to the dead peer fails promptly, naming it.
        let st = a
            .submit(batch_to(&victim, 4))
            .wait(Duration::from_secs(20))
            .unwrap();
        assert_eq!(st.failed, 4, "{st:?}");
        true
    });
}

/// With a cluster token, the control listener refuses peers that do not present it, and
/// says so; peers with it connect.
#[test]
fn a_cluster_token_keeps_strangers_out() {
    let b = Engine::new("b", tcp_rails(1).token("s3cret")).unwrap();
    b.register("dst", 4096, Access::REMOTE_WRITE).unwrap();
    let stranger = Engine::new("x", tcp_rails(1)).unwrap();
    let e = stranger
        .open_segment(&b.control_addr().to_string())
        .unwrap_err();
    assert!(e.to_string().contains("token"), "{e}");
    let wrong = Engine::new("y", tcp_rails(1).token("guess")).unwrap();
    assert!(wrong.open_segment(&b.control_addr().to_string()).is_err());
    let friend = Engine::new("a", tcp_rails(1).token("s3cret")).unwrap();
    let src = friend.register("src", 4096, Access::LOCAL_WRITE).unwrap();
    let seg = open_peer(&friend, &b);
    let mut batch = Batch::new();
    batch
        .write((&src, 0), &seg, Target::Offset(0), 4096)
        .unwrap();
    assert!(friend.submit(batch).wait(T).unwrap().is_success());
}

/// A peer that comes back under the same name and control address with other rails: a
/// refresh of the segment opened before refuses its descriptor (the paths were made for
/// the old rails, whose keys the new one does not have) rather than take it.
#[test]
fn a_refresh_refuses_a_peer_whose_rails_changed() {
    let a = Engine::new("a", tcp_rails(1)).unwrap();
    let b = Engine::new("b", tcp_rails(2)).unwrap();
    let seg = open_peer(&a, &b);
    let control = b.control_addr();
    a.refresh(&seg).unwrap();
    drop(b);
    let _b = Engine::new("b", tcp_rails(1).listen(control)).unwrap();
    let err = a.refresh(&seg).unwrap_err();
    assert!(err.to_string().contains("rails changed"), "{err}");
}

/// A request the peer refuses (its buffer unregistered after the segment was opened)
/// fails with the peer's status, on the one path it was tried on: the other paths stay
/// up (before, it went from path to path, taking each down in turn).
#[test]
fn a_refused_request_takes_down_one_path_only() {
    let a = Engine::new("a", tcp_rails(2)).unwrap();
    let b = Engine::new("b", tcp_rails(2)).unwrap();
    let src = a.register("src", 8192, Access::LOCAL_WRITE).unwrap();
    let dst = b
        .register("dst", 8192, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    let seg = open_peer(&a, &b);
    b.unregister(&dst);
    let mut batch = Batch::new();
    batch
        .write((&src, 0), &seg, Target::Buffer("dst", 0), 4096)
        .unwrap();
    let h = a.submit(batch);
    let st = h.wait(T).unwrap();
    assert_eq!((st.completed, st.failed), (0, 1));
    match h.status(0) {
        Some(RequestStatus::Failed(f)) => {
            assert_eq!(f.status, Some(rdmx::WcStatus::RemAccessErr), "{f}")
        }
        other => panic!("{other:?}"),
    }
    let paths = &a.status()[0].2;
    assert_eq!(
        paths.iter().filter(|p| !p.up).count(),
        1,
        "paths down for one refused request: {paths:?}"
    );
}

/// One WRITE of 4 KiB from `src` into `seg`'s buffer "dst"; whether it succeeded.
fn write_once(a: &Engine, src: &rdmx_transfer::LocalBuf, seg: &Segment) -> bool {
    let h = a.submit(writes(
        src,
        seg,
        1,
        4096,
        |o| o,
        |o| Target::Buffer("dst", o),
    ));
    h.wait(T).unwrap().is_success()
}

/// An engine that names itself after one connected to the target does not take over
/// that connection: it is refused, and the connection goes on serving its engine.
#[test]
fn an_engine_named_as_a_connected_one_is_refused() {
    let a = Engine::new("a", tcp_rails(1)).unwrap();
    let b = Engine::new("b", tcp_rails(1)).unwrap();
    let src = a
        .register("src", pattern(3, 4096), Access::LOCAL_WRITE)
        .unwrap();
    let _dst = b.register("dst", 4096, Access::REMOTE_WRITE).unwrap();
    let seg = open_peer(&a, &b);
    assert!(write_once(&a, &src, &seg));
    let impostor = Engine::new("a", tcp_rails(1)).unwrap();
    let e = impostor
        .open_segment(&b.control_addr().to_string())
        .unwrap_err();
    assert!(e.to_string().contains("connected here already"), "{e}");
    assert!(
        write_once(&a, &src, &seg),
        "the impostor took the connection over"
    );
}

/// An engine that went and came back under its name (at another address) replaces the
/// connection it left.
#[test]
fn an_engine_back_under_its_name_replaces_its_old_connection() {
    let b = Engine::new("b", tcp_rails(1)).unwrap();
    let _dst = b.register("dst", 4096, Access::REMOTE_WRITE).unwrap();
    let a = Engine::new("a", tcp_rails(1)).unwrap();
    let seg = open_peer(&a, &b);
    let src = a
        .register("src", pattern(3, 4096), Access::LOCAL_WRITE)
        .unwrap();
    assert!(write_once(&a, &src, &seg));
    drop((seg, src, a));
    let a = Engine::new("a", tcp_rails(1)).unwrap();
    let src = a
        .register("src", pattern(4, 4096), Access::LOCAL_WRITE)
        .unwrap();
    let seg = open_peer(&a, &b);
    assert!(write_once(&a, &src, &seg));
}

/// Engines "a" and "b" on tcp, each with a 4 KiB "dst" peers may write and a 4 KiB
/// "src" of its own.
struct Both {
    a: Engine,
    b: Engine,
    sa: rdmx_transfer::LocalBuf,
    sb: rdmx_transfer::LocalBuf,
    _dst: [rdmx_transfer::LocalBuf; 2],
}

fn both() -> Both {
    let a = Engine::new("a", tcp_rails(1)).unwrap();
    let b = Engine::new("b", tcp_rails(1)).unwrap();
    let dst = |e: &Engine| e.register("dst", 4096, Access::REMOTE_WRITE).unwrap();
    let src = |e: &Engine, seed| {
        e.register("src", pattern(seed, 4096), Access::LOCAL_WRITE)
            .unwrap()
    };
    Both {
        sa: src(&a, 1),
        sb: src(&b, 2),
        _dst: [dst(&a), dst(&b)],
        a,
        b,
    }
}

/// Two engines that open each other at once agree on one connection: whatever the
/// two opens returned, opening again on either side gives a segment that works.
#[test]
fn engines_that_open_each_other_at_once_agree_on_one_connection() {
    for round in 0..8 {
        let Both { a, b, sa, sb, .. } = &both();
        std::thread::scope(|s| {
            s.spawn(|| a.open_segment(&b.control_addr().to_string()));
            s.spawn(|| b.open_segment(&a.control_addr().to_string()));
        });
        let ab = open_peer(a, b);
        let ba = open_peer(b, a);
        assert!(write_once(a, sa, &ab), "round {round}: a to b");
        assert!(write_once(b, sb, &ba), "round {round}: b to a");
    }
}

/// An engine opened by a peer opens that peer back under another spelling of its
/// address: the peer's refusal (it holds the connection) leads to the connection both
/// use, and the peer's own segment keeps working.
#[test]
fn an_engine_opened_by_its_peer_opens_it_back_by_any_address() {
    let Both { a, b, sa, sb, .. } = &both();
    let ba = open_peer(b, a);
    assert!(write_once(b, sb, &ba));
    let ab = a
        .open_segment(&format!("localhost:{}", b.control_addr().port()))
        .unwrap();
    assert!(write_once(a, sa, &ab), "a to b");
    assert!(write_once(b, sb, &ba), "b's segment after a opened it back");
}
