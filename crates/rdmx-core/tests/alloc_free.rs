//! Posting and completing allocate nothing once a queue pair has warmed up.
//!
//! A counting global allocator counts this thread's allocations while two engines run
//! SEND, inline SEND, WRITE, WRITE with immediate, READ and both atomics, with the
//! receives they consume posted to the queue pair or to a shared receive queue, through
//! the two ways a transport moves packets:
//!
//! - whole packets ([`RcQp::poll_transmit_into`] and [`RcQp::handle_packet`] on buffers
//!   that are reused), as a datagram transport or the in-memory loopback does;
//! - headers and payload apart ([`RcQp::poll_transmit_parts`], [`RcQp::handle_header`]
//!   and the placements it returns), as the stream transport does.
//!
//! After a warm-up, in which the engines' queues and spare room grow to what the workload
//! needs, a thousand more rounds must not allocate once.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Instant;

use rdmx_core::rc::{CqSide, MemAccess, Placement, QpConfig, RcQp, Srq, Transmit};
use rdmx_core::{
    Access, ConnectParams, KeyError, KeyUse, MrTable, Mtu, PdId, QpLimits, RecvWr, RemoteAddr,
    SendFlags, SendOp, SendWr, Sge, WcStatus,
};

/// Counts the allocations (and reallocations) made by each thread.
struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    // `try_with`: a thread being torn down has no counter left, and needs none.
    let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
}

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

// SAFETY: every method forwards to the system allocator with the caller's arguments, so
// it upholds GlobalAlloc's contract exactly as System does; counting touches only a
// const-initialised thread-local Cell, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's layout, as GlobalAlloc::alloc requires.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: as for alloc.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: `ptr` was allocated by this allocator (that is, by System) with
        // `layout`, as the caller guarantees.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by System with `layout`, as the caller guarantees.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const PD: PdId = PdId(1);
const BASE: u64 = 0x10_0000;
const ARENA: usize = 64 * 1024;
const ALL: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_ATOMIC);

/// A region's handle: holding it keeps the region "alive", which the test checks the
/// engine lets go of.
type Handle = Rc<u32>;

/// One side's registered memory: a fixed arena and a key table, both made before the
/// measured phase, so reaching memory allocates nothing.
struct Mem {
    table: MrTable<Handle>,
    bytes: RefCell<Box<[u8]>>,
    next: Cell<usize>,
    handles: RefCell<Vec<Handle>>,
}

#[derive(Clone, Copy)]
struct Region {
    addr: u64,
    lkey: u32,
    rkey: u32,
}

impl Mem {
    fn new(seed: u64) -> Self {
        Mem {
            table: MrTable::new(seed),
            bytes: RefCell::new(vec![0; ARENA].into_boxed_slice()),
            next: Cell::new(0),
            handles: RefCell::new(Vec::new()),
        }
    }

    fn register(&mut self, len: usize, access: Access) -> Region {
        let at = self.next.get().next_multiple_of(8);
        self.next.set(at + len);
        assert!(at + len <= ARENA);
        let handle = Rc::new(at as u32);
        self.handles.borrow_mut().push(handle.clone());
        let e = self
            .table
            .insert(PD, BASE + at as u64, len as u64, access, handle)
            .unwrap();
        Region {
            addr: e.addr,
            lkey: e.lkey,
            rkey: e.rkey,
        }
    }

    fn u64_at(&self, addr: u64) -> u64 {
        let at = (addr - BASE) as usize;
        u64::from_ne_bytes(self.bytes.borrow()[at..at + 8].try_into().unwrap())
    }

    /// Whether anything besides the table and this test holds a region's handle.
    fn handles_held_elsewhere(&self) -> usize {
        self.handles
            .borrow()
            .iter()
            .filter(|h| Rc::strong_count(h) > 2)
            .count()
    }
}

impl MemAccess for Mem {
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
        self.table
            .check(key, key_use, pd, addr, len, need)
            .map(|e| e.payload.clone())
    }

    fn read(&self, _: &Handle, addr: u64, out: &mut [u8]) {
        let at = (addr - BASE) as usize;
        out.copy_from_slice(&self.bytes.borrow()[at..at + out.len()]);
    }

    fn write(&self, _: &Handle, addr: u64, data: &[u8]) {
        let at = (addr - BASE) as usize;
        self.bytes.borrow_mut()[at..at + data.len()].copy_from_slice(data);
    }

    fn compare_swap(&self, mr: &Handle, addr: u64, compare: u64, swap: u64) -> u64 {
        let old = self.u64_at(addr);
        if old == compare {
            self.write(mr, addr, &swap.to_ne_bytes());
        }
        old
    }

    fn fetch_add(&self, mr: &Handle, addr: u64, add: u64) -> u64 {
        let old = self.u64_at(addr);
        self.write(mr, addr, &old.wrapping_add(add).to_ne_bytes());
        old
    }
}

struct Side {
    qp: RcQp<Mem>,
    /// The shared receive queue the QP takes its receives from, if it uses one.
    srq: Option<Srq<Handle>>,
    mem: Mem,
    /// Successful completions reaped, per CQ.
    sent: u64,
    received: u64,
}

impl Side {
    fn new(qpn: u32, seed: u64, srq: bool) -> Self {
        let mut cfg = QpConfig::new(qpn, PD);
        cfg.srq = srq;
        Side {
            qp: RcQp::new(cfg, QpLimits::default()),
            srq: srq.then(|| Srq::new(PD, 64, 4)),
            mem: Mem::new(seed),
            sent: 0,
            received: 0,
        }
    }

    fn connect(&mut self, dest_qpn: u32, sq_psn: u32, rq_psn: u32) {
        let params = ConnectParams {
            access: ALL,
            mtu: Mtu::Mtu256,
            dest_qpn,
            rq_psn,
            sq_psn,
            max_rd_atomic: 4,
            max_dest_rd_atomic: 4,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
        };
        for (attr, mask) in params.steps() {
            self.qp.modify(&attr, mask).unwrap();
        }
    }

    /// Reaps completions; every one must be a success.
    fn reap(&mut self) -> bool {
        let mut any = false;
        while let Some((side, c, _)) = self.qp.poll_completion() {
            assert_eq!(c.status, WcStatus::Success, "wr {}", c.wr_id);
            match side {
                CqSide::Send => self.sent += 1,
                CqSide::Recv => self.received += 1,
            }
            any = true;
        }
        any
    }
}

/// How packets travel between the two engines.
#[derive(Clone, Copy, Debug)]
enum Path {
    /// Whole packets, as a datagram transport or the loopback provider moves them.
    Packets,
    /// Headers first, then the payload placed where the engine says, as a stream
    /// transport moves them.
    Parts,
}

/// The transport's buffers, made once and reused for every packet.
struct Link {
    packet: Vec<u8>,
    parts: Transmit<Handle>,
    place: Vec<Placement<Handle>>,
}

impl Link {
    fn new() -> Self {
        Link {
            packet: Vec::new(),
            parts: Transmit::default(),
            place: Vec::new(),
        }
    }

    /// Moves every packet `from` has to `to`; returns whether there was any.
    fn carry(&mut self, path: Path, now: Instant, from: &mut Side, to: &mut Side) -> bool {
        let mut any = false;
        match path {
            Path::Packets => {
                while from.qp.poll_transmit_into(now, &from.mem, &mut self.packet) {
                    to.qp
                        .handle_packet_srq(now, &to.mem, to.srq.as_mut(), &self.packet);
                    any = true;
                }
            }
            Path::Parts => {
                while from.qp.poll_transmit_parts(now, &mut self.parts) {
                    // What a stream carries: headers (with any inline payload), the
                    // gathered payload, the pad.
                    let t = &self.parts;
                    self.packet.clear();
                    self.packet.extend_from_slice(&t.header);
                    for s in &t.gather {
                        let at = self.packet.len();
                        self.packet.resize(at + s.len as usize, 0);
                        from.mem.read(&s.mr, s.addr, &mut self.packet[at..]);
                    }
                    self.packet
                        .resize(self.packet.len() + usize::from(t.pad), 0);
                    // What the receiving side does: headers to the engine, then the
                    // payload straight to where it says.
                    let op = rdmx_wire::Opcode::try_from(self.packet[0]).unwrap();
                    let (header, rest) = self.packet.split_at(op.header_len());
                    to.qp
                        .handle_header(
                            now,
                            &to.mem,
                            to.srq.as_mut(),
                            header,
                            rest.len(),
                            &mut self.place,
                        )
                        .expect("the engine's own headers parse");
                    for p in self.place.drain(..) {
                        let at = p.offset as usize;
                        to.mem.write(&p.mr, p.addr, &rest[at..at + p.len as usize]);
                    }
                    any = true;
                }
            }
        }
        any
    }
}

/// Two connected engines, their registered memory and the requests they post.
struct Bench {
    a: Side,
    b: Side,
    link: Link,
    now: Instant,
    sends: Vec<(SendWr, Option<&'static [u8]>)>,
    recv: RecvWr,
    counter: Region,
}

static INLINE: [u8; 64] = [0x5a; 64];

impl Bench {
    /// Two engines; B takes its receives from a shared receive queue with `srq`.
    fn new(srq: bool) -> Self {
        let mut a = Side::new(0x11, 1, false);
        let mut b = Side::new(0x12, 2, srq);
        a.connect(0x12, 100, 900);
        b.connect(0x11, 900, 100);
        let src = a.mem.register(4096, Access::LOCAL_WRITE);
        let dst = b.mem.register(4096, ALL);
        let sink = b.mem.register(4096, Access::LOCAL_WRITE);
        let counter = b.mem.register(8, ALL);
        let sge = |r: Region, off: u64, len: u32| Sge {
            addr: r.addr + off,
            len,
            lkey: r.lkey,
        };
        let remote = |r: Region, off: u64| RemoteAddr {
            addr: r.addr + off,
            rkey: r.rkey,
        };
        let wr = |wr_id: u64, op: SendOp, sges: Vec<Sge>| SendWr {
            wr_id,
            op,
            sges: sges.as_slice().try_into().unwrap(),
            flags: SendFlags::SIGNALED,
            ud: None,
        };
        let sends = vec![
            // Three packets at a 256-byte MTU, gathered from two SGEs.
            (
                wr(1, SendOp::Send, vec![sge(src, 0, 300), sge(src, 512, 400)]),
                None,
            ),
            (
                SendWr {
                    flags: SendFlags::SIGNALED | SendFlags::INLINE,
                    ud: None,
                    ..wr(2, SendOp::Send, vec![])
                },
                Some(&INLINE[..]),
            ),
            (
                wr(3, SendOp::Write(remote(dst, 0)), vec![sge(src, 0, 700)]),
                None,
            ),
            (
                wr(
                    4,
                    SendOp::WriteWithImm(remote(dst, 1024), 0xfeed),
                    vec![sge(src, 0, 100)],
                ),
                None,
            ),
            (
                wr(5, SendOp::Read(remote(dst, 0)), vec![sge(src, 1024, 700)]),
                None,
            ),
            (
                wr(
                    6,
                    SendOp::FetchAdd {
                        remote: remote(counter, 0),
                        add: 1,
                    },
                    vec![sge(src, 2048, 8)],
                ),
                None,
            ),
            (
                wr(
                    7,
                    SendOp::CompareSwap {
                        remote: remote(counter, 0),
                        compare: u64::MAX,
                        swap: 0,
                    },
                    vec![sge(src, 2056, 8)],
                ),
                None,
            ),
        ];
        let recv = RecvWr {
            wr_id: 100,
            sges: [sge(sink, 0, 1024), sge(sink, 1024, 1024)]
                .try_into()
                .unwrap(),
        };
        Bench {
            a,
            b,
            link: Link::new(),
            now: Instant::now(),
            sends,
            recv,
            counter,
        }
    }

    /// One round: B posts the receives the round consumes, A posts every request, the
    /// packets flow until both sides are quiet, and every request completes.
    fn round(&mut self, path: Path) {
        let (sent, received) = (self.a.sent, self.b.received);
        // SEND, inline SEND and WRITE with immediate each consume a receive.
        for _ in 0..3 {
            match &mut self.b.srq {
                Some(srq) => srq.post_recv_ref(&self.b.mem, &self.recv).unwrap(),
                None => self.b.qp.post_recv_ref(&self.b.mem, &self.recv).unwrap(),
            }
        }
        for (wr, inline) in &self.sends {
            self.a.qp.post_send_ref(&self.a.mem, wr, *inline).unwrap();
        }
        loop {
            let mut moved = self.link.carry(path, self.now, &mut self.a, &mut self.b);
            moved |= self.link.carry(path, self.now, &mut self.b, &mut self.a);
            moved |= self.a.reap();
            moved |= self.b.reap();
            if !moved {
                break;
            }
        }
        assert_eq!(self.a.sent - sent, self.sends.len() as u64);
        assert_eq!(self.b.received - received, 3);
        assert_eq!(self.a.qp.outstanding(), (0, 0));
        assert_eq!(self.b.qp.outstanding(), (0, 0));
    }
}

fn steady_state_allocates_nothing(path: Path, srq: bool) {
    const WARM_UP: u64 = 16;
    const ROUNDS: u64 = 1000;
    let mut bench = Bench::new(srq);
    for _ in 0..WARM_UP {
        bench.round(path);
    }
    let before = allocations();
    for _ in 0..ROUNDS {
        bench.round(path);
    }
    let allocated = allocations() - before;
    assert_eq!(
        allocated, 0,
        "{path:?} (SRQ: {srq}): {allocated} allocations in {ROUNDS} warm rounds"
    );
    // The work was done: every FETCH_ADD counted once, and the CMP_SWAP never matched.
    assert_eq!(
        bench.b.mem.u64_at(bench.counter.addr),
        WARM_UP + ROUNDS,
        "{path:?}"
    );
    // The room the engines keep for the next requests holds no region.
    assert_eq!(bench.a.mem.handles_held_elsewhere(), 0, "{path:?}");
    assert_eq!(bench.b.mem.handles_held_elsewhere(), 0, "{path:?}");
}

#[test]
fn whole_packets_allocate_nothing_once_warm() {
    steady_state_allocates_nothing(Path::Packets, false);
}

#[test]
fn headers_and_placed_payloads_allocate_nothing_once_warm() {
    steady_state_allocates_nothing(Path::Parts, false);
}

#[test]
fn receives_from_a_shared_queue_allocate_nothing_once_warm() {
    steady_state_allocates_nothing(Path::Packets, true);
    steady_state_allocates_nothing(Path::Parts, true);
}

#[test]
fn the_counter_sees_allocations() {
    // The measurement would pass vacuously if the allocator did not count.
    let before = allocations();
    let v = std::hint::black_box(vec![1u8; 16]);
    assert!(allocations() > before);
    drop(v);
}
