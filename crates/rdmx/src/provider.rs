//! Providers: the backends a context runs on, and what their devices can do.
//!
//! Every provider keeps the same verbs contract:
//!
//! - `loopback`: queue pairs of one process connected through the RC engine with packets
//!   passed in memory; the default, and the reference for semantics.
//! - `tcp`: the RC engine over TCP streams, between processes and hosts, with payloads
//!   read and written straight from registered memory.
//! - `verbs` (cargo feature `verbs`, on by default): rdma-core, for InfiniBand, RoCE and
//!   iWARP adapters and Soft-RoCE; its devices are rdma-core's (`mlx5_0`, `rxe0`, ...).
//!   Without rdma-core or without RDMA devices it lists none and opening it says so.
//!
//! Asking for a provider that is not available is an error that says which are.

use rdmx_core::{Mtu, QpLimits};

use crate::{Error, Result};

/// A backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProviderKind {
    /// In-process queue pairs over the RC engine; the default.
    Loopback,
    /// The RC engine over TCP, across processes and hosts.
    Tcp,
    /// rdma-core (libibverbs): RDMA adapters and Soft-RoCE.
    Verbs,
}

impl ProviderKind {
    /// Every provider this build knows.
    #[cfg(feature = "verbs")]
    pub const ALL: &'static [ProviderKind] = &[
        ProviderKind::Loopback,
        ProviderKind::Tcp,
        ProviderKind::Verbs,
    ];
    /// Every provider this build knows.
    #[cfg(not(feature = "verbs"))]
    pub const ALL: &'static [ProviderKind] = &[ProviderKind::Loopback, ProviderKind::Tcp];

    /// The provider's name, as `--provider` takes it.
    pub fn name(self) -> &'static str {
        match self {
            ProviderKind::Loopback => "loopback",
            ProviderKind::Tcp => "tcp",
            ProviderKind::Verbs => "verbs",
        }
    }

    /// The name of this provider's one device; empty for verbs, whose devices are
    /// rdma-core's (see [`devices`] and [`Context::device_name`](crate::Context::device_name)).
    pub fn device_name(self) -> &'static str {
        match self {
            ProviderKind::Loopback => "loopback0",
            ProviderKind::Tcp => "tcp0",
            ProviderKind::Verbs => "",
        }
    }

    /// Looks a provider up by name.
    pub fn from_name(name: &str) -> Result<ProviderKind> {
        Self::ALL
            .iter()
            .copied()
            .find(|p| p.name() == name)
            .ok_or_else(|| Error::UnknownProvider {
                name: name.to_string(),
                available: Self::ALL
                    .iter()
                    .map(|p| p.name())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }
}

/// What a device can do (a subset of `ibv_device_attr` and `ibv_port_attr`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// Queue pairs.
    pub max_qp: u32,
    /// Depth of each send or receive queue.
    pub max_qp_wr: u32,
    /// SGEs per work request.
    pub max_sge: u32,
    /// Completions per CQ.
    pub max_cqe: u32,
    /// Memory regions.
    pub max_mr: u32,
    /// Largest memory region in bytes.
    pub max_mr_size: u64,
    /// READs/atomics a QP may have outstanding as responder (`max_qp_rd_atom`).
    pub max_qp_rd_atom: u8,
    /// READs/atomics a QP may issue at once (`max_qp_init_rd_atom`).
    pub max_qp_init_rd_atom: u8,
    /// Largest path MTU.
    pub max_mtu: Mtu,
    /// The path MTU connections use by default (`ibv_port_attr.active_mtu`).
    pub active_mtu: Mtu,
    /// Largest inline payload.
    pub max_inline_data: u32,
    /// Whether 8-byte atomics (CMP_SWAP, FETCH_ADD) are supported, and against what they
    /// are atomic (`ibv_device_attr.atomic_cap`).
    pub atomics: AtomicCap,
}

/// How atomic a device's 8-byte atomics are, as `ibv_atomic_cap` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AtomicCap {
    /// No atomics: CMP_SWAP and FETCH_ADD are refused (`IBV_ATOMIC_NONE`).
    None,
    /// Atomic against other atomics of this device only; a CPU atomic on the same word
    /// at the same time may be lost (`IBV_ATOMIC_HCA`; Soft-RoCE, most NICs).
    Device,
    /// Atomic against CPU atomics on the target memory too (`IBV_ATOMIC_GLOB`; the
    /// software providers, which run atomics with the CPU's own instructions).
    Global,
}

impl AtomicCap {
    /// True unless atomics are unsupported.
    pub fn supported(self) -> bool {
        self != AtomicCap::None
    }

    /// The name `rdmx devices` prints: `none`, `device` or `global`.
    pub fn name(self) -> &'static str {
        match self {
            AtomicCap::None => "none",
            AtomicCap::Device => "device",
            AtomicCap::Global => "global",
        }
    }
}

impl Capabilities {
    pub(crate) fn of(kind: ProviderKind) -> Self {
        let limits = crate::qp::limits(kind);
        let mut caps = Self::software(&limits);
        if kind == ProviderKind::Tcp {
            caps.active_mtu = Mtu::Bytes(crate::tcp::ACTIVE_MTU);
        }
        caps
    }

    fn software(limits: &QpLimits) -> Self {
        Capabilities {
            max_qp: 1 << 16,
            max_qp_wr: 1 << 14,
            max_sge: 32,
            max_cqe: 1 << 20,
            max_mr: (1 << rdmx_core::mr::INDEX_BITS) - 1,
            max_mr_size: u64::from(u32::MAX),
            max_qp_rd_atom: limits.max_dest_rd_atomic,
            max_qp_init_rd_atom: limits.max_rd_atomic,
            max_mtu: limits.max_mtu,
            active_mtu: limits.max_mtu,
            max_inline_data: 4096,
            atomics: AtomicCap::Global,
        }
    }
}

/// A device a provider offers.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceInfo {
    /// The provider.
    pub provider: ProviderKind,
    /// Device name.
    pub name: String,
    /// What it can do.
    pub capabilities: Capabilities,
    /// verbs: the GID index and GID a context on this device uses by default.
    pub gid: Option<(u32, std::net::Ipv6Addr)>,
}

/// Every device available on this machine: one per software provider, and each RDMA
/// device rdma-core offers.
pub fn devices() -> Vec<DeviceInfo> {
    let list: Vec<DeviceInfo> = ProviderKind::ALL
        .iter()
        .filter(|&&p| p != ProviderKind::Verbs)
        .map(|&p| DeviceInfo {
            provider: p,
            name: p.device_name().to_string(),
            capabilities: Capabilities::of(p),
            gid: None,
        })
        .collect();
    #[cfg(feature = "verbs")]
    let list = [list, crate::verbs::devices()].concat();
    list
}
