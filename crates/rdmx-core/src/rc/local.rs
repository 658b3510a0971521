//! A request's local memory as the engine holds it: the segments its local keys resolved
//! to (or its inline bytes), and the spare vectors they come from and go back to.

use super::MemAccess;
use crate::access::Access;
use crate::mr::{KeyUse, PdId};
use crate::wr::WcStatus;

/// A local memory segment resolved at post time.
#[derive(Clone, Debug)]
pub(crate) struct Seg<Mr> {
    pub(crate) mr: Mr,
    pub(crate) addr: u64,
    pub(crate) len: u32,
}

/// Where a request's local bytes are.
#[derive(Clone, Debug)]
pub(crate) enum Local<Mr> {
    Segs(Vec<Seg<Mr>>),
    Inline(Vec<u8>),
}

impl<Mr> Local<Mr> {
    pub(crate) fn len(&self) -> u64 {
        match self {
            Local::Segs(s) => s.iter().map(|s| u64::from(s.len)).sum(),
            Local::Inline(v) => v.len() as u64,
        }
    }
}

/// The buffers of finished requests, kept for the next ones.
///
/// A posted request needs room for its resolved segments (or its inline bytes); an adapter
/// keeps that room in a ring of work-queue entries sized when the queue is created. The
/// engine gets the same effect lazily: a request's vectors come from here and go back here
/// when it completes, emptied (so no region is kept alive by a spare), and once the queues
/// have been as full as they get, posting and completing allocate nothing.
#[derive(Debug)]
pub(crate) struct Spare<Mr> {
    segs: Vec<Vec<Seg<Mr>>>,
    bytes: Vec<Vec<u8>>,
    /// Most vectors of each kind kept: the requests that can be outstanding at once.
    max: usize,
    /// Room a new segment vector gets: the most SGEs a request may have.
    max_sge: usize,
    /// Room a new byte vector gets: the largest inline payload.
    max_inline: usize,
}

impl<Mr> Spare<Mr> {
    pub(crate) fn new(max: usize, max_sge: usize, max_inline: usize) -> Self {
        Spare {
            segs: Vec::new(),
            bytes: Vec::new(),
            max,
            max_sge,
            max_inline,
        }
    }

    /// An empty segment vector with room for any request's SGEs.
    pub(crate) fn segs(&mut self) -> Vec<Seg<Mr>> {
        self.segs
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(self.max_sge))
    }

    /// An empty byte vector with room for any inline payload.
    pub(crate) fn bytes(&mut self) -> Vec<u8> {
        self.bytes
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(self.max_inline))
    }

    /// Takes back a request's segment vector.
    pub(crate) fn put_segs(&mut self, mut v: Vec<Seg<Mr>>) {
        v.clear();
        if v.capacity() > 0 && self.segs.len() < self.max {
            self.segs.push(v);
        }
    }

    /// Takes back a request's local data.
    pub(crate) fn put_local(&mut self, local: Local<Mr>) {
        match local {
            Local::Segs(v) => self.put_segs(v),
            Local::Inline(mut v) => {
                v.clear();
                if v.capacity() > 0 && self.bytes.len() < self.max {
                    self.bytes.push(v);
                }
            }
        }
    }
}

/// Resolves local elements at post time into `segs` (emptied first); the first that fails
/// its check makes the request complete with `LOC_PROT_ERR`, and leaves `segs` empty.
pub(crate) fn resolve_sges<M: MemAccess>(
    mem: &M,
    pd: PdId,
    sges: &[crate::wr::Sge],
    need: Access,
    segs: &mut Vec<Seg<M::Mr>>,
) -> Option<WcStatus> {
    segs.clear();
    for s in sges {
        match resolve_sge(mem, pd, s, need) {
            Some(seg) => segs.push(seg),
            None => {
                segs.clear();
                return Some(WcStatus::LocProtErr);
            }
        }
    }
    None
}

/// One local element as a segment, if its key grants a QP in `pd` the access `need` to
/// the element's bytes.
pub(crate) fn resolve_sge<M: MemAccess>(
    mem: &M,
    pd: PdId,
    s: &crate::wr::Sge,
    need: Access,
) -> Option<Seg<M::Mr>> {
    let mr = mem
        .resolve(s.lkey, KeyUse::Local, pd, s.addr, u64::from(s.len), need)
        .ok()?;
    Some(Seg {
        mr,
        addr: s.addr,
        len: s.len,
    })
}

/// Calls `f(segment, address, range)` for each piece of bytes `[off, off + len)` of the
/// concatenated segments, where `range` is the piece's place in those `len` bytes.
pub(crate) fn for_each_span<Mr>(
    segs: &[Seg<Mr>],
    off: u64,
    len: usize,
    mut f: impl FnMut(&Seg<Mr>, u64, std::ops::Range<usize>),
) {
    let mut skip = off;
    let mut at = 0;
    for s in segs {
        if at == len {
            break;
        }
        let slen = u64::from(s.len);
        if skip >= slen {
            skip -= slen;
            continue;
        }
        let n = ((slen - skip) as usize).min(len - at);
        f(s, s.addr + skip, at..at + n);
        at += n;
        skip = 0;
    }
}
