//! The verbs provider: the rdmx API on rdma-core (libibverbs), so the same program runs on
//! InfiniBand, RoCE and iWARP adapters, and on Soft-RoCE (`rdma_rxe`).
//!
//! What the adapter does, the adapter does: keys, bounds, access and PD checks, the RC
//! protocol, RNR and retries. What rdmx promises beyond plain verbs is kept here in
//! software, on top:
//!
//! - Queue depths are exactly the ones asked for (adapters round them up): a post beyond
//!   `max_send_wr` outstanding requests, counted as verbs counts them (an unsignaled
//!   request frees its slot when a later signaled one is reaped), fails with `QueueFull`.
//! - A posted request holds a reference to every region its elements name until its
//!   completion is reaped, so the memory outlives deregistration while the adapter may
//!   still touch it. To map completions back, the adapter sees a sequence number as the
//!   `wr_id`; the caller's `wr_id` comes back in the completion.
//! - A CQ holds exactly its capacity: completions are moved from the adapter's CQ (sized
//!   one larger) into the rdmx CQ when it is polled, and one too many is an overrun.
//! - Posting in RESET, INIT (sends) or RTR (sends) is refused before it reaches the
//!   adapter, with the state named; modifies are checked against the verbs rules first.
//!
//! The GID a context uses is chosen when it opens: the RoCEv2 GID that maps an IPv4
//! address if the port has one, else another RoCEv2 GID, else index 0 (InfiniBand);
//! [`Options::gid_index`] picks one explicitly.

pub mod cm;
mod ffi;
mod glue;
mod qp;
mod rdmacm;
mod srq;
mod sys;

pub use glue::Options;
pub(crate) use glue::ENTRY;

use std::collections::HashMap;
use std::net::Ipv6Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Weak};

use parking_lot::{Mutex, RwLock};
use rdmx_core::{Completion, KeyError, KeyUse, Mtu, PdId, QpLimits, WcOpcode, WcStatus};
use rdmx_mem::Access;

pub(crate) use qp::Qp;
pub(crate) use srq::Srq;

use crate::provider::{AtomicCap, Capabilities, MrRef, MrShared, Transport};
use crate::{Error, Result};

/// The port every context uses.
const PORT: u8 = 1;

/// Names of the devices rdma-core offers; empty when there are none or no rdma-core.
pub(crate) fn device_names() -> Vec<String> {
    sys::device_names().unwrap_or_default()
}

/// Every verbs device with its capabilities (devices that fail to open are left out).
pub(crate) fn devices() -> Vec<crate::DeviceInfo> {
    device_names()
        .into_iter()
        .filter_map(|name| {
            let dev = Device::open(Some(&name), None).ok()?;
            Some(crate::DeviceInfo {
                provider: glue::NAME,
                name,
                capabilities: dev.caps.clone(),
                gid: Some((dev.gid_index, dev.gid())),
            })
        })
        .collect()
}

/// An open device and what the provider keeps about it.
pub(crate) struct Device {
    pub(crate) ctx: Arc<sys::Context>,
    pub(crate) name: String,
    pub(crate) port: u8,
    pub(crate) gid_index: u32,
    gid: [u8; 16],
    pub(crate) caps: Capabilities,
    pub(crate) limits: QpLimits,
    /// Registered regions by lkey, for posted requests to hold.
    mrs: RwLock<HashMap<u32, Arc<MrShared>>>,
    /// The lkey of each region with remote access, by rkey.
    rkeys: RwLock<HashMap<u32, u32>>,
    /// The adapter's registrations, by lkey; removing one deregisters it.
    hw_mrs: Mutex<HashMap<u32, Mr>>,
    /// Live QPs by number, to map their completions back.
    qps: RwLock<HashMap<u32, Weak<qp::Shared>>>,
    /// Live SRQs by address, for their limit events.
    srqs: Mutex<HashMap<usize, Weak<srq::SrqShared>>>,
    /// Protection domains by rdmx id.
    pds: Mutex<HashMap<PdId, Weak<sys::Pd>>>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("verbs::Device")
            .field("name", &self.name)
            .field("port", &self.port)
            .field("gid_index", &self.gid_index)
            .field("gid", &self.gid())
            .finish_non_exhaustive()
    }
}

fn verb(name: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |e| Error::Io(name, e)
}

impl Device {
    /// Opens device `name` (default: the first one) and picks its GID.
    pub(crate) fn open(name: Option<&str>, gid_index: Option<u32>) -> Result<Arc<Device>> {
        let names = sys::device_names().unwrap_or_default();
        let name = match name {
            Some(n) if names.iter().any(|d| d == n) => n.to_string(),
            Some(n) if names.is_empty() => {
                return Err(Error::NoDevice(format!("no RDMA devices (asked for {n})")))
            }
            Some(n) => {
                return Err(Error::NoDevice(format!(
                    "no RDMA device named {n}; available: {}",
                    names.join(", ")
                )))
            }
            None => names
                .first()
                .cloned()
                .ok_or_else(|| Error::NoDevice("no RDMA devices".to_string()))?,
        };
        let ctx = Arc::new(sys::Context::open(&name).map_err(verb("ibv_open_device"))?);
        ctx.async_fd()
            .map_err(verb("make the async event descriptor non-blocking"))?;
        let dev = ctx.query_device().map_err(verb("ibv_query_device"))?;
        let port = ctx.query_port(PORT).map_err(verb("ibv_query_port"))?;
        let (gid_index, gid) = pick_gid(&ctx, port.gid_tbl_len.max(0) as u32, gid_index)?;
        let iwarp = ctx.is_iwarp();
        let mtu = |code: u32| Mtu::from_ib_code(code as u8).unwrap_or(Mtu::Mtu1024);
        let clamp = |v: i32| v.clamp(0, i32::from(u8::MAX)) as u8;
        let mut limits = QpLimits::default();
        limits.max_rd_atomic = clamp(dev.max_qp_init_rd_atom);
        limits.max_dest_rd_atomic = clamp(dev.max_qp_rd_atom);
        limits.max_mtu = mtu(port.max_mtu);
        limits.ports = dev.phys_port_cnt.max(1);
        limits.pkey_table_len = port.pkey_tbl_len.max(1);
        let caps = Capabilities {
            max_qp: dev.max_qp.max(0) as u32,
            max_qp_wr: dev.max_qp_wr.max(0) as u32,
            max_sge: dev.max_sge.max(0) as u32,
            // One entry of each adapter CQ is kept spare (see the module docs).
            max_cqe: (dev.max_cqe.max(1) - 1) as u32,
            max_mr: dev.max_mr.max(0) as u32,
            max_mr_size: dev.max_mr_size,
            max_qp_rd_atom: limits.max_dest_rd_atomic,
            max_qp_init_rd_atom: limits.max_rd_atomic,
            max_mtu: limits.max_mtu,
            active_mtu: mtu(port.active_mtu),
            max_inline_data: qp::probe_max_inline(&ctx),
            atomics: match dev.atomic_cap {
                _ if iwarp => AtomicCap::None,
                sys::consts::atomic_cap::IBV_ATOMIC_GLOB => AtomicCap::Global,
                sys::consts::atomic_cap::IBV_ATOMIC_HCA => AtomicCap::Device,
                _ => AtomicCap::None,
            },
            // What iWARP lacks: immediate data (RDMAP has none), RNR, and (soft-iWARP)
            // more than one local element of a READ.
            transport: if iwarp {
                Transport::Iwarp
            } else {
                Transport::InfiniBand
            },
            imm_data: !iwarp,
            max_read_sge: if iwarp { 1 } else { dev.max_sge.max(0) as u32 },
            rnr_retry: !iwarp,
            remote_error_completions: !iwarp,
            // UC, UD and multicast where the device has them (not iWARP).
            uc: !iwarp,
            ud: !iwarp,
            multicast: !iwarp && dev.max_mcast_grp > 0,
            // The device drops datagrams (a wrong Q_Key, no receive) out of sight.
            counts_dropped: false,
        };
        tracing::info!(
            device = %name,
            gid_index,
            gid = %Ipv6Addr::from(gid),
            "verbs: opened the device"
        );
        Ok(Arc::new(Device {
            ctx,
            name,
            port: PORT,
            gid_index,
            gid,
            caps,
            limits,
            mrs: RwLock::new(HashMap::new()),
            rkeys: RwLock::new(HashMap::new()),
            hw_mrs: Mutex::new(HashMap::new()),
            qps: RwLock::new(HashMap::new()),
            srqs: Mutex::new(HashMap::new()),
            pds: Mutex::new(HashMap::new()),
        }))
    }

    /// The GID this context uses, as an IPv6 address.
    pub(crate) fn gid(&self) -> Ipv6Addr {
        Ipv6Addr::from(self.gid)
    }

    /// The verbs PD behind rdmx domain `id`, allocated on first use.
    pub(crate) fn pd(&self, id: PdId) -> Result<Arc<sys::Pd>> {
        let mut pds = self.pds.lock();
        if let Some(pd) = pds.get(&id).and_then(Weak::upgrade) {
            return Ok(pd);
        }
        let pd = Arc::new(sys::Pd::alloc(&self.ctx).map_err(verb("ibv_alloc_pd"))?);
        pds.retain(|_, w| w.strong_count() > 0);
        pds.insert(id, Arc::downgrade(&pd));
        Ok(pd)
    }

    /// Registers `[addr, addr + len)` in `pd` (`ibv_reg_mr`), returning the verbs MR and
    /// its keys (rkey 0 when the region grants no remote access, as on every provider).
    ///
    /// # Safety
    ///
    /// The range must stay mapped until the returned MR is dropped.
    pub(crate) unsafe fn register(
        &self,
        pd: &Arc<sys::Pd>,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<(Mr, u32, u32)> {
        // SAFETY: forwarded from the caller.
        let mr = unsafe { sys::Mr::register(pd, addr, len, access.bits()) }.map_err(|e| {
            if matches!(e.raw_os_error(), Some(libc::ENOMEM) | Some(libc::EPERM)) {
                Error::Io(
                    "ibv_reg_mr (pinning may exceed RLIMIT_MEMLOCK: raise it with \
                     `ulimit -l unlimited` or in /etc/security/limits.conf)",
                    e,
                )
            } else {
                Error::Io("ibv_reg_mr", e)
            }
        })?;
        let (lkey, rkey) = mr.keys();
        let rkey = if access.intersects(Access::REMOTE_READ | Access::REMOTE_MUTATE) {
            rkey
        } else {
            0
        };
        Ok((Mr { mr }, lkey, rkey))
    }

    /// Makes a registered region findable by its keys, and keeps the adapter's MR.
    pub(crate) fn insert_mr(&self, shared: &Arc<MrShared>, hw: Mr) {
        self.hw_mrs.lock().insert(shared.lkey, hw);
        if shared.rkey != 0 {
            self.rkeys.write().insert(shared.rkey, shared.lkey);
        }
        self.mrs.write().insert(shared.lkey, shared.clone());
    }

    /// Deregisters a region: the adapter's MR first (its keys die), then the maps.
    pub(crate) fn remove_mr(&self, mr: &MrShared) {
        let hw = self.hw_mrs.lock().remove(&mr.lkey);
        drop(hw);
        if mr.rkey != 0 {
            self.rkeys.write().remove(&mr.rkey);
        }
        let shared = self.mrs.write().remove(&mr.lkey);
        // The region's memory lives on while posted requests hold it.
        drop(shared);
    }

    /// Regions registered now.
    pub(crate) fn registered_regions(&self) -> usize {
        self.mrs.read().len()
    }

    /// The region an lkey names, if it is live.
    pub(crate) fn mr_by_lkey(&self, lkey: u32) -> Option<MrRef> {
        self.mrs.read().get(&lkey).map(|s| MrRef::new(s.clone()))
    }

    /// [`ProtectionDomain::check`](crate::ProtectionDomain::check) on this device's regions:
    /// a hash lookup by lkey or rkey, then the checks every provider runs.
    pub(crate) fn check(
        &self,
        key: u32,
        key_use: KeyUse,
        pd: PdId,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<MrRef, KeyError> {
        let lkey = match key_use {
            KeyUse::Local => Some(key),
            _ => self.rkeys.read().get(&key).copied(),
        };
        let mrs = self.mrs.read();
        let shared = lkey
            .and_then(|l| mrs.get(&l))
            .ok_or(KeyError::InvalidKey { key })?;
        if shared.pd != pd {
            return Err(KeyError::PdMismatch {
                key,
                mr_pd: shared.pd,
                pd,
            });
        }
        let (mr_addr, mr_len) = (shared.addr as u64, shared.len as u64);
        if addr < mr_addr || addr.saturating_add(len) > mr_addr + mr_len {
            return Err(KeyError::OutOfBounds {
                key,
                addr,
                len,
                mr_addr,
                mr_len,
            });
        }
        if !shared.access.contains(need) {
            return Err(KeyError::AccessDenied {
                key,
                need,
                have: shared.access,
            });
        }
        Ok(MrRef::new(shared.clone()))
    }

    fn qp(&self, qpn: u32) -> Option<Arc<qp::Shared>> {
        self.qps.read().get(&qpn).and_then(Weak::upgrade)
    }

    /// A receive completion of a QP already destroyed: if it took an SRQ's receive, that
    /// receive's slot goes (each SRQ numbers its receives in a window of its own), so the
    /// SRQ does not count it as posted for good and refuse posts it has room for.
    fn release_srq_receive(&self, hw_wr_id: u64) {
        let srqs: Vec<_> = self
            .srqs
            .lock()
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        for s in srqs {
            if s.release(hw_wr_id) {
                return;
            }
        }
    }

    /// Takes every waiting async event: SRQ limit events are recorded on their SRQ.
    fn poll_async(&self) {
        while let Some((ty, element)) = self.ctx.next_async_event() {
            if ty == sys::consts::EVENT_SRQ_LIMIT_REACHED {
                if let Some(s) = self.srqs.lock().get(&element).and_then(Weak::upgrade) {
                    s.limit_fired();
                }
            } else {
                tracing::debug!(event = ty, "verbs: async event");
            }
        }
    }
}

/// A registered verbs MR; dropping it deregisters.
pub(crate) struct Mr {
    mr: sys::Mr,
}

impl std::fmt::Debug for Mr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (lkey, rkey) = self.mr.keys();
        write!(f, "verbs::Mr(lkey {lkey:#x}, rkey {rkey:#x})")
    }
}

fn pick_gid(ctx: &sys::Context, table_len: u32, asked: Option<u32>) -> Result<(u32, [u8; 16])> {
    if let Some(i) = asked {
        let (gid, _) = ctx.query_gid(PORT, i).map_err(verb("ibv_query_gid"))?;
        if gid == [0; 16] {
            return Err(Error::NoDevice(format!(
                "GID index {i} of port {PORT} is empty"
            )));
        }
        return Ok((i, gid));
    }
    let mut first_v2 = None;
    let mut first = None;
    for i in 0..table_len {
        let Ok((gid, v2)) = ctx.query_gid(PORT, i) else {
            continue;
        };
        if gid == [0; 16] {
            continue;
        }
        first.get_or_insert((i, gid));
        if v2 {
            if Ipv6Addr::from(gid).to_ipv4_mapped().is_some() {
                return Ok((i, gid));
            }
            first_v2.get_or_insert((i, gid));
        }
    }
    first_v2
        .or(first)
        .ok_or_else(|| Error::NoDevice(format!("port {PORT} has no GID")))
}

/// The adapter side of a completion queue.
#[derive(Debug)]
pub(crate) struct Cq {
    pub(crate) hw: Arc<sys::Cq>,
    dev: Arc<Device>,
    /// Readable when the completion channel or the rdmx CQ's own eventfd is.
    epoll: OwnedFd,
    /// Held while draining: the adapter's completions are matched to their requests in
    /// the order the CQ gives them (a completion also retires the unsignaled requests
    /// before it), so two threads polling one CQ take turns.
    draining: parking_lot::Mutex<()>,
}

impl std::fmt::Debug for sys::Cq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("verbs::Cq")
    }
}

impl Cq {
    /// A CQ for `capacity` completions whose rdmx side signals through `event`.
    pub(crate) fn create(dev: &Arc<Device>, capacity: usize, event: RawFd) -> Result<Cq> {
        let cqe = u32::try_from(capacity + 1).unwrap_or(u32::MAX);
        let hw = Arc::new(sys::Cq::create(&dev.ctx, cqe).map_err(verb("ibv_create_cq"))?);
        // SAFETY: epoll_create1 takes flags and returns a new descriptor.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return Err(Error::Io("epoll_create1", std::io::Error::last_os_error()));
        }
        // SAFETY: `ep` is a new descriptor nothing else owns.
        let epoll = unsafe { OwnedFd::from_raw_fd(ep) };
        for fd in [hw.channel_fd(), event] {
            let mut ev = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: fd as u64,
            };
            // SAFETY: adds a live descriptor to our epoll instance; `ev` is valid.
            if unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
                return Err(Error::Io("epoll_ctl", std::io::Error::last_os_error()));
            }
        }
        Ok(Cq {
            hw,
            dev: dev.clone(),
            epoll,
            draining: parking_lot::Mutex::new(()),
        })
    }

    /// The descriptor an application waits on.
    pub(crate) fn fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    /// Moves every completion the adapter has into `push` (which returns false once the
    /// rdmx CQ has overrun; the rest are taken all the same).
    pub(crate) fn drain(&self, mut push: impl FnMut(Completion)) -> Result<()> {
        const BATCH: usize = 32;
        // Not zeroed: that memset, on every poll of an empty CQ, was a hot spot.
        let mut wcs = [std::mem::MaybeUninit::<sys::Wc>::uninit(); BATCH];
        let _turn = self.draining.lock();
        loop {
            let got = self.hw.poll(&mut wcs).map_err(verb("ibv_poll_cq"))?;
            for wc in got {
                if let Some(c) = self.complete(wc) {
                    push(c);
                }
            }
            if got.len() < BATCH {
                return Ok(());
            }
        }
    }

    /// The rdmx completion for an adapter's, releasing what its request held; `None` for
    /// completions of QPs already destroyed.
    fn complete(&self, wc: &sys::Wc) -> Option<Completion> {
        use sys::consts::{wc_opcode, wc_status};
        let Some(qp) = self.dev.qp(wc.qp_num) else {
            if qp::is_recv(wc.wr_id) {
                self.dev.release_srq_receive(wc.wr_id);
            }
            return None;
        };
        let status = match wc.status {
            wc_status::IBV_WC_SUCCESS => WcStatus::Success,
            wc_status::IBV_WC_LOC_LEN_ERR => WcStatus::LocLenErr,
            wc_status::IBV_WC_LOC_QP_OP_ERR => WcStatus::LocQpOpErr,
            wc_status::IBV_WC_LOC_PROT_ERR => WcStatus::LocProtErr,
            wc_status::IBV_WC_WR_FLUSH_ERR => WcStatus::WrFlushErr,
            wc_status::IBV_WC_BAD_RESP_ERR => WcStatus::BadRespErr,
            wc_status::IBV_WC_LOC_ACCESS_ERR => WcStatus::LocAccessErr,
            wc_status::IBV_WC_REM_INV_REQ_ERR => WcStatus::RemInvReqErr,
            wc_status::IBV_WC_REM_ACCESS_ERR => WcStatus::RemAccessErr,
            wc_status::IBV_WC_REM_OP_ERR => WcStatus::RemOpErr,
            wc_status::IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExcErr,
            wc_status::IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExcErr,
            _ => WcStatus::GeneralErr,
        };
        let (wr_id, opcode) = if qp::is_recv(wc.wr_id) {
            let opcode = if status == WcStatus::Success
                && wc.opcode == wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM
            {
                WcOpcode::RecvRdmaWithImm
            } else {
                WcOpcode::Recv
            };
            (qp.complete_recv(wc.wr_id)?, opcode)
        } else {
            qp.complete_send(wc.wr_id)?
        };
        let imm_data = (wc.wc_flags & sys::consts::WC_WITH_IMM != 0)
            // SAFETY: with IBV_WC_WITH_IMM set the union holds the immediate data.
            .then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data }));
        Some(Completion {
            wr_id,
            status,
            opcode,
            byte_len: wc.byte_len,
            imm_data,
            qp_num: wc.qp_num,
            src_qp: wc.src_qp,
            grh: wc.wc_flags & sys::consts::WC_GRH != 0,
        })
    }

    /// Arms the adapter CQ's notification.
    pub(crate) fn req_notify(&self, solicited_only: bool) -> Result<()> {
        self.hw
            .req_notify(solicited_only)
            .map_err(verb("ibv_req_notify_cq"))
    }

    /// Takes the completion events waiting on the channel; returns whether there was one.
    pub(crate) fn take_events(&self) -> bool {
        let mut any = false;
        while self.hw.take_event() {
            any = true;
        }
        any
    }
}
