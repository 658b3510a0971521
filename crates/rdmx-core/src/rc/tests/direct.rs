//! Requests a transport executes itself (`direct.rs`): which qualify, what the target's
//! engine accepts, the completions, and packets before and after.

use super::util::*;
use crate::access::Access;
use crate::qp::{QpAttr, QpAttrMask, QpState};
use crate::rc::QpType;
use crate::wr::{SendOp, WcOpcode, WcStatus};

/// Executes `req` between the pair's memories the way a transport would: the bytes
/// from A to B (WRITE) or B to A (READ), span by span.
fn run(p: &mut Pair, req: &crate::rc::DirectRequest<TestMr>) {
    let (va, _) = req.remote();
    let mut at = 0u64;
    let spans: Vec<(u64, u32)> = req.local().map(|(_, a, n)| (a, n)).collect();
    for (addr, n) in spans {
        if req.is_read() {
            let bytes = p.b.mem.bytes(va + at, n as usize);
            p.a.mem.fill(addr, &bytes);
        } else {
            let bytes = p.a.mem.bytes(addr, n as usize);
            p.b.mem.fill(va + at, &bytes);
        }
        at += u64::from(n);
    }
}

#[test]
fn writes_and_reads_run_directly_and_packets_continue_after_them() {
    let mut p = Pair::new();
    let src = p.a.mem.register(5000, ALL);
    let back = p.a.mem.register(5000, ALL);
    let dst = p.b.mem.register(5000, ALL);
    let data = pattern(3, 5000);
    p.a.mem.fill(src.addr, &data);
    let write = wr(
        1,
        SendOp::Write(dst.remote(0)),
        split_sges(&src, 0, 3000, 3),
    );
    let req =
        p.a.qp
            .direct_request(&p.a.mem, &write, None)
            .expect("a WRITE");
    assert!(!req.is_read());
    assert_eq!(req.len(), 3000);
    assert!(p.b.qp.direct_target(&p.b.mem, &req, QpType::Rc).is_some());
    run(&mut p, &req);
    p.a.qp.direct_complete(req);
    let read = wr_unsignaled(2, SendOp::Read(dst.remote(0)), vec![back.sge(0, 3000)]);
    let req =
        p.a.qp
            .direct_request(&p.a.mem, &read, None)
            .expect("a READ");
    assert!(p.b.qp.direct_target(&p.b.mem, &req, QpType::Rc).is_some());
    run(&mut p, &req);
    p.a.qp.direct_complete(req);
    // Packets after: the PSNs on both sides are where they were.
    p.a.post(wr(
        3,
        SendOp::Write(dst.remote(3000)),
        vec![src.sge(3000, 2000)],
    ))
    .unwrap();
    p.drive();
    assert_eq!(
        p.a.sends(),
        vec![(1, WcStatus::Success), (3, WcStatus::Success)]
    );
    assert_eq!(p.a.send_cq[0].c.opcode, WcOpcode::RdmaWrite);
    assert_eq!(p.a.send_cq[0].c.byte_len, 3000);
    assert_eq!(p.b.mem.bytes(dst.addr, 5000), data);
    assert_eq!(p.a.mem.bytes(back.addr, 3000), data[..3000]);
    assert!(p.b.recv_cq.is_empty() && p.b.send_cq.is_empty());
    assert_eq!(
        (p.a.qp.state(), p.b.qp.state()),
        (QpState::Rts, QpState::Rts)
    );
}

#[test]
fn only_writes_and_reads_on_an_empty_send_queue_qualify() {
    let mut p = Pair::new();
    let src = p.a.mem.register(4096, ALL);
    let dst = p.b.mem.register(4096, ALL);
    let r = dst.remote(0);
    let not = [
        wr(1, SendOp::Send, vec![src.sge(0, 64)]),
        wr(1, SendOp::WriteWithImm(r, 7), vec![src.sge(0, 64)]),
        wr(
            1,
            SendOp::FetchAdd { remote: r, add: 1 },
            vec![src.sge(0, 8)],
        ),
        wr(1, SendOp::Write(r), vec![]),
        wr(1, SendOp::Write(r), vec![src.sge(4000, 200)]),
        wr(1, SendOp::Read(r), vec![src.sge(0, 0)]),
    ];
    for w in &not {
        assert!(p.a.qp.direct_request(&p.a.mem, w, None).is_none(), "{w:?}");
    }
    // A request on the queue: nothing may overtake it.
    p.a.post(wr(9, SendOp::Send, vec![src.sge(0, 64)])).unwrap();
    let w = wr(1, SendOp::Write(r), vec![src.sge(0, 64)]);
    assert!(p.a.qp.direct_request(&p.a.mem, &w, None).is_none());
    let inbox = p.b.mem.register(64, ALL);
    p.b.recv(1, vec![inbox.sge(0, 64)]).unwrap();
    p.drive();
    assert_eq!(p.a.sends(), vec![(9, WcStatus::Success)]);
    assert!(p.a.qp.direct_request(&p.a.mem, &w, None).is_some());
}

#[test]
fn the_target_refuses_what_its_responder_would() {
    for case in 0..5 {
        let mut p = Pair::new();
        let src = p.a.mem.register(4096, ALL);
        let dst = p.b.mem.register(4096, ALL);
        let no_write =
            p.b.mem
                .register(4096, Access::LOCAL_WRITE | Access::REMOTE_READ);
        let mut stale = dst.remote(0);
        stale.rkey ^= 0x100;
        let op = match case {
            0 => SendOp::Write(stale),
            1 => SendOp::Write(dst.remote(1)),
            2 => SendOp::Write(no_write.remote(0)),
            _ => SendOp::Read(dst.remote(0)),
        };
        match case {
            3 => {
                let attr = QpAttr {
                    qp_access_flags: Access::REMOTE_WRITE,
                    ..QpAttr::default()
                };
                p.b.qp.modify(&attr, QpAttrMask::ACCESS_FLAGS).unwrap();
            }
            4 => {
                let attr = QpAttr {
                    qp_state: QpState::Err,
                    ..QpAttr::default()
                };
                p.b.qp.modify(&attr, QpAttrMask::STATE).unwrap();
            }
            _ => {}
        }
        let w = wr(1, op, vec![src.sge(0, 4096)]);
        let req = p.a.qp.direct_request(&p.a.mem, &w, None).unwrap();
        assert!(
            p.b.qp.direct_target(&p.b.mem, &req, QpType::Rc).is_none(),
            "case {case}"
        );
        assert!(p.b.qp.direct_target(&p.b.mem, &req, QpType::Uc).is_none());
    }
}
