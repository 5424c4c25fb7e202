//! SGD (momentum, dampening, Nesterov, weight decay) in one pass, bit for bit Burn's `Sgd`.

use burn::optim::{LearningRate, Optimizer, StateSink, StateSource};
use burn::tensor::{Device, Tensor};
use rayon::prelude::*;

use super::{CHUNK, fused, host_values, load};

/// SGD with optional momentum (dampening, Nesterov) and L2 weight decay, as Burn's
/// `SgdConfig` builds it: `g ← g + λ·w`; `v ← (1 − d)·g + μ·v` (`v ← g` on the first step);
/// `g ← v` (or `g + μ·v` with Nesterov); `w ← w − lr·g`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FusedSgd {
    /// `(μ, 1 − d, nesterov)` when momentum is on.
    momentum: Option<(f32, f32, bool)>,
    /// The weight-decay penalty λ, when on.
    penalty: Option<f32>,
}

impl FusedSgd {
    /// SGD with the given momentum `μ`, dampening `d` and weight decay `λ` (0 turns either off,
    /// as in `TrainConfig`).
    pub fn new(momentum: f64, dampening: f64, nesterov: bool, weight_decay: f64) -> Self {
        // The same conversions to f32 as Burn's `Momentum`, `WeightDecay` and `mul_scalar`.
        FusedSgd {
            momentum: (momentum > 0.0).then_some((
                momentum as f32,
                (1.0 - dampening) as f32,
                nesterov,
            )),
            penalty: (weight_decay > 0.0).then_some(weight_decay as f32),
        }
    }

    /// Plain SGD: `w ← w − lr·g`.
    pub fn plain() -> Self {
        Self::new(0.0, 0.0, false, 0.0)
    }

    /// The optimiser over a whole module.
    pub fn init(self) -> burn::optim::ModuleOptimizer {
        self.into()
    }

    /// One element's step: the new weight and, with momentum, the new velocity. `DECAY`,
    /// `MOMENTUM` and `NESTEROV` say which of the configuration's terms are on (compile-time,
    /// so the loops calling this have no branch per element and vectorize).
    #[inline(always)]
    fn element<const DECAY: bool, const MOMENTUM: bool, const NESTEROV: bool>(
        (penalty, momentum, keep): (f32, f32, f32),
        lr: f32,
        w: f32,
        g: f32,
        v: Option<f32>,
    ) -> (f32, f32) {
        let g = if DECAY { w * penalty + g } else { g };
        let (g, v) = if MOMENTUM {
            let v = match v {
                Some(v) => g * keep + v * momentum,
                None => g,
            };
            (if NESTEROV { v * momentum + g } else { v }, v)
        } else {
            (g, 0.0)
        };
        (w - g * lr, v)
    }

    /// The step on host memory: `w` and (with momentum) the velocity updated in place.
    fn step_values(&self, lr: f32, w: &mut [f32], g: &mut [f32], v: Option<&mut [f32]>) {
        // The configuration's branches taken once, not per element: with them inside, the
        // loops stayed scalar (4% of CNN2's training step on one thread).
        match (self.penalty.is_some(), self.momentum.map(|(_, _, n)| n)) {
            (false, None) => self.step_with::<false, false, false>(lr, w, g, v),
            (true, None) => self.step_with::<true, false, false>(lr, w, g, v),
            (false, Some(false)) => self.step_with::<false, true, false>(lr, w, g, v),
            (true, Some(false)) => self.step_with::<true, true, false>(lr, w, g, v),
            (false, Some(true)) => self.step_with::<false, true, true>(lr, w, g, v),
            (true, Some(true)) => self.step_with::<true, true, true>(lr, w, g, v),
        }
    }

    /// [`FusedSgd::step_values`] for the configuration `DECAY`, `MOMENTUM`, `NESTEROV`.
    fn step_with<const DECAY: bool, const MOMENTUM: bool, const NESTEROV: bool>(
        &self,
        lr: f32,
        w: &mut [f32],
        g: &mut [f32],
        v: Option<&mut [f32]>,
    ) {
        let (momentum, keep, _) = self.momentum.unwrap_or((0.0, 0.0, false));
        let c = (self.penalty.unwrap_or(0.0), momentum, keep);
        let element = Self::element::<DECAY, MOMENTUM, NESTEROV>;
        match (MOMENTUM, v) {
            (false, _) => w
                .par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK))
                .for_each(|(w, g)| {
                    for (w, &g) in w.iter_mut().zip(g) {
                        *w = element(c, lr, *w, g, None).0;
                    }
                }),
            // First step: the velocity is the (decayed) gradient, written over the gradient's
            // buffer, which becomes the state.
            (true, None) => w
                .par_chunks_mut(CHUNK)
                .zip(g.par_chunks_mut(CHUNK))
                .for_each(|(w, g)| {
                    for (w, g) in w.iter_mut().zip(g) {
                        (*w, *g) = element(c, lr, *w, *g, None);
                    }
                }),
            (true, Some(v)) => w
                .par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK))
                .zip(v.par_chunks_mut(CHUNK))
                .for_each(|((w, g), v)| {
                    for ((w, &g), v) in w.iter_mut().zip(g).zip(v) {
                        (*w, *v) = element(c, lr, *w, g, Some(*v));
                    }
                }),
        }
    }

    /// Burn's sequence of tensor ops, for tensors the fused pass does not handle.
    fn step_tensors<const D: usize>(
        &self,
        lr: LearningRate,
        w: Tensor<D>,
        mut g: Tensor<D>,
        v: Option<Tensor<D>>,
    ) -> (Tensor<D>, Option<Tensor<D>>) {
        if let Some(p) = self.penalty {
            g = w.clone().mul_scalar(p).add(g);
        }
        let mut velocity = None;
        if let Some((m, keep, nesterov)) = self.momentum {
            let v = match v {
                Some(v) => g.clone().mul_scalar(keep).add(v.mul_scalar(m)),
                None => g.clone(),
            };
            g = if nesterov {
                v.clone().mul_scalar(m).add(g)
            } else {
                v.clone()
            };
            velocity = Some(v);
        }
        (w - g.mul_scalar(lr), velocity)
    }
}

/// [`FusedSgd`]'s state of one parameter: the momentum velocity, if any.
#[derive(Clone)]
pub struct SgdVelocity<const D: usize>(Option<Tensor<D>>);

impl<const D: usize> burn::optim::RecordState for SgdVelocity<D> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        if let Some(v) = &self.0 {
            out.push_tensor(prefix, "velocity", v.to_data());
        }
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, device: &Device) -> Option<Self> {
        let v = src.take_tensor(prefix, "velocity");
        Some(SgdVelocity(v.map(|data| Tensor::from_data(data, device))))
    }
}

impl Optimizer for FusedSgd {
    type State<const D: usize> = SgdVelocity<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let velocity = state.and_then(|s| s.0);
        if !fused(&tensor, &[Some(&grad), velocity.as_ref()]) {
            let (w, v) = self.step_tensors(lr, tensor, grad, velocity);
            return (w, Some(SgdVelocity(v)));
        }
        let device = tensor.device();
        let (mut w, mut g) = (tensor.into_data(), grad.into_data());
        let mut v = velocity.map(Tensor::into_data);
        self.step_values(
            lr as f32,
            host_values(&mut w),
            host_values(&mut g),
            v.as_mut().map(host_values),
        );
        let velocity = match (self.momentum, v) {
            (None, _) => None,
            (Some(_), Some(v)) => Some(v),
            (Some(_), None) => Some(g),
        };
        let velocity = velocity.map(|v| load(v, &device));
        (load(w, &device), Some(SgdVelocity(velocity)))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        SgdVelocity(state.0.map(|v| v.to_device(device)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trainer::optim::tests::assert_same_steps;
    use burn::optim::SgdConfig;
    use burn::optim::decay::WeightDecayConfig;
    use burn::optim::momentum::MomentumConfig;
    use burn::tensor::Distribution;

    /// Several steps of both optimisers from the same start with the same gradients: weights
    /// equal bit for bit, for every combination of momentum, dampening, Nesterov and decay.
    #[test]
    fn matches_burns_sgd_bit_for_bit() {
        let cases = [
            (0.0, 0.0, false, 0.0),
            (0.5, 0.0, false, 0.0),
            (0.9, 0.1, false, 5e-4),
            (0.9, 0.0, true, 1e-3),
            (0.0, 0.0, false, 1e-2),
        ];
        for (momentum, dampening, nesterov, decay) in cases {
            let burn = SgdConfig::new()
                .with_momentum((momentum > 0.0).then(|| {
                    MomentumConfig::new()
                        .with_momentum(momentum)
                        .with_dampening(dampening)
                        .with_nesterov(nesterov)
                }))
                .with_weight_decay((decay > 0.0).then(|| WeightDecayConfig::new(decay as f32)))
                .init();
            let fused = FusedSgd::new(momentum, dampening, nesterov, decay).into();
            let case = format!("{:?}", (momentum, dampening, nesterov, decay));
            assert_same_steps(burn, fused, 0.05, &case);
        }
    }

    /// The tensor-op path (other backends) gives the fused pass's values too.
    #[test]
    fn tensor_path_matches_fused_pass() {
        let device = Device::default();
        let sgd = FusedSgd::new(0.9, 0.1, true, 1e-3);
        let shape = [70_000];
        let w = Tensor::<1>::random(shape, Distribution::Normal(0.0, 1.0), &device);
        let g = Tensor::<1>::random(shape, Distribution::Normal(0.0, 1.0), &device);
        let v = Tensor::<1>::random(shape, Distribution::Normal(0.0, 1.0), &device);
        let (w1, v1) = sgd.step_tensors(0.05, w.clone(), g.clone(), Some(v.clone()));
        let (w2, v2) = sgd.step(0.05, w, g, Some(SgdVelocity(Some(v))));
        let v2 = v2.and_then(|s| s.0).expect("a velocity");
        assert_eq!(w1.into_data(), w2.into_data());
        assert_eq!(v1.expect("a velocity").into_data(), v2.into_data());
    }
}
