//! A udp queue pair's peer: given before RTR (a QP without one is refused RTR), and kept
//! once connected (`connect` or `bind_peer` naming another peer is refused, and the QP
//! goes on with its own). In a binary of its own: `hostile_udp` measures its memory.

use rdmx::{QpAttr, QpAttrMask, QpState};

mod common;

use common::udp_pair::{opts, pair, side, write_works};

#[test]
fn a_connect_to_another_peer_leaves_a_live_queue_pair_on_its_own() {
    // A connected QP given another peer by mistake (`connect`, or `bind_peer`): refused,
    // and the QP still sends to, and takes packets from, the peer it connected to
    // (before, `bind_peer` redirected it at once and the move to INIT was refused after).
    let (a, b) = pair(28791);
    let c = side("127.1.0.3:28791");
    assert!(a.qp.connect(c.qp.endpoint(), &opts()).is_err());
    assert!(a.qp.bind_peer(&c.qp.endpoint()).is_err());
    assert_eq!(a.qp.state(), QpState::Rts);
    write_works(&a, &b, 3);
    write_works(&b, &a, 4);
}

#[test]
fn a_queue_pair_without_its_peer_is_refused_rtr() {
    // Moved to RTR by hand with no `bind_peer`: refused (before, it went, sent every
    // packet nowhere, completed UC sends with success, and dropped all that came).
    let a = side("127.1.0.4:29791");
    let b = side("127.1.0.5:29791");
    let init = QpAttr {
        qp_state: QpState::Init,
        pkey_index: 0,
        port_num: 1,
        qp_access_flags: rdmx::Access::ALL,
        ..QpAttr::default()
    };
    a.qp.modify(
        &init,
        QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
    )
    .expect("RESET to INIT");
    let peer = b.qp.endpoint();
    let rtr = QpAttr {
        qp_state: QpState::Rtr,
        path_mtu: rdmx::Mtu::Mtu1024,
        dest_qp_num: peer.qp_num,
        rq_psn: peer.psn,
        max_dest_rd_atomic: 1,
        min_rnr_timer: 12,
        ..init.clone()
    };
    let mask = QpAttrMask::STATE
        | QpAttrMask::AV
        | QpAttrMask::PATH_MTU
        | QpAttrMask::DEST_QPN
        | QpAttrMask::RQ_PSN
        | QpAttrMask::MAX_DEST_RD_ATOMIC
        | QpAttrMask::MIN_RNR_TIMER;
    let e = a.qp.modify(&rtr, mask).expect_err("RTR without a peer");
    assert!(e.to_string().contains("bind_peer"), "{e}");
    assert_eq!(a.qp.state(), QpState::Init);
    // Named, it goes.
    a.qp.bind_peer(&peer).expect("bind_peer");
    a.qp.modify(&rtr, mask).expect("INIT to RTR");
    assert_eq!(a.qp.state(), QpState::Rtr);
}
