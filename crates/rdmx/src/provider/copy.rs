//! A memory copy that keeps its speed for every alignment pair.
//!
//! glibc's `memcpy` copies large blocks with `rep movsb`, which on some CPUs (AMD EPYC
//! hosts of this project among them) runs an order of magnitude slower when source and
//! destination sit at different offsets within a cache line; on others (later EPYCs) it
//! has no such cliff and runs a third faster than any vector loop. Software providers
//! copy payloads into and out of registered memory (and shm through its rings) at
//! whatever offsets the application chose, so the process measures both on this CPU
//! and keeps the faster for every later differently aligned copy
//! (`rdmx::shm::copy_method` says which): `memcpy`, or its own loop of unaligned vector
//! loads and aligned vector stores.
//!
//! Large copies that `rep movsb` takes at full speed (equally aligned ones, and all of
//! them where it has no cliff) go to it directly on x86_64 CPUs that have it (ERMS), as
//! `memcpy` itself sends them after a few dozen instructions of dispatch, up to
//! [`MID_MIN`]. From there up to [`RACE_MIN`], where source and destination no longer
//! fit the L1 cache together, they go to the vector loop unless `rep movsb` measured
//! clearly faster on 64 KiB (`rdmx::shm::mid_copy_method` says which): on one 2-vCPU
//! Intel Xeon the loop moved 64 and 256 KiB between processes 8-11% faster than `rep
//! movsb` (which copied 8-24 KiB, in L1, a quarter faster than the loop), while on the
//! AMD EPYCs measured `rep movsb` was a third faster. From the size of the core's L2
//! cache up, glibc's `memcpy` leaves `rep movsb` for a vector loop, which is faster on
//! some CPUs and slower on others: 1 MiB copied 15% slower where measured on a 2 vCPU AMD
//! EPYC with 1 MiB of L2 per core, and 4-6% faster on one with 512 KiB (READs and WRITEs
//! of 1 MiB between two processes on the shm provider's mapped path). So copies of
//! [`RACE_MIN`] or more go to whichever the process measured faster on 1 MiB
//! (`rdmx::shm::large_copy_method` says which): `rep movsb` only if it beat `memcpy`
//! clearly, since `memcpy` is what the C library chose for that size on this CPU. Small
//! copies always go to `memcpy`.
//!
//! The measurements take about four milliseconds, once per process: when its
//! first software device opens ([`calibrate`]), or else on the first copy that needs them.

use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Instant;

/// Copies below this many bytes go to `memcpy` whatever their alignment.
const LOOP_MIN: usize = 1024;

/// Copies of at least this many bytes may go to `rep movsb` directly.
const REP_MIN: usize = 4096;

/// Copies of at least this many bytes, below [`RACE_MIN`], go to what [`measure_mid`]
/// chose: source and destination together no longer fit the L1 data cache of the CPUs
/// measured (32-48 KiB), where `rep movsb` and a vector loop rank differently by CPU.
const MID_MIN: usize = 32 << 10;

/// Copies of at least this many bytes go to what [`measure_large`] chose; smaller ones
/// from [`REP_MIN`] up to `rep movsb` wherever the CPU has ERMS. The smallest L2 cache
/// of the x86_64 CPUs this was measured on: below it glibc's `memcpy` itself uses `rep
/// movsb` for these copies.
const RACE_MIN: usize = 512 << 10;

/// What differently aligned copies use, once measured (0 until then).
static MISALIGNED: AtomicU8 = AtomicU8::new(0);
/// What large copies `rep movsb` takes at full speed use, once measured (0 until then).
static LARGE: AtomicU8 = AtomicU8::new(0);
/// What copies from [`MID_MIN`] to [`RACE_MIN`] use, once measured (0 until then).
static MID: AtomicU8 = AtomicU8::new(0);
const MEMCPY: u8 = 1;
const LOOP: u8 = 2;
const REP_MOVSB: u8 = 3;

/// Copies `len` bytes from `src` to `dst`.
///
/// # Safety
///
/// As [`std::ptr::copy_nonoverlapping`]: `src` readable and `dst` writable for `len`
/// bytes, the ranges not overlapping. Either range may be shared memory another process
/// writes concurrently: the bytes copied are then unspecified, nothing else goes wrong
/// (no reference to either range is formed).
#[inline]
pub(crate) unsafe fn copy(dst: *mut u8, src: *const u8, len: usize) {
    // Packet headers, small payloads, and the empty pieces callers split copies into:
    // a few moves in place, not a call into `memcpy` and its dispatch.
    if len <= SMALL_MAX {
        // SAFETY: forwarded.
        unsafe { copy_small(dst, src, len) };
        return;
    }
    // SAFETY: forwarded.
    unsafe { copy_large(dst, src, len) };
}

/// Copies of at most this many bytes are made in place ([`copy_small`]).
const SMALL_MAX: usize = 32;

/// [`copy`] of at most [`SMALL_MAX`] bytes: two possibly overlapping moves of the widest
/// size that fits (the first and the last bytes of the range), as `memcpy` itself copies
/// small sizes, without its call and dispatch.
///
/// # Safety
///
/// As [`copy`], and `len` is at most [`SMALL_MAX`].
#[inline(always)]
unsafe fn copy_small(dst: *mut u8, src: *const u8, len: usize) {
    debug_assert!(len <= SMALL_MAX);
    /// Copies `N` bytes at `src` and the `N` ending at `src + len` (`N <= len <= 2N`).
    ///
    /// # Safety
    ///
    /// As [`copy`].
    #[inline(always)]
    unsafe fn ends<const N: usize>(dst: *mut u8, src: *const u8, len: usize) {
        // SAFETY: both moves lie inside the `len` bytes of each range (N <= len); the
        // loads are made before the stores, and unaligned accesses are allowed.
        unsafe {
            let head = src.cast::<[u8; N]>().read_unaligned();
            let tail = src.add(len - N).cast::<[u8; N]>().read_unaligned();
            dst.cast::<[u8; N]>().write_unaligned(head);
            dst.add(len - N).cast::<[u8; N]>().write_unaligned(tail);
        }
    }
    // SAFETY: each branch's `N` is at most `len` and `len` at most `2N`; forwarded.
    unsafe {
        match len {
            0 => {}
            1..=3 => {
                // The first, the middle and the last byte (the same byte when len < 3).
                let (a, b, c) = (*src, *src.add(len / 2), *src.add(len - 1));
                *dst = a;
                *dst.add(len / 2) = b;
                *dst.add(len - 1) = c;
            }
            4..=7 => ends::<4>(dst, src, len),
            8..=15 => ends::<8>(dst, src, len),
            _ => ends::<16>(dst, src, len),
        }
    }
}

/// [`copy`] of more than [`SMALL_MAX`] bytes.
///
/// # Safety
///
/// As [`copy`].
unsafe fn copy_large(dst: *mut u8, src: *const u8, len: usize) {
    if len >= LOOP_MIN {
        let offsets_differ = (dst as usize ^ src as usize) & 63 != 0;
        if offsets_differ && misaligned() == LOOP {
            // SAFETY: forwarded.
            unsafe { copy_loop(dst, src, len) };
            return;
        }
        // Here `rep movsb` runs at full speed: the copy is equally aligned, or the CPU
        // has no cliff (`memcpy`, which is `rep movsb` at 64 KiB, measured no slower
        // than the loop).
        let method = if len >= RACE_MIN {
            large()
        } else if len >= MID_MIN {
            mid()
        } else if len >= REP_MIN && has_erms() {
            REP_MOVSB
        } else {
            MEMCPY
        };
        match method {
            // SAFETY: forwarded (`len` ≥ LOOP_MIN ≥ 64 for the loop).
            REP_MOVSB => return unsafe { rep_movsb(dst, src, len) },
            // SAFETY: as above.
            LOOP => return unsafe { copy_loop(dst, src, len) },
            _ => {}
        }
    }
    // SAFETY: forwarded.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

/// Measures now, once per process, what [`copy`] would otherwise measure on its first
/// large copies (about a millisecond): software providers call it when a device opens,
/// so that the measurement is not charged to the first requests an application (or a
/// benchmark) times.
pub(crate) fn calibrate() {
    large();
    mid();
    misaligned();
}

/// Whether all three methods are measured (nothing is measured to say so).
#[cfg(feature = "testing")]
pub(crate) fn calibrated() -> bool {
    [&LARGE, &MID, &MISALIGNED]
        .iter()
        .all(|m| m.load(Ordering::Relaxed) != 0)
}

/// How this process copies blocks of 512 KiB or more that `rep movsb` takes at full
/// speed: `"rep movsb"` or `"memcpy"`, whichever measured faster on 1 MiB on this CPU
/// (`rep movsb` only if clearly faster; measured now if no copy has needed it yet: a
/// hundred and twenty-eight copies of 1 MiB, about three and a half milliseconds).
/// Smaller ones from 4 KiB up use `rep movsb` wherever the CPU has ERMS, as `memcpy`
/// does, but from 32 KiB what [`mid_copy_method`] says.
pub fn large_copy_method() -> &'static str {
    name(large())
}

/// [`MEMCPY`] or [`REP_MOVSB`], measured on first use.
fn large() -> u8 {
    measured(&LARGE, measure_large)
}

/// How this process copies blocks from 32 KiB up to 512 KiB that `rep movsb` takes at
/// full speed: `"rep movsb"`, `"vector loop"`, or `"memcpy"` where the CPU lacks ERMS;
/// the loop unless `rep movsb` measured clearly faster on 64 KiB on this CPU (measured
/// now if no copy has needed it yet: 512 copies of 64 KiB, about half a millisecond).
pub fn mid_copy_method() -> &'static str {
    name(mid())
}

/// [`REP_MOVSB`], [`LOOP`] or (without ERMS) [`MEMCPY`], measured on first use.
fn mid() -> u8 {
    measured(&MID, measure_mid)
}

/// Times `rep movsb` and the vector loop on 64 KiB between equally aligned buffers,
/// thirty-two copies in a row per timing, and returns `rep movsb` only if it was faster
/// by more than [`MID_MARGIN`] (`memcpy` where the CPU lacks ERMS, as below
/// [`MID_MIN`]).
///
/// The margin is wide because the race sees `rep movsb` in one state: on a 2-vCPU Intel
/// Xeon, streams of 64 KiB copies by `rep movsb` ran at 55 GB/s for some milliseconds and
/// 47 for others (C loops of 256 copies timed in turn), while the loop held 52. The race
/// there found `rep movsb` 1-9% faster, yet READs and WRITEs of 64 and 256 KiB between two
/// processes on shm's mapped path ran 8-11% faster with the loop (four to six interleaved
/// pairs each). On the AMD EPYCs measured `rep movsb` beat the loop by a third.
fn measure_mid() -> u8 {
    if !has_erms() {
        return MEMCPY;
    }
    #[cfg(target_arch = "x86_64")]
    if !std::is_x86_feature_detected!("avx2") {
        // The loop the race would time is the 16-byte one, measured nowhere.
        return REP_MOVSB;
    }
    if race(64 << 10, 0, 32, rep_movsb, copy_loop) > MID_MARGIN {
        REP_MOVSB
    } else {
        LOOP
    }
}

/// How much faster than the loop `rep movsb` must measure to copy blocks from
/// [`MID_MIN`] to [`RACE_MIN`] ([`measure_mid`]).
const MID_MARGIN: f64 = 1.15;

/// What a method is called in the `*_copy_method` answers.
fn name(method: u8) -> &'static str {
    match method {
        REP_MOVSB => "rep movsb",
        LOOP => "vector loop",
        _ => "memcpy",
    }
}

/// The method `cell` holds, or what `measure` says if it holds none yet (0).
fn measured(cell: &AtomicU8, measure: fn() -> u8) -> u8 {
    match cell.load(Ordering::Relaxed) {
        0 => {
            let m = measure();
            // Threads that measured at once may store different answers; each is a
            // correct copy, and the last store stays.
            cell.store(m, Ordering::Relaxed);
            m
        }
        m => m,
    }
}

/// Times `memcpy` and `rep movsb` on 1 MiB between equally aligned buffers, and returns
/// `rep movsb` if it was faster by more than 2%; `memcpy` where the CPU lacks ERMS.
///
/// Each timing is of eight copies in a row: the two differ by a few percent in a
/// stream of copies (what a provider moving 1 MiB messages makes), and timings of one or
/// two copies, measured that way, chose either about as often on a CPU where `memcpy`
/// was 4% faster. The margin leaves the choice to the C library's unless `rep movsb`
/// clearly beats it.
fn measure_large() -> u8 {
    if has_erms() && race(1 << 20, 0, 8, rep_movsb, memcpy) > 1.02 {
        REP_MOVSB
    } else {
        MEMCPY
    }
}

/// Whether the CPU has ERMS (fast `rep movsb`); the standard library caches the answer.
fn has_erms() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("ermsb")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `memcpy`, as a function like the others.
///
/// # Safety
///
/// As [`copy`].
unsafe fn memcpy(dst: *mut u8, src: *const u8, len: usize) {
    // SAFETY: forwarded.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

/// How many times faster `first` copies `len` bytes than `second`, the destination
/// `delta` bytes further along a cache line than the source: each timing is of `copies`
/// copies in a row, the two timed one after the other (by turns, either first) in each of
/// seven rounds after an untimed one, and the answer is the median of the rounds' ratios.
/// The source sits 64 bytes into its page and the destination 64 + `delta` further into
/// its own, so neither copy stalls on stores the CPU mistakes for the loads' (4 KiB
/// aliasing).
///
/// Ratios of timings taken together, not each method's best timing: on one 2-vCPU AMD
/// EPYC, where `rep movsb` copied 64 KiB 1.30× faster than the loop in round after round,
/// a single lucky timing of the loop, or a stretch of slow ones of `rep movsb` at
/// process start, brought the best timings within 1.08-1.15× of each other in one process
/// of five, which then copied with the loop and moved 64 KiB READs between processes a
/// quarter slower.
///
/// Both functions must copy as [`copy`] does (and be callable on this CPU).
fn race(
    len: usize,
    delta: usize,
    copies: usize,
    first: unsafe fn(*mut u8, *const u8, usize),
    second: unsafe fn(*mut u8, *const u8, usize),
) -> f64 {
    debug_assert!(delta < 64);
    let src_buf = vec![1u8; len + 8192];
    let mut dst_buf = vec![0u8; len + 8192];
    let src = src_buf[src_buf.as_ptr().align_offset(4096) + 64..].as_ptr();
    let d_off = dst_buf.as_ptr().align_offset(4096) + 128 + delta;
    let dst = dst_buf[d_off..].as_mut_ptr();
    let time = |f: unsafe fn(*mut u8, *const u8, usize)| {
        let t = Instant::now();
        for _ in 0..copies {
            // SAFETY: `len` bytes from each offset lie inside their vectors (each has
            // 8 KiB to spare and the offsets are below 4,288), which do not overlap; `f`
            // copies as `copy` does (this function's contract).
            unsafe { f(dst, src, len) };
            std::hint::black_box(dst);
        }
        t.elapsed().as_secs_f64().max(1e-9)
    };
    // Untimed: the destination's pages fault in.
    time(first);
    time(second);
    let mut ratios: Vec<f64> = (0..RACE_ROUNDS)
        .map(|round| {
            let (a, b) = if round % 2 == 0 {
                let a = time(first);
                (a, time(second))
            } else {
                let b = time(second);
                (time(first), b)
            };
            b / a
        })
        .collect();
    ratios.sort_by(f64::total_cmp);
    ratios[RACE_ROUNDS / 2]
}

/// Timed rounds of a [`race`].
const RACE_ROUNDS: usize = 7;

/// `rep movsb`: the CPU's string copy.
///
/// # Safety
///
/// As [`copy`]. Every x86_64 CPU runs it; ERMS only makes it fast, so [`copy`] takes it
/// only where the CPU has ERMS (and from [`MID_MIN`] up, where [`measure_mid`] or
/// [`measure_large`] chose it).
unsafe fn rep_movsb(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: copies `len` bytes from `src` to `dst` (forwarded contract), forwards
    // (the direction flag is clear at every function boundary by the ABI); it touches
    // no stack and no flags.
    unsafe {
        std::arch::asm!(
            "rep movsb",
            inout("rcx") len => _,
            inout("rdi") dst => _,
            inout("rsi") src => _,
            options(nostack, preserves_flags)
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: forwarded.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, len)
    };
}

/// How this process copies large blocks whose source and destination lie at different
/// offsets within a cache line: `"memcpy"` or `"vector loop"`, whichever measured faster
/// on this CPU (measured now if no copy has needed it yet: sixteen copies of 64 KiB each
/// way, well under a millisecond even where `memcpy` falls off its cliff).
pub fn copy_method() -> &'static str {
    name(misaligned())
}

/// [`MEMCPY`] or [`LOOP`], measured on first use.
fn misaligned() -> u8 {
    measured(&MISALIGNED, measure)
}

/// Times `memcpy` and the loop on 64 KiB whose destination lies 16 bytes further along a
/// cache line than its source (where `rep movsb` falls off its cliff on the CPUs that
/// have one), and returns the faster.
fn measure() -> u8 {
    if cfg!(not(target_arch = "x86_64")) {
        return MEMCPY;
    }
    if race(64 << 10, 16, 2, copy_loop, memcpy) > 1.0 {
        LOOP
    } else {
        MEMCPY
    }
}

/// The loop, with the widest vectors the CPU has of the two it knows.
///
/// # Safety
///
/// As [`copy`], and `len` ≥ 64.
unsafe fn copy_loop(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: forwarded; the CPU has AVX2 (checked just above).
            unsafe { copy_avx2(dst, src, len) };
        } else {
            // SAFETY: forwarded; SSE2 is part of x86_64.
            unsafe { copy_sse2(dst, src, len) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: forwarded.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, len)
    };
}

/// Copies `src` into `dst` (the same length) at the same speed whatever the two
/// slices' offsets within a cache line: the copy software providers move payloads with.
///
/// # Panics
///
/// If the lengths differ.
pub fn copy_slice(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_slice: lengths differ");
    // SAFETY: two distinct slices (one mutable borrow, one shared) of `src.len()` bytes.
    unsafe { copy(dst.as_mut_ptr(), src.as_ptr(), src.len()) };
}

/// [`copy`] with 32-byte vectors, four per round.
///
/// # Safety
///
/// As [`copy`], and the CPU supports AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_avx2(mut dst: *mut u8, mut src: *const u8, mut len: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_store_si256};
    // Bring the destination to a 32-byte boundary (len ≥ LOOP_MIN > 32).
    let head = dst.align_offset(32);
    // SAFETY: head < 32 ≤ len bytes, inside both ranges.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        dst = dst.add(head);
        src = src.add(head);
    }
    len -= head;
    while len >= 128 {
        // SAFETY: 128 bytes remain in both ranges; loads are unaligned, stores go to the
        // 32-aligned destination.
        unsafe {
            let s = src.cast::<__m256i>();
            let d = dst.cast::<__m256i>();
            let a = _mm256_loadu_si256(s);
            let b = _mm256_loadu_si256(s.add(1));
            let c = _mm256_loadu_si256(s.add(2));
            let e = _mm256_loadu_si256(s.add(3));
            _mm256_store_si256(d, a);
            _mm256_store_si256(d.add(1), b);
            _mm256_store_si256(d.add(2), c);
            _mm256_store_si256(d.add(3), e);
            dst = dst.add(128);
            src = src.add(128);
        }
        len -= 128;
    }
    // SAFETY: the last `len` bytes of both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

/// [`copy`] with 16-byte vectors, four per round.
///
/// # Safety
///
/// As [`copy`].
#[cfg(target_arch = "x86_64")]
unsafe fn copy_sse2(mut dst: *mut u8, mut src: *const u8, mut len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_store_si128};
    let head = dst.align_offset(16);
    // SAFETY: head < 16 ≤ len bytes, inside both ranges.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        dst = dst.add(head);
        src = src.add(head);
    }
    len -= head;
    while len >= 64 {
        // SAFETY: 64 bytes remain in both ranges; stores go to the 16-aligned destination.
        unsafe {
            let s = src.cast::<__m128i>();
            let d = dst.cast::<__m128i>();
            let a = _mm_loadu_si128(s);
            let b = _mm_loadu_si128(s.add(1));
            let c = _mm_loadu_si128(s.add(2));
            let e = _mm_loadu_si128(s.add(3));
            _mm_store_si128(d, a);
            _mm_store_si128(d.add(1), b);
            _mm_store_si128(d.add(2), c);
            _mm_store_si128(d.add(3), e);
            dst = dst.add(64);
            src = src.add(64);
        }
        len -= 64;
    }
    // SAFETY: the last `len` bytes of both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

#[cfg(test)]
mod tests {
    use super::{copy, copy_loop, memcpy, race, LOOP_MIN, MID_MIN};
    #[cfg(target_arch = "x86_64")]
    use super::{rep_movsb, REP_MIN};

    #[test]
    fn every_alignment_pair_copies_exactly() {
        let src: Vec<u8> = (0..40_000u32).map(|i| (i * 7 + 3) as u8).collect();
        // Every size class of `copy`: in place, `memcpy`, `rep movsb`, and from MID_MIN
        // up whatever this CPU measured.
        for len in (0..=40).chain([1023, 1024, 1025, 4096, 5000, MID_MIN + 5]) {
            for so in 0..66 {
                for d_off in [0, 1, 15, 16, 33, 63, 64] {
                    let mut dst = vec![0xeeu8; len + 200];
                    // SAFETY: both ranges lie inside their vectors and do not overlap.
                    unsafe { copy(dst.as_mut_ptr().add(d_off), src.as_ptr().add(so), len) };
                    assert_eq!(&dst[d_off..d_off + len], &src[so..so + len]);
                    assert!(dst[..d_off].iter().all(|&b| b == 0xee));
                    assert!(dst[d_off + len..].iter().all(|&b| b == 0xee));
                    if len < LOOP_MIN {
                        continue;
                    }
                    // The loop itself, whichever of the two this CPU's copies use.
                    dst.fill(0xee);
                    // SAFETY: as above.
                    unsafe { copy_loop(dst.as_mut_ptr().add(d_off), src.as_ptr().add(so), len) };
                    assert_eq!(&dst[d_off..d_off + len], &src[so..so + len]);
                    assert!(dst[..d_off].iter().all(|&b| b == 0xee));
                    assert!(dst[d_off + len..].iter().all(|&b| b == 0xee));
                    // And `rep movsb`, where the CPU has it, whichever large copies use.
                    #[cfg(target_arch = "x86_64")]
                    if len >= REP_MIN && std::is_x86_feature_detected!("ermsb") {
                        dst.fill(0xee);
                        // SAFETY: as above; the CPU has ERMS.
                        unsafe {
                            rep_movsb(dst.as_mut_ptr().add(d_off), src.as_ptr().add(so), len)
                        };
                        assert_eq!(&dst[d_off..d_off + len], &src[so..so + len]);
                        assert!(dst[..d_off].iter().all(|&b| b == 0xee));
                        assert!(dst[d_off + len..].iter().all(|&b| b == 0xee));
                    }
                }
            }
        }
    }

    /// A copy one byte at a time through volatile accesses: hundreds of times slower
    /// than `memcpy` on 64 KiB.
    ///
    /// # Safety
    ///
    /// As [`copy`].
    unsafe fn bytewise(dst: *mut u8, src: *const u8, len: usize) {
        for i in 0..len {
            // SAFETY: `i` < `len`, inside both ranges (forwarded contract).
            unsafe { dst.add(i).write_volatile(src.add(i).read_volatile()) };
        }
    }

    /// The race answers how many times faster its first method is than its second: a
    /// ratio the wrong way round would send every copy to the slower method.
    #[test]
    fn a_race_says_how_much_faster_the_first_is() {
        assert!(race(64 << 10, 0, 1, memcpy, bytewise) > 2.0);
        assert!(race(64 << 10, 16, 1, bytewise, memcpy) < 0.5);
    }
}
