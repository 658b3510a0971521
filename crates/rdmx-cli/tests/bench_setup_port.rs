//! A `rdmx bench --server` keeps serving after bad peers on its connection-setup port.
//!
//! Sixty connections that are not an rdmx bench reach the setup port before the client:
//! random bytes, HTTP requests, truncated and oversized rdmx cm messages, connections
//! that close at once and a few that stall for seconds. The server logs each one and keeps
//! waiting; the valid client that comes next completes a verified benchmark and both
//! processes exit 0.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

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
