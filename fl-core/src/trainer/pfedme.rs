//! pFedMe's local steps (T. Dinh, Tran, Nguyen, NeurIPS 2020): the personalised model θ solves
//! the Moreau-envelope problem `min_θ f(θ; D) + (λ/2)‖θ − w‖²` approximately, with K gradient
//! steps of size η_p from where it was; then the local model moves towards it,
//! `w ← w − ηλ(w − θ)` (η: the run's `--lr`). θ lives for the client's whole round, as in the
//! authors' code; the server then mixes the uploads into the global model with β.

use burn::optim::GradientsParams;
use burn::tensor::Tensor;

use super::{FusedSgd, TrainError};
use crate::layers::ParamTable;
use crate::model::Classifier;

/// The settings of pFedMe's local problem.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MoreauStep {
    /// λ, the weight of the proximal term (the paper: 15 on MNIST).
    pub lambda: f64,
    /// η_p, the step size of the inner problem (the paper: 0.01 to 0.1).
    pub personal_lr: f64,
    /// K, the inner steps per mini-batch (the paper: 5).
    pub inner_steps: usize,
}

impl MoreauStep {
    /// Checks λ > 0, η_p > 0, K ≥ 1.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.lambda.is_finite() && self.lambda > 0.0) {
            return Err(format!("pFedMe's lambda must be > 0, got {}", self.lambda));
        }
        if !(self.personal_lr.is_finite() && self.personal_lr > 0.0) {
            return Err(format!(
                "pFedMe's personal learning rate must be > 0, got {}",
                self.personal_lr
            ));
        }
        if self.inner_steps == 0 {
            return Err("pFedMe's inner steps must be at least 1".into());
        }
        Ok(())
    }

    /// K steps of `θ ← θ − η_p(∇f(θ) + λ(θ − w))` (trainable tensors in the proximal term, as
    /// FedProx's); `loss(θ)` is `f` on the step's mini-batch. Returns θ and the last `f(θ)`.
    pub fn personalise<M: Classifier>(
        &self,
        mut theta: M,
        w: &ParamTable,
        loss: &dyn Fn(&M) -> Result<Tensor<1>, TrainError>,
    ) -> Result<(M, Tensor<1>), TrainError> {
        let mut sgd = FusedSgd::plain().init();
        let mut last = None;
        for _ in 0..self.inner_steps {
            let f = loss(&theta)?;
            let params = ParamTable::from_module_tracked(&theta);
            let prox = params.trainable_sum(w, |t, w0| (t - w0).square().sum());
            let total = f.clone() + prox.mul_scalar(self.lambda / 2.0);
            let grads = GradientsParams::from_grads(total.backward(), &theta);
            theta = sgd.step(self.personal_lr, theta, grads);
            last = Some(f.detach());
        }
        Ok((theta, last.expect("at least one inner step")))
    }

    /// The local model's step towards θ: `w − ηλ(w − θ) = (1 − ηλ)w + ηλθ`.
    pub fn pull(
        &self,
        w: &ParamTable,
        theta: &ParamTable,
        lr: f64,
    ) -> Result<ParamTable, TrainError> {
        let k = lr * self.lambda;
        Ok(w.combine(1.0 - k, theta, k)?)
    }
}

#[cfg(test)]
mod tests {
    use burn::nn::loss::CrossEntropyLossConfig;

    use super::*;
    use crate::test_model::{TinyNet, device, flat, synthetic_data, tracked, trainable};
    use crate::trainer::make_batch;

    /// θ after personalising from w = `tracked(4)` with λ and η_p, and w.
    fn personalised(lambda: f64, personal_lr: f64, inner_steps: usize) -> (Vec<f32>, Vec<f32>) {
        let (data, norm) = synthetic_data(40, 2);
        let d = device().autodiff();
        let idx: Vec<usize> = (0..40).collect();
        let (x, y) = make_batch(&data, &norm, &idx, &d);
        let ce = CrossEntropyLossConfig::new().init(&d);
        let loss = |m: &TinyNet| -> Result<Tensor<1>, TrainError> {
            Ok(ce.forward(m.forward(x.clone()), y.clone()))
        };
        let model = tracked(4);
        let w = ParamTable::from_module(&model);
        let step = MoreauStep {
            lambda,
            personal_lr,
            inner_steps,
        };
        let (theta, _) = step.personalise(model, &w, &loss).unwrap();
        (trainable(&ParamTable::from_module(&theta)), trainable(&w))
    }

    fn distance(a: &[f32], b: &[f32]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(x, y)| ((x - y) as f64).powi(2))
            .sum::<f64>()
            .sqrt()
    }

    #[test]
    fn a_large_lambda_keeps_the_personalised_model_at_the_local_one() {
        // ∇f(θ) + λ(θ − w) = 0 puts θ within |∇f|/λ of w.
        let (theta, w) = personalised(1e5, 1e-6, 30);
        let tight = distance(&theta, &w);
        let (theta, w) = personalised(1e-3, 0.05, 30);
        let loose = distance(&theta, &w);
        assert!(tight < 1e-4, "λ = 1e5: |θ − w| = {tight}");
        assert!(loose > 100.0 * tight, "λ = 1e-3: |θ − w| = {loose}");
    }

    #[test]
    fn the_local_model_moves_towards_the_personalised_one() {
        let w = ParamTable::from_module(&crate::test_model::tiny(1));
        let theta = ParamTable::from_module(&crate::test_model::tiny(2));
        let step = MoreauStep {
            lambda: 10.0,
            personal_lr: 0.01,
            inner_steps: 1,
        };
        // ηλ = 1 lands on θ; ηλ = 0.5 halfway.
        assert_eq!(flat(&step.pull(&w, &theta, 0.1).unwrap()), flat(&theta));
        let half = flat(&step.pull(&w, &theta, 0.05).unwrap());
        let mid: Vec<f32> = flat(&w)
            .iter()
            .zip(flat(&theta))
            .map(|(a, b)| 0.5 * a + 0.5 * b)
            .collect();
        assert!(crate::test_model::close(&half, &mid, 1e-6));
    }
}
