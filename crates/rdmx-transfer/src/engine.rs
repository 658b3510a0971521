//! The engine: rails, this engine's segment, the control listener peers handshake with,
//! opening peers' segments, submitting batches, notifications and status.

use std::collections::{HashMap, VecDeque};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};
use rdmx::{Access, ConnectOptions, Context, QpCaps, QueuePair};

use crate::batch::{Batch, BatchHandle};
use crate::config::{Config, Rail, Transport};
use crate::error::{Error, Result};
use crate::meta::{Meta, SegmentEvent};
use crate::path::{schedule, Conn, Path, PathStatus, RailRt, RECVS};
use crate::segment::{LocalBuf, LocalBuffer, Mem, Segment, SlotPool};
use crate::wire::{Msg, RailDesc, SegmentDesc, MAX_NAME};

/// A notification from a peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// The peer engine's name.
    pub from: String,
    /// What it sent.
    pub data: Vec<u8>,
}

/// What the engine's threads share.
pub(crate) struct Shared {
    pub(crate) me: Weak<Shared>,
    pub(crate) name: String,
    pub(crate) config: Config,
    pub(crate) rails: Vec<Arc<RailRt>>,
    pub(crate) control: SocketAddr,
    host: String,
    buffers: RwLock<Vec<Arc<LocalBuffer>>>,
    next_offset: Mutex<u64>,
    conns: Mutex<HashMap<String, Arc<Conn>>>,
    by_addr: Mutex<HashMap<String, String>>,
    next_path: AtomicU32,
    notes: Mutex<VecDeque<Notification>>,
    notes_cv: Condvar,
    stop: AtomicBool,
    pub(crate) meta: Meta,
}

impl Shared {
    pub(crate) fn deliver(&self, n: Notification) {
        self.notes.lock().push_back(n);
        self.notes_cv.notify_all();
    }

    fn desc(&self) -> SegmentDesc {
        SegmentDesc {
            name: self.name.clone(),
            host: self.host.clone(),
            pid: std::process::id(),
            control: self.control,
            // Every rail, closed or not: peers address rails by their index here.
            rails: self.rails.iter().map(|r| r.desc.clone()).collect(),
            buffers: self.buffers.read().iter().map(|b| b.desc()).collect(),
        }
    }

    /// The rails in service.
    fn open_rails(&self) -> Vec<Arc<RailRt>> {
        self.rails
            .iter()
            .filter(|r| !r.closed.load(Ordering::Acquire))
            .cloned()
            .collect()
    }

    fn token(&self) -> Vec<u8> {
        self.config
            .token
            .as_ref()
            .map(|t| t.as_bytes().to_vec())
            .unwrap_or_default()
    }

    fn new_qp(&self, rail: &RailRt) -> Result<QueuePair> {
        let caps = QpCaps::default()
            .max_send_wr(self.config.queue_depth.max(1) + 4)
            .max_recv_wr(RECVS);
        Ok(rail.pd.create_qp(&rail.cq, &rail.cq, caps)?)
    }

    fn connect_opts(&self, mtu: u32) -> ConnectOptions {
        ConnectOptions::default()
            .access(Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE)
            .mtu(rdmx::Mtu::from_bytes(mtu))
            .connect_timeout(self.config.connect_timeout)
    }

    fn add_conn(&self, conn: Arc<Conn>) {
        // Connections peers opened to this engine whose every path is down (the peer went
        // away; only the opening side rebuilds paths) are let go.
        let dead: Vec<Arc<Conn>> = {
            let mut conns = self.conns.lock();
            let names: Vec<String> = conns
                .iter()
                .filter(|(_, c)| {
                    !c.initiator && c.paths.iter().all(|p| !p.up.load(Ordering::Acquire))
                })
                .map(|(n, _)| n.clone())
                .collect();
            names.iter().filter_map(|n| conns.remove(n)).collect()
        };
        for c in &dead {
            self.drop_conn(c);
        }
        for p in &conn.paths {
            let _ = p.post_recvs();
            p.rail.paths.lock().push(p.clone());
        }
        if let Some(old) = self.conns.lock().insert(conn.peer.clone(), conn) {
            self.drop_conn(&old);
        }
    }

    fn drop_conn(&self, c: &Arc<Conn>) {
        c.closed.store(true, Ordering::Release);
        for p in &c.paths {
            p.rail.paths.lock().retain(|q| !Arc::ptr_eq(q, p));
            p.fail(self);
        }
    }
}

/// A transfer engine: this process's segment, its rails, and the peers it talks to.
///
/// Dropping it closes every connection: peers' requests to it fail, and its own
/// requests fail.
pub struct Engine {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("name", &self.shared.name)
            .field("control", &self.shared.control)
            .finish()
    }
}

fn host_id() -> String {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    format!(
        "{} {}",
        read("/proc/sys/kernel/hostname").trim(),
        read("/proc/sys/kernel/random/boot_id").trim()
    )
}

fn open_rail(index: usize, rail: &Rail) -> Result<Arc<RailRt>> {
    let ctx = match rail {
        Rail::Loopback => Context::open_provider("loopback")?,
        Rail::Shm => Context::open_provider("shm")?,
        Rail::Tcp { bind } => Context::open(rdmx::tcp::Options::default().bind(*bind))?,
        Rail::Verbs { device } => Context::open_device("verbs", device.as_deref())?,
    };
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq((ctx.capabilities().max_cqe as usize).min(1 << 16))?;
    let desc = RailDesc {
        kind: rail.transport(),
        device: ctx.device_name().to_string(),
        mtu: ctx.capabilities().active_mtu.bytes(),
        gid: ctx.gid().map(|(_, g)| g),
    };
    Ok(Arc::new(RailRt {
        index,
        kind: rail.transport(),
        pd,
        cq,
        desc,
        paths: Mutex::new(Vec::new()),
        sleeping: AtomicBool::new(false),
        stop: AtomicBool::new(false),
        closed: AtomicBool::new(false),
    }))
}

impl Engine {
    /// Starts an engine named `name` (unique among the engines that talk to each other):
    /// opens its rails, starts their workers and its control listener.
    pub fn new(name: &str, config: Config) -> Result<Engine> {
        if name.is_empty() || name.len() > MAX_NAME {
            return Err(Error::Invalid(format!(
                "engine name of {} bytes (1 to {MAX_NAME})",
                name.len()
            )));
        }
        if config.rails.is_empty() || config.rails.len() > crate::wire::MAX_RAILS {
            return Err(Error::Invalid("an engine needs 1 to 16 rails".into()));
        }
        if config.qps_per_rail == 0 || config.qps_per_rail > 16 || config.queue_depth == 0 {
            return Err(Error::Invalid(
                "qps_per_rail must be 1 to 16 and queue_depth above 0".into(),
            ));
        }
        let meta = Meta::open(&config.metadata, name, config.lease_ttl)?;
        let rails = config
            .rails
            .iter()
            .enumerate()
            .map(|(i, r)| open_rail(i, r))
            .collect::<Result<Vec<_>>>()?;
        let listener = TcpListener::bind(config.listen)
            .map_err(|e| Error::Io("bind the control listener", e))?;
        let mut control = listener
            .local_addr()
            .map_err(|e| Error::Io("getsockname", e))?;
        if control.ip().is_unspecified() {
            control.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        let shared = Arc::new_cyclic(|me| Shared {
            me: me.clone(),
            name: name.to_string(),
            config,
            rails,
            control,
            host: host_id(),
            buffers: RwLock::new(Vec::new()),
            next_offset: Mutex::new(0),
            conns: Mutex::new(HashMap::new()),
            by_addr: Mutex::new(HashMap::new()),
            next_path: AtomicU32::new(1),
            notes: Mutex::new(VecDeque::new()),
            notes_cv: Condvar::new(),
            stop: AtomicBool::new(false),
            meta,
        });
        shared.meta.publish(&shared.desc());
        let mut threads = Vec::new();
        for r in &shared.rails {
            let (s, r) = (shared.clone(), r.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("rdmx-te-{}", r.kind))
                    .spawn(move || crate::worker::run(s, r))
                    .map_err(|e| Error::Io("spawn a rail worker", e))?,
            );
        }
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::Io("O_NONBLOCK", e))?;
        let s = Arc::downgrade(&shared);
        threads.push(
            std::thread::Builder::new()
                .name("rdmx-te-listen".into())
                .spawn(move || listen(s, listener))
                .map_err(|e| Error::Io("spawn the control listener", e))?,
        );
        Ok(Engine { shared, threads })
    }

    /// This engine's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The address peers open this engine's segment at (`p2p`).
    pub fn control_addr(&self) -> SocketAddr {
        self.shared.control
    }

    /// This engine's segment descriptor, as peers receive it.
    pub fn desc(&self) -> SegmentDesc {
        self.shared.desc()
    }

    /// Registers `mem` (a `Vec<u8>`, an rdmx `Mapping`, or a length for a fresh zeroed
    /// mapping) as buffer `name` of this engine's segment, on every rail. Peers may READ
    /// it only with `Access::REMOTE_READ`, WRITE it only with `Access::REMOTE_WRITE`;
    /// `LOCAL_WRITE` is always added (READs land in it).
    pub fn register(&self, name: &str, mem: impl Into<Mem>, access: Access) -> Result<LocalBuf> {
        if name.is_empty() || name.len() > MAX_NAME {
            return Err(Error::Invalid(format!(
                "buffer name of {} bytes (1 to {MAX_NAME})",
                name.len()
            )));
        }
        let mem = mem.into().into_memory()?;
        let mut bufs = self.shared.buffers.write();
        if bufs.iter().any(|b| b.name == name) {
            return Err(Error::Invalid(format!("a buffer named {name:?} exists")));
        }
        if bufs.len() >= crate::wire::MAX_BUFFERS {
            return Err(Error::Invalid("too many buffers in one segment".into()));
        }
        let mut next = self.shared.next_offset.lock();
        let pds: Vec<_> = self.shared.rails.iter().map(|r| r.pd.clone()).collect();
        let b = LocalBuffer::register(
            name.to_string(),
            *next,
            mem,
            access | Access::LOCAL_WRITE,
            &pds,
        )?;
        *next = (*next + b.len).next_multiple_of(4096);
        let b = Arc::new(b);
        bufs.push(b.clone());
        drop((bufs, next));
        self.shared.meta.publish(&self.shared.desc());
        Ok(LocalBuf { inner: b })
    }

    /// Registers a buffer of `count` slots of `slot` bytes and returns a pool over it.
    pub fn register_pool(
        &self,
        name: &str,
        slot: u64,
        count: u32,
        access: Access,
    ) -> Result<SlotPool> {
        let total = slot
            .checked_mul(count as u64)
            .filter(|&t| t > 0 && t <= isize::MAX as u64)
            .ok_or_else(|| Error::Invalid(format!("{count} slots of {slot} bytes")))?;
        let buf = self.register(name, Mem::Zeroed(total as usize), access)?;
        Ok(SlotPool::new(buf, slot, count))
    }

    /// Takes buffer `buf` out of the segment: its keys stop working at once on every rail
    /// (peers' requests to it fail); requests in flight keep its memory alive.
    pub fn unregister(&self, buf: &LocalBuf) {
        self.shared
            .buffers
            .write()
            .retain(|b| !Arc::ptr_eq(b, &buf.inner));
        buf.inner.mrs.write().clear();
        self.shared.meta.publish(&self.shared.desc());
    }

    /// Opens the segment of engine `peer`: with `p2p` metadata `peer` is its control
    /// address (`host:port`), with etcd its name (looked up in etcd). The handshake
    /// exchanges descriptors, chooses the transport, and connects
    /// [`qps_per_rail`](Config::qps_per_rail) queue pairs on each rail of it. An engine
    /// already open is returned as it is, without asking etcd (see [`Segment::desc`], and
    /// [`refresh`](Self::refresh) for new buffers).
    pub fn open_segment(&self, peer: &str) -> Result<Segment> {
        self.open_segment_with(peer, self.shared.config.transport)
    }

    /// [`open_segment`](Self::open_segment) with a transport forced for this peer.
    pub fn open_segment_with(&self, peer: &str, transport: Option<Transport>) -> Result<Segment> {
        // An open connection serves either side, whoever opened it.
        let known = |c: &Arc<Conn>| {
            if self.shared.meta.is_p2p() {
                c.control.to_string() == peer
                    || self.shared.by_addr.lock().get(peer) == Some(&c.peer)
            } else {
                c.peer == peer
            }
        };
        let open = self
            .shared
            .conns
            .lock()
            .values()
            .find(|c| !c.closed.load(Ordering::Acquire) && known(c))
            .cloned();
        if let Some(conn) = open {
            return Ok(Segment { conn });
        }
        let addr = if self.shared.meta.is_p2p() {
            peer.to_string()
        } else {
            self.shared.meta.lookup(peer)?.control.to_string()
        };
        let conn = connect(&self.shared, &addr, transport)?;
        if !self.shared.meta.is_p2p() && conn.peer != peer {
            return Err(Error::Descriptor(format!(
                "etcd sent {peer:?} to {addr}, where {:?} answered",
                conn.peer
            )));
        }
        self.shared
            .by_addr
            .lock()
            .insert(peer.to_string(), conn.peer.clone());
        self.shared.add_conn(conn.clone());
        Ok(Segment { conn })
    }

    /// The segments the metadata service lists now (etcd; empty with `p2p`).
    pub fn segments(&self) -> Vec<String> {
        self.shared.meta.segments()
    }

    /// The next segment added to or removed from the metadata service, waiting up to
    /// `timeout` (etcd; with `p2p` there are none).
    pub fn next_segment_event(&self, timeout: Duration) -> Option<SegmentEvent> {
        self.shared.meta.next_event(timeout)
    }

    /// Fetches `seg`'s descriptor again (buffers registered since it was opened).
    pub fn refresh(&self, seg: &Segment) -> Result<()> {
        let mut s = control_stream(&self.shared, &seg.conn.control.to_string())?;
        Msg::Hello {
            desc: self.shared.desc(),
            describe_only: true,
            token: self.shared.token(),
        }
        .send(&mut s)?;
        match Msg::recv(&mut s)? {
            Msg::Desc(d) if d.name == seg.conn.peer => {
                *seg.conn.desc.write() = Arc::new(d);
                Ok(())
            }
            Msg::Refused(why) => Err(Error::Refused {
                peer: seg.conn.peer.clone(),
                why,
            }),
            _ => Err(Error::Descriptor(
                "the peer answered a descriptor request with something else".into(),
            )),
        }
    }

    /// Submits a batch: its requests are cut into slices and queued on the paths at
    /// once; the rails' workers post them. Returns a handle to follow it.
    pub fn submit(&self, batch: Batch) -> BatchHandle {
        let state = batch.into_state();
        schedule(&self.shared, &state);
        BatchHandle { state }
    }

    /// Sends a notification (at most [`MAX_NOTIFY`](crate::MAX_NOTIFY) bytes) to `seg`'s
    /// engine; it arrives after every request to that peer that completed before.
    pub fn notify(&self, seg: &Segment, msg: &[u8]) -> Result<BatchHandle> {
        let mut b = Batch::new();
        b.notify(msg)?;
        let state = b.into_state();
        let w = crate::path::Work::Notify {
            data: msg.into(),
            batch: Some(state.clone()),
            attempt: 0,
        };
        state.notifying(1);
        match seg.conn.first_up(&self.shared) {
            Some(i) => seg.conn.paths[i].enqueue(w),
            None => state.notify_done(Err(format!("no usable path to {}", seg.conn.peer))),
        }
        Ok(BatchHandle { state })
    }

    /// The next notification, waiting up to `timeout`.
    pub fn recv_notification(&self, timeout: Duration) -> Option<Notification> {
        let deadline = Instant::now() + timeout;
        let mut q = self.shared.notes.lock();
        loop {
            if let Some(n) = q.pop_front() {
                return Some(n);
            }
            if self
                .shared
                .notes_cv
                .wait_until(&mut q, deadline)
                .timed_out()
            {
                return q.pop_front();
            }
        }
    }

    /// The next notification, if one is there.
    pub fn try_recv_notification(&self) -> Option<Notification> {
        self.shared.notes.lock().pop_front()
    }

    /// Every open peer and its paths: transport, state, bytes in flight, bandwidth.
    pub fn status(&self) -> Vec<(String, Transport, Vec<PathStatus>)> {
        let mut v: Vec<_> = self
            .shared
            .conns
            .lock()
            .values()
            .map(|c| {
                (
                    c.peer.clone(),
                    c.transport,
                    c.paths.iter().map(|p| p.status()).collect(),
                )
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Puts rail `index` back in service after [`close_rail`](Self::close_rail): peers
    /// rebuild their paths on it when they next need them.
    pub fn reopen_rail(&self, index: usize) -> Result<()> {
        let rail = self
            .shared
            .rails
            .get(index)
            .ok_or_else(|| Error::Invalid(format!("no rail {index}")))?;
        rail.closed.store(false, Ordering::Release);
        Ok(())
    }

    /// Takes rail `index` out of service: its queue pairs are closed (peers see their
    /// requests on it fail and move to other rails), and it is used for nothing new.
    pub fn close_rail(&self, index: usize) -> Result<()> {
        let rail = self
            .shared
            .rails
            .get(index)
            .ok_or_else(|| Error::Invalid(format!("no rail {index}")))?;
        rail.closed.store(true, Ordering::Release);
        let paths: Vec<_> = rail.paths.lock().clone();
        for p in paths {
            p.fail(&self.shared);
            p.qp.lock().take();
        }
        Ok(())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        let conns: Vec<_> = self.shared.conns.lock().drain().map(|(_, c)| c).collect();
        for c in &conns {
            self.shared.drop_conn(c);
            for p in &c.paths {
                p.qp.lock().take();
            }
        }
        for r in &self.shared.rails {
            r.stop.store(true, Ordering::Release);
            r.cq.wake();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn control_stream(shared: &Shared, peer: &str) -> Result<TcpStream> {
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
    let has =
        |t: Transport| mine.iter().any(|r| r.kind == t) && theirs.rails.iter().any(|r| r.kind == t);
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
                        kinds(&mut theirs.rails.iter().map(|r| r.kind))
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
                        kinds(&mut theirs.rails.iter().map(|r| r.kind))
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
    let remote: Vec<(u8, &RailDesc)> = theirs
        .rails
        .iter()
        .enumerate()
        .filter(|(_, r)| r.kind == t)
        .map(|(i, r)| (i as u8, r))
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
fn connect(shared: &Arc<Shared>, peer: &str, want: Option<Transport>) -> Result<Arc<Conn>> {
    let mut s = control_stream(shared, peer)?;
    Msg::Hello {
        desc: shared.desc(),
        describe_only: false,
        token: shared.token(),
    }
    .send(&mut s)?;
    let theirs = match Msg::recv(&mut s)? {
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
    let eps = match Msg::recv(&mut s)? {
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
    let conn = build_conn(shared, &theirs, secret, transport, mtu, true, qps)?;
    Msg::Ready.send(&mut s)?;
    match Msg::recv(&mut s)? {
        Msg::Ready => {}
        _ => return Err(Error::Descriptor("the peer did not confirm".into())),
    }
    tracing::info!(peer = %conn.peer, %transport, paths = conn.paths.len(), "segment opened");
    Ok(conn)
}

fn build_conn(
    shared: &Arc<Shared>,
    theirs: &SegmentDesc,
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
            control: theirs.control,
            secret,
            transport,
            mtu,
            initiator,
            desc: RwLock::new(Arc::new(theirs.clone())),
            paths,
            closed: AtomicBool::new(false),
        }
    });
    match err {
        Some(e) => Err(e),
        None => Ok(conn),
    }
}

/// The control listener: each peer's handshake on its own thread, bounded in time; a
/// bad peer gets a refusal with the reason and the listener goes on.
fn listen(shared: Weak<Shared>, l: TcpListener) {
    loop {
        let Some(s) = shared.upgrade() else { return };
        if s.stop.load(Ordering::Acquire) {
            return;
        }
        match l.accept() {
            Ok((stream, from)) => {
                let s2 = s.clone();
                let _ = std::thread::Builder::new()
                    .name("rdmx-te-handshake".into())
                    .spawn(move || {
                        if let Err(e) = serve(&s2, stream) {
                            tracing::warn!(%from, error = %e, "a control connection failed");
                        }
                    });
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
    let first = match Msg::recv(&mut s) {
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
            let (secret, transport, mtu, paths) = match Msg::recv(&mut s)? {
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
            let res = accept_paths(shared, &desc, transport, mtu, &paths);
            let qps = match res {
                Ok(q) => q,
                Err(e) => {
                    let _ = Msg::Refused(e.to_string()).send(&mut s);
                    return Err(e);
                }
            };
            Msg::Accept(qps.iter().map(|(_, _, q)| q.endpoint()).collect()).send(&mut s)?;
            match Msg::recv(&mut s)? {
                Msg::Ready => {}
                _ => return Err(Error::Descriptor("the peer did not confirm".into())),
            }
            let conn = build_conn(shared, &desc, secret, transport, mtu, false, qps)?;
            shared.add_conn(conn);
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
                    match Msg::recv(&mut s)? {
                        Msg::Ready => {}
                        _ => return Err(Error::Descriptor("the peer did not confirm".into())),
                    }
                    install(&p, qp);
                    Msg::Ready.send(&mut s)?;
                    Ok(())
                }
                Err(e) => {
                    let _ = Msg::Refused(e.to_string()).send(&mut s);
                    Err(e)
                }
            }
        }
        other => {
            let e = Error::Descriptor(format!("a control connection that opened with {other:?}"));
            let _ = Msg::Refused(e.to_string()).send(&mut s);
            Err(e)
        }
    }
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
    let mine = shared.open_rails();
    let mut out = Vec::with_capacity(paths.len());
    for &(their_rail, my_rail, ep) in paths {
        let rail = mine.get(my_rail as usize).ok_or_else(|| {
            Error::Descriptor(format!(
                "a path on rail {my_rail}, which this engine has not"
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

fn repair_target(
    shared: &Shared,
    name: &str,
    secret: u64,
    path: u16,
    ep: rdmx::QpEndpoint,
) -> Result<(Arc<Path>, QueuePair)> {
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
    if p.rail.closed.load(Ordering::Acquire) {
        return Err(Error::Invalid(format!("rail {} is closed", p.rail.index)));
    }
    let qp = shared.new_qp(&p.rail)?;
    qp.connect(ep, &shared.connect_opts(conn.mtu))?;
    Ok((p, qp))
}

/// Puts a rebuilt queue pair into a path and brings it up.
fn install(p: &Path, qp: QueuePair) {
    *p.qp.lock() = Some(Arc::new(qp));
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
    let qp = shared.new_qp(&p.rail)?;
    let mut s = control_stream(shared, &conn.control.to_string())?;
    Msg::Repair {
        name: shared.name.clone(),
        secret: conn.secret,
        path: p.index,
        endpoint: qp.endpoint(),
    }
    .send(&mut s)?;
    let ep = match Msg::recv(&mut s)? {
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
    match Msg::recv(&mut s)? {
        Msg::Ready => {}
        _ => return Err(Error::Descriptor("the peer did not confirm".into())),
    }
    install(p, qp);
    tracing::info!(path = %p.name, "transfer path rebuilt");
    Ok(())
}
