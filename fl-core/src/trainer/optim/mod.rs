//! The local optimisers as one parallel pass per parameter on CPU tensors, bit for bit Burn's.
//!
//! Burn's `Sgd` and `Adam` run four to twelve elementwise tensor ops per parameter, each a
//! separate single-threaded pass over memory on the flex backend (10–15% of a two-thread
//! training step of the FC-heavy models: VGG-16, CNN1–CNN4, the FedAvg CNN). [`FusedSgd`] and
//! [`FusedAdam`] compute the same expressions, in the same order and with the same `f32`
//! roundings (no fused multiply-adds), in one pass over the weight, the gradient and the state
//! on the thread pool. Other backends and dtypes run the same expressions as tensor ops
//! (Burn's own sequence), so results never depend on which path ran.

use burn::tensor::{DType, Tensor, TensorData};
use std::sync::atomic::{AtomicBool, Ordering};

mod adam;
mod sgd;
pub use adam::{AdamMoments, FusedAdam};
pub use sgd::{FusedSgd, SgdVelocity};

/// Elements per task on the thread pool: large enough that small parameters (biases, BatchNorm)
/// run in one piece on the calling thread.
const CHUNK: usize = 1 << 15;

/// Whether the fused optimisers take their one-pass path (on by default).
static FUSED: AtomicBool = AtomicBool::new(true);

/// Turns the one-pass path of [`FusedSgd`] and [`FusedAdam`] on or off for the whole process
/// (off, they run Burn's sequence of tensor ops): for A/B timing
/// (`fl bench --burn-kernels=optimizer`); results are the same either way.
pub fn set_fused_optimizers(enabled: bool) {
    FUSED.store(enabled, Ordering::Relaxed);
}

/// Whether the one-pass path is on (see [`set_fused_optimizers`]).
pub fn fused_optimizers() -> bool {
    FUSED.load(Ordering::Relaxed)
}

/// Whether the one-pass path handles these tensors: switched on, `f32`, in host memory (the
/// flex backend), of one shape.
fn fused<const D: usize>(first: &Tensor<D>, others: &[Option<&Tensor<D>>]) -> bool {
    fused_optimizers()
        && on_host(first)
        && others
            .iter()
            .flatten()
            .all(|t| on_host(t) && t.shape() == first.shape())
}

fn on_host<const D: usize>(t: &Tensor<D>) -> bool {
    #[cfg(feature = "flex")]
    {
        use burn::backend::DispatchDevice;
        t.dtype() == DType::F32
            && matches!(t.device().inner().as_dispatch(), DispatchDevice::Flex(_))
    }
    #[cfg(not(feature = "flex"))]
    {
        let _ = (t, DType::F32);
        false
    }
}

/// The values of a tensor's data in host memory (moved out of the tensor when nothing else
/// held it, so writing them copies nothing).
fn host_values(data: &mut TensorData) -> &mut [f32] {
    data.as_mut_slice::<f32>()
        .expect("fused optimiser: f32 tensors in host memory (checked by `fused`)")
}

/// A tensor of `f32` values on `device`.
fn load<const D: usize>(data: TensorData, device: &burn::tensor::Device) -> Tensor<D> {
    Tensor::from_data(data, (device, DType::F32))
}

#[cfg(test)]
mod tests {
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::{GradientsParams, ModuleOptimizer};
    use burn::tensor::{Device, Distribution, Tensor};

    /// The weight and bias of `m`, bit for bit.
    fn bits(m: &Linear) -> Vec<u32> {
        let mut out = Vec::new();
        for t in [
            m.weight.val().into_data(),
            m.bias.clone().unwrap().val().into_data(),
        ] {
            out.extend(t.as_slice::<f32>().unwrap().iter().map(|x| x.to_bits()));
        }
        out
    }

    /// Four steps of `burn` and `fused` at `lr` from the same start on the same inputs, on
    /// tensors larger than one chunk (so the fused pass runs on the thread pool): the weights
    /// must agree bit for bit and must have moved.
    pub(super) fn assert_same_steps(
        mut burn: ModuleOptimizer,
        mut fused: ModuleOptimizer,
        lr: f64,
        case: &str,
    ) {
        let device = Device::default().autodiff();
        let start = LinearConfig::new(300, 150).init(&device);
        let inputs: Vec<Tensor<2>> = (0..4)
            .map(|_| Tensor::random([8, 300], Distribution::Normal(0.0, 1.0), &device))
            .collect();
        let (mut a, mut b) = (start.clone(), start.clone());
        for x in &inputs {
            let step = |m: Linear, optim: &mut ModuleOptimizer| {
                let loss = m.forward(x.clone()).powi_scalar(2).mean();
                let grads = GradientsParams::from_grads(loss.backward(), &m);
                optim.step(lr, m, grads)
            };
            a = step(a, &mut burn);
            b = step(b, &mut fused);
        }
        assert_eq!(bits(&a), bits(&b), "{case}");
        assert_ne!(bits(&a), bits(&start), "{case}: the steps moved nothing");
    }
}
