//! Connection setup through rdma_cm (`rdmx::verbs::cm::Listener`, `rdmx::verbs::cm::connect`)
//! on the verbs provider: two queue pairs of this process, each on its own context,
//! connected over the device's IPv4 address (`RXE_IP` when set, as in the Soft-RoCE VM of
//! `scripts/rxe-test.sh`, else the IPv4 address the device's GID maps), then a WRITE, a
//! READ and a SEND/RECV with their data checked, and the errors a caller must get.
//!
//! Where no RDMA device exists the verbs tests pass after printing why they did not run,
//! unless `RDMX_REQUIRE_VERBS=1`, which turns that into a failure. The checks that need no
//! device run everywhere.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use rdmx::verbs::cm::{
    self, Listener as RdmaCmListener, MAX_ACCEPT_PRIVATE as MAX_RDMA_CM_ACCEPT_PRIVATE,
    MAX_CONNECT_PRIVATE as MAX_RDMA_CM_CONNECT_PRIVATE,
};
use rdmx::{
    Access, Completion, CompletionQueue, ConnectOptions, Context, Error, LocalSge, MemoryRegion,
    QpCaps, QpState, QueuePair, RecvRequest, RemoteAddr, SendRequest, Transport, WcOpcode,
    WcStatus,
};

const LEN: usize = 64 * 1024;
const TIMEOUT: Duration = Duration::from_secs(10);

/// The device to use and an IPv4 address of it, or `None` (after saying why) when there
/// is no RDMA device here.
fn device() -> Option<(String, Ipv4Addr)> {
    let want = std::env::var("RDMX_VERBS_DEVICE")
        .or_else(|_| std::env::var("RXE_DEV"))
        .ok();
    let dev = rdmx::devices()
        .into_iter()
        .find(|d| d.provider == "verbs" && want.as_ref().map_or(true, |w| *w == d.name));
    let why = match dev {
        Some(d) => {
            let ip = std::env::var("RXE_IP")
                .ok()
                .and_then(|s| s.parse().ok())
                .or_else(|| d.gid.and_then(|(_, g)| g.to_ipv4_mapped()));
            match ip {
                Some(ip) => return Some((d.name, ip)),
                None => format!("{} has no IPv4 address for rdma_cm (set RXE_IP)", d.name),
            }
        }
        None => "no RDMA device".to_string(),
    };
    if std::env::var_os("RDMX_REQUIRE_VERBS").is_some_and(|v| v == "1") {
        panic!("RDMX_REQUIRE_VERBS=1 but the rdma_cm tests cannot run: {why}");
    }
    eprintln!("skipped: the rdma_cm tests cannot run here: {why}");
    None
}

/// One side: a context of its own, a CQ, a QP in RESET and a registered region.
struct Side {
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
    _ctx: Context,
}

impl Side {
    fn open(dev: &str, fill: u8) -> Side {
        let ctx = Context::open(rdmx::verbs::Options::default().device(dev)).unwrap();
        let pd = ctx.alloc_pd();
        let cq = ctx.create_cq(64).unwrap();
        // Inline data up to what the device takes (soft-iWARP: below the default).
        let inline = 256.min(ctx.capabilities().max_inline_data as usize);
        let qp = pd
            .create_qp(&cq, &cq, QpCaps::default().max_inline_data(inline))
            .unwrap();
        let rw = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
        let mr = pd.register(vec![fill; LEN], rw).unwrap();
        Side {
            cq,
            qp,
            mr,
            _ctx: ctx,
        }
    }

    /// The region as private data: address, rkey.
    fn region(&self) -> Vec<u8> {
        let mut v = (self.mr.addr() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(&self.mr.rkey().to_le_bytes());
        v
    }

    fn wait(&self) -> Completion {
        let until = Instant::now() + TIMEOUT;
        loop {
            if let Some(c) = self.cq.poll_one().unwrap() {
                return c;
            }
            assert!(Instant::now() < until, "no completion within {TIMEOUT:?}");
            std::thread::yield_now();
        }
    }
}

fn remote(private: &[u8]) -> RemoteAddr {
    RemoteAddr {
        addr: u64::from_le_bytes(private[..8].try_into().unwrap()),
        rkey: u32::from_le_bytes(private[8..12].try_into().unwrap()),
    }
}

/// `private` as the peer received it: the bytes sent, then (IB and RoCE) zero padding.
fn assert_private(got: &[u8], sent: &[u8], max: usize) {
    assert!(
        got.len() >= sent.len() && got.len() <= max,
        "{} bytes",
        got.len()
    );
    assert_eq!(&got[..sent.len()], sent);
    assert!(got[sent.len()..].iter().all(|b| *b == 0));
}

/// Connects a client and a server side through rdma_cm; returns (client, server, the
/// server's region as the client received it, the client's as the server received it).
fn connected(dev: &str, ip: Ipv4Addr) -> (Side, Side, Vec<u8>, Vec<u8>) {
    let (client, server) = (Side::open(dev, 0xc1), Side::open(dev, 0x5e));
    let listener = RdmaCmListener::bind((ip, 0)).unwrap();
    let addr = listener.local_addr().unwrap();
    assert_eq!(addr.ip(), IpAddr::V4(ip));
    assert_ne!(addr.port(), 0);
    let opts = ConnectOptions::default();
    let (c_priv, s_priv) = (client.region(), server.region());
    let (from_server, from_client) = std::thread::scope(|s| {
        let accepted =
            s.spawn(|| listener.accept(std::slice::from_ref(&server.qp), &opts, &s_priv, TIMEOUT));
        let from_server = cm::connect(
            addr,
            std::slice::from_ref(&client.qp),
            &opts,
            &c_priv,
            TIMEOUT,
        )
        .unwrap();
        (from_server, accepted.join().unwrap().unwrap())
    });
    assert_private(&from_server, &s_priv, MAX_RDMA_CM_ACCEPT_PRIVATE);
    assert_private(&from_client, &c_priv, MAX_RDMA_CM_CONNECT_PRIVATE);
    assert_eq!(client.qp.state(), QpState::Rts);
    assert_eq!(server.qp.state(), QpState::Rts);
    // iWARP connections have no peer QP numbers; elsewhere rdma_cm carries them.
    if client._ctx.capabilities().transport != Transport::Iwarp {
        assert_eq!(client.qp.attrs().dest_qp_num, server.qp.qp_num());
        assert_eq!(server.qp.attrs().dest_qp_num, client.qp.qp_num());
    }
    (client, server, from_server, from_client)
}

#[test]
fn write_read_send_over_rdma_cm() {
    let Some((dev, ip)) = device() else { return };
    let (client, server, server_region, client_region) = connected(&dev, ip);

    // WRITE: the client's pattern into the server's region.
    let pattern: Vec<u8> = (0..LEN).map(|i| (i * 7 + 3) as u8).collect();
    client.mr.write_at(0, &pattern).unwrap();
    let sge = LocalSge::new(&client.mr, 0, LEN).unwrap();
    let at = remote(&server_region);
    client
        .qp
        .post_send(SendRequest::write(1, at).sge(sge))
        .unwrap();
    let c = client.wait();
    assert_eq!((c.wr_id, c.status), (1, WcStatus::Success));
    let mut got = vec![0u8; LEN];
    server.mr.read_at(0, &mut got).unwrap();
    assert!(got == pattern, "the WRITE's data differs at the server");

    // READ: the server reads the client's region back (the other direction's path).
    client.mr.write_at(0, &[0xab; 4096]).unwrap();
    let sge = LocalSge::new(&server.mr, 0, 4096).unwrap();
    server
        .qp
        .post_send(SendRequest::read(2, remote(&client_region)).sge(sge))
        .unwrap();
    let c = server.wait();
    assert_eq!(
        (c.wr_id, c.status, c.opcode),
        (2, WcStatus::Success, WcOpcode::RdmaRead)
    );
    server.mr.read_at(0, &mut got[..4096]).unwrap();
    assert!(got[..4096].iter().all(|b| *b == 0xab));

    // SEND/RECV.
    server
        .qp
        .post_recv(RecvRequest::new(3).sge(LocalSge::new(&server.mr, 0, LEN).unwrap()))
        .unwrap();
    client.mr.write_at(0, b"hello over rdma_cm").unwrap();
    client
        .qp
        .post_send(SendRequest::send(4).sge(LocalSge::new(&client.mr, 0, 18).unwrap()))
        .unwrap();
    let c = client.wait();
    assert_eq!((c.wr_id, c.status), (4, WcStatus::Success));
    let r = server.wait();
    assert_eq!(
        (r.wr_id, r.status, r.opcode, r.byte_len),
        (3, WcStatus::Success, WcOpcode::Recv, 18)
    );
    server.mr.read_at(0, &mut got[..18]).unwrap();
    assert_eq!(&got[..18], b"hello over rdma_cm");
}

/// The `ready` callbacks run with the queue pair in INIT, before the peer can send: the
/// receives they post take the first messages, which the connecting side sends first
/// (iWARP has no RNR, and lets the accepting side send only after it).
#[test]
fn receives_posted_when_ready_take_the_first_messages() {
    let Some((dev, ip)) = device() else { return };
    let (client, server) = (Side::open(&dev, 0xc1), Side::open(&dev, 0x5e));
    let listener = RdmaCmListener::bind((ip, 0)).unwrap();
    let addr = listener.local_addr().unwrap();
    let opts = ConnectOptions::default();
    let post = |side: &Side, id: u64| {
        assert_eq!(side.qp.state(), QpState::Init, "ready runs in INIT");
        let sge = LocalSge::new(&side.mr, 0, 64).unwrap();
        side.qp.post_recv(RecvRequest::new(id).sge(sge))
    };
    std::thread::scope(|s| {
        let accepted = s.spawn(|| {
            listener.accept_then(
                std::slice::from_ref(&server.qp),
                &opts,
                &[],
                TIMEOUT,
                || post(&server, 10),
            )
        });
        cm::connect_then(
            addr,
            std::slice::from_ref(&client.qp),
            &opts,
            &[],
            TIMEOUT,
            || post(&client, 20),
        )
        .unwrap();
        // The first message goes at once, from the connecting side.
        client.mr.write_at(64, b"first").unwrap();
        let sge = LocalSge::new(&client.mr, 64, 5).unwrap();
        client.qp.post_send(SendRequest::send(21).sge(sge)).unwrap();
        accepted.join().unwrap().unwrap();
    });
    let c = client.wait();
    assert_eq!((c.wr_id, c.status), (21, WcStatus::Success));
    let r = server.wait();
    assert_eq!((r.wr_id, r.status, r.byte_len), (10, WcStatus::Success, 5));
    let mut got = [0u8; 5];
    server.mr.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"first");
    // Then the accepting side's, into the receive the client posted before connecting.
    server.mr.write_at(64, b"reply").unwrap();
    let sge = LocalSge::new(&server.mr, 64, 5).unwrap();
    server.qp.post_send(SendRequest::send(11).sge(sge)).unwrap();
    let c = server.wait();
    assert_eq!((c.wr_id, c.status), (11, WcStatus::Success));
    let r = client.wait();
    assert_eq!((r.wr_id, r.status, r.byte_len), (20, WcStatus::Success, 5));
    client.mr.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"reply");
}

/// An error from the accepting side's `ready` rejects the request: both sides fail.
#[test]
fn an_error_from_ready_rejects_the_connection() {
    let Some((dev, ip)) = device() else { return };
    let (client, server) = (Side::open(&dev, 0xc1), Side::open(&dev, 0x5e));
    let listener = RdmaCmListener::bind((ip, 0)).unwrap();
    let addr = listener.local_addr().unwrap();
    let opts = ConnectOptions::default();
    std::thread::scope(|s| {
        let accepted = s.spawn(|| {
            listener.accept_then(
                std::slice::from_ref(&server.qp),
                &opts,
                &[],
                TIMEOUT,
                || Err(Error::Protocol("not ready")),
            )
        });
        let connected = cm::connect(addr, std::slice::from_ref(&client.qp), &opts, &[], TIMEOUT);
        assert!(
            matches!(connected, Err(Error::RdmaCm { .. })),
            "the connect fails with an rdma_cm event: {connected:?}"
        );
        let accepted = accepted.join().unwrap();
        assert!(
            matches!(accepted, Err(Error::Protocol("not ready"))),
            "the accept returns ready's error: {accepted:?}"
        );
    });
}

#[test]
fn connect_to_a_port_nobody_listens_on_fails_in_time() {
    let Some((dev, ip)) = device() else { return };
    let side = Side::open(&dev, 0);
    // A port rdma_cm has no listener on: one a listener just gave back.
    let port = RdmaCmListener::bind((ip, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let start = Instant::now();
    let e = cm::connect(
        (ip, port),
        std::slice::from_ref(&side.qp),
        &ConnectOptions::default(),
        b"anyone?",
        Duration::from_secs(5),
    )
    .unwrap_err();
    let took = start.elapsed();
    assert!(took < Duration::from_secs(7), "took {took:?}");
    match &e {
        Error::RdmaCm { event, .. } => {
            assert!(
                ["RDMA_CM_EVENT_REJECTED", "RDMA_CM_EVENT_UNREACHABLE"].contains(event),
                "{e}"
            );
        }
        Error::Timeout(_) => {}
        // iWARP: the MPA connection's TCP connect is refused at once.
        Error::Io(_, e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
        other => panic!("expected a rejected connection or a timeout, got {other:?}"),
    }
    eprintln!("connect to {ip}:{port}: {e} (after {took:?})");
}

#[test]
fn a_listener_that_gets_no_request_times_out() {
    let Some((dev, ip)) = device() else { return };
    let side = Side::open(&dev, 0);
    let listener = RdmaCmListener::bind((ip, 0)).unwrap();
    let start = Instant::now();
    let e = listener
        .accept(
            std::slice::from_ref(&side.qp),
            &ConnectOptions::default(),
            b"",
            Duration::from_millis(300),
        )
        .unwrap_err();
    assert!(matches!(e, Error::Timeout(_)), "{e:?}");
    assert!(start.elapsed() < Duration::from_secs(3));
}

#[test]
fn oversize_private_data_is_refused_on_verbs() {
    let Some((dev, ip)) = device() else { return };
    let side = Side::open(&dev, 0);
    let listener = RdmaCmListener::bind((ip, 0)).unwrap();
    let addr = listener.local_addr().unwrap();
    let qps = std::slice::from_ref(&side.qp);
    let opts = ConnectOptions::default();
    let e = cm::connect(
        addr,
        qps,
        &opts,
        &[0; MAX_RDMA_CM_CONNECT_PRIVATE + 1],
        TIMEOUT,
    )
    .unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(m) if m.contains("56 bytes")),
        "{e:?}"
    );
    let e = listener
        .accept(qps, &opts, &[0; MAX_RDMA_CM_ACCEPT_PRIVATE + 1], TIMEOUT)
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(m) if m.contains("196 bytes")),
        "{e:?}"
    );
    // Nothing reached the queue pair.
    assert_eq!(side.qp.state(), QpState::Reset);
}

/// Queue pairs of the loopback and tcp providers (no device needed).
fn software_qps() -> Vec<(Context, QueuePair)> {
    ["loopback", "tcp"]
        .into_iter()
        .map(|p| {
            let ctx = Context::open_provider(p).unwrap();
            let cq = ctx.create_cq(8).unwrap();
            let qp = ctx
                .alloc_pd()
                .create_qp(&cq, &cq, QpCaps::default())
                .unwrap();
            (ctx, qp)
        })
        .collect()
}

#[test]
fn non_verbs_queue_pairs_are_unsupported() {
    // Something listens here, so a provider that went ahead would not fail for lack of a
    // peer; the refusal must come first, and fast.
    let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr: SocketAddr = tcp.local_addr().unwrap();
    for (ctx, qp) in software_qps() {
        let start = Instant::now();
        let e = cm::connect(
            addr,
            std::slice::from_ref(&qp),
            &ConnectOptions::default(),
            b"hi",
            TIMEOUT,
        )
        .unwrap_err();
        assert!(
            matches!(e, Error::Unsupported(_)),
            "{}: {e:?}",
            ctx.provider()
        );
        assert!(e.to_string().contains("verbs"), "{e}");
        // Well before the connect timeout: refused without waiting on the listener.
        assert!(start.elapsed() < TIMEOUT / 4, "{:?}", start.elapsed());
        assert_eq!(qp.state(), QpState::Reset);
    }
}

#[test]
fn rdma_cm_takes_exactly_one_queue_pair_and_bounded_private_data() {
    let ctx = Context::open_provider("loopback").unwrap();
    let cq = ctx.create_cq(8).unwrap();
    let pd = ctx.alloc_pd();
    let two: Vec<QueuePair> = (0..2)
        .map(|_| pd.create_qp(&cq, &cq, QpCaps::default()).unwrap())
        .collect();
    let opts = ConnectOptions::default();
    for qps in [&two[..0], &two[..]] {
        let e = cm::connect("127.0.0.1:1", qps, &opts, b"", TIMEOUT).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(m) if m.contains("exactly one")),
            "{e:?}"
        );
    }
    let e = cm::connect("127.0.0.1:1", &two[..1], &opts, &[7; 57], TIMEOUT).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(m) if m.contains("56 bytes")),
        "{e:?}"
    );
    // At the limit the size is fine; the loopback queue pair is what is refused.
    let e = cm::connect("127.0.0.1:1", &two[..1], &opts, &[7; 56], TIMEOUT).unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e:?}");
}
