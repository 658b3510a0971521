//! The provider conformance suite (`tests/conformance/`) on the udp provider, both sides
//! in this process, each with its own context bound to its own loopback address on port
//! 4791 (127.0.0.1 and 127.0.0.2 for the first pair, 127.0.1.1 and 127.0.1.2 for the
//! next, ...), so every request crosses real UDP sockets as RoCEv2 datagrams with checked
//! ICRCs. `loss_udp` runs the loss-recovery tests (`faults.rs`) with the faults injected
//! at the sending socket: datagrams dropped, duplicated, reordered, delayed, corrupted
//! (then dropped by the receiver's ICRC check) or with mangled headers (resealed, so the
//! parsers must reject them).

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU32, Ordering};

use rdmx::loopback::faults::{FaultStats, Faults};
use rdmx::Context;

#[macro_use]
mod conformance;

#[path = "faults.rs"]
mod loss_udp;

/// Opens a udp context on the next free loopback address, port 4791.
fn open_udp(opts: rdmx::udp::Options) -> rdmx::Result<Context> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let mut last = None;
    for _ in 0..512 {
        let k = NEXT.fetch_add(1, Ordering::Relaxed) % 500;
        let ip = Ipv4Addr::new(127, 0, (k / 2) as u8, 1 + (k % 2) as u8);
        let addr = SocketAddr::from((ip, rdmx::udp::ROCE_PORT));
        match Context::open(opts.clone().bind(addr)) {
            Ok(c) => return Ok(c),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("tried"))
}

/// For `loss_udp`: a udp context with `faults`.
fn open_faulty(faults: Option<Faults>) -> Context {
    let mut o = rdmx::udp::Options::default();
    if let Some(f) = faults {
        o = o.faults(f);
    }
    open_udp(o).expect("open a udp context")
}

/// For `loss_udp`: what fault injection did.
fn fault_stats(ctx: &Context) -> Option<FaultStats> {
    rdmx::udp::fault_stats(ctx)
}

mod conformance_udp {
    use rdmx::Mtu;

    use crate::conformance::Provider;

    /// udp at its largest path MTU (4 KiB).
    const UDP: Provider = Provider {
        name: "udp",
        open: || crate::open_udp(rdmx::udp::Options::default()),
        mtu: Mtu::Mtu4096,
    };

    conformance_suite!(UDP);
}

mod conformance_udp_small_mtu {
    use rdmx::Mtu;

    use crate::conformance::Provider;

    /// udp at the smallest path MTU (256 bytes), with a small send window: messages span
    /// many datagrams and the window fills.
    const UDP_256: Provider = Provider {
        name: "udp",
        open: || {
            crate::open_udp(
                rdmx::udp::Options::default()
                    .max_mtu(Mtu::Mtu256)
                    .send_window(16),
            )
        },
        mtu: Mtu::Mtu256,
    };

    conformance_suite!(UDP_256);
}
