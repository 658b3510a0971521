//! Latency tests, as perftest runs them: one request outstanding on one QP.
//!
//! - `write_lat`: ping-pong. Each side WRITEs its peer's buffer, whose last byte carries
//!   the round's tag, and spins on the last byte of its own buffer (read through the
//!   region's `byte_becomes`) until the peer's WRITE lands. Half the round trip.
//! - `send_lat`: ping-pong with SEND and RECV. Half the round trip.
//! - `read_lat`, `atomic_lat`: one READ or FETCH_ADD at a time, each timed from the post
//!   to its completion: the whole round trip.
//!
//! The first `n/10` rounds (100 with `-D`) warm up and are not recorded; with `-D` the
//! measured rounds run for that long after them. The recorded rounds are reported as
//! perftest reports them, its two largest left out of the figures ([`LatRecorder`]; the
//! definitions are in [`super::report`]).

use std::time::Instant;

use rdmx::{LocalSge, RemoteAddr, SendRequest, WcOpcode};

use super::args::{Budget, Op, Params};
use super::connect::Region;
use super::report::LatRecorder;
use super::responder::{ReadyAgain, Sizing};
use super::setup::{poll, Abort, BoxError, Layout, Role, Side, CTL, EMPTY, STALL};
use super::verify::{check_region, stamp_for, tag, Expect};

/// What one size measured: the recorder, and the requests issued (warm-up included).
pub(crate) type LatRun = (LatRecorder, u64);

/// Whether round `r` (warm-up included) runs.
fn more(p: &Params, r: u64, warm: u64, t0: &mut Option<Instant>) -> bool {
    if r < warm {
        return true;
    }
    match p.budget {
        Budget::Iters(n) => r < warm + n,
        Budget::Seconds(_) => {
            let start = *t0.get_or_insert_with(Instant::now);
            r == warm || start.elapsed() < p.time_limit().unwrap_or_default()
        }
    }
}

/// The clock that times rounds. Its reads sit inside the time they measure, so they must
/// cost little: with an invariant TSC it reads the time-stamp counter (as perftest's
/// `get_cycles` does), a fifth of a `clock_gettime` in a virtual machine; elsewhere it
/// reads the monotonic clock.
fn round_clock() -> quanta::Clock {
    quanta::Clock::new()
}

/// Polls `side`'s CQ until `step`, handed each batch of completions (maybe none), says
/// the wait is over; fails once the other side of this process fails or nothing ends the
/// wait for [`STALL`] (saying so, then `stall_hint`).
fn spin(
    side: &Side,
    abort: &Abort,
    stall_hint: &str,
    mut step: impl FnMut(&[rdmx::Completion]) -> Result<bool, BoxError>,
) -> Result<(), BoxError> {
    let mut wc = [EMPTY; 8];
    let mut spins = 0u32;
    let mut since = None;
    loop {
        let n = poll(&side.cq, &mut wc)?;
        if step(&wc[..n])? {
            return Ok(());
        }
        spins = spins.wrapping_add(1);
        if spins % 4096 == 0 {
            abort.check()?;
            if since.get_or_insert_with(Instant::now).elapsed() > STALL {
                return Err(format!("the peer did not answer within {STALL:?}{stall_hint}").into());
            }
        }
    }
}

/// What a ping that stalls adds to its error: over UC and UD nothing is sent again, so a
/// lost ping or answer stops the ping-pong (as it stops perftest's).
fn lost_hint(p: &Params) -> &'static str {
    if p.lossy() {
        " (over UC and UD a ping or an answer that is lost is not sent again, and the \
         ping-pong stops)"
    } else {
        ""
    }
}

/// How many times a side waiting for a WRITE reads the last byte of its buffer between
/// two polls of its CQ. perftest's latency tests wait for a WRITE by reading that byte in
/// a tight loop, which is right where the WRITE lands without the target's polls: an
/// adapter places it (verbs), or the initiator copies it (shm's mapped and direct data
/// paths); there a WRITE is seen within nanoseconds of landing rather than a poll later.
/// The reads are [`rdmx::MemoryRegion::byte_becomes`]'s, 256 of which take about 0.1 µs,
/// so the side still polls often (for control messages, and to keep its provider's
/// progress thread aside). Measured on shm's mapped path (`write_lat`, 8 B, two
/// processes, interleaved rounds, medians):
/// - 256 reads through `read_at`, which takes the region's gate for each read (about
///   5.6 µs for the 256): 0.165-0.17 µs against 0.19-0.205 µs with 16 reads, in rounds
///   where a cache line crossed cores fast;
/// - `byte_becomes` against those `read_at` reads: 0.94× and 0.96× (two runs of 10
///   rounds); 4096 reads rather than 256 showed no gain (1.04× the `read_at` reads).
///
/// Where a poll may be what lands it (the other software providers make progress when
/// polled), each poll is followed by one read.
fn last_byte_reads(side: &Side) -> usize {
    let unpolled = match side.ctx.provider() {
        "verbs" => true,
        rdmx::shm::NAME => side
            .qps
            .first()
            .and_then(rdmx::shm::data_path)
            .is_some_and(|p| matches!(p, "mapped" | "direct")),
        _ => false,
    };
    if unpolled {
        256
    } else {
        1
    }
}

/// What a ping-pong message of round `g` holds.
fn message(p: &Params, size: usize, g: u64) -> Expect {
    let e = Expect::pattern(size, size).stamped(stamp_for(g, size));
    if p.test.op() == Op::Write {
        e.tagged(tag(g))
    } else {
        e
    }
}

/// The bytes a ping-pong message of `size` bytes sends inline (perftest's -I), when it is
/// that short: the source's, which [`stamp_source`] then stamps in its place.
fn inline_source(side: &Side, size: usize) -> Result<Option<Vec<u8>>, BoxError> {
    if size > side.inline_size {
        return Ok(None);
    }
    let mut bytes = vec![0; size];
    side.mrs[0].read_at(side.layout.src(0), &mut bytes)?;
    Ok(Some(bytes))
}

/// Writes round `g`'s stamp (and tag) into the source, as far as the run needs it: into
/// the region, or into `inline`, the bytes sent in its place.
fn stamp_source(
    p: &Params,
    side: &Side,
    size: usize,
    g: u64,
    inline: Option<&mut [u8]>,
) -> Result<(), BoxError> {
    let (mr, at) = (&side.mrs[0], side.layout.src(0));
    let e = message(p, size, g);
    let stamp = stamp_for(g, size).to_le_bytes();
    let stamp = &stamp[..e.stamp_len()];
    match inline {
        Some(bytes) => {
            if p.verify {
                bytes[..stamp.len()].copy_from_slice(stamp);
            }
            if let Some(t) = e.tag {
                bytes[size - 1] = t;
            }
        }
        None => {
            if p.verify {
                mr.write_at(at, stamp)?;
            }
            if let Some(t) = e.tag {
                mr.write_at(at + size - 1, &[t])?;
            }
        }
    }
    Ok(())
}

/// Posts round `g`'s message: a WRITE to `to` or a SEND, of the bytes `inline` when it
/// is sent inline, else of the source `src`.
fn post_message(
    side: &Side,
    write: bool,
    g: u64,
    to: RemoteAddr,
    inline: Option<&[u8]>,
    src: LocalSge,
) -> Result<(), BoxError> {
    let req = if write {
        SendRequest::write(g, to)
    } else {
        SendRequest::send(g)
    };
    let req = match inline {
        Some(bytes) => req.inline(bytes),
        None => req.sge(src),
    };
    side.qps[0].post_send(side.route(0, req))?;
    Ok(())
}

/// The pinging side of `write_lat` and `send_lat`; `round` counts rounds across sizes.
pub(crate) fn ping(
    p: &Params,
    size: usize,
    side: &Side,
    remote: &[Region],
    round: &mut u64,
    abort: &Abort,
) -> Result<LatRun, BoxError> {
    let (l, mr) = (&side.layout, &side.mrs[0]);
    let write = p.test.op() == Op::Write;
    let lossy = p.lossy();
    let reads = last_byte_reads(side);
    let src = LocalSge::new(mr, l.src(0), size)?;
    let to = remote[0].at(Layout::new(p, Role::Responder).dst(0));
    if p.verify {
        side.fill_sources(size, false)?;
    }
    let mut inline = inline_source(side, size)?;
    let (warm, mut t0) = (p.warmup(), None);
    let mut rec = LatRecorder::new(true);
    let clock = round_clock();
    let mut buf = Vec::new();
    let mut r = 0;
    while more(p, r, warm, &mut t0) {
        let g = *round;
        let t = clock.raw();
        stamp_source(p, side, size, g, inline.as_deref_mut())?;
        post_message(side, write, g, to, inline.as_deref(), src)?;
        let (mut sent, mut got, mut len) = (false, false, size as u32);
        spin(side, abort, lost_hint(p), |wc| {
            for c in wc {
                match c.opcode {
                    // Over UC and UD, the previous size's verdict sent again (for its
                    // DONE, sent again before the verdict came): nothing to do.
                    WcOpcode::Recv if lossy && side.ctl_value(c)?.is_some() => {
                        side.post_recv(0, c.wr_id)?;
                    }
                    WcOpcode::Recv if side.ctl_value(c)?.is_some() => {
                        return Err("a control message arrived in the middle of a round".into())
                    }
                    WcOpcode::Recv => {
                        (got, len) = (true, c.byte_len);
                        side.post_recv(0, c.wr_id)?;
                    }
                    _ => sent |= c.wr_id == g,
                }
            }
            if write && sent && !got {
                got = mr.byte_becomes(l.dst(0) + size - 1, tag(g), reads)?;
            }
            Ok(sent && got)
        })?;
        let dt = clock.delta(t, clock.raw());
        if r >= warm {
            rec.record(dt);
        }
        if p.verify {
            if len as usize != size + l.grh {
                return Err(
                    format!("--verify: answer {g} has {len} bytes, expected {size}").into(),
                );
            }
            check_region(mr, l.dst(0), &message(p, size, g), &mut buf, || {
                format!("the answer of round {g} ({size} bytes)")
            })?;
        }
        r += 1;
        *round += 1;
    }
    Ok((rec, r))
}

/// The answering side of a ping-pong, for one size: answers every round until `DONE`.
/// Returns the verdict of its checks.
pub(crate) fn pong(
    p: &Params,
    size: usize,
    side: &Side,
    remote: &[Region],
    round: &mut u64,
    sizing: Sizing,
    abort: &Abort,
) -> Result<Result<(), String>, BoxError> {
    let (l, mr) = (&side.layout, &side.mrs[0]);
    let write = p.test.op() == Op::Write;
    let lossy = p.lossy();
    let reads = last_byte_reads(side);
    let src = LocalSge::new(mr, l.src(0), size)?;
    let to = remote[0].at(Layout::new(p, Role::Requester).dst(0));
    let mut bad = None;
    let mut buf = Vec::new();
    let mut answered = 0u64;
    // This side's answers not yet completed. A WRITE can land at the peer before its
    // acknowledgement comes back (the next ping may even overtake it), so an answer
    // waits for the one before it to complete: one request outstanding, as perftest
    // keeps, and the send queue never fills.
    let mut unanswered = 0u32;
    let mut wc = [EMPTY; 8];
    let mut ready = ReadyAgain::new(p, &sizing);
    // (The sources are ready: `responder::prepare` ran for this size.)
    let mut inline = inline_source(side, size)?;
    loop {
        let g = *round;
        let (mut ping, mut done, mut len) = (false, None, size as u32);
        // No stall limit here: the pinging side decides when rounds come.
        let mut spins = 0u32;
        while !ping && done.is_none() {
            let n = poll(&side.cq, &mut wc)?;
            for c in &wc[..n] {
                if c.opcode != WcOpcode::Recv {
                    // (Not a verdict sent again, below: only answers count.)
                    if c.wr_id & CTL == 0 {
                        unanswered = unanswered.saturating_sub(1);
                    }
                } else {
                    ready.heard();
                    let ctl = side.ctl_value(c)?;
                    side.post_recv(0, c.wr_id)?;
                    match ctl {
                        // Over UC and UD, a DONE of the previous size may come again: it
                        // gets that size's verdict again (`Sizing::done`).
                        Some(imm) => {
                            if let Some(n) = sizing.done(side, lossy, imm)? {
                                done = Some(n);
                            }
                        }
                        None => (ping, len) = (true, c.byte_len),
                    }
                }
            }
            if write && !ping {
                ping = mr.byte_becomes(l.dst(0) + size - 1, tag(g), reads)?;
            }
            spins = spins.wrapping_add(1);
            if spins % 4096 == 0 {
                abort.check()?;
                ready.tick(side)?;
            }
        }
        if let Some(n) = done {
            // (Over UC and UD the count is modulo 2^31: the top bit is the generation.)
            let sent = answered as u32 & if lossy { 0x7fff_ffff } else { u32::MAX };
            if p.verify && bad.is_none() && n != sent {
                bad = Some(format!(
                    "--verify: {answered} pings arrived, the other side sent {n}"
                ));
            }
            return Ok(bad.map_or(Ok(()), Err));
        }
        if p.verify && bad.is_none() {
            if len as usize != size + l.grh {
                bad = Some(format!(
                    "--verify: ping {g} has {len} bytes, expected {size}"
                ));
            } else if let Err(e) =
                check_region(mr, l.dst(0), &message(p, size, g), &mut buf, || {
                    format!("ping {g} ({size} bytes)")
                })
            {
                bad = Some(e);
            }
        }
        // No ping can come before this answer goes, so only completions of answers
        // arrive meanwhile.
        if unanswered > 0 {
            spin(side, abort, "", |wc| {
                for c in wc {
                    if c.opcode == WcOpcode::Recv {
                        return Err("a message arrived before the answer to the last one".into());
                    }
                    // (Control messages' sends complete here too: not answers.)
                    if c.wr_id & CTL == 0 {
                        unanswered = unanswered.saturating_sub(1);
                    }
                }
                Ok(unanswered == 0)
            })?;
        }
        stamp_source(p, side, size, g, inline.as_deref_mut())?;
        post_message(side, write, g, to, inline.as_deref(), src)?;
        unanswered = 1;
        answered += 1;
        *round += 1;
    }
}

/// `read_lat` and `atomic_lat`: one READ or FETCH_ADD at a time. `round` counts the
/// requests issued so far (the value the next FETCH_ADD must find).
pub(crate) fn one_sided(
    p: &Params,
    size: usize,
    side: &Side,
    remote: &[Region],
    round: &mut u64,
    abort: &Abort,
) -> Result<LatRun, BoxError> {
    let (l, mr, qp) = (&side.layout, &side.mrs[0], &side.qps[0]);
    let peer = Layout::new(p, Role::Responder);
    let read = p.test.op() == Op::Read;
    let sge = LocalSge::new(mr, l.dst(0), if read { size } else { 8 })?;
    let expect = Expect::pattern(size, size).stamped(0);
    let poison = expect.poison();
    let (warm, mut t0) = (p.warmup(), None);
    let mut rec = LatRecorder::new(false);
    let clock = round_clock();
    let mut buf = Vec::new();
    let mut r = 0;
    while more(p, r, warm, &mut t0) {
        let g = *round;
        if p.verify && read {
            mr.write_at(l.dst(0), &poison[..expect.stamp_len().max(1)])?;
        }
        let req = if read {
            SendRequest::read(g, remote[0].at(peer.src(0)))
        } else {
            SendRequest::fetch_add(g, remote[0].at(peer.dst(0)), 1)
        };
        let t = clock.raw();
        qp.post_send(req.sge(sge))?;
        let mut done = false;
        spin(side, abort, "", |wc| {
            done |= wc.iter().any(|c| c.wr_id == g);
            Ok(done)
        })?;
        let dt = clock.delta(t, clock.raw());
        if r >= warm {
            rec.record(dt);
        }
        if p.verify && read {
            check_region(mr, l.dst(0), &expect, &mut buf, || {
                format!("READ {g} ({size} bytes)")
            })?;
        } else if p.verify {
            let old = mr.load_u64(l.dst(0))?;
            if old != g {
                return Err(format!(
                    "--verify: FETCH_ADD {g} found the counter at {old}, expected {g}"
                )
                .into());
            }
        }
        r += 1;
        *round += 1;
    }
    Ok((rec, r))
}
