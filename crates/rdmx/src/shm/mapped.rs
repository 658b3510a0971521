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
//! ## Revocation
//!
//! Deregistering a published region first unpublishes it (odd sequence number, slot
//! cleared, even again: a tag naming the old number never matches again), then waits
//! until no connection's claim word names the slot with its old sequence number. Both
//! the claim and the unpublication are sequentially consistent stores each followed by
//! a load of the other's word, so either the initiator sees the slot changed and does
//! not copy, or deregistration sees the claim and waits for it to go. Destroying a queue
//! pair zeroes its target word the same way before its connection goes; a peer that
//! claims afterwards sees it and backs off. Connections whose peer has closed its socket
//! (it exited or was killed) hold no claims.
//!
//! The wait is bounded ([`DRAIN_BOUND`]). A peer that still claims the key after it
//! (stalled mid-copy, or writing garbage into its claim word) loses the memory instead:
//! the target replaces its own view of the whole mapping with a private copy at the same
//! address ([`rdmx_mem::shared::detach`]), so whatever the peer writes later lands in
//! pages this process no longer uses, and what it reads is no longer this process's
//! memory; the mapping's other published regions are unpublished with it (their
//! requests take the packets from then on). Deregistration then returns. (Regions of
//! the same mapping registered on another context of this process stay published there:
//! registering one mapping on several contexts that run the mapped path, with a peer
//! that stalls, is the one case the detaching does not cover.)
//!
//! A peer holding the memfd can reach the whole mapping while the target shares it:
//! the mapped path trusts its peers (same user, or one in `allowed_uids`, checked with
//! `SO_PEERCRED`) to follow the protocol, as a process with ptrace rights over the other
//! could read and write it anyway; a peer that ignores the claims altogether and writes
//! into the mapping is not stopped. Memory that must never be within a peer's reach is
//! plain memory (`Vec`, [`Mapping::new`](rdmx_mem::Mapping::new)), which the rings
//! carry.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rdmx_core::{Access, QpType, SendWr};
use rdmx_mem::shared::SharedFile;

use super::qp::{Conn, Inner};
use super::ring::Segment;
use super::sys;
use crate::provider::MrShared;

const TABLE_MAGIC: u64 = u64::from_be_bytes(*b"RDMXKEYS");
/// Slots of a key table.
pub(crate) const SLOTS: usize = 1024;
const SLOT: usize = 64;
const TABLE_HDR: usize = 64;
/// Bytes of a key table.
pub(crate) const TABLE_LEN: usize = TABLE_HDR + SLOTS * SLOT;
/// How long deregistration waits for a peer's claim to go before it detaches the memory.
pub const DRAIN_BOUND: Duration = Duration::from_secs(1);
/// A message on a connection's socket: a file to map (with its descriptor)...
const FILE_MAGIC: &[u8; 8] = b"RDMXMFD1";
/// ... or one to unmap: magic, file id, length (bytes).
const FORGET_MAGIC: &[u8; 8] = b"RDMXMFD0";
const MSG_LEN: usize = 24;
/// Most files a peer may hand over on one connection (each is a mapping of this
/// process); more ends the connection.
const MAX_FILES: usize = 4096;
/// Peer files up to this size are populated when mapped (no page faults in the first
/// copies); larger ones fault their pages in as copies reach them, so that a peer cannot
/// make this process allocate a huge file's pages.
const POPULATE_MAX: usize = 256 << 20;
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
        // Writable mappings are the peer's files: populated now if not too large.
        let (prot, flags) = match writable {
            true if len <= POPULATE_MAX => (
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
            ),
            true => (libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED),
            false => (libc::PROT_READ, libc::MAP_SHARED),
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

/// This context's key table, and the files of its published regions.
#[derive(Debug)]
pub(crate) struct Published {
    fd: OwnedFd,
    table: Map,
    state: Mutex<PubState>,
}

#[derive(Debug, Default)]
struct PubState {
    /// Files of published regions, and how many regions each backs.
    files: HashMap<u64, (Arc<SharedFile>, usize)>,
    /// Published regions by lkey: their slot and file.
    by_lkey: HashMap<u32, (usize, u64)>,
    used: Vec<bool>,
}

/// What deregistering a region leaves to do: wait for claims of `tag`, and tell peers
/// to unmap `forget`.
pub(crate) struct Withdrawn {
    pub(crate) tag: u64,
    pub(crate) file: u64,
    pub(crate) forget: Option<u64>,
}

impl Published {
    pub(crate) fn new() -> std::io::Result<Published> {
        let fd = sys::memfd_sealed(TABLE_LEN, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW)?;
        let table = Map::new(&fd, TABLE_LEN, true)?;
        table.word(0).store(TABLE_MAGIC, Ordering::Relaxed);
        table.word(8).store(SLOTS as u64, Ordering::Relaxed);
        // From now on nobody can map it writable: peers read it, this mapping writes it.
        sys::seal_future_write(&fd)?;
        Ok(Published {
            fd,
            table,
            state: Mutex::new(PubState {
                used: vec![false; SLOTS],
                ..PubState::default()
            }),
        })
    }

    /// The table's descriptor, for the peer.
    pub(crate) fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Publishes `mr` if it has remote access and lies in a shared mapping. Returns its
    /// file if peers do not have it yet.
    pub(crate) fn publish(&self, mr: &MrShared) -> Option<Arc<SharedFile>> {
        if !mr
            .access
            .intersects(Access::REMOTE_READ | Access::REMOTE_WRITE)
        {
            return None;
        }
        let (file, off) = rdmx_mem::shared::find(mr.addr as usize, mr.len)?;
        let idx = mr.rkey as usize % SLOTS;
        let mut st = self.state.lock();
        if st.used[idx] {
            tracing::debug!(
                rkey = mr.rkey,
                "shm mapped: the key's slot is taken; its requests take the rings"
            );
            return None;
        }
        st.used[idx] = true;
        st.by_lkey.insert(mr.lkey, (idx, file.id()));
        let w = |o| slot_word(&self.table, idx, o);
        let seq = w(S_SEQ).load(Ordering::Relaxed);
        w(S_SEQ).store(seq + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        w(S_KEY).store(
            u64::from(mr.rkey) | u64::from(mr.access.bits()) << 32,
            Ordering::Relaxed,
        );
        w(S_PD).store(u64::from(mr.pd.0) | 1 << 32, Ordering::Relaxed);
        w(S_FILE).store(file.id(), Ordering::Relaxed);
        w(S_OFF).store(off, Ordering::Relaxed);
        w(S_VA).store(mr.addr as u64, Ordering::Relaxed);
        w(S_LEN).store(mr.len as u64, Ordering::Relaxed);
        w(S_SEQ).store(seq + 2, Ordering::Release);
        let entry = st.files.entry(file.id()).or_insert((file, 0));
        entry.1 += 1;
        (entry.1 == 1).then(|| entry.0.clone())
    }

    /// Unpublishes the slot `idx`; returns the tag of claims made on it before.
    fn clear(&self, idx: usize) -> u64 {
        let w = |o| slot_word(&self.table, idx, o);
        let seq = w(S_SEQ).load(Ordering::Relaxed);
        // Sequentially consistent, then the caller loads the claims: see the module docs.
        w(S_SEQ).store(seq + 1, Ordering::SeqCst);
        w(S_PD).store(0, Ordering::SeqCst);
        w(S_SEQ).store(seq + 2, Ordering::SeqCst);
        tag(idx, seq)
    }

    /// Unpublishes `mr`, if it was published.
    pub(crate) fn withdraw(&self, mr: &MrShared) -> Option<Withdrawn> {
        let mut st = self.state.lock();
        let (idx, file) = st.by_lkey.remove(&mr.lkey)?;
        st.used[idx] = false;
        let tag = self.clear(idx);
        let forget = match st.files.get_mut(&file) {
            Some(e) if e.1 > 1 => {
                e.1 -= 1;
                None
            }
            _ => st.files.remove(&file).map(|_| file),
        };
        Some(Withdrawn { tag, file, forget })
    }

    /// Unpublishes every region of file `file` (its mapping was detached). Returns
    /// whether the file was still offered.
    pub(crate) fn withdraw_file(&self, file: u64) -> bool {
        let mut st = self.state.lock();
        let idxs: Vec<(u32, usize)> = st
            .by_lkey
            .iter()
            .filter(|(_, (_, f))| *f == file)
            .map(|(&k, &(i, _))| (k, i))
            .collect();
        for (lkey, idx) in idxs {
            st.by_lkey.remove(&lkey);
            st.used[idx] = false;
            self.clear(idx);
        }
        st.files.remove(&file).is_some()
    }

    /// Offers every published file to a new connection's peer.
    pub(crate) fn offer_all(&self, sock: &UnixStream) {
        let files: Vec<Arc<SharedFile>> = self
            .state
            .lock()
            .files
            .values()
            .map(|(f, _)| f.clone())
            .collect();
        for f in files {
            offer(sock, &f);
        }
    }
}

impl super::Driver {
    /// The connections that run the mapped path (their peers map this context's files).
    fn mapped_socks(&self) -> Vec<Arc<UnixStream>> {
        let active: Vec<_> = self.active.read().clone();
        active
            .iter()
            .filter_map(|q| {
                let g = q.inner.lock();
                let c = g.conn.as_ref()?;
                c.mapped.is_some().then(|| c.sock.clone())
            })
            .collect()
    }

    /// `mr` was registered: published if it qualifies, its file offered to the peers.
    pub(crate) fn published(&self, mr: &MrShared) {
        let Some(file) = self.published.as_ref().and_then(|p| p.publish(mr)) else {
            return;
        };
        for s in self.mapped_socks() {
            offer(&s, &file);
        }
    }

    /// `mr` is being deregistered: unpublished, and once no peer copies through its key
    /// (or [`DRAIN_BOUND`] has passed and its mapping was detached), returns.
    pub(crate) fn unpublish(&self, mr: &MrShared) {
        let Some(p) = self.published.as_ref() else {
            return;
        };
        let Some(w) = p.withdraw(mr) else { return };
        let mut forget_file = w.forget;
        if !drain(&self.watch, w.tag, DRAIN_BOUND) {
            tracing::warn!(
                rkey = mr.rkey,
                "shm mapped: a peer still claims a key being deregistered after {DRAIN_BOUND:?}; \
                 its memory is taken back from every peer (detached)"
            );
            match rdmx_mem::shared::detach(mr.addr as usize) {
                Ok(_) => {
                    if p.withdraw_file(w.file) {
                        forget_file = Some(w.file);
                    }
                }
                Err(e) => tracing::error!(
                    rkey = mr.rkey,
                    "shm mapped: detaching the memory failed ({e})"
                ),
            }
        }
        if let Some(id) = forget_file {
            for s in self.mapped_socks() {
                forget(&s, id);
            }
        }
    }
}

#[cfg(feature = "testing")]
impl Published {
    /// Whether the table can be mapped writable (it must not: it is sealed).
    pub(crate) fn writable(&self) -> bool {
        Map::new(&self.fd, TABLE_LEN, true).is_ok()
    }

    /// Sets the length word of `rkey`'s slot, if it is published.
    pub(crate) fn scribble_len(&self, rkey: u32, len: u64) -> bool {
        let st = self.state.lock();
        let idx = rkey as usize % SLOTS;
        if !st.used[idx] {
            return false;
        }
        slot_word(&self.table, idx, S_LEN).store(len, Ordering::SeqCst);
        true
    }
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
    pub fn write(&self, off: usize, bytes: &[u8]) -> bool {
        if off
            .checked_add(bytes.len())
            .map_or(true, |e| e > self.0.len)
        {
            return false;
        }
        // SAFETY: inside the mapping (checked); shared memory, written by copy only.
        unsafe { super::copy::copy(self.0.base.add(off), bytes.as_ptr(), bytes.len()) };
        true
    }
}

#[cfg(feature = "testing")]
impl PeerView {
    /// The tag a claim on `rkey` carries now, if the peer publishes it.
    pub(crate) fn tag_of(&self, rkey: u32) -> Option<u64> {
        let idx = rkey as usize % SLOTS;
        let seq = slot_word(&self.table, idx, S_SEQ).load(Ordering::SeqCst);
        let key = slot_word(&self.table, idx, S_KEY).load(Ordering::SeqCst);
        (seq & 1 == 0 && key as u32 == rkey).then(|| tag(idx, seq))
    }
}

/// Hands file `f` to the peer on `sock`. A peer that does not get it (its socket is
/// full) sends its requests to this file's regions by packets.
pub(crate) fn offer(sock: &UnixStream, f: &SharedFile) {
    let mut msg = [0u8; MSG_LEN];
    msg[..8].copy_from_slice(FILE_MAGIC);
    msg[8..16].copy_from_slice(&f.id().to_ne_bytes());
    msg[16..24].copy_from_slice(&(f.len() as u64).to_ne_bytes());
    if let Err(e) = sys::send_with_fds(sock, &msg, &[f.fd().as_raw_fd()]) {
        tracing::debug!("shm mapped: could not offer a file to the peer ({e})");
    }
}

/// Tells the peer on `sock` to unmap file `id`.
pub(crate) fn forget(sock: &UnixStream, id: u64) {
    let mut msg = [0u8; MSG_LEN];
    msg[..8].copy_from_slice(FORGET_MAGIC);
    msg[8..16].copy_from_slice(&id.to_ne_bytes());
    if let Err(e) = sys::send_with_fds(sock, &msg, &[]) {
        tracing::debug!("shm mapped: could not tell the peer to unmap a file ({e})");
    }
}

/// A connection whose claims deregistration must wait for: its segment, its socket
/// (gone once the connection is), the peer's side, and whether the peer closed its end.
#[derive(Debug)]
pub(crate) struct Watch {
    pub(crate) seg: Arc<Segment>,
    pub(crate) sock: Weak<UnixStream>,
    pub(crate) peer: usize,
    pub(crate) peer_gone: Arc<std::sync::atomic::AtomicBool>,
}

/// Waits until no watched connection claims `tag`, for at most `bound`; forgets
/// connections that are gone and claim nothing. Returns whether the claims went.
pub(crate) fn drain(watch: &Mutex<Vec<Watch>>, tag: u64, bound: Duration) -> bool {
    let deadline = Instant::now() + bound;
    let mut spins = 0u32;
    loop {
        let mut busy = false;
        watch.lock().retain(|w| {
            let claim = w.seg.claim_word(w.peer).load(Ordering::SeqCst);
            let sock = w.sock.upgrade();
            if claim == tag {
                // A peer that closed its socket holds no claims.
                if w.peer_gone.load(Ordering::SeqCst)
                    || sock.as_ref().is_some_and(|s| sys::hung_up(s))
                {
                    return false;
                }
                busy = true;
            }
            sock.is_some() || claim != 0
        });
        if !busy {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        spins += 1;
        if spins < 1000 {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// The peer's key table and the files it handed over, as this process maps them.
#[derive(Debug)]
pub(crate) struct PeerView {
    table: Map,
    files: HashMap<u64, Map, IdState>,
}

/// Hashes the peer's file ids for the lookup every mapped request makes: one multiply,
/// keyed per process so that a peer cannot pick ids that collide (SipHash, the default,
/// was a sixth of an 8-byte WRITE's cost).
#[derive(Clone, Debug)]
struct IdState(u64);

impl Default for IdState {
    fn default() -> Self {
        static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        IdState(*SEED.get_or_init(|| {
            use std::hash::{BuildHasher, RandomState};
            RandomState::new().hash_one(0x726d_6478u64) | 1
        }))
    }
}

impl std::hash::BuildHasher for IdState {
    type Hasher = IdHasher;
    fn build_hasher(&self) -> IdHasher {
        IdHasher(self.0)
    }
}

/// See [`IdState`].
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .rotate_left(23)
            ^ self.0;
    }
    fn finish(&self) -> u64 {
        let x = self.0.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^ (x >> 33)
    }
}

impl PeerView {
    /// Maps the peer's key table (read-only), after checking its seals, size and header.
    pub(crate) fn open(fd: &OwnedFd) -> std::io::Result<PeerView> {
        let bad = |why| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
        if !sys::sealed(fd) {
            return Err(bad("a key table whose size is not sealed"));
        }
        if sys::file_size(fd)? < TABLE_LEN as u64 {
            return Err(bad("a key table too small"));
        }
        let table = Map::new(fd, TABLE_LEN, false)?;
        if table.word(0).load(Ordering::Relaxed) != TABLE_MAGIC
            || table.word(8).load(Ordering::Relaxed) != SLOTS as u64
        {
            return Err(bad("a key table that is not rdmx's"));
        }
        Ok(PeerView {
            table,
            files: HashMap::default(),
        })
    }

    /// Reads the messages waiting on the connection's socket. An error (a message that
    /// is not rdmx's, a file that cannot be mapped, the socket's end) ends the
    /// connection.
    pub(crate) fn receive(&mut self, sock: &UnixStream) -> std::io::Result<()> {
        let bad = |why| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
        loop {
            let mut msg = [0u8; MSG_LEN];
            let fds = match sys::recv_with_fds(sock, &mut msg) {
                Ok(fds) => fds,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(e),
            };
            let id = u64::from_ne_bytes(msg[8..16].try_into().expect("8 bytes"));
            let mut fds = fds.into_iter();
            match (&msg[..8], fds.next(), fds.next()) {
                (m, Some(fd), None) if m == FILE_MAGIC => {
                    if !sys::sealed(&fd) {
                        return Err(bad("a file whose size is not sealed"));
                    }
                    if self.files.len() >= MAX_FILES && !self.files.contains_key(&id) {
                        return Err(bad("more files than a connection maps"));
                    }
                    let len = sys::file_size(&fd)?;
                    let len = usize::try_from(len)
                        .ok()
                        .filter(|&n| n > 0 && n <= isize::MAX as usize)
                        .ok_or_else(|| bad("a file of a bad size"))?;
                    self.files.insert(id, Map::new(&fd, len, true)?);
                }
                (m, None, None) if m == FORGET_MAGIC => {
                    self.files.remove(&id);
                }
                _ => return Err(bad("a message that is not rdmx's")),
            }
        }
    }
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

/// Executes `wr` on the mapped data path if it qualifies and the target accepts it;
/// returns whether it did (its completion is then queued in the engine).
pub(crate) fn execute(g: &mut Inner, wr: &SendWr, inline: Option<&[u8]>) -> bool {
    if !super::direct::may_run_at_post(g, wr) {
        return false;
    }
    let ty = g.engine.config().qp_type;
    let Some(Conn {
        seg,
        side,
        mapped: Some(view),
        ..
    }) = g.conn.as_ref()
    else {
        return false;
    };
    if view.files.is_empty() {
        return false;
    }
    let Some(req) = g.engine.direct_request(&g.keys, wr, inline) else {
        return false;
    };
    let (va, rkey) = req.remote();
    let need = if req.is_read() {
        Access::REMOTE_READ
    } else {
        Access::REMOTE_WRITE
    };
    let Some(found) = check(
        view,
        seg,
        1 - side,
        va,
        rkey,
        u64::from(req.len()),
        need,
        ty,
    ) else {
        g.engine.direct_cancel(req);
        return false;
    };
    // Claim the slot, then see that neither it nor the target changed (module docs).
    let claim = seg.claim_word(*side);
    claim.store(found.tag, Ordering::SeqCst);
    let seq = slot_word(&view.table, found.idx, S_SEQ).load(Ordering::SeqCst);
    let target = seg.target_word(1 - side).load(Ordering::SeqCst);
    if seq != found.seq || target != found.target {
        claim.store(0, Ordering::Release);
        g.engine.direct_cancel(req);
        return false;
    }
    // SAFETY: `found.at` lies `req.len()` bytes inside the peer's mapped file (checked
    // by `check`), which `view` keeps mapped for the call; `req`'s segments were resolved
    // by this QP's engine. The file is a mapping of its own, so it never overlaps local
    // memory (it may view the same pages when the peer is this process, which leaves the
    // bytes unspecified, as concurrent access to registered memory does).
    unsafe { super::direct::transfer_at(&req, inline, found.at) };
    claim.store(0, Ordering::Release);
    g.engine.direct_complete(req);
    true
}

/// Where a checked request goes: the address in the mapped file, the slot and its
/// sequence number, the claim's tag, and the target word it was checked against.
struct Found {
    at: *mut u8,
    idx: usize,
    seq: u64,
    tag: u64,
    target: u64,
}

/// Checks a request to `[va, va + len)` with `rkey` needing `need`, as the target's
/// responder would, against the target word of side `peer` and the peer's key table.
#[allow(clippy::too_many_arguments)]
fn check(
    view: &PeerView,
    seg: &Segment,
    peer: usize,
    va: u64,
    rkey: u32,
    len: u64,
    need: Access,
    ty: QpType,
) -> Option<Found> {
    let target = seg.target_word(peer).load(Ordering::SeqCst);
    if target != target_word_checked(target, need, ty)? {
        return None;
    }
    let idx = rkey as usize % SLOTS;
    let w = |o| slot_word(&view.table, idx, o);
    let seq = w(S_SEQ).load(Ordering::Acquire);
    if seq & 1 != 0 {
        return None;
    }
    let (key, pd, file, off, e_va, e_len) = (
        w(S_KEY).load(Ordering::Relaxed),
        w(S_PD).load(Ordering::Relaxed),
        w(S_FILE).load(Ordering::Relaxed),
        w(S_OFF).load(Ordering::Relaxed),
        w(S_VA).load(Ordering::Relaxed),
        w(S_LEN).load(Ordering::Relaxed),
    );
    fence(Ordering::Acquire);
    if w(S_SEQ).load(Ordering::Relaxed) != seq {
        return None;
    }
    let rights = Access::from_bits_truncate((key >> 32) as u32);
    if pd >> 32 != 1
        || key as u32 != rkey
        || pd as u32 != (target >> 32) as u32
        || !rights.contains(need)
        || va < e_va
        || va.checked_add(len)? > e_va.checked_add(e_len)?
    {
        return None;
    }
    let map = view.files.get(&file)?;
    let start = off.checked_add(va - e_va)?;
    if start.checked_add(len)? > map.len as u64 {
        return None;
    }
    Some(Found {
        at: map.base.wrapping_add(start as usize),
        idx,
        seq,
        tag: tag(idx, seq),
        target,
    })
}

/// `target` if it says a QP of type `ty` that accepts requests needing `need`.
fn target_word_checked(target: u64, need: Access, ty: QpType) -> Option<u64> {
    let want_ty = match ty {
        QpType::Rc => 1,
        QpType::Uc => 2,
        _ => return None,
    };
    let access = Access::from_bits_truncate(((target >> 8) & 0xff_ffff) as u32);
    (target & 1 == 1 && (target >> 1) & 3 == want_ty && access.contains(need)).then_some(target)
}

#[cfg(test)]
mod tests {
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
