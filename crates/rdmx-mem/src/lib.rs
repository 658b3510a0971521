//! # rdmx-mem: the memory layer of rdmx
//!
//! The one place raw memory lives. Everything here serves memory registration:
//!
//! - [`pin`]: locking pages with `mlock`, counted per page range so overlapping
//!   registrations never unlock each other's pages, and `RLIMIT_MEMLOCK` errors that say
//!   how to raise the limit.
//! - [`mapping`]: owned anonymous mappings, optionally hugepage-backed, and the
//!   [`Memory`] trait for memory a registration may own.
//! - [`shared`]: memfd-backed mappings a provider may hand to a peer process, and taking
//!   them back.
//! - [`registrar`]: the [`Registrar`] / [`Region`] seam. The cache and the pools call a
//!   registrar (in rdmx, a protection domain) and know nothing of providers.
//! - [`cache`]: a registration cache for callers that bring plain buffers, with
//!   refcounted handles, an LRU of idle entries bounded by count and bytes, explicit
//!   invalidation, and automatic invalidation on `munmap`/`madvise` through [`monitor`].
//! - [`pool`]: registered-buffer pools in size classes, with per-thread caches so the hot
//!   path takes no global lock.
//!
//! Access flags ([`Access`]) are defined in the sans-IO core (`rdmx-core`), which checks
//! them on every key use, and re-exported here because every registration carries them.
//! The layers, lowest first: `rdmx-wire`, `rdmx-core`, `rdmx-mem`, then the facade.

pub mod access;
pub mod cache;
pub mod error;
pub mod mapping;
pub mod monitor;
pub mod pin;
pub mod pool;
mod ranges;
pub mod registrar;
pub mod shared;
pub mod sys;

pub use access::{Access, InvalidAccess};
pub use cache::{CacheConfig, CacheHandle, CacheStats, Invalidation, Monitoring, RegCache};
pub use error::{Error, MemlockLimit};
pub use mapping::{Backing, HugePages, Mapping, Memory};
pub use pin::{PinGuard, Pinning};
pub use pool::{BufferPool, PoolBuf, PoolConfig, PoolStats};
pub use registrar::{PinOnly, Region, Registrar};
