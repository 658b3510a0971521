//! What devices can do: [`Capabilities`], [`DeviceInfo`], and the queue sizes a queue pair
//! asks for ([`QpCaps`]).

use rdmx_core::{Mtu, QpType};

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
    /// The transport the device runs, which decides how its queue pairs connect.
    pub transport: Transport,
    /// Whether SEND_WITH_IMM and RDMA_WRITE_WITH_IMM are supported (not on iWARP, whose
    /// soft-iWARP provider refuses them at post).
    pub imm_data: bool,
    /// Most elements on the local side of an RDMA READ (iWARP: 1, the READ response lands
    /// in one buffer); other requests take up to [`max_sge`](Self::max_sge).
    pub max_read_sge: u32,
    /// Whether a SEND that finds no posted receive waits for one (Receiver Not Ready,
    /// retried as the queue pair's `rnr_retry` says). iWARP has no RNR: such a SEND breaks
    /// the connection.
    pub rnr_retry: bool,
    /// Whether a request the responder refuses (a bad key, bounds, access, a receive too
    /// short) completes with the remote error (`RemAccessErr`, `RemInvReqErr`, ...), as
    /// InfiniBand's NAK makes it. On iWARP the responder ends the connection instead: a
    /// SEND or WRITE has completed once handed to TCP, a READ completes with `WrFlushErr`,
    /// and the requester's queue pair goes to ERR.
    pub remote_error_completions: bool,
    /// Unreliable connected queue pairs ([`QpType::Uc`]) can be created.
    pub uc: bool,
    /// Unreliable datagram queue pairs ([`QpType::Ud`]) and address handles can be
    /// created.
    pub ud: bool,
    /// UD queue pairs can attach to multicast groups (`ibv_attach_mcast`).
    pub multicast: bool,
    /// Whether [`QueuePair::dropped`](crate::QueuePair::dropped) counts what a UD or UC
    /// queue pair drops on receipt (a wrong Q_Key, no receive posted, a lost packet). The
    /// software providers count; on verbs the device drops such packets where user space
    /// cannot see them, and the count stays 0.
    pub counts_dropped: bool,
}

impl Capabilities {
    /// Whether queue pairs of type `qp_type` can be created (RC always can).
    pub fn supports(&self, qp_type: QpType) -> bool {
        match qp_type {
            QpType::Rc => true,
            QpType::Uc => self.uc,
            QpType::Ud => self.ud,
        }
    }

    /// The QP types this device has, in `RC`, `UC`, `UD` order.
    pub fn qp_types(&self) -> impl Iterator<Item = QpType> + '_ {
        QpType::ALL.into_iter().filter(|&t| self.supports(t))
    }

    /// The largest UD message: the active path MTU (`ibv_ud_pingpong`'s limit).
    pub fn max_ud_message(&self) -> usize {
        self.active_mtu.bytes() as usize
    }
}

/// The transport protocol a device runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Transport {
    /// InfiniBand's transport (InfiniBand, RoCE, and the software providers, which run
    /// its RC protocol): queue pairs connect by exchanging endpoints
    /// ([`QueuePair::connect`](crate::QueuePair::connect)) or through a connection
    /// manager.
    InfiniBand,
    /// iWARP (RDMAP/DDP/MPA over TCP; soft-iWARP, iWARP adapters): queue pairs connect
    /// only through rdma_cm ([`verbs::cm`](crate::verbs::cm)), which also moves them to
    /// RTS; a queue pair has no peer QP number.
    Iwarp,
}

impl Transport {
    /// The name `rdmx devices` prints: `InfiniBand` or `iWARP`.
    pub fn name(self) -> &'static str {
        match self {
            Transport::InfiniBand => "InfiniBand",
            Transport::Iwarp => "iWARP",
        }
    }
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

/// A device a provider offers.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceInfo {
    /// The provider's name (`loopback`, `tcp`, `verbs`, ...).
    pub provider: &'static str,
    /// Device name.
    pub name: String,
    /// What it can do.
    pub capabilities: Capabilities,
    /// verbs: the GID index and GID a context on this device uses by default.
    pub gid: Option<(u32, std::net::Ipv6Addr)>,
}

/// Sizes of a queue pair's queues (`ibv_qp_cap`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: usize,
    /// Receive queue depth.
    pub max_recv_wr: usize,
    /// SGEs per send request.
    pub max_send_sge: usize,
    /// SGEs per receive request.
    pub max_recv_sge: usize,
    /// Largest inline payload in bytes.
    pub max_inline_data: usize,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 256,
        }
    }
}

impl QpCaps {
    /// Sets the send queue depth.
    pub fn max_send_wr(mut self, n: usize) -> Self {
        self.max_send_wr = n;
        self
    }
    /// Sets the receive queue depth.
    pub fn max_recv_wr(mut self, n: usize) -> Self {
        self.max_recv_wr = n;
        self
    }
    /// Sets SGEs per request, on both queues.
    pub fn max_sge(mut self, n: usize) -> Self {
        self.max_send_sge = n;
        self.max_recv_sge = n;
        self
    }
    /// Sets the largest inline payload.
    pub fn max_inline_data(mut self, n: usize) -> Self {
        self.max_inline_data = n;
        self
    }
}
