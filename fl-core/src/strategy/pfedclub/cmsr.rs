//! Candidate generation by controllable model search and reassembly (pFedClub, Algorithm 1).
//!
//! For a client model with blocks `b_1 … b_L`, a candidate takes position `j` from the
//! functional group of `b_j`: an *anchor* for `b_1`, then, under the order constraint, a block
//! whose index in its own model is strictly greater than that of the block chosen before it
//! (so a candidate never runs a network's layers backwards). When no block of the group
//! qualifies, the search stops and *completion* fills the remaining positions with the
//! client's own blocks `b_j … b_L`, so every candidate has the client's depth.

use rand::Rng;
use rand::seq::SliceRandom;

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
    /// Any block of the group (the paper's method): candidates are drawn uniformly among all
    /// order-valid ones.
    #[default]
    Random,
    /// The group's blocks with the smallest block index (`q ← min(I)`, Table 3's "min"): the
    /// first block of the client's own or another model.
    Min,
    /// The other models' block most similar to the client's first block (an extra ablation).
    MostSimilar,
    /// The other models' block least similar to the client's first block (an extra ablation).
    LeastSimilar,
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
    /// pFedClub's search without its rules (`--variant club-no-rules`): a random block of each
    /// position's group, no order constraint, no completion. pFedHR itself is
    /// [`Method::Pfedhr`](super::Method::Pfedhr).
    pub const NO_RULES: Self = Self {
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

/// Up to this many order-valid candidates are listed one by one (and sampled without
/// replacement); beyond it candidates are drawn uniformly by their counts instead.
pub const ENUMERATION_CAP: usize = 4096;

/// The search space of Algorithm 1 for uploaded model `own`: the anchors, and how many
/// complete candidates continue from each block at each position.
struct Search {
    own: usize,
    rules: SearchRules,
    anchors: Vec<BlockRef>,
    /// `counts[j][b]`: candidates continuing from `members(g_j)[b]` at position `j` (`f64`:
    /// without the order rule they grow as a product).
    counts: Vec<Vec<f64>>,
    members: Vec<Vec<BlockRef>>,
}

impl Search {
    fn new(
        own: usize,
        groups: &BlockGroups,
        similarity: &dyn Fn(BlockRef, BlockRef) -> f64,
        rules: SearchRules,
    ) -> Self {
        let own_groups = &groups.group_of[own];
        let members: Vec<Vec<BlockRef>> = own_groups.iter().map(|&g| groups.members(g)).collect();
        let pool = &members[0];
        let first = BlockRef {
            model: own,
            block: 0,
        };
        let others: Vec<BlockRef> = pool.iter().copied().filter(|b| b.model != own).collect();
        let others = if others.is_empty() { pool } else { &others };
        let key = |b: &&BlockRef| similarity(first, **b);
        let anchors = match rules.anchor {
            Anchor::Random => pool.clone(),
            Anchor::Min => {
                let min = pool.iter().map(|b| b.block).min().expect("own block");
                pool.iter().copied().filter(|b| b.block == min).collect()
            }
            Anchor::MostSimilar => vec![
                *others
                    .iter()
                    .max_by(|a, b| key(a).total_cmp(&key(b)))
                    .expect("pool"),
            ],
            Anchor::LeastSimilar => vec![
                *others
                    .iter()
                    .min_by(|a, b| key(a).total_cmp(&key(b)))
                    .expect("pool"),
            ],
        };
        let mut search = Self {
            own,
            rules,
            anchors,
            counts: vec![Vec::new(); members.len()],
            members,
        };
        for j in (0..search.members.len()).rev() {
            search.counts[j] = (0..search.members[j].len())
                .map(|i| {
                    let next = search.next(j, search.members[j][i]);
                    if next.is_empty() {
                        1.0
                    } else {
                        next.iter().map(|&k| search.counts[j + 1][k]).sum()
                    }
                })
                .collect();
        }
        search
    }

    /// Indices into `members[j + 1]` of the blocks that may follow `b` at position `j`.
    fn next(&self, j: usize, b: BlockRef) -> Vec<usize> {
        match self.members.get(j + 1) {
            None => Vec::new(),
            Some(pool) => (0..pool.len())
                .filter(|&k| !self.rules.ordered || pool[k].block > b.block)
                .collect(),
        }
    }

    fn count_from(&self, b: BlockRef) -> f64 {
        let i = self.members[0]
            .iter()
            .position(|m| *m == b)
            .expect("anchor in its group");
        self.counts[0][i]
    }

    /// How many candidates there are.
    fn total(&self) -> f64 {
        self.anchors.iter().map(|&a| self.count_from(a)).sum()
    }

    /// The searched prefix completed with the client's own blocks (if the rules complete).
    fn finish(&self, mut parts: Vec<BlockRef>) -> Vec<BlockRef> {
        if self.rules.complete {
            let stop = parts.len();
            let depth = self.members.len();
            parts.extend((stop..depth).map(|block| BlockRef {
                model: self.own,
                block,
            }));
        }
        parts
    }

    /// Every candidate, in a fixed order.
    fn enumerate(&self) -> Vec<Vec<BlockRef>> {
        let mut out = Vec::new();
        let mut stack: Vec<Vec<BlockRef>> = self.anchors.iter().rev().map(|&a| vec![a]).collect();
        while let Some(prefix) = stack.pop() {
            let j = prefix.len() - 1;
            let next = self.next(j, prefix[j]);
            if next.is_empty() {
                out.push(self.finish(prefix));
                continue;
            }
            for &k in next.iter().rev() {
                let mut longer = prefix.clone();
                longer.push(self.members[j + 1][k]);
                stack.push(longer);
            }
        }
        out
    }

    /// One candidate drawn uniformly among all of them.
    fn draw<R: Rng>(&self, rng: &mut R) -> Vec<BlockRef> {
        let pick = |weights: &[f64], rng: &mut R| {
            let total: f64 = weights.iter().sum();
            let mut u = rng.random::<f64>() * total;
            for (i, w) in weights.iter().enumerate() {
                if u < *w {
                    return i;
                }
                u -= w;
            }
            weights.len() - 1
        };
        let weights: Vec<f64> = self.anchors.iter().map(|&a| self.count_from(a)).collect();
        let mut parts = vec![self.anchors[pick(&weights, rng)]];
        loop {
            let j = parts.len() - 1;
            let next = self.next(j, parts[j]);
            if next.is_empty() {
                return self.finish(parts);
            }
            let weights: Vec<f64> = next.iter().map(|&k| self.counts[j + 1][k]).collect();
            parts.push(self.members[j + 1][next[pick(&weights, rng)]]);
        }
    }
}

/// The candidates of one client model: what Algorithm 1 found.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidates {
    /// Up to `max` distinct candidates passing the filter, never the client's own model.
    pub found: Vec<Vec<BlockRef>>,
    /// How many order-valid candidates exist (before the filter and the own model are removed).
    pub valid: f64,
}

/// One candidate for uploaded model `own`, drawn uniformly among the order-valid ones.
/// `similarity(a, b)` is the functional similarity of two blocks (the similarity anchors).
pub fn draw_candidate<R: Rng>(
    own: usize,
    groups: &BlockGroups,
    similarity: &dyn Fn(BlockRef, BlockRef) -> f64,
    rules: SearchRules,
    rng: &mut R,
) -> Vec<BlockRef> {
    Search::new(own, groups, similarity, rules).draw(rng)
}

/// Algorithm 1 for uploaded model `own`: from the anchors, every sequence of blocks, position
/// `j` from the group of the client's block `j`, under the order rule each from a strictly later
/// block index than the one before, until no block qualifies (then completion). Up to
/// [`ENUMERATION_CAP`] candidates are listed and `max` of those passing `keep` (pFedClub+'s size
/// limit) taken at random; with more, up to `10 × max` are drawn uniformly.
pub fn candidates<R: Rng>(
    own: usize,
    groups: &BlockGroups,
    similarity: &dyn Fn(BlockRef, BlockRef) -> f64,
    rules: SearchRules,
    max: usize,
    keep: &dyn Fn(&[BlockRef]) -> bool,
    rng: &mut R,
) -> Candidates {
    let search = Search::new(own, groups, similarity, rules);
    let valid = search.total();
    let depth = groups.group_of[own].len();
    let unchanged: Vec<BlockRef> = (0..depth)
        .map(|block| BlockRef { model: own, block })
        .collect();
    let admissible = |c: &Vec<BlockRef>| *c != unchanged && keep(c);
    let found = if valid <= ENUMERATION_CAP as f64 {
        let mut all: Vec<Vec<BlockRef>> =
            search.enumerate().into_iter().filter(admissible).collect();
        all.shuffle(rng);
        all.truncate(max);
        all
    } else {
        let mut found: Vec<Vec<BlockRef>> = Vec::new();
        for _ in 0..10 * max {
            if found.len() == max {
                break;
            }
            let c = search.draw(rng);
            if admissible(&c) && !found.contains(&c) {
                found.push(c);
            }
        }
        found
    };
    Candidates { found, valid }
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
        fn candidates_keep_order_and_depth(groups in groupings(), seed: u64, anchor in 0usize..4) {
            let anchor = [Anchor::Random, Anchor::Min, Anchor::MostSimilar, Anchor::LeastSimilar][anchor];
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
                let hr = draw_candidate(own, &groups, &sim, SearchRules::NO_RULES, &mut rng);
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
        )
        .found;
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
        )
        .found;
        assert!(kept.iter().all(|c| only_model_1(c)));
        // Similarity anchors: the other models' most (least) similar first-group block.
        let rules = SearchRules {
            anchor: Anchor::MostSimilar,
            ..SearchRules::PFEDCLUB
        };
        let c = draw_candidate(0, &groups, &sim, rules, &mut rng);
        assert_eq!(c[0].model, 2);
        let rules = SearchRules {
            anchor: Anchor::LeastSimilar,
            ..SearchRules::PFEDCLUB
        };
        assert_eq!(
            draw_candidate(0, &groups, &sim, rules, &mut rng)[0].model,
            1
        );
    }

    /// Every candidate by brute force: each tuple of blocks from the right groups, from an
    /// anchor, in strictly increasing block order, that no block of the next group can extend.
    fn brute_force(own: usize, groups: &BlockGroups, anchors: &[BlockRef]) -> Vec<Vec<BlockRef>> {
        let own_groups = &groups.group_of[own];
        let mut all = Vec::new();
        let mut prefixes: Vec<Vec<BlockRef>> = anchors.iter().map(|&a| vec![a]).collect();
        while let Some(p) = prefixes.pop() {
            let j = p.len();
            let extensions: Vec<BlockRef> = match own_groups.get(j) {
                None => Vec::new(),
                Some(&g) => groups
                    .members(g)
                    .into_iter()
                    .filter(|b| b.block > p[j - 1].block)
                    .collect(),
            };
            if extensions.is_empty() {
                let mut c = p.clone();
                c.extend((j..own_groups.len()).map(|block| BlockRef { model: own, block }));
                all.push(c);
            }
            for b in extensions {
                let mut longer = p.clone();
                longer.push(b);
                prefixes.push(longer);
            }
        }
        all.sort_by_key(|c| c.iter().map(|b| (b.model, b.block)).collect::<Vec<_>>());
        all
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn enumeration_equals_brute_force(groups in groupings(), seed: u64) {
            let sim = |_: BlockRef, _: BlockRef| 0.0;
            for own in 0..groups.group_of.len() {
                let search = Search::new(own, &groups, &sim, SearchRules::PFEDCLUB);
                let mut listed = search.enumerate();
                listed.sort_by_key(|c| c.iter().map(|b| (b.model, b.block)).collect::<Vec<_>>());
                let expected = brute_force(own, &groups, &groups.members(groups.group_of[own][0]));
                prop_assert_eq!(search.total(), expected.len() as f64);
                prop_assert_eq!(&listed, &expected);
                // Found candidates are valid, distinct, and as many as asked where possible.
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                let c = candidates(own, &groups, &sim, SearchRules::PFEDCLUB, 3, &|_| true, &mut rng);
                prop_assert_eq!(c.valid, expected.len() as f64);
                let unchanged = expected.iter().filter(|e| e.iter().enumerate().all(|(i, b)| *b == BlockRef { model: own, block: i })).count();
                prop_assert_eq!(c.found.len(), 3.min(expected.len() - unchanged));
                for f in &c.found {
                    prop_assert!(expected.contains(f));
                }
            }
        }
    }

    #[test]
    fn min_anchor_takes_the_smallest_block_index() {
        // Model 1's block 0 and model 2's block 1 share the first group with model 0's block 0;
        // the smallest index is 0 (models 0 and 1).
        let groups = BlockGroups {
            group_of: vec![vec![0, 1, 2], vec![0, 1, 2], vec![3, 0, 1, 2]],
        };
        let sim = |_: BlockRef, _: BlockRef| 0.0;
        let rules = SearchRules {
            anchor: Anchor::Min,
            ..SearchRules::PFEDCLUB
        };
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for _ in 0..50 {
            let c = draw_candidate(0, &groups, &sim, rules, &mut rng);
            assert_eq!(c[0].block, 0, "{c:?}");
        }
        let random = Search::new(0, &groups, &sim, SearchRules::PFEDCLUB);
        assert!(random.anchors.iter().any(|b| b.block == 1));
    }

    #[test]
    fn uniform_draws_cover_the_candidates_evenly() {
        // Without the order rule 3 models × 3 positions give 27 candidates; 27,000 draws hit
        // each about 1,000 times.
        let groups = BlockGroups {
            group_of: vec![vec![0, 1, 2]; 3],
        };
        let sim = |_: BlockRef, _: BlockRef| 0.0;
        let search = Search::new(0, &groups, &sim, SearchRules::NO_RULES);
        assert_eq!(search.total(), 27.0);
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let mut hits = std::collections::HashMap::new();
        for _ in 0..27_000 {
            *hits.entry(search.draw(&mut rng)).or_insert(0usize) += 1;
        }
        assert_eq!(hits.len(), 27);
        assert!(hits.values().all(|&n| (850..1150).contains(&n)), "{hits:?}");
    }
}
