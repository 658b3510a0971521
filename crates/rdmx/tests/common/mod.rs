//! Helpers shared by the integration tests.
#![allow(dead_code, unreachable_pub)]

pub mod udp_pair;

/// Bytes of `[start, end)` that lie in mappings the kernel holds locked (`lo` among the
/// `VmFlags:` of /proc/self/smaps). mlock splits mappings at the locked boundary; the
/// count is clipped to the range all the same, because the kernel merges a locked
/// mapping with an adjacent one locked by another test thread.
pub fn locked_in(start: usize, end: usize) -> usize {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut total = 0;
    let mut overlap = 0;
    for line in smaps.lines() {
        if let Some((a, b)) = line.split_once(' ').and_then(|(r, _)| range(r)) {
            overlap = b.min(end).saturating_sub(a.max(start));
            continue;
        }
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            if flags.split_ascii_whitespace().any(|f| f == "lo") {
                total += overlap;
            }
        }
    }
    total
}

/// A mapped file as /proc/self/maps names it: `(device, inode)`.
pub type MappedFile = (String, u64);

/// The file behind the mapping of this process that covers `addr`, as `(device, inode)`
/// from /proc/self/maps; `None` when the address is not mapped or the mapping is
/// anonymous (inode 0).
///
/// A test that checks memory was unmapped must not look at the address alone: another
/// thread of the test binary may map something new at the same address the moment it is
/// free. A memfd-backed mapping ([`rdmx::Mapping::shared`]) has an inode no other
/// mapping shares, so its absence is certain.
pub fn mapped_file(addr: usize) -> Option<MappedFile> {
    maps()
        .into_iter()
        .find_map(|(a, b, file)| (a <= addr && addr < b).then_some(file).flatten())
}

/// Whether any mapping of this process is of `file`, as [`mapped_file`] returns it.
pub fn file_is_mapped(file: &MappedFile) -> bool {
    maps().into_iter().any(|(_, _, f)| f.as_ref() == Some(file))
}

/// Every mapping of this process: start, end and, for a file, `(device, inode)`.
fn maps() -> Vec<(usize, usize, Option<MappedFile>)> {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("read /proc/self/maps");
    maps.lines()
        .filter_map(|line| {
            // start-end perms offset dev inode [path]
            let mut f = line.split_ascii_whitespace();
            let (a, b) = range(f.next()?)?;
            let (_perms, _offset) = (f.next()?, f.next()?);
            let dev = f.next()?.to_string();
            let inode: u64 = f.next()?.parse().ok()?;
            Some((a, b, (inode != 0).then_some((dev, inode))))
        })
        .collect()
}

/// A mapping's `start-end` (hexadecimal) as /proc/self/maps and smaps give it.
fn range(field: &str) -> Option<(usize, usize)> {
    let (a, b) = field.split_once('-')?;
    Some((
        usize::from_str_radix(a, 16).ok()?,
        usize::from_str_radix(b, 16).ok()?,
    ))
}

/// A udp context bound to the RoCEv2 port on an address of its own in `127.0.<net>.0/24`
/// (a test binary takes a `net` of its own): the first of 64 that is free.
pub fn open_udp(net: u8) -> rdmx::Result<rdmx::Context> {
    let mut last = None;
    for k in 0..64u8 {
        let ip = std::net::Ipv4Addr::new(127, 0, net, 1 + k);
        let addr = std::net::SocketAddr::from((ip, rdmx::udp::ROCE_PORT));
        match rdmx::Context::open(rdmx::udp::Options::default().bind(addr)) {
            Ok(c) => return Ok(c),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("tried"))
}
