//! Engine tests over the deterministic two-endpoint harness in [`util`] (with simulated
//! memory in [`mem`] and links in [`link`]).
//!
//! - `basic`: every operation at the sizes around the MTU, several SGEs on both sides.
//! - `recovery`: scripted single drops, late and duplicated packets; `lossy`: random
//!   loss, duplication and reordering over mixed workloads.
//! - `failure`: retries exhausted, remote errors, destroying a queue pair; `rnr`: RNR
//!   waits and their exhaustion; `local`: local errors and post-time refusals; `window`:
//!   the send window and the timer of a message still going out.
//! - `semantics`: duplicates at the responder, sequence NAKs, ordering, FENCE, the
//!   read/atomic depth, selective signaling, credits; `drain`: SQ drain; `headers`: the
//!   headers on the wire.
//! - `flood`: a peer that sends requests and never takes the answers.

mod basic;
mod direct;
mod drain;
mod failure;
mod flood;
mod headers;
mod link;
mod local;
mod lossy;
mod mem;
mod recovery;
mod rewind;
mod rnr;
mod semantics;
mod util;
mod window;

use util::{Pair, PairConfig, Rng};

#[test]
fn harness_rng_is_deterministic_and_spread() {
    let mut a = Rng::new(7);
    let mut b = Rng::new(7);
    let xs: Vec<u64> = (0..100).map(|_| a.next_u64()).collect();
    let ys: Vec<u64> = (0..100).map(|_| b.next_u64()).collect();
    assert_eq!(xs, ys);
    let mut c = Rng::new(8);
    assert_ne!(xs[0], c.next_u64());
    let mut r = Rng::new(3);
    let hits = (0..10_000).filter(|_| r.chance(0.25)).count();
    assert!((2_000..3_000).contains(&hits), "{hits}");
}

#[test]
fn harness_idle_pair_is_quiet() {
    let mut p = Pair::with(PairConfig::default());
    assert!(p.quiet());
    p.drive();
    assert_eq!(p.ab.sent().count() + p.ba.sent().count(), 0);
    assert_eq!(p.elapsed(), std::time::Duration::ZERO);
}
