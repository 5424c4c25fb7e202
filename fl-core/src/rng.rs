//! Seeded randomness that does not depend on thread scheduling.
//!
//! Every random decision draws from its own generator, derived from the run seed and the
//! decision's coordinates (round, client, purpose). Clients trained in parallel therefore see
//! the same random numbers whatever the thread count or completion order.

use rand::SeedableRng;
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
}
