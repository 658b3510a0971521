//! UC and UD under packet loss, on the loopback provider's fault injector: UC drops a
//! message that lost a packet whole (a receive never completes with torn data) and
//! delivers the next one normally; UD loses datagrams, never corrupts them.

use std::time::{Duration, Instant};

use rdmx::loopback::fault_stats;
use rdmx::loopback::faults::{Faults, PPM};
use rdmx::{
    Access, AhAttr, Completion, CompletionQueue, ConnectOptions, Context, LocalSge, Mtu, QpCaps,
    QpType, RecvRequest, SendRequest, WcOpcode, WcStatus, GRH_LEN,
};

const DEADLINE: Duration = Duration::from_secs(60);

fn open(faults: Option<Faults>) -> Context {
    let mut opts = rdmx::loopback::Options::default();
    if let Some(f) = faults {
        opts = opts.faults(f);
    }
    Context::open(opts).unwrap()
}

fn pattern(tag: u64, len: usize) -> Vec<u8> {
    let mut x = tag.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn poll_until(cq: &CompletionQueue, n: usize, what: &str) -> Vec<Completion> {
    let mut out = Vec::new();
    let end = Instant::now() + DEADLINE;
    while out.len() < n {
        let mut buf = [Completion::default(); 64];
        let got = cq.poll(&mut buf).unwrap();
        out.extend_from_slice(&buf[..got]);
        assert!(
            Instant::now() < end,
            "timed out waiting for {what}: {}/{n}",
            out.len()
        );
    }
    out
}

/// Drains what arrives until `quiet` passes with nothing new.
fn drain(cq: &CompletionQueue, quiet: Duration) -> Vec<Completion> {
    let mut out = Vec::new();
    let mut last = Instant::now();
    while last.elapsed() < quiet {
        let mut buf = [Completion::default(); 64];
        let got = cq.poll(&mut buf).unwrap();
        if got > 0 {
            out.extend_from_slice(&buf[..got]);
            last = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    out
}

#[test]
fn uc_drops_whole_messages_under_loss_and_continues() {
    const N: usize = 300;
    const MTU: usize = 1024;
    const LEN: usize = 3 * MTU + 200; // four packets a message
    let a_ctx = open(Some(Faults::seeded(7).drop(PPM / 20)));
    let b_ctx = open(None);
    let (a_pd, b_pd) = (a_ctx.alloc_pd(), b_ctx.alloc_pd());
    let (a_cq, b_cq) = (
        a_ctx.create_cq(4 * N).unwrap(),
        b_ctx.create_cq(4 * N).unwrap(),
    );
    let caps = QpCaps::default().max_send_wr(N).max_recv_wr(N);
    let a = a_pd
        .create_qp_of_type(QpType::Uc, &a_cq, &a_cq, None, caps)
        .unwrap();
    let b = b_pd
        .create_qp_of_type(QpType::Uc, &b_cq, &b_cq, None, caps)
        .unwrap();
    let mut opts = ConnectOptions::default();
    opts.mtu = Some(Mtu::Mtu1024);
    a.connect(b.endpoint(), &opts).unwrap();
    b.connect(a.endpoint(), &opts).unwrap();

    let src = a_pd
        .register(vec![0u8; N * LEN], Access::LOCAL_WRITE)
        .unwrap();
    let dst = b_pd
        .register(vec![0u8; N * LEN], Access::LOCAL_WRITE)
        .unwrap();
    for i in 0..N {
        src.write_at(i * LEN, &pattern(i as u64, LEN)).unwrap();
        b.post_recv(RecvRequest::new(i as u64).sge(LocalSge::new(&dst, i * LEN, LEN).unwrap()))
            .unwrap();
    }
    for i in 0..N {
        a.post_send(SendRequest::send(i as u64).sge(LocalSge::new(&src, i * LEN, LEN).unwrap()))
            .unwrap();
    }
    // Every send completes: UC awaits no acknowledgement.
    let sent = poll_until(&a_cq, N, "the UC sends");
    assert!(sent
        .iter()
        .all(|c| c.status == WcStatus::Success && c.opcode == WcOpcode::Send));
    let stats = fault_stats(&a_ctx).unwrap();
    assert!(stats.dropped > 0, "the injector dropped packets: {stats:?}");

    let got = drain(&b_cq, Duration::from_millis(200));
    // Whole messages only, in order: the k-th receive holds a complete message, later
    // than the one before it.
    let mut last: Option<usize> = None;
    for (k, c) in got.iter().enumerate() {
        assert_eq!(c.status, WcStatus::Success);
        assert_eq!(c.wr_id, k as u64, "receives complete in order");
        assert_eq!(c.byte_len as usize, LEN, "a whole message");
        let mut bytes = vec![0u8; LEN];
        dst.read_at(k * LEN, &mut bytes).unwrap();
        let tag = (0..N)
            .find(|&t| pattern(t as u64, LEN) == bytes)
            .unwrap_or_else(|| panic!("receive {k} holds torn or foreign data"));
        assert!(last.map_or(true, |l| tag > l), "messages in order");
        last = Some(tag);
    }
    let lost = N - got.len();
    assert!(lost > 0, "some messages lost a packet");
    assert!(
        got.len() > N / 2,
        "most messages arrive ({} of {N})",
        got.len()
    );
    assert!(
        b.dropped().is_some_and(|n| n > 0),
        "the receiver counted what it dropped"
    );

    // After the losses the connection carries on: a message without faults on its way is
    // delivered into the next receive.
    let faults_before = fault_stats(&a_ctx).unwrap().dropped;
    let mut delivered = false;
    for round in 0..50u64 {
        let tag = 10_000 + round;
        src.write_at(0, &pattern(tag, LEN)).unwrap();
        a.post_send(SendRequest::send(tag).sge(LocalSge::new(&src, 0, LEN).unwrap()))
            .unwrap();
        poll_until(&a_cq, 1, "a later send");
        let more = drain(&b_cq, Duration::from_millis(50));
        if let Some(c) = more.first() {
            let k = c.wr_id as usize;
            let mut bytes = vec![0u8; LEN];
            dst.read_at(k * LEN, &mut bytes).unwrap();
            assert_eq!(
                bytes,
                pattern(tag, LEN),
                "the next message is delivered whole"
            );
            delivered = true;
            break;
        }
    }
    assert!(
        delivered,
        "a message got through after the losses (faults {faults_before})"
    );
}

#[test]
fn ud_loses_datagrams_never_corrupts_them() {
    const N: usize = 200;
    const LEN: usize = 512;
    const QKEY: u32 = 0x42;
    let a_ctx = open(Some(Faults::seeded(9).drop(PPM / 10).corrupt(PPM / 20)));
    let b_ctx = open(None);
    let (a_pd, b_pd) = (a_ctx.alloc_pd(), b_ctx.alloc_pd());
    let (a_cq, b_cq) = (
        a_ctx.create_cq(4 * N).unwrap(),
        b_ctx.create_cq(4 * N).unwrap(),
    );
    let caps = QpCaps::default().max_send_wr(N).max_recv_wr(N);
    let a = a_pd
        .create_qp_of_type(QpType::Ud, &a_cq, &a_cq, None, caps)
        .unwrap();
    let b = b_pd
        .create_qp_of_type(QpType::Ud, &b_cq, &b_cq, None, caps)
        .unwrap();
    a.activate(QKEY).unwrap();
    b.activate(QKEY).unwrap();
    let slot = GRH_LEN + LEN;
    let src = a_pd
        .register(vec![0u8; N * LEN], Access::LOCAL_WRITE)
        .unwrap();
    let dst = b_pd
        .register(vec![0u8; N * slot], Access::LOCAL_WRITE)
        .unwrap();
    for i in 0..N {
        src.write_at(i * LEN, &pattern(i as u64, LEN)).unwrap();
        b.post_recv(RecvRequest::new(i as u64).sge(LocalSge::new(&dst, i * slot, slot).unwrap()))
            .unwrap();
    }
    let ah = a_pd.create_ah(&AhAttr::to_endpoint(&b.endpoint())).unwrap();
    for i in 0..N {
        a.post_send(
            SendRequest::send(i as u64)
                .sge(LocalSge::new(&src, i * LEN, LEN).unwrap())
                .ud(&ah, b.qp_num(), QKEY),
        )
        .unwrap();
    }
    poll_until(&a_cq, N, "the UD sends");
    let got = drain(&b_cq, Duration::from_millis(200));
    assert!(
        !got.is_empty() && got.len() < N,
        "{} of {N} datagrams arrived",
        got.len()
    );
    for c in &got {
        assert_eq!(c.status, WcStatus::Success);
        assert_eq!(c.src_qp, a.qp_num());
        let mut bytes = vec![0u8; LEN];
        dst.read_at(c.wr_id as usize * slot + GRH_LEN, &mut bytes)
            .unwrap();
        assert!(
            (0..N).any(|t| pattern(t as u64, LEN) == bytes),
            "a datagram arrives whole or not at all"
        );
    }
}

#[test]
fn ud_to_an_unknown_qpn_or_empty_group_is_counted_stray() {
    const QKEY: u32 = 7;
    let ctx = open(None);
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(64).unwrap();
    let a = pd
        .create_qp_of_type(QpType::Ud, &cq, &cq, None, QpCaps::default())
        .unwrap();
    a.activate(QKEY).unwrap();
    let src = pd.register(vec![1u8; 64], Access::LOCAL_WRITE).unwrap();
    let before = rdmx::loopback::stray_datagrams();
    let ah = pd.create_ah(&AhAttr::to_endpoint(&a.endpoint())).unwrap();
    // QP numbers are 24 bits and handed out from 0x11 up: this one is nobody's.
    a.post_send(
        SendRequest::send(1)
            .sge(LocalSge::new(&src, 0, 64).unwrap())
            .ud(&ah, 0xff_fff0, QKEY),
    )
    .unwrap();
    let group = pd
        .create_ah(&AhAttr::multicast("ff0e::dead".parse().unwrap()))
        .unwrap();
    a.post_send(
        SendRequest::send(2)
            .sge(LocalSge::new(&src, 0, 64).unwrap())
            .ud(&group, rdmx::MULTICAST_QPN, QKEY),
    )
    .unwrap();
    let cs = poll_until(&cq, 2, "both sends");
    assert!(cs.iter().all(|c| c.status == WcStatus::Success));
    // Other tests may stray datagrams at the same time: at least these two were counted.
    assert!(rdmx::loopback::stray_datagrams() >= before + 2);
}
