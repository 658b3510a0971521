//! The loopback provider: queue pairs of this process connected through the RC engine,
//! with packets passed in memory.
//!
//! Every loopback queue pair lives in one process-wide fabric, addressed by its QP
//! number. Progress is made from the calling thread: each verb that can change a queue
//! pair (post, modify, poll) pumps the fabric until nothing moves, delivering packets,
//! routing completions to their CQs and firing due timers, so one-sided operations
//! complete as soon as either side calls in. The fabric is serialised by one lock; it is
//! the reference for semantics, not for speed.
//!
//! A context opened by name with [`FAULTS_ENV`] set (or, with the `testing` feature, with
//! `Options::faults`) has the packets its queue pairs send dropped, delayed, duplicated,
//! reordered or corrupted on their way (`faults`); delayed packets wait in the fabric
//! until they are due.

#[cfg(feature = "testing")]
pub mod faults;
#[cfg(not(feature = "testing"))]
#[allow(dead_code, unreachable_pub)]
mod faults;

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use parking_lot::Mutex;
use rdmx_core::rc::{DatagramInfo, RcQp, Srq};
use rdmx_core::{QpType, MULTICAST_QPN};

#[cfg(feature = "testing")]
pub use faults::{FaultStats, Faults};

use self::faults::{Faults as FaultSpec, Injector, Rng, Wire};
use crate::ah::LOCAL_GID;
use crate::endpoint::PeerAddr;
use crate::provider::{self, Capabilities, CqCore, MrRef, ProviderConfig};
use crate::soft::{self, Engine, Keys, SoftDevice, SoftQp, SoftSrq, Transport};
use crate::{Error, Result};

/// The provider's name.
pub const NAME: &str = "loopback";

/// The environment variable that gives a loopback context opened by name
/// (`Context::open_provider("loopback")`, `rdmx bench --provider loopback`) faults on the
/// packets its queue pairs send, to see an application (or a benchmark) under loss:
/// comma-separated `KIND=PPM` (parts per million of packets) for `drop`, `duplicate`,
/// `reorder`, `corrupt` (a bit flipped, caught by a CRC: a loss) and `mangle` (headers
/// broken), `delay=PPM@MICROS`, and `seed=N` for the generators (0 by default, so a
/// failing run repeats), e.g. `RDMX_LOOPBACK_FAULTS=drop=2000,seed=7`. A value that does
/// not parse fails the open.
pub const FAULTS_ENV: &str = "RDMX_LOOPBACK_FAULTS";
const DEVICE: &str = "loopback0";

/// How to open a loopback context.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct Options {
    #[cfg(feature = "testing")]
    faults: Option<Faults>,
    #[cfg(feature = "testing")]
    seed: Option<u64>,
}

impl Options {
    /// Drops, delays, duplicates, reorders or corrupts the packets this context's queue
    /// pairs send, to test recovery.
    #[cfg(feature = "testing")]
    pub fn faults(mut self, faults: Faults) -> Self {
        self.faults = Some(faults);
        self
    }

    /// Key variants derived from `seed` instead of drawn at random: keys are then
    /// predictable, for reproducible tests only.
    #[cfg(feature = "testing")]
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }
}

impl From<Options> for ProviderConfig {
    fn from(opts: Options) -> ProviderConfig {
        ProviderConfig::new(NAME, move || {
            #[cfg(feature = "testing")]
            let (seed, faults) = (opts.seed, opts.faults);
            #[cfg(not(feature = "testing"))]
            let (seed, faults) = {
                let _ = opts;
                (None, None)
            };
            open_device(seed, faults)
        })
    }
}

/// The provider as the registry lists it.
pub(crate) const ENTRY: provider::Entry = provider::Entry {
    name: NAME,
    devices: || {
        vec![provider::DeviceInfo {
            provider: NAME,
            name: DEVICE.to_string(),
            capabilities: caps(),
            gid: None,
        }]
    },
    open: |device| {
        if let Some(d) = device.filter(|&d| d != DEVICE) {
            return Err(crate::Error::NoDevice(format!(
                "provider {NAME} has no device {d}; its device is {DEVICE}"
            )));
        }
        let faults = match std::env::var(FAULTS_ENV) {
            Ok(spec) => Some(
                FaultSpec::parse(&spec)
                    .map_err(|e| crate::Error::NoDevice(format!("{NAME}: {FAULTS_ENV}: {e}")))?,
            ),
            Err(_) => None,
        };
        open_device(None, faults)
    },
};

/// Opens a device: its keys derived from `seed` (drawn at random if `None`), `faults`
/// applied to its packets.
fn open_device(seed: Option<u64>, faults: Option<FaultSpec>) -> Result<Arc<dyn provider::Device>> {
    let seed = match seed {
        Some(s) => s,
        None => soft::seed()?,
    };
    crate::provider::copy::calibrate();
    let faults = faults.map(|f| Arc::new(Injector::new(f)));
    Ok(Arc::new(Device::new(seed, faults)) as Arc<dyn provider::Device>)
}

fn caps() -> Capabilities {
    let limits = limits();
    let mut caps = soft::capabilities(&limits, limits.max_mtu);
    // The fabric routes each datagram by its own destination, and fans groups out.
    caps.ud = true;
    caps.multicast = true;
    caps
}

/// Datagrams the fabric carried to no queue pair: an unknown QP number, or a multicast
/// group nobody joined.
pub fn stray_datagrams() -> u64 {
    fabric().lock().stray
}

/// Wire destinations from here up name multicast groups (index in `Fabric::groups`), not
/// QPs (whose numbers are 24 bits).
const GROUP_BASE: u32 = 1 << 24;

/// What fault injection did to this context's packets; `None` for a context of another
/// provider or one opened without [`Options::faults`].
#[cfg(feature = "testing")]
pub fn fault_stats(ctx: &crate::Context) -> Option<FaultStats> {
    ctx.device()
        .as_any()
        .downcast_ref::<Device>()?
        .faults
        .as_ref()
        .map(|i| i.stats())
}

/// A loopback device: a key table, and the faults its packets meet.
#[derive(Debug)]
struct Device {
    keys: Arc<Keys>,
    caps: Capabilities,
    faults: Option<Arc<Injector>>,
}

impl Device {
    fn new(seed: u64, faults: Option<Arc<Injector>>) -> Device {
        start_progress_thread();
        Device {
            keys: Arc::new(Keys::new(seed)),
            caps: caps(),
            faults,
        }
    }
}

impl SoftDevice for Device {
    const PROVIDER: &'static str = NAME;
    const DEVICE: &'static str = DEVICE;
    const AFTER_SRQ_POST: fn() = progress;
    fn keys(&self) -> &Arc<Keys> {
        &self.keys
    }
    fn caps(&self) -> &Capabilities {
        &self.caps
    }
    fn address(&self) -> PeerAddr {
        PeerAddr::Local
    }
    fn create_cq(&self, _core: &Arc<CqCore>) -> Result<Box<dyn provider::Cq>> {
        Ok(Box::new(Cq))
    }
    fn create_qp(&self, init: provider::QpInit<'_>) -> Result<Box<dyn provider::Qp>> {
        let srq = SoftSrq::of(init.srq)?;
        let mut fab = fabric().lock();
        let qpn = fab.alloc_qpn().ok_or(Error::InvalidArgument(
            "every loopback queue pair number is taken",
        ))?;
        let faults = self.faults.as_ref().map(|i| (i.clone(), i.rng(qpn), None));
        fab.qps.insert(
            qpn,
            Entry {
                engine: RcQp::new(soft::config(&init, qpn), limits()),
                keys: self.keys.clone(),
                send_cq: init.send_cq.core.clone(),
                recv_cq: init.recv_cq.core.clone(),
                srq,
                faults,
            },
        );
        Ok(Box::new(SoftQp {
            qpn,
            transport: Link { qpn },
        }))
    }
}

/// A loopback CQ: polling it pumps the fabric.
#[derive(Debug)]
struct Cq;

impl provider::Cq for Cq {
    fn progress(&self, _core: &CqCore) -> Result<()> {
        progress();
        Ok(())
    }
    fn needs_polling(&self) -> bool {
        true
    }
    fn notifies_unpolled(&self) -> bool {
        // Every post pumps the fabric, and the progress thread fires timers.
        true
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A loopback QP's place in the fabric.
#[derive(Debug)]
struct Link {
    qpn: u32,
}

impl Transport for Link {
    fn with<T>(&self, f: impl FnOnce(&mut Engine, &Keys) -> T) -> T {
        let mut fab = fabric().lock();
        let e = fab
            .qps
            .get_mut(&self.qpn)
            .expect("a live queue pair is in the fabric");
        let out = f(&mut e.engine, &e.keys);
        fab.pump();
        out
    }
    fn address(&self) -> PeerAddr {
        PeerAddr::Local
    }
    fn multicast(&self, gid: [u8; 16], attach: bool) -> Result<()> {
        let mut fab = fabric().lock();
        let i = match fab.groups.iter().position(|(g, _)| *g == gid) {
            Some(i) => i,
            None if attach => {
                fab.groups.push((gid, Vec::new()));
                fab.groups.len() - 1
            }
            None => {
                return Err(crate::Error::InvalidArgument(
                    "the queue pair is not attached to that group",
                ))
            }
        };
        let members = &mut fab.groups[i].1;
        let at = members.iter().position(|&q| q == self.qpn);
        match (attach, at) {
            (true, None) => members.push(self.qpn),
            // Attaching twice is harmless, as in verbs.
            (true, Some(_)) => {}
            (false, Some(j)) => {
                members.swap_remove(j);
            }
            (false, None) => {
                return Err(crate::Error::InvalidArgument(
                    "the queue pair is not attached to that group",
                ))
            }
        }
        Ok(())
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        let mut fab = fabric().lock();
        for (_, members) in fab.groups.iter_mut() {
            members.retain(|&q| q != self.qpn);
        }
        drop(fab);
        let entry = fabric().lock().qps.remove(&self.qpn);
        // Completion queues and regions the QP held are released outside the lock.
        drop(entry);
    }
}

struct Entry {
    engine: Engine,
    keys: Arc<Keys>,
    send_cq: Arc<CqCore>,
    recv_cq: Arc<CqCore>,
    /// The shared receive queue the QP takes its receives from.
    srq: Option<Arc<Mutex<Srq<MrRef>>>>,
    /// With fault injection: the context's injector, the QP's generator, and a packet held
    /// back for reordering.
    faults: Option<(Arc<Injector>, Rng, Option<Wire>)>,
}

struct Fabric {
    qps: HashMap<u32, Entry>,
    next_qpn: u32,
    /// Delayed packets: when each is due, and who sent it.
    delayed: Vec<(Instant, u32, Wire)>,
    /// Multicast groups and their members; a group keeps its index for good.
    groups: Vec<([u8; 16], Vec<u32>)>,
    /// Datagrams that reached no queue pair.
    stray: u64,
}

fn fabric() -> &'static Mutex<Fabric> {
    static FABRIC: OnceLock<Mutex<Fabric>> = OnceLock::new();
    FABRIC.get_or_init(|| {
        Mutex::new(Fabric {
            qps: HashMap::new(),
            next_qpn: FIRST_QPN,
            delayed: Vec::new(),
            groups: Vec::new(),
            stray: 0,
        })
    })
}

/// The first queue pair number handed out: 0 and 1 are special in InfiniBand.
const FIRST_QPN: u32 = 0x11;

/// The first number from `*next` on (wrapping within 24 bits, to [`FIRST_QPN`]) that is
/// not `in_use` nor the multicast QPN; `*next` moves past it. `None` when all are.
fn next_free_qpn(next: &mut u32, in_use: impl Fn(u32) -> bool) -> Option<u32> {
    for _ in 0..=0xff_ffffu32 {
        let qpn = *next;
        *next = match (qpn + 1) & 0xff_ffff {
            n if n < FIRST_QPN => FIRST_QPN,
            n => n,
        };
        if qpn != rdmx_core::MULTICAST_QPN && !in_use(qpn) {
            return Some(qpn);
        }
    }
    None
}

impl Fabric {
    /// A free queue pair number: the next after the last handed out, skipping those in
    /// use, the special ones (below [`FIRST_QPN`]) and the multicast QPN, once the 24-bit
    /// space wraps. `None` when every one is in use.
    fn alloc_qpn(&mut self) -> Option<u32> {
        let qps = &self.qps;
        next_free_qpn(&mut self.next_qpn, |n| qps.contains_key(&n))
    }

    /// Runs every queue pair until no packet, completion or due timer is left.
    fn pump(&mut self) {
        let now = Instant::now();
        loop {
            let mut moved = self.deliver_due(now);
            let qpns: Vec<u32> = self.qps.keys().copied().collect();
            for qpn in qpns {
                let mut packets = Vec::new();
                if let Some(e) = self.qps.get_mut(&qpn) {
                    if e.engine.poll_timeout().is_some_and(|t| t <= now) {
                        e.engine.handle_timeout(now);
                    }
                    if e.engine.config().qp_type == QpType::Ud {
                        while let Some((p, av)) = e.engine.poll_datagram(now, &*e.keys) {
                            packets.push((p, av));
                        }
                    } else {
                        while let Some(p) = e.engine.poll_transmit(now, &*e.keys) {
                            packets.push((p, None));
                        }
                    }
                    moved |= route_completions(e);
                }
                let dest_qpn = self.qps.get(&qpn).map(|e| e.engine.dest_qpn());
                for (p, av) in packets {
                    moved = true;
                    let dest = match av {
                        None => dest_qpn.unwrap_or(0),
                        Some(av) => {
                            let to = u32::from_be_bytes([0, p[5], p[6], p[7]]);
                            if av.is_multicast() && to == MULTICAST_QPN {
                                match self.groups.iter().position(|(g, _)| *g == av.dgid) {
                                    Some(i) => GROUP_BASE + i as u32,
                                    None => {
                                        self.stray += 1;
                                        continue;
                                    }
                                }
                            } else {
                                to
                            }
                        }
                    };
                    self.send(qpn, Wire::plain(dest, p), now);
                }
            }
            if !moved {
                // Packets held back for reordering go once nothing overtakes them.
                moved = self.release_held(now);
            }
            if !moved {
                break;
            }
        }
    }

    /// The earliest instant a delayed packet is due.
    fn next_delayed(&self) -> Option<Instant> {
        self.delayed.iter().map(|(t, _, _)| *t).min()
    }

    /// Sends `w` from QP `from`, through its context's faults if it has any.
    fn send(&mut self, from: u32, w: Wire, now: Instant) {
        let Some(e) = self.qps.get_mut(&from) else {
            return;
        };
        let Some((inj, rng, held)) = e.faults.as_mut() else {
            self.deliver(None, w, now);
            return;
        };
        let inj = inj.clone();
        let fate = faults::apply(&inj, rng, now, w.dest, w.bytes);
        let overtaken = match fate.hold {
            Some(h) => held.replace(h),
            None => held.take(),
        };
        if let Some((at, w)) = fate.later {
            self.delayed.push((at, from, w));
        }
        for w in fate.now {
            self.deliver(Some(&inj), w, now);
        }
        // A packet held back goes after the one that overtook it.
        if let Some(w) = overtaken {
            self.deliver(Some(&inj), w, now);
        }
    }

    fn deliver_due(&mut self, now: Instant) -> bool {
        let mut due = Vec::new();
        let mut i = 0;
        while i < self.delayed.len() {
            if self.delayed[i].0 <= now {
                due.push(self.delayed.swap_remove(i));
            } else {
                i += 1;
            }
        }
        due.sort_by_key(|(t, _, _)| *t);
        let moved = !due.is_empty();
        for (_, from, w) in due {
            let inj = self
                .qps
                .get(&from)
                .and_then(|e| e.faults.as_ref().map(|f| f.0.clone()));
            self.deliver(inj.as_deref(), w, now);
        }
        moved
    }

    fn release_held(&mut self, now: Instant) -> bool {
        let mut held = Vec::new();
        for e in self.qps.values_mut() {
            if let Some((inj, _, h)) = e.faults.as_mut() {
                if let Some(w) = h.take() {
                    held.push((Some(inj.clone()), w));
                }
            }
        }
        let moved = !held.is_empty();
        for (inj, w) in held {
            self.deliver(inj.as_deref(), w, now);
        }
        moved
    }

    /// Hands `w` to its destination QP, unless it fails its CRC check.
    fn deliver(&mut self, inj: Option<&Injector>, w: Wire, now: Instant) {
        if !w.intact(inj) {
            return;
        }
        if w.dest >= GROUP_BASE {
            let Some((gid, members)) = self.groups.get((w.dest - GROUP_BASE) as usize) else {
                return;
            };
            let (gid, members) = (*gid, members.clone());
            if members.is_empty() {
                self.stray += 1;
            }
            for m in members {
                self.deliver_to(m, gid, &w.bytes, now);
            }
        } else {
            self.deliver_to(w.dest, LOCAL_GID.octets(), &w.bytes, now);
        }
    }

    /// Hands a packet to QP `dest`; `dgid` is where a datagram was sent.
    fn deliver_to(&mut self, dest: u32, dgid: [u8; 16], bytes: &[u8], now: Instant) {
        let Some(peer) = self.qps.get_mut(&dest) else {
            if matches!(
                bytes.first(),
                Some(&(rdmx_wire::UD_SEND_ONLY | rdmx_wire::UD_SEND_ONLY_WITH_IMMEDIATE))
            ) {
                self.stray += 1;
            }
            return;
        };
        let mut srq = peer.srq.as_ref().map(|s| s.lock());
        if peer.engine.config().qp_type == QpType::Ud {
            let info = DatagramInfo {
                sgid: LOCAL_GID.octets(),
                dgid,
                roce_ipv4: false,
                roce_ipv6: false,
            };
            peer.engine
                .handle_datagram(&*peer.keys, srq.as_deref_mut(), &info, bytes);
        } else {
            peer.engine
                .handle_packet_srq(now, &*peer.keys, srq.as_deref_mut(), bytes);
        }
    }
}

fn route_completions(e: &mut Entry) -> bool {
    soft::route_completions(&mut e.engine, &e.send_cq, &e.recv_cq)
}

/// Pumps the fabric from a verb that does not otherwise touch it (polling a CQ).
fn progress() {
    fabric().lock().pump();
}

/// Starts, once per process, the thread that fires timers (retransmission, the end of an
/// RNR wait) when no application thread calls in, so a request completes even while the
/// application only waits on a CQ's descriptor.
fn start_progress_thread() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        let spawned = std::thread::Builder::new()
            .name("rdmx-loopback".into())
            .spawn(|| loop {
                let next = {
                    let mut fab = fabric().lock();
                    fab.pump();
                    fab.qps
                        .values()
                        .filter_map(|e| e.engine.poll_timeout())
                        .chain(fab.next_delayed())
                        .min()
                };
                let now = Instant::now();
                let idle = std::time::Duration::from_millis(50);
                let wait = next.map_or(idle, |t| t.saturating_duration_since(now).min(idle));
                std::thread::sleep(wait.max(std::time::Duration::from_micros(20)));
            });
        if let Err(e) = spawned {
            tracing::warn!(
                "cannot start the loopback progress thread ({e}); progress is made only \
                 when the application calls in"
            );
        }
    });
}

/// Limits of loopback queue pairs.
fn limits() -> rdmx_core::QpLimits {
    soft::limits(rdmx_core::QpLimits::default().max_mtu)
}

#[cfg(test)]
mod tests {
    use super::{next_free_qpn, FIRST_QPN};

    /// Past the 24-bit space, numbers wrap to the first after the special ones, and
    /// neither a number in use nor the multicast QPN is handed out.
    #[test]
    fn queue_pair_numbers_wrap_around_those_in_use() {
        let in_use = |n: u32| n == 0xff_fffd || n == FIRST_QPN;
        let mut next = 0xff_fffc;
        let got: Vec<u32> = (0..3)
            .map(|_| next_free_qpn(&mut next, in_use).unwrap())
            .collect();
        assert_eq!(got, [0xff_fffc, 0xff_fffe, FIRST_QPN + 1]);
        let mut next = FIRST_QPN;
        assert_eq!(next_free_qpn(&mut next, |_| true), None);
    }
}
