//! The MobileNets' kernels as a second Burn backend extension: depthwise convolutions, the
//! fused ReLU6 / hard-swish activations (and both ResNet-20s' residual additions, with or
//! without their ReLU) and global average pooling, with their own backward passes for autodiff.

use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::{
    Backend, Dispatch, Flex, TensorMetadata, backend_extension, tensor::FloatTensor,
};
use burn::tensor::ops::ConvOptions;
use burn::tensor::{DType, Tensor, TensorData};
use burn_flex::FlexTensor;

use super::Activation;
use super::cpu::{self, Conv2dGeometry};
use super::flex::{
    UNSUPPORTED, contiguous, dims4, flex_tensor, on_flex, slice, spatial_geometry, values_mut,
};

/// Depthwise convolutions and fused activations for CPU backends, with hand-written backward
/// passes.
#[backend_extension(Flex, Autodiff)]
pub trait MobileKernelOps: Backend {
    /// Depthwise 2-D convolution without bias: groups = input channels = output channels,
    /// weight `[c, 1, kh, kw]`, dilation 1.
    fn fl_depthwise(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self>;
    /// Gradient of [`fl_depthwise`](MobileKernelOps::fl_depthwise) with respect to its input.
    fn fl_depthwise_x_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self>;
    /// Gradient of [`fl_depthwise`](MobileKernelOps::fl_depthwise) with respect to its weight.
    fn fl_depthwise_weight_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self>;
    /// An elementwise activation in one pass.
    fn fl_activation(x: FloatTensor<Self>, act: Activation) -> FloatTensor<Self>;
    /// Gradient of [`fl_activation`](MobileKernelOps::fl_activation) with respect to its input,
    /// given `saved`: its output for ReLU and ReLU6, its input for hard-swish.
    fn fl_activation_backward(
        saved: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        act: Activation,
    ) -> FloatTensor<Self>;
    /// `act(a + b)` for two tensors of one shape (a residual connection and its activation:
    /// identity or ReLU) in one pass; its gradient is the activation's, passed to both operands.
    fn fl_add_activation(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        act: Activation,
    ) -> FloatTensor<Self>;
    /// Global average pooling, `[n, c, h, w]` → `[n, c, 1, 1]`: Burn's adaptive average pooling
    /// to 1 × 1, bit for bit.
    fn fl_global_avg_pool(x: FloatTensor<Self>) -> FloatTensor<Self>;
    /// Gradient of [`fl_global_avg_pool`](MobileKernelOps::fl_global_avg_pool) with respect
    /// to its input of `[h, w]` pixels per plane.
    fn fl_global_avg_pool_backward(grad: FloatTensor<Self>, input: [usize; 2])
    -> FloatTensor<Self>;
}

/// The geometry of a depthwise convolution the kernels handle (groups = input channels =
/// output channels ≥ 2, one input channel per filter, dilation 1), or `None`.
fn depthwise_geometry(
    x: [usize; 4],
    w: [usize; 4],
    options: &ConvOptions<2>,
) -> Option<Conv2dGeometry> {
    let channels = x[1];
    let depthwise = channels >= 2 && options.groups == channels && w[0] == channels && w[1] == 1;
    depthwise.then(|| spatial_geometry(x, w, options)).flatten()
}

/// Whether the kernels handle this (bias-free) depthwise convolution: `f32` tensors on flex.
pub(super) fn handles_depthwise(
    x: &Tensor<4>,
    weight: &Tensor<4>,
    options: &ConvOptions<2>,
) -> bool {
    x.dtype() == DType::F32
        && weight.dtype() == DType::F32
        && on_flex(x)
        && depthwise_geometry(x.dims(), weight.dims(), options).is_some()
}

/// Runs [`MobileKernelOps::fl_depthwise`] through Burn's dispatch.
pub(super) fn depthwise(x: Tensor<4>, weight: Tensor<4>, options: ConvOptions<2>) -> Tensor<4> {
    Tensor::from_dispatch(<Dispatch as MobileKernelOps>::fl_depthwise(
        x.into_dispatch(),
        weight.into_dispatch(),
        options,
    ))
}

/// Whether the fused activations handle this tensor: `f32` on flex.
pub(super) fn handles<const D: usize>(x: &Tensor<D>) -> bool {
    x.dtype() == DType::F32 && on_flex(x)
}

/// Runs [`MobileKernelOps::fl_add_activation`] through Burn's dispatch.
pub(super) fn add_activation<const D: usize>(
    a: Tensor<D>,
    b: Tensor<D>,
    act: Activation,
) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as MobileKernelOps>::fl_add_activation(
        a.into_dispatch(),
        b.into_dispatch(),
        act,
    ))
}

/// Whether the global average pooling handles this tensor: `f32` on flex, non-empty planes.
pub(super) fn handles_global_avg_pool(x: &Tensor<4>) -> bool {
    let [_, _, h, w] = x.dims();
    h * w > 0 && handles(x)
}

/// Runs [`MobileKernelOps::fl_global_avg_pool`] through Burn's dispatch.
pub(super) fn global_avg_pool(x: Tensor<4>) -> Tensor<4> {
    Tensor::from_dispatch(<Dispatch as MobileKernelOps>::fl_global_avg_pool(
        x.into_dispatch(),
    ))
}

/// Runs [`MobileKernelOps::fl_activation`] through Burn's dispatch.
pub(super) fn activation<const D: usize>(x: Tensor<D>, act: Activation) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as MobileKernelOps>::fl_activation(
        x.into_dispatch(),
        act,
    ))
}

fn geometry_of(x: &FlexTensor, weight: &FlexTensor, options: &ConvOptions<2>) -> Conv2dGeometry {
    depthwise_geometry(dims4(&x.shape()), dims4(&weight.shape()), options).expect(UNSUPPORTED)
}

impl MobileKernelOps for Flex {
    fn fl_depthwise(x: FlexTensor, weight: FlexTensor, options: ConvOptions<2>) -> FlexTensor {
        let g = geometry_of(&x, &weight, &options);
        let (x, weight) = (contiguous(x), contiguous(weight));
        let y = cpu::depthwise_forward(&g, slice(&x), slice(&weight));
        flex_tensor(y, [g.batch, g.c_out, g.output[0], g.output[1]])
    }

    fn fl_depthwise_x_backward(
        x: FlexTensor,
        weight: FlexTensor,
        grad: FlexTensor,
        options: ConvOptions<2>,
    ) -> FlexTensor {
        let g = geometry_of(&x, &weight, &options);
        let (weight, grad) = (contiguous(weight), contiguous(grad));
        let dx = cpu::depthwise_input_grad(&g, slice(&weight), slice(&grad));
        flex_tensor(dx, [g.batch, g.c_in, g.input[0], g.input[1]])
    }

    fn fl_depthwise_weight_backward(
        x: FlexTensor,
        weight: FlexTensor,
        grad: FlexTensor,
        options: ConvOptions<2>,
    ) -> FlexTensor {
        let g = geometry_of(&x, &weight, &options);
        let w_dims = dims4(&weight.shape());
        let (x, grad) = (contiguous(x), contiguous(grad));
        flex_tensor(
            cpu::depthwise_weight_grad(&g, slice(&x), slice(&grad)),
            w_dims,
        )
    }

    fn fl_activation(x: FlexTensor, act: Activation) -> FlexTensor {
        let mut x = contiguous(x);
        if let Some(values) = values_mut(&mut x) {
            cpu::activation_forward_in_place(act, values);
            return x;
        }
        let y = cpu::activation_forward(act, slice(&x));
        FlexTensor::from_data(TensorData::new(y, x.shape()))
    }

    fn fl_activation_backward(saved: FlexTensor, grad: FlexTensor, act: Activation) -> FlexTensor {
        let (saved, mut grad) = (contiguous(saved), contiguous(grad));
        if let Some(values) = values_mut(&mut grad) {
            cpu::activation_backward_in_place(act, slice(&saved), values);
            return grad;
        }
        let dx = cpu::activation_backward(act, slice(&saved), slice(&grad));
        FlexTensor::from_data(TensorData::new(dx, saved.shape()))
    }

    fn fl_add_activation(a: FlexTensor, b: FlexTensor, act: Activation) -> FlexTensor {
        let (mut a, b) = (contiguous(a), contiguous(b));
        if let Some(values) = values_mut(&mut a) {
            cpu::add_activation_in_place(act, values, slice(&b));
            return a;
        }
        let y = cpu::add_activation(act, slice(&a), slice(&b));
        FlexTensor::from_data(TensorData::new(y, a.shape()))
    }

    fn fl_global_avg_pool(x: FlexTensor) -> FlexTensor {
        let x = contiguous(x);
        let [n, c, h, w] = dims4(&x.shape());
        flex_tensor(cpu::global_avg_pool_forward(h * w, slice(&x)), [n, c, 1, 1])
    }

    fn fl_global_avg_pool_backward(grad: FlexTensor, [h, w]: [usize; 2]) -> FlexTensor {
        let grad = contiguous(grad);
        let [n, c, _, _] = dims4(&grad.shape());
        flex_tensor(
            cpu::global_avg_pool_backward(h * w, slice(&grad)),
            [n, c, h, w],
        )
    }
}

/// The depthwise convolution's autodiff node: parents (x, weight).
#[derive(Debug)]
struct DepthwiseBackward;

impl<B: Backend + MobileKernelOps> Backward<B, 2> for DepthwiseBackward {
    type State = (NodeId, NodeId, ConvOptions<2>);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (x, weight, options) = ops.state;
        let x = checkpointer.retrieve_node_output::<FloatTensor<B>>(x);
        let weight = checkpointer.retrieve_node_output::<FloatTensor<B>>(weight);
        let [node_x, node_weight] = ops.parents;
        if let Some(node) = node_x {
            let dx = B::fl_depthwise_x_backward(
                x.clone(),
                weight.clone(),
                grad.clone(),
                options.clone(),
            );
            grads.register::<B>(node.id, dx);
        }
        if let Some(node) = node_weight {
            let dw = B::fl_depthwise_weight_backward(x, weight, grad, options);
            grads.register::<B>(node.id, dw);
        }
    }
}

/// What an activation's backward pass reads: its input (checkpointed), or for ReLU and ReLU6
/// its output (as Burn's ReLU keeps it; the next layer holds that tensor anyway, so a
/// MobileNetV2 block's batch-norm outputs are freed after the forward pass).
#[derive(Debug, Clone)]
enum Saved<B: Backend> {
    Input(NodeId),
    Output(FloatTensor<B>),
}

#[derive(Debug)]
struct ActivationBackward;

impl<B: Backend + MobileKernelOps> Backward<B, 1> for ActivationBackward {
    type State = (Saved<B>, Activation);

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (saved, act) = ops.state;
        let [node_x] = ops.parents;
        if let Some(node) = node_x {
            let x = match saved {
                Saved::Input(x) => checkpointer.retrieve_node_output::<FloatTensor<B>>(x),
                Saved::Output(y) => y,
            };
            grads.register::<B>(node.id, B::fl_activation_backward(x, grad, act));
        }
    }
}

/// `act(a + b)`'s autodiff node: parents (a, b), state its output (for ReLU) and activation.
#[derive(Debug)]
struct AddActivationBackward;

impl<B: Backend + MobileKernelOps> Backward<B, 2> for AddActivationBackward {
    type State = (Option<FloatTensor<B>>, Activation);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let mut grad = grads.consume::<B>(&ops.node);
        // The activation's gradient from its output, then the addition's: the same tensor to
        // both operands.
        if let (Some(y), act) = ops.state {
            grad = B::fl_activation_backward(y, grad, act);
        }
        match ops.parents {
            [Some(a), Some(b)] => {
                grads.register::<B>(a.id, grad.clone());
                grads.register::<B>(b.id, grad);
            }
            [Some(node), None] | [None, Some(node)] => grads.register::<B>(node.id, grad),
            [None, None] => {}
        }
    }
}

/// Global average pooling's autodiff node: state the input's plane size.
#[derive(Debug)]
struct GlobalAvgPoolBackward;

impl<B: Backend + MobileKernelOps> Backward<B, 1> for GlobalAvgPoolBackward {
    type State = [usize; 2];

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let [Some(node)] = ops.parents {
            grads.register::<B>(node.id, B::fl_global_avg_pool_backward(grad, ops.state));
        }
    }
}

/// Autodiff: the forward pass runs on the inner backend and records a node whose backward pass
/// calls the gradient kernels. The gradient kernels themselves are not differentiable again.
impl<B: Backend + MobileKernelOps, C: CheckpointStrategy> MobileKernelOps for Autodiff<B, C> {
    fn fl_depthwise(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        match DepthwiseBackward
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
                let y = B::fl_depthwise(x.into_primitive(), weight.into_primitive(), options);
                prep.finish(state, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fl_depthwise(
                x.into_primitive(),
                weight.into_primitive(),
                options,
            )),
        }
    }

    fn fl_depthwise_x_backward(
        _x: FloatTensor<Self>,
        _weight: FloatTensor<Self>,
        _grad: FloatTensor<Self>,
        _options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        unimplemented!("second-order gradients of the flex depthwise kernels")
    }

    fn fl_depthwise_weight_backward(
        _x: FloatTensor<Self>,
        _weight: FloatTensor<Self>,
        _grad: FloatTensor<Self>,
        _options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        unimplemented!("second-order gradients of the flex depthwise kernels")
    }

    fn fl_activation(x: FloatTensor<Self>, act: Activation) -> FloatTensor<Self> {
        match ActivationBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) if act.backward_reads_output() => {
                let y = B::fl_activation(x.into_primitive(), act);
                prep.finish((Saved::Output(y.clone()), act), y)
            }
            OpsKind::Tracked(mut prep) => {
                let state = (Saved::Input(prep.checkpoint(&x)), act);
                prep.finish(state, B::fl_activation(x.into_primitive(), act))
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fl_activation(x.into_primitive(), act)),
        }
    }

    fn fl_activation_backward(
        _saved: FloatTensor<Self>,
        _grad: FloatTensor<Self>,
        _act: Activation,
    ) -> FloatTensor<Self> {
        unimplemented!("second-order gradients of the fused activations")
    }

    fn fl_add_activation(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        act: Activation,
    ) -> FloatTensor<Self> {
        assert!(
            matches!(act, Activation::Identity | Activation::Relu),
            "residual addition: identity or ReLU (their gradients read the output)"
        );
        match AddActivationBackward
            .prepare::<C>([a.node(), b.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = B::fl_add_activation(a.into_primitive(), b.into_primitive(), act);
                let saved = (act == Activation::Relu).then(|| y.clone());
                prep.finish((saved, act), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fl_add_activation(
                a.into_primitive(),
                b.into_primitive(),
                act,
            )),
        }
    }

    fn fl_global_avg_pool(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let [_, _, h, w] = dims4(&x.shape());
        match GlobalAvgPoolBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                prep.finish([h, w], B::fl_global_avg_pool(x.into_primitive()))
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fl_global_avg_pool(x.into_primitive())),
        }
    }

    fn fl_global_avg_pool_backward(
        _grad: FloatTensor<Self>,
        _input: [usize; 2],
    ) -> FloatTensor<Self> {
        unimplemented!("second-order gradients of the global average pooling")
    }
}
