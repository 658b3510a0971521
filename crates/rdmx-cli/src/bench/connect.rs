//! Connecting the two sides of a run: QP by QP in this process ([`connect_local`]), or
//! with a peer in another process through `rdmx::cm` ([`connect_remote`]), trading
//! [`Hello`]s: who each side is, the parameters (compared, a difference named), each QP's
//! number, first PSN and region.

use std::time::{Duration, Instant};

use rdmx::{ConnectOptions, Mtu, QpState, QueuePair, RemoteAddr, WcOpcode};
use serde::{Deserialize, Serialize};

use super::args::{Budget, Conn, Params, PeerMode};
use super::setup::{poll, BoxError, Role, Side, EMPTY, HELLO, UD_QKEY};

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
            gid: self
                .qps
                .first()
                .map(|q| rdmx::AhAttr::to_endpoint(&q.endpoint()).dgid),
            session: None,
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
            addr: self.addr.wrapping_add(offset as u64),
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
    /// The GID an address handle names this side's queue pairs by (UD datagrams go
    /// there): its context's address.
    #[serde(default)]
    pub(crate) gid: Option<std::net::Ipv6Addr>,
    /// The server's answer in the first exchange names a random session, and the client's
    /// message in the second names it back: the server connects its queue pairs only to
    /// the peer it agreed the terms with.
    #[serde(default)]
    pub(crate) session: Option<u64>,
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
/// that the queue pairs are connected, with it before each connect request or accept
/// leaves, so no message of the peer finds none.
///
/// On iWARP the client sends first: a [`HELLO`] on every queue pair, which the server
/// waits for before it returns. iWARP's connection setup (MPA, without the peer-to-peer
/// mode that adds a handshake frame, as soft-iWARP) lets the accepting side send only
/// once the connecting side has: a message from the server can reach the client on the
/// heels of the MPA reply, before the client has taken that reply in, and siw takes it
/// for a protocol error there (the client's connect fails with
/// RDMA_CM_EVENT_CONNECT_ERROR, status -22, and the server's receives complete flushed).
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
    // UD queue pairs do not connect: they are ready, their receives posted, before the
    // peer hears of them, and their datagrams go to the address the peer's hello names.
    let ud = p.conn == Conn::Ud;
    if ud {
        for q in &side.qps {
            q.activate(UD_QKEY)?;
        }
        side.post_receives()?;
    }
    // The queue pairs the control connection connects (none with --rdma-cm or UD).
    let control_qps: &[QueuePair] = if p.rdma_cm || ud { &[] } else { &side.qps };
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
    // With --rdma-cm each queue pair's receives go up once it is in INIT, before the
    // connect request or accept leaves: iWARP has no RNR, so a first message of the peer
    // that found no receive would break the connection (the receives then complete
    // flushed).
    let post_on = |i: usize| {
        side.post_receives_on(i).map_err(|e| {
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
            let mut session = [0u8; 8];
            getrandom::fill(&mut session)
                .map_err(|e| format!("no random session for the setup exchange: {e}"))?;
            let session = u64::from_ne_bytes(session);
            terms.session = Some(session);
            let first = accept_valid(
                &l,
                &[],
                &opts,
                &serde_json::to_vec(&terms)?,
                ACCEPT_TIMEOUT,
                None,
                &mut || Ok(()),
            )?;
            check_terms(&mine, &first)?;
            let second = accept_valid(
                &l,
                control_qps,
                &opts,
                &serde_json::to_vec(&mine)?,
                CONNECT_TIMEOUT,
                Some(session),
                &mut post,
            )
            .map_err(|e| post_error().unwrap_or(e))?;
            check_peer(&mine, &second)?;
            let mut theirs = second;
            if let Some(l) = rdma_cm {
                for (i, qp) in side.qps.iter().enumerate() {
                    l.accept_then(
                        std::slice::from_ref(qp),
                        &opts,
                        &[],
                        CONNECT_TIMEOUT,
                        || post_on(i),
                    )
                    .map_err(|e| {
                        post_error().unwrap_or_else(|| {
                            format!("rdma_cm: accept on port {port}: {e}").into()
                        })
                    })?;
                }
                rdma_cm_peers(side, &mut theirs);
                if iwarp {
                    wait_hellos(side, CONNECT_TIMEOUT)?;
                }
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
            let first = check(first, false)?;
            // The second message names the session the server's answer named.
            let again = Hello {
                session: first.session,
                ..mine.clone()
            };
            let second = connect_retrying(
                host,
                *port,
                control_qps,
                &opts,
                &serde_json::to_vec(&again)?,
                &mut post,
            )
            .map_err(|e| post_error().unwrap_or(e))?;
            let mut theirs = check(second, true)?;
            if p.rdma_cm {
                let port = &cm_port(*port)?;
                for (i, qp) in side.qps.iter().enumerate() {
                    rdmx::verbs::cm::connect_then(
                        (host.as_str(), *port),
                        std::slice::from_ref(qp),
                        &opts,
                        &[],
                        CONNECT_TIMEOUT,
                        || post_on(i),
                    )
                    .map_err(|e| {
                        post_error().unwrap_or_else(|| {
                            format!("rdma_cm: connect to {host}:{port}: {e}").into()
                        })
                    })?;
                }
                rdma_cm_peers(side, &mut theirs);
                if iwarp {
                    for i in 0..side.qps.len() {
                        side.send_ctl(i, HELLO)?;
                    }
                }
            }
            theirs
        }
        PeerMode::Local => unreachable!("a local run connects with connect_local"),
    };
    if ud {
        ud_peers(side, &theirs)?;
    }
    Ok(theirs)
}

/// Responder on iWARP, once rdma_cm connected its queue pairs: waits up to `timeout` for
/// the requester's [`HELLO`] on every one, reposting the receives they took.
fn wait_hellos(side: &Side, timeout: Duration) -> Result<(), BoxError> {
    let mut heard = vec![false; side.qps.len()];
    let mut wc = [EMPTY; 16];
    let since = Instant::now();
    while heard.contains(&false) {
        let n = poll(&side.cq, &mut wc)?;
        for c in &wc[..n] {
            if !matches!(c.opcode, WcOpcode::Recv) {
                continue;
            }
            let i = side.qp_index(c.qp_num);
            match side.ctl_value(c)? {
                Some(HELLO) => heard[i] = true,
                other => {
                    return Err(format!(
                        "the peer's first message on QP {:#x} was {other:#x?}, not HELLO",
                        c.qp_num
                    )
                    .into())
                }
            }
            side.post_recv(i, c.wr_id)?;
        }
        if n == 0 {
            if since.elapsed() > timeout {
                return Err(format!("the peer sent no HELLO within {timeout:?}").into());
            }
            std::thread::yield_now();
        }
    }
    Ok(())
}

/// Address handles for the peer's UD queue pairs, from its hello.
fn ud_peers(side: &Side, theirs: &Hello) -> Result<(), BoxError> {
    let gid = theirs
        .gid
        .ok_or("the peer's hello names no address for its UD queue pairs")?;
    let mut peers = Vec::new();
    for (q, &(qpn, _)) in side.qps.iter().zip(&theirs.endpoints) {
        let ah = q.pd().create_ah(&rdmx::AhAttr::gid(gid))?;
        peers.push((ah, qpn));
    }
    let _ = side.ud_peers.set(peers);
    Ok(())
}

/// Accepts on the connection-setup port until an rdmx bench (of this version) has
/// exchanged its hello, within `timeout` in all; with a `session`, only one whose hello
/// names it (the peer of the first exchange), before anything is sent to it. Anything
/// else that connects (a port scan, an HTTP request, garbage, a truncated or oversized
/// message, a stall, another client) is logged on stderr with the reason and skipped, as
/// long as it left the queue pairs unconnected.
fn accept_valid(
    l: &rdmx::cm::Listener,
    qps: &[QueuePair],
    opts: &ConnectOptions,
    private: &[u8],
    timeout: Duration,
    session: Option<u64>,
    connected: &mut dyn FnMut() -> rdmx::Result<()>,
) -> Result<Hello, BoxError> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("no rdmx bench peer connected within {timeout:?}").into());
        }
        // The peer's hello, or why it was refused before this side sent anything.
        let mut heard = Err(String::new());
        let admit = |raw: &[u8]| {
            heard = match serde_json::from_slice::<Hello>(raw) {
                Err(e) => Err(format!("not an rdmx bench of this version: {e}")),
                Ok(h) if session.is_some() && h.session != session => Err(
                    "a bench that did not agree the terms with this server (its hello \
                     names another session)"
                        .to_string(),
                ),
                // A bench of another version is told why (check_terms), not skipped.
                Ok(h) => Ok(h),
            };
            heard.is_ok()
        };
        let accepted = l.accept_checked(qps, opts, private, left, admit, &mut *connected);
        let reason = match (accepted, heard) {
            (Ok(_), Ok(h)) => return Ok(h),
            (Err(rdmx::Error::Timeout("no peer connected")), _) => {
                return Err(format!("no rdmx bench peer connected within {timeout:?}").into())
            }
            (_, Err(why)) if !why.is_empty() => why,
            (Err(e), _) => e.to_string(),
            // (Not reached: the exchange goes on only with a hello heard.)
            (Ok(_), Err(_)) => "no hello".to_string(),
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
            warm_up: false,
            inline_size: None,
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
            gid: None,
            session: None,
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
