//! The provider seam: what a provider implements, and the few types both sides share.
//!
//! The facade's public objects ([`Context`](crate::Context),
//! [`CompletionQueue`](crate::CompletionQueue), [`QueuePair`](crate::QueuePair), ...) hold
//! trait objects from this module and never name a provider's own types. A provider lives
//! in one folder, implements [`Device`], [`Cq`], [`Qp`] and [`Srq`], and is listed once
//! in [`crate::PROVIDERS`]. Providers use this module, the error type and rdmx-core; they
//! never reach into the facade's objects.
//!
//! ```text
//!   Context ─ ProtectionDomain ─ MemoryRegion ─ CompletionQueue ─ QueuePair   (facade)
//!        │                │                 │                 │
//!        ▼                ▼                 ▼                 ▼
//!     Device::register / create_cq / create_qp / create_srq      (this seam)
//!        ▲
//!   loopback/  tcp/  (software: the RC engine, soft/)    verbs/ (rdma-core)
//! ```
//!
//! Registered memory crosses the seam as [`MrShared`] (what a region is, kept alive by
//! [`MrRef`]s while requests use it); completions as pushes into a [`CqCore`], the
//! provider-independent part of every CQ.

use std::any::Any;
use std::fmt;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use rdmx_core::{
    AddressVector, KeyError, KeyUse, PdId, QpAttr, QpAttrMask, QpState, QpType, RecvWr, SendWr,
};
use rdmx_mem::{Access, Memory, Pinning};

use crate::endpoint::{PeerAddr, QpEndpoint};
use crate::Result;

pub(crate) mod caps;
pub(crate) mod copy;
pub(crate) mod cq;
pub(crate) mod mem;

pub use caps::{AtomicCap, Capabilities, DeviceInfo, QpCaps, Transport};
pub(crate) use cq::CqCore;
pub use mem::MrRef;
pub(crate) use mem::MrShared;

/// One provider, as [`crate::PROVIDERS`] lists it.
#[derive(Clone, Copy)]
pub(crate) struct Entry {
    /// The name `--provider` and [`Context::open_provider`](crate::Context::open_provider)
    /// take.
    pub(crate) name: &'static str,
    /// Its devices on this machine, with their capabilities.
    pub(crate) devices: fn() -> Vec<DeviceInfo>,
    /// Opens a device with default options (`device`: a device name, `None` for the first).
    pub(crate) open: fn(device: Option<&str>) -> Result<Arc<dyn Device>>,
}

/// A provider with its options, ready to open a device: what
/// [`Context::open`](crate::Context::open) takes. Each provider's `Options` converts into
/// one (`rdmx::tcp::Options::default().busy_poll(true)`, ...).
pub struct ProviderConfig {
    name: &'static str,
    open: Box<dyn FnOnce() -> Result<Arc<dyn Device>> + Send>,
}

impl ProviderConfig {
    pub(crate) fn new(
        name: &'static str,
        open: impl FnOnce() -> Result<Arc<dyn Device>> + Send + 'static,
    ) -> Self {
        ProviderConfig {
            name,
            open: Box::new(open),
        }
    }

    /// The provider's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    pub(crate) fn open(self) -> Result<Arc<dyn Device>> {
        (self.open)()
    }
}

impl fmt::Debug for ProviderConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProviderConfig")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Memory handed to [`Device::register`].
pub(crate) struct Registration {
    pub(crate) pd: PdId,
    pub(crate) addr: *mut u8,
    pub(crate) len: usize,
    pub(crate) access: Access,
    pub(crate) pinning: Pinning,
    /// The owner of the memory, if the region owns it; dropped after the keys die and the
    /// last [`MrRef`] goes.
    pub(crate) owner: Option<Box<dyn Memory>>,
}

/// An open device: the provider's half of a [`Context`](crate::Context).
pub(crate) trait Device: Send + Sync + fmt::Debug {
    /// The provider's name.
    fn provider(&self) -> &'static str;
    /// The device's name.
    fn name(&self) -> &str;
    /// What it can do.
    fn caps(&self) -> &Capabilities;
    /// Where peers reach this device's queue pairs, if it has one address for all of them
    /// (tcp: its listener; verbs: its GID).
    fn address(&self) -> PeerAddr;
    /// The GID index and GID in use (verbs).
    fn gid(&self) -> Option<(u32, std::net::Ipv6Addr)> {
        None
    }

    /// Registers memory (`ibv_reg_mr`).
    ///
    /// # Safety
    ///
    /// `[addr, addr + len)` stays mapped until the returned region and every [`MrRef`] to
    /// it are dropped.
    unsafe fn register(&self, reg: Registration) -> Result<Arc<MrShared>>;
    /// Deregisters: the region's keys stop working now. (`mr` is the region's own
    /// reference: what else holds it shows who may still use the memory.)
    fn deregister(&self, mr: &Arc<MrShared>);
    /// Resolves a key as a QP of `pd` would before touching memory.
    fn check(
        &self,
        pd: PdId,
        key: u32,
        key_use: KeyUse,
        addr: u64,
        len: u64,
        need: Access,
    ) -> std::result::Result<MrRef, KeyError>;
    /// Regions registered now.
    fn registered_regions(&self) -> usize;

    /// Creates the provider half of a CQ whose completions go to `core`.
    fn create_cq(&self, core: &Arc<CqCore>) -> Result<Box<dyn Cq>>;
    /// Creates a queue pair of type `init.qp_type` in RESET (the facade has checked that
    /// [`Capabilities::supports`] it).
    fn create_qp(&self, init: QpInit<'_>) -> Result<Box<dyn Qp>>;
    /// Creates an address handle (`ibv_create_ah`) for UD sends.
    fn create_ah(&self, _pd: PdId, av: &AddressVector) -> Result<Arc<dyn Ah>> {
        let _ = av;
        Err(crate::Error::Unsupported(
            "this provider has no UD queue pairs, so no address handles",
        ))
    }
    /// Creates a shared receive queue.
    fn create_srq(&self, pd: PdId, max_wr: usize, max_sge: usize) -> Result<Box<dyn Srq>>;
    /// As `Any`, for the provider's own downcasts (only test tools need it).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    fn as_any(&self) -> &dyn Any;
}

/// A CQ as [`Device::create_qp`] sees it: the shared core and the provider's half.
#[derive(Debug)]
pub(crate) struct CqParts {
    pub(crate) core: Arc<CqCore>,
    pub(crate) imp: Box<dyn Cq>,
}

/// What a new queue pair is made of.
pub(crate) struct QpInit<'a> {
    pub(crate) pd: PdId,
    /// RC, UC or UD.
    pub(crate) qp_type: QpType,
    pub(crate) send_cq: &'a Arc<CqParts>,
    pub(crate) recv_cq: &'a Arc<CqParts>,
    pub(crate) srq: Option<&'a dyn Srq>,
    pub(crate) caps: QpCaps,
    /// The QP's first PSN, drawn at random by the facade.
    pub(crate) psn: u32,
    /// The QP's connection secret, drawn at random by the facade; a provider whose
    /// transport lets strangers in (tcp) refuses a peer that cannot present it.
    pub(crate) secret: u64,
}

/// The provider half of a completion queue.
pub(crate) trait Cq: Send + Sync + fmt::Debug + Any {
    /// Called by a poll that did not fill its output from what `core` already held, before
    /// it takes more: move the provider's completions into `core`, or make progress
    /// where polling is what makes it.
    fn progress(&self, core: &CqCore) -> Result<()>;
    /// Arms notification.
    fn req_notify(&self, core: &CqCore, solicited_only: bool) {
        core.arm(solicited_only);
    }
    /// The descriptor that becomes readable on a notification, if not the core's.
    fn fd(&self) -> Option<RawFd> {
        None
    }
    /// Consumes a notification; returns whether there was one.
    fn get_event(&self, core: &CqCore) -> bool {
        core.read_event()
    }
    /// Whether completions move only when someone polls (waiters must poll in slices).
    fn needs_polling(&self) -> bool {
        false
    }
    /// Whether completions reach the core, and notify, without anyone polling (a thread or
    /// the adapter makes progress), so a waiter can sleep on the notification alone.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    fn notifies_unpolled(&self) -> bool {
        !self.needs_polling()
    }
    /// A thread is about to sleep on the notification (it stops polling for now): where
    /// polls make progress in place of a thread, the thread resumes.
    fn idle(&self) {}
    /// As `Any`, for the provider's own downcasts (the verbs provider's).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    fn as_any(&self) -> &dyn Any;
}

/// The provider half of a queue pair.
pub(crate) trait Qp: Send + Sync + fmt::Debug + Any {
    /// The QP number.
    fn qp_num(&self) -> u32;
    /// Current state.
    fn state(&self) -> QpState;
    /// Current attributes.
    fn attrs(&self) -> QpAttr;
    /// `ibv_modify_qp`.
    fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()>;
    /// Where the peer reaches this QP.
    fn address(&self) -> PeerAddr;
    /// Names the peer before the move to RTR (the address vector).
    fn bind_peer(&self, peer: &QpEndpoint, connect_timeout: Duration) -> Result<()>;
    /// `ibv_post_send`.
    ///
    /// # Safety
    ///
    /// The caller must not hold Rust references to the memory the elements name while the
    /// request is outstanding.
    unsafe fn post_send(&self, wr: &SendWr, inline: Option<&[u8]>) -> Result<()>;
    /// `ibv_post_send` of a UD send through address handle `ah` (made by this provider's
    /// [`Device::create_ah`]); `wr.ud` holds the same address vector, the remote QPN and
    /// the Q_Key. Software providers route by `wr.ud` alone.
    ///
    /// # Safety
    ///
    /// As [`post_send`](Self::post_send).
    unsafe fn post_send_ud(&self, wr: &SendWr, inline: Option<&[u8]>, ah: &dyn Ah) -> Result<()> {
        let _ = ah;
        // SAFETY: forwarded; the caller upholds the contract.
        unsafe { self.post_send(wr, inline) }
    }
    /// `ibv_post_send` with a list: posts `wrs` in order and stops at the first that is
    /// refused, giving its index and the error. Providers that take a lock or make
    /// progress per post override it to do that once for the list. Not for UD.
    ///
    /// # Safety
    ///
    /// As [`post_send`](Self::post_send), for every request.
    unsafe fn post_send_list(
        &self,
        wrs: &mut dyn Iterator<Item = (&SendWr, Option<&[u8]>)>,
    ) -> std::result::Result<(), (usize, crate::Error)> {
        for (i, (wr, inline)) in wrs.enumerate() {
            // SAFETY: forwarded; the caller upholds the contract.
            unsafe { self.post_send(wr, inline) }.map_err(|e| (i, e))?;
        }
        Ok(())
    }
    /// Attaches a UD queue pair to the multicast group `gid` (`ibv_attach_mcast`).
    fn attach_mcast(&self, _gid: [u8; 16], _lid: u16) -> Result<()> {
        Err(crate::Error::Unsupported("this provider has no multicast"))
    }
    /// Detaches a UD queue pair from the multicast group `gid` (`ibv_detach_mcast`).
    fn detach_mcast(&self, _gid: [u8; 16], _lid: u16) -> Result<()> {
        Err(crate::Error::Unsupported("this provider has no multicast"))
    }
    /// UD datagrams this queue pair dropped on receipt (wrong Q_Key, no receive posted,
    /// too long for the receive, malformed), and UC messages it dropped whole (a lost
    /// packet, no receive posted); `None` when the provider cannot know (see
    /// [`QueuePair::dropped`](crate::QueuePair::dropped)).
    fn dropped(&self) -> Option<u64> {
        None
    }
    /// The queue pair went back to RESET, and the facade drew a new first PSN and
    /// connection secret for its next connection: from now on a peer must present
    /// `secret`, and a connection that presented the old one and waits for the queue pair
    /// goes. Providers without a secret (their transport admits no strangers) ignore it.
    fn rekey(&self, _psn: u32, _secret: u64) {}
    /// `ibv_post_recv`.
    ///
    /// # Safety
    ///
    /// As [`post_send`](Self::post_send).
    unsafe fn post_recv(&self, wr: &RecvWr) -> Result<()>;
    /// The queue pair is being destroyed (`ibv_destroy_qp`): nothing is called on it
    /// after this but its drop. Returns false if the provider may still read or write
    /// memory of requests that were in flight even once the queue pair is dropped (a
    /// peer process that did not let go of it in time); true by default, for providers
    /// whose drop returns with nothing held.
    fn quiesce(&self) -> bool {
        true
    }
    /// As `Any`, for the provider's own downcasts (the verbs provider's).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    fn as_any(&self) -> &dyn Any;
}

/// The provider half of an address handle.
pub(crate) trait Ah: Send + Sync + fmt::Debug + Any {
    /// Its address vector.
    fn av(&self) -> AddressVector;
    /// As `Any`, for the provider's own downcasts (the verbs provider's).
    #[allow(dead_code)]
    fn as_any(&self) -> &dyn Any;
}

/// The provider half of a shared receive queue.
pub(crate) trait Srq: Send + Sync + fmt::Debug + Any {
    /// `ibv_post_srq_recv`.
    ///
    /// # Safety
    ///
    /// As [`Qp::post_send`].
    unsafe fn post_recv(&self, wr: &RecvWr) -> Result<()>;
    /// Receives posted and not consumed.
    fn len(&self) -> usize;
    /// Arms the limit event (`limit` is at most the queue's `max_wr`).
    fn arm_limit(&self, limit: usize) -> Result<()>;
    /// Takes the limit event.
    fn limit_reached(&self) -> bool;
    /// As `Any`, for the provider's own downcasts.
    fn as_any(&self) -> &dyn Any;
}
