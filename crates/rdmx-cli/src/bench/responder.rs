//! The responder: the passive side of every test but the ping-pongs (`write_lat`,
//! `send_lat`, see [`super::lat::pong`]), and the driver of the responder's side of a run.
//!
//! One-sided tests need nothing from the responder's application, as with perftest's
//! server; it polls its CQ (in busy-poll mode that is what moves its side) until the
//! requester's `DONE`, then checks what landed (`--verify`) and answers with its verdict.
//! For `send_bw` it reposts each receive as it completes and checks each message's stamp.

use std::time::{Duration, Instant};

use rdmx::{WcOpcode, WcStatus};

use super::args::{Conn, Op, Params};
use super::connect::Region;
use super::lat;
use super::setup::{
    linger, poll, verdict_for, Abort, BoxError, Role, Side, BYE, CTL, EMPTY, READY, STALL,
    VERDICT_BAD, VERDICT_OK,
};
use super::verify::{check_lossy_slot, check_region, stamp_for, Expect};

/// Runs the responder's side of every size, then returns; an error after a verdict was
/// sent is the responder's own (wrong data, a failed request).
pub(crate) fn drive(
    p: &Params,
    side: &Side,
    remote: &[Region],
    abort: &Abort,
) -> Result<(), BoxError> {
    let mut counters = vec![0u64; side.qps.len()];
    prepare(p, side, p.sizes[0])?;
    side.send_ctl(0, READY)?;
    let mut round = 0u64;
    let mut last_verdict = None;
    for (k, &size) in p.sizes.iter().enumerate() {
        let sizing = Sizing {
            gen: k as u32 % 2,
            last_verdict,
        };
        let checked = if p.test.is_ping_pong() {
            lat::pong(p, size, side, remote, &mut round, sizing, abort)?
        } else {
            serve(p, size, side, &mut counters, sizing, abort)?
        };
        if let Some(&next) = p.sizes.get(k + 1) {
            prepare(p, side, next)?;
        }
        let verdict = if checked.is_ok() {
            VERDICT_OK
        } else {
            // This side's error is the one to report, not the requester's "BAD".
            abort.fail(Role::Responder);
            VERDICT_BAD
        };
        let verdict = verdict_for(verdict, k, p.lossy());
        last_verdict = Some(verdict);
        side.send_ctl(0, verdict)?;
        if let Err(e) = checked {
            linger(side, Duration::from_millis(500), |c| {
                c.wr_id == CTL | u64::from(verdict)
            });
            return Err(e.into());
        }
    }
    // BYE says the requester has the last verdict; then stay a moment so the transport
    // acknowledges BYE before the QPs close.
    let since = Instant::now();
    let mut wc = [EMPTY; 16];
    loop {
        let n = side.cq.poll(&mut wc)?;
        let mut bye = false;
        for c in &wc[..n] {
            // Once BYE is in, the requester may close at any moment and flush the
            // receives still posted here: what follows BYE is no error.
            if c.status == WcStatus::Success && side.ctl_value(c)? == Some(BYE) {
                bye = true;
                break;
            }
            if c.status == WcStatus::Success && c.imm_data.is_some() && p.lossy() {
                // A DONE again: the last verdict was lost on the way.
                side.post_recv(side.qp_index(c.qp_num), c.wr_id)?;
                if let Some(v) = last_verdict {
                    side.send_ctl(0, v)?;
                }
            }
            if c.status != WcStatus::Success {
                return Err(format!(
                    "the peer went away before the run ended ({:?} on QP {:#x})",
                    c.status, c.qp_num
                )
                .into());
            }
        }
        if bye {
            if p.lossy() || !side.ctx.capabilities().remote_error_completions {
                // The requester waits for this before it closes (see say_bye); over UC
                // and UD it sends BYE again until this comes.
                side.send_ctl(0, BYE)?;
            }
            break;
        }
        if since.elapsed() > STALL {
            return Err(format!("the peer did not say goodbye within {STALL:?}").into());
        }
        abort.check()?;
        std::thread::sleep(Duration::from_micros(20));
    }
    linger(side, Duration::from_millis(50), |_| false);
    Ok(())
}

/// Gets the responder's sources ready for `size`-byte messages, before telling the
/// requester it may start.
fn prepare(p: &Params, side: &Side, size: usize) -> Result<(), BoxError> {
    if !p.verify {
        return Ok(());
    }
    match p.test.op() {
        // READ sources: slot j stamped j.
        Op::Read => side.fill_sources(size, true),
        // Over UC, what a WRITE that was dropped placed stays (see `check`): the slots
        // of a bandwidth test start zeroed.
        Op::Write if p.lossy() && !p.test.is_ping_pong() => {
            let zeros = vec![0u8; size];
            for mr in &side.mrs {
                for j in 0..side.layout.dst_slots {
                    mr.write_at(side.layout.dst(j), &zeros)?;
                }
            }
            Ok(())
        }
        // The answers of a ping-pong are stamped per round by lat::pong.
        _ if p.test.is_ping_pong() => side.fill_sources(size, false),
        _ => Ok(()),
    }
}

/// Which size a DONE is for, over UC and UD (which may lose messages, control ones too):
/// the requester sends DONE again until the verdict comes, with the size's generation
/// bit, so a DONE of the previous size is answered with its verdict again, not taken
/// for this size's.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sizing {
    /// This size's generation bit.
    pub(crate) gen: u32,
    /// The verdict of the previous size.
    pub(crate) last_verdict: Option<u32>,
}

impl Sizing {
    /// The count a `DONE` control message `imm` carries, if it is this size's; for one of
    /// the previous size (over UC or UD, `lossy`, sent again before its verdict came),
    /// sends that size's verdict again and returns `None`.
    pub(crate) fn done(&self, side: &Side, lossy: bool, imm: u32) -> Result<Option<u32>, BoxError> {
        if !lossy {
            return Ok(Some(imm));
        }
        if imm >> 31 != self.gen {
            if let Some(v) = self.last_verdict {
                side.send_ctl(0, v)?;
            }
            return Ok(None);
        }
        Ok(Some(imm & 0x7fff_ffff))
    }
}

/// How often a responder over UC or UD sends READY again until the requester is heard.
const READY_AGAIN: Duration = Duration::from_millis(100);

/// READY sent again over UC and UD, where it may be lost: during the first size, every
/// [`READY_AGAIN`] until a message of the requester arrives (the requester lets the
/// copies that come after pass).
pub(crate) struct ReadyAgain(Option<Instant>);

impl ReadyAgain {
    pub(crate) fn new(p: &Params, sizing: &Sizing) -> ReadyAgain {
        ReadyAgain((p.lossy() && sizing.last_verdict.is_none()).then(Instant::now))
    }

    /// A message of the requester arrived: it has READY.
    pub(crate) fn heard(&mut self) {
        self.0 = None;
    }

    /// Sends READY again if it is due.
    pub(crate) fn tick(&mut self, side: &Side) -> Result<(), BoxError> {
        if let Some(at) = self.0 {
            if at.elapsed() >= READY_AGAIN {
                side.send_ctl(0, READY)?;
                self.0 = Some(Instant::now());
            }
        }
        Ok(())
    }
}

/// Serves one size until `DONE` has come on every QP; returns the verdict of the checks.
///
/// Over UC and UD a message may be lost (no receive posted when it came, or a packet of
/// it lost): messages are then checked to arrive whole, each as it completes, and in
/// order, at most as many as were sent; over UD a duplicate or a late datagram is
/// checked whole and not counted.
fn serve(
    p: &Params,
    size: usize,
    side: &Side,
    counters: &mut [u64],
    sizing: Sizing,
    abort: &Abort,
) -> Result<Result<(), String>, BoxError> {
    let lossy = p.lossy();
    let ud = p.conn == Conn::Ud;
    let mut received = vec![0u64; side.qps.len()];
    let l = &side.layout;
    let op = p.test.op();
    let q = side.qps.len();
    let slots = l.dst_slots.max(1);
    let mut counts: Vec<Option<u64>> = vec![None; q];
    let mut got = vec![0u64; q];
    let mut last: Vec<Vec<Option<u64>>> = vec![vec![None; slots]; q];
    let mut bad: Option<String> = None;
    let stamp_len = size.min(8);
    let mut stamp = [0u8; 8];
    let mut buf = Vec::new();
    let mut wc = [EMPTY; 64];
    let mut idle = 0u32;
    let mut armed = false;
    let mut ready = ReadyAgain::new(p, &sizing);
    while counts.iter().any(Option::is_none) {
        let n = poll(&side.cq, &mut wc)?;
        for c in &wc[..n] {
            if !matches!(c.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm) {
                continue; // a verdict's send completion
            }
            ready.heard();
            let i = side.qp_index(c.qp_num);
            if let Some(imm) = side.ctl_value(c)? {
                let Some(n) = sizing.done(side, lossy, imm)? else {
                    side.post_recv(i, c.wr_id)?;
                    continue;
                };
                counts[i] = Some(u64::from(n));
            } else if p.verify && bad.is_none() {
                // A data message: its stamp must be the next sequence number (over UC and
                // UD, a later one: the ones between were lost).
                let slot = c.wr_id as usize % slots;
                side.mrs[i].read_at(l.dst(slot), &mut stamp[..stamp_len])?;
                // The message's number: the next one, or over UC and UD a later one (the
                // ones between were lost); over UD an earlier one is a duplicate or came
                // late (datagrams are neither ordered nor freed of duplicates), checked
                // whole but not counted.
                let (mut number, mut late) = (got[i], false);
                if lossy {
                    let bits = 8 * stamp_len as u32;
                    let mask = if bits == 64 {
                        u64::MAX
                    } else {
                        (1u64 << bits) - 1
                    };
                    let mut raw = [0u8; 8];
                    raw[..stamp_len].copy_from_slice(&stamp[..stamp_len]);
                    let low = (u64::from_le_bytes(raw) ^ stamp_for(0, size)) & mask;
                    let ahead = low.wrapping_sub(got[i]) & mask;
                    if ud && ahead > mask / 2 {
                        late = true;
                        number = got[i].wrapping_sub(got[i].wrapping_sub(low) & mask);
                    } else {
                        number += ahead;
                    }
                }
                let want = stamp_for(number, size).to_le_bytes();
                if c.byte_len as usize != size + l.grh {
                    bad = Some(format!(
                        "--verify: QP {i}: message {number} has {} bytes, expected {size}",
                        c.byte_len as usize - l.grh.min(c.byte_len as usize)
                    ));
                } else if stamp[..stamp_len] != want[..stamp_len] {
                    bad = Some(format!(
                        "--verify: QP {i}: message {number} of {size} bytes carries stamp \
                         {:02x?}, expected {:02x?}",
                        &stamp[..stamp_len],
                        &want[..stamp_len]
                    ));
                }
                if lossy && bad.is_none() {
                    // Checked whole now: once reposted, the buffer may take part of a
                    // later message that is then lost (UC drops a message whose packets
                    // do not all arrive, after placing the ones that did).
                    let e = Expect::pattern(size, size).stamped(stamp_for(number, size));
                    bad = check_region(&side.mrs[i], l.dst(slot), &e, &mut buf, || {
                        format!("QP {i}: message {number} of {size} bytes")
                    })
                    .err();
                } else {
                    last[i][slot] = Some(number);
                }
                if !late {
                    received[i] += 1;
                    got[i] = number + 1;
                }
            } else {
                got[i] += 1;
                received[i] += 1;
            }
            side.post_recv(i, c.wr_id)?;
        }
        if n == 0 {
            ready.tick(side)?;
            idle += 1;
            if idle % 1024 == 0 {
                abort.check()?;
            }
            if op != Op::Send && !side.polls_move_data() {
                // One-sided, and nothing here moves the data: nothing to do but notice
                // DONE. Sleep until a completion (bounded, to look at `abort`), leaving
                // the cores to the transfer, as perftest's passive side does. The CQ is
                // armed, then polled once more before the wait: nothing is missed.
                if !armed {
                    side.cq.req_notify(false);
                    armed = true;
                } else {
                    armed = false;
                    if !side.cq.wait_event(Duration::from_millis(10))? {
                        abort.check()?;
                    }
                }
            } else if side.busy {
                std::hint::spin_loop();
            } else {
                // Receives must be reposted promptly.
                std::thread::yield_now();
            }
        }
    }
    let counts: Vec<u64> = counts.into_iter().map(Option::unwrap_or_default).collect();
    for (i, c) in counts.iter().enumerate() {
        counters[i] += c;
    }
    if !p.verify {
        return Ok(Ok(()));
    }
    if let Some(b) = bad {
        return Ok(Err(b));
    }
    if lossy {
        for (i, (&r, &n)) in received.iter().zip(&counts).enumerate() {
            if r > n {
                return Ok(Err(format!(
                    "--verify: QP {i}: {r} messages arrived, the sender sent {n}"
                )));
            }
        }
        // Lost messages are no error here: the sequence check above saw the rest whole
        // and in order.
        if op == Op::Send {
            return Ok(check(p, size, side, &got, &got, &last, counters));
        }
    }
    Ok(check(p, size, side, &counts, &got, &last, counters))
}

/// What the responder checks once a size is done (`--verify`).
fn check(
    p: &Params,
    size: usize,
    side: &Side,
    counts: &[u64],
    got: &[u64],
    last: &[Vec<Option<u64>>],
    counters: &[u64],
) -> Result<(), String> {
    let l = &side.layout;
    let slots = l.dst_slots.max(1);
    let mut buf = Vec::new();
    for (i, mr) in side.mrs.iter().enumerate() {
        let n = counts[i];
        match p.test.op() {
            Op::Write if p.lossy() => {
                // Slot j took WRITEs j, j + slots, ...; any of them may have been dropped
                // after some of its packets were placed.
                let mtu = side.qps[i].attrs().path_mtu.bytes() as usize;
                for j in 0..slots.min(n as usize) {
                    buf.resize(size, 0);
                    mr.read_at(l.dst(j), &mut buf[..size])
                        .map_err(|e| e.to_string())?;
                    let numbers = (j as u64..n).step_by(slots);
                    check_lossy_slot(&buf[..size], size, mtu, numbers).map_err(|m| {
                        format!("--verify: QP {i}: slot {j} of {size}-byte UC WRITEs: {m}")
                    })?;
                }
            }
            Op::Write => {
                // Slot j holds the last WRITE aimed at it: number j + slots * k.
                for j in 0..slots.min(n as usize) {
                    let s = j as u64 + slots as u64 * ((n - 1 - j as u64) / slots as u64);
                    let e = Expect::pattern(size, size).stamped(stamp_for(s, size));
                    check_region(mr, l.dst(j), &e, &mut buf, || {
                        format!("QP {i}: WRITE {s} of {size} bytes")
                    })?;
                }
            }
            Op::Send => {
                if got[i] as u32 != n as u32 {
                    return Err(format!(
                        "--verify: QP {i}: {} messages arrived, the sender sent {n}",
                        got[i]
                    ));
                }
                for (j, s) in last[i].iter().enumerate() {
                    if let Some(s) = *s {
                        let e = Expect::pattern(size, size).stamped(stamp_for(s, size));
                        check_region(mr, l.dst(j), &e, &mut buf, || {
                            format!("QP {i}: message {s} of {size} bytes")
                        })?;
                    }
                }
            }
            Op::Atomic => {
                let v = mr.load_u64(l.dst(0)).map_err(|e| e.to_string())?;
                if v as u32 != counters[i] as u32 {
                    return Err(format!(
                        "--verify: QP {i}: the counter is {v} after {} FETCH_ADDs of 1",
                        counters[i]
                    ));
                }
            }
            Op::Read => {}
        }
    }
    Ok(())
}
