//! Opening a software device measures the copy methods, so that the first large copies
//! an application times do not pay for the measurement (about four milliseconds).
//!
//! The measurement is made once per process: each provider is checked in a process of
//! its own (this test binary, run again).

use std::process::Command;

const PROVIDER_ENV: &str = "RDMX_CALIBRATION_PROVIDER";

/// In the process run for one provider: nothing measured before its device opens, both
/// methods after.
#[test]
fn one_provider() {
    let Ok(name) = std::env::var(PROVIDER_ENV) else {
        return;
    };
    assert!(
        !rdmx::shm::testing::copy_calibrated(),
        "{name}: measured before any device opened"
    );
    let ctx = rdmx::Context::open_provider(&name).expect("open");
    assert!(
        rdmx::shm::testing::copy_calibrated(),
        "{name}: opening its device measured nothing"
    );
    drop(ctx);
}

#[test]
fn opening_a_software_device_measures_the_copy_methods() {
    if std::env::var(PROVIDER_ENV).is_ok() {
        return;
    }
    for name in ["loopback", "tcp", "shm", "udp"] {
        let out = Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", "one_provider", "--nocapture", "--test-threads=1"])
            .env(PROVIDER_ENV, name)
            .output()
            .expect("run the test binary again");
        assert!(
            out.status.success(),
            "{name}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
