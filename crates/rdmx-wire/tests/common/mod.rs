//! Helpers shared by the integration tests.
#![allow(dead_code)]

use rdmx_wire::{
    pad_for, AethRepr, AtomicAckEthRepr, AtomicEthRepr, BthRepr, Credits, IethRepr, ImmDtRepr,
    Opcode, RcRepr, RethRepr, Syndrome,
};

/// A tiny xorshift64* PRNG so the tests need no dependency.
pub(crate) struct XorShift(u64);

impl XorShift {
    pub(crate) fn new(seed: u64) -> Self {
        XorShift(seed | 1)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    pub(crate) fn byte(&mut self) -> u8 {
        self.next_u64() as u8
    }

    pub(crate) fn bool(&mut self) -> bool {
        self.next_u64() & 1 == 1
    }

    pub(crate) fn fill(&mut self, buf: &mut [u8]) {
        for b in buf {
            *b = self.byte();
        }
    }
}

pub(crate) fn bth(opcode: Opcode, payload_len: usize) -> BthRepr {
    BthRepr {
        opcode,
        solicited: opcode.ends_message() && opcode.is_request(),
        migreq: true,
        pad_count: pad_for(payload_len),
        pkey: 0xFFFF,
        fecn: false,
        becn: false,
        dest_qpn: 0x00AB_CDEF,
        ack_req: opcode.ends_message() && opcode.is_request(),
        psn: 0x00FF_FFFE,
    }
}

/// A representation of `opcode` carrying every header it needs (with
/// distinctive field values) and `payload`.
pub(crate) fn sample_repr(opcode: Opcode, payload: &[u8]) -> RcRepr<'_> {
    let mut r = RcRepr::new(bth(opcode, payload.len()));
    if opcode.has_reth() {
        r.reth = Some(RethRepr {
            va: 0x0000_7FFF_DEAD_B000,
            rkey: 0x1234_5678,
            dma_len: 0x0001_0000,
        });
    }
    if opcode.has_atomic_eth() {
        r.atomic_eth = Some(AtomicEthRepr {
            va: 0x0000_7FFF_0000_0008,
            rkey: 0x8765_4321,
            swap_add: 0x0102_0304_0506_0708,
            compare: 0x1112_1314_1516_1718,
        });
    }
    if opcode.has_aeth() {
        r.aeth = Some(AethRepr {
            syndrome: Syndrome::Ack {
                credits: Credits::from_count(64),
            },
            msn: 0x00C0_FFEE,
        });
    }
    if opcode.has_atomic_ack_eth() {
        r.atomic_ack_eth = Some(AtomicAckEthRepr {
            orig_data: 0xA1A2_A3A4_A5A6_A7A8,
        });
    }
    if opcode.has_immdt() {
        r.immdt = Some(ImmDtRepr { imm: 0xDEAD_BEEF });
    }
    if opcode.has_ieth() {
        r.ieth = Some(IethRepr { rkey: 0x0BAD_CAFE });
    }
    r.payload = payload;
    r
}

/// Payload lengths that are legal for `opcode`.
pub(crate) fn legal_payload_lens(opcode: Opcode) -> Vec<usize> {
    if !opcode.has_payload() {
        vec![0]
    } else if opcode.is_first() || opcode.is_middle() {
        vec![0, 4, 8, 256, 1024]
    } else {
        vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 13, 255, 256, 4096]
    }
}
