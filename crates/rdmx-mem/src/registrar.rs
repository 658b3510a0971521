//! The seam between this crate and whoever registers memory with an adapter.
//!
//! The registration cache and the buffer pools do not know about protection domains or
//! providers: they call a [`Registrar`] (in rdmx, a protection domain) and keep the
//! [`Region`] it returns. Dropping a `Region` deregisters it.

use std::sync::atomic::{AtomicU32, Ordering};

use crate::access::Access;
use crate::pin::{PinGuard, Pinning};
use crate::{Error, Mapping};

/// Something that registers memory: a protection domain of some provider.
pub trait Registrar: Send + Sync + 'static {
    /// A registration; dropping it deregisters.
    type Region: Region;

    /// Registers `[addr, addr + len)` with `access`.
    ///
    /// # Safety
    ///
    /// The memory must stay mapped and must not be used in a way that conflicts with
    /// `access` (for example through a live `&[u8]` while it is writable) until the
    /// returned region is dropped.
    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Self::Region, Error>;

    /// Registers all of `mapping` with `access`, handing it over: the registration keeps
    /// it mapped for as long as anything uses it, not only until the region is dropped
    /// (a provider may still be placing a peer's bytes into it then). What the pools
    /// register.
    fn register_mapping(&self, mapping: Mapping, access: Access) -> Result<Self::Region, Error>;
}

/// A registered memory region as seen by the cache and the pools.
pub trait Region: Send + Sync + 'static {
    /// First registered byte.
    fn addr(&self) -> usize;
    /// Registered length in bytes.
    fn len(&self) -> usize;
    /// Whether the region is empty (registrations never are).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Local key.
    fn lkey(&self) -> u32;
    /// Remote key.
    fn rkey(&self) -> u32;
    /// Access flags it was registered with.
    fn access(&self) -> Access;
    /// Whether `[addr, addr + len)` lies inside this region (overflow-safe).
    fn covers(&self, addr: usize, len: usize) -> bool {
        match (addr.checked_add(len), self.addr().checked_add(self.len())) {
            (Some(end), Some(my_end)) => addr >= self.addr() && end <= my_end,
            _ => false,
        }
    }
}

/// A registrar that only pins memory and numbers keys with a counter.
///
/// It has no key table and checks nothing remote; it exists to test and measure the cache
/// and the pools on their own. rdmx's protection domains are the real registrars.
#[derive(Debug)]
pub struct PinOnly {
    pinning: Pinning,
    next_key: AtomicU32,
}

impl PinOnly {
    /// A registrar that pins with `pinning`.
    pub fn new(pinning: Pinning) -> Self {
        PinOnly {
            pinning,
            next_key: AtomicU32::new(1),
        }
    }
}

/// A region registered by [`PinOnly`].
#[derive(Debug)]
pub struct PinOnlyRegion {
    addr: usize,
    len: usize,
    key: u32,
    access: Access,
    _pin: Option<PinGuard>,
    /// The memory, when it was handed over (unmapped after the pin goes).
    _owned: Option<Mapping>,
}

impl Registrar for PinOnly {
    type Region = PinOnlyRegion;

    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<PinOnlyRegion, Error> {
        access.validate()?;
        let pin = crate::pin::pin(addr as usize, len, self.pinning)?;
        Ok(PinOnlyRegion {
            addr: addr as usize,
            len,
            key: self.next_key.fetch_add(1, Ordering::Relaxed),
            access,
            _pin: pin,
            _owned: None,
        })
    }

    fn register_mapping(&self, mapping: Mapping, access: Access) -> Result<PinOnlyRegion, Error> {
        // SAFETY: the region owns the mapping from here on and drops it last, so it stays
        // mapped for as long as the region lives.
        let mut region = unsafe { self.register(mapping.as_ptr(), mapping.len(), access) }?;
        region._owned = Some(mapping);
        Ok(region)
    }
}

impl Region for PinOnlyRegion {
    fn addr(&self) -> usize {
        self.addr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn lkey(&self) -> u32 {
        self.key
    }
    fn rkey(&self) -> u32 {
        self.key
    }
    fn access(&self) -> Access {
        self.access
    }
}
