//! The `rc_pingpong` example between two processes over tcp: a server with `-p 0` (it
//! prints the port it listens on) and a client given that port; both must exit 0 and
//! print the throughput and latency lines.
//!
//! The example's code is compiled into this test binary, which runs itself again as the
//! server and as the client (`cargo test --test rc_pingpong` does not build examples).

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::time::Duration;

#[allow(dead_code)]
#[allow(unreachable_pub)]
#[path = "../examples/rc_pingpong.rs"]
mod example;

const ARGS_ENV: &str = "RDMX_TEST_RC_PINGPONG_ARGS";
const DEADLINE: Duration = Duration::from_secs(60);

/// Kills a process the test gives up on.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(args: &[&str]) -> Proc {
    let child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "as_the_example",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ARGS_ENV, args.join(" "))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn");
    Proc(child)
}

/// Runs as the example when spawned by the test below; a no-op otherwise.
#[test]
fn as_the_example() {
    let Ok(args) = std::env::var(ARGS_ENV) else {
        return;
    };
    let code = example::rc_pingpong(args.split_whitespace().map(String::from));
    std::process::exit(if code == ExitCode::SUCCESS { 0 } else { 1 });
}

fn check_output(who: &str, out: &str, size: u64, iters: u64) {
    let bytes = format!("{} bytes in ", size * iters * 2);
    assert!(
        out.lines()
            .any(|l| l.contains(&bytes) && l.ends_with(" Mbit/sec")),
        "{who}: no bytes line:\n{out}"
    );
    let it = format!("{iters} iters in ");
    assert!(
        out.lines()
            .any(|l| l.contains(&it) && l.ends_with(" usec/iter")),
        "{who}: no iters line:\n{out}"
    );
}

#[test]
fn rc_pingpong_between_two_processes_over_tcp() {
    let (size, iters) = (4096u64, 200u64);
    let (s, n) = (size.to_string(), iters.to_string());
    let mut server = spawn(&["-d", "tcp", "-p", "0", "-s", &s, "-n", &n]);
    let stdout = server.0.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            all.push_str(&line);
            all.push('\n');
            let _ = tx.send(line);
        }
        all
    });
    let port = loop {
        let line = rx
            .recv_timeout(DEADLINE)
            .expect("the server says where it listens");
        // (After the test harness's "test as_the_example ... ".)
        if let Some(addr) = line.split("listening on ").nth(1) {
            break addr.rsplit(':').next().expect("address:port").to_string();
        }
    };
    let mut client = spawn(&["-d", "tcp", "-p", &port, "-s", &s, "-n", &n, "127.0.0.1"]);
    let mut client_out = String::new();
    client
        .0
        .stdout
        .take()
        .expect("stdout")
        .read_to_string(&mut client_out)
        .expect("the client's output");
    let c = client.0.wait().expect("client");
    let s_status = server.0.wait().expect("server");
    let server_out = reader.join().expect("reader");
    assert!(c.success(), "client: {c}\n{client_out}");
    assert!(s_status.success(), "server: {s_status}\n{server_out}");
    check_output("client", &client_out, size, iters);
    check_output("server", &server_out, size, iters);
}

#[test]
fn bad_arguments_are_refused() {
    let mut p = spawn(&["-s"]);
    let status = p.0.wait().expect("wait");
    assert!(!status.success());
}
