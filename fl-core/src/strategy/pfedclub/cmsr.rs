//! Candidate generation by controllable model search and reassembly (pFedClub, Algorithm 1).
//!
//! For a client model with blocks `b_1 … b_L`, a candidate takes position `j` from the
//! functional group of `b_j`: an *anchor* for `b_1`, then, under the order constraint, a block
//! whose index in its own model is strictly greater than that of the block chosen before it
//! (so a candidate never runs a network's layers backwards). When no block of the group
//! qualifies, the search stops and *completion* fills the remaining positions with the
//! client's own blocks `b_j … b_L`, so every candidate has the client's depth.

use rand::Rng;
use rand::seq::IndexedRandom;

/// Block `block` of the round's uploaded model `model` (indices into the round's models).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct BlockRef {
    /// Which uploaded model.
    pub model: usize,
    /// Which of its blocks.
    pub block: usize,
}

/// How the anchor block (position 1) is chosen from the group of the client's first block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Anchor {
    /// Uniformly at random (the paper's method).
    #[default]
    Random,
    /// The other models' block most similar to the client's first block (ablation).
    Max,
    /// The other models' block least similar to the client's first block (ablation).
    Min,
}

/// The search rules (the paper's Table 3 ablations switch them off one by one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SearchRules {
    /// How the anchor is chosen.
    pub anchor: Anchor,
    /// Each next block must come from a strictly later block index than the previous one.
    pub ordered: bool,
    /// Fill the positions left after an early stop with the client's own blocks.
    pub complete: bool,
}

impl SearchRules {
    /// pFedClub's rules: random anchor, order constraint, completion.
    pub const PFEDCLUB: Self = Self {
        anchor: Anchor::Random,
        ordered: true,
        complete: true,
    };
    /// pFedHR-style random reassembly: a random block of each position's group, no order
    /// constraint, no completion.
    pub const PFEDHR: Self = Self {
        anchor: Anchor::Random,
        ordered: false,
        complete: false,
    };
}

/// The functional groups of the round's blocks: `group_of[model][block]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockGroups {
    /// Group of every block of every uploaded model.
    pub group_of: Vec<Vec<usize>>,
}

impl BlockGroups {
    /// Every block in `group`, in (model, block) order.
    pub fn members(&self, group: usize) -> Vec<BlockRef> {
        self.group_of
            .iter()
            .enumerate()
            .flat_map(|(model, groups)| {
                groups
                    .iter()
                    .enumerate()
                    .filter(move |&(_, &g)| g == group)
                    .map(move |(block, _)| BlockRef { model, block })
            })
            .collect()
    }
}

/// Draws one candidate for uploaded model `own`. `similarity(a, b)` is the functional
/// similarity of two blocks (used by the max/min anchors).
pub fn draw_candidate<R: Rng>(
    own: usize,
    groups: &BlockGroups,
    similarity: &dyn Fn(BlockRef, BlockRef) -> f64,
    rules: SearchRules,
    rng: &mut R,
) -> Vec<BlockRef> {
    let own_blocks = &groups.group_of[own];
    let depth = own_blocks.len();
    let first = BlockRef {
        model: own,
        block: 0,
    };
    let pool = groups.members(own_blocks[0]);
    let anchor = match rules.anchor {
        Anchor::Random => *pool.choose(rng).expect("a block is in its own group"),
        rule => {
            let others: Vec<BlockRef> = pool.iter().copied().filter(|b| b.model != own).collect();
            let pool = if others.is_empty() { pool } else { others };
            let key = |b: &BlockRef| similarity(first, *b);
            let best = match rule {
                Anchor::Max => pool.iter().max_by(|a, b| key(a).total_cmp(&key(b))),
                _ => pool.iter().min_by(|a, b| key(a).total_cmp(&key(b))),
            };
            *best.expect("non-empty pool")
        }
    };
    let mut parts = vec![anchor];
    for (position, &group) in own_blocks.iter().enumerate().skip(1) {
        let previous = parts[position - 1].block;
        let pool: Vec<BlockRef> = groups
            .members(group)
            .into_iter()
            .filter(|b| !rules.ordered || b.block > previous)
            .collect();
        match pool.choose(rng) {
            Some(&b) => parts.push(b),
            None => break,
        }
    }
    if rules.complete {
        let stop = parts.len();
        parts.extend((stop..depth).map(|block| BlockRef { model: own, block }));
    }
    parts
}

/// Up to `max` distinct candidates for uploaded model `own` that pass `keep` (pFedClub+'s size
/// limit), never the client's own model unchanged. Draws at most `10 × max` times.
pub fn candidates<R: Rng>(
    own: usize,
    groups: &BlockGroups,
    similarity: &dyn Fn(BlockRef, BlockRef) -> f64,
    rules: SearchRules,
    max: usize,
    keep: &dyn Fn(&[BlockRef]) -> bool,
    rng: &mut R,
) -> Vec<Vec<BlockRef>> {
    let depth = groups.group_of[own].len();
    let unchanged: Vec<BlockRef> = (0..depth)
        .map(|block| BlockRef { model: own, block })
        .collect();
    let mut found: Vec<Vec<BlockRef>> = Vec::new();
    for _ in 0..10 * max {
        if found.len() == max {
            break;
        }
        let c = draw_candidate(own, groups, similarity, rules, rng);
        if c != unchanged && !found.contains(&c) && keep(&c) {
            found.push(c);
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    /// Random groupings of 2–5 models with 2–8 blocks each into 1–4 groups.
    fn groupings() -> impl Strategy<Value = BlockGroups> {
        prop::collection::vec(prop::collection::vec(0usize..4, 2..8), 2..5)
            .prop_map(|group_of| BlockGroups { group_of })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn candidates_keep_order_and_depth(groups in groupings(), seed: u64, anchor in 0usize..3) {
            let anchor = [Anchor::Random, Anchor::Max, Anchor::Min][anchor];
            let sim = |a: BlockRef, b: BlockRef| (a.block as f64 - b.block as f64).abs() + b.model as f64;
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            for own in 0..groups.group_of.len() {
                let depth = groups.group_of[own].len();
                let rules = SearchRules { anchor, ..SearchRules::PFEDCLUB };
                let c = draw_candidate(own, &groups, &sim, rules, &mut rng);
                // Completion gives the client's depth.
                prop_assert_eq!(c.len(), depth);
                // Some split gives a searched prefix (from the right groups, strictly
                // increasing block indices) and a completed suffix of the client's own blocks.
                let valid_split = |k: usize| {
                    c[..k].iter().enumerate().all(|(j, b)| {
                        groups.group_of[b.model][b.block] == groups.group_of[own][j]
                    }) && c[..k].windows(2).all(|w| w[1].block > w[0].block)
                        && c[k..].iter().enumerate().all(|(i, b)| *b == BlockRef { model: own, block: k + i })
                };
                prop_assert!((1..=depth).any(valid_split), "invalid candidate {:?}", c);
                // Without completion the candidate is the searched prefix only.
                let rules = SearchRules { complete: false, ..rules };
                let short = draw_candidate(own, &groups, &sim, rules, &mut rng);
                prop_assert!(!short.is_empty() && short.len() <= depth);
                for w in short.windows(2) {
                    prop_assert!(w[1].block > w[0].block);
                }
                // pFedHR: every position filled from its group, any order.
                let hr = draw_candidate(own, &groups, &sim, SearchRules::PFEDHR, &mut rng);
                prop_assert_eq!(hr.len(), depth);
                for (j, b) in hr.iter().enumerate() {
                    prop_assert_eq!(groups.group_of[b.model][b.block], groups.group_of[own][j]);
                }
            }
        }
    }

    #[test]
    fn candidate_sets_are_distinct_filtered_and_exclude_the_own_model() {
        let groups = BlockGroups {
            group_of: vec![vec![0, 1, 2, 3], vec![0, 1, 2, 3], vec![0, 0, 1, 2, 3]],
        };
        let sim = |_: BlockRef, b: BlockRef| b.model as f64;
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let all = candidates(
            0,
            &groups,
            &sim,
            SearchRules::PFEDCLUB,
            6,
            &|_| true,
            &mut rng,
        );
        assert!(all.len() >= 3, "{all:?}");
        let own: Vec<BlockRef> = (0..4).map(|block| BlockRef { model: 0, block }).collect();
        assert!(!all.contains(&own));
        for (i, a) in all.iter().enumerate() {
            assert!(all[i + 1..].iter().all(|b| b != a));
        }
        let only_model_1 = |c: &[BlockRef]| c.iter().all(|b| b.model != 2);
        let kept = candidates(
            0,
            &groups,
            &sim,
            SearchRules::PFEDCLUB,
            6,
            &only_model_1,
            &mut rng,
        );
        assert!(kept.iter().all(|c| only_model_1(c)));
        // Max anchor: the other models' most similar first-group block (model 2 scores highest).
        let rules = SearchRules {
            anchor: Anchor::Max,
            ..SearchRules::PFEDCLUB
        };
        let c = draw_candidate(0, &groups, &sim, rules, &mut rng);
        assert_eq!(c[0].model, 2);
        let rules = SearchRules {
            anchor: Anchor::Min,
            ..SearchRules::PFEDCLUB
        };
        assert_eq!(
            draw_candidate(0, &groups, &sim, rules, &mut rng)[0].model,
            1
        );
    }
}
