//! Protection domains: the scope of memory keys, and the registrar for the cache and pools.

use rdmx_core::{KeyError, KeyUse, PdId};
use rdmx_mem::{Access, Memory, Pinning};

use crate::mr::MemoryRegion;
use crate::provider::{MrRef, Registration};
use crate::{Context, Error, Result};

/// A protection domain (`ibv_pd`).
///
/// Memory registered in a domain can only be reached through queue pairs of the same
/// domain. Cloning is cheap and yields the same domain.
#[derive(Clone, Debug)]
pub struct ProtectionDomain {
    ctx: Context,
    id: PdId,
    pinning: Pinning,
}

impl ProtectionDomain {
    pub(crate) fn new(ctx: Context, id: PdId) -> Self {
        ProtectionDomain {
            ctx,
            id,
            pinning: Pinning::Pinned,
        }
    }

    /// This domain's identity within its context.
    pub fn id(&self) -> PdId {
        self.id
    }

    /// The context the domain belongs to.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The same domain, registering with `pinning` when used as a
    /// [`Registrar`](rdmx_mem::Registrar) by a registration cache or a buffer pool.
    pub fn with_pinning(&self, pinning: Pinning) -> ProtectionDomain {
        ProtectionDomain {
            pinning,
            ..self.clone()
        }
    }

    /// Registers memory the region takes ownership of (`ibv_reg_mr`), pinning it.
    ///
    /// The memory is freed once the region is deregistered and no posted work request
    /// uses it any more. On error the memory is dropped.
    pub fn register<M: Memory>(&self, mem: M, access: Access) -> Result<MemoryRegion> {
        self.register_with(mem, access, Pinning::Pinned)
    }

    /// [`register`](Self::register) with an explicit pinning choice.
    pub fn register_with<M: Memory>(
        &self,
        mut mem: M,
        access: Access,
        pinning: Pinning,
    ) -> Result<MemoryRegion> {
        let (addr, len) = mem.as_raw();
        self.register_inner(addr, len, access, pinning, Some(Box::new(mem)))
    }

    /// Registers memory the caller keeps owning.
    ///
    /// # Safety
    ///
    /// `[addr, addr + len)` must stay mapped until the region and every [`MrRef`] to it are
    /// dropped, and for as long as the region grants `LOCAL_WRITE` or any remote access,
    /// the caller must not hold Rust references into it: the adapter or a peer may write
    /// it at any time. (On shm's mapped path, deregistering such memory in a
    /// [`Mapping::shared`](rdmx_mem::Mapping::shared) waits for a peer stalled mid-copy
    /// into it however long that takes: it is not taken back from the peer by copying,
    /// as memory the region owns is.)
    pub unsafe fn register_raw(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
        pinning: Pinning,
    ) -> Result<MemoryRegion> {
        self.register_inner(addr, len, access, pinning, None)
    }

    fn register_inner(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
        pinning: Pinning,
        owner: Option<Box<dyn Memory>>,
    ) -> Result<MemoryRegion> {
        access.validate().map_err(rdmx_mem::Error::from)?;
        let reg = Registration {
            pd: self.id,
            addr,
            len,
            access,
            pinning,
            owner,
        };
        // SAFETY: the memory stays mapped while the region lives: `owner` owns it, or the
        // register_raw caller promised so.
        let shared = unsafe { self.ctx.device().register(reg)? };
        Ok(MemoryRegion::new(shared, self.ctx.clone()))
    }

    /// Resolves a key as a queue pair of this domain would before touching memory:
    /// the key must name a live region of this domain that covers `[addr, addr + len)` and
    /// grants `need`. The returned reference keeps the memory alive.
    pub fn check(
        &self,
        key: u32,
        key_use: KeyUse,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<MrRef, KeyError> {
        self.ctx
            .device()
            .check(self.id, key, key_use, addr, len, need)
    }
}

impl rdmx_mem::Registrar for ProtectionDomain {
    type Region = MemoryRegion;

    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion, rdmx_mem::Error> {
        // SAFETY: forwarded; the caller upholds register_raw's contract.
        let res = unsafe { self.register_raw(addr, len, access, self.pinning) };
        res.map_err(registrar_error)
    }

    fn register_mapping(
        &self,
        mapping: rdmx_mem::Mapping,
        access: Access,
    ) -> Result<MemoryRegion, rdmx_mem::Error> {
        // The region's shared part owns the mapping: every `MrRef` keeps it mapped.
        self.register_with(mapping, access, self.pinning)
            .map_err(registrar_error)
    }
}

/// A registration error as the cache and the pools report it.
fn registrar_error(e: Error) -> rdmx_mem::Error {
    match e {
        Error::Register(e) => e,
        other => rdmx_mem::Error::Registrar(Box::new(other)),
    }
}
