//! A connection's shared segment: two single-producer single-consumer byte rings, one per
//! direction, in a memfd both processes map.
//!
//! ```text
//! 0     magic, ring capacity                       (written by the creator, checked once)
//! 64    side 0 asleep    128   side 1 asleep       (wake-up flags)
//! 192   side 0 pulls     196   side 1 pulls        (it reads descriptor records)
//! 384   ring 0: head                               (side 0 → side 1)
//! 640   ring 1: head                               (side 1 → side 0)
//! 768   side 0 as a target   832   side 1 as a target   (the `mapped` data path:
//! 1024  side 0's claim       1088  side 1's claim        see `mapped`)
//! 1152  side 0 copying       1216  side 1 copying      (it copies payload out of its
//! 1280  side 0 gone          1344  side 1 gone          peer's memory; its QP is gone)
//! 4096  ring 0 data, then ring 1 data              (capacity bytes each)
//! ```
//!
//! The consumer's head is a byte count that only grows; a position is the count modulo the
//! capacity. A ring holds records, 16-aligned, never wrapping: a record that would not fit
//! before the end is preceded by a wrap record that fills the rest. A producer that finds
//! the consumer has taken everything, once past the first [`early_wrap`] bytes, also wraps,
//! so that a connection whose ring keeps draining (requests and answers in turn) cycles
//! through a few cache-warm pages rather than through the whole ring, each page faulted in
//! on its first lap. A record is a 16-byte header (kind, prefix length, payload offset,
//! payload length), the packet's first bytes (its headers), then, at `payload offset`, the
//! rest of the packet. Large payloads start at the same offset within a cache line as the
//! memory they were copied from, so that copy runs at full speed; a short record's payload
//! starts as far in as it takes for the record to end where a cache line does, so that the
//! next record starts a line and the consumer gets it whole with the line its kind word is
//! in. A descriptor record has the same layout; its payload names where the packet's
//! payload lies in the producer's memory, for the consumer to copy from there itself (a
//! side says it can by raising its `pulls` flag).
//!
//! The kind word publishes a record: the producer writes it last, with release ordering,
//! and the consumer polls the kind word where its next record starts, so an arriving
//! record costs the consumer's core one cache-line transfer, not one for an index and
//! then one for the record. A batch of short records is published by its first record's
//! kind word, written last, so that the consumer does not poll the lines the producer is
//! writing ([`Producer::batch`]). A kind of 0 means nothing yet: before it publishes a
//! record, the producer clears the kind word where the record after it will start (the
//! room it asks for includes that header), so the consumer never mistakes bytes of an
//! older record for a new one. A fresh segment is all zeros. The producer learns how far the
//! consumer got from the consumer's head.
//!
//! Everything in the segment is the peer's to change at any moment. The producer keeps
//! its own tail and the consumer its own head (neither reads its own index back); the
//! producer reads the consumer's head with an atomic load and checks it; headers are
//! copied out once and checked before anything is trusted; payload bytes are only ever
//! copied, never referenced. A peer that breaks a rule gets a [`RingError`], and its queue
//! pair goes to the error state: it cannot make this process read or write outside the
//! segment.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use super::sys;
use crate::provider::copy::copy;

const MAGIC: u64 = u64::from_be_bytes(*b"RDMXSHM3");
const SLEEP_OFF: [usize; 2] = [64, 128];
const HEAD_OFF: [usize; 2] = [384, 640];
const DATA_OFF: usize = 4096;
const REC_HDR: usize = 16;
const KIND_PACKET: u32 = 1;
const KIND_WRAP: u32 = 2;
const KIND_DESC: u32 = 3;
const PULLS_OFF: [usize; 2] = [192, 196];
const TARGET_OFF: [usize; 2] = [768, 832];
const CLAIM_OFF: [usize; 2] = [1024, 1088];
const COPYING_OFF: [usize; 2] = [1152, 1216];
const GONE_OFF: [usize; 2] = [1280, 1344];
/// Payloads at least this long are placed at their source's offset in a cache line.
const ALIGN_MIN: usize = 256;
/// Most bytes of a record's prefix (the packet's headers, and inline payload).
pub(crate) const MAX_PREFIX: usize = 8192;

/// How a peer broke the ring's rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RingError {
    /// The peer's index is beyond what the ring can hold.
    Index { what: &'static str, value: u64 },
    /// A record header that no producer writes.
    Garbage(&'static str),
    /// Copying a descriptor's bytes out of the peer failed (the error): it named memory
    /// it does not have, or it exited.
    Pull(String),
    /// A record of this many bytes, which this side would send, does not fit the rings:
    /// they are smaller than the queue pair's path MTU needs.
    TooLarge(usize),
}

impl std::fmt::Display for RingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RingError::Index { what, value } => {
                write!(f, "the peer's {what} ({value}) lies beyond the ring")
            }
            RingError::Garbage(why) => write!(f, "garbage in the ring: {why}"),
            RingError::Pull(e) => write!(
                f,
                "copying a payload out of the peer's memory failed ({e}): the peer \
                 exited, or its descriptor names memory it does not have"
            ),
            RingError::TooLarge(n) => write!(
                f,
                "a record of {n} bytes does not fit the rings (each record may take at \
                 most half a ring)"
            ),
        }
    }
}

fn round16(n: usize) -> usize {
    (n + 15) & !15
}

/// A mapped segment.
#[derive(Debug)]
pub(crate) struct Segment {
    base: *mut u8,
    len: usize,
    cap: usize,
}

// SAFETY: the mapping is process memory shared with a peer; the segment hands out no
// references into it but to atomics (`&AtomicU64`, `&AtomicU32`), and otherwise copies,
// so any thread may use it.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: `base` and `len` are the mapping this segment made; nothing refers into
        // it once the segment is gone.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// Bytes of a segment whose rings hold `cap` bytes each.
pub(crate) fn segment_len(cap: usize) -> usize {
    DATA_OFF + 2 * cap
}

impl Segment {
    /// A new segment with rings of `cap` bytes (a power of two, at least 4 KiB), and the
    /// memfd to pass to the peer.
    pub(crate) fn create(cap: usize) -> std::io::Result<(Segment, OwnedFd)> {
        assert!(cap.is_power_of_two() && cap >= 4096);
        let fd = sys::memfd(segment_len(cap))?;
        let seg = Self::map(&fd, cap)?;
        // SAFETY: offsets 0 and 8 lie inside the new mapping, 8-aligned (page-aligned base).
        unsafe {
            AtomicU64::from_ptr(seg.base.cast()).store(MAGIC, Ordering::Relaxed);
            AtomicU64::from_ptr(seg.base.add(8).cast()).store(cap as u64, Ordering::Relaxed);
        }
        Ok((seg, fd))
    }

    /// Maps a segment the peer created, after checking its size and header.
    pub(crate) fn open(fd: &OwnedFd, cap: usize) -> std::io::Result<Segment> {
        let bad = |why| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
        if !cap.is_power_of_two() || !(4096..=1 << 30).contains(&cap) {
            return Err(bad("a ring capacity out of range"));
        }
        if !sys::sealed(fd) {
            return Err(bad("a segment whose size is not sealed"));
        }
        if sys::file_size(fd)? < segment_len(cap) as u64 {
            return Err(bad("a segment smaller than its rings"));
        }
        let seg = Self::map(fd, cap)?;
        if seg.atomic64(0).load(Ordering::Relaxed) != MAGIC
            || seg.atomic64(8).load(Ordering::Relaxed) != cap as u64
        {
            return Err(bad("a segment that is not an rdmx ring pair"));
        }
        Ok(seg)
    }

    /// Ring capacity in bytes.
    pub(crate) fn cap(&self) -> usize {
        self.cap
    }

    fn map(fd: &OwnedFd, cap: usize) -> std::io::Result<Segment> {
        let len = segment_len(cap);
        // SAFETY: maps `len` bytes of the file shared; the kernel picks the address. The
        // file is sealed against shrinking (checked by `open`, done by `sys::memfd`), so
        // the mapping stays backed.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Segment {
            base: p.cast(),
            len,
            cap,
        })
    }

    fn atomic64(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off % 8 == 0 && off + 8 <= DATA_OFF);
        // SAFETY: `off` is one of the 8-aligned control words inside the mapping, which
        // lives as long as `self`; shared words are only accessed atomically.
        unsafe { AtomicU64::from_ptr(self.base.add(off).cast()) }
    }

    fn atomic32(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off % 4 == 0 && off + 4 <= DATA_OFF);
        // SAFETY: as in `atomic64`.
        unsafe { AtomicU32::from_ptr(self.base.add(off).cast()) }
    }

    /// The first byte of ring `ring`'s data.
    fn data(&self, ring: usize) -> *mut u8 {
        self.base.wrapping_add(DATA_OFF + ring * self.cap)
    }

    /// Side `side` is about to sleep (or has woken): whoever changes a ring it cares
    /// about wakes it if this is set.
    pub(crate) fn set_asleep(&self, side: usize, on: bool) {
        self.atomic32(SLEEP_OFF[side])
            .store(u32::from(on), Ordering::SeqCst);
    }

    /// Whether side `side` sleeps and must be woken; clears the flag.
    pub(crate) fn take_asleep(&self, side: usize) -> bool {
        // Orders the ring update before this load (pairs with the sleeper's store of the
        // flag before it checks the rings again).
        fence(Ordering::SeqCst);
        let flag = self.atomic32(SLEEP_OFF[side]);
        flag.load(Ordering::Relaxed) != 0 && flag.swap(0, Ordering::SeqCst) != 0
    }

    /// Side `side` reads descriptor records from now on.
    pub(crate) fn set_pulls(&self, side: usize) {
        self.atomic32(PULLS_OFF[side]).store(1, Ordering::Release);
    }

    /// Whether side `side` said it reads descriptor records.
    pub(crate) fn pulls(&self, side: usize) -> bool {
        self.atomic32(PULLS_OFF[side]).load(Ordering::Acquire) == 1
    }

    /// Side `side` starts copying a payload out of its peer's memory (a descriptor
    /// record's): returns false, and copies nothing, if the peer's queue pair is gone.
    ///
    /// With [`leave`](Self::leave) it makes a handshake: the flag and the peer's `gone`
    /// word are each stored, then the other's read, sequentially consistent, so either
    /// the copier sees the peer gone, or the peer sees the copy and waits for it to end
    /// ([`copy_done`](Self::copy_done)) before its memory may be used again.
    pub(crate) fn copy_begin(&self, side: usize) -> bool {
        self.atomic32(COPYING_OFF[side]).store(1, Ordering::SeqCst);
        if self.atomic32(GONE_OFF[1 - side]).load(Ordering::SeqCst) != 0 {
            self.copy_done(side);
            return false;
        }
        true
    }

    /// Side `side`'s copy out of its peer's memory is over.
    pub(crate) fn copy_done(&self, side: usize) {
        self.atomic32(COPYING_OFF[side]).store(0, Ordering::Release);
    }

    /// Side `side`'s queue pair goes: its peer copies nothing more out of its memory.
    /// Returns whether the peer is copying now (it may still read this side's memory
    /// until [`copying`](Self::copying) says otherwise).
    pub(crate) fn leave(&self, side: usize) -> bool {
        self.atomic32(GONE_OFF[side]).store(1, Ordering::SeqCst);
        self.copying(1 - side)
    }

    /// Whether side `side` copies out of its peer's memory now.
    pub(crate) fn copying(&self, side: usize) -> bool {
        self.atomic32(COPYING_OFF[side]).load(Ordering::SeqCst) != 0
    }

    /// The word in which side `side` says what its queue pair accepts as the target of
    /// requests executed by the peer (the `mapped` data path).
    pub(crate) fn target_word(&self, side: usize) -> &AtomicU64 {
        self.atomic64(TARGET_OFF[side])
    }

    /// The word in which side `side` names the key it copies through now (the `mapped`
    /// data path's claim; 0: none).
    pub(crate) fn claim_word(&self, side: usize) -> &AtomicU64 {
        self.atomic64(CLAIM_OFF[side])
    }

    /// Writes one record to ring `ring`: a prefix of `prefix_len` bytes and a payload of
    /// `payload_len` bytes, which `fill` copies in given where each goes (`fill` may only
    /// write those bytes); `desc`: the payload is a descriptor. `align` is the payload
    /// source's address (its offset within a cache line is kept). Returns false, writing
    /// nothing, when the ring lacks room.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn push(
        &self,
        ring: usize,
        p: &mut Producer,
        desc: bool,
        prefix_len: usize,
        payload_len: usize,
        align: usize,
        fill: impl FnOnce(*mut u8, *mut u8),
    ) -> Result<bool, RingError> {
        let cap = self.cap;
        let base = REC_HDR + prefix_len;
        let worst = round16(base + 63 + payload_len);
        // The peer made the rings: records sized by this side's path MTU may not fit them.
        if worst > cap / 2 || prefix_len > MAX_PREFIX {
            return Err(RingError::TooLarge(worst));
        }
        // `cap` is a power of two (checked where the segment is made or opened): a mask, not
        // a division.
        let at = (p.tail & (cap as u64 - 1)) as usize;
        let mut wrap = if cap - at < worst { cap - at } else { 0 };
        // Past the first bytes, a drained ring starts over (module docs), if the record
        // and the next header fit before `at`, where the consumer waits for the wrap
        // record. The consumer's head is read at most once per `RECHECK` bytes pushed: it
        // is a cache line the consumer writes.
        if wrap == 0 && at >= early_wrap(cap) && worst + REC_HDR <= at && p.tail >= p.recheck {
            p.recheck = p.tail + RECHECK;
            if self.consumer_head(ring, p)? == p.tail {
                wrap = cap - at;
            }
        }
        // Room for the record and for the next record's header, which is cleared ahead.
        let need = (wrap + worst + REC_HDR) as u64;
        if cap as u64 - (p.tail - p.head) < need {
            self.consumer_head(ring, p)?;
            if cap as u64 - (p.tail - p.head) < need {
                return Ok(false);
            }
        }
        let data = self.data(ring);
        let pos = if wrap > 0 { 0 } else { at };
        let off = if payload_len >= ALIGN_MIN {
            base + (align.wrapping_sub(pos + base) & 63)
        } else {
            // A short record ends where a cache line does (its payload goes up to 48 bytes
            // further in), so that the next one starts a line: the consumer, which polls
            // the kind word where the next record starts, then has it whole with that one
            // line, never half of it with a second.
            let off = (base + 7) & !7;
            off + (64 - ((pos + round16(off + payload_len)) & 63)) % 64
        };
        let size = round16(off + payload_len);
        debug_assert!(pos + size <= cap && size <= worst);
        let next = (pos + size) & (cap - 1);
        // SAFETY: every position written lies inside this ring's data, 16-aligned, in bytes
        // the consumer has released (room checked above, the next header's included; with
        // a wrap, the record and the next header lie before `at`: size ≤ worst ≤ cap/2 <
        // at, or on a drained ring worst + 16 ≤ at). `fill` writes only the prefix and
        // payload ranges.
        unsafe {
            // The next record's kind first: the consumer, having read this record, must
            // find no record there until the next push publishes one.
            kind_word(data, next).store(0, Ordering::Relaxed);
            let rec = data.add(pos);
            // The header's words one by one: a 12-byte copy out of an array built on the
            // stack would load what the three stores there have not yet written back,
            // and stall on each load.
            rec.add(4).cast::<u32>().write(prefix_len as u32);
            rec.add(8).cast::<u32>().write(off as u32);
            rec.add(12).cast::<u32>().write(payload_len as u32);
            fill(rec.add(REC_HDR), rec.add(off));
            let kind = if desc { KIND_DESC } else { KIND_PACKET };
            // The word the consumer waits on: the wrap record's, if there is one (it
            // sends the consumer to this record at the start), else this record's.
            let (look, look_kind) = if wrap > 0 {
                kind_word(data, pos).store(kind, Ordering::Release);
                (at, KIND_WRAP)
            } else {
                (pos, kind)
            };
            if p.batching && p.pending.is_none() && size <= BATCH_BYTES {
                // A batch's first record: published with the batch (`publish`).
                p.pending = Some((look, look_kind));
            } else {
                // Publishes the record: everything above is visible to whoever reads
                // this (a record in a batch is only read after the batch's first).
                kind_word(data, look).store(look_kind, Ordering::Release);
            }
        }
        p.tail += (wrap + size) as u64;
        if p.pending.is_some() {
            p.batched += wrap + size;
            if p.batched >= BATCH_BYTES {
                self.publish(ring, p);
                p.batching = true;
            }
        }
        Ok(true)
    }

    /// Ends a batch ([`Producer::batch`]): the consumer may read every record pushed.
    pub(crate) fn publish(&self, ring: usize, p: &mut Producer) {
        p.batching = false;
        p.batched = 0;
        if let Some((pos, kind)) = p.pending.take() {
            // SAFETY: `push` took `pos` from a record header it wrote, 16-aligned inside
            // this ring's data.
            unsafe { kind_word(self.data(ring), pos) }.store(kind, Ordering::Release);
        }
    }

    /// Reads and checks the consumer's head of ring `ring` into `p`, and returns it.
    fn consumer_head(&self, ring: usize, p: &mut Producer) -> Result<u64, RingError> {
        let head = self.atomic64(HEAD_OFF[ring]).load(Ordering::Acquire);
        if head > p.tail || p.tail - head > self.cap as u64 || head < p.head {
            return Err(RingError::Index {
                what: "consumer index",
                value: head,
            });
        }
        p.head = head;
        Ok(head)
    }

    /// The next record of ring `ring`, if one has arrived. Records the peer got wrong are
    /// errors; wrap records are skipped.
    pub(crate) fn peek(&self, ring: usize, c: &mut Consumer) -> Result<Option<Record>, RingError> {
        let cap = self.cap;
        let data = self.data(ring);
        loop {
            let pos = (c.head & (cap as u64 - 1)) as usize;
            // SAFETY: `pos` is 16-aligned inside this ring's data.
            let kind = unsafe { kind_word(data, pos) }.load(Ordering::Acquire);
            match kind {
                0 => return Ok(None),
                KIND_WRAP => {
                    // A producer wraps when a record (at most half the ring) does not
                    // fit before the end, or when the ring is drained past its first
                    // bytes: never within them (so never where the wrap leads).
                    if pos < early_wrap(cap) {
                        return Err(RingError::Garbage("a wrap record in the wrong place"));
                    }
                    c.head += (cap - pos) as u64;
                }
                KIND_PACKET | KIND_DESC => {
                    let mut hdr = [0u32; 3];
                    // SAFETY: pos + 16 ≤ cap (16-aligned positions), inside this ring's
                    // data; copied out once, then checked.
                    unsafe { copy(hdr.as_mut_ptr().cast(), data.add(pos + 4), 12) };
                    let (prefix, off, len) = (hdr[0] as usize, hdr[1] as usize, hdr[2] as usize);
                    if prefix > MAX_PREFIX || off < REC_HDR + prefix || off > REC_HDR + prefix + 64
                    {
                        return Err(RingError::Garbage("a record with a bad layout"));
                    }
                    let size = round16(off + len);
                    let room = cap - pos;
                    if len > room || size > room {
                        return Err(RingError::Garbage("a record longer than the ring holds"));
                    }
                    return Ok(Some(Record {
                        desc: kind == KIND_DESC,
                        pos,
                        prefix,
                        off,
                        len,
                        size,
                    }));
                }
                _ => return Err(RingError::Garbage("an unknown record kind")),
            }
        }
    }

    /// Copies `len` bytes at `at` of `rec`'s prefix (`payload: false`) or payload into
    /// `dst`.
    ///
    /// # Safety
    ///
    /// `dst` is writable for `len` bytes and not inside the segment; `at + len` is within
    /// the prefix or payload length `rec` names.
    pub(crate) unsafe fn read(
        &self,
        ring: usize,
        rec: &Record,
        payload: bool,
        at: usize,
        dst: *mut u8,
        len: usize,
    ) {
        let (start, max) = if payload {
            (rec.off, rec.len)
        } else {
            (REC_HDR, rec.prefix)
        };
        assert!(at.checked_add(len).is_some_and(|e| e <= max));
        // SAFETY: `peek` checked the record lies inside the ring's data; the caller
        // vouches for `dst`.
        unsafe { copy(dst, self.data(ring).add(rec.pos + start + at), len) };
    }

    /// Whether the consumer of ring `ring` has taken every record `p` wrote into it.
    pub(crate) fn drained(&self, ring: usize, p: &Producer) -> bool {
        self.atomic64(HEAD_OFF[ring]).load(Ordering::Acquire) == p.tail
    }

    /// Releases `rec` (and any wrap record before it) to the producer.
    pub(crate) fn consume(&self, ring: usize, c: &mut Consumer, rec: &Record) {
        c.head += rec.size as u64;
        self.atomic64(HEAD_OFF[ring])
            .store(c.head, Ordering::Release);
    }
}

/// The kind word of the record header at `pos` of the ring data at `data`: 0 until the
/// producer publishes the record there.
///
/// # Safety
///
/// `pos` is 16-aligned and `pos + 16` lies inside the ring's data.
unsafe fn kind_word<'a>(data: *mut u8, pos: usize) -> &'a AtomicU32 {
    // SAFETY: forwarded; the word is 4-aligned (the mapping is page-aligned), and shared
    // words are only accessed atomically.
    unsafe { AtomicU32::from_ptr(data.add(pos).cast()) }
}

/// Where, in a ring of `cap` bytes, a producer may start over once the ring is drained:
/// past a quarter of the ring, at most 64 KiB in (16 pages).
fn early_wrap(cap: usize) -> usize {
    (cap / 4).min(64 << 10)
}

/// A producer looks whether its ring is drained at most once per this many bytes pushed.
const RECHECK: u64 = 16 << 10;

/// A batch holds back its first record's publication until it has this many bytes, or
/// ends (see [`Producer::batch`]); a record longer than this is never held back.
const BATCH_BYTES: usize = 2048;

/// The producer's side of a ring: its own tail, and the consumer's head as last seen.
#[derive(Debug, Default)]
pub(crate) struct Producer {
    tail: u64,
    head: u64,
    /// The tail from which the producer may look again whether the ring is drained.
    recheck: u64,
    /// In a batch ([`Producer::batch`]).
    batching: bool,
    /// The kind word (position, kind) of the batch's first record, not yet published,
    /// and the bytes pushed since (0 while nothing is pending).
    pending: Option<(usize, u32)>,
    batched: usize,
}

impl Producer {
    /// Starts a batch: the records pushed until [`Segment::publish`] reach the consumer
    /// together, up to [`BATCH_BYTES`] at a time. The consumer polls the kind word where
    /// its next record starts, so a record published as soon as it is written has its
    /// line taken back and forth between the two cores; a batch publishes its first
    /// record last, and writes the others in lines the consumer does not read yet.
    pub(crate) fn batch(&mut self) {
        self.batching = true;
    }
}

/// The consumer's side of a ring: its own head.
#[derive(Debug, Default)]
pub(crate) struct Consumer {
    head: u64,
}

impl Consumer {
    /// Bytes consumed so far.
    #[cfg(feature = "testing")]
    pub(crate) fn head(&self) -> u64 {
        self.head
    }
}

/// A record found by [`Segment::peek`], checked to lie inside the ring.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Record {
    /// The payload is a descriptor: where the packet's payload lies in the producer.
    pub(crate) desc: bool,
    pos: usize,
    /// Bytes of the prefix.
    pub(crate) prefix: usize,
    off: usize,
    /// Bytes of the payload.
    pub(crate) len: usize,
    size: usize,
}

/// Raw access to a segment's bytes, for tests that play a hostile peer.
#[cfg(any(test, feature = "testing"))]
impl Segment {
    /// Writes `bytes` at byte `off` of the segment, ignoring every rule.
    pub(crate) fn scribble(&self, off: usize, bytes: &[u8]) {
        assert!(off + bytes.len() <= self.len);
        // SAFETY: inside the mapping (checked above).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.base.add(off), bytes.len()) };
    }
    /// Byte offsets of ring `ring`'s head and data in the segment.
    pub(crate) fn layout(&self, ring: usize) -> (usize, usize) {
        (HEAD_OFF[ring], DATA_OFF + ring * self.cap)
    }
}

#[cfg(test)]
mod tests;
