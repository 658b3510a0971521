//! # rdmx-core: the sans-IO core of rdmx
//!
//! This crate holds the parts of the verbs contract that need no sockets, no threads and
//! no clock: it is driven by the layers above and never calls out. Today it owns the
//! memory-region table ([`mr`]): 32-bit keys made of a table index and key-variant bits,
//! and the lookup every provider runs before touching memory, which checks the protection
//! domain, the bounds and the access flags and says which check failed.
//!
//! Randomness is passed in (the table's seed), never drawn here, so every behaviour is
//! reproducible in tests.

#![forbid(unsafe_code)]

pub mod mr;
pub mod qp;
pub mod rc;
pub mod wr;

pub use mr::{KeyError, KeyUse, MrEntry, MrTable, PdId, TableError};
pub use qp::{
    ConnectParams, ModifyError, Mtu, QpAttr, QpAttrMask, QpLimits, QpState, QpStateMachine,
    Transition,
};
pub use rdmx_mem::Access;
pub use wr::{
    Completion, PostError, RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge, WcOpcode, WcStatus,
};
