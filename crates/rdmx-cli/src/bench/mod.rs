//! `rdmx bench ...`: `rdmx bench reg` (memory registration) and `rdmx bench TEST`
//! (perftest's transfer tests on any provider).
//!
//! | module | what |
//! |---|---|
//! | [`args`] | the options of `rdmx bench TEST` and their checks |
//! | [`setup`] | each side's context, QPs and regions; control messages |
//! | [`connect`] | connecting the sides, in this process or through `rdmx::cm`; the hellos |
//! | [`bw`], [`lat`] | the requester's measurement loops |
//! | [`responder`] | the responder's side (and the ping-pong answers in [`lat`]) |
//! | [`verify`] | what `--verify` expects to find, and the check |
//! | [`report`], [`plot`] | perftest's table, JSON, latency statistics; the SVG plot |
//! | [`perftest`] | `--perftest`: one side of a run against stock perftest, in its exchange |
//! | [`mod@run`] | one run per provider, in this process or against a peer |

use clap::Subcommand;

mod args;
mod bw;
mod connect;
mod lat;
mod perftest;
mod plot;
mod reg;
mod report;
mod responder;
mod run;
mod setup;
mod stats;
mod transfer;
mod verify;

/// Benchmarks: a transfer test (perftest's), or `reg`.
#[derive(clap::Args, Debug)]
#[command(
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    after_help = "Tests (like perftest's ib_<TEST>): write_bw write_lat read_bw read_lat \
                  send_bw send_lat atomic_bw atomic_lat.\n\
                  Without --server or HOST both sides run in this process.\n\
                  `rdmx bench reg` measures memory registration instead."
)]
pub(crate) struct Bench {
    #[command(subcommand)]
    other: Option<Other>,
    #[command(flatten)]
    transfer: args::Args,
}

/// Benchmarks that are not transfer tests.
#[derive(Subcommand, Debug)]
enum Other {
    /// Memory registration: register+deregister by size, registration cache hit and miss,
    /// buffer pool get+put on one and two threads.
    Reg(reg::Args),
    /// The transfer engine (like Mooncake's transfer_engine_bench and nixlbench): batches
    /// of READs or WRITEs striped over queue pairs and rails.
    Transfer(Box<transfer::Args>),
}

/// Runs a benchmark.
pub(crate) fn run(b: Bench) -> Result<(), Box<dyn std::error::Error>> {
    match b.other {
        Some(Other::Reg(args)) => reg::run(args),
        Some(Other::Transfer(args)) => transfer::run(*args),
        None => run::run(&b.transfer).map_err(|e| e as Box<dyn std::error::Error>),
    }
}
