//! Shared receive queues: receives that several queue pairs consume, with a limit event.

use std::collections::VecDeque;

use super::{resolve_sges, MemAccess, RecvWqe, Spare};
use crate::access::Access;
use crate::mr::PdId;
use crate::wr::{PostError, RecvWr};

/// A shared receive queue (`ibv_srq`).
///
/// Queue pairs created with [`QpConfig::srq`](super::QpConfig::srq) take their receives
/// from one of these instead of their own receive queue. When the number of posted
/// receives falls below an armed limit, the limit event fires once
/// (`IBV_EVENT_SRQ_LIMIT_REACHED`) and the limit disarms, as verbs does.
#[derive(Debug)]
pub struct Srq<Mr> {
    pd: PdId,
    max_wr: usize,
    max_sge: usize,
    pub(crate) queue: VecDeque<RecvWqe<Mr>>,
    pub(crate) spare: Spare<Mr>,
    limit: Option<usize>,
    limit_event: bool,
    /// The limit the last [`take`](Self::take) fired, if it did, and whether an event was
    /// already pending then: a receive put back at once ([`put_back`](Self::put_back))
    /// was not consumed, and fires nothing.
    fired_by_last: Option<(usize, bool)>,
}

impl<Mr> Srq<Mr> {
    /// An empty SRQ in `pd` holding up to `max_wr` receives of up to `max_sge` elements.
    pub fn new(pd: PdId, max_wr: usize, max_sge: usize) -> Self {
        Srq {
            pd,
            max_wr,
            max_sge,
            queue: VecDeque::new(),
            spare: Spare::new(max_wr, max_sge, 0),
            limit: None,
            limit_event: false,
            fired_by_last: None,
        }
    }

    /// Posts a receive (`ibv_post_srq_recv`), taking the request by value; see
    /// [`post_recv_ref`](Self::post_recv_ref), which this calls.
    pub fn post_recv<M: MemAccess<Mr = Mr>>(
        &mut self,
        mem: &M,
        wr: RecvWr,
    ) -> Result<(), PostError> {
        self.post_recv_ref(mem, &wr)
    }

    /// Posts a receive (`ibv_post_srq_recv`). Once the queue has been as deep as it gets,
    /// this allocates nothing: the queue pairs that consume receives give their room back.
    pub fn post_recv_ref<M: MemAccess<Mr = Mr>>(
        &mut self,
        mem: &M,
        wr: &RecvWr,
    ) -> Result<(), PostError> {
        if self.queue.len() >= self.max_wr {
            return Err(PostError::QueueFull { depth: self.max_wr });
        }
        wr.check(self.max_sge)?;
        let mut segs = self.spare.segs();
        let error = resolve_sges(mem, self.pd, &wr.sges, Access::LOCAL_WRITE, &mut segs);
        let len = segs.iter().map(|s| u64::from(s.len)).sum();
        self.queue.push_back(RecvWqe {
            wr_id: wr.wr_id,
            segs,
            len,
            error,
        });
        Ok(())
    }

    /// Receives posted and not yet consumed.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether no receive is posted.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Arms the limit (`ibv_modify_srq` with `IBV_SRQ_LIMIT`): the event fires when fewer
    /// than `limit` receives remain. A limit of 0 disarms.
    pub fn arm_limit(&mut self, limit: usize) {
        self.limit = (limit > 0).then_some(limit);
    }

    /// Takes the limit event, if it fired since the last call.
    pub fn take_limit_event(&mut self) -> bool {
        std::mem::take(&mut self.limit_event)
    }

    pub(crate) fn take(&mut self) -> Option<RecvWqe<Mr>> {
        let wqe = self.queue.pop_front()?;
        self.fired_by_last = None;
        if let Some(l) = self.limit.filter(|&l| self.queue.len() < l) {
            self.limit = None;
            self.fired_by_last = Some((l, self.limit_event));
            self.limit_event = true;
        }
        Some(wqe)
    }

    /// Puts back, at the head, the receive the last [`take`](Self::take) took, unused
    /// (the message was dropped): had that take fired the limit, the limit is armed
    /// again and the event withdrawn, since no receive was consumed.
    pub(crate) fn put_back(&mut self, wqe: RecvWqe<Mr>) {
        self.queue.push_front(wqe);
        if let Some((l, pending)) = self.fired_by_last.take() {
            self.limit = Some(l);
            self.limit_event = pending;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::RecvWqe;
    use super::Srq;
    use crate::mr::PdId;

    fn wqe(wr_id: u64) -> RecvWqe<()> {
        RecvWqe {
            wr_id,
            segs: Vec::new(),
            len: 64,
            error: None,
        }
    }

    /// A receive put back at once withdraws only the event its own take fired: one that
    /// was pending before (fired, then the limit armed again) stays.
    #[test]
    fn a_receive_put_back_withdraws_only_its_own_event() {
        let mut srq = Srq::<()>::new(PdId(1), 8, 1);
        for i in 0..4 {
            srq.queue.push_back(wqe(i));
        }
        srq.arm_limit(3);
        let w = srq.take().unwrap(); // 3 left: not below the limit
        srq.put_back(w);
        assert!(!srq.take_limit_event());
        let _consumed = srq.take().unwrap(); // 3 left
        let _consumed = srq.take().unwrap(); // 2 left: fires
        srq.arm_limit(2);
        let w = srq.take().unwrap(); // 1 left: fires again, then put back unused
        srq.put_back(w);
        assert!(srq.take_limit_event(), "the first, real event was lost");
        assert!(!srq.take_limit_event());
        assert_eq!(srq.len(), 2);
        // The limit is armed again: the next receive consumed fires it.
        let _consumed = srq.take().unwrap();
        assert!(srq.take_limit_event());
    }
}
