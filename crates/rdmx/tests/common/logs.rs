//! Captures what rdmx logs, for tests that check a reason was logged.
//!
//! [`logs`] installs a global `tracing` subscriber on first use (a test binary has one),
//! which keeps every event from an `rdmx` target at debug level or above.

use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long [`wait_logged`] waits for a line.
const WAIT: Duration = Duration::from_secs(30);

/// Every event logged by rdmx at debug level or above, formatted as
/// `LEVEL message field=value ...`.
pub(crate) fn logs() -> &'static Mutex<Vec<String>> {
    static LOGS: Mutex<Vec<String>> = Mutex::new(Vec::new());
    static INIT: OnceLock<()> = OnceLock::new();
    INIT.get_or_init(|| {
        tracing::subscriber::set_global_default(Capture)
            .expect("no other subscriber in this test binary");
    });
    &LOGS
}

struct Capture;

struct Line(String);

impl tracing::field::Visit for Line {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0.push_str(&format!(" {value:?}"));
        } else {
            self.0.push_str(&format!(" {}={value:?}", field.name()));
        }
    }
}

impl tracing::Subscriber for Capture {
    fn enabled(&self, m: &tracing::Metadata<'_>) -> bool {
        m.target().starts_with("rdmx") && *m.level() <= tracing::Level::DEBUG
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, e: &tracing::Event<'_>) {
        let mut line = Line(e.metadata().level().to_string());
        e.record(&mut line);
        let mut logs = logs().lock().unwrap_or_else(|p| p.into_inner());
        // Bounded: the tests log a few lines per connection.
        if logs.len() < 100_000 {
            logs.push(line.0);
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// Waits until a logged line at `level` contains every one of `parts`.
#[track_caller]
pub(crate) fn wait_logged(level: &str, parts: &[&str]) {
    let start = Instant::now();
    loop {
        {
            let logs = logs().lock().unwrap_or_else(|p| p.into_inner());
            if logs
                .iter()
                .any(|l| l.starts_with(level) && parts.iter().all(|p| l.contains(p)))
            {
                return;
            }
            assert!(
                start.elapsed() < WAIT,
                "no {level} line with {parts:?} logged; the last lines: {:#?}",
                &logs[logs.len().saturating_sub(20)..]
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
