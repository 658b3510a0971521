//! `rdmx devices` and `rdmx bench reg`: their outputs have the documented keys. The
//! transfer tests are in `bench_*.rs`.

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
fn devices_json_lists_every_software_provider_with_capabilities() {
    let v = rdmx(&["devices", "--json"]);
    let devs = v["devices"].as_array().expect("a devices list");
    for (provider, device) in [
        ("loopback", "loopback0"),
        ("tcp", "tcp0"),
        ("shm", "shm0"),
        ("udp", "udp0"),
    ] {
        let d = devs
            .iter()
            .find(|d| d["provider"] == provider)
            .unwrap_or_else(|| panic!("no {provider} device: {v}"));
        assert_eq!(d["device"], device, "{d}");
        assert_eq!(d["atomics"], "global", "{d}");
    }
    for d in devs {
        assert!(
            ["loopback", "tcp", "shm", "udp", "verbs"]
                .contains(&d["provider"].as_str().unwrap_or("")),
            "{d}"
        );
        assert!(d["device"].as_str().is_some_and(|n| !n.is_empty()), "{d}");
        for key in [
            "max_qp",
            "max_qp_wr",
            "max_sge",
            "max_cqe",
            "max_mr",
            "max_mr_size",
            "max_qp_rd_atom",
            "max_qp_init_rd_atom",
            "max_inline_data",
        ] {
            assert!(d[key].as_u64().is_some(), "{key} should be a number: {d}");
        }
        assert!(
            d["max_mtu"]
                .as_u64()
                .is_some_and(|m| m >= 256 && m.is_power_of_two()),
            "{d}"
        );
        assert!(
            ["none", "device", "global"].contains(&d["atomics"].as_str().unwrap_or("")),
            "{d}"
        );
    }
}

#[test]
fn devices_table_names_each_device_and_its_provider() {
    let out = Command::new(env!("CARGO_BIN_EXE_rdmx"))
        .arg("devices")
        .output()
        .expect("run rdmx");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("device: loopback0 (provider loopback)"),
        "{text}"
    );
    assert!(text.contains("device: tcp0 (provider tcp)"), "{text}");
    assert!(text.contains("max_qp:"), "{text}");
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
        "memcpy_64k_misaligned_ns",
        "copy_64k_ns",
        "copy_64k_misaligned_ns",
        "line_one_way_ns",
    ] {
        assert!(
            v[key].as_f64().is_some_and(|t| t > 0.0),
            "{key} should be a positive number: {}",
            v[key]
        );
    }
    assert!(v["cache_hits"].as_u64().unwrap() > 0);
}
