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
    pub(crate) backend: Backend,
    /// loopback: faults applied to the packets this context's QPs send.
    pub(crate) faults: Option<Arc<crate::faults::Injector>>,
}

/// What a context runs on.
#[derive(Debug)]
pub(crate) enum Backend {
    /// The process-wide loopback fabric.
    Loopback,
    /// A tcp driver of this context's own.
    Tcp(Arc<crate::tcp::Driver>),
    /// An rdma-core device.
    #[cfg(feature = "verbs")]
    Verbs(Arc<crate::verbs::Device>),
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        if let Backend::Tcp(d) = &self.backend {
            d.shutdown();
        }
    }
}

/// How to open a context ([`Context::open_with`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ContextOptions {
    /// No progress thread: polling any of the context's CQs makes progress instead. The
    /// lowest latency, paid for with a busy core; one-sided operations aimed at this
    /// context then complete only while the application polls.
    pub busy_poll: bool,
    /// tcp: the address the context listens on for peers' queue pairs (default: every
    /// interface, a port the kernel picks).
    pub bind: Option<std::net::SocketAddr>,
    /// loopback: drop, delay, duplicate, reorder or corrupt the packets this context's
    /// queue pairs send ([`crate::faults`]), to test recovery. Other providers refuse it.
    pub faults: Option<crate::faults::Faults>,
    /// verbs: the device to open (default: the first one rdma-core lists).
    pub device: Option<String>,
    /// verbs: the GID index to use (default: the RoCEv2 GID of an IPv4 address, else
    /// another RoCEv2 GID, else index 0).
    pub gid_index: Option<u32>,
}

impl ContextOptions {
    /// Sets [`busy_poll`](Self::busy_poll).
    pub fn busy_poll(mut self, on: bool) -> Self {
        self.busy_poll = on;
        self
    }
    /// Sets [`bind`](Self::bind).
    pub fn bind(mut self, addr: std::net::SocketAddr) -> Self {
        self.bind = Some(addr);
        self
    }
    /// Sets [`faults`](Self::faults).
    pub fn faults(mut self, faults: crate::faults::Faults) -> Self {
        self.faults = Some(faults);
        self
    }
    /// Sets [`device`](Self::device).
    pub fn device(mut self, name: &str) -> Self {
        self.device = Some(name.to_string());
        self
    }
    /// Sets [`gid_index`](Self::gid_index).
    pub fn gid_index(mut self, index: u32) -> Self {
        self.gid_index = Some(index);
        self
    }
}

impl Context {
    /// Opens the default provider's device (loopback).
    pub fn open() -> Result<Context> {
        Self::open_provider(ProviderKind::Loopback.name())
    }

    /// Opens the device of the provider named `name`; an unknown or unavailable provider
    /// is an error that lists the available ones.
    pub fn open_provider(name: &str) -> Result<Context> {
        Self::open_with(name, &ContextOptions::default())
    }

    /// Opens the device of the provider named `name` with `opts`.
    pub fn open_with(name: &str, opts: &ContextOptions) -> Result<Context> {
        let kind = ProviderKind::from_name(name)?;
        if kind != ProviderKind::Verbs && (opts.device.is_some() || opts.gid_index.is_some()) {
            if let Some(d) = opts.device.as_deref().filter(|&d| d != kind.device_name()) {
                return Err(Error::NoDevice(format!(
                    "provider {name} has no device {d}; its device is {}",
                    kind.device_name()
                )));
            }
            if opts.gid_index.is_some() {
                return Err(Error::InvalidArgument("a GID index is a verbs option"));
            }
        }
        let mut seed = [0u8; 8];
        getrandom::fill(&mut seed).map_err(|e| Error::Seed(e.to_string()))?;
        let seed = u64::from_ne_bytes(seed);
        let backend = match kind {
            ProviderKind::Loopback => {
                crate::loopback::start_progress_thread();
                Backend::Loopback
            }
            ProviderKind::Tcp if opts.faults.is_some() => {
                return Err(Error::InvalidArgument(
                    "fault injection is a loopback option",
                ))
            }
            ProviderKind::Tcp => {
                let bind = opts.bind.unwrap_or_else(|| {
                    std::net::SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, 0))
                });
                Backend::Tcp(crate::tcp::Driver::start(
                    bind,
                    opts.busy_poll,
                    (seed >> 32) as u32,
                )?)
            }
            ProviderKind::Verbs if opts.faults.is_some() || opts.bind.is_some() => {
                return Err(Error::InvalidArgument(
                    "fault injection and bind are not verbs options",
                ))
            }
            #[cfg(feature = "verbs")]
            ProviderKind::Verbs => {
                let dev = crate::verbs::Device::open(opts.device.as_deref(), opts.gid_index)?;
                let caps = dev.caps.clone();
                return Ok(Self::build_with(seed, kind, caps, Backend::Verbs(dev)));
            }
            #[cfg(not(feature = "verbs"))]
            ProviderKind::Verbs => {
                return Err(Error::NoDevice(
                    "no RDMA devices: rdmx was built without its verbs feature".to_string(),
                ))
            }
        };
        let mut ctx = Self::build(seed, kind, backend);
        if let Some(f) = &opts.faults {
            Arc::get_mut(&mut ctx.inner).expect("a new context").faults =
                Some(Arc::new(crate::faults::Injector::new(f.clone())));
        }
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
        crate::loopback::start_progress_thread();
        Self::build(seed, ProviderKind::Loopback, Backend::Loopback)
    }

    fn build(seed: u64, provider: ProviderKind, backend: Backend) -> Context {
        Self::build_with(seed, provider, Capabilities::of(provider), backend)
    }

    fn build_with(
        seed: u64,
        provider: ProviderKind,
        caps: Capabilities,
        backend: Backend,
    ) -> Context {
        Context {
            inner: Arc::new(ContextInner {
                mrs: RwLock::new(MrTable::new(seed)),
                next_pd: AtomicU32::new(1),
                provider,
                caps,
                backend,
                faults: None,
            }),
        }
    }

    /// The name of the open device (`loopback0`, `tcp0`, or rdma-core's, e.g. `mlx5_0`).
    pub fn device_name(&self) -> &str {
        match &self.inner.backend {
            #[cfg(feature = "verbs")]
            Backend::Verbs(d) => &d.name,
            _ => self.inner.provider.device_name(),
        }
    }

    /// verbs: the GID index and GID this context's queue pairs use.
    pub fn gid(&self) -> Option<(u32, std::net::Ipv6Addr)> {
        match &self.inner.backend {
            #[cfg(feature = "verbs")]
            Backend::Verbs(d) => Some((d.gid_index, d.gid())),
            _ => None,
        }
    }

    /// tcp: the address this context listens on for peers' queue pairs.
    pub fn listen_addr(&self) -> Option<std::net::SocketAddr> {
        match &self.inner.backend {
            Backend::Tcp(d) => Some(d.local_addr()),
            _ => None,
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
        let progress = match &self.inner.backend {
            Backend::Loopback => crate::cq::Progress::Loopback,
            Backend::Tcp(d) if d.busy_poll() => crate::cq::Progress::Tcp(d.clone()),
            Backend::Tcp(_) => crate::cq::Progress::Background,
            #[cfg(feature = "verbs")]
            Backend::Verbs(d) => return CompletionQueue::new_verbs(capacity, d),
        };
        CompletionQueue::new(capacity, progress)
    }

    /// Memory regions registered in this context now.
    pub fn registered_regions(&self) -> usize {
        match &self.inner.backend {
            #[cfg(feature = "verbs")]
            Backend::Verbs(d) => d.registered_regions(),
            _ => self.inner.mrs.read().len(),
        }
    }
}
