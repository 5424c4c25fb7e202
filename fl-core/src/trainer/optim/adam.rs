//! Adam (with optional L2 weight decay) in one pass, bit for bit Burn's `Adam`.

use burn::optim::{LearningRate, Optimizer, StateSink, StateSource};
use burn::tensor::{Device, Tensor, TensorData};
use rayon::prelude::*;

use super::{CHUNK, fused, host_values, load};

/// Adam as Burn's `AdamConfig` builds it (no AMSGrad): `g ← g + λ·w`;
/// `m ← β₁·m + (1 − β₁)·g`, `v ← β₂·v + (1 − β₂)·g²` (`(1 − β₁)·g` and `(1 − β₂)·g²` on the
/// first step); `w ← w − lr · (m·c) / (√v + ε·b)` with `b = √(1 − β₂ᵗ)` and `c = b / (1 − β₁ᵗ)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FusedAdam {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    /// The weight-decay penalty λ, when on.
    penalty: Option<f32>,
}

/// The per-step constants of one element's update.
#[derive(Clone, Copy)]
struct StepConstants {
    lr: f32,
    /// `1 − β₁`, `1 − β₂`.
    keep_1: f32,
    keep_2: f32,
    /// `c` and `ε·b` of [`FusedAdam`]'s formula.
    combined: f32,
    epsilon: f32,
}

impl FusedAdam {
    /// Adam with the given β₁, β₂, ε and weight decay λ (0 turns it off).
    pub fn new(beta_1: f32, beta_2: f32, epsilon: f32, weight_decay: f64) -> Self {
        FusedAdam {
            beta_1,
            beta_2,
            epsilon,
            penalty: (weight_decay > 0.0).then_some(weight_decay as f32),
        }
    }

    /// PyTorch's defaults (β = 0.9, 0.999, ε = 1e-8) with weight decay λ (0 turns it off).
    pub fn pytorch(weight_decay: f64) -> Self {
        Self::new(0.9, 0.999, 1e-8, weight_decay)
    }

    /// The optimiser over a whole module.
    pub fn init(self) -> burn::optim::ModuleOptimizer {
        self.into()
    }

    /// The constants of step `time` (1 for the first), computed as Burn computes them.
    fn constants(&self, lr: LearningRate, time: usize) -> StepConstants {
        let time = time as i32;
        let correction_2 = (1.0 - self.beta_2.powi(time)).sqrt();
        StepConstants {
            lr: lr as f32,
            keep_1: 1.0 - self.beta_1,
            keep_2: 1.0 - self.beta_2,
            combined: correction_2 / (1.0 - self.beta_1.powi(time)),
            epsilon: self.epsilon * correction_2,
        }
    }

    /// One element's step: the new weight and moments (`m = None` on the first step).
    /// `DECAY` says whether the weight decay is on (compile-time, so the loops calling this
    /// have no branch per element and vectorize).
    #[inline(always)]
    fn element<const DECAY: bool>(
        &self,
        c: StepConstants,
        w: f32,
        g: f32,
        m: Option<(f32, f32)>,
    ) -> [f32; 3] {
        let g = if DECAY {
            w * self.penalty.unwrap_or(0.0) + g
        } else {
            g
        };
        let (m1, m2) = match m {
            Some((m1, m2)) => (
                m1 * self.beta_1 + g * c.keep_1,
                m2 * self.beta_2 + (g * g) * c.keep_2,
            ),
            None => (g * c.keep_1, (g * g) * c.keep_2),
        };
        let step = (m1 * c.combined) / (m2.sqrt() + c.epsilon);
        [w - step * c.lr, m1, m2]
    }

    /// The step on host memory: `w`, `m1` and `m2` updated in place.
    fn step_values(
        &self,
        c: StepConstants,
        w: &mut [f32],
        g: &[f32],
        (m1, m2): (&mut [f32], &mut [f32]),
        first: bool,
    ) {
        // The configuration's branches taken once, not per element (with them inside, the
        // loop stayed scalar).
        match (self.penalty.is_some(), first) {
            (false, false) => self.step_with::<false, false>(c, w, g, m1, m2),
            (false, true) => self.step_with::<false, true>(c, w, g, m1, m2),
            (true, false) => self.step_with::<true, false>(c, w, g, m1, m2),
            (true, true) => self.step_with::<true, true>(c, w, g, m1, m2),
        }
    }

    /// [`FusedAdam::step_values`] with weight decay `DECAY`, on the first step if `FIRST`.
    fn step_with<const DECAY: bool, const FIRST: bool>(
        &self,
        c: StepConstants,
        w: &mut [f32],
        g: &[f32],
        m1: &mut [f32],
        m2: &mut [f32],
    ) {
        w.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .zip(m1.par_chunks_mut(CHUNK).zip(m2.par_chunks_mut(CHUNK)))
            .for_each(|((w, g), (m1, m2))| {
                let moments = m1.iter_mut().zip(m2.iter_mut());
                for ((w, &g), (m1, m2)) in w.iter_mut().zip(g).zip(moments) {
                    let m = (!FIRST).then_some((*m1, *m2));
                    [*w, *m1, *m2] = self.element::<DECAY>(c, *w, g, m);
                }
            });
    }

    /// Burn's sequence of tensor ops, for tensors the fused pass does not handle.
    fn step_tensors<const D: usize>(
        &self,
        c: StepConstants,
        w: Tensor<D>,
        mut g: Tensor<D>,
        m: Option<(Tensor<D>, Tensor<D>)>,
    ) -> (Tensor<D>, Tensor<D>, Tensor<D>) {
        if let Some(p) = self.penalty {
            g = w.clone().mul_scalar(p).add(g);
        }
        let (m1, m2) = match m {
            Some((m1, m2)) => (
                m1.mul_scalar(self.beta_1)
                    .add(g.clone().mul_scalar(c.keep_1)),
                m2.mul_scalar(self.beta_2)
                    .add(g.square().mul_scalar(c.keep_2)),
            ),
            None => (
                g.clone().mul_scalar(c.keep_1),
                g.square().mul_scalar(c.keep_2),
            ),
        };
        let step = m1
            .clone()
            .mul_scalar(c.combined)
            .div(m2.clone().sqrt().add_scalar(c.epsilon));
        (w - step.mul_scalar(c.lr), m1, m2)
    }
}

/// [`FusedAdam`]'s state of one parameter: the step count and the two moments.
#[derive(Clone)]
pub struct AdamMoments<const D: usize> {
    time: usize,
    moment_1: Tensor<D>,
    moment_2: Tensor<D>,
}

impl<const D: usize> burn::optim::RecordState for AdamMoments<D> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        let time = TensorData::new(vec![self.time as i64], [1]);
        out.push_tensor(prefix, "time", time);
        out.push_tensor(prefix, "moment_1", self.moment_1.to_data());
        out.push_tensor(prefix, "moment_2", self.moment_2.to_data());
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, device: &Device) -> Option<Self> {
        let time = src.take_tensor(prefix, "time")?.try_to_vec::<i64>().ok()?;
        let mut moment = |leaf| Some(Tensor::from_data(src.take_tensor(prefix, leaf)?, device));
        Some(AdamMoments {
            time: usize::try_from(*time.first()?).ok()?,
            moment_1: moment("moment_1")?,
            moment_2: moment("moment_2")?,
        })
    }
}

impl Optimizer for FusedAdam {
    type State<const D: usize> = AdamMoments<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let time = state.as_ref().map_or(1, |s| s.time + 1);
        let c = self.constants(lr, time);
        let moments = state.map(|s| (s.moment_1, s.moment_2));
        let others = [
            Some(&grad),
            moments.as_ref().map(|m| &m.0),
            moments.as_ref().map(|m| &m.1),
        ];
        if !fused(&tensor, &others) {
            let (w, moment_1, moment_2) = self.step_tensors(c, tensor, grad, moments);
            return (
                w,
                Some(AdamMoments {
                    time,
                    moment_1,
                    moment_2,
                }),
            );
        }
        let device = tensor.device();
        let first = moments.is_none();
        let (mut w, mut g) = (tensor.into_data(), grad.into_data());
        let (mut m1, mut m2) = match moments {
            Some((m1, m2)) => (m1.into_data(), m2.into_data()),
            None => {
                let zeros = || TensorData::new(vec![0.0f32; g.num_elements()], g.shape().clone());
                (zeros(), zeros())
            }
        };
        self.step_values(
            c,
            host_values(&mut w),
            host_values(&mut g),
            (host_values(&mut m1), host_values(&mut m2)),
            first,
        );
        let state = AdamMoments {
            time,
            moment_1: load(m1, &device),
            moment_2: load(m2, &device),
        };
        (load(w, &device), Some(state))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        AdamMoments {
            time: state.time,
            moment_1: state.moment_1.to_device(device),
            moment_2: state.moment_2.to_device(device),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trainer::optim::tests::assert_same_steps;
    use burn::optim::AdamConfig;
    use burn::optim::decay::WeightDecayConfig;
    use burn::tensor::Distribution;

    /// Several steps of both optimisers from the same start with the same inputs: weights equal
    /// bit for bit, with and without weight decay, for PyTorch's and Burn's ε; and the same
    /// through the tensor-op path (`set_fused_optimizers(false)` is process-wide, so that path
    /// is tested directly).
    #[test]
    fn matches_burns_adam_bit_for_bit() {
        for (epsilon, decay) in [(1e-8, 0.0), (1e-5, 5e-4)] {
            let burn = AdamConfig::new()
                .with_epsilon(epsilon)
                .with_weight_decay((decay > 0.0).then(|| WeightDecayConfig::new(decay as f32)))
                .init();
            let adam = FusedAdam::new(0.9, 0.999, epsilon, decay);
            let case = (epsilon, decay);
            assert_same_steps(burn, adam.into(), 1e-3, &format!("{case:?}"));

            let shape = [70_000];
            let t =
                || Tensor::<1>::random(shape, Distribution::Normal(0.0, 1.0), &Device::default());
            let (w, g, m1) = (t(), t(), t());
            let m2 = t().abs();
            // A run-time step count, as in `step` (a constant one lets the compiler expand
            // `powi` into multiplications associated differently from the run-time call's).
            let c = adam.constants(1e-3, std::hint::black_box(3));
            let (w1, ..) =
                adam.step_tensors(c, w.clone(), g.clone(), Some((m1.clone(), m2.clone())));
            let state = AdamMoments {
                time: 2,
                moment_1: m1,
                moment_2: m2,
            };
            let (w2, _) = adam.step(1e-3, w, g, Some(state));
            assert_eq!(w1.into_data(), w2.into_data(), "{case:?}: tensor path");
        }
    }
}
