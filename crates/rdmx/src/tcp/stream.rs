//! Frames on a TCP stream, moved between the socket and registered memory without an
//! intermediate copy.
//!
//! A frame is a 4-byte big-endian length, then one IBTA RC packet of that length: BTH,
//! extension headers, payload, pad (no ICRC: TCP checks the bytes). Sending gathers the
//! length and headers from a small buffer and the payload straight from registered memory
//! in one `writev`. Receiving reads headers into a small buffer, lets the engine check them
//! and name where the payload goes, then `readv`s the payload straight into those places.
//! Payload bytes that arrived in the same read as their headers (at most
//! [`HEADER_READ`] bytes) are copied from the small buffer; the `readv` that places a
//! payload's last bytes reads the next frame's headers into that buffer too.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, RawFd};

use rdmx_core::rc::{Placement, Span, Transmit};

use crate::provider::MrRef;

/// Bytes asked of the socket when looking for headers: enough for a whole small frame, so
/// an 8-byte WRITE takes one read, and little enough that a large payload is mostly read
/// straight into place.
pub(crate) const HEADER_READ: usize = 512;

/// Bytes of the next frame asked for by the `readv` that ends a payload: the prefix and
/// the headers of a WRITE's first (or only) packet, so that a stream of large WRITEs has
/// no payload byte land in the header buffer (and copied out of it) at all.
const READ_AHEAD: usize = PREFIX + rdmx_wire::BTH_LEN + rdmx_wire::RETH_LEN;

/// A payload at least this long is followed by a read-ahead of [`READ_AHEAD`] bytes, a
/// shorter one by [`HEADER_READ`].
const LARGE_PAYLOAD: usize = 4096;

/// Most iovecs given to one `readv`/`writev`.
const MAX_IOV: usize = 64;

/// The length prefix of a frame.
pub(crate) const PREFIX: usize = 4;

/// Why a stream was closed.
#[derive(Debug)]
pub(crate) enum StreamError {
    /// The peer closed it.
    Closed,
    /// The socket failed.
    Io(io::Error),
    /// The peer broke the framing or sent headers the engine refused to parse.
    Protocol(String),
    /// This side ended the stream, for the reason given.
    Abandoned(&'static str),
}

impl std::fmt::Display for StreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StreamError::Closed => f.write_str("peer closed the connection"),
            StreamError::Io(e) => write!(f, "socket error: {e}"),
            StreamError::Protocol(m) => write!(f, "protocol violation: {m}"),
            StreamError::Abandoned(why) => f.write_str(why),
        }
    }
}

/// A frame waiting to be written.
#[derive(Debug)]
struct Frame {
    /// Length prefix, headers and inline payload.
    head: Vec<u8>,
    /// Payload in registered memory; holding the spans keeps that memory alive.
    gather: Vec<Span<MrRef>>,
    pad: u8,
    /// Bytes of the frame already written.
    written: usize,
}

impl Frame {
    fn len(&self) -> usize {
        self.head.len()
            + self.gather.iter().map(|s| s.len as usize).sum::<usize>()
            + self.pad as usize
    }
}

/// Frames queued for the socket.
#[derive(Debug, Default)]
pub(crate) struct TxQueue {
    frames: VecDeque<Frame>,
    /// Head buffers of written frames, kept for reuse.
    spare: Vec<Vec<u8>>,
    /// Gather lists of written frames, emptied and kept for reuse.
    spare_gather: Vec<Vec<Span<MrRef>>>,
}

static ZEROS: [u8; 4] = [0; 4];

/// Up to [`MAX_IOV`] `iovec`s for one `readv`/`writev`, on the stack.
struct IoVecs {
    v: [libc::iovec; MAX_IOV],
    n: usize,
}

impl IoVecs {
    fn new() -> IoVecs {
        IoVecs {
            v: [libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            }; MAX_IOV],
            n: 0,
        }
    }
    fn clear(&mut self) {
        self.n = 0;
    }
    fn len(&self) -> usize {
        self.n
    }
    fn is_empty(&self) -> bool {
        self.n == 0
    }
    /// Appends one; the callers check the room first.
    fn push(&mut self, v: libc::iovec) {
        self.v[self.n] = v;
        self.n += 1;
    }
    fn as_slice(&self) -> &[libc::iovec] {
        &self.v[..self.n]
    }
}

impl TxQueue {
    /// Queues the packet in `t` (taking its contents) as one frame; `t` gets an empty
    /// gather list of a written frame back, so neither side allocates once warm.
    pub(crate) fn push(&mut self, t: &mut Transmit<MrRef>) {
        let mut head = self.spare.pop().unwrap_or_default();
        head.clear();
        head.extend_from_slice(&(t.len() as u32).to_be_bytes());
        head.extend_from_slice(&t.header);
        let mut gather = self.spare_gather.pop().unwrap_or_default();
        std::mem::swap(&mut gather, &mut t.gather);
        self.frames.push_back(Frame {
            head,
            gather,
            pad: t.pad,
            written: 0,
        });
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// Drops the frames not yet written that carry payload from registered memory (their
    /// requests are flushed: the memory is its owner's again), keeping the others (an
    /// acknowledgement, a NAK). Returns false, dropping nothing, when the frame part-way
    /// written carries such payload: its rest cannot be left out of the stream.
    pub(crate) fn drop_payloads(&mut self) -> bool {
        if self
            .frames
            .front()
            .is_some_and(|f| f.written > 0 && !f.gather.is_empty())
        {
            return false;
        }
        let mut kept = VecDeque::with_capacity(self.frames.len());
        for mut f in self.frames.drain(..) {
            if f.gather.is_empty() {
                kept.push_back(f);
            } else {
                f.gather.clear();
                self.spare_gather.push(f.gather);
                self.spare.push(f.head);
            }
        }
        self.frames = kept;
        true
    }

    /// Writes queued frames until the queue is empty or the socket is full; returns
    /// whether the queue is empty.
    pub(crate) fn flush(&mut self, fd: RawFd) -> Result<bool, StreamError> {
        let mut iov = IoVecs::new();
        while !self.frames.is_empty() {
            iov.clear();
            for f in self.frames.iter() {
                if iov.len() + f.gather.len() + 2 > MAX_IOV {
                    break;
                }
                let mut skip = f.written;
                let mut add = |ptr: *mut u8, len: usize| {
                    if skip >= len {
                        skip -= len;
                        return;
                    }
                    iov.push(libc::iovec {
                        iov_base: ptr.wrapping_add(skip).cast(),
                        iov_len: len - skip,
                    });
                    skip = 0;
                };
                add(f.head.as_ptr().cast_mut(), f.head.len());
                for s in &f.gather {
                    let p =
                        s.mr.raw_range(s.addr, s.len as usize)
                            .expect("the engine gathers inside resolved regions");
                    add(p, s.len as usize);
                }
                add(ZEROS.as_ptr().cast_mut(), f.pad as usize);
            }
            if iov.is_empty() {
                // One frame with more spans than MAX_IOV: write its parts in turns.
                return self.flush_one_large(fd).map(|_| self.frames.is_empty());
            }
            // SAFETY: every iovec names memory that stays valid for the call: frame heads
            // owned by this queue, ZEROS, and registered memory kept alive by the spans'
            // MrRefs (raw_range checked the bounds). writev only reads it.
            let n = unsafe { libc::writev(fd, iov.as_slice().as_ptr(), iov.len() as libc::c_int) };
            if n < 0 {
                let e = io::Error::last_os_error();
                return match e.kind() {
                    io::ErrorKind::WouldBlock => Ok(false),
                    io::ErrorKind::Interrupted => continue,
                    _ => Err(StreamError::Io(e)),
                };
            }
            self.advance(n as usize);
        }
        Ok(true)
    }

    fn flush_one_large(&mut self, fd: RawFd) -> Result<(), StreamError> {
        let f = self.frames.front().expect("not empty");
        // Copy the frame's remaining bytes once; frames this fragmented are rare (a WR
        // with more SGEs than MAX_IOV).
        let mut bytes = f.head.clone();
        for s in &f.gather {
            let at = bytes.len();
            bytes.resize(at + s.len as usize, 0);
            s.mr.shared()
                .read_at(
                    (s.addr as usize).wrapping_sub(s.mr.addr()),
                    &mut bytes[at..],
                )
                .expect("the engine gathers inside resolved regions");
        }
        bytes.resize(bytes.len() + f.pad as usize, 0);
        let rest = &bytes[f.written..];
        // SAFETY: `rest` is a live buffer of `rest.len()` bytes.
        let n = unsafe { libc::write(fd, rest.as_ptr().cast(), rest.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(()),
                _ => Err(StreamError::Io(e)),
            };
        }
        self.advance(n as usize);
        Ok(())
    }

    fn advance(&mut self, mut n: usize) {
        while n > 0 {
            let f = self.frames.front_mut().expect("wrote no more than queued");
            let left = f.len() - f.written;
            if n < left {
                f.written += n;
                return;
            }
            n -= left;
            let mut f = self.frames.pop_front().expect("just seen");
            if self.spare.len() < 64 {
                self.spare.push(f.head);
            }
            if self.spare_gather.len() < 64 {
                f.gather.clear();
                self.spare_gather.push(f.gather);
            }
        }
    }

    /// Drops every queued frame (the stream is gone).
    pub(crate) fn clear(&mut self) {
        self.frames.clear();
    }
}

/// What the receive side is in the middle of.
#[derive(Debug)]
enum RxState {
    /// Waiting for a frame's prefix and headers.
    Header,
    /// Reading a payload (and pad) of `rest` bytes into `place`; `off` bytes done.
    Payload {
        place: Vec<Placement<MrRef>>,
        rest: usize,
        off: usize,
    },
}

/// The receive side of a stream.
#[derive(Debug)]
pub(crate) struct Rx {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    state: RxState,
    /// Most bytes a frame may have (headers, largest payload, pad).
    max_frame: usize,
    /// Where payload bytes that nothing asked for go.
    discard: Box<[u8]>,
    /// A read came back short since [`Rx::rearm`]: the socket was empty then, so reading
    /// again would only return `EAGAIN` (bytes arriving later raise a new readiness event).
    drained: bool,
    /// The readiness event said the peer's side closed (or failed): read on to end of
    /// stream, since no further event comes after the last bytes.
    until_eof: bool,
    /// Bytes read from the socket so far.
    total: u64,
    /// The placements buffer of the last payload, emptied for the next one.
    spare_place: Vec<Placement<MrRef>>,
}

/// What [`Rx::next`] found.
pub(crate) enum RxEvent<'a> {
    /// A frame's headers: the packet's first bytes and how many more follow. The caller
    /// hands them to the engine and returns the placements with [`Rx::start_payload`].
    Header(&'a [u8], usize),
    /// A payload was placed in full: the engine may be polled again.
    PayloadDone,
    /// The socket has nothing more for now.
    Idle,
}

impl Rx {
    pub(crate) fn new(max_frame: usize) -> Rx {
        Rx {
            buf: vec![0; HEADER_READ.max(PREFIX + 64) * 2].into_boxed_slice(),
            start: 0,
            end: 0,
            state: RxState::Header,
            max_frame,
            discard: vec![0; 64 * 1024].into_boxed_slice(),
            drained: false,
            until_eof: false,
            total: 0,
            spare_place: Vec::new(),
        }
    }

    /// Bytes read from the socket so far.
    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    /// The socket reported readiness: it may have bytes again.
    pub(crate) fn rearm(&mut self, until_eof: bool) {
        self.drained = false;
        self.until_eof = until_eof;
    }

    /// Whether the last [`Rx::rearm`] asked to read on to end of stream.
    pub(crate) fn until_eof(&self) -> bool {
        self.until_eof
    }

    /// Whether a payload is part-way read (the engine must not be polled meanwhile).
    pub(crate) fn mid_payload(&self) -> bool {
        matches!(self.state, RxState::Payload { .. })
    }

    /// Whether the payload part-way read has bytes left to place into `mr`.
    pub(crate) fn places_into(&self, mr: &crate::provider::MrShared) -> bool {
        let RxState::Payload { place, off, .. } = &self.state else {
            return false;
        };
        place
            .iter()
            .any(|p| std::ptr::eq(p.mr.shared(), mr) && p.offset as usize + p.len as usize > *off)
    }

    /// Makes progress on the socket: returns the next header to hand to the engine, or
    /// reports that a payload finished, or that the socket is drained for now.
    pub(crate) fn next(&mut self, fd: RawFd) -> Result<RxEvent<'_>, StreamError> {
        if let RxState::Payload { .. } = self.state {
            return self.read_payload(fd);
        }
        loop {
            let have = self.end - self.start;
            if have >= PREFIX + rdmx_wire::BTH_LEN {
                let b = &self.buf[self.start..self.end];
                let frame = u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize;
                let hlen = rdmx_wire::header_len_of(b[PREFIX]).ok_or_else(|| {
                    StreamError::Protocol(format!("unknown opcode {:#04x}", b[PREFIX]))
                })?;
                if frame < hlen || frame > self.max_frame {
                    return Err(StreamError::Protocol(format!(
                        "frame of {frame} bytes (headers {hlen}, at most {})",
                        self.max_frame
                    )));
                }
                if have >= PREFIX + hlen {
                    let at = self.start + PREFIX;
                    self.start += PREFIX + hlen;
                    return Ok(RxEvent::Header(&self.buf[at..at + hlen], frame - hlen));
                }
            }
            // Need more bytes: make room at the end and read.
            if self.start > 0 {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            if self.drained {
                return Ok(RxEvent::Idle);
            }
            let want = HEADER_READ.min(self.buf.len() - self.end);
            match read(fd, &mut self.buf[self.end..self.end + want])? {
                Some(n) => {
                    self.end += n;
                    self.total += n as u64;
                    self.drained = n < want && !self.until_eof;
                }
                None => return Ok(RxEvent::Idle),
            }
        }
    }

    /// The emptied placements buffer of the last payload, for the next one (after
    /// [`RxEvent::PayloadDone`]): a warm stream allocates none.
    pub(crate) fn take_place(&mut self) -> Vec<Placement<MrRef>> {
        let mut place = std::mem::take(&mut self.spare_place);
        place.clear();
        place
    }

    /// Starts reading a payload of `rest` bytes (payload and pad) into `place` (from
    /// [`take_place`](Self::take_place)), after the engine saw its headers.
    pub(crate) fn start_payload(&mut self, place: Vec<Placement<MrRef>>, rest: usize) {
        self.state = RxState::Payload {
            place,
            rest,
            off: 0,
        };
    }

    fn read_payload(&mut self, fd: RawFd) -> Result<RxEvent<'_>, StreamError> {
        let RxState::Payload { place, rest, off } = &mut self.state else {
            unreachable!("called in the payload state")
        };
        // Bytes already buffered are copied into place.
        let n = (self.end - self.start).min(*rest - *off);
        if n > 0 {
            let bytes = &self.buf[self.start..self.start + n];
            for p in place.iter() {
                let (a, b) = (p.offset as usize, p.offset as usize + p.len as usize);
                let (lo, hi) = (a.max(*off), b.min(*off + n));
                if lo < hi {
                    let at = (p.addr as usize + (lo - a)).wrapping_sub(p.mr.addr());
                    p.mr.shared()
                        .write_at(at, &bytes[lo - *off..hi - *off])
                        .expect("the engine places inside resolved regions");
                }
            }
            self.start += n;
            *off += n;
        }
        let mut iov = IoVecs::new();
        while *off < *rest {
            if self.drained {
                return Ok(RxEvent::Idle);
            }
            // Every byte buffered was placed above: the buffer is empty.
            debug_assert_eq!(self.start, self.end);
            self.start = 0;
            self.end = 0;
            iov.clear();
            let mut at = *off;
            for p in place.iter() {
                let (a, b) = (p.offset as usize, p.offset as usize + p.len as usize);
                if b <= at {
                    continue;
                }
                if iov.len() + 2 > MAX_IOV {
                    break;
                }
                if a > at {
                    let gap = (a - at).min(self.discard.len());
                    iov.push(libc::iovec {
                        iov_base: self.discard.as_mut_ptr().cast(),
                        iov_len: gap,
                    });
                    at += gap;
                    if at < a {
                        break;
                    }
                }
                let from = at.max(a);
                let ptr =
                    p.mr.raw_range(p.addr + (from - a) as u64, b - from)
                        .expect("the engine places inside resolved regions");
                iov.push(libc::iovec {
                    iov_base: ptr.cast(),
                    iov_len: b - from,
                });
                at = b;
            }
            if at < *rest && iov.len() < MAX_IOV && at >= place_end(place) {
                // Trailing bytes nothing asked for (the pad, or a dropped payload).
                let gap = (*rest - at).min(self.discard.len());
                iov.push(libc::iovec {
                    iov_base: self.discard.as_mut_ptr().cast(),
                    iov_len: gap,
                });
                at += gap;
            }
            // When this readv asks for the payload's last bytes, it asks for the next
            // frame's headers too (into the empty buffer), sparing a read per frame:
            // after a large payload just one WRITE's headers (the next is likely large
            // too, and its bytes go straight into place), after a small one a whole
            // header read (small frames are then taken several per read).
            let payload = iov.as_slice().iter().map(|v| v.iov_len).sum::<usize>();
            let ahead = if at >= *rest && iov.len() < MAX_IOV {
                let ahead = if payload >= LARGE_PAYLOAD {
                    READ_AHEAD
                } else {
                    HEADER_READ
                };
                iov.push(libc::iovec {
                    iov_base: self.buf.as_mut_ptr().cast(),
                    iov_len: ahead,
                });
                ahead
            } else {
                0
            };
            // SAFETY: every iovec names writable memory valid for the call: the discard
            // and header buffers owned by self (READ_AHEAD and HEADER_READ are below
            // buf.len()), or registered memory kept alive by the placements' MrRefs,
            // inside the bounds raw_range checked. Nothing holds a Rust reference into
            // registered memory.
            let n = unsafe { libc::readv(fd, iov.as_slice().as_ptr(), iov.len() as libc::c_int) };
            if n < 0 {
                let e = io::Error::last_os_error();
                return match e.kind() {
                    io::ErrorKind::WouldBlock => Ok(RxEvent::Idle),
                    io::ErrorKind::Interrupted => continue,
                    _ => Err(StreamError::Io(e)),
                };
            }
            if n == 0 {
                return Err(StreamError::Closed);
            }
            let n = n as usize;
            self.drained = n < payload + ahead && !self.until_eof;
            let placed = n.min(payload);
            *off += placed;
            self.end = n - placed;
            self.total += n as u64;
        }
        if let RxState::Payload { mut place, .. } =
            std::mem::replace(&mut self.state, RxState::Header)
        {
            // Drops the placements' region references now.
            place.clear();
            self.spare_place = place;
        }
        Ok(RxEvent::PayloadDone)
    }
}

fn place_end(place: &[Placement<MrRef>]) -> usize {
    place
        .last()
        .map_or(0, |p| p.offset as usize + p.len as usize)
}

/// Reads into `buf`: `Some(n)` bytes, `None` when the socket has nothing now.
fn read(fd: RawFd, buf: &mut [u8]) -> Result<Option<usize>, StreamError> {
    loop {
        // SAFETY: `buf` is a live, writable buffer of `buf.len()` bytes.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n > 0 {
            return Ok(Some(n as usize));
        }
        if n == 0 {
            return Err(StreamError::Closed);
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::WouldBlock => return Ok(None),
            io::ErrorKind::Interrupted => continue,
            _ => return Err(StreamError::Io(e)),
        }
    }
}

/// The raw descriptor of a stream.
pub(crate) fn fd(s: &mio::net::TcpStream) -> RawFd {
    s.as_raw_fd()
}

/// Connections a listener queues before they are accepted. mio listens with 128, which
/// overflows when a peer connects hundreds of QPs at once: the kernel drops their SYNs and
/// each waits a full retransmission timeout (a second) to try again. The kernel caps the
/// value at `net.core.somaxconn`.
const LISTEN_BACKLOG: libc::c_int = 4096;

/// Lets `listener` queue [`LISTEN_BACKLOG`] connections.
pub(crate) fn deepen_backlog(listener: &mio::net::TcpListener) -> std::io::Result<()> {
    // SAFETY: listen(2) on a socket this listener owns; calling it again on a listening
    // socket only changes its backlog.
    if unsafe { libc::listen(listener.as_raw_fd(), LISTEN_BACKLOG) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
