//! `rdmx`: benchmarks for memory registration and data transfer with RDMA semantics.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench;
mod devices;

/// rdmx: efficient data transfer with RDMA semantics.
#[derive(Parser, Debug)]
#[command(name = "rdmx", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a benchmark: a transfer test (write_bw, read_lat, ...) or `reg`.
    Bench(Box<bench::Bench>),
    /// List providers and devices with their capabilities (like ibv_devinfo).
    Devices(devices::Args),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(tracing_subscriber::filter::LevelFilter::WARN)
        .init();
    let cli = Cli::parse();
    let res = match cli.command {
        Command::Bench(b) => bench::run(*b),
        Command::Devices(a) => devices::run(a),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let mut said = e.to_string();
            eprintln!("rdmx: {said}");
            let mut src = std::error::Error::source(&*e);
            while let Some(s) = src {
                // Errors that wrap another often repeat its text: say each thing once.
                let text = s.to_string();
                if !said.contains(&text) {
                    eprintln!("  caused by: {text}");
                }
                said = text;
                src = s.source();
            }
            ExitCode::FAILURE
        }
    }
}
