//! Errors of the memory layer.

use std::fmt;
use std::io;

use crate::access::InvalidAccess;

/// Everything that can go wrong while pinning, mapping, registering or pooling memory.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Access flags break the verbs rule.
    #[error(transparent)]
    InvalidAccess(#[from] InvalidAccess),
    /// An empty range, or one whose end overflows the address space.
    #[error("invalid memory range: {len} bytes at {addr:#x}")]
    InvalidRange {
        /// Start address.
        addr: usize,
        /// Length in bytes.
        len: usize,
    },
    /// Pinning would exceed `RLIMIT_MEMLOCK`.
    #[error(transparent)]
    MemlockLimit(#[from] MemlockLimit),
    /// `mlock` failed for another reason.
    #[error("mlock of {len} bytes at {addr:#x} failed")]
    Pin {
        /// Start address.
        addr: usize,
        /// Length in bytes.
        len: usize,
        /// The system error.
        #[source]
        source: io::Error,
    },
    /// `mmap` failed.
    #[error("mmap of {len} bytes failed")]
    Map {
        /// Length in bytes.
        len: usize,
        /// The system error.
        #[source]
        source: io::Error,
    },
    /// A pool reached its configured byte limit.
    #[error("buffer pool exhausted: {limit} bytes registered, the configured maximum")]
    PoolExhausted {
        /// The configured maximum.
        limit: usize,
    },
    /// A pool request larger than its largest size class.
    #[error("requested {len} bytes but the largest size class of this pool is {max} bytes")]
    TooLarge {
        /// Bytes requested.
        len: usize,
        /// Largest class.
        max: usize,
    },
    /// A pool configuration that cannot work.
    #[error(transparent)]
    InvalidPoolConfig(#[from] crate::pool::InvalidPoolConfig),
    /// The registration layer above refused (key space exhausted, device error, ...).
    #[error("registration failed: {0}")]
    Registrar(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Pinning would exceed the process's `RLIMIT_MEMLOCK`.
///
/// The message names the limit, what was asked for and how to raise the limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemlockLimit {
    /// Bytes this registration needed to lock (whole pages not already locked by rdmx).
    pub requested: usize,
    /// The soft `RLIMIT_MEMLOCK` in bytes; `None` when unlimited.
    pub limit: Option<u64>,
    /// Bytes already locked by this process (`VmLck`), when known.
    pub locked: Option<u64>,
}

impl fmt::Display for MemlockLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cannot pin {} bytes: RLIMIT_MEMLOCK is ", self.requested)?;
        match self.limit {
            Some(l) => write!(f, "{l} bytes ({})", human(l))?,
            None => write!(f, "unlimited")?,
        }
        if let Some(locked) = self.locked {
            write!(f, " and {locked} bytes are already locked by this process")?;
        }
        write!(
            f,
            ". Raise the limit (`ulimit -l unlimited` in the shell, a `memlock` line in \
             /etc/security/limits.conf, `LimitMEMLOCK=infinity` for a systemd service, \
             `--ulimit memlock=-1` for a container), grant CAP_IPC_LOCK, or register with \
             Pinning::Unpinned"
        )
    }
}

impl std::error::Error for MemlockLimit {}

fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memlock_message_names_limit_request_and_fix() {
        let e = MemlockLimit {
            requested: 4 << 20,
            limit: Some(8 << 20),
            locked: Some(6 << 20),
        };
        let s = e.to_string();
        assert!(s.contains("4194304 bytes"), "{s}");
        assert!(s.contains("8388608 bytes (8 MiB)"), "{s}");
        assert!(s.contains("6291456 bytes are already locked"), "{s}");
        assert!(s.contains("ulimit -l"), "{s}");
    }
}
