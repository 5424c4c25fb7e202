//! Per-FedAvg's local steps (Fallah, Mokhtari, Ozdaglar, NeurIPS 2020): each step optimises the
//! loss *after* one inner gradient step, `F(w) = f(w − α∇f(w))`, so that the global model is a
//! good starting point for one step of personalisation.
//!
//! A step takes three of the client's shuffled mini-batches: the inner step on the next batch
//! `D'` gives `w̃ = w − α∇f(w; D')`; the outer gradient is `g = ∇f(w̃; D)` on the step's own
//! batch `D`. First-order (FO): `w ← w − β g`. Hessian-free (HF): `w ← w − β (g − α H g)`, the
//! Hessian-vector product `H g = ∇²f(w; D'') g` by a central difference of two gradients,
//! `(∇f(w + δg; D'') − ∇f(w − δg; D'')) / 2δ`: no second-order autodiff, so every backend runs
//! it. With α = 0 a step is a plain SGD step on `D` (tested). On ReLU networks δ trades accuracy
//! for stability: the gradient jumps where a unit changes sign, so a tiny δ that straddles a kink
//! divides a jump by 2δ. Training a CNN2 on 2-class clients (README), δ = 1e-4 and 1e-3 ended in
//! NaN losses, δ = 1e-2 trained well: the CLI's default is 1e-2.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

use super::{FusedSgd, TrainError};

/// How a client takes its local steps.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LocalProcedure {
    /// One gradient step per mini-batch.
    #[default]
    Sgd,
    /// Per-FedAvg's meta-learning step per mini-batch.
    PerFedAvg(MetaStep),
    /// pFedMe's Moreau-envelope step per mini-batch ([`MoreauStep`](super::MoreauStep)).
    PFedMe(super::MoreauStep),
    /// pFedBayes' variational steps ([`BayesStep`](super::BayesStep)): the client trains its
    /// personalised posterior and its copy of the global one.
    PFedBayes(super::BayesStep),
    /// Deep mutual learning of the received model and the client's own (its state): each on
    /// cross-entropy plus KL towards the other's predictions (FedKEMF).
    Mutual,
}

/// The settings of a Per-FedAvg step.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MetaStep {
    /// The inner (personalisation) step size α.
    pub alpha: f64,
    /// `None`: first-order (FO); `Some(δ)`: Hessian-free (HF) with finite-difference step δ.
    pub hessian_free: Option<f64>,
}

impl MetaStep {
    /// Checks α ≥ 0 and δ > 0.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.alpha.is_finite() && self.alpha >= 0.0) {
            return Err(format!(
                "Per-FedAvg's alpha must be >= 0, got {}",
                self.alpha
            ));
        }
        match self.hessian_free {
            Some(d) if !(d.is_finite() && d > 0.0) => Err(format!(
                "Per-FedAvg's finite-difference delta must be > 0, got {d}"
            )),
            _ => Ok(()),
        }
    }

    /// The loss and the gradient to apply at `model` for one step; `loss_at(m, k)` is the loss
    /// of `m` on the step's batch `k` (0: `D`, 1: `D'`, 2: `D''`). The returned loss is the
    /// outer one, `f(w̃; D)`.
    pub(super) fn gradients<M: Module + Clone>(
        &self,
        model: &M,
        loss_at: &dyn Fn(&M, usize) -> Result<Tensor<1>, TrainError>,
    ) -> Result<(Tensor<1>, GradientsParams), TrainError> {
        let inner = loss_at(model, 1)?;
        let adapted = descend(
            model,
            GradientsParams::from_grads(inner.backward(), model),
            self.alpha,
        );
        let outer = loss_at(&adapted, 0)?;
        let g = GradientsParams::from_grads(outer.backward(), &adapted);
        let Some(delta) = self.hessian_free else {
            return Ok((outer, g));
        };
        let hg = hessian_vector_product(model, &g, delta, &|m| loss_at(m, 2))?;
        let step = combine(model, &[(&g, 1.0), (&hg, -self.alpha)]);
        Ok((outer, step))
    }
}

/// `model − lr · grads`, a stateless SGD step (parameter ids are kept, so gradients taken at the
/// result apply to `model`).
fn descend<M: Module + Clone>(model: &M, grads: GradientsParams, lr: f64) -> M {
    FusedSgd::plain().init().step(lr, model.clone(), grads)
}

/// `∇²f(w) v ≈ (∇f(w + δv) − ∇f(w − δv)) / 2δ`, `loss(m)` giving `f` at the parameters of `m`.
pub fn hessian_vector_product<M: Module + Clone>(
    model: &M,
    v: &GradientsParams,
    delta: f64,
    loss: &dyn Fn(&M) -> Result<Tensor<1>, TrainError>,
) -> Result<GradientsParams, TrainError> {
    let plus = descend(model, combine(model, &[(v, -1.0)]), delta);
    let minus = descend(model, combine(model, &[(v, 1.0)]), delta);
    let g_plus = GradientsParams::from_grads(loss(&plus)?.backward(), &plus);
    let g_minus = GradientsParams::from_grads(loss(&minus)?.backward(), &minus);
    let s = 1.0 / (2.0 * delta);
    Ok(combine(model, &[(&g_plus, s), (&g_minus, -s)]))
}

/// `Σ scale · grads` per parameter of `model` (a parameter without a gradient in any part is
/// left out, as in Burn's own gradients).
pub fn combine<M: Module>(model: &M, parts: &[(&GradientsParams, f64)]) -> GradientsParams {
    let mut sum = Combine {
        parts,
        out: GradientsParams::new(),
    };
    model.visit(&mut sum);
    sum.out
}

struct Combine<'a> {
    parts: &'a [(&'a GradientsParams, f64)],
    out: GradientsParams,
}

impl ModuleVisitor for Combine<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let mut sum: Option<Tensor<D>> = None;
        for (grads, scale) in self.parts {
            if let Some(g) = grads.get::<D>(param.id) {
                let g = g.mul_scalar(*scale);
                sum = Some(match sum {
                    Some(s) => s + g,
                    None => g,
                });
            }
        }
        if let Some(sum) = sum {
            self.out.register(param.id, sum);
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::nn::loss::CrossEntropyLossConfig;
    use burn::tensor::Int;
    use fl_data::Normalization;

    use super::*;
    use crate::layers::ParamTable;
    use crate::test_model::{device, synthetic_data, tracked, trainable};
    use crate::trainer::{LocalTask, TrainConfig, make_batch, train_local};

    fn data() -> (fl_data::Dataset, Normalization) {
        synthetic_data(120, 3)
    }

    fn train(procedure: LocalProcedure) -> Vec<f32> {
        let (data, norm) = data();
        let indices: Vec<usize> = (0..60).collect();
        let model = tracked(5);
        let task = LocalTask {
            start: ParamTable::from_module(&model),
            template: model,
            data: &data,
            norm: &norm,
            indices: &indices,
            client: 2,
            round: 1,
            seed: 9,
            objective: None,
            state: None,
            personal_template: None,
        };
        let cfg = TrainConfig {
            local_epochs: 2,
            batch_size: 16,
            lr: 0.05,
            momentum: 0.0,
            procedure,
            ..TrainConfig::default()
        };
        trainable(&train_local(task, &cfg).unwrap().table)
    }

    #[test]
    fn with_alpha_zero_both_variants_are_plain_sgd() {
        let sgd = train(LocalProcedure::Sgd);
        for hessian_free in [None, Some(1e-3)] {
            let meta = MetaStep {
                alpha: 0.0,
                hessian_free,
            };
            assert_eq!(train(LocalProcedure::PerFedAvg(meta)), sgd, "{meta:?}");
        }
        // A positive α changes the update (the comparison above can fail).
        let meta = MetaStep {
            alpha: 0.05,
            hessian_free: None,
        };
        assert_ne!(train(LocalProcedure::PerFedAvg(meta)), sgd);
    }

    /// A smooth two-layer network (tanh): its Hessian is defined everywhere, unlike a ReLU
    /// network's, whose gradient jumps where a unit changes sign.
    #[derive(burn::module::Module, Debug)]
    struct Smooth {
        fc1: burn::nn::Linear,
        fc2: burn::nn::Linear,
    }

    impl Smooth {
        fn logits(&self, x: Tensor<4>) -> Tensor<2> {
            let h = burn::tensor::activation::tanh(self.fc1.forward(x.flatten(1, 3)));
            self.fc2.forward(h)
        }
    }

    fn flat<M: Module>(model: &M, g: &GradientsParams) -> Vec<f64> {
        struct Flat<'a>(&'a GradientsParams, Vec<f64>);
        impl ModuleVisitor for Flat<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                if let Some(g) = self.0.get::<D>(p.id) {
                    let v: Vec<f32> = g.into_data().try_to_vec().unwrap();
                    self.1.extend(v.iter().map(|&x| x as f64));
                }
            }
        }
        let mut f = Flat(g, Vec::new());
        model.visit(&mut f);
        f.1
    }

    #[test]
    fn hessian_vector_product_matches_a_difference_of_gradients_and_is_symmetric() {
        use burn::nn::LinearConfig;
        let (data, norm) = data();
        let d = device().autodiff();
        let ce = CrossEntropyLossConfig::new().init(&d);
        let batch = |from: usize| -> (Tensor<4>, Tensor<1, Int>) {
            let idx: Vec<usize> = (from..from + 24).collect();
            make_batch(&data, &norm, &idx, &d)
        };
        let (x, y) = batch(0);
        let loss = |m: &Smooth| -> Result<Tensor<1>, TrainError> {
            Ok(ce.forward(m.logits(x.clone()), y.clone()))
        };
        let model = Smooth {
            fc1: LinearConfig::new(64, 12).init(&d),
            fc2: LinearConfig::new(12, 10).init(&d),
        };
        // Two directions: the gradients on two other batches.
        let grad_on = |from: usize| {
            let (bx, by) = batch(from);
            let l = ce.forward(model.logits(bx), by);
            GradientsParams::from_grads(l.backward(), &model)
        };
        let (u, v) = (grad_on(30), grad_on(60));
        let hvp = |dir: &GradientsParams| {
            flat(
                &model,
                &hessian_vector_product(&model, dir, 1e-3, &loss).unwrap(),
            )
        };
        let (hu, hv) = (hvp(&u), hvp(&v));
        // The reference: a one-sided difference of gradients, (∇f(w + hv) − ∇f(w)) / h, taken
        // on the host in f64.
        let grad_at = |m: &Smooth| {
            flat(
                m,
                &GradientsParams::from_grads(loss(m).unwrap().backward(), m),
            )
        };
        let h = 1e-4;
        let shifted = descend(&model, combine(&model, &[(&v, -1.0)]), h);
        let reference: Vec<f64> = grad_at(&shifted)
            .iter()
            .zip(&grad_at(&model))
            .map(|(a, b)| (a - b) / h)
            .collect();
        let norm = |a: &[f64]| a.iter().map(|x| x * x).sum::<f64>().sqrt();
        let diff: Vec<f64> = hv.iter().zip(&reference).map(|(a, b)| a - b).collect();
        assert!(norm(&reference) > 1e-3, "a degenerate direction");
        assert!(
            norm(&diff) <= 0.02 * norm(&reference),
            "|Hv − reference| = {} against |reference| = {}",
            norm(&diff),
            norm(&reference)
        );
        // The Hessian is symmetric: u·Hv = v·Hu.
        let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
        let (uhv, vhu) = (dot(&flat(&model, &u), &hv), dot(&flat(&model, &v), &hu));
        assert!(
            (uhv - vhu).abs() <= 0.01 * uhv.abs().max(vhu.abs()),
            "u·Hv = {uhv}, v·Hu = {vhu}"
        );
    }
}
