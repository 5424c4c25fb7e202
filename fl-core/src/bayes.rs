//! Mean-field Gaussian posteriors over any model, through the layer API (pFedBayes).
//!
//! A [`Posterior`] gives every trainable scalar of a model its own Gaussian `N(μ, σ²)` with
//! `σ = softplus(ρ)`; the means are a [`ParamTable`] with the model's layout, so a model of any
//! architecture in `fl-models` becomes Bayesian without being rewritten. A sampled model is
//! `w = μ + σ·ε` loaded into the ordinary module ([`Posterior::sample`]); gradients reach μ and
//! ρ by the reparameterisation `∂w/∂μ = 1`, `∂w/∂ρ = ε·sigmoid(ρ)` (see the trainer's pFedBayes
//! step). Buffers (BatchNorm running statistics) are not random: they stay in the mean table.
//!
//! On the wire a posterior is one table ([`pack`](Posterior::pack)): `mu.<name>` for every tensor,
//! then `rho.<name>` for every trainable one, so averaging, mixing and checkpointing posteriors
//! are the layer API's ordinary table operations.

use burn::tensor::activation::softplus;
use burn::tensor::{Device, Tensor, TensorData};
use rand::Rng;
use rand_distr::StandardNormal;

use crate::layers::{LayerError, ParamKind, ParamTable};

/// A mean-field Gaussian over a model's trainable parameters.
#[derive(Debug, Clone)]
pub struct Posterior {
    /// The means μ, with the model's layout; buffers are kept here as they are.
    pub mean: ParamTable,
    /// ρ of each trainable tensor (`σ = softplus(ρ)`), in layout order.
    pub rho: Vec<Tensor<1>>,
}

/// The indices of a table's trainable tensors.
pub fn trainable_indices(table: &ParamTable) -> Vec<usize> {
    table
        .layout()
        .tensors()
        .iter()
        .enumerate()
        .filter(|(_, t)| t.kind == ParamKind::Trainable)
        .map(|(i, _)| i)
        .collect()
}

/// `Σ KL(N(μq, σq²) ‖ N(μp, σp²))` over all elements of the given tensors (works on tracked
/// tensors: the loss terms of pFedBayes' two updates).
pub fn kl_divergence(
    q: (&[Tensor<1>], &[Tensor<1>]),
    p: (&[Tensor<1>], &[Tensor<1>]),
) -> Tensor<1> {
    let ((mu_q, sigma_q), (mu_p, sigma_p)) = (q, p);
    let terms = (0..mu_q.len()).map(|i| {
        let var_p = sigma_p[i].clone().square();
        let ratio = (sigma_q[i].clone().square() + (mu_q[i].clone() - mu_p[i].clone()).square())
            / var_p.mul_scalar(2.0);
        (sigma_p[i].clone().log() - sigma_q[i].clone().log() + ratio - 0.5).sum()
    });
    terms
        .reduce(|a, b| a + b)
        .expect("a model has a trainable tensor")
}

/// `n` draws of `N(0, noise²)` from `rng`, on `device` (drawn on the host: the same numbers on
/// every backend and thread count).
pub fn standard_normal(rng: &mut impl Rng, n: usize, noise: f64, device: &Device) -> Tensor<1> {
    let host: Vec<f32> = (0..n)
        .map(|_| rng.sample::<f32, _>(StandardNormal) * noise as f32)
        .collect();
    Tensor::from_data(TensorData::new(host, [n]), device)
}

/// `softplus(ρ)`.
pub fn sigma_of(rho: &[Tensor<1>]) -> Vec<Tensor<1>> {
    rho.iter().map(|r| softplus(r.clone(), 1.0)).collect()
}

impl Posterior {
    /// The posterior centred on `mean` with every `ρ = rho` (the pFedBayes authors start from
    /// ρ = −3, σ ≈ 0.049).
    pub fn new(mean: ParamTable, rho: f64) -> Self {
        let rho = trainable_indices(&mean)
            .into_iter()
            .map(|i| mean.values()[i].zeros_like().add_scalar(rho))
            .collect();
        Self { mean, rho }
    }

    /// The trainable means, in layout order.
    pub fn mu(&self) -> Vec<Tensor<1>> {
        trainable_indices(&self.mean)
            .into_iter()
            .map(|i| self.mean.values()[i].clone())
            .collect()
    }

    /// The standard deviations `softplus(ρ)`.
    pub fn sigma(&self) -> Vec<Tensor<1>> {
        sigma_of(&self.rho)
    }

    /// `KL(self ‖ prior)`.
    pub fn kl(&self, prior: &Posterior) -> f64 {
        let (q_mu, p_mu) = (self.mu(), prior.mu());
        kl_divergence((&q_mu, &self.sigma()), (&p_mu, &prior.sigma())).into_scalar::<f32>() as f64
    }

    /// A model drawn from the posterior, `w = μ + σ·ε` with `ε ~ N(0, noise²)` from `rng`
    /// (`noise` = 1: the paper's reparameterisation); returns it and the ε (one tensor per
    /// trainable tensor).
    pub fn sample(
        &self,
        rng: &mut impl Rng,
        noise: f64,
    ) -> Result<(ParamTable, Vec<Tensor<1>>), LayerError> {
        let device = self.mean.device();
        let mut values = self.mean.values().to_vec();
        let mut eps = Vec::with_capacity(self.rho.len());
        for (k, (i, sigma)) in trainable_indices(&self.mean)
            .into_iter()
            .zip(self.sigma())
            .enumerate()
        {
            let e = standard_normal(rng, self.rho[k].dims()[0], noise, &device);
            values[i] = values[i].clone() + sigma * e.clone();
            eps.push(e);
        }
        Ok((self.mean.with_values(values)?, eps))
    }

    /// The posterior as one table: `mu.<name>` for every tensor, then `rho.<name>` for the
    /// trainable ones.
    pub fn pack(&self) -> ParamTable {
        let n = self.mean.values().len();
        let mut parts = self.mean.prefixed("mu", 0..n);
        let rho_table = self.rho_table();
        parts.extend(rho_table.prefixed("rho", trainable_indices(&rho_table)));
        ParamTable::from_parts(parts).expect("prefixed names are distinct")
    }

    /// A table with the means' layout holding ρ at the trainable tensors (buffers: the means').
    fn rho_table(&self) -> ParamTable {
        let mut values = self.mean.values().to_vec();
        for (i, r) in trainable_indices(&self.mean).into_iter().zip(&self.rho) {
            values[i] = r.clone();
        }
        self.mean.with_values(values).expect("same tensor count")
    }

    /// Reads a [`pack`](Self::pack)ed posterior of a model with `like`'s layout.
    pub fn unpack(packed: &ParamTable, like: &ParamTable) -> Result<Self, LayerError> {
        let n = like.values().len();
        let trainable = trainable_indices(like);
        let expected = Posterior {
            mean: like.clone(),
            rho: trainable
                .iter()
                .map(|&i| like.values()[i].clone())
                .collect(),
        }
        .pack();
        let (a, b) = (packed.layout().tensors(), expected.layout().tensors());
        if a.len() != b.len()
            || a.iter()
                .zip(b)
                .any(|(x, y)| x.name != y.name || x.shape != y.shape)
        {
            return Err(LayerError::LayoutMismatch(format!(
                "a posterior of this model has {} tensors (mu.*, rho.*), the table {}",
                b.len(),
                a.len()
            )));
        }
        let values = packed.values();
        Ok(Self {
            mean: like.with_values(values[..n].to_vec())?,
            rho: values[n..].to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::test_model::{flat, tiny};

    #[test]
    fn the_kl_between_identical_gaussians_is_zero_and_grows_with_their_distance() {
        let q = Posterior::new(ParamTable::from_module(&tiny(1)), -3.0);
        assert!(q.kl(&q).abs() < 1e-6, "{}", q.kl(&q));
        // A closed form: KL(N(0, σ²) ‖ N(0, s²)) = ln(s/σ) + σ²/(2s²) − ½ per element.
        let p = Posterior::new(q.mean.clone(), 0.0);
        let n = q.mean.num_trainable() as f64;
        let (sq, sp) = ((1.0f64 + (-3.0f64).exp()).ln(), 2f64.ln());
        let expected = n * ((sp / sq).ln() + sq * sq / (2.0 * sp * sp) - 0.5);
        assert!(
            (q.kl(&p) - expected).abs() < 1e-3 * expected,
            "{} vs {expected}",
            q.kl(&p)
        );
        let far = Posterior::new(ParamTable::from_module(&tiny(2)), -3.0);
        assert!(q.kl(&far) > 1.0);
    }

    #[test]
    fn sampled_weights_have_the_posterior_mean_and_variance() {
        // One weight tensor of TinyNet's fc1 (2,304 values) at μ, σ = softplus(ρ): the sample
        // mean and variance of w − μ over many draws match 0 and σ²·noise².
        let q = Posterior::new(ParamTable::from_module(&tiny(1)), -1.0);
        let sigma = (1.0f64 + (-1.0f64).exp()).ln();
        let mu = flat(&q.mean);
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for noise in [1.0, 0.5] {
            let (mut sum, mut sq, mut count) = (0.0f64, 0.0f64, 0usize);
            for _ in 0..20 {
                let (w, _) = q.sample(&mut rng, noise).unwrap();
                let w = flat(&w);
                for (k, info) in q.mean.layout().tensors().iter().enumerate() {
                    let start: usize = q.mean.layout().tensors()[..k]
                        .iter()
                        .map(|t| t.shape.iter().product::<usize>())
                        .sum();
                    let len: usize = info.shape.iter().product();
                    for j in start..start + len {
                        let d = (w[j] - mu[j]) as f64;
                        if info.kind == ParamKind::Buffer {
                            assert_eq!(d, 0.0, "{} is not random", info.name);
                        } else {
                            sum += d;
                            sq += d * d;
                            count += 1;
                        }
                    }
                }
            }
            let mean = sum / count as f64;
            let var = sq / count as f64 - mean * mean;
            let want = (sigma * noise).powi(2);
            assert!(mean.abs() < 0.01 * sigma, "mean {mean}");
            assert!((var - want).abs() < 0.02 * want, "var {var} vs {want}");
        }
    }

    #[test]
    fn a_packed_posterior_unpacks_to_itself() {
        let mean = ParamTable::from_module(&tiny(4));
        let q = Posterior::new(mean.clone(), -2.5);
        let packed = q.pack();
        assert_eq!(
            packed.num_elements(),
            mean.num_elements() + mean.num_trainable()
        );
        let back = Posterior::unpack(&packed, &mean).unwrap();
        assert_eq!(flat(&back.mean), flat(&q.mean));
        assert_eq!(flat(&back.pack()), flat(&packed));
        // A plain model table is not a posterior.
        assert!(Posterior::unpack(&mean, &mean).is_err());
    }
}
