//! An open device: the owner of protection domains and of the memory-region table.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;
use rdmx_core::{MrTable, PdId};

use crate::cq::CompletionQueue;
use crate::mr::MrShared;
use crate::pd::ProtectionDomain;
use crate::provider::{Capabilities, ProviderKind};
use crate::{Error, Result};

/// An open device (`ibv_context`).
///
/// Keys are per context, as on an adapter: the memory-region table lives here, and its
/// starting key variants are drawn at random when the context opens, so keys differ from
/// run to run. Cloning is cheap and shares the context.
#[derive(Clone, Debug)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

#[derive(Debug)]
pub(crate) struct ContextInner {
    pub(crate) mrs: RwLock<MrTable<Arc<MrShared>>>,
    next_pd: AtomicU32,
    provider: ProviderKind,
    caps: Capabilities,
}

impl Context {
    /// Opens the default provider's device (loopback).
    pub fn open() -> Result<Context> {
        Self::open_provider(ProviderKind::Loopback.name())
    }

    /// Opens the device of the provider named `name`; an unknown or unavailable provider
    /// is an error that lists the available ones.
    pub fn open_provider(name: &str) -> Result<Context> {
        let _kind = ProviderKind::from_name(name)?;
        let mut seed = [0u8; 8];
        getrandom::fill(&mut seed).map_err(|e| Error::Seed(e.to_string()))?;
        let ctx = Self::with_seed(u64::from_ne_bytes(seed));
        crate::loopback::start_progress_thread();
        Ok(ctx)
    }

    /// The provider this context runs on.
    pub fn provider(&self) -> ProviderKind {
        self.inner.provider
    }

    /// What the device can do.
    pub fn capabilities(&self) -> &Capabilities {
        &self.inner.caps
    }

    /// Opens a software context whose key variants derive from `seed`.
    ///
    /// Keys are then predictable; this is for reproducible tests only.
    pub fn with_seed(seed: u64) -> Context {
        Context {
            inner: Arc::new(ContextInner {
                mrs: RwLock::new(MrTable::new(seed)),
                next_pd: AtomicU32::new(1),
                provider: ProviderKind::Loopback,
                caps: Capabilities::loopback(),
            }),
        }
    }

    /// Allocates a protection domain (`ibv_alloc_pd`).
    pub fn alloc_pd(&self) -> ProtectionDomain {
        let id = PdId(self.inner.next_pd.fetch_add(1, Ordering::Relaxed));
        ProtectionDomain::new(self.clone(), id)
    }

    /// Creates a completion queue holding up to `capacity` completions (`ibv_create_cq`).
    pub fn create_cq(&self, capacity: usize) -> Result<CompletionQueue> {
        if capacity > self.inner.caps.max_cqe as usize {
            return Err(Error::InvalidArgument(
                "CQ capacity above the device's max_cqe",
            ));
        }
        CompletionQueue::new(capacity)
    }

    /// Memory regions registered in this context now.
    pub fn registered_regions(&self) -> usize {
        self.inner.mrs.read().len()
    }
}
