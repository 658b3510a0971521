//! Owned handles for the queue objects (QP, SRQ, address handle) and the work requests
//! posted to them, in libibverbs' own layout (`ibv_send_wr` with its SGE list held
//! inline, `ibv_recv_wr`).

use std::io;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use super::{check, ffi, last_error, Cq, Pd};

/// Sizes asked for at QP creation, and what the device granted.
pub(crate) type QpCap = ffi::ibv_qp_cap;
/// `ibv_qp_attr`.
pub(crate) type QpAttr = ffi::ibv_qp_attr;
/// `ibv_ah_attr`: an address vector.
pub(crate) type AhAttr = ffi::ibv_ah_attr;

/// A new all-zero `ibv_qp_attr`.
pub(crate) fn qp_attr() -> QpAttr {
    // SAFETY: ibv_qp_attr is plain data; all-zero is a valid value.
    unsafe { std::mem::zeroed() }
}

/// Sets the address vector of `attr` for a RoCE or IB path: the peer's GID (always with a
/// GRH, as RoCE requires) or, when `dgid` is `None`, its LID.
pub(crate) fn set_av(
    attr: &mut QpAttr,
    port: u8,
    sgid_index: u8,
    dgid: Option<[u8; 16]>,
    dlid: u16,
) {
    attr.ah_attr.port_num = port;
    attr.ah_attr.dlid = dlid;
    if let Some(raw) = dgid {
        attr.ah_attr.is_global = 1;
        attr.ah_attr.grh.dgid = ffi::ibv_gid { raw };
        attr.ah_attr.grh.sgid_index = sgid_index;
        attr.ah_attr.grh.hop_limit = 64;
    }
}

/// An RC queue pair (`ibv_qp`).
pub(crate) struct Qp {
    ptr: NonNull<ffi::ibv_qp>,
    _pd: Arc<Pd>,
    _cqs: (Arc<Cq>, Arc<Cq>),
    _srq: Option<Arc<Srq>>,
}

// SAFETY: see Context.
unsafe impl Send for Qp {}
// SAFETY: see Context.
unsafe impl Sync for Qp {}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: the QP is destroyed once; its CQs, SRQ and PD outlive it (Arcs).
        let rc = unsafe { ffi::ibv_destroy_qp(self.ptr.as_ptr()) };
        if rc != 0 {
            tracing::error!(
                errno = rc,
                "verbs: ibv_destroy_qp failed; the queue pair lives on in the adapter"
            );
        }
    }
}

impl Qp {
    /// `ibv_create_qp` for a QP of `qp_type` (IBV_QPT_*); `cap` is updated with what the
    /// device granted.
    pub(crate) fn create(
        pd: &Arc<Pd>,
        qp_type: u32,
        send_cq: &Arc<Cq>,
        recv_cq: &Arc<Cq>,
        srq: Option<&Arc<Srq>>,
        cap: &mut QpCap,
    ) -> io::Result<Qp> {
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: send_cq.cq.as_ptr(),
            recv_cq: recv_cq.cq.as_ptr(),
            srq: srq.map_or(ptr::null_mut(), |s| s.ptr.as_ptr()),
            cap: *cap,
            qp_type,
            sq_sig_all: 0,
        };
        // SAFETY: the PD, CQs and SRQ are live objects of one context; `init` is valid.
        let p = unsafe { ffi::ibv_create_qp(pd.ptr.as_ptr(), &mut init) };
        let ptr = NonNull::new(p).ok_or_else(|| last_error(libc::EINVAL))?;
        *cap = init.cap;
        Ok(Qp {
            ptr,
            _pd: pd.clone(),
            _cqs: (send_cq.clone(), recv_cq.clone()),
            _srq: srq.cloned(),
        })
    }

    /// The QP number.
    pub(crate) fn qp_num(&self) -> u32 {
        // SAFETY: reading a field of the live QP.
        unsafe { (*self.ptr.as_ptr()).qp_num }
    }

    /// `ibv_modify_qp` with IBV_QP_* `mask`.
    pub(crate) fn modify(&self, attr: &mut QpAttr, mask: u32) -> io::Result<()> {
        // SAFETY: the QP is live and `attr` a valid attribute block.
        check(unsafe { ffi::ibv_modify_qp(self.ptr.as_ptr(), attr, mask as i32) })
    }

    /// `ibv_attach_mcast` (`attach`) or `ibv_detach_mcast` of multicast group `gid`.
    pub(crate) fn mcast(&self, attach: bool, gid: [u8; 16], lid: u16) -> io::Result<()> {
        let gid = ffi::ibv_gid { raw: gid };
        let qp = self.ptr.as_ptr();
        // SAFETY: the QP is live (a UD one, checked by the caller) and `gid` valid.
        check(unsafe {
            if attach {
                ffi::ibv_attach_mcast(qp, &gid, lid)
            } else {
                ffi::ibv_detach_mcast(qp, &gid, lid)
            }
        })
    }

    /// The state as `ibv_query_qp` reports it (an `ibv_qp_state` value).
    pub(crate) fn query_state(&self) -> io::Result<u32> {
        let mut attr = qp_attr();
        // SAFETY: ibv_qp_init_attr is plain data; all-zero is a valid value.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE as i32;
        // SAFETY: the QP is live and both out-pointers are valid.
        check(unsafe { ffi::ibv_query_qp(self.ptr.as_ptr(), &mut attr, mask, &mut init) })?;
        Ok(attr.qp_state)
    }

    /// `ibv_post_send` of one request.
    ///
    /// # Safety
    ///
    /// The memory the request names through its keys must stay valid until its completion
    /// is reaped (or the QP is destroyed).
    pub(crate) unsafe fn post_send(&self, wr: &mut SendWr) -> io::Result<()> {
        wr.wr.sg_list = wr.sges.as_mut_ptr();
        wr.wr.num_sge = wr.len as i32;
        let mut bad = ptr::null_mut();
        // SAFETY: `wr` is one well-formed request whose SGE list lives across the call; the
        // caller keeps the memory it names valid.
        check(unsafe { ffi::ibv_post_send(self.ptr.as_ptr(), &mut wr.wr, &mut bad) })
    }

    /// `ibv_post_recv` of one request with `sges`.
    ///
    /// # Safety
    ///
    /// As [`post_send`](Self::post_send).
    pub(crate) unsafe fn post_recv(&self, wr_id: u64, sges: &mut [ffi::ibv_sge]) -> io::Result<()> {
        let mut wr = recv_wr(wr_id, sges);
        let mut bad = ptr::null_mut();
        // SAFETY: `wr` is well formed and its SGEs live across the call; the caller keeps
        // the memory valid.
        check(unsafe { ffi::ibv_post_recv(self.ptr.as_ptr(), &mut wr, &mut bad) })
    }
}

fn recv_wr(wr_id: u64, sges: &mut [ffi::ibv_sge]) -> ffi::ibv_recv_wr {
    ffi::ibv_recv_wr {
        wr_id,
        next: ptr::null_mut(),
        sg_list: sges.as_mut_ptr(),
        num_sge: sges.len() as i32,
    }
}

/// A scatter/gather element.
pub(crate) type Sge = ffi::ibv_sge;

/// An `ibv_send_wr` with its SGE list, held inline.
pub(crate) struct SendWr {
    wr: ffi::ibv_send_wr,
    sges: [Sge; rdmx_core::wr::MAX_SGE],
    len: usize,
}

/// Up to [`MAX_SGE`](rdmx_core::wr::MAX_SGE) elements in `ibv_sge` form, without a heap
/// allocation.
pub(crate) struct SgeArray {
    sges: [Sge; rdmx_core::wr::MAX_SGE],
    len: usize,
}

impl SgeArray {
    /// The elements of `list` (which holds at most `MAX_SGE`).
    pub(crate) fn new(list: &[rdmx_core::Sge]) -> SgeArray {
        let mut sges = [Sge {
            addr: 0,
            length: 0,
            lkey: 0,
        }; rdmx_core::wr::MAX_SGE];
        for (hw, s) in sges.iter_mut().zip(list) {
            *hw = Sge {
                addr: s.addr,
                length: s.len,
                lkey: s.lkey,
            };
        }
        SgeArray {
            sges,
            len: list.len().min(rdmx_core::wr::MAX_SGE),
        }
    }

    /// One element naming `data` with no key (for an inline send).
    pub(crate) fn inline(data: &[u8]) -> SgeArray {
        let mut a = SgeArray::new(&[]);
        a.sges[0] = Sge {
            addr: data.as_ptr() as u64,
            length: data.len() as u32,
            lkey: 0,
        };
        a.len = 1;
        a
    }

    /// The elements.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [Sge] {
        &mut self.sges[..self.len]
    }
}

/// What a send request does, in `ibv_send_wr` terms.
#[derive(Clone, Copy, Debug)]
pub(crate) enum SendKind {
    Send,
    SendImm(u32),
    Write(u64, u32),
    WriteImm(u64, u32, u32),
    Read(u64, u32),
    CompareSwap(u64, u32, u64, u64),
    FetchAdd(u64, u32, u64),
}

impl SendWr {
    /// A request of `kind` with IBV_SEND_* `flags` and `sges`.
    pub(crate) fn new(wr_id: u64, kind: SendKind, flags: u32, sges: SgeArray) -> SendWr {
        // SAFETY: ibv_send_wr is plain data (pointers, integers, unions of them); all-zero
        // is a valid value.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.send_flags = flags;
        use ffi::ibv_wr_opcode as op;
        let rdma = |remote_addr, rkey| ffi::ibv_send_wr_wr {
            rdma: ffi::ibv_send_wr_rdma { remote_addr, rkey },
        };
        let atomic = |remote_addr, rkey, compare_add, swap| ffi::ibv_send_wr_wr {
            atomic: ffi::ibv_send_wr_atomic {
                remote_addr,
                compare_add,
                swap,
                rkey,
            },
        };
        let imm = |v: u32| ffi::ibv_send_wr_imm {
            imm_data: v.to_be(),
        };
        match kind {
            SendKind::Send => wr.opcode = op::IBV_WR_SEND,
            SendKind::SendImm(v) => {
                wr.opcode = op::IBV_WR_SEND_WITH_IMM;
                wr.__bindgen_anon_1 = imm(v);
            }
            SendKind::Write(a, k) => {
                wr.opcode = op::IBV_WR_RDMA_WRITE;
                wr.wr = rdma(a, k);
            }
            SendKind::WriteImm(a, k, v) => {
                wr.opcode = op::IBV_WR_RDMA_WRITE_WITH_IMM;
                wr.wr = rdma(a, k);
                wr.__bindgen_anon_1 = imm(v);
            }
            SendKind::Read(a, k) => {
                wr.opcode = op::IBV_WR_RDMA_READ;
                wr.wr = rdma(a, k);
            }
            SendKind::CompareSwap(a, k, c, s) => {
                wr.opcode = op::IBV_WR_ATOMIC_CMP_AND_SWP;
                wr.wr = atomic(a, k, c, s);
            }
            SendKind::FetchAdd(a, k, add) => {
                wr.opcode = op::IBV_WR_ATOMIC_FETCH_AND_ADD;
                wr.wr = atomic(a, k, add, 0);
            }
        }
        SendWr {
            wr,
            sges: sges.sges,
            len: sges.len,
        }
    }
}

impl SendWr {
    /// Makes the request a UD send through `ah` to QP `remote_qpn` with Q_Key
    /// `remote_qkey`.
    pub(crate) fn set_ud(&mut self, ah: &Ah, remote_qpn: u32, remote_qkey: u32) {
        self.wr.wr = ffi::ibv_send_wr_wr {
            ud: ffi::ibv_send_wr_ud {
                ah: ah.ptr.as_ptr(),
                remote_qpn,
                remote_qkey,
            },
        };
    }
}

/// An address handle (`ibv_ah`).
pub(crate) struct Ah {
    ptr: NonNull<ffi::ibv_ah>,
    _pd: Arc<Pd>,
}

// SAFETY: see Context.
unsafe impl Send for Ah {}
// SAFETY: see Context.
unsafe impl Sync for Ah {}

impl Drop for Ah {
    fn drop(&mut self) {
        // SAFETY: the AH is destroyed once; sends through it hold an Arc until they
        // complete, and its PD outlives it.
        unsafe { ffi::ibv_destroy_ah(self.ptr.as_ptr()) };
    }
}

impl Ah {
    /// `ibv_create_ah` in `pd` for the GID `dgid` (with a GRH, as RoCE requires) from GID
    /// index `sgid_index` of `port`.
    pub(crate) fn create(
        pd: &Arc<Pd>,
        port: u8,
        sgid_index: u8,
        dgid: [u8; 16],
        dlid: u16,
        sl: u8,
        hop_limit: u8,
    ) -> io::Result<Ah> {
        // SAFETY: ibv_ah_attr is plain data; all-zero is a valid value.
        let mut attr: AhAttr = unsafe { std::mem::zeroed() };
        attr.port_num = port;
        attr.dlid = dlid;
        attr.sl = sl;
        attr.is_global = 1;
        attr.grh.dgid = ffi::ibv_gid { raw: dgid };
        attr.grh.sgid_index = sgid_index;
        attr.grh.hop_limit = hop_limit;
        // SAFETY: the PD is live; `attr` is a valid attribute block for the call.
        let p = unsafe { ffi::ibv_create_ah(pd.ptr.as_ptr(), &mut attr) };
        let ptr = NonNull::new(p).ok_or_else(|| last_error(libc::EINVAL))?;
        Ok(Ah {
            ptr,
            _pd: pd.clone(),
        })
    }
}

/// A shared receive queue (`ibv_srq`).
pub(crate) struct Srq {
    ptr: NonNull<ffi::ibv_srq>,
    _pd: Arc<Pd>,
}

// SAFETY: see Context.
unsafe impl Send for Srq {}
// SAFETY: see Context.
unsafe impl Sync for Srq {}

impl Drop for Srq {
    fn drop(&mut self) {
        // SAFETY: QPs using the SRQ hold an Arc to it, so none is left.
        unsafe { ffi::ibv_destroy_srq(self.ptr.as_ptr()) };
    }
}

impl Srq {
    /// `ibv_create_srq`.
    pub(crate) fn create(pd: &Arc<Pd>, max_wr: u32, max_sge: u32) -> io::Result<Srq> {
        let mut init = ffi::ibv_srq_init_attr {
            srq_context: ptr::null_mut(),
            attr: ffi::ibv_srq_attr {
                max_wr,
                max_sge,
                srq_limit: 0,
            },
        };
        // SAFETY: the PD is live and `init` valid.
        let p = unsafe { ffi::ibv_create_srq(pd.ptr.as_ptr(), &mut init) };
        Ok(Srq {
            ptr: NonNull::new(p).ok_or_else(|| last_error(libc::EINVAL))?,
            _pd: pd.clone(),
        })
    }

    /// `ibv_modify_srq` of the limit (0 disarms).
    pub(crate) fn arm_limit(&self, limit: u32) -> io::Result<()> {
        let mut attr = ffi::ibv_srq_attr {
            max_wr: 0,
            max_sge: 0,
            srq_limit: limit,
        };
        let mask = ffi::ibv_srq_attr_mask::IBV_SRQ_LIMIT as i32;
        // SAFETY: the SRQ is live and `attr` valid.
        check(unsafe { ffi::ibv_modify_srq(self.ptr.as_ptr(), &mut attr, mask) })
    }

    /// The SRQ's address, as async events name it.
    pub(crate) fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// `ibv_post_srq_recv` of one request.
    ///
    /// # Safety
    ///
    /// As [`Qp::post_send`].
    pub(crate) unsafe fn post_recv(&self, wr_id: u64, sges: &mut [Sge]) -> io::Result<()> {
        let mut wr = recv_wr(wr_id, sges);
        let mut bad = ptr::null_mut();
        // SAFETY: as in Qp::post_recv.
        check(unsafe { ffi::ibv_post_srq_recv(self.ptr.as_ptr(), &mut wr, &mut bad) })
    }
}
