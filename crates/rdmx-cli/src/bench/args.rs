//! The options of `rdmx bench TEST` (perftest's names) and their checks.
//!
//! [`Args`] is what clap parses; [`Args::resolve`] checks every combination and turns it
//! into a [`Config`]: the [`Params`] both sides of a run must agree on (they travel to a
//! remote peer and are compared there), plus what only this side decides (providers,
//! output, progress mode).

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Smallest and largest message of a sweep (`-a`): 2 B to 8 MiB, as perftest.
pub(crate) const SWEEP: (u32, u32) = (1, 23);
/// Largest `-s`.
const MAX_SIZE: usize = 1 << 30;

/// Which test (perftest's program names without the `ib_` prefix).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[value(rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub(crate) enum Test {
    /// RDMA WRITE bandwidth (ib_write_bw).
    WriteBw,
    /// RDMA WRITE latency: ping-pong, half the round trip (ib_write_lat).
    WriteLat,
    /// RDMA READ bandwidth (ib_read_bw).
    ReadBw,
    /// RDMA READ latency: the whole round trip (ib_read_lat).
    ReadLat,
    /// SEND bandwidth (ib_send_bw).
    SendBw,
    /// SEND latency: ping-pong, half the round trip (ib_send_lat).
    SendLat,
    /// FETCH_ADD rate (ib_atomic_bw).
    AtomicBw,
    /// FETCH_ADD latency: the whole round trip (ib_atomic_lat).
    AtomicLat,
}

/// `-c`: the queue pairs' transport service (perftest's connection type).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub(crate) enum Conn {
    /// Reliable connected.
    #[default]
    #[value(name = "RC", alias = "rc")]
    Rc,
    /// Unreliable connected: write and send tests.
    #[value(name = "UC", alias = "uc")]
    Uc,
    /// Unreliable datagram: send tests, messages up to the path MTU.
    #[value(name = "UD", alias = "ud")]
    Ud,
}

impl Conn {
    /// The QP type.
    pub(crate) fn qp_type(self) -> rdmx::QpType {
        match self {
            Conn::Rc => rdmx::QpType::Rc,
            Conn::Uc => rdmx::QpType::Uc,
            Conn::Ud => rdmx::QpType::Ud,
        }
    }
}

/// Largest UD message of a sweep (`-a -c UD`): perftest sweeps UD up to the MTU.
pub(crate) const UD_SWEEP_MAX: usize = 4096;

/// What moves the data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    Write,
    Read,
    Send,
    Atomic,
}

impl Test {
    /// The name on the command line and in JSON.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Test::WriteBw => "write_bw",
            Test::WriteLat => "write_lat",
            Test::ReadBw => "read_bw",
            Test::ReadLat => "read_lat",
            Test::SendBw => "send_bw",
            Test::SendLat => "send_lat",
            Test::AtomicBw => "atomic_bw",
            Test::AtomicLat => "atomic_lat",
        }
    }

    /// perftest's title for the header.
    pub(crate) fn title(self) -> &'static str {
        match self {
            Test::WriteBw => "RDMA_Write BW Test",
            Test::WriteLat => "RDMA_Write Latency Test",
            Test::ReadBw => "RDMA_Read BW Test",
            Test::ReadLat => "RDMA_Read Latency Test",
            Test::SendBw => "Send BW Test",
            Test::SendLat => "Send Latency Test",
            Test::AtomicBw => "Atomic FETCH_AND_ADD BW Test",
            Test::AtomicLat => "Atomic FETCH_AND_ADD Latency Test",
        }
    }

    pub(crate) fn is_bw(self) -> bool {
        matches!(
            self,
            Test::WriteBw | Test::ReadBw | Test::SendBw | Test::AtomicBw
        )
    }

    pub(crate) fn op(self) -> Op {
        match self {
            Test::WriteBw | Test::WriteLat => Op::Write,
            Test::ReadBw | Test::ReadLat => Op::Read,
            Test::SendBw | Test::SendLat => Op::Send,
            Test::AtomicBw | Test::AtomicLat => Op::Atomic,
        }
    }

    /// Latency tests where both sides send (each round is a ping and a pong).
    pub(crate) fn is_ping_pong(self) -> bool {
        matches!(self, Test::WriteLat | Test::SendLat)
    }

    /// Latency reported as half the round trip (ping-pong), as perftest does.
    pub(crate) fn halves_round_trip(self) -> bool {
        self.is_ping_pong()
    }
}

/// `--progress`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ProgressMode {
    /// The library's default, for every test: polls drive progress, and a progress thread
    /// per context takes over while nobody polls. (`auto` is the same.)
    #[value(alias = "auto")]
    Thread,
    /// No progress thread: polling the CQs drives each side.
    Busy,
}

/// Options of `rdmx bench TEST` (perftest's names where they exist).
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct Args {
    /// The test to run.
    #[arg(value_enum, required = true)]
    pub(crate) test: Option<Test>,
    /// Connect to a peer on HOST that runs the same test with --server.
    #[arg(value_name = "HOST")]
    pub(crate) host: Option<String>,
    /// Wait for a peer to connect (the passive side, like perftest's server).
    #[arg(long, conflicts_with = "host")]
    pub(crate) server: bool,
    /// Device to use (see `rdmx devices`); picks its provider when --provider is not given.
    #[arg(short = 'd', long = "ib-dev", value_name = "DEVICE")]
    pub(crate) ib_dev: Option<String>,
    /// Provider(s) to run on, comma-separated (default: the default provider).
    #[arg(long, value_delimiter = ',', value_name = "NAME[,NAME...]")]
    pub(crate) provider: Vec<String>,
    /// Message size in bytes [default: 65536 for bandwidth, 2 for latency, 8 for atomics].
    #[arg(short = 's', long, conflicts_with = "all")]
    pub(crate) size: Option<usize>,
    /// Run every size from 2 B to 8 MiB, powers of two (atomics: 8 B only).
    #[arg(short = 'a', long)]
    pub(crate) all: bool,
    /// Iterations per QP (and per size) [default: 5000 for write_bw, 1000 for the rest].
    #[arg(short = 'n', long, conflicts_with = "duration")]
    pub(crate) iters: Option<u64>,
    /// Run each size for this many seconds instead of a number of iterations.
    #[arg(short = 'D', long, value_name = "SECONDS")]
    pub(crate) duration: Option<f64>,
    /// Number of queue pairs (bandwidth tests) [default: 1].
    #[arg(short = 'q', long = "qp", value_name = "QPS")]
    pub(crate) qps: Option<usize>,
    /// Requests outstanding per QP (bandwidth tests) [default: 128].
    #[arg(short = 't', long = "tx-depth")]
    pub(crate) tx_depth: Option<usize>,
    /// Signal one request in this many (bandwidth tests) [default: 100].
    #[arg(short = 'Q', long = "cq-mod")]
    pub(crate) cq_mod: Option<usize>,
    /// Requests posted per batch (bandwidth tests) [default: 1].
    #[arg(short = 'l', long = "post_list", alias = "post-list")]
    pub(crate) post_list: Option<usize>,
    /// Send messages of up to this many bytes inline, as perftest's -I: the bytes go with
    /// the request, which names no region [default: as perftest, for latency tests 220
    /// for write_lat, 236 for send_lat over RC and UC, 188 over UD, at most what the
    /// device takes; 0 for the rest; --perftest runs post from the region].
    #[arg(
        short = 'I',
        long = "inline_size",
        alias = "inline-size",
        value_name = "BYTES"
    )]
    pub(crate) inline_size: Option<usize>,
    /// Before measuring, post one window of requests (-t per QP) and wait for it, as
    /// perftest's option of that name (write, read and atomic bandwidth tests): first
    /// touches of the buffers and a cold start stay out of the figures.
    #[arg(long = "perform_warm_up", alias = "perform-warm-up")]
    pub(crate) perform_warm_up: bool,
    /// Report bandwidth in Gb/s instead of MiB/s.
    #[arg(long = "report_gbits", alias = "report-gbits")]
    pub(crate) report_gbits: bool,
    /// Connection type: RC, UC (write and send tests) or UD (send tests), as perftest's -c.
    #[arg(short = 'c', long = "connection", value_enum, default_value_t = Conn::Rc)]
    pub(crate) connection: Conn,
    /// Port of the connection setup (--server listens on it, HOST is reached on it).
    #[arg(short = 'p', long, default_value_t = 18515)]
    pub(crate) port: u16,
    /// verbs: connect the queue pairs through rdma_cm (librdmacm), as perftest's -R; the
    /// regions are still traded over the TCP control connection on --port.
    #[arg(short = 'R', long = "rdma-cm")]
    pub(crate) rdma_cm: bool,
    /// Path MTU in bytes [default: the device's active MTU].
    #[arg(short = 'm', long)]
    pub(crate) mtu: Option<u32>,
    /// The queue pairs' ack timeout, 4.096 µs × 2^N (perftest's -u) [default: 14].
    #[arg(short = 'u', long = "qp-timeout", value_parser = clap::value_parser!(u8).range(1..=31))]
    pub(crate) qp_timeout: Option<u8>,
    /// verbs: GID index [default: the RoCEv2 GID of an IPv4 address, else the first RoCEv2
    /// GID, else 0].
    #[arg(short = 'x', long = "gid-index")]
    pub(crate) gid_index: Option<u32>,
    /// Speak perftest's exchange (version 6.24) instead of rdmx's own: run one side against
    /// a stock perftest tool (`ib_write_bw` and the rest) or another `--perftest` side.
    #[arg(long)]
    pub(crate) perftest: bool,
    /// Ignored (perftest's -F: do not fail on a CPU frequency warning).
    #[arg(short = 'F', long = "CPU-freq", hide = true)]
    pub(crate) cpu_freq: bool,
    /// How progress is made.
    #[arg(long, value_enum, default_value_t = ProgressMode::Thread)]
    pub(crate) progress: ProgressMode,
    /// Check the data on the receiving side; a mismatch fails the run.
    #[arg(long)]
    pub(crate) verify: bool,
    /// Print JSON instead of perftest's table.
    #[arg(long)]
    pub(crate) json: bool,
    /// After a sweep (-a), draw bandwidth or latency against message size into this SVG.
    #[arg(long, value_name = "FILE.svg", requires = "all")]
    pub(crate) plot: Option<PathBuf>,
}

/// How long each size runs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) enum Budget {
    /// This many iterations per QP.
    Iters(u64),
    /// This many seconds.
    Seconds(f64),
}

/// What both sides of a run must agree on; a remote peer's copy is compared with ours.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Params {
    pub(crate) test: Test,
    /// Message sizes, in the order they run.
    pub(crate) sizes: Vec<usize>,
    pub(crate) budget: Budget,
    pub(crate) qps: usize,
    /// Requests outstanding per QP (1 for latency tests).
    pub(crate) tx_depth: usize,
    /// Signal one request in this many (1 for latency tests).
    pub(crate) cq_mod: usize,
    /// Requests per post batch.
    pub(crate) post_list: usize,
    pub(crate) verify: bool,
    pub(crate) mtu: Option<u32>,
    /// The ack timeout code (-u); this side's own choice.
    #[serde(skip)]
    pub(crate) qp_timeout: Option<u8>,
    /// Queue pairs connect through rdma_cm (--rdma-cm).
    #[serde(default)]
    pub(crate) rdma_cm: bool,
    /// The connection type (-c).
    #[serde(default)]
    pub(crate) conn: Conn,
    /// The requester posts one window before it measures (--perform_warm_up); the
    /// responder need not know.
    #[serde(skip)]
    pub(crate) warm_up: bool,
    /// Messages up to this size go inline (-I); `None`: perftest's default for the test,
    /// up to what the device takes ([`Params::inline_size`]). This side's own choice.
    #[serde(skip)]
    pub(crate) inline_size: Option<usize>,
}

impl Params {
    /// Whether messages may be lost (UC and UD): control messages then carry the size's
    /// generation bit and go again until answered.
    pub(crate) fn lossy(&self) -> bool {
        self.conn != Conn::Rc
    }

    /// The largest message sent inline on a device that takes up to `device_max` bytes
    /// inline: -I, or perftest's default for the test (latency tests only: 220 bytes for
    /// WRITEs, 236 for SENDs over RC and UC, 188 over UD), capped at `device_max`. An -I
    /// the device cannot take is an error.
    pub(crate) fn inline_size(&self, device_max: usize) -> Result<usize, String> {
        match self.inline_size {
            Some(n) if n > device_max => Err(format!(
                "-I {n}: the device sends at most {device_max} bytes inline"
            )),
            Some(n) => Ok(n),
            None => Ok(match (self.test, self.conn) {
                (Test::WriteLat, _) => 220,
                (Test::SendLat, Conn::Ud) => 188,
                (Test::SendLat, _) => 236,
                _ => 0,
            }
            .min(device_max)),
        }
    }

    /// The largest message.
    pub(crate) fn max_size(&self) -> usize {
        self.sizes.iter().copied().max().unwrap_or(1)
    }

    /// Unmeasured rounds before a latency measurement.
    pub(crate) fn warmup(&self) -> u64 {
        match self.budget {
            Budget::Iters(n) => (n / 10).max(1),
            Budget::Seconds(_) => 100,
        }
    }

    /// The run's time limit, if it is timed.
    pub(crate) fn time_limit(&self) -> Option<Duration> {
        match self.budget {
            Budget::Seconds(s) => Some(Duration::from_secs_f64(s)),
            Budget::Iters(_) => None,
        }
    }
}

/// Where the peer is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum PeerMode {
    /// Both sides in this process.
    Local,
    /// Wait for a peer on this port.
    Listen(u16),
    /// Connect to a peer.
    Connect(String, u16),
}

/// A checked command line.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) params: Params,
    /// Provider names, in run order; empty means the default provider.
    pub(crate) providers: Vec<String>,
    /// The device asked for with -d.
    pub(crate) device: Option<String>,
    /// The GID index asked for with -x.
    pub(crate) gid_index: Option<u32>,
    pub(crate) peer: PeerMode,
    pub(crate) progress: ProgressMode,
    pub(crate) json: bool,
    pub(crate) report_gbits: bool,
    pub(crate) plot: Option<PathBuf>,
}

impl Config {
    /// Whether this side busy-polls.
    pub(crate) fn busy(&self) -> bool {
        self.progress == ProgressMode::Busy
    }
}

fn at_least_one(v: Option<usize>, what: &str) -> Result<Option<usize>, BoxError> {
    match v {
        Some(0) => Err(format!("{what} must be at least 1").into()),
        v => Ok(v),
    }
}

impl Args {
    /// Checks the options and fills in perftest's defaults.
    pub(crate) fn resolve(&self) -> Result<Config, BoxError> {
        let test = self.test.ok_or("name a test")?;
        let name = test.name();
        let atomic = test.op() == Op::Atomic;
        if atomic && self.size.is_some_and(|s| s != 8) {
            return Err(format!("{name}: atomics are 8 bytes; -s must be 8 or left out").into());
        }
        let size = at_least_one(self.size, "-s/--size")?;
        if size.is_some_and(|s| s > MAX_SIZE) {
            return Err(format!("-s/--size is at most {MAX_SIZE} bytes (1 GiB)").into());
        }
        let conn = self.connection;
        let allowed = match conn {
            Conn::Rc => true,
            Conn::Uc => matches!(test.op(), Op::Write | Op::Send),
            Conn::Ud => test.op() == Op::Send,
        };
        if !allowed {
            return Err(format!(
                "{name} does not run over -c {}: UC takes the write and send tests, UD the \
                 send tests (as perftest)",
                conn.qp_type()
            )
            .into());
        }
        let sizes = if atomic {
            vec![8]
        } else if self.all && conn == Conn::Ud {
            (SWEEP.0..=SWEEP.1)
                .map(|k| 1usize << k)
                .filter(|&s| s <= UD_SWEEP_MAX)
                .collect()
        } else if self.all {
            (SWEEP.0..=SWEEP.1).map(|k| 1usize << k).collect()
        } else {
            vec![size.unwrap_or(if test.is_bw() { 65536 } else { 2 })]
        };
        let budget = match (self.iters, self.duration) {
            (Some(0), _) => return Err("-n/--iters must be at least 1".into()),
            (Some(n), _) => Budget::Iters(n),
            (None, Some(d)) if !(d.is_finite() && d > 0.0 && d <= 86400.0) => {
                return Err("-D/--duration must be a number of seconds above 0".into())
            }
            (None, Some(d)) => Budget::Seconds(d),
            // perftest's: DEF_ITERS_WB for write_bw, DEF_ITERS otherwise.
            (None, None) => Budget::Iters(if test == Test::WriteBw { 5000 } else { 1000 }),
        };
        let qps = at_least_one(self.qps, "-q/--qp")?;
        let tx_depth = at_least_one(self.tx_depth, "-t/--tx-depth")?;
        let cq_mod = at_least_one(self.cq_mod, "-Q/--cq-mod")?;
        let post_list = at_least_one(self.post_list, "-l/--post_list")?;
        let (qps, tx_depth, cq_mod, post_list) = if test.is_bw() {
            let tx = tx_depth.unwrap_or(128);
            let l = post_list.unwrap_or(1);
            if l > tx {
                return Err(
                    format!("-l/--post_list ({l}) must not exceed -t/--tx-depth ({tx})").into(),
                );
            }
            let q = if l > 1 {
                // perftest: with a post list, CQ moderation is the size of the list.
                match cq_mod {
                    Some(q) if q != l => {
                        return Err(format!(
                            "with -l/--post_list {l}, one request per list is signaled (CQ \
                             moderation {l}, as perftest); drop -Q {q}"
                        )
                        .into())
                    }
                    _ => l,
                }
            } else {
                // perftest: moderation beyond the queue depth would never signal.
                cq_mod.unwrap_or(100).min(tx)
            };
            (qps.unwrap_or(1), tx, q, l)
        } else {
            for (given, opt) in [
                (qps.is_some_and(|q| q > 1), "-q/--qp above 1"),
                (tx_depth.is_some(), "-t/--tx-depth"),
                (cq_mod.is_some(), "-Q/--cq-mod"),
                (post_list.is_some(), "-l/--post_list"),
            ] {
                if given {
                    return Err(format!(
                        "{opt} applies to bandwidth tests only; {name} keeps one request \
                         outstanding on one QP, as perftest"
                    )
                    .into());
                }
            }
            (1, 1, 1, 1)
        };
        if let Some(m) = self.mtu {
            if rdmx::Mtu::from_bytes(m).is_none() {
                return Err(format!(
                    "--mtu {m}: the path MTU is a power of two from 256 bytes (256, 512, 1024, ...)"
                )
                .into());
            }
        }
        let peer = match (&self.host, self.server) {
            (Some(h), _) => PeerMode::Connect(h.clone(), self.port),
            (None, true) => PeerMode::Listen(self.port),
            (None, false) => PeerMode::Local,
        };
        let providers: Vec<String> = self.provider.iter().map(|p| p.trim().to_string()).collect();
        if providers.iter().any(String::is_empty) {
            return Err("--provider: empty provider name in the list".into());
        }
        if peer != PeerMode::Local && providers.len() > 1 {
            return Err("a run with a peer (--server or HOST) takes one provider".into());
        }
        if self.rdma_cm && conn != Conn::Rc {
            return Err("--rdma-cm connects RC queue pairs; drop -c or --rdma-cm".into());
        }
        if self.rdma_cm && peer == PeerMode::Local {
            return Err(
                "--rdma-cm connects to a peer: give it to both --server and the client".into(),
            );
        }
        if self.rdma_cm && providers.iter().any(|p| p != "verbs") {
            return Err(format!(
                "--rdma-cm needs the verbs provider (rdma_cm connects verbs queue pairs), \
                 not --provider {}",
                providers.join(",")
            )
            .into());
        }
        if self.perform_warm_up && !(test.is_bw() && test.op() != Op::Send) {
            return Err(format!(
                "--perform_warm_up applies to the write, read and atomic bandwidth tests (as \
                 perftest), not {name}"
            )
            .into());
        }
        if self.perftest {
            self.check_perftest(test, &peer)?;
        }
        if matches!(peer, PeerMode::Listen(_)) && self.plot.is_some() {
            return Err("--plot draws what the client measures: give it to the client".into());
        }
        if self.plot.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
            return Err("--plot needs a file name".into());
        }
        Ok(Config {
            params: Params {
                test,
                sizes,
                budget,
                qps,
                tx_depth,
                cq_mod,
                post_list,
                verify: self.verify,
                mtu: self.mtu,
                qp_timeout: self.qp_timeout,
                rdma_cm: self.rdma_cm,
                conn,
                warm_up: self.perform_warm_up,
                inline_size: self.inline_size,
            },
            providers,
            device: self.ib_dev.clone(),
            gid_index: self.gid_index,
            peer,
            progress: self.progress,
            json: self.json,
            report_gbits: self.report_gbits,
            plot: self.plot.clone(),
        })
    }
}

impl Args {
    /// What `--perftest` runs: the tests and options perftest's exchange carries.
    fn check_perftest(&self, test: Test, peer: &PeerMode) -> Result<(), BoxError> {
        let refuse =
            |what: &str| -> Result<(), BoxError> { Err(format!("--perftest: {what}").into()) };
        if *peer == PeerMode::Local {
            return refuse("runs against a peer: give --server or HOST");
        }
        if matches!(test, Test::ReadLat | Test::AtomicLat) {
            return refuse("runs write_bw, read_bw, send_bw, atomic_bw, write_lat and send_lat");
        }
        if self.all || self.duration.is_some() {
            return refuse("one size for -n iterations (no -a, no -D)");
        }
        if self.iters.is_some_and(|n| n < 5) {
            // As perftest: its latency loops time each iteration from the one before, so
            // a run of one has no sample at all.
            return refuse("at least 5 iterations (-n), as perftest asks");
        }
        if self.rdma_cm || self.connection != Conn::Rc {
            return refuse("RC queue pairs connected by the exchange (no -R, no -c)");
        }
        if self.post_list.is_some_and(|l| l > 1) || self.json || self.plot.is_some() {
            return refuse("no -l, --json or --plot");
        }
        if self.perform_warm_up {
            return refuse("no --perform_warm_up");
        }
        if self.inline_size.is_some() {
            // Its loops post from the region, whatever the size.
            return refuse("no -I: its requests name their region");
        }
        if self.verify {
            // perftest's buffers hold random bytes: what can be checked of the data is
            // checked on every run (see `checked:` in the output), --verify adds nothing.
            return refuse(
                "no --verify: perftest's buffers hold random bytes; what can be checked is \
                 checked on every run",
            );
        }
        if self.provider.len() > 1 {
            return refuse("one provider");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn resolve(line: &[&str]) -> Result<Config, String> {
        let cli = Cli::try_parse_from(std::iter::once("bench").chain(line.iter().copied()))
            .map_err(|e| e.to_string())?;
        cli.args.resolve().map_err(|e| e.to_string())
    }

    #[test]
    fn perftest_defaults() {
        let c = resolve(&["write_bw"]).unwrap();
        let p = &c.params;
        assert_eq!(p.sizes, [65536]);
        assert_eq!(p.budget, Budget::Iters(5000));
        assert_eq!((p.qps, p.tx_depth, p.cq_mod, p.post_list), (1, 128, 100, 1));
        let c = resolve(&["send_lat"]).unwrap();
        assert_eq!(c.params.sizes, [2]);
        assert_eq!(c.params.budget, Budget::Iters(1000));
        for bw in ["read_bw", "send_bw", "atomic_bw"] {
            assert_eq!(resolve(&[bw]).unwrap().params.budget, Budget::Iters(1000));
        }
        assert_eq!(resolve(&["atomic_lat"]).unwrap().params.sizes, [8]);
        assert_eq!(c.peer, PeerMode::Local);
    }

    #[test]
    fn inline_sizes_follow_perftest_up_to_the_device() {
        let size = |line: &[&str], device| resolve(line).unwrap().params.inline_size(device);
        assert_eq!(size(&["send_lat"], 4096), Ok(236));
        assert_eq!(size(&["send_lat", "-c", "UC"], 4096), Ok(236));
        assert_eq!(size(&["send_lat", "-c", "UD"], 4096), Ok(188));
        assert_eq!(size(&["write_lat"], 4096), Ok(220));
        assert_eq!(size(&["write_lat"], 64), Ok(64));
        for t in [
            "write_bw",
            "read_bw",
            "send_bw",
            "atomic_bw",
            "read_lat",
            "atomic_lat",
        ] {
            assert_eq!(size(&[t], 4096), Ok(0), "{t}");
        }
        assert_eq!(size(&["write_bw", "-I", "32"], 4096), Ok(32));
        assert_eq!(size(&["send_lat", "-I", "0"], 4096), Ok(0));
        let e = size(&["send_lat", "-I", "100"], 64).unwrap_err();
        assert!(e.contains("-I 100") && e.contains("64"), "{e}");
    }

    #[test]
    fn sweep_is_2_bytes_to_8_mib() {
        let s = resolve(&["read_bw", "-a"]).unwrap().params.sizes;
        assert_eq!(s.len(), 23);
        assert_eq!((s[0], s[22]), (2, 8 << 20));
        assert_eq!(resolve(&["atomic_bw", "-a"]).unwrap().params.sizes, [8]);
    }

    #[test]
    fn bad_combinations_are_refused() {
        for line in [
            &["write_bw", "-s", "0"][..],
            &["write_bw", "-a", "-s", "64"],
            &["atomic_bw", "-s", "16"],
            &["write_bw", "-q", "0"],
            &["write_bw", "-n", "0"],
            &["write_bw", "-n", "5", "-D", "1"],
            &["write_bw", "-D", "0"],
            &["write_bw", "-t", "4", "-l", "8"],
            &["write_bw", "-l", "4", "-Q", "10"],
            &["write_lat", "-q", "2"],
            &["read_lat", "-t", "4"],
            &["write_bw", "--server", "localhost"],
            &["write_bw", "--plot", "x.svg"],
            &["write_bw", "--mtu", "1000"],
            &["send_bw", "--perform_warm_up"],
            &["read_lat", "--perform_warm_up"],
            &["write_bw", "--perftest", "--server", "--perform_warm_up"],
            &["write_bw", "--provider", "loopback,tcp", "--server"],
            &["write_bw", "-a", "--plot", "x.svg", "--server"],
            &["nope"],
        ] {
            assert!(resolve(line).is_err(), "{line:?} should be refused");
        }
    }

    #[test]
    fn cq_moderation_follows_perftest() {
        let p = resolve(&["write_bw", "-t", "16"]).unwrap().params;
        assert_eq!(p.cq_mod, 16, "clamped to the depth");
        let p = resolve(&["write_bw", "-l", "8"]).unwrap().params;
        assert_eq!((p.post_list, p.cq_mod), (8, 8));
    }

    #[test]
    fn rdma_cm_needs_verbs_and_a_peer() {
        let e = resolve(&["write_bw", "--rdma-cm", "--provider", "tcp", "--server"]).unwrap_err();
        assert!(e.contains("needs the verbs provider"), "{e}");
        let e = resolve(&["write_bw", "-R"]).unwrap_err();
        assert!(e.contains("connects to a peer"), "{e}");
        let c = resolve(&["write_bw", "-u", "18", "--server"]).unwrap();
        assert_eq!(c.params.qp_timeout, Some(18));
        assert!(resolve(&["write_bw", "-u", "0"]).is_err());
        let c = resolve(&["write_bw", "-R", "--provider", "verbs", "--server"]).unwrap();
        assert!(c.params.rdma_cm);
        assert!(!resolve(&["write_bw", "--server"]).unwrap().params.rdma_cm);
    }

    #[test]
    fn perftest_takes_what_its_exchange_carries() {
        let c = resolve(&[
            "write_bw",
            "--perftest",
            "-m",
            "1024",
            "-F",
            "-x",
            "1",
            "host",
        ])
        .unwrap();
        assert_eq!((c.params.mtu, c.gid_index), (Some(1024), Some(1)));
        assert!(resolve(&["send_lat", "--perftest", "--server", "-n", "10"]).is_ok());
        for line in [
            &["write_bw", "--perftest"][..],
            &["read_lat", "--perftest", "--server"],
            &["atomic_lat", "--perftest", "host"],
            &["write_bw", "--perftest", "-a", "--server"],
            &["write_bw", "--perftest", "-D", "2", "--server"],
            &[
                "write_bw",
                "--perftest",
                "-R",
                "--provider",
                "verbs",
                "--server",
            ],
            &["send_bw", "--perftest", "-c", "UC", "--server"],
            &["write_bw", "--perftest", "-l", "4", "host"],
            &["write_bw", "--perftest", "--json", "host"],
            &["write_bw", "--perftest", "--verify", "--server"],
            &["read_bw", "--perftest", "--verify", "host"],
            &["write_lat", "--perftest", "-n", "1", "host"],
            &["send_lat", "--perftest", "-n", "4", "--server"],
            &["send_lat", "--perftest", "-I", "64", "--server"],
        ] {
            let e = resolve(line).expect_err(&format!("{line:?} should be refused"));
            assert!(e.contains("--perftest"), "{line:?}: {e}");
        }
    }

    #[test]
    fn peers_and_providers() {
        let c = resolve(&["write_bw", "host.example", "-p", "7000"]).unwrap();
        assert_eq!(c.peer, PeerMode::Connect("host.example".into(), 7000));
        let c = resolve(&["write_bw", "-a", "--plot", "x.svg", "host.example"]).unwrap();
        assert_eq!(c.plot, Some(PathBuf::from("x.svg")), "the client plots");
        let c = resolve(&["write_bw", "--provider", "loopback,tcp"]).unwrap();
        assert_eq!(c.providers, ["loopback", "tcp"]);
        assert_eq!(
            resolve(&["write_bw", "--server"]).unwrap().peer,
            PeerMode::Listen(18515)
        );
    }
}
