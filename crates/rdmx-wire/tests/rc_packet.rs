//! Whole-packet parse/emit tests through the public API.

mod common;

use common::{bth, legal_payload_lens, sample_repr};
use rdmx_wire::{
    pad_for, AethRepr, AtomicAckEthRepr, AtomicEthRepr, BthRepr, Credits, Error, HeaderKind,
    IethRepr, ImmDtRepr, NakCode, Opcode, RcPacket, RcRepr, RethRepr, RnrTimer, Syndrome,
};

fn emit_vec(r: &RcRepr<'_>) -> Vec<u8> {
    let mut buf = vec![0xEE; r.buffer_len() + 7];
    let n = r.emit_with_payload(&mut buf).unwrap();
    assert_eq!(n, r.buffer_len());
    buf.truncate(n);
    buf
}

fn bth_repr(
    opcode: Opcode,
    solicited: bool,
    pkey: u16,
    qpn: u32,
    ack_req: bool,
    psn: u32,
) -> BthRepr {
    BthRepr {
        opcode,
        solicited,
        migreq: false,
        pad_count: 0,
        pkey,
        fecn: false,
        becn: false,
        dest_qpn: qpn,
        ack_req,
        psn,
    }
}

#[test]
fn rc_known_bytes_write_only_with_immediate() {
    #[rustfmt::skip]
    let bytes: [u8; 36] = [
        0x0B, 0x90, 0xFF, 0xFF, 0x00, 0x00, 0x00, 0x11, 0x80, 0x00, 0x00, 0x2A, // BTH
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x10, 0x00, // RETH VA
        0x00, 0x00, 0x00, 0x07, 0x00, 0x00, 0x00, 0x03, // RETH R_Key, DMA len
        0x00, 0xC0, 0xFF, 0xEE, // ImmDt
        b'a', b'b', b'c', 0x00, // payload + 1 pad byte
    ];
    let mut repr = RcRepr::new(BthRepr {
        pad_count: 1,
        ..bth_repr(
            Opcode::RdmaWriteOnlyWithImmediate,
            true,
            0xFFFF,
            0x11,
            true,
            42,
        )
    });
    repr.reth = Some(RethRepr {
        va: 0x1000,
        rkey: 7,
        dma_len: 3,
    });
    repr.immdt = Some(ImmDtRepr { imm: 0x00C0_FFEE });
    repr.payload = b"abc";

    assert_eq!(repr.header_len(), 32);
    assert_eq!(emit_vec(&repr), bytes);
    assert_eq!(RcRepr::parse_bytes(&bytes), Ok(repr));

    let p = RcPacket::new_checked(&bytes[..]).unwrap();
    assert_eq!(p.opcode(), Opcode::RdmaWriteOnlyWithImmediate);
    assert_eq!(p.header_len(), 32);
    assert_eq!(p.pad_count(), 1);
    assert_eq!(p.payload_len(), 3);
    assert_eq!(p.payload(), b"abc");
    assert_eq!(p.reth().unwrap().rkey(), 7);
    assert_eq!(p.immdt().unwrap().imm(), 0x00C0_FFEE);
    assert!(p.aeth().is_none() && p.ieth().is_none() && p.atomic_eth().is_none());
    assert_eq!(p.bth().psn(), 42);
}

#[test]
fn rc_known_bytes_atomic_acknowledge() {
    #[rustfmt::skip]
    let bytes: [u8; 24] = [
        0x12, 0x00, 0x80, 0x01, 0x00, 0x00, 0x01, 0x02, 0x00, 0x00, 0x00, 0x10, // BTH
        0x1F, 0x00, 0x00, 0x05, // AETH: ACK, no credit limit, MSN 5
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x64, // AtomicAckETH
    ];
    let mut repr = RcRepr::new(bth_repr(
        Opcode::AtomicAcknowledge,
        false,
        0x8001,
        0x102,
        false,
        0x10,
    ));
    repr.aeth = Some(AethRepr {
        syndrome: Syndrome::Ack {
            credits: Credits::UNLIMITED,
        },
        msn: 5,
    });
    repr.atomic_ack_eth = Some(AtomicAckEthRepr { orig_data: 100 });
    assert_eq!(emit_vec(&repr), bytes);
    assert_eq!(RcRepr::parse_bytes(&bytes), Ok(repr));
    let p = RcPacket::new_checked(&bytes[..]).unwrap();
    assert_eq!(p.atomic_ack_eth().unwrap().orig_data(), 100);
    assert_eq!(p.aeth().unwrap().msn(), 5);
    assert!(p.payload().is_empty());
}

#[test]
fn rc_known_bytes_nak_and_rnr_nak() {
    #[rustfmt::skip]
    let nak: [u8; 16] = [
        0x11, 0x00, 0xFF, 0xFF, 0x00, 0x00, 0x00, 0x05, 0x00, 0x12, 0x34, 0x56,
        0x60, 0x00, 0x00, 0x09,
    ];
    let mut repr = RcRepr::new(bth_repr(
        Opcode::Acknowledge,
        false,
        0xFFFF,
        5,
        false,
        0x12_3456,
    ));
    repr.aeth = Some(AethRepr {
        syndrome: Syndrome::Nak(NakCode::PsnSequenceError),
        msn: 9,
    });
    assert_eq!(emit_vec(&repr), nak);
    assert_eq!(RcRepr::parse_bytes(&nak), Ok(repr));

    let mut rnr = nak;
    rnr[12] = 0x2E; // RNR NAK, timer code 14 = 1.28 ms
    let parsed = RcRepr::parse_bytes(&rnr).unwrap();
    assert_eq!(
        parsed.aeth.unwrap().syndrome,
        Syndrome::RnrNak {
            timer: RnrTimer::from_code(14).unwrap()
        }
    );
    assert_eq!(RnrTimer::from_code(14).unwrap().to_micros(), 1280);
}

#[test]
fn rc_known_bytes_compare_swap() {
    #[rustfmt::skip]
    let bytes: [u8; 40] = [
        0x13, 0x00, 0xFF, 0xFF, 0x00, 0x00, 0x00, 0x05, 0x80, 0x00, 0x00, 0x01, // BTH
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x20, 0x00, // VA
        0x00, 0x00, 0x00, 0x09, // R_Key
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, // swap
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // compare
    ];
    let mut repr = RcRepr::new(bth_repr(Opcode::CompareSwap, false, 0xFFFF, 5, true, 1));
    repr.atomic_eth = Some(AtomicEthRepr {
        va: 0x2000,
        rkey: 9,
        swap_add: 1,
        compare: 0,
    });
    assert_eq!(emit_vec(&repr), bytes);
    assert_eq!(RcRepr::parse_bytes(&bytes), Ok(repr));
}

#[test]
fn rc_known_bytes_send_only_with_invalidate_and_read_response_middle() {
    #[rustfmt::skip]
    let bytes: [u8; 20] = [
        0x17, 0x80, 0xFF, 0xFF, 0x00, 0x00, 0x00, 0x05, 0x80, 0x00, 0x00, 0x07, // BTH
        0x00, 0x00, 0xAB, 0xCD, // IETH
        0x01, 0x02, 0x03, 0x04, // payload
    ];
    let mut repr = RcRepr::new(bth_repr(
        Opcode::SendOnlyWithInvalidate,
        true,
        0xFFFF,
        5,
        true,
        7,
    ));
    repr.ieth = Some(IethRepr { rkey: 0xABCD });
    repr.payload = &[1, 2, 3, 4];
    assert_eq!(emit_vec(&repr), bytes);
    assert_eq!(RcRepr::parse_bytes(&bytes), Ok(repr));

    #[rustfmt::skip]
    let mid: [u8; 16] = [
        0x0E, 0x00, 0xFF, 0xFF, 0x00, 0x00, 0x00, 0x05, 0x00, 0x00, 0x00, 0x08,
        0xAA, 0xBB, 0xCC, 0xDD,
    ];
    let mut repr = RcRepr::new(bth_repr(
        Opcode::RdmaReadResponseMiddle,
        false,
        0xFFFF,
        5,
        false,
        8,
    ));
    repr.payload = &[0xAA, 0xBB, 0xCC, 0xDD];
    assert_eq!(emit_vec(&repr), mid);
    assert_eq!(RcRepr::parse_bytes(&mid), Ok(repr));
}

#[test]
fn rc_round_trip_every_opcode() {
    let big: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    for op in Opcode::ALL {
        for len in legal_payload_lens(op) {
            let repr = sample_repr(op, &big[..len]);
            let bytes = emit_vec(&repr);
            assert_eq!(bytes.len(), op.header_len() + len + pad_for(len) as usize);
            assert_eq!(bytes.len() % 4, 0, "{op} len {len}");
            assert_eq!(bytes[0], op.as_u8());
            assert!(
                bytes[op.header_len() + len..].iter().all(|b| *b == 0),
                "pad"
            );

            let parsed = RcRepr::parse_bytes(&bytes).unwrap_or_else(|e| panic!("{op} {len}: {e}"));
            assert_eq!(parsed, repr, "{op} len {len}");
            // Zero-copy: the payload borrows the input buffer.
            assert_eq!(
                parsed.payload.as_ptr(),
                bytes[op.header_len()..].as_ptr(),
                "{op}"
            );

            // The view agrees with the repr.
            let p = RcPacket::new_checked(&bytes[..]).unwrap();
            assert_eq!(p.opcode(), op);
            assert_eq!(p.len(), bytes.len());
            assert_eq!(p.payload(), &big[..len]);
            assert_eq!(p.reth().is_some(), op.has_reth());
            assert_eq!(p.aeth().is_some(), op.has_aeth());
            assert_eq!(p.atomic_eth().is_some(), op.has_atomic_eth());
            assert_eq!(p.atomic_ack_eth().is_some(), op.has_atomic_ack_eth());
            assert_eq!(p.immdt().is_some(), op.has_immdt());
            assert_eq!(p.ieth().is_some(), op.has_ieth());

            // Header-only emit writes exactly the same header bytes.
            let mut hdr = vec![0u8; repr.header_len()];
            assert_eq!(repr.emit(&mut hdr, len), Ok(op.header_len()));
            assert_eq!(hdr[..], bytes[..op.header_len()]);

            // Display never fails and names the opcode.
            assert!(parsed.to_string().starts_with(op.name()));
        }
    }
}

#[test]
fn rc_header_offsets_follow_spec_order() {
    use HeaderKind::*;
    assert_eq!(Reth.offset_in(Opcode::RdmaWriteOnlyWithImmediate), Some(12));
    assert_eq!(
        ImmDt.offset_in(Opcode::RdmaWriteOnlyWithImmediate),
        Some(28)
    );
    assert_eq!(Aeth.offset_in(Opcode::AtomicAcknowledge), Some(12));
    assert_eq!(AtomicAckEth.offset_in(Opcode::AtomicAcknowledge), Some(16));
    assert_eq!(AtomicEth.offset_in(Opcode::FetchAdd), Some(12));
    assert_eq!(Aeth.offset_in(Opcode::RdmaReadResponseFirst), Some(12));
    assert_eq!(Aeth.offset_in(Opcode::RdmaReadResponseMiddle), None);
    assert_eq!(ImmDt.offset_in(Opcode::SendLastWithImmediate), Some(12));
    assert_eq!(Ieth.offset_in(Opcode::SendLastWithInvalidate), Some(12));
    assert_eq!(Reth.offset_in(Opcode::SendOnly), None);
    for op in Opcode::ALL {
        let mut expect = 12;
        for k in HeaderKind::ALL {
            if k.present_in(op) {
                assert_eq!(k.offset_in(op), Some(expect), "{op} {k}");
                expect += k.wire_len();
            } else {
                assert_eq!(k.offset_in(op), None);
            }
        }
        assert_eq!(expect, op.header_len(), "{op}");
    }
}

#[test]
fn rc_header_only_emit_for_zero_copy() {
    let payload = [9u8; 10];
    let repr = sample_repr(Opcode::SendOnlyWithImmediate, &[]);
    // Headers into their own small buffer, payload and pad separately.
    let mut hdr = [0u8; 16];
    assert_eq!(repr.emit(&mut hdr, payload.len()), Ok(16));
    assert_eq!(hdr[1] & 0x30, 2 << 4, "pad count derived from payload_len");
    let mut wire = hdr.to_vec();
    wire.extend_from_slice(&payload);
    wire.extend(std::iter::repeat(0).take(pad_for(payload.len()).into()));
    let parsed = RcRepr::parse_bytes(&wire).unwrap();
    assert_eq!(parsed.payload, payload);
    assert_eq!(parsed.bth.pad_count, 2);
    assert_eq!(parsed.immdt, repr.immdt);

    // bth.pad_count in the repr is ignored on emit.
    let mut r2 = repr;
    r2.bth.pad_count = 3;
    let mut hdr2 = [0u8; 16];
    r2.emit(&mut hdr2, payload.len()).unwrap();
    assert_eq!(hdr, hdr2);

    assert_eq!(pad_for(0), 0);
    assert_eq!(pad_for(1), 3);
    assert_eq!(pad_for(2), 2);
    assert_eq!(pad_for(3), 1);
    assert_eq!(pad_for(4), 0);
    assert_eq!(pad_for(usize::MAX), 1);
}

#[test]
fn rc_emit_rejects_inconsistent_reprs() {
    let mut buf = [0u8; 128];

    let mut r = sample_repr(Opcode::RdmaWriteFirst, &[]);
    r.reth = None;
    assert_eq!(
        r.emit(&mut buf, 0),
        Err(Error::MissingHeader(HeaderKind::Reth))
    );

    let mut r = sample_repr(Opcode::SendOnly, &[]);
    r.immdt = Some(ImmDtRepr { imm: 1 });
    assert_eq!(
        r.emit(&mut buf, 0),
        Err(Error::UnexpectedHeader(HeaderKind::ImmDt))
    );

    let mut r = sample_repr(Opcode::Acknowledge, &[]);
    r.atomic_ack_eth = Some(AtomicAckEthRepr { orig_data: 0 });
    assert_eq!(
        r.emit(&mut buf, 0),
        Err(Error::UnexpectedHeader(HeaderKind::AtomicAckEth))
    );
    let r = sample_repr(Opcode::Acknowledge, &[]);
    assert_eq!(
        r.emit(&mut buf, 1),
        Err(Error::UnexpectedPayload { len: 1 })
    );
    let r = sample_repr(Opcode::RdmaReadRequest, &[1, 2, 3, 4]);
    assert_eq!(
        r.emit_with_payload(&mut buf),
        Err(Error::UnexpectedPayload { len: 4 })
    );

    for op in [
        Opcode::SendFirst,
        Opcode::RdmaWriteMiddle,
        Opcode::RdmaReadResponseFirst,
    ] {
        let r = sample_repr(op, &[]);
        assert_eq!(r.emit(&mut buf, 8), Ok(op.header_len()));
        assert!(
            matches!(r.emit(&mut buf, 6), Err(Error::BadPad { pad_count: 2, .. })),
            "{op}"
        );
    }

    let mut r = sample_repr(Opcode::SendOnly, &[]);
    r.bth.psn = 1 << 24;
    assert_eq!(
        r.emit(&mut buf, 0),
        Err(Error::FieldOutOfRange {
            field: "psn",
            value: 1 << 24
        })
    );
    r.bth.psn = 0;
    r.bth.dest_qpn = 0x0100_0000;
    assert!(matches!(
        r.emit(&mut buf, 0),
        Err(Error::FieldOutOfRange {
            field: "dest_qpn",
            ..
        })
    ));

    let mut r = sample_repr(Opcode::RdmaReadResponseLast, &[]);
    r.aeth.as_mut().unwrap().msn = u32::MAX;
    assert!(matches!(
        r.emit(&mut buf, 0),
        Err(Error::FieldOutOfRange { field: "msn", .. })
    ));

    // Too-small buffers: nothing is written.
    let r = sample_repr(Opcode::RdmaWriteOnlyWithImmediate, b"hello");
    let mut small = [0x77u8; 31];
    assert_eq!(
        r.emit(&mut small, 5),
        Err(Error::Truncated { need: 32, have: 31 })
    );
    assert!(small.iter().all(|b| *b == 0x77));
    let mut small = [0x77u8; 39];
    assert_eq!(
        r.emit_with_payload(&mut small),
        Err(Error::Truncated { need: 40, have: 39 })
    );
    assert!(small.iter().all(|b| *b == 0x77));
    let mut exact = [0x77u8; 40];
    assert_eq!(r.emit_with_payload(&mut exact), Ok(40));
    assert_eq!(&exact[37..], &[0, 0, 0]);
}

#[test]
fn rc_parse_rejects_truncated_headers() {
    for op in Opcode::ALL {
        let repr = sample_repr(op, &[]);
        let bytes = emit_vec(&repr);
        for n in 0..op.header_len() {
            let need = if n < 12 { 12 } else { op.header_len() };
            assert_eq!(
                RcRepr::parse_bytes(&bytes[..n]),
                Err(Error::Truncated { need, have: n }),
                "{op} {n}"
            );
            assert!(RcPacket::new_checked(&bytes[..n]).is_err());
        }
    }
}

#[test]
fn rc_parse_rejects_bad_pad() {
    // SEND_ONLY with 5 bytes of payload: 12 + 5 + 3 = 20 bytes.
    let payload = [1u8, 2, 3, 4, 5];
    let good = emit_vec(&sample_repr(Opcode::SendOnly, &payload));
    assert_eq!(good.len(), 20);
    assert_eq!(good[1] & 0x30, 0x30);

    // Not a multiple of 4 after the headers.
    for cut in [17, 18, 19] {
        assert!(matches!(
            RcRepr::parse_bytes(&good[..cut]),
            Err(Error::BadPad { pad_count: 3, .. })
        ));
    }
    // Aligned, but pad larger than the remainder.
    let mut hdr_only = good[..12].to_vec();
    assert_eq!(
        RcRepr::parse_bytes(&hdr_only),
        Err(Error::BadPad {
            pad_count: 3,
            len: 0
        })
    );
    // A pad count of 0 with an aligned body is fine (8-byte payload).
    hdr_only[1] &= !0x30;
    hdr_only.extend_from_slice(&[0; 8]);
    assert_eq!(RcRepr::parse_bytes(&hdr_only).unwrap().payload.len(), 8);

    // FIRST / MIDDLE must not be padded.
    let mut first = emit_vec(&sample_repr(Opcode::SendFirst, &[0; 8]));
    first[1] |= 0x10;
    assert_eq!(
        RcRepr::parse_bytes(&first),
        Err(Error::BadPad {
            pad_count: 1,
            len: 8
        })
    );

    // No-payload opcodes must not have a pad count.
    let mut ack = emit_vec(&sample_repr(Opcode::Acknowledge, &[]));
    ack[1] |= 0x20;
    assert_eq!(
        RcRepr::parse_bytes(&ack),
        Err(Error::BadPad {
            pad_count: 2,
            len: 0
        })
    );
}

#[test]
fn rc_parse_rejects_payload_on_opcodes_without_one() {
    for op in Opcode::ALL.into_iter().filter(|op| !op.has_payload()) {
        let mut bytes = emit_vec(&sample_repr(op, &[]));
        bytes.extend_from_slice(&[0; 4]); // e.g. an ICRC left in place
        assert_eq!(
            RcRepr::parse_bytes(&bytes),
            Err(Error::UnexpectedPayload { len: 4 }),
            "{op}"
        );
    }
}

#[test]
fn rc_parse_rejects_unknown_opcode_version_and_syndrome() {
    let good = emit_vec(&sample_repr(Opcode::SendOnly, &[0; 4]));
    for op in [0x15u8, 0x18, 0x20, 0x24, 0x64, 0x81, 0xFF] {
        let mut b = good.clone();
        b[0] = op;
        assert_eq!(RcRepr::parse_bytes(&b), Err(Error::UnknownOpcode(op)));
    }
    for tver in 1..16u8 {
        let mut b = good.clone();
        b[1] |= tver;
        assert_eq!(RcRepr::parse_bytes(&b), Err(Error::BadVersion(tver)));
    }
    let mut ack = emit_vec(&sample_repr(Opcode::Acknowledge, &[]));
    for syn in [0x40u8, 0x5F, 0x65, 0x7F, 0x80, 0xFF] {
        ack[12] = syn;
        assert!(RcPacket::new_checked(&ack[..]).is_ok(), "layout is fine");
        assert_eq!(RcRepr::parse_bytes(&ack), Err(Error::BadSyndrome(syn)));
    }
}

#[test]
fn rc_reserved_bits_and_pad_contents_are_ignored() {
    let repr = sample_repr(Opcode::SendLast, b"xy");
    let mut bytes = emit_vec(&repr);
    bytes[4] |= 0x3F;
    bytes[8] |= 0x7F;
    let n = bytes.len();
    bytes[n - 1] = 0xAA;
    bytes[n - 2] = 0xBB;
    assert_eq!(RcRepr::parse_bytes(&bytes), Ok(repr));
}

#[test]
fn rc_packet_mutators() {
    let repr = sample_repr(Opcode::RdmaWriteOnly, b"payload!");
    let mut bytes = emit_vec(&repr);
    {
        let mut p = RcPacket::new_checked(&mut bytes[..]).unwrap();
        p.set_psn(0x0100_0003); // high bits dropped
        p.set_ack_req(false);
        p.set_solicited(false);
        p.set_migreq(false);
        p.set_fecn(true);
        p.set_becn(true);
        p.set_pkey(0x7FFF);
        p.set_dest_qpn(0x42);
        p.reth_mut().unwrap().set_rkey(0xFEED);
        assert!(p.aeth_mut().is_none());
        assert!(p.immdt_mut().is_none());
        assert!(p.ieth_mut().is_none());
        assert!(p.atomic_eth_mut().is_none());
        assert!(p.atomic_ack_eth_mut().is_none());
        p.payload_mut().copy_from_slice(b"PAYLOAD?");
    }
    let parsed = RcRepr::parse_bytes(&bytes).unwrap();
    assert_eq!(parsed.bth.psn, 3);
    assert!(!parsed.bth.ack_req && !parsed.bth.solicited && !parsed.bth.migreq);
    assert!(parsed.bth.fecn && parsed.bth.becn);
    assert_eq!(parsed.bth.pkey, 0x7FFF);
    assert_eq!(parsed.bth.dest_qpn, 0x42);
    assert_eq!(parsed.reth.unwrap().rkey, 0xFEED);
    assert_eq!(parsed.payload, b"PAYLOAD?");

    let mut ack = emit_vec(&sample_repr(Opcode::AtomicAcknowledge, &[]));
    {
        let mut p = RcPacket::new_checked(&mut ack[..]).unwrap();
        p.aeth_mut().unwrap().set_syndrome(Syndrome::RnrNak {
            timer: RnrTimer::at_least_micros(1000),
        });
        p.atomic_ack_eth_mut().unwrap().set_orig_data(77);
        assert!(p.payload_mut().is_empty());
    }
    let parsed = RcRepr::parse_bytes(&ack).unwrap();
    assert_eq!(parsed.atomic_ack_eth.unwrap().orig_data, 77);
    assert_eq!(
        parsed.aeth.unwrap().syndrome,
        Syndrome::RnrNak {
            timer: RnrTimer::from_code(14).unwrap()
        }
    );
}

#[test]
fn rc_sample_bth_helper_is_consistent() {
    // Guards the shared helper the other tests rely on.
    for op in Opcode::ALL {
        for len in legal_payload_lens(op) {
            let b = bth(op, len);
            assert_eq!(b.check(), Ok(()));
            assert_eq!(b.pad_count, pad_for(len));
        }
    }
}

#[test]
fn error_display_and_std_error() {
    let cases: [(Error, &str); 9] = [
        (
            Error::Truncated { need: 12, have: 3 },
            "truncated: need 12 bytes, have 3",
        ),
        (Error::UnknownOpcode(0x64), "unknown or non-RC opcode 0x64"),
        (
            Error::BadVersion(2),
            "unsupported transport header version 2",
        ),
        (
            Error::BadPad {
                pad_count: 3,
                len: 0,
            },
            "pad count 3 inconsistent with 0 bytes of payload and pad",
        ),
        (
            Error::UnexpectedPayload { len: 4 },
            "4 payload bytes on an opcode that carries none",
        ),
        (Error::BadSyndrome(0x40), "reserved AETH syndrome 0x40"),
        (
            Error::MissingHeader(HeaderKind::Reth),
            "opcode requires a RETH header",
        ),
        (
            Error::UnexpectedHeader(HeaderKind::ImmDt),
            "opcode does not carry a ImmDt header",
        ),
        (
            Error::FieldOutOfRange {
                field: "psn",
                value: 0x100_0000,
            },
            "psn value 0x1000000 does not fit its wire field",
        ),
    ];
    for (e, s) in cases {
        assert_eq!(e.to_string(), s);
        let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(e);
        assert_eq!(boxed.to_string(), s);
    }
}
