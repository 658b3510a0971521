//! `rdmx bench ...`: one module per benchmark family.

use clap::Subcommand;

mod reg;
mod stats;

/// The benchmarks.
#[derive(Subcommand, Debug)]
pub(crate) enum Bench {
    /// Memory registration: register+deregister by size, registration cache hit and miss,
    /// buffer pool get+put on one and two threads.
    Reg(reg::Args),
}

/// Runs a benchmark.
pub(crate) fn run(b: Bench) -> Result<(), Box<dyn std::error::Error>> {
    match b {
        Bench::Reg(args) => reg::run(args),
    }
}
