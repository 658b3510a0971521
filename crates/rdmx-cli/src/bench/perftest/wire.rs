//! perftest's out-of-band messages (version 6.24, as Debian's perftest 25.01 reports
//! itself) and the TCP connection that carries them.
//!
//! Every exchange is symmetric: the client writes its message and then reads the
//! server's; the server reads first and then writes. Each message has a fixed size and
//! perftest reads it with one `read()`, so each is written with one call.
//!
//! | message | bytes | content |
//! |---|---|---|
//! | version | 16 | `"6.24"`, NUL-padded |
//! | system data | 4 + 4 | cycle buffer and cache-line size, big-endian `int`s; both sides take the larger |
//! | MTU | 2 | the `ibv_mtu` enum in ASCII decimal and a NUL; both sides take the smaller |
//! | keys (one per QP, and every handshake) | 108 | [`Keys`] |
//! | bandwidth report | 5 × 8 | size, iterations, peak, average, message rate; big-endian; bandwidth in the sender's unit ([`BwReport`]) |

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use super::super::report::{Row, GBITS_PER_MIB};
use super::super::setup::BoxError;

/// The version this side announces: the one whose exchange it speaks.
pub(crate) const VERSION: &str = "6.24";
/// The oldest version perftest itself still talks to.
const OLDEST: f64 = 5.70;
/// Bytes of the version message.
pub(crate) const VERSION_LEN: usize = 16;
/// Bytes of a key message with a GID (always so on RoCE), the NUL included.
pub(crate) const KEY_LEN: usize = 108;

/// One queue pair's side of the connection, as perftest's `pingpong_dest` travels:
/// `%04x:%04x:%06x:%06x:%08x:%016llx:` (LID, outstanding reads, QPN, PSN, rkey, address
/// of the region the peer targets), the 16 GID bytes as `%02x:` each, then the SRQ number
/// `%08x:`; NUL-terminated, 108 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Keys {
    pub(crate) lid: u16,
    pub(crate) out_reads: u16,
    pub(crate) qpn: u32,
    pub(crate) psn: u32,
    pub(crate) rkey: u32,
    pub(crate) vaddr: u64,
    pub(crate) gid: [u8; 16],
    pub(crate) srqn: u32,
}

impl Keys {
    pub(crate) fn to_msg(self) -> [u8; KEY_LEN] {
        let mut text = format!(
            "{:04x}:{:04x}:{:06x}:{:06x}:{:08x}:{:016x}:",
            self.lid, self.out_reads, self.qpn, self.psn, self.rkey, self.vaddr
        );
        for b in self.gid {
            text.push_str(&format!("{b:02x}:"));
        }
        text.push_str(&format!("{:08x}:", self.srqn));
        let mut out = [0u8; KEY_LEN];
        out[..text.len()].copy_from_slice(text.as_bytes());
        out
    }

    /// Parses a peer's key message. Anything but the exact layout (field widths, hex
    /// digits, the NUL) is refused, with the message's text in the error.
    pub(crate) fn parse(msg: &[u8]) -> Result<Keys, BoxError> {
        let shown = || String::from_utf8_lossy(&msg[..msg.len().min(KEY_LEN)]).into_owned();
        let bad = |why: &str| -> BoxError {
            format!(
                "the peer's key message is not perftest's ({why}): {:?}",
                shown()
            )
            .into()
        };
        if msg.len() != KEY_LEN {
            return Err(bad(&format!("{} bytes, not {KEY_LEN}", msg.len())));
        }
        if msg[KEY_LEN - 1] != 0 {
            return Err(bad("not NUL-terminated"));
        }
        let text = std::str::from_utf8(&msg[..KEY_LEN - 1]).map_err(|_| bad("not text"))?;
        let fields: Vec<&str> = text.split(':').collect();
        // 6 fields, 16 GID bytes, the SRQ number, and the empty rest after the last ':'.
        if fields.len() != 24 || !fields[23].is_empty() {
            return Err(bad("wrong number of fields"));
        }
        let widths = [4, 4, 6, 6, 8, 16];
        let hex = |s: &str, width: usize| -> Result<u64, BoxError> {
            if s.len() != width || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bad(&format!("field {s:?} is not {width} hex digits")));
            }
            u64::from_str_radix(s, 16).map_err(|_| bad("a field does not parse"))
        };
        let mut v = [0u64; 6];
        for (i, w) in widths.iter().enumerate() {
            v[i] = hex(fields[i], *w)?;
        }
        let mut gid = [0u8; 16];
        for (i, g) in gid.iter_mut().enumerate() {
            *g = hex(fields[6 + i], 2)? as u8;
        }
        let srqn = hex(fields[22], 8)? as u32;
        Ok(Keys {
            lid: v[0] as u16,
            out_reads: v[1] as u16,
            qpn: v[2] as u32,
            psn: v[3] as u32,
            rkey: v[4] as u32,
            vaddr: v[5],
            gid,
            srqn,
        })
    }
}

/// The version message of this side.
pub(crate) fn version_msg() -> [u8; VERSION_LEN] {
    let mut out = [0u8; VERSION_LEN];
    out[..VERSION.len()].copy_from_slice(VERSION.as_bytes());
    out
}

/// The peer's version, refused below the oldest perftest still accepts.
pub(crate) fn parse_version(msg: &[u8; VERSION_LEN]) -> Result<String, BoxError> {
    let text = msg.split(|&b| b == 0).next().unwrap_or_default();
    let text = std::str::from_utf8(text)
        .ok()
        .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit() || b == b'.'))
        .ok_or_else(|| {
            format!(
                "the peer is not perftest: its version message is {:?}",
                String::from_utf8_lossy(msg)
            )
        })?;
    // perftest reads it with atof: the leading number.
    let lead: String = {
        let mut dot = false;
        text.chars()
            .take_while(|&c| c.is_ascii_digit() || (c == '.' && !std::mem::replace(&mut dot, true)))
            .collect()
    };
    let v: f64 = lead
        .parse()
        .map_err(|_| format!("the peer's version {text:?} is not a number"))?;
    if v < OLDEST {
        return Err(format!(
            "perftest {text} is older than {OLDEST:.2}, which perftest itself refuses"
        )
        .into());
    }
    Ok(text.to_string())
}

/// The MTU message: `ibv_mtu` (1 = 256 bytes ... 5 = 4096 bytes) in ASCII and a NUL.
pub(crate) fn mtu_msg(mtu: rdmx::Mtu) -> [u8; 2] {
    [b'0' + mtu_code(mtu), 0]
}

/// `ibv_mtu`'s value of `mtu`.
pub(crate) fn mtu_code(mtu: rdmx::Mtu) -> u8 {
    (mtu.bytes().trailing_zeros() - 7) as u8
}

/// The peer's MTU message, `None` if it names no valid MTU (perftest then keeps its own).
pub(crate) fn parse_mtu(msg: &[u8; 2]) -> Option<rdmx::Mtu> {
    match msg {
        [d @ b'1'..=b'5', 0] => rdmx::Mtu::from_bytes(128 << (d - b'0')),
        _ => None,
    }
}

/// A bandwidth report as `xchg_bw_reports` trades it (without the per-port figures).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct BwReport {
    pub(crate) size: u64,
    pub(crate) iters: u64,
    /// In the sender's unit, as perftest sends them: MB/s (2^20 bytes per second), or
    /// Gb/s (10^9 bits per second) where the sender was given --report_gbits. The
    /// exchange does not say which.
    pub(crate) bw_peak: f64,
    pub(crate) bw_avg: f64,
    /// Million messages per second.
    pub(crate) msg_rate: f64,
}

impl BwReport {
    /// The report of a bandwidth row measured on this side, as perftest's
    /// `print_report_bw` fills it: bandwidth in this side's unit, Gb/s (10^9 bits per
    /// second) with `gbits` (--report_gbits), else MB/s.
    pub(crate) fn of(row: &Row, gbits: bool) -> Option<BwReport> {
        let k = if gbits { GBITS_PER_MIB } else { 1.0 };
        match *row {
            Row::Bw {
                bytes,
                iterations,
                peak_mib,
                avg_mib,
                mpps,
            } => Some(BwReport {
                size: bytes as u64,
                iters: iterations,
                bw_peak: peak_mib * k,
                bw_avg: avg_mib * k,
                msg_rate: mpps,
            }),
            Row::Lat { .. } => None,
        }
    }

    /// The row this side prints for the peer's report: its figures as they came, in the
    /// peer's unit, under this side's column titles (`gbits`: this side's
    /// --report_gbits), as perftest's server prints its client's report
    /// (`print_full_bw_report(&user_param, &rem_bw_rep, NULL)`). A row holds MiB/s and
    /// [`table_row`](super::super::report::table_row) converts it to Gb/s with
    /// --report_gbits: with `gbits` the figures are stored as the MiB/s that print as
    /// they came.
    pub(crate) fn row(&self, gbits: bool) -> Row {
        let k = if gbits { GBITS_PER_MIB } else { 1.0 };
        Row::Bw {
            bytes: self.size as usize,
            iterations: self.iters,
            peak_mib: self.bw_peak / k,
            avg_mib: self.bw_avg / k,
            mpps: self.msg_rate,
        }
    }
}

/// The control connection to the peer.
pub(crate) struct Comm {
    stream: TcpStream,
    client: bool,
    /// How long one message may take to arrive, from when it is awaited.
    timeout: Duration,
}

impl Comm {
    /// `client`: this side writes first in every exchange.
    pub(crate) fn new(
        stream: TcpStream,
        client: bool,
        timeout: Duration,
    ) -> Result<Comm, BoxError> {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        Ok(Comm {
            stream,
            client,
            timeout,
        })
    }

    /// How long a message may take to arrive (a peer that stops answering fails the run
    /// after it).
    pub(crate) fn set_timeout(&mut self, timeout: Duration) -> Result<(), BoxError> {
        self.timeout = timeout;
        Ok(())
    }

    /// Reads `buf.len()` bytes within the timeout. The socket's own timeout bounds one
    /// read only: it is set to what is left before each, so that a peer that sends a
    /// byte at a time cannot stretch the wait.
    fn read_within(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        let deadline = std::time::Instant::now() + self.timeout;
        let mut at = 0;
        while at < buf.len() {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(std::io::ErrorKind::TimedOut.into());
            }
            self.stream.set_read_timeout(Some(left))?;
            match self.stream.read(&mut buf[at..]) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => at += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn read(&mut self, buf: &mut [u8], what: &str) -> Result<(), BoxError> {
        self.read_within(buf).map_err(|e| -> BoxError {
            match e.kind() {
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset => {
                    format!("the peer closed the connection instead of sending its {what}").into()
                }
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                    format!("the peer sent no {what} in time").into()
                }
                _ => format!("reading the peer's {what}: {e}").into(),
            }
        })
    }

    /// Trades `mine` for the peer's message of the same size.
    pub(crate) fn xchg(
        &mut self,
        mine: &[u8],
        theirs: &mut [u8],
        what: &str,
    ) -> Result<(), BoxError> {
        debug_assert_eq!(mine.len(), theirs.len());
        if self.client {
            self.stream.write_all(mine)?;
            self.read(theirs, what)
        } else {
            self.read(theirs, what)?;
            self.stream.write_all(mine)?;
            Ok(())
        }
    }

    /// A handshake: trades key messages; returns the peer's.
    pub(crate) fn hand_shake(&mut self, mine: &Keys) -> Result<Keys, BoxError> {
        let mut theirs = [0u8; KEY_LEN];
        self.xchg(&mine.to_msg(), &mut theirs, "key message")?;
        Keys::parse(&theirs)
    }

    /// Trades versions; returns the peer's.
    pub(crate) fn versions(&mut self) -> Result<String, BoxError> {
        let mut theirs = [0u8; VERSION_LEN];
        self.xchg(&version_msg(), &mut theirs, "version")?;
        parse_version(&theirs)
    }

    /// Trades one big-endian `int`.
    pub(crate) fn xchg_i32(&mut self, mine: i32, what: &str) -> Result<i32, BoxError> {
        let mut theirs = [0u8; 4];
        self.xchg(&mine.to_be_bytes(), &mut theirs, what)?;
        Ok(i32::from_be_bytes(theirs))
    }

    /// Trades the MTU; returns the one both use: the smaller, or ours if the peer's
    /// names none.
    pub(crate) fn mtu(&mut self, mine: rdmx::Mtu) -> Result<rdmx::Mtu, BoxError> {
        let mut theirs = [0u8; 2];
        self.xchg(&mtu_msg(mine), &mut theirs, "MTU")?;
        Ok(parse_mtu(&theirs).map_or(mine, |t| t.min(mine)))
    }

    /// Trades bandwidth reports; returns the peer's.
    pub(crate) fn reports(&mut self, mine: &BwReport) -> Result<BwReport, BoxError> {
        let mut words = [0u64; 5];
        let out = [
            mine.size,
            mine.iters,
            mine.bw_peak.to_bits(),
            mine.bw_avg.to_bits(),
            mine.msg_rate.to_bits(),
        ];
        for (w, o) in words.iter_mut().zip(out) {
            let mut b = [0u8; 8];
            self.xchg(&o.to_be_bytes(), &mut b, "report")?;
            *w = u64::from_be_bytes(b);
        }
        Ok(BwReport {
            size: words[0],
            iters: words[1],
            bw_peak: f64::from_bits(words[2]),
            bw_avg: f64::from_bits(words[3]),
            msg_rate: f64::from_bits(words[4]),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys() -> Keys {
        Keys {
            lid: 0,
            out_reads: 0x80,
            qpn: 0x11,
            psn: 0xabcdef,
            rkey: 0x1234_5678,
            vaddr: 0x7f00_dead_beef_0000,
            gid: std::net::Ipv4Addr::new(10, 77, 0, 2)
                .to_ipv6_mapped()
                .octets(),
            srqn: 0,
        }
    }

    #[test]
    fn key_message_is_perftests() {
        let m = keys().to_msg();
        let text = std::str::from_utf8(&m[..KEY_LEN - 1]).unwrap();
        assert_eq!(
            text,
            "0000:0080:000011:abcdef:12345678:7f00deadbeef0000:00:00:00:00:00:00:00:00:00:00:\
             ff:ff:0a:4d:00:02:00000000:"
        );
        assert_eq!(m[KEY_LEN - 1], 0);
        assert_eq!(Keys::parse(&m).unwrap(), keys());
        // The largest values fit the same 108 bytes.
        let max = Keys {
            lid: 0xffff,
            out_reads: 0xffff,
            qpn: 0xff_ffff,
            psn: 0xff_ffff,
            rkey: u32::MAX,
            vaddr: u64::MAX,
            gid: [0xff; 16],
            srqn: u32::MAX,
        };
        assert_eq!(Keys::parse(&max.to_msg()).unwrap(), max);
    }

    #[test]
    fn malformed_key_messages_are_refused() {
        let good = keys().to_msg();
        let mut cases: Vec<Vec<u8>> = vec![
            good[..KEY_LEN - 1].to_vec(),
            [&good[..], b"x"].concat(),
            vec![0; KEY_LEN],
            vec![b'A'; KEY_LEN],
            vec![0xff; KEY_LEN],
        ];
        let mut no_nul = good;
        no_nul[KEY_LEN - 1] = b':';
        cases.push(no_nul.to_vec());
        let mut not_hex = good;
        not_hex[0] = b'g';
        cases.push(not_hex.to_vec());
        let mut short_field = good;
        short_field[4] = b'0'; // "00000" then the next ':' is gone
        cases.push(short_field.to_vec());
        let mut sign = good;
        sign[5] = b'+';
        cases.push(sign.to_vec());
        let mut colon = good;
        colon[KEY_LEN - 2] = b'0';
        cases.push(colon.to_vec());
        for c in cases {
            let e = Keys::parse(&c).unwrap_err().to_string();
            assert!(e.contains("not perftest's"), "{e}");
        }
    }

    #[test]
    fn versions() {
        assert_eq!(&version_msg()[..5], b"6.24\0");
        assert_eq!(version_msg()[4..], [0; 12]);
        assert_eq!(parse_version(&version_msg()).unwrap(), "6.24");
        let v = |s: &[u8]| {
            let mut m = [0u8; VERSION_LEN];
            m[..s.len()].copy_from_slice(s);
            parse_version(&m)
        };
        assert!(v(b"6.28").is_ok());
        assert!(v(b"5.60").unwrap_err().to_string().contains("older"));
        assert!(v(b"GET / HTTP/1.1\r\n")
            .unwrap_err()
            .to_string()
            .contains("not perftest"));
        assert!(v(b"").is_err());
        assert!(parse_version(&[0xff; VERSION_LEN]).is_err());
    }

    #[test]
    fn mtu_messages() {
        assert_eq!(&mtu_msg(rdmx::Mtu::Mtu1024), b"3\0");
        assert_eq!(&mtu_msg(rdmx::Mtu::Mtu4096), b"5\0");
        for m in [256, 512, 1024, 2048, 4096] {
            let mtu = rdmx::Mtu::from_bytes(m).unwrap();
            assert_eq!(parse_mtu(&mtu_msg(mtu)), Some(mtu));
        }
        assert_eq!(parse_mtu(b"6\0"), None);
        assert_eq!(parse_mtu(b"0\0"), None);
        assert_eq!(parse_mtu(b"3x"), None);
    }

    #[test]
    fn exchanges_over_tcp() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = Duration::from_secs(5);
        let server = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut c = Comm::new(s, false, t).unwrap();
            let v = c.versions().unwrap();
            let mtu = c.mtu(rdmx::Mtu::Mtu4096).unwrap();
            let k = c.hand_shake(&keys()).unwrap();
            let r = c.reports(&BwReport::default()).unwrap();
            (v, mtu, k, r)
        });
        let mut c = Comm::new(TcpStream::connect(addr).unwrap(), true, t).unwrap();
        assert_eq!(c.versions().unwrap(), "6.24");
        assert_eq!(c.mtu(rdmx::Mtu::Mtu1024).unwrap(), rdmx::Mtu::Mtu1024);
        let mut mine = keys();
        mine.qpn = 0x22;
        assert_eq!(c.hand_shake(&mine).unwrap(), keys());
        let rep = BwReport {
            size: 65536,
            iters: 5000,
            bw_peak: 50.5,
            bw_avg: 49.25,
            msg_rate: 0.000788,
        };
        assert_eq!(c.reports(&rep).unwrap(), BwReport::default());
        let (v, mtu, k, r) = server.join().unwrap();
        assert_eq!(
            (v.as_str(), mtu, k, r),
            ("6.24", rdmx::Mtu::Mtu1024, mine, rep)
        );
    }

    #[test]
    fn bandwidth_figures_travel_in_the_senders_unit() {
        use super::super::super::args::Test;
        use super::super::super::report::{table_row, GBITS_PER_MIB};
        // A client's row: 11134.5 MiB/s is 93.40 Gb/s.
        let row = Row::Bw {
            bytes: 65536,
            iterations: 5000,
            peak_mib: 11200.0,
            avg_mib: 11134.5,
            mpps: 0.178,
        };
        let g = BwReport::of(&row, true).unwrap();
        assert!((g.bw_avg - 11134.5 * GBITS_PER_MIB).abs() < 1e-12, "{g:?}");
        assert!((g.bw_peak - 11200.0 * GBITS_PER_MIB).abs() < 1e-12, "{g:?}");
        assert_eq!((g.size, g.iters, g.msg_rate), (65536, 5000, 0.178));
        let m = BwReport::of(&row, false).unwrap();
        assert_eq!((m.bw_peak, m.bw_avg), (11200.0, 11134.5));
        // The server prints the client's figures as they came, under its own titles.
        let theirs = BwReport {
            size: 65536,
            iters: 5000,
            bw_peak: 93.95,
            bw_avg: 93.40,
            msg_rate: 0.178,
        };
        for gbits in [true, false] {
            let line = table_row(Test::WriteBw, &theirs.row(gbits), gbits);
            let cells: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(
                cells,
                ["65536", "5000", "93.95", "93.40", "0.178000"],
                "{gbits}"
            );
        }
    }

    #[test]
    fn a_peer_that_trickles_is_out_of_time() {
        // A version message a byte every 60 ms: each byte comes well within the timeout
        // of 300 ms, the whole message (16 bytes, about a second) does not.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let peer = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            for &b in version_msg().iter() {
                if s.write_all(&[b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(60));
            }
        });
        let mut c = Comm::new(
            TcpStream::connect(addr).unwrap(),
            false,
            Duration::from_millis(300),
        )
        .unwrap();
        let err = c.versions().unwrap_err().to_string();
        assert!(err.contains("in time"), "{err}");
        drop(c);
        peer.join().unwrap();
    }

    #[test]
    fn a_silent_or_closing_peer_is_an_error() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let hold = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap(); // silent, then closes
            std::thread::sleep(Duration::from_millis(500));
            drop(s);
            let (mut s, _) = l.accept().unwrap(); // a short message, then closes
            s.write_all(b"6.2").unwrap();
        });
        let mut c = Comm::new(
            TcpStream::connect(addr).unwrap(),
            true,
            Duration::from_millis(100),
        )
        .unwrap();
        let e = c.versions().unwrap_err().to_string();
        assert!(e.contains("in time"), "{e}");
        let mut c = Comm::new(
            TcpStream::connect(addr).unwrap(),
            true,
            Duration::from_secs(5),
        )
        .unwrap();
        let e = c.versions().unwrap_err().to_string();
        assert!(e.contains("closed"), "{e}");
        hold.join().unwrap();
    }
}
