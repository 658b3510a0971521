//! Descriptors: a packet whose payload stays in the sender's registered memory names it
//! by spans (address, length, lkey), and the receiver copies the bytes itself, with
//! `process_vm_readv` from another process or a memcpy from this one.
//!
//! A descriptor is the pad length, then for each span its address, and its length with
//! the lkey of its region in the upper 32 bits, all 8-byte words in native order.

use crate::provider::copy::copy;
use crate::provider::MrRef;
use crate::soft::Keys;

use super::ring::RingError;

/// Most spans one descriptor names (the engine gathers at most `max_sge` of them).
pub(super) const MAX_SPANS: usize = 64;

/// Writes `v` (native byte order) at `dst`.
///
/// # Safety
///
/// `dst` is writable for 8 bytes.
pub(super) unsafe fn write_u64(dst: *mut u8, v: u64) {
    // SAFETY: forwarded.
    unsafe { std::ptr::copy_nonoverlapping(v.to_ne_bytes().as_ptr(), dst, 8) };
}

/// Reads a descriptor (the pad length, then for each span its address, and its length
/// with the lkey of its region in the upper 32 bits) into `spans` and `keys`. Returns the
/// bytes the spans cover and the pad length.
pub(super) fn parse_desc(
    b: &[u8],
    spans: &mut Vec<(u64, u64)>,
    keys: &mut Vec<u32>,
) -> Result<(usize, usize), RingError> {
    let word = |i: usize| u64::from_ne_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    if b.len() < 24 || (b.len() - 8) % 16 != 0 || (b.len() - 8) / 16 > MAX_SPANS {
        return Err(RingError::Garbage("a descriptor of a bad length"));
    }
    let pad = word(0);
    if pad > 3 {
        return Err(RingError::Garbage("a descriptor with a bad pad length"));
    }
    spans.clear();
    keys.clear();
    let mut total: u64 = 0;
    for i in (8..b.len()).step_by(16) {
        let (addr, len, lkey) = (word(i), word(i + 8) & 0xffff_ffff, word(i + 8) >> 32);
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(RingError::Garbage("a descriptor with a bad span"));
        }
        total += len;
        spans.push((addr, len));
        keys.push(lkey as u32);
    }
    if total > u64::from(u32::MAX) {
        return Err(RingError::Garbage("a descriptor longer than a packet"));
    }
    Ok((total as usize, pad as usize))
}

/// The `direct` data path's pull: copies each piece out of the peer's registered memory
/// (this process's, found through the peer's key table by the lkeys the descriptor
/// names) with memcpy. A span whose key does not cover it (the peer deregistered the
/// region, or the descriptor is garbage) fails the pull, and nothing is copied.
///
/// # Safety
///
/// As [`sys::pull`]: every piece's local range is writable memory of this process that
/// nothing references for the duration of the call, and the pieces lie inside `spans`
/// (as [`cut`] makes them).
pub(super) unsafe fn direct_copy(
    keys: &Keys,
    spans: &[(u64, u64)],
    span_keys: &[u32],
    pieces: &[(usize, u64, usize)],
    sources: &mut Vec<MrRef>,
) -> std::io::Result<()> {
    sources.clear();
    for (&(addr, len), &lkey) in spans.iter().zip(span_keys) {
        let Some(mr) = keys.lookup_local(lkey, addr, len as usize) else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "a descriptor names memory the peer has not registered",
            ));
        };
        sources.push(mr);
    }
    for &(dst, src, len) in pieces {
        // SAFETY: `src..src + len` lies inside a span (the caller's contract), and every
        // span lies inside a registered region of this process that `sources` keeps alive
        // (checked by lookup_local just above); the destination is the caller's.
        unsafe { copy(dst as *mut u8, src as usize as *const u8, len) };
    }
    sources.clear();
    Ok(())
}

/// Appends to `out` the pieces that bring bytes `[at, at + len)` of the payload the spans
/// describe to local address `dst`: local address, peer address, length.
pub(super) fn cut(
    spans: &[(u64, u64)],
    at: usize,
    len: usize,
    dst: *mut u8,
    out: &mut Vec<(usize, u64, usize)>,
) {
    let (mut at, mut left, mut dst) = (at as u64, len as u64, dst as usize);
    for &(addr, n) in spans {
        if left == 0 {
            break;
        }
        if at >= n {
            at -= n;
            continue;
        }
        let k = (n - at).min(left);
        out.push((dst, addr + at, k as usize));
        dst += k as usize;
        left -= k;
        at = 0;
    }
    debug_assert_eq!(left, 0, "the caller keeps the range inside the spans");
}

#[cfg(test)]
mod tests {
    use super::{cut, parse_desc, MAX_SPANS};

    fn desc(pad: u64, spans: &[(u64, u64)]) -> Vec<u8> {
        let mut b = pad.to_ne_bytes().to_vec();
        for &(a, n) in spans {
            b.extend_from_slice(&a.to_ne_bytes());
            b.extend_from_slice(&n.to_ne_bytes());
        }
        b
    }

    #[test]
    fn descriptors_parse_and_bad_ones_are_errors() {
        let (mut spans, mut keys) = (Vec::new(), Vec::new());
        let d = desc(2, &[(0x1000, 7 << 32 | 100), (0x9000, 28)]);
        assert_eq!(parse_desc(&d, &mut spans, &mut keys), Ok((128, 2)));
        assert_eq!(spans, [(0x1000, 100), (0x9000, 28)]);
        assert_eq!(keys, [7, 0]);
        for bad in [
            desc(0, &[]),
            desc(4, &[(0x1000, 1)]),
            desc(0, &[(0x1000, 0)]),
            desc(0, &[(u64::MAX, 2)]),
            desc(0, &[(0x1000, 5 << 32)]),
            desc(0, &[(0, u64::from(u32::MAX)), (0, 1)]),
            desc(0, &vec![(0x1000, 1); MAX_SPANS + 1]),
            desc(0, &[(0x1000, 1)])[..20].to_vec(),
        ] {
            assert!(parse_desc(&bad, &mut spans, &mut keys).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_range_is_cut_at_span_boundaries() {
        let spans = [(1000, 10), (5000, 20), (9000, 5)];
        let mut out = Vec::new();
        cut(&spans, 8, 20, 100 as *mut u8, &mut out);
        assert_eq!(out, [(100, 1008, 2), (102, 5000, 18)]);
        out.clear();
        cut(&spans, 29, 6, std::ptr::null_mut(), &mut out);
        assert_eq!(out, [(0, 5019, 1), (1, 9000, 5)]);
    }
}
