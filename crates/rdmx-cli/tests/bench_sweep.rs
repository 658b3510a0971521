//! `rdmx bench TEST -a`: every size from 2 B to 8 MiB, one row each, and `--plot` drawing
//! one line per provider. Few iterations per size keep the sweeps short (a sweep has no
//! upper bound other than perftest's 8 MiB).

mod common;

use common::{check_row, json};

/// The `points` of the data lines in an SVG drawn by `--plot` (the wide polylines with
/// more than two points; the legend's are two-point strokes).
fn lines(svg: &str) -> Vec<(String, usize)> {
    svg.split("<polyline")
        .skip(1)
        .filter_map(|p| {
            let attr = |name: &str| {
                let at = p.find(&format!("{name}=\""))? + name.len() + 2;
                Some(p[at..].split('"').next()?.to_string())
            };
            let points = attr("points")?.split_whitespace().count();
            let stroke = attr("stroke")?;
            (attr("stroke-width")? == "2" && points > 2).then_some((stroke, points))
        })
        .collect()
}

fn sweep_rows(v: &serde_json::Value, test: &str) {
    let rows = v["results"].as_array().expect("results");
    assert_eq!(rows.len(), 23, "{v}");
    for (k, row) in rows.iter().enumerate() {
        check_row(test, row, 2u64 << k, &v.to_string());
        assert_eq!(row["iterations"], 3, "{row}");
    }
}

#[test]
fn a_bandwidth_sweep_has_a_row_per_power_of_two() {
    let v = json(&["bench", "write_bw", "-a", "-n", "3", "--verify", "--json"]);
    assert_eq!(v["provider"], "shm");
    assert_eq!(v["provider_by_default"], true);
    sweep_rows(&v, "write_bw");
}

#[test]
fn a_latency_sweep_has_a_row_per_power_of_two() {
    let v = json(&[
        "bench",
        "read_lat",
        "-a",
        "-n",
        "3",
        "--provider",
        "tcp",
        "--json",
    ]);
    sweep_rows(&v, "read_lat");
}

#[test]
fn an_atomic_sweep_is_8_bytes() {
    let v = json(&["bench", "atomic_lat", "-a", "-n", "3", "--json"]);
    let rows = v["results"].as_array().expect("results");
    assert_eq!(rows.len(), 1, "{v}");
    check_row("atomic_lat", &rows[0], 8, &v.to_string());
}

#[test]
fn a_plot_draws_one_line_per_provider() {
    let dir = std::env::temp_dir().join(format!("rdmx-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (test, providers, n) in [
        ("send_bw", "loopback,tcp", 2),
        ("write_lat", "tcp,loopback", 2),
        ("read_bw", "tcp", 1),
    ] {
        let path = dir.join(format!("{test}.svg"));
        let path_s = path.to_str().unwrap();
        let v = json(&[
            "bench",
            test,
            "-a",
            "-n",
            "3",
            "--provider",
            providers,
            "--plot",
            path_s,
            "--json",
        ]);
        let runs = match v.get("runs") {
            Some(r) => r.as_array().unwrap().clone(),
            None => vec![v.clone()],
        };
        let names: Vec<&str> = providers.split(',').collect();
        assert_eq!(runs.len(), n, "{v}");
        for (run, name) in runs.iter().zip(&names) {
            assert_eq!(run["provider"], *name, "{v}");
            sweep_rows(run, test);
        }
        let svg = std::fs::read_to_string(&path).expect("the plot was written");
        assert!(
            svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
            "{svg}"
        );
        assert!(svg.contains(test), "the title names the test");
        let drawn = lines(&svg);
        assert_eq!(drawn.len(), n, "one line per provider: {drawn:?}");
        for (_, points) in &drawn {
            assert_eq!(*points, 23, "a point per size: {drawn:?}");
        }
        if n == 2 {
            assert_ne!(drawn[0].0, drawn[1].0, "each provider has its colour");
        }
        for name in names {
            assert!(svg.contains(&format!("\n{name}\n")), "legend for {name}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn no_progress_bar_when_stderr_is_not_a_terminal() {
    let out = common::run(&["bench", "write_lat", "-a", "-n", "3"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("/23") && !err.contains('\r'), "{err}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains('\r'), "{text}");
}

#[test]
fn a_sweep_on_a_terminal_shows_progress_and_keeps_stdout_clean() {
    // util-linux `script` runs the command on a pseudo-terminal.
    if std::process::Command::new("script")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("no `script` here to give rdmx a terminal; the bar is not checked");
        return;
    }
    let dir = std::env::temp_dir().join(format!("rdmx-tty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json_path, log) = (dir.join("out.json"), dir.join("tty.log"));
    let cmd = format!(
        "{} bench write_bw -a -n 3 --json > {}",
        env!("CARGO_BIN_EXE_rdmx"),
        json_path.display()
    );
    let st = std::process::Command::new("script")
        .args(["-qec", &cmd])
        .arg(&log)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run script");
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    let tty = String::from_utf8_lossy(&std::fs::read(&log).unwrap()).into_owned();
    assert!(tty.contains("/23"), "a bar counting the 23 sizes: {tty}");
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json_path).unwrap()).expect("clean JSON");
    sweep_rows(&v, "write_bw");
    let _ = std::fs::remove_dir_all(&dir);
}
