//! Per-thread magazines: one thread-local table for all pools, indexed by pool id.
//!
//! The table is only ever borrowed for short stretches that run no foreign code. Caches
//! that must be released (closed pools) are moved to a graveyard under the borrow and
//! released after it ends, because releasing one may drop a pool's last reference and
//! with it regions, whose `Drop` is the registrar's code.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use super::{Shared, Slot};

/// A thread's stake in a pool: keeps the pool's memory alive for the thread's cache and
/// for every buffer the thread got, and counts the thread's hits and misses.
///
/// Each buffer holds the part of the thread that got it, so reference counting stays on
/// a cache line that thread owns instead of one shared by all threads.
pub(super) struct ThreadPart {
    pub(super) shared: Arc<Shared>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl ThreadPart {
    pub(super) fn new(shared: Arc<Shared>) -> Arc<Self> {
        Arc::new(ThreadPart {
            shared,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        })
    }

    // Only the owning thread writes the counters: a load and a store, no read-modify-write.

    #[inline]
    pub(super) fn hit(&self) {
        self.hits.store(self.hits.load(Relaxed) + 1, Relaxed);
    }

    pub(super) fn miss(&self) {
        self.misses.store(self.misses.load(Relaxed) + 1, Relaxed);
    }

    pub(super) fn counts(&self) -> (u64, u64) {
        (self.hits.load(Relaxed), self.misses.load(Relaxed))
    }
}

/// The thread parts of a pool that still have a cache, for `stats`, and the counts of
/// those that are gone.
#[derive(Default)]
pub(super) struct Parts {
    pub(super) live: Vec<Arc<ThreadPart>>,
    pub(super) retired_hits: u64,
    pub(super) retired_misses: u64,
}

/// Free buffers of one class cached by one thread.
pub(super) struct Magazine {
    pub(super) slots: Vec<Slot>,
    cap: usize,
}

impl Magazine {
    /// Caches `slot`; beyond capacity, half a magazine (the least recently freed) goes
    /// back to the shared list.
    #[inline]
    pub(super) fn push(&mut self, slot: Slot, shared: &Shared, class: usize) {
        self.slots.push(slot);
        if self.slots.len() > self.cap {
            self.spill(shared, class);
        }
    }

    #[cold]
    fn spill(&mut self, shared: &Shared, class: usize) {
        let n = self.slots.len() - self.cap / 2;
        shared.put_back(class, self.slots.drain(..n));
    }
}

/// One thread's cache of one pool.
pub(super) struct Local {
    pub(super) part: Arc<ThreadPart>,
    pub(super) mags: Box<[Magazine]>,
}

impl Local {
    fn new(shared: &Arc<Shared>) -> Local {
        let part = ThreadPart::new(shared.clone());
        shared.parts.lock().live.push(part.clone());
        let mags = shared
            .classes
            .iter()
            .map(|c| Magazine {
                slots: Vec::with_capacity(c.cap + 1),
                cap: c.cap,
            })
            .collect();
        Local { part, mags }
    }

    /// Hands the cached buffers back (unless the pool is closed: nobody can get them any
    /// more) and folds the counters into the pool's totals. Dropping the part afterwards
    /// may release the pool's memory.
    fn retire(self) {
        let Local { part, mut mags } = self;
        let shared = &part.shared;
        if !shared.is_closed() {
            for (class, mag) in mags.iter_mut().enumerate() {
                if !mag.slots.is_empty() {
                    shared.put_back(class, mag.slots.drain(..));
                }
            }
        }
        let mut parts = shared.parts.lock();
        let (hits, misses) = part.counts();
        parts.retired_hits += hits;
        parts.retired_misses += misses;
        if let Some(i) = parts.live.iter().position(|p| Arc::ptr_eq(p, &part)) {
            parts.live.swap_remove(i);
        }
    }
}

/// This thread's caches, indexed by pool id.
pub(super) struct Table {
    locals: Vec<Option<Local>>,
    graveyard: Vec<Local>,
}

impl Table {
    #[inline]
    pub(super) fn get(&mut self, id: usize) -> Option<&mut Local> {
        self.locals.get_mut(id)?.as_mut()
    }

    pub(super) fn take(&mut self, id: usize) -> Option<Local> {
        self.locals.get_mut(id)?.take()
    }

    /// Releases `local` once the table is no longer borrowed.
    pub(super) fn bury(&mut self, local: Local) {
        self.graveyard.push(local);
    }

    /// This thread's cache of `shared`, created if missing. Creating one first purges the
    /// caches of closed pools.
    pub(super) fn get_or_create(&mut self, shared: &Arc<Shared>) -> &mut Local {
        let id = shared.id;
        if self.get(id).is_none() {
            for entry in self.locals.iter_mut() {
                if entry.as_ref().is_some_and(|l| l.part.shared.is_closed()) {
                    self.graveyard.extend(entry.take());
                }
            }
            if self.locals.len() <= id {
                self.locals.resize_with(id + 1, || None);
            }
            self.locals[id] = Some(Local::new(shared));
        }
        self.locals[id].as_mut().expect("cache just ensured")
    }
}

/// The thread-local cell; its destructor (thread exit) returns every cached buffer.
struct Locals(RefCell<Table>);

impl Drop for Locals {
    fn drop(&mut self) {
        let table = self.0.get_mut();
        let locals = std::mem::take(&mut table.locals);
        let graveyard = std::mem::take(&mut table.graveyard);
        for local in locals.into_iter().flatten().chain(graveyard) {
            local.retire();
        }
    }
}

thread_local! {
    static LOCALS: Locals = const {
        Locals(RefCell::new(Table {
            locals: Vec::new(),
            graveyard: Vec::new(),
        }))
    };
}

/// Runs `f` on this thread's cache of pool `id`: the fast path. `None` when the thread has
/// no such cache, or as for [`with_locals`].
#[inline]
pub(super) fn with_local<T>(id: usize, f: impl FnOnce(&mut Local) -> T) -> Option<T> {
    LOCALS
        .try_with(|cell| {
            let mut table = cell.0.try_borrow_mut().ok()?;
            table.get(id).map(f)
        })
        .ok()
        .flatten()
}

/// Runs `f` on this thread's table. `None` when the thread-local is gone (the thread is
/// exiting) or already borrowed (re-entry from a registrar or a region's `Drop`); callers
/// then work on the shared lists directly.
#[inline]
pub(super) fn with_locals<T>(f: impl FnOnce(&mut Table) -> T) -> Option<T> {
    LOCALS
        .try_with(|cell| {
            let mut table = cell.0.try_borrow_mut().ok()?;
            let out = f(&mut table);
            if !table.graveyard.is_empty() {
                let dead = std::mem::take(&mut table.graveyard);
                drop(table);
                for local in dead {
                    local.retire();
                }
            }
            Some(out)
        })
        .ok()
        .flatten()
}
