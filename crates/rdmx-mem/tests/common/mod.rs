//! Test helpers shared by the integration tests of rdmx-mem.
#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rdmx_mem::pool::PoolBuf;
use rdmx_mem::registrar::PinOnlyRegion;
use rdmx_mem::{Access, Error, Mapping, PinOnly, Pinning, Region, Registrar};

/// What the counting registrar knows of a live region.
#[derive(Clone, Copy, Debug)]
pub struct Reg {
    pub addr: usize,
    pub len: usize,
    pub lkey: u32,
    pub rkey: u32,
}

/// Wraps `PinOnly`, gives each region an rkey different from its lkey and records the
/// live regions.
#[derive(Clone)]
pub struct Counting {
    inner: Arc<PinOnly>,
    live: Arc<Mutex<HashMap<u32, Reg>>>,
}

impl Counting {
    pub fn new() -> Self {
        Self::with_pinning(Pinning::Unpinned)
    }

    pub fn with_pinning(pinning: Pinning) -> Self {
        Counting {
            inner: Arc::new(PinOnly::new(pinning)),
            live: Arc::default(),
        }
    }

    pub fn live(&self) -> Vec<Reg> {
        self.live.lock().unwrap().values().copied().collect()
    }

    /// The one live region covering the buffer, and that there is exactly one.
    pub fn region_of<R: Registrar>(&self, buf: &PoolBuf<R>) -> Reg {
        let hits: Vec<Reg> = self
            .live()
            .into_iter()
            .filter(|r| buf.addr() >= r.addr && buf.addr() + buf.capacity() <= r.addr + r.len)
            .collect();
        assert_eq!(hits.len(), 1, "buffer {buf:?} in regions {hits:?}");
        hits[0]
    }
}

pub struct CountingRegion {
    inner: PinOnlyRegion,
    live: Arc<Mutex<HashMap<u32, Reg>>>,
}

impl Registrar for Counting {
    type Region = CountingRegion;

    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<CountingRegion, Error> {
        // SAFETY: forwarded with the caller's guarantees.
        let inner = unsafe { self.inner.register(addr, len, access) }?;
        Ok(self.count(inner))
    }

    fn register_mapping(&self, mapping: Mapping, access: Access) -> Result<CountingRegion, Error> {
        let inner = self.inner.register_mapping(mapping, access)?;
        Ok(self.count(inner))
    }
}

impl Counting {
    /// `inner`, counted as live until it is dropped.
    fn count(&self, inner: PinOnlyRegion) -> CountingRegion {
        let reg = Reg {
            addr: inner.addr(),
            len: inner.len(),
            lkey: inner.lkey(),
            rkey: inner.rkey().wrapping_add(0x1000_0000),
        };
        self.live.lock().unwrap().insert(reg.lkey, reg);
        CountingRegion {
            inner,
            live: self.live.clone(),
        }
    }
}

impl Drop for CountingRegion {
    fn drop(&mut self) {
        // Deregistration must come before the memory is unmapped: madvise on an unmapped
        // range fails with ENOMEM.
        // SAFETY: MADV_NORMAL only resets the paging advice; it never changes contents.
        let mapped = unsafe {
            libc::madvise(
                self.inner.addr() as *mut libc::c_void,
                self.inner.len(),
                libc::MADV_NORMAL,
            )
        } == 0;
        if !mapped {
            UNMAPPED_BEFORE_DEREGISTER.fetch_add(1, Ordering::SeqCst);
        }
        self.live.lock().unwrap().remove(&self.inner.lkey());
    }
}

/// Regions dropped after their memory was unmapped, in the whole test binary.
pub static UNMAPPED_BEFORE_DEREGISTER: AtomicUsize = AtomicUsize::new(0);

impl Region for CountingRegion {
    fn addr(&self) -> usize {
        self.inner.addr()
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn lkey(&self) -> u32 {
        self.inner.lkey()
    }
    fn rkey(&self) -> u32 {
        self.inner.rkey().wrapping_add(0x1000_0000)
    }
    fn access(&self) -> Access {
        self.inner.access()
    }
}
