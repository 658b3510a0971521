//! The target's side of the mapped path: its key table, publishing and unpublishing
//! regions, handing their files to peers, and waiting for peers' claims to go.

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{fence, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use rdmx_core::Access;
use rdmx_mem::shared::SharedFile;

use super::{
    slot_word, tag, Map, DRAIN_BOUND, FILE_MAGIC, FLAG_BARRIERS, FORGET_MAGIC, MSG_LEN, SLOTS,
    S_FILE, S_KEY, S_LEN, S_OFF, S_PD, S_SEQ, S_VA, TABLE_FLAGS, TABLE_LEN, TABLE_MAGIC,
};
use crate::provider::MrShared;
use crate::shm::ring::Segment;
use crate::shm::sys;

/// This context's key table, and the files of its published regions.
#[derive(Debug)]
pub(crate) struct Published {
    fd: OwnedFd,
    table: Map,
    /// Peers are told they may claim with a plain store ([`FLAG_BARRIERS`]): a global
    /// barrier goes before every read of their claims that follows a change they must
    /// see ([`Published::barrier`]).
    barriers: bool,
    /// Tests make the barriers fail.
    #[cfg(feature = "testing")]
    fail_barriers: std::sync::atomic::AtomicBool,
    state: Mutex<PubState>,
}

#[derive(Debug, Default)]
struct PubState {
    /// Files of published regions, and how many regions each backs.
    files: HashMap<u64, (Arc<SharedFile>, usize)>,
    /// Published regions by lkey: their slot and file.
    by_lkey: HashMap<u32, (usize, u64)>,
    used: Vec<bool>,
    /// Files taken back from the peers (their mapping detached, or being detached): no
    /// region of them is published again.
    detached: HashSet<u64>,
    /// Regions being deregistered whose claim a peer still held past the bound, by
    /// lkey: dealt with once their keys are gone ([`Driver::unpublished`]).
    stalled: HashMap<u32, Withdrawn>,
}

/// What deregistering a region leaves to do: wait for claims of `tag`, and tell peers
/// to unmap `forget`.
#[derive(Debug)]
struct Withdrawn {
    tag: u64,
    file: u64,
    forget: Option<u64>,
}

impl Published {
    pub(crate) fn new() -> std::io::Result<Published> {
        let fd = sys::memfd_sealed(TABLE_LEN, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW)?;
        let table = Map::new(&fd, TABLE_LEN, true)?;
        table.word(0).store(TABLE_MAGIC, Ordering::Relaxed);
        table.word(8).store(SLOTS as u64, Ordering::Relaxed);
        let barriers = sys::issues_global_barriers();
        let flags = if barriers { FLAG_BARRIERS } else { 0 };
        table.word(TABLE_FLAGS).store(flags, Ordering::Relaxed);
        // From now on nobody can map it writable: peers read it, this mapping writes it.
        sys::seal_future_write(&fd)?;
        Ok(Published {
            fd,
            table,
            barriers,
            #[cfg(feature = "testing")]
            fail_barriers: Default::default(),
            state: Mutex::new(PubState {
                used: vec![false; SLOTS],
                ..PubState::default()
            }),
        })
    }

    /// Makes the peers' claims made before now visible, and this thread's stores before
    /// now visible to their loads after it, when they claim with plain stores: called
    /// after unpublishing or zeroing a target word and before reading claims. An error
    /// (the barrier could not be issued) means the claims read then prove nothing: the
    /// caller takes them as held, and may try again.
    pub(crate) fn barrier(&self) -> std::io::Result<()> {
        if !self.barriers {
            return Ok(());
        }
        #[cfg(feature = "testing")]
        if self.fail_barriers.load(Ordering::SeqCst) {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        sys::global_barrier()
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
        if st.detached.contains(&file.id()) {
            return None;
        }
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
    fn withdraw(&self, mr: &MrShared) -> Option<Withdrawn> {
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

    /// Takes file `file` back from the peers, before its mapping is detached: no region
    /// of it is published again, and every one published now is unpublished. Returns
    /// whether the file was offered, and the tags of the claims made on those regions.
    fn take_back(&self, file: u64) -> (bool, Vec<u64>) {
        let mut st = self.state.lock();
        st.detached.insert(file);
        let idxs: Vec<(u32, usize)> = st
            .by_lkey
            .iter()
            .filter(|(_, (_, f))| *f == file)
            .map(|(&k, &(i, _))| (k, i))
            .collect();
        let mut tags = Vec::with_capacity(idxs.len());
        for (lkey, idx) in idxs {
            st.by_lkey.remove(&lkey);
            st.used[idx] = false;
            tags.push(self.clear(idx));
        }
        (st.files.remove(&file).is_some(), tags)
    }

    /// Whether file `file` backs a published region.
    fn offered(&self, file: u64) -> bool {
        self.state.lock().files.contains_key(&file)
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

impl crate::shm::Driver {
    /// `mr` was registered: published if it qualifies, its file offered to the peers.
    ///
    /// Offers and forgets go out under the lock of the watched connections (the
    /// connections that run the mapped path, each added under it with every file offered
    /// then): each peer gets them in the order the key table changed, so a file offered
    /// again while its last region was being deregistered is not forgotten after it.
    pub(crate) fn published(&self, mr: &MrShared) {
        let Some(p) = self.published.as_ref() else {
            return;
        };
        let watch = self.watch.lock();
        let Some(file) = p.publish(mr) else {
            return;
        };
        for s in watch.iter().filter_map(|w| w.sock.upgrade()) {
            offer(&s, &file);
        }
    }

    /// `mr` is being deregistered: unpublished, and once no peer copies through its key
    /// returns. A claim still held after [`DRAIN_BOUND`] is dealt with once the keys are
    /// gone ([`unpublished`](Self::unpublished)).
    pub(crate) fn unpublish(&self, mr: &MrShared) {
        let Some(p) = self.published.as_ref() else {
            return;
        };
        let Some(w) = p.withdraw(mr) else { return };
        if drain(p, &self.watch, &[w.tag], DRAIN_BOUND) {
            self.forget_unoffered(p, w.forget);
        } else {
            p.state.lock().stalled.insert(mr.lkey, w);
        }
    }

    /// `mr`'s keys are gone, and a peer still claimed it after [`DRAIN_BOUND`]: its
    /// memory is taken back from the peers (its mapping detached) where that is sound, or
    /// else waited for, however long it takes: the memory must not return to its owner
    /// while a peer may still write it. Sound means the region owns its memory, alone
    /// ([`Memory::shared_with_others`](rdmx_mem::Memory::shared_with_others)), and spans
    /// its whole mapping (memory registered raw stays its owner's, who may write it at
    /// any time, and the rest of a mapping may be in use); handles to the region
    /// ([`MrRef`](crate::MrRef)) read and write through its gate, which the copy holds.
    pub(crate) fn unpublished(&self, mr: &Arc<MrShared>) {
        let Some(p) = self.published.as_ref() else {
            return;
        };
        let Some(w) = p.state.lock().stalled.remove(&mr.lkey) else {
            return;
        };
        let mut forget_file = w.forget;
        let (addr, len) = (mr.addr as usize, mr.len);
        if rdmx_mem::shared::find(addr, len).is_none() {
            // Taken back already (detached for another region of it), or gone: the
            // peer's writes no longer reach this process's memory.
            tracing::warn!(
                rkey = mr.rkey,
                "shm mapped: a peer still claims a key being deregistered after \
                 {DRAIN_BOUND:?}; its memory is no longer shared"
            );
        } else if mr._owner.as_ref().is_some_and(|o| !o.shared_with_others())
            && rdmx_mem::shared::spans(addr, len)
        {
            let (offered, detached) = self.take_back_from_peers(p, mr, w.file);
            if offered {
                forget_file = Some(w.file);
            }
            if !detached {
                self.wait_for_claim(p, mr, w.tag);
            }
        } else {
            tracing::error!(
                rkey = mr.rkey,
                "shm mapped: a peer still claims a key being deregistered after \
                 {DRAIN_BOUND:?}; the region does not own all of its shared mapping, so \
                 the memory cannot be taken back: waiting for the claim to go"
            );
            self.wait_for_claim(p, mr, w.tag);
        }
        self.forget_unoffered(p, forget_file);
    }

    /// Tells the peers to unmap file `id`, unless a region of it was published again.
    fn forget_unoffered(&self, p: &Published, id: Option<u64>) {
        if let Some(id) = id {
            let watch = self.watch.lock();
            // A region of the file registered meanwhile offered it again: peers keep it.
            if !p.offered(id) {
                for s in watch.iter().filter_map(|w| w.sock.upgrade()) {
                    forget(&s, id);
                }
            }
        }
    }

    /// Takes the mapping that `mr` spans back from every peer (a peer still claims `mr`'s
    /// key past [`DRAIN_BOUND`]). Returns whether its file had been offered to them, and
    /// whether the mapping was detached.
    fn take_back_from_peers(&self, p: &Published, mr: &MrShared, file: u64) -> (bool, bool) {
        tracing::warn!(
            rkey = mr.rkey,
            "shm mapped: a peer still claims a key being deregistered after {DRAIN_BOUND:?}; \
             its memory is taken back from every peer (detached)"
        );
        // First nothing of the mapping stays published (the requests to its other
        // regions take the rings from now on), and the copies peers were making into
        // those end; then no queue pair of this context places a peer's bytes while
        // the mapping is copied: what the peers wrote is in the copy.
        let (offered, others) = p.take_back(file);
        if !drain(p, &self.watch, &others, DRAIN_BOUND) {
            tracing::warn!(
                "shm mapped: a peer still claims another region of the mapping being \
                 detached after {DRAIN_BOUND:?}; what it writes there now is lost"
            );
        }
        let detached = self.with_queue_pairs_locked(|| {
            let _gate = mr.gate.write();
            // SAFETY: `mr`, being deregistered, owns its memory and spans the mapping
            // (checked by the caller; `detach` checks the span again): the `Memory`
            // contract says nothing else accesses memory while a registration that owns
            // it is removed (pools deregister a slab only once all its buffers are back).
            // The handles to the region read and write only through its gate, held here,
            // and every queue pair of this context is held, so none places a peer's bytes
            // meanwhile.
            unsafe { rdmx_mem::shared::detach(mr.addr as usize, mr.len) }
        });
        let detached = match detached {
            Ok(d) => d,
            Err(e) => {
                tracing::error!(
                    rkey = mr.rkey,
                    "shm mapped: detaching the memory failed ({e})"
                );
                false
            }
        };
        (offered, detached)
    }

    /// Waits, however long it takes, until no peer claims `tag` (the memory of `mr`, which
    /// a peer may still write, must not return to its owner before), or the memory is no
    /// longer shared (detached for another region of it).
    fn wait_for_claim(&self, p: &Published, mr: &MrShared, tag: u64) {
        while !drain(p, &self.watch, &[tag], DRAIN_BOUND) {
            if rdmx_mem::shared::find(mr.addr as usize, mr.len).is_none() {
                return;
            }
            tracing::error!(
                rkey = mr.rkey,
                "shm mapped: a peer still claims a key being deregistered"
            );
        }
    }
}

/// Hands file `f` to the peer on `sock`. A peer that does not get it (its socket is
/// full) sends its requests to this file's regions by packets.
fn offer(sock: &UnixStream, f: &SharedFile) {
    let mut msg = [0u8; MSG_LEN];
    msg[..8].copy_from_slice(FILE_MAGIC);
    msg[8..16].copy_from_slice(&f.id().to_ne_bytes());
    msg[16..24].copy_from_slice(&(f.len() as u64).to_ne_bytes());
    if let Err(e) = sys::send_with_fds(sock, &msg, &[f.fd().as_raw_fd()]) {
        tracing::debug!("shm mapped: could not offer a file to the peer ({e})");
    }
}

/// Tells the peer on `sock` to unmap file `id`.
fn forget(sock: &UnixStream, id: u64) {
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

impl Watch {
    /// The peer's claim word, and the connection's socket if it is still there; `None`
    /// if what the word says proves nothing (the barrier below failed). The socket is
    /// looked at first: a connection that went zeroed its target word before its socket
    /// went (`Conn::drop`), so a peer that claimed in time to copy shows its claim here,
    /// and one that claims later sees the zero and backs off. A peer that claims with a
    /// plain store needs a barrier between the two: the zeroing may have come after the
    /// caller's own.
    fn claim(&self, p: &Published) -> Option<(u64, Option<Arc<UnixStream>>)> {
        let sock = self.sock.upgrade();
        if sock.is_none() {
            // The failed upgrade read the socket's last release: the fence makes what
            // the connection did before it (the zeroed target word) happen before the
            // load below.
            fence(Ordering::SeqCst);
            p.barrier().ok()?;
        }
        Some((self.seg.claim_word(self.peer).load(Ordering::SeqCst), sock))
    }
}

/// Forgets the watched connections that went and claim nothing (each keeps its segment
/// mapped): called as connections come, so that a context whose published regions are
/// never deregistered does not keep every connection it ever had.
pub(crate) fn prune(p: &Published, watch: &mut Vec<Watch>) {
    watch.retain(|w| match w.claim(p) {
        Some((claim, sock)) => still_watched(w, claim, &sock),
        None => true,
    });
}

/// Whether a watched connection may still hold a claim: its socket is there, or it went
/// with a claim in its word and its peer was not seen to close its end (a peer that
/// closed its socket holds no claims, whatever its word says).
fn still_watched(w: &Watch, claim: u64, sock: &Option<Arc<UnixStream>>) -> bool {
    sock.is_some() || (claim != 0 && !w.peer_gone.load(Ordering::SeqCst))
}

/// Waits until no watched connection claims one of `tags`, for at most `bound`; forgets
/// connections that are gone and claim nothing. Returns whether the claims went.
fn drain(p: &Published, watch: &Mutex<Vec<Watch>>, tags: &[u64], bound: Duration) -> bool {
    // What the caller unpublished, before the claims: without the barrier they prove
    // nothing, and count as held (it is tried again until the bound).
    let mut ordered = false;
    let mut failed = None;
    let drained = crate::shm::wait_bounded(bound, || {
        if !ordered {
            match p.barrier() {
                Ok(()) => ordered = true,
                Err(e) => {
                    failed = Some(e);
                    return false;
                }
            }
        }
        let mut busy = false;
        watch.lock().retain(|w| {
            let Some((claim, sock)) = w.claim(p) else {
                busy = true;
                return true;
            };
            if claim != 0 && tags.contains(&claim) {
                // A peer that closed its socket holds no claims.
                if w.peer_gone.load(Ordering::SeqCst)
                    || sock.as_ref().is_some_and(|s| sys::hung_up(s))
                {
                    return false;
                }
                busy = true;
            }
            still_watched(w, claim, &sock)
        });
        !busy
    });
    if let (false, Some(e)) = (ordered, failed) {
        tracing::error!("shm mapped: membarrier failed ({e}); peers' claims are taken as held");
    }
    drained
}

#[cfg(test)]
impl Published {
    /// Clears the table's flags, as a target that issues no barriers writes them.
    pub(crate) fn clear_flags(&self) {
        self.table.word(TABLE_FLAGS).store(0, Ordering::SeqCst);
    }
}

#[cfg(feature = "testing")]
impl Published {
    /// See [`crate::shm::testing::fail_barriers`].
    pub(crate) fn fail_barriers(&self, fail: bool) -> bool {
        self.fail_barriers.store(fail, Ordering::SeqCst);
        self.barriers
    }

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
