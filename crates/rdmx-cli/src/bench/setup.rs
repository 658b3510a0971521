//! One side of a run: its context, CQ, queue pairs and regions, and the few control
//! messages the two sides trade around each measurement (connecting the sides is in
//! [`super::connect`]).
//!
//! ## Control messages
//!
//! The measurement loops are the same whether the peer is a thread of this process or
//! another process, so the sides synchronise in band, with SEND_WITH_IMM (data messages
//! are plain SENDs, so the immediate tells the two apart):
//!
//! 1. the responder, once its receives are posted, sends [`READY`] on QP 0 (over UC and
//!    UD again every 100 ms until the requester is heard from, as it may be lost);
//! 2. after each size the requester sends `DONE` on every QP, with the number of
//!    requests it issued on that QP in the immediate (modulo 2^32);
//! 3. the responder, having checked its data (`--verify`), answers [`VERDICT_OK`] or
//!    [`VERDICT_BAD`] on QP 0, which also says it is ready for the next size (over UC
//!    and UD, where a control message may be lost, hence sent again and arrive twice,
//!    `DONE` and the verdict carry the size's generation bit: [`verdict_for`]);
//! 4. after the last size the requester sends [`BYE`] and waits for it to be
//!    acknowledged, so neither side closes its QPs while the other still needs them.
//!
//! Every side keeps its receives posted and reposts each one as it completes.

use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use rdmx::{
    Access, Completion, CompletionQueue, Context, LocalSge, Mapping, MemoryRegion, Pinning, QpCaps,
    QueuePair, RecvRequest, SendRequest, WcOpcode, WcStatus,
};
use serde::{Deserialize, Serialize};

use super::args::{Config, Conn, Op, Params};
use super::verify::Expect;

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// On iWARP, the requester's first message on every QP, which the responder waits for
/// before it sends anything (see [`connect_remote`]).
pub(crate) const HELLO: u32 = 0x4845_4c4f;
/// The responder is ready (sent on QP 0; over UC and UD again until the requester is heard).
pub(crate) const READY: u32 = 0x5245_4459;
/// The responder's data checked out.
pub(crate) const VERDICT_OK: u32 = 0x4f4b_4f4b;
/// The responder found wrong data.
pub(crate) const VERDICT_BAD: u32 = 0x4241_4421;
/// The verdict `v` as the responder sends it for size number `k`: over UC and UD
/// (`lossy`) with the size's generation bit in bit 31, so that a verdict of the previous
/// size, sent again for a DONE of it that came late, is not taken for this size's.
pub(crate) fn verdict_for(v: u32, k: usize, lossy: bool) -> u32 {
    match lossy {
        true => v | (k as u32 % 2) << 31,
        false => v,
    }
}

/// The verdict in control message `msg` if it is size number `k`'s ([`verdict_for`]);
/// `None` for the previous size's, and over UC and UD for anything but a verdict (a READY
/// sent again, see `ReadyAgain`).
pub(crate) fn verdict_of(msg: u32, k: usize, lossy: bool) -> Option<u32> {
    match lossy {
        true => Some(msg & 0x7fff_ffff)
            .filter(|v| msg >> 31 == k as u32 % 2 && matches!(*v, VERDICT_OK | VERDICT_BAD)),
        false => Some(msg),
    }
}

/// The requester has the last verdict and is about to close.
pub(crate) const BYE: u32 = 0x4259_4521;
/// wr_id bit of control messages.
pub(crate) const CTL: u64 = 1 << 63;
/// Bytes of a control message's payload on a device without immediate data: [`CTL_MAGIC`]
/// and the value, little-endian.
const CTL_LEN: usize = 8;
const CTL_MAGIC: u32 = 0x5844_4d52; // "RMDX"
/// Receives a send_bw responder keeps posted per QP without --verify (perftest's rx depth).
const RX_DEPTH: usize = 512;
/// Most bytes of slots per QP when --verify stamps every message into its own slot.
const VERIFY_BYTES: usize = 16 << 20;
/// How long a side waits for its peer's next control message.
pub(crate) const STALL: Duration = Duration::from_secs(60);

/// Which end of the test a side is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Role {
    /// Posts the requests and measures (perftest's client).
    Requester,
    /// The target (perftest's server); in ping-pong tests, the side that answers.
    Responder,
}

/// Where things are in each QP's region: `src_slots` slots messages are sent or read
/// from, then `dst_slots` slots messages land in, each `stride` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) stride: usize,
    pub(crate) src_slots: usize,
    pub(crate) dst_slots: usize,
    /// Receives kept posted per QP.
    pub(crate) rx_depth: usize,
    /// Requests outstanding per QP (`-t`, or fewer under --verify: one slot each).
    pub(crate) window: usize,
    /// Requests per post batch (`-l`, at most the window).
    pub(crate) batch: usize,
    /// One request in this many is signaled (`-Q`, at most the window: a window of
    /// unsignaled requests would never complete).
    pub(crate) signal_every: usize,
    /// Whether receives take data (SEND tests) rather than control messages only.
    pub(crate) recv_data: bool,
    /// Bytes before a received message in its slot: the GRH area of UD, else 0.
    pub(crate) grh: usize,
}

impl Layout {
    pub(crate) fn new(p: &Params, role: Role) -> Layout {
        let grh = if p.conn == Conn::Ud { rdmx::GRH_LEN } else { 0 };
        let stride = (p.max_size().max(8) + grh).next_multiple_of(64);
        let slots = if p.verify {
            (VERIFY_BYTES / stride).clamp(1, p.tx_depth)
        } else {
            1
        };
        let window = if p.verify { slots } else { p.tx_depth };
        let op = p.test.op();
        let ping_pong = p.test.is_ping_pong();
        let (src, dst) = match (role, op) {
            _ if ping_pong => (1, 1),
            (Role::Requester, Op::Write | Op::Send) => (slots, 0),
            (Role::Requester, Op::Read | Op::Atomic) => (0, slots),
            (Role::Responder, Op::Read) => (slots, 0),
            (Role::Responder, Op::Atomic) => (0, 1),
            (Role::Responder, Op::Write | Op::Send) => (0, slots),
        };
        let rx_depth = match (role, op) {
            (Role::Responder, Op::Send) if !ping_pong => {
                if p.verify {
                    slots
                } else {
                    RX_DEPTH
                }
            }
            _ => 1,
        };
        Layout {
            stride,
            src_slots: src,
            dst_slots: dst,
            rx_depth,
            window,
            batch: p.post_list.min(window),
            signal_every: p.cq_mod.min(window),
            recv_data: op == Op::Send,
            grh,
        }
    }

    pub(crate) fn src(&self, slot: usize) -> usize {
        (slot % self.src_slots.max(1)) * self.stride
    }

    /// Where the message of destination slot `slot` starts (after the GRH area on UD).
    pub(crate) fn dst(&self, slot: usize) -> usize {
        self.dst_slot(slot) + self.grh
    }

    /// Where destination slot `slot` starts: what a receive names.
    fn dst_slot(&self, slot: usize) -> usize {
        (self.src_slots + slot % self.dst_slots.max(1)) * self.stride
    }

    /// UD: the GRH area of receives that land no message (control messages), after the
    /// slots.
    fn scratch(&self) -> usize {
        (self.src_slots + self.dst_slots).max(1) * self.stride
    }

    /// Where control messages land that no destination slot receives (devices without
    /// immediate data carry them in the payload): after the scratch area.
    pub(crate) fn ctl(&self) -> usize {
        self.scratch() + self.grh
    }

    fn len(&self) -> usize {
        self.ctl() + CTL_LEN
    }
}

/// One side: a context, one CQ for everything, `-q` QPs, a region per QP.
pub(crate) struct Side {
    pub(crate) ctx: Context,
    pub(crate) cq: CompletionQueue,
    pub(crate) qps: Vec<QueuePair>,
    pub(crate) mrs: Vec<MemoryRegion>,
    pub(crate) layout: Layout,
    pub(crate) role: Role,
    pub(crate) busy: bool,
    /// Whether its regions' pages are locked (see [`Side::open`]).
    pub(crate) pinned: bool,
    /// Whether its regions are memfd-backed, for peers to map (shm's mapped data path).
    pub(crate) shared_memory: bool,
    /// Whether the device has immediate data; without it (iWARP) control messages carry
    /// their value in the payload.
    pub(crate) imm: bool,
    /// Messages of up to this many bytes are sent inline (-I, or perftest's default).
    pub(crate) inline_size: usize,
    /// UD: per QP, the address handle of the peer QP and its number, once connected.
    pub(crate) ud_peers: std::sync::OnceLock<Vec<(rdmx::AddressHandle, u32)>>,
}

/// The Q_Key of the bench's UD queue pairs.
pub(crate) const UD_QKEY: u32 = 0x1111_1111;

/// Opens `provider` with the options the command line gives: `-d`, `--gid-index` and
/// the progress mode.
pub(crate) fn open_context(provider: &str, cfg: &Config, busy: bool) -> Result<Context, BoxError> {
    if cfg.gid_index.is_some() && provider != "verbs" {
        return Err("--gid-index is a verbs option".into());
    }
    Ok(match provider {
        rdmx::tcp::NAME => {
            if let Some(dev) = cfg.device.as_deref().filter(|&d| d != "tcp0") {
                return Err(format!("provider tcp has no device {dev}; its device is tcp0").into());
            }
            Context::open(rdmx::tcp::Options::default().busy_poll(busy))?
        }
        "verbs" => {
            let mut opts = rdmx::verbs::Options::default();
            opts.device = cfg.device.clone();
            opts.gid_index = cfg.gid_index;
            Context::open(opts)?
        }
        other => Context::open_device(other, cfg.device.as_deref())?,
    })
}

impl Side {
    /// Whether this side's polls are what moves its data: busy-polled software providers.
    /// An adapter (verbs) moves data without being polled, and progress threads do the
    /// rest.
    pub(crate) fn polls_move_data(&self) -> bool {
        self.busy && self.ctx.provider() != "verbs"
    }

    /// Opens `provider` (on the device and GID `cfg` asks for) and creates what the run
    /// needs for `role`, registering its regions with `pinning` (the verbs provider's
    /// memory is pinned by the kernel either way).
    pub(crate) fn open(
        provider: &str,
        cfg: &Config,
        role: Role,
        busy: bool,
        pinning: Pinning,
    ) -> Result<Side, BoxError> {
        let p = &cfg.params;
        let ctx = open_context(provider, cfg, busy)?;
        let layout = Layout::new(p, role);
        let pd = ctx.alloc_pd();
        let per_qp = layout.window + layout.rx_depth + 8;
        let cq = ctx.create_cq(p.qps * per_qp + 16)?;
        // Inline data up to what the device takes (soft-iWARP: below the default).
        let device_inline = ctx.capabilities().max_inline_data as usize;
        let inline = QpCaps::default().max_inline_data.min(device_inline);
        let inline_size = p.inline_size(device_inline)?;
        let caps = QpCaps::default()
            .max_send_wr(layout.window + 4)
            .max_recv_wr(layout.rx_depth + 1)
            .max_inline_data(inline.max(inline_size));
        let qp_type = p.conn.qp_type();
        if !ctx.capabilities().supports(qp_type) {
            return Err(format!(
                "provider {} has no {qp_type} queue pairs (see its capabilities in `rdmx \
                 devices`)",
                ctx.provider()
            )
            .into());
        }
        if qp_type == rdmx::QpType::Ud {
            let most = ctx.capabilities().max_ud_message();
            if p.max_size() > most {
                return Err(format!(
                    "-c UD: messages are at most the path MTU, {most} bytes on {}",
                    ctx.provider()
                )
                .into());
            }
        }
        // On shm's mapped data path the peer maps memfd-backed memory; plain memory
        // would take the rings.
        let shared_memory = rdmx::shm::maps_memory(&ctx) == Some(true);
        let mut qps = Vec::with_capacity(p.qps);
        let mut mrs = Vec::with_capacity(p.qps);
        for _ in 0..p.qps {
            qps.push(
                pd.create_qp_of_type(qp_type, &cq, &cq, None, caps)
                    .map_err(|e| {
                        format!(
                            "create a QP with {} send and {} receive requests: {e}",
                            caps.max_send_wr, caps.max_recv_wr
                        )
                    })?,
            );
            let map = if shared_memory {
                Mapping::shared(layout.len())?
            } else {
                Mapping::new(layout.len())?
            };
            mrs.push(pd.register_with(map, Access::ALL, pinning)?);
        }
        Ok(Side {
            imm: ctx.capabilities().imm_data,
            ctx,
            cq,
            qps,
            mrs,
            layout,
            role,
            busy,
            pinned: pinning == Pinning::Pinned,
            shared_memory,
            inline_size,
            ud_peers: std::sync::OnceLock::new(),
        })
    }

    /// `req` on QP `i`, addressed to the peer QP when the queue pairs are UD.
    #[inline(always)]
    pub(crate) fn route<'a>(&'a self, i: usize, req: SendRequest<'a>) -> SendRequest<'a> {
        match self.ud_peers.get().and_then(|v| v.get(i)) {
            Some((ah, qpn)) => req.ud(ah, *qpn, UD_QKEY),
            None => req,
        }
    }

    /// The index of the QP numbered `qp_num`.
    pub(crate) fn qp_index(&self, qp_num: u32) -> usize {
        self.qps
            .iter()
            .position(|q| q.qp_num() == qp_num)
            .unwrap_or(0)
    }

    /// Fills every source slot with the pattern of `size`-byte messages (slot `j`
    /// stamped `j` when `stamp_slots`).
    pub(crate) fn fill_sources(&self, size: usize, stamp_slots: bool) -> Result<(), BoxError> {
        for mr in &self.mrs {
            for j in 0..self.layout.src_slots {
                let mut e = Expect::pattern(size, size);
                if stamp_slots {
                    e = e.stamped(j as u64);
                }
                mr.write_at(self.layout.src(j), &e.bytes())?;
            }
        }
        Ok(())
    }

    /// Posts receive `r` (slot `r` of the destination area, or no element where nothing
    /// lands) on QP `i`.
    pub(crate) fn post_recv(&self, i: usize, r: u64) -> Result<(), BoxError> {
        let mut req = RecvRequest::new(r);
        let l = &self.layout;
        let data_slot = l.recv_data && l.dst_slots > 0;
        if !self.imm && !data_slot {
            // Control messages only, in their payload: into the control area (never a
            // slot a WRITE lands in).
            req = req.sge(LocalSge::new(&self.mrs[i], l.ctl(), CTL_LEN)?);
        } else if l.dst_slots > 0 {
            req = req.sge(LocalSge::new(
                &self.mrs[i],
                l.dst_slot(r as usize),
                l.stride,
            )?);
        } else if l.grh > 0 {
            // A control message still brings its GRH.
            req = req.sge(LocalSge::new(&self.mrs[i], l.scratch(), l.grh)?);
        }
        self.qps[i].post_recv(req)?;
        Ok(())
    }

    /// Posts the side's receives: `rx_depth` on every QP (the requester: one on QP 0).
    pub(crate) fn post_receives(&self) -> Result<(), BoxError> {
        for i in 0..self.qps.len() {
            self.post_receives_on(i)?;
        }
        Ok(())
    }

    /// Posts QP `i`'s share of [`post_receives`](Self::post_receives).
    pub(crate) fn post_receives_on(&self, i: usize) -> Result<(), BoxError> {
        if self.role == Role::Requester && i > 0 {
            return Ok(());
        }
        for r in 0..self.layout.rx_depth as u64 {
            self.post_recv(i, r)?;
        }
        Ok(())
    }

    /// Sends a control message with immediate `imm` on QP `i`.
    pub(crate) fn send_ctl(&self, i: usize, imm: u32) -> Result<(), BoxError> {
        let wr_id = CTL | u64::from(imm);
        if self.imm {
            self.qps[i].post_send(self.route(i, SendRequest::send_with_imm(wr_id, imm)))?;
        } else {
            let mut msg = [0u8; CTL_LEN];
            msg[..4].copy_from_slice(&CTL_MAGIC.to_le_bytes());
            msg[4..].copy_from_slice(&imm.to_le_bytes());
            self.qps[i].post_send(self.route(i, SendRequest::send(wr_id).inline(&msg)))?;
        }
        Ok(())
    }

    /// The value of control message `c` (a receive completion), or `None` for a data
    /// message: the immediate data, or on a device without it the payload's.
    pub(crate) fn ctl_value(&self, c: &Completion) -> Result<Option<u32>, BoxError> {
        if self.imm || c.imm_data.is_some() {
            return Ok(c.imm_data);
        }
        if c.status != WcStatus::Success || c.byte_len as usize != CTL_LEN {
            return Ok(None);
        }
        let l = &self.layout;
        let at = match l.recv_data && l.dst_slots > 0 {
            false => l.ctl(),
            true => l.dst(c.wr_id as usize),
        };
        let mut msg = [0u8; CTL_LEN];
        self.mrs[self.qp_index(c.qp_num)].read_at(at, &mut msg)?;
        let word = |k: usize| u32::from_le_bytes(msg[k..k + 4].try_into().expect("4 bytes"));
        Ok((word(0) == CTL_MAGIC).then(|| word(4)))
    }
}

/// Whether `e` is registration running into `RLIMIT_MEMLOCK`.
pub(crate) fn is_memlock_limit(e: &(dyn std::error::Error + 'static)) -> bool {
    matches!(
        e.downcast_ref::<rdmx::Error>(),
        Some(rdmx::Error::Register(rdmx_mem::Error::MemlockLimit(_)))
    )
}

/// Checks every completion's status.
pub(crate) fn poll(cq: &CompletionQueue, out: &mut [Completion]) -> Result<usize, BoxError> {
    let n = cq.poll(out)?;
    for c in &out[..n] {
        if c.status != WcStatus::Success {
            let what = if c.wr_id & CTL != 0 {
                "a control message".to_string()
            } else {
                format!("work request {}", c.wr_id)
            };
            return Err(format!(
                "{what} on QP {:#x} completed with {:?} ({:?})",
                c.qp_num, c.status, c.opcode
            )
            .into());
        }
    }
    Ok(n)
}

/// An empty completion for poll buffers.
pub(crate) const EMPTY: Completion = Completion {
    wr_id: 0,
    status: WcStatus::Success,
    opcode: WcOpcode::Send,
    byte_len: 0,
    imm_data: None,
    qp_num: 0,
    src_qp: 0,
    grh: false,
};

/// Which side of a run in one process failed first; the other side's loops give up once
/// one has.
#[derive(Debug, Default)]
pub(crate) struct Abort(AtomicU8);

impl Abort {
    /// Marks `role` as failed, unless a side already has.
    pub(crate) fn fail(&self, role: Role) {
        let code = match role {
            Role::Requester => 1,
            Role::Responder => 2,
        };
        let _ = self
            .0
            .compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire);
    }

    /// The side that failed first.
    pub(crate) fn first(&self) -> Option<Role> {
        match self.0.load(Ordering::Acquire) {
            1 => Some(Role::Requester),
            2 => Some(Role::Responder),
            _ => None,
        }
    }

    /// Fails once a side has failed.
    pub(crate) fn check(&self) -> Result<(), BoxError> {
        match self.first() {
            None => Ok(()),
            Some(_) => Err("the other side of the run failed".into()),
        }
    }
}

/// Requester: waits for the control message `want` (READY or a verdict) on QP 0,
/// reposting the receive it used and reaping anything else.
pub(crate) fn wait_ctl(side: &Side, abort: &Abort, what: &str) -> Result<u32, BoxError> {
    let mut wc = [EMPTY; 16];
    let since = Instant::now();
    loop {
        let n = poll(&side.cq, &mut wc)?;
        let mut got = None;
        for c in &wc[..n] {
            if matches!(c.opcode, WcOpcode::Recv) {
                if let Some(imm) = side.ctl_value(c)? {
                    got = Some(imm);
                }
                side.post_recv(0, c.wr_id)?;
            }
        }
        if let Some(imm) = got {
            return Ok(imm);
        }
        if n == 0 {
            abort.check()?;
            if since.elapsed() > STALL {
                return Err(format!("the peer sent no {what} within {STALL:?}").into());
            }
            std::hint::spin_loop();
        }
    }
}

/// Requester, after size number `k`: DONE with `counts[i]` on every QP, then the
/// verdict. Over UC and UD (`lossy`), where DONE or the verdict may be lost, DONE carries the
/// size's generation bit and goes again until the verdict comes.
pub(crate) fn finish_size(
    side: &Side,
    counts: &[u64],
    k: usize,
    lossy: bool,
    abort: &Abort,
) -> Result<(), BoxError> {
    let verdict = if lossy {
        let gen = (k as u32 % 2) << 31;
        let since = Instant::now();
        loop {
            for (i, &n) in counts.iter().enumerate() {
                side.send_ctl(i, (n as u32 & 0x7fff_ffff) | gen)?;
            }
            // (The previous size's verdict, sent again for its DONE that came late, is
            // not this size's.)
            let got = wait_ctl_for(side, abort, Duration::from_millis(100))?;
            if let Some(v) = got.and_then(|m| verdict_of(m, k, lossy)) {
                break v;
            }
            if since.elapsed() > STALL {
                return Err(format!("the peer sent no verdict within {STALL:?}").into());
            }
        }
    } else {
        for (i, &n) in counts.iter().enumerate() {
            side.send_ctl(i, n as u32)?;
        }
        wait_ctl(side, abort, "verdict")?
    };
    match verdict {
        VERDICT_OK => Ok(()),
        VERDICT_BAD => {
            Err("--verify: the receiving side found wrong data (its error says where)".into())
        }
        other => Err(format!("unexpected control message {other:#x} from the peer").into()),
    }
}

/// [`wait_ctl`] for at most `timeout`: `None` if no control message came.
fn wait_ctl_for(side: &Side, abort: &Abort, timeout: Duration) -> Result<Option<u32>, BoxError> {
    let mut wc = [EMPTY; 16];
    let since = Instant::now();
    while since.elapsed() < timeout {
        let n = poll(&side.cq, &mut wc)?;
        let mut got = None;
        for c in &wc[..n] {
            if matches!(c.opcode, WcOpcode::Recv) {
                side.post_recv(0, c.wr_id)?;
                if let Some(imm) = c.imm_data {
                    got = Some(imm);
                }
            }
        }
        if got.is_some() {
            return Ok(got);
        }
        if n == 0 {
            abort.check()?;
            std::thread::yield_now();
        }
    }
    Ok(None)
}

/// Requester, at the end: BYE, acknowledged (or not: the run is over either way). Over UC
/// and UD (`lossy`), where BYE or the peer's BYE in return may be lost, BYE goes again
/// until the answer comes, for [`BYE_FOR`] at most.
pub(crate) fn say_bye(side: &Side, lossy: bool) -> Result<(), BoxError> {
    let answer = |c: &Completion| {
        c.opcode == WcOpcode::Recv && side.ctl_value(c).ok().flatten() == Some(BYE)
    };
    if lossy {
        let since = Instant::now();
        loop {
            side.send_ctl(0, BYE)?;
            if linger(side, Duration::from_millis(100), answer) || since.elapsed() > BYE_FOR {
                return Ok(());
            }
        }
    }
    side.send_ctl(0, BYE)?;
    if side.ctx.capabilities().remote_error_completions {
        linger(side, Duration::from_secs(1), |c| {
            c.wr_id == CTL | u64::from(BYE)
        });
    } else {
        // A SEND that completed was only handed to the transport (iWARP), and closing
        // now could take BYE with it: wait for the peer's BYE in return.
        linger(side, Duration::from_secs(5), answer);
    }
    Ok(())
}

/// How long a requester over UC or UD sends BYE again while no answer comes.
const BYE_FOR: Duration = Duration::from_secs(2);

/// Polls `side`'s CQ for up to `timeout` or until `until` picks a completion, ignoring
/// error statuses: for the end of a run, when the peer may close at any moment. Returns
/// whether `until` picked one.
pub(crate) fn linger(side: &Side, timeout: Duration, until: impl Fn(&Completion) -> bool) -> bool {
    let mut wc = [EMPTY; 16];
    let since = Instant::now();
    while since.elapsed() < timeout {
        match side.cq.poll(&mut wc) {
            Ok(n) if wc[..n].iter().any(&until) => return true,
            Ok(_) => std::thread::sleep(Duration::from_micros(20)),
            Err(_) => return false,
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::args::{Budget, Test};

    fn params(test: Test, verify: bool) -> Params {
        Params {
            test,
            sizes: vec![65536],
            budget: Budget::Iters(10),
            qps: 1,
            tx_depth: 128,
            cq_mod: 100,
            post_list: 1,
            verify,
            mtu: None,
            qp_timeout: None,
            warm_up: false,
            inline_size: None,
            rdma_cm: false,
            conn: Conn::Rc,
        }
    }

    #[test]
    fn layouts() {
        let l = Layout::new(&params(Test::WriteBw, false), Role::Requester);
        assert_eq!((l.src_slots, l.dst_slots, l.window), (1, 0, 128));
        let l = Layout::new(&params(Test::WriteBw, true), Role::Responder);
        assert_eq!((l.src_slots, l.dst_slots, l.window), (0, 128, 128));
        let l = Layout::new(&params(Test::SendBw, false), Role::Responder);
        assert_eq!((l.dst_slots, l.rx_depth), (1, RX_DEPTH));
        let mut p = params(Test::SendBw, true);
        p.sizes = vec![8 << 20];
        let l = Layout::new(&p, Role::Responder);
        assert_eq!((l.dst_slots, l.rx_depth, l.window), (2, 2, 2));
        assert_eq!(l.dst(3), l.stride, "slot 3 of 2 is slot 1");
        // Fewer slots than -Q or -l: every window still ends with a signaled request.
        p.test = Test::WriteBw;
        p.post_list = 8;
        p.cq_mod = 8;
        let l = Layout::new(&p, Role::Requester);
        assert_eq!((l.window, l.batch, l.signal_every), (2, 2, 2));
    }

    #[test]
    fn a_verdict_sent_again_for_the_previous_size_is_not_taken_for_this_one_s() {
        for lossy in [false, true] {
            for v in [VERDICT_OK, VERDICT_BAD] {
                for k in 0..4 {
                    assert_eq!(verdict_of(verdict_for(v, k, lossy), k, lossy), Some(v));
                }
            }
        }
        // Over UC and UD: size 1's OK, sent again late, while size 2 waits for its
        // verdict (which may be BAD).
        let stale = verdict_for(VERDICT_OK, 1, true);
        assert_eq!(verdict_of(stale, 2, true), None);
        assert_eq!(verdict_of(stale, 1, true), Some(VERDICT_OK));
        // A READY sent again, late, is no verdict of any size.
        for k in 0..2 {
            assert_eq!(verdict_of(READY, k, true), None);
        }
    }
}
