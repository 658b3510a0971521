//! The software providers' key table, and the engine's view of registered memory
//! ([`MemAccess`]) over it.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::{RwLock, RwLockReadGuard};
use rdmx_core::rc::MemAccess;
use rdmx_core::{KeyError, KeyUse, MrEntry, MrTable, PdId};
use rdmx_mem::Access;

use crate::provider::{MrRef, MrShared, Registration};
use crate::Result;

/// A software device's memory regions, by key.
#[derive(Debug)]
pub(crate) struct Keys {
    table: RwLock<MrTable<Arc<MrShared>>>,
    /// Deregistrations so far: raised under the table's write lock as each removes its
    /// region (see [`Lent`]).
    epoch: AtomicU64,
    /// A region was lent past the lock ([`KeysRead::lend`]): deregistrations must wait
    /// for the lock its borrower holds.
    lent_out: AtomicBool,
}

impl Keys {
    /// An empty table whose key variants start from `seed`.
    pub(crate) fn new(seed: u64) -> Keys {
        Keys {
            table: RwLock::new(MrTable::new(seed)),
            epoch: AtomicU64::new(0),
            lent_out: AtomicBool::new(false),
        }
    }

    /// Pins and registers memory.
    ///
    /// # Safety
    ///
    /// As [`Device::register`](crate::provider::Device::register).
    pub(crate) unsafe fn register(&self, reg: Registration) -> Result<Arc<MrShared>> {
        let Registration {
            pd,
            addr,
            len,
            access,
            pinning,
            owner,
        } = reg;
        let pin = rdmx_mem::pin::pin(addr as usize, len, pinning)?;
        let mut table = self.table.write();
        let entry = table.insert_with(pd, addr as u64, len as u64, access, |lkey, rkey| {
            Arc::new(MrShared {
                pin,
                _owner: owner,
                addr,
                len,
                access,
                lkey,
                rkey,
                pd,
                gate: Default::default(),
            })
        })?;
        Ok(entry.payload.clone())
    }

    /// Removes a region: its keys stop working now.
    pub(crate) fn deregister(&self, mr: &MrShared) {
        let mut table = self.table.write();
        let removed = table.remove(mr.lkey);
        debug_assert!(removed.is_some(), "region missing from its key table");
        self.epoch.fetch_add(1, Ordering::Release);
        drop(table);
        // `removed` holds a clone of the region; it is dropped outside the table lock.
        drop(removed);
    }

    /// The region lkey `lkey` names, if it covers `[addr, addr + len)`: for a transport
    /// that copies straight out of a peer's memory in the same process. The reference
    /// keeps the memory alive while the copy runs, even if the peer deregisters it.
    pub(crate) fn lookup_local(&self, lkey: u32, addr: u64, len: usize) -> Option<MrRef> {
        let table = self.table.read();
        let mr = MrRef::new(table.get(lkey, KeyUse::Local)?.payload.clone());
        mr.raw_range(addr, len).map(|_| mr)
    }

    /// The table, read-locked until the guard goes: registration and deregistration wait
    /// for it. Its [`view`](KeysRead::view) lends the regions for that long.
    pub(crate) fn read(&self) -> KeysRead<'_> {
        KeysRead(self.table.read(), self)
    }

    /// [`read`](Self::read) for a thread that holds another table's read lock already
    /// (the target's table while it holds the initiator's): it does not queue behind a
    /// waiting writer, so that two threads holding each other's second table while
    /// writers wait on both can never block each other.
    pub(crate) fn read_nested(&self) -> KeysRead<'_> {
        KeysRead(self.table.read_recursive(), self)
    }

    /// Whether `lent` still names a registered region: no region of the table was
    /// deregistered since it was lent.
    pub(crate) fn still_lends(&self, lent: &Lent) -> bool {
        self.epoch.load(Ordering::Acquire) == lent.epoch
    }

    /// Whether a region was ever lent past the lock: then each deregistration must wait,
    /// after it returns, for the locks borrowers hold while they use what they were lent.
    pub(crate) fn lent_out(&self) -> bool {
        self.lent_out.load(Ordering::Relaxed)
    }

    /// Regions registered now.
    pub(crate) fn len(&self) -> usize {
        self.table.read().len()
    }
}

impl MemAccess for Keys {
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
        let table = self.table.read();
        let entry = table.check(key, key_use, pd, addr, len, need)?;
        Ok(MrRef::new(entry.payload.clone()))
    }

    fn read(&self, mr: &MrRef, addr: u64, out: &mut [u8]) {
        engine_read(mr.shared(), addr, out);
    }

    fn write(&self, mr: &MrRef, addr: u64, data: &[u8]) {
        engine_write(mr.shared(), addr, data);
    }

    fn compare_swap(&self, mr: &MrRef, addr: u64, compare: u64, swap: u64) -> u64 {
        engine_compare_swap(mr.shared(), addr, compare, swap)
    }

    fn fetch_add(&self, mr: &MrRef, addr: u64, add: u64) -> u64 {
        engine_fetch_add(mr.shared(), addr, add)
    }
}

/// A key table held read-locked (see [`Keys::read`]).
pub(crate) struct KeysRead<'a>(RwLockReadGuard<'a, MrTable<Arc<MrShared>>>, &'a Keys);

impl KeysRead<'_> {
    /// The engine's view of the locked table: resolving a key lends the region for as
    /// long as the table stays locked, with no reference taken on it.
    pub(crate) fn view(&self) -> KeyView<'_> {
        KeyView(Lender::Table(&self.0))
    }

    /// The region local key `lkey` names, lent past the lock (see [`Lent`]).
    pub(crate) fn lend(&self, lkey: u32) -> Option<Lent> {
        let entry = self.0.get(lkey, KeyUse::Local)?;
        // Under the read lock: a deregistration that takes the write lock next sees it
        // (and one that took it before raised the count this reads).
        if !self.1.lent_out.load(Ordering::Relaxed) {
            self.1.lent_out.store(true, Ordering::Relaxed);
        }
        Some(Lent {
            entry: entry.with_payload(NonNull::from(&*entry.payload)),
            // Deregistration raises it under the write lock, which this lock excludes.
            epoch: self.1.epoch.load(Ordering::Relaxed),
        })
    }
}

/// A region's entry copied out of the read-locked table, with the table's count of
/// deregistrations then ([`Keys::still_lends`]): a transport that keeps it lends the
/// region without the table's lock while the count has not moved, provided every
/// deregistration waits, after its count is raised, for whatever lock the transport
/// holds while it uses the region (shm: each queue pair's, which its requests hold from
/// the check of the count to the end of their copy).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Lent {
    entry: MrEntry<NonNull<MrShared>>,
    epoch: u64,
}

// SAFETY: the pointer is an address of a region the table held when it was lent; it is
// dereferenced only under the contract of `Lent::view`.
unsafe impl Send for Lent {}

impl Lent {
    /// Its local key.
    pub(crate) fn lkey(&self) -> u32 {
        self.entry.lkey
    }

    /// The engine's view of the one region: its key resolves as the table resolves it
    /// (the same checks, on a copy of the entry); any other key is unknown.
    ///
    /// # Safety
    ///
    /// The region must stay registered while the view and the regions it resolves are
    /// used: [`Keys::still_lends`] said so under a lock that every deregistration waits
    /// for after raising its count, and that lock is held throughout.
    pub(crate) unsafe fn view(&self) -> KeyView<'_> {
        KeyView(Lender::One(&self.entry))
    }
}

/// Registered memory lent by a read-locked key table: for a request the transport
/// executes while it holds the lock (no region can be deregistered, hence freed, under
/// it), it saves taking and dropping a reference on each region. Or one region lent past
/// the lock ([`Lent::view`]).
#[derive(Clone, Copy)]
pub(crate) struct KeyView<'g>(Lender<'g>);

/// What a [`KeyView`] resolves keys in.
#[derive(Clone, Copy)]
enum Lender<'g> {
    /// The read-locked table.
    Table(&'g MrTable<Arc<MrShared>>),
    /// One region's entry, lent past the lock ([`Lent::view`]).
    One(&'g MrEntry<NonNull<MrShared>>),
}

impl<'g> MemAccess for KeyView<'g> {
    type Mr = &'g MrShared;

    fn resolve(
        &self,
        key: u32,
        key_use: KeyUse,
        pd: PdId,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<&'g MrShared, KeyError> {
        match self.0 {
            Lender::Table(table) => Ok(&table.check(key, key_use, pd, addr, len, need)?.payload),
            Lender::One(entry) => {
                entry.check(key, key_use, pd, addr, len, need)?;
                // SAFETY: the region is registered while the view is used (`Lent::view`'s
                // contract), so the table's reference to it keeps it alive.
                Ok(unsafe { entry.payload.as_ref() })
            }
        }
    }

    fn read(&self, mr: &&'g MrShared, addr: u64, out: &mut [u8]) {
        engine_read(mr, addr, out);
    }

    fn write(&self, mr: &&'g MrShared, addr: u64, data: &[u8]) {
        engine_write(mr, addr, data);
    }

    fn compare_swap(&self, mr: &&'g MrShared, addr: u64, compare: u64, swap: u64) -> u64 {
        engine_compare_swap(mr, addr, compare, swap)
    }

    fn fetch_add(&self, mr: &&'g MrShared, addr: u64, add: u64) -> u64 {
        engine_fetch_add(mr, addr, add)
    }
}

/// The key table, with one region lent past its lock ([`Lent`]) whose key resolves on the
/// loan's copy of its entry, with no look-up and no lock on the table: for a queue pair's
/// receives, which name the same region post after post. The regions it resolves are
/// references, as the table's are; every other key resolves in the table.
pub(crate) struct WithLoan<'a> {
    keys: &'a Keys,
    loan: Option<&'a Lent>,
}

impl<'a> WithLoan<'a> {
    /// The table `keys`, with `loan`'s region resolved on the loan.
    ///
    /// # Safety
    ///
    /// As [`Lent::view`]: `loan`'s region stays registered while the view is used, or
    /// at least its memory stays alive: [`Keys::still_lends`] said so, or
    /// [`KeysRead::lend`] made the loan, under a lock that every deregistration waits for
    /// after raising its count (and after it returns, while its caller still holds the
    /// region), and that lock is held throughout.
    pub(crate) unsafe fn new(keys: &'a Keys, loan: Option<&'a Lent>) -> WithLoan<'a> {
        WithLoan { keys, loan }
    }
}

impl MemAccess for WithLoan<'_> {
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
        let Some(loan) = self
            .loan
            .filter(|l| l.lkey() == key && key_use == KeyUse::Local)
        else {
            return self.keys.resolve(key, key_use, pd, addr, len, need);
        };
        // SAFETY: `new`'s contract is `view`'s.
        let shared: *const MrShared =
            unsafe { loan.view() }.resolve(key, key_use, pd, addr, len, need)?;
        // SAFETY: `shared` is the region the table held in an `Arc` when it was lent, and
        // that allocation is alive while the lock `new`'s contract names is held (the
        // table's reference, or after the region was removed from the table, that of
        // the deregistration's caller, which waits for the lock): the count taken here
        // is that allocation's, and the `Arc` made holds it.
        let arc = unsafe {
            Arc::increment_strong_count(shared);
            Arc::from_raw(shared)
        };
        Ok(MrRef::new(arc))
    }

    // The regions it resolves are the table's: the table's accesses serve them.

    fn read(&self, mr: &MrRef, addr: u64, out: &mut [u8]) {
        MemAccess::read(self.keys, mr, addr, out);
    }

    fn write(&self, mr: &MrRef, addr: u64, data: &[u8]) {
        self.keys.write(mr, addr, data);
    }

    fn compare_swap(&self, mr: &MrRef, addr: u64, compare: u64, swap: u64) -> u64 {
        self.keys.compare_swap(mr, addr, compare, swap)
    }

    fn fetch_add(&self, mr: &MrRef, addr: u64, add: u64) -> u64 {
        self.keys.fetch_add(mr, addr, add)
    }
}

/// A view that lends no region (every key is unknown to it): for a request whose bytes
/// are inline, which names no local key, so that executing it at post takes no lock on
/// the key table (two atomic read-modify-writes of a request that costs a few dozen
/// nanoseconds).
pub(crate) fn no_regions() -> KeyView<'static> {
    static EMPTY: OnceLock<MrTable<Arc<MrShared>>> = OnceLock::new();
    KeyView(Lender::Table(EMPTY.get_or_init(|| MrTable::new(0))))
}

// The engine's accesses to a region it resolved, through either view of the table.

fn engine_read(mr: &MrShared, addr: u64, out: &mut [u8]) {
    let res = mr.read_at(offset(mr, addr), out);
    debug_assert!(res.is_ok(), "engine read outside a resolved region");
}

fn engine_write(mr: &MrShared, addr: u64, data: &[u8]) {
    let res = mr.write_at(offset(mr, addr), data);
    debug_assert!(res.is_ok(), "engine write outside a resolved region");
}

fn engine_compare_swap(mr: &MrShared, addr: u64, compare: u64, swap: u64) -> u64 {
    mr.compare_swap(offset(mr, addr), compare, swap)
        .expect("resolved, 8-aligned atomic target")
}

fn engine_fetch_add(mr: &MrShared, addr: u64, add: u64) -> u64 {
    mr.fetch_add(offset(mr, addr), add)
        .expect("resolved, 8-aligned atomic target")
}

/// Offset of `addr` in a region it was resolved in (bounds were checked by `resolve`;
/// an address below the region becomes a huge offset that the accessors refuse).
fn offset(mr: &MrShared, addr: u64) -> usize {
    (addr as usize).wrapping_sub(mr.addr as usize)
}
