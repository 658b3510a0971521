//! Memory: this engine's segment (its registered buffers, each registered on every rail
//! with remote access only where asked), slot pools carved from one buffer, and the
//! handles of peers' segments.

use std::sync::Arc;

use parking_lot::RwLock;
use rdmx::{Access, Mapping, Memory, MemoryRegion};

use crate::error::{Error, Result};
use crate::path::Conn;
use crate::wire::{BufferDesc, SegmentDesc};

/// Memory registered on several rails at once: one owner, one address range.
struct Owned {
    // Only kept alive; never touched here.
    _mem: Box<dyn Memory>,
}

/// One rail's share of an [`Owned`] memory: what each rail's registration owns.
struct Share {
    owner: Arc<Owned>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: `ptr` points into memory `owner` keeps alive and that nothing here touches
// through references; moving or sharing the pointer between threads is as safe as moving
// the owner, which is `Send + Sync` (`Memory` requires it).
unsafe impl Send for Share {}
// SAFETY: as above; `Share` has no interior state.
unsafe impl Sync for Share {}

// SAFETY: `ptr`/`len` were read once from the owned memory, whose range stays valid and
// writable while `owner` lives (`Memory`'s contract); every `Share` holds `owner`.
unsafe impl Memory for Share {
    fn as_raw(&mut self) -> (*mut u8, usize) {
        let _ = &self.owner;
        (self.ptr, self.len)
    }

    /// Every rail registers the memory: the others reach it while one is removed.
    fn shared_with_others(&self) -> bool {
        true
    }
}

/// A buffer of this engine's segment.
pub(crate) struct LocalBuffer {
    pub(crate) name: String,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) access: Access,
    /// Per rail; emptied when the buffer is unregistered (keys die at once).
    pub(crate) mrs: RwLock<Vec<MemoryRegion>>,
}

impl std::fmt::Debug for LocalBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalBuffer")
            .field("name", &self.name)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl LocalBuffer {
    /// Registers `mem` on every rail's protection domain.
    pub(crate) fn register(
        name: String,
        offset: u64,
        mut mem: Box<dyn Memory>,
        access: Access,
        pds: &[rdmx::ProtectionDomain],
    ) -> Result<LocalBuffer> {
        let (ptr, len) = mem.as_raw();
        if len == 0 {
            return Err(Error::Invalid(format!("buffer {name:?} is empty")));
        }
        let owner = Arc::new(Owned { _mem: mem });
        let mut mrs = Vec::with_capacity(pds.len());
        for (i, pd) in pds.iter().enumerate() {
            let share = Share {
                owner: owner.clone(),
                ptr,
                len,
            };
            // Pinned once, by the first rail: a second mlock is redundant and the first
            // munlock would undo the others'.
            let pinning = if i == 0 {
                rdmx::Pinning::Pinned
            } else {
                rdmx::Pinning::Unpinned
            };
            mrs.push(pd.register_with(share, access, pinning)?);
        }
        Ok(LocalBuffer {
            name,
            offset,
            len: len as u64,
            access,
            mrs: RwLock::new(mrs),
        })
    }

    pub(crate) fn desc(&self) -> BufferDesc {
        let mrs = self.mrs.read();
        BufferDesc {
            name: self.name.clone(),
            offset: self.offset,
            len: self.len,
            remote_read: self.access.contains(Access::REMOTE_READ),
            remote_write: self.access.contains(Access::REMOTE_WRITE),
            keys: mrs.iter().map(|m| (m.addr() as u64, m.rkey())).collect(),
        }
    }
}

/// A buffer registered in this engine's segment. Cheap to clone.
///
/// Its bytes are reached by copies ([`write`](Self::write), [`read`](Self::read)): peers
/// and rails may write them at any time.
#[derive(Clone, Debug)]
pub struct LocalBuf {
    pub(crate) inner: Arc<LocalBuffer>,
}

impl LocalBuf {
    /// The name it was registered under.
    pub fn name(&self) -> &str {
        &self.inner.name
    }
    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.inner.len
    }
    /// Whether it is empty (never: registration refuses empty buffers).
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }
    /// Where it starts in this engine's segment (what peers address by offset).
    pub fn segment_offset(&self) -> u64 {
        self.inner.offset
    }
    /// Copies `data` into the buffer at `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        let mrs = self.inner.mrs.read();
        let mr = mrs.first().ok_or_else(|| unregistered(&self.inner.name))?;
        Ok(mr.write_at(offset as usize, data)?)
    }
    /// Copies bytes at `offset` out into `out`.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let mrs = self.inner.mrs.read();
        let mr = mrs.first().ok_or_else(|| unregistered(&self.inner.name))?;
        Ok(mr.read_at(offset as usize, out)?)
    }
}

pub(crate) fn unregistered(name: &str) -> Error {
    Error::Invalid(format!("buffer {name:?} was unregistered"))
}

/// Fixed-size slots carved from one registered buffer, handed out and returned without
/// registering anything: for callers that move many equal blocks (KV-cache pages).
#[derive(Clone, Debug)]
pub struct SlotPool {
    buf: LocalBuf,
    slot: u64,
    free: Arc<parking_lot::Mutex<Vec<u32>>>,
}

/// A slot of a [`SlotPool`]; going back to the pool when dropped.
#[derive(Debug)]
pub struct Slot {
    pool: SlotPool,
    index: u32,
}

impl SlotPool {
    pub(crate) fn new(buf: LocalBuf, slot: u64, count: u32) -> SlotPool {
        SlotPool {
            buf,
            slot,
            free: Arc::new(parking_lot::Mutex::new((0..count).rev().collect())),
        }
    }
    /// A free slot, if any.
    pub fn get(&self) -> Option<Slot> {
        let index = self.free.lock().pop()?;
        Some(Slot {
            pool: self.clone(),
            index,
        })
    }
    /// Slots free now.
    pub fn available(&self) -> usize {
        self.free.lock().len()
    }
    /// The buffer the slots are carved from.
    pub fn buffer(&self) -> &LocalBuf {
        &self.buf
    }
}

impl Slot {
    /// The buffer and the slot's offset in it, for a request.
    pub fn local(&self) -> (&LocalBuf, u64) {
        (&self.pool.buf, self.offset())
    }
    /// The slot's offset in the pool's buffer.
    pub fn offset(&self) -> u64 {
        self.index as u64 * self.pool.slot
    }
    /// The slot's length.
    pub fn len(&self) -> u64 {
        self.pool.slot
    }
    /// Whether the slot is empty (never).
    pub fn is_empty(&self) -> bool {
        self.pool.slot == 0
    }
    /// Copies `data` into the slot at `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        self.pool.buf.write(self.offset() + offset, data)
    }
    /// Copies bytes of the slot at `offset` into `out`.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len())?;
        self.pool.buf.read(self.offset() + offset, out)
    }
    fn check(&self, offset: u64, len: usize) -> Result<()> {
        if offset
            .checked_add(len as u64)
            .map_or(true, |e| e > self.pool.slot)
        {
            return Err(Error::Invalid(format!(
                "{len} bytes at {offset} outside a slot of {}",
                self.pool.slot
            )));
        }
        Ok(())
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.pool.free.lock().push(self.index);
    }
}

/// Memory to register: anything a registration may own (`Vec<u8>`, an rdmx
/// [`Mapping`]), or a fresh zeroed mapping of some length.
pub enum Mem {
    /// Memory the engine takes ownership of.
    Owned(Box<dyn Memory>),
    /// A fresh page-aligned zeroed mapping of this many bytes.
    Zeroed(usize),
}

impl From<Vec<u8>> for Mem {
    fn from(v: Vec<u8>) -> Self {
        Mem::Owned(Box::new(v))
    }
}
impl From<Mapping> for Mem {
    fn from(m: Mapping) -> Self {
        Mem::Owned(Box::new(m))
    }
}
impl From<usize> for Mem {
    fn from(n: usize) -> Self {
        Mem::Zeroed(n)
    }
}

impl Mem {
    pub(crate) fn into_memory(self) -> Result<Box<dyn Memory>> {
        Ok(match self {
            Mem::Owned(m) => m,
            Mem::Zeroed(n) => Box::new(Mapping::new(n).map_err(rdmx::Error::from)?),
        })
    }
}

/// Where in a peer's segment a request goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target<'a> {
    /// An offset in the segment's offset space (buffers laid end to end as registered).
    Offset(u64),
    /// An offset in the buffer registered under a name.
    Buffer(&'a str, u64),
}

/// An open peer segment: the handle requests name. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Segment {
    pub(crate) conn: Arc<Conn>,
}

impl Segment {
    /// The peer engine's name.
    pub fn name(&self) -> &str {
        &self.conn.peer
    }
    /// The transport its paths run on.
    pub fn transport(&self) -> crate::Transport {
        self.conn.transport
    }
    /// The descriptor as last received.
    pub fn desc(&self) -> Arc<SegmentDesc> {
        self.conn.desc.read().clone()
    }
    /// Its paths and their state, as the engine's status shows them.
    pub fn paths(&self) -> Vec<crate::PathStatus> {
        self.conn.paths.iter().map(|p| p.status()).collect()
    }
    /// Whether the connection is still usable (some path up or repairable).
    pub fn is_open(&self) -> bool {
        !self.conn.closed.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// Resolves a target to (buffer index, offset in it), checking bounds and access.
pub(crate) fn resolve(
    desc: &SegmentDesc,
    target: Target<'_>,
    len: u64,
    write: bool,
) -> Result<(u32, u64)> {
    let (i, off) = match target {
        Target::Offset(o) => {
            let i = desc.buffers.partition_point(|b| b.offset <= o);
            if i == 0 || o - desc.buffers[i - 1].offset >= desc.buffers[i - 1].len {
                return Err(Error::Invalid(format!(
                    "offset {o} of segment {:?} is in no registered buffer",
                    desc.name
                )));
            }
            (i - 1, o - desc.buffers[i - 1].offset)
        }
        Target::Buffer(name, o) => {
            let i = desc
                .buffers
                .iter()
                .position(|b| b.name == name)
                .ok_or_else(|| {
                    Error::Invalid(format!("segment {:?} has no buffer {name:?}", desc.name))
                })?;
            (i, o)
        }
    };
    let b = &desc.buffers[i];
    if off.checked_add(len).map_or(true, |e| e > b.len) {
        return Err(Error::Invalid(format!(
            "{len} bytes at {off} overrun buffer {:?} of segment {:?} ({} bytes)",
            b.name, desc.name, b.len
        )));
    }
    if write && !b.remote_write || !write && !b.remote_read {
        return Err(Error::Invalid(format!(
            "buffer {:?} of segment {:?} does not allow remote {}",
            b.name,
            desc.name,
            if write { "writes" } else { "reads" }
        )));
    }
    Ok((i as u32, off))
}
