//! Shared pieces of the engine fuzz targets.
//!
//! [`FakeMem`] is registered memory for [`rdmx_core::rc::RcQp`]: one byte arena holding a
//! few regions with guard bytes around each, and a `Vec`-backed key table with fixed keys.
//! Unlike the test harness's memory it *checks every access the engine makes*: a write,
//! read or atomic must stay inside the range that [`MemAccess::resolve`] granted for the
//! handle used, with an access right that allows it. A violation panics with a message
//! starting `BUG:`, which libFuzzer reports as a crash. Guard bytes and regions the engine
//! must never change are compared with their first contents by [`FakeMem::check_intact`].
//!
//! The selectors ([`LenSel`], [`AddrSel`], ...) are small `Arbitrary` enums that steer
//! generated packets and requests towards the interesting values (region bounds, the MTU,
//! the expected PSN) while still allowing any value.

use std::cell::RefCell;

use arbitrary::Arbitrary;
use rdmx_core::rc::{MemAccess, Placement, Transmit};
use rdmx_core::{Access, KeyError, KeyUse, Mtu, PdId};

/// Address of the arena's first byte (a guard byte).
pub const BASE: u64 = 0x0000_7f00_0010_0000;
/// Guard bytes before, between and after the regions.
pub const GUARD: usize = 64;
/// Value of every guard byte.
pub const GUARD_BYTE: u8 = 0xA5;

/// Variant bits of the issued keys; other variants of the same index are stale keys.
const LKEY_VARIANT: u32 = 0x4C;
const RKEY_VARIANT: u32 = 0x52;
const STALE_VARIANT: u32 = 0x53;

/// A registered region.
#[derive(Clone, Debug)]
pub struct Region {
    /// Protection domain.
    pub pd: PdId,
    /// First byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Access granted.
    pub access: Access,
    /// Local key.
    pub lkey: u32,
    /// Remote key, when some remote access is granted.
    pub rkey: Option<u32>,
    /// Offset in the arena.
    off: usize,
}

/// What [`FakeMem::resolve`] hands the engine: the region and the exact range and rights
/// it was checked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Handle {
    /// Index of the region.
    pub region: usize,
    /// First byte granted.
    pub addr: u64,
    /// Bytes granted.
    pub len: u64,
    /// The rights checked.
    pub need: Access,
    /// Local or remote key.
    pub key_use: KeyUse,
}

impl Handle {
    fn covers(&self, addr: u64, len: usize) -> bool {
        match addr.checked_add(len as u64) {
            Some(end) => addr >= self.addr && end <= self.addr + self.len,
            None => false,
        }
    }
}

/// Checked registered memory; see the crate docs.
pub struct FakeMem {
    /// The regions, by index.
    pub regions: Vec<Region>,
    bytes: RefCell<Vec<u8>>,
    pristine: Vec<u8>,
    /// Per byte, the serial number of the last write to it (0: never written).
    written: RefCell<Vec<u64>>,
    serial: std::cell::Cell<u64>,
}

impl FakeMem {
    /// Lays out `specs` (protection domain, length, access) with guard bytes around each;
    /// region bytes start as a position-dependent pattern.
    pub fn new(specs: &[(PdId, usize, Access)]) -> FakeMem {
        let mut bytes = vec![GUARD_BYTE; GUARD];
        let mut regions = Vec::new();
        for (i, &(pd, len, access)) in specs.iter().enumerate() {
            let off = bytes.len();
            bytes.extend((0..len).map(|j| (j as u8).wrapping_mul(31).wrapping_add(i as u8 + 7)));
            bytes.extend(std::iter::repeat_n(GUARD_BYTE, GUARD));
            let index = (i as u32 + 1) << 8;
            let remote = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
            regions.push(Region {
                pd,
                addr: BASE + off as u64,
                len: len as u64,
                access,
                lkey: index | LKEY_VARIANT,
                rkey: access.intersects(remote).then_some(index | RKEY_VARIANT),
                off,
            });
        }
        let n = bytes.len();
        FakeMem {
            regions,
            pristine: bytes.clone(),
            bytes: RefCell::new(bytes),
            written: RefCell::new(vec![0; n]),
            serial: std::cell::Cell::new(0),
        }
    }

    /// A key with region `i`'s index and a variant never issued: a stale key.
    pub fn stale_key(&self, i: usize) -> u32 {
        ((i as u32 + 1) << 8) | STALE_VARIANT
    }

    /// Region `i`'s rkey, or a key of its index that is not an rkey when it has none.
    pub fn rkey(&self, i: usize) -> u32 {
        self.regions[i]
            .rkey
            .unwrap_or(((i as u32 + 1) << 8) | RKEY_VARIANT)
    }

    fn arena_off(&self, addr: u64, len: usize) -> usize {
        let off = addr.checked_sub(BASE).expect("BUG: access below the arena") as usize;
        assert!(
            off + len <= self.pristine.len(),
            "BUG: access past the arena"
        );
        off
    }

    /// The serial number of the last write so far, to pass to [`FakeMem::written_since`].
    pub fn stamp(&self) -> u64 {
        self.serial.get()
    }

    /// Whether every byte of `[addr, addr + len)` was written after [`FakeMem::stamp`]
    /// returned `stamp`.
    pub fn written_since(&self, addr: u64, len: u64, stamp: u64) -> bool {
        let off = self.arena_off(addr, len as usize);
        self.written.borrow()[off..off + len as usize]
            .iter()
            .all(|&w| w > stamp)
    }

    fn mark(&self, off: usize, len: usize) {
        let s = self.serial.get() + 1;
        self.serial.set(s);
        self.written.borrow_mut()[off..off + len].fill(s);
    }

    /// Panics unless every guard byte and every byte of the regions in `protected` still
    /// holds its first value.
    pub fn check_intact(&self, protected: &[usize]) {
        let bytes = self.bytes.borrow();
        let mut at = 0;
        for r in &self.regions {
            if let Some(i) = (at..r.off).find(|&i| bytes[i] != GUARD_BYTE) {
                panic!("BUG: guard byte at {:#x} overwritten", BASE + i as u64);
            }
            at = r.off + r.len as usize;
        }
        if let Some(i) = (at..bytes.len()).find(|&i| bytes[i] != GUARD_BYTE) {
            panic!("BUG: guard byte at {:#x} overwritten", BASE + i as u64);
        }
        for &p in protected {
            let r = &self.regions[p];
            let span = r.off..r.off + r.len as usize;
            assert!(
                bytes[span.clone()] == self.pristine[span],
                "BUG: region {p} ({:?}, {:?}) was written",
                r.pd,
                r.access
            );
        }
    }

    /// Copies a packet built by `poll_transmit_parts` into one buffer, reading its spans
    /// through the checked [`MemAccess::read`].
    pub fn flatten(&self, t: &Transmit<Handle>) -> Vec<u8> {
        let mut out = t.header.clone();
        for s in &t.gather {
            let at = out.len();
            out.resize(at + s.len as usize, 0);
            self.read(&s.mr, s.addr, &mut out[at..]);
        }
        out.resize(out.len() + usize::from(t.pad), 0);
        out
    }

    /// Does what a stream transport does with the engine's placements: copies each
    /// piece of `payload` to where it belongs, through the checked [`MemAccess::write`].
    pub fn place(&self, place: &[Placement<Handle>], payload: &[u8]) {
        let mut total = 0usize;
        for p in place {
            let (off, len) = (p.offset as usize, p.len as usize);
            assert!(
                off.checked_add(len).is_some_and(|end| end <= payload.len()),
                "BUG: placement {p:?} outside the {}-byte payload",
                payload.len()
            );
            total += len;
            self.write(&p.mr, p.addr, &payload[off..off + len]);
        }
        assert!(total <= payload.len(), "BUG: placements exceed the payload");
    }
}

impl MemAccess for FakeMem {
    type Mr = Handle;

    fn resolve(
        &self,
        key: u32,
        key_use: KeyUse,
        pd: PdId,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<Handle, KeyError> {
        let found = self.regions.iter().position(|r| match key_use {
            KeyUse::Local => r.lkey == key,
            KeyUse::Remote => r.rkey == Some(key),
        });
        let Some(i) = found else {
            return Err(KeyError::InvalidKey { key });
        };
        let r = &self.regions[i];
        if r.pd != pd {
            return Err(KeyError::PdMismatch {
                key,
                mr_pd: r.pd,
                pd,
            });
        }
        let inside = addr
            .checked_add(len)
            .is_some_and(|end| addr >= r.addr && end <= r.addr + r.len);
        if !inside {
            return Err(KeyError::OutOfBounds {
                key,
                addr,
                len,
                mr_addr: r.addr,
                mr_len: r.len,
            });
        }
        if !r.access.contains(need) {
            return Err(KeyError::AccessDenied {
                key,
                need,
                have: r.access,
            });
        }
        Ok(Handle {
            region: i,
            addr,
            len,
            need,
            key_use,
        })
    }

    fn read(&self, mr: &Handle, addr: u64, out: &mut [u8]) {
        assert!(
            mr.covers(addr, out.len()),
            "BUG: read of {} bytes at {addr:#x} outside the granted {mr:?}",
            out.len()
        );
        if mr.key_use == KeyUse::Remote {
            assert!(
                mr.need.contains(Access::REMOTE_READ),
                "BUG: remote read through {mr:?}"
            );
        }
        let off = self.arena_off(addr, out.len());
        out.copy_from_slice(&self.bytes.borrow()[off..off + out.len()]);
    }

    fn write(&self, mr: &Handle, addr: u64, data: &[u8]) {
        assert!(
            mr.covers(addr, data.len()),
            "BUG: write of {} bytes at {addr:#x} outside the granted {mr:?}",
            data.len()
        );
        let right = match mr.key_use {
            KeyUse::Local => Access::LOCAL_WRITE,
            KeyUse::Remote => Access::REMOTE_WRITE,
        };
        assert!(mr.need.contains(right), "BUG: write through {mr:?}");
        let off = self.arena_off(addr, data.len());
        self.bytes.borrow_mut()[off..off + data.len()].copy_from_slice(data);
        self.mark(off, data.len());
    }

    fn compare_swap(&self, mr: &Handle, addr: u64, compare: u64, swap: u64) -> u64 {
        let old = self.atomic_at(mr, addr);
        if old == compare {
            self.put_u64(addr, swap);
        }
        old
    }

    fn fetch_add(&self, mr: &Handle, addr: u64, add: u64) -> u64 {
        let old = self.atomic_at(mr, addr);
        self.put_u64(addr, old.wrapping_add(add));
        old
    }
}

impl FakeMem {
    fn atomic_at(&self, mr: &Handle, addr: u64) -> u64 {
        assert!(addr % 8 == 0, "BUG: atomic at unaligned {addr:#x}");
        assert!(
            mr.covers(addr, 8),
            "BUG: atomic at {addr:#x} outside the granted {mr:?}"
        );
        assert!(
            mr.key_use == KeyUse::Remote && mr.need.contains(Access::REMOTE_ATOMIC),
            "BUG: atomic through {mr:?}"
        );
        let off = self.arena_off(addr, 8);
        u64::from_ne_bytes(self.bytes.borrow()[off..off + 8].try_into().unwrap())
    }

    fn put_u64(&self, addr: u64, v: u64) {
        let off = self.arena_off(addr, 8);
        self.bytes.borrow_mut()[off..off + 8].copy_from_slice(&v.to_ne_bytes());
        self.mark(off, 8);
    }
}

/// A length: zero, small, around a multiple of the MTU, or anything.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum LenSel {
    /// 0.
    Zero,
    /// 1..=8 (8 is an atomic's length).
    Tiny(u8),
    /// 0..=255.
    Small(u8),
    /// `mult` (0..=4) MTUs plus `adj` (-128..=127).
    Mtu {
        /// MTUs.
        mult: u8,
        /// Adjustment.
        adj: i8,
    },
    /// Any 32-bit length.
    Raw(u32),
}

impl LenSel {
    /// The length for path MTU `mtu`.
    pub fn get(self, mtu: u32) -> u32 {
        match self {
            LenSel::Zero => 0,
            LenSel::Tiny(n) => u32::from(n % 8) + 1,
            LenSel::Small(n) => u32::from(n),
            LenSel::Mtu { mult, adj } => {
                (u32::from(mult % 5) * mtu).saturating_add_signed(i32::from(adj))
            }
            LenSel::Raw(n) => n,
        }
    }
}

/// An address relative to a region: near its start, near its end, 8-aligned inside, or
/// anything.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum AddrSel {
    /// Start plus an offset.
    Start(u16),
    /// End minus an offset.
    End(u16),
    /// Start plus 8 × n.
    Aligned(u8),
    /// Start plus a signed offset (below the start too).
    Around(i16),
    /// Any address.
    Raw(u64),
}

impl AddrSel {
    /// The address, relative to `r`.
    pub fn get(self, r: &Region) -> u64 {
        match self {
            AddrSel::Start(o) => r.addr + u64::from(o),
            AddrSel::End(o) => (r.addr + r.len).wrapping_sub(u64::from(o)),
            AddrSel::Aligned(n) => r.addr + 8 * u64::from(n),
            AddrSel::Around(o) => r.addr.wrapping_add_signed(i64::from(o)),
            AddrSel::Raw(a) => a,
        }
    }
}

/// A key, and the region addresses are taken relative to.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum KeySel {
    /// The region's own key (rkey for remote use, lkey for local use).
    Own(u8),
    /// A stale key of the region's index.
    Stale(u8),
    /// The region's other key (its lkey used as an rkey, or the reverse).
    Other(u8),
    /// Any key; addresses relative to region 0.
    Raw(u32),
}

impl KeySel {
    /// The key and the index of the region it relates to, for a `key_use` access.
    pub fn get(self, mem: &FakeMem, key_use: KeyUse) -> (u32, usize) {
        let n = mem.regions.len();
        let (own, other): (fn(&FakeMem, usize) -> u32, fn(&FakeMem, usize) -> u32) = match key_use {
            KeyUse::Remote => (|m, i| m.rkey(i), |m, i| m.regions[i].lkey),
            KeyUse::Local => (|m, i| m.regions[i].lkey, |m, i| m.rkey(i)),
        };
        match self {
            KeySel::Own(i) => (own(mem, usize::from(i) % n), usize::from(i) % n),
            KeySel::Stale(i) => (mem.stale_key(usize::from(i) % n), usize::from(i) % n),
            KeySel::Other(i) => (other(mem, usize::from(i) % n), usize::from(i) % n),
            KeySel::Raw(k) => (k, 0),
        }
    }
}

/// A path MTU.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum MtuSel {
    /// 256.
    M256,
    /// 512.
    M512,
    /// 1024.
    M1024,
    /// 4096.
    M4096,
}

impl MtuSel {
    /// The MTU.
    pub fn get(self) -> Mtu {
        match self {
            MtuSel::M256 => Mtu::Mtu256,
            MtuSel::M512 => Mtu::Mtu512,
            MtuSel::M1024 => Mtu::Mtu1024,
            MtuSel::M4096 => Mtu::Mtu4096,
        }
    }
}

/// A first PSN: 0, just before the 24-bit wrap, or anything.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum PsnStart {
    /// 0.
    Zero,
    /// 2^24 - 1 - n.
    NearWrap(u8),
    /// Any (masked to 24 bits).
    Raw(u32),
}

impl PsnStart {
    /// The PSN.
    pub fn get(self) -> u32 {
        match self {
            PsnStart::Zero => 0,
            PsnStart::NearWrap(n) => 0xFF_FFFF - u32::from(n),
            PsnStart::Raw(p) => p & 0xFF_FFFF,
        }
    }
}

/// This side's QP number.
pub const QPN: u32 = 0x11;
/// The fake peer's QP number.
pub const PEER_QPN: u32 = 0x22;

/// Takes `qp` from any state through RESET to RTS with `params`.
pub fn connect(qp: &mut rdmx_core::rc::RcQp<FakeMem>, params: &rdmx_core::ConnectParams) {
    use rdmx_core::{QpAttr, QpAttrMask, QpState};
    if qp.state() != QpState::Reset {
        let reset = QpAttr {
            qp_state: QpState::Reset,
            ..QpAttr::default()
        };
        qp.modify(&reset, QpAttrMask::STATE)
            .expect("any state may go to RESET");
    }
    for (attr, mask) in params.steps() {
        qp.modify(&attr, mask).expect("the connect steps are valid");
    }
}

/// A state change the fuzzer may ask for; refused ones are ignored.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Modify {
    /// RTS → SQD (drain), with or without the drained event.
    ToSqd(bool),
    /// SQD → RTS.
    ToRts,
    /// Any state → ERR.
    ToErr,
}

impl Modify {
    /// Applies the change to `qp`, ignoring a refusal.
    pub fn apply(self, qp: &mut rdmx_core::rc::RcQp<FakeMem>) {
        use rdmx_core::{QpAttr, QpAttrMask, QpState};
        let (state, mask) = match self {
            Modify::ToSqd(true) => (
                QpState::Sqd,
                QpAttrMask::STATE | QpAttrMask::EN_SQD_ASYNC_NOTIFY,
            ),
            Modify::ToSqd(false) => (QpState::Sqd, QpAttrMask::STATE),
            Modify::ToRts => (QpState::Rts, QpAttrMask::STATE),
            Modify::ToErr => (QpState::Err, QpAttrMask::STATE),
        };
        let attr = QpAttr {
            qp_state: state,
            en_sqd_async_notify: true,
            ..qp.attrs().clone()
        };
        let _ = qp.modify(&attr, mask);
        let _ = qp.take_sq_drained_event();
    }
}

/// Parses a packet the engine sent: it must be a valid RC packet for the peer.
pub fn check_sent(p: &[u8]) -> rdmx_wire::RcRepr<'_> {
    let r = rdmx_wire::RcRepr::parse_bytes(p).unwrap_or_else(|e| {
        panic!("BUG: the engine sent a packet that does not parse: {e} ({p:02x?})")
    });
    assert_eq!(
        r.bth.dest_qpn, PEER_QPN,
        "BUG: packet for the wrong QP: {r}"
    );
    r
}

/// Whether `RDMX_FUZZ_TRACE` is set: the targets then print one line per completion (and
/// other events) on stderr, so `-runs=0` over a corpus shows which paths it reaches, e.g.
/// `RDMX_FUZZ_TRACE=1 cargo fuzz run T corpus/T -- -runs=0 2>&1 | grep '^trace' | sort | uniq -c`.
pub fn tracing() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("RDMX_FUZZ_TRACE").is_some())
}

/// Prints `trace <what>` on stderr when [`tracing`] is on.
#[macro_export]
macro_rules! trace {
    ($($t:tt)*) => {
        if $crate::tracing() {
            eprintln!("trace {}", format_args!($($t)*));
        }
    };
}
