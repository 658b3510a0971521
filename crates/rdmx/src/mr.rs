//! Memory regions: registered memory with its keys, kept alive while anything uses it.
//!
//! A [`MemoryRegion`] is the owner's handle. Dropping it (or calling
//! [`deregister`](MemoryRegion::deregister)) removes the region from its context's key
//! table at once, so its keys stop working immediately. The memory itself, and its pin,
//! live on in a shared part for as long as an [`MrRef`] holds it: a posted work request
//! holds one until its completion is reaped, so no safe call can make a provider touch
//! deregistered or freed memory.
//!
//! Registered memory may be written by the adapter or by a peer at any time, so safe code
//! reaches it only through copying accessors ([`read_at`](MemoryRegion::read_at),
//! [`write_at`](MemoryRegion::write_at)), never through a long-lived `&[u8]`.

use std::sync::Arc;

use rdmx_core::PdId;
use rdmx_mem::Access;

use crate::endpoint::RemoteRegion;
use crate::provider::mem::region_getters;
use crate::provider::{MrRef, MrShared};
use crate::{Context, Result};

/// A registered memory region (`ibv_mr`), owned by the caller.
#[derive(Debug)]
pub struct MemoryRegion {
    shared: Arc<MrShared>,
    ctx: Context,
}

impl MemoryRegion {
    pub(crate) fn new(shared: Arc<MrShared>, ctx: Context) -> Self {
        MemoryRegion { shared, ctx }
    }

    region_getters!();

    /// Address, length and rkey, to hand to a peer.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            addr: self.shared.addr as u64,
            len: self.shared.len as u64,
            rkey: self.shared.rkey,
        }
    }

    /// The remote address of the byte at `offset`, with this region's rkey.
    pub fn remote_at(&self, offset: usize) -> rdmx_core::RemoteAddr {
        rdmx_core::RemoteAddr {
            addr: self.shared.addr as u64 + offset as u64,
            rkey: self.shared.rkey,
        }
    }

    /// A reference that keeps the memory alive (what a posted work request holds).
    pub fn share(&self) -> MrRef {
        MrRef::new(self.shared.clone())
    }

    /// Deregisters (`ibv_dereg_mr`): the keys stop working now; the memory is released
    /// once no [`MrRef`] uses it. Same as dropping the region.
    pub fn deregister(self) {}
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // Keys die now; the memory lives on while posted requests hold it.
        self.ctx.device().deregister(&self.shared);
    }
}

impl rdmx_mem::Region for MemoryRegion {
    fn addr(&self) -> usize {
        MemoryRegion::addr(self)
    }
    fn len(&self) -> usize {
        MemoryRegion::len(self)
    }
    fn lkey(&self) -> u32 {
        MemoryRegion::lkey(self)
    }
    fn rkey(&self) -> u32 {
        MemoryRegion::rkey(self)
    }
    fn access(&self) -> Access {
        MemoryRegion::access(self)
    }
}
