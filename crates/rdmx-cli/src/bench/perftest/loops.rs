//! The tests as perftest runs them (`run_iter_bw`, `run_iter_bw_server`,
//! `run_iter_lat_write`, `run_iter_lat_send`), on this side's queue pairs. The latency
//! tests time each post from the one before (`n - 1` rounds) and report them as
//! perftest's `print_report_lat`, its two largest rounds left out ([`LatRecorder`]).

use std::time::{Duration, Instant};

use rdmx::{
    Completion, CompletionQueue, LocalSge, MemoryRegion, QueuePair, RecvRequest, RemoteAddr,
    SendRequest, WcOpcode,
};

use super::super::args::Op;
use super::super::bw::peak_rate;
use super::super::report::{LatRecorder, Row};
use super::super::setup::{poll, BoxError, EMPTY, STALL};
use super::wire::{BwReport, Keys};

const MIB: f64 = 1048576.0;
/// What each FETCH_ADD adds.
const ADD: u64 = 1;
/// wr_ids of the requests that check a run's data afterwards (beyond any test's).
const CHECK: u64 = 1 << 62;

/// One side's run: its queue pairs connected, its regions, the peer's keys.
pub(super) struct Run<'a> {
    pub(super) cq: &'a CompletionQueue,
    pub(super) qps: &'a [QueuePair],
    pub(super) mrs: &'a [MemoryRegion],
    /// Bytes of each half of a region: the source half at 0, the target half after it
    /// (what the peer was told), a scratch half after that.
    pub(super) half: usize,
    pub(super) size: usize,
    pub(super) iters: u64,
    pub(super) tx_depth: usize,
    pub(super) cq_mod: usize,
    /// Slots a message walks through, `step` bytes apart.
    pub(super) slots: usize,
    pub(super) step: usize,
    pub(super) rem: &'a [Keys],
    pub(super) busy: bool,
    /// --report_gbits: the report sent to the peer is in Gb/s.
    pub(super) gbits: bool,
}

/// Fails once nothing happened for [`STALL`].
struct Watch {
    last: Instant,
}

impl Watch {
    fn new() -> Watch {
        Watch {
            last: Instant::now(),
        }
    }
    fn moved(&mut self) {
        self.last = Instant::now();
    }
    fn check(&self, what: &dyn Fn() -> String) -> Result<(), BoxError> {
        if self.last.elapsed() > STALL {
            return Err(format!("the peer stopped: {} within {STALL:?}", what()).into());
        }
        Ok(())
    }
}

impl Run<'_> {
    fn target(&self) -> usize {
        self.half
    }

    fn scratch(&self) -> usize {
        2 * self.half
    }

    fn remote(&self, i: usize, offset: usize) -> RemoteAddr {
        RemoteAddr {
            addr: self.rem[i].vaddr + offset as u64,
            rkey: self.rem[i].rkey,
        }
    }

    fn idle(&self) {
        if !self.busy {
            std::thread::yield_now();
        }
    }

    /// Posts receive `r` on QP `i` into its slot of the target half.
    fn post_recv(&self, i: usize, r: u64) -> Result<(), BoxError> {
        let off = self.target() + (r as usize % self.slots) * self.step;
        let sge = LocalSge::new(&self.mrs[i], off, self.size)?;
        self.qps[i].post_recv(RecvRequest::new(r).sge(sge))?;
        Ok(())
    }

    /// Posts the first `n` receives on every QP (before the peer may send).
    pub(super) fn post_receives(&self, n: u64) -> Result<(), BoxError> {
        for i in 0..self.qps.len() {
            for r in 0..n {
                self.post_recv(i, r)?;
            }
        }
        Ok(())
    }

    fn qp_index(&self, qp_num: u32) -> usize {
        self.qps
            .iter()
            .position(|q| q.qp_num() == qp_num)
            .unwrap_or(0)
    }

    /// A received message must have the test's size.
    fn check_recv(&self, c: &Completion) -> Result<(), BoxError> {
        if c.byte_len as usize != self.size {
            return Err(format!(
                "received a {}-byte message in a {}-byte test",
                c.byte_len, self.size
            )
            .into());
        }
        Ok(())
    }

    /// The client of a bandwidth test: `iters` requests per QP, `tx_depth` in flight,
    /// one in `cq_mod` signaled (and the last). The row and the report count the
    /// requests of every QP, as perftest's.
    pub(super) fn bw_client(&self, op: Op) -> Result<(Row, BwReport), BoxError> {
        let q = self.qps.len();
        let n = self.iters;
        let size = if op == Op::Atomic { 8 } else { self.size };
        let window = self.tx_depth as u64;
        let signal = (self.cq_mod as u64).min(window);
        let mut posted = vec![0u64; q];
        let mut done = vec![0u64; q];
        let mut wc = [EMPTY; 64];
        let mut marks = vec![(Duration::ZERO, 0u64)];
        let mut total = 0u64;
        let mut watch = Watch::new();
        let start = Instant::now();
        let mut end = start;
        while done.iter().any(|&d| d < n) {
            for i in 0..q {
                while posted[i] < n && posted[i] - done[i] < window {
                    let seq = posted[i];
                    let off = (seq as usize % self.slots) * self.step;
                    let remote = self.remote(i, off);
                    let req = match op {
                        Op::Write => SendRequest::write(seq, remote),
                        Op::Read => SendRequest::read(seq, remote),
                        Op::Send => SendRequest::send(seq),
                        Op::Atomic => SendRequest::fetch_add(seq, remote, ADD),
                    };
                    let mut req = req.sge(LocalSge::new(&self.mrs[i], off, size)?);
                    if (seq + 1) % signal != 0 && seq + 1 != n {
                        req = req.unsignaled();
                    }
                    match self.qps[i].post_send(req) {
                        Ok(()) => posted[i] += 1,
                        Err(rdmx::Error::Post(rdmx::PostError::QueueFull { .. })) => break,
                        Err(e) => return Err(e.into()),
                    }
                }
            }
            let k = poll(self.cq, &mut wc)?;
            if k == 0 {
                watch.check(&|| "no request completed".into())?;
                self.idle();
                continue;
            }
            end = Instant::now();
            for c in &wc[..k] {
                let i = self.qp_index(c.qp_num);
                let d = c.wr_id + 1;
                if d > done[i] {
                    total += d - done[i];
                    done[i] = d;
                }
            }
            marks.push((end - start, total));
            watch.moved();
        }
        let secs = (end - start).as_secs_f64().max(1e-9);
        let bytes = (size as u64 * n * q as u64) as f64;
        let avg = bytes / secs / MIB;
        let peak = peak_rate(&marks) * size as f64 / MIB;
        let mpps = (n * q as u64) as f64 / secs / 1e6;
        match op {
            Op::Read => self.check_reads(n)?,
            Op::Atomic => self.check_atomics(n)?,
            Op::Write | Op::Send => {}
        }
        // perftest's #iterations, printed and sent, counts every QP's requests.
        let row = Row::Bw {
            bytes: size,
            iterations: n * q as u64,
            peak_mib: peak.max(avg),
            avg_mib: avg,
            mpps,
        };
        let rep = BwReport::of(&row, self.gbits).expect("a bandwidth row");
        Ok((row, rep))
    }

    /// Reads the peer's whole target area (the slots the test used) into the scratch half.
    fn read_back(&self, i: usize, len: usize) -> Result<(), BoxError> {
        let sge = LocalSge::new(&self.mrs[i], self.scratch(), len)?;
        self.qps[i].post_send(SendRequest::read(CHECK, self.remote(i, 0)).sge(sge))?;
        self.wait_check(CHECK, "the READ of the check")
    }

    /// Waits for the completion of `wr_id`.
    fn wait_check(&self, wr_id: u64, what: &str) -> Result<(), BoxError> {
        let mut wc = [EMPTY; 16];
        let watch = Watch::new();
        loop {
            let k = poll(self.cq, &mut wc)?;
            if wc[..k].iter().any(|c| c.wr_id == wr_id) {
                return Ok(());
            }
            watch.check(&|| format!("{what} did not complete"))?;
            self.idle();
        }
    }

    /// After read_bw: each slot holds what the peer's memory holds at the same place.
    fn check_reads(&self, n: u64) -> Result<(), BoxError> {
        let used = self.slots.min(n as usize);
        let len = (used - 1) * self.step + self.size;
        let (mut a, mut b) = (vec![0u8; self.size], vec![0u8; self.size]);
        for (i, mr) in self.mrs.iter().enumerate() {
            self.read_back(i, len)?;
            for j in 0..used {
                mr.read_at(j * self.step, &mut a)?;
                mr.read_at(self.scratch() + j * self.step, &mut b)?;
                if a != b {
                    let at = a.iter().zip(&b).position(|(x, y)| x != y).unwrap_or(0);
                    return Err(format!(
                        "QP {i}: the READs into slot {j} brought other bytes than the peer's \
                         memory holds (first difference at byte {at}: {:#04x}, the peer has {:#04x})",
                        a[at], b[at]
                    )
                    .into());
                }
            }
        }
        println!(
            " checked: the {used} slot(s) the READs filled match the peer's memory, read back after the run"
        );
        Ok(())
    }

    /// After atomic_bw: each slot's value in the peer's memory is the last value fetched
    /// there plus what was added. The peer's region need not be readable (perftest's
    /// atomic_bw grants atomics only): a FETCH_ADD of 0 per slot fetches the values.
    fn check_atomics(&self, n: u64) -> Result<(), BoxError> {
        let used = self.slots.min(n as usize);
        for (i, mr) in self.mrs.iter().enumerate() {
            for j in 0..used {
                let off = j * self.step;
                let sge = LocalSge::new(mr, self.scratch() + off, 8)?;
                let req = SendRequest::fetch_add(CHECK + j as u64, self.remote(i, off), 0);
                self.qps[i].post_send(req.sge(sge))?;
                self.wait_check(CHECK + j as u64, "a FETCH_ADD of the check")?;
                let mut f = [0u8; 8];
                let mut now = [0u8; 8];
                mr.read_at(off, &mut f)?;
                mr.read_at(self.scratch() + off, &mut now)?;
                let (f, now) = (u64::from_ne_bytes(f), u64::from_ne_bytes(now));
                if now != f.wrapping_add(ADD) {
                    return Err(format!(
                        "QP {i}, slot {j}: the last FETCH_ADD fetched {f:#x}, the peer's memory \
                         holds {now:#x} after it, not {:#x}",
                        f.wrapping_add(ADD)
                    )
                    .into());
                }
            }
        }
        println!(
            " checked: each of the {used} slot(s) holds its last fetched value + {ADD} in the peer's memory"
        );
        Ok(())
    }

    /// The server of send_bw: `iters` messages per QP into the receives, reposted.
    pub(super) fn send_bw_server(&self, rx: u64) -> Result<Row, BoxError> {
        let q = self.qps.len();
        let n = self.iters;
        let mut posted = vec![rx; q];
        let mut got = vec![0u64; q];
        let mut wc = [EMPTY; 64];
        let mut watch = Watch::new();
        let mut start = None;
        let mut end = Instant::now();
        while got.iter().any(|&g| g < n) {
            let k = poll(self.cq, &mut wc)?;
            if k == 0 {
                watch.check(&|| {
                    format!(
                        "{} of {} messages came",
                        got.iter().sum::<u64>(),
                        n * q as u64
                    )
                })?;
                self.idle();
                continue;
            }
            watch.moved();
            end = Instant::now();
            start.get_or_insert(end);
            for c in &wc[..k] {
                if c.opcode != WcOpcode::Recv {
                    continue;
                }
                self.check_recv(c)?;
                let i = self.qp_index(c.qp_num);
                got[i] += 1;
                if posted[i] < n {
                    self.post_recv(i, posted[i])?;
                    posted[i] += 1;
                }
            }
        }
        // From the first message to the last: the client's rate, seen from here.
        let secs = (end - start.unwrap_or(end)).as_secs_f64().max(1e-9);
        let all = n * q as u64;
        let avg = (self.size as u64 * all) as f64 / secs / MIB;
        println!(" checked: {all} messages of {} bytes each", self.size);
        Ok(Row::Bw {
            bytes: self.size,
            iterations: all,
            peak_mib: avg,
            avg_mib: avg,
            mpps: all as f64 / secs / 1e6,
        })
    }

    /// write_lat: the server writes first; each side writes its next message once the
    /// peer's last one landed (its last byte carries the round number, the rest is the
    /// peer's zeroed buffer: checked every round).
    pub(super) fn write_lat(&self, client: bool) -> Result<Row, BoxError> {
        let n = self.iters;
        let size = self.size;
        let mr = &self.mrs[0];
        let target = self.target();
        let zero = vec![0u8; size];
        mr.write_at(0, &zero)?;
        let sge = LocalSge::new(mr, 0, size)?;
        let mut seen = vec![0u8; size];
        let (mut scnt, mut ccnt, mut rcnt) = (0u64, 0u64, 0u64);
        let mut wc = [EMPTY; 16];
        let mut lat = LatRecorder::new(true);
        let mut prev: Option<Instant> = None;
        while scnt < n || ccnt < n || rcnt < n {
            // The server writes first.
            if rcnt < n && (client || scnt >= 1) {
                rcnt += 1;
                let want = rcnt as u8;
                let watch = Watch::new();
                loop {
                    let mut last = [0u8];
                    mr.read_at(target + size - 1, &mut last)?;
                    if last[0] == want {
                        break;
                    }
                    // Polls drive a software provider's receive path; count sends meanwhile.
                    let k = poll(self.cq, &mut wc)?;
                    ccnt += k as u64;
                    if k == 0 {
                        watch.check(&|| format!("no write of round {rcnt} landed"))?;
                    }
                }
                mr.read_at(target, &mut seen)?;
                if seen[..size - 1].iter().any(|&b| b != 0) {
                    return Err(format!(
                        "round {rcnt}: the peer's write is not its zeroed buffer with the round \
                         in the last byte: {:02x?}",
                        &seen[..size.min(64)]
                    )
                    .into());
                }
            }
            if scnt < n {
                let now = Instant::now();
                if let Some(p) = prev {
                    lat.record(now - p);
                }
                prev = Some(now);
                scnt += 1;
                mr.write_at(size - 1, &[scnt as u8])?;
                self.qps[0].post_send(SendRequest::write(scnt, self.remote(0, 0)).sge(sge))?;
            }
            let watch = Watch::new();
            while ccnt < scnt {
                let k = poll(self.cq, &mut wc)?;
                ccnt += k as u64;
                if k == 0 {
                    watch.check(&|| format!("write {scnt} did not complete"))?;
                }
            }
        }
        println!(
            " checked: {n} writes of the peer, each its zeroed buffer with the round number last"
        );
        // perftest prints the iterations asked for (n - 1 rounds are timed).
        Ok(Row::Lat {
            bytes: size,
            iterations: n,
            stats: lat.stats(),
        })
    }

    /// send_lat: the client sends first; each side sends once the peer's message came.
    pub(super) fn send_lat(&self, client: bool, rx: u64) -> Result<Row, BoxError> {
        let n = self.iters;
        let sge = LocalSge::new(&self.mrs[0], 0, self.size)?;
        let (mut scnt, mut ccnt, mut rcnt, mut pending) = (0u64, 0u64, 0u64, 0u64);
        let mut posted = rx;
        let mut wc = [EMPTY; 16];
        let mut lat = LatRecorder::new(true);
        let mut prev: Option<Instant> = None;
        let mut take =
            |wc: &[Completion], pending: &mut u64, ccnt: &mut u64| -> Result<(), BoxError> {
                for c in wc {
                    if c.opcode == WcOpcode::Recv {
                        self.check_recv(c)?;
                        *pending += 1;
                        if posted < n {
                            self.post_recv(0, posted)?;
                            posted += 1;
                        }
                    } else {
                        *ccnt += 1;
                    }
                }
                Ok(())
            };
        while scnt < n || rcnt < n {
            // The client sends first.
            if rcnt < n && (!client || scnt >= 1) {
                let watch = Watch::new();
                while pending == 0 {
                    let k = poll(self.cq, &mut wc)?;
                    take(&wc[..k], &mut pending, &mut ccnt)?;
                    if k == 0 {
                        watch.check(&|| format!("message {} did not come", rcnt + 1))?;
                    }
                }
                pending -= 1;
                rcnt += 1;
            }
            if scnt < n {
                let now = Instant::now();
                if let Some(p) = prev {
                    lat.record(now - p);
                }
                prev = Some(now);
                scnt += 1;
                self.qps[0].post_send(SendRequest::send(scnt).sge(sge))?;
            }
        }
        let watch = Watch::new();
        while ccnt < scnt {
            let k = poll(self.cq, &mut wc)?;
            take(&wc[..k], &mut pending, &mut ccnt)?;
            if k == 0 {
                watch.check(&|| "the last sends did not complete".into())?;
            }
        }
        println!(" checked: {rcnt} messages of {} bytes each", self.size);
        Ok(Row::Lat {
            bytes: self.size,
            iterations: n,
            stats: lat.stats(),
        })
    }
}
