//! The engine's errors. A failed transfer is not an `Err` but a request status
//! ([`RequestStatus::Failed`](crate::RequestStatus::Failed)) carrying the work-completion
//! status and the path; these are for calls that cannot start.

/// What went wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The facade refused an operation (opening a device, registering, posting).
    #[error(transparent)]
    Rdmx(#[from] rdmx::Error),
    /// A system call or socket operation failed.
    #[error("{0}: {1}")]
    Io(&'static str, #[source] std::io::Error),
    /// A descriptor or control message from a peer (or from etcd) was malformed, oversized
    /// or inconsistent.
    #[error("refused a descriptor or control message: {0}")]
    Descriptor(String),
    /// The two sides cannot be connected as asked (transport, GID, MTU, device); the
    /// message names both sides' values.
    #[error("cannot connect to {peer}: {why}")]
    Mismatch {
        /// The peer.
        peer: String,
        /// What differs, with both values.
        why: String,
    },
    /// The peer refused the handshake, with its reason.
    #[error("{peer} refused: {why}")]
    Refused {
        /// The peer.
        peer: String,
        /// Its reason.
        why: String,
    },
    /// A request that cannot be valid (bounds, access, unknown buffer, sizes).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The metadata service could not be reached or answered wrongly.
    #[error("metadata: {0}")]
    Metadata(String),
    /// Something did not finish in time.
    #[error("timed out: {0}")]
    Timeout(String),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
