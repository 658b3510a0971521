//! How the engine reaches registered memory.
//!
//! The engine does no I/O and holds no raw pointers: it names memory by key and address,
//! and a provider implements [`MemAccess`] over its key table. [`MemAccess::resolve`] runs
//! the checks of [`MrTable::check`](crate::MrTable::check) and returns a handle that keeps
//! the memory alive; the engine stores those handles in the requests it holds, so a posted
//! request keeps what it uses alive until it completes.

use crate::access::Access;
use crate::mr::{KeyError, KeyUse, PdId};

/// Registered memory as the engine sees it.
pub trait MemAccess {
    /// A resolved region; keeps the memory alive while held.
    type Mr: Clone;

    /// Checks `key` for an access of `len` bytes at `addr` by a QP in `pd` that needs
    /// `need`, and returns the region.
    fn resolve(
        &self,
        key: u32,
        key_use: KeyUse,
        pd: PdId,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<Self::Mr, KeyError>;

    /// Copies `out.len()` bytes at `addr` (inside `mr`, as resolved) into `out`.
    fn read(&self, mr: &Self::Mr, addr: u64, out: &mut [u8]);

    /// Copies `data` to `addr` (inside `mr`, as resolved).
    fn write(&self, mr: &Self::Mr, addr: u64, data: &[u8]);

    /// Atomically: if the 8 bytes at the 8-aligned `addr` equal `compare`, store `swap`.
    /// Returns the old value. Atomic against other calls and against CPU atomics.
    fn compare_swap(&self, mr: &Self::Mr, addr: u64, compare: u64, swap: u64) -> u64;

    /// Atomically adds `add` to the 8 bytes at the 8-aligned `addr`; returns the old value.
    fn fetch_add(&self, mr: &Self::Mr, addr: u64, add: u64) -> u64;
}
