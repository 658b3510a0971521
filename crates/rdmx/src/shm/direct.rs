//! Posting on the `direct` data path: an RDMA WRITE or READ to a peer queue pair in this
//! process is executed by the initiator when it is posted, with one memcpy, when nothing
//! posted before it on the queue pair is outstanding.
//!
//! Carried by packets, such a request would cost a handoff between threads: the target's
//! engine runs on whichever thread makes its context's progress (usually the progress
//! thread, since the target application of a one-sided operation does not poll), and
//! the initiator's completion waits for the acknowledgement to come back. Here the
//! initiator does what the target's responder would do, under the target queue pair's
//! lock: the engine checks the target QP's state, its access flags and the rkey (its
//! protection domain, rights and bounds) exactly as for a request packet
//! ([`RcQp::direct_target`](rdmx_core::rc::RcQp::direct_target)), then the bytes are
//! copied and the request completes at once. Both key tables stay read-locked through
//! the copy, which lends it the regions without taking a reference on them: neither
//! region can be deregistered, hence freed, under it.
//!
//! What it must not change, it leaves to the packets:
//!
//! - Order: only a request posted on an empty send queue (nothing in flight, nothing
//!   awaiting its acknowledgement or completion, hence no fence pending) is executed;
//!   on UC, whose requests complete when sent, the peer must also have read every
//!   packet sent before. Anything later goes behind what is queued. Neither engine's
//!   PSNs move, so the packets that follow continue where the last ones stopped.
//! - Errors: a request the target refuses (bad rkey, bounds, rights, QP state), or one
//!   whose own checks fail, is posted as usual, and the packets give the responder's
//!   own answer: the same status, the same state changes, on both sides.
//! - SENDs, WRITEs with immediate data (they take a receive at the target) and atomics
//!   always take the packets.
//!
//! Locks: the initiator takes its own queue pair's lock and the target's in a fixed
//! order (by address), the only place that holds two queue pairs' locks, so two queue
//! pairs posting to each other at once never wait on each other for good. Under them
//! it read-locks its own key table, then the target's if that is another
//! (`Keys::read_nested`, which never queues behind a waiting writer); nothing that holds
//! a key table's lock takes a queue pair's.

use std::sync::Arc;

use parking_lot::MutexGuard;
use rdmx_core::rc::DirectRequest;
use rdmx_core::{SendOp, SendWr};

use super::mapped::{self, PostScope};
use super::qp::{Inner, ShmQp};
use crate::provider::copy::copy;
use crate::provider::MrShared;
use crate::Result;

/// Posts `wr` on `qp`: executed now when it can be (see the module docs), else to the
/// engine, whose packets carry it.
pub(crate) fn post_send(qp: &ShmQp, wr: &SendWr, inline: Option<&[u8]>) -> Result<()> {
    let mut g = qp.inner.lock();
    // A steady stream's WRITE or READ, on the mapped path's lean path.
    if qp.driver.execute_at_post && mapped::execute_lean(&mut g, &qp.keys, wr, inline) {
        g.executed_at_post += 1;
        qp.settle_executed(&mut g);
        return Ok(());
    }
    let mut scope = PostScope::new(&qp.keys);
    let posted = post_one(qp, &mut g, wr, inline, &mut scope);
    mapped::release(&g, &mut scope);
    match posted {
        Ok(Path::AtPost) => qp.settle_executed(&mut g),
        _ => _ = qp.pump_posted(&mut g),
    }
    posted.map(|_| ())
}

/// Posts a list as [`post_send`] posts each request, under one lock and with one progress
/// step; stops at the first refused, with its index.
pub(crate) fn post_send_list(
    qp: &ShmQp,
    wrs: &mut dyn Iterator<Item = (&SendWr, Option<&[u8]>)>,
) -> std::result::Result<(), (usize, crate::Error)> {
    let mut g = qp.inner.lock();
    let mut posted = Ok(());
    // The list's requests to one region on the mapped path claim it once, and its
    // requests on that path lock the key table once (but those on the lean path, each
    // with a claim of its own and no lock).
    let mut scope = PostScope::new(&qp.keys);
    let mut all_at_post = true;
    for (i, (wr, inline)) in wrs.enumerate() {
        // The lean path makes and ends a claim of its own: never while the list holds
        // one (the claim word is the connection's).
        if qp.driver.execute_at_post
            && !scope.claimed()
            && mapped::execute_lean(&mut g, &qp.keys, wr, inline)
        {
            g.executed_at_post += 1;
            continue;
        }
        match post_one(qp, &mut g, wr, inline, &mut scope) {
            Ok(Path::AtPost) => {}
            Ok(Path::Engine) => all_at_post = false,
            Err(e) => {
                posted = Err((i, e));
                all_at_post = false;
                break;
            }
        }
    }
    mapped::release(&g, &mut scope);
    match all_at_post {
        true => qp.settle_executed(&mut g),
        false => _ = qp.pump_posted(&mut g),
    }
    posted
}

/// Where a posted request went.
enum Path {
    /// Executed at post: complete, its completion (if signaled) queued in the engine.
    AtPost,
    /// To the engine, whose packets carry it.
    Engine,
}

/// Executes `wr` at post if it can, else hands it to the engine; the caller makes
/// progress.
fn post_one(
    qp: &ShmQp,
    g: &mut MutexGuard<'_, Inner>,
    wr: &SendWr,
    inline: Option<&[u8]>,
    scope: &mut PostScope<'_>,
) -> Result<Path> {
    let mut executed = qp.driver.execute_at_post && mapped::execute(g, wr, inline, scope);
    if !executed {
        // The paths below may lock the key table themselves.
        scope.unlock_keys();
    }
    let peer = match executed {
        true => None,
        false => candidate(g, wr),
    };
    if let Some(peer) = peer.filter(|p| !std::ptr::eq(Arc::as_ptr(p), qp)) {
        // Both locks, in address order (no other code holds two queue pairs' locks).
        let target = if Arc::as_ptr(&peer) < (qp as *const ShmQp) {
            MutexGuard::unlocked(g, || peer.inner.lock())
        } else {
            peer.inner.lock()
        };
        // The connection may have changed while the locks were taken.
        let same = candidate(g, wr).is_some_and(|p| Arc::ptr_eq(&p, &peer));
        executed = same && target.conn.is_some() && execute(g, target, wr, inline);
    }
    if executed {
        g.executed_at_post += 1;
        Ok(Path::AtPost)
    } else {
        let i = &mut **g;
        i.engine.post_send_ref(&i.keys, wr, inline)?;
        Ok(Path::Engine)
    }
}

/// Whether `wr` may run at post on this QP, on any path that executes at post: a WRITE
/// or READ with nothing outstanding before it, and on UC with every packet sent before
/// it taken by the peer.
pub(super) fn may_run_at_post(g: &Inner, wr: &SendWr) -> bool {
    matches!(wr.op, SendOp::Write(_) | SendOp::Read(_))
        && g.engine.outstanding().0 == 0
        && (g.engine.config().qp_type != rdmx_core::QpType::Uc || g.peer_took_all())
}

/// The peer queue pair, if `wr` might run at post on this connection (the engine decides
/// with both queue pairs locked).
fn candidate(g: &Inner, wr: &SendWr) -> Option<Arc<ShmQp>> {
    if !may_run_at_post(g, wr) {
        return None;
    }
    g.conn.as_ref()?.peer_qp.as_ref()?.upgrade()
}

/// Executes `wr` if it qualifies and the target accepts it; returns whether it did (its
/// completion is then queued in the engine).
fn execute(
    g: &mut Inner,
    target: MutexGuard<'_, Inner>,
    wr: &SendWr,
    inline: Option<&[u8]>,
) -> bool {
    let ty = g.engine.config().qp_type;
    let i = &mut *g;
    // The local regions are lent by the locked key table until the copy is done.
    let keys = i.keys.read();
    let Some(req) = i.engine.direct_request(&keys.view(), wr, inline) else {
        return false;
    };
    // The target's table, nested in ours (the same table when both QPs share a device).
    let theirs = match Arc::ptr_eq(&target.keys, &i.keys) {
        true => None,
        false => Some(target.keys.read_nested()),
    };
    let their_view = theirs.as_ref().map_or(keys.view(), |t| t.view());
    let Some(target_mr) = target.engine.direct_target(&their_view, &req, ty) else {
        return false;
    };
    // The target's lock stays held through the copy, as when its engine places a
    // packet: the access happens while the target QP is in the state that allowed it.
    // SAFETY: the local spans lie in regions the engine resolved, the remote range in
    // the region the target's engine resolved, both checked against their bounds, and
    // both lent by key tables that stay read-locked through the copy (`keys`, `theirs`);
    // `inline` is the caller's slice.
    unsafe { transfer(&req, inline, target_mr) };
    drop(theirs);
    drop(target);
    i.engine.direct_complete(req);
    true
}

/// Copies a direct request's bytes: the local memory (segments, or `inline`) to the
/// target region for a WRITE, the other way for a READ.
///
/// # Safety
///
/// `req`'s segments were resolved by the initiator's engine and `target` by the target's
/// for `req`'s remote range (so every range is inside its region), and both regions stay
/// alive for the call (their key tables stay locked).
unsafe fn transfer(req: &DirectRequest<&MrShared>, inline: Option<&[u8]>, target: &MrShared) {
    let (va, _) = req.remote();
    let remote = target
        .raw_range(va, req.len() as usize)
        .expect("the target's engine resolved the range");
    // SAFETY: `remote` is the resolved range, `req.len()` bytes inside the target's
    // region; the rest is this function's contract.
    unsafe { transfer_at(req, inline, remote) }
}

/// Copies a direct request's bytes between its local memory (segments, or `inline`) and
/// `remote`: to it for a WRITE, from it for a READ.
///
/// # Safety
///
/// `req`'s segments were resolved by the initiator's engine (so each lies inside its
/// region), whose key table stays locked for the call (so the regions stay alive);
/// `remote` is valid for `req.len()` bytes of reads
/// and writes for as long as the call lasts.
pub(super) unsafe fn transfer_at(
    req: &DirectRequest<&MrShared>,
    inline: Option<&[u8]>,
    remote: *mut u8,
) {
    if let Some(data) = inline {
        // SAFETY: `data` is readable for its length, `remote` writable for `req.len()`
        // bytes, which is `data.len()` (the engine took the length from it).
        unsafe { place(remote, data.as_ptr(), data.len()) };
        return;
    }
    let mut at = 0usize;
    for (mr, addr, len) in req.local() {
        let local = mr
            .raw_range(addr, len as usize)
            .expect("the engine resolved the segment");
        let far = remote.wrapping_add(at);
        // SAFETY: `local` lies inside a live registered region, `far..far + len` inside
        // `remote` (the contract): `at + len` stays within the request's length, the
        // sum of the segments.
        unsafe { transfer_one(req.is_read(), local, far, len as usize) };
        at += len as usize;
    }
}

/// Moves the `len` bytes of one local element at `local` and the remote memory at
/// `remote`: into `local` for a READ, out of it for a WRITE (placed in order, see
/// [`place`]).
///
/// # Safety
///
/// Both ranges are valid for `len` bytes (writable where the bytes go).
pub(super) unsafe fn transfer_one(read: bool, local: *mut u8, remote: *mut u8, len: usize) {
    // SAFETY: forwarded.
    unsafe {
        match read {
            true => move_bytes(local, remote, len),
            false => place(remote, local, len),
        }
    }
}

/// Copies the bytes of a WRITE as [`move_bytes`] does, storing the last byte after all
/// the others when the ranges do not overlap: an adapter places a WRITE in order, and a
/// target that polls the last byte of its buffer for arrival (perftest's latency tests)
/// must then find the whole message. `memcpy` stores a copy's first bytes last.
///
/// # Safety
///
/// As [`move_bytes`].
pub(super) unsafe fn place(dst: *mut u8, src: *const u8, len: usize) {
    let (d, s) = (dst as usize, src as usize);
    if len < 2 || (d < s.wrapping_add(len) && s < d.wrapping_add(len)) {
        // SAFETY: forwarded.
        unsafe { move_bytes(dst, src, len) };
        return;
    }
    if len <= SMALL {
        // SAFETY: forwarded; the ranges do not overlap and hold 2 to SMALL bytes.
        unsafe { place_small(dst, src, len) };
        return;
    }
    // The bulk ends at the destination's last cache-line boundary before the last byte:
    // `memcpy` (`rep movsb`) of `len - 1` bytes, ending mid-line, ran slower on 64 KiB
    // than the whole lines.
    let bulk = (d.wrapping_add(len - 1) & !63).wrapping_sub(d).min(len - 1);
    // SAFETY: forwarded; the ranges do not overlap, and the three pieces (`bulk` bytes,
    // then up to the last byte, then the last byte) lie inside them.
    unsafe {
        copy(dst, src, bulk);
        copy(dst.add(bulk), src.add(bulk), len - 1 - bulk);
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
        copy(dst.add(len - 1), src.add(len - 1), 1);
    }
}

/// WRITEs up to this many bytes are placed by [`place_small`].
const SMALL: usize = 16;

/// [`place`] for 2 to [`SMALL`] bytes, inline: all but the last byte by two loads and
/// two stores of the widest word that fits (overlapping in the middle), then the last
/// byte. Through `memcpy` (a call per piece), an 8-byte WRITE on the mapped path took 706
/// instructions from post to return; this way, 606.
///
/// # Safety
///
/// As [`move_bytes`], the ranges not overlapping, and `2 <= len <= SMALL`.
unsafe fn place_small(dst: *mut u8, src: *const u8, len: usize) {
    /// The first `m` bytes by two loads and two stores of a `T`, the second ending on
    /// byte `m` (`size_of::<T>() <= m`).
    ///
    /// # Safety
    ///
    /// As [`place_small`]'s, for the first `m` bytes.
    unsafe fn pair<T>(d: *mut u8, s: *const u8, m: usize) {
        use std::ptr::{read_unaligned as get, write_unaligned as put};
        let w = std::mem::size_of::<T>();
        debug_assert!(w <= m);
        // SAFETY: both accesses lie inside the first `m` bytes of both ranges (`w <= m`);
        // unaligned accesses of raw pointers, forming no reference.
        unsafe {
            let (a, b) = (get(s.cast::<T>()), get(s.add(m - w).cast::<T>()));
            put(d.cast::<T>(), a);
            put(d.add(m - w).cast::<T>(), b);
        }
    }
    debug_assert!((2..=SMALL).contains(&len));
    let m = len - 1;
    // SAFETY: the first `m` bytes (each arm's word fits in them), then the last byte,
    // inside both ranges (the contract).
    unsafe {
        match m {
            8.. => pair::<u64>(dst, src, m),
            4..=7 => pair::<u32>(dst, src, m),
            2..=3 => pair::<u16>(dst, src, m),
            _ => *dst = *src,
        }
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
        *dst.add(m) = *src.add(m);
    }
}

/// Copies `len` bytes from `src` to `dst`, which may overlap (two regions of one process
/// can share memory).
///
/// # Safety
///
/// `src` readable and `dst` writable for `len` bytes; either may be written
/// concurrently by others (registered memory), which leaves the bytes unspecified.
unsafe fn move_bytes(dst: *mut u8, src: *const u8, len: usize) {
    let (d, s) = (dst as usize, src as usize);
    if d < s.wrapping_add(len) && s < d.wrapping_add(len) {
        // SAFETY: forwarded; `ptr::copy` allows overlap.
        unsafe { std::ptr::copy(src, dst, len) };
    } else {
        // SAFETY: forwarded; the ranges do not overlap.
        unsafe { copy(dst, src, len) };
    }
}

#[cfg(test)]
mod tests {
    use super::place;

    #[test]
    fn writes_of_every_small_length_land_whole_and_nothing_beside() {
        let src: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
        for len in 0..=40 {
            for off in 0..9 {
                let mut dst = vec![0xeeu8; 64];
                // SAFETY: both ranges lie inside their vectors, which do not overlap.
                unsafe { place(dst.as_mut_ptr().add(off), src.as_ptr().add(3), len) };
                assert_eq!(&dst[off..off + len], &src[3..3 + len], "len {len} at {off}");
                assert!(dst[..off].iter().all(|&b| b == 0xee), "len {len} at {off}");
                assert!(
                    dst[off + len..].iter().all(|&b| b == 0xee),
                    "len {len} at {off}"
                );
            }
        }
    }
}
