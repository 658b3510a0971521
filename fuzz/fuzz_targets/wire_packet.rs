//! Arbitrary bytes into every public parse entry point of `rdmx-wire`.
//!
//! Checks: nothing panics; what parses emits back (`emit`, `emit_with_payload`) and
//! re-parses to an equal representation; the re-emitted bytes equal the input except in
//! the bits the format reserves (TVer aside, which must be 0 to parse) and in the pad
//! bytes; `RcPacket`'s views agree with `RcRepr`; `RcRepr::parse_split` (headers now,
//! payload later) accepts exactly what the whole-packet parse accepts, with the same
//! headers; the layout setters of a checked packet keep it valid. The same bytes are
//! also read as an arbitrary `RcRepr` to emit, which must either fail cleanly or parse
//! back to itself.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use rdmx_wire::*;

fuzz_target!(|data: &[u8]| {
    header_views(data);
    whole_packet(data);
    split_packet(data);
    emit_arbitrary(data);
});

/// Each fixed-size header view and its `Repr`, at every offset the packet parser uses.
fn header_views(data: &[u8]) {
    if let Ok(bth) = Bth::new_checked(data) {
        let _ = (
            bth.opcode_raw(),
            bth.opcode(),
            bth.solicited(),
            bth.migreq(),
            bth.pad_count(),
            bth.tver(),
            bth.pkey(),
            bth.fecn(),
            bth.becn(),
            bth.resv6(),
            bth.dest_qpn(),
            bth.ack_req(),
            bth.resv7(),
            bth.psn(),
        );
        if let Ok(r) = BthRepr::parse(&bth) {
            r.check().expect("a parsed BTH has in-range fields");
            let mut buf = [0u8; BTH_LEN];
            r.emit(&mut Bth::new_unchecked(&mut buf[..]));
            assert_eq!(BthRepr::parse(&Bth::new_unchecked(&buf[..])), Ok(r));
        }
    }
    macro_rules! roundtrip {
        ($view:ident, $repr:ident, $len:expr) => {
            if let Ok(v) = $view::new_checked(data) {
                if let Ok(r) = $repr::parse(&v) {
                    assert_eq!(r.buffer_len(), $len);
                    let mut buf = [0u8; $len];
                    r.emit(&mut $view::new_unchecked(&mut buf[..]));
                    assert_eq!($repr::parse(&$view::new_unchecked(&buf[..])), Ok(r));
                    // Every bit of these headers is significant: the bytes come back.
                    assert_eq!(
                        &buf[..],
                        &data[..$len],
                        "{} re-emitted differently",
                        stringify!($view)
                    );
                }
            } else {
                assert!(data.len() < $len);
            }
        };
    }
    roundtrip!(Reth, RethRepr, RETH_LEN);
    roundtrip!(AtomicEth, AtomicEthRepr, ATOMIC_ETH_LEN);
    roundtrip!(Aeth, AethRepr, AETH_LEN);
    roundtrip!(AtomicAckEth, AtomicAckEthRepr, ATOMIC_ACK_ETH_LEN);
    roundtrip!(ImmDt, ImmDtRepr, IMMDT_LEN);
    roundtrip!(Ieth, IethRepr, IETH_LEN);

    if let Some(&b) = data.first() {
        if let Ok(op) = Opcode::try_from(b) {
            assert_eq!(op.as_u8(), b);
            assert_eq!(u8::from(op), b);
            let _ = (op.name(), op.to_string(), op.has_payload(), op.is_request());
            let mut hlen = BTH_LEN;
            for k in HeaderKind::ALL {
                if let Some(off) = k.offset_in(op) {
                    assert_eq!(off, hlen, "{k} of {op} out of wire order");
                    hlen += k.wire_len();
                }
            }
            assert_eq!(hlen, op.header_len());
        }
        match Syndrome::from_byte(b) {
            Ok(s) => {
                assert_eq!(s.to_byte(), b);
                let _ = s.to_string();
            }
            Err(e) => assert_eq!(e, Error::BadSyndrome(b)),
        }
        let _ = Credits::from_code(b).map(|c| (c.count(), c.is_unlimited()));
        let _ = RnrTimer::from_code(b).map(|t| t.to_duration());
        let _ = NakCode::from_code(b).map(|n| n.to_string());
    }
    if data.len() >= 8 {
        let a = u32::from_be_bytes(data[..4].try_into().unwrap());
        let b = u32::from_be_bytes(data[4..8].try_into().unwrap());
        let d = psn_diff(a, b);
        assert!((-(1 << 23)..(1 << 23)).contains(&d));
        assert_eq!(psn_add(b, d as u32), a & PSN_MASK);
        assert_eq!(psn_sub(a, d as u32), b & PSN_MASK);
        assert_eq!(psn_lt(a, b), d < 0);
        assert_eq!(psn_le(a, b), d <= 0);
        let _ = (Credits::from_count(a), RnrTimer::at_least_micros(b));
    }
}

/// The whole-packet view and representation.
fn whole_packet(data: &[u8]) {
    let pkt = match RcPacket::new_checked(data) {
        Ok(p) => p,
        Err(_) => {
            assert!(RcRepr::parse_bytes(data).is_err());
            return;
        }
    };
    let op = pkt.opcode();
    assert_eq!(pkt.len(), data.len());
    assert_eq!(pkt.header_len(), op.header_len());
    assert!(pkt.pad_count() <= 3);
    assert_eq!(
        pkt.header_len() + pkt.payload_len() + usize::from(pkt.pad_count()),
        data.len()
    );
    assert_eq!(pkt.payload().len(), pkt.payload_len());
    assert_eq!(pkt.reth().is_some(), op.has_reth());
    assert_eq!(pkt.atomic_eth().is_some(), op.has_atomic_eth());
    assert_eq!(pkt.aeth().is_some(), op.has_aeth());
    assert_eq!(pkt.atomic_ack_eth().is_some(), op.has_atomic_ack_eth());
    assert_eq!(pkt.immdt().is_some(), op.has_immdt());
    assert_eq!(pkt.ieth().is_some(), op.has_ieth());
    if let Some(r) = pkt.reth() {
        let _ = (r.va(), r.rkey(), r.dma_len());
    }
    if let Some(a) = pkt.atomic_eth() {
        let _ = (a.va(), a.rkey(), a.swap_add(), a.compare());
    }
    if let Some(a) = pkt.aeth() {
        let _ = (a.syndrome_raw(), a.syndrome(), a.msn());
    }
    if let Some(a) = pkt.atomic_ack_eth() {
        let _ = a.orig_data();
    }
    if let Some(i) = pkt.immdt() {
        let _ = i.imm();
    }
    if let Some(i) = pkt.ieth() {
        let _ = i.rkey();
    }

    let parsed = RcRepr::parse(&pkt);
    assert_eq!(parsed, RcRepr::parse_bytes(data));
    let Ok(repr) = parsed else {
        // Only header contents can fail past `new_checked`: the AETH syndrome.
        assert!(pkt.aeth().is_some_and(|a| a.syndrome().is_err()));
        return;
    };
    let _ = repr.to_string();
    assert_eq!(repr.payload, pkt.payload());
    assert_eq!(repr.bth.pad_count, pad_for(repr.payload.len()));
    assert_eq!(repr.buffer_len(), data.len());
    assert_eq!(repr.check(repr.payload.len()), Ok(()));

    // Emit it all back: same length, equal on re-parse, same bytes but for reserved bits
    // and pad contents.
    let mut out = vec![0xEE; data.len()];
    assert_eq!(repr.emit_with_payload(&mut out), Ok(data.len()));
    assert_eq!(RcRepr::parse_bytes(&out), Ok(repr));
    let mut masked = data.to_vec();
    masked[4] &= 0xC0; // FECN, BECN; Resv6 cleared on emit
    masked[8] &= 0x80; // AckReq; Resv7 cleared on emit
    let pad_at = data.len() - usize::from(repr.bth.pad_count);
    masked[pad_at..].fill(0);
    assert_eq!(out, masked, "re-emitted packet differs from its source");

    // Headers only, into a buffer just big enough; then a buffer one byte short.
    let hlen = repr.header_len();
    let mut hdr = vec![0u8; hlen];
    assert_eq!(repr.emit(&mut hdr, repr.payload.len()), Ok(hlen));
    assert_eq!(&hdr[..], &out[..hlen]);
    let mut short = vec![0u8; hlen - 1];
    assert!(repr.emit(&mut short, repr.payload.len()).is_err());
    assert!(short.iter().all(|&b| b == 0), "a failed emit wrote");

    // The setters cannot change the layout.
    let mut copy = data.to_vec();
    let mut m = RcPacket::new_checked(&mut copy[..]).unwrap();
    m.set_psn(!repr.bth.psn);
    m.set_ack_req(!repr.bth.ack_req);
    m.set_solicited(!repr.bth.solicited);
    m.set_migreq(!repr.bth.migreq);
    m.set_fecn(!repr.bth.fecn);
    m.set_becn(!repr.bth.becn);
    m.set_pkey(!repr.bth.pkey);
    m.set_dest_qpn(!repr.bth.dest_qpn);
    if let Some(mut r) = m.reth_mut() {
        r.set_dma_len(!r.dma_len());
    }
    if let Some(mut a) = m.aeth_mut() {
        a.set_msn(!a.msn());
    }
    if let Some(mut i) = m.immdt_mut() {
        i.set_imm(!i.imm());
    }
    m.payload_mut().iter_mut().for_each(|b| *b = !*b);
    let again = RcPacket::new_checked(&copy[..]).expect("setters broke the layout");
    assert_eq!(again.opcode(), op);
    assert_eq!(again.payload_len(), repr.payload.len());
    let r2 = RcRepr::parse(&again).expect("setters broke the contents");
    assert_eq!(r2.bth.psn, !repr.bth.psn & PSN_MASK);
    assert_eq!(r2.bth.dest_qpn, !repr.bth.dest_qpn & QPN_MASK);
}

/// Headers now, payload later: `parse_split` at every boundary agrees with the
/// whole-packet parse.
fn split_packet(data: &[u8]) {
    let whole = RcRepr::parse_bytes(data);
    for k in 0..=data.len().min(80) {
        let split = RcRepr::parse_split(&data[..k], data.len() - k);
        match (&whole, &split) {
            (Ok(w), Ok((s, plen))) => {
                assert_eq!(k, w.header_len(), "split accepted a wrong boundary");
                assert_eq!(*plen, w.payload.len());
                assert_eq!(
                    RcRepr {
                        payload: w.payload,
                        ..*s
                    },
                    *w
                );
            }
            (Ok(w), Err(_)) => assert_ne!(k, w.header_len(), "split refused a good packet"),
            (Err(_), Ok(_)) => panic!("split accepted a packet the whole parse refuses"),
            (Err(_), Err(_)) => {}
        }
    }
    // An arbitrary remaining length, huge ones included.
    if data.len() > 8 {
        let rest = u64::from_le_bytes(data[data.len() - 8..].try_into().unwrap()) as usize;
        if let Ok((r, plen)) = RcRepr::parse_split(&data[..data.len() - 8], rest) {
            assert!(plen <= rest);
            assert_eq!(plen + usize::from(r.bth.pad_count), rest);
            assert!(r.payload.is_empty());
        }
    }
}

/// The same bytes read as a representation to emit: either a clean error with nothing
/// written, or a packet that parses back to it.
fn emit_arbitrary(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(spec) = ReprSpec::arbitrary(&mut u) else {
        return;
    };
    let Some(op) = Opcode::ALL.get(usize::from(spec.op) % (Opcode::ALL.len() + 1)) else {
        return;
    };
    let syndrome = match Syndrome::from_byte(spec.syndrome) {
        Ok(s) => s,
        Err(_) => Syndrome::Ack {
            credits: Credits::UNLIMITED,
        },
    };
    let payload = &spec.payload[..];
    let mut repr = RcRepr::new(BthRepr {
        opcode: *op,
        solicited: spec.flags & 1 != 0,
        migreq: spec.flags & 2 != 0,
        pad_count: spec.pad,
        pkey: spec.pkey,
        fecn: spec.flags & 4 != 0,
        becn: spec.flags & 8 != 0,
        dest_qpn: spec.qpn,
        ack_req: spec.flags & 16 != 0,
        psn: spec.psn,
    });
    // Headers as the opcode calls for them, unless the spec flips one on or off.
    let want = |k: HeaderKind, i: u32| k.present_in(*op) != (spec.flip >> i & 1 != 0);
    repr.reth = want(HeaderKind::Reth, 0).then_some(RethRepr {
        va: spec.a,
        rkey: spec.rkey,
        dma_len: spec.len,
    });
    repr.atomic_eth = want(HeaderKind::AtomicEth, 1).then_some(AtomicEthRepr {
        va: spec.a,
        rkey: spec.rkey,
        swap_add: spec.b,
        compare: spec.c,
    });
    repr.aeth = want(HeaderKind::Aeth, 2).then_some(AethRepr {
        syndrome,
        msn: spec.msn,
    });
    repr.atomic_ack_eth =
        want(HeaderKind::AtomicAckEth, 3).then_some(AtomicAckEthRepr { orig_data: spec.b });
    repr.immdt = want(HeaderKind::ImmDt, 4).then_some(ImmDtRepr { imm: spec.len });
    repr.ieth = want(HeaderKind::Ieth, 5).then_some(IethRepr { rkey: spec.rkey });
    repr.payload = payload;

    let need = repr.buffer_len();
    let room = (need + usize::from(spec.room)).saturating_sub(8);
    let mut buf = vec![0x5Au8; room];
    match repr.emit_with_payload(&mut buf) {
        Ok(n) => {
            assert_eq!(n, need);
            let mut back = repr;
            back.bth.pad_count = pad_for(payload.len());
            assert_eq!(RcRepr::parse_bytes(&buf[..n]), Ok(back));
            assert_eq!(repr.check(payload.len()), Ok(()));
        }
        Err(_) => assert!(buf.iter().all(|&b| b == 0x5A), "a failed emit wrote"),
    }
}

#[derive(Arbitrary, Debug)]
struct ReprSpec {
    op: u8,
    flags: u8,
    pad: u8,
    pkey: u16,
    qpn: u32,
    psn: u32,
    flip: u8,
    a: u64,
    b: u64,
    c: u64,
    rkey: u32,
    len: u32,
    syndrome: u8,
    msn: u32,
    room: u8,
    payload: Vec<u8>,
}
