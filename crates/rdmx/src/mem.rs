//! The engine's view of registered memory: [`MemAccess`] over a context's key table.

use rdmx_core::rc::MemAccess;
use rdmx_core::{KeyError, KeyUse, PdId};
use rdmx_mem::Access;

use crate::context::ContextInner;
use crate::mr::MrRef;

impl MemAccess for ContextInner {
    type Mr = MrRef;

    fn resolve(
        &self,
        key: u32,
        key_use: KeyUse,
        pd: PdId,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<MrRef, KeyError> {
        let table = self.mrs.read();
        let entry = table.check(key, key_use, pd, addr, len, need)?;
        Ok(MrRef::new(entry.payload.clone()))
    }

    fn read(&self, mr: &MrRef, addr: u64, out: &mut [u8]) {
        let res = mr.read_at(offset(mr, addr), out);
        debug_assert!(res.is_ok(), "engine read outside a resolved region");
    }

    fn write(&self, mr: &MrRef, addr: u64, data: &[u8]) {
        let res = mr.write_at(offset(mr, addr), data);
        debug_assert!(res.is_ok(), "engine write outside a resolved region");
    }

    fn compare_swap(&self, mr: &MrRef, addr: u64, compare: u64, swap: u64) -> u64 {
        mr.compare_swap_u64(offset(mr, addr), compare, swap)
            .expect("resolved, 8-aligned atomic target")
    }

    fn fetch_add(&self, mr: &MrRef, addr: u64, add: u64) -> u64 {
        mr.fetch_add_u64(offset(mr, addr), add)
            .expect("resolved, 8-aligned atomic target")
    }
}

/// Offset of `addr` in a region it was resolved in (bounds were checked by `resolve`;
/// an address below the region becomes a huge offset that the accessors refuse).
fn offset(mr: &MrRef, addr: u64) -> usize {
    (addr as usize).wrapping_sub(mr.addr())
}
