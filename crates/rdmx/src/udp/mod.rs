//! The udp provider: the RC engine on UDP sockets as IBTA RoCEv2, a peer of Linux
//! Soft-RoCE (rxe) and of RoCE adapters.
//!
//! Every packet is one datagram to UDP port 4791 ([`ROCE_PORT`]): the BTH and extension
//! headers as the engine makes them, the payload, the pad to 4 bytes, and the invariant CRC
//! ([`icrc`], computed as rxe does). A context binds one socket to one address (port 4791
//! unless told otherwise, [`Options::bind`]); all its queue pairs share it, and a datagram
//! goes to the QP its BTH names. The path MTU is 256 to 4096 bytes, the smaller of both
//! sides' offers (the endpoint carries each side's).
//!
//! ## What a datagram must pass
//!
//! Before its packet reaches the engine, a datagram must have a plausible length, a
//! correct ICRC (unless [`Options::verify_icrc`] is off), an RC, UC or UD SEND opcode,
//! transport version 0 and the default partition; name a QP of this context; come from the
//! exact address and port of the peer that QP was connected to (not for a UD QP, which has
//! no peer: any source, its Q_Key checked by the engine); and find the QP in RTR, RTS or
//! SQD. Anything
//! else is dropped and counted ([`stats`]). A peer named by its GID is a RoCE port (verbs:
//! Linux rxe, an adapter), which may send from any source port (rxe picks one per QP):
//! only its address is compared. An rdmx peer, named by its address and port, sends from
//! its socket's port, which must match. No state is kept for strangers, so a flood
//! costs only the time to look at it. The engine then checks PSNs, keys and bounds as on
//! every provider.
//!
//! RoCEv2 has no field for the endpoint's connection secret: a queue pair is protected by
//! the peer address and port it was bound to and by its random first PSN, as an RDMA
//! adapter's would be. A process on the peer's host can send from the peer's address, and
//! with a RoCE peer (any source port) from any port of it; a privileged one can send from
//! the peer's very port, as it can to an adapter.
//!
//! ## Reliability and pacing
//!
//! Loss, duplication and reordering are the engine's to recover from (retransmission on
//! the ACK timer, PSN-sequence NAKs, RNR waits). So that a burst does not overrun the
//! peer's socket buffer, the requester keeps at most [`Options::send_window`] packets
//! unacknowledged and asks for an ACK every quarter window.
//!
//! ## UD and multicast
//!
//! A UD datagram goes to port 4791 of the address its address handle's GID names (an
//! IPv4-mapped GID is an IPv4 address, as rxe's `rdma_gid2ip` reads it), from the
//! context's socket; what arrives for a UD QP is checked as above and handed to its engine
//! with the source and destination addresses for the GRH area, which over IPv4 gets what
//! rxe writes there (20 zero bytes, then the IPv4 header, rebuilt: identification 0 and TTL
//! 64 stand for what the socket does not show). An IPv4 context joins IPv4 multicast groups
//! (IPv4-mapped GIDs of 224.0.0.0/4): the first of its QPs to attach opens a socket bound
//! to the group's address on port 4791 (`SO_REUSEADDR`, so every context of the host can)
//! and joins it on the context's interface (`IP_ADD_MEMBERSHIP`); a thread per joined group
//! reads it and hands each datagram for QPN `0xFFFFFF` to every attached QP of the
//! context; the last to detach closes it. Datagrams to a group leave through the
//! context's interface (`IP_MULTICAST_IF`) and loop back to the host's members. An IPv6
//! context has no multicast (its capabilities say so).
//!
//! ## Batching and progress
//!
//! Packets a QP produces in one go leave in `sendmmsg` batches; arriving datagrams are read
//! with `recvmmsg`, every QP's packets of a batch handled before its answers are sent.
//! A packet's payload is not copied on its way out: its iovecs name its headers, the
//! registered memory it is gathered from (the packet holds the region until it is sent) and
//! its pad with its ICRC, which is computed over that memory where it lies. Arriving
//! payloads are copied once, from the receive buffer into registered memory, after their
//! datagram's ICRC and headers have been checked.
//! By default ([`Options::gso`]) each run of equal-sized datagrams of a multi-packet
//! message (up to 64 of them, 64 KB) is one UDP GSO message, and the socket takes joined
//! runs (UDP GRO): over loopback a run stays one packet from `sendmmsg` to `recvmmsg`, and
//! on a network the kernel splits it into ordinary datagrams, each with its own UDP
//! header and an ICRC computed for the IPv4 identification the kernel gives it ([`icrc`]),
//! so a peer that knows nothing of GSO (Linux rxe, an adapter) sees plain RoCEv2.
//! `RDMX_UDP_GSO=0` turns it off; a run's header (`rdmx bench`) says which path ran
//! ([`data_path`]).
//!
//! Polling a CQ reads the socket without waiting; a progress thread takes over while
//! nobody polls (as on tcp), so one-sided operations complete while the target application
//! does nothing.

mod driver;
pub mod icrc;
mod qp;
mod sys;
mod ud;

use std::any::Any;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use rdmx_core::{Mtu, QpState};

use self::driver::{Driver, Start};
use self::qp::UdpQp;
use crate::endpoint::{PeerAddr, QpEndpoint};
use crate::provider::{self, Capabilities, CqCore, ProviderConfig};
use crate::soft::{self, Engine, Keys, SoftDevice, SoftQp, SoftSrq, Transport};
use crate::{Error, Result};

pub use icrc::ROCE_PORT;

/// The provider's name.
pub const NAME: &str = "udp";
const DEVICE: &str = "udp0";

/// The environment variable naming the address a context opened by name binds
/// (`ADDR:PORT`, or an address for port 4791).
pub const BIND_ENV: &str = "RDMX_UDP_BIND";

/// How to open a udp context.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Options {
    /// The address to bind. It must be a specific address: the ICRC covers the IP source
    /// address. Default: the first free one of 127.0.0.1, 127.0.0.2, ... on port 4791.
    pub bind: Option<SocketAddr>,
    /// The largest path MTU this side offers (256 to 4096 bytes; default 4096). The
    /// context offers less where its interface's MTU cannot carry packets of this size
    /// (1024 on 1500-byte Ethernet), as rxe does.
    pub max_mtu: Mtu,
    /// Check the ICRC of every received datagram (default on). On IPv4 the check assumes
    /// the sender's IP identification is 0 to 63, as this provider's are (a datagram sent
    /// alone carries 0, segment `k` of a GSO send `k`); a peer that picks others (Linux
    /// rxe) needs it off there. Over IPv6 it works with every peer.
    pub verify_icrc: bool,
    /// Most packets a queue pair keeps unacknowledged (default 256; at most 2^22, a
    /// quarter of the PSN space; 0 is no limit).
    pub send_window: u32,
    /// Datagrams per `sendmmsg` and `recvmmsg` call, 1 to 32 (default 32; 1 is a system
    /// call per datagram, for comparison).
    pub batch: usize,
    /// Send each run of equal-sized datagrams to one peer (a multi-packet message) as one
    /// UDP GSO message, and take joined runs (UDP GRO) on receipt (default on; off on a
    /// kernel without UDP GRO). The kernel splits a GSO message into ordinary datagrams
    /// where it leaves the host (over loopback it stays one), numbering their IPv4
    /// identifications 0, 1, 2, ...: each segment's ICRC is computed for the
    /// identification and UDP length it goes out with, so that a receiver checking the
    /// real headers (Linux rxe, an adapter) accepts it; see [`icrc`].
    pub gso: bool,
    #[cfg(feature = "testing")]
    faults: Option<crate::loopback::faults::Faults>,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            bind: None,
            max_mtu: Mtu::Mtu4096,
            verify_icrc: true,
            send_window: 256,
            batch: sys::BATCH,
            gso: true,
            #[cfg(feature = "testing")]
            faults: None,
        }
    }
}

impl Options {
    /// Sets [`bind`](Self::bind).
    pub fn bind(mut self, addr: SocketAddr) -> Self {
        self.bind = Some(addr);
        self
    }
    /// Sets [`max_mtu`](Self::max_mtu).
    pub fn max_mtu(mut self, mtu: Mtu) -> Self {
        self.max_mtu = mtu;
        self
    }
    /// Sets [`verify_icrc`](Self::verify_icrc).
    pub fn verify_icrc(mut self, on: bool) -> Self {
        self.verify_icrc = on;
        self
    }
    /// Sets [`batch`](Self::batch).
    pub fn batch(mut self, datagrams: usize) -> Self {
        self.batch = datagrams;
        self
    }
    /// Sets [`gso`](Self::gso).
    pub fn gso(mut self, on: bool) -> Self {
        self.gso = on;
        self
    }
    /// Sets [`send_window`](Self::send_window).
    pub fn send_window(mut self, packets: u32) -> Self {
        self.send_window = packets;
        self
    }
    /// Drops, delays, duplicates, reorders or corrupts the datagrams this context's queue
    /// pairs send, at the socket, to test recovery. A corrupted datagram fails the
    /// receiver's ICRC check.
    #[cfg(feature = "testing")]
    pub fn faults(mut self, faults: crate::loopback::faults::Faults) -> Self {
        self.faults = Some(faults);
        self
    }

    /// The options of a context opened by name: [`BIND_ENV`] gives the address, and
    /// `RDMX_UDP_BATCH` the [`batch`](Self::batch), `RDMX_UDP_GSO=0` turns off
    /// [`gso`](Self::gso), `RDMX_UDP_WINDOW` sets the [`send_window`](Self::send_window)
    /// and `RDMX_UDP_VERIFY_ICRC=0` turns off
    /// [`verify_icrc`](Self::verify_icrc).
    pub fn from_env() -> Result<Options> {
        let mut o = Options {
            gso: std::env::var("RDMX_UDP_GSO").map_or(true, |v| v != "0"),
            verify_icrc: std::env::var("RDMX_UDP_VERIFY_ICRC").map_or(true, |v| v != "0"),
            ..Options::default()
        };
        if let Ok(v) = std::env::var("RDMX_UDP_WINDOW") {
            o.send_window = v
                .parse()
                .map_err(|_| Error::InvalidArgument("RDMX_UDP_WINDOW is not a number"))?;
        }
        if let Ok(v) = std::env::var("RDMX_UDP_BATCH") {
            o.batch = v
                .parse()
                .ok()
                .filter(|b| (1..=sys::BATCH).contains(b))
                .ok_or(Error::InvalidArgument("RDMX_UDP_BATCH is not 1 to 32"))?;
        }
        if let Ok(v) = std::env::var(BIND_ENV) {
            let addr = v
                .parse::<SocketAddr>()
                .or_else(|_| v.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, ROCE_PORT)))
                .map_err(|_| Error::InvalidArgument("RDMX_UDP_BIND is not an address"))?;
            o.bind = Some(addr);
        }
        Ok(o)
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
            capabilities: caps(Mtu::Mtu4096, true),
            gid: None,
        }]
    },
    open: |device| {
        if let Some(d) = device.filter(|&d| d != DEVICE) {
            return Err(Error::NoDevice(format!(
                "provider {NAME} has no device {d}; its device is {DEVICE}"
            )));
        }
        ProviderConfig::from(Options::from_env()?).open()
    },
};

fn limits(max_mtu: Mtu) -> rdmx_core::QpLimits {
    soft::limits(max_mtu)
}

/// Capabilities of a context whose path MTU is at most `max_mtu`, bound to an IPv4
/// address (`ipv4`) or an IPv6 one.
fn caps(max_mtu: Mtu, ipv4: bool) -> Capabilities {
    let mut caps = soft::capabilities(&limits(max_mtu), max_mtu);
    // Every datagram goes to the address its own address handle names (`ud`); groups are
    // IPv4 multicast groups.
    caps.ud = true;
    caps.multicast = ipv4;
    caps
}

/// The largest IB path MTU whose packets fit an interface MTU of `link` bytes, with their
/// IPv6 (or IPv4), UDP and transport headers: 1024 on Ethernet's 1500, 4096 on jumbo
/// frames and loopback; 256 at the least (below it the interface cannot carry RoCEv2).
fn mtu_for_link(link: u32) -> Mtu {
    let room = link.saturating_sub(40 + 8 + HEADROOM as u32);
    [Mtu::Mtu4096, Mtu::Mtu2048, Mtu::Mtu1024, Mtu::Mtu512]
        .into_iter()
        .find(|m| m.bytes() <= room)
        .unwrap_or(Mtu::Mtu256)
}

/// Bytes of a datagram's headers beyond the payload, at most (BTH, RETH, immediate data or
/// the atomic headers, pad, ICRC), with room to spare.
const HEADROOM: usize = 64;

/// What a udp context received and dropped so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct UdpStats {
    /// Datagrams read from the socket.
    pub received: u64,
    /// Datagrams whose packet was handed to a queue pair.
    pub delivered: u64,
    /// Dropped: too short for a BTH and an ICRC, or longer than the largest packet.
    pub bad_length: u64,
    /// Dropped: the ICRC did not match.
    pub bad_icrc: u64,
    /// Dropped: not an RC packet of transport version 0 in the default partition.
    pub bad_header: u64,
    /// Dropped: for a QP number this context does not have.
    pub unknown_qp: u64,
    /// Dropped: not from the address and port the QP was connected to.
    pub wrong_source: u64,
    /// Dropped: for a QP not in RTR, RTS or SQD.
    pub not_ready: u64,
    /// Datagrams sent.
    pub sent: u64,
    /// Datagrams the kernel refused (lost; the engine retransmits).
    pub send_failed: u64,
    /// Datagrams that arrived joined with others in one read (UDP GRO).
    pub joined: u64,
}

/// What a udp context received and dropped so far; `None` for a context of another
/// provider.
pub fn stats(ctx: &crate::Context) -> Option<UdpStats> {
    Some(device(ctx)?.driver.stats.get())
}

/// How a udp context moves packets, for a run's header: RoCEv2 on UDP, whether runs of
/// datagrams go as UDP GSO sends and arrive joined (GRO), and whether it checks the ICRC
/// of what it receives. `None` for a context of another provider.
pub fn data_path(ctx: &crate::Context) -> Option<&'static str> {
    let d = &device(ctx)?.driver;
    Some(match (d.gso, d.verify_icrc) {
        (true, true) => "RoCEv2 on UDP, GSO/GRO, received ICRCs checked",
        (true, false) => "RoCEv2 on UDP, GSO/GRO, received ICRCs not checked",
        (false, true) => "RoCEv2 on UDP, one datagram per message, received ICRCs checked",
        (false, false) => "RoCEv2 on UDP, one datagram per message, received ICRCs not checked",
    })
}

/// The address a udp context's socket is bound to; `None` for a context of another
/// provider.
pub fn local_addr(ctx: &crate::Context) -> Option<SocketAddr> {
    Some(device(ctx)?.driver.local)
}

/// Feeds `datagram` to a udp context's receive path as if it had arrived from `from` (for
/// fuzzing and tests: it passes every check a datagram from the socket passes). Returns
/// whether its packet reached a queue pair.
#[cfg(feature = "testing")]
pub fn inject(ctx: &crate::Context, from: SocketAddr, datagram: &[u8]) -> bool {
    let Some(d) = device(ctx) else { return false };
    let now = std::time::Instant::now();
    match d.driver.deliver(Some(from), datagram, datagram.len(), now) {
        Some(qp) => {
            let mut g = qp.inner.lock();
            qp.pump(&mut g, now);
            true
        }
        None => false,
    }
}

/// What fault injection did to a udp context's datagrams; `None` for a context of another
/// provider or one opened without [`Options::faults`].
#[cfg(feature = "testing")]
pub fn fault_stats(ctx: &crate::Context) -> Option<crate::loopback::FaultStats> {
    device(ctx)?.driver.faults.as_ref().map(|i| i.stats())
}

fn device(ctx: &crate::Context) -> Option<&Device> {
    ctx.device().as_any().downcast_ref::<Device>()
}

/// Timers context `ctx`'s driver holds (each a QP's deadline, due or stale); `None` for a
/// context of another provider. For tests.
#[cfg(feature = "testing")]
pub fn pending_timers(ctx: &crate::Context) -> Option<usize> {
    let d = ctx.device().as_any().downcast_ref::<Device>()?;
    Some(d.driver.timers.lock().len())
}

/// A udp device: a key table and a driver.
#[derive(Debug)]
struct Device {
    keys: Arc<Keys>,
    caps: Capabilities,
    max_mtu: Mtu,
    send_window: u32,
    driver: Arc<Driver>,
    /// The multicast groups its UD queue pairs joined.
    groups: Arc<ud::Groups>,
}

/// The largest [`Options::send_window`]: PSNs compare within half their 24-bit space, and
/// a window beyond a quarter of it would leave no room for the PSNs of a READ's responses.
const MAX_SEND_WINDOW: u32 = 1 << 22;

impl Device {
    fn open(opts: &Options) -> Result<Device> {
        let mtu = opts.max_mtu.bytes();
        if !(256..=4096).contains(&mtu) {
            return Err(Error::InvalidArgument(
                "a udp path MTU is 256 to 4096 bytes",
            ));
        }
        if opts.send_window > MAX_SEND_WINDOW {
            return Err(Error::InvalidArgument(
                "a udp send window is at most 2^22 packets (a quarter of the PSN space)",
            ));
        }
        let sock = match opts.bind {
            Some(a) if a.ip().is_unspecified() => {
                return Err(Error::InvalidArgument(
                    "a udp context binds a specific address (the ICRC covers it)",
                ))
            }
            Some(std::net::SocketAddr::V6(a)) if a.ip().to_ipv4_mapped().is_some() => {
                // Its packets go as IPv4 on the wire, and peers' come back as IPv4
                // sources, while the ICRC would be computed over an IPv6 header.
                return Err(Error::InvalidArgument(
                    "a udp context binds an IPv4 address as IPv4, not IPv4-mapped IPv6",
                ));
            }
            Some(a) => sys::bind(a).map_err(|e| Error::Io("bind", e))?,
            None => bind_loopback()?,
        };
        ud::prepare(&sock)?;
        let local = sock.local_addr().map_err(|e| Error::Io("getsockname", e))?;
        let ipv4 = local.is_ipv4();
        // As rxe: the path MTU a context offers fits its interface's MTU, so that no
        // packet is refused on the way out (every datagram goes with DF set).
        let link = sys::interface_mtu(local.ip());
        let max_mtu = match link.map(mtu_for_link) {
            Some(fits) if fits.bytes() < opts.max_mtu.bytes() => {
                tracing::info!(
                    ?link,
                    path_mtu = fits.bytes(),
                    "udp: the interface's MTU bounds the path MTU offered"
                );
                fits
            }
            _ => opts.max_mtu,
        };
        let mtu = max_mtu.bytes();
        crate::provider::copy::calibrate();
        let seed = soft::seed()?;
        let driver = Driver::start(Start {
            sock,
            max_datagram: mtu as usize + HEADROOM,
            verify_icrc: opts.verify_icrc,
            batch: opts.batch,
            gso: opts.gso,
            qpn_seed: (seed >> 32) as u32,
            #[cfg(feature = "testing")]
            faults: opts.faults.clone(),
        })?;
        Ok(Device {
            keys: Arc::new(Keys::new(seed)),
            caps: caps(max_mtu, ipv4),
            max_mtu,
            send_window: opts.send_window,
            driver,
            groups: Arc::new(ud::Groups::default()),
        })
    }
}

/// Binds the first free one of 127.0.0.1, 127.0.0.2, ... on port 4791.
fn bind_loopback() -> Result<std::net::UdpSocket> {
    let mut last = None;
    for i in 1..=254u8 {
        let a = SocketAddr::from((Ipv4Addr::new(127, 0, 0, i), ROCE_PORT));
        match sys::bind(a) {
            Ok(s) => return Ok(s),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => last = Some(e),
            Err(e) => return Err(Error::Io("bind", e)),
        }
    }
    Err(Error::Io(
        "bind (every 127.0.0.x:4791 is taken)",
        last.unwrap_or_else(|| std::io::Error::from(std::io::ErrorKind::AddrInUse)),
    ))
}

impl Drop for Device {
    fn drop(&mut self) {
        tracing::debug!(local = %self.driver.local, stats = ?self.driver.stats.get(), "udp context closed");
        self.driver.shutdown();
    }
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
        PeerAddr::Ip(self.driver.local)
    }
    fn create_cq(&self, _core: &Arc<CqCore>) -> Result<Box<dyn provider::Cq>> {
        Ok(Box::new(Cq {
            driver: self.driver.clone(),
        }))
    }
    fn create_qp(&self, init: provider::QpInit<'_>) -> Result<Box<dyn provider::Qp>> {
        let srq = SoftSrq::of(init.srq)?;
        let qpn = self.driver.alloc_qpn();
        let mut cfg = soft::config(&init, qpn);
        cfg.send_window = self.send_window;
        let engine = Engine::new(cfg, limits(self.max_mtu));
        let qp = Arc::new(UdpQp::new(
            qpn,
            self.driver.clone(),
            engine,
            self.keys.clone(),
            (init.send_cq.core.clone(), init.recv_cq.core.clone()),
            srq,
        ));
        self.driver.add_qp(qp.clone());
        Ok(Box::new(SoftQp {
            qpn,
            transport: Link {
                qp,
                groups: self.groups.clone(),
                max_datagram: self.max_mtu.bytes() as usize + HEADROOM,
            },
        }))
    }
}

/// A udp CQ: polls read the socket (see the module's "Batching and progress").
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

/// A udp QP as the software host sees it.
#[derive(Debug)]
struct Link {
    qp: Arc<UdpQp>,
    groups: Arc<ud::Groups>,
    max_datagram: usize,
}

impl Transport for Link {
    fn with<T>(&self, f: impl FnOnce(&mut Engine, &Keys) -> T) -> T {
        self.qp.with(|i| f(&mut i.engine, &i.keys))
    }
    fn address(&self) -> PeerAddr {
        PeerAddr::Ip(self.qp.driver.local)
    }
    fn bind_peer(&self, peer: &QpEndpoint, _timeout: Duration) -> Result<()> {
        let addr = match peer.addr {
            PeerAddr::Ip(a) => a,
            // A RoCE port (verbs: Linux rxe, an adapter) names itself by its GID; an
            // IPv4-mapped one is an IPv4 address. It listens on port 4791.
            PeerAddr::Gid(g) => match g.to_ipv4_mapped() {
                Some(v4) => SocketAddr::new(IpAddr::V4(v4), ROCE_PORT),
                None => SocketAddr::new(IpAddr::V6(g), ROCE_PORT),
            },
            _ => {
                return Err(Error::InvalidArgument(
                    "a udp peer endpoint needs an IP address or a RoCE GID",
                ))
            }
        };
        if addr.ip().is_unspecified() || addr.port() == 0 {
            return Err(Error::InvalidArgument(
                "a udp peer endpoint needs a specific address and port",
            ));
        }
        if addr.is_ipv4() != self.qp.driver.local.is_ipv4() {
            return Err(Error::InvalidArgument(
                "a udp peer must be of the context's address family",
            ));
        }
        let mut g = self.qp.inner.lock();
        // A live QP keeps its peer: packets go to, and are taken from, the peer it
        // connected to (a `connect` to another peer, refused at its move to INIT, must not
        // redirect it first).
        if !matches!(g.engine.state(), QpState::Reset | QpState::Init) {
            return Err(Error::InvalidArgument(
                "a udp queue pair is given its peer in RESET or INIT",
            ));
        }
        g.peer = Some(addr);
        g.any_port = matches!(peer.addr, PeerAddr::Gid(_));
        drop(g);
        Ok(())
    }
    fn ready_for_rtr(&self) -> Result<()> {
        let g = self.qp.inner.lock();
        if g.engine.config().qp_type != rdmx_core::QpType::Ud && g.peer.is_none() {
            // Its packets would go nowhere (a UC send completing with success) and every
            // packet that came would be from a stranger.
            return Err(Error::InvalidArgument(
                "a udp RC or UC queue pair needs its peer (bind_peer) before RTR",
            ));
        }
        Ok(())
    }
    fn multicast(&self, gid: [u8; 16], attach: bool) -> Result<()> {
        self.groups.attach(&self.qp, gid, attach, self.max_datagram)
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.groups.leave_all(self.qp.qpn);
        self.qp.driver.remove_qp(self.qp.qpn);
    }
}

#[cfg(test)]
mod tests {
    use super::{mtu_for_link, sys, Mtu};

    #[test]
    fn the_path_mtu_fits_the_interface_s() {
        for (link, path) in [
            (65536, Mtu::Mtu4096),
            (9000, Mtu::Mtu4096),
            (4208, Mtu::Mtu4096),
            (4207, Mtu::Mtu2048),
            (1500, Mtu::Mtu1024),
            (1280, Mtu::Mtu1024),
            (1000, Mtu::Mtu512),
            (576, Mtu::Mtu256),
            (68, Mtu::Mtu256),
        ] {
            assert_eq!(mtu_for_link(link), path, "an interface MTU of {link}");
        }
    }

    #[test]
    fn the_loopback_interface_s_mtu_is_found_by_its_address() {
        let lo: u32 = std::fs::read_to_string("/sys/class/net/lo/mtu")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert_eq!(sys::interface_mtu([127, 0, 0, 1].into()), Some(lo));
        // 192.0.2.0/24 is for documentation: no interface has it.
        assert_eq!(sys::interface_mtu([192, 0, 2, 1].into()), None);
    }
}
