//! What the benchmarks share: their command line (`NAME...` picks runs, `--flag N` sets
//! a number).

/// A benchmark's command line.
pub(crate) struct Args(Vec<String>);

impl Args {
    /// The process's arguments (after `cargo bench`'s `--`).
    pub(crate) fn from_env() -> Args {
        Args(std::env::args().skip(1).collect())
    }

    /// The number after `name`, or `default` when it is absent or not a number.
    pub(crate) fn flag(&self, name: &str, default: u64) -> u64 {
        self.0
            .iter()
            .position(|a| a == name)
            .and_then(|i| self.0.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    }

    /// Whether `switch` was given.
    #[allow(
        dead_code,
        reason = "each benchmark compiles this module; not all have switches"
    )]
    pub(crate) fn has(&self, switch: &str) -> bool {
        self.0.iter().any(|a| a == switch)
    }

    /// Whether the run `name`, one of `runs`, is to run: named, or none of `runs` named.
    pub(crate) fn runs(&self, runs: &[&str], name: &str) -> bool {
        let named = |r: &str| self.0.iter().any(|a| a == r);
        !runs.iter().any(|r| named(r)) || named(name)
    }
}
