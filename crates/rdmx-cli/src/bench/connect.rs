//! Connecting the two sides of a run: QP by QP in this process ([`connect_local`]), or
//! with a peer in another process through `rdmx::cm` ([`connect_remote`]), trading
//! [`Hello`]s: who each side is, the parameters (compared, a difference named), each QP's
//! number, first PSN and region.

use std::time::{Duration, Instant};

use rdmx::{ConnectOptions, Mtu, QpState, QueuePair, RemoteAddr};
use serde::{Deserialize, Serialize};

use super::args::{Budget, Conn, Params, PeerMode};
use super::setup::{BoxError, Role, Side, UD_QKEY};

/// How long the client keeps retrying a peer that refuses the connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the server waits for a peer.
const ACCEPT_TIMEOUT: Duration = Duration::from_secs(600);
/// How long the server gives one connection on its setup port to exchange hellos, so that
/// a stranger that connects and stalls holds up a valid client only this long.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(5);

impl Side {
    /// What this side tells its peer.
    pub(crate) fn hello(&self, p: &Params) -> Hello {
        Hello {
            magic: MAGIC.to_string(),
            role: self.role,
            provider: self.ctx.provider().to_string(),
            params: p.clone(),
            endpoints: self
                .qps
                .iter()
                .map(|q| {
                    let e = q.endpoint();
                    // Once connected, the PSN the QP really started at (rdma_cm picks it).
                    match q.state() {
                        QpState::Rts => (e.qp_num, q.attrs().sq_psn),
                        _ => (e.qp_num, e.psn),
                    }
                })
                .collect(),
            regions: self
                .mrs
                .iter()
                .map(|mr| {
                    let r = mr.remote();
                    Region {
                        addr: r.addr,
                        len: r.len,
                        rkey: r.rkey,
                    }
                })
                .collect(),
        }
    }
}

const MAGIC: &str = "rdmx-bench/1";

/// A region a peer may reach.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Region {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) rkey: u32,
}

impl Region {
    /// The remote address `offset` bytes in.
    pub(crate) fn at(&self, offset: usize) -> RemoteAddr {
        RemoteAddr {
            addr: self.addr + offset as u64,
            rkey: self.rkey,
        }
    }
}

/// What the two sides tell each other when they connect (the `private` data of the
/// connection setup): who they are, the parameters, and each QP's region.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Hello {
    magic: String,
    pub(crate) role: Role,
    pub(crate) provider: String,
    pub(crate) params: Params,
    /// Each QP's number and first PSN.
    pub(crate) endpoints: Vec<(u32, u32)>,
    pub(crate) regions: Vec<Region>,
}

impl Hello {
    /// perftest's "address" line of QP `i`.
    pub(crate) fn address(&self, i: usize) -> String {
        let (qpn, psn) = self.endpoints.get(i).copied().unwrap_or_default();
        let r = self.regions.get(i).copied().unwrap_or(Region {
            addr: 0,
            len: 0,
            rkey: 0,
        });
        format!(
            "QPN {qpn:#08x} PSN {psn:#08x} RKey {:#010x} VAddr {:#018x}",
            r.rkey, r.addr
        )
    }
}

/// Checks that the peer runs the same test as this side: its role, provider and every
/// option in [`Params`]; a difference names the option and both values.
fn check_terms(mine: &Hello, theirs: &Hello) -> Result<(), BoxError> {
    if theirs.magic != MAGIC {
        return Err(format!("the peer speaks {:?}, not {MAGIC:?}", theirs.magic).into());
    }
    if theirs.role == mine.role {
        let how = match mine.role {
            Role::Responder => "--server",
            Role::Requester => "a HOST to connect to",
        };
        return Err(format!(
            "both sides were started with {how}; start one with --server and the other \
             with its address"
        )
        .into());
    }
    let differs = |what: &str, here: String, there: String| -> Result<(), BoxError> {
        if here == there {
            Ok(())
        } else {
            Err(format!(
                "the two sides disagree on {what}: the peer has {there}, this side {here}; \
                 start both with the same options"
            )
            .into())
        }
    };
    // RoCEv2 on both sides: the verbs provider (on a RoCE port) and the udp provider
    // speak the same packets.
    let roce = |p: &str| p == "verbs" || p == rdmx::udp::NAME;
    if !(roce(&mine.provider) && roce(&theirs.provider)) {
        differs("--provider", mine.provider.clone(), theirs.provider.clone())?;
    }
    let (a, b) = (&mine.params, &theirs.params);
    differs("TEST", a.test.name().into(), b.test.name().into())?;
    differs(
        "the message sizes (-s/-a)",
        sizes(&a.sizes),
        sizes(&b.sizes),
    )?;
    differs("-n/-D", budget(a.budget), budget(b.budget))?;
    differs("-q/--qp", a.qps.to_string(), b.qps.to_string())?;
    differs(
        "-t/--tx-depth",
        a.tx_depth.to_string(),
        b.tx_depth.to_string(),
    )?;
    differs("-Q/--cq-mod", a.cq_mod.to_string(), b.cq_mod.to_string())?;
    differs(
        "-l/--post_list",
        a.post_list.to_string(),
        b.post_list.to_string(),
    )?;
    let on = |v: bool| if v { "on" } else { "off" }.to_string();
    differs("--verify", on(a.verify), on(b.verify))?;
    let mtu = |m: Option<u32>| m.map_or("the device's".to_string(), |m| m.to_string());
    differs("--mtu", mtu(a.mtu), mtu(b.mtu))?;
    differs(
        "-c/--connection",
        a.conn.qp_type().name().into(),
        b.conn.qp_type().name().into(),
    )?;
    differs("--rdma-cm", on(a.rdma_cm), on(b.rdma_cm))
}

/// `-s N`, or the sweep.
fn sizes(s: &[usize]) -> String {
    match s {
        [one] => format!("-s {one}"),
        _ => format!(
            "-a ({} to {} bytes)",
            s.first().copied().unwrap_or(0),
            s.last().copied().unwrap_or(0)
        ),
    }
}

fn budget(b: Budget) -> String {
    match b {
        Budget::Iters(n) => format!("-n {n}"),
        Budget::Seconds(d) => format!("-D {d}"),
    }
}

/// Checks the peer's full hello (the terms, and a region per QP) against ours.
fn check_peer(mine: &Hello, theirs: &Hello) -> Result<(), BoxError> {
    check_terms(mine, theirs)?;
    if theirs.regions.len() != mine.params.qps || theirs.endpoints.len() != mine.params.qps {
        return Err("the peer sent a region count that is not its QP count".into());
    }
    Ok(())
}

fn connect_options(p: &Params) -> ConnectOptions {
    let mut opts = ConnectOptions::default();
    opts.mtu = p.mtu.and_then(Mtu::from_bytes);
    if let Some(t) = p.qp_timeout {
        opts.timeout = t;
    }
    opts
}

/// Connects two sides of this process QP by QP; returns each one's view of the other.
pub(crate) fn connect_local(a: &Side, b: &Side, p: &Params) -> Result<(Hello, Hello), BoxError> {
    let opts = connect_options(p);
    if p.conn == Conn::Ud {
        for (x, y) in [(a, b), (b, a)] {
            let mut peers = Vec::new();
            for (qx, qy) in x.qps.iter().zip(&y.qps) {
                qx.activate(UD_QKEY)?;
                let ah = qx
                    .pd()
                    .create_ah(&rdmx::AhAttr::to_endpoint(&qy.endpoint()))?;
                peers.push((ah, qy.qp_num()));
            }
            let _ = x.ud_peers.set(peers);
        }
    } else {
        for (qa, qb) in a.qps.iter().zip(&b.qps) {
            qa.connect(qb.endpoint(), &opts)?;
            qb.connect(qa.endpoint(), &opts)?;
        }
    }
    let (ha, hb) = (a.hello(p), b.hello(p));
    check_peer(&ha, &hb)?;
    Ok((hb, ha))
}

/// Connects `side` to a peer in another process through `rdmx::cm`, trading hellos;
/// returns the peer's. `on_listen` is told the address a server waits on.
///
/// Two exchanges on the same control port: the first carries only the terms (role,
/// provider, [`Params`]), so that two sides started with different options both stop
/// with an error naming the option and both values, before any queue pair is connected;
/// the second connects the queue pairs and trades the regions.
///
/// With --rdma-cm the second exchange trades only the regions (they do not fit in
/// rdma_cm's private data for every QP count), and then each queue pair connects through
/// rdma_cm on the same port number (rdma_cm's port space on InfiniBand and RoCE is not the
/// kernel's TCP one; on iWARP it is, so there rdma_cm takes the next port), in order: the
/// server, which bound its rdma_cm listener before the first exchange, accepts `qps[i]`
/// while the client connects its `qps[i]`.
///
/// Returns with the side's receives posted: without --rdma-cm before the peer learns
/// that the queue pairs are connected, so no message of the peer finds none.
pub(crate) fn connect_remote(
    side: &Side,
    p: &Params,
    peer: &PeerMode,
    on_listen: impl FnOnce(std::net::SocketAddr),
) -> Result<Hello, BoxError> {
    if side
        .qps
        .iter()
        .any(|q| q.endpoint().addr == rdmx::PeerAddr::Local)
    {
        return Err(format!(
            "two-process runs need a provider with connection setup: {} connects queue \
             pairs of one process only (try --provider tcp)",
            side.ctx.provider()
        )
        .into());
    }
    let mine = side.hello(p);
    let mut terms = mine.clone();
    terms.endpoints.clear();
    terms.regions.clear();
    let opts = connect_options(p);
    let check = |raw: Vec<u8>, full: bool| -> Result<Hello, BoxError> {
        let theirs: Hello = serde_json::from_slice(&raw)
            .map_err(|e| format!("the peer is not an rdmx bench of this version: {e}"))?;
        if full {
            check_peer(&mine, &theirs)?;
        } else {
            check_terms(&mine, &theirs)?;
        }
        Ok(theirs)
    };
    if p.rdma_cm && side.ctx.provider() != "verbs" {
        return Err(format!(
            "--rdma-cm connects verbs queue pairs only, not {} ones (use --provider verbs)",
            side.ctx.provider()
        )
        .into());
    }
    // The queue pairs the control connection connects (none with --rdma-cm).
    let control_qps: &[QueuePair] = if p.rdma_cm { &[] } else { &side.qps };
    // Receives go up once the queue pairs are connected and before the peer hears so:
    // on UC a message that finds no receive is lost.
    let failed = std::cell::RefCell::new(None::<BoxError>);
    let mut post = || {
        if control_qps.is_empty() {
            return Ok(());
        }
        side.post_receives().map_err(|e| {
            *failed.borrow_mut() = Some(e);
            rdmx::Error::Protocol("posting the receives failed")
        })
    };
    let post_error = || failed.borrow_mut().take();
    // iWARP's connection manager listens on a kernel TCP port: the next one.
    let iwarp = side.ctx.capabilities().transport == rdmx::Transport::Iwarp;
    let cm_port = |port: u16| -> Result<u16, BoxError> {
        match iwarp {
            false => Ok(port),
            true => port
                .checked_add(1)
                .ok_or_else(|| "on iWARP rdma_cm takes the port after -p: pick a lower one".into()),
        }
    };
    let theirs = match peer {
        PeerMode::Listen(port) => {
            let rdma_cm = match p.rdma_cm {
                true => {
                    let cm = cm_port(*port)?;
                    Some(
                        rdmx::verbs::cm::Listener::bind(("0.0.0.0", cm))
                            .map_err(|e| format!("rdma_cm: listen on port {cm}: {e}"))?,
                    )
                }
                false => None,
            };
            let l = rdmx::cm::Listener::bind(("0.0.0.0", *port))
                .map_err(|e| format!("listen on port {port}: {e}"))?
                .with_exchange_timeout(EXCHANGE_TIMEOUT);
            on_listen(l.local_addr()?);
            let first = accept_valid(
                &l,
                &[],
                &opts,
                &serde_json::to_vec(&terms)?,
                ACCEPT_TIMEOUT,
                &mut || Ok(()),
            )?;
            check_terms(&mine, &first)?;
            let second = accept_valid(
                &l,
                control_qps,
                &opts,
                &serde_json::to_vec(&mine)?,
                CONNECT_TIMEOUT,
                &mut post,
            )
            .map_err(|e| post_error().unwrap_or(e))?;
            check_peer(&mine, &second)?;
            let mut theirs = second;
            if let Some(l) = rdma_cm {
                for qp in &side.qps {
                    l.accept(std::slice::from_ref(qp), &opts, &[], CONNECT_TIMEOUT)
                        .map_err(|e| format!("rdma_cm: accept on port {port}: {e}"))?;
                }
                rdma_cm_peers(side, &mut theirs);
                side.post_receives()?;
            }
            theirs
        }
        PeerMode::Connect(host, port) => {
            let first = connect_retrying(
                host,
                *port,
                &[],
                &opts,
                &serde_json::to_vec(&terms)?,
                &mut || Ok(()),
            )?;
            check(first, false)?;
            let second = connect_retrying(
                host,
                *port,
                control_qps,
                &opts,
                &serde_json::to_vec(&mine)?,
                &mut post,
            )
            .map_err(|e| post_error().unwrap_or(e))?;
            let mut theirs = check(second, true)?;
            if p.rdma_cm {
                let port = &cm_port(*port)?;
                for qp in &side.qps {
                    rdmx::verbs::cm::connect(
                        (host.as_str(), *port),
                        std::slice::from_ref(qp),
                        &opts,
                        &[],
                        CONNECT_TIMEOUT,
                    )
                    .map_err(|e| format!("rdma_cm: connect to {host}:{port}: {e}"))?;
                }
                rdma_cm_peers(side, &mut theirs);
                side.post_receives()?;
            }
            theirs
        }
        PeerMode::Local => unreachable!("a local run connects with connect_local"),
    };
    Ok(theirs)
}

/// Accepts on the connection-setup port until an rdmx bench (of this version) has
/// exchanged its hello, within `timeout` in all. Anything else that connects (a port scan,
/// an HTTP request, garbage, a truncated or oversized message, a stall) is logged on
/// stderr with the reason and skipped, as long as it left the queue pairs unconnected.
fn accept_valid(
    l: &rdmx::cm::Listener,
    qps: &[QueuePair],
    opts: &ConnectOptions,
    private: &[u8],
    timeout: Duration,
    connected: &mut dyn FnMut() -> rdmx::Result<()>,
) -> Result<Hello, BoxError> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("no rdmx bench peer connected within {timeout:?}").into());
        }
        let reason = match l.accept_then(qps, opts, private, left, &mut *connected) {
            Ok(raw) => match serde_json::from_slice::<Hello>(&raw) {
                // A bench of another version is told why (check_terms), not skipped.
                Ok(h) => return Ok(h),
                Err(e) => format!("not an rdmx bench of this version: {e}"),
            },
            Err(rdmx::Error::Timeout("no peer connected")) => {
                return Err(format!("no rdmx bench peer connected within {timeout:?}").into())
            }
            Err(e) => e.to_string(),
        };
        if qps.iter().any(|q| q.state() != QpState::Reset) {
            return Err(
                format!("a peer connected the queue pairs and then failed: {reason}").into(),
            );
        }
        eprintln!("rdmx: ignored a connection on the setup port: {reason}");
    }
}

/// After rdma_cm connected the queue pairs: the peer's QP numbers and first PSNs as
/// rdma_cm set them (its hello, sent before, has the ones rdmx would have used).
fn rdma_cm_peers(side: &Side, theirs: &mut Hello) {
    for (qp, ep) in side.qps.iter().zip(&mut theirs.endpoints) {
        let a = qp.attrs();
        *ep = (a.dest_qp_num, a.rq_psn);
    }
}

/// `rdmx::cm::connect`, retried while the peer refuses: the server may still be starting.
fn connect_retrying(
    host: &str,
    port: u16,
    qps: &[QueuePair],
    opts: &ConnectOptions,
    private: &[u8],
    connected: &mut dyn FnMut() -> rdmx::Result<()>,
) -> Result<Vec<u8>, BoxError> {
    let since = Instant::now();
    loop {
        match rdmx::cm::connect_then(
            (host, port),
            qps,
            opts,
            private,
            CONNECT_TIMEOUT,
            &mut *connected,
        ) {
            Ok(v) => return Ok(v),
            Err(rdmx::Error::Io(_, e))
                if e.kind() == std::io::ErrorKind::ConnectionRefused
                    && since.elapsed() < CONNECT_TIMEOUT =>
            {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(format!("connect to {host}:{port}: {e}").into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::args::{Budget, Test};

    fn params(test: Test) -> Params {
        Params {
            test,
            sizes: vec![65536],
            budget: Budget::Iters(10),
            qps: 1,
            tx_depth: 128,
            cq_mod: 100,
            post_list: 1,
            verify: false,
            mtu: None,
            qp_timeout: None,
            rdma_cm: false,
            conn: Conn::Rc,
        }
    }

    #[test]
    fn a_mismatched_peer_is_refused() {
        let p = params(Test::WriteBw);
        let hello = |role, params: &Params| Hello {
            magic: MAGIC.into(),
            role,
            provider: "tcp".into(),
            params: params.clone(),
            endpoints: vec![(1, 2)],
            regions: vec![Region {
                addr: 0,
                len: 1,
                rkey: 1,
            }],
        };
        let mine = hello(Role::Requester, &p);
        assert!(check_peer(&mine, &hello(Role::Responder, &p)).is_ok());
        assert!(check_peer(&mine, &hello(Role::Requester, &p)).is_err());
        let mut q = p.clone();
        q.test = Test::ReadBw;
        let e = check_peer(&mine, &hello(Role::Responder, &q)).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("TEST") && e.contains("read_bw") && e.contains("write_bw"),
            "{e}"
        );
        q = p.clone();
        q.conn = Conn::Uc;
        let e = check_peer(&mine, &hello(Role::Responder, &q)).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("-c/--connection") && e.contains("UC") && e.contains("RC"),
            "{e}"
        );
        q = p.clone();
        q.tx_depth = 64;
        let e = check_peer(&mine, &hello(Role::Responder, &q)).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("-t/--tx-depth") && e.contains("64") && e.contains("128"),
            "{e}"
        );
        q = p.clone();
        q.sizes = vec![2, 4];
        let e = check_peer(&mine, &hello(Role::Responder, &q)).unwrap_err();
        assert!(e.to_string().contains("-s 65536"), "{e}");
    }
}
