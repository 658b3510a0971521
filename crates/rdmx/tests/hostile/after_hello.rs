//! A peer that sent a valid hello, then breaks the protocol: bad length prefixes,
//! unknown opcodes, reserved syndromes, random bytes, truncated frames, wrong PSNs and
//! forged rkeys.

use super::*;

/// Sends `bytes` after the hello and expects the stream closed for a protocol violation.
fn protocol_violation(bytes: &[u8], reason: &str) {
    protocol_violation_to(|_| bytes.to_vec(), reason)
}

/// Like [`protocol_violation`], with bytes made for the victim's QP number.
fn protocol_violation_to(make: impl FnOnce(u32) -> Vec<u8>, reason: &str) {
    let mut srv = Server::new();
    let v = srv.victim();
    let mut s = srv.dial(&v);
    s.write_all(&make(v.qp.qp_num()))
        .expect("send the hostile bytes");
    wait_closed(&mut s);
    let qpn = format!("qpn={}", v.qp.qp_num());
    wait_logged(
        "WARN",
        &["closing the connection", "protocol violation", reason, &qpn],
    );
    srv.check_after(&v);
}

#[test]
fn zero_length_prefix() {
    let _running = memory::beside();
    protocol_violation(
        &[0, 0, 0, 0, 0x0A, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        "frame of 0 bytes",
    );
}

#[test]
fn oversized_length_prefix() {
    let _running = memory::beside();
    let mut f = write_frame(1, FAKE_PSN, 0, 0, &[0; 16]);
    f[..4].copy_from_slice(&u32::MAX.to_be_bytes());
    protocol_violation(&f, "frame of 4294967295 bytes");
}

#[test]
fn length_prefix_one_past_the_largest_frame() {
    let _running = memory::beside();
    // 128 bytes of headers plus the largest path MTU (1 MiB) is the most a frame may be.
    let mut f = write_frame(1, FAKE_PSN, 0, 0, &[0; 16]);
    f[..4].copy_from_slice(&(128u32 + (1 << 20) + 1).to_be_bytes());
    protocol_violation(&f, "at most");
}

#[test]
fn length_prefix_shorter_than_the_headers() {
    let _running = memory::beside();
    let mut f = write_frame(1, FAKE_PSN, 0, 0, &[0; 16]);
    f[..4].copy_from_slice(&20u32.to_be_bytes()); // WRITE ONLY has 28 bytes of headers
    protocol_violation(&f, "frame of 20 bytes");
}

#[test]
fn invalid_opcode() {
    let _running = memory::beside();
    let mut f = write_frame(1, FAKE_PSN, 0, 0, &[0; 16]);
    f[4] = 0x1F; // reserved in the RC opcode space
    protocol_violation(&f, "unknown opcode 0x1f");
}

#[test]
fn reserved_aeth_syndrome() {
    let _running = memory::beside();
    // An ACK whose AETH syndrome uses the reserved type (binary 10): headers the engine
    // cannot parse.
    protocol_violation_to(
        |qpn| {
            let mut f = vec![0u8; 4 + 12 + 4];
            f[..4].copy_from_slice(&16u32.to_be_bytes());
            f[4] = Opcode::Acknowledge.as_u8();
            f[6..8].copy_from_slice(&0xffffu16.to_be_bytes());
            f[8..12].copy_from_slice(&qpn.to_be_bytes());
            f[16] = 0b0100_0000;
            f
        },
        "malformed or unsupported packet headers",
    );
}

#[test]
fn random_bytes_after_the_hello() {
    let _running = memory::beside();
    // Random streams mostly fail the opcode or length check at once; some parse as
    // frames and go to the engine. Either way the server must close the stream or keep
    // it consistent, never panic, and never touch memory the stream had no key for.
    let mut srv = Server::new();
    for seed in 1..=24u64 {
        let v = srv.victim();
        let mut s = srv.dial(&v);
        let len = 1 + (seed as usize * 977) % 6000;
        let _ = s.write_all(&noise(seed, len));
        // Close our side: whatever was left unparsed becomes a truncated frame.
        let _ = s.shutdown(std::net::Shutdown::Write);
        wait_closed(&mut s);
        wait_state(&v.qp, QpState::Err);
        assert_image(
            &image(&v.mr),
            &v.before,
            &format!("seed {seed}: the victim's memory"),
        );
    }
    srv.check_healthy();
}

#[test]
fn truncated_frame_then_close() {
    let _running = memory::beside();
    let mut srv = Server::new();
    // With a valid rkey the engine names where the payload goes and the stream reads it
    // straight there, so the bytes that arrived may be placed: the peer had the right to
    // write them (as with a WRITE that fails part-way on an adapter). Nothing else changes.
    let v = srv.victim();
    let mut s = srv.dial(&v);
    let f = write_frame(
        v.qp.qp_num(),
        FAKE_PSN,
        v.mr.addr() as u64,
        v.mr.rkey(),
        &[0xEE; 256],
    );
    s.write_all(&f[..f.len() - 128])
        .expect("send part of a frame");
    s.shutdown(std::net::Shutdown::Write).expect("shutdown");
    wait_closed(&mut s);
    wait_state(&v.qp, QpState::Err);
    let c = wait_one(&v.cq, "the victim's receive");
    assert_eq!((c.wr_id, c.status), (77, WcStatus::WrFlushErr), "{c:?}");
    let now = image(&v.mr);
    let k = now.iter().take_while(|&&b| b == 0xEE).count().min(128);
    let mut want = v.before.clone();
    want[..k].fill(0xEE);
    assert_image(
        &now,
        &want,
        "only a prefix of the truncated payload may be placed",
    );
    wait_logged(
        "DEBUG",
        &["connection closed", &format!("qpn={}", v.qp.qp_num())],
    );

    // With a forged rkey nothing is placed, whole or truncated.
    let v = srv.victim();
    let mut s = srv.dial(&v);
    let f = write_frame(
        v.qp.qp_num(),
        FAKE_PSN,
        v.mr.addr() as u64,
        v.mr.rkey() ^ 0x80,
        &[0xEE; 256],
    );
    s.write_all(&f[..f.len() - 128])
        .expect("send part of a frame");
    s.shutdown(std::net::Shutdown::Write).expect("shutdown");
    wait_closed(&mut s);
    srv.check_after(&v);
}

#[test]
fn wrong_psn_is_nakked_and_never_placed() {
    let _running = memory::beside();
    let mut srv = Server::new();
    let v = srv.victim();
    let mut s = srv.dial(&v);
    // PSNs ahead of the expected one: a sequence error, NAKed once, nothing placed.
    for d in [1u32, 2, 1000, 0x7f_ffff] {
        let psn = (FAKE_PSN + d) & 0xff_ffff;
        s.write_all(&write_frame(
            v.qp.qp_num(),
            psn,
            v.mr.addr() as u64,
            v.mr.rkey(),
            &[0xEE; 64],
        ))
        .expect("send");
    }
    let p = read_frame(&mut s);
    assert_eq!(nak_of(&p), Some(NakCode::PsnSequenceError));
    // A PSN behind the expected one is a duplicate: acknowledged, not executed again
    // (there was no first execution, so nothing changes).
    let behind = (FAKE_PSN + 0xff_ffff) & 0xff_ffff;
    s.write_all(&write_frame(
        v.qp.qp_num(),
        behind,
        v.mr.addr() as u64,
        v.mr.rkey(),
        &[0xEE; 64],
    ))
    .expect("send");
    // The expected PSN then works: the stream is still usable.
    let good = pattern(9, 64);
    s.write_all(&write_frame(
        v.qp.qp_num(),
        FAKE_PSN,
        v.mr.addr() as u64 + 64,
        v.mr.rkey(),
        &good,
    ))
    .expect("send");
    let start = Instant::now();
    loop {
        let p = read_frame(&mut s);
        if nak_of(&p).is_none() && RcRepr::parse_bytes(&p).expect("parsed").bth.psn == FAKE_PSN {
            break;
        }
        assert!(start.elapsed() < DEADLINE, "no ACK for the expected PSN");
    }
    let mut want = v.before.clone();
    want[64..128].copy_from_slice(&good);
    assert_image(
        &image(&v.mr),
        &want,
        "only the in-sequence WRITE may change memory",
    );
    assert_eq!(v.qp.state(), QpState::Rts);
    srv.check_healthy();
}

#[test]
fn forged_rkeys_are_refused_with_memory_unchanged() {
    let _running = memory::beside();
    let mut srv = Server::new();
    // A region that was registered and deregistered: its rkey is stale.
    let stale = region(&srv.pd, 3);
    let stale_rkey = stale.rkey();
    let stale_addr = stale.addr() as u64;
    drop(stale);
    for (what, forge) in [
        ("a flipped variant bit", 0u32),
        ("a stale rkey", 1),
        ("the lkey of a local-only region", 2),
        ("random keys", 3),
    ] {
        let v = srv.victim();
        let local_only = srv
            .pd
            .register(vec![0u8; 64], Access::LOCAL_WRITE)
            .expect("register");
        let (va, rkey) = match forge {
            0 => (v.mr.addr() as u64, v.mr.rkey() ^ 0x1),
            1 => (stale_addr, stale_rkey),
            2 => (local_only.addr() as u64, local_only.lkey()),
            _ => (
                v.mr.addr() as u64,
                u32::from_le_bytes(noise(7, 4).try_into().unwrap()),
            ),
        };
        let mut s = srv.dial(&v);
        s.write_all(&write_frame(v.qp.qp_num(), FAKE_PSN, va, rkey, &[0xEE; 64]))
            .expect("send");
        let p = read_frame(&mut s);
        assert_eq!(nak_of(&p), Some(NakCode::RemoteAccessError), "{what}");
        // A remote access error is fatal for the responder's QP.
        wait_state(&v.qp, QpState::Err);
        let c = wait_one(&v.cq, "the victim's receive");
        assert_eq!(
            (c.wr_id, c.status),
            (77, WcStatus::WrFlushErr),
            "{what}: {c:?}"
        );
        assert_image(&image(&v.mr), &v.before, what);
        assert_image(&image(&local_only), &[0u8; 64], what);
    }
    srv.check_healthy();
}
