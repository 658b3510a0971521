//! Engine tests over the deterministic two-endpoint harness in [`util`] (with simulated
//! memory in [`mem`] and links in [`link`]).
//!
//! - `basic`: every operation at the sizes around the MTU, several SGEs on both sides.
//! - `recovery`: scripted single drops, random loss/duplication/reordering, late packets.
//! - `failure`: retry and RNR exhaustion, remote and local errors, post-time refusals.
//! - `semantics`: duplicates at the responder, sequence NAKs, ordering, FENCE, the
//!   read/atomic depth, selective signaling, credits.
//! - `flood`: a peer that sends requests and never takes the answers.

mod basic;
mod direct;
mod failure;
mod flood;
mod link;
mod mem;
mod recovery;
mod rewind;
mod semantics;
mod util;

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
