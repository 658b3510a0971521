//! Helpers shared by the integration tests.
#![allow(dead_code, unreachable_pub)]

/// Bytes the kernel reports locked (`Locked:` in /proc/self/smaps) for mappings that
/// intersect `[start, end)`. mlock splits mappings at the locked boundary, so this is
/// exactly the locked part of the range.
pub fn locked_in(start: usize, end: usize) -> usize {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut total = 0;
    let mut hit = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ') {
            if let Some((a, b)) = range.split_once('-') {
                if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
                {
                    hit = a < end && b > start;
                    continue;
                }
            }
        }
        if hit {
            if let Some(rest) = line.strip_prefix("Locked:") {
                let kib: usize = rest.trim().trim_end_matches("kB").trim().parse().unwrap();
                total += kib * 1024;
            }
        }
    }
    total
}
