//! Access flags of a memory registration, as in verbs (`IBV_ACCESS_*`).
//!
//! The flags and their verbs rule belong to the sans-IO core, which checks them on every
//! key use; they are re-exported here because every registration carries them.

pub use rdmx_core::access::{Access, InvalidAccess};
