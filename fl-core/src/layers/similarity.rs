//! Similarity of parameter tables: per-layer dot products, Gram matrices, cosines, distances.

use burn::tensor::Tensor;

use super::{LayerError, ParamTable, host_f32};

impl ParamTable {
    /// Per layer, `[x·y, ‖x‖², ‖y‖²]` of the two models (all tensors, buffers included), read
    /// back in one transfer: every similarity and distance here derives from these (sum them
    /// over layers with [`sum_products`] for whole-model values).
    pub fn layer_products(&self, other: &Self) -> Result<Vec<[f64; 3]>, LayerError> {
        self.check_same(other)?;
        let parts: Vec<Tensor<1>> = self
            .values
            .iter()
            .zip(&other.values)
            .flat_map(|(a, b)| {
                [
                    a.clone().mul(b.clone()).sum(),
                    a.clone().square().sum(),
                    b.clone().square().sum(),
                ]
            })
            .collect();
        let host = host_f32(Tensor::cat(parts, 0))?;
        let mut layers = vec![[0.0f64; 3]; self.layout.layers.len()];
        for (i, info) in self.layout.tensors.iter().enumerate() {
            for k in 0..3 {
                layers[info.layer][k] += host[3 * i + k] as f64;
            }
        }
        Ok(layers)
    }

    /// The Gram matrix of `tables` as flat vectors, `g[i][j] = ⟨tᵢ, tⱼ⟩`, with one host
    /// readback for all pairs (per-tensor products summed in f64 in tensor order, as
    /// [`layer_products`](Self::layer_products)).
    pub fn gram(tables: &[Self]) -> Result<Vec<Vec<f64>>, LayerError> {
        let Some(first) = tables.first() else {
            return Ok(Vec::new());
        };
        for t in &tables[1..] {
            first.check_same(t)?;
        }
        let k = tables.len();
        let pairs: Vec<(usize, usize)> = (0..k).flat_map(|i| (i..k).map(move |j| (i, j))).collect();
        let tensors = first.values.len();
        let mut g = vec![vec![0.0f64; k]; k];
        if tensors == 0 {
            return Ok(g);
        }
        let mut parts: Vec<Tensor<1>> = Vec::with_capacity(pairs.len() * tensors);
        for &(i, j) in &pairs {
            for (a, b) in tables[i].values.iter().zip(&tables[j].values) {
                parts.push(if i == j {
                    a.clone().square().sum()
                } else {
                    a.clone().mul(b.clone()).sum()
                });
            }
        }
        let host = host_f32(Tensor::cat(parts, 0))?;
        for (&(i, j), products) in pairs.iter().zip(host.chunks(tensors)) {
            let v: f64 = products.iter().map(|&p| p as f64).sum();
            (g[i][j], g[j][i]) = (v, v);
        }
        Ok(g)
    }

    /// Cosine similarity of the two models as flat vectors.
    pub fn cosine_similarity(&self, other: &Self) -> Result<f64, LayerError> {
        let [dot, xx, yy] = sum_products(&self.layer_products(other)?);
        Ok(cosine([dot, xx, yy]))
    }

    /// Cosine similarity per layer, in layer order.
    pub fn layer_cosine_similarity(&self, other: &Self) -> Result<Vec<f64>, LayerError> {
        Ok(self
            .layer_products(other)?
            .into_iter()
            .map(cosine)
            .collect())
    }

    /// Euclidean distance of the two models as flat vectors.
    pub fn l2_distance(&self, other: &Self) -> Result<f64, LayerError> {
        let [dot, xx, yy] = sum_products(&self.layer_products(other)?);
        Ok((xx + yy - 2.0 * dot).max(0.0).sqrt())
    }

    /// Euclidean distance per layer, in layer order.
    pub fn layer_l2_distance(&self, other: &Self) -> Result<Vec<f64>, LayerError> {
        Ok(self
            .layer_products(other)?
            .into_iter()
            .map(|[dot, xx, yy]| (xx + yy - 2.0 * dot).max(0.0).sqrt())
            .collect())
    }
}

/// Cosine similarity from `[x·y, ‖x‖², ‖y‖²]` (0 when either vector is zero).
pub fn cosine([dot, xx, yy]: [f64; 3]) -> f64 {
    dot / (xx.sqrt() * yy.sqrt()).max(f64::MIN_POSITIVE)
}

/// Sums per-layer `[x·y, ‖x‖², ‖y‖²]` (from [`ParamTable::layer_products`]) over layers.
pub fn sum_products(layers: &[[f64; 3]]) -> [f64; 3] {
    layers.iter().fold([0.0; 3], |acc, l| {
        [acc[0] + l[0], acc[1] + l[1], acc[2] + l[2]]
    })
}
