//! Helpers for driving the `rdmx` binary: runs that must succeed (their JSON parsed),
//! runs that must fail (their stderr returned), and bench servers on free ports.

#![allow(dead_code)] // each test file uses some of these

use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};

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

/// Checks a row of `test`: `bytes`, `iterations` and positive figures.
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
        assert!(
            x.is_some_and(|x| x > 0.0 && x.is_finite()),
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
pub(crate) struct Server(pub(crate) Option<Child>);

impl Server {
    /// Starts `rdmx bench args... --server -p port`.
    pub(crate) fn start(args: &[&str], port: u16) -> Server {
        let port = port.to_string();
        let child = command(args)
            .args(["--server", "-p", &port])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the server");
        Server(Some(child))
    }

    /// Waits for the server to exit.
    pub(crate) fn finish(mut self) -> Output {
        self.0
            .take()
            .expect("a running server")
            .wait_with_output()
            .expect("wait for the server")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
