//! Errors of the rdmx API.

use rdmx_core::{KeyError, TableError};

/// An rdmx verb failed.
///
/// A failed work completion is a status, not an `Error`; this type is for verbs that fail
/// when called.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Registering memory failed in the memory layer (access flags, range, pinning).
    #[error("register memory region: {0}")]
    Register(#[from] rdmx_mem::Error),
    /// The memory-region table refused the registration.
    #[error("register memory region: {0}")]
    Table(#[from] TableError),
    /// A key lookup failed.
    #[error(transparent)]
    Key(#[from] KeyError),
    /// An access to a region's bytes fell outside it.
    #[error("{len} bytes at offset {offset} are outside a region of {region_len} bytes")]
    OutOfBounds {
        /// Offset asked for.
        offset: usize,
        /// Length asked for.
        len: usize,
        /// The region's length.
        region_len: usize,
    },
    /// An 8-byte atomic access at an offset that is not 8-aligned in memory.
    #[error("atomic access at offset {offset} is not 8-byte aligned")]
    Misaligned {
        /// Offset asked for.
        offset: usize,
    },
    /// The completion queue overflowed; completions were lost.
    #[error("completion queue overrun: completions arrived while it was full")]
    CqOverrun,
    /// An argument that cannot be valid.
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    /// A system call failed.
    #[error("{0} failed")]
    Io(&'static str, #[source] std::io::Error),
    /// A post was refused.
    #[error(transparent)]
    Post(#[from] rdmx_core::PostError),
    /// A queue-pair modify was refused.
    #[error(transparent)]
    Modify(#[from] rdmx_core::ModifyError),
    /// No provider of that name is available.
    #[error("no provider named {name:?}; available: {available}")]
    UnknownProvider {
        /// The name asked for.
        name: String,
        /// The providers this build offers.
        available: String,
    },
    /// The provider has no device to open (verbs: no RDMA device, or none of that name).
    #[error("{0}")]
    NoDevice(String),
    /// An operation did not finish within its timeout.
    #[error("timed out: {0}")]
    Timeout(&'static str),

    /// The operation is not available for these objects (provider or build).
    #[error("unsupported: {0}")]
    Unsupported(&'static str),

    /// The RDMA connection manager (rdma_cm) reported an event other than the one the
    /// step waited for, or a failure status: e.g. `RDMA_CM_EVENT_REJECTED` (status 8:
    /// nobody listens on that port), `RDMA_CM_EVENT_UNREACHABLE`, `RDMA_CM_EVENT_ADDR_ERROR`,
    /// `RDMA_CM_EVENT_ROUTE_ERROR`, `RDMA_CM_EVENT_CONNECT_ERROR`.
    #[error("{during}: {event} (status {status}){}", rdma_cm_hint(.event, *.status))]
    RdmaCm {
        /// The `rdma_cm_event_type` that came, by name.
        event: &'static str,
        /// The event's status (for REJECTED, the IB CM reject reason).
        status: i32,
        /// What the step was doing.
        during: &'static str,
    },

    /// A peer broke the connection-setup protocol.
    #[error("connection setup: {0}")]
    Protocol(&'static str),

    /// The operating system's random source failed while opening a context.
    #[error("open context: no random seed for memory keys: {0}")]
    Seed(String),
}

fn rdma_cm_hint(event: &str, status: i32) -> &'static str {
    match (event, status) {
        ("RDMA_CM_EVENT_REJECTED", 8) => ": nobody listens on that port",
        ("RDMA_CM_EVENT_REJECTED", 28) => ": the peer rejected the connection",
        ("RDMA_CM_EVENT_UNREACHABLE", _) => ": the peer did not answer",
        _ => "",
    }
}

/// Result of an rdmx verb.
pub type Result<T, E = Error> = std::result::Result<T, E>;
