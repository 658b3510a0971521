//! Verbs shared receive queues: the receives each holds, by the adapter's sequence
//! number, with the references they keep on registered memory, and the limit event.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use rdmx_core::{PostError, RecvWr, WcOpcode};

use super::qp::{lkey_refs, next_seq_window, post_error, Slot, RECV_BIT};
use super::{sys, verb, Device};
use crate::Result;

/// The receives an SRQ holds, by adapter sequence number.
#[derive(Default)]
pub(super) struct SrqSlots {
    next_seq: u64,
    pub(super) slots: HashMap<u64, Slot>,
}

/// What completions and async events need of an SRQ.
pub(crate) struct SrqShared {
    pub(super) slots: Mutex<SrqSlots>,
    limit: AtomicBool,
}

impl SrqShared {
    pub(super) fn limit_fired(&self) {
        self.limit.store(true, Ordering::Release);
    }

    /// Lets go of the receive the adapter numbered `hw_wr_id`, if it is this SRQ's;
    /// returns whether it was.
    pub(super) fn release(&self, hw_wr_id: u64) -> bool {
        self.slots
            .lock()
            .slots
            .remove(&(hw_wr_id & !RECV_BIT))
            .is_some()
    }
}

/// A shared receive queue on a verbs device.
pub(crate) struct Srq {
    pub(super) hw: Arc<sys::Srq>,
    dev: Arc<Device>,
    pub(super) shared: Arc<SrqShared>,
    max_wr: usize,
    max_sge: usize,
}

impl std::fmt::Debug for Srq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("verbs::Srq")
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        self.dev.srqs.lock().remove(&self.hw.addr());
    }
}

impl Srq {
    /// `ibv_create_srq`.
    pub(crate) fn create(
        dev: &Arc<Device>,
        pd: rdmx_core::PdId,
        max_wr: usize,
        max_sge: usize,
    ) -> Result<Srq> {
        let hw_pd = dev.pd(pd)?;
        let hw = Arc::new(
            sys::Srq::create(&hw_pd, max_wr as u32, max_sge.max(1) as u32)
                .map_err(verb("ibv_create_srq"))?,
        );
        // A window of numbers of its own, apart from every QP's and SRQ's: a receive
        // completion whose QP is gone names its SRQ by its number alone.
        let base = next_seq_window();
        let shared = Arc::new(SrqShared {
            slots: Mutex::new(SrqSlots {
                next_seq: base,
                slots: HashMap::new(),
            }),
            limit: AtomicBool::new(false),
        });
        dev.srqs.lock().insert(hw.addr(), Arc::downgrade(&shared));
        Ok(Srq {
            hw,
            dev: dev.clone(),
            shared,
            max_wr,
            max_sge,
        })
    }

    /// `ibv_post_srq_recv`.
    ///
    /// # Safety
    ///
    /// As [`provider::Qp::post_recv`](crate::provider::Qp::post_recv).
    pub(crate) unsafe fn post_recv(&self, wr: &RecvWr) -> Result<()> {
        wr.check(self.max_sge)?;
        let (refs, mut sges) = lkey_refs(&self.dev, &wr.sges);
        let mut q = self.shared.slots.lock();
        if q.slots.len() >= self.max_wr {
            return Err(PostError::QueueFull { depth: self.max_wr }.into());
        }
        let seq = q.next_seq;
        // SAFETY: as in Qp::post_send.
        unsafe { self.hw.post_recv(seq | RECV_BIT, sges.as_mut_slice()) }
            .map_err(|e| post_error(e, self.max_wr, "ibv_post_srq_recv"))?;
        q.next_seq += 1;
        q.slots.insert(
            seq,
            Slot {
                seq,
                wr_id: wr.wr_id,
                opcode: WcOpcode::Recv,
                _refs: refs,
                _ah: None,
            },
        );
        Ok(())
    }

    /// Receives posted and not yet reaped.
    pub(crate) fn len(&self) -> usize {
        self.shared.slots.lock().slots.len()
    }

    /// `ibv_modify_srq` of the limit.
    pub(crate) fn arm_limit(&self, limit: usize) -> crate::Result<()> {
        self.dev.poll_async();
        self.shared.limit.store(false, Ordering::Release);
        let limit = u32::try_from(limit)
            .map_err(|_| crate::Error::InvalidArgument("an SRQ limit past u32"))?;
        self.hw.arm_limit(limit).map_err(verb("ibv_modify_srq"))
    }

    /// Takes the limit event if it fired.
    pub(crate) fn limit_reached(&self) -> bool {
        self.dev.poll_async();
        self.shared.limit.swap(false, Ordering::AcqRel)
    }
}
