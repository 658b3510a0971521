//! A queue pair's packets through the rings of its segment: the records that arrive,
//! handed to the engine with their payloads placed in registered memory (from the ring,
//! or pulled from the peer's memory for a descriptor), and the engine's packets written
//! as records (headers and payload, or a descriptor of the payload for a peer that
//! pulls).

use std::time::Instant;

use rdmx_core::rc::ACK_LEN;
use rdmx_core::QpState;

use super::{Inner, Outgoing, DIRECT_MIN, OUT_BATCH, PULL_MIN, RX_BUDGET};
use crate::provider::copy::copy;
use crate::shm::desc::{cut, direct_copy, parse_desc, write_u64, MAX_SPANS};
use crate::shm::ring::RingError;
use crate::shm::sys;
use crate::soft;

impl Inner {
    /// Hands incoming records to the engine, placing payloads straight from the ring into
    /// registered memory. Returns how many records were read.
    pub(super) fn receive(&mut self, now: Instant) -> Result<usize, RingError> {
        let Some(conn) = self.conn.as_ref() else {
            return Ok(0);
        };
        let (seg, ring) = (&conn.seg, 1 - conn.side);
        let mut n = 0;
        while n < RX_BUDGET {
            if !matches!(
                self.engine.state(),
                QpState::Rtr | QpState::Rts | QpState::Sqd
            ) {
                // The engine would drop what arrives; leave it in the ring until it can
                // take it (RTR), or until the connection goes.
                if self.engine.state() != QpState::Err {
                    break;
                }
            }
            let Some(rec) = seg.peek(ring, &mut self.cons)? else {
                break;
            };
            if rec.prefix < rdmx_wire::BTH_LEN {
                return Err(RingError::Garbage("a packet shorter than its headers"));
            }
            self.prefix.resize(rec.prefix, 0);
            // SAFETY: `prefix` is a local buffer of `rec.prefix` bytes.
            unsafe { seg.read(ring, &rec, false, 0, self.prefix.as_mut_ptr(), rec.prefix) };
            let h = rdmx_wire::header_len_of(self.prefix[0])
                .ok_or(RingError::Garbage("a packet with an unknown opcode"))?;
            if h > rec.prefix {
                return Err(RingError::Garbage("a packet shorter than its headers"));
            }
            let inline = rec.prefix - h;
            // Payload bytes after the inline part: in the ring, or in the peer's memory.
            let (far, pad) = if rec.desc {
                if !conn.pulls {
                    return Err(RingError::Garbage(
                        "a descriptor on a connection that copies through the ring",
                    ));
                }
                self.desc_bytes.resize(rec.len, 0);
                // SAFETY: `desc_bytes` is a local buffer of `rec.len` bytes.
                unsafe { seg.read(ring, &rec, true, 0, self.desc_bytes.as_mut_ptr(), rec.len) };
                let far = parse_desc(&self.desc_bytes, &mut self.spans, &mut self.span_keys)?;
                // What earlier packets completed goes out now: a failed pull marks only
                // the completions of its own packet.
                soft::route_completions(&mut self.engine, &self.send_cq, &self.recv_cq);
                far
            } else {
                (rec.len, 0)
            };
            let rest = inline + far + pad;
            let mut srq = self.srq.as_ref().map(|s| s.lock());
            let handled = self.engine.handle_header(
                now,
                &*self.keys,
                srq.as_deref_mut(),
                &self.prefix[..h],
                rest,
                &mut self.place,
            );
            drop(srq);
            if handled.is_none() {
                return Err(RingError::Garbage(
                    "malformed or unsupported packet headers",
                ));
            }
            for p in &self.place {
                let (a, b) = (p.offset as usize, p.offset as usize + p.len as usize);
                if b > rest {
                    // What the headers completed did not arrive.
                    self.engine.abort_payload();
                    return Err(RingError::Garbage("a payload beyond its record"));
                }
                // The part of the placement in the prefix (inline payload)...
                if a < inline {
                    let e = b.min(inline);
                    let at = (p.addr as usize).wrapping_sub(p.mr.addr());
                    p.mr.shared()
                        .write_at(at, &self.prefix[h + a..h + e])
                        .expect("the engine places inside resolved regions");
                }
                // ... and the part in the peer's memory (gathered for one pull) ...
                if rec.desc && b > inline {
                    let from = a.max(inline);
                    let e = b.min(inline + far);
                    if e > from {
                        let dst =
                            p.mr.raw_range(p.addr + (from - a) as u64, e - from)
                                .expect("the engine places inside resolved regions");
                        cut(&self.spans, from - inline, e - from, dst, &mut self.pieces);
                    }
                    if b > inline + far {
                        // Pad bytes: zeros.
                        let z = b - (inline + far).max(a);
                        let at = (p.addr as usize).wrapping_sub(p.mr.addr()) + (b - a - z);
                        p.mr.shared()
                            .write_at(at, &[0; 3][..z])
                            .expect("the engine places inside resolved regions");
                    }
                    continue;
                }
                // ... or in the ring.
                if b > inline {
                    let from = a.max(inline);
                    let len = b - from;
                    let dst =
                        p.mr.raw_range(p.addr + (from - a) as u64, len)
                            .expect("the engine places inside resolved regions");
                    // SAFETY: `dst` is registered memory kept alive by the placement's
                    // MrRef, `len` bytes inside its bounds (raw_range checked), and not in
                    // the segment; the range lies in the record's payload (checked above).
                    unsafe { seg.read(ring, &rec, true, from - inline, dst, len) };
                }
            }
            if !self.pieces.is_empty() {
                // The peer's queue pair may go meanwhile, and its memory be used again:
                // the handshake makes it wait for this copy, or this copy not happen.
                let pulled = if seg.copy_begin(conn.side) {
                    // SAFETY: every piece's local range is registered memory the engine
                    // resolved for this packet, kept alive by the placements' MrRefs,
                    // and not in the segment; `cut` made the pieces inside the spans.
                    let pulled = unsafe {
                        match &conn.direct {
                            Some(keys) => direct_copy(
                                keys,
                                &self.spans,
                                &self.span_keys,
                                &self.pieces,
                                &mut self.sources,
                            ),
                            None => sys::pull(conn.peer_pid, &self.pieces),
                        }
                    };
                    seg.copy_done(conn.side);
                    pulled
                } else {
                    Err(std::io::Error::new(
                        std::io::ErrorKind::NotConnected,
                        "the peer's queue pair is gone",
                    ))
                };
                self.pieces.clear();
                if let Err(e) = pulled {
                    // The packet's completions (if any) must not say it arrived.
                    while let Some((side, mut c, solicited)) = self.engine.poll_completion() {
                        c.status = rdmx_core::WcStatus::GeneralErr;
                        let cq = match side {
                            rdmx_core::rc::CqSide::Send => &self.send_cq,
                            rdmx_core::rc::CqSide::Recv => &self.recv_cq,
                        };
                        cq.push(c, solicited);
                    }
                    return Err(RingError::Pull(e.to_string()));
                }
            }
            seg.consume(ring, &mut self.cons, &rec);
            n += 1;
        }
        if n > 0 {
            // The peer may sleep waiting for the room just released.
            self.peer_may_wait();
        }
        Ok(n)
    }

    /// Moves the engine's packets into the outgoing ring until it has none or the ring is
    /// full. Returns whether any was sent.
    ///
    /// Packets go in batches: up to [`OUT_BATCH`] are taken from the engine, then written
    /// to the ring one after the other, and published together
    /// ([`Producer::batch`](crate::shm::ring::Producer::batch)). Taking a packet clones
    /// its regions' references and lets the last ones go, each a locked instruction; one
    /// that follows ring writes waits until the peer's core has given up those lines. In
    /// batches, that wait comes once per batch, not once per packet.
    pub(super) fn send(&mut self, now: Instant) -> Result<bool, RingError> {
        let Some(conn) = self.conn.as_ref() else {
            return Ok(false);
        };
        let ring = conn.side;
        self.prod.batch();
        let sent = self.send_batches(now);
        if let Some(c) = self.conn.as_ref() {
            c.seg.publish(ring, &mut self.prod);
        }
        let sent = sent?;
        if sent && !self.held() {
            // The last packets' regions are let go, as a call that finds nothing would
            // (after the batch is published: each is a locked instruction). A call that
            // sent nothing took nothing: the last one let its packets' regions go.
            for o in &mut self.out {
                o.t.gather.clear();
            }
        }
        if sent {
            self.peer_may_wait();
        }
        Ok(sent)
    }

    fn send_batches(&mut self, now: Instant) -> Result<bool, RingError> {
        let mut sent = false;
        loop {
            if !self.held() {
                // A plain acknowledgement, the packet sent most often, goes as its bytes,
                // with no `Transmit` built and gathered: it is on the way from a
                // request's arrival to its completion, and this way costs about 290
                // fewer instructions (callgrind, `shm_ops send`).
                if let Some(ack) = self.engine.poll_ack() {
                    let conn = self.conn.as_ref().expect("sending on a connection");
                    let pushed = conn.seg.push(
                        conn.side,
                        &mut self.prod,
                        false,
                        ACK_LEN,
                        0,
                        0,
                        |pre, _| {
                            // SAFETY: `push` hands out `ACK_LEN` writable bytes at `pre`,
                            // inside the segment; `ack` is a local array of as many.
                            unsafe { copy(pre, ack.as_ptr(), ACK_LEN) }
                        },
                    )?;
                    if !pushed {
                        // No room: held as any packet is, until there is.
                        if self.out.is_empty() {
                            self.out.push(Outgoing::default());
                        }
                        let o = &mut self.out[0];
                        o.t.header.clear();
                        o.t.header.extend_from_slice(&ack);
                        o.t.gather.clear();
                        o.t.pad = 0;
                        o.owned = None;
                        (self.out_next, self.out_end) = (0, 1);
                        return Ok(sent);
                    }
                    sent = true;
                    continue;
                }
                (self.out_next, self.out_end) = (0, 0);
                // (`may_transmit` asked first: every step that sends a packet would
                // otherwise end with a call that finds nothing, some 120 of the 840
                // instructions a step took.)
                while self.out_end < OUT_BATCH && self.engine.may_transmit() {
                    if self.out.len() == self.out_end {
                        self.out.push(Outgoing::default());
                    }
                    let o = &mut self.out[self.out_end];
                    o.owned = None;
                    if !self.engine.poll_transmit_parts(now, &mut o.t) {
                        break;
                    }
                    self.out_end += 1;
                }
                if self.out_end == 0 {
                    return Ok(sent);
                }
            }
            while self.out_next < self.out_end {
                if !self.push_out(self.out_next)? {
                    if self.engine.config().qp_type == rdmx_core::QpType::Uc {
                        for i in self.out_next..self.out_end {
                            self.own_held(i);
                        }
                    }
                    return Ok(sent);
                }
                self.out_next += 1;
                sent = true;
            }
        }
    }

    /// Writes packet `i` of `out` to the ring. Returns false, writing nothing, when the
    /// ring lacks room.
    fn push_out(&mut self, i: usize) -> Result<bool, RingError> {
        let conn = self.conn.as_ref().expect("sending on a connection");
        let ring = conn.side;
        let Outgoing { t, owned } = &self.out[i];
        let gathered: usize = t.gather.iter().map(|s| s.len as usize).sum();
        let pull_min = if conn.direct.is_some() {
            DIRECT_MIN
        } else {
            PULL_MIN
        };
        if gathered >= pull_min && !self.peer_pulls {
            self.peer_pulls = conn.seg.pulls(1 - conn.side);
        }
        // (Never on UC: its requests complete when sent, and the peer would pull the
        // payload after the application may have written its memory again.)
        let uc = self.engine.config().qp_type == rdmx_core::QpType::Uc;
        if gathered >= pull_min && self.peer_pulls && t.gather.len() <= MAX_SPANS && !uc {
            // A descriptor: the pad length, then each span's address and length.
            let len = 8 + 16 * t.gather.len();
            return conn.seg.push(
                ring,
                &mut self.prod,
                true,
                t.header.len(),
                len,
                0,
                |pre, pay| {
                    // SAFETY: `push` hands out `t.header.len()` writable bytes at `pre`
                    // and `len` at `pay`, inside the segment.
                    unsafe {
                        copy(pre, t.header.as_ptr(), t.header.len());
                        write_u64(pay, u64::from(t.pad));
                        for (i, s) in t.gather.iter().enumerate() {
                            let src =
                                s.mr.raw_range(s.addr, s.len as usize)
                                    .expect("the engine gathers inside resolved regions");
                            write_u64(pay.add(8 + 16 * i), src as usize as u64);
                            let lkey = u64::from(s.mr.lkey()) << 32;
                            write_u64(pay.add(16 + 16 * i), lkey | u64::from(s.len));
                        }
                    }
                },
            );
        }
        let (payload, align) = match owned {
            Some((bytes, from)) => (bytes.len(), *from),
            None => (
                gathered + usize::from(t.pad),
                t.gather.first().map_or(0, |s| s.addr as usize),
            ),
        };
        conn.seg.push(
            ring,
            &mut self.prod,
            false,
            t.header.len(),
            payload,
            align,
            |pre, pay| {
                // SAFETY: `push` hands out `t.header.len()` writable bytes at `pre` and
                // `payload` at `pay`, inside the segment; the sources are the packet's own
                // header buffer, its owned payload of `payload` bytes, or registered memory
                // kept alive by the spans' MrRefs, inside the bounds raw_range checks.
                unsafe {
                    copy(pre, t.header.as_ptr(), t.header.len());
                    if let Some((bytes, _)) = owned {
                        copy(pay, bytes.as_ptr(), bytes.len());
                        return;
                    }
                    let mut at = 0;
                    for s in &t.gather {
                        let src =
                            s.mr.raw_range(s.addr, s.len as usize)
                                .expect("the engine gathers inside resolved regions");
                        copy(pay.add(at), src, s.len as usize);
                        at += s.len as usize;
                    }
                    if t.pad > 0 {
                        std::ptr::write_bytes(pay.add(at), 0, usize::from(t.pad));
                    }
                }
            },
        )
    }

    /// Copies held packet `i`'s payload out of registered memory. On UC the engine
    /// completes a request when it sends its last packet, and its completion goes to the
    /// CQ with this step's: the application may then write the memory again, while the
    /// packet still waits for room in the ring. (RC completes a request only once the
    /// peer acknowledged it, which it cannot before the packet is in the ring.)
    fn own_held(&mut self, i: usize) {
        let o = &mut self.out[i];
        if o.owned.is_some() {
            return;
        }
        let t = &mut o.t;
        let gathered: usize = t.gather.iter().map(|s| s.len as usize).sum();
        let mut bytes = vec![0u8; gathered + usize::from(t.pad)];
        let mut at = 0;
        for s in &t.gather {
            let src =
                s.mr.raw_range(s.addr, s.len as usize)
                    .expect("the engine gathers inside resolved regions");
            // SAFETY: `src` is `s.len` bytes of registered memory kept alive by the
            // span's MrRef (raw_range checked the bounds); `bytes` has room for every
            // span (its length is their sum, and the pad).
            unsafe { copy(bytes.as_mut_ptr().add(at), src, s.len as usize) };
            at += s.len as usize;
        }
        let from = t.gather.first().map_or(0, |s| s.addr as usize);
        // The regions are let go: nothing of the packet is read there any more.
        t.gather.clear();
        o.owned = Some((bytes, from));
    }
}
