//! # rdmx-transfer: a batch transfer engine on rdmx
//!
//! For KV-cache transfer, checkpoint shipping, replication and block storage: callers
//! move byte ranges between named segments and never see a queue pair or a key.
//!
//! - An [`Engine`] has a name, rails (devices: shm, tcp, verbs) and a segment: the
//!   buffers it [registers](Engine::register), laid end to end in one offset space, each
//!   open to peers' READs and WRITEs only where asked.
//! - [`Engine::open_segment`] connects to a peer (a handshake over its control listener:
//!   descriptors exchanged, transport chosen — shm on the same host, verbs when both have
//!   a device, tcp otherwise — GID and MTU checked, queue pairs connected, each with its
//!   own secret) and returns a [`Segment`].
//! - A [`Batch`] of READ and WRITE requests (local buffer and offset, segment, target by
//!   offset or buffer name, length) is [submitted](Engine::submit); requests are cut into
//!   slices ([`Config::slice_size`]: 64 KiB on tcp and verbs, 1 MiB on shm) spread over
//!   every path to the peer ([`Config::qps_per_rail`] queue pairs on each rail of the
//!   chosen transport), by each path's bytes queued and in flight over its measured
//!   bandwidth.
//! - A path that fails, or whose slices get no completion within [`Config::timeout`], is
//!   set aside ([`Config::set_aside`]), its slices retried on others (up to
//!   [`Config::max_retries`]), and it is rebuilt on demand later; a request fails only
//!   when every path has, or when a slice is not even flushed within a second timeout,
//!   with the work-completion status and the path ([`RequestStatus::Failed`]). What was in
//!   flight on the failed path goes again only once the peer has moved its side of the
//!   path to the error state (a fence, asked for over the control connection with the
//!   connection's secret): a first attempt that a TCP stream, an shm ring or a fabric
//!   may still hold cannot land after the retry. A peer that does not confirm the fence
//!   (within [`Config::connect_timeout`] to connect, and again to answer) fails that
//!   work instead; failover therefore needs the peer's control listener reachable.
//!   A slice the peer refuses for its key, range or rights fails at once, on the one
//!   path it took down; one refused as an invalid request (which a fabric also answers
//!   when the path's request stream broke) goes on another path once.
//! - Notifications: a batch may carry one the peer receives only after all its bytes are
//!   in place ([`Batch::notify`]); [`Engine::notify`] sends one alone. Each is delivered
//!   once: it carries a number of its connection, and the peer drops a second arrival
//!   (a first attempt that arrived although its path failed). One sent again after a
//!   failure may arrive after later ones, and fails instead if over 32,768 later ones
//!   went meanwhile.
//!
//! Layers: this crate uses only rdmx's public facade (contexts, protection domains,
//! regions, queue pairs, completion queues).
//!
//! ```
//! use rdmx::Access;
//! use rdmx_transfer::{Batch, Config, Engine, Rail, Target};
//! # fn main() -> rdmx_transfer::Result<()> {
//! let tcp = || Config::default().rails(vec![Rail::tcp("127.0.0.1:0".parse().unwrap())]);
//! let target = Engine::new("decode-0", tcp().listen("127.0.0.1:0".parse().unwrap()))?;
//! let kv = target.register("kv", 1 << 20, Access::REMOTE_WRITE | Access::REMOTE_READ)?;
//!
//! let initiator = Engine::new("prefill-0", tcp())?;
//! let src = initiator.register("out", vec![7u8; 256 << 10], Access::LOCAL_WRITE)?;
//! let seg = initiator.open_segment(&target.control_addr().to_string())?;
//! let mut batch = Batch::new();
//! batch.write((&src, 0), &seg, Target::Buffer("kv", 4096), 256 << 10)?;
//! batch.notify(b"layer 0 ready")?;
//! let done = initiator.submit(batch).wait(std::time::Duration::from_secs(10))?;
//! assert!(done.is_success());
//!
//! let n = target.recv_notification(std::time::Duration::from_secs(10)).unwrap();
//! assert_eq!(n.data, b"layer 0 ready");
//! let mut got = [0u8; 4];
//! kv.read(4096, &mut got)?;
//! assert_eq!(got, [7; 4]);
//! # Ok(()) }
//! ```

mod batch;
mod config;
mod engine;
mod error;
mod fence;
mod handshake;
mod meta;
mod notes;
mod path;
mod seen;
mod segment;
mod wire;
mod worker;

/// Largest notification, in bytes.
pub const MAX_NOTIFY: usize = 4096;

pub use batch::{Batch, BatchHandle, BatchStatus, Failure, Op, RequestStatus};
pub use config::{Config, Rail, Transport};
pub use engine::{Engine, Notification};
pub use error::{Error, Result};
pub use meta::SegmentEvent;
pub use path::PathStatus;
pub use segment::{LocalBuf, Mem, Segment, Slot, SlotPool, Target};
pub use wire::{BufferDesc, RailDesc, SegmentDesc};
