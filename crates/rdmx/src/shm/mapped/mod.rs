//! The `mapped` data path: an RDMA WRITE or READ between two processes executed by the
//! initiator at post time, with one memcpy between its registered memory and the
//! target's, which it maps.
//!
//! Memory rdmx allocates for this ([`Mapping::shared`](rdmx_mem::Mapping::shared)) is
//! backed by a memfd sealed at its size. When such memory is registered with remote
//! access on a context that runs the mapped path, the context publishes the region in
//! its **key table** and hands the memfd to the peer of each of its connections that
//! runs it too (over the connection's Unix socket, `SCM_RIGHTS`; also to a connection
//! made later); the peer maps it. A region of plain memory is not published: requests to
//! it take the rings, as before.
//!
//! ## What lives where
//!
//! - The key table: a memfd per context, created and written by it alone, passed to each
//!   peer at connection setup and sealed (`F_SEAL_FUTURE_WRITE`) so peers can only map it
//!   read-only. A slot per key (by rkey modulo the table's size; a key whose slot is
//!   taken is not published) holds under a sequence lock: the rkey, its access rights,
//!   protection domain, the region's address and length, which file backs it and where.
//!   The sequence number is even when the slot is stable, odd while it is written.
//! - In each connection's segment, per side: a **target word**, where a side says what
//!   its queue pair accepts (its responder's state is RTR, RTS or SQD; its access flags;
//!   its type and protection domain), written by that side after every engine change;
//!   and a **claim word**, where a side names the slot and sequence number it copies
//!   through now (0: none).
//!
//! ## Executing a request
//!
//! Only a request the engine lets the initiator execute at post time qualifies, as on
//! the `direct` path (an RDMA WRITE without immediate data or a READ, on an empty send
//! queue; UC: every packet sent before has been read). The initiator reads the target
//! word and the key's slot (a consistent snapshot, or nothing), and checks what the
//! target's responder would: the QP's state, type and access flags; the rkey, its
//! protection domain (the target QP's), its rights and that the range lies within the
//! region; then that the range lies within the mapped file. It **claims** the slot
//! (stores its tag in its claim word), then reads the slot's sequence number and the
//! target word again: if either changed, it withdraws the claim and the request takes
//! the packets. Otherwise it copies, clears the claim and completes the request. Any
//! check that fails sends the request by packets, so errors (a bad key, bounds, rights,
//! state) get the responder's own answer, on both sides. Everything read from the shared
//! memory is checked before use: offsets and lengths from the peer are never trusted.
//!
//! Within one post (a post list), a claim made on this path outlives the request that
//! made it (the lean path's, below, does not): the next
//! request to the same key reads the slot's sequence number and the target word again,
//! and if neither changed, checks its range and rights against what the first request
//! read (the region as published, and the target QP's access flags) and copies under
//! the same claim, with no new claim and no look-up. Anything else ends the claim and
//! takes the path above. The claim ends before the post returns. So does the read lock
//! on the initiator's own key table, which lends the requests' local regions: a post
//! takes it once, at its first request on this path that names local memory (an inline
//! request names none), and lets it go before any of its requests takes the packets.
//!
//! A request whose elements all name the local region of the first element of the last
//! request that took the lock takes no lock on the table at all: the queue pair keeps a
//! copy of the region's entry with the table's count of deregistrations then
//! ([`Lent`](crate::soft::Lent)), and while the count has not moved the copy is checked
//! as the table would check the entry. Deregistration raises the count under the
//! table's write lock and, once any region of the table was lent so, takes and lets go
//! each queue pair's lock in turn before it returns: a request that read the old count
//! holds its queue pair's lock until its copy is done, and one that takes the lock
//! later reads the new count and looks the key up again.
//!
//! The **lean path**: a request that is an inline WRITE or names one element of the region
//! on loan, to a remote range the kept look-up below covers, posted alone or in a list
//! that holds no claim, goes straight to a claim of its own: the engine's checks that need
//! no memory, the loan's resolution of the element and the look-up's of the range are
//! the same as above, but no request is built for them, and the claim ends with the copy.
//! Anything else takes the path above (a list's claim then serves its later requests).
//!
//! From one post to the next, the initiator keeps what it read of the last key it
//! looked up (the slot's sequence number, the target word, the region, where it lies in
//! the mapped file). A request to that key that the kept region covers with the rights
//! it needs claims the slot as above, and copies if the sequence number and the target
//! word read after the claim are still the kept ones: the slot cannot have been
//! rewritten since, so it still says what was read. Otherwise the kept look-up is
//! dropped and the request takes the packets (on the lean path: the path above, whose
//! look-up starts afresh). Any message on the socket (a file handed
//! over or forgotten) drops it too, since it points into a file.
//!
//! ## Revocation
//!
//! Deregistering a published region first unpublishes it (odd sequence number, slot
//! cleared, even again: a tag naming the old number never matches again), then waits
//! until no connection's claim word names the slot with its old sequence number. Both
//! the claim and the unpublication are sequentially consistent stores each followed by
//! a load of the other's word, so either the initiator sees the slot changed and does
//! not copy, or deregistration sees the claim and waits for it to go. Where the kernel
//! has global expedited barriers (`membarrier(2)`, Linux 4.16), the target says so in
//! its key table's header and issues one after each such change and before it reads the
//! claims; an initiator that takes part in them then claims with a plain store, a
//! locked instruction fewer per request: the barrier runs a full fence on each of its
//! threads that is running, and a thread that is not has passed one in the scheduler,
//! so a claim stored before it is seen, and a load after it sees the change. A barrier
//! that cannot be issued leaves the claims unproven: they count as held, the barrier is
//! tried again until the bound, and past it the region goes as under a stalled peer
//! (below). Reading the claim word of a connection that went (its target word zeroed as
//! it went) takes a barrier too. Destroying a queue pair zeroes its target word the
//! same way, then waits (within [`DRAIN_BOUND`], as for its peer's other copies) until
//! the peer's claim word is clear: a peer that claims afterwards sees the 0 and backs
//! off, and one that claimed before has finished its copy when the destruction returns.
//! Connections whose peer has closed its socket (it exited or was killed) hold no
//! claims.
//!
//! Files are offered and forgotten under one lock (that of the watched connections), so
//! each peer gets the messages in the order the key table changed: a file offered again
//! while its last region was being deregistered stays mapped at the peer.
//!
//! The wait is bounded ([`DRAIN_BOUND`]). A peer that still claims the key after it
//! (stalled mid-copy, or writing garbage into its claim word) loses the memory instead:
//! the target replaces its own view of the whole mapping with a private copy at the same
//! address ([`rdmx_mem::shared::detach`]), so whatever the peer writes later lands in
//! pages this process no longer uses, and what it reads is no longer this process's
//! memory. Before that, the mapping's other published regions are unpublished (their
//! requests take the packets from then on, and none of the mapping is published again)
//! and the claims made on them drained (within [`DRAIN_BOUND`] too), and while the
//! mapping is copied every queue pair of the context is held, so that what peers wrote
//! into it, through the mapping or the packets, is in the copy. Deregistration then
//! returns. Only a region that owns its memory (`register`, as the pools' slabs) and
//! spans its whole mapping detaches it: memory registered raw stays its owner's, who
//! may write it at any time, and the rest of a mapping a region covers part of may be
//! in use; copying either would race with that. Such a region's deregistration waits
//! for the claim to go (or the peer's connection), however long that takes, logging an
//! error at each bound. (Regions of the same mapping registered on another context of this process
//! stay published there: registering one mapping on several contexts that run the
//! mapped path, with a peer that stalls, is the one case the detaching does not cover.)
//!
//! A peer holding the memfd can reach the whole mapping while the target shares it:
//! the mapped path trusts its peers (same user, or one in `allowed_uids`, checked with
//! `SO_PEERCRED`) to follow the protocol, as a process with ptrace rights over the other
//! could read and write it anyway; a peer that ignores the claims altogether and writes
//! into the mapping is not stopped. Memory that must never be within a peer's reach is
//! plain memory (`Vec`, [`Mapping::new`](rdmx_mem::Mapping::new)), which the rings
//! carry.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use rdmx_core::{Access, QpType};

mod peer;
mod table;

pub(crate) use peer::{execute, execute_lean, release, PeerView, PostScope};
pub(crate) use table::{prune, Published, Watch};

const TABLE_MAGIC: u64 = u64::from_be_bytes(*b"RDMXKEYS");
/// Slots of a key table.
const SLOTS: usize = 1024;
const SLOT: usize = 64;
const TABLE_HDR: usize = 64;
/// The header word of a key table's flags.
const TABLE_FLAGS: usize = 16;
/// Flag: the table's owner issues a global barrier between unpublishing and reading the
/// claims (see the module docs), so its peers may claim with a plain store.
const FLAG_BARRIERS: u64 = 1;
/// Bytes of a key table.
const TABLE_LEN: usize = TABLE_HDR + SLOTS * SLOT;
/// How long deregistration waits for a peer's claim to go before it detaches the memory.
pub const DRAIN_BOUND: Duration = Duration::from_secs(1);
/// A message on a connection's socket (each is [`MSG_LEN`] bytes): a file to map (with
/// its descriptor)...
const FILE_MAGIC: &[u8; 8] = b"RDMXMFD1";
/// ... or one to unmap: magic, file id, length (bytes).
const FORGET_MAGIC: &[u8; 8] = b"RDMXMFD0";
/// Bytes of every message on a connection's socket after the hello.
pub(crate) const MSG_LEN: usize = 24;
/// Most files a peer may hand over on one connection (each is a mapping of this
/// process); more ends the connection.
const MAX_FILES: usize = 4096;
/// Peer files up to this size are populated when mapped (no page faults in the first
/// copies), up to [`POPULATE_BUDGET`] bytes of them per connection; others fault their
/// pages in as copies reach them, so that a peer cannot make this process allocate a
/// huge file's pages, nor many files'.
const POPULATE_MAX: usize = 256 << 20;
/// Bytes of a connection's peer files populated when mapped, at most.
const POPULATE_BUDGET: usize = 1 << 30;
/// Sequence numbers in a claim: the low 40 bits (the slot index is above them).
const SEQ_MASK: u64 = (1 << 40) - 1;

// Slot words (byte offsets in a slot).
const S_SEQ: usize = 0;
const S_KEY: usize = 8; // rkey | access << 32
const S_PD: usize = 16; // pd | valid << 32
const S_FILE: usize = 24;
const S_OFF: usize = 32;
const S_VA: usize = 40;
const S_LEN: usize = 48;

/// A shared mapping of a file, unmapped on drop.
#[derive(Debug)]
struct Map {
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is shared memory reached only through atomics and raw copies; the
// pointer is no alias of anything Rust owns.
unsafe impl Send for Map {}
// SAFETY: as above.
unsafe impl Sync for Map {}

impl Map {
    fn new(fd: &OwnedFd, len: usize, writable: bool) -> std::io::Result<Map> {
        Map::with(fd, len, writable, false)
    }

    /// A shared mapping of `len` bytes of the file, writable or not, its pages faulted in
    /// now or not.
    fn with(fd: &OwnedFd, len: usize, writable: bool, populate: bool) -> std::io::Result<Map> {
        let prot = match writable {
            true => libc::PROT_READ | libc::PROT_WRITE,
            false => libc::PROT_READ,
        };
        let flags = match populate {
            true => libc::MAP_SHARED | libc::MAP_POPULATE,
            false => libc::MAP_SHARED,
        };
        // SAFETY: a shared mapping of a file at an address of the kernel's choosing.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Map {
            base: p.cast(),
            len,
        })
    }

    /// The word at byte `off`, if it lies inside the mapping (8-aligned).
    fn word(&self, off: usize) -> &AtomicU64 {
        assert!(off % 8 == 0 && off + 8 <= self.len);
        // SAFETY: inside the mapping (checked), 8-aligned (page-aligned base), which
        // lives as long as `self`; shared words are only accessed atomically.
        unsafe { AtomicU64::from_ptr(self.base.add(off).cast()) }
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: the mapping this value made; nothing refers into it once it goes.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

fn slot_word(table: &Map, idx: usize, w: usize) -> &AtomicU64 {
    table.word(TABLE_HDR + idx * SLOT + w)
}

fn tag(idx: usize, seq: u64) -> u64 {
    ((idx as u64 + 1) << 40) | (seq & SEQ_MASK)
}

/// The target word of a queue pair whose engine reports `view` (0: it accepts nothing).
pub(crate) fn target_word(view: Option<(rdmx_core::PdId, Access, QpType)>) -> u64 {
    let Some((pd, access, ty)) = view else {
        return 0;
    };
    let ty = match ty {
        QpType::Rc => 1,
        QpType::Uc => 2,
        _ => return 0,
    };
    u64::from(pd.0) << 32 | u64::from(access.bits() & 0xff_ffff) << 8 | ty << 1 | 1
}

/// A second mapping of the file behind a shared mapping, as a peer holds it.
#[cfg(feature = "testing")]
#[derive(Debug)]
pub struct PeerMapping(Map);

#[cfg(feature = "testing")]
impl PeerMapping {
    /// Maps the file behind the live shared mapping that holds `addr`, as a peer does.
    pub fn of(addr: *const u8) -> Option<PeerMapping> {
        let (file, _) = rdmx_mem::shared::find(addr as usize, 1)?;
        let fd = file.fd().try_clone_to_owned().ok()?;
        Map::new(&fd, file.len(), true).ok().map(PeerMapping)
    }

    /// Writes `bytes` at byte `off` of the file; false if that lies outside it.
    ///
    /// # Safety
    ///
    /// Nothing of this process may access those bytes of the file while it writes them
    /// (through a mapping of its own, or references into one): the call plays a peer
    /// process, whose writes this process's code cannot see coming.
    pub unsafe fn write(&self, off: usize, bytes: &[u8]) -> bool {
        if off
            .checked_add(bytes.len())
            .map_or(true, |e| e > self.0.len)
        {
            return false;
        }
        // SAFETY: inside the mapping (checked); shared memory, written by copy only, which
        // nothing else accesses meanwhile (the caller's contract).
        unsafe { crate::provider::copy::copy(self.0.base.add(off), bytes.as_ptr(), bytes.len()) };
        true
    }
}

#[cfg(test)]
mod tests {
    use super::peer::target_word_checked;
    use super::*;

    #[test]
    fn target_words_say_type_and_access() {
        let w = target_word(Some((rdmx_core::PdId(7), Access::REMOTE_WRITE, QpType::Rc)));
        assert_eq!(w >> 32, 7);
        assert!(target_word_checked(w, Access::REMOTE_WRITE, QpType::Rc).is_some());
        assert!(target_word_checked(w, Access::REMOTE_READ, QpType::Rc).is_none());
        assert!(target_word_checked(w, Access::REMOTE_WRITE, QpType::Uc).is_none());
        assert!(target_word_checked(0, Access::empty(), QpType::Rc).is_none());
        assert_eq!(target_word(None), 0);
    }

    #[test]
    fn tags_differ_by_slot_and_sequence() {
        assert_ne!(tag(0, 2), tag(1, 2));
        assert_ne!(tag(0, 2), tag(0, 4));
        assert_ne!(tag(0, 0), 0);
    }
}
