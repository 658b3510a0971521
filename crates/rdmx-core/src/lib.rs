//! # rdmx-core: the sans-IO core of rdmx
//!
//! This crate holds the parts of the verbs contract that need no sockets, no threads and
//! no clock: it is driven by the layers above and never calls out. Every provider runs the
//! same checks from here, and every software provider runs the same engine, so every
//! provider has the same semantics.
//!
//! ## Where it sits
//!
//! ```text
//! rdmx        facade and providers (IO, threads, clocks)
//! rdmx-mem    pinning, registration cache, pools: raw memory
//! rdmx-core   this crate: checks, state machines and the RC engine, no IO
//! rdmx-wire   IBTA transport headers as bytes
//! ```
//!
//! Lower layers never import higher ones. In particular this crate does not depend on
//! `rdmx-mem` (nor on libc): it names memory by key and address only, and reaches it
//! through the [`rc::MemAccess`] trait a provider implements.
//!
//! ## What it owns
//!
//! - [`access`]: the access flags of a registration ([`Access`]) and the verbs rule they
//!   obey ([`Access::validate`]).
//! - [`mr`]: the memory-region table: 32-bit keys made of a table index and key-variant
//!   bits, and the lookup every provider runs before touching memory, which checks the
//!   protection domain, the bounds and the access flags and says which check failed.
//! - [`qp`]: the queue-pair state machine (RESET → INIT → RTR → RTS, SQD, SQE, ERR) with
//!   the verbs attribute rules, and the parameters two sides exchange to connect.
//! - [`wr`]: work requests and completions, named as in verbs.
//! - [`rc`]: the engine: send and receive queues, requester and responder, retransmission
//!   and flow control for RC, and the UC and UD services on the same queues (no
//!   acknowledgement; UD with Q_Keys, per-request destinations and the GRH area), driven
//!   by `handle_*` and `poll_*` calls.
//!   Its packets are built and parsed with `rdmx-wire`.
//!
//! Randomness is passed in (the table's seed, initial PSNs), never drawn here, and time is
//! passed in as an `Instant`, so every behaviour is reproducible in tests.

#![forbid(unsafe_code)]

pub mod access;
pub mod mr;
pub mod qp;
pub mod rc;
pub mod wr;

pub use access::{Access, InvalidAccess};
pub use mr::{KeyError, KeyUse, MrEntry, MrTable, PdId, TableError};
pub use qp::{
    ud_steps, ConnectParams, ModifyError, Mtu, QpAttr, QpAttrMask, QpLimits, QpState,
    QpStateMachine, QpType, Transition,
};
pub use wr::{
    AddressVector, Completion, PostError, RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge,
    SgeList, SgeListFull, UdDest, WcOpcode, WcStatus, GRH_LEN, MAX_MESSAGE, MULTICAST_QPN,
};
