//! `rdmx bench` refuses bad command lines with a message that names the valid choices.

mod common;

use common::{fails, TESTS};

#[test]
fn a_bad_test_names_every_test() {
    let err = fails(&["bench", "write_bandwidth"]);
    for t in TESTS {
        assert!(err.contains(t), "{t} missing: {err}");
    }
}

#[test]
fn an_unknown_provider_names_the_available_ones() {
    let err = fails(&["bench", "write_bw", "--provider", "nope"]);
    assert!(err.contains("nope"), "{err}");
    assert!(err.contains("loopback") && err.contains("tcp"), "{err}");
    let err = fails(&["bench", "write_bw", "--provider", "loopback,nope"]);
    assert!(err.contains("nope") && err.contains("tcp"), "{err}");
}

#[test]
fn a_provider_without_a_device_says_why() {
    let listed = common::json(&["devices", "--json"]);
    let has_verbs = listed["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .any(|d| d["provider"] == "verbs");
    if !has_verbs {
        let err = fails(&["bench", "write_bw", "--provider", "verbs"]);
        assert!(
            err.contains("not available") && err.contains("RDMA device"),
            "{err}"
        );
        assert!(err.contains("loopback") && err.contains("tcp"), "{err}");
    }
}

#[test]
fn an_unknown_device_names_the_devices() {
    let err = fails(&["bench", "write_bw", "-d", "mlx5_9"]);
    assert!(err.contains("mlx5_9"), "{err}");
    assert!(err.contains("loopback0") && err.contains("tcp0"), "{err}");
    let err = fails(&["bench", "write_bw", "-d", "tcp0", "--provider", "loopback"]);
    assert!(err.contains("tcp0") && err.contains("loopback0"), "{err}");
}

#[test]
fn loopback_cannot_reach_a_peer() {
    let port = common::free_port().to_string();
    for args in [
        &[
            "bench",
            "write_bw",
            "--provider",
            "loopback",
            "--server",
            "-p",
            &port,
        ][..],
        &[
            "bench",
            "write_bw",
            "--provider",
            "loopback",
            "127.0.0.1",
            "-p",
            &port,
        ],
        &[
            "bench",
            "write_bw",
            "-d",
            "loopback0",
            "--server",
            "-p",
            &port,
        ],
    ] {
        let err = fails(args);
        assert!(err.contains("one process"), "{args:?}: {err}");
        assert!(err.contains("tcp"), "{args:?} should name tcp: {err}");
    }
}

#[test]
fn option_errors_name_the_option() {
    for (args, want) in [
        (&["bench", "atomic_bw", "-s", "16"][..], "-s"),
        (&["bench", "write_bw", "-s", "0"], "-s"),
        (&["bench", "write_bw", "-q", "0"], "-q"),
        (&["bench", "write_bw", "-n", "0"], "-n"),
        (&["bench", "write_bw", "-D", "0"], "-D"),
        (&["bench", "write_bw", "-n", "5", "-D", "1"], "--duration"),
        (&["bench", "write_bw", "-a", "-s", "64"], "--size"),
        (&["bench", "write_bw", "-t", "4", "-l", "8"], "-l"),
        (&["bench", "write_bw", "-l", "4", "-Q", "10"], "-Q"),
        (&["bench", "write_lat", "-q", "2"], "-q"),
        (&["bench", "read_lat", "-t", "4"], "-t"),
        (&["bench", "write_bw", "--plot", "x.svg"], "--all"),
        (&["bench", "write_bw", "--mtu", "1000"], "--mtu"),
        (
            &[
                "bench",
                "write_bw",
                "--provider",
                "loopback,tcp",
                "--server",
            ],
            "provider",
        ),
        (&["bench", "write_bw", "--progress", "fast"], "busy"),
    ] {
        let err = fails(args);
        assert!(err.contains(want), "{args:?} should name {want}: {err}");
    }
}
