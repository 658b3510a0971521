//! A `rdmx bench --server` keeps serving after bad peers on its connection-setup port.
//!
//! Sixty connections that are not an rdmx bench reach the setup port before the client:
//! random bytes, HTTP requests, truncated and oversized rdmx cm messages, connections
//! that close at once and a few that stall for seconds. The server logs each one and keeps
//! waiting; the valid client that comes next completes a verified benchmark and both
//! processes exit 0.
//!
//! A second client that reaches the server between a client's two setup exchanges is
//! refused before it learns anything: the server connects its queue pairs only to the
//! client it agreed the terms with.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod common;

const DEADLINE: Duration = Duration::from_secs(60);
/// The cm wire format (crates/rdmx/src/cm.rs): magic, u32 QP count, u32 private length,
/// 40-byte endpoints, private data.
const CM_MAGIC: &[u8; 8] = b"RDMXCM02";

/// Kills the server if the test fails before it exits.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn noise(seed: u64, len: usize) -> Vec<u8> {
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

fn cm_head(qps: u32, private: u32) -> Vec<u8> {
    let mut m = CM_MAGIC.to_vec();
    m.extend_from_slice(&qps.to_be_bytes());
    m.extend_from_slice(&private.to_be_bytes());
    m
}

/// Sends `bytes` (then half-closes if `close`) and reads until the server closes.
fn attack(port: u16, bytes: &[u8], close: bool) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("the setup port accepts");
    s.set_read_timeout(Some(DEADLINE)).expect("SO_RCVTIMEO");
    let _ = s.write_all(bytes);
    if close {
        let _ = s.shutdown(Shutdown::Write);
    }
    let mut buf = [0u8; 4096];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
    }
}

/// Bad connection number `i` of the mix.
fn bad_peer(port: u16, i: u64) {
    match i % 10 {
        0 => attack(port, &noise(i, 2048), false),
        1 => attack(port, b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n", false),
        // Truncated: the head alone, then part of it, then a body cut short.
        2 => attack(port, &cm_head(0, 100), true),
        3 => attack(port, &CM_MAGIC[..5], true),
        4 => {
            let mut m = cm_head(0, 64);
            m.extend_from_slice(b"{\"magic\":");
            attack(port, &m, true)
        }
        // Oversized: more private data than the limit, or more QPs than the server has.
        5 => attack(port, &cm_head(0, u32::MAX), false),
        6 => {
            let mut m = cm_head(3, 0);
            m.extend_from_slice(&noise(i, 120));
            attack(port, &m, false)
        }
        // A whole message of garbage private data (the JSON hello is wrong), and no
        // confirmation after it.
        7 => {
            let junk = noise(i, 50);
            let mut m = cm_head(0, junk.len() as u32);
            m.extend_from_slice(&junk);
            attack(port, &m, true)
        }
        // Connect and close.
        8 => drop(TcpStream::connect(("127.0.0.1", port)).expect("dial")),
        // A TLS client hello's start, then end of stream (a short message that merely
        // stopped would cost the server its exchange timeout, like the stallers).
        _ => attack(port, b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03", true),
    }
}

#[test]
fn bench_server_serves_a_valid_client_after_60_bad_peers() {
    let exe = env!("CARGO_BIN_EXE_rdmx");
    let mut child = Command::new(exe)
        .args([
            "bench",
            "write_bw",
            "--provider",
            "tcp",
            "--server",
            "-p",
            "0",
            "-n",
            "200",
            "--verify",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the server");
    let stderr = child.stderr.take().expect("stderr");
    let mut stdout = child.stdout.take().expect("stdout");
    let mut server = Server(child);
    let (tx, rx) = mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut lines = Vec::new();
    let port = loop {
        let line = rx
            .recv_timeout(DEADLINE)
            .expect("the server says where it waits");
        lines.push(line.clone());
        if let Some(addr) = line.split("waiting for a peer on ").nth(1) {
            let port = addr.rsplit(':').next().expect("address:port");
            break port.trim().parse::<u16>().expect("a port");
        }
    };

    let start = Instant::now();
    // Two that stall (connected, silent) for a few seconds each, held while the rest come.
    let stallers: Vec<_> = (0..2)
        .map(|_| {
            std::thread::spawn(move || {
                let s = TcpStream::connect(("127.0.0.1", port)).expect("dial");
                std::thread::sleep(Duration::from_secs(3));
                drop(s);
            })
        })
        .collect();
    for i in 0..58 {
        bad_peer(port, i);
    }
    for s in stallers {
        s.join().expect("staller");
    }
    eprintln!("60 bad peers in {:?}", start.elapsed());
    assert!(
        start.elapsed() < DEADLINE,
        "bad peers held the setup port up too long"
    );
    let start = Instant::now();
    let client = Command::new(exe)
        .args([
            "bench",
            "write_bw",
            "--provider",
            "tcp",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-n",
            "200",
            "--verify",
        ])
        .output()
        .expect("run the client");
    assert!(
        client.status.success(),
        "the client failed: {}",
        String::from_utf8_lossy(&client.stderr)
    );
    let status = loop {
        if let Some(s) = server.0.try_wait().expect("wait for the server") {
            break s;
        }
        assert!(start.elapsed() < DEADLINE, "the server did not exit");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut out = String::new();
    stdout.read_to_string(&mut out).expect("server stdout");
    reader.join().expect("stderr reader");
    lines.extend(rx.try_iter());
    assert!(
        status.success(),
        "the server failed ({status}); its stderr: {lines:#?}"
    );
    let ignored = lines
        .iter()
        .filter(|l| l.contains("ignored a connection on the setup port"))
        .count();
    // Each bad peer is one line (a connect-and-close may be seen as one too).
    assert!(
        ignored >= 50,
        "{ignored} bad peers logged, of 60: {lines:#?}"
    );
}

/// Relays `from` to a new connection to `port` and back, each way until its end of
/// stream, in the background; `read` (bytes already read from `from`) go first.
fn relay(from: TcpStream, read: Vec<u8>, port: u16) -> std::thread::JoinHandle<()> {
    let mut to = TcpStream::connect(("127.0.0.1", port)).expect("dial the server");
    to.write_all(&read).expect("relay");
    let (from2, to2) = (
        from.try_clone().expect("clone"),
        to.try_clone().expect("clone"),
    );
    let ahead = std::thread::spawn(move || {
        let _ = std::io::copy(&mut &from, &mut &to);
        let _ = to.shutdown(Shutdown::Write);
    });
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut &to2, &mut &from2);
        let _ = from2.shutdown(Shutdown::Write);
        let _ = ahead.join();
    })
}

/// Reads one cm message (head, endpoints, private data) from `s`.
fn read_cm_message(s: &mut TcpStream) -> Vec<u8> {
    let mut m = vec![0u8; 16];
    s.read_exact(&mut m).expect("a cm head");
    assert_eq!(&m[..8], CM_MAGIC);
    let n = u32::from_be_bytes(m[8..12].try_into().unwrap()) as usize;
    let plen = u32::from_be_bytes(m[12..16].try_into().unwrap()) as usize;
    let mut body = vec![0u8; n * 40 + plen];
    s.read_exact(&mut body).expect("a cm body");
    m.extend_from_slice(&body);
    m
}

/// The benchmark both sides run, the client's address and port after it.
const RUN: [&str; 7] = [
    "bench",
    "write_bw",
    "--provider",
    "tcp",
    "-n",
    "200",
    "--verify",
];

fn client(port: u16) -> std::process::Command {
    let mut c = common::command(&RUN);
    c.args(["127.0.0.1", "-p", &port.to_string()]);
    c
}

/// A client's two setup exchanges go through a relay, which holds the second back while
/// an intruder sends the server that very message with its session removed (a
/// well-formed hello of a bench, for the right number of queue pairs, from a peer that
/// did not take part in the first exchange): the server refuses it before it sends
/// anything, and the client's benchmark then completes.
#[test]
fn bench_server_connects_only_the_client_it_agreed_terms_with() {
    let (server, port) = common::Server::start(&RUN);
    let proxy = TcpListener::bind("127.0.0.1:0").expect("bind the relay");
    let proxy_port = proxy.local_addr().expect("addr").port();
    let first = client(proxy_port)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the client");
    // Its first exchange (the terms) goes through; its second waits in the relay.
    let (terms, _) = proxy.accept().expect("the client's first exchange");
    relay(terms, Vec::new(), port).join().expect("relay");
    let (mut held, _) = proxy.accept().expect("the client's second exchange");
    held.set_read_timeout(Some(DEADLINE)).expect("SO_RCVTIMEO");
    let message = read_cm_message(&mut held);
    let n = u32::from_be_bytes(message[8..12].try_into().unwrap()) as usize;
    let mut hello: serde_json::Value =
        serde_json::from_slice(&message[16 + n * 40..]).expect("the client's hello");
    assert!(
        hello["session"].is_u64(),
        "the hello names no session: {hello}"
    );
    hello["session"] = serde_json::Value::Null;
    let private = serde_json::to_vec(&hello).expect("json");
    let mut forged = message[..12].to_vec();
    forged.extend_from_slice(&(private.len() as u32).to_be_bytes());
    forged.extend_from_slice(&message[16..16 + n * 40]);
    forged.extend_from_slice(&private);
    let mut intruder = TcpStream::connect(("127.0.0.1", port)).expect("dial the server");
    intruder
        .set_read_timeout(Some(DEADLINE))
        .expect("SO_RCVTIMEO");
    intruder.write_all(&forged).expect("send");
    let mut learned = Vec::new();
    let _ = intruder.read_to_end(&mut learned);
    assert!(
        learned.is_empty(),
        "the server answered the intruder with {} bytes",
        learned.len()
    );
    let relayed = relay(held, message, port);
    let out = first.wait_with_output().expect("the client");
    assert!(
        out.status.success(),
        "the client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    relayed.join().expect("relay");
    let out = server.finish();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the server failed: {said}");
    assert!(
        said.contains("did not agree the terms"),
        "the server did not log the intruder: {said}"
    );
}
