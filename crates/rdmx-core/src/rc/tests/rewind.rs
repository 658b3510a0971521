//! Answers that arrive after the requester has already rewound and sent again, on an
//! ordered link (as TCP is): a NAK that no longer describes the responder must not send
//! the requester back over requests the responder has executed.

use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

use super::util::*;
use crate::wr::{SendOp, WcStatus};

/// Atomics posted behind the SEND: more than the responder remembers answers for.
const ATOMICS: u64 = 12;

/// A SEND that meets no receive (RNR NAK), then `ATOMICS` FETCH_ADDs. Every packet B sends
/// after its first RNR NAK is late by `late`, in order, so the RNR NAK arrives on time and
/// whatever B said right after it (a sequence NAK for the FETCH_ADD behind the SEND)
/// arrives after A's RNR wait and its resend.
fn send_then_atomics_with_late_answers(reliable_link: bool, late: Duration) -> Pair {
    let mut p = Pair::with(PairConfig {
        reliable_link,
        ..PairConfig::default()
    });
    let target = p.b.mem.register(64, ALL);
    let local = p.a.mem.register(8 * (ATOMICS + 1), ALL);
    let inbox = p.b.mem.register(64, ALL);
    let rnr_seen = Rc::new(Cell::new(false));
    let seen = rnr_seen.clone();
    p.ba.set_filter(move |pkt| {
        if seen.get() {
            return Some(Fate::Delay(late));
        }
        seen.set(pkt.is_rnr_nak());
        None
    });
    p.a.post(wr(0, SendOp::Send, vec![local.sge(0, 8)]))
        .unwrap();
    for i in 1..=ATOMICS {
        p.a.post(wr(
            i,
            SendOp::FetchAdd {
                remote: target.remote(0),
                add: 1,
            },
            vec![local.sge(8 * i, 8)],
        ))
        .unwrap();
    }
    p.drive_until(|p| p.ba.sent().any(|x| x.is_rnr_nak()));
    p.b.recv(7, vec![inbox.sge(0, 64)]).unwrap();
    p.drive();
    let want: Vec<_> = (0..=ATOMICS).map(|i| (i, WcStatus::Success)).collect();
    assert_eq!(p.a.sends(), want, "{}", p.trace());
    assert_eq!(p.b.mem.u64_at(target.addr), ATOMICS, "{}", p.trace());
    for i in 1..=ATOMICS {
        assert_eq!(p.a.mem.u64_at(local.addr + 8 * i), i - 1, "{}", p.trace());
    }
    p
}

#[test]
fn a_sequence_nak_behind_an_rnr_nak_does_not_rewind_an_executed_atomic() {
    for reliable_link in [false, true] {
        for late in [20, 40, 80, 160, 320] {
            let p = send_then_atomics_with_late_answers(reliable_link, Duration::from_micros(late));
            // A duplicate atomic gets its saved answer again: one answer each means no
            // atomic reached the responder twice.
            let answers = p.ba.sent().filter(|x| x.atomic_orig.is_some()).count() as u64;
            assert_eq!(
                answers,
                ATOMICS,
                "late {late} µs: one answer per atomic\n{}",
                p.trace()
            );
        }
    }
}
