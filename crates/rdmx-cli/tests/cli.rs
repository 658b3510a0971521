//! The `rdmx` binary: its JSON outputs have the documented keys.

use std::process::Command;

fn rdmx(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_rdmx"))
        .args(args)
        .output()
        .expect("run rdmx");
    assert!(
        out.status.success(),
        "rdmx {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object on stdout")
}

#[test]
fn devices_json_lists_loopback_with_capabilities() {
    let v = rdmx(&["devices", "--json"]);
    let devs = v["devices"].as_array().expect("a devices list");
    let lo = devs
        .iter()
        .find(|d| d["provider"] == "loopback")
        .expect("the loopback device");
    for key in [
        "device",
        "max_qp",
        "max_qp_wr",
        "max_sge",
        "max_mr_size",
        "max_mtu",
    ] {
        assert!(lo.get(key).is_some(), "missing {key}: {lo}");
    }
    assert_eq!(lo["atomics"], true);
}

#[test]
fn bench_reg_json_has_the_documented_keys() {
    let v = rdmx(&["bench", "reg", "--runs", "1", "--json"]);
    for size in ["4096", "65536", "1048576", "67108864"] {
        let t = &v["register_us"][size];
        assert!(
            t.is_null() || t.as_f64().is_some_and(|t| t > 0.0),
            "register_us[{size}] = {t}"
        );
    }
    for key in [
        "cache_hit_ns",
        "cache_miss_us",
        "pool_get_put_ns",
        "pool_get_put_2t_ns",
        "memcpy_64k_ns",
    ] {
        assert!(
            v[key].as_f64().is_some_and(|t| t > 0.0),
            "{key} should be a positive number: {}",
            v[key]
        );
    }
    assert!(v["cache_hits"].as_u64().unwrap() > 0);
}

#[test]
fn unknown_command_is_an_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_rdmx"))
        .args(["bench", "no_such_test"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(!out.stderr.is_empty());
}

#[test]
fn every_transfer_test_runs_on_every_provider_with_verified_data() {
    for provider in ["loopback", "tcp"] {
        for test in [
            "write_bw",
            "read_bw",
            "send_bw",
            "atomic_bw",
            "write_lat",
            "read_lat",
            "send_lat",
            "atomic_lat",
        ] {
            let v = rdmx(&[
                "bench",
                test,
                "--provider",
                provider,
                "-n",
                "200",
                "-s",
                if test.starts_with("atomic") {
                    "8"
                } else {
                    "4097"
                },
                "--verify",
                "--json",
            ]);
            let what = format!("{test} on {provider}: {v}");
            assert_eq!(v["test"], test, "{what}");
            assert_eq!(v["provider"], provider, "{what}");
            assert_eq!(v["transport"], "RC", "{what}");
            let row = &v["results"][0];
            assert_eq!(row["iterations"], 200, "{what}");
            let keys: &[&str] = if test.ends_with("_bw") {
                &["bw_peak_mib_s", "bw_avg_mib_s", "msg_rate_mpps"]
            } else {
                &[
                    "t_min_us",
                    "t_max_us",
                    "t_typical_us",
                    "t_avg_us",
                    "t_stdev_us",
                    "p99_us",
                    "p999_us",
                ]
            };
            for k in keys {
                assert!(row[k].as_f64().is_some_and(|x| x > 0.0), "{k}: {what}");
            }
        }
    }
}

#[test]
fn unavailable_provider_is_an_error_naming_the_available_ones() {
    let out = Command::new(env!("CARGO_BIN_EXE_rdmx"))
        .args(["bench", "write_bw", "--provider", "nope"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("loopback") && err.contains("tcp"), "{err}");
}

#[test]
fn bad_sizes_are_refused() {
    for args in [
        &["bench", "atomic_bw", "-s", "16"][..],
        &["bench", "write_bw", "-s", "0"][..],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_rdmx"))
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
    }
}
