//! `--verify`: what a message must hold when it lands, and the check the receiving side
//! runs.
//!
//! A message of `len` bytes is a pattern that depends on the offset and on a seed (the
//! message size, so data left over from another size never passes), with the first (up
//! to) 8 bytes replaced by a *stamp* and, for `write_lat`, the last byte by the round's
//! *tag* (the byte the receiver spins on). Senders stamp each message with its iteration
//! number before posting it, so a message that never landed, landed twice or landed in
//! the wrong place leaves a stamp the receiver does not expect.

use std::fmt;

/// What a slot must hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Expect {
    /// Bytes checked.
    pub(crate) len: usize,
    /// Seed of the pattern.
    pub(crate) seed: u8,
    /// The stamp in the first `min(8, len - tag)` bytes, little-endian, truncated.
    pub(crate) stamp: Option<u64>,
    /// The last byte.
    pub(crate) tag: Option<u8>,
}

/// The first byte that differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Mismatch {
    pub(crate) offset: usize,
    pub(crate) expected: u8,
    pub(crate) found: u8,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "byte {} is {:#04x}, expected {:#04x}",
            self.offset, self.found, self.expected
        )
    }
}

/// The pattern byte at `offset` for `seed`.
fn pattern(offset: usize, seed: u8) -> u8 {
    (offset as u8).wrapping_mul(131).wrapping_add(seed) ^ (offset >> 8) as u8 ^ 0x5a
}

/// The seed of messages of `size` bytes.
pub(crate) fn seed_for(size: usize) -> u8 {
    (size.trailing_zeros() as u8)
        .wrapping_mul(37)
        .wrapping_add(size.count_ones() as u8)
        .wrapping_add((size >> 3) as u8)
}

/// The stamp of iteration `i` of messages of `size` bytes: unique per size too.
pub(crate) fn stamp_for(i: u64, size: usize) -> u64 {
    i ^ ((size as u64) << 40)
}

/// The tag of round `g` (never 0, so a zeroed buffer never looks done).
pub(crate) fn tag(g: u64) -> u8 {
    (g % 255 + 1) as u8
}

impl Expect {
    /// A plain pattern of `len` bytes for messages of `size` bytes.
    pub(crate) fn pattern(len: usize, size: usize) -> Expect {
        Expect {
            len,
            seed: seed_for(size),
            stamp: None,
            tag: None,
        }
    }

    pub(crate) fn stamped(mut self, stamp: u64) -> Expect {
        self.stamp = Some(stamp);
        self
    }

    pub(crate) fn tagged(mut self, tag: u8) -> Expect {
        self.tag = Some(tag);
        self
    }

    /// Bytes the stamp covers.
    pub(crate) fn stamp_len(&self) -> usize {
        self.len
            .saturating_sub(usize::from(self.tag.is_some()))
            .min(8)
    }

    fn byte(&self, offset: usize) -> u8 {
        if self.tag.is_some() && offset + 1 == self.len {
            return self.tag.unwrap_or(0);
        }
        match self.stamp {
            Some(s) if offset < self.stamp_len() => s.to_le_bytes()[offset],
            _ => pattern(offset, self.seed),
        }
    }

    /// The bytes a correct message holds.
    pub(crate) fn bytes(&self) -> Vec<u8> {
        (0..self.len).map(|i| self.byte(i)).collect()
    }

    /// The same bytes with every stamp byte inverted: what a destination is poisoned with
    /// before a READ, so a READ that never lands is seen.
    pub(crate) fn poison(&self) -> Vec<u8> {
        let mut v = self.bytes();
        for b in v.iter_mut().take(self.stamp_len().max(1)) {
            *b = !*b;
        }
        v
    }

    /// Compares `found` (at least `len` bytes) with what it must hold.
    pub(crate) fn check(&self, found: &[u8]) -> Result<(), Mismatch> {
        for (offset, &b) in found[..self.len].iter().enumerate() {
            let expected = self.byte(offset);
            if b != expected {
                return Err(Mismatch {
                    offset,
                    expected,
                    found: b,
                });
            }
        }
        Ok(())
    }
}

/// Reads `e.len` bytes at `offset` of `mr` and checks them; `what` names the message in
/// the error.
pub(crate) fn check_region(
    mr: &rdmx::MemoryRegion,
    offset: usize,
    e: &Expect,
    buf: &mut Vec<u8>,
    what: impl FnOnce() -> String,
) -> Result<(), String> {
    buf.resize(e.len, 0);
    mr.read_at(offset, buf).map_err(|err| err.to_string())?;
    e.check(buf)
        .map_err(|m| format!("--verify: {}: {m}", what()))
}

/// Checks a slot that `size`-byte UC WRITEs numbered `numbers` were aimed at, zeroed as
/// the size began. A UC WRITE that loses a packet is dropped after the packets before it
/// were placed, so each piece of `mtu` bytes (a packet's payload) holds that piece of one
/// of those WRITEs, the first piece with its stamp, or is still zero.
pub(crate) fn check_lossy_slot(
    found: &[u8],
    size: usize,
    mtu: usize,
    numbers: impl Iterator<Item = u64> + Clone,
) -> Result<(), Mismatch> {
    let plain = Expect::pattern(size, size);
    let stamp_len = plain.stamp_len();
    for start in (0..size).step_by(mtu.max(1)) {
        let piece = &found[start..size.min(start + mtu)];
        if piece.iter().all(|&b| b == 0) {
            continue;
        }
        // The pattern past the stamp, then the stamp of some WRITE to the slot.
        let from = if start == 0 { stamp_len } else { 0 };
        for (i, &b) in piece.iter().enumerate().skip(from) {
            let expected = plain.byte(start + i);
            if b != expected {
                return Err(Mismatch {
                    offset: start + i,
                    expected,
                    found: b,
                });
            }
        }
        if start == 0 && stamp_len > 0 {
            let stamped =
                |n: u64| stamp_for(n, size).to_le_bytes()[..stamp_len] == piece[..stamp_len];
            if !numbers.clone().any(stamped) {
                let last = numbers.clone().last().unwrap_or(0);
                return Err(Mismatch {
                    offset: 0,
                    expected: stamp_for(last, size).to_le_bytes()[0],
                    found: piece[0],
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_correct_message_passes_and_any_corrupted_byte_is_found() {
        for len in [1usize, 2, 7, 8, 9, 64, 4097] {
            for e in [
                Expect::pattern(len, len),
                Expect::pattern(len, len).stamped(stamp_for(41, len)),
                Expect::pattern(len, len).stamped(7).tagged(tag(3)),
            ] {
                let good = e.bytes();
                assert_eq!(e.check(&good), Ok(()), "{e:?}");
                for at in [0, len / 2, len - 1] {
                    let mut bad = good.clone();
                    bad[at] ^= 0x10;
                    let m = e.check(&bad).expect_err("corruption must be found");
                    assert_eq!((m.offset, m.found), (at, bad[at]));
                }
            }
        }
    }

    #[test]
    fn stale_data_fails() {
        let len = 64;
        let e = Expect::pattern(len, len).stamped(stamp_for(5, len));
        // The previous iteration's message in the same slot.
        let old = Expect::pattern(len, len).stamped(stamp_for(4, len)).bytes();
        assert_eq!(e.check(&old).unwrap_err().offset, 0);
        // A message of another size in the same slot.
        let other = Expect::pattern(len, 128).stamped(stamp_for(5, len)).bytes();
        assert!(e.check(&other).is_err());
        // Nothing at all, and a READ destination that was never written.
        assert!(e.check(&[0u8; 64]).is_err());
        assert_eq!(e.check(&e.poison()).unwrap_err().offset, 0);
        let one = Expect::pattern(1, 1);
        assert!(one.check(&one.poison()).is_err());
    }

    #[test]
    fn seeds_differ_across_the_sweep() {
        let seeds: std::collections::HashSet<u8> = (1..=23).map(|k| seed_for(1 << k)).collect();
        assert_eq!(seeds.len(), 23);
    }

    #[test]
    fn tags_are_never_zero_and_change_every_round() {
        for g in 0..1000u64 {
            assert_ne!(tag(g), 0);
            assert_ne!(tag(g), tag(g + 1));
        }
    }

    #[test]
    fn a_lossy_slot_holds_pieces_of_its_writes_or_zeros_and_nothing_else() {
        let (size, mtu) = (40, 16);
        let write = |n: u64| {
            Expect::pattern(size, size)
                .stamped(stamp_for(n, size))
                .bytes()
        };
        let numbers = || [3u64, 7, 11].into_iter();
        // Whole WRITEs, a later one cut short over an earlier one, a piece never placed.
        let mut mixed = write(3);
        mixed[..16].copy_from_slice(&write(11)[..16]);
        let mut hole = write(7);
        hole[16..32].fill(0);
        for ok in [write(3), write(11), mixed, hole, vec![0; size]] {
            assert!(check_lossy_slot(&ok, size, mtu, numbers()).is_ok());
        }
        // A stamp of a WRITE aimed elsewhere, a piece half placed, a wrong byte.
        let elsewhere = write(4);
        let mut half = write(3);
        half[20..32].fill(0);
        let mut wrong = write(7);
        wrong[35] ^= 1;
        for (bad, at) in [(elsewhere, 0), (half, 20), (wrong, 35)] {
            let m = check_lossy_slot(&bad, size, mtu, numbers()).expect_err("caught");
            assert_eq!(m.offset, at);
        }
    }
}
