//! `rdmx bench TEST --server` and `rdmx bench TEST HOST` in two processes: every test
//! across processes with its data verified, tcp when no provider is named, and options
//! that differ between the sides refused on both.

mod common;

use common::{check_row, command, small_size, Server};

/// Runs `args` as a server and as a client of it; returns both outputs.
fn pair(
    server_args: &[&str],
    client_args: &[&str],
) -> (std::process::Output, std::process::Output) {
    let (server, port) = Server::start(server_args);
    let client = command(client_args)
        .args(["127.0.0.1", "-p", &port.to_string()])
        .output()
        .expect("run the client");
    (server.finish(), client)
}

fn ok(what: &str, out: &std::process::Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{what} failed: {err}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `test` across two processes on tcp, with --verify.
fn across(test: &str) {
    let size = small_size(test);
    let args = [
        "bench",
        test,
        "--provider",
        "tcp",
        "-n",
        "100",
        "-s",
        size,
        "--verify",
        "--json",
    ];
    let (server, client) = pair(&args, &args);
    let s: serde_json::Value =
        serde_json::from_str(&ok("the server", &server)).expect("the server's JSON");
    let c: serde_json::Value =
        serde_json::from_str(&ok("the client", &client)).expect("the client's JSON");
    for v in [&s, &c] {
        assert_eq!(v["test"], test, "{v}");
        assert_eq!(v["provider"], "tcp", "{v}");
        assert_eq!(v["verify"], true, "{v}");
    }
    assert!(
        c["peer"]
            .as_str()
            .is_some_and(|p| p.starts_with("127.0.0.1:")),
        "{c}"
    );
    // The client measures and reports; the server has no rows.
    assert_eq!(s["results"].as_array().map(Vec::len), Some(0), "{s}");
    let rows = c["results"].as_array().expect("results");
    assert_eq!(rows.len(), 1, "{c}");
    check_row(test, &rows[0], size.parse().unwrap(), &c.to_string());
    assert_eq!(rows[0]["iterations"], 100, "{c}");
}

macro_rules! across_processes {
    ($($name:ident: $test:literal,)*) => {
        $(
            #[test]
            fn $name() {
                across($test);
            }
        )*
    };
}

across_processes! {
    write_bw: "write_bw",
    write_lat: "write_lat",
    read_bw: "read_bw",
    read_lat: "read_lat",
    send_bw: "send_bw",
    send_lat: "send_lat",
    atomic_bw: "atomic_bw",
    atomic_lat: "atomic_lat",
}

#[test]
fn a_peer_without_a_provider_runs_tcp_and_the_header_says_so() {
    let (server, client) = pair(
        &["bench", "write_bw", "-n", "100"],
        &["bench", "write_bw", "-n", "100"],
    );
    for (what, out) in [("server", &server), ("client", &client)] {
        let text = ok(what, out);
        let provider = text
            .lines()
            .find(|l| l.trim_start().starts_with("Provider"))
            .unwrap_or_else(|| panic!("{what}: no Provider line: {text}"));
        assert!(
            provider.contains("tcp") && provider.contains("tcp0"),
            "{what}: {provider}"
        );
    }
    let text = ok("client", &client);
    assert!(text.contains("BW average[MiB/sec]"), "{text}");
    assert!(
        text.lines().any(|l| l.trim_start().starts_with("65536")),
        "{text}"
    );
}

#[test]
fn a_sweep_and_several_qps_cross_processes_and_the_client_plots() {
    let svg = std::env::temp_dir().join(format!("rdmx-2p-{}.svg", std::process::id()));
    let args = [
        "bench", "send_bw", "-a", "-n", "3", "-q", "2", "-l", "2", "--verify", "--json",
    ];
    let mut client_args = args.to_vec();
    client_args.extend(["--plot", svg.to_str().unwrap()]);
    let (server, client) = pair(&args, &client_args);
    ok("the server", &server);
    let c: serde_json::Value =
        serde_json::from_str(&ok("the client", &client)).expect("the client's JSON");
    assert_eq!(c["qps"], 2, "{c}");
    let rows = c["results"].as_array().expect("results");
    assert_eq!(rows.len(), 23, "{c}");
    for (k, row) in rows.iter().enumerate() {
        check_row("send_bw", row, 2 << k, &c.to_string());
    }
    let plot = std::fs::read_to_string(&svg).expect("the client drew the plot");
    assert!(
        plot.contains("<polyline") && plot.contains("\ntcp\n"),
        "{plot}"
    );
    let _ = std::fs::remove_file(&svg);
}

#[test]
fn differing_options_are_refused_on_both_sides() {
    for (server_extra, client_extra, option, here, there) in [
        (&["-q", "2"][..], &["-q", "1"][..], "-q/--qp", "2", "1"),
        (&["-s", "64"], &["-s", "128"], "-s", "-s 64", "-s 128"),
        (&["-n", "10"], &["-D", "1"], "-n/-D", "-n 10", "-D 1"),
        (&["--verify"], &[], "--verify", "on", "off"),
    ] {
        let mut s = vec!["bench", "write_bw"];
        s.extend_from_slice(server_extra);
        let mut c = vec!["bench", "write_bw"];
        c.extend_from_slice(client_extra);
        let (server, client) = pair(&s, &c);
        for (what, out, mine, peer) in [
            ("server", &server, here, there),
            ("client", &client, there, here),
        ] {
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{what} of {s:?} / {c:?} should fail");
            assert!(err.contains(option), "{what} should name {option}: {err}");
            assert!(
                err.contains(&format!("the peer has {peer}, this side {mine}")),
                "{what} should name both values: {err}"
            );
        }
    }
    let (server, client) = pair(&["bench", "read_bw"], &["bench", "write_bw"]);
    for (what, out) in [("server", &server), ("client", &client)] {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{what}");
        assert!(
            err.contains("TEST") && err.contains("read_bw") && err.contains("write_bw"),
            "{what}: {err}"
        );
    }
}

#[test]
fn uc_tests_cross_processes_with_their_data_verified() {
    for test in ["write_bw", "send_lat"] {
        let size = small_size(test);
        let args = [
            "bench",
            test,
            "-c",
            "UC",
            "--provider",
            "tcp",
            "-n",
            "100",
            "-s",
            size,
            "--verify",
            "--json",
        ];
        let c = both_ok(&args);
        assert_eq!(c["transport"], "UC", "{c}");
        let rows = c["results"].as_array().expect("results");
        check_row(test, &rows[0], size.parse().unwrap(), &c.to_string());
    }
}

/// Runs `args` (with `--json`) as server and client; both must succeed. Returns the
/// client's JSON.
fn both_ok(args: &[&str]) -> serde_json::Value {
    let (server, client) = pair(args, args);
    ok("the server", &server);
    serde_json::from_str(&ok("the client", &client)).expect("the client's JSON")
}

/// Ping-pongs over UC and UD through a sweep of sizes: from the second size on, `DONE`
/// carries the generation bit (before, the answering side read it as part of the count
/// and reported wrong data).
#[test]
fn uc_and_ud_ping_pongs_sweep_sizes_with_their_data_verified() {
    for (conn, provider, test) in [
        ("UC", "tcp", "write_lat"),
        ("UC", "shm", "send_lat"),
        ("UD", "shm", "send_lat"),
    ] {
        let args = [
            "bench",
            test,
            "-c",
            conn,
            "--provider",
            provider,
            "-a",
            "-n",
            "5",
            "--verify",
            "--json",
        ];
        let c = both_ok(&args);
        let rows = c["results"].as_array().expect("results");
        assert!(rows.len() > 2, "{conn} {test}: {c}");
    }
}

#[test]
fn ud_tests_cross_processes_on_shm_and_udp_with_their_data_verified() {
    for provider in ["shm", "udp"] {
        for test in ["send_bw", "send_lat"] {
            // A UD message fits the path MTU: an odd size under it.
            let args = [
                "bench",
                test,
                "-c",
                "UD",
                "--provider",
                provider,
                "-n",
                "100",
                "-s",
                "1001",
                "--verify",
                "--json",
            ];
            let c = both_ok(&args);
            assert_eq!(c["transport"], "UD", "{c}");
            assert_eq!(c["provider"], provider, "{c}");
            let rows = c["results"].as_array().expect("results");
            check_row(test, &rows[0], 1001, &c.to_string());
        }
    }
}
