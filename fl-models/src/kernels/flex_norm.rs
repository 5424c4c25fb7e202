//! Batch normalisation through Burn's dispatch, and its autodiff nodes: the training node's
//! backward pass, and the retro-forward that recomputes its output under gradient checkpointing.

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::{
    base::Checkpointer, retro_forward::RetroForward, state::BackwardStates,
};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::{Backend, Dispatch, TensorMetadata, tensor::FloatTensor};
use burn::tensor::{DType, Tensor};
use burn_flex::FlexTensor;

use super::Activation;
use super::cpu::NormGeometry;
use super::flex::{CpuKernelOps, dims4, on_flex};

/// Whether the kernels handle this batch normalisation: a 4-D `f32` tensor on flex.
pub(super) fn handles_batch_norm(x: &Tensor<4>, gamma: &Tensor<1>) -> bool {
    x.dtype() == DType::F32 && gamma.dtype() == DType::F32 && on_flex(x)
}

/// Runs [`CpuKernelOps::fl_batch_norm_train`] through Burn's dispatch: (output, mean, variance).
pub(super) fn batch_norm_train(
    x: Tensor<4>,
    gamma: Tensor<1>,
    beta: Tensor<1>,
    epsilon: f64,
    act: Activation,
) -> (Tensor<4>, Tensor<1>, Tensor<1>) {
    let (y, mean, var) = <Dispatch as CpuKernelOps>::fl_batch_norm_train(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        epsilon,
        act,
    );
    (
        Tensor::from_dispatch(y),
        Tensor::from_dispatch(mean),
        Tensor::from_dispatch(var),
    )
}

/// Runs [`CpuKernelOps::fl_batch_norm_inference`] through Burn's dispatch. Gradients reach `x`
/// only: the caller checks that γ and β take none.
pub(super) fn batch_norm_inference(
    x: Tensor<4>,
    (gamma, beta): (Tensor<1>, Tensor<1>),
    (mean, std): (Tensor<1>, Tensor<1>),
    act: Activation,
) -> Tensor<4> {
    Tensor::from_dispatch(<Dispatch as CpuKernelOps>::fl_batch_norm_inference(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        mean.into_dispatch(),
        std.into_dispatch(),
        act,
    ))
}

pub(super) fn norm_geometry(x: &FlexTensor) -> NormGeometry {
    let [batch, channels, h, w] = dims4(&x.shape());
    NormGeometry {
        batch,
        channels,
        plane: h * w,
    }
}

/// A training batch norm's autodiff node: parents (x, γ, β).
#[derive(Debug)]
pub(super) struct BatchNormTrainBackward;

impl<B: Backend + CpuKernelOps> Backward<B, 3> for BatchNormTrainBackward {
    // x, γ and β are checkpointed; the batch statistics come along as the forward computed them.
    type State = ([NodeId; 3], FloatTensor<B>, FloatTensor<B>, f64, Activation);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (nodes, mean, variance, epsilon, act) = ops.state;
        let [x, gamma, beta] =
            nodes.map(|node| checkpointer.retrieve_node_output::<FloatTensor<B>>(node));
        let (dx, d_gamma, d_beta) =
            B::fl_batch_norm_train_backward(x, gamma, beta, mean, variance, epsilon, act, grad);
        let [node_x, node_gamma, node_beta] = ops.parents;
        for (node, grad) in [(node_x, dx), (node_gamma, d_gamma), (node_beta, d_beta)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// Recomputes a training batch norm's output from its input, γ and β and the statistics the
/// forward pass computed (the same bits: the same coefficients and pass).
#[derive(Debug)]
pub(super) struct RetroBatchNorm<B: Backend> {
    /// The nodes of x, γ and β.
    pub(super) nodes: [NodeId; 3],
    /// The batch mean and (biased) variance.
    pub(super) stats: (FloatTensor<B>, FloatTensor<B>),
    pub(super) epsilon: f64,
    pub(super) act: Activation,
}

impl<B: Backend + CpuKernelOps> RetroForward for RetroBatchNorm<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let [x, gamma, beta] = self
            .nodes
            .map(|node| states.get_state::<FloatTensor<B>>(&node));
        let (mean, var) = self.stats.clone();
        let y = B::fl_batch_norm_train_output(x, gamma, beta, mean, var, self.epsilon, self.act);
        states.save(out_node, y);
    }
}

/// An inference batch norm's autodiff node (frozen layers): parent x.
#[derive(Debug)]
pub(super) struct BatchNormInferenceBackward;

impl<B: Backend + CpuKernelOps> Backward<B, 1> for BatchNormInferenceBackward {
    // γ and the standard deviations, constants of the node.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (gamma, std) = ops.state;
        let [node_x] = ops.parents;
        if let Some(node) = node_x {
            let dx = B::fl_batch_norm_inference_backward(gamma, std, grad);
            grads.register::<B>(node.id, dx);
        }
    }
}
