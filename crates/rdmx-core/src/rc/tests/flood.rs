//! A peer that sends requests and never takes the answers: the responder's queue of
//! answers stays bounded, and each packet costs the same however long the flood lasts.
//!
//! The harness holds B's transmissions (`hold`: a socket that is never read), and the
//! "peer" feeds B's QP forged packets directly, as a hostile requester would.

use rdmx_wire::{psn_add, AtomicEthRepr, RethRepr};

use super::util::*;
use crate::qp::QpState;
use crate::rc::codec::{self, Opcode, RcRepr};

/// Answers B may hold: twice its responder resources and the slack the engine allows.
fn bound(p: &Pair) -> usize {
    2 * usize::from(p.cfg.max_dest_rd_atomic) + 64
}

fn packet(op: Opcode, psn: u32, f: impl FnOnce(&mut RcRepr<'static>)) -> Vec<u8> {
    let mut h = codec::header(op, QPN_B, psn);
    h.bth.ack_req = true;
    f(&mut h);
    let mut out = Vec::new();
    let payload = if op == Opcode::RdmaWriteOnly {
        &[7u8; 8][..]
    } else {
        &[]
    };
    codec::encode(&h, payload, &mut out);
    out
}

/// B's answers, taken now that the transport accepts them.
fn drain(p: &mut Pair) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    while let Some(x) = p.b.qp.poll_transmit(p.now, &p.b.mem) {
        out.push(x);
    }
    out
}

#[test]
fn duplicate_reads_and_writes_from_a_peer_that_never_reads() {
    let mut p = Pair::new();
    let region = p.b.mem.register(4096, ALL);
    p.b.hold = true;
    let e = p.cfg.sq_psn_a;
    // A READ of the whole region (16 response packets at the default MTU), then its
    // duplicate and a duplicate WRITE, over and over: each duplicate READ is answered
    // again, and each duplicate WRITE asks for an ACK between them.
    let read = packet(Opcode::RdmaReadRequest, e, |h| {
        h.reth = Some(RethRepr {
            va: region.addr,
            rkey: region.rkey,
            dma_len: 4096,
        })
    });
    let dup_write = packet(Opcode::RdmaWriteOnly, psn_add(e, 0xff_ffff), |h| {
        h.reth = Some(RethRepr {
            va: region.addr,
            rkey: region.rkey,
            dma_len: 8,
        })
    });
    for _ in 0..20_000 {
        p.b.qp.handle_packet(p.now, &p.b.mem, &read);
        p.b.qp.handle_packet(p.now, &p.b.mem, &dup_write);
        assert!(
            p.b.qp.resp.queued() <= bound(&p),
            "{} answers queued",
            p.b.qp.resp.queued()
        );
    }
    assert_eq!(p.b.qp.state(), QpState::Rts);
    let answers = drain(&mut p);
    assert!(!answers.is_empty() && p.b.qp.resp.queued() == 0);
    // The duplicate WRITEs were never placed.
    assert!(p.b.mem.bytes(region.addr, 4096).iter().all(|&b| b == 0));
    // B still answers a new request at the PSN after the READ.
    let next = psn_add(e, 4096 / p.cfg.mtu.bytes());
    let read2 = packet(Opcode::RdmaReadRequest, next, |h| {
        h.reth = Some(RethRepr {
            va: region.addr,
            rkey: region.rkey,
            dma_len: 8,
        })
    });
    p.b.qp.handle_packet(p.now, &p.b.mem, &read2);
    let answers = drain(&mut p);
    let psns: Vec<u32> = answers
        .iter()
        .map(|x| rdmx_wire::RcRepr::parse_bytes(x).expect("parses").bth.psn)
        .collect();
    assert_eq!(psns, vec![next], "one READ response for the new READ");
}

#[test]
fn duplicate_atomics_from_a_peer_that_never_reads() {
    let mut p = Pair::new();
    let target = p.b.mem.register(8, ALL);
    p.b.hold = true;
    let e = p.cfg.sq_psn_a;
    let add = packet(Opcode::FetchAdd, e, |h| {
        h.atomic_eth = Some(AtomicEthRepr {
            va: target.addr,
            rkey: target.rkey,
            swap_add: 1,
            compare: 0,
        })
    });
    // The atomic once, then its duplicate many times: executed once, answered while no
    // answer to it is queued.
    for _ in 0..20_000 {
        p.b.qp.handle_packet(p.now, &p.b.mem, &add);
        assert!(p.b.qp.resp.queued() <= bound(&p));
    }
    assert_eq!(p.b.mem.u64_at(target.addr), 1);
    assert_eq!(p.b.mem.atomics.get(), 1);
    assert_eq!(drain(&mut p).len(), 1, "one ATOMIC ACKNOWLEDGE queued");
    assert_eq!(p.b.qp.state(), QpState::Rts);
}

#[test]
fn new_atomics_beyond_the_responder_resources_are_refused() {
    // A requester keeps at most max_rd_atomic READs and atomics unanswered; a peer that
    // sends more while its answers wait broke the agreement, as with READs.
    let mut p = Pair::new();
    let target = p.b.mem.register(8, ALL);
    p.b.hold = true;
    let e = p.cfg.sq_psn_a;
    let depth = u32::from(p.cfg.max_dest_rd_atomic);
    for i in 0..=depth {
        let add = packet(Opcode::FetchAdd, psn_add(e, i), |h| {
            h.atomic_eth = Some(AtomicEthRepr {
                va: target.addr,
                rkey: target.rkey,
                swap_add: 1,
                compare: 0,
            })
        });
        p.b.qp.handle_packet(p.now, &p.b.mem, &add);
    }
    assert_eq!(p.b.mem.u64_at(target.addr), u64::from(depth));
    assert_eq!(p.b.qp.state(), QpState::Err);
    let answers = drain(&mut p);
    let last = rdmx_wire::RcRepr::parse_bytes(answers.last().expect("answers")).expect("parses");
    assert_eq!(last.bth.psn, psn_add(e, depth));
    assert!(
        matches!(
            last.aeth.map(|a| a.syndrome),
            Some(rdmx_wire::Syndrome::Nak(rdmx_wire::NakCode::InvalidRequest))
        ),
        "{last}"
    );
}

#[test]
fn misaligned_atomics_from_a_peer_are_invalid_requests() {
    // The requester refuses them at post; a peer that sends one anyway gets a NAK
    // (Invalid Request) and nothing in memory changes.
    for (op, off) in [
        (Opcode::FetchAdd, 4u64),
        (Opcode::CompareSwap, 1),
        (Opcode::FetchAdd, 12),
    ] {
        let mut p = Pair::new();
        let target = p.b.mem.register(64, ALL);
        p.b.hold = true;
        let e = p.cfg.sq_psn_a;
        let bad = packet(op, e, |h| {
            h.atomic_eth = Some(AtomicEthRepr {
                va: target.addr + off,
                rkey: target.rkey,
                swap_add: 1,
                compare: 0,
            })
        });
        p.b.qp.handle_packet(p.now, &p.b.mem, &bad);
        assert_eq!(
            p.b.mem.bytes(target.addr, 64),
            vec![0; 64],
            "{op:?} at {off}"
        );
        assert_eq!(p.b.mem.atomics.get(), 0, "{op:?} at {off}");
        let answers = drain(&mut p);
        let last =
            rdmx_wire::RcRepr::parse_bytes(answers.last().expect("answers")).expect("parses");
        assert_eq!(last.bth.psn, e);
        assert!(
            matches!(
                last.aeth.map(|a| a.syndrome),
                Some(rdmx_wire::Syndrome::Nak(rdmx_wire::NakCode::InvalidRequest))
            ),
            "{op:?} at {off}: {last}"
        );
    }
}

#[test]
fn requests_longer_than_the_longest_message_are_invalid() {
    // A READ or WRITE whose RETH claims more than 2^31 bytes (a READ of 2^32 - 1 at an
    // MTU of 256 would span the whole PSN space): a NAK (Invalid Request), nothing read
    // or written, the expected PSN unchanged.
    for op in [Opcode::RdmaReadRequest, Opcode::RdmaWriteFirst] {
        let mut p = Pair::new();
        let region = p.b.mem.register(64, ALL);
        p.b.hold = true;
        let e = p.cfg.sq_psn_a;
        let big = packet(op, e, |h| {
            h.reth = Some(RethRepr {
                va: region.addr,
                rkey: region.rkey,
                dma_len: u32::MAX,
            })
        });
        p.b.qp.handle_packet(p.now, &p.b.mem, &big);
        let answers = drain(&mut p);
        assert_eq!(answers.len(), 1, "{op:?}: one answer");
        let nak = rdmx_wire::RcRepr::parse_bytes(&answers[0]).expect("parses");
        assert_eq!(nak.bth.psn, e);
        assert!(
            matches!(
                nak.aeth.map(|a| a.syndrome),
                Some(rdmx_wire::Syndrome::Nak(rdmx_wire::NakCode::InvalidRequest))
            ),
            "{op:?}: {nak}"
        );
        assert_eq!(p.b.mem.bytes(region.addr, 64), vec![0; 64], "{op:?}");
    }
}

#[test]
fn packets_whose_length_does_not_fit_their_place_at_the_path_mtu_are_invalid() {
    // At a path MTU of 256: FIRST and MIDDLE carry exactly 256 bytes, LAST 1 to 256, ONLY
    // at most 256 (IBTA; rxe checks the same). A packet that breaks this gets a NAK
    // (Invalid Request) at its PSN, the QP goes to ERR, a SEND's receive completes with
    // the error, and nothing of it is placed. Each case: good packets, then the bad one.
    let mtu = 256;
    let cases: [(&[(Opcode, usize)], &str); 8] = [
        (&[(Opcode::SendOnly, mtu + 1)], "SEND ONLY past the MTU"),
        (&[(Opcode::SendFirst, mtu - 4)], "SEND FIRST short"),
        (&[(Opcode::SendFirst, mtu + 16)], "SEND FIRST long"),
        (
            &[(Opcode::SendFirst, mtu), (Opcode::SendMiddle, 100)],
            "SEND MIDDLE short",
        ),
        (
            &[(Opcode::SendFirst, mtu), (Opcode::SendLast, 0)],
            "SEND LAST empty",
        ),
        (
            &[(Opcode::SendFirst, mtu), (Opcode::SendLast, mtu + 1)],
            "SEND LAST past the MTU",
        ),
        (
            &[(Opcode::RdmaWriteOnly, mtu + 1)],
            "WRITE ONLY past the MTU",
        ),
        (&[(Opcode::RdmaWriteFirst, 100)], "WRITE FIRST short"),
    ];
    for (packets, what) in cases {
        let mut p = Pair::new();
        assert_eq!(p.cfg.mtu.bytes() as usize, mtu);
        let region = p.b.mem.register(4096, ALL);
        p.b.recv(7, vec![region.sge(0, 4096)]).unwrap();
        p.b.hold = true;
        let e = p.cfg.sq_psn_a;
        let bad_psn = psn_add(e, packets.len() as u32 - 1);
        for (i, &(op, len)) in packets.iter().enumerate() {
            let mut h = codec::header(op, QPN_B, psn_add(e, i as u32));
            h.bth.ack_req = true;
            if op.is_write() && op.starts_message() {
                h.reth = Some(RethRepr {
                    va: region.addr,
                    rkey: region.rkey,
                    dma_len: 4096,
                });
            }
            let mut out = Vec::new();
            codec::encode(&h, &vec![0xa5; len], &mut out);
            p.b.qp.handle_packet(p.now, &p.b.mem, &out);
        }
        let answers = drain(&mut p);
        let last =
            rdmx_wire::RcRepr::parse_bytes(answers.last().expect("an answer")).expect("parses");
        assert_eq!(last.bth.psn, bad_psn, "{what}");
        assert!(
            matches!(
                last.aeth.map(|a| a.syndrome),
                Some(rdmx_wire::Syndrome::Nak(rdmx_wire::NakCode::InvalidRequest))
            ),
            "{what}: {last}"
        );
        assert_eq!(p.b.qp.state(), QpState::Err, "{what}");
        let recv =
            p.b.qp
                .poll_completion()
                .map(|(_, c, _)| (c.wr_id, c.status));
        let expect = match packets[0].0.is_send() {
            true => crate::wr::WcStatus::RemInvReqErr,
            // The WRITE took no receive: it is flushed with the QP.
            false => crate::wr::WcStatus::WrFlushErr,
        };
        assert_eq!(recv, Some((7, expect)), "{what}");
        // Only the good packets before the bad one were placed.
        let good: usize = packets[..packets.len() - 1].iter().map(|p| p.1).sum();
        let bytes = p.b.mem.bytes(region.addr, 4096);
        assert!(bytes[good..].iter().all(|&b| b == 0), "{what}");
    }
}
