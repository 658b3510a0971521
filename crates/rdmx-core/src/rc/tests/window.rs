//! The send window: packets held until acknowledgements arrive, and the retransmission
//! timer of a message still going out or held back.

use std::time::Duration;

use super::util::*;
use crate::wr::{SendOp, WcStatus};

/// Posts WRITE 1 of `packets` packets (at a 256-byte MTU) of `pattern(seed, ..)` from A
/// into a region of B; returns where it lands and its length.
fn post_long_write(p: &mut Pair, packets: usize, seed: u64) -> (u64, usize) {
    let len = packets * 256;
    let src = p.a.mem.register(len as u64, ALL);
    p.a.mem.fill(src.addr, &pattern(seed, len));
    let dst = p.b.mem.register(len as u64, ALL);
    p.a.post(wr(
        1,
        SendOp::Write(dst.remote(0)),
        vec![src.sge(0, len as u32)],
    ))
    .unwrap();
    (dst.addr, len)
}

#[test]
fn a_send_window_holds_packets_until_acknowledgements_arrive() {
    let mut p = Pair::with(PairConfig {
        mtu: crate::Mtu::Mtu256,
        send_window: 8,
        ..PairConfig::default()
    });
    let lat = Duration::from_millis(1);
    p.ab.latency = lat;
    p.ba.latency = lat;
    let (dst, len) = post_long_write(&mut p, 64, 3);
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)]);
    assert_eq!(p.b.mem.bytes(dst, len), pattern(3, len));
    let sent: Vec<_> = p.ab.sent().collect();
    assert_eq!(sent.len(), 64, "each packet once");
    // The first window leaves at once; the next packet waits for an acknowledgement,
    // which takes a round trip.
    let first = sent[0].at;
    assert!(sent[7].at < first + lat, "the first window was held");
    assert!(
        sent[8].at >= first + 2 * lat,
        "a packet beyond the window left early"
    );
    // Acknowledgements are asked for every quarter window, inside the message too.
    assert!(sent[..63].iter().filter(|x| x.ack_req).count() >= 64 / 2 - 1);
}

/// A message longer than the send window, to a peer that stopped answering: its first
/// window goes, the rest waits for acknowledgements that never come, and the
/// retransmission timer still runs out its retries (before, it was disarmed while the
/// message was part-way sent, and the request never completed).
#[test]
fn a_message_held_by_the_send_window_times_out_on_a_dead_link() {
    let mut p = Pair::with(PairConfig {
        mtu: crate::Mtu::Mtu256,
        send_window: 8,
        retry_cnt: 2,
        ..PairConfig::default()
    });
    p.ab.down = true;
    post_long_write(&mut p, 64, 0);
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::RetryExcErr)]);
}

/// A message a slow transport takes out a packet at a time, over many ACK timeouts (a
/// stream without a send window, as tcp and shm are): it completes; the timer does not
/// run while the message is still going out (it did for a moment, and such a message
/// failed with RETRY_EXC_ERR on a healthy link).
#[test]
fn a_message_still_going_out_is_not_timed_out() {
    let mut p = Pair::with(PairConfig {
        mtu: crate::Mtu::Mtu256,
        retry_cnt: 1,
        ..PairConfig::default()
    });
    let timeout = crate::qp::timeout_duration(p.cfg.timeout).unwrap();
    p.a.burst = Some(1);
    p.a.pace = timeout / 2;
    let (dst, len) = post_long_write(&mut p, 32, 4);
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)]);
    assert_eq!(p.b.mem.bytes(dst, len), pattern(4, len));
    assert_eq!(p.ab.sent().count(), 32, "each packet once");
}

/// The same message with the acknowledgements from its 40th packet on lost, three times
/// (the window holds the rest back each time): the timer sends again what went
/// unacknowledged, and every byte lands.
#[test]
fn a_message_held_by_the_send_window_recovers_lost_acknowledgements() {
    let mut p = Pair::with(PairConfig {
        mtu: crate::Mtu::Mtu256,
        send_window: 8,
        ..PairConfig::default()
    });
    let from = rdmx_wire::psn_add(p.cfg.sq_psn_a, 40);
    p.ba.drop_matching(3, move |x| {
        x.is_ack() && rdmx_wire::psn_diff(x.psn, from) >= 0
    });
    let (dst, len) = post_long_write(&mut p, 64, 5);
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)]);
    assert_eq!(p.b.mem.bytes(dst, len), pattern(5, len));
    // Each timeout sends again from the first packet not acknowledged (the 40th), not
    // from the message's start: at most a window's worth each time.
    let sent = p.ab.sent().count();
    assert!(sent <= 64 + 3 * 8, "{sent} packets sent for 64");
}

/// A packet lost in the middle of a long WRITE: the responder NAKs the PSN it expects,
/// and the requester sends again from there, not from the message's start.
#[test]
fn a_sequence_nak_resumes_a_long_message_where_it_broke() {
    let mut p = Pair::with(PairConfig {
        mtu: crate::Mtu::Mtu256,
        ..PairConfig::default()
    });
    let lost = rdmx_wire::psn_add(p.cfg.sq_psn_a, 30);
    p.ab.drop_matching(1, move |x| x.psn == lost);
    let (dst, len) = post_long_write(&mut p, 64, 8);
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::Success)]);
    assert_eq!(p.b.mem.bytes(dst, len), pattern(8, len));
    let sent = p.ab.sent().count();
    assert!(sent <= 64 + (64 - 30), "{sent} packets sent for 64");
}
