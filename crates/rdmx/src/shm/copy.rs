//! A memory copy that keeps its speed for every alignment pair.
//!
//! glibc's `memcpy` copies large blocks with `rep movsb`, which on some CPUs (this
//! project's AMD EPYC hosts among them) runs an order of magnitude slower when source
//! and destination sit at different offsets within a cache line. A provider copies
//! between user buffers and its rings at whatever offsets the application chose, so for
//! large, differently aligned copies it uses its own loop: unaligned vector loads,
//! aligned vector stores. Equally aligned copies and small ones go to `memcpy`.

/// Copies below this many bytes go to `memcpy` whatever their alignment.
const LOOP_MIN: usize = 1024;

/// Copies `len` bytes from `src` to `dst`.
///
/// # Safety
///
/// As [`std::ptr::copy_nonoverlapping`]: `src` readable and `dst` writable for `len`
/// bytes, the ranges not overlapping. Either range may be shared memory another process
/// writes concurrently: the bytes copied are then unspecified, nothing else goes wrong
/// (no reference to either range is formed).
pub(crate) unsafe fn copy(dst: *mut u8, src: *const u8, len: usize) {
    // Callers split copies into pieces, some of them empty: no `memcpy` call for those.
    if len == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if len >= LOOP_MIN && (dst as usize ^ src as usize) & 63 != 0 {
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: forwarded; the CPU has AVX2 (checked just above).
            unsafe { copy_avx2(dst, src, len) };
        } else {
            // SAFETY: forwarded; SSE2 is part of x86_64.
            unsafe { copy_sse2(dst, src, len) };
        }
        return;
    }
    // SAFETY: forwarded.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

/// Copies `src` into `dst` (the same length) at the same speed whatever the two
/// slices' offsets within a cache line: the copy the shm provider moves payloads with.
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
    use super::copy;

    #[test]
    fn every_alignment_pair_copies_exactly() {
        let src: Vec<u8> = (0..9000u32).map(|i| (i * 7 + 3) as u8).collect();
        for len in [0, 1, 31, 1023, 1024, 1025, 4096, 5000] {
            for so in 0..66 {
                for d_off in [0, 1, 15, 16, 33, 63, 64] {
                    let mut dst = vec![0xeeu8; len + 200];
                    // SAFETY: both ranges lie inside their vectors and do not overlap.
                    unsafe { copy(dst.as_mut_ptr().add(d_off), src.as_ptr().add(so), len) };
                    assert_eq!(&dst[d_off..d_off + len], &src[so..so + len]);
                    assert!(dst[..d_off].iter().all(|&b| b == 0xee));
                    assert!(dst[d_off + len..].iter().all(|&b| b == 0xee));
                }
            }
        }
    }
}
