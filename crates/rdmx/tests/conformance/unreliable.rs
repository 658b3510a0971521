//! UD and UC queue pairs, on every provider whose capabilities have them (a provider
//! without the QP type passes these tests by checking that it refuses to create one).

use std::net::Ipv6Addr;

use rdmx::{
    AhAttr, Completion, CompletionQueue, ConnectOptions, GrhRepr, ProtectionDomain, QpCaps,
    QpState, QpType, QueuePair, RecvRequest, SendRequest, WcOpcode, WcStatus, GRH_LEN,
    MULTICAST_QPN,
};

use super::{
    assert_bytes, assert_quiet, image, pattern, raddr, register, sge, wait_n, wait_one, Provider,
    ALL, LOCAL,
};

const QKEY: u32 = 0x1111_2222;

/// A queue pair of `qp_type` with its CQs.
struct Ep {
    pd: ProtectionDomain,
    scq: CompletionQueue,
    rcq: CompletionQueue,
    qp: QueuePair,
}

/// A new queue pair of `qp_type` in a context of its own, or `None` (after checking the
/// provider refuses it) when the provider lacks the type.
fn ep(p: &Provider, qp_type: QpType) -> Option<Ep> {
    let ctx = p.open();
    let pd = ctx.alloc_pd();
    let scq = ctx.create_cq(256).unwrap();
    let rcq = ctx.create_cq(256).unwrap();
    let made = pd.create_qp_of_type(qp_type, &scq, &rcq, None, QpCaps::default());
    if !ctx.capabilities().supports(qp_type) {
        assert!(
            matches!(made, Err(rdmx::Error::Unsupported(_))),
            "{}: a {qp_type} QP the capabilities deny must be refused",
            p.name
        );
        eprintln!("{}: no {qp_type} queue pairs; skipped", p.name);
        return None;
    }
    let qp = made.unwrap_or_else(|e| panic!("{}: create a {qp_type} QP: {e}", p.name));
    assert_eq!(qp.qp_type(), qp_type);
    Some(Ep { pd, scq, rcq, qp })
}

fn ud(p: &Provider) -> Option<Ep> {
    let e = ep(p, QpType::Ud)?;
    e.qp.activate(QKEY)
        .unwrap_or_else(|err| panic!("{}: activate a UD QP: {err}", p.name));
    assert_eq!(e.qp.state(), QpState::Rts);
    Some(e)
}

fn uc_pair(p: &Provider) -> Option<(Ep, Ep)> {
    let a = ep(p, QpType::Uc)?;
    let b = ep(p, QpType::Uc)?;
    let opts: ConnectOptions = p.options();
    a.qp.connect(b.qp.endpoint(), &opts).unwrap();
    b.qp.connect(a.qp.endpoint(), &opts).unwrap();
    assert_eq!(a.qp.state(), QpState::Rts);
    Some((a, b))
}

/// The UD message size the suite sends: well under the path MTU.
fn ud_len(p: &Provider, e: &Ep) -> usize {
    (e.pd.context().capabilities().max_ud_message()).min(p.mtu_bytes()) / 2
}

/// Datagrams from one QP to several, each landing after the GRH area, with the sender's
/// QPN and a GRH in the completion.
pub(crate) fn ud_datagrams_to_several_qps(p: &Provider) {
    let Some(tx) = ud(p) else { return };
    let rx: Vec<Ep> = (0..3).filter_map(|_| ud(p)).collect();
    let len = ud_len(p, &tx);
    let src = register(&tx.pd, 3 * len, ALL);
    for (i, r) in rx.iter().enumerate() {
        let buf = register(&r.pd, GRH_LEN + len, LOCAL);
        r.qp.post_recv(RecvRequest::new(i as u64).sge(sge(&buf, 0, GRH_LEN + len)))
            .unwrap();
        let data = pattern(i as u64 + 1, len);
        src.write_at(i * len, &data).unwrap();
        let ah = tx
            .pd
            .create_ah(&AhAttr::to_endpoint(&r.qp.endpoint()))
            .unwrap();
        tx.qp
            .post_send(
                SendRequest::send_with_imm(100 + i as u64, 7 + i as u32)
                    .sge(sge(&src, i * len, len))
                    .ud(&ah, r.qp.qp_num(), QKEY),
            )
            .unwrap();
        let c = wait_one(&tx.scq, "the UD send's completion");
        assert_eq!(
            (c.wr_id, c.status, c.opcode),
            (100 + i as u64, WcStatus::Success, WcOpcode::Send)
        );
        let c = wait_one(&r.rcq, "the datagram");
        check_datagram(p, &c, i as u64, len, tx.qp.qp_num());
        assert_eq!(c.imm_data, Some(7 + i as u32));
        let got = image(&buf);
        assert_bytes(&got[GRH_LEN..], &data, "the datagram after the GRH area");
        if c.grh {
            assert_eq!(
                grh_dgid(&got[..GRH_LEN]),
                AhAttr::to_endpoint(&r.qp.endpoint()).dgid
            );
            // An InfiniBand GRH counts the BTH, DETH, immediate data, payload and ICRC.
            if let Some(n) = grh_payload_len(&got[..GRH_LEN]) {
                assert_eq!(
                    usize::from(n),
                    12 + 8 + 4 + len + 4,
                    "{}: the GRH's payload length",
                    p.name
                );
            }
        }
    }
}

/// The payload length of the GRH in a GRH area, when the area holds an InfiniBand GRH
/// (IP version 6, next header a BTH; not an IPv4 or IPv6/UDP header as RoCEv2 puts).
fn grh_payload_len(area: &[u8]) -> Option<u16> {
    let grh = GrhRepr::parse(area).ok()?;
    (area[0] >> 4 == 6 && grh.next_header == rdmx_wire::GRH_NEXT_HEADER_BTH)
        .then_some(grh.payload_len)
}

/// The destination GID the GRH area of a received datagram names. On RoCEv2 over IPv4
/// verbs puts the datagram's IPv4 header in the area's last 20 bytes (the first 20 are
/// undefined); its destination is named as an IPv4-mapped GID. Otherwise the area holds
/// a GRH.
fn grh_dgid(area: &[u8]) -> Ipv6Addr {
    let ip = &area[20..40];
    if ip[0] >> 4 == 4 {
        std::net::Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]).to_ipv6_mapped()
    } else {
        Ipv6Addr::from(GrhRepr::parse(area).expect("a GRH in the GRH area").dgid)
    }
}

fn check_datagram(p: &Provider, c: &Completion, wr_id: u64, len: usize, src_qp: u32) {
    assert_eq!(c.status, WcStatus::Success, "{}: datagram status", p.name);
    assert_eq!(c.wr_id, wr_id, "{}: the receive the datagram took", p.name);
    assert_eq!(c.opcode, WcOpcode::Recv);
    assert_eq!(
        c.byte_len as usize,
        GRH_LEN + len,
        "{}: byte_len counts the GRH area",
        p.name
    );
    assert_eq!(c.src_qp, src_qp, "{}: the sender's QPN", p.name);
}

/// A datagram with another Q_Key is dropped: the receive it would have taken gets the
/// next datagram, which has the right one.
pub(crate) fn ud_qkey_mismatch(p: &Provider) {
    let Some(tx) = ud(p) else { return };
    let Some(rx) = ud(p) else { return };
    let len = 64;
    let src = register(&tx.pd, 2 * len, ALL);
    src.write_at(0, &pattern(1, len)).unwrap();
    src.write_at(len, &pattern(2, len)).unwrap();
    let buf = register(&rx.pd, 2 * (GRH_LEN + len), LOCAL);
    for i in 0..2 {
        let off = i * (GRH_LEN + len);
        rx.qp
            .post_recv(RecvRequest::new(i as u64).sge(sge(&buf, off, GRH_LEN + len)))
            .unwrap();
    }
    let dropped = rx.qp.dropped();
    let counts = dropped.is_some();
    let ah = tx
        .pd
        .create_ah(&AhAttr::to_endpoint(&rx.qp.endpoint()))
        .unwrap();
    for (i, qkey) in [(0, QKEY ^ 1), (1, QKEY)] {
        tx.qp
            .post_send(
                SendRequest::send(i)
                    .sge(sge(&src, i as usize * len, len))
                    .ud(&ah, rx.qp.qp_num(), qkey),
            )
            .unwrap();
    }
    wait_n(
        &tx.scq,
        2,
        "both sends complete (UD sends are not acknowledged)",
    );
    let c = wait_one(&rx.rcq, "the datagram with the right Q_Key");
    check_datagram(p, &c, 0, len, tx.qp.qp_num());
    assert_bytes(
        &image(&buf)[GRH_LEN..GRH_LEN + len],
        &pattern(2, len),
        "the right datagram",
    );
    assert_quiet(&rx.rcq, "no second datagram");
    // A provider that counts drops (its capabilities say so) counted this one; one that
    // cannot know (verbs: the adapter drops) says None.
    let caps = rx.pd.context().capabilities();
    assert_eq!(
        counts, caps.counts_dropped,
        "{}: dropped() is Some exactly where the capabilities say drops are counted",
        p.name
    );
    assert_eq!(
        rx.qp.dropped().is_some(),
        counts,
        "{}: dropped() stays Some or None",
        p.name
    );
    if let (Some(before), Some(after)) = (dropped, rx.qp.dropped()) {
        assert!(after > before, "{}: the wrong Q_Key was counted", p.name);
    }
}

/// A UD message longer than the path MTU is refused at post; one of exactly the MTU goes.
pub(crate) fn ud_oversize_refused(p: &Provider) {
    let Some(tx) = ud(p) else { return };
    let Some(rx) = ud(p) else { return };
    let mtu = tx.pd.context().capabilities().max_ud_message();
    let src = register(&tx.pd, mtu + 1, ALL);
    let ah = tx
        .pd
        .create_ah(&AhAttr::to_endpoint(&rx.qp.endpoint()))
        .unwrap();
    let too_long = SendRequest::send(1)
        .sge(sge(&src, 0, mtu + 1))
        .ud(&ah, rx.qp.qp_num(), QKEY);
    assert!(
        tx.qp.post_send(too_long).is_err(),
        "{}: a datagram over the MTU",
        p.name
    );
    let buf = register(&rx.pd, GRH_LEN + mtu, LOCAL);
    rx.qp
        .post_recv(RecvRequest::new(9).sge(sge(&buf, 0, GRH_LEN + mtu)))
        .unwrap();
    let data = pattern(3, mtu);
    src.write_at(0, &data).unwrap();
    tx.qp
        .post_send(
            SendRequest::send(2)
                .sge(sge(&src, 0, mtu))
                .ud(&ah, rx.qp.qp_num(), QKEY),
        )
        .unwrap();
    let c = wait_one(&tx.scq, "the MTU-sized send");
    assert_eq!((c.wr_id, c.status), (2, WcStatus::Success));
    let c = wait_one(&rx.rcq, "the MTU-sized datagram");
    check_datagram(p, &c, 9, mtu, tx.qp.qp_num());
    assert_bytes(&image(&buf)[GRH_LEN..], &data, "an MTU-sized datagram");
}

/// UD takes SEND only, through an address handle; UC takes no READ or atomic.
pub(crate) fn refused_opcodes(p: &Provider) {
    if let Some(tx) = ud(p) {
        let mr = register(&tx.pd, 64, ALL);
        let r = raddr(&mr, 0);
        assert!(
            tx.qp
                .post_send(SendRequest::send(1).sge(sge(&mr, 0, 8)))
                .is_err(),
            "UD send without an address handle"
        );
        let ah = tx
            .pd
            .create_ah(&AhAttr::to_endpoint(&tx.qp.endpoint()))
            .unwrap();
        for req in [
            SendRequest::write(2, r),
            SendRequest::read(3, r),
            SendRequest::fetch_add(4, r, 1),
        ] {
            assert!(
                tx.qp
                    .post_send(req.sge(sge(&mr, 0, 8)).ud(&ah, 1, QKEY))
                    .is_err(),
                "{}: UD takes SEND only",
                p.name
            );
        }
        assert!(
            tx.qp.connect(tx.qp.endpoint(), &p.options()).is_err(),
            "UD does not connect"
        );
    }
    if let Some((a, b)) = uc_pair(p) {
        let mr = register(&a.pd, 64, ALL);
        let remote = register(&b.pd, 64, ALL);
        let r = raddr(&remote, 0);
        for req in [
            SendRequest::read(3, r),
            SendRequest::fetch_add(4, r, 1),
            SendRequest::compare_swap(5, r, 0, 1),
        ] {
            assert!(
                a.qp.post_send(req.sge(sge(&mr, 0, 8))).is_err(),
                "{}: UC takes no READ or atomic",
                p.name
            );
        }
        // The refusals changed nothing: a WRITE still goes.
        mr.write_at(0, &pattern(4, 64)).unwrap();
        a.qp.post_send(SendRequest::write(6, r).sge(sge(&mr, 0, 64)))
            .unwrap();
        let c = wait_one(&a.scq, "the UC WRITE after the refusals");
        assert_eq!((c.wr_id, c.status), (6, WcStatus::Success));
        // UC has no acknowledgement: the data is there once a later SEND is received.
        let buf = register(&b.pd, 8, LOCAL);
        b.qp.post_recv(RecvRequest::new(1).sge(sge(&buf, 0, 8)))
            .unwrap();
        a.qp.post_send(SendRequest::send(7).sge(sge(&mr, 0, 8)))
            .unwrap();
        wait_one(&b.rcq, "the SEND after the WRITE");
        assert_bytes(&image(&remote), &pattern(4, 64), "the UC WRITE's data");
    }
}

/// Multicast: one SEND to a group reaches every attached QP; a detached QP gets nothing.
/// On RoCE the host also holds an IP-level membership of the group, as applications do
/// there (Soft-RoCE delivers nothing without it; see `QueuePair::attach_mcast`).
pub(crate) fn ud_multicast(p: &Provider) {
    let Some(tx) = ud(p) else { return };
    let caps = tx.pd.context().capabilities().clone();
    // RoCEv2 over IPv4 (a context whose GID maps an IPv4 address) joins IPv4 groups. The
    // group is this test's own (named after the sender's QPN): other tests of the host may
    // be sending to theirs at the same time.
    let [_, x, y, z] = tx.qp.qp_num().to_be_bytes();
    let iface = AhAttr::to_endpoint(&tx.qp.endpoint()).dgid.to_ipv4_mapped();
    let group: Ipv6Addr = match iface {
        Some(_) => std::net::Ipv4Addr::new(239, x, y, z).to_ipv6_mapped(),
        None => Ipv6Addr::new(
            0xff0e,
            0,
            0,
            0,
            0,
            0,
            u16::from(x),
            u16::from_be_bytes([y, z]),
        ),
    };
    // What an application on RoCE does besides attaching (rdma_cm's rdma_join_multicast
    // does it for it): the host joins the group at the IP level on the device's interface.
    // Soft-RoCE needs it (see `QueuePair::attach_mcast`); where the provider joins by
    // itself, one more membership changes nothing.
    let _membership = iface.and_then(|ip| {
        let s = std::net::UdpSocket::bind((ip, 0)).ok()?;
        s.join_multicast_v4(&std::net::Ipv4Addr::new(239, x, y, z), &ip)
            .ok()?;
        Some(s)
    });
    let members: Vec<Ep> = (0..3).filter_map(|_| ud(p)).collect();
    if !caps.multicast {
        assert!(
            members[0].qp.attach_mcast(group, 0).is_err(),
            "{}: multicast the capabilities deny",
            p.name
        );
        return;
    }
    let len = 100;
    let src = register(&tx.pd, len, ALL);
    let bufs: Vec<_> = members
        .iter()
        .map(|m| {
            m.qp.attach_mcast(group, 0).unwrap();
            let b = register(&m.pd, 2 * (GRH_LEN + len), LOCAL);
            for i in 0..2 {
                m.qp.post_recv(RecvRequest::new(i).sge(sge(
                    &b,
                    i as usize * (GRH_LEN + len),
                    GRH_LEN + len,
                )))
                .unwrap();
            }
            b
        })
        .collect();
    let ah = tx.pd.create_ah(&AhAttr::multicast(group)).unwrap();
    src.write_at(0, &pattern(5, len)).unwrap();
    tx.qp
        .post_send(
            SendRequest::send(1)
                .sge(sge(&src, 0, len))
                .ud(&ah, MULTICAST_QPN, QKEY),
        )
        .unwrap();
    wait_one(&tx.scq, "the multicast send");
    for (m, b) in members.iter().zip(&bufs) {
        let c = wait_one(&m.rcq, "the multicast datagram at every member");
        check_datagram(p, &c, 0, len, tx.qp.qp_num());
        assert_bytes(
            &image(b)[GRH_LEN..GRH_LEN + len],
            &pattern(5, len),
            "the multicast payload",
        );
        if c.grh {
            assert_eq!(
                grh_dgid(&image(b)[..GRH_LEN]),
                group,
                "the GRH names the group"
            );
        }
    }
    // The last member leaves; the next datagram reaches the other two only.
    members[2].qp.detach_mcast(group, 0).unwrap();
    src.write_at(0, &pattern(6, len)).unwrap();
    tx.qp
        .post_send(
            SendRequest::send(2)
                .sge(sge(&src, 0, len))
                .ud(&ah, MULTICAST_QPN, QKEY),
        )
        .unwrap();
    wait_one(&tx.scq, "the second multicast send");
    for m in &members[..2] {
        let c = wait_one(&m.rcq, "the second multicast datagram");
        assert_eq!(c.wr_id, 1);
    }
    // The detached member's second receive takes the next unicast datagram, so the group
    // datagram never reached it.
    let uni = tx
        .pd
        .create_ah(&AhAttr::to_endpoint(&members[2].qp.endpoint()))
        .unwrap();
    tx.qp
        .post_send(SendRequest::send(3).sge(sge(&src, 0, len)).ud(
            &uni,
            members[2].qp.qp_num(),
            QKEY,
        ))
        .unwrap();
    let c = wait_one(
        &members[2].rcq,
        "the unicast datagram at the detached member",
    );
    assert_eq!(
        c.wr_id, 1,
        "{}: the detached member got no group datagram",
        p.name
    );
    // A member dropped while still in the group leaves it with its queue pair: a group
    // datagram sent after reaches the member that stays, and nothing lands where the
    // dropped one had a receive posted.
    for (m, b) in members[..2].iter().zip(&bufs) {
        m.qp.post_recv(RecvRequest::new(9).sge(sge(b, 0, GRH_LEN + len)))
            .unwrap();
    }
    let before = image(&bufs[0]);
    let mut members = members;
    drop(members.remove(0));
    src.write_at(0, &pattern(7, len)).unwrap();
    tx.qp
        .post_send(
            SendRequest::send(4)
                .sge(sge(&src, 0, len))
                .ud(&ah, MULTICAST_QPN, QKEY),
        )
        .unwrap();
    wait_one(&tx.scq, "the third multicast send");
    let c = wait_one(&members[0].rcq, "the third multicast datagram");
    assert_eq!(c.wr_id, 9);
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert_bytes(
        &image(&bufs[0]),
        &before,
        &format!("{}: the buffer of a member dropped in the group", p.name),
    );
}

/// Many datagrams from several senders: every one arrives once, in whatever order.
pub(crate) fn ud_unordered_delivery(p: &Provider) {
    let Some(rx) = ud(p) else { return };
    let senders: Vec<Ep> = (0..2).filter_map(|_| ud(p)).collect();
    let n = 32usize;
    let len = 32;
    let buf = register(&rx.pd, 2 * n * (GRH_LEN + len), LOCAL);
    for i in 0..2 * n {
        rx.qp
            .post_recv(RecvRequest::new(i as u64).sge(sge(
                &buf,
                i * (GRH_LEN + len),
                GRH_LEN + len,
            )))
            .unwrap();
    }
    for (s_i, s) in senders.iter().enumerate() {
        let src = register(&s.pd, n * len, ALL);
        let ah =
            s.pd.create_ah(&AhAttr::to_endpoint(&rx.qp.endpoint()))
                .unwrap();
        for k in 0..n {
            let tag = (s_i * n + k) as u64;
            src.write_at(k * len, &pattern(tag, len)).unwrap();
            s.qp.post_send(SendRequest::send(tag).sge(sge(&src, k * len, len)).ud(
                &ah,
                rx.qp.qp_num(),
                QKEY,
            ))
            .unwrap();
        }
        wait_n(&s.scq, n, "the sends");
    }
    let cs = wait_n(&rx.rcq, 2 * n, "every datagram");
    let img = image(&buf);
    let mut seen: Vec<u64> = cs
        .iter()
        .map(|c| {
            assert_eq!(c.status, WcStatus::Success);
            let at = c.wr_id as usize * (GRH_LEN + len) + GRH_LEN;
            let got = &img[at..at + len];
            (0..2 * n as u64)
                .find(|&t| pattern(t, len) == got)
                .expect("every datagram is one that was sent")
        })
        .collect();
    seen.sort_unstable();
    assert_eq!(
        seen,
        (0..2 * n as u64).collect::<Vec<_>>(),
        "each datagram exactly once"
    );
}

/// UC without loss: multi-packet SENDs and WRITEs, with and without immediate data.
pub(crate) fn uc_send_and_write(p: &Provider) {
    let Some((a, b)) = uc_pair(p) else { return };
    let len = 3 * p.mtu_bytes() + 17;
    let src = register(&a.pd, len, ALL);
    let data = pattern(11, len);
    src.write_at(0, &data).unwrap();
    let target = register(&b.pd, len, ALL);
    let rbuf = register(&b.pd, len, LOCAL);
    for i in 0..3 {
        b.qp.post_recv(RecvRequest::new(i).sge(sge(&rbuf, 0, len)))
            .unwrap();
    }
    a.qp.post_send(SendRequest::send(1).sge(sge(&src, 0, len)))
        .unwrap();
    let c = wait_one(&b.rcq, "a UC SEND");
    assert_eq!(
        (c.wr_id, c.status, c.byte_len as usize),
        (0, WcStatus::Success, len)
    );
    assert_bytes(&image(&rbuf), &data, "the UC SEND");
    a.qp.post_send(SendRequest::send_with_imm(2, 0xabcd).sge(sge(&src, 0, 5)))
        .unwrap();
    let c = wait_one(&b.rcq, "a UC SEND with immediate");
    assert_eq!((c.wr_id, c.imm_data, c.byte_len), (1, Some(0xabcd), 5));
    a.qp.post_send(SendRequest::write_with_imm(3, raddr(&target, 0), 0x77).sge(sge(&src, 0, len)))
        .unwrap();
    let c = wait_one(&b.rcq, "a UC WRITE with immediate");
    assert_eq!(
        (c.wr_id, c.opcode, c.imm_data),
        (2, WcOpcode::RecvRdmaWithImm, Some(0x77))
    );
    assert_bytes(&image(&target), &data, "the UC WRITE");
    let cs = wait_n(&a.scq, 3, "the UC sender's completions");
    assert!(cs.iter().all(|c| c.status == WcStatus::Success));
    let _ = b.scq;
}

/// A UC WRITE with immediate data of 40 packets: a provider that keeps a send window
/// (udp, 16 packets in its small-MTU run) lets UC packets past it, since UC gets no
/// acknowledgement that would move it; the message lands whole and both sides complete.
pub(crate) fn uc_messages_span_more_than_a_send_window(p: &Provider) {
    let Some((a, b)) = uc_pair(p) else { return };
    let len = 40 * p.mtu_bytes();
    let src = register(&a.pd, len, ALL);
    let data = pattern(12, len);
    src.write_at(0, &data).unwrap();
    let target = register(&b.pd, len, ALL);
    let rbuf = register(&b.pd, 8, LOCAL);
    b.qp.post_recv(RecvRequest::new(9).sge(sge(&rbuf, 0, 8)))
        .unwrap();
    a.qp.post_send(SendRequest::write_with_imm(4, raddr(&target, 0), 0x55).sge(sge(&src, 0, len)))
        .unwrap();
    let c = wait_one(&a.scq, "the UC WRITE's completion");
    assert_eq!((c.wr_id, c.status), (4, WcStatus::Success));
    let c = wait_one(&b.rcq, "the UC WRITE with immediate");
    assert_eq!(
        (c.wr_id, c.status, c.imm_data),
        (9, WcStatus::Success, Some(0x55))
    );
    assert_bytes(&image(&target), &data, "the UC WRITE");
}

/// UD queue pairs that take their receives from one shared receive queue: datagrams to
/// either land in the SRQ's receives, and a dropped one (wrong Q_Key) takes none.
pub(crate) fn ud_with_a_shared_receive_queue(p: &Provider) {
    let Some(tx) = ud(p) else { return };
    let ctx = p.open();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(64).unwrap();
    let srq = pd.create_srq(16, 1).unwrap();
    let rx: Vec<QueuePair> = (0..2)
        .map(|_| {
            let q = pd
                .create_qp_of_type(QpType::Ud, &cq, &cq, Some(&srq), QpCaps::default())
                .unwrap();
            q.activate(QKEY).unwrap();
            q
        })
        .collect();
    let len = 48;
    let buf = register(&pd, 3 * (GRH_LEN + len), LOCAL);
    for i in 0..3 {
        srq.post_recv(RecvRequest::new(i as u64).sge(sge(
            &buf,
            i * (GRH_LEN + len),
            GRH_LEN + len,
        )))
        .unwrap();
    }
    let src = register(&tx.pd, len, ALL);
    src.write_at(0, &pattern(8, len)).unwrap();
    let sends = [(&rx[0], QKEY ^ 2), (&rx[0], QKEY), (&rx[1], QKEY)];
    for (k, (q, qkey)) in sends.iter().enumerate() {
        let ah = tx
            .pd
            .create_ah(&AhAttr::to_endpoint(&q.endpoint()))
            .unwrap();
        tx.qp
            .post_send(SendRequest::send(k as u64).sge(sge(&src, 0, len)).ud(
                &ah,
                q.qp_num(),
                *qkey,
            ))
            .unwrap();
    }
    wait_n(&tx.scq, 3, "the sends");
    let cs = wait_n(&cq, 2, "the two datagrams with the right Q_Key");
    let mut by_qp: Vec<(u32, u64)> = cs.iter().map(|c| (c.qp_num, c.wr_id)).collect();
    by_qp.sort_unstable();
    let mut want = vec![(rx[0].qp_num(), 0), (rx[1].qp_num(), 1)];
    want.sort_unstable();
    assert_eq!(
        by_qp, want,
        "{}: receives 0 and 1 of the SRQ, in order",
        p.name
    );
    assert_eq!(srq.len(), 1, "the dropped datagram took no receive");
    assert_quiet(&cq, "no third datagram");
}

/// `e`'s receive 7 completed in error (any status but success and a flush), the QP went
/// to ERR, and receive 8 behind it was flushed.
fn failed_then_flushed(e: &Ep, what: &str) {
    let cs = wait_n(&e.rcq, 2, what);
    assert_eq!(cs[0].wr_id, 7, "{what}: {cs:?}");
    assert!(
        !matches!(cs[0].status, WcStatus::Success | WcStatus::WrFlushErr),
        "{what}: {cs:?}"
    );
    assert_eq!(
        (cs[1].wr_id, cs[1].status),
        (8, WcStatus::WrFlushErr),
        "{what}: {cs:?}"
    );
    assert_eq!(e.qp.state(), QpState::Err, "{what}");
}

/// A receive that fails (its lkey names a deregistered region) fails a UD or UC queue
/// pair as it does an RC one: the receive completes in error, the QP goes to ERR, and
/// the receive behind it is flushed rather than filled by the next message.
pub(crate) fn receives_in_error_fail_ud_and_uc_qps(p: &Provider) {
    let Some(tx) = ud(p) else { return };
    let Some(rx) = ud(p) else { return };
    let len = 48;
    let stale_buf = register(&rx.pd, GRH_LEN + len, LOCAL);
    let stale = sge(&stale_buf, 0, GRH_LEN + len);
    stale_buf.deregister();
    let good = register(&rx.pd, GRH_LEN + len, LOCAL);
    rx.qp.post_recv(RecvRequest::new(7).sge(stale)).unwrap();
    rx.qp
        .post_recv(RecvRequest::new(8).sge(sge(&good, 0, GRH_LEN + len)))
        .unwrap();
    let src = register(&tx.pd, len, ALL);
    let ah = tx
        .pd
        .create_ah(&AhAttr::to_endpoint(&rx.qp.endpoint()))
        .unwrap();
    for k in 0..2 {
        tx.qp
            .post_send(
                SendRequest::send(k)
                    .sge(sge(&src, 0, len))
                    .ud(&ah, rx.qp.qp_num(), QKEY),
            )
            .unwrap();
    }
    wait_n(&tx.scq, 2, "the UD sends");
    let what = format!("{}: UD receive with a stale lkey", p.name);
    failed_then_flushed(&rx, &what);

    let Some((a, b)) = uc_pair(p) else { return };
    let what = format!("{}: UC receive with a stale lkey", p.name);
    let stale_buf = register(&b.pd, 64, LOCAL);
    let stale = sge(&stale_buf, 0, 64);
    stale_buf.deregister();
    let good = register(&b.pd, 64, LOCAL);
    b.qp.post_recv(RecvRequest::new(7).sge(stale)).unwrap();
    b.qp.post_recv(RecvRequest::new(8).sge(sge(&good, 0, 64)))
        .unwrap();
    let src = register(&a.pd, 64, ALL);
    for k in 0..2 {
        a.qp.post_send(SendRequest::send(k).sge(sge(&src, 0, 64)))
            .unwrap();
    }
    wait_n(&a.scq, 2, "the UC sends");
    failed_then_flushed(&b, &what);
}

/// The limit of a shared receive queue counts the receives messages consume: a datagram
/// too long for the receive it was offered, dropped with the receive left posted, fires
/// no limit event; the next that takes one does. (Where drops are not counted, verbs,
/// the adapter's handling of the long datagram cannot be told apart: skipped.)
pub(crate) fn srq_limit_counts_consumed_receives_only(p: &Provider) {
    let Some(tx) = ud(p) else { return };
    let ctx = p.open();
    if !ctx.capabilities().counts_dropped {
        eprintln!("{}: drops are not counted; skipped", p.name);
        return;
    }
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(64).unwrap();
    let srq = pd.create_srq(16, 1).unwrap();
    let rx = pd
        .create_qp_of_type(QpType::Ud, &cq, &cq, Some(&srq), QpCaps::default())
        .unwrap();
    rx.activate(QKEY).unwrap();
    let len = 48;
    let buf = register(&pd, 2 * (GRH_LEN + len), LOCAL);
    for i in 0..2 {
        srq.post_recv(RecvRequest::new(i as u64).sge(sge(
            &buf,
            i * (GRH_LEN + len),
            GRH_LEN + len,
        )))
        .unwrap();
    }
    srq.arm_limit(2).unwrap();
    let src = register(&tx.pd, 100, ALL);
    let ah = tx
        .pd
        .create_ah(&AhAttr::to_endpoint(&rx.endpoint()))
        .unwrap();
    let what = format!("{}: SRQ limit", p.name);
    let before = rx.dropped().unwrap();
    tx.qp
        .post_send(
            SendRequest::send(1)
                .sge(sge(&src, 0, 100))
                .ud(&ah, rx.qp_num(), QKEY),
        )
        .unwrap();
    let start = std::time::Instant::now();
    while rx.dropped().unwrap() == before {
        assert!(
            start.elapsed() < super::DEADLINE,
            "{what}: the long datagram was not dropped"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(srq.len(), 2, "{what}: the dropped datagram took a receive");
    assert!(
        !srq.limit_reached(),
        "{what}: an event for a receive not consumed"
    );
    tx.qp
        .post_send(
            SendRequest::send(2)
                .sge(sge(&src, 0, len))
                .ud(&ah, rx.qp_num(), QKEY),
        )
        .unwrap();
    let c = wait_one(&cq, &what);
    assert_eq!((c.wr_id, c.status), (0, WcStatus::Success), "{what}: {c:?}");
    assert_eq!(srq.len(), 1, "{what}");
    assert!(srq.limit_reached(), "{what}: no event below the limit");
    wait_n(&tx.scq, 2, "the UD sends");
}
