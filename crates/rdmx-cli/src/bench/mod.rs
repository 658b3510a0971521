//! `rdmx bench ...`: one module per benchmark family.

use clap::Subcommand;

mod reg;
mod stats;
mod transfer;

use transfer::Test;

/// The benchmarks.
#[derive(Subcommand, Debug)]
pub(crate) enum Bench {
    /// Memory registration: register+deregister by size, registration cache hit and miss,
    /// buffer pool get+put on one and two threads.
    Reg(reg::Args),
    /// RDMA WRITE bandwidth (like ib_write_bw).
    #[command(name = "write_bw")]
    WriteBw(transfer::Args),
    /// RDMA READ bandwidth (like ib_read_bw).
    #[command(name = "read_bw")]
    ReadBw(transfer::Args),
    /// SEND bandwidth (like ib_send_bw).
    #[command(name = "send_bw")]
    SendBw(transfer::Args),
    /// FETCH_ADD rate (like ib_atomic_bw).
    #[command(name = "atomic_bw")]
    AtomicBw(transfer::Args),
    /// RDMA WRITE latency, ping-pong, half round trip (like ib_write_lat).
    #[command(name = "write_lat")]
    WriteLat(transfer::Args),
    /// RDMA READ latency, whole round trip (like ib_read_lat).
    #[command(name = "read_lat")]
    ReadLat(transfer::Args),
    /// SEND latency, ping-pong, half round trip (like ib_send_lat).
    #[command(name = "send_lat")]
    SendLat(transfer::Args),
    /// FETCH_ADD latency, whole round trip (like ib_atomic_lat).
    #[command(name = "atomic_lat")]
    AtomicLat(transfer::Args),
}

/// Runs a benchmark.
pub(crate) fn run(b: Bench) -> Result<(), Box<dyn std::error::Error>> {
    match b {
        Bench::Reg(args) => reg::run(args),
        Bench::WriteBw(a) => transfer::run(Test::WriteBw, a),
        Bench::ReadBw(a) => transfer::run(Test::ReadBw, a),
        Bench::SendBw(a) => transfer::run(Test::SendBw, a),
        Bench::AtomicBw(a) => transfer::run(Test::AtomicBw, a),
        Bench::WriteLat(a) => transfer::run(Test::WriteLat, a),
        Bench::ReadLat(a) => transfer::run(Test::ReadLat, a),
        Bench::SendLat(a) => transfer::run(Test::SendLat, a),
        Bench::AtomicLat(a) => transfer::run(Test::AtomicLat, a),
    }
}
