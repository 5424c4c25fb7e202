//! Faster convolution, max-pooling, batch normalisation and activations on CPU, used by every
//! model in this crate.
//!
//! On the flex backend (feature `flex`, on by default) 2-D convolutions with groups 1 and
//! dilation 1, unpadded max-pooling and training-mode batch normalisation run hand-written
//! kernels: direct stride-1 convolutions with AVX-512 or AVX2 register tiles where the CPU has
//! AVX-512F or AVX2 with FMA, im2col + gemm per sample straight in NCHW layout otherwise (flex's own convolution
//! converts to channels-last and packs the batch, and computes the weight gradient as a
//! convolution with the whole feature map as its kernel), a direct max-pool whose backward pass
//! recomputes the window maxima instead of keeping an index tensor, and a per-channel two-pass
//! batch norm (Burn's is composed of tensor ops with layout copies). The MobileNets' depthwise
//! convolutions (groups = channels, no bias, any stride) run a direct kernel over stride-phased
//! planes, and their ReLU6 and hard-swish one fused pass each way (Burn composes them of clamps
//! and mask fills). Fully connected layers run Burn's own product and bias bit for bit, minus
//! the copy flex makes of every product's output, and global average pooling runs Burn's sums
//! bit for bit without a thread-pool task per plane. They plug into Burn as backend extensions
//! with their own backward passes, so models stay ordinary backend-generic Burn modules: on any
//! other backend, and for any other convolution (grouped, dilated, `f16`, ...), these functions
//! call Burn's own [`conv2d`](burn::tensor::module::conv2d),
//! [`max_pool2d`](burn::tensor::module::max_pool2d), [`BatchNorm::forward`],
//! [`Linear::forward`] and activations.
//!
//! Results are deterministic and independent of the thread count; they differ from Burn's own
//! kernels only by floating-point summation order.

#[cfg(feature = "flex")]
pub(crate) mod cpu;
#[cfg(feature = "flex")]
mod direct;
#[cfg(feature = "flex")]
mod flex;
#[cfg(feature = "flex")]
mod flex_linear;
#[cfg(feature = "flex")]
mod flex_mobile;
#[cfg(feature = "flex")]
mod flex_norm;
pub(crate) mod isa;
#[cfg(feature = "flex")]
mod lanes16;
#[cfg(all(test, feature = "flex"))]
mod norm_tests;
#[cfg(feature = "flex")]
pub mod roofline;
mod switches;

pub use isa::{Isa, set_max_isa};
pub use switches::{Kernel, enabled, kernel_enabled, set_enabled, set_kernel_enabled};

use burn::nn::PaddingConfig2d;
use burn::nn::conv::Conv2d;
use burn::nn::pool::{AdaptiveAvgPool2d, MaxPool2d};
use burn::nn::{BatchNorm, Linear};
use burn::tensor::Tensor;
use burn::tensor::ops::{ConvOptions, MaxPoolOptions};

/// Whether evaluation may run `images`' feature-map blocks in chunks of the batch: on flex, with
/// chunked evaluation and every kernel family that evaluation runs on (Burn's own convolution
/// packs the whole batch into one `gemm`, whose sums may depend on its size).
pub(crate) fn chunked_inference(images: &Tensor<4>) -> bool {
    #[cfg(feature = "flex")]
    {
        use Kernel::*;
        flex::on_flex(images)
            && [EvalChunks, Conv, Depthwise, MaxPool, BatchNorm, Activation]
                .into_iter()
                .all(kernel_enabled)
    }
    #[cfg(not(feature = "flex"))]
    {
        let _ = images;
        false
    }
}

/// 2-D convolution, as [`burn::tensor::module::conv2d`], on the fast kernels where they apply.
pub fn conv2d(
    x: Tensor<4>,
    weight: Tensor<4>,
    bias: Option<Tensor<1>>,
    options: ConvOptions<2>,
) -> Tensor<4> {
    #[cfg(feature = "flex")]
    if kernel_enabled(Kernel::Conv) && flex::handles_conv2d(&x, &weight, bias.as_ref(), &options) {
        return flex::conv2d(x, weight, bias, options);
    }
    #[cfg(feature = "flex")]
    if kernel_enabled(Kernel::Depthwise)
        && bias.is_none()
        && flex_mobile::handles_depthwise(&x, &weight, &options)
    {
        return flex_mobile::depthwise(x, weight, options);
    }
    burn::tensor::module::conv2d(x, weight, bias, options)
}

/// An elementwise activation (after a convolution in the MobileNets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// No activation (linear bottleneck projections).
    Identity,
    /// ReLU.
    Relu,
    /// min(max(x, 0), 6) (MobileNetV2). The fused kernel passes the gradient where
    /// 0 < x < 6, as PyTorch does (Burn: 0 ≤ x ≤ 6), so that its backward pass can read the
    /// output, which the next layer keeps anyway, and not hold the input.
    Relu6,
    /// x · relu6(x + 3) / 6 (MobileNetV3).
    HardSwish,
}

impl Activation {
    /// Whether the fused kernel's backward pass reads the activation's output (else its input).
    #[cfg(feature = "flex")]
    pub(crate) fn backward_reads_output(self) -> bool {
        matches!(self, Self::Relu | Self::Relu6)
    }

    /// Applies the activation: on the fused parallel kernel (one pass each way) where the
    /// kernels apply, otherwise Burn's own ops.
    pub fn apply<const D: usize>(self, x: Tensor<D>) -> Tensor<D> {
        #[cfg(feature = "flex")]
        if self != Self::Identity && kernel_enabled(Kernel::Activation) && flex_mobile::handles(&x)
        {
            return flex_mobile::activation(x, self);
        }
        match self {
            Self::Identity => x,
            Self::Relu => burn::tensor::activation::relu(x),
            Self::Relu6 => burn::tensor::activation::relu6(x),
            Self::HardSwish => burn::tensor::activation::hard_swish(x),
        }
    }
}

/// ReLU, bitwise as Burn's [`relu`](burn::tensor::activation::relu), on the parallel kernel
/// where it applies.
pub fn relu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    Activation::Relu.apply(x)
}

/// `a + b` (a residual connection), bitwise as Burn's addition: in one parallel pass where the
/// kernels apply (Burn's runs on one thread), else Burn's op.
pub fn add<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> Tensor<D> {
    add_activation(a, b, Activation::Identity)
}

/// `relu(a + b)` (a residual connection and its activation), bitwise as the two ops, in one
/// parallel pass where the kernels apply (see [`add`]).
pub fn add_relu<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> Tensor<D> {
    add_activation(a, b, Activation::Relu)
}

fn add_activation<const D: usize>(a: Tensor<D>, b: Tensor<D>, act: Activation) -> Tensor<D> {
    #[cfg(feature = "flex")]
    if kernel_enabled(Kernel::Activation)
        && a.dims() == b.dims()
        && flex_mobile::handles(&a)
        && flex_mobile::handles(&b)
    {
        return flex_mobile::add_activation(a, b, act);
    }
    act.apply(a + b)
}

/// 2-D max-pooling, as [`burn::tensor::module::max_pool2d`], on the fast kernel where it applies.
pub fn max_pool2d(x: Tensor<4>, options: MaxPoolOptions<2>) -> Tensor<4> {
    #[cfg(feature = "flex")]
    if kernel_enabled(Kernel::MaxPool) && flex::handles_max_pool2d(&x, &options) {
        return flex::max_pool2d(x, options);
    }
    burn::tensor::module::max_pool2d(x, options)
}

/// Burn's [`BatchNorm::forward`] for `[batch, channels, h, w]` maps, with the training pass
/// (batch statistics, running-statistics update) and the inference pass (running statistics;
/// evaluation and frozen layers) on the fast kernels where they apply.
pub fn batch_norm_forward(norm: &BatchNorm, x: Tensor<4>) -> Tensor<4> {
    batch_norm_act(norm, x, Activation::Identity)
}

/// `act(`[`batch_norm_forward`]`(norm, x))`, bit for bit, with the activation applied in the
/// training pass's own passes (one pass over the maps fewer each way) where the kernels apply.
pub fn batch_norm_act(norm: &BatchNorm, x: Tensor<4>, act: Activation) -> Tensor<4> {
    #[cfg(feature = "flex")]
    use Activation::Identity;
    #[cfg(feature = "flex")]
    if kernel_enabled(Kernel::BatchNorm) && flex_norm::handles_batch_norm(&x, &norm.gamma.val()) {
        let device = x.device();
        // Burn's own choice between the two passes.
        if device.is_autodiff() && norm.training.is_enabled() {
            // Fused only where the activation's own kernel would run (the switches' A/B).
            let fused = if kernel_enabled(Kernel::Activation) {
                act
            } else {
                Identity
            };
            let (y, mean, var) = flex_norm::batch_norm_train(
                x,
                norm.gamma.val(),
                norm.beta.val(),
                norm.epsilon,
                fused,
            );
            // The running statistics as Burn's BatchNorm updates them.
            let update = |state: &burn::module::RunningState<Tensor<1>>, batch: Tensor<1>| {
                let running = state.value_sync().to_device(&device);
                let updated = running
                    .mul_scalar(1.0 - norm.momentum)
                    .add(batch.detach().mul_scalar(norm.momentum));
                state.update(updated.detach());
            };
            update(&norm.running_mean, mean);
            update(&norm.running_var, var);
            return if fused == act { y } else { act.apply(y) };
        }
        // Inference (evaluation, frozen layers), where only `x` can take a gradient.
        let (gamma, beta) = (norm.gamma.val(), norm.beta.val());
        if !gamma.is_require_grad() && !beta.is_require_grad() {
            let mean = norm.running_mean.value().to_device(&device);
            let var = norm.running_var.value().to_device(&device);
            // As Burn's `batch_norm` computes it: the same value, bit for bit.
            let std = var.add_scalar(norm.epsilon).sqrt();
            let (params, stats) = ((gamma, beta), (mean, std));
            return match kernel_enabled(Kernel::Activation) && flex_mobile::handles(&x) {
                true => flex_norm::batch_norm_inference(x, params, stats, act),
                false => act.apply(flex_norm::batch_norm_inference(x, params, stats, Identity)),
            };
        }
    }
    act.apply(norm.forward(x))
}

/// Burn's [`Linear::forward`] for a batch of vectors, bit for bit, on the flex kernel where it
/// applies (a layer with a bias, `f32`).
pub fn linear(layer: &Linear, x: Tensor<2>) -> Tensor<2> {
    #[cfg(feature = "flex")]
    if let Some(bias) = &layer.bias {
        let (weight, bias) = (layer.weight.val(), bias.val());
        if kernel_enabled(Kernel::Linear) && flex_linear::handles(&x, &weight, &bias) {
            return flex_linear::linear(x, weight, bias);
        }
    }
    layer.forward(x)
}

/// Burn's [`Conv2d::forward`] on the fast kernels: the same padding rules and parameters.
pub fn conv2d_forward(conv: &Conv2d, x: Tensor<4>) -> Tensor<4> {
    let [_, _, h, w] = x.dims();
    let ((top, bottom), (left, right)) =
        padding_pairs(&conv.padding, [h, w], conv.kernel_size, conv.stride);
    let options = ConvOptions::new_with_padding(
        conv.stride,
        [(top, bottom), (left, right)],
        conv.dilation,
        conv.groups,
    );
    conv2d(
        x,
        conv.weight.val(),
        conv.bias.as_ref().map(|b| b.val()),
        options,
    )
}

/// Burn's [`AdaptiveAvgPool2d::forward`], bit for bit: on the flex kernel where the output is
/// 1 × 1 (global average pooling), else Burn's own op.
pub fn adaptive_avg_pool2d_forward(pool: &AdaptiveAvgPool2d, x: Tensor<4>) -> Tensor<4> {
    #[cfg(feature = "flex")]
    if pool.output_size == [1, 1]
        && kernel_enabled(Kernel::AvgPool)
        && flex_mobile::handles_global_avg_pool(&x)
    {
        return flex_mobile::global_avg_pool(x);
    }
    pool.forward(x)
}

/// Burn's [`MaxPool2d::forward`] on the fast kernel: the same options.
pub fn max_pool2d_forward(pool: &MaxPool2d, x: Tensor<4>) -> Tensor<4> {
    let [_, _, h, w] = x.dims();
    let (rows, cols) = padding_pairs(&pool.padding, [h, w], pool.kernel_size, pool.stride);
    let options = MaxPoolOptions::new(pool.kernel_size)
        .with_stride(pool.stride)
        .with_padding_pairs([rows, cols])
        .with_dilation(pool.dilation)
        .with_ceil_mode(pool.ceil_mode);
    max_pool2d(x, options)
}

type PaddingPairs = ((usize, usize), (usize, usize));

/// The (begin, end) padding of both spatial axes, by Burn's rules (its own helper is private):
/// `Same` pads `(out - 1) · stride + kernel - in` in all, the smaller half first.
fn padding_pairs(
    padding: &PaddingConfig2d,
    [h, w]: [usize; 2],
    kernel: [usize; 2],
    stride: [usize; 2],
) -> PaddingPairs {
    let same = |k: usize, s: usize, size: usize| {
        let out = size.div_ceil(s);
        let total = if out > 0 {
            ((out - 1) * s + k).saturating_sub(size)
        } else {
            0
        };
        (total / 2, total - total / 2)
    };
    match padding {
        PaddingConfig2d::Valid => ((0, 0), (0, 0)),
        PaddingConfig2d::Same => (same(kernel[0], stride[0], h), same(kernel[1], stride[1], w)),
        PaddingConfig2d::Explicit(top, left, bottom, right) => ((*top, *bottom), (*left, *right)),
    }
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use super::*;
    use burn::nn::PaddingConfig2d;
    use burn::nn::conv::Conv2dConfig;
    use burn::nn::pool::MaxPool2dConfig;
    use burn::tensor::{Device, Distribution, Tensor};

    /// `a` and `b` agree to within 1e-4 relative (plus absolute) per value.
    pub(super) fn close(a: Tensor<4>, b: Tensor<4>) {
        let (a, b) = (
            a.into_data().try_to_vec::<f32>().unwrap(),
            b.into_data().try_to_vec::<f32>().unwrap(),
        );
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "{x} vs {y}");
        }
    }

    /// A tensor's values as their bit patterns (for bit-for-bit comparisons).
    pub(super) fn bits<const D: usize>(t: Tensor<D>) -> Vec<u32> {
        let v = t.into_data().try_to_vec::<f32>().unwrap();
        v.into_iter().map(f32::to_bits).collect()
    }

    /// Forward values and all three gradients agree with Burn's own convolution on flex.
    #[test]
    fn convolution_and_its_gradients_match_burn() {
        let device = Device::flex().autodiff();
        let configs = [
            Conv2dConfig::new([3, 6], [5, 5]),
            Conv2dConfig::new([4, 8], [3, 3]).with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1)),
            Conv2dConfig::new([4, 8], [3, 3])
                .with_stride([2, 2])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .with_bias(false),
            Conv2dConfig::new([4, 8], [1, 1]).with_stride([2, 2]),
            Conv2dConfig::new([5, 3], [1, 1]),
            // Even kernel, "same" padding: asymmetric (1 before, 2 after).
            Conv2dConfig::new([2, 3], [4, 4]).with_padding(PaddingConfig2d::Same),
        ];
        for config in configs {
            let conv = config.init(&device);
            conv_matches_burn(&conv, [5, config.channels[0], 11, 10]);
        }
    }

    /// `conv`'s forward values and its input, weight and bias gradients on a random input of
    /// `shape` agree with Burn's own convolution.
    fn conv_matches_burn(conv: &burn::nn::conv::Conv2d, shape: [usize; 4]) {
        let device = conv.weight.device();
        let x = Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), &device).require_grad();
        let ours = conv2d_forward(conv, x.clone());
        let burns = conv.forward(x.clone());
        close(ours.clone(), burns.clone());
        let probe = Tensor::<4>::random(burns.dims(), Distribution::Normal(0.0, 1.0), &device);
        let g_ours = (ours * probe.clone()).sum().backward();
        let g_burn = (burns * probe).sum().backward();
        close(x.grad(&g_ours).unwrap(), x.grad(&g_burn).unwrap());
        let w = &conv.weight;
        close(w.grad(&g_ours).unwrap(), w.grad(&g_burn).unwrap());
        if let Some(b) = &conv.bias {
            let (a, c) = (b.grad(&g_ours).unwrap(), b.grad(&g_burn).unwrap());
            close(a.reshape([1, 1, 1, -1]), c.reshape([1, 1, 1, -1]));
        }
    }

    /// Maps narrower than the padding (a 5×5 "same" convolution on 1×1 to 3×2 maps, as CNN2
    /// and CNN3 reach on small images): no kernel column lies inside, and the results still
    /// agree with Burn's.
    #[test]
    fn convolutions_on_maps_smaller_than_the_kernel_match_burn() {
        let device = Device::flex().autodiff();
        let conv = Conv2dConfig::new([4, 6], [5, 5])
            .with_padding(PaddingConfig2d::Explicit(2, 2, 2, 2))
            .init(&device);
        for [h, w] in [[1, 1], [1, 2], [2, 1], [2, 2], [3, 2]] {
            conv_matches_burn(&conv, [3, 4, h, w]);
        }
    }

    #[test]
    fn max_pooling_and_its_gradient_match_burn() {
        let device = Device::flex().autodiff();
        for (kernel, stride) in [([2, 2], [2, 2]), ([3, 3], [2, 2]), ([2, 3], [1, 2])] {
            let pool = MaxPool2dConfig::new(kernel).with_strides(stride).init();
            let x = Tensor::<4>::random([3, 4, 9, 11], Distribution::Normal(0.0, 1.0), &device)
                .require_grad();
            let ours = max_pool2d_forward(&pool, x.clone());
            let burns = pool.forward(x.clone());
            close(ours.clone(), burns.clone());
            let probe = Tensor::<4>::random(burns.dims(), Distribution::Normal(0.0, 1.0), &device);
            let g_ours = (ours * probe.clone()).sum().backward();
            let g_burn = (burns * probe).sum().backward();
            close(x.grad(&g_ours).unwrap(), x.grad(&g_burn).unwrap());
        }
    }

    /// Global average pooling is Burn's adaptive average pooling to 1 × 1 bit for bit, output
    /// and input gradient (a −0 output gradient included), with and without autodiff, over more
    /// planes than one task takes; other output sizes run Burn's op.
    #[test]
    fn global_average_pooling_is_burns_bit_for_bit() {
        use burn::nn::pool::AdaptiveAvgPool2dConfig;
        let normal = Distribution::Normal(0.5, 2.0);
        let device = Device::flex().autodiff();
        let pool = AdaptiveAvgPool2dConfig::new([1, 1]).init();
        for shape in [
            [2, 3, 1, 1],
            [3, 5, 2, 2],
            [2, 4, 7, 7],
            [3, 200, 4, 4],
            [1, 2, 8, 8],
        ] {
            let x = Tensor::<4>::random(shape, normal, &device).require_grad();
            let ours = adaptive_avg_pool2d_forward(&pool, x.clone());
            let burns = pool.forward(x.clone());
            assert_eq!(bits(ours.clone()), bits(burns.clone()), "{shape:?}");
            let mut probe = Tensor::<4>::random(burns.dims(), normal, &device);
            probe = probe.slice_assign(
                [0..1, 0..1, 0..1, 0..1],
                Tensor::full([1, 1, 1, 1], -0.0, &device),
            );
            let g_ours = (ours * probe.clone()).sum().backward();
            let g_burn = (burns * probe).sum().backward();
            let (a, b) = (x.grad(&g_ours).unwrap(), x.grad(&g_burn).unwrap());
            assert_eq!(bits(a), bits(b), "{shape:?}: gradient");
            let plain = x.inner();
            let ours = adaptive_avg_pool2d_forward(&pool, plain.clone());
            assert_eq!(
                bits(ours),
                bits(pool.forward(plain)),
                "{shape:?} without autodiff"
            );
        }
        let pool = AdaptiveAvgPool2dConfig::new([2, 2]).init();
        let x = Tensor::<4>::random([2, 3, 5, 5], normal, &device);
        let ours = adaptive_avg_pool2d_forward(&pool, x.clone());
        assert_eq!(bits(ours), bits(pool.forward(x)));
    }

    /// Depthwise convolutions (MobileNets' 3×3 and 5×5, strides 1 and 2) and the fused
    /// activations: values and gradients agree with Burn's ops, on every instruction tier.
    #[test]
    fn depthwise_convolution_and_fused_activations_match_burn() {
        let device = Device::flex().autodiff();
        let check = |_| {
            for (c, k, stride) in [(6, 3, 1), (6, 3, 2), (4, 5, 2), (3, 5, 1)] {
                let conv = Conv2dConfig::new([c, c], [k, k])
                    .with_groups(c)
                    .with_stride([stride, stride])
                    .with_padding(PaddingConfig2d::Explicit(k / 2, k / 2, k / 2, k / 2))
                    .with_bias(false)
                    .init(&device);
                let x = Tensor::<4>::random([3, c, 9, 10], Distribution::Normal(0.0, 1.0), &device)
                    .require_grad();
                let ours = conv2d_forward(&conv, x.clone());
                let burns = conv.forward(x.clone());
                close(ours.clone(), burns.clone());
                let probe =
                    Tensor::<4>::random(burns.dims(), Distribution::Normal(0.0, 1.0), &device);
                let g_ours = (ours * probe.clone()).sum().backward();
                let g_burn = (burns * probe).sum().backward();
                close(x.grad(&g_ours).unwrap(), x.grad(&g_burn).unwrap());
                close(
                    conv.weight.grad(&g_ours).unwrap(),
                    conv.weight.grad(&g_burn).unwrap(),
                );
            }
            // Random values plus the clamps' boundaries, where the masks decide the gradient.
            let edges = [-3.0f32, 0.0, 3.0, 6.0, -0.0, 2.9999998, 6.0000005];
            let mut values: Vec<f32> =
                Tensor::<1>::random([4096], Distribution::Normal(0.0, 4.0), &device)
                    .into_data()
                    .try_to_vec::<f32>()
                    .unwrap();
            values.extend(edges);
            let n = values.len();
            for act in [Activation::Relu, Activation::Relu6, Activation::HardSwish] {
                let x = Tensor::<1>::from_floats(values.as_slice(), &device)
                    .reshape([1, 1, 1, n])
                    .require_grad();
                let ours = act.apply(x.clone());
                let burns = match act {
                    Activation::Relu => burn::tensor::activation::relu(x.clone()),
                    Activation::Relu6 => burn::tensor::activation::relu6(x.clone()),
                    _ => burn::tensor::activation::hard_swish(x.clone()),
                };
                let probe =
                    Tensor::<4>::random([1, 1, 1, n], Distribution::Normal(0.0, 1.0), &device);
                let g_ours = (ours.clone() * probe.clone()).sum().backward();
                let g_burn = (burns.clone() * probe).sum().backward();
                let (dx_ours, dx_burn) = (x.grad(&g_ours).unwrap(), x.grad(&g_burn).unwrap());
                // A tensor nothing else holds is overwritten in place: the same values.
                let unique = Tensor::<1>::from_floats(values.as_slice(), &Device::flex());
                let in_place = act.apply(unique.reshape([1, 1, 1, n]));
                assert_eq!(bits(in_place), bits(ours.clone()), "{act:?} in place");
                if act == Activation::Relu {
                    // ReLU is bitwise Burn's (models switched to it keep their pinned results).
                    assert_eq!(bits(ours), bits(burns));
                    assert_eq!(bits(dx_ours), bits(dx_burn));
                } else if act == Activation::Relu6 {
                    // Burn's gradient, except at exactly 0 and 6 (PyTorch's open interval).
                    let burn_dx = dx_burn.into_data().try_to_vec::<f32>().unwrap();
                    let expected: Vec<f32> = values
                        .iter()
                        .zip(burn_dx)
                        .map(|(&x, g)| if x == 0.0 || x == 6.0 { 0.0 } else { g })
                        .collect();
                    assert_eq!(bits(ours), bits(burns));
                    let expected = Tensor::<1>::from_floats(expected.as_slice(), &device);
                    assert_eq!(bits(dx_ours), bits(expected.reshape([1, 1, 1, n])));
                } else {
                    close(ours, burns);
                    close(dx_ours, dx_burn);
                }
            }
        };
        cpu::tests::at_every_isa(check);
    }

    /// The fused residual additions, `a + b` and `relu(a + b)`, are Burn's bit for bit, value
    /// and both gradients, on every instruction tier, in place or not.
    #[test]
    fn residual_additions_are_burns_bit_for_bit() {
        let device = Device::flex().autodiff();
        // Random values, then sums of exactly +0 and −0 and signed-zero operands.
        let mut a_values = cpu::tests::values(5000, 51);
        a_values.extend([1.0, -0.0, -0.0, 0.0, 2.5, -3.0, 0.0]);
        let mut b_values = cpu::tests::values(5000, 52);
        b_values.extend([-1.0, -0.0, 0.0, -0.0, 0.5, 1.0, -0.0]);
        let n = a_values.len();
        let tensor =
            |v: &[f32], device: &Device| Tensor::<1>::from_floats(v, device).reshape([1, 1, 1, n]);
        type Op = fn(Tensor<4>, Tensor<4>) -> Tensor<4>;
        let ops: [(Op, Op); 2] = [
            (add, |a, b| a + b),
            (add_relu, |a, b| burn::tensor::activation::relu(a + b)),
        ];
        cpu::tests::at_every_isa(|_| {
            for (i, (ours_op, burn_op)) in ops.iter().enumerate() {
                let (a, b) = (
                    tensor(&a_values, &device).require_grad(),
                    tensor(&b_values, &device).require_grad(),
                );
                let ours = ours_op(a.clone(), b.clone());
                let burns = burn_op(a.clone(), b.clone());
                assert_eq!(bits(ours.clone()), bits(burns.clone()), "op {i}");
                let probe =
                    Tensor::<4>::random([1, 1, 1, n], Distribution::Normal(0.0, 1.0), &device);
                let g_ours = (ours.clone() * probe.clone()).sum().backward();
                let g_burn = (burns * probe).sum().backward();
                for x in [&a, &b] {
                    assert_eq!(
                        bits(x.grad(&g_ours).unwrap()),
                        bits(x.grad(&g_burn).unwrap()),
                        "op {i}: gradient"
                    );
                }
                // Operands nothing else holds: the sum overwrites the first, the same values.
                let plain = Device::flex();
                let in_place = ours_op(tensor(&a_values, &plain), tensor(&b_values, &plain));
                assert_eq!(bits(in_place), bits(ours), "op {i}: in place");
            }
        });
    }

    /// The FC kernel is Burn's `Linear` bit for bit: the output and the gradients of the input,
    /// weight and bias, for small and thread-pool-sized products (flex's parallel threshold is
    /// 192³), with and without a tracked input, for a strided (transposed) input, and without
    /// autodiff.
    #[test]
    fn linear_is_burns_bit_for_bit() {
        use burn::module::Module;
        use burn::nn::LinearConfig;
        let normal = Distribution::Normal(0.0, 1.0);
        let device = Device::flex().autodiff();
        for (rows, d_in, d_out, track_x, transposed) in [
            (3, 5, 7, true, false),
            (50, 1600, 512, true, false),
            (64, 300, 10, false, false),
            (20, 30, 40, true, true),
        ] {
            let layer = LinearConfig::new(d_in, d_out).init(&device);
            let leaf = if transposed {
                Tensor::<2>::random([d_in, rows], normal, &device)
            } else {
                Tensor::<2>::random([rows, d_in], normal, &device)
            };
            let leaf = if track_x { leaf.require_grad() } else { leaf };
            let probe = Tensor::<2>::random([rows, d_out], normal, &device);
            // Each side on its own graph: Burn's tape is consumed by one backward pass.
            let run = |kernel: bool| {
                let x = if transposed {
                    leaf.clone().transpose()
                } else {
                    leaf.clone()
                };
                let y = if kernel {
                    linear(&layer, x)
                } else {
                    layer.forward(x)
                };
                let g = (y.clone() * probe.clone()).sum().backward();
                let bias = layer.bias.as_ref().unwrap();
                let dx = track_x.then(|| bits(leaf.grad(&g).unwrap()));
                let grads = (
                    bits(layer.weight.grad(&g).unwrap()),
                    bits(bias.grad(&g).unwrap()),
                );
                (bits(y), grads, dx)
            };
            assert_eq!(run(true), run(false), "{rows}x{d_in}x{d_out}");
            let x = if transposed {
                leaf.clone().transpose()
            } else {
                leaf.clone()
            };
            let plain = layer.valid();
            let x = Tensor::<2>::from_data(x.into_data(), &Device::flex());
            assert_eq!(bits(linear(&plain, x.clone())), bits(plain.forward(x)));
        }
    }

    /// Each kernel family switches on its own; switched off, its op is Burn's, bit for bit.
    #[test]
    fn kernel_families_switch_one_at_a_time() {
        // Other tests compare two runs' bits: none may see the switch flip in between.
        let _lock = isa::test_lock();
        let device = Device::flex();
        let conv = Conv2dConfig::new([4, 8], [3, 3])
            .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
            .init(&device);
        let x = Tensor::<4>::random([2, 4, 8, 8], Distribution::Normal(0.0, 1.0), &device);
        set_kernel_enabled(Kernel::Conv, false);
        let others_on = Kernel::ALL[1..].iter().all(|&k| kernel_enabled(k));
        let (conv_on, all_on) = (kernel_enabled(Kernel::Conv), enabled());
        let off = conv2d_forward(&conv, x.clone());
        set_enabled(true);
        assert!(others_on && !conv_on && !all_on && enabled());
        assert_eq!(bits(off), bits(conv.forward(x.clone())));
        close(conv2d_forward(&conv, x.clone()), conv.forward(x));
        for k in Kernel::ALL {
            assert_eq!(k.name().parse::<Kernel>(), Ok(k));
        }
        assert!(
            "pool"
                .parse::<Kernel>()
                .unwrap_err()
                .contains("known: conv,")
        );
    }

    /// Without autodiff (evaluation), and for what the kernels do not handle, results are Burn's.
    #[test]
    fn inference_and_unsupported_options_fall_back_cleanly() {
        let device = Device::flex();
        let conv = Conv2dConfig::new([4, 8], [3, 3]).init(&device);
        let x = Tensor::<4>::random([2, 4, 8, 8], Distribution::Normal(0.0, 1.0), &device);
        close(conv2d_forward(&conv, x.clone()), conv.forward(x.clone()));
        // Depthwise with a bias: Burn's op.
        let depthwise = Conv2dConfig::new([4, 4], [3, 3])
            .with_groups(4)
            .init(&device);
        close(
            conv2d_forward(&depthwise, x.clone()),
            depthwise.forward(x.clone()),
        );
        let padded = MaxPool2dConfig::new([2, 2])
            .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
            .init();
        close(max_pool2d_forward(&padded, x.clone()), padded.forward(x));
    }
}
