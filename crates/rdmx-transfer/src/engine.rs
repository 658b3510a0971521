//! The engine: rails, this engine's segment, the control listener peers handshake with,
//! opening peers' segments, submitting batches, notifications and status.

use std::collections::{HashMap, VecDeque};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};
use rdmx::{Access, ConnectOptions, Context, QpCaps, QueuePair};

use crate::batch::{Batch, BatchHandle};
use crate::config::{Config, Rail, Transport};
use crate::error::{Error, Result};
use crate::handshake::{connect, control_stream, listen};
use crate::meta::{Meta, SegmentEvent};
use crate::path::{schedule, Conn, PathStatus, RailRt, RECVS};
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
    pub(crate) host: String,
    pub(crate) buffers: RwLock<Vec<Arc<LocalBuffer>>>,
    pub(crate) next_offset: Mutex<u64>,
    pub(crate) conns: Mutex<HashMap<String, Arc<Conn>>>,
    pub(crate) by_addr: Mutex<HashMap<String, String>>,
    pub(crate) next_path: AtomicU32,
    /// Connections added so far: a handshake notes it when it begins, and a connection
    /// to its peer added since was made while it ran (both sides opened at once).
    pub(crate) conns_added: AtomicU64,
    pub(crate) notes: Mutex<VecDeque<Notification>>,
    pub(crate) notes_cv: Condvar,
    pub(crate) stop: AtomicBool,
    pub(crate) meta: Meta,
}

impl Shared {
    pub(crate) fn deliver(&self, n: Notification) {
        self.notes.lock().push_back(n);
        self.notes_cv.notify_all();
    }

    pub(crate) fn desc(&self) -> SegmentDesc {
        SegmentDesc {
            name: self.name.clone(),
            host: self.host.clone(),
            pid: std::process::id(),
            control: self.control,
            // Every rail, closed or not: peers address rails by their index here.
            rails: self
                .rails
                .iter()
                .map(|r| RailDesc {
                    closed: r.closed.load(Ordering::Acquire),
                    ..r.desc.clone()
                })
                .collect(),
            buffers: self.buffers.read().iter().map(|b| b.desc()).collect(),
        }
    }

    /// The rails in service.
    pub(crate) fn open_rails(&self) -> Vec<Arc<RailRt>> {
        self.rails
            .iter()
            .filter(|r| !r.closed.load(Ordering::Acquire))
            .cloned()
            .collect()
    }

    pub(crate) fn token(&self) -> Vec<u8> {
        self.config
            .token
            .as_ref()
            .map(|t| t.as_bytes().to_vec())
            .unwrap_or_default()
    }

    pub(crate) fn new_qp(&self, rail: &RailRt) -> Result<QueuePair> {
        let caps = QpCaps::default()
            .max_send_wr(self.config.queue_depth.max(1) + 4)
            .max_recv_wr(RECVS);
        Ok(rail.pd.create_qp(&rail.cq, &rail.cq, caps)?)
    }

    pub(crate) fn connect_opts(&self, mtu: u32) -> ConnectOptions {
        ConnectOptions::default()
            .access(Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE)
            .mtu(rdmx::Mtu::from_bytes(mtu))
            .connect_timeout(self.config.connect_timeout)
    }

    /// Adds `conn`, made by a handshake that began when [`conns_added`](Self::conns_added)
    /// was `since`, and returns the connection to its peer kept: `conn`, which replaces
    /// any other, unless another was added while the handshake ran (both engines opened
    /// each other at once). Then both sides keep the one opened by the engine whose name
    /// sorts first, and close the other.
    pub(crate) fn add_conn(&self, conn: Arc<Conn>, since: u64) -> Arc<Conn> {
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
        let opener = |c: &Conn| match c.initiator {
            true => self.name.clone(),
            false => c.peer.clone(),
        };
        let mut conns = self.conns.lock();
        let concurrent = conns.get(&conn.peer).filter(|old| {
            !old.closed.load(Ordering::Acquire)
                && old.added.load(Ordering::Acquire) > since
                && opener(old) < opener(&conn)
        });
        if let Some(old) = concurrent.cloned() {
            drop(conns);
            self.drop_conn(&conn);
            return old;
        }
        for p in &conn.paths {
            let _ = p.post_recvs();
            p.rail.paths.lock().push(p.clone());
        }
        let n = self.conns_added.fetch_add(1, Ordering::AcqRel) + 1;
        conn.added.store(n, Ordering::Release);
        let old = conns.insert(conn.peer.clone(), conn.clone());
        drop(conns);
        if let Some(old) = old {
            self.drop_conn(&old);
        }
        conn
    }

    /// The open connection with the engine named `name`, if any.
    pub(crate) fn open_conn(&self, name: &str) -> Option<Arc<Conn>> {
        self.conns
            .lock()
            .get(name)
            .filter(|c| !c.closed.load(Ordering::Acquire))
            .cloned()
    }

    pub(crate) fn drop_conn(&self, c: &Arc<Conn>) {
        c.closed.store(true, Ordering::Release);
        for p in &c.paths {
            p.rail.paths.lock().retain(|q| !Arc::ptr_eq(q, p));
            p.fail(self);
            // What is still queued there (on a path already set aside, which `fail`
            // leaves as it is) would wait where no worker looks any more.
            p.fail_queued(self, &c.peer);
        }
        // Marked closed above: what the gate holds fails.
        c.release_notes(self);
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
        closed: false,
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
            conns_added: AtomicU64::new(0),
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
        // An open connection serves either side, whoever opened it. With p2p, by the
        // address this engine dialed and the name that answered there: never by the
        // control address a peer's own descriptor claims (anyone may claim any).
        let known = |c: &Arc<Conn>| {
            if self.shared.meta.is_p2p() {
                self.shared.by_addr.lock().get(peer) == Some(&c.peer)
            } else {
                c.peer == peer
            }
        };
        // Connections added from here on were made while this open ran.
        let since = self.shared.conns_added.load(Ordering::Acquire);
        let open = || {
            self.shared
                .conns
                .lock()
                .values()
                .find(|c| !c.closed.load(Ordering::Acquire) && known(c))
                .cloned()
        };
        if let Some(conn) = open() {
            return Ok(Segment { conn });
        }
        let addr = if self.shared.meta.is_p2p() {
            peer.to_string()
        } else {
            self.shared.meta.lookup(peer)?.control.to_string()
        };
        let conn = match connect(&self.shared, &addr, transport) {
            Ok(c) => c,
            // The peer refused because it holds a connection with this engine (one it
            // opened, perhaps at once with this open): that connection serves either side.
            Err(Error::Refused { peer: name, why }) => {
                return match self.shared.open_conn(&name).or_else(open) {
                    Some(conn) => {
                        if self.shared.meta.is_p2p() {
                            self.shared
                                .by_addr
                                .lock()
                                .insert(peer.to_string(), conn.peer.clone());
                        }
                        Ok(Segment { conn })
                    }
                    None => Err(Error::Refused { peer: name, why }),
                };
            }
            Err(e) => return open().map(|conn| Segment { conn }).ok_or(e),
        };
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
        let conn = self.shared.add_conn(conn, since);
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
        // Where this engine reaches the peer (not the address its descriptor claims).
        let mut s = control_stream(&self.shared, &seg.conn.probe_at.to_string())?;
        Msg::Hello {
            desc: self.shared.desc(),
            describe_only: true,
            token: self.shared.token(),
        }
        .send(&mut s)?;
        let t = self.shared.config.connect_timeout;
        match Msg::recv(&mut crate::wire::ByDeadline::new(&s, t))? {
            Msg::Desc(d) if d.name == seg.conn.peer => {
                // The paths were made for the peer's rails as they were: a descriptor
                // with other rails would name keys they cannot use.
                // (Whether a rail is in service may change; the rails may not.)
                let same = |a: &[RailDesc], b: &[RailDesc]| {
                    a.len() == b.len()
                        && a.iter().zip(b).all(|(x, y)| {
                            RailDesc {
                                closed: y.closed,
                                ..x.clone()
                            } == *y
                        })
                };
                if !same(&d.rails, &seg.conn.desc.read().rails) {
                    return Err(Error::Descriptor(format!(
                        "{}'s rails changed since its segment was opened; open it again",
                        seg.conn.peer
                    )));
                }
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
        if state.reqs.is_empty() {
            // Nothing to move: its notification (if any) has no peer to go to.
            crate::path::send_notifications(&self.shared, &state);
        } else {
            schedule(&self.shared, &state);
        }
        BatchHandle { state }
    }

    /// Sends a notification (at most [`MAX_NOTIFY`](crate::MAX_NOTIFY) bytes) to `seg`'s
    /// engine; it arrives after every request to that peer that completed before.
    pub fn notify(&self, seg: &Segment, msg: &[u8]) -> Result<BatchHandle> {
        let mut b = Batch::new();
        b.notify(msg)?;
        let state = b.into_state();
        let w = seg.conn.notification(msg.into(), Some(state.clone()));
        state.notifying(1);
        seg.conn.send_note(&self.shared, w);
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
        self.shared.meta.publish(&self.shared.desc());
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
        self.shared.meta.publish(&self.shared.desc());
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
