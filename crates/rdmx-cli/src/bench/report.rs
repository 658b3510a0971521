//! Results: latency statistics, perftest's text table, and the JSON rows.
//!
//! Bandwidth rows: `#bytes`, `#iterations` (the requests of all QPs: `-n` times `-q`, as
//! perftest counts them; with `-D`, all that completed), `BW peak` (see
//! [`super::bw::peak_rate`]), `BW average` (all bytes of all QPs over the time from the
//! first post to the last completion) and `MsgRate` (messages of all QPs per second), in
//! MiB/s (2^20 bytes per second, perftest's "MB/sec") or, with `--report_gbits`, Gb/s
//! (10^9 bits per second).
//!
//! Latency rows follow perftest's `print_report_lat`: of the `n` recorded rounds, sorted
//! (`delta[0..n]`), the largest [`LAT_MEASURE_TAIL`] (2) are left out and the
//! `measure_cnt = n - 2` smallest are measured. `t_min` is `delta[0]`; `t_max` is
//! `delta[measure_cnt]`, the second largest round; `t_typical` the median, `t_avg` the mean
//! and `t_stdev` the population standard deviation of the measured rounds; the 99% and
//! 99.9% percentiles are `delta[ceil(0.99 * measure_cnt)]` and
//! `delta[ceil(0.999 * measure_cnt)]`. `t_min`, `t_max`, `t_avg` and `t_stdev` are exact;
//! the median and the percentiles are exact where they fall on `t_min` or on the two
//! largest rounds, else an HDR histogram's (nanoseconds, 3 significant digits: within
//! 0.1%). perftest truncates each deviation to whole microseconds before squaring it;
//! rdmx's `t_stdev` does not. With fewer than 3 rounds (perftest runs at least 5), the
//! smallest alone is measured.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde_json::{json, Value};

use super::args::Test;

const MIB: f64 = 1048576.0;
/// Gb/s per MiB/s.
pub(crate) const GBITS_PER_MIB: f64 = MIB * 8.0 / 1e9;
/// perftest's dashed line.
pub(crate) const LINE: &str =
    "---------------------------------------------------------------------------------------";

/// perftest's `LAT_MEASURE_TAIL`: the largest rounds a latency report leaves out.
pub(crate) const LAT_MEASURE_TAIL: usize = 2;

/// Latency samples of one size, in microseconds, reported as perftest's
/// `print_report_lat` does (see the module's doc). Memory stays bounded: an HDR histogram
/// of every sample, the [`LAT_MEASURE_TAIL`] largest samples kept aside exactly, and
/// running sums of the others.
pub(crate) struct LatRecorder {
    halve: bool,
    hist: Histogram<u64>,
    n: u64,
    min: f64,
    /// The largest samples, largest first; the first `min(n, LAT_MEASURE_TAIL)` are set.
    top: [f64; LAT_MEASURE_TAIL],
    /// Every sample but those in `top`.
    rest: Moments,
}

/// Count, mean and sum of squared deviations of samples (Welford's running update).
#[derive(Clone, Copy, Default)]
struct Moments {
    n: u64,
    mean: f64,
    m2: f64,
}

impl Moments {
    fn add(&mut self, x: f64) {
        self.n += 1;
        let d = x - self.mean;
        self.mean += d / self.n as f64;
        self.m2 += d * (x - self.mean);
    }
}

/// What a latency row reports, in microseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct LatStats {
    pub(crate) min: f64,
    pub(crate) max: f64,
    pub(crate) typical: f64,
    pub(crate) avg: f64,
    pub(crate) stdev: f64,
    pub(crate) p99: f64,
    pub(crate) p999: f64,
}

impl LatRecorder {
    /// `halve`: record half of each time (the one-way latency of a ping-pong).
    pub(crate) fn new(halve: bool) -> LatRecorder {
        LatRecorder {
            halve,
            hist: Histogram::new(3).expect("3 significant digits is in range"),
            n: 0,
            min: f64::INFINITY,
            top: [0.0; LAT_MEASURE_TAIL],
            rest: Moments::default(),
        }
    }

    /// Records one round.
    pub(crate) fn record(&mut self, dt: Duration) {
        let mut us = dt.as_secs_f64() * 1e6;
        if self.halve {
            us /= 2.0;
        }
        let held = self.held();
        self.n += 1;
        self.min = self.min.min(us);
        // Into `top` if it is among the largest; what that pushes out (or `us` itself)
        // goes to `rest`.
        let out = if held < LAT_MEASURE_TAIL {
            self.top[held] = us;
            None
        } else if us > self.top[LAT_MEASURE_TAIL - 1] {
            Some(std::mem::replace(&mut self.top[LAT_MEASURE_TAIL - 1], us))
        } else {
            Some(us)
        };
        let upto = (held + 1).min(LAT_MEASURE_TAIL);
        self.top[..upto].sort_by(|a, b| b.total_cmp(a));
        if let Some(x) = out {
            self.rest.add(x);
        }
        let ns = (us * 1000.0).round() as u64;
        // `record` grows the histogram's range; it only fails past u64's range.
        if self.hist.record(ns).is_err() {
            self.hist.saturating_record(ns);
        }
    }

    /// Rounds recorded.
    pub(crate) fn count(&self) -> u64 {
        self.n
    }

    /// Samples held in `top`.
    fn held(&self) -> usize {
        (self.n as usize).min(LAT_MEASURE_TAIL)
    }

    /// Sorted sample `k` (0-based) of the histogram, in nanoseconds (the highest value
    /// of its bucket).
    fn ranked(&self, k: u64) -> u64 {
        let mut seen = 0;
        for v in self.hist.iter_recorded() {
            seen += v.count_at_value();
            if seen > k {
                return self.hist.highest_equivalent(v.value_iterated_to());
            }
        }
        self.hist.max()
    }

    /// perftest's figures: of the `n` samples sorted (`delta`), the `measure_cnt = n -
    /// LAT_MEASURE_TAIL` smallest are measured (at least one: perftest runs at least 5
    /// rounds, rdmx may record fewer).
    pub(crate) fn stats(&self) -> LatStats {
        if self.n == 0 {
            return LatStats {
                min: 0.0,
                max: 0.0,
                typical: 0.0,
                avg: 0.0,
                stdev: 0.0,
                p99: 0.0,
                p999: 0.0,
            };
        }
        let n = self.n as usize;
        let held = self.held();
        let cut = (n - 1).min(LAT_MEASURE_TAIL);
        let measured = n - cut;
        // The measured samples: `rest`, and what of `top` is not cut.
        let mut kept = self.rest;
        for &x in &self.top[cut..held] {
            kept.add(x);
        }
        // delta[k]: exact for the smallest and for those in `top`; else the histogram's,
        // within the exact range (its buckets are 0.1% wide).
        let at = |k: usize| -> f64 {
            let k = k.min(n - 1);
            if k >= n - held {
                self.top[n - 1 - k]
            } else if k == 0 {
                self.min
            } else {
                (self.ranked(k as u64) as f64 / 1000.0).clamp(self.min, self.top[held - 1])
            }
        };
        let typical = if measured % 2 == 0 {
            (at(measured / 2) + at(measured / 2 - 1)) / 2.0
        } else {
            at(measured / 2)
        };
        let pct = |q: f64| at((measured as f64 * q).ceil() as usize);
        LatStats {
            min: self.min,
            max: at(measured),
            typical,
            avg: kept.mean,
            stdev: (kept.m2.max(0.0) / kept.n as f64).sqrt(),
            p99: pct(0.99),
            p999: pct(0.999),
        }
    }
}

/// One line of results.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Row {
    Bw {
        bytes: usize,
        iterations: u64,
        peak_mib: f64,
        avg_mib: f64,
        mpps: f64,
    },
    Lat {
        bytes: usize,
        iterations: u64,
        stats: LatStats,
    },
}

impl Row {
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Row::Bw { bytes, .. } | Row::Lat { bytes, .. } => *bytes,
        }
    }

    /// The figure a plot draws: average bandwidth (MiB/s or Gb/s), or typical latency.
    pub(crate) fn headline(&self, gbits: bool) -> f64 {
        match self {
            Row::Bw { avg_mib, .. } if gbits => avg_mib * GBITS_PER_MIB,
            Row::Bw { avg_mib, .. } => *avg_mib,
            Row::Lat { stats, .. } => stats.typical,
        }
    }

    pub(crate) fn json(&self) -> Value {
        match *self {
            Row::Bw {
                bytes,
                iterations,
                peak_mib,
                avg_mib,
                mpps,
            } => json!({
                "bytes": bytes,
                "iterations": iterations,
                "bw_peak_mib_s": peak_mib,
                "bw_avg_mib_s": avg_mib,
                "bw_avg_gbit_s": avg_mib * GBITS_PER_MIB,
                "msg_rate_mpps": mpps,
            }),
            Row::Lat {
                bytes,
                iterations,
                stats: s,
            } => json!({
                "bytes": bytes,
                "iterations": iterations,
                "t_min_us": s.min,
                "t_max_us": s.max,
                "t_typical_us": s.typical,
                "t_avg_us": s.avg,
                "t_stdev_us": s.stdev,
                "p99_us": s.p99,
                "p999_us": s.p999,
            }),
        }
    }
}

/// The column titles of `test`'s table.
fn columns(test: Test, gbits: bool) -> Vec<String> {
    if test.is_bw() {
        let unit = if gbits { "Gb/sec" } else { "MiB/sec" };
        vec![
            "#bytes".into(),
            "#iterations".into(),
            format!("BW peak[{unit}]"),
            format!("BW average[{unit}]"),
            "MsgRate[Mpps]".into(),
        ]
    } else {
        [
            "#bytes",
            "#iterations",
            "t_min[usec]",
            "t_max[usec]",
            "t_typical[usec]",
            "t_avg[usec]",
            "t_stdev[usec]",
            "99% percentile[usec]",
            "99.9% percentile[usec]",
        ]
        .map(String::from)
        .to_vec()
    }
}

/// Lays `cells` out under `columns`, left-aligned, as perftest does; `#bytes` is as wide
/// as the largest size (10 digits), so every row of a sweep lines up.
fn line(columns: &[String], cells: &[String]) -> String {
    let mut s = String::from(" ");
    for (k, (c, v)) in columns.iter().zip(cells).enumerate() {
        let least = if k == 0 { 10 } else { c.len() };
        s.push_str(&format!("{v:<w$}", w = least.max(v.len()) + 4));
    }
    s.trim_end().to_string()
}

/// The table's title line.
pub(crate) fn table_header(test: Test, gbits: bool) -> String {
    let c = columns(test, gbits);
    line(&c, &c)
}

/// One row of the table.
pub(crate) fn table_row(test: Test, row: &Row, gbits: bool) -> String {
    let cells: Vec<String> = match *row {
        Row::Bw {
            bytes,
            iterations,
            peak_mib,
            avg_mib,
            mpps,
        } => {
            let k = if gbits { GBITS_PER_MIB } else { 1.0 };
            vec![
                bytes.to_string(),
                iterations.to_string(),
                format!("{:.2}", peak_mib * k),
                format!("{:.2}", avg_mib * k),
                format!("{mpps:.6}"),
            ]
        }
        Row::Lat {
            bytes,
            iterations,
            stats: s,
        } => [s.min, s.max, s.typical, s.avg, s.stdev, s.p99, s.p999]
            .iter()
            .map(|v| format!("{v:.2}"))
            .fold(
                vec![bytes.to_string(), iterations.to_string()],
                |mut v, x| {
                    v.push(x);
                    v
                },
            ),
    };
    line(&columns(test, gbits), &cells)
}

/// What ran, for the header and the JSON object.
#[derive(Clone, Debug)]
pub(crate) struct RunInfo {
    pub(crate) test: Test,
    /// The connection type: `RC`, `UC` or `UD`.
    pub(crate) conn: &'static str,
    pub(crate) provider: String,
    pub(crate) device: String,
    pub(crate) mtu: u32,
    pub(crate) busy: bool,
    /// Whether the regions' pages are locked.
    pub(crate) pinned: bool,
    /// Whether the regions are memfd-backed (shm's mapped data path maps them).
    pub(crate) shared_memory: bool,
    /// Messages of up to this many bytes are sent inline (-I).
    pub(crate) inline_size: usize,
    pub(crate) qps: usize,
    /// Requests outstanding per QP.
    pub(crate) tx_depth: usize,
    pub(crate) cq_mod: usize,
    pub(crate) post_list: usize,
    pub(crate) verify: bool,
    /// Requests per QP completed before measuring (--perform_warm_up), 0 without.
    pub(crate) warm_up: usize,
    /// "in-process", "HOST:PORT" or "server".
    pub(crate) peer: String,
    /// "local address: ..." and "remote address: ..." lines, per QP.
    pub(crate) addresses: Vec<String>,
    /// How the provider moves payloads (shm: `rdmx::shm::data_path`; udp: RoCEv2, and
    /// whether received ICRCs are checked).
    pub(crate) data_path: Option<&'static str>,
    /// shm direct or mapped: how many requests the initiator executed at post time (known
    /// once the run is over).
    pub(crate) executed_at_post: Option<u64>,
    /// The provider was chosen by default (no --provider, no -d).
    pub(crate) by_default: bool,
}

impl RunInfo {
    /// How the provider moves payloads, for providers with more than one way (shm) or
    /// something to say about it (udp).
    fn data_path(&self) -> Option<&'static str> {
        self.data_path
    }

    fn progress(&self) -> &'static str {
        if self.busy {
            "busy-poll"
        } else {
            "thread"
        }
    }

    /// perftest's header block, ending with the dashed line above the table.
    pub(crate) fn header(&self) -> String {
        let on = |b: bool| if b { "ON" } else { "OFF" };
        let pairs = [
            (
                "Provider",
                self.provider.clone(),
                "Device",
                self.device.clone(),
            ),
            (
                "Number of qps",
                self.qps.to_string(),
                "Transport type",
                "IB".into(),
            ),
            (
                "Connection type",
                self.conn.into(),
                "Peer",
                self.peer.clone(),
            ),
            (
                "TX depth",
                self.tx_depth.to_string(),
                "Post list",
                self.post_list.to_string(),
            ),
            (
                "CQ Moderation",
                self.cq_mod.to_string(),
                "Progress",
                self.progress().into(),
            ),
            (
                "Mtu",
                format!("{}[B]", self.mtu),
                "Verify",
                on(self.verify).into(),
            ),
        ];
        let mut s = format!("{LINE}\n                    {}\n", self.test.title());
        for (a, x, b, y) in pairs {
            s.push_str(&format!(" {a:<15} : {x:<16}{b:<15}: {y}\n"));
        }
        let memory = if self.pinned {
            "pinned"
        } else {
            "unpinned (RLIMIT_MEMLOCK)"
        };
        let shared = if self.shared_memory {
            ", memfd-backed (the peer maps it)"
        } else {
            ""
        };
        s.push_str(&format!(" {:<15} : {memory}{shared}\n", "Memory"));
        if self.inline_size > 0 {
            s.push_str(&format!(
                " Inline data is used up to {} bytes message\n",
                self.inline_size
            ));
        }
        if let Some(path) = self.data_path() {
            if path == "mapped" && !self.shared_memory {
                s.push_str(&format!(
                    " {:<15} : mapped, but this memory is not memfd-backed: its requests take \
                     the rings\n",
                    "Data path"
                ));
            } else {
                s.push_str(&format!(" {:<15} : {path}\n", "Data path"));
            }
        }
        if self.warm_up > 0 {
            s.push_str(&format!(
                " {:<15} : {} requests per QP before measuring\n",
                "Warm up", self.warm_up
            ));
        }
        if self.by_default {
            s.push_str(&format!(
                " {:<15} : the default {}\n",
                "Provider chosen",
                if self.peer == "this process" {
                    "in one process (the fastest here; --provider loopback is the reference)"
                } else {
                    "with a peer"
                }
            ));
        }
        s.push_str(&format!("{LINE}\n"));
        for a in &self.addresses {
            s.push_str(&format!(" {a}\n"));
        }
        s.push_str(LINE);
        s
    }

    /// The JSON object of a run with its rows.
    pub(crate) fn json(&self, rows: &[Row]) -> Value {
        json!({
            "test": self.test.name(),
            "provider": self.provider,
            "device": self.device,
            "transport": self.conn,
            "mtu": self.mtu,
            "progress": self.progress(),
            "qps": self.qps,
            "tx_depth": self.tx_depth,
            "cq_mod": self.cq_mod,
            "post_list": self.post_list,
            "verify": self.verify,
            "warm_up": self.warm_up,
            "pinned": self.pinned,
            "shared_memory": self.shared_memory,
            "inline_size": self.inline_size,
            "data_path": self.data_path(),
            "executed_at_post": self.executed_at_post,
            "provider_by_default": self.by_default,
            "peer": self.peer,
            "results": rows.iter().map(Row::json).collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_statistics() {
        let mut r = LatRecorder::new(false);
        for us in 1..=1000u64 {
            r.record(Duration::from_micros(us));
        }
        // perftest measures the 998 smallest (1 to 998 us); its t_max is the 999th.
        let s = r.stats();
        assert_eq!(s.min, 1.0);
        assert!((s.max - 999.0).abs() < 1e-9, "{s:?}");
        assert!((s.avg - 499.5).abs() < 1e-9, "{s:?}");
        assert!((s.typical - 499.5).abs() <= 0.5, "{s:?}");
        assert!((s.p99 - 990.0).abs() <= 1.0, "{s:?}");
        assert!((s.p999 - 999.0).abs() < 1e-9, "{s:?}");
        assert!((s.stdev - 288.0976).abs() < 0.001, "{s:?}");
        let mut h = LatRecorder::new(true);
        h.record(Duration::from_micros(10));
        assert_eq!(h.stats().typical, 5.0);
    }

    #[test]
    fn latency_leaves_out_perftests_tail() {
        // 998 rounds of 2 us and one of 100 us: perftest's report leaves the largest two
        // rounds out, and its t_max is the second largest.
        let mut r = LatRecorder::new(false);
        for _ in 0..998 {
            r.record(Duration::from_micros(2));
        }
        r.record(Duration::from_micros(100));
        let s = r.stats();
        assert_eq!(r.count(), 999);
        assert_eq!(
            (s.min, s.max, s.typical, s.avg),
            (2.0, 2.0, 2.0, 2.0),
            "{s:?}"
        );
        assert_eq!((s.p99, s.p999, s.stdev), (2.0, 2.0, 0.0), "{s:?}");
        // Two outliers: t_max and the 99.9% percentile are the smaller one, sorted sample
        // measure_cnt = 999 - 2 (ceil(0.999 * 997) = 997 too).
        let mut r = LatRecorder::new(false);
        r.record(Duration::from_micros(100));
        for _ in 0..997 {
            r.record(Duration::from_micros(2));
        }
        r.record(Duration::from_micros(50));
        let s = r.stats();
        assert_eq!(
            (s.max, s.p999, s.p99, s.avg),
            (50.0, 50.0, 2.0, 2.0),
            "{s:?}"
        );
        // Fewer rounds than perftest allows (it runs at least 5): the smallest is kept.
        let mut r = LatRecorder::new(false);
        for us in [3, 1, 2] {
            r.record(Duration::from_micros(us));
        }
        let s = r.stats();
        assert_eq!(
            (s.min, s.typical, s.avg, s.max, s.p999),
            (1.0, 1.0, 1.0, 2.0, 2.0),
            "{s:?}"
        );
        let mut r = LatRecorder::new(false);
        r.record(Duration::from_micros(7));
        let s = r.stats();
        assert_eq!(
            (s.min, s.typical, s.avg, s.max, s.p999),
            (7.0, 7.0, 7.0, 7.0, 7.0),
            "{s:?}"
        );
    }

    /// perftest's print_report_lat over every sample, sorted.
    fn perftest_lat(samples: &[f64]) -> LatStats {
        let mut d = samples.to_vec();
        d.sort_by(f64::total_cmp);
        let m = d.len() - LAT_MEASURE_TAIL;
        let median = if (m - 1) % 2 != 0 {
            (d[m / 2] + d[m / 2 - 1]) / 2.0
        } else {
            d[m / 2]
        };
        let avg = d[..m].iter().sum::<f64>() / m as f64;
        let var = d[..m].iter().map(|x| (x - avg).powi(2)).sum::<f64>() / m as f64;
        LatStats {
            min: d[0],
            max: d[m],
            typical: median,
            avg,
            stdev: var.sqrt(),
            p99: d[(m as f64 * 0.99).ceil() as usize],
            p999: d[(m as f64 * 0.999).ceil() as usize],
        }
    }

    #[test]
    fn latency_matches_perftests_definitions() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for n in [5, 6, 7, 100, 1001, 5000] {
            let mut r = LatRecorder::new(false);
            let mut all = Vec::new();
            for _ in 0..n {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                // 1 to ~1000 us, with a long tail.
                let us = 1 + (seed >> 33) % 100 + if seed % 17 == 0 { seed % 900 } else { 0 };
                let dt = Duration::from_micros(us);
                r.record(dt);
                all.push(dt.as_secs_f64() * 1e6);
            }
            let (got, want) = (r.stats(), perftest_lat(&all));
            let close = |a: f64, b: f64, tol: f64| (a - b).abs() <= tol * b.max(1.0);
            for (what, a, b, tol) in [
                ("min", got.min, want.min, 1e-12),
                ("max", got.max, want.max, 1e-12),
                ("avg", got.avg, want.avg, 1e-9),
                ("stdev", got.stdev, want.stdev, 1e-9),
                ("typical", got.typical, want.typical, 1e-3),
                ("p99", got.p99, want.p99, 1e-3),
                ("p999", got.p999, want.p999, 1e-3),
            ] {
                assert!(close(a, b, tol), "n {n}, {what}: {a} vs perftest's {b}");
            }
        }
    }

    #[test]
    fn rows_line_up_under_their_columns() {
        let row = Row::Bw {
            bytes: 65536,
            iterations: 5000,
            peak_mib: 1234.5,
            avg_mib: 1000.0,
            mpps: 0.016,
        };
        let head = table_header(Test::WriteBw, false);
        let line = table_row(Test::WriteBw, &row, false);
        assert_eq!(head.find("#iterations"), line.find("5000"));
        let big = Row::Bw {
            bytes: 8 << 20,
            iterations: 5000,
            peak_mib: 1.0,
            avg_mib: 1.0,
            mpps: 0.0,
        };
        let big = table_row(Test::WriteBw, &big, false);
        assert_eq!(head.find("#iterations"), big.find("5000"), "{big}");
        assert_eq!(head.find("BW average"), line.find("1000.00"));
        let g = table_row(Test::WriteBw, &row, true);
        assert!(g.contains("8.39"), "{g}");
        assert!(table_header(Test::WriteBw, true).contains("BW peak[Gb/sec]"));
        assert!(table_header(Test::ReadLat, false).contains("99.9% percentile[usec]"));
    }
}
