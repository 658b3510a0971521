//! The memory-region table: keys, and the checks run before any access.
//!
//! ## Keys
//!
//! A key is 32 bits: the table index in the upper [`INDEX_BITS`] bits and a key variant
//! in the lower [`VARIANT_BITS`], as RDMA adapters do (`lkey = index << 8 | variant`).
//!
//! - Deregistration invalidates the key at once: the slot is emptied and its variant moves
//!   on, so the old key fails the lookup from that moment.
//! - A reused index gets a new variant, so a stale key never matches the new region.
//!   Indices are reused first-in first-out, and only once [`QUARANTINE`] indices are free,
//!   so a key value can only come back after `2^VARIANT_BITS` reuses of its index, that is
//!   after at least `256 × 1024` later registrations.
//! - Each slot's starting variant is derived from a per-table seed, which the owner draws
//!   at random per context, so keys are not predictable across runs.
//! - Index 0 is never used, so key 0 is never valid. An MR without remote access has rkey
//!   0, as on rxe.
//!
//! ## Checks
//!
//! [`MrTable::check`] resolves a key for a use (local or remote) and verifies, in order:
//! the key names a live region ([`KeyError::InvalidKey`]), the region belongs to the
//! requester's protection domain ([`KeyError::PdMismatch`]), `[addr, addr + len)` lies
//! inside it, with overflow-safe arithmetic ([`KeyError::OutOfBounds`]), and the region
//! grants the access asked for ([`KeyError::AccessDenied`]).

use std::collections::VecDeque;

use crate::access::Access;

/// Bits of a key that hold the table index.
pub const INDEX_BITS: u32 = 24;
/// Bits of a key that hold the key variant.
pub const VARIANT_BITS: u32 = 8;
/// Free indices kept back before any is reused.
pub const QUARANTINE: usize = 1024;
/// Largest table index.
pub const MAX_INDEX: u32 = (1 << INDEX_BITS) - 1;

const VARIANT_MASK: u32 = (1 << VARIANT_BITS) - 1;

/// A protection domain's identity within one context.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PdId(pub u32);

/// Whether a key is used by the local adapter (lkey) or by a remote peer (rkey).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyUse {
    /// An lkey in a local scatter/gather entry.
    Local,
    /// An rkey in a remote peer's request.
    Remote,
}

/// One registered region.
#[derive(Clone, Copy, Debug)]
pub struct MrEntry<T> {
    /// Owning protection domain.
    pub pd: PdId,
    /// First byte (the region's virtual address).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Access flags.
    pub access: Access,
    /// The local key.
    pub lkey: u32,
    /// The remote key (0 when the region grants no remote access).
    pub rkey: u32,
    /// Whatever the owner keeps with the region.
    pub payload: T,
}

/// Why a key lookup failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// No live region has this key (never issued, deregistered, or stale).
    #[error("key {key:#010x} names no registered memory region")]
    InvalidKey {
        /// The key presented.
        key: u32,
    },
    /// The region belongs to another protection domain.
    #[error("key {key:#010x} belongs to protection domain {mr_pd:?}, not {pd:?}")]
    PdMismatch {
        /// The key presented.
        key: u32,
        /// The region's domain.
        mr_pd: PdId,
        /// The requester's domain.
        pd: PdId,
    },
    /// The range is not inside the region.
    #[error(
        "{len} bytes at {addr:#x} are outside region {key:#010x} ({mr_len} bytes at {mr_addr:#x})"
    )]
    OutOfBounds {
        /// The key presented.
        key: u32,
        /// Requested address.
        addr: u64,
        /// Requested length.
        len: u64,
        /// Region start.
        mr_addr: u64,
        /// Region length.
        mr_len: u64,
    },
    /// The region does not grant the access asked for.
    #[error("region {key:#010x} grants {have:?} but {need:?} is needed")]
    AccessDenied {
        /// The key presented.
        key: u32,
        /// Access needed.
        need: Access,
        /// Access granted.
        have: Access,
    },
}

/// Why a registration could not enter the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TableError {
    /// All `2^INDEX_BITS - 1` indices are in use.
    #[error("memory-region table full: {live} regions registered")]
    Full {
        /// Regions registered now.
        live: usize,
    },
    /// Empty range, or one whose end overflows.
    #[error("invalid region: {len} bytes at {addr:#x}")]
    InvalidRange {
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
    },
}

struct Slot<T> {
    variant: u32,
    entry: Option<MrEntry<T>>,
}

/// The memory-region table of one context.
pub struct MrTable<T> {
    slots: Vec<Slot<T>>,
    free: VecDeque<u32>,
    seed: u64,
    live: usize,
}

impl<T> std::fmt::Debug for MrTable<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MrTable")
            .field("live", &self.live)
            .field("slots", &self.slots.len())
            .finish()
    }
}

impl<T> MrTable<T> {
    /// An empty table whose starting key variants derive from `seed`.
    pub fn new(seed: u64) -> Self {
        MrTable {
            // Index 0 is reserved so that key 0 is never valid.
            slots: vec![Slot {
                variant: 0,
                entry: None,
            }],
            free: VecDeque::new(),
            seed,
            live: 0,
        }
    }

    /// Regions registered now.
    pub fn len(&self) -> usize {
        self.live
    }

    /// Whether no region is registered.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Registers a region and returns its entry (with its keys).
    pub fn insert(
        &mut self,
        pd: PdId,
        addr: u64,
        len: u64,
        access: Access,
        payload: T,
    ) -> Result<&MrEntry<T>, TableError> {
        self.insert_with(pd, addr, len, access, |_, _| payload)
    }

    /// Registers a region whose payload is made from its `(lkey, rkey)`.
    pub fn insert_with(
        &mut self,
        pd: PdId,
        addr: u64,
        len: u64,
        access: Access,
        payload: impl FnOnce(u32, u32) -> T,
    ) -> Result<&MrEntry<T>, TableError> {
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(TableError::InvalidRange { addr, len });
        }
        let index = if self.free.len() >= QUARANTINE {
            self.free.pop_front().expect("free list is long")
        } else if self.slots.len() <= MAX_INDEX as usize {
            let index = self.slots.len() as u32;
            self.slots.push(Slot {
                variant: initial_variant(self.seed, index),
                entry: None,
            });
            index
        } else if let Some(index) = self.free.pop_front() {
            index
        } else {
            return Err(TableError::Full { live: self.live });
        };
        let slot = &mut self.slots[index as usize];
        let lkey = (index << VARIANT_BITS) | slot.variant;
        let rkey = if access.intersects(Access::REMOTE_READ | Access::REMOTE_MUTATE) {
            lkey
        } else {
            0
        };
        self.live += 1;
        Ok(slot.entry.insert(MrEntry {
            pd,
            addr,
            len,
            access,
            lkey,
            rkey,
            payload: payload(lkey, rkey),
        }))
    }

    /// Deregisters the region with local key `lkey`; its keys stop matching at once.
    pub fn remove(&mut self, lkey: u32) -> Option<MrEntry<T>> {
        let index = lkey >> VARIANT_BITS;
        let slot = self.slots.get_mut(index as usize).filter(|_| index != 0)?;
        if slot.variant != lkey & VARIANT_MASK || slot.entry.is_none() {
            return None;
        }
        let entry = slot.entry.take();
        slot.variant = (slot.variant + 1) & VARIANT_MASK;
        self.free.push_back(index);
        self.live -= 1;
        entry
    }

    /// The live region whose key (for `key_use`) is `key`, without further checks.
    pub fn get(&self, key: u32, key_use: KeyUse) -> Option<&MrEntry<T>> {
        let index = key >> VARIANT_BITS;
        if index == 0 {
            return None;
        }
        let slot = self.slots.get(index as usize)?;
        let entry = slot.entry.as_ref()?;
        let matches = match key_use {
            KeyUse::Local => entry.lkey == key,
            KeyUse::Remote => entry.rkey == key,
        };
        matches.then_some(entry)
    }

    /// Resolves `key` for an access of `len` bytes at `addr` by a requester in `pd` that
    /// needs `need`, and says which check failed.
    pub fn check(
        &self,
        key: u32,
        key_use: KeyUse,
        pd: PdId,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<&MrEntry<T>, KeyError> {
        let entry = self.get(key, key_use).ok_or(KeyError::InvalidKey { key })?;
        entry.check(key, key_use, pd, addr, len, need)?;
        Ok(entry)
    }
}

impl<T> MrEntry<T> {
    /// The checks of [`MrTable::check`] against this entry: that `key` names it (for
    /// `key_use`), then the protection domain, bounds and rights. For a copy of an
    /// entry kept outside its table, checked as the table would check it.
    pub fn check(
        &self,
        key: u32,
        key_use: KeyUse,
        pd: PdId,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<(), KeyError> {
        let named = match key_use {
            KeyUse::Local => self.lkey == key,
            KeyUse::Remote => self.rkey == key && key != 0,
        };
        if !named {
            return Err(KeyError::InvalidKey { key });
        }
        if self.pd != pd {
            return Err(KeyError::PdMismatch {
                key,
                mr_pd: self.pd,
                pd,
            });
        }
        let inside = match addr.checked_add(len) {
            Some(end) => addr >= self.addr && end <= self.addr + self.len,
            None => false,
        };
        if !inside {
            return Err(KeyError::OutOfBounds {
                key,
                addr,
                len,
                mr_addr: self.addr,
                mr_len: self.len,
            });
        }
        if !self.access.contains(need) {
            return Err(KeyError::AccessDenied {
                key,
                need,
                have: self.access,
            });
        }
        Ok(())
    }

    /// A copy of the entry with another payload.
    pub fn with_payload<U>(&self, payload: U) -> MrEntry<U> {
        MrEntry {
            pd: self.pd,
            addr: self.addr,
            len: self.len,
            access: self.access,
            lkey: self.lkey,
            rkey: self.rkey,
            payload,
        }
    }
}

/// The first variant of a slot: a well-mixed function of the seed and the index.
fn initial_variant(seed: u64, index: u32) -> u32 {
    // splitmix64 finaliser.
    let mut z = seed ^ (u64::from(index)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z as u32) & VARIANT_MASK
}

#[cfg(test)]
mod tests {
    use super::*;

    const PD: PdId = PdId(1);
    const RW: Access = Access::LOCAL_WRITE
        .union(Access::REMOTE_READ)
        .union(Access::REMOTE_WRITE);

    fn table() -> MrTable<()> {
        MrTable::new(0x1234_5678)
    }

    #[test]
    fn keys_are_index_and_variant_and_never_zero() {
        let mut t = table();
        let e = t.insert(PD, 0x1000, 64, RW, ()).unwrap();
        assert_eq!(e.lkey >> VARIANT_BITS, 1);
        assert_eq!(e.lkey, e.rkey);
        assert_ne!(e.lkey, 0);
        let local_only = t.insert(PD, 0x1000, 64, Access::LOCAL_WRITE, ()).unwrap();
        assert_eq!(local_only.rkey, 0);
        assert!(t.get(0, KeyUse::Remote).is_none());
        assert!(t.get(0, KeyUse::Local).is_none());
    }

    #[test]
    fn deregistration_invalidates_at_once_and_reuse_changes_variant() {
        let mut t = table();
        // Fill the quarantine so the first freed index is reused.
        let mut keys: Vec<u32> = (0..=QUARANTINE)
            .map(|i| t.insert(PD, 0x1000 + i as u64, 1, RW, ()).unwrap().lkey)
            .collect();
        let old = keys.remove(0);
        assert!(t.remove(old).is_some());
        assert!(t.remove(old).is_none(), "double deregistration");
        assert_eq!(
            t.check(old, KeyUse::Remote, PD, 0x1000, 1, Access::REMOTE_READ)
                .unwrap_err(),
            KeyError::InvalidKey { key: old }
        );
        for k in &keys {
            t.remove(*k).unwrap();
        }
        // The oldest freed index comes back first, with a new variant.
        let new = t.insert(PD, 0x1000, 1, RW, ()).unwrap().lkey;
        assert_eq!(new >> VARIANT_BITS, old >> VARIANT_BITS);
        assert_ne!(new, old);
        assert!(t.get(old, KeyUse::Local).is_none());
        assert!(t.get(new, KeyUse::Local).is_some());
    }

    #[test]
    fn indices_are_not_reused_before_the_quarantine_fills() {
        let mut t = table();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..QUARANTINE {
            let k = t.insert(PD, 0x1000, 1, RW, ()).unwrap().lkey;
            assert!(seen.insert(k >> VARIANT_BITS), "index reused too early");
            t.remove(k).unwrap();
        }
    }

    #[test]
    fn stale_key_does_not_match_until_variants_wrap() {
        let mut t = table();
        for i in 0..QUARANTINE as u64 {
            let k = t.insert(PD, i, 1, RW, ()).unwrap().lkey;
            t.remove(k).unwrap();
        }
        // Index 1 is now reused every QUARANTINE+1 registrations; a key returns only
        // after 2^VARIANT_BITS reuses.
        let first = t.insert(PD, 0, 1, RW, ()).unwrap().lkey;
        t.remove(first).unwrap();
        let mut same_index = 0;
        for _ in 0..(QUARANTINE + 1) * (1 << VARIANT_BITS) {
            let k = t.insert(PD, 0, 1, RW, ()).unwrap().lkey;
            if k >> VARIANT_BITS == first >> VARIANT_BITS {
                same_index += 1;
                if same_index < 1 << VARIANT_BITS {
                    assert_ne!(k, first, "key repeated after {same_index} reuses");
                }
            }
            t.remove(k).unwrap();
        }
        assert!(same_index >= (1 << VARIANT_BITS) - 1);
    }

    #[test]
    fn starting_variants_depend_on_the_seed() {
        let keys = |seed| {
            let mut t: MrTable<()> = MrTable::new(seed);
            (0..32)
                .map(|_| t.insert(PD, 0, 1, RW, ()).unwrap().lkey)
                .collect::<Vec<_>>()
        };
        assert_ne!(keys(1), keys(2));
        assert_eq!(keys(7), keys(7));
    }

    #[test]
    fn a_copy_of_an_entry_checks_as_its_table_does() {
        let mut t = table();
        let e = t
            .insert(PD, 0x1000, 0x100, Access::LOCAL_WRITE, ())
            .unwrap();
        let (lkey, copy) = (e.lkey, e.with_payload(7u8));
        let cases = [
            (lkey, KeyUse::Local, PD, 0x1000, 0x100, Access::LOCAL_WRITE),
            (lkey ^ 1, KeyUse::Local, PD, 0x1000, 1, Access::empty()),
            (lkey, KeyUse::Remote, PD, 0x1000, 1, Access::empty()),
            (0, KeyUse::Remote, PD, 0x1000, 1, Access::empty()),
            (lkey, KeyUse::Local, PdId(2), 0x1000, 1, Access::empty()),
            (lkey, KeyUse::Local, PD, 0x10ff, 2, Access::empty()),
            (lkey, KeyUse::Local, PD, 0x0fff, 1, Access::empty()),
            (lkey, KeyUse::Local, PD, u64::MAX, 2, Access::empty()),
            (lkey, KeyUse::Local, PD, 0x1000, 1, Access::REMOTE_READ),
        ];
        for (key, key_use, pd, addr, len, need) in cases {
            assert_eq!(
                copy.check(key, key_use, pd, addr, len, need),
                t.check(key, key_use, pd, addr, len, need).map(|_| ()),
                "{key:#x} {key_use:?} {pd:?} {addr:#x}+{len:#x} {need:?}"
            );
        }
        assert_eq!(copy.payload, 7);
    }

    #[test]
    fn check_names_the_failing_test() {
        let mut t = table();
        let k = t
            .insert(
                PD,
                0x1000,
                0x100,
                Access::LOCAL_WRITE | Access::REMOTE_READ,
                (),
            )
            .unwrap()
            .rkey;
        let ok = t.check(k, KeyUse::Remote, PD, 0x1000, 0x100, Access::REMOTE_READ);
        assert!(ok.is_ok());
        assert_eq!(
            t.check(k ^ 1, KeyUse::Remote, PD, 0x1000, 1, Access::REMOTE_READ)
                .unwrap_err(),
            KeyError::InvalidKey { key: k ^ 1 }
        );
        assert!(matches!(
            t.check(k, KeyUse::Remote, PdId(2), 0x1000, 1, Access::REMOTE_READ),
            Err(KeyError::PdMismatch {
                mr_pd: PD,
                pd: PdId(2),
                ..
            })
        ));
        for (addr, len) in [
            (0x0fff, 1),
            (0x1000, 0x101),
            (0x10ff, 2),
            (0x1100, 1),
            (u64::MAX, 2),
            (0x1000, u64::MAX),
        ] {
            assert!(
                matches!(
                    t.check(k, KeyUse::Remote, PD, addr, len, Access::REMOTE_READ),
                    Err(KeyError::OutOfBounds { .. })
                ),
                "{addr:#x}+{len:#x}"
            );
        }
        assert!(matches!(
            t.check(k, KeyUse::Remote, PD, 0x1000, 8, Access::REMOTE_WRITE),
            Err(KeyError::AccessDenied {
                need: Access::REMOTE_WRITE,
                ..
            })
        ));
        assert!(t
            .check(k, KeyUse::Local, PD, 0x1000, 8, Access::LOCAL_WRITE)
            .is_ok());
    }

    #[test]
    fn rkey_of_local_only_region_is_not_usable_remotely() {
        let mut t = table();
        let e = t.insert(PD, 0x1000, 8, Access::LOCAL_WRITE, ()).unwrap();
        let lkey = e.lkey;
        assert_eq!(
            t.check(lkey, KeyUse::Remote, PD, 0x1000, 8, Access::empty())
                .unwrap_err(),
            KeyError::InvalidKey { key: lkey }
        );
    }

    #[test]
    fn invalid_ranges_are_refused() {
        let mut t = table();
        assert!(t.insert(PD, 0, 0, RW, ()).is_err());
        assert!(t.insert(PD, u64::MAX, 2, RW, ()).is_err());
    }
}
