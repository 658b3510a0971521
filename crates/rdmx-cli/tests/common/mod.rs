//! Helpers for driving the `rdmx` binary: runs that must succeed (their JSON parsed),
//! runs that must fail (their stderr returned), and bench servers on free ports.

#![allow(dead_code)] // each test file uses some of these

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Every transfer test.
pub(crate) const TESTS: [&str; 8] = [
    "write_bw",
    "write_lat",
    "read_bw",
    "read_lat",
    "send_bw",
    "send_lat",
    "atomic_bw",
    "atomic_lat",
];

/// Keys of a bandwidth row.
pub(crate) const BW_KEYS: [&str; 3] = ["bw_peak_mib_s", "bw_avg_mib_s", "msg_rate_mpps"];
/// Keys of a latency row.
pub(crate) const LAT_KEYS: [&str; 7] = [
    "t_min_us",
    "t_max_us",
    "t_typical_us",
    "t_avg_us",
    "t_stdev_us",
    "p99_us",
    "p999_us",
];

pub(crate) fn command(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_rdmx"));
    c.args(args);
    c
}

/// Runs `rdmx args...`, which must succeed.
pub(crate) fn run(args: &[&str]) -> Output {
    let out = command(args).output().expect("run rdmx");
    assert!(
        out.status.success(),
        "rdmx {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs `rdmx args...`, which must succeed and print one JSON object.
pub(crate) fn json(args: &[&str]) -> serde_json::Value {
    let out = run(args);
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "rdmx {args:?}: not one JSON object ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// Runs `rdmx args...`, which must fail with a message; returns its stderr.
pub(crate) fn fails(args: &[&str]) -> String {
    let out = command(args).output().expect("run rdmx");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "rdmx {args:?} should fail");
    assert!(!err.trim().is_empty(), "rdmx {args:?} failed silently");
    err
}

/// The default size of `test` small enough for quick runs.
pub(crate) fn small_size(test: &str) -> &'static str {
    if test.starts_with("atomic") {
        "8"
    } else {
        "4097"
    }
}

/// Checks a row of `test`: `bytes`, `iterations` and positive figures (`t_stdev_us` may
/// be 0: a run of fewer than 5 rounds measures one, perftest's two largest left out).
pub(crate) fn check_row(test: &str, row: &serde_json::Value, bytes: u64, what: &str) {
    assert_eq!(row["bytes"], bytes, "{what}: {row}");
    assert!(
        row["iterations"].as_u64().is_some_and(|n| n > 0),
        "{what}: {row}"
    );
    let keys: &[&str] = if test.ends_with("_bw") {
        &BW_KEYS
    } else {
        &LAT_KEYS
    };
    for k in keys {
        let x = row[k].as_f64();
        let least = if *k == "t_stdev_us" {
            0.0
        } else {
            f64::MIN_POSITIVE
        };
        assert!(
            x.is_some_and(|x| x >= least && x.is_finite()),
            "{what}: {k} = {}: {row}",
            row[k]
        );
    }
    if test.ends_with("_lat") {
        let f = |k: &str| row[k].as_f64().unwrap();
        assert!(f("t_min_us") <= f("t_typical_us"), "{what}: {row}");
        assert!(f("t_typical_us") <= f("t_max_us"), "{what}: {row}");
        assert!(f("t_min_us") <= f("t_avg_us"), "{what}: {row}");
        assert!(f("p99_us") <= f("p999_us"), "{what}: {row}");
        assert!(f("p999_us") <= f("t_max_us"), "{what}: {row}");
    } else {
        let f = |k: &str| row[k].as_f64().unwrap();
        assert!(
            f("bw_peak_mib_s") >= f("bw_avg_mib_s") * 0.999,
            "{what}: {row}"
        );
    }
}

/// A port nothing listens on right now.
pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a free port")
        .port()
}

/// A `rdmx bench ... --server` process, killed if the test ends before it does.
///
/// It listens on a port the kernel picks (`-p 0`) and the test reads that port from the
/// line the server prints: a port picked by the test and freed before the server binds it
/// could meanwhile become another connection's ephemeral port.
pub(crate) struct Server {
    child: Option<Child>,
    stderr: Option<JoinHandle<Vec<u8>>>,
}

impl Server {
    /// Starts `rdmx bench args... --server -p 0`; returns it and the port it listens on.
    pub(crate) fn start(args: &[&str]) -> (Server, u16) {
        let mut child = command(args)
            .args(["--server", "-p", "0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the server");
        let pipe = child.stderr.take().expect("the server's stderr");
        let (tx, rx) = mpsc::channel::<u16>();
        // Keeps every line for `finish`, and passes on the port once the server names it.
        let stderr = std::thread::spawn(move || {
            let mut all = Vec::new();
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                if let Some(addr) = line.split("waiting for a peer on ").nth(1) {
                    if let Some(port) = addr.rsplit(':').next().and_then(|p| p.trim().parse().ok())
                    {
                        let _ = tx.send(port);
                    }
                }
                all.extend_from_slice(line.as_bytes());
                all.push(b'\n');
            }
            all
        });
        let mut server = Server {
            child: Some(child),
            stderr: Some(stderr),
        };
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(port) => (server, port),
            Err(_) => {
                let out = server.finish_output();
                panic!(
                    "the server did not say where it listens: {}",
                    String::from_utf8_lossy(&out.stderr)
                )
            }
        }
    }

    /// Waits for the server to exit.
    pub(crate) fn finish(mut self) -> Output {
        self.finish_output()
    }

    fn finish_output(&mut self) -> Output {
        let mut out = self
            .child
            .take()
            .expect("a running server")
            .wait_with_output()
            .expect("wait for the server");
        if let Some(t) = self.stderr.take() {
            out.stderr = t.join().unwrap_or_default();
        }
        out
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
