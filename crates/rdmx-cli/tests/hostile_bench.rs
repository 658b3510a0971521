//! A `rdmx bench --server` under attack still serves a valid client.
//!
//! The server process is attacked on its tcp provider's data listener (found through
//! `/proc`: the process's listening sockets other than the connection-setup port) before
//! the client connects and while the benchmark runs: random bytes, hellos that are not
//! rdmx's, hellos for QPs that do not exist, oversized frames, half-open streams and
//! streams that connect and stall. Then:
//!
//! - the client's benchmark completes with its data verified, and both processes exit 0;
//! - the server logged a reason for the connections it closed;
//! - the server's resident memory did not grow with a flood of hostile connections.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(60);

/// Kills the server if the test fails before it exits.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Ports of the TCP sockets process `pid` listens on.
fn listening_ports(pid: u32) -> Vec<u16> {
    let mut inodes = Vec::new();
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd")).expect("read the server's fds") {
        let Ok(link) = std::fs::read_link(fd.expect("fd entry").path()) else {
            continue;
        };
        let link = link.to_string_lossy().into_owned();
        if let Some(ino) = link
            .strip_prefix("socket:[")
            .and_then(|s| s.strip_suffix(']'))
        {
            inodes.push(ino.to_string());
        }
    }
    let mut ports = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local_address, rem_address, st (0A = LISTEN), ..., inode at index 9.
            if f.len() > 9 && f[3] == "0A" && inodes.iter().any(|i| i == f[9]) {
                let port = f[1].rsplit(':').next().expect("address:port");
                ports.push(u16::from_str_radix(port, 16).expect("hex port"));
            }
        }
    }
    ports
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
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

/// The tcp provider's hello, with a secret a stranger cannot know.
fn hello(to: u32, from: u32) -> Vec<u8> {
    let mut h = b"RDMXTCP2".to_vec();
    h.extend_from_slice(&to.to_be_bytes());
    h.extend_from_slice(&from.to_be_bytes());
    h.extend_from_slice(&0u64.to_be_bytes());
    h
}

/// Sends `bytes` to `port` and waits (bounded) for the server to close the stream.
fn attack(port: u16, bytes: &[u8]) {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        panic!("the data listener on port {port} refused a connection");
    };
    s.set_read_timeout(Some(DEADLINE)).expect("SO_RCVTIMEO");
    let _ = s.write_all(bytes);
    let mut buf = [0u8; 512];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
}

/// One round of every attack on the data listener; returns streams left open (a
/// half-open one and a staller) for the caller to hold.
fn attack_round(port: u16, seed: u64) -> Vec<TcpStream> {
    attack(port, &noise(seed, 4096));
    attack(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n0123");
    let mut b = hello(0x00ab_cdef, 1);
    b.extend_from_slice(&[0xff; 64]);
    attack(port, &b);
    let mut b = hello(0x00ab_cdef, 1);
    b.extend_from_slice(&u32::MAX.to_be_bytes());
    b.extend_from_slice(&noise(seed + 1, 60));
    attack(port, &b);
    let mut open = Vec::new();
    let mut half = TcpStream::connect(("127.0.0.1", port)).expect("dial");
    half.write_all(b"RDMXTC").expect("send");
    half.shutdown(std::net::Shutdown::Write).expect("shutdown");
    open.push(half);
    open.push(TcpStream::connect(("127.0.0.1", port)).expect("dial"));
    open
}

#[test]
fn bench_server_under_attack_serves_a_valid_client() {
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
            "-D",
            "3",
            "--verify",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the server");
    let pid = child.id();
    let stderr = child.stderr.take().expect("stderr");
    let mut stdout = child.stdout.take().expect("stdout");
    let server = Server(child);
    // The server's stderr, line by line, on a thread (it also carries the warnings).
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
    let cm_port = loop {
        let line = rx
            .recv_timeout(DEADLINE)
            .expect("the server says where it waits");
        lines.push(line.clone());
        if let Some(addr) = line.split("waiting for a peer on ").nth(1) {
            let port = addr.rsplit(':').next().expect("address:port");
            break port.trim().parse::<u16>().expect("a port");
        }
    };
    let data_ports: Vec<u16> = listening_ports(pid)
        .into_iter()
        .filter(|&p| p != cm_port)
        .collect();
    assert_eq!(
        data_ports.len(),
        1,
        "one tcp data listener besides the setup port {cm_port}: {data_ports:?}"
    );
    let data = data_ports[0];

    // Before the client: every attack, then a flood, with memory measured around it.
    let mut held = attack_round(data, 1);
    let before = rss_kib(pid);
    for i in 0..300 {
        let mut b = hello(0x0077_0000 + i, 5);
        b.extend_from_slice(&noise(u64::from(i), 512));
        attack(data, &b);
    }
    let after = rss_kib(pid);
    let grown = after.saturating_sub(before);
    eprintln!("server resident memory around 300 hostile connections: {before} KiB -> {after} KiB");
    assert!(
        grown < 32 << 10,
        "the server's resident memory grew by {grown} KiB over 300 hostile connections"
    );

    // The client, with attacks while its benchmark runs.
    let client = Command::new(exe)
        .args([
            "bench",
            "write_bw",
            "--provider",
            "tcp",
            "127.0.0.1",
            "-p",
            &cm_port.to_string(),
            "-D",
            "3",
            "--verify",
            "--json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the client");
    std::thread::sleep(Duration::from_millis(500));
    for round in 2..6 {
        held.extend(attack_round(data, round));
    }
    let out = client.wait_with_output().expect("the client runs");
    assert!(
        out.status.success(),
        "the client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");
    assert_eq!(report["test"], "write_bw", "{report}");
    assert_eq!(report["verify"], true, "{report}");
    let iters = report["results"][0]["iterations"].as_u64().unwrap_or(0);
    assert!(iters > 0, "the client ran no iterations: {report}");
    eprintln!(
        "client under attack: {iters} x 64 KiB WRITEs verified, {:.0} MiB/s",
        report["results"][0]["bw_avg_mib_s"].as_f64().unwrap_or(0.0)
    );

    let mut server = server;
    let start = Instant::now();
    let status = loop {
        if let Some(s) = server.0.try_wait().expect("wait for the server") {
            break s;
        }
        assert!(start.elapsed() < DEADLINE, "the server did not exit");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut out = String::new();
    stdout.read_to_string(&mut out).expect("server stdout");
    drop(held);
    reader.join().expect("stderr reader");
    lines.extend(rx.try_iter());
    assert!(
        status.success(),
        "the server failed ({status}); its stderr: {lines:#?}"
    );
    let logged = |what: &str| lines.iter().any(|l| l.contains("WARN") && l.contains(what));
    assert!(
        logged("hello is not rdmx's"),
        "no warning for a stream without an rdmx hello: {lines:#?}"
    );
    assert!(
        logged("QP that does not exist"),
        "no warning for a hello to an unknown QP: {lines:#?}"
    );
}
