//! The headers requests, responses and acknowledgements carry on the wire.

use rdmx_wire::psn_add;

use super::util::*;
use crate::wr::{SendOp, WcStatus};

#[test]
fn headers_on_the_wire() {
    let mut p = Pair::new();
    let len = 3 * 256 - 10;
    let src = p.a.mem.register(2 * len as u64, ALL);
    let dst = p.b.mem.register(2 * len as u64, ALL);
    p.b.recv(1, vec![dst.sge(0, len as u32)]).unwrap();
    p.a.post(wr(
        1,
        SendOp::Write(dst.remote(4)),
        vec![src.sge(0, len as u32)],
    ))
    .unwrap();
    p.a.post(wr(
        2,
        SendOp::Read(dst.remote(8)),
        vec![src.sge(0, len as u32)],
    ))
    .unwrap();
    p.a.post(wr(3, SendOp::Send, vec![src.sge(0, len as u32)]))
        .unwrap();
    p.drive();
    assert_eq!(p.a.send_cq.len(), 3);

    let reqs: Vec<&Pkt> = p.ab.sent().collect();
    assert!(reqs.iter().all(|x| x.is_request()));
    // WRITE: 3 packets, the RETH (address, rkey, whole length) on the first only.
    let write: Vec<&&Pkt> = reqs.iter().filter(|x| x.is_write()).collect();
    assert_eq!(write.len(), 3);
    let reth = write[0].reth.unwrap();
    assert_eq!(
        (reth.va, reth.rkey, reth.dma_len),
        (dst.addr + 4, dst.rkey, len as u32)
    );
    assert!(write[1].reth.is_none() && write[2].reth.is_none());
    // The READ request: one packet with a RETH, taking 3 PSNs.
    let read = reqs.iter().find(|x| x.is_read_request()).unwrap();
    assert_eq!(read.reth.unwrap().dma_len, len as u32);
    let send_first = reqs.iter().find(|x| x.is_send()).unwrap();
    assert_eq!(send_first.psn, psn_add(read.psn, 3));
    // PSNs are consecutive; only the last packet of each message asks for an ACK.
    for (k, x) in reqs.iter().enumerate() {
        assert_eq!(x.psn, a_psn(&p, k as u32 + if k >= 4 { 2 } else { 0 }));
        assert_eq!(x.ack_req, x.ends(), "packet {k}: {:?}", x.op);
        assert!(x.len <= 256);
    }
    assert_eq!(reqs.iter().filter(|x| x.starts()).count(), 3);

    // Responses: READ response FIRST and LAST carry an AETH, MIDDLE none; the MSN counts
    // completed messages (WRITE 1, READ 2, SEND 3).
    let resp: Vec<&Pkt> = p.ba.sent().collect();
    let rr: Vec<&&Pkt> = resp.iter().filter(|x| x.is_read_response()).collect();
    assert_eq!(rr.len(), 3);
    assert!(rr[0].starts() && rr[2].ends());
    assert_eq!(
        rr.iter().map(|x| x.msn).collect::<Vec<_>>(),
        vec![Some(2), None, Some(2)]
    );
    let acks: Vec<(u32, Option<u32>)> = resp
        .iter()
        .filter(|x| x.is_ack())
        .map(|x| (x.psn, x.msn))
        .collect();
    assert_eq!(acks, vec![(a_psn(&p, 2), Some(1)), (a_psn(&p, 8), Some(3))]);
}

/// A message spanning more than a quarter of the PSN space at the path MTU (a READ of
/// 1 GiB + 256 bytes at 256 bytes) completes with LOC_LEN_ERR when posted: the PSNs of
/// the requests after it would not compare with its own.
#[test]
fn a_message_over_a_quarter_of_the_psn_space_is_a_length_error() {
    let mut p = Pair::new();
    let big = (u64::from(crate::rc::MAX_MESSAGE_PACKETS) * 256) as u32;
    // Registered only: the post refuses the request before any byte is touched.
    let local =
        p.a.mem
            .register_at(super::mem::PD, 1 << 40, u64::from(big) + 256, ALL);
    let remote = p.b.mem.register(8, ALL);
    p.a.post(wr(
        1,
        SendOp::Read(remote.remote(0)),
        vec![local.sge(0, big + 256)],
    ))
    .unwrap();
    p.drive();
    assert_eq!(p.a.sends(), vec![(1, WcStatus::LocLenErr)]);
    assert_eq!(p.ab.sent().count(), 0, "nothing sent");
}
