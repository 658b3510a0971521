//! An open device: the owner of protection domains and completion queues.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use rdmx_core::PdId;

use crate::cq::CompletionQueue;
use crate::endpoint::PeerAddr;
use crate::pd::ProtectionDomain;
use crate::provider::{Capabilities, Device, ProviderConfig};
use crate::{Error, Result};

/// An open device (`ibv_context`) of some provider.
///
/// Keys are per context, as on an adapter; on the software providers their starting
/// variants are drawn at random when the context opens, so keys differ from run to run.
/// Cloning is cheap and shares the context.
#[derive(Clone, Debug)]
pub struct Context {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    device: Arc<dyn Device>,
    next_pd: AtomicU32,
}

impl Context {
    /// Opens a device of the provider `config` names, with its options:
    ///
    /// ```
    /// # fn main() -> rdmx::Result<()> {
    /// let ctx = rdmx::Context::open(rdmx::tcp::Options::default().busy_poll(true))?;
    /// assert_eq!(ctx.provider(), "tcp");
    /// # Ok(()) }
    /// ```
    pub fn open(config: impl Into<ProviderConfig>) -> Result<Context> {
        Ok(Self::from_device(config.into().open()?))
    }

    /// Opens the default provider's device (loopback: queue pairs of this process).
    pub fn open_default() -> Result<Context> {
        Self::open_provider(crate::loopback::NAME)
    }

    /// Opens the first device of the provider named `name` with its default options, as
    /// `rdmx bench --provider` does; an unknown provider is an error that lists the
    /// available ones.
    pub fn open_provider(name: &str) -> Result<Context> {
        Self::open_device(name, None)
    }

    /// Opens device `device` (or the first) of the provider named `name`, with its
    /// default options.
    pub fn open_device(name: &str, device: Option<&str>) -> Result<Context> {
        let entry = crate::PROVIDERS
            .iter()
            .find(|p| p.name == name)
            .ok_or_else(|| Error::UnknownProvider {
                name: name.to_string(),
                available: crate::provider_names().collect::<Vec<_>>().join(", "),
            })?;
        Ok(Self::from_device((entry.open)(device)?))
    }

    fn from_device(device: Arc<dyn Device>) -> Context {
        Context {
            inner: Arc::new(Inner {
                device,
                next_pd: AtomicU32::new(1),
            }),
        }
    }

    pub(crate) fn device(&self) -> &Arc<dyn Device> {
        &self.inner.device
    }

    /// Whether `other` is this context (or a clone of it): protection domain ids are
    /// numbered per context.
    pub(crate) fn same(&self, other: &Context) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The name of the provider this context runs on (`loopback`, `tcp`, `verbs`, ...).
    pub fn provider(&self) -> &'static str {
        self.inner.device.provider()
    }

    /// What the device can do.
    pub fn capabilities(&self) -> &Capabilities {
        self.inner.device.caps()
    }

    /// The name of the open device (`loopback0`, `tcp0`, or rdma-core's, e.g. `mlx5_0`).
    pub fn device_name(&self) -> &str {
        self.inner.device.name()
    }

    /// Where peers reach this context's queue pairs: tcp, its listener; verbs, its GID.
    pub fn address(&self) -> PeerAddr {
        self.inner.device.address()
    }

    /// The IP address and port peers reach this context at, if it has one (tcp).
    pub fn listen_addr(&self) -> Option<std::net::SocketAddr> {
        match self.address() {
            PeerAddr::Ip(a) => Some(a),
            _ => None,
        }
    }

    /// verbs: the GID index and GID this context's queue pairs use.
    pub fn gid(&self) -> Option<(u32, std::net::Ipv6Addr)> {
        self.inner.device.gid()
    }

    /// Allocates a protection domain (`ibv_alloc_pd`).
    pub fn alloc_pd(&self) -> ProtectionDomain {
        let id = PdId(self.inner.next_pd.fetch_add(1, Ordering::Relaxed));
        ProtectionDomain::new(self.clone(), id)
    }

    /// Creates a completion queue holding up to `capacity` completions (`ibv_create_cq`).
    pub fn create_cq(&self, capacity: usize) -> Result<CompletionQueue> {
        if capacity > self.capabilities().max_cqe as usize {
            return Err(Error::InvalidArgument(
                "CQ capacity above the device's max_cqe",
            ));
        }
        CompletionQueue::new(self.inner.device.as_ref(), capacity)
    }

    /// Memory regions registered in this context now.
    pub fn registered_regions(&self) -> usize {
        self.inner.device.registered_regions()
    }
}
