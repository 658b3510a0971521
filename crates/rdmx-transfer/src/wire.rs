//! What engines tell each other: segment descriptors and the control messages of the
//! peer-to-peer handshake, in a compact, versioned binary form.
//!
//! Everything here is read from peers (or from etcd), so every reader is bounded and
//! checked: a truncated, oversized or inconsistent message is an [`Error::Descriptor`]
//! naming what was wrong, never a panic or a silent wrong answer.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use rdmx::QpEndpoint;

use crate::config::Transport;
use crate::error::{Error, Result};

/// Largest control message accepted.
pub(crate) const MAX_MESSAGE: usize = 16 << 20;
/// Most rails one engine may describe.
pub(crate) const MAX_RAILS: usize = 16;
/// Most buffers one segment may describe.
pub(crate) const MAX_BUFFERS: usize = 1 << 16;
/// Longest name (engine, buffer, device, host).
pub(crate) const MAX_NAME: usize = 255;
/// Longest cluster token.
pub(crate) const MAX_TOKEN: usize = 64;
/// Most paths one connection sets up.
pub(crate) const MAX_PATHS: usize = 256;

/// The control messages' magic: "RDMXTE" and the wire version (02: rails say whether
/// they are in service).
const MAGIC: &[u8; 8] = b"RDMXTE02";

/// What one rail of an engine is, as its peers see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RailDesc {
    /// The transport.
    pub kind: Transport,
    /// The device name (`tcp0`, `shm0`, `mlx5_0`, ...).
    pub device: String,
    /// The largest path MTU the rail offers, in bytes.
    pub mtu: u32,
    /// verbs: the GID its queue pairs use.
    pub gid: Option<Ipv6Addr>,
    /// Taken out of service (`Engine::close_rail`): peers open no path on it.
    pub closed: bool,
}

/// One registered buffer of a segment, as its peers see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BufferDesc {
    /// The name it was registered under.
    pub name: String,
    /// Where it starts in the segment's offset space.
    pub offset: u64,
    /// Its length in bytes.
    pub len: u64,
    /// Whether peers may READ it.
    pub remote_read: bool,
    /// Whether peers may WRITE it.
    pub remote_write: bool,
    /// Per rail of the owning engine (same order): address and rkey.
    pub(crate) keys: Vec<(u64, u32)>,
}

/// An engine's segment descriptor: who it is, how to reach it, and its buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentDesc {
    /// The engine's name.
    pub name: String,
    /// An identity of its host (hostname and boot id): equal means "same host".
    pub host: String,
    /// Its process id (loopback rails work only within one process).
    pub pid: u32,
    /// Its control listener.
    pub control: SocketAddr,
    /// Its rails.
    pub rails: Vec<RailDesc>,
    /// Its buffers, sorted by offset.
    pub buffers: Vec<BufferDesc>,
}

impl SegmentDesc {
    /// The compact form.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = Writer::default();
        self.put(&mut w);
        w.0
    }

    /// Parses and checks the compact form.
    pub fn from_bytes(raw: &[u8]) -> Result<SegmentDesc> {
        let mut r = Reader::new(raw);
        let d = SegmentDesc::get(&mut r)?;
        r.end()?;
        Ok(d)
    }

    fn put(&self, w: &mut Writer) {
        w.str(&self.name);
        w.str(&self.host);
        w.u32(self.pid);
        w.addr(self.control);
        w.u8(self.rails.len() as u8);
        for r in &self.rails {
            w.u8(r.kind as u8);
            w.str(&r.device);
            w.u32(r.mtu);
            // Bit 0: a GID follows; bit 1: the rail is closed.
            let closed = (r.closed as u8) << 1;
            match r.gid {
                Some(g) => {
                    w.u8(1 | closed);
                    w.bytes(&g.octets());
                }
                None => w.u8(closed),
            }
        }
        w.u32(self.buffers.len() as u32);
        for b in &self.buffers {
            w.str(&b.name);
            w.u64(b.offset);
            w.u64(b.len);
            w.u8(b.remote_read as u8 | (b.remote_write as u8) << 1);
            for &(addr, rkey) in &b.keys {
                w.u64(addr);
                w.u32(rkey);
            }
        }
    }

    fn get(r: &mut Reader<'_>) -> Result<SegmentDesc> {
        let name = r.name("engine name")?;
        let host = r.name("host")?;
        let pid = r.u32()?;
        let control = r.addr()?;
        let nrails = r.u8()? as usize;
        if nrails == 0 || nrails > MAX_RAILS {
            return Err(bad(format!("{nrails} rails (1 to {MAX_RAILS} allowed)")));
        }
        let mut rails = Vec::with_capacity(nrails);
        for _ in 0..nrails {
            let kind = Transport::from_u8(r.u8()?)
                .ok_or_else(|| bad("a rail of an unknown transport".into()))?;
            let device = r.name("device name")?;
            let mtu = r.u32()?;
            if rdmx::Mtu::from_bytes(mtu).is_none() {
                return Err(bad(format!("a rail with MTU {mtu}")));
            }
            let flags = r.u8()?;
            let gid = match flags & !2 {
                0 => None,
                1 => Some(Ipv6Addr::from(r.array::<16>()?)),
                _ => return Err(bad("a malformed GID".into())),
            };
            rails.push(RailDesc {
                kind,
                device,
                mtu,
                gid,
                closed: flags & 2 != 0,
            });
        }
        let nbuf = r.u32()? as usize;
        if nbuf > MAX_BUFFERS {
            return Err(bad(format!("{nbuf} buffers (at most {MAX_BUFFERS})")));
        }
        // Each buffer takes at least this many bytes: refuse a count the message cannot hold
        // before allocating for it.
        if nbuf.saturating_mul(1 + 8 + 8 + 1 + nrails * 12) > r.left() {
            return Err(bad(format!(
                "{nbuf} buffers in a message too short for them"
            )));
        }
        let mut buffers: Vec<BufferDesc> = Vec::with_capacity(nbuf);
        let mut names = std::collections::HashSet::with_capacity(nbuf);
        for _ in 0..nbuf {
            let name = r.name("buffer name")?;
            let offset = r.u64()?;
            let len = r.u64()?;
            let flags = r.u8()?;
            if flags & !3 != 0 {
                return Err(bad(format!("buffer {name:?} with unknown access bits")));
            }
            let mut keys = Vec::with_capacity(nrails);
            for _ in 0..nrails {
                let addr = r.u64()?;
                let rkey = r.u32()?;
                if addr.checked_add(len).is_none() {
                    return Err(bad(format!("buffer {name:?} wraps the address space")));
                }
                keys.push((addr, rkey));
            }
            if len == 0 || offset.checked_add(len).is_none() {
                return Err(bad(format!(
                    "buffer {name:?} with length {len} at {offset}"
                )));
            }
            if let Some(prev) = buffers.last() {
                if prev.offset + prev.len > offset {
                    return Err(bad(format!(
                        "buffers {:?} and {name:?} overlap or are out of order",
                        prev.name
                    )));
                }
            }
            // (A set: comparing every name with every other is quadratic in what a
            // stranger may send before its token is checked.)
            if !names.insert(name.clone()) {
                return Err(bad(format!("two buffers named {name:?}")));
            }
            buffers.push(BufferDesc {
                name,
                offset,
                len,
                remote_read: flags & 1 != 0,
                remote_write: flags & 2 != 0,
                keys,
            });
        }
        Ok(SegmentDesc {
            name,
            host,
            pid,
            control,
            rails,
            buffers,
        })
    }
}

/// A control message.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Msg {
    /// Initiator → target: who I am; `describe_only` asks for the descriptor and nothing
    /// more.
    Hello {
        desc: SegmentDesc,
        describe_only: bool,
        /// The cluster token, if the initiator has one.
        token: Vec<u8>,
    },
    /// Target → initiator: who I am.
    Desc(SegmentDesc),
    /// Initiator → target: connect these paths (local rail, remote rail, endpoint).
    Connect {
        secret: u64,
        transport: Transport,
        mtu: u32,
        paths: Vec<(u8, u8, QpEndpoint)>,
    },
    /// Target → initiator: the target's endpoints, path by path.
    Accept(Vec<QpEndpoint>),
    /// Both: queue pairs connected.
    Ready,
    /// Initiator → target: rebuild path `path` of connection `secret` from `name`.
    Repair {
        name: String,
        secret: u64,
        path: u16,
        endpoint: QpEndpoint,
    },
    /// Either: refused, and why.
    Refused(String),
    /// A target → the control listener of an engine it holds a connection with: do you
    /// hold a connection `secret` to `name` (the asker), open? `Ready` if so, `Refused`
    /// if not. Asked when another initiator names itself as that engine.
    Probe { name: String, secret: u64 },
    /// Either side → the other's control listener: move your queue pair `qpn` of path
    /// `path` of connection `secret` from `name` to the error state, so that nothing more
    /// of what was sent to it lands (the sender is about to send it again on another
    /// path). `Ready` once done, or when that queue pair is gone already.
    Fence {
        name: String,
        secret: u64,
        path: u16,
        qpn: u32,
    },
}

impl Msg {
    fn to_bytes(&self) -> Vec<u8> {
        let mut w = Writer::default();
        match self {
            Msg::Hello {
                desc,
                describe_only,
                token,
            } => {
                w.u8(1);
                w.u8(*describe_only as u8);
                w.u8(token.len().min(MAX_TOKEN) as u8);
                w.bytes(&token[..token.len().min(MAX_TOKEN)]);
                desc.put(&mut w);
            }
            Msg::Desc(d) => {
                w.u8(2);
                d.put(&mut w);
            }
            Msg::Connect {
                secret,
                transport,
                mtu,
                paths,
            } => {
                w.u8(3);
                w.u64(*secret);
                w.u8(*transport as u8);
                w.u32(*mtu);
                w.u16(paths.len() as u16);
                for (l, r, ep) in paths {
                    w.u8(*l);
                    w.u8(*r);
                    w.bytes(&ep.to_bytes());
                }
            }
            Msg::Accept(eps) => {
                w.u8(4);
                w.u16(eps.len() as u16);
                for ep in eps {
                    w.bytes(&ep.to_bytes());
                }
            }
            Msg::Ready => w.u8(5),
            Msg::Repair {
                name,
                secret,
                path,
                endpoint,
            } => {
                w.u8(6);
                w.str(name);
                w.u64(*secret);
                w.u16(*path);
                w.bytes(&endpoint.to_bytes());
            }
            Msg::Refused(why) => {
                w.u8(7);
                let why: String = why.chars().take(1000).collect();
                w.u16(why.len() as u16);
                w.bytes(why.as_bytes());
            }
            Msg::Probe { name, secret } => {
                w.u8(8);
                w.str(name);
                w.u64(*secret);
            }
            Msg::Fence {
                name,
                secret,
                path,
                qpn,
            } => {
                w.u8(9);
                w.str(name);
                w.u64(*secret);
                w.u16(*path);
                w.u32(*qpn);
            }
        }
        w.0
    }

    fn from_bytes(raw: &[u8]) -> Result<Msg> {
        let mut r = Reader::new(raw);
        let m = match r.u8()? {
            1 => {
                let describe_only = r.u8()? != 0;
                let n = r.u8()? as usize;
                if n > MAX_TOKEN {
                    return Err(bad(format!("a token of {n} bytes (at most {MAX_TOKEN})")));
                }
                let token = r.take(n)?.to_vec();
                Msg::Hello {
                    describe_only,
                    token,
                    desc: SegmentDesc::get(&mut r)?,
                }
            }
            2 => Msg::Desc(SegmentDesc::get(&mut r)?),
            3 => {
                let secret = r.u64()?;
                let transport = Transport::from_u8(r.u8()?)
                    .ok_or_else(|| bad("an unknown transport".into()))?;
                let mtu = r.u32()?;
                let n = r.u16()? as usize;
                if n == 0 || n > MAX_PATHS {
                    return Err(bad(format!("{n} paths (1 to {MAX_PATHS} allowed)")));
                }
                let mut paths = Vec::with_capacity(n);
                for _ in 0..n {
                    let l = r.u8()?;
                    let rr = r.u8()?;
                    paths.push((l, rr, r.endpoint()?));
                }
                Msg::Connect {
                    secret,
                    transport,
                    mtu,
                    paths,
                }
            }
            4 => {
                let n = r.u16()? as usize;
                if n > MAX_PATHS {
                    return Err(bad(format!("{n} paths (at most {MAX_PATHS})")));
                }
                let mut eps = Vec::with_capacity(n);
                for _ in 0..n {
                    eps.push(r.endpoint()?);
                }
                Msg::Accept(eps)
            }
            5 => Msg::Ready,
            6 => Msg::Repair {
                name: r.name("engine name")?,
                secret: r.u64()?,
                path: r.u16()?,
                endpoint: r.endpoint()?,
            },
            7 => {
                let n = r.u16()? as usize;
                Msg::Refused(String::from_utf8_lossy(r.take(n)?).into_owned())
            }
            8 => Msg::Probe {
                name: r.name("engine name")?,
                secret: r.u64()?,
            },
            9 => Msg::Fence {
                name: r.name("engine name")?,
                secret: r.u64()?,
                path: r.u16()?,
                qpn: r.u32()?,
            },
            t => return Err(bad(format!("a control message of unknown type {t}"))),
        };
        r.end()?;
        Ok(m)
    }

    /// Writes the message, framed.
    pub(crate) fn send(&self, s: &mut impl Write) -> Result<()> {
        let body = self.to_bytes();
        let mut out = Vec::with_capacity(12 + body.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(body.len() as u32).to_be_bytes());
        out.extend_from_slice(&body);
        s.write_all(&out)
            .map_err(|e| Error::Io("send a control message", e))
    }

    /// Reads one framed message.
    pub(crate) fn recv(s: &mut impl Read) -> Result<Msg> {
        let mut head = [0u8; 12];
        s.read_exact(&mut head)
            .map_err(|e| Error::Io("receive a control message", e))?;
        if &head[..8] != MAGIC {
            if head[..6] == MAGIC[..6] {
                return Err(bad(format!(
                    "the peer speaks wire version {} of the rdmx transfer engine, this one {}",
                    String::from_utf8_lossy(&head[6..8]),
                    String::from_utf8_lossy(&MAGIC[6..8])
                )));
            }
            return Err(bad("the peer is not an rdmx transfer engine".into()));
        }
        let len = u32::from_be_bytes([head[8], head[9], head[10], head[11]]) as usize;
        if len > MAX_MESSAGE {
            return Err(bad(format!(
                "a control message of {len} bytes (at most {MAX_MESSAGE})"
            )));
        }
        // Grown as the bytes come, so that a length claimed and not sent costs nothing.
        let mut body = Vec::with_capacity(len.min(64 << 10));
        let got = s
            .take(len as u64)
            .read_to_end(&mut body)
            .map_err(|e| Error::Io("receive a control message", e))?;
        if got != len {
            return Err(Error::Io(
                "receive a control message",
                std::io::ErrorKind::UnexpectedEof.into(),
            ));
        }
        Msg::from_bytes(&body)
    }
}

/// A stream read by a deadline: every read waits at most until `until`, so that a peer
/// sending a message a byte at a time cannot make it last longer.
pub(crate) struct ByDeadline<'a> {
    s: &'a std::net::TcpStream,
    until: std::time::Instant,
}

impl<'a> ByDeadline<'a> {
    /// Reads from `s` until `within` from now.
    pub(crate) fn new(s: &'a std::net::TcpStream, within: std::time::Duration) -> Self {
        ByDeadline {
            s,
            until: std::time::Instant::now() + within,
        }
    }
}

impl Read for ByDeadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self
            .until
            .saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the peer did not send its message in time",
            ));
        }
        self.s.set_read_timeout(Some(left))?;
        let mut s = self.s;
        s.read(buf)
    }
}

fn bad(what: String) -> Error {
    Error::Descriptor(what)
}

#[derive(Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_be_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_be_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_be_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }
    fn str(&mut self, s: &str) {
        // Names are checked at registration; a longer one is cut at a char boundary.
        let mut end = s.len().min(MAX_NAME);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u8(end as u8);
        self.bytes(&s.as_bytes()[..end]);
    }
    fn addr(&mut self, a: SocketAddr) {
        let ip = match a.ip() {
            IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            IpAddr::V6(v6) => v6,
        };
        self.bytes(&ip.octets());
        self.u16(a.port());
    }
}

struct Reader<'a> {
    raw: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn new(raw: &'a [u8]) -> Self {
        Reader { raw, at: 0 }
    }
    fn left(&self) -> usize {
        self.raw.len() - self.at
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.left() {
            return Err(bad(format!(
                "a truncated message ({} bytes, {} more needed at byte {})",
                self.raw.len(),
                n - self.left(),
                self.at
            )));
        }
        let s = &self.raw[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_be_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_be_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_be_bytes(self.array()?))
    }
    fn name(&mut self, what: &str) -> Result<String> {
        let n = self.u8()? as usize;
        let raw = self.take(n)?;
        let s = std::str::from_utf8(raw).map_err(|_| bad(format!("a {what} that is not UTF-8")))?;
        if s.is_empty() && what != "host" {
            return Err(bad(format!("an empty {what}")));
        }
        Ok(s.to_string())
    }
    fn addr(&mut self) -> Result<SocketAddr> {
        let ip = Ipv6Addr::from(self.array::<16>()?);
        let port = self.u16()?;
        Ok(SocketAddr::new(IpAddr::V6(ip).to_canonical(), port))
    }
    fn endpoint(&mut self) -> Result<QpEndpoint> {
        let raw = self.take(QpEndpoint::LEN)?;
        QpEndpoint::from_bytes(raw).map_err(|e| bad(format!("a queue-pair endpoint: {e}")))
    }
    fn end(&self) -> Result<()> {
        if self.left() != 0 {
            return Err(bad(format!(
                "{} stray bytes after the message",
                self.left()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> SegmentDesc {
        SegmentDesc {
            name: "prefill-0".into(),
            host: "h boot".into(),
            pid: 42,
            control: "127.0.0.1:7000".parse().unwrap(),
            rails: vec![
                RailDesc {
                    kind: Transport::Tcp,
                    device: "tcp0".into(),
                    mtu: 4096,
                    gid: None,
                    closed: false,
                },
                RailDesc {
                    kind: Transport::Verbs,
                    device: "rxe0".into(),
                    mtu: 1024,
                    gid: Some("::ffff:10.0.0.1".parse().unwrap()),
                    closed: true,
                },
            ],
            buffers: vec![
                BufferDesc {
                    name: "kv".into(),
                    offset: 0,
                    len: 1 << 20,
                    remote_read: true,
                    remote_write: false,
                    keys: vec![(0x1000, 7), (0x1000, 9)],
                },
                BufferDesc {
                    name: "ckpt".into(),
                    offset: 1 << 20,
                    len: 4096,
                    remote_read: true,
                    remote_write: true,
                    keys: vec![(0x9000, 8), (0x9000, 10)],
                },
            ],
        }
    }

    #[test]
    fn descriptors_round_trip() {
        let d = sample();
        assert_eq!(SegmentDesc::from_bytes(&d.to_bytes()).unwrap(), d);
    }

    #[test]
    fn every_truncation_and_garbage_is_refused() {
        let raw = sample().to_bytes();
        for n in 0..raw.len() {
            let e = SegmentDesc::from_bytes(&raw[..n]).unwrap_err();
            assert!(matches!(e, Error::Descriptor(_)), "{n}: {e}");
        }
        let mut long = raw.clone();
        long.push(0);
        assert!(SegmentDesc::from_bytes(&long).is_err());
        // Flipping any byte either parses to something else or is refused; never panics.
        for i in 0..raw.len() {
            let mut m = raw.clone();
            m[i] ^= 0xff;
            let _ = SegmentDesc::from_bytes(&m);
        }
    }

    #[test]
    fn forged_descriptors_are_refused_with_the_reason() {
        let mut d = sample();
        d.buffers[1].offset = 100; // overlaps "kv"
        let e = SegmentDesc::from_bytes(&d.to_bytes()).unwrap_err();
        assert!(e.to_string().contains("overlap"), "{e}");
        let mut d = sample();
        d.buffers[1].name = "kv".into();
        d.buffers[1].offset = 2 << 20;
        let e = SegmentDesc::from_bytes(&d.to_bytes()).unwrap_err();
        assert!(e.to_string().contains("two buffers"), "{e}");
        let mut d = sample();
        d.buffers[0].keys[0].0 = u64::MAX - 5;
        let e = SegmentDesc::from_bytes(&d.to_bytes()).unwrap_err();
        assert!(e.to_string().contains("wraps"), "{e}");
        // A buffer count the message cannot hold is refused before allocating.
        let mut raw = sample().to_bytes();
        let mut empty = sample();
        empty.buffers.clear();
        let at = empty.to_bytes().len() - 4;
        raw[at..at + 4].copy_from_slice(&60_000u32.to_be_bytes());
        let e = SegmentDesc::from_bytes(&raw).unwrap_err();
        assert!(e.to_string().contains("too short"), "{e}");
    }

    #[test]
    fn control_messages_round_trip_and_oversized_frames_are_refused() {
        let ep = QpEndpoint {
            qp_num: 0x10,
            psn: 5,
            mtu: 4096,
            secret: 77,
            addr: rdmx::PeerAddr::Local,
        };
        for m in [
            Msg::Hello {
                desc: sample(),
                describe_only: true,
                token: b"cluster".to_vec(),
            },
            Msg::Desc(sample()),
            Msg::Connect {
                secret: 3,
                transport: Transport::Shm,
                mtu: 4096,
                paths: vec![(0, 1, ep)],
            },
            Msg::Accept(vec![ep, ep]),
            Msg::Ready,
            Msg::Repair {
                name: "x".into(),
                secret: 9,
                path: 1,
                endpoint: ep,
            },
            Msg::Refused("no".into()),
            Msg::Probe {
                name: "y".into(),
                secret: 11,
            },
            Msg::Fence {
                name: "z".into(),
                secret: 13,
                path: 2,
                qpn: 0x1234,
            },
        ] {
            let mut buf = Vec::new();
            m.send(&mut buf).unwrap();
            assert_eq!(Msg::recv(&mut &buf[..]).unwrap(), m);
        }
        let mut frame = MAGIC.to_vec();
        frame.extend_from_slice(&u32::MAX.to_be_bytes());
        let e = Msg::recv(&mut &frame[..]).unwrap_err();
        assert!(e.to_string().contains("at most"), "{e}");
        let e = Msg::recv(&mut &b"GET / HTTP/1.1\r\n\r\n"[..]).unwrap_err();
        assert!(e.to_string().contains("not an rdmx"), "{e}");
        let mut older = b"RDMXTE01".to_vec();
        older.extend_from_slice(&0u32.to_be_bytes());
        let e = Msg::recv(&mut &older[..]).unwrap_err();
        assert!(e.to_string().contains("wire version 01"), "{e}");
    }
}
