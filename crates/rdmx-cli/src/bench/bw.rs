//! Bandwidth tests: the requester's loop.
//!
//! Each QP keeps up to `window` requests outstanding (`-t`, fewer under `--verify`, one
//! slot each), posted `-l` at a time; one request in `-Q` is signaled, and the last one
//! always is, so every request's completion is known. The CQ is polled in batches of 64.
//! With `-D` the QPs post until the time is up, then finish what is outstanding.

use std::time::{Duration, Instant};

use rdmx::{LocalSge, SendRequest, WcOpcode};

use super::args::{Budget, Op, Params};
use super::connect::Region;
use super::setup::{poll, Abort, BoxError, Layout, Role, Side, CTL, EMPTY, STALL};
use super::verify::{check_region, stamp_for, Expect};

/// What one size measured.
pub(crate) struct BwRun {
    /// Requests completed on each QP while measuring.
    pub(crate) per_qp: Vec<u64>,
    /// Requests each QP completed before measuring (--perform_warm_up).
    pub(crate) warm: u64,
    /// From the first post to the last completion.
    pub(crate) elapsed: Duration,
    /// (time since start, requests completed on all QPs) at each poll that reaped
    /// completions, starting with (0, 0).
    pub(crate) marks: Vec<(Duration, u64)>,
}

impl BwRun {
    pub(crate) fn total(&self) -> u64 {
        self.per_qp.iter().sum()
    }
}

/// Runs one size of a bandwidth test from the requester `side` against the peer's
/// `remote` regions.
pub(crate) fn requester(
    p: &Params,
    size: usize,
    side: &Side,
    remote: &[Region],
    abort: &Abort,
) -> Result<BwRun, BoxError> {
    let l = &side.layout;
    let peer = Layout::new(p, Role::Responder);
    let op = p.test.op();
    let q = side.qps.len();
    let (window, batch, cq_mod) = (l.window as u64, l.batch as u64, l.signal_every as u64);
    let slots = match op {
        Op::Write | Op::Send => l.src_slots,
        Op::Read | Op::Atomic => l.dst_slots,
    }
    .max(1);
    let len = if op == Op::Atomic { 8 } else { size };
    // Local elements, per QP and slot.
    let sges = side
        .mrs
        .iter()
        .map(|mr| {
            (0..slots)
                .map(|j| {
                    let off = match op {
                        Op::Write | Op::Send => l.src(j),
                        Op::Read | Op::Atomic => l.dst(j),
                    };
                    LocalSge::new(mr, off, len)
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .collect::<Result<Vec<_>, _>>()?;
    let stamp_len = size.min(8);
    // A READ's destination is poisoned first, so a READ that never lands is seen.
    let poison: Vec<Vec<u8>> = (0..slots)
        .map(|j| Expect::pattern(size, size).stamped(j as u64).poison()[..stamp_len].to_vec())
        .collect();
    if p.verify && matches!(op, Op::Write | Op::Send) {
        side.fill_sources(size, false)?;
    }
    // WRITEs and SENDs of up to -I bytes go inline: each slot's source bytes, read once
    // (a bandwidth test stamps nothing per request).
    let inline = match op {
        Op::Write | Op::Send if size <= side.inline_size => side
            .mrs
            .iter()
            .map(|mr| {
                (0..slots)
                    .map(|j| {
                        let mut bytes = vec![0; size];
                        mr.read_at(l.src(j), &mut bytes).map(|()| bytes)
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<Vec<_>, _>>()?,
        _ => Vec::new(),
    };

    let mut posted = vec![0u64; q];
    let mut done = vec![0u64; q];
    // With --perform_warm_up, one window per QP first; the measurement starts when it
    // has completed.
    let warm = if p.warm_up { window } else { 0 };
    let measured = match p.budget {
        Budget::Iters(n) => warm + n,
        Budget::Seconds(_) => u64::MAX,
    };
    let mut warming = warm > 0;
    let mut target = vec![if warming { warm } else { measured }; q];
    let mut wc = [EMPTY; 64];
    let mut list: Vec<SendRequest<'_>> = Vec::with_capacity(batch as usize);
    // The request of QP `i` for `slot`, before it names its bytes.
    let base = |i: usize, slot: usize, seq: u64| match op {
        Op::Write => SendRequest::write(seq, remote[i].at(peer.dst(slot))),
        Op::Read => SendRequest::read(seq, remote[i].at(peer.src(slot))),
        Op::Send => SendRequest::send(seq),
        Op::Atomic => SendRequest::fetch_add(seq, remote[i].at(peer.dst(0)), 1),
    };
    // The request of QP `i` for `slot`, signaled.
    let request = |i: usize, slot: usize, seq: u64| {
        let req = base(i, slot, seq);
        match inline.get(i) {
            Some(bytes) => side.route(i, req.inline(&bytes[slot])),
            None => side.route(i, req.sge(sges[i][slot])),
        }
    };
    // With one slot and nothing stamped, every request of a QP is the same but for its
    // id and signaling: each QP's list is built once and reused, as perftest builds its
    // work requests once.
    let mut reuse: Vec<Vec<SendRequest<'_>>> = match slots == 1 && !p.verify {
        true => (0..q)
            .map(|i| (0..batch).map(|_| request(i, 0, 0)).collect())
            .collect(),
        false => Vec::new(),
    };
    let mut marks = vec![(Duration::ZERO, 0u64)];
    let mut total = 0u64;
    let mut idle = 0u32;
    let mut start = Instant::now();
    let mut deadline = p.time_limit().filter(|_| !warming).map(|d| start + d);
    let mut last = start;
    loop {
        if deadline.is_some_and(|d| Instant::now() >= d) && target[0] == u64::MAX {
            // Time is up: one more request where needed so the last one is signaled.
            for i in 0..q {
                target[i] = posted[i].next_multiple_of(cq_mod).min(posted[i] + 1).max(1);
            }
        }
        for i in 0..q {
            'post: while posted[i] < target[i] {
                let n = batch.min(target[i] - posted[i]);
                if window - (posted[i] - done[i]) < n {
                    break;
                }
                let end = target[i];
                let signaled = |seq: u64| (seq + 1) % cq_mod == 0 || seq + 1 == end;
                // Under --verify, the stamped bytes of this batch's inline requests, and
                // the batch.
                let stamped: Vec<Vec<u8>>;
                let own: Vec<SendRequest<'_>>;
                let list = match reuse.get_mut(i) {
                    // Built once: only the ids and the signaling change.
                    Some(list) => {
                        for (k, req) in list[..n as usize].iter_mut().enumerate() {
                            let seq = posted[i] + k as u64;
                            req.set_wr_id(seq);
                            req.set_signaled(signaled(seq));
                        }
                        &list[..n as usize]
                    }
                    None if p.verify && !inline.is_empty() => {
                        let seqs = posted[i]..posted[i] + n;
                        let slot = |seq: u64| (seq % slots as u64) as usize;
                        stamped = seqs
                            .clone()
                            .map(|seq| {
                                let mut bytes = inline[i][slot(seq)].clone();
                                let s = stamp_for(seq, size).to_le_bytes();
                                bytes[..stamp_len].copy_from_slice(&s[..stamp_len]);
                                bytes
                            })
                            .collect();
                        own = seqs
                            .zip(&stamped)
                            .map(|(seq, bytes)| {
                                let req = base(i, slot(seq), seq).inline(bytes);
                                let mut req = side.route(i, req);
                                req.set_signaled(signaled(seq));
                                req
                            })
                            .collect();
                        &own[..]
                    }
                    None => {
                        list.clear();
                        for k in 0..n {
                            let seq = posted[i] + k;
                            let slot = (seq % slots as u64) as usize;
                            if p.verify {
                                let mr = &side.mrs[i];
                                match op {
                                    Op::Write | Op::Send => {
                                        let s = stamp_for(seq, size).to_le_bytes();
                                        mr.write_at(l.src(slot), &s[..stamp_len])?;
                                    }
                                    Op::Read => mr.write_at(l.dst(slot), &poison[slot])?,
                                    Op::Atomic => {}
                                }
                            }
                            let mut req = request(i, slot, seq);
                            req.set_signaled(signaled(seq));
                            list.push(req);
                        }
                        &list[..]
                    }
                };
                // One list per batch, as perftest's post list: one ibv_post_send call.
                match side.qps[i].post_send_list(list) {
                    Ok(()) => posted[i] += n,
                    // Slots of unsignaled requests free up with the next signaled
                    // completion: poll and come back.
                    Err((k, rdmx::Error::Post(rdmx::PostError::QueueFull { .. }))) => {
                        posted[i] += k as u64;
                        break 'post;
                    }
                    Err((_, e)) => return Err(e.into()),
                }
            }
        }
        let n = poll(&side.cq, &mut wc)?;
        if n > 0 {
            let now = Instant::now();
            let mut moved = false;
            for c in &wc[..n] {
                if c.wr_id & CTL != 0 {
                    continue; // a control message's send completion, from before
                }
                let i = side.qp_index(c.qp_num);
                if matches!(c.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm) {
                    // Over UC and UD, the previous size's verdict sent again (for its DONE,
                    // sent again before the verdict came): its receive goes back, for the
                    // verdict of this size. Nothing else arrives here during a run.
                    if c.status == rdmx::WcStatus::Success && side.ctl_value(c)?.is_some() {
                        side.post_recv(i, c.wr_id)?;
                        continue;
                    }
                    return Err(format!("an unexpected receive completion: {c:?}").into());
                }
                let d = c.wr_id + 1;
                if d > done[i] {
                    total += d - done[i];
                    done[i] = d;
                    moved = true;
                }
            }
            if moved {
                marks.push((now - start, total));
                last = now;
            }
        } else {
            idle += 1;
            if idle % 4096 == 0 {
                abort.check()?;
                if last.elapsed() > STALL {
                    let outstanding: u64 = (0..q).map(|i| posted[i] - done[i]).sum();
                    return Err(format!(
                        "no request completed within {STALL:?} ({outstanding} outstanding, \
                         {total} completed)"
                    )
                    .into());
                }
            }
            if !side.busy {
                // Progress threads move the data: leave them the core.
                std::thread::yield_now();
            }
        }
        if target[0] != u64::MAX && (0..q).all(|i| done[i] >= target[i]) {
            if !warming {
                break;
            }
            warming = false;
            start = Instant::now();
            last = start;
            deadline = p.time_limit().map(|d| start + d);
            marks = vec![(Duration::ZERO, 0)];
            total = 0;
            target.fill(measured);
        }
    }
    if p.verify && op == Op::Read {
        // Each destination slot holds what the last READ into it read.
        let mut buf = Vec::new();
        for (i, mr) in side.mrs.iter().enumerate() {
            for j in 0..slots.min(done[i] as usize) {
                let e = Expect::pattern(size, size).stamped(j as u64);
                check_region(mr, l.dst(j), &e, &mut buf, || {
                    format!("QP {i}: READ into slot {j} ({size} bytes)")
                })?;
            }
        }
    }
    Ok(BwRun {
        per_qp: done.iter().map(|d| d - warm).collect(),
        warm,
        elapsed: last - start,
        marks,
    })
}

/// The peak rate in requests per second: the best rate over any stretch between two
/// polls that spans at least a tenth of the run (perftest takes the best rate between a
/// post and a later completion over any stretch; over very short stretches that measures
/// completion batching, not the transfer). Never below the average, which is one such
/// stretch.
pub(crate) fn peak_rate(marks: &[(Duration, u64)]) -> f64 {
    // At most ~1000 points (always keeping the first and the last): the search is
    // quadratic.
    let step = marks.len().div_ceil(1000).max(1);
    let mut pts: Vec<(f64, f64)> = marks
        .iter()
        .step_by(step)
        .map(|&(t, n)| (t.as_secs_f64(), n as f64))
        .collect();
    if let Some(&(t, n)) = marks.last() {
        if pts.last() != Some(&(t.as_secs_f64(), n as f64)) {
            pts.push((t.as_secs_f64(), n as f64));
        }
    }
    let (Some(first), Some(last)) = (pts.first(), pts.last()) else {
        return 0.0;
    };
    let min = (last.0 - first.0) / 10.0;
    let mut best = 0.0f64;
    for (i, a) in pts.iter().enumerate() {
        for b in &pts[i + 1..] {
            let dt = b.0 - a.0;
            if dt >= min && dt > 0.0 {
                best = best.max((b.1 - a.1) / dt);
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(m: u64) -> Duration {
        Duration::from_millis(m)
    }

    #[test]
    fn peak_is_the_best_stretch_of_a_tenth_or_more() {
        // 100 requests per ms for 9 ms, then 1000 in the last ms.
        let mut marks: Vec<_> = (0..=9).map(|k| (ms(k), 100 * k)).collect();
        marks.push((ms(10), 1900));
        let avg = 1900.0 / 0.010;
        let peak = peak_rate(&marks);
        assert!((peak - 1000.0 / 0.001).abs() < 1e-6, "{peak}");
        assert!(peak >= avg);
        // A steady run peaks at its average.
        let steady: Vec<_> = (0..=10).map(|k| (ms(k), 50 * k)).collect();
        assert!((peak_rate(&steady) - 50_000.0).abs() < 1e-6);
        assert_eq!(peak_rate(&[]), 0.0);
    }

    #[test]
    fn many_marks_are_thinned_not_dropped_at_the_end() {
        let marks: Vec<_> = (0..=100_000u64)
            .map(|k| (Duration::from_micros(k), k))
            .collect();
        let peak = peak_rate(&marks);
        assert!((peak - 1e6).abs() < 1.0, "{peak}");
    }
}
