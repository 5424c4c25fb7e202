//! Sharpness-aware local steps (SAM, Foret et al. 2021; ASAM, Kwon et al. ICML 2021), FedASAM's
//! local optimiser.
//!
//! Every local step takes two gradients: `g` at the weights `w`, then the descent gradient at
//! `w + ε` with `ε = ρ · T² g / ‖T g‖`, where `T = |w| + η` on weights (convolution and linear
//! weights, BatchNorm scales) and `T = 1` on biases, as in the ASAM authors' code. The optimiser
//! (SGD with momentum) then applies the second gradient to the unperturbed `w`. With
//! `adaptive = false` it is SAM (`T = 1` everywhere: FedSAM). Paper defaults: ρ = 0.1, η = 0.

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

/// Settings of sharpness-aware local steps: every step takes the descent gradient at `w + ε`,
/// `ε = ρ · T² g / ‖T g‖` with `T = |w| + η` on weights (ASAM) or `T = 1` (SAM).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SharpnessAware {
    /// Neighbourhood radius ρ.
    pub rho: f64,
    /// η added to `|w|` in the adaptive scaling (ASAM only).
    pub eta: f64,
    /// ASAM (scale-invariant neighbourhood) rather than SAM.
    pub adaptive: bool,
}

impl SharpnessAware {
    /// ASAM with radius `rho` and offset `eta`.
    pub fn asam(rho: f64, eta: f64) -> Self {
        Self {
            rho,
            eta,
            adaptive: true,
        }
    }

    /// Plain SAM with radius `rho`.
    pub fn sam(rho: f64) -> Self {
        Self {
            rho,
            eta: 0.0,
            adaptive: false,
        }
    }

    /// Checks ρ > 0 and η ≥ 0.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.rho.is_finite() && self.rho > 0.0) {
            return Err(format!("ASAM rho must be > 0, got {}", self.rho));
        }
        if !(self.eta.is_finite() && self.eta >= 0.0) {
            return Err(format!("ASAM eta must be >= 0, got {}", self.eta));
        }
        Ok(())
    }

    /// `model` moved to `w + ε` along `grads` (its gradients at `w`). Parameter ids, devices and
    /// autodiff settings are kept, so the gradients taken at the result apply to `model`.
    pub fn perturb<M: Module>(&self, model: M, grads: &GradientsParams) -> M {
        let mut directions = Directions {
            sam: self,
            grads,
            path: Vec::new(),
            directions: HashMap::new(),
            sq_norms: Vec::new(),
        };
        model.visit(&mut directions);
        if directions.sq_norms.is_empty() {
            return model;
        }
        let norm = Tensor::cat(directions.sq_norms, 0)
            .sum()
            .sqrt()
            .into_scalar::<f32>() as f64;
        // The ASAM code's 1e-16 guard, at f32 scale.
        let scale = self.rho / (norm + 1e-12);
        model.map(&mut Shift {
            directions: directions.directions,
            scale,
        })
    }
}

/// Whether a parameter is scaled by `|w| + η` in ASAM: PyTorch's "weight" tensors (Burn calls
/// BatchNorm's scale `gamma`), not biases.
fn is_scaled(name: &str) -> bool {
    matches!(name, "weight" | "gamma")
}

/// First pass: per parameter, the unnormalised direction `T² g` and `‖T g‖²`.
struct Directions<'a> {
    sam: &'a SharpnessAware,
    grads: &'a GradientsParams,
    path: Vec<String>,
    directions: HashMap<ParamId, Tensor<1>>,
    sq_norms: Vec<Tensor<1>>,
}

impl ModuleVisitor for Directions<'_> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let Some(grad) = self.grads.get::<D>(param.id) else {
            return; // buffers and frozen parameters have no gradient
        };
        let grad = grad.flatten::<1>(0, D - 1);
        let scaled = self.sam.adaptive && self.path.last().is_some_and(|n| is_scaled(n));
        let (scaled_grad, direction) = if scaled {
            let t = param
                .val()
                .inner()
                .flatten::<1>(0, D - 1)
                .abs()
                .add_scalar(self.sam.eta);
            let tg = grad * t.clone();
            (tg.clone(), tg * t)
        } else {
            (grad.clone(), grad)
        };
        self.sq_norms.push(scaled_grad.square().sum());
        self.directions.insert(param.id, direction);
    }
}

/// Second pass: `w + scale · direction` for every parameter that has a direction.
struct Shift {
    directions: HashMap<ParamId, Tensor<1>>,
    scale: f64,
}

impl ModuleMapper for Shift {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(direction) = self.directions.remove(&param.id) else {
            return param;
        };
        let scale = self.scale;
        // A fresh leaf on the parameter's own device: tracked like the original, same id.
        param.map(|w| {
            let checkpointing = w.gradient_checkpointing_strategy();
            let w = w.inner();
            let shape = w.shape();
            let shifted = w + direction.mul_scalar(scale).reshape(shape);
            match checkpointing {
                // Burn's `autodiff()` alone gives the default strategy, and ops mixing two panic.
                Some(strategy) => shifted
                    .autodiff()
                    .with_gradient_checkpointing_strategy(strategy)
                    .require_grad(),
                None => shifted,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_model::{TinyNet, device, tracked};
    use crate::{Classifier, ParamTable};
    use burn::nn::loss::CrossEntropyLossConfig;
    use burn::tensor::{Distribution, Int};

    fn grads_of(model: &TinyNet) -> GradientsParams {
        let d = device().autodiff();
        let x = Tensor::<4>::random([4, 1, 8, 8], Distribution::Default, &d);
        let y = Tensor::<1, Int>::from_ints([0, 1, 2, 3], &d);
        let loss = CrossEntropyLossConfig::new()
            .init(&d)
            .forward(model.forward(x), y);
        GradientsParams::from_grads(loss.backward(), model)
    }

    /// ε has norm ρ in the scaled space (‖T⁻¹ε‖ = ρ), biases move by plain gradients, and
    /// buffers do not move.
    #[test]
    fn perturbation_has_radius_rho_in_the_adaptive_metric() {
        let model = tracked(3);
        let grads = grads_of(&model);
        for sam in [SharpnessAware::asam(0.5, 0.01), SharpnessAware::sam(0.05)] {
            let before = ParamTable::from_module(&model);
            let after = ParamTable::from_module(&sam.perturb(model.clone(), &grads));
            let mut sq = 0.0f64;
            for ((w0, w1), info) in before
                .to_host()
                .unwrap()
                .iter()
                .zip(after.to_host().unwrap())
                .zip(before.layout().tensors())
            {
                let leaf = info.name.rsplit('.').next().unwrap();
                for (a, b) in w0.iter().zip(&w1) {
                    let eps = (b - a) as f64;
                    let t = if sam.adaptive && is_scaled(leaf) {
                        a.abs() as f64 + sam.eta
                    } else {
                        1.0
                    };
                    sq += (eps / t).powi(2);
                }
                if info.name.contains("running") {
                    assert_eq!(w0, &w1, "{} moved", info.name);
                }
            }
            assert!(
                (sq.sqrt() - sam.rho).abs() < 1e-3 * sam.rho,
                "{sam:?}: radius {}",
                sq.sqrt()
            );
        }
    }

    /// The perturbed copy keeps parameter ids (its gradients apply to the original) and leaves
    /// the original untouched.
    #[test]
    fn perturbed_copy_keeps_ids_and_the_original() {
        let model: TinyNet = tracked(4);
        let grads = grads_of(&model);
        let before = ParamTable::from_module(&model).to_host().unwrap();
        let perturbed = SharpnessAware::asam(0.1, 0.0).perturb(model.clone(), &grads);
        assert_eq!(ParamTable::from_module(&model).to_host().unwrap(), before);
        assert_eq!(model.fc1.weight.id, perturbed.fc1.weight.id);
        let grads2 = grads_of(&perturbed);
        assert!(grads2.get::<2>(model.fc1.weight.id).is_some());
    }

    #[test]
    fn bad_settings_are_rejected() {
        assert!(SharpnessAware::asam(0.0, 0.0).validate().is_err());
        assert!(SharpnessAware::asam(0.1, -1.0).validate().is_err());
        assert!(SharpnessAware::asam(f64::NAN, 0.0).validate().is_err());
        assert!(SharpnessAware::asam(0.1, 0.0).validate().is_ok());
    }
}
