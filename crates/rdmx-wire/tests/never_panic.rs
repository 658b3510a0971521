//! Robustness: no input makes any parser panic, and whatever parses
//! re-emits to the same bytes (modulo reserved bits and pad contents).

mod common;

use common::{legal_payload_lens, sample_repr, XorShift};
use rdmx_wire::{
    Aeth, AethRepr, AtomicAckEth, AtomicAckEthRepr, AtomicEth, AtomicEthRepr, Bth, BthRepr, Ieth,
    IethRepr, ImmDt, ImmDtRepr, Opcode, RcPacket, RcRepr, Reth, RethRepr, Syndrome,
};

/// Runs every parser over `bytes`; returns whether the whole packet parsed.
fn exercise(bytes: &[u8]) -> bool {
    if let Some(&b) = bytes.first() {
        let _ = Opcode::try_from(b);
        let _ = Syndrome::from_byte(b);
    }

    // Individual header views: checked constructors and parse (which
    // re-checks the length, so unchecked views are safe to parse too).
    if let Ok(v) = Bth::new_checked(bytes) {
        let _ = (
            v.opcode(),
            v.solicited(),
            v.migreq(),
            v.pad_count(),
            v.tver(),
        );
        let _ = (v.pkey(), v.fecn(), v.becn(), v.resv6(), v.dest_qpn());
        let _ = (v.ack_req(), v.resv7(), v.psn());
    }
    let _ = BthRepr::parse(&Bth::new_unchecked(bytes));
    let _ = RethRepr::parse(&Reth::new_unchecked(bytes));
    let _ = AethRepr::parse(&Aeth::new_unchecked(bytes));
    let _ = AtomicEthRepr::parse(&AtomicEth::new_unchecked(bytes));
    let _ = AtomicAckEthRepr::parse(&AtomicAckEth::new_unchecked(bytes));
    let _ = ImmDtRepr::parse(&ImmDt::new_unchecked(bytes));
    let _ = IethRepr::parse(&Ieth::new_unchecked(bytes));
    if let Ok(v) = Aeth::new_checked(bytes) {
        let _ = (v.syndrome(), v.msn());
    }

    // Whole-packet view.
    match RcPacket::new_checked(bytes) {
        Ok(p) => {
            assert_eq!(
                p.header_len() + p.payload_len() + usize::from(p.pad_count()),
                bytes.len()
            );
            assert_eq!(p.payload().len(), p.payload_len());
            let _ = (
                p.bth().psn(),
                p.reth().map(|r| r.va()),
                p.aeth().map(|a| a.msn()),
            );
            let _ = p.atomic_eth().map(|a| a.compare());
            let _ = p.atomic_ack_eth().map(|a| a.orig_data());
            let _ = (p.immdt().map(|i| i.imm()), p.ieth().map(|i| i.rkey()));

            let mut copy = bytes.to_vec();
            let mut m = RcPacket::new_checked(&mut copy[..]).unwrap();
            m.set_psn(u32::MAX);
            m.set_dest_qpn(u32::MAX);
            m.payload_mut().fill(0);
            if let Some(mut r) = m.reth_mut() {
                r.set_dma_len(0);
            }
            assert!(RcPacket::new_checked(&copy[..]).is_ok());
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }

    // Headers parsed apart from their payload agree with the whole packet.
    let whole = RcRepr::parse_bytes(bytes);
    let hlen = bytes
        .first()
        .and_then(|&b| Opcode::try_from(b).ok())
        .map_or(bytes.len(), |op| op.header_len());
    if hlen <= bytes.len() {
        let split = RcRepr::parse_split(&bytes[..hlen], bytes.len() - hlen);
        match (&whole, split) {
            (Ok(w), Ok((h, payload_len))) => {
                assert_eq!(payload_len, w.payload.len());
                assert_eq!(RcRepr { payload: &[], ..*w }, h);
            }
            (Err(_), Err(_)) => {}
            (w, s) => panic!("whole {w:?} but split {s:?}"),
        }
    }
    if bytes.len() > hlen {
        // More than the headers is not a header.
        assert!(RcRepr::parse_split(bytes, 0).is_err());
    }

    match whole {
        Ok(r) => {
            let _ = r.to_string();
            assert_eq!(r.buffer_len(), bytes.len());
            let mut out = vec![0x55; r.buffer_len()];
            assert_eq!(r.emit_with_payload(&mut out), Ok(bytes.len()));
            let mut canon = bytes.to_vec();
            canon[4] &= 0xC0; // Resv6
            canon[8] &= 0x80; // Resv7
            let pad_start = bytes.len() - usize::from(r.bth.pad_count);
            canon[pad_start..].fill(0);
            assert_eq!(out, canon);
            assert_eq!(RcRepr::parse_bytes(&out), Ok(r));
            true
        }
        Err(e) => {
            let _ = e.to_string();
            false
        }
    }
}

#[test]
fn never_panic_random_bytes_all_lengths() {
    let mut rng = XorShift::new(0x9E37_79B9_7F4A_7C15);
    let mut parsed = 0usize;
    for len in 0..200 {
        for i in 0..300 {
            let mut buf = vec![0u8; len];
            rng.fill(&mut buf);
            // Bias half the inputs towards plausible packets so the deeper
            // paths run: a real RC opcode, TVer 0, and often a sane pad.
            if i % 2 == 0 && len >= 2 {
                buf[0] = Opcode::ALL[rng.below(Opcode::ALL.len())].as_u8();
                buf[1] &= 0xF0;
                if rng.bool() {
                    buf[1] &= 0xC0;
                }
                if len > 12 && rng.bool() {
                    // Top syndrome bit clear: valid more often than not
                    // when byte 12 is an AETH.
                    buf[12] &= 0x7F;
                }
            }
            if exercise(&buf) {
                parsed += 1;
            }
        }
    }
    eprintln!("random: {parsed} parsed");
    assert!(parsed > 1000, "generator too hostile: only {parsed} parsed");
}

#[test]
fn never_panic_mutated_valid_packets() {
    let mut rng = XorShift::new(0xDEAD_BEEF_CAFE_F00D);
    let payload: Vec<u8> = (0..=255u8).collect();
    let mut parsed = 0usize;
    let mut total = 0usize;
    for op in Opcode::ALL {
        for len in legal_payload_lens(op).into_iter().filter(|l| *l <= 256) {
            let repr = sample_repr(op, &payload[..len]);
            let mut good = vec![0u8; repr.buffer_len()];
            repr.emit_with_payload(&mut good).unwrap();
            assert!(exercise(&good), "{op} {len}");
            for _ in 0..300 {
                let mut b = good.clone();
                for _ in 0..1 + rng.below(3) {
                    match rng.below(7) {
                        0 if !b.is_empty() => {
                            let i = rng.below(b.len());
                            b[i] ^= 1 << rng.below(8);
                        }
                        1 if !b.is_empty() => {
                            let i = rng.below(b.len());
                            b[i] = rng.byte();
                        }
                        2 => {
                            let n = rng.below(b.len() + 1);
                            b.truncate(n);
                        }
                        3 => {
                            for _ in 0..rng.below(9) {
                                b.push(rng.byte());
                            }
                        }
                        4 if !b.is_empty() => {
                            // Swap in another RC opcode: the layout no
                            // longer matches the bytes.
                            b[0] = Opcode::ALL[rng.below(Opcode::ALL.len())].as_u8();
                        }
                        5 if b.len() > 1 => {
                            b[1] = (b[1] & !0x30) | ((rng.byte() & 3) << 4);
                        }
                        _ if b.len() > 12 => {
                            b[12] = rng.byte();
                        }
                        _ => {}
                    }
                }
                total += 1;
                if exercise(&b) {
                    parsed += 1;
                }
            }
        }
    }
    eprintln!("mutated: {parsed} of {total} parsed");
    assert!(parsed > 100 && parsed < total, "parsed {parsed} of {total}");
}
