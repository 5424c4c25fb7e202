//! Fully connected layers (`x · W + b`) on flex, bit for bit as Burn's, without its output copy.
//!
//! flex's matrix product allocates its output through `FlexTensor::empty`, which zero-fills a
//! byte vector and then copies it into a fresh 16-byte-aligned buffer. For the big FC layers
//! (CNN1–CNN4, the FedAvg CNN, VGG-16) that is two allocations, a copy and a wave of page faults
//! per product — and the copy *reads* untouched heap pages, so the next writer of that memory
//! takes a copy-on-write fault with a TLB shootdown across threads. Here the same `gemm` call
//! (same shapes, strides and parallelism as flex's) writes straight into a `Vec<f32>` that
//! becomes the tensor, so the values are Burn's bit for bit; the backward pass is Burn's
//! (`dx = dy · Wᵀ`, `dW = xᵀ · dy`, `db = Σ_rows dy`) with the two products done the same way.

use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::{
    Backend, Dispatch, Flex, TensorMetadata, backend_extension, tensor::FloatTensor,
};
use burn::tensor::{DType, Shape, Tensor, TensorData};
use burn_flex::FlexTensor;

use super::cpu;
use super::flex::{contiguous, on_flex, slice};

/// Fully connected layers for CPU backends, with Burn's backward pass.
#[backend_extension(Flex, Autodiff)]
pub trait LinearKernelOps: Backend {
    /// `x · weight + bias` for `x [rows, d_in]`, `weight [d_in, d_out]`, `bias [d_out]`.
    fn fl_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
    /// `lhs · rhs` of two matrices with any strides (the backward pass's products).
    fn fl_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// Whether the kernel handles this input, weight and bias: `f32` tensors on flex.
pub(super) fn handles(x: &Tensor<2>, weight: &Tensor<2>, bias: &Tensor<1>) -> bool {
    [x.dtype(), weight.dtype(), bias.dtype()] == [DType::F32; 3] && on_flex(x)
}

/// Runs [`LinearKernelOps::fl_linear`] through Burn's dispatch.
pub(super) fn linear(x: Tensor<2>, weight: Tensor<2>, bias: Tensor<1>) -> Tensor<2> {
    Tensor::from_dispatch(<Dispatch as LinearKernelOps>::fl_linear(
        x.into_dispatch(),
        weight.into_dispatch(),
        bias.into_dispatch(),
    ))
}

/// Products at least this large (m·n·k) run gemm on the thread pool: flex's threshold, so that
/// the call — and with it every bit of the result — is the one flex would make.
const PARALLEL_THRESHOLD: usize = 192 * 192 * 192;

/// A matrix operand as gemm reads it: the storage, the first element and the strides.
struct Operand<'a> {
    data: &'a [f32],
    start: usize,
    rows: usize,
    cols: usize,
    row_stride: isize,
    col_stride: isize,
}

impl<'a> Operand<'a> {
    /// The operand's view, or `None` where a stride is negative (the caller copies first).
    fn of(t: &'a FlexTensor) -> Option<Self> {
        let shape = t.shape();
        let layout = t.layout();
        let (rows, cols) = (shape[0], shape[1]);
        let strides = layout.strides();
        let (row_stride, col_stride) = (strides[0], strides[1]);
        if row_stride < 0 || col_stride < 0 {
            return None;
        }
        let data = t.storage::<f32>();
        let start = layout.start_offset();
        // Every element gemm reads lies in the storage: the safety argument of `matmul`.
        let last = start
            + rows.saturating_sub(1) * row_stride as usize
            + cols.saturating_sub(1) * col_stride as usize;
        assert!(
            rows == 0 || cols == 0 || last < data.len(),
            "linear kernel: a strided operand outside its storage"
        );
        Some(Operand {
            data,
            start,
            rows,
            cols,
            row_stride,
            col_stride,
        })
    }
}

/// A matrix as a gemm operand, copied to contiguous memory only if its strides are negative.
fn operand(t: FlexTensor) -> FlexTensor {
    if Operand::of(&t).is_some() {
        t
    } else {
        contiguous(t)
    }
}

/// `lhs · rhs` into a new row-major buffer, with the `gemm` call flex's `matmul` makes.
fn matmul(lhs: &FlexTensor, rhs: &FlexTensor) -> Vec<f32> {
    let (a, b) = (
        Operand::of(lhs).expect("linear kernel: operands pass through `operand` first"),
        Operand::of(rhs).expect("linear kernel: operands pass through `operand` first"),
    );
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(k, b.rows, "linear kernel: inner dimensions must match");
    // `dy · Wᵀ` (the input gradient): the weight read in place instead of packed by gemm.
    if a.col_stride == 1 && b.row_stride == 1 && cpu::dense::applies(m, n, k) {
        return cpu::dense::input_grad(
            (&a.data[a.start..], a.row_stride as usize),
            (&b.data[b.start..], b.col_stride as usize),
            [m, n, k],
        );
    }
    if m == 0 || n == 0 || k == 0 {
        return cpu::par_zeroed(m * n);
    }
    // gemm writes every element of its output (`read_dst` false: the first depth block stores,
    // the later ones add onto it), so the buffer is not zeroed first: a pass over the whole
    // product's memory, 64 MiB for VGG-16's 4096 × 4096 weight gradient.
    let parallelism = if m.saturating_mul(n).saturating_mul(k) >= PARALLEL_THRESHOLD {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: `Operand::of` checked that every element the strides reach lies in its storage;
    // `out` holds m·n elements written with row stride n, the operands do not alias it, and
    // with `read_dst` false gemm writes each of them before any read.
    unsafe {
        cpu::written_whole(m * n, |out| {
            gemm::gemm(
                m,
                n,
                k,
                out.as_mut_ptr().cast::<f32>(),
                1,
                n as isize,
                false,
                a.data.as_ptr().add(a.start),
                a.col_stride,
                a.row_stride,
                b.data.as_ptr().add(b.start),
                b.col_stride,
                b.row_stride,
                0.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            )
        })
    }
}

impl LinearKernelOps for Flex {
    fn fl_linear(x: FlexTensor, weight: FlexTensor, bias: FlexTensor) -> FlexTensor {
        let (x, weight, bias) = (operand(x), operand(weight), contiguous(bias));
        let (rows, d_out) = (x.shape()[0], weight.shape()[1]);
        let mut y = matmul(&x, &weight);
        // flex adds the broadcast bias as `y + b`, one rounding per element: the same value.
        let b = slice(&bias);
        assert_eq!(b.len(), d_out, "linear kernel: bias length");
        if d_out > 0 {
            for row in y.chunks_exact_mut(d_out) {
                row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
            }
        }
        FlexTensor::from_data(TensorData::new(y, [rows, d_out]))
    }

    fn fl_matmul(lhs: FlexTensor, rhs: FlexTensor) -> FlexTensor {
        let (lhs, rhs) = (operand(lhs), operand(rhs));
        let shape = [lhs.shape()[0], rhs.shape()[1]];
        FlexTensor::from_data(TensorData::new(matmul(&lhs, &rhs), shape))
    }
}

/// The layer's autodiff node: parents (x, weight, bias); each of x and the weight is kept only
/// if the other one takes a gradient, as Burn's linear node does.
#[derive(Debug)]
struct LinearBackward;

impl<B: Backend + LinearKernelOps> Backward<B, 3> for LinearBackward {
    type State = (Option<NodeId>, Option<NodeId>);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_x, node_weight, node_bias] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, weight) = ops.state;
        let x = x.map(|id| checkpointer.retrieve_node_output::<FloatTensor<B>>(id));
        let weight = weight.map(|id| checkpointer.retrieve_node_output::<FloatTensor<B>>(id));
        if let Some(node) = node_x {
            let weight = weight.expect("kept when x is tracked");
            let dx = B::fl_matmul(grad.clone(), B::float_swap_dims(weight, 0, 1));
            grads.register::<B>(node.id, dx);
        }
        if let Some(node) = node_weight {
            let x = x.expect("kept when the weight is tracked");
            let dw = B::fl_matmul(B::float_swap_dims(x, 0, 1), grad.clone());
            grads.register::<B>(node.id, dw);
        }
        if let Some(node) = node_bias {
            let d_out = grad.shape()[1];
            let db = B::float_reshape(B::float_sum_dim(grad, 0), Shape::new([d_out]));
            grads.register::<B>(node.id, db);
        }
    }
}

/// Autodiff: the forward pass runs on the inner backend and records a [`LinearBackward`] node.
impl<B: Backend + LinearKernelOps, C: CheckpointStrategy> LinearKernelOps for Autodiff<B, C> {
    fn fl_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let (x_tracked, weight_tracked) = (x.is_tracked(), weight.is_tracked());
        match LinearBackward
            .prepare::<C>([x.node(), weight.node(), bias.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let x_state = weight_tracked.then(|| prep.checkpoint(&x));
                let weight_state = x_tracked.then(|| prep.checkpoint(&weight));
                let y = B::fl_linear(
                    x.into_primitive(),
                    weight.into_primitive(),
                    bias.into_primitive(),
                );
                prep.finish((x_state, weight_state), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fl_linear(
                x.into_primitive(),
                weight.into_primitive(),
                bias.into_primitive(),
            )),
        }
    }

    fn fl_matmul(_lhs: FloatTensor<Self>, _rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        unimplemented!("second-order gradients of the flex linear kernel")
    }
}
