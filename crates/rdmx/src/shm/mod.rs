//! The shm provider: the RC engine over shared-memory rings, between processes of one
//! host (or within one process).
//!
//! Each connected queue pair has a segment of its own: an anonymous, size-sealed memfd
//! that the connecting side creates and passes to its peer, holding one lock-free
//! single-producer single-consumer ring per direction (`ring`). Packets are IBTA RC
//! packets, as on every software provider; a packet's headers and its payload go into the
//! ring with one copy from registered memory, and come out with one copy straight into
//! registered memory where the engine places it. Copies keep their speed for every
//! alignment pair (`copy`). The engine's acknowledgements, credits and RNR handling run
//! unchanged; the rings never lose or reorder a packet, so it never retransmits.
//!
//! ## Data paths
//!
//! - **direct** (the default between two contexts of one process): a packet whose
//!   payload in registered memory is 4 KiB or more goes into the ring as a descriptor
//!   (the payload's addresses and the lkeys of their regions), and the receiver, once its
//!   own engine has checked the packet's keys and resolved where the payload goes, looks
//!   the source up in the sender's key table and copies it with one memcpy. The lookup
//!   holds the source region for the copy, so a region deregistered meanwhile is never
//!   read (the pull fails, as below). [`Options::direct`] turns it off.
//!
//!   An RDMA WRITE or READ posted while nothing earlier is outstanding on its send queue
//!   (UC: and the peer has read every packet sent before) does not take the rings at
//!   all: the initiator executes it at post time. With both queue pairs locked, the
//!   target's engine checks the access exactly as its responder checks a request
//!   packet (state, access flags, rkey: protection domain, rights, bounds), the bytes
//!   go with one memcpy, and the request completes before the post returns. There is
//!   no handoff between threads: the target application never polls for a one-sided
//!   operation, so on the rings its engine runs on the progress thread, and the
//!   initiator waits for it. Requests behind an outstanding one, refused ones (so a
//!   bad key gets the responder's own answer, on both sides), SENDs, WRITEs with
//!   immediate data and atomics take the rings; neither engine's PSNs move. It counts
//!   in [`executed_at_post`]; [`Options::execute_at_post`] turns it off.
//! - **mapped** (opt-in on both sides, [`Options::mapped`] or
//!   `RDMX_SHM_DATA_PATH=mapped`; between processes, or two contexts of one): memory
//!   allocated with [`Mapping::shared`](rdmx_mem::Mapping::shared) (a memfd sealed at its
//!   size) and registered with remote access is published in the context's key table (a
//!   memfd only the context can write) and its memfd handed to the peers over the
//!   connection's socket; they map it. An RDMA WRITE or READ to such a region, posted
//!   when the engine would execute it at post time as on `direct`, is checked by the
//!   initiator against the target's key table and the target QP's word in the segment
//!   (state, type, access flags, protection domain, rkey rights and bounds, the mapped
//!   file's bounds), then copied with one memcpy through the initiator's mapping: no
//!   system call, no target thread. Anything refused takes the rings. Deregistration
//!   drains the peers' claims on the key, for at most [`DRAIN_BOUND`], then takes the
//!   memory back from a peer that still claims it (the target's view becomes a private
//!   copy). The protocol, and what it trusts, is described in full in the `mapped`
//!   module's source documentation (`src/shm/mapped.rs`). Plain memory is never
//!   published: its requests take the other paths.
//! - **ring** (the default between processes): every payload is copied into the ring
//!   and out of it (two copies, by the two sides at once).
//! - **cma** (opt-in on both sides, [`Options::cma`] or `RDMX_SHM_DATA_PATH=cma`): a
//!   packet whose payload in registered memory is 16 KiB or more goes into the ring as a
//!   descriptor (the payload's addresses in the sender), and the receiver, once its own
//!   engine has checked the packet's keys and resolved where the payload goes in its
//!   registered memory, copies it straight there with one `process_vm_readv`
//!   (cross-memory attach, as UCX's `cma` and libfabric's `shm` do).
//!   Each side only ever writes memory its own engine resolved: the target of a WRITE
//!   or SEND pulls from the initiator, the initiator of a READ pulls the response from
//!   the responder. A pull the kernel refuses (the descriptor names memory the peer does
//!   not have) fails the queue pair, logged; the packet's completions, if any, carry an
//!   error. Smaller payloads take the ring. It is not the default because on the hosts
//!   measured it was slower: `process_vm_readv` copied at most about 11 GB/s there
//!   (pinning the peer's pages costs more than the copy), while the ring, with both sides
//!   copying at once, moved 64 KiB WRITEs between two processes at 8.7-19.6 GB/s
//!   against 7.5-8.9 GB/s on cma (2 vCPU AMD EPYC VM). When other work crowds the cores
//!   it goes the other way, since a pull needs only the receiver to run while the ring
//!   needs both sides at once: under a load of 5 on those 2 vCPUs, 64 KiB WRITEs ran at
//!   2.9 GB/s on cma against 1.9 on the ring, 1 MiB WRITEs 4.9 against 1.8. It also
//!   spares the sender's CPU and caches.
//!
//! The kernel lets a process read another's memory only with ptrace permission: the
//! same user and `kernel.yama.ptrace_scope` 0, or more (`PR_SET_PTRACER`, privileges).
//! At connection setup each side names a word of its memory, and the other tries to read
//! it; a side that can raises a flag in the segment, and its peer sends it descriptors.
//! A side that cannot logs why (warning) and gets every payload through the ring.
//! [`data_path`] says which path a connected queue pair runs.
//!
//! ## Connection setup
//!
//! A context listens on a Unix socket in the abstract namespace, named after its process
//! and a random number; [`QueuePair::endpoint`](crate::QueuePair::endpoint) carries both
//! ([`PeerAddr::Unix`]) and the QP's random secret. Of two QPs being connected, the one with
//! the smaller (QP number, PSN) connects to the other's socket, checks with
//! `SO_PEERCRED` that the listener runs as the same user (or one in
//! [`Options::allowed_uids`]), and sends a hello (both QP
//! numbers, the secret of the QP it wants, the ring size) with the segment's memfd and
//! its context's wake-up eventfd. The listening side checks the peer's user, the secret
//! and the segment (size, seals), answers with its own eventfd, and closes its copy of
//! the memfd; a connection that fails any check is closed and logged. The socket stays
//! open: its end tells either side that the other has gone (exited, or was killed), and
//! the queue pair then goes to the error state with its requests flushed.
//!
//! ## UD
//!
//! UD queue pairs have no ring: each context also binds a Unix datagram socket in the
//! abstract namespace ([`ud_socket_name`], named like the listener), and a UD datagram,
//! one IBTA packet (BTH, DETH, immediate data, payload), goes to the socket of the
//! context its address handle names. An address handle names an shm context by a GID of
//! its random number and process id ([`shm_gid`](crate::shm_gid)); the datagram's QP
//! within it is the BTH's destination QPN. The receiving socket asks for every sender's
//! credentials (`SO_PASSCRED`): a datagram counts only from a process of this user (or
//! one in [`Options::allowed_uids`]) sent from a socket named as a context of that very
//! process, so the source GID in the GRH area is the sender's own. Malformed datagrams,
//! strangers' and those for QPs that do not exist are dropped and counted
//! ([`ud_stats`]); the engine drops (and counts per QP) a wrong Q_Key or no receive. The
//! kernel bounds each socket's queue; a send to a full one waits in a queue bounded by
//! [`MAX_QUEUED`] bytes for at most [`MAX_WAIT`], then is dropped, as a congested
//! network drops datagrams. The kernel copies each datagram in and out: the path is for
//! messages of up to the path MTU, not bulk data. There is no multicast on shm.
//!
//! ## Progress
//!
//! As on tcp, whoever polls makes progress: a poll of one of the context's CQs reads every
//! connected QP's incoming ring once. A progress thread takes over while nobody polls, so
//! one-sided operations complete while the target application does nothing: it spins
//! while there is work, then sleeps in `epoll_wait` after raising a flag in every segment;
//! a peer that puts a packet in (or frees room in) a ring whose reader sleeps writes its
//! eventfd.

mod copy;
pub use copy::copy_slice;
mod direct;
mod mapped;
mod setup;
#[cfg(feature = "testing")]
pub mod testing;
pub use mapped::DRAIN_BOUND;
mod qp;
mod ring;
mod sys;
mod ud;

pub use ud::{socket_name as ud_socket_name, UdStats, MAX_QUEUED, MAX_WAIT};

use std::any::Any;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};
use slab::Slab;

use qp::{Conn, Peer, ShmQp};
use rdmx_core::{Mtu, QpType};

use crate::endpoint::{PeerAddr, QpEndpoint};
use crate::provider::{self, Capabilities, CqCore, ProviderConfig};
use crate::soft::{self, Engine, Keys, SoftDevice, SoftQp, SoftSrq, Transport};
use crate::{Error, Result};

/// The provider's name.
pub const NAME: &str = "shm";
const DEVICE: &str = "shm0";

/// How a connected shm queue pair moves payloads: `"direct"` (its peer is in this
/// process; large payloads with one memcpy), `"mapped"` (both sides map the other's
/// memfd-backed regions: WRITEs and READs to them with one memcpy by the initiator,
/// everything else through the rings, or by cma where both asked for it), `"cma"` (large payloads with one
/// kernel copy, in both directions), `"ring"` (every payload through the rings),
/// `"cma+ring"` (only one side can copy out of the other); `None` for a queue pair of
/// another provider, or one without its connection yet.
pub fn data_path(qp: &crate::QueuePair) -> Option<&'static str> {
    let link = qp.provider_qp().as_any().downcast_ref::<SoftQp<Link>>()?;
    let g = link.transport.qp.inner.lock();
    g.conn.as_ref().map(qp::Conn::data_path)
}

/// Whether context `ctx` runs the `mapped` data path ([`Options::mapped`]): memory
/// registered on it with remote access that is memfd-backed
/// ([`Mapping::shared`](rdmx_mem::Mapping::shared)) is mapped by its peers; `None` for a
/// context of another provider.
pub fn maps_memory(ctx: &crate::Context) -> Option<bool> {
    let d = ctx.device().as_any().downcast_ref::<Device>()?;
    Some(d.driver.published.is_some())
}

/// How many send requests of `qp` its initiator executed at post time, with one memcpy
/// between the two contexts' registered memory (the `direct` data path's shortcut for
/// WRITEs and READs; see the [module docs](self)); `None` for a queue pair of another
/// provider.
pub fn executed_at_post(qp: &crate::QueuePair) -> Option<u64> {
    let link = qp.provider_qp().as_any().downcast_ref::<SoftQp<Link>>()?;
    let n = link.transport.qp.inner.lock().executed_at_post;
    Some(n)
}

/// How to open an shm context.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Options {
    /// Bytes of each ring (a power of two, 64 KiB to 1 GiB; default 4 MiB). The largest
    /// path MTU is a quarter of it.
    pub ring_bytes: usize,
    /// Copy large payloads straight between the processes' registered memory when the
    /// kernel allows it (the `cma` data path; see the [module docs](self)); both sides
    /// must ask for it. Default: off (the ring was faster where measured), unless the
    /// environment has `RDMX_SHM_DATA_PATH=cma`.
    pub cma: bool,
    /// Between two contexts of this process, copy payloads of 4 KiB or more once,
    /// straight from the sender's registered memory into the receiver's (the `direct`
    /// data path); both contexts must allow it. Default: on, unless the environment has
    /// `RDMX_SHM_DATA_PATH=ring`, `=cma` or `=mapped`.
    pub direct: bool,
    /// On the `direct` data path, let the initiator of an RDMA WRITE or READ execute it
    /// when it is posted, if nothing earlier on its send queue is outstanding: it checks
    /// the target queue pair and key as the target would and copies with one memcpy,
    /// with no handoff to another thread (see the [module docs](self)). Default: on.
    pub execute_at_post: bool,
    /// Between processes, let the initiator of an RDMA WRITE or READ execute it at post
    /// time with one memcpy into or out of the target's memory, which it maps, when that
    /// memory is memfd-backed ([`Mapping::shared`](rdmx_mem::Mapping::shared)) and
    /// registered with remote access (the `mapped` data path; see the [module
    /// docs](self)); both sides must ask for it. It
    /// takes the place of `direct` between contexts of one process. Default: off,
    /// unless the environment has `RDMX_SHM_DATA_PATH=mapped`.
    pub mapped: bool,
    /// Users, besides this process's own, whose processes may connect to this context
    /// and whose contexts this one connects to (checked with `SO_PEERCRED` on the socket
    /// both ways). Default: none.
    pub allowed_uids: Vec<u32>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            ring_bytes: 4 << 20,
            cma: std::env::var_os("RDMX_SHM_DATA_PATH").is_some_and(|v| v == "cma"),
            direct: !std::env::var_os("RDMX_SHM_DATA_PATH")
                .is_some_and(|v| v == "ring" || v == "cma" || v == "mapped"),
            execute_at_post: true,
            mapped: std::env::var_os("RDMX_SHM_DATA_PATH").is_some_and(|v| v == "mapped"),
            allowed_uids: Vec::new(),
        }
    }
}

impl Options {
    /// Sets [`ring_bytes`](Self::ring_bytes).
    pub fn ring_bytes(mut self, n: usize) -> Self {
        self.ring_bytes = n;
        self
    }

    /// Sets [`cma`](Self::cma).
    pub fn cma(mut self, on: bool) -> Self {
        self.cma = on;
        self
    }

    /// Adds `uid` to [`allowed_uids`](Self::allowed_uids).
    pub fn allow_uid(mut self, uid: u32) -> Self {
        self.allowed_uids.push(uid);
        self
    }

    /// Sets [`direct`](Self::direct).
    pub fn direct(mut self, on: bool) -> Self {
        self.direct = on;
        self
    }

    /// Sets [`mapped`](Self::mapped).
    pub fn mapped(mut self, on: bool) -> Self {
        self.mapped = on;
        self
    }

    /// Sets [`execute_at_post`](Self::execute_at_post).
    pub fn execute_at_post(mut self, on: bool) -> Self {
        self.execute_at_post = on;
        self
    }
}

impl From<Options> for ProviderConfig {
    fn from(opts: Options) -> ProviderConfig {
        ProviderConfig::new(NAME, move || {
            Ok(Arc::new(Device::open(&opts)?) as Arc<dyn provider::Device>)
        })
    }
}

/// The provider as the registry lists it.
pub(crate) const ENTRY: provider::Entry = provider::Entry {
    name: NAME,
    devices: || {
        vec![provider::DeviceInfo {
            provider: NAME,
            name: DEVICE.to_string(),
            capabilities: caps(Options::default().ring_bytes),
            gid: None,
        }]
    },
    open: |device| {
        if let Some(d) = device.filter(|&d| d != DEVICE) {
            return Err(Error::NoDevice(format!(
                "provider {NAME} has no device {d}; its device is {DEVICE}"
            )));
        }
        ProviderConfig::from(Options::default()).open()
    },
};

/// The path MTU shm connections use unless told otherwise.
const ACTIVE_MTU: u32 = 1 << 16;

fn max_mtu(ring_bytes: usize) -> u32 {
    (ring_bytes / 4).min(1 << 20) as u32
}

fn limits(ring_bytes: usize) -> rdmx_core::QpLimits {
    soft::limits(Mtu::Bytes(max_mtu(ring_bytes)))
}

fn active_mtu(ring_bytes: usize) -> u32 {
    ACTIVE_MTU.min(max_mtu(ring_bytes))
}

fn caps(ring_bytes: usize) -> Capabilities {
    let mut caps = soft::capabilities(&limits(ring_bytes), Mtu::Bytes(active_mtu(ring_bytes)));
    // Datagrams go through each context's datagram socket (`ud`); no multicast.
    caps.ud = true;
    caps
}

/// What an shm context's UD datagram socket received, sent and dropped so far; `None`
/// for a context of another provider.
pub fn ud_stats(ctx: &crate::Context) -> Option<UdStats> {
    let d = ctx.device().as_any().downcast_ref::<Device>()?;
    Some(d.driver.ud.stats())
}

/// An shm device: a key table and a driver.
#[derive(Debug)]
struct Device {
    keys: Arc<Keys>,
    caps: Capabilities,
    ring_bytes: usize,
    driver: Arc<Driver>,
}

impl Device {
    fn open(opts: &Options) -> Result<Device> {
        let ring_bytes = opts.ring_bytes;
        if !ring_bytes.is_power_of_two() || !(64 << 10..=1 << 30).contains(&ring_bytes) {
            return Err(Error::InvalidArgument(
                "shm ring_bytes must be a power of two from 64 KiB to 1 GiB",
            ));
        }
        let seed = soft::seed()?;
        let keys = Arc::new(Keys::new(seed));
        let driver = Driver::start(seed, opts)?;
        if opts.direct && !opts.mapped {
            local_devices().push((driver.id, Arc::downgrade(&keys), Arc::downgrade(&driver)));
        }
        Ok(Device {
            keys,
            caps: caps(ring_bytes),
            ring_bytes,
            driver,
        })
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        local_devices().retain(|(id, ..)| *id != self.driver.id);
        self.driver.shutdown();
    }
}

/// This process's shm contexts that copy directly, by context id: their key tables and
/// drivers. A queue pair whose peer is in this process copies payloads straight out of
/// the peer's registered memory (the `direct` data path), finding it through the peer's
/// table, and finds the peer queue pair through its driver.
type LocalDevices = Vec<(u32, Weak<Keys>, Weak<Driver>)>;

fn local_devices() -> std::sync::MutexGuard<'static, LocalDevices> {
    static LOCAL: std::sync::Mutex<LocalDevices> = std::sync::Mutex::new(Vec::new());
    LOCAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The key table of context `id` of process `pid`, and its queue pair `qpn`, if that
/// process is this one and both contexts copy directly (`direct` is this context's
/// option).
fn local_peer(
    direct: bool,
    pid: i32,
    id: u32,
    qpn: u32,
) -> (Option<Arc<Keys>>, Option<Weak<ShmQp>>) {
    if !direct || u32::try_from(pid).ok() != Some(std::process::id()) {
        return (None, None);
    }
    let found = local_devices()
        .iter()
        .find(|(i, ..)| *i == id)
        .and_then(|(_, k, d)| Some((k.upgrade()?, d.upgrade()?)));
    let Some((keys, driver)) = found else {
        return (None, None);
    };
    let token = driver.by_qpn.lock().get(&qpn).copied();
    let qp = token.and_then(|t| driver.qps.lock().get(t).cloned());
    (Some(keys), qp)
}

impl SoftDevice for Device {
    const PROVIDER: &'static str = NAME;
    const DEVICE: &'static str = DEVICE;
    const AFTER_SRQ_POST: fn() = || {};
    fn keys(&self) -> &Arc<Keys> {
        &self.keys
    }
    fn caps(&self) -> &Capabilities {
        &self.caps
    }
    fn address(&self) -> PeerAddr {
        self.driver.addr()
    }
    fn create_cq(&self, _core: &Arc<CqCore>) -> Result<Box<dyn provider::Cq>> {
        Ok(Box::new(Cq {
            driver: self.driver.clone(),
        }))
    }
    fn registered(&self, mr: &Arc<provider::MrShared>) {
        self.driver.published(mr);
    }
    fn deregistering(&self, mr: &provider::MrShared) {
        self.driver.unpublish(mr);
    }
    fn create_qp(&self, init: provider::QpInit<'_>) -> Result<Box<dyn provider::Qp>> {
        let srq = SoftSrq::of(init.srq)?;
        let qpn = self.driver.alloc_qpn();
        if init.qp_type == QpType::Ud {
            // A UD message is at most the active path MTU: one datagram.
            let cfg = soft::config(&init, qpn);
            let engine = Engine::new(cfg, soft::limits(Mtu::Bytes(active_mtu(self.ring_bytes))));
            let qp = Arc::new(ud::UdQp::new(
                qpn,
                self.driver.ud.clone(),
                engine,
                self.keys.clone(),
                (init.send_cq.core.clone(), init.recv_cq.core.clone()),
                srq,
            ));
            self.driver.ud.add(qp.clone());
            return Ok(Box::new(SoftQp {
                qpn,
                transport: UdLink {
                    qp,
                    addr: self.driver.addr(),
                },
            }));
        }
        let mut cfg = soft::config(&init, qpn);
        // The rings deliver every packet once and in order, or the connection fails.
        soft::reliable_link(&mut cfg);
        let engine = Engine::new(cfg, limits(self.ring_bytes));
        let qp = self.driver.add_qp(|token| {
            ShmQp::new(
                qpn,
                init.secret,
                token,
                self.driver.clone(),
                engine,
                self.keys.clone(),
                (init.send_cq.core.clone(), init.recv_cq.core.clone()),
                srq,
            )
        });
        qp.inner.lock().my_psn = init.psn;
        Ok(Box::new(SoftQp {
            qpn,
            transport: Link {
                qp,
                ring_bytes: self.ring_bytes,
            },
        }))
    }
}

/// An shm CQ: every poll runs the driver once.
#[derive(Debug)]
struct Cq {
    driver: Arc<Driver>,
}

impl provider::Cq for Cq {
    fn progress(&self, _core: &CqCore) -> Result<()> {
        self.driver.app_progress();
        Ok(())
    }
    fn idle(&self) {
        self.driver.idle();
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// An shm QP as the software host sees it.
#[derive(Debug)]
struct Link {
    qp: Arc<ShmQp>,
    ring_bytes: usize,
}

impl Transport for Link {
    fn with<T>(&self, f: impl FnOnce(&mut Engine, &Keys) -> T) -> T {
        self.qp.with(|i| f(&mut i.engine, &i.keys))
    }
    fn post_send(&self, wr: &rdmx_core::SendWr, inline: Option<&[u8]>) -> Result<()> {
        direct::post_send(&self.qp, wr, inline)
    }
    fn post_send_list(
        &self,
        wrs: &mut dyn Iterator<Item = (&rdmx_core::SendWr, Option<&[u8]>)>,
    ) -> std::result::Result<(), (usize, Error)> {
        direct::post_send_list(&self.qp, wrs)
    }
    fn entered_rtr(&self) -> Result<()> {
        self.qp.driver.establish(&self.qp, self.ring_bytes)
    }
    fn address(&self) -> PeerAddr {
        self.qp.driver.addr()
    }
    fn bind_peer(&self, peer: &QpEndpoint, timeout: Duration) -> Result<()> {
        let PeerAddr::Unix { pid, id } = peer.addr else {
            return Err(Error::InvalidArgument(
                "an shm peer endpoint needs the Unix address of its context",
            ));
        };
        let mut g = self.qp.inner.lock();
        g.peer = Some(Peer {
            pid,
            dev: id,
            qpn: peer.qp_num,
            psn: peer.psn,
            secret: peer.secret,
        });
        g.connect_timeout = timeout;
        Ok(())
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.qp.driver.remove_qp(&self.qp);
    }
}

/// A UD shm QP as the software host sees it: it has no connection, and sends through its
/// context's datagram socket.
#[derive(Debug)]
struct UdLink {
    qp: Arc<ud::UdQp>,
    addr: PeerAddr,
}

impl Transport for UdLink {
    fn with<T>(&self, f: impl FnOnce(&mut Engine, &Keys) -> T) -> T {
        self.qp.with(|i| f(&mut i.engine, &i.keys))
    }
    fn address(&self) -> PeerAddr {
        self.addr
    }
}

impl Drop for UdLink {
    fn drop(&mut self) {
        self.qp.port.remove(self.qp.qpn);
    }
}

const EVENT: u64 = 0;
const LISTENER: u64 = 1;
/// The datagram socket's token (QP and handshake tokens count up from 2).
const UD: u64 = u64::MAX;
/// The progress thread leaves the rings to an application that polled this recently.
const HANDOVER: Duration = Duration::from_millis(1);
/// The progress thread spins this long after the last work before it sleeps. Waking it
/// costs a peer a system call and the packet tens of microseconds, so it stays up through
/// the gaps of a busy stream (measured: 8-byte WRITEs ran 7× faster with 2 ms than with
/// 50 µs on two cores).
const SPIN: Duration = Duration::from_millis(1);
/// The spinning progress thread reads the clock once every this many idle rounds.
const CLOCK_EVERY: u32 = 64;
/// An application's poll looks at the sockets (peers gone, new connections) every this
/// many rounds.
const EPOLL_EVERY: u32 = 64;
/// Connections parked for a QP that has not reached RTR are closed after this long...
const PARKED_TIMEOUT: Duration = Duration::from_secs(60);
/// ... and connections that sent no hello after this long.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

fn qp_token(idx: usize) -> u64 {
    2 + 2 * idx as u64
}

fn hs_token(idx: usize) -> u64 {
    3 + 2 * idx as u64
}

/// The abstract socket name of device `id` of process `pid`.
fn socket_name(pid: u32, id: u32) -> String {
    format!("rdmx-shm.{pid}.{id:08x}")
}

/// A connection whose QP does not expect it yet.
struct Parked {
    conn: Conn,
    from: u32,
    since: Instant,
}

/// A context's listener, connections, timers and progress thread.
pub(crate) struct Driver {
    epoll: sys::Epoll,
    listener: UnixListener,
    pid: u32,
    id: u32,
    /// Peers write this to wake the progress thread.
    event: OwnedFd,
    qps: Mutex<Slab<Weak<ShmQp>>>,
    by_qpn: Mutex<HashMap<u32, usize>>,
    /// QPs with a connection: what a round reads.
    active: RwLock<Vec<Arc<ShmQp>>>,
    pending: Mutex<HashMap<u32, Parked>>,
    handshakes: Mutex<Slab<(UnixStream, Instant)>>,
    timers: Mutex<BinaryHeap<Reverse<(Instant, usize)>>>,
    /// Held by whoever runs a round.
    running: Mutex<()>,
    /// The progress thread sleeps in `epoll_wait`.
    sleeping: AtomicBool,
    rounds: AtomicU32,
    /// When an application last polled, in nanoseconds after `epoch` (0: not polling).
    app_polled: AtomicU64,
    epoch: Instant,
    nap: (Mutex<()>, Condvar),
    stop: AtomicBool,
    next_qpn: AtomicU32,
    /// Copy large payloads out of peers' memory where the kernel allows it.
    cma: bool,
    /// Copy payloads straight out of the memory of peers in this process.
    direct: bool,
    /// Execute WRITEs and READs to peers in this process at post time.
    execute_at_post: bool,
    /// Other users whose processes may be peers.
    allowed_uids: Vec<u32>,
    /// The key table of the `mapped` data path, when this context runs it.
    published: Option<mapped::Published>,
    /// Connections whose peers may claim this context's keys (`mapped`).
    watch: Mutex<Vec<mapped::Watch>>,
    /// The datagram socket of UD queue pairs.
    ud: Arc<ud::Port>,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("shm::Driver")
            .field("pid", &self.pid)
            .field("id", &self.id)
            .finish()
    }
}

impl Driver {
    fn start(seed: u64, opts: &Options) -> Result<Arc<Driver>> {
        let pid = std::process::id();
        let epoll = sys::Epoll::new().map_err(|e| Error::Io("epoll_create", e))?;
        let event = sys::eventfd().map_err(|e| Error::Io("eventfd", e))?;
        // A random name: nobody can guess it to squat it before the context binds, and
        // a second context of the process gets its own.
        let (listener, id) = loop {
            let id = soft::seed()? as u32 ^ (seed >> 32) as u32;
            let addr = UnixAddr::from_abstract_name(socket_name(pid, id))
                .map_err(|e| Error::Io("socket name", e))?;
            match UnixListener::bind_addr(&addr) {
                Ok(l) => break (l, id),
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => continue,
                Err(e) => return Err(Error::Io("bind the shm socket", e)),
            }
        };
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::Io("O_NONBLOCK", e))?;
        epoll
            .add(event.as_raw_fd(), EVENT)
            .map_err(|e| Error::Io("epoll_ctl", e))?;
        epoll
            .add(listener.as_raw_fd(), LISTENER)
            .map_err(|e| Error::Io("epoll_ctl", e))?;
        let ud = ud::Port::bind(
            pid,
            id,
            active_mtu(opts.ring_bytes) as usize,
            opts.allowed_uids.clone(),
        )?;
        epoll
            .add(ud.fd(), UD)
            .map_err(|e| Error::Io("epoll_ctl", e))?;
        let driver = Arc::new(Driver {
            epoll,
            listener,
            pid,
            id,
            event,
            qps: Mutex::new(Slab::new()),
            by_qpn: Mutex::new(HashMap::new()),
            active: RwLock::new(Vec::new()),
            pending: Mutex::new(HashMap::new()),
            handshakes: Mutex::new(Slab::new()),
            timers: Mutex::new(BinaryHeap::new()),
            running: Mutex::new(()),
            sleeping: AtomicBool::new(false),
            rounds: AtomicU32::new(0),
            app_polled: AtomicU64::new(0),
            epoch: Instant::now(),
            nap: (Mutex::new(()), Condvar::new()),
            stop: AtomicBool::new(false),
            // QP numbers 0 and 1 are special in InfiniBand.
            next_qpn: AtomicU32::new(((seed as u32) & 0x7f_ffff) | 0x10),
            cma: opts.cma,
            // The mapped path takes the place of `direct` (it runs in one process too).
            direct: opts.direct && !opts.mapped,
            execute_at_post: opts.execute_at_post,
            allowed_uids: opts.allowed_uids.clone(),
            published: if opts.mapped {
                Some(
                    mapped::Published::new()
                        .map_err(|e| Error::Io("create the shm key table", e))?,
                )
            } else {
                None
            },
            watch: Mutex::new(Vec::new()),
            ud: Arc::new(ud),
        });
        let d = Arc::downgrade(&driver);
        std::thread::Builder::new()
            .name("rdmx-shm".into())
            .spawn(move || Driver::run_thread(d))
            .map_err(|e| Error::Io("spawn the progress thread", e))?;
        Ok(driver)
    }

    fn addr(&self) -> PeerAddr {
        PeerAddr::Unix {
            pid: self.pid,
            id: self.id,
        }
    }

    fn shutdown(&self) {
        self.stop.store(true, Ordering::SeqCst);
        sys::signal(self.event.as_raw_fd());
        let _g = self.nap.0.lock();
        self.nap.1.notify_all();
    }

    fn alloc_qpn(&self) -> u32 {
        self.next_qpn.fetch_add(1, Ordering::Relaxed) & 0xff_ffff
    }

    fn add_qp(&self, make: impl FnOnce(usize) -> ShmQp) -> Arc<ShmQp> {
        let mut qps = self.qps.lock();
        let entry = qps.vacant_entry();
        let qp = Arc::new(make(entry.key()));
        entry.insert(Arc::downgrade(&qp));
        self.by_qpn.lock().insert(qp.qpn, qp.token);
        qp
    }

    fn remove_qp(&self, qp: &ShmQp) {
        self.active.write().retain(|q| q.token != qp.token);
        self.qps.lock().try_remove(qp.token);
        self.by_qpn.lock().remove(&qp.qpn);
        self.pending.lock().remove(&qp.qpn);
        // Closes the connection (the peer sees its socket end).
        let conn = qp.inner.lock().conn.take();
        if let Some(c) = conn {
            self.epoll.remove(c.sock.as_raw_fd());
        }
    }

    /// `qp` has its connection: rounds read it from now on.
    fn activate(&self, qp: &ShmQp) {
        let arc = self.qps.lock().get(qp.token).and_then(Weak::upgrade);
        if let Some(arc) = arc {
            let mut active = self.active.write();
            if !active.iter().any(|q| q.token == qp.token) {
                active.push(arc);
            }
        }
    }

    /// Asks for [`ShmQp::timeout`] on QP `token` at `at`.
    fn schedule(&self, at: Instant, token: usize) {
        let mut t = self.timers.lock();
        let earlier = t.peek().map_or(true, |Reverse((first, _))| at < *first);
        t.push(Reverse((at, token)));
        drop(t);
        if earlier && self.sleeping.load(Ordering::SeqCst) {
            // The sleeping thread must wait less.
            sys::signal(self.event.as_raw_fd());
        }
    }

    /// The progress thread: runs rounds while no application polls, spins a little after
    /// the last work, then sleeps until a peer, a socket or a timer wakes it.
    fn run_thread(me: Weak<Driver>) {
        let mut last_work = Instant::now();
        // The time rounds run with: read again after work, and every CLOCK_EVERY idle
        // rounds (a spin that reads the clock every round spends its time there).
        let mut now = last_work;
        let mut idle = 0u32;
        let mut events = Vec::new();
        loop {
            let Some(d) = me.upgrade() else { return };
            if d.stop.load(Ordering::SeqCst) {
                return;
            }
            if let Some(until) = d.app_polling_until() {
                let mut g = d.nap.0.lock();
                if !d.stop.load(Ordering::SeqCst) && d.app_polling_until().is_some() {
                    d.nap.1.wait_until(&mut g, until);
                }
                now = Instant::now();
                continue;
            }
            let Some(guard) = d.running.try_lock() else {
                std::thread::yield_now();
                now = Instant::now();
                continue;
            };
            let mut moved = d.round(now);
            let n = d.rounds.fetch_add(1, Ordering::Relaxed);
            if n % EPOLL_EVERY == 0 {
                events.clear();
                d.epoll.wait(Some(Duration::ZERO), &mut events);
                moved |= !events.is_empty();
                d.handle_events(&events);
            }
            if moved {
                now = Instant::now();
                last_work = now;
                idle = 0;
                continue;
            }
            idle = idle.wrapping_add(1);
            if idle % CLOCK_EVERY != 0 {
                drop(guard);
                std::hint::spin_loop();
                continue;
            }
            now = Instant::now();
            if now.duration_since(last_work) < SPIN {
                drop(guard);
                std::hint::spin_loop();
                continue;
            }
            // Sleep: raise the flags, look once more, then wait.
            let active = d.active.read().clone();
            for q in &active {
                q.inner.lock().set_asleep(true);
            }
            d.sleeping.store(true, Ordering::SeqCst);
            let ready = active.iter().any(|q| q.inner.lock().ready()) || d.ud.backlogged();
            if !ready {
                // Read after `sleeping` is raised: a timer scheduled later signals.
                let next = d.timers.lock().peek().map(|Reverse((t, _))| *t);
                let wait = next.map_or(Duration::from_millis(100), |t| {
                    t.saturating_duration_since(Instant::now())
                        .min(Duration::from_millis(100))
                });
                drop(guard);
                events.clear();
                d.epoll.wait(Some(wait), &mut events);
                d.sleeping.store(false, Ordering::SeqCst);
                for q in &active {
                    q.inner.lock().set_asleep(false);
                }
                let _guard = d.running.lock();
                d.handle_events(&events);
            } else {
                d.sleeping.store(false, Ordering::SeqCst);
                for q in &active {
                    q.inner.lock().set_asleep(false);
                }
            }
            now = Instant::now();
            last_work = now;
        }
    }

    /// One pass over every connected QP and the due timers. Returns whether anything
    /// moved. The caller holds `running`.
    fn round(&self, now: Instant) -> bool {
        let mut moved = false;
        {
            let active = self.active.read();
            for q in active.iter() {
                if let Some(mut g) = q.inner.try_lock() {
                    moved |= q.progress(&mut g, now);
                }
            }
        }
        if self.ud.in_use() {
            moved |= self.ud.progress(now);
        }
        moved | self.fire_timers(now)
    }

    fn fire_timers(&self, now: Instant) -> bool {
        let mut fired = false;
        loop {
            let token = {
                let mut t = self.timers.lock();
                match t.peek() {
                    Some(Reverse((at, token))) if *at <= now => {
                        let token = *token;
                        t.pop();
                        token
                    }
                    _ => break,
                }
            };
            fired = true;
            let qp = self.qps.lock().get(token).and_then(Weak::upgrade);
            if let Some(qp) = qp {
                let mut g = qp.inner.lock();
                qp.timeout(&mut g, now);
            }
        }
        fired
    }

    fn handle_events(&self, events: &[u64]) {
        for &ev in events {
            match ev {
                EVENT => sys::drain(self.event.as_raw_fd()),
                LISTENER => self.accept(),
                UD => {
                    self.ud.progress(Instant::now());
                }
                t if t % 2 == 0 => {
                    let qp = self
                        .qps
                        .lock()
                        .get(((t - 2) / 2) as usize)
                        .and_then(Weak::upgrade);
                    if let Some(qp) = qp {
                        let mut g = qp.inner.lock();
                        let hung_up = g.conn.as_ref().is_some_and(|c| sys::hung_up(&c.sock));
                        let mut gone = hung_up;
                        if let Some(Conn {
                            sock,
                            mapped: Some(view),
                            ..
                        }) = g.conn.as_mut()
                        {
                            // Files the peer hands over, or takes back (`mapped`).
                            if let Err(e) = view.receive(sock) {
                                if !gone {
                                    tracing::warn!(qpn = qp.qpn, "shm mapped: {e}");
                                }
                                gone = true;
                            }
                        }
                        if gone {
                            if let Some(c) = g.conn.as_ref().filter(|_| hung_up) {
                                // (Not a peer that broke the rules: it may still copy.)
                                c.peer_gone.store(true, Ordering::SeqCst);
                            }
                            // Whatever the peer managed to put in the ring first counts.
                            qp.progress(&mut g, Instant::now());
                            if let Some(c) = g.conn.as_ref() {
                                self.epoll.remove(c.sock.as_raw_fd());
                            }
                            g.fail_as(
                                qp.qpn,
                                "the peer closed its connection (it exited or was killed)",
                                tracing::Level::DEBUG,
                            );
                        }
                    }
                }
                t => self.handshake(((t - 3) / 2) as usize),
            }
        }
        self.expire();
    }

    /// Until when the progress thread leaves the rings to polling applications.
    fn app_polling_until(&self) -> Option<Instant> {
        let at = self.app_polled.load(Ordering::SeqCst);
        if at == 0 {
            return None;
        }
        let until = self.epoch + Duration::from_nanos(at) + HANDOVER;
        (Instant::now() < until).then_some(until)
    }

    /// An application polls: records it and runs a round if nobody else is.
    fn app_progress(&self) {
        let now = Instant::now();
        let now_ns = now.duration_since(self.epoch).as_nanos() as u64 | 1;
        if self.app_polled.load(Ordering::Relaxed) != now_ns {
            self.app_polled.store(now_ns, Ordering::SeqCst);
        }
        if let Some(_g) = self.running.try_lock() {
            self.round(now);
            if self.rounds.fetch_add(1, Ordering::Relaxed) % EPOLL_EVERY == 0 {
                let mut events = Vec::new();
                self.epoll.wait(Some(Duration::ZERO), &mut events);
                self.handle_events(&events);
            }
        }
    }

    /// An application stops polling: the progress thread resumes at once.
    fn idle(&self) {
        if self.app_polled.swap(0, Ordering::SeqCst) == 0 {
            return;
        }
        let _g = self.nap.0.lock();
        self.nap.1.notify_all();
    }
}
