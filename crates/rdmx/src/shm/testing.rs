//! Test tools: the rings as a broken or hostile peer could write them, the shared words
//! of the `mapped` data path, and a peer stalled mid-copy.

use super::Link;
use crate::soft::SoftQp;
use crate::{Error, QueuePair, Result};

pub use super::mapped::PeerMapping;

fn with_conn<T>(qp: &QueuePair, f: impl FnOnce(&super::qp::Conn) -> Result<T>) -> Result<T> {
    let Some(link) = qp.provider_qp().as_any().downcast_ref::<SoftQp<Link>>() else {
        return Err(Error::InvalidArgument("not an shm queue pair"));
    };
    let g = link.transport.qp.inner.lock();
    let Some(conn) = g.conn.as_ref() else {
        return Err(Error::InvalidArgument("the queue pair is not connected"));
    };
    f(conn)
}

/// `f` on the view of `qp`'s peer that the `mapped` data path keeps.
fn with_view<T>(qp: &QueuePair, f: impl FnOnce(&super::mapped::PeerView) -> T) -> Result<T> {
    with_conn(qp, |c| {
        c.mapped.as_ref().map(f).ok_or(Error::InvalidArgument(
            "the queue pair does not run the mapped data path",
        ))
    })
}

/// Makes `qp` claim its peer's key `rkey` as an initiator does before it copies (see
/// the `mapped` data path), and never let go: what a peer stalled mid-copy, or one
/// that scribbles its claim word, leaves in the segment.
pub fn stall_claim(qp: &QueuePair, rkey: u32) -> Result<()> {
    with_conn(qp, |c| {
        let view = c.mapped.as_ref().ok_or(Error::InvalidArgument(
            "the queue pair does not run the mapped data path",
        ))?;
        let tag = view.tag_of(rkey).ok_or(Error::InvalidArgument(
            "the peer has not published that key",
        ))?;
        c.seg
            .claim_word(c.side)
            .store(tag, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    })
}

/// Sends `bytes` on the socket of `qp`'s connection, as a peer could write anything
/// there: its peer reads them.
pub fn send_on_socket(qp: &QueuePair, bytes: &[u8]) -> Result<()> {
    with_conn(qp, |c| {
        use std::io::Write;
        (&*c.sock)
            .write_all(bytes)
            .map_err(|e| Error::Io("write the connection's socket", e))
    })
}

/// How many claims `qp` made on its peer's keys so far (the `mapped` path).
pub fn claims_made(qp: &QueuePair) -> Result<u64> {
    with_view(qp, |v| v.claims())
}

/// Whether `qp`'s peer publishes key `rkey` in its key table now (the `mapped` path).
pub fn peer_publishes(qp: &QueuePair, rkey: u32) -> Result<bool> {
    with_view(qp, |v| v.publishes(rkey))
}

/// How many of its peer's files `qp` maps now (the `mapped` path).
pub fn peer_files_mapped(qp: &QueuePair) -> Result<usize> {
    with_view(qp, |v| v.files_mapped())
}

/// Raises `qp`'s copying flag, as a queue pair does while it copies a payload out of
/// its peer's memory (a descriptor record's), and leaves it raised: what a peer stopped
/// mid-copy leaves in the segment. [`end_copy`] lowers it.
pub fn stall_copy(qp: &QueuePair) -> Result<()> {
    with_conn(qp, |c| match c.seg.copy_begin(c.side) {
        true => Ok(()),
        false => Err(Error::InvalidArgument("the peer's queue pair is gone")),
    })
}

/// Lowers `qp`'s copying flag: the copy [`stall_copy`] began is over.
pub fn end_copy(qp: &QueuePair) -> Result<()> {
    with_conn(qp, |c| {
        c.seg.copy_done(c.side);
        Ok(())
    })
}

/// Writes `value` into `qp`'s claim word (0 lets go of any claim).
pub fn scribble_claim(qp: &QueuePair, value: u64) -> Result<()> {
    with_conn(qp, |c| {
        c.seg
            .claim_word(c.side)
            .store(value, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    })
}

/// Writes `value` into the target word `qp`'s peer reads (what a peer that scribbles
/// the segment can do to the words of the side it connects to).
pub fn scribble_target_word(qp: &QueuePair, value: u64) -> Result<()> {
    with_conn(qp, |c| {
        c.seg
            .target_word(c.side)
            .store(value, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    })
}

/// Whether the key table of context `ctx` can be mapped writable, as a peer holding
/// its descriptor would try (`None`: the context does not run the mapped path).
pub fn key_table_writable(ctx: &crate::Context) -> Option<bool> {
    let d = ctx.device().as_any().downcast_ref::<super::Device>()?;
    Some(d.driver.published.as_ref()?.writable())
}

/// Makes every barrier the key table of context `ctx` issues before reading its peers'
/// claims fail (or succeed again), as a kernel or filter that refuses `membarrier` at
/// run time. Returns false if the context does not issue them (it does not run the
/// mapped path, or its kernel has no global expedited barriers).
pub fn fail_barriers(ctx: &crate::Context, fail: bool) -> bool {
    let Some(d) = ctx.device().as_any().downcast_ref::<super::Device>() else {
        return false;
    };
    d.driver
        .published
        .as_ref()
        .is_some_and(|p| p.fail_barriers(fail))
}

/// How many connections context `ctx` watches for claims on its published keys (each
/// keeps its segment mapped); `None` for a context that does not run the mapped path.
pub fn watched_connections(ctx: &crate::Context) -> Option<usize> {
    let d = ctx.device().as_any().downcast_ref::<super::Device>()?;
    d.driver.published.as_ref()?;
    Some(d.driver.watch.lock().len())
}

/// Sets the length word of key `rkey`'s slot in the key table of context `ctx` to
/// `len`, as a lying target would publish it. Returns whether the key was published.
pub fn scribble_key_length(ctx: &crate::Context, rkey: u32, len: u64) -> bool {
    let Some(d) = ctx.device().as_any().downcast_ref::<super::Device>() else {
        return false;
    };
    d.driver
        .published
        .as_ref()
        .is_some_and(|p| p.scribble_len(rkey, len))
}

/// Writes `bytes` where the next record of the ring `qp` reads would start, its first
/// four (the record's kind word, which publishes it) last, ignoring every rule of the
/// ring: what a peer that is broken or hostile leaves there. The QP reads it on the next
/// poll of its CQs. (The real peer may still write too: call this while it has nothing
/// to send.)
pub fn scribble_incoming(qp: &QueuePair, bytes: &[u8]) -> Result<()> {
    let Some(link) = qp.provider_qp().as_any().downcast_ref::<SoftQp<Link>>() else {
        return Err(Error::InvalidArgument("not an shm queue pair"));
    };
    let g = link.transport.qp.inner.lock();
    let Some(conn) = g.conn.as_ref() else {
        return Err(Error::InvalidArgument("the queue pair is not connected"));
    };
    let ring = 1 - conn.side;
    let (_, data) = conn.seg.layout(ring);
    let head = g.cons.head();
    let pos = (head % conn.seg.cap() as u64) as usize;
    let n = bytes.len().min(conn.seg.cap() - pos);
    let kind = n.min(4);
    conn.seg.scribble(data + pos + kind, &bytes[kind..n]);
    conn.seg.scribble(data + pos, &bytes[..kind]);
    Ok(())
}

/// Bytes of records `qp` has read from its incoming ring so far (0 before it has its
/// connection).
pub fn incoming_read(qp: &QueuePair) -> Result<u64> {
    let Some(link) = qp.provider_qp().as_any().downcast_ref::<SoftQp<Link>>() else {
        return Err(Error::InvalidArgument("not an shm queue pair"));
    };
    let g = link.transport.qp.inner.lock();
    Ok(g.conn.as_ref().map_or(0, |_| g.cons.head()))
}

/// How many progress rounds the driver of context `ctx` has run so far (its progress
/// thread's and polling applications' together, wrapping); `None` for a context of
/// another provider.
pub fn progress_rounds(ctx: &crate::Context) -> Option<u32> {
    let d = ctx.device().as_any().downcast_ref::<super::Device>()?;
    Some(d.driver.running.lock().rounds_run())
}

/// How many connections to context `ctx`'s listener wait for their hello.
pub fn handshakes_waiting(ctx: &crate::Context) -> Option<usize> {
    let d = ctx.device().as_any().downcast_ref::<super::Device>()?;
    Some(d.driver.handshakes.lock().len())
}

/// Connects to the listener of the context `peer` names, as any local process can, and
/// sends nothing.
pub fn connect_listener(peer: &crate::QpEndpoint) -> Result<std::os::unix::net::UnixStream> {
    use std::os::linux::net::SocketAddrExt;
    let crate::PeerAddr::Unix { pid, id } = peer.addr else {
        return Err(Error::InvalidArgument("not an shm endpoint"));
    };
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(super::socket_name(pid, id))
        .map_err(|e| Error::Io("socket name", e))?;
    std::os::unix::net::UnixStream::connect_addr(&addr).map_err(|e| Error::Io("connect", e))
}

/// Timers context `ctx`'s driver holds (each a QP's deadline, due or stale).
pub fn pending_timers(ctx: &crate::Context) -> Option<usize> {
    let d = ctx.device().as_any().downcast_ref::<super::Device>()?;
    Some(d.driver.timers.lock().len())
}

/// How many wake-ups context `ctx`'s driver read from its connections' sockets (a peer
/// found it asleep and woke it).
pub fn wakes_read(ctx: &crate::Context) -> Option<u32> {
    let d = ctx.device().as_any().downcast_ref::<super::Device>()?;
    Some(d.driver.wakes.load(std::sync::atomic::Ordering::Relaxed))
}

/// Holds the progress thread of context `ctx` on its next way to sleep (its wake-up
/// flags raised and its rings found empty, `epoll_wait` not yet entered) until the guard
/// drops, and makes each of its sleeps last up to `cap` (a wake-up lost then shows as a
/// stall that long); `None` for a context of another provider.
pub fn hold_sleep(ctx: &crate::Context, cap: std::time::Duration) -> Option<SleepHeld> {
    let d = ctx.device().as_any().downcast_ref::<super::Device>()?;
    let hook = &d.driver.sleep_hook;
    hook.cap_ms.store(
        cap.as_millis().max(1) as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
    hook.hold.store(true, std::sync::atomic::Ordering::SeqCst);
    Some(SleepHeld(d.driver.clone()))
}

/// What [`hold_sleep`] returns: the thread goes on to sleep once it drops.
#[derive(Debug)]
pub struct SleepHeld(std::sync::Arc<super::driver::Driver>);

impl SleepHeld {
    /// Whether the thread waits at the hold.
    pub fn reached(&self) -> bool {
        self.0
            .sleep_hook
            .held
            .load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for SleepHeld {
    fn drop(&mut self) {
        let hook = &self.0.sleep_hook;
        hook.hold.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Whether this process has measured its copy methods ([`super::copy_method`],
/// [`super::mid_copy_method`] and [`super::large_copy_method`]), without measuring them.
pub fn copy_calibrated() -> bool {
    crate::provider::copy::calibrated()
}

static HELD: parking_lot::Mutex<Vec<u32>> = parking_lot::Mutex::new(Vec::new());
static ANY_HELD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Keeps the shm queue pairs of this process connected to the queue pair numbered
/// `peer_qpn` from reading their incoming rings until the guard drops: what a peer whose
/// progress stalled does. What arrives stays in the ring; verbs on those queue pairs
/// (posts, state changes) go on. (Queue pair numbers are per context: a queue pair of
/// another context with a peer of the same number is held too.)
pub fn hold_reads_from(peer_qpn: u32) -> ReadsHeld {
    let mut held = HELD.lock();
    held.push(peer_qpn);
    ANY_HELD.store(true, std::sync::atomic::Ordering::SeqCst);
    ReadsHeld(peer_qpn)
}

/// What [`hold_reads_from`] returns: the reads go on once it drops.
#[derive(Debug)]
pub struct ReadsHeld(u32);

impl Drop for ReadsHeld {
    fn drop(&mut self) {
        let mut held = HELD.lock();
        if let Some(i) = held.iter().position(|&q| q == self.0) {
            held.swap_remove(i);
        }
        ANY_HELD.store(!held.is_empty(), std::sync::atomic::Ordering::SeqCst);
    }
}

/// Whether reads of a queue pair connected to `peer_qpn` are held ([`hold_reads_from`]).
pub(super) fn reads_held(peer_qpn: u32) -> bool {
    ANY_HELD.load(std::sync::atomic::Ordering::Relaxed) && HELD.lock().contains(&peer_qpn)
}
