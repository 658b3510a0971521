//! The work requests posted to a queue pair, built from registered regions: local
//! scatter/gather elements checked against their region, send requests (with inline data
//! and UD destinations) and receive requests.

use rdmx_core::{PostError, RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge, SgeList, UdDest};

use crate::ah::AddressHandle;
use crate::mr::MemoryRegion;
use crate::{Error, Result};

/// A scatter/gather element in a registered region, checked against the region's bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalSge(Sge);

impl LocalSge {
    /// `len` bytes at `offset` in `mr`.
    ///
    /// Only regions that own their memory qualify: a posted request may outlive any borrow
    /// of memory registered with
    /// [`ProtectionDomain::register_raw`](crate::ProtectionDomain::register_raw) (as the
    /// registration cache does), so such memory is posted with the `unsafe` `*_raw` calls.
    pub fn new(mr: &MemoryRegion, offset: usize, len: usize) -> Result<LocalSge> {
        if !mr.owns_memory() {
            return Err(Error::InvalidArgument(
                "the region borrows its memory; post it with post_send_raw/post_recv_raw",
            ));
        }
        match offset.checked_add(len) {
            Some(end) if end <= mr.len() && len <= u32::MAX as usize => Ok(LocalSge(Sge {
                addr: (mr.addr() + offset) as u64,
                len: len as u32,
                lkey: mr.lkey(),
            })),
            _ => Err(Error::OutOfBounds {
                offset,
                len,
                region_len: mr.len(),
            }),
        }
    }

    /// The element as verbs sees it.
    pub fn sge(&self) -> Sge {
        self.0
    }
}

/// A send work request built from registered regions.
///
/// It holds up to [`INLINE_SGE`](rdmx_core::wr::INLINE_SGE) elements inline and borrows
/// any [inline](Self::inline) payload, so building and posting one with that many
/// elements allocates nothing (a longer list, up to [`MAX_SGE`](rdmx_core::wr::MAX_SGE),
/// allocates once).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendRequest<'a> {
    pub(super) wr: SendWr,
    pub(super) inline: Option<&'a [u8]>,
    /// UD: the address handle the request goes through.
    pub(super) ah: Option<&'a AddressHandle>,
    /// Elements added beyond what the list holds: the post is refused with their count.
    pub(super) overflow: usize,
}

impl<'a> SendRequest<'a> {
    /// A request doing `op`, signaled by default.
    #[inline(always)]
    pub fn new(wr_id: u64, op: SendOp) -> Self {
        SendRequest {
            wr: SendWr {
                wr_id,
                op,
                sges: SgeList::new(),
                flags: SendFlags::SIGNALED,
                ud: None,
            },
            inline: None,
            ah: None,
            overflow: 0,
        }
    }
    /// SEND.
    #[inline(always)]
    pub fn send(wr_id: u64) -> Self {
        Self::new(wr_id, SendOp::Send)
    }
    /// RDMA WRITE to `remote`.
    #[inline(always)]
    pub fn write(wr_id: u64, remote: RemoteAddr) -> Self {
        Self::new(wr_id, SendOp::Write(remote))
    }
    /// RDMA READ from `remote`.
    #[inline(always)]
    pub fn read(wr_id: u64, remote: RemoteAddr) -> Self {
        Self::new(wr_id, SendOp::Read(remote))
    }
    /// SEND with immediate data.
    #[inline(always)]
    pub fn send_with_imm(wr_id: u64, imm: u32) -> Self {
        Self::new(wr_id, SendOp::SendWithImm(imm))
    }
    /// RDMA WRITE with immediate data (consumes a receive at the peer).
    #[inline(always)]
    pub fn write_with_imm(wr_id: u64, remote: RemoteAddr, imm: u32) -> Self {
        Self::new(wr_id, SendOp::WriteWithImm(remote, imm))
    }
    /// 8-byte compare-and-swap; the old value lands in the (8-byte) local element.
    #[inline(always)]
    pub fn compare_swap(wr_id: u64, remote: RemoteAddr, compare: u64, swap: u64) -> Self {
        Self::new(
            wr_id,
            SendOp::CompareSwap {
                remote,
                compare,
                swap,
            },
        )
    }
    /// 8-byte fetch-and-add; the old value lands in the (8-byte) local element.
    #[inline(always)]
    pub fn fetch_add(wr_id: u64, remote: RemoteAddr, add: u64) -> Self {
        Self::new(wr_id, SendOp::FetchAdd { remote, add })
    }
    /// Adds a local element. More than the queue pair's `max_send_sge` are refused when
    /// the request is posted.
    #[inline(always)]
    pub fn sge(mut self, sge: LocalSge) -> Self {
        if self.wr.sges.try_push(sge.0).is_err() {
            self.overflow += 1;
        }
        self
    }
    /// Sends the datagram through `ah` to QP `remote_qpn` with Q_Key `remote_qkey` (UD
    /// only; `ibv_send_wr.wr.ud`). A Q_Key with the high bit set sends the QP's own. To a
    /// multicast group: an [`AhAttr::multicast`](crate::AhAttr::multicast) handle and
    /// [`MULTICAST_QPN`](crate::MULTICAST_QPN).
    #[inline(always)]
    pub fn ud(mut self, ah: &'a AddressHandle, remote_qpn: u32, remote_qkey: u32) -> Self {
        self.wr.ud = Some(UdDest {
            av: ah.attr().av(),
            remote_qpn,
            remote_qkey,
        });
        self.ah = Some(ah);
        self
    }
    /// No completion on success (selective signaling).
    #[inline(always)]
    pub fn unsignaled(mut self) -> Self {
        self.wr.flags.remove(SendFlags::SIGNALED);
        self
    }
    /// Wait for earlier READs and atomics before starting.
    #[inline(always)]
    pub fn fence(mut self) -> Self {
        self.wr.flags |= SendFlags::FENCE;
        self
    }
    /// Ask for a solicited event at the receiver.
    #[inline(always)]
    pub fn solicited(mut self) -> Self {
        self.wr.flags |= SendFlags::SOLICITED;
        self
    }
    /// Replaces the flags (SIGNALED is on by default; pass it to keep it).
    #[inline(always)]
    pub fn flags(mut self, flags: SendFlags) -> Self {
        self.wr.flags = flags;
        self
    }
    /// Sends `data` inline: copied at post time, no local key needed.
    #[inline(always)]
    pub fn inline(mut self, data: &'a [u8]) -> Self {
        self.wr.flags |= SendFlags::INLINE;
        self.wr.sges.clear();
        self.overflow = 0;
        self.inline = Some(data);
        self
    }
    /// Replaces the work request id: for a request (or a list) built once and posted
    /// again and again, as perftest reuses its work requests.
    #[inline(always)]
    pub fn set_wr_id(&mut self, wr_id: u64) {
        self.wr.wr_id = wr_id;
    }
    /// Asks for a completion on success, or not (selective signaling), on a request
    /// built once and posted again.
    #[inline(always)]
    pub fn set_signaled(&mut self, signaled: bool) {
        self.wr.flags.set(SendFlags::SIGNALED, signaled);
    }
    /// The work request.
    pub fn wr(&self) -> &SendWr {
        &self.wr
    }
    /// The inline payload, if any.
    pub fn inline_data(&self) -> Option<&'a [u8]> {
        self.inline
    }
    /// Refuses a request given more elements than any list holds.
    pub(super) fn check_overflow(&self) -> Result<()> {
        if self.overflow == 0 {
            return Ok(());
        }
        Err(PostError::TooManySges {
            count: self.wr.sges.len() + self.overflow,
            max: rdmx_core::wr::MAX_SGE,
        }
        .into())
    }
}

/// A receive work request built from registered regions; like [`SendRequest`] it holds
/// its elements inline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecvRequest {
    pub(super) wr: RecvWr,
    /// Elements added beyond what the list holds: the post is refused with their count.
    pub(super) overflow: usize,
}

impl RecvRequest {
    /// A receive with no elements yet.
    #[inline(always)]
    pub fn new(wr_id: u64) -> Self {
        RecvRequest {
            wr: RecvWr {
                wr_id,
                sges: SgeList::new(),
            },
            overflow: 0,
        }
    }
    /// Adds a local element. More than the queue pair's `max_recv_sge` are refused when
    /// the request is posted.
    #[inline]
    pub fn sge(mut self, sge: LocalSge) -> Self {
        if self.wr.sges.try_push(sge.0).is_err() {
            self.overflow += 1;
        }
        self
    }
    /// The work request.
    pub fn wr(&self) -> &RecvWr {
        &self.wr
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_built_once_takes_new_ids_and_signaling() {
        let remote = RemoteAddr { addr: 64, rkey: 7 };
        let mut req = SendRequest::write(1, remote).unsignaled().fence();
        req.set_wr_id(42);
        req.set_signaled(true);
        assert_eq!(req.wr().wr_id, 42);
        assert_eq!(req.wr().flags, SendFlags::SIGNALED | SendFlags::FENCE);
        req.set_signaled(false);
        assert_eq!(req.wr().flags, SendFlags::FENCE);
        assert_eq!(req.wr().op, SendOp::Write(remote));
    }
}
