//! # rdmx: efficient data transfer with RDMA semantics
//!
//! rdmx gives one verbs-shaped, safe API over several providers. It is built in layers,
//! each its own crate, top-down:
//!
//! - **rdmx** (this crate): the facade users program against: [`Context`],
//!   [`ProtectionDomain`], [`MemoryRegion`], the registration cache ([`RegCache`]) and
//!   registered-buffer pools ([`BufferPool`]).
//! - **rdmx-core**: the sans-IO core. Memory-region keys and the checks every provider
//!   runs before touching memory ([`rdmx_core::MrTable`]).
//! - **rdmx-mem**: the memory layer. Pinning with `RLIMIT_MEMLOCK` diagnostics, the
//!   registration cache and its `munmap` monitor, buffer pools, hugepage mappings.
//!
//! ## Quick start
//!
//! ```
//! use rdmx::{Access, Context};
//!
//! let ctx = Context::open()?;
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
//! ## Memory safety
//!
//! - A region's keys die the moment it is deregistered; its memory lives until nothing
//!   uses it ([`MrRef`]).
//! - Memory that the adapter or a peer may write is reached through copying accessors or
//!   owned pool buffers, never through long-lived slices.
//! - Registering memory the caller keeps owning is `unsafe`
//!   ([`ProtectionDomain::register_raw`]); owned memory ([`Memory`]) is safe.

pub mod cm;
mod context;
mod cq;
mod error;
pub mod faults;
mod loopback;
mod mem;
mod mr;
mod pd;
mod provider;
mod qp;
mod tcp;
#[cfg(feature = "verbs")]
mod verbs;

pub use context::{Context, ContextOptions};
pub use cq::CompletionQueue;
pub use error::{Error, Result};
pub use mr::{MemoryRegion, MrRef, RemoteRegion};
pub use pd::ProtectionDomain;
pub use provider::{devices, AtomicCap, Capabilities, DeviceInfo, ProviderKind};
pub use qp::{
    ConnectOptions, LocalSge, QpCaps, QpEndpoint, QueuePair, RecvRequest, SendRequest,
    SharedReceiveQueue,
};
pub use rdmx_core::{
    Completion, KeyError, KeyUse, ModifyError, Mtu, PdId, PostError, QpAttr, QpAttrMask, QpState,
    RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge, WcOpcode, WcStatus,
};
pub use rdmx_mem::{
    Access, Backing, CacheConfig, CacheStats, HugePages, Invalidation, Mapping, MemlockLimit,
    Memory, Monitoring, Pinning, PoolConfig, PoolStats,
};

/// A registration cache over a protection domain.
pub type RegCache = rdmx_mem::RegCache<ProtectionDomain>;
/// A handle to a cached registration.
pub type CacheHandle = rdmx_mem::CacheHandle<ProtectionDomain>;
/// A pool of buffers registered in a protection domain.
pub type BufferPool = rdmx_mem::BufferPool<ProtectionDomain>;
/// An owned buffer from a [`BufferPool`].
pub type PoolBuf = rdmx_mem::PoolBuf<ProtectionDomain>;

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
