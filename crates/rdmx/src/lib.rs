//! # rdmx: efficient data transfer with RDMA semantics
//!
//! rdmx gives one verbs-shaped, safe API over several providers. It is built in layers,
//! each its own crate, top-down:
//!
//! - **rdmx** (this crate): the facade users program against — [`Context`],
//!   [`ProtectionDomain`], [`MemoryRegion`], [`CompletionQueue`], [`QueuePair`],
//!   [`SharedReceiveQueue`], [`AddressHandle`] (UD), connection setup ([`cm`]), the
//!   registration cache
//!   ([`RegCache`]) and registered-buffer pools ([`BufferPool`]) — over a provider seam;
//!   blocking, and with the feature `tokio` async (`rdmx::tokio`).
//! - **providers**, each one folder behind the seam, listed once (`PROVIDERS` in this
//!   file):
//!   - [`loopback`] (the default): queue pairs of this process, packets passed in memory;
//!   - [`tcp`]: between processes and hosts, one TCP stream per queue pair, payloads moved
//!     straight between the socket and registered memory;
//!   - [`shm`]: between processes of one host (or within one), a pair of shared-memory
//!     rings per queue pair;
//!   - [`udp`]: RoCEv2 on UDP sockets, between rdmx processes and with Linux Soft-RoCE
//!     and RoCE adapters;
//!   - `verbs` (cargo feature `verbs`, on by default): rdma-core, for InfiniBand, RoCE and
//!     iWARP adapters and Soft-RoCE, with its own rdma_cm connection setup.
//!
//!   The software providers share one host for the RC engine (the `soft` module) and
//!   bring only their packet transport.
//! - **rdmx-mem**: pinning with `RLIMIT_MEMLOCK` diagnostics, the registration cache and
//!   its `munmap` monitor, buffer pools, hugepage and shareable mappings.
//! - **rdmx-core**: the sans-IO core — memory-region keys and the checks every provider
//!   runs, the QP state machine, and the engine (RC: requester, responder, retransmission,
//!   RNR, credits; UC and UD on the same queues) — with no IO, threads or clock reads.
//! - **rdmx-wire**: IBTA headers as packet views and representations (BTH, RETH, AETH,
//!   AtomicETH, ImmDt, IETH, ...).
//!
//! ## Quick start
//!
//! ```
//! use rdmx::{Access, Context};
//!
//! let ctx = Context::open_default()?;
//! let pd = ctx.alloc_pd();
//! let mr = pd.register(vec![0u8; 4096], Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
//! mr.write_at(0, b"hello")?;
//! let mut out = [0u8; 5];
//! mr.read_at(0, &mut out)?;
//! assert_eq!(&out, b"hello");
//! println!("lkey {:#x} rkey {:#x}", mr.lkey(), mr.rkey());
//! # Ok::<(), rdmx::Error>(())
//! ```
//!
//! Choosing a provider and its options is typed:
//! `Context::open(rdmx::tcp::Options::default().busy_poll(true))`; by name (as the CLI's
//! `--provider`) it is [`Context::open_provider`].
//!
//! ## Blocking and async
//!
//! Every request can be posted and reaped blocking, or awaited. Blocking:
//! [`QueuePair::post_send_buf`] moves an owned buffer into a request, [`CompletionQueue::wait`]
//! polls, arms and sleeps until completions arrive, and [`QueuePair::take_buf`] gives the
//! buffer back (see the `owned` module's example). Async, with the cargo feature `tokio`:
//! `rdmx::tokio::AsyncCq` wraps the same completion queue and
//! `tokio::AsyncQp` the same queue pair, and one call does all three:
//!
//! ```ignore
//! let (buf, completion) = qp.send(buf).await?;      // blocking: post_send_buf, wait, take_buf
//! let (buf, completion) = qp.read(buf, remote).await?;
//! ```
//!
//! A dropped operation never frees or reuses its buffer while a provider may touch it:
//! the queue pair keeps it until the completion arrives. See the `rdmx::tokio` module (with
//! the feature) for the full example, and the `async_echo` and `async_copy` examples.
//!
//! ## Queue-pair types
//!
//! [`ProtectionDomain::create_qp`] makes RC queue pairs;
//! [`ProtectionDomain::create_qp_of_type`] makes UC ([`QpType::Uc`]: SEND and WRITE, no
//! acknowledgement, a message that loses a packet is dropped whole) and UD ones
//! ([`QpType::Ud`]: [`QueuePair::activate`] with a Q_Key, then SENDs through an
//! [`AddressHandle`] with [`SendRequest::ud`]; each receive starts with the
//! [`GRH_LEN`]-byte GRH area). [`Capabilities::supports`] says which types a provider has.
//!
//! ```
//! use rdmx::{Access, AhAttr, Context, LocalSge, QpCaps, QpType, RecvRequest, SendRequest};
//!
//! let ctx = Context::open_provider("loopback")?;
//! let pd = ctx.alloc_pd();
//! let cq = ctx.create_cq(16)?;
//! let (a, b) = (
//!     pd.create_qp_of_type(QpType::Ud, &cq, &cq, None, QpCaps::default())?,
//!     pd.create_qp_of_type(QpType::Ud, &cq, &cq, None, QpCaps::default())?,
//! );
//! a.activate(0x1111)?;
//! b.activate(0x1111)?;
//! let mr = pd.register(vec![0u8; 4096], Access::LOCAL_WRITE)?;
//! mr.write_at(0, b"hello")?;
//! b.post_recv(RecvRequest::new(1).sge(LocalSge::new(&mr, 1024, rdmx::GRH_LEN + 64)?))?;
//! let ah = pd.create_ah(&AhAttr::to_endpoint(&b.endpoint()))?;
//! a.post_send(SendRequest::send(2).sge(LocalSge::new(&mr, 0, 5)?).ud(&ah, b.qp_num(), 0x1111))?;
//! let mut got = Vec::new();
//! while got.len() < 2 {
//!     let mut wc = [rdmx::Completion::default(); 2];
//!     let n = cq.poll(&mut wc)?;
//!     got.extend_from_slice(&wc[..n]);
//! }
//! let recv = got.iter().find(|c| c.wr_id == 1).unwrap();
//! assert_eq!((recv.src_qp, recv.byte_len as usize), (a.qp_num(), rdmx::GRH_LEN + 5));
//! let mut msg = [0u8; 5];
//! mr.read_at(1024 + rdmx::GRH_LEN, &mut msg)?;
//! assert_eq!(&msg, b"hello");
//! # Ok::<(), rdmx::Error>(())
//! ```
//!
//! ## Memory safety
//!
//! - A region's keys die the moment it is deregistered; its memory lives until nothing
//!   uses it ([`MrRef`]): a posted request holds its regions until it completes.
//! - Memory that the adapter or a peer may write is reached through copying accessors or
//!   owned pool buffers, never through long-lived slices.
//! - Registering memory the caller keeps owning is `unsafe`
//!   ([`ProtectionDomain::register_raw`]); owned memory ([`Memory`]) is safe.
//!
//! ## Cargo features
//!
//! - `verbs` (default): the rdma-core provider (loaded at run time).
//! - `serde`: `Serialize`/`Deserialize` for [`QpEndpoint`], [`PeerAddr`] and
//!   [`RemoteRegion`] (each also has a compact byte form).
//! - `tokio`: the async API (`rdmx::tokio`): awaitable completion queues,
//!   operations as futures that own their buffers, async connection setup.
//! - `testing`: test tools — the loopback provider's fault injection and seeded keys.

mod ah;
pub mod cm;
mod context;
mod cq;
mod endpoint;
mod error;
mod mr;
mod owned;
mod pd;
mod provider;
mod qp;
mod soft;
mod srq;
#[cfg(feature = "tokio")]
pub mod tokio;

pub mod loopback;
pub mod shm;
pub mod tcp;
pub mod udp;
#[cfg(feature = "verbs")]
pub mod verbs;

/// Every provider this build has: one line each.
pub(crate) const PROVIDERS: &[provider::Entry] = &[
    loopback::ENTRY,
    tcp::ENTRY,
    shm::ENTRY,
    udp::ENTRY,
    #[cfg(feature = "verbs")]
    verbs::ENTRY,
];

/// The names of the providers this build has (`loopback`, `tcp`, `shm`, `udp`, `verbs`).
pub fn provider_names() -> impl Iterator<Item = &'static str> {
    PROVIDERS.iter().map(|p| p.name)
}

/// Every device available on this machine: one per software provider, and each RDMA
/// device rdma-core offers.
pub fn devices() -> Vec<DeviceInfo> {
    PROVIDERS.iter().flat_map(|p| (p.devices)()).collect()
}

pub use ah::{shm_gid, shm_of_gid, AddressHandle, AhAttr, LOCAL_GID, SHM_GID_PREFIX};
pub use context::Context;
pub use cq::CompletionQueue;
pub use endpoint::{ConnectOptions, PeerAddr, QpEndpoint, RemoteRegion};
pub use error::{Error, Result};
pub use mr::MemoryRegion;
pub use owned::{CachedBuf, OwnedBuf, RESERVED_WR_IDS};
pub use provider::{AtomicCap, Capabilities, DeviceInfo, MrRef, ProviderConfig, QpCaps, Transport};
pub use qp::{LocalSge, QueuePair, RecvRequest, SendRequest};
pub use rdmx_core::{
    AddressVector, Completion, KeyError, KeyUse, ModifyError, Mtu, PdId, PostError, QpAttr,
    QpAttrMask, QpState, QpType, RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge, SgeList,
    UdDest, WcOpcode, WcStatus, GRH_LEN, MULTICAST_QPN,
};
pub use rdmx_mem::{
    Access, Backing, CacheConfig, CacheStats, HugePages, Invalidation, Mapping, MemlockLimit,
    Memory, Monitoring, Pinning, PoolConfig, PoolStats,
};
pub use rdmx_wire::GrhRepr;
pub use srq::SharedReceiveQueue;

/// A registration cache over a protection domain.
pub type RegCache = rdmx_mem::RegCache<ProtectionDomain>;
/// A handle to a cached registration.
pub type CacheHandle = rdmx_mem::CacheHandle<ProtectionDomain>;
/// A pool of buffers registered in a protection domain.
pub type BufferPool = rdmx_mem::BufferPool<ProtectionDomain>;
/// An owned buffer from a [`BufferPool`].
pub type PoolBuf = rdmx_mem::PoolBuf<ProtectionDomain>;

pub use pd::ProtectionDomain;

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
