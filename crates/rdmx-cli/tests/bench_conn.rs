//! `rdmx bench -c RC|UC|UD` (perftest's connection type): the tests perftest allows on each
//! type run with their data verified on every software provider whose capabilities have
//! the type, chosen by `rdmx devices`' capabilities, and the rest are refused by name.

mod common;

use common::{check_row, fails, json, small_size};

/// The providers whose devices have `conn` queue pairs, as `rdmx devices --json` says.
fn providers_with(conn: &str) -> Vec<String> {
    let v = json(&["devices", "--json"]);
    let mut out: Vec<String> = v["devices"]
        .as_array()
        .expect("a list of devices")
        .iter()
        .filter(|d| d["provider"] != "verbs")
        .filter(|d| {
            d["qp_types"]
                .as_array()
                .is_some_and(|t| t.iter().any(|t| t == conn))
        })
        .map(|d| d["provider"].as_str().unwrap().to_string())
        .collect();
    out.dedup();
    out
}

fn verified(test: &str, conn: &str, provider: &str) {
    // A UD message fits the path MTU: an odd size under it.
    let size = if conn == "UD" {
        "1001"
    } else {
        small_size(test)
    };
    let v = json(&[
        "bench",
        test,
        "-c",
        conn,
        "--provider",
        provider,
        "-n",
        "100",
        "-s",
        size,
        "--verify",
        "--json",
    ]);
    let what = format!("{test} -c {conn} on {provider}: {v}");
    assert_eq!(v["transport"], conn, "{what}");
    assert_eq!(v["verify"], true, "{what}");
    let rows = v["results"].as_array().expect("results");
    assert_eq!(rows.len(), 1, "{what}");
    check_row(test, &rows[0], size.parse().unwrap(), &what);
}

#[test]
fn uc_runs_write_and_send_tests_on_every_provider_with_uc() {
    let providers = providers_with("UC");
    assert!(providers.iter().any(|p| p == "loopback"), "{providers:?}");
    for p in &providers {
        for test in ["write_bw", "write_lat", "send_bw", "send_lat"] {
            verified(test, "UC", p);
        }
    }
}

#[test]
fn ud_runs_send_tests_on_every_provider_with_ud() {
    let providers = providers_with("UD");
    assert!(providers.iter().any(|p| p == "loopback"), "{providers:?}");
    for p in &providers {
        for test in ["send_bw", "send_lat"] {
            verified(test, "UD", p);
        }
    }
}

#[test]
fn what_a_connection_type_lacks_is_refused_by_name() {
    for test in ["read_bw", "read_lat", "atomic_bw", "atomic_lat"] {
        let err = fails(&["bench", test, "-c", "UC"]);
        assert!(err.contains("-c UC"), "{test}: {err}");
    }
    for test in ["write_bw", "write_lat", "read_bw", "atomic_lat"] {
        let err = fails(&["bench", test, "-c", "UD"]);
        assert!(err.contains("-c UD"), "{test}: {err}");
    }
    let err = fails(&["bench", "send_bw", "-c", "UD", "--provider", "tcp"]);
    assert!(err.contains("no UD queue pairs"), "{err}");
    let err = fails(&["bench", "send_bw", "-c", "UD", "-s", "1000000"]);
    assert!(err.contains("path MTU"), "{err}");
}
