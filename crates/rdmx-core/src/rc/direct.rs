//! Requests a transport executes itself, at post time, when the peer's memory is its to
//! reach (a peer queue pair in the same process): an RDMA WRITE or READ that nothing
//! earlier on the send queue could be overtaken by.
//!
//! The initiator asks [`RcQp::direct_request`] whether a request qualifies, and gets it
//! validated with its local keys resolved; the transport then asks the target's engine
//! with [`RcQp::direct_target`] whether it would accept the access now, exactly as its
//! responder checks a request packet (state, the QP's access flags, the rkey's
//! protection domain, rights and bounds). When both agree, the transport copies the
//! bytes and completes the request with [`RcQp::direct_complete`]; when either says no,
//! the request is posted as usual ([`RcQp::post_send_ref`]) and the packets carry it,
//! errors included, so a refused access gets the responder's own answer. A transport
//! that resolves a request's local bytes itself (one element it has on loan, or inline
//! bytes) takes the same checks with [`RcQp::direct_ready`] and completes the request
//! with [`RcQp::direct_done`], building no [`DirectRequest`].
//!
//! A direct request takes no PSN on either side and leaves both engines' sequence state
//! as it was: the packets that follow it continue where the last ones stopped.

use super::{resolve_sge, CqSide, MemAccess, RcQp, Seg};
use crate::access::Access;
use crate::mr::KeyUse;
use crate::qp::{QpState, QpType};
use crate::wr::{
    Completion, RemoteAddr, SendFlags, SendOp, SendWr, WcOpcode, WcStatus, INLINE_SGE,
};

/// An RDMA WRITE or READ validated for execution by the transport: its local memory
/// (resolved segments, or the inline bytes the caller holds) and its remote target.
///
/// It lives only while the transport executes it, so it holds its segments in place
/// (up to [`INLINE_SGE`]; a request with more takes the packets): building one
/// allocates nothing.
#[derive(Debug)]
pub struct DirectRequest<Mr> {
    wr_id: u64,
    /// The remote address and rkey.
    remote: (u64, u32),
    read: bool,
    signaled: bool,
    len: u32,
    segs: [Option<Seg<Mr>>; INLINE_SGE],
}

impl<Mr> DirectRequest<Mr> {
    /// Whether it is a READ (the bytes go from the target to the local segments).
    pub fn is_read(&self) -> bool {
        self.read
    }

    /// The remote address and rkey.
    pub fn remote(&self) -> (u64, u32) {
        self.remote
    }

    /// Bytes moved.
    pub fn len(&self) -> u32 {
        self.len
    }

    /// Whether it moves nothing (never: zero-length requests take the packets).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The local memory, in order: region, address, length of each segment. Empty for
    /// an inline WRITE (the bytes are the caller's inline data).
    pub fn local(&self) -> impl Iterator<Item = (&Mr, u64, u32)> {
        self.segs
            .iter()
            .map_while(|s| s.as_ref().map(|s| (&s.mr, s.addr, s.len)))
    }
}

impl<M: MemAccess> RcQp<M> {
    /// `wr` as a request the transport may execute at once, or `None` when it must be
    /// posted with [`post_send_ref`](Self::post_send_ref): only an RDMA WRITE (without
    /// immediate data) or READ on an RC queue pair, or an RDMA WRITE on a UC one, in
    /// RTS, with an empty send queue (nothing posted earlier is outstanding, so nothing
    /// can be overtaken and no fence can be pending), of a non-zero length, valid as a
    /// post and whose local keys resolve. Anything else, a malformed request or a bad
    /// local key included, is left to `post_send_ref`, which reports it as usual.
    ///
    /// On a UC queue pair the transport must also know that every packet it sent before
    /// has been handled by the peer (UC requests complete when sent).
    ///
    /// The local keys are resolved through `mem`, which may be another view of the
    /// engine's memory than the one it was built with: one that lends its regions for the
    /// time the transport executes the request (the request's `Mr`), rather than one
    /// that hands out references keeping them alive beyond it.
    pub fn direct_request<N: MemAccess>(
        &mut self,
        mem: &N,
        wr: &SendWr,
        inline: Option<&[u8]>,
    ) -> Option<DirectRequest<N::Mr>> {
        let remote = self.direct_ready(wr, inline)?;
        let mut segs: [Option<Seg<N::Mr>>; INLINE_SGE] = Default::default();
        let len = match inline {
            Some(data) => data.len() as u64,
            None => {
                let need = if wr.op.writes_local() {
                    Access::LOCAL_WRITE
                } else {
                    Access::empty()
                };
                let mut len = 0u64;
                for (slot, s) in segs.iter_mut().zip(wr.sges.iter()) {
                    *slot = Some(resolve_sge(mem, self.cfg.pd, s, need)?);
                    len += u64::from(s.len);
                }
                len
            }
        };
        let Ok(len @ 1..) = u32::try_from(len) else {
            return None;
        };
        Some(DirectRequest {
            wr_id: wr.wr_id,
            remote: (remote.addr, remote.rkey),
            read: matches!(wr.op, SendOp::Read(_)),
            signaled: wr.flags.contains(SendFlags::SIGNALED),
            len,
            segs,
        })
    }

    /// The checks of [`direct_request`](Self::direct_request) that need no memory: the
    /// request's type, the queue pair's state and send queue, and the request as a post.
    /// Returns the request's remote address and rkey if it passes them. Its local
    /// elements (at most [`INLINE_SGE`]) are then still to be resolved, as
    /// `direct_request` resolves them, and its length to be checked non-zero: a transport
    /// that does both itself, for a request it executes without building a
    /// [`DirectRequest`], completes it with [`direct_done`](Self::direct_done).
    pub fn direct_ready(&self, wr: &SendWr, inline: Option<&[u8]>) -> Option<RemoteAddr> {
        let remote = match (self.cfg.qp_type, wr.op) {
            (QpType::Rc, SendOp::Write(r) | SendOp::Read(r)) | (QpType::Uc, SendOp::Write(r)) => r,
            _ => return None,
        };
        if self.sm.state() != QpState::Rts
            || !self.req.sq.is_empty()
            || wr.ud.is_some()
            || wr.sges.len() > INLINE_SGE
            || wr
                .check(inline, self.cfg.max_send_sge, self.cfg.max_inline_data)
                .is_err()
        {
            return None;
        }
        Some(remote)
    }

    /// The region a peer's direct `req` reaches on this (the target) queue pair, if this
    /// QP's responder would accept the request's packets now: a connected QP of the
    /// request's type in RTR, RTS or SQD, whose access flags grant the access, and
    /// whose table has the rkey, in this QP's protection domain, with the access and
    /// covering the range. `None`: the request must take the packets.
    ///
    /// As for [`direct_request`](Self::direct_request), `mem` may be a view of this
    /// engine's memory that lends the region for the time of the copy.
    pub fn direct_target<N: MemAccess, Mr>(
        &self,
        mem: &N,
        req: &DirectRequest<Mr>,
        peer_type: QpType,
    ) -> Option<N::Mr> {
        if self.cfg.qp_type != peer_type
            || !matches!(self.sm.state(), QpState::Rtr | QpState::Rts | QpState::Sqd)
        {
            return None;
        }
        let need = if req.is_read() {
            Access::REMOTE_READ
        } else {
            Access::REMOTE_WRITE
        };
        if !self.sm.attrs().qp_access_flags.contains(need) {
            return None;
        }
        let (va, rkey) = req.remote();
        mem.resolve(
            rkey,
            KeyUse::Remote,
            self.cfg.pd,
            va,
            u64::from(req.len),
            need,
        )
        .ok()
    }

    /// What a peer that executes requests on this (the target) queue pair from another
    /// process needs to know of it, to check them as [`direct_target`](Self::direct_target)
    /// does: its protection domain, access flags and type, when its responder accepts
    /// requests now (RTR, RTS or SQD); `None` otherwise.
    pub fn direct_target_view(&self) -> Option<(crate::mr::PdId, Access, QpType)> {
        if !matches!(self.sm.state(), QpState::Rtr | QpState::Rts | QpState::Sqd) {
            return None;
        }
        Some((
            self.cfg.pd,
            self.sm.attrs().qp_access_flags,
            self.cfg.qp_type,
        ))
    }

    /// The transport executed `req`: its completion (when signalled) joins the others,
    /// after every earlier one.
    pub fn direct_complete<Mr>(&mut self, req: DirectRequest<Mr>) {
        self.direct_done(req.wr_id, req.read, req.len, req.signaled);
    }

    /// The transport executed the request `wr_id` that passed
    /// [`direct_ready`](Self::direct_ready), a READ or a WRITE of `len` bytes, signaled
    /// or not: as [`direct_complete`](Self::direct_complete).
    pub fn direct_done(&mut self, wr_id: u64, read: bool, len: u32, signaled: bool) {
        if signaled {
            let c = Completion {
                wr_id,
                status: WcStatus::Success,
                opcode: match read {
                    true => WcOpcode::RdmaRead,
                    false => WcOpcode::RdmaWrite,
                },
                byte_len: len,
                imm_data: None,
                qp_num: self.cfg.qpn,
                src_qp: 0,
                grh: false,
            };
            self.completions.push_back((CqSide::Send, c, false));
        }
    }
}
