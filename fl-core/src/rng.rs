//! Seeded randomness that does not depend on thread scheduling.
//!
//! Every random decision draws from its own generator, derived from the run seed and the
//! decision's coordinates (round, client, purpose). Clients trained in parallel therefore see
//! the same random numbers whatever the thread count or completion order.

use std::cell::RefCell;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// What a generator is used for (keeps streams of different purposes independent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum Purpose {
    /// Initial model weights.
    Init = 1,
    /// Which clients take part in a round.
    Sampling = 2,
    /// A client's mini-batch order.
    Shuffle = 3,
    /// Server-side randomness of a strategy (e.g. FedMR's permutations).
    Server = 4,
    /// Data partitioning.
    Partition = 5,
    /// Randomness inside a model's forward pass during local training (dropout masks).
    Forward = 6,
    /// Randomness of a client's local loss term (FedGen's generated samples).
    Objective = 7,
    /// Batches and forward passes of the personalisation steps before a per-client evaluation.
    FineTune = 8,
    /// The weight noise ε of a Bayesian client's sampled models (pFedBayes).
    Posterior = 9,
    /// A client's batches on the server's public samples (FedMD's digest) and the server's
    /// draw of those samples.
    Public = 10,
}

/// SplitMix64 finaliser: a cheap, well-mixed 64-bit hash step.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A 64-bit seed derived from the run seed and the coordinates of one random decision.
pub fn derive_seed(seed: u64, purpose: Purpose, round: u64, client: u64) -> u64 {
    [purpose as u64, round, client]
        .into_iter()
        .fold(mix(seed), |acc, x| mix(acc ^ mix(x)))
}

/// A generator for one random decision (see [`derive_seed`]).
pub fn rng_for(seed: u64, purpose: Purpose, round: u64, client: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(derive_seed(seed, purpose, round, client))
}

thread_local! {
    /// The stream [`with_forward_stream`] installs for the current thread.
    static FORWARD: RefCell<ChaCha8Rng> = RefCell::new(ChaCha8Rng::seed_from_u64(0));
}

/// Runs `f` with this thread's forward-pass stream seeded from `seed`, then restores the
/// previous stream.
///
/// Burn's own random tensors draw from one process-wide generator, so dropout masks would depend
/// on how parallel clients interleave. Layers that need randomness in the forward pass (such as
/// `fl_models::Dropout`) draw from this per-thread stream instead, and the local trainer seeds it
/// per (run, round, client): a client's masks are the same whatever the thread count.
pub fn with_forward_stream<T>(seed: u64, f: impl FnOnce() -> T) -> T {
    let previous = FORWARD.with(|s| s.replace(ChaCha8Rng::seed_from_u64(seed)));
    let out = f();
    FORWARD.with(|s| s.replace(previous));
    out
}

/// `n` independent draws that are 1 with probability `keep` and 0 otherwise, from the current
/// thread's forward-pass stream (see [`with_forward_stream`]).
pub fn forward_bernoulli(n: usize, keep: f64) -> Vec<f32> {
    FORWARD.with(|s| {
        let mut rng = s.borrow_mut();
        (0..n)
            .map(|_| if rng.random_bool(keep) { 1.0 } else { 0.0 })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_differ_by_every_coordinate() {
        let base = derive_seed(1, Purpose::Shuffle, 3, 4);
        assert_eq!(base, derive_seed(1, Purpose::Shuffle, 3, 4));
        for other in [
            derive_seed(2, Purpose::Shuffle, 3, 4),
            derive_seed(1, Purpose::Sampling, 3, 4),
            derive_seed(1, Purpose::Shuffle, 4, 3),
            derive_seed(1, Purpose::Shuffle, 3, 5),
        ] {
            assert_ne!(base, other);
        }
    }

    #[test]
    fn forward_stream_is_per_seed_and_restored() {
        let a = with_forward_stream(7, || forward_bernoulli(64, 0.5));
        let b = with_forward_stream(7, || forward_bernoulli(64, 0.5));
        let c = with_forward_stream(8, || forward_bernoulli(64, 0.5));
        assert_eq!(a, b);
        assert_ne!(a, c);
        // Nested use restores the outer stream.
        let outer = with_forward_stream(1, || {
            let first = forward_bernoulli(8, 0.5);
            with_forward_stream(2, || forward_bernoulli(8, 0.5));
            (first, forward_bernoulli(8, 0.5))
        });
        let plain = with_forward_stream(1, || forward_bernoulli(16, 0.5));
        assert_eq!([outer.0, outer.1].concat(), plain);
        assert!(forward_bernoulli(1000, 1.0).iter().all(|&x| x == 1.0));
    }
}
