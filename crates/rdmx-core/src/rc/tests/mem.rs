//! Simulated registered memory for the engine harness: regions with keys, access and
//! protection domains, and the engine's [`MemAccess`] over them.

use std::cell::{Cell, RefCell};
use std::fmt;

use crate::access::Access;
use crate::mr::{KeyError, KeyUse, MrTable, PdId};
use crate::rc::MemAccess;
use crate::wr::{RemoteAddr, Sge};

/// The protection domain both QPs live in.
pub(super) const PD: PdId = PdId(1);
/// Another protection domain, for wrong-PD tests.
pub(super) const OTHER_PD: PdId = PdId(2);

/// Everything: local write and all remote access.
pub(super) const ALL: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_ATOMIC);

/// A registered region of a [`TestMem`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Region {
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) lkey: u32,
    pub(super) rkey: u32,
}

impl Region {
    /// An SGE for `len` bytes at offset `off`.
    pub(super) fn sge(&self, off: u64, len: u32) -> Sge {
        Sge {
            addr: self.addr + off,
            len,
            lkey: self.lkey,
        }
    }

    /// The remote address of offset `off`.
    pub(super) fn remote(&self, off: u64) -> RemoteAddr {
        RemoteAddr {
            addr: self.addr + off,
            rkey: self.rkey,
        }
    }
}

/// What [`TestMem::resolve`] hands the engine: the region as it was checked.
#[derive(Clone, Debug)]
pub(super) struct TestMr {
    addr: u64,
    len: u64,
}

/// One endpoint's memory: a byte arena whose addresses start at `base`, with regions in
/// a real [`MrTable`] so the engine gets the real key, PD, bounds and access checks.
pub(super) struct TestMem {
    table: MrTable<()>,
    arena: RefCell<Vec<u8>>,
    base: u64,
    /// Atomic operations executed on this memory (compare-swap and fetch-add).
    pub(super) atomics: Cell<u64>,
}

impl fmt::Debug for TestMem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestMem")
            .field("base", &self.base)
            .field("bytes", &self.arena.borrow().len())
            .finish()
    }
}

impl TestMem {
    pub(super) fn new(base: u64, seed: u64) -> Self {
        TestMem {
            table: MrTable::new(seed),
            arena: RefCell::new(Vec::new()),
            base,
            atomics: Cell::new(0),
        }
    }

    /// Allocates `len` bytes (64-aligned, zeroed, with a 64-byte gap to the next
    /// allocation) without registering them.
    pub(super) fn alloc(&self, len: u64) -> u64 {
        let mut a = self.arena.borrow_mut();
        let start = (a.len() as u64).div_ceil(64) * 64 + 64;
        a.resize((start + len) as usize, 0);
        self.base + start
    }

    /// Allocates and registers `len` bytes in `pd` with `access`.
    pub(super) fn register_in(&mut self, pd: PdId, len: u64, access: Access) -> Region {
        let addr = self.alloc(len);
        self.register_at(pd, addr, len, access)
    }

    /// Allocates and registers `len` bytes in [`PD`] with `access`.
    pub(super) fn register(&mut self, len: u64, access: Access) -> Region {
        self.register_in(PD, len, access)
    }

    /// Registers already allocated bytes.
    pub(super) fn register_at(&mut self, pd: PdId, addr: u64, len: u64, access: Access) -> Region {
        let e = self
            .table
            .insert(pd, addr, len, access, ())
            .expect("register");
        Region {
            addr,
            len,
            lkey: e.lkey,
            rkey: e.rkey,
        }
    }

    /// Deregisters a region; its keys stop working at once.
    pub(super) fn deregister(&mut self, r: &Region) {
        self.table.remove(r.lkey).expect("registered");
    }

    fn range(&self, addr: u64, len: usize) -> std::ops::Range<usize> {
        assert!(addr >= self.base, "address {addr:#x} below the arena");
        let start = (addr - self.base) as usize;
        start..start + len
    }

    /// Copies bytes out of the arena.
    pub(super) fn bytes(&self, addr: u64, len: usize) -> Vec<u8> {
        self.arena.borrow()[self.range(addr, len)].to_vec()
    }

    /// Writes bytes into the arena.
    pub(super) fn fill(&self, addr: u64, data: &[u8]) {
        let r = self.range(addr, data.len());
        self.arena.borrow_mut()[r].copy_from_slice(data);
    }

    /// Native-endian u64 at `addr`.
    pub(super) fn u64_at(&self, addr: u64) -> u64 {
        u64::from_ne_bytes(self.bytes(addr, 8).try_into().unwrap())
    }

    /// Stores a native-endian u64 at `addr`.
    pub(super) fn set_u64(&self, addr: u64, v: u64) {
        self.fill(addr, &v.to_ne_bytes());
    }

    fn check_in(mr: &TestMr, addr: u64, len: u64) {
        assert!(
            addr >= mr.addr && addr + len <= mr.addr + mr.len,
            "engine access of {len} bytes at {addr:#x} outside the resolved region \
             ({} bytes at {:#x})",
            mr.len,
            mr.addr
        );
    }
}

impl MemAccess for TestMem {
    type Mr = TestMr;

    fn resolve(
        &self,
        key: u32,
        key_use: KeyUse,
        pd: PdId,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<TestMr, KeyError> {
        let e = self.table.check(key, key_use, pd, addr, len, need)?;
        Ok(TestMr {
            addr: e.addr,
            len: e.len,
        })
    }

    fn read(&self, mr: &TestMr, addr: u64, out: &mut [u8]) {
        Self::check_in(mr, addr, out.len() as u64);
        out.copy_from_slice(&self.arena.borrow()[self.range(addr, out.len())]);
    }

    fn write(&self, mr: &TestMr, addr: u64, data: &[u8]) {
        Self::check_in(mr, addr, data.len() as u64);
        self.fill(addr, data);
    }

    fn compare_swap(&self, mr: &TestMr, addr: u64, compare: u64, swap: u64) -> u64 {
        Self::check_in(mr, addr, 8);
        assert_eq!(addr % 8, 0, "misaligned atomic reached memory");
        self.atomics.set(self.atomics.get() + 1);
        let old = self.u64_at(addr);
        if old == compare {
            self.set_u64(addr, swap);
        }
        old
    }

    fn fetch_add(&self, mr: &TestMr, addr: u64, add: u64) -> u64 {
        Self::check_in(mr, addr, 8);
        assert_eq!(addr % 8, 0, "misaligned atomic reached memory");
        self.atomics.set(self.atomics.get() + 1);
        let old = self.u64_at(addr);
        self.set_u64(addr, old.wrapping_add(add));
        old
    }
}
