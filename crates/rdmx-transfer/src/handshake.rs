//! The peer-to-peer handshake over the control listener: descriptors exchanged, the
//! transport and rail pairs chosen and checked (GID, MTU, device), queue pairs created and
//! connected on both sides; and the rebuild of one set-aside path, authenticated by the
//! connection's secret.

use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::RwLock;
use rdmx::QueuePair;

use crate::config::Transport;
use crate::engine::Shared;
use crate::error::{Error, Result};
use crate::path::{Conn, Path, RailRt};
use crate::wire::{ByDeadline, Msg, RailDesc, SegmentDesc};

pub(crate) fn control_stream(shared: &Shared, peer: &str) -> Result<TcpStream> {
    let timeout = shared.config.connect_timeout;
    let mut last = None;
    let addrs = peer
        .to_socket_addrs()
        .map_err(|e| Error::Io("resolve the peer's address", e))?;
    for a in addrs {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => {
                let io = |e| Error::Io("set up the control connection", e);
                s.set_read_timeout(Some(timeout)).map_err(io)?;
                s.set_write_timeout(Some(timeout)).map_err(io)?;
                s.set_nodelay(true).map_err(io)?;
                return Ok(s);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(Error::Io(
        "connect to the peer's control listener",
        last.unwrap_or_else(|| std::io::Error::other("the address resolved to nothing")),
    ))
}

/// A transport, the rail pairs (local rail, the peer's rail index) and the path MTU.
type Choice = (Transport, Vec<(Arc<RailRt>, u8)>, u32);

/// The transport for a peer, and the rail pairs (local, remote index in the peer's
/// descriptor) to connect, with the path MTU.
fn choose(shared: &Shared, theirs: &SegmentDesc, want: Option<Transport>) -> Result<Choice> {
    let mine = shared.open_rails();
    // The peer's rails in service, by their index in its descriptor: no path is opened
    // on a closed one.
    let in_service: Vec<(u8, &RailDesc)> = theirs
        .rails
        .iter()
        .enumerate()
        .filter(|(_, r)| !r.closed)
        .map(|(i, r)| (i as u8, r))
        .collect();
    let has = |t: Transport| {
        mine.iter().any(|r| r.kind == t) && in_service.iter().any(|(_, r)| r.kind == t)
    };
    let same_host = theirs.host == shared.host;
    let kinds = |rails: &mut dyn Iterator<Item = Transport>| {
        let mut v: Vec<_> = rails.map(|t| t.name()).collect();
        v.dedup();
        v.join(", ")
    };
    let t = match want {
        Some(t) => {
            if !has(t) {
                return Err(Error::Mismatch {
                    peer: theirs.name.clone(),
                    why: format!(
                        "{t} asked for; rails here: {}; the peer's: {}",
                        kinds(&mut mine.iter().map(|r| r.kind)),
                        kinds(&mut in_service.iter().map(|(_, r)| r.kind))
                    ),
                });
            }
            t
        }
        None => {
            if same_host && theirs.pid == std::process::id() && has(Transport::Loopback) {
                Transport::Loopback
            } else if same_host && has(Transport::Shm) {
                Transport::Shm
            } else if has(Transport::Verbs) {
                Transport::Verbs
            } else if has(Transport::Tcp) {
                Transport::Tcp
            } else {
                return Err(Error::Mismatch {
                    peer: theirs.name.clone(),
                    why: format!(
                        "no transport in common (here: {}; the peer: {}; same host: {same_host})",
                        kinds(&mut mine.iter().map(|r| r.kind)),
                        kinds(&mut in_service.iter().map(|(_, r)| r.kind))
                    ),
                });
            }
        }
    };
    if (t == Transport::Shm || t == Transport::Loopback) && !same_host {
        return Err(Error::Mismatch {
            peer: theirs.name.clone(),
            why: format!(
                "{t} needs the same host (here {:?}, the peer {:?})",
                shared.host, theirs.host
            ),
        });
    }
    let local: Vec<_> = mine.iter().filter(|r| r.kind == t).cloned().collect();
    let remote: Vec<(u8, &RailDesc)> = in_service
        .iter()
        .copied()
        .filter(|(_, r)| r.kind == t)
        .collect();
    let n = local.len().max(remote.len());
    let mut pairs = Vec::with_capacity(n);
    let mut mtu = u32::MAX;
    for i in 0..n {
        let l = &local[i % local.len()];
        let (ri, r) = remote[i % remote.len()];
        check_pair(&theirs.name, &l.desc, r)?;
        mtu = mtu.min(l.desc.mtu).min(r.mtu);
        pairs.push((l.clone(), ri));
    }
    if let Some(m) = shared.config.mtu {
        if m > mtu {
            return Err(Error::Mismatch {
                peer: theirs.name.clone(),
                why: format!("MTU {m} asked for, but the smaller of both sides' is {mtu}"),
            });
        }
        mtu = m;
    }
    Ok((t, pairs, mtu))
}

/// A rail pair both sides can use: on verbs, GIDs of the same kind (RoCEv2 IPv4-mapped
/// or not) and a GID on each side.
fn check_pair(peer: &str, l: &RailDesc, r: &RailDesc) -> Result<()> {
    if l.kind != Transport::Verbs {
        return Ok(());
    }
    match (l.gid, r.gid) {
        (Some(a), Some(b)) if a.to_ipv4_mapped().is_some() == b.to_ipv4_mapped().is_some() => {
            Ok(())
        }
        (a, b) => Err(Error::Mismatch {
            peer: peer.to_string(),
            why: format!(
                "GID {} on device {} here, GID {} on device {} at the peer",
                a.map_or("none".into(), |g| g.to_string()),
                l.device,
                b.map_or("none".into(), |g| g.to_string()),
                r.device
            ),
        }),
    }
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b).expect("the OS random source");
    u64::from_ne_bytes(b)
}

/// The initiator's side of the handshake.
pub(crate) fn connect(
    shared: &Arc<Shared>,
    peer: &str,
    want: Option<Transport>,
) -> Result<Arc<Conn>> {
    let t = shared.config.connect_timeout;
    let mut s = control_stream(shared, peer)?;
    let dialed = s
        .peer_addr()
        .map_err(|e| Error::Io("getpeername on the control connection", e))?;
    Msg::Hello {
        desc: shared.desc(),
        describe_only: false,
        token: shared.token(),
    }
    .send(&mut s)?;
    let theirs = match Msg::recv(&mut ByDeadline::new(&s, t))? {
        Msg::Desc(d) => d,
        Msg::Refused(why) => {
            return Err(Error::Refused {
                peer: peer.into(),
                why,
            })
        }
        _ => return Err(Error::Descriptor("expected the peer's descriptor".into())),
    };
    if theirs.name == shared.name {
        return Err(Error::Invalid(format!(
            "the peer at {peer} has this engine's own name {:?}",
            shared.name
        )));
    }
    let (transport, pairs, mtu) = match choose(shared, &theirs, want) {
        Ok(c) => c,
        Err(e) => {
            let _ = Msg::Refused(e.to_string()).send(&mut s);
            return Err(e);
        }
    };
    let secret = random_u64();
    let mut qps = Vec::new();
    let mut wire = Vec::new();
    for (rail, ri) in &pairs {
        for _ in 0..shared.config.qps_per_rail {
            let qp = shared.new_qp(rail)?;
            wire.push((rail.index as u8, *ri, qp.endpoint()));
            qps.push((rail.clone(), *ri, qp));
        }
    }
    Msg::Connect {
        secret,
        transport,
        mtu,
        paths: wire,
    }
    .send(&mut s)?;
    let eps = match Msg::recv(&mut ByDeadline::new(&s, t))? {
        Msg::Accept(eps) if eps.len() == qps.len() => eps,
        Msg::Refused(why) => {
            return Err(Error::Refused {
                peer: theirs.name,
                why,
            })
        }
        _ => return Err(Error::Descriptor("expected the peer's endpoints".into())),
    };
    let opts = shared.connect_opts(mtu);
    for ((_, _, qp), ep) in qps.iter().zip(&eps) {
        qp.connect(*ep, &opts)?;
    }
    let conn = build_conn(shared, &theirs, dialed, secret, transport, mtu, true, qps)?;
    for (p, ep) in conn.paths.iter().zip(&eps) {
        p.qp_pair.lock().1 = ep.qp_num;
    }
    Msg::Ready.send(&mut s)?;
    match Msg::recv(&mut ByDeadline::new(&s, t))? {
        Msg::Ready => {}
        Msg::Refused(why) => {
            return Err(Error::Refused {
                peer: theirs.name,
                why,
            })
        }
        _ => return Err(Error::Descriptor("the peer did not confirm".into())),
    }
    tracing::info!(peer = %conn.peer, %transport, paths = conn.paths.len(), "segment opened");
    Ok(conn)
}

#[allow(clippy::too_many_arguments)]
fn build_conn(
    shared: &Arc<Shared>,
    theirs: &SegmentDesc,
    probe_at: SocketAddr,
    secret: u64,
    transport: Transport,
    mtu: u32,
    initiator: bool,
    qps: Vec<(Arc<RailRt>, u8, QueuePair)>,
) -> Result<Arc<Conn>> {
    let mut err = None;
    let conn = Arc::new_cyclic(|w: &Weak<Conn>| {
        let mut paths = Vec::new();
        for (i, (rail, ri, qp)) in qps.into_iter().enumerate() {
            let id = shared.next_path.fetch_add(1, Ordering::Relaxed) & 0x7fff_ffff;
            match Path::new(w.clone(), rail, ri, i as u16, id, &theirs.name, qp) {
                Ok(p) => paths.push(p),
                Err(e) => err = Some(e),
            }
        }
        Conn {
            peer: theirs.name.clone(),
            probe_at,
            secret,
            transport,
            mtu,
            initiator,
            desc: RwLock::new(Arc::new(theirs.clone())),
            paths,
            closed: AtomicBool::new(false),
            added: std::sync::atomic::AtomicU64::new(0),
            notes_sent: std::sync::atomic::AtomicU32::new(0),
            notes_seen: Default::default(),
            gate: Default::default(),
        }
    });
    match err {
        Some(e) => Err(e),
        None => Ok(conn),
    }
}

/// Control connections served at once, at most: beyond them, a new one closes the one
/// that has waited longest (real peers' exchanges take milliseconds; a stranger that
/// sends slowly holds one for at most the connect timeout per message).
const MAX_HANDSHAKES: usize = 64;

/// The control listener: each peer's handshake on its own thread, bounded in time (each
/// message within the connect timeout, however slowly it comes) and in number; a bad
/// peer gets a refusal with the reason and the listener goes on.
pub(crate) fn listen(shared: Weak<Shared>, l: TcpListener) {
    // The connections being served, oldest first, by a number of their own.
    let serving: Arc<parking_lot::Mutex<std::collections::VecDeque<(u64, TcpStream)>>> =
        Arc::default();
    let mut next = 0u64;
    loop {
        let Some(s) = shared.upgrade() else { return };
        if s.stop.load(Ordering::Acquire) {
            return;
        }
        match l.accept() {
            Ok((stream, from)) => {
                let id = next;
                next += 1;
                {
                    let mut q = serving.lock();
                    if q.len() >= MAX_HANDSHAKES {
                        if let Some((_, oldest)) = q.pop_front() {
                            tracing::warn!(
                                "{MAX_HANDSHAKES} control connections at once: closing the \
                                 one that waited longest"
                            );
                            let _ = oldest.shutdown(std::net::Shutdown::Both);
                        }
                    }
                    if let Ok(c) = stream.try_clone() {
                        q.push_back((id, c));
                    }
                }
                let s2 = s.clone();
                let serving2 = serving.clone();
                let spawned = std::thread::Builder::new()
                    .name("rdmx-te-handshake".into())
                    .spawn(move || {
                        if let Err(e) = serve(&s2, stream) {
                            tracing::warn!(%from, error = %e, "a control connection failed");
                        }
                        serving2.lock().retain(|(i, _)| *i != id);
                    });
                if let Err(e) = spawned {
                    tracing::warn!(%from, error = %e, "no thread for a control connection");
                    serving.lock().retain(|(i, _)| *i != id);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                drop(s);
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept on the control listener failed");
                drop(s);
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// The target's side of one control connection.
fn serve(shared: &Arc<Shared>, mut s: TcpStream) -> Result<()> {
    let t = shared.config.connect_timeout;
    let io = |e| Error::Io("set up the control connection", e);
    s.set_nonblocking(false).map_err(io)?;
    s.set_read_timeout(Some(t)).map_err(io)?;
    s.set_write_timeout(Some(t)).map_err(io)?;
    s.set_nodelay(true).map_err(io)?;
    let from = s.peer_addr().map_err(io)?;
    let since = shared.conns_added.load(Ordering::Acquire);
    let first = match Msg::recv(&mut ByDeadline::new(&s, t)) {
        Ok(m) => m,
        Err(e) => {
            let _ = Msg::Refused(e.to_string()).send(&mut s);
            return Err(e);
        }
    };
    match first {
        Msg::Hello {
            desc,
            describe_only,
            token,
        } => {
            if let Some(mine) = &shared.config.token {
                let mine = mine.as_bytes();
                let same = mine.len() == token.len()
                    && mine
                        .iter()
                        .zip(&token)
                        .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                        == 0;
                if !same {
                    let e = Error::Refused {
                        peer: desc.name,
                        why: "the peer did not present this cluster's token".into(),
                    };
                    let _ = Msg::Refused("wrong or missing cluster token".into()).send(&mut s);
                    return Err(e);
                }
            }
            Msg::Desc(shared.desc()).send(&mut s)?;
            if describe_only {
                return Ok(());
            }
            let (secret, transport, mtu, paths) = match Msg::recv(&mut ByDeadline::new(&s, t))? {
                Msg::Connect {
                    secret,
                    transport,
                    mtu,
                    paths,
                } => (secret, transport, mtu, paths),
                Msg::Refused(why) => {
                    return Err(Error::Refused {
                        peer: desc.name,
                        why,
                    })
                }
                _ => return Err(Error::Descriptor("expected a connect request".into())),
            };
            // Nobody takes over another engine's connection by naming itself after it. (The
            // refusal comes after this engine's descriptor: an initiator that holds that
            // connection, opened by this engine, learns whose it is and uses it.)
            if let Some(why) = held_elsewhere(shared, &desc.name) {
                let _ = Msg::Refused(why.clone()).send(&mut s);
                return Err(Error::Refused {
                    peer: desc.name,
                    why,
                });
            }
            let res = accept_paths(shared, &desc, transport, mtu, &paths);
            let qps = match res {
                Ok(q) => q,
                Err(e) => {
                    let _ = Msg::Refused(e.to_string()).send(&mut s);
                    return Err(e);
                }
            };
            Msg::Accept(qps.iter().map(|(_, _, q)| q.endpoint()).collect()).send(&mut s)?;
            match Msg::recv(&mut ByDeadline::new(&s, t))? {
                Msg::Ready => {}
                _ => return Err(Error::Descriptor("the peer did not confirm".into())),
            }
            let probe_at = match desc.control.ip().is_loopback() && !from.ip().is_loopback() {
                true => SocketAddr::new(from.ip(), desc.control.port()),
                false => desc.control,
            };
            let conn = build_conn(shared, &desc, probe_at, secret, transport, mtu, false, qps)?;
            for (p, (_, _, ep)) in conn.paths.iter().zip(&paths) {
                p.qp_pair.lock().1 = ep.qp_num;
            }
            let kept = shared.add_conn(conn.clone(), since);
            if !Arc::ptr_eq(&kept, &conn) {
                // Both engines opened each other at once and this one keeps the other
                // connection: the initiator falls back on it too.
                let why = "both engines opened each other at once; the connection the other \
                           opened is kept";
                let _ = Msg::Refused(why.into()).send(&mut s);
                return Err(Error::Refused {
                    peer: desc.name,
                    why: why.into(),
                });
            }
            Msg::Ready.send(&mut s)?;
            Ok(())
        }
        Msg::Repair {
            name,
            secret,
            path,
            endpoint,
        } => {
            let res = repair_target(shared, &name, secret, path, endpoint);
            match res {
                Ok((p, qp)) => {
                    Msg::Accept(vec![qp.endpoint()]).send(&mut s)?;
                    match Msg::recv(&mut ByDeadline::new(&s, t))? {
                        Msg::Ready => {}
                        _ => return Err(Error::Descriptor("the peer did not confirm".into())),
                    }
                    install(&p, qp, endpoint.qp_num);
                    Msg::Ready.send(&mut s)?;
                    Ok(())
                }
                Err(e) => {
                    let _ = Msg::Refused(e.to_string()).send(&mut s);
                    Err(e)
                }
            }
        }
        Msg::Fence {
            name,
            secret,
            path,
            qpn,
        } => match fence_target(shared, &name, secret, path, qpn) {
            Ok(()) => Msg::Ready.send(&mut s),
            Err(e) => {
                let _ = Msg::Refused(e.to_string()).send(&mut s);
                Err(e)
            }
        },
        Msg::Probe { name, secret } => {
            let holds = shared.open_conn(&name).is_some_and(|c| c.secret == secret);
            match holds {
                true => Msg::Ready.send(&mut s),
                false => Msg::Refused("no such connection here".into()).send(&mut s),
            }
        }
        other => {
            let e = Error::Descriptor(format!("a control connection that opened with {other:?}"));
            let _ = Msg::Refused(e.to_string()).send(&mut s);
            Err(e)
        }
    }
}

/// Why an initiator naming itself `name` is refused: this engine holds an open
/// connection with an engine of that name, which says it still holds it. `None` when it
/// holds none, or the engine it was made with no longer answers for it (it went, or
/// restarted: it does not know the connection's secret), so the newcomer replaces it.
fn held_elsewhere(shared: &Shared, name: &str) -> Option<String> {
    let old = shared.open_conn(name)?;
    probe(shared, &old).then(|| {
        format!(
            "an engine named {name:?} is connected here already (its control listener at {} \
             holds the connection)",
            old.probe_at
        )
    })
}

/// Whether the peer of `conn` still holds it: asked at its control listener. A listener
/// that is not there, or says no (or answers something no engine says), does not; one
/// that takes the connection and then does not answer in time, or closes it unanswered,
/// is taken to: a stalled engine keeps its connections, and a listener full of others'
/// connections closes the oldest (a stranger that fills it must not make this engine
/// give the connection to whoever names itself as the peer).
fn probe(shared: &Shared, conn: &Conn) -> bool {
    let t = shared.config.connect_timeout / 2;
    let Ok(mut s) = TcpStream::connect_timeout(&conn.probe_at, t) else {
        return false;
    };
    if s.set_read_timeout(Some(t)).is_err() || s.set_write_timeout(Some(t)).is_err() {
        return false;
    }
    let asked = Msg::Probe {
        name: shared.name.clone(),
        secret: conn.secret,
    }
    .send(&mut s);
    matches!(
        asked.and_then(|()| Msg::recv(&mut ByDeadline::new(&s, t))),
        Ok(Msg::Ready) | Err(Error::Io(..))
    )
}

/// Creates and connects the target's queue pairs for a connect request, after checking
/// it against this engine's rails.
fn accept_paths(
    shared: &Shared,
    theirs: &SegmentDesc,
    transport: Transport,
    mtu: u32,
    paths: &[(u8, u8, rdmx::QpEndpoint)],
) -> Result<Vec<(Arc<RailRt>, u8, QueuePair)>> {
    if theirs.name == shared.name {
        return Err(Error::Invalid(format!(
            "a peer with this engine's name {:?}",
            shared.name
        )));
    }
    let mut out = Vec::with_capacity(paths.len());
    for &(their_rail, my_rail, ep) in paths {
        // Rails are numbered as in the descriptor: every rail, closed ones included.
        let rail = shared
            .rails
            .get(my_rail as usize)
            .filter(|r| !r.closed.load(Ordering::Acquire))
            .ok_or_else(|| {
                Error::Descriptor(format!(
                    "a path on rail {my_rail}, which this engine has not in service"
                ))
            })?;
        let tr = theirs.rails.get(their_rail as usize).ok_or_else(|| {
            Error::Descriptor(format!(
                "a path from rail {their_rail} the peer did not describe"
            ))
        })?;
        if rail.kind != transport || tr.kind != transport {
            return Err(Error::Mismatch {
                peer: theirs.name.clone(),
                why: format!(
                    "{transport} asked for, on rail {} here and {} at the peer",
                    rail.kind, tr.kind
                ),
            });
        }
        check_pair(&theirs.name, &rail.desc, tr)?;
        let both = rail.desc.mtu.min(tr.mtu);
        if mtu > both {
            return Err(Error::Mismatch {
                peer: theirs.name.clone(),
                why: format!(
                    "MTU {mtu} asked for; rail {} here offers {}, the peer's {}",
                    rail.desc.device, rail.desc.mtu, tr.mtu
                ),
            });
        }
        let qp = shared.new_qp(rail)?;
        qp.connect(ep, &shared.connect_opts(mtu))?;
        out.push((rail.clone(), their_rail, qp));
    }
    Ok(out)
}

/// Path `path` of the connection with `name` that `secret` names.
fn named_path(
    shared: &Shared,
    name: &str,
    secret: u64,
    path: u16,
) -> Result<(Arc<Conn>, Arc<Path>)> {
    let conn = shared
        .conns
        .lock()
        .get(name)
        .cloned()
        .filter(|c| c.secret == secret)
        .ok_or_else(|| Error::Invalid(format!("no connection from {name:?} with that secret")))?;
    let p = conn
        .paths
        .get(path as usize)
        .cloned()
        .ok_or_else(|| Error::Invalid(format!("no path {path}")))?;
    Ok((conn, p))
}

fn repair_target(
    shared: &Shared,
    name: &str,
    secret: u64,
    path: u16,
    ep: rdmx::QpEndpoint,
) -> Result<(Arc<Path>, QueuePair)> {
    let (conn, p) = named_path(shared, name, secret, path)?;
    if p.rail.closed.load(Ordering::Acquire) {
        return Err(Error::Invalid(format!("rail {} is closed", p.rail.index)));
    }
    let qp = shared.new_qp(&p.rail)?;
    qp.connect(ep, &shared.connect_opts(conn.mtu))?;
    Ok((p, qp))
}

/// The peer's side of a fence: its queue pair `qpn` of the path goes to the error state
/// (and the path is set aside), so that nothing more of what the peer sent on it lands.
/// A queue pair the path no longer has (rebuilt since, or its rail closed) takes nothing
/// already.
fn fence_target(shared: &Shared, name: &str, secret: u64, path: u16, qpn: u32) -> Result<()> {
    let (_, p) = named_path(shared, name, secret, path)?;
    let current = |p: &Path| p.qp.lock().as_ref().filter(|q| q.qp_num() == qpn).cloned();
    let Some(qp) = current(&p) else {
        return Ok(());
    };
    if qp.state() != rdmx::QpState::Err {
        let attr = rdmx::QpAttr {
            qp_state: rdmx::QpState::Err,
            ..Default::default()
        };
        qp.modify(&attr, rdmx::QpAttrMask::STATE)?;
    }
    // Set aside too, unless rebuilt meanwhile (a new queue pair is not this one).
    if current(&p).is_some() {
        p.fail(shared);
    }
    tracing::info!(path = %p.name, "transfer path fenced at the peer's request");
    Ok(())
}

/// Asks the peer to fence its side of path `p` (its queue pair `qpn`), which failed
/// here with work in flight: `Ok` once it confirms.
pub(crate) fn fence(shared: &Arc<Shared>, p: &Path, qpn: u32) -> Result<()> {
    let conn = p
        .conn
        .upgrade()
        .ok_or_else(|| Error::Invalid("the connection is closed".into()))?;
    let t = shared.config.connect_timeout;
    let mut s = control_stream(shared, &conn.probe_at.to_string())?;
    Msg::Fence {
        name: shared.name.clone(),
        secret: conn.secret,
        path: p.index,
        qpn,
    }
    .send(&mut s)?;
    match Msg::recv(&mut ByDeadline::new(&s, t))? {
        Msg::Ready => Ok(()),
        Msg::Refused(why) => Err(Error::Refused {
            peer: conn.peer.clone(),
            why,
        }),
        _ => Err(Error::Descriptor(
            "expected the fence's confirmation".into(),
        )),
    }
}

/// Puts a rebuilt queue pair, connected to the peer's `peer_qpn`, into a path and brings
/// it up.
fn install(p: &Path, qp: QueuePair, peer_qpn: u32) {
    // Fences are per queue pair: one for the old pair, if still asked for, finishes its
    // work, and a failure of the new one asks for its own.
    let mut pair = p.qp_pair.lock();
    *pair = (qp.qp_num(), peer_qpn);
    *p.qp.lock() = Some(Arc::new(qp));
    drop(pair);
    // Finished fences were for older queue pairs (a number may come back, much later).
    p.fences.lock().retain(crate::fence::Fence::running);
    let _ = p.post_recvs();
    *p.down_until.lock() = None;
    p.up.store(true, Ordering::Release);
    p.rail.kick();
}

/// The initiator rebuilds a set-aside path: a new queue pair on each side.
pub(crate) fn repair(shared: &Arc<Shared>, p: &Arc<Path>) -> Result<()> {
    let conn = p
        .conn
        .upgrade()
        .ok_or_else(|| Error::Invalid("the connection is closed".into()))?;
    let t = shared.config.connect_timeout;
    let qp = shared.new_qp(&p.rail)?;
    // Where this engine reaches the peer (not the address its descriptor claims).
    let mut s = control_stream(shared, &conn.probe_at.to_string())?;
    Msg::Repair {
        name: shared.name.clone(),
        secret: conn.secret,
        path: p.index,
        endpoint: qp.endpoint(),
    }
    .send(&mut s)?;
    let ep = match Msg::recv(&mut ByDeadline::new(&s, t))? {
        Msg::Accept(eps) if eps.len() == 1 => eps[0],
        Msg::Refused(why) => {
            return Err(Error::Refused {
                peer: conn.peer.clone(),
                why,
            })
        }
        _ => return Err(Error::Descriptor("expected one endpoint".into())),
    };
    qp.connect(ep, &shared.connect_opts(conn.mtu))?;
    Msg::Ready.send(&mut s)?;
    match Msg::recv(&mut ByDeadline::new(&s, t))? {
        Msg::Ready => {}
        _ => return Err(Error::Descriptor("the peer did not confirm".into())),
    }
    install(p, qp, ep.qp_num);
    tracing::info!(path = %p.name, "transfer path rebuilt");
    Ok(())
}
