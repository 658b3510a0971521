//! `rdmx bench transfer` with the target in another process: `--verify` checks every
//! batch by reading it back (WRITE) or against a pattern written first (READ), and the
//! target exits after `--runs` initiators' closing notifications.

mod common;

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::command;

#[test]
fn a_target_in_another_process_serves_verified_writes_and_reads_then_exits() {
    let mut target = command(&[
        "bench",
        "transfer",
        "--mode",
        "target",
        "--rails",
        "tcp:127.0.0.1:0",
        "--listen",
        "127.0.0.1:0",
        "--buffer-size",
        "4194304",
        "--runs",
        "2",
    ])
    .stdout(Stdio::piped())
    .spawn()
    .unwrap();
    let mut out = BufReader::new(target.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let addr = line
        .strip_prefix("target listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .trim()
        .to_string();
    for op in ["write", "read"] {
        let o = command(&[
            "bench",
            "transfer",
            "--mode",
            "initiator",
            "--segment",
            &addr,
            "--rails",
            "tcp:127.0.0.1:0",
            "--op",
            op,
            "--block-size",
            "65536,100000",
            "--batch-size",
            "8",
            "--duration",
            "0.3",
            "--verify",
            "--json",
        ])
        .output()
        .unwrap();
        assert!(
            o.status.success(),
            "{op}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        for p in v["results"].as_array().unwrap() {
            assert!(p["batches"].as_u64().unwrap() >= 1, "{p}");
            assert_eq!(p["transport"], "tcp");
            assert_eq!(p["slice_size"], 65536);
        }
    }
    // Both closing notifications arrive, and the target exits.
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(st) = target.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = target.kill();
            panic!("the target did not exit after two runs");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success());
    let rest: Vec<String> = out.lines().map(|l| l.unwrap()).collect();
    assert_eq!(
        rest.iter()
            .filter(|l| l.starts_with("target: notification from bench-initiator-"))
            .count(),
        2,
        "{rest:?}"
    );
}
