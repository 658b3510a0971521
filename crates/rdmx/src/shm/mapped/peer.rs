//! The initiator's side of the mapped path: the peer's key table and files as this
//! process maps them, and executing a request through them at post time.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{compiler_fence, fence, Ordering};

use rdmx_core::{Access, QpType, SendWr};

use super::{
    slot_word, tag, Map, FILE_MAGIC, FLAG_BARRIERS, FORGET_MAGIC, MAX_FILES, MSG_LEN,
    POPULATE_BUDGET, POPULATE_MAX, SLOTS, S_FILE, S_KEY, S_LEN, S_OFF, S_PD, S_SEQ, S_VA,
    TABLE_FLAGS, TABLE_LEN, TABLE_MAGIC,
};
use crate::shm::qp::{Conn, Inner};
use crate::shm::ring::Segment;
use crate::shm::sys;
use crate::soft::{no_regions, Keys, KeysRead, Lent};

/// The peer's key table and the files it handed over, as this process maps them.
#[derive(Debug)]
pub(crate) struct PeerView {
    table: Map,
    files: HashMap<u64, PeerFile, IdState>,
    /// The last key a request checked, as it was checked: a later request to it reads
    /// the slot's sequence number and the target word again after its claim instead of
    /// looking the key up. Cleared whenever the files change (it points into one).
    last: Option<Held>,
    /// Bytes copied under the claim of the post now running.
    under_claim: u64,
    /// Claims are plain stores: the peer issues a global barrier before it reads them
    /// after a change (its table says so), and this process takes part in such barriers.
    plain_claims: bool,
    /// Claims made so far.
    claims: u64,
    /// Bytes of the peer's files populated when mapped, and how many may be (see
    /// [`POPULATE_BUDGET`]).
    populated: usize,
    populate_budget: usize,
}

/// Bytes of address space the files of every peer take in this process, and how many
/// files: a peer hands over sparse files of any size (a sealed memfd of 60 TiB costs it
/// nothing), and each mapping is one of the process's `vm.max_map_count` areas.
static PEER_FILES: std::sync::Mutex<(usize, usize)> = std::sync::Mutex::new((0, 0));
/// Most bytes of address space peers' files may take in this process (32 TiB, a quarter
/// of x86_64's user address space): a file beyond it ends its connection.
const PEER_BYTES_MAX: usize = 1 << 45;
/// Most peer files mapped in this process at once (`vm.max_map_count` is 65,530 by
/// default, for every mapping of the process).
const PEER_FILES_MAX: usize = 16384;

/// A peer's file as this process maps it: counted in [`PEER_FILES`] while it is, and
/// in its connection's populated bytes if it was populated.
#[derive(Debug)]
struct PeerFile {
    map: Map,
    populated: usize,
}

impl PeerFile {
    /// Maps `len` bytes of `fd` (populated if `populate`), if the budget has room.
    fn map(fd: &OwnedFd, len: usize, populate: bool) -> std::io::Result<PeerFile> {
        {
            let mut used = PEER_FILES.lock().unwrap_or_else(|e| e.into_inner());
            let bytes = used.0.checked_add(len).filter(|&n| n <= PEER_BYTES_MAX);
            match bytes {
                Some(bytes) if used.1 < PEER_FILES_MAX => *used = (bytes, used.1 + 1),
                _ => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::OutOfMemory,
                        "peers' files would take more address space or mappings than a \
                         process gives them (32 TiB, 16,384 files)",
                    ))
                }
            }
        }
        Map::with(fd, len, true, populate)
            .map(|map| PeerFile {
                map,
                populated: if populate { len } else { 0 },
            })
            .inspect_err(|_| unmapped(len))
    }
}

impl std::ops::Deref for PeerFile {
    type Target = Map;
    fn deref(&self) -> &Map {
        &self.map
    }
}

impl Drop for PeerFile {
    fn drop(&mut self) {
        unmapped(self.map.len);
    }
}

/// A peer file of `len` bytes is no longer mapped.
fn unmapped(len: usize) {
    let mut used = PEER_FILES.lock().unwrap_or_else(|e| e.into_inner());
    *used = (used.0.saturating_sub(len), used.1.saturating_sub(1));
}

/// Most bytes a post list copies under one claim: past them the claim is made again
/// (after reading the slot again), so that a long list never holds one for long enough
/// to look stalled to a deregistration waiting for it ([`super::DRAIN_BOUND`]).
const CLAIM_BYTES: u64 = 64 << 20;

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
        let plain_claims = table.word(TABLE_FLAGS).load(Ordering::Relaxed) & FLAG_BARRIERS != 0
            && sys::takes_global_barriers();
        Ok(PeerView {
            table,
            files: HashMap::default(),
            last: None,
            under_claim: 0,
            plain_claims,
            claims: 0,
            populated: 0,
            populate_budget: POPULATE_BUDGET,
        })
    }

    /// Handles a message of the peer's on the connection's socket that is not a wake-up:
    /// a file handed over (`fd`) or taken back. An error (a message that is not rdmx's, a
    /// file that cannot be mapped) ends the connection.
    pub(crate) fn handle(&mut self, msg: &[u8; MSG_LEN], fds: Vec<OwnedFd>) -> std::io::Result<()> {
        let bad = |why| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
        let id = u64::from_ne_bytes(msg[8..16].try_into().expect("8 bytes"));
        // The look-up kept may point into the file this message replaces or forgets.
        self.last = None;
        let mut fds = fds.into_iter();
        match (&msg[..8], fds.next(), fds.next()) {
            (m, Some(fd), None) if m == FILE_MAGIC => {
                if !sys::sealed(&fd) {
                    return Err(bad("a file whose size is not sealed"));
                }
                if sys::on_hugetlbfs(&fd) {
                    return Err(bad(
                        "a file on hugetlbfs (its pages can go under a mapping)",
                    ));
                }
                if self.files.len() >= MAX_FILES && !self.files.contains_key(&id) {
                    return Err(bad("more files than a connection maps"));
                }
                let len = sys::file_size(&fd)?;
                let len = usize::try_from(len)
                    .ok()
                    .filter(|&n| n > 0 && n <= isize::MAX as usize)
                    .ok_or_else(|| bad("a file of a bad size"))?;
                let populate = len <= POPULATE_MAX
                    && self.populated.saturating_add(len) <= self.populate_budget;
                let file = PeerFile::map(&fd, len, populate)?;
                self.populated += file.populated;
                if let Some(old) = self.files.insert(id, file) {
                    self.populated -= old.populated;
                }
            }
            (m, None, None) if m == FORGET_MAGIC => {
                if let Some(old) = self.files.remove(&id) {
                    self.populated -= old.populated;
                }
            }
            _ => {
                return Err(bad(
                    "a message on the connection's socket that is not rdmx's",
                ))
            }
        }
        Ok(())
    }
}

/// A key as a request checked it, kept for the next (the claim of a post list's
/// requests to one region is made once, and a later post skips the look-up): the slot,
/// the words it was checked against, and what the slot said of the region.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Held {
    rkey: u32,
    seq: u64,
    target: u64,
    rights: Access,
    /// The region's first address and length, as the peer published them.
    va: u64,
    len: u64,
    /// Where the region starts in this process's mapping of its file, and the bytes of
    /// the file from there on.
    at: *mut u8,
    room: u64,
}

// SAFETY: `at` is an address in one of the peer's files as the `PeerView` that keeps
// the look-up maps it (the view drops the look-up whenever its files change); it is a
// plain address into shared memory, dereferenced only by the copy, under the QP's lock.
unsafe impl Send for Held {}

impl Held {
    /// The key table slot the claim names.
    fn idx(&self) -> usize {
        self.rkey as usize % SLOTS
    }

    /// Where `[va, va + len)` lies in the mapping, if the region covers it with `need`.
    fn place(&self, va: u64, len: u64, need: Access) -> Option<*mut u8> {
        let from = va.checked_sub(self.va)?;
        let end = from.checked_add(len)?;
        (self.rights.contains(need) && end <= self.len && end <= self.room)
            .then(|| self.at.wrapping_add(from as usize))
    }
}

/// What one post (a request, or a list of them) keeps from one request to the next on
/// the mapped path: its claim, and the local key table's read lock.
pub(crate) struct PostScope<'k> {
    /// A claim names the key the connection's view kept (see [`execute`]).
    claimed: bool,
    keys: &'k Keys,
    /// The local key table, read-locked since the first request of the post that had
    /// local segments: the regions they name are lent by it (no reference is taken on
    /// them), and a list's later requests take no lock of their own.
    lent: Option<KeysRead<'k>>,
}

impl<'k> PostScope<'k> {
    /// A post on a queue pair whose key table is `keys`.
    pub(crate) fn new(keys: &'k Keys) -> PostScope<'k> {
        PostScope {
            claimed: false,
            keys,
            lent: None,
        }
    }

    /// Whether the post holds a claim (made by an earlier request of its list).
    pub(crate) fn claimed(&self) -> bool {
        self.claimed
    }

    /// Unlocks the key table, before anything of the post that may lock it again (a
    /// request for the engine, or for the `direct` path): a second read lock on the same
    /// thread would queue behind a waiting writer, which waits for the first.
    pub(crate) fn unlock_keys(&mut self) {
        self.lent = None;
    }
}

/// Executes `wr` on the mapped data path if it qualifies and the target accepts it;
/// returns whether it did (its completion is then queued in the engine).
///
/// The claim made for it stays for the next request of the same post (`scope` says so;
/// it names the key the connection's view kept): a request to the same key copies under
/// it after reading again the slot's sequence number and the target word (no new claim,
/// no new look-up). The caller releases it with [`release`] before it lets go of the
/// queue pair's lock.
pub(crate) fn execute(
    g: &mut Inner,
    wr: &SendWr,
    inline: Option<&[u8]>,
    scope: &mut PostScope<'_>,
) -> bool {
    if !crate::shm::direct::may_run_at_post(g, wr) {
        return false;
    }
    let ty = g.engine.config().qp_type;
    let Some((seg, side, view)) = mapped_conn(&mut g.conn) else {
        return false;
    };
    if view.files.is_empty() {
        return false;
    }
    let PostScope {
        claimed,
        keys,
        lent,
    } = scope;
    // The local regions are lent by the locked key table until the copy is done, or
    // past its lock by the loan the queue pair keeps (a request naming only the region
    // the last one named, none deregistered since); inline bytes need none, nor the lock.
    let kept_loan = match inline {
        Some(_) => None,
        None => standing_loan(g.lent, keys, wr),
    };
    let req = match (inline, &kept_loan) {
        (Some(_), _) => g.engine.direct_request(&no_regions(), wr, inline),
        // SAFETY: no region of the table was deregistered since the loan was made
        // (`still_lends`), and each deregistration waits, after raising the count it
        // read, for this queue pair's lock (`Driver::wait_for_borrowers`), held here
        // until the copy is done.
        (None, Some(loan)) => g.engine.direct_request(&unsafe { loan.view() }, wr, inline),
        (None, None) => {
            let lent = &*lent.get_or_insert_with(|| keys.read());
            if let [s, ..] = wr.sges.as_slice() {
                g.lent = lent.lend(s.lkey);
            }
            g.engine.direct_request(&lent.view(), wr, inline)
        }
    };
    let Some(req) = req else {
        return false;
    };
    let (va, rkey) = req.remote();
    let len = u64::from(req.len());
    let need = if req.is_read() {
        Access::REMOTE_READ
    } else {
        Access::REMOTE_WRITE
    };
    // The key as an earlier request checked it.
    let kept = view.last.filter(|h| h.rkey == rkey);
    if *claimed {
        // The claim still names the kept key's slot: it cannot be reused under the
        // copy. Whatever changed since it was checked, or enough copied under it, sends
        // the request the long way (a new claim).
        let fits = view.under_claim.saturating_add(len) <= CLAIM_BYTES;
        let at = kept.filter(|_| fits).and_then(|h| {
            h.place(va, len, need).filter(|_| {
                slot_word(&view.table, h.idx(), S_SEQ).load(Ordering::Acquire) == h.seq
                    && seg.target_word(1 - side).load(Ordering::Acquire) == h.target
            })
        });
        if let Some(at) = at {
            // SAFETY: `at` lies `req.len()` bytes inside the region the claim covers
            // and inside the peer's mapped file (`place` checked both against what
            // `check` read), which `view` keeps mapped for the call; otherwise as for a
            // request that claims (below).
            unsafe { crate::shm::direct::transfer_at(&req, inline, at) };
            view.under_claim += len;
            g.engine.direct_complete(req);
            return true;
        }
        *claimed = false;
        seg.claim_word(side).store(0, Ordering::Release);
    }
    // The kept look-up if it covers this request, else a new one.
    let (at, found) = match kept.and_then(|h| Some((h.place(va, len, need)?, h))) {
        Some(hit) => hit,
        None => {
            let Some(hit) = check(view, seg, 1 - side, va, rkey, len, need, ty) else {
                return false;
            };
            view.last = Some(hit.1);
            hit
        }
    };
    if !claim(view, seg, side, &found) {
        return false;
    }
    // SAFETY: `at` lies `req.len()` bytes inside the peer's mapped file (checked by
    // `check`, now or for an earlier post: the look-up `view` kept is dropped whenever
    // its files change), which `view` keeps mapped for the call; `req`'s segments were
    // resolved by this QP's engine in regions that stay registered for the call: lent
    // by the read-locked table (`lent`), or by the queue pair's loan, which no
    // deregistration has voided and none can before this QP's lock goes (see the loan's
    // SAFETY above); an inline request has none: its bytes are the caller's slice. The file
    // is a mapping of its own, so it never overlaps local memory (it may view the same
    // pages when the peer is this process, which leaves the bytes unspecified, as
    // concurrent access to registered memory does).
    unsafe { crate::shm::direct::transfer_at(&req, inline, at) };
    *claimed = true;
    view.under_claim = len;
    view.claims += 1;
    g.engine.direct_complete(req);
    true
}

/// The queue pair's loan `lent`, if every element of `wr` names its region and no region
/// of the table was deregistered since it was made.
fn standing_loan(lent: Option<Lent>, keys: &Keys, wr: &SendWr) -> Option<Lent> {
    lent.filter(|l| wr.sges.iter().all(|s| s.lkey == l.lkey()) && keys.still_lends(l))
}

/// The connection's segment, this side of it, and its view of the peer's files, if it
/// runs the mapped path.
fn mapped_conn(conn: &mut Option<Conn>) -> Option<(&Segment, usize, &mut PeerView)> {
    match conn {
        Some(Conn {
            seg,
            side,
            mapped: Some(view),
            ..
        }) => Some((seg, *side, view)),
        _ => None,
    }
}

/// Claims the slot `found` names, then sees that neither it nor the target changed since
/// it was checked (module docs). If either did, withdraws the claim, drops the kept
/// look-up and returns false: the request takes the packets.
fn claim(view: &mut PeerView, seg: &Segment, side: usize, found: &Held) -> bool {
    let claim = seg.claim_word(side);
    if view.plain_claims {
        // The loads below may pass the store in this CPU; the peer's global barrier,
        // between its change and its read of the claim, orders them (module docs).
        claim.store(tag(found.idx(), found.seq), Ordering::Relaxed);
        compiler_fence(Ordering::SeqCst);
    } else {
        claim.store(tag(found.idx(), found.seq), Ordering::SeqCst);
    }
    let seq = slot_word(&view.table, found.idx(), S_SEQ).load(Ordering::SeqCst);
    let target = seg.target_word(1 - side).load(Ordering::SeqCst);
    if seq != found.seq || target != found.target {
        claim.store(0, Ordering::Release);
        view.last = None;
        return false;
    }
    true
}

/// Executes on the lean path (module docs) a request of the steady stream a queue pair
/// sees most, to the key the connection's view kept, whose range covers it: a WRITE of
/// `inline` bytes, or a WRITE or READ of one element in the region the queue pair has on
/// loan. The caller holds no claim (the request makes and ends its own). The checks are
/// those of [`execute`] on that path, without building the engine's request: the loan's
/// own resolution of the element, `may_run_at_post`, the engine's
/// [`direct_ready`](rdmx_core::rc::RcQp::direct_ready), the kept look-up's, the claim.
/// Returns false, having changed nothing (but for a claim that found the slot changed,
/// which drops the kept look-up as `execute` does), when any of them does not hold: the
/// request then goes to [`execute`] and the other paths.
pub(crate) fn execute_lean(g: &mut Inner, keys: &Keys, wr: &SendWr, inline: Option<&[u8]>) -> bool {
    let read = matches!(wr.op, rdmx_core::SendOp::Read(_));
    let need = match read {
        true => Access::REMOTE_READ,
        false => Access::REMOTE_WRITE,
    };
    // The local bytes: where they are, and how many.
    let (local, len) = match inline {
        // (`direct_ready` below lets only a WRITE carry inline bytes.)
        Some(data) => (Local::Inline(data), data.len()),
        None => {
            let [sge] = wr.sges.as_slice() else {
                return false;
            };
            let Some(loan) = standing_loan(g.lent, keys, wr) else {
                return false;
            };
            let local_need = match read {
                true => Access::LOCAL_WRITE,
                false => Access::empty(),
            };
            // SAFETY: no region of the table was deregistered since the loan was made
            // (`still_lends`), and each deregistration waits, after raising the count it
            // read, for this queue pair's lock, held by the caller until the copy is
            // done.
            let lent = unsafe { loan.view() };
            let at = rdmx_core::rc::MemAccess::resolve(
                &lent,
                sge.lkey,
                rdmx_core::KeyUse::Local,
                g.engine.config().pd,
                sge.addr,
                u64::from(sge.len),
                local_need,
            )
            .ok()
            .and_then(|mr| mr.raw_range(sge.addr, sge.len as usize));
            let Some(at) = at else {
                return false;
            };
            (Local::Lent(at), sge.len as usize)
        }
    };
    if !crate::shm::direct::may_run_at_post(g, wr) {
        return false;
    }
    let Some(remote) = g.engine.direct_ready(wr, inline) else {
        return false;
    };
    // Zero-length requests take the packets, as with `direct_request`.
    let Ok(len32 @ 1..) = u32::try_from(len) else {
        return false;
    };
    let Some((seg, side, view)) = mapped_conn(&mut g.conn) else {
        return false;
    };
    let Some((at, found)) = view
        .last
        .filter(|h| h.rkey == remote.rkey)
        .and_then(|h| Some((h.place(remote.addr, len as u64, need)?, h)))
    else {
        return false;
    };
    if !claim(view, seg, side, &found) {
        return false;
    }
    // SAFETY: `at` lies `len` bytes inside the peer's mapped file (the kept look-up
    // checked it, and `view` drops it whenever its files change), which `view` keeps
    // mapped for the call; the local bytes are the caller's slice, or lie `len` bytes
    // inside the region on loan, which stays registered while this queue pair's lock is
    // held (above). The file is a mapping of its own, never overlapping local memory
    // (see `execute`).
    unsafe {
        match local {
            Local::Inline(data) => crate::shm::direct::place(at, data.as_ptr(), len),
            Local::Lent(p) => crate::shm::direct::transfer_one(read, p, at, len),
        }
    };
    seg.claim_word(side).store(0, Ordering::Release);
    view.claims += 1;
    g.engine.direct_done(
        wr.wr_id,
        read,
        len32,
        wr.flags.contains(rdmx_core::SendFlags::SIGNALED),
    );
    true
}

/// The local bytes of a request on the lean path ([`execute_lean`]).
enum Local<'a> {
    /// Inline bytes, the caller's.
    Inline(&'a [u8]),
    /// The element's bytes in the region on loan.
    Lent(*mut u8),
}

/// Ends the claim of the post, if it made one, and unlocks the key table.
pub(crate) fn release(g: &Inner, scope: &mut PostScope<'_>) {
    scope.unlock_keys();
    if std::mem::take(&mut scope.claimed) {
        if let Some(c) = g.conn.as_ref() {
            c.seg.claim_word(c.side).store(0, Ordering::Release);
        }
    }
}

/// Checks a request to `[va, va + len)` with `rkey` needing `need`, as the target's
/// responder would, against the target word of side `peer` and the peer's key table.
/// Returns where the request goes in the mapped file, and what was checked: the slot,
/// its sequence number, the target word and the region.
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
) -> Option<(*mut u8, Held)> {
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
    if pd >> 32 != 1 || key as u32 != rkey || pd as u32 != (target >> 32) as u32 {
        return None;
    }
    let map = view.files.get(&file)?;
    let room = (map.len as u64).checked_sub(off)?;
    // What a later request to this key may do: what both the region and the target QP
    // (its access flags, in the target word) allow.
    let qp_access = Access::from_bits_truncate(((target >> 8) & 0xff_ffff) as u32);
    let held = Held {
        rkey,
        seq,
        target,
        rights: Access::from_bits_truncate((key >> 32) as u32) & qp_access,
        va: e_va,
        len: e_len,
        at: map.base.wrapping_add(off as usize),
        room,
    };
    Some((held.place(va, len, need)?, held))
}

/// `target` if it says a QP of type `ty` that accepts requests needing `need`.
pub(super) fn target_word_checked(target: u64, need: Access, ty: QpType) -> Option<u64> {
    let want_ty = match ty {
        QpType::Rc => 1,
        QpType::Uc => 2,
        _ => return None,
    };
    let access = Access::from_bits_truncate(((target >> 8) & 0xff_ffff) as u32);
    (target & 1 == 1 && (target >> 1) & 3 == want_ty && access.contains(need)).then_some(target)
}

#[cfg(feature = "testing")]
impl PeerView {
    /// Claims made on this connection so far.
    pub(crate) fn claims(&self) -> u64 {
        self.claims
    }

    /// Whether the peer publishes `rkey` now (a stable slot naming it, marked valid).
    pub(crate) fn publishes(&self, rkey: u32) -> bool {
        let idx = rkey as usize % SLOTS;
        let seq = slot_word(&self.table, idx, S_SEQ).load(Ordering::SeqCst);
        let key = slot_word(&self.table, idx, S_KEY).load(Ordering::SeqCst);
        let pd = slot_word(&self.table, idx, S_PD).load(Ordering::SeqCst);
        seq & 1 == 0 && key as u32 == rkey && pd >> 32 == 1
    }

    /// How many of the peer's files are mapped.
    pub(crate) fn files_mapped(&self) -> usize {
        self.files.len()
    }

    /// The tag a claim on `rkey` carries now, if the peer publishes it.
    pub(crate) fn tag_of(&self, rkey: u32) -> Option<u64> {
        let idx = rkey as usize % SLOTS;
        let seq = slot_word(&self.table, idx, S_SEQ).load(Ordering::SeqCst);
        let key = slot_word(&self.table, idx, S_KEY).load(Ordering::SeqCst);
        (seq & 1 == 0 && key as u32 == rkey).then(|| tag(idx, seq))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file message for file `id`.
    fn file_msg(id: u64) -> [u8; MSG_LEN] {
        let mut msg = [0u8; MSG_LEN];
        msg[..8].copy_from_slice(FILE_MAGIC);
        msg[8..16].copy_from_slice(&id.to_ne_bytes());
        msg
    }

    /// An initiator claims with plain stores only where the target's table says it
    /// issues global barriers and this process takes part in them.
    #[test]
    fn claims_are_plain_only_when_the_target_barriers() {
        let table = super::super::Published::new().unwrap();
        let v = PeerView::open(table.fd()).unwrap();
        let can = sys::issues_global_barriers() && sys::takes_global_barriers();
        assert_eq!(v.plain_claims, can);
        table.clear_flags();
        let v = PeerView::open(table.fd()).unwrap();
        assert!(
            !v.plain_claims,
            "a target that issues no barrier gets plain claims"
        );
    }

    #[test]
    fn populated_files_stay_within_the_budget() {
        let table = super::super::Published::new().unwrap();
        let mut v = PeerView::open(table.fd()).unwrap();
        v.populate_budget = 3 << 20;
        for id in 0..5 {
            let fd = sys::memfd(1 << 20).unwrap();
            v.handle(&file_msg(id), vec![fd]).unwrap();
        }
        assert_eq!(v.files.len(), 5, "every file is mapped");
        assert_eq!(v.populated, 3 << 20, "only the budget's worth is populated");
        // A populated file forgotten gives its room back: the next one is populated.
        let mut forget = file_msg(0);
        forget[..8].copy_from_slice(FORGET_MAGIC);
        v.handle(&forget, Vec::new()).unwrap();
        assert_eq!(v.populated, 2 << 20);
        v.handle(&file_msg(5), vec![sys::memfd(1 << 20).unwrap()])
            .unwrap();
        assert_eq!(v.populated, 3 << 20, "the room was not given back");
    }

    /// A sealed file on hugetlbfs (whose pages a hole punched by the peer would give
    /// back under this process's mapping) is refused, and nothing is mapped.
    #[test]
    fn a_file_on_hugetlbfs_is_refused() {
        let table = super::super::Published::new().unwrap();
        let mut v = PeerView::open(table.fd()).unwrap();
        // SAFETY: memfd_create takes a NUL-terminated name and flags; returns a new fd.
        let raw = unsafe {
            libc::memfd_create(
                c"huge".as_ptr(),
                libc::MFD_HUGETLB | libc::MFD_ALLOW_SEALING,
            )
        };
        assert!(raw >= 0, "{}", std::io::Error::last_os_error());
        // SAFETY: a new descriptor that nothing else owns.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
        // SAFETY: ftruncate and fcntl on a descriptor we own.
        unsafe {
            assert_eq!(libc::ftruncate(raw, 2 << 20), 0);
            let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
            assert_eq!(libc::fcntl(raw, libc::F_ADD_SEALS, seals), 0);
        }
        assert!(sys::sealed(&fd));
        let err = v.handle(&file_msg(1), vec![fd]).unwrap_err();
        assert!(err.to_string().contains("hugetlbfs"), "{err}");
        assert!(v.files.is_empty());
    }

    /// A sealed, sparse file of `len` bytes.
    fn sparse(len: u64) -> OwnedFd {
        sys::memfd(len as usize).unwrap()
    }

    /// Peers' sparse files (free to them) take at most 32 TiB of this process's address
    /// space: a 64 TiB one ends its connection unmapped; a forgotten file gives its room
    /// back.
    #[test]
    fn peer_files_take_a_bounded_address_space() {
        let table = super::super::Published::new().unwrap();
        let mut v = PeerView::open(table.fd()).unwrap();
        let err = v.handle(&file_msg(1), vec![sparse(1 << 46)]).unwrap_err();
        assert!(err.to_string().contains("address space"), "{err}");
        assert!(v.files.is_empty());
        // 20 TiB, forgotten, then 20 TiB again: the first gave its room back.
        v.handle(&file_msg(2), vec![sparse(20 << 40)]).unwrap();
        let mut forget = file_msg(2);
        forget[..8].copy_from_slice(FORGET_MAGIC);
        v.handle(&forget, Vec::new()).unwrap();
        v.handle(&file_msg(3), vec![sparse(20 << 40)]).unwrap();
        assert_eq!(v.files.len(), 1);
    }

    #[test]
    fn a_message_that_is_not_rdmx_s_is_an_error() {
        let table = super::super::Published::new().unwrap();
        let mut v = PeerView::open(table.fd()).unwrap();
        let mut msg = file_msg(1);
        msg[..8].copy_from_slice(b"NOTRDMX!");
        assert!(v.handle(&msg, Vec::new()).is_err());
        // A file message without its file.
        assert!(v.handle(&file_msg(1), Vec::new()).is_err());
        assert!(v.files.is_empty());
    }
}
