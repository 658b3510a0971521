//! The UD receive path fed arbitrary datagrams.
//!
//! A UD `RcQp` in RTS with a Q_Key, over checked memory (`rdmx_fuzz::FakeMem`): region 0
//! holds receive buffers, region 1 (read-only to the QP's peers, never a receive) must
//! never change. Each step is a datagram (raw bytes, or a well-formed UD SEND whose Q_Key,
//! destination QP, immediate and length come from the input, possibly truncated or with a
//! bit flipped), a posted receive of arbitrary size, or a poll.
//!
//! Checked: no panic; memory is touched only through handles the engine resolved
//! (`FakeMem`); region 1 and the guard bytes never change; a receive completes at most
//! once and only if posted; a successful datagram had the QP's Q_Key and QP number (or the
//! multicast QPN), fits its receive (GRH area included) and its bytes after the GRH area
//! are the payload sent; whatever is not delivered is counted as dropped.
#![no_main]

use std::collections::HashMap;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use rdmx_core::rc::{DatagramInfo, MemAccess, QpConfig, RcQp};
use rdmx_core::{
    Access, PdId, QpLimits, QpType, RecvWr, Sge, SgeList, WcStatus, GRH_LEN, MULTICAST_QPN,
};
use rdmx_fuzz::*;
use rdmx_wire::{DethRepr, UdRepr};

const QKEY: u32 = 0x1234_5678;
const MAX_STEPS: usize = 300;

#[derive(Arbitrary, Debug)]
enum Step {
    Raw(Vec<u8>),
    Datagram {
        right_qkey: bool,
        qkey: u32,
        dest: u8,
        imm: Option<u32>,
        len: u16,
        cut: Option<u16>,
        flip: Option<u16>,
    },
    Recv {
        len: u16,
    },
    Poll,
}

/// Records `bytes` as acceptable if it is a UD SEND with the QP's Q_Key and number.
fn note(bytes: &[u8], acceptable: &mut Vec<(Vec<u8>, u32)>) {
    if let Ok(p) = UdRepr::parse_bytes(bytes) {
        if p.deth.qkey == QKEY && (p.dest_qpn == QPN || p.dest_qpn == MULTICAST_QPN) {
            acceptable.push((p.payload.to_vec(), p.deth.src_qpn));
        }
    }
}

fuzz_target!(|steps: Vec<Step>| {
    let mem = FakeMem::new(&[
        (PdId(1), 64 * 1024, Access::LOCAL_WRITE),
        (PdId(1), 256, Access::REMOTE_READ),
    ]);
    let mut cfg = QpConfig::new(QPN, PdId(1));
    cfg.qp_type = QpType::Ud;
    cfg.max_recv_wr = 64;
    let mut qp = RcQp::new(cfg, QpLimits::default());
    for (attr, mask) in rdmx_core::ud_steps(QKEY, 0) {
        qp.modify(&attr, mask).expect("the UD steps are valid");
    }
    let lkey = mem.regions[0].lkey;
    let base = mem.regions[0].addr;
    let mut next_off = 0u64;
    let mut posted: HashMap<u64, u64> = HashMap::new();
    let mut wr_id = 0u64;
    let info = DatagramInfo::default();
    // Datagrams the QP may accept: payload and source QP.
    let mut acceptable: Vec<(Vec<u8>, u32)> = Vec::new();
    for step in steps.into_iter().take(MAX_STEPS) {
        match step {
            Step::Raw(bytes) => {
                note(&bytes, &mut acceptable);
                qp.handle_datagram(&mem, None, &info, &bytes);
            }
            Step::Datagram { right_qkey, qkey, dest, imm, len, cut, flip } => {
                let len = usize::from(len % 5000);
                let payload: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(7)).collect();
                let dest_qpn = match dest % 3 {
                    0 => QPN,
                    1 => MULTICAST_QPN,
                    _ => u32::from(dest),
                };
                let repr = UdRepr {
                    dest_qpn,
                    psn: 0,
                    solicited: false,
                    pkey: 0xffff,
                    deth: DethRepr { qkey: if right_qkey { QKEY } else { qkey }, src_qpn: PEER_QPN },
                    imm,
                    payload: &[],
                };
                let mut out = Vec::new();
                let pad = repr.emit_header(len, &mut out);
                out.extend_from_slice(&payload);
                out.resize(out.len() + usize::from(pad), 0);
                if let Some(c) = cut {
                    out.truncate(usize::from(c) % (out.len() + 1));
                }
                if let Some(f) = flip {
                    if !out.is_empty() {
                        let bit = usize::from(f) % (out.len() * 8);
                        out[bit / 8] ^= 1 << (bit % 8);
                    }
                }
                note(&out, &mut acceptable);
                qp.handle_datagram(&mem, None, &info, &out);
            }
            Step::Recv { len } => {
                let len = u64::from(len % 6000);
                if next_off + len > 64 * 1024 {
                    continue;
                }
                let mut sges = SgeList::new();
                sges.push(Sge { addr: base + next_off, len: len as u32, lkey });
                if qp.post_recv(&mem, RecvWr { wr_id, sges }).is_ok() {
                    posted.insert(wr_id, next_off);
                }
                next_off += len;
                wr_id += 1;
            }
            Step::Poll => {}
        }
        while let Some((_, c, _)) = qp.poll_completion() {
            let off = posted.remove(&c.wr_id).expect("a completion of a posted receive, once");
            if c.status == WcStatus::Success {
                assert!(c.byte_len as usize >= GRH_LEN);
                let n = c.byte_len as usize - GRH_LEN;
                let mut got = vec![0u8; n];
                let h = Handle {
                    region: 0,
                    addr: base + off,
                    len: c.byte_len.into(),
                    need: Access::LOCAL_WRITE,
                    key_use: rdmx_core::KeyUse::Local,
                };
                mem.read(&h, base + off + GRH_LEN as u64, &mut got);
                assert!(
                    acceptable.iter().any(|(p, src)| *p == got && *src == c.src_qp),
                    "a delivered datagram is one with the QP's Q_Key and number"
                );
            }
        }
    }
    mem.check_intact(&[1]);
});
