//! The one place rdmx calls libibverbs: owned handles for the verbs objects (device
//! context, PD, MR, completion channel, CQ, QP, SRQ), each destroyed on drop, and the
//! data-path calls on them. Everything above this module is safe code.
//!
//! This file holds the device and its resources (context, PD, MR, CQ with its channel)
//! and the constants the provider maps; [`queue`] the queue objects (QP, SRQ, address
//! handle) and the work requests posted to them.
//!
//! libibverbs is loaded at run time (see [`ffi`](super::ffi)), so a machine without
//! rdma-core sees no devices instead of failing to start.

use std::ffi::CStr;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::RawFd;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use super::ffi;

mod queue;

pub(crate) use queue::{
    qp_attr, set_av, Ah, AhAttr, Qp, QpAttr, QpCap, SendKind, SendWr, SgeArray, Srq,
};

/// The errno of a failed verb, or `fallback` when the call reported none.
fn last_error(fallback: i32) -> io::Error {
    match io::Error::last_os_error().raw_os_error() {
        Some(e) if e != 0 => io::Error::from_raw_os_error(e),
        _ => io::Error::from_raw_os_error(fallback),
    }
}

/// A verb's return code as a result: 0 is success, anything else an errno (negative or
/// positive, as providers differ).
fn check(rc: i32) -> io::Result<()> {
    match rc {
        0 => Ok(()),
        rc => Err(io::Error::from_raw_os_error(rc.abs())),
    }
}

/// Names of the RDMA devices rdma-core sees, in its order.
pub(crate) fn device_names() -> io::Result<Vec<String>> {
    let mut n = 0;
    // SAFETY: ibv_get_device_list writes the count to `n` and returns a list we free below.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Err(last_error(libc::ENODEV));
    }
    let mut names = Vec::with_capacity(n.max(0) as usize);
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` valid device pointers until it is freed.
        let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(*list.add(i))) };
        names.push(name.to_string_lossy().into_owned());
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { ffi::ibv_free_device_list(list) };
    Ok(names)
}

/// An open device (`ibv_context`).
pub(crate) struct Context {
    ptr: NonNull<ffi::ibv_context>,
}

// SAFETY: libibverbs objects are thread-safe (verbs calls may be made from any thread).
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every object made from this context holds an Arc to it, so none is left.
        unsafe { ffi::ibv_close_device(self.ptr.as_ptr()) };
    }
}

impl Context {
    /// Opens the device called `name`.
    pub(crate) fn open(name: &str) -> io::Result<Context> {
        let mut n = 0;
        // SAFETY: as in device_names.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(last_error(libc::ENODEV));
        }
        let mut ctx = Err(io::Error::from_raw_os_error(libc::ENODEV));
        for i in 0..n.max(0) as usize {
            // SAFETY: the list holds `n` valid device pointers until it is freed.
            let dev = unsafe { *list.add(i) };
            // SAFETY: `dev` is a valid device of the list.
            let this = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(dev)) };
            if this.to_bytes() == name.as_bytes() {
                // SAFETY: `dev` is valid; the context outlives the list (verbs allows it).
                let p = unsafe { ffi::ibv_open_device(dev) };
                ctx = NonNull::new(p)
                    .map(|ptr| Context { ptr })
                    .ok_or_else(|| last_error(libc::EIO));
                break;
            }
        }
        // SAFETY: `list` came from ibv_get_device_list and is freed once.
        unsafe { ffi::ibv_free_device_list(list) };
        ctx
    }

    /// Whether the device runs the iWARP transport (`ibv_device.transport_type`).
    pub(crate) fn is_iwarp(&self) -> bool {
        // SAFETY: an open context points to its device, which libibverbs keeps alive.
        let t = unsafe { (*(*self.ptr.as_ptr()).device).transport_type };
        t == ffi::ibv_transport_type::IBV_TRANSPORT_IWARP
    }

    /// `ibv_query_device`.
    pub(crate) fn query_device(&self) -> io::Result<ffi::ibv_device_attr> {
        // SAFETY: ibv_device_attr is plain data; all-zero is a valid value.
        let mut attr: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `attr` is a valid out-pointer.
        check(unsafe { ffi::ibv_query_device(self.ptr.as_ptr(), &mut attr) })?;
        Ok(attr)
    }

    /// `ibv_query_port`.
    pub(crate) fn query_port(&self, port: u8) -> io::Result<ffi::ibv_port_attr> {
        // SAFETY: ibv_port_attr is plain data; all-zero is a valid value.
        let mut attr: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `attr` is a valid out-pointer.
        check(unsafe { ffi::ibv_query_port(self.ptr.as_ptr(), port, &mut attr) })?;
        Ok(attr)
    }

    /// `ibv_query_gid`: the GID at `index`, with whether it is a RoCEv2 GID.
    pub(crate) fn query_gid(&self, port: u8, index: u32) -> io::Result<([u8; 16], bool)> {
        let mut gid = ffi::ibv_gid { raw: [0; 16] };
        // SAFETY: the context is open and `gid` is a valid out-pointer.
        check(unsafe { ffi::ibv_query_gid(self.ptr.as_ptr(), port, index as i32, &mut gid) })?;
        // SAFETY: both union fields are plain bytes.
        let raw = unsafe { gid.raw };
        Ok((raw, self.gid_is_roce_v2(port, index)))
    }

    /// Whether GID `index` of `port` is a RoCEv2 GID, as `ibv_query_gid_ex` (rdma-core 32
    /// and later) or, before it, sysfs says. Not knowing counts as no (InfiniBand or RoCEv1).
    fn gid_is_roce_v2(&self, port: u8, index: u32) -> bool {
        // SAFETY: ibv_gid_entry is plain data; all-zero is a valid value.
        let mut entry: ffi::ibv_gid_entry = unsafe { std::mem::zeroed() };
        let size = std::mem::size_of_val(&entry);
        // SAFETY: the context is open and `entry` a valid out-pointer of `size` bytes.
        let rc = unsafe {
            ffi::_ibv_query_gid_ex(self.ptr.as_ptr(), port.into(), index, &mut entry, 0, size)
        };
        if rc == 0 {
            return entry.gid_type == ffi::ibv_gid_type::IBV_GID_TYPE_ROCE_V2;
        }
        // SAFETY: reading a field of the open context.
        let dev = unsafe { (*self.ptr.as_ptr()).device };
        // SAFETY: the device's name is a NUL-terminated string owned by libibverbs.
        let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(dev)) };
        let path = format!(
            "/sys/class/infiniband/{}/ports/{port}/gid_attrs/types/{index}",
            name.to_string_lossy()
        );
        std::fs::read_to_string(path).is_ok_and(|ty| ty.trim() == "RoCE v2")
    }

    /// The descriptor that async events arrive on, made non-blocking.
    pub(crate) fn async_fd(&self) -> io::Result<RawFd> {
        // SAFETY: reading a field of the open context.
        let fd = unsafe { (*self.ptr.as_ptr()).async_fd };
        set_nonblocking(fd)?;
        Ok(fd)
    }

    /// Takes one async event if one is waiting (the async fd must be non-blocking):
    /// its type and the address of the object it concerns.
    pub(crate) fn next_async_event(&self) -> Option<(u32, usize)> {
        // SAFETY: ibv_async_event is plain data (pointers and an enum whose 0 is valid).
        let mut ev: ffi::ibv_async_event = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `ev` a valid out-pointer.
        if unsafe { ffi::ibv_get_async_event(self.ptr.as_ptr(), &mut ev) } != 0 {
            return None;
        }
        let ty = ev.event_type;
        // SAFETY: every member of the element union is a pointer; read it as an address.
        let element = unsafe { ev.element.qp } as usize;
        // SAFETY: `ev` was filled by ibv_get_async_event and is acknowledged once.
        unsafe { ffi::ibv_ack_async_event(&mut ev) };
        Some((ty, element))
    }
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor owned by libibverbs; only O_NONBLOCK is added.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A protection domain (`ibv_pd`).
pub(crate) struct Pd {
    ptr: NonNull<ffi::ibv_pd>,
    _ctx: Arc<Context>,
}

// SAFETY: see Context.
unsafe impl Send for Pd {}
// SAFETY: see Context.
unsafe impl Sync for Pd {}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: MRs, QPs and SRQs of this PD hold an Arc to it, so none is left.
        unsafe { ffi::ibv_dealloc_pd(self.ptr.as_ptr()) };
    }
}

impl Pd {
    /// `ibv_alloc_pd`.
    pub(crate) fn alloc(ctx: &Arc<Context>) -> io::Result<Pd> {
        // SAFETY: the context is open.
        let p = unsafe { ffi::ibv_alloc_pd(ctx.ptr.as_ptr()) };
        Ok(Pd {
            ptr: NonNull::new(p).ok_or_else(|| last_error(libc::ENOMEM))?,
            _ctx: ctx.clone(),
        })
    }
}

/// A registered memory region (`ibv_mr`); dropping it deregisters.
pub(crate) struct Mr {
    ptr: NonNull<ffi::ibv_mr>,
    _pd: Arc<Pd>,
}

// SAFETY: see Context.
unsafe impl Send for Mr {}
// SAFETY: see Context.
unsafe impl Sync for Mr {}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: the MR is registered and deregistered once.
        unsafe { ffi::ibv_dereg_mr(self.ptr.as_ptr()) };
    }
}

impl Mr {
    /// `ibv_reg_mr` with `access` (IBV_ACCESS_* bits).
    ///
    /// # Safety
    ///
    /// `[addr, addr + len)` must stay mapped until the returned `Mr` is dropped.
    pub(crate) unsafe fn register(
        pd: &Arc<Pd>,
        addr: *mut u8,
        len: usize,
        access: u32,
    ) -> io::Result<Mr> {
        // SAFETY: the PD is allocated; the caller keeps the range mapped while registered.
        let p = unsafe { ffi::ibv_reg_mr(pd.ptr.as_ptr(), addr.cast(), len, access as i32) };
        Ok(Mr {
            ptr: NonNull::new(p).ok_or_else(|| last_error(libc::EINVAL))?,
            _pd: pd.clone(),
        })
    }

    /// (lkey, rkey).
    pub(crate) fn keys(&self) -> (u32, u32) {
        // SAFETY: reading fields of a registered MR.
        unsafe { ((*self.ptr.as_ptr()).lkey, (*self.ptr.as_ptr()).rkey) }
    }
}

/// A completion queue with a completion channel of its own (`ibv_cq`, `ibv_comp_channel`).
pub(crate) struct Cq {
    cq: NonNull<ffi::ibv_cq>,
    channel: NonNull<ffi::ibv_comp_channel>,
    _ctx: Arc<Context>,
}

// SAFETY: see Context.
unsafe impl Send for Cq {}
// SAFETY: see Context.
unsafe impl Sync for Cq {}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: QPs using the CQ hold an Arc to it, so none is left; every event taken
        // was acknowledged; the channel outlives its CQ.
        unsafe {
            ffi::ibv_destroy_cq(self.cq.as_ptr());
            ffi::ibv_destroy_comp_channel(self.channel.as_ptr());
        }
    }
}

/// A work completion as the device wrote it.
pub(crate) type Wc = ffi::ibv_wc;

impl Cq {
    /// `ibv_create_comp_channel` (non-blocking) and `ibv_create_cq` for `cqe` entries.
    pub(crate) fn create(ctx: &Arc<Context>, cqe: u32) -> io::Result<Cq> {
        // SAFETY: the context is open.
        let ch = unsafe { ffi::ibv_create_comp_channel(ctx.ptr.as_ptr()) };
        let channel = NonNull::new(ch).ok_or_else(|| last_error(libc::ENOMEM))?;
        // SAFETY: reading a field of the new channel.
        let fd = unsafe { (*ch).fd };
        let destroy_channel = || {
            // SAFETY: the channel has no CQ yet and is destroyed once.
            unsafe { ffi::ibv_destroy_comp_channel(ch) };
        };
        if let Err(e) = set_nonblocking(fd) {
            destroy_channel();
            return Err(e);
        }
        // SAFETY: the context is open and the channel belongs to it.
        let cq =
            unsafe { ffi::ibv_create_cq(ctx.ptr.as_ptr(), cqe as i32, ptr::null_mut(), ch, 0) };
        match NonNull::new(cq) {
            Some(cq) => Ok(Cq {
                cq,
                channel,
                _ctx: ctx.clone(),
            }),
            None => {
                let e = last_error(libc::EINVAL);
                destroy_channel();
                Err(e)
            }
        }
    }

    /// `ibv_poll_cq` into `out`; returns the completions written, a prefix of `out`.
    /// `out` needs no initialising: the device writes whole entries, and only those are
    /// returned.
    pub(crate) fn poll<'a>(&self, out: &'a mut [MaybeUninit<Wc>]) -> io::Result<&'a [Wc]> {
        let n = out.len().min(i32::MAX as usize) as i32;
        // SAFETY: `out` has room for `n` work completions; ibv_poll_cq only writes.
        let rc = unsafe { ffi::ibv_poll_cq(self.cq.as_ptr(), n, out.as_mut_ptr().cast()) };
        let got = usize::try_from(rc).map_err(|_| io::Error::from_raw_os_error(rc.abs()))?;
        // SAFETY: ibv_poll_cq initialised the first `got` (≤ n) entries.
        Ok(unsafe { std::slice::from_raw_parts(out.as_ptr().cast::<Wc>(), got.min(out.len())) })
    }

    /// `ibv_req_notify_cq`.
    pub(crate) fn req_notify(&self, solicited_only: bool) -> io::Result<()> {
        // SAFETY: the CQ is live.
        check(unsafe { ffi::ibv_req_notify_cq(self.cq.as_ptr(), i32::from(solicited_only)) })
    }

    /// The completion channel's descriptor.
    pub(crate) fn channel_fd(&self) -> RawFd {
        // SAFETY: reading a field of the live channel.
        unsafe { (*self.channel.as_ptr()).fd }
    }

    /// Takes and acknowledges one completion event if one is waiting.
    pub(crate) fn take_event(&self) -> bool {
        let mut cq = ptr::null_mut();
        let mut cq_ctx = ptr::null_mut();
        // SAFETY: the channel is non-blocking and live; the out-pointers are valid.
        let rc = unsafe { ffi::ibv_get_cq_event(self.channel.as_ptr(), &mut cq, &mut cq_ctx) };
        if rc != 0 {
            return false;
        }
        // SAFETY: the event was for `cq` (the channel's only CQ) and is acknowledged once.
        unsafe { ffi::ibv_ack_cq_events(cq, 1) };
        true
    }
}

/// The ibv_atomic_cap, ibv_wc_status, ibv_wc_opcode, ibv_qp_state, IBV_QP_* and IBV_SEND_* values
/// the provider maps.
pub(crate) mod consts {
    use super::ffi;

    pub(crate) use ffi::ibv_atomic_cap as atomic_cap;
    pub(crate) use ffi::ibv_qp_state as qp_state;
    pub(crate) use ffi::ibv_wc_opcode as wc_opcode;
    pub(crate) use ffi::ibv_wc_status as wc_status;

    /// IBV_WC_WITH_IMM.
    pub(crate) const WC_WITH_IMM: u32 = ffi::ibv_wc_flags::IBV_WC_WITH_IMM;
    /// IBV_WC_GRH.
    pub(crate) const WC_GRH: u32 = ffi::ibv_wc_flags::IBV_WC_GRH;
    /// IBV_QPT_*.
    pub(crate) use ffi::ibv_qp_type as qp_type;
    /// IBV_EVENT_SRQ_LIMIT_REACHED.
    pub(crate) const EVENT_SRQ_LIMIT_REACHED: u32 =
        ffi::ibv_event_type::IBV_EVENT_SRQ_LIMIT_REACHED;

    /// IBV_SEND_*.
    pub(crate) const SEND_FENCE: u32 = ffi::ibv_send_flags::IBV_SEND_FENCE;
    pub(crate) const SEND_SIGNALED: u32 = ffi::ibv_send_flags::IBV_SEND_SIGNALED;
    pub(crate) const SEND_SOLICITED: u32 = ffi::ibv_send_flags::IBV_SEND_SOLICITED;
    pub(crate) const SEND_INLINE: u32 = ffi::ibv_send_flags::IBV_SEND_INLINE;

    /// IBV_QP_*.
    pub(crate) mod mask {
        use super::ffi::ibv_qp_attr_mask as m;
        pub(crate) const STATE: u32 = m::IBV_QP_STATE;
        pub(crate) const CUR_STATE: u32 = m::IBV_QP_CUR_STATE;
        pub(crate) const EN_SQD_ASYNC_NOTIFY: u32 = m::IBV_QP_EN_SQD_ASYNC_NOTIFY;
        pub(crate) const ACCESS_FLAGS: u32 = m::IBV_QP_ACCESS_FLAGS;
        pub(crate) const PKEY_INDEX: u32 = m::IBV_QP_PKEY_INDEX;
        pub(crate) const PORT: u32 = m::IBV_QP_PORT;
        pub(crate) const AV: u32 = m::IBV_QP_AV;
        pub(crate) const PATH_MTU: u32 = m::IBV_QP_PATH_MTU;
        pub(crate) const TIMEOUT: u32 = m::IBV_QP_TIMEOUT;
        pub(crate) const RETRY_CNT: u32 = m::IBV_QP_RETRY_CNT;
        pub(crate) const RNR_RETRY: u32 = m::IBV_QP_RNR_RETRY;
        pub(crate) const RQ_PSN: u32 = m::IBV_QP_RQ_PSN;
        pub(crate) const MAX_QP_RD_ATOMIC: u32 = m::IBV_QP_MAX_QP_RD_ATOMIC;
        pub(crate) const MIN_RNR_TIMER: u32 = m::IBV_QP_MIN_RNR_TIMER;
        pub(crate) const SQ_PSN: u32 = m::IBV_QP_SQ_PSN;
        pub(crate) const MAX_DEST_RD_ATOMIC: u32 = m::IBV_QP_MAX_DEST_RD_ATOMIC;
        pub(crate) const DEST_QPN: u32 = m::IBV_QP_DEST_QPN;
        pub(crate) const QKEY: u32 = m::IBV_QP_QKEY;
    }
}
