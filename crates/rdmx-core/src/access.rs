//! Access flags of a memory registration, as in verbs (`IBV_ACCESS_*`), and the rule they
//! obey. The key table checks them on every use; queue pairs carry them too.

use bitflags::bitflags;

bitflags! {
    /// What a memory region allows: local writes by the adapter, and remote READ, WRITE and
    /// atomics through its rkey. Local reads are always allowed.
    ///
    /// As in verbs, `REMOTE_WRITE` or `REMOTE_ATOMIC` without `LOCAL_WRITE` is invalid; see
    /// [`Access::validate`].
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
    pub struct Access: u32 {
        /// The local adapter may write the region (RECV targets, READ and atomic results).
        const LOCAL_WRITE = 1 << 0;
        /// A remote peer may write the region with RDMA WRITE.
        const REMOTE_WRITE = 1 << 1;
        /// A remote peer may read the region with RDMA READ.
        const REMOTE_READ = 1 << 2;
        /// A remote peer may run atomic operations on the region.
        const REMOTE_ATOMIC = 1 << 3;
    }
}

impl Access {
    /// Flags that let a remote peer change the memory.
    pub const REMOTE_MUTATE: Access = Access::REMOTE_WRITE.union(Access::REMOTE_ATOMIC);

    /// Everything: local write and all remote access.
    pub const ALL: Access = Access::all();

    /// Checks the verbs rule: remote write or atomic access requires local write.
    pub fn validate(self) -> Result<Access, InvalidAccess> {
        if self.intersects(Access::REMOTE_MUTATE) && !self.contains(Access::LOCAL_WRITE) {
            Err(InvalidAccess(self))
        } else {
            Ok(self)
        }
    }

    /// Whether anything other than this process's own safe code may write the memory.
    pub fn is_shared_writable(self) -> bool {
        self.intersects(Access::LOCAL_WRITE | Access::REMOTE_MUTATE)
    }
}

/// The access flags break the verbs rule (remote write or atomic without local write).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid access flags {0:?}: REMOTE_WRITE and REMOTE_ATOMIC require LOCAL_WRITE")]
pub struct InvalidAccess(pub Access);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_write_or_atomic_needs_local_write() {
        assert!(Access::REMOTE_WRITE.validate().is_err());
        assert!(Access::REMOTE_ATOMIC.validate().is_err());
        assert!((Access::REMOTE_READ | Access::REMOTE_ATOMIC)
            .validate()
            .is_err());
        assert!(Access::empty().validate().is_ok());
        assert!(Access::REMOTE_READ.validate().is_ok());
        assert!((Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .validate()
            .is_ok());
        assert!(Access::ALL.validate().is_ok());
    }
}
