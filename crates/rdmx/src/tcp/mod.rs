//! The tcp provider: the RC engine over TCP streams, across processes and hosts.
//!
//! Each queue pair has its own stream to its peer QP (a stream per QP keeps each QP's
//! packets in order and lets the receive side read a payload straight into place without
//! holding other QPs back). Frames are IBTA RC packets behind a 4-byte length
//! (`stream`); payloads move between the socket and registered memory with vectored
//! I/O and no intermediate copy. Sends are plain `writev`s of up to 1 MiB of packets:
//! `MSG_ZEROCOPY` was measured at about half the bandwidth on loopback (the kernel copies
//! every looped-back zero-copy packet anyway and adds a completion notification per send),
//! and it pays off only for large sends between hosts.
//!
//! A context has one `Driver`: a listening socket that peers' QPs dial, an epoll
//! instance (mio) watching every stream, and the timers of every QP.
//!
//! ## Progress
//!
//! By default whoever polls makes progress: a poll of one of the context's CQs that does
//! not find all it asks for already queued runs the driver once without waiting
//! (reading a few QPs' streams directly, without `epoll_wait`), and a progress thread
//! takes over only while nobody polls, so one-sided operations complete while the
//! target application does nothing. While an application polled within the last
//! millisecond the thread sleeps, away from the driver and the cores: on two cores a
//! thread woken by every packet, competing with an application that spins on its CQ,
//! costs a ping-pong a hundredfold. A poll that finds the thread asleep
//! in `epoll_wait` (holding the driver) wakes it, once, so that it hands over; a thread
//! about to sleep in [`CompletionQueue::wait`](crate::CompletionQueue::wait) says it no
//! longer polls, and the progress thread resumes at once. In busy-poll mode
//! ([`Options::busy_poll`]) no thread is started at all, and transmissions wait for the
//! next poll so that an ACK and the next request leave in one `writev`.
//!
//! ## Connection setup
//!
//! [`QueuePair::endpoint`](crate::QueuePair::endpoint) carries the address of the
//! context's listener and the QP's random secret. Of two QPs being connected, the one with
//! the smaller (QP number, PSN, port) dials the other's listener and sends a hello naming
//! both QP numbers and presenting the secret of the QP it dials; the other side's driver
//! hands the stream to the QP it names once that QP expects this peer, and closes (and
//! logs) a stream whose hello is not rdmx's, names no QP, or lacks the secret, so nobody
//! who only knows QP numbers can take a queue pair over. Neither side blocks waiting for
//! the other, so both ends can be connected from one thread.

mod driver;
mod qp;
mod stream;

use std::any::Any;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use driver::Driver;
use qp::TcpQp;
use rdmx_core::Mtu;

use crate::endpoint::{PeerAddr, QpEndpoint};
use crate::provider::{self, Capabilities, CqCore, ProviderConfig};
use crate::soft::{self, Engine, Keys, SoftDevice, SoftQp, SoftSrq, Transport};
use crate::{Error, Result};

/// The provider's name.
pub const NAME: &str = "tcp";
const DEVICE: &str = "tcp0";

/// How to open a tcp context.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Options {
    /// The address the context listens on for peers' queue pairs (default: every
    /// interface, a port the kernel picks).
    pub bind: Option<SocketAddr>,
    /// No progress thread: polling any of the context's CQs makes progress instead. One-
    /// sided operations aimed at this context then complete only while the application
    /// polls. The default (a progress thread that hands over to polling applications) is
    /// about as fast for a ping-pong; this mode also batches an ACK with the next request.
    /// An application that stops polling part-way through sending a frame for longer
    /// than its peer's retry budget (the peer QP's ack timeout times its tries, 4 s by
    /// default) has its connection failed by the peer, which takes it for dead.
    pub busy_poll: bool,
}

impl Options {
    /// Sets [`bind`](Self::bind).
    pub fn bind(mut self, addr: SocketAddr) -> Self {
        self.bind = Some(addr);
        self
    }
    /// Sets [`busy_poll`](Self::busy_poll).
    pub fn busy_poll(mut self, on: bool) -> Self {
        self.busy_poll = on;
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
            capabilities: caps(),
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

fn limits() -> rdmx_core::QpLimits {
    soft::limits(Mtu::Bytes(MAX_MTU))
}

fn caps() -> Capabilities {
    soft::capabilities(&limits(), Mtu::Bytes(ACTIVE_MTU))
}

/// Timers context `ctx`'s driver holds (each a QP's deadline, due or stale); `None` for a
/// context of another provider. For tests.
#[cfg(feature = "testing")]
pub fn pending_timers(ctx: &crate::Context) -> Option<usize> {
    let d = ctx.device().as_any().downcast_ref::<Device>()?;
    Some(d.driver.timers.lock().len())
}

/// A tcp device: a key table and a driver.
#[derive(Debug)]
struct Device {
    keys: Arc<Keys>,
    caps: Capabilities,
    driver: Arc<Driver>,
}

impl Device {
    fn open(opts: &Options) -> Result<Device> {
        crate::provider::copy::calibrate();
        let seed = soft::seed()?;
        let bind = opts
            .bind
            .unwrap_or_else(|| SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, 0)));
        Ok(Device {
            keys: Arc::new(Keys::new(seed)),
            caps: caps(),
            driver: Driver::start(bind, opts.busy_poll, (seed >> 32) as u32)?,
        })
    }
}

impl Drop for Device {
    fn drop(&mut self) {
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
        PeerAddr::Ip(self.driver.local_addr())
    }
    fn create_cq(&self, _core: &Arc<CqCore>) -> Result<Box<dyn provider::Cq>> {
        Ok(Box::new(Cq {
            driver: self.driver.clone(),
        }))
    }
    fn deregistered(&self, mr: &Arc<provider::MrShared>) {
        self.driver.deregistered(mr);
    }
    fn create_qp(&self, init: provider::QpInit<'_>) -> Result<Box<dyn provider::Qp>> {
        let srq = SoftSrq::of(init.srq)?;
        let qpn = self.driver.alloc_qpn();
        let mut cfg = soft::config(&init, qpn);
        // TCP delivers every packet once and in order, or breaks the stream.
        soft::reliable_link(&mut cfg);
        let engine = Engine::new(cfg, limits());
        let qp = self.driver.add_qp(|token| {
            TcpQp::new(
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
            transport: Link { qp },
        }))
    }
}

/// A tcp CQ: polls run the driver (see the module's "Progress").
#[derive(Debug)]
struct Cq {
    driver: Arc<Driver>,
}

impl provider::Cq for Cq {
    fn progress(&self, _core: &CqCore) -> Result<()> {
        if self.driver.busy_poll {
            self.driver.progress(Some(Duration::ZERO));
        } else {
            self.driver.app_progress();
        }
        Ok(())
    }
    fn idle(&self) {
        self.driver.idle();
    }
    fn needs_polling(&self) -> bool {
        self.driver.busy_poll
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A tcp QP as the software host sees it.
#[derive(Debug)]
struct Link {
    qp: Arc<TcpQp>,
}

impl Transport for Link {
    fn with<T>(&self, f: impl FnOnce(&mut Engine, &Keys) -> T) -> T {
        self.qp.with(|i| f(&mut i.engine, &i.keys))
    }
    fn post_with<T>(&self, f: impl FnOnce(&mut Engine, &Keys) -> T) -> T {
        self.qp.post(|i| f(&mut i.engine, &i.keys))
    }
    fn entered_rtr(&self) -> Result<()> {
        self.qp.driver.establish(&self.qp)
    }
    fn address(&self) -> PeerAddr {
        PeerAddr::Ip(self.qp.driver.local_addr())
    }
    fn rekey(&self, psn: u32, secret: u64) {
        self.qp.driver.rekey(&self.qp, psn, secret);
    }
    fn bind_peer(&self, peer: &QpEndpoint, timeout: Duration) -> Result<()> {
        let PeerAddr::Ip(addr) = peer.addr else {
            return Err(Error::InvalidArgument(
                "a tcp peer endpoint needs the address of its context",
            ));
        };
        self.qp
            .bind_peer((addr, peer.qp_num, peer.psn, peer.secret), timeout);
        Ok(())
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.qp.driver.remove_qp(&self.qp);
    }
}

/// Largest path MTU on tcp.
pub(crate) const MAX_MTU: u32 = 1 << 20;
/// Largest frame a QP accepts: headers, the largest payload, pad.
pub(crate) const MAX_FRAME: usize = 128 + MAX_MTU as usize;
/// The path MTU tcp connections use unless told otherwise.
pub(crate) const ACTIVE_MTU: u32 = 1 << 20;
