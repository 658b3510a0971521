//! `rdmx bench TEST` with both sides in one process: every test on every software
//! provider with its data verified, and perftest's options showing in what ran.

mod common;

use common::{check_row, json, run, small_size};

/// Runs `test` on `provider` with `--verify` and checks the JSON object.
fn verified(test: &str, provider: &str) {
    let size = small_size(test);
    let v = json(&[
        "bench",
        test,
        "--provider",
        provider,
        "-n",
        "200",
        "-s",
        size,
        "--verify",
        "--json",
    ]);
    let what = format!("{test} on {provider}: {v}");
    assert_eq!(v["test"], test, "{what}");
    assert_eq!(v["provider"], provider, "{what}");
    assert_eq!(v["device"], format!("{provider}0"), "{what}");
    assert_eq!(v["transport"], "RC", "{what}");
    assert_eq!(v["verify"], true, "{what}");
    assert_eq!(v["peer"], "this process", "{what}");
    let rows = v["results"].as_array().expect("results");
    assert_eq!(rows.len(), 1, "{what}");
    check_row(test, &rows[0], size.parse().unwrap(), &what);
    assert_eq!(rows[0]["iterations"], 200, "{what}");
}

macro_rules! every_test_on {
    ($($name:ident: $test:literal on $provider:literal,)*) => {
        $(
            #[test]
            fn $name() {
                verified($test, $provider);
            }
        )*
    };
}

every_test_on! {
    write_bw_loopback: "write_bw" on "loopback",
    write_lat_loopback: "write_lat" on "loopback",
    read_bw_loopback: "read_bw" on "loopback",
    read_lat_loopback: "read_lat" on "loopback",
    send_bw_loopback: "send_bw" on "loopback",
    send_lat_loopback: "send_lat" on "loopback",
    atomic_bw_loopback: "atomic_bw" on "loopback",
    atomic_lat_loopback: "atomic_lat" on "loopback",
    write_bw_tcp: "write_bw" on "tcp",
    write_lat_tcp: "write_lat" on "tcp",
    read_bw_tcp: "read_bw" on "tcp",
    read_lat_tcp: "read_lat" on "tcp",
    send_bw_tcp: "send_bw" on "tcp",
    send_lat_tcp: "send_lat" on "tcp",
    atomic_bw_tcp: "atomic_bw" on "tcp",
    atomic_lat_tcp: "atomic_lat" on "tcp",
    write_bw_shm: "write_bw" on "shm",
    write_lat_shm: "write_lat" on "shm",
    read_bw_shm: "read_bw" on "shm",
    read_lat_shm: "read_lat" on "shm",
    send_bw_shm: "send_bw" on "shm",
    send_lat_shm: "send_lat" on "shm",
    atomic_bw_shm: "atomic_bw" on "shm",
    atomic_lat_shm: "atomic_lat" on "shm",
}

/// The column titles of the table in `text`: its line starting with `first`, split at
/// runs of two or more spaces.
fn columns(text: &str, first: &str) -> Vec<String> {
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with(first))
        .unwrap_or_else(|| panic!("no column titles: {text}"));
    line.split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(String::from)
        .collect()
}

#[test]
fn the_default_provider_in_one_process_is_shm_and_the_header_says_so() {
    let out = run(&["bench", "write_bw", "-n", "50"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("RDMA_Write BW Test"), "{text}");
    let provider = text
        .lines()
        .find(|l| l.trim_start().starts_with("Provider"))
        .unwrap_or_else(|| panic!("no Provider line: {text}"));
    assert!(
        provider.contains("shm") && provider.contains("shm0"),
        "{provider}"
    );
    assert!(
        text.lines()
            .any(|l| l.contains("Provider chosen") && l.contains("default in one process")),
        "{text}"
    );
    assert_eq!(
        columns(&text, "#bytes"),
        [
            "#bytes",
            "#iterations",
            "BW peak[MiB/sec]",
            "BW average[MiB/sec]",
            "MsgRate[Mpps]"
        ]
    );
    let row = text
        .lines()
        .find(|l| l.trim_start().starts_with("65536"))
        .unwrap_or_else(|| panic!("no row for 65536 bytes: {text}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cells.len(), 5, "{row}");
    assert_eq!(cells[1], "50", "{row}");
    assert!(cells[3].parse::<f64>().is_ok_and(|bw| bw > 0.0), "{row}");
}

#[test]
fn latency_tables_have_perftest_columns() {
    let out = run(&["bench", "read_lat", "-n", "50", "--provider", "tcp"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        columns(&text, "#bytes"),
        [
            "#bytes",
            "#iterations",
            "t_min[usec]",
            "t_max[usec]",
            "t_typical[usec]",
            "t_avg[usec]",
            "t_stdev[usec]",
            "99% percentile[usec]",
            "99.9% percentile[usec]"
        ]
    );
    let row = text
        .lines()
        .find(|l| l.trim_start().starts_with("2 "))
        .unwrap_or_else(|| panic!("no row for 2 bytes: {text}"));
    assert_eq!(row.split_whitespace().count(), 9, "{row}");
}

#[test]
fn report_gbits_changes_the_columns() {
    let out = run(&["bench", "write_bw", "-n", "50", "--report_gbits"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        columns(&text, "#bytes")[2..4],
        ["BW peak[Gb/sec]", "BW average[Gb/sec]"]
    );
    assert!(!text.contains("MiB/sec"), "{text}");
    let v = json(&["bench", "write_bw", "-n", "50", "--report_gbits", "--json"]);
    let row = &v["results"][0];
    let (mib, gbit) = (
        row["bw_avg_mib_s"].as_f64().unwrap(),
        row["bw_avg_gbit_s"].as_f64().unwrap(),
    );
    // The same figure in two units: 1 MiB/s = 8 * 2^20 / 10^9 Gb/s.
    assert!(
        (gbit - mib * 8.0 * 1048576.0 / 1e9).abs() <= 1e-9 * mib.max(1.0),
        "{row}"
    );
}

#[test]
fn a_warm_up_window_runs_before_the_measured_requests() {
    // The responder checks every request that reached it: an atomic counter that missed
    // the warm-up's FETCH_ADDs, or a slot holding a warm-up WRITE, fails the run.
    for (test, size) in [
        ("atomic_bw", "8"),
        ("write_bw", "4096"),
        ("read_bw", "4096"),
    ] {
        let v = json(&[
            "bench",
            test,
            "--provider",
            "tcp",
            "-n",
            "40",
            "-t",
            "16",
            "-s",
            size,
            "--perform_warm_up",
            "--verify",
            "--json",
        ]);
        assert_eq!(v["verify"], true, "{v}");
        assert_eq!(v["warm_up"], v["tx_depth"], "one window: {v}");
        let row = &v["results"][0];
        check_row(test, row, size.parse().unwrap(), &v.to_string());
        assert_eq!(row["iterations"], 40, "the warm-up is not counted: {v}");
    }
}

#[test]
fn qps_spread_the_run_and_count_the_iterations_of_every_qp() {
    for provider in ["loopback", "tcp"] {
        let v = json(&[
            "bench",
            "send_bw",
            "--provider",
            provider,
            "-q",
            "3",
            "-n",
            "100",
            "-s",
            "1024",
            "--verify",
            "--json",
        ]);
        assert_eq!(v["qps"], 3, "{v}");
        let row = &v["results"][0];
        check_row("send_bw", row, 1024, &v.to_string());
        // As perftest's #iterations: -n per QP, times -q.
        assert_eq!(row["iterations"], 300, "every QP's: {v}");
        // Three QPs' messages over the elapsed time.
        let bw = row["bw_avg_mib_s"].as_f64().unwrap();
        let rate = row["msg_rate_mpps"].as_f64().unwrap();
        assert!(
            (bw * 1048576.0 / 1024.0 - rate * 1e6).abs() <= 1e-6 * bw * 1024.0,
            "{row}"
        );
    }
}

#[test]
fn tx_depth_cq_moderation_and_post_lists_show_in_what_ran() {
    let v = json(&["bench", "write_bw", "-t", "16", "-n", "100", "--json"]);
    assert_eq!(
        (v["tx_depth"].as_u64(), v["cq_mod"].as_u64()),
        (Some(16), Some(16)),
        "-Q is capped at -t: {v}"
    );
    let v = json(&["bench", "write_bw", "-Q", "10", "-n", "95", "--json"]);
    assert_eq!(v["cq_mod"], 10, "{v}");
    assert_eq!(
        v["results"][0]["iterations"], 95,
        "the last request is signaled: {v}"
    );
    for provider in ["loopback", "tcp"] {
        let v = json(&[
            "bench",
            "read_bw",
            "--provider",
            provider,
            "-l",
            "4",
            "-n",
            "102",
            "--verify",
            "--json",
        ]);
        assert_eq!(
            (v["post_list"].as_u64(), v["cq_mod"].as_u64()),
            (Some(4), Some(4)),
            "{v}"
        );
        check_row("read_bw", &v["results"][0], 65536, &v.to_string());
        assert_eq!(v["results"][0]["iterations"], 102, "{v}");
    }
}

#[test]
fn verify_with_large_messages_and_post_lists_completes() {
    // 8 MiB messages leave two slots under --verify: fewer than -l and -Q.
    let v = json(&[
        "bench", "write_bw", "-s", "8388608", "-n", "6", "-l", "4", "--verify", "--json",
    ]);
    assert_eq!(v["tx_depth"], 2, "{v}");
    assert_eq!(
        (v["post_list"].as_u64(), v["cq_mod"].as_u64()),
        (Some(2), Some(2)),
        "{v}"
    );
    check_row("write_bw", &v["results"][0], 8388608, &v.to_string());
}

#[test]
fn large_messages_ping_pong_with_their_data_verified() {
    // Busy polling once reported a 64 KiB receive before its payload had landed; the
    // check on every round catches that, in both progress modes (the default has polls
    // read the streams too).
    for (mode, name) in [("busy", "busy-poll"), ("thread", "thread")] {
        for test in ["send_lat", "read_lat", "write_lat"] {
            let v = json(&[
                "bench",
                test,
                "--provider",
                "tcp",
                "-s",
                "65536",
                "-n",
                "300",
                "--progress",
                mode,
                "--verify",
                "--json",
            ]);
            assert_eq!(v["progress"], name, "{v}");
            check_row(test, &v["results"][0], 65536, &v.to_string());
        }
    }
}

#[test]
fn duration_runs_for_a_time_instead_of_a_count() {
    for test in ["write_bw", "atomic_bw", "send_lat"] {
        let v = json(&["bench", test, "--provider", "tcp", "-D", "0.3", "--json"]);
        let what = v.to_string();
        let row = &v["results"][0];
        check_row(test, row, small_default(test), &what);
    }
}

fn small_default(test: &str) -> u64 {
    match test {
        _ if test.starts_with("atomic") => 8,
        _ if test.ends_with("_bw") => 65536,
        _ => 2,
    }
}

#[test]
fn a_device_picks_its_provider() {
    let v = json(&["bench", "write_lat", "-d", "tcp0", "-n", "50", "--json"]);
    assert_eq!(
        (v["provider"].as_str(), v["device"].as_str()),
        (Some("tcp"), Some("tcp0")),
        "{v}"
    );
    let v = json(&[
        "bench",
        "write_bw",
        "-d",
        "loopback0",
        "--provider",
        "loopback",
        "-n",
        "50",
        "--json",
    ]);
    assert_eq!(v["device"], "loopback0", "{v}");
}

#[test]
fn a_low_memlock_limit_runs_unpinned_and_says_so() {
    // Root locks memory past any limit (CAP_IPC_LOCK): run as nobody then.
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let root = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        == Some("0");
    let drop = if root {
        if std::process::Command::new("setpriv")
            .arg("--version")
            .output()
            .is_err()
        {
            eprintln!("running as root without setpriv: the memlock limit is not checked");
            return;
        }
        "setpriv --reuid=65534 --regid=65534 --clear-groups "
    } else {
        ""
    };
    for provider in ["loopback", "tcp"] {
        let line = format!(
            "ulimit -l 64 && exec {drop}{} bench write_bw --provider {provider} -n 50 --verify --json",
            env!("CARGO_BIN_EXE_rdmx")
        );
        let out = std::process::Command::new("sh")
            .args(["-c", &line])
            .current_dir("/")
            .output()
            .expect("run sh");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{line}: {err}");
        assert!(
            err.contains("RLIMIT_MEMLOCK") && err.contains("unpinned"),
            "{err}"
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert_eq!(v["pinned"], false, "{v}");
        check_row("write_bw", &v["results"][0], 65536, &v.to_string());
    }
    if root {
        let v = json(&["bench", "write_bw", "-n", "50", "--json"]);
        assert_eq!(v["pinned"], true, "no limit, pinned: {v}");
    }
}

/// shm names its data path as it runs it: direct by default (both sides are in this
/// process), cma when asked for (`RDMX_SHM_DATA_PATH=cma`) and the kernel lets the
/// process read its own memory, which it always does, and the ring when asked for.
/// 64 KiB WRITEs verified each way.
#[test]
fn shm_reports_the_data_path_it_runs() {
    for (env, want) in [
        (None, "direct"),
        (Some("cma"), "cma"),
        (Some("ring"), "ring"),
    ] {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rdmx"));
        cmd.args([
            "bench",
            "write_bw",
            "--provider",
            "shm",
            "-n",
            "200",
            "-s",
            "65536",
            "--verify",
            "--json",
        ]);
        match env {
            Some(v) => cmd.env("RDMX_SHM_DATA_PATH", v),
            None => cmd.env_remove("RDMX_SHM_DATA_PATH"),
        };
        let out = cmd.output().expect("run rdmx");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert_eq!(v["data_path"], want, "RDMX_SHM_DATA_PATH={env:?}: {v}");
    }
}

#[test]
fn inline_sizes_follow_perftest_and_inline_messages_arrive_intact() {
    // perftest's defaults (latency tests inline, bandwidth tests not), -I in their place;
    // each run checks its data.
    let cases: [(&str, &[&str], u64); 7] = [
        ("send_lat", &[], 236),
        ("send_lat", &["-c", "UD"], 188),
        ("write_lat", &[], 220),
        ("write_bw", &[], 0),
        ("send_lat", &["-I", "0"], 0),
        ("write_bw", &["-I", "64"], 64),
        ("send_bw", &["-I", "64", "-l", "4"], 64),
    ];
    for provider in ["shm", "loopback"] {
        for (test, extra, want) in cases {
            let mut args = vec![
                "bench",
                test,
                "--provider",
                provider,
                "-s",
                "8",
                "-n",
                "200",
                "--verify",
                "--json",
            ];
            args.extend(extra);
            let v = json(&args);
            let what = format!("{test} {extra:?} on {provider}: {v}");
            assert_eq!(v["inline_size"], want, "{what}");
            check_row(test, &v["results"][0], 8, &what);
        }
    }
    let out = run(&["bench", "send_lat", "-s", "8", "-n", "100"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("Inline data is used up to 236 bytes message"),
        "{text}"
    );
    let err = common::fails(&["bench", "send_lat", "--provider", "loopback", "-I", "5000"]);
    assert!(
        err.contains("-I 5000") && err.contains("at most 4096 bytes inline"),
        "{err}"
    );
}
