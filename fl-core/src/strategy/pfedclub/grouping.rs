//! Functional grouping of blocks (pFedClub, Section 4.1): blocks that compute similar functions
//! on the public data, by linear CKA of their inputs and outputs, clustered with K-means.

use burn::tensor::Tensor;
use rand::Rng;

/// A block's representations on the public batch, as centred Gram matrices (`n × n`, row-major)
/// of its input and output features: all linear CKA needs.
#[derive(Debug, Clone)]
pub struct BlockGrams {
    /// Gram matrix of the block's (pooled, centred) inputs.
    pub input: Vec<f64>,
    /// Gram matrix of the block's (pooled, centred) outputs.
    pub output: Vec<f64>,
}

/// The centred linear Gram matrix `X̄ X̄ᵀ` of features `[n, d]` (columns centred first), on
/// the host.
pub fn centred_gram(features: Tensor<2>) -> Vec<f64> {
    let centred = features.clone() - features.mean_dim(0);
    let gram = centred.clone().matmul(centred.transpose());
    gram.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 data")
        .into_iter()
        .map(f64::from)
        .collect()
}

/// Linear CKA (Kornblith et al. 2019) from two centred Gram matrices:
/// ⟨K, L⟩ / (‖K‖ ‖L‖). 1 for identical representations, invariant to orthogonal transforms and
/// isotropic scaling of either; 0 when either is constant.
pub fn cka(k: &[f64], l: &[f64]) -> f64 {
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    let denom = (dot(k, k) * dot(l, l)).sqrt();
    if denom <= f64::EPSILON {
        return 0.0;
    }
    dot(k, l) / denom
}

/// The block similarity matrix: `CKA(inputs) + CKA(outputs)` for every pair of blocks (in
/// `[0, 2]`).
pub fn similarity_matrix(blocks: &[BlockGrams]) -> Vec<Vec<f64>> {
    let n = blocks.len();
    let mut sim = vec![vec![0.0; n]; n];
    for i in 0..n {
        for j in i..n {
            let s =
                cka(&blocks[i].input, &blocks[j].input) + cka(&blocks[i].output, &blocks[j].output);
            sim[i][j] = s;
            sim[j][i] = s;
        }
    }
    sim
}

/// K-means (k-means++ seeding, Lloyd iterations until stable) of `points`; returns each
/// point's cluster in `0..k` (`k` is capped at the number of points). pFedClub clusters blocks
/// by their rows of the similarity matrix: blocks with similar similarity profiles group
/// together.
pub fn kmeans<R: Rng>(points: &[Vec<f64>], k: usize, rng: &mut R) -> Vec<usize> {
    let n = points.len();
    let k = k.clamp(1, n.max(1));
    if n == 0 {
        return Vec::new();
    }
    let dist = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>();
    // k-means++: each next centre with probability ∝ squared distance to the nearest centre.
    let mut centres = vec![points[rng.random_range(0..n)].clone()];
    while centres.len() < k {
        let d: Vec<f64> = points
            .iter()
            .map(|p| {
                centres
                    .iter()
                    .map(|c| dist(p, c))
                    .fold(f64::INFINITY, f64::min)
            })
            .collect();
        let total: f64 = d.iter().sum();
        let next = if total <= 0.0 {
            // All points coincide with a centre: take any point not yet a centre.
            (0..n).find(|&i| !centres.contains(&points[i])).unwrap_or(0)
        } else {
            let mut r = rng.random::<f64>() * total;
            d.iter()
                .position(|&di| {
                    r -= di;
                    r <= 0.0
                })
                .unwrap_or(n - 1)
        };
        centres.push(points[next].clone());
    }
    let mut assign = vec![usize::MAX; n];
    for _ in 0..100 {
        let next: Vec<usize> = points
            .iter()
            .map(|p| {
                (0..k)
                    .min_by(|&a, &b| dist(p, &centres[a]).total_cmp(&dist(p, &centres[b])))
                    .expect("k >= 1")
            })
            .collect();
        if next == assign {
            break;
        }
        assign = next;
        for (c, centre) in centres.iter_mut().enumerate() {
            let members: Vec<&Vec<f64>> = points
                .iter()
                .zip(&assign)
                .filter(|&(_, &a)| a == c)
                .map(|(p, _)| p)
                .collect();
            if members.is_empty() {
                continue; // keep an empty cluster's centre where it was
            }
            for (d, v) in centre.iter_mut().enumerate() {
                *v = members.iter().map(|p| p[d]).sum::<f64>() / members.len() as f64;
            }
        }
    }
    assign
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, Distribution, TensorData};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn random(n: usize, d: usize, seed: u64) -> Tensor<2> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let v: Vec<f32> = (0..n * d).map(|_| rng.random::<f32>() - 0.5).collect();
        Tensor::from_data(TensorData::new(v, [n, d]), &Device::flex())
    }

    /// A random orthogonal matrix (Gram–Schmidt on a random one).
    fn orthogonal(d: usize, seed: u64) -> Tensor<2> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut q: Vec<Vec<f64>> = Vec::new();
        while q.len() < d {
            let mut v: Vec<f64> = (0..d).map(|_| rng.random::<f64>() - 0.5).collect();
            for u in &q {
                let p: f64 = v.iter().zip(u).map(|(a, b)| a * b).sum();
                v.iter_mut().zip(u).for_each(|(a, b)| *a -= p * b);
            }
            let norm = v.iter().map(|a| a * a).sum::<f64>().sqrt();
            q.push(v.into_iter().map(|a| a / norm).collect());
        }
        let flat: Vec<f32> = q.into_iter().flatten().map(|a| a as f32).collect();
        Tensor::from_data(TensorData::new(flat, [d, d]), &Device::flex())
    }

    #[test]
    fn cka_is_one_on_itself_and_invariant_to_rotation_and_scale() {
        let x = random(64, 12, 1);
        let kx = centred_gram(x.clone());
        assert!((cka(&kx, &kx) - 1.0).abs() < 1e-9);
        let rotated = x
            .clone()
            .matmul(orthogonal(12, 2))
            .mul_scalar(3.5)
            .add_scalar(7.0);
        let kr = centred_gram(rotated);
        assert!((cka(&kx, &kr) - 1.0).abs() < 1e-4, "{}", cka(&kx, &kr));
        let y = random(64, 12, 3);
        let other = cka(&kx, &centred_gram(y));
        assert!(other < 0.9, "unrelated features: {other}");
        let constant = centred_gram(Tensor::<2>::ones([64, 3], &Device::flex()));
        assert_eq!(cka(&kx, &constant), 0.0);
        let _ = Distribution::Default;
    }

    #[test]
    fn kmeans_separates_clear_clusters_deterministically() {
        let mut points = Vec::new();
        for c in 0..3 {
            for i in 0..5 {
                points.push(vec![c as f64 * 10.0 + i as f64 * 0.1, c as f64 * -5.0]);
            }
        }
        let run = |seed| kmeans(&points, 3, &mut ChaCha8Rng::seed_from_u64(seed));
        let a = run(7);
        assert_eq!(a, run(7));
        for c in 0..3 {
            let members = &a[c * 5..c * 5 + 5];
            assert!(members.iter().all(|&m| m == members[0]), "{a:?}");
        }
        assert_eq!(a.iter().collect::<std::collections::BTreeSet<_>>().len(), 3);
        assert_eq!(
            kmeans(&points[..2], 5, &mut ChaCha8Rng::seed_from_u64(1)).len(),
            2
        );
    }
}
