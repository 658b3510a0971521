//! Who may connect to an shm context: processes of the same user, and users the context
//! names in `shm::Options::allowed_uids`. This test binary runs itself again as the peer
//! under another user (nobody, uid 65534), which needs root; without root it says so and
//! checks only that its own user is admitted.

#[path = "common/logs.rs"]
mod logs;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rdmx::{
    Access, CompletionQueue, ConnectOptions, Context, LocalSge, PeerAddr, ProtectionDomain, QpCaps,
    QpEndpoint, QueuePair, RemoteAddr, SendRequest, WcStatus,
};

const CHILD_ENV: &str = "RDMX_TEST_SHM_USERS_CHILD";
/// The child connects to the listener this many times and sends nothing.
const STRANGER_ENV: &str = "RDMX_TEST_SHM_USERS_STRANGER";
/// The user the peer allows besides its own.
const ALLOW_ENV: &str = "RDMX_TEST_SHM_USERS_ALLOW";
const NOBODY: u32 = 65534;
const LEN: usize = 64 << 10;

struct Side {
    _ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
}

fn side(opts: rdmx::shm::Options) -> Side {
    let ctx = Context::open(opts).expect("open shm");
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(64).expect("cq");
    let qp = pd.create_qp(&cq, &cq, QpCaps::default()).expect("qp");
    Side {
        _ctx: ctx,
        pd,
        cq,
        qp,
    }
}

/// An endpoint as one text line: pid id qpn psn secret mtu.
fn to_line(e: &QpEndpoint) -> String {
    let PeerAddr::Unix { pid, id } = e.addr else {
        panic!("an shm endpoint has a Unix address")
    };
    format!("{pid} {id} {} {} {}", e.qp_num, e.psn, e.secret)
}

fn from_line(line: &str, like: &QpEndpoint) -> QpEndpoint {
    let v: Vec<u64> = line
        .split_whitespace()
        .map(|w| w.parse().unwrap())
        .collect();
    let mut e = *like;
    e.addr = PeerAddr::Unix {
        pid: v[0] as u32,
        id: v[1] as u32,
    };
    e.qp_num = v[2] as u32;
    e.psn = v[3] as u32;
    e.secret = v[4];
    e
}

/// The peer (allowing the user in `ALLOW_ENV`): prints its endpoint, reads the test's, connects, prints the address and
/// rkey of a region open for remote writes, and waits for its stdin to close.
fn child() {
    let mut opts = rdmx::shm::Options::default();
    if let Some(uid) = std::env::var(ALLOW_ENV).ok().and_then(|v| v.parse().ok()) {
        opts = opts.allow_uid(uid);
    }
    let s = side(opts);
    let mr =
        s.pd.register(vec![0u8; LEN], Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    let mine = s.qp.endpoint();
    println!("{}", to_line(&mine));
    let mut input = BufReader::new(std::io::stdin());
    let mut line = String::new();
    input.read_line(&mut line).unwrap();
    let theirs = from_line(&line, &mine);
    let connected = s.qp.connect(theirs, &ConnectOptions::default());
    println!("{} {} {}", connected.is_ok(), mr.addr(), mr.rkey());
    std::io::stdout().flush().unwrap();
    line.clear();
    let _ = input.read_line(&mut line);
}

/// Connects a QP of a context opened with `opts` to a peer running as `uid`; returns
/// whether a WRITE to the peer then completes successfully (false when the connection
/// is refused or nothing completes within a few seconds).
fn write_to_peer_as(uid: u32, opts: rdmx::shm::Options) -> bool {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(exe);
    cmd.env(CHILD_ENV, "1")
        .arg("--exact")
        .arg("child_entry")
        .arg("--nocapture")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    if uid != euid() {
        // The peer allows this process's user: what is tested is this side's check.
        cmd.uid(uid).gid(uid).env(ALLOW_ENV, euid().to_string());
    }
    let mut peer = cmd.spawn().expect("spawn the peer");
    let mut out = BufReader::new(peer.stdout.take().unwrap());
    let mut stdin = peer.stdin.take().unwrap();
    let mut line = String::new();
    let endpoint = loop {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the peer exited");
        if line.split_whitespace().count() == 5 {
            break line.clone();
        }
    };
    let s = side(opts);
    let mine = s.qp.endpoint();
    let theirs = from_line(&endpoint, &mine);
    writeln!(stdin, "{}", to_line(&mine)).unwrap();
    let connected = s.qp.connect(theirs, &ConnectOptions::default().timeout(14));
    let (peer_ok, addr, rkey) = loop {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the peer exited");
        let w: Vec<&str> = line.split_whitespace().collect();
        if w.len() == 3 && (w[0] == "true" || w[0] == "false") {
            break (
                w[0] == "true",
                w[1].parse::<u64>().unwrap(),
                w[2].parse().unwrap(),
            );
        }
    };
    let mut ok = false;
    if connected.is_ok() && peer_ok {
        let src = s.pd.register(vec![7u8; 4096], Access::LOCAL_WRITE).unwrap();
        s.qp.post_send(
            SendRequest::write(1, RemoteAddr { addr, rkey })
                .sge(LocalSge::new(&src, 0, 4096).unwrap()),
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(c) = s.cq.poll_one().unwrap() {
                ok = c.status == WcStatus::Success;
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    drop(stdin);
    let _ = peer.wait();
    ok
}

/// This process's effective user, from /proc.
fn euid() -> u32 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    line.split_whitespace().nth(2).unwrap().parse().unwrap()
}

/// The stranger: reads the test's endpoint, connects to its listener `n` times without
/// a word, prints `done`, and waits for its stdin to close.
fn stranger(n: usize) {
    let mut input = BufReader::new(std::io::stdin());
    let mut line = String::new();
    input.read_line(&mut line).unwrap();
    let e = from_line(&line, &side(rdmx::shm::Options::default()).qp.endpoint());
    let held: Vec<_> = (0..n)
        .filter_map(|_| rdmx::shm::testing::connect_listener(&e).ok())
        .collect();
    println!("done {}", held.len());
    std::io::stdout().flush().unwrap();
    line.clear();
    let _ = input.read_line(&mut line);
}

#[test]
fn child_entry() {
    if let Some(n) = std::env::var(STRANGER_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
    {
        stranger(n);
    } else if std::env::var_os(CHILD_ENV).is_some() {
        child();
    }
}

/// Until `f` holds, for at most a few seconds.
fn eventually(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A process of another user connects to the listener 200 times and sends nothing:
/// each connection is closed when accepted (none waits for a hello), and the listener
/// still admits this user's peer.
#[test]
fn strangers_are_closed_when_accepted() {
    if euid() != 0 {
        eprintln!("not root: cannot run a peer as another user");
        return;
    }
    let _ = logs::logs();
    let s = side(rdmx::shm::Options::default());
    let exe = std::env::current_exe().unwrap();
    let mut peer = Command::new(exe)
        .env(STRANGER_ENV, "200")
        .arg("--exact")
        .arg("child_entry")
        .arg("--nocapture")
        .uid(NOBODY)
        .gid(NOBODY)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the stranger");
    let mut out = BufReader::new(peer.stdout.take().unwrap());
    let mut stdin = peer.stdin.take().unwrap();
    writeln!(stdin, "{}", to_line(&s.qp.endpoint())).unwrap();
    let mut line = String::new();
    loop {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the stranger exited");
        if line.starts_with("done") {
            break;
        }
    }
    logs::wait_logged(
        "WARN",
        &["refusing an shm connection from a process of another user"],
    );
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(rdmx::shm::testing::handshakes_waiting(&s._ctx), Some(0));
    drop(stdin);
    let _ = peer.wait();
    assert!(write_to_peer_as(euid(), rdmx::shm::Options::default()));
}

/// Connections of this user that send no hello: at most 256 wait at once (each new one
/// closes the one that waited longest), and a peer that sends its hello still connects.
#[test]
fn connections_without_a_hello_are_bounded() {
    let _ = logs::logs();
    let a = side(rdmx::shm::Options::default());
    let b = side(rdmx::shm::Options::default());
    let idle: Vec<_> = (0..300)
        .map(|_| rdmx::shm::testing::connect_listener(&b.qp.endpoint()).unwrap())
        .collect();
    eventually("the listener took the connections", || {
        rdmx::shm::testing::handshakes_waiting(&b._ctx) == Some(256)
    });
    logs::wait_logged("WARN", &["closing an shm connection that sent no hello"]);
    let (ea, eb) = (a.qp.endpoint(), b.qp.endpoint());
    a.qp.connect(eb, &ConnectOptions::default()).unwrap();
    b.qp.connect(ea, &ConnectOptions::default()).unwrap();
    let dst =
        b.pd.register(vec![0u8; 4096], Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    let src = a.pd.register(vec![7u8; 4096], Access::LOCAL_WRITE).unwrap();
    a.qp.post_send(
        SendRequest::write(
            1,
            RemoteAddr {
                addr: dst.addr() as u64,
                rkey: dst.rkey(),
            },
        )
        .sge(LocalSge::new(&src, 0, 4096).unwrap()),
    )
    .unwrap();
    eventually("the WRITE to complete", || {
        a.cq.poll_one()
            .unwrap()
            .is_some_and(|c| c.status == WcStatus::Success)
    });
    drop(idle);
}

#[test]
fn same_user_is_admitted() {
    let me = euid();
    assert!(write_to_peer_as(me, rdmx::shm::Options::default()));
}

#[test]
fn another_user_only_when_allowed() {
    if euid() != 0 {
        eprintln!("not root: cannot run a peer as another user; only the same user is tested");
        return;
    }
    assert!(
        !write_to_peer_as(NOBODY, rdmx::shm::Options::default()),
        "a peer of another user was admitted without allowed_uids"
    );
    assert!(
        write_to_peer_as(NOBODY, rdmx::shm::Options::default().allow_uid(NOBODY)),
        "a peer of an allowed user was refused"
    );
}
