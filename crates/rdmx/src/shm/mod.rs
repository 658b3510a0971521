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
//!   read (the pull fails, as below). [`Options::direct`] turns it off. UC payloads
//!   always take the ring, here and on `cma`: a UC request completes when sent, and its
//!   memory may be written again before the peer would copy it (for the same reason a
//!   UC packet that waits for room in the ring has its payload copied out first).
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
//! On `cma` and `direct`, a side copies out of its peer's memory only between raising its
//! copying flag in the segment and lowering it, and only while the peer has not said it
//! is gone. Destroying a queue pair says so, then waits until the peer copies nothing
//! out of its memory (for [`DRAIN_BOUND`] at most, then warns), so the memory of its
//! requests in flight may be used again when the drop returns: a descriptor the peer had
//! not taken yet fails the peer's queue pair instead of delivering the bytes of the
//! memory's next use.
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
//! numbers, the secret of the QP it wants, the ring size) with the segment's memfd. The
//! listening side checks the peer's user, the secret and the segment (size, seals, rings
//! of at least 64 KiB; rings too small for its path MTU fail the QP), answers, and
//! closes its copy of the memfd; a connection that fails any check is closed and logged.
//! The socket stays open: its end tells either side that the other has gone (exited, or
//! was killed), and the queue pair then goes to the error state with its requests
//! flushed. It carries the wake-ups (below) and, on the `mapped` path, files; anything
//! else a peer writes there fails the queue pair. Neither side ever writes to a
//! descriptor the other holds: one a peer shares can be made to block (its mode belongs
//! to the peer too, and an eventfd or pipe it fills blocks a writer), while a send on
//! one's own socket end with `MSG_DONTWAIT` never waits.
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
//! a peer that puts a packet in (or frees room in) a ring whose reader sleeps sends a
//! wake-up on the connection's socket, which that reader's epoll watches. A poll reads the
//! same sockets now and then: when it took something while the thread sleeps, it signals
//! the thread, as a queue pair that connects then does (the thread raised no flag for it),
//! so that the thread goes back to sleep with every flag raised.

pub use crate::provider::copy::{copy_method, copy_slice, large_copy_method, mid_copy_method};
mod desc;
mod direct;
mod driver;
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
use std::sync::{Arc, Weak};
use std::time::Duration;

use driver::{hs_token, qp_token, socket_name, Driver, HANDSHAKE_TIMEOUT};
use qp::{Peer, ShmQp};
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

/// Waits until `done` says so, for at most `bound`: spinning at first, then checking
/// every 50 µs. Returns whether `done` said so in time.
fn wait_bounded(bound: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + bound;
    let mut spins = 0u32;
    loop {
        if done() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        spins += 1;
        if spins < 1000 {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// The smallest rings a context makes ([`Options::ring_bytes`]).
const MIN_RING: usize = 64 << 10;

/// The largest path MTU rings of `ring_bytes` carry (a record may take half a ring).
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
        if !ring_bytes.is_power_of_two() || !(MIN_RING..=1 << 30).contains(&ring_bytes) {
            return Err(Error::InvalidArgument(
                "shm ring_bytes must be a power of two from 64 KiB to 1 GiB",
            ));
        }
        crate::provider::copy::calibrate();
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
    fn deregistered(&self, mr: &Arc<provider::MrShared>) {
        if self.keys().lent_out() {
            self.driver.wait_for_borrowers();
        }
        self.driver.unpublished(mr);
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

/// An shm CQ: a poll runs the driver once (when what is queued does not fill it).
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
    fn post_recv(&self, wr: &rdmx_core::RecvWr) -> Result<()> {
        self.qp.with_quiet(|i| i.post_recv(wr))
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
    fn rekey(&self, psn: u32, secret: u64) {
        self.qp.driver.rekey(&self.qp, psn, secret);
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
    fn quiesce(&self) -> bool {
        // (The drop that follows finds nothing more to do.)
        self.qp.driver.remove_qp(&self.qp)
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
