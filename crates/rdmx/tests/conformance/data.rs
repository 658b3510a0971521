//! Data movement: every opcode at every size and with several SGEs, inline data,
//! ordering, fences and immediate data.

use rdmx::{MemoryRegion, RecvRequest, SendFlags, SendOp, SendRequest, WcOpcode, WcStatus};

use super::{
    assert_bytes, assert_drained, big_memory, check_ok, fill, image, lacks, pattern, raddr,
    register, register_page, sge, u64_at, wait_n, wait_one, Pair, Provider, ALL, LOCAL,
};

// ---- every opcode, every size ----------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Xfer {
    Send,
    SendWithImm,
    Write,
    WriteWithImm,
    Read,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// One element (none for a 0-byte message).
    OneSge,
    /// Three elements of uneven sizes, in two regions, with gaps between them.
    ThreeSges,
}

/// A piece of a side's memory: (region index, offset, length).
type Seg = (usize, usize, usize);

/// Offset of the contiguous remote range that WRITEs land in and READs come from.
const REMOTE_OFF: usize = 13;

/// 0, 1, MTU-1, MTU, MTU+1, a few packets, and 1 MiB.
fn sizes(p: &Provider) -> Vec<usize> {
    let m = p.mtu_bytes();
    let mut v = vec![0, 1, m - 1, m, m + 1, 3 * m + 7, 1 << 20];
    v.sort_unstable();
    v.dedup();
    v
}

/// Two regions per side: region 0 holds any single element, region 1 part of a split.
struct Buffers {
    mrs: [MemoryRegion; 2],
}

impl Buffers {
    fn new(pd: &rdmx::ProtectionDomain, max: usize) -> Buffers {
        Buffers {
            mrs: [
                register(pd, max + 8192, ALL),
                register(pd, max / 2 + 8192, ALL),
            ],
        }
    }
    fn fill(&self, seed: u64) -> [Vec<u8>; 2] {
        [fill(&self.mrs[0], seed), fill(&self.mrs[1], seed ^ 0x5555)]
    }
    fn images(&self) -> [Vec<u8>; 2] {
        [image(&self.mrs[0]), image(&self.mrs[1])]
    }
    fn sge(&self, s: Seg) -> rdmx::LocalSge {
        sge(&self.mrs[s.0], s.1, s.2)
    }
}

fn split(len: usize, d1: usize, d2: usize) -> [usize; 3] {
    let l1 = (len / d1).max(1);
    let l2 = (len / d2).max(1);
    [l1, l2, len - l1 - l2]
}

/// The requester's elements: gathered from by SEND and WRITE, scattered into by READ.
fn local_segs(len: usize, layout: Layout) -> Vec<Seg> {
    match layout {
        Layout::OneSge if len == 0 => vec![],
        Layout::OneSge => vec![(0, 7, len)],
        Layout::ThreeSges => {
            let [l1, l2, l3] = split(len, 4, 3);
            vec![(0, 5, l1), (0, 5 + l1 + 31, l2), (1, 3, l3)]
        }
    }
}

/// The responder's receive elements for a SEND of `len` bytes, and the part of them a
/// shorter message leaves undefined.
fn recv_segs(len: usize, layout: Layout) -> (Vec<Seg>, Option<Seg>) {
    match layout {
        // A receive 64 bytes longer than the message.
        Layout::OneSge => (
            vec![(0, REMOTE_OFF, len + 64)],
            Some((0, REMOTE_OFF + len, 64)),
        ),
        // Split differently from the sender's elements, so boundaries do not line up.
        Layout::ThreeSges => {
            let [l1, l2, l3] = split(len, 2, 5);
            (vec![(1, 9, l1), (0, 11, l2), (0, 11 + l2 + 17, l3)], None)
        }
    }
}

fn gather(images: &[Vec<u8>; 2], segs: &[Seg]) -> Vec<u8> {
    segs.iter()
        .flat_map(|&(r, off, len)| images[r][off..off + len].iter().copied())
        .collect()
}

fn scatter(images: &mut [Vec<u8>; 2], segs: &[Seg], mut data: &[u8]) {
    for &(r, off, len) in segs {
        let n = len.min(data.len());
        images[r][off..off + n].copy_from_slice(&data[..n]);
        data = &data[n..];
    }
    assert!(data.is_empty(), "the model scattered past its elements");
}

/// Runs `xfer` at every size with both layouts on one connection, checking every byte of
/// both sides' regions after each transfer.
fn sizes_and_sges(p: &Provider, xfer: Xfer) {
    let imm = matches!(xfer, Xfer::SendWithImm | Xfer::WriteWithImm);
    if imm && lacks(p, "immediate data", |c| c.imm_data) {
        return;
    }
    let _big = big_memory();
    let pair = p.pair();
    let sizes = sizes(p);
    let max = *sizes.iter().max().expect("sizes");
    let a = Buffers::new(&pair.a.pd, max);
    let b = Buffers::new(&pair.b.pd, max);
    let mut round = 0;
    for &len in &sizes {
        for layout in [Layout::OneSge, Layout::ThreeSges] {
            if layout == Layout::ThreeSges && len < 3 {
                continue;
            }
            // A READ scatters into one element on devices that take no more.
            if xfer == Xfer::Read && layout == Layout::ThreeSges && pair.a.caps().max_read_sge < 3 {
                continue;
            }
            round += 1;
            transfer(p, &pair, &a, &b, xfer, len, layout, round);
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn transfer(
    p: &Provider,
    pair: &Pair,
    a: &Buffers,
    b: &Buffers,
    xfer: Xfer,
    len: usize,
    layout: Layout,
    round: u64,
) {
    let what = format!("{}: {xfer:?} of {len} bytes, {layout:?}", p.name);
    let mut exp_a = a.fill(round * 2);
    let mut exp_b = b.fill(round * 2 + 1);
    let local = local_segs(len, layout);
    let remote: Seg = (0, REMOTE_OFF, len);
    let imm = 0x9e37_79b9u32.wrapping_mul(round as u32) ^ 0x8000_0001;
    let mut undefined = None;
    let recv = match xfer {
        Xfer::Send | Xfer::SendWithImm => {
            let (r, u) = recv_segs(len, layout);
            let data = gather(&exp_a, &local);
            scatter(&mut exp_b, &r, &data);
            undefined = u;
            Some(r)
        }
        Xfer::Write | Xfer::WriteWithImm => {
            let data = gather(&exp_a, &local);
            scatter(&mut exp_b, &[remote], &data);
            // WRITE with immediate consumes a receive but places nothing in it.
            (xfer == Xfer::WriteWithImm).then(|| vec![(1, 0, 64)])
        }
        Xfer::Read => {
            let data = gather(&exp_b, &[remote]);
            scatter(&mut exp_a, &local, &data);
            None
        }
    };
    if let Some(r) = &recv {
        let req = r
            .iter()
            .fold(RecvRequest::new(round), |q, &s| q.sge(b.sge(s)));
        pair.b
            .qp
            .post_recv(req)
            .unwrap_or_else(|e| panic!("{what}: post_recv: {e}"));
    }
    let at = raddr(&b.mrs[0], REMOTE_OFF);
    let (op, opcode) = match xfer {
        Xfer::Send => (SendOp::Send, WcOpcode::Send),
        Xfer::SendWithImm => (SendOp::SendWithImm(imm), WcOpcode::Send),
        Xfer::Write => (SendOp::Write(at), WcOpcode::RdmaWrite),
        Xfer::WriteWithImm => (SendOp::WriteWithImm(at, imm), WcOpcode::RdmaWrite),
        Xfer::Read => (SendOp::Read(at), WcOpcode::RdmaRead),
    };
    let req = local
        .iter()
        .fold(SendRequest::new(round, op), |q, &s| q.sge(a.sge(s)));
    pair.a
        .qp
        .post_send(req)
        .unwrap_or_else(|e| panic!("{what}: post_send: {e}"));

    let c = wait_one(&pair.a.scq, &what);
    check_ok(&c, round, opcode, pair.a.qp.qp_num(), &what);
    if xfer == Xfer::Read {
        assert_eq!(c.byte_len as usize, len, "{what}: READ completion byte_len");
    }
    if recv.is_some() {
        let r = wait_one(&pair.b.rcq, &what);
        let (opcode, imm) = match xfer {
            Xfer::Send => (WcOpcode::Recv, None),
            Xfer::SendWithImm => (WcOpcode::Recv, Some(imm)),
            _ => (WcOpcode::RecvRdmaWithImm, Some(imm)),
        };
        check_ok(&r, round, opcode, pair.b.qp.qp_num(), &what);
        assert_eq!(
            (r.byte_len as usize, r.imm_data),
            (len, imm),
            "{what}: receive byte_len and immediate data"
        );
    }

    let got_b = b.images();
    if let Some((r, off, n)) = undefined {
        exp_b[r][off..off + n].copy_from_slice(&got_b[r][off..off + n]);
    }
    for (side, got, exp) in [("A", a.images(), &exp_a), ("B", got_b, &exp_b)] {
        for i in 0..2 {
            let w = format!("{what}: {side}'s region {i}");
            assert_bytes(&got[i], &exp[i], &w);
        }
    }
    for cq in [&pair.a.scq, &pair.a.rcq, &pair.b.scq, &pair.b.rcq] {
        assert_drained(cq, &what);
    }
}

/// SEND at 0, 1, MTU-1, MTU, MTU+1, 3 MTU+7 and 1 MiB bytes, with one and three SGEs on
/// each side; every byte of both sides checked.
pub(crate) fn send_sizes_and_sges(p: &Provider) {
    sizes_and_sges(p, Xfer::Send);
}

/// SEND_WITH_IMM at every size and layout: data, byte_len and imm_data.
pub(crate) fn send_with_imm_sizes_and_sges(p: &Provider) {
    sizes_and_sges(p, Xfer::SendWithImm);
}

/// RDMA WRITE at every size, gathered from one or three SGEs.
pub(crate) fn write_sizes_and_sges(p: &Provider) {
    sizes_and_sges(p, Xfer::Write);
}

/// RDMA WRITE_WITH_IMM at every size: data placed, a receive consumed and left untouched.
pub(crate) fn write_with_imm_sizes_and_sges(p: &Provider) {
    sizes_and_sges(p, Xfer::WriteWithImm);
}

/// RDMA READ at every size, scattered into one or three SGEs.
pub(crate) fn read_sizes_and_sges(p: &Provider) {
    sizes_and_sges(p, Xfer::Read);
}

// ---- inline ----------------------------------------------------------------------------

/// SEND and WRITE with inline data (up to the default `max_inline_data`, 256 bytes, or
/// the device's limit if lower).
pub(crate) fn inline_send_and_write(p: &Provider) {
    let pair = p.pair();
    let (qa, qb) = (pair.a.qp.qp_num(), pair.b.qp.qp_num());
    let max = pair.a.qp.caps().max_inline_data;
    let (send_len, write_len) = (200.min(max), 256.min(max));
    let inbox = register(&pair.b.pd, 512, LOCAL);
    let dst = register(&pair.b.pd, 512, ALL);
    let mut exp_in = fill(&inbox, 1);
    let mut exp_dst = fill(&dst, 2);

    let what = format!("{}: inline SEND", p.name);
    let data = pattern(3, send_len);
    pair.b
        .qp
        .post_recv(RecvRequest::new(1).sge(sge(&inbox, 0, 512)))
        .unwrap();
    pair.a
        .qp
        .post_send(SendRequest::send(11).inline(&data))
        .unwrap_or_else(|e| panic!("{what}: post_send: {e}"));
    check_ok(&wait_one(&pair.a.scq, &what), 11, WcOpcode::Send, qa, &what);
    let r = wait_one(&pair.b.rcq, &what);
    check_ok(&r, 1, WcOpcode::Recv, qb, &what);
    assert_eq!(r.byte_len as usize, send_len, "{what}: byte_len");
    let got = image(&inbox);
    exp_in[send_len..].copy_from_slice(&got[send_len..]);
    exp_in[..send_len].copy_from_slice(&data);
    assert_bytes(&got, &exp_in, &what);

    let what = format!("{}: inline WRITE", p.name);
    let data = pattern(4, write_len);
    pair.a
        .qp
        .post_send(SendRequest::write(12, raddr(&dst, 100)).inline(&data))
        .unwrap_or_else(|e| panic!("{what}: post_send: {e}"));
    check_ok(
        &wait_one(&pair.a.scq, &what),
        12,
        WcOpcode::RdmaWrite,
        qa,
        &what,
    );
    exp_dst[100..100 + write_len].copy_from_slice(&data);
    assert_bytes(&image(&dst), &exp_dst, &what);
}

// ---- ordering --------------------------------------------------------------------------

/// A multi-packet WRITE followed by a SEND: when the SEND's receive completes, the
/// WRITE's data is in place. Rounds vary whether the WRITE is signaled and whether both
/// are queued behind a SEND waiting for a receive (RNR), so that they start together.
pub(crate) fn write_then_send_ordering(p: &Provider) {
    let mut cfg = p.config();
    cfg.opts.rnr_retry = 7;
    let pair = p.pair_with(cfg, p.config());
    let (qa, qb) = (pair.a.qp.qp_num(), pair.b.qp.qp_num());
    let len = 4 * p.mtu_bytes() + 5;
    let src = register(&pair.a.pd, len, LOCAL);
    let msg = register(&pair.a.pd, 16, LOCAL);
    let dst = register(&pair.b.pd, len, ALL);
    let inbox = register(&pair.b.pd, 64, LOCAL);
    for round in 0..16u64 {
        let (signaled, blocked) = (round % 2 == 0, round % 4 >= 2);
        if blocked && !pair.a.caps().rnr_retry {
            continue; // no RNR to queue them behind (iWARP)
        }
        let what = format!(
            "{}: WRITE then SEND, round {round} (WRITE signaled: {signaled}, queued behind \
             an RNR: {blocked})",
            p.name
        );
        fill(&dst, 1000 + round);
        let data = fill(&src, round);
        msg.write_at(0, &round.to_ne_bytes()).unwrap();
        let flags = if signaled {
            SendFlags::SIGNALED
        } else {
            SendFlags::empty()
        };
        let mut reqs = Vec::new();
        if blocked {
            reqs.push(SendRequest::send(3000 + round).sge(sge(&msg, 8, 8)));
        } else {
            pair.b
                .qp
                .post_recv(RecvRequest::new(round).sge(sge(&inbox, 0, 64)))
                .unwrap();
        }
        reqs.push(
            SendRequest::write(1000 + round, raddr(&dst, 0))
                .sge(sge(&src, 0, len))
                .flags(flags),
        );
        reqs.push(SendRequest::send(2000 + round).sge(sge(&msg, 0, 8)));
        for r in reqs {
            pair.a
                .qp
                .post_send(r)
                .unwrap_or_else(|e| panic!("{what}: post_send: {e}"));
        }
        if blocked {
            for id in [3000 + round, round] {
                pair.b
                    .qp
                    .post_recv(RecvRequest::new(id).sge(sge(&inbox, 0, 64)))
                    .unwrap();
            }
            check_ok(
                &wait_one(&pair.b.rcq, &what),
                3000 + round,
                WcOpcode::Recv,
                qb,
                &what,
            );
        }

        let r = wait_one(&pair.b.rcq, &what);
        check_ok(&r, round, WcOpcode::Recv, qb, &what);
        // The receive of the SEND completed: the WRITE posted before it is visible.
        assert_bytes(
            &image(&dst),
            &data,
            &format!("{what}: WRITE data at the SEND's receive"),
        );
        let mut got = [0u8; 8];
        inbox.read_at(0, &mut got).unwrap();
        assert_eq!(u64::from_ne_bytes(got), round, "{what}: SEND data");

        let mut expected = Vec::new();
        if blocked {
            expected.push(3000 + round);
        }
        if signaled {
            expected.push(1000 + round);
        }
        expected.push(2000 + round);
        let ids: Vec<u64> = wait_n(&pair.a.scq, expected.len(), &what)
            .iter()
            .inspect(|c| assert_eq!(c.status, WcStatus::Success, "{what}: {c:?}"))
            .inspect(|c| assert_eq!(c.qp_num, qa, "{what}: {c:?}"))
            .map(|c| c.wr_id)
            .collect();
        assert_eq!(ids, expected, "{what}: send completions in order");
    }
}

/// A fenced WRITE and a fenced SEND that gather from a READ's destination carry the
/// READ's data; a fenced WRITE of an atomic's result carries the old value.
///
/// Each chain is queued behind a SEND that waits for a receive (RNR, `rnr_retry` 7), so
/// the READ and the fenced requests are outstanding together and start together once the
/// receive is posted, even on providers that make progress inside every verb call.
pub(crate) fn fence_after_read_and_atomic(p: &Provider) {
    if lacks(p, "RNR waits (which queue each chain)", |c| c.rnr_retry)
        || lacks(p, "atomics", |c| c.atomics.supported())
    {
        return;
    }
    let mut cfg = p.config();
    cfg.opts.rnr_retry = 7;
    let pair = p.pair_with(cfg, p.config());
    let (qa, qb) = (pair.a.qp.qp_num(), pair.b.qp.qp_num());
    let len = 3 * p.mtu_bytes() + 5;
    let x = register(&pair.b.pd, len, ALL);
    let y = register(&pair.b.pd, len, ALL);
    let inbox = register(&pair.b.pd, 2 * len, LOCAL);
    let l = register(&pair.a.pd, len, LOCAL);
    let blocker = register(&pair.a.pd, 8, LOCAL);
    let fenced = SendFlags::SIGNALED | SendFlags::FENCE;
    for round in 0..8u64 {
        let what = format!("{}: fenced after READ, round {round}", p.name);
        let data = fill(&x, round);
        fill(&y, 1000 + round);
        fill(&l, 2000 + round);
        let id = 10 * round;
        let reqs = [
            SendRequest::send(id).sge(sge(&blocker, 0, 8)),
            SendRequest::read(id + 1, raddr(&x, 0)).sge(sge(&l, 0, len)),
            SendRequest::write(id + 2, raddr(&y, 0))
                .sge(sge(&l, 0, len))
                .flags(fenced),
            SendRequest::send(id + 3).sge(sge(&l, 0, len)).flags(fenced),
        ];
        for r in reqs {
            pair.a
                .qp
                .post_send(r)
                .unwrap_or_else(|e| panic!("{what}: post_send: {e}"));
        }
        for (k, off) in [(0, 0), (1, len)] {
            pair.b
                .qp
                .post_recv(RecvRequest::new(2 * round + k).sge(sge(&inbox, off, len)))
                .unwrap();
        }
        let cs = wait_n(&pair.a.scq, 4, &what);
        check_ok(&cs[0], id, WcOpcode::Send, qa, &what);
        check_ok(&cs[1], id + 1, WcOpcode::RdmaRead, qa, &what);
        check_ok(&cs[2], id + 2, WcOpcode::RdmaWrite, qa, &what);
        check_ok(&cs[3], id + 3, WcOpcode::Send, qa, &what);
        let rs = wait_n(&pair.b.rcq, 2, &what);
        check_ok(&rs[0], 2 * round, WcOpcode::Recv, qb, &what);
        check_ok(&rs[1], 2 * round + 1, WcOpcode::Recv, qb, &what);
        assert_eq!(rs[1].byte_len as usize, len, "{what}: fenced SEND byte_len");
        assert_bytes(&image(&l), &data, &format!("{what}: READ destination"));
        assert_bytes(&image(&y), &data, &format!("{what}: fenced WRITE"));
        assert_bytes(
            &image(&inbox)[len..],
            &data,
            &format!("{what}: fenced SEND"),
        );
    }

    let what = format!("{}: fenced WRITE after FETCH_ADD", p.name);
    let counter = register_page(&pair.b.pd, 4096, ALL);
    let l8 = register_page(&pair.a.pd, 4096, LOCAL);
    counter.write_at(0, &77u64.to_ne_bytes()).unwrap();
    l8.write_at(0, &0xdead_beefu64.to_ne_bytes()).unwrap();
    y.write_at(0, &[0u8; 8]).unwrap();
    let add = SendOp::FetchAdd {
        remote: raddr(&counter, 0),
        add: 1,
    };
    let reqs = [
        SendRequest::send(900).sge(sge(&blocker, 0, 8)),
        SendRequest::new(901, add).sge(sge(&l8, 0, 8)),
        SendRequest::write(902, raddr(&y, 0))
            .sge(sge(&l8, 0, 8))
            .flags(fenced),
    ];
    for r in reqs {
        pair.a
            .qp
            .post_send(r)
            .unwrap_or_else(|e| panic!("{what}: post_send: {e}"));
    }
    pair.b
        .qp
        .post_recv(RecvRequest::new(900).sge(sge(&inbox, 0, 8)))
        .unwrap();
    let cs = wait_n(&pair.a.scq, 3, &what);
    check_ok(&cs[0], 900, WcOpcode::Send, qa, &what);
    check_ok(&cs[1], 901, WcOpcode::FetchAdd, qa, &what);
    check_ok(&cs[2], 902, WcOpcode::RdmaWrite, qa, &what);
    check_ok(
        &wait_one(&pair.b.rcq, &what),
        900,
        WcOpcode::Recv,
        qb,
        &what,
    );
    assert_eq!(u64_at(&image(&y), 0), 77, "{what}: the fenced WRITE's data");
    assert_eq!(counter.load_u64(0).unwrap(), 78, "{what}: the counter");
}

// ---- immediate data --------------------------------------------------------------------

/// SEND_WITH_IMM and WRITE_WITH_IMM deliver imm_data in the receive completion; a WRITE
/// with immediate consumes a receive (opcode RecvRdmaWithImm, byte_len = WRITE length,
/// receive buffer untouched), a plain WRITE consumes none.
pub(crate) fn immediate_data(p: &Provider) {
    if lacks(p, "immediate data", |c| c.imm_data) {
        return;
    }
    let pair = p.pair();
    let (qa, qb) = (pair.a.qp.qp_num(), pair.b.qp.qp_num());
    let src = register(&pair.a.pd, 4096, LOCAL);
    let inbox = register(&pair.b.pd, 4 * 64, LOCAL);
    let dst = register(&pair.b.pd, 4096, ALL);
    let data = fill(&src, 1);
    let mut exp_in = fill(&inbox, 2);
    let mut exp_dst = fill(&dst, 3);
    for id in 0..4u64 {
        pair.b
            .qp
            .post_recv(RecvRequest::new(id).sge(sge(&inbox, 64 * id as usize, 64)))
            .unwrap();
    }

    // Receive 0: SEND_WITH_IMM.
    let what = format!("{}: SEND_WITH_IMM", p.name);
    pair.a
        .qp
        .post_send(SendRequest::new(10, SendOp::SendWithImm(0xdead_beef)).sge(sge(&src, 0, 16)))
        .unwrap();
    check_ok(&wait_one(&pair.a.scq, &what), 10, WcOpcode::Send, qa, &what);
    let r = wait_one(&pair.b.rcq, &what);
    check_ok(&r, 0, WcOpcode::Recv, qb, &what);
    assert_eq!((r.byte_len, r.imm_data), (16, Some(0xdead_beef)), "{what}");
    exp_in[..16].copy_from_slice(&data[..16]);

    // A plain WRITE consumes no receive.
    let what = format!("{}: plain WRITE", p.name);
    pair.a
        .qp
        .post_send(SendRequest::write(11, raddr(&dst, 1000)).sge(sge(&src, 100, 32)))
        .unwrap();
    check_ok(
        &wait_one(&pair.a.scq, &what),
        11,
        WcOpcode::RdmaWrite,
        qa,
        &what,
    );
    exp_dst[1000..1032].copy_from_slice(&data[100..132]);

    // Receive 1: WRITE_WITH_IMM, imm 0.
    let what = format!("{}: WRITE_WITH_IMM", p.name);
    let op = SendOp::WriteWithImm(raddr(&dst, 2000), 0);
    pair.a
        .qp
        .post_send(SendRequest::new(12, op).sge(sge(&src, 200, 100)))
        .unwrap();
    check_ok(
        &wait_one(&pair.a.scq, &what),
        12,
        WcOpcode::RdmaWrite,
        qa,
        &what,
    );
    let r = wait_one(&pair.b.rcq, &what);
    check_ok(&r, 1, WcOpcode::RecvRdmaWithImm, qb, &what);
    assert_eq!((r.byte_len, r.imm_data), (100, Some(0)), "{what}");
    exp_dst[2000..2100].copy_from_slice(&data[200..300]);

    // Receive 2: zero-length WRITE_WITH_IMM, imm u32::MAX.
    let what = format!("{}: zero-length WRITE_WITH_IMM", p.name);
    let op = SendOp::WriteWithImm(raddr(&dst, 3000), u32::MAX);
    pair.a.qp.post_send(SendRequest::new(13, op)).unwrap();
    check_ok(
        &wait_one(&pair.a.scq, &what),
        13,
        WcOpcode::RdmaWrite,
        qa,
        &what,
    );
    let r = wait_one(&pair.b.rcq, &what);
    check_ok(&r, 2, WcOpcode::RecvRdmaWithImm, qb, &what);
    assert_eq!((r.byte_len, r.imm_data), (0, Some(u32::MAX)), "{what}");

    // Receive 3: a plain SEND has no immediate data.
    let what = format!("{}: SEND after immediates", p.name);
    pair.a
        .qp
        .post_send(SendRequest::send(14).sge(sge(&src, 300, 64)))
        .unwrap();
    check_ok(&wait_one(&pair.a.scq, &what), 14, WcOpcode::Send, qa, &what);
    let r = wait_one(&pair.b.rcq, &what);
    check_ok(&r, 3, WcOpcode::Recv, qb, &what);
    assert_eq!((r.byte_len, r.imm_data), (64, None), "{what}");
    exp_in[192..256].copy_from_slice(&data[300..364]);

    let what = format!("{}: immediate data", p.name);
    assert_bytes(&image(&inbox), &exp_in, &format!("{what}: receive buffers"));
    assert_bytes(&image(&dst), &exp_dst, &format!("{what}: WRITE target"));
    assert_drained(&pair.b.rcq, &what);
}

// ---- both ways at once -----------------------------------------------------------------

/// Both sides WRITE several megabytes to each other at once, more than a link buffers in
/// either direction: each side's requests complete and land whole (on a stream, neither
/// side may wait to finish reading the other's packet before it finishes sending its own).
pub(crate) fn writes_both_ways_at_once(p: &Provider) {
    let _big = big_memory();
    let pair = p.pair();
    let len = 2 << 20;
    let (sa, sb) = (
        register(&pair.a.pd, len, LOCAL),
        register(&pair.b.pd, len, LOCAL),
    );
    let (da, db) = (
        register(&pair.a.pd, len, ALL),
        register(&pair.b.pd, len, ALL),
    );
    let (xa, xb) = (fill(&sa, 1), fill(&sb, 2));
    let (qa, qb) = (pair.a.qp.qp_num(), pair.b.qp.qp_num());
    const N: u64 = 4;
    for round in 0..4 {
        for i in 0..N {
            let id = round * N + i;
            pair.a
                .qp
                .post_send(SendRequest::write(id, raddr(&db, 0)).sge(sge(&sa, 0, len)))
                .unwrap();
            pair.b
                .qp
                .post_send(SendRequest::write(id, raddr(&da, 0)).sge(sge(&sb, 0, len)))
                .unwrap();
        }
        let what = |s| {
            format!(
                "{}: WRITEs from {s}, both ways at once, round {round}",
                p.name
            )
        };
        for (i, c) in wait_n(&pair.a.scq, N as usize, &what("a"))
            .iter()
            .enumerate()
        {
            check_ok(c, round * N + i as u64, WcOpcode::RdmaWrite, qa, &what("a"));
        }
        for (i, c) in wait_n(&pair.b.scq, N as usize, &what("b"))
            .iter()
            .enumerate()
        {
            check_ok(c, round * N + i as u64, WcOpcode::RdmaWrite, qb, &what("b"));
        }
    }
    assert_bytes(&image(&db), &xa, "a's WRITEs at b");
    assert_bytes(&image(&da), &xb, "b's WRITEs at a");
}
