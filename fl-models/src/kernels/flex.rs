//! The kernels as a Burn backend extension: implemented for the flex backend, with their own
//! backward passes for autodiff (Burn's `#[backend_extension]` routes `Dispatch` calls here).

use burn::backend::AutodiffBackend;
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::{
    Backend, Dispatch, DispatchDevice, Flex, TensorMetadata, backend_extension, tensor::FloatTensor,
};
use burn::tensor::ops::{ConvOptions, MaxPoolOptions};
use burn::tensor::{DType, Shape, Tensor, TensorData};
use burn_flex::FlexTensor;

use super::Activation;
use super::cpu::{self, Conv2dGeometry, PoolGeometry};
use super::flex_mobile::MobileKernelOps;
use super::flex_norm::{
    BatchNormInferenceBackward, BatchNormTrainBackward, RetroBatchNorm, norm_geometry,
};

/// Convolution and max-pooling kernels for CPU backends, with hand-written backward passes.
#[backend_extension(Flex, Autodiff)]
pub trait CpuKernelOps: Backend {
    /// 2-D convolution (groups 1, dilation 1) without bias.
    fn fl_conv2d(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self>;
    /// 2-D convolution (groups 1, dilation 1) with bias. (Two methods rather than an optional
    /// bias: the extension macro does not route optional tensors through autodiff.)
    fn fl_conv2d_bias(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self>;
    /// Gradient of [`fl_conv2d`](CpuKernelOps::fl_conv2d) with respect to its input.
    fn fl_conv2d_x_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self>;
    /// Gradients of [`fl_conv2d`](CpuKernelOps::fl_conv2d) with respect to its weight and, if
    /// `bias`, its bias (else the second tensor is empty: no pass over `grad` for a layer
    /// without one).
    fn fl_conv2d_weight_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        options: ConvOptions<2>,
        bias: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// 2-D max-pooling (no padding, no dilation, floor mode).
    fn fl_max_pool2d(x: FloatTensor<Self>, options: MaxPoolOptions<2>) -> FloatTensor<Self>;
    /// Gradient of [`fl_max_pool2d`](CpuKernelOps::fl_max_pool2d) with respect to its input.
    fn fl_max_pool2d_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        options: MaxPoolOptions<2>,
    ) -> FloatTensor<Self>;
    /// Batch normalisation of a `[batch, channels, h, w]` tensor with batch statistics, then
    /// `act`: the output, the channel means and the biased channel variances.
    fn fl_batch_norm_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        act: Activation,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
    /// Gradients of [`fl_batch_norm_train`](CpuKernelOps::fl_batch_norm_train) with respect to
    /// `x`, `gamma` and `beta`.
    #[allow(clippy::too_many_arguments)]
    fn fl_batch_norm_train_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        epsilon: f64,
        act: Activation,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
    /// The output of [`fl_batch_norm_train`](CpuKernelOps::fl_batch_norm_train) again, bit
    /// for bit, from the statistics it returned (gradient checkpointing recomputes it in the
    /// backward pass instead of keeping it).
    fn fl_batch_norm_train_output(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        epsilon: f64,
        act: Activation,
    ) -> FloatTensor<Self>;
    /// Batch normalisation of a `[batch, channels, h, w]` tensor with given statistics
    /// (inference, frozen layers), then `act`: `act(((x − mean) / std) · γ + β)`,
    /// `std = sqrt(var + ε)`.
    fn fl_batch_norm_inference(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        std: FloatTensor<Self>,
        act: Activation,
    ) -> FloatTensor<Self>;
    /// Gradient of [`fl_batch_norm_inference`](CpuKernelOps::fl_batch_norm_inference) with
    /// respect to `x` (γ, β and the statistics are constants there).
    fn fl_batch_norm_inference_backward(
        gamma: FloatTensor<Self>,
        std: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

/// Whether a tensor lives on the flex backend (with or without autodiff).
pub(super) fn on_flex<const D: usize>(x: &Tensor<D>) -> bool {
    matches!(x.device().inner().as_dispatch(), DispatchDevice::Flex(_))
}

pub(super) fn dims4(shape: &Shape) -> [usize; 4] {
    [shape[0], shape[1], shape[2], shape[3]]
}

/// The geometry of a convolution the kernels handle, or `None` (then Burn's own op runs).
fn conv_geometry(x: [usize; 4], w: [usize; 4], options: &ConvOptions<2>) -> Option<Conv2dGeometry> {
    if options.groups != 1 || w[1] != x[1] {
        return None;
    }
    spatial_geometry(x, w, options)
}

/// The shapes of a convolution with dilation 1 and a non-empty output (`c_in` is the input's
/// channels, `c_out` the weight's rows; the caller checks how they relate), or `None`.
pub(super) fn spatial_geometry(
    x: [usize; 4],
    w: [usize; 4],
    options: &ConvOptions<2>,
) -> Option<Conv2dGeometry> {
    let [batch, c_in, h, wd] = x;
    let [c_out, _, kh, kw] = w;
    if options.dilation != [1, 1] || kh == 0 || kw == 0 {
        return None;
    }
    let [(top, bottom), (left, right)] = options.padding;
    let [sh, sw] = options.stride;
    if sh == 0 || sw == 0 || h + top + bottom < kh || wd + left + right < kw {
        return None;
    }
    Some(Conv2dGeometry {
        batch,
        c_in,
        input: [h, wd],
        c_out,
        kernel: [kh, kw],
        stride: [sh, sw],
        pad_begin: [top, left],
        output: [
            (h + top + bottom - kh) / sh + 1,
            (wd + left + right - kw) / sw + 1,
        ],
    })
}

fn pool_geometry(x: [usize; 4], options: &MaxPoolOptions<2>) -> Option<PoolGeometry> {
    let [batch, channels, h, w] = x;
    let [kh, kw] = options.kernel_size;
    let [sh, sw] = options.stride;
    let unpadded = options.padding == [(0, 0), (0, 0)];
    if !unpadded || options.dilation != [1, 1] || options.ceil_mode {
        return None;
    }
    if kh == 0 || kw == 0 || sh == 0 || sw == 0 || h < kh || w < kw {
        return None;
    }
    Some(PoolGeometry {
        planes: batch * channels,
        input: [h, w],
        kernel: [kh, kw],
        stride: [sh, sw],
        output: [(h - kh) / sh + 1, (w - kw) / sw + 1],
    })
}

/// Whether the kernels handle this convolution: tensors on flex in `f32`, groups 1, dilation 1.
pub(super) fn handles_conv2d(
    x: &Tensor<4>,
    weight: &Tensor<4>,
    bias: Option<&Tensor<1>>,
    options: &ConvOptions<2>,
) -> bool {
    x.dtype() == DType::F32
        && weight.dtype() == DType::F32
        && bias.is_none_or(|b| b.dtype() == DType::F32)
        && on_flex(x)
        && conv_geometry(x.dims(), weight.dims(), options).is_some()
}

/// Runs [`CpuKernelOps::fl_conv2d`] (or its biased twin) through Burn's dispatch.
pub(super) fn conv2d(
    x: Tensor<4>,
    weight: Tensor<4>,
    bias: Option<Tensor<1>>,
    options: ConvOptions<2>,
) -> Tensor<4> {
    let (x, weight) = (x.into_dispatch(), weight.into_dispatch());
    Tensor::from_dispatch(match bias {
        Some(b) => {
            <Dispatch as CpuKernelOps>::fl_conv2d_bias(x, weight, b.into_dispatch(), options)
        }
        None => <Dispatch as CpuKernelOps>::fl_conv2d(x, weight, options),
    })
}

/// Whether the kernels handle this max-pooling: on flex in `f32`, no padding or dilation, floor
/// mode.
pub(super) fn handles_max_pool2d(x: &Tensor<4>, options: &MaxPoolOptions<2>) -> bool {
    x.dtype() == DType::F32 && on_flex(x) && pool_geometry(x.dims(), options).is_some()
}

/// Runs [`CpuKernelOps::fl_max_pool2d`] through Burn's dispatch.
pub(super) fn max_pool2d(x: Tensor<4>, options: MaxPoolOptions<2>) -> Tensor<4> {
    Tensor::from_dispatch(<Dispatch as CpuKernelOps>::fl_max_pool2d(
        x.into_dispatch(),
        options,
    ))
}

pub(super) fn flex_vector(values: Vec<f32>) -> FlexTensor {
    let len = values.len();
    FlexTensor::from_data(TensorData::new(values, [len]))
}

/// A contiguous `f32` view of a flex tensor (a copy only if it is strided).
pub(super) fn contiguous(t: FlexTensor) -> FlexTensor {
    if t.is_contiguous() {
        t
    } else {
        t.to_contiguous()
    }
}

/// The values of a contiguous tensor whose buffer nothing else holds (and which it fills
/// exactly), to overwrite in place; `None` for any other tensor.
pub(super) fn values_mut(t: &mut FlexTensor) -> Option<&mut [f32]> {
    let whole = t.is_contiguous()
        && t.layout().start_offset() == 0
        && t.bytes().len() == t.shape().num_elements() * size_of::<f32>();
    if whole {
        t.try_storage_mut::<f32>()
    } else {
        None
    }
}

/// `t` itself where [`values_mut`] can overwrite it (nothing else holds it: no new buffer, and
/// no pass over freshly zeroed memory), else a contiguous copy of it.
pub(super) fn owned(t: FlexTensor) -> FlexTensor {
    let mut t = contiguous(t);
    if values_mut(&mut t).is_some() {
        return t;
    }
    FlexTensor::from_data(TensorData::new(cpu::par_copy(slice(&t)), t.shape()))
}

pub(super) const OWNED: &str = "flex kernels: `owned` returns a tensor `values_mut` can write";

pub(super) fn slice(t: &FlexTensor) -> &[f32] {
    t.as_slice::<f32>()
        .expect("flex kernels: contiguous f32 tensors (checked by the caller)")
}

pub(super) fn flex_tensor(values: Vec<f32>, shape: [usize; 4]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

pub(super) const UNSUPPORTED: &str = "flex kernels: called on a convolution or pooling they do not handle \
                           (the public wrappers check this first)";

fn flex_conv2d(
    x: FlexTensor,
    weight: FlexTensor,
    bias: Option<FlexTensor>,
    options: ConvOptions<2>,
) -> FlexTensor {
    let g = conv_geometry(dims4(&x.shape()), dims4(&weight.shape()), &options).expect(UNSUPPORTED);
    let (x, weight) = (contiguous(x), contiguous(weight));
    let bias = bias.map(contiguous);
    let y = cpu::conv2d_forward(&g, slice(&x), slice(&weight), bias.as_ref().map(slice));
    flex_tensor(y, [g.batch, g.c_out, g.output[0], g.output[1]])
}

impl CpuKernelOps for Flex {
    fn fl_conv2d(x: FlexTensor, weight: FlexTensor, options: ConvOptions<2>) -> FlexTensor {
        flex_conv2d(x, weight, None, options)
    }

    fn fl_conv2d_bias(
        x: FlexTensor,
        weight: FlexTensor,
        bias: FlexTensor,
        options: ConvOptions<2>,
    ) -> FlexTensor {
        flex_conv2d(x, weight, Some(bias), options)
    }

    fn fl_conv2d_x_backward(
        x: FlexTensor,
        weight: FlexTensor,
        grad: FlexTensor,
        options: ConvOptions<2>,
    ) -> FlexTensor {
        let g =
            conv_geometry(dims4(&x.shape()), dims4(&weight.shape()), &options).expect(UNSUPPORTED);
        let (weight, grad) = (contiguous(weight), contiguous(grad));
        let dx = cpu::conv2d_input_grad(&g, slice(&weight), slice(&grad));
        flex_tensor(dx, [g.batch, g.c_in, g.input[0], g.input[1]])
    }

    fn fl_conv2d_weight_backward(
        x: FlexTensor,
        weight: FlexTensor,
        grad: FlexTensor,
        options: ConvOptions<2>,
        bias: bool,
    ) -> (FlexTensor, FlexTensor) {
        let w_dims = dims4(&weight.shape());
        let g = conv_geometry(dims4(&x.shape()), w_dims, &options).expect(UNSUPPORTED);
        let (x, grad) = (contiguous(x), contiguous(grad));
        let (dw, db) = cpu::conv2d_weight_grad_of(&g, slice(&x), slice(&grad), bias);
        (flex_tensor(dw, w_dims), flex_vector(db))
    }

    fn fl_max_pool2d(x: FlexTensor, options: MaxPoolOptions<2>) -> FlexTensor {
        let [n, c, h, w] = dims4(&x.shape());
        let g = pool_geometry([n, c, h, w], &options).expect(UNSUPPORTED);
        let x = contiguous(x);
        let y = cpu::max_pool2d_forward(&g, slice(&x));
        flex_tensor(y, [n, c, g.output[0], g.output[1]])
    }

    fn fl_max_pool2d_backward(
        x: FlexTensor,
        grad: FlexTensor,
        options: MaxPoolOptions<2>,
    ) -> FlexTensor {
        let dims = dims4(&x.shape());
        let g = pool_geometry(dims, &options).expect(UNSUPPORTED);
        let (x, grad) = (contiguous(x), contiguous(grad));
        flex_tensor(cpu::max_pool2d_backward(&g, slice(&x), slice(&grad)), dims)
    }

    fn fl_batch_norm_train(
        x: FlexTensor,
        gamma: FlexTensor,
        beta: FlexTensor,
        epsilon: f64,
        act: Activation,
    ) -> (FlexTensor, FlexTensor, FlexTensor) {
        let g = norm_geometry(&x);
        let dims = dims4(&x.shape());
        let [x, gamma, beta] = [x, gamma, beta].map(contiguous);
        let params = (slice(&gamma), slice(&beta));
        let (y, mean, var) = cpu::batch_norm_train_forward(&g, slice(&x), params, epsilon, act);
        (flex_tensor(y, dims), flex_vector(mean), flex_vector(var))
    }

    fn fl_batch_norm_train_output(
        x: FlexTensor,
        gamma: FlexTensor,
        beta: FlexTensor,
        mean: FlexTensor,
        variance: FlexTensor,
        epsilon: f64,
        act: Activation,
    ) -> FlexTensor {
        let g = norm_geometry(&x);
        let dims = dims4(&x.shape());
        let [x, gamma, beta, mean, variance] = [x, gamma, beta, mean, variance].map(contiguous);
        let params = (slice(&gamma), slice(&beta));
        let stats = (slice(&mean), slice(&variance));
        let y = cpu::batch_norm_train_output(&g, slice(&x), params, stats, epsilon, act);
        flex_tensor(y, dims)
    }

    fn fl_batch_norm_train_backward(
        x: FlexTensor,
        gamma: FlexTensor,
        beta: FlexTensor,
        mean: FlexTensor,
        variance: FlexTensor,
        epsilon: f64,
        act: Activation,
        grad: FlexTensor,
    ) -> (FlexTensor, FlexTensor, FlexTensor) {
        let g = norm_geometry(&x);
        let mut grad = contiguous(grad);
        let [x, gamma, beta, mean, variance] = [x, gamma, beta, mean, variance].map(contiguous);
        let params = (slice(&gamma), slice(&beta), slice(&mean), slice(&variance));
        if let Some(values) = values_mut(&mut grad) {
            let (d_gamma, d_beta) =
                cpu::batch_norm_train_backward(&g, slice(&x), params, epsilon, act, values);
            return (grad, flex_vector(d_gamma), flex_vector(d_beta));
        }
        // Shared (a residual branch's gradient): one pass into a new buffer, not a copy and a
        // pass.
        let (dx, d_gamma, d_beta) =
            cpu::batch_norm_train_backward_into(&g, slice(&x), params, epsilon, act, slice(&grad));
        let dx = FlexTensor::from_data(TensorData::new(dx, grad.shape()));
        (dx, flex_vector(d_gamma), flex_vector(d_beta))
    }

    fn fl_batch_norm_inference(
        x: FlexTensor,
        gamma: FlexTensor,
        beta: FlexTensor,
        mean: FlexTensor,
        std: FlexTensor,
        act: Activation,
    ) -> FlexTensor {
        let g = norm_geometry(&x);
        let mut x = contiguous(x);
        let [gamma, beta, mean, std] = [gamma, beta, mean, std].map(contiguous);
        let params = (slice(&gamma), slice(&beta), slice(&mean), slice(&std));
        if let Some(values) = values_mut(&mut x) {
            cpu::batch_norm_inference(&g, values, params, act);
            return x;
        }
        // Shared (a residual branch's input): one pass into a new buffer, not a copy and a pass.
        let y = cpu::batch_norm_inference_into(&g, slice(&x), params, act);
        FlexTensor::from_data(TensorData::new(y, x.shape()))
    }

    fn fl_batch_norm_inference_backward(
        gamma: FlexTensor,
        std: FlexTensor,
        grad: FlexTensor,
    ) -> FlexTensor {
        let g = norm_geometry(&grad);
        let mut grad = owned(grad);
        let [gamma, std] = [gamma, std].map(contiguous);
        let values = values_mut(&mut grad).expect(OWNED);
        cpu::batch_norm_inference_backward(&g, values, slice(&gamma), slice(&std));
        grad
    }
}

/// Registers the convolution's gradients for whichever parents require them.
fn conv_backward<B: Backend + CpuKernelOps>(
    [node_x, node_weight, node_bias]: [Option<NodeId>; 3],
    (x, weight, grad): (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>),
    options: ConvOptions<2>,
    grads: &mut Gradients,
) {
    if let Some(node) = node_x {
        let dx = B::fl_conv2d_x_backward(x.clone(), weight.clone(), grad.clone(), options.clone());
        grads.register::<B>(node, dx);
    }
    if node_weight.is_some() || node_bias.is_some() {
        let bias = node_bias.is_some();
        let (dw, db) = B::fl_conv2d_weight_backward(x, weight, grad, options, bias);
        if let Some(node) = node_weight {
            grads.register::<B>(node, dw);
        }
        if let Some(node) = node_bias {
            grads.register::<B>(node, db);
        }
    }
}

/// The convolution's autodiff node: parents (x, weight) or (x, weight, bias).
#[derive(Debug)]
struct Conv2dBackward;

impl<B: Backend + CpuKernelOps, const N: usize> Backward<B, N> for Conv2dBackward {
    type State = (NodeId, NodeId, ConvOptions<2>);

    fn backward(
        self,
        ops: Ops<Self::State, N>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (x, weight, options) = ops.state;
        let x = checkpointer.retrieve_node_output::<FloatTensor<B>>(x);
        let weight = checkpointer.retrieve_node_output::<FloatTensor<B>>(weight);
        let mut ids = [None; 3];
        for (id, parent) in ids.iter_mut().zip(&ops.parents) {
            *id = parent.as_ref().map(|node| node.id);
        }
        conv_backward::<B>(ids, (x, weight, grad), options, grads);
    }
}

#[derive(Debug)]
struct MaxPool2dBackward;

impl<B: Backend + CpuKernelOps> Backward<B, 1> for MaxPool2dBackward {
    type State = (NodeId, MaxPoolOptions<2>);

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (x, options) = ops.state;
        let [node_x] = ops.parents;
        if let Some(node) = node_x {
            let x = checkpointer.retrieve_node_output::<FloatTensor<B>>(x);
            grads.register::<B>(node.id, B::fl_max_pool2d_backward(x, grad, options));
        }
    }
}

/// Autodiff: the forward pass runs on the inner backend and records a node whose backward pass
/// calls the gradient kernels. The gradient kernels themselves are not differentiable again.
impl<B: Backend + CpuKernelOps + MobileKernelOps, C: CheckpointStrategy> CpuKernelOps
    for Autodiff<B, C>
{
    fn fl_conv2d(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        match Conv2dBackward
            .prepare::<C>([x.node(), weight.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = (
                    prep.checkpoint(&x),
                    prep.checkpoint(&weight),
                    options.clone(),
                );
                prep.finish(
                    state,
                    B::fl_conv2d(x.into_primitive(), weight.into_primitive(), options),
                )
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fl_conv2d(
                x.into_primitive(),
                weight.into_primitive(),
                options,
            )),
        }
    }

    fn fl_conv2d_bias(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        let parents = [x.node(), weight.node(), bias.node()];
        match Conv2dBackward
            .prepare::<C>(parents)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = (
                    prep.checkpoint(&x),
                    prep.checkpoint(&weight),
                    options.clone(),
                );
                let y = B::fl_conv2d_bias(
                    x.into_primitive(),
                    weight.into_primitive(),
                    bias.into_primitive(),
                    options,
                );
                prep.finish(state, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fl_conv2d_bias(
                x.into_primitive(),
                weight.into_primitive(),
                bias.into_primitive(),
                options,
            )),
        }
    }

    fn fl_conv2d_x_backward(
        _x: FloatTensor<Self>,
        _weight: FloatTensor<Self>,
        _grad: FloatTensor<Self>,
        _options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        unimplemented!("second-order gradients of the flex convolution kernels")
    }

    fn fl_conv2d_weight_backward(
        _x: FloatTensor<Self>,
        _weight: FloatTensor<Self>,
        _grad: FloatTensor<Self>,
        _options: ConvOptions<2>,
        _bias: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        unimplemented!("second-order gradients of the flex convolution kernels")
    }

    fn fl_max_pool2d(x: FloatTensor<Self>, options: MaxPoolOptions<2>) -> FloatTensor<Self> {
        match MaxPool2dBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = (prep.checkpoint(&x), options.clone());
                prep.finish(state, B::fl_max_pool2d(x.into_primitive(), options))
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fl_max_pool2d(x.into_primitive(), options)),
        }
    }

    fn fl_max_pool2d_backward(
        _x: FloatTensor<Self>,
        _grad: FloatTensor<Self>,
        _options: MaxPoolOptions<2>,
    ) -> FloatTensor<Self> {
        unimplemented!("second-order gradients of the flex max-pooling kernel")
    }

    fn fl_batch_norm_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        act: Activation,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let parents = [x.node(), gamma.node(), beta.node()];
        // The statistics come first: the retro-forward needs them before the node exists.
        let (y, mean, var) = B::fl_batch_norm_train(
            x.primitive().clone(),
            gamma.primitive().clone(),
            beta.primitive().clone(),
            epsilon,
            act,
        );
        let retro = RetroBatchNorm::<B> {
            nodes: [&x, &gamma, &beta].map(|t| t.id()),
            stats: (mean.clone(), var.clone()),
            epsilon,
            act,
        };
        // Memory bound: with gradient checkpointing the output is recomputed from `x` in the
        // backward pass where a later layer needs it, instead of being kept.
        match BatchNormTrainBackward
            .prepare::<C>(parents)
            .memory_bound()
            .retro_forward(retro)
            .parents([&x, &gamma, &beta])
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let nodes = [&x, &gamma, &beta].map(|t| prep.checkpoint(t));
                let state = (nodes, mean.clone(), var.clone(), epsilon, act);
                let y = prep.finish(state, y);
                (y, Self::from_inner(mean), Self::from_inner(var))
            }
            OpsKind::UnTracked(prep) => (
                prep.finish(y),
                Self::from_inner(mean),
                Self::from_inner(var),
            ),
        }
    }

    fn fl_batch_norm_train_output(
        _x: FloatTensor<Self>,
        _gamma: FloatTensor<Self>,
        _beta: FloatTensor<Self>,
        _mean: FloatTensor<Self>,
        _variance: FloatTensor<Self>,
        _epsilon: f64,
        _act: Activation,
    ) -> FloatTensor<Self> {
        unimplemented!("the recomputation of a batch-norm output runs on the inner backend")
    }

    fn fl_batch_norm_train_backward(
        _x: FloatTensor<Self>,
        _gamma: FloatTensor<Self>,
        _beta: FloatTensor<Self>,
        _mean: FloatTensor<Self>,
        _variance: FloatTensor<Self>,
        _epsilon: f64,
        _act: Activation,
        _grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        unimplemented!("second-order gradients of the flex batch-norm kernel")
    }

    fn fl_batch_norm_inference(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        std: FloatTensor<Self>,
        act: Activation,
    ) -> FloatTensor<Self> {
        let prep = BatchNormInferenceBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful();
        let (gamma, std) = (gamma.into_primitive(), std.into_primitive());
        let (x, beta, mean) = (
            x.into_primitive(),
            beta.into_primitive(),
            mean.into_primitive(),
        );
        match prep {
            OpsKind::Tracked(prep) => {
                // A gradient to pass back (frozen layers): the activation as its own node.
                let y = B::fl_batch_norm_inference(
                    x,
                    gamma.clone(),
                    beta,
                    mean,
                    std.clone(),
                    Activation::Identity,
                );
                let y = prep.finish((gamma, std), y);
                match act {
                    Activation::Identity => y,
                    act => <Self as MobileKernelOps>::fl_activation(y, act),
                }
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::fl_batch_norm_inference(x, gamma, beta, mean, std, act))
            }
        }
    }

    fn fl_batch_norm_inference_backward(
        _gamma: FloatTensor<Self>,
        _std: FloatTensor<Self>,
        _grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        unimplemented!("second-order gradients of the flex batch-norm kernel")
    }
}
