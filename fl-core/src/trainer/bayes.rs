//! pFedBayes' local steps (Zhang, Li, Li, Wang, Ni, ICML 2022): variational Bayesian
//! personalisation over mean-field Gaussian weights ([`Posterior`]).
//!
//! A client keeps its personalised posterior `q_i` from round to round and receives the global
//! posterior `v` (the server's `z`). For each mini-batch, `q_i` takes K steps on the
//! per-sample negative ELBO `CE(w; batch) + (ζ/N_i)·KL(q_i ‖ v)` with `w = μ + σ·ε` sampled
//! afresh each step (reparameterised: `∂w/∂μ = 1`, `∂w/∂ρ = ε·sigmoid(ρ)`), then the client's
//! copy of the global posterior takes one step on `(ζ/N_i)·KL(q_i ‖ v)` towards it. Both use
//! Adam, as the authors' code (η_p for `q_i`, the run's `--lr` for `v`); `v` is uploaded and
//! `q_i` stays on the client. Fresh Adam moments every round (the authors keep them across
//! rounds; README "Algorithm notes").

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Tensor};
use rand::seq::SliceRandom;

use super::{
    FusedAdam, LocalTask, LocalUpdate, TrainConfig, TrainError, epoch_sum, make_batch, model_device,
};
use crate::bayes::{Posterior, sigma_of, standard_normal};
use crate::layers::{ParamKind, ParamTable};
use crate::model::Classifier;
use crate::rng::{Purpose, rng_for};

/// The settings of pFedBayes' local problem.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BayesStep {
    /// ζ, the weight of the KL term to the global posterior (per training sample: ζ/N_i).
    pub zeta: f64,
    /// η_p, the personalised posterior's Adam step size.
    pub personal_lr: f64,
    /// K, the personalised posterior's steps per mini-batch (the authors: 5).
    pub inner_steps: usize,
    /// The standard deviation of ε in `w = μ + σ·ε`: 1 in the paper, 0.001 in the authors' code.
    pub noise: f64,
}

impl BayesStep {
    /// Checks ζ ≥ 0, η_p > 0, K ≥ 1, noise ≥ 0.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.zeta.is_finite() && self.zeta >= 0.0) {
            return Err(format!("pFedBayes' zeta must be >= 0, got {}", self.zeta));
        }
        if !(self.personal_lr.is_finite() && self.personal_lr > 0.0) {
            return Err(format!(
                "pFedBayes' personal learning rate must be > 0, got {}",
                self.personal_lr
            ));
        }
        if self.inner_steps == 0 {
            return Err("pFedBayes' inner steps must be at least 1".into());
        }
        if !(self.noise.is_finite() && self.noise >= 0.0) {
            return Err(format!("pFedBayes' noise must be >= 0, got {}", self.noise));
        }
        Ok(())
    }
}

/// A posterior's trainable μ and ρ as a Burn module, so Burn's Adam optimises them (with the
/// gradients of [`Moments`], registered by hand).
#[derive(Module, Debug)]
struct Variational {
    mu: Vec<Param<Tensor<1>>>,
    rho: Vec<Param<Tensor<1>>>,
}

/// A posterior's trainable moments as plain tensors: μ, ρ, σ = softplus(ρ).
struct Moments {
    mu: Vec<Tensor<1>>,
    rho: Vec<Tensor<1>>,
    sigma: Vec<Tensor<1>>,
}

impl Variational {
    fn new(posterior: &Posterior, device: &Device) -> Self {
        // With the device's checkpointing strategy: Burn's `autodiff()` alone gives the default
        // one, and ops mixing two panic.
        let strategy = device.gradient_checkpointing_strategy().unwrap_or_default();
        let param = |t: Tensor<1>| {
            let t = t.to_device(device).autodiff();
            Param::from_tensor(t.with_gradient_checkpointing_strategy(strategy))
        };
        Self {
            mu: posterior.mu().into_iter().map(param).collect(),
            rho: posterior.rho.iter().cloned().map(param).collect(),
        }
    }

    fn moments(&self) -> Moments {
        let rho: Vec<_> = self.rho.iter().map(|r| r.val().inner()).collect();
        Moments {
            mu: self.mu.iter().map(|m| m.val().inner()).collect(),
            sigma: sigma_of(&rho),
            rho,
        }
    }

    /// One Adam step along the gradients `(dμ, dρ)`.
    fn step(self, adam: &mut ModuleOptimizer, lr: f64, (d_mu, d_rho): Grads) -> Self {
        let mut grads = GradientsParams::new();
        for (p, g) in self.mu.iter().zip(d_mu).chain(self.rho.iter().zip(d_rho)) {
            grads.register(p.id, g);
        }
        adam.step(lr, self, grads)
    }

    /// The posterior with the buffers (and layout) of `like`.
    fn posterior(&self, like: &ParamTable) -> Result<Posterior, TrainError> {
        let m = self.moments();
        let mut values = like.values().to_vec();
        for (i, mu) in crate::bayes::trainable_indices(like).into_iter().zip(m.mu) {
            values[i] = mu;
        }
        Ok(Posterior {
            mean: like.with_values(values)?,
            rho: m.rho,
        })
    }
}

/// Gradients in μ and in ρ, per trainable tensor.
type Grads = (Vec<Tensor<1>>, Vec<Tensor<1>>);

/// The gradients of the personalised posterior's loss `CE(μ + σ·ε) + c·KL(q ‖ v)` in `q`'s μ
/// and ρ, given the model's gradient `g` at the sampled weights: by the chain rule
/// `∂/∂μ = g + c(μq − μv)/σv²` and `∂/∂ρ = (g·ε + c(σq/σv² − 1/σq))·sigmoid(ρq)`, with
/// `sigmoid(ρ) = 1 − e^(−softplus(ρ))`. Written out because an autodiff graph of the KL costs
/// several times more passes over the parameters (tested against autodiff).
fn personal_grads(q: &Moments, v: &Moments, g: &[Tensor<1>], eps: &[Tensor<1>], c: f64) -> Grads {
    (0..q.mu.len())
        .map(|k| {
            let inv_var = v.sigma[k].clone().square().recip();
            let d_mu = g[k].clone() + (q.mu[k].clone() - v.mu[k].clone()) * inv_var.clone() * c;
            let d_sigma = g[k].clone() * eps[k].clone()
                + (q.sigma[k].clone() * inv_var - q.sigma[k].clone().recip()) * c;
            (d_mu, d_sigma * sigmoid_from_sigma(&q.sigma[k]))
        })
        .unzip()
}

/// The gradients of `c·KL(q ‖ v)` in `v`'s μ and ρ: `∂/∂μv = c(μv − μq)/σv²`,
/// `∂/∂σv = c(1/σv − (σq² + (μq − μv)²)/σv³)`.
fn global_grads(q: &Moments, v: &Moments, c: f64) -> Grads {
    (0..q.mu.len())
        .map(|k| {
            let (sv, sq) = (&v.sigma[k], &q.sigma[k]);
            let diff = v.mu[k].clone() - q.mu[k].clone();
            let inv_var = sv.clone().square().recip();
            let d_mu = diff.clone() * inv_var.clone() * c;
            let spread = (sq.clone().square() + diff.square()) * inv_var / sv.clone();
            let d_sigma = (sv.clone().recip() - spread) * c;
            (d_mu, d_sigma * sigmoid_from_sigma(sv))
        })
        .unzip()
}

/// `sigmoid(ρ)`, the derivative of `σ = softplus(ρ)`, from σ: `1 − e^(−σ)`.
fn sigmoid_from_sigma(sigma: &Tensor<1>) -> Tensor<1> {
    sigma.clone().neg().exp().neg().add_scalar(1.0)
}

/// The gradient of each trainable tensor of `model` (zeros where it got none), flattened;
/// `kinds` are the model's tensor kinds in layout order.
fn trainable_grads<M: Module>(
    model: &M,
    grads: &GradientsParams,
    kinds: &[ParamKind],
) -> Vec<Tensor<1>> {
    struct Read<'a> {
        grads: &'a GradientsParams,
        kinds: &'a [ParamKind],
        next: usize,
        out: Vec<Tensor<1>>,
    }
    impl ModuleVisitor for Read<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let kind = self.kinds[self.next];
            self.next += 1;
            if kind == ParamKind::Trainable {
                let n = param.lazy_shape().num_elements();
                let g = match self.grads.get::<D>(param.id) {
                    Some(g) => g.reshape([n]),
                    None => param.val().inner().reshape([n]).zeros_like(),
                };
                self.out.push(g);
            }
        }
    }
    let mut read = Read {
        grads,
        kinds,
        next: 0,
        out: Vec::new(),
    };
    model.visit(&mut read);
    read.out
}

/// One client's pFedBayes round: `task.start` is the global posterior and `task.state` the
/// client's own (`None`: it starts as the global one), both [`Posterior::pack`]ed; uploads the updated global copy, keeps the new
/// personalised posterior as its state.
pub(super) fn train<M: Classifier>(
    task: LocalTask<'_, M>,
    step: &BayesStep,
    cfg: &TrainConfig,
) -> Result<LocalUpdate, TrainError> {
    let like = ParamTable::from_module(&task.template);
    let kinds: Vec<ParamKind> = like.layout().tensors().iter().map(|t| t.kind).collect();
    let trainable = crate::bayes::trainable_indices(&like);
    let has_buffers = kinds.contains(&ParamKind::Buffer);
    let global = Posterior::unpack(&task.start, &like)?;
    // A client's first personalised posterior is the global one it first receives.
    let personal = match &task.state {
        Some(state) => Posterior::unpack(state, &like)?,
        None => global.clone(),
    };
    let device = model_device(&task.template);
    let mut q = Variational::new(&personal, &device);
    let mut v = Variational::new(&global, &device);
    // BatchNorm statistics come from the sampled models' forward passes.
    let mut buffers = personal.mean.clone();
    let mut adam_q = FusedAdam::pytorch(0.0).init();
    let mut adam_v = FusedAdam::pytorch(0.0).init();
    let kl_weight = step.zeta / task.indices.len() as f64;
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let (round, client) = (task.round as u64, task.client as u64);
    let mut shuffle = rng_for(task.seed, Purpose::Shuffle, round, client);
    let mut noise = rng_for(task.seed, Purpose::Posterior, round, client);
    let mut order = task.indices.to_vec();
    let (mut loss_sum, mut steps) = (0.0f64, 0usize);
    for epoch in 1..=cfg.local_epochs {
        order.shuffle(&mut shuffle);
        let mut epoch_losses: Vec<Tensor<1>> = Vec::new();
        for batch in order.chunks(cfg.batch_size) {
            let (images, labels) = make_batch(task.data, task.norm, batch, &device);
            let global = v.moments();
            for _ in 0..step.inner_steps {
                let personal = q.moments();
                let eps: Vec<Tensor<1>> = personal
                    .mu
                    .iter()
                    .map(|m| standard_normal(&mut noise, m.dims()[0], step.noise, &m.device()))
                    .collect();
                let mut values = buffers.values().to_vec();
                for (k, &i) in trainable.iter().enumerate() {
                    values[i] = personal.mu[k].clone() + personal.sigma[k].clone() * eps[k].clone();
                }
                let model = buffers
                    .with_values(values)?
                    .load_into(task.template.clone())?;
                let ce = loss_fn.forward(model.forward(images.clone()), labels.clone());
                let grads = GradientsParams::from_grads(ce.backward(), &model);
                let g = trainable_grads(&model, &grads, &kinds);
                if has_buffers {
                    buffers = buffers.with_buffers_from(&ParamTable::from_module(&model))?;
                }
                epoch_losses.push(ce.detach().inner());
                let grads = personal_grads(&personal, &global, &g, &eps, kl_weight);
                q = q.step(&mut adam_q, step.personal_lr, grads);
            }
            let grads = global_grads(&q.moments(), &global, kl_weight);
            v = v.step(&mut adam_v, cfg.lr, grads);
        }
        let (sum, n) = epoch_sum(epoch_losses, task.client, epoch)?;
        loss_sum += sum;
        steps += n;
    }
    Ok(LocalUpdate {
        client: task.client,
        table: v.posterior(&buffers)?.pack(),
        state: Some(q.posterior(&buffers)?.pack()),
        prototypes: None,
        num_samples: task.indices.len(),
        train_loss: loss_sum / steps as f64,
        steps,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_model::{close, flat, synthetic_data, tracked};
    use crate::trainer::{LocalOptimizer, LocalProcedure, train_local};

    /// One client round of 2 epochs on 60 synthetic samples with `procedure` and `optimizer`;
    /// `start` is what the client receives.
    fn round(
        start: ParamTable,
        procedure: LocalProcedure,
        optimizer: LocalOptimizer,
    ) -> LocalUpdate {
        let (data, norm) = synthetic_data(120, 3);
        let indices: Vec<usize> = (0..60).collect();
        let task = LocalTask {
            template: tracked(5),
            start,
            data: &data,
            norm: &norm,
            indices: &indices,
            client: 1,
            round: 2,
            seed: 4,
            objective: None,
            state: None,
            personal_template: None,
        };
        let cfg = TrainConfig {
            local_epochs: 2,
            batch_size: 16,
            lr: 0.01,
            optimizer,
            procedure,
            ..TrainConfig::default()
        };
        train_local(task, &cfg).unwrap()
    }

    fn step(zeta: f64, noise: f64, inner_steps: usize) -> LocalProcedure {
        LocalProcedure::PFedBayes(BayesStep {
            zeta,
            personal_lr: 0.01,
            inner_steps,
            noise,
        })
    }

    #[test]
    fn without_noise_and_kl_the_personal_mean_trains_like_adam_on_the_plain_loss() {
        // w = μ exactly and the surrogate's μ-gradient is the model's: K = 1 step per batch is
        // Adam at η_p on the cross-entropy.
        let model = ParamTable::from_module(&tracked(5));
        let prior = Posterior::new(model.clone(), -3.0);
        let bayes = round(prior.pack(), step(0.0, 0.0, 1), LocalOptimizer::Sgd);
        let personal = Posterior::unpack(bayes.state.as_ref().unwrap(), &model).unwrap();
        let adam = round(model.clone(), LocalProcedure::Sgd, LocalOptimizer::Adam);
        assert!(close(&flat(&personal.mean), &flat(&adam.table), 1e-6));
        // ... and a noisy draw changes it (the comparison can fail).
        let noisy = round(prior.pack(), step(0.0, 1.0, 1), LocalOptimizer::Sgd);
        let noisy = Posterior::unpack(noisy.state.as_ref().unwrap(), &model).unwrap();
        assert!(!close(&flat(&noisy.mean), &flat(&adam.table), 1e-4));
    }

    #[test]
    fn the_written_out_gradients_match_autodiff_of_the_losses() {
        use crate::bayes::kl_divergence;
        use burn::tensor::TensorData;
        let d = crate::test_model::device().autodiff();
        let vec = |v: &[f32]| Tensor::<1>::from_data(TensorData::new(v.to_vec(), [v.len()]), &d);
        let tracked = |v: &[f32]| vec(v).require_grad();
        let (mu_q, rho_q) = (tracked(&[0.3, -0.2, 0.05]), tracked(&[-3.0, -1.0, 0.5]));
        let (mu_v, rho_v) = (tracked(&[0.1, 0.0, -0.4]), tracked(&[-2.0, -2.5, 1.0]));
        let (g, eps) = (vec(&[0.7, -1.1, 0.2]), vec(&[0.5, 1.5, -0.8]));
        let c = 0.37;
        let moments = |mu: &Tensor<1>, rho: &Tensor<1>| Moments {
            mu: vec![mu.clone().inner()],
            rho: vec![rho.clone().inner()],
            sigma: sigma_of(&[rho.clone().inner()]),
        };
        let (q, v) = (moments(&mu_q, &rho_q), moments(&mu_v, &rho_v));
        let host = |t: Tensor<1>| t.into_data().try_to_vec::<f32>().unwrap();
        let near = |a: Tensor<1>, b: Tensor<1>| {
            let (a, b) = (host(a), host(b));
            assert!(close(&a, &b, 1e-5), "{a:?} vs {b:?}");
        };
        // The personalised posterior's loss: Σ w·g (the data term's linearisation) + c·KL(q ‖ v).
        let sigma_q = sigma_of(std::slice::from_ref(&rho_q));
        let w = mu_q.clone() + sigma_q[0].clone() * eps.clone();
        let kl = kl_divergence(
            (std::slice::from_ref(&mu_q), &sigma_q),
            (
                &[mu_v.clone().detach()],
                &sigma_of(&[rho_v.clone().detach()]),
            ),
        );
        let grads = ((w * g.clone()).sum() + kl.mul_scalar(c)).backward();
        let (d_mu, d_rho) = personal_grads(&q, &v, &[g.inner()], &[eps.inner()], c);
        near(mu_q.grad(&grads).unwrap(), d_mu[0].clone());
        near(rho_q.grad(&grads).unwrap(), d_rho[0].clone());
        // The global copy's loss: c·KL(q ‖ v) in v.
        let kl = kl_divergence(
            (
                &[mu_q.clone().detach()],
                &sigma_of(&[rho_q.clone().detach()]),
            ),
            (
                std::slice::from_ref(&mu_v),
                &sigma_of(std::slice::from_ref(&rho_v)),
            ),
        );
        let grads = kl.mul_scalar(c).backward();
        let (d_mu, d_rho) = global_grads(&q, &v, c);
        near(mu_v.grad(&grads).unwrap(), d_mu[0].clone());
        near(rho_v.grad(&grads).unwrap(), d_rho[0].clone());
    }

    #[test]
    fn the_global_copy_moves_towards_the_personalised_posterior() {
        let model = ParamTable::from_module(&tracked(5));
        let prior = Posterior::new(model.clone(), -3.0);
        let update = round(prior.pack(), step(10.0, 1.0, 3), LocalOptimizer::Sgd);
        let personal = Posterior::unpack(update.state.as_ref().unwrap(), &model).unwrap();
        let local = Posterior::unpack(&update.table, &model).unwrap();
        assert!(
            personal.kl(&prior) > 1e-3,
            "the personalised posterior trained"
        );
        assert!(
            personal.kl(&local) < personal.kl(&prior),
            "KL(q ‖ v) = {} not below KL(q ‖ z) = {}",
            personal.kl(&local),
            personal.kl(&prior)
        );
        assert!(update.train_loss.is_finite() && update.steps == 2 * 4 * 3);
        // The upload is a posterior: twice the trainable parameters, plus the buffers.
        assert_eq!(update.table.num_elements(), prior.pack().num_elements());
    }
}
