//! The verbs provider behind the seam: its options, its registry entry, and the seam's
//! traits over the device, CQ, QP and SRQ types of this folder.

use std::any::Any;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use rdmx_core::{KeyError, KeyUse, PdId, QpAttr, QpAttrMask, QpState, RecvWr, SendWr};
use rdmx_mem::Access;

use super::{Cq, Device, Qp, Srq};
use crate::endpoint::{PeerAddr, QpEndpoint};
use crate::provider::{self, Capabilities, CqCore, MrRef, MrShared, ProviderConfig, Registration};
use crate::{Error, Result};

/// The provider's name.
pub(crate) const NAME: &str = "verbs";

/// How to open a verbs context.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Options {
    /// The device to open (default: the first one rdma-core lists).
    pub device: Option<String>,
    /// The GID index to use (default: the RoCEv2 GID of an IPv4 address, else another
    /// RoCEv2 GID, else index 0).
    pub gid_index: Option<u32>,
}

impl Options {
    /// Sets [`device`](Self::device).
    pub fn device(mut self, name: &str) -> Self {
        self.device = Some(name.to_string());
        self
    }
    /// Sets [`gid_index`](Self::gid_index).
    pub fn gid_index(mut self, index: u32) -> Self {
        self.gid_index = Some(index);
        self
    }
}

impl From<Options> for ProviderConfig {
    fn from(opts: Options) -> ProviderConfig {
        ProviderConfig::new(NAME, move || {
            let dev = Device::open(opts.device.as_deref(), opts.gid_index)?;
            Ok(Arc::new(Dev(dev)) as Arc<dyn provider::Device>)
        })
    }
}

/// The provider as the registry lists it.
pub(crate) const ENTRY: provider::Entry = provider::Entry {
    name: NAME,
    devices: super::devices,
    open: |device| {
        ProviderConfig::from(Options {
            device: device.map(str::to_string),
            gid_index: None,
        })
        .open()
    },
};

/// An open verbs device behind the seam.
#[derive(Debug)]
struct Dev(Arc<Device>);

impl provider::Device for Dev {
    fn provider(&self) -> &'static str {
        NAME
    }
    fn name(&self) -> &str {
        &self.0.name
    }
    fn caps(&self) -> &Capabilities {
        &self.0.caps
    }
    fn address(&self) -> PeerAddr {
        PeerAddr::Gid(self.0.gid())
    }
    fn gid(&self) -> Option<(u32, std::net::Ipv6Addr)> {
        Some((self.0.gid_index, self.0.gid()))
    }
    unsafe fn register(&self, reg: Registration) -> Result<Arc<MrShared>> {
        if reg.len == 0 {
            return Err(rdmx_mem::Error::InvalidRange {
                addr: reg.addr as usize,
                len: reg.len,
            }
            .into());
        }
        let pd = self.0.pd(reg.pd)?;
        // SAFETY: the memory stays mapped while the region lives (the caller's contract);
        // the adapter's MR is dropped by `deregister`, before the last `MrRef` can free the
        // memory.
        let (hw, lkey, rkey) = unsafe { self.0.register(&pd, reg.addr, reg.len, reg.access)? };
        let shared = Arc::new(MrShared {
            pin: None,
            _owner: reg.owner,
            addr: reg.addr,
            len: reg.len,
            access: reg.access,
            lkey,
            rkey,
            pd: reg.pd,
            gate: Default::default(),
        });
        self.0.insert_mr(&shared, hw);
        Ok(shared)
    }
    fn deregister(&self, mr: &Arc<MrShared>) {
        self.0.remove_mr(mr);
    }
    fn check(
        &self,
        pd: PdId,
        key: u32,
        key_use: KeyUse,
        addr: u64,
        len: u64,
        need: Access,
    ) -> std::result::Result<MrRef, KeyError> {
        self.0.check(key, key_use, pd, addr, len, need)
    }
    fn registered_regions(&self) -> usize {
        self.0.registered_regions()
    }
    fn create_cq(&self, core: &Arc<CqCore>) -> Result<Box<dyn provider::Cq>> {
        Ok(Box::new(Cq::create(
            &self.0,
            core.capacity(),
            core.event_fd(),
        )?))
    }
    fn create_qp(&self, init: provider::QpInit<'_>) -> Result<Box<dyn provider::Qp>> {
        let srq = match init.srq {
            None => None,
            Some(s) => Some(
                s.as_any()
                    .downcast_ref::<Srq>()
                    .ok_or(Error::InvalidArgument(
                        "the shared receive queue belongs to another provider",
                    ))?,
            ),
        };
        let cqs = (cq_of(init.send_cq)?, cq_of(init.recv_cq)?);
        Ok(Box::new(Qp::create(
            &self.0,
            init.pd,
            init.qp_type,
            cqs,
            srq,
            init.caps,
        )?))
    }
    fn create_ah(&self, pd: PdId, av: &rdmx_core::AddressVector) -> Result<Arc<dyn provider::Ah>> {
        Ok(Arc::new(super::qp::Ah::create(&self.0, pd, av)?))
    }
    fn create_srq(
        &self,
        pd: PdId,
        max_wr: usize,
        max_sge: usize,
    ) -> Result<Box<dyn provider::Srq>> {
        Ok(Box::new(Srq::create(&self.0, pd, max_wr, max_sge)?))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn cq_of(c: &provider::CqParts) -> Result<&Cq> {
    c.imp
        .as_any()
        .downcast_ref::<Cq>()
        .ok_or(Error::InvalidArgument(
            "the completion queues belong to another provider",
        ))
}

impl provider::Cq for Cq {
    fn progress(&self, core: &CqCore) -> Result<()> {
        self.drain(|c| {
            core.push(c, false);
        })
    }
    fn req_notify(&self, core: &CqCore, solicited_only: bool) {
        // The adapter notifies; the rdmx side only adds error completions in
        // solicited-only mode, which not every adapter reports (rxe does not).
        core.arm_errors_only(solicited_only);
        if let Err(e) = Cq::req_notify(self, solicited_only) {
            tracing::warn!(error = %e, "verbs: arming the CQ failed");
        }
    }
    fn fd(&self) -> Option<RawFd> {
        Some(Cq::fd(self))
    }
    fn get_event(&self, core: &CqCore) -> bool {
        let adapter = self.take_events();
        if adapter {
            core.disarm();
        }
        core.read_event() | adapter
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl provider::Qp for Qp {
    fn qp_num(&self) -> u32 {
        Qp::qp_num(self)
    }
    fn state(&self) -> QpState {
        Qp::state(self)
    }
    fn attrs(&self) -> QpAttr {
        Qp::attrs(self)
    }
    fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        Qp::modify(self, attr, mask)
    }
    fn address(&self) -> PeerAddr {
        PeerAddr::Gid(self.device().gid())
    }
    fn bind_peer(&self, peer: &QpEndpoint, _timeout: Duration) -> Result<()> {
        Qp::bind_peer(self, peer);
        Ok(())
    }
    unsafe fn post_send(&self, wr: &SendWr, inline: Option<&[u8]>) -> Result<()> {
        // SAFETY: forwarded; the caller upholds the contract.
        unsafe { Qp::post_send(self, wr, inline, None) }
    }
    unsafe fn post_send_ud(
        &self,
        wr: &SendWr,
        inline: Option<&[u8]>,
        ah: &dyn provider::Ah,
    ) -> Result<()> {
        let ah = ah
            .as_any()
            .downcast_ref::<super::qp::Ah>()
            .ok_or(Error::InvalidArgument(
                "the address handle belongs to another provider",
            ))?;
        // SAFETY: forwarded; the caller upholds the contract.
        unsafe { Qp::post_send(self, wr, inline, Some(ah)) }
    }
    fn attach_mcast(&self, gid: [u8; 16], lid: u16) -> Result<()> {
        Qp::mcast(self, true, gid, lid)
    }
    fn detach_mcast(&self, gid: [u8; 16], lid: u16) -> Result<()> {
        Qp::mcast(self, false, gid, lid)
    }
    unsafe fn post_recv(&self, wr: &RecvWr) -> Result<()> {
        // SAFETY: forwarded; the caller upholds the contract.
        unsafe { Qp::post_recv(self, wr) }
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl provider::Srq for Srq {
    unsafe fn post_recv(&self, wr: &RecvWr) -> Result<()> {
        // SAFETY: forwarded; the caller upholds the contract.
        unsafe { Srq::post_recv(self, wr) }
    }
    fn len(&self) -> usize {
        Srq::len(self)
    }
    fn arm_limit(&self, limit: usize) -> crate::Result<()> {
        Srq::arm_limit(self, limit)
    }
    fn limit_reached(&self) -> bool {
        Srq::limit_reached(self)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
