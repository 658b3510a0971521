//! Timing helpers: repeated runs, medians.

use std::time::Instant;

/// Runs `f(iters)` `runs` times after one warm-up and returns the median nanoseconds per
/// iteration.
pub(crate) fn median_ns_per_iter(runs: usize, iters: u64, mut f: impl FnMut(u64)) -> f64 {
    f(iters.div_ceil(10).max(1));
    let mut per: Vec<f64> = (0..runs.max(1))
        .map(|_| {
            let t = Instant::now();
            f(iters);
            t.elapsed().as_nanos() as f64 / iters as f64
        })
        .collect();
    median(&mut per)
}

/// The median of `v` (mean of the middle two for even lengths).
pub(crate) fn median(v: &mut [f64]) -> f64 {
    assert!(!v.is_empty());
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
