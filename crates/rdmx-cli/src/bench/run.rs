//! `rdmx bench TEST`: runs a test on each provider asked for, in this process or
//! against a peer, and prints what it measured.
//!
//! The requester's side and the responder's side are the same code in both cases: in one
//! process the responder runs on a thread of its own, with its own context; against a
//! peer, this process is one side and `rdmx::cm` connects it ([`super::setup`]).

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use rdmx::{Context, Pinning};

use super::args::{Args, Budget, Config, Params, PeerMode};
use super::bw;
use super::connect::{connect_local, connect_remote, Hello, Region};
use super::lat;
use super::plot;
use super::report::{table_header, table_row, Row, RunInfo, LINE};
use super::responder;
use super::setup::{
    finish_size, is_memlock_limit, say_bye, wait_ctl, Abort, BoxError, Role, Side, READY,
};

const MIB: f64 = 1048576.0;

/// Runs `rdmx bench TEST ...`.
pub(crate) fn run(args: &Args) -> Result<(), BoxError> {
    if args.perftest {
        return super::perftest::run(args);
    }
    let cfg = args.resolve()?;
    let providers = providers(&cfg)?;
    let out = Out::new(&cfg, providers.len());
    let mut runs = Vec::new();
    for name in &providers {
        let (info, rows) = run_provider(&cfg, name, &out)?;
        runs.push((info, rows));
    }
    out.done();
    if cfg.json {
        let v = match &runs[..] {
            [(info, rows)] => info.json(rows),
            _ => serde_json::json!({
                "runs": runs.iter().map(|(i, r)| i.json(r)).collect::<Vec<_>>()
            }),
        };
        println!("{}", serde_json::to_string_pretty(&v)?);
    }
    if let Some(path) = &cfg.plot {
        let series: Vec<(String, Vec<Row>)> = runs
            .into_iter()
            .map(|(i, rows)| (i.provider, rows))
            .collect();
        plot::draw(path, cfg.params.test, cfg.report_gbits, &series)?;
        eprintln!("rdmx: plot written to {}", path.display());
    }
    Ok(())
}

/// The providers to run on, checked before anything runs: each must be known, have a
/// device here, and (with a peer) reach other processes. Without --provider: the
/// provider of the -d device, else tcp when there is a peer, else shm (the fastest in
/// one process), else the library's default provider.
fn providers(cfg: &Config) -> Result<Vec<String>, BoxError> {
    let devices = rdmx::devices();
    let list = || {
        devices
            .iter()
            .map(|d| format!("{} (provider {})", d.name, d.provider))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut here: Vec<&str> = Vec::new();
    for d in &devices {
        if !here.contains(&d.provider) {
            here.push(d.provider);
        }
    }
    let names_of =
        |kinds: &mut dyn Iterator<Item = &&str>| kinds.copied().collect::<Vec<_>>().join(", ");
    let remote = cfg.peer != PeerMode::Local;
    let mut names = cfg.providers.clone();
    if names.is_empty() {
        names.push(match &cfg.device {
            Some(dev) => devices
                .iter()
                .find(|d| d.name == *dev)
                .map(|d| d.provider.to_string())
                .ok_or_else(|| format!("-d {dev}: no such device; available: {}", list()))?,
            // A peer in another process: the software provider that crosses processes.
            None if remote => rdmx::tcp::NAME.to_string(),
            // Both sides in this process: the fastest provider with the full semantics of
            // the connection type, shm (its direct data path) where it has the type;
            // loopback, the library's default, is the reference with fault injection.
            None if devices.iter().any(|d| {
                d.provider == rdmx::shm::NAME && d.capabilities.supports(cfg.params.conn.qp_type())
            }) =>
            {
                rdmx::shm::NAME.to_string()
            }
            None => Context::open_default()?.provider().to_string(),
        });
    }
    for name in &names {
        let Some(kind) = rdmx::provider_names().find(|k| k == name) else {
            return Err(format!(
                "--provider {name}: no such provider; available here: {}",
                names_of(&mut here.iter())
            )
            .into());
        };
        if !here.contains(&kind) {
            let why = match kind {
                "verbs" => "rdma-core found no RDMA device (see `rdmx devices`)",
                _ => "it has no device",
            };
            return Err(format!(
                "--provider {name} is not available on this machine: {why}; available here: {}",
                names_of(&mut here.iter())
            )
            .into());
        }
        if remote && !crosses_processes(kind) {
            return Err(format!(
                "provider {name} connects queue pairs within one process only, so it cannot \
                 reach a peer (--server or HOST); providers that can: {} (tcp is the default with a peer)",
                names_of(&mut here.iter().filter(|&&k| crosses_processes(k)))
            )
            .into());
        }
        if let Some(dev) = &cfg.device {
            if !devices.iter().any(|d| d.provider == kind && d.name == *dev) {
                return Err(format!(
                    "-d {dev}: provider {name} has no such device; available: {}",
                    list()
                )
                .into());
            }
        }
    }
    Ok(names)
}

/// Whether `kind` connects queue pairs of different processes.
fn crosses_processes(kind: &str) -> bool {
    kind != rdmx::loopback::NAME
}

/// Text output, kept clear of the progress bar.
struct Out {
    json: bool,
    bar: Option<ProgressBar>,
}

impl Out {
    /// A progress bar on sweeps and long runs, when stderr is a terminal.
    fn new(cfg: &Config, providers: usize) -> Out {
        let p = &cfg.params;
        let steps = (p.sizes.len() * providers) as u64;
        let long = match p.budget {
            Budget::Seconds(_) => true,
            Budget::Iters(n) => n.saturating_mul(p.qps as u64) >= 1_000_000,
        };
        let bar = (std::io::stderr().is_terminal()
            && !matches!(cfg.peer, PeerMode::Listen(_))
            && (steps > 1 || long))
            .then(|| {
                let b = ProgressBar::new(steps);
                if let Ok(style) = ProgressStyle::with_template(
                    "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}",
                ) {
                    b.set_style(style);
                }
                b.enable_steady_tick(Duration::from_millis(200));
                b
            });
        Out {
            json: cfg.json,
            bar,
        }
    }

    fn print(&self, s: &str) {
        if self.json {
            return;
        }
        match &self.bar {
            Some(b) => b.suspend(|| println!("{s}")),
            None => println!("{s}"),
        }
    }

    fn step(&self, msg: String) {
        if let Some(b) = &self.bar {
            b.set_message(msg);
        }
    }

    fn advance(&self) {
        if let Some(b) = &self.bar {
            b.inc(1);
        }
    }

    fn done(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

/// What the header says about a run.
fn info(cfg: &Config, side: &Side, mine: &Hello, peer: &Hello, where_: String) -> RunInfo {
    let p = &cfg.params;
    let kind = side.ctx.provider();
    let mtu = match p.conn.qp_type() {
        // A UD queue pair has no path: its messages go up to the port's MTU.
        rdmx::QpType::Ud => side.ctx.capabilities().active_mtu.bytes(),
        _ => side.qps[0].attrs().path_mtu.bytes(),
    };
    let mut addresses = Vec::new();
    for i in 0..side.qps.len() {
        addresses.push(format!("local address:  {}", mine.address(i)));
        addresses.push(format!("remote address: {}", peer.address(i)));
    }
    RunInfo {
        test: p.test,
        conn: p.conn.qp_type().name(),
        provider: kind.to_string(),
        device: side.ctx.device_name().to_string(),
        mtu,
        busy: side.busy,
        pinned: side.pinned,
        shared_memory: side.shared_memory,
        inline_size: side.inline_size,
        qps: p.qps,
        tx_depth: side.layout.window,
        cq_mod: side.layout.signal_every,
        post_list: side.layout.batch,
        verify: p.verify,
        warm_up: if p.warm_up { side.layout.window } else { 0 },
        peer: where_,
        addresses,
        data_path: if kind == rdmx::shm::NAME {
            Some(shm_data_path(side))
        } else {
            rdmx::udp::data_path(&side.ctx)
        },
        by_default: cfg.providers.is_empty() && cfg.device.is_none(),
        executed_at_post: None,
    }
}

/// The data path of a side's shm queue pairs, as they run it. A queue pair that waits
/// for its peer to connect gets its connection within moments of the peer reaching RTR.
fn shm_data_path(side: &Side) -> &'static str {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    loop {
        let paths: Vec<_> = side.qps.iter().map(rdmx::shm::data_path).collect();
        if let Some(&first) = paths.iter().flatten().next() {
            if paths.iter().all(|p| p == &Some(first)) {
                return first;
            }
        }
        if std::time::Instant::now() > deadline {
            return "unknown (not connected yet)";
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Opens a side per role on provider `name`, with pinned memory as registration has by
/// default. When pinning runs into `RLIMIT_MEMLOCK` on a software provider, whose memory
/// no adapter reads, opens them again unpinned, says so on stderr and in the header.
fn open_sides<const N: usize>(
    name: &str,
    cfg: &Config,
    roles: [Role; N],
    busy: bool,
) -> Result<[Side; N], BoxError> {
    let open = |pinning| -> Result<[Side; N], BoxError> {
        let sides = roles
            .iter()
            .map(|&r| Side::open(name, cfg, r, busy, pinning))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(sides
            .try_into()
            .unwrap_or_else(|_| unreachable!("a side per role")))
    };
    match open(Pinning::Pinned) {
        Err(e) if is_memlock_limit(&*e) && name != "verbs" => {
            eprintln!(
                "rdmx: {name}: RLIMIT_MEMLOCK is too low to pin this run's memory, so it runs \
                 unpinned (a software provider needs no pinning); `ulimit -l unlimited` pins it"
            );
            open(Pinning::Unpinned)
        }
        r => r,
    }
}

/// Runs the test on one provider; returns what ran and the rows (none on a server).
fn run_provider(cfg: &Config, name: &str, out: &Out) -> Result<(RunInfo, Vec<Row>), BoxError> {
    let p = &cfg.params;
    let busy = cfg.busy();
    let abort = Abort::default();
    let mut rows = Vec::new();
    let mut on_row = |row: Row| {
        out.print(&table_row(p.test, &row, cfg.report_gbits));
        out.advance();
        rows.push(row);
    };
    let info = match &cfg.peer {
        PeerMode::Local => {
            let [a, b] = open_sides(name, cfg, [Role::Requester, Role::Responder], busy)?;
            let (hb, ha) = connect_local(&a, &b, p)?;
            a.post_receives()?;
            b.post_receives()?;
            let mut info = info(cfg, &a, &ha, &hb, "this process".into());
            out.print(&info.header());
            out.print(&table_header(p.test, cfg.report_gbits));
            let abort = &abort;
            std::thread::scope(|s| {
                let resp = s.spawn(|| {
                    let r = responder::drive(p, &b, &ha.regions, abort);
                    if r.is_err() {
                        abort.fail(Role::Responder);
                    }
                    r
                });
                let r = drive(p, &a, &hb.regions, abort, out, name, &mut on_row);
                if r.is_err() {
                    abort.fail(Role::Requester);
                }
                let rr = resp
                    .join()
                    .unwrap_or_else(|_| Err("the responder thread panicked".into()));
                // The side that failed first has the error that says what went wrong.
                match (r, rr, abort.first()) {
                    (Err(e), _, Some(Role::Requester)) | (_, Err(e), _) | (Err(e), _, _) => Err(e),
                    (Ok(()), Ok(()), _) => Ok(()),
                }
            })?;
            executed_at_post(&mut info, &a, out);
            info
        }
        PeerMode::Listen(_) => {
            let [side] = open_sides(name, cfg, [Role::Responder], busy)?;
            let peer = connect_remote(&side, p, &cfg.peer, |addr| {
                eprintln!("rdmx: {} waiting for a peer on {addr}", p.test.name());
            })?;
            let info = info(
                cfg,
                &side,
                &side.hello(p),
                &peer,
                match p.rdma_cm {
                    true => "a client (rdmx::cm, queue pairs through rdma_cm)".into(),
                    false => "a client (rdmx::cm)".into(),
                },
            );
            out.print(&info.header());
            out.print(" (the client measures and reports)");
            responder::drive(p, &side, &peer.regions, &abort)?;
            info
        }
        PeerMode::Connect(host, port) => {
            let [side] = open_sides(name, cfg, [Role::Requester], busy)?;
            let peer = connect_remote(&side, p, &cfg.peer, |_| {})?;
            let mut info = info(cfg, &side, &side.hello(p), &peer, format!("{host}:{port}"));
            out.print(&info.header());
            out.print(&table_header(p.test, cfg.report_gbits));
            drive(p, &side, &peer.regions, &abort, out, name, &mut on_row)?;
            executed_at_post(&mut info, &side, out);
            info
        }
    };
    out.print(LINE);
    Ok((info, rows))
}

/// On shm's direct and mapped data paths: says how many requests the requester `side`
/// executed at post time.
fn executed_at_post(info: &mut RunInfo, side: &Side, out: &Out) {
    if info
        .data_path
        .is_some_and(|d| d.starts_with("direct") || d == "mapped")
    {
        let n = side
            .qps
            .iter()
            .filter_map(rdmx::shm::executed_at_post)
            .sum();
        out.print(&format!(
            " {:<15} : {n} requests executed by the initiator at post time",
            "Data path"
        ));
        info.executed_at_post = Some(n);
    }
}

/// The requester's side of a run: every size, one row each.
fn drive(
    p: &Params,
    side: &Side,
    remote: &[Region],
    abort: &Abort,
    out: &Out,
    provider: &str,
    on_row: &mut dyn FnMut(Row),
) -> Result<(), BoxError> {
    let first = wait_ctl(side, abort, "READY")?;
    if first != READY {
        return Err(format!("the peer started with {first:#x}, not READY").into());
    }
    let mut round = 0u64;
    for (k, &size) in p.sizes.iter().enumerate() {
        out.step(format!("{} on {provider}, {size} bytes", p.test.name()));
        let (row, counts) = if p.test.is_bw() {
            let run = bw::requester(p, size, side, remote, abort)?;
            let secs = run.elapsed.as_secs_f64().max(1e-9);
            let total = run.total() as f64;
            let row = Row::Bw {
                bytes: size,
                // perftest's #iterations: the requests of every QP.
                iterations: run.total(),
                peak_mib: bw::peak_rate(&run.marks) * size as f64 / MIB,
                avg_mib: total * size as f64 / MIB / secs,
                mpps: total / secs / 1e6,
            };
            // The responder checks against every request, the warm-up's too.
            let sent = run.per_qp.iter().map(|n| n + run.warm).collect();
            (row, sent)
        } else {
            let (rec, issued) = if p.test.is_ping_pong() {
                lat::ping(p, size, side, remote, &mut round, abort)?
            } else {
                lat::one_sided(p, size, side, remote, &mut round, abort)?
            };
            let row = Row::Lat {
                bytes: size,
                iterations: rec.count(),
                stats: rec.stats(),
            };
            (row, vec![issued])
        };
        finish_size(side, &counts, k, p.lossy(), abort)?;
        on_row(row);
    }
    say_bye(side, p.lossy())
}
