//! Request packets, by kind: checked against the expected PSN, then executed (a SEND
//! scattered into a receive, a WRITE placed, a READ answered, an atomic executed once) or
//! answered as a duplicate, an error or an RNR NAK; the answers join the responder's
//! queue ([`Responder`](super::Responder)).

use rdmx_wire::{psn_add, psn_diff, AtomicAckEthRepr, AtomicEthRepr, RethRepr};

use super::{Answer, Filling, Placing, ReadJob, Replay};
use crate::access::Access;
use crate::mr::KeyUse;
use crate::qp::QpAttr;
use crate::rc::codec::{self, NakCode, Opcode, RcRepr, Syndrome};
use crate::rc::io::Payload;
use crate::rc::{for_each_span, packets_of, psn_offset, CqSide, MemAccess, RcQp, RecvWqe, Srq};
use crate::wr::{Completion, WcOpcode, WcStatus};

/// Handles a request packet from the peer's requester.
pub(crate) fn handle_request<M: MemAccess>(
    qp: &mut RcQp<M>,
    mem: &M,
    srq: Option<&mut Srq<M::Mr>>,
    hdr: &RcRepr<'_>,
    payload: &mut Payload<'_, M::Mr>,
) {
    let attrs = qp.sm.attrs().clone();
    if qp.resp.full(&attrs) {
        return;
    }
    let credits = qp.credits();
    let d = psn_diff(hdr.bth.psn, qp.resp.epsn);
    if d > 0 {
        if !qp.resp.nak_sent {
            qp.resp.nak_sent = true;
            let epsn = qp.resp.epsn;
            qp.resp.nak(
                &attrs,
                credits,
                epsn,
                Syndrome::Nak(NakCode::PsnSequenceError),
            );
        }
        return;
    }
    if d < 0 {
        duplicate(qp, mem, &attrs, hdr, credits);
        return;
    }
    qp.resp.nak_sent = false;
    let op = hdr.bth.opcode;
    if op.is_send() {
        send(qp, mem, srq, &attrs, hdr, payload);
    } else if op.is_write() {
        write(qp, mem, srq, &attrs, hdr, payload);
    } else if op.is_read_request() {
        read(qp, mem, &attrs, hdr, credits, None);
    } else if op.is_atomic() {
        atomic(qp, mem, &attrs, hdr, credits);
    }
}

fn duplicate<M: MemAccess>(
    qp: &mut RcQp<M>,
    mem: &M,
    attrs: &QpAttr,
    hdr: &RcRepr<'_>,
    credits: Option<u32>,
) {
    let psn = hdr.bth.psn;
    match hdr.bth.opcode {
        Opcode::RdmaReadRequest => {
            // The READ asked again, from its start or (the responses before taken) from
            // one of its response PSNs: answered again from there, within what it was.
            let epsn = qp.resp.epsn;
            let first = qp.resp.replay.iter().rev().find_map(|r| match *r {
                Replay::Read { psn: p, packets } if psn_diff(p, epsn) < 0 => {
                    psn_offset(psn, p, packets).map(|skip| (p, packets, skip))
                }
                _ => None,
            });
            if let Some(original) = first {
                read(qp, mem, attrs, hdr, credits, Some(original));
            }
        }
        Opcode::CompareSwap | Opcode::FetchAdd => {
            let saved = qp.resp.replay.iter().rev().find_map(|r| match r {
                Replay::Atomic { psn: p, orig } if *p == psn => Some(*orig),
                _ => None,
            });
            // An answer to this atomic still queued goes out in its place, with the same
            // value.
            let queued = qp
                .resp
                .out
                .iter()
                .any(|a| matches!(a, Answer::Atomic { psn: p, .. } if *p == psn));
            if let (Some(orig), false) = (saved, queued) {
                let mut h = codec::header(Opcode::AtomicAcknowledge, attrs.dest_qp_num, psn);
                h.aeth = codec::aeth(codec::ack(credits), qp.resp.msn);
                h.atomic_ack_eth = Some(AtomicAckEthRepr { orig_data: orig });
                let answer = Answer::Atomic {
                    psn,
                    again: true,
                    packet: h,
                };
                qp.resp.push(attrs, credits, answer);
            }
        }
        // SEND and WRITE duplicates: acknowledge everything received so far.
        _ => qp.resp.ack = Some((psn_add(qp.resp.epsn, 0xff_ffff), qp.resp.msn)),
    }
}

/// Ends a request in error on the responder side: answer with the NAK, then move the QP
/// to ERR. These are IBTA's class C responder errors (invalid request, remote access,
/// remote operational): the responder's QP fails too, as on rxe and adapters, rather
/// than waiting at the refused PSN for a requester that has failed.
fn refuse<M: MemAccess>(qp: &mut RcQp<M>, attrs: &QpAttr, psn: u32, nak: NakCode) {
    let credits = qp.credits();
    qp.resp.placing = None;
    qp.resp.nak(attrs, credits, psn, Syndrome::Nak(nak));
    qp.enter_error();
}

/// Answers the request at `psn` with an RNR NAK: no receive is posted for it. The
/// requester goes back to `psn` after its RNR wait, so the packets it sent behind it are
/// dropped without a sequence NAK. Such a NAK would reach the requester after the RNR
/// NAK, possibly after it had sent `psn` again and the responder had executed what
/// follows, and send it back over those requests a second time.
fn rnr_nak<M: MemAccess>(qp: &mut RcQp<M>, attrs: &QpAttr, psn: u32) {
    let credits = qp.credits();
    qp.resp
        .nak(attrs, credits, psn, codec::rnr_nak(attrs.min_rnr_timer));
    qp.resp.nak_sent = true;
}

fn accept<M: MemAccess>(qp: &mut RcQp<M>, hdr: &RcRepr<'_>) {
    let (op, psn) = (hdr.bth.opcode, hdr.bth.psn);
    qp.resp.epsn = psn_add(psn, 1);
    if op.ends_message() {
        qp.resp.msn = (qp.resp.msn + 1) & 0xff_ffff;
    }
    if op.ends_message() || hdr.bth.ack_req {
        qp.resp.ack = Some((psn, qp.resp.msn));
    }
}

/// Takes the next receive, from the SRQ when the QP uses one.
fn take_recv<M: MemAccess>(
    qp: &mut RcQp<M>,
    srq: &mut Option<&mut Srq<M::Mr>>,
) -> Option<RecvWqe<M::Mr>> {
    match srq {
        Some(srq) if qp.cfg.srq => srq.take(),
        _ if qp.cfg.srq => None,
        _ => qp.rq.pop_front(),
    }
}

fn has_recv<M: MemAccess>(qp: &RcQp<M>, srq: &Option<&mut Srq<M::Mr>>) -> bool {
    match srq {
        Some(srq) if qp.cfg.srq => !srq.is_empty(),
        _ if qp.cfg.srq => false,
        _ => !qp.rq.is_empty(),
    }
}

/// Whether a SEND or WRITE packet's payload of `len` bytes has a length its place in
/// its message allows at a path MTU of `mtu` bytes, as IBTA requires and rxe checks: a
/// FIRST or MIDDLE packet carries exactly the MTU, a LAST one 1 byte up to it, an ONLY
/// one at most the MTU. A requester splits a message so; a packet that is not so comes
/// from a peer that broke the protocol (or runs at another path MTU).
pub(crate) fn length_fits(op: Opcode, len: usize, mtu: usize) -> bool {
    match (op.starts_message(), op.ends_message()) {
        (true, true) => len <= mtu,
        (false, true) => (1..=mtu).contains(&len),
        _ => len == mtu,
    }
}

fn send<M: MemAccess>(
    qp: &mut RcQp<M>,
    mem: &M,
    mut srq: Option<&mut Srq<M::Mr>>,
    attrs: &QpAttr,
    hdr: &RcRepr<'_>,
    payload: &mut Payload<'_, M::Mr>,
) {
    if hdr.bth.opcode.starts_message() {
        if qp.resp.filling.is_some() {
            // A new message while one is half-way: the requester broke the protocol.
            refuse(qp, attrs, hdr.bth.psn, NakCode::InvalidRequest);
            return;
        }
        let Some(wqe) = take_recv(qp, &mut srq) else {
            rnr_nak(qp, attrs, hdr.bth.psn);
            return;
        };
        qp.resp.filling = Some(Filling { wqe, off: 0 });
    }
    let Some(f) = qp.resp.filling.as_mut() else {
        refuse(qp, attrs, hdr.bth.psn, NakCode::InvalidRequest);
        return;
    };
    if let Some(err) = f.wqe.error {
        let f = qp.resp.filling.take().expect("just seen");
        complete_recv(qp, &mut srq, f.wqe, err, 0, None, false);
        refuse(qp, attrs, hdr.bth.psn, NakCode::RemoteOperationalError);
        return;
    }
    // Checked once the receive is taken, as rxe does: it completes with the error.
    if !length_fits(
        hdr.bth.opcode,
        payload.len(),
        attrs.path_mtu.bytes() as usize,
    ) {
        let f = qp.resp.filling.take().expect("just seen");
        complete_recv(qp, &mut srq, f.wqe, WcStatus::RemInvReqErr, 0, None, false);
        refuse(qp, attrs, hdr.bth.psn, NakCode::InvalidRequest);
        return;
    }
    if f.off + payload.len() as u64 > f.wqe.len {
        let f = qp.resp.filling.take().expect("just seen");
        complete_recv(qp, &mut srq, f.wqe, WcStatus::LocLenErr, 0, None, false);
        refuse(qp, attrs, hdr.bth.psn, NakCode::InvalidRequest);
        return;
    }
    place(mem, &f.wqe, f.off, payload);
    f.off += payload.len() as u64;
    if hdr.bth.opcode.ends_message() {
        let f = qp.resp.filling.take().expect("just seen");
        let len = f.off as u32;
        complete_recv(
            qp,
            &mut srq,
            f.wqe,
            WcStatus::Success,
            len,
            hdr.immdt.map(|i| i.imm),
            hdr.bth.solicited,
        );
    }
    accept(qp, hdr);
}

fn write<M: MemAccess>(
    qp: &mut RcQp<M>,
    mem: &M,
    mut srq: Option<&mut Srq<M::Mr>>,
    attrs: &QpAttr,
    hdr: &RcRepr<'_>,
    payload: &mut Payload<'_, M::Mr>,
) {
    // Before the rkey, as rxe checks.
    if !length_fits(
        hdr.bth.opcode,
        payload.len(),
        attrs.path_mtu.bytes() as usize,
    ) {
        refuse(qp, attrs, hdr.bth.psn, NakCode::InvalidRequest);
        return;
    }
    if hdr.bth.opcode.starts_message() {
        let Ok((va, len, mr)) = reth_target(qp, mem, attrs, hdr, Access::REMOTE_WRITE) else {
            return;
        };
        qp.resp.placing = Some(Placing {
            mr,
            next: va,
            left: u64::from(len),
            total: len,
        });
    }
    let receive_ready = has_recv(qp, &srq);
    let Some(p) = qp.resp.placing.as_ref() else {
        refuse(qp, attrs, hdr.bth.psn, NakCode::InvalidRequest);
        return;
    };
    if payload.len() as u64 > p.left
        || (hdr.bth.opcode.ends_message() && payload.len() as u64 != p.left)
    {
        refuse(qp, attrs, hdr.bth.psn, NakCode::InvalidRequest);
        return;
    }
    // The receive a WRITE with immediate data consumes (with its last packet), taken
    // before the packet's bytes are placed.
    let imm_recv = if hdr.bth.opcode.has_immdt() {
        let Some(wqe) = receive_ready.then(|| take_recv(qp, &mut srq)).flatten() else {
            // The data may already be in place; the requester resends the message after
            // the RNR wait and it is placed again.
            rnr_nak(qp, attrs, hdr.bth.psn);
            return;
        };
        if let Some(err) = wqe.error {
            // A receive that failed its checks at post fails here, as for a SEND: both
            // QPs go to ERR (it is not completed as a success nor left behind).
            complete_recv(qp, &mut srq, wqe, err, 0, None, false);
            refuse(qp, attrs, hdr.bth.psn, NakCode::RemoteOperationalError);
            return;
        }
        Some(wqe)
    } else {
        None
    };
    let p = qp.resp.placing.as_mut().expect("checked above");
    if let Some(mr) = &p.mr {
        if !payload.is_empty() {
            payload.place(mem, mr, p.next, 0..payload.len());
        }
    }
    p.next += payload.len() as u64;
    p.left -= payload.len() as u64;
    if hdr.bth.opcode.ends_message() {
        // Only the first packet carries the RETH: the length comes from the context.
        let len = p.total;
        qp.resp.placing = None;
        if let Some(wqe) = imm_recv {
            let c = Completion {
                wr_id: wqe.wr_id,
                status: WcStatus::Success,
                opcode: WcOpcode::RecvRdmaWithImm,
                byte_len: len,
                imm_data: hdr.immdt.map(|i| i.imm),
                qp_num: 0,
                src_qp: 0,
                grh: false,
            };
            recycle(qp, &mut srq, wqe);
            qp.complete(CqSide::Recv, c, hdr.bth.solicited);
        }
    }
    accept(qp, hdr);
}

/// Answers a READ request; `again` names the READ a repeated one belongs to (its first
/// PSN, its response packets, and how many of them the request skips).
fn read<M: MemAccess>(
    qp: &mut RcQp<M>,
    mem: &M,
    attrs: &QpAttr,
    hdr: &RcRepr<'_>,
    credits: Option<u32>,
    again: Option<(u32, u32, u32)>,
) {
    let Ok((va, len, mr)) = reth_target(qp, mem, attrs, hdr, Access::REMOTE_READ) else {
        return;
    };
    let mtu = attrs.path_mtu.bytes() as u64;
    let n = packets_of(u64::from(len), mtu).max(1);
    if let Some((first, packets, skip)) = again {
        // Its answer stays within the PSNs of the READ it repeats.
        if u64::from(skip) + n > u64::from(packets) {
            return;
        }
        // A retransmission, never a new use of the responder's resources.
        qp.resp.forget_read(first, packets);
    } else if qp.resp.resources_in_use() >= usize::from(attrs.max_dest_rd_atomic.max(1)) {
        // The responder holds at most max_dest_rd_atomic READs and atomics being
        // answered, as an adapter's responder resources; a requester that exceeds them
        // broke the agreement.
        refuse(qp, attrs, hdr.bth.psn, NakCode::InvalidRequest);
        return;
    }
    let again = again.is_some();
    if !again {
        qp.resp.msn = (qp.resp.msn + 1) & 0xff_ffff;
    }
    let job = ReadJob {
        mr,
        va,
        len: u64::from(len),
        psn: hdr.bth.psn,
        next: 0,
        packets: n,
        mtu,
        dest: attrs.dest_qp_num,
        credits,
        msn: qp.resp.msn,
        again,
    };
    qp.resp.push(attrs, credits, Answer::Read(job));
    if !again {
        qp.resp.epsn = psn_add(hdr.bth.psn, n as u32);
        qp.resp.remember(
            Replay::Read {
                psn: hdr.bth.psn,
                packets: n as u32,
            },
            attrs.max_dest_rd_atomic,
        );
    }
}

fn atomic<M: MemAccess>(
    qp: &mut RcQp<M>,
    mem: &M,
    attrs: &QpAttr,
    hdr: &RcRepr<'_>,
    credits: Option<u32>,
) {
    let Some(AtomicEthRepr {
        va,
        rkey,
        swap_add,
        compare,
    }) = hdr.atomic_eth
    else {
        refuse(qp, attrs, hdr.bth.psn, NakCode::InvalidRequest);
        return;
    };
    if va % 8 != 0 {
        refuse(qp, attrs, hdr.bth.psn, NakCode::InvalidRequest);
        return;
    }
    if qp.resp.resources_in_use() >= usize::from(attrs.max_dest_rd_atomic.max(1)) {
        // As for READs: more atomics unanswered than the responder resources agreed.
        refuse(qp, attrs, hdr.bth.psn, NakCode::InvalidRequest);
        return;
    }
    let Ok(Some(mr)) = remote_target(
        qp,
        mem,
        attrs,
        hdr.bth.psn,
        (rkey, va, 8),
        Access::REMOTE_ATOMIC,
    ) else {
        return;
    };
    let orig = match hdr.bth.opcode {
        Opcode::CompareSwap => mem.compare_swap(&mr, va, compare, swap_add),
        _ => mem.fetch_add(&mr, va, swap_add),
    };
    qp.resp.msn = (qp.resp.msn + 1) & 0xff_ffff;
    qp.resp.epsn = psn_add(hdr.bth.psn, 1);
    qp.resp.remember(
        Replay::Atomic {
            psn: hdr.bth.psn,
            orig,
        },
        attrs.max_dest_rd_atomic,
    );
    let mut h = codec::header(Opcode::AtomicAcknowledge, attrs.dest_qp_num, hdr.bth.psn);
    h.aeth = codec::aeth(codec::ack(credits), qp.resp.msn);
    h.atomic_ack_eth = Some(AtomicAckEthRepr { orig_data: orig });
    let answer = Answer::Atomic {
        psn: hdr.bth.psn,
        again: false,
        packet: h,
    };
    qp.resp.push(attrs, credits, answer);
}

/// The target of a WRITE or READ: its RETH's address and length, and the region
/// [`remote_target`] resolved; answers a NAK (invalid request without a RETH) otherwise.
fn reth_target<M: MemAccess>(
    qp: &mut RcQp<M>,
    mem: &M,
    attrs: &QpAttr,
    hdr: &RcRepr<'_>,
    need: Access,
) -> Result<(u64, u32, Option<M::Mr>), ()> {
    let Some(RethRepr {
        va,
        rkey,
        dma_len: len,
    }) = hdr.reth
    else {
        refuse(qp, attrs, hdr.bth.psn, NakCode::InvalidRequest);
        return Err(());
    };
    if u64::from(len) > crate::wr::MAX_MESSAGE {
        // No requester sends one: a READ of it would span more than half the PSN space.
        refuse(qp, attrs, hdr.bth.psn, NakCode::InvalidRequest);
        return Err(());
    }
    let mr = remote_target(qp, mem, attrs, hdr.bth.psn, (rkey, va, len), need)?;
    Ok((va, len, mr))
}

/// Checks that this QP grants `need` and that `rkey` covers `len` bytes at `va` with it;
/// answers a REMOTE ACCESS NAK otherwise. Zero-length accesses check nothing, as in
/// InfiniBand, and resolve to no region.
fn remote_target<M: MemAccess>(
    qp: &mut RcQp<M>,
    mem: &M,
    attrs: &QpAttr,
    psn: u32,
    (rkey, va, len): (u32, u64, u32),
    need: Access,
) -> Result<Option<M::Mr>, ()> {
    if len == 0 {
        return Ok(None);
    }
    let granted = attrs.qp_access_flags.contains(need);
    match mem.resolve(rkey, KeyUse::Remote, qp.cfg.pd, va, u64::from(len), need) {
        Ok(mr) if granted => Ok(Some(mr)),
        _ => {
            refuse(qp, attrs, psn, NakCode::RemoteAccessError);
            Err(())
        }
    }
}

/// Scatters the payload at byte offset `off` of a receive.
fn place<M: MemAccess>(mem: &M, wqe: &RecvWqe<M::Mr>, off: u64, payload: &mut Payload<'_, M::Mr>) {
    let len = payload.len();
    for_each_span(&wqe.segs, off, len, |s, addr, r| {
        payload.place(mem, &s.mr, addr, r)
    });
}

fn complete_recv<M: MemAccess>(
    qp: &mut RcQp<M>,
    srq: &mut Option<&mut Srq<M::Mr>>,
    wqe: RecvWqe<M::Mr>,
    status: WcStatus,
    byte_len: u32,
    imm: Option<u32>,
    solicited: bool,
) {
    let c = Completion {
        wr_id: wqe.wr_id,
        status,
        opcode: WcOpcode::Recv,
        byte_len,
        imm_data: imm,
        qp_num: 0,
        src_qp: 0,
        grh: false,
    };
    recycle(qp, srq, wqe);
    qp.complete(CqSide::Recv, c, solicited);
}

/// Gives a consumed receive's room back to the queue it was posted to, for the next post.
fn recycle<M: MemAccess>(qp: &mut RcQp<M>, srq: &mut Option<&mut Srq<M::Mr>>, wqe: RecvWqe<M::Mr>) {
    match srq {
        Some(srq) if qp.cfg.srq => srq.spare.put_segs(wqe.segs),
        _ => qp.spare.put_segs(wqe.segs),
    }
}
