//! Arbitrary bytes as a transfer engine's segment descriptor, as a peer's handshake or
//! etcd delivers it (`rdmx_transfer::SegmentDesc::from_bytes`).
//!
//! Checked: parsing returns, an error or a descriptor, without panicking; a descriptor
//! it accepts is consistent (buffers in order, not overlapping, a key per rail, no
//! address range that wraps) and encodes back to exactly the input (the form is
//! canonical, so nothing a peer sends is read two ways).
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmx_transfer::SegmentDesc;

fuzz_target!(|data: &[u8]| {
    let Ok(d) = SegmentDesc::from_bytes(data) else {
        return;
    };
    assert!(!d.rails.is_empty() && d.rails.len() <= 16);
    let mut end = 0u64;
    for b in &d.buffers {
        assert!(b.len > 0 && b.offset >= end);
        end = b.offset.checked_add(b.len).expect("no wrap");
    }
    assert_eq!(d.to_bytes(), data, "the descriptor did not encode back to its input");
});
