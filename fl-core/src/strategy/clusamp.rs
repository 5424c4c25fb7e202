//! Clustered sampling (Fraboni, Vidal, Kameni and Lorenzi, ICML 2021), Algorithm 2: clients are
//! clustered by the similarity of their latest model updates, and each round samples one client
//! from each of `m` distributions built from the clusters, so that similar clients are rarely
//! sampled together while every client keeps its expected weight `n_i / N`.
//!
//! Each round:
//! 1. the representative gradient of client i is its last update `w_i − w_global` (trainable
//!    tensors; zero until it is first sampled);
//! 2. the clients' pairwise distances (arccos of the cosine similarity by default; L1, or the
//!    sum of squared differences) form a matrix, clustered with Ward's linkage. As in the
//!    authors' code (`scipy.cluster.hierarchy.linkage(matrix, "ward")`, which reads a square
//!    matrix as one observation per row) the default clusters the matrix's *rows*;
//!    [`LinkageInput::Distances`] uses the matrix as the pairwise distances themselves;
//! 3. the tree is cut into the largest subtrees whose clients hold at most `1/m` of the data;
//!    the `m` heaviest clusters start one distribution each, the clients of the others
//!    (lightest cluster first, shuffled within a cluster) fill the distributions up to mass
//!    `1/m` each, a client's mass `m·n_i/N` split over distributions where needed;
//! 4. one client is drawn from each distribution (a client can be drawn twice), and the server
//!    averages the `m` uploads with equal weights (the paper's unbiased aggregation).
//!
//! Masses are integers (`m·n_i` against a capacity of `N` per distribution), so the
//! construction is exact. Memory: one update per client that has trained, and an `n × n`
//! distance matrix.

use std::collections::BTreeMap;

use rand::Rng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use super::fedavg::Average;
use super::fedavg_with::{ClientRule, FedAvgWith};
use super::{ClientTables, Metrics, RoundContext, StrategyError, StrategyState};
use crate::layers::{LayerError, ParamKind, ParamTable};
use crate::trainer::LocalUpdate;

/// How two representative gradients are compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum UpdateDistance {
    /// `arccos` of the cosine similarity (0 when either update is zero, as the authors' code).
    Arccos,
    /// Sum of absolute differences.
    L1,
    /// Sum of squared differences (the authors' "L2").
    L2,
}

/// What Ward's linkage is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LinkageInput {
    /// Each client's row of the distance matrix as its feature vector (the authors' code).
    Rows,
    /// The distance matrix as pairwise distances.
    Distances,
}

/// Settings of clustered sampling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClusampConfig {
    /// Distance between representative gradients.
    pub distance: UpdateDistance,
    /// What the linkage clusters.
    pub linkage: LinkageInput,
}

impl Default for ClusampConfig {
    fn default() -> Self {
        Self {
            distance: UpdateDistance::Arccos,
            linkage: LinkageInput::Rows,
        }
    }
}

/// Clustered sampling with equal-weight averaging.
pub type Clusamp = FedAvgWith<ClusteredSampling, Average>;

impl Clusamp {
    /// Clustered sampling with `config`.
    pub fn new(config: ClusampConfig) -> Self {
        Self::compose(ClusteredSampling::new(config), Average { weighted: false })
    }
}

/// Clustered sampling's client rule: it picks the round's clients from the clusters of their
/// latest updates.
#[derive(Debug, Clone)]
pub struct ClusteredSampling {
    config: ClusampConfig,
    /// Each client's latest update (full table; only trainable tensors are compared).
    updates: ClientTables,
    /// Host copies of the updates' trainable values (derived from `updates`).
    flat: BTreeMap<usize, Vec<f32>>,
    /// Pairwise distances (derived; rows of clients whose update changed are recomputed).
    distances: Vec<Vec<f64>>,
    stale: Vec<usize>,
    /// Number of clusters of the last selection (a metric).
    last_clusters: usize,
}

impl ClusteredSampling {
    /// The rule with `config`.
    pub fn new(config: ClusampConfig) -> Self {
        Self {
            config,
            updates: ClientTables::default(),
            flat: BTreeMap::new(),
            distances: Vec::new(),
            stale: Vec::new(),
            last_clusters: 0,
        }
    }

    /// Brings the distance matrix up to date for `n` clients.
    fn refresh_distances(&mut self, n: usize) {
        if self.distances.len() != n {
            self.distances = vec![vec![0.0; n]; n];
            self.stale = self.flat.keys().copied().collect();
        }
        let stale = std::mem::take(&mut self.stale);
        for &i in &stale {
            for j in 0..n {
                let d = pair_distance(self.config.distance, self.flat.get(&i), self.flat.get(&j));
                self.distances[i][j] = d;
                self.distances[j][i] = d;
            }
        }
    }
}

/// Distance of two representative gradients (`None` = never sampled = zero).
fn pair_distance(kind: UpdateDistance, a: Option<&Vec<f32>>, b: Option<&Vec<f32>>) -> f64 {
    let zero: Vec<f32> = Vec::new();
    let (a, b) = (a.unwrap_or(&zero), b.unwrap_or(&zero));
    let at = |v: &[f32], i: usize| v.get(i).copied().unwrap_or(0.0) as f64;
    let len = a.len().max(b.len());
    match kind {
        UpdateDistance::Arccos => {
            let (mut dot, mut na, mut nb) = (0.0, 0.0, 0.0);
            for i in 0..len {
                let (x, y) = (at(a, i), at(b, i));
                dot += x * y;
                na += x * x;
                nb += y * y;
            }
            if na == 0.0 || nb == 0.0 {
                0.0
            } else {
                (dot / (na * nb).sqrt()).clamp(-1.0, 1.0).acos()
            }
        }
        UpdateDistance::L1 => (0..len).map(|i| (at(a, i) - at(b, i)).abs()).sum(),
        UpdateDistance::L2 => (0..len).map(|i| (at(a, i) - at(b, i)).powi(2)).sum(),
    }
}

/// One merge of an agglomerative clustering: the two clusters joined (ids as SciPy numbers
/// them: leaves `0..n`, the merge at position t is cluster `n + t`) and the linkage distance.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Merge {
    /// First cluster.
    pub a: usize,
    /// Second cluster.
    pub b: usize,
    /// Ward distance at which they merge.
    pub distance: f64,
}

/// Ward's hierarchical clustering of `n` items given their pairwise Euclidean distances
/// (a full symmetric matrix), by the nearest-neighbour chain algorithm (O(n²) time).
/// Returns the `n − 1` merges in increasing distance, as SciPy's `linkage`.
pub fn ward_linkage(distances: &[Vec<f64>]) -> Vec<Merge> {
    let n = distances.len();
    let mut d: Vec<Vec<f64>> = distances.to_vec();
    let mut size = vec![1usize; n];
    let mut active = vec![true; n];
    let mut raw: Vec<(usize, usize, f64)> = Vec::with_capacity(n.saturating_sub(1));
    let mut chain: Vec<usize> = Vec::new();
    while raw.len() + 1 < n {
        if chain.is_empty() {
            chain.push((0..n).find(|&i| active[i]).expect("an active cluster"));
        }
        loop {
            let a = *chain.last().expect("non-empty chain");
            let previous = chain.len().checked_sub(2).map(|i| chain[i]);
            // Nearest active neighbour; on ties prefer the chain's previous element, so the
            // chain ends in a reciprocal pair.
            let mut best = previous.unwrap_or(usize::MAX);
            let mut best_d = previous.map_or(f64::INFINITY, |p| d[a][p]);
            for (x, &on) in active.iter().enumerate() {
                if on && x != a && d[a][x] < best_d {
                    best = x;
                    best_d = d[a][x];
                }
            }
            if Some(best) == previous {
                break;
            }
            chain.push(best);
        }
        let a = chain.pop().expect("pair");
        let b = chain.pop().expect("pair");
        let dab = d[a][b];
        // Lance–Williams update for Ward; the merged cluster lives in slot `b`.
        for k in 0..n {
            if !active[k] || k == a || k == b {
                continue;
            }
            let (na, nb, nk) = (size[a] as f64, size[b] as f64, size[k] as f64);
            let v = ((na + nk) * d[a][k].powi(2) + (nb + nk) * d[b][k].powi(2) - nk * dab.powi(2))
                / (na + nb + nk);
            let v = v.max(0.0).sqrt();
            d[b][k] = v;
            d[k][b] = v;
        }
        size[b] += size[a];
        active[a] = false;
        raw.push((a, b, dab));
    }
    // SciPy's order and numbering: sort by distance (stably), then name clusters by merge.
    raw.sort_by(|x, y| x.2.total_cmp(&y.2));
    let mut id_of_slot: Vec<usize> = (0..n).collect();
    let mut parent: Vec<usize> = (0..n).collect();
    fn find(parent: &mut [usize], mut x: usize) -> usize {
        while parent[x] != x {
            parent[x] = parent[parent[x]];
            x = parent[x];
        }
        x
    }
    raw.into_iter()
        .enumerate()
        .map(|(t, (a, b, distance))| {
            let (ra, rb) = (find(&mut parent, a), find(&mut parent, b));
            let (ia, ib) = (id_of_slot[ra], id_of_slot[rb]);
            parent[ra] = rb;
            id_of_slot[rb] = n + t;
            Merge {
                a: ia.min(ib),
                b: ia.max(ib),
                distance,
            }
        })
        .collect()
}

/// Euclidean distances between the rows of `m` (SciPy's reading of a square matrix given to
/// `linkage`).
fn row_distances(m: &[Vec<f64>]) -> Vec<Vec<f64>> {
    let n = m.len();
    let mut out = vec![vec![0.0; n]; n];
    for i in 0..n {
        for j in i + 1..n {
            let d = m[i]
                .iter()
                .zip(&m[j])
                .map(|(x, y)| (x - y).powi(2))
                .sum::<f64>()
                .sqrt();
            out[i][j] = d;
            out[j][i] = d;
        }
    }
    out
}

/// Algorithm 2's `m` sampling distributions from a clustering tree: `out[k]` lists
/// `(client, mass)` with masses summing to `Σ sizes` for every k (a client's total mass over
/// all distributions is `m · sizes[client]`). Also returns the number of clusters.
pub fn sampling_distributions(
    merges: &[Merge],
    sizes: &[usize],
    m: usize,
    rng: &mut ChaCha8Rng,
) -> (Vec<Vec<(usize, u64)>>, usize) {
    let n = sizes.len();
    let total: u64 = sizes.iter().map(|&s| s as u64).sum();
    // Members and weight of every node of the tree.
    let mut members: Vec<Vec<usize>> = (0..n).map(|i| vec![i]).collect();
    let mut weight: Vec<u64> = sizes.iter().map(|&s| s as u64).collect();
    for merge in merges {
        let joined = [members[merge.a].clone(), members[merge.b].clone()].concat();
        members.push(joined);
        weight.push(weight[merge.a] + weight[merge.b]);
    }
    // Cut: the maximal subtrees of weight at most total/m (weight·m ≤ total); leaves always.
    let fits = |node: usize| node < n || weight[node] * m as u64 <= total;
    let mut clusters: Vec<usize> = Vec::new();
    let mut stack: Vec<usize> = vec![members.len() - 1];
    while let Some(node) = stack.pop() {
        if fits(node) {
            clusters.push(node);
        } else {
            let merge = merges[node - n];
            stack.push(merge.b);
            stack.push(merge.a);
        }
    }
    // Lightest first (ties by their first client, for a deterministic order).
    clusters.sort_by_key(|&c| (weight[c], members[c].iter().min().copied()));
    let num_clusters = clusters.len();
    let capacity = total;
    let mut rows: Vec<Vec<(usize, u64)>> = vec![Vec::new(); m];
    let mut filled = vec![0u64; m];
    let kept_from = num_clusters.saturating_sub(m);
    let mut spill: Vec<(usize, u64)> = Vec::new();
    // The m heaviest clusters keep a distribution each (a giant client's excess spills).
    for (row, &c) in clusters[kept_from..].iter().enumerate() {
        for &client in &members[c] {
            let mass = m as u64 * sizes[client] as u64;
            let take = mass.min(capacity - filled[row]);
            if take > 0 {
                rows[row].push((client, take));
                filled[row] += take;
            }
            if mass > take {
                spill.push((client, mass - take));
            }
        }
    }
    let mut rest: Vec<(usize, u64)> = Vec::new();
    for &c in &clusters[..kept_from] {
        let mut clients = members[c].clone();
        clients.shuffle(rng);
        rest.extend(clients.into_iter().map(|i| (i, m as u64 * sizes[i] as u64)));
    }
    rest.extend(spill);
    // Fill the distributions in order up to their capacity.
    let mut row = 0;
    for (client, mut mass) in rest {
        while mass > 0 {
            while row < m && filled[row] == capacity {
                row += 1;
            }
            let Some(room) = (row < m).then(|| capacity - filled[row]) else {
                break; // all full: masses add up exactly, so nothing is left
            };
            let take = mass.min(room);
            rows[row].push((client, take));
            filled[row] += take;
            mass -= take;
        }
    }
    (rows, num_clusters)
}

/// One client drawn from a distribution of integer masses.
fn draw(row: &[(usize, u64)], rng: &mut ChaCha8Rng) -> Option<usize> {
    let total: u64 = row.iter().map(|&(_, w)| w).sum();
    if total == 0 {
        return None;
    }
    let mut r = rng.random_range(0..total);
    for &(client, w) in row {
        if r < w {
            return Some(client);
        }
        r -= w;
    }
    None
}

/// The trainable values of a table, concatenated on the host.
fn trainable_host(table: &ParamTable) -> Result<Vec<f32>, LayerError> {
    let host = table.to_host()?;
    Ok(host
        .into_iter()
        .zip(table.layout().tensors())
        .filter(|(_, info)| info.kind == ParamKind::Trainable)
        .flat_map(|(v, _)| v)
        .collect())
}

impl ClusteredSampling {
    /// One client per cluster-based distribution (`None` if a distribution were empty).
    fn choose(
        &mut self,
        client_sizes: &[usize],
        sample: usize,
        rng: &mut ChaCha8Rng,
    ) -> Option<Vec<usize>> {
        let n = client_sizes.len();
        self.refresh_distances(n);
        let linkage_input = match self.config.linkage {
            LinkageInput::Rows => row_distances(&self.distances),
            LinkageInput::Distances => self.distances.clone(),
        };
        let merges = ward_linkage(&linkage_input);
        let (rows, clusters) = sampling_distributions(&merges, client_sizes, sample, rng);
        self.last_clusters = clusters;
        let chosen: Option<Vec<usize>> = rows.iter().map(|row| draw(row, rng)).collect();
        if chosen.is_none() {
            // Cannot happen (every distribution holds mass N), but say so if it ever does.
            tracing::warn!("clustered sampling built an empty distribution; sampling uniformly");
        }
        chosen
    }
}

impl ClientRule for ClusteredSampling {
    fn name(&self) -> &'static str {
        "clusamp"
    }

    fn init(&mut self, _initial: &ParamTable) -> Result<(), StrategyError> {
        self.updates.clear();
        self.flat.clear();
        self.distances.clear();
        self.stale.clear();
        Ok(())
    }

    fn select(&mut self, ctx: &mut RoundContext<'_>) -> Option<Vec<usize>> {
        self.choose(ctx.client_sizes, ctx.sample, ctx.rng)
    }

    fn observe(
        &mut self,
        _round: usize,
        global: &ParamTable,
        updates: &[LocalUpdate],
        _rng: &mut ChaCha8Rng,
    ) -> Result<Metrics, StrategyError> {
        for u in updates {
            let delta = u.table.sub(global)?;
            self.flat.insert(u.client, trainable_host(&delta)?);
            self.updates.insert(u.client, delta);
            self.stale.push(u.client);
        }
        let distinct: std::collections::BTreeSet<usize> =
            updates.iter().map(|u| u.client).collect();
        let mut extra = Metrics::new();
        extra.insert("clusters".into(), self.last_clusters.into());
        extra.insert("distinct_clients".into(), distinct.len().into());
        Ok(extra)
    }

    fn save(&self, state: &mut StrategyState) {
        self.updates.save_into(state);
    }

    fn load(&mut self, state: &mut StrategyState) -> Result<(), StrategyError> {
        self.updates = ClientTables::take_from("clustered sampling", state, 1)?;
        self.flat = self
            .updates
            .iter()
            .map(|(c, t)| Ok((c, trainable_host(t)?)))
            .collect::<Result<_, LayerError>>()?;
        self.distances.clear();
        self.stale.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::{prop_assert_eq, proptest};
    use rand::SeedableRng;

    fn euclid(points: &[Vec<f64>]) -> Vec<Vec<f64>> {
        row_distances(points)
    }

    /// Merges of a naive O(n³) Ward clustering (recompute the best pair every step).
    fn naive_ward(points: &[Vec<f64>]) -> Vec<f64> {
        let mut clusters: Vec<Vec<usize>> = (0..points.len()).map(|i| vec![i]).collect();
        let centroid = |c: &[usize]| -> Vec<f64> {
            let dim = points[0].len();
            (0..dim)
                .map(|k| c.iter().map(|&i| points[i][k]).sum::<f64>() / c.len() as f64)
                .collect()
        };
        let mut heights = Vec::new();
        while clusters.len() > 1 {
            let mut best = (f64::INFINITY, 0, 0);
            for i in 0..clusters.len() {
                for j in i + 1..clusters.len() {
                    let (a, b) = (&clusters[i], &clusters[j]);
                    let (ca, cb) = (centroid(a), centroid(b));
                    let sq: f64 = ca.iter().zip(&cb).map(|(x, y)| (x - y).powi(2)).sum();
                    let (na, nb) = (a.len() as f64, b.len() as f64);
                    // Ward distance as SciPy reports it.
                    let d = (2.0 * na * nb / (na + nb) * sq).sqrt();
                    if d < best.0 {
                        best = (d, i, j);
                    }
                }
            }
            let (d, i, j) = best;
            let b = clusters.remove(j);
            clusters[i].extend(b);
            heights.push(d);
        }
        heights
    }

    #[test]
    fn ward_matches_the_naive_definition() {
        let points: Vec<Vec<f64>> = vec![
            vec![0.0, 0.0],
            vec![0.1, 0.0],
            vec![5.0, 5.0],
            vec![5.2, 5.1],
            vec![10.0, 0.0],
            vec![0.0, 0.3],
        ];
        let merges = ward_linkage(&euclid(&points));
        let heights: Vec<f64> = merges.iter().map(|m| m.distance).collect();
        let naive = naive_ward(&points);
        for (a, b) in heights.iter().zip(&naive) {
            assert!((a - b).abs() < 1e-9, "{heights:?} vs {naive:?}");
        }
        // SciPy numbering: the first merge joins the two closest leaves.
        assert_eq!((merges[0].a, merges[0].b), (0, 1));
        assert_eq!((merges[1].a, merges[1].b), (2, 3));
        assert_eq!((merges[2].a, merges[2].b), (5, 6));
    }

    proptest! {
        /// Every distribution has the same total mass, every client's masses add up to m·n_i,
        /// and the clustering tree has n − 1 merges.
        #[test]
        fn distributions_preserve_every_clients_weight(
            sizes in proptest::collection::vec(1usize..200, 2..40),
            m in 1usize..8,
            seed in 0u64..1000,
        ) {
            let m = m.min(sizes.len());
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let points: Vec<Vec<f64>> = (0..sizes.len())
                .map(|_| vec![rng.random::<f64>(), rng.random::<f64>()])
                .collect();
            let merges = ward_linkage(&euclid(&points));
            prop_assert_eq!(merges.len(), sizes.len() - 1);
            let (rows, _) = sampling_distributions(&merges, &sizes, m, &mut rng);
            prop_assert_eq!(rows.len(), m);
            let total: u64 = sizes.iter().map(|&s| s as u64).sum();
            let mut per_client = vec![0u64; sizes.len()];
            for row in &rows {
                prop_assert_eq!(row.iter().map(|&(_, w)| w).sum::<u64>(), total);
                for &(c, w) in row {
                    per_client[c] += w;
                }
            }
            for (c, &s) in sizes.iter().enumerate() {
                prop_assert_eq!(per_client[c], m as u64 * s as u64);
            }
        }
    }

    /// Two well separated groups of identical updates: with m = 2, every round samples one
    /// client from each group.
    #[test]
    fn similar_clients_are_not_sampled_together() {
        let mut s = ClusteredSampling::new(ClusampConfig::default());
        s.init(&ParamTable::from_module(&crate::test_model::tiny(1)))
            .unwrap();
        let n = 8;
        for c in 0..n {
            let sign = if c < n / 2 { 1.0 } else { -1.0 };
            s.flat.insert(c, vec![sign, 1.0, 0.5 * sign]);
        }
        s.stale = (0..n).collect();
        let sizes = vec![10; n];
        for seed in 0..20 {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let chosen = s.choose(&sizes, 2, &mut rng).unwrap();
            let groups: Vec<bool> = chosen.iter().map(|&c| c < n / 2).collect();
            assert_ne!(groups[0], groups[1], "seed {seed}: {chosen:?}");
        }
    }

    #[test]
    fn distances_follow_the_authors_definitions() {
        let a = vec![1.0f32, 0.0];
        let b = vec![0.0f32, 2.0];
        let d = |k| pair_distance(k, Some(&a), Some(&b));
        assert!((d(UpdateDistance::Arccos) - std::f64::consts::FRAC_PI_2).abs() < 1e-12);
        assert_eq!(d(UpdateDistance::L1), 3.0);
        assert_eq!(d(UpdateDistance::L2), 5.0);
        // A client never sampled (zero update) is at arccos distance 0 from everyone.
        assert_eq!(pair_distance(UpdateDistance::Arccos, Some(&a), None), 0.0);
    }
}
