//! `rdmx bench TEST --perftest` against another `rdmx bench TEST --perftest`, in two
//! processes on the udp provider (each binds the first free loopback address on port
//! 4791): the rows each side prints, as perftest's tools print them.

mod common;

use common::{command, Server};

/// Runs `args` with `--perftest --provider udp` as a server (with `server`) and as its
/// client (with `client`); returns both stdouts.
fn pair(args: &[&str], server: &[&str], client: &[&str]) -> (String, String) {
    let base = [&["bench"], args, &["--perftest", "--provider", "udp"]].concat();
    let (s, port) = Server::start(&[&base[..], server].concat());
    let c = command(&[&base[..], client].concat())
        .args(["127.0.0.1", "-p", &port.to_string()])
        .output()
        .expect("run the client");
    let s = s.finish();
    let text = |what: &str, out: &std::process::Output| {
        assert!(
            out.status.success(),
            "the {what} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    (text("server", &s), text("client", &c))
}

/// The cells of the row under the table's title line.
fn row(text: &str) -> Vec<String> {
    let mut lines = text.lines();
    lines
        .by_ref()
        .find(|l| l.trim_start().starts_with("#bytes"))
        .unwrap_or_else(|| panic!("no table: {text}"));
    let row = lines.next().unwrap_or_else(|| panic!("no row: {text}"));
    row.split_whitespace().map(String::from).collect()
}

#[test]
fn the_server_prints_the_clients_bandwidth_as_it_came() {
    // perftest sends bandwidth in the sender's unit (Gb/s with --report_gbits) and its
    // server prints the client's report unchanged, whatever its own unit.
    for server in [&["--report_gbits"][..], &[]] {
        let (s, c) = pair(
            &["write_bw", "-n", "200", "-s", "4096"],
            server,
            &["--report_gbits"],
        );
        assert!(c.contains("BW average[Gb/sec]"), "{c}");
        let (s, c) = (row(&s), row(&c));
        assert_eq!(s.len(), 5, "{s:?}");
        assert!(c[3].parse::<f64>().is_ok_and(|bw| bw > 0.0), "{c:?}");
        assert_eq!(
            s[2..],
            c[2..],
            "server {server:?}: the server's row, then the client's"
        );
    }
}

#[test]
fn latency_rows_count_the_iterations_asked_for() {
    // perftest times n - 1 rounds (each post from the one before) and prints
    // #iterations n.
    for test in ["write_lat", "send_lat"] {
        let (s, c) = pair(&[test, "-n", "100"], &[], &[]);
        for (side, text) in [("server", &s), ("client", &c)] {
            let r = row(text);
            assert_eq!(r.len(), 9, "{test}, {side}: {r:?}");
            assert_eq!(r[1], "100", "{test}, {side}: {text}");
        }
    }
}

#[test]
fn bandwidth_rows_count_the_iterations_of_every_qp() {
    // perftest's #iterations (and the report it sends) is -n times -q.
    for test in ["write_bw", "read_bw", "send_bw"] {
        let (s, c) = pair(&[test, "-q", "2", "-n", "100", "-s", "4096"], &[], &[]);
        for (side, text) in [("server", &s), ("client", &c)] {
            let r = row(text);
            assert_eq!(r.len(), 5, "{test}, {side}: {r:?}");
            assert_eq!(r[1], "200", "{test}, {side}: {text}");
        }
    }
}
