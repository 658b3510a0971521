//! Counts over address ranges: how many holders each page has (pins, watches), as a step
//! function, so that a range is acted on only where its count leaves or reaches zero.

use std::collections::BTreeMap;

/// A step function over addresses: at each key the count changes to the value, and it
/// holds until the next key. Adjacent steps never share a value; the last step is 0.
#[derive(Debug, Default)]
pub(crate) struct RangeCounts {
    steps: BTreeMap<usize, usize>,
}

impl RangeCounts {
    pub(crate) const fn new() -> RangeCounts {
        RangeCounts {
            steps: BTreeMap::new(),
        }
    }

    fn count_at(&self, at: usize) -> usize {
        self.steps.range(..=at).next_back().map_or(0, |(_, &c)| c)
    }

    /// The sub-ranges of `[start, end)` with their counts, in order.
    pub(crate) fn pieces(&self, start: usize, end: usize) -> Vec<(usize, usize, usize)> {
        let mut out = Vec::new();
        let mut at = start;
        let mut count = self.count_at(start);
        for (&k, &c) in self.steps.range(start + 1..end) {
            out.push((at, k, count));
            at = k;
            count = c;
        }
        out.push((at, end, count));
        out
    }

    /// Adds `delta` to the count of every address in `[start, end)`.
    ///
    /// # Panics
    ///
    /// When a count would go below zero (a holder let go of what it did not hold).
    pub(crate) fn add(&mut self, start: usize, end: usize, delta: isize) {
        let at_end = self.count_at(end);
        let at_start = self.count_at(start);
        self.steps.insert(end, at_end);
        self.steps.insert(start, at_start);
        for (_, c) in self.steps.range_mut(start..end) {
            *c = c
                .checked_add_signed(delta)
                .expect("range count out of balance");
        }
        // Normalise around the touched boundaries: drop steps equal to their predecessor.
        for key in [start, end] {
            let prev = self.steps.range(..key).next_back().map_or(0, |(_, &c)| c);
            if self.steps.get(&key) == Some(&prev) {
                self.steps.remove(&key);
            }
        }
        let inner: Vec<usize> = self.steps.range(start + 1..end).map(|(&k, _)| k).collect();
        for key in inner {
            let prev = self.steps.range(..key).next_back().map_or(0, |(_, &c)| c);
            if self.steps.get(&key) == Some(&prev) {
                self.steps.remove(&key);
            }
        }
    }

    /// Bytes whose count is not zero.
    pub(crate) fn covered_bytes(&self) -> usize {
        let mut total = 0;
        let mut prev: Option<(usize, usize)> = None;
        for (&k, &c) in &self.steps {
            if let Some((pk, pc)) = prev {
                if pc > 0 {
                    total += k - pk;
                }
            }
            prev = Some((k, c));
        }
        total
    }
}

/// Joins adjacent pieces into ranges.
pub(crate) fn merge(pieces: impl Iterator<Item = (usize, usize, usize)>) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for (s, e, _) in pieces {
        match out.last_mut() {
            Some(last) if last.1 == s => last.1 = e,
            _ => out.push((s, e)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_function_counts_overlaps_and_normalises() {
        let mut t = RangeCounts::new();
        t.add(0x1000, 0x3000, 1);
        t.add(0x2000, 0x4000, 1);
        assert_eq!(
            t.pieces(0x1000, 0x4000),
            vec![
                (0x1000, 0x2000, 1),
                (0x2000, 0x3000, 2),
                (0x3000, 0x4000, 1)
            ]
        );
        assert_eq!(t.covered_bytes(), 0x3000);
        t.add(0x1000, 0x3000, -1);
        assert_eq!(
            t.pieces(0x1000, 0x4000),
            vec![(0x1000, 0x2000, 0), (0x2000, 0x4000, 1)]
        );
        t.add(0x2000, 0x4000, -1);
        assert!(t.steps.is_empty(), "{:?}", t.steps);
    }
}
