//! Shared receive queues: receives that several queue pairs consume.

use crate::pd::ProtectionDomain;
use crate::provider;
use crate::qp::RecvRequest;
use crate::{Error, Result};

/// A shared receive queue (`ibv_srq`): receives that several queue pairs consume.
#[derive(Debug)]
pub struct SharedReceiveQueue {
    imp: Box<dyn provider::Srq>,
    max_wr: usize,
}

impl ProtectionDomain {
    /// Creates a shared receive queue (`ibv_create_srq`).
    pub fn create_srq(&self, max_wr: usize, max_sge: usize) -> Result<SharedReceiveQueue> {
        let dev = self.context().capabilities();
        if max_wr == 0 || max_wr > dev.max_qp_wr as usize || max_sge > dev.max_sge as usize {
            return Err(Error::InvalidArgument(
                "shared receive queue sizes outside the device's limits",
            ));
        }
        let imp = self
            .context()
            .device()
            .create_srq(self.id(), max_wr, max_sge)?;
        Ok(SharedReceiveQueue { imp, max_wr })
    }
}

impl SharedReceiveQueue {
    pub(crate) fn imp(&self) -> &dyn provider::Srq {
        self.imp.as_ref()
    }

    /// Posts a receive (`ibv_post_srq_recv`).
    pub fn post_recv(&self, req: impl std::borrow::Borrow<RecvRequest>) -> Result<()> {
        crate::owned::check_wr_id(req.borrow().wr().wr_id)?;
        // SAFETY: every element of a RecvRequest was made by LocalSge::new from a
        // registered region that owns its memory, which safe code only reaches through
        // copies.
        unsafe { self.imp.post_recv(req.borrow().wr()) }
    }

    /// Receives posted and not yet consumed (verbs: not yet reaped from a CQ).
    pub fn len(&self) -> usize {
        self.imp.len()
    }

    /// Whether no receive is posted.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Arms the limit: the limit event fires once when fewer than `limit` receives remain
    /// (`IBV_SRQ_LIMIT`). 0 disarms. A limit above the queue's `max_wr` is refused
    /// ([`Error::InvalidArgument`]), and so is one the adapter refuses (`ibv_modify_srq`;
    /// some refuse `max_wr` itself).
    pub fn arm_limit(&self, limit: usize) -> Result<()> {
        if limit > self.max_wr {
            return Err(Error::InvalidArgument(
                "an SRQ limit above the queue's max_wr",
            ));
        }
        self.imp.arm_limit(limit)
    }

    /// Takes the limit event (`IBV_EVENT_SRQ_LIMIT_REACHED`) if it fired.
    pub fn limit_reached(&self) -> bool {
        self.imp.limit_reached()
    }
}
